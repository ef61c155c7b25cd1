#include "engine/fp8_checkpoint_scales.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

namespace tpserve {
namespace {

using Json = nlohmann::json;

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string t;
  for (int64_t d : shape) t += (t.empty() ? "" : ",") + std::to_string(d);
  return "[" + t + "]";
}

// Every value of an F32/BF16 scale tensor, each a positive finite number.
StatusOr<std::vector<float>> ScaleValues(const TensorView& v, const std::string& where) {
  if (v.dtype != StDtype::kF32 && v.dtype != StDtype::kBF16) {
    return InvalidArgumentError(where + " has dtype " + std::string(StDtypeName(v.dtype)) +
                                " (F32 or BF16)");
  }
  std::vector<float> values(v.numel());
  for (int64_t i = 0; i < v.numel(); ++i) {
    if (v.dtype == StDtype::kF32) {
      std::memcpy(&values[i], v.data + 4 * i, 4);
    } else {
      BFloat16 h;
      std::memcpy(&h.bits, v.data + 2 * i, 2);
      values[i] = BFloat16ToFloat(h);
    }
    if (!(values[i] > 0) || !std::isfinite(values[i])) {
      return InvalidArgumentError(where + " must hold positive finite scales, got " +
                                  std::to_string(values[i]) + " at element " + std::to_string(i));
    }
  }
  return values;
}

// UNIMPLEMENTED unless `block` (a JSON [rows, cols]) is [128, 128].
Status CheckBlockSize(const Json& block, const std::string& where) {
  if (block == Json::array({kFp8BlockSize, kFp8BlockSize})) return Status::Ok();
  return UnimplementedError(where + " is " + block.dump() + ": block-wise FP8 scales are read " +
                            "for 128x128 blocks only");
}

// compressed-tensors: the weights' strategy of every config group, if they agree.
StatusOr<std::optional<Fp8Scheme>> CompressedTensorsScheme(const Json& q, const std::string& at) {
  const auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object()) return std::optional<Fp8Scheme>();
  std::set<Fp8Scheme> found;
  for (const auto& [name, group] : groups->items()) {
    const auto w = group.is_object() ? group.find("weights") : group.end();
    if (w == group.end() || !w->is_object() || !w->contains("strategy")) continue;
    const std::string key = at + ".config_groups." + name + ".weights";
    if (!(*w)["strategy"].is_string()) {
      return InvalidArgumentError(key + ".strategy is not a string");
    }
    const std::string strategy = (*w)["strategy"].get<std::string>();
    const std::optional<Fp8Scheme> s = ParseFp8Scheme(strategy);
    if (!s) {
      return UnimplementedError(key + ".strategy is \"" + strategy +
                                "\" (FP8 weights: tensor, channel or block)");
    }
    if (*s == Fp8Scheme::kBlock) {
      if (!w->contains("block_structure")) {
        return InvalidArgumentError(key + " has strategy block but no block_structure");
      }
      TP_RETURN_IF_ERROR(CheckBlockSize((*w)["block_structure"], key + ".block_structure"));
    }
    found.insert(*s);
  }
  if (found.size() != 1) return std::optional<Fp8Scheme>();
  return std::optional<Fp8Scheme>(*found.begin());
}

// compressed-tensors: some config group's input activations are static (dynamic: false).
bool StaticActivations(const Json& q) {
  const auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object()) return false;
  for (const auto& [name, group] : groups->items()) {
    const auto a = group.is_object() ? group.find("input_activations") : group.end();
    if (a != group.end() && a->is_object() && a->value("dynamic", true) == false) return true;
  }
  return false;
}

