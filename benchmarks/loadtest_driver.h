// tpserve-loadtest's arrival processes and measurement windows, whatever the requests are.
//
// A LoadDriver keeps N requests outstanding (closed loop) or issues them at target times from
// a scheduler thread, constant spacing or exponential gaps (open loop), so that a slow server
// does not slow the arrival process. A subclass sends one request per Send() and reports
// each one's end through Finish(); the driver files it in the current measurement window.
// Windows run back to back (RollWindow), so that every completion falls in exactly one.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/support/status_code_enum.h>

#include "benchmarks/loadtest_generate_stats.h"

namespace tpserve::loadtest {

using Clock = std::chrono::steady_clock;

// The name of a gRPC status code ("UNAVAILABLE"): how errors are counted per category.
const char* StatusName(grpc::StatusCode c);

// What one measurement window saw.
struct Window {
  double seconds = 0;
  int64_t ok = 0, failed = 0;
  int64_t tokens = 0;                // prompt tokens of the successful requests
  std::vector<double> latencies_ms;  // successful requests only, end to end
  std::vector<GenSample> generated;  // generation: one per successful request
  std::map<std::string, int64_t> errors;
  bool have_server = false;
  uint64_t server_count = 0, server_queue_ns = 0, server_compute_ns = 0;
  int64_t in_flight_at_end = 0;  // requests still outstanding when the window closed
  int64_t issued = 0;            // open loop: requests the schedule issued in the window
};

// How one request ended.
struct Outcome {
  std::string error;  // empty: success; else the error's category (a status code's name)
  double latency_ms = 0;
  int64_t prompt_tokens = 0;
  std::optional<GenSample> generated;  // generation requests' figures, on success
};

// Thread-safety: every public method may be called from any thread; Finish may be called
// concurrently from completion threads. A subclass's destructor must call StopLoad() before
// its own members go (Send may be running until then).
class LoadDriver {
 public:
  LoadDriver() = default;
  LoadDriver(const LoadDriver&) = delete;
  LoadDriver& operator=(const LoadDriver&) = delete;
  virtual ~LoadDriver();

  // Closed loop: n requests outstanding, each replaced when it ends, until StopLoad.
  void StartConcurrency(int n);
  // Open loop: requests at `rate` per second, evenly spaced or with exponential gaps (Poisson
  // arrivals, seeded), until StopLoad.
  void StartRate(double rate, bool poisson, uint64_t seed);
  // Stops issuing and waits for every outstanding request to end.
  void StopLoad();

  void BeginWindow();
  Window EndWindow();
  // Ends the current window and begins the next at the same instant, so that every
  // completion falls in one window or the other (nothing is lost to the time the caller
  // spends between windows, e.g. fetching the server's statistics from a stalled server).
  Window RollWindow();
  // Completions so far in the current window: (ok, failed).
  std::pair<int64_t, int64_t> WindowCounts();
  // Waits up to `d` for the window to reach `n` completions.
  void WaitForCompletions(int64_t n, Clock::duration d);

 protected:
  // Starts one request without blocking; it is already counted as outstanding, and must
  // end in exactly one Finish call (timeouts included).
  virtual void Send() = 0;
  // Files one ended request; in closed loop while loading, sends its replacement first, so
  // that the outstanding count is never below the concurrency in between.
  void Finish(Outcome outcome);

 private:
  void Issue();

  std::thread scheduler_;
  std::atomic<bool> loading_{false}, concurrency_mode_{true};
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t outstanding_ = 0;  // guarded by mu_
  bool collecting_ = false;  // guarded by mu_
  Window window_;            // guarded by mu_
  Clock::time_point window_start_;
};

}  // namespace tpserve::loadtest
