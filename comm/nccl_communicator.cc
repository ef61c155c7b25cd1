#include "comm/nccl_communicator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "comm/cuda_check.h"

namespace tpserve {
namespace {

using Clock = NcclCommunicator::Clock;

// Makes `device` current for a scope and restores the previous one.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device_) TP_CUDA_LOG(cudaSetDevice(device_));
  }
  ~ScopedDevice() {
    if (previous_ >= 0 && previous_ != device_) TP_CUDA_LOG(cudaSetDevice(previous_));
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

// Polling pause: yields first (an enqueue usually completes within
// microseconds), then sleeps with growing intervals up to 1 ms.
class Backoff {
 public:
  void Pause() {
    if (n_ < 64) {
      ++n_;
      std::this_thread::yield();
      return;
    }
    const int shift = std::min(n_ - 64, 7);
    ++n_;
    std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
        std::chrono::microseconds(8 << shift), std::chrono::milliseconds(1)));
  }

 private:
  int n_ = 0;
};

// Completion of a stream's work so far, signalled by a host function enqueued behind it: a
// waiter wakes when the work ends instead of at its next poll. Shared with the host function,
// which may run after the waiter gave up (deadline, abort) or never (an aborted stream).
struct StreamSignal {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;

  static void CUDART_CB Fire(void* arg) {
    auto* self = static_cast<std::shared_ptr<StreamSignal>*>(arg);
    {
      std::lock_guard lock((*self)->mu);
      (*self)->done = true;
    }
    (*self)->cv.notify_all();
    delete self;
  }

  // Enqueues the signal on `stream`; null (the caller polls instead) when CUDA refuses.
  static std::shared_ptr<StreamSignal> Enqueue(cudaStream_t stream) {
    auto signal = std::make_shared<StreamSignal>();
    auto* ref = new std::shared_ptr<StreamSignal>(signal);
    if (cudaLaunchHostFunc(stream, &StreamSignal::Fire, ref) != cudaSuccess) {
      delete ref;
      (void)cudaGetLastError();
      return nullptr;
    }
    return signal;
  }

  // Waits until fired or `most` has passed.
  void WaitFor(std::chrono::microseconds most) {
    std::unique_lock lock(mu);
    cv.wait_for(lock, most, [this] { return done; });
  }
};

int64_t MillisSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

int NcclCtaPolicy(NcclCommConfig::CtaPolicy p) {
  switch (p) {
    case NcclCommConfig::CtaPolicy::kDefault:
      return NCCL_CTA_POLICY_DEFAULT;
    case NcclCommConfig::CtaPolicy::kEfficiency:
      return NCCL_CTA_POLICY_EFFICIENCY;
    case NcclCommConfig::CtaPolicy::kZero:
      return NCCL_CTA_POLICY_ZERO;
  }
  return NCCL_CTA_POLICY_DEFAULT;
}

// `name` must outlive the communicator made with the result.
ncclConfig_t ToNcclConfig(const NcclCommConfig& c, const char* name) {
  ncclConfig_t nc = NCCL_CONFIG_INITIALIZER;
  nc.blocking = 0;
  if (c.min_ctas > 0) nc.minCTAs = c.min_ctas;
  if (c.max_ctas > 0) nc.maxCTAs = c.max_ctas;
  if (c.cga_cluster_size > 0) nc.cgaClusterSize = c.cga_cluster_size;
  nc.CTAPolicy = NcclCtaPolicy(c.cta_policy);
  nc.commName = name;
  return nc;
}

// Logs each distinct environment warning once per process.
void LogEnvOverrides(const NcclCommConfig& config) {
  static std::mutex mu;
  static std::set<std::string> logged;
  for (std::string& w : NcclEnvOverrides(config)) {
    std::lock_guard lock(mu);
    if (logged.insert(w).second) spdlog::warn("{}", w);
  }
}

Status NcclError(ncclResult_t r, ncclComm_t comm, std::string_view what, int line) {
  const std::string expr(what);
  return NcclCallError(r, comm, expr.c_str(), __FILE__, line);
}

Status CheckPeer(const char* what, const char* role, int peer, int nranks) {
  if (peer < 0 || peer >= nranks) {
    return InvalidArgumentError(std::string(what) + ": " + role + " " + std::to_string(peer) +
                                " is not a rank of this communicator (size " +
                                std::to_string(nranks) + ")");
  }
  return Status::Ok();
}

