// NcclThreadGroup: N ranks as threads of one process, one GPU each, for GPU
// tests and single-process benchmarks. (Serving runs one process per GPU.)
//
// Create() initialises one NCCL communicator pool per GPU concurrently (NCCL
// init is collective); Run() runs a function on every rank's thread with that
// rank's device current; the destructor destroys the pools concurrently
// (destruction is collective too). Every wait is bounded by `timeout`.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "comm/nccl_communicator.h"
#include "comm/rank_group.h"

namespace tpserve {

// Number of CUDA devices; 0 when there are none or the driver is missing.
int CudaDeviceCount();

class NcclThreadGroup final : public RankGroup {
 public:
  // Ranks 0..n-1 on devices 0..n-1. FAILED_PRECONDITION if fewer devices.
  static StatusOr<std::unique_ptr<NcclThreadGroup>> Create(
      int n, std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~NcclThreadGroup() override;

  int size() const override { return static_cast<int>(pools_.size()); }
  bool leader() const override { return true; }
  NcclCommPool& pool(int rank) override { return *pools_[rank]; }

  // Runs fn(rank) on one thread per rank (device `rank` current, error
  // messages tagged with the rank) and returns the first error in rank order.
  // A rank that fails aborts every communicator so that the others cannot
  // wait for it forever.
  Status Run(const std::function<Status(int rank)>& fn) override;

 private:
  NcclThreadGroup() = default;
  std::vector<std::unique_ptr<NcclCommPool>> pools_;
};

}  // namespace tpserve
