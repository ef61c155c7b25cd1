#include "server/infer_calls.h"

#include <grpcpp/support/proto_buffer_reader.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <set>

#include "proto/grpc_service.grpc.pb.h"
#include "server/generation_request.h"

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kVersion[] = "1";

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

uint64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

bool ClientCaused(StatusCode c) {
  return c == StatusCode::kInvalidArgument || c == StatusCode::kNotFound ||
         c == StatusCode::kDeadlineExceeded || c == StatusCode::kCancelled ||
         c == StatusCode::kResourceExhausted || c == StatusCode::kFailedPrecondition;
}

void CountRejection(ServingContext& ctx, const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      ctx.metrics.Reject(RejectReason::kInvalidArgument);
      break;
    case StatusCode::kNotFound:
      ctx.metrics.Reject(RejectReason::kNotFound);
      break;
    case StatusCode::kResourceExhausted:
      ctx.metrics.Reject(RejectReason::kQueueFull);
      break;
    default:
      ctx.metrics.Reject(ctx.draining.load() ? RejectReason::kShuttingDown
                                             : RejectReason::kUnavailable);
  }
}

// Parses raw request bytes; INVALID_ARGUMENT naming the problem.
Status ParseRequest(const grpc::ByteBuffer& bytes, inference::ModelInferRequest* q) {
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(&bytes));
  if (!q->ParseFromZeroCopyStream(&reader)) {
    return InvalidArgumentError("the message (" + std::to_string(bytes.Length()) +
                                " bytes) is not a valid inference.ModelInferRequest");
  }
  return Status::Ok();
}

template <class Message>
void Serialize(const Message& m, grpc::ByteBuffer* out) {
  out->Clear();  // the serializer takes an empty buffer (a stream reuses its write buffer)
  bool own = false;
  grpc::Status s = grpc::SerializationTraits<Message>::Serialize(m, out, &own);
  if (!s.ok()) spdlog::error("serializing a response: {}", s.error_message());
}

