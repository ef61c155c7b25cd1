#include <cuda_bf16.h>

#include "layers/kernel_grid.h"
#include "layers/sum_kernels.h"

namespace tpserve {
namespace {

__device__ float SumAt(const SumSlotsParams& p, int64_t i) {
  const auto* own = static_cast<const __nv_bfloat16*>(p.own);
  const auto* slots = static_cast<const __nv_bfloat16*>(p.slots);
  float acc = 0.0f;
  for (int s = 0; s < p.num_slots; ++s) {
    acc += __bfloat162float(s == p.own_slot ? own[i] : slots[s * p.slot_stride + i]);
  }
  return acc;
}

__global__ void SumSlotsScalar(SumSlotsParams p) {
  auto* dst = static_cast<__nv_bfloat16*>(p.dst);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(SumAt(p, i));
  }
}

// Eight elements (16 bytes) per thread and step.
__global__ void SumSlotsVec8(SumSlotsParams p) {
  const int64_t groups = p.count / 8;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int s = 0; s < p.num_slots; ++s) {
      const void* base = s == p.own_slot
                             ? p.own
                             : static_cast<const void*>(static_cast<const __nv_bfloat16*>(p.slots) +
                                                        s * p.slot_stride);
      const uint4 v = reinterpret_cast<const uint4*>(base)[g];
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        acc[2 * j] += f.x;
        acc[2 * j + 1] += f.y;
      }
    }
    uint4 out;
    auto* o = reinterpret_cast<__nv_bfloat162*>(&out);
    for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    reinterpret_cast<uint4*>(p.dst)[g] = out;
  }
}

}  // namespace

Status LaunchSumSlotsBf16(const SumSlotsParams& p, cudaStream_t stream) {
  if (p.count < 0 || p.num_slots < 1 || p.own_slot < 0 || p.own_slot >= p.num_slots) {
    return InvalidArgumentError("sum of slots: needs count >= 0 and 0 <= own_slot < num_slots, got "
                                "count=" + std::to_string(p.count) +
                                " num_slots=" + std::to_string(p.num_slots) +
                                " own_slot=" + std::to_string(p.own_slot));
  }
  if (p.count == 0) return Status::Ok();
  if (p.dst == nullptr || p.own == nullptr || (p.num_slots > 1 && p.slots == nullptr)) {
    return InvalidArgumentError("sum of slots: dst, own and slots must be non-null");
  }
  if (p.num_slots > 1 && p.slot_stride < p.count) {
    return InvalidArgumentError("sum of slots: slot_stride " + std::to_string(p.slot_stride) +
                                " is shorter than count " + std::to_string(p.count));
  }
  const bool vec = p.count % 8 == 0 && p.slot_stride % 8 == 0 && IsAligned(p.dst, 16) &&
                   IsAligned(p.own, 16) && (p.num_slots == 1 || IsAligned(p.slots, 16));
  if (vec) {
    SumSlotsVec8<<<GridFor(p.count / 8), kThreads, 0, stream>>>(p);
  } else {
    SumSlotsScalar<<<GridFor(p.count), kThreads, 0, stream>>>(p);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return InternalError(std::string("sum of slots launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace tpserve
