#include "benchmarks/loadtest_generate.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tpserve::loadtest {
namespace {

using Json = nlohmann::json;

// One request as sent, less its id, and what it asks for.
struct GenRequest {
  inference::ModelInferRequest request;
  int64_t prompt_tokens = 0;
  int64_t output_len = 0;
};

// Appends a [1,1] (or [1,n]) tensor of raw little-endian `bytes`.
void AddInput(inference::ModelInferRequest* q, const std::string& name, const char* datatype,
              int64_t columns, std::string bytes) {
  auto* in = q->add_inputs();
  in->set_name(name);
  in->set_datatype(datatype);
  in->add_shape(1);
  in->add_shape(columns);
  q->add_raw_input_contents(std::move(bytes));
}

template <typename T>
std::string Bytes(T v) {
  std::string b(sizeof(T), '\0');
  std::memcpy(b.data(), &v, sizeof(T));
  return b;
}

GenRequest MakeRequest(const std::string& model, const std::string& input_name, const PromptIds& p,
                       int64_t output_len, const GenerateOptions& o) {
  GenRequest g;
  g.prompt_tokens = p.tokens;
  g.output_len = output_len;
  auto& q = g.request;
  q.set_model_name(model);
  AddInput(&q, input_name, "INT32", p.tokens, *p.raw_int32);
  AddInput(&q, "input_lengths", "INT32", 1, Bytes(static_cast<int32_t>(p.tokens)));
  AddInput(&q, "request_output_len", "INT32", 1, Bytes(static_cast<int32_t>(output_len)));
  if (!o.ignore_eos) AddInput(&q, "end_id", "INT32", 1, Bytes(static_cast<int32_t>(o.end_id)));
  if (o.streaming) AddInput(&q, "streaming", "BOOL", 1, std::string(1, '\1'));
  AddInput(&q, "exclude_input_in_output", "BOOL", 1, std::string(1, '\1'));
  return g;
}

// The number of token ids in the response's output_ids; 0 when it has none and
// !required; -1 when malformed (or missing and required).
int64_t OutputTokens(const inference::ModelInferResponse& r, bool required) {
  for (int i = 0; i < r.outputs_size(); ++i) {
    const auto& out = r.outputs(i);
    if (out.name() != "output_ids") continue;
    if (out.datatype() != "INT32") return -1;
    int64_t n = 1;
    for (int64_t d : out.shape()) {
      if (d < 0) return -1;
      n *= d;
    }
    if (i < r.raw_output_contents_size()) {
      if (static_cast<int64_t>(r.raw_output_contents(i).size()) != 4 * n) return -1;
    } else if (out.contents().int_contents_size() != n) {
      return -1;
    }
    return n;
  }
  return required ? -1 : 0;
}

bool IsFinal(const inference::ModelInferResponse& r) {
  auto it = r.parameters().find("triton_final_response");
  return it != r.parameters().end() && it->second.bool_param();
}

// Why a finished request's length is wrong, or "".
std::string LengthError(int64_t tokens, int64_t asked, bool ignore_eos) {
  if (tokens > asked) return "LONG_OUTPUT";
  if (ignore_eos && tokens < asked) return "SHORT_OUTPUT";
  return "";
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

class GenerateDriver final : public LoadDriver {
 public:
  GenerateDriver(std::shared_ptr<grpc::Channel> channel, std::vector<GenRequest> requests,
                 const GenerateOptions& o, int64_t timeout_ms)
      : stub_(inference::GRPCInferenceService::NewStub(channel)),
        requests_(std::move(requests)),
        streaming_(o.streaming),
        ignore_eos_(o.ignore_eos),
        per_stream_(o.requests_per_stream),
        timeout_(std::chrono::milliseconds(timeout_ms)) {
    if (streaming_) watcher_ = std::thread([this] { WatchDeadlines(); });
  }

  ~GenerateDriver() override {
    StopLoad();
    std::vector<std::shared_ptr<Stream>> open;
    {
      std::unique_lock<std::mutex> lock(mu_);
      stopping_ = true;
      open.swap(streams_);
      cv_.notify_all();
    }
    if (watcher_.joinable()) watcher_.join();
    // A stream ends cleanly once the server has answered what was written (requests that
    // timed out may still be running there); a stalled server is cut off.
    for (const auto& s : open) s->Close();
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(2), [&] { return live_streams_ == 0; })) {
      for (const auto& s : open) s->Cancel();  // safe on a stream that has ended
    }
    cv_.wait(lock, [&] { return live_streams_ == 0 && unary_running_ == 0; });
  }

