// How a layer's K and V rows are stored in the paged KV cache, shared by the cache's write
// kernel (paged_kv_write.cu, LaunchPagedKvWrite) and the RoPE kernel that stores the rows it
// rotates (cuda_ops.cu, RopeParams::kv_store): their argument block, where a row's elements
// go, and how eight of them are stored. Internal to engine/; include only from .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/dtype.h"
#include "engine/device_math.cuh"
#include "engine/paged_kv_ops.h"

namespace tpserve {

struct KvStoreArgs {
  const BFloat16* k = nullptr;
  int64_t k_row_stride = 0;
  const BFloat16* v = nullptr;
  int64_t v_row_stride = 0;
  const int32_t* slot_mapping = nullptr;
  int64_t rows = 0;
  void* cache = nullptr;
  int64_t k_offset = 0;  // element offsets of (layer, K | V, block 0, head 0, slot 0)
  int64_t v_offset = 0;
  int64_t num_slots = 0;  // num_blocks * block_size
  int64_t block_size = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  float k_scale = 1.0f;  // PagedKvWriteParams::scales
  float v_scale = 1.0f;
};

// The device arguments of `p`, which CheckPagedKvWrite has accepted.
inline KvStoreArgs MakeKvStoreArgs(const PagedKvWriteParams& p) {
  KvStoreArgs a;
  a.k = p.k;
  a.k_row_stride = p.k_row_stride;
  a.v = p.v;
  a.v_row_stride = p.v_row_stride;
  a.slot_mapping = p.slot_mapping;
  a.rows = p.rows;
  a.cache = p.cache;
  a.k_offset = p.layout.Offset(p.layer, 0, 0, 0, 0);
  a.v_offset = p.layout.Offset(p.layer, 1, 0, 0, 0);
  a.num_slots = p.layout.num_blocks * p.layout.block_size;
  a.block_size = p.layout.block_size;
  a.kv_heads = p.layout.kv_heads;
  a.head_dim = p.layout.head_dim;
  a.k_scale = p.scales.k;
  a.v_scale = p.scales.v;
  return a;
}

// Where row `row` goes: its block's head 0 at its place in the block, in rows of head_dim
// (-1 for a padding row or a corrupt slot, which are not stored).
__device__ __forceinline__ int64_t KvRowBase(const KvStoreArgs& a, int64_t row) {
  const int64_t slot = a.slot_mapping[row];
  if (slot < 0 || slot >= a.num_slots) return -1;
  const int64_t block = slot / a.block_size;
  return block * a.kv_heads * a.block_size + (slot - block * a.block_size);
}

// Element index of (head, i) of a row at `base` (KvRowBase) within a layer's K or V part.
__device__ __forceinline__ int64_t KvElement(const KvStoreArgs& a, int64_t base, int64_t head,
                                             int64_t i) {
  return (base + head * a.block_size) * a.head_dim + i;
}

// Eight BF16 elements (raw bits) into the cache at element `offset`: as they are, or (kFp8) as
// the E4M3 codes of x / scale (the layer's K or V scale; CpuKvCache::Write's codes).
template <bool kFp8>
__device__ __forceinline__ void StoreKv8(void* cache, int64_t offset, const uint4& raw,
                                         float scale) {
  if constexpr (kFp8) {
    uint2 codes;
    if (scale == 1.0f) {  // x / 1 is x: the conversion alone
      codes = device::Bf16x8ToE4m3Sat(raw);
    } else {
      float f[8];
      device::UnpackBf16x8(raw, f);
      const Fp8Divisor d = MakeFp8Divisor(scale);
      codes = d.inv != 0.0f ? device::Fp8Codes8<true>(f, d) : device::Fp8Codes8<false>(f, d);
    }
    reinterpret_cast<uint2*>(static_cast<uint8_t*>(cache) + offset)[0] = codes;
  } else {
    (void)scale;
    reinterpret_cast<uint4*>(static_cast<uint16_t*>(cache) + offset)[0] = raw;
  }
}

}  // namespace tpserve
