#include "comm/nccl_thread_group.h"

#include <thread>

#include "comm/cuda_check.h"

namespace tpserve {
namespace {

// Runs fn(r) for r in [0, n) on n threads; results in rank order.
std::vector<Status> OnThreads(int n, const std::function<Status(int)>& fn) {
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      SetCurrentRank(r);
      const cudaError_t e = cudaSetDevice(r);
      results[r] =
          e == cudaSuccess ? fn(r) : CudaCallError(e, "cudaSetDevice(r)", __FILE__, __LINE__);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

Status FirstError(const std::vector<Status>& results) {
  for (const Status& s : results) {
    if (!s.ok() && s.code() != StatusCode::kAborted) return s;
  }
  for (const Status& s : results) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver/device" error
    return 0;
  }
  return n;
}

StatusOr<std::unique_ptr<NcclThreadGroup>> NcclThreadGroup::Create(
    int n, std::chrono::milliseconds timeout) {
  if (n < 1) return InvalidArgumentError("thread group: size must be >= 1");
  const int devices = CudaDeviceCount();
  if (devices < n) {
    return FailedPreconditionError("thread group: " + std::to_string(n) + " ranks need " +
                                   std::to_string(n) + " GPUs, found " + std::to_string(devices));
  }
  ncclUniqueId id;
  TP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
  auto group = std::unique_ptr<NcclThreadGroup>(new NcclThreadGroup());
  std::vector<std::unique_ptr<NcclCommunicator>> comms(n);
  const Status s = FirstError(OnThreads(n, [&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(comms[r], NcclCommunicator::Create(id, n, r, r, NcclCommConfig{}, timeout));
    return Status::Ok();
  }));
  if (!s.ok()) {
    for (auto& c : comms) {
      if (c) c->Abort();
    }
    return s;
  }
  for (auto& c : comms) group->pools_.push_back(std::make_unique<NcclCommPool>(std::move(c)));
  return group;
}

NcclThreadGroup::~NcclThreadGroup() {
  // Communicator destruction is collective: every rank's thread at once.
  OnThreads(size(), [&](int r) -> Status {
    pools_[r].reset();
    return Status::Ok();
  });
}

Status NcclThreadGroup::Run(const std::function<Status(int rank)>& fn) {
  return FirstError(OnThreads(size(), [&](int r) -> Status {
    // An exception must fail this rank like an error, not end the process.
    Status s = CallCatching("rank " + std::to_string(r), [&] { return fn(r); });
    if (!s.ok()) {
      for (auto& p : pools_) p->Abort();
    }
    return s;
  }));
}

}  // namespace tpserve
