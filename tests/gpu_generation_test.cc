// Generation on the CUDA backend: the tiny model through CudaEngine::Step and the Generator
// (scheduler, paged KV cache on the GPU, sampling on the GPU), against the CPU backend with
// the same random weights (MakeRandomRankWeights, seed 7).
//
// CudaModel keeps activations in BF16 between ops (CpuModel: FP32), so logits differ by a few
// BF16 roundings per layer and tokens are compared, not logits: greedy tokens must equal the
// CPU engine's, except that a sequence may part from the CPU's after a near-tie, where the
// CPU's logit of the GPU's token is within 2 % of its largest |logit| (the margin
// tests/gpu_model_test.cc holds CudaModel::Forward's top-1 tokens to), from the CPU model
// recomputing the sequence; every parting and its gap is printed. After that point the two
// continue from different sequences and are not compared. Chunked prefill, a pool small
// enough to force preemption (recompute), eager steps and both weight types are held to the
// same rule; the FP8 KV cache (E4M3 codes of values that differ in their low bits can differ
// by a code, 6 %) is held to it with a 5 % margin.
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/cuda_engine.h"
#include "engine/generator.h"
#include "engine/model_weights.h"
#include "engine/safetensors.h"
#include "layers/fp8.h"
#include "tests/generation_test_util.h"
#include "tests/gpu_test_util.h"

