#include "benchmarks/loadtest_driver.h"

#include <algorithm>
#include <random>

namespace tpserve::loadtest {

const char* StatusName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    default:
      return "UNKNOWN";
  }
}

LoadDriver::~LoadDriver() {
  loading_ = false;
  if (scheduler_.joinable()) scheduler_.join();
}

void LoadDriver::StartConcurrency(int n) {
  concurrency_mode_ = true;
  loading_ = true;
  for (int i = 0; i < n; ++i) Issue();
}

void LoadDriver::StartRate(double rate, bool poisson, uint64_t seed) {
  concurrency_mode_ = false;
  loading_ = true;
  scheduler_ = std::thread([this, rate, poisson, seed] {
    std::mt19937_64 rng(seed);
    std::exponential_distribution<double> gap_dist(rate);
    auto next = Clock::now();
    while (loading_) {
      for (auto now = Clock::now(); now < next && loading_; now = Clock::now()) {
        std::this_thread::sleep_for(
            std::min<Clock::duration>(next - now, std::chrono::milliseconds(20)));
      }
      if (!loading_) break;
      Issue();
      const double gap = poisson ? gap_dist(rng) : 1.0 / rate;
      next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap));
    }
  });
}

void LoadDriver::StopLoad() {
  loading_ = false;
  if (scheduler_.joinable()) scheduler_.join();
  std::unique_lock<std::mutex> lock(mu_);
  while (outstanding_ > 0) cv_.wait_for(lock, std::chrono::milliseconds(50));
}

void LoadDriver::BeginWindow() {
  std::lock_guard<std::mutex> lock(mu_);
  window_ = Window{};
  collecting_ = true;
  window_start_ = Clock::now();
}

Window LoadDriver::EndWindow() {
  std::lock_guard<std::mutex> lock(mu_);
  collecting_ = false;
  window_.seconds = std::chrono::duration<double>(Clock::now() - window_start_).count();
  window_.in_flight_at_end = outstanding_;
  return std::move(window_);
}

Window LoadDriver::RollWindow() {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  Window done = std::move(window_);
  done.seconds = std::chrono::duration<double>(now - window_start_).count();
  done.in_flight_at_end = outstanding_;
  window_ = Window{};
  window_start_ = now;
  return done;
}

std::pair<int64_t, int64_t> LoadDriver::WindowCounts() {
  std::lock_guard<std::mutex> lock(mu_);
  return {window_.ok, window_.failed};
}

void LoadDriver::WaitForCompletions(int64_t n, Clock::duration d) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, d, [&] { return window_.ok + window_.failed >= n; });
}

void LoadDriver::Issue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++outstanding_;
    if (collecting_) ++window_.issued;
  }
  Send();
}

void LoadDriver::Finish(Outcome o) {
  const bool replace = concurrency_mode_ && loading_;
  if (replace) Send();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (collecting_) {
      if (o.error.empty()) {
        ++window_.ok;
        window_.tokens += o.prompt_tokens;
        window_.latencies_ms.push_back(o.latency_ms);
        if (o.generated) window_.generated.push_back(std::move(*o.generated));
      } else {
        ++window_.failed;
        ++window_.errors[o.error];
      }
    }
    if (!replace) --outstanding_;
    // Under the lock: once StopLoad sees nothing outstanding the driver may go, so nothing
    // of it is touched after the lock is released.
    cv_.notify_all();
  }
}

}  // namespace tpserve::loadtest
