#include "engine/model_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>
#include <set>
#include <sstream>

namespace tpserve {
namespace {

using Json = nlohmann::json;

constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();
constexpr const char* kAllowedModelTypes = "llama";

// Short rendering of a JSON value for error messages.
std::string Render(const Json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

Status WrongType(const std::string& source, const char* key, const char* want, const Json& v) {
  return InvalidArgumentError(source + ": key '" + key + "' must be " + want + ", got " +
                              v.type_name() + " " + Render(v));
}

// Absent and null keys leave *out as it is (null is how HF writes None).
Status ReadInt(const Json& root, const std::string& source, const char* key, bool required,
               int64_t* out) {
  const auto it = root.find(key);
  if (it == root.end()) {
    if (required) return InvalidArgumentError(source + ": missing required key '" + key + "'");
    return Status::Ok();
  }
  if (it->is_null() && !required) return Status::Ok();
  if (!it->is_number_integer()) return WrongType(source, key, "an integer", *it);
  if (it->is_number_unsigned() &&
      it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return InvalidArgumentError(source + ": key '" + key + "' is out of range: " + Render(*it));
  }
  *out = it->get<int64_t>();
  return Status::Ok();
}

Status ReadDouble(const Json& root, const std::string& source, const char* key, double* out) {
  const auto it = root.find(key);
  if (it == root.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return WrongType(source, key, "a number", *it);
  *out = it->get<double>();
  return Status::Ok();
}

Status CheckSize(const ModelConfig& c, const char* field, int64_t value) {
  if (value < 1 || value > kMaxSize) {
    return InvalidArgumentError("model config '" + c.name + "': " + field + " (" +
                                std::to_string(value) + ") must be in [1, " +
                                std::to_string(kMaxSize) + "]");
  }
  return Status::Ok();
}

Status CheckPositive(const ModelConfig& c, const char* field, double value) {
  if (!(value > 0) || !std::isfinite(value)) {
    std::ostringstream s;
    s << "model config '" << c.name << "': " << field << " (" << value
      << ") must be a positive finite number";
    return InvalidArgumentError(s.str());
  }
  return Status::Ok();
}

// RoPE scaling's parameters, as RopeScaling states them; `prefix` starts each message
// ("<source>: rope_scaling." or "model config '<name>': rope_scaling.").
Status CheckRopeScaling(const RopeScaling& r, const std::string& prefix) {
  auto positive = [&](const char* key, double value) -> Status {
    if (!(value > 0) || !std::isfinite(value)) {
      std::ostringstream s;
      s << prefix << key << " (" << value << ") must be a positive finite number";
      return InvalidArgumentError(s.str());
    }
    return Status::Ok();
  };
  if (r.type == RopeType::kDefault) return Status::Ok();
  TP_RETURN_IF_ERROR(positive("factor", r.factor));
  if (r.type != RopeType::kLlama3) return Status::Ok();
  TP_RETURN_IF_ERROR(positive("low_freq_factor", r.low_freq_factor));
  TP_RETURN_IF_ERROR(positive("high_freq_factor", r.high_freq_factor));
  if (!(r.high_freq_factor > r.low_freq_factor)) {
    std::ostringstream s;
    s << prefix << "high_freq_factor (" << r.high_freq_factor
      << ") must be greater than low_freq_factor (" << r.low_freq_factor << ")";
    return InvalidArgumentError(s.str());
  }
  if (r.original_max_position_embeddings < 1) {
    return InvalidArgumentError(prefix + "original_max_position_embeddings (" +
                                std::to_string(r.original_max_position_embeddings) +
                                ") must be >= 1");
  }
  return Status::Ok();
}

// One RoPE object of a config.json: `key` is "rope_scaling" or "rope_parameters" (which
// may hold rope_theta: *theta, when with_theta). Errors name key.<field>.
Status ParseRopeObject(const Json& obj, const std::string& source, const std::string& key,
                       bool with_theta, RopeScaling* out, std::optional<double>* theta) {
  if (!obj.is_object()) return WrongType(source, key.c_str(), "an object", obj);
  auto present = [&](const char* k) {
    const auto it = obj.find(k);
    return it != obj.end() && !it->is_null() ? &*it : nullptr;
  };
  // The kind first: a scaled RoPE of another kind is named as such, not by its first
  // unknown key. Both spellings may be given (transformers 4 kept "type" next to
  // "rope_type"), then they must agree.
  std::string type, type_key;
  for (const char* k : {"rope_type", "type"}) {
    const Json* t = present(k);
    if (t == nullptr) continue;
    const std::string where = key + "." + k;
    if (!t->is_string()) return WrongType(source, where.c_str(), "a string", *t);
    if (!type.empty() && t->get<std::string>() != type) {
      return InvalidArgumentError(source + ": " + type_key + " ('" + type + "') and " + where +
                                  " ('" + t->get<std::string>() + "') disagree");
    }
    if (type.empty()) {
      type = t->get<std::string>();
      type_key = where;
    }
  }
  if (type.empty()) {
    // transformers 5 leaves a plain RoPE's rope_type out; rope_scaling without one means
    // nothing HF would accept.
    if (!with_theta)
      return InvalidArgumentError(source + ": missing required key '" + key + ".rope_type'");
    type = "default";
  }
  std::vector<std::string> reads;  // the type's parameters
  if (type == "default") {
    out->type = RopeType::kDefault;
  } else if (type == "linear") {
    out->type = RopeType::kLinear;
    reads = {"factor"};
  } else if (type == "llama3") {
    out->type = RopeType::kLlama3;
    reads = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
  } else {
    return UnimplementedError(source + ": " + type_key + " is '" + type +
                              "': that RoPE scaling is not implemented (implemented: default, "
                              "linear, llama3)");
  }
  for (const auto& [k, value] : obj.items()) {
    if (value.is_null() || k == "rope_type" || k == "type") continue;
    if (k == "rope_theta" && with_theta) continue;
    if (std::find(reads.begin(), reads.end(), k) != reads.end()) continue;
    std::string allowed = "rope_type";
    if (with_theta) allowed += ", rope_theta";
    for (const std::string& r : reads) allowed += ", " + r;
    return UnimplementedError(source + ": key '" + key + "." + k + "' (" + Render(value) +
                              ") is not supported with rope_type '" + type +
                              "' (reads: " + allowed + ")");
  }
  if (with_theta) {
    if (const Json* t = present("rope_theta")) {
      const std::string where = key + ".rope_theta";
      if (!t->is_number()) return WrongType(source, where.c_str(), "a number", *t);
      *theta = t->get<double>();
    }
  }
  for (const std::string& k : reads) {
    const std::string where = key + "." + k;
    const Json* v = present(k.c_str());
    if (v == nullptr) {
      return InvalidArgumentError(source + ": missing required key '" + where + "' (rope_type '" +
                                  type + "')");
    }
    if (k == "original_max_position_embeddings") {
      if (!v->is_number_integer()) return WrongType(source, where.c_str(), "an integer", *v);
      if (v->is_number_unsigned() &&
          v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return InvalidArgumentError(source + ": key '" + where +
                                    "' is out of range: " + Render(*v));
      }
      out->original_max_position_embeddings = v->get<int64_t>();
      continue;
    }
    if (!v->is_number()) return WrongType(source, where.c_str(), "a number", *v);
    const double d = v->get<double>();
    if (k == "factor") out->factor = d;
    if (k == "low_freq_factor") out->low_freq_factor = d;
    if (k == "high_freq_factor") out->high_freq_factor = d;
  }
  return CheckRopeScaling(*out, source + ": " + key + ".");
}

Status CheckTpDivides(const ModelConfig& c, const char* field, int64_t value, int tp,
                      std::string_view why = {}) {
  if (value % tp != 0) {
    std::string m = "model config '" + c.name + "': " + field + " (" + std::to_string(value) +
                    ") is not divisible by tp (" + std::to_string(tp) + ")";
    if (!why.empty()) {
      m += ": ";
      m += why;
    }
    return InvalidArgumentError(std::move(m));
  }
  return Status::Ok();
}

ModelConfig MakePreset(std::string name, int64_t hidden, int64_t inter, int64_t heads,
                       int64_t kv_heads, int64_t layers, int64_t vocab, int64_t max_pos,
                       double theta) {
  ModelConfig c;
  c.name = std::move(name);
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.num_hidden_layers = layers;
  c.vocab_size = vocab;
  c.max_position_embeddings = max_pos;
  c.rope_theta = theta;
  c.rms_norm_eps = 1e-5;
  return c;
}

const std::vector<ModelConfig>& Presets() {
  static const std::vector<ModelConfig> presets = {
      MakePreset("tiny", 512, 512, 8, 4, 2, 1024, 2048, 10000.0),
      MakePreset("llama3-8b", 4096, 14336, 32, 8, 32, 128256, 8192, 500000.0),
      MakePreset("llama3-70b", 8192, 28672, 64, 8, 80, 128256, 8192, 500000.0),
  };
  return presets;
}

}  // namespace

const char* RopeTypeName(RopeType type) {
  switch (type) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kLlama3:
      return "llama3";
  }
  return "?";
}

std::vector<double> RopeInverseFrequencies(double theta, int64_t head_dim,
                                           const RopeScaling& scaling) {
  const int64_t half = head_dim / 2;
  std::vector<double> inv(static_cast<size_t>(std::max<int64_t>(half, 0)));
  for (int64_t i = 0; i < half; ++i) {
    inv[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  }
  if (scaling.type == RopeType::kLinear) {
    for (double& f : inv) f /= scaling.factor;
  } else if (scaling.type == RopeType::kLlama3) {
    const double original = static_cast<double>(scaling.original_max_position_embeddings);
    const double low_wavelen = original / scaling.low_freq_factor;    // longer: scaled
    const double high_wavelen = original / scaling.high_freq_factor;  // shorter: kept
    for (double& f : inv) {
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f /= scaling.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (original / wavelen - scaling.low_freq_factor) /
                              (scaling.high_freq_factor - scaling.low_freq_factor);
        f = (1.0 - smooth) * f / scaling.factor + smooth * f;
      }
    }
  }
  return inv;
}

std::vector<double> RopeInverseFrequencies(const ModelConfig& config) {
  return RopeInverseFrequencies(config.rope_theta, config.head_dim(), config.rope_scaling);
}

int64_t ModelConfig::head_dim() const {
  if (head_dim_override > 0) return head_dim_override;
  return num_attention_heads > 0 ? hidden_size / num_attention_heads : 0;
}

Status ModelConfig::Validate() const {
  TP_RETURN_IF_ERROR(CheckSize(*this, "hidden_size", hidden_size));
  TP_RETURN_IF_ERROR(CheckSize(*this, "intermediate_size", intermediate_size));
  TP_RETURN_IF_ERROR(CheckSize(*this, "num_attention_heads", num_attention_heads));
  TP_RETURN_IF_ERROR(CheckSize(*this, "num_key_value_heads", num_key_value_heads));
  TP_RETURN_IF_ERROR(CheckSize(*this, "num_hidden_layers", num_hidden_layers));
  TP_RETURN_IF_ERROR(CheckSize(*this, "vocab_size", vocab_size));
  TP_RETURN_IF_ERROR(CheckSize(*this, "max_position_embeddings", max_position_embeddings));
  TP_RETURN_IF_ERROR(CheckPositive(*this, "rms_norm_eps", rms_norm_eps));
  TP_RETURN_IF_ERROR(CheckPositive(*this, "rope_theta", rope_theta));
  const std::string prefix = "model config '" + name + "': ";
  TP_RETURN_IF_ERROR(CheckRopeScaling(rope_scaling, prefix + "rope_scaling."));
  if (head_dim_override < 0 || head_dim_override > kMaxSize) {
    return InvalidArgumentError(prefix + "head_dim (" + std::to_string(head_dim_override) +
                                ") must be in [1, " + std::to_string(kMaxSize) +
                                "], or 0 for hidden_size / num_attention_heads");
  }
  if (head_dim_override == 0 && hidden_size % num_attention_heads != 0) {
    return InvalidArgumentError(prefix + "num_attention_heads (" +
                                std::to_string(num_attention_heads) +
                                ") does not divide hidden_size (" + std::to_string(hidden_size) +
                                ") and no head_dim is given");
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return InvalidArgumentError(prefix + "num_attention_heads (" +
                                std::to_string(num_attention_heads) +
                                ") must be a multiple of num_key_value_heads (" +
                                std::to_string(num_key_value_heads) + ")");
  }
  if (head_dim() % 2 != 0) {
    return InvalidArgumentError(prefix + "head_dim (" + std::to_string(head_dim()) +
                                ") must be even: RoPE rotates pairs of elements");
  }
  return Status::Ok();
}

Status ModelConfig::ValidateForTp(int tp) const {
  TP_RETURN_IF_ERROR(Validate());
  if (tp < 1) {
    return InvalidArgumentError("model config '" + name + "': tp (" + std::to_string(tp) +
                                ") must be >= 1");
  }
  TP_RETURN_IF_ERROR(CheckTpDivides(*this, "num_attention_heads", num_attention_heads, tp));
  TP_RETURN_IF_ERROR(CheckTpDivides(
      *this, "num_key_value_heads", num_key_value_heads, tp,
      tp > num_key_value_heads
          ? "replicating KV heads across ranks (tp > num_key_value_heads) is not supported yet"
          : ""));
  TP_RETURN_IF_ERROR(CheckTpDivides(*this, "intermediate_size", intermediate_size, tp));
  TP_RETURN_IF_ERROR(CheckTpDivides(*this, "vocab_size", vocab_size, tp));
  return Status::Ok();
}

StatusOr<ModelConfig> ParseModelConfigJson(std::string_view json_text, const std::string& source) {
  Json root;
  // JSON leaves repeated keys undefined and nlohmann keeps the last one: a
  // silent choice, so a repeat (in any object) is refused, naming the key.
  std::vector<std::set<std::string>> keys_of_open_objects;
  std::string repeated;
  auto watch = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) {
      keys_of_open_objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end && !keys_of_open_objects.empty()) {
      keys_of_open_objects.pop_back();
    } else if (event == Json::parse_event_t::key && !keys_of_open_objects.empty() &&
               parsed.is_string() && !keys_of_open_objects.back().insert(parsed).second &&
               repeated.empty()) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  try {
    root = Json::parse(json_text.begin(), json_text.end(), watch);
  } catch (const Json::exception& e) {
    return InvalidArgumentError(source + ": JSON syntax error: " + e.what());
  }
  if (!repeated.empty()) {
    return InvalidArgumentError(source + ": key '" + repeated +
                                "' appears more than once in one object");
  }
  if (!root.is_object()) {
    return InvalidArgumentError(source + ": must be a JSON object, got " + root.type_name());
  }

