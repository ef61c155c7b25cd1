// CudaEngine: a model served by one process per GPU on this node. The server
// process is rank 0; it starts ranks 1..tp-1 as worker processes (the same
// executable, `tpserve worker ...`, found by the caller's worker_argv) and
// hands them the NCCL unique id through the environment
// (comm/nccl_bootstrap.h). Every rank loads its own weight shard and builds a
// CudaModel.
//
// Per batch, rank 0 broadcasts a header (what to do, tokens, sequences) and
// then the batch (token ids, positions, sequence boundaries) over NCCL; every
// rank runs CudaModel::Forward; rank 0 returns the logits. A generation step
// goes the same way (what = step; the payload adds the context lengths, block
// tables and sampling parameters) and every rank runs CudaModel::Step on its
// KV cache. A stop header ends the workers' loops.
//
// Failure: a WorkerWatch waits for the worker processes from the moment
// they are started. A worker that exits while the model loads ends Start()
// within moments, naming the worker (the communicators' waits are cancelled,
// CancelFlag), instead of at the deadline; one that exits while the engine
// runs makes it abort the communicators at once, so a Forward() in flight
// returns within moments as well. A
// rank that hangs instead makes rank 0's collective miss its deadline
// (options.timeout), with the same outcome. Either way this and every later
// Forward() answers UNAVAILABLE and healthy() turns false (the server then
// reports NOT_SERVING and exits non-zero). Workers exit when rank 0 dies
// (PR_SET_PDEATHSIG) or its collectives fail.
//
// Thread-safety: Forward() may be called from any thread; calls are
// serialised. Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_bootstrap.h"
#include "comm/nccl_communicator.h"
#include "engine/cuda_model.h"
#include "engine/engine.h"
#include "engine/worker_watch.h"

namespace tpserve {

struct CudaEngineOptions {
  ModelConfig config;                      // the model's shape
  int tp = 1;                              // ranks = GPUs = processes
  DataType dtype = DataType::kFloat8E4M3;  // of the TP layers (random or loaded)
  uint64_t seed = 7;                       // of random weights
  std::string checkpoint_dir;              // empty: random weights
  // Random weights generated on the GPUs (CudaModel::CreateRandom: seconds
  // for llama3-70b shapes) instead of the host's MakeRandomRankWeights (the
  // weights the CPU backend uses, so logits compare; slow for large models).
  bool device_random_weights = false;
  std::shared_ptr<const OverlapConfig> overlap;  // may be null: every layer mode none
  // Batch limits (tokens, sequences) and the KV cache of generation (model.kv_blocks,
  // kv_block_size, kv_dtype; 0 blocks: no generation).
  CudaModelOptions model;
  // Rank 0 only: the command line of a worker (argv[0] an executable path,
  // e.g. "/proc/self/exe"); RunCudaWorker must be what it runs.
  std::vector<std::string> worker_argv;
  std::chrono::milliseconds timeout = std::chrono::seconds(300);  // any collective
  // Who this process is (PlanLaunch); the default is rank 0 of a single node
  // that starts ranks 1..tp-1 itself. Several nodes (mpirun, LeaderWorkerSet):
  // rank 0 hands the NCCL id to the other launcher-started processes over TCP
  // on rendezvous.port, and they fetch it from rendezvous.host.
  std::optional<LaunchPlan> launch;
  RendezvousAddress rendezvous;
};

class CudaEngine final : public Engine {
 public:
  // Rank 0: starts the workers, loads its shard, and returns once every rank
  // is ready (or with the first error; the workers are then stopped).
  static StatusOr<std::unique_ptr<CudaEngine>> Start(CudaEngineOptions options);
  ~CudaEngine() override;  // stops and reaps the workers

  StatusOr<std::vector<float>> Forward(const TokenBatch& batch) override;
  // Generation: rank 0 validates the step (INVALID_ARGUMENT, nothing sent), broadcasts it
  // like a batch, every rank runs CudaModel::Step, rank 0 returns the tokens. Failures are
  // handled as Forward's. FAILED_PRECONDITION without a KV cache (options.model.kv_blocks 0).
  StatusOr<StepResult> Step(const StepBatch& step) override;
  KvCacheLayout kv_cache_layout() const override { return kv_layout_; }
  const ModelConfig& config() const override { return options_.config; }
  bool healthy() const override;
  int tp() const override { return options_.tp; }
  const OverlapConfig* overlap() const override { return options_.overlap.get(); }
  GemmScaleScheme scale_scheme() const override { return scale_scheme_; }
  // As of the last Forward (or the start): layers are made on first use.
  size_t device_memory_bytes() const override { return device_bytes_.load(); }

 private:
  explicit CudaEngine(CudaEngineOptions options) : options_(std::move(options)) {}
  void Fail(const Status& why);  // under mu_
  void StopWorkers(bool graceful);
  void OnWorkerLost(const std::string& lost);  // on watch_'s thread
  std::string LostWorker() const;              // what the watch saw ("" if nothing)

  CudaEngineOptions options_;
  std::vector<pid_t> workers_;
  std::unique_ptr<NcclCommPool> pool_;
  std::unique_ptr<CudaModel> model_;
  DeviceBuffer header_, payload_;   // broadcast staging (device)
  std::vector<int32_t> step_flat_;  // a step's payload on the host, reused
  KvCacheLayout kv_layout_;         // rank 0's, set at Start
  CudaStream stream_;

  mutable std::mutex mu_;            // one Forward at a time; guards first_error_
  std::atomic<bool> broken_{false};  // written under mu_, read by healthy() without it
  Status first_error_;

  mutable std::mutex monitor_mu_;  // guards stopping_ and lost_ (healthy() reads them)
  std::mutex abort_mu_;            // OnWorkerLost's abort of pool_ vs. its set and reset
  bool stopping_ = false;
  std::string lost_;
  // Raised by OnWorkerLost with lost_: every communicator of pool_ holds it,
  // so waits during loading (before pool_ exists here) end too.
  std::shared_ptr<CancelFlag> cancel_ = std::make_shared<CancelFlag>();
  std::unique_ptr<WorkerWatch> watch_;  // the workers, from the moment they start
  std::atomic<size_t> device_bytes_{0};
  GemmScaleScheme scale_scheme_ = GemmScaleScheme::kPerTensor;  // rank 0's model's, set at Start
};

// A worker rank's whole life: its rank from options.launch (else from the
// environment: TPSERVE_RANK, TPSERVE_WORLD_SIZE, TPSERVE_LOCAL_RANK), the
// unique id from TPSERVE_NCCL_ID or rank 0's rendezvous, the node's extra
// ranks started (LeaderWorkerSet pods with several GPUs), its shard loaded;
// then it serves rank 0's batches until a stop header. `options` must
// describe the same model as rank 0's (worker_argv starts the extra ranks).
// OK after a stop; the first error otherwise.
Status RunCudaWorker(const CudaEngineOptions& options);

}  // namespace tpserve
