// The copy-engine, in_place and full_weight schedules as plans (layers/overlap_plan.h): every
// schedule the tuner can emit (tests/cuda_linear_test_modes.h), planned as the layer plans it
// (LinearPlanRequest), passes ValidatePlan on every rank and ValidatePlanGroup at TP 2, 3, 4
// and 8, and the CPU executor running it matches the unsharded reference. Each kind of mistake
// in a pull plan is caught: by the checks, or by a wrong output on the CPU executor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "comm/local_communicator.h"
#include "layers/cpu_linear.h"
#include "layers/linear_knobs.h"
#include "layers/linear_problem.h"
#include "layers/overlap_plan.h"
#include "tests/cuda_linear_test_modes.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;

LinearKnobs KnobsOf(const TunerMode& md) {
  LinearKnobs k;
  k.mode = md.mode;
  k.chunks = md.chunks;
  k.copy_engine = md.copy_engine;
  k.full_weight = md.full_weight;
  k.in_place = md.in_place;
  return k;
}

std::string Name(const TunerMode& md) {
  return std::string(OverlapOpName(md.op)) + " " + std::string(OverlapModeName(md.mode)) +
         " chunks=" + std::to_string(md.chunks) + (md.copy_engine ? " copy_engine" : "") +
         (md.full_weight ? " full_weight" : "") + (md.in_place ? " in_place" : "");
}

StatusOr<std::vector<OverlapPlan>> Plans(const TunerMode& md, int tp, int64_t m) {
  std::vector<OverlapPlan> plans;
  for (int r = 0; r < tp; ++r) {
    TP_ASSIGN_OR_RETURN(OverlapPlan p,
                        MakeOverlapPlan(LinearPlanRequest(md.op, KnobsOf(md), tp, r, m)));
    plans.push_back(std::move(p));
  }
  return plans;
}

// Every rank runs its plan on the CPU executor.
StatusOr<std::vector<std::vector<BFloat16>>> RunPlans(const LinearProblem& p,
                                                      const std::vector<OverlapPlan>& plans) {
  std::vector<std::vector<BFloat16>> y(p.tp);
  for (int r = 0; r < p.tp; ++r) y[r].assign(p.OutputElements(r), BFloat16{kPoisonBf16});
  TP_RETURN_IF_ERROR(RunOnLocalRanks(p.tp, [&](Communicator& c) -> Status {
    return RunCpuLinear(plans[c.rank()], c, p.ArgsFor(c.rank(), y[c.rank()].data()));
  }));
  return y;
}

bool UsesPulls(const OverlapPlan& p) {
  return std::any_of(p.steps.begin(), p.steps.end(), [](const PlanStep& s) {
    return s.kind == StepKind::kPullGather || s.kind == StepKind::kPullRing ||
           s.kind == StepKind::kPullReduce || s.kind == StepKind::kPullColumns;
  });
}

bool UsesCollectives(const OverlapPlan& p) {
  return std::any_of(p.steps.begin(), p.steps.end(), [](const PlanStep& s) {
    return s.kind == StepKind::kAllGather || s.kind == StepKind::kReduceScatter ||
           s.kind == StepKind::kSendRecv;
  });
}