  if (const auto it = root.find("model_type"); it != root.end() && !it->is_null()) {
    if (!it->is_string()) return WrongType(source, "model_type", "a string", *it);
    if (it->get<std::string>() != kAllowedModelTypes) {
      return InvalidArgumentError(source + ": model_type '" + it->get<std::string>() +
                                  "' is not supported (allowed: " + kAllowedModelTypes + ")");
    }
  }
  // Architecture options this engine does not implement: refused, never
  // silently computed as a plain Llama block.
  if (const auto it = root.find("hidden_act"); it != root.end() && !it->is_null()) {
    if (!it->is_string()) return WrongType(source, "hidden_act", "a string", *it);
    if (it->get<std::string>() != "silu") {
      return UnimplementedError(source + ": hidden_act '" + it->get<std::string>() +
                                "' is not supported (allowed: silu)");
    }
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (const auto it = root.find(key); it != root.end() && !it->is_null()) {
      if (!it->is_boolean()) return WrongType(source, key, "true or false", *it);
      if (it->get<bool>()) {
        return UnimplementedError(source + ": " + key +
                                  " is true: linear layers with biases are not supported");
      }
    }
  }

  ModelConfig c;
  c.name = source;
  // A key a file leaves out takes HuggingFace LlamaConfig's default (not the
  // presets' Llama 3 values): a Llama 2 file without rope_theta means 10000.
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 2048;
  if (const auto it = root.find("tie_word_embeddings"); it != root.end() && !it->is_null()) {
    if (!it->is_boolean()) return WrongType(source, "tie_word_embeddings", "true or false", *it);
    c.tie_word_embeddings = it->get<bool>();
  }
  TP_RETURN_IF_ERROR(ReadInt(root, source, "hidden_size", true, &c.hidden_size));
  TP_RETURN_IF_ERROR(ReadInt(root, source, "intermediate_size", true, &c.intermediate_size));
  TP_RETURN_IF_ERROR(ReadInt(root, source, "num_attention_heads", true, &c.num_attention_heads));
  TP_RETURN_IF_ERROR(ReadInt(root, source, "num_hidden_layers", true, &c.num_hidden_layers));
  TP_RETURN_IF_ERROR(ReadInt(root, source, "vocab_size", true, &c.vocab_size));
  c.num_key_value_heads = c.num_attention_heads;
  TP_RETURN_IF_ERROR(ReadInt(root, source, "num_key_value_heads", false, &c.num_key_value_heads));
  TP_RETURN_IF_ERROR(ReadDouble(root, source, "rms_norm_eps", &c.rms_norm_eps));
  TP_RETURN_IF_ERROR(ReadDouble(root, source, "rope_theta", &c.rope_theta));
  // RoPE: transformers 4's rope_scaling next to rope_theta, or transformers 5's
  // rope_parameters holding both. A file with both spellings must say the same in each.
  std::optional<RopeScaling> scaling, parameters;
  if (const auto it = root.find("rope_scaling"); it != root.end() && !it->is_null()) {
    scaling.emplace();
    TP_RETURN_IF_ERROR(ParseRopeObject(*it, source, "rope_scaling", false, &*scaling, nullptr));
  }
  if (const auto it = root.find("rope_parameters"); it != root.end() && !it->is_null()) {
    parameters.emplace();
    std::optional<double> theta;
    TP_RETURN_IF_ERROR(ParseRopeObject(*it, source, "rope_parameters", true, &*parameters, &theta));
    if (theta.has_value()) {
      if (const auto top = root.find("rope_theta");
          top != root.end() && !top->is_null() && top->get<double>() != *theta) {
        std::ostringstream m;
        m << source << ": rope_theta (" << top->get<double>()
          << ") and rope_parameters.rope_theta (" << *theta << ") disagree";
        return InvalidArgumentError(m.str());
      }
      c.rope_theta = *theta;
    }
  }
  if (scaling.has_value() && parameters.has_value() && *scaling != *parameters) {
    return InvalidArgumentError(
        source + ": rope_scaling (rope_type '" + RopeTypeName(scaling->type) +
        "') and rope_parameters (rope_type '" + RopeTypeName(parameters->type) + "') disagree");
  }
  if (scaling.has_value()) c.rope_scaling = *scaling;
  if (parameters.has_value()) c.rope_scaling = *parameters;
  TP_RETURN_IF_ERROR(
      ReadInt(root, source, "max_position_embeddings", false, &c.max_position_embeddings));
  int64_t head_dim = 0;
  TP_RETURN_IF_ERROR(ReadInt(root, source, "head_dim", false, &head_dim));
  if (const auto it = root.find("head_dim"); it != root.end() && !it->is_null() && head_dim < 1) {
    // An explicit 0 is a broken file, not "derive it".
    return InvalidArgumentError(source + ": key 'head_dim' (" + std::to_string(head_dim) +
                                ") must be positive");
  }
  // Newer HF files spell out head_dim even when it is the derived value;
  // keep such configs equal to the ones that leave it out.
  const bool derived = c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0 &&
                       head_dim == c.hidden_size / c.num_attention_heads;
  c.head_dim_override = derived ? 0 : head_dim;
  TP_RETURN_IF_ERROR(c.Validate());
  return c;
}

StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file(path);
  if (fs::is_directory(file, ec)) file /= "config.json";
  if (!fs::is_regular_file(file, ec)) {
    return NotFoundError("model config " + file.string() + ": no such file");
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return NotFoundError("model config " + file.string() + ": cannot open the file");
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return InternalError("model config " + file.string() + ": read error");
  TP_ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfigJson(text.str(), file.string()));
  const fs::path dir = file.parent_path();
  c.name = dir.empty() ? "." : dir.string();
  return c;
}

