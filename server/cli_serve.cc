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
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_config.h"
#include "engine/cpu_engine.h"
#if TPSERVE_WITH_CUDA
#include "comm/nccl_thread_group.h"
#include "engine/cuda_engine.h"
#endif
#include "server/cli.h"
#include "server/cli_cuda_only.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_serve_flags.h"
#include "server/inference_server.h"
#include "server/metrics_http.h"

namespace tpserve {
namespace {

// Seconds that tearing down may take after the drain's exit timeout.
constexpr int kTeardownGraceS = 20;

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
  eo.model.gemm_algo = GemmAlgoFromFlag(f.gemm_algo);
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
  eo.model.fp8_attention = f.fp8_attention;
  if (f.fp8_attention) eo.worker_argv.push_back("--fp8-attention");
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
    if (f.fp8_attention && config.head_dim() != 128) {
      return InvalidArgumentError("--fp8-attention: " + config.name + "'s head_dim is " +
                                  std::to_string(config.head_dim()) +
                                  "; the E4M3 attention takes 128");
    }
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

// Serve's checks before anything else, the model's loading included (auto falling back to the
// cpu only warns, later): the cuda-only flags and the listen addresses. 0 if they pass, else
// the exit status, logged.
int CheckServeFlags(const ServeFlags& f) {
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
  return 0;
}

#if TPSERVE_WITH_CUDA
// Several nodes: the launcher (mpirun, LeaderWorkerSet) starts this same
// command on every node; ranks > 0 run the worker loop, not a server.
// nullopt where this process serves (rank 0, or --backend cpu), else its exit status: the
// worker loop's, or 2 for a launch it cannot place. `signals`: blocked in every thread.
std::optional<int> RunIfGroupWorker(const ServeFlags& f, const sigset_t& signals) {
  if (f.backend == "cpu") return std::nullopt;
  auto plan = LaunchPlanFor(f);
  if (!plan.ok()) {
    spdlog::error("{}", plan.status().ToString());
    return 2;
  }
  if (plan->role != LaunchPlan::Role::kWorker) return std::nullopt;
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
#endif

// One thread takes the signals from here on. Until the server is up
// (loading a model can take minutes) nothing has been accepted, so a
// SIGTERM or SIGINT then ends the process at once; afterwards it starts
// the drain (ServeUntilSignal).
void StartSignalThread(const sigset_t& signals, SignalBox& box) {
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
}

// The engine that serves, as the flags say: the backend resolved, the model loaded, the
// engine started. 0 with *engine and *from_dir set, else the exit status (2 for a bad
// flag), logged.
int StartServeEngine(const ServeFlags& f, std::shared_ptr<Engine>* engine, bool* from_dir) {
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
  std::shared_ptr<const OverlapConfig> overlap;
  ModelConfig config;
  if (!LoadModelFlagsOrLog(f, &config, from_dir, &overlap)) return 2;
  if (*from_dir && f.seed_given) {
    spdlog::error(
        "--seed: --model {} is a checkpoint, whose weights are used; --seed seeds a "
        "preset's random weights",
        f.model);
    return 2;
  }
  auto started = StartEngine(f, *backend, config, *from_dir, overlap);
  if (!started.ok()) {
    spdlog::error("{}", started.status().ToString());
    return started.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  *engine = std::move(started).value();
  return 0;
}

// The gRPC server's options from the flags.
ServerOptions ServerOptionsFor(const ServeFlags& f, bool from_dir) {
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
  return so;
}

// Serves until a signal (SIGTERM, SIGINT, or SIGUSR1 from the engine watch below), then
// drains and tears down; returns the exit status (or ends the process). `box`: marked serving.
int ServeUntilSignal(const ServeFlags& f, SignalBox& box, const std::shared_ptr<Engine>& engine,
                     std::unique_ptr<InferenceServer>& server, MetricsHttpServer* metrics) {
  InferenceServer* srv = server.get();
  // An engine that fails (a GPU rank lost) cannot recover in this process:
  // the server reports NOT_SERVING (its health watcher), answers what it
  // holds with UNAVAILABLE while draining, and exits non-zero so that the
  // orchestrator restarts it.
  std::atomic<bool> watching{true};
  std::shared_ptr<Engine> watched = engine;
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
  server.reset();  // engine threads stop after the server
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

int Serve(const ServeFlags& f) {
  if (const int status = CheckServeFlags(f); status != 0) return status;
  // Signals are taken by a waiting thread, not a handler: block them in
  // every thread first (threads inherit the mask).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGUSR1);  // from ServeUntilSignal's engine watch: the engine failed
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
#if TPSERVE_WITH_CUDA
  if (const std::optional<int> status = RunIfGroupWorker(f, signals)) return *status;
#endif
  SignalBox box;
  StartSignalThread(signals, box);
  std::shared_ptr<Engine> engine;
  bool from_dir = false;
  if (const int status = StartServeEngine(f, &engine, &from_dir); status != 0) return status;
  ServerOptions so = ServerOptionsFor(f, from_dir);
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
  auto server = InferenceServer::Start(so, engine);
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
  return ServeUntilSignal(f, box, engine, *server, metrics.get());
}

int Worker(const ServeFlags& f) {
#if TPSERVE_WITH_CUDA
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
  AddServeFlags(cmd, f.get(), cuda_only.get());
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
  AddWorkerFlags(wcmd, w.get());
  wcmd->callback([w, exit_code] { *exit_code = Worker(*w); });
}

}  // namespace tpserve
