// NcclCommunicator: the Communicator interface over one NCCL communicator
// (one rank = one process = one GPU in production; threads as ranks in tests).
//
// Every communicator is NON-BLOCKING (ncclConfig_t.blocking = 0), so that no
// NCCL call can hang the calling thread and every wait has a deadline:
//  - NCCL calls on a non-blocking communicator may return ncclInProgress: the
//    operation is being set up / enqueued by a NCCL background thread. NCCL's
//    docs require the caller to poll ncclCommGetAsyncError until the state is
//    no longer ncclInProgress before making another NCCL call on that
//    communicator and before putting more work on the streams NCCL uses.
//    Every method here does that before returning (bounded by the
//    communicator's timeout; on expiry it aborts and returns
//    DEADLINE_EXCEEDED), so callers never see ncclInProgress and the stream
//    order they observe is the order of their calls.
//  - This also holds while the calling thread captures a CUDA graph: when
//    NCCL finishes an enqueue in its background thread, that thread launches
//    into the capturing stream, and the method returns only after that launch,
//    i.e. before the caller records its next node or ends the capture. Capture
//    with cudaStreamCaptureModeThreadLocal (or Relaxed): in Global mode the
//    NCCL thread's own CUDA calls would invalidate the capture. Issue the same
//    collectives eagerly once before capturing, so that connection setup
//    (what makes NCCL go asynchronous) happens outside the graph.
//  - Stream-ordered methods (AllGather, ReduceScatter, Send, Recv, Broadcast,
//    SendRecv) only enqueue. WaitStream() waits for a stream with a deadline,
//    watching the communicator for asynchronous errors (never
//    cudaStreamSynchronize: a dead peer would hang it forever).
//  - Errors: ncclInvalidArgument leaves the communicator usable (NCCL's docs:
//    the call had no effect). Every other error, an asynchronous error, or a
//    missed deadline aborts the communicator (ncclCommAbort); afterwards every
//    method returns ABORTED with the first reason. Peers are not told: they
//    find out through their own deadlines or NCCL's remote-error detection.
//    Split communicators share their parent's abort flag (splitShare = 1), so
//    aborting one stops the kernels of the whole family: abort them all
//    (NcclCommPool::Abort).
//
// Thread-safety: one thread (the rank's) calls the methods of a communicator;
// Abort() may be called from any thread at any time (it waits for a NCCL call
// in progress on another thread to return, as NCCL requires). Collectives,
// Split, symmetric-buffer registration and destruction are collective: all
// ranks make the same calls in the same order.
//
// Shutdown order: CUDA graphs that captured a communicator's operations, then
// symmetric buffers registered on it, then split communicators, then their
// parent (NCCL >= 2.26 blocks communicator destruction while a graph still
// references it; here that wait ends at the timeout with an abort).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/deadline.h"
#include "comm/nccl_bootstrap.h"
#include "comm/nccl_config.h"
#include "comm/status.h"

namespace tpserve {

// Warnings about NCCL environment variables that silently change what
// `config` asks for (NCCL reads them at communicator creation and lets them
// win over ncclConfig_t): NCCL_MIN_CTAS / NCCL_MAX_CTAS (and the legacy
// NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS), NCCL_CTA_POLICY,
// NCCL_CGA_CLUSTER_SIZE, NCCL_COMM_BLOCKING other than 0 (would make calls
// blocking, so deadlines could no longer interrupt them),
// NCCL_COMM_SPLIT_SHARE_RESOURCES other than 1, NCCL_WIN_ENABLE=0 (no
// symmetric windows), and NCCL_NVLS_ENABLE unset or not 0 (tpserve's GPU hosts
// must keep NVLink multicast off). One message per finding; empty if none.
// Create() and Split() log these with spdlog (each distinct message once per
// process).
std::vector<std::string> NcclEnvOverrides(const NcclCommConfig& config,
                                          const EnvLookup& env = ProcessEnv());

class NcclSymmetricBuffer;

// Raised by another thread to make every wait of the communicators that hold
// it give up now rather than at their deadline: rank 0's watcher raises it
// when a worker process exits while the model loads, so that start-up fails
// within milliseconds, naming the worker, instead of after --rank-timeout-s.
// A communicator that sees it raised while waiting aborts (as on a missed
// deadline) and returns ABORTED with the reason. Thread-safe.
class CancelFlag {
 public:
  // The first reason is kept.
  void Cancel(std::string reason);
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  std::string reason() const;

 private:
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  std::string reason_;
};

class NcclCommunicator final : public Communicator {
 public:
  using Clock = std::chrono::steady_clock;

