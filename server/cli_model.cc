// `tpserve run` (one forward pass of a model), `tpserve make-checkpoint` and
// `tpserve calibrate-kv-scales`.
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cpu_model.h"
#include "engine/kv_calibration.h"
#include "engine/safetensors.h"
#if TPSERVE_WITH_CUDA
#include "comm/nccl_thread_group.h"
#include "engine/cuda_model.h"
#endif
#include "server/cli.h"
#include "server/cli_cuda_only.h"
#include "server/cli_gemm_algo.h"

namespace tpserve {
namespace {

struct ModelFlags {
  std::string model = "tiny";
  int tp = 2;
  std::string backend = "cpu";
  std::string ids = "1,2,3";
  std::string overlap_config;
  std::string dtype = "fp8";
  uint64_t seed = 7;
  bool seed_given = false;  // run: --seed on the command line (refused with a checkpoint)
  bool json = false;
  std::string out;
  bool force = false;  // make-checkpoint: replace a checkpoint in `out`
  // make-checkpoint: scale layout of the FP8 weights (tensor, channel, block)
  std::string fp8_scheme = "tensor";
  std::string gemm_algo = "timed";
  // calibrate-kv-scales
  std::string prompts;
  int64_t num_prompts = 8;
  int64_t prompt_len = 256;
};

StatusOr<std::vector<int32_t>> ParseIds(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      if (used != item.size() || v < INT32_MIN || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      return InvalidArgumentError("--ids: '" + item + "' is not a token id");
    }
  }
  if (ids.empty()) return InvalidArgumentError("--ids: no token ids given");
  // getline drops an empty last field: "1,2," is as malformed as "1,,2".
  if (text.back() == ',')
    return InvalidArgumentError("--ids: '' is not a token id (after the last comma)");
  return ids;
}

int Fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? 2 : 1;
}

