// tpserve-bench: times the TP linear layers on the GPUs of one host (one
// process per GPU as in serving, or ranks as threads), every overlap method side by side with the
// GEMM alone and the communication alone, in CUDA-graph replay mode with CUDA events around each
// replay. Writes the records of benchmarks/README.md's JSON schema (impl "tpserve");
// benchmarks/run_overlap_bench.sh merges them with the PyTorch peer's records of the same run.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_gemm_scales.h"
#include "benchmarks/bench_layers.h"
#include "benchmarks/device_compare.h"
#include "benchmarks/tune_choice.h"
#include "benchmarks/write_replacing.h"
#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/rank_group.h"
#include "layers/cublaslt_gemm.h"
#include "layers/cuda_linear.h"
#include "layers/overlap_config.h"
#include "layers/quantize_kernels.h"
#include "layers/random_fill.h"
#include "layers/sum_kernels.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_graph_priority.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

using json = nlohmann::json;

struct ShapeCase {
  std::string layer;  // e.g. "llama70b.gate_up"
  OverlapOp op;
  int64_t m, n, k;  // global problem
};

struct Method {
  std::string method;  // gemm_only | comm_only | none | pipeline | ring | auto | layer_gemm
  LinearKnobs knobs;
};

struct Flags {
  std::string shapes = "llama70b";
  std::vector<int64_t> ms = {512, 2048, 8192, 16384};
  std::vector<std::string> dtypes = {"fp8"};
  std::vector<int> chunks = {2, 4};
  // pipeline_ce / ring_ce on request only: see LinearKnobs::copy_engine. tpserve-tune's
  // default is {none, pipeline, ring} (Main).
  std::vector<std::string> methods = {"gemm_only", "comm_only", "none",
                                      "pipeline",  "ring",      "layer_gemm"};
  std::vector<int> max_ctas = {0};  // NCCL CTA limits to sweep (0 = NCCL's default)
  int tp = 2;
  std::string ranks = "processes";  // processes (one per GPU, as served) | threads
  int warmup = 5;
  int queue_delay_us = 100;  // GPU delay per method before each round (host queues ahead)
  int l2_flush_mib = 128;    // written before each timed replay: the L2 holds no operand
  bool breakdown = false;    // also time each pipeline/ring method's GEMM and comm steps alone
  int timeout_s = 120;       // bound on every wait for the GPUs (then abort, not hang)
  std::string overlap;       // overlap config (YAML) for method auto
  int rounds = 30;
  bool check = true;
  bool fast_accum = false;
  // FP8 scale scheme of every layer (layers/scale_scheme.h): per_tensor, per_token_channel or
  // blockwise; the scales are all 1/16, as per tensor. The tuned entries are keyed by it.
  std::string scale_scheme = "per_tensor";
  bool split_output = false;  // gemm_rs layer methods as the engine runs them (RunSplit + reader)
  std::string gemm_algo = "timed";      // GemmAlgoSelection of every GEMM
  std::string graph_priority = "node";  // CudaGraphExec::Priority of every graph
  std::string out = "bench.json";
  std::string commit = "unknown";
  std::string run_label;  // recorded as "run" in every record (one session, several runs)
  std::string tune_out;   // write the tuned overlap config (YAML) here (tpserve-tune: overlap.yaml)
  // Tuning: the fastest layer methods of each case timed again among
  // themselves (with plain none), and the tuned choice made from that round.
  int finalists = 3;
};

std::vector<ShapeCase> MakeShapes(const Flags& f) {
  std::vector<ShapeCase> out;
  if (f.shapes == "llama70b") {
    for (int64_t m : f.ms) {
      out.push_back({"llama70b.qkv", OverlapOp::kAllGatherGemm, m, 10240, 8192});
      out.push_back({"llama70b.o", OverlapOp::kGemmReduceScatter, m, 8192, 8192});
      out.push_back({"llama70b.gate_up", OverlapOp::kAllGatherGemm, m, 57344, 8192});
      out.push_back({"llama70b.down", OverlapOp::kGemmReduceScatter, m, 8192, 28672});
    }
  } else if (f.shapes == "seed") {
    out.push_back({"seed.ag_gemm", OverlapOp::kAllGatherGemm, 65536, 1024LL * f.tp, 4096});
  } else if (f.shapes == "small") {
    for (int64_t m : f.ms) {
      out.push_back({"small.ag", OverlapOp::kAllGatherGemm, m, 1024, 1024});
      out.push_back({"small.rs", OverlapOp::kGemmReduceScatter, m, 1024, 1024});
    }
  }
  return out;
}

// `overlap`: the config that method "auto" resolves (null: no auto).
// The scale scheme of a case's layers: --scale-scheme for fp8, per tensor for bf16.
GemmScaleScheme SchemeOf(const Flags& f, DataType dtype) {
  if (dtype != DataType::kFloat8E4M3) return GemmScaleScheme::kPerTensor;
  auto scheme = ParseGemmScaleScheme(f.scale_scheme);  // the flag's check admits only names
  return scheme.ok() ? *scheme : GemmScaleScheme::kPerTensor;
}

// Whether a layer with a fine scale scheme runs these knobs: not full_weight, and no GEMM of
// the plan adds into C (cuBLASLt takes per-row and per-group scales with beta 0 only).
bool FineSchemeRuns(const LinearKnobs& knobs, OverlapOp op, int tp, int64_t m) {
  if (knobs.full_weight) return false;
  auto plan = MakeOverlapPlan(LinearPlanRequest(op, knobs, tp, 0, m));
  if (!plan.ok()) return false;
  return std::none_of(plan->steps.begin(), plan->steps.end(),
                      [](const PlanStep& s) { return s.accumulate; });
}

