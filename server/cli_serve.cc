// `tpserve serve`: the KServe v2 gRPC server with Prometheus metrics, running
// until SIGTERM/SIGINT, then draining accepted requests.
#include <netdb.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/cli_numbers.h"
#include "comm/nccl_config.h"
#include "engine/cpu_engine.h"
#if TPSERVE_WITH_CUDA
#include "comm/nccl_thread_group.h"
#include "engine/cuda_engine.h"
#endif
#include "layers/gemm_algo_flag.h"
#include "server/cli.h"
#include "server/cli_cuda_only.h"
#include "server/inference_server.h"
#include "server/metrics_http.h"

namespace tpserve {
namespace {

// Seconds that tearing down may take after the drain's exit timeout.
constexpr int kTeardownGraceS = 20;
// Longest --exit-timeout / --rank-timeout-s: a week (their milliseconds must fit int64).
constexpr double kMaxTimeoutS = 7 * 24 * 3600.0;

struct ServeFlags {
  std::string model = "tiny";
  std::string model_name;
  int tp = 2;
  std::string backend = "auto";
  std::string overlap_config;
  std::string dtype = "fp8";
  uint64_t seed = 7;
  bool seed_given = false;  // serve: --seed on the command line (refused with a checkpoint)
  std::string host = "0.0.0.0";
  int grpc_port = 8001;
  std::string metrics_host = "127.0.0.1";
  int metrics_port = 8002;
  // The /metrics server's bounds (MetricsHttpOptions).
  int metrics_max_connections = 64;
  int64_t metrics_max_header_bytes = 8192;
  double metrics_read_timeout_s = 5;
  double metrics_write_timeout_s = 5;
  int64_t max_batch_tokens = 8192;
  int64_t max_queue_delay_us = 2000;
  int64_t max_queue_size = 1024;
  int64_t max_streams = 1024;
  int64_t max_batch_sequences = 256;
  // Generation (engine/generator.h).
  double kv_cache_gib = 0.25;
  int64_t kv_cache_blocks = 0;  // > 0: exactly this many (overrides --kv-cache-gib)
  int64_t kv_block_size = 16;
  std::string kv_cache_dtype = "bf16";
  int64_t max_step_tokens = 2048;
  int64_t max_running_sequences = 256;
  int64_t max_output_len = 4096;
  int64_t max_requests_per_stream = 64;
  double rank_timeout_s = 300;
  bool device_random_weights = false;
  int64_t max_tokens_per_request = 4096;
  double exit_timeout_s = 30;
  std::string tls_cert, tls_key, tls_client_ca;
  std::string gemm_algo = "timed";
  // Those of the cuda-only flags (CudaOnly) given on the command line,
  // whatever their value: --backend cpu refuses them, auto on the cpu warns.
  std::vector<std::string> cuda_only_given;
};

// The model (--model) and the overlap config (--overlap-config, may be
// absent) that serve and worker load alike.
StatusOr<ModelConfig> LoadModelFlags(const ServeFlags& f, bool* from_dir,
                                     std::shared_ptr<const OverlapConfig>* overlap) {
  TP_ASSIGN_OR_RETURN(ModelConfig config, ResolveModel(f.model, from_dir));
  if (!f.overlap_config.empty()) {
    TP_ASSIGN_OR_RETURN(OverlapConfig cfg, OverlapConfig::LoadFile(f.overlap_config));
    *overlap = std::make_shared<OverlapConfig>(std::move(cfg));
  }
  return config;
}

// The fields CpuEngineOptions and CudaEngineOptions share.
template <class Options>
Options CommonEngineOptions(const ServeFlags& f, const ModelConfig& config, bool from_dir,
                            std::shared_ptr<const OverlapConfig> overlap) {
  Options eo;
  eo.config = config;
  eo.tp = f.tp;
  eo.dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  eo.seed = f.seed;
  if (from_dir) eo.checkpoint_dir = f.model;
  eo.overlap = std::move(overlap);
  return eo;
}

// LoadModelFlags, logging the error; false on error.
bool LoadModelFlagsOrLog(const ServeFlags& f, ModelConfig* config, bool* from_dir,
                         std::shared_ptr<const OverlapConfig>* overlap) {
  auto loaded = LoadModelFlags(f, from_dir, overlap);
  if (!loaded.ok()) {
    spdlog::error("{}", loaded.status().ToString());
    return false;
  }
  *config = std::move(loaded).value();
  return true;
}

#if TPSERVE_WITH_CUDA
// Who this process is in the TP group: from a launcher's environment
// (mpirun, LeaderWorkerSet, or tpserve's own for spawned ranks), else rank 0
// of a single node.
StatusOr<LaunchPlan> LaunchPlanFor(const ServeFlags& f) {
  return PlanLaunch(RankInfoFromEnv(), f.tp);
}

// What both rank 0 and the workers build the CUDA engine from, including
// the command line of the ranks a process starts itself (`tpserve worker`
// with the same model flags) and the rendezvous address of several nodes.
StatusOr<CudaEngineOptions> CudaOptions(const ServeFlags& f, const ModelConfig& config,
                                        bool from_dir,
                                        std::shared_ptr<const OverlapConfig> overlap) {
  auto eo = CommonEngineOptions<CudaEngineOptions>(f, config, from_dir, std::move(overlap));
  eo.model.max_tokens = f.max_batch_tokens;
  eo.model.max_seqs = f.max_batch_sequences;
  eo.timeout = std::chrono::milliseconds(static_cast<int64_t>(f.rank_timeout_s * 1000));
  eo.device_random_weights = f.device_random_weights;
  // The KV cache (generation): --kv-cache-blocks, else as many blocks as --kv-cache-gib
  // holds (0: none, logits requests only). Workers get the block count itself.
  TP_ASSIGN_OR_RETURN(eo.model.kv_dtype, ParseKvCacheDtype(f.kv_cache_dtype));
  eo.model.kv_block_size = f.kv_block_size;
  eo.model.kv_blocks = f.kv_cache_blocks;
  if (eo.model.kv_blocks == 0 && f.kv_cache_gib > 0) {
    const KvCacheLayout per_block{config.num_hidden_layers, 1,
                                  f.kv_block_size,          config.num_key_value_heads / f.tp,
                                  config.head_dim(),        eo.model.kv_dtype};
    eo.model.kv_blocks = static_cast<int64_t>(f.kv_cache_gib * 1073741824.0 /
                                              static_cast<double>(per_block.BlockBytes()));
    if (eo.model.kv_blocks < 1) {
      return InvalidArgumentError("--kv-cache-gib " + std::to_string(f.kv_cache_gib) +
                                  " holds no block of " + std::to_string(per_block.BlockBytes()) +
                                  " bytes");
    }
  }
  eo.worker_argv = {"/proc/self/exe",     "worker",  "--model", f.model,  "--tp",
                    std::to_string(f.tp), "--dtype", f.dtype,   "--seed", std::to_string(f.seed)};
  for (auto [flag, value] : {std::pair<const char*, std::string>{
                                 "--max-batch-tokens", std::to_string(f.max_batch_tokens)},
                             {"--max-batch-sequences", std::to_string(f.max_batch_sequences)},
                             {"--rank-timeout-s", std::to_string(f.rank_timeout_s)},
                             {"--kv-cache-blocks", std::to_string(eo.model.kv_blocks)},
                             {"--kv-cache-gib", "0"},
                             {"--kv-block-size", std::to_string(f.kv_block_size)},
                             {"--kv-cache-dtype", f.kv_cache_dtype},
                             {"--gemm-algo", f.gemm_algo}}) {
    eo.worker_argv.push_back(flag);
    eo.worker_argv.push_back(value);
  }
  if (f.device_random_weights) eo.worker_argv.push_back("--device-random-weights");
  if (!f.overlap_config.empty()) {
    eo.worker_argv.push_back("--overlap-config");
    eo.worker_argv.push_back(f.overlap_config);
  }
  TP_ASSIGN_OR_RETURN(eo.launch, LaunchPlanFor(f));
  if (eo.launch->fetch_id || eo.launch->serve_id_clients > 0) {
    TP_ASSIGN_OR_RETURN(eo.rendezvous, RendezvousAddressFromEnv());
  }
  return eo;
}
#endif

// The backend that serves, decided before the model loads: --backend cpu or
// cuda as given (cuda checked against this build and node); auto is cuda when
// this build has CUDA and the node has its share of the --tp GPUs, else cpu,
// with *why_cpu saying why.
StatusOr<std::string> ResolveBackend(const ServeFlags& f, std::string* why_cpu) {
  if (f.backend == "cpu") return std::string("cpu");
#if TPSERVE_WITH_CUDA
  // This node's share of the group: itself and the ranks it starts.
  TP_ASSIGN_OR_RETURN(LaunchPlan plan, LaunchPlanFor(f));
  const int needed = plan.local_rank + 1 + static_cast<int>(plan.spawn_ranks.size());
  const int devices = CudaDeviceCount();
  if (devices >= needed) return std::string("cuda");
  if (f.backend == "cuda") {
    return InvalidArgumentError("--backend cuda --tp " + std::to_string(f.tp) + " needs " +
                                std::to_string(needed) + " GPUs on this node; it has " +
                                std::to_string(devices));
  }
  *why_cpu = "this node has " + std::to_string(devices) + " GPUs, --tp " + std::to_string(f.tp) +
             " needs " + std::to_string(needed);
#else
  if (f.backend == "cuda") {
    return InvalidArgumentError(
        "--backend cuda: this build has no CUDA (configure with a CUDA "
        "toolkit); use --backend cpu");
  }
  *why_cpu = "this build has no CUDA";
#endif
  return std::string("cpu");
}

// `backend`: ResolveBackend's answer.
StatusOr<std::shared_ptr<Engine>> StartEngine(const ServeFlags& f, const std::string& backend,
                                              const ModelConfig& config, bool from_dir,
                                              std::shared_ptr<const OverlapConfig> overlap) {
#if TPSERVE_WITH_CUDA
  if (backend == "cuda") {
    TP_ASSIGN_OR_RETURN(CudaEngineOptions eo, CudaOptions(f, config, from_dir, std::move(overlap)));
    // A generation step must fit the engine's batch limits (its buffers and graphs).
    if (eo.model.kv_blocks > 0 && (f.max_step_tokens > f.max_batch_tokens ||
                                   f.max_running_sequences > f.max_batch_sequences)) {
      return InvalidArgumentError(
          "--backend cuda: --max-step-tokens (" + std::to_string(f.max_step_tokens) +
          ") and --max-running-sequences (" + std::to_string(f.max_running_sequences) +
          ") must not exceed --max-batch-tokens (" + std::to_string(f.max_batch_tokens) +
          ") and --max-batch-sequences (" + std::to_string(f.max_batch_sequences) + ")");
    }
    spdlog::info("loading {} ({} layers, hidden {}) on the CUDA backend, tp={}", config.name,
                 config.num_hidden_layers, config.hidden_size, f.tp);
    if (eo.model.kv_blocks > 0) {
      const KvCacheLayout per_block{config.num_hidden_layers, 1,
                                    f.kv_block_size,          config.num_key_value_heads / f.tp,
                                    config.head_dim(),        eo.model.kv_dtype};
      spdlog::info("KV cache: {} blocks of {} tokens ({}), {:.1f} MiB per GPU", eo.model.kv_blocks,
                   f.kv_block_size, f.kv_cache_dtype,
                   eo.model.kv_blocks * per_block.BlockBytes() / 1048576.0);
    } else {
      spdlog::info("KV cache: none (--kv-cache-gib 0): logits requests only, no generation");
    }
    TP_ASSIGN_OR_RETURN(auto engine, CudaEngine::Start(std::move(eo)));
    return std::shared_ptr<Engine>(std::move(engine));
  }
#else
  (void)backend;  // always cpu here: ResolveBackend refused cuda
#endif
  auto eo = CommonEngineOptions<CpuEngineOptions>(f, config, from_dir, std::move(overlap));
  TP_ASSIGN_OR_RETURN(eo.kv_dtype, ParseKvCacheDtype(f.kv_cache_dtype));
  eo.kv_block_size = f.kv_block_size;
  eo.kv_blocks = f.kv_cache_blocks;
  if (eo.kv_blocks == 0 && f.kv_cache_gib > 0) {
    // One rank's share: its KV heads of every layer, per block.
    KvCacheLayout per_block{config.num_hidden_layers, 1,
                            f.kv_block_size,          config.num_key_value_heads / f.tp,
                            config.head_dim(),        eo.kv_dtype};
    eo.kv_blocks = static_cast<int64_t>(f.kv_cache_gib * 1073741824.0 /
                                        static_cast<double>(per_block.BlockBytes()));
    if (eo.kv_blocks < 1) {
      return InvalidArgumentError("--kv-cache-gib " + std::to_string(f.kv_cache_gib) +
                                  " holds no block of " + std::to_string(per_block.BlockBytes()) +
                                  " bytes");
    }
  }
  spdlog::info("loading {} ({} layers, hidden {}) on the CPU backend, tp={}", config.name,
               config.num_hidden_layers, config.hidden_size, f.tp);
  TP_ASSIGN_OR_RETURN(auto engine, CpuEngine::Start(eo));
  return std::shared_ptr<Engine>(std::move(engine));
}

// Hands a signal from the signal thread to Serve once the server is up.
class SignalBox {
 public:
  // Signal thread: true if the server is up and takes the signal; false if
  // it is still starting (the caller then exits).
  bool Deliver(int sig) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!serving_) return false;
    sig_ = sig;
    cv_.notify_all();
    return true;
  }
  // Serve, as soon as the gRPC server accepts requests: from here on a
  // signal starts the drain instead of ending the process.
  void MarkServing() {
    std::lock_guard<std::mutex> lock(mu_);
    serving_ = true;
  }
  // Serve: blocks until a signal arrives (at once if one came after MarkServing).
  int Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return sig_ != 0; });
    return sig_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool serving_ = false;
  int sig_ = 0;
};

