#include "engine/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
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
  if (const auto it = root.find("rope_scaling"); it != root.end() && !it->is_null()) {
    std::string kind;
    if (it->is_object()) {
      for (const char* k : {"rope_type", "type"}) {
        if (const auto t = it->find(k); t != it->end() && t->is_string()) {
          kind = " (rope_type '" + t->get<std::string>() + "')";
          break;
        }
      }
    }
    return UnimplementedError(source + ": key 'rope_scaling' is set" + kind +
                              ": RoPE scaling (Llama 3.1 and later) is not implemented; only "
                              "plain RoPE (rope_scaling: null)");
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
  // transformers 5 writes RoPE's settings as rope_parameters {rope_type, rope_theta, ...}
  // instead of top-level rope_theta and rope_scaling.
  if (const auto it = root.find("rope_parameters"); it != root.end() && !it->is_null()) {
    if (!it->is_object()) return WrongType(source, "rope_parameters", "an object", *it);
    // The kind first: a scaled RoPE is named as such, not by its first unknown key.
    for (const char* key : {"rope_type", "type"}) {
      const auto t = it->find(key);
      if (t == it->end()) continue;
      const std::string where = std::string("rope_parameters.") + key;
      if (!t->is_string()) return WrongType(source, where.c_str(), "a string", *t);
      if (t->get<std::string>() != "default") {
        return UnimplementedError(source + ": " + where + " is '" + t->get<std::string>() +
                                  "': RoPE scaling (Llama 3.1 and later) is not implemented; "
                                  "only plain RoPE (rope_type 'default')");
      }
    }
    for (const auto& [key, value] : it->items()) {
      const std::string where = "rope_parameters." + key;
      if (key == "rope_type" || key == "type") {
        continue;  // checked above
      } else if (key == "rope_theta") {
        if (!value.is_number()) return WrongType(source, where.c_str(), "a number", value);
        const double theta = value.get<double>();
        if (const auto top = root.find("rope_theta");
            top != root.end() && !top->is_null() && top->get<double>() != theta) {
          std::ostringstream m;
          m << source << ": rope_theta (" << top->get<double>() << ") and " << where << " ("
            << theta << ") disagree";
          return InvalidArgumentError(m.str());
        }
        c.rope_theta = theta;
      } else {
        return UnimplementedError(source + ": key '" + where +
                                  "' is not supported (plain RoPE reads rope_type and "
                                  "rope_theta only)");
      }
    }
  }
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
  j["rope_scaling"] = nullptr;
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
