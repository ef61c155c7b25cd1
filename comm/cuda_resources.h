// Move-only RAII owners for CUDA runtime handles: stream, event, device memory, pinned host
// memory, graph.
//
// Factories return StatusOr and never throw. Destructors are noexcept: a failing release is
// logged (TP_CUDA_LOG), never thrown, and a moved-from owner releases nothing.
//
// Every owner belongs to the device that was current when its factory ran; enqueue work on it
// only with that device current. None of these types is thread-safe: an object used from
// several threads needs external synchronisation (handing it over is fine).
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "comm/status.h"

namespace tpserve {

// A cudaStream_t.
class CudaStream {
 public:
  // non_blocking: cudaStreamNonBlocking, i.e. no implicit synchronisation with the legacy
  // default stream (what NCCL and graph capture want). priority: lower numbers run first;
  // nullopt keeps the default priority. A priority outside
  // cudaDeviceGetStreamPriorityRange() is INVALID_ARGUMENT (CUDA would clamp it silently).
  static StatusOr<CudaStream> Create(bool non_blocking = true,
                                     std::optional<int> priority = std::nullopt);

  CudaStream() = default;  // empty: get() == nullptr, which CUDA reads as the legacy stream
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }

  // Blocks the calling thread until all work on the stream is done. Not for the serving path
  // (no deadline); use Query() to poll there.
  Status Synchronize() const;
  // true when all work enqueued so far has completed.
  StatusOr<bool> Query() const;

 private:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  void Reset() noexcept;

  cudaStream_t stream_ = nullptr;
};

// A cudaEvent_t. Without timing (the default) it is the cheap kind for stream fork/join.
class CudaEvent {
 public:
  static StatusOr<CudaEvent> Create(bool enable_timing = false);

  CudaEvent() = default;  // empty
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  bool timing_enabled() const { return timing_; }

  // cudaEventRecord(event, stream).
  Status Record(cudaStream_t stream) const;
  // Makes `stream` wait for the work captured by the last Record (cudaStreamWaitEvent).
  Status WaitOn(cudaStream_t stream) const;
  // true when the recorded work has completed.
  StatusOr<bool> Query() const;
  // Milliseconds between two completed records; both events need enable_timing.
  static StatusOr<float> ElapsedMs(const CudaEvent& start, const CudaEvent& end);

 private:
  CudaEvent(cudaEvent_t e, bool timing) : event_(e), timing_(timing) {}
  void Reset() noexcept;

  cudaEvent_t event_ = nullptr;
  bool timing_ = false;
};

// Device memory from cudaMalloc, with a name for error messages.
class DeviceBuffer {
 public:
  // bytes == 0 gives an empty buffer (data() == nullptr) without calling CUDA. Out of memory is
  // RESOURCE_EXHAUSTED naming the buffer, the requested size and the device's free memory.
  // Memory is uninitialised.
  static StatusOr<DeviceBuffer> Allocate(size_t bytes, std::string name);

  DeviceBuffer() = default;  // empty
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }  // bytes
  bool empty() const { return size_ == 0; }
  const std::string& name() const { return name_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  DeviceBuffer(void* data, size_t size, std::string name)
      : data_(data), size_(size), name_(std::move(name)) {}
  void Reset() noexcept;

  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
};

// Page-locked host memory from cudaMallocHost, with a name for error messages: the source or
// destination of asynchronous copies that run at the link's speed and return at once (a copy
// from pageable memory is staged by the driver and blocks the caller). Reuse one across passes:
// allocating it costs far more than a copy.
class PinnedHostBuffer {
 public:
  // bytes == 0 gives an empty buffer without calling CUDA. Failure is RESOURCE_EXHAUSTED naming
  // the buffer and the size. Memory is uninitialised.
  static StatusOr<PinnedHostBuffer> Allocate(size_t bytes, std::string name);

  PinnedHostBuffer() = default;  // empty
  ~PinnedHostBuffer();
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }  // bytes
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void Reset() noexcept;

  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
};

// An instantiated CUDA graph (cudaGraphExec_t) together with the cudaGraph_t it came from.
// Destroy it before anything the graph references (buffers, and NCCL communicators: NCCL
// >= 2.26 blocks communicator destruction while a graph still references it).
class CudaGraphExec {
 public:
  // How a graph's kernels are prioritised when it runs. kPerNode (the default) instantiates
  // with cudaGraphInstantiateFlagUseNodePriority: each kernel node keeps the priority of the
  // stream it was captured from, as when the same work is enqueued eagerly (a layer's comm
  // stream outranks its GEMMs', so NCCL's kernels get SMs ahead of queued GEMM blocks).
  // kLaunchStream is CUDA's default: every kernel of the graph runs at the priority of the
  // stream the graph is launched into. Chosen per graph, by its Instantiate/Capture.
  enum class Priority { kPerNode, kLaunchStream };
  static std::string_view PriorityName(Priority priority);  // "node" | "stream"
  // "node" or "stream"; INVALID_ARGUMENT naming the allowed values otherwise.
  static StatusOr<Priority> ParsePriority(std::string_view name);

  // Takes ownership of `graph` (on failure too) and instantiates it.
  static StatusOr<CudaGraphExec> Instantiate(cudaGraph_t graph,
                                             Priority priority = Priority::kPerNode);

  // Captures the work that `body` enqueues on `stream` (and on streams forked from it with
  // events, which must join back before body returns), then instantiates it. Capture always
  // ends, also when body fails, so `stream` stays usable. Threads that capture concurrently
  // should use cudaStreamCaptureModeThreadLocal. A body that does something illegal under
  // capture (synchronisation, cudaMalloc, ...) yields an error, not a graph.
  static StatusOr<CudaGraphExec> Capture(cudaStream_t stream, cudaStreamCaptureMode mode,
                                         const std::function<Status()>& body,
                                         Priority priority = Priority::kPerNode);

  CudaGraphExec() = default;  // empty
  ~CudaGraphExec();
  CudaGraphExec(CudaGraphExec&& other) noexcept;
  CudaGraphExec& operator=(CudaGraphExec&& other) noexcept;
  CudaGraphExec(const CudaGraphExec&) = delete;
  CudaGraphExec& operator=(const CudaGraphExec&) = delete;

  cudaGraphExec_t exec() const { return exec_; }
  cudaGraph_t graph() const { return graph_; }

  // cudaGraphLaunch on `stream`; asynchronous.
  Status Launch(cudaStream_t stream) const;

 private:
  CudaGraphExec(cudaGraph_t graph, cudaGraphExec_t exec) : graph_(graph), exec_(exec) {}
  void Reset() noexcept;

  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace tpserve
