// Hopper warpgroup MMA (wgmma) helpers for engine/attention_wgmma.cu: shared-memory matrix
// descriptors for 128-byte swizzled tiles, the fences and groups that order wgmma against
// other instructions, and the m64n128 products the attention kernels need (BF16 k16, E4M3
// k32). CUDA C++17, device code only. Every helper needs sm_90a (the "a" features) and traps
// elsewhere.
//
// Layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout"): a 128-byte
// swizzled tile is stored as rows of 128 bytes (64 BF16), the 16-byte chunk c of row r at
// chunk c ^ (r % 8), every 8-row group (1024 bytes) 1024-byte aligned. A K-major operand puts
// M or N on the rows and 64 of K along each row: its descriptor's stride byte offset (SBO) is
// the distance between 8-row groups, and a k-step of 16 inside the 64 advances the start
// address by 32 bytes. An MN-major operand puts K on the rows and 64 of M or N along each
// row: SBO is again the distance between 8-row (8 K) groups, and the leading byte offset (LBO)
// the distance to the next 64 of M or N.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tpserve::device {

// Descriptor of a 128-byte swizzled shared-memory operand starting at shared address `addr`
// (a __cvta_generic_to_shared value); byte offsets are multiples of 16.
__device__ __forceinline__ uint64_t SmemDescSw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t{1} << 62);
}

// Orders earlier register and shared-memory accesses before the wgmma that follows.
__device__ __forceinline__ void WgmmaFence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void WgmmaCommit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending committed wgmma groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Makes this thread's generic-proxy writes to shared memory (stores, cp.async) visible to
// the async proxy that wgmma reads through; a barrier must follow before another thread's
// wgmma reads them.
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accesses of `r` across the wgmma that writes it
// asynchronously (the asm statements of the wgmma do not name its in-flight registers).
template <int kN>
__device__ __forceinline__ void PinRegisters(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kN>
__device__ __forceinline__ void PinRegisters(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The 64 FP32 accumulators of an m64n128 wgmma: their registers in the instruction (operands
// %0..%63) and their read-write constraints.
#define TPSERVE_WGMMA_D64_REGS                                                                 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define TPSERVE_WGMMA_D8(d, i)                                                                \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define TPSERVE_WGMMA_D64(d)                                                     \
  TPSERVE_WGMMA_D8(d, 0), TPSERVE_WGMMA_D8(d, 8), TPSERVE_WGMMA_D8(d, 16),       \
      TPSERVE_WGMMA_D8(d, 24), TPSERVE_WGMMA_D8(d, 32), TPSERVE_WGMMA_D8(d, 40), \
      TPSERVE_WGMMA_D8(d, 48), TPSERVE_WGMMA_D8(d, 56)

// S = A B^T: A (64 x 16) and B (128 x 16) from shared memory, both K-major, 128-byte
// swizzled; d += product, or d = product when accumulate is 0.
__device__ __forceinline__ void WgmmaSS64x128x16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TPSERVE_WGMMA_D64_REGS
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : TPSERVE_WGMMA_D64(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();
#endif
}

// d += A B: A (64 x 16, BF16) from registers in the m16n8k16 A fragment order per warp (warp
// w of the warpgroup holds rows 16w..16w+15), B (16 x 128) from shared memory, MN-major
// (N contiguous), 128-byte swizzled.
__device__ __forceinline__ void WgmmaRS64x128x16TransB(float (&d)[64], const uint32_t (&a)[4],
                                                       uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TPSERVE_WGMMA_D64_REGS
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : TPSERVE_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
#else
  (void)d, (void)a, (void)desc_b;
  __trap();
#endif
}

// S = A B^T in E4M3: A (64 x 32) and B (128 x 32) from shared memory, both K-major (the
// only order 8-bit wgmma takes), 128-byte swizzled (a row is 128 codes: a k-step of 32 advances
// the start address by 32 bytes); d += product, or d = product when accumulate is 0.
__device__ __forceinline__ void WgmmaSS64x128x32E4M3(float (&d)[64], uint64_t desc_a,
                                                     uint64_t desc_b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" TPSERVE_WGMMA_D64_REGS
      "}, %64, %65, p, 1, 1;\n}\n"
      : TPSERVE_WGMMA_D64(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();
#endif
}

// d += A B in E4M3: A (64 x 32) from registers (warp w of the warpgroup holds rows
// 16w..16w+15; a thread with lane = 4g + t holds, low byte first, k 4t..4t+3 of row g in a[0],
// of row g + 8 in a[1], and k 16 + 4t.. of those rows in a[2], a[3]), B (32 x 128) from shared
// memory K-major (N on the rows: 128 rows of 128 k codes), 128-byte swizzled.
__device__ __forceinline__ void WgmmaRS64x128x32E4M3(float (&d)[64], const uint32_t (&a)[4],
                                                     uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" TPSERVE_WGMMA_D64_REGS
      "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : TPSERVE_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
#else
  (void)d, (void)a, (void)desc_b;
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Transaction barriers (mbarrier), tensor-memory-access (TMA) copies and named barriers.
// `bar` and `dst` are shared addresses (__cvta_generic_to_shared).

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Makes initialised barriers visible to the other threads and to the TMA unit (a block
// barrier must follow before they are used).
__device__ __forceinline__ void MbarInitFence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival that also expects `bytes` more of TMA traffic in the current phase.
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}
// Waits until the phase of parity `parity` has completed (a barrier starts in phase 0).
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
#endif
}
// One box of a 2-D tensor map (a __grid_constant__ CUtensorMap kernel parameter) at
// coordinates (c0 innermost, c1) into shared memory; its bytes complete on `bar`.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const void* tensor_map, int c0, int c1,
                                          uint32_t bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#else
  (void)dst, (void)tensor_map, (void)c0, (void)c1, (void)bar;
#endif
}
// Named barriers 1..15: `threads` (a multiple of 32) arrive in all, those calling Sync wait.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace tpserve::device
