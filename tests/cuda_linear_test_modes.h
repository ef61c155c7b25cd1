// The layer modes the tuner can emit (benchmarks/bench_layers.cc, MakeMethods), shared by the
// tests that go through CudaLinear's host-side schedule (cuda_linear_steps_test.cc records it,
// cuda_linear_schedule_test.cc executes it on the CPU).
#pragma once

#include <vector>

#include "layers/overlap_plan.h"

namespace tpserve {

struct TunerMode {
  OverlapOp op;
  OverlapMode mode;
  bool copy_engine;
  int chunks;
  bool full_weight = false;
  bool in_place = false;
};

// Every mode the tuner can emit, at chunks 1, 2, 4 (mode none: 1): none / pipeline / ring for
// both ops, over NCCL and copy engines; gemm_rs full_weight (copy engines) in every mode; gemm_rs
// in_place rings.
inline std::vector<TunerMode> TunerModes() {
  std::vector<TunerMode> out;
  for (OverlapOp op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
    for (OverlapMode mode : {OverlapMode::kNone, OverlapMode::kPipeline, OverlapMode::kRing}) {
      for (bool ce : {false, true}) {
        for (int chunks : {1, 2, 4}) {
          if (mode == OverlapMode::kNone && chunks != 1) continue;
          out.push_back({op, mode, ce, chunks});
        }
      }
    }
  }
  const OverlapOp rs = OverlapOp::kGemmReduceScatter;
  out.push_back({rs, OverlapMode::kNone, true, 1, /*full_weight=*/true});
  for (OverlapMode mode : {OverlapMode::kPipeline, OverlapMode::kRing}) {
    for (int chunks : {1, 2, 4}) out.push_back({rs, mode, true, chunks, /*full_weight=*/true});
  }
  for (int chunks : {1, 2, 4}) {
    out.push_back({rs, OverlapMode::kRing, true, chunks, false, /*in_place=*/true});
  }
  return out;
}

}  // namespace tpserve