std::string ModelConfigToJson(const ModelConfig& c) {
  nlohmann::ordered_json j;
  if (!c.name.empty()) j["_name_or_path"] = c.name;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["vocab_size"] = c.vocab_size;
  if (c.head_dim_override > 0) j["head_dim"] = c.head_dim_override;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  const RopeScaling& r = c.rope_scaling;
  if (r.type == RopeType::kDefault) {
    j["rope_scaling"] = nullptr;
  } else {
    nlohmann::ordered_json scaling;
    scaling["rope_type"] = RopeTypeName(r.type);
    scaling["factor"] = r.factor;
    if (r.type == RopeType::kLlama3) {
      scaling["low_freq_factor"] = r.low_freq_factor;
      scaling["high_freq_factor"] = r.high_freq_factor;
      scaling["original_max_position_embeddings"] = r.original_max_position_embeddings;
    }
    j["rope_scaling"] = std::move(scaling);
  }
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  return j.dump(2) + "\n";
}

StatusOr<ModelConfig> ModelPreset(std::string_view name) {
  for (const ModelConfig& p : Presets()) {
    if (p.name == name) return p;
  }
  std::string list;
  for (const std::string& n : ModelPresetNames()) {
    if (!list.empty()) list += ", ";
    list += n;
  }
  return NotFoundError("unknown model preset '" + std::string(name) + "' (presets: " + list + ")");
}

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const ModelConfig& p : Presets()) names.push_back(p.name);
  return names;
}

}  // namespace tpserve
