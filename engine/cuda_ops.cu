// Kernels and launchers for engine/cuda_ops.h. Plain CUDA C++17: host logic beyond argument
// checks belongs in .cc files (nvcc 13.0's front end is fragile, see GPU_HOST.md).
//
// BF16 travels as its raw bits (uint16_t), eight to a 16-byte vector, so that no operator
// overloads get in the way.
#include "engine/cuda_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "comm/cuda_check.h"
#include "engine/launch_checks.h"
#include "layers/fp8_divide.cuh"
#include "layers/kernel_grid.h"

namespace tpserve {
namespace {

using namespace launch_checks;

std::string Str(int64_t v) { return std::to_string(v); }

// ---------------------------------------------------------------------------------------------
// Device helpers

__device__ __forceinline__ float Bf16ToFloat(uint32_t bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ uint32_t FloatToBf16(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Two floats as a bf16x2 word, the lower index in the low half (the MMA operand order too).
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return FloatToBf16(lo) | (FloatToBf16(hi) << 16);
}

__device__ __forceinline__ void UnpackBf16x8(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint4 PackBf16x8(const float (&f)[8]) {
  return make_uint4(PackBf16x2(f[0], f[1]), PackBf16x2(f[2], f[3]), PackBf16x2(f[4], f[5]),
                    PackBf16x2(f[6], f[7]));
}

// Eight codes: one 8-byte store when aligned, bytes otherwise.
__device__ __forceinline__ void StoreFp8x8(uint8_t* dst, const float (&f)[8], const Fp8Divisor& d) {
  uint8_t q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = QuantizeToE4M3(f[i], d);
  if ((reinterpret_cast<uintptr_t>(dst) & 7u) == 0) {
    uint2 w;
    memcpy(&w, q, sizeof w);
    *reinterpret_cast<uint2*>(dst) = w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = q[i];
  }
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ float BlockSum(float v) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  v = WarpSum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? warp_sums[lane] : 0.0f;
    v = WarpSum(v);
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  return warp_sums[0];
}

// Max over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// fmaxf drops a NaN operand, so NaN values are skipped, as in layers/fp8.h's Amax.
__device__ float BlockMax(float v) {
  __shared__ float warp_maxes[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if (lane == 0) warp_maxes[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? warp_maxes[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    if (lane == 0) warp_maxes[0] = v;
  }
  __syncthreads();
  return warp_maxes[0];
}

// The block's largest |bf16(y)| into *amax (zeroed by the launcher): one
// atomic per block. Non-negative floats order as their bit patterns.
__device__ __forceinline__ void BlockAmaxInto(float* amax, float local) {
  const float m = BlockMax(local);
  if (threadIdx.x == 0 && m > 0.0f) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

// |y| after rounding to BF16, as the BF16 output stores it.
__device__ __forceinline__ float AbsBf16(float y) { return fabsf(Bf16ToFloat(FloatToBf16(y))); }

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: one block per row, each thread holding up to kRmsVecsPerThread vectors of 8 in
// registers between the sum of squares and the output.

constexpr int kRmsVecsPerThread = 2;
constexpr int kRmsMaxThreads = 1024;
constexpr int64_t kRmsMaxDim = 8 * kRmsVecsPerThread * kRmsMaxThreads;  // 16384

__global__ void __launch_bounds__(kRmsMaxThreads) RmsNormKernel(RmsNormParams p) {
  const int64_t row = blockIdx.x;
  const int vecs = static_cast<int>(p.dim / 8);
  const int64_t offset = row * p.dim;
  const uint4* in = reinterpret_cast<const uint4*>(p.input + offset);

  float h[kRmsVecsPerThread][8];
  float sum_sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kRmsVecsPerThread; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v >= vecs) continue;
    UnpackBf16x8(in[v], h[k]);
    if (p.residual != nullptr) {
      float r[8];
      UnpackBf16x8(reinterpret_cast<const uint4*>(p.residual + offset)[v], r);
      if (p.residual2 != nullptr) {
        float r2[8];
        UnpackBf16x8(reinterpret_cast<const uint4*>(p.residual2 + offset)[v], r2);
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = Bf16ToFloat(FloatToBf16(r[i] + r2[i]));
      }
      // h = bf16(x + residual): the residual stream is BF16, and the norm sees what is stored.
#pragma unroll
      for (int i = 0; i < 8; ++i) h[k][i] = Bf16ToFloat(FloatToBf16(h[k][i] + r[i]));
      reinterpret_cast<uint4*>(p.residual_out + offset)[v] = PackBf16x8(h[k]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sum_sq += h[k][i] * h[k][i];
  }
  sum_sq = BlockSum(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(p.dim) + p.eps);
  const Fp8Divisor fp8 = MakeFp8Divisor(p.out_fp8 != nullptr ? *p.out_fp8_scale : 1.0f);
  const uint4* weight = reinterpret_cast<const uint4*>(p.weight);
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kRmsVecsPerThread; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v >= vecs) continue;
    float w[8];
    UnpackBf16x8(weight[v], w);
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = h[k][i] * inv_rms * w[i];
    if (p.out != nullptr) reinterpret_cast<uint4*>(p.out + offset)[v] = PackBf16x8(y);
    if (p.out_fp8 != nullptr) StoreFp8x8(p.out_fp8 + offset + 8 * v, y, fp8);
    if (p.out_amax != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, AbsBf16(y[i]));
    }
  }
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
}

// ---------------------------------------------------------------------------------------------
// RoPE: one block per row. The block first tabulates cos/sin of the row's head_dim/2 angles
// (in double, like the reference; the inverse frequencies from p.inv_freq, or plain RoPE's
// from theta), then every head of q and k uses the table.

constexpr int kRopeThreads = 128;
constexpr int64_t kRopeMaxHeadDim = 512;

template <int kVec>
__global__ void __launch_bounds__(kRopeThreads) RopeKernel(RopeParams p) {
  __shared__ float2 cos_sin[kRopeMaxHeadDim / 2];
  const int64_t row = blockIdx.x;
  const int head_dim = static_cast<int>(p.head_dim);
  const int half = head_dim / 2;
  const double position = static_cast<double>(p.positions[row]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const double inv_freq =
        p.inv_freq != nullptr
            ? p.inv_freq[i]
            : pow(p.theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    double s, c;
    sincos(position * inv_freq, &s, &c);
    cos_sin[i] = make_float2(static_cast<float>(c), static_cast<float>(s));
  }
  __syncthreads();

  const int groups = half / kVec;  // per head
  const int64_t q_items = p.q_heads * groups;
  const int64_t items = q_items + (p.k != nullptr ? p.kv_heads * groups : 0);
  for (int64_t item = threadIdx.x; item < items; item += blockDim.x) {
    const bool is_q = item < q_items;
    const int64_t local = is_q ? item : item - q_items;
    const int64_t head = local / groups;
    const int i0 = static_cast<int>(local % groups) * kVec;
    uint16_t* x = reinterpret_cast<uint16_t*>(is_q ? p.q + row * p.q_row_stride + head * head_dim
                                                   : p.k + row * p.k_row_stride + head * head_dim);
    float a[kVec], b[kVec];
    if constexpr (kVec == 8) {
      UnpackBf16x8(*reinterpret_cast<const uint4*>(x + i0), a);
      UnpackBf16x8(*reinterpret_cast<const uint4*>(x + i0 + half), b);
    } else {
      a[0] = Bf16ToFloat(x[i0]);
      b[0] = Bf16ToFloat(x[i0 + half]);
    }
    float ra[kVec], rb[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float2 cs = cos_sin[i0 + j];
      ra[j] = a[j] * cs.x - b[j] * cs.y;
      rb[j] = b[j] * cs.x + a[j] * cs.y;
    }
    if constexpr (kVec == 8) {
      *reinterpret_cast<uint4*>(x + i0) = PackBf16x8(ra);
      *reinterpret_cast<uint4*>(x + i0 + half) = PackBf16x8(rb);
    } else {
      x[i0] = static_cast<uint16_t>(FloatToBf16(ra[0]));
      x[i0 + half] = static_cast<uint16_t>(FloatToBf16(rb[0]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Causal varlen attention, flash-attention-2 style on mma.sync m16n8k16 (BF16 in, FP32
// accumulate). A block owns one (sequence, query head) and a tile of kAttnBr query rows; each
// of its warps owns kAttnMTiles m16 tiles of those rows and keeps their O accumulators and
// softmax state in registers, so every K or V fragment read from shared memory feeds
// kAttnMTiles products. Q, K and V tiles are staged through shared memory (K and V double
// buffered, kAttnBc keys each).
//
// Fragment layouts (PTX ISA, "mma.m16n8k16" for .bf16), g = lane / 4, t = lane % 4:
//   A (16x16, row-major) regs 0..3: (row g, cols 2t..2t+1), (row g+8, cols 2t..), (row g,
//     cols 2t+8..), (row g+8, cols 2t+8..)
//   B (16x8, "col"): regs 0..1: (k rows 2t..2t+1, col g), (k rows 2t+8..2t+9, col g)
//   C (16x8 FP32): c0, c1: (row g, cols 2t, 2t+1); c2, c3: (row g+8, same cols)
// so the C fragments of two adjacent n8 tiles of S are exactly the A fragment of P for the
// next product, without a trip through shared memory.

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = 32 * kAttnWarps;
constexpr int kAttnMTiles = 2;                          // m16 tiles per warp
constexpr int kAttnBr = 16 * kAttnMTiles * kAttnWarps;  // query rows per tile
constexpr int kAttnBc = 64;                             // keys per tile

__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the launcher documents sm_80+; the default build is sm_90a only
#endif
}

// Four 8x8 BF16 matrices from shared memory (ldmatrix .x4): lanes 8i..8i+7 give the
// addresses of matrix i's eight 16-byte rows; r[i] receives this lane's pair of matrix i,
// row lane/4, columns 2(lane%4) and +1 (kTrans: column lane/4, rows 2(lane%4) and +1), the
// lower index in the low half.
template <bool kTrans>
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], const uint16_t* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0;
  __trap();
#endif
}

// 16 bytes global -> shared without a trip through registers (cp.async, L2 only); `zero`
// fills the 16 bytes with zeros instead (src is then not read).
__device__ __forceinline__ void CopyAsync16(uint16_t* dst, const uint16_t* src, bool zero) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int src_bytes = zero ? 0 : 16;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src),
               "r"(src_bytes));
#else
  (void)dst, (void)src, (void)zero;
  __trap();
#endif
}
__device__ __forceinline__ void CopyAsyncCommit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// Shared memory of the attention kernel (dynamic): K and V tiles, two of each (the next
// tile loads while this one is used), and the Q tile.
template <int kHeadDim>
constexpr size_t AttentionSmemBytes() {
  return (4 * static_cast<size_t>(kAttnBc) + kAttnBr) * (kHeadDim + 8) * sizeof(uint16_t);
}

// 2^x on the multi-function unit; results below 2^-126 flush to zero (softmax weights
// that small vanish next to the row's largest, which is 1).
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Blocks of the attention kernel resident per SM (its __launch_bounds__); the launcher
// sizes the grid with it.
constexpr int kAttnBlocksPerSm = 2;

template <int kHeadDim>
__global__ void __launch_bounds__(kAttnThreads, kAttnBlocksPerSm)
    CausalAttentionKernel(AttentionParams p, float scale_log2) {
  // Rows padded by 8 BF16 (16 bytes): rows stay 16-byte aligned for the copies, and the
  // ldmatrix row addresses of 8 consecutive rows hit distinct banks.
  constexpr int kPitch = kHeadDim + 8;
  constexpr int kVecsPerRow = kHeadDim / 8;
  constexpr int kKSteps = kHeadDim / 16;   // k-steps of Q.K^T
  constexpr int kDimTiles = kHeadDim / 8;  // n8 tiles of O
  constexpr int kKeyTiles = kAttnBc / 8;   // n8 tiles of S
  constexpr int kTileElems = kAttnBc * kPitch;
  constexpr int kWarpRows = 16 * kAttnMTiles;
  // Each thread copies the same 16-byte column of every kRowStep-th row of a tile.
  constexpr int kRowStep = kAttnThreads / kVecsPerRow;
  constexpr int kCopies = kAttnBc / kRowStep;
  constexpr int kQCopies = kAttnBr / kRowStep;
  static_assert(
      kAttnThreads % kVecsPerRow == 0 && kAttnBc % kRowStep == 0 && kAttnBr % kRowStep == 0,
      "tile copies");
  // [K buffer 0 | K buffer 1 | V buffer 0 | V buffer 1 | Q tile]
  extern __shared__ __align__(16) uint16_t attn_smem[];
  uint16_t* q_tile = attn_smem + 4 * kTileElems;

  // The sequence first, so that a block with no tile leaves at once (grid.y is sized for a
  // typical sequence of the bucket: a block whose y is at least its sequence's tile count has
  // nothing to do).
  // The launcher bounds num_seqs * q_heads and tokens by 2^31 - 1: 32-bit from here on.
  const int q_heads = static_cast<int>(p.q_heads);
  const int seq = static_cast<int>(blockIdx.x) / q_heads;
  const int head = static_cast<int>(blockIdx.x) - seq * q_heads;
  // Clamped, so that a corrupt cu_seqlens cannot send a block outside [0, tokens).
  const int tokens = static_cast<int>(p.tokens);
  int begin = p.cu_seqlens[seq];
  int end = p.cu_seqlens[seq + 1];
  begin = begin < 0 ? 0 : (begin > tokens ? tokens : begin);
  end = end < begin ? begin : (end > tokens ? tokens : end);
  const int len = end - begin;
  const int num_tiles = len / kAttnBr + (len % kAttnBr != 0 ? 1 : 0);
  if (static_cast<int>(blockIdx.y) >= num_tiles) return;  // uniform over the block

  const int kv_head = head / (q_heads / static_cast<int>(p.kv_heads));
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;

  const uint16_t* k_base = reinterpret_cast<const uint16_t*>(p.k) +
                           static_cast<int64_t>(begin) * p.k_row_stride +
                           int64_t{kv_head} * kHeadDim;
  const uint16_t* v_base = reinterpret_cast<const uint16_t*>(p.v) +
                           static_cast<int64_t>(begin) * p.v_row_stride +
                           int64_t{kv_head} * kHeadDim;
  float amax = 0.0f;  // of the BF16-rounded values this thread stores (out_amax)

  // This thread's share of every tile copy: rows copy_row + i * kRowStep, column copy_col.
  const int copy_row = threadIdx.x / kVecsPerRow;
  const int copy_col = (threadIdx.x % kVecsPerRow) * 8;
  const int64_t k_step = kRowStep * p.k_row_stride;
  const int64_t v_step = kRowStep * p.v_row_stride;
  // ldmatrix row addresses: lanes 8i..8i+7 give matrix i's rows.
  const int mat = lane >> 3;

  // Tiles from the last (the most keys) down, so the heaviest are scheduled first (blockIdx.y
  // varies slowest). Every condition below that guards a __syncthreads is uniform over the
  // block.
  for (int tile = num_tiles - 1 - static_cast<int>(blockIdx.y); tile >= 0;
       tile -= static_cast<int>(gridDim.y)) {
    const int q0 = tile * kAttnBr;
    const int warp_row0 = q0 + warp * kWarpRows;  // this warp's first query row
    // Causal: the tile's last row is q0 + kAttnBr - 1, so no key at or beyond kv_end matters;
    // this warp needs keys up to its own last row only.
    const int kv_end = len - q0 > kAttnBr ? q0 + kAttnBr : len;
    const int warp_kv_end = warp_row0 + kWarpRows < kv_end ? warp_row0 + kWarpRows : kv_end;

    // Starts loading the key tile at kv0 into buffer `buf` (one commit group per thread).
    auto load_tile = [&](int buf, int kv0) {
      uint16_t* k_dst = attn_smem + buf * kTileElems + copy_row * kPitch + copy_col;
      uint16_t* v_dst = attn_smem + (2 + buf) * kTileElems + copy_row * kPitch + copy_col;
      const int64_t first = static_cast<int64_t>(kv0 + copy_row);
      const uint16_t* k_src = k_base + first * p.k_row_stride + copy_col;
      const uint16_t* v_src = v_base + first * p.v_row_stride + copy_col;
      const int rows_left = kv_end - kv0 - copy_row;  // this thread's rows before kv_end
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        // Zeros past kv_end: such keys are masked, and 0 * V must not meet a NaN there.
        // The address stays valid (the sequence's first row) when nothing is read.
        const bool past = i * kRowStep >= rows_left;
        CopyAsync16(k_dst + i * kRowStep * kPitch, past ? k_base + copy_col : k_src, past);
        CopyAsync16(v_dst + i * kRowStep * kPitch, past ? v_base + copy_col : v_src, past);
        k_src += k_step;
        v_src += v_step;
      }
    };
    // The Q tile (zeros past the sequence) joins the first key tile's commit group.
    {
      const uint16_t* q_base = reinterpret_cast<const uint16_t*>(p.q) +
                               static_cast<int64_t>(begin) * p.q_row_stride +
                               int64_t{head} * kHeadDim;
      const int rows_left = len - q0 - copy_row;
      const uint16_t* q_src =
          q_base + static_cast<int64_t>(q0 + copy_row) * p.q_row_stride + copy_col;
      const int64_t q_step = kRowStep * p.q_row_stride;
#pragma unroll
      for (int i = 0; i < kQCopies; ++i) {
        const bool past = i * kRowStep >= rows_left;
        CopyAsync16(q_tile + (copy_row + i * kRowStep) * kPitch + copy_col,
                    past ? q_base + copy_col : q_src, past);
        q_src += q_step;
      }
    }
    load_tile(0, 0);
    CopyAsyncCommit();

    float o[kAttnMTiles][kDimTiles][4];
#pragma unroll
    for (int mt = 0; mt < kAttnMTiles; ++mt) {
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
      }
    }
    // Per m-tile and half (rows g, g + 8): the running max of the raw scores Q.K (the
    // positive scale is applied inside the exponent) and this thread's share of the sum.
    float row_max[kAttnMTiles][2], row_sum[kAttnMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kAttnMTiles; ++mt) {
      row_max[mt][0] = row_max[mt][1] = -INFINITY;
      row_sum[mt][0] = row_sum[mt][1] = 0.0f;
    }

    int buf = 0;
    for (int kv0 = 0; kv0 < kv_end; kv0 += kAttnBc, buf ^= 1) {
      // The next tile loads into the other buffer (everyone finished reading it at the end
      // of the previous step) while this one is used.
      if (kv_end - kv0 > kAttnBc) {
        load_tile(buf ^ 1, kv0 + kAttnBc);
        CopyAsyncCommit();
        CopyAsyncWait<1>();
      } else {
        CopyAsyncWait<0>();
      }
      __syncthreads();  // this tile (and the Q tile), from every thread's copies

      // A warp whose rows all precede the tile has nothing to add (causal); it only keeps
      // the block's barriers.
      if (kv0 < warp_kv_end) {
        const uint16_t* k_tile = attn_smem + buf * kTileElems;
        const uint16_t* v_tile = attn_smem + (2 + buf) * kTileElems;

        // S = Q K^T for this warp's rows and the tile's kAttnBc keys.
        float s[kAttnMTiles][kKeyTiles][4];
#pragma unroll
        for (int mt = 0; mt < kAttnMTiles; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
            s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
          }
        }
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          // A = Q rows (16 per m-tile) x dims ks*16..: matrices (rows 0-7 / 8-15, dims
          // 0-7 / 8-15), in the A register order.
          uint32_t a[kAttnMTiles][4];
#pragma unroll
          for (int mt = 0; mt < kAttnMTiles; ++mt) {
            LoadMatrixX4<false>(
                a[mt], q_tile + (warp * kWarpRows + mt * 16 + (mat & 1) * 8 + (lane & 7)) * kPitch +
                           ks * 16 + (mat >> 1) * 8);
          }
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; nt += 2) {
            // B[k = dim][n = key] = K[key][dim]: matrices (keys nt*8.., dims ks*16 + 0 / 8)
            // and the same for keys (nt+1)*8..; each lane's pair is (key g, dims 2t, 2t+1).
            uint32_t b[4];
            LoadMatrixX4<false>(b, k_tile + ((nt + (mat >> 1)) * 8 + (lane & 7)) * kPitch +
                                       ks * 16 + (mat & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < kAttnMTiles; ++mt) {
              MmaBf16(s[mt][nt], a[mt], b[0], b[1]);
              MmaBf16(s[mt][nt + 1], a[mt], b[2], b[3]);
            }
          }
        }

        uint32_t p_frag[kAttnMTiles][kAttnBc / 16][4];
#pragma unroll
        for (int mt = 0; mt < kAttnMTiles; ++mt) {
          const int row_lo = warp_row0 + mt * 16 + g;  // this thread's two rows
          // Masks: a key after the row (causal) or past the sequence. Only tiles that reach
          // the m-tile's diagonal or the sequence's end have any (warp-uniform).
          if (kv0 + kAttnBc - 1 > warp_row0 + mt * 16 || len - kv0 < kAttnBc) {
            // Element (nt, e) holds key kv0 + nt*8 + 2t + (e & 1) of row row_lo (e < 2) or
            // row_lo + 8: it is visible iff nt*8 + (e & 1) <= limit[e >> 1].
            const int last_key = len - 1 - kv0 - 2 * t;
            const int limit[2] = {min(row_lo - kv0 - 2 * t, last_key),
                                  min(row_lo + 8 - kv0 - 2 * t, last_key)};
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                if (nt * 8 + (e & 1) > limit[e >> 1]) s[mt][nt][e] = -INFINITY;
              }
            }
          }
          // The tile's row maxima (over the 4 lanes of a row).
          float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[mt][nt][e]);
          }
          float alpha[2];
          float base[2];  // the new max, in log2 units
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
            tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
            const float new_max = fmaxf(row_max[mt][i], tile_max[i]);
            // A row with no visible key yet keeps max -inf; subtracting 0 instead keeps
            // exp2(-inf - -inf) = NaN out (every p and alpha is then 0).
            base[i] = new_max == -INFINITY ? 0.0f : new_max * scale_log2;
            alpha[i] = Exp2Approx(fmaf(row_max[mt][i], scale_log2, -base[i]));
            row_max[mt][i] = new_max;
          }
          // P, packed to BF16 at once (the A fragments of P V; it frees S's registers):
          // n8 tiles 2kk and 2kk+1 of S are the A fragment kk.
          float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
            float pr[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              pr[e] = Exp2Approx(fmaf(s[mt][nt][e], scale_log2, -base[e >> 1]));
              tile_sum[e >> 1] += pr[e];
            }
            p_frag[mt][nt >> 1][(nt & 1) * 2] = PackBf16x2(pr[0], pr[1]);
            p_frag[mt][nt >> 1][(nt & 1) * 2 + 1] = PackBf16x2(pr[2], pr[3]);
          }
