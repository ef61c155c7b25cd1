// GPU tests for CublasLtGemm (layers/cublaslt_gemm.h), the FP8 element-wise kernels
// (layers/quantize_kernels.h) and the CUDA RAII owners (comm/cuda_resources.h).
//
// Every result is checked against the CPU reference: layers/fp8.h's codec and a GEMM
// accumulated in double. Inputs are fresh random data at awkward shapes; outputs are poisoned
// with NaN patterns before each run, so an element the GPU did not write shows up as NaN, and
// padding the GPU must not touch is checked to still hold the poison. Tolerances:
//   BF16-output GEMMs:  relative Frobenius error ||out - ref|| / ||ref|| <= 1e-2.
//   FP8-output GEMMs:   every element within one E4M3 ulp of ref * d_quant_scale, relative
//                       Frobenius error <= 5e-2 (3 mantissa bits), amax within 1e-3 relative.
//   Scaled (per token/channel, blockwise) GEMMs: relative Frobenius error <= 2^-8, from BF16
//                       output rounding (see kScaledGemmTolerance).
//   Quantize, amax, dequantize kernels: bit-exact.
// Every test skips when no CUDA device is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "comm/status.h"
#include "layers/cublaslt_gemm.h"
#include "layers/fp8.h"
#include "layers/quantize_kernels.h"
#include "layers/sum_kernels.h"
#include "tests/gpu_test_util.h"

namespace tpserve {
namespace {

// cudaError_t checks in test bodies and void helpers.
#define TP_CUDA_CHECK_FOR_TEST(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

constexpr double kBf16OutputTolerance = 1e-2;
constexpr double kFp8OutputFrobeniusTolerance = 5e-2;
constexpr double kAmaxRelativeTolerance = 1e-3;

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    TP_ASSERT_OK_AND_ASSIGN(stream_, CudaStream::Create());
  }

  cudaStream_t stream() const { return stream_.get(); }

  CudaStream stream_;
};

// ---------------------------------------------------------------------------------------------
// Host <-> device helpers

// Upload / Download: tests/gpu_test_util.h.

StatusOr<DeviceBuffer> DeviceScalar(float v, const std::string& name) {
  return Upload(std::vector<float>{v}, name);
}

// ---------------------------------------------------------------------------------------------
// Random data. Matrices are row-major rows x cols with row pitch ld; the padding columns hold
// NaN codes, so a GEMM that reads them produces NaN.

std::vector<uint8_t> RandomFp8Matrix(int64_t rows, int64_t cols, int64_t ld, float lo, float hi,
                                     uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint8_t> m(static_cast<size_t>(rows * ld), kFp8E4M3PoisonBits);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) m[r * ld + c] = FloatToFp8E4M3(dist(rng));
  }
  return m;
}

std::vector<BFloat16> RandomBf16Matrix(int64_t rows, int64_t cols, int64_t ld, float lo, float hi,
                                       uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<BFloat16> m(static_cast<size_t>(rows * ld), BFloat16{kBf16PoisonBits});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) m[r * ld + c] = FloatToBFloat16(dist(rng));
  }
  return m;
}

std::vector<float> DecodeFp8(const std::vector<uint8_t>& codes) {
  std::vector<float> f(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) f[i] = Fp8E4M3ToFloat(codes[i]);
  return f;
}

std::vector<float> DecodeBf16(const std::vector<BFloat16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = BFloat16ToFloat(v[i]);
  return f;
}

// ---------------------------------------------------------------------------------------------
// CPU reference: out[i*n + j] = scale * sum_kk a[i*lda + kk] * b[j*ldb + kk], accumulated in
// double (float products are exact in double). Rows in blocks of 4 so that each row of b is
// read once per block; threads take interleaved blocks.

std::vector<double> ReferenceGemm(const float* a, int64_t lda, const float* b, int64_t ldb,
                                  int64_t m, int64_t n, int64_t k, double scale) {
  std::vector<double> out(static_cast<size_t>(m * n));
  constexpr int64_t kRows = 4;
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1u, 64u);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i0 = t * kRows; i0 < m; i0 += static_cast<int64_t>(threads) * kRows) {
        const float* rows[kRows];
        for (int64_t r = 0; r < kRows; ++r) rows[r] = a + std::min(i0 + r, m - 1) * lda;
        for (int64_t j = 0; j < n; ++j) {
          const float* bj = b + j * ldb;
          double acc[kRows] = {0.0, 0.0, 0.0, 0.0};
          for (int64_t kk = 0; kk < k; ++kk) {
            const double bv = bj[kk];
            for (int64_t r = 0; r < kRows; ++r) acc[r] += static_cast<double>(rows[r][kk]) * bv;
          }
          for (int64_t r = 0; r < kRows && i0 + r < m; ++r) out[(i0 + r) * n + j] = scale * acc[r];
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  return out;
}

struct Comparison {
  size_t nan_count = 0;
  double rel_frobenius = 0.0;
};

Comparison Compare(const std::vector<double>& got, const std::vector<double>& ref) {
  Comparison c;
  double err2 = 0.0;
  double ref2 = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) {
      ++c.nan_count;
      continue;
    }
    err2 += (got[i] - ref[i]) * (got[i] - ref[i]);
    ref2 += ref[i] * ref[i];
  }
  c.rel_frobenius = ref2 > 0.0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  return c;
}

// The m x n block of a BF16 matrix with pitch ld, as doubles.
std::vector<double> Bf16Block(const std::vector<BFloat16>& raw, size_t offset, int64_t m, int64_t n,
                              int64_t ld) {
  std::vector<double> v(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) v[i * n + j] = BFloat16ToFloat(raw[offset + i * ld + j]);
  }
  return v;
}

// Elements of raw[offset, offset + rows*ld) outside the m x n block that no longer hold the
// poison (rows beyond m count as padding too).
size_t CountTouchedPadding(const std::vector<BFloat16>& raw, size_t offset, int64_t rows, int64_t m,
                           int64_t n, int64_t ld) {
  size_t touched = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < ld; ++j) {
      if (i < m && j < n) continue;
      if (raw[offset + i * ld + j].bits != kBf16PoisonBits) ++touched;
    }
  }
  return touched;
}

// ---------------------------------------------------------------------------------------------
// FP8 x FP8 -> BF16 on fresh data, checked against the reference. lda/ldb/ldd of p may be
// padded; padding must be neither read (it holds NaN) nor written (it must stay poisoned).

void CheckFp8Bf16Gemm(CublasLtGemm& gemm, GemmParams p, uint32_t seed, cudaStream_t stream) {
  const int64_t lda = p.lda ? p.lda : p.k;
  const int64_t ldb = p.ldb ? p.ldb : p.k;
  const int64_t ldd = p.ldd ? p.ldd : p.n;
  const float a_scale = 0.37f;
  const float b_scale = 0.011f;
  const std::vector<uint8_t> a = RandomFp8Matrix(p.m, p.k, lda, -4.0f, 4.0f, seed);
  const std::vector<uint8_t> b = RandomFp8Matrix(p.n, p.k, ldb, -1.0f, 1.0f, seed + 1);

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsa, DeviceScalar(a_scale, "a_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsb, DeviceScalar(b_scale, "b_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(p.m * ldd * 2, "D"));
  TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kBFloat16, p.m * ldd, stream));

  p.a_type = p.b_type = DataType::kFloat8E4M3;
  p.d_type = DataType::kBFloat16;
  p.a_scale = dsa.as<float>();
  p.b_scale = dsb.as<float>();
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));

  TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dd.data(), p.m * ldd));
  const std::vector<float> af = DecodeFp8(a);
  const std::vector<float> bf = DecodeFp8(b);
  const std::vector<double> ref = ReferenceGemm(af.data(), lda, bf.data(), ldb, p.m, p.n, p.k,
                                                static_cast<double>(a_scale) * b_scale);
  const Comparison c = Compare(Bf16Block(out, 0, p.m, p.n, ldd), ref);
  EXPECT_EQ(c.nan_count, 0u) << "unwritten (poisoned) or NaN output elements";
  EXPECT_LE(c.rel_frobenius, kBf16OutputTolerance);
  EXPECT_EQ(CountTouchedPadding(out, 0, p.m, p.m, p.n, ldd), 0u) << "wrote into the ldd padding";
}

// ---------------------------------------------------------------------------------------------
// FP8 GEMM at awkward shapes.

struct Shape {
  int64_t m, n, k;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  return "m" + std::to_string(info.param.m) + "_n" + std::to_string(info.param.n) + "_k" +
         std::to_string(info.param.k);
}

std::vector<Shape> Fp8Shapes() {
  std::vector<Shape> shapes;
  for (int64_t m : {37, 1002, 4099}) {
    for (int64_t n : {64, 1040}) {
      for (int64_t k : {256, 4096}) shapes.push_back({m, n, k});
    }
  }
  return shapes;
}

class Fp8GemmShapeTest : public GpuTest, public ::testing::WithParamInterface<Shape> {};

TEST_P(Fp8GemmShapeTest, Bf16OutputMatchesCpuReference) {
  const Shape s = GetParam();
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("fp8_shape_test"));
  GemmParams p;
  p.m = s.m;
  p.n = s.n;
  p.k = s.k;
  CheckFp8Bf16Gemm(gemm, p, /*seed=*/static_cast<uint32_t>(s.m * 31 + s.n * 7 + s.k), stream());
}

INSTANTIATE_TEST_SUITE_P(AwkwardShapes, Fp8GemmShapeTest, ::testing::ValuesIn(Fp8Shapes()),
                         ShapeName);

TEST_F(GpuTest, Fp8GemmPaddedLeadingDimsNeitherReadNorWritePadding) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("fp8_padded"));
  GemmParams p;
  p.m = 1002;
  p.n = 1040;
  p.k = 512;
  p.lda = p.k + 16;
  p.ldb = p.k + 48;
  p.ldd = p.n + 24;
  CheckFp8Bf16Gemm(gemm, p, 11, stream());
}

TEST_F(GpuTest, Fp8GemmFastAccumOnAndOffBothMatchReference) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("fp8_fast_accum"));
  for (bool fast : {false, true}) {
    SCOPED_TRACE(fast ? "fast_accum on" : "fast_accum off");
    GemmParams p;
    p.m = 1002;
    p.n = 1040;
    p.k = 4096;
    p.fast_accum = fast;
    CheckFp8Bf16Gemm(gemm, p, 21, stream());
  }
  EXPECT_EQ(gemm.num_plans(), 2u) << "fast_accum must be part of the plan key";
}

TEST_F(GpuTest, GemmPrepareRunsHeuristicOncePerShape) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("plan_cache"));
  GemmParams p;
  p.m = 37;
  p.n = 64;
  p.k = 256;
  TP_ASSERT_OK(gemm.Prepare(p));
  TP_ASSERT_OK(gemm.Prepare(p));
  EXPECT_EQ(gemm.num_plans(), 1u);
  p.lda = 256;  // the same as packed: same plan
  TP_ASSERT_OK(gemm.Prepare(p));
  EXPECT_EQ(gemm.num_plans(), 1u);
  p.m = 38;
  TP_ASSERT_OK(gemm.Prepare(p));
  EXPECT_EQ(gemm.num_plans(), 2u);
}

