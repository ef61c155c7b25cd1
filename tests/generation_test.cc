// Generation on the CPU backend: the tiny model through CpuEngine::Step and
// the Generator (scheduler, paged KV cache, sampling), checked against the
// model recomputed from scratch and against itself under other batchings,
// TP sizes, step budgets and cache sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/generator.h"
#include "engine/model_weights.h"
#include "layers/fp8.h"
#include "tests/checkpoint_test_util.h"
#include "tests/generation_test_util.h"

namespace tpserve {
namespace {

using namespace std::chrono_literals;

struct GenSetup {
  int tp = 1;
  int64_t kv_blocks = 256;
  int64_t block_size = 16;
  int64_t max_step_tokens = 2048;
  KvCacheDtype kv_dtype = KvCacheDtype::kBFloat16;
};

std::shared_ptr<CpuEngine> StartEngine(const GenSetup& s) {
  CpuEngineOptions o;
  o.config = *ModelPreset("tiny");
  o.tp = s.tp;
  o.kv_blocks = s.kv_blocks;
  o.kv_block_size = s.block_size;
  o.kv_dtype = s.kv_dtype;
  auto e = CpuEngine::Start(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::shared_ptr<CpuEngine>(std::move(e).value()) : nullptr;
}

std::unique_ptr<Generator> StartGenerator(std::shared_ptr<Engine> engine, const GenSetup& s) {
  GeneratorOptions o;
  o.scheduler.max_step_tokens = s.max_step_tokens;
  auto g = Generator::Start(o, std::move(engine));
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  return g.ok() ? std::move(g).value() : nullptr;
}

using Outcome = GenerationOutcome;

std::vector<Outcome> Generate(Generator& g, const std::vector<std::vector<int32_t>>& prompts,
                              const GenerationParams& params) {
  return GenerateAll(g, prompts, params, 120s);
}

GenerationParams Greedy(int64_t n) {
  GenerationParams p;
  p.max_new_tokens = n;
  return p;
}

const std::vector<std::vector<int32_t>> kPrompts = {
    {1, 2, 3, 4, 5, 6, 7},
    {17},
    {900, 800, 700, 600, 500, 400, 300, 200, 100, 0, 11, 22, 33, 44, 55, 66, 77, 88, 99}};

// Greedy decoding by recomputing the whole sequence with Forward (no cache)
// at every position: the reference for the cached path. Returns the tokens
// and, per token, the gap between the two largest logits relative to the
// largest magnitude.
std::pair<std::vector<int32_t>, std::vector<double>> RecomputeGreedy(CpuEngine& e,
                                                                     std::vector<int32_t> seq,
                                                                     int64_t n) {
  std::vector<int32_t> out;
  std::vector<double> gaps;
  for (int64_t i = 0; i < n; ++i) {
    auto batch = PackSequences({seq}, 1024, 2048);
    EXPECT_TRUE(batch.ok());
    auto logits = e.Forward(*batch);
    EXPECT_TRUE(logits.ok()) << logits.status().ToString();
    if (!logits.ok()) break;
    std::vector<float> l = *logits;
    const int32_t t = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    std::vector<float> sorted = l;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    gaps.push_back((sorted[0] - sorted[1]) / std::max(std::abs(sorted[0]), 1e-6f));
    out.push_back(t);
    seq.push_back(t);
  }
  return {out, gaps};
}

// The cached path equals recomputation token for token, except after a
// near-tie (top-2 gap under 1 %) where the two may legitimately part.
TEST(Generation, GreedyEqualsRecomputingTheWholeSequence) {
  const GenSetup s;
  auto engine = StartEngine(s);
  ASSERT_NE(engine, nullptr);
  auto g = StartGenerator(engine, s);
  ASSERT_NE(g, nullptr);
  const auto got = Generate(*g, kPrompts, Greedy(10));
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    SCOPED_TRACE("prompt " + std::to_string(p));
    ASSERT_TRUE(got[p].error.ok()) << got[p].error.ToString();
    EXPECT_EQ(got[p].finish, FinishReason::kLength);
    const auto [want, gaps] = RecomputeGreedy(*engine, kPrompts[p], 10);
    ASSERT_EQ(got[p].tokens.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[p].tokens[i] != want[i]) {
        EXPECT_LT(gaps[i], 0.01) << "token " << i << " differs without a near-tie";
        break;
      }
    }
  }
}

TEST(Generation, GreedyTokensAgreeAcrossTpSizes) {
  std::vector<std::vector<int32_t>> ref;
  for (int tp : {1, 2, 4}) {
    SCOPED_TRACE("tp=" + std::to_string(tp));
    GenSetup s;
    s.tp = tp;
    auto g = StartGenerator(StartEngine(s), s);
    ASSERT_NE(g, nullptr);
    const auto got = Generate(*g, kPrompts, Greedy(8));
    std::vector<std::vector<int32_t>> tokens;
    for (const auto& o : got) tokens.push_back(o.tokens);
    if (ref.empty()) {
      ref = tokens;
    } else {
      EXPECT_EQ(tokens, ref);
    }
  }
}

// A prompt alone, among 63 others, with a step budget that splits prompts
// into chunks, and with a cache so small that sequences are preempted and
// recomputed: the same greedy tokens every time.
TEST(Generation, BatchingChunkingAndPreemptionDoNotChangeTheTokens) {
  const std::vector<int32_t> target = kPrompts[2];
  GenSetup alone_setup;
  auto alone_g = StartGenerator(StartEngine(alone_setup), alone_setup);
  ASSERT_NE(alone_g, nullptr);
  const auto alone = Generate(*alone_g, {target}, Greedy(6));
  ASSERT_TRUE(alone[0].error.ok());

  std::vector<std::vector<int32_t>> crowd;
  for (int i = 0; i < 64; ++i) {
    std::vector<int32_t> p;
    for (int j = 0; j <= i % 9; ++j) p.push_back((i * 37 + j * 11) % 1024);
    crowd.push_back(p);
  }
  crowd[17] = target;
  for (const GenSetup& s : {GenSetup{.max_step_tokens = 256},
                            GenSetup{.kv_blocks = 12, .block_size = 4, .max_step_tokens = 7}}) {
    SCOPED_TRACE("blocks=" + std::to_string(s.kv_blocks) +
                 " budget=" + std::to_string(s.max_step_tokens));
    auto g = StartGenerator(StartEngine(s), s);
    ASSERT_NE(g, nullptr);
    const auto got = Generate(*g, crowd, Greedy(6));
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].error.ok()) << i << ": " << got[i].error.ToString();
      EXPECT_EQ(got[i].tokens.size(), 6u) << i;
    }
    EXPECT_EQ(got[17].tokens, alone[0].tokens);
    const GeneratorStats st = g->stats();
    EXPECT_EQ(st.blocks_used, 0);
    EXPECT_EQ(st.finished, 64u);
    if (s.kv_blocks == 12) {
      EXPECT_GT(st.preemptions, 0u);
    }
  }
}