std::vector<Method> MakeMethods(const Flags& f, const ShapeCase& sc, const OverlapConfig* overlap,
                                GemmScaleScheme scheme) {
  const OverlapOp op = sc.op;
  std::vector<Method> out;
  const bool fine = scheme != GemmScaleScheme::kPerTensor;
  // A method, and with --breakdown its GEMM steps alone and its communication
  // steps alone under the same knobs. A fine scale scheme leaves out what it cannot run.
  auto add = [&](const Method& m) {
    if (fine && !FineSchemeRuns(m.knobs, op, f.tp, sc.m)) return;
    out.push_back(m);
    if (!f.breakdown) return;
    for (const char* part : {"layer_gemm", "layer_comm"}) {
      Method g = m;
      g.method = part;
      out.push_back(g);
    }
  };
  for (const std::string& name : f.methods) {
    Method base;
    base.knobs.fast_accum = f.fast_accum;
    if (name == "auto") {
      if (overlap == nullptr) continue;
      // The layer's knobs as a served model would get them: by name, then
      // the tuned table at this M (falling back to none).
      auto knobs = overlap->Resolve(sc.layer, op, sc.n, sc.k, sc.m, f.tp, scheme);
      if (!knobs.ok()) {
        spdlog::error("{} m={}: method auto: {}", sc.layer, sc.m, knobs.status().ToString());
        continue;
      }
      base.method = "auto";
      base.knobs = *knobs;
      base.knobs.fast_accum = base.knobs.fast_accum || f.fast_accum;
      out.push_back(base);
      continue;
    }
    if (name == "gemm_only" || name == "comm_only" || name == "none" || name == "layer_gemm") {
      base.method = name;
      out.push_back(base);
    } else if (name == "none_ce") {
      // Mode none over peer memory: recorded as method none with
      // copy_engine in its config.
      base.method = "none";
      base.knobs.copy_engine = true;
      add(base);
    } else if (name == "none_fullw" || name == "pipeline_fullw" || name == "ring_fullw") {
      // gemm_rs without partial sums (LinearKnobs::full_weight): the whole weight on every
      // rank, the peers' input columns of the own rows pulled by copy engines; recorded as
      // none / pipeline / ring with copy_engine and full_weight. Ring (a lead of rows /
      // (2 * chunks) rows on the own columns first) also at one chunk.
      if (op != OverlapOp::kGemmReduceScatter) continue;
      const OverlapMode mode = name == "none_fullw"       ? OverlapMode::kNone
                               : name == "pipeline_fullw" ? OverlapMode::kPipeline
                                                          : OverlapMode::kRing;
      std::vector<int> chunks = mode == OverlapMode::kNone ? std::vector<int>{1} : f.chunks;
      if (mode == OverlapMode::kRing &&
          std::find(chunks.begin(), chunks.end(), 1) == chunks.end()) {
        chunks.insert(chunks.begin(), 1);
      }
      for (int c : chunks) {
        Method m = base;
        m.method = OverlapModeName(mode);
        m.knobs.mode = mode;
        m.knobs.chunks = c;
        m.knobs.copy_engine = true;
        m.knobs.full_weight = true;
        add(m);
      }
    } else if (name == "pipeline" || name == "ring" || name == "pipeline_ce" || name == "ring_ce" ||
               name == "ring_inplace") {
      // ring_inplace: ring over peer memory, gemm_rs layers reading the running sums in the
      // peers' memory (LinearKnobs::in_place); recorded as ring with copy_engine and in_place.
      const bool in_place = name == "ring_inplace";
      if (in_place && op != OverlapOp::kGemmReduceScatter) continue;
      const bool ce = name.ends_with("_ce") || in_place;
      const bool ring = name.starts_with("ring");
      // Copy engines also at one chunk: their transfer has no kernel to
      // overlap with, so at small M a single pull may be the fastest.
      std::vector<int> chunks = f.chunks;
      if (ce && std::find(chunks.begin(), chunks.end(), 1) == chunks.end()) {
        chunks.insert(chunks.begin(), 1);
      }
      for (int c : chunks) {
        for (int ctas : f.max_ctas) {
          if (ce && ctas != 0) continue;  // copy engines use no NCCL CTAs
          Method m = base;
          m.method = ring ? "ring" : "pipeline";
          m.knobs.mode = ring ? OverlapMode::kRing : OverlapMode::kPipeline;
          m.knobs.chunks = c;
          m.knobs.comm.max_ctas = ctas;
          m.knobs.copy_engine = ce;
          m.knobs.in_place = in_place;
          add(m);
        }
      }
    }
  }
  return out;
}

json Stats(std::vector<float> t) {
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  auto q = [&](double p) {
    const double pos = p * (n - 1);
    const size_t lo = static_cast<size_t>(pos);
    const size_t hi = std::min(lo + 1, n - 1);
    return t[lo] + (t[hi] - t[lo]) * (pos - lo);
  };
  double mean = 0;
  for (float v : t) mean += v;
  mean /= n;
  double var = 0;
  for (float v : t) var += (v - mean) * (v - mean);
  return json{{"median_ms", q(0.5)},
              {"min_ms", t.front()},
              {"max_ms", t.back()},
              {"mean_ms", mean},
              {"stddev_ms", n > 1 ? std::sqrt(var / (n - 1)) : 0.0},
              {"iqr_ms", q(0.75) - q(0.25)},
              {"rounds", n}};
}

json KnobsJson(const LinearKnobs& k) {
  return json{{"mode", OverlapModeName(k.mode)},
              {"chunks", k.chunks},
              {"min_ctas", k.comm.min_ctas},
              {"max_ctas", k.comm.max_ctas},
              {"cta_policy", CtaPolicyName(k.comm.cta_policy)},
              {"copy_engine", k.copy_engine},
              {"fast_accum", k.fast_accum},
              {"in_place", k.in_place},
              {"full_weight", k.full_weight}};
}

// One method of one case on one rank, ready to replay.
struct Prepared {
  std::unique_ptr<CudaLinear> layer;
  CublasLtGemm gemm;
  GemmParams gemm_params;
  DeviceBuffer comm_in, comm_out;
  CudaGraphExec graph;
  std::vector<float> times;
};

