// Causal varlen prefill attention on Hopper's warpgroup MMA (engine/attention_wgmma.h).
// Plain CUDA C++17; the kernel body needs sm_90a and traps elsewhere (the launcher is only
// called where TPSERVE_HAS_SM90A is defined and the device is compute capability 9.0).
//
// A block of two warpgroups owns one (sequence, query head) and a tile of 128 query rows,
// 64 per warpgroup. Q (128 x 128) and three stages each of K and V tiles of 128 keys sit in
// shared memory as 128-byte swizzled panels (engine/wgmma.cuh), filled by cp.async from all
// 256 threads. Per key tile, each warpgroup computes S = Q K^T (eight m64n128k16 products,
// both operands from shared memory), the online softmax on S in registers, and O += P V with
// P from registers (the S accumulator's layout is the A fragment's) and V read MN-major.
// P_j V_j and S_{j+1} = Q K_{j+1} are issued together, so the tensor cores run them back to
// back; tiles are copied two or three steps ahead of their use (one barrier per step).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "comm/cuda_check.h"
#include "engine/attention_store.cuh"
#include "engine/attention_wgmma.h"
#include "engine/device_math.cuh"
#include "engine/mma.cuh"
#include "engine/wgmma.cuh"
#include "layers/fp8_divide.cuh"
#include "layers/kernel_grid.h"

