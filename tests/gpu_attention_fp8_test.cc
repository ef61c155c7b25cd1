// GPU tests of the E4M3 prefill attention (engine/attention_fp8.h): the producer's codes and
// V^T layout bit for bit against the CPU's (layers/fp8.h), which keys each query row reaches
// (exactly), and the attention against a CPU emulation of its own arithmetic on those codes:
// key tiles of 128 in order, the online softmax's running maximum, each weight
// exp2(score - max + 8) rounded to E4M3 for P V while the row sums take it unrounded, all
// sums exact. The hardware does not sum exactly: Hopper's 8-bit MMA keeps fewer bits than
// FP32 as it accumulates (DeepSeek-V3's report measured about 14), so a score is off by up to
// about 2^-14 of its terms' magnitudes, which moves some weights across an E4M3 rounding
// boundary (a weight then changes by up to 1/16), and P V's sums lose low bits too. Measured on
// an H200 at these seeds: 1.7e-3 to 4.0e-3 relative Frobenius difference to the emulation,
// and 0.02 % to 0.48 % of the outputs outside |gpu - emu| <= 2^-8 |emu| + 2^-9 max|v|. The
// bounds are 6e-3 and 1 %; a probability paired with the wrong key's value, a scale left out
// or a tile's weights mis-scaled move most outputs by percents. Against attention on the
// unquantized BF16 inputs (measured 3.4e-2 to 3.9e-2) the bound is 6e-2: the E4M3 rounding of
// q and k (through the scores), v and P, each about 2.5 % RMS. The producer's RoPE gives
// LaunchRope's codes bit for bit, and the engine's logits with E4M3 attention stay near BF16
// attention's (the last test says how near). Skips without a Hopper GPU and an sm_90a build.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "comm/nccl_thread_group.h"
#include "comm/status.h"
#include "engine/attention_fp8.h"
#include "engine/cpu_ops.h"
#include "engine/cuda_model.h"
#include "engine/cuda_ops.h"
#include "engine/model_weights.h"
#include "engine/token_batch.h"
#include "layers/fp8.h"
#include "layers/quantize_kernels.h"
#include "tests/gpu_test_util.h"