TEST(Generation, SeededSamplingRepeatsAndSeedsDiffer) {
  const GenSetup s;
  auto g = StartGenerator(StartEngine(s), s);
  ASSERT_NE(g, nullptr);
  GenerationParams p = Greedy(12);
  p.sampling.temperature = 1.5f;
  p.sampling.top_k = 50;
  p.sampling.top_p = 0.95f;
  p.return_log_probs = true;
  p.sampling.seed = 42;
  const auto a = Generate(*g, {kPrompts[0], kPrompts[0]}, p);
  EXPECT_EQ(a[0].tokens, a[1].tokens);
  EXPECT_EQ(a[0].log_probs.size(), 12u);
  for (float lp : a[0].log_probs) EXPECT_LE(lp, 0.0f);
  p.sampling.seed = 43;
  const auto b = Generate(*g, {kPrompts[0]}, p);
  EXPECT_NE(a[0].tokens, b[0].tokens);
}

TEST(Generation, EndIdAndStopWordsEndTheSequence) {
  const GenSetup s;
  auto g = StartGenerator(StartEngine(s), s);
  ASSERT_NE(g, nullptr);
  const auto free_run = Generate(*g, {kPrompts[0]}, Greedy(8))[0].tokens;
  ASSERT_EQ(free_run.size(), 8u);
  GenerationParams end = Greedy(8);
  end.end_id = free_run[3];
  const auto e = Generate(*g, {kPrompts[0]}, end)[0];
  EXPECT_EQ(e.finish, FinishReason::kEndId);
  const auto first = std::find(free_run.begin(), free_run.end(), free_run[3]);
  EXPECT_EQ(e.tokens, std::vector<int32_t>(free_run.begin(), first));
  GenerationParams stop = Greedy(8);
  stop.stop_words = {{free_run[4], free_run[5]}};
  const auto w = Generate(*g, {kPrompts[0]}, stop)[0];
  EXPECT_EQ(w.finish, FinishReason::kStopWords);
  EXPECT_EQ(w.tokens.back(), free_run[5]);
  EXPECT_LE(w.tokens.size(), 6u);
}

