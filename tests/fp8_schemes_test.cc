// FP8 scale schemes (per tensor, per channel + per token, 128x128 blocks + 1x128 groups): the
// CPU reference against an unquantized FP64 product within a derived bound, the loader's
// reading, sharding and refusal of scale tensors, and the CPU engine on make-checkpoint's
// output of each scheme against the BF16 model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/cpu_model.h"
#include "engine/fp8_checkpoint_scales.h"
#include "engine/model_weights.h"
#include "engine/safetensors.h"
#include "layers/cpu_linear.h"
#include "layers/fp8.h"
#include "tests/checkpoint_test_util.h"

namespace tpserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr Fp8Scheme kSchemes[] = {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel, Fp8Scheme::kBlock};

// A quantized GEMM problem: X [m, k], W [n, k] in float, their codes and scales per scheme.
struct Problem {
  int64_t m, n, k;
  std::vector<float> x, w;
};

struct Quantized {
  std::vector<uint8_t> xq, wq;
  std::vector<float> xs, ws;
};

Quantized Quantize(const Problem& p, Fp8Scheme s) {
  Quantized q;
  q.xq.resize(p.x.size());
  q.wq.resize(p.w.size());
  q.xs.resize(s == Fp8Scheme::kPerTensor ? 1 : p.m * Fp8ActivationScalesPerRow(s, p.k));
  q.ws.resize(Fp8WeightScaleCount(s, p.n, p.k));
  QuantizeActivationsFp8(s, p.x, p.k, q.xq, q.xs);
  QuantizeWeightsFp8(s, p.w, p.n, p.k, q.wq, q.ws);
  return q;
}

std::vector<float> RunReference(const Problem& p, Fp8Scheme s, const Quantized& q) {
  std::vector<BFloat16> y(p.m * p.n);
  const Status st = ReferenceLinearFp8(s, p.m, p.n, p.k, q.xq, q.xs, q.wq, q.ws, y);
  EXPECT_TRUE(st.ok()) << st.ToString();
  std::vector<float> out(y.size());
  for (size_t i = 0; i < y.size(); ++i) out[i] = BFloat16ToFloat(y[i]);
  return out;
}

std::vector<double> Fp64Product(const Problem& p) {
  std::vector<double> y(p.m * p.n);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double acc = 0;
      for (int64_t t = 0; t < p.k; ++t) acc += double(p.x[i * p.k + t]) * p.w[j * p.k + t];
      y[i * p.n + j] = acc;
    }
  }
  return y;
}

// dequant(Xq) and dequant(Wq) in float, through the layout functions (not the GEMM's).
struct Dequantized {
  std::vector<float> x, w;
};

Dequantized Dequantize(const Problem& p, Fp8Scheme s, const Quantized& q) {
  Dequantized d{std::vector<float>(p.x.size()), std::vector<float>(p.w.size())};
  DequantizeActivationsFp8(s, q.xq, q.xs, p.k, d.x);
  DequantizeWeightsFp8(s, q.wq, q.ws, p.n, p.k, d.w);
  return d;
}

// The GEMM's rule, Y = dequant(Xq) · dequant(Wq)^T, holds up to its arithmetic: FP32 sums of
// at most k + 4 roundings (the 128-long group sums and their total for blocks, the scale
// products), <= (k + 4) 2^-24 sum |xq wq|; then the BF16 output, within 2^-8 of its value.
std::vector<double> ArithmeticBound(const Problem& p, const Dequantized& d,
                                    std::vector<double>* exact) {
  std::vector<double> bound(p.m * p.n);
  exact->assign(p.m * p.n, 0.0);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double acc = 0, mag = 0;
      for (int64_t t = 0; t < p.k; ++t) {
        const double prod = double(d.x[i * p.k + t]) * d.w[j * p.k + t];
        acc += prod;
        mag += std::fabs(prod);
      }
      const double b = (p.k + 4) * std::ldexp(mag, -24);
      (*exact)[i * p.n + j] = acc;
      bound[i * p.n + j] = b + std::ldexp(std::fabs(acc) + b, -8);
    }
  }
  return bound;
}

