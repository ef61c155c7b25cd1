// What FP8 costs a model's output: tpserve's logits under each FP8 scale scheme (layers/fp8.h:
// Fp8Scheme) against the same model with BF16 weights and activations, at every position of a
// few prompts, on the CPU reference backend (engine/cpu_model.h) or any backend a caller plugs in
// (AccuracyOptions::logits; tpserve-accuracy --backend cuda: the CUDA engine). The library of
// tpserve-accuracy (benchmarks/accuracy.cc); tests/accuracy_eval_test.cc checks it on a
// transformers-made checkpoint.
//
// The FP8 model is made in memory from a BF16 checkpoint the way a checkpoint producer makes
// one (QuantizeWeightsFp8: scale = amax / 448 over what it covers, E4M3 codes rounded to
// nearest): one scale per weight tensor, per output channel (row) or per 128x128 block. The
// four TP layers of each block are quantized; embedding, norms and LM head stay as the
// engine keeps them (BF16 / FP32) under every scheme. Activations are scaled at run time as
// the engine scales them for such a checkpoint: per tensor from the layer input's amax over
// the batch (a BF16 or uncalibrated checkpoint has no static input_scale); per token for
// per-channel weights; per 1x128 group for block weights.
//
// Quantization happens on the fused tensors the engine runs ([q; k; v] and [gate; up] stacked
// along rows, at TP 1). That is the producer's per-projection quantization exactly for per
// channel; for per tensor it is what the loader makes of per-projection scales (FuseParts
// takes the largest, which is the fused tensor's amax / 448); block grids coincide with the
// producer's whenever every projection has a multiple of 128 rows (all Llama shapes; tiny
// test models may have blocks that straddle two projections).
//
// TP 1 only: the logits do not depend on the TP size by construction (per-tensor scales are
// the whole tensor's and the whole input's on every rank; the finer schemes are local to a
// row / block), and the engine's tests hold TP > 1 to TP 1.
//
// Each prompt runs as its own batch (a per-tensor activation scale is then one prompt's
// prefill); the logits of every position come from one pass (CpuModel::ForwardAllTokens).
// Thread-compatible; nothing here keeps state between calls.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "comm/status.h"
#include "engine/kv_calibration.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "layers/fp8.h"