template <class T>
void AddOutput(inference::ModelInferResponse* r, const char* name, const char* dtype,
               std::initializer_list<int64_t> shape, const std::vector<T>& values) {
  auto* o = r->add_outputs();
  o->set_name(name);
  o->set_datatype(dtype);
  for (int64_t d : shape) o->add_shape(d);
  r->add_raw_output_contents(
      std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
}

// A reply to one request: a complete response, or (streamed generation) new
// tokens that the stream turns into a response when it sends it.
struct Reply {
  Status error;  // non-OK: an error reply, always final
  bool final = true;
  inference::ModelInferResponse response;  // when !delta
  bool delta = false;
  std::vector<int32_t> tokens;
  std::vector<float> log_probs;
  std::string finish_reason;
};

class Request;

// Where a request's replies go.
class Sink {
 public:
  virtual ~Sink() = default;
  // Called from the batcher's or the generator's thread (or the caller's, for
  // an immediate error); must not block. After a final reply, no other.
  virtual void Deliver(const std::shared_ptr<Request>& request, Reply reply) = 0;
};

// One request in progress.
class Request : public std::enable_shared_from_this<Request> {
 public:
  // `peer`: the client's address, for the batcher's fair sharing.
  Request(ServingContext& ctx, std::string id, Sink* sink, bool in_stream, std::string peer)
      : ctx_(ctx), id_(std::move(id)), sink_(sink), in_stream_(in_stream), peer_(std::move(peer)) {}

  const std::string& id() const { return id_; }

  // Validates and queues. A non-OK status means nothing was queued and no
  // reply will come.
  Status Start(const inference::ModelInferRequest& q, Clock::time_point deadline) {
    TP_RETURN_IF_ERROR(ctx_.CheckModel(q.model_name(), q.model_version()));
    if (ctx_.draining.load()) {
      return UnavailableError("the server is shutting down: send the request to another replica");
    }
    return IsGenerationRequest(q) ? StartGeneration(q, deadline) : StartLogits(q, deadline);
  }

  void Cancel() {
    cancelled_->store(true);
    if (const uint64_t id = generation_id_.load(); id != 0) {
      ctx_.generator->Cancel(id);
    } else {
      ctx_.batcher->Wake();
    }
  }

 private:
  Status StartLogits(const inference::ModelInferRequest& q, Clock::time_point deadline) {
    TP_ASSIGN_OR_RETURN(ParsedRequest p, ValidateInferRequest(q, ctx_.limits));
    auto self = shared_from_this();
    return ctx_.batcher->Submit(
        p.ids, deadline, cancelled_,
        [self, p](StatusOr<BatchResult> r) { self->FinishLogits(p, std::move(r)); }, peer_);
  }

  void FinishLogits(const ParsedRequest& p, StatusOr<BatchResult> result) {
    Reply reply;
    if (!result.ok()) {
      reply.error = result.status();
      return Send(std::move(reply));
    }
    auto& r = reply.response;
    Header(&r);
    const int64_t vocab = ctx_.config->vocab_size;
    if (p.want_logits) {
      auto* o = r.add_outputs();
      o->set_name("logits");
      o->set_datatype("FP32");
      if (p.batched_shape) o->add_shape(1);
      o->add_shape(vocab);
      r.add_raw_output_contents(std::string(reinterpret_cast<const char*>(result->logits.data()),
                                            result->logits.size() * sizeof(float)));
    }
    if (p.want_next) {
      const int32_t next = static_cast<int32_t>(
          std::max_element(result->logits.begin(), result->logits.end()) - result->logits.begin());
      auto* o = r.add_outputs();
      o->set_name("next_token_id");
      o->set_datatype("INT32");
      if (p.batched_shape) o->add_shape(1);
      o->add_shape(1);
      r.add_raw_output_contents(std::string(reinterpret_cast<const char*>(&next), sizeof next));
    }
    ctx_.queue_ns += result->queue_ns;
    ctx_.compute_ns += result->compute_ns;
    Send(std::move(reply));
  }

  Status StartGeneration(const inference::ModelInferRequest& q, Clock::time_point deadline) {
    if (ctx_.generator == nullptr) {
      return FailedPreconditionError(
          "this server has no token generation (the backend has no KV cache: start it with "
          "--kv-cache-gib > 0 on the CPU backend); send input_ids alone for logits");
    }
    TP_ASSIGN_OR_RETURN(gen_, ValidateGenerationRequest(q, ctx_.limits.max_tokens));
    if (gen_.streaming && !in_stream_) {
      return InvalidArgumentError(
          "input 'streaming' is true: streamed generation needs ModelStreamInfer");
    }
    if (!gen_.seeded) {
      static std::atomic<uint64_t> counter{std::random_device{}()};
      gen_.params.sampling.seed = counter.fetch_add(0x9E3779B97F4A7C15ull);
    }
    auto self = shared_from_this();
    TP_ASSIGN_OR_RETURN(const uint64_t id,
                        ctx_.generator->Submit(gen_.prompt, gen_.params, deadline,
                                               [self](GenerationEvent e) { self->OnEvent(e); }));
    generation_id_.store(id);
    if (cancelled_->load()) ctx_.generator->Cancel(id);  // cancelled while being queued
    return Status::Ok();
  }

  void OnEvent(const GenerationEvent& e) {
    const auto now = Clock::now();
    for (size_t i = 0; i < e.new_tokens.size(); ++i) {
      if (tokens_.empty() && i == 0) {
        ctx_.metrics.ttft.Observe(Seconds(now - start_));
      } else {
        ctx_.metrics.inter_token.Observe(Seconds(now - last_token_));
      }
      last_token_ = now;
      tokens_.push_back(e.new_tokens[i]);
    }
    log_probs_.insert(log_probs_.end(), e.new_log_probs.begin(), e.new_log_probs.end());
    Reply reply;
    reply.final = e.last();
    if (!e.error.ok()) {
      reply.error = e.error;
    } else if (e.finish == FinishReason::kCancelled) {
      reply.error = CancelledError("the request was cancelled");
    }
    if (reply.final && reply.error.ok()) ctx_.metrics.e2e.Observe(Seconds(now - start_));
    if (!reply.error.ok()) return Send(std::move(reply));
    reply.finish_reason = reply.final ? FinishReasonName(e.finish) : "";
    if (gen_.streaming) {
      reply.delta = true;
      reply.tokens = e.new_tokens;
      reply.log_probs = e.new_log_probs;
      return Send(std::move(reply));
    }
    if (!reply.final) return;
    Header(&reply.response);
    std::vector<int32_t> out;
    if (!gen_.exclude_input) out = gen_.prompt;
    out.insert(out.end(), tokens_.begin(), tokens_.end());
    FillGeneration(&reply.response, out, log_probs_, reply.finish_reason);
    Send(std::move(reply));
  }

 public:
  // output_ids, sequence_length, output_log_probs as the request asked.
  void FillGeneration(inference::ModelInferResponse* r, const std::vector<int32_t>& ids,
                      const std::vector<float>& log_probs, const std::string& finish) const {
    const int64_t n = static_cast<int64_t>(ids.size());
    if (gen_.want_output_ids) AddOutput(r, "output_ids", "INT32", {1, 1, n}, ids);
    if (gen_.want_sequence_length) {
      AddOutput(r, "sequence_length", "INT32", {1, 1},
                std::vector<int32_t>{static_cast<int32_t>(n)});
    }
    if (gen_.want_log_probs) {
      AddOutput(r, "output_log_probs", "FP32", {1, 1, static_cast<int64_t>(log_probs.size())},
                log_probs);
    }
    if (!finish.empty()) (*r->mutable_parameters())["finish_reason"].set_string_param(finish);
  }

  void Header(inference::ModelInferResponse* r) const {
    r->set_model_name(ctx_.model_name);
    r->set_model_version(kVersion);
    r->set_id(id_);
  }

 private:
  void Send(Reply reply) {
    if (reply.final) {
      const uint64_t ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start_).count();
      if (reply.error.ok()) {
        ++ctx_.success_count;
        ctx_.success_ns += ns;
        ctx_.last_inference_ms = NowMs();
      } else {
        ++ctx_.fail_count;
        ctx_.LogFailure(in_stream_ ? "ModelStreamInfer" : "ModelInfer", id_, reply.error);
      }
    }
    sink_->Deliver(shared_from_this(), std::move(reply));
  }

  ServingContext& ctx_;
  const std::string id_;
  Sink* const sink_;
  const bool in_stream_;
  const std::string peer_;
  const Clock::time_point start_ = Clock::now();
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  std::atomic<uint64_t> generation_id_{0};
  GenerationRequest gen_;
  std::vector<int32_t> tokens_;
  std::vector<float> log_probs_;
  Clock::time_point last_token_;
};

