#include "engine/model_weights.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>

#include "engine/fp8_checkpoint_scales.h"
#include "engine/safetensors.h"
#include "engine/tp_layers.h"
#include "layers/fp8.h"

namespace tpserve {
namespace {

namespace fs = std::filesystem;

// FP8 static input scale when a checkpoint gives none: activations up to 8
// in magnitude (RMSNorm outputs and attention/SwiGLU outputs of Llama-scale
// models sit well inside) keep their full E4M3 resolution.
constexpr float kDefaultInputScale = 8.0f / kFp8E4M3Max;

// A checkpoint's tensors by HuggingFace name, from files or made in memory.
class Checkpoint {
 public:
  void AddOwned(std::string name, StDtype dtype, std::vector<int64_t> shape,
                std::vector<uint8_t> bytes) {
    owned_.push_back(std::make_unique<std::vector<uint8_t>>(std::move(bytes)));
    TensorView v;
    v.name = name;
    v.dtype = dtype;
    v.shape = std::move(shape);
    v.data = owned_.back()->data();
    v.bytes = owned_.back()->size();
    views_[name] = v;
  }
  // A tensor's name, dtype and shape without its data (null data; bytes is
  // its size): a plan of what a writer will get.
  void AddShape(std::string name, StDtype dtype, std::vector<int64_t> shape) {
    TensorView v;
    v.name = name;
    v.dtype = dtype;
    v.shape = std::move(shape);
    v.bytes = static_cast<size_t>(v.numel()) * StDtypeSize(dtype);
    views_[name] = std::move(v);
  }
  // INVALID_ARGUMENT when a tensor of `file` is already in an earlier file
  // (a stray copy next to a sharded checkpoint must not silently win).
  Status AddFile(SafetensorsFile file) {
    for (const TensorView& v : file.tensors()) {
      if (auto it = where_.find(v.name); it != where_.end()) {
        return InvalidArgumentError("tensor '" + v.name + "' is in both " + it->second + " and " +
                                    file.path() + "; remove one of the files");
      }
    }
    files_.push_back(std::make_unique<SafetensorsFile>(std::move(file)));
    for (const TensorView& v : files_.back()->tensors()) {
      views_[v.name] = v;
      where_[v.name] = files_.back()->path();
    }
    return Status::Ok();
  }
  // Every name looked up, found or not, is remembered: Unused() lists the rest.
  const TensorView* Find(const std::string& name) const {
    looked_up_.insert(name);
    auto it = views_.find(name);
    return it == views_.end() ? nullptr : &it->second;
  }
  // Loading notes for rank 0 to log (each rank reads the same tensors).
  void Note(std::string text) const { notes_.push_back(std::move(text)); }
  const std::vector<std::string>& notes() const { return notes_; }
  // The tensors no Find has asked for, in name order.
  std::vector<std::string> Unused() const {
    std::vector<std::string> out;
    for (const auto& [name, v] : views_) {
      if (!looked_up_.count(name)) out.push_back(name);
    }
    return out;
  }
  StatusOr<const TensorView*> Get(const std::string& name) const {
    if (const TensorView* v = Find(name)) return v;
    return NotFoundError(source_ + ": tensor '" + name + "' is missing");
  }
  std::string Where(const std::string& name) const {
    auto it = where_.find(name);
    return (it == where_.end() ? source_ : it->second) + ": tensor '" + name + "'";
  }
  const std::map<std::string, TensorView>& views() const { return views_; }
  void set_source(std::string s) { source_ = std::move(s); }
  const std::string& source() const { return source_; }
  // What config.json's quantization_config declares (nothing for random weights).
  void set_quant(Fp8QuantConfig q) { quant_ = std::move(q); }
  const Fp8QuantConfig& quant() const { return quant_; }

