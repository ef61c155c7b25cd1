#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "engine/safetensors_internal.h"

namespace tpserve {

using namespace safetensors_detail;  // the format names and error wording both halves share

namespace {

using Json = nlohmann::json;

// A valid header nests three levels deep (header, entry, shape); anything much
// deeper is garbage, and the cap keeps the parser's stacks small.
constexpr size_t kMaxJsonDepth = 32;
// A header's arrays are shapes and data_offsets: no tensor has more
// dimensions than this. Bounds the memory a header's DOM takes.
constexpr size_t kMaxArrayElements = 64;
// Entries of "__metadata__" (HF writes one: "format").
constexpr size_t kMaxMetadataEntries = 65536;
// Names quoted in errors, and nlohmann's messages (which end with the
// offending token, possibly megabytes of it), are cut to these many bytes.
constexpr size_t kMaxQuotedBytes = 200;
constexpr size_t kMaxParserMessageBytes = 400;

struct DtypeInfo {
  StDtype dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DtypeInfo, 15> kDtypes = {{
    {StDtype::kF32, "F32", 4},
    {StDtype::kF16, "F16", 2},
    {StDtype::kBF16, "BF16", 2},
    {StDtype::kF8E4M3, "F8_E4M3", 1},
    {StDtype::kF8E5M2, "F8_E5M2", 1},
    {StDtype::kI8, "I8", 1},
    {StDtype::kU8, "U8", 1},
    {StDtype::kI16, "I16", 2},
    {StDtype::kU16, "U16", 2},
    {StDtype::kI32, "I32", 4},
    {StDtype::kU32, "U32", 4},
    {StDtype::kI64, "I64", 8},
    {StDtype::kU64, "U64", 8},
    {StDtype::kBool, "BOOL", 1},
    {StDtype::kF64, "F64", 8},
}};

std::string AllowedDtypeNames() {
  std::string s;
  for (const DtypeInfo& d : kDtypes) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

// Length of the well-formed UTF-8 sequence (RFC 3629: no overlongs, no
// surrogates, at most U+10FFFF) at the start of [p, p + n), or 0 if there is
// none. The same rules as nlohmann's lexer, so that what the writer accepts
// the reader accepts too.
size_t Utf8SequenceLength(const unsigned char* p, size_t n) {
  auto cont = [&](size_t i, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
    return i < n && p[i] >= lo && p[i] <= hi;
  };
  const unsigned char c = p[0];
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c == 0xE0) return cont(1, 0xA0) && cont(2) ? 3 : 0;
  if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return cont(1) && cont(2) ? 3 : 0;
  if (c == 0xED) return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0;
  if (c == 0xF0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
  if (c >= 0xF1 && c <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
  if (c == 0xF4) return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0;
  return 0;
}

// `s` made safe and short for an error message: control characters, quotes,
// backslashes and bytes that are not valid UTF-8 are escaped; long text is cut.
std::string Sanitize(std::string_view s, size_t max_bytes = kMaxQuotedBytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size() && out.size() < max_bytes) {
    const unsigned char c = p[i];
    const size_t len = Utf8SequenceLength(p + i, s.size() - i);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (len == 0 || c < 0x20 || c == 0x7F) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out.append(s.data() + i, len);
      i += len;
      continue;
    }
    ++i;
  }
  if (i < s.size()) out += "...";
  return out;
}

// A JSON value for an error message: scalars in full, containers by type.
std::string Describe(const Json& j) {
  if (j.is_string()) return Quote(j.get_ref<const std::string&>());
  if (j.is_primitive()) return j.dump();
  return j.type_name();
}

std::optional<uint64_t> AsNonNegativeInteger(const Json& j) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer() && j.get<int64_t>() >= 0)
    return static_cast<uint64_t>(j.get<int64_t>());
  return std::nullopt;
}

}  // namespace

