#include "comm/cuda_resources.h"

#include <cstdio>
#include <string>
#include <utility>

#include "comm/cuda_check.h"

namespace tpserve {
namespace {

std::string FormatBytes(size_t bytes) {
  const double mib = static_cast<double>(bytes) / (1024.0 * 1024.0);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", mib);
  return std::to_string(bytes) + " bytes (" + buf + ")";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// CudaStream

StatusOr<CudaStream> CudaStream::Create(bool non_blocking, std::optional<int> priority) {
  const unsigned int flags = non_blocking ? cudaStreamNonBlocking : cudaStreamDefault;
  cudaStream_t s = nullptr;
  if (priority.has_value()) {
    int least = 0;
    int greatest = 0;
    TP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    // Lower numbers are higher priorities: the valid range is [greatest, least].
    if (*priority < greatest || *priority > least) {
      return InvalidArgumentError("stream priority " + std::to_string(*priority) +
                                  " is outside this device's range [" + std::to_string(greatest) +
                                  " (highest), " + std::to_string(least) + " (lowest)]");
    }
    TP_CUDA_CHECK(cudaStreamCreateWithPriority(&s, flags, *priority));
  } else {
    TP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, flags));
  }
  return CudaStream(s);
}

CudaStream::~CudaStream() { Reset(); }

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    Reset();
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void CudaStream::Reset() noexcept {
  if (stream_ != nullptr) {
    TP_CUDA_LOG(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }
}

Status CudaStream::Synchronize() const {
  TP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

StatusOr<bool> CudaStream::Query() const {
  const cudaError_t err = cudaStreamQuery(stream_);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) return false;
  return CudaCallError(err, "cudaStreamQuery(stream_)", __FILE__, __LINE__);
}

// ---------------------------------------------------------------------------------------------
// CudaEvent

StatusOr<CudaEvent> CudaEvent::Create(bool enable_timing) {
  cudaEvent_t e = nullptr;
  TP_CUDA_CHECK(
      cudaEventCreateWithFlags(&e, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
  return CudaEvent(e, enable_timing);
}

CudaEvent::~CudaEvent() { Reset(); }

CudaEvent::CudaEvent(CudaEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)), timing_(std::exchange(other.timing_, false)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    Reset();
    event_ = std::exchange(other.event_, nullptr);
    timing_ = std::exchange(other.timing_, false);
  }
  return *this;
}

void CudaEvent::Reset() noexcept {
  if (event_ != nullptr) {
    TP_CUDA_LOG(cudaEventDestroy(event_));
    event_ = nullptr;
  }
}

Status CudaEvent::Record(cudaStream_t stream) const {
  TP_CUDA_CHECK(cudaEventRecord(event_, stream));
  return Status::Ok();
}

Status CudaEvent::WaitOn(cudaStream_t stream) const {
  TP_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  return Status::Ok();
}

StatusOr<bool> CudaEvent::Query() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) return false;
  return CudaCallError(err, "cudaEventQuery(event_)", __FILE__, __LINE__);
}

StatusOr<float> CudaEvent::ElapsedMs(const CudaEvent& start, const CudaEvent& end) {
  if (!start.timing_ || !end.timing_) {
    return InvalidArgumentError("CudaEvent::ElapsedMs needs two events created with enable_timing");
  }
  float ms = 0.0f;
  TP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, end.event_));
  return ms;
}

// ---------------------------------------------------------------------------------------------
// DeviceBuffer

StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes, std::string name) {
  if (bytes == 0) return DeviceBuffer(nullptr, 0, std::move(name));
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaSuccess) return DeviceBuffer(p, bytes, std::move(name));

  // Allocation failures are not sticky; clear the thread's last error so that a later
  // cudaGetLastError() after a kernel launch does not report this one.
  (void)cudaGetLastError();
  int device = -1;
  (void)cudaGetDevice(&device);
  std::string where = "device buffer '" + name + "' of " + FormatBytes(bytes) + " on device " +
                      std::to_string(device) + " (rank " +
                      (CurrentRank() < 0 ? std::string("?") : std::to_string(CurrentRank())) + ")";
  if (err == cudaErrorMemoryAllocation) {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    std::string mem = "free memory unknown";
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      mem = FormatBytes(free_bytes) + " free of " + FormatBytes(total_bytes);
    } else {
      (void)cudaGetLastError();
    }
    return ResourceExhaustedError("out of device memory allocating " + where + "; " + mem);
  }
  return CudaCallError(err, "cudaMalloc(&p, bytes)", __FILE__, __LINE__)
      .WithContext("allocating " + where);
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      name_(std::move(other.name_)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    name_ = std::move(other.name_);
  }
  return *this;
}

