#include "layers/overlap_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tpserve {
namespace {

using ::testing::HasSubstr;

StatusOr<std::vector<OverlapPlan>> GroupPlans(OverlapOp op, OverlapMode mode, int tp, int64_t m,
                                              int chunks) {
  std::vector<OverlapPlan> plans;
  for (int r = 0; r < tp; ++r) {
    TP_ASSIGN_OR_RETURN(OverlapPlan p, MakeOverlapPlan({op, mode, tp, r, m, chunks}));
    plans.push_back(std::move(p));
  }
  return plans;
}

TEST(RowSplit, ShardsAreBalancedContiguousAndCoverAllRows) {
  for (int64_t m : {1, 7, 37, 1002, 4099}) {
    for (int tp : {1, 2, 3, 4, 8}) {
      int64_t next = 0;
      for (int r = 0; r < tp; ++r) {
        RowRange s = ShardRows(m, tp, r);
        EXPECT_EQ(s.begin, next);
        EXPECT_TRUE(s.size() == m / tp || s.size() == m / tp + 1);
        // The larger shards come first.
        EXPECT_EQ(s.size(), m / tp + (r < m % tp ? 1 : 0));
        next = s.end;
      }
      EXPECT_EQ(next, m);
    }
  }
}

TEST(RowSplit, ChunksOfAShardCoverItInOrder) {
  const RowRange shard{10, 47};
  for (int chunks = 1; chunks <= 8; ++chunks) {
    int64_t next = shard.begin;
    for (int c = 0; c < chunks; ++c) {
      RowRange r = ChunkRows(shard, chunks, c);
      EXPECT_EQ(r.begin, next);
      next = r.end;
    }
    EXPECT_EQ(next, shard.end);
  }
  EXPECT_TRUE(ChunkRows({5, 7}, 4, 3).empty());  // 2 rows, 4 chunks: last ones empty
}

TEST(OverlapPlan, RejectsBadRequestsNamingTheField) {
  auto err = [](PlanRequest q) { return MakeOverlapPlan(q).status(); };
  EXPECT_THAT(err({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 0, 0, 8, 1}).message(),
              HasSubstr("tp must be"));
  EXPECT_THAT(err({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 2, 8, 1}).message(),
              HasSubstr("rank must be"));
  EXPECT_THAT(err({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 0, 1}).message(),
              HasSubstr("m (rows) must be"));
  EXPECT_THAT(err({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 8, 0}).message(),
              HasSubstr("chunks must be"));
  EXPECT_THAT(err({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 8, 65}).message(),
              HasSubstr("chunks must be"));
  EXPECT_THAT(err({OverlapOp::kGemmReduceScatter, OverlapMode::kNone, 2, 0, 8, 2}).message(),
              HasSubstr("mode none takes chunks = 1"));
  EXPECT_EQ(err({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 8, 0}).code(),
            StatusCode::kInvalidArgument);
}

TEST(OverlapPlan, ParsesNamesAndRejectsAuto) {
  EXPECT_EQ(*ParseOverlapMode("ring"), OverlapMode::kRing);
  EXPECT_EQ(*ParseOverlapOp("gemm_rs"), OverlapOp::kGemmReduceScatter);
  EXPECT_THAT(ParseOverlapMode("auto").status().message(), HasSubstr("resolved by the overlap"));
  EXPECT_THAT(ParseOverlapMode("fast").status().message(), HasSubstr("allowed: none"));
  EXPECT_FALSE(ParseOverlapOp("gemm").ok());
  for (auto m : {OverlapMode::kNone, OverlapMode::kPipeline, OverlapMode::kRing}) {
    EXPECT_EQ(*ParseOverlapMode(OverlapModeName(m)), m);
  }
}

TEST(OverlapPlan, NoneIsOneCollectiveAndOneGemm) {
  auto ag = MakeOverlapPlan({OverlapOp::kAllGatherGemm, OverlapMode::kNone, 4, 1, 100, 1});
  ASSERT_TRUE(ag.ok());
  ASSERT_EQ(ag->steps.size(), 2u);
  EXPECT_EQ(ag->steps[0].kind, StepKind::kAllGather);
  EXPECT_EQ(ag->steps[1].kind, StepKind::kGemm);
  EXPECT_EQ(ag->steps[1].deps, std::vector<int>{0});
  EXPECT_EQ(ag->max_step_rows, 25);

  auto rs = MakeOverlapPlan({OverlapOp::kGemmReduceScatter, OverlapMode::kNone, 4, 1, 100, 1});
  ASSERT_TRUE(rs.ok());
  ASSERT_EQ(rs->steps.size(), 2u);
  EXPECT_EQ(rs->steps[0].kind, StepKind::kGemm);
  EXPECT_EQ(rs->steps[1].kind, StepKind::kReduceScatter);
  EXPECT_EQ(rs->steps[1].rows[1], (RowRange{25, 50}));
}

TEST(OverlapPlan, PipelineAlternatesCommAndGemmPerChunk) {
  auto p = MakeOverlapPlan({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 16, 4});
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->steps.size(), 8u);
  for (int c = 0; c < 4; ++c) {
    const PlanStep& comm = p->steps[2 * c];
    const PlanStep& gemm = p->steps[2 * c + 1];
    EXPECT_EQ(comm.kind, StepKind::kAllGather);
    EXPECT_EQ(comm.stream, StepStream::kComm);
    EXPECT_EQ(comm.rows[0], (RowRange{2 * c, 2 * c + 2}));
    EXPECT_EQ(comm.rows[1], (RowRange{8 + 2 * c, 8 + 2 * c + 2}));
    EXPECT_EQ(gemm.stream, StepStream::kCompute);
    EXPECT_EQ(gemm.deps, std::vector<int>{2 * c});
    EXPECT_EQ(gemm.rows.size(), 2u);
  }
}

