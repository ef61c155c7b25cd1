// The pieces of generation that need no model: sampling, the block pool, the
// step batch checks and the scheduler's policy (driven with made-up tokens).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/sampling.h"
#include "engine/scheduler.h"
#include "engine/step_batch.h"

namespace tpserve {
namespace {

TEST(Sampling, GreedyTakesTheLowestIdAmongEqualMaxima) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  SamplingParams p;  // temperature 0
  EXPECT_EQ(SampleToken(logits, p, 0).token, 1);
  p.temperature = 5.0f;
  p.top_k = 1;  // top_k 1 is greedy whatever the temperature
  EXPECT_EQ(SampleToken(logits, p, 3).token, 1);
  // The log-probability is the model's: log_softmax of the raw logits.
  double sum = 0;
  for (float l : logits) sum += std::exp(l);
  EXPECT_NEAR(SampleToken(logits, p, 3).log_prob, 2.0 - std::log(sum), 1e-5);
}

TEST(Sampling, SeededDrawsRepeatAndFollowTheDistribution) {
  const std::vector<float> logits = {1.0f, 0.0f, 2.0f, -1.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1234;
  std::map<int32_t, int> counts;
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) {
    const int32_t t = SampleToken(logits, p, i).token;
    EXPECT_EQ(t, SampleToken(logits, p, i).token) << "draw " << i << " did not repeat";
    ++counts[t];
  }
  double z = 0;
  for (float l : logits) z += std::exp(l);
  for (int32_t t = 0; t < 4; ++t) {
    const double expected = std::exp(logits[t]) / z;
    EXPECT_NEAR(counts[t] / double(kDraws), expected, 0.015) << "token " << t;
  }
  // Another seed draws another sequence.
  SamplingParams q = p;
  q.seed = 99;
  int same = 0;
  for (int i = 0; i < 200; ++i)
    same += SampleToken(logits, p, i).token == SampleToken(logits, q, i).token;
  EXPECT_LT(same, 150);
}

TEST(Sampling, TopKAndTopPCutTheTail) {
  // Probabilities at temperature 1: about 0.64, 0.24, 0.09, 0.03.
  const std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  for (int i = 0; i < 2000; ++i) EXPECT_LT(SampleToken(logits, p, i).token, 2);
  p.top_k = 0;
  p.top_p = 0.5f;  // the first token alone reaches 0.5
  for (int i = 0; i < 500; ++i) EXPECT_EQ(SampleToken(logits, p, i).token, 0);
  p.top_p = 0.8f;  // 0.64 + 0.24 reaches 0.8: two tokens
  std::map<int32_t, int> counts;
  for (int i = 0; i < 2000; ++i) ++counts[SampleToken(logits, p, i).token];
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_GT(counts[1], 300);
}

TEST(Sampling, InvalidParametersNameTheInput) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_NE(ValidateSamplingParams(p).message().find("runtime_top_p"), std::string::npos);
  p.top_p = 1.5f;
  EXPECT_FALSE(ValidateSamplingParams(p).ok());
  p = {};
  p.top_k = -1;
  EXPECT_NE(ValidateSamplingParams(p).message().find("runtime_top_k"), std::string::npos);
  p = {};
  p.temperature = -0.5f;
  EXPECT_NE(ValidateSamplingParams(p).message().find("temperature"), std::string::npos);
  p.temperature = std::nanf("");
  EXPECT_FALSE(ValidateSamplingParams(p).ok());
}

