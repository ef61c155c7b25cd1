// InferenceServer: the KServe v2 (Open Inference Protocol) gRPC server in
// front of an engine, with the token batcher, grpc.health.v1 and statistics.
//
// Model interface (model name = ServerOptions::model_name, version "1"):
//   input  `input_ids`     INT32 (INT64 accepted), shape [n] or [1, n]
//   output `logits`        FP32, the last position, shape [vocab] or [1, vocab]
//   output `next_token_id` INT32, shape [1] or [1, 1] (argmax of the logits)
// Outputs follow the input's rank; requested outputs are honoured (default:
// both); input contents may be raw (raw_input_contents) or typed; outputs are
// returned as raw_output_contents.
// Generation (when the engine has a KV cache): a request with
// `request_output_len` generates tokens, in the tensor names of Triton's
// TensorRT-LLM backend (server/generation_request.h); ModelInfer answers with
// the whole generation, ModelStreamInfer with `streaming` true sends a
// response per step and marks the last with the parameter
// triton_final_response = true (Triton's decoupled convention).
// ModelInfer and ModelStreamInfer are gRPC callbacks (server/infer_calls.h):
// a waiting request holds no thread.
//
// Errors: unknown model or version -> NOT_FOUND; malformed input ->
// INVALID_ARGUMENT naming the input, expected and actual; full queue ->
// RESOURCE_EXHAUSTED; client deadline/cancellation honoured; shutting down ->
// UNAVAILABLE. Nothing a client sends can crash the server.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "engine/engine.h"
#include "engine/generator.h"
#include "server/batcher.h"

namespace tpserve {

struct ServerOptions {
  std::string model_name = "tpserve";           // the name clients address
  std::string grpc_address = "127.0.0.1:8001";  // host:port; port 0 picks a free port
  int64_t max_tokens_per_request = 4096;
  // Open ModelStreamInfer streams beyond this get RESOURCE_EXHAUSTED.
  size_t max_streams = 1024;
  // Requests in progress on one stream; beyond, the stream is not read until
  // one finishes (back-pressure on that client alone).
  size_t max_requests_per_stream = 64;
  // HTTP/2 streams (calls) one connection may have open at once.
  int64_t max_streams_per_connection = 1024;
  // gRPC's buffers (messages received and to send) at most this much memory;
  // 0: no quota.
  int64_t grpc_memory_bytes = int64_t{1} << 30;
  BatcherOptions batcher;
  // Generation (when the engine has a KV cache): step budget and limits;
  // the queue limit is batcher.max_queue_size.
  GeneratorOptions generation;
  // TLS: PEM files. Certificate and key together turn TLS on; a client CA
  // additionally requires and verifies client certificates (mutual TLS).
  std::string tls_cert_file, tls_key_file, tls_client_ca_file;
};

class InferenceService;

// "host:port" for gRPC's listening address: an IPv6 host (it contains ':')
// goes in brackets unless it already is ("::1" -> "[::1]:8001").
std::string GrpcListenAddress(std::string_view host, int port);

// `v` escaped for a Prometheus label value (backslash, double quote and
// newline, as the text exposition format requires).
std::string PrometheusLabelValue(std::string_view v);

class InferenceServer {
 public:
  // Starts serving `engine` (kept alive by the server). Health is SERVING
  // once this returns.
  static StatusOr<std::unique_ptr<InferenceServer>> Start(ServerOptions options,
                                                          std::shared_ptr<Engine> engine);
  ~InferenceServer();  // Shutdown(now) if still running

  int port() const { return port_; }

  // Graceful stop: health NOT_SERVING, no new RPCs, accepted requests finish
  // (the batcher drains) until `deadline`, after which the rest is cancelled.
  void Shutdown(std::chrono::system_clock::time_point deadline);

  // Prometheus text exposition of the server's counters.
  std::string MetricsText() const;

 private:
  InferenceServer() = default;
  std::shared_ptr<Engine> engine_;
  std::unique_ptr<TokenBatcher> batcher_;
  std::unique_ptr<Generator> generator_;
  std::unique_ptr<InferenceService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::atomic<bool> stopped_{false};
  // Turns health NOT_SERVING when the engine fails between requests.
  std::thread health_watch_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
};

}  // namespace tpserve
