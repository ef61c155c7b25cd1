// Kernel and launcher for layers/small_m_gemm.h. Plain CUDA C++17.
#include "layers/small_m_gemm.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "layers/fp8_divide.cuh"
#include "layers/mma_e4m3.cuh"
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
// The one-group kernel's k: every warp kOneGroupWarpBlocks blocks (llama3-8b's qkv, o, gate_up).
constexpr int kOneGroupWarpBlocks = 2 * kUnroll;
constexpr int64_t kOneGroupK = int64_t{kWarps} * kOneGroupWarpBlocks * kBlockK;

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
};

__device__ __forceinline__ uint4 LoadStream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Activations written by the kernel ahead (read after the PDL wait). Volatile, so that the
// loads stay where they are written among the (volatile) MMAs instead of all being hoisted
// (which would take registers the one-group kernel does not have).
__device__ __forceinline__ uint4 LoadActivations(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Lane (g, t) = (lane / 4, lane % 4) loads bytes 16t .. 16t + 15 of a 64-column block of
// weight rows g and g + 8 and of token g, the layout of MmaBlockE4m3 (layers/mma_e4m3.cuh).
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
// kOneGroup (k = kOneGroupK): each warp issues all of its weight loads at once (before the PDL
// wait with a constant B) instead of in kUnroll-block rounds, so that they wait out one memory
// latency, not two; the activations are read kUnroll blocks at a time. Capped at 64 registers
// (two CTAs an SM).
template <bool kSwiGlu, bool kOneGroup>
__global__ void __launch_bounds__(kWarps * 32, kOneGroup ? 2 : 0) SmallMGemmKernel(SmallMArgs p) {
  __shared__ float partial[kWarps][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * (kSwiGlu ? kRows / 2 : kRows);
  const int64_t blocks = p.k / kBlockK;
  const int64_t first = blocks * warp / kWarps, last = blocks * (warp + 1) / kWarps;
  const uint8_t* w_lo = p.b + (row0 + g) * p.ldb + 16 * t;
  const uint8_t* w_hi = kSwiGlu ? w_lo + (p.n / 2) * p.ldb : w_lo + 8 * p.ldb;
  const bool token = g < p.m;
  const uint8_t* x = p.a + (token ? g : 0) * p.lda + 16 * t;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // kUnroll blocks from kb: the weight's (loaded by the caller) against the activations'.
  auto multiply = [&](const uint4(&lo)[kUnroll], const uint4(&hi)[kUnroll], int64_t kb) {
    uint4 xv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      xv[u] =
          token ? *reinterpret_cast<const uint4*>(x + (kb + u) * kBlockK) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      MmaBlockE4m3(acc, lo[u], hi[u], xv[u]);
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
  if constexpr (kOneGroup) {
    uint4 lo[kOneGroupWarpBlocks], hi[kOneGroupWarpBlocks];
    if (!p.b_constant) PdlEnter();
#pragma unroll
    for (int u = 0; u < kOneGroupWarpBlocks; ++u) {
      lo[u] = LoadStream(w_lo + (kb + u) * kBlockK);
      hi[u] = LoadStream(w_hi + (kb + u) * kBlockK);
    }
    if (p.b_constant) PdlEnter();
#pragma unroll
    for (int h = 0; h < kOneGroupWarpBlocks / kUnroll; ++h) {
      uint4 xv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        xv[u] =
            token ? LoadActivations(x + (kb + h * kUnroll + u) * kBlockK) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        MmaBlockE4m3(acc, lo[h * kUnroll + u], hi[h * kUnroll + u], xv[u]);
      }
    }
  } else {
    if (p.b_constant && first + kUnroll <= last) {
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
      const uint4 xv =
          token ? *reinterpret_cast<const uint4*>(x + kb * kBlockK) : make_uint4(0, 0, 0, 0);
      MmaBlockE4m3(acc, lo, hi, xv);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
  __syncthreads();
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
  return args;
}

// One CTA per 16 rows of B either way (with SwiGLU: 8 gate rows and their 8 up rows).
Status Launch(const SmallMArgs& args, bool swiglu, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.n / kRows));
  const dim3 block(kWarps * 32);
  const bool one_group = args.k == kOneGroupK;
  void (*const kernel)(SmallMArgs) =
      swiglu ? (one_group ? SmallMGemmKernel<true, true> : SmallMGemmKernel<true, false>)
             : (one_group ? SmallMGemmKernel<false, true> : SmallMGemmKernel<false, false>);
  const cudaError_t e = LaunchPdl(kernel, grid, block, 0, stream, args);
  if (e != cudaSuccess) {
    return InternalError(std::string("small-m GEMM launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

}  // namespace

Status LaunchSmallMGemm(const GemmParams& p, const void* a, const void* b, const void* c, void* d,
                        cudaStream_t stream) {
  if (!SmallMGemmFits(p)) return InvalidArgumentError("small-m GEMM: the params do not fit");
  return Launch(MakeArgs(p, a, b, c, d), /*swiglu=*/false, stream);
}

Status LaunchSmallMGemmSwiGlu(const GemmParams& p, const void* a, const void* b, uint8_t* out,
                              int64_t ldo, const float* out_scale, cudaStream_t stream) {
  if (!SmallMGemmFits(p) || p.beta != 0.0f) {
    return InvalidArgumentError("small-m GEMM with SwiGLU: the params do not fit (or beta != 0)");
  }
  if (a == nullptr || b == nullptr || reinterpret_cast<uintptr_t>(a) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(b) % 16 != 0) {
    return InvalidArgumentError(
        "small-m GEMM with SwiGLU: a and b must be non-null, 16-byte "
        "aligned");
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
  args.swiglu_out = out;
  args.ldo = ldo;
  args.swiglu_scale = out_scale;
  return Launch(args, /*swiglu=*/true, stream);
}

}  // namespace tpserve
