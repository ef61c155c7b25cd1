#include "engine/cuda_engine.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/nccl_bootstrap.h"

namespace tpserve {
namespace {

// Header words broadcast before every batch or step (kMaxBlocks: a step's block table width).
enum HeaderWord { kWhat = 0, kTokens = 1, kSequences = 2, kMaxBlocks = 3, kHeaderWords = 4 };
enum What : int64_t { kForward = 1, kStop = 2, kStep = 3 };

// What a worker receives: a forward batch, a generation step, or a stop.
struct Message {
  What what = kStop;
  TokenBatch batch;
  StepBatch step;
};

// The widest block table a step may carry: a sequence's longest context, or the whole pool.
int64_t StepTableWidth(const CudaEngineOptions& o) {
  return std::min(BlocksFor(o.config.max_position_embeddings, o.model.kv_block_size),
                  o.model.kv_blocks);
}

// A step's payload in int32 words: ids, positions | cu_seqlens | per sequence: context_lens,
// sample, top_k, temperature and top_p (float bits), seed and sample_index (two words each)
// | block tables.
int64_t StepWords(int64_t tokens, int64_t seqs, int64_t max_blocks) {
  return 2 * tokens + (seqs + 1) + 9 * seqs + seqs * max_blocks;
}

void FlattenStep(const StepBatch& b, std::vector<int32_t>* flat) {
  const int64_t seqs = b.sequences();
  flat->clear();
  flat->insert(flat->end(), b.ids.begin(), b.ids.end());
  flat->insert(flat->end(), b.positions.begin(), b.positions.end());
  flat->insert(flat->end(), b.cu_seqlens.begin(), b.cu_seqlens.end());
  flat->insert(flat->end(), b.context_lens.begin(), b.context_lens.end());
  auto word = [](auto v) {
    int32_t w;
    std::memcpy(&w, &v, 4);
    return w;
  };
  for (int64_t s = 0; s < seqs; ++s) {
    const SamplingParams& p = b.sampling[s];
    const uint64_t seed = p.seed, index = b.sample_index[s];
    for (int32_t w :
         {int32_t{b.sample[s]}, p.top_k, word(p.temperature), word(p.top_p),
          word(static_cast<uint32_t>(seed)), word(static_cast<uint32_t>(seed >> 32)),
          word(static_cast<uint32_t>(index)), word(static_cast<uint32_t>(index >> 32))}) {
      flat->push_back(w);
    }
  }
  flat->insert(flat->end(), b.block_tables.begin(), b.block_tables.end());
}

StepBatch UnflattenStep(const std::vector<int32_t>& flat, int64_t tokens, int64_t seqs,
                        int64_t max_blocks) {
  StepBatch b;
  auto it = flat.begin();
  auto take = [&](int64_t n, std::vector<int32_t>* out) {
    out->assign(it, it + n);
    it += n;
  };
  take(tokens, &b.ids);
  take(tokens, &b.positions);
  take(seqs + 1, &b.cu_seqlens);
  take(seqs, &b.context_lens);
  auto u32 = [](int32_t w) { return static_cast<uint64_t>(static_cast<uint32_t>(w)); };
  for (int64_t s = 0; s < seqs; ++s, it += 8) {
    SamplingParams p;
    b.sample.push_back(static_cast<uint8_t>(it[0]));
    p.top_k = it[1];
    std::memcpy(&p.temperature, &it[2], 4);
    std::memcpy(&p.top_p, &it[3], 4);
    p.seed = u32(it[4]) | u32(it[5]) << 32;
    b.sampling.push_back(p);
    b.sample_index.push_back(u32(it[6]) | u32(it[7]) << 32);
  }
  b.max_blocks = max_blocks;
  take(seqs * max_blocks, &b.block_tables);
  return b;
}

struct RankState {
  std::unique_ptr<NcclCommPool> pool;
  std::unique_ptr<CudaModel> model;
  DeviceBuffer header, payload;
  CudaStream stream;
};

size_t PayloadBytes(const CudaEngineOptions& o) {
  const CudaModelOptions& m = o.model;
  const int64_t forward = 2 * m.max_tokens + m.max_seqs + 1;
  const int64_t step = m.kv_blocks > 0 ? StepWords(m.max_tokens, m.max_seqs, StepTableWidth(o)) : 0;
  return sizeof(int32_t) * std::max(forward, step);
}

StatusOr<RankState> SetUpRank(const CudaEngineOptions& o, const ncclUniqueId& id, int rank,
                              int device, std::shared_ptr<const CancelFlag> cancel) {
  RankState st;
  TP_ASSIGN_OR_RETURN(auto comm, NcclCommunicator::Create(id, o.tp, rank, device, NcclCommConfig{},
                                                          o.timeout, std::move(cancel)));
  st.pool = std::make_unique<NcclCommPool>(std::move(comm));
  if (o.checkpoint_dir.empty() && o.device_random_weights) {
    TP_ASSIGN_OR_RETURN(st.model, CudaModel::CreateRandom(o.config, o.dtype, o.seed,
                                                          o.overlap.get(), *st.pool, o.model));
  } else {
    RankWeights w;
    if (o.checkpoint_dir.empty()) {
      TP_ASSIGN_OR_RETURN(w, MakeRandomRankWeights(o.config, o.dtype, o.tp, rank, o.seed));
    } else {
      TP_ASSIGN_OR_RETURN(w, LoadRankWeights(o.checkpoint_dir, o.config, o.tp, rank, o.dtype));
    }
    TP_ASSIGN_OR_RETURN(st.model,
                        CudaModel::Create(o.config, w, o.overlap.get(), *st.pool, o.model));
  }
  // Every bucket's graph before the first request (collective: all ranks
  // warm up the same buckets in the same order).
  TP_RETURN_IF_ERROR(st.model->WarmUp());
  TP_ASSIGN_OR_RETURN(st.header, DeviceBuffer::Allocate(kHeaderWords * 8, "batch.header"));
  TP_ASSIGN_OR_RETURN(st.payload, DeviceBuffer::Allocate(PayloadBytes(o), "batch.payload"));
  TP_ASSIGN_OR_RETURN(st.stream, CudaStream::Create());
  return st;
}

// Rank 0: the header `h`, then the payload `flat` (a forward's ids | positions | cu_seqlens,
// a step's FlattenStep; nothing for a stop).
Status Send(NcclCommunicator& comm, DeviceBuffer& header, DeviceBuffer& payload,
            cudaStream_t stream, const int64_t (&h)[kHeaderWords],
            const std::vector<int32_t>& flat) {
  TP_CUDA_CHECK(cudaMemcpyAsync(header.data(), h, sizeof h, cudaMemcpyHostToDevice, stream));
  TP_RETURN_IF_ERROR(comm.Broadcast(header.data(), sizeof h, 0, stream));
  if (!flat.empty()) {
    TP_CUDA_CHECK(cudaMemcpyAsync(payload.data(), flat.data(), flat.size() * 4,
                                  cudaMemcpyHostToDevice, stream));
    TP_RETURN_IF_ERROR(comm.Broadcast(payload.data(), flat.size() * 4, 0, stream));
  }
  return comm.WaitStream(stream);  // `h` and `flat` must outlive the copies
}

Status SendBatch(NcclCommunicator& comm, DeviceBuffer& header, DeviceBuffer& payload,
                 cudaStream_t stream, const TokenBatch* batch) {
  int64_t h[kHeaderWords] = {batch != nullptr ? kForward : kStop, 0, 0, 0};
  std::vector<int32_t> flat;
  if (batch != nullptr) {
    h[kTokens] = batch->tokens();
    h[kSequences] = batch->sequences();
    flat.reserve(2 * batch->ids.size() + batch->cu_seqlens.size());
    flat.insert(flat.end(), batch->ids.begin(), batch->ids.end());
    flat.insert(flat.end(), batch->positions.begin(), batch->positions.end());
    flat.insert(flat.end(), batch->cu_seqlens.begin(), batch->cu_seqlens.end());
  }
  return Send(comm, header, payload, stream, h, flat);
}

// Workers: the next message. Waits for rank 0 without a deadline (a server
// may be idle for hours); rank 0's death ends the process through
// PR_SET_PDEATHSIG.
StatusOr<Message> Receive(NcclCommunicator& comm, DeviceBuffer& header, DeviceBuffer& payload,
                          cudaStream_t stream, const CudaEngineOptions& o) {
  int64_t h[kHeaderWords] = {};
  TP_RETURN_IF_ERROR(comm.Broadcast(header.data(), sizeof h, 0, stream));
  TP_RETURN_IF_ERROR(comm.WaitStream(stream, NcclCommunicator::Clock::time_point::max()));
  TP_CUDA_CHECK(cudaMemcpy(h, header.data(), sizeof h, cudaMemcpyDeviceToHost));
  Message msg;
  if (h[kWhat] == kStop) return msg;
  const CudaModelOptions& limits = o.model;
  const int64_t tokens = h[kTokens], seqs = h[kSequences], max_blocks = h[kMaxBlocks];
  const bool step = h[kWhat] == kStep;
  if ((h[kWhat] != kForward && !step) || tokens < 1 || seqs < 1 || tokens > limits.max_tokens ||
      seqs > limits.max_seqs || (step && (max_blocks < 1 || max_blocks > StepTableWidth(o)))) {
    return InternalError("bad batch header from rank 0: what=" + std::to_string(h[kWhat]) +
                         " tokens=" + std::to_string(tokens) + " sequences=" +
                         std::to_string(seqs) + " max_blocks=" + std::to_string(max_blocks));
  }
  msg.what = step ? kStep : kForward;
  const size_t words =
      static_cast<size_t>(step ? StepWords(tokens, seqs, max_blocks) : 2 * tokens + seqs + 1);
  TP_RETURN_IF_ERROR(comm.Broadcast(payload.data(), words * 4, 0, stream));
  TP_RETURN_IF_ERROR(comm.WaitStream(stream));
  std::vector<int32_t> flat(words);
  TP_CUDA_CHECK(cudaMemcpy(flat.data(), payload.data(), words * 4, cudaMemcpyDeviceToHost));
  if (step) {
    msg.step = UnflattenStep(flat, tokens, seqs, max_blocks);
    return msg;
  }
  TokenBatch& b = msg.batch;
  b.ids.assign(flat.begin(), flat.begin() + tokens);
  b.positions.assign(flat.begin() + tokens, flat.begin() + 2 * tokens);
  b.cu_seqlens.assign(flat.begin() + 2 * tokens, flat.end());
  return msg;
}

}  // namespace

StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Start(CudaEngineOptions options) {
  TP_RETURN_IF_ERROR(options.config.ValidateForTp(options.tp));
  if (options.tp > 1 && options.worker_argv.empty()) {
    return InvalidArgumentError("CudaEngine with tp > 1 needs worker_argv");
  }
  if (!options.launch) {
    TP_ASSIGN_OR_RETURN(options.launch, PlanLaunch(NotFoundError("single node"), options.tp));
  }
  if (options.launch->role != LaunchPlan::Role::kLeader) {
    return InvalidArgumentError("CudaEngine::Start runs rank 0; this process is rank " +
                                std::to_string(options.launch->rank));
  }
  auto engine = std::unique_ptr<CudaEngine>(new CudaEngine(std::move(options)));
  const CudaEngineOptions& o = engine->options_;
  const LaunchPlan& plan = *o.launch;
  ncclUniqueId id{};
  TP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  // Other nodes' processes fetch the id while this one loads (NCCL's init
  // waits for them).
  std::thread id_server;
  Status served;
  if (plan.serve_id_clients > 0) {
    TP_ASSIGN_OR_RETURN(UniqueIdServer server, UniqueIdServer::Listen(o.rendezvous.port));
    spdlog::info("CudaEngine: handing the NCCL id to {} process(es) on port {}",
                 plan.serve_id_clients, server.port());
    id_server = std::thread(
        [&served, &o, id, clients = plan.serve_id_clients, srv = std::move(server)]() mutable {
          served = srv.Serve(id, clients, std::chrono::steady_clock::now() + o.timeout);
        });
  }
  auto spawned = SpawnWorkers(o.worker_argv, o.tp, plan.spawn_ranks, id);
  if (spawned.ok()) engine->workers_ = std::move(spawned).value();
  spdlog::info("CudaEngine: started {} worker process(es); loading rank 0",
               engine->workers_.size());
  // Watched from now on: a worker that dies while loading cancels rank 0's
  // waits (SetUpRank's communicators hold cancel_).
  engine->watch_ = std::make_unique<WorkerWatch>(
      engine->workers_, plan.spawn_ranks,
      [e = engine.get()](const std::string& lost) { e->OnWorkerLost(lost); });
  auto rank0 = spawned.ok() ? SetUpRank(o, id, 0, plan.local_rank, engine->cancel_)
                            : StatusOr<RankState>(spawned.status());
  if (id_server.joinable()) id_server.join();
  Status ready = rank0.ok() ? served : rank0.status();
  if (ready.ok()) {
    {
      std::lock_guard abort_lock(engine->abort_mu_);  // the watch may abort it already
      engine->pool_ = std::move(rank0->pool);
    }
    engine->model_ = std::move(rank0->model);
    engine->scale_scheme_ = engine->model_->scale_scheme();
    engine->header_ = std::move(rank0->header);
    engine->payload_ = std::move(rank0->payload);
    engine->stream_ = std::move(rank0->stream);
    // Every rank has its weights once this returns.
    ready = engine->pool_->base().Barrier();
  }
  if (!ready.ok()) {
    engine->broken_ = true;  // the destructor kills the workers
    // The lost worker is the cause; rank 0's cancelled wait is the symptom.
    if (const std::string lost = engine->LostWorker(); !lost.empty()) {
      ready = UnavailableError(lost + " while the engine was starting (rank 0: " + ready.message() +
                               ")");
    }
    return ready.WithContext("starting the CUDA engine");
  }
  engine->device_bytes_ = engine->model_->device_bytes();
  engine->kv_layout_ = engine->model_->kv_layout();
  spdlog::info("CudaEngine: {} ranks ready ({} MiB on rank 0's GPU)", o.tp,
               engine->device_bytes_.load() >> 20);
  return engine;
}

void CudaEngine::OnWorkerLost(const std::string& lost) {
  // Held while this uses pool_, so that the destructor cannot reset it
  // meanwhile; monitor_mu_ is not held during the abort: healthy() takes it,
  // and must answer while the communicators are being torn down.
  std::lock_guard abort_lock(abort_mu_);
  {
    std::lock_guard lock(monitor_mu_);
    if (stopping_) return;  // workers exit when the engine stops
    lost_ = lost;
    spdlog::error("CudaEngine: {}; aborting the communicators", lost_);
    cancel_->Cancel(lost_);
  }
  // A Forward in flight returns ABORTED now (each abort waits a bounded time);
  // while loading, pool_ is not set yet and cancel_ ends rank 0's waits.
  if (pool_ != nullptr) pool_->Abort();
}

std::string CudaEngine::LostWorker() const {
  std::lock_guard lock(monitor_mu_);
  return lost_;
}

CudaEngine::~CudaEngine() {
  {
    std::lock_guard lock(monitor_mu_);
    stopping_ = true;
  }
  // Workers exit from here on; a lost-worker call in progress ends first.
  if (watch_ != nullptr) watch_->Stop();
  std::lock_guard lock(mu_);
  bool graceful = !broken_ && pool_ != nullptr;
  if (graceful) {
    Status s = SendBatch(pool_->base(), header_, payload_, stream_.get(), nullptr);
    if (!s.ok()) {
      spdlog::warn("CudaEngine: telling the workers to stop failed: {}", s.ToString());
      graceful = false;
    }
  }
  if (graceful && model_ != nullptr) {
    // Collective with the workers' Close after their stop header.
    Status closed = model_->Close();
    if (!closed.ok()) {
      spdlog::warn("CudaEngine: closing the model: {}", closed.ToString());
      graceful = false;
    }
  }
  if (!graceful && pool_ != nullptr) pool_->Abort();
  model_.reset();
  stream_ = CudaStream();
  header_ = DeviceBuffer();
  payload_ = DeviceBuffer();
  {
    std::lock_guard abort_lock(abort_mu_);  // not while the watch aborts it
    pool_.reset();  // collective with the workers' own teardown when graceful
  }
  StopWorkers(graceful);
}

void CudaEngine::StopWorkers(bool graceful) {
  // Give stopping workers time to exit, then make sure.
  std::vector<pid_t> live;
  for (pid_t& pid : workers_) {
    if (pid > 0) live.push_back(pid);
    pid = -1;
  }
  const Status reaped =
      ReapWorkers(live, graceful ? std::chrono::milliseconds(30000) : std::chrono::milliseconds(0));
  if (!reaped.ok()) spdlog::warn("stopping the engine: {}", reaped.ToString());
}

void CudaEngine::Fail(const Status& why) {
  if (!broken_) {
    broken_ = true;
    first_error_ = why;
    spdlog::error("CudaEngine: {}; the engine stops serving", why.ToString());
    if (pool_ != nullptr) pool_->Abort();
  }
}

bool CudaEngine::healthy() const {
  // Not under mu_: a Forward in flight holds it, and health must answer now.
  return !broken_.load() && LostWorker().empty();
}

StatusOr<std::vector<float>> CudaEngine::Forward(const TokenBatch& batch) {
  std::lock_guard lock(mu_);
  if (broken_) {
    return UnavailableError("the CUDA engine failed earlier: " + first_error_.ToString());
  }
  // Well-formed (ids, positions, sequence boundaries; at least one token),
  // then within what the engine was sized for. Refused before anything
  // reaches the workers.
  TP_RETURN_IF_ERROR(ValidateTokenBatch(batch, options_.config.vocab_size,
                                        options_.config.max_position_embeddings));
  const CudaModelOptions& lim = options_.model;
  if (batch.tokens() > lim.max_tokens || batch.sequences() > lim.max_seqs) {
    return InvalidArgumentError("batch of " + std::to_string(batch.tokens()) + " tokens in " +
                                std::to_string(batch.sequences()) +
                                " sequences is outside the engine's limits (" +
                                std::to_string(lim.max_tokens) + " tokens, " +
                                std::to_string(lim.max_seqs) + " sequences)");
  }
  // A worker that died between batches: fail now instead of at the deadline.
  if (const std::string gone = LostWorker(); !gone.empty()) {
    Fail(UnavailableError(gone));
    return UnavailableError("the CUDA engine failed: " + gone);
  }
  Status sent = SendBatch(pool_->base(), header_, payload_, stream_.get(), &batch);
  StatusOr<std::vector<float>> logits = sent;
  if (sent.ok()) logits = model_->Forward(batch);
  if (!logits.ok()) {
    // Name the lost worker when that was the cause (the abort is the symptom).
    const std::string lost = LostWorker();
    Status why = lost.empty() ? logits.status() : UnavailableError(lost);
    Fail(why);
    return UnavailableError("the CUDA engine failed: " + why.ToString());
  }
  device_bytes_ = model_->device_bytes();
  return logits;
}

StatusOr<StepResult> CudaEngine::Step(const StepBatch& step) {
  std::lock_guard lock(mu_);
  if (broken_) {
    return UnavailableError("the CUDA engine failed earlier: " + first_error_.ToString());
  }
  if (kv_layout_.num_blocks == 0) {
    return FailedPreconditionError("the CUDA engine was started without a KV cache");
  }
  // Refused before anything reaches the workers: malformed, or over the engine's limits.
  TP_RETURN_IF_ERROR(ValidateStepBatch(step, options_.config.vocab_size,
                                       options_.config.max_position_embeddings,
                                       kv_layout_.num_blocks, kv_layout_.block_size));
  const CudaModelOptions& lim = options_.model;
  if (step.tokens() > lim.max_tokens || step.sequences() > lim.max_seqs ||
      step.max_blocks > StepTableWidth(options_)) {
    return InvalidArgumentError(
        "step of " + std::to_string(step.tokens()) + " tokens in " +
        std::to_string(step.sequences()) + " sequences with block tables of " +
        std::to_string(step.max_blocks) + " is outside the engine's limits (" +
        std::to_string(lim.max_tokens) + " tokens, " + std::to_string(lim.max_seqs) +
        " sequences, " + std::to_string(StepTableWidth(options_)) + " blocks)");
  }
  if (const std::string gone = LostWorker(); !gone.empty()) {
    Fail(UnavailableError(gone));
    return UnavailableError("the CUDA engine failed: " + gone);
  }
  const int64_t h[kHeaderWords] = {kStep, step.tokens(), step.sequences(), step.max_blocks};
  FlattenStep(step, &step_flat_);
  Status sent = Send(pool_->base(), header_, payload_, stream_.get(), h, step_flat_);
  StatusOr<StepResult> result = sent;
  if (sent.ok()) result = model_->Step(step);
  if (!result.ok()) {
    const std::string lost = LostWorker();
    Status why = lost.empty() ? result.status() : UnavailableError(lost);
    Fail(why);
    return UnavailableError("the CUDA engine failed: " + why.ToString());
  }
  device_bytes_ = model_->device_bytes();
  return result;
}

Status RunCudaWorker(const CudaEngineOptions& options) {
  // Exit with rank 0: a worker must not outlive the server that started it.
  // SIGTERM must not be blocked here (an inherited mask would hold it).
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_UNBLOCK, &term, nullptr);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() == 1) return UnavailableError("rank 0 exited before this worker started");
  LaunchPlan plan;
  if (options.launch) {
    plan = *options.launch;
  } else {
    TP_ASSIGN_OR_RETURN(plan, PlanLaunch(RankInfoFromEnv(), options.tp));
  }
  if (plan.role != LaunchPlan::Role::kWorker) {
    return InvalidArgumentError("a worker must be rank > 0; this process is rank " +
                                std::to_string(plan.rank));
  }
  ncclUniqueId id{};
  if (plan.fetch_id) {
    spdlog::info("worker rank {}: fetching the NCCL id from {}:{}", plan.rank,
                 options.rendezvous.host, options.rendezvous.port);
    TP_ASSIGN_OR_RETURN(id, FetchUniqueId(options.rendezvous.host, options.rendezvous.port,
                                          std::chrono::steady_clock::now() + options.timeout));
  } else {
    TP_ASSIGN_OR_RETURN(id, UniqueIdFromEnv());
  }
  // This node's other ranks (a LeaderWorkerSet pod with several GPUs); they
  // die with this process (PR_SET_PDEATHSIG in theirs). One that exits
  // before the stop header cancels this rank's waits (while loading) or
  // aborts its communicators (while serving), so that this process exits
  // with an error naming it rather than waiting for a rank that is gone.
  std::vector<pid_t> local;
  if (!plan.spawn_ranks.empty()) {
    TP_ASSIGN_OR_RETURN(local, SpawnWorkers(options.worker_argv, options.tp, plan.spawn_ranks, id));
  }
  auto cancel = std::make_shared<CancelFlag>();
  std::mutex pool_mu;     // the watch's abort vs. st's set-up
  RankState st;           // set under pool_mu once loaded
  bool stopping = false;  // under pool_mu: the stop header came, workers exit now
  // Declared after what it uses, so destroyed (stopped) before them on every return.
  WorkerWatch watch(local, plan.spawn_ranks, [&](const std::string& lost) {
    std::lock_guard lock(pool_mu);
    if (stopping) return;
    spdlog::error("worker rank {}: {}; aborting the communicators", plan.rank, lost);
    cancel->Cancel(lost);
    if (st.pool != nullptr) st.pool->Abort();
  });
  spdlog::info("worker rank {}/{}: loading on GPU {}", plan.rank, plan.world_size, plan.local_rank);
  {
    StatusOr<RankState> set_up = SetUpRank(options, id, plan.rank, plan.local_rank, cancel);
    if (!set_up.ok()) {
      if (cancel->cancelled()) {
        return UnavailableError(cancel->reason() + " while worker rank " +
                                std::to_string(plan.rank) +
                                " was loading: " + set_up.status().message());
      }
      return set_up.status();
    }
    std::lock_guard lock(pool_mu);
    st = std::move(set_up).value();
  }
  const RankInfo info{plan.rank, plan.world_size, plan.local_rank, "", 0};
  NcclCommunicator& comm = st.pool->base();
  TP_RETURN_IF_ERROR(comm.Barrier());
  int64_t batches = 0;
  while (true) {
    TP_ASSIGN_OR_RETURN(Message msg,
                        Receive(comm, st.header, st.payload, st.stream.get(), options));
    if (msg.what == kStop) break;
    // Rank 0 returns the logits or tokens; the same step on every rank keeps the caches alike.
    if (msg.what == kStep) {
      TP_RETURN_IF_ERROR(st.model->Step(msg.step).status());
    } else {
      TP_RETURN_IF_ERROR(st.model->Run(msg.batch));
    }
    ++batches;
  }
  spdlog::info("worker rank {}: stop after {} batches", info.rank, batches);
  {
    std::lock_guard lock(pool_mu);
    stopping = true;
  }
  watch.Stop();
  // Collective with rank 0's Close (CudaEngine's destructor).
  if (Status closed = st.model->Close(); !closed.ok()) {
    spdlog::warn("worker rank {}: closing the model: {}", info.rank, closed.ToString());
  }
  st.model.reset();
  st.pool.reset();
  for (pid_t pid : local) {
    int status = 0;
    waitpid(pid, &status, 0);  // they stop on the same stop header
  }
  return Status::Ok();
}

}  // namespace tpserve
