// `tpserve-bench gemm-scales`: see bench_gemm_scales.h.
#include "benchmarks/bench_gemm_scales.h"

#include <cublasLt.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/device_compare.h"
#include "benchmarks/write_replacing.h"
#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "layers/cublaslt_gemm.h"
#include "layers/quantize_kernels.h"
#include "layers/random_fill.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

using json = nlohmann::json;

struct Flags {
  std::string shapes = "llama3-8b";
  std::vector<int64_t> ms = {2048, 4096, 8192};
  std::vector<std::string> schemes = {"per_tensor", "per_token_channel", "blockwise"};
  int warmup = 5;
  int rounds = 50;
  int queue_delay_us = 100;
  int l2_flush_mib = 128;
  std::string l2_flush_mode = "write";
  double per_token_limit = 1.05;
  double blockwise_limit = 1.15;
  int64_t judge_min_m = 2048;
  bool check = true;
  std::string gemm_algo = "timed";
  std::string out = "gemm_scales.json";
  std::string commit = "unknown";
};

struct LayerShape {
  std::string layer;
  int64_t n, k;  // weight [n, k]; unsharded (one GPU)
};

std::vector<LayerShape> Shapes(const std::string& preset) {
  if (preset == "llama3-8b") {
    return {{"llama3-8b.qkv", 6144, 4096},
            {"llama3-8b.o", 4096, 4096},
            {"llama3-8b.gate_up", 28672, 4096},
            {"llama3-8b.down", 4096, 14336}};
  }
  return {{"small", 1024, 1024}};  // "small": a quick smoke run
}

json Stats(std::vector<float> t) {
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  double mean = 0;
  for (float v : t) mean += v;
  mean /= static_cast<double>(n);
  return json{{"median_ms", n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2])},
              {"min_ms", t.front()},
              {"max_ms", t.back()},
              {"mean_ms", mean},
              {"rounds", n}};
}

// One scheme of one case: its buffers and graphs.
struct SchemeRun {
  GemmScaleScheme scheme;
  GemmParams params;
  DeviceBuffer a, a_scales, d;
  CublasLtGemm gemm;
  CudaGraphExec quantize_graph, gemm_graph;
  std::vector<float> quantize_ms, gemm_ms;
};

// The activation quantize step of `scheme`: x (bf16 m x k) -> a (fp8), a_scales.
Status EnqueueQuantize(GemmScaleScheme scheme, const void* x, int64_t m, int64_t k, uint8_t* a,
                       float* a_scales, float* amax, cudaStream_t st) {
  if (scheme == GemmScaleScheme::kPerTensor) {
    AbsMaxParams ap;
    ap.input = x;
    ap.count = static_cast<size_t>(m * k);
    ap.amax = amax;
    TP_RETURN_IF_ERROR(LaunchAbsMax(ap, st));
    TP_RETURN_IF_ERROR(LaunchScaleFromAmax(amax, 1, a_scales, st));
    QuantizeFp8Params qp;
    qp.input = x;
    qp.output = a;
    qp.count = static_cast<size_t>(m * k);
    qp.scale = a_scales;
    return LaunchQuantizeToFp8E4M3(qp, st);
  }
  QuantizeFp8DynamicParams qp;
  qp.input = x;
  qp.output = a;
  qp.scales = a_scales;
  qp.rows = m;
  qp.cols = k;
  qp.granularity = scheme == GemmScaleScheme::kBlockwise ? Fp8ScaleGranularity::kPerGroup128
                                                         : Fp8ScaleGranularity::kPerRow;
  return LaunchQuantizeFp8Dynamic(qp, st);
}

double LimitOf(const Flags& f, GemmScaleScheme s) {
  switch (s) {
    case GemmScaleScheme::kPerTokenChannel:
      return f.per_token_limit;
    case GemmScaleScheme::kBlockwise:
      return f.blockwise_limit;
    default:
      return 1.0;
  }
}

