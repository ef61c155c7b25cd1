#include "engine/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace tpserve {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// meta-llama/Meta-Llama-3-8B config.json as published, plus the
// quantization_config block an FP8 ModelOpt checkpoint adds.
constexpr char kLlama3_8b[] = R"({
  "_name_or_path": "meta-llama/Meta-Llama-3-8B",
  "architectures": [
    "LlamaForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "quantization_config": {
    "quant_method": "modelopt",
    "quant_algo": "FP8",
    "kv_cache_quant_algo": null,
    "exclude_modules": ["lm_head"]
  },
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
}
)";

constexpr char kMinimal[] = R"({
  "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
  "num_hidden_layers": 1, "vocab_size": 100
})";

// kMinimal with `key` set to the JSON text `value` (added or replaced).
std::string MinimalWith(const std::string& key, const std::string& value) {
  nlohmann::json j = nlohmann::json::parse(kMinimal);
  j[key] = nlohmann::json::parse(value);
  return j.dump();
}

std::string MinimalWithout(const std::string& key) {
  nlohmann::json j = nlohmann::json::parse(kMinimal);
  j.erase(key);
  return j.dump();
}

Status ParseError(const std::string& text) {
  return ParseModelConfigJson(text, "bad/config.json").status();
}

ModelConfig Tiny() {
  auto c = ModelPreset("tiny");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : ModelConfig();
}

// A fresh directory under the test temp dir, removed at the end of the test.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(std::filesystem::path(::testing::TempDir()) / name) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

void WriteFile(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

TEST(ModelConfig, ParsesHuggingFaceLlama3Config) {
  auto c = ParseModelConfigJson(kLlama3_8b, "Meta-Llama-3-8B/config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->name, "Meta-Llama-3-8B/config.json");
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->num_hidden_layers, 32);
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->max_position_embeddings, 8192);
  EXPECT_EQ(c->head_dim(), 128);
  EXPECT_EQ(c->head_dim_override, 0);

  // Same shape as the preset.
  auto preset = ModelPreset("llama3-8b");
  ASSERT_TRUE(preset.ok());
  c->name = preset->name;
  EXPECT_EQ(*c, *preset);
}

TEST(ModelConfig, OptionalKeysTakeDefaults) {
  auto c = ParseModelConfigJson(kMinimal, "min.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_key_value_heads, 4);  // = num_attention_heads
  // HuggingFace LlamaConfig's defaults: a Llama 2 file without rope_theta is
  // a 10000 model, not a Llama 3 one.
  EXPECT_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim(), 16);

  // null is HF's None: the default, as if absent.
  auto n = ParseModelConfigJson(MinimalWith("num_key_value_heads", "null"), "min.json");
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(n->num_key_value_heads, 4);
}

TEST(ModelConfig, ArchitectureOptionsThatAreNotImplementedAreRefused) {
  struct Case {
    std::string key, value, message;
  };
  const Case cases[] = {
      {"hidden_act", "\"gelu\"", "min.json: hidden_act 'gelu' is not supported (allowed: silu)"},
      {"attention_bias", "true",
       "min.json: attention_bias is true: linear layers with biases are not supported"},
      {"mlp_bias", "true", "min.json: mlp_bias is true"},
  };
  for (const Case& c : cases) {
    auto r = ParseModelConfigJson(MinimalWith(c.key, c.value), "min.json");
    ASSERT_FALSE(r.ok()) << c.key;
    EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented) << c.key;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
  auto wrong = ParseModelConfigJson(MinimalWith("attention_bias", "1"), "min.json");
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("attention_bias"));
  for (const auto& [key, value] :
       {std::pair{"hidden_act", "\"silu\""}, std::pair{"attention_bias", "false"},
        std::pair{"mlp_bias", "null"}}) {
    EXPECT_TRUE(ParseModelConfigJson(MinimalWith(key, value), "min.json").ok()) << key;
  }
  auto tied = ParseModelConfigJson(MinimalWith("tie_word_embeddings", "true"), "min.json");
  ASSERT_TRUE(tied.ok());
  EXPECT_TRUE(tied->tie_word_embeddings);
}

