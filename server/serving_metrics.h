// Counters and latency histograms of the serving path, rendered in
// Prometheus' text format. Thread-safe: updated from gRPC reactors and the
// generator's thread, read by /metrics scrapes.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

namespace tpserve {

// A histogram of durations in seconds with fixed bucket bounds.
class LatencyHistogram {
 public:
  static constexpr std::array<double, 16> kBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                     0.1,   0.25,   0.5,   1.0,  2.5,   5.0,
                                                     10.0,  30.0,   60.0,  120.0};
  void Observe(double seconds);
  // "# HELP/# TYPE" and the _bucket/_sum/_count lines, with `labels` (the
  // text inside the braces, without them) on every line.
  void Render(std::ostringstream& o, const std::string& name, const std::string& help,
              const std::string& labels) const;
  uint64_t count() const;

 private:
  mutable std::mutex mu_;
  std::array<uint64_t, kBounds.size() + 1> counts_{};
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Calls refused before any work, by reason (label values of
// tpserve_rejected_requests_total).
enum class RejectReason {
  kInvalidArgument,  // malformed request or undecodable message
  kNotFound,         // unknown model or version
  kQueueFull,        // queued requests at their limit
  kTooManyStreams,   // --max-streams reached
  kShuttingDown,     // arrived during the drain
  kUnavailable,      // the backend cannot serve it (no generation, engine down)
};
const char* RejectReasonName(RejectReason r);

class ServingMetrics {
 public:
  void Reject(RejectReason r) { rejected_[static_cast<int>(r)].fetch_add(1); }
  uint64_t rejected(RejectReason r) const { return rejected_[static_cast<int>(r)].load(); }

  LatencyHistogram ttft;         // request arrival -> first generated token
  LatencyHistogram inter_token;  // between consecutive generated tokens of a request
  LatencyHistogram e2e;          // request arrival -> last token (generation requests)

  // The rejection counters and the three histograms, labelled with `labels`.
  void Render(std::ostringstream& o, const std::string& labels) const;

 private:
  static constexpr int kReasons = 6;
  std::array<std::atomic<uint64_t>, kReasons> rejected_{};
};

}  // namespace tpserve