 private:
  std::string source_ = "random weights";
  Fp8QuantConfig quant_;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> owned_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> views_;
  std::map<std::string, std::string> where_;
  mutable std::set<std::string> looked_up_;
  mutable std::vector<std::string> notes_;
};

// What the checkpoint holds that the model did not read. Refused where it means the model
// would compute something else than the checkpoint's: layers beyond num_hidden_layers (the
// config does not match the weights) and biases (linear layers here have none). The rest
// (e.g. rotary_emb.inv_freq, a query scale) is named in a warning by rank 0.
Status CheckUnused(const Checkpoint& ck, const ModelConfig& c, int rank) {
  const std::vector<std::string> unused = ck.Unused();
  const std::string prefix = "model.layers.";
  for (const std::string& name : unused) {
    if (name.starts_with(prefix)) {
      const size_t digits = name.find_first_not_of("0123456789", prefix.size());
      const std::string layer = name.substr(prefix.size(), digits - prefix.size());
      if (!layer.empty() && digits != std::string::npos && name[digits] == '.' &&
          layer.size() < 10 && std::stoll(layer) >= c.num_hidden_layers) {
        return InvalidArgumentError(ck.Where(name) + " belongs to layer " + layer +
                                    ", but the config has num_hidden_layers " +
                                    std::to_string(c.num_hidden_layers) +
                                    ": the config does not describe these weights");
      }
    }
    if (name.ends_with(".bias")) {
      return UnimplementedError(ck.Where(name) +
                                ": biases are not supported (this engine's linear layers and "
                                "norms have none)");
    }
  }
  if (rank == 0) {
    for (const std::string& note : ck.notes()) spdlog::warn("{}", note);
  }
  if (rank == 0 && !unused.empty()) {
    std::string shown;
    for (size_t i = 0; i < unused.size() && i < 5; ++i) shown += (i ? ", " : "") + unused[i];
    spdlog::warn("{}: {} tensor(s) not used by the model, left unread: {}{}", ck.source(),
                 unused.size(), shown, unused.size() > 5 ? ", ..." : "");
  }
  return Status::Ok();
}

// "[a,b]": a shape in the loader's errors.
std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string t;
  for (int64_t d : shape) t += (t.empty() ? "" : ",") + std::to_string(d);
  return "[" + t + "]";
}

// An embedding or norm tensor (BF16 or F32, as FP8 checkpoints keep them) of
// exactly the shape the config implies.
StatusOr<std::vector<float>> ToFloats(const Checkpoint& ck, const TensorView& v,
                                      const std::vector<int64_t>& shape) {
  if (v.shape != shape) {
    return InvalidArgumentError(ck.Where(v.name) + " has shape " + ShapeText(v.shape) +
                                ", the config implies " + ShapeText(shape));
  }
  std::vector<float> out(v.numel());
  switch (v.dtype) {
    case StDtype::kF32:
      std::memcpy(out.data(), v.data, v.bytes);
      break;
    case StDtype::kBF16:
      for (int64_t i = 0; i < v.numel(); ++i) {
        BFloat16 b;
        std::memcpy(&b.bits, v.data + 2 * i, 2);
        out[i] = BFloat16ToFloat(b);
      }
      break;
    default:
      return UnimplementedError(ck.Where(v.name) + " has dtype " +
                                std::string(StDtypeName(v.dtype)) +
                                " (embeddings and norms: F32 or BF16; only the linear layers' "
                                "weights may be F8_E4M3)");
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) {  // would turn every logit it reaches into NaN
      return InvalidArgumentError(ck.Where(v.name) + " holds a non-finite value (" +
                                  std::to_string(out[i]) + ") at element " + std::to_string(i));
    }
  }
  return out;
}

