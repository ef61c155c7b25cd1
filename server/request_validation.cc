#include "server/request_validation.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

namespace tpserve {
namespace {

constexpr char kInput[] = "input_ids";
constexpr char kLogits[] = "logits";
constexpr char kNextToken[] = "next_token_id";
constexpr char kBinaryDataSize[] = "binary_data_size";
constexpr char kBinaryData[] = "binary_data";

// A client's shape as an error shows it: the first 8 dimensions, then how many there are
// (a shape of thousands of dimensions must not make a status too long for the client's
// metadata limit, nor a log line that long).
std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& shape) {
  constexpr int kShown = 8;
  std::string s = "[";
  for (int i = 0; i < shape.size() && i < kShown; ++i) {
    s += (i ? "," : "") + std::to_string(shape[i]);
  }
  if (shape.size() > kShown) s += ",...; " + std::to_string(shape.size()) + " dimensions";
  return s + "]";
}

Status BadId(int64_t i, int64_t v, int64_t vocab) {
  return InvalidArgumentError("input 'input_ids': token " + std::to_string(i) + " has id " +
                              std::to_string(v) + ", outside [0, " + std::to_string(vocab) + ")");
}

// The first key of a parameters map other than `accepted` (null: none is), for the error
// naming it (sorted: the map's iteration order is unspecified); empty if there is none.
template <typename Map>
std::string FirstKey(const Map& m, const char* accepted = nullptr) {
  std::string first;
  bool found = false;
  for (const auto& [key, value] : m) {
    if (accepted != nullptr && key == accepted) continue;
    if (!found || key < first) first = key;
    found = true;
  }
  return first;
}

// The outputs `q` asks for, into p->want_logits and p->want_next (none listed: both, as
// ParsedRequest's defaults say); INVALID_ARGUMENT for an unknown or repeated output or an
// output parameter other than a bool binary_data.
Status ParseRequestedOutputs(const inference::ModelInferRequest& q, ParsedRequest* p) {
  if (q.outputs_size() == 0) return Status::Ok();
  p->want_logits = p->want_next = false;
  for (const auto& o : q.outputs()) {
    bool* wanted = nullptr;
    if (o.name() == kLogits) {
      wanted = &p->want_logits;
    } else if (o.name() == kNextToken) {
      wanted = &p->want_next;
    } else {
      return InvalidArgumentError("unknown requested output '" + ClientText(o.name()) +
                                  "' (outputs: logits, next_token_id)");
    }
    if (*wanted) {
      return InvalidArgumentError("output '" + o.name() + "' is requested twice");
    }
    // binary_data (KServe's and Triton's clients): over gRPC every output is in
    // raw_output_contents, which those clients read whatever they asked for.
    if (o.parameters().size() > o.parameters().count(kBinaryData)) {
      return InvalidArgumentError("output '" + o.name() + "': parameter '" +
                                  ClientText(FirstKey(o.parameters(), kBinaryData)) +
                                  "' is not supported (outputs are raw logits and the argmax; "
                                  "only binary_data is accepted)");
    }
    if (const auto it = o.parameters().find(kBinaryData);
        it != o.parameters().end() &&
        it->second.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return InvalidArgumentError("output '" + o.name() +
                                  "': parameter 'binary_data' must be a bool_param");
    }
    *wanted = true;
  }
  return Status::Ok();
}

}  // namespace

