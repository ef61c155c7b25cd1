// GPU tests for the non-GEMM Llama ops (engine/cuda_ops.h), checked against the CPU reference
// in engine/cpu_ops.h run on the same BF16 inputs widened to float.
//
// Inputs are random from fixed seeds at awkward shapes; outputs are poisoned with NaN
// patterns first, so an element the GPU did not write fails every comparison, and padding
// that must stay untouched is checked to still hold the poison. Tolerances (ref = the CPU
// reference in FP32, computed in double; BF16 output rounding alone is 2^-9 relative):
//   RMSNorm, SwiGLU (BF16 out): |gpu - ref| <= 2^-8 |ref| + 1e-6 (FP32 math, one rounding).
//   RoPE (inputs in [-2, 2]):   |gpu - ref| <= 2^-8 |ref| + 1e-5 (the rotation's FP32
//                               cancellation error is ~2^-23 (|a| + |b|)).
//   FP8 outputs:                the E4M3 code of ref / scale, or an adjacent code (the FP32
//                               value may sit on the other side of a rounding boundary), with
//                               at most 0.1% of codes adjacent rather than equal.
//   Attention (|v| <= 1):       |gpu - ref| <= 2^-8 |ref| + 2^-8: the output's BF16 rounding
//                               (2^-9 |ref|) plus P rounded to BF16 for P.V (<= 2^-9 sum p|v|),
//                               with a factor 2 of margin; and ||gpu - ref|| / ||ref|| <= 1e-2.
//   The residual sum, the embedding lookup and the last-token gather: bit-exact.
// Tests that launch kernels skip when no CUDA device is present; the argument checks run
// everywhere (they return before touching CUDA).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "comm/status.h"
#include "engine/attention_wgmma.h"
#include "engine/cpu_ops.h"
#include "engine/cuda_ops.h"
#include "engine/model_config.h"
#include "layers/fp8.h"
#include "layers/quantize_kernels.h"
#include "tests/gpu_test_util.h"

