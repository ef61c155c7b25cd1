#include "layers/overlap_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace tpserve {
namespace {

using ::testing::HasSubstr;

constexpr char kExample[] = R"(version: 1
tp: 2
defaults:
  mode: pipeline
  chunks: 2
layers:
  - match: "layers.*.mlp.down"
    comm: {max_ctas: 8}
    m_ranges:
      - {m_min: 1, m_max: 1024, mode: none}
      - {m_min: 1025, m_max: 8192, mode: ring, chunks: 4}
      - {m_min: 8193, mode: ring, chunks: 8, fast_accum: true}
  - match: "layers.?.self_attn.o_proj"
    mode: auto
  - match: "layers.*.mlp.gate_up"
    mode: pipeline
    chunks: 2
    copy_engine: true
    comm: {cta_policy: zero}
tuned:
  - {op: gemm_rs, n: 8192, k: 8192, m: 2048, mode: pipeline, chunks: 4, median_ms: 0.2, none_ms: 0.21}
  - {op: gemm_rs, n: 8192, k: 8192, m: 8192, mode: ring, chunks: 2, median_ms: 0.6, none_ms: 0.7}
)";

OverlapConfig MustParse(const std::string& text) {
  auto cfg = OverlapConfig::Parse(text, "test.yaml");
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  return cfg.ok() ? *cfg : OverlapConfig();
}

Status ParseError(const std::string& text) {
  return OverlapConfig::Parse(text, "bad.yaml").status();
}

TEST(GlobMatch, StarsAndQuestionMarks) {
  EXPECT_TRUE(GlobMatch("layers.*.mlp.down", "layers.3.mlp.down"));
  EXPECT_TRUE(GlobMatch("layers.*.mlp.down", "layers.71.mlp.down"));
  EXPECT_TRUE(GlobMatch("*", ""));
  EXPECT_TRUE(GlobMatch("layers.?.x", "layers.3.x"));
  EXPECT_FALSE(GlobMatch("layers.?.x", "layers.13.x"));
  EXPECT_FALSE(GlobMatch("layers.*.mlp.down", "layers.3.mlp.gate_up"));
  EXPECT_TRUE(GlobMatch("*down", "layers.3.mlp.down"));
  EXPECT_FALSE(GlobMatch("down", "layers.3.mlp.down"));
}

TEST(OverlapConfig, EmptyConfigGivesModeNone) {
  OverlapConfig cfg;
  auto k = cfg.Resolve("layers.0.mlp.down", OverlapOp::kGemmReduceScatter, 8192, 28672, 4096, 2);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->mode, OverlapMode::kNone);
}

TEST(OverlapConfig, ResolvesRulesByNameAndMRangeWithInheritance) {
  const OverlapConfig cfg = MustParse(kExample);
  const auto down = [&](int64_t m) {
    return *cfg.Resolve("layers.3.mlp.down", OverlapOp::kGemmReduceScatter, 8192, 28672, m, 2);
  };
  EXPECT_EQ(down(512).mode, OverlapMode::kNone);
  EXPECT_EQ(down(512).chunks, 1);  // mode none: chunks do not apply
  EXPECT_EQ(down(1024).mode, OverlapMode::kNone);
  EXPECT_EQ(down(1025).mode, OverlapMode::kRing);
  EXPECT_EQ(down(1025).chunks, 4);
  EXPECT_EQ(down(1025).comm.max_ctas, 8);  // inherited from the rule
  EXPECT_EQ(down(100000).chunks, 8);
  EXPECT_TRUE(down(100000).fast_accum);
  EXPECT_FALSE(down(1025).fast_accum);  // a range's own knob
  // No rule: the defaults.
  auto qkv =
      cfg.Resolve("layers.3.self_attn.qkv_proj", OverlapOp::kAllGatherGemm, 10240, 8192, 4096, 2);
  ASSERT_TRUE(qkv.ok());
  EXPECT_EQ(qkv->mode, OverlapMode::kPipeline);
  EXPECT_EQ(qkv->chunks, 2);
  auto gate = cfg.Resolve("layers.0.mlp.gate_up", OverlapOp::kAllGatherGemm, 57344, 8192, 64, 2);
  ASSERT_TRUE(gate.ok());
  EXPECT_TRUE(gate->copy_engine);
  EXPECT_EQ(gate->comm.cta_policy, NcclCommConfig::CtaPolicy::kZero);
}

