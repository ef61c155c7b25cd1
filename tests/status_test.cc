#include "comm/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace tpserve {
namespace {

TEST(Status, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(Status, ErrorCarriesCodeAndMessage) {
  Status s = InvalidArgumentError("input 'input_ids' has shape [3,4]");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "INVALID_ARGUMENT: input 'input_ids' has shape [3,4]");
}

TEST(Status, CodesMatchGrpcNumbering) {
  // server/ converts by value; these are grpc::StatusCode's numbers.
  EXPECT_EQ(static_cast<int>(StatusCode::kInvalidArgument), 3);
  EXPECT_EQ(static_cast<int>(StatusCode::kDeadlineExceeded), 4);
  EXPECT_EQ(static_cast<int>(StatusCode::kNotFound), 5);
  EXPECT_EQ(static_cast<int>(StatusCode::kResourceExhausted), 8);
  EXPECT_EQ(static_cast<int>(StatusCode::kAborted), 10);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 14);
  EXPECT_EQ(StatusCodeName(StatusCode::kUnavailable), "UNAVAILABLE");
}

TEST(Status, WithContextPrefixesErrorsOnly) {
  EXPECT_TRUE(Status::Ok().WithContext("loading").ok());
  Status s = NotFoundError("no such file").WithContext("model.safetensors");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "model.safetensors: no such file");
}

Status FailIf(bool fail) {
  if (fail) return InternalError("boom");
  return Status::Ok();
}

Status Chain(bool fail, int* reached) {
  TP_RETURN_IF_ERROR(FailIf(fail));
  *reached = 1;
  return Status::Ok();
}

TEST(Status, ReturnIfErrorStopsAtFirstError) {
  int reached = 0;
  EXPECT_EQ(Chain(true, &reached).code(), StatusCode::kInternal);
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(Chain(false, &reached).ok());
  EXPECT_EQ(reached, 1);
}

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError(std::to_string(x) + " is odd");
  return x / 2;
}

StatusOr<int> Quarter(int x) {
  TP_ASSIGN_OR_RETURN(int h, Half(x));
  TP_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusOr, HoldsValueOrError) {
  StatusOr<int> ok = Half(8);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 4);
  StatusOr<int> bad = Half(3);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "3 is odd");
}

TEST(StatusOr, AssignOrReturnPropagates) {
  EXPECT_EQ(*Quarter(12), 3);
  StatusOr<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "3 is odd");
}

TEST(StatusOr, FromOkStatusBecomesInternalError) {
  StatusOr<int> r(Status::Ok());
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(StatusOr, HoldsMoveOnlyValues) {
  StatusOr<std::unique_ptr<int>> r(std::make_unique<int>(7));
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 7);
}

}  // namespace
}  // namespace tpserve
