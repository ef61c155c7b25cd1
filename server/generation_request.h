// Validation of a generation request in the tensor names of Triton's
// TensorRT-LLM backend, so that its clients (and perf tools such as
// genai-perf) work unchanged. Pure: unit-tested and fuzzed on its own.
//
// Inputs (a request is a generation request when it has request_output_len):
//   input_ids           INT32 (INT64 accepted)  [1, n] or [n]   the prompt
//   request_output_len  INT32  one value   tokens to generate at most
//   input_lengths       INT32  one value   optional; must equal n
//   end_id              INT32  one value   optional; stop when sampled (not returned)
//   pad_id              INT32  one value   optional; accepted, unused (no padding here)
//   streaming           BOOL   one value   optional; a response per step (ModelStreamInfer)
//   temperature         FP32   one value   optional, default 0 (greedy)
//   runtime_top_k       INT32  one value   optional, default 0 (no cut)
//   runtime_top_p       FP32   one value   optional, default 1 (no cut)
//   seed | random_seed  UINT64 one value   optional; default: the request's own
//   stop_words_list     INT32  [1, 2, L]   optional; row 0 the words' tokens back to
//                                          back, row 1 each word's end offset, -1 padded
//   return_log_probs    BOOL   one value   optional
//   exclude_input_in_output BOOL one value optional (default false: output_ids starts
//                                          with the prompt, as TensorRT-LLM's does)
// "One value": shape [1, 1], [1] or []. Contents raw (one raw_input_contents
// entry per input) or typed in the datatype's contents field.
// Outputs: output_ids INT32 [1, 1, T], sequence_length INT32 [1, 1],
// output_log_probs FP32 [1, 1, G] (when asked for; G generated tokens).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "comm/status.h"
#include "engine/scheduler.h"
#include "proto/grpc_service.pb.h"

namespace tpserve {

// Whether the request has an input named request_output_len.
bool IsGenerationRequest(const inference::ModelInferRequest& q);

struct GenerationRequest {
  std::vector<int32_t> prompt;
  GenerationParams params;
  bool seeded = false;  // a seed was given
  bool streaming = false;
  bool exclude_input = false;
  bool want_output_ids = true, want_sequence_length = true, want_log_probs = false;
};

// INVALID_ARGUMENT naming the tensor, what it needs and what it got, for
// anything malformed: unknown inputs or outputs, wrong datatype or shape,
// contents that disagree with the shape, input_lengths that disagree with
// input_ids, values out of range (a negative request_output_len, top_p
// outside (0, 1], a negative temperature or top_k). Ranges that depend on the
// model and the cache (vocabulary, positions, cache size) are checked by the
// Scheduler when the request is queued. `max_prompt` bounds input_ids.
StatusOr<GenerationRequest> ValidateGenerationRequest(const inference::ModelInferRequest& q,
                                                      int64_t max_prompt);

}  // namespace tpserve