// ---------------------------------------------------------------------------------------------
// FP8 output with D scale and amax.

struct Fp8OutputResult {
  std::vector<double> ref;      // before d_quant_scale
  std::vector<double> abs_ref;  // sum_k |a||b| * scales: bounds the accumulation error
  std::vector<uint8_t> out;
  float amax = 0.0f;
  float d_quant_scale = 0.0f;
};

void RunFp8OutputGemm(cudaStream_t stream, float amax_initial, Fp8OutputResult* result) {
  const int64_t m = 1002, n = 1040, k = 4096;
  const float a_scale = 0.37f, b_scale = 0.011f;
  const std::vector<uint8_t> a = RandomFp8Matrix(m, k, k, -4.0f, 4.0f, 41);
  const std::vector<uint8_t> b = RandomFp8Matrix(n, k, k, -1.0f, 1.0f, 42);
  const std::vector<float> af = DecodeFp8(a);
  const std::vector<float> bf = DecodeFp8(b);
  result->ref =
      ReferenceGemm(af.data(), k, bf.data(), k, m, n, k, static_cast<double>(a_scale) * b_scale);
  std::vector<float> abs_a(af.size()), abs_b(bf.size());
  for (size_t i = 0; i < af.size(); ++i) abs_a[i] = std::abs(af[i]);
  for (size_t i = 0; i < bf.size(); ++i) abs_b[i] = std::abs(bf[i]);
  result->abs_ref = ReferenceGemm(abs_a.data(), k, abs_b.data(), k, m, n, k,
                                  static_cast<double>(a_scale) * b_scale);
  double ref_amax = 0.0;
  for (double v : result->ref) ref_amax = std::max(ref_amax, std::abs(v));
  // Not a power of two, and maps the largest value to 300 < 448: no saturation.
  result->d_quant_scale = static_cast<float>(300.0 / ref_amax);

  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("fp8_out"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsa, DeviceScalar(a_scale, "a_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsb, DeviceScalar(b_scale, "b_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsd, DeviceScalar(result->d_quant_scale, "d_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer damax, DeviceScalar(amax_initial, "amax"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(m * n, "D"));
  TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kFloat8E4M3, m * n, stream));

  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.d_type = DataType::kFloat8E4M3;
  p.a_scale = dsa.as<float>();
  p.b_scale = dsb.as<float>();
  p.d_quant_scale = dsd.as<float>();
  p.d_amax = damax.as<float>();
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(result->out, Download<uint8_t>(dd.data(), m * n));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<float> amax, Download<float>(damax.data(), 1));
  result->amax = amax[0];
}

TEST_F(GpuTest, Fp8GemmFp8OutputAppliesDScaleAndReportsAmax) {
  Fp8OutputResult r;
  RunFp8OutputGemm(stream(), 0.0f, &r);
  if (HasFatalFailure()) return;

  // Each code must be the RNE rounding of ref * d_quant_scale, or its neighbour when the
  // GPU's sum lands on the other side of a rounding boundary: within one E4M3 ulp (at most
  // 2^-3 of the value, 2^-9 absolute for subnormals) plus the accumulation error of the
  // tensor cores' FP8 path, which keeps fewer than FP32's bits: 2^-12 of sum |a||b| (seen on
  // the H200: a plain one-ulp bound failed on 453 of 1M elements with cancellation).
  size_t nan_codes = 0, off_by_more_than_ulp = 0;
  std::vector<double> got(r.out.size());
  for (size_t i = 0; i < r.out.size(); ++i) {
    if ((r.out[i] & 0x7F) == 0x7F) {
      ++nan_codes;
      got[i] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    const double scaled_ref = r.ref[i] * r.d_quant_scale;
    const double decoded = Fp8E4M3ToFloat(r.out[i]);
    const double allowed = std::max(std::abs(scaled_ref) * 0.125, std::ldexp(1.0, -9)) +
                           std::ldexp(r.abs_ref[i] * r.d_quant_scale, -12);
    if (std::abs(decoded - scaled_ref) > allowed) ++off_by_more_than_ulp;
    got[i] = decoded / r.d_quant_scale;
  }
  EXPECT_EQ(nan_codes, 0u) << "unwritten (poisoned) or NaN output codes";
  EXPECT_EQ(off_by_more_than_ulp, 0u)
      << "codes further than one ulp from ref * d_quant_scale: is D_SCALE a multiplier?";
  EXPECT_LE(Compare(got, r.ref).rel_frobenius, kFp8OutputFrobeniusTolerance);

  double ref_amax = 0.0;
  for (double v : r.ref) ref_amax = std::max(ref_amax, std::abs(v));
  EXPECT_NEAR(r.amax, ref_amax, kAmaxRelativeTolerance * ref_amax)
      << "amax must be max|result| before d_quant_scale";
}

// Whether callers must zero d_amax before each GEMM (inside a CUDA graph too).
TEST_F(GpuTest, Fp8GemmAmaxIsOverwrittenNotAccumulated) {
  Fp8OutputResult r;
  RunFp8OutputGemm(stream(), 1e30f, &r);
  if (HasFatalFailure()) return;
  double ref_amax = 0.0;
  for (double v : r.ref) ref_amax = std::max(ref_amax, std::abs(v));
  EXPECT_NEAR(r.amax, ref_amax, kAmaxRelativeTolerance * ref_amax);
}

// ---------------------------------------------------------------------------------------------
// Accumulation: D = A·B^T + beta * C.

void CheckFp8AccumulatesC(cudaStream_t stream, int64_t k,
                          GemmAlgoSelection selection = GemmAlgoSelection::kTimed,
                          int64_t m = 1002) {
  const int64_t n = 1040;
  const int64_t ldc = n + 8;  // out of place: C's pitch differs from D's
  const float a_scale = 0.37f, b_scale = 0.011f;
  const std::vector<uint8_t> a = RandomFp8Matrix(m, k, k, -4.0f, 4.0f, 51);
  const std::vector<uint8_t> b = RandomFp8Matrix(n, k, k, -1.0f, 1.0f, 52);
  const std::vector<BFloat16> c = RandomBf16Matrix(m, n, ldc, -1.0f, 1.0f, 53);
  const std::vector<float> af = DecodeFp8(a), bf = DecodeFp8(b);
  std::vector<double> ref =
      ReferenceGemm(af.data(), k, bf.data(), k, m, n, k, static_cast<double>(a_scale) * b_scale);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) ref[i * n + j] += BFloat16ToFloat(c[i * ldc + j]);
  }

  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("fp8_beta", selection));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dc, Upload(c, "C"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsa, DeviceScalar(a_scale, "a_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsb, DeviceScalar(b_scale, "b_scale"));
  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a_scale = dsa.as<float>();
  p.b_scale = dsb.as<float>();
  p.beta = 1.0f;

  {
    SCOPED_TRACE("out of place, ldc != ldd");
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(m * n * 2, "D"));
    TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kBFloat16, m * n, stream));
    p.ldc = ldc;
    TP_ASSERT_OK(gemm.Prepare(p));  // with timed selection: times this shape
    TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), dc.data(), dd.data(), stream));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
    TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dd.data(), m * n));
    const Comparison cmp = Compare(Bf16Block(out, 0, m, n, n), ref);
    EXPECT_EQ(cmp.nan_count, 0u);
    EXPECT_LE(cmp.rel_frobenius, kBf16OutputTolerance);
  }
  {
    SCOPED_TRACE("in place, C == D");
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dcd, Upload(c, "C=D"));
    p.ldc = ldc;
    p.ldd = ldc;
    TP_ASSERT_OK(gemm.Prepare(p));  // with timed selection: times this shape
    TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), dcd.data(), dcd.data(), stream));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
    TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dcd.data(), m * ldc));
    const Comparison cmp = Compare(Bf16Block(out, 0, m, n, ldc), ref);
    EXPECT_EQ(cmp.nan_count, 0u);
    EXPECT_LE(cmp.rel_frobenius, kBf16OutputTolerance);
    EXPECT_EQ(CountTouchedPadding(out, 0, m, m, n, ldc), 0u);
  }
}

// At most 8 rows of FP8 with per-tensor scales (layers/small_m_gemm.h): tpserve's own kernel,
// no cuBLASLt plan, against the CPU reference at the shapes of a decode step (k up to 14336,
// the 224 64-column blocks of llama3-8b's down split unevenly over the warps), padded pitches,
// every row count from 1 to 8, and beta = 1 out of place and in place; 9 rows go to cuBLASLt.
// Both with B read after the launch dependency resolves and with B declared constant (read
// before it), k from one block (some warps with none, none with a first group to load early)
// to 224 blocks (14 a warp: an early group, then the loop); 33 blocks give some warps an early
// group and one block after it; k = 4096 runs the one-group kernel (4 blocks a warp).
TEST_F(GpuTest, SmallMFp8GemmMatchesCpuReferenceWithoutACublasPlan) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("small_m"));
  for (int64_t m : {1, 2, 3, 5, 8}) {
    for (const Shape& s : {Shape{m, 16, 64}, Shape{m, 1040, 4096}, Shape{m, 4096, 14336},
                           Shape{m, 96, 192}, Shape{m, 32, 2112}}) {
      for (const bool constant : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "m=" << s.m << " n=" << s.n << " k=" << s.k << " b_constant=" << constant);
        GemmParams p;
        p.m = s.m;
        p.n = s.n;
        p.k = s.k;
        p.b_constant = constant;
        TP_ASSERT_OK(gemm.Prepare(p));
        CheckFp8Bf16Gemm(gemm, p, static_cast<uint32_t>(s.m * 13 + s.n + s.k), stream());
        p.lda = s.k + 32;
        p.ldb = s.k + 16;
        p.ldd = s.n + 8;
        CheckFp8Bf16Gemm(gemm, p, static_cast<uint32_t>(s.m * 17 + s.n + s.k), stream());
      }
    }
  }
  EXPECT_EQ(gemm.num_plans(), 0u) << "a small-m GEMM built a cuBLASLt plan";
  GemmParams nine;
  nine.m = 9;
  nine.n = 16;
  nine.k = 64;
  TP_ASSERT_OK(gemm.Prepare(nine));
  EXPECT_EQ(gemm.num_plans(), 1u);
  for (int64_t m : {1, 7}) {
    SCOPED_TRACE(::testing::Message() << "beta = 1, m=" << m);
    CheckFp8AccumulatesC(stream(), 4096, GemmAlgoSelection::kTimed, m);
  }
}

TEST_F(GpuTest, Fp8GemmAccumulatesCWithBetaOutOfPlaceAndInPlace) {
  CheckFp8AccumulatesC(stream(), 256);
}

