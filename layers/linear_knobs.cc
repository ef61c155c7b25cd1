#include "layers/linear_knobs.h"

namespace tpserve {

std::string LinearKnobs::ToString() const {
  return "mode=" + std::string(OverlapModeName(mode)) + " chunks=" + std::to_string(chunks) +
         " comm{" + comm.Key() + "} copy_engine=" + std::to_string(copy_engine) +
         " gemm_sm_count=" + std::to_string(gemm_sm_count) +
         " fast_accum=" + std::to_string(fast_accum) + (push ? " push=1" : "");
}

Status ValidateLinearKnobs(const LinearKnobs& knobs, OverlapOp op) {
  if (knobs.chunks < 1 || knobs.chunks > 64) {
    return InvalidArgumentError("chunks must be in [1, 64], got " + std::to_string(knobs.chunks));
  }
  if (knobs.mode == OverlapMode::kNone && knobs.chunks != 1) {
    return InvalidArgumentError("chunks must be 1 with mode none, got " +
                                std::to_string(knobs.chunks));
  }
  if (knobs.gemm_sm_count < 0) {
    return InvalidArgumentError("gemm_sm_count must be >= 0 (0 = all SMs), got " +
                                std::to_string(knobs.gemm_sm_count));
  }
  if (knobs.push) {
    if (op != OverlapOp::kAllGatherGemm) {
      return InvalidArgumentError("push applies to ag_gemm layers only (a producer stores the "
                                  "gathered input), not to " +
                                  std::string(OverlapOpName(op)));
    }
    if (knobs.mode != OverlapMode::kNone) {
      return InvalidArgumentError("push needs mode none (the producer's stores replace the "
                                  "AllGather), got mode " +
                                  std::string(OverlapModeName(knobs.mode)));
    }
    if (knobs.copy_engine) {
      return InvalidArgumentError("push and copy_engine exclude each other (push moves no data "
                                  "of its own)");
    }
  }
  return knobs.comm.Validate().WithContext("comm");
}

}  // namespace tpserve