 private:
  // One ModelStreamInfer call: writes queued one at a time, a read always pending.
  // Lifetime: held by the driver while it sends on it and by itself until OnDone.
  class Stream : public grpc::ClientBidiReactor<inference::ModelInferRequest,
                                                inference::ModelStreamInferResponse> {
   public:
    explicit Stream(GenerateDriver* d) : driver_(d) {}

    // Sets the call up (no reaction runs before Begin, so the driver's lock may be held).
    // The hold taken here lets other threads write until the stream is retired (gRPC calls
    // OnDone only once every hold is released, and a write after OnDone is undefined).
    void Prepare(std::shared_ptr<Stream> self) {
      self_ = std::move(self);
      driver_->stub_->async()->ModelStreamInfer(&ctx_, this);
      AddHold();
      StartRead(&response_);
    }
    // Starts the call; writes queued before it go out after.
    void Begin() { StartCall(); }

    // Queues a request; dropped once the stream is retired (OnDone then fails it).
    void Write(inference::ModelInferRequest q) {
      inference::ModelInferRequest* next = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (retired_) return;
        queue_.push_back(std::move(q));
        if (writing_) return;
        writing_ = true;
        next = &queue_.front();  // deque elements stay put while others are added
        AddHold();  // the retiring hold may go meanwhile: this one lasts past StartWrite
      }
      StartWrite(next);
      RemoveHold();
    }

