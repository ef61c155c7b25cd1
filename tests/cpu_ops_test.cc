#include "engine/cpu_ops.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "engine/model_config.h"

namespace tpserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// |got - want| within `rel` of |want| (plus a tiny floor for exact zeros).
::testing::AssertionResult RelNear(double got, double want, double rel) {
  if (std::abs(got - want) <= rel * std::abs(want) + 1e-30) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "got " << got << ", want " << want << " (rel err "
         << std::abs(got - want) / std::abs(want) << " > " << rel << ")";
}

// ---- RmsNorm ---------------------------------------------------------------

TEST(CpuRmsNorm, MatchesDoubleFormula) {
  constexpr int64_t kRows = 5, kDim = 37;
  const double eps = 1e-5;
  const auto x = Random(kRows * kDim, 1, -3.0f, 3.0f);
  const auto w = Random(kDim, 2, 0.5f, 1.5f);
  std::vector<float> out(x.size(), std::numeric_limits<float>::quiet_NaN());
  RmsNorm(x.data(), w.data(), kRows, kDim, eps, out.data());
  for (int64_t r = 0; r < kRows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < kDim; ++i) ss += double(x[r * kDim + i]) * x[r * kDim + i];
    const double rms = std::sqrt(ss / kDim + eps);
    for (int64_t i = 0; i < kDim; ++i) {
      const double want = x[r * kDim + i] / rms * w[i];
      EXPECT_FLOAT_EQ(out[r * kDim + i], static_cast<float>(want)) << r << "," << i;
    }
  }
  // In place gives the same bits.
  std::vector<float> inplace = x;
  RmsNorm(inplace.data(), w.data(), kRows, kDim, eps, inplace.data());
  EXPECT_EQ(inplace, out);
}

TEST(CpuRmsNorm, ZeroRowStaysZeroThanksToEps) {
  const std::vector<float> x(8, 0.0f), w(8, 1.0f);
  std::vector<float> out(8, 1.0f);
  RmsNorm(x.data(), w.data(), 1, 8, 1e-6, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

// ---- RoPE ------------------------------------------------------------------

// Direct formula, double precision: one head of `head_dim` at `pos`.
std::vector<double> RopeRef(const float* x, int64_t head_dim, int64_t pos, double theta) {
  const int64_t half = head_dim / 2;
  std::vector<double> y(head_dim);
  for (int64_t i = 0; i < half; ++i) {
    const double angle = pos / std::pow(theta, double(2 * i) / head_dim);
    y[i] = x[i] * std::cos(angle) - x[i + half] * std::sin(angle);
    y[i + half] = x[i + half] * std::cos(angle) + x[i] * std::sin(angle);
  }
  return y;
}

double Dot(const float* a, const float* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(a[i]) * b[i];
  return s;
}

TEST(CpuRope, PositionZeroIsIdentity) {
  const auto x = Random(3 * 4 * 64, 3);
  std::vector<float> y = x;
  const std::vector<int32_t> pos(3, 0);
  ASSERT_TRUE(ApplyRope(y.data(), 3, 4, 64, pos.data(), 500000.0).ok());
  EXPECT_EQ(y, x);
}

TEST(CpuRope, KnownValues) {
  // head_dim 2: one pair, inv_freq 1, so the angle is the position.
  std::vector<float> x = {1.0f, 0.0f, 0.0f, 1.0f};  // two rows
  const std::vector<int32_t> pos = {1, 2};
  ASSERT_TRUE(ApplyRope(x.data(), 2, 1, 2, pos.data(), 10000.0).ok());
  EXPECT_FLOAT_EQ(x[0], std::cos(1.0f));
  EXPECT_FLOAT_EQ(x[1], std::sin(1.0f));
  EXPECT_FLOAT_EQ(x[2], -std::sin(2.0f));
  EXPECT_FLOAT_EQ(x[3], std::cos(2.0f));

  // head_dim 4, theta 100: pairs (0,2) at inv_freq 1 and (1,3) at 100^-0.5 = 0.1.
  std::vector<float> y = {1.0f, 1.0f, 0.0f, 0.0f};
  const int32_t p10 = 10;
  ASSERT_TRUE(ApplyRope(y.data(), 1, 1, 4, &p10, 100.0).ok());
  EXPECT_FLOAT_EQ(y[0], static_cast<float>(std::cos(10.0)));
  EXPECT_FLOAT_EQ(y[2], static_cast<float>(std::sin(10.0)));
  EXPECT_FLOAT_EQ(y[1], static_cast<float>(std::cos(1.0)));
  EXPECT_FLOAT_EQ(y[3], static_cast<float>(std::sin(1.0)));
}

TEST(CpuRope, MatchesDirectFormulaAndPreservesPairNorms) {
  constexpr int64_t kRows = 6, kHeads = 3, kHeadDim = 128;
  const double theta = 500000.0;
  const auto x = Random(kRows * kHeads * kHeadDim, 4);
  const std::vector<int32_t> pos = {0, 1, 7, 100, 4095, 8191};
  std::vector<float> y = x;
  ASSERT_TRUE(ApplyRope(y.data(), kRows, kHeads, kHeadDim, pos.data(), theta).ok());
  constexpr int64_t kHalf = kHeadDim / 2;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t h = 0; h < kHeads; ++h) {
      const int64_t off = (r * kHeads + h) * kHeadDim;
      const auto want = RopeRef(x.data() + off, kHeadDim, pos[r], theta);
      for (int64_t i = 0; i < kHeadDim; ++i) {
        EXPECT_NEAR(y[off + i], want[i], 1e-6) << r << "," << h << "," << i;
      }
      for (int64_t i = 0; i < kHalf; ++i) {
        const double before = std::hypot(x[off + i], x[off + i + kHalf]);
        const double after = std::hypot(y[off + i], y[off + i + kHalf]);
        EXPECT_TRUE(RelNear(after, before, 1e-6)) << r << "," << h << "," << i;
      }
    }
  }
}