namespace tpserve {
namespace {

using namespace device;

constexpr int kHeadDim = 128;
constexpr int kBr = 128;  // query rows per block, 64 per warpgroup
constexpr int kBc = 128;  // keys per tile
constexpr int kWgThreads = 256;
constexpr int kPanelBytes = 128 * 128;       // 128 rows x 64 BF16 (one swizzle width)
constexpr int kTileBytes = 2 * kPanelBytes;  // 128 rows x 128 BF16: two panels
constexpr int kStages = 3;                   // K and V tiles in flight or in use
constexpr int kQOffset = 0;                  // shared layout: [Q | K 0..2 | V 0..2]
constexpr int kKOffset = kTileBytes;
constexpr int kVOffset = (1 + kStages) * kTileBytes;
// + slack to align the base to 1024 bytes: 230,400 bytes of the 232,448 a block may have.
constexpr int kSmemBytes = (1 + 2 * kStages) * kTileBytes + 1024;

// Byte offset of the 16-byte chunk `c` (0..15: dims 8c..8c+7) of row `r` in a swizzled tile.
__device__ __forceinline__ uint32_t SwizzledChunk(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * kPanelBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Copies rows [row0, row0 + 128) of a [rows, stride] BF16 matrix (this head's 128 columns
// at `base`) into a swizzled tile; rows at or past `limit` are zeros (not read). Each thread
// copies column chunk threadIdx % 16 of every 16th row.
__device__ __forceinline__ void LoadTile(uint32_t tile, const uint16_t* base, int64_t stride,
                                         int row0, int limit) {
  const int c = static_cast<int>(threadIdx.x) & 15;
  const int r0 = static_cast<int>(threadIdx.x) >> 4;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = r0 + 16 * i;
    const bool past = row0 + r >= limit;
    const uint16_t* src = past ? base : base + static_cast<int64_t>(row0 + r) * stride + c * 8;
    const uint32_t dst = tile + SwizzledChunk(r, c);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(past ? 0 : 16));
#else
    (void)dst, (void)src;
#endif
  }
}

__global__ void __launch_bounds__(kWgThreads, 1)
    CausalAttentionWgmmaKernel(AttentionParams p, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t wg_smem_raw[];
  // 1024-byte aligned base: the swizzle pattern repeats every 1024 bytes of address.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem_raw));
  const uint32_t smem = (raw + 1023u) & ~1023u;
  const uint32_t q_tile = smem + kQOffset;

  const int q_heads = static_cast<int>(p.q_heads);
  const int seq = static_cast<int>(blockIdx.x) / q_heads;
  const int head = static_cast<int>(blockIdx.x) - seq * q_heads;
  const int tokens = static_cast<int>(p.tokens);
  int begin = p.cu_seqlens[seq];
  int end = p.cu_seqlens[seq + 1];
  begin = begin < 0 ? 0 : (begin > tokens ? tokens : begin);
  end = end < begin ? begin : (end > tokens ? tokens : end);
  const int len = end - begin;
  const int num_tiles = (len + kBr - 1) / kBr;
  if (static_cast<int>(blockIdx.y) >= num_tiles) return;  // uniform over the block
  const int kv_head = head / (q_heads / static_cast<int>(p.kv_heads));

  const int wg = static_cast<int>(threadIdx.x) >> 7;          // warpgroup: rows 64 wg ..
  const int warp = (static_cast<int>(threadIdx.x) >> 5) & 3;  // warp in the warpgroup
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2;
  const int t = lane & 3;

  const uint16_t* q_base = reinterpret_cast<const uint16_t*>(p.q) +
                           static_cast<int64_t>(begin) * p.q_row_stride + int64_t{head} * kHeadDim;
  const uint16_t* k_base = reinterpret_cast<const uint16_t*>(p.k) +
                           static_cast<int64_t>(begin) * p.k_row_stride +
                           int64_t{kv_head} * kHeadDim;
  const uint16_t* v_base = reinterpret_cast<const uint16_t*>(p.v) +
                           static_cast<int64_t>(begin) * p.v_row_stride +
                           int64_t{kv_head} * kHeadDim;
  float amax = 0.0f;

  // Tiles from the last (the most keys) down, so the heaviest are scheduled first.
  for (int tile = num_tiles - 1 - static_cast<int>(blockIdx.y); tile >= 0;
       tile -= static_cast<int>(gridDim.y)) {
    const int q0 = tile * kBr;
    const int kv_end = min(q0 + kBr, len);  // causal: no key past the tile's last row
    const int n_kv = (kv_end + kBc - 1) / kBc;
    const int row_lo = q0 + wg * 64 + warp * 16 + g;  // this thread's rows: row_lo, row_lo + 8

    __syncthreads();  // the previous tile's readers are done with every buffer
    // Copy groups, committed by every thread in this order: {Q, K0}, {K1, V0}, {K2, V1}, then
    // one per key step i: {K(i+3), V(i+2)} (empty past the last tile), so that step i finds
    // {K(i+1), V(i)} complete by waiting for all but the newest group.
    auto load_kv = [&](int key_tile, bool k, bool v) {
      if (key_tile >= n_kv) return;
      if (k) {
        LoadTile(smem + kKOffset + (key_tile % kStages) * kTileBytes, k_base, p.k_row_stride,
                 key_tile * kBc, kv_end);
      }
      if (v) {
        LoadTile(smem + kVOffset + (key_tile % kStages) * kTileBytes, v_base, p.v_row_stride,
                 key_tile * kBc, kv_end);
      }
    };
    LoadTile(q_tile, q_base, p.q_row_stride, q0, len);
    load_kv(0, true, false);
    CopyAsyncCommit();
    load_kv(1, true, false);
    load_kv(0, false, true);
    CopyAsyncCommit();
    load_kv(2, true, false);
    load_kv(1, false, true);
    CopyAsyncCommit();
    CopyAsyncWait<2>();
    FenceProxyAsyncShared();
    __syncthreads();

    // This warpgroup's Q rows: k-step s reads panel s / 4, 32 bytes in per step.
    auto q_desc = [&](int s) {
      return SmemDescSw128(q_tile + (s >> 2) * kPanelBytes + wg * 64 * 128 + (s & 3) * 32, 0, 1024);
    };
    auto k_desc = [&](int stage, int s) {
      return SmemDescSw128(
          smem + kKOffset + stage * kTileBytes + (s >> 2) * kPanelBytes + (s & 3) * 32, 0, 1024);
    };
    // V as B of P V: K = keys on the rows (16 per step: 2048 bytes), N = dims across the two
    // panels (LBO), 8-key groups 1024 bytes apart (SBO).
    auto v_desc = [&](int stage, int s) {
      return SmemDescSw128(smem + kVOffset + stage * kTileBytes + s * 2048, kPanelBytes, 1024);
    };

    float s_acc[64];
    float o[64];
    uint32_t p_frag[8][4];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = s_acc[i] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};

    WgmmaFence();
#pragma unroll
    for (int s = 0; s < 8; ++s) WgmmaSS64x128x16(s_acc, q_desc(s), k_desc(0, s), s > 0 ? 1 : 0);
    WgmmaCommit();
    WgmmaWait<0>();
    PinRegisters(s_acc);

    for (int j = 0; j < n_kv; ++j) {
      const int kv0 = j * kBc;
      // Masks: keys after the row (causal) or past the sequence; only the tiles that reach
      // this warp's diagonal or the sequence's end have any (warp-uniform).
      if (kv0 + kBc - 1 > q0 + wg * 64 + warp * 16 || len - kv0 < kBc) {
        // Element (nt, e) is key kv0 + 8 nt + 2t + (e & 1) of row row_lo + 8 (e >> 1).
        const int last_key = len - 1 - kv0 - 2 * t;
        const int limit[2] = {min(row_lo - kv0 - 2 * t, last_key),
                              min(row_lo + 8 - kv0 - 2 * t, last_key)};
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (nt * 8 + (e & 1) > limit[e >> 1]) s_acc[4 * nt + e] = -INFINITY;
          }
        }
      }
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < 64; ++i) tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], s_acc[i]);
      float alpha[2], base[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        const float new_max = fmaxf(row_max[h], tile_max[h]);
        // A row with no visible key yet keeps max -inf; subtracting 0 keeps NaN out.
        base[h] = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
        alpha[h] = Exp2Approx(fmaf(row_max[h], scale_log2, -base[h]));
        row_max[h] = new_max;
      }
      float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          pr[e] = Exp2Approx(fmaf(s_acc[4 * nt + e], scale_log2, -base[e >> 1]));
          tile_sum[e >> 1] += pr[e];
        }
        // n8 tiles 2kk and 2kk + 1 of S are the A fragment kk of P V.
        p_frag[nt >> 1][(nt & 1) * 2] = PackBf16x2(pr[0], pr[1]);
        p_frag[nt >> 1][(nt & 1) * 2 + 1] = PackBf16x2(pr[2], pr[3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];

      // {K(j+1), V(j)} have landed (all but the newest group); after the barrier every
      // thread is past step j - 1, so the stages of K(j) and V(j - 1) are free for
      // K(j + 3) and V(j + 2).
      CopyAsyncWait<1>();
      FenceProxyAsyncShared();
      __syncthreads();
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        WgmmaRS64x128x16TransB(o, p_frag[kk], v_desc(j % kStages, kk));
      }
      if (j + 1 < n_kv) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          WgmmaSS64x128x16(s_acc, q_desc(s), k_desc((j + 1) % kStages, s), s > 0 ? 1 : 0);
        }
      }
      WgmmaCommit();
      load_kv(j + 3, true, false);
      load_kv(j + 2, false, true);
      CopyAsyncCommit();
      WgmmaWait<0>();
      PinRegisters(o);
      PinRegisters(s_acc);
      // P's registers were read by the product in flight: live until it is done.
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) PinRegisters(p_frag[kk]);
    }
    CopyAsyncWait<0>();  // nothing of this tile is in flight when the next one starts

    uint16_t* out_base = p.out != nullptr ? reinterpret_cast<uint16_t*>(p.out) +
                                                static_cast<int64_t>(begin) * p.out_row_stride +
                                                int64_t{head} * kHeadDim
                                          : nullptr;
    uint8_t* fp8_base = p.out_fp8 != nullptr
                            ? p.out_fp8 + static_cast<int64_t>(begin) * p.out_fp8_row_stride +
                                  int64_t{head} * kHeadDim
                            : nullptr;
    const Fp8Divisor fp8 = MakeFp8Divisor(p.out_fp8 != nullptr ? *p.out_fp8_scale : 1.0f);
    auto store = [&](auto fast_divide) {
      constexpr bool kFast = decltype(fast_divide)::value;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = row_sum[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row = row_lo + 8 * h;
        if (row >= len) continue;
        StoreAttentionRow<kFast, 16>(
            out_base != nullptr ? out_base + row * p.out_row_stride : nullptr,
            fp8_base != nullptr ? fp8_base + row * p.out_fp8_row_stride : nullptr, t, inv_sum, fp8,
            p.out_amax != nullptr, amax,
            [&](int dt) { return make_float2(o[4 * dt + 2 * h], o[4 * dt + 2 * h + 1]); });
      }
    };
    if (fp8.inv != 0.0f) {
      store(std::true_type{});
    } else {
      store(std::false_type{});
    }
  }
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
#else
  (void)p, (void)scale_log2;
  __trap();
#endif
}

}  // namespace

bool WgmmaAttentionSupports(int64_t head_dim) {
#if defined(TPSERVE_HAS_SM90A)
  if (head_dim != kHeadDim) return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
#else
  (void)head_dim;
  return false;
#endif
}

Status LaunchCausalAttentionWgmma(const AttentionParams& p, int64_t tiles, float scale_log2,
                                  cudaStream_t stream) {
  TP_CUDA_CHECK(cudaFuncSetAttribute(CausalAttentionWgmmaKernel,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(static_cast<unsigned>(p.num_seqs * p.q_heads), static_cast<unsigned>(tiles));
  CausalAttentionWgmmaKernel<<<grid, kWgThreads, kSmemBytes, stream>>>(p, scale_log2);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
