#include "benchmarks/accuracy_eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "comm/local_communicator.h"
#include "engine/cpu_model.h"
#include "engine/kv_calibration.h"
#include "engine/safetensors.h"

namespace tpserve {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// The BF16 weight `w` ([n, k]) in FP8 under `scheme`.
StatusOr<LinearWeight> QuantizeLinear(const LinearWeight& w, Fp8Scheme scheme,
                                      const std::string& name) {
  if (w.dtype != DataType::kBFloat16 || w.data.size() != static_cast<size_t>(w.n * w.k * 2)) {
    return InvalidArgumentError(name + ": not a BF16 [" + std::to_string(w.n) + ", " +
                                std::to_string(w.k) + "] weight");
  }
  std::vector<float> values(w.n * w.k);
  for (size_t i = 0; i < values.size(); ++i) {
    BFloat16 b;
    std::memcpy(&b.bits, w.data.data() + 2 * i, 2);
    values[i] = BFloat16ToFloat(b);
    if (!std::isfinite(values[i])) {
      // One inf would make its scale infinite and every code it covers 0 or NaN.
      return InvalidArgumentError(name + ": non-finite weight (" + std::to_string(values[i]) +
                                  ") at row " + std::to_string(i / w.k) + ", column " +
                                  std::to_string(i % w.k));
    }
  }
  LinearWeight q;
  q.dtype = DataType::kFloat8E4M3;
  q.n = w.n;
  q.k = w.k;
  q.scheme = scheme;
  q.data.resize(values.size());
  std::vector<float> scales(Fp8WeightScaleCount(scheme, w.n, w.k));
  QuantizeWeightsFp8(scheme, values, w.n, w.k, q.data, scales);
  q.weight_scale = *std::max_element(scales.begin(), scales.end());
  if (scheme != Fp8Scheme::kPerTensor) q.weight_scales = std::move(scales);
  // No static input scale: per tensor, the engine then scales each batch's input by its amax
  // (as for a BF16 checkpoint served in FP8); the finer schemes always scale dynamically.
  q.dynamic_input = true;
  q.input_scale = 1.0f;  // unused with dynamic_input
  return q;
}

// INVALID_ARGUMENT when `dir` holds an already-quantized checkpoint.
Status CheckNotQuantized(const std::string& dir) {
  const std::string config = dir + "/config.json";
  std::ifstream in(config);
  if (in) {
    const Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("quantization_config") && !j["quantization_config"].is_null()) {
      return InvalidArgumentError(
          config +
          " has a quantization_config: this tool quantizes a BF16 checkpoint itself "
          "(give it the unquantized model)");
    }
  }
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    TP_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(f));
    for (const TensorView& v : file.tensors()) {
      const bool fp8 = v.dtype == StDtype::kF8E4M3 || v.dtype == StDtype::kF8E5M2;
      const bool scale = v.name.ends_with("_scale") || v.name.ends_with("_scale_inv");
      if (fp8 || scale) {
        return InvalidArgumentError(
            f + ": tensor '" + v.name + "' (" + std::string(StDtypeName(v.dtype)) +
            ") belongs to an FP8 checkpoint: this tool quantizes a BF16 checkpoint itself "
            "(give it the unquantized model)");
      }
    }
  }
  return Status::Ok();
}

std::string Sci(double v, int digits = 3) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  return buf;
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string ModelLine(const AccuracyReport& r) {
  const ModelConfig& c = r.config;
  std::ostringstream s;
  s << "hidden " << c.hidden_size << ", " << c.num_hidden_layers << " layers, "
    << c.num_attention_heads << " heads (" << c.num_key_value_heads << " KV), head_dim "
    << c.head_dim() << ", intermediate " << c.intermediate_size << ", vocab " << c.vocab_size
    << ", RoPE " << RopeTypeName(c.rope_scaling.type)
    << (c.tie_word_embeddings ? ", tied embeddings" : "");
  return s.str();
}