#pragma unroll
          for (int i = 0; i < 2; ++i) row_sum[mt][i] = row_sum[mt][i] * alpha[i] + tile_sum[i];
#pragma unroll
          for (int dt = 0; dt < kDimTiles; ++dt) {
            o[mt][dt][0] *= alpha[0];
            o[mt][dt][1] *= alpha[0];
            o[mt][dt][2] *= alpha[1];
            o[mt][dt][3] *= alpha[1];
          }
        }

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < kAttnBc / 16; ++kk) {
#pragma unroll
          for (int dt = 0; dt < kDimTiles; dt += 2) {
            // B[k = key][n = dim] = V[key][dim], transposed on load: matrices (keys
            // kk*16 + 0 / 8.., dims dt*8..) and the same for dims (dt+1)*8..; each lane's
            // pair is (keys 2t, 2t+1 of its half, dim g).
            uint32_t b[4];
            LoadMatrixX4<true>(b, v_tile + (kk * 16 + (mat & 1) * 8 + (lane & 7)) * kPitch +
                                      (dt + (mat >> 1)) * 8);
#pragma unroll
            for (int mt = 0; mt < kAttnMTiles; ++mt) {
              MmaBf16(o[mt][dt], p_frag[mt][kk], b[0], b[1]);
              MmaBf16(o[mt][dt + 1], p_frag[mt][kk], b[2], b[3]);
            }
          }
        }
      }
      __syncthreads();  // everyone is done with this buffer before it loads again
    }

    // This thread's two adjacent values per n8 tile of each of its rows: BF16, and/or the
    // E4M3 codes of those BF16 values (what a quantize pass over `out` would give). The
    // output pointers are formed here, not held through the key loop (registers).
    uint16_t* out_base = p.out != nullptr ? reinterpret_cast<uint16_t*>(p.out) +
                                                static_cast<int64_t>(begin) * p.out_row_stride +
                                                int64_t{head} * kHeadDim
                                          : nullptr;
    uint8_t* fp8_base = p.out_fp8 != nullptr
                            ? p.out_fp8 + static_cast<int64_t>(begin) * p.out_fp8_row_stride +
                                  int64_t{head} * kHeadDim
                            : nullptr;
    const Fp8Divisor fp8 = MakeFp8Divisor(p.out_fp8 != nullptr ? *p.out_fp8_scale : 1.0f);
    // Instantiated twice: with the branch-free division (fp8.inv != 0, checked once here)
    // and with the IEEE fallback; a per-value branch made this epilogue a third of the
    // kernel's stalls under a profiler.
    auto store = [&](auto fast_divide) {
      constexpr bool kFast = decltype(fast_divide)::value;
#pragma unroll
      for (int mt = 0; mt < kAttnMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float sum = row_sum[mt][half];
          sum += __shfl_xor_sync(0xffffffffu, sum, 1);
          sum += __shfl_xor_sync(0xffffffffu, sum, 2);
          // Every real row sees its own key, so its sum is >= 1; rows past len are not stored.
          const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
          const int row = warp_row0 + mt * 16 + g + 8 * half;
          if (row >= len) continue;
          uint32_t* dst = out_base != nullptr
                              ? reinterpret_cast<uint32_t*>(out_base + row * p.out_row_stride)
                              : nullptr;
          uint16_t* dst_fp8 =
              fp8_base != nullptr
                  ? reinterpret_cast<uint16_t*>(fp8_base + row * p.out_fp8_row_stride)
                  : nullptr;
#pragma unroll
          for (int dt = 0; dt < kDimTiles; ++dt) {
            const uint32_t pair =
                PackBf16x2(o[mt][dt][2 * half] * inv_sum, o[mt][dt][2 * half + 1] * inv_sum);
            if (dst != nullptr) dst[dt * 4 + t] = pair;
            const float lo = Bf16ToFloat(pair & 0xFFFFu), hi = Bf16ToFloat(pair >> 16);
            if (dst_fp8 != nullptr) {
              dst_fp8[dt * 4 + t] = static_cast<uint16_t>(QuantizeToE4M3<kFast>(lo, fp8) |
                                                          (QuantizeToE4M3<kFast>(hi, fp8) << 8));
            }
            if (p.out_amax != nullptr) amax = fmaxf(amax, fmaxf(fabsf(lo), fabsf(hi)));
          }
        }
      }
    };
    if (fp8.inv != 0.0f) {
      store(std::true_type{});
    } else {
      store(std::false_type{});
    }
    // The next tile's Q copy overwrites q_tile: every warp must be done reading it (the last
    // key step's barrier already ensures that; no extra barrier needed).
  }
  // Every thread of the block gets here (the tile loop's bounds are uniform).
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