// How far dequant(Xq) · dequant(Wq)^T may be from the unquantized X · W^T, worst case:
// E4M3 keeps 4 significant bits, so a normal value rounds within 2^-4 of itself (relative);
// below the smallest normal (2^-6 scale units) codes are 2^-9 scale units apart, so a value is
// off by at most 2^-10 of its scale. |xq - x| <= e_x = 2^-4 |x| + 2^-10 s_x, likewise e_w, and
// |xq wq - x w| <= |xq| e_w + e_x |w|, summed over k.
std::vector<double> QuantizationBound(const Problem& p, Fp8Scheme s, const Quantized& q,
                                      const Dequantized& d) {
  const int64_t per_row = Fp8ActivationScalesPerRow(s, p.k);
  auto x_scale = [&](int64_t i, int64_t t) {
    if (s == Fp8Scheme::kPerTensor) return double(q.xs[0]);
    return double(q.xs[i * per_row + (s == Fp8Scheme::kBlock ? t / kFp8BlockSize : 0)]);
  };
  std::vector<double> bound(p.m * p.n);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double sum = 0;
      for (int64_t t = 0; t < p.k; ++t) {
        const double x = p.x[i * p.k + t], w = p.w[j * p.k + t];
        const double e_x = std::ldexp(std::fabs(x), -4) + std::ldexp(x_scale(i, t), -10);
        const double ws = q.ws[Fp8WeightScaleIndex(s, p.k, j, t)];
        const double e_w = std::ldexp(std::fabs(w), -4) + std::ldexp(ws, -10);
        sum += std::fabs(d.x[i * p.k + t]) * e_w + e_x * std::fabs(w);
      }
      bound[i * p.n + j] = sum;
    }
  }
  return bound;
}

// Awkward sizes: k not a multiple of 128 (a partial group and block), n neither.
Problem RandomProblem(int64_t m, int64_t n, int64_t k, uint64_t seed) {
  Problem p{m, n, k, std::vector<float>(m * k), std::vector<float>(n * k)};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (float& v : p.x) v = d(rng);
  for (float& v : p.w) v = 0.02f * d(rng);
  return p;
}

double RelError(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

TEST(Fp8Schemes, ScalesCoverTheirRowsAndGroups) {
  const Problem p = RandomProblem(3, 130, 300, 4);
  const Quantized q = Quantize(p, Fp8Scheme::kBlock);
  ASSERT_EQ(q.xs.size(), 9u);  // 3 rows x ceil(300/128) groups
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t g = 0; g < 3; ++g) {
      const int64_t len = std::min<int64_t>(128, 300 - 128 * g);
      EXPECT_EQ(q.xs[r * 3 + g],
                Amax(std::span(p.x).subspan(r * 300 + 128 * g, len)) / kFp8E4M3Max);
    }
  }
  ASSERT_EQ(q.ws.size(), 6u);  // ceil(130/128) x ceil(300/128) blocks
  float amax = 0;              // the partial block: rows 128..129, columns 256..299
  for (int64_t r = 128; r < 130; ++r) {
    amax = std::max(amax, Amax(std::span(p.w).subspan(r * 300 + 256, 44)));
  }
  EXPECT_EQ(q.ws[5], amax / kFp8E4M3Max);
  const Quantized c = Quantize(p, Fp8Scheme::kPerChannel);
  ASSERT_EQ(c.xs.size(), 3u);
  ASSERT_EQ(c.ws.size(), 130u);
  EXPECT_EQ(c.xs[1], Amax(std::span(p.x).subspan(300, 300)) / kFp8E4M3Max);
  EXPECT_EQ(c.ws[129], Amax(std::span(p.w).subspan(129 * 300, 300)) / kFp8E4M3Max);
}

