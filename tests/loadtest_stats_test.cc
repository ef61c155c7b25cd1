// tpserve-loadtest's pure pieces (benchmarks/loadtest_stats.h).
#include "benchmarks/loadtest_stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace tpserve::loadtest {
namespace {

TEST(LoadtestRangeTest, ExpandsStartEndStep) {
  EXPECT_EQ(ParseRange("4:64:20"), (std::vector<double>{4, 24, 44, 64}));
  EXPECT_EQ(ParseRange("5"), (std::vector<double>{5}));
  EXPECT_EQ(ParseRange("1:3"), (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(ParseRange("1:2:0.5"), (std::vector<double>{1, 1.5, 2}));
  // The end need not be on the grid: values stop at or below it.
  EXPECT_EQ(ParseRange("4:50:20"), (std::vector<double>{4, 24, 44}));
}

TEST(LoadtestRangeTest, RefusesMalformedRanges) {
  for (const std::string bad : {"", "0", "-1", "4:1", "1:2:0", "1:2:-1", "a", "1:b", "1:2:3:4",
                                "nan", "1:inf", "1e400", "2 "}) {
    EXPECT_FALSE(ParseRange(bad).has_value()) << "'" << bad << "'";
  }
}

TEST(LoadtestRangeTest, RefusesRangesLongerThanTheCap) {
  const auto most = ParseRange("1:" + std::to_string(kMaxRangeValues));
  ASSERT_TRUE(most.has_value());
  EXPECT_EQ(most->size(), kMaxRangeValues);
  EXPECT_FALSE(ParseRange("1:" + std::to_string(kMaxRangeValues + 1)).has_value());
  EXPECT_FALSE(ParseRange("0.5:10000:0.5").has_value());  // 20,000 values
}

TEST(LoadtestPercentileTest, NearestRank) {
  std::vector<double> ten;
  for (int i = 1; i <= 10; ++i) ten.push_back(i);
  EXPECT_EQ(NearestRankPercentile(ten, 50), 5);
  EXPECT_EQ(NearestRankPercentile(ten, 90), 9);
  EXPECT_EQ(NearestRankPercentile(ten, 95), 10);
  EXPECT_EQ(NearestRankPercentile(ten, 99), 10);
  EXPECT_EQ(NearestRankPercentile(ten, 100), 10);
  std::vector<double> many;
  for (int i = 1; i <= 200; ++i) many.push_back(i);
  EXPECT_EQ(NearestRankPercentile(many, 50), 100);
  EXPECT_EQ(NearestRankPercentile(many, 90), 180);
  EXPECT_EQ(NearestRankPercentile(many, 95), 190);
  EXPECT_EQ(NearestRankPercentile(many, 99), 198);
  EXPECT_EQ(NearestRankPercentile({7.5}, 50), 7.5);
  EXPECT_EQ(NearestRankPercentile({7.5}, 99), 7.5);
  EXPECT_TRUE(std::isnan(NearestRankPercentile({}, 50)));
}

TEST(LoadtestStableTest, JudgesTheLastThreeWindows) {
  EXPECT_EQ(Stable({}, 10), std::nullopt);
  EXPECT_EQ(Stable({100, 100}, 10), std::nullopt);  // fewer than 3 windows
  EXPECT_EQ(Stable({100, 100, 100}, 10), true);
  EXPECT_EQ(Stable({100, 91, 109}, 10), true);      // each within 10 % of the mean 100
  EXPECT_EQ(Stable({100, 89, 111}, 10), false);     // 11 % off
  EXPECT_EQ(Stable({1, 100, 100, 100}, 10), true);  // only the last 3 count
  EXPECT_EQ(Stable({100, 100, 100, 1}, 10), false);
  EXPECT_EQ(Stable({0, 0, 0}, 10), std::nullopt);  // nothing succeeded
  EXPECT_EQ(Stable({100, 100, 100}, 0), true);
}

}  // namespace
}  // namespace tpserve::loadtest
