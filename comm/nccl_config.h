// NcclCommConfig: the communicator knobs (ncclConfig_t fields) that tpserve
// tunes per layer. Plain C++ so that the overlap config file, the CPU build
// and the autotuner can use it without NCCL; comm/nccl_communicator.h turns it
// into an ncclConfig_t.
#pragma once

#include <string>
#include <string_view>

#include "comm/status.h"

namespace tpserve {

// The ncclConfig_t knobs tpserve tunes per layer. Communicators with
// different values are made by ncclCommSplit from one base communicator
// (NcclCommPool). Validated by Validate(); NCCL environment variables can
// still override them (see NcclEnvOverrides).
struct NcclCommConfig {
  enum class CtaPolicy {
    kDefault,     // NCCL_CTA_POLICY_DEFAULT: NCCL sizes its CTA use for bandwidth.
    kEfficiency,  // NCCL_CTA_POLICY_EFFICIENCY: fewest CTAs that still perform well.
    kZero,        // NCCL_CTA_POLICY_ZERO: no CTAs where possible; NCCL 2.28 runs
                  // AllGather on copy engines when both buffers are in
                  // symmetric windows (NcclSymmetricBuffer) within one NVLink
                  // domain.
  };

  // Lower bound of the CTAs (channels) NCCL uses per operation; 0 = NCCL's
  // default (1). At most kMaxCtas.
  int min_ctas = 0;
  // Upper bound of the CTAs NCCL uses per operation; 0 = NCCL's default (its
  // channel limit). At most kMaxCtas; not below min_ctas when both are set.
  int max_ctas = 0;
  // See CtaPolicy.
  CtaPolicy cta_policy = CtaPolicy::kDefault;
  // Thread-block cluster size of NCCL's kernels (Hopper CGA); 0 = NCCL's
  // default. At most kMaxCgaClusterSize.
  int cga_cluster_size = 0;

  // NCCL's channel limit (MAXCHANNELS) and cluster-size limit.
  static constexpr int kMaxCtas = 64;
  static constexpr int kMaxCgaClusterSize = 8;

  // Canonical text, e.g. "min_ctas=0,max_ctas=2,cta_policy=zero,cga_cluster_size=0":
  // equal configs have equal keys. Used as NcclCommPool's key and in logs.
  std::string Key() const;

  // INVALID_ARGUMENT naming the field and the allowed range.
  Status Validate() const;

  friend bool operator==(const NcclCommConfig&, const NcclCommConfig&) = default;
};

// "default", "efficiency", "zero".
std::string_view CtaPolicyName(NcclCommConfig::CtaPolicy policy);
// Inverse of CtaPolicyName; INVALID_ARGUMENT listing the allowed names.
StatusOr<NcclCommConfig::CtaPolicy> ParseCtaPolicy(std::string_view name);

}  // namespace tpserve