namespace tpserve {
namespace {

using namespace std::chrono_literals;

struct GenSetup {
  DataType dtype = DataType::kFloat8E4M3;
  int64_t kv_blocks = 256;
  int64_t block_size = 16;
  KvCacheDtype kv_dtype = KvCacheDtype::kBFloat16;
  int64_t max_step_tokens = 512;
  bool cuda_graphs = true;
  std::string checkpoint_dir;  // empty: random weights of seed 7
  int64_t max_running = 16;    // the scheduler's (1: one sequence at a time, steps of one)
  CudaModelOptions::DecodeFusions fusions;
  // cuBLASLt's heuristic algorithm instead of the fastest timed one: two engines then pick
  // the same algorithms (and round alike).
  bool heuristic_gemms = false;
  int injected_capture_failures = 0;  // CudaModelOptions::injected_capture_failures
};

constexpr int64_t kMaxTokens = 512, kMaxSeqs = 16, kNewTokens = 20;
constexpr double kTieMargin = 0.02;

std::shared_ptr<Engine> StartCuda(const GenSetup& s) {
  CudaEngineOptions o;
  o.config = *ModelPreset("tiny");
  o.dtype = s.dtype;
  o.seed = 7;
  o.checkpoint_dir = s.checkpoint_dir;
  o.model.max_tokens = kMaxTokens;
  o.model.max_seqs = kMaxSeqs;
  o.model.cuda_graphs = s.cuda_graphs;
  o.model.kv_blocks = s.kv_blocks;
  o.model.kv_block_size = s.block_size;
  o.model.kv_dtype = s.kv_dtype;
  o.model.decode_fusions = s.fusions;
  if (s.heuristic_gemms) o.model.gemm_algo = GemmAlgoSelection::kHeuristic;
  o.model.injected_capture_failures = s.injected_capture_failures;
  o.timeout = 120s;
  o.worker_argv = {"/proc/self/exe"};  // tp 1 starts no worker, but the engine wants a command
  auto e = CudaEngine::Start(std::move(o));
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::shared_ptr<Engine>(std::move(e).value()) : nullptr;
}

std::shared_ptr<CpuEngine> StartCpu(const GenSetup& s) {
  CpuEngineOptions o;
  o.config = *ModelPreset("tiny");
  o.dtype = s.dtype;
  o.seed = 7;
  o.checkpoint_dir = s.checkpoint_dir;
  o.kv_blocks = 256;
  o.kv_block_size = 16;
  o.kv_dtype = s.kv_dtype;
  auto e = CpuEngine::Start(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::shared_ptr<CpuEngine>(std::move(e).value()) : nullptr;
}

using Outcome = GenerationOutcome;

// Generates for every prompt at once on a Generator over `engine`.
std::vector<Outcome> Generate(std::shared_ptr<Engine> engine, const GenSetup& s,
                              const std::vector<std::vector<int32_t>>& prompts,
                              const GenerationParams& params, GeneratorStats* stats = nullptr) {
  GeneratorOptions go;
  go.scheduler.max_step_tokens = s.max_step_tokens;
  go.scheduler.max_running = s.max_running;
  auto g = Generator::Start(go, std::move(engine));
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  if (!g.ok()) return std::vector<Outcome>(prompts.size());
  auto out = GenerateAll(**g, prompts, params, 300s);
  if (stats != nullptr) *stats = (*g)->stats();
  return out;
}

GenerationParams Greedy() {
  GenerationParams p;
  p.max_new_tokens = kNewTokens;
  p.return_log_probs = true;
  return p;
}

// Random prompts of awkward lengths (1 token, mid-block, several blocks, ~300).
std::vector<std::vector<int32_t>> Prompts() {
  std::mt19937 rng(2024);
  std::uniform_int_distribution<int32_t> id(0, 1023);
  std::vector<std::vector<int32_t>> out;
  for (int len : {1, 7, 19, 64, 150, 301}) {
    std::vector<int32_t> p(len);
    for (auto& t : p) t = id(rng);
    out.push_back(std::move(p));
  }
  return out;
}

// Checks `gpu` against `cpu` token by token under the near-tie rule (header), printing one
// line per prompt.
void ExpectSameTokens(CpuEngine& cpu_engine, const std::vector<std::vector<int32_t>>& prompts,
                      const std::vector<Outcome>& cpu, const std::vector<Outcome>& gpu,
                      double margin, const std::string& what) {
  ASSERT_EQ(cpu.size(), prompts.size());
  ASSERT_EQ(gpu.size(), prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) {
    SCOPED_TRACE(what + ", prompt " + std::to_string(p) + " (" + std::to_string(prompts[p].size()) +
                 " tokens)");
    ASSERT_TRUE(cpu[p].error.ok()) << cpu[p].error.ToString();
    ASSERT_TRUE(gpu[p].error.ok()) << gpu[p].error.ToString();
    EXPECT_EQ(gpu[p].finish, FinishReason::kLength);
    ASSERT_EQ(gpu[p].tokens.size(), static_cast<size_t>(kNewTokens));
    ASSERT_EQ(cpu[p].tokens.size(), static_cast<size_t>(kNewTokens));
    ASSERT_EQ(gpu[p].log_probs.size(), static_cast<size_t>(kNewTokens));
    size_t i = 0;
    double max_lp_diff = 0;
    while (i < gpu[p].tokens.size() && gpu[p].tokens[i] == cpu[p].tokens[i]) {
      EXPECT_TRUE(std::isfinite(gpu[p].log_probs[i]) && gpu[p].log_probs[i] <= 0.0f);
      max_lp_diff =
          std::max<double>(max_lp_diff, std::abs(gpu[p].log_probs[i] - cpu[p].log_probs[i]));
      ++i;
    }
    std::cout << "[ " << what << " ] prompt " << p << " (" << prompts[p].size() << " tokens): " << i
              << "/" << kNewTokens << " tokens equal, max |log_prob gpu - cpu| " << max_lp_diff;
    if (i == gpu[p].tokens.size()) {
      std::cout << "\n";
      continue;
    }
    // The CPU model's logits at the parting position.
    std::vector<int32_t> seq = prompts[p];
    seq.insert(seq.end(), cpu[p].tokens.begin(), cpu[p].tokens.begin() + i);
    auto batch = PackSequences({seq}, 1024, 2048);
    ASSERT_TRUE(batch.ok());
    auto logits = cpu_engine.Forward(*batch);
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    const std::vector<float>& l = *logits;
    const float top = *std::max_element(l.begin(), l.end());
    const int32_t got = gpu[p].tokens[i];
    ASSERT_TRUE(got >= 0 && got < static_cast<int32_t>(l.size()));
    float largest = 1e-6f;
    for (float v : l) largest = std::max(largest, std::abs(v));
    const double gap = (top - l[got]) / largest;
    std::cout << "; parts at " << i << ": cpu " << cpu[p].tokens[i] << " (logit " << top
              << "), gpu " << got << " (cpu logit " << l[got] << "), gap " << 100 * gap << " %\n";
    EXPECT_LE(gap, margin) << "the GPU's token " << got << " at " << i
                           << " is not a near-tie of the CPU's " << cpu[p].tokens[i];
  }
}

class GpuGenerationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  }