TEST(OverlapConfig, AutoUsesTheTunedTableAndFallsBackToNone) {
  const OverlapConfig cfg = MustParse(kExample);
  auto o = [&](int64_t m, int64_t n = 8192) {
    return *cfg.Resolve("layers.3.self_attn.o_proj", OverlapOp::kGemmReduceScatter, n, 8192, m, 2);
  };
  EXPECT_EQ(o(512).mode, OverlapMode::kPipeline);  // below every entry: the smallest
  EXPECT_EQ(o(2048).chunks, 4);
  EXPECT_EQ(o(4096).mode, OverlapMode::kPipeline);  // largest tuned m <= 4096 is 2048
  EXPECT_EQ(o(8192).mode, OverlapMode::kRing);
  EXPECT_EQ(o(65536).mode, OverlapMode::kRing);
  EXPECT_EQ(o(2048, 4096).mode, OverlapMode::kNone);  // no entry for this shape
  // The glob's '?' matches one character only: layer 13 gets the defaults.
  auto l13 =
      cfg.Resolve("layers.13.self_attn.o_proj", OverlapOp::kGemmReduceScatter, 8192, 8192, 2048, 2);
  EXPECT_EQ(l13->chunks, 2);
}

TEST(OverlapConfig, RejectsAConfigMadeForAnotherTpSize) {
  const OverlapConfig cfg = MustParse(kExample);
  auto k = cfg.Resolve("layers.0.mlp.down", OverlapOp::kGemmReduceScatter, 8192, 28672, 64, 8);
  EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(k.status().message(), HasSubstr("made for tp=2"));
}

TEST(OverlapConfig, CopyEngineOnARowParallelLayerResolvesInEveryMode) {
  // Copy engines reduce-scatter too (pulls plus an add kernel), so a rule's
  // copy_engine holds for either op.
  const OverlapConfig cfg = MustParse(kExample);
  auto k = cfg.Resolve("layers.0.mlp.gate_up", OverlapOp::kGemmReduceScatter, 8192, 8192, 64, 2);
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_TRUE(k->copy_engine);
  EXPECT_EQ(k->mode, OverlapMode::kPipeline);
  EXPECT_EQ(k->chunks, 2);
  // Every mode, from the defaults.
  for (const OverlapMode mode : {OverlapMode::kNone, OverlapMode::kPipeline, OverlapMode::kRing}) {
    SCOPED_TRACE(OverlapModeName(mode));
    const OverlapConfig c =
        MustParse("version: 1\ndefaults: {mode: " + std::string(OverlapModeName(mode)) +
                  ", chunks: 2, copy_engine: true}\n");
    auto r = c.Resolve("layers.0.mlp.down", OverlapOp::kGemmReduceScatter, 8192, 8192, 64, 2);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->mode, mode);
    EXPECT_TRUE(r->copy_engine);
  }
  // And from the tuned table, through mode auto.
  auto tuned = OverlapConfig::Parse(
      "version: 1\ndefaults: {mode: auto}\ntuned:\n"
      "  - {op: gemm_rs, n: 8, k: 8, m: 8, mode: ring, chunks: 2, copy_engine: true}\n",
      "t.yaml");
  ASSERT_TRUE(tuned.ok()) << tuned.status().ToString();
  auto t = tuned->Resolve("layers.0.mlp.down", OverlapOp::kGemmReduceScatter, 8, 8, 8, 2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->mode, OverlapMode::kRing);
  EXPECT_TRUE(t->copy_engine);
}