namespace tpserve {

// The FP8 model under `scheme` made from `bf16` (a TP-1 RankWeights with BF16 TP layers, as
// LoadRankWeights(dir, config, 1, 0, DataType::kBFloat16) gives it): every TP layer's
// weight quantized as described above, with dynamic activation scaling. INVALID_ARGUMENT for
// weights that are not BF16 or not TP 1, or a non-finite weight (naming the layer).
StatusOr<RankWeights> QuantizeModelFp8(const RankWeights& bf16, Fp8Scheme scheme);

// Gives `bf16` (TP 1, BF16, the fused layout of engine/model_weights.h) outlier channels of
// magnitude 2^exponent without changing what the BF16 model computes: in every layer the V
// rows of KV head 0 are multiplied by 2^exponent and the o_proj input columns of the query
// heads that read that KV head by 2^-exponent (attention is linear in V). Powers of two are
// exact in BF16 and commute with its rounding, so the BF16 logits stay the same bit for bit;
// the FP8 schemes see what trained models have: output channels of a weight far above the
// rest (qkv), input channels of an activation far above the rest (o's input) and weight
// columns far below (o). Why: E4M3 spans 2^17, so on weights and activations without such
// outliers one scale per tensor loses almost nothing to the finer schemes (only rounding
// noise differs); this shows what each scheme keeps when outliers are there. exponent 0
// changes nothing. INVALID_ARGUMENT for |exponent| > 30 or weights not TP-1 BF16.
Status AddOutlierChannels(const ModelConfig& config, int exponent, RankWeights* bf16);

// Logits of every position of every prompt, [sum of prompt lengths, vocab] row-major, prompt
// after prompt, each prompt its own batch. `progress` (may be empty) is called after each
// prompt with the prompts done. Errors: the model's (a prompt too long, a token outside the
// vocabulary, weights that do not fit `config`), naming the prompt.
StatusOr<std::vector<float>> PromptLogits(
    const ModelConfig& config, const RankWeights& weights, const Prompts& prompts,
    const std::function<void(size_t done)>& progress = nullptr);

// How far `test` logits land from `ref` logits, both [positions, vocab] row-major.
struct LogitsDivergence {
  int64_t positions = 0;
  // KL(P_ref || P_test) per position in nats, softmax and sums in double; a position's
  // value below 0 (rounding, for nearly equal distributions) counts as 0.
  double mean_kl = 0;
  double max_kl = 0;
  int64_t max_kl_position = 0;  // the row of max_kl
  int64_t top1_agree = 0;       // positions whose argmax (first on ties) is the same
  double top1_agreement = 0;    // top1_agree / positions
  // ||test - ref|| / ||ref||, Frobenius norms over all positions.
  double rel_err = 0;
};

// INVALID_ARGUMENT when the sizes differ or are not a positive multiple of vocab, or when a
// logit is not finite (naming the position and which side).
StatusOr<LogitsDivergence> CompareLogits(std::span<const float> ref, std::span<const float> test,
                                         int64_t vocab);

// DefaultPrompts and ReadPrompts: engine/kv_calibration.h.

// What the weights and activations of `scheme` are scaled by, for tables.
const char* Fp8SchemeWeightsText(Fp8Scheme scheme);
const char* Fp8SchemeActivationsText(Fp8Scheme scheme);

// How a run computes logits: PromptLogits's signature and contract (every position of every
// prompt, [sum of prompt lengths, vocab]).
using PromptLogitsFn = std::function<StatusOr<std::vector<float>>(
    const ModelConfig& config, const RankWeights& weights, const Prompts& prompts,
    const std::function<void(size_t done)>& progress)>;

struct AccuracyOptions {
  // The backend every model of the run (the BF16 reference and each scheme) goes through, and
  // its name for the report. Default: PromptLogits, the CPU reference.
  PromptLogitsFn logits;
  std::string backend = "CPU reference backend (engine/cpu_model.h), tp 1";
  std::string model_dir;  // HF layout: config.json and *.safetensors with BF16 (or F32) weights
  Prompts prompts;
  std::string prompts_source;  // for the report: a file, or how they were drawn
  std::vector<Fp8Scheme> schemes = {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel,
                                    Fp8Scheme::kBlock};
  // AddOutlierChannels's exponent applied to the loaded BF16 model (0: the checkpoint as is).
  int outlier_exponent = 0;
  // Not empty: the FP8 models' KV cache scales (LayerWeights::kv_scales) calibrated on these
  // prompts (engine/kv_calibration.h's CalibrateKvAbsMax on the BF16 model, outliers included,
  // then KvScalesForAbsMax),
  // as a checkpoint's k_scale / v_scale would be; empty: 1. They reach the logits only where
  // K and V are quantized (the CUDA engine's E4M3 attention).
  Prompts kv_calibration;
  std::string kv_calibration_source;  // for the report
  // Called with a line of progress (may be empty).
  std::function<void(const std::string&)> progress;
};

struct SchemeAccuracy {
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  LogitsDivergence divergence;
  double seconds = 0;  // the scheme's quantization and forward passes
};

struct AccuracyReport {
  std::string backend;  // AccuracyOptions::backend
  std::string model_dir;
  ModelConfig config;
  std::string prompts_source;
  int outlier_exponent = 0;
  // "1", or how the KV cache scales were calibrated, and the scales, one pair a layer.
  std::string kv_scales = "1";
  std::vector<KvScales> kv_scale_values;
  std::vector<int64_t> prompt_lengths;
  int64_t positions = 0;
  double reference_seconds = 0;  // the BF16 model's forward passes
  std::vector<SchemeAccuracy> schemes;
};

// Loads the model (BF16), runs the reference and every scheme, compares. Errors name the
// file and tensor: NOT_FOUND / INVALID_ARGUMENT from the loader; INVALID_ARGUMENT when the
// checkpoint is already quantized (an FP8 linear weight or a quantization_config: this tool
// quantizes BF16 weights itself); the prompts' errors.
StatusOr<AccuracyReport> RunAccuracy(const AccuracyOptions& options);

// The report as JSON text (`commit` recorded in meta), as a Markdown section (a heading, the
// model and prompts, the table), and as an aligned plain-text table for a console.
std::string AccuracyJson(const AccuracyReport& report, const std::string& commit);
std::string AccuracyMarkdown(const AccuracyReport& report);
std::string AccuracyConsoleTable(const AccuracyReport& report);

}  // namespace tpserve