TEST(ModelConfig, IntegerValuedThetaAndEpsAreAccepted) {
  auto c = ParseModelConfigJson(MinimalWith("rope_theta", "10000"), "min.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_theta, 10000.0);
}

TEST(ModelConfig, ExplicitHeadDim) {
  // Mistral-Nemo-style: head_dim not hidden / heads.
  auto c = ParseModelConfigJson(MinimalWith("head_dim", "32"), "min.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->head_dim(), 32);
  EXPECT_EQ(c->head_dim_override, 32);

  // Spelled out but equal to the derived value: same config as without it.
  auto same = ParseModelConfigJson(MinimalWith("head_dim", "16"), "min.json");
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(same->head_dim_override, 0);
  EXPECT_EQ(*same, *ParseModelConfigJson(kMinimal, "min.json"));

  // With head_dim given, heads need not divide hidden_size.
  nlohmann::json j = nlohmann::json::parse(kMinimal);
  j["head_dim"] = 32;
  j["num_attention_heads"] = 6;
  j["num_key_value_heads"] = 2;
  auto odd = ParseModelConfigJson(j.dump(), "min.json");
  ASSERT_TRUE(odd.ok()) << odd.status().ToString();
  EXPECT_EQ(odd->num_attention_heads, 6);
  EXPECT_EQ(odd->head_dim(), 32);

  EXPECT_THAT(ParseError(MinimalWith("head_dim", "0")).message(),
              AllOf(HasSubstr("bad/config.json"), HasSubstr("'head_dim'"), HasSubstr("(0)")));
}

TEST(ModelConfig, MissingRequiredKeyIsNamed) {
  for (const char* key : {"hidden_size", "intermediate_size", "num_attention_heads",
                          "num_hidden_layers", "vocab_size"}) {
    const std::string text = MinimalWithout(key);
    const Status s = ParseError(text);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << key;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"), HasSubstr("missing"),
                                   HasSubstr(std::string("'") + key + "'")));
  }
}

TEST(ModelConfig, WrongTypesAreNamed) {
  struct Case {
    const char* key;
    const char* value;
  };
  for (const Case& c :
       {Case{"hidden_size", "\"64\""}, Case{"hidden_size", "64.0"}, Case{"hidden_size", "true"},
        Case{"num_key_value_heads", "[4]"}, Case{"rms_norm_eps", "\"1e-5\""},
        Case{"rope_theta", "{}"}, Case{"max_position_embeddings", "1.5"},
        Case{"head_dim", "\"16\""}, Case{"model_type", "7"}, Case{"vocab_size", "null"}}) {
    const Status s = ParseError(MinimalWith(c.key, c.value));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.key << " = " << c.value;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"),
                                   HasSubstr(std::string("'") + c.key + "'"), HasSubstr("must be")))
        << c.key << " = " << c.value;
  }
}

TEST(ModelConfig, SyntaxErrorAndNonObject) {
  Status s = ParseError("{\"hidden_size\": 64,");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"), HasSubstr("syntax")));
  s = ParseError("[1, 2]");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"), HasSubstr("object")));
}

TEST(ModelConfig, RepeatedKeysAreRefused) {
  std::string text = kMinimal;
  text.insert(text.find('{') + 1, "\"hidden_size\": 64,");
  Status s = ParseError(text);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"),
                                 HasSubstr("key 'hidden_size' appears more than once")));
  // The same key in two different objects is fine.
  EXPECT_TRUE(
      ParseModelConfigJson(MinimalWith("quantization_config", "{\"hidden_size\": 1}"), "x").ok());
}

TEST(ModelConfig, OnlyLlamaModelType) {
  EXPECT_TRUE(ParseModelConfigJson(MinimalWith("model_type", "\"llama\""), "x").ok());
  const Status s = ParseError(MinimalWith("model_type", "\"mistral\""));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"), HasSubstr("'mistral'"),
                                 HasSubstr("allowed: llama")));
}

TEST(ModelConfig, RopeScalingIsUnimplemented) {
  // Llama 3.1's block.
  const Status s = ParseError(MinimalWith("rope_scaling", R"({
    "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"})"));
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"), HasSubstr("'rope_scaling'"),
                                 HasSubstr("llama3")));
  EXPECT_TRUE(ParseModelConfigJson(MinimalWith("rope_scaling", "null"), "x").ok());
}

