// The reduction step of a copy-engine ReduceScatter: once copy engines have
// pulled each peer's partial of this rank's rows, one element-wise kernel
// adds them to this rank's own partial.
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/status.h"

namespace tpserve {

struct SumSlotsParams {
  void* dst = nullptr;          // BF16 [count]
  const void* own = nullptr;    // BF16 [count]: this rank's partial
  const void* slots = nullptr;  // BF16: slot s starts at slots + s * slot_stride elements
  int64_t slot_stride = 0;      // elements between slots (>= count)
  int num_slots = 0;            // ranks (>= 1)
  int own_slot = 0;             // the slot `own` stands in for (its slot is not read)
  int64_t count = 0;            // elements
};

// dst[i] = sum over s = 0 .. num_slots-1 of (s == own_slot ? own[i] :
// slots[s * slot_stride + i]), added in slot order in FP32 and rounded to BF16
// once (RNE): every rank adds in the same order. dst may alias own. No
// allocation or synchronisation (capturable); 16-byte aligned pointers and
// strides take the vectorised path.
Status LaunchSumSlotsBf16(const SumSlotsParams& p, cudaStream_t stream);

}  // namespace tpserve
