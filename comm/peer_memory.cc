#include "comm/peer_memory.h"

#include <cuda.h>
#include <spdlog/spdlog.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <utility>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"

namespace tpserve {
namespace {

// What each rank tells the others about its copy of a PeerBuffer.
struct Exported {
  cudaIpcMemHandle_t handle;
  uint64_t ptr;
  uint64_t offset;  // of ptr in its allocation (what the IPC handle maps)
  uint64_t host_hash;
  uint64_t process;  // ProcessToken()
  int32_t device;
};

// Tells this process apart from every other: pids do not, since they repeat
// across PID namespaces (containers that share a hostname, each running
// tpserve as pid 1), and a peer taken for this process would have its
// pointer used unmapped.
uint64_t ProcessToken() {
  static const uint64_t token = [] {
    uint64_t t = 0;
    if (::getrandom(&t, sizeof t, 0) != static_cast<ssize_t>(sizeof t)) {
      t = (static_cast<uint64_t>(getpid()) << 32) ^
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    return t;
  }();
  return token;
}

uint64_t HostHash() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return std::hash<std::string>{}(name);
}

// Lets `device` (current) access `peer_device`'s memory; already enabled is fine.
Status EnablePeerAccess(int device, int peer_device, const std::string& what) {
  if (device == peer_device) return Status::Ok();
  int can = 0;
  TP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer_device));
  if (!can) {
    return FailedPreconditionError(what + ": device " + std::to_string(device) +
                                   " cannot access device " + std::to_string(peer_device) +
                                   " directly (no peer-to-peer path)");
  }
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // clear the sticky-free error
    return Status::Ok();
  }
  TP_CUDA_CHECK(e);
  return Status::Ok();
}

// The driver's batch of stream memory operations, looked up through the
// runtime (so that nothing links libcuda directly).
using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
BatchMemOpFn g_batch_mem_op = nullptr;

Status LoadStreamMemOps() {
  static const Status loaded = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &p, 12000,
                                                           cudaEnableDefault, &found);
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
      (void)cudaGetLastError();
      return UnimplementedError(
          "the CUDA driver has no cuStreamBatchMemOp (stream memory operations), needed for "
          "copy-engine transfers");
    }
    g_batch_mem_op = reinterpret_cast<BatchMemOpFn>(p);
    return Status::Ok();
  }();
  return loaded;
}

Status DriverCheck(CUresult r, const char* what);

StatusOr<uint64_t> OffsetInAllocation(void* ptr) {
  using RangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static RangeFn range = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<RangeFn>(p);
  }();
  if (range == nullptr) return UnimplementedError("the CUDA driver has no cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  TP_RETURN_IF_ERROR(
      DriverCheck(range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)), "cuMemGetAddressRange"));
  return static_cast<uint64_t>(reinterpret_cast<CUdeviceptr>(ptr) - base);
}

Status DriverCheck(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return Status::Ok();
  return InternalError(std::string(what) + " failed with CUresult " + std::to_string(r));
}

// One 32-bit operation of a batch. The write and wait members of the union
// have the same fields; `Member` picks the one `type` names.
template <typename Member>
CUstreamBatchMemOpParams MemOp32(Member CUstreamBatchMemOpParams::*member,
                                 CUstreamBatchMemOpType type, uint32_t* addr, uint32_t value,
                                 unsigned int flags) {
  CUstreamBatchMemOpParams op;
  std::memset(&op, 0, sizeof op);
  Member& m = op.*member;
  m.operation = type;
  m.address = reinterpret_cast<CUdeviceptr>(addr);
  m.value = value;
  m.flags = flags;
  return op;
}

// Default flags: the write is preceded by a memory fence.
CUstreamBatchMemOpParams WriteOp(uint32_t* addr, uint32_t value) {
  return MemOp32(&CUstreamBatchMemOpParams::writeValue, CU_STREAM_MEM_OP_WRITE_VALUE_32, addr,
                 value, 0);
}

CUstreamBatchMemOpParams WaitEqOp(uint32_t* addr, uint32_t value) {
  return MemOp32(&CUstreamBatchMemOpParams::waitValue, CU_STREAM_MEM_OP_WAIT_VALUE_32, addr, value,
                 CU_STREAM_WAIT_VALUE_EQ);
}

}  // namespace