    // Half-closes after the queued writes and retires the stream.
    void Close() {
      bool now = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (retired_) return;
        retired_ = closing_ = true;
        now = !writing_;
      }
      if (now) StartWritesDone();
      RemoveHold();
    }

    void Cancel() { ctx_.TryCancel(); }

    // Requests sent on this stream and not ended yet (guarded by the driver's lock).
    int64_t in_flight = 0;

    void OnWriteDone(bool ok) override {
      inference::ModelInferRequest* next = nullptr;
      bool done_writing = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.pop_front();
        if (ok && !queue_.empty()) {
          next = &queue_.front();
        } else {
          writing_ = false;
          done_writing = ok && closing_;
        }
      }
      if (next) StartWrite(next);
      if (done_writing) StartWritesDone();
      if (!ok) Retire();  // broken: the requests never written fail in OnDone
    }

    void OnReadDone(bool ok) override {
      if (!ok) {
        Retire();  // the stream is ending: OnDone follows
        return;
      }
      driver_->OnStreamResponse(response_, Clock::now());
      StartRead(&response_);
    }

    void OnDone(const grpc::Status& s) override {
      GenerateDriver* d = driver_;
      d->OnStreamDone(this, s);
      // This stream (and its call) goes before the driver learns it is gone: once it does, the
      // driver and the process may end.
      std::shared_ptr<Stream>(std::move(self_)).reset();  // may delete this
      d->StreamGone();
    }

   private:
    // No more requests on this stream: the driver opens another for the next one.
    void Retire() {
      driver_->Unpublish(this);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (retired_) return;
        retired_ = true;
      }
      RemoveHold();
    }

    GenerateDriver* driver_;
    grpc::ClientContext ctx_;
    inference::ModelStreamInferResponse response_;
    std::shared_ptr<Stream> self_;
    std::mutex mu_;
    std::deque<inference::ModelInferRequest> queue_;  // guarded by mu_; front: being written
    bool writing_ = false, closing_ = false, retired_ = false;  // guarded by mu_
  };

  // A streamed request in flight.
  struct Pending {
    Clock::time_point start, deadline;
    const GenRequest* request = nullptr;
    Stream* stream = nullptr;
    GenSample sample;
    Clock::time_point last_token;
  };

  void Send() override {
    const GenRequest& r = requests_[next_request_.fetch_add(1) % requests_.size()];
    if (streaming_) {
      SendStreaming(r);
    } else {
      SendUnary(r);
    }
  }

  void SendUnary(const GenRequest& r) {
    struct Call {
      grpc::ClientContext ctx;
      inference::ModelInferResponse response;
      Clock::time_point start;
    };
    auto* call = new Call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++unary_running_;
    }
    call->ctx.set_deadline(std::chrono::system_clock::now() + timeout_);
    call->start = Clock::now();
    stub_->async()->ModelInfer(
        &call->ctx, &r.request, &call->response, [this, call, &r](grpc::Status s) {
          std::unique_ptr<Call> own(call);
          Outcome o;
          o.latency_ms = Ms(Clock::now() - call->start);
          o.prompt_tokens = r.prompt_tokens;
          if (!s.ok()) {
            o.error = StatusName(s.error_code());
          } else if (const int64_t n = OutputTokens(call->response, /*required=*/true); n < 0) {
            o.error = "BAD_RESPONSE";
          } else if (o.error = LengthError(n, r.output_len, ignore_eos_); o.error.empty()) {
            GenSample g;
            g.e2e_ms = o.latency_ms;
            g.prompt_tokens = r.prompt_tokens;
            g.output_tokens = n;
            o.generated = std::move(g);
          }
          Finish(std::move(o));
          own.reset();  // the call goes before the driver learns it is done
          std::lock_guard<std::mutex> lock(mu_);
          --unary_running_;
          cv_.notify_all();  // under the lock: the destructor may go once it is released
        });
  }

  void SendStreaming(const GenRequest& r) {
    const uint64_t id = next_id_.fetch_add(1);
    inference::ModelInferRequest q = r.request;
    q.set_id(std::to_string(id));
    std::shared_ptr<Stream> stream;
    bool begin = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The first stream with room, else a new one (the server reads a bounded number of
      // requests in progress from one stream; the rest would wait in the client's queue).
      for (const auto& open : streams_) {
        if (open->in_flight < per_stream_) {
          stream = open;
          break;
        }
      }
      if (!stream) {
        stream = std::make_shared<Stream>(this);
        ++live_streams_;
        stream->Prepare(stream);
        streams_.push_back(stream);
        begin = true;
      }
      ++stream->in_flight;
      Pending& p = pending_[id];
      p.start = Clock::now();
      p.deadline = p.start + timeout_;
      p.request = &r;
      p.stream = stream.get();
      p.sample.prompt_tokens = r.prompt_tokens;
      const bool earliest = deadlines_.empty() || p.deadline < deadlines_.begin()->first;
      deadlines_.emplace(p.deadline, id);
      if (earliest) cv_.notify_all();
    }
    // Outside the lock: reactions take it.
    if (begin) stream->Begin();
    stream->Write(std::move(q));
  }

  // Ends a pending request (erased by the caller) as an Outcome.
  Outcome End(const Pending& p, std::string error, Clock::time_point now) {
    Outcome o;
    o.latency_ms = Ms(now - p.start);
    o.prompt_tokens = p.request->prompt_tokens;
    o.error = std::move(error);
    if (o.error.empty()) {
      o.error = LengthError(p.sample.output_tokens, p.request->output_len, ignore_eos_);
    }
    if (o.error.empty()) {
      o.generated = p.sample;
      o.generated->e2e_ms = o.latency_ms;
    }
    return o;
  }

  void OnStreamResponse(const inference::ModelStreamInferResponse& m, Clock::time_point now) {
    std::optional<Outcome> ended;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const std::string& sid = m.infer_response().id();
      uint64_t id = 0;
      const auto [end, ec] = std::from_chars(sid.data(), sid.data() + sid.size(), id);
      auto it =
          ec == std::errc() && end == sid.data() + sid.size() ? pending_.find(id) : pending_.end();
      if (it == pending_.end()) return;  // timed out already, or not ours
      Pending& p = it->second;
      std::string error;
      if (!m.error_message().empty()) {
        error = StreamErrorCategory(m.error_message());
      } else {
        const int64_t k = OutputTokens(m.infer_response(), /*required=*/false);
        if (k < 0) {
          error = "BAD_RESPONSE";
        } else if (k > 0) {
          if (!p.sample.ttft_ms) {
            p.sample.ttft_ms = Ms(now - p.start);
          } else {
            p.sample.itl_ms.push_back(Ms(now - p.last_token));
          }
          p.last_token = now;
          p.sample.output_tokens += k;
        }
      }
      if (error.empty() && !IsFinal(m.infer_response())) return;
      ended = End(p, std::move(error), now);
      EraseLocked(it);
    }
    Finish(std::move(*ended));
  }

  // Sends no more requests on `s`.
  void Unpublish(const Stream* s) {
    std::lock_guard<std::mutex> lock(mu_);
    UnpublishLocked(s);
  }
  void UnpublishLocked(const Stream* s) {
    std::erase_if(streams_, [s](const std::shared_ptr<Stream>& open) { return open.get() == s; });
  }

  // Forgets an ended request (its stream is alive: OnStreamDone erases a stream's requests
  // before the stream goes).
  void EraseLocked(std::unordered_map<uint64_t, Pending>::iterator it) {
    --it->second.stream->in_flight;
    deadlines_.erase({it->second.deadline, it->first});
    pending_.erase(it);
  }

  void OnStreamDone(const Stream* s, const grpc::Status& status) {
    std::vector<Outcome> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      UnpublishLocked(s);
      const Clock::time_point now = Clock::now();
      // A stream that ends with requests unanswered failed them, even when it ends OK.
      const std::string error = status.ok() ? "STREAM_CLOSED" : StatusName(status.error_code());
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.stream != s) {
          ++it;
          continue;
        }
        failed.push_back(End(it->second, error, now));
        EraseLocked(it++);
      }
    }
    for (Outcome& o : failed) Finish(std::move(o));
  }

  void StreamGone() {
    std::lock_guard<std::mutex> lock(mu_);
    --live_streams_;
    cv_.notify_all();  // under the lock: the destructor may go once it is released
  }

  // Ends streamed requests at their deadlines (a stream has one deadline for all its
  // requests, so each gets its own here; the server is not told, and its later responses
  // to the request are dropped).
  void WatchDeadlines() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (deadlines_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const auto [when, id] = *deadlines_.begin();
      if (Clock::now() < when) {
        cv_.wait_until(lock, when);
        continue;
      }
      deadlines_.erase(deadlines_.begin());
      auto it = pending_.find(id);
      if (it == pending_.end()) continue;
      // The server still runs it, but the stream takes a request in its place: a server
      // that stalls shows as timeouts, not as a client that stops sending.
      Outcome o = End(it->second, "DEADLINE_EXCEEDED", Clock::now());
      EraseLocked(it);
      lock.unlock();
      Finish(std::move(o));
      lock.lock();
    }
  }

  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  const std::vector<GenRequest> requests_;
  const bool streaming_, ignore_eos_;
  const int64_t per_stream_;
  const std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> next_request_{0}, next_id_{1};
  std::thread watcher_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Stream>> streams_;                // guarded by mu_; open ones
  int live_streams_ = 0;                                        // guarded by mu_
  int64_t unary_running_ = 0;                                   // guarded by mu_
  bool stopping_ = false;                                       // guarded by mu_
  std::unordered_map<uint64_t, Pending> pending_;               // guarded by mu_
  std::set<std::pair<Clock::time_point, uint64_t>> deadlines_;  // guarded by mu_
};

