// tpserve-accuracy: what each FP8 scale scheme costs a model's output. For a HuggingFace-layout
// checkpoint with BF16 weights, tpserve's logits (CPU reference backend, or with --backend cuda
// the CUDA engine; TP 1) under per-tensor,
// per-channel + per-token and block-wise (128x128 weights, 1x128 activations) FP8 against the
// same model in BF16, at every position of a few prompts: mean and max KL(P_bf16 || P_scheme),
// top-1 agreement and relative error (benchmarks/accuracy_eval.h says how the FP8 models are
// made). Writes a JSON file and a Markdown table (each through FILE.tmp and a rename) and
// prints the table. The CPU backend runs anywhere.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks/accuracy_eval.h"
#if TPSERVE_WITH_CUDA
#include "benchmarks/accuracy_cuda.h"
#endif
#include "benchmarks/write_replacing.h"
#include "engine/model_config.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

struct Flags {
  std::string model;
  std::string prompts;
  int64_t num_prompts = 4;
  int64_t prompt_len = 64;
  uint64_t seed = 1;
  std::vector<std::string> schemes = {"tensor", "channel", "block"};
  std::string out_json = "accuracy.json";
  std::string out_md = "accuracy.md";
  std::string commit = "unknown";
  int outlier_exponent = 0;
  bool quiet = false;
  std::string backend = "cpu";
  bool fp8_attention = false;
  std::string kv_scales = "one";
  int64_t calibration_prompts = 8;
};

