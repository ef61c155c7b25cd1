// tpserve-loadtest's generation figures (benchmarks/loadtest_generate_stats.h): TTFT, TPOT,
// ITL, token rates and goodput, against hand-computed values.
#include "benchmarks/loadtest_generate_stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace tpserve::loadtest {
namespace {

// A streamed request: the first token at `ttft`, then one token per response `gap` apart.
GenSample Streamed(double ttft, double gap, int64_t tokens, int64_t prompt = 10) {
  GenSample s;
  s.ttft_ms = ttft;
  s.prompt_tokens = prompt;
  s.output_tokens = tokens;
  for (int64_t i = 1; i < tokens; ++i) s.itl_ms.push_back(gap);
  s.e2e_ms = ttft + gap * static_cast<double>(tokens - 1);
  return s;
}

TEST(LoadtestGenerateTest, TpotIsTheTimeAfterTheFirstTokenPerLaterToken) {
  EXPECT_DOUBLE_EQ(*Tpot(Streamed(100, 20, 11)), 20);  // (300 - 100) / 10
  GenSample s;
  s.ttft_ms = 50;
  s.e2e_ms = 250;
  s.output_tokens = 5;
  EXPECT_DOUBLE_EQ(*Tpot(s), 50);  // (250 - 50) / 4, whatever the response grouping
  s.output_tokens = 1;
  EXPECT_EQ(Tpot(s), std::nullopt);  // one token: no time between tokens
  s.output_tokens = 5;
  s.ttft_ms.reset();
  EXPECT_EQ(Tpot(s), std::nullopt);  // unary: TTFT unseen, so TPOT too (not e2e / tokens)
}

TEST(LoadtestGenerateTest, SummaryOfStreamedRequests) {
  // Two requests over 2 s: ttft 100 and 300 ms, ITL 10 and 30 ms, 5 and 3 tokens.
  const std::vector<GenSample> v = {Streamed(100, 10, 5, 7), Streamed(300, 30, 3, 9)};
  const GenSummary g = Summarize(v, 2.0, Slo{});
  EXPECT_EQ(g.requests, 2);
  EXPECT_EQ(g.output_tokens, 8);
  EXPECT_EQ(g.prompt_tokens, 16);
  EXPECT_DOUBLE_EQ(g.requests_per_sec, 1.0);
  EXPECT_DOUBLE_EQ(g.output_tokens_per_sec, 4.0);
  EXPECT_DOUBLE_EQ(g.total_tokens_per_sec, 12.0);
  EXPECT_TRUE(std::isnan(g.goodput_per_sec));  // no objectives: no goodput
  EXPECT_EQ(g.ttft_ms.count, 2u);
  EXPECT_DOUBLE_EQ(g.ttft_ms.mean, 200);
  EXPECT_DOUBLE_EQ(g.ttft_ms.p50, 100);
  EXPECT_DOUBLE_EQ(g.ttft_ms.p99, 300);
  EXPECT_DOUBLE_EQ(g.tpot_ms.mean, 20);  // per request: 10 and 30
  // ITL pools every gap: four of 10 ms and two of 30 ms.
  EXPECT_EQ(g.itl_ms.count, 6u);
  EXPECT_DOUBLE_EQ(g.itl_ms.mean, (4 * 10 + 2 * 30) / 6.0);
  EXPECT_DOUBLE_EQ(g.itl_ms.p50, 10);
  EXPECT_DOUBLE_EQ(g.itl_ms.p90, 30);
  EXPECT_DOUBLE_EQ(g.e2e_ms.p50, 140);  // 100 + 4 * 10
  EXPECT_DOUBLE_EQ(g.e2e_ms.p99, 360);  // 300 + 2 * 30
}

TEST(LoadtestGenerateTest, TpotAndItlDifferWhenResponsesCarrySeveralTokens) {
  // 9 tokens in 3 responses of 3 (at 100, 200, 300 ms): TPOT spreads the 200 ms over 8
  // tokens; ITL sees two 100 ms gaps between arrivals.
  GenSample s;
  s.ttft_ms = 100;
  s.e2e_ms = 300;
  s.output_tokens = 9;
  s.itl_ms = {100, 100};
  const GenSummary g = Summarize({s}, 1.0, Slo{});
  EXPECT_DOUBLE_EQ(g.tpot_ms.p50, 25);
  EXPECT_DOUBLE_EQ(g.itl_ms.p50, 100);
}

TEST(LoadtestGenerateTest, ClosedLoopThroughputIsClientsTimesTokensOverLatency) {
  // e2e 140 and 360 ms (mean 250), 8 tokens over 2 requests: 4 clients give 4 * 4 / 0.25 s.
  const std::vector<GenSample> v = {Streamed(100, 10, 5, 7), Streamed(300, 30, 3, 9)};
  const GenSummary g = Summarize(v, 2.0, Slo{});
  EXPECT_DOUBLE_EQ(ClosedLoopOutputTokensPerSec(g, 4), 64.0);
  EXPECT_DOUBLE_EQ(ClosedLoopOutputTokensPerSec(g, 1), 16.0);
  // The windowed rate does not depend on the clients; this one does, linearly.
  EXPECT_DOUBLE_EQ(g.output_tokens_per_sec, 4.0);
  EXPECT_TRUE(std::isnan(ClosedLoopOutputTokensPerSec(g, 0)));
  EXPECT_TRUE(std::isnan(ClosedLoopOutputTokensPerSec(Summarize({}, 2.0, Slo{}), 4)));
}

TEST(LoadtestGenerateTest, UnaryRequestsHaveNoTtftTpotOrItl) {
  GenSample s;
  s.e2e_ms = 500;
  s.prompt_tokens = 4;
  s.output_tokens = 16;
  const GenSummary g = Summarize({s, s}, 1.0, Slo{});
  EXPECT_EQ(g.ttft_ms.count, 0u);
  EXPECT_TRUE(std::isnan(g.ttft_ms.p50));  // null in the report, not the e2e latency
  EXPECT_TRUE(std::isnan(g.tpot_ms.mean));
  EXPECT_TRUE(std::isnan(g.itl_ms.p99));
  EXPECT_DOUBLE_EQ(g.e2e_ms.p50, 500);
  EXPECT_DOUBLE_EQ(g.output_tokens_per_sec, 32);
  EXPECT_DOUBLE_EQ(g.total_tokens_per_sec, 40);
}

TEST(LoadtestGenerateTest, GoodputCountsRequestsMeetingEveryObjective) {
  const std::vector<GenSample> v = {
      Streamed(100, 10, 5),   // meets both
      Streamed(300, 10, 5),   // TTFT too slow
      Streamed(100, 50, 5),   // TPOT too slow
      Streamed(200, 20, 5),   // exactly at both limits: meets them
      Streamed(150, 999, 1),  // one token: no TPOT, meets a TPOT objective
  };
  Slo both;
  both.ttft_ms = 200;
  both.tpot_ms = 20;
  GenSummary g = Summarize(v, 2.0, both);
  EXPECT_EQ(g.good_requests, 3);
  EXPECT_DOUBLE_EQ(g.goodput_per_sec, 1.5);
  Slo ttft_only;
  ttft_only.ttft_ms = 200;
  g = Summarize(v, 2.0, ttft_only);
  EXPECT_EQ(g.good_requests, 4);
  Slo tpot_only;
  tpot_only.tpot_ms = 20;
  g = Summarize(v, 2.0, tpot_only);
  EXPECT_EQ(g.good_requests, 4);
  // Nothing observed about the first token: a TTFT objective is missed, not assumed met.
  GenSample unary;
  unary.e2e_ms = 1;
  unary.output_tokens = 3;
  EXPECT_FALSE(MeetsSlo(unary, ttft_only));
  EXPECT_FALSE(MeetsSlo(unary, tpot_only));
  EXPECT_TRUE(MeetsSlo(unary, Slo{}));
}

TEST(LoadtestGenerateTest, EmptyStepsAndZeroSeconds) {
  GenSummary g = Summarize({}, 1.0, Slo{});
  EXPECT_EQ(g.requests, 0);
  EXPECT_DOUBLE_EQ(g.requests_per_sec, 0);
  EXPECT_TRUE(std::isnan(g.e2e_ms.p50));
  g = Summarize({Streamed(1, 1, 2)}, 0, Slo{});
  EXPECT_TRUE(std::isnan(g.output_tokens_per_sec));
}

TEST(LoadtestGenerateTest, OutputLen) {
  auto fixed = ParseOutputLen("128");
  ASSERT_TRUE(fixed.has_value());
  EXPECT_EQ(fixed->min, 128);
  EXPECT_EQ(fixed->max, 128);
  auto range = ParseOutputLen("16:1024");
  ASSERT_TRUE(range.has_value());
  EXPECT_EQ(range->min, 16);
  EXPECT_EQ(range->max, 1024);
  EXPECT_TRUE(ParseOutputLen(std::to_string(kMaxOutputLen)).has_value());
  for (const std::string& bad :
       std::vector<std::string>{"", "0", "-1", "1.5", "8:4", "1:2:3", "a", "1:", ":4", "nan",
                                std::to_string(kMaxOutputLen + 1), "1e400", " 4"}) {
    EXPECT_FALSE(ParseOutputLen(bad).has_value()) << "'" << bad << "'";
  }
}

TEST(LoadtestGenerateTest, StreamErrorCategory) {
  EXPECT_EQ(StreamErrorCategory("INVALID_ARGUMENT: input 'x' is unknown"), "INVALID_ARGUMENT");
  EXPECT_EQ(StreamErrorCategory("RESOURCE_EXHAUSTED: too many"), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StreamErrorCategory("something broke: badly"), "STREAM_ERROR");
  EXPECT_EQ(StreamErrorCategory("no colon"), "STREAM_ERROR");
  EXPECT_EQ(StreamErrorCategory(": empty"), "STREAM_ERROR");
}

}  // namespace
}  // namespace tpserve::loadtest