// transformers 5 writes rope_parameters in place of rope_theta and rope_scaling: its theta is
// read, and any RoPE other than the plain one is refused as rope_scaling is.
TEST(ModelConfig, RopeParametersOfTransformers5) {
  auto c = ParseModelConfigJson(
      MinimalWith("rope_parameters", R"({"rope_type": "default", "rope_theta": 500000.0})"), "x");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_theta, 500000.0);
  const Status scaled = ParseError(MinimalWith("rope_parameters", R"({
    "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3"})"));
  EXPECT_EQ(scaled.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(scaled.message(), AllOf(HasSubstr("bad/config.json"),
                                      HasSubstr("rope_parameters.rope_type is 'llama3'")));
  const Status extra =
      ParseError(MinimalWith("rope_parameters", R"({"rope_theta": 1e4, "factor": 2.0})"));
  EXPECT_EQ(extra.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(extra.message(), HasSubstr("'rope_parameters.factor' is not supported"));
  nlohmann::json both = nlohmann::json::parse(MinimalWith("rope_theta", "500000.0"));
  both["rope_parameters"] = nlohmann::json::parse(R"({"rope_theta": 1e4})");
  const Status twice = ParseError(both.dump());
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.message(), HasSubstr("disagree"));
  EXPECT_EQ(ParseError(MinimalWith("rope_parameters", "[1]")).code(), StatusCode::kInvalidArgument);
}

TEST(ModelConfig, ParseRunsValidate) {
  const Status s = ParseError(MinimalWith("num_key_value_heads", "3"));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"), HasSubstr("num_key_value_heads"),
                                 HasSubstr("(3)")));
}

TEST(ModelConfig, ValidateMessages) {
  EXPECT_TRUE(Tiny().Validate().ok());

  struct Case {
    void (*mutate)(ModelConfig&);
    const char* expect;
  };
  const Case cases[] = {
      {[](ModelConfig& c) { c.hidden_size = 0; }, "hidden_size (0)"},
      {[](ModelConfig& c) { c.intermediate_size = -5; }, "intermediate_size (-5)"},
      {[](ModelConfig& c) { c.num_hidden_layers = 0; }, "num_hidden_layers (0)"},
      {[](ModelConfig& c) { c.vocab_size = int64_t{1} << 40; }, "vocab_size (1099511627776)"},
      {[](ModelConfig& c) { c.max_position_embeddings = 0; }, "max_position_embeddings (0)"},
      {[](ModelConfig& c) { c.num_attention_heads = 7; },
       "num_attention_heads (7) does not divide"},
      {[](ModelConfig& c) { c.num_key_value_heads = 3; },
       "num_attention_heads (8) must be a multiple of num_key_value_heads (3)"},
      {[](ModelConfig& c) { c.head_dim_override = 7; }, "head_dim (7) must be even"},
      {[](ModelConfig& c) { c.head_dim_override = -1; }, "head_dim (-1)"},
      {[](ModelConfig& c) { c.rms_norm_eps = 0; }, "rms_norm_eps (0)"},
      {[](ModelConfig& c) { c.rope_theta = -1; }, "rope_theta (-1)"},
  };
  for (const Case& c : cases) {
    ModelConfig cfg = Tiny();
    c.mutate(cfg);
    const Status s = cfg.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.expect;
    EXPECT_THAT(s.message(), AllOf(HasSubstr("'tiny'"), HasSubstr(c.expect)));
  }
}

TEST(ModelConfig, ValidateForTp) {
  auto l70 = ModelPreset("llama3-70b");
  ASSERT_TRUE(l70.ok());
  for (int tp : {1, 2, 4, 8}) EXPECT_TRUE(l70->ValidateForTp(tp).ok()) << tp;

  // 16 > 8 KV heads: needs replication.
  Status s = l70->ValidateForTp(16);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("num_key_value_heads (8)"), HasSubstr("tp (16)"),
                                 HasSubstr("not supported yet")));

  s = l70->ValidateForTp(3);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("num_attention_heads (64)"), HasSubstr("tp (3)")));
  s = l70->ValidateForTp(0);
  EXPECT_THAT(s.message(), HasSubstr("tp (0)"));

  ModelConfig c = Tiny();  // 8 heads, 4 KV heads, 512 inter, 1024 vocab
  c.num_key_value_heads = 8;
  c.intermediate_size = 516;  // divisible by 2 and 4, not by 8
  s = c.ValidateForTp(8);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("intermediate_size (516)"), HasSubstr("tp (8)")));
  EXPECT_THAT(s.message(), Not(HasSubstr("not supported yet")));
  c.intermediate_size = 512;
  c.vocab_size = 1020;
  s = c.ValidateForTp(8);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("vocab_size (1020)"), HasSubstr("tp (8)")));
  EXPECT_TRUE(c.ValidateForTp(4).ok());

  // Invalid model: Validate's error comes first.
  c.hidden_size = 0;
  EXPECT_THAT(c.ValidateForTp(1).message(), HasSubstr("hidden_size (0)"));
}