TEST(GemmAlgoSelectionTest, ParsesItsTwoNamesAndRejectsOthersNamingThem) {
  TP_ASSERT_OK_AND_ASSIGN(GemmAlgoSelection h, ParseGemmAlgoSelection("heuristic"));
  EXPECT_EQ(h, GemmAlgoSelection::kHeuristic);
  TP_ASSERT_OK_AND_ASSIGN(GemmAlgoSelection t, ParseGemmAlgoSelection("timed"));
  EXPECT_EQ(t, GemmAlgoSelection::kTimed);
  EXPECT_EQ(GemmAlgoSelectionName(t), "timed");
  const StatusOr<GemmAlgoSelection> bad = ParseGemmAlgoSelection("fastest");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'fastest'"), std::string::npos);
  EXPECT_NE(bad.status().message().find("heuristic, timed"), std::string::npos);
}

TEST_F(GpuTest, EachGemmObjectKeepsItsOwnSelection) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm by_default, CublasLtGemm::Create("default_selection"));
  EXPECT_EQ(by_default.selection(), GemmAlgoSelection::kTimed) << "the default";
  TP_ASSERT_OK_AND_ASSIGN(
      CublasLtGemm heuristic,
      CublasLtGemm::Create("heuristic_selection", GemmAlgoSelection::kHeuristic));
  EXPECT_EQ(heuristic.selection(), GemmAlgoSelection::kHeuristic);
  EXPECT_EQ(by_default.selection(), GemmAlgoSelection::kTimed) << "not changed by another object";
}

TEST_F(GpuTest, TimedAlgoSelectionTimesEachShapeOnceAndMatchesReference) {
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsa, DeviceScalar(1.0f, "a_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsb, DeviceScalar(1.0f, "b_scale"));
  GemmParams p;
  p.m = 2048 + 37;  // a shape no other test times
  p.n = 1040;
  p.k = 4096;
  p.a_scale = dsa.as<float>();  // the plan key counts the scales' presence
  p.b_scale = dsb.as<float>();
  const size_t before = CublasLtGemm::timed_shapes();
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm first, CublasLtGemm::Create("timed_first"));
  TP_ASSERT_OK(first.Prepare(p));
  EXPECT_EQ(CublasLtGemm::timed_shapes(), before + 1);
  // Another object of the process takes the remembered choice without timing again.
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm second, CublasLtGemm::Create("timed_second"));
  TP_ASSERT_OK(second.Prepare(p));
  EXPECT_EQ(CublasLtGemm::timed_shapes(), before + 1);
  // Whatever was chosen computes the same product (the check poisons D first).
  CheckFp8Bf16Gemm(first, p, 61, stream());
  CheckFp8Bf16Gemm(second, p, 62, stream());
  // beta != 0 is a shape of its own: timed separately, with C read.
  p.beta = 1.0f;
  TP_ASSERT_OK(first.Prepare(p));
  EXPECT_EQ(CublasLtGemm::timed_shapes(), before + 2);
}

TEST_F(GpuTest, TimedAndHeuristicAlgoSelectionBothAccumulateC) {
  // Out of place (ldc != ldd) and in place: each plan chosen by Prepare(), then run.
  for (GemmAlgoSelection s : {GemmAlgoSelection::kTimed, GemmAlgoSelection::kHeuristic}) {
    SCOPED_TRACE(std::string(GemmAlgoSelectionName(s)));
    CheckFp8AccumulatesC(stream(), 4096, s);
  }
}

TEST_F(GpuTest, TimedAlgoSelectionWithoutMemoryForOperandsKeepsTheHeuristic) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("timed_oom"));
  GemmParams p;
  p.m = int64_t{1} << 21;  // A alone: 2^21 x 2^17 FP8 = 256 GiB, more than any GPU here
  p.n = 1024;
  p.k = int64_t{1} << 17;
  const size_t before = CublasLtGemm::timed_shapes();
  // Timing is an optimisation: without the memory for it, it is skipped.
  TP_ASSERT_OK(gemm.Prepare(p));
  EXPECT_EQ(CublasLtGemm::timed_shapes(), before + 1) << "the heuristic's answer is remembered";
  EXPECT_EQ(gemm.num_plans(), 1u);
}

TEST_F(GpuTest, HeuristicAlgoSelectionTimesNothing) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm,
                          CublasLtGemm::Create("heuristic_only", GemmAlgoSelection::kHeuristic));
  GemmParams p;
  p.m = 4096 + 37;  // a shape no other test uses
  p.n = 1040;
  p.k = 4096;
  const size_t before = CublasLtGemm::timed_shapes();
  TP_ASSERT_OK(gemm.Prepare(p));
  EXPECT_EQ(CublasLtGemm::timed_shapes(), before);
  CheckFp8Bf16Gemm(gemm, p, 71, stream());
}

// ---------------------------------------------------------------------------------------------
// Strided batch: the AG+GEMM executor computes a chunk's tp row blocks, which sit at separate
// offsets of the gathered buffer, with one launch.

void CheckStridedBatchedFp8(cudaStream_t stream, int batch, bool shared_weight) {
  const int64_t m = 37, n = 1040, k = 512;
  // Gaps between items (NaN-poisoned in A, poison in D) catch reads and writes across items.
  const int64_t a_rows = m + 5, d_rows = m + 3;
  const int64_t stride_a = a_rows * k, stride_d = d_rows * n;
  const int64_t stride_b = shared_weight ? 0 : n * k;
  const float a_scale = 0.37f, b_scale = 0.011f;

  const std::vector<uint8_t> a = RandomFp8Matrix(batch * a_rows, k, k, -4.0f, 4.0f, 61);
  std::vector<uint8_t> a_gapped = a;
  for (int bi = 0; bi < batch; ++bi) {
    for (int64_t i = m; i < a_rows; ++i) {
      std::fill_n(a_gapped.begin() + bi * stride_a + i * k, k, kFp8E4M3PoisonBits);
    }
  }
  const int b_items = shared_weight ? 1 : batch;
  const std::vector<uint8_t> b = RandomFp8Matrix(b_items * n, k, k, -1.0f, 1.0f, 62);

  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("fp8_batched"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a_gapped, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsa, DeviceScalar(a_scale, "a_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsb, DeviceScalar(b_scale, "b_scale"));
  const size_t d_count = static_cast<size_t>(batch * stride_d);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(d_count * 2, "D"));
  TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kBFloat16, d_count, stream));

  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.batch = batch;
  p.stride_a = stride_a;
  p.stride_b = stride_b;
  p.stride_d = stride_d;
  p.a_scale = dsa.as<float>();
  p.b_scale = dsb.as<float>();
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dd.data(), d_count));

  const std::vector<float> af = DecodeFp8(a_gapped), bf = DecodeFp8(b);
  for (int bi = 0; bi < batch; ++bi) {
    SCOPED_TRACE("batch item " + std::to_string(bi));
    const std::vector<double> ref =
        ReferenceGemm(af.data() + bi * stride_a, k, bf.data() + bi * stride_b, k, m, n, k,
                      static_cast<double>(a_scale) * b_scale);
    const size_t offset = static_cast<size_t>(bi * stride_d);
    const Comparison cmp = Compare(Bf16Block(out, offset, m, n, n), ref);
    EXPECT_EQ(cmp.nan_count, 0u);
    EXPECT_LE(cmp.rel_frobenius, kBf16OutputTolerance);
    EXPECT_EQ(CountTouchedPadding(out, offset, d_rows, m, n, n), 0u) << "wrote into a gap";
  }
}

TEST_F(GpuTest, Fp8GemmStridedBatchedRowBlocksWithSharedWeight) {
  for (int batch : {2, 3}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    CheckStridedBatchedFp8(stream(), batch, /*shared_weight=*/true);
  }
}

TEST_F(GpuTest, Fp8GemmStridedBatchedWithSeparateWeights) {
  CheckStridedBatchedFp8(stream(), 3, /*shared_weight=*/false);
}

// ---------------------------------------------------------------------------------------------
// BF16 GEMM.

TEST_F(GpuTest, Bf16GemmMatchesCpuReferenceAtAwkwardShapes) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("bf16"));
  // BF16 needs only 16-byte rows: k and n multiples of 8.
  const Shape shapes[] = {{37, 1000, 264}, {1002, 64, 4096}, {4099, 1040, 264}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE("m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) +
                 " k=" + std::to_string(s.k));
    const std::vector<BFloat16> a = RandomBf16Matrix(s.m, s.k, s.k, -2.0f, 2.0f, 71);
    const std::vector<BFloat16> b = RandomBf16Matrix(s.n, s.k, s.k, -0.1f, 0.1f, 72);
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "A"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(s.m * s.n * 2, "D"));
    TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kBFloat16, s.m * s.n, stream()));
    GemmParams p;
    p.m = s.m;
    p.n = s.n;
    p.k = s.k;
    p.a_type = p.b_type = p.d_type = DataType::kBFloat16;
    TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dd.data(), s.m * s.n));
    const std::vector<float> af = DecodeBf16(a), bf = DecodeBf16(b);
    const std::vector<double> ref =
        ReferenceGemm(af.data(), s.k, bf.data(), s.k, s.m, s.n, s.k, 1.0);
    const Comparison cmp = Compare(Bf16Block(out, 0, s.m, s.n, s.n), ref);
    EXPECT_EQ(cmp.nan_count, 0u);
    EXPECT_LE(cmp.rel_frobenius, kBf16OutputTolerance);
  }
}

TEST_F(GpuTest, Bf16GemmAccumulatesInPlaceWithBeta) {
  const int64_t m = 1002, n = 1040, k = 264;
  const float alpha = 0.5f, beta = 1.0f;
  const std::vector<BFloat16> a = RandomBf16Matrix(m, k, k, -2.0f, 2.0f, 81);
  const std::vector<BFloat16> b = RandomBf16Matrix(n, k, k, -0.1f, 0.1f, 82);
  const std::vector<BFloat16> c = RandomBf16Matrix(m, n, n, -1.0f, 1.0f, 83);
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("bf16_beta"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dcd, Upload(c, "C=D"));
  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a_type = p.b_type = p.d_type = DataType::kBFloat16;
  p.alpha = alpha;
  p.beta = beta;
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), dcd.data(), dcd.data(), stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dcd.data(), m * n));
  const std::vector<float> af = DecodeBf16(a), bf = DecodeBf16(b);
  std::vector<double> ref = ReferenceGemm(af.data(), k, bf.data(), k, m, n, k, alpha);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] += beta * BFloat16ToFloat(c[i]);
  const Comparison cmp = Compare(Bf16Block(out, 0, m, n, n), ref);
  EXPECT_EQ(cmp.nan_count, 0u);
  EXPECT_LE(cmp.rel_frobenius, kBf16OutputTolerance);
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs.