Status RunCase(RankGroup& group, const Flags& f, const ShapeCase& sc, const OverlapConfig* overlap,
               DataType dtype, std::vector<json>& records) {
  const int tp = group.size();
  const bool ag = sc.op == OverlapOp::kAllGatherGemm;
  const int64_t n_local = ag ? sc.n / tp : sc.n, k_local = ag ? sc.k : sc.k / tp;
  const GemmScaleScheme scheme = SchemeOf(f, dtype);
  const std::vector<Method> methods = MakeMethods(f, sc, overlap, scheme);
  CudaLinearOptions layer_options;  // every layer's and gemm_only's GEMM alike
  layer_options.gemm_algo = GemmAlgoFromFlag(f.gemm_algo);
  std::vector<std::vector<json>> rank_records(tp);
  Status s = group.Run([&](int r) -> Status {
    NcclCommPool& pool = group.pool(r);
    NcclCommunicator& base = pool.base();
    TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
    cudaStream_t st = stream.get();
    const size_t e = DataTypeSize(dtype);
    const RowRange own = ShardRows(sc.m, tp, r);
    // Operands: W_r and the full local X (the GEMM alone reads all of it; the
    // layers get their part), random, with dequantization scales of 1/16.
    TP_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(n_local * k_local * e, "bench.w"));
    TP_ASSIGN_OR_RETURN(DeviceBuffer x_full,
                        DeviceBuffer::Allocate(sc.m * k_local * e, "bench.x_full"));
    // x and w scales 16 bytes apart (cuBLASLt wants them 16-byte aligned).
    TP_ASSIGN_OR_RETURN(DeviceBuffer scales, DeviceBuffer::Allocate(8 * sizeof(float), "scales"));
    const float sc_host[8] = {1.0f / 16, 0, 0, 0, 1.0f / 16, 0, 0, 0};
    // On `st`: a cudaMemcpy from pageable memory may return before its DMA
    // lands, and `st` (non-blocking) would not wait for it.
    TP_CUDA_CHECK(
        cudaMemcpyAsync(scales.data(), sc_host, sizeof sc_host, cudaMemcpyHostToDevice, st));
    const float* xs = scales.as<float>();
    const float* ws = scales.as<float>() + 4;
    // A fine scheme's scales, all 1/16 (x's per row or 1x128 group of all m rows, w's per row
    // or 128x128 block): one buffer serves both.
    DeviceBuffer fine_scales;
    if (scheme != GemmScaleScheme::kPerTensor) {
      const int64_t groups = scheme == GemmScaleScheme::kBlockwise ? k_local / kGemmScaleBlock : 1;
      const int64_t w_count = scheme == GemmScaleScheme::kBlockwise
                                  ? n_local / kGemmScaleBlock * BlockwiseWeightScalePitch(k_local)
                                  : n_local;
      const int64_t count = std::max(sc.m * groups, w_count);
      TP_ASSIGN_OR_RETURN(fine_scales, DeviceBuffer::Allocate(count * 4, "bench.fine_scales"));
      TP_RETURN_IF_ERROR(LaunchFillPattern(fine_scales.data(), count, 4, 0x3D800000u, st));
      xs = ws = fine_scales.as<float>();
    }
    const bool fp8 = dtype == DataType::kFloat8E4M3;
    const float amp = fp8 ? 16.0f : 1.0f;
    TP_RETURN_IF_ERROR(LaunchRandomUniform(w.data(), dtype, n_local * k_local, 1000 + r, amp, st));
    TP_RETURN_IF_ERROR(
        LaunchRandomUniform(x_full.data(), dtype, sc.m * k_local, 2000 + (ag ? 0 : r), amp, st));
    // full_weight methods (gemm_rs): the whole weight [n, tp * k_local], rank j's W_j (drawn
    // as rank j draws it) in columns [j * k_local, (j + 1) * k_local).
    DeviceBuffer w_full;
    if (std::any_of(methods.begin(), methods.end(),
                    [](const Method& m) { return m.knobs.full_weight; })) {
      TP_ASSIGN_OR_RETURN(w_full,
                          DeviceBuffer::Allocate(tp * n_local * k_local * e, "bench.w_full"));
      TP_ASSIGN_OR_RETURN(DeviceBuffer w_j,
                          DeviceBuffer::Allocate(n_local * k_local * e, "bench.w_j"));
      for (int j = 0; j < tp; ++j) {
        TP_RETURN_IF_ERROR(
            LaunchRandomUniform(w_j.data(), dtype, n_local * k_local, 1000 + j, amp, st));
        TP_CUDA_CHECK(cudaMemcpy2DAsync(w_full.as<char>() + j * k_local * e, tp * k_local * e,
                                        w_j.data(), k_local * e, k_local * e, n_local,
                                        cudaMemcpyDeviceToDevice, st));
      }
      TP_CUDA_CHECK(cudaStreamSynchronize(st));  // before w_j is freed
    }
    const int64_t out_rows = ag ? sc.m : own.size();
    const size_t out_bytes = std::max<int64_t>(out_rows, 1) * n_local * 2;
    TP_ASSIGN_OR_RETURN(DeviceBuffer y_ref, DeviceBuffer::Allocate(out_bytes, "bench.y_ref"));
    TP_ASSIGN_OR_RETURN(DeviceBuffer y, DeviceBuffer::Allocate(out_bytes, "bench.y"));
    TP_ASSIGN_OR_RETURN(DeviceBuffer full_out,
                        DeviceBuffer::Allocate(sc.m * n_local * 2, "bench.full_out"));
    // --split-output: what the stand-in consumer of a gemm_rs layer writes.
    DeviceBuffer consumed;
    if (f.split_output && !ag) {
      TP_ASSIGN_OR_RETURN(consumed, DeviceBuffer::Allocate(out_bytes, "bench.consumed"));
    }
    auto split_body = [&](const Method& m) {
      return f.split_output && !ag && m.method != "layer_gemm" && m.method != "layer_comm";
    };
    // Where a layer method's checked output lands.
    auto out_of = [&](const Method& m) { return split_body(m) ? consumed.data() : y.data(); };

    // The reference every layer method is checked against: plain mode none
    // (NCCL), run once here, whatever --methods lists and in whatever order
    // (a run without none used to compare against never-written memory).
    auto checked = [&](const Method& m) {
      return m.method != "gemm_only" && m.method != "comm_only" && m.method != "layer_gemm" &&
             m.method != "layer_comm";
    };
    const bool check = f.check && std::any_of(methods.begin(), methods.end(), checked);
    if (check) {
      CudaLinearShape shape{sc.op, dtype, sc.m, n_local, k_local, scheme};
      TP_ASSIGN_OR_RETURN(auto ref, CudaLinear::Create("bench." + sc.layer + ".reference", shape,
                                                       LinearKnobs{}, pool, layer_options));
      TP_RETURN_IF_ERROR(ref->Prepare(sc.m));
      const void* src =
          static_cast<const char*>(x_full.data()) + (ag ? own.begin * k_local * e : 0);
      TP_CUDA_CHECK(cudaMemcpyAsync(ref->input(sc.m), src, ref->input_bytes(sc.m),
                                    cudaMemcpyDeviceToDevice, st));
      TP_RETURN_IF_ERROR(ref->Run(sc.m, w.data(), xs, ws, y_ref.data(), st));
      TP_RETURN_IF_ERROR(base.WaitStream(st));
    }

    // Build every method, check it against the reference, and capture its graph.
    std::vector<Prepared> prepared(methods.size());
    std::vector<std::function<Status()>> bodies(methods.size());
    std::vector<json> checks(methods.size());
    for (size_t i = 0; i < methods.size(); ++i) {
      const Method& m = methods[i];
      Prepared& p = prepared[i];
      if (m.method == "gemm_only") {
        TP_ASSIGN_OR_RETURN(p.gemm,
                            CublasLtGemm::Create("bench.gemm_only", layer_options.gemm_algo));
        GemmParams& gp = p.gemm_params;
        gp.m = sc.m;
        gp.n = n_local;
        gp.k = k_local;
        gp.a_type = gp.b_type = dtype;
        gp.d_type = DataType::kBFloat16;
        gp.fast_accum = fp8 && f.fast_accum;
        gp.scale_scheme = scheme;
        if (fp8) {
          gp.a_scale = xs;
          gp.b_scale = ws;
        }
        TP_RETURN_IF_ERROR(p.gemm.Prepare(gp));
        bodies[i] = [&, i] {
          return prepared[i].gemm.Run(prepared[i].gemm_params, x_full.data(), w.data(), nullptr,
                                      full_out.data(), st);
        };
      } else if (m.method == "comm_only") {
        // The layer's communication alone: AllGather of every rank's shard of
        // X, or ReduceScatter of the [m, n] BF16 partial.
        if (ag) {
          const size_t bytes = ShardRows(sc.m, tp, 0).size() * k_local * e;
          TP_ASSIGN_OR_RETURN(p.comm_in, DeviceBuffer::Allocate(bytes, "bench.comm_in"));
          TP_ASSIGN_OR_RETURN(p.comm_out, DeviceBuffer::Allocate(bytes * tp, "bench.comm_out"));
          bodies[i] = [&, i, bytes] {
            return base.AllGather(prepared[i].comm_in.data(), prepared[i].comm_out.data(), bytes,
                                  st);
          };
        } else {
          const size_t count = ShardRows(sc.m, tp, 0).size() * n_local;
          TP_ASSIGN_OR_RETURN(p.comm_in, DeviceBuffer::Allocate(count * tp * 2, "bench.comm_in"));
          TP_ASSIGN_OR_RETURN(p.comm_out, DeviceBuffer::Allocate(count * 2, "bench.comm_out"));
          TP_RETURN_IF_ERROR(LaunchRandomUniform(p.comm_in.data(), DataType::kBFloat16, count * tp,
                                                 3000 + r, 1.0f, st));
          bodies[i] = [&, i, count] {
            return base.ReduceScatter(prepared[i].comm_in.data(), prepared[i].comm_out.data(),
                                      count, DataType::kBFloat16, st);
          };
        }
      } else {
        CudaLinearShape shape{sc.op, dtype, sc.m, n_local, k_local, scheme};
        const void* wm = m.knobs.full_weight ? w_full.data() : w.data();
        TP_ASSIGN_OR_RETURN(
            p.layer, CudaLinear::Create("bench." + sc.layer, shape, m.knobs, pool, layer_options));
        TP_RETURN_IF_ERROR(p.layer->Prepare(sc.m));
        const void* src =
            static_cast<const char*>(x_full.data()) + (ag ? own.begin * k_local * e : 0);
        TP_CUDA_CHECK(cudaMemcpyAsync(p.layer->input(sc.m), src, p.layer->input_bytes(sc.m),
                                      cudaMemcpyDeviceToDevice, st));
        // The breakdown's parts compute nothing to check.
        void* dst = y.data();
        // One full run first: it fills the gather buffers that layer_gemm
        // reads (a GEMM over never-written memory would time zeros).
        if (out_rows > 0) {
          TP_RETURN_IF_ERROR(LaunchPoisonFill(dst, DataType::kBFloat16, out_rows * n_local, st));
        }
        TP_RETURN_IF_ERROR(p.layer->Run(sc.m, wm, xs, ws, dst, st));
        if (m.method == "layer_gemm") {
          bodies[i] = [&, i, dst, wm] {
            return prepared[i].layer->RunGemmOnly(sc.m, wm, xs, ws, dst, st);
          };
        } else if (m.method == "layer_comm") {
          bodies[i] = [&, i, dst] { return prepared[i].layer->RunCommOnly(sc.m, dst, st); };
        } else if (split_body(m)) {
          // The layer, then its consumer's read: both addends where RunSplit left two (their
          // sum), else the output alone (a copy).
          bodies[i] = [&, i, dst, wm]() -> Status {
            CudaLinear::SplitOutput split;
            TP_RETURN_IF_ERROR(prepared[i].layer->RunSplit(sc.m, wm, xs, ws, dst, st, &split));
            SumSlotsParams reader;
            reader.dst = consumed.data();
            reader.slots[0] = split.first;
            reader.slots[1] = split.second;
            reader.num_slots = split.second != nullptr ? 2 : 1;
            reader.count = out_rows * n_local;
            return LaunchSumSlotsBf16(reader, st);
          };
          if (out_rows > 0) {
            TP_RETURN_IF_ERROR(
                LaunchPoisonFill(consumed.data(), DataType::kBFloat16, out_rows * n_local, st));
          }
          TP_RETURN_IF_ERROR(bodies[i]());
        } else {
          bodies[i] = [&, i, dst, wm] { return prepared[i].layer->Run(sc.m, wm, xs, ws, dst, st); };
        }
        TP_RETURN_IF_ERROR(base.WaitStream(st));
        if (check && checked(m) && out_rows > 0) {
          TP_ASSIGN_OR_RETURN(double d,
                              RelDiffBf16Rows(out_of(m), y_ref.data(), out_rows, n_local));
          checks[i] = d;
          if (!(d <= 1e-2)) {
            return InternalError(sc.layer + " " + m.method + " " + m.knobs.ToString() +
                                 " differs from mode none: rel " + std::to_string(d));
          }
        }
      }
      for (int k = 0; k < 2; ++k) TP_RETURN_IF_ERROR(bodies[i]());
      TP_RETURN_IF_ERROR(base.WaitStream(st));
      TP_ASSIGN_OR_RETURN(p.graph,
                          CudaGraphExec::Capture(st, cudaStreamCaptureModeThreadLocal, bodies[i],
                                                 GraphPriorityFromFlag(f.graph_priority)));
      if (r == 0) {
        spdlog::info("{} m={} {}: prepared {} {} ({}/{})", sc.layer, sc.m, fp8 ? "fp8" : "bf16",
                     m.method, m.knobs.ToString(), i + 1, methods.size());
      }
    }

    // Time the methods interleaved, round by round, so that clock and power
    // drift over the run falls on all of them alike.
    std::vector<CudaEvent> events;
    for (size_t i = 0; i < 2 * methods.size(); ++i) {
      TP_ASSIGN_OR_RETURN(CudaEvent ev, CudaEvent::Create(true));
      events.push_back(std::move(ev));
    }
    // A 16-byte AllGather before each timed replay lines the ranks up, so that
    // a rank that started its round late (host-side polling) does not charge
    // its lateness to the first collective of the round.
    TP_ASSIGN_OR_RETURN(DeviceBuffer sync, DeviceBuffer::Allocate(16 * (tp + 1), "bench.sync"));
    // Without a flush, a method replayed right after one that read the same
    // weights finds part of them in L2 (the sweep interleaves dozens of
    // graphs, the peer times each method back to back): the same GEMM then
    // differs by up to ~10 % at small M (benchmarks/PERFORMANCE.md).
    const size_t flush_bytes = static_cast<size_t>(f.l2_flush_mib) << 20;
    DeviceBuffer flush;
    if (flush_bytes > 0) {
      TP_ASSIGN_OR_RETURN(flush, DeviceBuffer::Allocate(flush_bytes, "bench.l2_flush"));
    }
    // Times the methods `which` (indices into `methods`), appending each
    // round's time to times[i].
    auto time_rounds = [&](const std::vector<size_t>& which,
                           std::vector<std::vector<float>>& times) -> Status {
      for (int round = -f.warmup; round < f.rounds; ++round) {
        // The GPU waits while the host queues the whole round: no timed
        // interval then holds host launch latency (small cases are shorter
        // than a graph launch plus the AllGather's).
        TP_RETURN_IF_ERROR(LaunchGpuDelay(
            int64_t{f.queue_delay_us} * 1000 * static_cast<int64_t>(which.size()), st));
        for (size_t i : which) {
          if (flush_bytes > 0)
            TP_CUDA_CHECK(cudaMemsetAsync(flush.data(), i & 0xff, flush_bytes, st));
          TP_RETURN_IF_ERROR(base.AllGather(sync.data(), sync.as<char>() + 16, 16, st));
          TP_RETURN_IF_ERROR(events[2 * i].Record(st));
          TP_RETURN_IF_ERROR(prepared[i].graph.Launch(st));
          TP_RETURN_IF_ERROR(events[2 * i + 1].Record(st));
        }
        TP_RETURN_IF_ERROR(base.WaitStream(st));
        if (round < 0) continue;
        for (size_t i : which) {
          TP_ASSIGN_OR_RETURN(float ms, CudaEvent::ElapsedMs(events[2 * i], events[2 * i + 1]));
          times[i].push_back(ms);
        }
      }
      // Each replay's time is the slowest rank's: the layer is done when its
      // last rank is (the ranks start each replay aligned, above). The
      // PyTorch peer reports the same (torch_peer.py, rank_times "max").
      const size_t n = which.size() * static_cast<size_t>(f.rounds);
      if (n == 0 || tp == 1) return Status::Ok();
      TP_ASSIGN_OR_RETURN(DeviceBuffer gathered,
                          DeviceBuffer::Allocate((tp + 1) * n * sizeof(float), "bench.times"));
      std::vector<float> table(tp * n);
      for (size_t j = 0; j < which.size(); ++j) {
        const std::vector<float>& t = times[which[j]];
        if (t.size() < static_cast<size_t>(f.rounds)) return InternalError("round count");
        std::copy(t.end() - f.rounds, t.end(), table.begin() + j * f.rounds);
      }
      float* send = gathered.as<float>() + tp * n;
      TP_CUDA_CHECK(
          cudaMemcpyAsync(send, table.data(), n * sizeof(float), cudaMemcpyHostToDevice, st));
      TP_RETURN_IF_ERROR(base.AllGather(send, gathered.data(), n * sizeof(float), st));
      TP_RETURN_IF_ERROR(base.WaitStream(st));
      TP_CUDA_CHECK(cudaMemcpy(table.data(), gathered.data(), tp * n * sizeof(float),
                               cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < which.size(); ++j) {
        std::vector<float>& t = times[which[j]];
        for (int round = 0; round < f.rounds; ++round) {
          float slowest = 0;
          for (int q = 0; q < tp; ++q)
            slowest = std::max(slowest, table[q * n + j * f.rounds + round]);
          t[t.size() - f.rounds + round] = slowest;
        }
      }
      return Status::Ok();
    };
    std::vector<size_t> all(methods.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    {
      std::vector<std::vector<float>> times(methods.size());
      TP_RETURN_IF_ERROR(time_rounds(all, times));
      for (size_t i = 0; i < methods.size(); ++i) prepared[i].times = std::move(times[i]);
    }
    // Tuning: the sweep interleaves every method, so each replay finds the
    // caches and the GPUs' queues as dozens of other graphs left them; at
    // small M that context moves a method by up to 10 % (o, M = 512:
    // benchmarks/PERFORMANCE.md), more than the gaps between the best few. The
    // fastest few layer methods (by rank 0's medians, shared so that every
    // rank replays the same graphs) are timed again among themselves, with
    // plain none, and the tuner chooses from that round.
    std::vector<size_t> finals;
    if (!f.tune_out.empty() && f.finalists > 0) {
      std::vector<std::pair<double, size_t>> ranked;
      int32_t none_index = -1;
      for (size_t i = 0; i < methods.size(); ++i) {
        const std::string& name = methods[i].method;
        if (!IsTuneCandidate(name)) continue;
        if (name == "none" && !methods[i].knobs.copy_engine) none_index = static_cast<int32_t>(i);
        if (prepared[i].times.empty()) continue;
        ranked.push_back({Stats(prepared[i].times)["median_ms"].get<double>(), i});
      }
      std::sort(ranked.begin(), ranked.end());
      std::vector<int32_t> pick(f.finalists + 1, -1);
      pick[0] = none_index;
      for (int j = 0, n = 0; j < static_cast<int>(ranked.size()) && n < f.finalists; ++j) {
        if (static_cast<int32_t>(ranked[j].second) == none_index) continue;
        pick[1 + n++] = static_cast<int32_t>(ranked[j].second);
      }
      TP_ASSIGN_OR_RETURN(DeviceBuffer shared,
                          DeviceBuffer::Allocate(pick.size() * sizeof(int32_t), "bench.finals"));
      TP_CUDA_CHECK(cudaMemcpyAsync(shared.data(), pick.data(), pick.size() * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, st));
      TP_RETURN_IF_ERROR(base.Broadcast(shared.data(), pick.size() * sizeof(int32_t), 0, st));
      TP_RETURN_IF_ERROR(base.WaitStream(st));
      TP_CUDA_CHECK(cudaMemcpy(pick.data(), shared.data(), pick.size() * sizeof(int32_t),
                               cudaMemcpyDeviceToHost));
      for (int32_t i : pick) {
        if (i >= 0 && static_cast<size_t>(i) < methods.size()) finals.push_back(i);
      }
    }
    std::vector<std::vector<float>> final_times(methods.size());
    if (finals.size() > 1) TP_RETURN_IF_ERROR(time_rounds(finals, final_times));
    // The replayed graphs must compute what the eager runs did.
    for (size_t i = 0; i < methods.size(); ++i) {
      const std::string& name = methods[i].method;
      if (!check || !prepared[i].layer || !checked(methods[i]) || out_rows == 0) continue;
      void* out = out_of(methods[i]);
      TP_RETURN_IF_ERROR(LaunchPoisonFill(out, DataType::kBFloat16, out_rows * n_local, st));
      TP_RETURN_IF_ERROR(prepared[i].graph.Launch(st));
      TP_RETURN_IF_ERROR(base.WaitStream(st));
      TP_ASSIGN_OR_RETURN(double d, RelDiffBf16Rows(out, y_ref.data(), out_rows, n_local));
      if (!(d <= 1e-2)) {
        return InternalError(sc.layer + " " + name + " " + methods[i].knobs.ToString() +
                             ": graph replay differs from mode none: rel " + std::to_string(d));
      }
      checks[i] = std::max(checks[i].get<double>(), d);
    }
    for (size_t i = 0; i < methods.size(); ++i) {
      const Method& m = methods[i];
      json rec{{"impl", "tpserve"},
               {"layer", sc.layer},
               {"op", OverlapOpName(sc.op)},
               {"method", m.method},
               {"dtype", fp8 ? "fp8" : "bf16"},
               {"scale_scheme", GemmScaleSchemeName(scheme)},
               {"tp", tp},
               {"m", sc.m},
               {"n", sc.n},
               {"k", sc.k},
               {"chunks", m.knobs.chunks},
               {"config", KnobsJson(m.knobs)},
               {"l2_flush_mib", f.l2_flush_mib},
               {"rank_times", tp > 1 ? "max" : "rank0"}};
      if (!f.run_label.empty()) rec["run"] = f.run_label;
      if (split_body(m) && prepared[i].layer) rec["split_output"] = true;
      rec.update(Stats(prepared[i].times));
      // Every round's time (the slowest rank's), as the peer records its own.
      rec["times_ms"] = json::array();
      for (float t : prepared[i].times) rec["times_ms"].push_back(std::round(t * 1e6) / 1e6);
      if (!checks[i].is_null()) rec["check_rel_diff_vs_none"] = checks[i];
      if (!final_times[i].empty()) {
        // The tuner's second round (see above): median among the finalists.
        rec["tune_final_median_ms"] = Stats(final_times[i])["median_ms"];
      }
      rank_records[r].push_back(rec);
    }
    // Graphs before the layers and communicators they captured.
    for (Prepared& p : prepared) p.graph = CudaGraphExec();
    TP_RETURN_IF_ERROR(base.WaitStream(st));
    for (Prepared& p : prepared) {
      if (p.layer != nullptr) TP_RETURN_IF_ERROR(p.layer->Close());
    }
    return base.Barrier();
  });
  TP_RETURN_IF_ERROR(s);
  for (json& rec : rank_records[0]) {
    spdlog::info("{:17} m={:5} {:4} {:10} {:55} median {:.4f} ms", rec["layer"].get<std::string>(),
                 rec["m"].get<int64_t>(), rec["dtype"].get<std::string>(),
                 rec["method"].get<std::string>(), rec["config"].dump(),
                 rec["median_ms"].get<double>());
    records.push_back(rec);
  }
  return Status::Ok();
}

// The tuned file's note on --split-output.
constexpr const char* kSplitOutputNote =
    "# gemm_rs entries: timed as the engine runs o and down (--split-output): a one-chunk\n"
    "# copy-engine ring leaves its last sum to the add & norm, which reads both addends.\n";

}  // namespace