// Rows [row_begin, row_end) and columns [col_begin, col_end) of the 2-D
// weight `base`, dequantized, with the scales an FP8 `dtype` rank keeps.
StatusOr<LinearPart> ReadBlock(const Checkpoint& ck, const std::string& base, int64_t full_rows,
                               int64_t full_cols, int64_t row_begin, int64_t row_end,
                               int64_t col_begin, int64_t col_end, DataType dtype, int tp) {
  const std::string wname = base + ".weight";
  TP_ASSIGN_OR_RETURN(const TensorView* w, ck.Get(wname));
  if (const std::vector<int64_t> want{full_rows, full_cols}; w->shape != want) {
    return InvalidArgumentError(ck.Where(wname) + " has shape " + ShapeText(w->shape) +
                                ", the config implies " + ShapeText(want));
  }
  LinearPart b;
  b.rows = row_end - row_begin;
  b.cols = col_end - col_begin;
  b.row_begin = row_begin;
  b.col_begin = col_begin;
  b.where = ck.Where(wname);
  std::optional<WeightScales> ws;
  if (w->dtype == StDtype::kF8E4M3) {
    const TensorView* per = ck.Find(base + ".weight_scale");
    const TensorView* inv = ck.Find(base + ".weight_scale_inv");
    if (per != nullptr && inv != nullptr) {
      return InvalidArgumentError(ck.Where(base + ".weight_scale_inv") + " and " +
                                  ck.Where(base + ".weight_scale") +
                                  " both scale one weight; a checkpoint gives one of them");
    }
    const std::string sname = base + (inv != nullptr ? ".weight_scale_inv" : ".weight_scale");
    TP_ASSIGN_OR_RETURN(const TensorView* sv, ck.Get(sname));
    b.where = ck.Where(sname);
    TP_ASSIGN_OR_RETURN(
        ws, ReadWeightScales(*sv, b.where, inv != nullptr, full_rows, full_cols, ck.quant()));
  } else if (w->dtype != StDtype::kBF16 && w->dtype != StDtype::kF32) {
    return UnimplementedError(ck.Where(wname) + " has dtype " + std::string(StDtypeName(w->dtype)) +
                              " (supported: F8_E4M3 with weight_scale or weight_scale_inv, BF16, "
                              "F32)");
  }
  b.values.resize(b.rows * b.cols);
  const size_t esize = StDtypeSize(w->dtype);
  for (int64_t r = 0; r < b.rows; ++r) {
    const uint8_t* row = w->data + ((row_begin + r) * full_cols + col_begin) * esize;
    for (int64_t c = 0; c < b.cols; ++c) {
      float v;
      if (w->dtype == StDtype::kF8E4M3) {
        if ((row[c] & 0x7f) == 0x7f) {  // E4M3's only NaN codes
          return InvalidArgumentError(ck.Where(wname) + " holds a NaN code at row " +
                                      std::to_string(row_begin + r) + ", column " +
                                      std::to_string(col_begin + c));
        }
        v = Fp8E4M3ToFloat(row[c]) * ws->At(row_begin + r, col_begin + c);
      } else if (w->dtype == StDtype::kBF16) {
        BFloat16 h;
        std::memcpy(&h.bits, row + 2 * c, 2);
        v = BFloat16ToFloat(h);
      } else {
        std::memcpy(&v, row + 4 * c, 4);
      }
      b.values[r * b.cols + c] = v;
    }
  }
  if (ws && dtype == DataType::kFloat8E4M3) {
    TP_RETURN_IF_ERROR(TakeScales(*ws, tp, &b));  // the codes keep their scales
  } else if (!ws) {
    float amax = 0.0f;
    for (int64_t i = 0; i < full_rows * full_cols; ++i) {
      float v;
      if (w->dtype == StDtype::kBF16) {
        BFloat16 hv;
        std::memcpy(&hv.bits, w->data + 2 * i, 2);
        v = BFloat16ToFloat(hv);
      } else {
        std::memcpy(&v, w->data + 4 * i, 4);
      }
      if (!std::isfinite(v)) {
        // One inf would make the scale infinite and every code 0 (or NaN).
        return InvalidArgumentError(ck.Where(wname) + " holds a non-finite value (" +
                                    std::to_string(v) + ") at element " + std::to_string(i));
      }
      amax = std::max(amax, std::fabs(v));
    }
    b.scale = ScaleFromAmax(amax, Fp8Format::kE4M3);
  }
  // Static, per tensor; the finer schemes scale their inputs at run time (an input_scale
  // they carry is left unread, and named as such).
  if (b.scheme == Fp8Scheme::kPerTensor && ck.Find(base + ".input_scale") != nullptr) {
    TP_ASSIGN_OR_RETURN(const TensorView* in, ck.Get(base + ".input_scale"));
    TP_ASSIGN_OR_RETURN(b.input_scale, ReadInputScale(*in, ck.Where(base + ".input_scale")));
    b.has_input_scale = true;
  }
  return b;
}

// The embedding, final norm and LM head of rank `rank` (w.tp, w.rank and
// w.dtype set; no layers).
StatusOr<RankWeights> ShardGlobals(const Checkpoint& ck, const ModelConfig& c, DataType dtype,
                                   int tp, int rank) {
  TP_RETURN_IF_ERROR(c.ValidateForTp(tp));
  if (rank < 0 || rank >= tp) {
    return InvalidArgumentError("rank " + std::to_string(rank) +
                                " outside tp=" + std::to_string(tp));
  }
  const int64_t h = c.hidden_size, v = c.vocab_size, v_l = v / tp;
  RankWeights w;
  w.tp = tp;
  w.rank = rank;
  w.dtype = dtype;
  TP_ASSIGN_OR_RETURN(const TensorView* embed, ck.Get("model.embed_tokens.weight"));
  TP_ASSIGN_OR_RETURN(w.embed, ToFloats(ck, *embed, {v, h}));
  TP_ASSIGN_OR_RETURN(const TensorView* norm, ck.Get("model.norm.weight"));
  TP_ASSIGN_OR_RETURN(w.final_norm, ToFloats(ck, *norm, {h}));
  if (dtype == DataType::kFloat8E4M3 && rank == 0) {
    // A BF16 checkpoint (or an FP8 one without calibration) gives no input
    // scales: those layers' FP8 inputs are then scaled per batch from their
    // amax (LinearWeight::dynamic_input). Said once, by rank 0.
    int64_t missing = 0, linear = 0;
    for (const auto& [name, view] : ck.views()) {
      if (!name.ends_with("_proj.weight")) continue;
      ++linear;
      const std::string base = name.substr(0, name.size() - std::string_view(".weight").size());
      // Per-channel and block weights scale their inputs per token / group by design.
      const TensorView* ws = ck.Find(base + ".weight_scale");
      if (ck.Find(base + ".weight_scale_inv") != nullptr || (ws != nullptr && ws->numel() > 1)) {
        --linear;
        continue;
      }
      if (ck.Find(base + ".input_scale") == nullptr) ++missing;
    }
    if (missing > 0) {
      spdlog::info(
          "{}: {} of {} linear layers have no input_scale: their FP8 inputs are scaled per "
          "batch from their absolute maximum (dynamic scaling: one more pass over each such "
          "input, and one float exchanged between the ranks)",
          ck.source(), missing, linear);
    }
  }
  // Tied embeddings (config.json's tie_word_embeddings): the embedding table
  // is the LM head, as in HF. Untied, lm_head.weight must be there.
  if (!c.tie_word_embeddings && !ck.Find("lm_head.weight")) {
    return NotFoundError(ck.Where("lm_head.weight") +
                         " is missing (config.json's tie_word_embeddings is false; a model "
                         "whose LM head is its embedding table sets it true)");
  }
  const std::string head = c.tie_word_embeddings ? "model.embed_tokens" : "lm_head";
  TP_ASSIGN_OR_RETURN(LinearPart lm, ReadBlock(ck, head, v, h, rank * v_l, (rank + 1) * v_l, 0, h,
                                               DataType::kBFloat16, tp));
  TP_ASSIGN_OR_RETURN(w.lm_head, FuseParts({lm}, DataType::kBFloat16, tp));
  return w;
}