TEST_F(GpuTest, GemmRunIsCapturableInCudaGraphAfterPrepare) {
  const int64_t m = 1002, n = 1040, k = 512;
  const std::vector<uint8_t> a = RandomFp8Matrix(m, k, k, -4.0f, 4.0f, 91);
  const std::vector<uint8_t> b = RandomFp8Matrix(n, k, k, -1.0f, 1.0f, 92);
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("graph"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsa, DeviceScalar(0.37f, "a_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsb, DeviceScalar(0.011f, "b_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer eager, DeviceBuffer::Allocate(m * n * 2, "D_eager"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer graphed, DeviceBuffer::Allocate(m * n * 2, "D_graph"));
  TP_ASSERT_OK(LaunchPoisonFill(eager.data(), DataType::kBFloat16, m * n, stream()));
  TP_ASSERT_OK(LaunchPoisonFill(graphed.data(), DataType::kBFloat16, m * n, stream()));
  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a_scale = dsa.as<float>();
  p.b_scale = dsb.as<float>();

  TP_ASSERT_OK(gemm.Prepare(p));
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, eager.data(), stream()));
  TP_ASSERT_OK_AND_ASSIGN(CudaGraphExec graph,
                          CudaGraphExec::Capture(stream(), cudaStreamCaptureModeThreadLocal, [&]() {
                            return gemm.Run(p, da.data(), db.data(), nullptr, graphed.data(),
                                            stream());
                          }));
  EXPECT_EQ(gemm.num_plans(), 1u);
  TP_ASSERT_OK(graph.Launch(stream()));
  TP_ASSERT_OK(graph.Launch(stream()));  // replays are idempotent
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));

  TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> e, Download<BFloat16>(eager.data(), m * n));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> g, Download<BFloat16>(graphed.data(), m * n));
  size_t differ = 0;
  for (size_t i = 0; i < e.size(); ++i) differ += e[i].bits != g[i].bits;
  EXPECT_EQ(differ, 0u) << "graph replay differs from the eager run with the same plan";
  const std::vector<float> af = DecodeFp8(a), bf = DecodeFp8(b);
  const std::vector<double> ref =
      ReferenceGemm(af.data(), k, bf.data(), k, m, n, k, static_cast<double>(0.37f) * 0.011f);
  const Comparison cmp = Compare(Bf16Block(g, 0, m, n, n), ref);
  EXPECT_EQ(cmp.nan_count, 0u);
  EXPECT_LE(cmp.rel_frobenius, kBf16OutputTolerance);
}

TEST_F(GpuTest, GemmRunWithoutPrepareWhileCapturingFailsCleanly) {
  const int64_t m = 64, n = 64, k = 64;
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("graph_unprepared"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, DeviceBuffer::Allocate(m * k, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, DeviceBuffer::Allocate(n * k, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(m * n * 2, "D"));
  TP_CUDA_CHECK_FOR_TEST(cudaMemsetAsync(da.data(), 0, m * k, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaMemsetAsync(db.data(), 0, n * k, stream()));
  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  const StatusOr<CudaGraphExec> graph = CudaGraphExec::Capture(
      stream(), cudaStreamCaptureModeThreadLocal,
      [&]() { return gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream()); });
  ASSERT_FALSE(graph.ok());
  EXPECT_EQ(graph.status().code(), StatusCode::kFailedPrecondition) << graph.status().ToString();
  EXPECT_NE(graph.status().message().find("Prepare"), std::string::npos);
  EXPECT_EQ(gemm.num_plans(), 0u);
  // The stream left capture and still works (D poisoned: the zeros must be written).
  TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kBFloat16, m * n, stream()));
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dd.data(), m * n));
  for (const BFloat16& v : out) ASSERT_EQ(v.bits, 0u);
}

// Both graph priorities instantiate and replay a two-stream graph (a high-priority side stream
// forked from the captured one, as a layer's comm stream is) that computes the same bytes; the
// names parse back and anything else is refused naming the allowed values.
TEST_F(GpuTest, GraphsRunUnderEitherPriority) {
  for (const char* name : {"node", "stream"}) {
    TP_ASSERT_OK_AND_ASSIGN(CudaGraphExec::Priority p, CudaGraphExec::ParsePriority(name));
    EXPECT_EQ(CudaGraphExec::PriorityName(p), name);
  }
  const auto bad = CudaGraphExec::ParsePriority("high");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("(allowed: node, stream)"), std::string::npos);

  int least = 0, greatest = 0;
  TP_CUDA_CHECK_FOR_TEST(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  TP_ASSERT_OK_AND_ASSIGN(CudaStream side, CudaStream::Create(true, greatest));
  TP_ASSERT_OK_AND_ASSIGN(CudaEvent fork, CudaEvent::Create(false));
  TP_ASSERT_OK_AND_ASSIGN(CudaEvent join, CudaEvent::Create(false));
  const int64_t count = 1 << 16;
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer a, DeviceBuffer::Allocate(count * 2, "a"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer b, DeviceBuffer::Allocate(count * 2, "b"));
  for (const auto priority :
       {CudaGraphExec::Priority::kLaunchStream, CudaGraphExec::Priority::kPerNode}) {
    TP_ASSERT_OK(LaunchPoisonFill(a.data(), DataType::kBFloat16, count, stream()));
    TP_ASSERT_OK(LaunchPoisonFill(b.data(), DataType::kBFloat16, count, stream()));
    auto body = [&]() -> Status {
      TP_RETURN_IF_ERROR(fork.Record(stream()));
      TP_RETURN_IF_ERROR(fork.WaitOn(side.get()));
      TP_RETURN_IF_ERROR(LaunchFillPattern(a.data(), count, 2, 0x3F80u, stream()));
      TP_RETURN_IF_ERROR(LaunchFillPattern(b.data(), count, 2, 0x4000u, side.get()));
      TP_RETURN_IF_ERROR(join.Record(side.get()));
      return join.WaitOn(stream());
    };
    auto graph = CudaGraphExec::Capture(stream(), cudaStreamCaptureModeThreadLocal, body, priority);
    ASSERT_TRUE(graph.ok()) << CudaGraphExec::PriorityName(priority) << ": "
                            << graph.status().ToString();
    TP_ASSERT_OK(graph->Launch(stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK_AND_ASSIGN(auto ha, Download<uint16_t>(a.data(), count));
    TP_ASSERT_OK_AND_ASSIGN(auto hb, Download<uint16_t>(b.data(), count));
    size_t wrong = 0;
    for (int64_t i = 0; i < count; ++i) wrong += ha[i] != 0x3F80u || hb[i] != 0x4000u;
    EXPECT_EQ(wrong, 0u) << CudaGraphExec::PriorityName(priority);
  }
}

// ---------------------------------------------------------------------------------------------
// Parameter validation: INVALID_ARGUMENT / UNIMPLEMENTED naming the field.

void ExpectRejected(const Status& s, StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  EXPECT_NE(s.message().find(needle), std::string::npos)
      << "message should mention '" << needle << "': " << s.ToString();
}

TEST_F(GpuTest, GemmRejectsParamsCublasLtFp8CannotRun) {
  GemmParams good;
  good.m = 37;
  good.n = 1040;
  good.k = 256;
  EXPECT_TRUE(ValidateGemmParams(good).ok()) << ValidateGemmParams(good).ToString();

  GemmParams p = good;
  p.k = 200;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.k");
  p = good;
  p.n = 1000;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.n");
  p = good;
  p.m = 0;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.m");
  p = good;
  p.lda = 128;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.lda");
  p = good;
  p.ldb = 264;  // 264 bytes of FP8: not a multiple of 16
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.ldb");
  p = good;
  p.ldd = 1044;  // 2088 bytes of BF16
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.ldd");
  p = good;
  p.batch = 2;
  p.stride_d = 10 * 1040;  // < m * ldd
  p.stride_a = 37 * 256;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.stride_d");
  p = good;
  p.d_amax = reinterpret_cast<float*>(uintptr_t{256});
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "d_amax");
  p = good;
  p.d_type = DataType::kFloat8E4M3;
  p.beta = 1.0f;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kUnimplemented, "beta");
  p = good;
  p.b_type = DataType::kBFloat16;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kUnimplemented, "a_type");
  p = good;
  p.a_type = p.b_type = DataType::kBFloat16;
  p.a_scale = reinterpret_cast<const float*>(uintptr_t{256});
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "a_scale");
}

TEST_F(GpuTest, Bf16GemmWritesFp32OutputUnroundedAndAccumulatesFp32C) {
  // BF16 x BF16 -> FP32 D (an LM head's logits), planned by Prepare (timed: its operands
  // include an FP32 C), then in place with beta (C FP32 as D). Tolerance 1e-5 relative: FP32
  // accumulation over k = 264 errs by ~1e-7, while D rounded to BF16 would err by ~1e-3
  // (half a step of 2^-8, uniformly), a hundred times the bound.
  const int64_t m = 37, n = 1000, k = 264;
  const float alpha = 0.5f, beta = 1.0f;
  const std::vector<BFloat16> a = RandomBf16Matrix(m, k, k, -2.0f, 2.0f, 91);
  const std::vector<BFloat16> b = RandomBf16Matrix(n, k, k, -0.1f, 0.1f, 92);
  std::vector<float> c(static_cast<size_t>(m * n));
  std::mt19937 rng(93);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& v : c) v = dist(rng);
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("bf16_fp32"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(m * n * 4, "D"));
  TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kFloat32, m * n, stream()));
  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a_type = p.b_type = DataType::kBFloat16;
  p.d_type = DataType::kFloat32;
  TP_ASSERT_OK(gemm.Prepare(p));
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<float> out, Download<float>(dd.data(), m * n));
  const std::vector<float> af = DecodeBf16(a), bf = DecodeBf16(b);
  std::vector<double> ref = ReferenceGemm(af.data(), k, bf.data(), k, m, n, k, 1.0);
  Comparison cmp = Compare(std::vector<double>(out.begin(), out.end()), ref);
  EXPECT_EQ(cmp.nan_count, 0u);
  EXPECT_LE(cmp.rel_frobenius, 1e-5);
  std::vector<double> rounded(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    rounded[i] = BFloat16ToFloat(FloatToBFloat16(static_cast<float>(ref[i])));
  }
  EXPECT_GT(Compare(rounded, ref).rel_frobenius, 1e-4) << "test construction: BF16 would pass";

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dcd, Upload(c, "C=D"));
  p.alpha = alpha;
  p.beta = beta;
  TP_ASSERT_OK(gemm.Prepare(p));
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), dcd.data(), dcd.data(), stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(out, Download<float>(dcd.data(), m * n));
  ref = ReferenceGemm(af.data(), k, bf.data(), k, m, n, k, alpha);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] += beta * static_cast<double>(c[i]);
  cmp = Compare(std::vector<double>(out.begin(), out.end()), ref);
  EXPECT_EQ(cmp.nan_count, 0u);
  EXPECT_LE(cmp.rel_frobenius, 1e-5);

  // FP32 rows must be 16-byte multiples; FP8 inputs keep their output types.
  GemmParams bad = p;
  bad.ldd = bad.ldc = 1002;  // 4008 bytes
  ExpectRejected(ValidateGemmParams(bad), StatusCode::kInvalidArgument, "GemmParams.ldd");
  bad = p;
  bad.a_type = bad.b_type = DataType::kFloat8E4M3;
  bad.beta = 0.0f;
  ExpectRejected(ValidateGemmParams(bad), StatusCode::kUnimplemented, "d_type");
}