const char* EnvValue(const EnvLookup& env, const char* name) {
  const char* v = env ? env(name) : nullptr;
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

}  // namespace

// ---- NcclCommConfig ------------------------------------------------------------

std::vector<std::string> NcclEnvOverrides(const NcclCommConfig& config, const EnvLookup& env) {
  std::vector<std::string> out;
  const std::string key = config.Key();
  // An integer knob: overrides an explicit setting, or NCCL's default.
  const auto knob = [&](const char* var, const char* field, const std::string& configured,
                        bool is_set) {
    const char* v = EnvValue(env, var);
    if (v == nullptr) return;
    if (is_set) {
      out.push_back(std::string(var) + "=" + v + " overrides " + field + "=" + configured +
                    " of NCCL communicator config '" + key + "'");
    } else {
      out.push_back(std::string(var) + "=" + v + " replaces NCCL's default " + field +
                    " for every communicator, including config '" + key + "'");
    }
  };
  knob("NCCL_MIN_CTAS", "min_ctas", std::to_string(config.min_ctas), config.min_ctas > 0);
  knob("NCCL_MIN_NCHANNELS", "min_ctas", std::to_string(config.min_ctas), config.min_ctas > 0);
  knob("NCCL_MAX_CTAS", "max_ctas", std::to_string(config.max_ctas), config.max_ctas > 0);
  knob("NCCL_MAX_NCHANNELS", "max_ctas", std::to_string(config.max_ctas), config.max_ctas > 0);
  // The CTA policy is always passed explicitly, so the variable always wins.
  knob("NCCL_CTA_POLICY", "cta_policy", std::string(CtaPolicyName(config.cta_policy)), true);
  knob("NCCL_CGA_CLUSTER_SIZE", "cga_cluster_size", std::to_string(config.cga_cluster_size),
       config.cga_cluster_size > 0);

  if (const char* v = EnvValue(env, "NCCL_COMM_BLOCKING"); v != nullptr && std::string(v) != "0") {
    out.push_back(std::string("NCCL_COMM_BLOCKING=") + v +
                  " makes NCCL communicators blocking: NCCL calls may then hang and tpserve's "
                  "deadlines cannot interrupt them; unset it");
  }
  if (const char* v = EnvValue(env, "NCCL_COMM_SPLIT_SHARE_RESOURCES");
      v != nullptr && std::string(v) != "1") {
    out.push_back(std::string("NCCL_COMM_SPLIT_SHARE_RESOURCES=") + v +
                  " stops split communicators from sharing their parent's resources "
                  "(tpserve asks for splitShare=1): more memory per variant");
  }
  if (const char* v = EnvValue(env, "NCCL_WIN_ENABLE"); v != nullptr && std::string(v) == "0") {
    out.push_back(
        "NCCL_WIN_ENABLE=0 disables window registration: symmetric buffers and the "
        "copy-engine AllGather of cta_policy=zero are unavailable");
  }
  if (const char* v = EnvValue(env, "NCCL_NVLS_ENABLE"); v == nullptr) {
    out.push_back(
        "NCCL_NVLS_ENABLE is not set: tpserve's GPU hosts require NVLink multicast off "
        "(NCCL_NVLS_ENABLE=0)");
  } else if (std::string(v) != "0") {
    out.push_back(std::string("NCCL_NVLS_ENABLE=") + v +
                  ": tpserve's GPU hosts require NVLink multicast off (NCCL_NVLS_ENABLE=0)");
  }
  return out;
}

// ---- NcclCommunicator ------------------------------------------------------------

void CancelFlag::Cancel(std::string reason) {
  std::lock_guard lock(mu_);
  if (!cancelled_.load(std::memory_order_relaxed)) reason_ = std::move(reason);
  cancelled_.store(true, std::memory_order_release);
}

std::string CancelFlag::reason() const {
  std::lock_guard lock(mu_);
  return reason_;
}

NcclCommunicator::NcclCommunicator(int rank, int nranks, int device, const NcclCommConfig& config,
                                   std::chrono::milliseconds timeout,
                                   std::shared_ptr<const CancelFlag> cancel)
    : rank_(rank),
      nranks_(nranks),
      device_(device),
      config_(config),
      timeout_(timeout),
      cancel_(std::move(cancel)),
      name_("tpserve[" + config.Key() + "]") {}