Json NumberOrNull(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

std::string Fmt(const Json& v, int prec) {
  if (!v.is_number()) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v.get<double>());
  return buf;
}

}  // namespace

std::function<std::string()> AddGenerateFlags(CLI::App& app, GenerateOptions* o) {
  constexpr const char* kGroup = "Generation (--mode generate)";
  app.add_option("--mode", o->mode,
                 "logits: one ModelInfer per prompt, answered with the next token's logits; "
                 "generate: token generation (input_ids, input_lengths, request_output_len, as "
                 "Triton's TensorRT-LLM backend), reporting TTFT, TPOT, ITL, token rates and "
                 "goodput")
      ->check(CLI::IsMember({"logits", "generate"}))
      ->capture_default_str();
  auto* len = app.add_option("--output-len", o->output_len_spec,
                             "output tokens per request, N or MIN:MAX (drawn uniformly per "
                             "request from --seed), 1 to 1048576")
                  ->capture_default_str();
  auto* ignore = app.add_flag("--ignore-eos", o->ignore_eos,
                              "send no end_id, so that every request runs to --output-len (the "
                              "default: benchmarks compare equal work)");
  auto* end_id = app.add_option("--end-id", o->end_id,
                                "send this end_id: a request may stop early at it (then only "
                                "outputs longer than asked for are errors)");
  ignore->excludes(end_id);
  auto given = std::make_shared<std::pair<bool, bool>>();  // --streaming, --no-streaming
  auto* streaming = app.add_flag("--streaming", given->first,
                                 "ModelStreamInfer: a response per engine step, requests "
                                 "multiplexed on streams by id (the default; TTFT, TPOT and "
                                 "ITL need it)");
  auto* unary = app.add_flag("--no-streaming", given->second,
                             "ModelInfer: one response per request (TTFT, TPOT and ITL are "
                             "then not observed, and reported as null)");
  streaming->excludes(unary);
  auto* per_stream =
      app.add_option("--requests-per-stream", o->requests_per_stream,
                     "most requests in flight on one stream; more open more streams (`tpserve "
                     "serve` reads at most --max-requests-per-stream from one stream, 64 by "
                     "default; a request beyond waits, and its TTFT with it), 1 to 1000000")
          ->capture_default_str();
  // Parsed here, kept in o->slo once checked.
  auto ttft_ms = std::make_shared<double>(0), tpot_ms = std::make_shared<double>(0);
  auto* ttft = app.add_option("--slo-ttft-ms", *ttft_ms,
                              "goodput counts requests whose time to first token is at most "
                              "this (needs streaming)");
  auto* tpot = app.add_option("--slo-tpot-ms", *tpot_ms,
                              "goodput counts requests whose time per output token after the "
                              "first is at most this (needs streaming)");
  for (CLI::Option* opt : {len, ignore, end_id, streaming, unary, per_stream, ttft, tpot}) {
    opt->group(kGroup);
  }
  // The values CLI11 writes into live as long as the returned function.
  return [o, len, ignore, end_id, streaming, unary, per_stream, ttft, tpot, ttft_ms, tpot_ms,
          given]() -> std::string {
    if (o->mode != "generate") {
      for (const CLI::Option* opt :
           {len, ignore, end_id, streaming, unary, per_stream, ttft, tpot}) {
        if (opt->count() > 0) return opt->get_name() + " needs --mode generate";
      }
      return "";
    }
    const auto parsed = ParseOutputLen(o->output_len_spec);
    if (!parsed) {
      return "--output-len must be N or MIN:MAX, whole numbers with 1 <= MIN <= MAX <= " +
             std::to_string(kMaxOutputLen) + ", got '" + o->output_len_spec + "'";
    }
    o->output_len = *parsed;
    o->streaming = unary->count() == 0;
    if (o->requests_per_stream < 1 || o->requests_per_stream > 1000000) {
      return "--requests-per-stream must be from 1 to 1000000, got " +
             std::to_string(o->requests_per_stream);
    }
    if (end_id->count() > 0) {
      if (o->end_id < 0 || o->end_id > std::numeric_limits<int32_t>::max()) {
        return "--end-id must be a token id from 0 to 2147483647, got " + std::to_string(o->end_id);
      }
      o->ignore_eos = false;
    } else {
      o->ignore_eos = true;
    }
    for (const auto& [opt, v, slo] : {std::tuple{ttft, *ttft_ms, &o->slo.ttft_ms},
                                      std::tuple{tpot, *tpot_ms, &o->slo.tpot_ms}}) {
      if (opt->count() == 0) continue;
      if (!(std::isfinite(v) && v > 0)) {
        return opt->get_name() + " must be a positive number of milliseconds";
      }
      if (!o->streaming) {
        return opt->get_name() +
               " needs streaming: without it the first token's arrival is not observed";
      }
      *slo = v;
    }
    return "";
  };
}

