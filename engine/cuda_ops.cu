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
#include "engine/device_math.cuh"
#include "engine/launch_checks.h"
#include "engine/paged_kv_ops.h"
#include "engine/paged_kv_store.cuh"
#include "engine/rope.cuh"
#include "layers/fp8_divide.cuh"
#include "layers/kernel_grid.h"
#include "layers/pdl.cuh"
#include "layers/silu.cuh"

namespace tpserve {
namespace {

using namespace launch_checks;
using namespace device;

// ---------------------------------------------------------------------------------------------
// RMSNorm: one block per row, each thread holding RmsNormParams::vecs_per_thread vectors of 8
// in registers as BF16 between the sum of squares and the output. A row's loads (its weight
// and output scale too) are all issued before the first is used: the pass is bound by the
// latency of each row's load, reduction and store chain, not by bandwidth, unless many rows
// are in flight on each SM (benchmarks/bench_elementwise.cc against the copy's floor).

// Stores a row's values, already rounded to BF16 (8 a vector, packed), as E4M3 codes with
// scales of their own (see RmsNormParams::out_fp8_scales): thread t holds vectors
// v = t + k * blockDim.x (k < kVecs) in y; vectors from `vecs` on are not read. Per row, the
// block's amax; per 1x128 group, 16 consecutive vectors, which 16 consecutive lanes of one warp
// hold (blockDim.x a multiple of 32, vecs of 16). Every thread of the block calls it.
template <int kVecs>
__device__ __forceinline__ void StoreFp8OwnScales(const uint4 (&y)[kVecs], int vecs, uint8_t* out,
                                                  float* scales, int64_t row, int64_t rows,
                                                  bool per_group) {
  if (!per_group) {
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (threadIdx.x + k * blockDim.x >= vecs) continue;
      float f[8];
      UnpackBf16x8(y[k], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(f[i]));
    }
    const float scale = ScaleFromAmaxE4M3(BlockMax(m));
    if (threadIdx.x == 0) scales[row] = scale;
    const Fp8Divisor d = MakeFp8Divisor(scale);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v >= vecs) continue;
      float f[8];
      UnpackBf16x8(y[k], f);
      StoreFp8x8(out + 8 * v, f, d);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    float f[8];
    float m = 0.0f;
    if (v < vecs) {
      UnpackBf16x8(y[k], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(f[i]));
    }
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    if (v >= vecs) continue;
    const float scale = ScaleFromAmaxE4M3(m);
    if (v % 16 == 0) scales[(v / 16) * rows + row] = scale;
    StoreFp8x8(out + 8 * v, f, MakeFp8Divisor(scale));
  }
}

constexpr int kRmsMaxThreads = 1024;
// A block's most threads with kVecs vectors each: a 16384-wide row (2048 vectors) at most.
constexpr int RmsThreadsFor(int vecs) { return vecs >= 2 ? 2048 / vecs : kRmsMaxThreads; }

__device__ __forceinline__ uint4 AddBf16x8(const uint4& a, const uint4& b) {
  float x[8], y[8];
  UnpackBf16x8(a, x);
  UnpackBf16x8(b, y);
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] += y[i];
  return PackBf16x8(x);
}