namespace tpserve {
namespace {

#define TP_CUDA_CHECK_FOR_TEST(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// First statement of every test that launches kernels.
const double kBf16Rel = std::ldexp(1.0, -8);

class GpuOpsTest : public GpuStreamTest {};

// ---------------------------------------------------------------------------------------------
// Host <-> device helpers

// Upload / Download: tests/gpu_test_util.h.

// ---------------------------------------------------------------------------------------------
// Data and comparisons

std::vector<float> Widen(const std::vector<BFloat16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = BFloat16ToFloat(v[i]);
  return f;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Every element within abs_tol + rel_tol * |ref|; NaN (an unwritten poison) fails.
void ExpectBf16Near(const std::vector<BFloat16>& gpu, const std::vector<float>& ref, double rel_tol,
                    double abs_tol, const std::string& what) {
  ASSERT_EQ(gpu.size(), ref.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = BFloat16ToFloat(gpu[i]);
    const double err = std::fabs(g - ref[i]);
    if (!(err <= abs_tol + rel_tol * std::fabs(ref[i]))) {
      if (++bad <= 5) {
        ADD_FAILURE() << what << ": element " << i << " gpu " << g << " ref " << ref[i]
                      << " (bits 0x" << std::hex << gpu[i].bits << std::dec << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": elements out of tolerance, of " << ref.size();
}

// The GPU's E4M3 codes against FloatToFp8E4M3(ref / scale): equal or adjacent, and rarely
// adjacent.
void ExpectFp8Near(const std::vector<uint8_t>& gpu, const std::vector<float>& ref, float scale,
                   const std::string& what) {
  ASSERT_EQ(gpu.size(), ref.size()) << what;
  size_t adjacent = 0, bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const uint8_t want = FloatToFp8E4M3(ref[i] / scale);
    const uint8_t got = gpu[i];
    if (got == want) continue;
    const int got_mag = got & 0x7F, want_mag = want & 0x7F;
    const bool same_sign = (got & 0x80) == (want & 0x80);
    const bool both_tiny = got_mag <= 1 && want_mag <= 1;
    if (got_mag != 0x7F && ((same_sign && std::abs(got_mag - want_mag) == 1) || both_tiny)) {
      ++adjacent;
    } else if (++bad <= 5) {
      ADD_FAILURE() << what << ": element " << i << " code 0x" << std::hex << int{got} << " want 0x"
                    << int{want} << std::dec << " (ref / scale = " << ref[i] / scale << ")";
    }
  }
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_LE(adjacent, ref.size() / 1000 + 1) << what << ": too many codes one step off";
}

// A scale under which the largest quarter of |ref|'s range saturates, to cover clamping.
float SaturatingScale(const std::vector<float>& ref) {
  const float amax = MaxAbs(ref);
  return amax > 0 ? amax * 0.75f / kFp8E4M3Max : 1.0f;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

// `residuals`: 0 (h = x), 1 (h = bf16(x + residual)) or 2 (the residual is the two-part sum
// bf16(residual + residual2) first, as a GEMM+RS layer's split output).
void CheckRmsNorm(cudaStream_t stream, int64_t rows, int64_t dim, int residuals, uint32_t seed) {
  const bool with_residual = residuals > 0;
  const std::string what = "rms_norm rows=" + std::to_string(rows) + " dim=" + std::to_string(dim) +
                           " residuals=" + std::to_string(residuals);
  const size_t n = static_cast<size_t>(rows * dim);
  const std::vector<BFloat16> x = RandomBf16(n, -2.0f, 2.0f, seed);
  const std::vector<BFloat16> residual = RandomBf16(n, -2.0f, 2.0f, seed + 1);
  const std::vector<BFloat16> residual2 = RandomBf16(n, -2.0f, 2.0f, seed + 3);
  const std::vector<BFloat16> weight = RandomBf16(static_cast<size_t>(dim), 0.5f, 1.5f, seed + 2);
  const float eps = 1e-5f;

  // h = bf16(x + r), each FP32 sum rounded once, like the kernel; r = residual, or
  // bf16(residual + residual2).
  std::vector<BFloat16> h_bits(n);
  for (size_t i = 0; i < n; ++i) {
    BFloat16 r = residual[i];
    if (residuals == 2) r = FloatToBFloat16(BFloat16ToFloat(r) + BFloat16ToFloat(residual2[i]));
    h_bits[i] = with_residual ? FloatToBFloat16(BFloat16ToFloat(x[i]) + BFloat16ToFloat(r)) : x[i];
  }
  const std::vector<float> h = Widen(h_bits);
  const std::vector<float> w = Widen(weight);
  std::vector<float> ref(n);
  RmsNorm(h.data(), w.data(), rows, dim, eps, ref.data());
  const float scale = SaturatingScale(ref);

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_x, Upload(x, "x"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_res, Upload(residual, "residual"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_res2, Upload(residual2, "residual2"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_w, Upload(weight, "weight"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_scale, Upload(std::vector<float>{scale}, "scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_out,
                          PoisonedBuffer(DataType::kBFloat16, n, "out", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_res_out,
                          PoisonedBuffer(DataType::kBFloat16, n, "residual_out", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_fp8,
                          PoisonedBuffer(DataType::kFloat8E4M3, n, "out_fp8", stream));
  // Garbage in out_amax: the launcher must zero it first.
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_amax, Upload(std::vector<float>{1e30f}, "amax"));

  RmsNormParams p;
  p.input = d_x.as<BFloat16>();
  if (with_residual) {
    p.residual = d_res.as<BFloat16>();
    p.residual_out = d_res_out.as<BFloat16>();
  }
  if (residuals == 2) p.residual2 = d_res2.as<BFloat16>();
  p.weight = d_w.as<BFloat16>();
  p.out = d_out.as<BFloat16>();
  p.out_fp8 = d_fp8.as<uint8_t>();
  p.out_fp8_scale = d_scale.as<float>();
  p.out_amax = d_amax.as<float>();
  p.rows = rows;
  p.dim = dim;
  p.eps = eps;
  TP_ASSERT_OK(LaunchRmsNorm(p, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));

  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_out.data(), n));
  TP_ASSERT_OK_AND_ASSIGN(auto fp8, Download<uint8_t>(d_fp8.data(), n));
  ExpectBf16Near(out, ref, kBf16Rel, 1e-6, what);
  ExpectFp8Near(fp8, ref, scale, what + " fp8");
  // out_amax: exactly the largest |out| the kernel stored.
  TP_ASSERT_OK_AND_ASSIGN(auto amax, Download<float>(d_amax.data(), 1));
  EXPECT_EQ(amax[0], Amax(Widen(out))) << what;
  if (with_residual) {
    TP_ASSERT_OK_AND_ASSIGN(auto res_out, Download<BFloat16>(d_res_out.data(), n));
    size_t mismatches = 0;
    for (size_t i = 0; i < n; ++i) mismatches += res_out[i].bits != h_bits[i].bits;
    EXPECT_EQ(mismatches, 0u) << what << ": residual_out is not bf16(x + r)";
  }
}

TEST_F(GpuOpsTest, RmsNormMatchesReference) {
  TP_SKIP_WITHOUT_GPU();
  uint32_t seed = 100;
  for (int64_t rows : {1, 37, 1002}) {
    for (int64_t dim : {256, 8192}) {
      for (int residuals : {0, 1, 2}) CheckRmsNorm(stream(), rows, dim, residuals, seed += 4);
    }
  }
  // The extremes of dim: one vector per row, and two per thread of a full block.
  for (int residuals : {1, 2}) {
    CheckRmsNorm(stream(), 37, 8, residuals, 7);
    CheckRmsNorm(stream(), 37, 16384, residuals, 8);
  }
  CheckRmsNorm(stream(), 5, 8200, 0, 9);  // not a multiple of a warp's vectors
}

TEST_F(GpuOpsTest, RmsNormInPlaceOnTheResidualStream) {
  TP_SKIP_WITHOUT_GPU();
  // The decoder layer's use: residual_out == residual (the stream is updated in place) and
  // out == input (the sublayer's output buffer is reused for the normalised input).
  const int64_t rows = 37, dim = 4096;
  const size_t n = rows * dim;
  const std::vector<BFloat16> x = RandomBf16(n, -2.0f, 2.0f, 21);
  const std::vector<BFloat16> residual = RandomBf16(n, -2.0f, 2.0f, 22);
  const std::vector<BFloat16> weight = RandomBf16(dim, 0.5f, 1.5f, 23);
  std::vector<BFloat16> h_bits(n);
  for (size_t i = 0; i < n; ++i) {
    h_bits[i] = FloatToBFloat16(BFloat16ToFloat(x[i]) + BFloat16ToFloat(residual[i]));
  }
  const std::vector<float> h = Widen(h_bits), w = Widen(weight);
  std::vector<float> ref(n);
  RmsNorm(h.data(), w.data(), rows, dim, 1e-6, ref.data());

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_x, Upload(x, "x"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_res, Upload(residual, "residual"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_w, Upload(weight, "weight"));
  RmsNormParams p;
  p.input = d_x.as<BFloat16>();
  p.out = d_x.as<BFloat16>();
  p.residual = d_res.as<BFloat16>();
  p.residual_out = d_res.as<BFloat16>();
  p.weight = d_w.as<BFloat16>();
  p.rows = rows;
  p.dim = dim;
  p.eps = 1e-6f;
  TP_ASSERT_OK(LaunchRmsNorm(p, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_x.data(), n));
  TP_ASSERT_OK_AND_ASSIGN(auto res_out, Download<BFloat16>(d_res.data(), n));
  ExpectBf16Near(out, ref, kBf16Rel, 1e-6, "in-place rms_norm");
  size_t mismatches = 0;
  for (size_t i = 0; i < n; ++i) mismatches += res_out[i].bits != h_bits[i].bits;
  EXPECT_EQ(mismatches, 0u);
}

// ---------------------------------------------------------------------------------------------
// RoPE, on the q and k slices of a fused QKV buffer

// `scaling`: null runs the kernel's plain-RoPE path (theta); otherwise both the reference and
// the kernel rotate by RopeInverseFrequencies' table (the kernel reading it from the device).
void CheckRope(cudaStream_t stream, int64_t rows, int64_t q_heads, int64_t kv_heads,
               int64_t head_dim, double theta, bool rotate_k, uint32_t seed,
               const RopeScaling* scaling = nullptr) {
  const std::string what =
      "rope rows=" + std::to_string(rows) + " heads=" + std::to_string(q_heads) + "/" +
      std::to_string(kv_heads) + " head_dim=" + std::to_string(head_dim) +
      (rotate_k ? "" : " q only") +
      (scaling != nullptr ? std::string(" table ") + RopeTypeName(scaling->type) : "");
  const int64_t q_width = q_heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t stride = q_width + 2 * kv_width;
  const std::vector<BFloat16> qkv = RandomBf16(rows * stride, -2.0f, 2.0f, seed);
  std::vector<int32_t> positions(rows);
  std::mt19937 rng(seed + 1);
  std::uniform_int_distribution<int32_t> pos_dist(0, 131071);
  for (auto& pos : positions) pos = pos_dist(rng);
  positions[0] = 0;  // the identity rotation
  if (rows > 1) positions[rows - 1] = 1000000;

  std::vector<float> q_ref(rows * q_width), k_ref(rows * kv_width);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < q_width; ++j)
      q_ref[r * q_width + j] = BFloat16ToFloat(qkv[r * stride + j]);
    for (int64_t j = 0; j < kv_width; ++j) {
      k_ref[r * kv_width + j] = BFloat16ToFloat(qkv[r * stride + q_width + j]);
    }
  }
  const std::vector<double> inv_freq =
      RopeInverseFrequencies(theta, head_dim, scaling != nullptr ? *scaling : RopeScaling{});
  TP_ASSERT_OK(ApplyRope(q_ref.data(), rows, q_heads, head_dim, positions.data(), inv_freq));
  if (rotate_k) {
    TP_ASSERT_OK(ApplyRope(k_ref.data(), rows, kv_heads, head_dim, positions.data(), inv_freq));
  }

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_qkv, Upload(qkv, "qkv"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_pos, Upload(positions, "positions"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_inv_freq, Upload(inv_freq, "inv_freq"));
  RopeParams p;
  p.q = d_qkv.as<BFloat16>();
  p.q_row_stride = stride;
  p.q_heads = q_heads;
  if (rotate_k) {
    p.k = d_qkv.as<BFloat16>() + q_width;
    p.k_row_stride = stride;
    p.kv_heads = kv_heads;
  }
  p.head_dim = head_dim;
  p.positions = d_pos.as<int32_t>();
  p.rows = rows;
  p.theta = theta;
  if (scaling != nullptr) p.inv_freq = d_inv_freq.as<double>();
  TP_ASSERT_OK(LaunchRope(p, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_qkv.data(), qkv.size()));

  std::vector<BFloat16> q_gpu(rows * q_width), k_gpu(rows * kv_width);
  size_t v_changed = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < q_width; ++j) q_gpu[r * q_width + j] = out[r * stride + j];
    for (int64_t j = 0; j < kv_width; ++j) {
      k_gpu[r * kv_width + j] = out[r * stride + q_width + j];
      const int64_t vj = r * stride + q_width + kv_width + j;
      v_changed += out[vj].bits != qkv[vj].bits;
    }
  }
  ExpectBf16Near(q_gpu, q_ref, kBf16Rel, 1e-5, what + " q");
  ExpectBf16Near(k_gpu, k_ref, kBf16Rel, 1e-5, what + " k");
  EXPECT_EQ(v_changed, 0u) << what << ": the v slice was modified";
}

TEST_F(GpuOpsTest, RopeMatchesReference) {
  TP_SKIP_WITHOUT_GPU();
  CheckRope(stream(), 37, 64, 8, 128, 500000.0, true, 200);   // Llama 3 70B, whole model
  CheckRope(stream(), 1002, 8, 1, 128, 500000.0, true, 201);  // the same at TP 8
  CheckRope(stream(), 1, 4, 2, 64, 10000.0, true, 202);
  CheckRope(stream(), 37, 3, 1, 36, 10000.0, true, 203);  // head_dim/2 = 18: scalar path
  CheckRope(stream(), 5, 2, 1, 64, 10000.0, false, 204);  // k untouched when not given
}

// Scaled RoPE from the device table, against the CPU ApplyRope with the same table.
TEST_F(GpuOpsTest, RopeScaledMatchesReference) {
  TP_SKIP_WITHOUT_GPU();
  RopeScaling llama3;  // Llama 3.1
  llama3.type = RopeType::kLlama3;
  llama3.factor = 8.0;
  llama3.low_freq_factor = 1.0;
  llama3.high_freq_factor = 4.0;
  llama3.original_max_position_embeddings = 8192;
  RopeScaling linear;
  linear.type = RopeType::kLinear;
  linear.factor = 4.0;
  const RopeScaling plain;
  CheckRope(stream(), 37, 32, 8, 128, 500000.0, true, 210, &llama3);  // Llama 3.1 8B
  CheckRope(stream(), 301, 4, 1, 128, 500000.0, true, 211, &llama3);  // at TP 8
  CheckRope(stream(), 37, 3, 1, 36, 500000.0, true, 212, &llama3);    // scalar path
  CheckRope(stream(), 19, 8, 2, 64, 10000.0, true, 213, &linear);
  CheckRope(stream(), 19, 8, 2, 64, 10000.0, false, 214, &plain);  // the plain table

  // The table is what the kernel reads: llama3's rotation is not plain RoPE's (the reference
  // run both ways differs from the kernel's result by far more than the tolerance).
  const int64_t rows = 4, heads = 1, head_dim = 128;
  const std::vector<BFloat16> x = RandomBf16(rows * heads * head_dim, -2.0f, 2.0f, 215);
  const std::vector<int32_t> positions = {0, 9000, 60000, 120000};
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_x, Upload(x, "x"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_pos, Upload(positions, "positions"));
  const std::vector<double> inv_freq = RopeInverseFrequencies(500000.0, head_dim, llama3);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_inv, Upload(inv_freq, "inv_freq"));
  RopeParams p;
  p.q = d_x.as<BFloat16>();
  p.q_row_stride = heads * head_dim;
  p.q_heads = heads;
  p.head_dim = head_dim;
  p.positions = d_pos.as<int32_t>();
  p.rows = rows;
  p.theta = 500000.0;
  p.inv_freq = d_inv.as<double>();
  TP_ASSERT_OK(LaunchRope(p, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_x.data(), x.size()));
  std::vector<float> unscaled(x.size());
  for (size_t i = 0; i < x.size(); ++i) unscaled[i] = BFloat16ToFloat(x[i]);
  TP_ASSERT_OK(ApplyRope(unscaled.data(), rows, heads, head_dim, positions.data(), 500000.0));
  double most = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    most = std::max(most, std::abs(double(BFloat16ToFloat(out[i])) - unscaled[i]));
  }
  EXPECT_GT(most, 0.1) << "the kernel rotated as plain RoPE";
}

// ---------------------------------------------------------------------------------------------
// Causal varlen attention, on the slices of a fused QKV buffer

struct AttentionCase {
  std::vector<int32_t> seqlens;
  int64_t q_heads, kv_heads, head_dim;
  float q_range;           // q uniform in [-q_range, q_range]; k, v in [-1, 1]
  int64_t max_seqlen = 0;  // 0: the true maximum
  AttentionKernel kernel = AttentionKernel::kAuto;
};

void CheckAttention(cudaStream_t stream, const AttentionCase& c, uint32_t seed) {
  std::vector<int32_t> cu_seqlens{0};
  int64_t longest = 0;
  for (int32_t len : c.seqlens) {
    cu_seqlens.push_back(cu_seqlens.back() + len);
    longest = std::max<int64_t>(longest, len);
  }
  const int64_t tokens = cu_seqlens.back();
  const int64_t num_seqs = static_cast<int64_t>(c.seqlens.size());
  const int64_t hd = c.head_dim;
  const int64_t q_width = c.q_heads * hd, kv_width = c.kv_heads * hd;
  const int64_t stride = q_width + 2 * kv_width;
  const int64_t out_stride = q_width + 8;  // padding that must stay poisoned
  std::string what = "attention heads=" + std::to_string(c.q_heads) + "/" +
                     std::to_string(c.kv_heads) + " head_dim=" + std::to_string(hd) + " seqlens=";
  for (int32_t len : c.seqlens) what += std::to_string(len) + ",";
  what += c.kernel == AttentionKernel::kWgmma     ? " kernel=wgmma"
          : c.kernel == AttentionKernel::kMmaSync ? " kernel=mma.sync"
                                                  : " kernel=auto";

  std::vector<BFloat16> qkv(tokens * stride);
  {
    const std::vector<BFloat16> q = RandomBf16(tokens * q_width, -c.q_range, c.q_range, seed);
    const std::vector<BFloat16> kv = RandomBf16(tokens * 2 * kv_width, -1.0f, 1.0f, seed + 1);
    for (int64_t r = 0; r < tokens; ++r) {
      std::copy_n(q.begin() + r * q_width, q_width, qkv.begin() + r * stride);
      std::copy_n(kv.begin() + r * 2 * kv_width, 2 * kv_width, qkv.begin() + r * stride + q_width);
    }
  }
  const QkvFloats f = WidenQkv(qkv, tokens, q_width, kv_width);
  const std::vector<float>& v_f = f.v;
  std::vector<float> ref(tokens * q_width);
  TP_ASSERT_OK(CausalAttentionVarlen(f.q.data(), f.k.data(), f.v.data(), tokens, c.q_heads,
                                     c.kv_heads, hd, cu_seqlens, ref.data()));

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_qkv, Upload(qkv, "qkv"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_cu, Upload(cu_seqlens, "cu_seqlens"));
  const float scale = SaturatingScale(ref);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_scale, Upload(std::vector<float>{scale}, "scale"));
  const int64_t out_elems = std::max<int64_t>(tokens * out_stride, 1);
  // Run 1 stores every output: BF16, its E4M3 codes and its amax (garbage first: the
  // launcher must zero it). Run 2 stores the codes only, as the FP8 model does. The Hopper
  // kernel: run 1 persistent, from a work counter (which it must leave zero), as the model
  // runs it; run 2 a block per unit, which must give the same codes.
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_out,
                          PoisonedBuffer(DataType::kBFloat16, out_elems, "out", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_fp8,
                          PoisonedBuffer(DataType::kFloat8E4M3, out_elems, "out_fp8", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_fp8_only,
                          PoisonedBuffer(DataType::kFloat8E4M3, out_elems, "out_fp8_only", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_amax, Upload(std::vector<float>{1e30f}, "amax"));
  AttentionParams p;
  p.q = d_qkv.as<BFloat16>();
  p.q_row_stride = stride;
  p.k = d_qkv.as<BFloat16>() + q_width;
  p.k_row_stride = stride;
  p.v = d_qkv.as<BFloat16>() + q_width + kv_width;
  p.v_row_stride = stride;
  p.out = d_out.as<BFloat16>();
  p.out_row_stride = out_stride;
  p.out_fp8 = d_fp8.as<uint8_t>();
  p.out_fp8_row_stride = out_stride;
  p.out_fp8_scale = d_scale.as<float>();
  p.out_amax = d_amax.as<float>();
  p.cu_seqlens = d_cu.as<int32_t>();
  p.num_seqs = num_seqs;
  p.tokens = tokens;
  p.max_seqlen = c.max_seqlen > 0 ? c.max_seqlen : longest;
  p.q_heads = c.q_heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = hd;
  p.kernel = c.kernel;
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_counter, Upload(std::vector<int32_t>{0, 0}, "counter"));
  p.work_counter = d_counter.as<int32_t>();
  TP_ASSERT_OK(LaunchCausalAttention(p, stream));
  AttentionParams fp8_only = p;
  fp8_only.work_counter = nullptr;
  fp8_only.out = nullptr;
  fp8_only.out_row_stride = 0;
  fp8_only.out_amax = nullptr;
  fp8_only.out_fp8 = d_fp8_only.as<uint8_t>();
  TP_ASSERT_OK(LaunchCausalAttention(fp8_only, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_out.data(), tokens * out_stride));
  TP_ASSERT_OK_AND_ASSIGN(auto fp8, Download<uint8_t>(d_fp8.data(), tokens * out_stride));
  TP_ASSERT_OK_AND_ASSIGN(auto fp8_only_codes,
                          Download<uint8_t>(d_fp8_only.data(), tokens * out_stride));
  TP_ASSERT_OK_AND_ASSIGN(auto amax, Download<float>(d_amax.data(), 1));
  TP_ASSERT_OK_AND_ASSIGN(auto counter, Download<int32_t>(d_counter.data(), 2));
  EXPECT_EQ(counter, (std::vector<int32_t>{0, 0})) << what << ": the work counter is left dirty";

  std::vector<BFloat16> gpu(tokens * q_width);
  size_t padding_written = 0, fp8_padding_written = 0, codes_wrong = 0, codes_differ = 0;
  for (int64_t r = 0; r < tokens; ++r) {
    std::copy_n(out.begin() + r * out_stride, q_width, gpu.begin() + r * q_width);
    for (int64_t j = 0; j < q_width; ++j) {
      const int64_t i = r * out_stride + j;
      // Exactly the codes a quantize pass over the stored BF16 output gives.
      codes_wrong += fp8[i] != FloatToFp8E4M3(BFloat16ToFloat(out[i]) / scale);
      codes_differ += fp8_only_codes[i] != fp8[i];
    }
    for (int64_t j = q_width; j < out_stride; ++j) {
      const int64_t i = r * out_stride + j;
      padding_written += out[i].bits != kBf16PoisonBits;
      fp8_padding_written +=
          (fp8[i] != kFp8E4M3PoisonBits) + (fp8_only_codes[i] != kFp8E4M3PoisonBits);
    }
  }
  EXPECT_EQ(padding_written, 0u) << what << ": wrote past q_heads * head_dim";
  EXPECT_EQ(fp8_padding_written, 0u) << what << ": out_fp8 written past q_heads * head_dim";
  EXPECT_EQ(codes_wrong, 0u) << what << ": out_fp8 is not the E4M3 codes of out / scale";
  EXPECT_EQ(codes_differ, 0u) << what << ": out_fp8 alone differs from out_fp8 beside out";
  // out_amax: exactly the largest |out| stored (0 when no token was attended).
  EXPECT_EQ(amax[0], Amax(Widen(gpu))) << what;
  const double v_max = MaxAbs(v_f);
  ExpectBf16Near(gpu, ref, kBf16Rel, std::ldexp(v_max, -8), what);
  double err_sq = 0, ref_sq = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = BFloat16ToFloat(gpu[i]) - ref[i];
    err_sq += d * d;
    ref_sq += static_cast<double>(ref[i]) * ref[i];
  }
  if (ref_sq > 0) {
    EXPECT_LE(std::sqrt(err_sq / ref_sq), 1e-2) << what;
  }
}

TEST_F(GpuOpsTest, CausalAttentionGqaMatchesReference) {
  TP_SKIP_WITHOUT_GPU();
  // Llama 3 70B's heads (64 q / 8 kv at head_dim 128); lengths around the 64-row tiles,
  // an empty sequence and a single token.
  CheckAttention(stream(), {{1, 37, 0, 500, 129}, 64, 8, 128, 2.0f}, 300);
  // Small: group 2 at head_dim 64, with peaky softmax (large q) so each key matters.
  CheckAttention(stream(), {{1, 37, 0, 500, 129}, 4, 2, 64, 6.0f}, 301);
}

TEST_F(GpuOpsTest, CausalAttentionTileBoundariesAndEmptySequences) {
  TP_SKIP_WITHOUT_GPU();
  CheckAttention(stream(), {{0, 64, 65, 63, 1, 128, 0}, 8, 8, 64, 3.0f}, 310);
  CheckAttention(stream(), {{0, 64, 65, 63, 1, 128, 0}, 4, 1, 128, 3.0f}, 311);
}

TEST_F(GpuOpsTest, CausalAttentionWithUnderestimatedMaxSeqlenIsStillCorrect) {
  TP_SKIP_WITHOUT_GPU();
  // max_seqlen only sizes the grid: one query tile per block here, looping over 17.
  CheckAttention(stream(), {{1030, 7}, 2, 1, 128, 3.0f, /*max_seqlen=*/64}, 320);
  CheckAttention(stream(), {{1030, 7}, 2, 2, 64, 3.0f, /*max_seqlen=*/1}, 321);
}

TEST_F(GpuOpsTest, CausalAttentionHopperKernelMatchesReference) {
  TP_SKIP_WITHOUT_GPU();
  if (!WgmmaAttentionSupports(128)) {
    GTEST_SKIP() << "the warpgroup-MMA kernel needs an sm_90a build on a compute capability 9.0 "
                    "device";
  }
  constexpr AttentionKernel kWg = AttentionKernel::kWgmma;
  // Lengths around its 128-row query and key tiles, an empty sequence and a single token;
  // GQA groups of 8 and 1.
  CheckAttention(stream(), {{1, 37, 0, 500, 129, 128, 127, 256, 255}, 64, 8, 128, 2.0f, 0, kWg},
                 330);
  CheckAttention(stream(), {{1, 37, 0, 500, 129}, 4, 4, 128, 6.0f, 0, kWg}, 331);
  // Sixteen key tiles (both buffers reused many times), and blocks that loop over query tiles
  // (max_seqlen underestimated).
  CheckAttention(stream(), {{2000, 3}, 2, 1, 128, 3.0f, /*max_seqlen=*/64, kWg}, 332);
  // The persistent grid (one tile on average, and more than 16): blocks move between
  // sequences, heads and KV heads, skip units without a tile (empty sequences, slots past a
  // short sequence's tiles) and copy each next unit's tiles in while they write the current
  // one; CheckAttention's second run, a block per unit, must give the same codes.
  std::vector<int32_t> short_seqs;
  for (int i = 0; i < 60; ++i) short_seqs.push_back((i * 37) % 150);
  short_seqs.resize(100, 0);  // empty slots after them, as a padded batch has
  CheckAttention(stream(), {short_seqs, 16, 4, 128, 3.0f, 0, kWg}, 334);
  CheckAttention(stream(), {{4200, 5}, 2, 1, 128, 3.0f, 0, kWg}, 335);
  // kAuto takes this kernel at head_dim 128 here: the mma.sync kernel stays tested by name.
  CheckAttention(stream(), {{1, 37, 0, 500, 129}, 8, 2, 128, 3.0f, 0, AttentionKernel::kMmaSync},
                 333);
}

// A non-finite value in one sequence's keys or values must not reach another sequence of the
// batch (the Hopper kernel reads rows past a sequence and masks them).
TEST_F(GpuOpsTest, CausalAttentionKeepsSequencesApart) {
  TP_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> cu_seqlens = {0, 100, 160};  // the second sequence's rows are NaN
  const int64_t tokens = 160, heads = 4, kv_heads = 2, hd = 128;
  const int64_t stride = (heads + 2 * kv_heads) * hd;
  std::vector<AttentionKernel> kernels = {AttentionKernel::kMmaSync};
  if (WgmmaAttentionSupports(hd)) kernels.push_back(AttentionKernel::kWgmma);
  std::vector<BFloat16> clean = RandomBf16(tokens * stride, -1.0f, 1.0f, 340);
  std::vector<BFloat16> poisoned = clean;
  for (int64_t r = 100; r < tokens; ++r) {
    for (int64_t j = 0; j < stride; ++j) poisoned[r * stride + j].bits = 0x7FC0;  // NaN
  }
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_cu, Upload(cu_seqlens, "cu_seqlens"));
  for (AttentionKernel kernel : kernels) {
    std::vector<std::vector<BFloat16>> outs;
    for (const auto* qkv : {&clean, &poisoned}) {
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_qkv, Upload(*qkv, "qkv"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_out,
                              DeviceBuffer::Allocate(tokens * heads * hd * 2, "out"));
      AttentionParams p;
      p.q = d_qkv.as<BFloat16>();
      p.k = p.q + heads * hd;
      p.v = p.k + kv_heads * hd;
      p.q_row_stride = p.k_row_stride = p.v_row_stride = stride;
      p.out = d_out.as<BFloat16>();
      p.out_row_stride = heads * hd;
      p.cu_seqlens = d_cu.as<int32_t>();
      p.num_seqs = 2;
      p.tokens = tokens;
      p.max_seqlen = 100;
      p.q_heads = heads;
      p.kv_heads = kv_heads;
      p.head_dim = hd;
      p.kernel = kernel;
      TP_ASSERT_OK(LaunchCausalAttention(p, stream()));
      TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
      TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_out.data(), 100 * heads * hd));
      outs.push_back(std::move(out));
    }
    size_t differ = 0, non_finite = 0;
    for (size_t i = 0; i < outs[0].size(); ++i) {
      differ += outs[0][i].bits != outs[1][i].bits;
      non_finite += !std::isfinite(BFloat16ToFloat(outs[1][i]));
    }
    const char* name = kernel == AttentionKernel::kWgmma ? "wgmma" : "mma.sync";
    EXPECT_EQ(non_finite, 0u) << name << ": NaN rows of the next sequence reached the first";
    EXPECT_EQ(differ, 0u) << name << ": the first sequence's output depends on the next one's";
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

void CheckSwiGlu(cudaStream_t stream, int64_t rows, int64_t inter, uint32_t seed) {
  const std::string what =
      "swiglu rows=" + std::to_string(rows) + " inter=" + std::to_string(inter);
  const std::vector<BFloat16> gate_up = RandomBf16(rows * 2 * inter, -6.0f, 6.0f, seed);
  const std::vector<float> gate_up_f = Widen(gate_up);
  std::vector<float> ref(rows * inter);
  SwiGlu(gate_up_f.data(), rows, inter, ref.data());
  const float scale = SaturatingScale(ref);

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_in, Upload(gate_up, "gate_up"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_scale, Upload(std::vector<float>{scale}, "scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_out,
                          PoisonedBuffer(DataType::kBFloat16, rows * inter, "out", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_fp8,
                          PoisonedBuffer(DataType::kFloat8E4M3, rows * inter, "out_fp8", stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_amax, Upload(std::vector<float>{1e30f}, "amax"));
  SwiGluParams p;
  p.gate_up = d_in.as<BFloat16>();
  p.out = d_out.as<BFloat16>();
  p.out_fp8 = d_fp8.as<uint8_t>();
  p.out_fp8_scale = d_scale.as<float>();
  p.out_amax = d_amax.as<float>();
  p.rows = rows;
  p.inter = inter;
  TP_ASSERT_OK(LaunchSwiGlu(p, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_out.data(), rows * inter));
  TP_ASSERT_OK_AND_ASSIGN(auto fp8, Download<uint8_t>(d_fp8.data(), rows * inter));
  ExpectBf16Near(out, ref, kBf16Rel, 1e-6, what);
  ExpectFp8Near(fp8, ref, scale, what + " fp8");
  TP_ASSERT_OK_AND_ASSIGN(auto amax, Download<float>(d_amax.data(), 1));
  EXPECT_EQ(amax[0], Amax(Widen(out))) << what;
}

TEST_F(GpuOpsTest, SwiGluMatchesReference) {
  TP_SKIP_WITHOUT_GPU();
  uint32_t seed = 400;
  for (int64_t rows : {1, 37, 1002}) {
    for (int64_t inter : {256, 8192}) CheckSwiGlu(stream(), rows, inter, ++seed);
  }
  CheckSwiGlu(stream(), 37, 3584, 410);  // Llama 3 70B's 28672 at TP 8
  CheckSwiGlu(stream(), 37, 37, 411);    // scalar path
}

// ---------------------------------------------------------------------------------------------
// Embedding lookup

struct EmbeddingRun {
  std::vector<BFloat16> out;
  int32_t error_flag = -1;
};

StatusOr<EmbeddingRun> RunEmbedding(cudaStream_t stream, const std::vector<BFloat16>& table,
                                    int64_t vocab, int64_t dim, const std::vector<int32_t>& ids) {
  const int64_t n = static_cast<int64_t>(ids.size());
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_table, Upload(table, "table"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_ids, Upload(ids, "ids"));
  // The flag starts non-zero, to see the launcher reset it.
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_flag, Upload(std::vector<int32_t>{12345}, "error_flag"));
  TP_ASSIGN_OR_RETURN(
      DeviceBuffer d_out,
      PoisonedBuffer(DataType::kBFloat16, std::max<int64_t>(n * dim, 1), "out", stream));
  EmbeddingParams p;
  p.table = d_table.as<BFloat16>();
  p.vocab = vocab;
  p.dim = dim;
  p.ids = d_ids.as<int32_t>();
  p.n = n;
  p.out = d_out.as<BFloat16>();
  p.error_flag = d_flag.as<int32_t>();
  TP_RETURN_IF_ERROR(LaunchEmbeddingLookup(p, stream));
  TP_CUDA_CHECK(cudaStreamSynchronize(stream));
  EmbeddingRun run;
  TP_ASSIGN_OR_RETURN(run.out, Download<BFloat16>(d_out.data(), n * dim));
  TP_ASSIGN_OR_RETURN(std::vector<int32_t> flag, Download<int32_t>(d_flag.data(), 1));
  run.error_flag = flag[0];
  return run;
}

TEST_F(GpuOpsTest, EmbeddingLookupCopiesRows) {
  TP_SKIP_WITHOUT_GPU();
  const int64_t vocab = 1000;
  for (int64_t dim : {256, 8192, 7}) {  // 7: scalar path
    for (int64_t n : {1, 37, 1002}) {
      const std::vector<BFloat16> table = RandomBf16(vocab * dim, -1.0f, 1.0f, 500 + dim);
      std::vector<int32_t> ids(n);
      std::mt19937 rng(501 + n);
      std::uniform_int_distribution<int32_t> id_dist(0, vocab - 1);
      for (auto& id : ids) id = id_dist(rng);
      ids[0] = static_cast<int32_t>(vocab - 1);
      TP_ASSERT_OK_AND_ASSIGN(EmbeddingRun run, RunEmbedding(stream(), table, vocab, dim, ids));
      EXPECT_EQ(run.error_flag, 0);
      std::vector<float> ref(n * dim);
      const std::vector<float> table_f = Widen(table);
      TP_ASSERT_OK(EmbeddingLookup(table_f.data(), vocab, dim, ids.data(), n, ref.data()));
      ExpectBf16Near(run.out, ref, 0.0, 0.0, "embedding dim=" + std::to_string(dim));
    }
  }
}

TEST_F(GpuOpsTest, EmbeddingLookupFlagsOutOfRangeIdsAndZeroesTheirRows) {
  TP_SKIP_WITHOUT_GPU();
  const int64_t vocab = 100, dim = 64, n = 37;
  const std::vector<BFloat16> table = RandomBf16(vocab * dim, -1.0f, 1.0f, 510);
  std::vector<int32_t> ids(n);
  for (int64_t t = 0; t < n; ++t) ids[t] = static_cast<int32_t>((t * 7) % vocab);
  ids[30] = std::numeric_limits<int32_t>::min();
  ids[20] = static_cast<int32_t>(vocab);
  ids[5] = -1;  // the first bad position
  TP_ASSERT_OK_AND_ASSIGN(EmbeddingRun run, RunEmbedding(stream(), table, vocab, dim, ids));
  EXPECT_EQ(run.error_flag, 6) << "first bad position + 1";
  for (int64_t t = 0; t < n; ++t) {
    const bool bad = t == 5 || t == 20 || t == 30;
    for (int64_t j = 0; j < dim; ++j) {
      const uint16_t want = bad ? 0 : table[ids[t] * dim + j].bits;
      ASSERT_EQ(run.out[t * dim + j].bits, want) << "row " << t << " col " << j;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Last-token gather

TEST_F(GpuOpsTest, GatherLastTokensPicksEachSequencesLastRow) {
  TP_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> cu_seqlens{0, 1, 38, 38, 538, 667};
  const int64_t tokens = 667, dim = 250, stride = 264, seqs = 5;
  const std::vector<BFloat16> input = RandomBf16(tokens * stride, -4.0f, 4.0f, 600);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_in, Upload(input, "input"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_cu, Upload(cu_seqlens, "cu_seqlens"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_out,
                          PoisonedBuffer(DataType::kFloat32, seqs * dim, "out", stream()));
  GatherLastTokensParams p;
  p.input = d_in.as<BFloat16>();
  p.input_row_stride = stride;
  p.tokens = tokens;
  p.dim = dim;
  p.cu_seqlens = d_cu.as<int32_t>();
  p.num_seqs = seqs;
  p.out = d_out.as<float>();
  TP_ASSERT_OK(LaunchGatherLastTokens(p, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<float>(d_out.data(), seqs * dim));
  for (int64_t s = 0; s < seqs; ++s) {
    const bool empty = cu_seqlens[s + 1] == cu_seqlens[s];
    const int64_t row = cu_seqlens[s + 1] - 1;
    for (int64_t j = 0; j < dim; ++j) {
      const float want = empty ? 0.0f : BFloat16ToFloat(input[row * stride + j]);
      ASSERT_EQ(out[s * dim + j], want) << "sequence " << s << " col " << j;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Argument checks: they return before any CUDA call, so this runs without a GPU too. The
// pointers are never dereferenced; they only need the alignment the checks look at.

template <class T>
T* FakeDevicePointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void ExpectRejected(const Status& s, StatusCode code, const std::string& field) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_NE(s.message().find(field), std::string::npos)
      << "message does not name " << field << ": " << s.ToString();
}

TEST_F(GpuOpsTest, InvalidArgumentsAreRejectedBeforeLaunch) {
  constexpr auto kInvalid = StatusCode::kInvalidArgument;
  BFloat16* bf = FakeDevicePointer<BFloat16>(0x10000);
  BFloat16* bf_misaligned = FakeDevicePointer<BFloat16>(0x10002);
  uint8_t* bytes = FakeDevicePointer<uint8_t>(0x20000);
  float* scale = FakeDevicePointer<float>(0x30000);
  int32_t* ints = FakeDevicePointer<int32_t>(0x40000);

  RmsNormParams norm;
  norm.input = bf;
  norm.weight = bf;
  norm.out = bf;
  norm.rows = 3;
  norm.dim = 256;
  {
    RmsNormParams p = norm;
    p.dim = 12;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "dim");
    p.dim = 16392;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "dim");
  }
  {
    RmsNormParams p = norm;
    p.out = nullptr;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "out_fp8");
    p.out_fp8 = bytes;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "out_fp8_scale");
  }
  {
    RmsNormParams p = norm;
    p.residual = bf;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "residual_out");
  }
  {
    RmsNormParams p = norm;
    p.residual2 = bf;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "residual2");
  }
  {
    // out_amax is the BF16 output's amax: refused without out, and misaligned.
    RmsNormParams p = norm;
    p.out = nullptr;
    p.out_fp8 = bytes;
    p.out_fp8_scale = scale;
    p.out_amax = scale;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "when out_amax is set");
    p.out = bf;
    p.out_amax = reinterpret_cast<float*>(bytes + 2);
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "out_amax");
  }
  {
    RmsNormParams p = norm;
    p.input = bf_misaligned;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "input");
    p.input = bf;
    p.residual = p.residual_out = bf;
    p.residual2 = bf_misaligned;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "residual2");
    p.residual2 = nullptr;
    p.residual = nullptr;
    p.residual_out = nullptr;
    p.eps = -1.0f;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "eps");
    p.eps = 1e-5f;
    p.rows = -1;
    ExpectRejected(LaunchRmsNorm(p, nullptr), kInvalid, "rows");
  }

