// GemmScaleScheme's names and the block-wise weight-scale layout (layers/scale_scheme.h).
#include "layers/scale_scheme.h"

#include <algorithm>
#include <string>

namespace tpserve {

std::string_view GemmScaleSchemeName(GemmScaleScheme scheme) {
  switch (scheme) {
    case GemmScaleScheme::kPerTokenChannel:
      return "per_token_channel";
    case GemmScaleScheme::kBlockwise:
      return "blockwise";
    default:
      return "per_tensor";
  }
}

StatusOr<GemmScaleScheme> ParseGemmScaleScheme(std::string_view name) {
  if (name == "per_tensor") return GemmScaleScheme::kPerTensor;
  if (name == "per_token_channel") return GemmScaleScheme::kPerTokenChannel;
  if (name == "blockwise") return GemmScaleScheme::kBlockwise;
  return InvalidArgumentError("GEMM scale scheme '" + std::string(name) +
                              "': allowed values are per_tensor, per_token_channel, blockwise");
}

std::vector<float> BlockwiseWeightScalesForGemm(const std::vector<float>& grid, int64_t n,
                                                int64_t k) {
  const int64_t rows = n / kGemmScaleBlock, cols = k / kGemmScaleBlock;
  const int64_t pitch = BlockwiseWeightScalePitch(k);
  std::vector<float> out(rows * pitch, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(grid.begin() + r * cols, cols, out.begin() + r * pitch);
  }
  return out;
}

}  // namespace tpserve