TEST(Fp8Schemes, EachSchemeMatchesTheUnquantizedProductWithinItsBound) {
  const Problem p = RandomProblem(37, 133, 300, 1);
  const std::vector<double> unquantized = Fp64Product(p);
  for (Fp8Scheme s : kSchemes) {
    SCOPED_TRACE(Fp8SchemeName(s));
    Quantized q = Quantize(p, s);
    const Dequantized d = Dequantize(p, s, q);
    std::vector<double> rule;  // dequant(Xq) · dequant(Wq)^T in FP64
    const std::vector<double> arithmetic = ArithmeticBound(p, d, &rule);
    const std::vector<double> quantization = QuantizationBound(p, s, q, d);
    std::vector<float> y = RunReference(p, s, q);
    for (size_t e = 0; e < y.size(); ++e) {
      ASSERT_LE(std::fabs(y[e] - rule[e]), arithmetic[e]) << "element " << e;
      ASSERT_LE(std::fabs(rule[e] - unquantized[e]), quantization[e]) << "element " << e;
      ASSERT_LE(std::fabs(y[e] - unquantized[e]), arithmetic[e] + quantization[e]);
    }
    // The rule's bound is tight enough to catch a scale 10% off in one column or block.
    q.ws[s == Fp8Scheme::kBlock ? Fp8BlockCount(p.k) + 1 : q.ws.size() - 1] *= 1.1f;
    y = RunReference(p, s, q);
    size_t broken = 0;
    for (size_t e = 0; e < y.size(); ++e) broken += std::fabs(y[e] - rule[e]) > arithmetic[e];
    EXPECT_GT(broken, 0u);
  }
}

// The finer schemes keep the precision per-tensor scales lose to outliers. E4M3's exponent
// range (448 down to 2^-6 normal, 2^-9 subnormal) absorbs outliers of 1000x without loss, so
// the outliers here are 10^5 x: two tokens of X and two output channels of W. Under one scale
// per tensor an ordinary N(0, 1) value then sits near 448 / 3.5e5 = 0.0013 scale units, below
// the smallest subnormal step (2^-9 = 0.002): most round to 0 or one step, an error of the
// order of the values, where per-token / per-channel / per-block scales keep E4M3's 4 bits
// (a few percent). Compared over the outputs of ordinary tokens and of channels whose
// 128-row weight blocks hold no outlier (both outliers are in block row 0).
TEST(Fp8Schemes, FinerSchemesLoseLessToOutlierTokensAndChannels) {
  Problem p = RandomProblem(40, 256, 384, 2);
  for (int64_t i : {3, 17}) {
    for (int64_t t = 0; t < p.k; ++t) p.x[i * p.k + t] *= 1e5f;
  }
  for (int64_t j : {5, 60}) {
    for (int64_t t = 0; t < p.k; ++t) p.w[j * p.k + t] *= 1e5f;
  }
  const std::vector<double> exact = Fp64Product(p);
  auto ordinary_error = [&](Fp8Scheme s) {
    const std::vector<float> y = RunReference(p, s, Quantize(p, s));
    std::vector<float> got;
    std::vector<double> want;
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = kFp8BlockSize; j < p.n; ++j) {
        if (i == 3 || i == 17) continue;
        got.push_back(y[i * p.n + j]);
        want.push_back(exact[i * p.n + j]);
      }
    }
    return RelError(got, want);
  };
  const double tensor = ordinary_error(Fp8Scheme::kPerTensor);
  const double channel = ordinary_error(Fp8Scheme::kPerChannel);
  const double block = ordinary_error(Fp8Scheme::kBlock);
  SCOPED_TRACE("relative errors: tensor " + std::to_string(tensor) + " channel " +
               std::to_string(channel) + " block " + std::to_string(block));
  EXPECT_GT(tensor, 0.3);
  EXPECT_LT(channel, 0.06);
  EXPECT_LT(block, 0.06);
}

TEST(Fp8Schemes, ReferenceRefusesScalesOfTheWrongSize) {
  const Problem p = RandomProblem(4, 8, 130, 3);
  Quantized q = Quantize(p, Fp8Scheme::kBlock);
  q.ws.pop_back();
  std::vector<BFloat16> y(p.m * p.n);
  const Status s = ReferenceLinearFp8(Fp8Scheme::kBlock, p.m, p.n, p.k, q.xq, q.xs, q.wq, q.ws, y);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("needs 8 x scales and 2 w scales, got 8 and 1"));
}

// ---- Loading ----

ModelConfig Tiny() { return *ModelPreset("tiny"); }

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/tpserve_fp8_schemes_" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

// The F32 values of tensor `name` in dir/model.safetensors.
std::vector<float> FileFloats(const std::string& dir, const std::string& name) {
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  const TensorView* v = file.ok() ? file->Find(name) : nullptr;
  if (v == nullptr || v->dtype != StDtype::kF32) {
    ADD_FAILURE() << name << " missing or not F32";
    return {};
  }
  std::vector<float> out(v->numel());
  std::memcpy(out.data(), v->data, v->bytes);
  return out;
}