// Block i's weights of rank `rank` (ck holds at least that block).
StatusOr<LayerWeights> ShardLayer(const Checkpoint& ck, const ModelConfig& c, DataType dtype,
                                  int tp, int rank, int64_t i) {
  const int64_t h = c.hidden_size, hd = c.head_dim(), nh = c.num_attention_heads,
                nkv = c.num_key_value_heads, inter = c.intermediate_size;
  const int64_t nh_l = nh / tp, nkv_l = nkv / tp, inter_l = inter / tp;
  const std::string p = HfLayerPrefix(i);
  LayerWeights l;
  TP_ASSIGN_OR_RETURN(const TensorView* in_norm, ck.Get(p + ".input_layernorm.weight"));
  TP_ASSIGN_OR_RETURN(l.input_norm, ToFloats(ck, *in_norm, {h}));
  TP_ASSIGN_OR_RETURN(const TensorView* post, ck.Get(p + ".post_attention_layernorm.weight"));
  TP_ASSIGN_OR_RETURN(l.post_norm, ToFloats(ck, *post, {h}));
  // Rows [r0, r1) and columns [c0, c1) of the [rows, cols] weight `name`.
  auto read = [&](const char* name, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                  int64_t c1) {
    return ReadBlock(ck, p + name, rows, cols, r0, r1, c0, c1, dtype, tp);
  };
  const int64_t q0 = rank * nh_l * hd, q1 = q0 + nh_l * hd;
  const int64_t kv0 = rank * nkv_l * hd, kv1 = kv0 + nkv_l * hd;
  const int64_t i0 = rank * inter_l, i1 = i0 + inter_l;
  TP_ASSIGN_OR_RETURN(LinearPart q, read(".self_attn.q_proj", nh * hd, h, q0, q1, 0, h));
  TP_ASSIGN_OR_RETURN(LinearPart kk, read(".self_attn.k_proj", nkv * hd, h, kv0, kv1, 0, h));
  TP_ASSIGN_OR_RETURN(LinearPart vv, read(".self_attn.v_proj", nkv * hd, h, kv0, kv1, 0, h));
  TP_ASSIGN_OR_RETURN(l.qkv, FuseParts({q, kk, vv}, dtype, tp));
  TP_ASSIGN_OR_RETURN(LinearPart o, read(".self_attn.o_proj", h, nh * hd, 0, h, q0, q1));
  TP_ASSIGN_OR_RETURN(l.o, FuseParts({o}, dtype, tp));
  TP_ASSIGN_OR_RETURN(LinearPart gate, read(".mlp.gate_proj", inter, h, i0, i1, 0, h));
  TP_ASSIGN_OR_RETURN(LinearPart up, read(".mlp.up_proj", inter, h, i0, i1, 0, h));
  TP_ASSIGN_OR_RETURN(l.gate_up, FuseParts({gate, up}, dtype, tp));
  TP_ASSIGN_OR_RETURN(LinearPart down, read(".mlp.down_proj", h, inter, 0, h, i0, i1));
  TP_ASSIGN_OR_RETURN(l.down, FuseParts({down}, dtype, tp));
  TP_ASSIGN_OR_RETURN(l.kv_scales,
                      ReadKvScales([&](const std::string& n) { return ck.Find(n); },
                                   [&](const std::string& n) { return ck.Where(n); }, p));
  return l;
}

StatusOr<RankWeights> Shard(const Checkpoint& ck, const ModelConfig& c, DataType dtype, int tp,
                            int rank) {
  TP_ASSIGN_OR_RETURN(RankWeights w, ShardGlobals(ck, c, dtype, tp, rank));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    TP_ASSIGN_OR_RETURN(LayerWeights l, ShardLayer(ck, c, dtype, tp, rank, i));
    w.layers.push_back(std::move(l));
  }
  return w;
}

