// The median of a benchmark's timed rounds (tpserve-bench-decode, tpserve-bench-attention).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace tpserve {

// NaN for no rounds; the mean of the middle two for an even count.
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? std::nan("") : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

}  // namespace tpserve