std::vector<float> Slice(const std::vector<float>& v, int64_t begin, int64_t end) {
  return {v.begin() + begin, v.begin() + end};
}

std::vector<float> Concat(std::initializer_list<std::vector<float>> parts) {
  std::vector<float> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST(Fp8SchemesLoading, PerChannelCheckpointKeepsItsScaleVectorsAndCodes) {
  const std::string dir = TempDir("channel");
  ASSERT_TRUE(
      WriteRandomCheckpoint(Tiny(), DataType::kFloat8E4M3, 7, dir, Fp8Scheme::kPerChannel).ok());
  const std::string p = HfLayerPrefix(1);
  auto w = LoadRankWeights(dir, Tiny(), 1, 0);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const LinearWeight& o = w->layers[1].o;
  EXPECT_EQ(o.scheme, Fp8Scheme::kPerChannel);
  EXPECT_TRUE(o.dynamic_input);
  EXPECT_EQ(o.weight_scales, FileFloats(dir, p + ".self_attn.o_proj.weight_scale"));
  // Not requantized: the stored codes, byte for byte.
  auto file = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  const TensorView* codes = file->Find(p + ".self_attn.o_proj.weight");
  ASSERT_NE(codes, nullptr);
  EXPECT_EQ(o.data, std::vector<uint8_t>(codes->data, codes->data + codes->bytes));
  // Fused projections: the parts' vectors one after the other.
  EXPECT_EQ(w->layers[1].qkv.weight_scales,
            Concat({FileFloats(dir, p + ".self_attn.q_proj.weight_scale"),
                    FileFloats(dir, p + ".self_attn.k_proj.weight_scale"),
                    FileFloats(dir, p + ".self_attn.v_proj.weight_scale")}));
  // The per-row scales differ (a folded vector would be constant).
  const auto [lo, hi] = std::minmax_element(o.weight_scales.begin(), o.weight_scales.end());
  EXPECT_LT(*lo, 0.9f * *hi);
  std::filesystem::remove_all(dir);
}

// Column-parallel layers split the output channels (and their scales); row-parallel ones
// split K and keep every channel's scale (per channel) or take their columns of the block
// grid (block).
TEST(Fp8SchemesLoading, ScalesShardWithTheWeightAtTp2And4) {
  const ModelConfig c = Tiny();
  const int64_t hd = c.head_dim(), nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const int64_t inter = c.intermediate_size, h = c.hidden_size;
  const std::string dir = TempDir("shard");
  ASSERT_TRUE(
      WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir + "/channel", Fp8Scheme::kPerChannel)
          .ok());
  ASSERT_TRUE(
      WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir + "/block", Fp8Scheme::kBlock).ok());
  const std::string p = HfLayerPrefix(0);
  auto scales = [&](const std::string& sub, const std::string& name) {
    return FileFloats(dir + "/" + sub, p + name);
  };
  for (int tp : {2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      SCOPED_TRACE("tp=" + std::to_string(tp) + " rank=" + std::to_string(rank));
      auto w = LoadRankWeights(dir + "/channel", c, tp, rank);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      const LayerWeights& l = w->layers[0];
      const int64_t q = nh / tp * hd, kv = nkv / tp * hd, i = inter / tp;
      EXPECT_EQ(l.qkv.weight_scales,
                Concat({Slice(scales("channel", ".self_attn.q_proj.weight_scale"), rank * q,
                              (rank + 1) * q),
                        Slice(scales("channel", ".self_attn.k_proj.weight_scale"), rank * kv,
                              (rank + 1) * kv),
                        Slice(scales("channel", ".self_attn.v_proj.weight_scale"), rank * kv,
                              (rank + 1) * kv)}));
      EXPECT_EQ(
          l.gate_up.weight_scales,
          Concat(
              {Slice(scales("channel", ".mlp.gate_proj.weight_scale"), rank * i, (rank + 1) * i),
               Slice(scales("channel", ".mlp.up_proj.weight_scale"), rank * i, (rank + 1) * i)}));
      EXPECT_EQ(l.down.weight_scales, scales("channel", ".mlp.down_proj.weight_scale"));
      EXPECT_EQ(l.o.weight_scales, scales("channel", ".self_attn.o_proj.weight_scale"));
      if (tp != 2) continue;
      // Block at tp=2: every share is whole 128 blocks ([4, 4] grids of 512x512 weights).
      auto b = LoadRankWeights(dir + "/block", c, tp, rank);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      const LayerWeights& lb = b->layers[0];
      EXPECT_EQ(lb.o.scheme, Fp8Scheme::kBlock);
      const std::vector<float> o_grid = scales("block", ".self_attn.o_proj.weight_scale_inv");
      std::vector<float> o_cols;  // rank's 2 of 4 block columns, each block row
      for (int64_t br = 0; br < Fp8BlockCount(h); ++br) {
        for (int64_t bc = 2 * rank; bc < 2 * rank + 2; ++bc) o_cols.push_back(o_grid[br * 4 + bc]);
      }
      EXPECT_EQ(lb.o.weight_scales, o_cols);
      // q: 256 rows = 2 block rows of 4 scales; k and v: 128 rows = 1 block row each.
      EXPECT_EQ(
          lb.qkv.weight_scales,
          Concat(
              {Slice(scales("block", ".self_attn.q_proj.weight_scale_inv"), rank * 8, rank * 8 + 8),
               Slice(scales("block", ".self_attn.k_proj.weight_scale_inv"), rank * 4, rank * 4 + 4),
               Slice(scales("block", ".self_attn.v_proj.weight_scale_inv"), rank * 4,
                     rank * 4 + 4)}));
    }
  }
  // Block at tp=4: k_proj's 64 rows per rank split its 128-row blocks.
  auto refused = LoadRankWeights(dir + "/block", c, 4, 1);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              AllOf(HasSubstr("model.safetensors: tensor 'model.layers.0.self_attn.k_proj."
                              "weight_scale_inv': at tp=4"),
                    HasSubstr("split its 128x128 scale blocks")));
  // Loaded as BF16 the blocks need not align: the weights are dequantized.
  EXPECT_TRUE(LoadRankWeights(dir + "/block", c, 4, 1, DataType::kBFloat16).ok());
  std::filesystem::remove_all(dir);
}