namespace tpserve {
namespace {

class GpuAttentionFp8Test : public GpuStreamTest {};

constexpr int64_t kHd = 128;
// Dequantization scales of q, k and v: not powers of two, so a scale applied twice or not
// at all shows.
constexpr float kScales[3] = {0.013f, 0.0071f, 0.0043f};

int VtKeyAtSlot(int slot) { return 2 * (slot >> 2) + (slot & 1) + 8 * ((slot >> 1) & 1); }
int64_t VtBegin(int64_t begin, int64_t seq) { return (begin + 15) / 16 * 16 + 32 * seq; }

// AttentionParams over the q, k and v slices of a fused QKV buffer (outputs not set).
AttentionParams FusedQkvParams(const BFloat16* qkv, int64_t q_heads, int64_t kv_heads,
                               const int32_t* cu_seqlens, int64_t num_seqs, int64_t tokens,
                               int64_t max_seqlen) {
  AttentionParams p;
  p.q = qkv;
  p.k = qkv + q_heads * kHd;
  p.v = qkv + (q_heads + kv_heads) * kHd;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = (q_heads + 2 * kv_heads) * kHd;
  p.cu_seqlens = cu_seqlens;
  p.num_seqs = num_seqs;
  p.tokens = tokens;
  p.max_seqlen = max_seqlen;
  p.q_heads = q_heads;
  p.kv_heads = kv_heads;
  p.head_dim = kHd;
  return p;
}

struct Fp8Case {
  std::vector<int32_t> seqlens;
  int64_t q_heads, kv_heads;
  int64_t max_seqlen = 0;              // 0: the true maximum
  std::vector<int32_t> nan_seqs = {};  // sequences whose q, k, v are all NaN
  // Dequantization scales of q, k and v (1, 1, 1: the engine's, where the producer skips the
  // division).
  std::array<float, 3> scales = {kScales[0], kScales[1], kScales[2]};
};

struct Fp8Run {
  std::vector<uint8_t> q8, k8, vt;
  std::vector<BFloat16> out;
  int64_t vt_columns = 0;
};

// Runs producer and attention on qkv ([tokens, q_width + 2 kv_width] BF16): attention
// persistent, from a work counter (as the model runs it), then with a block per unit, which
// must give the same bits and leave the counter zero.
void RunFp8(cudaStream_t stream, const Fp8Case& c, const std::vector<BFloat16>& qkv,
            const std::vector<int32_t>& cu, Fp8Run& run) {
  const int64_t tokens = cu.back(), num_seqs = static_cast<int64_t>(c.seqlens.size());
  const int64_t q_width = c.q_heads * kHd, kv_width = c.kv_heads * kHd;
  run.vt_columns = Fp8AttentionVtColumns(tokens, num_seqs);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_qkv, Upload(qkv, "qkv"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_cu, Upload(cu, "cu_seqlens"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_scales,
                          Upload(std::vector<float>(c.scales.begin(), c.scales.end()), "scales"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer q8,
                          PoisonedBuffer(DataType::kFloat8E4M3, tokens * q_width, "q8", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer k8,
                          PoisonedBuffer(DataType::kFloat8E4M3, tokens * kv_width, "k8", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer vt, PoisonedBuffer(DataType::kFloat8E4M3,
                                                          kv_width * run.vt_columns, "vt", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer out,
                          PoisonedBuffer(DataType::kBFloat16, tokens * q_width, "out", stream));
  int64_t longest = 0;
  for (int32_t len : c.seqlens) longest = std::max<int64_t>(longest, len);
  AttentionParams p =
      FusedQkvParams(d_qkv.as<BFloat16>(), c.q_heads, c.kv_heads, d_cu.as<int32_t>(), num_seqs,
                     tokens, c.max_seqlen > 0 ? c.max_seqlen : longest);
  p.out = out.as<BFloat16>();
  p.out_row_stride = q_width;
  Fp8AttentionInputs in;
  in.q = q8.as<uint8_t>();
  in.k = k8.as<uint8_t>();
  in.vt = vt.as<uint8_t>();
  in.vt_columns = run.vt_columns;
  in.scales = d_scales.as<float>();
  TP_ASSERT_OK(LaunchFp8AttentionInputs(p, in, nullptr, stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer counter, Upload(std::vector<int32_t>{0, 0}, "counter"));
  p.work_counter = counter.as<int32_t>();
  TP_ASSERT_OK(LaunchCausalAttentionFp8(p, in, stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer unit_out,
                          PoisonedBuffer(DataType::kBFloat16, tokens * q_width, "out", stream));
  AttentionParams unit_blocks = p;
  unit_blocks.work_counter = nullptr;
  unit_blocks.out = unit_out.as<BFloat16>();
  TP_ASSERT_OK(LaunchCausalAttentionFp8(unit_blocks, in, stream));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  TP_ASSERT_OK_AND_ASSIGN(auto left, Download<int32_t>(counter.data(), 2));
  EXPECT_EQ(left, (std::vector<int32_t>{0, 0})) << "the work counter is left dirty";
  TP_ASSERT_OK_AND_ASSIGN(auto unit_bits, Download<BFloat16>(unit_out.data(), tokens * q_width));
  TP_ASSERT_OK_AND_ASSIGN(run.q8, Download<uint8_t>(q8.data(), tokens * q_width));
  TP_ASSERT_OK_AND_ASSIGN(run.k8, Download<uint8_t>(k8.data(), tokens * kv_width));
  TP_ASSERT_OK_AND_ASSIGN(run.vt, Download<uint8_t>(vt.data(), kv_width * run.vt_columns));
  TP_ASSERT_OK_AND_ASSIGN(run.out, Download<BFloat16>(out.data(), tokens * q_width));
  size_t differ = 0;
  for (size_t i = 0; i < run.out.size(); ++i) differ += run.out[i].bits != unit_bits[i].bits;
  EXPECT_EQ(differ, 0u) << "a block per unit gives other outputs than the persistent grid";
}

void CheckFp8Attention(cudaStream_t stream, const Fp8Case& c, uint32_t seed) {
  std::vector<int32_t> cu{0};
  for (int32_t len : c.seqlens) cu.push_back(cu.back() + len);
  const int64_t tokens = cu.back();
  const int64_t q_width = c.q_heads * kHd, kv_width = c.kv_heads * kHd;
  const int64_t stride = q_width + 2 * kv_width, group = c.q_heads / c.kv_heads;
  std::string what = "fp8 attention heads=" + std::to_string(c.q_heads) + "/" +
                     std::to_string(c.kv_heads) + " seqlens=";
  for (int32_t len : c.seqlens) what += std::to_string(len) + ",";

  std::vector<BFloat16> qkv = RandomBf16(tokens * stride, -1.0f, 1.0f, seed);
  for (int64_t r = 0; r < tokens; ++r) {  // q in [-2, 2]
    for (int64_t j = 0; j < q_width; ++j) {
      qkv[r * stride + j] = FloatToBFloat16(2 * BFloat16ToFloat(qkv[r * stride + j]));
    }
  }
  for (int32_t s : c.nan_seqs) {
    for (int64_t r = cu[s]; r < cu[s + 1]; ++r) {
      for (int64_t j = 0; j < stride; ++j) {
        qkv[r * stride + j] = FloatToBFloat16(std::numeric_limits<float>::quiet_NaN());
      }
    }
  }
  Fp8Run run;
  ASSERT_NO_FATAL_FAILURE(RunFp8(stream, c, qkv, cu, run));

  // The codes, as the CPU rounds value / scale.
  auto code = [&](int64_t row, int64_t col, int which) {
    return FloatToFp8E4M3(BFloat16ToFloat(qkv[row * stride + col]) / c.scales[which]);
  };
  size_t q_wrong = 0, k_wrong = 0, vt_wrong = 0;
  for (int64_t r = 0; r < tokens; ++r) {
    for (int64_t j = 0; j < q_width; ++j) q_wrong += run.q8[r * q_width + j] != code(r, j, 0);
    for (int64_t j = 0; j < kv_width; ++j) {
      k_wrong += run.k8[r * kv_width + j] != code(r, q_width + j, 1);
    }
  }
  for (size_t s = 0; s < c.seqlens.size(); ++s) {
    const int64_t len = c.seqlens[s], col0 = VtBegin(cu[s], static_cast<int64_t>(s));
    for (int64_t row = 0; row < kv_width; ++row) {
      for (int64_t slot = 0; slot < (len + 15) / 16 * 16; ++slot) {
        const int64_t key = slot / 16 * 16 + VtKeyAtSlot(static_cast<int>(slot % 16));
        const uint8_t want = key < len ? code(cu[s] + key, q_width + kv_width + row, 2) : 0;
        vt_wrong += run.vt[row * run.vt_columns + col0 + slot] != want;
      }
    }
  }
  EXPECT_EQ(q_wrong, 0u) << what << ": Q codes";
  EXPECT_EQ(k_wrong, 0u) << what << ": K codes";
  EXPECT_EQ(vt_wrong, 0u) << what << ": V^T codes or layout";

  // The emulation, and attention on the unquantized inputs.
  const float scale_log2 =
      static_cast<float>(1.4426950408889634 / std::sqrt(128.0)) * (c.scales[0] * c.scales[1]);
  const QkvFloats f = WidenQkv(qkv, tokens, q_width, kv_width);
  std::vector<float> exact(tokens * q_width);
  TP_ASSERT_OK(CausalAttentionVarlen(f.q.data(), f.k.data(), f.v.data(), tokens, c.q_heads,
                                     c.kv_heads, kHd, cu, exact.data()));
  double err_sq = 0, emu_sq = 0, exact_err_sq = 0, exact_sq = 0;
  size_t outside = 0, checked = 0;
  const double v_bound = 1.0;  // |v| <= 1
  for (size_t s = 0; s < c.seqlens.size(); ++s) {
    if (std::find(c.nan_seqs.begin(), c.nan_seqs.end(), static_cast<int32_t>(s)) !=
        c.nan_seqs.end()) {
      continue;
    }
    const int64_t begin = cu[s], len = c.seqlens[s];
    for (int64_t h = 0; h < c.q_heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = 0; i < len; ++i) {
        std::vector<double> scores(i + 1);
        for (int64_t key = 0; key <= i; ++key) {
          double dot = 0;
          for (int64_t d = 0; d < kHd; ++d) {
            dot += double(Fp8E4M3ToFloat(run.q8[(begin + i) * q_width + h * kHd + d])) *
                   Fp8E4M3ToFloat(run.k8[(begin + key) * kv_width + kvh * kHd + d]);
          }
          scores[key] = dot;
        }
        double m = -INFINITY, l = 0;
        std::vector<double> o(kHd, 0.0);
        for (int64_t kv0 = 0; kv0 <= i; kv0 += 128) {
          const int64_t kv1 = std::min<int64_t>(kv0 + 128, i + 1);
          double tile_max = -INFINITY;
          for (int64_t key = kv0; key < kv1; ++key) tile_max = std::max(tile_max, scores[key]);
          const double new_m = std::max(m, tile_max);
          const double base = new_m * scale_log2;
          const double alpha = m == -INFINITY ? 0.0 : std::exp2(m * scale_log2 - base);
          l *= alpha;
          for (double& x : o) x *= alpha;
          for (int64_t key = kv0; key < kv1; ++key) {
            const double w = std::exp2(scores[key] * scale_log2 - base + 8);
            l += w;
            const double wr = Fp8E4M3ToFloat(FloatToFp8E4M3(static_cast<float>(w)));
            for (int64_t d = 0; d < kHd; ++d) {
              // V's codes, read through the layout checked above.
              o[d] += wr * Fp8E4M3ToFloat(code(begin + key, q_width + kv_width + kvh * kHd + d, 2));
            }
          }
          m = new_m;
        }
        for (int64_t d = 0; d < kHd; ++d) {
          const double emu = o[d] / l * c.scales[2];
          const double gpu = BFloat16ToFloat(run.out[(begin + i) * q_width + h * kHd + d]);
          const double ex = exact[(begin + i) * q_width + h * kHd + d];
          ++checked;
          outside +=
              !(std::abs(gpu - emu) <= std::ldexp(std::abs(emu), -8) + std::ldexp(v_bound, -9));
          err_sq += (gpu - emu) * (gpu - emu);
          emu_sq += emu * emu;
          exact_err_sq += (gpu - ex) * (gpu - ex);
          exact_sq += ex * ex;
        }
      }
    }
  }
  ASSERT_GT(checked, 0u) << what;
  EXPECT_LE(outside, checked / 100) << what << ": of " << checked << " outputs";
  const double rel = std::sqrt(err_sq / emu_sq), rel_exact = std::sqrt(exact_err_sq / exact_sq);
  EXPECT_LE(rel, 6e-3) << what << ": against the emulation";
  EXPECT_LE(rel_exact, 6e-2) << what << ": against unquantized attention";
  std::printf(
      "%s: rel. difference %.2e to the emulation (%zu of %zu outputs outside the element-wise "
      "bound), %.2e to unquantized attention\n",
      what.c_str(), rel, outside, checked, rel_exact);
}

TEST_F(GpuAttentionFp8Test, MatchesItsEmulationAndKeepsItsLayout) {
  TP_SKIP_WITHOUT_GPU();
  if (!Fp8AttentionSupports(kHd)) GTEST_SKIP() << "needs sm_90a and a compute capability 9.0 GPU";
  // Lengths around the 16-key groups and 128-row tiles, an empty sequence, a single token.
  CheckFp8Attention(stream(), {{1, 37, 0, 500, 129, 128, 127, 256, 255, 16, 17}, 32, 8}, 700);
  CheckFp8Attention(stream(), {{40, 3}, 4, 4}, 701);
  // An underestimated max_seqlen: the producer's and the kernel's blocks loop.
  CheckFp8Attention(stream(), {{1500, 3}, 8, 2, /*max_seqlen=*/64}, 702);
  // Unit scales, as the engine runs it: no division in the producer.
  CheckFp8Attention(stream(), {{300, 77, 1}, 8, 2, 0, {}, {1.0f, 1.0f, 1.0f}}, 703);
}

TEST_F(GpuAttentionFp8Test, KeepsSequencesApart) {
  TP_SKIP_WITHOUT_GPU();
  if (!Fp8AttentionSupports(kHd)) GTEST_SKIP() << "needs sm_90a and a compute capability 9.0 GPU";
  // NaN rows in the neighbours of each finite sequence: its last key tile reaches into their
  // V^T columns, which must not reach its output through 0 * NaN.
  CheckFp8Attention(stream(), {{37, 200, 130, 5}, 8, 2, 0, {1, 3}}, 710);
}

// Which keys each query row reaches, exactly: q = k = 0 make every unmasked weight 2^8 (an
// E4M3 code) and key j's value is the one-hot row e_(j mod 128), so row i's output is
// c * #{j <= i : j mod 128 = d} / (i + 1) with c = v's one code times its scale, to the BF16
// rounding. A probability paired with another key's value, a row's mask or sum off by a
// key, or a 16-key group's slots in another order moves whole entries. On failure the
// first wrong rows are printed as the dims they reached (with weight x (i + 1) / c), which
// names the key permutation the kernel used.
TEST_F(GpuAttentionFp8Test, AttendsToTheRightKeys) {
  TP_SKIP_WITHOUT_GPU();
  if (!Fp8AttentionSupports(kHd)) GTEST_SKIP() << "needs sm_90a and a compute capability 9.0 GPU";
  const Fp8Case c{{300, 45}, 4, 2};
  const std::vector<int32_t> cu = {0, 300, 345};
  const int64_t tokens = 345, q_width = 4 * kHd, kv_width = 2 * kHd;
  const int64_t stride = q_width + 2 * kv_width;
  std::vector<BFloat16> qkv(tokens * stride, FloatToBFloat16(0.0f));
  for (size_t s = 0; s < 2; ++s) {
    for (int64_t j = 0; j < c.seqlens[s]; ++j) {
      for (int64_t h = 0; h < 2; ++h) {
        qkv[(cu[s] + j) * stride + q_width + kv_width + h * kHd + j % kHd] = FloatToBFloat16(1.0f);
      }
    }
  }
  Fp8Run run;
  ASSERT_NO_FATAL_FAILURE(RunFp8(stream(), c, qkv, cu, run));
  const double one = Fp8E4M3ToFloat(FloatToFp8E4M3(1.0f / kScales[2])) * kScales[2];
  size_t wrong_rows = 0, wrong = 0;
  for (size_t s = 0; s < 2; ++s) {
    for (int64_t i = 0; i < c.seqlens[s]; ++i) {
      for (int64_t h = 0; h < 4; ++h) {
        bool row_ok = true;
        std::string reached;
        for (int64_t d = 0; d < kHd; ++d) {
          const int64_t count = d <= i ? (i - d) / kHd + 1 : 0;
          const float want = BFloat16ToFloat(FloatToBFloat16(
              static_cast<float>(one * static_cast<double>(count) / static_cast<double>(i + 1))));
          const float got = BFloat16ToFloat(run.out[(cu[s] + i) * q_width + h * kHd + d]);
          // BF16 of the same quotient, up to one rounding step apart (FP32 sums of 2^8 codes
          // are exact; the division is the hardware's).
          const bool ok = std::abs(got - want) <= std::ldexp(std::abs(want), -7);
          row_ok &= ok;
          wrong += !ok;
          if (got != 0.0f) {
            reached += " " + std::to_string(d) + ":" +
                       std::to_string(static_cast<double>(got) * static_cast<double>(i + 1) / one);
          }
        }
        if (!row_ok && ++wrong_rows <= 6) {
          ADD_FAILURE() << "sequence " << s << " row " << i << " head " << h
                        << ": dims reached (dim:weight x (row + 1)):" << reached;
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0u) << "in " << wrong_rows << " rows";
}

TEST_F(GpuAttentionFp8Test, RejectsBadInputs) {
  TP_SKIP_WITHOUT_GPU();
  AttentionParams p;
  p.q_heads = 8;
  p.kv_heads = 2;
  p.head_dim = 64;
  p.num_seqs = 1;
  p.tokens = 10;
  p.max_seqlen = 10;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.out_row_stride = 8 * 128;
  Fp8AttentionInputs in;
  const Status head_dim = LaunchCausalAttentionFp8(p, in, stream());
  EXPECT_EQ(head_dim.code(), StatusCode::kUnimplemented) << head_dim.ToString();
  if (!Fp8AttentionSupports(kHd)) GTEST_SKIP() << "needs sm_90a and a compute capability 9.0 GPU";
  p.head_dim = kHd;
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, DeviceBuffer::Allocate(1 << 20, "buf"));
  p.q = p.k = p.v = buf.as<BFloat16>();
  p.out = buf.as<BFloat16>();
  p.cu_seqlens = buf.as<int32_t>();
  in.q = in.k = in.vt = buf.as<uint8_t>();
  const Status no_scales = LaunchFp8AttentionInputs(p, in, nullptr, stream());
  EXPECT_EQ(no_scales.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_scales.message().find("scales"), std::string::npos) << no_scales.ToString();
  in.scales = buf.as<float>();
  in.vt_columns = Fp8AttentionVtColumns(p.tokens, p.num_seqs) - 16;
  for (const Status& s : {LaunchFp8AttentionInputs(p, in, nullptr, stream()),
                          LaunchCausalAttentionFp8(p, in, stream())}) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("vt_columns"), std::string::npos) << s.ToString();
  }
  in.vt_columns = Fp8AttentionVtColumns(p.tokens, p.num_seqs) + 8;
  const Status unaligned = LaunchCausalAttentionFp8(p, in, stream());
  EXPECT_NE(unaligned.message().find("multiple of 16"), std::string::npos) << unaligned.ToString();
  // RoPE's rows must be the attention's tokens.
  in.vt_columns = Fp8AttentionVtColumns(p.tokens, p.num_seqs);
  RopeParams rope;
  rope.q = buf.as<BFloat16>();
  rope.q_row_stride = 8 * 128;
  rope.q_heads = 8;
  rope.head_dim = kHd;
  rope.positions = buf.as<int32_t>();
  rope.rows = p.tokens + 1;
  const Status rows = LaunchFp8AttentionInputs(p, in, &rope, stream());
  EXPECT_EQ(rows.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rows.message().find("rows"), std::string::npos) << rows.ToString();
}

// RoPE inside the producer: the codes of LaunchRope's output, bit for bit (Llama 3.1's
// scaled frequencies, positions that restart with each sequence).
TEST_F(GpuAttentionFp8Test, RotatesAsLaunchRopeDoes) {
  TP_SKIP_WITHOUT_GPU();
  if (!Fp8AttentionSupports(kHd)) GTEST_SKIP() << "needs sm_90a and a compute capability 9.0 GPU";
  const std::vector<int32_t> seqlens = {300, 1, 77};
  const int64_t q_heads = 8, kv_heads = 2, q_width = q_heads * kHd, kv_width = kv_heads * kHd;
  const int64_t stride = q_width + 2 * kv_width;
  std::vector<int32_t> cu{0}, positions;
  for (int32_t len : seqlens) {
    cu.push_back(cu.back() + len);
    for (int32_t i = 0; i < len; ++i) positions.push_back(i + 5);
  }
  const int64_t tokens = cu.back();
  const std::vector<BFloat16> qkv = RandomBf16(tokens * stride, -3.0f, 3.0f, 720);
  std::vector<double> inv_freq(kHd / 2);
  for (int64_t i = 0; i < kHd / 2; ++i) {
    inv_freq[i] = std::pow(500000.0, -2.0 * i / kHd) / (i < 20 ? 1.0 : 8.0);
  }
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_qkv, Upload(qkv, "qkv"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_rotated, Upload(qkv, "qkv rotated"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_cu, Upload(cu, "cu_seqlens"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_pos, Upload(positions, "positions"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_freq, Upload(inv_freq, "inv_freq"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_scales,
                          Upload(std::vector<float>(kScales, kScales + 3), "scales"));
  const int64_t cols = Fp8AttentionVtColumns(tokens, 3);
  std::vector<DeviceBuffer> codes;
  for (int run = 0; run < 2; ++run) {
    for (int64_t bytes : {tokens * q_width, tokens * kv_width, kv_width * cols}) {
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer b,
                              PoisonedBuffer(DataType::kFloat8E4M3, bytes, "codes", stream()));
      codes.push_back(std::move(b));
    }
  }
  auto params = [&](const DeviceBuffer& qkv_buf) {
    return FusedQkvParams(qkv_buf.as<BFloat16>(), q_heads, kv_heads, d_cu.as<int32_t>(), 3, tokens,
                          300);
  };
  auto inputs = [&](int run) {
    Fp8AttentionInputs in;
    in.q = codes[3 * run].as<uint8_t>();
    in.k = codes[3 * run + 1].as<uint8_t>();
    in.vt = codes[3 * run + 2].as<uint8_t>();
    in.vt_columns = cols;
    in.scales = d_scales.as<float>();
    return in;
  };
  RopeParams rope;
  rope.q = d_rotated.as<BFloat16>();
  rope.q_row_stride = stride;
  rope.q_heads = q_heads;
  rope.k = rope.q + q_width;
  rope.k_row_stride = stride;
  rope.kv_heads = kv_heads;
  rope.head_dim = kHd;
  rope.positions = d_pos.as<int32_t>();
  rope.rows = tokens;
  rope.inv_freq = d_freq.as<double>();
  TP_ASSERT_OK(LaunchRope(rope, stream()));  // run 0: rotated first, then quantized
  TP_ASSERT_OK(LaunchFp8AttentionInputs(params(d_rotated), inputs(0), nullptr, stream()));
  rope.q = d_qkv.as<BFloat16>();  // run 1: rotated inside the producer
  rope.k = rope.q + q_width;
  TP_ASSERT_OK(LaunchFp8AttentionInputs(params(d_qkv), inputs(1), &rope, stream()));
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);
  const char* names[3] = {"q", "k", "vt"};
  for (int i = 0; i < 3; ++i) {
    const size_t n = codes[i].size();
    TP_ASSERT_OK_AND_ASSIGN(auto a, Download<uint8_t>(codes[i].data(), n));
    TP_ASSERT_OK_AND_ASSIGN(auto b, Download<uint8_t>(codes[3 + i].data(), n));
    size_t differ = 0;
    for (size_t j = 0; j < n; ++j) differ += a[j] != b[j];
    EXPECT_EQ(differ, 0u) << names[i] << ": of " << n << " codes";
  }
  // The producer left its input unrotated.
  TP_ASSERT_OK_AND_ASSIGN(auto after, Download<BFloat16>(d_qkv.data(), qkv.size()));
  size_t written = 0;
  for (size_t j = 0; j < qkv.size(); ++j) written += after[j].bits != qkv[j].bits;
  EXPECT_EQ(written, 0u);
}

// The engine with CudaModelOptions::fp8_attention at tp 1 (a 2-layer model of head_dim 128,
// random FP8 weights): graph replay equal to the eager pass bit for bit, and the logits near
// those of BF16 attention (relative Frobenius <= 2.5e-2, measured 1.0e-2 on an H200, every top-1
// equal outside near-ties: tests/gpu_test_util.h's Compare), while the two sets differ (the E4M3
// path ran). Then with KV cache scales per layer (LayerWeights::kv_scales, as a checkpoint gives
// them; K and V quantized with them): as near BF16 attention, and not the unit scales' logits
// (a scale used to quantize but not to dequantize would put the logits far off).
TEST_F(GpuAttentionFp8Test, ModelLogitsStayNearBf16Attention) {
  TP_SKIP_WITHOUT_GPU();
  if (!Fp8AttentionSupports(kHd)) GTEST_SKIP() << "needs sm_90a and a compute capability 9.0 GPU";
  ModelConfig c = *ModelPreset("tiny");
  c.num_attention_heads = c.hidden_size / kHd;  // head_dim 128
  c.num_key_value_heads = c.num_attention_heads / 2;
  ASSERT_EQ(c.head_dim(), kHd);
  ASSERT_TRUE(c.ValidateForTp(1).ok());
  auto batch = PackSequences(
      {std::vector<int32_t>(300, 3), {1, 2, 3, 4, 5}, std::vector<int32_t>(129, 0), {7}},
      c.vocab_size, c.max_position_embeddings);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  for (int64_t i = 0; i < batch->tokens(); ++i) batch->ids[i] = (i * 7919 + 13) % c.vocab_size;
  TP_ASSERT_OK_AND_ASSIGN(auto group, NcclThreadGroup::Create(1));
  TP_ASSERT_OK_AND_ASSIGN(RankWeights w, MakeRandomRankWeights(c, DataType::kFloat8E4M3, 1, 0, 5));
  RankWeights scaled = w;
  for (size_t l = 0; l < scaled.layers.size(); ++l) {
    scaled.layers[l].kv_scales = {0.011f * static_cast<float>(l + 1), 0.017f};
  }
  std::vector<float> bf16, eager, replay, with_scales;
  for (int run = 0; run < 4; ++run) {
    const Status s = group->Run([&](int rank) -> Status {
      CudaModelOptions o;
      o.max_tokens = 512;
      o.max_seqs = 4;
      o.buckets = {512};
      o.fp8_attention = run > 0;
      o.cuda_graphs = run == 2;
      TP_ASSIGN_OR_RETURN(
          auto model, CudaModel::Create(c, run == 3 ? scaled : w, nullptr, group->pool(rank), o));
      for (int pass = 0; pass < (run == 2 ? 2 : 1); ++pass) {  // capture, then replay
        TP_ASSIGN_OR_RETURN(std::vector<float> logits, model->Forward(*batch));
        (run == 0 ? bf16 : run == 1 ? eager : run == 2 ? replay : with_scales) = std::move(logits);
      }
      return model->Close();
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  ASSERT_EQ(eager.size(), bf16.size());
  EXPECT_EQ(replay, eager) << "graph replay differs from the eager pass";
  EXPECT_NE(eager, bf16) << "E4M3 attention gave BF16 attention's logits bit for bit";
  const Comparison cmp = Compare(eager, bf16, batch->sequences(), c.vocab_size);
  EXPECT_LE(cmp.rel_frobenius, 2.5e-2);
  EXPECT_EQ(cmp.top1_mismatches, 0);
  std::printf("[ model    ] E4M3 against BF16 attention: rel_frobenius %.3g\n", cmp.rel_frobenius);
  ASSERT_EQ(with_scales.size(), bf16.size());
  EXPECT_NE(with_scales, eager) << "the KV cache scales changed nothing";
  const Comparison scaled_cmp = Compare(with_scales, bf16, batch->sequences(), c.vocab_size);
  EXPECT_LE(scaled_cmp.rel_frobenius, 2.5e-2);
  EXPECT_EQ(scaled_cmp.top1_mismatches, 0);
  std::printf("[ model    ] E4M3 with KV cache scales against BF16 attention: rel_frobenius %.3g\n",
              scaled_cmp.rel_frobenius);
}

}  // namespace
}  // namespace tpserve