TEST(Generation, CancelFreesTheBlocksWithinAStep) {
  const GenSetup s;
  auto g = StartGenerator(StartEngine(s), s);
  ASSERT_NE(g, nullptr);
  std::promise<GenerationEvent> last;
  std::atomic<int> events{0};
  auto id = g->Submit(kPrompts[2], Greedy(1000), Generator::Clock::time_point::max(),
                      [&](GenerationEvent e) {
                        ++events;
                        if (e.last()) last.set_value(e);
                      });
  ASSERT_TRUE(id.ok());
  while (events.load() < 2) std::this_thread::sleep_for(1ms);
  EXPECT_GT(g->stats().blocks_used, 0);
  g->Cancel(*id);
  auto f = last.get_future();
  ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(f.get().finish, FinishReason::kCancelled);
  EXPECT_EQ(g->stats().blocks_used, 0);
  EXPECT_EQ(g->stats().cancelled, 1u);
}

TEST(Generation, DeadlineEndsARequestAndStopDrainsTheRest) {
  const GenSetup s;
  auto g = StartGenerator(StartEngine(s), s);
  ASSERT_NE(g, nullptr);
  std::promise<Status> late;
  ASSERT_TRUE(
      g->Submit(kPrompts[1], Greedy(1000), Generator::Clock::now() + 50ms, [&](GenerationEvent e) {
         if (e.last()) late.set_value(e.error);
       }).ok());
  std::promise<GenerationEvent> finished;
  ASSERT_TRUE(g->Submit(kPrompts[0], Greedy(5), Generator::Clock::time_point::max(),
                        [&](GenerationEvent e) {
                          if (e.last()) finished.set_value(e);
                        })
                  .ok());
  EXPECT_EQ(late.get_future().get().code(), StatusCode::kDeadlineExceeded);
  g->Stop(Generator::Clock::now() + 60s);  // the admitted request finishes
  EXPECT_EQ(finished.get_future().get().finish, FinishReason::kLength);
  auto refused = g->Submit(kPrompts[0], Greedy(1), Generator::Clock::time_point::max(),
                           [](GenerationEvent) {});
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
}

TEST(Generation, Fp8CacheStaysCloseToBf16) {
  // The logits of one step over an FP8 cache against a BF16 one: the cache's
  // rounding is all that differs.
  GenSetup bf16;
  GenSetup fp8;
  fp8.kv_dtype = KvCacheDtype::kFloat8E4M3;
  auto a = StartEngine(bf16), b = StartEngine(fp8);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  StepBatch step;
  step.ids = kPrompts[2];
  for (size_t i = 0; i < step.ids.size(); ++i) step.positions.push_back(static_cast<int32_t>(i));
  step.cu_seqlens = {0, static_cast<int32_t>(step.ids.size())};
  step.context_lens = {static_cast<int32_t>(step.ids.size())};
  step.max_blocks = 2;
  step.block_tables = {5, 9};
  step.sample = {1};
  step.sampling = {SamplingParams{}};
  step.sample_index = {0};
  auto ra = a->Step(step), rb = b->Step(step);
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  ASSERT_TRUE(rb.ok()) << rb.status().ToString();
  // Same greedy token; log-probabilities within a few percent.
  EXPECT_EQ(ra->tokens[0].token, rb->tokens[0].token);
  EXPECT_NEAR(ra->tokens[0].log_prob, rb->tokens[0].log_prob,
              0.05 * std::abs(ra->tokens[0].log_prob) + 1e-3);
}

