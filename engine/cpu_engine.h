// CpuEngine: a model served by `tp` rank threads on the CPU executor. The
// weights are loaded once at Start(); Forward() then runs one packed batch on
// all ranks. The serving backend on machines without GPUs.
//
// Thread-safety: Forward() may be called from any thread; calls are
// serialised. Failure: a rank that fails aborts the group (no rank waits for
// it); the engine then answers every later Forward() with UNAVAILABLE.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "engine/cpu_model.h"
#include "engine/engine.h"

namespace tpserve {

struct CpuEngineOptions {
  ModelConfig config;                            // the model's shape
  int tp = 1;                                    // ranks (threads)
  DataType dtype = DataType::kFloat8E4M3;        // of the TP layers (random or loaded)
  uint64_t seed = 7;                             // of random weights
  std::string checkpoint_dir;                    // empty: random weights
  std::shared_ptr<const OverlapConfig> overlap;  // may be null: every layer mode none
  // The paged KV cache of generation, per rank, allocated at Start (host
  // memory): num_blocks blocks of block_size tokens; 0 blocks: no generation.
  int64_t kv_blocks = 0;
  int64_t kv_block_size = 16;
  KvCacheDtype kv_dtype = KvCacheDtype::kBFloat16;
};

class CpuEngine final : public Engine {
 public:
  static StatusOr<std::unique_ptr<CpuEngine>> Start(CpuEngineOptions options);
  ~CpuEngine() override;  // stops the rank threads

  // Logits [sequences, vocab] of the last token of every sequence.
  StatusOr<std::vector<float>> Forward(const TokenBatch& batch) override;
  // A generation step; rank 0 samples from the logits (engine/sampling.h).
  StatusOr<StepResult> Step(const StepBatch& step) override;
  KvCacheLayout kv_cache_layout() const override { return kv_layout_; }

  const ModelConfig& config() const override { return options_.config; }
  int tp() const override { return options_.tp; }
  const OverlapConfig* overlap() const override { return options_.overlap.get(); }
  GemmScaleScheme scale_scheme() const override;
  bool healthy() const override;

 private:
  explicit CpuEngine(CpuEngineOptions options) : options_(std::move(options)) {}
  void RankLoop(int rank, Communicator* comm);
  // What every rank runs for one call; rank 0's logits are kept.
  using Job = std::function<StatusOr<std::vector<float>>(CpuModel&, CpuKvCache*)>;
  StatusOr<std::vector<float>> Run(const Job& job);

  CpuEngineOptions options_;
  KvCacheLayout kv_layout_;  // num_blocks 0: no cache
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::thread> threads_;

  std::mutex forward_mu_;  // one Forward at a time
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;  // bumped per job
  int started_ = 0;          // ranks that finished loading
  int finished_ = 0;         // ranks done with the current job
  int running_ = 0;          // ranks inside the current job (reading *job_)
  bool stop_ = false;
  bool broken_ = false;
  Status first_error_;
  GemmScaleScheme scale_scheme_ = GemmScaleScheme::kPerTensor;  // rank 0's weights', under mu_
  const Job* job_ = nullptr;
  std::vector<float> logits_;
};

}  // namespace tpserve