int BenchLayersMain(int argc, char** argv, bool tune) {
  // Subcommand: the single-GPU GEMM scale-scheme benchmark (bench_gemm_scales.h).
  if (!tune && argc > 1 && std::string(argv[1]) == "gemm-scales")
    return RunGemmScalesBench(argc - 1, argv + 1);
  Flags f;
  if (tune) {
    f.methods = {"none", "pipeline", "ring"};
    f.tune_out = "overlap.yaml";
    // Mode auto gives an M below every tuned entry the smallest entry's knobs, and a decode
    // step's M is its running sequences: the tuner's config covers decode sizes as well.
    f.ms = {16, 64, 256, 512, 2048, 8192, 16384};
  }
  CLI::App app{
      tune ? "tpserve-tune: sweep every overlap method and knob (chunks, NCCL CTAs, GEMM SMs, "
             "copy engines) per TP layer shape and M on this host's GPUs, and write the overlap "
             "config (YAML) that mode auto reads; also writes the measurements as JSON (--out)"
           : "tpserve-bench: time TP linear layers (every overlap method, GEMM alone, "
             "communication alone) on the GPUs of this host; writes JSON records"};
  app.add_option("--shapes", f.shapes,
                 "Shape preset: llama70b (QKV, O, gate_up, down at each "
                 "--m), seed (m=65536 k=4096 n=1024*tp), small")
      ->check(CLI::IsMember({"llama70b", "seed", "small"}))
      ->capture_default_str();
  CLI::Option* m_option =
      app.add_option("--m", f.ms,
                     "Global M values (tokens) for llama70b/small (seed: its own, 65536)")
          ->check(Positive())
          ->capture_default_str();
  app.add_option("--dtype", f.dtypes, "Operand types: fp8, bf16")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  app.add_option("--chunks", f.chunks, "Chunk counts for pipeline and ring (1 to 64)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--methods", f.methods,
                 "Methods: gemm_only, comm_only, none, pipeline, ring, auto (the knobs --overlap "
                 "gives the layer at this M), none_ce, pipeline_ce and ring_ce "
                 "(peer memory instead of NCCL kernels: copy-engine pulls, and for gemm_rs "
                 "none_ce a sum kernel reading the peers' partials; chunks 1 included; "
                 "they need --ranks processes), ring_inplace (gemm_rs only: ring over peer "
                 "memory whose GEMMs read the running sums in the peers' memory, no pulls; "
                 "chunks 1 included), none_fullw, pipeline_fullw and ring_fullw (gemm_rs only: "
                 "every rank holds the whole weight and pulls the peers' input columns of its "
                 "own rows, then one whole-K GEMM per chunk, no partial sums; ring_fullw starts "
                 "a lead of rows / (2 * chunks) rows on the own columns at once, chunks 1 "
                 "included; need --ranks processes), "
                 "layer_gemm (the layer's GEMM steps without communication)")
      ->check(CLI::IsMember({"gemm_only", "comm_only", "none", "pipeline", "ring", "auto",
                             "none_ce", "pipeline_ce", "ring_ce", "ring_inplace", "none_fullw",
                             "pipeline_fullw", "ring_fullw", "layer_gemm"}))
      ->capture_default_str();
  app.add_option("--max-ctas", f.max_ctas,
                 "NCCL max CTA counts to sweep for pipeline/ring (0 = NCCL's default; at most 64)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--tp", f.tp,
                 "Tensor-parallel size (GPUs); must divide each shape's split dimension (n of "
                 "ag_gemm, k of gemm_rs)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--ranks", f.ranks,
                 "How ranks run: processes (one per GPU, as tpserve serves; this process is "
                 "rank 0 and starts the others with the same arguments) or threads (one "
                 "process, which refuses the copy-engine methods: their graph replays hung with "
                 "ranks as threads)")
      ->check(CLI::IsMember({"processes", "threads"}))
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "Graph replays before timing")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--queue-delay-us", f.queue_delay_us,
                 "Before each round of timed replays the GPU spins this many microseconds per "
                 "method, so that the host has queued the round before it runs (0: off; then "
                 "short cases include host launch latency; at most 1000000)")
      ->check(CLI::Range(0, 1'000'000))
      ->capture_default_str();
  app.add_option("--l2-flush-mib", f.l2_flush_mib,
                 "Before each timed replay (outside its timing) write this many MiB, so that "
                 "no method finds its operands in the GPU's L2 cache (as in a model, where "
                 "each layer's weights are new; the PyTorch peer does the same); 0: off")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--rounds", f.rounds, "Timed graph replays per case")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--overlap", f.overlap,
                 "Overlap config (YAML, e.g. deploy/overlap-llama3-70b-tp2.yaml) that method "
                 "auto resolves per layer and M, as the server would; needed for --methods auto")
      ->check(CLI::ExistingFile);
  app.add_option("--timeout-s", f.timeout_s,
                 "Seconds any wait for the GPUs may take before the run aborts with an error "
                 "(NCCL work, copy-engine signals)")
      ->check(Positive())
      ->capture_default_str();
  app.add_flag("!--no-check", f.check,
               "Skip comparing each overlap method's output with mode none");
  app.add_flag("--fast-accum", f.fast_accum, "FP8 fast accumulation in every GEMM");
  app.add_option("--scale-scheme", f.scale_scheme,
                 "FP8 scale scheme of every layer and of gemm_only: per_tensor; "
                 "per_token_channel (a scale per row of X and per row of W); blockwise (1x128 "
                 "groups of X, 128x128 blocks of W; needs n and k multiples of 128 and no "
                 "--fast-accum). Every scale is 1/16. Methods the scheme cannot run (full_weight, "
                 "in_place, rings whose GEMMs add the running sum) are left out; --tune-out keys "
                 "its entries by the scheme")
      ->check(CLI::IsMember({"per_tensor", "per_token_channel", "blockwise"}))
      ->capture_default_str();
  app.add_flag("--split-output", f.split_output,
               "Time (and tune) gemm_rs layer methods as the engine runs o and down: "
               "CudaLinear::RunSplit, whose plans that end in a sum step of their own (ring, "
               "chunks 1, copy engines) leave that addition to the output's consumer, then a "
               "stand-in consumer that reads the output (both addends where there are two) and "
               "writes their sum, as the engine's add & norm reads it. Every gemm_rs layer "
               "method's time includes that read; the check compares what it wrote. "
               "gemm_only, comm_only and the --breakdown parts are unchanged");
  app.add_flag(
      "--breakdown", f.breakdown,
      "After each pipeline/ring/none_ce method, also time its GEMM steps alone (layer_gemm) "
      "and its communication steps alone (layer_comm: transfers, signals, sums; no "
      "GEMM), both with that method's config: separates the cost of chunked GEMMs "
      "from that of the transfers");
  AddGemmAlgoFlag(&app, &f.gemm_algo);  // gemm_only's GEMM too
  AddGraphPriorityFlag(&app, &f.graph_priority);
  app.add_option("--out", f.out, "JSON output file")->capture_default_str();
  app.add_option("--tune-out", f.tune_out,
                 "Autotune: write an overlap config (YAML) with the fastest layer method per "
                 "shape and M (needs exactly one --dtype; tpserve-tune writes overlap.yaml "
                 "unless told otherwise, tpserve-bench nothing)")
      ->capture_default_str();
  app.add_option("--tune-finalists", f.finalists,
                 "Autotune: time this many of each case's fastest layer methods again, among "
                 "themselves and plain none, and choose from that round (their medians are "
                 "recorded as tune_final_median_ms; 0: choose from the sweep)")
      ->check(CLI::Range(0, 16))
      ->capture_default_str();
  app.add_option("--run-label", f.run_label,
                 "Recorded as \"run\" in every record and in the meta: tells apart the runs of "
                 "one session merged into one results file (run_overlap_bench.sh: sweep, auto), "
                 "so that render_results.py judges each shape within one run");
  app.add_option("--commit", f.commit, "Commit id recorded in the JSON meta")
      ->capture_default_str();
  StrictNumbers(app);
  CLI11_PARSE(app, argc, argv);
  // Usage errors before any GPU work (a process group starts the other ranks).
  if (f.shapes == "seed" && m_option->count() > 0 && f.ms != std::vector<int64_t>{65536}) {
    spdlog::error("--m: --shapes seed has its own m (65536); --m is for llama70b and small");
    return 2;
  }
  for (const ShapeCase& sc : MakeShapes(f)) {
    const bool ag = sc.op == OverlapOp::kAllGatherGemm;
    if ((ag ? sc.n : sc.k) % f.tp != 0) {
      spdlog::error("--tp {}: {} splits {}={} over the ranks, which does not divide by {}", f.tp,
                    sc.layer, ag ? "n" : "k", ag ? sc.n : sc.k, f.tp);
      return 2;
    }
  }
  if (f.scale_scheme == "blockwise" && f.fast_accum) {
    spdlog::error(
        "--scale-scheme blockwise runs without --fast-accum (cuBLASLt's blockwise FP8 "
        "GEMM has no fast accumulation)");
    return 2;
  }
  if (!f.tune_out.empty() && f.dtypes.size() != 1) {
    spdlog::error("--tune-out tunes one operand type: give exactly one --dtype");
    return 2;
  }
  if (std::find(f.methods.begin(), f.methods.end(), "auto") != f.methods.end() &&
      f.overlap.empty()) {
    spdlog::error("--methods auto needs --overlap FILE (the config auto resolves)");
    return 2;
  }
  if (f.ranks == "threads") {
    for (const std::string& m : f.methods) {
      if ((m.size() > 3 && m.compare(m.size() - 3, 3, "_ce") == 0) || m == "ring_inplace" ||
          m.ends_with("_fullw")) {
        spdlog::error(
            "--methods {}: copy-engine methods need --ranks processes (CudaLinear refuses copy "
            "engines with ranks as threads: their graph replays hung)",
            m);
        return 2;
      }
    }
  }

  auto made = CreateRankGroup(f.ranks, std::vector<std::string>(argv, argv + argc), f.tp,
                              std::chrono::seconds(f.timeout_s));
  if (!made.ok()) {
    spdlog::error("{}", made.status().ToString());
    return 1;
  }
  const std::unique_ptr<RankGroup> group = std::move(made).value();
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  std::ostringstream cmd;
  for (int i = 0; i < argc; ++i) cmd << (i ? " " : "") << argv[i];
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  json out{{"meta",
            {{"commit", f.commit},
             {"date", date},
             {"device", std::to_string(f.tp) + "x " + prop.name},
             {"nccl", nccl_version},
             {"cublaslt", static_cast<int64_t>(cublasLtGetVersion())},
             {"gemm_algo", f.gemm_algo},
             {"graph_priority", f.graph_priority},
             {"command", cmd.str()}}},
           {"records", json::array()}};
  if (!f.run_label.empty()) out["meta"]["run"] = f.run_label;
  // The results so far, rewritten after every case (through a .tmp file and
  // a rename), so that a run stopped by a timeout keeps what it measured.
  auto write_results = [&](const std::vector<json>& records) {
    if (!group->leader()) return true;
    json doc = out;
    for (const json& r : records) doc["records"].push_back(r);
    if (std::string err = WriteReplacing(f.out, doc.dump(1) + "\n"); !err.empty()) {
      spdlog::error("{}", err);
      return false;
    }
    return true;
  };
  OverlapConfig tuned;
  tuned.set_tp(f.tp);
  {
    // Every layer takes the measured best of its shape at the nearest M.
    OverlapConfig::Rule all;
    all.match = "*";
    OverlapConfig::Setting auto_setting;
    auto_setting.auto_mode = true;
    all.settings.push_back(auto_setting);
    tuned.mutable_rules().push_back(all);
  }
  // Method auto: the overlap config as the server would load it.
  std::optional<OverlapConfig> overlap;
  if (!f.overlap.empty()) {
    auto loaded = OverlapConfig::LoadFile(f.overlap);
    if (!loaded.ok()) {
      spdlog::error("{}", loaded.status().ToString());
      return 2;
    }
    overlap = std::move(loaded).value();
  }
  const OverlapConfig* overlap_ptr = overlap ? &*overlap : nullptr;
  std::vector<json> records;
  int failures = 0;
  const std::vector<ShapeCase> shapes = MakeShapes(f);
  // Every case this run means to measure: a reader (render_results.py) can
  // then tell a case that failed or was never reached from one not asked for.
  out["meta"]["planned_cases"] = json::array();
  for (const ShapeCase& sc : shapes) {
    for (const std::string& d : f.dtypes) {
      json planned{{"layer", sc.layer}, {"m", sc.m}, {"dtype", d}};
      if (!f.run_label.empty()) planned["run"] = f.run_label;
      out["meta"]["planned_cases"].push_back(planned);
    }
  }
  // The plan on disk before the first case: a run that dies early still
  // leaves a file that says what it meant to measure.
  if (!write_results(records)) ++failures;
  size_t done = 0;
  bool stopped = false;  // the communicators were aborted: no later case can run
  for (const ShapeCase& sc : shapes) {
    if (stopped) break;
    for (const std::string& d : f.dtypes) {
      const DataType dtype = d == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
      const size_t first = records.size();
      Status s = RunCase(*group, f, sc, overlap_ptr, dtype, records);
      ++done;
      if (!s.ok()) {
        spdlog::error("{} m={} {}: {}", sc.layer, sc.m, d, s.ToString());
        ++failures;
        if (s.code() == StatusCode::kAborted || s.code() == StatusCode::kDeadlineExceeded) {
          spdlog::error("communicators aborted: the {} case(s) left are not run",
                        shapes.size() * f.dtypes.size() - done);
          stopped = true;
          break;
        }
        continue;
      }
      if (!write_results(records)) ++failures;
      // The tuned choice (benchmarks/tune_choice.h): the finalists' second
      // round when there was one, else the sweep.
      const GemmScaleScheme scheme = SchemeOf(f, dtype);
      const std::vector<Method> methods = MakeMethods(f, sc, overlap_ptr, scheme);
      std::vector<TuneCandidate> candidates;
      for (size_t i = 0; i < methods.size() && first + i < records.size(); ++i) {
        const json& rec = records[first + i];
        TuneCandidate c;
        c.method = methods[i].method;
        c.knobs = methods[i].knobs;
        c.sweep_ms = rec.value("median_ms", 0.0);
        c.final_ms = rec.value("tune_final_median_ms", 0.0);
        candidates.push_back(c);
      }
      if (const std::optional<TuneChoice> choice = ChooseTuned(candidates)) {
        OverlapConfig::Tuned t;
        t.op = sc.op;
        t.n = sc.n;
        t.k = sc.k;
        t.m = sc.m;
        t.scale_scheme = scheme;
        t.knobs = choice->knobs;
        t.median_ms = choice->best_ms;
        t.none_ms = choice->none_ms;
        tuned.AddTuned(t);
        spdlog::info("[{}/{}] {} m={} {}: best {} {:.4f} ms (none {:.4f} ms{})", done,
                     shapes.size() * f.dtypes.size(), sc.layer, sc.m, d, choice->knobs.ToString(),
                     choice->best_ms, choice->none_ms,
                     choice->from_finals ? ", finalists' round" : "");
      }
    }
  }
  if (!group->leader()) {
    // A worker process: rank 0 reports.
    const Status finished = group->Finish(std::chrono::seconds(10));
    return failures == 0 && finished.ok() ? 0 : 1;
  }
  if (!write_results(records)) ++failures;
  spdlog::info("wrote {} records to {} ({} failed cases)", records.size(), f.out, failures);
  if (!f.tune_out.empty()) {
    std::ofstream yaml(f.tune_out);
    yaml << "# Overlap config tuned by tpserve-bench --tune-out on "
         << out["meta"]["device"].get<std::string>() << ", " << date << ", commit " << f.commit
         << ".\n# Command: " << cmd.str()
         << "\n# tuned: the fastest measured knobs per layer shape (global n, k) and M; "
            "mode auto picks the\n# entry with the largest m <= M (else the smallest) and "
            "none for shapes not listed.\n"
         << (f.split_output ? kSplitOutputNote : "") << tuned.ToYaml();
    yaml.close();
    if (!yaml) {
      spdlog::error("--tune-out: cannot write {}", f.tune_out);
      ++failures;
    } else {
      spdlog::info("wrote the tuned overlap config ({} entries) to {}", tuned.tuned().size(),
                   f.tune_out);
    }
  }
  if (const Status finished = group->Finish(std::chrono::seconds(f.timeout_s)); !finished.ok()) {
    spdlog::error("{}", finished.ToString());
    ++failures;
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace tpserve
