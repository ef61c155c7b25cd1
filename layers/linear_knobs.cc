#include "layers/linear_knobs.h"

namespace tpserve {

std::string LinearKnobs::ToString() const {
  return "mode=" + std::string(OverlapModeName(mode)) + " chunks=" + std::to_string(chunks) +
         " comm{" + comm.Key() + "} copy_engine=" + std::to_string(copy_engine) +
         " fast_accum=" + std::to_string(fast_accum) + (in_place ? " in_place=1" : "") +
         (full_weight ? " full_weight=1" : "");
}

Status ValidateLinearKnobs(const LinearKnobs& knobs, OverlapOp op) {
  if (knobs.chunks < 1 || knobs.chunks > 64) {
    return InvalidArgumentError("chunks must be in [1, 64], got " + std::to_string(knobs.chunks));
  }
  if (knobs.mode == OverlapMode::kNone && knobs.chunks != 1) {
    return InvalidArgumentError("chunks must be 1 with mode none, got " +
                                std::to_string(knobs.chunks));
  }
  if (knobs.in_place && (op != OverlapOp::kGemmReduceScatter || knobs.mode != OverlapMode::kRing ||
                         !knobs.copy_engine)) {
    return InvalidArgumentError(
        "in_place applies to gemm_rs layers in mode ring with copy_engine (their running sums "
        "read in the peer's memory), got " +
        std::string(OverlapOpName(op)) + " mode " + std::string(OverlapModeName(knobs.mode)) +
        (knobs.copy_engine ? " with" : " without") + " copy_engine");
  }
  if (knobs.full_weight && (op != OverlapOp::kGemmReduceScatter || !knobs.copy_engine)) {
    return InvalidArgumentError(
        "full_weight applies to gemm_rs layers with copy_engine (the peers' input columns "
        "pulled, no partial sums), got " +
        std::string(OverlapOpName(op)) + " mode " + std::string(OverlapModeName(knobs.mode)) +
        (knobs.copy_engine ? " with" : " without") + " copy_engine");
  }
  if (knobs.full_weight && knobs.in_place) {
    // in_place defers the wait for the peers' `done` to the next Run, which is safe for the
    // running sums only Run writes; full_weight's peers read this rank's input, which the
    // caller rewrites between Runs.
    return InvalidArgumentError(
        "full_weight and in_place do not combine (the peers pull this rank's input, which must "
        "not be rewritten before they are done; in_place lets Run return before that)");
  }
  return knobs.comm.Validate().WithContext("comm");
}

PlanRequest LinearPlanRequest(OverlapOp op, const LinearKnobs& knobs, int tp, int rank, int64_t m) {
  PlanRequest q{op, knobs.mode, tp, rank, m, knobs.chunks};
  q.copy_engine = knobs.copy_engine && tp > 1;
  q.in_place = knobs.in_place && q.copy_engine;
  q.full_weight = knobs.full_weight;
  q.defer_last_sum = op == OverlapOp::kGemmReduceScatter && knobs.mode == OverlapMode::kRing &&
                     q.copy_engine && knobs.chunks == 1 && !knobs.in_place && !knobs.full_weight;
  return q;
}

}  // namespace tpserve
