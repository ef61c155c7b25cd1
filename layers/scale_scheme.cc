// GemmScaleScheme's names (layers/scale_scheme.h).
#include "layers/scale_scheme.h"

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

}  // namespace tpserve
