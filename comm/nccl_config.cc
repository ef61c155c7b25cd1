#include "comm/nccl_config.h"

#include <initializer_list>

namespace tpserve {

std::string_view CtaPolicyName(NcclCommConfig::CtaPolicy policy) {
  switch (policy) {
    case NcclCommConfig::CtaPolicy::kDefault:
      return "default";
    case NcclCommConfig::CtaPolicy::kEfficiency:
      return "efficiency";
    case NcclCommConfig::CtaPolicy::kZero:
      return "zero";
  }
  return "invalid";
}

StatusOr<NcclCommConfig::CtaPolicy> ParseCtaPolicy(std::string_view name) {
  for (auto p : {NcclCommConfig::CtaPolicy::kDefault, NcclCommConfig::CtaPolicy::kEfficiency,
                 NcclCommConfig::CtaPolicy::kZero}) {
    if (name == CtaPolicyName(p)) return p;
  }
  return InvalidArgumentError("unknown NCCL CTA policy '" + std::string(name) +
                              "' (allowed: default, efficiency, zero)");
}

std::string NcclCommConfig::Key() const {
  return "min_ctas=" + std::to_string(min_ctas) + ",max_ctas=" + std::to_string(max_ctas) +
         ",cta_policy=" + std::string(CtaPolicyName(cta_policy)) +
         ",cga_cluster_size=" + std::to_string(cga_cluster_size);
}

Status NcclCommConfig::Validate() const {
  const auto range = [](const char* field, int v, int max) -> Status {
    if (v < 0 || v > max) {
      return InvalidArgumentError("NCCL communicator config: " + std::string(field) + " = " +
                                  std::to_string(v) + " is outside [0, " + std::to_string(max) +
                                  "] (0 = NCCL's default)");
    }
    return Status::Ok();
  };
  TP_RETURN_IF_ERROR(range("min_ctas", min_ctas, kMaxCtas));
  TP_RETURN_IF_ERROR(range("max_ctas", max_ctas, kMaxCtas));
  TP_RETURN_IF_ERROR(range("cga_cluster_size", cga_cluster_size, kMaxCgaClusterSize));
  if (min_ctas > 0 && max_ctas > 0 && min_ctas > max_ctas) {
    return InvalidArgumentError("NCCL communicator config: min_ctas = " + std::to_string(min_ctas) +
                                " is above max_ctas = " + std::to_string(max_ctas));
  }
  if (CtaPolicyName(cta_policy) == "invalid") {
    return InvalidArgumentError("NCCL communicator config: cta_policy has the invalid value " +
                                std::to_string(static_cast<int>(cta_policy)));
  }
  return Status::Ok();
}

}  // namespace tpserve
