// LocalCommunicator: ranks are threads of one process. Used by the CPU
// reference executor and by tests of TP logic on machines without GPUs.
//
// Collectives are synchronous (complete before returning). Send copies the
// message and returns at once; Recv waits for it. Every wait is bounded by
// `timeout`: a rank that does not arrive in time makes the waiting rank return
// DEADLINE_EXCEEDED and aborts the whole group (its state can no longer be
// trusted), so later operations of every rank return ABORTED.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace tpserve {

struct LocalCommOptions {
  // How long any operation waits for its peers before giving up.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// Makes `size` communicators that share one group; element r is rank r.
// Each must be used by one thread. The group lives as long as any member.
StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalCommunicators(
    int size, LocalCommOptions options = {});

// Runs fn(comm) on `size` threads, one per rank, and returns the first non-OK
// status in rank order (OK if all succeeded). A rank that fails aborts the
// group so that the others do not wait for it until the timeout; an exception
// thrown by fn fails its rank with INTERNAL ("rank r threw: ...").
Status RunOnLocalRanks(int size, const std::function<Status(Communicator&)>& fn,
                       LocalCommOptions options = {});

}  // namespace tpserve