  // CPU and GPU generations of Prompts() with setup `s` (the CPU engine: an ample pool, one
  // step for all prompts), compared under the near-tie rule.
  void CheckAgainstCpu(const GenSetup& s, double margin, const std::string& what,
                       GeneratorStats* gpu_stats = nullptr) {
    const auto prompts = Prompts();
    auto cpu = StartCpu(s);
    ASSERT_NE(cpu, nullptr);
    GenSetup cpu_setup = s;
    cpu_setup.max_step_tokens = 2048;
    const auto want = Generate(cpu, cpu_setup, prompts, Greedy());
    auto gpu = StartCuda(s);
    ASSERT_NE(gpu, nullptr);
    const auto got = Generate(gpu, s, prompts, Greedy(), gpu_stats);
    EXPECT_TRUE(gpu->healthy());
    ExpectSameTokens(*cpu, prompts, want, got, margin, what);
  }
};

TEST_F(GpuGenerationTest, Fp8WeightsGreedyTokensMatchCpuEngine) {
  CheckAgainstCpu(GenSetup{}, kTieMargin, "fp8 weights");
}

// Per-channel and block-wise FP8 checkpoints: at tp 1 the CUDA engine runs their scales (prefill
// chunks and decode steps, block-wise at step buckets in multiples of 4), as the CPU engine does.
TEST_F(GpuGenerationTest, FineScaleCheckpointsGreedyTokensMatchCpuEngine) {
  for (Fp8Scheme scheme : {Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    GenSetup s;
    s.checkpoint_dir = ::testing::TempDir() + "/tpserve_gpu_gen_" + Fp8SchemeName(scheme);
    std::filesystem::remove_all(s.checkpoint_dir);
    ASSERT_TRUE(WriteRandomCheckpoint(*ModelPreset("tiny"), DataType::kFloat8E4M3, 7,
                                      s.checkpoint_dir, scheme)
                    .ok());
    CheckAgainstCpu(s, kTieMargin, std::string("fp8 ") + Fp8SchemeName(scheme) + " checkpoint");
    std::filesystem::remove_all(s.checkpoint_dir);
  }
}

TEST_F(GpuGenerationTest, Bf16WeightsGreedyTokensMatchCpuEngine) {
  GenSetup s;
  s.dtype = DataType::kBFloat16;
  CheckAgainstCpu(s, kTieMargin, "bf16 weights");
}

TEST_F(GpuGenerationTest, EagerStepsMatchCpuEngine) {
  GenSetup s;
  s.cuda_graphs = false;
  CheckAgainstCpu(s, kTieMargin, "no graphs");
}

// A decode step whose graph capture fails keeps its result, and its (bucket, slots) runs eagerly
// from then on: the tokens of an engine whose captures all succeed (both on cuBLASLt's heuristic
// algorithms and one sequence at a time, so that their steps and rounding are alike), every
// request completed, the engine healthy. The warning the engine logs shows that the injected
// failure happened.
TEST_F(GpuGenerationTest, AFailedGraphCaptureKeepsTheStep) {
  GenSetup s;
  s.heuristic_gemms = true;
  s.max_running = 1;
  const auto prompts = Prompts();
  auto graphed = StartCuda(s);
  ASSERT_NE(graphed, nullptr);
  const auto want = Generate(graphed, s, prompts, Greedy());
  graphed.reset();

  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  spdlog::default_logger()->sinks().push_back(sink);
  GenSetup faulty = s;
  faulty.injected_capture_failures = 1;  // the first decode shape runs eagerly
  auto engine = StartCuda(faulty);
  std::vector<Outcome> got;
  if (engine != nullptr) {
    got = Generate(engine, faulty, prompts, Greedy());
    EXPECT_TRUE(engine->healthy());
    engine.reset();
  }
  spdlog::default_logger()->sinks().pop_back();
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) {
    EXPECT_TRUE(got[p].error.ok()) << "prompt " << p << ": " << got[p].error.ToString();
    EXPECT_EQ(want[p].tokens.size(), static_cast<size_t>(kNewTokens)) << "prompt " << p;
    EXPECT_EQ(got[p].tokens, want[p].tokens) << "prompt " << p;
  }
  size_t warnings = 0;
  for (size_t at = log.str().find("could not be captured"); at != std::string::npos;
       at = log.str().find("could not be captured", at + 1)) {
    ++warnings;
  }
  EXPECT_EQ(warnings, 1u) << log.str();
}

TEST_F(GpuGenerationTest, ChunkedPrefillMatchesCpuEngine) {
  GenSetup s;
  s.max_step_tokens = 24;  // prompts in chunks that start mid-block, beside decoding rows
  CheckAgainstCpu(s, kTieMargin, "chunked prefill");
}

TEST_F(GpuGenerationTest, SmallPoolPreemptsAndMatchesCpuEngine) {
  GenSetup s;
  // The first five prompts are admitted together (18 blocks) and grow to 24 blocks while
  // decoding: the newest (150 tokens) is preempted and recomputed; the longest sequence
  // (321 tokens, 21 blocks) still fits alone. (The scheduler alone, with these lengths,
  // preempts once in 44 steps; with 24 blocks, never.)
  s.kv_blocks = 22;
  GeneratorStats stats;
  CheckAgainstCpu(s, kTieMargin, "small pool", &stats);
  std::cout << "small pool: " << stats.preemptions << " preemptions in " << stats.steps
            << " steps\n";
  EXPECT_GT(stats.preemptions, 0u);
}

TEST_F(GpuGenerationTest, Fp8KvCacheMatchesCpuEngine) {
  GenSetup s;
  s.kv_dtype = KvCacheDtype::kFloat8E4M3;
  CheckAgainstCpu(s, 0.05, "fp8 kv cache");
}

// A checkpoint with KV cache scales (every spelling the loader reads, values that are not powers
// of two): the CUDA engine's E4M3 cache stores and reads with them as the CPU engine's does.
// Ignoring them on either side, or applying them on one way only, changes the attention of every
// layer by the scale (about 20x here) and the tokens with it.
TEST_F(GpuGenerationTest, Fp8KvCacheWithCheckpointScalesMatchesCpuEngine) {
  GenSetup s;
  s.kv_dtype = KvCacheDtype::kFloat8E4M3;
  s.checkpoint_dir = ::testing::TempDir() + "/tpserve_gpu_gen_kv_scales";
  std::filesystem::remove_all(s.checkpoint_dir);
  const ModelConfig c = *ModelPreset("tiny");
  ASSERT_TRUE(WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, s.checkpoint_dir).ok());
  std::vector<float> values;
  values.reserve(2 * static_cast<size_t>(c.num_hidden_layers));  // stable addresses
  std::vector<TensorToWrite> scales;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = HfLayerPrefix(l) + ".self_attn.";
    values.push_back(0.043f + 0.01f * static_cast<float>(l));
    values.push_back(0.061f);
    const bool modelopt = l % 2 == 1;
    scales.push_back({p + (modelopt ? "k_proj.k_scale" : "k_scale"),
                      StDtype::kF32,
                      {},
                      &values[values.size() - 2],
                      4});
    scales.push_back(
        {p + (modelopt ? "v_proj.v_scale" : "v_scale"), StDtype::kF32, {1}, &values.back(), 4});
  }
  ASSERT_TRUE(WriteSafetensors(s.checkpoint_dir + "/kv_scales.safetensors", scales).ok());
  CheckAgainstCpu(s, 0.05, "fp8 kv cache, checkpoint scales");
  std::filesystem::remove_all(s.checkpoint_dir);
}

