// Kernel and launcher for layers/small_m_gemm.h. Plain CUDA C++17.
#include "layers/small_m_gemm.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "layers/fp8_divide.cuh"
#include "layers/pdl.cuh"
#include "layers/silu.cuh"

namespace tpserve {
namespace {

// 16 warps of a CTA share k (more warps a row tile beat more unrolling or more row tiles a CTA
// on llama3-8b's four shapes), each issuing the loads of kUnroll steps together.
constexpr int kWarps = 16;
constexpr int kUnroll = 2;
constexpr int kRows = 16;    // weight rows (output columns) of a CTA: one m16 tile
constexpr int kBlockK = 64;  // columns of one step: two m16n8k32 MMAs
// The norm prologue (SmallMNorm): each row of codes in shared memory is followed by kNormPad
// bytes, so that consecutive tokens' rows start in opposite halves of the banks and a warp's
// activation loads (8 tokens x 64 bytes) take 4 wavefronts, not 8. Each thread normalises
// kNormRowsAtOnce rows a pass, their loads issued together.
constexpr int kNormPad = 64;
constexpr int kNormRowsAtOnce = 2;

struct SmallMArgs {
  const uint8_t* a;  // [m, lda] activations
  const uint8_t* b;  // [n, ldb] weight
  const __nv_bfloat16* c;
  __nv_bfloat16* d;
  const float* a_scale;
  const float* b_scale;
  int m;
  int64_t n, k, lda, ldb, ldc, ldd;
  float alpha, beta;
  bool b_constant;  // GemmParams::b_constant: B may be read before the PDL wait
  // LaunchSmallMGemmSwiGlu: E4M3 codes of silu(gate) * up, [m, n / 2] with row pitch ldo.
  uint8_t* swiglu_out;
  int64_t ldo;
  const float* swiglu_scale;
  // SmallMNorm, in 16-byte vectors: x [m, norm_ldx], the norm's weight [k / 8]; norm_threads
  // is the RMSNorm kernel's block for a row of k (NormRows).
  const uint4* norm_x;
  const uint4* norm_w;
  int64_t norm_ldx;
  float norm_eps;
  int norm_threads;
};

__device__ __forceinline__ uint4 LoadStream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 LoadShared(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address));
  return v;
}

__device__ __forceinline__ void MmaE4m3(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void UnpackBf16x8(const uint4& raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The norm prologue: the E4M3 codes of the m normalised rows of x into `codes` (pitch k +
// kNormPad). For the same bits as engine/cuda_ops.cu's RmsNormKernel<2>, each row is reduced
// as that kernel reduces it: its block of T = p.norm_threads threads is a group of T / 32 warps
// here (the CTA's 16 warps make 512 / T groups, each taking a row a pass), thread tn of a
// group holding vectors tn and tn + T of the row, the sum of squares over a thread's values in
// order, then over each warp (xor butterfly), then over the group's warp sums the same way.
// Every thread of the CTA calls it; it ends with a barrier.
__device__ __forceinline__ void NormRows(const SmallMArgs& p, uint8_t* codes,
                                         float (&sums)[kNormRowsAtOnce][kWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int threads = p.norm_threads, warps = threads / 32;
  const int tn = threadIdx.x % threads, group = threadIdx.x / threads;
  const int groups = kWarps * 32 / threads;
  const int vecs = static_cast<int>(p.k / 8);
  const int64_t pitch = p.k + kNormPad;
  const Fp8Divisor divisor = MakeFp8Divisor(*p.a_scale);
  for (int base = 0; base < p.m; base += groups * kNormRowsAtOnce) {
    auto row_vector = [&](int tok, int v) {
      return tok < p.m && v < vecs ? p.norm_x[tok * p.norm_ldx + v] : make_uint4(0, 0, 0, 0);
    };
    {
      uint4 h[kNormRowsAtOnce][2];
#pragma unroll
      for (int r = 0; r < kNormRowsAtOnce; ++r) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
          h[r][j] = row_vector(base + r * groups + group, tn + j * threads);
      }
#pragma unroll
      for (int r = 0; r < kNormRowsAtOnce; ++r) {
        float sum_sq = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (tn + j * threads >= vecs) continue;
          float f[8];
          UnpackBf16x8(h[r][j], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) sum_sq += f[i] * f[i];
        }
        sum_sq = WarpSum(sum_sq);
        if (lane == 0) sums[r][warp] = sum_sq;
      }
    }
    // The rows are read again below (from L1) rather than held across the barrier, which
    // would spill the early weight loads' registers.
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kNormRowsAtOnce; ++r) {
      const int tok = base + r * groups + group;
      float sum_sq = lane < warps ? sums[r][group * warps + lane] : 0.0f;
      sum_sq = WarpSum(sum_sq);
      const float inv_rms = rsqrtf(sum_sq / static_cast<float>(p.k) + p.norm_eps);
      if (tok >= p.m) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int v = tn + j * threads;
        if (v >= vecs) continue;
        float wf[8], y[8];
        UnpackBf16x8(__ldg(p.norm_w + v), wf);
        UnpackBf16x8(row_vector(tok, v), y);
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = y[i] * inv_rms * wf[i];
        const uint2 c =
            divisor.inv != 0.0f ? Fp8Codes8<true>(y, divisor) : Fp8Codes8<false>(y, divisor);
        *reinterpret_cast<uint2*>(codes + tok * pitch + 8 * v) = c;
      }
    }
    __syncthreads();
  }
}