TEST(CpuRope, DotProductDependsOnlyOnRelativePosition) {
  constexpr int64_t kHeadDim = 64;
  const auto q = Random(kHeadDim, 5);
  const auto k = Random(kHeadDim, 6);
  auto rotated_dot = [&](int32_t pq, int32_t pk) {
    std::vector<float> qr = q, kr = k;
    EXPECT_TRUE(ApplyRope(qr.data(), 1, 1, kHeadDim, &pq, 10000.0).ok());
    EXPECT_TRUE(ApplyRope(kr.data(), 1, 1, kHeadDim, &pk, 10000.0).ok());
    return Dot(qr.data(), kr.data(), kHeadDim);
  };
  EXPECT_NEAR(rotated_dot(7, 3), rotated_dot(104, 100), 1e-4);
  EXPECT_NEAR(rotated_dot(3, 7), rotated_dot(1000, 1004), 1e-4);
  EXPECT_NEAR(rotated_dot(5, 5), Dot(q.data(), k.data(), kHeadDim), 1e-4);
  // And it does depend on the difference.
  EXPECT_GT(std::abs(rotated_dot(7, 3) - rotated_dot(7, 4)), 1e-3);
}

TEST(CpuRope, Errors) {
  std::vector<float> x(2 * 6, 1.0f);
  const std::vector<int32_t> pos = {0, -3};
  Status s = ApplyRope(x.data(), 2, 2, 3, pos.data(), 10000.0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("head_dim (3)"));

  s = ApplyRope(x.data(), 2, 1, 6, pos.data(), 10000.0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("positions[1] (-3)"));
  EXPECT_EQ(x, std::vector<float>(12, 1.0f));  // untouched

  const std::vector<int32_t> ok_pos = {0, 1};
  s = ApplyRope(x.data(), 2, 1, 6, ok_pos.data(), 0.0);
  EXPECT_THAT(s.message(), HasSubstr("theta"));
  s = ApplyRope(x.data(), 2, 0, 6, ok_pos.data(), 10000.0);
  EXPECT_THAT(s.message(), HasSubstr("heads (0)"));
  s = ApplyRope(nullptr, 2, 1, 6, ok_pos.data(), 10000.0);
  EXPECT_THAT(s.message(), HasSubstr("x is null"));
  EXPECT_TRUE(ApplyRope(nullptr, 0, 1, 6, nullptr, 10000.0).ok());
}