StatusOr<PeerBuffer> PeerBuffer::Create(NcclCommunicator& comm, size_t bytes, std::string name) {
  const std::string what = "peer buffer '" + name + "' (" + std::to_string(bytes) + " bytes)";
  if (bytes == 0) return InvalidArgumentError(what + ": size must be positive");
  TP_CUDA_CHECK(cudaSetDevice(comm.device()));
  PeerBuffer buf;
  buf.name_ = std::move(name);
  buf.bytes_ = bytes;
  buf.device_ = comm.device();
  const int n = comm.size(), me = comm.rank();
  buf.peers_.assign(n, nullptr);
  buf.ipc_opened_.assign(n, false);
  buf.ipc_bases_.assign(n, nullptr);
  buf.peer_devices_.assign(n, buf.device_);
  buf.own_rank_ = me;
  {
    const cudaError_t e = cudaMalloc(&buf.local_, bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      buf.local_ = nullptr;
      return Status(StatusCode::kResourceExhausted, "allocating " + what + " on device " +
                                                        std::to_string(buf.device_) +
                                                        " failed: " + cudaGetErrorString(e));
    }
  }
  buf.peers_[me] = buf.local_;

  Exported mine{};
  TP_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, buf.local_));
  mine.ptr = reinterpret_cast<uint64_t>(buf.local_);
  // cudaMalloc may carve small requests out of a larger allocation, and an
  // IPC handle maps that allocation from its start.
  TP_ASSIGN_OR_RETURN(mine.offset, OffsetInAllocation(buf.local_));
  mine.host_hash = HostHash();
  mine.process = ProcessToken();
  mine.device = buf.device_;

  // Exchange over the communicator (a device AllGather; this is set-up, not
  // the serving path, so the synchronous copies are fine).
  TP_ASSIGN_OR_RETURN(DeviceBuffer dev,
                      DeviceBuffer::Allocate(sizeof(Exported) * (n + 1), buf.name_ + ".handles"));
  TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  char* send = dev.as<char>() + sizeof(Exported) * n;
  // On `stream`, which the AllGather follows (a cudaMemcpy from pageable
  // memory may return before its DMA lands).
  TP_CUDA_CHECK(cudaMemcpyAsync(send, &mine, sizeof mine, cudaMemcpyHostToDevice, stream.get()));
  TP_RETURN_IF_ERROR(comm.AllGather(send, dev.data(), sizeof(Exported), stream.get()));
  TP_RETURN_IF_ERROR(comm.WaitStream(stream.get()).WithContext(what));
  std::vector<Exported> all(n);
  TP_CUDA_CHECK(cudaMemcpy(all.data(), dev.data(), sizeof(Exported) * n, cudaMemcpyDeviceToHost));

  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    const Exported& e = all[r];
    if (e.host_hash != mine.host_hash) {
      return FailedPreconditionError(what + ": rank " + std::to_string(r) +
                                     " is on another node; copy-engine transfers need all ranks "
                                     "of the communicator on one node");
    }
    TP_RETURN_IF_ERROR(EnablePeerAccess(buf.device_, e.device, what));
    buf.peer_devices_[r] = e.device;
    if (e.process == mine.process) {
      buf.peers_[r] = reinterpret_cast<void*>(e.ptr);  // same process: one address space
    } else {
      void* p = nullptr;
      const cudaError_t err = cudaIpcOpenMemHandle(&p, e.handle, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return InternalError(what + ": mapping rank " + std::to_string(r) +
                             "'s copy (cudaIpcOpenMemHandle) failed: " + cudaGetErrorString(err));
      }
      buf.peers_[r] = static_cast<char*>(p) + e.offset;
      buf.ipc_opened_[r] = true;
      buf.ipc_bases_[r] = p;
    }
  }
  spdlog::debug("{}: rank {}/{} mapped {} peers", what, me, n, n - 1);
  return buf;
}

