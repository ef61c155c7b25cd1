// Communicator: the collective and point-to-point operations that TP layers
// need, independent of the transport (threads of one process, or NCCL).
//
// Semantics (all ranks of the group must call collectives in the same order):
//  - AllGather: each rank contributes `bytes_per_rank` bytes from `send`;
//    `recv` receives size()*bytes_per_rank bytes, rank r's at offset
//    r*bytes_per_rank. `send` may alias recv + rank()*bytes_per_rank.
//  - ReduceScatter: `send` holds size()*count elements; rank r receives the
//    element-wise sum over ranks of block r into `recv` (count elements).
//    Supported types: kFloat32, kBFloat16 (BF16 is summed in FP32 and rounded
//    once by the CPU implementation; NCCL rounds per step).
//  - Send/Recv: `bytes` bytes to/from `peer`; matched in program order per pair.
//  - Broadcast: `bytes` bytes from `root`'s buffer into everyone's buffer.
//  - Barrier: returns once every rank has entered it.
//
// `stream` is a cudaStream_t for implementations with streams and is ignored
// (must be nullptr) otherwise. Implementations with streams enqueue and return;
// the CPU implementation completes the operation before returning.
//
// Failure: a non-OK Status. Operations never wait forever: a peer that does
// not arrive within the communicator's timeout yields DEADLINE_EXCEEDED, and
// after Abort() every pending and future operation returns ABORTED.
//
// Thread-safety: one Communicator object is used by one thread (its rank).
#pragma once

#include <cstddef>

#include "comm/dtype.h"
#include "comm/status.h"

namespace tpserve {

using StreamHandle = void*;  // cudaStream_t where streams exist, else nullptr

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual Status AllGather(const void* send, void* recv, size_t bytes_per_rank,
                           StreamHandle stream) = 0;
  virtual Status ReduceScatter(const void* send, void* recv, size_t count, DataType dtype,
                               StreamHandle stream) = 0;
  virtual Status Send(const void* buf, size_t bytes, int peer, StreamHandle stream) = 0;
  virtual Status Recv(void* buf, size_t bytes, int peer, StreamHandle stream) = 0;
  // One ring step: sends `send_bytes` to `send_peer` and receives `recv_bytes`
  // from `recv_peer`, progressing both together so that a ring of SendRecv
  // calls cannot deadlock. A peer of -1 skips that side. The default (Send,
  // then Recv) suits implementations whose Send does not wait for the peer.
  virtual Status SendRecv(const void* send_buf, size_t send_bytes, int send_peer, void* recv_buf,
                          size_t recv_bytes, int recv_peer, StreamHandle stream) {
    // Only -1 skips: another negative peer is a caller's error that Send/Recv report.
    if (send_peer != -1) TP_RETURN_IF_ERROR(Send(send_buf, send_bytes, send_peer, stream));
    if (recv_peer != -1) TP_RETURN_IF_ERROR(Recv(recv_buf, recv_bytes, recv_peer, stream));
    return Status::Ok();
  }
  virtual Status Broadcast(void* buf, size_t bytes, int root, StreamHandle stream) = 0;
  virtual Status Barrier() = 0;

  // Makes every pending and future operation of the whole group fail with
  // ABORTED. Idempotent; safe to call from any thread.
  virtual void Abort() = 0;
};

}  // namespace tpserve
