// Kernel and launcher for layers/scale_slots.h. Plain CUDA C++17.
#include "layers/scale_slots.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "layers/kernel_grid.h"

namespace tpserve {
namespace {

// The part `i` of n rows split into `parts` balanced parts falls in, and that part's first row
// and size: the inverse of ChunkRows (layers/overlap_plan.cc), whose first n % parts parts hold
// one row more.
__device__ __forceinline__ void PartOf(int64_t i, int64_t n, int parts, int* part, int64_t* begin,
                                       int64_t* size) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t big = extra * (base + 1);  // rows in the larger parts
  int64_t p = 0;
  if (i < big) {
    p = i / (base + 1);
  } else {
    p = extra + (i - big) / base;
  }
  *part = static_cast<int>(p);
  *begin = p * base + (p < extra ? p : extra);
  *size = base + (p < extra ? 1 : 0);
}

__global__ void ScatterScaleSlotsKernel(ScatterScaleSlotsParams p, int64_t src_row0,
                                        int64_t src_rows) {
  const int64_t total = p.groups * src_rows;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    const int64_t g = e / src_rows;
    const int64_t row = src_row0 + e % src_rows;  // global row
    int shard = 0, chunk = 0;
    int64_t shard_begin = 0, shard_size = 0, chunk_begin = 0, chunk_size = 0;
    PartOf(row, p.m, p.tp, &shard, &shard_begin, &shard_size);
    PartOf(row - shard_begin, shard_size, p.chunks, &chunk, &chunk_begin, &chunk_size);
    const int64_t slot = (static_cast<int64_t>(chunk) * p.tp + shard) * p.pitch;
    p.dst[slot + g * chunk_size + (row - shard_begin - chunk_begin)] = p.src[e];
  }
}

}  // namespace

Status LaunchScatterScaleSlots(const ScatterScaleSlotsParams& p, cudaStream_t stream) {
  if (p.src == nullptr || p.dst == nullptr) {
    return InvalidArgumentError("scale slots: src and dst must be non-null");
  }
  if (p.m < 1 || p.tp < 1 || p.chunks < 1 || p.groups < 1 || p.only_shard >= p.tp ||
      p.pitch < ScaleSlotPitch(p.m, p.tp, p.chunks, p.groups) || p.pitch % 4 != 0) {
    return InvalidArgumentError(
        "scale slots: bad sizes m=" + std::to_string(p.m) + " tp=" + std::to_string(p.tp) +
        " chunks=" + std::to_string(p.chunks) + " groups=" + std::to_string(p.groups) +
        " pitch=" + std::to_string(p.pitch) + " only_shard=" + std::to_string(p.only_shard));
  }
  if (!IsAligned(p.dst, 16)) return InvalidArgumentError("scale slots: dst not 16-byte aligned");
  int64_t row0 = 0, rows = p.m;
  if (p.only_shard >= 0) {  // ShardRows(m, tp, only_shard)
    const int64_t base = p.m / p.tp, extra = p.m % p.tp;
    row0 = p.only_shard * base + (p.only_shard < extra ? p.only_shard : extra);
    rows = base + (p.only_shard < extra ? 1 : 0);
  }
  if (rows == 0) return Status::Ok();
  const int64_t total = p.groups * rows;
  ScatterScaleSlotsKernel<<<GridFor(total), kThreads, 0, stream>>>(p, row0, rows);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return InternalError(std::string("scale slots launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace tpserve
