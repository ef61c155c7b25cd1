// NcclProcessGroup: one process per GPU on one node, for tools that run the
// same program on every rank (tpserve-bench, tpserve-bench-model).
//
// Create() in a process without TPSERVE_RANK in its environment makes it the
// leader, rank 0 on device 0: it starts ranks 1..n-1 as copies of itself
// (SpawnLocalWorkers, same arguments) and all of them build their NCCL
// communicator together. In a started copy, Create() joins as the rank its
// environment names. Each process then runs the same sequence of collective
// work; only the leader writes results. The leader's Finish() reaps the
// workers.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/rank_group.h"

namespace tpserve {

class NcclProcessGroup final : public RankGroup {
 public:
  // argv: this program's whole argument vector (argv[0] is replaced by
  // /proc/self/exe for the copies). FAILED_PRECONDITION when the node has
  // fewer than n GPUs; INVALID_ARGUMENT when a started copy's environment
  // disagrees with n.
  static StatusOr<std::unique_ptr<NcclProcessGroup>> Create(const std::vector<std::string>& argv,
                                                            int n,
                                                            std::chrono::milliseconds timeout);
  // Destroys the communicators; a leader that did not call Finish() sends
  // its workers SIGTERM and reaps them.
  ~NcclProcessGroup() override;

  int size() const override { return size_; }
  bool leader() const override { return rank_ == 0; }
  int rank() const { return rank_; }
  NcclCommPool& pool(int rank) override;
  Status Run(const std::function<Status(int rank)>& fn) override;

  // Leader: destroys this rank's communicators, then waits up to `timeout`
  // for the workers to exit (killing those left). INTERNAL naming each
  // worker that failed or had to be killed. Workers: destroys the
  // communicators and returns OK.
  Status Finish(std::chrono::seconds timeout) override;

 private:
  NcclProcessGroup() = default;
  int size_ = 1;
  int rank_ = 0;
  int device_ = 0;
  std::unique_ptr<NcclCommPool> pool_;
  std::vector<pid_t> workers_;
};

}  // namespace tpserve