Clock::time_point DeadlineOf(grpc::CallbackServerContext* call) {
  if (call->deadline() == std::chrono::system_clock::time_point::max()) {
    return Clock::time_point::max();
  }
  return Clock::now() + (call->deadline() - std::chrono::system_clock::now());
}

class UnaryCall final : public grpc::ServerUnaryReactor, public Sink {
 public:
  UnaryCall(ServingContext& ctx, grpc::CallbackServerContext* call, const grpc::ByteBuffer* request,
            grpc::ByteBuffer* response)
      : ctx_(ctx), response_(response) {
    ++ctx_.calls_in_progress;
    inference::ModelInferRequest q;
    Status s = ParseRequest(*request, &q);
    if (s.ok()) {
      request_ = std::make_shared<Request>(ctx_, q.id(), this, false, call->peer());
      s = request_->Start(q, DeadlineOf(call));
    }
    if (!s.ok()) {
      CountRejection(ctx_, s);
      ++ctx_.fail_count;
      ctx_.LogFailure("ModelInfer", q.id(), s);
      Finish(ToGrpc(s));
    }
  }

  void Deliver(const std::shared_ptr<Request>&, Reply reply) override {
    if (reply.error.ok()) Serialize(reply.response, response_);
    Finish(ToGrpc(reply.error));  // the last use of this object: OnDone may follow at once
  }

  void OnCancel() override {
    if (request_) request_->Cancel();
  }
  void OnDone() override {
    --ctx_.calls_in_progress;
    delete this;
  }

 private:
  ServingContext& ctx_;
  grpc::ByteBuffer* const response_;
  std::shared_ptr<Request> request_;
};

class StreamCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                         public Sink,
                         public DrainableStream {
 public:
  StreamCall(ServingContext& ctx, grpc::CallbackServerContext* call) : ctx_(ctx), call_(call) {
    ++ctx_.calls_in_progress;
    if (ctx_.draining.load()) {
      ctx_.metrics.Reject(RejectReason::kShuttingDown);
      ended_ = true;
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"));
      return;
    }
    if (++ctx_.open_streams > static_cast<int64_t>(ctx_.max_streams)) {
      --ctx_.open_streams;
      ctx_.metrics.Reject(RejectReason::kTooManyStreams);
      ended_ = true;
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          std::to_string(ctx_.max_streams) +
                              " streams are open, the server's limit (--max-streams); close "
                              "one, or send requests with ModelInfer"));
      return;
    }
    counted_ = true;
    ctx_.AddStream(this);
    std::lock_guard lock(mu_);
    reading_ = true;
    StartRead(&read_buf_);
  }

  // The drain: no more reads; the stream ends once its requests are answered.
  void Drain() override {
    std::lock_guard lock(mu_);
    draining_ = true;
    MaybeFinishLocked();
  }

  void OnReadDone(bool ok) override {
    std::lock_guard lock(mu_);
    reading_ = false;
    if (!ok) {
      read_closed_ = true;
      return MaybeFinishLocked();
    }
    inference::ModelInferRequest q;
    Status s = ParseRequest(read_buf_, &q);
    read_buf_.Clear();
    if (s.ok() && (draining_ || ctx_.draining.load())) {
      s = UnavailableError("the server is shutting down: send the rest to another replica");
    }
    if (s.ok()) {
      auto request = std::make_shared<Request>(ctx_, q.id(), this, true, call_->peer());
      active_.insert(request);
      ++inflight_;
      mu_.unlock();  // Start may deliver at once (on this thread)
      s = request->Start(q, DeadlineOf(call_));
      mu_.lock();
      if (!s.ok()) {
        active_.erase(request);
        --inflight_;
      }
    }
    if (!s.ok()) {
      CountRejection(ctx_, s);
      ++ctx_.fail_count;
      ctx_.LogFailure("ModelStreamInfer", q.id(), s);
      Out out;
      out.message.set_error_message(s.ToString());
      out.message.mutable_infer_response()->set_id(q.id());
      outq_.push_back(std::move(out));
      MaybeWriteLocked();
    }
    MaybeReadLocked();
    MaybeFinishLocked();
  }

  void Deliver(const std::shared_ptr<Request>& request, Reply reply) override {
    std::lock_guard lock(mu_);
    if (reply.final) {
      active_.erase(request);
      --inflight_;
    }
    if (!cancelled_) Enqueue(request, std::move(reply));
    MaybeWriteLocked();
    MaybeReadLocked();
    MaybeFinishLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard lock(mu_);
    writing_ = false;
    if (!ok) {
      // The client is gone: nothing more can be sent.
      cancelled_ = true;
      outq_.clear();
      CancelAllLocked();
    }
    MaybeWriteLocked();
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard lock(mu_);
    cancelled_ = true;
    outq_.clear();
    CancelAllLocked();
    MaybeFinishLocked();
  }

  void OnDone() override {
    ctx_.RemoveStream(this);
    if (counted_) --ctx_.open_streams;
    --ctx_.calls_in_progress;
    // A thread that delivered the last reply may still be leaving mu_.
    { std::lock_guard lock(mu_); }
    delete this;
  }

 private:
  struct Out {
    std::shared_ptr<Request> request;  // set for streamed generation tokens, merged while queued
    bool final = false;
    std::vector<int32_t> tokens;
    std::vector<float> log_probs;
    std::string finish_reason;
    inference::ModelStreamInferResponse message;  // complete messages
  };

  void Enqueue(const std::shared_ptr<Request>& request, Reply reply) {
    if (!reply.error.ok()) {
      Out out;
      out.message.set_error_message(reply.error.ToString());
      out.message.mutable_infer_response()->set_id(request->id());
      outq_.push_back(std::move(out));
      return;
    }
    if (!reply.delta) {
      // A request answered in one response (not streamed): on a stream it is
      // marked final too, so that clients end every request the same way.
      Out out;
      *out.message.mutable_infer_response() = std::move(reply.response);
      (*out.message.mutable_infer_response()->mutable_parameters())["triton_final_response"]
          .set_bool_param(true);
      outq_.push_back(std::move(out));
      return;
    }
    // A client that reads slowly gets the tokens of several steps in one
    // response: memory stays bounded by the requests in progress.
    for (Out& o : outq_) {
      if (o.request == request) {
        o.tokens.insert(o.tokens.end(), reply.tokens.begin(), reply.tokens.end());
        o.log_probs.insert(o.log_probs.end(), reply.log_probs.begin(), reply.log_probs.end());
        o.final = reply.final;
        o.finish_reason = reply.finish_reason;
        return;
      }
    }
    Out out;
    out.request = request;
    out.final = reply.final;
    out.tokens = std::move(reply.tokens);
    out.log_probs = std::move(reply.log_probs);
    out.finish_reason = std::move(reply.finish_reason);
    outq_.push_back(std::move(out));
  }

  void MaybeWriteLocked() {
    if (writing_ || outq_.empty() || finished_) return;
    Out out = std::move(outq_.front());
    outq_.pop_front();
    if (out.request) {
      auto* r = out.message.mutable_infer_response();
      out.request->Header(r);
      out.request->FillGeneration(r, out.tokens, out.log_probs, out.finish_reason);
      (*r->mutable_parameters())["triton_final_response"].set_bool_param(out.final);
    }
    Serialize(out.message, &write_buf_);
    writing_ = true;
    StartWrite(&write_buf_);
  }

  void MaybeReadLocked() {
    if (reading_ || read_closed_ || draining_ || cancelled_ || finished_) return;
    if (inflight_ >= static_cast<int64_t>(ctx_.max_requests_per_stream)) return;  // back-pressure
    reading_ = true;
    StartRead(&read_buf_);
  }

  void CancelAllLocked() {
    for (const auto& r : active_) r->Cancel();
  }

  void MaybeFinishLocked() {
    if (finished_ || ended_) return;
    const bool no_more_reads = read_closed_ || draining_ || cancelled_;
    if (!no_more_reads || inflight_ > 0 || writing_ || !outq_.empty()) return;
    finished_ = true;
    if (cancelled_) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the stream was cancelled"));
    } else if (draining_ && !read_closed_) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "the server is shutting down: this stream's requests were answered, "
                          "send the rest to another replica"));
    } else {
      Finish(grpc::Status::OK);
    }
  }

  ServingContext& ctx_;
  grpc::CallbackServerContext* const call_;
  std::mutex mu_;
  grpc::ByteBuffer read_buf_, write_buf_;
  bool reading_ = false, read_closed_ = false, writing_ = false, finished_ = false;
  bool ended_ = false;    // refused at the start
  bool counted_ = false;  // in ctx_.open_streams
  bool cancelled_ = false, draining_ = false;
  int64_t inflight_ = 0;
  std::set<std::shared_ptr<Request>> active_;
  std::deque<Out> outq_;
};

}  // namespace