// Lane (g, t) = (lane / 4, lane % 4) loads bytes 16t .. 16t + 15 of a 64-column block of
// weight rows g and g + 8 and of token g. MMA 1 takes bytes 0-7 of each, MMA 2 bytes 8-15: in
// the m16n8k32 fragments lane t holds k = 4t .. 4t + 3 (registers a0/a1, b0) and
// 16 + 4t .. 16 + 4t + 3 (a2/a3, b1), so both operands see the block's columns in the same
// order and each is multiplied with its own partner.
//
// With a constant B each warp loads its first kUnroll weight blocks before the PDL wait, so a
// GEMM whose CTAs are resident while the kernel ahead of it runs (a norm, attention, SwiGLU:
// short, latency-bound kernels at decode sizes) has them in registers when that kernel ends.
//
// kSwiGlu: B's rows are gate rows [0, n/2) and up rows [n/2, n); CTA c takes gate rows
// 8c .. 8c + 7 as its MMA rows 0-7 and the up rows of the same columns as rows 8-15, so that
// each lane ends with the gate and up sums of one column and two tokens, and stores the E4M3
// code of silu(gate) * up (each first rounded to BF16, as D would hold it).
//
// kNorm: A is the norm prologue's codes in shared memory (NormRows, after the PDL wait, while
// the early weight loads are in flight); at most 64 registers, so that two CTAs share an SM
// as without it.
template <bool kSwiGlu, bool kNorm>
__device__ __forceinline__ void GemmTile(const SmallMArgs& p, int64_t tile, bool first_tile,
                                         float (&partial)[kWarps][32][4], uint4* norm_codes,
                                         float (&norm_sums)[kNormRowsAtOnce][kWarps]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row0 = tile * (kSwiGlu ? kRows / 2 : kRows);
  const int64_t blocks = p.k / kBlockK;
  const int64_t first = blocks * warp / kWarps, last = blocks * (warp + 1) / kWarps;
  const uint8_t* w_lo = p.b + (row0 + g) * p.ldb + 16 * t;
  const uint8_t* w_hi = kSwiGlu ? w_lo + (p.n / 2) * p.ldb : w_lo + 8 * p.ldb;
  const bool token = g < p.m;
  // The token's activations: global (A) or, with kNorm, a shared-memory address.
  const uint8_t* x = kNorm ? nullptr : p.a + (token ? g : 0) * p.lda + 16 * t;
  const uint32_t x_shared =
      kNorm ? static_cast<uint32_t>(__cvta_generic_to_shared(norm_codes)) +
                  static_cast<uint32_t>((token ? g : 0) * (p.k + kNormPad) + 16 * t)
            : 0u;
  auto load_x = [&](int64_t kb) {
    if (!token) return make_uint4(0, 0, 0, 0);
    if constexpr (kNorm) return LoadShared(x_shared + static_cast<uint32_t>(kb) * kBlockK);
    return *reinterpret_cast<const uint4*>(x + kb * kBlockK);
  };
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // kUnroll blocks from kb: the weight's (loaded by the caller) against the activations'.
  auto multiply = [&](const uint4(&lo)[kUnroll], const uint4(&hi)[kUnroll], int64_t kb) {
    uint4 xv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      xv[u] = load_x(kb + u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      MmaE4m3(acc, lo[u].x, hi[u].x, lo[u].y, hi[u].y, xv[u].x, xv[u].y);
      MmaE4m3(acc, lo[u].z, hi[u].z, lo[u].w, hi[u].w, xv[u].z, xv[u].w);
    }
  };
  auto load = [&](uint4(&lo)[kUnroll], uint4(&hi)[kUnroll], int64_t kb) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      lo[u] = LoadStream(w_lo + (kb + u) * kBlockK);
      hi[u] = LoadStream(w_hi + (kb + u) * kBlockK);
    }
  };
  int64_t kb = first;
  if (kNorm && !first_tile) {
    // A later tile of a persistent CTA: the codes are in shared memory already.
  } else if constexpr (kNorm) {
    // Every thread reaches NormRows' barriers: the early loads' branch is per warp.
    const bool early = p.b_constant && first + kUnroll <= last;
    uint4 lo[kUnroll], hi[kUnroll];
    if (early) load(lo, hi, kb);
    PdlEnter();
    NormRows(p, reinterpret_cast<uint8_t*>(norm_codes), norm_sums);
    if (early) {
      multiply(lo, hi, kb);
      kb += kUnroll;
    }
  } else if (p.b_constant && first + kUnroll <= last) {
    uint4 lo[kUnroll], hi[kUnroll];
    load(lo, hi, kb);
    PdlEnter();
    multiply(lo, hi, kb);
    kb += kUnroll;
  } else {
    PdlEnter();
  }
  for (; kb + kUnroll <= last; kb += kUnroll) {
    uint4 lo[kUnroll], hi[kUnroll];
    load(lo, hi, kb);
    multiply(lo, hi, kb);
  }
  for (; kb < last; ++kb) {
    const uint4 lo = LoadStream(w_lo + kb * kBlockK);
    const uint4 hi = LoadStream(w_hi + kb * kBlockK);
    const uint4 xv = load_x(kb);
    MmaE4m3(acc, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
    MmaE4m3(acc, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
  __syncthreads();
  // With kNorm the next tile's warps write the other partial buffer: this one is read by warp
  // 0 until it reaches the next tile's barrier.
  if (warp != 0) return;
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sum[i] += partial[w][lane][i];
  }
  float alpha = p.alpha;
  if (p.a_scale != nullptr) alpha *= *p.a_scale;
  if (p.b_scale != nullptr) alpha *= *p.b_scale;
  if constexpr (kSwiGlu) {
    // sum[0], sum[1]: gate column row0 + g, tokens 2t, 2t + 1; sum[2], sum[3]: its up column.
    const Fp8Divisor divisor = MakeFp8Divisor(*p.swiglu_scale);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tok = 2 * t + i;
      if (tok >= p.m) continue;
      const float gate = __bfloat162float(__float2bfloat16_rn(alpha * sum[i]));
      const float up = __bfloat162float(__float2bfloat16_rn(alpha * sum[i + 2]));
      p.swiglu_out[tok * p.ldo + row0 + g] = QuantizeToE4M3(Silu(gate) * up, divisor);
    }
  } else {
    // The accumulator fragment: acc[0], acc[1] are weight row g, tokens 2t and 2t + 1; acc[2],
    // acc[3] weight row g + 8, the same tokens.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = 2 * t + (i & 1);
      if (tok >= p.m) continue;
      const int64_t col = row0 + g + (i >> 1) * 8;
      float v = alpha * sum[i];
      if (p.c != nullptr) v += p.beta * __bfloat162float(p.c[tok * p.ldc + col]);
      p.d[tok * p.ldd + col] = __float2bfloat16_rn(v);
    }
  }
}

