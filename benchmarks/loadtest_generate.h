// tpserve-loadtest --mode generate: token generation requests in the protocol of Triton's
// TensorRT-LLM backend (inputs input_ids, input_lengths, request_output_len, ...; outputs
// output_ids, sequence_length), unary (ModelInfer, one response per request) or streamed
// (ModelStreamInfer: a response per engine step carrying the new tokens, the last one marked
// by the parameter triton_final_response; requests multiplexed on a stream by id, up to
// --requests-per-stream of them on each).
//
// Every request asks for exclude_input_in_output, so that output_ids holds only generated
// tokens; a response longer than request_output_len (or, ignoring the end token, shorter)
// counts as an error, so that a server that answers wrongly is not measured as fast.
#pragma once

#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/loadtest_driver.h"
#include "benchmarks/loadtest_generate_stats.h"
#include "proto/grpc_service.grpc.pb.h"

namespace tpserve::loadtest {

// The generation flags (validated by the function AddGenerateFlags returns).
struct GenerateOptions {
  // "logits" (one ModelInfer per prompt, answered with the next token's logits) or
  // "generate" (everything below).
  std::string mode = "logits";
  // Output tokens per request: "N" or "MIN:MAX", drawn uniformly per request (seeded).
  std::string output_len_spec = "128";
  OutputLen output_len{128, 128};
  // Stop only at request_output_len (no end_id sent); off when end_id is given.
  bool ignore_eos = true;
  // The end token id to send (stops a sequence early); < 0: none.
  int64_t end_id = -1;
  // ModelStreamInfer with a response per step (TTFT and ITL observable), else ModelInfer.
  bool streaming = true;
  // Most requests in flight on one stream; beyond, the client opens another (tpserve reads
  // at most --max-requests-per-stream, 64 by default, in progress from one stream).
  int64_t requests_per_stream = 64;
  // Goodput's objectives; unset ones do not constrain.
  Slo slo;
};

// Registers --mode, --output-len, --ignore-eos, --end-id, --streaming/--no-streaming,
// --requests-per-stream, --slo-ttft-ms and --slo-tpot-ms on `app`, writing into *o. The returned
// function, called after parsing, finishes *o (output_len, ignore_eos) and returns a usage error or
// "".
std::function<std::string()> AddGenerateFlags(CLI::App& app, GenerateOptions* o);

// "" when `model` at `stub` takes the generation inputs (request_output_len and
// `input_name`), else why not: a server without generation answers --mode generate this way
// before any load runs.
std::string CheckGenerationModel(inference::GRPCInferenceService::Stub* stub,
                                 const std::string& model, const std::string& input_name);

// One prompt's token ids as INT32 bytes (the raw contents of its input tensor).
struct PromptIds {
  const std::string* raw_int32 = nullptr;
  int64_t tokens = 0;
};

// The driver of generation requests: a request per prompt (cycled, with the output length
// drawn from `seed`), each ending after `timeout_ms` at the latest (DEADLINE_EXCEEDED).
std::unique_ptr<LoadDriver> MakeGenerateDriver(std::shared_ptr<grpc::Channel> channel,
                                               const std::string& model,
                                               const std::string& input_name,
                                               const std::vector<PromptIds>& prompts,
                                               const GenerateOptions& o, int64_t timeout_ms,
                                               uint64_t seed);

// Adds a step's generation figures (TTFT, TPOT, ITL, token rates, goodput) to its JSON result
// `r`, from the reported windows.
void AddGenerateFields(const std::vector<Window>& windows, const GenerateOptions& o,
                       nlohmann::json* r);
// The names of those figures, in the CSV's column order.
const std::vector<std::string>& GenerateFields();
// The run's generation settings, for the report's meta.
nlohmann::json GenerateMeta(const GenerateOptions& o);
// A line of a step's generation figures, and the sweep's table of them.
std::string GenerateStepLine(const nlohmann::json& r);
void PrintGenerateTable(const std::string& key, const nlohmann::json& steps);

}  // namespace tpserve::loadtest
