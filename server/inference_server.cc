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
#include "server/infer_calls.h"
#include "server/request_validation.h"

namespace tpserve {
namespace {

constexpr char kInput[] = "input_ids";
constexpr char kLogits[] = "logits";
constexpr char kNextToken[] = "next_token_id";
constexpr char kVersion[] = "1";
// Threads of the synchronous methods (health, metadata, statistics): the
// inference RPCs are callbacks and hold none while they wait.
constexpr int kSyncRpcThreads = 64;

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
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

class InferenceService final
    : public inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
          inference::GRPCInferenceService::WithRawCallbackMethod_ModelStreamInfer<
              inference::GRPCInferenceService::Service>> {
 public:
  InferenceService(const ServerOptions& options, const Engine& engine, TokenBatcher& batcher,
                   Generator* generator)
      : options_(options),
        engine_(engine),
        config_(engine.config()),
        batcher_(batcher),
        generator_(generator) {
    ctx_.model_name = options.model_name;
    ctx_.config = &config_;
    ctx_.limits = {config_.vocab_size, LongestRequest(options, config_)};
    ctx_.batcher = &batcher;
    ctx_.generator = generator;
    ctx_.max_streams = options.max_streams;
    ctx_.max_requests_per_stream = options.max_requests_per_stream;
  }

  void set_serving(bool serving) { serving_ = serving; }
  ServingContext& context() { return ctx_; }

  // The start of a shutdown: new requests get UNAVAILABLE, open streams stop
  // reading and end once their requests are answered.
  void BeginDrain() {
    ctx_.draining = true;
    ctx_.DrainStreams();
  }

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* call,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override {
    return StartUnaryCall(ctx_, call, request, response);
  }
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* call) override {
    return StartStreamCall(ctx_, call);
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
    if (Status s = ctx_.CheckModel(q->name(), q->version()); !s.ok()) return ToGrpc(s);
    r->set_ready(serving_.load() && engine_.healthy());
    return grpc::Status::OK;
  }
  grpc::Status ServerMetadata(grpc::ServerContext*, const inference::ServerMetadataRequest*,
                              inference::ServerMetadataResponse* r) override {
    r->set_name("tpserve");
    r->set_version("0.1.0");
    r->add_extensions("statistics");
    r->add_extensions("health");
    if (generator_ != nullptr) r->add_extensions("generation");
    return grpc::Status::OK;
  }
  grpc::Status ModelMetadata(grpc::ServerContext*, const inference::ModelMetadataRequest* q,
                             inference::ModelMetadataResponse* r) override {
    if (Status s = ctx_.CheckModel(q->name(), q->version()); !s.ok()) return ToGrpc(s);
    r->set_name(options_.model_name);
    r->add_versions(kVersion);
    r->set_platform("tpserve_llama");
    auto tensor = [](auto* t, const char* name, const char* dtype,
                     std::initializer_list<int64_t> shape) {
      t->set_name(name);
      t->set_datatype(dtype);
      for (int64_t d : shape) t->add_shape(d);
    };
    tensor(r->add_inputs(), kInput, "INT32", {-1});  // [n]; [1, n] is accepted too
    tensor(r->add_outputs(), kLogits, "FP32", {config_.vocab_size});
    tensor(r->add_outputs(), kNextToken, "INT32", {1});
    if (generator_ != nullptr) {
      // Generation, in the tensor names of Triton's TensorRT-LLM backend
      // (server/generation_request.h).
      tensor(r->add_inputs(), "input_lengths", "INT32", {1});
      tensor(r->add_inputs(), "request_output_len", "INT32", {1});
      tensor(r->add_inputs(), "end_id", "INT32", {1});
      tensor(r->add_inputs(), "pad_id", "INT32", {1});
      tensor(r->add_inputs(), "streaming", "BOOL", {1});
      tensor(r->add_inputs(), "temperature", "FP32", {1});
      tensor(r->add_inputs(), "runtime_top_k", "INT32", {1});
      tensor(r->add_inputs(), "runtime_top_p", "FP32", {1});
      tensor(r->add_inputs(), "seed", "UINT64", {1});
      tensor(r->add_inputs(), "stop_words_list", "INT32", {2, -1});
      tensor(r->add_inputs(), "return_log_probs", "BOOL", {1});
      tensor(r->add_inputs(), "exclude_input_in_output", "BOOL", {1});
      tensor(r->add_outputs(), "output_ids", "INT32", {1, -1});
      tensor(r->add_outputs(), "sequence_length", "INT32", {1});
      tensor(r->add_outputs(), "output_log_probs", "FP32", {1, -1});
    }
    return grpc::Status::OK;
  }