std::string PromptsLine(const AccuracyReport& r) {
  std::ostringstream s;
  s << r.prompt_lengths.size() << " prompts (lengths";
  for (size_t i = 0; i < r.prompt_lengths.size(); ++i) s << (i ? ", " : " ") << r.prompt_lengths[i];
  s << "; " << r.prompts_source << "), " << r.positions << " positions";
  if (r.outlier_exponent != 0) {
    s << "; outlier channels of 2^" << r.outlier_exponent << " added (AddOutlierChannels)";
  }
  s << "; KV cache scales: " << r.kv_scales;
  return s.str();
}

std::string Top1Text(const LogitsDivergence& d) {
  return Fixed(d.top1_agreement, 4) + " (" + std::to_string(d.top1_agree) + "/" +
         std::to_string(d.positions) + ")";
}

}  // namespace

StatusOr<RankWeights> QuantizeModelFp8(const RankWeights& bf16, Fp8Scheme scheme) {
  if (bf16.tp != 1 || bf16.rank != 0) {
    return InvalidArgumentError("QuantizeModelFp8 takes TP-1 weights, got rank " +
                                std::to_string(bf16.rank) + " of tp " + std::to_string(bf16.tp));
  }
  if (bf16.dtype != DataType::kBFloat16) {
    return InvalidArgumentError(
        "QuantizeModelFp8 takes BF16 weights (load them with "
        "DataType::kBFloat16)");
  }
  RankWeights q;
  q.tp = 1;
  q.rank = 0;
  q.dtype = DataType::kFloat8E4M3;
  q.embed = bf16.embed;
  q.final_norm = bf16.final_norm;
  q.lm_head = bf16.lm_head;  // BF16 under every scheme, as the engine keeps it
  q.layers.reserve(bf16.layers.size());
  for (size_t i = 0; i < bf16.layers.size(); ++i) {
    const LayerWeights& l = bf16.layers[i];
    const std::string p = HfLayerPrefix(static_cast<int64_t>(i));
    LayerWeights o;
    o.input_norm = l.input_norm;
    o.post_norm = l.post_norm;
    o.kv_scales = l.kv_scales;
    TP_ASSIGN_OR_RETURN(o.qkv, QuantizeLinear(l.qkv, scheme, p + ".self_attn.{q,k,v}_proj"));
    TP_ASSIGN_OR_RETURN(o.o, QuantizeLinear(l.o, scheme, p + ".self_attn.o_proj"));
    TP_ASSIGN_OR_RETURN(o.gate_up, QuantizeLinear(l.gate_up, scheme, p + ".mlp.{gate,up}_proj"));
    TP_ASSIGN_OR_RETURN(o.down, QuantizeLinear(l.down, scheme, p + ".mlp.down_proj"));
    q.layers.push_back(std::move(o));
  }
  return q;
}

