// Tensor-core and asynchronous-copy helpers shared by the engine's attention kernels
// (engine/attention.cu, engine/paged_decode_attention.cu): mma.sync m16n8k16 on BF16, ldmatrix,
// cp.async, exp2 on the multi-function unit, E4M3 widened to BF16. CUDA C++17, device code
// only; include from .cu files. Every helper needs sm_80+ and traps below it (the default
// build is sm_90a only).
//
// Fragment layouts (PTX ISA, "mma.m16n8k16" for .bf16), g = lane / 4, t = lane % 4:
//   A (16x16, row-major) regs 0..3: (row g, cols 2t..2t+1), (row g+8, cols 2t..), (row g,
//     cols 2t+8..), (row g+8, cols 2t+8..)
//   B (16x8, "col"): regs 0..1: (k rows 2t..2t+1, col g), (k rows 2t+8..2t+9, col g)
//   C (16x8 FP32): c0, c1: (row g, cols 2t, 2t+1); c2, c3: (row g+8, same cols)
// so the C fragments of two adjacent n8 tiles are exactly the A fragment of the next product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "engine/device_math.cuh"

namespace tpserve::device {

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

// 2^x on the multi-function unit; results below 2^-126 flush to zero (softmax weights
// that small vanish next to the row's largest, which is 1).
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two E4M3 codes (bytes 0 and 1 of `pair`) as a bf16x2 word, exact, on the integer and
// half-precision pipes only (the format conversions run at a quarter of their rate, and a
// decode step over an E4M3 cache widens every code it reads). Each code's sign goes to bit 15
// of its 16-bit lane and its seven exponent and mantissa bits to bits 4..10: read as BF16 that
// is the code's value times 2^-120 (a normal code's exponent field e is BF16's e too, whose
// bias is 120 more; a subnormal code becomes the BF16 subnormal of the same mantissa), and
// one BF16 multiply by 2^120 restores it exactly. The two NaN codes (0x7F, 0xFF) read as
// +-480; the cache writers saturate, so they never store one.
__device__ __forceinline__ uint32_t Fp8x2ToBf16x2(uint32_t pair) {
  const uint32_t lanes = __byte_perm(pair, 0u, 0x4140u);  // [0 | code1][0 | code0]
  const uint32_t sign = lanes & 0x00800080u;
  // lanes * 16 puts the magnitude at bits 4..10 and the sign at bit 11; sign * 240 moves it
  // to bit 15 (+2^15 - 2^11 in each lane; no lane carries into the next).
  const uint32_t bits = lanes * 16u + sign * 240u;
  __nv_bfloat162 v;
  std::memcpy(&v, &bits, sizeof(v));
  const __nv_bfloat162 kTwoTo120 =
      __halves2bfloat162(__ushort_as_bfloat16(0x7B80u), __ushort_as_bfloat16(0x7B80u));
  v = __hmul2(v, kTwoTo120);
  uint32_t out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

// Eight E4M3 codes as eight BF16 values (exact; see Fp8x2ToBf16x2).
__device__ __forceinline__ uint4 Fp8x8ToBf16x8(const uint2& raw) {
  return make_uint4(Fp8x2ToBf16x2(raw.x), Fp8x2ToBf16x2(raw.x >> 16), Fp8x2ToBf16x2(raw.y),
                    Fp8x2ToBf16x2(raw.y >> 16));
}

}  // namespace tpserve::device