  // Joins the communicator `id` as `rank` of `nranks`, driving `cuda_device`
  // (made current on the calling thread, as NCCL requires). Collective: every
  // rank calls it with the same id and nranks. Initialisation runs in NCCL's
  // background thread; this waits for it for at most `timeout`, then aborts
  // and returns DEADLINE_EXCEEDED. `timeout` also bounds every later internal
  // wait (see the file comment) and Barrier(). `cancel` (optional; shared with
  // communicators split from this one) ends any wait early once raised.
  static StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const ncclUniqueId& id, int nranks, int rank, int cuda_device, const NcclCommConfig& config,
      std::chrono::milliseconds timeout, std::shared_ptr<const CancelFlag> cancel = nullptr);

  // Finalizes and destroys the NCCL communicator (waiting at most timeout()
  // for outstanding work and peers, then aborting), or aborts it if it is in
  // error. Collective among the ranks of one node, as ncclCommDestroy is.
  // Logs failures; never throws.
  ~NcclCommunicator() override;

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // A communicator over the same ranks (same rank numbers) with `config`:
  // ncclCommSplit(color 0, key = rank, splitShare = 1). Collective on this
  // communicator; no operation of it may be outstanding. The result has this
  // communicator's device and timeout, and must be destroyed before it.
  StatusOr<std::unique_ptr<NcclCommunicator>> Split(const NcclCommConfig& config);