Status NcclCommunicator::CheckCancelLocked(const std::string& what) {
  if (cancel_ == nullptr || !cancel_->cancelled()) return Status::Ok();
  Status s = AbortedError(what + " given up (rank " + std::to_string(rank_) + " of " +
                          std::to_string(nranks_) + ", communicator " + name_ +
                          "): " + cancel_->reason() + "; communicator aborted");
  AbortLocked(s.message());
  return s;
}

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const ncclUniqueId& id, int nranks, int rank, int cuda_device, const NcclCommConfig& config,
    std::chrono::milliseconds timeout, std::shared_ptr<const CancelFlag> cancel) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return InvalidArgumentError("NcclCommunicator::Create: rank " + std::to_string(rank) +
                                " is not in [0, " + std::to_string(nranks) + ")");
  }
  if (timeout.count() <= 0) {
    return InvalidArgumentError("NcclCommunicator::Create: timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  }
  TP_RETURN_IF_ERROR(config.Validate());
  int device_count = 0;
  TP_CUDA_CHECK(cudaGetDeviceCount(&device_count));
  if (cuda_device < 0 || cuda_device >= device_count) {
    return InvalidArgumentError("NcclCommunicator::Create: CUDA device " +
                                std::to_string(cuda_device) + " does not exist (" +
                                std::to_string(device_count) + " visible)");
  }
  TP_CUDA_CHECK(cudaSetDevice(cuda_device));
  if (CurrentRank() < 0) SetCurrentRank(rank);
  LogEnvOverrides(config);

  std::unique_ptr<NcclCommunicator> comm(
      new NcclCommunicator(rank, nranks, cuda_device, config, timeout, std::move(cancel)));
  TP_RETURN_IF_ERROR(comm->CreateBarrierResources());

  ncclConfig_t nc = ToNcclConfig(config, comm->name_.c_str());
  const Clock::time_point start = Clock::now();
  std::unique_lock lock(comm->mu_);
  ncclComm_t raw = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&raw, nranks, id, rank, &nc);
  comm->comm_ = raw;
  if (raw == nullptr && r != ncclSuccess && r != ncclInProgress) {
    comm->aborted_.store(true, std::memory_order_release);
    return NcclError(r, nullptr, "ncclCommInitRankConfig", __LINE__);
  }
  TP_RETURN_IF_ERROR(comm->FinishLocked(lock, r, "ncclCommInitRankConfig", __LINE__,
                                        DeadlineAfter(start, timeout)));
  spdlog::info("NCCL communicator {} ready: rank {} of {} on device {} in {} ms", comm->name_, rank,
               nranks, cuda_device, MillisSince(start));
  lock.unlock();
  return comm;
}

Status NcclCommunicator::CreateBarrierResources() {
  ScopedDevice guard(device_);
  TP_CUDA_CHECK(cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking));
  const cudaError_t err = cudaMalloc(&barrier_buf_, sizeof(float));
  if (err != cudaSuccess) {
    barrier_buf_ = nullptr;
    return CudaCallError(err, "cudaMalloc(&barrier_buf_, 4)", __FILE__, __LINE__)
        .WithContext("allocating the 4-byte NCCL barrier buffer");
  }
  TP_CUDA_CHECK(cudaMemsetAsync(barrier_buf_, 0, sizeof(float), barrier_stream_));
  TP_CUDA_CHECK(cudaStreamSynchronize(barrier_stream_));
  return Status::Ok();
}