// Shares off the 128 grid are refused naming the tensor and tp.
TEST(Fp8SchemesLoading, BlockSharesOffTheGridAreRefused) {
  ModelConfig c = Tiny();
  c.intermediate_size = 384;  // down_proj's K: 192 per rank at tp=2
  const std::string dir = TempDir("ksplit");
  ASSERT_TRUE(WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir, Fp8Scheme::kBlock).ok());
  EXPECT_TRUE(LoadRankWeights(dir, c, 1, 0).ok());
  auto w = LoadRankWeights(dir, c, 2, 0);
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("'model.layers.0.mlp.gate_proj.weight_scale_inv': at tp=2"),
                    HasSubstr("rows [0, 192)")));
  // A row-parallel share: columns [192, 384) of a [256, 384] weight.
  WeightScales ws{Fp8Scheme::kBlock, std::vector<float>(2 * 3, 1.0f), 256, 384};
  LinearPart part;
  part.rows = 256;
  part.cols = 192;
  part.col_begin = 192;
  part.where = "f.safetensors: tensor 'x.down_proj.weight_scale_inv'";
  const Status k_split = TakeScales(ws, 2, &part);
  EXPECT_EQ(k_split.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(k_split.message(),
              HasSubstr("'x.down_proj.weight_scale_inv': at tp=2 a rank takes rows [0, 256) and "
                        "columns [192, 384)"));
  part.col_begin = 128;
  part.cols = 256;
  EXPECT_TRUE(TakeScales(ws, 2, &part).ok());
  EXPECT_EQ(part.scales, std::vector<float>(4, 1.0f));
  std::filesystem::remove_all(dir);
}

// Rewrites tensor `name` of src into dst (with src's config.json) with `values` (F32, `shape`).
void WithScale(const std::string& src, const std::string& dst, const std::string& name,
               std::vector<int64_t> shape, const std::vector<float>& values) {
  RewriteCheckpoint(src, dst, [&](TensorToWrite& t) {
    if (t.name == name) {
      t.shape = shape;
      t.data = values.data();
      t.bytes = values.size() * 4;
    }
    return true;
  });
  std::filesystem::copy(src + "/config.json", dst + "/config.json");
}

