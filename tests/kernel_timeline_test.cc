#include "benchmarks/kernel_timeline.h"

#include <gtest/gtest.h>

#include <vector>

namespace tpserve {
namespace {

KernelRecord K(const char* label, uint64_t start_ns, uint64_t end_ns) {
  KernelRecord r;
  r.label = label;
  r.start_ns = start_ns;
  r.end_ns = end_ns;
  return r;
}

TEST(KernelTimelineTest, OverlappedKernelsAddOnlyWhatEndsBeyondTheFrontier) {
  // a runs 0-10 us; b starts inside a (a PDL launch) and ends at 14; c starts after a 2 us gap.
  const std::vector<KernelRecord> records = {K("c", 16000, 20000), K("a", 0, 10000),
                                             K("b", 3000, 14000)};
  const std::vector<KernelShare> s = StepShares(records, TimelineWindow{0, 100000});
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].label, "a");
  EXPECT_DOUBLE_EQ(s[0].exposed_us, 10.0);
  EXPECT_EQ(s[1].label, "b");
  EXPECT_DOUBLE_EQ(s[1].duration_us, 11.0);
  EXPECT_DOUBLE_EQ(s[1].exposed_us, 4.0);
  EXPECT_DOUBLE_EQ(s[1].idle_before_us, 0.0);
  EXPECT_EQ(s[2].label, "c");
  EXPECT_DOUBLE_EQ(s[2].idle_before_us, 2.0);
  EXPECT_DOUBLE_EQ(s[2].exposed_us, 4.0);
}

TEST(KernelTimelineTest, AKernelInsideAnEarlierOneAddsNothing) {
  const std::vector<KernelRecord> records = {K("long", 0, 10000), K("inside", 2000, 5000),
                                             K("after", 9000, 12000)};
  const std::vector<KernelShare> s = StepShares(records, TimelineWindow{0, 100000});
  ASSERT_EQ(s.size(), 3u);
  EXPECT_DOUBLE_EQ(s[1].exposed_us, 0.0);
  EXPECT_DOUBLE_EQ(s[2].exposed_us, 2.0);  // 10 to 12, not 9 to 12
}

TEST(KernelTimelineTest, WindowsSelectKernelsByStartAndTheSummaryTakesMediansOverSteps) {
  // Three steps of 100 us windows; "x" in every step, "y" only in the last two (first seen
  // in step 1), a kernel outside every window ignored.
  std::vector<KernelRecord> records = {K("x", 10000, 30000),     // step 0: x exposed 20
                                       K("x", 110000, 120000),   // step 1: x 10
                                       K("y", 125000, 135000),   //         y 10, idle 5
                                       K("x", 210000, 250000),   // step 2: x 40
                                       K("y", 240000, 260000),   //         y 10
                                       K("z", 400000, 410000)};  // no window
  const std::vector<TimelineWindow> w = {{0, 100000}, {100000, 200000}, {200000, 300000}};
  const TimelineSummary t = SummarizeTimeline(records, w);
  EXPECT_EQ(t.steps, 3);
  ASSERT_EQ(t.labels.size(), 2u);
  EXPECT_EQ(t.labels[0].label, "x");
  EXPECT_DOUBLE_EQ(t.labels[0].launches_per_step, 1.0);
  EXPECT_DOUBLE_EQ(t.labels[0].duration_us_median, 20.0);   // of 20, 10, 40
  EXPECT_DOUBLE_EQ(t.labels[0].exposed_us_per_step, 20.0);  // of 20, 10, 40
  EXPECT_EQ(t.labels[1].label, "y");
  EXPECT_DOUBLE_EQ(t.labels[1].launches_per_step, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(t.labels[1].exposed_us_per_step, 10.0);  // of 0, 10, 10
  EXPECT_DOUBLE_EQ(t.labels[1].idle_us_per_step, 0.0);      // of 0, 5, 0
  // Spans 20, 25, 50; idle 0, 5, 0.
  EXPECT_DOUBLE_EQ(t.span_us_median, 25.0);
  EXPECT_DOUBLE_EQ(t.idle_us_median, 0.0);
}

TEST(KernelTimelineTest, LabelsKeepTheKernelsNameAndTemplateArgumentsAndTheGrid) {
  EXPECT_EQ(ShortKernelLabel("void tpserve::(anonymous namespace)::SmallMGemmKernel<true, false>"
                             "(tpserve::(anonymous namespace)::SmallMArgs)",
                             384),
            "SmallMGemmKernel<true, false> grid 384");
  EXPECT_EQ(ShortKernelLabel("void foo(int, float*)", 1), "foo grid 1");
  // cuBLASLt's names are plain and long: cut to 57 characters and an ellipsis.
  EXPECT_EQ(
      ShortKernelLabel("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize64x128x128_warpgroup", 66),
      "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize64x128x1... grid 66");
}

}  // namespace
}  // namespace tpserve
