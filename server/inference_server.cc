#include "server/inference_server.h"

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "proto/grpc_service.grpc.pb.h"
#include "server/request_validation.h"

namespace tpserve {
namespace {

constexpr char kInput[] = "input_ids";
constexpr char kLogits[] = "logits";
constexpr char kNextToken[] = "next_token_id";
constexpr char kVersion[] = "1";
// RPC threads beyond the queued, batched and streaming requests' (InferenceServer::Start):
// health and metadata calls, and requests on their way to the queue.
constexpr size_t kSpareRpcThreads = 64;

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return InvalidArgumentError(std::string(what) + " " + path + ": cannot read the file");
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return InvalidArgumentError(std::string(what) + " " + path + ": not a PEM file");
  }
  return text.str();
}

StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(const ServerOptions& o) {
  if (o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    if (!o.tls_client_ca_file.empty()) {
      return InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (o.tls_cert_file.empty() || o.tls_key_file.empty()) {
    return InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
  }
  grpc::SslServerCredentialsOptions ssl;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  TP_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(o.tls_cert_file, "TLS certificate"));
  TP_ASSIGN_OR_RETURN(pair.private_key, ReadPem(o.tls_key_file, "TLS key"));
  ssl.pem_key_cert_pairs.push_back(pair);
  if (!o.tls_client_ca_file.empty()) {
    TP_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem(o.tls_client_ca_file, "TLS client CA"));
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// Client mistakes (the request's fault) at info, so that a stream of bad
// requests does not drown the log's warnings; the server's own failures
// (engine lost, internal errors) as errors.
void LogFailure(const char* rpc, const std::string& id, const Status& s) {
  const StatusCode c = s.code();
  const bool client = c == StatusCode::kInvalidArgument || c == StatusCode::kNotFound ||
                      c == StatusCode::kDeadlineExceeded || c == StatusCode::kCancelled ||
                      c == StatusCode::kResourceExhausted || c == StatusCode::kFailedPrecondition;
  if (client) {
    spdlog::info("{} id='{}': {}", rpc, ClientText(id), s.ToString());
  } else {
    spdlog::error("{} id='{}': {}", rpc, ClientText(id), s.ToString());
  }
}

// The longest request accepted: a request must also fit one engine batch
// (the batcher never splits one) and the model's positions.
int64_t LongestRequest(const ServerOptions& o, const ModelConfig& c) {
  return std::min(
      {o.max_tokens_per_request, c.max_position_embeddings, o.batcher.max_batch_tokens});
}

}  // namespace

std::string PrometheusLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char ch : v) {
    if (ch == '\\') {
      out += "\\\\";
    } else if (ch == '"') {
      out += "\\\"";
    } else if (ch == '\n') {
      out += "\\n";
    } else {
      out += ch;
    }
  }
  return out;
}

std::string GrpcListenAddress(std::string_view host, int port) {
  const bool ipv6 = host.find(':') != std::string_view::npos && !host.starts_with('[');
  return (ipv6 ? "[" + std::string(host) + "]" : std::string(host)) + ":" + std::to_string(port);
}

class InferenceService final : public inference::GRPCInferenceService::Service {
 public:
  InferenceService(const ServerOptions& options, const Engine& engine, TokenBatcher& batcher)
      : options_(options), engine_(engine), config_(engine.config()), batcher_(batcher) {}

  void set_serving(bool serving) { serving_ = serving; }

  // The start of a shutdown: every open stream ends after the request it is
  // answering (UNAVAILABLE), and streams idle in a read are cancelled now
  // instead of holding the drain open until its deadline: their clients see
  // CANCELLED, with nothing of theirs in progress (a synchronous handler
  // blocked in Read cannot end its call with another status).
  void BeginDrain() {
    std::lock_guard lock(streams_mu_);
    draining_ = true;
    for (const auto& [ctx, busy] : streams_) {
      if (!busy) ctx->TryCancel();
    }
  }

