// ModelConfig: the shape of a Llama-family model, read from a HuggingFace
// `config.json` (or taken from a built-in preset), validated once at start-up.
//
// Parsing is lenient about keys it does not use (HF files carry dozens:
// bos_token_id, torch_dtype, quantization_config, ...) and strict about the
// ones it does: a wrong type is an error, not a default. Errors name the
// source (file name) and the key.
//
// Plain value type; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "comm/status.h"

namespace tpserve {

// How RoPE's per-pair frequencies are scaled for a longer context: HF's rope_scaling (or
// transformers 5's rope_parameters) "rope_type". Only the kinds Llama checkpoints use.
enum class RopeType {
  kDefault,  // plain RoPE ("default", or no rope_scaling at all)
  kLinear,   // "linear": every inverse frequency divided by factor (position interpolation)
  kLlama3,   // "llama3" (Llama 3.1 and later): low frequencies divided by factor, high ones
             // kept, a smooth blend between (RopeInverseFrequencies)
};
// "default", "linear", "llama3": the json spelling.
const char* RopeTypeName(RopeType type);

// RoPE scaling and its parameters. A field the type does not read keeps its default, so
// configs that mean the same compare equal.
struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;                              // linear, llama3: positive, finite
  double low_freq_factor = 1.0;                     // llama3: positive, finite
  double high_freq_factor = 4.0;                    // llama3: positive, finite, > low_freq_factor
  int64_t original_max_position_embeddings = 8192;  // llama3: >= 1 (the pre-training context)

  friend bool operator==(const RopeScaling&, const RopeScaling&) = default;
};

struct ModelConfig {
  // Preset name, or the directory the config.json came from (the `source`
  // given to ParseModelConfigJson when parsed from text).
  std::string name;

  int64_t hidden_size = 0;          // model width (residual stream)
  int64_t intermediate_size = 0;    // MLP width (gate and up each have this many columns)
  int64_t num_attention_heads = 0;  // query heads
  int64_t num_key_value_heads = 0;  // K/V heads (grouped-query attention); == query heads for MHA
  int64_t num_hidden_layers = 0;    // transformer blocks
  int64_t vocab_size = 0;           // embedding rows and LM-head columns

  double rms_norm_eps = 1e-5;              // epsilon inside every RMSNorm
  double rope_theta = 500000.0;            // RoPE base (Llama 3: 500000, Llama 2: 10000)
  RopeScaling rope_scaling;                // default: plain RoPE
  int64_t max_position_embeddings = 8192;  // longest sequence the model supports
  // The LM head is the embedding table (the checkpoint needs no lm_head.weight).
  bool tie_word_embeddings = false;

  // Per-head width: hidden_size / num_attention_heads unless the json gives
  // "head_dim" (stored in head_dim_override).
  int64_t head_dim() const;
  // 0 = derived from hidden_size / num_attention_heads. A json head_dim equal
  // to the derived value is stored as 0, so such files compare equal to the
  // ones that leave it out.
  int64_t head_dim_override = 0;

  // Model-only checks: positive sizes, attention heads divide hidden_size
  // (unless head_dim is given), attention heads a multiple of KV heads, even
  // head_dim (RoPE rotates pairs), vocab_size fits the int32 token ids,
  // positive eps / theta, rope_scaling's parameters as RopeScaling states
  // (named rope_scaling.<key>). INVALID_ARGUMENT naming the field and its value.
  Status Validate() const;

  // Validate() plus the divisibility that a TP degree of `tp` needs: query
  // heads, KV heads (KV-head replication for tp > num_key_value_heads is not
  // supported yet), intermediate_size and vocab_size divisible by tp.
  // INVALID_ARGUMENT naming the field, its value and tp.
  Status ValidateForTp(int tp) const;

  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// Parses the text of a HuggingFace Llama config.json. `source` names the
// text in errors and becomes ModelConfig::name.
//   required: hidden_size, intermediate_size, num_attention_heads,
//             num_hidden_layers, vocab_size (integers)
//   optional, with HF LlamaConfig's defaults: num_key_value_heads
//             (num_attention_heads), rms_norm_eps (1e-6), rope_theta (10000),
//             max_position_embeddings (2048), head_dim (derived),
//             tie_word_embeddings (false); a JSON null means "absent", as in HF
//   RoPE, in either of HF's spellings (both may be given if they agree):
//             rope_scaling {rope_type (or type), parameters} next to a
//             top-level rope_theta (transformers 4, most published files), or
//             rope_parameters {rope_type (or type), rope_theta, parameters}
//             (transformers 5; its rope_type may be left out: default).
//             rope_type "default" (or rope_scaling null): plain RoPE;
//             "linear": factor; "llama3": factor, low_freq_factor,
//             high_freq_factor, original_max_position_embeddings (all
//             required). A key the type does not read is refused
//             (UNIMPLEMENTED), as is any other rope_type (yarn, dynamic,
//             longrope, ...), naming the key and its value.
//   checked if present: model_type must be "llama"; hidden_act must be
//             "silu"; attention_bias and mlp_bias must be false
//   everything else: ignored.
// Errors: INVALID_ARGUMENT (syntax, missing key, wrong type, unsupported
// model_type, RoPE parameters out of range, rope_theta / rope_scaling and
// rope_parameters that disagree, failed Validate()), UNIMPLEMENTED (a RoPE
// type or key, hidden_act, biases).
StatusOr<ModelConfig> ParseModelConfigJson(std::string_view json_text, const std::string& source);

// Reads and parses `path`: a config.json file, or a model directory holding
// one. ModelConfig::name is the directory. NOT_FOUND naming the path when
// there is no such file.
StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// HF-style config.json text ("model_type": "llama", "architectures":
// ["LlamaForCausalLM"], ...) that ParseModelConfigJson reads back to an equal
// config (name aside: that comes from the source).
std::string ModelConfigToJson(const ModelConfig& config);

// RoPE's inverse frequencies, [head_dim / 2] in double: pair i (elements i and
// i + head_dim/2 of a head) is rotated by the angle position * inv_freq[i].
// Plain: theta^(-2i / head_dim). Scaled, as transformers defines the kinds:
//   linear: plain / factor (positions in effect divided by factor);
//   llama3: with wavelen = 2 pi / plain, low = original_max / low_freq_factor
//     and high = original_max / high_freq_factor (wavelengths):
//     wavelen > low: plain / factor; wavelen < high: plain; otherwise the
//     blend (1 - s) * plain / factor + s * plain with
//     s = (original_max / wavelen - low_freq_factor) /
//         (high_freq_factor - low_freq_factor).
// Preconditions: theta > 0, head_dim even >= 2, the scaling valid (as
// ModelConfig::Validate checks); the config overload: a valid config.
std::vector<double> RopeInverseFrequencies(double theta, int64_t head_dim,
                                           const RopeScaling& scaling);
std::vector<double> RopeInverseFrequencies(const ModelConfig& config);

// Built-in shapes for tests and benchmarks with random weights:
//   "tiny"       512 hidden, 512 inter, 8 heads of 64, 4 KV heads, 2 layers, 1024 vocab
//   "llama3-8b"  Meta-Llama-3-8B
//   "llama3-70b" Meta-Llama-3-70B
// NOT_FOUND listing the presets for any other name.
StatusOr<ModelConfig> ModelPreset(std::string_view name);
std::vector<std::string> ModelPresetNames();

}  // namespace tpserve