// One CTA per tile of 16 weight rows; with kNorm a persistent grid (at most two CTAs an SM),
// each CTA running the norm prologue once and then its tiles, blockIdx.x and every
// gridDim.x-th after it, with two partial-sum buffers in turn. kNorm: at most 64 registers,
// so that two CTAs share an SM as without it.
template <bool kSwiGlu, bool kNorm>
__global__ void __launch_bounds__(kWarps * 32, kNorm ? 2 : 0) SmallMGemmKernel(SmallMArgs p) {
  __shared__ float partial[kNorm ? 2 : 1][kWarps][32][4];
  extern __shared__ uint4 norm_codes[];  // kNorm: [m][k + kNormPad] bytes
  __shared__ float norm_sums[kNormRowsAtOnce][kWarps];
  if constexpr (!kNorm) {
    GemmTile<kSwiGlu, false>(p, blockIdx.x, true, partial[0], norm_codes, norm_sums);
  } else {
    int buffer = 0;
    for (int64_t tile = blockIdx.x; tile < p.n / kRows; tile += gridDim.x) {
      GemmTile<kSwiGlu, true>(p, tile, tile == blockIdx.x, partial[buffer], norm_codes, norm_sums);
      buffer ^= 1;
    }
  }
}

}  // namespace

bool SmallMGemmFits(const GemmParams& p) {
  return p.a_type == DataType::kFloat8E4M3 && p.b_type == DataType::kFloat8E4M3 &&
         p.d_type == DataType::kBFloat16 && p.scale_scheme == GemmScaleScheme::kPerTensor &&
         p.m >= 1 && p.m <= kSmallMGemmMaxM && p.batch <= 1 && p.k % kBlockK == 0 &&
         p.n % kRows == 0 && p.lda % 16 == 0 && p.ldb % 16 == 0 && p.ldc % 2 == 0 &&
         p.ldd % 2 == 0 && p.d_quant_scale == nullptr && p.d_amax == nullptr;
}

