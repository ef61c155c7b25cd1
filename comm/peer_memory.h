// Peer memory for copy-engine transfers between the GPUs of one node.
//
// PeerBuffer: device memory that every rank of a communicator can address —
// its own copy plus a pointer to each peer's copy. Across processes the
// peers' copies are mapped with CUDA IPC (cudaIpcOpenMemHandle); when ranks
// are threads of one process the peer's own pointer is used, with peer access
// enabled. cudaMemcpyAsync between a local and a peer pointer runs on a copy
// engine over NVLink and takes no SM from the GEMMs.
//
// PeerSignals: one-word flags in a PeerBuffer that order such transfers
// across GPUs. Signal() writes 1 into a flag in a peer's memory; Wait() holds
// the stream until this rank's flag is 1, then writes it back to 0. Both are
// CUDA stream memory operations (32-bit writes and waits):
// the GPU's front end executes them, so they occupy no SM. (A first version
// used one-thread spin kernels; a spinning block holding an SM can deadlock a
// GEMM whose CTAs must all be resident, and did.)
// Each call enqueues one cuStreamBatchMemOp.
// They capture into CUDA graphs; the flags return to zero after every matched
// Signal/Wait pair, so a replayed graph starts from the state it was captured
// in.
//
// A Wait whose Signal never comes (a peer process died) holds its stream:
// the host notices through the communicator's deadline (WaitStream aborts and
// reports DEADLINE_EXCEEDED); the process must then restart.
//
// Only compiled when TPSERVE_WITH_CUDA is on. All ranks must be on one node
// (Create returns FAILED_PRECONDITION otherwise). Not thread-safe; one object
// per rank. Destroy on every rank together, after the graphs that use it and
// before the communicator. CUDA leaves it undefined what happens when memory
// is freed while another process still has it mapped, so an orderly teardown
// is: CloseImports() on every rank, a barrier, then destruction (CudaLinear::
// Close does that for a layer's buffers); destruction alone (an error path)
// unmaps and frees at once.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/nccl_communicator.h"
#include "comm/status.h"

namespace tpserve {

class PeerBuffer {
 public:
  // Allocates `bytes` (> 0, same on every rank) on comm's device and maps
  // every peer's copy. Collective over `comm` (exchanges handles with an
  // AllGather); all ranks create their PeerBuffers in the same order. Errors
  // name the buffer.
  static StatusOr<PeerBuffer> Create(NcclCommunicator& comm, size_t bytes, std::string name);

  PeerBuffer() = default;
  PeerBuffer(PeerBuffer&& other) noexcept;
  PeerBuffer& operator=(PeerBuffer&& other) noexcept;
  PeerBuffer(const PeerBuffer&) = delete;
  PeerBuffer& operator=(const PeerBuffer&) = delete;
  ~PeerBuffer();

  void* data() const { return local_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(local_);
  }
  // Rank `rank`'s copy as addressed from this device; peer(own rank) == data().
  void* peer(int rank) const { return peers_.at(rank); }
  // The CUDA device that holds rank `rank`'s copy.
  int peer_device(int rank) const { return peer_devices_.at(rank); }
  // Whether rank `rank`'s copy belongs to another device of this process
  // (ranks as threads) rather than being mapped into this device's context
  // by CUDA IPC. Copy-engine transfers refuse such peers (see CopyFromPeer).
  bool same_process(int rank) const { return rank != own_rank_ && !ipc_opened_.at(rank); }

  // Enqueues a copy of `bytes` from rank `rank`'s copy at `offset` to `dst`
  // (this device) on `stream`, on a copy engine. FAILED_PRECONDITION when
  // that rank is a thread of this process: such copies can hang (see
  // PeerBuffer's same-process rule in peer_memory.cc).
  // INVALID_ARGUMENT for a rank outside the communicator or a range outside
  // the buffer.
  Status CopyFromPeer(int rank, size_t offset, void* dst, size_t bytes, cudaStream_t stream) const;
  // The same for `height` rows of `width` bytes: row i from offset + i * src_pitch in rank
  // `rank`'s copy to dst + i * dst_pitch (pitches >= width). The same errors; the range checked
  // is from offset to the last row's end.
  Status CopyFromPeer2D(int rank, size_t offset, size_t src_pitch, void* dst, size_t dst_pitch,
                        size_t width, size_t height, cudaStream_t stream) const;
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  // Unmaps the peers' copies opened with CUDA IPC (peer() is then null for
  // them); this rank's own copy stays until destruction. Idempotent.
  void CloseImports() noexcept;

 private:
  void Reset() noexcept;
  // CopyFromPeer's checks of a read of `span` bytes at `offset` of rank `rank`'s copy; the
  // source address, or the error.
  StatusOr<const char*> PeerSource(int rank, size_t offset, size_t span) const;

  int device_ = -1;
  void* local_ = nullptr;
  size_t bytes_ = 0;
  std::vector<void*> peers_;
  std::vector<bool> ipc_opened_;  // peers_[r] came from cudaIpcOpenMemHandle
  std::vector<void*> ipc_bases_;  // what it returned (to close)
  std::vector<int> peer_devices_;
  int own_rank_ = 0;
  std::string name_;
};

class PeerSignals {
 public:
  // `slots` flags per (sender, kind) pair. Collective over `comm`.
  static StatusOr<PeerSignals> Create(NcclCommunicator& comm, int slots, std::string name);

  PeerSignals() = default;

  // What a flag means; each kind has its own slots.
  enum Kind : int { kReady = 0, kDone = 1 };
  struct Flag {
    int peer = 0;  // Signal: the rank signalled; Wait: the rank that signals
    int slot = 0;
  };

  // Enqueues on `stream`: set flag (kind, this rank, slot) on each listed
  // peer. Work enqueued earlier on `stream` is complete and visible to the
  // peers before the flags are set (the write is preceded by a fence).
  Status Signal(Kind kind, const std::vector<Flag>& to, cudaStream_t stream) const;
  // Enqueues on `stream`: wait until each listed peer has signalled (kind,
  // slot) to this rank, then re-arm those flags.
  Status Wait(Kind kind, const std::vector<Flag>& from, cudaStream_t stream) const;
  // Signal(signal_kind, to) then Wait(wait_kind, from) as one batch of stream
  // memory operations (cuStreamBatchMemOp): a single node when captured,
  // where the two calls would make 1 + 2 * |from| + |to| nodes, each adding
  // its own scheduling latency.
  Status SignalThenWait(Kind signal_kind, const std::vector<Flag>& to, Kind wait_kind,
                        const std::vector<Flag>& from, cudaStream_t stream) const;
  // Operations per cuStreamBatchMemOp call (the driver's limit on one batch);
  // a call with more flags (written once, awaited twice) is issued as several
  // batches in order, one graph node each.
  static constexpr size_t kMaxBatchOps = 255;

  // PeerBuffer::CloseImports of the flags (teardown; no Signal or Wait after).
  void CloseImports() noexcept { flags_.CloseImports(); }

  int slots() const { return slots_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  uint32_t* FlagOn(int owner, Kind kind, int sender, int slot) const;
  Status CheckFlag(const Flag& f, const char* what) const;

  PeerBuffer flags_;
  int slots_ = 0;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace tpserve
