// The paged KV cache's write kernel and its launcher (engine/paged_kv_ops.h:
// LaunchPagedKvWrite). Plain CUDA C++17.
//
// BF16 travels as its raw bits (uint16_t), eight to a 16-byte vector.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "comm/cuda_check.h"
#include "engine/device_math.cuh"
#include "engine/launch_checks.h"
#include "engine/paged_kv_ops.h"
#include "engine/paged_kv_store.cuh"
#include "layers/kernel_grid.h"
#include "layers/pdl.cuh"

namespace tpserve {
namespace {

using namespace launch_checks;

// ---------------------------------------------------------------------------------------------
// KV write: one thread per 8 elements of (row, K|V, head).

template <bool kFp8>
__global__ void PagedKvWriteKernel(KvStoreArgs a) {
  PdlEnter();
  const int64_t vecs_per_head = a.head_dim / 8;
  const int64_t per_row = 2 * a.kv_heads * vecs_per_head;
  const int64_t total = a.rows * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row;
    int64_t rest = i - row * per_row;
    const int kv = static_cast<int>(rest / (a.kv_heads * vecs_per_head));
    rest -= kv * a.kv_heads * vecs_per_head;
    const int64_t head = rest / vecs_per_head;
    const int64_t c = rest - head * vecs_per_head;
    const int64_t base = KvRowBase(a, row);
    if (base < 0) continue;  // padding, or corrupt
    const BFloat16* src = (kv == 0 ? a.k + row * a.k_row_stride : a.v + row * a.v_row_stride) +
                          head * a.head_dim + c * 8;
    StoreKv8<kFp8>(a.cache, (kv == 0 ? a.k_offset : a.v_offset) + KvElement(a, base, head, c * 8),
                   *reinterpret_cast<const uint4*>(src), kv == 0 ? a.k_scale : a.v_scale);
  }
}

}  // namespace

Status CheckPagedKvWrite(const PagedKvWriteParams& p) {
  constexpr const char* kP = "PagedKvWriteParams";
  TP_RETURN_IF_ERROR(CheckKvLayout(kP, p.layout, p.layer));
  const int64_t hd = p.layout.head_dim, width = p.layout.kv_heads * hd;
  if (hd % 8 != 0) return BadField(kP, "layout.head_dim", hd, "must be a multiple of 8");
  if (p.rows < 0) return BadField(kP, "rows", p.rows, "must be >= 0");
  TP_RETURN_IF_ERROR(CheckKvScales(p.scales, std::string(kP) + ".scales"));
  const struct {
    const char* name;
    int64_t stride;
  } strides[] = {{"k_row_stride", p.k_row_stride}, {"v_row_stride", p.v_row_stride}};
  for (const auto& st : strides) {
    if (st.stride < width || st.stride % 8 != 0) {
      return BadField(
          kP, st.name, st.stride,
          "must be a multiple of 8 and >= kv_heads * head_dim (" + std::to_string(width) + ")");
    }
  }
  if (p.rows == 0) return Status::Ok();
  return CheckPointers(kP, {{"k", p.k, 16},
                            {"v", p.v, 16},
                            {"cache", p.cache, 16},
                            {"slot_mapping", p.slot_mapping, 4}});
}

Status LaunchPagedKvWrite(const PagedKvWriteParams& p, cudaStream_t stream) {
  TP_RETURN_IF_ERROR(CheckPagedKvWrite(p));
  if (p.rows == 0) return Status::Ok();
  const KvStoreArgs a = MakeKvStoreArgs(p);
  const unsigned grid = GridFor(p.rows * 2 * p.layout.kv_heads * p.layout.head_dim / 8);
  if (p.layout.dtype == KvCacheDtype::kFloat8E4M3) {
    TP_CUDA_CHECK(LaunchPdl(PagedKvWriteKernel<true>, dim3(grid), dim3(kThreads), 0, stream, a));
  } else {
    TP_CUDA_CHECK(LaunchPdl(PagedKvWriteKernel<false>, dim3(grid), dim3(kThreads), 0, stream, a));
  }
  return Status::Ok();
}

}  // namespace tpserve
