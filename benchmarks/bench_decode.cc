// tpserve-bench-decode: decode step time of the CUDA model (engine/cuda_model.h: Step) on one
// GPU, or on --tp GPUs (one process per GPU, as served, with --overlap's knobs or mode none),
// against its floor, measured in the same run.
//
// For every --batches entry B: B sequences are prefilled to --context tokens (eager prefill
// steps of at most --step-tokens tokens, through the paged KV cache), then the model runs pure
// decode steps (one token per sequence, each fed its last sampled token: greedy, or sampled
// with --temperature, --top-k, --top-p), the first capturing the step's CUDA graph. --steps
// more are timed on the host around Step() (upload, graph replay, sampling, download of the
// tokens: what the serving loop pays per step besides its own bookkeeping) and on the GPU
// (events around the replay). One eager decode step is then timed stage by stage
// (CudaModel::ProfileStep).
//
// The floor of a step is max(bytes / HBM bandwidth, FLOPs / GEMM ceiling): bytes are the
// weights the step reads (every block's linear layers, norms, the LM head; embedding rows are
// negligible) plus the KV cache it attends over (B x context x layers x 2 x kv_heads x
// head_dim elements); the bandwidth is a device-to-device copy measured in this run (read +
// write bytes over time); FLOPs are 2 x B x (linear + LM head parameters) + attention's
// 4 x B x context x heads x head_dim per layer, over --gemm-ceiling-tflops. At --tp N each GPU
// reads 1/N of the linear layers, the LM head and the KV cache (norms whole) and does 1/N of
// the FLOPs: the floor is one GPU's.
//
// --timeline traces the timed steps' kernels (CUPTI: benchmarks/cupti_timeline.h) and reports,
// per kernel, what it adds to the step's critical path beyond the kernels started before it
// (benchmarks/kernel_timeline.h), and the time no kernel runs. Tracing is on for the whole run
// then, so the step times of such a run are traced ones: compare them with an untraced run.
//
// --unfused turns decode-step fusions off (CudaModelOptions::decode_fusions), so that one
// build measures what each is worth (benchmarks/run_decode_ab.sh's LABEL=DIR@NAMES).
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/cupti_timeline.h"
#include "benchmarks/kernel_timeline.h"
#include "benchmarks/kernel_timing.h"
#include "benchmarks/median.h"
#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/rank_group.h"
#include "engine/cuda_model.h"
#include "engine/kv_cache.h"
#include "engine/model_config.h"
#include "engine/sampling.h"
#include "layers/overlap_config.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

using json = nlohmann::json;

struct Flags {
  std::string model = "llama3-8b";
  std::string dtype = "fp8";
  std::string kv_dtype = "bf16";
  std::vector<int64_t> batches = {1, 8, 64, 256};
  int64_t context = 1024;
  int steps = 30;
  int warmup = 3;
  int64_t step_tokens = 8192;
  int64_t block_size = 16;
  double gemm_ceiling_tflops = 1760;  // cuBLASLt FP8 8192^3 on this host (shared/GPU_HOST.md)
  uint64_t seed = 7;
  std::string out = "decode.json";
  std::string commit = "unknown";
  std::string gemm_algo = "timed";
  int tp = 1;
  std::string ranks = "processes";   // processes (one per GPU, as served) | threads
  std::string overlap;               // overlap config (YAML); empty: every layer in mode none
  std::vector<std::string> unfused;  // CudaModelOptions::decode_fusions turned off, by name
  std::vector<std::string> fused;    // and those off by default turned on
  SamplingParams sampling;           // every decode step's; default greedy
  bool timeline = false;             // trace the timed steps' kernels (CUPTI)
};