// exp and the division on the multi-function unit (a few ulp of FP32, far below the BF16 or
// E4M3 rounding after): with IEEE expf and division the kernel was bound by its arithmetic,
// not by memory. For g below about -87.3, 1 + exp(-g) exceeds 2^126 (or is infinite) and
// __fdividef gives -0, as the quotient should be.
__device__ __forceinline__ float Silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

__global__ void SwiGluVecKernel(SwiGluParams p) {
  const int64_t vecs_per_row = p.inter / 8;
  const int64_t total = p.rows * vecs_per_row;
  const Fp8Divisor fp8 = MakeFp8Divisor(p.out_fp8 != nullptr ? *p.out_fp8_scale : 1.0f);
  const uint4* in = reinterpret_cast<const uint4*>(p.gate_up);
  float amax = 0.0f;
  for (int64_t v = GlobalThread(); v < total; v += GridThreads()) {
    const int64_t r = v / vecs_per_row;
    const int64_t c = v % vecs_per_row;
    float gate[8], up[8], y[8];
    UnpackBf16x8(in[r * 2 * vecs_per_row + c], gate);
    UnpackBf16x8(in[r * 2 * vecs_per_row + vecs_per_row + c], up);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = Silu(gate[i]) * up[i];
    if (p.out != nullptr) reinterpret_cast<uint4*>(p.out)[v] = PackBf16x8(y);
    if (p.out_fp8 != nullptr) StoreFp8x8(p.out_fp8 + 8 * v, y, fp8);
    if (p.out_amax != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, AbsBf16(y[i]));
    }
  }
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
}

