// benchmarks/accuracy_eval.h (tpserve-accuracy's library) on the transformers-made Llama-3.1-style
// checkpoint tests/data/hf/llama31 (hidden 128, 2 layers, GQA 4/2, llama3 RoPE, BF16 weights).
//
// What the numbers look like there (4 random prompts of 64 tokens): every FP8 scheme lands at a
// mean KL of about 5e-2 from BF16 and the three differ only by rounding noise (a few percent,
// either way): the fixture's random-normal weights and its activations have no outliers, and
// E4M3 spans 2^17, so one scale per tensor loses nothing to finer scales there. The ordering
// test therefore gives the model outlier channels of 2^14 that leave its BF16 logits unchanged
// bit for bit (AddOutlierChannels, checked below): per tensor then doubles its KL while
// per-channel and block stay near the plain model's.
#include "benchmarks/accuracy_eval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/local_communicator.h"
#include "engine/cpu_model.h"
#include "engine/kv_calibration.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"

namespace tpserve {
namespace {

std::string Fixture() { return std::string(TPSERVE_SOURCE_DIR) + "/tests/data/hf/llama31"; }

constexpr int kOutlierExponent = 14;

struct Model {
  ModelConfig config;
  RankWeights bf16;
};

Model LoadFixture() {
  Model m;
  auto config = LoadModelConfig(Fixture());
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  if (!config.ok()) return m;
  m.config = *config;
  auto w = LoadRankWeights(Fixture(), m.config, 1, 0, DataType::kBFloat16);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  if (w.ok()) m.bf16 = *std::move(w);
  return m;
}

Prompts TestPrompts(const ModelConfig& c) { return DefaultPrompts(4, 64, c.vocab_size, 1); }

TEST(AccuracyEval, CompareLogitsByHand) {
  // Position 0: ref (0, ln 3) -> P = (1/4, 3/4); test (0, 0) -> Q = (1/2, 1/2).
  // KL = 1/4 ln(1/2) + 3/4 ln(3/2). Position 1 equal: KL 0, same top-1.
  const std::vector<float> ref = {0.0f, std::log(3.0f), 1.0f, 2.0f};
  const std::vector<float> test = {0.0f, 0.0f, 1.0f, 2.0f};
  auto d = CompareLogits(ref, test, 2);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const double kl0 = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  EXPECT_NEAR(d->max_kl, kl0, 1e-7);
  EXPECT_EQ(d->max_kl_position, 0);
  EXPECT_NEAR(d->mean_kl, kl0 / 2, 1e-7);
  // Position 0's top-1 is index 1 in ref, index 0 (first of a tie) in test.
  EXPECT_EQ(d->top1_agree, 1);
  EXPECT_DOUBLE_EQ(d->top1_agreement, 0.5);
  const double ln3 = std::log(3.0f);
  EXPECT_NEAR(d->rel_err, ln3 / std::sqrt(ln3 * ln3 + 1 + 4), 1e-7);

  EXPECT_FALSE(CompareLogits(ref, std::vector<float>(3), 2).ok());
  std::vector<float> bad = test;
  bad[3] = NAN;
  auto e = CompareLogits(ref, bad, 2);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("position 1"), std::string::npos) << e.status().ToString();
}

TEST(AccuracyEval, DefaultPromptsAreFixedAndInRange) {
  const Prompts a = DefaultPrompts(3, 50, 128, 9), b = DefaultPrompts(3, 50, 128, 9);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, DefaultPrompts(3, 50, 128, 10));
  ASSERT_EQ(a.size(), 3u);
  for (const auto& p : a) {
    ASSERT_EQ(p.size(), 50u);
    for (int32_t id : p) EXPECT_TRUE(id >= 0 && id < 128) << id;
  }
}

TEST(AccuracyEval, ReadPromptsTakesReferenceJsonAndNamesErrors) {
  auto p = ReadPrompts(Fixture() + "/reference.json", 128, 128);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->size(), 4u);
  auto small_vocab = ReadPrompts(Fixture() + "/reference.json", 2, 128);
  ASSERT_FALSE(small_vocab.ok());
  EXPECT_NE(small_vocab.status().message().find("reference.json: prompt 0"), std::string::npos)
      << small_vocab.status().ToString();
  auto too_long = ReadPrompts(Fixture() + "/reference.json", 128, 50);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("max_position_embeddings"), std::string::npos);
  EXPECT_FALSE(ReadPrompts(Fixture() + "/config.json", 128, 128).ok());  // no "prompts"
  EXPECT_FALSE(ReadPrompts(Fixture() + "/missing.json", 128, 128).ok());
}