json TimelineJson(const TimelineSummary& t, uint64_t dropped) {
  json labels = json::array();
  for (const LabelSummary& l : t.labels) {
    labels.push_back(json{{"kernel", l.label},
                          {"launches_per_step", l.launches_per_step},
                          {"duration_us_median", l.duration_us_median},
                          {"exposed_us_per_step", l.exposed_us_per_step},
                          {"idle_before_us_per_step", l.idle_us_per_step}});
  }
  return json{{"steps", t.steps},
              {"span_us_median", t.span_us_median},
              {"idle_us_median", t.idle_us_median},
              {"records_dropped", dropped},
              {"kernels", labels}};
}

void LogTimeline(int64_t batch, const TimelineSummary& t) {
  spdlog::info(
      "batch {:>4} timeline of {} traced steps: span {:.1f} us, no kernel running {:.1f} us", batch,
      t.steps, t.span_us_median, t.idle_us_median);
  spdlog::info("  {:>9} {:>9} {:>10} {:>9}  kernel", "launches", "dur us", "exposed us", "idle us");
  for (const LabelSummary& l : t.labels) {
    spdlog::info("  {:>9.1f} {:>9.2f} {:>10.1f} {:>9.1f}  {}", l.launches_per_step,
                 l.duration_us_median, l.exposed_us_per_step, l.idle_us_per_step, l.label);
  }
}

// --unfused's names of CudaModelOptions::DecodeFusions' fields.
constexpr const char* kFusionNames[] = {"rope", "out-fp8", "cluster-merge", "early-loads",
                                        "swiglu"};
// --fused's names: the fusions off by default, turned on.
constexpr const char* kOptInNames[] = {"cluster-merge"};

void TurnOff(const std::string& name, CudaModelOptions::DecodeFusions* d) {
  if (name == "rope") d->rope_in_attention = false;
  if (name == "out-fp8") d->attention_out_fp8 = false;
  if (name == "cluster-merge") d->cluster_merge = false;
  if (name == "early-loads") d->early_loads = false;
  if (name == "swiglu") d->swiglu_in_gemm = false;
}

struct Floor {
  double weight_bytes = 0, kv_bytes = 0, flops = 0;
};

Floor StepFloor(const ModelConfig& c, DataType dtype, KvCacheDtype kv, int64_t batch,
                int64_t context, int tp) {
  const double h = static_cast<double>(c.hidden_size), hd = static_cast<double>(c.head_dim());
  const double heads = static_cast<double>(c.num_attention_heads);
  const double kvh = static_cast<double>(c.num_key_value_heads);
  const double inter = static_cast<double>(c.intermediate_size);
  const double layers = static_cast<double>(c.num_hidden_layers);
  const double linear = h * (heads + 2 * kvh) * hd + heads * hd * h + 2 * h * inter + inter * h;
  const double head = static_cast<double>(c.vocab_size) * h;
  const double wbytes = dtype == DataType::kFloat8E4M3 ? 1.0 : 2.0;
  Floor f;
  // Linear weights in the model's dtype; norms and the LM head in BF16.
  const double n = static_cast<double>(tp);
  f.weight_bytes = layers * (linear * wbytes / n + 2 * h * 2) + h * 2 + head * 2 / n;
  f.kv_bytes = static_cast<double>(batch) * static_cast<double>(context) * layers * 2 * kvh * hd *
               static_cast<double>(KvCacheElementBytes(kv)) / n;
  f.flops =
      (2.0 * static_cast<double>(batch) * (layers * linear + head) +
       4.0 * static_cast<double>(batch) * static_cast<double>(context) * heads * hd * layers) /
      n;
  return f;
}