uint64_t Mix(uint64_t seed, const std::string& name) {
  uint64_t hsh = seed ^ 0x9E3779B97F4A7C15ull;
  for (unsigned char ch : name) hsh = (hsh ^ ch) * 0x100000001B3ull;
  return hsh;
}

// Progress of long work over a model's layers: at most one line per kProgressEveryS seconds,
// so a model made in seconds prints nothing.
class LayerProgress {
 public:
  static constexpr double kProgressEveryS = 5;
  // `what` is null: silent.
  LayerProgress(const char* what, int64_t layers) : what_(what), layers_(layers) {}
  void LayerDone(int64_t done) {
    if (what_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last_).count() < kProgressEveryS) return;
    last_ = now;
    spdlog::info("{}: {} of {} layers ({:.0f} s)", what_, done, layers_,
                 std::chrono::duration<double>(now - start_).count());
  }

 private:
  const char* what_;
  int64_t layers_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_ = start_;
};

// The global (not per-block) tensors of a random checkpoint: bits of
// RandomPart::globals.
enum RandomGlobal : unsigned {
  kEmbedding = 1,  // model.embed_tokens.weight
  kFinalNorm = 2,  // model.norm.weight
  kLmHead = 4,     // lm_head.weight
  kAllGlobals = kEmbedding | kFinalNorm | kLmHead,
};

// Which tensors of a random checkpoint to make: some of the global ones, and
// every tensor of blocks [first_layer, end_layer).
struct RandomPart {
  unsigned globals = 0;  // RandomGlobal bits
  int64_t first_layer = 0, end_layer = 0;
};

std::map<std::string, std::string> RandomCheckpointMetadata() {
  return {{"format", "pt"}, {"producer", "tpserve make-checkpoint"}};
}

// Random checkpoint tensors (HF names, ModelOpt FP8 layout) of `part`. Each
// tensor's values depend only on the seed and its name, so any split into
// parts gives the same tensors. Without `values`: only their names, dtypes
// and shapes (views without data), what a streaming writer declares first.
Checkpoint MakeRandomCheckpoint(const ModelConfig& c, DataType dtype, uint64_t seed,
                                const RandomPart& part, Fp8Scheme scheme, bool values = true) {
  Checkpoint ck;
  const int64_t h = c.hidden_size, hd = c.head_dim();
  auto numel = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  };
  // `count` N(0, sd) values of the stream `stream` (a name), each to put(i, x).
  auto draw = [&](const std::string& stream, int64_t count, float sd, auto&& put) {
    std::mt19937_64 rng(Mix(seed, stream));
    std::normal_distribution<float> dist(0.0f, sd);
    for (int64_t i = 0; i < count; ++i) put(i, dist(rng));
  };
  // `make` returns the tensor's bytes; it runs only when making values.
  auto add = [&](const std::string& name, StDtype st, std::vector<int64_t> shape, auto&& make) {
    if (values) {
      ck.AddOwned(name, st, std::move(shape), make());
    } else {
      ck.AddShape(name, st, std::move(shape));
    }
  };
  auto f32 = [&](const std::string& name, std::vector<int64_t> shape, float value) {
    const int64_t n = numel(shape);
    add(name, StDtype::kF32, std::move(shape), [&] {
      std::vector<uint8_t> bytes(n * 4);
      for (int64_t i = 0; i < n; ++i) std::memcpy(bytes.data() + 4 * i, &value, 4);
      return bytes;
    });
  };
  auto f32v = [&](const std::string& name, std::vector<int64_t> shape,
                  const std::vector<float>& v) {
    add(name, StDtype::kF32, std::move(shape), [&] {
      std::vector<uint8_t> bytes(v.size() * 4);
      std::memcpy(bytes.data(), v.data(), bytes.size());
      return bytes;
    });
  };
  // Drawn straight into BF16: an embedding table has no float copy.
  auto bf16 = [&](const std::string& name, std::vector<int64_t> shape, const std::string& stream,
                  float sd) {
    const int64_t n = numel(shape);
    add(name, StDtype::kBF16, std::move(shape), [&] {
      std::vector<uint8_t> bytes(n * 2);
      draw(stream, n, sd, [&](int64_t i, float x) {
        const BFloat16 b = FloatToBFloat16(x);
        std::memcpy(bytes.data() + 2 * i, &b.bits, 2);
      });
      return bytes;
    });
  };
  auto linear = [&](const std::string& base, int64_t rows, int64_t cols) {
    if (dtype != DataType::kFloat8E4M3) {
      bf16(base + ".weight", {rows, cols}, base, 0.02f);
      return;
    }
    // The weight's scales, once its values are made.
    std::vector<float> scales(Fp8WeightScaleCount(scheme, rows, cols));
    add(base + ".weight", StDtype::kF8E4M3, {rows, cols}, [&] {
      std::vector<float> x(rows * cols);
      draw(base, rows * cols, 0.02f, [&](int64_t i, float v) { x[i] = v; });
      std::vector<uint8_t> codes(x.size());
      QuantizeWeightsFp8(scheme, x, rows, cols, codes, scales);
      return codes;
    });
    switch (scheme) {
      case Fp8Scheme::kPerTensor:
        f32(base + ".weight_scale", {}, scales[0]);
        f32(base + ".input_scale", {}, kDefaultInputScale);
        break;
      case Fp8Scheme::kPerChannel:
        f32v(base + ".weight_scale", {rows, 1}, scales);
        break;
      case Fp8Scheme::kBlock:
        f32v(base + ".weight_scale_inv", {Fp8BlockCount(rows), Fp8BlockCount(cols)}, scales);
        break;
    }
  };
  if (part.globals & kEmbedding) {
    bf16("model.embed_tokens.weight", {c.vocab_size, h}, "embed", 1.0f);
  }
  if (part.globals & kFinalNorm) f32("model.norm.weight", {h}, 1.0f);
  if (part.globals & kLmHead) bf16("lm_head.weight", {c.vocab_size, h}, "lm_head", 0.02f);
  for (int64_t i = part.first_layer; i < part.end_layer; ++i) {
    const std::string p = HfLayerPrefix(i);
    f32(p + ".input_layernorm.weight", {h}, 1.0f);
    f32(p + ".post_attention_layernorm.weight", {h}, 1.0f);
    linear(p + ".self_attn.q_proj", c.num_attention_heads * hd, h);
    linear(p + ".self_attn.k_proj", c.num_key_value_heads * hd, h);
    linear(p + ".self_attn.v_proj", c.num_key_value_heads * hd, h);
    linear(p + ".self_attn.o_proj", h, c.num_attention_heads * hd);
    linear(p + ".mlp.gate_proj", c.intermediate_size, h);
    linear(p + ".mlp.up_proj", c.intermediate_size, h);
    linear(p + ".mlp.down_proj", h, c.intermediate_size);
  }
  return ck;
}

}  // namespace

