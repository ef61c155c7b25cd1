// tpserve-bench-model: prefill throughput of the CUDA model (engine/cuda_model.h)
// on this host's GPUs (one process per GPU as in serving, or ranks as threads),
// with each overlap setting side by side
// on one set of random weights (generated on the GPUs).
//
// For every --batches entry (SEQSxLEN: SEQS sequences of LEN tokens) and
// every overlap setting (none, and each --overlap FILE), the model runs the
// batch once (planning the layers, capturing the bucket's CUDA graph), then
// --rounds more times, settings interleaved round by round; each round is
// timed on the host around ForwardView() on rank 0 (upload of the batch, graph
// replay, download of the logits into pinned memory: what a server pays per
// batch; the other ranks Run() without downloading, as served) after lining the
// ranks up with a barrier. Writes one JSON record per (batch, setting) with
// the schema of benchmarks/README.md's model section (impl "tpserve").
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/batch_shape.h"
#include "comm/rank_group.h"
#include "engine/cuda_model.h"
#include "engine/model_config.h"
#include "layers/overlap_config.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_graph_priority.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

using json = nlohmann::json;

struct Flags {
  std::string model = "llama3-70b";
  int layers = 0;  // blocks to build (0 = the model's own count: all of them)
  int tp = 2;
  std::string ranks = "processes";  // processes (one per GPU, as served) | threads
  std::string dtype = "fp8";
  std::vector<std::string> batches = {"8x1024", "16x1024"};
  std::vector<std::string> overlaps;  // overlap config files, besides mode none
  int warmup = 2;
  int rounds = 10;
  uint64_t seed = 7;
  std::string out = "model.json";
  std::string commit = "unknown";
  std::string gemm_algo = "timed";          // GemmAlgoSelection of every GEMM
  std::string graph_priority = "node";      // CudaGraphExec::Priority of every graph
  bool dynamic_input_scales = false;        // FP8 inputs scaled per batch (CudaModelOptions)
  std::string scale_scheme = "per_tensor";  // FP8 scale scheme (CudaModelOptions)
  bool residual_in_norm = false;            // CudaModelOptions::residual_in_gemm off
  bool fp8_attention = false;               // CudaModelOptions::fp8_attention
  float residual_gain = 1.0f;               // CudaModelOptions::residual_gain
  bool stages = false;                      // also where an eager pass spends its time
  double check_logits = -1;                 // >= 0: fail above this rel. difference from none
  int idle_ms = 0;                          // the GPUs idle this long before every timed pass
  bool eager = false;                       // time eager passes, no CUDA graphs
  int graph_blocks = 0;                     // > 0: one graph per this many blocks
};

TokenBatch MakeBatch(const BatchShape& b, int64_t vocab, uint64_t seed) {
  TokenBatch t;
  t.cu_seqlens.push_back(0);
  for (int64_t s = 0; s < b.seqs; ++s) {
    for (int64_t i = 0; i < b.len; ++i) {
      t.ids.push_back(static_cast<int32_t>((seed + 7919 * (s * b.len + i)) % vocab));
      t.positions.push_back(static_cast<int32_t>(i));
    }
    t.cu_seqlens.push_back(static_cast<int32_t>(t.ids.size()));
  }
  return t;
}

json Stats(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  auto q = [&](double p) {
    const double pos = p * static_cast<double>(n - 1);
    const size_t lo = static_cast<size_t>(pos);
    const size_t hi = std::min(lo + 1, n - 1);
    return t[lo] + (t[hi] - t[lo]) * (pos - static_cast<double>(lo));
  };
  double mean = 0;
  for (double v : t) mean += v;
  mean /= static_cast<double>(n);
  return json{{"median_ms", q(0.5)}, {"min_ms", t.front()},         {"max_ms", t.back()},
              {"mean_ms", mean},     {"iqr_ms", q(0.75) - q(0.25)}, {"rounds", n}};
}