  grpc::Status ServerLive(grpc::ServerContext*, const inference::ServerLiveRequest*,
                          inference::ServerLiveResponse* r) override {
    r->set_live(true);
    return grpc::Status::OK;
  }
  grpc::Status ServerReady(grpc::ServerContext*, const inference::ServerReadyRequest*,
                           inference::ServerReadyResponse* r) override {
    r->set_ready(serving_.load() && engine_.healthy());
    return grpc::Status::OK;
  }
  grpc::Status ModelReady(grpc::ServerContext*, const inference::ModelReadyRequest* q,
                          inference::ModelReadyResponse* r) override {
    if (Status s = CheckModel(q->name(), q->version()); !s.ok()) return ToGrpc(s);
    r->set_ready(serving_.load() && engine_.healthy());
    return grpc::Status::OK;
  }
  grpc::Status ServerMetadata(grpc::ServerContext*, const inference::ServerMetadataRequest*,
                              inference::ServerMetadataResponse* r) override {
    r->set_name("tpserve");
    r->set_version("0.1.0");
    r->add_extensions("statistics");
    r->add_extensions("health");
    return grpc::Status::OK;
  }
  grpc::Status ModelMetadata(grpc::ServerContext*, const inference::ModelMetadataRequest* q,
                             inference::ModelMetadataResponse* r) override {
    if (Status s = CheckModel(q->name(), q->version()); !s.ok()) return ToGrpc(s);
    r->set_name(options_.model_name);
    r->add_versions(kVersion);
    r->set_platform("tpserve_llama");
    auto* in = r->add_inputs();
    in->set_name(kInput);
    in->set_datatype("INT32");
    in->add_shape(-1);  // [n]; [1, n] is accepted too
    auto* logits = r->add_outputs();
    logits->set_name(kLogits);
    logits->set_datatype("FP32");
    logits->add_shape(config_.vocab_size);
    auto* next = r->add_outputs();
    next->set_name(kNextToken);
    next->set_datatype("INT32");
    next->add_shape(1);
    return grpc::Status::OK;
  }

  grpc::Status ModelInfer(grpc::ServerContext* ctx, const inference::ModelInferRequest* q,
                          inference::ModelInferResponse* r) override {
    const Status s = Infer(ctx, *q, r);
    if (!s.ok()) {
      ++fail_count_;
      LogFailure("ModelInfer", q->id(), s);
    }
    return ToGrpc(s);
  }