namespace safetensors_detail {

bool IsValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t len = Utf8SequenceLength(p + i, s.size() - i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string Quote(std::string_view s) { return "\"" + Sanitize(s) + "\""; }

std::string TensorContext(std::string_view name) { return "tensor " + Quote(name) + ": "; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// Element count of `shape`, or nullopt if it does not fit int64. A zero
// dimension makes the product zero however large the others are.
std::optional<int64_t> CheckedNumel(const std::vector<int64_t>& shape) {
  if (std::any_of(shape.begin(), shape.end(), [](int64_t d) { return d < 0; })) return std::nullopt;
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

// Maps a failed system call onto a status whose message names the path.
Status ErrnoError(int err, const std::string& path, std::string_view call) {
  std::string msg = path + ": " + std::string(call) + ": " + std::strerror(err);
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return NotFoundError(std::move(msg));
    case EACCES:
    case EPERM:
    case EROFS:
      return Status(StatusCode::kPermissionDenied, std::move(msg));
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EFBIG:
      return ResourceExhaustedError(std::move(msg));
    default:
      return Status(StatusCode::kUnknown, std::move(msg));
  }
}

}  // namespace safetensors_detail

namespace {

// Builds the header's DOM through nlohmann's SAX interface rather than
// json::parse, because the DOM parser silently keeps the last of duplicate
// keys, throws on errors, and does not bound nesting or the tensor count
// before doing the work.
class HeaderSax final : public nlohmann::json_sax<Json> {
 public:
  explicit HeaderSax(size_t max_tensors) : max_tensors_(max_tensors) {}

  Json& root() { return root_; }
  // Set when parsing stopped on a semantic problem (duplicate key, ...).
  const std::string& semantic_error() const { return semantic_error_; }
  // Set when nlohmann reported a syntax error.
  const std::string& syntax_error() const { return syntax_error_; }

  bool null() override { return Add(Json(nullptr)) != nullptr; }
  bool boolean(bool v) override { return Add(Json(v)) != nullptr; }
  bool number_integer(number_integer_t v) override { return Add(Json(v)) != nullptr; }
  bool number_unsigned(number_unsigned_t v) override { return Add(Json(v)) != nullptr; }
  bool number_float(number_float_t v, const string_t&) override { return Add(Json(v)) != nullptr; }
  bool string(string_t& v) override { return Add(Json(std::move(v))) != nullptr; }
  bool binary(binary_t&) override {  // JSON text has no binary values
    semantic_error_ = "unexpected binary value";
    return false;
  }

  bool start_object(std::size_t) override { return Open(Json::object()); }
  bool start_array(std::size_t) override { return Open(Json::array()); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }

  bool key(string_t& k) override {
    Frame& top = stack_.back();
    if (top.value->contains(k)) {
      if (stack_.size() == 1) {
        semantic_error_ = k == kMetadataKey ? std::string(kMetadataKey) + " appears twice"
                                            : TensorContext(k) + "name appears twice in the header";
      } else {
        semantic_error_ = TopLevelContext() + "duplicate key " + Quote(k);
      }
      return false;
    }
    if (stack_.size() == 2 && stack_[1].key == kMetadataKey &&
        top.value->size() >= kMaxMetadataEntries) {
      semantic_error_ = std::string(kMetadataKey) + ": more than " +
                        std::to_string(kMaxMetadataEntries) + " entries";
      return false;
    }
    // Inside a tensor's entry only its three keys may appear: an unknown one is refused
    // here, as it is read, so that a small header cannot make the parser build a large tree
    // under keys that would be refused afterwards anyway.
    if (stack_.size() == 2 && stack_[1].key != kMetadataKey && k != "dtype" && k != "shape" &&
        k != "data_offsets") {
      semantic_error_ =
          TopLevelContext() + "unknown key " + Quote(k) + " (allowed: dtype, shape, data_offsets)";
      return false;
    }
    if (stack_.size() == 1 && k != kMetadataKey && ++top_level_tensors_ > max_tensors_) {
      semantic_error_ =
          "more than " + std::to_string(max_tensors_) + " tensors (SafetensorsLimits::max_tensors)";
      return false;
    }
    pending_key_ = std::move(k);
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const Json::exception& ex) override {
    std::string_view what = ex.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " tag.
    if (!what.empty() && what.front() == '[') {
      const size_t close = what.find("] ");
      if (close != std::string_view::npos) what.remove_prefix(close + 2);
    }
    syntax_error_ = Sanitize(what, kMaxParserMessageBytes);
    return false;
  }

 private:
  struct Frame {
    Json* value;
    std::string key;  // under which `value` sits in its parent object ("" in an array)
  };

  // Why `container`, about to be opened, cannot be part of a valid header (the whole
  // message), or "" if it can:
  // an entry's values hold no containers, except a tensor's shape and data_offsets (arrays,
  // whose elements are integers).
  std::string NestedValueError(const Json& container) const {
    if (stack_.size() < 2 || !stack_[0].value->is_object()) return "";
    const std::string got = " (got " + std::string(container.type_name()) + ")";
    const Json& entry = *stack_[1].value;
    if (stack_[1].key == kMetadataKey) {
      if (!entry.is_object())
        return std::string(kMetadataKey) + " is not a JSON object of strings (got array)";
      return TopLevelContext() + "value of key " + Quote(pending_key_) + " is not a string" + got;
    }
    if (!entry.is_object()) return TopLevelContext() + "entry is not a JSON object (got array)";
    if (stack_.size() == 2) {  // the entry's value under pending_key_
      return pending_key_ == "dtype" ? TopLevelContext() + "dtype is not a string" + got : "";
    }
    const std::string& key = stack_[2].key;
    if (!stack_[2].value->is_array())
      return TopLevelContext() + key + " is not an array (got object)";
    return TopLevelContext() + key + "[" + std::to_string(stack_[2].value->size()) +
           "] is not a non-negative integer" + got;
  }

  // "tensor "w": " or "__metadata__: " for the top-level entry being parsed.
  std::string TopLevelContext() const {
    if (stack_.size() < 2 || !stack_[0].value->is_object()) return "";
    const std::string& k = stack_[1].key;
    return k == kMetadataKey ? std::string(kMetadataKey) + ": " : TensorContext(k);
  }

  // Inserts `v` into the innermost open container (or makes it the root) and
  // returns where it now lives. Pointers into a parent array stay valid: the
  // parent gets no new elements until the child is closed.
  Json* Add(Json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& parent = *stack_.back().value;
    if (parent.is_object()) {
      auto& obj = parent.get_ref<Json::object_t&>();
      return &obj.emplace(pending_key_, std::move(v)).first->second;
    }
    auto& arr = parent.get_ref<Json::array_t&>();
    if (arr.size() >= kMaxArrayElements) {
      semantic_error_ = TopLevelContext() + "an array with more than " +
                        std::to_string(kMaxArrayElements) +
                        " elements (a shape has at most that many dimensions)";
      return nullptr;
    }
    arr.push_back(std::move(v));
    return &arr.back();
  }

  bool Open(Json container) {
    if (stack_.size() >= kMaxJsonDepth) {
      semantic_error_ = "JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels";
      return false;
    }
    // Nothing in the format nests below an entry's values (a shape and data_offsets are
    // arrays of integers, dtype and __metadata__'s values strings): refused as read, as
    // above, with the message the checks after parsing would give.
    if (std::string nested = NestedValueError(container); !nested.empty()) {
      semantic_error_ = std::move(nested);
      return false;
    }
    std::string key;
    if (!stack_.empty() && stack_.back().value->is_object()) key = pending_key_;
    Json* v = Add(std::move(container));
    if (v == nullptr) return false;
    stack_.push_back(Frame{v, std::move(key)});
    return true;
  }

  bool Close() {
    stack_.pop_back();
    return true;
  }

  const size_t max_tensors_;
  size_t top_level_tensors_ = 0;
  Json root_;
  std::vector<Frame> stack_;
  std::string pending_key_;
  std::string semantic_error_;
  std::string syntax_error_;
};

// Where a tensor lies in the byte buffer, for the overlap check.
struct ByteRange {
  uint64_t begin;
  uint64_t end;
  const TensorView* tensor;
};

class Parser {
 public:
  Parser(const uint8_t* data, size_t size, const std::string& source,
         const SafetensorsLimits& limits)
      : data_(data), size_(size), source_(source), limits_(limits) {}

  StatusOr<ParsedSafetensors> Run() {
    if (size_ < kLengthPrefixBytes) {
      return Error("file is " + std::to_string(size_) +
                   " bytes, shorter than the 8-byte header length prefix");
    }
    uint64_t n = 0;
    for (size_t i = 0; i < kLengthPrefixBytes; ++i) n |= static_cast<uint64_t>(data_[i]) << (8 * i);
    if (n == 0) return Error("header length is 0");
    if (n > limits_.max_header_bytes) {
      return Error("header length " + std::to_string(n) + " exceeds the limit of " +
                   std::to_string(limits_.max_header_bytes) +
                   " bytes (SafetensorsLimits::max_header_bytes)");
    }
    if (n > size_ - kLengthPrefixBytes) {
      return Error("header length " + std::to_string(n) + " runs past the end of the file (" +
                   std::to_string(size_ - kLengthPrefixBytes) + " bytes follow the 8-byte prefix)");
    }
    out_.header_bytes = n;
    out_.data_begin = kLengthPrefixBytes + static_cast<size_t>(n);
    buffer_ = data_ + out_.data_begin;
    buffer_size_ = size_ - out_.data_begin;

    const char* text = reinterpret_cast<const char*>(data_ + kLengthPrefixBytes);
    // nlohmann's lexer takes a NUL byte for the end of input and would ignore
    // whatever follows it; valid JSON text never contains one.
    if (const void* nul = std::memchr(text, '\0', n); nul != nullptr) {
      return Error("header is not valid UTF-8 JSON: NUL byte at header offset " +
                   std::to_string(static_cast<const char*>(nul) - text));
    }
    HeaderSax sax(limits_.max_tensors);
    bool parsed = false;
    try {  // sax_parse reports through the handler; this only guards the unexpected
      parsed = Json::sax_parse(text, text + n, &sax);
    } catch (const Json::exception& e) {
      return Error(std::string("header is not valid JSON: ") +
                   Sanitize(e.what(), kMaxParserMessageBytes));
    }
    if (!parsed) {
      if (!sax.semantic_error().empty()) return Error(sax.semantic_error());
      return Error("header is not valid UTF-8 JSON: " + sax.syntax_error());
    }
    const Json& root = sax.root();
    if (!root.is_object()) {
      return Error(std::string("header is not a JSON object (got ") + root.type_name() + ")");
    }

    out_.tensors.reserve(root.size());
    for (const auto& [name, entry] : root.items()) {
      if (name == kMetadataKey) {
        TP_RETURN_IF_ERROR(ParseMetadata(entry));
      } else {
        TP_RETURN_IF_ERROR(ParseTensor(name, entry));
      }
    }
    // Sorted with the comparison Find uses, whatever order the JSON object kept.
    std::sort(out_.tensors.begin(), out_.tensors.end(),
              [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
    TP_RETURN_IF_ERROR(CheckNoOverlap());
    return std::move(out_);
  }

 private:
  Status Error(const std::string& what) const {
    return InvalidArgumentError(source_ + ": " + what);
  }

  Status ParseMetadata(const Json& entry) {
    if (!entry.is_object()) {
      return Error(std::string(kMetadataKey) + " is not a JSON object of strings (got " +
                   entry.type_name() + ")");
    }
    for (const auto& [key, value] : entry.items()) {
      if (!value.is_string()) {
        return Error(std::string(kMetadataKey) + ": value of key " + Quote(key) +
                     " is not a string (got " + Describe(value) + ")");
      }
      out_.metadata.emplace(key, value.get<std::string>());
    }
    return Status::Ok();
  }

  Status ParseTensor(const std::string& name, const Json& entry) {
    const std::string where = TensorContext(name);
    if (name.empty()) return Error(where + "tensor name is empty");
    if (!entry.is_object()) {
      return Error(where + "entry is not a JSON object (got " + Describe(entry) + ")");
    }
    static constexpr std::array<std::string_view, 3> kKeys = {"dtype", "shape", "data_offsets"};
    for (const auto& [key, value] : entry.items()) {
      if (std::find(kKeys.begin(), kKeys.end(), key) == kKeys.end()) {
        return Error(where + "unknown key " + Quote(key) +
                     " (allowed: dtype, shape, data_offsets)");
      }
    }
    for (std::string_view key : kKeys) {
      if (!entry.contains(key)) return Error(where + "missing key \"" + std::string(key) + "\"");
    }

    TensorView view;
    view.name = name;

    const Json& dtype = entry["dtype"];
    if (!dtype.is_string()) {
      return Error(where + "dtype is not a string (got " + Describe(dtype) + ")");
    }
    std::optional<StDtype> st = StDtypeFromName(dtype.get_ref<const std::string&>());
    if (!st) {
      return Error(where + "unknown dtype " + Describe(dtype) +
                   " (allowed: " + AllowedDtypeNames() + ")");
    }
    view.dtype = *st;

    const Json& shape = entry["shape"];
    if (!shape.is_array()) {
      return Error(where + "shape is not an array (got " + Describe(shape) + ")");
    }
    view.shape.reserve(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
      std::optional<uint64_t> d = AsNonNegativeInteger(shape[i]);
      if (!d || *d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(where + "shape[" + std::to_string(i) +
                     "] is not a non-negative integer that fits int64 (got " + Describe(shape[i]) +
                     ")");
      }
      view.shape.push_back(static_cast<int64_t>(*d));
    }
    std::optional<int64_t> numel = CheckedNumel(view.shape);
    if (!numel) {
      return Error(where + "shape " + ShapeString(view.shape) +
                   " has more elements than fit in int64");
    }
    size_t needed = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(*numel), StDtypeSize(view.dtype), &needed)) {
      return Error(where + "shape " + ShapeString(view.shape) + " of " +
                   std::string(StDtypeName(view.dtype)) + " has more bytes than fit in size_t");
    }

    const Json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2) {
      return Error(
          where + "data_offsets is not an array [begin, end] (got " + Describe(offsets) +
          (offsets.is_array() ? " of " + std::to_string(offsets.size()) + " elements" : "") + ")");
    }
    std::array<uint64_t, 2> be{};
    for (size_t i = 0; i < 2; ++i) {
      std::optional<uint64_t> v = AsNonNegativeInteger(offsets[i]);
      if (!v) {
        return Error(where + "data_offsets[" + std::to_string(i) +
                     "] is not a non-negative integer (got " + Describe(offsets[i]) + ")");
      }
      be[i] = *v;
    }
    const auto [begin, end] = be;
    const std::string range = "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
    if (begin > end) return Error(where + "data_offsets " + range + " has begin > end");
    if (end > buffer_size_) {
      return Error(where + "data_offsets " + range + " end is beyond the byte buffer (" +
                   std::to_string(buffer_size_) + " bytes)");
    }
    if (end - begin != needed) {
      return Error(where + "data_offsets " + range + " cover " + std::to_string(end - begin) +
                   " bytes, but " + std::string(StDtypeName(view.dtype)) + " " +
                   ShapeString(view.shape) + " needs " + std::to_string(needed) + " (" +
                   std::to_string(*numel) + " elements of " +
                   std::to_string(StDtypeSize(view.dtype)) + " bytes)");
    }
    view.data = buffer_ + begin;
    view.bytes = needed;
    out_.tensors.push_back(std::move(view));
    return Status::Ok();
  }

  // Tensors must not share bytes; empty tensors occupy none. Gaps are fine.
  Status CheckNoOverlap() const {
    std::vector<ByteRange> ranges;
    ranges.reserve(out_.tensors.size());
    for (const TensorView& t : out_.tensors) {
      if (t.bytes == 0) continue;
      const auto begin = static_cast<uint64_t>(t.data - buffer_);
      ranges.push_back({begin, begin + t.bytes, &t});
    }
    std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    for (size_t i = 1; i < ranges.size(); ++i) {
      const ByteRange& a = ranges[i - 1];
      const ByteRange& b = ranges[i];
      // Sorted by begin and disjoint so far, so `a` has the largest end seen.
      if (b.begin < a.end) {
        return Error("tensors " + Quote(a.tensor->name) + " [" + std::to_string(a.begin) + ", " +
                     std::to_string(a.end) + "] and " + Quote(b.tensor->name) + " [" +
                     std::to_string(b.begin) + ", " + std::to_string(b.end) +
                     "] overlap in data_offsets");
      }
    }
    return Status::Ok();
  }

  const uint8_t* data_;
  size_t size_;
  const std::string& source_;
  const SafetensorsLimits& limits_;
  const uint8_t* buffer_ = nullptr;
  size_t buffer_size_ = 0;
  ParsedSafetensors out_;
};

// Closes a file descriptor on scope exit (SafetensorsFile::Open's; the
// mapping outlives it).
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);  // read-only: nothing to lose
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

std::string_view StDtypeName(StDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "INVALID";
}

size_t StDtypeSize(StDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d.size;
  }
  return 0;
}

