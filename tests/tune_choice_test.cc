#include "benchmarks/tune_choice.h"

#include <gtest/gtest.h>

#include <vector>

namespace tpserve {
namespace {

TuneCandidate Candidate(const char* method, OverlapMode mode, int chunks, bool copy_engine,
                        double sweep_ms, double final_ms = 0) {
  TuneCandidate c;
  c.method = method;
  c.knobs.mode = mode;
  c.knobs.chunks = chunks;
  c.knobs.copy_engine = copy_engine;
  c.sweep_ms = sweep_ms;
  c.final_ms = final_ms;
  return c;
}

TEST(TuneChoiceTest, WithoutFinalsTheSweepsFastestWinsWhenItBeatsNoneByOnePercent) {
  const std::vector<TuneCandidate> c = {
      Candidate("none", OverlapMode::kNone, 1, false, 1.00),
      Candidate("ring", OverlapMode::kRing, 2, true, 0.80),
      Candidate("pipeline", OverlapMode::kPipeline, 4, false, 0.85),
      // Not layer methods: never chosen, however fast.
      Candidate("gemm_only", OverlapMode::kNone, 1, false, 0.10),
      Candidate("layer_gemm", OverlapMode::kRing, 2, true, 0.20),
  };
  const auto got = ChooseTuned(c);
  ASSERT_TRUE(got.has_value());
  EXPECT_FALSE(got->from_finals);
  EXPECT_EQ(got->knobs.mode, OverlapMode::kRing);
  EXPECT_EQ(got->knobs.chunks, 2);
  EXPECT_TRUE(got->knobs.copy_engine);
  EXPECT_DOUBLE_EQ(got->best_ms, 0.80);
  EXPECT_DOUBLE_EQ(got->none_ms, 1.00);
}

TEST(TuneChoiceTest, AMethodWithinOnePercentOfNoneLosesToNone) {
  TuneCandidate none = Candidate("none", OverlapMode::kNone, 1, false, 1.000);
  none.knobs.fast_accum = true;  // plain none's own knobs are kept
  const std::vector<TuneCandidate> c = {none,
                                        Candidate("ring", OverlapMode::kRing, 1, true, 0.995)};
  const auto got = ChooseTuned(c);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->knobs.mode, OverlapMode::kNone);
  EXPECT_FALSE(got->knobs.copy_engine);
  EXPECT_TRUE(got->knobs.fast_accum);
  EXPECT_DOUBLE_EQ(got->best_ms, 1.000);
}

TEST(TuneChoiceTest, FinalistsCompeteOnTheirSecondRoundOnly) {
  const std::vector<TuneCandidate> c = {
      Candidate("none", OverlapMode::kNone, 1, false, 0.0750, 0.0680),
      // Fastest in the sweep but slower among the finalists.
      Candidate("ring", OverlapMode::kRing, 1, true, 0.0680, 0.0660),
      Candidate("none", OverlapMode::kNone, 1, true, 0.0682, 0.0600),
      // Not a finalist: its sweep time does not count once there are finals.
      Candidate("pipeline", OverlapMode::kPipeline, 2, true, 0.0500, 0),
  };
  const auto got = ChooseTuned(c);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(got->from_finals);
  EXPECT_EQ(got->knobs.mode, OverlapMode::kNone);
  EXPECT_TRUE(got->knobs.copy_engine);  // none over peer memory is a method, not the reference
  EXPECT_DOUBLE_EQ(got->best_ms, 0.0600);
  EXPECT_DOUBLE_EQ(got->none_ms, 0.0680);
}

TEST(TuneChoiceTest, WithoutPlainNoneTheFastestWinsOutright) {
  const std::vector<TuneCandidate> c = {Candidate("ring", OverlapMode::kRing, 4, false, 0.50),
                                        Candidate("ring", OverlapMode::kRing, 2, false, 0.49)};
  const auto got = ChooseTuned(c);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->knobs.chunks, 2);
  EXPECT_DOUBLE_EQ(got->none_ms, 0.0);
}

TEST(TuneChoiceTest, NothingMeasuredIsNoChoice) {
  EXPECT_FALSE(ChooseTuned({}).has_value());
  EXPECT_FALSE(ChooseTuned({Candidate("ring", OverlapMode::kRing, 2, false, 0.0)}).has_value());
  EXPECT_FALSE(
      ChooseTuned({Candidate("comm_only", OverlapMode::kNone, 1, false, 0.3)}).has_value());
}

}  // namespace
}  // namespace tpserve
