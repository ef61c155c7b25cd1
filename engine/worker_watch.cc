#include "engine/worker_watch.h"

#include <sys/wait.h>

#include <utility>

namespace tpserve {

std::optional<std::string> FirstExitedWorker(const std::vector<pid_t>& pids,
                                             const std::vector<int>& ranks) {
  for (size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] <= 0) continue;  // never started, or already given up on
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(pids[i]), &info, WEXITED | WNOWAIT | WNOHANG) != 0 ||
        info.si_pid != pids[i]) {
      continue;  // running (si_pid 0), or not a child of this process
    }
    const int rank = i < ranks.size() ? ranks[i] : static_cast<int>(i) + 1;
    return "worker rank " + std::to_string(rank) + " (pid " + std::to_string(info.si_pid) + ") " +
           (info.si_code == CLD_EXITED ? "exited with status " + std::to_string(info.si_status)
                                       : "was killed by signal " + std::to_string(info.si_status));
  }
  return std::nullopt;
}

WorkerWatch::WorkerWatch(std::vector<pid_t> pids, std::vector<int> ranks,
                         std::function<void(const std::string&)> on_lost,
                         std::chrono::milliseconds poll) {
  if (pids.empty()) return;
  thread_ = std::thread(
      [this, pids = std::move(pids), ranks = std::move(ranks), on_lost = std::move(on_lost), poll] {
        std::unique_lock lock(mu_);
        while (!stopping_) {
          if (std::optional<std::string> lost = FirstExitedWorker(pids, ranks)) {
            lock.unlock();  // Stop() may be called meanwhile; it waits for this call to end
            on_lost(*lost);
            return;
          }
          stop_cv_.wait_for(lock, poll, [this] { return stopping_; });
        }
      });
}

void WorkerWatch::Stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace tpserve
