// The CUDA model (engine/cuda_model.h) against the CPU reference model on the
// same random weights, on 2 GPUs (ranks as threads). Skipped without 2 GPUs.
//
// Tolerance: the GPU keeps activations in BF16 between ops (the CPU model in
// FP32) and attention multiplies BF16 probabilities, so logits differ by a
// few BF16 roundings per layer, amplified through FP8 requantization: relative
// Frobenius error <= 5e-2 over all logits, and the top-1 token of every
// sequence equal unless the reference's top two are within 2 % of the
// reference's largest |logit| of each other.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/nccl_thread_group.h"
#include "engine/cpu_model.h"
#include "engine/cuda_model.h"
#include "layers/overlap_config.h"
#include "tests/checkpoint_test_util.h"

namespace tpserve {
namespace {

constexpr int kTp = 2;

// The tiny preset: hidden 512 = 8 heads of 64 (the attention kernel's
// smallest head_dim), 4 KV heads, 2 layers, vocab 1024.
ModelConfig SmallConfig() { return *ModelPreset("tiny"); }

struct Comparison {
  double rel_frobenius = 0;
  int top1_mismatches = 0;  // outside near-ties
};

Comparison Compare(const std::vector<float>& gpu, const std::vector<float>& ref, int64_t seqs,
                   int64_t vocab) {
  Comparison out;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(gpu[i]) - ref[i];
    num += std::isfinite(d) ? d * d : 1e30;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  out.rel_frobenius = std::sqrt(num / std::max(den, 1e-30));
  for (int64_t s = 0; s < seqs; ++s) {
    const float* r = ref.data() + s * vocab;
    const float* g = gpu.data() + s * vocab;
    std::vector<int64_t> idx(vocab);
    for (int64_t j = 0; j < vocab; ++j) idx[j] = j;
    std::partial_sort(idx.begin(), idx.begin() + 2, idx.end(),
                      [&](int64_t a, int64_t b) { return r[a] > r[b]; });
    const int64_t gpu_top = std::max_element(g, g + vocab) - g;
    float scale = 0;
    for (int64_t j = 0; j < vocab; ++j) scale = std::max(scale, std::fabs(r[j]));
    const bool near_tie = r[idx[0]] - r[idx[1]] < 0.02f * scale;
    if (gpu_top != idx[0] && !near_tie) ++out.top1_mismatches;
  }
  return out;
}

class GpuModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() < kTp) GTEST_SKIP() << "needs " << kTp << " GPUs";
    auto g = NcclThreadGroup::Create(kTp);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    group_ = std::move(g).value();
  }
  void TearDown() override { group_.reset(); }

  void CheckAgainstCpu(DataType dtype, const OverlapConfig* overlap) {
    const ModelConfig c = SmallConfig();
    ASSERT_TRUE(c.ValidateForTp(kTp).ok());
    // Awkward lengths; 37 + 5 + 100 + 1 = 143 tokens (odd: padded to 144).
    auto batch = PackSequences(
        {std::vector<int32_t>(37, 3), {1, 2, 3, 4, 5}, std::vector<int32_t>(100, 0), {1023}},
        c.vocab_size, c.max_position_embeddings);
    ASSERT_TRUE(batch.ok()) << batch.status().ToString();
    for (int64_t i = 0; i < batch->tokens(); ++i) batch->ids[i] = (i * 7919 + 13) % c.vocab_size;
    auto ref = RunCpuModel(c, kTp, dtype, /*seed=*/11, "", overlap, *batch);
    ASSERT_TRUE(ref.ok()) << ref.status().ToString();
    auto gpu = RunCudaModel(c, *group_, dtype, /*seed=*/11, overlap, *batch);
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    ASSERT_EQ(gpu->size(), ref->size());
    const Comparison cmp = Compare(*gpu, *ref, batch->sequences(), c.vocab_size);
    EXPECT_LE(cmp.rel_frobenius, 5e-2);
    EXPECT_EQ(cmp.top1_mismatches, 0);
    std::printf("[ model    ] %s: rel_frobenius %.3g, top-1 mismatches %d of %lld\n",
                DataTypeName(dtype).data(), cmp.rel_frobenius, cmp.top1_mismatches,
                static_cast<long long>(batch->sequences()));
  }

  std::unique_ptr<NcclThreadGroup> group_;
};