// kVecs: vectors of 8 per thread (RmsNormParams::vecs_per_thread).
template <int kVecs>
__global__ void __launch_bounds__(RmsThreadsFor(kVecs)) RmsNormKernel(RmsNormParams p) {
  PdlEnter();
  const int64_t row = blockIdx.x;
  const int vecs = static_cast<int>(p.dim / 8);
  const int64_t offset = row * p.dim;
  const uint4* in = reinterpret_cast<const uint4*>(p.input + offset);
  const uint4* weight = reinterpret_cast<const uint4*>(p.weight);
  const bool own_scales = p.out_fp8_scales != nullptr;

  // Everything the row needs is loaded up front, the weight and the output scale too, so that
  // no load waits on the reduction. h = the row as BF16: x, or bf16(x + residual) (the
  // residual stream is BF16, and the norm sees what is stored), with residual =
  // bf16(residual + residual2) when split in two.
  uint4 h[kVecs], w[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < vecs) {
      h[k] = in[v];
      w[k] = __ldg(weight + v);
    }
  }
  const float out_scale = p.out_fp8 != nullptr && !own_scales ? *p.out_fp8_scale : 1.0f;
  if (p.residual != nullptr) {
    const uint4* res = reinterpret_cast<const uint4*>(p.residual + offset);
    const uint4* res2 = reinterpret_cast<const uint4*>(p.residual2 + offset);
    uint4* res_out = reinterpret_cast<uint4*>(p.residual_out + offset);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v >= vecs) continue;
      uint4 r = res[v];
      if (p.residual2 != nullptr) r = AddBf16x8(r, res2[v]);
      h[k] = AddBf16x8(h[k], r);
      res_out[v] = h[k];
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (threadIdx.x + k * blockDim.x >= vecs) continue;
    float f[8];
    UnpackBf16x8(h[k], f);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum_sq += f[i] * f[i];
  }
  sum_sq = BlockSum(sum_sq);
  const float inv_rms = rsqrtf(sum_sq / static_cast<float>(p.dim) + p.eps);
  const Fp8Divisor fp8 = MakeFp8Divisor(out_scale);
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v >= vecs) continue;
    float wf[8], y[8];
    UnpackBf16x8(w[k], wf);
    UnpackBf16x8(h[k], y);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = y[i] * inv_rms * wf[i];
    if (p.out != nullptr) reinterpret_cast<uint4*>(p.out + offset)[v] = PackBf16x8(y);
    if (own_scales) {  // kept, as BF16 stores them, for StoreFp8OwnScales below
      h[k] = PackBf16x8(y);
    } else if (p.out_fp8 != nullptr) {
      StoreFp8x8(p.out_fp8 + offset + 8 * v, y, fp8);
    }
    if (p.out_amax != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, AbsBf16(y[i]));
    }
  }
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
  if (own_scales) {
    StoreFp8OwnScales(h, vecs, p.out_fp8 + offset, p.out_fp8_scales, row, p.rows,
                      p.out_fp8_granularity == Fp8ScaleGranularity::kPerGroup128);
  }
}

