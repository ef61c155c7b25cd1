// tpserve-loadtest's generation figures, as `vllm bench serve` and trtllm-bench define them:
// time to first token (TTFT), time per output token (TPOT), inter-token latency (ITL),
// end-to-end latency, token throughput and goodput under latency objectives. Pure functions
// of per-request samples; header-only, tested on the CPU (tests/loadtest_generate_stats_test.cc).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "benchmarks/loadtest_stats.h"

namespace tpserve::loadtest {

// The most tokens --output-len may ask for per request.
inline constexpr int64_t kMaxOutputLen = int64_t{1} << 20;

// What one successful generation request measured, times from when the client issued it.
struct GenSample {
  double e2e_ms = 0;  // until its last response (the final one, or the unary response)
  // Until the first response carrying a token; only streaming observes it (unary: nullopt),
  // and a request that generated no token has none.
  std::optional<double> ttft_ms;
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  // Streaming: the gaps between consecutive responses that carry tokens (a response with
  // several tokens is one arrival, and responses with none are not arrivals), so
  // (number of such responses - 1) values; empty without streaming.
  std::vector<double> itl_ms;
};

// Time per output token after the first: (e2e - TTFT) / (output tokens - 1); nullopt when
// TTFT was not observed or fewer than 2 tokens came.
inline std::optional<double> Tpot(const GenSample& s) {
  if (!s.ttft_ms || s.output_tokens < 2) return std::nullopt;
  return (s.e2e_ms - *s.ttft_ms) / static_cast<double>(s.output_tokens - 1);
}

// Service-level objectives of goodput; an unset one does not constrain.
struct Slo {
  std::optional<double> ttft_ms;
  std::optional<double> tpot_ms;
  bool any() const { return ttft_ms.has_value() || tpot_ms.has_value(); }
};

// Whether a request meets every objective that is set. A TTFT objective is missed when TTFT
// was not observed (no token, or no streaming: the client does not count what it cannot
// see); a TPOT objective holds for a request of fewer than 2 tokens, which has no time
// between tokens (vLLM counts its TPOT as 0), and is missed when TTFT was not observed.
inline bool MeetsSlo(const GenSample& s, const Slo& slo) {
  if (slo.ttft_ms && !(s.ttft_ms && *s.ttft_ms <= *slo.ttft_ms)) return false;
  if (slo.tpot_ms) {
    if (s.output_tokens >= 2) {
      const std::optional<double> tpot = Tpot(s);
      if (!(tpot && *tpot <= *slo.tpot_ms)) return false;
    } else if (!s.ttft_ms && s.output_tokens == 1) {
      return false;  // one token, never seen arriving: unobserved
    }
  }
  return true;
}

// Mean and nearest-rank percentiles of some values; every figure NaN when there are none.
struct Distribution {
  size_t count = 0;
  double mean = std::nan("");
  double p50 = std::nan(""), p90 = std::nan(""), p99 = std::nan("");
};

inline Distribution Distribute(std::vector<double> v) {
  Distribution d;
  d.count = v.size();
  if (v.empty()) return d;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  d.mean = sum / static_cast<double>(v.size());
  d.p50 = NearestRankPercentile(v, 50);
  d.p90 = NearestRankPercentile(v, 90);
  d.p99 = NearestRankPercentile(v, 99);
  return d;
}

// One step's generation figures from its successful requests over `seconds` of measurement.
// Rates are NaN when seconds <= 0; goodput is NaN when no objective is set.
struct GenSummary {
  int64_t requests = 0, good_requests = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;
  double requests_per_sec = std::nan("");
  double output_tokens_per_sec = std::nan("");
  double total_tokens_per_sec = std::nan("");  // prompt and output tokens
  double goodput_per_sec = std::nan("");       // requests/s meeting every objective
  Distribution ttft_ms, tpot_ms, itl_ms, e2e_ms;
};

inline GenSummary Summarize(const std::vector<GenSample>& samples, double seconds, const Slo& slo) {
  GenSummary g;
  std::vector<double> ttft, tpot, itl, e2e;
  for (const GenSample& s : samples) {
    ++g.requests;
    g.prompt_tokens += s.prompt_tokens;
    g.output_tokens += s.output_tokens;
    e2e.push_back(s.e2e_ms);
    if (s.ttft_ms) ttft.push_back(*s.ttft_ms);
    if (const auto t = Tpot(s)) tpot.push_back(*t);
    itl.insert(itl.end(), s.itl_ms.begin(), s.itl_ms.end());
    if (slo.any() && MeetsSlo(s, slo)) ++g.good_requests;
  }
  g.ttft_ms = Distribute(std::move(ttft));
  g.tpot_ms = Distribute(std::move(tpot));
  g.itl_ms = Distribute(std::move(itl));
  g.e2e_ms = Distribute(std::move(e2e));
  if (seconds > 0) {
    g.requests_per_sec = static_cast<double>(g.requests) / seconds;
    g.output_tokens_per_sec = static_cast<double>(g.output_tokens) / seconds;
    g.total_tokens_per_sec = static_cast<double>(g.prompt_tokens + g.output_tokens) / seconds;
    if (slo.any()) g.goodput_per_sec = static_cast<double>(g.good_requests) / seconds;
  }
  return g;
}

// A closed loop's steady output tokens/s by Little's law: `clients` requests always in flight,
// each yielding the mean output tokens over the mean end-to-end latency. The windowed rate
// counts the tokens of requests completing inside the windows, so when generations last
// longer than a window and the clients, started together, complete in waves, it reads the
// waves' phase rather than the server's speed; this figure does not. NaN without requests
// or clients.
inline double ClosedLoopOutputTokensPerSec(const GenSummary& g, int64_t clients) {
  if (g.requests <= 0 || clients <= 0 || !(g.e2e_ms.mean > 0)) return std::nan("");
  const double tokens_per_request =
      static_cast<double>(g.output_tokens) / static_cast<double>(g.requests);
  return static_cast<double>(clients) * tokens_per_request / (g.e2e_ms.mean / 1e3);
}

// Output tokens per request: "N" or "MIN:MAX" (drawn uniformly per request), whole numbers
// with 1 <= MIN <= MAX <= kMaxOutputLen; nullopt when malformed.
struct OutputLen {
  int64_t min = 0, max = 0;
};

inline std::optional<OutputLen> ParseOutputLen(const std::string& s) {
  const std::vector<std::string> parts = Split(s, ':');
  if (parts.size() > 2) return std::nullopt;
  double v[2] = {0, 0};
  for (size_t i = 0; i < parts.size(); ++i) {
    // stod skips leading blanks: a part with any is refused, as one with trailing ones is.
    if (parts[i].find_first_of(" \t\n\v\f\r") != std::string::npos ||
        !ParseDouble(parts[i], &v[i]) || v[i] != std::floor(v[i]) || v[i] < 1 ||
        v[i] > static_cast<double>(kMaxOutputLen)) {
      return std::nullopt;
    }
  }
  if (parts.size() == 1) v[1] = v[0];
  if (v[1] < v[0]) return std::nullopt;
  return OutputLen{static_cast<int64_t>(v[0]), static_cast<int64_t>(v[1])};
}

// The category of a streamed request's error_message, which carries no status code of its
// own: the leading status-code name when the message starts with one ("INVALID_ARGUMENT:
// ..."), else "STREAM_ERROR".
inline std::string StreamErrorCategory(const std::string& message) {
  const size_t colon = message.find(':');
  if (colon == std::string::npos || colon == 0) return "STREAM_ERROR";
  for (size_t i = 0; i < colon; ++i) {
    const char c = message[i];
    if (!((c >= 'A' && c <= 'Z') || c == '_')) return "STREAM_ERROR";
  }
  return message.substr(0, colon);
}

}  // namespace tpserve::loadtest