// `given_cuda_only`: the cuda-only flags (CudaOnly) on the command line.
int RunModel(const ModelFlags& f, const std::vector<std::string>& given_cuda_only) {
  // Refused before anything else, the model included.
  if (const std::string e = CudaOnlyFlagsError(f.backend, given_cuda_only, /*offers_auto=*/false);
      !e.empty()) {
    return Fail(InvalidArgumentError(e));
  }
  bool from_dir = false;
  auto config = ResolveModel(f.model, &from_dir);
  if (!config.ok()) return Fail(config.status());
  if (from_dir && f.seed_given) {
    return Fail(InvalidArgumentError("--seed: --model " + f.model +
                                     " is a checkpoint, whose weights are used; --seed seeds a "
                                     "preset's random weights"));
  }
  auto ids = ParseIds(f.ids);
  if (!ids.ok()) return Fail(ids.status());
  auto batch = PackSequences({*ids}, config->vocab_size, config->max_position_embeddings);
  if (!batch.ok()) return Fail(batch.status().WithContext("--ids"));
  std::unique_ptr<OverlapConfig> overlap;
  if (!f.overlap_config.empty()) {
    auto cfg = OverlapConfig::LoadFile(f.overlap_config);
    if (!cfg.ok()) return Fail(cfg.status());
    overlap = std::make_unique<OverlapConfig>(std::move(cfg).value());
  }
  const DataType dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  spdlog::info("{}: {} layers, hidden {}, tp {}, {} weights, {} tokens", config->name,
               config->num_hidden_layers, config->hidden_size, f.tp,
               from_dir ? "checkpoint" : "random", ids->size());
  StatusOr<std::vector<float>> logits = UnimplementedError("unreachable");
  if (f.backend == "cuda") {
#if TPSERVE_WITH_CUDA
    // Ranks as threads of this process, one GPU each; a checkpoint's shards are loaded as
    // `tpserve serve` loads them.
    auto group = NcclThreadGroup::Create(f.tp);
    if (!group.ok()) return Fail(group.status());
    logits = RunCudaModel(*config, **group, dtype, f.seed, overlap.get(), *batch,
                          from_dir ? f.model : "", GemmAlgoFromFlag(f.gemm_algo));
#else
    return Fail(InvalidArgumentError("--backend cuda: this build has no CUDA"));
#endif
  } else {
    logits =
        RunCpuModel(*config, f.tp, dtype, f.seed, from_dir ? f.model : "", overlap.get(), *batch);
  }
  if (!logits.ok()) return Fail(logits.status());
  std::vector<int32_t> order(logits->size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::partial_sort(order.begin(), order.begin() + std::min<size_t>(10, order.size()), order.end(),
                    [&](int32_t a, int32_t b) {
                      return (*logits)[a] > (*logits)[b] || ((*logits)[a] == (*logits)[b] && a < b);
                    });
  order.resize(std::min<size_t>(10, order.size()));
  if (f.json) {
    nlohmann::json j;
    j["next_token_id"] = order.front();
    j["top_logits"] = nlohmann::json::array();
    for (int32_t id : order) j["top_logits"].push_back({id, (*logits)[id]});
    j["logits"] = *logits;
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("next token id: %d\ntop logits:\n", order.front());
    for (int32_t id : order) std::printf("  %8d  %.5f\n", id, (*logits)[id]);
  }
  return 0;
}

// make-checkpoint's file being written, for the signal handler to remove: an interrupted
// run of a large model would otherwise leave gigabytes behind in model.safetensors.tmp.
char g_partial_file[4096] = {0};

void RemovePartialAndExit(int sig) {
  if (g_partial_file[0] != 0) ::unlink(g_partial_file);  // async-signal-safe
  ::_exit(128 + sig);
}

int MakeCheckpoint(const ModelFlags& f) {
  bool from_dir = false;
  auto config = ResolveModel(f.model, &from_dir);
  if (!config.ok()) return Fail(config.status());
  const DataType dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  if (dtype == DataType::kBFloat16 && f.fp8_scheme != "tensor") {
    return Fail(InvalidArgumentError("--fp8-scheme " + f.fp8_scheme +
                                     " needs --dtype fp8 (a bf16 checkpoint has no scales)"));
  }
  // A directory that already holds a checkpoint is not written over unless asked: its
  // config.json would be replaced, and a shard of its own next to the new model.safetensors
  // would make the directory unloadable (a tensor in two files).
  {
    namespace fs = std::filesystem;
    std::error_code ec;
    std::vector<fs::path> found;
    if (fs::is_directory(f.out, ec)) {
      for (const auto& e : fs::directory_iterator(f.out, ec)) {
        const fs::path& p = e.path();
        if (p.filename() == "config.json" || p.extension() == ".safetensors") found.push_back(p);
      }
    }
    std::sort(found.begin(), found.end());
    if (!found.empty() && !f.force) {
      std::string names;
      for (size_t i = 0; i < found.size() && i < 4; ++i) {
        names += (i ? ", " : "") + found[i].filename().string();
      }
      if (found.size() > 4) names += ", ...";
      return Fail(InvalidArgumentError("--out " + f.out + " already holds a checkpoint (" + names +
                                       "); give --force to replace it"));
    }
    for (const fs::path& p : found) {  // --force: the old files go, not only those rewritten
      if (p.extension() == ".safetensors" && !fs::remove(p, ec)) {
        return Fail(UnavailableError("cannot remove " + p.string() + ": " + ec.message()));
      }
    }
  }
  spdlog::info("writing a random {} checkpoint of {} ({} layers) to {}", f.dtype, config->name,
               config->num_hidden_layers, f.out);
  const std::string partial = (std::filesystem::path(f.out) / "model.safetensors.tmp").string();
  if (partial.size() < sizeof g_partial_file) {
    std::memcpy(g_partial_file, partial.c_str(), partial.size() + 1);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, RemovePartialAndExit);
  }
  const Fp8Scheme scheme = ParseFp8Scheme(f.fp8_scheme).value_or(Fp8Scheme::kPerTensor);
  const Status s = WriteRandomCheckpoint(*config, dtype, f.seed, f.out, scheme);
  if (!s.ok()) return Fail(s);
  std::printf("wrote %s/config.json and %s/model.safetensors\n", f.out.c_str(), f.out.c_str());
  return 0;
}