TEST_F(GpuTest, GemmRunRejectsMisalignedPointersAndMissingC) {
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("validation"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, DeviceBuffer::Allocate(1 << 20, "scratch"));
  char* base = buf.as<char>();
  GemmParams p;
  p.m = 37;
  p.n = 64;
  p.k = 256;
  ExpectRejected(gemm.Run(p, base + 8, base, nullptr, base + 65536, stream()),
                 StatusCode::kInvalidArgument, "A pointer");
  ExpectRejected(gemm.Run(p, base, base + 4096, nullptr, base + 65536 + 2, stream()),
                 StatusCode::kInvalidArgument, "D pointer");
  p.beta = 1.0f;
  ExpectRejected(gemm.Run(p, base, base + 4096, nullptr, base + 65536, stream()),
                 StatusCode::kInvalidArgument, "C pointer");
  EXPECT_EQ(gemm.num_plans(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Quantize / amax / dequantize kernels: bit-exact with layers/fp8.h.

// Log-uniform magnitudes from 2^-14 to 2^10 times `scale`, so that x / scale covers E4M3
// subnormals, normals and saturation; both signs.
std::vector<float> LogUniformFloats(size_t count, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(count);
  for (float& x : v) x = (negative(rng) ? -1.0f : 1.0f) * std::exp2(exponent(rng)) * scale;
  return v;
}

// Values whose rounding is easy to get wrong, for scale 1: ties, the saturation boundary,
// subnormal ties, signed zero, infinities, NaN.
std::vector<float> TrickyFloats() {
  const float inf = std::numeric_limits<float>::infinity();
  return {1.0625f,
          1.1875f,
          -1.0625f,
          464.0f,
          -464.0f,
          448.0f,
          449.0f,
          480.0f,
          1e30f,
          -1e30f,
          std::ldexp(1.0f, -10),
          std::ldexp(3.0f, -10),
          std::ldexp(1.0f, -9),
          std::ldexp(5.0f, -11),
          0.0f,
          -0.0f,
          inf,
          -inf,
          std::nanf(""),
          -std::nanf(""),
          0.015625f,
          0.0146484375f,
          240.0f,
          248.0f};
}

void CheckQuantize(cudaStream_t stream, DataType type, const std::vector<float>& values,
                   float scale) {
  // Offsets 0 (16-byte aligned: vector path) and 1 element (scalar path).
  for (size_t offset : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    const size_t count = values.size() - offset;
    std::vector<float> input_f;  // what the GPU sees, as float
    DeviceBuffer din;
    if (type == DataType::kBFloat16) {
      std::vector<BFloat16> in(values.size());
      for (size_t i = 0; i < values.size(); ++i) in[i] = FloatToBFloat16(values[i]);
      input_f = DecodeBf16(in);
      TP_ASSERT_OK_AND_ASSIGN(din, Upload(in, "in"));
    } else {
      input_f = values;
      TP_ASSERT_OK_AND_ASSIGN(din, Upload(values, "in"));
    }
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dscale, DeviceScalar(scale, "scale"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dout, DeviceBuffer::Allocate(values.size(), "out"));
    TP_ASSERT_OK(LaunchPoisonFill(dout.data(), DataType::kFloat8E4M3, values.size(), stream));
    QuantizeFp8Params q;
    q.input = din.as<char>() + offset * DataTypeSize(type);
    q.input_type = type;
    q.output = dout.as<uint8_t>() + offset;
    q.count = count;
    q.scale = dscale.as<float>();
    TP_ASSERT_OK(LaunchQuantizeToFp8E4M3(q, stream));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
    TP_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> out,
                            Download<uint8_t>(dout.data(), values.size()));

    std::vector<uint8_t> expected(count);
    QuantizeFp8(std::span<const float>(input_f).subspan(offset), scale, Fp8Format::kE4M3, expected);
    size_t mismatches = 0;
    for (size_t i = 0; i < count; ++i) {
      if (out[offset + i] != expected[i]) {
        if (mismatches < 5) {
          ADD_FAILURE() << "element " << i << ": x = " << input_f[offset + i] << ", scale " << scale
                        << ": GPU code 0x" << std::hex << int{out[offset + i]} << ", CPU code 0x"
                        << int{expected[i]};
        }
        ++mismatches;
      }
    }
    EXPECT_EQ(mismatches, 0u);
    if (offset == 1) {
      EXPECT_EQ(out[0], kFp8E4M3PoisonBits) << "wrote before the output";
    }
  }
}

TEST_F(GpuTest, QuantizeBf16ToFp8IsBitExactWithCpuReference) {
  const float scale = 0.0375f;
  std::vector<float> values = LogUniformFloats(1002 * 37 + 5, scale, 101);
  for (float t : TrickyFloats()) values.push_back(t * scale);
  CheckQuantize(stream(), DataType::kBFloat16, values, scale);
}

TEST_F(GpuTest, QuantizeFp32ToFp8IsBitExactWithCpuReference) {
  for (float scale : {1.0f, 0.0375f, 3.7f}) {
    SCOPED_TRACE("scale " + std::to_string(scale));
    std::vector<float> values = TrickyFloats();
    for (float t : TrickyFloats()) values.push_back(t * scale);
    const std::vector<float> random = LogUniformFloats(4099 * 3 + 7, scale, 102);
    values.insert(values.end(), random.begin(), random.end());
    CheckQuantize(stream(), DataType::kFloat32, values, scale);
  }
}

// The quantize kernels divide by the scale with a reciprocal and one FMA correction
// (layers/fp8_divide.cuh) instead of the IEEE division routine. The claim is that the codes
// equal the CPU's RN(x / scale) for every input: checked for all 65,536 BF16 values and 2^21
// random FP32 bit patterns (every exponent, subnormals, infinities, NaNs), at scales with
// and without a normal reciprocal (the latter take the IEEE division).
TEST_F(GpuTest, QuantizeMatchesCpuDivisionForEveryBf16AndRandomFp32Patterns) {
  std::vector<float> every_bf16(65536);
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint32_t f = bits << 16;
    std::memcpy(&every_bf16[bits], &f, sizeof f);
  }
  std::mt19937 rng(131);
  std::vector<float> random_fp32(size_t{1} << 21);
  for (float& x : random_fp32) {
    const uint32_t f = static_cast<uint32_t>(rng());
    std::memcpy(&x, &f, sizeof f);
  }
  const float scales[] = {1.0f,        0.0375f,          3.7f,     1.0f / 448.0f,
                          0.33333334f, 7.1e-3f,          1e-30f,   0x1p-126f,
                          0x1.8p-126f, 0x1.fffffep-127f, 1.4e-45f, 1e-40f,
                          0x1p126f,    0x1.000002p126f,  1e37f,    3.0e38f};
  for (float scale : scales) {
    std::ostringstream name;
    name << std::hexfloat << scale;
    SCOPED_TRACE("scale " + name.str());
    CheckQuantize(stream(), DataType::kBFloat16, every_bf16, scale);
    CheckQuantize(stream(), DataType::kFloat32, random_fp32, scale);
  }
}

// Where the division could go wrong it shows as a code one step off at an E4M3 rounding
// midpoint: FP32 inputs x = RN(midpoint * scale) and their 4 neighbours on each side, for
// every midpoint of the positive and negative codes. The scales include the tiny ones near
// 2^-126 (where a review found the reciprocal-and-FMA step one ulp off, and which must take
// the IEEE division) and both sides of the fast path's lower bound, 2^-64.
TEST_F(GpuTest, QuantizeIsExactNextToEveryE4M3MidpointAcrossScales) {
  const float scales[] = {
      0x1.954acap-126f, 0x1.aaaaaap-126f, 0x1.3p-100f, 1e-30f, 0x1p-90f, 0x1.fffffep-65f, 0x1p-64f,
      0x1.000002p-64f,  1.0f / 448.0f,    0.0375f,     3.7f,   1e20f,    0x1p126f};
  for (float scale : scales) {
    std::ostringstream name;
    name << std::hexfloat << scale;
    SCOPED_TRACE("scale " + name.str());
    std::vector<float> values;
    for (int code = 0; code < 0x7E; ++code) {
      const double mid = (double{Fp8E4M3ToFloat(static_cast<uint8_t>(code))} +
                          Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1))) /
                         2;
      for (float sign : {1.0f, -1.0f}) {
        float x = static_cast<float>(sign * mid * scale);
        for (int i = 0; i < 4; ++i) x = std::nextafter(x, 0.0f);
        for (int i = 0; i < 9; ++i) {
          values.push_back(x);
          x = std::nextafter(x, sign * std::numeric_limits<float>::infinity());
        }
      }
    }
    CheckQuantize(stream(), DataType::kFloat32, values, scale);
  }
}

void CheckAbsMax(cudaStream_t stream, DataType type) {
  std::vector<float> values = LogUniformFloats(4099 * 37 + 3, 1.0f, 111);
  values[12345] = -2000.5f;     // the largest magnitude is negative
  values[777] = std::nanf("");  // skipped, as in the CPU Amax
  for (size_t offset : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    std::vector<float> input_f;
    DeviceBuffer din;
    if (type == DataType::kBFloat16) {
      std::vector<BFloat16> in(values.size());
      for (size_t i = 0; i < values.size(); ++i) in[i] = FloatToBFloat16(values[i]);
      input_f = DecodeBf16(in);
      TP_ASSERT_OK_AND_ASSIGN(din, Upload(in, "in"));
    } else {
      input_f = values;
      TP_ASSERT_OK_AND_ASSIGN(din, Upload(values, "in"));
    }
    // Garbage in *amax: the launcher must zero it first.
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer damax, DeviceScalar(1e30f, "amax"));
    AbsMaxParams p;
    p.input = din.as<char>() + offset * DataTypeSize(type);
    p.input_type = type;
    p.count = values.size() - offset;
    p.amax = damax.as<float>();
    TP_ASSERT_OK(LaunchAbsMax(p, stream));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
    TP_ASSERT_OK_AND_ASSIGN(std::vector<float> amax, Download<float>(damax.data(), 1));
    const float expected = Amax(std::span<const float>(input_f).subspan(offset));
    EXPECT_EQ(amax[0], expected);
  }
  // Empty input: 0.
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer damax, DeviceScalar(1e30f, "amax"));
  AbsMaxParams empty;
  empty.input_type = type;
  empty.amax = damax.as<float>();
  TP_ASSERT_OK(LaunchAbsMax(empty, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<float> amax, Download<float>(damax.data(), 1));
  EXPECT_EQ(amax[0], 0.0f);
}

TEST_F(GpuTest, AbsMaxBf16IsExact) { CheckAbsMax(stream(), DataType::kBFloat16); }
TEST_F(GpuTest, AbsMaxFp32IsExact) { CheckAbsMax(stream(), DataType::kFloat32); }

