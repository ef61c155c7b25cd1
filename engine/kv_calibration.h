// Calibration of the E4M3 KV cache's scales (engine/kv_cache.h: KvScales) on the CPU reference,
// for checkpoints that carry none: each layer's largest |key| (RoPE applied) and |value| over
// some prompts (CpuModel::MeasureKvAbsMax), and the safetensors file that gives the loader
// those as a checkpoint's k_scale / v_scale (engine/model_weights.h reads every *.safetensors
// file of a model directory).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "comm/dtype.h"
#include "comm/status.h"
#include "engine/kv_cache.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"

namespace tpserve {

using Prompts = std::vector<std::vector<int32_t>>;

// `count` prompts of `length` tokens each, ids uniform over [0, vocab) from a splitmix64
// stream of `seed`: the same on every platform.
Prompts DefaultPrompts(int64_t count, int64_t length, int64_t vocab, uint64_t seed);

// Prompts from a JSON file: a list of token-id lists, or an object whose "prompts" is one (as
// tests/data/hf/*/reference.json). INVALID_ARGUMENT naming the file (and the prompt and
// token) for anything else, an empty prompt, an id outside [0, vocab) or a prompt longer
// than max_positions; NOT_FOUND for a missing file.
StatusOr<Prompts> ReadPrompts(const std::string& path, int64_t vocab, int64_t max_positions);

// Each layer's largest |key| and |value| over every position of `prompts`, each prompt its
// own batch, on the CPU reference at tp 1 with `weights`. `progress` (may be empty) is called
// after each prompt with the prompts done. Errors: the model's, naming the prompt.
StatusOr<std::vector<KvAbsMax>> CalibrateKvAbsMax(const ModelConfig& config,
                                                  const RankWeights& weights,
                                                  const Prompts& prompts,
                                                  const std::function<void(size_t)>& progress = {});

// The same over the checkpoint in `dir` loaded as `dtype` on `tp` ranks (threads; each loads
// its shard, as serve does).
StatusOr<std::vector<KvAbsMax>> CalibrateKvAbsMax(const ModelConfig& config, const std::string& dir,
                                                  DataType dtype, int tp, const Prompts& prompts,
                                                  const std::function<void(size_t)>& progress = {});

// Writes `scales` (one pair a layer) to `path` as F32 scalars named
// model.layers.N.self_attn.k_scale / v_scale (compressed-tensors' spelling), with `metadata`
// in the header. WriteSafetensors's errors.
Status WriteKvScales(const std::string& path, const std::vector<KvScales>& scales,
                     const std::map<std::string, std::string>& metadata = {});

}  // namespace tpserve
