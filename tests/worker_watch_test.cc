// engine/worker_watch.h on real child processes: each child either exits with a status, is
// killed, or waits in pause() until the test kills it.
#include "engine/worker_watch.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace tpserve {
namespace {

// A child that waits until it is signalled.
pid_t SpawnWaiting() {
  const pid_t pid = fork();
  if (pid == 0) {
    for (;;) pause();
  }
  return pid;
}

// A child that exits with `status` at once.
pid_t SpawnExiting(int status) {
  const pid_t pid = fork();
  if (pid == 0) _exit(status);
  return pid;
}

// Reaps `pid`, returning its wait status (-1 when it was not a child to reap).
int Reap(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, 0) == pid ? status : -1;
}

// FirstExitedWorker until it answers or `limit` passes.
std::optional<std::string> AwaitExit(const std::vector<pid_t>& pids, const std::vector<int>& ranks,
                                     std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (auto lost = FirstExitedWorker(pids, ranks)) return lost;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return std::nullopt;
}

TEST(WorkerWatchTest, NamesTheRankAndStatusOfAnExitedWorkerWithoutReapingIt) {
  const pid_t running = SpawnWaiting();
  const pid_t exiting = SpawnExiting(3);
  ASSERT_GT(running, 0);
  ASSERT_GT(exiting, 0);
  const std::vector<pid_t> pids = {running, exiting};
  const auto lost = AwaitExit(pids, {5, 6});
  ASSERT_TRUE(lost.has_value());
  EXPECT_EQ(*lost, "worker rank 6 (pid " + std::to_string(exiting) + ") exited with status 3");
  // Still there to reap, with its real status.
  const int status = Reap(exiting);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << status;
  // Only the running one is left: nothing to report (a reaped pid is not a child any more).
  EXPECT_EQ(FirstExitedWorker(pids, {5, 6}), std::nullopt);
  kill(running, SIGKILL);
  const auto killed = AwaitExit({running}, {});  // no ranks given: index + 1
  ASSERT_TRUE(killed.has_value());
  EXPECT_EQ(*killed, "worker rank 1 (pid " + std::to_string(running) + ") was killed by signal " +
                         std::to_string(SIGKILL));
  EXPECT_TRUE(WIFSIGNALED(Reap(running)));
}

TEST(WorkerWatchTest, IgnoresPidsThatAreNotItsChildrenOrNotStarted) {
  // The parent of this process, pid 1 and unstarted slots are never reported.
  EXPECT_EQ(FirstExitedWorker({getppid(), 1, 0, -1}, {1, 2, 3, 4}), std::nullopt);
}

TEST(WorkerWatchTest, CallsOnLostOnceWhenAWorkerExits) {
  const pid_t running = SpawnWaiting();
  const pid_t doomed = SpawnWaiting();
  ASSERT_GT(running, 0);
  ASSERT_GT(doomed, 0);
  std::mutex mu;
  std::vector<std::string> calls;
  {
    WorkerWatch watch({running, doomed}, {1, 2}, [&](const std::string& lost) {
      std::lock_guard lock(mu);
      calls.push_back(lost);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // several polls, all running
    {
      std::lock_guard lock(mu);
      EXPECT_TRUE(calls.empty());
    }
    kill(doomed, SIGTERM);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
      {
        std::lock_guard lock(mu);
        if (!calls.empty() || std::chrono::steady_clock::now() > end) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    // The second exit comes after the watch has reported and stopped: not reported.
    kill(running, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0], "worker rank 2 (pid " + std::to_string(doomed) + ") was killed by signal " +
                          std::to_string(SIGTERM));
  EXPECT_TRUE(WIFSIGNALED(Reap(doomed)));
  EXPECT_TRUE(WIFSIGNALED(Reap(running)));
}

TEST(WorkerWatchTest, StopEndsTheWatchWithoutACall) {
  const pid_t running = SpawnWaiting();
  ASSERT_GT(running, 0);
  bool called = false;
  WorkerWatch watch(
      {running}, {1}, [&](const std::string&) { called = true; }, std::chrono::milliseconds(1000));
  const auto t0 = std::chrono::steady_clock::now();
  watch.Stop();  // wakes the poll's wait instead of sleeping it out
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  watch.Stop();  // again: nothing to do
  kill(running, SIGKILL);
  EXPECT_TRUE(WIFSIGNALED(Reap(running)));
  EXPECT_FALSE(called);
  WorkerWatch empty({}, {}, [&](const std::string&) { called = true; });  // no thread
  EXPECT_FALSE(called);
}

}  // namespace
}  // namespace tpserve