int Worker(const ServeFlags& f);

// `s`, an error of BindListenSocket, with the flag it concerns: the port's for a port in use,
// else the host's.
std::string ListenFlagError(const Status& s, const char* host_flag, const char* port_flag) {
  return std::string(s.code() == StatusCode::kAlreadyExists ? port_flag : host_flag) + " " +
         s.message();
}

// Why `host`:`port` cannot be listened on ("" if it can), found before the model loads
// (minutes for a large one) rather than after: a host that does not resolve or is not this
// machine's, or a port in use. `host_flag` and `port_flag` name the flags in the message.
// The trial socket is closed again; the servers bind for real later. It has the listeners'
// options (BindListenSocket: SO_REUSEADDR, as gRPC's listener and the metrics server have
// it), so that it agrees with them: a port held only by the previous process's connections
// in TIME_WAIT passes, as it does for them, and a restart binds at once.
std::string ListenError(const std::string& host, int port, const char* host_flag,
                        const char* port_flag) {
  StatusOr<int> fd = BindListenSocket(host, port);
  if (!fd.ok()) return ListenFlagError(fd.status(), host_flag, port_flag);
  close(*fd);
  return "";
}

// The /metrics server's options from the flags.
MetricsHttpOptions MetricsOptions(const ServeFlags& f) {
  MetricsHttpOptions o;
  o.host = f.metrics_host;
  o.port = f.metrics_port;
  o.max_connections = f.metrics_max_connections;
  o.max_header_bytes = static_cast<size_t>(f.metrics_max_header_bytes);
  const auto ms = [](double s) {
    return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(s * 1000)));
  };
  o.read_timeout = ms(f.metrics_read_timeout_s);
  o.write_timeout = ms(f.metrics_write_timeout_s);
  return o;
}