std::string HfLayerPrefix(int64_t layer) { return "model.layers." + std::to_string(layer); }

StatusOr<RankWeights> MakeRandomRankWeights(const ModelConfig& config, DataType dtype, int tp,
                                            int rank, uint64_t seed) {
  TP_RETURN_IF_ERROR(config.ValidateForTp(tp));
  // Minutes for a large model on the host: rank 0 says how far it is.
  LayerProgress progress(rank == 0 ? "random weights" : nullptr, config.num_hidden_layers);
  // One block at a time: the host holds this rank's shard and one full
  // block, not the whole model (tp ranks as threads would hold tp copies).
  TP_ASSIGN_OR_RETURN(RankWeights w,
                      ShardGlobals(MakeRandomCheckpoint(config, dtype, seed, {kAllGlobals, 0, 0},
                                                        Fp8Scheme::kPerTensor),
                                   config, dtype, tp, rank));
  progress.LayerDone(0);  // the embedding and the LM head
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    TP_ASSIGN_OR_RETURN(
        LayerWeights l,
        ShardLayer(MakeRandomCheckpoint(config, dtype, seed, {0, i, i + 1}, Fp8Scheme::kPerTensor),
                   config, dtype, tp, rank, i));
    w.layers.push_back(std::move(l));
    progress.LayerDone(i + 1);
  }
  return w;
}