Status RunCase(const Flags& f, const LayerShape& shape, int64_t m,
               const std::vector<GemmScaleScheme>& schemes, std::vector<json>& records,
               bool* all_within) {
  const int64_t n = shape.n, k = shape.k;
  TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  cudaStream_t st = stream.get();
  TP_ASSIGN_OR_RETURN(DeviceBuffer x, DeviceBuffer::Allocate(m * k * 2, "bench.x"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(n * k, "bench.w"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer amax, DeviceBuffer::Allocate(16, "bench.amax"));
  // Weight scales: every scheme's layout (at most n/128 * pitch or n floats), all 2^-6, so that
  // each scheme's weight holds the same real values and the outputs are comparable.
  const int64_t w_scale_count =
      std::max<int64_t>({n, (n + 127) / 128 * BlockwiseWeightScalePitch(k), 4});
  TP_ASSIGN_OR_RETURN(DeviceBuffer w_scales,
                      DeviceBuffer::Allocate(w_scale_count * sizeof(float), "bench.w_scales"));
  TP_RETURN_IF_ERROR(LaunchRandomUniform(x.data(), DataType::kBFloat16, m * k, 11, 4.0f, st));
  TP_RETURN_IF_ERROR(LaunchRandomUniform(w.data(), DataType::kFloat8E4M3, n * k, 12, 448.0f, st));
  TP_RETURN_IF_ERROR(LaunchFillPattern(w_scales.data(), w_scale_count, 4, 0x3C800000u, st));

  std::vector<SchemeRun> runs(schemes.size());
  for (size_t i = 0; i < schemes.size(); ++i) {
    SchemeRun& r = runs[i];
    r.scheme = schemes[i];
    const std::string name = std::string(GemmScaleSchemeName(r.scheme));
    r.params.m = m;
    r.params.n = n;
    r.params.k = k;
    r.params.scale_scheme = r.scheme;
    const int64_t a_scale_count = std::max<int64_t>(GemmAScaleCount(r.params), 4);
    TP_ASSIGN_OR_RETURN(r.a, DeviceBuffer::Allocate(m * k, "bench.a." + name));
    TP_ASSIGN_OR_RETURN(r.a_scales, DeviceBuffer::Allocate(a_scale_count * sizeof(float),
                                                           "bench.a_scales." + name));
    TP_ASSIGN_OR_RETURN(r.d, DeviceBuffer::Allocate(m * n * 2, "bench.d." + name));
    r.params.a_scale = r.a_scales.as<float>();
    r.params.b_scale = w_scales.as<float>();
    TP_ASSIGN_OR_RETURN(r.gemm, CublasLtGemm::Create("bench." + shape.layer + "." + name,
                                                     GemmAlgoFromFlag(f.gemm_algo)));
    TP_RETURN_IF_ERROR(r.gemm.Prepare(r.params));
    // Eager run first: the check below reads its output.
    TP_RETURN_IF_ERROR(EnqueueQuantize(r.scheme, x.data(), m, k, r.a.as<uint8_t>(),
                                       r.a_scales.as<float>(), amax.as<float>(), st));
    TP_RETURN_IF_ERROR(r.gemm.Run(r.params, r.a.data(), w.data(), nullptr, r.d.data(), st));
    TP_ASSIGN_OR_RETURN(r.quantize_graph,
                        CudaGraphExec::Capture(st, cudaStreamCaptureModeThreadLocal, [&] {
                          return EnqueueQuantize(r.scheme, x.data(), m, k, r.a.as<uint8_t>(),
                                                 r.a_scales.as<float>(), amax.as<float>(), st);
                        }));
    TP_ASSIGN_OR_RETURN(
        r.gemm_graph, CudaGraphExec::Capture(st, cudaStreamCaptureModeThreadLocal, [&] {
          return r.gemm.Run(r.params, r.a.data(), w.data(), nullptr, r.d.data(), st);
        }));
  }
  TP_RETURN_IF_ERROR(stream.Synchronize());

  // Rounds interleave the schemes (drift hits each alike); the L2 is flushed before each
  // replay, outside its timing, as a model's layers find their weights out of cache.
  const size_t flush_bytes = static_cast<size_t>(f.l2_flush_mib) << 20;
  const bool flush_by_reading = f.l2_flush_mode == "read";
  DeviceBuffer flush;
  if (flush_bytes > 0) {
    TP_ASSIGN_OR_RETURN(flush, DeviceBuffer::Allocate(flush_bytes, "bench.l2_flush"));
  }
  const size_t items = 2 * runs.size();
  std::vector<CudaEvent> events;
  for (size_t i = 0; i < 2 * items; ++i) {
    TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(true));
    events.push_back(std::move(e));
  }
  for (int round = -f.warmup; round < f.rounds; ++round) {
    TP_RETURN_IF_ERROR(
        LaunchGpuDelay(int64_t{f.queue_delay_us} * 1000 * static_cast<int64_t>(items), st));
    for (size_t i = 0; i < items; ++i) {
      SchemeRun& r = runs[i / 2];
      if (flush_bytes > 0 && flush_by_reading) {
        TP_RETURN_IF_ERROR(LaunchL2FlushByReading(flush.data(), flush_bytes, st));
      } else if (flush_bytes > 0) {
        TP_CUDA_CHECK(cudaMemsetAsync(flush.data(), i & 0xff, flush_bytes, st));
      }
      TP_RETURN_IF_ERROR(events[2 * i].Record(st));
      TP_RETURN_IF_ERROR((i % 2 ? r.gemm_graph : r.quantize_graph).Launch(st));
      TP_RETURN_IF_ERROR(events[2 * i + 1].Record(st));
    }
    TP_RETURN_IF_ERROR(stream.Synchronize());
    if (round < 0) continue;
    for (size_t i = 0; i < items; ++i) {
      TP_ASSIGN_OR_RETURN(float ms, CudaEvent::ElapsedMs(events[2 * i], events[2 * i + 1]));
      (i % 2 ? runs[i / 2].gemm_ms : runs[i / 2].quantize_ms).push_back(ms);
    }
  }

  // The per-tensor GEMM is the baseline (first in `schemes` when present).
  double base_ms = 0.0;
  const SchemeRun* base = nullptr;
  for (const SchemeRun& r : runs) {
    if (r.scheme == GemmScaleScheme::kPerTensor) {
      base = &r;
      base_ms = Stats(r.gemm_ms)["median_ms"].get<double>();
    }
  }
  for (const SchemeRun& r : runs) {
    const json gemm = Stats(r.gemm_ms), quant = Stats(r.quantize_ms);
    const double gemm_med = gemm["median_ms"].get<double>();
    json rec{{"impl", "tpserve"},
             {"bench", "gemm_scales"},
             {"layer", shape.layer},
             {"m", m},
             {"n", n},
             {"k", k},
             {"scheme", std::string(GemmScaleSchemeName(r.scheme))},
             {"gemm", gemm},
             {"quantize", quant},
             {"gemm_tflops", 2.0 * m * n * k / (gemm_med * 1e-3) / 1e12},
             {"l2_flush_mib", f.l2_flush_mib},
             {"l2_flush_mode", f.l2_flush_mode}};
    if (base != nullptr && base_ms > 0.0) {
      const double ratio = gemm_med / base_ms;
      const double limit = LimitOf(f, r.scheme);
      const bool judged = r.scheme != GemmScaleScheme::kPerTensor && m >= f.judge_min_m;
      rec["gemm_ratio_vs_per_tensor"] = ratio;
      rec["limit"] = limit;
      rec["judged"] = judged;
      if (judged) {
        rec["within_limit"] = ratio <= limit;
        if (ratio > limit) *all_within = false;
      }
    }
    if (f.check && base != nullptr && &r != base) {
      // Same real weights, activations quantized three ways: the outputs agree to FP8
      // quantization error (a few percent); a scale read from the wrong place does not.
      TP_ASSIGN_OR_RETURN(double d, RelDiffBf16Rows(r.d.data(), base->d.data(), m, n));
      rec["check_rel_diff_vs_per_tensor"] = d;
      if (!(d <= 0.1)) {
        return InternalError(shape.layer + " m=" + std::to_string(m) + " " +
                             std::string(GemmScaleSchemeName(r.scheme)) +
                             ": output differs from per_tensor's by rel " + std::to_string(d) +
                             " (> 0.1): a scale layout is wrong");
      }
    }
    records.push_back(rec);
  }
  // Graphs before the GEMM objects whose workspaces they captured.
  for (SchemeRun& r : runs) r.gemm_graph = CudaGraphExec();
  return Status::Ok();
}

void PrintTable(const std::vector<json>& records) {
  std::printf("%-18s %6s %6s %6s %-18s %10s %9s %8s %7s %11s %s\n", "layer", "m", "n", "k",
              "scheme", "gemm_ms", "TFLOPS", "ratio", "limit", "quant_ms", "verdict");
  for (const json& r : records) {
    const double ratio = r.value("gemm_ratio_vs_per_tensor", 0.0);
    std::string verdict = "-";
    if (r.value("judged", false)) verdict = r.value("within_limit", false) ? "PASS" : "FAIL";
    std::printf(
        "%-18s %6lld %6lld %6lld %-18s %10.4f %9.1f %8.3f %7.2f %11.4f %s\n",
        r["layer"].get<std::string>().c_str(), static_cast<long long>(r["m"].get<int64_t>()),
        static_cast<long long>(r["n"].get<int64_t>()),
        static_cast<long long>(r["k"].get<int64_t>()), r["scheme"].get<std::string>().c_str(),
        r["gemm"]["median_ms"].get<double>(), r["gemm_tflops"].get<double>(), ratio,
        r.value("limit", 0.0), r["quantize"]["median_ms"].get<double>(), verdict.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

int RunGemmScalesBench(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "tpserve-bench gemm-scales: time the FP8 GEMM of each scale scheme (per_tensor, "
      "per_token_channel, blockwise) and each scheme's activation quantize kernel on one GPU; "
      "writes JSON records and prints a table judging each scheme's GEMM time against "
      "per_tensor's (exit 3 when a judged case exceeds its limit)"};
  app.add_option("--shapes", f.shapes, "Shape preset: llama3-8b (qkv, o, gate_up, down), small")
      ->check(CLI::IsMember({"llama3-8b", "small"}))
      ->capture_default_str();
  app.add_option("--m", f.ms, "M values (tokens)")->check(Positive())->capture_default_str();
  app.add_option("--schemes", f.schemes, "Scale schemes (per_tensor is the baseline)")
      ->check(CLI::IsMember({"per_tensor", "per_token_channel", "blockwise"}))
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "Untimed rounds")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--rounds", f.rounds, "Timed rounds")->check(Positive())->capture_default_str();
  app.add_option("--queue-delay-us", f.queue_delay_us,
                 "GPU spin per replay before each round, so the host queues the round first")
      ->check(CLI::Range(0, 1'000'000))
      ->capture_default_str();
  app.add_option("--l2-flush-mib", f.l2_flush_mib,
                 "MiB written (or read) before each replay to flush the L2 (0: off)")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--l2-flush-mode", f.l2_flush_mode,
                 "How the flush evicts the L2: write (a memset, which leaves dirty lines that "
                 "the timed GEMM may pay to write back) or read (a kernel that only reads the "
                 "buffer, leaving clean lines)")
      ->check(CLI::IsMember({"write", "read"}))
      ->capture_default_str();
  app.add_option("--per-token-limit", f.per_token_limit,
                 "Largest per_token_channel / per_tensor GEMM time ratio that passes")
      ->capture_default_str();
  app.add_option("--blockwise-limit", f.blockwise_limit,
                 "Largest blockwise / per_tensor GEMM time ratio that passes")
      ->capture_default_str();
  app.add_option("--judge-min-m", f.judge_min_m, "Judge the limits only at M >= this")
      ->check(Positive())
      ->capture_default_str();
  app.add_flag("!--no-check", f.check,
               "Skip comparing each scheme's output with per_tensor's (rel <= 0.1)");
  AddGemmAlgoFlag(&app, &f.gemm_algo);
  app.add_option("--out", f.out, "JSON output file")->capture_default_str();
  app.add_option("--commit", f.commit, "Commit id recorded in the JSON meta")
      ->capture_default_str();
  StrictNumbers(app);
  CLI11_PARSE(app, argc, argv);

  std::vector<GemmScaleScheme> schemes;
  for (const std::string& s : f.schemes) schemes.push_back(ParseGemmScaleScheme(s).value());
  std::sort(schemes.begin(), schemes.end());
  schemes.erase(std::unique(schemes.begin(), schemes.end()), schemes.end());

  if (cudaSetDevice(0) != cudaSuccess) {
    spdlog::error("gemm-scales: no CUDA device");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::ostringstream cmd;
  for (int i = 0; i < argc; ++i) cmd << (i ? " " : "") << argv[i];
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  json out{{"meta",
            {{"commit", f.commit},
             {"date", date},
             {"device", prop.name},
             {"cublaslt", static_cast<int64_t>(cublasLtGetVersion())},
             {"gemm_algo", f.gemm_algo},
             {"per_token_limit", f.per_token_limit},
             {"blockwise_limit", f.blockwise_limit},
             {"judge_min_m", f.judge_min_m},
             {"command", "tpserve-bench " + cmd.str()}}},
           {"records", json::array()}};
  std::vector<json> records;
  bool all_within = true;
  for (const LayerShape& shape : Shapes(f.shapes)) {
    for (int64_t m : f.ms) {
      const Status s = RunCase(f, shape, m, schemes, records, &all_within);
      if (!s.ok()) {
        spdlog::error("{} m={}: {}", shape.layer, m, s.ToString());
        return 1;
      }
      out["records"] = records;
      // Rewritten after every case: a later failure keeps what was measured.
      if (std::string err = WriteReplacing(f.out, out.dump(1) + "\n"); !err.empty()) {
        spdlog::error("{}", err);
        return 1;
      }
    }
  }
  PrintTable(records);
  std::printf(
      "gemm-scales: %s (limits: per_token_channel <= %.2fx, blockwise <= %.2fx the "
      "per_tensor GEMM at M >= %lld); results in %s\n",
      all_within ? "ALL WITHIN LIMITS" : "SOME CASES EXCEED THEIR LIMIT", f.per_token_limit,
      f.blockwise_limit, static_cast<long long>(f.judge_min_m), f.out.c_str());
  return all_within ? 0 : 3;
}

}  // namespace tpserve