// The metadata calibrate-kv-scales writes, by which it knows a file it may replace.
constexpr const char* kKvScalesMetadataKey = "tpserve";
constexpr const char* kKvScalesMetadataValue = "calibrate-kv-scales";

// A KV cache scale tensor (any spelling the loader reads) of the checkpoint in `dir` outside
// the file `except`, as "FILE: tensor NAME"; empty when there is none.
std::string FindKvScaleTensor(const std::string& dir, const std::string& except) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".safetensors" || fs::equivalent(e.path(), except, ec)) continue;
    auto file = SafetensorsFile::Open(e.path().string());
    if (!file.ok()) continue;  // the load reports it
    for (const TensorView& v : file->tensors()) {
      for (const char* tail : {".k_scale", ".v_scale", ".kv_scale"}) {
        if (v.name.ends_with(tail)) return e.path().string() + ": tensor " + v.name;
      }
    }
  }
  return "";
}

int CalibrateKvScales(const ModelFlags& f) {
  namespace fs = std::filesystem;
  bool from_dir = false;
  auto config = ResolveModel(f.model, &from_dir);
  if (!config.ok()) return Fail(config.status());
  if (!from_dir) {
    return Fail(InvalidArgumentError("--model " + f.model +
                                     ": a preset's weights are random; calibrate a checkpoint "
                                     "directory's"));
  }
  if (fs::path(f.out).extension() != ".safetensors") {
    return Fail(InvalidArgumentError("--out " + f.out + ": name a .safetensors file"));
  }
  std::error_code ec;
  if (fs::exists(f.out, ec)) {
    auto old = SafetensorsFile::Open(f.out);
    const bool ours = old.ok() && old->metadata().count(kKvScalesMetadataKey) > 0 &&
                      old->metadata().at(kKvScalesMetadataKey) == kKvScalesMetadataValue;
    if (!ours) {
      return Fail(InvalidArgumentError("--out " + f.out +
                                       " exists and was not written by calibrate-kv-scales; "
                                       "name another file"));
    }
  }
  const bool into_model = fs::equivalent(fs::absolute(f.out, ec).parent_path(), f.model, ec);
  if (into_model) {
    // Scales already there (but in the file being replaced) would meet the new ones in one
    // directory, which the loader refuses.
    if (const std::string found = FindKvScaleTensor(f.model, f.out); !found.empty()) {
      return Fail(InvalidArgumentError(
          "--model " + f.model + " already holds KV cache scales (" + found +
          "); remove them to calibrate again, or write --out outside the model directory"));
    }
  }
  Prompts prompts;
  std::string source;
  if (!f.prompts.empty()) {
    auto read = ReadPrompts(f.prompts, config->vocab_size, config->max_position_embeddings);
    if (!read.ok()) return Fail(read.status());
    prompts = *std::move(read);
    source = f.prompts;
  } else {
    if (f.prompt_len > config->max_position_embeddings) {
      return Fail(InvalidArgumentError("--prompt-len " + std::to_string(f.prompt_len) +
                                       " exceeds the model's " + "max_position_embeddings (" +
                                       std::to_string(config->max_position_embeddings) + ")"));
    }
    prompts = DefaultPrompts(f.num_prompts, f.prompt_len, config->vocab_size, f.seed);
    source = std::to_string(f.num_prompts) + " random prompts of " + std::to_string(f.prompt_len) +
             " tokens (seed " + std::to_string(f.seed) + ")";
    spdlog::warn(
        "calibrate-kv-scales: random token ids stand in for text; --prompts with tokenized "
        "text like the traffic to serve gives scales that fit it");
  }
  const DataType dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  spdlog::info("calibrate-kv-scales: {} ({} layers) as {} on {} CPU rank(s), {}", f.model,
               config->num_hidden_layers, f.dtype, f.tp, source);
  const auto start = std::chrono::steady_clock::now();
  auto most = CalibrateKvAbsMax(*config, f.model, dtype, f.tp, prompts, [&](size_t done) {
    spdlog::info("calibrate-kv-scales: prompt {}/{} ({:.1f} s)", done, prompts.size(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  });
  if (!most.ok()) return Fail(most.status());
  std::vector<KvScales> scales;
  std::printf("layer  max |K|       max |V|       k_scale       v_scale\n");
  for (size_t l = 0; l < most->size(); ++l) {
    scales.push_back(KvScalesForAbsMax((*most)[l]));
    std::printf("%5zu  %-12.6g  %-12.6g  %-12.6g  %-12.6g\n", l, (*most)[l].k, (*most)[l].v,
                scales.back().k, scales.back().v);
  }
  const Status written =
      WriteKvScales(f.out, scales,
                    {{kKvScalesMetadataKey, kKvScalesMetadataValue},
                     {"prompts", source},
                     {"weights", f.dtype},
                     {"rule", "each layer's largest |K| (RoPE applied) and |V| / 448"}});
  if (!written.ok()) return Fail(written);
  std::printf("wrote %s: %zu layers' k_scale and v_scale%s\n", f.out.c_str(), scales.size(),
              into_model ? "; the model directory's loads read it (--kv-cache-dtype fp8, "
                           "--fp8-attention)"
                         : "; put it into the model directory for the loader to read it");
  return 0;
}

void AddModelFlag(CLI::App* cmd, ModelFlags* f) {
  cmd->add_option("--model", f->model,
                  "A preset (tiny, llama3-8b, llama3-70b: random weights) or a directory with a "
                  "HuggingFace config.json and *.safetensors")
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the random weights")->capture_default_str();
  cmd->add_option("--dtype", f->dtype, "Weights of the TP layers: fp8 (E4M3) or bf16")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
}

}  // namespace

StatusOr<ModelConfig> ResolveModel(const std::string& model, bool* from_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  *from_dir = fs::is_directory(model, ec);
  if (*from_dir) return LoadModelConfig(model);
  if (model.find('/') != std::string::npos || fs::exists(model, ec)) {
    // A path, not a preset name: say what is wrong with it.
    return NotFoundError("--model " + model + ": " +
                         (fs::exists(model, ec)
                              ? "not a directory (give the directory holding config.json and "
                                "*.safetensors)"
                              : "no such directory"));
  }
  return ModelPreset(model);
}

std::string DefaultModelName(const std::string& model, bool from_dir) {
  if (!from_dir) return model;
  namespace fs = std::filesystem;
  // The last component, a trailing separator dropped ("ckpt/" -> "ckpt").
  auto last = [](fs::path p) {
    p = p.lexically_normal();
    if (!p.has_filename()) p = p.parent_path();
    return p.filename().string();
  };
  std::string name = last(model);
  if (name.empty() || name == "." || name == "..") {
    std::error_code ec;
    name = last(fs::absolute(model, ec));
  }
  return name.empty() || name == "." || name == ".." ? "model" : name;
}

void AddModelCommands(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<ModelFlags>();
  // The flags only the cuda backend reads (CudaOnly), for the callback.
  auto cuda_only = std::make_shared<std::vector<const CLI::Option*>>();
  CLI::App* run = app.add_subcommand(
      "run",
      "One forward pass of a model over one prompt: prints the next-token id and the top "
      "logits of the last position");
  AddModelFlag(run, f.get());
  run->add_option("--tp", f->tp, "Tensor-parallel size (ranks)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  run->add_option("--backend", f->backend,
                  "cpu (ranks are threads on the CPU reference) or cuda (ranks are threads, "
                  "one GPU each); both run a preset's random weights or a checkpoint "
                  "directory's")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  run->add_option("--ids", f->ids, "Prompt token ids, comma-separated")->capture_default_str();
  run->add_option("--overlap-config", f->overlap_config,
                  "Overlap config (YAML) choosing each TP layer's mode by name and M");
  AddGemmAlgoFlag(run, &f->gemm_algo);
  CudaOnly(run->get_option("--gemm-algo"), cuda_only.get());
  run->add_flag("--json", f->json,
                "Print one JSON object: next_token_id, top_logits ([[id, value], ...], 10), "
                "logits (the whole last-position vector)");
  run->callback([f, exit_code, cuda_only, run] {
    f->seed_given = run->get_option("--seed")->count() > 0;
    *exit_code = RunModel(*f, GivenFlags(*cuda_only));
  });

  auto g = std::make_shared<ModelFlags>();
  CLI::App* mk = app.add_subcommand(
      "make-checkpoint",
      "Write a random checkpoint (config.json + model.safetensors, ModelOpt FP8 layout: weight, "
      "weight_scale, input_scale) of a model config. Streamed one block at a time: memory stays "
      "near one block (or the embedding table, if larger) whatever the model's size");
  AddModelFlag(mk, g.get());
  mk->add_option("--out", g->out, "Directory to write (created if missing)")->required();
  mk->add_flag("--force", g->force,
               "Replace a checkpoint already in --out (its config.json and every *.safetensors "
               "file); without it such a directory is refused");
  mk->add_option("--fp8-scheme", g->fp8_scheme,
                 "Scale layout of the FP8 weights: tensor (ModelOpt: weight_scale [] and a static "
                 "input_scale), channel (weight_scale [N,1], compressed-tensors "
                 "quantization_config with dynamic per-token activations) or block "
                 "(weight_scale_inv [ceil(N/128),ceil(K/128)], weight_block_size [128,128])")
      ->check(CLI::IsMember({"tensor", "channel", "block"}))
      ->capture_default_str();
  mk->callback([g, exit_code] { *exit_code = MakeCheckpoint(*g); });

  auto k = std::make_shared<ModelFlags>();
  k->tp = 1;
  CLI::App* cal = app.add_subcommand(
      "calibrate-kv-scales",
      "Measure each layer's largest |K| (RoPE applied) and |V| over prompts on the CPU "
      "reference and write the FP8 KV cache scales they give (max / 448) as a safetensors file "
      "of model.layers.N.self_attn.k_scale / v_scale: in the model directory, the fp8 KV cache "
      "and --fp8-attention quantize K and V with them instead of scale 1");
  cal->add_option("--model", k->model, "Checkpoint directory (config.json and *.safetensors)")
      ->required();
  cal->add_option("--out", k->out,
                  "The .safetensors file to write, e.g. MODEL/kv_scales.safetensors (replaces "
                  "only a file this command wrote)")
      ->required();
  cal->add_option("--prompts", k->prompts,
                  "JSON file of tokenized prompts: a list of token-id lists, or an object whose "
                  "\"prompts\" is one; without it, random token ids (a poor stand-in for text)");
  cal->add_option("--num-prompts", k->num_prompts, "Without --prompts: how many random prompts")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cal->add_option("--prompt-len", k->prompt_len, "Without --prompts: tokens a random prompt")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cal->add_option("--seed", k->seed, "Without --prompts: seed of the random prompts")
      ->capture_default_str();
  cal->add_option("--dtype", k->dtype,
                  "How the TP layers' weights load, as serve's --dtype: fp8 (E4M3; a BF16 "
                  "checkpoint is quantized on load) or bf16")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  cal->add_option("--tp", k->tp, "CPU ranks (threads) the model is sharded over")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cal->callback([k, exit_code] { *exit_code = CalibrateKvScales(*k); });
}

}  // namespace tpserve