// The table form with the plain table is the theta form, bit for bit.
TEST(CpuRope, TableOfPlainRopeEqualsTheta) {
  constexpr int64_t kRows = 4, kHeads = 2, kHeadDim = 128;
  const auto x = Random(kRows * kHeads * kHeadDim, 8);
  const std::vector<int32_t> pos = {0, 3, 1000, 131071};
  std::vector<float> by_theta = x, by_table = x;
  ASSERT_TRUE(ApplyRope(by_theta.data(), kRows, kHeads, kHeadDim, pos.data(), 500000.0).ok());
  ASSERT_TRUE(ApplyRope(by_table.data(), kRows, kHeads, kHeadDim, pos.data(),
                        RopeInverseFrequencies(500000.0, kHeadDim, RopeScaling{}))
                  .ok());
  EXPECT_EQ(by_table, by_theta);
}

// Linear scaling is position interpolation: position p rotates as plain RoPE at p / factor.
// With a power-of-two factor both angles are the same double, so the results are equal.
TEST(CpuRope, LinearScalingEqualsDividedPositions) {
  constexpr int64_t kRows = 5, kHeads = 3, kHeadDim = 64;
  RopeScaling linear;
  linear.type = RopeType::kLinear;
  linear.factor = 4.0;
  const auto x = Random(kRows * kHeads * kHeadDim, 9);
  const std::vector<int32_t> pos = {0, 4, 40, 4000, 65532};
  std::vector<int32_t> divided(pos.size());
  for (size_t i = 0; i < pos.size(); ++i) divided[i] = pos[i] / 4;
  std::vector<float> scaled = x, plain = x;
  ASSERT_TRUE(ApplyRope(scaled.data(), kRows, kHeads, kHeadDim, pos.data(),
                        RopeInverseFrequencies(10000.0, kHeadDim, linear))
                  .ok());
  ASSERT_TRUE(ApplyRope(plain.data(), kRows, kHeads, kHeadDim, divided.data(), 10000.0).ok());
  EXPECT_EQ(scaled, plain);
  // And it is not plain RoPE at the undivided positions.
  std::vector<float> unscaled = x;
  ASSERT_TRUE(ApplyRope(unscaled.data(), kRows, kHeads, kHeadDim, pos.data(), 10000.0).ok());
  EXPECT_NE(scaled, unscaled);
}

// Llama 3.1's scaled RoPE: each pair rotates by position * its scaled inverse frequency.
TEST(CpuRope, Llama3ScalingRotatesByTheTable) {
  constexpr int64_t kRows = 3, kHeads = 2, kHeadDim = 128, kHalf = kHeadDim / 2;
  RopeScaling llama3;
  llama3.type = RopeType::kLlama3;
  llama3.factor = 8.0;
  llama3.low_freq_factor = 1.0;
  llama3.high_freq_factor = 4.0;
  llama3.original_max_position_embeddings = 8192;
  const std::vector<double> inv = RopeInverseFrequencies(500000.0, kHeadDim, llama3);
  const auto x = Random(kRows * kHeads * kHeadDim, 10);
  const std::vector<int32_t> pos = {1, 5000, 100000};
  std::vector<float> y = x;
  ASSERT_TRUE(ApplyRope(y.data(), kRows, kHeads, kHeadDim, pos.data(), inv).ok());
  // Pair 0 (kept), 32 (blend: 500000^-0.5 scaled to 5.248461609929547e-4), 63 (/ 8),
  // worked out by hand from transformers' definition.
  const struct {
    int64_t i;
    double inv_freq;
  } pairs[] = {{0, 1.0}, {32, 0.0005248461609929547}, {63, 2.455140791131609e-06 / 8}};
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t h = 0; h < kHeads; ++h) {
      const int64_t off = (r * kHeads + h) * kHeadDim;
      for (const auto& p : pairs) {
        const double angle = pos[r] * p.inv_freq;
        const double a = x[off + p.i], b = x[off + p.i + kHalf];
        EXPECT_NEAR(y[off + p.i], a * std::cos(angle) - b * std::sin(angle), 2e-6)
            << r << "," << h << "," << p.i;
        EXPECT_NEAR(y[off + p.i + kHalf], b * std::cos(angle) + a * std::sin(angle), 2e-6)
            << r << "," << h << "," << p.i;
      }
    }
  }
  // The scaling changes the low-frequency pairs only at long range: not plain RoPE.
  std::vector<float> plain = x;
  ASSERT_TRUE(ApplyRope(plain.data(), kRows, kHeads, kHeadDim, pos.data(), 500000.0).ok());
  EXPECT_GT(std::abs(plain[2 * kHeads * kHeadDim + 63] - y[2 * kHeads * kHeadDim + 63]), 1e-3);
  EXPECT_EQ(plain[0], y[0]);  // row 0, pair 0: kept
}