PeerBuffer::PeerBuffer(PeerBuffer&& other) noexcept
    : device_(std::exchange(other.device_, -1)),
      local_(std::exchange(other.local_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      peers_(std::move(other.peers_)),
      ipc_opened_(std::move(other.ipc_opened_)),
      ipc_bases_(std::move(other.ipc_bases_)),
      peer_devices_(std::move(other.peer_devices_)),
      own_rank_(other.own_rank_),
      name_(std::move(other.name_)) {}

PeerBuffer& PeerBuffer::operator=(PeerBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    device_ = std::exchange(other.device_, -1);
    local_ = std::exchange(other.local_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    peers_ = std::move(other.peers_);
    ipc_opened_ = std::move(other.ipc_opened_);
    ipc_bases_ = std::move(other.ipc_bases_);
    peer_devices_ = std::move(other.peer_devices_);
    own_rank_ = other.own_rank_;
    name_ = std::move(other.name_);
  }
  return *this;
}

PeerBuffer::~PeerBuffer() { Reset(); }

void PeerBuffer::CloseImports() noexcept {
  if (device_ < 0) return;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device_) TP_CUDA_LOG(cudaSetDevice(device_));
  for (size_t r = 0; r < peers_.size(); ++r) {
    // ipc_opened_ stays set: it tells what kind of peer r is (same_process).
    if (!ipc_opened_[r] || ipc_bases_[r] == nullptr) continue;
    TP_CUDA_LOG(cudaIpcCloseMemHandle(ipc_bases_[r]));
    ipc_bases_[r] = nullptr;
    peers_[r] = nullptr;
  }
  if (previous >= 0 && previous != device_) TP_CUDA_LOG(cudaSetDevice(previous));
}

void PeerBuffer::Reset() noexcept {
  CloseImports();
  if (device_ >= 0 && local_ != nullptr) {
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    if (previous != device_) TP_CUDA_LOG(cudaSetDevice(device_));
    TP_CUDA_LOG(cudaFree(local_));
    if (previous >= 0 && previous != device_) TP_CUDA_LOG(cudaSetDevice(previous));
  }
  peers_.clear();
  ipc_opened_.clear();
  ipc_bases_.clear();
  local_ = nullptr;
  bytes_ = 0;
  device_ = -1;
}

StatusOr<const char*> PeerBuffer::PeerSource(int rank, size_t offset, size_t bytes) const {
  if (rank < 0 || static_cast<size_t>(rank) >= peers_.size()) {
    return InvalidArgumentError("copy from peer buffer '" + name_ + "': rank " +
                                std::to_string(rank) + " is not one of its " +
                                std::to_string(peers_.size()) + " ranks");
  }
  // Not offset + bytes > bytes_, which wraps for offsets near SIZE_MAX.
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return InvalidArgumentError("copy of " + std::to_string(bytes) + " bytes at offset " +
                                std::to_string(offset) + " from peer buffer '" + name_ + "' (" +
                                std::to_string(bytes_) + " bytes)");
  }
  if (same_process(rank)) {
    // Another device's memory of this process: copies from it hung on the
    // 2xH200 host, eagerly and in graph replays, while copies from CUDA IPC
    // mappings never did.
    return FailedPreconditionError("copy from peer buffer '" + name_ + "' of rank " +
                                   std::to_string(rank) +
                                   ", a thread of this process: copy-engine transfers need one "
                                   "process per GPU");
  }
  if (peer(rank) == nullptr) {
    return FailedPreconditionError("copy from peer buffer '" + name_ + "' of rank " +
                                   std::to_string(rank) + ": its mapping was closed (teardown)");
  }
  return static_cast<const char*>(peer(rank)) + offset;
}

Status PeerBuffer::CopyFromPeer(int rank, size_t offset, void* dst, size_t bytes,
                                cudaStream_t stream) const {
  TP_ASSIGN_OR_RETURN(const char* src, PeerSource(rank, offset, bytes));
  TP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

Status PeerBuffer::CopyFromPeer2D(int rank, size_t offset, size_t src_pitch, void* dst,
                                  size_t dst_pitch, size_t width, size_t height,
                                  cudaStream_t stream) const {
  if (src_pitch < width || dst_pitch < width) {
    return InvalidArgumentError("2D copy from peer buffer '" + name_ + "': pitches " +
                                std::to_string(src_pitch) + " / " + std::to_string(dst_pitch) +
                                " shorter than a row of " + std::to_string(width) + " bytes");
  }
  if (height == 0 || width == 0) return PeerSource(rank, offset, 0).status();  // rank checked
  // The span from the first row's start to the last row's end (no overflow: the rows fit the
  // buffer only if the span does, and PeerSource checks it without wrapping).
  if (height - 1 > (SIZE_MAX - width) / src_pitch) {
    return InvalidArgumentError("2D copy from peer buffer '" + name_ +
                                "': " + std::to_string(height) + " rows of pitch " +
                                std::to_string(src_pitch) + " overflow");
  }
  const size_t span = (height - 1) * src_pitch + width;
  TP_ASSIGN_OR_RETURN(const char* src, PeerSource(rank, offset, span));
  TP_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                  cudaMemcpyDeviceToDevice, stream));
  return Status::Ok();
}