std::string CheckGenerationModel(inference::GRPCInferenceService::Stub* stub,
                                 const std::string& model, const std::string& input_name) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  inference::ModelMetadataRequest req;
  req.set_name(model);
  inference::ModelMetadataResponse meta;
  const grpc::Status s = stub->ModelMetadata(&ctx, req, &meta);
  if (!s.ok()) {
    return "cannot read model '" + model + "''s metadata: " + StatusName(s.error_code()) + ": " +
           s.error_message();
  }
  bool have_len = false, have_ids = false;
  for (const auto& in : meta.inputs()) {
    have_len = have_len || in.name() == "request_output_len";
    have_ids = have_ids || in.name() == input_name;
  }
  if (!have_len) {
    return "model '" + model +
           "' has no input named request_output_len: the server does not generate tokens "
           "(--mode generate needs it; --mode logits measures the logits requests)";
  }
  if (!have_ids) return "model '" + model + "' has no input named " + input_name;
  return "";
}

std::unique_ptr<LoadDriver> MakeGenerateDriver(std::shared_ptr<grpc::Channel> channel,
                                               const std::string& model,
                                               const std::string& input_name,
                                               const std::vector<PromptIds>& prompts,
                                               const GenerateOptions& o, int64_t timeout_ms,
                                               uint64_t seed) {
  // As many requests as prompts, and at least 512 output lengths drawn (prompts cycled).
  const size_t n = std::max<size_t>(prompts.size(), o.output_len.min == o.output_len.max ? 1 : 512);
  std::mt19937_64 rng(seed ^ 0x6f75747075746c65);  // a stream apart from the prompts'
  std::uniform_int_distribution<int64_t> len(o.output_len.min, o.output_len.max);
  std::vector<GenRequest> requests;
  requests.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    requests.push_back(MakeRequest(model, input_name, prompts[i % prompts.size()], len(rng), o));
  }
  return std::make_unique<GenerateDriver>(std::move(channel), std::move(requests), o, timeout_ms);
}

