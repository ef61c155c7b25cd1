#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

namespace tpserve {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// log_softmax(logits)[token], in double.
float LogProb(std::span<const float> logits, int32_t token) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max);
  return static_cast<float>(static_cast<double>(logits[token]) - max - std::log(sum));
}

}  // namespace

Status ValidateSamplingParams(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return InvalidArgumentError("temperature is " + std::to_string(p.temperature) +
                                ", needs a finite value >= 0 (0: greedy)");
  }
  if (p.top_k < 0) {
    return InvalidArgumentError("runtime_top_k is " + std::to_string(p.top_k) +
                                ", needs >= 0 (0: no cut)");
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return InvalidArgumentError("runtime_top_p is " + std::to_string(p.top_p) +
                                ", needs a value in (0, 1]");
  }
  return Status::Ok();
}

double SampleUniform(uint64_t seed, uint64_t index) {
  return static_cast<double>(SplitMix64(seed ^ SplitMix64(index)) >> 11) * 0x1.0p-53;
}

SampledToken SampleToken(std::span<const float> logits, const SamplingParams& params,
                         uint64_t index) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  if (params.temperature == 0.0f || params.top_k == 1) {
    // max_element returns the first of equal maxima: the lowest id.
    const int32_t t =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    return {t, LogProb(logits, t)};
  }
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  const int64_t keep = params.top_k > 0 ? std::min<int64_t>(params.top_k, vocab) : vocab;
  auto before = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), before);
  order.resize(static_cast<size_t>(keep));
  const double inv_t = 1.0 / static_cast<double>(params.temperature);
  const double top = static_cast<double>(logits[order[0]]) * inv_t;
  std::vector<double> p(order.size());
  double sum = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    p[i] = std::exp(static_cast<double>(logits[order[i]]) * inv_t - top);
    sum += p[i];
  }
  size_t kept = order.size();
  if (params.top_p < 1.0f) {
    double cum = 0;
    const double target = static_cast<double>(params.top_p) * sum;
    for (size_t i = 0; i < order.size(); ++i) {
      cum += p[i];
      if (cum >= target) {
        kept = i + 1;
        break;
      }
    }
  }
  double kept_sum = 0;
  for (size_t i = 0; i < kept; ++i) kept_sum += p[i];
  const double u = SampleUniform(params.seed, index) * kept_sum;
  double cum = 0;
  int32_t token = order[kept - 1];
  for (size_t i = 0; i < kept; ++i) {
    cum += p[i];
    if (cum > u) {
      token = order[i];
      break;
    }
  }
  return {token, LogProb(logits, token)};
}

}  // namespace tpserve