TEST(PullPlans, EveryTunerScheduleValidatesAndMatchesTheReferenceOnTheCpuExecutor) {
  int cases = 0;
  for (const TunerMode& md : TunerModes()) {
    for (int tp : {2, 3, 4, 8}) {
      for (int64_t m : {1, 7, 37, 300}) {
        SCOPED_TRACE(Name(md) + " tp=" + std::to_string(tp) + " m=" + std::to_string(m));
        auto plans = Plans(md, tp, m);
        ASSERT_TRUE(plans.ok()) << plans.status().ToString();
        for (const OverlapPlan& p : *plans) {
          const Status s = ValidatePlan(p);
          ASSERT_TRUE(s.ok()) << s.ToString() << "\n" << DescribePlan(p);
          // A copy-engine layer's transfers are pulls, never collectives.
          EXPECT_EQ(UsesCollectives(p), !md.copy_engine) << DescribePlan(p);
          if (md.copy_engine) {
            EXPECT_TRUE(UsesPulls(p)) << DescribePlan(p);
          }
        }
        const Status g = ValidatePlanGroup(*plans);
        ASSERT_TRUE(g.ok()) << g.ToString();
        const bool ag = md.op == OverlapOp::kAllGatherGemm;
        const DataType dtype = (cases % 2 == 0) ? DataType::kFloat8E4M3 : DataType::kBFloat16;
        auto problem =
            MakeRandomLinearProblem(md.op, dtype, tp, m, ag ? 8 * tp : 24, ag ? 32 : 16 * tp,
                                    31 * tp + static_cast<uint64_t>(m) + cases);
        ASSERT_TRUE(problem.ok()) << problem.status().ToString();
        auto y = RunPlans(*problem, *plans);
        ASSERT_TRUE(y.ok()) << y.status().ToString();
        auto err = CompareWithReference(*problem, *y);
        ASSERT_TRUE(err.ok()) << err.status().ToString();
        EXPECT_EQ(err->unwritten, 0);
        if (ag) {
          EXPECT_EQ(err->differing, 0) << "max abs error " << err->max_abs;
        } else {
          EXPECT_LE(err->rel_frobenius, 1e-2);
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, static_cast<int>(TunerModes().size()) * 4 * 4);
}

// full_weight without a lead (none / pipeline) multiplies each row over the whole K in one dot
// product, as the reference does: bit-identical, so a wrong column block would show.
TEST(PullPlans, FullWeightWithoutALeadIsTheReferenceBitForBit) {
  for (OverlapMode mode : {OverlapMode::kNone, OverlapMode::kPipeline}) {
    const TunerMode md{OverlapOp::kGemmReduceScatter, mode, true,
                       mode == OverlapMode::kNone ? 1 : 3, /*full_weight=*/true};
    for (int tp : {2, 4}) {
      auto plans = Plans(md, tp, 50);
      ASSERT_TRUE(plans.ok());
      auto problem = MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, DataType::kFloat8E4M3,
                                             tp, 50, 24, 16 * tp, 5 + tp);
      ASSERT_TRUE(problem.ok());
      auto y = RunPlans(*problem, *plans);
      ASSERT_TRUE(y.ok()) << y.status().ToString();
      auto err = CompareWithReference(*problem, *y);
      ASSERT_TRUE(err.ok());
      EXPECT_EQ(err->differing, 0) << Name(md) << " tp=" << tp;
    }
  }
}

TEST(PullPlans, RequestsOutsideTheirLayersAreRefused) {
  auto code = [](PlanRequest q) { return MakeOverlapPlan(q).status(); };
  PlanRequest q{OverlapOp::kGemmReduceScatter, OverlapMode::kRing, 1, 0, 16, 1};
  q.copy_engine = true;  // nothing to transfer at tp 1
  EXPECT_THAT(code(q).message(), HasSubstr("copy_engine needs tp > 1"));
  q = {OverlapOp::kAllGatherGemm, OverlapMode::kRing, 2, 0, 16, 1};
  q.copy_engine = q.in_place = true;
  EXPECT_THAT(code(q).message(), HasSubstr("in_place is for gemm_rs ring"));
  q = {OverlapOp::kGemmReduceScatter, OverlapMode::kRing, 2, 0, 16, 1};
  q.full_weight = true;  // tp 2 without copy engines
  EXPECT_THAT(code(q).message(), HasSubstr("full_weight is for gemm_rs"));
  q.copy_engine = q.defer_last_sum = true;
  EXPECT_EQ(code(q).code(), StatusCode::kInvalidArgument);
}

OverlapPlan PlanOf(const TunerMode& md, int tp, int rank, int64_t m) {
  auto p = MakeOverlapPlan(LinearPlanRequest(md.op, KnobsOf(md), tp, rank, m));
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? *std::move(p) : OverlapPlan{};
}

int FirstOfKind(const OverlapPlan& p, StepKind kind) {
  for (size_t i = 0; i < p.steps.size(); ++i) {
    if (p.steps[i].kind == kind) return static_cast<int>(i);
  }
  return -1;
}

TEST(PullPlans, ValidatePlanCatchesEachKindOfSignallingMistake) {
  const OverlapOp ag = OverlapOp::kAllGatherGemm, rs = OverlapOp::kGemmReduceScatter;
  // A pull without waiting for the peer's `ready`.
  OverlapPlan p = PlanOf({ag, OverlapMode::kPipeline, true, 2}, 3, 1, 30);
  int i = FirstOfKind(p, StepKind::kPullGather);
  ASSERT_GE(i, 0);
  p.steps[i].ready_from.clear();
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("without waiting for it to be ready"));
  // A message awaited but never answered with a `done` (the peer would wait forever).
  p = PlanOf({ag, OverlapMode::kRing, true, 1}, 3, 1, 30);
  i = FirstOfKind(p, StepKind::kPullRing);
  p.steps[i].done_to.clear();
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("never sends the `done`"));
  // Messages numbered out of order (two messages on one signal slot).
  p = PlanOf({ag, OverlapMode::kPipeline, true, 2}, 2, 0, 30);
  for (PlanStep& s : p.steps) {
    for (PlanMessage& mm : s.ready_to) mm.msg = 0;
  }
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("out of order"));
  // A GEMM+RS partial offered before its GEMM computed it.
  p = PlanOf({rs, OverlapMode::kPipeline, true, 2}, 2, 0, 30);
  i = FirstOfKind(p, StepKind::kPullReduce);
  p.steps[i].deps.clear();
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("before they are there"));
  // A sum that leaves out a peer's partial.
  p = PlanOf({rs, OverlapMode::kNone, true, 1}, 3, 0, 30);
  i = FirstOfKind(p, StepKind::kPullReduce);
  p.steps[i].pulls.pop_back();
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("partials of 1 peers, not tp - 1"));
  // in_place: the GEMM that reads the running sum in the peer's memory, started before it is
  // there; and its `done` sent by the pull step instead (before the GEMM has read it).
  const TunerMode in_place{rs, OverlapMode::kRing, true, 1, false, true};
  p = PlanOf(in_place, 2, 0, 30);
  const int gemm = static_cast<int>(p.steps.size()) - 1;
  ASSERT_FALSE(p.steps[gemm].done_to.empty()) << DescribePlan(p);
  OverlapPlan early = p;
  early.steps[gemm].deps.clear();
  EXPECT_THAT(ValidatePlan(early).message(), HasSubstr("step " + std::to_string(gemm) + ":"));
  i = FirstOfKind(p, StepKind::kPullRing);
  p.steps[i].done_to = p.steps[gemm].done_to;
  p.steps[gemm].done_to.clear();
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("read in place, from a step other than"));
}