const std::vector<std::string>& GenerateFields() {
  static const std::vector<std::string> kFields = {"output_tokens_per_sec",
                                                   "total_tokens_per_sec",
                                                   "goodput_per_sec",
                                                   "good_requests",
                                                   "output_tokens",
                                                   "prompt_tokens",
                                                   "ttft_mean_ms",
                                                   "ttft_p50_ms",
                                                   "ttft_p90_ms",
                                                   "ttft_p99_ms",
                                                   "tpot_mean_ms",
                                                   "tpot_p50_ms",
                                                   "tpot_p90_ms",
                                                   "tpot_p99_ms",
                                                   "itl_mean_ms",
                                                   "itl_p50_ms",
                                                   "itl_p90_ms",
                                                   "itl_p99_ms",
                                                   "e2e_mean_ms",
                                                   "closed_loop_output_tokens_per_sec"};
  return kFields;
}

void AddGenerateFields(const std::vector<Window>& windows, const GenerateOptions& o, Json* r) {
  std::vector<GenSample> all;
  double seconds = 0;
  for (const Window& w : windows) {
    seconds += w.seconds;
    all.insert(all.end(), w.generated.begin(), w.generated.end());
  }
  const GenSummary g = Summarize(all, seconds, o.slo);
  Json& j = *r;
  j["output_tokens_per_sec"] = NumberOrNull(g.output_tokens_per_sec);
  j["total_tokens_per_sec"] = NumberOrNull(g.total_tokens_per_sec);
  // Null without objectives (nothing to meet); with them, the requests/s that met all.
  j["goodput_per_sec"] = NumberOrNull(g.goodput_per_sec);
  j["good_requests"] = o.slo.any() ? Json(g.good_requests) : Json(nullptr);
  j["output_tokens"] = g.output_tokens;
  j["prompt_tokens"] = g.prompt_tokens;
  for (const auto& [name, d] :
       {std::pair{"ttft", g.ttft_ms}, std::pair{"tpot", g.tpot_ms}, std::pair{"itl", g.itl_ms}}) {
    const std::string n = name;
    j[n + "_mean_ms"] = NumberOrNull(d.mean);
    j[n + "_p50_ms"] = NumberOrNull(d.p50);
    j[n + "_p90_ms"] = NumberOrNull(d.p90);
    j[n + "_p99_ms"] = NumberOrNull(d.p99);
  }
  j["e2e_mean_ms"] = NumberOrNull(g.e2e_ms.mean);
  // Closed loops only (open loops have no fixed number of requests in flight).
  const bool closed = j.contains("concurrency") && j["concurrency"].is_number_integer();
  j["closed_loop_output_tokens_per_sec"] =
      closed ? NumberOrNull(ClosedLoopOutputTokensPerSec(g, j["concurrency"].get<int64_t>()))
             : Json(nullptr);
}

