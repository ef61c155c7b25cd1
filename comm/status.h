// Status and StatusOr<T>: the error currency of tpserve.
//
// Fallible functions return Status or StatusOr<T>; both are [[nodiscard]].
// No exceptions cross module boundaries. server/ maps StatusCode onto
// grpc::StatusCode one to one (the numeric values are the same on purpose).
#pragma once

#include <cassert>
#include <exception>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace tpserve {

// Values match grpc::StatusCode so that server/ can convert without a table.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "INVALID_ARGUMENT: message" (or "OK").
  std::string ToString() const;

  // Returns a copy whose message is "context: message"; OK stays OK.
  Status WithContext(std::string_view context) const;

  // Explicitly drops a status where ignoring it is the right thing to do
  // (e.g. a best-effort cleanup path that already reports the first error).
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status CancelledError(std::string message);
Status InvalidArgumentError(std::string message);
Status DeadlineExceededError(std::string message);
Status NotFoundError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status AbortedError(std::string message);
Status OutOfRangeError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);
Status UnavailableError(std::string message);

// Holds either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  // A StatusOr made from an OK status is a programming error; it is turned
  // into an INTERNAL error instead of a value-less "OK".
  StatusOr(Status status) : v_(std::move(status)) {  // NOLINT: implicit
    if (std::get<Status>(v_).ok()) {
      v_ = Status(StatusCode::kInternal, "StatusOr constructed from OK status");
    }
  }
  StatusOr(T value) : v_(std::move(value)) {}  // NOLINT: implicit

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  // Precondition: ok().
  T& value() & {
    assert(ok());
    return std::get<T>(v_);
  }
  const T& value() const& {
    assert(ok());
    return std::get<T>(v_);
  }
  T&& value() && {
    assert(ok());
    return std::get<T>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> v_;
};

// fn() (returning a Status or StatusOr) with any exception it throws turned
// into INTERNAL "<what> threw: ...": for threads that must fail like any
// other error (a rank, the batcher) instead of ending the process.
template <typename F>
auto CallCatching(std::string_view what, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return InternalError(std::string(what) + " threw: " + e.what());
  } catch (...) {
    return InternalError(std::string(what) + " threw a non-standard exception");
  }
}

}  // namespace tpserve

#define TP_STATUS_CONCAT_INNER(a, b) a##b
#define TP_STATUS_CONCAT(a, b) TP_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (a Status); returns it from the current function if not OK.
#define TP_RETURN_IF_ERROR(expr) \
  TP_RETURN_IF_ERROR_IMPL(TP_STATUS_CONCAT(tp_status_, __COUNTER__), expr)
#define TP_RETURN_IF_ERROR_IMPL(var, expr) \
  do {                                     \
    ::tpserve::Status var = (expr);        \
    if (!var.ok()) return var;             \
  } while (0)

// `lhs` = value of `expr` (a StatusOr<T>), or returns its error.
#define TP_ASSIGN_OR_RETURN(lhs, expr) \
  TP_ASSIGN_OR_RETURN_IMPL(TP_STATUS_CONCAT(tp_statusor_, __COUNTER__), lhs, expr)
#define TP_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