__global__ void SwiGluScalarKernel(SwiGluParams p) {
  const int64_t total = p.rows * p.inter;
  const Fp8Divisor fp8 = MakeFp8Divisor(p.out_fp8 != nullptr ? *p.out_fp8_scale : 1.0f);
  float amax = 0.0f;
  const uint16_t* in = reinterpret_cast<const uint16_t*>(p.gate_up);
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t r = i / p.inter;
    const int64_t c = i % p.inter;
    const float gate = Bf16ToFloat(in[r * 2 * p.inter + c]);
    const float up = Bf16ToFloat(in[r * 2 * p.inter + p.inter + c]);
    const float y = Silu(gate) * up;
    if (p.out != nullptr) reinterpret_cast<uint16_t*>(p.out)[i] = FloatToBf16(y);
    if (p.out_fp8 != nullptr) p.out_fp8[i] = QuantizeToE4M3(y, fp8);
    if (p.out_amax != nullptr) amax = fmaxf(amax, AbsBf16(y));
  }
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
}

// ---------------------------------------------------------------------------------------------
// Embedding lookup

// *flag = min(*flag, value) where 0 means "unset".
__device__ void RecordFirstBadPosition(int32_t* flag, int32_t value) {
  int old = atomicCAS(flag, 0, value);
  while (old != 0 && old > value) {
    const int prev = atomicCAS(flag, old, value);
    if (prev == old) break;
    old = prev;
  }
}

