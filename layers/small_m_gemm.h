// The GEMMs of a decode step: D[m, n] = alpha * a_scale * b_scale * A[m, k] . B[n, k]^T
// (+ beta * C) for m <= kSmallMGemmMaxM rows of FP8 E4M3 activations against an FP8 weight.
// They stream the weight once and compute almost nothing, so they are bounded by HBM bytes and
// by latency; CublasLtGemm::Run (layers/cublaslt_gemm.h) sends the GemmParams that fit here to
// this kernel instead of cuBLASLt.
//
// The kernel: one CTA per 16 rows of B (output columns n), its 16 warps splitting k. Each lane
// loads 16 contiguous bytes of two weight rows and of one activation row per 64 columns and
// feeds them to two FP8 tensor-core MMAs (m16n8k32: the 16 weight rows as A, up to 8 tokens
// as B's columns), reading the columns of a 64-column block in an order of its own that is the
// same for both operands, so the sums are the dot products. The warps' partial sums meet in
// shared memory; one warp scales them, adds C and stores BF16. With GemmParams::b_constant the
// weight's first bytes are loaded, and the rest asked into L2, before the kernel waits for the
// one ahead of it in the stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/status.h"
#include "layers/cublaslt_gemm.h"

namespace tpserve {

inline constexpr int64_t kSmallMGemmMaxM = 8;

// Whether `p` (with lda, ldb, ldc, ldd filled in) is a GEMM this kernel runs: FP8 E4M3 A and B
// with per-tensor scales, a BF16 D (and C, when beta != 0), 1 <= m <= kSmallMGemmMaxM, one
// batch item, k % 64 == 0, n % 16 == 0, row pitches multiples of 16 bytes (A, B) and of 2
// elements (C, D), no D scale or amax. Pure.
bool SmallMGemmFits(const GemmParams& p);

// Enqueues the GEMM on `stream`: no allocation or synchronisation (capturable). The pointers
// are those of CublasLtGemm::Run, A and B 16-byte aligned; a_scale / b_scale may be null (1).
// INVALID_ARGUMENT when !SmallMGemmFits(p); the launch's error.
Status LaunchSmallMGemm(const GemmParams& p, const void* a, const void* b, const void* c, void* d,
                        cudaStream_t stream);

// Llama's gate_up GEMM with SwiGLU in its epilogue: B's rows are the gate rows [0, n/2) and the
// up rows [n/2, n); instead of D, out[t * ldo + j] (j < n/2) gets the E4M3 code of
// silu(gate) * up over *out_scale (a dequantization scale, divided by), gate and up being the
// BF16 values D would hold at columns j and n/2 + j: bit-identical to LaunchSmallMGemm and
// then engine/cuda_ops.h's LaunchSwiGlu with out_fp8 / out_fp8_scale, in one kernel instead
// of two. p's pitches filled in (ResolveGemmParams). INVALID_ARGUMENT when !SmallMGemmFits(p),
// beta != 0, a pitch is left 0 (lda or ldb below k), out or out_scale is null, or ldo < n/2.
Status LaunchSmallMGemmSwiGlu(const GemmParams& p, const void* a, const void* b, uint8_t* out,
                              int64_t ldo, const float* out_scale, cudaStream_t stream);

}  // namespace tpserve