// ForwardAllTokens gives each row the logits Forward gives the prefix ending there (BF16:
// no batch-wide activation scale, so bit for bit).
TEST(AccuracyEval, ForwardAllTokensEqualsForwardOfEachPrefix) {
  Model m = LoadFixture();
  ASSERT_FALSE(m.bf16.layers.empty());
  const std::vector<int32_t> prompt = DefaultPrompts(1, 9, m.config.vocab_size, 3)[0];
  const int64_t v = m.config.vocab_size;
  ASSERT_TRUE(RunOnLocalRanks(1, [&](Communicator& comm) -> Status {
                auto model = CpuModel::Create(m.config, m.bf16, nullptr, comm);
                if (!model.ok()) return model.status();
                auto all = (*model)->ForwardAllTokens(*PackSequences({prompt}, v, 128));
                if (!all.ok()) return all.status();
                EXPECT_EQ(all->size(), prompt.size() * v);
                for (size_t i = 0; i < prompt.size(); ++i) {
                  std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + i + 1);
                  auto last = (*model)->Forward(*PackSequences({prefix}, v, 128));
                  if (!last.ok()) return last.status();
                  EXPECT_TRUE(std::equal(last->begin(), last->end(), all->begin() + i * v))
                      << "row " << i;
                }
                return Status::Ok();
              }).ok());
}

// Per tensor is what the engine makes of this BF16 checkpoint served in FP8 today.
TEST(AccuracyEval, PerTensorEqualsTheLoadersFp8) {
  Model m = LoadFixture();
  ASSERT_FALSE(m.bf16.layers.empty());
  auto ours = QuantizeModelFp8(m.bf16, Fp8Scheme::kPerTensor);
  ASSERT_TRUE(ours.ok()) << ours.status().ToString();
  auto loader = LoadRankWeights(Fixture(), m.config, 1, 0, DataType::kFloat8E4M3);
  ASSERT_TRUE(loader.ok()) << loader.status().ToString();
  for (size_t i = 0; i < ours->layers.size(); ++i) {
    const LayerWeights &a = ours->layers[i], &b = loader->layers[i];
    for (auto [x, y] :
         {std::pair{&a.qkv, &b.qkv}, {&a.o, &b.o}, {&a.gate_up, &b.gate_up}, {&a.down, &b.down}}) {
      EXPECT_EQ(x->scheme, y->scheme) << "layer " << i;
      EXPECT_EQ(x->weight_scale, y->weight_scale) << "layer " << i;
      EXPECT_EQ(x->dynamic_input, y->dynamic_input) << "layer " << i;
      EXPECT_EQ(x->data, y->data) << "layer " << i;
    }
  }
}

TEST(AccuracyEval, OutlierChannelsKeepTheBf16LogitsBitForBit) {
  Model m = LoadFixture();
  ASSERT_FALSE(m.bf16.layers.empty());
  const Prompts prompts = TestPrompts(m.config);
  auto plain = PromptLogits(m.config, m.bf16, prompts);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  RankWeights outliers = m.bf16;
  ASSERT_TRUE(AddOutlierChannels(m.config, kOutlierExponent, &outliers).ok());
  ASSERT_NE(outliers.layers[0].qkv.data, m.bf16.layers[0].qkv.data);
  auto same = PromptLogits(m.config, outliers, prompts);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(*plain, *same);
  EXPECT_FALSE(AddOutlierChannels(m.config, 31, &outliers).ok());
}

