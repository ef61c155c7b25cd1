// Test helpers for safetensors checkpoints written by make-checkpoint.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "engine/safetensors.h"

namespace tpserve {

// Rewrites the checkpoint in `dir` into `out` (model.safetensors only):
// `edit` sees every tensor's entry (and may change it) and
// returns false to leave the tensor out. Any data an edit points at must
// outlive the call.
inline void RewriteCheckpoint(const std::string& dir, const std::string& out,
                              const std::function<bool(TensorToWrite&)>& edit) {
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  std::vector<TensorToWrite> tensors;
  for (const TensorView& v : file->tensors()) {
    TensorToWrite t{v.name, v.dtype, v.shape, v.data, v.bytes};
    if (edit(t)) tensors.push_back(std::move(t));
  }
  std::filesystem::create_directories(out);
  ASSERT_TRUE(WriteSafetensors(out + "/model.safetensors", tensors).ok());
}

// A random FP8 checkpoint of `config` in `dir` whose activations outgrow
// the default static input scale (8/448 saturates at 8): every RMSNorm
// weight is `norm_gain` instead of 1, and, without `keep_input_scales`, the
// input_scale tensors are left out, so that the loader scales the FP8
// inputs per batch (LinearWeight::dynamic_input).
inline void WriteLoudCheckpoint(const ModelConfig& config, const std::string& dir, float norm_gain,
                                bool keep_input_scales) {
  const std::string plain = dir + ".plain";
  std::filesystem::remove_all(plain);
  ASSERT_TRUE(WriteRandomCheckpoint(config, DataType::kFloat8E4M3, 7, plain).ok());
  const std::vector<float> gains(config.hidden_size, norm_gain);
  RewriteCheckpoint(plain, dir, [&](TensorToWrite& t) {
    if (t.name.ends_with("layernorm.weight")) t.data = gains.data();  // F32 [hidden]
    return keep_input_scales || !t.name.ends_with(".input_scale");
  });
  std::filesystem::copy(plain + "/config.json", dir + "/config.json",
                        std::filesystem::copy_options::overwrite_existing);
  std::filesystem::remove_all(plain);
}

// One F32 tensor for CopyWithExtraTensors.
struct ExtraTensor {
  std::string name;
  std::vector<float> values;
  std::vector<int64_t> shape;  // {} for a scalar
};

// Copies the checkpoint in `src` (config.json and its safetensors files) to `dst` and adds
// dst/extra.safetensors holding `tensors`: what a checkpoint with more tensors (e.g. KV cache
// scales) looks like to the loader, which reads every *.safetensors file of a directory.
inline void CopyWithExtraTensors(const std::string& src, const std::string& dst,
                                 const std::vector<ExtraTensor>& tensors) {
  std::filesystem::remove_all(dst);
  std::filesystem::copy(src, dst, std::filesystem::copy_options::recursive);
  std::vector<TensorToWrite> out;
  for (const ExtraTensor& t : tensors) {
    out.push_back({t.name, StDtype::kF32, t.shape, t.values.data(), t.values.size() * 4});
  }
  ASSERT_TRUE(WriteSafetensors(dst + "/extra.safetensors", out).ok());
}

}  // namespace tpserve
