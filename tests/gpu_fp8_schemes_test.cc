// FP8 checkpoints with per-channel and block-wise weight scales on the CUDA engine at tp 1 (one
// GPU): each layer runs the checkpoint's scheme inside its GEMM (per-token x per-channel, or
// 1x128 x 128x128 scales), against the CPU reference of the same weights. Skipped without a GPU.
//
// Tolerance as in gpu_model_test.cc (BF16 activations between the GPU's ops against the CPU's
// FP32): relative Frobenius error <= 5e-2, top-1 equal outside near-ties.
//
// The checkpoint as written (random rows, scales within 2x of each other) is held to that bound.
// It cannot tell a right GEMM from a wrong one, though: on such rows one scale per tensor loses
// almost nothing (E4M3 spans 2^17). So the weights' scales are then spread far beyond that
// (codes unchanged; a different model, the same on both sides): in qkv the q rows 2^15 larger
// and the k rows 2^12 smaller, in gate_up the gate rows 2^15 larger. One scale per tensor (a
// fold, what the engine does at tp > 1) puts the k and up rows into or under E4M3's
// subnormals, and a GEMM that put the weight scales on the wrong rows, or used one for all,
// lands near the model before the spread; the GPU's logits must be far nearer the scheme's
// CPU reference than either.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm/local_communicator.h"
#include "comm/nccl_thread_group.h"
#include "engine/cpu_model.h"
#include "engine/cuda_model.h"
#include "engine/cuda_ops.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "engine/token_batch.h"
#include "layers/fp8.h"
#include "layers/overlap_config.h"
#include "layers/quantize_kernels.h"
#include "tests/gpu_test_util.h"