TEST(OverlapPlan, RingAllGatherPassesShardsToTheNextRank) {
  auto p = MakeOverlapPlan({OverlapOp::kAllGatherGemm, OverlapMode::kRing, 4, 1, 40, 1});
  ASSERT_TRUE(p.ok());
  // k=0: send own shard 1 to rank 2, receive shard 0 from rank 0; gemm on shard 1.
  ASSERT_EQ(p->steps[0].kind, StepKind::kSendRecv);
  EXPECT_EQ(p->steps[0].send_peer, 2);
  EXPECT_EQ(p->steps[0].recv_peer, 0);
  EXPECT_EQ(p->steps[0].send_rows, (RowRange{10, 20}));
  EXPECT_EQ(p->steps[0].recv_rows, (RowRange{0, 10}));
  EXPECT_EQ(p->steps[1].kind, StepKind::kGemm);
  EXPECT_EQ(p->steps[1].rows[0], (RowRange{10, 20}));
  EXPECT_TRUE(p->steps[1].deps.empty());
  // k=1: gemm on shard 0 waits for its arrival.
  EXPECT_EQ(p->steps[3].rows[0], (RowRange{0, 10}));
  EXPECT_EQ(p->steps[3].deps, std::vector<int>{0});
  // Last ring step sends nothing: 3 exchanges and 4 gemms in all.
  EXPECT_EQ(p->steps.size(), 7u);
}

TEST(OverlapPlan, RingReduceScatterEndsOnOwnShard) {
  auto p = MakeOverlapPlan({OverlapOp::kGemmReduceScatter, OverlapMode::kRing, 3, 0, 30, 1});
  ASSERT_TRUE(p.ok());
  const PlanStep& first = p->steps.front();
  EXPECT_EQ(first.kind, StepKind::kGemm);
  EXPECT_FALSE(first.accumulate);
  EXPECT_EQ(first.rows[0], (RowRange{10, 20}));  // shard of rank 1 first
  const PlanStep& last = p->steps.back();
  EXPECT_EQ(last.kind, StepKind::kGemm);
  EXPECT_TRUE(last.accumulate);
  EXPECT_TRUE(last.final_output);
  EXPECT_EQ(last.rows[0], (RowRange{0, 10}));
  EXPECT_EQ(p->steps[1].send_peer, 2);  // partial sums travel to rank - 1
  EXPECT_EQ(p->steps[1].recv_peer, 1);
}

TEST(OverlapPlan, EmptyStepsAreLeftOutIdenticallyOnAllRanks) {
  // M=1 over 8 ranks in 4 chunks: one row, so one collective and one gemm.
  auto plans = GroupPlans(OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 8, 1, 4);
  ASSERT_TRUE(plans.ok());
  for (const OverlapPlan& p : *plans) {
    ASSERT_EQ(p.steps.size(), 2u);
    EXPECT_EQ(p.steps[0].rows[0], (RowRange{0, 1}));
    EXPECT_TRUE(p.steps[0].rows[5].empty());
  }
  EXPECT_TRUE(ValidatePlanGroup(*plans).ok());
}

TEST(OverlapPlan, TpOneNeedsNoCommunication) {
  for (auto op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
    for (auto mode : {OverlapMode::kPipeline, OverlapMode::kRing}) {
      auto p = MakeOverlapPlan({op, mode, 1, 0, 37, 3});
      ASSERT_TRUE(p.ok());
      EXPECT_EQ(p->steps.size(), 3u);
      for (const PlanStep& s : p->steps) EXPECT_EQ(s.kind, StepKind::kGemm);
    }
  }
}