std::string ClientText(std::string_view s) {
  std::string out;
  const size_t shown = std::min(s.size(), kClientTextMax);
  for (size_t i = 0; i < shown; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c >= 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (shown < s.size()) out += "...(" + std::to_string(s.size()) + " bytes)";
  return out;
}

StatusOr<ParsedRequest> ValidateInferRequest(const inference::ModelInferRequest& q,
                                             const RequestLimits& limits) {
  if (!q.parameters().empty()) {
    return InvalidArgumentError("request parameter '" + ClientText(FirstKey(q.parameters())) +
                                "' is not supported (this model takes no parameters)");
  }
  if (q.inputs_size() != 1 || q.inputs(0).name() != kInput) {
    std::string names;
    int listed = 0;
    for (const auto& in : q.inputs()) {
      if (++listed > 8) {
        names += ", ...";
        break;
      }
      names += (names.empty() ? "'" : ", '") + ClientText(in.name()) + "'";
    }
    return InvalidArgumentError("expected exactly one input named 'input_ids', got " +
                                std::to_string(q.inputs_size()) + " input(s)" +
                                (names.empty() ? "" : ": " + names));
  }
  const auto& in = q.inputs(0);
  const bool i32 = in.datatype() == "INT32", i64 = in.datatype() == "INT64";
  if (!i32 && !i64) {
    return InvalidArgumentError("input 'input_ids': datatype must be INT32 or INT64, got '" +
                                ClientText(in.datatype()) + "'");
  }
  // binary_data_size: KServe's and Triton's Python clients send it with raw contents (it
  // sizes the binary part of an HTTP request); over gRPC it must agree with the raw bytes.
  int64_t binary_data_size = -1;
  if (in.parameters().size() > in.parameters().count(kBinaryDataSize)) {
    return InvalidArgumentError("input 'input_ids': parameter '" +
                                ClientText(FirstKey(in.parameters(), kBinaryDataSize)) +
                                "' is not supported (only binary_data_size)");
  }
  if (const auto it = in.parameters().find(kBinaryDataSize); it != in.parameters().end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kInt64Param ||
        it->second.int64_param() < 0) {
      return InvalidArgumentError(
          "input 'input_ids': parameter 'binary_data_size' must be a non-negative int64_param");
    }
    binary_data_size = it->second.int64_param();
  }
  ParsedRequest p;
  int64_t n = -1;
  if (in.shape_size() == 1 && in.shape(0) >= 1) {
    n = in.shape(0);
  } else if (in.shape_size() == 2 && in.shape(0) == 1 && in.shape(1) >= 1) {
    n = in.shape(1);
    p.batched_shape = true;
  }
  if (n < 1) {
    return InvalidArgumentError("input 'input_ids': shape must be [n] or [1, n] with n >= 1, got " +
                                ShapeString(in.shape()));
  }
  if (n > limits.max_tokens) {
    return InvalidArgumentError("input 'input_ids': " + std::to_string(n) + " tokens, at most " +
                                std::to_string(limits.max_tokens) + " per request");
  }
  // Values in a contents field of another datatype are a client's mistake,
  // never silently ignored.
  const auto& c = in.contents();
  const std::pair<const char*, int> fields[] = {
      {"bool_contents", c.bool_contents_size()},     {"int_contents", c.int_contents_size()},
      {"int64_contents", c.int64_contents_size()},   {"uint_contents", c.uint_contents_size()},
      {"uint64_contents", c.uint64_contents_size()}, {"fp32_contents", c.fp32_contents_size()},
      {"fp64_contents", c.fp64_contents_size()},     {"bytes_contents", c.bytes_contents_size()}};
  const char* own_field = i32 ? "int_contents" : "int64_contents";
  for (const auto& [field, count] : fields) {
    if (count > 0 && std::string_view(field) != own_field) {
      return InvalidArgumentError(
          "input 'input_ids': datatype " + in.datatype() + " takes its values in " + own_field +
          " or raw_input_contents, but " + field + " holds " + std::to_string(count) + " value(s)");
    }
  }
  const size_t elem = i32 ? 4 : 8;
  const bool typed =
      i32 ? in.contents().int_contents_size() > 0 : in.contents().int64_contents_size() > 0;
  if (q.raw_input_contents_size() > 0) {
    if (typed) {
      return InvalidArgumentError(
          "input 'input_ids': give raw_input_contents or typed contents, not both");
    }
    if (q.raw_input_contents_size() != 1) {
      return InvalidArgumentError("raw_input_contents has " +
                                  std::to_string(q.raw_input_contents_size()) +
                                  " entries for 1 input");
    }
    const std::string& raw = q.raw_input_contents(0);
    if (binary_data_size >= 0 && static_cast<uint64_t>(binary_data_size) != raw.size()) {
      return InvalidArgumentError("input 'input_ids': parameter binary_data_size says " +
                                  std::to_string(binary_data_size) + " bytes, raw contents hold " +
                                  std::to_string(raw.size()));
    }
    if (raw.size() != static_cast<size_t>(n) * elem) {
      return InvalidArgumentError(
          "input 'input_ids': raw contents hold " + std::to_string(raw.size()) + " bytes, shape " +
          ShapeString(in.shape()) + " of " + in.datatype() + " needs " + std::to_string(n * elem));
    }
    p.ids.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      int64_t v = 0;
      if (i32) {
        int32_t x;
        std::memcpy(&x, raw.data() + 4 * i, 4);
        v = x;
      } else {
        std::memcpy(&v, raw.data() + 8 * i, 8);
      }
      p.ids[i] = static_cast<int32_t>(std::clamp<int64_t>(v, -1, INT32_MAX));
      if (v < 0 || v >= limits.vocab) return BadId(i, v, limits.vocab);
    }
  } else {
    if (binary_data_size >= 0) {
      return InvalidArgumentError(
          "input 'input_ids': parameter binary_data_size is given, but no raw_input_contents");
    }
    const int64_t count =
        i32 ? in.contents().int_contents_size() : in.contents().int64_contents_size();
    if (count != n) {
      return InvalidArgumentError("input 'input_ids': contents hold " + std::to_string(count) +
                                  " values, shape " + ShapeString(in.shape()) + " needs " +
                                  std::to_string(n));
    }
    p.ids.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = i32 ? in.contents().int_contents(i) : in.contents().int64_contents(i);
      if (v < 0 || v >= limits.vocab) return BadId(i, v, limits.vocab);
      p.ids[i] = static_cast<int32_t>(v);
    }
  }
  TP_RETURN_IF_ERROR(ParseRequestedOutputs(q, &p));
  return p;
}

}  // namespace tpserve