  grpc::Status ModelStatistics(grpc::ServerContext*, const inference::ModelStatisticsRequest* q,
                               inference::ModelStatisticsResponse* r) override {
    if (!q->name().empty()) {
      if (Status s = ctx_.CheckModel(q->name(), q->version()); !s.ok()) return ToGrpc(s);
    }
    const uint64_t success = ctx_.success_count.load();
    auto* m = r->add_model_stats();
    m->set_name(options_.model_name);
    m->set_version(kVersion);
    m->set_last_inference(ctx_.last_inference_ms.load());
    m->set_inference_count(success);
    m->set_execution_count(batcher_.batches() +
                           (generator_ != nullptr ? generator_->stats().steps : 0));
    auto* st = m->mutable_inference_stats();
    st->mutable_success()->set_count(success);
    st->mutable_success()->set_ns(ctx_.success_ns.load());
    st->mutable_fail()->set_count(ctx_.fail_count.load());
    st->mutable_queue()->set_count(success);
    st->mutable_queue()->set_ns(ctx_.queue_ns.load());
    st->mutable_compute_infer()->set_count(success);
    st->mutable_compute_infer()->set_ns(ctx_.compute_ns.load());
    return grpc::Status::OK;
  }

  std::string MetricsText() const {
    std::ostringstream o;
    const std::string model = PrometheusLabelValue(options_.model_name);
    const std::string label_text = "model=\"" + model + "\",version=\"1\"";
    const std::string labels = "{" + label_text + "}";
    auto metric = [&](const char* name, const char* type, const char* help, uint64_t v) {
      o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n"
        << name << labels << " " << v << "\n";
    };
    metric("nv_inference_request_success", "counter", "Number of successful inference requests",
           ctx_.success_count.load());
    metric("nv_inference_request_failure", "counter", "Number of failed inference requests",
           ctx_.fail_count.load());
    metric("nv_inference_count", "counter", "Number of inferences performed",
           ctx_.success_count.load());
    metric("nv_inference_exec_count", "counter", "Number of engine batches executed",
           batcher_.batches());
    metric("nv_inference_request_duration_us", "counter",
           "Cumulative inference request duration in microseconds", ctx_.success_ns.load() / 1000);
    metric("nv_inference_queue_duration_us", "counter",
           "Cumulative time requests spent queued, in microseconds", ctx_.queue_ns.load() / 1000);
    metric("nv_inference_compute_infer_duration_us", "counter",
           "Cumulative engine time of the requests' batches, in microseconds",
           ctx_.compute_ns.load() / 1000);
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
    metric("tpserve_open_streams", "gauge", "Open ModelStreamInfer streams",
           static_cast<uint64_t>(std::max<int64_t>(0, ctx_.open_streams.load())));
    if (generator_ != nullptr) {
      const GeneratorStats g = generator_->stats();
      metric("tpserve_generation_running", "gauge", "Sequences holding KV cache blocks",
             static_cast<uint64_t>(g.running));
      metric("tpserve_generation_waiting", "gauge", "Sequences waiting for admission",
             static_cast<uint64_t>(g.waiting));
      metric("tpserve_kv_cache_blocks_used", "gauge", "KV cache blocks in use",
             static_cast<uint64_t>(g.blocks_used));
      metric("tpserve_kv_cache_blocks_free", "gauge", "KV cache blocks free",
             static_cast<uint64_t>(g.blocks_free));
      metric("tpserve_generation_preemptions_total", "counter",
             "Sequences preempted (blocks freed, recomputed later) when the KV cache ran out",
             g.preemptions);
      metric("tpserve_generation_tokens_total", "counter", "Tokens generated", g.generated_tokens);
      metric("tpserve_generation_steps_total", "counter", "Generation steps run", g.steps);
      metric("tpserve_generation_step_tokens_total", "counter",
             "Tokens run in generation steps (prefill chunks and decode)", g.step_tokens);
      metric("tpserve_generation_cancelled_total", "counter",
             "Generation requests cancelled (client gone, RPC cancelled)", g.cancelled);
    }
    ctx_.metrics.Render(o, label_text);
    // Which overlap settings the TP layers get at the last batch's size.
    const int64_t m = std::max<int64_t>(1, batcher_.last_batch_tokens());
    const char* name = "tpserve_overlap_layers";
    o << "# HELP " << name
      << " TP layers per overlap setting at the most recent batch's size (by layer kind)\n"
      << "# TYPE " << name << " gauge\n";
    for (const OverlapSettingCount& e : OverlapSettingsAt(
             engine_.config(), engine_.overlap(), engine_.tp(), m, engine_.scale_scheme())) {
      o << name << "{model=\"" << model << "\",kind=\"" << PrometheusLabelValue(e.kind)
        << "\",op=\"" << PrometheusLabelValue(e.op) << "\",mode=\"" << PrometheusLabelValue(e.mode)
        << "\",knobs=\"" << PrometheusLabelValue(e.knobs) << "\",m=\"" << m << "\"} " << e.layers
        << "\n";
    }
    return o.str();
  }