Status AddOutlierChannels(const ModelConfig& config, int exponent, RankWeights* w) {
  if (exponent < -30 || exponent > 30) {
    return InvalidArgumentError("outlier exponent " + std::to_string(exponent) +
                                " outside [-30, 30]");
  }
  if (w->tp != 1 || w->dtype != DataType::kBFloat16) {
    return InvalidArgumentError("AddOutlierChannels takes TP-1 BF16 weights");
  }
  const int64_t hd = config.head_dim(), nh = config.num_attention_heads,
                nkv = config.num_key_value_heads, group = nh / nkv;
  const float up = std::ldexp(1.0f, exponent), down = std::ldexp(1.0f, -exponent);
  auto scale = [](LinearWeight& lw, int64_t row, int64_t col, float f) {
    uint8_t* p = lw.data.data() + 2 * (row * lw.k + col);
    BFloat16 b;
    std::memcpy(&b.bits, p, 2);
    b = FloatToBFloat16(BFloat16ToFloat(b) * f);  // exact: a power of two
    std::memcpy(p, &b.bits, 2);
  };
  for (LayerWeights& l : w->layers) {
    // V of KV head 0: rows [nh + nkv, nh + nkv + 1) * hd of the fused [q; k; v].
    for (int64_t r = (nh + nkv) * hd; r < (nh + nkv + 1) * hd; ++r) {
      for (int64_t c = 0; c < l.qkv.k; ++c) scale(l.qkv, r, c, up);
    }
    // o's input columns of query heads 0 .. group-1 (those reading KV head 0).
    for (int64_t r = 0; r < l.o.n; ++r) {
      for (int64_t c = 0; c < group * hd; ++c) scale(l.o, r, c, down);
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<float>> PromptLogits(const ModelConfig& config, const RankWeights& weights,
                                          const Prompts& prompts,
                                          const std::function<void(size_t)>& progress) {
  std::vector<float> logits;
  TP_RETURN_IF_ERROR(RunOnLocalRanks(1, [&](Communicator& comm) -> Status {
    // CpuModel owns its weights: one copy per call, the price of running them unchanged.
    TP_ASSIGN_OR_RETURN(auto model, CpuModel::Create(config, weights, nullptr, comm));
    for (size_t p = 0; p < prompts.size(); ++p) {
      const std::string what =
          "prompt " + std::to_string(p) + " (" + std::to_string(prompts[p].size()) + " tokens)";
      auto batch = PackSequences({prompts[p]}, config.vocab_size, config.max_position_embeddings);
      if (!batch.ok()) return batch.status().WithContext(what);
      auto rows = model->ForwardAllTokens(*batch);
      if (!rows.ok()) return rows.status().WithContext(what);
      logits.insert(logits.end(), rows->begin(), rows->end());
      if (progress) progress(p + 1);
    }
    return Status::Ok();
  }));
  return logits;
}

StatusOr<LogitsDivergence> CompareLogits(std::span<const float> ref, std::span<const float> test,
                                         int64_t vocab) {
  if (vocab <= 0 || ref.empty() || ref.size() % vocab != 0 || test.size() != ref.size()) {
    return InvalidArgumentError("compare logits: " + std::to_string(ref.size()) +
                                " reference and " + std::to_string(test.size()) +
                                " test values, vocab " + std::to_string(vocab) +
                                " (want equal, positive multiples of vocab)");
  }
  LogitsDivergence d;
  d.positions = static_cast<int64_t>(ref.size()) / vocab;
  double diff2 = 0, ref2 = 0, kl_sum = 0;
  for (int64_t pos = 0; pos < d.positions; ++pos) {
    const float* a = ref.data() + pos * vocab;
    const float* b = test.data() + pos * vocab;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
        return InvalidArgumentError("compare logits: position " + std::to_string(pos) + ", token " +
                                    std::to_string(i) + ": " +
                                    (std::isfinite(a[i]) ? "test" : "reference") + " logit is " +
                                    std::to_string(std::isfinite(a[i]) ? b[i] : a[i]));
      }
    }
    // log-softmax of each, in double.
    const double max_a = *std::max_element(a, a + vocab), max_b = *std::max_element(b, b + vocab);
    double sum_a = 0, sum_b = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      sum_a += std::exp(double(a[i]) - max_a);
      sum_b += std::exp(double(b[i]) - max_b);
    }
    const double lse_a = max_a + std::log(sum_a), lse_b = max_b + std::log(sum_b);
    double kl = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const double la = double(a[i]) - lse_a, lb = double(b[i]) - lse_b;
      kl += std::exp(la) * (la - lb);
      diff2 += (double(b[i]) - a[i]) * (double(b[i]) - a[i]);
      ref2 += double(a[i]) * a[i];
    }
    kl = std::max(kl, 0.0);
    kl_sum += kl;
    if (pos == 0 || kl > d.max_kl) {
      d.max_kl = kl;
      d.max_kl_position = pos;
    }
    if (std::max_element(a, a + vocab) - a == std::max_element(b, b + vocab) - b) ++d.top1_agree;
  }
  d.mean_kl = kl_sum / d.positions;
  d.top1_agreement = double(d.top1_agree) / d.positions;
  d.rel_err = ref2 > 0 ? std::sqrt(diff2 / ref2) : (diff2 > 0 ? INFINITY : 0.0);
  return d;
}

const char* Fp8SchemeWeightsText(Fp8Scheme scheme) {
  switch (scheme) {
    case Fp8Scheme::kPerChannel:
      return "per output channel";
    case Fp8Scheme::kBlock:
      return "128x128 blocks";
    case Fp8Scheme::kPerTensor:
      break;
  }
  return "per tensor";
}

const char* Fp8SchemeActivationsText(Fp8Scheme scheme) {
  switch (scheme) {
    case Fp8Scheme::kPerChannel:
      return "per token, dynamic";
    case Fp8Scheme::kBlock:
      return "1x128 groups, dynamic";
    case Fp8Scheme::kPerTensor:
      break;
  }
  return "per tensor, dynamic (batch amax)";
}