// A setting's last-position logits ([seqs, vocab], rank 0's) against mode none's.
struct VsNone {
  double rel_frobenius = 0;  // ||got - none|| / ||none||
  int64_t top1_agree = 0;    // sequences whose arg max is the same
  int64_t seqs = 0;
};

VsNone CompareLogits(std::span<const float> got, const std::vector<float>& none, int64_t vocab) {
  VsNone v;
  if (vocab <= 0 || got.size() != none.size()) return v;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (static_cast<double>(got[i]) - none[i]) * (static_cast<double>(got[i]) - none[i]);
    den += static_cast<double>(none[i]) * none[i];
  }
  v.rel_frobenius = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0);
  v.seqs = static_cast<int64_t>(got.size()) / vocab;
  for (int64_t q = 0; q < v.seqs; ++q) {
    const float* g = got.data() + q * vocab;
    const float* n = none.data() + q * vocab;
    v.top1_agree += std::max_element(g, g + vocab) - g == std::max_element(n, n + vocab) - n;
  }
  return v;
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "tpserve-bench-model: prefill tokens/s of the CUDA model (random weights generated on the "
      "GPUs) with mode none and each --overlap config, side by side; writes JSON records"};
  app.add_option("--model", f.model, "Preset: tiny, llama3-8b, llama3-70b")
      ->check(CLI::IsMember({"tiny", "llama3-8b", "llama3-70b"}))
      ->capture_default_str();
  app.add_option("--layers", f.layers,
                 "Transformer blocks to build (0 = all of the preset's; at most the preset's "
                 "count); fewer than the full model when the weights would not fit")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--ranks", f.ranks,
                 "How ranks run: processes (one per GPU, as tpserve serves; this process is "
                 "rank 0 and starts the others with the same arguments) or threads")
      ->check(CLI::IsMember({"processes", "threads"}))
      ->capture_default_str();
  app.add_option("--tp", f.tp, "Tensor-parallel size (GPUs)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--dtype", f.dtype, "Weights and activations of the TP layers: fp8 or bf16")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  app.add_option("--batches", f.batches,
                 "Batch shapes SEQSxLEN (sequences x tokens each; LEN at most the model's "
                 "max_position_embeddings, SEQS x LEN at most 2147483647)")
      ->capture_default_str();
  app.add_option("--overlap", f.overlaps,
                 "Overlap config files (YAML) to time besides mode none (e.g. "
                 "deploy/overlap-llama3-70b-tp2.yaml)")
      ->check(CLI::ExistingFile);
  app.add_option("--warmup", f.warmup, "Untimed rounds after the capture")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--rounds", f.rounds, "Timed rounds per (batch, setting)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--seed", f.seed, "Seed of the random weights and token ids")
      ->capture_default_str();
  AddGemmAlgoFlag(&app, &f.gemm_algo);
  AddGraphPriorityFlag(&app, &f.graph_priority);
  app.add_flag("--dynamic-input-scales", f.dynamic_input_scales,
               "Scale every FP8 layer's input per batch from its amax, as for a checkpoint "
               "without input scales (default: the static scales of the random weights)");
  app.add_option("--scale-scheme", f.scale_scheme,
                 "FP8 scale scheme of every TP layer: per_tensor; "
                 "per_token_channel (a scale per weight row, the input quantized per token for "
                 "every batch); blockwise (128x128 weight blocks, 1x128 input groups)")
      ->check(CLI::IsMember({"per_tensor", "per_token_channel", "blockwise"}))
      ->capture_default_str();
  app.add_flag("--stages", f.stages,
               "After the timed rounds, one eager pass per (batch, setting) timed stage by stage "
               "with CUDA events on rank 0 (embedding, norm, qkv, rope, attention, o, gate_up, "
               "swiglu, down, head; each summed over the blocks): printed, and in each record "
               "as stages_ms, and each block's time in order as block_ms (the first and last "
               "tenth of the blocks printed). Eager, so launch gaps count; not the graph the "
               "rounds replay");
  app.add_option("--check-logits", f.check_logits,
                 "Fail (exit 1, after writing the results) when an overlap setting's logits "
                 "differ from mode none's on the same batch by more than this relative "
                 "Frobenius norm, or pick another top-1 token for any sequence; checked on the "
                 "eager first run and on the last round's graph replay (negative: report only)")
      ->capture_default_str();
  app.add_option("--residual-gain", f.residual_gain,
                 "Scale the random o and down weights (the layers that write the residual "
                 "stream) by this gain. At 1 (Llama's init) an 80-block random model is "
                 "chaotic: two correct schedules round differently and end with unrelated "
                 "logits, so --check-logits cannot tell a wrong one; a small gain (e.g. 0.02) "
                 "keeps each block a small step, rounding differences small, and a wrong sum "
                 "still visible (recorded in the meta)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--idle-ms", f.idle_ms,
                 "Leave the GPUs idle this many milliseconds before every pass (not timed): "
                 "a duty cycle below 100 % keeps their average power under the limit, as a "
                 "server that is not saturated does (recorded in the meta)")
      ->check(CLI::Range(0, 60000))
      ->capture_default_str();
  app.add_flag("--residual-in-norm", f.residual_in_norm,
               "At tp 1, o and down write a buffer of their own and the add & norm after each "
               "adds it to the residual stream (CudaModelOptions::residual_in_gemm off, as at "
               "tp > 1), instead of adding into the residual stream in the GEMM's epilogue "
               "(recorded in the meta)");
  app.add_flag("--fp8-attention", f.fp8_attention,
               "Prefill attention in E4M3 (CudaModelOptions::fp8_attention: Q, K, V and the "
               "probabilities as E4M3, scale 1; Hopper, head_dim 128; recorded in the meta)");
  app.add_flag("--eager", f.eager,
               "Run every pass eagerly (CudaModelOptions::cuda_graphs off) instead of replaying "
               "the bucket's CUDA graph: what the graph saves, or costs, per setting (recorded "
               "in the meta)");
  app.add_option("--graph-blocks", f.graph_blocks,
                 "Capture each bucket's pass as one CUDA graph per this many blocks, launched "
                 "one after another (0: one graph for the whole pass, as served; recorded in "
                 "the meta)")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--out", f.out, "JSON output")->capture_default_str();
  app.add_option("--commit", f.commit, "Commit id recorded in the JSON meta")
      ->capture_default_str();
  StrictNumbers(app);
  CLI11_PARSE(app, argc, argv);

  auto preset = ModelPreset(f.model);
  if (!preset.ok()) {
    spdlog::error("{}", preset.status().ToString());
    return 2;
  }
  ModelConfig config = *preset;
  if (f.layers > config.num_hidden_layers) {
    spdlog::error("--layers {}: {} has {} layers", f.layers, f.model, config.num_hidden_layers);
    return 2;
  }
  if (f.layers > 0) config.num_hidden_layers = f.layers;
  if (f.fp8_attention && config.head_dim() != 128) {
    spdlog::error("--fp8-attention: {}'s head_dim is {}; the E4M3 attention takes 128", f.model,
                  config.head_dim());
    return 2;
  }
  std::vector<BatchShape> shapes;
  int64_t max_tokens = 0, max_seqs = 0;
  for (const std::string& b : f.batches) {
    auto s = ParseBatch(b);
    if (!s.ok()) {
      spdlog::error("{}", s.status().ToString());
      return 2;
    }
    // Token offsets and positions are int32; a sequence is at most the model's positions.
    if (s->len > config.max_position_embeddings || s->seqs > INT32_MAX / s->len) {
      spdlog::error(
          "--batches: '{}': LEN must be at most {} ({}'s max_position_embeddings) and "
          "SEQS x LEN at most {}",
          b, config.max_position_embeddings, f.model, INT32_MAX);
      return 2;
    }
    shapes.push_back(*s);
    max_tokens = std::max(max_tokens, s->seqs * s->len);
    max_seqs = std::max(max_seqs, s->seqs);
  }
  // Settings: mode none, then each config file.
  std::vector<std::string> names = {"none"};
  std::vector<std::unique_ptr<OverlapConfig>> configs;
  configs.push_back(nullptr);
  for (const std::string& path : f.overlaps) {
    auto cfg = OverlapConfig::LoadFile(path);
    if (!cfg.ok()) {
      spdlog::error("{}", cfg.status().ToString());
      return 2;
    }
    configs.push_back(std::make_unique<OverlapConfig>(std::move(cfg).value()));
    names.push_back(path);
  }

  auto made = CreateRankGroup(f.ranks, std::vector<std::string>(argv, argv + argc), f.tp,
                              std::chrono::seconds(120));
  if (!made.ok()) {
    spdlog::error("{}", made.status().ToString());
    return 1;
  }
  const std::unique_ptr<RankGroup> group = std::move(made).value();
  const DataType dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  CudaModelOptions options;
  options.max_tokens = max_tokens;
  options.gemm_algo = GemmAlgoFromFlag(f.gemm_algo);
  options.graph_priority = GraphPriorityFromFlag(f.graph_priority);
  options.max_seqs = max_seqs;
  for (const BatchShape& b : shapes) options.buckets.push_back(b.seqs * b.len);
  options.dynamic_input_scales = f.dynamic_input_scales;
  options.scale_scheme = ParseGemmScaleScheme(f.scale_scheme).value();  // CLI checked it
  options.cuda_graphs = !f.eager;
  options.time_passes = true;
  options.graph_blocks = f.graph_blocks;
  options.residual_in_gemm = !f.residual_in_norm;
  options.fp8_attention = f.fp8_attention;
  options.residual_gain = f.residual_gain;

  // gpu_times[batch][setting]: rank 0's CudaModel::last_pass_ms of each round
  std::vector<std::vector<std::vector<double>>> gpu_times(
      shapes.size(), std::vector<std::vector<double>>(configs.size()));
  // copy_times[batch][setting]: rank 0's CudaModel::last_copy_ms of each round
  auto copy_times = gpu_times;
  // times[batch][setting]; stages[batch][setting]: rank 0's stage times (--stages)
  std::vector<std::vector<std::vector<double>>> times(
      shapes.size(), std::vector<std::vector<double>>(configs.size()));
  std::vector<std::vector<std::vector<std::pair<std::string, double>>>> stages(
      shapes.size(), std::vector<std::vector<std::pair<std::string, double>>>(configs.size()));
  // blocks[batch][setting]: rank 0's per-block times of the same eager pass (--stages)
  std::vector<std::vector<std::vector<double>>> blocks(
      shapes.size(), std::vector<std::vector<double>>(configs.size()));
  // vs_none[batch][setting] and vs_none_replay: rank 0's comparison of the setting's logits
  // with mode none's on the same batch and weights, on its first run (eager, capturing the
  // graph) and on the last round (a graph replay, as served).
  std::vector<std::vector<VsNone>> vs_none(shapes.size(), std::vector<VsNone>(configs.size()));
  std::vector<std::vector<VsNone>> vs_none_replay = vs_none;
  Status s = group->Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(auto model, CudaModel::CreateRandom(config, dtype, f.seed, nullptr,
                                                            group->pool(r), options));
    NcclCommunicator& comm = group->pool(r).base();
    for (size_t b = 0; b < shapes.size(); ++b) {
      const TokenBatch batch = MakeBatch(shapes[b], config.vocab_size, f.seed);
      std::vector<float> none_logits;  // rank 0: mode none's, from its first run / last round
      for (int round = -1 - f.warmup; round < f.rounds; ++round) {
        for (size_t c = 0; c < configs.size(); ++c) {
          // Each setting's first run of this batch captures its graph.
          model->SetOverlap(configs[c].get());
          if (round == -1 - f.warmup && r == 0) {
            spdlog::info("{} tokens ({}x{}): setting {}", shapes[b].seqs * shapes[b].len,
                         shapes[b].seqs, shapes[b].len, names[c]);
          }
          if (f.idle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(f.idle_ms));
          TP_RETURN_IF_ERROR(comm.Barrier());
          const auto t0 = std::chrono::steady_clock::now();
          std::span<const float> logits;
          if (r == 0) {
            TP_ASSIGN_OR_RETURN(logits, model->ForwardView(batch));
          } else {
            TP_RETURN_IF_ERROR(model->Run(batch));
          }
          const double ms =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count();
          if (round >= 0 && r == 0) {
            times[b][c].push_back(ms);
            gpu_times[b][c].push_back(model->last_pass_ms());
            copy_times[b][c].push_back(model->last_copy_ms());
          }
          const bool first = round == -1 - f.warmup, last = round == f.rounds - 1;
          if ((first || last) && r == 0) {
            if (c == 0) {
              none_logits.assign(logits.begin(), logits.end());
            } else {
              (first ? vs_none : vs_none_replay)[b][c] =
                  CompareLogits(logits, none_logits, config.vocab_size);
            }
          }
        }
      }
      for (size_t c = 0; f.stages && c < configs.size(); ++c) {
        model->SetOverlap(configs[c].get());
        TP_RETURN_IF_ERROR(comm.Barrier());
        // The second of two passes: the first may still set up connections.
        std::vector<std::pair<std::string, double>> got;
        std::vector<double> per_block;
        for (int pass = 0; pass < 2; ++pass) {
          TP_ASSIGN_OR_RETURN(got, model->ProfileStages(batch, &per_block));
        }
        if (r == 0) {
          stages[b][c] = std::move(got);
          blocks[b][c] = std::move(per_block);
        }
      }
    }
    return model->Close();
  });
  if (!s.ok()) {
    spdlog::error("{}", s.ToString());
    return 1;
  }
  if (const Status finished = group->Finish(std::chrono::seconds(60)); !finished.ok()) {
    spdlog::error("{}", finished.ToString());
    return 1;
  }
  if (!group->leader()) return 0;  // a worker process: rank 0 reports
  bool logits_failed = false;      // --check-logits
  json out{{"meta",
            {{"commit", f.commit},
             {"model", f.model},
             {"layers", config.num_hidden_layers},
             {"tp", f.tp},
             {"dtype", f.dtype},
             {"gemm_algo", f.gemm_algo},
             {"graph_priority", f.graph_priority},
             {"input_scales", f.dynamic_input_scales ? "dynamic" : "static"},
             {"scale_scheme", f.scale_scheme},
             {"idle_ms", f.idle_ms},
             {"cuda_graphs", !f.eager},
             {"graph_blocks", f.graph_blocks},
             {"residual_gain", f.residual_gain},
             {"attention", f.fp8_attention ? "e4m3" : "bf16"},
             {"residual", f.residual_in_norm || f.tp > 1 ? "in_norm" : "in_gemm"}}},
           {"records", json::array()}};
  for (size_t b = 0; b < shapes.size(); ++b) {
    for (size_t c = 0; c < configs.size(); ++c) {
      const int64_t tokens = shapes[b].seqs * shapes[b].len;
      json rec{{"impl", "tpserve"},
               {"method", c == 0 ? "none" : "overlap_config"},
               {"overlap_config", names[c]},
               {"model", f.model},
               {"layers", config.num_hidden_layers},
               {"tp", f.tp},
               {"dtype", f.dtype},
               {"seqs", shapes[b].seqs},
               {"seq_len", shapes[b].len},
               {"tokens", tokens}};
      rec.update(Stats(times[b][c]));
      // Every round in order, to the microsecond.
      auto rounds = [](const std::vector<double>& ms) {
        json a = json::array();
        for (double t : ms) a.push_back(std::round(t * 1e3) / 1e3);
        return a;
      };
      // The settings ran interleaved, so round i of two settings is a pair measured under
      // the same conditions.
      rec["times_ms"] = rounds(times[b][c]);
      // The same rounds on the GPU alone (graph launch to its end on the model's stream):
      // what the host-timed rounds spend beyond it is upload, download and host time.
      rec["gpu_times_ms"] = rounds(gpu_times[b][c]);
      rec["gpu_median_ms"] = Stats(gpu_times[b][c])["median_ms"];
      // The copies behind the pass on the GPU (error flag, logits to pinned host memory).
      rec["copy_median_ms"] = Stats(copy_times[b][c])["median_ms"];
      for (int replay = 0; c > 0 && replay < 2; ++replay) {
        const VsNone& v = (replay ? vs_none_replay : vs_none)[b][c];
        rec[replay ? "logits_vs_none_replay" : "logits_vs_none"] = {
            {"rel_frobenius", v.rel_frobenius}, {"top1_agree", v.top1_agree}, {"seqs", v.seqs}};
        spdlog::info(
            "{:>6} tokens ({}x{}) {:40} logits vs none ({}): rel_frobenius {:.3g}, top-1 "
            "agrees on {} of {} sequences",
            tokens, shapes[b].seqs, shapes[b].len, names[c], replay ? "graph replay" : "eager",
            v.rel_frobenius, v.top1_agree, v.seqs);
        if (f.check_logits >= 0 &&
            (!(v.rel_frobenius <= f.check_logits) || v.top1_agree != v.seqs || v.seqs == 0)) {
          spdlog::error(
              "{} tokens: {}'s logits ({}) differ from mode none's beyond "
              "--check-logits {}",
              tokens, names[c], replay ? "graph replay" : "eager", f.check_logits);
          logits_failed = true;
        }
      }
      rec["tokens_per_sec"] = tokens / (rec["median_ms"].get<double>() / 1000.0);
      spdlog::info(
          "{:>6} tokens ({}x{}) {:40} median {:.3f} ms  {:.0f} tokens/s (GPU pass {:.3f} ms, "
          "download {:.3f} ms)",
          tokens, shapes[b].seqs, shapes[b].len, names[c], rec["median_ms"].get<double>(),
          rec["tokens_per_sec"].get<double>(), rec["gpu_median_ms"].get<double>(),
          rec["copy_median_ms"].get<double>());
      if (f.stages) {
        json st = json::object();
        std::string line;
        double total = 0;
        for (const auto& [name, ms] : stages[b][c]) {
          st[name] = ms;
          total += ms;
          line += fmt::format(" {} {:.1f}", name, ms);
        }
        rec["stages_ms"] = st;
        spdlog::info("{:>6} tokens ({}x{}) {:40} eager stages, ms per pass (total {:.1f}):{}",
                     tokens, shapes[b].seqs, shapes[b].len, names[c], total, line);
        // Blocks along the pass: do they slow down as it goes on?
        const std::vector<double>& bl = blocks[b][c];
        rec["block_ms"] = bl;
        const size_t tenth = std::max<size_t>(1, bl.size() / 10);
        if (bl.size() >= 2 * tenth) {
          double first = 0, last = 0;
          for (size_t i = 0; i < tenth; ++i) {
            first += bl[i];
            last += bl[bl.size() - 1 - i];
          }
          spdlog::info(
              "{:>6} tokens ({}x{}) {:40} eager blocks: first {} {:.3f} ms each, last {} "
              "{:.3f} ms each",
              tokens, shapes[b].seqs, shapes[b].len, names[c], tenth, first / tenth, tenth,
              last / tenth);
        }
      }
      out["records"].push_back(rec);
    }
  }
  std::ofstream file(f.out);
  file << out.dump(1) << "\n";
  if (!file) {
    spdlog::error("cannot write {}", f.out);
    return 1;
  }
  spdlog::info("wrote {} records to {}", out["records"].size(), f.out);
  return logits_failed ? 1 : 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