namespace {

SmallMArgs MakeArgs(const GemmParams& p, const void* a, const void* b, const void* c, void* d) {
  SmallMArgs args;
  args.a = static_cast<const uint8_t*>(a);
  args.b = static_cast<const uint8_t*>(b);
  args.c = p.beta != 0.0f ? static_cast<const __nv_bfloat16*>(c) : nullptr;
  args.d = static_cast<__nv_bfloat16*>(d);
  args.a_scale = p.a_scale;
  args.b_scale = p.b_scale;
  args.m = static_cast<int>(p.m);
  args.n = p.n;
  args.k = p.k;
  args.lda = p.lda;
  args.ldb = p.ldb;
  args.ldc = p.ldc;
  args.ldd = p.ldd;
  args.alpha = p.alpha;
  args.beta = p.beta;
  args.b_constant = p.b_constant;
  args.swiglu_out = nullptr;
  args.ldo = 0;
  args.swiglu_scale = nullptr;
  args.norm_x = nullptr;
  args.norm_w = nullptr;
  args.norm_ldx = 0;
  args.norm_eps = 0.0f;
  args.norm_threads = 0;
  return args;
}

// The RMSNorm kernel's block for a row of k (engine/cuda_ops.cu, vecs_per_thread 2): two
// vectors of 8 a thread, whole warps.
int64_t NormThreads(int64_t k) { return ((k / 8 + 1) / 2 + 31) / 32 * 32; }

// Fills args' norm fields from `norm` (null: none), after checking them.
Status SetNorm(const GemmParams& p, const SmallMNorm* norm, SmallMArgs& args) {
  if (norm == nullptr) return Status::Ok();
  if (!SmallMNormFits(p)) {
    return InvalidArgumentError("small-m GEMM with a norm: m = " + std::to_string(p.m) +
                                ", k = " + std::to_string(p.k) + " do not fit the prologue");
  }
  if (norm->x == nullptr || norm->weight == nullptr ||
      reinterpret_cast<uintptr_t>(norm->x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(norm->weight) % 16 != 0) {
    return InvalidArgumentError(
        "small-m GEMM with a norm: x and weight must be non-null, 16-byte aligned");
  }
  if (norm->ldx < p.k || norm->ldx % 8 != 0) {
    return InvalidArgumentError("small-m GEMM with a norm: ldx (" + std::to_string(norm->ldx) +
                                ") must be a multiple of 8 and >= k (" + std::to_string(p.k) + ")");
  }
  if (!(norm->eps >= 0.0f) || norm->eps == std::numeric_limits<float>::infinity()) {
    return InvalidArgumentError("small-m GEMM with a norm: eps must be finite and >= 0");
  }
  if (p.a_scale == nullptr) {
    return InvalidArgumentError("small-m GEMM with a norm: a_scale (the codes' scale) is null");
  }
  args.norm_x = static_cast<const uint4*>(norm->x);
  args.norm_w = static_cast<const uint4*>(norm->weight);
  args.norm_ldx = norm->ldx / 8;
  args.norm_eps = norm->eps;
  args.norm_threads = static_cast<int>(NormThreads(p.k));
  return Status::Ok();
}

// One CTA per 16 rows of B either way (with SwiGLU: 8 gate rows and their 8 up rows).
Status Launch(const SmallMArgs& args, bool swiglu, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.n / kRows));
  const dim3 block(kWarps * 32);
  cudaError_t e;
  if (args.norm_x != nullptr) {
    const size_t smem = static_cast<size_t>(args.m * (args.k + kNormPad));
    auto* kernel = swiglu ? SmallMGemmKernel<true, true> : SmallMGemmKernel<false, true>;
    int device = 0, sms = 0;
    e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    // Static (16.1 KB) and dynamic shared memory together may pass the 48 KB a block gets
    // without asking.
    if (e == cudaSuccess) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kSmallMNormMaxBytes));
    }
    const dim3 persistent(static_cast<unsigned>(std::min<int64_t>(args.n / kRows, 2 * sms)));
    if (e == cudaSuccess) e = LaunchPdl(kernel, persistent, block, smem, stream, args);
  } else {
    e = swiglu ? LaunchPdl(SmallMGemmKernel<true, false>, grid, block, 0, stream, args)
               : LaunchPdl(SmallMGemmKernel<false, false>, grid, block, 0, stream, args);
  }
  if (e != cudaSuccess) {
    return InternalError(std::string("small-m GEMM launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace

bool SmallMNormFits(const GemmParams& p) {
  if (!SmallMGemmFits(p)) return false;
  const int64_t threads = NormThreads(p.k);
  return threads <= kWarps * 32 && (kWarps * 32) % threads == 0 &&
         p.m * (p.k + kNormPad) <= kSmallMNormMaxBytes;
}

Status LaunchSmallMGemm(const GemmParams& p, const void* a, const void* b, const void* c, void* d,
                        cudaStream_t stream, const SmallMNorm* norm) {
  if (!SmallMGemmFits(p)) return InvalidArgumentError("small-m GEMM: the params do not fit");
  SmallMArgs args = MakeArgs(p, a, b, c, d);
  TP_RETURN_IF_ERROR(SetNorm(p, norm, args));
  return Launch(args, /*swiglu=*/false, stream);
}

Status LaunchSmallMGemmSwiGlu(const GemmParams& p, const void* a, const void* b, uint8_t* out,
                              int64_t ldo, const float* out_scale, cudaStream_t stream,
                              const SmallMNorm* norm) {
  if (!SmallMGemmFits(p) || p.beta != 0.0f) {
    return InvalidArgumentError("small-m GEMM with SwiGLU: the params do not fit (or beta != 0)");
  }
  if ((norm == nullptr && (a == nullptr || reinterpret_cast<uintptr_t>(a) % 16 != 0)) ||
      b == nullptr || reinterpret_cast<uintptr_t>(b) % 16 != 0) {
    return InvalidArgumentError(
        "small-m GEMM with SwiGLU: a (without a norm) and b must be non-null, 16-byte aligned");
  }
  if (p.lda < p.k || p.ldb < p.k) {
    return InvalidArgumentError("small-m GEMM with SwiGLU: lda and ldb must be filled in (>= k)");
  }
  if (out == nullptr || out_scale == nullptr) {
    return InvalidArgumentError("small-m GEMM with SwiGLU: out and out_scale must be non-null");
  }
  if (ldo < p.n / 2) {
    return InvalidArgumentError("small-m GEMM with SwiGLU: ldo (" + std::to_string(ldo) +
                                ") must be >= n / 2 (" + std::to_string(p.n / 2) + ")");
  }
  SmallMArgs args = MakeArgs(p, a, b, nullptr, nullptr);
  TP_RETURN_IF_ERROR(SetNorm(p, norm, args));
  args.swiglu_out = out;
  args.ldo = ldo;
  args.swiglu_scale = out_scale;
  return Launch(args, /*swiglu=*/true, stream);
}

}  // namespace tpserve