TEST(KvCache, Fp8ScalesDivideOnWriteAndMultiplyOnRead) {
  // Layer 1 of an E4M3 cache with keys at scale 4 and values at 0.5; layer 0 at 1 (the default).
  KvCacheLayout L;
  L.layers = 2;
  L.num_blocks = 1;
  L.block_size = 1;
  L.kv_heads = 1;
  L.head_dim = 4;
  L.dtype = KvCacheDtype::kFloat8E4M3;
  CpuKvCache cache(L);
  ASSERT_TRUE(cache.SetScales(1, {4.0f, 0.5f}).ok());
  const std::vector<float> x{1000.0f, 3.3f, -0.01f, 200.0f};
  const int32_t position = 0, table = 0;
  for (int64_t layer = 0; layer < 2; ++layer) {
    cache.Write(layer, x.data(), x.data(), 1, &position, &table);
    for (int kv = 0; kv < 2; ++kv) {
      const float scale = layer == 0 ? 1.0f : kv == 0 ? 4.0f : 0.5f;
      for (int64_t d = 0; d < 4; ++d) {
        EXPECT_EQ(cache.Read(layer, kv, 0, 0, 0, d),
                  Fp8E4M3ToFloat(FloatToFp8E4M3(x[d] / scale)) * scale)
            << "layer " << layer << " kv " << kv << " d " << d;
      }
    }
  }
  // 1000 saturates to 448 at scale 1; at scale 4 it is the code of 250 (256) times 4.
  EXPECT_EQ(cache.Read(0, 0, 0, 0, 0, 0), 448.0f);
  EXPECT_EQ(cache.Read(1, 0, 0, 0, 0, 0), 1024.0f);
  // At scale 0.5, 200 is 400's code (saturation at 224).
  EXPECT_EQ(cache.Read(1, 1, 0, 0, 0, 3), Fp8E4M3ToFloat(FloatToFp8E4M3(400.0f)) * 0.5f);
  for (const float bad : {0.0f, -1.0f, std::nanf(""), INFINITY}) {
    const Status s = cache.SetScales(0, {1.0f, bad});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("layer 0: KV cache scale v is"), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(cache.SetScales(2, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.scales(0).v, 1.0f);  // the refused calls changed nothing
  // The start-up line says which scales a cache quantizes with.
  EXPECT_NE(KvScalesSummary(KvCacheDtype::kFloat8E4M3, {{}, {}}).find("at scale 1"),
            std::string::npos);
  EXPECT_NE(KvScalesSummary(KvCacheDtype::kFloat8E4M3, {{0.5f, 2.0f}, {0.25f, 3.0f}})
                .find("over 2 layers: k_scale 0.25 to 0.5, v_scale 2 to 3"),
            std::string::npos);
  EXPECT_NE(KvScalesSummary(KvCacheDtype::kBFloat16, {{0.5f, 2.0f}}).find("are not used"),
            std::string::npos);
  EXPECT_EQ(KvScalesSummary(KvCacheDtype::kBFloat16, {{}}), "bf16 cache: no scales");
  // A BF16 cache ignores them.
  L.dtype = KvCacheDtype::kBFloat16;
  CpuKvCache bf16(L);
  ASSERT_TRUE(bf16.SetScales(0, {4.0f, 4.0f}).ok());
  bf16.Write(0, x.data(), x.data(), 1, &position, &table);
  EXPECT_EQ(bf16.Read(0, 0, 0, 0, 0, 1), BFloat16ToFloat(FloatToBFloat16(3.3f)));
}

// A checkpoint's KV cache scales reach the engine's cache: scales of 2^-3 (the codes 8 times
// the values, the same relative rounding away from the subnormals and 448) keep the greedy
// tokens of the checkpoint without scales and their log-probs within 0.02 (they differ by up
// to 0.008: values below 2^-6 keep more bits), which they would not if the scale were applied
// on one way only (every key and value 8 times off: tokens differ and log-probs by 0.07 to
// 0.4, measured with the read's multiplication taken out); scales of 24 put
// the values among E4M3's few subnormal codes, which changes the tokens, which it would not if
// the cache ignored them. A BF16 cache ignores them: the tokens and log-probs bit for bit.
TEST(Generation, CheckpointKvScalesReachTheCache) {
  const std::string dir = ::testing::TempDir() + "/tpserve_gen_kv_scales";
  std::filesystem::remove_all(dir);
  const ModelConfig c = *ModelPreset("tiny");
  ASSERT_TRUE(WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir + "/plain").ok());
  auto scaled = [&](const std::string& name, float scale) {
    std::vector<ExtraTensor> t;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      t.push_back({HfLayerPrefix(l) + ".self_attn.k_scale", {scale}, {}});
      t.push_back({HfLayerPrefix(l) + ".self_attn.v_scale", {scale}, {}});
    }
    CopyWithExtraTensors(dir + "/plain", dir + "/" + name, t);
    return dir + "/" + name;
  };
  const std::string fine = scaled("fine", 0.125f), coarse = scaled("coarse", 24.0f);
  auto run = [&](const std::string& ckpt, KvCacheDtype kv) {
    GenSetup s;
    s.kv_dtype = kv;
    CpuEngineOptions o;
    o.config = c;
    o.checkpoint_dir = ckpt;
    o.kv_blocks = s.kv_blocks;
    o.kv_block_size = s.block_size;
    o.kv_dtype = kv;
    auto e = CpuEngine::Start(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    if (!e.ok()) return std::vector<Outcome>(kPrompts.size());
    auto g = StartGenerator(std::shared_ptr<CpuEngine>(std::move(e).value()), s);
    if (g == nullptr) return std::vector<Outcome>(kPrompts.size());
    GenerationParams p = Greedy(12);
    p.return_log_probs = true;
    return Generate(*g, kPrompts, p);
  };
  const auto plain = run(dir + "/plain", KvCacheDtype::kFloat8E4M3);
  const auto with_fine = run(fine, KvCacheDtype::kFloat8E4M3);
  const auto with_coarse = run(coarse, KvCacheDtype::kFloat8E4M3);
  size_t coarse_differs = 0;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    ASSERT_EQ(plain[i].tokens.size(), 12u) << plain[i].error.ToString();
    EXPECT_EQ(with_fine[i].tokens, plain[i].tokens) << "prompt " << i;
    ASSERT_EQ(with_fine[i].log_probs.size(), plain[i].log_probs.size());
    for (size_t t = 0; t < plain[i].log_probs.size(); ++t) {
      EXPECT_NEAR(with_fine[i].log_probs[t], plain[i].log_probs[t], 2e-2)
          << "prompt " << i << " token " << t;
    }
    coarse_differs += with_coarse[i].tokens != plain[i].tokens;
  }
  EXPECT_GT(coarse_differs, 0u) << "scales of 24 gave the unscaled tokens";
  const auto bf16 = run(dir + "/plain", KvCacheDtype::kBFloat16);
  const auto bf16_coarse = run(coarse, KvCacheDtype::kBFloat16);
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    EXPECT_EQ(bf16_coarse[i].tokens, bf16[i].tokens) << "prompt " << i;
    EXPECT_EQ(bf16_coarse[i].log_probs, bf16[i].log_probs) << "prompt " << i;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tpserve