// The decode step's fusions change no result: with each one that keeps the bits (all but the
// cluster merge, whose merge rounds differently) off in turn, the tokens and their log-probs
// are those of all on, bit for bit. One sequence at a time, so that every engine runs the same
// steps (prefill chunks, then decode steps of one: the decode kernel with its splits, RoPE
// inside it or not, o's E4M3 input from it or from a quantize pass, SwiGLU in gate_up's
// small-M GEMM or after it).
TEST_F(GpuGenerationTest, DecodeFusionsChangeNoResult) {
  const auto prompts = Prompts();
  for (const KvCacheDtype kv : {KvCacheDtype::kBFloat16, KvCacheDtype::kFloat8E4M3}) {
    GenSetup on;
    on.kv_dtype = kv;
    on.max_running = 1;
    on.heuristic_gemms = true;
    const auto want = Generate(StartCuda(on), on, prompts, Greedy());
    const struct {
      const char* name;
      bool CudaModelOptions::DecodeFusions::*field;
    } fusions[] = {{"rope in attention", &CudaModelOptions::DecodeFusions::rope_in_attention},
                   {"attention out fp8", &CudaModelOptions::DecodeFusions::attention_out_fp8},
                   {"early loads", &CudaModelOptions::DecodeFusions::early_loads},
                   {"swiglu in gemm", &CudaModelOptions::DecodeFusions::swiglu_in_gemm}};
    for (const auto& f : fusions) {
      GenSetup off = on;
      off.fusions.*f.field = false;
      const auto got = Generate(StartCuda(off), off, prompts, Greedy());
      for (size_t i = 0; i < prompts.size(); ++i) {
        SCOPED_TRACE(std::string(KvCacheDtypeName(kv)) + " cache, " + f.name + " off, prompt " +
                     std::to_string(i));
        ASSERT_TRUE(want[i].error.ok()) << want[i].error.ToString();
        ASSERT_TRUE(got[i].error.ok()) << got[i].error.ToString();
        EXPECT_EQ(want[i].tokens.size(), static_cast<size_t>(kNewTokens));
        EXPECT_EQ(got[i].tokens, want[i].tokens);
        EXPECT_EQ(got[i].log_probs, want[i].log_probs);
      }
    }
  }
}

