// The checked-call macros need no GPU: error codes are mapped on the host.
#include "comm/cuda_check.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tpserve {
namespace {

using ::testing::HasSubstr;

Status FailingCuda() {
  TP_CUDA_CHECK(cudaErrorInvalidValue);
  return Status::Ok();
}
Status FailingCudaOom() {
  TP_CUDA_CHECK(cudaErrorMemoryAllocation);
  return Status::Ok();
}
Status FailingCublas() {
  TP_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED);
  return Status::Ok();
}
Status FailingNccl() {
  TP_NCCL_CHECK(ncclInvalidArgument, nullptr);
  return Status::Ok();
}
Status NcclInProgressIsNotAnError() {
  TP_NCCL_CHECK(ncclInProgress, nullptr);
  return Status::Ok();
}
StatusOr<int> CheckInStatusOrFunction() {
  TP_CUDA_CHECK(cudaErrorInvalidDevice);
  return 1;
}

TEST(CudaCheck, RecordsExpressionFileLineAndRank) {
  SetCurrentRank(3);
  Status s = FailingCuda();
  SetCurrentRank(-1);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("cudaErrorInvalidValue"));
  EXPECT_THAT(s.message(), HasSubstr("`cudaErrorInvalidValue`"));
  EXPECT_THAT(s.message(), HasSubstr("cuda_check_test.cc:"));
  EXPECT_THAT(s.message(), HasSubstr("(rank 3)"));
}

TEST(CudaCheck, OutOfMemoryIsResourceExhausted) {
  EXPECT_EQ(FailingCudaOom().code(), StatusCode::kResourceExhausted);
}

TEST(CudaCheck, UnsetRankIsShownAsUnknown) {
  SetCurrentRank(-1);
  EXPECT_THAT(FailingCuda().message(), HasSubstr("(rank ?)"));
}

TEST(CudaCheck, CublasErrorsAreMapped) {
  Status s = FailingCublas();
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("CUBLAS_STATUS_NOT_SUPPORTED"));
}

TEST(CudaCheck, NcclErrorsAreMappedAndInProgressPasses) {
  Status s = FailingNccl();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("NCCL error"));
  EXPECT_TRUE(NcclInProgressIsNotAnError().ok());
}

TEST(CudaCheck, WorksInFunctionsReturningStatusOr) {
  StatusOr<int> r = CheckInStatusOrFunction();
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("cudaErrorInvalidDevice"));
}

}  // namespace
}  // namespace tpserve
