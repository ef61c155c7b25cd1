// The checks that ValidateGemmParams (layers/cublaslt_gemm.h) applies to a GemmParams whose
// scale_scheme is not kPerTensor; private to layers/. The scheme's scale counts are declared
// in layers/cublaslt_gemm.h and defined beside this check (its names: layers/scale_scheme.h).
#pragma once

#include "layers/cublaslt_gemm.h"

namespace tpserve {

// The per-token/channel and blockwise schemes' extra conditions. cuBLASLt documents them for
// D in 16/32-bit floats only (no D scale or amax), without C scaling; batched scale tensors
// are not described at all. beta != 0 and batch > 1 are refused because no test covers them.
// `fp8`: both inputs are fp8_e4m3. INVALID_ARGUMENT or UNIMPLEMENTED naming the field.
Status CheckGemmScaleScheme(const GemmParams& p, bool fp8);

}  // namespace tpserve