TEST(CpuRope, TableErrors) {
  std::vector<float> x(2 * 6, 1.0f);
  const std::vector<int32_t> pos = {0, 1};
  Status s = ApplyRope(x.data(), 2, 1, 6, pos.data(), std::vector<double>{1.0, 0.5});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("inv_freq has 2 entries"), HasSubstr("needs 3")));
  s = ApplyRope(x.data(), 2, 1, 6, pos.data(), std::vector<double>{1.0, 0.0, 0.5});
  EXPECT_THAT(s.message(), HasSubstr("inv_freq[1] (0.000000)"));
  s = ApplyRope(x.data(), 2, 1, 6, pos.data(),
                std::vector<double>{1.0, 0.5, std::numeric_limits<double>::quiet_NaN()});
  EXPECT_THAT(s.message(), HasSubstr("inv_freq[2]"));
  EXPECT_EQ(x, std::vector<float>(12, 1.0f));  // untouched
}

// ---- Attention -------------------------------------------------------------

struct AttnShape {
  int64_t q_heads = 8, kv_heads = 2, head_dim = 16;
};

// Naive reference in double: materialises each sequence's [len, len] score
// matrix per head.
std::vector<double> AttentionRef(const std::vector<float>& q, const std::vector<float>& k,
                                 const std::vector<float>& v, const AttnShape& a,
                                 const std::vector<int32_t>& cu) {
  const int64_t tokens = cu.back();
  std::vector<double> out(tokens * a.q_heads * a.head_dim);
  const int64_t group = a.q_heads / a.kv_heads;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t b = cu[s], len = cu[s + 1] - cu[s];
    for (int64_t h = 0; h < a.q_heads; ++h) {
      const int64_t kvh = h / group;
      std::vector<std::vector<double>> p(len, std::vector<double>(len, 0.0));
      for (int64_t i = 0; i < len; ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          p[i][j] = Dot(&q[((b + i) * a.q_heads + h) * a.head_dim],
                        &k[((b + j) * a.kv_heads + kvh) * a.head_dim], a.head_dim) /
                    std::sqrt(double(a.head_dim));
          m = std::max(m, p[i][j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += p[i][j] = std::exp(p[i][j] - m);
        for (int64_t j = 0; j <= i; ++j) p[i][j] /= sum;
      }
      for (int64_t i = 0; i < len; ++i) {
        for (int64_t d = 0; d < a.head_dim; ++d) {
          double o = 0;
          for (int64_t j = 0; j < len; ++j) {
            o += p[i][j] * v[((b + j) * a.kv_heads + kvh) * a.head_dim + d];
          }
          out[((b + i) * a.q_heads + h) * a.head_dim + d] = o;
        }
      }
    }
  }
  return out;
}

std::vector<int32_t> CuSeqlens(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu = {0};
  for (int32_t len : lengths) cu.push_back(cu.back() + len);
  return cu;
}

struct AttnData {
  std::vector<float> q, k, v;
};

AttnData RandomAttn(const AttnShape& a, int64_t tokens, uint32_t seed, float q_scale = 1.0f) {
  AttnData d{Random(tokens * a.q_heads * a.head_dim, seed, -q_scale, q_scale),
             Random(tokens * a.kv_heads * a.head_dim, seed + 1, -2.0f, 2.0f),
             Random(tokens * a.kv_heads * a.head_dim, seed + 2, -1.0f, 1.0f)};
  return d;
}

std::vector<float> RunAttn(const AttnData& d, const AttnShape& a, const std::vector<int32_t>& cu) {
  std::vector<float> out(cu.back() * a.q_heads * a.head_dim,
                         std::numeric_limits<float>::quiet_NaN());
  const Status s = CausalAttentionVarlen(d.q.data(), d.k.data(), d.v.data(), cu.back(), a.q_heads,
                                         a.kv_heads, a.head_dim, cu, out.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

TEST(CpuAttention, MatchesNaiveReferenceWithGqaAndPacking) {
  const AttnShape a;
  const auto cu = CuSeqlens({1, 5, 17});
  const AttnData d = RandomAttn(a, cu.back(), 7);
  const auto got = RunAttn(d, a, cu);
  const auto want = AttentionRef(d.q, d.k, d.v, a, cu);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(RelNear(got[i], want[i], 1e-5)) << i;
}

TEST(CpuAttention, SequenceOutputIsIndependentOfThePack) {
  const AttnShape a;
  const std::vector<int32_t> lengths = {1, 5, 17};
  const auto cu = CuSeqlens(lengths);
  const AttnData d = RandomAttn(a, cu.back(), 8);
  const auto packed = RunAttn(d, a, cu);
  const int64_t q_row = a.q_heads * a.head_dim, kv_row = a.kv_heads * a.head_dim;
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int64_t b = cu[s], e = cu[s + 1];
    const AttnData alone{{d.q.begin() + b * q_row, d.q.begin() + e * q_row},
                         {d.k.begin() + b * kv_row, d.k.begin() + e * kv_row},
                         {d.v.begin() + b * kv_row, d.v.begin() + e * kv_row}};
    const auto out = RunAttn(alone, a, {0, lengths[s]});
    const std::vector<float> slice(packed.begin() + b * q_row, packed.begin() + e * q_row);
    EXPECT_EQ(out, slice) << "sequence " << s;  // bit-identical
  }
}

TEST(CpuAttention, EmptySequencesInThePackAreAllowed) {
  const AttnShape a;
  const std::vector<int32_t> cu = {0, 0, 5, 5, 6, 6};
  const AttnData d = RandomAttn(a, 6, 9);
  const auto got = RunAttn(d, a, cu);
  const auto want = AttentionRef(d.q, d.k, d.v, a, cu);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(RelNear(got[i], want[i], 1e-5)) << i;
}

TEST(CpuAttention, SingleTokenReturnsItsValue) {
  const AttnShape a;
  const AttnData d = RandomAttn(a, 1, 10);
  const auto out = RunAttn(d, a, {0, 1});
  const int64_t group = a.q_heads / a.kv_heads;
  for (int64_t h = 0; h < a.q_heads; ++h) {
    for (int64_t i = 0; i < a.head_dim; ++i) {
      EXPECT_EQ(out[h * a.head_dim + i], d.v[(h / group) * a.head_dim + i]);
    }
  }
}

TEST(CpuAttention, StableForHugeScores) {
  const AttnShape a;
  const auto cu = CuSeqlens({17});
  const AttnData d = RandomAttn(a, 17, 11, /*q_scale=*/1000.0f);  // scores up to ~1e4
  const auto got = RunAttn(d, a, cu);
  const auto want = AttentionRef(d.q, d.k, d.v, a, cu);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    EXPECT_TRUE(RelNear(got[i], want[i], 1e-5)) << i;
  }
}

TEST(CpuAttention, BadArguments) {
  const AttnShape a;
  const AttnData d = RandomAttn(a, 6, 12);
  std::vector<float> out(6 * a.q_heads * a.head_dim);
  auto run = [&](const std::vector<int32_t>& cu, int64_t tokens = 6, int64_t kv_heads = 2) {
    return CausalAttentionVarlen(d.q.data(), d.k.data(), d.v.data(), tokens, a.q_heads, kv_heads,
                                 a.head_dim, cu, out.data());
  };
  Status s = run({1, 6});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("cu_seqlens[0] (1) must be 0"));

  s = run({0, 4, 3, 6});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("non-decreasing"), HasSubstr("cu_seqlens[2] (3)")));

  s = run({0, 2, 5});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("cu_seqlens[2] (5) must equal tokens (6)"));

  s = run({});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("cu_seqlens is empty"));

  s = run({0, 6}, 6, 3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("q_heads (8) must be a multiple of kv_heads (3)"));

  s = run({0, 6}, -1);
  EXPECT_THAT(s.message(), HasSubstr("tokens (-1)"));

  EXPECT_TRUE(run({0}, 0).ok());  // an empty batch
}