NcclCommunicator::~NcclCommunicator() {
  ScopedDevice guard(device_);
  {
    std::unique_lock lock(mu_);
    if (comm_ != nullptr) {
      const Clock::time_point deadline = DefaultDeadline();
      // Outstanding enqueues first; then finalize (flushes outstanding work,
      // synchronises with the peers) without blocking, so that the wait keeps
      // its deadline; then the purely local destroy.
      Status s = AwaitReadyLocked(lock, "ncclCommFinalize", __LINE__, deadline,
                                  /*before_call=*/true);
      if (s.ok() && comm_ != nullptr) {
        s = FinishLocked(lock, ncclCommFinalize(comm_), "ncclCommFinalize", __LINE__, deadline);
      }
      if (s.ok() && comm_ != nullptr) {
        TP_NCCL_LOG(ncclCommDestroy(comm_), comm_);
        comm_ = nullptr;
      } else if (!s.ok()) {
        spdlog::warn("NCCL communicator {} (rank {}): clean shutdown failed: {}", name_, rank_,
                     s.message());
        AbortLocked(s.message());  // no-op when the failure already aborted
      }
    }
  }
  if (barrier_buf_ != nullptr) TP_CUDA_LOG(cudaFree(barrier_buf_));
  if (barrier_stream_ != nullptr) TP_CUDA_LOG(cudaStreamDestroy(barrier_stream_));
}

