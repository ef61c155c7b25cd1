// The inference RPCs as gRPC callback reactors: no thread and no timer per
// waiting request. A request's completion (the batcher's or the generator's
// callback) answers it; a cancelled RPC or closed stream cancels its requests
// in the batcher or the generator.
//
// Both RPCs take their messages as raw bytes and parse them here, so that an
// undecodable message is answered with INVALID_ARGUMENT naming the problem
// (in a stream: an error response, and the stream goes on) instead of
// gRPC's own empty INTERNAL or a silently ended stream.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "engine/engine.h"
#include "engine/generator.h"
#include "server/batcher.h"
#include "server/request_validation.h"
#include "server/serving_metrics.h"

namespace tpserve {

// An open stream, as the drain sees it.
class DrainableStream {
 public:
  virtual ~DrainableStream() = default;
  // No more reads; the stream ends once its requests are answered.
  virtual void Drain() = 0;
};

// What the reactors share: the backends, the limits, the counters. Owned by
// the service; outlives every call.
struct ServingContext {
  std::string model_name;
  const ModelConfig* config = nullptr;
  RequestLimits limits;
  TokenBatcher* batcher = nullptr;
  Generator* generator = nullptr;  // null: the backend has no generation
  size_t max_streams = 256;
  size_t max_requests_per_stream = 64;  // in progress on one stream; reading pauses beyond

  ServingMetrics metrics;
  std::atomic<uint64_t> success_count{0}, fail_count{0}, success_ns{0}, queue_ns{0}, compute_ns{0},
      last_inference_ms{0};
  std::atomic<bool> draining{false};
  std::atomic<int64_t> open_streams{0};
  std::atomic<int64_t> calls_in_progress{0};  // unary calls and streams not yet finished

  // Ends every open stream's reading (their requests still finish).
  void DrainStreams();
  void AddStream(DrainableStream* s);
  void RemoveStream(DrainableStream* s);

  // NOT_FOUND for another model or version.
  Status CheckModel(const std::string& name, const std::string& version) const;
  // Logs a failed request: client-caused failures at most a few lines a
  // second (clients control their volume), server failures always.
  void LogFailure(const char* rpc, const std::string& id, const Status& s);

 private:
  std::atomic<int64_t> log_window_{0};
  std::atomic<int> logged_in_window_{0};
  std::atomic<uint64_t> suppressed_{0};
  std::mutex streams_mu_;
  std::set<DrainableStream*> streams_;
};

// The reactor of one ModelInfer call (deletes itself when done).
grpc::ServerUnaryReactor* StartUnaryCall(ServingContext& ctx, grpc::CallbackServerContext* call,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response);

// The reactor of one ModelStreamInfer call (deletes itself when done).
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartStreamCall(
    ServingContext& ctx, grpc::CallbackServerContext* call);

}  // namespace tpserve