  grpc::Status ModelStreamInfer(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<inference::ModelStreamInferResponse, inference::ModelInferRequest>*
          stream) override {
    const grpc::Status shutting_down(grpc::StatusCode::UNAVAILABLE,
                                     "the server is shutting down: this stream's earlier "
                                     "requests were answered, send the rest to another replica");
    {
      std::lock_guard lock(streams_mu_);
      if (draining_) return shutting_down;
      // Each open stream holds one of the server's RPC threads: beyond the limit, the threads
      // kept for queued requests, health and metadata calls would go to idle streams.
      if (streams_.size() >= options_.max_streams) {
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            std::to_string(streams_.size()) +
                                " streams are open, the server's limit (--max-streams); close "
                                "one, or send requests with ModelInfer");
      }
      streams_[ctx] = false;  // idle: waiting for a request
    }
    // Marks the stream busy (true) or idle (false); false when the server drains.
    auto set_busy = [&](bool busy) {
      std::lock_guard lock(streams_mu_);
      streams_[ctx] = busy;
      return !draining_;
    };
    grpc::Status end = grpc::Status::OK;
    inference::ModelInferRequest q;
    while (stream->Read(&q)) {
      inference::ModelStreamInferResponse out;
      Status s = set_busy(true) ? Infer(ctx, q, out.mutable_infer_response())
                                : UnavailableError("the server is shutting down");
      if (!s.ok()) {
        ++fail_count_;
        LogFailure("ModelStreamInfer", q.id(), s);
        // As Triton does: the failed request's id, so that the client can tell which one
        // failed; the message keeps the status code's name (a stream has no other place
        // for it).
        out.clear_infer_response();
        out.mutable_infer_response()->set_id(q.id());
        out.set_error_message(s.ToString());
      }
      if (!stream->Write(out)) break;
      if (!set_busy(false)) {
        end = shutting_down;
        break;
      }
    }
    std::lock_guard lock(streams_mu_);
    streams_.erase(ctx);
    return end;
  }

  grpc::Status ModelStatistics(grpc::ServerContext*, const inference::ModelStatisticsRequest* q,
                               inference::ModelStatisticsResponse* r) override {
    if (!q->name().empty()) {
      if (Status s = CheckModel(q->name(), q->version()); !s.ok()) return ToGrpc(s);
    }
    auto* m = r->add_model_stats();
    m->set_name(options_.model_name);
    m->set_version(kVersion);
    m->set_last_inference(last_inference_ms_.load());
    m->set_inference_count(success_count_.load());
    m->set_execution_count(batcher_.batches());
    auto* st = m->mutable_inference_stats();
    st->mutable_success()->set_count(success_count_.load());
    st->mutable_success()->set_ns(success_ns_.load());
    st->mutable_fail()->set_count(fail_count_.load());
    st->mutable_queue()->set_count(success_count_.load());
    st->mutable_queue()->set_ns(queue_ns_.load());
    st->mutable_compute_infer()->set_count(success_count_.load());
    st->mutable_compute_infer()->set_ns(compute_ns_.load());
    return grpc::Status::OK;
  }

  std::string MetricsText() const {
    std::ostringstream o;
    const std::string model = PrometheusLabelValue(options_.model_name);
    const std::string labels = "{model=\"" + model + "\",version=\"1\"}";
    auto metric = [&](const char* name, const char* type, const char* help, uint64_t v) {
      o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n"
        << name << labels << " " << v << "\n";
    };
    metric("nv_inference_request_success", "counter", "Number of successful inference requests",
           success_count_.load());
    metric("nv_inference_request_failure", "counter", "Number of failed inference requests",
           fail_count_.load());
    metric("nv_inference_count", "counter", "Number of inferences performed",
           success_count_.load());
    metric("nv_inference_exec_count", "counter", "Number of engine batches executed",
           batcher_.batches());
    metric("nv_inference_request_duration_us", "counter",
           "Cumulative inference request duration in microseconds", success_ns_.load() / 1000);
    metric("nv_inference_queue_duration_us", "counter",
           "Cumulative time requests spent queued, in microseconds", queue_ns_.load() / 1000);
    metric("nv_inference_compute_infer_duration_us", "counter",
           "Cumulative engine time of the requests' batches, in microseconds",
           compute_ns_.load() / 1000);
    metric("nv_inference_pending_request_count", "gauge", "Requests waiting in the queue",
           batcher_.queued());
    metric("tpserve_batch_tokens_total", "counter",
           "Tokens the engine has run, summed over batches (rate(): tokens/s)",
           batcher_.batch_tokens());
    metric("tpserve_batch_sequences_total", "counter",
           "Requests the engine has run, summed over batches (/ exec_count: mean batch size)",
           batcher_.batch_sequences());
    metric("tpserve_last_batch_tokens", "gauge", "Tokens in the most recent batch",
           static_cast<uint64_t>(batcher_.last_batch_tokens()));
    metric("tpserve_engine_device_memory_bytes", "gauge",
           "Device memory the engine holds on rank 0's GPU (0: CPU backend)",
           engine_.device_memory_bytes());
    // Which overlap settings the TP layers get at the last batch's size.
    const int64_t m = std::max<int64_t>(1, batcher_.last_batch_tokens());
    const char* name = "tpserve_overlap_layers";
    o << "# HELP " << name
      << " TP layers per overlap setting at the most recent batch's size (by layer kind)\n"
      << "# TYPE " << name << " gauge\n";
    for (const OverlapSettingCount& e :
         OverlapSettingsAt(engine_.config(), engine_.overlap(), engine_.tp(), m)) {
      o << name << "{model=\"" << model << "\",kind=\"" << PrometheusLabelValue(e.kind)
        << "\",op=\"" << PrometheusLabelValue(e.op) << "\",mode=\"" << PrometheusLabelValue(e.mode)
        << "\",knobs=\"" << PrometheusLabelValue(e.knobs) << "\",m=\"" << m << "\"} " << e.layers
        << "\n";
    }
    return o.str();
  }

 private:
  Status CheckModel(const std::string& name, const std::string& version) const {
    if (name != options_.model_name) {
      return NotFoundError("unknown model '" + ClientText(name) + "' (this server serves '" +
                           options_.model_name + "')");
    }
    if (!version.empty() && version != kVersion) {
      return NotFoundError("model '" + name + "' has no version '" + ClientText(version) +
                           "' (available: 1)");
    }
    return Status::Ok();
  }

  Status Infer(grpc::ServerContext* ctx, const inference::ModelInferRequest& q,
               inference::ModelInferResponse* r) {
    const auto start = std::chrono::steady_clock::now();
    TP_RETURN_IF_ERROR(CheckModel(q.model_name(), q.model_version()));
    TP_ASSIGN_OR_RETURN(ParsedRequest p, ValidateInferRequest(q, limits_));
    const auto deadline =
        ctx->deadline() == std::chrono::system_clock::time_point::max()
            ? TokenBatcher::Clock::time_point::max()
            : TokenBatcher::Clock::now() + (ctx->deadline() - std::chrono::system_clock::now());
    auto cancelled = std::make_shared<std::atomic<bool>>(false);
    TP_ASSIGN_OR_RETURN(auto future, batcher_.Submit(p.ids, deadline, cancelled));
    while (future.wait_for(std::chrono::milliseconds(5)) != std::future_status::ready) {
      if (ctx->IsCancelled()) cancelled->store(true);
    }
    TP_ASSIGN_OR_RETURN(BatchResult result, future.get());
    r->set_model_name(options_.model_name);
    r->set_model_version(kVersion);
    r->set_id(q.id());
    if (p.want_logits) {
      auto* o = r->add_outputs();
      o->set_name(kLogits);
      o->set_datatype("FP32");
      if (p.batched_shape) o->add_shape(1);
      o->add_shape(config_.vocab_size);
      r->add_raw_output_contents(std::string(reinterpret_cast<const char*>(result.logits.data()),
                                             result.logits.size() * sizeof(float)));
    }
    if (p.want_next) {
      const int32_t next = static_cast<int32_t>(
          std::max_element(result.logits.begin(), result.logits.end()) - result.logits.begin());
      auto* o = r->add_outputs();
      o->set_name(kNextToken);
      o->set_datatype("INT32");
      if (p.batched_shape) o->add_shape(1);
      o->add_shape(1);
      r->add_raw_output_contents(std::string(reinterpret_cast<const char*>(&next), sizeof next));
    }
    ++success_count_;
    success_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now() - start)
                       .count();
    queue_ns_ += result.queue_ns;
    compute_ns_ += result.compute_ns;
    last_inference_ms_ = NowNs() / 1000000;
    return Status::Ok();
  }

  const ServerOptions options_;
  const Engine& engine_;
  const ModelConfig config_;
  const RequestLimits limits_{config_.vocab_size, LongestRequest(options_, config_)};
  TokenBatcher& batcher_;
  std::atomic<bool> serving_{false};
  // Open ModelStreamInfer calls and whether each is answering a request.
  std::mutex streams_mu_;
  std::map<grpc::ServerContext*, bool> streams_;
  bool draining_ = false;  // guarded by streams_mu_
  std::atomic<uint64_t> success_count_{0}, fail_count_{0}, success_ns_{0}, queue_ns_{0},
      compute_ns_{0}, last_inference_ms_{0};
};

