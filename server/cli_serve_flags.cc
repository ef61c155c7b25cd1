#include "server/cli_serve_flags.h"

#include "server/cli_cuda_only.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

// Longest --exit-timeout / --rank-timeout-s: a week (their milliseconds must fit int64).
constexpr double kMaxTimeoutS = 7 * 24 * 3600.0;

// The model and how it is sharded and typed.
void AddModelFlags(CLI::App* cmd, ServeFlags* f) {
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
}

// Where the gRPC and /metrics servers listen, and the /metrics server's bounds.
void AddListenFlags(CLI::App* cmd, ServeFlags* f) {
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
}

// The engine's batches and generation (KV cache, scheduler).
void AddBatchAndGenerationFlags(CLI::App* cmd, ServeFlags* f) {
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
                  "Generation: KV cache element type, bf16 or fp8 (E4M3 codes of x / scale "
                  "with the checkpoint's per-layer k_scale / v_scale, else scale 1: values "
                  "saturate at +-448 x scale; half the bytes, so twice the tokens in "
                  "--kv-cache-gib and faster decode at long contexts and large batches)")
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
}

// Admission (queues, streams, prompt length) and the drain's timeout.
void AddAdmissionFlags(CLI::App* cmd, ServeFlags* f) {
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
}

// gRPC over TLS, optionally mutual.
void AddTlsFlags(CLI::App* cmd, ServeFlags* f) {
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
}

}  // namespace

void AddServeFlags(CLI::App* cmd, ServeFlags* f, std::vector<const CLI::Option*>* cuda_only) {
  AddModelFlags(cmd, f);
  AddListenFlags(cmd, f);
  AddBatchAndGenerationFlags(cmd, f);
  CudaOnly(cmd->add_option("--rank-timeout-s", f->rank_timeout_s,
                           "seconds a collective may take before the engine declares a rank lost "
                           "(then every request gets UNAVAILABLE and health turns NOT_SERVING); "
                           "at most a week")
               ->check(CLI::Range(0.001, kMaxTimeoutS))
               ->capture_default_str(),
           cuda_only);
  CudaOnly(cmd->add_flag("--device-random-weights", f->device_random_weights,
                         "with a preset model, generate its random weights on the GPUs (seconds, "
                         "also for llama3-70b) instead of on the host (what the CPU backend uses, "
                         "so logits compare; minutes for large models)"),
           cuda_only);
  AddAdmissionFlags(cmd, f);
  AddGemmAlgoFlag(cmd, &f->gemm_algo);
  CudaOnly(cmd->get_option("--gemm-algo"), cuda_only);
  CudaOnly(cmd->add_flag("--fp8-attention", f->fp8_attention,
                         "logits requests (prefill-only passes): attention in E4M3, Q and "
                         "the probabilities quantized at scale 1, K and V as the fp8 KV cache "
                         "stores them (the checkpoint's KV cache scales, else 1), so values "
                         "beyond +-448 x scale saturate (Hopper, head_dim 128; faster at long "
                         "sequences; accuracy in benchmarks/PERFORMANCE.md); generation keeps "
                         "BF16 attention"),
           cuda_only);
  AddTlsFlags(cmd, f);
}

void AddWorkerFlags(CLI::App* wcmd, ServeFlags* w) {
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
  wcmd->add_flag("--fp8-attention", w->fp8_attention, "As serve --fp8-attention");
}

}  // namespace tpserve