  int rank() const override { return rank_; }
  int size() const override { return nranks_; }
  int device() const { return device_; }
  const NcclCommConfig& config() const { return config_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Communicator (stream-ordered: enqueue and return; `stream` is a
  // cudaStream_t on this communicator's device).
  Status AllGather(const void* send, void* recv, size_t bytes_per_rank,
                   StreamHandle stream) override;
  // Sum; dtype kFloat32 or kBFloat16 (NCCL rounds BF16 per reduction step).
  Status ReduceScatter(const void* send, void* recv, size_t count, DataType dtype,
                       StreamHandle stream) override;
  Status Send(const void* buf, size_t bytes, int peer, StreamHandle stream) override;
  Status Recv(void* buf, size_t bytes, int peer, StreamHandle stream) override;
  // In place: root's `buf` into everyone's `buf`.
  Status Broadcast(void* buf, size_t bytes, int root, StreamHandle stream) override;
  // A one-element all-reduce on an internal stream, waited for with the
  // communicator's timeout. Not while this thread captures a CUDA graph.
  Status Barrier() override;
  // Aborts the NCCL communicator now (ncclCommAbort): kernels of this rank
  // exit, pending and later calls return ABORTED. Idempotent, any thread.
  void Abort() override;

  // Sends `send_bytes` to `send_peer` and receives `recv_bytes` from
  // `recv_peer` as one NCCL group, so the two progress together and a ring of
  // these calls (send to rank+1, receive from rank-1) cannot deadlock. A peer
  // of -1 skips that side. A side with 0 bytes is still posted (its peer must
  // post the matching 0-byte side).
  Status SendRecv(const void* send_buf, size_t send_bytes, int send_peer, void* recv_buf,
                  size_t recv_bytes, int recv_peer, StreamHandle stream) override;

  // Waits until all work on `stream` has completed: polls cudaStreamQuery (yielding
  // between polls) for the first 20 ms, so that a decode step's end is seen at once,
  // then enqueues a host function behind the work and sleeps until
  // it fires, checking ncclCommGetAsyncError and cancellation every 2 ms
  // meanwhile (the host function runs on the stream: a caller's later work on
  // it queues behind that call). On an asynchronous NCCL error, a CUDA error or
  // the deadline, aborts the communicator (so that its kernels exit) and
  // returns the error (DEADLINE_EXCEEDED for the deadline); never hangs.
  // FAILED_PRECONDITION if `stream` is being captured.
  Status WaitStream(cudaStream_t stream, Clock::time_point deadline);
  // Deadline = now + timeout().
  Status WaitStream(cudaStream_t stream);

  // For code that calls NCCL itself with raw() (e.g. grouped launches): runs
  // `call(raw())` under this communicator's lock and applies the same
  // protocol as the methods above (waits out ncclInProgress, aborts on fatal
  // errors). `what` names the call in errors.
  Status Enqueue(std::string_view what, const std::function<ncclResult_t(ncclComm_t)>& call);

  // The NCCL handle, or nullptr once aborted. Callers that use it directly
  // must follow the non-blocking protocol above (or use Enqueue).
  ncclComm_t raw() const;
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

 private:
  friend class NcclSymmetricBuffer;

  NcclCommunicator(int rank, int nranks, int device, const NcclCommConfig& config,
                   std::chrono::milliseconds timeout, std::shared_ptr<const CancelFlag> cancel);
  // Non-OK (and the communicator aborted) once cancel_ is raised; `what` is
  // the wait's subject.
  Status CheckCancelLocked(const std::string& what);
  // Disposes of a child whose ncclCommSplit failed before NCCL stored its
  // handle: deliberately leaked, since NCCL may still store it.
  void AbandonUnsplit(std::unique_ptr<NcclCommunicator> child);

  Status CreateBarrierResources();
  Clock::time_point DefaultDeadline() const { return DeadlineAfter(Clock::now(), timeout_); }

  // Issues `call` and applies the protocol. `line` locates the call site.
  Status Issue(std::string_view what, int line,
               const std::function<ncclResult_t(ncclComm_t)>& call);
  // Turns the result of a NCCL call made under `lock` into a Status.
  Status FinishLocked(std::unique_lock<std::mutex>& lock, ncclResult_t result,
                      std::string_view what, int line, Clock::time_point deadline);
  // Polls until the communicator's state is not ncclInProgress; unlocks
  // between polls so that Abort() can get in. `before_call`: the state is
  // checked before issuing `what`, so an error belongs to earlier work.
  Status AwaitReadyLocked(std::unique_lock<std::mutex>& lock, std::string_view what, int line,
                          Clock::time_point deadline, bool before_call = false);
  // Marks the communicator aborted and aborts it in NCCL, waiting at most
  // kAbortWait for ncclCommAbort (which may then finish in the background).
  void AbortLocked(const std::string& reason);
  Status AbortedErrorLocked(std::string_view what) const;
  static constexpr std::chrono::milliseconds kAbortWait{5000};

  const int rank_;
  const int nranks_;
  const int device_;
  const NcclCommConfig config_;
  const std::chrono::milliseconds timeout_;
  const std::shared_ptr<const CancelFlag> cancel_;
  // Handed to NCCL as ncclConfig_t.commName; lives as long as the communicator.
  const std::string name_;

  mutable std::mutex mu_;      // guards comm_ and abort_reason_; held
                               // during every NCCL call on comm_
  ncclComm_t comm_ = nullptr;  // nullptr once aborted or destroyed
  std::string abort_reason_;
  std::atomic<bool> aborted_{false};

  cudaStream_t barrier_stream_ = nullptr;
  float* barrier_buf_ = nullptr;  // one float, device memory
};

// Device memory from ncclMemAlloc registered as a symmetric window
// (ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC) on one communicator:
// what NCCL needs for its symmetric kernels and for copy-engine AllGather
// (CtaPolicy::kZero). Every rank must use the same offsets into its buffer in
// a collective. Move-only; the destructor deregisters (skipped if the
// communicator was aborted) and frees. The buffer must not outlive its
// communicator, and no NCCL work (or live CUDA graph) may use it when it is
// destroyed. A buffer may be registered on one communicator only.
class NcclSymmetricBuffer {
 public:
  // Allocates `bytes` (> 0) on comm's device and registers them. Collective
  // over `comm`: all ranks call it in the same order (sizes may differ but
  // collectives may only touch ranges valid on every rank). Errors name the
  // buffer and its size.
  static StatusOr<NcclSymmetricBuffer> Create(NcclCommunicator& comm, size_t bytes,
                                              std::string name);

  NcclSymmetricBuffer() = default;
  NcclSymmetricBuffer(NcclSymmetricBuffer&& other) noexcept;
  NcclSymmetricBuffer& operator=(NcclSymmetricBuffer&& other) noexcept;
  NcclSymmetricBuffer(const NcclSymmetricBuffer&) = delete;
  NcclSymmetricBuffer& operator=(const NcclSymmetricBuffer&) = delete;
  ~NcclSymmetricBuffer();

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  ncclWindow_t window() const { return window_; }

  // Deregisters and frees now (what the destructor does); logs failures.
  void Reset();

 private:
  NcclCommunicator* comm_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  ncclWindow_t window_ = nullptr;
  std::string name_;
};

// A base communicator and the Split variants made from it on demand, one per
// distinct NcclCommConfig::Key(). Owns them all; destroys the variants (newest
// first) before the base.
//
// Get() is collective: the first request of a key makes a new communicator by
// ncclCommSplit on the base, so every rank must request the same configs in
// the same order (in practice: walk the layer configuration in a fixed order
// at start-up, before any CUDA graph is captured). Get() and the destructor
// are called by the rank's thread; Abort() from any thread.
class NcclCommPool {
 public:
  explicit NcclCommPool(std::unique_ptr<NcclCommunicator> base);
  ~NcclCommPool();

  NcclCommPool(const NcclCommPool&) = delete;
  NcclCommPool& operator=(const NcclCommPool&) = delete;

  NcclCommunicator& base() const { return *base_; }

  // The communicator for `config`: the base if config equals the base's
  // config, else the variant with its key, made now if needed.
  StatusOr<NcclCommunicator*> Get(const NcclCommConfig& config);

  size_t num_variants() const;

  // Aborts the base and every variant (they share the base's abort flag).
  void Abort();

 private:
  mutable std::mutex mu_;  // guards variants_ (Get appends; Abort reads)
  std::unique_ptr<NcclCommunicator> base_;
  std::vector<std::pair<std::string, std::unique_ptr<NcclCommunicator>>> variants_;
};

}  // namespace tpserve