// Sequence s owns blocks [s * per_seq, (s + 1) * per_seq).
StepBatch MakeStep(int64_t first_seq, int64_t seqs, int64_t begin, int64_t len, int64_t per_seq,
                   const std::vector<int32_t>& last_tokens, int64_t vocab, bool sample,
                   uint64_t index, const SamplingParams& sampling = SamplingParams{}) {
  StepBatch b;
  b.max_blocks = per_seq;
  b.cu_seqlens.push_back(0);
  for (int64_t s = first_seq; s < first_seq + seqs; ++s) {
    for (int64_t i = begin; i < begin + len; ++i) {
      const int32_t id = len == 1 && !last_tokens.empty()
                             ? last_tokens[static_cast<size_t>(s)]
                             : static_cast<int32_t>((7919 * (s * 4099 + i) + 17) % vocab);
      b.ids.push_back(id);
      b.positions.push_back(static_cast<int32_t>(i));
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.ids.size()));
    b.context_lens.push_back(static_cast<int32_t>(begin + len));
    for (int64_t k = 0; k < per_seq; ++k)
      b.block_tables.push_back(static_cast<int32_t>(s * per_seq + k));
    b.sample.push_back(sample ? 1 : 0);
    b.sampling.push_back(sampling);
    b.sample_index.push_back(index);
  }
  return b;
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "tpserve-bench-decode: decode step time of the CUDA model on one GPU or --tp GPUs (random "
      "FP8 or BF16 weights generated on the devices) at each batch size, each sequence at a "
      "fixed context, against the step's floor measured in the same run; writes a JSON record "
      "per batch"};
  app.add_option("--model", f.model,
                 "Preset: tiny, llama3-8b, llama3-70b (a rank's share must fit its GPU)")
      ->check(CLI::IsMember({"tiny", "llama3-8b", "llama3-70b"}))
      ->capture_default_str();
  app.add_option("--dtype", f.dtype, "Weights and activations of the linear layers: fp8 or bf16")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  app.add_option("--kv-dtype", f.kv_dtype, "KV cache elements: bf16 or fp8")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  app.add_option("--batches", f.batches, "Sequences per decode step (each a separate case)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  app.add_option("--context", f.context, "Tokens each sequence has cached when decoding starts")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--steps", f.steps, "Timed decode steps per batch")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "Untimed decode steps after the one that captures the graph")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--step-tokens", f.step_tokens, "Most tokens per prefill step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--kv-block-size", f.block_size, "Tokens per KV cache block")
      ->check(CLI::Range(int64_t{1}, int64_t{1024}))
      ->capture_default_str();
  app.add_option("--gemm-ceiling-tflops", f.gemm_ceiling_tflops,
                 "Dense GEMM throughput the FLOP floor divides by (TFLOP/s)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", f.seed, "Seed of the random weights")->capture_default_str();
  app.add_option("--temperature", f.sampling.temperature,
                 "Decode steps sample at this temperature (0: greedy; the prefill's first token "
                 "is greedy either way)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--top-k", f.sampling.top_k, "Decode steps' top-k cut (0: none)")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--top-p", f.sampling.top_p, "Decode steps' top-p cut, in (0, 1] (1: none)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--sample-seed", f.sampling.seed, "Seed of the decode steps' sampling")
      ->capture_default_str();
  app.add_option("--tp", f.tp,
                 "Tensor-parallel size (GPUs): must divide the preset's attention and KV heads, "
                 "intermediate size and vocabulary")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--ranks", f.ranks,
                 "How ranks run at --tp > 1: processes (one per GPU, as tpserve serves; this "
                 "process is rank 0 and starts the others with the same arguments) or threads")
      ->check(CLI::IsMember({"processes", "threads"}))
      ->capture_default_str();
  app.add_option("--overlap", f.overlap,
                 "Overlap config (YAML, e.g. deploy/overlap-llama3-70b-tp2.yaml) whose knobs the "
                 "TP layers take at each step's M, as the server would (default: every layer in "
                 "mode none)")
      ->check(CLI::ExistingFile);
  app.add_option("--unfused", f.unfused,
                 "Decode-step fusions to turn off, to measure what each is worth (the results "
                 "stay the same, but for cluster-merge's rounding): rope (RoPE and the K/V store "
                 "inside attention), out-fp8 "
                 "(attention writing o's E4M3 input), cluster-merge (the decode kernel's splits "
                 "merged in a cluster instead of a combine pass), early-loads (attention's "
                 "loads of earlier keys before its PDL wait), swiglu (SwiGLU in gate_up's "
                 "small-M GEMM); default none")
      ->check(
          CLI::IsMember(std::vector<std::string>(std::begin(kFusionNames), std::end(kFusionNames))))
      ->delimiter(',');
  app.add_option("--fused", f.fused,
                 "Decode-step fusions off by default to turn on: cluster-merge (the decode "
                 "kernel's splits merged in a thread-block cluster; measured slower than the "
                 "combine pass at batch 1 and 8)")
      ->check(
          CLI::IsMember(std::vector<std::string>(std::begin(kOptInNames), std::end(kOptInNames))))
      ->delimiter(',');
  app.add_flag("--timeline", f.timeline,
               "Trace the timed steps' kernels with CUPTI and report, per kernel, its launches a "
               "step, its median duration, what it adds to the step beyond the kernels started "
               "before it (exposed) and the idle time before it; the run's step times are then "
               "traced ones");
  AddGemmAlgoFlag(&app, &f.gemm_algo);
  app.add_option("--out", f.out, "JSON output")->capture_default_str();
  app.add_option("--commit", f.commit, "Commit id recorded in the JSON meta")
      ->capture_default_str();
  StrictNumbers(app);
  CLI11_PARSE(app, argc, argv);
  if (const Status st = ValidateSamplingParams(f.sampling); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 2;
  }

  if (f.timeline && f.tp != 1) {
    spdlog::error("--timeline traces one GPU's kernels: it needs --tp 1 (got --tp {})", f.tp);
    return 2;
  }
  auto config = ModelPreset(f.model);
  if (!config.ok()) {
    spdlog::error("{}", config.status().ToString());
    return 2;
  }
  if (config->num_attention_heads % f.tp != 0 || config->num_key_value_heads % f.tp != 0 ||
      config->intermediate_size % f.tp != 0 || config->vocab_size % f.tp != 0) {
    spdlog::error(
        "--tp {}: {} has {} attention heads, {} KV heads, intermediate size {} and vocabulary {}; "
        "the tp must divide each",
        f.tp, f.model, config->num_attention_heads, config->num_key_value_heads,
        config->intermediate_size, config->vocab_size);
    return 2;
  }
  std::unique_ptr<OverlapConfig> overlap;
  if (!f.overlap.empty()) {
    auto cfg = OverlapConfig::LoadFile(f.overlap);
    if (!cfg.ok()) {
      spdlog::error("{}", cfg.status().ToString());
      return 2;
    }
    overlap = std::make_unique<OverlapConfig>(std::move(cfg).value());
  }
  const int64_t max_batch = *std::max_element(f.batches.begin(), f.batches.end());
  const int64_t total_steps = 1 + f.warmup + f.steps + 1;  // capture, warm-up, timed, profile
  if (f.context + total_steps > config->max_position_embeddings) {
    spdlog::error("--context {} plus {} decode steps exceeds {}'s max_position_embeddings ({})",
                  f.context, total_steps, f.model, config->max_position_embeddings);
    return 2;
  }
  const int64_t per_seq = (f.context + total_steps + f.block_size - 1) / f.block_size;
  const DataType dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  const KvCacheDtype kv = f.kv_dtype == "fp8" ? KvCacheDtype::kFloat8E4M3 : KvCacheDtype::kBFloat16;
  CudaModelOptions options;
  options.max_tokens = std::max(f.step_tokens, max_batch);
  options.gemm_algo = GemmAlgoFromFlag(f.gemm_algo);
  options.max_seqs = std::max<int64_t>(max_batch, 1);
  options.time_passes = true;
  options.kv_blocks = max_batch * per_seq;
  options.kv_block_size = f.block_size;
  options.kv_dtype = kv;
  for (const std::string& name : f.unfused) TurnOff(name, &options.decode_fusions);
  for (const std::string& name : f.fused) {
    if (name == "cluster-merge") options.decode_fusions.cluster_merge = true;
  }

  auto group = CreateRankGroup(f.ranks, std::vector<std::string>(argv, argv + argc), f.tp,
                               std::chrono::seconds(120));
  if (!group.ok()) {
    spdlog::error("{}", group.status().ToString());
    return 1;
  }
  if (f.timeline) {
    // Before any graph is captured: CUPTI records the kernels of graphs made while it is on.
    if (const Status st = StartKernelTracing(); !st.ok()) {
      spdlog::error("--timeline: {}", st.ToString());
      return 1;
    }
  }
  const auto bw = MeasureHbmBandwidth(size_t{4} << 30, 5);
  if (!bw.ok()) {
    spdlog::error("bandwidth: {}", bw.status().ToString());
    return 1;
  }
  if ((*group)->leader()) {
    spdlog::info("HBM: {:.0f} GB/s (device-to-device copy, read + write)", *bw / 1e9);
  }

  json records = json::array();
  Status s = (*group)->Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(auto model, CudaModel::CreateRandom(*config, dtype, f.seed, overlap.get(),
                                                            (*group)->pool(r), options));
    for (const int64_t batch : f.batches) {
      // Prefill: whole sequences per step while they fit, else chunks of one sequence.
      const int64_t chunk = std::min(f.context, f.step_tokens);
      const int64_t seqs_per_step = std::max<int64_t>(1, f.step_tokens / f.context);
      std::vector<int32_t> last(static_cast<size_t>(batch), 0);
      const auto p0 = std::chrono::steady_clock::now();
      for (int64_t s0 = 0; s0 < batch; s0 += seqs_per_step) {
        const int64_t n = std::min(seqs_per_step, batch - s0);
        for (int64_t begin = 0; begin < f.context; begin += chunk) {
          const int64_t len = std::min(chunk, f.context - begin);
          const bool done = begin + len == f.context;
          TP_ASSIGN_OR_RETURN(StepResult got, model->Step(MakeStep(s0, n, begin, len, per_seq, {},
                                                                   config->vocab_size, done, 0)));
          for (size_t k = 0; done && k < got.tokens.size(); ++k) {
            last[static_cast<size_t>(s0) + k] = got.tokens[k].token;
          }
        }
      }
      const double prefill_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count();
      std::vector<double> host_ms, gpu_ms;
      std::vector<TimelineWindow> windows;
      int64_t pos = f.context;
      auto decode = [&](bool profile) -> StatusOr<std::vector<std::pair<std::string, double>>> {
        // The tokens fed back are the model's own (greedy unless --temperature); last holds
        // all sequences'.
        const StepBatch step = MakeStep(0, batch, pos, 1, per_seq, last, config->vocab_size, true,
                                        static_cast<uint64_t>(pos - f.context), f.sampling);
        ++pos;
        if (profile) return model->ProfileStep(step);
        const uint64_t w0 = f.timeline ? CuptiTimestampNs() : 0;
        const auto t0 = std::chrono::steady_clock::now();
        TP_ASSIGN_OR_RETURN(StepResult got, model->Step(step));
        if (f.timeline) windows.push_back(TimelineWindow{w0, CuptiTimestampNs()});
        host_ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
        gpu_ms.push_back(model->last_pass_ms());
        for (size_t k = 0; k < got.tokens.size(); ++k) last[k] = got.tokens[k].token;
        return std::vector<std::pair<std::string, double>>{};
      };
      for (int i = 0; i < 1 + f.warmup; ++i) TP_RETURN_IF_ERROR(decode(false).status());
      host_ms.clear();
      gpu_ms.clear();
      windows.clear();
      for (int i = 0; i < f.steps; ++i) TP_RETURN_IF_ERROR(decode(false).status());
      json timeline;
      if (f.timeline) {
        uint64_t dropped = 0;
        TP_ASSIGN_OR_RETURN(const std::vector<KernelRecord> kernels,
                            CollectKernelRecords(&dropped));
        const TimelineSummary t = SummarizeTimeline(kernels, windows);
        if (r == 0) LogTimeline(batch, t);
        timeline = TimelineJson(t, dropped);
      }
      TP_ASSIGN_OR_RETURN(const auto stages, decode(true));
      if (r != 0) continue;  // every rank decodes the same tokens (the same logits and seeds)

      const Floor fl = StepFloor(*config, dtype, kv, batch, f.context, f.tp);
      const double bytes_ms = (fl.weight_bytes + fl.kv_bytes) / *bw * 1e3;
      const double flops_ms = fl.flops / (f.gemm_ceiling_tflops * 1e12) * 1e3;
      const double floor_ms = std::max(bytes_ms, flops_ms);
      const double host = Median(host_ms), gpu = Median(gpu_ms);
      json st = json::object();
      std::string line;
      double stage_sum = 0;
      for (const auto& [name, ms] : stages) {
        st[name] = ms;
        stage_sum += ms;
        char buf[64];
        std::snprintf(buf, sizeof buf, " %s %.3f", name.c_str(), ms);
        line += buf;
      }
      spdlog::info(
          "batch {:>4} at context {}: step {:.3f} ms host-timed, {:.3f} ms GPU; floor {:.3f} ms "
          "(bytes {:.3f}, FLOPs {:.3f}): {:.2f}x the floor host-timed; prefill {:.1f} s",
          batch, f.context, host, gpu, floor_ms, bytes_ms, flops_ms, host / floor_ms, prefill_s);
      spdlog::info("batch {:>4} eager step by stage, ms (total {:.3f}):{}", batch, stage_sum, line);
      records.push_back(
          json{{"batch", batch},
               {"context", f.context},
               {"step_host_ms_median", host},
               {"step_gpu_ms_median", gpu},
               {"step_host_ms_min", *std::min_element(host_ms.begin(), host_ms.end())},
               {"floor_ms", floor_ms},
               {"floor_bytes_ms", bytes_ms},
               {"floor_flops_ms", flops_ms},
               {"weight_bytes", fl.weight_bytes},
               {"kv_bytes", fl.kv_bytes},
               {"flops", fl.flops},
               {"host_over_floor", host / floor_ms},
               {"gpu_over_floor", gpu / floor_ms},
               {"eager_stages_ms", st},
               {"steps", f.steps},
               {"prefill_s", prefill_s}});
      if (f.timeline) records.back()["timeline"] = timeline;
    }
    return model->Close();
  });
  if (!s.ok()) {
    spdlog::error("{}", s.ToString());
    return 1;
  }
  if (!(*group)->leader()) return 0;  // a worker process: rank 0 reports
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) == cudaSuccess) (void)cudaGetDeviceProperties(&prop, dev);
  json doc{{"meta",
            {{"benchmark", "decode"},
             {"model", f.model},
             {"dtype", f.dtype},
             {"kv_dtype", f.kv_dtype},
             {"kv_block_size", f.block_size},
             {"tp", f.tp},
             {"ranks", f.ranks},
             {"overlap", f.overlap.empty() ? "none" : f.overlap},
             {"gpu", prop.name},
             {"hbm_copy_gbps", *bw / 1e9},
             {"gemm_ceiling_tflops", f.gemm_ceiling_tflops},
             {"gemm_algo", f.gemm_algo},
             {"unfused", f.unfused},
             {"fused", f.fused},
             {"timeline_traced", f.timeline},
             {"sampling",
              {{"temperature", f.sampling.temperature},
               {"top_k", f.sampling.top_k},
               {"top_p", f.sampling.top_p},
               {"seed", f.sampling.seed}}},
             {"commit", f.commit}}},
           {"records", records}};
  std::ofstream out(f.out);
  out << doc.dump(2) << "\n";
  if (!out) {
    spdlog::error("could not write {}", f.out);
    return 1;
  }
  spdlog::info("wrote {}", f.out);
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