TEST_F(GpuGenerationTest, SeededSamplingIsReproducible) {
  GenSetup s;
  auto gpu = StartCuda(s);
  ASSERT_NE(gpu, nullptr);
  GenerationParams p = Greedy();
  p.sampling.temperature = 0.8f;
  p.sampling.top_k = 50;
  p.sampling.top_p = 0.95f;
  p.sampling.seed = 1234;
  const auto prompts = Prompts();
  const auto a = Generate(gpu, s, prompts, p);
  const auto b = Generate(gpu, s, prompts, p);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(a[i].error.ok()) << a[i].error.ToString();
    ASSERT_TRUE(b[i].error.ok()) << b[i].error.ToString();
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "prompt " << i;
    EXPECT_EQ(a[i].tokens.size(), static_cast<size_t>(kNewTokens));
  }
}

TEST_F(GpuGenerationTest, BadStepsAreRefusedAndTheEngineKeepsServing) {
  GenSetup none;
  none.kv_blocks = 0;
  auto plain = StartCuda(none);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->kv_cache_layout().num_blocks, 0);
  StepBatch step;
  step.ids = {5};
  step.positions = {0};
  step.cu_seqlens = {0, 1};
  step.context_lens = {1};
  step.max_blocks = 1;
  step.block_tables = {0};
  step.sample = {1};
  step.sampling = {SamplingParams{}};
  step.sample_index = {0};
  EXPECT_EQ(plain->Step(step).status().code(), StatusCode::kFailedPrecondition);

  auto gpu = StartCuda(GenSetup{});
  ASSERT_NE(gpu, nullptr);
  EXPECT_EQ(gpu->kv_cache_layout().num_blocks, 256);
  StepBatch bad = step;
  bad.block_tables = {256};  // outside the pool
  EXPECT_EQ(gpu->Step(bad).status().code(), StatusCode::kInvalidArgument);
  bad = step;
  bad.ids = {1024};  // outside the vocabulary
  EXPECT_EQ(gpu->Step(bad).status().code(), StatusCode::kInvalidArgument);
  auto ok = gpu->Step(step);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  ASSERT_EQ(ok->tokens.size(), 1u);
  EXPECT_TRUE(ok->tokens[0].token >= 0 && ok->tokens[0].token < 1024);
  EXPECT_TRUE(gpu->healthy());
}

}  // namespace
}  // namespace tpserve
