// Checked calls for the CUDA runtime, cuBLASLt and NCCL.
//
// TP_CUDA_CHECK(expr), TP_CUBLAS_CHECK(expr), TP_NCCL_CHECK(expr, comm) return
// a non-OK Status from the enclosing function (which returns Status or
// StatusOr<T>) when the call fails. The message records the expression,
// file:line, the calling thread's rank (SetCurrentRank) and, for NCCL,
// ncclGetLastError(comm). The *_LOG variants only log (for destructors).
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "comm/status.h"

namespace tpserve {

// The rank this thread works for, recorded in error messages (-1: unset).
void SetCurrentRank(int rank);
int CurrentRank();

Status CudaCallError(cudaError_t err, const char* expr, const char* file, int line);
Status CublasCallError(cublasStatus_t err, const char* expr, const char* file, int line);
// `comm` may be nullptr; then NCCL's last error of this thread is reported.
Status NcclCallError(ncclResult_t err, ncclComm_t comm, const char* expr, const char* file,
                     int line);

}  // namespace tpserve

#define TP_CUDA_CHECK(expr)                                                \
  do {                                                                     \
    const cudaError_t tp_err_ = (expr);                                    \
    if (tp_err_ != cudaSuccess)                                            \
      return ::tpserve::CudaCallError(tp_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define TP_CUBLAS_CHECK(expr)                                                \
  do {                                                                       \
    const cublasStatus_t tp_err_ = (expr);                                   \
    if (tp_err_ != CUBLAS_STATUS_SUCCESS)                                    \
      return ::tpserve::CublasCallError(tp_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// ncclInProgress is success for non-blocking communicators: completion is
// observed later through ncclCommGetAsyncError.
#define TP_NCCL_CHECK(expr, comm)                                                  \
  do {                                                                             \
    const ncclResult_t tp_err_ = (expr);                                           \
    if (tp_err_ != ncclSuccess && tp_err_ != ncclInProgress)                       \
      return ::tpserve::NcclCallError(tp_err_, (comm), #expr, __FILE__, __LINE__); \
  } while (0)

// Logging variants for paths that cannot return (destructors, cleanup).
#define TP_CUDA_LOG(expr)                                                                    \
  do {                                                                                       \
    const cudaError_t tp_err_ = (expr);                                                      \
    if (tp_err_ != cudaSuccess)                                                              \
      ::tpserve::LogCallError(::tpserve::CudaCallError(tp_err_, #expr, __FILE__, __LINE__)); \
  } while (0)

#define TP_NCCL_LOG(expr, comm)                                                  \
  do {                                                                           \
    const ncclResult_t tp_err_ = (expr);                                         \
    if (tp_err_ != ncclSuccess && tp_err_ != ncclInProgress)                     \
      ::tpserve::LogCallError(                                                   \
          ::tpserve::NcclCallError(tp_err_, (comm), #expr, __FILE__, __LINE__)); \
  } while (0)

#define TP_CUBLAS_LOG(expr)                                                                    \
  do {                                                                                         \
    const cublasStatus_t tp_err_ = (expr);                                                     \
    if (tp_err_ != CUBLAS_STATUS_SUCCESS)                                                      \
      ::tpserve::LogCallError(::tpserve::CublasCallError(tp_err_, #expr, __FILE__, __LINE__)); \
  } while (0)

namespace tpserve {
void LogCallError(const Status& status);
}  // namespace tpserve