std::optional<StDtype> StDtypeFromName(std::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const TensorView* ParsedSafetensors::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorView& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

StatusOr<ParsedSafetensors> ParseSafetensors(const uint8_t* data, size_t size,
                                             const std::string& source,
                                             const SafetensorsLimits& limits) {
  return Parser(data, size, source, limits).Run();
}

// ---------------------------------------------------------------------------
// SafetensorsFile

StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path,
                                                const SafetensorsLimits& limits) {
  // O_NONBLOCK: opening a FIFO (or another special file) named *.safetensors must not wait
  // for a writer; it is refused as not a regular file just below. It changes nothing for the
  // regular file's reads.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) return ErrnoError(errno, path, "open");
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, path, "fstat");
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(path + ": not a regular file");
  const auto size = static_cast<size_t>(st.st_size);
  void* map = nullptr;
  if (size > 0) {  // mmap rejects length 0; the parser reports the short file
    map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (map == MAP_FAILED) return ErrnoError(errno, path, "mmap");
  }
  // The mapping outlives the descriptor; fd closes here or on return.
  StatusOr<ParsedSafetensors> parsed =
      ParseSafetensors(static_cast<const uint8_t*>(map), size, path, limits);
  if (!parsed.ok()) {
    if (map != nullptr) ::munmap(map, size);
    return parsed.status();
  }
  return SafetensorsFile(path, map, size, std::move(parsed).value());
}