namespace tpserve {
namespace {

constexpr double kBound = 5e-2;
constexpr float kQUp = 32768.0f;       // 2^15
constexpr float kKDown = 1.0f / 4096;  // 2^-12

TokenBatch AwkwardBatch(const ModelConfig& c, std::vector<std::vector<int32_t>> seqs) {
  auto batch = PackSequences(seqs, c.vocab_size, c.max_position_embeddings);
  EXPECT_TRUE(batch.ok()) << batch.status().ToString();
  for (int64_t i = 0; i < batch->tokens(); ++i) batch->ids[i] = (i * 7919 + 13) % c.vocab_size;
  return *std::move(batch);
}

// Multiplies the scales of qkv's rows [begin, end) by `f`: per channel, those rows'; block-wise,
// the 128-row blocks they make up (begin and end multiples of 128).
void ScaleRows(LinearWeight& w, int64_t begin, int64_t end, float f) {
  if (w.scheme == Fp8Scheme::kPerChannel) {
    for (int64_t r = begin; r < end; ++r) w.weight_scales[r] *= f;
  } else {
    const int64_t cols = (w.k + kFp8BlockSize - 1) / kFp8BlockSize;
    for (int64_t b = begin / kFp8BlockSize; b < end / kFp8BlockSize; ++b) {
      for (int64_t c = 0; c < cols; ++c) w.weight_scales[b * cols + c] *= f;
    }
  }
  w.weight_scale = *std::max_element(w.weight_scales.begin(), w.weight_scales.end());
}

// The spread of scales described at the top, in every block of a tp-1 model (qkv: q rows
// [0, heads x head_dim), then the k rows; gate_up: the gate rows first).
void SpreadScales(RankWeights& w, const ModelConfig& c) {
  const int64_t hd = c.head_dim(), q_rows = c.num_attention_heads * hd;
  for (LayerWeights& l : w.layers) {
    ScaleRows(l.qkv, 0, q_rows, kQUp);
    ScaleRows(l.qkv, q_rows, q_rows + c.num_key_value_heads * hd, kKDown);
    ScaleRows(l.gate_up, 0, c.intermediate_size, kQUp);
  }
}

// Every FP8 layer requantized to one scale per tensor (the largest), with per-batch input
// scales: what a fold gives.
void FoldToPerTensor(RankWeights& w) {
  for (LayerWeights& l : w.layers) {
    for (LinearWeight* lw : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      std::vector<float> values(lw->data.size());
      DequantizeWeightsFp8(lw->scheme, lw->data, lw->weight_scales, lw->n, lw->k, values);
      lw->weight_scale = *std::max_element(lw->weight_scales.begin(), lw->weight_scales.end());
      QuantizeFp8(values, lw->weight_scale, Fp8Format::kE4M3, lw->data);
      lw->scheme = Fp8Scheme::kPerTensor;
      lw->weight_scales.clear();
      lw->dynamic_input = true;
    }
  }
}

StatusOr<std::vector<float>> CpuLogits(const ModelConfig& c, const RankWeights& w,
                                       const TokenBatch& batch) {
  std::vector<float> out;
  TP_RETURN_IF_ERROR(RunOnLocalRanks(1, [&](Communicator& comm) -> Status {
    TP_ASSIGN_OR_RETURN(auto model, CpuModel::Create(c, w, nullptr, comm));
    TP_ASSIGN_OR_RETURN(out, model->Forward(batch));
    return Status::Ok();
  }));
  return out;
}

// The GPU's logits of `batch`: run eagerly, then (after `other`) replayed from its graph.
struct GpuLogits {
  std::vector<float> eager, replay;
};
StatusOr<GpuLogits> RunOnGpu(const ModelConfig& c, const RankWeights& w, const TokenBatch& batch,
                             const TokenBatch& other, bool residual_in_gemm = true,
                             const OverlapConfig* overlap = nullptr) {
  TP_ASSIGN_OR_RETURN(auto group, NcclThreadGroup::Create(1));
  GpuLogits out;
  TP_RETURN_IF_ERROR(group->Run([&](int r) -> Status {
    CudaModelOptions o;
    o.residual_in_gemm = residual_in_gemm;
    o.max_tokens = batch.tokens();
    o.max_seqs = batch.sequences();
    TP_ASSIGN_OR_RETURN(auto model, CudaModel::Create(c, w, overlap, group->pool(r), o));
    TP_ASSIGN_OR_RETURN(out.eager, model->Forward(batch));
    TP_RETURN_IF_ERROR(model->Forward(other).status());
    TP_ASSIGN_OR_RETURN(out.replay, model->Forward(batch));
    return model->Close();
  }));
  return out;
}

class GpuFp8SchemesTest : public ::testing::TestWithParam<Fp8Scheme> {
 protected:
  void SetUp() override {
    if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(GpuFp8SchemesTest, CheckpointRunsItsSchemeAtTp1) {
  const Fp8Scheme scheme = GetParam();
  const ModelConfig c = *ModelPreset("tiny");
  const std::string dir =
      ::testing::TempDir() + "/tpserve_gpu_scheme_" + std::string(Fp8SchemeName(scheme));
  std::filesystem::remove_all(dir);
  TP_ASSERT_OK(WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir, scheme));
  TP_ASSERT_OK_AND_ASSIGN(const RankWeights plain, LoadRankWeights(dir, c, 1, 0));
  std::filesystem::remove_all(dir);
  ASSERT_EQ(plain.layers[0].qkv.scheme, scheme) << "the loader kept the checkpoint's scheme";
  RankWeights spread = plain;
  SpreadScales(spread, c);
  RankWeights folded = spread;
  FoldToPerTensor(folded);
  // 143 tokens (a block-wise model's buckets are multiples of 4: 144).
  const TokenBatch batch = AwkwardBatch(
      c, {std::vector<int32_t>(37, 3), {1, 2, 3, 4, 5}, std::vector<int32_t>(100, 0), {1023}});
  const TokenBatch other = AwkwardBatch(c, {std::vector<int32_t>(60, 9), {5, 6, 7}});
  auto cmp = [&](const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    return a.size() == b.size() ? Compare(a, b, batch.sequences(), c.vocab_size)
                                : Comparison{1e9, 1000};
  };

  // The checkpoint as written: as close to the CPU as every FP8 model test holds the GPU.
  TP_ASSERT_OK_AND_ASSIGN(const std::vector<float> plain_ref, CpuLogits(c, plain, batch));
  TP_ASSERT_OK_AND_ASSIGN(const GpuLogits plain_gpu, RunOnGpu(c, plain, batch, other));
  EXPECT_EQ(plain_gpu.eager, plain_gpu.replay) << "graph replay differs from the eager run";
  const Comparison on_plain = cmp(plain_gpu.eager, plain_ref);
  EXPECT_LE(on_plain.rel_frobenius, kBound);
  EXPECT_EQ(on_plain.top1_mismatches, 0);

  // The spread scales: sharper attention and a louder MLP amplify the GPU's BF16 roundings
  // (measured 0.065-0.076), so the bound is 2x that; the GPU's logits must also sit far
  // nearer the scheme's reference than the fold's or the unspread model's.
  TP_ASSERT_OK_AND_ASSIGN(const std::vector<float> ref, CpuLogits(c, spread, batch));
  TP_ASSERT_OK_AND_ASSIGN(const std::vector<float> folded_ref, CpuLogits(c, folded, batch));
  TP_ASSERT_OK_AND_ASSIGN(const GpuLogits gpu, RunOnGpu(c, spread, batch, other));
  EXPECT_EQ(gpu.eager, gpu.replay) << "graph replay differs from the eager run";
  const Comparison on_spread = cmp(gpu.eager, ref);
  const Comparison to_fold = cmp(gpu.eager, folded_ref);
  const Comparison to_plain = cmp(gpu.eager, plain_ref);
  std::printf(
      "[ fp8 scheme ] %s at tp 1, GPU vs CPU rel_frobenius (top-1 mismatches): checkpoint %.3g "
      "(%d); spread scales %.3g (%d), against the CPU's fold to per tensor %.3g (%d), against "
      "the unspread model %.3g (%d)\n",
      Fp8SchemeName(scheme), on_plain.rel_frobenius, on_plain.top1_mismatches,
      on_spread.rel_frobenius, on_spread.top1_mismatches, to_fold.rel_frobenius,
      to_fold.top1_mismatches, to_plain.rel_frobenius, to_plain.top1_mismatches);
  EXPECT_LE(on_spread.rel_frobenius, 3 * kBound);
  EXPECT_EQ(on_spread.top1_mismatches, 0);
  EXPECT_GT(to_fold.rel_frobenius, 3 * on_spread.rel_frobenius) << "nearer a fold than the scheme";
  EXPECT_GT(to_plain.rel_frobenius, 3 * on_spread.rel_frobenius) << "the spread scales are lost";

  // The same model with every layer in chunks (pipeline 4, ring 2): each chunk's GEMM reads its
  // rows' scales from a scale slot (layers/scale_slots.h) that the layer fills from the
  // caller's. Against the one-GEMM run above: a few BF16 roundings apart (cuBLASLt may pick
  // other kernels for the chunks' M), where a chunk reading another chunk's scales rescales
  // whole rows by the ratio of two tokens' amaxes.
  for (const char* mode : {"mode: pipeline\n  chunks: 4", "mode: ring\n  chunks: 2"}) {
    SCOPED_TRACE(mode);
    auto overlap = OverlapConfig::Parse(std::string("version: 1\ndefaults:\n  ") + mode + "\n",
                                        "test-overlap.yaml");
    ASSERT_TRUE(overlap.ok()) << overlap.status().ToString();
    TP_ASSERT_OK_AND_ASSIGN(const GpuLogits chunked,
                            RunOnGpu(c, spread, batch, other, true, &*overlap));
    EXPECT_EQ(chunked.eager, chunked.replay) << "graph replay differs from the eager run";
    const Comparison to_one = cmp(chunked.eager, gpu.eager);
    const Comparison to_ref = cmp(chunked.eager, ref);
    std::printf(
        "[ fp8 scheme ] %s at tp 1 in chunks (%s): vs one GEMM %.3g (%d), vs CPU %.3g (%d)\n",
        Fp8SchemeName(scheme), mode, to_one.rel_frobenius, to_one.top1_mismatches,
        to_ref.rel_frobenius, to_ref.top1_mismatches);
    EXPECT_LE(to_one.rel_frobenius, 1e-2);
    EXPECT_LE(to_ref.rel_frobenius, 3 * kBound);
    EXPECT_EQ(to_ref.top1_mismatches, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Schemes, GpuFp8SchemesTest,
                         ::testing::Values(Fp8Scheme::kPerChannel, Fp8Scheme::kBlock),
                         [](const auto& p) { return std::string(Fp8SchemeName(p.param)); });

// CudaModelOptions::residual_in_gemm (the default at tp 1: o and down add into the residual
// stream in their GEMMs' epilogue) against the norm adding a separate product: both within the
// model bound of the CPU reference, FP8 and BF16, eagerly and replayed alike, and within a few
// BF16 roundings of each other (the product rounded before the add, or not). A residual added
// twice or lost moves the logits by far more than either bound.
TEST(GpuResidualTest, ResidualInTheGemmMatchesTheNormsAddAndTheCpu) {
  if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = *ModelPreset("tiny");
  const TokenBatch batch = AwkwardBatch(
      c, {std::vector<int32_t>(37, 3), {1, 2, 3, 4, 5}, std::vector<int32_t>(100, 0), {1023}});
  const TokenBatch other = AwkwardBatch(c, {std::vector<int32_t>(60, 9), {5, 6, 7}});
  for (DataType dtype : {DataType::kFloat8E4M3, DataType::kBFloat16}) {
    SCOPED_TRACE(DataTypeName(dtype));
    TP_ASSERT_OK_AND_ASSIGN(const RankWeights w, MakeRandomRankWeights(c, dtype, 1, 0, 5));
    TP_ASSERT_OK_AND_ASSIGN(const std::vector<float> ref, CpuLogits(c, w, batch));
    TP_ASSERT_OK_AND_ASSIGN(const GpuLogits in_gemm, RunOnGpu(c, w, batch, other, true));
    TP_ASSERT_OK_AND_ASSIGN(const GpuLogits in_norm, RunOnGpu(c, w, batch, other, false));
    EXPECT_EQ(in_gemm.eager, in_gemm.replay) << "graph replay differs from the eager run";
    ASSERT_EQ(in_gemm.eager.size(), ref.size());
    ASSERT_EQ(in_norm.eager.size(), ref.size());
    const Comparison gemm_cpu = Compare(in_gemm.eager, ref, batch.sequences(), c.vocab_size);
    const Comparison norm_cpu = Compare(in_norm.eager, ref, batch.sequences(), c.vocab_size);
    const Comparison between =
        Compare(in_gemm.eager, in_norm.eager, batch.sequences(), c.vocab_size);
    std::printf(
        "[ residual ] %s: in the GEMM vs CPU %.3g, in the norm vs CPU %.3g, between them %.3g "
        "(rel_frobenius)\n",
        DataTypeName(dtype).data(), gemm_cpu.rel_frobenius, norm_cpu.rel_frobenius,
        between.rel_frobenius);
    EXPECT_LE(gemm_cpu.rel_frobenius, kBound);
    EXPECT_EQ(gemm_cpu.top1_mismatches, 0);
    EXPECT_LE(norm_cpu.rel_frobenius, kBound);
    EXPECT_LE(between.rel_frobenius, 2e-2);
    EXPECT_EQ(between.top1_mismatches, 0);
  }
}

// A model of random weights in every scheme (CudaModelOptions::scale_scheme, what the model
// benchmark measures): the pass runs, eagerly and replayed alike, and its logits are finite.
TEST(GpuFp8SchemesRandomTest, RandomModelRunsEveryScheme) {
  if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = *ModelPreset("tiny");
  const TokenBatch batch = AwkwardBatch(c, {std::vector<int32_t>(37, 3), {1, 2, 3, 4, 5}});
  const TokenBatch other = AwkwardBatch(c, {std::vector<int32_t>(20, 9)});
  TP_ASSERT_OK_AND_ASSIGN(auto group, NcclThreadGroup::Create(1));
  for (GemmScaleScheme s : {GemmScaleScheme::kPerTokenChannel, GemmScaleScheme::kBlockwise}) {
    SCOPED_TRACE(GemmScaleSchemeName(s));
    std::vector<float> first, again;
    TP_ASSERT_OK(group->Run([&](int r) -> Status {
      CudaModelOptions o;
      o.max_tokens = 64;
      o.max_seqs = 4;
      o.scale_scheme = s;
      TP_ASSIGN_OR_RETURN(auto model, CudaModel::CreateRandom(c, DataType::kFloat8E4M3, 3, nullptr,
                                                              group->pool(r), o));
      TP_ASSIGN_OR_RETURN(first, model->Forward(batch));
      TP_RETURN_IF_ERROR(model->Forward(other).status());
      TP_ASSIGN_OR_RETURN(again, model->Forward(batch));
      return model->Close();
    }));
    ASSERT_EQ(first.size(), static_cast<size_t>(batch.sequences() * c.vocab_size));
    EXPECT_EQ(first, again);
    EXPECT_TRUE(std::all_of(first.begin(), first.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_GT(*std::max_element(first.begin(), first.end()), 0.0f) << "all logits zero or less";
  }
}

// CudaModelOptions::residual_gain (tpserve-bench-model --residual-gain) scales what o and down
// add to the residual stream, and nothing else: at a vanishing gain two sequences that end in
// the same token get the same logits (the blocks add almost nothing to that token's embedding),
// at gain 1 they do not (the blocks carry the different prompts); a gain that is not positive
// is refused before anything is allocated.
TEST(GpuFp8SchemesRandomTest, ResidualGainScalesWhatTheBlocksAdd) {
  if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = *ModelPreset("tiny");
  auto packed = PackSequences({{5, 9, 11, 300, 42}, {700, 3, 8, 1, 42}}, c.vocab_size,
                              c.max_position_embeddings);
  ASSERT_TRUE(packed.ok()) << packed.status().ToString();
  TP_ASSERT_OK_AND_ASSIGN(auto group, NcclThreadGroup::Create(1));
  auto logits_at = [&](float gain, std::vector<float>* out) -> Status {
    return group->Run([&](int r) -> Status {
      CudaModelOptions o;
      o.max_tokens = 64;
      o.max_seqs = 4;
      o.residual_gain = gain;
      TP_ASSIGN_OR_RETURN(auto model, CudaModel::CreateRandom(c, DataType::kFloat8E4M3, 3, nullptr,
                                                              group->pool(r), o));
      TP_ASSIGN_OR_RETURN(*out, model->Forward(*packed));
      return model->Close();
    });
  };
  // ||row 1 - row 0|| / ||row 0|| of one Forward's logits.
  auto apart = [&](const std::vector<float>& l) {
    const size_t v = static_cast<size_t>(c.vocab_size);
    double num = 0, den = 0;
    for (size_t i = 0; i < v; ++i) {
      num += (l[v + i] - l[i]) * static_cast<double>(l[v + i] - l[i]);
      den += static_cast<double>(l[i]) * l[i];
    }
    return std::sqrt(num / den);
  };
  std::vector<float> vanishing, one;
  TP_ASSERT_OK(logits_at(1e-4f, &vanishing));
  TP_ASSERT_OK(logits_at(1.0f, &one));
  ASSERT_EQ(vanishing.size(), 2u * c.vocab_size);
  ASSERT_EQ(one.size(), 2u * c.vocab_size);
  EXPECT_LT(apart(vanishing), 1e-2);
  EXPECT_GT(apart(one), 1e-1);
  for (const float bad : {0.0f, -1.0f}) {
    std::vector<float> unused;
    const Status s = logits_at(bad, &unused);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("residual_gain"), std::string::npos) << s.ToString();
  }
}

// RMSNorm and SwiGLU with out_fp8_scales (what the engine runs for a fine layer's input) give
// the codes and scales that quantizing their BF16 output with LaunchQuantizeFp8Dynamic gives,
// bit for bit: per row and per 1x128 group, rows of magnitudes 2^-10 .. 2^9 apart and an
// all-zero row (scale 1).
class GpuOwnScalesTest : public GpuStreamTest {};

TEST_F(GpuOwnScalesTest, FusedQuantizationEqualsQuantizingTheBf16Output) {
  TP_SKIP_WITHOUT_GPU();
  const int64_t rows = 37;
  for (const int64_t cols : {256, 1408, 4096, 14336}) {
    for (const Fp8ScaleGranularity g :
         {Fp8ScaleGranularity::kPerRow, Fp8ScaleGranularity::kPerGroup128}) {
      const bool group = g == Fp8ScaleGranularity::kPerGroup128;
      SCOPED_TRACE("cols " + std::to_string(cols) + (group ? ", 1x128 groups" : ", per row"));
      const size_t n = static_cast<size_t>(rows * cols);
      const size_t n_scales = group ? n / 128 : static_cast<size_t>(rows);
      // Inputs: rows scaled by 2^(r % 20 - 10), row 5 zero.
      auto loud = [&](size_t count, int64_t row_len, uint32_t seed) {
        std::vector<BFloat16> v = RandomBf16(count, -2.0f, 2.0f, seed);
        for (size_t i = 0; i < count; ++i) {
          const int64_t r = static_cast<int64_t>(i) / row_len;
          const float f = r == 5 ? 0.0f : std::ldexp(BFloat16ToFloat(v[i]), r % 20 - 10);
          v[i] = FloatToBFloat16(f);
        }
        return v;
      };
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer x, Upload(loud(n, cols, 1), "x"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer res, Upload(RandomBf16(n, -1.0f, 1.0f, 2), "res"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer w, Upload(RandomBf16(cols, 0.5f, 1.5f, 3), "w"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer gate_up, Upload(loud(2 * n, 2 * cols, 4), "gate_up"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer res_out, DeviceBuffer::Allocate(2 * n, "res_out"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer bf16, DeviceBuffer::Allocate(2 * n, "bf16"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer codes_a, DeviceBuffer::Allocate(n, "codes_a"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer codes_b, DeviceBuffer::Allocate(n, "codes_b"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer scales_a, DeviceBuffer::Allocate(4 * n_scales, "sa"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer scales_b, DeviceBuffer::Allocate(4 * n_scales, "sb"));
      auto staged = [&]() -> Status {  // BF16 output, then the dynamic quantize kernel
        QuantizeFp8DynamicParams q;
        q.input = bf16.data();
        q.output = codes_a.as<uint8_t>();
        q.scales = scales_a.as<float>();
        q.rows = rows;
        q.cols = cols;
        q.granularity = g;
        return LaunchQuantizeFp8Dynamic(q, stream());
      };
      auto expect_same = [&](const char* op) {
        ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);
        TP_ASSERT_OK_AND_ASSIGN(auto a, Download<uint8_t>(codes_a.data(), n));
        TP_ASSERT_OK_AND_ASSIGN(auto b, Download<uint8_t>(codes_b.data(), n));
        TP_ASSERT_OK_AND_ASSIGN(auto sa, Download<uint32_t>(scales_a.data(), n_scales));
        TP_ASSERT_OK_AND_ASSIGN(auto sb, Download<uint32_t>(scales_b.data(), n_scales));
        EXPECT_EQ(sa, sb) << op << ": scales differ";
        EXPECT_EQ(a, b) << op << ": codes differ";
        EXPECT_NE(sa[0], sa[1]) << "rows 0 and 1 (2^-10, 2^-9) should differ in scale";
      };
      if (cols <= 16384) {
        RmsNormParams p;
        p.input = x.as<BFloat16>();
        p.residual = res.as<BFloat16>();
        p.residual_out = res_out.as<BFloat16>();
        p.weight = w.as<BFloat16>();
        p.rows = rows;
        p.dim = cols;
        p.out = bf16.as<BFloat16>();
        TP_ASSERT_OK(LaunchRmsNorm(p, stream()));
        TP_ASSERT_OK(staged());
        p.out = nullptr;
        p.out_fp8 = codes_b.as<uint8_t>();
        p.out_fp8_scales = scales_b.as<float>();
        p.out_fp8_granularity = g;
        TP_ASSERT_OK(LaunchRmsNorm(p, stream()));
        expect_same("rms_norm");
      }
      SwiGluParams sw;
      sw.gate_up = gate_up.as<BFloat16>();
      sw.rows = rows;
      sw.inter = cols;
      sw.out = bf16.as<BFloat16>();
      TP_ASSERT_OK(LaunchSwiGlu(sw, stream()));
      TP_ASSERT_OK(staged());
      sw.out = nullptr;
      sw.out_fp8 = codes_b.as<uint8_t>();
      sw.out_fp8_scales = scales_b.as<float>();
      sw.out_fp8_granularity = g;
      TP_ASSERT_OK(LaunchSwiGlu(sw, stream()));
      expect_same("swiglu");
    }
  }
}

// The launchers refuse what the fused path cannot do, naming the field.
TEST(OwnScalesParamsTest, InvalidCombinationsAreRefused) {
  float scale_storage[4];
  uint8_t codes[16];
  SwiGluParams sw;
  sw.rows = 0;  // nothing would launch: only the checks run
  sw.inter = 136;
  sw.out_fp8 = codes;
  sw.out_fp8_scales = scale_storage;
  sw.out_fp8_granularity = Fp8ScaleGranularity::kPerGroup128;
  Status s = LaunchSwiGlu(sw, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("inter"), std::string::npos) << s.ToString();
  sw.out_fp8_granularity = Fp8ScaleGranularity::kPerRow;
  sw.out_fp8_scale = scale_storage;
  s = LaunchSwiGlu(sw, nullptr);
  EXPECT_NE(s.message().find("out_fp8_scale"), std::string::npos) << s.ToString();
  RmsNormParams p;
  p.rows = 0;
  p.dim = 64;
  p.out_fp8_scales = scale_storage;
  p.out = reinterpret_cast<BFloat16*>(codes);
  s = LaunchRmsNorm(p, nullptr);
  EXPECT_NE(s.message().find("needs out_fp8"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace tpserve