void NcclCommunicator::AbandonUnsplit(std::unique_ptr<NcclCommunicator> child) {
  // NCCL's split thread holds &child->comm_ and may still store the new
  // handle there (the parent's abort waits for it only kAbortWait). Freeing
  // the object could let that store land in freed memory, so a failed
  // split's few bytes (and its barrier buffer and stream) are kept instead.
  spdlog::warn(
      "NCCL communicator {} (rank {}): a failed split's communicator object is kept "
      "for NCCL's late store",
      name_, rank_);
  (void)child.release();
}

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Split(const NcclCommConfig& config) {
  TP_RETURN_IF_ERROR(config.Validate());
  LogEnvOverrides(config);
  std::unique_ptr<NcclCommunicator> child(
      new NcclCommunicator(rank_, nranks_, device_, config, timeout_, cancel_));
  TP_RETURN_IF_ERROR(child->CreateBarrierResources());
  ncclConfig_t nc = ToNcclConfig(config, child->name_.c_str());
  nc.splitShare = 1;

  ScopedDevice guard(device_);
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = DeadlineAfter(start, timeout_);
  {
    std::unique_lock lock(mu_);
    TP_RETURN_IF_ERROR(
        AwaitReadyLocked(lock, "ncclCommSplit", __LINE__, deadline, /*before_call=*/true));
    // NCCL writes the child's handle from its background thread when the
    // split completes: the destination must outlive the wait below, hence the
    // child's own member rather than a local. child->mu_ is not contended yet.
    const ncclResult_t r = ncclCommSplit(comm_, /*color=*/0, /*key=*/rank_, &child->comm_, &nc);
    Status s = FinishLocked(lock, r, "ncclCommSplit", __LINE__, deadline);
    if (!s.ok()) {
      // A failed parent was aborted by FinishLocked (an aborted parent joins
      // the split's thread); abort the child too if NCCL made one.
      const bool stored = __atomic_load_n(&child->comm_, __ATOMIC_ACQUIRE) != nullptr;
      {
        std::lock_guard child_lock(child->mu_);
        child->AbortLocked(s.message());
      }
      if (!stored) AbandonUnsplit(std::move(child));
      return s;
    }
  }
  // With a non-blocking parent, NCCL may store the child's handle from its
  // background thread after the parent reports success (seen with NCCL
  // 2.28.9 on the H200 host): wait for the store, within the deadline.
  while (__atomic_load_n(&child->comm_, __ATOMIC_ACQUIRE) == nullptr && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (__atomic_load_n(&child->comm_, __ATOMIC_ACQUIRE) == nullptr) {
    Status s =
        InternalError("ncclCommSplit reported success but stored no communicator within " +
                      std::to_string(MillisSince(start)) + " ms (rank " + std::to_string(rank_) +
                      ", config " + config.Key() + "); parent communicator aborted");
    {
      std::lock_guard lock(mu_);
      AbortLocked(s.message());
    }
    // A store that lands now is never aborted; the leaked object's handle
    // then lives until the process exits, as a failed server does soon.
    AbandonUnsplit(std::move(child));
    return s;
  }
  std::unique_lock child_lock(child->mu_);
  TP_RETURN_IF_ERROR(
      child->AwaitReadyLocked(child_lock, "ncclCommSplit (new communicator)", __LINE__, deadline));
  child_lock.unlock();
  spdlog::info("NCCL communicator {} split from {}: rank {} of {} in {} ms", child->name_, name_,
               rank_, nranks_, MillisSince(start));
  return child;
}

ncclComm_t NcclCommunicator::raw() const {
  std::lock_guard lock(mu_);
  return comm_;
}

Status NcclCommunicator::AbortedErrorLocked(std::string_view what) const {
  return AbortedError("NCCL communicator " + name_ + " (rank " + std::to_string(rank_) +
                      ") was aborted (" +
                      (abort_reason_.empty() ? std::string("reason unknown") : abort_reason_) +
                      "); " + std::string(what) + " not done");
}

void NcclCommunicator::AbortLocked(const std::string& reason) {
  aborted_.store(true, std::memory_order_release);
  if (abort_reason_.empty()) abort_reason_ = reason;
  if (comm_ == nullptr) return;
  spdlog::warn("aborting NCCL communicator {} (rank {} of {}): {}", name_, rank_, nranks_, reason);
  // The handle is freed by the call: no ncclGetLastError(comm) afterwards.
  // ncclCommAbort first raises the flag that makes this rank's NCCL kernels
  // return, then reclaims its resources, which can block for good when a
  // peer process is gone (it waits on proxy threads and peers; seen on the
  // H200 host with a killed worker). So it runs on a thread of its own, and
  // after kAbortWait the abort goes on in the background: the communicator
  // is unusable either way, and no caller (all of them wait for mu_) may
  // hang behind it.
  ncclComm_t comm = comm_;
  comm_ = nullptr;
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  const int device = device_;
  std::thread([comm, device, done] {
    ScopedDevice guard(device);
    TP_NCCL_LOG(ncclCommAbort(comm), nullptr);
    done->set_value();
  }).detach();
  if (finished.wait_for(kAbortWait) != std::future_status::ready) {
    spdlog::warn(
        "NCCL communicator {} (rank {}): ncclCommAbort did not return within {} ms (a "
        "peer process gone?); it continues in the background",
        name_, rank_, kAbortWait.count());
  }
}

void NcclCommunicator::Abort() {
  std::lock_guard lock(mu_);
  AbortLocked("Abort() called");
}

Status NcclCommunicator::AwaitReadyLocked(std::unique_lock<std::mutex>& lock, std::string_view what,
                                          int line, Clock::time_point deadline, bool before_call) {
  const Clock::time_point start = Clock::now();
  // Names what the state belongs to: the call just made, or earlier work.
  const auto subject = [&] {
    return before_call ? "earlier NCCL work (seen before " + std::string(what) + ")"
                       : std::string(what);
  };
  Backoff backoff;
  for (;;) {
    if (comm_ == nullptr) return AbortedErrorLocked(what);
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
    if (q != ncclSuccess) {
      Status s = NcclError(q, comm_, "ncclCommGetAsyncError", __LINE__).WithContext(what);
      AbortLocked(s.message());
      return s;
    }
    if (state == ncclSuccess) return Status::Ok();
    if (state != ncclInProgress) {
      Status s = NcclError(state, comm_, subject(), line);
      AbortLocked(s.message());
      return s;
    }
    TP_RETURN_IF_ERROR(CheckCancelLocked(subject()));
    if (Clock::now() >= deadline) {
      Status s = DeadlineExceededError(
          subject() + " still in progress after " + std::to_string(MillisSince(start)) +
          " ms (rank " + std::to_string(rank_) + " of " + std::to_string(nranks_) +
          ", communicator " + name_ + "): a peer missing or stuck? Communicator aborted");
      AbortLocked(s.message());
      return s;
    }
    lock.unlock();
    backoff.Pause();
    lock.lock();
  }
}

Status NcclCommunicator::FinishLocked(std::unique_lock<std::mutex>& lock, ncclResult_t result,
                                      std::string_view what, int line, Clock::time_point deadline) {
  if (result == ncclSuccess) return Status::Ok();
  if (result == ncclInProgress) return AwaitReadyLocked(lock, what, line, deadline);
  Status s = NcclError(result, comm_, what, line);
  // NCCL's docs: an invalid argument has no effect and leaves the communicator
  // working. Everything else is fatal for it.
  if (result != ncclInvalidArgument) AbortLocked(s.message());
  return s;
}

Status NcclCommunicator::Issue(std::string_view what, int line,
                               const std::function<ncclResult_t(ncclComm_t)>& call) {
  const Clock::time_point deadline = DefaultDeadline();
  std::unique_lock lock(mu_);
  // Also surfaces asynchronous errors of earlier operations before enqueuing
  // more work behind them.
  TP_RETURN_IF_ERROR(AwaitReadyLocked(lock, what, line, deadline, /*before_call=*/true));
  const ncclResult_t r = call(comm_);
  return FinishLocked(lock, r, what, line, deadline);
}

Status NcclCommunicator::Enqueue(std::string_view what,
                                 const std::function<ncclResult_t(ncclComm_t)>& call) {
  return Issue(what, __LINE__, call);
}

Status NcclCommunicator::AllGather(const void* send, void* recv, size_t bytes_per_rank,
                                   StreamHandle stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return Issue("ncclAllGather", __LINE__, [&](ncclComm_t c) {
    return ncclAllGather(send, recv, bytes_per_rank, ncclUint8, c, s);
  });
}

Status NcclCommunicator::ReduceScatter(const void* send, void* recv, size_t count, DataType dtype,
                                       StreamHandle stream) {
  ncclDataType_t type;
  switch (dtype) {
    case DataType::kFloat32:
      type = ncclFloat32;
      break;
    case DataType::kBFloat16:
      type = ncclBfloat16;
      break;
    default:
      return InvalidArgumentError("NCCL ReduceScatter: element type " +
                                  std::string(DataTypeName(dtype)) +
                                  " is not supported (f32 or bf16)");
  }
  auto s = static_cast<cudaStream_t>(stream);
  return Issue("ncclReduceScatter", __LINE__, [&](ncclComm_t c) {
    return ncclReduceScatter(send, recv, count, type, ncclSum, c, s);
  });
}

Status NcclCommunicator::Send(const void* buf, size_t bytes, int peer, StreamHandle stream) {
  TP_RETURN_IF_ERROR(CheckPeer("ncclSend", "peer", peer, nranks_));
  auto s = static_cast<cudaStream_t>(stream);
  return Issue("ncclSend", __LINE__,
               [&](ncclComm_t c) { return ncclSend(buf, bytes, ncclUint8, peer, c, s); });
}

Status NcclCommunicator::Recv(void* buf, size_t bytes, int peer, StreamHandle stream) {
  TP_RETURN_IF_ERROR(CheckPeer("ncclRecv", "peer", peer, nranks_));
  auto s = static_cast<cudaStream_t>(stream);
  return Issue("ncclRecv", __LINE__,
               [&](ncclComm_t c) { return ncclRecv(buf, bytes, ncclUint8, peer, c, s); });
}

Status NcclCommunicator::Broadcast(void* buf, size_t bytes, int root, StreamHandle stream) {
  TP_RETURN_IF_ERROR(CheckPeer("ncclBroadcast", "root", root, nranks_));
  auto s = static_cast<cudaStream_t>(stream);
  return Issue("ncclBroadcast", __LINE__,
               [&](ncclComm_t c) { return ncclBroadcast(buf, buf, bytes, ncclUint8, root, c, s); });
}

Status NcclCommunicator::SendRecv(const void* send_buf, size_t send_bytes, int send_peer,
                                  void* recv_buf, size_t recv_bytes, int recv_peer,
                                  StreamHandle stream) {
  const bool do_send = send_peer != -1;
  const bool do_recv = recv_peer != -1;
  if (do_send) TP_RETURN_IF_ERROR(CheckPeer("SendRecv", "send_peer", send_peer, nranks_));
  if (do_recv) TP_RETURN_IF_ERROR(CheckPeer("SendRecv", "recv_peer", recv_peer, nranks_));
  if (!do_send && !do_recv) return Status::Ok();
  auto s = static_cast<cudaStream_t>(stream);
  return Issue("ncclGroupStart; ncclSend; ncclRecv; ncclGroupEnd", __LINE__, [&](ncclComm_t c) {
    const ncclResult_t start = ncclGroupStart();
    if (start != ncclSuccess) return start;
    // Within a group, a failed call poisons the group and ncclGroupEnd cleans
    // it up and reports; the group must be closed in every case.
    const ncclResult_t rs =
        do_send ? ncclSend(send_buf, send_bytes, ncclUint8, send_peer, c, s) : ncclSuccess;
    const ncclResult_t rr =
        do_recv ? ncclRecv(recv_buf, recv_bytes, ncclUint8, recv_peer, c, s) : ncclSuccess;
    const ncclResult_t re = ncclGroupEnd();
    for (ncclResult_t r : {rs, rr}) {
      if (r != ncclSuccess && r != ncclInProgress) return r;
    }
    return re;
  });
}

Status NcclCommunicator::Barrier() {
  TP_RETURN_IF_ERROR(Issue("ncclAllReduce (Barrier)", __LINE__, [&](ncclComm_t c) {
    return ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, c, barrier_stream_);
  }));
  return WaitStream(barrier_stream_, DefaultDeadline());
}

