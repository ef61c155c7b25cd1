#include <cuda_bf16.h>

#include "layers/kernel_grid.h"
#include "layers/sum_kernels.h"

namespace tpserve {
namespace {

__device__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Every block: wait for the peers' flags before reading their memory.
__device__ void AwaitPeers(const SumSlotsParams& p) {
  if (p.num_wait == 0) return;
  if (threadIdx.x == 0) {
    const uint64_t start = GlobalTimerNs();
    for (int i = 0; i < p.num_wait; ++i) {
      while (LoadAcquireSys(p.wait_flags[i]) != 1u) {
        if (GlobalTimerNs() - start > kHandshakeTimeoutNs) __trap();
        __nanosleep(64);
      }
    }
  }
  __syncthreads();
}

// The last block to finish re-arms the waits and tells the peers they may
// reuse what this kernel read.
__device__ void ReleasePeers(const SumSlotsParams& p) {
  if (p.num_wait == 0 && p.num_done == 0) return;
  __syncthreads();  // this block's reads and writes are done
  if (threadIdx.x != 0) return;
  __threadfence_system();
  if (atomicAdd(p.counter, 1u) != gridDim.x - 1) return;
  for (int i = 0; i < p.num_wait; ++i) p.wait_flags[i][0] = 0u;
  *p.counter = 0u;
  __threadfence_system();
  for (int i = 0; i < p.num_done; ++i) StoreReleaseSys(p.done_flags[i], 1u);
}

__global__ void SumSlotsScalar(SumSlotsParams p) {
  AwaitPeers(p);
  auto* dst = static_cast<__nv_bfloat16*>(p.dst);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < p.num_slots; ++s) {
      acc += __bfloat162float(static_cast<const __nv_bfloat16*>(p.slots[s])[i]);
    }
    dst[i] = __float2bfloat16_rn(acc);
  }
  ReleasePeers(p);
}

// Eight elements (16 bytes) per thread and step.
__global__ void SumSlotsVec8(SumSlotsParams p) {
  AwaitPeers(p);
  const int64_t groups = p.count / 8;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int s = 0; s < p.num_slots; ++s) {
      const uint4 v = static_cast<const uint4*>(p.slots[s])[g];
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
    static_cast<uint4*>(p.dst)[g] = out;
  }
  ReleasePeers(p);
}

}  // namespace

Status LaunchSumSlotsBf16(const SumSlotsParams& p, cudaStream_t stream) {
  if (p.count < 0 || p.num_slots < 1 || p.num_slots > kMaxSumSlots) {
    return InvalidArgumentError(
        "sum of slots: needs count >= 0 and 1 <= num_slots <= " + std::to_string(kMaxSumSlots) +
        ", got count=" + std::to_string(p.count) + " num_slots=" + std::to_string(p.num_slots));
  }
  if (p.num_wait < 0 || p.num_wait > kMaxSumSlots || p.num_done < 0 || p.num_done > kMaxSumSlots) {
    return InvalidArgumentError("sum of slots: num_wait and num_done must be in [0, " +
                                std::to_string(kMaxSumSlots) + "], got " +
                                std::to_string(p.num_wait) + " and " + std::to_string(p.num_done));
  }
  const bool handshake = p.num_wait > 0 || p.num_done > 0;
  if (handshake && p.counter == nullptr) {
    return InvalidArgumentError("sum of slots: a handshake (wait or done flags) needs `counter`");
  }
  for (int i = 0; i < p.num_wait; ++i) {
    if (p.wait_flags[i] == nullptr)
      return InvalidArgumentError("sum of slots: a wait flag is null");
  }
  for (int i = 0; i < p.num_done; ++i) {
    if (p.done_flags[i] == nullptr)
      return InvalidArgumentError("sum of slots: a done flag is null");
  }
  // Nothing to add: the handshake still runs (one block), so peers are not
  // left waiting.
  if (p.count == 0 && !handshake) return Status::Ok();
  bool vec = p.count % 8 == 0 && IsAligned(p.dst, 16);
  if (p.dst == nullptr) return InvalidArgumentError("sum of slots: dst is null");
  for (int s = 0; s < p.num_slots; ++s) {
    if (p.slots[s] == nullptr) {
      return InvalidArgumentError("sum of slots: slot " + std::to_string(s) + " is null");
    }
    vec = vec && IsAligned(p.slots[s], 16);
  }
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
