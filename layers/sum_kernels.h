// The reduction step of a peer-memory ReduceScatter: one element-wise kernel
// adds every rank's partial of this rank's rows, each read where it lies
// (pulled here by copy engines, or in a peer's memory mapped here).
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/status.h"

namespace tpserve {

inline constexpr int kMaxSumSlots = 8;

struct SumSlotsParams {
  void* dst = nullptr;                   // BF16 [count]
  const void* slots[kMaxSumSlots] = {};  // BF16 [count] each: local or a peer's mapping
  int num_slots = 0;                     // 1 .. kMaxSumSlots
  int64_t count = 0;                     // elements

  // In-kernel handshake with the peers whose memory the slots read (peer
  // signals, comm/peer_memory.h), for when nothing else runs beside the
  // kernel (mode none): a wait there costs a spinning block per SM, which is
  // harmless only then. Each block waits until every wait_flags[i] (this
  // GPU's flags) is 1 before it reads; the last block to finish re-arms them
  // to 0, re-arms `counter`, and sets every done_flags[i] (in the peers'
  // memory) to 1 after a system-wide fence: the peers may then overwrite what
  // was read. A flag that never comes traps after kHandshakeTimeoutNs (the
  // stream then reports an error) rather than spin for ever.
  uint32_t* wait_flags[kMaxSumSlots] = {};
  int num_wait = 0;
  uint32_t* done_flags[kMaxSumSlots] = {};
  int num_done = 0;
  uint32_t* counter = nullptr;  // one zeroed word of this GPU; required with any flag
};

inline constexpr uint64_t kHandshakeTimeoutNs = 30ull * 1000 * 1000 * 1000;

// dst[i] = slots[0][i] + slots[1][i] + ... in FP32, in slot order (every
// rank adds in the same order), rounded to BF16 once (RNE). A slot may be
// another GPU's memory mapped here (comm/peer_memory.h): the kernel then
// reads it over NVLink itself. dst may alias a slot. No allocation or
// synchronisation (capturable); 16-byte aligned pointers with count % 8 == 0
// take the vectorised path.
Status LaunchSumSlotsBf16(const SumSlotsParams& p, cudaStream_t stream);

}  // namespace tpserve