Status ServingContext::CheckModel(const std::string& name, const std::string& version) const {
  if (name != model_name) {
    return NotFoundError("unknown model '" + ClientText(name) + "' (this server serves '" +
                         model_name + "')");
  }
  if (!version.empty() && version != kVersion) {
    return NotFoundError("model '" + name + "' has no version '" + ClientText(version) +
                         "' (available: 1)");
  }
  return Status::Ok();
}

void ServingContext::LogFailure(const char* rpc, const std::string& id, const Status& s) {
  if (!ClientCaused(s.code())) {
    spdlog::error("{} id='{}': {}", rpc, ClientText(id), s.ToString());
    return;
  }
  // At most 5 lines a second of client-caused failures; the rest are counted
  // and summarised in the next window's first line.
  constexpr int kPerSecond = 5;
  const int64_t window = static_cast<int64_t>(NowMs() / 1000);
  if (log_window_.exchange(window) != window) {
    logged_in_window_ = 0;
    if (const uint64_t n = suppressed_.exchange(0); n > 0) {
      spdlog::info("{} more failed requests were not logged (client errors, rate-limited)", n);
    }
  }
  if (logged_in_window_.fetch_add(1) < kPerSecond) {
    spdlog::info("{} id='{}': {}", rpc, ClientText(id), s.ToString());
  } else {
    ++suppressed_;
  }
}

grpc::ServerUnaryReactor* StartUnaryCall(ServingContext& ctx, grpc::CallbackServerContext* call,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) {
  return new UnaryCall(ctx, call, request, response);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartStreamCall(
    ServingContext& ctx, grpc::CallbackServerContext* call) {
  return new StreamCall(ctx, call);
}

void ServingContext::AddStream(DrainableStream* s) {
  std::lock_guard lock(streams_mu_);
  streams_.insert(s);
}

void ServingContext::RemoveStream(DrainableStream* s) {
  std::lock_guard lock(streams_mu_);
  streams_.erase(s);
}

// Streams leave the set in OnDone, which waits for this lock: none is
// deleted while it is drained here.
void ServingContext::DrainStreams() {
  std::lock_guard lock(streams_mu_);
  for (DrainableStream* s : streams_) s->Drain();
}

}  // namespace tpserve
