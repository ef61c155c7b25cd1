#include "engine/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
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

// Meta-Llama-3.1-8B's block, as published (transformers 4 spelling).
constexpr char kLlama31Scaling[] = R"({
    "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"})";

RopeScaling Llama31Scaling() {
  RopeScaling r;
  r.type = RopeType::kLlama3;
  r.factor = 8.0;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = 8192;
  return r;
}

TEST(ModelConfig, RopeScalingLlama3) {
  auto c = ParseModelConfigJson(MinimalWith("rope_scaling", kLlama31Scaling), "x");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_scaling, Llama31Scaling());
  EXPECT_EQ(c->rope_theta, 10000.0);  // top-level rope_theta (absent here: HF's default)

  // The older "type" spelling, and both spellings when they agree.
  auto linear = ParseModelConfigJson(
      MinimalWith("rope_scaling", R"({"type": "linear", "factor": 2.5})"), "x");
  ASSERT_TRUE(linear.ok()) << linear.status().ToString();
  EXPECT_EQ(linear->rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(linear->rope_scaling.factor, 2.5);
  EXPECT_EQ(linear->rope_scaling.original_max_position_embeddings,
            RopeScaling{}.original_max_position_embeddings);  // not read: left at the default
  EXPECT_TRUE(
      ParseModelConfigJson(MinimalWith("rope_scaling", R"({"type": "linear", "rope_type": "linear",
                                                   "factor": 2})"),
                           "x")
          .ok());
  const Status mixed = ParseError(
      MinimalWith("rope_scaling", R"({"type": "linear", "rope_type": "llama3", "factor": 2})"));
  EXPECT_EQ(mixed.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(mixed.message(), HasSubstr("disagree"));

  // "default" and null are plain RoPE: the same config as no key at all.
  auto plain = ParseModelConfigJson(kMinimal, "x");
  ASSERT_TRUE(plain.ok());
  for (const char* v : {"null", R"({"rope_type": "default"})"}) {
    auto d = ParseModelConfigJson(MinimalWith("rope_scaling", v), "x");
    ASSERT_TRUE(d.ok()) << v << ": " << d.status().ToString();
    EXPECT_EQ(*d, *plain) << v;
  }
}