// KV cache scales (LayerWeights::kv_scales) in the spellings writers use: compressed-tensors'
// self_attn.k_scale / v_scale, ModelOpt's k_proj.k_scale / v_proj.v_scale, the older
// self_attn.kv_scale for both; F32 [] or [1]; 1 where a checkpoint has none; the same on every
// rank. Two spellings for one layer's keys, more than one value, or a value that is not
// positive and finite are refused, naming the tensor and its file.
TEST(Fp8SchemesLoading, KvCacheScalesLoadInEverySpellingAndBadOnesAreRefused) {
  const std::string dir = TempDir("kv_scales");
  const ModelConfig c = Tiny();
  ASSERT_EQ(c.num_hidden_layers, 2);
  ASSERT_TRUE(WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir + "/plain").ok());
  const std::string l0 = HfLayerPrefix(0) + ".self_attn.", l1 = HfLayerPrefix(1) + ".self_attn.";
  struct Want {
    KvScales layer0, layer1;
  };
  const std::vector<std::pair<std::vector<ExtraTensor>, Want>> good = {
      {{}, {{1.0f, 1.0f}, {1.0f, 1.0f}}},
      {{{l0 + "k_scale", {0.5f}, {}},
        {l0 + "v_scale", {0.25f}, {1}},
        {l1 + "kv_scale", {3.0f}, {}}},
       {{0.5f, 0.25f}, {3.0f, 3.0f}}},
      {{{l0 + "k_proj.k_scale", {0.02f}, {1}},
        {l0 + "v_proj.v_scale", {0.03f}, {}},
        {l1 + "v_scale", {7.0f}, {}}},
       {{0.02f, 0.03f}, {1.0f, 7.0f}}},
  };
  for (size_t i = 0; i < good.size(); ++i) {
    SCOPED_TRACE("good case " + std::to_string(i));
    const std::string d = dir + "/good" + std::to_string(i);
    CopyWithExtraTensors(dir + "/plain", d, good[i].first);
    for (int rank = 0; rank < 2; ++rank) {
      auto w = LoadRankWeights(d, c, 2, rank, DataType::kFloat8E4M3);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      EXPECT_EQ(w->layers[0].kv_scales.k, good[i].second.layer0.k);
      EXPECT_EQ(w->layers[0].kv_scales.v, good[i].second.layer0.v);
      EXPECT_EQ(w->layers[1].kv_scales.k, good[i].second.layer1.k);
      EXPECT_EQ(w->layers[1].kv_scales.v, good[i].second.layer1.v);
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<std::vector<ExtraTensor>, std::string>> bad = {
      {{{l0 + "k_scale", {0.5f}, {}}, {l0 + "kv_scale", {0.5f}, {}}}, "'" + l0 + "kv_scale' and "},
      {{{l1 + "v_scale", {0.5f}, {}}, {l1 + "v_proj.v_scale", {0.5f}, {}}},
       "' both scale the layer's cached values; keep one"},
      {{{l0 + "k_scale", {0.5f, 0.5f}, {2}}}, "has shape [2]: a KV cache scale is one value"},
      {{{l1 + "v_scale", {-0.5f}, {}}}, "must hold positive finite scales, got -0.5"},
      {{{l1 + "kv_scale", {nan}, {1}}}, "must hold positive finite scales, got nan"},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE("bad case " + std::to_string(i));
    const std::string d = dir + "/bad" + std::to_string(i);
    CopyWithExtraTensors(dir + "/plain", d, bad[i].first);
    auto w = LoadRankWeights(d, c, 1, 0, DataType::kFloat8E4M3);
    EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument) << w.status().ToString();
    EXPECT_THAT(w.status().message(), HasSubstr(bad[i].second));
    EXPECT_THAT(w.status().message(), HasSubstr(d + "/extra.safetensors: tensor '"));
  }
  std::filesystem::remove_all(dir);
}