TEST(PullPlans, ValidatePlanCatchesFullWeightMistakes) {
  const OverlapOp rs = OverlapOp::kGemmReduceScatter;
  const TunerMode pipeline{rs, OverlapMode::kPipeline, true, 2, true};
  // A whole-K GEMM that does not wait for the peers' columns.
  OverlapPlan p = PlanOf(pipeline, 2, 0, 40);
  const int gemm = FirstOfKind(p, StepKind::kGemm);
  p.steps[gemm].deps.clear();
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("before that rank's columns are pulled"));
  // The `done`s sent before the second chunk's pulls (the peers could rewrite their input).
  p = PlanOf(pipeline, 2, 0, 40);
  std::vector<int> pulls;
  for (size_t i = 0; i < p.steps.size(); ++i) {
    if (p.steps[i].kind == StepKind::kPullColumns) pulls.push_back(static_cast<int>(i));
  }
  ASSERT_EQ(pulls.size(), 2u);
  std::swap(p.steps[pulls[0]].done_to, p.steps[pulls[1]].done_to);
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("after its `done`"));
  // The ring's lead: a block multiplied twice, and an add before the write it adds to.
  const TunerMode ring{rs, OverlapMode::kRing, true, 1, true};
  p = PlanOf(ring, 2, 1, 600);
  int add = -1;
  for (size_t i = 0; i < p.steps.size(); ++i) {
    if (p.steps[i].add_to_output) add = static_cast<int>(i);
  }
  ASSERT_GE(add, 0) << DescribePlan(p);
  OverlapPlan twice = p;
  twice.steps[add].k_blocks.push_back(1);
  EXPECT_THAT(ValidatePlan(twice).message(), HasSubstr("2 times, not once"));
  p.steps[add].deps.pop_back();  // no longer after the own block's GEMM
  EXPECT_THAT(ValidatePlan(p).message(), HasSubstr("before they are written"));
}