  RopeParams rope;
  rope.q = bf;
  rope.q_row_stride = 8 * 128;
  rope.q_heads = 8;
  rope.head_dim = 128;
  rope.positions = ints;
  rope.rows = 3;
  {
    RopeParams p = rope;
    p.head_dim = 127;
    ExpectRejected(LaunchRope(p, nullptr), kInvalid, "head_dim");
  }
  {
    RopeParams p = rope;
    p.q_row_stride = 100;
    ExpectRejected(LaunchRope(p, nullptr), kInvalid, "q_row_stride");
    p.q_row_stride = rope.q_row_stride;
    p.theta = 0.0;
    ExpectRejected(LaunchRope(p, nullptr), kInvalid, "theta");
    p.theta = 10000.0;
    p.positions = nullptr;
    ExpectRejected(LaunchRope(p, nullptr), kInvalid, "positions");
    p.positions = ints;
    p.k = bf;
    ExpectRejected(LaunchRope(p, nullptr), kInvalid, "kv_heads");
  }
  {
    RopeParams p = rope;
    p.inv_freq = reinterpret_cast<const double*>(reinterpret_cast<const char*>(ints) + 4);
    ExpectRejected(LaunchRope(p, nullptr), kInvalid, "inv_freq");
  }

  AttentionParams attn;
  attn.q = bf;
  attn.k = bf;
  attn.v = bf;
  attn.out = bf;
  attn.q_row_stride = attn.out_row_stride = 8 * 128;
  attn.k_row_stride = attn.v_row_stride = 128;
  attn.cu_seqlens = ints;
  attn.num_seqs = 2;
  attn.tokens = 10;
  attn.max_seqlen = 7;
  attn.q_heads = 8;
  attn.kv_heads = 1;
  attn.head_dim = 128;
  {
    AttentionParams p = attn;
    p.head_dim = 96;
    ExpectRejected(LaunchCausalAttention(p, nullptr), StatusCode::kUnimplemented, "head_dim");
  }
  {
    AttentionParams p = attn;
    p.head_dim = 64;
    p.q_row_stride = p.out_row_stride = 8 * 64;
    p.k_row_stride = p.v_row_stride = 64;
    p.kernel = AttentionKernel::kWgmma;
    ExpectRejected(LaunchCausalAttention(p, nullptr), StatusCode::kUnimplemented,
                   "kernel = kWgmma");
  }
  {
    AttentionParams p = attn;
    p.kv_heads = 3;
    p.k_row_stride = p.v_row_stride = 3 * 128;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "q_heads");
  }
  {
    AttentionParams p = attn;
    p.k_row_stride = 100;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "k_row_stride");
    p.k_row_stride = 132;  // >= 128 but not a multiple of 8
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "k_row_stride");
  }
  {
    AttentionParams p = attn;
    p.max_seqlen = 0;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "max_seqlen");
    p.max_seqlen = 7;
    p.cu_seqlens = nullptr;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "cu_seqlens");
    p.cu_seqlens = ints;
    p.v = bf_misaligned;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "AttentionParams.v is not aligned");
  }
  {
    // The fused FP8 output: one output at least, its scale, its stride and alignment; and
    // out_amax, the BF16 output's amax, only beside out.
    AttentionParams p = attn;
    p.out = nullptr;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "out and out_fp8 are both null");
    p.out_fp8 = bytes;
    p.out_fp8_row_stride = 8 * 128;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "out_fp8_scale");
    p.out_fp8_scale = scale;
    p.out_fp8_row_stride = 8 * 128 - 8;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "out_fp8_row_stride");
    p.out_fp8_row_stride = 8 * 128;
    p.out_fp8 = bytes + 8;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "out_fp8");
    p.out_fp8 = bytes;
    p.out_amax = scale;
    ExpectRejected(LaunchCausalAttention(p, nullptr), kInvalid, "when out_amax is set");
  }

  SwiGluParams swiglu;
  swiglu.gate_up = bf;
  swiglu.out = bf;
  swiglu.rows = 3;
  swiglu.inter = 256;
  {
    SwiGluParams p = swiglu;
    p.inter = 0;
    ExpectRejected(LaunchSwiGlu(p, nullptr), kInvalid, "inter");
    p.inter = 256;
    p.out = nullptr;
    ExpectRejected(LaunchSwiGlu(p, nullptr), kInvalid, "out_fp8");
    p.out_fp8 = bytes;
    ExpectRejected(LaunchSwiGlu(p, nullptr), kInvalid, "out_fp8_scale");
  }

  EmbeddingParams embed;
  embed.table = bf;
  embed.vocab = 100;
  embed.dim = 64;
  embed.ids = ints;
  embed.n = 3;
  embed.out = bf;
  {
    EmbeddingParams p = embed;  // error_flag left null
    ExpectRejected(LaunchEmbeddingLookup(p, nullptr), kInvalid, "error_flag");
    p.error_flag = ints;
    p.vocab = 0;
    ExpectRejected(LaunchEmbeddingLookup(p, nullptr), kInvalid, "vocab");
  }

  GatherLastTokensParams gather;
  gather.input = bf;
  gather.input_row_stride = 10;
  gather.tokens = 4;
  gather.dim = 16;
  gather.cu_seqlens = ints;
  gather.num_seqs = 1;
  gather.out = scale;
  ExpectRejected(LaunchGatherLastTokens(gather, nullptr), kInvalid, "input_row_stride");

  // Empty work is OK and launches nothing, null pointers included.
  EXPECT_TRUE(LaunchRmsNorm({.out = bf, .rows = 0, .dim = 256}, nullptr).ok());
  EXPECT_TRUE(LaunchRope({.q_row_stride = 64, .q_heads = 1, .head_dim = 64}, nullptr).ok());
  AttentionParams empty_attn = attn;
  empty_attn.tokens = 0;
  empty_attn.num_seqs = 0;
  EXPECT_TRUE(LaunchCausalAttention(empty_attn, nullptr).ok());
  EXPECT_TRUE(LaunchSwiGlu({.out = bf, .rows = 0, .inter = 8}, nullptr).ok());
}

}  // namespace
}  // namespace tpserve