StatusOr<AccuracyReport> RunAccuracy(const AccuracyOptions& o) {
  auto say = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  if (o.prompts.empty()) return InvalidArgumentError("accuracy: no prompts");
  AccuracyReport r;
  r.backend = o.backend;
  r.model_dir = o.model_dir;
  const PromptLogitsFn logits_of = o.logits ? o.logits : PromptLogitsFn(PromptLogits);
  r.prompts_source = o.prompts_source;
  for (const auto& p : o.prompts) {
    r.prompt_lengths.push_back(static_cast<int64_t>(p.size()));
    r.positions += static_cast<int64_t>(p.size());
  }
  TP_ASSIGN_OR_RETURN(r.config, LoadModelConfig(o.model_dir));
  TP_RETURN_IF_ERROR(CheckNotQuantized(o.model_dir));
  auto t0 = std::chrono::steady_clock::now();
  TP_ASSIGN_OR_RETURN(RankWeights bf16,
                      LoadRankWeights(o.model_dir, r.config, 1, 0, DataType::kBFloat16));
  TP_RETURN_IF_ERROR(AddOutlierChannels(r.config, o.outlier_exponent, &bf16));
  r.outlier_exponent = o.outlier_exponent;
  say("loaded " + o.model_dir + " (BF16) in " + Fixed(Seconds(t0), 1) + " s");
  if (!o.kv_calibration.empty()) {
    t0 = std::chrono::steady_clock::now();
    TP_ASSIGN_OR_RETURN(std::vector<KvAbsMax> most,
                        CalibrateKvAbsMax(r.config, bf16, o.kv_calibration));
    for (size_t l = 0; l < most.size(); ++l) {
      bf16.layers[l].kv_scales = KvScalesForAbsMax(most[l]);
      r.kv_scale_values.push_back(bf16.layers[l].kv_scales);
    }
    r.kv_scales = "each layer's largest |K| and |V| over " + o.kv_calibration_source + " / 448";
    say("KV cache scales calibrated in " + Fixed(Seconds(t0), 1) + " s");
  }

  const size_t n = o.prompts.size();
  auto per_prompt = [&](const std::string& what, std::chrono::steady_clock::time_point since) {
    return [&, what, since](size_t done) {
      say(what + ": prompt " + std::to_string(done) + "/" + std::to_string(n) + ", " +
          Fixed(Seconds(since), 1) + " s");
    };
  };
  t0 = std::chrono::steady_clock::now();
  TP_ASSIGN_OR_RETURN(std::vector<float> ref,
                      logits_of(r.config, bf16, o.prompts, per_prompt("bf16", t0)));
  r.reference_seconds = Seconds(t0);
  for (Fp8Scheme scheme : o.schemes) {
    const std::string name = Fp8SchemeName(scheme);
    t0 = std::chrono::steady_clock::now();
    TP_ASSIGN_OR_RETURN(RankWeights fp8, QuantizeModelFp8(bf16, scheme));
    TP_ASSIGN_OR_RETURN(std::vector<float> logits,
                        logits_of(r.config, fp8, o.prompts, per_prompt(name, t0)));
    SchemeAccuracy s;
    s.scheme = scheme;
    TP_ASSIGN_OR_RETURN(s.divergence, CompareLogits(ref, logits, r.config.vocab_size));
    s.seconds = Seconds(t0);
    say(name + ": mean KL " + Sci(s.divergence.mean_kl) + ", top-1 " + Top1Text(s.divergence));
    r.schemes.push_back(s);
  }
  return r;
}