 private:
  const ServerOptions options_;
  const Engine& engine_;
  const ModelConfig config_;
  TokenBatcher& batcher_;
  Generator* const generator_;
  ServingContext ctx_;
  std::atomic<bool> serving_{false};
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
  if (eng->kv_cache_layout().num_blocks > 0) {
    GeneratorOptions go = options.generation;
    go.max_queued = options.batcher.max_queue_size;
    go.scheduler.max_new_tokens =
        std::min(go.scheduler.max_new_tokens, eng->config().max_position_embeddings);
    TP_ASSIGN_OR_RETURN(s->generator_, Generator::Start(go, s->engine_));
    const KvCacheLayout kv = eng->kv_cache_layout();
    spdlog::info(
        "generation: KV cache of {} blocks x {} tokens ({} tokens, {} per rank, {:.1f} MiB per "
        "rank), step budget {} tokens, at most {} running sequences",
        kv.num_blocks, kv.block_size, kv.num_blocks * kv.block_size, KvCacheDtypeName(kv.dtype),
        kv.BlockBytes() * kv.num_blocks / 1048576.0, go.scheduler.max_step_tokens,
        go.scheduler.max_running);
  }
  s->service_ =
      std::make_unique<InferenceService>(options, *eng, *s->batcher_, s->generator_.get());
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
  // Bounds on what clients can make the server hold: threads of the
  // synchronous methods; HTTP/2 streams per connection; keepalive pings no
  // more often than every 10 s without data (more, twice: the connection
  // is closed); and a memory quota for gRPC's buffers.
  grpc::ResourceQuota quota("tpserve");
  quota.SetMaxThreads(kSyncRpcThreads);
  if (options.grpc_memory_bytes > 0) quota.Resize(options.grpc_memory_bytes);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(
      GRPC_ARG_MAX_CONCURRENT_STREAMS,
      static_cast<int>(std::min<int64_t>(options.max_streams_per_connection, INT_MAX)));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
  // A request carries at most the longest accepted prompt (int64 varints:
  // up to 10 bytes a token); the margin lets a somewhat longer one through to
  // the precise INVALID_ARGUMENT that names the limit.
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
    // Drain while still listening, so that health checks keep answering
    // NOT_SERVING: new requests get UNAVAILABLE, the accepted ones finish
    // (until the deadline), then the server stops and cancels what is left.
    service_->set_serving(false);
    server_->GetHealthCheckService()->SetServingStatus(false);
    service_->BeginDrain();
    batcher_->Flush();
    while (service_->context().calls_in_progress.load() > 0 &&
           std::chrono::system_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    server_->Shutdown(deadline);
    server_->Wait();
  }
  // Stopped, not destroyed: the service (and MetricsText, which a metrics
  // scrape may call during or after the drain) keeps references to them; the
  // destructor frees them after the service.
  if (generator_) generator_->Stop(std::chrono::steady_clock::now());
  if (batcher_) batcher_->Stop();
}

std::string InferenceServer::MetricsText() const { return service_->MetricsText(); }

}  // namespace tpserve