template <int kVecs>
Status LaunchRmsNormKernel(const RmsNormParams& p, int threads, cudaStream_t stream) {
  TP_CUDA_CHECK(LaunchPdl(RmsNormKernel<kVecs>, dim3(static_cast<unsigned>(p.rows)), dim3(threads),
                          0, stream, p));
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// RoPE: one block per row. The block first tabulates cos/sin of the row's head_dim/2 angles
// (in double, like the reference; the inverse frequencies from p.inv_freq, or plain RoPE's
// from theta), then every head of q and k uses the table.

constexpr int kRopeThreads = 128;
constexpr int64_t kRopeMaxHeadDim = 512;

// kStore: 0 rotates q and k only; 1 / 2 also stores K and V in a BF16 / E4M3 paged cache
// (kVec 8 only): items past q's and k's are the V heads' halves, copied as they are.
template <int kVec, int kStore>
__global__ void __launch_bounds__(kRopeThreads) RopeKernel(RopeParams p, KvStoreArgs st) {
  static_assert(kStore == 0 || kVec == 8, "the cache store takes whole vectors");
  __shared__ float2 cos_sin[kRopeMaxHeadDim / 2];
  PdlEnter();
  const int64_t row = blockIdx.x;
  const int head_dim = static_cast<int>(p.head_dim);
  const int half = head_dim / 2;
  const int32_t position = p.positions[row];
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    cos_sin[i] = RopeCosSin(position, i, head_dim, p.inv_freq, p.theta);
  }
  __syncthreads();

  const int groups = half / kVec;  // per head
  const int64_t q_items = p.q_heads * groups;
  const int64_t k_end = q_items + (p.k != nullptr ? p.kv_heads * groups : 0);
  const int64_t items = k_end + (kStore != 0 ? p.kv_heads * groups : 0);
  // The row's place in the cache (none for a padding row or a corrupt slot).
  int64_t slot_base = -1;
  if constexpr (kStore != 0) slot_base = KvRowBase(st, row);
  auto cache_at = [&](int64_t head, int i) { return KvElement(st, slot_base, head, i); };
  for (int64_t item = threadIdx.x; item < items; item += blockDim.x) {
    if constexpr (kStore != 0) {
      if (item >= k_end) {  // a V head's two halves: stored as they are
        const int64_t local = item - k_end;
        const int64_t head = local / groups;
        const int i0 = static_cast<int>(local % groups) * kVec;
        if (slot_base < 0) continue;
        const uint16_t* v =
            reinterpret_cast<const uint16_t*>(st.v + row * st.v_row_stride + head * head_dim);
        StoreKv8<kStore == 2>(st.cache, st.v_offset + cache_at(head, i0),
                              *reinterpret_cast<const uint4*>(v + i0), st.v_scale);
        StoreKv8<kStore == 2>(st.cache, st.v_offset + cache_at(head, i0 + half),
                              *reinterpret_cast<const uint4*>(v + i0 + half), st.v_scale);
        continue;
      }
    }
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
    for (int j = 0; j < kVec; ++j) RotatePair(a[j], b[j], cos_sin[i0 + j], &ra[j], &rb[j]);
    if constexpr (kVec == 8) {
      const uint4 lo = PackBf16x8(ra), hi = PackBf16x8(rb);
      *reinterpret_cast<uint4*>(x + i0) = lo;
      *reinterpret_cast<uint4*>(x + i0 + half) = hi;
      if constexpr (kStore != 0) {
        if (!is_q && slot_base >= 0) {
          StoreKv8<kStore == 2>(st.cache, st.k_offset + cache_at(head, i0), lo, st.k_scale);
          StoreKv8<kStore == 2>(st.cache, st.k_offset + cache_at(head, i0 + half), hi, st.k_scale);
        }
      }
    } else {
      x[i0] = static_cast<uint16_t>(FloatToBf16(ra[0]));
      x[i0 + half] = static_cast<uint16_t>(FloatToBf16(rb[0]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

// Silu: layers/silu.cuh (shared with the small-M GEMM's SwiGLU epilogue).

// Rows over blockIdx.y (grid-stride), each row's vectors over blockIdx.x and the block's
// threads: no 64-bit division per vector, which cost the kernel more than its arithmetic.
__global__ void SwiGluVecKernel(SwiGluParams p) {
  PdlEnter();
  const int64_t vecs_per_row = p.inter / 8;
  const Fp8Divisor fp8 = MakeFp8Divisor(p.out_fp8 != nullptr ? *p.out_fp8_scale : 1.0f);
  float amax = 0.0f;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c < vecs_per_row) {
    for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
      const uint4* gate = reinterpret_cast<const uint4*>(p.gate_up) + r * 2 * vecs_per_row;
      const int64_t v = r * vecs_per_row + c;
      float g[8], u[8], y[8];
      UnpackBf16x8(gate[c], g);
      UnpackBf16x8(gate[vecs_per_row + c], u);
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = Silu(g[i]) * u[i];
      if (p.out != nullptr) reinterpret_cast<uint4*>(p.out)[v] = PackBf16x8(y);
      if (p.out_fp8 != nullptr) StoreFp8x8(p.out_fp8 + 8 * v, y, fp8);
      if (p.out_amax != nullptr) {
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, AbsBf16(y[i]));
      }
    }
  }
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
}

// SwiGLU with an E4M3 output on scales of its own (SwiGluParams::out_fp8_scales): one block per
// row, each thread holding up to kSwiGluRowVecs vectors of 8 in registers until the row's (or
// group's) amax is known.
constexpr int kSwiGluRowVecs = 4;
constexpr int64_t kSwiGluOwnScalesMaxInter = 8 * kSwiGluRowVecs * 1024;

__global__ void __launch_bounds__(1024) SwiGluOwnScalesKernel(SwiGluParams p) {
  PdlEnter();
  const int64_t row = blockIdx.x;
  const int vecs = static_cast<int>(p.inter / 8);
  const uint4* gate = reinterpret_cast<const uint4*>(p.gate_up + row * 2 * p.inter);
  const uint4* up = gate + vecs;
  uint4 y[kSwiGluRowVecs];  // BF16-rounded, as the BF16 output stores them
#pragma unroll
  for (int k = 0; k < kSwiGluRowVecs; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v >= vecs) continue;
    float g[8], u[8];
    UnpackBf16x8(gate[v], g);
    UnpackBf16x8(up[v], u);
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = Silu(g[i]) * u[i];
    y[k] = PackBf16x8(g);
    if (p.out != nullptr) reinterpret_cast<uint4*>(p.out + row * p.inter)[v] = y[k];
  }
  StoreFp8OwnScales(y, vecs, p.out_fp8 + row * p.inter, p.out_fp8_scales, row, p.rows,
                    p.out_fp8_granularity == Fp8ScaleGranularity::kPerGroup128);
}

__global__ void SwiGluScalarKernel(SwiGluParams p) {
  PdlEnter();
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

}  // namespace

// The output choices of an op with an FP8 output (RmsNormParams, SwiGluParams): a static
// scale, or scales of its own (`cols`, named `cols_name`, the row length).
static Status CheckOwnScales(const char* kP, const uint8_t* out_fp8, const float* out_fp8_scale,
                             const float* out_fp8_scales, Fp8ScaleGranularity granularity,
                             const float* out_amax, int64_t cols, const char* cols_name) {
  if (out_fp8_scales == nullptr) {
    if (out_fp8 != nullptr && out_fp8_scale == nullptr) {
      return NullField(kP, "out_fp8_scale", "when out_fp8 is set (or out_fp8_scales)");
    }
    return Status::Ok();
  }
  const std::string p(kP);
  if (out_fp8 == nullptr) return InvalidArgumentError(p + ": out_fp8_scales needs out_fp8");
  if (out_fp8_scale != nullptr || out_amax != nullptr) {
    return InvalidArgumentError(p + ": out_fp8_scales goes with neither out_fp8_scale nor " +
                                "out_amax");
  }
  if (!IsAligned(out_fp8_scales, 4)) return MisalignedField(kP, "out_fp8_scales", 4);
  if (granularity != Fp8ScaleGranularity::kPerRow &&
      granularity != Fp8ScaleGranularity::kPerGroup128) {
    return InvalidArgumentError(p + ".out_fp8_granularity is not kPerRow or kPerGroup128");
  }
  if (granularity == Fp8ScaleGranularity::kPerGroup128 && cols % 128 != 0) {
    return BadField(kP, cols_name, cols, "must be a multiple of 128 with kPerGroup128 scales");
  }
  return Status::Ok();
}

Status LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  constexpr const char* kP = "RmsNormParams";
  if (p.rows < 0) return BadField(kP, "rows", p.rows, "must be >= 0");
  if (p.rows > kMaxGridX) return BadField(kP, "rows", p.rows, "exceeds 2^31 - 1");
  if (p.dim < 8 || p.dim > 16384 || p.dim % 8 != 0) {
    return BadField(kP, "dim", p.dim, "must be a multiple of 8 in [8, 16384]");
  }
  if (p.vecs_per_thread != 1 && p.vecs_per_thread != 2 && p.vecs_per_thread != 4 &&
      p.vecs_per_thread != 8) {
    return BadField(kP, "vecs_per_thread", p.vecs_per_thread, "must be 1, 2, 4 or 8");
  }
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) {
    return InvalidArgumentError(std::string(kP) + ".eps (" + std::to_string(p.eps) +
                                ") must be finite and >= 0");
  }
  if (p.out == nullptr && p.out_fp8 == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": out and out_fp8 are both null");
  }
  TP_RETURN_IF_ERROR(CheckOwnScales(kP, p.out_fp8, p.out_fp8_scale, p.out_fp8_scales,
                                    p.out_fp8_granularity, p.out_amax, p.dim, "dim"));
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
  if (p.out_fp8 != nullptr && p.out_fp8_scales == nullptr) {
    TP_RETURN_IF_ERROR(CheckScale(kP, "out_fp8_scale", p.out_fp8_scale));
  }

  const int64_t vecs = p.dim / 8;
  // The fewest vectors per thread from vecs_per_thread up that keep a block within 1024
  // threads (16384 wide rows: 2 a thread).
  int per_thread = p.vecs_per_thread;
  while (per_thread < 8 && (vecs + per_thread - 1) / per_thread > kRmsMaxThreads) per_thread *= 2;
  const int threads = static_cast<int>(((vecs + per_thread - 1) / per_thread + 31) / 32 * 32);
  switch (per_thread) {
    case 1:
      return LaunchRmsNormKernel<1>(p, threads, stream);
    case 2:
      return LaunchRmsNormKernel<2>(p, threads, stream);
    case 4:
      return LaunchRmsNormKernel<4>(p, threads, stream);
    default:
      return LaunchRmsNormKernel<8>(p, threads, stream);
  }
}