Status WriteRandomCheckpoint(const ModelConfig& config, DataType dtype, uint64_t seed,
                             const std::string& dir, Fp8Scheme scheme) {
  TP_RETURN_IF_ERROR(config.Validate());
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return UnavailableError("cannot create directory " + dir + ": " + ec.message());

  // Made one part at a time: each global tensor alone (an embedding table
  // is larger than a block), and each block.
  std::vector<RandomPart> parts = {{kEmbedding}, {kFinalNorm}, {kLmHead}};
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) parts.push_back({0, i, i + 1});
  // Every tensor and its part, by name: the file order of the whole model
  // made in memory (WriteRandomSafetensorsInMemory), which the file keeps.
  struct Planned {
    StDtype dtype = StDtype::kF32;
    std::vector<int64_t> shape;
    size_t part = 0;  // index into `parts`
  };
  std::map<std::string, Planned> plan;
  std::vector<size_t> unwritten(parts.size(), 0);  // tensors of each part
  for (size_t p = 0; p < parts.size(); ++p) {
    const Checkpoint shapes = MakeRandomCheckpoint(config, dtype, seed, parts[p], scheme, false);
    for (const auto& [name, v] : shapes.views()) {
      plan[name] = {v.dtype, v.shape, p};
      ++unwritten[p];
    }
  }
  std::vector<TensorSpec> specs;
  specs.reserve(plan.size());
  for (const auto& [name, t] : plan) specs.push_back({name, t.dtype, t.shape});
  TP_ASSIGN_OR_RETURN(SafetensorsStreamWriter out,
                      SafetensorsStreamWriter::Create(dir + "/model.safetensors", std::move(specs),
                                                      RandomCheckpointMetadata()));

  // In name order a part's tensors are contiguous (a block's share the
  // prefix "model.layers.<i>."; blocks come as their names sort: 0, 1, 10,
  // ..., 2, ...), so each part is made once, when its first tensor is due,
  // and only that part is in memory.
  LayerProgress progress("make-checkpoint", config.num_hidden_layers);
  std::optional<Checkpoint> made;
  size_t made_part = parts.size();
  int64_t blocks = 0;
  for (const auto& [name, t] : plan) {
    if (t.part != made_part) {
      made.reset();  // before making the next part
      made.emplace(MakeRandomCheckpoint(config, dtype, seed, parts[t.part], scheme));
      made_part = t.part;
    }
    TP_ASSIGN_OR_RETURN(const TensorView* v, made->Get(name));
    TP_RETURN_IF_ERROR(out.Write(name, v->data, v->bytes));
    if (--unwritten[t.part] == 0) {
      if (parts[t.part].end_layer > parts[t.part].first_layer) ++blocks;
      progress.LayerDone(blocks);
    }
  }
  TP_RETURN_IF_ERROR(out.Finish());
  std::ofstream json(dir + "/config.json");
  if (dtype == DataType::kFloat8E4M3 && scheme != Fp8Scheme::kPerTensor) {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(ModelConfigToJson(config));
    j["quantization_config"] = nlohmann::ordered_json::parse(Fp8QuantConfigJson(scheme));
    json << j.dump(2) << "\n";
  } else {
    json << ModelConfigToJson(config) << "\n";
  }
  json.close();  // a failure to flush shows here, not in the destructor
  if (!json) return UnavailableError("cannot write " + dir + "/config.json");
  return Status::Ok();
}

Status WriteRandomSafetensorsInMemory(const ModelConfig& config, DataType dtype, uint64_t seed,
                                      const std::string& path, Fp8Scheme scheme) {
  TP_RETURN_IF_ERROR(config.Validate());
  const Checkpoint ck =
      MakeRandomCheckpoint(config, dtype, seed, {kAllGlobals, 0, config.num_hidden_layers}, scheme);
  std::vector<TensorToWrite> tensors;
  for (const auto& [name, v] : ck.views()) {
    tensors.push_back({name, v.dtype, v.shape, v.data, v.bytes});
  }
  return WriteSafetensors(path, tensors, RandomCheckpointMetadata());
}

namespace {

// A sharded checkpoint's model.safetensors.index.json (HuggingFace's weight_map: tensor name
// -> file), if there is one: every file it lists must be in `dir`, so that a shard left out
// of a download is named as such rather than as the first tensor found missing. The files are
// still read by listing the directory (the index is not needed to load).
Status CheckShardIndex(const std::string& dir) {
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  if (!fs::exists(index, ec)) return Status::Ok();
  std::ifstream in(index);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  const auto map = j.is_object() ? j.find("weight_map") : j.end();
  if (!j.is_object() || map == j.end() || !map->is_object()) {
    return InvalidArgumentError(index.string() +
                                ": not a shard index (a JSON object with a weight_map object)");
  }
  std::set<std::string> shards;
  for (const auto& [tensor, file] : map->items()) {
    if (!file.is_string()) {
      return InvalidArgumentError(index.string() + ": weight_map[\"" + tensor +
                                  "\"] is not a file name");
    }
    shards.insert(file.get<std::string>());
  }
  std::vector<std::string> missing;
  for (const std::string& shard : shards) {
    if (!fs::exists(fs::path(dir) / shard, ec)) missing.push_back(shard);
  }
  if (missing.empty()) return Status::Ok();
  std::string names;
  for (size_t i = 0; i < missing.size() && i < 4; ++i) names += (i ? ", " : "") + missing[i];
  return NotFoundError(index.string() + " lists " + std::to_string(missing.size()) + " of " +
                       std::to_string(shards.size()) + " shard file(s) that are not in " + dir +
                       ": " + names + (missing.size() > 4 ? ", ..." : ""));
}

}  // namespace