// The calibration's maxima: the same at tp 1 and 2 (the ranks' KV heads combined); the
// outlier channels (KV head 0's V rows times 2^14) leave K's alone and lift V's by at most
// 2^14 (exactly that times KV head 0's own maximum); the scales are maxima over 448.
TEST(AccuracyEval, KvAbsMaxSeesEveryRankAndTheOutliers) {
  Model m = LoadFixture();
  ASSERT_FALSE(m.bf16.layers.empty());
  const Prompts prompts = TestPrompts(m.config);
  auto plain = CalibrateKvAbsMax(m.config, m.bf16, prompts);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  ASSERT_EQ(plain->size(), static_cast<size_t>(m.config.num_hidden_layers));
  // tp 2 (the fixture has 2 KV heads: one a rank), on the first prompt.
  auto batch = PackSequences({prompts[0]}, m.config.vocab_size, m.config.max_position_embeddings);
  ASSERT_TRUE(batch.ok());
  std::vector<std::vector<KvAbsMax>> by_tp(3);
  for (int tp : {1, 2}) {
    ASSERT_TRUE(RunOnLocalRanks(tp, [&](Communicator& comm) -> Status {
                  TP_ASSIGN_OR_RETURN(
                      RankWeights w,
                      LoadRankWeights(Fixture(), m.config, tp, comm.rank(), DataType::kBFloat16));
                  TP_ASSIGN_OR_RETURN(auto model, CpuModel::Create(m.config, w, nullptr, comm));
                  TP_ASSIGN_OR_RETURN(auto most, model->MeasureKvAbsMax(*batch));
                  if (comm.rank() == 0) by_tp[tp] = most;
                  return Status::Ok();
                }).ok());
  }
  ASSERT_EQ(by_tp[1].size(), by_tp[2].size());
  for (size_t l = 0; l < by_tp[1].size(); ++l) {
    EXPECT_EQ(by_tp[1][l].k, by_tp[2][l].k) << "layer " << l;
    EXPECT_EQ(by_tp[1][l].v, by_tp[2][l].v) << "layer " << l;
    EXPECT_GT(by_tp[1][l].k, 0.0f);
    EXPECT_LE(by_tp[1][l].k, (*plain)[l].k);  // one prompt of the four
  }
  RankWeights outliers = m.bf16;
  ASSERT_TRUE(AddOutlierChannels(m.config, kOutlierExponent, &outliers).ok());
  auto lifted = CalibrateKvAbsMax(m.config, outliers, prompts);
  ASSERT_TRUE(lifted.ok()) << lifted.status().ToString();
  const float gain = std::ldexp(1.0f, kOutlierExponent);
  for (size_t l = 0; l < plain->size(); ++l) {
    EXPECT_EQ((*lifted)[l].k, (*plain)[l].k) << "layer " << l;
    EXPECT_LE((*lifted)[l].v, gain * (*plain)[l].v) << "layer " << l;
    EXPECT_GE((*lifted)[l].v, gain / 8 * (*plain)[l].v) << "layer " << l;
    const KvScales s = KvScalesForAbsMax((*lifted)[l]);
    EXPECT_EQ(s.k, (*lifted)[l].k / 448.0f);
    EXPECT_EQ(s.v, (*lifted)[l].v / 448.0f);
  }
  EXPECT_EQ(KvScalesForAbsMax({}).k, 1.0f);  // nothing seen: scale 1
}