TEST(BlockPool, AllocatesAllOrNothingAndReusesFreedBlocks) {
  BlockPool pool(4);
  std::vector<int32_t> a, b;
  ASSERT_TRUE(pool.Allocate(3, &a));
  EXPECT_EQ(a, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE(pool.Allocate(2, &b));
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(pool.free(), 1);
  pool.Release(&a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(pool.free(), 4);
  ASSERT_TRUE(pool.Allocate(4, &b));
  std::sort(b.begin(), b.end());
  EXPECT_EQ(b, (std::vector<int32_t>{0, 1, 2, 3}));
}

SchedulerOptions Options(int64_t blocks, int64_t block_size, int64_t budget) {
  SchedulerOptions o;
  o.num_blocks = blocks;
  o.block_size = block_size;
  o.max_step_tokens = budget;
  o.vocab = 100;
  o.max_positions = 1000;
  return o;
}

GenerationParams Params(int64_t max_new) {
  GenerationParams p;
  p.max_new_tokens = max_new;
  return p;
}

// Runs the scheduler to the end, answering each sampled sequence with the
// token (id * 7 + index) % 50 + 50, a function of the sequence and its output
// position only: what a batch-invariant engine gives.
std::map<uint64_t, std::vector<int32_t>> Drive(Scheduler& s, int max_steps,
                                               std::vector<StepBatch>* steps = nullptr) {
  std::map<uint64_t, std::vector<int32_t>> out;
  for (int i = 0; i < max_steps && !s.empty(); ++i) {
    StepBatch b = s.Schedule();
    EXPECT_GT(b.sequences(), 0) << "nothing schedulable at step " << i;
    if (b.sequences() == 0) break;
    EXPECT_TRUE(
        ValidateStepBatch(b, 100, 1000, s.options().num_blocks, s.options().block_size).ok());
    const std::vector<uint64_t> ids = s.scheduled_ids();
    EXPECT_EQ(static_cast<int64_t>(ids.size()), b.sequences());
    StepResult r;
    for (int64_t q = 0; q < b.sequences(); ++q) {
      if (b.sample[q] == 0) continue;
      r.tokens.push_back({static_cast<int32_t>((ids[q] * 7 + b.sample_index[q]) % 50 + 50), 0.0f});
    }
    if (steps != nullptr) steps->push_back(b);
    for (SequenceUpdate& u : s.Complete(r)) {
      for (int32_t t : u.new_tokens) out[u.id].push_back(t);
    }
  }
  EXPECT_TRUE(s.empty()) << "sequences left after " << max_steps << " steps";
  return out;
}

TEST(Scheduler, ChunkedPrefillKeepsTheStepBudget) {
  Scheduler s(Options(64, 4, 5));
  ASSERT_TRUE(s.Add(1, std::vector<int32_t>(12, 3), Params(3)).ok());
  ASSERT_TRUE(s.Add(2, {4, 4}, Params(2)).ok());
  std::vector<StepBatch> steps;
  const auto out = Drive(s, 100, &steps);
  for (const StepBatch& b : steps) EXPECT_LE(b.tokens(), 5);
  // 12 prompt tokens in chunks of at most 5: the first sample comes at step 3.
  ASSERT_GE(steps.size(), 3u);
  EXPECT_EQ(steps[0].sample[0], 0);
  EXPECT_EQ(out.at(1).size(), 3u);
  EXPECT_EQ(out.at(2).size(), 2u);
  EXPECT_EQ(s.blocks_used(), 0);
}

TEST(Scheduler, PreemptsTheNewestWhenThePoolRunsOutAndLosesNothing) {
  // 8 blocks of 2 tokens; four sequences of 3 prompt tokens and 5 new each
  // need 4 blocks apiece at the end: they cannot all run at once.
  auto run = [](int64_t blocks) {
    Scheduler s(Options(blocks, 2, 64));
    for (uint64_t id = 1; id <= 4; ++id) {
      EXPECT_TRUE(s.Add(id, {static_cast<int32_t>(id), 1, 2}, Params(5)).ok());
    }
    auto out = Drive(s, 500);
    return std::make_pair(out, s.preemptions());
  };
  const auto [tight, preempted] = run(8);
  const auto [roomy, none] = run(64);
  EXPECT_GT(preempted, 0u);
  EXPECT_EQ(none, 0u);
  EXPECT_EQ(tight, roomy);  // every sequence completes with the same tokens
  for (const auto& [id, tokens] : tight) EXPECT_EQ(tokens.size(), 5u) << id;
}

TEST(Scheduler, StopsAtEndIdAndStopWords) {
  Scheduler s(Options(64, 4, 64));
  // Sequence 1 gets 57, 58, 59, ...; sequence 2 gets 64, 65, 66, ...
  GenerationParams end = Params(10);
  end.end_id = 59;
  ASSERT_TRUE(s.Add(1, {1}, end).ok());
  GenerationParams stop = Params(10);
  stop.stop_words = {{65, 66}, {99}};
  ASSERT_TRUE(s.Add(2, {1, 5}, stop).ok());
  const auto out = Drive(s, 100);
  EXPECT_EQ(out.at(1), (std::vector<int32_t>{57, 58}));      // end_id not included
  EXPECT_EQ(out.at(2), (std::vector<int32_t>{64, 65, 66}));  // the stop word is
}

TEST(Scheduler, RefusesWhatCanNeverRunNamingTheInput) {
  Scheduler s(Options(4, 4, 64));  // 16 tokens in the whole cache
  auto msg = [&](std::vector<int32_t> prompt, GenerationParams p) {
    return s.Add(1, std::move(prompt), std::move(p)).message();
  };
  EXPECT_NE(msg({1, 2}, Params(20)).find("KV cache"), std::string::npos);
  EXPECT_NE(msg({}, Params(1)).find("input_ids"), std::string::npos);
  EXPECT_NE(msg({100}, Params(1)).find("input_ids[0]"), std::string::npos);
  EXPECT_NE(msg({1}, Params(0)).find("request_output_len"), std::string::npos);
  GenerationParams p = Params(1);
  p.end_id = 100;
  EXPECT_NE(msg({1}, p).find("end_id"), std::string::npos);
  p = Params(1);
  p.stop_words = {{}};
  EXPECT_NE(msg({1}, p).find("stop_words_list"), std::string::npos);
  EXPECT_TRUE(s.empty());
}

TEST(Scheduler, RemoveFreesTheBlocks) {
  Scheduler s(Options(16, 4, 64));
  ASSERT_TRUE(s.Add(1, std::vector<int32_t>(9, 1), Params(4)).ok());
  StepBatch b = s.Schedule();
  ASSERT_EQ(b.sequences(), 1);
  StepResult r;
  r.tokens.push_back({5, 0.0f});
  s.Complete(r);
  EXPECT_EQ(s.blocks_used(), 3);
  EXPECT_TRUE(s.Remove(1));
  EXPECT_EQ(s.blocks_used(), 0);
  EXPECT_FALSE(s.Remove(1));
}

TEST(StepBatch, ValidationNamesWhatIsWrong) {
  StepBatch b;
  b.ids = {1, 2};
  b.positions = {3, 4};
  b.cu_seqlens = {0, 2};
  b.context_lens = {5};
  b.max_blocks = 2;
  b.block_tables = {0, 1};
  b.sample = {1};
  b.sampling = {SamplingParams{}};
  b.sample_index = {0};
  EXPECT_TRUE(ValidateStepBatch(b, 10, 100, 4, 4).ok());
  b.positions[1] = 7;
  EXPECT_NE(ValidateStepBatch(b, 10, 100, 4, 4).message().find("position"), std::string::npos);
  b.positions[1] = 4;
  b.block_tables[1] = 9;
  EXPECT_NE(ValidateStepBatch(b, 10, 100, 4, 4).message().find("block"), std::string::npos);
}

}  // namespace
}  // namespace tpserve
