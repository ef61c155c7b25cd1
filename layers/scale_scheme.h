// GemmScaleScheme: how the FP8 dequantization scales of a GEMM's two operands are laid out
// (layers/cublaslt_gemm.h applies them), in a header of its own so that what does not link
// cuBLASLt (the overlap config's tuned shape key, the CPU reference) can name a scheme.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "comm/status.h"

namespace tpserve {

// How the FP8 *dequantization* scales a_scale (of A, the activations) and b_scale (of B, the
// weight) are laid out; with the scales, D[i,j] = alpha * sum_kk sa(i,kk) * A[i,kk] *
// sb(j,kk) * B[j,kk] (+ beta * C[i,j]). In cuBLASLt's column-major terms A is its B operand
// and B its A operand (layers/cublaslt_gemm.h), so our per-row-of-A scales are its per-column
// scales of B and vice versa; CublasLtGemm does that mapping.
enum class GemmScaleScheme {
  // sa = a_scale[0], sb = b_scale[0] (each nullptr: 1). cuBLASLt SCALAR_32F.
  kPerTensor,
  // Per token and per output channel: sa(i,kk) = a_scale[i] (m floats), sb(j,kk) = b_scale[j]
  // (n floats). cuBLASLt OUTER_VEC_32F on both operands.
  kPerTokenChannel,
  // Blockwise: A in 1x128 groups along k, sa(i,kk) = a_scale[(kk / 128) * m + i] (k/128
  // columns of m floats: token-major, cuBLASLt VEC128_32F); B in 128x128 blocks,
  // sb(j,kk) = b_scale[(j / 128) * BlockwiseWeightScalePitch(k) + kk / 128] (n/128 rows of
  // k/128 floats padded to a multiple of 4: cuBLASLt BLK128x128_32F, K-major).
  kBlockwise,
};
// "per_tensor" | "per_token_channel" | "blockwise".
std::string_view GemmScaleSchemeName(GemmScaleScheme scheme);
// INVALID_ARGUMENT naming the allowed values.
StatusOr<GemmScaleScheme> ParseGemmScaleScheme(std::string_view name);

// The group / block edge of GemmScaleScheme::kBlockwise.
inline constexpr int64_t kGemmScaleBlock = 128;
// Floats between consecutive 128-row blocks of a kBlockwise b_scale: k/128 rounded up to a
// multiple of 4 (cuBLASLt wants the stride between its columns 16-byte aligned).
inline constexpr int64_t BlockwiseWeightScalePitch(int64_t k) {
  return ((k + kGemmScaleBlock - 1) / kGemmScaleBlock + 3) / 4 * 4;
}

// A [n, k] weight's 128x128 block scales as a kBlockwise GEMM reads them: `grid` holds the
// blocks row-major ([n/128][k/128], a checkpoint's weight_scale_inv layout, n and k multiples of
// 128, grid.size() checked by the caller); each block row is padded with 1s to
// BlockwiseWeightScalePitch(k).
std::vector<float> BlockwiseWeightScalesForGemm(const std::vector<float>& grid, int64_t n,
                                                int64_t k);

}  // namespace tpserve
