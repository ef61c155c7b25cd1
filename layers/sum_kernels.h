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
};

// dst[i] = slots[0][i] + slots[1][i] + ... in FP32, in slot order (every
// rank adds in the same order), rounded to BF16 once (RNE). A slot may be
// another GPU's memory mapped here (comm/peer_memory.h): the kernel then
// reads it over NVLink itself. dst may alias a slot. No allocation or
// synchronisation (capturable); 16-byte aligned pointers with count % 8 == 0
// take the vectorised path.
Status LaunchSumSlotsBf16(const SumSlotsParams& p, cudaStream_t stream);

}  // namespace tpserve