// ---- SwiGLU ----------------------------------------------------------------

TEST(CpuSwiGlu, MatchesFormula) {
  constexpr int64_t kRows = 4, kInter = 33;
  auto gate_up = Random(kRows * 2 * kInter, 13, -8.0f, 8.0f);
  gate_up[0] = 0.0f;     // silu(0) = 0
  gate_up[1] = -200.0f;  // exp(200) is large, not a NaN
  gate_up[2] = 200.0f;
  // Poisoned: an element SwiGlu does not write fails, even where the result is 0.
  std::vector<float> out(kRows * kInter, std::numeric_limits<float>::quiet_NaN());
  SwiGlu(gate_up.data(), kRows, kInter, out.data());
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kInter; ++j) {
      const double g = gate_up[r * 2 * kInter + j];
      const double u = gate_up[r * 2 * kInter + kInter + j];
      const double want = g / (1.0 + std::exp(-g)) * u;
      EXPECT_FLOAT_EQ(out[r * kInter + j], static_cast<float>(want)) << r << "," << j;
    }
  }
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[2], 200.0f * gate_up[kInter + 2]);

  // In place: the first rows * inter floats of the buffer hold the result.
  std::vector<float> inplace = gate_up;
  SwiGlu(inplace.data(), kRows, kInter, inplace.data());
  EXPECT_EQ(std::vector<float>(inplace.begin(), inplace.begin() + kRows * kInter), out);
}

