// FP8 scale schemes of a checkpoint's linear layers (layers/fp8.h's Fp8Scheme): reading and
// checking the scale tensors, what config.json's quantization_config declares, fusing the
// parts of a fused projection, and the fold the CUDA engine applies at tp > 1, where its layers
// take one scale per tensor.
//
// Layouts read (the weight is [rows, cols] = [out, in]):
//   per tensor   `weight_scale` [] or [1] (ModelOpt quant_algo FP8, compressed-tensors
//                strategy "tensor"), with an optional static per-tensor `input_scale`.
//   per channel  `weight_scale` [rows] or [rows, 1] (compressed-tensors strategy "channel",
//                fbgemm_fp8 rowwise): activations are then scaled per token at run time.
//   block        `weight_scale_inv` [ceil(rows/128), ceil(cols/128)] (HF fine-grained FP8,
//                quantization_config.weight_block_size [128, 128]; compressed-tensors
//                strategy "block"): activations in 1x128 groups scaled at run time.
// Despite its name, weight_scale_inv is a dequantization scale (real = fp8 * scale), as
// every writer of that layout uses it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/status.h"
#include "engine/kv_cache.h"
#include "engine/model_weights.h"
#include "engine/safetensors.h"
#include "layers/fp8.h"

namespace tpserve {

// What config.json's quantization_config says about the linear layers' weights.
struct Fp8QuantConfig {
  // The weights' scheme it declares; nullopt when it declares none (no quantization_config,
  // or groups of different strategies): then each layer's scale tensor decides alone.
  std::optional<Fp8Scheme> weights;
  // compressed-tensors' input_activations.dynamic is false: the writer calibrated static
  // activation scales. Per-channel and block layers scale their inputs per token / per 1x128
  // group at run time anyway (what the GEMM takes with those weights); the loader says so.
  bool static_activations = false;
  std::string where;  // "<file>: quantization_config", for messages
};

// Reads `config_json`'s quantization_config (a missing file or key declares nothing).
// Understood: compressed-tensors (config_groups.*.weights.strategy tensor/channel/block,
// block_structure [128, 128]), ModelOpt (quant_algo FP8, FP8_PER_CHANNEL_PER_TOKEN,
// FP8_BLOCK_SCALES), fbgemm_fp8 (channel), fp8 with weight_block_size (block). Errors name
// the file and key: UNIMPLEMENTED for a block size other than 128x128 or another strategy.
StatusOr<Fp8QuantConfig> ReadFp8QuantConfig(const std::string& config_json);

// The quantization_config object make-checkpoint writes for `scheme` (JSON text); empty for
// per-tensor, whose ModelOpt-style checkpoints carry none.
std::string Fp8QuantConfigJson(Fp8Scheme scheme);

// An FP8 weight's scales as stored, for the whole [rows, cols] tensor.
struct WeightScales {
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  std::vector<float> values;  // 1, rows, or the block grid (row-major)
  int64_t rows = 0, cols = 0;
  float At(int64_t r, int64_t c) const { return values[Fp8WeightScaleIndex(scheme, cols, r, c)]; }
};

// Reads the scale tensor `v` of a [rows, cols] FP8 weight: `block` for a weight_scale_inv,
// otherwise a weight_scale (per tensor or per channel by its shape). INVALID_ARGUMENT naming
// `where` (the checkpoint file and tensor) for a shape that fits no layout, a dtype other
// than F32/BF16, or a value that is not a positive finite number; and when `declared`
// declares another scheme than the tensor has.
StatusOr<WeightScales> ReadWeightScales(const TensorView& v, const std::string& where, bool block,
                                        int64_t rows, int64_t cols, const Fp8QuantConfig& declared);

// A static input_scale: one positive finite value ([] or [1]), F32 or BF16.
StatusOr<float> ReadInputScale(const TensorView& v, const std::string& where);

// A layer's KV cache scale (k_scale, v_scale or kv_scale): one positive finite value ([] or
// [1]), F32 or BF16; INVALID_ARGUMENT naming `where` otherwise (per-head scales are refused:
// the cache takes one scale a layer for keys and one for values).
StatusOr<float> ReadKvCacheScale(const TensorView& v, const std::string& where);

// The KV cache scales (LayerWeights::kv_scales) of the layer whose tensors start with
// `layer_prefix` ("model.layers.3"), in whichever spelling the checkpoint uses:
// self_attn.k_scale / v_scale (compressed-tensors), self_attn.k_proj.k_scale / v_proj.v_scale
// (ModelOpt), self_attn.kv_scale (one for both); 1 where it has none. `find` looks a tensor up
// (null: absent), `where` names it with its file for messages. INVALID_ARGUMENT naming both
// tensors when the checkpoint holds two for the keys or the values, and ReadKvCacheScale's.
StatusOr<KvScales> ReadKvScales(const std::function<const TensorView*(const std::string&)>& find,
                                const std::function<std::string(const std::string&)>& where,
                                const std::string& layer_prefix);

// Rows [row_begin, row_end) and columns [col_begin, col_end) of one checkpoint weight,
// dequantized, with the scales this rank's FP8 weight is to keep.
struct LinearPart {
  std::vector<float> values;  // rows x cols
  int64_t rows = 0, cols = 0;
  int64_t row_begin = 0, col_begin = 0;  // in the checkpoint's tensor
  std::string where;                     // its scale tensor (or weight), for messages
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  // Per tensor: the whole tensor's scale (the checkpoint's, or its amax over 448 for a
  // BF16/F32 weight), the same on every rank so that shards quantize alike whatever the TP
  // size. Per channel / block: the largest of the tensor's scales.
  float scale = 1.0f;
  // Per channel: this part's rows' scales. Block: its grid [ceil(rows/128), ceil(cols/128)];
  // row_begin and col_begin are then multiples of 128.
  std::vector<float> scales;
  // Without a checkpoint input_scale: activations up to 8 in magnitude keep E4M3's
  // resolution (RMSNorm, attention and SwiGLU outputs of Llama-scale models sit inside).
  float input_scale = 8.0f / kFp8E4M3Max;
  bool has_input_scale = false;  // the checkpoint's own (static) input_scale
};

// Takes the scales of `ws` for `part`'s rows and columns (part.rows/cols/row_begin/col_begin
// set). A block part must start on 128-row and 128-column boundaries of the tensor (and end
// on one or at its edge): otherwise INVALID_ARGUMENT naming the tensor and `tp`, since a
// rank's GEMM cannot take a 128x128 block that straddles ranks.
Status TakeScales(const WeightScales& ws, int tp, LinearPart* part);

// Stacks parts along rows into one LinearWeight of `dtype`. BF16: the values rounded.
// FP8, by the finest scheme among the parts: per tensor, the largest part scale (a part with
// it keeps its codes, the others are requantized); per channel, each row keeps its scale (a
// per-tensor part's scale repeats for its rows, which is exact); block, the grids stacked (all
// parts block-wise, each but the last a multiple of 128 rows, else INVALID_ARGUMENT naming
// the part and `tp`). Per channel and block take dynamic activation scales (per token, per
// 1x128 group): dynamic_input is set and input_scale unused.
StatusOr<LinearWeight> FuseParts(const std::vector<LinearPart>& parts, DataType dtype, int tp);

}  // namespace tpserve
