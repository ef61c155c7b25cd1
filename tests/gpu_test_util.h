// Helpers shared by the GPU tests: Status assertions, host <-> device copies.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "comm/nccl_thread_group.h"
#include "layers/quantize_kernels.h"

// ASSERT that a Status is OK / that a StatusOr is OK and move its value out.
#define TP_ASSERT_OK(expr)                                               \
  do {                                                                   \
    const ::tpserve::Status tp_assert_status_ = (expr);                  \
    ASSERT_TRUE(tp_assert_status_.ok()) << tp_assert_status_.ToString(); \
  } while (0)

#define TP_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  TP_ASSERT_OK_AND_ASSIGN_IMPL(TP_STATUS_CONCAT(tp_assert_statusor_, __LINE__), lhs, expr)
#define TP_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();  \
  lhs = std::move(tmp).value()

namespace tpserve {

// Logits [seqs, vocab] against a reference's: the relative Frobenius error over all of them
// (a non-finite difference counts as huge), and the sequences whose top-1 token differs
// although the reference's top two are more than 2 % of its largest |logit| apart.
struct Comparison {
  double rel_frobenius = 0;
  int top1_mismatches = 0;  // outside near-ties
};

inline Comparison Compare(const std::vector<float>& gpu, const std::vector<float>& ref,
                          int64_t seqs, int64_t vocab) {
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

// Whether any CUDA device is visible (tests skip without one).
inline bool HasCudaDevice() { return CudaDeviceCount() > 0; }

template <class T>
StatusOr<DeviceBuffer> Upload(const std::vector<T>& host, const std::string& name) {
  TP_ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::Allocate(host.size() * sizeof(T), name));
  if (!host.empty()) {
    TP_CUDA_CHECK(
        cudaMemcpy(buf.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    // From pageable memory cudaMemcpy may return before its DMA lands, and the tests' streams
    // are non-blocking: wait, so that kernels on them see the data.
    TP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return buf;
}

template <class T>
StatusOr<std::vector<T>> Download(const void* src, size_t count) {
  std::vector<T> host(count);
  if (count > 0) {
    TP_CUDA_CHECK(cudaMemcpy(host.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost));
  }
  return host;
}

// A fixture with a stream on device 0. Without a GPU, has_device_ is false and
// tests skip through TP_SKIP_WITHOUT_GPU().
class GpuStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    has_device_ = HasCudaDevice();
    if (!has_device_) return;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    auto stream = CudaStream::Create();
    ASSERT_TRUE(stream.ok()) << stream.status().ToString();
    stream_ = std::move(stream).value();
  }

  cudaStream_t stream() const { return stream_.get(); }

  bool has_device_ = false;
  CudaStream stream_;
};

#define TP_SKIP_WITHOUT_GPU()           \
  do {                                  \
    if (!has_device_) {                 \
      GTEST_SKIP() << "no CUDA device"; \
    }                                   \
  } while (0)

// A device buffer of `count` elements of `type`, filled with its poison pattern on `stream`.
inline StatusOr<DeviceBuffer> PoisonedBuffer(DataType type, size_t count, const std::string& name,
                                             cudaStream_t stream) {
  TP_ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::Allocate(count * DataTypeSize(type), name));
  TP_RETURN_IF_ERROR(LaunchPoisonFill(buf.data(), type, count, stream));
  return buf;
}

// The q, k and v slices of a fused [tokens, q_width + 2 kv_width] BF16 buffer (the QKV
// GEMM's output, as the attention kernels read it), widened to float, each row-major.
struct QkvFloats {
  std::vector<float> q, k, v;
};
inline QkvFloats WidenQkv(const std::vector<BFloat16>& qkv, int64_t tokens, int64_t q_width,
                          int64_t kv_width) {
  const int64_t stride = q_width + 2 * kv_width;
  QkvFloats f{std::vector<float>(tokens * q_width), std::vector<float>(tokens * kv_width),
              std::vector<float>(tokens * kv_width)};
  for (int64_t r = 0; r < tokens; ++r) {
    for (int64_t j = 0; j < q_width; ++j)
      f.q[r * q_width + j] = BFloat16ToFloat(qkv[r * stride + j]);
    for (int64_t j = 0; j < kv_width; ++j) {
      f.k[r * kv_width + j] = BFloat16ToFloat(qkv[r * stride + q_width + j]);
      f.v[r * kv_width + j] = BFloat16ToFloat(qkv[r * stride + q_width + kv_width + j]);
    }
  }
  return f;
}

// `count` BF16 values uniform in [lo, hi).
inline std::vector<BFloat16> RandomBf16(size_t count, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<BFloat16> v(count);
  for (auto& x : v) x = FloatToBFloat16(dist(rng));
  return v;
}

}  // namespace tpserve