// ---- Embedding -------------------------------------------------------------

TEST(CpuEmbedding, LooksUpRows) {
  constexpr int64_t kVocab = 10, kDim = 3;
  std::vector<float> table(kVocab * kDim);
  std::iota(table.begin(), table.end(), 0.0f);
  const std::vector<int32_t> ids = {3, 0, 9, 3};
  std::vector<float> out(ids.size() * kDim, -1.0f);
  ASSERT_TRUE(EmbeddingLookup(table.data(), kVocab, kDim, ids.data(), 4, out.data()).ok());
  EXPECT_EQ(out, (std::vector<float>{9, 10, 11, 0, 1, 2, 27, 28, 29, 9, 10, 11}));
}

TEST(CpuEmbedding, BadIdIsNamedAndNothingIsWritten) {
  constexpr int64_t kVocab = 10, kDim = 3;
  const std::vector<float> table(kVocab * kDim, 1.0f);
  std::vector<float> out(3 * kDim, -7.0f);
  std::vector<int32_t> ids = {1, 2, -1};
  Status s = EmbeddingLookup(table.data(), kVocab, kDim, ids.data(), 3, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ids[2] (-1)"));
  EXPECT_EQ(out, std::vector<float>(3 * kDim, -7.0f));

  ids = {10, 0, 0};
  s = EmbeddingLookup(table.data(), kVocab, kDim, ids.data(), 3, out.data());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("ids[0] (10)"), HasSubstr("[0, 10)")));

  s = EmbeddingLookup(table.data(), 0, kDim, ids.data(), 3, out.data());
  EXPECT_THAT(s.message(), HasSubstr("vocab (0)"));
}

}  // namespace
}  // namespace tpserve