std::string AccuracyJson(const AccuracyReport& r, const std::string& commit) {
  const ModelConfig& c = r.config;
  Json schemes = Json::array();
  for (const SchemeAccuracy& s : r.schemes) {
    const LogitsDivergence& d = s.divergence;
    schemes.push_back({{"scheme", Fp8SchemeName(s.scheme)},
                       {"weights", Fp8SchemeWeightsText(s.scheme)},
                       {"activations", Fp8SchemeActivationsText(s.scheme)},
                       {"mean_kl", d.mean_kl},
                       {"max_kl", d.max_kl},
                       {"max_kl_position", d.max_kl_position},
                       {"top1_agreement", d.top1_agreement},
                       {"top1_agree", d.top1_agree},
                       {"rel_err", d.rel_err},
                       {"seconds", s.seconds}});
  }
  Json doc = {
      {"meta",
       {{"tool", "tpserve-accuracy"},
        {"commit", commit},
        {"backend", r.backend},
        {"reference", "the same model with BF16 weights and activations"},
        {"kl", "KL(P_bf16 || P_scheme) in nats per position, softmax in double"},
        {"rel_err", "||logits_scheme - logits_bf16|| / ||logits_bf16||, over all positions"}}},
      {"model",
       {{"dir", r.model_dir},
        {"hidden_size", c.hidden_size},
        {"num_hidden_layers", c.num_hidden_layers},
        {"num_attention_heads", c.num_attention_heads},
        {"num_key_value_heads", c.num_key_value_heads},
        {"head_dim", c.head_dim()},
        {"intermediate_size", c.intermediate_size},
        {"vocab_size", c.vocab_size},
        {"rope_type", RopeTypeName(c.rope_scaling.type)},
        {"tie_word_embeddings", c.tie_word_embeddings}}},
      {"outlier_exponent", r.outlier_exponent},
      {"kv_scales", r.kv_scales},
      {"kv_scale_values",
       [&] {
         Json v = Json::array();
         for (const KvScales& k : r.kv_scale_values) v.push_back({{"k", k.k}, {"v", k.v}});
         return v;
       }()},
      {"prompts",
       {{"source", r.prompts_source}, {"lengths", r.prompt_lengths}, {"positions", r.positions}}},
      {"reference_seconds", r.reference_seconds},
      {"schemes", schemes}};
  return doc.dump(1) + "\n";
}

std::string AccuracyMarkdown(const AccuracyReport& r) {
  std::ostringstream s;
  s << "## FP8 scale schemes against BF16: " << fs::path(r.model_dir).filename().string() << "\n\n"
    << "Model `" << r.model_dir << "`: " << ModelLine(r) << ".  \n"
    << "Prompts: " << PromptsLine(r) << ".  \n"
    << "tpserve's " << r.backend
    << "; the reference is the same model with BF16 weights and activations on it. "
       "KL(P_bf16 || P_scheme) in nats per position.\n\n"
    << "| scheme | weights | activations | mean KL | max KL | top-1 agreement | rel. error |\n"
    << "|---|---|---|---:|---:|---:|---:|\n";
  for (const SchemeAccuracy& a : r.schemes) {
    const LogitsDivergence& d = a.divergence;
    s << "| " << Fp8SchemeName(a.scheme) << " | " << Fp8SchemeWeightsText(a.scheme) << " | "
      << Fp8SchemeActivationsText(a.scheme) << " | " << Sci(d.mean_kl) << " | " << Sci(d.max_kl)
      << " | " << Top1Text(d) << " | " << Sci(d.rel_err) << " |\n";
  }
  return s.str();
}

std::string AccuracyConsoleTable(const AccuracyReport& r) {
  std::ostringstream s;
  s << "model:   " << r.model_dir << " (" << ModelLine(r) << ")\n"
    << "prompts: " << PromptsLine(r) << "\n"
    << "backend: " << r.backend << "\n"
    << "reference: BF16 weights and activations, same backend\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-8s %-19s %-33s %10s %10s %-20s %10s\n", "scheme", "weights",
                "activations", "mean KL", "max KL", "top-1 agreement", "rel err");
  s << line;
  for (const SchemeAccuracy& a : r.schemes) {
    const LogitsDivergence& d = a.divergence;
    std::snprintf(line, sizeof line, "%-8s %-19s %-33s %10s %10s %-20s %10s\n",
                  Fp8SchemeName(a.scheme), Fp8SchemeWeightsText(a.scheme),
                  Fp8SchemeActivationsText(a.scheme), Sci(d.mean_kl, 2).c_str(),
                  Sci(d.max_kl, 2).c_str(), Top1Text(d).c_str(), Sci(d.rel_err, 2).c_str());
    s << line;
  }
  return s.str();
}

}  // namespace tpserve