// The device's scale from partial amaxes equals the CPU's ScaleFromAmax of
// their maximum, bit for bit: the largest of several, all zero (1), one
// below 448 times the smallest subnormal (clamped), and inf.
TEST_F(GpuTest, ScaleFromAmaxMatchesTheCpuReference) {
  const std::vector<std::vector<float>> cases = {
      {0.5f, 3.25f, 1e-3f}, {0.0f, 0.0f}, {1e-44f}, {7.0f, INFINITY}, {123.456f}};
  for (const std::vector<float>& amax : cases) {
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer damax, Upload(amax, "amax"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dscale, DeviceScalar(-1.0f, "scale"));
    TP_ASSERT_OK(LaunchScaleFromAmax(damax.as<float>(), static_cast<int>(amax.size()),
                                     dscale.as<float>(), stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK_AND_ASSIGN(std::vector<float> got, Download<float>(dscale.data(), 1));
    const float want = ScaleFromAmax(*std::max_element(amax.begin(), amax.end()), Fp8Format::kE4M3);
    EXPECT_EQ(got[0], want) << "max amax " << *std::max_element(amax.begin(), amax.end());
  }
  EXPECT_EQ(LaunchScaleFromAmax(nullptr, 1, nullptr, stream()).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(GpuTest, DequantizeFp8IsBitExactWithCpuReference) {
  const float scale = 0.37f;
  std::vector<uint8_t> codes(1003 * 4 + 9);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 7 + (i >> 8));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer din, Upload(codes, "codes"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dscale, DeviceScalar(scale, "scale"));
  for (DataType out_type : {DataType::kBFloat16, DataType::kFloat32}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE(std::string(DataTypeName(out_type)) + " offset " + std::to_string(offset));
      const size_t count = codes.size() - offset;
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dout, DeviceBuffer::Allocate(codes.size() * 4, "out"));
      // Poisoned: a fresh allocation may hold the previous iteration's (correct) results.
      TP_ASSERT_OK(LaunchPoisonFill(dout.data(), out_type, codes.size(), stream()));
      DequantizeFp8Params p;
      p.input = din.as<uint8_t>() + offset;
      p.output = dout.as<char>() + offset * DataTypeSize(out_type);
      p.output_type = out_type;
      p.count = count;
      p.scale = dscale.as<float>();
      TP_ASSERT_OK(LaunchDequantizeFp8E4M3(p, stream()));
      TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
      size_t mismatches = 0;
      if (out_type == DataType::kBFloat16) {
        TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out,
                                Download<BFloat16>(dout.data(), codes.size()));
        for (size_t i = 0; i < count; ++i) {
          const float want = Fp8E4M3ToFloat(codes[offset + i]) * scale;
          const BFloat16 got = out[offset + i];
          if (std::isnan(want)) {
            mismatches += !std::isnan(BFloat16ToFloat(got));
          } else {
            mismatches += got.bits != FloatToBFloat16(want).bits;
          }
        }
        if (offset == 1) {
          EXPECT_EQ(out[0].bits, kBf16PoisonBits) << "wrote before the output";
        }
      } else {
        TP_ASSERT_OK_AND_ASSIGN(std::vector<float> out, Download<float>(dout.data(), codes.size()));
        for (size_t i = 0; i < count; ++i) {
          const float want = Fp8E4M3ToFloat(codes[offset + i]) * scale;
          const float got = out[offset + i];
          if (std::isnan(want)) {
            mismatches += !std::isnan(got);
          } else {
            mismatches += std::memcmp(&want, &got, sizeof want) != 0;
          }
        }
        if (offset == 1) {
          uint32_t first;
          std::memcpy(&first, out.data(), sizeof first);
          EXPECT_EQ(first, kFp32PoisonBits) << "wrote before the output";
        }
      }
      EXPECT_EQ(mismatches, 0u);
    }
  }
}

TEST_F(GpuTest, PoisonFillWritesTheNanPatternOfEachType) {
  const size_t count = 1001;
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, DeviceBuffer::Allocate(count * 4, "poison"));
  TP_ASSERT_OK(LaunchPoisonFill(buf.data(), DataType::kBFloat16, count, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<uint16_t> u16, Download<uint16_t>(buf.data(), count));
  for (uint16_t v : u16) ASSERT_EQ(v, kBf16PoisonBits);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(BFloat16{kBf16PoisonBits})));

  TP_ASSERT_OK(LaunchPoisonFill(buf.data(), DataType::kFloat8E4M3, count, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> u8, Download<uint8_t>(buf.data(), count));
  for (uint8_t v : u8) ASSERT_EQ(v, kFp8E4M3PoisonBits);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(kFp8E4M3PoisonBits)));

  TP_ASSERT_OK(LaunchPoisonFill(buf.data(), DataType::kFloat32, count, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<uint32_t> u32, Download<uint32_t>(buf.data(), count));
  for (uint32_t v : u32) ASSERT_EQ(v, kFp32PoisonBits);

  EXPECT_EQ(LaunchPoisonFill(buf.data(), DataType::kInt32, count, stream()).code(),
            StatusCode::kUnimplemented);
}

// ---------------------------------------------------------------------------------------------
// RAII owners.

TEST_F(GpuTest, DeviceBufferOutOfMemoryErrorNamesBufferAndSize) {
  const size_t huge = size_t{1} << 50;  // 1 PiB
  const StatusOr<DeviceBuffer> buf = DeviceBuffer::Allocate(huge, "test.huge_activations");
  ASSERT_FALSE(buf.ok());
  EXPECT_EQ(buf.status().code(), StatusCode::kResourceExhausted) << buf.status().ToString();
  EXPECT_NE(buf.status().message().find("test.huge_activations"), std::string::npos);
  EXPECT_NE(buf.status().message().find(std::to_string(huge)), std::string::npos);
  // The failure does not linger as the thread's last CUDA error.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer small, DeviceBuffer::Allocate(256, "after_oom"));
  EXPECT_EQ(small.size(), 256u);
}

TEST_F(GpuTest, DeviceBufferMoveTransfersOwnership) {
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer a, DeviceBuffer::Allocate(1024, "a"));
  void* p = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), 1024u);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): checking moved-from state
  EXPECT_EQ(a.size(), 0u);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer c, DeviceBuffer::Allocate(0, "empty"));
  EXPECT_TRUE(c.empty());
  EXPECT_EQ(c.data(), nullptr);
}

TEST_F(GpuTest, CudaEventsJoinStreamsAndTime) {
  TP_ASSERT_OK_AND_ASSIGN(CudaStream side, CudaStream::Create(/*non_blocking=*/true, 0));
  TP_ASSERT_OK_AND_ASSIGN(CudaEvent start, CudaEvent::Create(/*enable_timing=*/true));
  TP_ASSERT_OK_AND_ASSIGN(CudaEvent stop, CudaEvent::Create(/*enable_timing=*/true));
  TP_ASSERT_OK_AND_ASSIGN(CudaEvent fork, CudaEvent::Create());
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, DeviceBuffer::Allocate(1 << 20, "buf"));
  TP_ASSERT_OK(start.Record(stream()));
  TP_ASSERT_OK(LaunchPoisonFill(buf.data(), DataType::kFloat32, (1 << 20) / 4, stream()));
  TP_ASSERT_OK(fork.Record(stream()));
  TP_ASSERT_OK(fork.WaitOn(side.get()));
  TP_ASSERT_OK(LaunchFillPattern(buf.data(), 1 << 20, 1, 0, side.get()));
  TP_ASSERT_OK(stop.Record(side.get()));
  TP_ASSERT_OK(side.Synchronize());
  TP_ASSERT_OK_AND_ASSIGN(bool done, stop.Query());
  EXPECT_TRUE(done);
  TP_ASSERT_OK_AND_ASSIGN(float ms, CudaEvent::ElapsedMs(start, stop));
  EXPECT_GE(ms, 0.0f);
  TP_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> out, Download<uint8_t>(buf.data(), 1 << 20));
  for (uint8_t v : out) ASSERT_EQ(v, 0u) << "side stream ran before the fork event";
  EXPECT_EQ(CudaEvent::ElapsedMs(fork, stop).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaStream::Create(true, 1000).status().code(), StatusCode::kInvalidArgument);
}