// The FP8 scale scheme is part of a tuned entry's shape key: mode auto gives a layer the entry of
// its own scheme and none where only another scheme's entry exists (knobs tuned for per-tensor
// scales may not run with per-token ones); entries of two schemes for one shape and m coexist,
// round-trip through ToYaml, and a repeated (shape, scheme, m) or an unknown scheme is refused.
TEST(OverlapConfig, TunedEntriesAreKeyedByScaleScheme) {
  const std::string text =
      "version: 1\ndefaults: {mode: auto}\ntuned:\n"
      "  - {op: gemm_rs, n: 8, k: 8, m: 8, mode: ring, chunks: 2, copy_engine: true}\n"
      "  - {op: gemm_rs, n: 8, k: 8, m: 8, scale_scheme: per_token_channel, mode: pipeline, "
      "chunks: 4}\n"
      "  - {op: ag_gemm, n: 8, k: 8, m: 8, scale_scheme: blockwise, mode: ring, chunks: 1}\n";
  const OverlapConfig cfg = MustParse(text);
  auto at = [&](OverlapOp op, GemmScaleScheme scheme) {
    auto k = cfg.Resolve("layers.0.x", op, 8, 8, 16, 2, scheme);
    EXPECT_TRUE(k.ok()) << k.status().ToString();
    return k.ok() ? *k : LinearKnobs{};
  };
  const OverlapOp rs = OverlapOp::kGemmReduceScatter, ag = OverlapOp::kAllGatherGemm;
  EXPECT_EQ(at(rs, GemmScaleScheme::kPerTensor).mode, OverlapMode::kRing);
  EXPECT_EQ(at(rs, GemmScaleScheme::kPerTokenChannel).mode, OverlapMode::kPipeline);
  EXPECT_EQ(at(rs, GemmScaleScheme::kPerTokenChannel).chunks, 4);
  EXPECT_EQ(at(rs, GemmScaleScheme::kBlockwise).mode, OverlapMode::kNone);
  EXPECT_EQ(at(ag, GemmScaleScheme::kBlockwise).mode, OverlapMode::kRing);
  EXPECT_EQ(at(ag, GemmScaleScheme::kPerTensor).mode, OverlapMode::kNone);
  // The default argument is per tensor.
  auto plain = cfg.Resolve("layers.0.x", rs, 8, 8, 16, 2);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->mode, OverlapMode::kRing);

  const std::string yaml = cfg.ToYaml();
  EXPECT_NE(yaml.find("scale_scheme: per_token_channel"), std::string::npos) << yaml;
  EXPECT_EQ(yaml.find("scale_scheme: per_tensor"), std::string::npos) << "per_tensor is implied";
  const OverlapConfig back = MustParse(yaml);
  ASSERT_EQ(back.tuned().size(), 3u);
  EXPECT_EQ(back.tuned()[1].scale_scheme, GemmScaleScheme::kPerTokenChannel);
  EXPECT_EQ(back.tuned()[2].scale_scheme, GemmScaleScheme::kBlockwise);

  OverlapConfig added = cfg;
  OverlapConfig::Tuned t = cfg.tuned()[1];
  t.knobs.chunks = 2;
  added.AddTuned(t);  // replaces the per-token entry, not the per-tensor one
  ASSERT_EQ(added.tuned().size(), 3u);
  EXPECT_EQ(added.tuned()[0].knobs.mode, OverlapMode::kRing);
  EXPECT_EQ(added.tuned()[1].knobs.chunks, 2);

  auto repeated = OverlapConfig::Parse(
      text + "  - {op: gemm_rs, n: 8, k: 8, m: 8, scale_scheme: per_token_channel, mode: none}\n",
      "r.yaml");
  ASSERT_FALSE(repeated.ok());
  EXPECT_NE(
      repeated.status().message().find("repeats the op, n, k, scale_scheme and m of tuned[1]"),
      std::string::npos)
      << repeated.status().ToString();
  auto bad = OverlapConfig::Parse(
      "version: 1\ntuned:\n  - {op: gemm_rs, n: 8, k: 8, m: 8, scale_scheme: channel}\n", "b.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tuned[0].scale_scheme"), std::string::npos)
      << bad.status().ToString();
  EXPECT_NE(bad.status().message().find("per_token_channel"), std::string::npos)
      << bad.status().ToString();
}