TEST(Fp8SchemesLoading, MalformedScaleTensorsAreRefusedNamingTensorAndFile) {
  const std::string dir = TempDir("malformed");
  const ModelConfig c = Tiny();
  ASSERT_TRUE(
      WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir + "/channel", Fp8Scheme::kPerChannel)
          .ok());
  ASSERT_TRUE(
      WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, dir + "/block", Fp8Scheme::kBlock).ok());
  const std::string o = HfLayerPrefix(1) + ".self_attn.o_proj";
  const std::vector<float> good = FileFloats(dir + "/channel", o + ".weight_scale");
  const std::vector<float> grid = FileFloats(dir + "/block", o + ".weight_scale_inv");
  struct Case {
    std::string sub, src, scale;
    std::vector<int64_t> shape;
    std::vector<float> values;
    std::string message;
  };
  auto with = [](std::vector<float> v, size_t i, float x) {
    v[i] = x;
    return v;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<Case> cases = {
      {"short", "channel", ".weight_scale", {511, 1}, Slice(good, 0, 511), "has shape [511,1]"},
      {"nan",
       "channel",
       ".weight_scale",
       {512, 1},
       with(good, 7, nan),
       "must hold positive finite scales, got nan at element 7"},
      {"inf",
       "channel",
       ".weight_scale",
       {512, 1},
       with(good, 8, inf),
       "must hold positive finite scales, got inf at element 8"},
      {"zero",
       "channel",
       ".weight_scale",
       {512, 1},
       with(good, 9, 0.0f),
       "must hold positive finite scales, got 0.000000 at element 9"},
      {"negative",
       "channel",
       ".weight_scale",
       {512, 1},
       with(good, 10, -good[10]),
       "must hold positive finite scales, got -"},
      {"grid_shape",
       "block",
       ".weight_scale_inv",
       {2, 8},
       grid,
       "has shape [2,8]: block scales of a [512,512] weight in 128x128 blocks are [4,4]"},
      {"grid_zero",
       "block",
       ".weight_scale_inv",
       {4, 4},
       with(grid, 5, 0.0f),
       "must hold positive finite scales, got 0.000000 at element 5"},
      {"grid_nan",
       "block",
       ".weight_scale_inv",
       {4, 4},
       with(grid, 6, nan),
       "must hold positive finite scales, got nan at element 6"},
      // The config declares channel scales; one value per tensor does not fit it.
      {"undeclared",
       "channel",
       ".weight_scale",
       {},
       {good[0]},
       "holds tensor scales (shape []), but " + dir +
           "/undeclared/config.json: "
           "quantization_config declares channel scales"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.sub);
    WithScale(dir + "/" + k.src, dir + "/" + k.sub, o + k.scale, k.shape, k.values);
    for (DataType dtype : {DataType::kFloat8E4M3, DataType::kBFloat16}) {
      auto w = LoadRankWeights(dir + "/" + k.sub, c, 2, 0, dtype);
      EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
      EXPECT_THAT(
          w.status().message(),
          AllOf(HasSubstr(dir + "/" + k.sub + "/model.safetensors: tensor '" + o + k.scale + "'"),
                HasSubstr(k.message)));
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(Fp8SchemesLoading, QuantizationConfigsOfEachWriterAreRead) {
  const std::string dir = TempDir("configs");
  std::filesystem::create_directories(dir);
  auto read = [&](const std::string& q) {
    std::ofstream(dir + "/config.json")
        << R"({"hidden_size": 8, "quantization_config": )" << q << "}";
    return ReadFp8QuantConfig(dir + "/config.json");
  };
  auto scheme = [&](const std::string& q) -> std::string {
    auto r = read(q);
    if (!r.ok()) return r.status().ToString();
    return r->weights ? Fp8SchemeName(*r->weights) : "none";
  };
  EXPECT_EQ(scheme(Fp8QuantConfigJson(Fp8Scheme::kPerChannel)), "channel");
  EXPECT_EQ(scheme(Fp8QuantConfigJson(Fp8Scheme::kBlock)), "block");
  EXPECT_EQ(scheme(R"({"quant_method": "modelopt", "quant_algo": "FP8"})"), "tensor");
  EXPECT_EQ(scheme(R"({"quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}})"), "channel");
  EXPECT_EQ(scheme(R"({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0})"), "channel");
  EXPECT_EQ(scheme(R"({"quant_method": "compressed-tensors", "config_groups": {"g": {
      "weights": {"strategy": "block", "block_structure": [128, 128]}}}})"),
            "block");
  EXPECT_EQ(scheme(R"({"quant_method": "compressed-tensors", "config_groups": {"g": {
      "weights": {"strategy": "tensor"}, "input_activations": {"dynamic": false}}}})"),
            "tensor");
  auto statics = read(R"({"quant_method": "compressed-tensors", "config_groups": {"g": {
      "weights": {"strategy": "channel"}, "input_activations": {"dynamic": false}}}})");
  ASSERT_TRUE(statics.ok());
  EXPECT_TRUE(statics->static_activations);
  EXPECT_FALSE(read(Fp8QuantConfigJson(Fp8Scheme::kPerChannel))->static_activations);
  // Groups that disagree declare nothing: each layer's tensors decide.
  EXPECT_EQ(scheme(R"({"quant_method": "compressed-tensors", "config_groups": {
      "a": {"weights": {"strategy": "tensor"}}, "b": {"weights": {"strategy": "channel"}}}})"),
            "none");
  EXPECT_EQ(scheme("null"), "none");
  auto bad_block = read(R"({"quant_method": "fp8", "weight_block_size": [64, 64]})");
  EXPECT_EQ(bad_block.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(bad_block.status().message(),
              HasSubstr("quantization_config.weight_block_size is [64,64]"));
  auto bad_strategy = read(R"({"quant_method": "compressed-tensors", "config_groups": {"g": {
      "weights": {"strategy": "group"}}}})");
  EXPECT_EQ(bad_strategy.status().code(), StatusCode::kUnimplemented);
  EXPECT_THAT(bad_strategy.status().message(),
              HasSubstr("quantization_config.config_groups.g.weights.strategy is \"group\""));
  std::filesystem::remove_all(dir);
}