Status CheckRope(const RopeParams& p) {
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

  const PagedKvWriteParams* kv = p.kv_store;
  if (kv != nullptr) {
    if (p.k == nullptr) return InvalidArgumentError(std::string(kP) + ": kv_store needs k");
    TP_RETURN_IF_ERROR(CheckPagedKvWrite(*kv).WithContext(std::string(kP) + ".kv_store"));
    const struct {
      const char* name;
      bool same;
    } agree[] = {{"k", kv->k == p.k},
                 {"k_row_stride", kv->k_row_stride == p.k_row_stride},
                 {"rows", kv->rows == p.rows},
                 {"layout.kv_heads", kv->layout.kv_heads == p.kv_heads},
                 {"layout.head_dim", kv->layout.head_dim == p.head_dim}};
    for (const auto& a : agree) {
      if (!a.same) {
        return InvalidArgumentError(std::string(kP) + ".kv_store->" + a.name +
                                    " differs from the RoPE launch's");
      }
    }
  }
  return Status::Ok();
}

Status LaunchRope(const RopeParams& p, cudaStream_t stream) {
  TP_RETURN_IF_ERROR(CheckRope(p));
  if (p.rows == 0) return Status::Ok();
  const PagedKvWriteParams* kv = p.kv_store;
  const bool vec = (p.head_dim / 2) % 8 == 0 && IsAligned(p.q, 16) && p.q_row_stride % 8 == 0 &&
                   (p.k == nullptr || (IsAligned(p.k, 16) && p.k_row_stride % 8 == 0));
  const unsigned grid = static_cast<unsigned>(p.rows);
  KvStoreArgs st;
  if (vec && kv != nullptr) {
    st = MakeKvStoreArgs(*kv);
    auto* kernel =
        kv->layout.dtype == KvCacheDtype::kFloat8E4M3 ? RopeKernel<8, 2> : RopeKernel<8, 1>;
    TP_CUDA_CHECK(LaunchPdl(kernel, dim3(grid), dim3(kRopeThreads), 0, stream, p, st));
  } else if (vec) {
    TP_CUDA_CHECK(LaunchPdl(RopeKernel<8, 0>, dim3(grid), dim3(kRopeThreads), 0, stream, p, st));
  } else {
    TP_CUDA_CHECK(LaunchPdl(RopeKernel<1, 0>, dim3(grid), dim3(kRopeThreads), 0, stream, p, st));
  }
  // Shapes the fused kernel does not take: the paged write after the rotation, as two kernels.
  if (kv != nullptr && !vec) return LaunchPagedKvWrite(*kv, stream);
  return Status::Ok();
}