StatusOr<std::unique_ptr<InferenceServer>> InferenceServer::Start(ServerOptions options,
                                                                  std::shared_ptr<Engine> engine) {
  if (!engine) return InvalidArgumentError("no engine to serve");
  auto s = std::unique_ptr<InferenceServer>(new InferenceServer());
  s->engine_ = std::move(engine);
  Engine* eng = s->engine_.get();
  s->batcher_ =
      std::make_unique<TokenBatcher>(options.batcher, eng->config().vocab_size,
                                     [eng](const TokenBatch& b) { return eng->Forward(b); });
  s->service_ = std::make_unique<InferenceService>(options, *eng, *s->batcher_);
  const int64_t longest = LongestRequest(options, eng->config());
  if (longest < options.max_tokens_per_request) {
    spdlog::info(
        "requests are limited to {} tokens, not --max-tokens-per-request {} "
        "(--max-batch-tokens {}, max_position_embeddings {})",
        longest, options.max_tokens_per_request, options.batcher.max_batch_tokens,
        eng->config().max_position_embeddings);
  }
  TP_ASSIGN_OR_RETURN(auto credentials, MakeCredentials(options));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.grpc_address, credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  // Bounds on what one client can make the server hold. Each RPC in progress
  // (a queued unary request, one in the running batch, an open stream) holds a
  // thread of the synchronous server: the queue's size, a batch's requests and
  // the open streams' limit, plus spare threads for health and metadata calls
  // and requests on their way to the queue; beyond them new calls get
  // RESOURCE_EXHAUSTED.
  // A request carries at most the longest accepted prompt (int64 varints:
  // up to 10 bytes a token); the margin lets a somewhat longer one through to
  // the precise INVALID_ARGUMENT that names the limit.
  grpc::ResourceQuota quota("tpserve");
  const uint64_t threads =
      uint64_t{options.batcher.max_queue_size} +
      static_cast<uint64_t>(std::max<int64_t>(options.batcher.max_batch_sequences, 0)) +
      options.max_streams + kSpareRpcThreads;
  quota.SetMaxThreads(static_cast<int>(std::min<uint64_t>(threads, INT_MAX)));
  builder.SetResourceQuota(quota);
  const int64_t max_message = std::max<int64_t>(1 << 20, 16 * longest + (64 << 10));
  builder.SetMaxReceiveMessageSize(static_cast<int>(std::min<int64_t>(max_message, INT_MAX)));
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    return UnavailableError("cannot listen on " + options.grpc_address +
                            " (address in use or not valid?)");
  }
  s->service_->set_serving(true);
  s->server_->GetHealthCheckService()->SetServingStatus(true);
  InferenceServer* self = s.get();
  s->health_watch_ = std::thread([self] {
    std::unique_lock lock(self->watch_mu_);
    while (!self->stopped_.load()) {
      self->watch_cv_.wait_for(lock, std::chrono::milliseconds(200));
      if (!self->stopped_.load() && !self->engine_->healthy()) {
        spdlog::error("the engine failed: health NOT_SERVING");
        self->service_->set_serving(false);
        self->server_->GetHealthCheckService()->SetServingStatus(false);
        return;
      }
    }
  });
  spdlog::info("serving model '{}' over gRPC on port {}", options.model_name, s->port_);
  return s;
}

InferenceServer::~InferenceServer() { Shutdown(std::chrono::system_clock::now()); }

void InferenceServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (stopped_.exchange(true)) return;
  watch_cv_.notify_all();
  if (health_watch_.joinable()) health_watch_.join();
  if (server_) {
    service_->set_serving(false);
    server_->GetHealthCheckService()->SetServingStatus(false);
    service_->BeginDrain();
    server_->Shutdown(deadline);  // waits for in-flight RPCs (the batcher still runs)
    server_->Wait();
  }
  // Stopped, not destroyed: the service (and MetricsText, which a metrics
  // scrape may call during or after the drain) keeps a reference to it; the
  // destructor frees it after the service, and its worker has nothing left.
  if (batcher_) batcher_->Stop();
}

std::string InferenceServer::MetricsText() const { return service_->MetricsText(); }

}  // namespace tpserve