// (a) BF16 against itself: nothing; (b) every scheme: something; (c) with outliers, both finer
// schemes below per tensor.
TEST(AccuracyEval, SchemesAgainstBf16OnTheLlama31Fixture) {
  Model m = LoadFixture();
  ASSERT_FALSE(m.bf16.layers.empty());
  const Prompts prompts = TestPrompts(m.config);
  auto ref = PromptLogits(m.config, m.bf16, prompts);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  auto again = PromptLogits(m.config, m.bf16, prompts);
  ASSERT_TRUE(again.ok());
  auto self = CompareLogits(*ref, *again, m.config.vocab_size);
  ASSERT_TRUE(self.ok()) << self.status().ToString();
  EXPECT_EQ(self->positions, 256);
  EXPECT_EQ(self->mean_kl, 0.0);
  EXPECT_EQ(self->max_kl, 0.0);
  EXPECT_EQ(self->top1_agreement, 1.0);
  EXPECT_EQ(self->rel_err, 0.0);

  for (int exponent : {0, kOutlierExponent}) {
    AccuracyOptions o;
    o.model_dir = Fixture();
    o.prompts = prompts;
    o.outlier_exponent = exponent;
    auto report = RunAccuracy(o);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    ASSERT_EQ(report->schemes.size(), 3u);
    EXPECT_EQ(report->positions, 256);
    double kl[3];
    for (int s = 0; s < 3; ++s) {
      const LogitsDivergence& d = report->schemes[s].divergence;
      kl[s] = d.mean_kl;
      RecordProperty(
          "mean_kl_e" + std::to_string(exponent) + "_" + Fp8SchemeName(report->schemes[s].scheme),
          std::to_string(d.mean_kl));
      EXPECT_GT(d.mean_kl, 1e-4) << Fp8SchemeName(report->schemes[s].scheme);
      EXPECT_GE(d.max_kl, d.mean_kl);
      EXPECT_LT(d.top1_agreement, 1.0);
      EXPECT_GT(d.top1_agreement, 0.5);
    }
    if (exponent == 0) {
      // Plain: rounding noise only; the schemes within 20 % of each other.
      EXPECT_LT(std::max({kl[0], kl[1], kl[2]}), 1.2 * std::min({kl[0], kl[1], kl[2]}));
    } else {
      EXPECT_LT(kl[1], 0.7 * kl[0]) << "channel vs tensor";
      EXPECT_LT(kl[2], 0.7 * kl[0]) << "block vs tensor";
    }
    // The report's three renderings carry every scheme.
    const auto j = nlohmann::json::parse(AccuracyJson(*report, "abc"));
    EXPECT_EQ(j["schemes"].size(), 3u);
    EXPECT_EQ(j["meta"]["commit"], "abc");
    EXPECT_EQ(j["outlier_exponent"], exponent);
    const std::string md = AccuracyMarkdown(*report);
    EXPECT_NE(md.find("| block | 128x128 blocks |"), std::string::npos) << md;
    EXPECT_NE(AccuracyConsoleTable(*report).find("channel"), std::string::npos);
  }
}

// (d) A scale that does not match its codes (per-channel weight scales doubled, codes kept):
// the comparison sees it.
TEST(AccuracyEval, BrokenScalesGiveAMuchLargerKl) {
  Model m = LoadFixture();
  ASSERT_FALSE(m.bf16.layers.empty());
  const Prompts prompts = TestPrompts(m.config);
  auto ref = PromptLogits(m.config, m.bf16, prompts);
  ASSERT_TRUE(ref.ok());
  auto good = QuantizeModelFp8(m.bf16, Fp8Scheme::kPerChannel);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  RankWeights broken = *good;
  for (LayerWeights& l : broken.layers) {
    for (LinearWeight* w : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      for (float& s : w->weight_scales) s *= 2;
      w->weight_scale *= 2;
    }
  }
  auto good_logits = PromptLogits(m.config, *good, prompts);
  auto broken_logits = PromptLogits(m.config, broken, prompts);
  ASSERT_TRUE(good_logits.ok() && broken_logits.ok());
  auto g = CompareLogits(*ref, *good_logits, m.config.vocab_size);
  auto b = CompareLogits(*ref, *broken_logits, m.config.vocab_size);
  ASSERT_TRUE(g.ok() && b.ok());
  RecordProperty("mean_kl_good", std::to_string(g->mean_kl));
  RecordProperty("mean_kl_broken", std::to_string(b->mean_kl));
  EXPECT_GT(b->mean_kl, 10 * g->mean_kl);
  EXPECT_LT(b->top1_agreement, g->top1_agreement);
}

TEST(AccuracyEval, RefusesAnFp8Checkpoint) {
  const std::string dir = ::testing::TempDir() + "/tpserve_accuracy_fp8";
  auto config = LoadModelConfig(Fixture());
  ASSERT_TRUE(config.ok());
  ASSERT_TRUE(WriteRandomCheckpoint(*config, DataType::kFloat8E4M3, 1, dir).ok());
  AccuracyOptions o;
  o.model_dir = dir;
  o.prompts = DefaultPrompts(1, 4, config->vocab_size, 1);
  auto r = RunAccuracy(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.safetensors"), std::string::npos)
      << r.status().ToString();
}

}  // namespace
}  // namespace tpserve