StatusOr<std::optional<Fp8Scheme>> DeclaredScheme(const Json& q, const std::string& at) {
  const std::string method = q.value("quant_method", std::string());
  if (q.contains("weight_block_size")) {  // HF fine-grained FP8 (quant_method "fp8")
    TP_RETURN_IF_ERROR(CheckBlockSize(q["weight_block_size"], at + ".weight_block_size"));
    return std::optional<Fp8Scheme>(Fp8Scheme::kBlock);
  }
  if (method == "compressed-tensors") return CompressedTensorsScheme(q, at);
  if (method == "fbgemm_fp8") return std::optional<Fp8Scheme>(Fp8Scheme::kPerChannel);
  // ModelOpt writes quant_algo at the top level of quantization_config or under
  // "quantization" (hf_quant_config.json's spelling).
  const Json* algo_of = &q;
  if (q.contains("quantization") && q["quantization"].is_object()) algo_of = &q["quantization"];
  const std::string algo = algo_of->value("quant_algo", std::string());
  if (algo == "FP8") return std::optional<Fp8Scheme>(Fp8Scheme::kPerTensor);
  if (algo == "FP8_PER_CHANNEL_PER_TOKEN") {
    return std::optional<Fp8Scheme>(Fp8Scheme::kPerChannel);
  }
  if (algo == "FP8_BLOCK_SCALES") return std::optional<Fp8Scheme>(Fp8Scheme::kBlock);
  return std::optional<Fp8Scheme>();
}

// Requantizes `values` [n, k] with the given scales (codes keep when the values came from
// them: code * s / s rounds back to the code).
std::vector<uint8_t> QuantizeWithScales(Fp8Scheme scheme, const std::vector<float>& values,
                                        int64_t n, int64_t k, const std::vector<float>& scales) {
  std::vector<uint8_t> codes(values.size());
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      codes[r * k + c] =
          FloatToFp8E4M3(values[r * k + c] / scales[Fp8WeightScaleIndex(scheme, k, r, c)]);
    }
  }
  return codes;
}

}  // namespace

StatusOr<Fp8QuantConfig> ReadFp8QuantConfig(const std::string& config_json) {
  Fp8QuantConfig out;
  out.where = config_json + ": quantization_config";
  std::error_code ec;
  if (!std::filesystem::exists(config_json, ec)) return out;
  std::ifstream in(config_json);
  const Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgumentError(config_json + ": not a JSON object");
  const auto q = j.find("quantization_config");
  if (q == j.end() || q->is_null()) return out;
  if (!q->is_object()) return InvalidArgumentError(out.where + " is not an object");
  TP_ASSIGN_OR_RETURN(out.weights, DeclaredScheme(*q, "quantization_config"));
  out.static_activations = StaticActivations(*q);
  return out;
}