TEST(ModelConfig, RopeScalingOtherTypesAreUnimplemented) {
  for (const char* type : {"yarn", "dynamic", "longrope", "su"}) {
    const Status s = ParseError(MinimalWith(
        "rope_scaling", std::string(R"({"rope_type": ")") + type + R"(", "factor": 4.0})"));
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << type;
    EXPECT_THAT(s.message(),
                AllOf(HasSubstr("bad/config.json"),
                      HasSubstr(std::string("rope_scaling.rope_type is '") + type + "'"),
                      HasSubstr("implemented: default, linear, llama3")));
  }
  const Status old = ParseError(MinimalWith("rope_scaling", R"({"type": "dynamic", "factor": 2})"));
  EXPECT_EQ(old.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(old.message(), HasSubstr("rope_scaling.type is 'dynamic'"));
  // A key the type does not read (yarn's, here next to llama3) is refused, not ignored.
  nlohmann::json extra = nlohmann::json::parse(kLlama31Scaling);
  extra["beta_fast"] = 32;
  const Status e = ParseError(MinimalWith("rope_scaling", extra.dump()));
  EXPECT_EQ(e.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(e.message(), AllOf(HasSubstr("'rope_scaling.beta_fast'"), HasSubstr("llama3")));
}

TEST(ModelConfig, RopeScalingParametersAreChecked) {
  struct Case {
    const char* key;
    const char* value;  // JSON text; nullptr: the key removed
    StatusCode code;
    const char* expect;
  };
  const Case cases[] = {
      {"factor", nullptr, StatusCode::kInvalidArgument,
       "missing required key 'rope_scaling.factor'"},
      {"original_max_position_embeddings", nullptr, StatusCode::kInvalidArgument,
       "'rope_scaling.original_max_position_embeddings'"},
      {"factor", "0", StatusCode::kInvalidArgument, "rope_scaling.factor (0)"},
      {"factor", "-2.0", StatusCode::kInvalidArgument, "rope_scaling.factor (-2)"},
      {"factor", "\"8\"", StatusCode::kInvalidArgument, "'rope_scaling.factor' must be a number"},
      {"low_freq_factor", "0.0", StatusCode::kInvalidArgument, "rope_scaling.low_freq_factor (0)"},
      {"high_freq_factor", "1.0", StatusCode::kInvalidArgument,
       "high_freq_factor (1) must be greater than low_freq_factor (1)"},
      {"high_freq_factor", "0.5", StatusCode::kInvalidArgument,
       "high_freq_factor (0.5) must be greater"},
      {"original_max_position_embeddings", "0", StatusCode::kInvalidArgument,
       "rope_scaling.original_max_position_embeddings (0) must be >= 1"},
      {"original_max_position_embeddings", "8192.5", StatusCode::kInvalidArgument,
       "'rope_scaling.original_max_position_embeddings' must be an integer"},
      {"rope_type", nullptr, StatusCode::kInvalidArgument,
       "missing required key 'rope_scaling.rope_type'"},
      {"rope_type", "3", StatusCode::kInvalidArgument, "'rope_scaling.rope_type' must be a string"},
  };
  for (const Case& c : cases) {
    nlohmann::json r = nlohmann::json::parse(kLlama31Scaling);
    if (c.value == nullptr) {
      r.erase(c.key);
    } else {
      r[c.key] = nlohmann::json::parse(c.value);
    }
    const Status s = ParseError(MinimalWith("rope_scaling", r.dump()));
    EXPECT_EQ(s.code(), c.code) << c.key << " " << (c.value ? c.value : "removed");
    EXPECT_THAT(s.message(), AllOf(HasSubstr("bad/config.json"), HasSubstr(c.expect)));
  }
  // Not an object at all.
  EXPECT_EQ(ParseError(MinimalWith("rope_scaling", "8.0")).code(), StatusCode::kInvalidArgument);
  // A non-finite factor is as wrong programmatically as in a file.
  ModelConfig c = Tiny();
  c.rope_scaling = Llama31Scaling();
  c.rope_scaling.factor = std::numeric_limits<double>::infinity();
  EXPECT_THAT(c.Validate().message(), AllOf(HasSubstr("'tiny'"), HasSubstr("rope_scaling.factor")));
  c.rope_scaling.factor = 8.0;
  EXPECT_TRUE(c.Validate().ok());
}

// transformers 5 writes rope_parameters in place of rope_theta and rope_scaling.
TEST(ModelConfig, RopeParametersOfTransformers5) {
  auto c = ParseModelConfigJson(
      MinimalWith("rope_parameters", R"({"rope_type": "default", "rope_theta": 500000.0})"), "x");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling, RopeScaling{});

  nlohmann::json llama31 = nlohmann::json::parse(kLlama31Scaling);
  llama31["rope_theta"] = 500000.0;
  auto scaled = ParseModelConfigJson(MinimalWith("rope_parameters", llama31.dump()), "x");
  ASSERT_TRUE(scaled.ok()) << scaled.status().ToString();
  EXPECT_EQ(scaled->rope_theta, 500000.0);
  EXPECT_EQ(scaled->rope_scaling, Llama31Scaling());
  // The same model in transformers 4's spelling is the same config.
  nlohmann::json v4 = nlohmann::json::parse(MinimalWith("rope_theta", "500000.0"));
  v4["rope_scaling"] = nlohmann::json::parse(kLlama31Scaling);
  auto old = ParseModelConfigJson(v4.dump(), "x");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(*old, *scaled);
  // Both spellings in one file: accepted when they agree, refused when not.
  nlohmann::json both = v4;
  both["rope_parameters"] = llama31;
  EXPECT_TRUE(ParseModelConfigJson(both.dump(), "x").ok());
  both["rope_parameters"]["factor"] = 4.0;
  const Status differ = ParseError(both.dump());
  EXPECT_EQ(differ.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(differ.message(), AllOf(HasSubstr("rope_scaling"), HasSubstr("rope_parameters"),
                                      HasSubstr("disagree")));

  const Status yarn = ParseError(MinimalWith("rope_parameters", R"({
    "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6,
    "rope_type": "yarn"})"));
  EXPECT_EQ(yarn.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(yarn.message(), AllOf(HasSubstr("bad/config.json"),
                                    HasSubstr("rope_parameters.rope_type is 'yarn'")));
  const Status bad = ParseError(MinimalWith("rope_parameters", R"({
    "factor": -8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3"})"));
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("rope_parameters.factor (-8)"));
  // No rope_type: plain RoPE, which reads no factor.
  const Status extra =
      ParseError(MinimalWith("rope_parameters", R"({"rope_theta": 1e4, "factor": 2.0})"));
  EXPECT_EQ(extra.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(extra.message(), HasSubstr("'rope_parameters.factor'"));
  nlohmann::json twice = nlohmann::json::parse(MinimalWith("rope_theta", "500000.0"));
  twice["rope_parameters"] = nlohmann::json::parse(R"({"rope_theta": 1e4})");
  const Status theta = ParseError(twice.dump());
  EXPECT_EQ(theta.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(theta.message(), HasSubstr("disagree"));
  EXPECT_EQ(ParseError(MinimalWith("rope_parameters", "[1]")).code(), StatusCode::kInvalidArgument);
}

// Values worked out from transformers' definition of each kind, for Llama 3.1 8B
// (theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192): pair i's plain
// inverse frequency is 500000^(-i/64), its wavelength 2 pi over that; the bands' edges are
// wavelengths 8192 / 4 = 2048 and 8192 / 1 = 8192.
TEST(RopeInverseFrequencies, Llama3Bands) {
  const std::vector<double> plain = RopeInverseFrequencies(500000.0, 128, RopeScaling{});
  const std::vector<double> inv = RopeInverseFrequencies(500000.0, 128, Llama31Scaling());
  ASSERT_EQ(plain.size(), 64u);
  ASSERT_EQ(inv.size(), 64u);
  EXPECT_EQ(plain[0], 1.0);
  EXPECT_DOUBLE_EQ(plain[32], 1.0 / std::sqrt(500000.0));
  struct Pair {
    int i;
    double want;
  };
  const Pair pairs[] = {
      {0, 1.0},                     // wavelength 2 pi: high band, kept
      {28, 0.003211445994752591},   // wavelength 1956.5 < 2048: kept
      {29, 0.002166570763503359},   // 2401.7: blend, s = 0.80362
      {32, 0.0005248461609929547},  // 4442.9: blend, s = 0.28128
      {34, 0.0001785078127679964},  // 6695.1: blend, s = 0.074527
      {35, 9.556212353964683e-05},  // 8218.7 > 8192: low band, / 8
      {63, 3.068925988914511e-07},  // low band, / 8
  };
  for (const Pair& p : pairs) {
    EXPECT_NEAR(inv[p.i], p.want, 1e-12 * p.want) << "pair " << p.i;
  }
  // Every pair: kept, divided by the factor, or in between, never outside.
  for (size_t i = 0; i < inv.size(); ++i) {
    EXPECT_LE(inv[i], plain[i]) << i;
    EXPECT_GE(inv[i], plain[i] / 8.0 * (1 - 1e-15)) << i;
  }
  // The blend meets both bands: no jump at the edges (pair 28 -> 29 and 34 -> 35 are
  // neighbours in frequency, so the ratio to plain moves monotonically from 1 to 1/8).
  for (size_t i = 1; i < inv.size(); ++i) {
    EXPECT_LE(inv[i] / plain[i], inv[i - 1] / plain[i - 1] * (1 + 1e-15)) << i;
  }

  // The config overload reads theta, head_dim and the scaling from the config.
  ModelConfig c = Tiny();  // head_dim 64, theta 10000
  c.rope_scaling = Llama31Scaling();
  EXPECT_EQ(RopeInverseFrequencies(c), RopeInverseFrequencies(10000.0, 64, Llama31Scaling()));
  c.head_dim_override = 128;
  EXPECT_EQ(RopeInverseFrequencies(c).size(), 64u);
}

TEST(RopeInverseFrequencies, LinearDividesByFactor) {
  RopeScaling linear;
  linear.type = RopeType::kLinear;
  linear.factor = 2.5;
  const std::vector<double> plain = RopeInverseFrequencies(10000.0, 64, RopeScaling{});
  const std::vector<double> inv = RopeInverseFrequencies(10000.0, 64, linear);
  ASSERT_EQ(inv.size(), 32u);
  for (size_t i = 0; i < inv.size(); ++i) EXPECT_DOUBLE_EQ(inv[i], plain[i] / 2.5) << i;
  // Plain: theta^(-2i / head_dim).
  EXPECT_DOUBLE_EQ(plain[16], 0.01);
  EXPECT_DOUBLE_EQ(plain[8], 0.1);
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
      {[](ModelConfig& c) {
         c.rope_scaling = {RopeType::kLinear, 0.0, 1.0, 4.0, 8192};
       },
       "rope_scaling.factor (0)"},
      {[](ModelConfig& c) {
         c.rope_scaling = {RopeType::kLlama3, 8.0, 2.0, 2.0, 8192};
       },
       "rope_scaling.high_freq_factor (2) must be greater than low_freq_factor (2)"},
      {[](ModelConfig& c) {
         c.rope_scaling = {RopeType::kLlama3, 8.0, 1.0, 4.0, 0};
       },
       "rope_scaling.original_max_position_embeddings (0)"},
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
  ModelConfig llama31 = *ModelPreset("llama3-8b");
  llama31.name = "llama3.1-8b";
  llama31.max_position_embeddings = 131072;
  llama31.rope_scaling = Llama31Scaling();
  configs.push_back(llama31);
  ModelConfig linear = Tiny();
  linear.name = "linear";
  linear.rope_scaling.type = RopeType::kLinear;
  linear.rope_scaling.factor = 1.0 / 3.0;
  configs.push_back(linear);
  ModelConfig odd_llama3 = Tiny();
  odd_llama3.name = "odd-llama3";
  odd_llama3.rope_scaling = {RopeType::kLlama3, 7.123456789012345, 0.3, 2.75, 4096};
  configs.push_back(odd_llama3);
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