StatusOr<RankWeights> LoadRankWeights(const std::string& dir, const ModelConfig& config, int tp,
                                      int rank, DataType dtype) {
  if (dtype != DataType::kFloat8E4M3 && dtype != DataType::kBFloat16) {
    return InvalidArgumentError("model directory " + dir + ": weights can load as fp8_e4m3 or " +
                                "bf16, not " + std::string(DataTypeName(dtype)));
  }
  Checkpoint ck;
  ck.set_source(dir);
  TP_ASSIGN_OR_RETURN(Fp8QuantConfig quant, ReadFp8QuantConfig(dir + "/config.json"));
  if (quant.static_activations && quant.weights && *quant.weights != Fp8Scheme::kPerTensor) {
    ck.Note(quant.where + ": static input activation scales with " + Fp8SchemeName(*quant.weights) +
            " weight scales; their inputs are scaled at run time instead (per token / per 1x128 "
            "group), as the GEMM takes them with such weights");
  }
  ck.set_quant(std::move(quant));
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  if (ec) return NotFoundError("model directory " + dir + ": " + ec.message());
  if (files.empty()) return NotFoundError("model directory " + dir + ": no *.safetensors files");
  TP_RETURN_IF_ERROR(CheckShardIndex(dir));
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    TP_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(f));
    TP_RETURN_IF_ERROR(ck.AddFile(std::move(file)));
  }
  TP_ASSIGN_OR_RETURN(RankWeights w, Shard(ck, config, dtype, tp, rank));
  TP_RETURN_IF_ERROR(CheckUnused(ck, config, rank));
  return w;
}

Status ValidateRankWeights(const ModelConfig& c, const RankWeights& w, int tp, int rank) {
  TP_RETURN_IF_ERROR(c.ValidateForTp(tp));
  if (w.tp != tp || w.rank != rank) {
    return InvalidArgumentError("weights are rank " + std::to_string(w.rank) + " of " +
                                std::to_string(w.tp) + ", expected rank " + std::to_string(rank) +
                                " of " + std::to_string(tp));
  }
  if (w.dtype != DataType::kFloat8E4M3 && w.dtype != DataType::kBFloat16) {
    return InvalidArgumentError("weights: the TP layers must be fp8_e4m3 or bf16, got " +
                                std::string(DataTypeName(w.dtype)));
  }
  const int64_t h = c.hidden_size, v = c.vocab_size;
  auto floats = [&](const std::string& name, const std::vector<float>& t, int64_t want) {
    if (static_cast<int64_t>(t.size()) == want) return Status::Ok();
    return InvalidArgumentError("weights: " + name + " has " + std::to_string(t.size()) +
                                " values, the config implies " + std::to_string(want));
  };
  auto linear = [&](const std::string& name, const LinearWeight& lw, DataType dtype, int64_t n,
                    int64_t k) {
    if (lw.dtype != dtype || lw.n != n || lw.k != k ||
        lw.data.size() != static_cast<size_t>(n * k) * DataTypeSize(dtype)) {
      return InvalidArgumentError(
          "weights: " + name + " is " + std::string(DataTypeName(lw.dtype)) + " [" +
          std::to_string(lw.n) + ", " + std::to_string(lw.k) + "] with " +
          std::to_string(lw.data.size()) + " bytes; rank " + std::to_string(rank) + " of " +
          std::to_string(tp) + " needs " + std::string(DataTypeName(dtype)) + " [" +
          std::to_string(n) + ", " + std::to_string(k) + "]");
    }
    const int64_t scales = Fp8WeightScaleCount(lw.scheme, n, k);
    if (lw.dtype == DataType::kFloat8E4M3 && lw.scheme != Fp8Scheme::kPerTensor &&
        static_cast<int64_t>(lw.weight_scales.size()) != scales) {
      return InvalidArgumentError("weights: " + name + " has " +
                                  std::to_string(lw.weight_scales.size()) + " " +
                                  Fp8SchemeName(lw.scheme) + " scales, [" + std::to_string(n) +
                                  ", " + std::to_string(k) + "] needs " + std::to_string(scales));
    }
    return Status::Ok();
  };
  TP_RETURN_IF_ERROR(floats("embed", w.embed, v * h));
  TP_RETURN_IF_ERROR(floats("final_norm", w.final_norm, h));
  TP_RETURN_IF_ERROR(linear("lm_head", w.lm_head, DataType::kBFloat16, v / tp, h));
  if (static_cast<int64_t>(w.layers.size()) != c.num_hidden_layers) {
    return InvalidArgumentError("weights have " + std::to_string(w.layers.size()) +
                                " layers, the config " + std::to_string(c.num_hidden_layers));
  }
  const auto shapes = TpLayerShapes(c);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = "layers." + std::to_string(i);
    TP_RETURN_IF_ERROR(floats(p + ".input_norm", l.input_norm, h));
    TP_RETURN_IF_ERROR(floats(p + ".post_norm", l.post_norm, h));
    TP_RETURN_IF_ERROR(CheckKvScales(l.kv_scales, "weights: " + p));
    const LinearWeight* in_block_order[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (const TpLayerShape& s : shapes) {
      TP_RETURN_IF_ERROR(linear(s.Name(static_cast<int64_t>(i)), *in_block_order[s.index], w.dtype,
                                s.local_n(tp), s.local_k(tp)));
    }
  }
  return Status::Ok();
}

}  // namespace tpserve
