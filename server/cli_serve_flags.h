// The flags of `tpserve serve` and of its GPU ranks, `tpserve worker` (server/cli_serve.cc runs
// both): their values with the defaults that --help shows, and the functions that register them.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace tpserve {

// The values of serve's flags (the worker's are a subset); the initialisers are the defaults.
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
  bool fp8_attention = false;  // logits requests' passes: E4M3 attention (CudaModelOptions)
  // Those of the cuda-only flags (CudaOnly) given on the command line,
  // whatever their value: --backend cpu refuses them, auto on the cpu warns.
  std::vector<std::string> cuda_only_given;
};

// Registers serve's flags on `cmd`, bound to *f, in the order --help lists them; the flags only
// the cuda backend reads are also appended to *cuda_only (CudaOnly). `cmd`, *f and *cuda_only
// must outlive the parse.
void AddServeFlags(CLI::App* cmd, ServeFlags* f, std::vector<const CLI::Option*>* cuda_only);
// Registers the worker's flags (serve's that every rank needs, which rank 0 passes on) on
// `wcmd`, bound to *w; both must outlive the parse.
void AddWorkerFlags(CLI::App* wcmd, ServeFlags* w);

}  // namespace tpserve
