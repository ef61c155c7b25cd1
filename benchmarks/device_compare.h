// Comparison of device results for the benchmarks' correctness checks.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/dtype.h"
#include "comm/status.h"

namespace tpserve {

// Relative Frobenius distance ||a - b|| / ||b|| of two row-major BF16 device tensors
// [rows, cols], over every 7th row (a sample: enough to catch a wrong schedule or layout, cheap
// to download). Infinity when either holds a NaN. Synchronous (cudaMemcpy2D).
inline StatusOr<double> RelDiffBf16Rows(const void* a, const void* b, int64_t rows, int64_t cols) {
  const int64_t step = 7, sampled = (rows + step - 1) / step;
  std::vector<uint16_t> ha(sampled * cols), hb(sampled * cols);
  const size_t pitch = cols * 2;
  TP_CUDA_CHECK(
      cudaMemcpy2D(ha.data(), pitch, a, pitch * step, pitch, sampled, cudaMemcpyDeviceToHost));
  TP_CUDA_CHECK(
      cudaMemcpy2D(hb.data(), pitch, b, pitch * step, pitch, sampled, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (size_t i = 0; i < ha.size(); ++i) {
    const double x = BFloat16ToFloat(BFloat16{ha[i]}), y = BFloat16ToFloat(BFloat16{hb[i]});
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace tpserve
