// The sharded, overlapped CPU layers against the unsharded reference GEMM.
#include "layers/cpu_linear.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "comm/local_communicator.h"
#include "layers/fp8.h"
#include "layers/linear_problem.h"
#include "layers/overlap_plan.h"

namespace tpserve {
namespace {

// GEMM+RS rounds each rank's partial to BF16 before the sum, the reference
// rounds once: relative Frobenius error stays far below this for tp <= 8.
constexpr double kRsRelTol = 1e-2;

// Column-parallel: every rank must produce X · W_r^T exactly as the unsharded
// reference does for those columns (same dot products, same order). Row-
// parallel: within the BF16-partial tolerance (exactly for tp = 1).
void CheckLayer(OverlapOp op, DataType dtype, OverlapMode mode, int tp, int64_t m, int chunks) {
  const bool ag = op == OverlapOp::kAllGatherGemm;
  const int64_t n = ag ? 16 * tp : 24, k = ag ? 32 : 16 * tp;
  auto p = MakeRandomLinearProblem(op, dtype, tp, m, n, k, 1000 * tp + m + chunks);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  auto y = RunCpuLinearGroup(*p, mode, chunks);
  ASSERT_TRUE(y.ok()) << y.status().ToString();
  auto err = CompareWithReference(*p, *y);
  ASSERT_TRUE(err.ok()) << err.status().ToString();
  EXPECT_EQ(err->unwritten, 0) << "output elements left unwritten";
  if (ag || tp == 1) {
    EXPECT_EQ(err->differing, 0) << "max abs error " << err->max_abs;
  } else {
    EXPECT_LE(err->rel_frobenius, kRsRelTol);
  }
}

using Case = std::tuple<OverlapOp, OverlapMode, DataType>;

class CpuLinearGrid : public ::testing::TestWithParam<Case> {};

TEST_P(CpuLinearGrid, ShardedOverlappedEqualsUnshardedReference) {
  const auto [op, mode, dtype] = GetParam();
  for (int tp : {1, 2, 3, 4, 8}) {
    for (int64_t m : {1, 7, 37, 1002, 4099}) {
      for (int chunks = 1; chunks <= 8; ++chunks) {
        if (mode == OverlapMode::kNone && chunks > 1) break;
        // The big M only at a few chunk counts: the grid's cost is in it.
        if (m == 4099 && chunks != 1 && chunks != 3 && chunks != 8) continue;
        SCOPED_TRACE(::testing::Message() << "tp=" << tp << " m=" << m << " chunks=" << chunks);
        CheckLayer(op, dtype, mode, tp, m, chunks);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllModes, CpuLinearGrid,
    ::testing::Combine(::testing::Values(OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter),
                       ::testing::Values(OverlapMode::kNone, OverlapMode::kPipeline,
                                         OverlapMode::kRing),
                       ::testing::Values(DataType::kFloat8E4M3, DataType::kBFloat16)),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      return std::string(OverlapOpName(std::get<0>(param_info.param))) + "_" +
             std::string(OverlapModeName(std::get<1>(param_info.param))) + "_" +
             (std::get<2>(param_info.param) == DataType::kBFloat16 ? "bf16" : "fp8");
    });

// The ring a gemm_rs layer on copy engines runs at one chunk (PlanRequest::defer_last_sum: the
// last GEMM computes the own partial alone, a sum step adds the arrived running sum): every
// rank's plan passes ValidatePlan, the group ValidatePlanGroup, and the CPU executor's output
// matches the unsharded reference at tp 2, 3, 4 and 8 (empty shards too), every element
// written. A plan whose sum is dropped leaves the output unwritten, and one that waits for
// nothing fails validation.
TEST(CpuLinear, DeferredLastSumMatchesTheReference) {
  for (DataType dtype : {DataType::kFloat8E4M3, DataType::kBFloat16}) {
    for (int tp : {2, 3, 4, 8}) {
      for (int64_t m : {1, 7, 37, 1002}) {
        SCOPED_TRACE(::testing::Message() << "tp=" << tp << " m=" << m);
        std::vector<OverlapPlan> plans;
        for (int r = 0; r < tp; ++r) {
          PlanRequest q{OverlapOp::kGemmReduceScatter, OverlapMode::kRing, tp, r, m, 1};
          q.defer_last_sum = true;
          auto plan = MakeOverlapPlan(q);
          ASSERT_TRUE(plan.ok()) << plan.status().ToString();
          ASSERT_TRUE(ValidatePlan(*plan).ok()) << ValidatePlan(*plan).ToString();
          const bool own_rows = !ShardRows(m, tp, r).empty();
          const int sums = static_cast<int>(
              std::count_if(plan->steps.begin(), plan->steps.end(),
                            [](const PlanStep& s) { return s.kind == StepKind::kSum; }));
          EXPECT_EQ(sums, own_rows ? 1 : 0);
          plans.push_back(*std::move(plan));
        }
        EXPECT_TRUE(ValidatePlanGroup(plans).ok());
        auto p = MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, dtype, tp, m, 24, 16 * tp,
                                         77 + tp);
        ASSERT_TRUE(p.ok());
        auto y = RunCpuLinearGroup(*p, OverlapMode::kRing, 1, /*defer_last_sum=*/true);
        ASSERT_TRUE(y.ok()) << y.status().ToString();
        auto err = CompareWithReference(*p, *y);
        ASSERT_TRUE(err.ok());
        EXPECT_EQ(err->unwritten, 0);
        EXPECT_LE(err->rel_frobenius, kRsRelTol);
      }
    }
  }
  // Broken plans: the sum before its received addend, and no sum at all.
  PlanRequest q{OverlapOp::kGemmReduceScatter, OverlapMode::kRing, 3, 1, 30, 1};
  q.defer_last_sum = true;
  auto plan = MakeOverlapPlan(q);
  ASSERT_TRUE(plan.ok());
  OverlapPlan early = *plan;
  early.steps.back().deps = {static_cast<int>(early.steps.size()) - 2};  // the GEMM only
  EXPECT_THAT(ValidatePlan(early).message(), ::testing::HasSubstr("before both"));
  OverlapPlan dropped = *plan;
  dropped.steps.pop_back();
  EXPECT_THAT(ValidatePlan(dropped).message(), ::testing::HasSubstr("written 0 times"));
  // Only for gemm_rs ring at one chunk.
  q.chunks = 2;
  EXPECT_EQ(MakeOverlapPlan(q).status().code(), StatusCode::kInvalidArgument);
  q.chunks = 1;
  q.mode = OverlapMode::kPipeline;
  EXPECT_EQ(MakeOverlapPlan(q).status().code(), StatusCode::kInvalidArgument);
}

// A problem with a scale per row (per channel: per-token X, per-channel W) or per 1x128 group
// and 128x128 block: every rank's share of the scales follows its share of X and W, so the CPU
// executor in every mode matches the unsharded reference of that scheme; with two rows' scales
// swapped in a rank's share the output is far off (the check can fail).
TEST(CpuLinear, FineScaleSchemesShardWithTheirRowsAndColumns) {
  for (Fp8Scheme scheme : {Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    for (OverlapOp op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
      for (int tp : {1, 2, 3}) {
        const bool ag = op == OverlapOp::kAllGatherGemm;
        // Block: each rank's split dimension whole 128s.
        const int64_t n = ag ? 128 * tp : 128, k = ag ? 256 : 128 * tp;
        for (int64_t m : {1, 37, 300}) {
          SCOPED_TRACE(::testing::Message() << Fp8SchemeName(scheme) << " " << OverlapOpName(op)
                                            << " tp=" << tp << " m=" << m);
          auto p = MakeRandomLinearProblem(op, DataType::kFloat8E4M3, tp, m, n, k, 11, scheme);
          ASSERT_TRUE(p.ok()) << p.status().ToString();
          for (OverlapMode mode :
               {OverlapMode::kNone, OverlapMode::kPipeline, OverlapMode::kRing}) {
            auto y = RunCpuLinearGroup(*p, mode, mode == OverlapMode::kNone ? 1 : 2);
            ASSERT_TRUE(y.ok()) << y.status().ToString();
            auto err = CompareWithReference(*p, *y);
            ASSERT_TRUE(err.ok());
            EXPECT_EQ(err->unwritten, 0);
            EXPECT_LE(err->rel_frobenius, ag ? 1e-6 : kRsRelTol) << OverlapModeName(mode);
          }
          if (m < 37) continue;
          LinearProblem swapped = *p;
          std::vector<float>& xs = swapped.x_scales_local[0];
          const size_t per_row = xs.size() / (ag ? ShardRows(m, tp, 0).size() : m);
          for (size_t g = 0; g < per_row; ++g) std::swap(xs[g], xs[per_row + g]);
          auto y = RunCpuLinearGroup(swapped, OverlapMode::kNone, 1);
          ASSERT_TRUE(y.ok());
          auto err = CompareWithReference(swapped, *y);
          ASSERT_TRUE(err.ok());
          if (xs[0] != xs[per_row]) {
            EXPECT_GT(err->rel_frobenius, 1e-2);
          }
        }
      }
    }
  }
  auto bf16 = MakeRandomLinearProblem(OverlapOp::kAllGatherGemm, DataType::kBFloat16, 2, 8, 256,
                                      256, 1, Fp8Scheme::kPerChannel);
  EXPECT_EQ(bf16.status().code(), StatusCode::kInvalidArgument);
  auto ragged = MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, DataType::kFloat8E4M3, 2, 8,
                                        128, 192, 1, Fp8Scheme::kBlock);
  EXPECT_EQ(ragged.status().code(), StatusCode::kInvalidArgument);
}

TEST(CpuLinear, PerRankComparisonAddsUpToTheGroupComparison) {
  auto p =
      MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, DataType::kBFloat16, 3, 37, 32, 48, 5);
  ASSERT_TRUE(p.ok());
  auto y = RunCpuLinearGroup(*p, OverlapMode::kRing, 2);
  ASSERT_TRUE(y.ok());
  (*y)[1][3].bits = kPoisonBf16;  // one unwritten element on rank 1
  auto all = CompareWithReference(*p, *y);
  ASSERT_TRUE(all.ok());
  int64_t unwritten = 0, differing = 0;
  for (int r = 0; r < 3; ++r) {
    auto one = CompareRankWithReference(*p, r, (*y)[r]);
    ASSERT_TRUE(one.ok());
    unwritten += one->unwritten;
    differing += one->differing;
  }
  EXPECT_EQ(all->unwritten, 1);
  EXPECT_EQ(unwritten, all->unwritten);
  EXPECT_EQ(differing, all->differing);
  EXPECT_FALSE(CompareRankWithReference(*p, 3, (*y)[0]).ok());
  EXPECT_FALSE(CompareRankWithReference(*p, 0, (*y)[1]).ok());  // wrong size for rank 0
}

TEST(CpuLinear, Fp8ScalesMultiplyTheProduct) {
  // x = 2 (code of 2.0) with scale 0.5 -> 1; w = 3 with scale 2 -> 6; k = 16.
  const int64_t m = 1, n = 1, k = 16;
  std::vector<uint8_t> x(k, FloatToFp8E4M3(2.0f)), w(k, FloatToFp8E4M3(3.0f));
  std::vector<BFloat16> y(1);
  ASSERT_TRUE(
      ReferenceLinear(DataType::kFloat8E4M3, m, n, k, x.data(), 0.5f, w.data(), 2.0f, y).ok());
  EXPECT_EQ(BFloat16ToFloat(y[0]), 16 * 6.0f);
}

TEST(CpuLinear, RejectsMismatchedCommunicator) {
  auto plan = MakeOverlapPlan({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 4, 0, 8, 2});
  ASSERT_TRUE(plan.ok());
  auto comms = MakeLocalCommunicators(2);
  ASSERT_TRUE(comms.ok());
  std::vector<uint8_t> x(8 * 16), w(16 * 16);
  std::vector<BFloat16> y(8 * 16);
  CpuLinearArgs a{DataType::kFloat8E4M3, 16, 16, x.data(), 1.0f, w.data(), 1.0f, y.data()};
  Status s = RunCpuLinear(*plan, *(*comms)[0], a);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("plan is for rank 0 of 4"));
}

TEST(CpuLinear, RejectsUnsupportedDtype) {
  std::vector<float> x(16), w(16);
  std::vector<BFloat16> y(1);
  Status s = ReferenceLinear(DataType::kFloat32, 1, 1, 16, x.data(), 1, w.data(), 1, y);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("f32"));
}

}  // namespace
}  // namespace tpserve