// The peer-memory ReduceScatter's add: every slot summed in slot order in
// FP32 and rounded once, as the CPU computes it here (exact: same operations,
// same order). Both the vectorised path (aligned, count % 8 == 0) and the
// scalar one (an odd count, a misaligned slot), for every slot count (each is
// its own kernel instance); the output is poisoned first, and elements past
// `count` must stay poisoned.
TEST_F(GpuTest, SumSlotsMatchesSlotOrderFp32SumExactly) {
  for (const auto& [count, misalign] :
       std::vector<std::pair<int64_t, int64_t>>{{4096, 0}, {1001, 0}, {4096, 1}}) {
    for (int slots = 1; slots <= kMaxSumSlots; ++slots) {
      std::vector<std::vector<BFloat16>> in(slots);
      std::vector<DeviceBuffer> dev(slots);
      SumSlotsParams p;
      for (int s = 0; s < slots; ++s) {
        in[s] = RandomBf16Matrix(1, count + misalign, count + misalign, -4.0f, 4.0f, 100 + s);
        TP_ASSERT_OK_AND_ASSIGN(dev[s], Upload(in[s], "slot"));
        p.slots[s] = dev[s].as<BFloat16>() + (s == 1 ? misalign : 0);
      }
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer out, DeviceBuffer::Allocate((count + 8) * 2, "out"));
      TP_ASSERT_OK(LaunchPoisonFill(out.data(), DataType::kBFloat16, count + 8, stream()));
      p.dst = out.data();
      p.num_slots = slots;
      p.count = count;
      TP_ASSERT_OK(LaunchSumSlotsBf16(p, stream()));
      TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
      TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> got, Download<BFloat16>(out.data(), count + 8));
      int64_t wrong = 0;
      for (int64_t i = 0; i < count; ++i) {
        float acc = 0.0f;
        for (int s = 0; s < slots; ++s) {
          acc += BFloat16ToFloat(in[s][i + (s == 1 ? misalign : 0)]);
        }
        wrong += got[i].bits != FloatToBFloat16(acc).bits;
      }
      EXPECT_EQ(wrong, 0) << "count " << count << " slots " << slots << " misalign " << misalign;
      for (int64_t i = count; i < count + 8; ++i) {
        EXPECT_EQ(got[i].bits, kBf16PoisonBits) << "wrote past count at " << i;
      }
    }
  }
  // dst may alias a slot (the deferred sum of a ring writes over its input):
  // every element is read before it is written.
  {
    const int64_t count = 40000;
    std::vector<BFloat16> a = RandomBf16Matrix(1, count, count, -4.0f, 4.0f, 7);
    std::vector<BFloat16> b = RandomBf16Matrix(1, count, count, -4.0f, 4.0f, 8);
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, Upload(a, "a"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(b, "b"));
    SumSlotsParams p;
    p.slots[0] = da.data();
    p.slots[1] = db.data();
    p.dst = da.data();
    p.num_slots = 2;
    p.count = count;
    TP_ASSERT_OK(LaunchSumSlotsBf16(p, stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> got, Download<BFloat16>(da.data(), count));
    int64_t wrong = 0;
    for (int64_t i = 0; i < count; ++i) {
      const float want = BFloat16ToFloat(a[i]) + BFloat16ToFloat(b[i]);
      wrong += got[i].bits != FloatToBFloat16(0.0f + want).bits;
    }
    EXPECT_EQ(wrong, 0) << "dst aliasing slot 0";
  }
  SumSlotsParams bad;
  bad.num_slots = kMaxSumSlots + 1;
  bad.count = 8;
  EXPECT_EQ(LaunchSumSlotsBf16(bad, stream()).code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// FP8 scale schemes (GemmScaleScheme) and the dynamic quantize kernels that feed them.
//
// Tolerance of the scaled GEMMs: the output is BF16, whose rounding moves each element by at
// most 2^-9 of its value, so the rounding alone gives a relative Frobenius error <= 2^-9; FP32
// accumulation of K <= 640 products adds orders of magnitude less. 2^-8 leaves a factor of 2
// and still fails a scale applied to the wrong row or block (the tests below show the
// reference with swapped or mis-laid-out scales misses it by far more).
constexpr double kScaledGemmTolerance = 1.0 / 256.0;

// BF16 activations whose rows (and 1x128 groups) differ in magnitude by up to 2^12, so that
// per-row and per-group scales differ; row 3 is all zeros (scale 1 rule) when rows > 3.
std::vector<BFloat16> SpreadBf16Matrix(int64_t rows, int64_t cols, int64_t ld, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<BFloat16> m(static_cast<size_t>(rows * ld), BFloat16{kBf16PoisonBits});
  for (int64_t r = 0; r < rows; ++r) {
    const float row_mag = std::ldexp(1.0f, exponent(rng));
    for (int64_t c = 0; c < cols; ++c) {
      const float group_mag = std::ldexp(1.0f, static_cast<int>((r * 7 + c / 128) % 7) - 3);
      const float v = r == 3 ? 0.0f : unit(rng) * row_mag * group_mag;
      m[r * ld + c] = FloatToBFloat16(v);
    }
  }
  return m;
}

// CPU reference of LaunchQuantizeFp8Dynamic: codes (row pitch cols) and scales.
void ReferenceDynamicQuantize(const std::vector<BFloat16>& in, int64_t rows, int64_t cols,
                              int64_t ld, Fp8ScaleGranularity g, std::vector<uint8_t>* codes,
                              std::vector<float>* scales) {
  const int64_t group = g == Fp8ScaleGranularity::kPerRow ? cols : 128;
  const int64_t groups = cols / group;
  codes->assign(static_cast<size_t>(rows * cols), 0);
  scales->assign(static_cast<size_t>(rows * groups), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      std::vector<float> vals(static_cast<size_t>(group));
      for (int64_t c = 0; c < group; ++c) vals[c] = BFloat16ToFloat(in[r * ld + gi * group + c]);
      const float scale = ScaleFromAmax(Amax(vals), Fp8Format::kE4M3);
      (*scales)[gi * rows + r] = scale;  // per row: gi == 0, so scales[r]
      for (int64_t c = 0; c < group; ++c) {
        (*codes)[r * cols + gi * group + c] = FloatToFp8E4M3(vals[c] / scale);
      }
    }
  }
}

struct QuantizeCase {
  int64_t rows, cols;
  Fp8ScaleGranularity granularity;
};

class DynamicQuantizeTest : public GpuTest, public ::testing::WithParamInterface<QuantizeCase> {};

TEST_P(DynamicQuantizeTest, CodesAndScalesAreBitExactWithCpuReference) {
  const QuantizeCase qc = GetParam();
  // Padded pitches (input by 16 bytes, output to the next 16-byte multiple plus 16).
  const int64_t in_ld = qc.cols + 8, out_ld = (qc.cols + 15) / 16 * 16 + 16;
  const std::vector<BFloat16> x =
      SpreadBf16Matrix(qc.rows, qc.cols, in_ld, static_cast<uint32_t>(qc.rows * 13 + qc.cols));
  const int64_t groups = qc.granularity == Fp8ScaleGranularity::kPerRow ? 1 : qc.cols / 128;
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dx, Upload(x, "x"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dq, DeviceBuffer::Allocate(qc.rows * out_ld, "q"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer ds, DeviceBuffer::Allocate(qc.rows * groups * 4, "s"));
  TP_ASSERT_OK(LaunchPoisonFill(dq.data(), DataType::kFloat8E4M3, qc.rows * out_ld, stream()));
  TP_ASSERT_OK(LaunchPoisonFill(ds.data(), DataType::kFloat32, qc.rows * groups, stream()));
  QuantizeFp8DynamicParams p;
  p.input = dx.data();
  p.output = dq.as<uint8_t>();
  p.scales = ds.as<float>();
  p.rows = qc.rows;
  p.cols = qc.cols;
  p.input_ld = in_ld;
  p.output_ld = out_ld;
  p.granularity = qc.granularity;
  TP_ASSERT_OK(LaunchQuantizeFp8Dynamic(p, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> q, Download<uint8_t>(dq.data(), qc.rows * out_ld));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<float> s, Download<float>(ds.data(), qc.rows * groups));

  std::vector<uint8_t> ref_codes;
  std::vector<float> ref_scales;
  ReferenceDynamicQuantize(x, qc.rows, qc.cols, in_ld, qc.granularity, &ref_codes, &ref_scales);
  size_t bad_scales = 0, bad_codes = 0, touched_padding = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    uint32_t got_bits, ref_bits;
    std::memcpy(&got_bits, &s[i], 4);
    std::memcpy(&ref_bits, &ref_scales[i], 4);
    if (got_bits != ref_bits && bad_scales++ < 5) {
      ADD_FAILURE() << "scale " << i << ": got " << s[i] << ", want " << ref_scales[i];
    }
  }
  for (int64_t r = 0; r < qc.rows; ++r) {
    for (int64_t c = 0; c < out_ld; ++c) {
      const uint8_t got = q[r * out_ld + c];
      if (c >= qc.cols) {
        touched_padding += got != kFp8E4M3PoisonBits;
      } else if (got != ref_codes[r * qc.cols + c] && bad_codes++ < 5) {
        ADD_FAILURE() << "code (" << r << ", " << c << "): got " << int{got} << ", want "
                      << int{ref_codes[r * qc.cols + c]};
      }
    }
  }
  EXPECT_EQ(bad_scales, 0u);
  EXPECT_EQ(bad_codes, 0u);
  EXPECT_EQ(touched_padding, 0u) << "wrote into the output_ld padding";
  // The zero row's scale is 1 (row 3, every group).
  for (int64_t gi = 0; gi < groups; ++gi) EXPECT_EQ(s[gi * qc.rows + 3], 1.0f);
}

std::string QuantizeCaseName(const ::testing::TestParamInfo<QuantizeCase>& info) {
  return std::string(info.param.granularity == Fp8ScaleGranularity::kPerRow ? "per_row"
                                                                            : "per_group128") +
         "_m" + std::to_string(info.param.rows) + "_k" + std::to_string(info.param.cols);
}

INSTANTIATE_TEST_SUITE_P(AwkwardShapes, DynamicQuantizeTest,
                         ::testing::Values(QuantizeCase{37, 640, Fp8ScaleGranularity::kPerRow},
                                           QuantizeCase{1002, 648, Fp8ScaleGranularity::kPerRow},
                                           QuantizeCase{5, 14336, Fp8ScaleGranularity::kPerRow},
                                           QuantizeCase{37, 640, Fp8ScaleGranularity::kPerGroup128},
                                           QuantizeCase{1002, 1024,
                                                        Fp8ScaleGranularity::kPerGroup128}),
                         QuantizeCaseName);

TEST_F(GpuTest, DynamicQuantizeRejectsShapesItsKernelsCannotTake) {
  QuantizeFp8DynamicParams p;
  p.input = reinterpret_cast<const void*>(uintptr_t{256});
  p.output = reinterpret_cast<uint8_t*>(uintptr_t{512});
  p.scales = reinterpret_cast<float*>(uintptr_t{1024});
  p.rows = 4;
  p.cols = 200;
  p.granularity = Fp8ScaleGranularity::kPerGroup128;
  ExpectRejected(LaunchQuantizeFp8Dynamic(p, stream()), StatusCode::kInvalidArgument, "cols");
  p.cols = 256;
  p.output_ld = 264;
  ExpectRejected(LaunchQuantizeFp8Dynamic(p, stream()), StatusCode::kInvalidArgument, "output_ld");
  p.output_ld = 0;
  p.input = reinterpret_cast<const void*>(uintptr_t{258});
  ExpectRejected(LaunchQuantizeFp8Dynamic(p, stream()), StatusCode::kInvalidArgument, "aligned");
}

// One scaled GEMM: A comes from BF16 activations through LaunchQuantizeFp8Dynamic (so the
// kernel's scale layout is what cuBLASLt reads), B is random FP8 with random scales of the
// scheme's layout spread over 2^-6..2^2. The reference is computed in double from the
// downloaded codes and scales. Returns the dequantized operands for the caller's own checks.
struct ScaledGemmRun {
  std::vector<uint8_t> a_codes, b_codes;
  std::vector<float> a_scales, b_scales;
  std::vector<double> out;  // m x n
};

void RunScaledGemm(GemmScaleScheme scheme, int64_t m, int64_t n, int64_t k, uint32_t seed,
                   cudaStream_t stream, ScaledGemmRun* run) {
  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.scale_scheme = scheme;
  const int64_t a_count = GemmAScaleCount(p), b_count = GemmBScaleCount(p);

  const std::vector<BFloat16> x = SpreadBf16Matrix(m, k, k, seed);
  run->b_codes = RandomFp8Matrix(n, k, k, -448.0f, 448.0f, seed + 1);
  std::mt19937 rng(seed + 2);
  std::uniform_real_distribution<float> log2_scale(-6.0f, 2.0f);
  run->b_scales.assign(static_cast<size_t>(b_count), 0.0f);
  for (float& v : run->b_scales) v = std::exp2(log2_scale(rng));

  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dx, Upload(x, "x"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer db, Upload(run->b_codes, "B"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsb, Upload(run->b_scales, "b_scales"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer da, DeviceBuffer::Allocate(m * k, "A"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dsa, DeviceBuffer::Allocate(a_count * 4, "a_scales"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer dd, DeviceBuffer::Allocate(m * n * 2, "D"));
  TP_ASSERT_OK(LaunchPoisonFill(dsa.data(), DataType::kFloat32, a_count, stream));
  TP_ASSERT_OK(LaunchPoisonFill(dd.data(), DataType::kBFloat16, m * n, stream));

  if (scheme == GemmScaleScheme::kPerTensor) {
    // Per tensor: the scalar scale from the amax of the whole tensor.
    AbsMaxParams ap;
    ap.input = dx.data();
    ap.count = static_cast<size_t>(m * k);
    ap.amax = dsa.as<float>();
    TP_ASSERT_OK(LaunchAbsMax(ap, stream));
    TP_ASSERT_OK(LaunchScaleFromAmax(dsa.as<float>(), 1, dsa.as<float>(), stream));
    QuantizeFp8Params qp;
    qp.input = dx.data();
    qp.output = da.as<uint8_t>();
    qp.count = static_cast<size_t>(m * k);
    qp.scale = dsa.as<float>();
    TP_ASSERT_OK(LaunchQuantizeToFp8E4M3(qp, stream));
  } else {
    QuantizeFp8DynamicParams qp;
    qp.input = dx.data();
    qp.output = da.as<uint8_t>();
    qp.scales = dsa.as<float>();
    qp.rows = m;
    qp.cols = k;
    qp.granularity = scheme == GemmScaleScheme::kBlockwise ? Fp8ScaleGranularity::kPerGroup128
                                                           : Fp8ScaleGranularity::kPerRow;
    TP_ASSERT_OK(LaunchQuantizeFp8Dynamic(qp, stream));
  }

  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("scaled_gemm_test"));
  p.a_scale = dsa.as<float>();
  p.b_scale = dsb.as<float>();
  TP_ASSERT_OK(gemm.Prepare(p));
  TP_ASSERT_OK(gemm.Run(p, da.data(), db.data(), nullptr, dd.data(), stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));

  TP_ASSERT_OK_AND_ASSIGN(run->a_codes, Download<uint8_t>(da.data(), m * k));
  TP_ASSERT_OK_AND_ASSIGN(run->a_scales, Download<float>(dsa.data(), a_count));
  TP_ASSERT_OK_AND_ASSIGN(std::vector<BFloat16> out, Download<BFloat16>(dd.data(), m * n));
  run->out = Bf16Block(out, 0, m, n, n);
}

// sa(i, kk) and sb(j, kk) of the scheme's layout (see GemmScaleScheme), given the vectors.
double ActScale(GemmScaleScheme s, const std::vector<float>& sa, int64_t m, int64_t i, int64_t kk) {
  switch (s) {
    case GemmScaleScheme::kPerTokenChannel:
      return sa[i];
    case GemmScaleScheme::kBlockwise:
      return sa[(kk / 128) * m + i];
    default:
      return sa[0];
  }
}
double WeightScale(GemmScaleScheme s, const std::vector<float>& sb, int64_t k, int64_t j,
                   int64_t kk) {
  switch (s) {
    case GemmScaleScheme::kPerTokenChannel:
      return sb[j];
    case GemmScaleScheme::kBlockwise:
      return sb[(j / 128) * BlockwiseWeightScalePitch(k) + kk / 128];
    default:
      return sb[0];
  }
}

// FP64 reference: D[i,j] = sum_kk (A[i,kk] sa(i,kk)) (B[j,kk] sb(j,kk)). The dequantized
// operands are exact in double (4-bit codes times 24-bit scales).
std::vector<double> ReferenceScaledGemm(GemmScaleScheme s, const std::vector<uint8_t>& a,
                                        const std::vector<float>& sa, const std::vector<uint8_t>& b,
                                        const std::vector<float>& sb, int64_t m, int64_t n,
                                        int64_t k) {
  std::vector<double> ad(static_cast<size_t>(m * k)), bd(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t kk = 0; kk < k; ++kk) {
      ad[i * k + kk] = Fp8E4M3ToFloat(a[i * k + kk]) * ActScale(s, sa, m, i, kk);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t kk = 0; kk < k; ++kk) {
      bd[j * k + kk] = Fp8E4M3ToFloat(b[j * k + kk]) * WeightScale(s, sb, k, j, kk);
    }
  }
  std::vector<double> out(static_cast<size_t>(m * n));
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1u, 64u);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < m; i += threads) {
        for (int64_t j = 0; j < n; ++j) {
          double acc = 0.0;
          for (int64_t kk = 0; kk < k; ++kk) acc += ad[i * k + kk] * bd[j * k + kk];
          out[i * n + j] = acc;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  return out;
}

struct ScaledShape {
  GemmScaleScheme scheme;
  int64_t m, n, k;
};

class ScaledGemmTest : public GpuTest, public ::testing::WithParamInterface<ScaledShape> {};

TEST_P(ScaledGemmTest, MatchesFp64ReferenceOfTheSameCodesAndScales) {
  const ScaledShape s = GetParam();
  ScaledGemmRun run;
  RunScaledGemm(s.scheme, s.m, s.n, s.k, static_cast<uint32_t>(s.m * 3 + s.n + s.k), stream(),
                &run);
  if (HasFatalFailure()) return;
  const std::vector<double> ref = ReferenceScaledGemm(s.scheme, run.a_codes, run.a_scales,
                                                      run.b_codes, run.b_scales, s.m, s.n, s.k);
  const Comparison c = Compare(run.out, ref);
  EXPECT_EQ(c.nan_count, 0u) << "unwritten (poisoned) or NaN output elements";
  EXPECT_LE(c.rel_frobenius, kScaledGemmTolerance);
}

std::string ScaledShapeName(const ::testing::TestParamInfo<ScaledShape>& info) {
  return std::string(GemmScaleSchemeName(info.param.scheme)) + "_m" + std::to_string(info.param.m) +
         "_n" + std::to_string(info.param.n) + "_k" + std::to_string(info.param.k);
}

// Blockwise needs m % 4 == 0 (cuBLASLt), so its awkward M are 36 and 1004.
INSTANTIATE_TEST_SUITE_P(
    AwkwardShapes, ScaledGemmTest,
    ::testing::Values(ScaledShape{GemmScaleScheme::kPerTensor, 37, 384, 640},
                      ScaledShape{GemmScaleScheme::kPerTokenChannel, 37, 384, 640},
                      ScaledShape{GemmScaleScheme::kPerTokenChannel, 1002, 1040, 256},
                      ScaledShape{GemmScaleScheme::kBlockwise, 36, 384, 640},
                      ScaledShape{GemmScaleScheme::kBlockwise, 1004, 384, 640},
                      ScaledShape{GemmScaleScheme::kBlockwise, 1004, 1024, 1152}),
    ScaledShapeName);

// The tolerance can fail: the same output against a reference whose scales are applied to the
// wrong rows (per token/channel: activation and weight vectors swapped, m == n) or read in the
// wrong layout (blockwise: the activation groups row-major instead of token-major) misses by
// far more than the tolerance.
TEST_F(GpuTest, ScaledGemmToleranceRejectsSwappedOrMisLaidOutScales) {
  {
    ScaledGemmRun run;
    RunScaledGemm(GemmScaleScheme::kPerTokenChannel, 384, 384, 640, 77, stream(), &run);
    if (HasFatalFailure()) return;
    const std::vector<double> right =
        ReferenceScaledGemm(GemmScaleScheme::kPerTokenChannel, run.a_codes, run.a_scales,
                            run.b_codes, run.b_scales, 384, 384, 640);
    const std::vector<double> swapped =
        ReferenceScaledGemm(GemmScaleScheme::kPerTokenChannel, run.a_codes, run.b_scales,
                            run.b_codes, run.a_scales, 384, 384, 640);
    EXPECT_LE(Compare(run.out, right).rel_frobenius, kScaledGemmTolerance);
    EXPECT_GT(Compare(run.out, swapped).rel_frobenius, 10 * kScaledGemmTolerance);
  }
  {
    const int64_t m = 36, n = 384, k = 640, groups = k / 128;
    ScaledGemmRun run;
    RunScaledGemm(GemmScaleScheme::kBlockwise, m, n, k, 78, stream(), &run);
    if (HasFatalFailure()) return;
    std::vector<float> row_major(run.a_scales.size());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t g = 0; g < groups; ++g) row_major[g * m + i] = run.a_scales[i * groups + g];
    }
    const std::vector<double> right = ReferenceScaledGemm(
        GemmScaleScheme::kBlockwise, run.a_codes, run.a_scales, run.b_codes, run.b_scales, m, n, k);
    const std::vector<double> wrong = ReferenceScaledGemm(
        GemmScaleScheme::kBlockwise, run.a_codes, row_major, run.b_codes, run.b_scales, m, n, k);
    EXPECT_LE(Compare(run.out, right).rel_frobenius, kScaledGemmTolerance);
    EXPECT_GT(Compare(run.out, wrong).rel_frobenius, 10 * kScaledGemmTolerance);
  }
}

TEST_F(GpuTest, ScaleSchemeIsPartOfThePlanKey) {
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer scales, DeviceBuffer::Allocate(64 << 10, "scales"));
  TP_ASSERT_OK_AND_ASSIGN(CublasLtGemm gemm, CublasLtGemm::Create("scheme_key_test"));
  GemmParams p;
  p.m = 256;
  p.n = 256;
  p.k = 256;
  p.a_scale = scales.as<float>();
  p.b_scale = scales.as<float>() + 4096;
  for (GemmScaleScheme s : {GemmScaleScheme::kPerTensor, GemmScaleScheme::kPerTokenChannel,
                            GemmScaleScheme::kBlockwise}) {
    p.scale_scheme = s;
    TP_ASSERT_OK(gemm.Prepare(p));
  }
  EXPECT_EQ(gemm.num_plans(), 3u);
}

