// Validation of a KServe v2 ModelInferRequest against tpserve's model
// interface (see server/inference_server.h). Pure: no server state, so it is
// unit-tested and fuzzed on its own.
#pragma once

#include <cstdint>
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

// INVALID_ARGUMENT naming the input, the expected and the actual value for
// anything malformed (model name and version are checked by the caller).
StatusOr<ParsedRequest> ValidateInferRequest(const inference::ModelInferRequest& q,
                                             const RequestLimits& limits);

}  // namespace tpserve