Json GenerateMeta(const GenerateOptions& o) {
  Json m;
  m["mode"] = o.mode;
  if (o.mode != "generate") return m;
  m["streaming"] = o.streaming;
  m["requests_per_stream"] = o.streaming ? Json(o.requests_per_stream) : Json(nullptr);
  m["output_len"] = {o.output_len.min, o.output_len.max};
  m["ignore_eos"] = o.ignore_eos;
  m["end_id"] = o.ignore_eos ? Json(nullptr) : Json(o.end_id);
  m["slo_ttft_ms"] = o.slo.ttft_ms ? Json(*o.slo.ttft_ms) : Json(nullptr);
  m["slo_tpot_ms"] = o.slo.tpot_ms ? Json(*o.slo.tpot_ms) : Json(nullptr);
  return m;
}

std::string GenerateStepLine(const Json& r) {
  auto three = [&](const std::string& n) {
    return Fmt(r[n + "_p50_ms"], 2) + "/" + Fmt(r[n + "_p90_ms"], 2) + "/" +
           Fmt(r[n + "_p99_ms"], 2);
  };
  const std::string steady =
      r["closed_loop_output_tokens_per_sec"].is_number()
          ? " (clients x tokens / e2e: " + Fmt(r["closed_loop_output_tokens_per_sec"], 1) + ")"
          : "";
  return "  generation: " + Fmt(r["output_tokens_per_sec"], 1) + " output tok/s" + steady + ", " +
         Fmt(r["total_tokens_per_sec"], 1) + " total tok/s, goodput " +
         Fmt(r["goodput_per_sec"], 2) + " req/s; p50/p90/p99 ms: TTFT " + three("ttft") +
         ", TPOT " + three("tpot") + ", ITL " + three("itl") + ", e2e " + Fmt(r["p50_ms"], 2) +
         "/" + Fmt(r["p90_ms"], 2) + "/" + Fmt(r["p99_ms"], 2);
}

void PrintGenerateTable(const std::string& key, const Json& steps) {
  std::printf("\n%12s %10s %11s %11s %9s %9s %9s %9s %9s %9s %9s %9s\n", key.c_str(), "req/s",
              "out_tok/s", "tot_tok/s", "goodput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
              "itl_p99", "e2e_p50", "e2e_p99");
  for (const auto& r : steps) {
    const Json& k = r[key];
    std::printf("%12s %10s %11s %11s %9s %9s %9s %9s %9s %9s %9s %9s\n",
                (k.is_number_integer() ? std::to_string(k.get<int64_t>()) : Fmt(k, 2)).c_str(),
                Fmt(r["requests_per_sec"], 1).c_str(), Fmt(r["output_tokens_per_sec"], 1).c_str(),
                Fmt(r["total_tokens_per_sec"], 1).c_str(), Fmt(r["goodput_per_sec"], 2).c_str(),
                Fmt(r["ttft_p50_ms"], 2).c_str(), Fmt(r["ttft_p99_ms"], 2).c_str(),
                Fmt(r["tpot_p50_ms"], 2).c_str(), Fmt(r["tpot_p99_ms"], 2).c_str(),
                Fmt(r["itl_p99_ms"], 2).c_str(), Fmt(r["p50_ms"], 2).c_str(),
                Fmt(r["p99_ms"], 2).c_str());
  }
}

}  // namespace tpserve::loadtest