// ---- The CPU engine on make-checkpoint's output ----

int64_t Argmax(const std::vector<float>& v, int64_t begin, int64_t end) {
  return std::max_element(v.begin() + begin, v.begin() + end) - v.begin() - begin;
}

TEST(Fp8SchemesModel, EachSchemeRunsCloseToTheBf16ModelAtTp1And2) {
  const ModelConfig c = Tiny();
  const std::string dir = TempDir("model");
  ASSERT_TRUE(WriteRandomCheckpoint(c, DataType::kBFloat16, 7, dir + "/bf16").ok());
  const std::vector<std::vector<int32_t>> seqs = {
      {1, 2, 3, 4, 5}, {17}, {100, 200, 300, 400, 500, 600, 700, 800, 900}, {1000, 3, 77}};
  auto batch = PackSequences(seqs, c.vocab_size, c.max_position_embeddings);
  ASSERT_TRUE(batch.ok());
  for (int tp : {1, 2}) {
    auto bf16 = RunCpuModel(c, tp, DataType::kBFloat16, 7, dir + "/bf16", nullptr, *batch);
    ASSERT_TRUE(bf16.ok()) << bf16.status().ToString();
    for (Fp8Scheme s : kSchemes) {
      SCOPED_TRACE(std::string(Fp8SchemeName(s)) + " tp=" + std::to_string(tp));
      const std::string sub = dir + "/" + Fp8SchemeName(s);
      if (!std::filesystem::exists(sub)) {
        ASSERT_TRUE(WriteRandomCheckpoint(c, DataType::kFloat8E4M3, 7, sub, s).ok());
      }
      auto fp8 = RunCpuModel(c, tp, DataType::kFloat8E4M3, 7, sub, nullptr, *batch);
      ASSERT_TRUE(fp8.ok()) << fp8.status().ToString();
      ASSERT_EQ(fp8->size(), bf16->size());
      double num = 0, den = 0;
      for (size_t i = 0; i < fp8->size(); ++i) {
        num += ((*fp8)[i] - (*bf16)[i]) * ((*fp8)[i] - (*bf16)[i]);
        den += (*bf16)[i] * (*bf16)[i];
      }
      // FP8 weights and activations (4 significant bits each, ~2^-5 relative rounding
      // error on average) through two blocks: a few percent of the logits' norm.
      EXPECT_LE(std::sqrt(num / den), 0.1);
      for (size_t q = 0; q < seqs.size(); ++q) {
        const int64_t v = c.vocab_size;
        EXPECT_EQ(Argmax(*fp8, q * v, (q + 1) * v), Argmax(*bf16, q * v, (q + 1) * v))
            << "sequence " << q;
      }
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tpserve
