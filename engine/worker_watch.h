// Watching the worker processes a rank started (one per GPU of its node): the first one that
// exits is reported on a thread of its own, so that the rank that started them can stop
// waiting on collectives those workers will never join.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace tpserve {

// The first of `pids` that has exited, described as "worker rank R (pid P) exited with status
// S" or "... was killed by signal N", where R is ranks[i] for pids[i] (i + 1 when ranks is
// shorter). Nothing is reaped (WNOWAIT): whoever reaps the workers later still can. Only the
// listed pids are looked at, never another child of this process. nullopt while all run.
std::optional<std::string> FirstExitedWorker(const std::vector<pid_t>& pids,
                                             const std::vector<int>& ranks);

// Polls FirstExitedWorker every `poll` on its own thread from construction until a worker has
// exited, then calls on_lost(description) once on that thread, and stops. Stop() (and the
// destructor) ends the watch and joins the thread; it waits for an on_lost call in progress,
// so on_lost must not call Stop() or take a lock its Stop() caller holds. No pids: no thread.
class WorkerWatch {
 public:
  WorkerWatch() = default;
  WorkerWatch(std::vector<pid_t> pids, std::vector<int> ranks,
              std::function<void(const std::string&)> on_lost,
              std::chrono::milliseconds poll = std::chrono::milliseconds(20));
  ~WorkerWatch() { Stop(); }
  WorkerWatch(const WorkerWatch&) = delete;
  WorkerWatch& operator=(const WorkerWatch&) = delete;

  void Stop();

 private:
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace tpserve