Status LaunchSwiGlu(const SwiGluParams& p, cudaStream_t stream) {
  constexpr const char* kP = "SwiGluParams";
  if (p.rows < 0) return BadField(kP, "rows", p.rows, "must be >= 0");
  if (p.inter < 1) return BadField(kP, "inter", p.inter, "must be >= 1");
  if (p.out == nullptr && p.out_fp8 == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": out and out_fp8 are both null");
  }
  TP_RETURN_IF_ERROR(CheckOwnScales(kP, p.out_fp8, p.out_fp8_scale, p.out_fp8_scales,
                                    p.out_fp8_granularity, p.out_amax, p.inter, "inter"));
  TP_RETURN_IF_ERROR(ZeroAmax(kP, p.out_amax, p.out, stream));  // 0 rows: amax 0
  if (p.rows == 0) return Status::Ok();
  if (p.gate_up == nullptr) return NullField(kP, "gate_up");
  if (!IsAligned(p.gate_up, 2)) return MisalignedField(kP, "gate_up", 2);
  if (!IsAligned(p.out, 2)) return MisalignedField(kP, "out", 2);
  if (p.out_fp8_scales != nullptr) {
    if (p.rows > kMaxGridX) return BadField(kP, "rows", p.rows, "exceeds 2^31 - 1");
    if (p.inter % 8 != 0 || p.inter > kSwiGluOwnScalesMaxInter) {
      return BadField(kP, "inter", p.inter,
                      "must be a multiple of 8 up to 32768 with out_fp8_scales");
    }
    if (!IsAligned(p.gate_up, 16)) return MisalignedField(kP, "gate_up", 16);
    if (!IsAligned(p.out, 16)) return MisalignedField(kP, "out", 16);
    const int64_t per_thread = (p.inter / 8 + kSwiGluRowVecs - 1) / kSwiGluRowVecs;
    const int threads = static_cast<int>((per_thread + 31) / 32 * 32);
    TP_CUDA_CHECK(LaunchPdl(SwiGluOwnScalesKernel, dim3(static_cast<unsigned>(p.rows)),
                            dim3(threads), 0, stream, p));
    return Status::Ok();
  }
  if (p.out_fp8 != nullptr) TP_RETURN_IF_ERROR(CheckScale(kP, "out_fp8_scale", p.out_fp8_scale));

  const int64_t total = p.rows * p.inter;
  if (p.inter % 8 == 0 && IsAligned(p.gate_up, 16) && IsAligned(p.out, 16)) {
    const int64_t across = (p.inter / 8 + kThreads - 1) / kThreads;
    // Enough blocks to fill the GPU several times over; rows beyond loop.
    const int64_t down = std::min<int64_t>(p.rows, std::max<int64_t>(1, 16 * kMaxBlocks / across));
    TP_CUDA_CHECK(LaunchPdl(SwiGluVecKernel,
                            dim3(static_cast<unsigned>(across), static_cast<unsigned>(down)),
                            dim3(kThreads), 0, stream, p));
  } else {
    TP_CUDA_CHECK(
        LaunchPdl(SwiGluScalarKernel, dim3(GridFor(total)), dim3(kThreads), 0, stream, p));
  }
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