TEST(GemmScaleSchemeTest, ValidationNamesTheParameterOfUnsupportedCombinations) {
  float dummy[4] = {};
  GemmParams good;
  good.m = 36;
  good.n = 384;
  good.k = 640;
  good.a_scale = dummy;
  good.b_scale = dummy;
  good.scale_scheme = GemmScaleScheme::kBlockwise;
  EXPECT_TRUE(ValidateGemmParams(good).ok()) << ValidateGemmParams(good).ToString();
  EXPECT_EQ(GemmAScaleCount(good), 5 * 36);
  EXPECT_EQ(GemmBScaleCount(good), 3 * 8);  // 5 k-blocks padded to 8

  GemmParams p = good;
  p.m = 37;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.m");
  p = good;
  p.k = 576;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.k");
  p = good;
  p.n = 400;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.n");
  p = good;
  p.fast_accum = true;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kUnimplemented, "GemmParams.fast_accum");
  p = good;
  p.d_type = DataType::kFloat8E4M3;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kUnimplemented, "GemmParams.d_type");
  p = good;
  p.a_scale = nullptr;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.a_scale");
  p = good;
  p.beta = 1.0f;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kUnimplemented, "GemmParams.beta");
  p = good;
  p.batch = 2;
  p.stride_a = 36 * 640;
  p.stride_d = 36 * 384;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kUnimplemented, "GemmParams.batch");
  p = good;
  p.a_type = p.b_type = DataType::kBFloat16;
  p.a_scale = p.b_scale = nullptr;
  ExpectRejected(ValidateGemmParams(p), StatusCode::kInvalidArgument, "GemmParams.scale_scheme");

  // Per token/channel takes any m (outer vectors have no block shape).
  p = good;
  p.scale_scheme = GemmScaleScheme::kPerTokenChannel;
  p.m = 37;
  p.n = 1040;
  p.k = 272;
  EXPECT_TRUE(ValidateGemmParams(p).ok()) << ValidateGemmParams(p).ToString();
  EXPECT_EQ(GemmAScaleCount(p), 37);
  EXPECT_EQ(GemmBScaleCount(p), 1040);

  EXPECT_EQ(ParseGemmScaleScheme("blockwise").value(), GemmScaleScheme::kBlockwise);
  ExpectRejected(ParseGemmScaleScheme("rowwise").status(), StatusCode::kInvalidArgument,
                 "per_token_channel");
}

}  // namespace
}  // namespace tpserve
