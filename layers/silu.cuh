// SiLU as the SwiGLU kernels compute it (engine/cuda_ops.cu's SwiGLU, and the small-M GEMM's
// SwiGLU epilogue in layers/small_m_gemm.cu): one definition, so that both give the same bits.
// Device code only; included by .cu files.
#pragma once

#include <cuda_runtime.h>

namespace tpserve {

// exp and the division on the multi-function unit (a few ulp of FP32, far below the BF16 or
// E4M3 rounding after): with IEEE expf and division the SwiGLU kernel was bound by its
// arithmetic, not by memory. For g below about -87.3, 1 + exp(-g) exceeds 2^126 (or is
// infinite) and __fdividef gives -0, as the quotient should be.
__device__ __forceinline__ float Silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

}  // namespace tpserve
