// Deadlines from timeouts, without wrapping: steady_clock counts nanoseconds
// in 64 bits, so `now + timeout` overflows for timeouts above ~292 years
// (e.g. milliseconds::max() passed as "no practical limit") and would yield a
// deadline in the past, i.e. an immediate timeout.
#pragma once

#include <chrono>

namespace tpserve {

// now + timeout, or the clock's last instant when that does not fit.
// A timeout <= 0 gives `now` (already due).
inline std::chrono::steady_clock::time_point DeadlineAfter(
    std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  if (timeout.count() <= 0) return now;
  // Compared in milliseconds: converting `timeout` to the clock's nanoseconds
  // is what overflows.
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  if (timeout >= room) return Clock::time_point::max();
  return now + timeout;
}

}  // namespace tpserve
