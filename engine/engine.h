// Engine: what the server needs from a model backend. CpuEngine (ranks as
// threads on the CPU reference executor) and CudaEngine (one process per
// GPU, engine/cuda_engine.h) implement it.
#pragma once

#include <string>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/model_config.h"
#include "engine/step_batch.h"
#include "engine/token_batch.h"
#include "layers/overlap_config.h"

namespace tpserve {

class Engine {
 public:
  virtual ~Engine() = default;

  // Logits [sequences, vocab] of the last token of every sequence of the
  // packed batch. Thread-safe (calls may be serialised).
  virtual StatusOr<std::vector<float>> Forward(const TokenBatch& batch) = 0;

  // Generation: runs one step (engine/step_batch.h) on every rank, writing
  // the step's keys and values into the paged KV cache and sampling a token
  // for each sequence marked `sample`. Calls are serialised with Forward.
  // INVALID_ARGUMENT for a malformed step (nothing computed); UNIMPLEMENTED
  // where the backend has no generation.
  virtual StatusOr<StepResult> Step(const StepBatch& step);
  // Rank 0's KV cache (num_blocks 0: no cache, no generation).
  virtual KvCacheLayout kv_cache_layout() const { return {}; }

  virtual const ModelConfig& config() const = 0;
  // False once the engine cannot serve any more (e.g. a rank failed).
  virtual bool healthy() const = 0;

  // The overlap config the engine's TP layers follow (null: every layer mode
  // none), and its TP size, for reporting which settings a batch of M tokens
  // gets (OverlapSettingsAt).
  virtual const OverlapConfig* overlap() const { return nullptr; }
  virtual int tp() const { return 1; }
  // The FP8 scale scheme of the TP layers' weights (per tensor for BF16), which keys the
  // overlap config's tuned entries (OverlapConfig::Resolve).
  virtual GemmScaleScheme scale_scheme() const { return GemmScaleScheme::kPerTensor; }
  // Device memory the engine holds on rank 0's GPU (0 on the CPU backend).
  virtual size_t device_memory_bytes() const { return 0; }
};

// How many of the model's TP layers get each setting at a batch of `m`
// tokens: one entry per (layer kind, op, knobs), kind being "attn.qkv",
// "attn.o", "mlp.gate_up" or "mlp.down". A layer whose config fails to
// resolve is counted under knobs "error: <message>".
struct OverlapSettingCount {
  std::string kind;
  std::string op;     // "ag_gemm" | "gemm_rs"
  std::string knobs;  // LinearKnobs::ToString()
  std::string mode;   // "none" | "pipeline" | "ring" | "error"
  int layers = 0;
};
std::vector<OverlapSettingCount> OverlapSettingsAt(
    const ModelConfig& config, const OverlapConfig* overlap, int tp, int64_t m,
    GemmScaleScheme scheme = GemmScaleScheme::kPerTensor);

}  // namespace tpserve
