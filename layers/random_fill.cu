#include "layers/random_fill.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <string>

#include "layers/pdl.cuh"

namespace tpserve {
namespace {

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ float UniformAt(uint64_t seed, size_t i, float scale) {
  const uint64_t bits = SplitMix64(seed ^ SplitMix64(i));
  // 24 random bits -> [0, 1) -> [-1, 1)
  const float u = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
  return (2.0f * u - 1.0f) * scale;
}

template <typename Store>
__global__ void RandomKernel(size_t count, uint64_t seed, float scale, Store store) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    store(i, UniformAt(seed, i, scale));
  }
}

struct StoreFp8 {
  uint8_t* p;
  __device__ void operator()(size_t i, float v) const {
    p[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  }
};
struct StoreBf16 {
  __nv_bfloat16* p;
  __device__ void operator()(size_t i, float v) const { p[i] = __float2bfloat16_rn(v); }
};
struct StoreF32 {
  float* p;
  __device__ void operator()(size_t i, float v) const { p[i] = v; }
};

template <typename Store>
Status Launch(size_t count, uint64_t seed, float scale, Store store, cudaStream_t stream) {
  const int threads = 256;
  const size_t want = (count + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 65536 ? want : 65536);
  RandomKernel<<<blocks, threads, 0, stream>>>(count, seed, scale, store);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return InternalError(std::string("random fill launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace

Status LaunchRandomUniform(void* dst, DataType type, size_t count, uint64_t seed, float scale,
                           cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  if (dst == nullptr) return InvalidArgumentError("random fill: dst is null");
  switch (type) {
    case DataType::kFloat8E4M3:
      return Launch(count, seed, scale, StoreFp8{static_cast<uint8_t*>(dst)}, stream);
    case DataType::kBFloat16:
      return Launch(count, seed, scale, StoreBf16{static_cast<__nv_bfloat16*>(dst)}, stream);
    case DataType::kFloat32:
      return Launch(count, seed, scale, StoreF32{static_cast<float*>(dst)}, stream);
    default:
      return UnimplementedError(std::string("random fill: unsupported type ") +
                                std::string(DataTypeName(type)));
  }
}

namespace {

__global__ void DelayKernel(int64_t ns, bool let_next_start) {
  if (let_next_start) PdlEnter();  // one CTA: lets the next PDL kernel start at once
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<int64_t>(now - start) < ns);
}

}  // namespace

Status LaunchGpuDelay(int64_t ns, cudaStream_t stream, bool let_next_start) {
  if (ns <= 0) return Status::Ok();
  cudaError_t e = cudaSuccess;
  if (let_next_start) {
    e = LaunchPdl(DelayKernel, dim3(1), dim3(1), 0, stream, ns, true);
  } else {
    DelayKernel<<<1, 1, 0, stream>>>(ns, false);
  }
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) {
    return InternalError(std::string("delay kernel launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

namespace {

// Grid-stride 16-byte loads cached in L2 only; volatile, so that unused results still load
// (the empty asm gives their XOR a use).
__global__ void ReadSweepKernel(const uint4* p, size_t n) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t a, b, c, d;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "l"(p + i));
    acc ^= a ^ b ^ c ^ d;
  }
  asm volatile("" ::"r"(acc));
}

}  // namespace

Status LaunchL2FlushByReading(const void* buffer, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::Ok();
  if (buffer == nullptr || reinterpret_cast<uintptr_t>(buffer) % 16 != 0 || bytes % 16 != 0) {
    return InvalidArgumentError(
        "L2 flush by reading: the buffer must be non-null and 16-byte aligned, and bytes (" +
        std::to_string(bytes) + ") a multiple of 16");
  }
  // A fixed grid: enough blocks to keep every SM of any Hopper part streaming.
  ReadSweepKernel<<<1024, 512, 0, stream>>>(static_cast<const uint4*>(buffer), bytes / 16);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return InternalError(std::string("L2 flush by reading failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace tpserve