void DeviceBuffer::Reset() noexcept {
  if (data_ != nullptr) {
    TP_CUDA_LOG(cudaFree(data_));
    data_ = nullptr;
  }
  size_ = 0;
}

// ---------------------------------------------------------------------------------------------
// PinnedHostBuffer

StatusOr<PinnedHostBuffer> PinnedHostBuffer::Allocate(size_t bytes, std::string name) {
  PinnedHostBuffer buf;
  if (bytes == 0) return buf;
  const cudaError_t e = cudaMallocHost(&buf.data_, bytes);
  if (e != cudaSuccess) {
    buf.data_ = nullptr;
    return ResourceExhaustedError("pinned host buffer " + name + " (" + std::to_string(bytes) +
                                  " bytes): " + cudaGetErrorString(e));
  }
  buf.size_ = bytes;
  buf.name_ = std::move(name);
  return buf;
}

PinnedHostBuffer::~PinnedHostBuffer() { Reset(); }

PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      name_(std::move(other.name_)) {}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    name_ = std::move(other.name_);
  }
  return *this;
}

void PinnedHostBuffer::Reset() noexcept {
  if (data_ != nullptr) {
    TP_CUDA_LOG(cudaFreeHost(data_));
    data_ = nullptr;
  }
  size_ = 0;
}

// ---------------------------------------------------------------------------------------------
// CudaGraphExec

std::string_view CudaGraphExec::PriorityName(Priority priority) {
  return priority == Priority::kPerNode ? "node" : "stream";
}

StatusOr<CudaGraphExec::Priority> CudaGraphExec::ParsePriority(std::string_view name) {
  if (name == "node") return Priority::kPerNode;
  if (name == "stream") return Priority::kLaunchStream;
  return InvalidArgumentError("graph priority '" + std::string(name) + "' (allowed: node, stream)");
}

StatusOr<CudaGraphExec> CudaGraphExec::Instantiate(cudaGraph_t graph, Priority priority) {
  if (graph == nullptr) return InvalidArgumentError("CudaGraphExec::Instantiate: graph is null");
  cudaGraphExec_t exec = nullptr;
  using Flags = unsigned long long;  // NOLINT(runtime/int): the API's type
  const Flags flags = priority == Priority::kPerNode
                          ? static_cast<Flags>(cudaGraphInstantiateFlagUseNodePriority)
                          : Flags{0};
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, flags);
  if (err != cudaSuccess) {
    TP_CUDA_LOG(cudaGraphDestroy(graph));
    return CudaCallError(err, "cudaGraphInstantiate(&exec, graph, flags)", __FILE__, __LINE__);
  }
  return CudaGraphExec(graph, exec);
}

StatusOr<CudaGraphExec> CudaGraphExec::Capture(cudaStream_t stream, cudaStreamCaptureMode mode,
                                               const std::function<Status()>& body,
                                               Priority priority) {
  TP_CUDA_CHECK(cudaStreamBeginCapture(stream, mode));
  const Status body_status = body();
  cudaGraph_t graph = nullptr;
  const cudaError_t end_err = cudaStreamEndCapture(stream, &graph);
  if (!body_status.ok() || end_err != cudaSuccess) {
    if (graph != nullptr) TP_CUDA_LOG(cudaGraphDestroy(graph));
    // Capture errors are not sticky; do not leave them for the next cudaGetLastError().
    (void)cudaGetLastError();
    if (!body_status.ok()) return body_status.WithContext("while capturing a CUDA graph");
    return CudaCallError(end_err, "cudaStreamEndCapture(stream, &graph)", __FILE__, __LINE__)
        .WithContext("capture was invalidated (an operation not allowed under capture?)");
  }
  return Instantiate(graph, priority);
}

CudaGraphExec::~CudaGraphExec() { Reset(); }

CudaGraphExec::CudaGraphExec(CudaGraphExec&& other) noexcept
    : graph_(std::exchange(other.graph_, nullptr)), exec_(std::exchange(other.exec_, nullptr)) {}

CudaGraphExec& CudaGraphExec::operator=(CudaGraphExec&& other) noexcept {
  if (this != &other) {
    Reset();
    graph_ = std::exchange(other.graph_, nullptr);
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}

void CudaGraphExec::Reset() noexcept {
  if (exec_ != nullptr) {
    TP_CUDA_LOG(cudaGraphExecDestroy(exec_));
    exec_ = nullptr;
  }
  if (graph_ != nullptr) {
    TP_CUDA_LOG(cudaGraphDestroy(graph_));
    graph_ = nullptr;
  }
}

Status CudaGraphExec::Launch(cudaStream_t stream) const {
  if (exec_ == nullptr) return FailedPreconditionError("CudaGraphExec::Launch on an empty graph");
  TP_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
  return Status::Ok();
}

}  // namespace tpserve
