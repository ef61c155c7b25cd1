// `tpserve serve`: the KServe v2 gRPC server with Prometheus metrics, running
// until SIGTERM/SIGINT, then draining accepted requests.
#include <httplib.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "comm/nccl_config.h"
#include "engine/cpu_engine.h"
#include "server/cli.h"
#include "server/inference_server.h"

namespace tpserve {
namespace {

struct ServeFlags {
  std::string model = "tiny";
  std::string model_name;
  int tp = 2;
  std::string backend = "auto";
  std::string overlap_config;
  std::string dtype = "fp8";
  uint64_t seed = 7;
  std::string host = "0.0.0.0";
  int grpc_port = 8001;
  std::string metrics_host = "127.0.0.1";
  int metrics_port = 8002;
  int64_t max_batch_tokens = 8192;
  int64_t max_queue_delay_us = 2000;
  int64_t max_queue_size = 1024;
  int64_t max_tokens_per_request = 4096;
  double exit_timeout_s = 30;
  std::string tls_cert, tls_key, tls_client_ca;
};

int Serve(const ServeFlags& f) {
  // Signals are taken by a waiting thread, not a handler: block them in
  // every thread first (threads inherit the mask).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (f.backend == "cuda") {
    spdlog::error("--backend cuda: the GPU engine is not built yet (issue 5); use cpu");
    return 2;
  }
  // auto: the GPU engine does not exist yet, so the CPU reference backend.
  bool from_dir = false;
  auto config = ResolveModel(f.model, &from_dir);
  if (!config.ok()) {
    spdlog::error("{}", config.status().ToString());
    return 2;
  }
  CpuEngineOptions eo;
  eo.config = *config;
  eo.tp = f.tp;
  eo.dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  eo.seed = f.seed;
  if (from_dir) eo.checkpoint_dir = f.model;
  if (!f.overlap_config.empty()) {
    auto cfg = OverlapConfig::LoadFile(f.overlap_config);
    if (!cfg.ok()) {
      spdlog::error("{}", cfg.status().ToString());
      return 2;
    }
    eo.overlap = std::make_shared<OverlapConfig>(std::move(cfg).value());
  }
  spdlog::info("loading {} ({} layers, hidden {}) on the CPU backend, tp={}", config->name,
               config->num_hidden_layers, config->hidden_size, f.tp);
  auto engine = CpuEngine::Start(eo);
  if (!engine.ok()) {
    spdlog::error("{}", engine.status().ToString());
    return 1;
  }
  ServerOptions so;
  so.model_name = f.model_name.empty()
                      ? (from_dir ? std::filesystem::path(f.model).filename().string() : f.model)
                      : f.model_name;
  so.grpc_address = f.host + ":" + std::to_string(f.grpc_port);
  so.max_tokens_per_request = f.max_tokens_per_request;
  so.tls_cert_file = f.tls_cert;
  so.tls_key_file = f.tls_key;
  so.tls_client_ca_file = f.tls_client_ca;
  so.batcher.max_batch_tokens = f.max_batch_tokens;
  so.batcher.max_queue_delay = std::chrono::microseconds(f.max_queue_delay_us);
  so.batcher.max_queue_size = static_cast<size_t>(f.max_queue_size);
  auto server = InferenceServer::Start(so, std::shared_ptr<CpuEngine>(std::move(engine).value()));
  if (!server.ok()) {
    spdlog::error("{}", server.status().ToString());
    return 1;
  }
  InferenceServer* srv = server->get();

  httplib::Server metrics;
  metrics.Get("/metrics", [srv](const httplib::Request&, httplib::Response& res) {
    res.set_content(srv->MetricsText(), "text/plain; version=0.0.4");
  });
  std::thread metrics_thread;
  if (f.metrics_port > 0) {
    if (!metrics.bind_to_port(f.metrics_host, f.metrics_port)) {
      spdlog::error("cannot serve metrics on {}:{}", f.metrics_host, f.metrics_port);
      return 1;
    }
    metrics_thread = std::thread([&] { metrics.listen_after_bind(); });
    spdlog::info("metrics on http://{}:{}/metrics", f.metrics_host, f.metrics_port);
  }
  std::printf("tpserve: serving '%s' on gRPC port %d\n", so.model_name.c_str(), srv->port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("{} received: draining (up to {} s)", sig == SIGTERM ? "SIGTERM" : "SIGINT",
               f.exit_timeout_s);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(f.exit_timeout_s * 1000));
  srv->Shutdown(deadline);
  if (metrics_thread.joinable()) {
    metrics.stop();
    metrics_thread.join();
  }
  server->reset();  // engine threads stop after the server
  spdlog::info("stopped");
  return 0;
}

}  // namespace

void AddServeCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ServeFlags>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Serve a model over gRPC (KServe v2 / Open Inference Protocol) with Prometheus metrics; "
      "SIGTERM or SIGINT drains accepted requests and exits 0");
  cmd->add_option("--model", f->model,
                  "A preset (tiny, llama3-8b, llama3-70b: random weights) or a directory with "
                  "config.json and *.safetensors")
      ->capture_default_str();
  cmd->add_option("--model-name", f->model_name,
                  "Name clients address (default: the preset or directory name)");
  cmd->add_option("--tp", f->tp, "Tensor-parallel size")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--backend", f->backend,
                  "auto (cuda when GPUs exist, else cpu; the GPU engine is not built yet, so "
                  "cpu), cuda, or cpu (ranks are threads)")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}))
      ->capture_default_str();
  cmd->add_option("--overlap-config", f->overlap_config,
                  "Overlap config (YAML) choosing each TP layer's mode by name and M");
  cmd->add_option("--dtype", f->dtype, "Random weights: fp8 or bf16")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of random weights")->capture_default_str();
  cmd->add_option("--host", f->host, "gRPC bind address")->capture_default_str();
  cmd->add_option("--grpc-port", f->grpc_port, "gRPC port (0: pick a free one)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--metrics-host", f->metrics_host, "Metrics bind address")->capture_default_str();
  cmd->add_option("--metrics-port", f->metrics_port, "Prometheus /metrics port (0: off)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", f->max_batch_tokens, "Tokens per engine batch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-queue-delay-us", f->max_queue_delay_us,
                  "Longest wait for batch-mates, microseconds")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--max-queue-size", f->max_queue_size,
                  "Queued requests beyond this get RESOURCE_EXHAUSTED")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-request", f->max_tokens_per_request,
                  "Longest prompt accepted (INVALID_ARGUMENT beyond)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--exit-timeout", f->exit_timeout_s,
                  "Seconds to finish accepted requests after SIGTERM")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--tls-cert", f->tls_cert, "PEM certificate chain: serve gRPC over TLS");
  cmd->add_option("--tls-key", f->tls_key, "PEM private key of --tls-cert");
  cmd->add_option("--tls-client-ca", f->tls_client_ca,
                  "PEM CA bundle: require client certificates signed by it (mutual TLS)");
  cmd->callback([f, exit_code] { *exit_code = Serve(*f); });
}

}  // namespace tpserve
