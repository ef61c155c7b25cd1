// tpserve-loadtest's pure pieces: argument parsing, the nearest-rank
// percentile and the stability verdict. Header-only, tested on the CPU
// (tests/loadtest_stats_test.cc).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace tpserve::loadtest {

// Most steps a range may give.
inline constexpr size_t kMaxRangeValues = 10000;
// Windows whose requests/s must agree for a step to count as stable.
inline constexpr size_t kStableWindows = 3;

inline std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

// The whole of `s` as a finite number.
inline bool ParseDouble(const std::string& s, double* out) {
  try {
    size_t pos = 0;
    *out = std::stod(s, &pos);
    return pos == s.size() && std::isfinite(*out);
  } catch (const std::exception&) {
    return false;
  }
}

// "start:end:step" (also "start" and "start:end", step 1) into the list of
// values start, start+step, ... <= end; nullopt when malformed (start <= 0,
// end < start, step <= 0, not numbers) or longer than kMaxRangeValues.
inline std::optional<std::vector<double>> ParseRange(const std::string& s) {
  auto parts = Split(s, ':');
  if (parts.empty() || parts.size() > 3) return std::nullopt;
  double start = 0, end = 0, step = 1;
  if (!ParseDouble(parts[0], &start)) return std::nullopt;
  end = start;
  if (parts.size() >= 2 && !ParseDouble(parts[1], &end)) return std::nullopt;
  if (parts.size() == 3 && !ParseDouble(parts[2], &step)) return std::nullopt;
  if (start <= 0 || end < start || step <= 0) return std::nullopt;
  std::vector<double> values;
  for (int i = 0;; ++i) {
    const double v = start + i * step;
    if (v > end + 1e-9) break;
    if (values.size() >= kMaxRangeValues) return std::nullopt;
    values.push_back(v);
  }
  return values;
}

// The p-th percentile (0 < p <= 100) of `sorted` (ascending) by the nearest
// rank: the smallest value with at least p % of the values at or below it.
// NaN when empty.
inline double NearestRankPercentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return std::nan("");
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

// Whether the last kStableWindows windows' requests/s are all within pct
// percent of their mean; nullopt when it cannot be told (fewer windows than
// that, or no request succeeded in them).
inline std::optional<bool> Stable(const std::vector<double>& rps, double pct) {
  if (rps.size() < kStableWindows) return std::nullopt;
  const std::vector<double> last(rps.end() - static_cast<std::ptrdiff_t>(kStableWindows),
                                 rps.end());
  double mean = 0;
  for (double v : last) mean += v;
  mean /= static_cast<double>(last.size());
  if (!(mean > 0)) return std::nullopt;
  for (double v : last) {
    if (std::abs(v - mean) > mean * pct / 100.0) return false;
  }
  return true;
}

}  // namespace tpserve::loadtest
