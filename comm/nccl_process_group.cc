#include "comm/nccl_process_group.h"

#include <signal.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

#include "comm/cuda_check.h"
#include "comm/nccl_bootstrap.h"
#include "comm/nccl_thread_group.h"

namespace tpserve {

StatusOr<std::unique_ptr<NcclProcessGroup>> NcclProcessGroup::Create(
    const std::vector<std::string>& argv, int n, std::chrono::milliseconds timeout) {
  if (n < 1)
    return InvalidArgumentError("process group: size must be >= 1, got " + std::to_string(n));
  if (argv.empty()) return InvalidArgumentError("process group: empty argument vector");
  auto group = std::unique_ptr<NcclProcessGroup>(new NcclProcessGroup());
  group->size_ = n;
  ncclUniqueId id{};
  const StatusOr<RankInfo> env = RankInfoFromEnv();
  if (env.ok()) {
    // A copy the leader started.
    if (env->world_size != n) {
      return InvalidArgumentError("process group: the environment (" + env->source + ") says " +
                                  std::to_string(env->world_size) + " ranks, the program " +
                                  std::to_string(n));
    }
    TP_ASSIGN_OR_RETURN(id, UniqueIdFromEnv());
    group->rank_ = env->rank;
    group->device_ = env->local_rank;
    SetCurrentRank(group->rank_);
  } else if (env.status().code() == StatusCode::kNotFound) {
    const int devices = CudaDeviceCount();
    if (devices < n) {
      return FailedPreconditionError("process group: " + std::to_string(n) + " ranks need " +
                                     std::to_string(n) + " GPUs on this node, found " +
                                     std::to_string(devices));
    }
    TP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    std::vector<std::string> child = argv;
    child[0] = "/proc/self/exe";
    TP_ASSIGN_OR_RETURN(group->workers_, SpawnLocalWorkers(child, n, id));
    if (n > 1) spdlog::info("rank 0 started {} worker process(es)", n - 1);
  } else {
    return env.status();
  }
  TP_CUDA_CHECK(cudaSetDevice(group->device_));
  auto comm =
      NcclCommunicator::Create(id, n, group->rank_, group->device_, NcclCommConfig{}, timeout);
  if (!comm.ok()) return comm.status();  // the destructor stops the workers
  group->pool_ = std::make_unique<NcclCommPool>(std::move(comm).value());
  return group;
}

NcclProcessGroup::~NcclProcessGroup() {
  pool_.reset();
  if (workers_.empty()) return;
  for (pid_t pid : workers_) ::kill(pid, SIGTERM);
  const Status s = ReapWorkers(workers_, std::chrono::seconds(10));
  if (!s.ok()) spdlog::warn("process group: {}", s.ToString());
}

NcclCommPool& NcclProcessGroup::pool(int rank) {
  if (rank != rank_) {
    spdlog::critical("process group: rank {} asked for rank {}'s communicators", rank_, rank);
    std::abort();
  }
  return *pool_;
}

Status NcclProcessGroup::Run(const std::function<Status(int rank)>& fn) {
  if (!pool_) return FailedPreconditionError("process group: already finished");
  SetCurrentRank(rank_);
  TP_CUDA_CHECK(cudaSetDevice(device_));
  Status s = fn(rank_);
  if (!s.ok()) pool_->Abort();
  return s;
}

Status NcclProcessGroup::Finish(std::chrono::seconds timeout) {
  pool_.reset();
  std::vector<pid_t> workers;
  workers.swap(workers_);
  if (workers.empty()) return Status::Ok();
  return ReapWorkers(workers, timeout);
}

StatusOr<std::unique_ptr<RankGroup>> CreateRankGroup(std::string_view kind,
                                                     const std::vector<std::string>& argv, int n,
                                                     std::chrono::milliseconds timeout) {
  if (kind == "threads") {
    TP_ASSIGN_OR_RETURN(auto g, NcclThreadGroup::Create(n, timeout));
    return std::unique_ptr<RankGroup>(std::move(g));
  }
  if (kind == "processes") {
    TP_ASSIGN_OR_RETURN(auto g, NcclProcessGroup::Create(argv, n, timeout));
    return std::unique_ptr<RankGroup>(std::move(g));
  }
  return InvalidArgumentError("rank group: unknown kind '" + std::string(kind) +
                              "' (threads or processes)");
}

}  // namespace tpserve
