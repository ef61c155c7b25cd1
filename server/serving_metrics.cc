#include "server/serving_metrics.h"

#include <algorithm>

namespace tpserve {

void LatencyHistogram::Observe(double seconds) {
  const size_t b = static_cast<size_t>(std::lower_bound(kBounds.begin(), kBounds.end(), seconds) -
                                       kBounds.begin());
  std::lock_guard lock(mu_);
  ++counts_[b];
  sum_ += seconds;
  ++count_;
}

uint64_t LatencyHistogram::count() const {
  std::lock_guard lock(mu_);
  return count_;
}

void LatencyHistogram::Render(std::ostringstream& o, const std::string& name,
                              const std::string& help, const std::string& labels) const {
  std::lock_guard lock(mu_);
  o << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= kBounds.size(); ++i) {
    cumulative += counts_[i];
    o << name << "_bucket{" << labels << ",le=\"";
    if (i < kBounds.size()) {
      o << kBounds[i];
    } else {
      o << "+Inf";
    }
    o << "\"} " << cumulative << "\n";
  }
  o << name << "_sum{" << labels << "} " << sum_ << "\n"
    << name << "_count{" << labels << "} " << count_ << "\n";
}

const char* RejectReasonName(RejectReason r) {
  switch (r) {
    case RejectReason::kInvalidArgument:
      return "invalid_argument";
    case RejectReason::kNotFound:
      return "not_found";
    case RejectReason::kQueueFull:
      return "queue_full";
    case RejectReason::kTooManyStreams:
      return "too_many_streams";
    case RejectReason::kShuttingDown:
      return "shutting_down";
    case RejectReason::kUnavailable:
      return "unavailable";
  }
  return "unknown";
}

void ServingMetrics::Render(std::ostringstream& o, const std::string& labels) const {
  const char* name = "tpserve_rejected_requests_total";
  o << "# HELP " << name << " Requests refused before any work, by reason\n# TYPE " << name
    << " counter\n";
  for (int r = 0; r < kReasons; ++r) {
    o << name << "{" << labels << ",reason=\"" << RejectReasonName(static_cast<RejectReason>(r))
      << "\"} " << rejected_[r].load() << "\n";
  }
  ttft.Render(o, "tpserve_time_to_first_token_seconds",
              "Generation requests: arrival to the first generated token", labels);
  inter_token.Render(o, "tpserve_inter_token_latency_seconds",
                     "Generation requests: time between consecutive generated tokens", labels);
  e2e.Render(o, "tpserve_e2e_request_latency_seconds",
             "Generation requests: arrival to the last generated token", labels);
}

}  // namespace tpserve