StatusOr<PeerSignals> PeerSignals::Create(NcclCommunicator& comm, int slots, std::string name) {
  TP_RETURN_IF_ERROR(LoadStreamMemOps());
  if (slots < 1) {
    return InvalidArgumentError("peer signals '" + name + "': slots must be >= 1, got " +
                                std::to_string(slots));
  }
  PeerSignals s;
  s.slots_ = slots;
  s.rank_ = comm.rank();
  s.size_ = comm.size();
  const size_t bytes = sizeof(uint32_t) * 2 * s.size_ * slots;
  TP_ASSIGN_OR_RETURN(s.flags_, PeerBuffer::Create(comm, bytes, std::move(name)));
  {
    // On a private stream: a device-wide synchronisation here could wait for
    // NCCL work that needs a peer which is itself blocked in set-up.
    TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
    TP_CUDA_CHECK(cudaMemsetAsync(s.flags_.data(), 0, bytes, stream.get()));
    TP_RETURN_IF_ERROR(stream.Synchronize());
  }
  TP_RETURN_IF_ERROR(comm.Barrier());  // zeroed everywhere before any peer may signal
  return s;
}

uint32_t* PeerSignals::FlagOn(int owner, Kind kind, int sender, int slot) const {
  // Layout on each rank: [kind][sender][slot].
  return static_cast<uint32_t*>(flags_.peer(owner)) +
         (static_cast<size_t>(kind) * size_ + sender) * slots_ + slot;
}

Status PeerSignals::CheckFlag(const Flag& f, const char* what) const {
  if (f.peer < 0 || f.peer >= size_ || f.peer == rank_ || f.slot < 0 || f.slot >= slots_) {
    return InvalidArgumentError(std::string(what) + " rank " + std::to_string(f.peer) + " slot " +
                                std::to_string(f.slot) + " out of range (" + std::to_string(size_) +
                                " ranks, own rank " + std::to_string(rank_) + ", " +
                                std::to_string(slots_) + " slots)");
  }
  return Status::Ok();
}

Status PeerSignals::Signal(Kind kind, const std::vector<Flag>& to, cudaStream_t stream) const {
  return SignalThenWait(kind, to, kind, {}, stream);
}

Status PeerSignals::Wait(Kind kind, const std::vector<Flag>& from, cudaStream_t stream) const {
  return SignalThenWait(kind, {}, kind, from, stream);
}

Status PeerSignals::SignalThenWait(Kind signal_kind, const std::vector<Flag>& to, Kind wait_kind,
                                   const std::vector<Flag>& from, cudaStream_t stream) const {
  // In the order given: the peers' flags set, then each awaited flag waited
  // for and re-armed. One batch (one node in a captured graph) when it fits the
  // driver's limit, else consecutive batches on the same stream, which keep
  // the order (TP = 8 with many chunks waits for 2 * chunks * 7 operations).
  std::vector<CUstreamBatchMemOpParams> ops;
  ops.reserve(to.size() + 2 * from.size());
  for (const Flag& f : to) {
    TP_RETURN_IF_ERROR(CheckFlag(f, "peer signal to"));
    ops.push_back(WriteOp(FlagOn(f.peer, signal_kind, rank_, f.slot), 1));
  }
  for (const Flag& f : from) {
    TP_RETURN_IF_ERROR(CheckFlag(f, "peer wait for"));
    uint32_t* flag = FlagOn(rank_, wait_kind, f.peer, f.slot);
    ops.push_back(WaitEqOp(flag, 1));
    ops.push_back(WriteOp(flag, 0));
  }
  for (size_t begin = 0; begin < ops.size(); begin += kMaxBatchOps) {
    const size_t count = std::min(kMaxBatchOps, ops.size() - begin);
    TP_RETURN_IF_ERROR(
        DriverCheck(g_batch_mem_op(reinterpret_cast<CUstream>(stream), static_cast<unsigned>(count),
                                   ops.data() + begin, 0),
                    "cuStreamBatchMemOp"));
  }
  return Status::Ok();
}

}  // namespace tpserve