Status NcclCommunicator::WaitStream(cudaStream_t stream) {
  return WaitStream(stream, DefaultDeadline());
}

Status NcclCommunicator::WaitStream(cudaStream_t stream, Clock::time_point deadline) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    return FailedPreconditionError(
        "NcclCommunicator::WaitStream: the stream is being captured into a CUDA graph; wait "
        "after the graph's launch instead");
  }
  const Clock::time_point start = Clock::now();
  std::shared_ptr<StreamSignal> signal;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    {
      std::unique_lock lock(mu_);
      if (comm_ == nullptr) return AbortedErrorLocked("WaitStream");
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) {
        Status s = NcclError(r, comm_, "ncclCommGetAsyncError", __LINE__).WithContext("WaitStream");
        AbortLocked(s.message());
        return s;
      }
      if (state != ncclSuccess && state != ncclInProgress) {
        Status s =
            NcclError(state, comm_, "asynchronous error while waiting for a stream", __LINE__);
        AbortLocked(s.message());
        return s;
      }
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady) {
        Status s = CudaCallError(q, "cudaStreamQuery(stream)", __FILE__, __LINE__);
        AbortLocked(s.message());
        return s;
      }
      TP_RETURN_IF_ERROR(CheckCancelLocked("NCCL work on a stream"));
      if (Clock::now() >= deadline) {
        Status s = DeadlineExceededError(
            "NCCL work on a stream did not complete within " + std::to_string(MillisSince(start)) +
            " ms (rank " + std::to_string(rank_) + " of " + std::to_string(nranks_) +
            ", communicator " + name_ + "): a peer missing or stuck? Communicator aborted");
        AbortLocked(s.message());
        return s;
      }
    }
    // Work of up to 20 ms (a decode step) is polled, its end seen within a poll; longer work
    // signals its end through a host function (a later wake-up, but no core held). Errors,
    // cancellation and the deadline above are checked between waits.
    if (signal == nullptr && Clock::now() - start >= std::chrono::milliseconds(20)) {
      signal = StreamSignal::Enqueue(stream);
    }
    if (signal != nullptr) {
      signal->WaitFor(std::chrono::milliseconds(2));
    } else {
      std::this_thread::yield();
    }
  }
}

