#include "comm/cuda_check.h"

#include <spdlog/spdlog.h>

#include <string>

namespace tpserve {
namespace {

thread_local int g_current_rank = -1;

std::string Where(const char* expr, const char* file, int line) {
  std::string s = "`";
  s += expr;
  s += "` at ";
  s += file;
  s += ":";
  s += std::to_string(line);
  s += " (rank ";
  s += g_current_rank < 0 ? std::string("?") : std::to_string(g_current_rank);
  s += ")";
  return s;
}

}  // namespace

void SetCurrentRank(int rank) { g_current_rank = rank; }
int CurrentRank() { return g_current_rank; }

Status CudaCallError(cudaError_t err, const char* expr, const char* file, int line) {
  const StatusCode code =
      err == cudaErrorMemoryAllocation ? StatusCode::kResourceExhausted : StatusCode::kInternal;
  return Status(code, std::string("CUDA error ") + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ") in " + Where(expr, file, line));
}

Status CublasCallError(cublasStatus_t err, const char* expr, const char* file, int line) {
  StatusCode code = StatusCode::kInternal;
  if (err == CUBLAS_STATUS_NOT_SUPPORTED) code = StatusCode::kUnimplemented;
  if (err == CUBLAS_STATUS_INVALID_VALUE) code = StatusCode::kInvalidArgument;
  if (err == CUBLAS_STATUS_ALLOC_FAILED) code = StatusCode::kResourceExhausted;
  return Status(code, std::string("cuBLASLt error ") + cublasLtGetStatusName(err) + " (" +
                          cublasLtGetStatusString(err) + ") in " + Where(expr, file, line));
}

Status NcclCallError(ncclResult_t err, ncclComm_t comm, const char* expr, const char* file,
                     int line) {
  StatusCode code = StatusCode::kInternal;
  if (err == ncclInvalidArgument || err == ncclInvalidUsage) {
    code = StatusCode::kInvalidArgument;
  } else if (err == ncclRemoteError || err == ncclSystemError) {
    code = StatusCode::kUnavailable;
  }
  std::string msg =
      std::string("NCCL error ") + ncclGetErrorString(err) + " in " + Where(expr, file, line);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') {
    msg += "; NCCL says: ";
    msg += last;
  }
  return Status(code, std::move(msg));
}

void LogCallError(const Status& status) { spdlog::error("{}", status.message()); }

}  // namespace tpserve