template <int kVec>
__global__ void EmbeddingKernel(EmbeddingParams p) {
  using Chunk = typename std::conditional<kVec == 8, uint4, uint16_t>::type;
  const int64_t chunks_per_row = p.dim / kVec;
  const int64_t total = p.n * chunks_per_row;
  const Chunk* table = reinterpret_cast<const Chunk*>(p.table);
  Chunk* out = reinterpret_cast<Chunk*>(p.out);
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t row = i / chunks_per_row;
    const int64_t c = i % chunks_per_row;
    const int32_t id = p.ids[row];
    if (id >= 0 && id < p.vocab) {
      out[i] = table[static_cast<int64_t>(id) * chunks_per_row + c];
    } else {
      out[i] = Chunk{};
      if (c == 0) RecordFirstBadPosition(p.error_flag, static_cast<int32_t>(row + 1));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Gather of each sequence's last token

__global__ void GatherLastTokensKernel(GatherLastTokensParams p) {
  const int64_t total = p.num_seqs * p.dim;
  const uint16_t* in = reinterpret_cast<const uint16_t*>(p.input);
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t s = i / p.dim;
    const int64_t j = i % p.dim;
    const int64_t begin = p.cu_seqlens[s];
    const int64_t row = static_cast<int64_t>(p.cu_seqlens[s + 1]) - 1;
    const bool valid = row >= begin && row >= 0 && row < p.tokens;
    p.out[i] = valid ? Bf16ToFloat(in[row * p.input_row_stride + j]) : 0.0f;
  }
}

// The kernel's tiles take more than the 48 KiB of shared memory a launch gets by default
// (head_dim 128: 104,448 bytes). The opt-in holds per device (context), and ranks may be
// threads of one process on several devices: set before every launch (a host-side call,
// allowed while a stream is captured; a graph replay does not repeat it).
template <int kHeadDim>
Status LaunchAttention(dim3 grid, const AttentionParams& p, float scale_log2, cudaStream_t stream) {
  constexpr size_t kSmem = AttentionSmemBytes<kHeadDim>();
  TP_CUDA_CHECK(cudaFuncSetAttribute(CausalAttentionKernel<kHeadDim>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kSmem)));
  CausalAttentionKernel<kHeadDim><<<grid, kAttnThreads, kSmem, stream>>>(p, scale_log2);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Argument checks shared by the launchers

Status CheckScale(const char* params, const char* field, const float* scale) {
  if (!IsAligned(scale, alignof(float))) return MisalignedField(params, field, alignof(float));
  return Status::Ok();
}

// An optional out_amax: checked (it is the BF16 output's amax, so `out`
// must be set) and zeroed on `stream` before the kernel adds to it.
Status ZeroAmax(const char* params, float* amax, const void* out, cudaStream_t stream) {
  if (amax == nullptr) return Status::Ok();
  if (out == nullptr) return NullField(params, "out", "when out_amax is set");
  if (!IsAligned(amax, alignof(float))) {
    return MisalignedField(params, "out_amax", alignof(float));
  }
  TP_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  return Status::Ok();
}

}  // namespace

Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  constexpr const char* kP = "RmsNormParams";
  if (p.rows < 0) return BadField(kP, "rows", p.rows, "must be >= 0");
  if (p.rows > kMaxGridX) return BadField(kP, "rows", p.rows, "exceeds 2^31 - 1");
  if (p.dim < 8 || p.dim > kRmsMaxDim || p.dim % 8 != 0) {
    return BadField(kP, "dim", p.dim, "must be a multiple of 8 in [8, 16384]");
  }
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) {
    return InvalidArgumentError(std::string(kP) + ".eps (" + std::to_string(p.eps) +
                                ") must be finite and >= 0");
  }
  if (p.out == nullptr && p.out_fp8 == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": out and out_fp8 are both null");
  }
  if (p.out_fp8 != nullptr && p.out_fp8_scale == nullptr) {
    return NullField(kP, "out_fp8_scale", "when out_fp8 is set");
  }
  if ((p.residual == nullptr) != (p.residual_out == nullptr)) {
    return InvalidArgumentError(std::string(kP) +
                                ": residual and residual_out must be both set or both null");
  }
  if (p.residual2 != nullptr && p.residual == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": residual2 needs residual");
  }
  TP_RETURN_IF_ERROR(ZeroAmax(kP, p.out_amax, p.out, stream));  // 0 rows: amax 0
  if (p.rows == 0) return Status::Ok();
  if (p.input == nullptr) return NullField(kP, "input");
  if (p.weight == nullptr) return NullField(kP, "weight");
  const struct {
    const char* name;
    const void* ptr;
  } vectors[] = {{"input", p.input},         {"residual", p.residual},
                 {"residual2", p.residual2}, {"residual_out", p.residual_out},
                 {"weight", p.weight},       {"out", p.out}};
  for (const auto& v : vectors) {
    if (!IsAligned(v.ptr, 16)) return MisalignedField(kP, v.name, 16);
  }
  if (p.out_fp8 != nullptr) TP_RETURN_IF_ERROR(CheckScale(kP, "out_fp8_scale", p.out_fp8_scale));

  const int64_t vecs = p.dim / 8;
  const int64_t per_thread = (vecs + kRmsVecsPerThread - 1) / kRmsVecsPerThread;
  const int threads = static_cast<int>((per_thread + 31) / 32 * 32);
  RmsNormKernel<<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchRope(const RopeParams& p, cudaStream_t stream) {
  constexpr const char* kP = "RopeParams";
  if (p.rows < 0) return BadField(kP, "rows", p.rows, "must be >= 0");
  if (p.rows > kMaxGridX) return BadField(kP, "rows", p.rows, "exceeds 2^31 - 1");
  if (p.head_dim < 2 || p.head_dim > kRopeMaxHeadDim || p.head_dim % 2 != 0) {
    return BadField(kP, "head_dim", p.head_dim, "must be even, in [2, 512]");
  }
  if (p.inv_freq == nullptr && (!(p.theta > 0.0) || !std::isfinite(p.theta))) {
    return InvalidArgumentError(std::string(kP) + ".theta (" + std::to_string(p.theta) +
                                ") must be a positive finite number");
  }
  if (p.q_heads < 1) return BadField(kP, "q_heads", p.q_heads, "must be >= 1");
  if (p.q_row_stride < p.q_heads * p.head_dim) {
    return BadField(kP, "q_row_stride", p.q_row_stride, "must be >= q_heads * head_dim");
  }
  if (p.k != nullptr) {
    if (p.kv_heads < 1) return BadField(kP, "kv_heads", p.kv_heads, "must be >= 1 when k is set");
    if (p.k_row_stride < p.kv_heads * p.head_dim) {
      return BadField(kP, "k_row_stride", p.k_row_stride, "must be >= kv_heads * head_dim");
    }
  }
  if (p.rows == 0) return Status::Ok();
  if (p.q == nullptr) return NullField(kP, "q");
  if (p.positions == nullptr) return NullField(kP, "positions");
  if (!IsAligned(p.q, 2)) return MisalignedField(kP, "q", 2);
  if (!IsAligned(p.k, 2)) return MisalignedField(kP, "k", 2);
  if (!IsAligned(p.positions, 4)) return MisalignedField(kP, "positions", 4);
  if (!IsAligned(p.inv_freq, 8)) return MisalignedField(kP, "inv_freq", 8);

  const bool vec = (p.head_dim / 2) % 8 == 0 && IsAligned(p.q, 16) && p.q_row_stride % 8 == 0 &&
                   (p.k == nullptr || (IsAligned(p.k, 16) && p.k_row_stride % 8 == 0));
  const unsigned grid = static_cast<unsigned>(p.rows);
  if (vec) {
    RopeKernel<8><<<grid, kRopeThreads, 0, stream>>>(p);
  } else {
    RopeKernel<1><<<grid, kRopeThreads, 0, stream>>>(p);
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchCausalAttention(const AttentionParams& p, cudaStream_t stream) {
  constexpr const char* kP = "AttentionParams";
  if (p.head_dim != 64 && p.head_dim != 128) {
    return UnimplementedError(std::string(kP) + ".head_dim = " + Str(p.head_dim) +
                              " is unsupported; supported: 64, 128");
  }
  if (p.kv_heads < 1) return BadField(kP, "kv_heads", p.kv_heads, "must be >= 1");
  if (p.q_heads < 1 || p.q_heads % p.kv_heads != 0) {
    return BadField(kP, "q_heads", p.q_heads,
                    "must be a positive multiple of kv_heads (" + Str(p.kv_heads) + ")");
  }
  if (p.num_seqs < 0) return BadField(kP, "num_seqs", p.num_seqs, "must be >= 0");
  // cu_seqlens are int32, and the kernel's row arithmetic (32-bit) runs up to a tile past
  // the last token.
  if (p.tokens < 0 || p.tokens > std::numeric_limits<int32_t>::max() - kAttnBr) {
    return BadField(kP, "tokens", p.tokens, "must be in [0, 2^31 - 1 - " + Str(kAttnBr) + "]");
  }
  if (p.out == nullptr && p.out_fp8 == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": out and out_fp8 are both null");
  }
  if (p.out_fp8 != nullptr && p.out_fp8_scale == nullptr) {
    return NullField(kP, "out_fp8_scale", "when out_fp8 is set");
  }
  const struct {
    const char* name;
    int64_t stride;
    int64_t min;
    bool used;
  } strides[] = {
      {"q_row_stride", p.q_row_stride, p.q_heads * p.head_dim, true},
      {"k_row_stride", p.k_row_stride, p.kv_heads * p.head_dim, true},
      {"v_row_stride", p.v_row_stride, p.kv_heads * p.head_dim, true},
      {"out_row_stride", p.out_row_stride, p.q_heads * p.head_dim, p.out != nullptr},
      {"out_fp8_row_stride", p.out_fp8_row_stride, p.q_heads * p.head_dim, p.out_fp8 != nullptr}};
  for (const auto& s : strides) {
    if (s.used && (s.stride < s.min || s.stride % 8 != 0)) {
      return BadField(kP, s.name, s.stride,
                      "must be a multiple of 8 and >= heads * head_dim (" + Str(s.min) + ")");
    }
  }
  TP_RETURN_IF_ERROR(ZeroAmax(kP, p.out_amax, p.out, stream));  // nothing to attend: amax 0
  if (p.num_seqs == 0 || p.tokens == 0) return Status::Ok();
  if (p.max_seqlen < 1) return BadField(kP, "max_seqlen", p.max_seqlen, "must be >= 1");
  if (p.num_seqs * p.q_heads > kMaxGridX) {
    return InvalidArgumentError(std::string(kP) + ": num_seqs * q_heads (" +
                                Str(p.num_seqs * p.q_heads) + ") exceeds 2^31 - 1");
  }
  const struct {
    const char* name;
    const void* ptr;
    bool required;
  } tensors[] = {{"q", p.q, true},
                 {"k", p.k, true},
                 {"v", p.v, true},
                 {"out", p.out, false},
                 {"out_fp8", p.out_fp8, false}};
  for (const auto& t : tensors) {
    if (t.ptr == nullptr && t.required) return NullField(kP, t.name);
    if (!IsAligned(t.ptr, 16)) return MisalignedField(kP, t.name, 16);
  }
  if (p.out_fp8 != nullptr) TP_RETURN_IF_ERROR(CheckScale(kP, "out_fp8_scale", p.out_fp8_scale));
  if (p.cu_seqlens == nullptr) return NullField(kP, "cu_seqlens");
  if (!IsAligned(p.cu_seqlens, 4)) return MisalignedField(kP, "cu_seqlens", 4);

  // grid.y: tiles per (sequence, head) in flight at once; a block takes tiles
  // num_tiles - 1 - y, then gridDim.y fewer each time. The longest sequence the bucket
  // allows would need no loop, but the graph is captured once per bucket, and for a batch of
  // many short sequences most of those blocks would find no tile, and each still costs a
  // launch and a read of cu_seqlens. So: the tiles of the average sequence, and at least
  // enough blocks that one long sequence alone occupies every SM.
  const int64_t longest = p.max_seqlen < p.tokens ? p.max_seqlen : p.tokens;
  const int64_t most_tiles = (longest + kAttnBr - 1) / kAttnBr;
  const int64_t average = (p.tokens + p.num_seqs - 1) / p.num_seqs;
  int device = 0, sms = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  TP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t fill = (int64_t{sms} * kAttnBlocksPerSm + p.q_heads - 1) / p.q_heads;
  int64_t tiles = std::max((average + kAttnBr - 1) / kAttnBr, fill);
  tiles = std::min({tiles, most_tiles, kMaxGridY});
  const dim3 grid(static_cast<unsigned>(p.num_seqs * p.q_heads), static_cast<unsigned>(tiles));
  constexpr double kLog2E = 1.4426950408889634;  // exp(x) = exp2(x * log2(e))
  const float scale_log2 = static_cast<float>(kLog2E / std::sqrt(static_cast<double>(p.head_dim)));
  if (p.head_dim == 64) {
    TP_RETURN_IF_ERROR(LaunchAttention<64>(grid, p, scale_log2, stream));
  } else {
    TP_RETURN_IF_ERROR(LaunchAttention<128>(grid, p, scale_log2, stream));
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream) {
  constexpr const char* kP = "SwiGluParams";
  if (p.rows < 0) return BadField(kP, "rows", p.rows, "must be >= 0");
  if (p.inter < 1) return BadField(kP, "inter", p.inter, "must be >= 1");
  if (p.out == nullptr && p.out_fp8 == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": out and out_fp8 are both null");
  }
  if (p.out_fp8 != nullptr && p.out_fp8_scale == nullptr) {
    return NullField(kP, "out_fp8_scale", "when out_fp8 is set");
  }
  TP_RETURN_IF_ERROR(ZeroAmax(kP, p.out_amax, p.out, stream));  // 0 rows: amax 0
  if (p.rows == 0) return Status::Ok();
  if (p.gate_up == nullptr) return NullField(kP, "gate_up");
  if (!IsAligned(p.gate_up, 2)) return MisalignedField(kP, "gate_up", 2);
  if (!IsAligned(p.out, 2)) return MisalignedField(kP, "out", 2);
  if (p.out_fp8 != nullptr) TP_RETURN_IF_ERROR(CheckScale(kP, "out_fp8_scale", p.out_fp8_scale));

  const int64_t total = p.rows * p.inter;
  if (p.inter % 8 == 0 && IsAligned(p.gate_up, 16) && IsAligned(p.out, 16)) {
    SwiGluVecKernel<<<GridFor(total / 8), kThreads, 0, stream>>>(p);
  } else {
    SwiGluScalarKernel<<<GridFor(total), kThreads, 0, stream>>>(p);
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchEmbeddingLookup(const EmbeddingParams& p, cudaStream_t stream) {
  constexpr const char* kP = "EmbeddingParams";
  if (p.vocab < 1 || p.vocab > std::numeric_limits<int32_t>::max()) {
    return BadField(kP, "vocab", p.vocab, "must be in [1, 2^31 - 1]");
  }
  if (p.dim < 1) return BadField(kP, "dim", p.dim, "must be >= 1");
  if (p.n < 0 || p.n > std::numeric_limits<int32_t>::max() - 1) {
    return BadField(kP, "n", p.n, "must be in [0, 2^31 - 2]");
  }
  if (p.error_flag == nullptr) return NullField(kP, "error_flag");
  if (!IsAligned(p.error_flag, 4)) return MisalignedField(kP, "error_flag", 4);
  if (p.n > 0) {
    if (p.table == nullptr) return NullField(kP, "table");
    if (p.ids == nullptr) return NullField(kP, "ids");
    if (p.out == nullptr) return NullField(kP, "out");
    if (!IsAligned(p.table, 2)) return MisalignedField(kP, "table", 2);
    if (!IsAligned(p.out, 2)) return MisalignedField(kP, "out", 2);
    if (!IsAligned(p.ids, 4)) return MisalignedField(kP, "ids", 4);
  }
  TP_CUDA_CHECK(cudaMemsetAsync(p.error_flag, 0, sizeof(int32_t), stream));
  if (p.n == 0) return Status::Ok();
  if (p.dim % 8 == 0 && IsAligned(p.table, 16) && IsAligned(p.out, 16)) {
    EmbeddingKernel<8><<<GridFor(p.n * p.dim / 8), kThreads, 0, stream>>>(p);
  } else {
    EmbeddingKernel<1><<<GridFor(p.n * p.dim), kThreads, 0, stream>>>(p);
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchGatherLastTokens(const GatherLastTokensParams& p, cudaStream_t stream) {
  constexpr const char* kP = "GatherLastTokensParams";
  if (p.num_seqs < 0) return BadField(kP, "num_seqs", p.num_seqs, "must be >= 0");
  if (p.tokens < 0) return BadField(kP, "tokens", p.tokens, "must be >= 0");
  if (p.dim < 1) return BadField(kP, "dim", p.dim, "must be >= 1");
  if (p.input_row_stride < p.dim) {
    return BadField(kP, "input_row_stride", p.input_row_stride, "must be >= dim");
  }
  if (p.num_seqs == 0) return Status::Ok();
  if (p.cu_seqlens == nullptr) return NullField(kP, "cu_seqlens");
  if (p.out == nullptr) return NullField(kP, "out");
  if (p.tokens > 0 && p.input == nullptr) return NullField(kP, "input");
  if (!IsAligned(p.input, 2)) return MisalignedField(kP, "input", 2);
  if (!IsAligned(p.cu_seqlens, 4)) return MisalignedField(kP, "cu_seqlens", 4);
  if (!IsAligned(p.out, 4)) return MisalignedField(kP, "out", 4);
  GatherLastTokensKernel<<<GridFor(p.num_seqs * p.dim), kThreads, 0, stream>>>(p);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