// ---- NcclSymmetricBuffer -----------------------------------------------------------

StatusOr<NcclSymmetricBuffer> NcclSymmetricBuffer::Create(NcclCommunicator& comm, size_t bytes,
                                                          std::string name) {
  const std::string what = "symmetric buffer '" + name + "' (" + std::to_string(bytes) + " bytes)";
  if (bytes == 0) return InvalidArgumentError(what + ": size must be positive");
  NcclSymmetricBuffer buf;
  buf.name_ = std::move(name);
  buf.bytes_ = bytes;
  {
    ScopedDevice guard(comm.device());
    const ncclResult_t r = ncclMemAlloc(&buf.ptr_, bytes);
    if (r != ncclSuccess) {
      buf.ptr_ = nullptr;
      Status s = NcclError(r, nullptr, "ncclMemAlloc", __LINE__);
      return Status(StatusCode::kResourceExhausted, "allocating " + what + " on device " +
                                                        std::to_string(comm.device()) +
                                                        " failed: " + s.message());
    }
  }
  const std::string register_what = "ncclCommWindowRegister(" + what + ")";
  ncclWindow_t* window = &buf.window_;
  void* ptr = buf.ptr_;
  Status s = comm.Issue(register_what, __LINE__, [&](ncclComm_t c) {
    return ncclCommWindowRegister(c, ptr, bytes, window, NCCL_WIN_COLL_SYMMETRIC);
  });
  // As with ncclCommSplit, a non-blocking communicator may store the window
  // handle from NCCL's background thread after the call reports success (seen
  // with NCCL 2.28.9): wait for it here, while `buf` cannot move.
  const auto deadline = DeadlineAfter(NcclCommunicator::Clock::now(), comm.timeout());
  while (s.ok() && __atomic_load_n(&buf.window_, __ATOMIC_ACQUIRE) == nullptr &&
         NcclCommunicator::Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (s.ok() && __atomic_load_n(&buf.window_, __ATOMIC_ACQUIRE) == nullptr) {
    s = InternalError(register_what + " returned no window within " +
                      std::to_string(comm.timeout().count()) + " ms; communicator aborted");
    // A missed deadline aborts, as every other wait here does: left running,
    // the registration could complete on a live communicator after `buf`'s
    // memory is freed below.
    std::lock_guard lock(comm.mu_);
    comm.AbortLocked(s.message());
  }
  if (!s.ok()) return s;  // buf's destructor frees the memory
  buf.comm_ = &comm;
  return buf;
}

NcclSymmetricBuffer::NcclSymmetricBuffer(NcclSymmetricBuffer&& other) noexcept
    : comm_(std::exchange(other.comm_, nullptr)),
      ptr_(std::exchange(other.ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      window_(std::exchange(other.window_, nullptr)),
      name_(std::move(other.name_)) {}

NcclSymmetricBuffer& NcclSymmetricBuffer::operator=(NcclSymmetricBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    comm_ = std::exchange(other.comm_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    window_ = std::exchange(other.window_, nullptr);
    name_ = std::move(other.name_);
  }
  return *this;
}

NcclSymmetricBuffer::~NcclSymmetricBuffer() { Reset(); }

void NcclSymmetricBuffer::Reset() {
  if (window_ != nullptr && comm_ != nullptr && !comm_->aborted()) {
    ncclWindow_t window = window_;
    Status s = comm_->Issue("ncclCommWindowDeregister(symmetric buffer '" + name_ + "')", __LINE__,
                            [&](ncclComm_t c) { return ncclCommWindowDeregister(c, window); });
    if (!s.ok()) spdlog::error("{}", s.message());
  }
  window_ = nullptr;
  if (ptr_ != nullptr) {
    const ncclResult_t r = ncclMemFree(ptr_);
    if (r != ncclSuccess) {
      spdlog::error("ncclMemFree of symmetric buffer '{}' ({} bytes) failed: {}", name_, bytes_,
                    ncclGetErrorString(r));
    }
  }
  ptr_ = nullptr;
  bytes_ = 0;
  comm_ = nullptr;
}

// ---- NcclCommPool -------------------------------------------------------------------

NcclCommPool::NcclCommPool(std::unique_ptr<NcclCommunicator> base) : base_(std::move(base)) {}

NcclCommPool::~NcclCommPool() {
  std::vector<std::pair<std::string, std::unique_ptr<NcclCommunicator>>> variants;
  {
    std::lock_guard lock(mu_);
    variants.swap(variants_);
  }
  while (!variants.empty()) variants.pop_back();  // newest first
  base_.reset();
}

StatusOr<NcclCommunicator*> NcclCommPool::Get(const NcclCommConfig& config) {
  if (base_ == nullptr) return FailedPreconditionError("NcclCommPool has no base communicator");
  if (config == base_->config()) return base_.get();
  const std::string key = config.Key();
  {
    std::lock_guard lock(mu_);
    for (auto& [k, comm] : variants_) {
      if (k == key) return comm.get();
    }
  }
  // Not under mu_: a split takes a while and Abort() must be able to stop it.
  auto made = base_->Split(config);
  if (!made.ok()) return made.status().WithContext("NCCL communicator pool, config " + key);
  NcclCommunicator* out = made->get();
  std::lock_guard lock(mu_);
  variants_.emplace_back(key, std::move(made).value());
  return out;
}

size_t NcclCommPool::num_variants() const {
  std::lock_guard lock(mu_);
  return variants_.size();
}

void NcclCommPool::Abort() {
  // Parent first, then the split communicators: NCCL's documented order for
  // stopping a split in progress.
  if (base_ != nullptr) base_->Abort();
  std::lock_guard lock(mu_);
  for (auto& [key, comm] : variants_) comm->Abort();
}

}  // namespace tpserve
