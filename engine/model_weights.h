// One rank's shard of a Llama-family model's weights, laid out as the TP
// layers take them:
//   attn.qkv   column-parallel, [q | k | v] rows of this rank's heads   [(nh + 2 nkv)/tp * hd, H]
//   attn.o     row-parallel, this rank's head columns                   [H, nh/tp * hd]
//   mlp.gate_up column-parallel, [gate | up] rows                       [2 I/tp, H]
//   mlp.down   row-parallel, this rank's intermediate columns           [H, I/tp]
//   lm_head    column-parallel over the vocabulary, BF16                [V/tp, H]
// Sources: random from a seed (every rank draws the same full tensors and
// keeps its shard), or a HuggingFace-style safetensors checkpoint with FP8
// `weight` + scales per linear layer, as NVIDIA ModelOpt, compressed-tensors,
// fbgemm_fp8 and HF's fine-grained FP8 write them, or BF16 `weight`s
// (quantized on load, per tensor). The scale scheme (layers/fp8.h:
// Fp8Scheme) comes from the scale tensors, checked against config.json's
// quantization_config (engine/fp8_checkpoint_scales.h): per tensor
// (`weight_scale` [] or [1], optional static per-tensor `input_scale`;
// without one the layer's FP8 input is scaled per batch from its amax,
// dynamic_input), per output channel (`weight_scale` [N] or [N,1]; inputs
// scaled per token at run time) or 128x128 blocks (`weight_scale_inv`;
// inputs scaled per 1x128 group at run time). Sharding splits the scale
// vector or grid with the weight.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/dtype.h"
#include "comm/status.h"
#include "engine/kv_cache.h"
#include "engine/model_config.h"
#include "layers/fp8.h"

namespace tpserve {

struct LinearWeight {
  DataType dtype = DataType::kFloat8E4M3;  // kFloat8E4M3 or kBFloat16
  int64_t n = 0, k = 0;                    // this rank's [n, k]
  std::vector<uint8_t> data;               // row-major elements of dtype
  // FP8: how the weight is scaled. kPerTensor: weight_scale. kPerChannel:
  // weight_scales[n], one per output row. kBlock: weight_scales, the grid
  // [ceil(n/128), ceil(k/128)] row-major of this rank's [n, k] (its blocks
  // are the checkpoint's: shards start on 128 boundaries). The finer schemes
  // scale their input dynamically per token / per 1x128 group (dynamic_input
  // is set, input_scale unused).
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  std::vector<float> weight_scales;
  // FP8 dequantization scale of the weight (per tensor); for the finer
  // schemes the largest of weight_scales.
  float weight_scale = 1.0f;
  float input_scale = 1.0f;  // FP8 static dequantization scale of the input
  // FP8: the input's scale is computed for every batch from the whole
  // input's amax (the largest over the ranks' parts) instead of input_scale;
  // set when the checkpoint gives no input_scale for (a part of) the layer.
  bool dynamic_input = false;
};

struct LayerWeights {
  std::vector<float> input_norm, post_norm;  // [H]
  LinearWeight qkv, o, gate_up, down;
  // The E4M3 KV cache's scales of this layer (engine/kv_cache.h), from the checkpoint's
  // self_attn.k_scale / v_scale (compressed-tensors), self_attn.k_proj.k_scale /
  // v_proj.v_scale (ModelOpt) or self_attn.kv_scale (one for both); 1 where it has none.
  // The same on every rank (one scalar for all KV heads).
  KvScales kv_scales;
};

struct RankWeights {
  int tp = 1, rank = 0;
  DataType dtype = DataType::kFloat8E4M3;  // of the four TP layers
  std::vector<float> embed;                // [V, H] (replicated)
  std::vector<float> final_norm;           // [H]
  LinearWeight lm_head;                    // BF16 [V/tp, H]
  std::vector<LayerWeights> layers;
};

// INVALID_ARGUMENT naming the first tensor whose size or type does not fit
// rank `rank` of `tp` for `config` (the layout above): the engines check
// weights handed to them before anything reads past a buffer.
Status ValidateRankWeights(const ModelConfig& config, const RankWeights& weights, int tp, int rank);

// HuggingFace tensor names of layer `i` (e.g. "model.layers.3.mlp.down_proj").
std::string HfLayerPrefix(int64_t layer);

// Random weights from `seed`: N(0, 0.02) linear weights (FP8: quantized with
// per-tensor scales from their amax), norms of 1, FP8 input scales 8/448.
StatusOr<RankWeights> MakeRandomRankWeights(const ModelConfig& config, DataType dtype, int tp,
                                            int rank, uint64_t seed);

// Writes a random checkpoint (config.json + model.safetensors) into `dir`
// (created if missing) in the ModelOpt FP8 layout (or BF16), with the same
// weights as MakeRandomRankWeights of the same seed. `scheme` (FP8 only)
// picks the scale layout: kPerTensor as above; kPerChannel a weight_scale
// [N,1] per layer, no input_scale, and a compressed-tensors
// quantization_config (channel weights, dynamic token activations); kBlock a
// weight_scale_inv [ceil(N/128), ceil(K/128)] per layer and an HF fine-grained
// FP8 quantization_config (weight_block_size [128, 128]). The drawn values are
// the same for every scheme (and BF16); only their quantization differs. Streams: the tensors are
// made and written one block at a time (and each global tensor alone), so
// memory holds one block or the embedding table, whichever is larger, not the
// model. Progress lines ("make-checkpoint: ...") on long work.
Status WriteRandomCheckpoint(const ModelConfig& config, DataType dtype, uint64_t seed,
                             const std::string& dir, Fp8Scheme scheme = Fp8Scheme::kPerTensor);

// WriteRandomCheckpoint's model.safetensors (only) written the simple way:
// every tensor made in memory at once, then WriteSafetensors. Memory: the
// whole model. Tests hold the streamed file to this one, byte for byte.
Status WriteRandomSafetensorsInMemory(const ModelConfig& config, DataType dtype, uint64_t seed,
                                      const std::string& path,
                                      Fp8Scheme scheme = Fp8Scheme::kPerTensor);

// Loads this rank's shard from `dir` (config.json + *.safetensors), with the
// TP layers' weights in `dtype`: FP8 (FP8 tensors as stored, BF16/F32 ones
// quantized with their amax scale) or BF16 (FP8 tensors dequantized with
// their weight_scale, BF16 ones as stored). Errors name the file and tensor.
StatusOr<RankWeights> LoadRankWeights(const std::string& dir, const ModelConfig& config, int tp,
                                      int rank, DataType dtype = DataType::kFloat8E4M3);

}  // namespace tpserve