// in_place: read, written back only where set, and refused (naming the file, the rule and the
// layer) where there is no running sum to read in place.
TEST(OverlapConfig, InPlaceResolvesForRowParallelRingsOverPeerMemoryOnly) {
  const OverlapConfig cfg = MustParse(
      "version: 1\n"
      "layers:\n"
      "  - {match: \"layers.*.mlp.down\", mode: ring, chunks: 1, copy_engine: true,\n"
      "     in_place: true}\n"
      "  - {match: \"layers.*.attn.o\", mode: ring, chunks: 2, in_place: true}\n"
      "  - {match: \"*\", mode: ring, copy_engine: true, in_place: true}\n");
  auto down = cfg.Resolve("layers.1.mlp.down", OverlapOp::kGemmReduceScatter, 8, 8, 64, 2);
  ASSERT_TRUE(down.ok()) << down.status().ToString();
  EXPECT_TRUE(down->in_place);
  EXPECT_THAT(down->ToString(), HasSubstr("in_place=1"));
  EXPECT_THAT(LinearKnobs{}.ToString(), ::testing::Not(HasSubstr("in_place")));
  auto nccl = cfg.Resolve("layers.1.attn.o", OverlapOp::kGemmReduceScatter, 8, 8, 64, 2);
  EXPECT_EQ(nccl.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(nccl.status().message(), HasSubstr("test.yaml:5 (match 'layers.*.attn.o')"));
  EXPECT_THAT(nccl.status().message(), HasSubstr("without copy_engine"));
  auto ag = cfg.Resolve("layers.1.mlp.gate_up", OverlapOp::kAllGatherGemm, 8, 8, 64, 2);
  EXPECT_EQ(ag.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(ag.status().message(), HasSubstr("layer 'layers.1.mlp.gate_up'"));
  EXPECT_THAT(ag.status().message(), HasSubstr("in_place applies to gemm_rs layers in mode ring"));
  const std::string text = cfg.ToYaml();
  EXPECT_THAT(text, HasSubstr("in_place: true"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("in_place: false")));
  auto again =
      MustParse(text).Resolve("layers.1.mlp.down", OverlapOp::kGemmReduceScatter, 8, 8, 64, 2);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToString(), down->ToString());
  EXPECT_THAT(ParseError("version: 1\ndefaults:\n  in_place: often\n").message(),
              HasSubstr("bad.yaml:3: defaults.in_place: must be true or false"));
}

// The removed knobs gemm_sm_count and gemm_lanes: a file that still names one, at any level, is
// refused naming the file, line and key and saying that it was removed, even at the value every
// run now has; nothing writes them.
TEST(OverlapConfig, RemovedKnobsAreRefusedByName) {
  const struct {
    const char* yaml;
    const char* expect;
  } cases[] = {
      {"version: 1\ndefaults:\n  gemm_lanes: 2\n", "bad.yaml:3: defaults.gemm_lanes: was removed"},
      {"version: 1\ndefaults: {mode: none, gemm_sm_count: 0}\n",
       "bad.yaml:2: defaults.gemm_sm_count: was removed"},
      {"version: 1\nlayers:\n  - {match: \"*\", gemm_lanes: 1}\n",
       "bad.yaml:3: layers[0].gemm_lanes: was removed"},
      {"version: 1\nlayers:\n  - match: \"*\"\n    m_ranges:\n"
       "      - {m_min: 1, gemm_sm_count: 120}\n",
       "bad.yaml:5: layers[0].m_ranges[0].gemm_sm_count: was removed"},
      {"version: 1\ntuned:\n  - {op: gemm_rs, n: 8, k: 8, m: 8, mode: ring, gemm_sm_count: 0}\n",
       "bad.yaml:3: tuned[0].gemm_sm_count: was removed"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.yaml);
    const Status s = ParseError(c.yaml);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
    EXPECT_THAT(s.message(), HasSubstr("delete the key"));
  }
  // Elsewhere they are unknown keys like any other.
  EXPECT_THAT(ParseError("version: 1\ngemm_lanes: 1\n").message(),
              HasSubstr("(top).gemm_lanes: unknown key"));
  const std::string text = MustParse(kExample).ToYaml();
  const std::string knobs = LinearKnobs{}.ToString();
  for (const char* key : {"gemm_sm_count", "gemm_lanes"}) {
    EXPECT_THAT(text, ::testing::Not(HasSubstr(key)));
    EXPECT_THAT(knobs, ::testing::Not(HasSubstr(key)));
  }
}

// full_weight: gemm_rs on copy engines only, in any mode (the error names the rule and what was
// given), written back only where set, and a boolean.
TEST(OverlapConfig, FullWeightOnlyForCopyEngineGemmRs) {
  const OverlapConfig cfg = MustParse(
      "version: 1\n"
      "layers:\n"
      "  - {match: \"layers.*.attn.o\", mode: pipeline, chunks: 2, copy_engine: true,\n"
      "     full_weight: true}\n"
      "  - {match: \"layers.*.mlp.down\", mode: ring, chunks: 2, copy_engine: true,\n"
      "     full_weight: true}\n"
      "  - {match: \"layers.*.mlp.up\", mode: ring, chunks: 1, full_weight: true}\n"
      "  - {match: \"*\", mode: none, full_weight: true}\n");
  auto o = cfg.Resolve("layers.1.attn.o", OverlapOp::kGemmReduceScatter, 8, 8, 64, 2);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->full_weight);
  EXPECT_EQ(o->chunks, 2);
  EXPECT_THAT(o->ToString(), HasSubstr("full_weight=1"));
  EXPECT_THAT(LinearKnobs{}.ToString(), ::testing::Not(HasSubstr("full_weight")));
  auto ring = cfg.Resolve("layers.1.mlp.down", OverlapOp::kGemmReduceScatter, 8, 8, 64, 2);
  ASSERT_TRUE(ring.ok()) << ring.status().ToString();
  EXPECT_TRUE(ring->full_weight);
  EXPECT_EQ(ring->mode, OverlapMode::kRing);
  EXPECT_EQ(ring->chunks, 2);
  auto up = cfg.Resolve("layers.1.mlp.up", OverlapOp::kGemmReduceScatter, 8, 8, 64, 2);
  EXPECT_EQ(up.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(up.status().message(), HasSubstr("test.yaml:7 (match 'layers.*.mlp.up')"));
  EXPECT_THAT(up.status().message(),
              HasSubstr("full_weight applies to gemm_rs layers with copy_engine"));
  EXPECT_THAT(up.status().message(), HasSubstr("got gemm_rs mode ring without copy_engine"));
  // With in_place (ring, copy engines: both allowed alone) refused: Run would return before
  // the peers have pulled this rank's input.
  LinearKnobs both = *ring;
  both.in_place = true;
  EXPECT_THAT(ValidateLinearKnobs(both, OverlapOp::kGemmReduceScatter).message(),
              HasSubstr("full_weight and in_place do not combine"));
  both.full_weight = false;
  EXPECT_TRUE(ValidateLinearKnobs(both, OverlapOp::kGemmReduceScatter).ok());
  auto nccl = cfg.Resolve("layers.1.mlp.gate_up", OverlapOp::kAllGatherGemm, 8, 8, 64, 2);
  EXPECT_EQ(nccl.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(nccl.status().message(), HasSubstr("got ag_gemm mode none without copy_engine"));
  const std::string text = cfg.ToYaml();
  EXPECT_THAT(text, HasSubstr("full_weight: true"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("full_weight: false")));
  auto again =
      MustParse(text).Resolve("layers.1.attn.o", OverlapOp::kGemmReduceScatter, 8, 8, 64, 2);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToString(), o->ToString());
  EXPECT_THAT(ParseError("version: 1\ndefaults:\n  full_weight: 2\n").message(),
              HasSubstr("bad.yaml:3: defaults.full_weight: must be true or false"));
}

// A level in mode none does not reset what inner levels inherit: its own
// resolved knobs have one chunk, an M range below it that picks ring gets the
// defaults' four.
// The one rule for the deferred last sum, shared by CudaLinear and the CPU model.
TEST(LinearPlanRequest, DefersTheLastSumOnlyWhereTheGpuRingDoes) {
  LinearKnobs ce;
  ce.mode = OverlapMode::kRing;
  ce.copy_engine = true;
  const PlanRequest q = LinearPlanRequest(OverlapOp::kGemmReduceScatter, ce, 4, 3, 100);
  EXPECT_TRUE(q.defer_last_sum);
  EXPECT_EQ(q.op, OverlapOp::kGemmReduceScatter);
  EXPECT_EQ(q.mode, OverlapMode::kRing);
  EXPECT_EQ(q.tp, 4);
  EXPECT_EQ(q.rank, 3);
  EXPECT_EQ(q.m, 100);
  EXPECT_EQ(q.chunks, 1);
  EXPECT_TRUE(MakeOverlapPlan(q).ok());
  EXPECT_FALSE(LinearPlanRequest(OverlapOp::kAllGatherGemm, ce, 4, 0, 100).defer_last_sum);
  EXPECT_FALSE(LinearPlanRequest(OverlapOp::kGemmReduceScatter, ce, 1, 0, 100).defer_last_sum);
  LinearKnobs two = ce;
  two.chunks = 2;
  EXPECT_FALSE(LinearPlanRequest(OverlapOp::kGemmReduceScatter, two, 4, 0, 100).defer_last_sum);
  LinearKnobs in_place = ce;
  in_place.in_place = true;
  EXPECT_FALSE(
      LinearPlanRequest(OverlapOp::kGemmReduceScatter, in_place, 4, 0, 100).defer_last_sum);
  LinearKnobs nccl = ce;
  nccl.copy_engine = false;
  EXPECT_FALSE(LinearPlanRequest(OverlapOp::kGemmReduceScatter, nccl, 4, 0, 100).defer_last_sum);
  LinearKnobs pipeline = ce;
  pipeline.mode = OverlapMode::kPipeline;
  EXPECT_FALSE(
      LinearPlanRequest(OverlapOp::kGemmReduceScatter, pipeline, 4, 0, 100).defer_last_sum);
}

TEST(OverlapConfig, ModeNoneDoesNotResetTheChunksInnerLevelsInherit) {
  const OverlapConfig cfg = MustParse(R"(version: 1
defaults: {mode: ring, chunks: 4}
layers:
  - match: "*"
    mode: none
    m_ranges:
      - {m_min: 1, m_max: 1024}
      - {m_min: 1025, mode: ring}
)");
  auto small = cfg.Resolve("layers.0.mlp.down", OverlapOp::kGemmReduceScatter, 8192, 8192, 512, 2);
  auto large = cfg.Resolve("layers.0.mlp.down", OverlapOp::kGemmReduceScatter, 8192, 8192, 4096, 2);
  ASSERT_TRUE(small.ok() && large.ok());
  EXPECT_EQ(small->mode, OverlapMode::kNone);
  EXPECT_EQ(small->chunks, 1);
  EXPECT_EQ(large->mode, OverlapMode::kRing);
  EXPECT_EQ(large->chunks, 4);
}

TEST(OverlapConfig, MalformedInputThatMadeYamlLoadAllLoopIsAnErrorAtOnce) {
  // Found by fuzz_overlap_config: yaml-cpp's LoadAll never returned on it.
  const std::string input("\x2c\xf7\x66\x61\x75\xff\xff\xff\xff\xff\x65\x72\x28\x73\x3a", 15);
  const Status s = ParseError(input);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

TEST(OverlapConfig, AnMInAGapOfARulesRangesFallsThroughToTheNextRule) {
  const OverlapConfig cfg = MustParse(R"(version: 1
defaults: {mode: pipeline, chunks: 2}
layers:
  - match: "layers.*.mlp.down"
    m_ranges:
      - {m_min: 1, m_max: 10, mode: ring, chunks: 2}
      - {m_min: 20, mode: ring, chunks: 4}
  - match: "layers.1.*"
    mode: none
)");
  const auto down = [&](const char* name, int64_t m) {
    return *cfg.Resolve(name, OverlapOp::kGemmReduceScatter, 8192, 28672, m, 2);
  };
  EXPECT_EQ(down("layers.1.mlp.down", 10).chunks, 2);
  EXPECT_EQ(down("layers.1.mlp.down", 15).mode, OverlapMode::kNone);      // the next rule
  EXPECT_EQ(down("layers.2.mlp.down", 15).mode, OverlapMode::kPipeline);  // the defaults
  EXPECT_EQ(down("layers.2.mlp.down", 20).chunks, 4);
}

TEST(OverlapConfig, RepeatedKeysAreRefusedNamingTheLine) {
  const Status s = ParseError("version: 1\ndefaults:\n  mode: none\n  mode: ring\n");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("bad.yaml:4: defaults.mode: duplicate key"));
  EXPECT_THAT(ParseError("version: 1\nversion: 1\n").message(),
              HasSubstr("(top).version: duplicate key"));
}

TEST(OverlapConfig, RoundTripsThroughYaml) {
  const OverlapConfig cfg = MustParse(kExample);
  const std::string text = cfg.ToYaml();
  const OverlapConfig back = MustParse(text);
  EXPECT_EQ(back.tp(), 2);
  ASSERT_EQ(back.rules().size(), cfg.rules().size());
  ASSERT_EQ(back.tuned().size(), 2u);
  for (int64_t m : {1, 512, 1025, 4096, 8192, 100000}) {
    for (const char* name :
         {"layers.3.mlp.down", "layers.3.self_attn.o_proj", "layers.0.mlp.gate_up"}) {
      const OverlapOp op = std::string(name).find("gate_up") != std::string::npos
                               ? OverlapOp::kAllGatherGemm
                               : OverlapOp::kGemmReduceScatter;
      auto a = cfg.Resolve(name, op, 8192, 8192, m, 2);
      auto b = back.Resolve(name, op, 8192, 8192, m, 2);
      ASSERT_TRUE(a.ok() && b.ok()) << name;
      EXPECT_EQ(a->ToString(), b->ToString()) << name << " m=" << m;
    }
  }
}

TEST(OverlapConfig, AddTunedReplacesTheSameShapeAndM) {
  OverlapConfig cfg;
  OverlapConfig::Tuned t;
  t.op = OverlapOp::kAllGatherGemm;
  t.n = 1024;
  t.k = 1024;
  t.m = 64;
  t.knobs.mode = OverlapMode::kPipeline;
  t.knobs.chunks = 2;
  cfg.AddTuned(t);
  t.knobs.chunks = 4;
  cfg.AddTuned(t);
  ASSERT_EQ(cfg.tuned().size(), 1u);
  EXPECT_EQ(cfg.tuned()[0].knobs.chunks, 4);
}

TEST(OverlapConfig, LoadFileReportsAMissingFile) {
  auto cfg = OverlapConfig::LoadFile("/nonexistent/overlap.yaml");
  EXPECT_EQ(cfg.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(cfg.status().message(), HasSubstr("/nonexistent/overlap.yaml"));
}

TEST(OverlapConfig, LoadFileReadsWhatWasWritten) {
  const std::string path = ::testing::TempDir() + "/overlap_config_test.yaml";
  std::ofstream(path) << kExample;
  auto cfg = OverlapConfig::LoadFile(path);
  std::remove(path.c_str());
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  EXPECT_EQ(cfg->source(), path);
  // The file's contents, not just its name: the same config as parsed from the text.
  const OverlapConfig parsed = MustParse(kExample);
  EXPECT_EQ(cfg->tp(), 2);
  EXPECT_EQ(cfg->rules().size(), 3u);
  EXPECT_EQ(cfg->tuned().size(), 2u);
  EXPECT_EQ(cfg->ToYaml(), parsed.ToYaml());
}

struct BadCase {
  const char* yaml;
  const char* expect;  // substring of the error
};

TEST(OverlapConfig, StrictLoaderNamesFileLineKeyAndAllowedValues) {
  const BadCase cases[] = {
      {"", "bad.yaml:"},
      {"version: 2\n", "bad.yaml:1: version: 2 is not supported (allowed: 1)"},
      {"tp: 2\n", "version: missing"},
      {"version: 1\nextra: 3\n", "bad.yaml:2: (top).extra: unknown key (allowed: version, tp"},
      {"version: 1\ndefaults:\n  mode: fast\n",
       "bad.yaml:3: defaults.mode: 'fast' (allowed: none, pipeline, ring, auto)"},
      {"version: 1\ndefaults:\n  chunks: 0\n", "bad.yaml:3: defaults.chunks: 0 is outside [1, 64]"},
      {"version: 1\ndefaults:\n  chunks: many\n",
       "defaults.chunks: must be an integer, got 'many'"},
      {"version: 1\ndefaults:\n  copy_engine: maybe\n", "copy_engine: must be true or false"},
      {"version: 1\ndefaults:\n  comm: {max_ctas: 99}\n", "defaults.comm.max_ctas: 99 is outside"},
      {"version: 1\ndefaults:\n  comm: {cta_policy: greedy}\n",
       "'greedy' (allowed: default, efficiency, zero)"},
      {"version: 1\ndefaults:\n  comm: {min_ctas: 8, max_ctas: 4}\n", "above max_ctas"},
      {"version: 1\ndefaults:\n  comm: {ctas: 4}\n", "defaults.comm.ctas: unknown key"},
      {"version: 1\nlayers:\n  - mode: ring\n", "bad.yaml:3: layers[0].match: missing"},
      {"version: 1\nlayers:\n  - match: x\n    chunk: 2\n",
       "bad.yaml:4: layers[0].chunk: unknown key (allowed: match, m_ranges, mode, chunks"},
      {"version: 1\nlayers:\n  - match: x\n    m_ranges:\n      - {m_min: 1, m_max: 100}\n"
       "      - {m_min: 50}\n",
       "bad.yaml:6: layers[0].m_ranges[1]: M range [50, inf] overlaps [1, 100] of the same rule"},
      {"version: 1\nlayers:\n  - match: x\n    m_ranges:\n      - {m_min: 10, m_max: 5}\n",
       "m_max 5 is below m_min 10"},
      {"version: 1\nlayers: {match: x}\n", "layers: must be a list of rules"},
      {"version: 1\ntuned:\n  - {op: gemm_rs, n: 8, k: 8, m: 8, mode: auto}\n",
       "a tuned entry cannot be auto"},
      {"version: 1\ntuned:\n  - {op: rs, n: 8, k: 8, m: 8}\n", "'rs' (allowed: ag_gemm, gemm_rs)"},
      {"version: 1\ntuned:\n  - {op: gemm_rs, n: 8, k: 8}\n", "needs op, n, k and m"},
      {"version: 1\ndefaults: [1, 2\n", "YAML syntax error"},
      // Found by fuzz_overlap_config: a mapping used as a key.
      {"version: 1\ndefaults:\n  ? {a: 1}\n  : 2\n", "keys must be plain strings"},
      {"version: 1\n? [x]\n: 1\n", "keys must be plain strings"},
      // yaml-cpp's Load reads the first document only: the rest would be lost.
      {"version: 1\n---\nversion: 1\nbogus: 3\n",
       "bad.yaml:2: a second YAML document ('---'); an overlap config is one document"},
      {"version: 1\ntuned:\n  - {op: gemm_rs, n: 8, k: 8, m: 8, mode: ring, chunks: 2}\n"
       "  - {op: gemm_rs, n: 8, k: 8, m: 8, mode: none}\n",
       "bad.yaml:4: tuned[1]: repeats the op, n, k, scale_scheme and m of tuned[0] (line 3)"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.yaml);
    Status s = ParseError(c.yaml);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(c.expect));
  }
}

// The example files under deploy/ must load and resolve every Llama-3-70B
// TP layer at every M without error.
TEST(OverlapConfig, DeployExamplesLoadAndResolveEveryLayer) {
  struct Layer {
    const char* name;
    OverlapOp op;
    int64_t n, k;
  };
  const Layer layers[] = {{"layers.0.attn.qkv", OverlapOp::kAllGatherGemm, 10240, 8192},
                          {"layers.0.attn.o", OverlapOp::kGemmReduceScatter, 8192, 8192},
                          {"layers.79.mlp.gate_up", OverlapOp::kAllGatherGemm, 57344, 8192},
                          {"layers.79.mlp.down", OverlapOp::kGemmReduceScatter, 8192, 28672}};
  for (const auto& [file, tp] : {std::pair<const char*, int>{"overlap-llama3-70b-tp2.yaml", 2},
                                 std::pair<const char*, int>{"overlap-llama3-70b-tp8.yaml", 8},
                                 std::pair<const char*, int>{"overlap-tp1-fast-accum.yaml", 1}}) {
    SCOPED_TRACE(file);
    auto cfg = OverlapConfig::LoadFile(std::string(TPSERVE_SOURCE_DIR) + "/deploy/" + file);
    ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
    EXPECT_EQ(cfg->tp(), tp);
    for (const Layer& l : layers) {
      for (int64_t m : {1, 512, 1000, 2048, 4096, 8192, 16384, 100000}) {
        auto k = cfg->Resolve(l.name, l.op, l.n, l.k, m, tp);
        ASSERT_TRUE(k.ok()) << l.name << " m=" << m << ": " << k.status().ToString();
        if (tp == 1) {  // the one-GPU file: every GEMM with fast accumulation, no overlap
          EXPECT_TRUE(k->fast_accum) << l.name << " m=" << m;
          EXPECT_EQ(k->mode, OverlapMode::kNone) << l.name << " m=" << m;
        }
        if (tp == 2 && m == 1) {  // a decode step: the sweep's m-2 entries, not m 512's rings
          EXPECT_NE(k->mode, OverlapMode::kRing) << l.name;
          EXPECT_FALSE(k->copy_engine) << l.name;
        }
      }
    }
  }
}

}  // namespace
}  // namespace tpserve