int Serve(const ServeFlags& f) {
  // Refused before anything else, the model's loading included (auto
  // falling back to the cpu only warns, below).
  if (const std::string e = CudaOnlyFlagsError(f.backend, f.cuda_only_given, /*offers_auto=*/true);
      !e.empty()) {
    spdlog::error("{}", e);
    return 2;
  }
  for (const std::string& e : {ListenError(f.host, f.grpc_port, "--host", "--grpc-port"),
                               f.metrics_port > 0 ? ListenError(f.metrics_host, f.metrics_port,
                                                                "--metrics-host", "--metrics-port")
                                                  : std::string()}) {
    if (!e.empty()) {
      spdlog::error("{}", e);
      return 2;
    }
  }
  ApplyGemmAlgo(f.gemm_algo);
  // Signals are taken by a waiting thread, not a handler: block them in
  // every thread first (threads inherit the mask).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGUSR1);  // from the engine watcher below: the engine failed
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

#if TPSERVE_WITH_CUDA
  // Several nodes: the launcher (mpirun, LeaderWorkerSet) starts this same
  // command on every node; ranks > 0 run the worker loop, not a server.
  if (f.backend != "cpu") {
    auto plan = LaunchPlanFor(f);
    if (!plan.ok()) {
      spdlog::error("{}", plan.status().ToString());
      return 2;
    }
    if (plan->role == LaunchPlan::Role::kWorker) {
      spdlog::info("rank {} of {}: a worker of the group (no gRPC server here)", plan->rank,
                   plan->world_size);
      // When the group is stopped (a Kubernetes delete signals every pod at once) the leader
      // drains its accepted requests, which needs every worker: a worker keeps serving after
      // SIGTERM or SIGINT until the leader's stop ends Worker(), and exits by itself only if
      // that has not come within the leader's drain (--exit-timeout), its teardown (20 s) and
      // 10 s more (the leader's preStop pause in deploy/k8s). A second signal ends it at once.
      // (A handler is needed anyway: as a container's first process, with none, SIGTERM
      // would be ignored.)
      const double wait_s = f.exit_timeout_s + 30;
      std::thread([signals, wait_s] {
        int sig = 0;
        if (sigwait(&signals, &sig) != 0) return;
        spdlog::warn(
            "{} received: serving the leader's drain; exiting in {:.0f} s unless the "
            "leader stops this worker first (a second signal exits now)",
            sig == SIGINT ? "SIGINT" : "SIGTERM", wait_s);
        std::thread([sig, wait_s] {
          std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
          spdlog::error("the leader did not stop this worker within {:.0f} s: exiting", wait_s);
          spdlog::default_logger()->flush();
          std::_Exit(128 + sig);
        }).detach();
        int again = 0;
        if (sigwait(&signals, &again) == 0) {
          spdlog::warn("second signal: exiting now");
          spdlog::default_logger()->flush();
          std::_Exit(128 + again);
        }
      }).detach();
      return Worker(f);
    }
  }
#endif
  // One thread takes the signals from here on. Until the server is up
  // (loading a model can take minutes) nothing has been accepted, so a
  // SIGTERM or SIGINT then ends the process at once; afterwards it starts
  // the drain below.
  SignalBox box;
  std::thread signal_thread([&signals, &box] {
    int sig = 0;
    while (sigwait(&signals, &sig) == 0) {
      if (box.Deliver(sig)) return;
      spdlog::warn("{} received while starting: exiting (nothing was accepted yet)",
                   sig == SIGINT    ? "SIGINT"
                   : sig == SIGTERM ? "SIGTERM"
                                    : "SIGUSR1");
      spdlog::default_logger()->flush();
      std::_Exit(128 + sig);
    }
  });
  signal_thread.detach();
  std::string why_cpu;
  auto backend = ResolveBackend(f, &why_cpu);
  if (!backend.ok()) {
    spdlog::error("{}", backend.status().ToString());
    // A bad flag (InvalidArgument) is a usage error, as in StartEngine below.
    return backend.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  if (*backend == "cpu" && !f.cuda_only_given.empty()) {  // auto: --backend cpu refused them
    spdlog::warn("--backend auto runs the cpu backend ({}): ignoring {} (cuda backend only)",
                 why_cpu, JoinFlags(f.cuda_only_given));
  }
  bool from_dir = false;
  std::shared_ptr<const OverlapConfig> overlap;
  ModelConfig config;
  if (!LoadModelFlagsOrLog(f, &config, &from_dir, &overlap)) return 2;
  if (from_dir && f.seed_given) {
    spdlog::error(
        "--seed: --model {} is a checkpoint, whose weights are used; --seed seeds a "
        "preset's random weights",
        f.model);
    return 2;
  }
  auto engine = StartEngine(f, *backend, config, from_dir, overlap);
  if (!engine.ok()) {
    spdlog::error("{}", engine.status().ToString());
    return engine.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  ServerOptions so;
  so.model_name = f.model_name.empty() ? DefaultModelName(f.model, from_dir) : f.model_name;
  so.grpc_address = GrpcListenAddress(f.host, f.grpc_port);
  so.max_tokens_per_request = f.max_tokens_per_request;
  so.tls_cert_file = f.tls_cert;
  so.tls_key_file = f.tls_key;
  so.tls_client_ca_file = f.tls_client_ca;
  so.batcher.max_batch_tokens = f.max_batch_tokens;
  so.batcher.max_queue_delay = std::chrono::microseconds(f.max_queue_delay_us);
  so.batcher.max_queue_size = static_cast<size_t>(f.max_queue_size);
  so.max_streams = static_cast<size_t>(f.max_streams);
  so.batcher.max_batch_sequences = f.max_batch_sequences;
  so.max_requests_per_stream = static_cast<size_t>(f.max_requests_per_stream);
  so.generation.scheduler.max_step_tokens = f.max_step_tokens;
  so.generation.scheduler.max_running = f.max_running_sequences;
  so.generation.scheduler.max_new_tokens = f.max_output_len;
  // The metrics port is bound before the gRPC server starts, so that a port
  // already in use fails the start before any request is accepted; it serves once the
  // gRPC server does (connections wait in the backlog until then).
  std::unique_ptr<MetricsHttpServer> metrics;
  if (f.metrics_port > 0) {
    auto listening = MetricsHttpServer::Listen(MetricsOptions(f));
    if (!listening.ok()) {
      spdlog::error("cannot serve metrics: {}",
                    ListenFlagError(listening.status(), "--metrics-host", "--metrics-port"));
      return 1;
    }
    metrics = std::move(listening).value();
  }
  auto server = InferenceServer::Start(so, *engine);
  if (!server.ok()) {
    spdlog::error("{}", server.status().ToString());
    return 1;
  }
  InferenceServer* srv = server->get();
  box.MarkServing();  // requests may be accepted from here on: a signal drains them
  if (metrics) {
    metrics->Start([srv] { return srv->MetricsText(); });  // stopped before *srv goes
    spdlog::info("metrics on http://{}:{}/metrics", f.metrics_host, f.metrics_port);
  }
  std::printf("tpserve: serving '%s' on gRPC port %d\n", so.model_name.c_str(), srv->port());
  std::fflush(stdout);

  // An engine that fails (a GPU rank lost) cannot recover in this process:
  // the server reports NOT_SERVING (its health watcher), answers what it
  // holds with UNAVAILABLE while draining, and exits non-zero so that the
  // orchestrator restarts it.
  std::atomic<bool> watching{true};
  std::shared_ptr<Engine> watched = *engine;
  std::thread engine_watch([&] {
    while (watching.load()) {
      if (!watched->healthy()) {
        kill(getpid(), SIGUSR1);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  const int sig = box.Wait();
  watching = false;
  engine_watch.join();
  watched.reset();
  const bool engine_failed = sig == SIGUSR1;
  if (engine_failed) {
    spdlog::error("the engine failed: draining (up to {} s), then exiting with status 1",
                  f.exit_timeout_s);
  } else {
    spdlog::info("{} received: draining (up to {} s)", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                 f.exit_timeout_s);
  }
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(f.exit_timeout_s * 1000));
  // The drain may take the exit timeout; tearing the engine down after it
  // should take seconds. Should either block for good (a GPU or NCCL call
  // that never returns), the process still ends, non-zero, instead of hanging.
  const auto give_up = std::chrono::milliseconds(static_cast<int64_t>(f.exit_timeout_s * 1000)) +
                       std::chrono::seconds(kTeardownGraceS);
  std::thread([give_up] {
    std::this_thread::sleep_for(give_up);
    spdlog::critical(
        "shutdown did not finish within the exit timeout + {} s: exiting with status 1",
        kTeardownGraceS);
    spdlog::default_logger()->flush();
    std::_Exit(1);
  }).detach();
  srv->Shutdown(deadline);  // metrics stay up while the server drains
  if (metrics) metrics->Stop();
  server->reset();  // engine threads stop after the server
  spdlog::info("stopped");
  if (engine_failed) {
    // An abort of the lost rank's communicators may still be running in NCCL
    // on a background thread (NcclCommunicator::kAbortWait): leave without
    // static destruction under its feet (a plain return crashed there).
    spdlog::default_logger()->flush();
    std::_Exit(1);
  }
  return 0;
}

int Worker(const ServeFlags& f) {
#if TPSERVE_WITH_CUDA
  ApplyGemmAlgo(f.gemm_algo);
  bool from_dir = false;
  std::shared_ptr<const OverlapConfig> overlap;
  ModelConfig config;
  if (!LoadModelFlagsOrLog(f, &config, &from_dir, &overlap)) return 2;
  auto options = CudaOptions(f, config, from_dir, overlap);
  Status s = options.ok() ? RunCudaWorker(*options) : options.status();
  if (!s.ok()) {
    spdlog::error("worker: {}", s.ToString());
    return 1;
  }
  return 0;
#else
  (void)f;
  spdlog::error("tpserve worker: this build has no CUDA");
  return 2;
#endif
}

}  // namespace

void AddServeCommand(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ServeFlags>();
  // The flags only the cuda backend reads (CudaOnly), for the callback.
  auto cuda_only = std::make_shared<std::vector<const CLI::Option*>>();
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
                  "auto (cuda when this build has CUDA and the node has --tp GPUs, else cpu), "
                  "cuda (one process per GPU: this process is rank 0 and starts the others as "
                  "`tpserve worker`), or cpu (ranks are threads)")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}))
      ->capture_default_str();
  cmd->add_option("--overlap-config", f->overlap_config,
                  "Overlap config (YAML) choosing each TP layer's mode by name and M");
  cmd->add_option("--dtype", f->dtype,
                  "Type of the TP layers' weights and GEMMs: fp8 (E4M3) or bf16. Random weights "
                  "are made in it; a checkpoint's weights are converted on load (FP8 ones "
                  "dequantized with their weight_scale for bf16, BF16/F32 ones quantized for "
                  "fp8)")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of random weights")->capture_default_str();
  cmd->add_option("--host", f->host,
                  "gRPC bind address: a name, an IPv4 address or an IPv6 address (with or "
                  "without brackets: ::1 and [::1] are the same)")
      ->capture_default_str();
  cmd->add_option("--grpc-port", f->grpc_port, "gRPC port (0: pick a free one)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--metrics-host", f->metrics_host,
                  "Metrics bind address: a name, an IPv4 or an IPv6 address (brackets are "
                  "removed)")
      ->capture_default_str();
  cmd->add_option("--metrics-port", f->metrics_port, "Prometheus /metrics port (0: off)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--metrics-max-connections", f->metrics_max_connections,
                  "Open /metrics connections at most; one more closes the one that has waited "
                  "longest (a slow or idle client), so that scrapes are served whatever other "
                  "clients do")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--metrics-max-header-bytes", f->metrics_max_header_bytes,
                  "Bytes of a /metrics request's line and headers at most (answered 431 "
                  "beyond; request bodies are never read)")
      ->check(CLI::Range(int64_t{256}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--metrics-read-timeout-s", f->metrics_read_timeout_s,
                  "Seconds a /metrics request's line and headers may take to arrive, however "
                  "they trickle (then the connection is closed); also how long a kept-alive "
                  "connection may idle")
      ->check(CLI::Range(0.001, 3600.0))
      ->capture_default_str();
  cmd->add_option("--metrics-write-timeout-s", f->metrics_write_timeout_s,
                  "Seconds a client may take to receive a /metrics response before its "
                  "connection is closed")
      ->check(CLI::Range(0.001, 3600.0))
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", f->max_batch_tokens, "Tokens per engine batch")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--max-batch-sequences", f->max_batch_sequences,
                  "Requests per engine batch (the GPU engine sizes its per-sequence buffers "
                  "by it)")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--kv-cache-gib", f->kv_cache_gib,
                  "Generation: KV cache memory per rank in GiB, allocated at start (cpu "
                  "backend: host memory; 0 with no --kv-cache-blocks: no generation, logits "
                  "requests only; cuda backend: GPU memory on every rank)")
      ->check(CLI::Range(0.0, 4096.0))
      ->capture_default_str();
  cmd->add_option("--kv-cache-blocks", f->kv_cache_blocks,
                  "Generation: exactly this many KV cache blocks (overrides --kv-cache-gib; "
                  "a small pool makes the scheduler preempt and recompute sequences)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--kv-block-size", f->kv_block_size, "Generation: tokens per KV cache block")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", f->kv_cache_dtype,
                  "Generation: KV cache element type, bf16 or fp8 (E4M3, scale 1)")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  cmd->add_option("--max-step-tokens", f->max_step_tokens,
                  "Generation: tokens per step, one per decoding sequence plus chunks of "
                  "prompts (chunked prefill)")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--max-running-sequences", f->max_running_sequences,
                  "Generation: sequences in flight (holding KV cache blocks) at most")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--max-output-len", f->max_output_len,
                  "Generation: largest request_output_len accepted (also capped by the "
                  "model's max_position_embeddings)")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--max-requests-per-stream", f->max_requests_per_stream,
                  "Requests in progress on one ModelStreamInfer stream; beyond, that stream is "
                  "not read until one finishes")
      ->check(Positive())
      ->capture_default_str();
  CudaOnly(cmd->add_option("--rank-timeout-s", f->rank_timeout_s,
                           "seconds a collective may take before the engine declares a rank lost "
                           "(then every request gets UNAVAILABLE and health turns NOT_SERVING); "
                           "at most a week")
               ->check(CLI::Range(0.001, kMaxTimeoutS))
               ->capture_default_str(),
           cuda_only.get());
  CudaOnly(cmd->add_flag("--device-random-weights", f->device_random_weights,
                         "with a preset model, generate its random weights on the GPUs (seconds, "
                         "also for llama3-70b) instead of on the host (what the CPU backend uses, "
                         "so logits compare; minutes for large models)"),
           cuda_only.get());
  cmd->add_option("--max-queue-delay-us", f->max_queue_delay_us,
                  "Longest wait for batch-mates, microseconds (at most 10 s)")
      ->check(CLI::Range(int64_t{0}, int64_t{10'000'000}))
      ->capture_default_str();
  cmd->add_option("--max-queue-size", f->max_queue_size,
                  "Queued requests beyond this get RESOURCE_EXHAUSTED (logits requests waiting "
                  "for a batch; generation requests in progress); a waiting request holds no "
                  "thread; at most 65536")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}))
      ->capture_default_str();
  cmd->add_option("--max-streams", f->max_streams,
                  "Open ModelStreamInfer streams beyond this get RESOURCE_EXHAUSTED (a stream "
                  "holds no thread); at most 65536")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}))
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-request", f->max_tokens_per_request,
                  "Longest prompt accepted (INVALID_ARGUMENT beyond); capped by --max-batch-tokens "
                  "(a request is never split over batches) and the model's "
                  "max_position_embeddings")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option(
         "--exit-timeout", f->exit_timeout_s,
         "Seconds to finish accepted requests after SIGTERM (or an engine failure); "
         "if tearing down then takes 20 s more, the process exits with status 1; at most a "
         "week")
      ->check(CLI::Range(0.0, kMaxTimeoutS))
      ->capture_default_str();
  AddGemmAlgoFlag(cmd, &f->gemm_algo);
  CudaOnly(cmd->get_option("--gemm-algo"), cuda_only.get());
  // Checked before the model loads (minutes for a large one), not when the server starts.
  CLI::Option* tls_cert =
      cmd->add_option("--tls-cert", f->tls_cert,
                      "PEM certificate chain: serve gRPC over TLS (needs --tls-key)")
          ->check(CLI::ExistingFile);
  CLI::Option* tls_key = cmd->add_option("--tls-key", f->tls_key, "PEM private key of --tls-cert")
                             ->check(CLI::ExistingFile);
  tls_cert->needs(tls_key);
  tls_key->needs(tls_cert);
  cmd->add_option("--tls-client-ca", f->tls_client_ca,
                  "PEM CA bundle: require client certificates signed by it (mutual TLS; needs "
                  "--tls-cert and --tls-key)")
      ->check(CLI::ExistingFile)
      ->needs(tls_cert);
  cmd->callback([f, exit_code, cuda_only, cmd] {
    f->cuda_only_given = GivenFlags(*cuda_only);
    f->seed_given = cmd->get_option("--seed")->count() > 0;
    *exit_code = Serve(*f);
  });

  // The worker ranks of `serve --backend cuda`: started by rank 0 with the
  // same model flags and the rank and NCCL id in the environment.
  auto w = std::make_shared<ServeFlags>();
  CLI::App* wcmd = app.add_subcommand(
      "worker",
      "Internal: one GPU rank of `serve --backend cuda`, started by rank 0 (reads TPSERVE_RANK, "
      "TPSERVE_WORLD_SIZE, TPSERVE_LOCAL_RANK and TPSERVE_NCCL_ID); exits when rank 0 stops it "
      "or exits");
  wcmd->add_option("--model", w->model, "As serve --model")->capture_default_str();
  wcmd->add_option("--tp", w->tp, "As serve --tp")->check(CLI::Range(1, 64))->capture_default_str();
  wcmd->add_option("--dtype", w->dtype, "As serve --dtype")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  wcmd->add_option("--seed", w->seed, "As serve --seed")->capture_default_str();
  wcmd->add_option("--overlap-config", w->overlap_config, "As serve --overlap-config");
  wcmd->add_option("--max-batch-tokens", w->max_batch_tokens, "As serve --max-batch-tokens")
      ->check(Positive())
      ->capture_default_str();
  wcmd->add_option("--max-batch-sequences", w->max_batch_sequences,
                   "As serve --max-batch-sequences")
      ->check(Positive())
      ->capture_default_str();
  wcmd->add_flag("--device-random-weights", w->device_random_weights,
                 "As serve --device-random-weights");
  wcmd->add_option("--kv-cache-gib", w->kv_cache_gib, "As serve --kv-cache-gib")
      ->check(CLI::Range(0.0, 4096.0));
  wcmd->add_option("--kv-cache-blocks", w->kv_cache_blocks, "As serve --kv-cache-blocks")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  wcmd->add_option("--kv-block-size", w->kv_block_size, "As serve --kv-block-size")
      ->check(CLI::Range(1, 1024));
  wcmd->add_option("--kv-cache-dtype", w->kv_cache_dtype, "As serve --kv-cache-dtype")
      ->check(CLI::IsMember({"bf16", "fp8"}));
  wcmd->add_option("--rank-timeout-s", w->rank_timeout_s, "As serve --rank-timeout-s")
      ->check(CLI::Range(0.001, kMaxTimeoutS))
      ->capture_default_str();
  AddGemmAlgoFlag(wcmd, &w->gemm_algo);
  wcmd->callback([w, exit_code] { *exit_code = Worker(*w); });
}

}  // namespace tpserve
