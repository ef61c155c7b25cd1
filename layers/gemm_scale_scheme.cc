// GemmScaleScheme's scale-tensor sizes and the conditions cuBLASLt sets on the non-per-tensor
// schemes (its names: layers/scale_scheme.cc).
#include "layers/gemm_scale_scheme.h"

#include <string>

namespace tpserve {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }
std::string Str(DataType t) { return std::string(DataTypeName(t)); }

}  // namespace

int64_t GemmAScaleCount(const GemmParams& p) {
  switch (p.scale_scheme) {
    case GemmScaleScheme::kPerTokenChannel:
      return p.m;
    case GemmScaleScheme::kBlockwise:
      return (p.k + kGemmScaleBlock - 1) / kGemmScaleBlock * p.m;
    default:
      return 1;
  }
}

int64_t GemmBScaleCount(const GemmParams& p) {
  switch (p.scale_scheme) {
    case GemmScaleScheme::kPerTokenChannel:
      return p.n;
    case GemmScaleScheme::kBlockwise:
      return (p.n + kGemmScaleBlock - 1) / kGemmScaleBlock * BlockwiseWeightScalePitch(p.k);
    default:
      return 1;
  }
}

Status CheckGemmScaleScheme(const GemmParams& p, bool fp8) {
  const std::string scheme =
      "GemmParams.scale_scheme = " + std::string(GemmScaleSchemeName(p.scale_scheme));
  if (!fp8) {
    return InvalidArgumentError(scheme + " needs FP8 inputs (a_type = " + Str(p.a_type) +
                                ", b_type = " + Str(p.b_type) + "); BF16 GEMMs are unscaled");
  }
  if (p.d_type != DataType::kBFloat16) {
    return UnimplementedError("GemmParams.d_type = " + Str(p.d_type) + " with " + scheme +
                              ": cuBLASLt supports only a bf16 output (no D scaling) there");
  }
  if (p.a_scale == nullptr || p.b_scale == nullptr) {
    return InvalidArgumentError(std::string("GemmParams.") +
                                (p.a_scale == nullptr ? "a_scale" : "b_scale") + " is nullptr; " +
                                scheme + " needs both scale tensors");
  }
  if (p.batch > 1) {
    return UnimplementedError("GemmParams.batch = " + Str(p.batch) + " with " + scheme +
                              ": strided batches take per-tensor scales only");
  }
  if (p.beta != 0.0f) {  // C is read
    return UnimplementedError("GemmParams.beta = " + std::to_string(p.beta) + " with " + scheme +
                              ": accumulating into C takes per-tensor scales only");
  }
  if (p.scale_scheme == GemmScaleScheme::kBlockwise) {
    if (p.k % kGemmScaleBlock != 0) {
      return InvalidArgumentError("GemmParams.k = " + Str(p.k) + " with " + scheme +
                                  ": needs k % 128 == 0 (whole 1x128 groups and 128x128 blocks)");
    }
    if (p.n % kGemmScaleBlock != 0) {
      return InvalidArgumentError("GemmParams.n = " + Str(p.n) + " with " + scheme +
                                  ": needs n % 128 == 0 (whole 128x128 weight blocks)");
    }
    if (p.m % 4 != 0) {
      return InvalidArgumentError(
          "GemmParams.m = " + Str(p.m) + " with " + scheme +
          ": needs m % 4 == 0 (cuBLASLt's 128-element block scaling wants both output "
          "dimensions multiples of 4; pad the token count)");
    }
    if (p.fast_accum) {
      return UnimplementedError("GemmParams.fast_accum = true with " + scheme +
                                ": blockwise scaling always promotes the accumulation");
    }
  }
  return Status::Ok();
}

}  // namespace tpserve