int Fail(const std::string& message) {
  std::fprintf(stderr, "tpserve-accuracy: %s\n", message.c_str());
  return 1;
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "tpserve-accuracy: tpserve's logits under each FP8 scale scheme against the same model in "
      "BF16, on the CPU reference backend or the CUDA engine (TP 1). The FP8 weights are made in "
      "memory from the "
      "checkpoint's BF16 ones (scale = amax / 448 per tensor, per output channel or per "
      "128x128 block; E4M3 codes); activations are scaled at run time per tensor (the batch's "
      "amax), per token, or per 1x128 group. Each prompt runs as one batch; every position "
      "counts. Reports per scheme the mean and max KL(P_bf16 || P_scheme) in nats (softmax in "
      "double), the top-1 agreement over positions and ||logits - logits_bf16|| / "
      "||logits_bf16||."};
  app.add_option("--model", f.model,
                 "Checkpoint directory in HuggingFace layout: config.json and *.safetensors with "
                 "BF16 (or F32) weights of a Llama-family model (an FP8 checkpoint is refused: "
                 "the tool quantizes itself)")
      ->required();
  app.add_option("--prompts", f.prompts,
                 "JSON file of prompts: a list of token-id lists, or an object with one as "
                 "\"prompts\" (e.g. tests/data/hf/llama31/reference.json). Default: "
                 "--num-prompts random prompts of --prompt-len tokens drawn from --seed");
  app.add_option("--num-prompts", f.num_prompts, "Random prompts to draw (without --prompts)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  app.add_option("--prompt-len", f.prompt_len,
                 "Tokens of each random prompt (without --prompts); at most the model's "
                 "max_position_embeddings")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--seed", f.seed,
                 "Seed of the random prompts (token ids uniform over the vocabulary, splitmix64: "
                 "the same prompts on every machine)")
      ->capture_default_str();
  app.add_option("--schemes", f.schemes,
                 "FP8 schemes to measure, in this order: tensor (one weight scale per tensor, "
                 "activations per tensor), channel (per output channel, activations per token), "
                 "block (128x128 weight blocks, 1x128 activation groups)")
      ->check(CLI::IsMember({"tensor", "channel", "block"}))
      ->capture_default_str();
  app.add_option("--outlier-exponent", f.outlier_exponent,
                 "Before measuring, give the BF16 model outlier channels of 2^E without changing "
                 "its BF16 logits (V rows of KV head 0 times 2^E, the o_proj input columns that "
                 "read them times 2^-E; see AddOutlierChannels in benchmarks/accuracy_eval.h). "
                 "0: the checkpoint as is. Random-init models have no outliers, and there the "
                 "schemes differ only by rounding noise")
      ->check(CLI::Range(-30, 30))
      ->capture_default_str();
  app.add_option("--out-json", f.out_json, "JSON results file (written through FILE.tmp)")
      ->capture_default_str();
  app.add_option("--out-md", f.out_md, "Markdown table file (written through FILE.tmp)")
      ->capture_default_str();
  app.add_option("--commit", f.commit, "Commit id recorded in the JSON meta")
      ->capture_default_str();
  app.add_option("--backend", f.backend,
                 "Where every model of the run (the BF16 reference and each scheme) computes its "
                 "logits: cpu (the CPU reference) or cuda (the CUDA engine at tp 1 on GPU 0, "
                 "each prompt as one batch of its prefixes; in builds with CUDA)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_flag("--fp8-attention", f.fp8_attention,
               "--backend cuda: the FP8 schemes' passes run attention in E4M3 too "
               "(CudaModelOptions::fp8_attention; the BF16 reference keeps BF16 attention), so "
               "against a run without it the table shows what E4M3 attention adds");
  app.add_option("--kv-scales", f.kv_scales,
                 "With --fp8-attention: K's and V's E4M3 scales (the KV cache scales a checkpoint "
                 "gives as k_scale / v_scale). one: 1, what a checkpoint without them gets; "
                 "calibrate: each layer's largest |K| and |V| over --calibration-prompts random "
                 "prompts (seed --seed + 1, --prompt-len tokens; the BF16 model, outliers "
                 "included) divided by 448")
      ->check(CLI::IsMember({"one", "calibrate"}))
      ->capture_default_str();
  app.add_option("--calibration-prompts", f.calibration_prompts,
                 "--kv-scales calibrate: how many random prompts")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_flag("--quiet", f.quiet, "No progress lines on stderr (the table is still printed)");
  StrictNumbers(app);
  CLI11_PARSE(app, argc, argv);

  auto config = LoadModelConfig(f.model);
  if (!config.ok()) return Fail(config.status().ToString());
  AccuracyOptions o;
  o.model_dir = f.model;
  if (!f.prompts.empty()) {
    auto prompts = ReadPrompts(f.prompts, config->vocab_size, config->max_position_embeddings);
    if (!prompts.ok()) return Fail(prompts.status().ToString());
    o.prompts = *std::move(prompts);
    o.prompts_source = f.prompts;
  } else {
    if (f.prompt_len > config->max_position_embeddings) {
      return Fail("--prompt-len " + std::to_string(f.prompt_len) + " exceeds " + f.model +
                  "'s max_position_embeddings (" + std::to_string(config->max_position_embeddings) +
                  ")");
    }
    o.prompts = DefaultPrompts(f.num_prompts, f.prompt_len, config->vocab_size, f.seed);
    o.prompts_source = "random token ids, seed " + std::to_string(f.seed);
  }
  o.outlier_exponent = f.outlier_exponent;
  if (f.backend == "cuda") {
#if TPSERVE_WITH_CUDA
    o.logits = [fp8_attention = f.fp8_attention](const ModelConfig& c, const RankWeights& w,
                                                 const Prompts& p,
                                                 const std::function<void(size_t)>& progress) {
      return CudaPromptLogits(c, w, p, progress, fp8_attention);
    };
    o.backend = std::string("CUDA engine (engine/cuda_model.h), tp 1, one GPU") +
                (f.fp8_attention ? "; FP8 schemes with E4M3 attention" : "");
#else
    return Fail("--backend cuda: this build has no CUDA backend (configure with CUDA)");
#endif
  } else if (f.fp8_attention) {
    return Fail("--fp8-attention needs --backend cuda");
  }
  if (f.kv_scales == "calibrate") {
    if (!f.fp8_attention) {
      return Fail(
          "--kv-scales calibrate needs --fp8-attention (only E4M3 attention quantizes K "
          "and V in these passes)");
    }
    o.kv_calibration = DefaultPrompts(
        f.calibration_prompts, std::min<int64_t>(f.prompt_len, config->max_position_embeddings),
        config->vocab_size, f.seed + 1);
    o.kv_calibration_source = std::to_string(f.calibration_prompts) + " random prompts of " +
                              std::to_string(o.kv_calibration.front().size()) + " tokens (seed " +
                              std::to_string(f.seed + 1) + ")";
  }
  o.schemes.clear();
  for (const std::string& s : f.schemes) o.schemes.push_back(*ParseFp8Scheme(s));
  if (!f.quiet) {
    o.progress = [](const std::string& line) {
      std::fprintf(stderr, "tpserve-accuracy: %s\n", line.c_str());
    };
  }
  auto report = RunAccuracy(o);
  if (!report.ok()) return Fail(report.status().ToString());

  if (std::string err = WriteReplacing(f.out_json, AccuracyJson(*report, f.commit)); !err.empty()) {
    return Fail(err);
  }
  if (std::string err = WriteReplacing(f.out_md, AccuracyMarkdown(*report)); !err.empty()) {
    return Fail(err);
  }
  std::printf("%s", AccuracyConsoleTable(*report).c_str());
  std::printf("wrote %s and %s\n", f.out_json.c_str(), f.out_md.c_str());
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