SafetensorsFile::SafetensorsFile(std::string path, void* map, size_t map_bytes,
                                 ParsedSafetensors contents)
    : path_(std::move(path)), map_(map), map_bytes_(map_bytes), contents_(std::move(contents)) {}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      contents_(std::move(other.contents_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    contents_ = std::move(other.contents_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() noexcept {
  // munmap only fails for arguments that mmap itself returned, i.e. never.
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

StatusOr<const TensorView*> SafetensorsFile::Get(std::string_view name) const {
  const TensorView* t = Find(name);
  if (t == nullptr) {
    return NotFoundError(path_ + ": no tensor " + Quote(name) + " (file has " +
                         std::to_string(tensors().size()) + " tensors)");
  }
  return t;
}

StatusOr<const TensorView*> SafetensorsFile::Get(std::string_view name, StDtype dtype,
                                                 const std::vector<int64_t>& shape) const {
  TP_ASSIGN_OR_RETURN(const TensorView* t, Get(name));
  if (t->dtype != dtype || t->shape != shape) {
    return InvalidArgumentError(path_ + ": " + TensorContext(name) + "expected " +
                                std::string(StDtypeName(dtype)) + " " + ShapeString(shape) +
                                ", got " + std::string(StDtypeName(t->dtype)) + " " +
                                ShapeString(t->shape));
  }
  return t;
}

}  // namespace tpserve