TEST(PullPlans, ValidatePlanGroupMatchesEveryMessageWithItsPeer) {
  auto plans = Plans({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, true, 2}, 3, 30);
  ASSERT_TRUE(plans.ok());
  ASSERT_TRUE(ValidatePlanGroup(*plans).ok());
  const int i = FirstOfKind((*plans)[2], StepKind::kPullGather);
  (*plans)[2].steps[i].ready_from[0].rows.end -= 1;
  EXPECT_THAT(ValidatePlanGroup(*plans).message(), HasSubstr("do not match what that rank awaits"));
}

// The CPU executor takes the data from the pulls: with one rank's first pulls emptied (its
// signals unchanged; ValidatePlan would refuse such a plan) its output is far off.
TEST(PullPlans, TheCpuExecutorComputesWithWhatWasPulled) {
  for (const TunerMode& md :
       {TunerMode{OverlapOp::kAllGatherGemm, OverlapMode::kRing, true, 1},
        TunerMode{OverlapOp::kGemmReduceScatter, OverlapMode::kPipeline, true, 2, true}}) {
    auto plans = Plans(md, 2, 40);
    ASSERT_TRUE(plans.ok());
    auto problem = MakeRandomLinearProblem(md.op, DataType::kBFloat16, 2, 40, 16, 32, 9);
    ASSERT_TRUE(problem.ok());
    auto good = RunPlans(*problem, *plans);
    ASSERT_TRUE(good.ok()) << good.status().ToString();
    auto good_err = CompareWithReference(*problem, *good);
    ASSERT_TRUE(good_err.ok());
    EXPECT_LE(good_err->rel_frobenius, 1e-2) << Name(md);
    // Rank 1 copies nothing from the first step that pulls; it still signals as before.
    for (PlanStep& s : (*plans)[1].steps) {
      if (!s.pulls.empty()) {
        for (PlanMessage& mm : s.pulls) mm.rows.end = mm.rows.begin;
        break;
      }
    }
    auto bad = RunPlans(*problem, *plans);
    ASSERT_TRUE(bad.ok()) << bad.status().ToString();
    auto bad_err = CompareWithReference(*problem, *bad);
    ASSERT_TRUE(bad_err.ok());
    EXPECT_GT(bad_err->rel_frobenius, 0.05) << Name(md);
  }
}

TEST(PullPlans, DescribeShowsTheMessages) {
  const OverlapPlan p =
      PlanOf({OverlapOp::kGemmReduceScatter, OverlapMode::kRing, true, 1, true}, 2, 0, 600);
  const std::string d = DescribePlan(p);
  EXPECT_THAT(d, HasSubstr("full_weight"));
  EXPECT_THAT(d, HasSubstr("pull_columns"));
  EXPECT_THAT(d, HasSubstr("ready_to 1#0[300,600)"));
  EXPECT_THAT(d, HasSubstr("pulls 1#0[0,128)"));
  EXPECT_THAT(d, HasSubstr("k_blocks 1 +out"));
}

}  // namespace
}  // namespace tpserve
