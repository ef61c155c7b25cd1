#include "server/generation_request.h"

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include "server/request_validation.h"

namespace tpserve {
namespace {

using inference::ModelInferRequest;

enum class Kind { kInt, kFloat, kBool };

struct InputSpec {
  const char* name;
  std::set<std::string> dtypes;  // accepted datatypes
  Kind kind;
  bool scalar;  // one value
};

const std::map<std::string, InputSpec>& Specs() {
  static const auto* specs = new std::map<std::string, InputSpec>{
      {"input_ids", {"input_ids", {"INT32", "INT64"}, Kind::kInt, false}},
      {"request_output_len", {"request_output_len", {"INT32"}, Kind::kInt, true}},
      {"input_lengths", {"input_lengths", {"INT32"}, Kind::kInt, true}},
      {"end_id", {"end_id", {"INT32"}, Kind::kInt, true}},
      {"pad_id", {"pad_id", {"INT32"}, Kind::kInt, true}},
      {"streaming", {"streaming", {"BOOL"}, Kind::kBool, true}},
      {"temperature", {"temperature", {"FP32"}, Kind::kFloat, true}},
      {"runtime_top_k", {"runtime_top_k", {"INT32"}, Kind::kInt, true}},
      {"runtime_top_p", {"runtime_top_p", {"FP32"}, Kind::kFloat, true}},
      {"seed", {"seed", {"UINT64"}, Kind::kInt, true}},
      {"random_seed", {"random_seed", {"UINT64"}, Kind::kInt, true}},
      {"stop_words_list", {"stop_words_list", {"INT32"}, Kind::kInt, false}},
      {"return_log_probs", {"return_log_probs", {"BOOL"}, Kind::kBool, true}},
      {"exclude_input_in_output", {"exclude_input_in_output", {"BOOL"}, Kind::kBool, true}},
  };
  return *specs;
}

std::string Str(int64_t v) { return std::to_string(v); }

std::string Shape(const inference::ModelInferRequest::InferInputTensor& in) {
  std::string s = "[";
  for (int i = 0; i < in.shape_size() && i < 8; ++i) s += (i ? "," : "") + Str(in.shape(i));
  if (in.shape_size() > 8) s += ",...";
  return s + "]";
}

Status Bad(const std::string& tensor, const std::string& what) {
  return InvalidArgumentError("input '" + tensor + "': " + what);
}

// The values of one input as doubles (exact for int32 and bools) or, for
// UINT64, as the raw 64-bit words in `u64`.
struct Values {
  std::vector<double> v;
  std::vector<uint64_t> u64;
  std::vector<int64_t> shape;
};

StatusOr<Values> ReadInput(const ModelInferRequest& q, int index, const InputSpec& spec,
                           int64_t max_elements) {
  const auto& in = q.inputs(index);
  if (spec.dtypes.count(in.datatype()) == 0) {
    std::string want;
    for (const auto& d : spec.dtypes) want += (want.empty() ? "" : " or ") + d;
    return Bad(spec.name, "datatype must be " + want + ", got '" + ClientText(in.datatype()) + "'");
  }
  Values out;
  int64_t n = 1;
  for (int64_t d : in.shape()) {
    if (d < 0 || (d > 0 && n > max_elements / d)) {
      return Bad(spec.name, "shape " + Shape(in) + " is negative or too large");
    }
    n *= d;
    out.shape.push_back(d);
  }
  if (n > max_elements) return Bad(spec.name, Str(n) + " values, at most " + Str(max_elements));
  if (spec.scalar && n != 1) {
    return Bad(spec.name, "needs one value (shape [1, 1]), got shape " + Shape(in));
  }
  const std::string& dt = in.datatype();
  const size_t elem = dt == "BOOL" ? 1 : (dt == "INT64" || dt == "UINT64") ? 8 : 4;
  if (q.raw_input_contents_size() > 0) {
    if (q.raw_input_contents_size() != q.inputs_size()) {
      return InvalidArgumentError("raw_input_contents has " + Str(q.raw_input_contents_size()) +
                                  " entries for " + Str(q.inputs_size()) +
                                  " inputs (give every input raw, or none)");
    }
    const std::string& raw = q.raw_input_contents(index);
    if (raw.size() != static_cast<size_t>(n) * elem) {
      return Bad(spec.name, "raw contents hold " + Str(static_cast<int64_t>(raw.size())) +
                                " bytes, shape " + Shape(in) + " of " + dt + " needs " +
                                Str(n * static_cast<int64_t>(elem)));
    }
    for (int64_t i = 0; i < n; ++i) {
      const char* p = raw.data() + i * elem;
      if (dt == "BOOL") {
        out.v.push_back(*p != 0 ? 1.0 : 0.0);
      } else if (dt == "INT32") {
        int32_t x;
        std::memcpy(&x, p, 4);
        out.v.push_back(x);
      } else if (dt == "INT64") {
        int64_t x;
        std::memcpy(&x, p, 8);
        out.v.push_back(static_cast<double>(x));
      } else if (dt == "UINT64") {
        uint64_t x;
        std::memcpy(&x, p, 8);
        out.u64.push_back(x);
      } else {
        float x;
        std::memcpy(&x, p, 4);
        out.v.push_back(x);
      }
    }
    return out;
  }
  const auto& c = in.contents();
  int64_t count = 0;
  if (dt == "BOOL") {
    for (bool b : c.bool_contents()) out.v.push_back(b ? 1.0 : 0.0);
    count = c.bool_contents_size();
  } else if (dt == "INT32") {
    for (int32_t x : c.int_contents()) out.v.push_back(x);
    count = c.int_contents_size();
  } else if (dt == "INT64") {
    for (int64_t x : c.int64_contents()) out.v.push_back(static_cast<double>(x));
    count = c.int64_contents_size();
  } else if (dt == "UINT64") {
    for (uint64_t x : c.uint64_contents()) out.u64.push_back(x);
    count = c.uint64_contents_size();
  } else {
    for (float x : c.fp32_contents()) out.v.push_back(x);
    count = c.fp32_contents_size();
  }
  const int64_t total = c.bool_contents_size() + c.int_contents_size() + c.int64_contents_size() +
                        c.uint_contents_size() + c.uint64_contents_size() + c.fp32_contents_size() +
                        c.fp64_contents_size() + c.bytes_contents_size();
  if (count != n || total != n) {
    return Bad(spec.name, "contents hold " + Str(total) + " values (" + Str(count) + " in the " +
                              dt + " field), shape " + Shape(in) + " needs " + Str(n));
  }
  return out;
}

bool HasParameters(const ModelInferRequest& q, std::string* which) {
  for (const auto& in : q.inputs()) {
    for (const auto& [k, v] : in.parameters()) {
      if (k != "binary_data_size") {
        *which = "input '" + ClientText(in.name()) + "' parameter '" + ClientText(k) + "'";
        return true;
      }
    }
  }
  for (const auto& [k, v] : q.parameters()) {
    *which = "request parameter '" + ClientText(k) + "'";
    return true;
  }
  return false;
}

Status ParseStopWords(const Values& v, GenerationParams* p) {
  // [1, 2, L] (or [2, L]): row 0 tokens, row 1 end offsets, -1 padded.
  const auto& s = v.shape;
  const bool ok_shape = (s.size() == 3 && s[0] == 1 && s[1] == 2) || (s.size() == 2 && s[0] == 2);
  if (!ok_shape) {
    return Bad("stop_words_list", "shape must be [1, 2, L] (tokens; end offsets)");
  }
  const int64_t len = s.back();
  int64_t begin = 0;
  for (int64_t i = 0; i < len; ++i) {
    const int64_t end = static_cast<int64_t>(v.v[len + i]);
    if (end < 0) break;  // padding
    if (end <= begin || end > len) {
      return Bad("stop_words_list", "offset " + Str(i) + " is " + Str(end) +
                                        ": offsets must rise and stay within the " + Str(len) +
                                        " tokens");
    }
    std::vector<int32_t> word;
    for (int64_t t = begin; t < end; ++t) word.push_back(static_cast<int32_t>(v.v[t]));
    p->stop_words.push_back(std::move(word));
    begin = end;
  }
  return Status::Ok();
}

}  // namespace

bool IsGenerationRequest(const ModelInferRequest& q) {
  for (const auto& in : q.inputs()) {
    if (in.name() == "request_output_len") return true;
  }
  return false;
}

StatusOr<GenerationRequest> ValidateGenerationRequest(const ModelInferRequest& q,
                                                      int64_t max_prompt) {
  std::string which;
  if (HasParameters(q, &which)) return InvalidArgumentError(which + " is not supported");
  const auto& specs = Specs();
  std::map<std::string, Values> got;
  for (int i = 0; i < q.inputs_size(); ++i) {
    const std::string& name = q.inputs(i).name();
    const auto it = specs.find(name);
    if (it == specs.end()) {
      return InvalidArgumentError("unknown input '" + ClientText(name) +
                                  "' (generation inputs: input_ids, input_lengths, "
                                  "request_output_len, end_id, pad_id, streaming, temperature, "
                                  "runtime_top_k, runtime_top_p, seed, stop_words_list, "
                                  "return_log_probs, exclude_input_in_output)");
    }
    if (got.count(name) != 0) return Bad(name, "given twice");
    const int64_t max_elements = name == "input_ids" ? max_prompt : 1 << 16;
    TP_ASSIGN_OR_RETURN(got[name], ReadInput(q, i, it->second, max_elements));
  }
  if (got.count("input_ids") == 0) return InvalidArgumentError("input 'input_ids' is missing");
  GenerationRequest r;
  const Values& ids = got["input_ids"];
  const bool shape_ok = (ids.shape.size() == 1) || (ids.shape.size() == 2 && ids.shape[0] == 1);
  if (!shape_ok || ids.v.empty()) {
    return Bad("input_ids", "shape must be [1, n] or [n] with n >= 1");
  }
  for (size_t i = 0; i < ids.v.size(); ++i) {
    if (ids.v[i] < 0 || ids.v[i] > INT32_MAX) {
      return Bad("input_ids", "token " + Str(static_cast<int64_t>(i)) + " has id " +
                                  Str(static_cast<int64_t>(ids.v[i])) + ", not a token id");
    }
    r.prompt.push_back(static_cast<int32_t>(ids.v[i]));
  }
  auto scalar = [&](const char* name) -> const double* {
    const auto it = got.find(name);
    return it == got.end() ? nullptr : &it->second.v[0];
  };
  if (const double* len = scalar("input_lengths");
      len != nullptr && *len != static_cast<double>(r.prompt.size())) {
    return Bad("input_lengths", "is " + Str(static_cast<int64_t>(*len)) + ", but input_ids holds " +
                                    Str(static_cast<int64_t>(r.prompt.size())) + " tokens");
  }
  const double out_len = *scalar("request_output_len");
  if (out_len < 1) {
    return Bad("request_output_len", "is " + Str(static_cast<int64_t>(out_len)) + ", needs >= 1");
  }
  r.params.max_new_tokens = static_cast<int64_t>(out_len);
  if (const double* e = scalar("end_id")) {
    if (*e < 0) return Bad("end_id", "is " + Str(static_cast<int64_t>(*e)) + ", not a token id");
    r.params.end_id = static_cast<int32_t>(*e);
  }
  if (const double* e = scalar("pad_id"); e != nullptr && *e < 0) {
    return Bad("pad_id", "is " + Str(static_cast<int64_t>(*e)) + ", not a token id");
  }
  if (const double* t = scalar("temperature")) {
    if (!std::isfinite(*t) || *t < 0) return Bad("temperature", "must be finite and >= 0");
    r.params.sampling.temperature = static_cast<float>(*t);
  }
  if (const double* k = scalar("runtime_top_k")) {
    if (*k < 0) return Bad("runtime_top_k", "is " + Str(static_cast<int64_t>(*k)) + ", needs >= 0");
    r.params.sampling.top_k = static_cast<int32_t>(*k);
  }
  if (const double* p = scalar("runtime_top_p")) {
    if (!(*p > 0 && *p <= 1)) return Bad("runtime_top_p", "must be in (0, 1]");
    r.params.sampling.top_p = static_cast<float>(*p);
  }
  for (const char* name : {"seed", "random_seed"}) {
    if (const auto it = got.find(name); it != got.end()) {
      if (r.seeded) return InvalidArgumentError("give seed or random_seed, not both");
      r.params.sampling.seed = it->second.u64[0];
      r.seeded = true;
    }
  }
  if (const auto it = got.find("stop_words_list"); it != got.end()) {
    TP_RETURN_IF_ERROR(ParseStopWords(it->second, &r.params));
  }
  if (const double* b = scalar("streaming")) r.streaming = *b != 0;
  if (const double* b = scalar("return_log_probs")) r.params.return_log_probs = *b != 0;
  if (const double* b = scalar("exclude_input_in_output")) r.exclude_input = *b != 0;
  if (q.outputs_size() > 0) {
    r.want_output_ids = r.want_sequence_length = false;
    for (const auto& o : q.outputs()) {
      bool* want = o.name() == "output_ids"         ? &r.want_output_ids
                   : o.name() == "sequence_length"  ? &r.want_sequence_length
                   : o.name() == "output_log_probs" ? &r.want_log_probs
                                                    : nullptr;
      if (want == nullptr) {
        return InvalidArgumentError("unknown requested output '" + ClientText(o.name()) +
                                    "' (outputs: output_ids, sequence_length, output_log_probs)");
      }
      if (*want) return InvalidArgumentError("output '" + o.name() + "' is requested twice");
      *want = true;
    }
  } else {
    r.want_log_probs = r.params.return_log_probs;
  }
  if (r.want_log_probs && !r.params.return_log_probs) {
    return InvalidArgumentError(
        "output 'output_log_probs' needs the input return_log_probs = true");
  }
  return r;
}

}  // namespace tpserve
