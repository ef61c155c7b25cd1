// Validation of a KServe v2 ModelInferRequest against tpserve's model
// interface (see server/inference_server.h). Pure: no server state, so it is
// unit-tested and fuzzed on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "comm/status.h"
#include "proto/grpc_service.pb.h"

namespace tpserve {

struct RequestLimits {
  int64_t vocab = 0;       // ids must be in [0, vocab)
  int64_t max_tokens = 0;  // longest sequence accepted
};

// A validated request: the token ids and how to answer.
struct ParsedRequest {
  std::vector<int32_t> ids;
  bool batched_shape = false;  // input was [1, n]: outputs get a leading 1
  bool want_logits = true, want_next = true;
};

// A client-supplied string as it may appear in an error message or a log
// line: control characters and non-ASCII bytes escaped (\n, \xNN), and cut
// after kClientTextMax bytes with the full length noted, so that a long name
// cannot push a status past the client's metadata limit or flood the log.
constexpr size_t kClientTextMax = 128;
std::string ClientText(std::string_view s);

// INVALID_ARGUMENT naming the input, the expected and the actual value for
// anything malformed (model name and version are checked by the caller).
// Parameters (request, input or output) are refused naming the key, and
// ignoring one (e.g. an output's "classification") would answer something
// other than what was asked; except the two that KServe's and Triton's Python
// clients send by default: the input's binary_data_size (an int64, which must
// equal the raw contents' size) and an output's binary_data (a bool: over gRPC
// outputs are always raw_output_contents).
StatusOr<ParsedRequest> ValidateInferRequest(const inference::ModelInferRequest& q,
                                             const RequestLimits& limits);

}  // namespace tpserve