TEST(ModelConfig, JsonRoundTrip) {
  std::vector<ModelConfig> configs;
  for (const std::string& name : ModelPresetNames()) configs.push_back(*ModelPreset(name));
  ModelConfig odd = Tiny();
  odd.name = "odd";
  odd.head_dim_override = 48;
  odd.rms_norm_eps = 1.2345678901234567e-6;
  odd.rope_theta = 1234567.891;
  odd.max_position_embeddings = 131072;
  configs.push_back(odd);
  for (const ModelConfig& c : configs) {
    const std::string json = ModelConfigToJson(c);
    EXPECT_THAT(json, AllOf(HasSubstr("\"model_type\": \"llama\""),
                            HasSubstr("\"LlamaForCausalLM\""), HasSubstr("\"hidden_size\"")));
    auto back = ParseModelConfigJson(json, c.name);
    ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << json;
    EXPECT_EQ(*back, c) << json;
  }
}

TEST(ModelConfig, Presets) {
  EXPECT_THAT(ModelPresetNames(), ElementsAre("tiny", "llama3-8b", "llama3-70b"));
  for (const std::string& name : ModelPresetNames()) {
    auto c = ModelPreset(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_EQ(c->name, name);
    EXPECT_TRUE(c->Validate().ok()) << name;
  }
  const ModelConfig t = Tiny();
  EXPECT_EQ(t.hidden_size, 512);
  EXPECT_EQ(t.intermediate_size, 512);
  EXPECT_EQ(t.num_attention_heads, 8);
  EXPECT_EQ(t.num_key_value_heads, 4);
  EXPECT_EQ(t.num_hidden_layers, 2);
  EXPECT_EQ(t.vocab_size, 1024);
  EXPECT_EQ(t.max_position_embeddings, 2048);
  EXPECT_EQ(t.rope_theta, 10000.0);
  EXPECT_EQ(t.head_dim(), 64);  // what the CUDA attention kernel supports

  auto l70 = ModelPreset("llama3-70b");
  ASSERT_TRUE(l70.ok());
  EXPECT_EQ(l70->hidden_size, 8192);
  EXPECT_EQ(l70->intermediate_size, 28672);
  EXPECT_EQ(l70->num_attention_heads, 64);
  EXPECT_EQ(l70->num_key_value_heads, 8);
  EXPECT_EQ(l70->num_hidden_layers, 80);
  EXPECT_EQ(l70->vocab_size, 128256);
  EXPECT_EQ(l70->rope_theta, 500000.0);
  EXPECT_EQ(l70->max_position_embeddings, 8192);
  EXPECT_EQ(l70->head_dim(), 128);

  const Status s = ModelPreset("llama2-7b").status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("'llama2-7b'"), HasSubstr("tiny, llama3-8b, llama3-70b")));
}

TEST(ModelConfig, LoadFromFileAndDirectory) {
  TempDir dir("model_config_test_Meta-Llama-3-8B");
  const auto file = dir.path() / "config.json";
  WriteFile(file, kLlama3_8b);

  auto from_file = LoadModelConfig(file.string());
  ASSERT_TRUE(from_file.ok()) << from_file.status().ToString();
  EXPECT_EQ(from_file->name, dir.path().string());
  EXPECT_EQ(from_file->vocab_size, 128256);

  auto from_dir = LoadModelConfig(dir.path().string());
  ASSERT_TRUE(from_dir.ok()) << from_dir.status().ToString();
  EXPECT_EQ(*from_dir, *from_file);

  // Errors name the file.
  WriteFile(file, MinimalWith("hidden_size", "1"));
  const Status s = LoadModelConfig(dir.path().string()).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(file.string()));
}

TEST(ModelConfig, LoadMissingFileIsNotFound) {
  TempDir dir("model_config_test_missing");
  const std::string path = (dir.path() / "nope" / "config.json").string();
  Status s = LoadModelConfig(path).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(path));

  // A directory without a config.json.
  s = LoadModelConfig(dir.path().string()).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr((dir.path() / "config.json").string()));
}

}  // namespace
}  // namespace tpserve
