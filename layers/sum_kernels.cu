#include <cuda_bf16.h>

#include <iterator>

#include "layers/kernel_grid.h"
#include "layers/sum_kernels.h"

namespace tpserve {
namespace {

// The slot count is a template parameter: every index into the slot array is
// then a compile-time constant, so the pointers stay in kernel parameter
// space (a run-time index would copy the whole parameter block into each
// thread's local memory first), and each thread issues all N loads before
// the first add. The adds still run in slot order, from 0.
template <int N>
__global__ void SumSlotsScalar(SumSlotsParams p) {
  auto* dst = static_cast<__nv_bfloat16*>(p.dst);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    __nv_bfloat16 v[N];
#pragma unroll
    for (int s = 0; s < N; ++s) v[s] = static_cast<const __nv_bfloat16*>(p.slots[s])[i];
    float acc = 0.0f;
#pragma unroll
    for (int s = 0; s < N; ++s) acc += __bfloat162float(v[s]);
    dst[i] = __float2bfloat16_rn(acc);
  }
}

// Eight elements (16 bytes) per thread and step.
template <int N>
__global__ void SumSlotsVec8(SumSlotsParams p) {
  const int64_t groups = p.count / 8;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint4 v[N];
#pragma unroll
    for (int s = 0; s < N; ++s) v[s] = static_cast<const uint4*>(p.slots[s])[g];
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int s = 0; s < N; ++s) {
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v[s]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        acc[2 * j] += f.x;
        acc[2 * j + 1] += f.y;
      }
    }
    uint4 out;
    auto* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    static_cast<uint4*>(p.dst)[g] = out;
  }
}

template <int N>
void LaunchSum(const SumSlotsParams& p, bool vec, cudaStream_t stream) {
  if (vec) {
    SumSlotsVec8<N><<<GridFor(p.count / 8), kThreads, 0, stream>>>(p);
  } else {
    SumSlotsScalar<N><<<GridFor(p.count), kThreads, 0, stream>>>(p);
  }
}

}  // namespace

Status LaunchSumSlotsBf16(const SumSlotsParams& p, cudaStream_t stream) {
  if (p.count < 0 || p.num_slots < 1 || p.num_slots > kMaxSumSlots) {
    return InvalidArgumentError(
        "sum of slots: needs count >= 0 and 1 <= num_slots <= " + std::to_string(kMaxSumSlots) +
        ", got count=" + std::to_string(p.count) + " num_slots=" + std::to_string(p.num_slots));
  }
  if (p.count == 0) return Status::Ok();
  bool vec = p.count % 8 == 0 && IsAligned(p.dst, 16);
  if (p.dst == nullptr) return InvalidArgumentError("sum of slots: dst is null");
  for (int s = 0; s < p.num_slots; ++s) {
    if (p.slots[s] == nullptr) {
      return InvalidArgumentError("sum of slots: slot " + std::to_string(s) + " is null");
    }
    vec = vec && IsAligned(p.slots[s], 16);
  }
  // One kernel instance per slot count, indexed by num_slots - 1.
  using Launcher = void (*)(const SumSlotsParams&, bool, cudaStream_t);
  static constexpr Launcher kLaunchers[] = {LaunchSum<1>, LaunchSum<2>, LaunchSum<3>, LaunchSum<4>,
                                            LaunchSum<5>, LaunchSum<6>, LaunchSum<7>, LaunchSum<8>};
  static_assert(std::size(kLaunchers) == kMaxSumSlots, "one launcher per slot count");
  kLaunchers[p.num_slots - 1](p, vec, stream);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return InternalError(std::string("sum of slots launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace tpserve
