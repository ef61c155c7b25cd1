// RankGroup: the ranks of a tensor-parallel group that this process drives.
//
// Two forms share this interface so that tools (benchmarks, CLIs) can run
// either way:
//  - NcclThreadGroup: every rank is a thread of this process (GPU tests).
//  - NcclProcessGroup: one process per GPU, as tpserve serves; this process
//    drives its own rank only, the others are processes of their own. Copy
//    engines between GPUs behave as in serving only in this form (CUDA IPC
//    mappings rather than another device's memory in the same process).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/nccl_communicator.h"

namespace tpserve {

class RankGroup {
 public:
  virtual ~RankGroup() = default;

  // Ranks in the whole group (all processes).
  virtual int size() const = 0;
  // True in the process that runs rank 0 (it reports results).
  virtual bool leader() const = 0;
  // The communicators of `rank`: a rank this process runs.
  virtual NcclCommPool& pool(int rank) = 0;
  // Runs fn(rank) for every rank this process runs, with that rank's device
  // current, and returns the first error. A rank that fails aborts the
  // communicators this process holds, so that no rank waits for it forever
  // (ranks elsewhere see their deadline pass).
  virtual Status Run(const std::function<Status(int rank)>& fn) = 0;
  // Ends the group's work: with worker processes, destroys this process's
  // communicators and (leader) waits up to `timeout` for the workers' exit.
  // Threads: nothing to do.
  virtual Status Finish(std::chrono::seconds timeout) {
    (void)timeout;
    return Status::Ok();
  }
};

// "threads" (NcclThreadGroup) or "processes" (NcclProcessGroup, started with
// `argv`) of n ranks; INVALID_ARGUMENT for another `kind`. Waits on the GPUs
// are bounded by `timeout`.
StatusOr<std::unique_ptr<RankGroup>> CreateRankGroup(std::string_view kind,
                                                     const std::vector<std::string>& argv, int n,
                                                     std::chrono::milliseconds timeout);

}  // namespace tpserve