// The property the executors rely on, over the whole grid the issue asks for.
TEST(OverlapPlan, EveryPlanCoversEveryRowOnceAndMatchesAcrossRanks) {
  int checked = 0;
  for (auto op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
    for (auto mode : {OverlapMode::kNone, OverlapMode::kPipeline, OverlapMode::kRing}) {
      for (int tp : {1, 2, 3, 4, 8}) {
        for (int64_t m : {1, 2, 7, 37, 1002, 4099}) {
          for (int chunks = 1; chunks <= 8; ++chunks) {
            if (mode == OverlapMode::kNone && chunks > 1) continue;
            auto plans = GroupPlans(op, mode, tp, m, chunks);
            ASSERT_TRUE(plans.ok()) << plans.status().ToString();
            for (const OverlapPlan& p : *plans) {
              Status s = ValidatePlan(p);
              ASSERT_TRUE(s.ok()) << s.ToString();
            }
            Status g = ValidatePlanGroup(*plans);
            ASSERT_TRUE(g.ok()) << g.ToString();
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 5 * 6 * (1 + 8 + 8));
}

TEST(ValidatePlan, CatchesARowComputedTwice) {
  auto p = MakeOverlapPlan({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 16, 2});
  ASSERT_TRUE(p.ok());
  p->steps.push_back(p->steps.back());
  EXPECT_THAT(ValidatePlan(*p).message(), HasSubstr("computed 2 times"));
}

TEST(ValidatePlan, CatchesAGemmThatDoesNotWaitForItsRows) {
  auto p = MakeOverlapPlan({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 16, 2});
  ASSERT_TRUE(p.ok());
  p->steps[1].deps.clear();
  EXPECT_THAT(ValidatePlan(*p).message(), HasSubstr("before they are gathered"));
}

TEST(ValidatePlan, CatchesAReduceBeforeItsPartial) {
  auto p = MakeOverlapPlan({OverlapOp::kGemmReduceScatter, OverlapMode::kPipeline, 2, 0, 16, 2});
  ASSERT_TRUE(p.ok());
  p->steps[1].deps.clear();
  EXPECT_THAT(ValidatePlan(*p).message(), HasSubstr("not computed before"));
}

TEST(ValidatePlan, CatchesAForwardDependency) {
  auto p = MakeOverlapPlan({OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 0, 16, 2});
  ASSERT_TRUE(p.ok());
  p->steps[0].deps = {3};
  EXPECT_THAT(ValidatePlan(*p).message(), HasSubstr("does not point to an earlier step"));
}

TEST(ValidatePlan, CatchesAMissingFinalRow) {
  auto p = MakeOverlapPlan({OverlapOp::kGemmReduceScatter, OverlapMode::kRing, 2, 0, 16, 1});
  ASSERT_TRUE(p.ok());
  p->steps.back().final_output = false;
  EXPECT_THAT(ValidatePlan(*p).message(), HasSubstr("written 0 times"));
}

TEST(ValidatePlanGroup, CatchesMismatchedCollectivesAndMessages) {
  auto plans = GroupPlans(OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 2, 16, 2);
  ASSERT_TRUE(plans.ok());
  (*plans)[1].steps[0].rows[0].end -= 1;
  EXPECT_THAT(ValidatePlanGroup(*plans).message(), HasSubstr("differs from rank 0"));

  auto ring = GroupPlans(OverlapOp::kAllGatherGemm, OverlapMode::kRing, 3, 30, 1);
  ASSERT_TRUE(ring.ok());
  (*ring)[2].steps[0].recv_rows.begin += 1;
  EXPECT_THAT(ValidatePlanGroup(*ring).message(), HasSubstr("do not match"));
}

TEST(OverlapPlan, DescribeListsEveryStep) {
  auto p = MakeOverlapPlan({OverlapOp::kGemmReduceScatter, OverlapMode::kRing, 2, 0, 8, 2});
  ASSERT_TRUE(p.ok());
  const std::string d = DescribePlan(*p);
  EXPECT_THAT(d, HasSubstr("gemm_rs mode=ring tp=2 rank=0 m=8 chunks=2"));
  EXPECT_THAT(d, HasSubstr("sendrecv"));
  EXPECT_THAT(d, HasSubstr("final"));
  EXPECT_EQ(std::count(d.begin(), d.end(), '\n'), 1 + static_cast<long>(p->steps.size()));
}

}  // namespace
}  // namespace tpserve