std::string Fp8QuantConfigJson(Fp8Scheme scheme) {
  Json q;
  switch (scheme) {
    case Fp8Scheme::kPerTensor:
      return "";
    case Fp8Scheme::kPerChannel: {
      const Json fp8 = {{"num_bits", 8}, {"type", "float"}, {"symmetric", true}};
      Json weights = fp8, acts = fp8;
      weights["strategy"] = "channel";
      weights["dynamic"] = false;
      acts["strategy"] = "token";
      acts["dynamic"] = true;
      q = {{"quant_method", "compressed-tensors"},
           {"format", "float-quantized"},
           {"config_groups",
            {{"group_0",
              {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", acts}}}}},
           {"ignore", {"lm_head"}}};
      break;
    }
    case Fp8Scheme::kBlock:
      q = {{"quant_method", "fp8"},
           {"fmt", "e4m3"},
           {"activation_scheme", "dynamic"},
           {"weight_block_size", {kFp8BlockSize, kFp8BlockSize}}};
      break;
  }
  return q.dump();
}

StatusOr<WeightScales> ReadWeightScales(const TensorView& v, const std::string& where, bool block,
                                        int64_t rows, int64_t cols,
                                        const Fp8QuantConfig& declared) {
  WeightScales ws;
  ws.rows = rows;
  ws.cols = cols;
  const std::vector<int64_t>& sh = v.shape;
  if (block) {
    ws.scheme = Fp8Scheme::kBlock;
    const std::vector<int64_t> grid{Fp8BlockCount(rows), Fp8BlockCount(cols)};
    if (sh != grid) {
      return InvalidArgumentError(where + " has shape " + ShapeText(sh) + ": block scales of a [" +
                                  std::to_string(rows) + "," + std::to_string(cols) +
                                  "] weight in 128x128 blocks are " + ShapeText(grid));
    }
  } else if (sh.empty() || sh == std::vector<int64_t>{1}) {
    ws.scheme = Fp8Scheme::kPerTensor;
  } else if (sh == std::vector<int64_t>{rows} || sh == std::vector<int64_t>{rows, 1}) {
    ws.scheme = Fp8Scheme::kPerChannel;
  } else {
    return InvalidArgumentError(where + " has shape " + ShapeText(sh) +
                                ": a weight scale is one value ([] or [1]) or one per output "
                                "channel ([" +
                                std::to_string(rows) + "] or [" + std::to_string(rows) + ",1])");
  }
  if (declared.weights && *declared.weights != ws.scheme) {
    return InvalidArgumentError(where + " holds " + Fp8SchemeName(ws.scheme) + " scales (shape " +
                                ShapeText(sh) + "), but " + declared.where + " declares " +
                                Fp8SchemeName(*declared.weights) + " scales");
  }
  TP_ASSIGN_OR_RETURN(ws.values, ScaleValues(v, where));
  return ws;
}

namespace {

// One positive finite scale ([] or [1]); `why` ends the error for any other shape.
StatusOr<float> ReadScalarScale(const TensorView& v, const std::string& where, const char* why) {
  if (!v.shape.empty() && v.shape != std::vector<int64_t>{1}) {
    return InvalidArgumentError(where + " has shape " + ShapeText(v.shape) + ": " + why);
  }
  TP_ASSIGN_OR_RETURN(std::vector<float> values, ScaleValues(v, where));
  return values.front();
}

}  // namespace

StatusOr<float> ReadInputScale(const TensorView& v, const std::string& where) {
  return ReadScalarScale(v, where,
                         "an input scale is one value ([] or [1]); activations are scaled per "
                         "tensor");
}

StatusOr<float> ReadKvCacheScale(const TensorView& v, const std::string& where) {
  return ReadScalarScale(v, where,
                         "a KV cache scale is one value ([] or [1]) for all of the layer's heads");
}

StatusOr<KvScales> ReadKvScales(const std::function<const TensorView*(const std::string&)>& find,
                                const std::function<std::string(const std::string&)>& where,
                                const std::string& layer_prefix) {
  KvScales out;
  const std::string p = layer_prefix + ".self_attn.";
  for (int kv = 0; kv < 2; ++kv) {
    const std::string x = kv == 0 ? "k" : "v";
    const std::string names[] = {p + x + "_scale", p + x + "_proj." + x + "_scale", p + "kv_scale"};
    const std::string* found = nullptr;
    for (const std::string& name : names) {
      if (find(name) == nullptr) continue;
      if (found != nullptr) {
        return InvalidArgumentError(where(name) + " and " + where(*found) +
                                    " both scale the layer's cached " +
                                    (kv == 0 ? "keys" : "values") + "; keep one");
      }
      found = &name;
    }
    if (found == nullptr) continue;
    TP_ASSIGN_OR_RETURN((kv == 0 ? out.k : out.v), ReadKvCacheScale(*find(*found), where(*found)));
  }
  return out;
}

Status TakeScales(const WeightScales& ws, int tp, LinearPart* part) {
  part->scheme = ws.scheme;
  part->scale = *std::max_element(ws.values.begin(), ws.values.end());
  part->scales.clear();
  if (ws.scheme == Fp8Scheme::kPerChannel) {
    part->scales.assign(ws.values.begin() + part->row_begin,
                        ws.values.begin() + part->row_begin + part->rows);
  } else if (ws.scheme == Fp8Scheme::kBlock) {
    const int64_t row_end = part->row_begin + part->rows, col_end = part->col_begin + part->cols;
    auto on_edge = [](int64_t at, int64_t full) { return at % kFp8BlockSize == 0 || at == full; };
    if (part->row_begin % kFp8BlockSize != 0 || part->col_begin % kFp8BlockSize != 0 ||
        !on_edge(row_end, ws.rows) || !on_edge(col_end, ws.cols)) {
      return InvalidArgumentError(
          part->where + ": at tp=" + std::to_string(tp) + " a rank takes rows [" +
          std::to_string(part->row_begin) + ", " + std::to_string(row_end) + ") and columns [" +
          std::to_string(part->col_begin) + ", " + std::to_string(col_end) +
          ") of the weight, which split its 128x128 scale blocks; block-wise FP8 needs every "
          "rank's share on 128 boundaries (choose a tp that divides the blocks)");
    }
    const int64_t kb = Fp8BlockCount(ws.cols);
    for (int64_t br = part->row_begin / kFp8BlockSize; br < Fp8BlockCount(row_end); ++br) {
      for (int64_t bc = part->col_begin / kFp8BlockSize; bc < Fp8BlockCount(col_end); ++bc) {
        part->scales.push_back(ws.values[br * kb + bc]);
      }
    }
  }
  return Status::Ok();
}

StatusOr<LinearWeight> FuseParts(const std::vector<LinearPart>& parts, DataType dtype, int tp) {
  LinearWeight lw;
  lw.dtype = dtype;
  lw.k = parts.front().cols;
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  float scale = 0.0f, input_scale = 0.0f;
  for (const LinearPart& b : parts) {
    lw.n += b.rows;
    scale = std::max(scale, b.scale);
    input_scale = std::max(input_scale, b.input_scale);
    // A part without a static scale (q_proj without, k_proj with, say)
    // makes the fused layer dynamic: no single static scale is known good.
    lw.dynamic_input = lw.dynamic_input || (dtype == DataType::kFloat8E4M3 && !b.has_input_scale);
    scheme = std::max(scheme, b.scheme);  // the enum runs from coarse to fine
  }
  lw.input_scale = input_scale;
  std::vector<float> all;
  all.reserve(lw.n * lw.k);
  for (const LinearPart& b : parts) all.insert(all.end(), b.values.begin(), b.values.end());
  if (dtype != DataType::kFloat8E4M3) {
    lw.data.resize(all.size() * 2);
    for (size_t i = 0; i < all.size(); ++i) {
      const BFloat16 h = FloatToBFloat16(all[i]);
      std::memcpy(lw.data.data() + 2 * i, &h.bits, 2);
    }
    return lw;
  }
  lw.scheme = scheme;
  lw.weight_scale = scale;
  if (scheme == Fp8Scheme::kPerTensor) {
    lw.data.resize(all.size());
    QuantizeFp8(all, lw.weight_scale, Fp8Format::kE4M3, lw.data);
    return lw;
  }
  lw.dynamic_input = true;  // per token or per 1x128 group, computed at run time
  for (size_t p = 0; p < parts.size(); ++p) {
    const LinearPart& b = parts[p];
    if (scheme == Fp8Scheme::kPerChannel) {
      if (b.scheme == Fp8Scheme::kPerTensor) {
        lw.weight_scales.insert(lw.weight_scales.end(), b.rows, b.scale);
      } else {
        lw.weight_scales.insert(lw.weight_scales.end(), b.scales.begin(), b.scales.end());
      }
      continue;
    }
    if (b.scheme != Fp8Scheme::kBlock) {
      return InvalidArgumentError(b.where + " has " + Fp8SchemeName(b.scheme) +
                                  " scales, but it is fused with block-wise " + parts[0].where +
                                  " (fused projections take one scheme)");
    }
    if (p + 1 < parts.size() && b.rows % kFp8BlockSize != 0) {
      return InvalidArgumentError(b.where + ": at tp=" + std::to_string(tp) + " a rank's " +
                                  std::to_string(b.rows) +
                                  " rows of it are not a multiple of 128, so the 128x128 scale "
                                  "blocks of the fused projection it starts would mix tensors");
    }
    lw.weight_scales.insert(lw.weight_scales.end(), b.scales.begin(), b.scales.end());
  }
  lw.data = QuantizeWithScales(scheme, all, lw.n, lw.k, lw.weight_scales);
  return lw;
}

}  // namespace tpserve