TEST_F(GpuModelTest, Fp8LogitsMatchCpuReference) {
  CheckAgainstCpu(DataType::kFloat8E4M3, nullptr);
}

TEST_F(GpuModelTest, Bf16LogitsMatchCpuReference) { CheckAgainstCpu(DataType::kBFloat16, nullptr); }

TEST_F(GpuModelTest, OverlappedLayersGiveTheSameLogitsAsModeNone) {
  // Every layer ring with 2 chunks (AG+GEMM and GEMM+RS), from a config file.
  auto overlap = OverlapConfig::Parse("version: 1\ndefaults:\n  mode: ring\n  chunks: 2\n",
                                      "test-overlap.yaml");
  ASSERT_TRUE(overlap.ok()) << overlap.status().ToString();
  CheckAgainstCpu(DataType::kFloat8E4M3, &*overlap);
}

TEST_F(GpuModelTest, GraphReplayEqualsEagerAndServesOtherBatchesOfTheBucket) {
  // The first Forward of a bucket runs eagerly and captures the bucket's
  // graph; later ones replay it. Replaying the same batch must give the
  // eager logits bit for bit, and a different batch of the same bucket its
  // own (CPU-reference) logits, not stale ones.
  const ModelConfig c = SmallConfig();
  auto first = PackSequences({std::vector<int32_t>(50, 5), {9, 8, 7}}, c.vocab_size,
                             c.max_position_embeddings);
  auto second = PackSequences({{1, 2, 3, 4}, std::vector<int32_t>(40, 77), {1000}}, c.vocab_size,
                              c.max_position_embeddings);
  ASSERT_TRUE(first.ok() && second.ok());
  std::vector<std::vector<float>> got(3);
  Status s = group_->Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(RankWeights w, MakeRandomRankWeights(c, DataType::kFloat8E4M3, kTp, r, 11));
    CudaModelOptions o;
    o.max_tokens = 64;
    o.max_seqs = 4;
    o.buckets = {64};
    TP_ASSIGN_OR_RETURN(auto model, CudaModel::Create(c, w, nullptr, group_->pool(r), o));
    const TokenBatch* order[3] = {&*first, &*first, &*second};
    for (int i = 0; i < 3; ++i) {
      TP_ASSIGN_OR_RETURN(std::vector<float> logits, model->Forward(*order[i]));
      if (r == 0) got[i] = std::move(logits);
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(got[0], got[1]) << "graph replay differs from the eager run";
  auto ref = RunCpuModel(c, kTp, DataType::kFloat8E4M3, 11, "", nullptr, *second);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  const Comparison cmp = Compare(got[2], *ref, second->sequences(), c.vocab_size);
  EXPECT_LE(cmp.rel_frobenius, 5e-2);
  EXPECT_EQ(cmp.top1_mismatches, 0);
}

// A checkpoint without input scales whose activations reach far beyond 8
// (RMSNorm gain 12): the FP8 inputs are scaled per batch (amax, then one
// float AllGathered per layer inside the captured graph). The GPU must agree
// with the CPU reference's dynamic scaling, in mode none and with ring
// overlap, and a graph replay must equal the eager run. Tolerance: this
// model amplifies rounding differences, so the bound is the larger of 5e-2
// and twice what the same comparison gives with the checkpoint's static
// scales kept (both sides then saturate alike at 8).
TEST_F(GpuModelTest, DynamicInputScalesMatchCpuReferenceAndReplayEqualsEager) {
  const ModelConfig c = SmallConfig();
  const std::string dir = ::testing::TempDir() + "/tpserve_gpu_dynamic";
  std::filesystem::remove_all(dir);
  WriteLoudCheckpoint(c, dir + "/dynamic", 12.0f, false);
  WriteLoudCheckpoint(c, dir + "/static", 12.0f, true);
  auto batch =
      PackSequences({std::vector<int32_t>(37, 3), {1, 2, 3, 4, 5}, std::vector<int32_t>(100, 0)},
                    c.vocab_size, c.max_position_embeddings);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  for (int64_t i = 0; i < batch->tokens(); ++i) batch->ids[i] = (i * 7919 + 13) % c.vocab_size;
  auto ring = OverlapConfig::Parse("version: 1\ndefaults:\n  mode: ring\n  chunks: 2\n",
                                   "test-overlap.yaml");
  ASSERT_TRUE(ring.ok()) << ring.status().ToString();
  // GPU logits (eager, then replayed) and their comparison with the CPU's.
  auto run = [&](const std::string& ckpt, const OverlapConfig* overlap) {
    std::vector<std::vector<float>> got(2);
    Status s = group_->Run([&](int r) -> Status {
      TP_ASSIGN_OR_RETURN(RankWeights w, LoadRankWeights(ckpt, c, kTp, r));
      CudaModelOptions o;
      o.max_tokens = batch->tokens();
      o.max_seqs = batch->sequences();
      TP_ASSIGN_OR_RETURN(auto model, CudaModel::Create(c, w, overlap, group_->pool(r), o));
      for (int i = 0; i < 2; ++i) {
        TP_ASSIGN_OR_RETURN(std::vector<float> logits, model->Forward(*batch));
        if (r == 0) got[i] = std::move(logits);
      }
      return Status::Ok();
    });
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(got[0], got[1]) << ckpt << ": graph replay differs from the eager run";
    auto ref = RunCpuModel(c, kTp, DataType::kFloat8E4M3, 7, ckpt, overlap, *batch);
    EXPECT_TRUE(ref.ok()) << ref.status().ToString();
    if (!s.ok() || !ref.ok() || got[0].size() != ref->size()) return Comparison{1e9, 1000};
    return Compare(got[0], *ref, batch->sequences(), c.vocab_size);
  };
  const Comparison fixed = run(dir + "/static", nullptr);
  const OverlapConfig* ring_config = &*ring;
  for (const OverlapConfig* overlap : {static_cast<const OverlapConfig*>(nullptr), ring_config}) {
    SCOPED_TRACE(overlap == nullptr ? "mode none" : "ring, 2 chunks");
    const Comparison dyn = run(dir + "/dynamic", overlap);
    std::printf("[ dynamic  ] %s: rel_frobenius %.3g (static scales: %.3g), top-1 mismatches %d\n",
                overlap == nullptr ? "none" : "ring", dyn.rel_frobenius, fixed.rel_frobenius,
                dyn.top1_mismatches);
    EXPECT_LE(dyn.rel_frobenius, std::max(5e-2, 2 * fixed.rel_frobenius));
    EXPECT_EQ(dyn.top1_mismatches, 0);
  }
  std::filesystem::remove_all(dir);
}

TEST_F(GpuModelTest, BatchOverTheLimitsIsRejected) {
  const ModelConfig c = SmallConfig();
  Status s = group_->Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(RankWeights w, MakeRandomRankWeights(c, DataType::kFloat8E4M3, kTp, r, 1));
    CudaModelOptions o;
    o.max_tokens = 8;
    o.max_seqs = 2;
    TP_ASSIGN_OR_RETURN(auto model, CudaModel::Create(c, w, nullptr, group_->pool(r), o));
    TP_ASSIGN_OR_RETURN(TokenBatch b, PackSequences({std::vector<int32_t>(9, 1)}, c.vocab_size,
                                                    c.max_position_embeddings));
    auto logits = model->Forward(b);
    if (logits.ok() || logits.status().code() != StatusCode::kInvalidArgument) {
      return InternalError("a 9-token batch on an 8-token model was not rejected");
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.ToString();
}

}  // namespace
}  // namespace tpserve
