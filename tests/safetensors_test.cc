// Unit tests for the safetensors reader and writer: round trips, Get's
// checks, one hand-made malformed file per validation rule, the writer's
// checks, and robustness against truncation and header corruption (parsed
// from exactly-sized heap buffers so that ASan sees any out-of-bounds read).
#include "engine/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace tpserve {
namespace {

std::string TestName() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// A fresh path in the test's temporary directory, unique per test and tag.
std::string TempPath(const std::string& tag = "") {
  std::string path = ::testing::TempDir() + "/st_" + TestName() + tag + ".safetensors";
  ::unlink(path.c_str());
  return path;
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string LengthPrefix(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A raw file: the length prefix (the header's size unless given), the header
// text, then the byte buffer.
std::string RawFile(const std::string& header, const std::string& data = "") {
  return LengthPrefix(header.size()) + header + data;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Checks that `s` is INVALID_ARGUMENT, starts with `source` and mentions
// every needle.
void ExpectInvalid(const Status& s, const std::string& source,
                   const std::vector<std::string>& needles) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(s.message().rfind(source + ": ", 0), 0u) << s.message();
  for (const std::string& n : needles) EXPECT_TRUE(Contains(s.message(), n)) << s.message();
}

// Writes `bytes` to a fresh file, opens it and checks the error.
void ExpectOpenInvalid(const std::string& bytes, const std::vector<std::string>& needles,
                       const SafetensorsLimits& limits = {}) {
  const std::string path = TempPath();
  WriteAll(path, bytes);
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path, limits);
  ASSERT_FALSE(f.ok()) << "opened a malformed file";
  ExpectInvalid(f.status(), path, needles);
}

// A header with one F32 tensor "w" whose entry is `entry`, and 16 data bytes.
void ExpectEntryInvalid(const std::string& entry, const std::vector<std::string>& needles) {
  std::vector<std::string> all = needles;
  all.push_back("tensor \"w\"");
  ExpectOpenInvalid(RawFile("{\"w\":" + entry + "}", std::string(16, '\0')), all);
}

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Points at `bytes`, which must outlive the result.
TensorToWrite ToWrite(const std::string& name, StDtype dtype, std::vector<int64_t> shape,
                      const std::vector<uint8_t>& bytes) {
  return TensorToWrite{name, dtype, std::move(shape), bytes.data(), bytes.size()};
}

// Checks what every successfully parsed file must satisfy.
void ExpectInvariants(const ParsedSafetensors& p, const uint8_t* data, size_t size) {
  ASSERT_LE(p.data_begin, size);
  const uint8_t* buffer = data + p.data_begin;
  const uint8_t* end = data + size;
  for (size_t i = 0; i < p.tensors.size(); ++i) {
    const TensorView& t = p.tensors[i];
    if (i > 0) {
      EXPECT_LT(p.tensors[i - 1].name, t.name);
    }
    EXPECT_EQ(t.bytes, static_cast<size_t>(t.numel()) * StDtypeSize(t.dtype));
    EXPECT_GE(t.data, buffer);
    EXPECT_LE(t.data, end);
    EXPECT_LE(t.bytes, static_cast<size_t>(end - t.data));
    for (size_t j = 0; j < i; ++j) {
      const TensorView& u = p.tensors[j];
      if (t.bytes == 0 || u.bytes == 0) continue;
      EXPECT_TRUE(t.data + t.bytes <= u.data || u.data + u.bytes <= t.data)
          << t.name << " overlaps " << u.name;
    }
  }
}

// Parses a copy of `bytes[0, len)` in a heap block of exactly `len` bytes.
StatusOr<ParsedSafetensors> ParseExact(const std::string& bytes, size_t len,
                                       const std::string& source, bool check_invariants) {
  std::unique_ptr<uint8_t[]> block(new uint8_t[len]);
  if (len > 0) std::memcpy(block.get(), bytes.data(), len);
  StatusOr<ParsedSafetensors> p = ParseSafetensors(block.get(), len, source);
  if (p.ok() && check_invariants) ExpectInvariants(*p, block.get(), len);
  return p;
}

// A small valid file with several dtypes, a scalar, an empty tensor and metadata.
std::string SmallValidFile() {
  const std::string path = TempPath("_small");
  std::vector<float> a = {1.5f, -2.0f, 3.25f};
  std::vector<uint8_t> b = {0x38, 0x40, 0xb8, 0x00, 0x7e};
  std::vector<int64_t> c = {-7};
  std::vector<uint8_t> empty;
  Status s = WriteSafetensors(
      path,
      {ToWrite("a", StDtype::kF32, {3}, Bytes(a)), ToWrite("b.weight", StDtype::kF8E4M3, {5}, b),
       ToWrite("c", StDtype::kI64, {}, Bytes(c)), ToWrite("e", StDtype::kBF16, {0, 2}, empty)},
      {{"format", "pt"}});
  EXPECT_TRUE(s.ok()) << s.ToString();
  return ReadAll(path);
}

// ---------------------------------------------------------------------------
// Dtypes

TEST(StDtypeTest, NamesSizesAndParsing) {
  const std::vector<std::pair<StDtype, std::pair<std::string, size_t>>> cases = {
      {StDtype::kF32, {"F32", 4}},        {StDtype::kF16, {"F16", 2}},
      {StDtype::kBF16, {"BF16", 2}},      {StDtype::kF8E4M3, {"F8_E4M3", 1}},
      {StDtype::kF8E5M2, {"F8_E5M2", 1}}, {StDtype::kI8, {"I8", 1}},
      {StDtype::kU8, {"U8", 1}},          {StDtype::kI16, {"I16", 2}},
      {StDtype::kI32, {"I32", 4}},        {StDtype::kI64, {"I64", 8}},
      {StDtype::kBool, {"BOOL", 1}},      {StDtype::kF64, {"F64", 8}},
      {StDtype::kU16, {"U16", 2}},        {StDtype::kU32, {"U32", 4}},
      {StDtype::kU64, {"U64", 8}},
  };
  for (const auto& [dtype, name_size] : cases) {
    EXPECT_EQ(StDtypeName(dtype), name_size.first);
    EXPECT_EQ(StDtypeSize(dtype), name_size.second) << name_size.first;
    EXPECT_EQ(StDtypeFromName(name_size.first), dtype) << name_size.first;
  }
  EXPECT_FALSE(StDtypeFromName("f32").has_value());
  EXPECT_FALSE(StDtypeFromName("F8_E4M3FN").has_value());
  EXPECT_FALSE(StDtypeFromName("").has_value());
}

// ---------------------------------------------------------------------------
// Round trips

TEST(SafetensorsRoundTripTest, SeveralDtypesScalarsEmptyTensorAndMetadata) {
  const std::string path = TempPath();
  std::vector<float> f32 = {1.0f, -2.5f, 3.0f, 0.0f, 1e-3f, 7.0f};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x7fc0, 0x0001};
  std::vector<uint8_t> fp8 = {
      0x00, 0x38, 0x7e, 0xfe, 0x01, 0x02, 0x03, 0x04,
      0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b};  // 15: misaligns what follows
  std::vector<int64_t> i64_scalar = {-123456789012345};
  std::vector<uint8_t> boolean = {1, 0, 1};
  std::vector<uint8_t> empty;
  std::vector<double> f64_scalar = {3.141592653589793};
  std::vector<int32_t> i32 = {1, -2, 3, -4};
  const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                       {"note", "ünïcødé, \"quoted\""}};
  // Byte copies that outlive `tensors`, which points into them.
  const std::vector<uint8_t> f32_b = Bytes(f32), bf16_b = Bytes(bf16), i64_b = Bytes(i64_scalar),
                             f64_b = Bytes(f64_scalar), i32_b = Bytes(i32);
  std::vector<TensorToWrite> tensors = {
      ToWrite("model.layers.0.weight", StDtype::kF32, {2, 3}, f32_b),
      ToWrite("bf16", StDtype::kBF16, {4}, bf16_b),
      ToWrite("fp8", StDtype::kF8E4M3, {3, 5}, fp8),
      ToWrite("scalar_i64", StDtype::kI64, {}, i64_b),
      ToWrite("mask", StDtype::kBool, {3, 1}, boolean),
      ToWrite("empty", StDtype::kF16, {0, 4}, empty),
      ToWrite("scalar_f64", StDtype::kF64, {}, f64_b),
      ToWrite("i32", StDtype::kI32, {2, 1, 2}, i32_b),
  };
  ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());
  EXPECT_FALSE(Exists(path + ".tmp"));

  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(f->metadata(), metadata);
  ASSERT_EQ(f->tensors().size(), tensors.size());
  for (size_t i = 1; i < f->tensors().size(); ++i) {
    EXPECT_LT(f->tensors()[i - 1].name, f->tensors()[i].name);
  }
  size_t total = 0;
  for (const TensorToWrite& w : tensors) {
    const TensorView* t = f->Find(w.name);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->name, w.name);
    EXPECT_EQ(t->dtype, w.dtype) << w.name;
    EXPECT_EQ(t->shape, w.shape) << w.name;
    EXPECT_EQ(t->bytes, w.bytes) << w.name;
    if (w.bytes > 0) {
      EXPECT_EQ(std::memcmp(t->data, w.data, w.bytes), 0) << w.name;
    }
    total += w.bytes;
  }
  EXPECT_EQ(f->Find("scalar_i64")->numel(), 1);
  EXPECT_EQ(f->Find("empty")->numel(), 0);
  EXPECT_EQ(f->Find("i32")->numel(), 4);
  EXPECT_EQ(f->Find("absent"), nullptr);

  // Header padded to a multiple of 8; data packed, nothing after it.
  const std::string raw = ReadAll(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(raw[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + n + total);
  EXPECT_EQ(f->file_bytes(), raw.size());
}

TEST(SafetensorsRoundTripTest, WriterPacksDataInGivenOrderWithoutGaps) {
  const std::string path = TempPath();
  std::vector<uint8_t> z = {1, 2, 3}, a = {4, 5, 6, 7, 8}, m = {9, 10};
  ASSERT_TRUE(WriteSafetensors(
                  path, {ToWrite("z", StDtype::kU8, {3}, z), ToWrite("a", StDtype::kI8, {5}, a),
                         ToWrite("m", StDtype::kU8, {2}, m)})
                  .ok());
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const TensorView* tz = f->Find("z");
  const TensorView* ta = f->Find("a");
  const TensorView* tm = f->Find("m");
  ASSERT_TRUE(tz && ta && tm);
  EXPECT_EQ(ta->data, tz->data + 3);
  EXPECT_EQ(tm->data, ta->data + 5);
  // The byte buffer starts 8-byte aligned in the file, hence in the mapping.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(tz->data) % 8, 0u);
  // Tensors come back sorted by name whatever the file order.
  EXPECT_EQ(f->tensors()[0].name, "a");
  EXPECT_EQ(f->tensors()[2].name, "z");
}

TEST(SafetensorsRoundTripTest, HeaderIsJsonObjectPaddedWithSpaces) {
  const std::string path = TempPath();
  std::vector<uint8_t> x = {1};
  ASSERT_TRUE(WriteSafetensors(path, {ToWrite("x", StDtype::kU8, {1}, x)}).ok());
  const std::string raw = ReadAll(path);
  ASSERT_GE(raw.size(), 9u);
  const uint64_t n = raw.size() - 8 - 1;
  EXPECT_EQ(raw.substr(0, 8), LengthPrefix(n));
  std::string header = raw.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  const size_t last = header.find_last_not_of(' ');
  EXPECT_EQ(header[last], '}');
  EXPECT_LT(header.size() - last - 1, 8u);
  EXPECT_FALSE(Contains(header, "__metadata__"));  // only written when non-empty
  EXPECT_TRUE(Contains(header, "\"data_offsets\":[0,1]"));
}

TEST(SafetensorsRoundTripTest, NoTensorsAtAll) {
  const std::string path = TempPath();
  ASSERT_TRUE(WriteSafetensors(path, {}).ok());
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_TRUE(f->metadata().empty());
}

TEST(SafetensorsRoundTripTest, WriterReplacesExistingFile) {
  const std::string path = TempPath();
  std::vector<uint8_t> one = {1}, two = {2, 2};
  ASSERT_TRUE(WriteSafetensors(path, {ToWrite("x", StDtype::kU8, {1}, one)}).ok());
  ASSERT_TRUE(WriteSafetensors(path, {ToWrite("y", StDtype::kU8, {2}, two)}).ok());
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->Find("x"), nullptr);
  ASSERT_NE(f->Find("y"), nullptr);
  EXPECT_FALSE(Exists(path + ".tmp"));
}

TEST(SafetensorsRoundTripTest, MoveKeepsViewsValid) {
  const std::string path = TempPath();
  std::vector<float> v = {1, 2, 3, 4};
  ASSERT_TRUE(WriteSafetensors(path, {ToWrite("v", StDtype::kF32, {4}, Bytes(v))}).ok());
  StatusOr<SafetensorsFile> opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok());
  const TensorView* before = opened->Find("v");
  ASSERT_NE(before, nullptr);
  SafetensorsFile moved(std::move(opened).value());
  EXPECT_EQ(moved.Find("v"), before);
  StatusOr<SafetensorsFile> other = SafetensorsFile::Open(path);
  ASSERT_TRUE(other.ok());
  *other = std::move(moved);  // unmaps other's own mapping first
  const TensorView* t = other->Find("v");
  ASSERT_EQ(t, before);
  float got[4];
  std::memcpy(got, t->data, sizeof got);
  EXPECT_EQ(got[3], 4.0f);
  EXPECT_EQ(other->path(), path);
}

TEST(SafetensorsRoundTripTest, ParseInMemoryPointsIntoTheBuffer) {
  const std::string bytes = SmallValidFile();
  std::vector<uint8_t> buf(bytes.begin(), bytes.end());
  StatusOr<ParsedSafetensors> p = ParseSafetensors(buf.data(), buf.size(), "mem");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectInvariants(*p, buf.data(), buf.size());
  ASSERT_EQ(p->tensors.size(), 4u);
  EXPECT_EQ(p->metadata.at("format"), "pt");
  const TensorView* b = p->Find("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, StDtype::kF8E4M3);
  EXPECT_EQ(b->data[2], 0xb8);
  EXPECT_EQ(p->data_begin, 8 + p->header_bytes);
}

// ---------------------------------------------------------------------------
// Get

TEST(SafetensorsGetTest, MissingTensorIsNotFoundNamingFileAndTensor) {
  const std::string path = TempPath();
  std::vector<uint8_t> x = {1};
  ASSERT_TRUE(WriteSafetensors(path, {ToWrite("x", StDtype::kU8, {1}, x)}).ok());
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  StatusOr<const TensorView*> t = f->Get("lm_head.weight");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(t.status().message(), path)) << t.status().message();
  EXPECT_TRUE(Contains(t.status().message(), "\"lm_head.weight\"")) << t.status().message();
  // The checked overload reports NOT_FOUND too.
  EXPECT_EQ(f->Get("lm_head.weight", StDtype::kU8, {1}).status().code(), StatusCode::kNotFound);
  StatusOr<const TensorView*> ok = f->Get("x");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)->name, "x");
}

TEST(SafetensorsGetTest, ChecksDtypeAndShape) {
  const std::string path = TempPath();
  std::vector<float> w(6, 1.0f);
  ASSERT_TRUE(WriteSafetensors(path, {ToWrite("w", StDtype::kF32, {2, 3}, Bytes(w))}).ok());
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  EXPECT_TRUE(f->Get("w", StDtype::kF32, {2, 3}).ok());

  StatusOr<const TensorView*> bad_dtype = f->Get("w", StDtype::kBF16, {2, 3});
  ASSERT_FALSE(bad_dtype.ok());
  ExpectInvalid(bad_dtype.status(), path, {"tensor \"w\"", "expected BF16 [2, 3], got F32 [2, 3]"});

  StatusOr<const TensorView*> bad_shape = f->Get("w", StDtype::kF32, {3, 2});
  ASSERT_FALSE(bad_shape.ok());
  ExpectInvalid(bad_shape.status(), path, {"tensor \"w\"", "expected F32 [3, 2], got F32 [2, 3]"});

  StatusOr<const TensorView*> bad_rank = f->Get("w", StDtype::kF32, {6});
  ASSERT_FALSE(bad_rank.ok());
  ExpectInvalid(bad_rank.status(), path, {"expected F32 [6], got F32 [2, 3]"});
}

// ---------------------------------------------------------------------------
// Open errors that are not about the format

TEST(SafetensorsOpenTest, MissingFileIsNotFound) {
  const std::string path = TempPath();
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(f.status().message(), path)) << f.status().message();
}

// A FIFO named like a checkpoint file: refused at once, not waited on for a writer.
TEST(SafetensorsOpenTest, FifoIsInvalidArgumentWithoutWaiting) {
  const std::string path = ::testing::TempDir() + "/st_fifo.safetensors";
  std::remove(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  auto f = SafetensorsFile::Open(path);  // blocked in open() before the fix
  ExpectInvalid(f.status(), path, {"not a regular file"});
  std::remove(path.c_str());
}

TEST(SafetensorsOpenTest, DirectoryIsInvalidArgument) {
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(::testing::TempDir());
  ASSERT_FALSE(f.ok());
  ExpectInvalid(f.status(), ::testing::TempDir(), {"not a regular file"});
}

// ---------------------------------------------------------------------------
// Malformed files, one per validation rule

TEST(SafetensorsMalformedTest, FileShorterThanEightBytes) {
  for (size_t len = 0; len < 8; ++len) {
    ExpectOpenInvalid(std::string(len, '\x01'),
                      {"file is " + std::to_string(len) + " bytes", "shorter than"});
  }
}

TEST(SafetensorsMalformedTest, HeaderLengthZero) {
  ExpectOpenInvalid(LengthPrefix(0) + "{}", {"header length is 0"});
}

TEST(SafetensorsMalformedTest, HeaderLengthOverLimit) {
  SafetensorsLimits limits;
  limits.max_header_bytes = 16;
  const std::string header = "{\"__metadata__\":{\"k\":\"a long value\"}}";
  ExpectOpenInvalid(RawFile(header),
                    {"header length " + std::to_string(header.size()) + " exceeds the limit of 16"},
                    limits);
  // A length near 2^64 with the default limit, and no data behind it.
  ExpectOpenInvalid(LengthPrefix(UINT64_MAX) + "{}",
                    {"header length 18446744073709551615 exceeds the limit"});
  // The default is the reference implementation's decimal 100,000,000 bytes:
  // one byte more is refused as too long, exactly that many is not (it then
  // fails for running past this short file).
  ExpectOpenInvalid(LengthPrefix(100'000'001) + "{}",
                    {"header length 100000001 exceeds the limit of 100000000"});
  ExpectOpenInvalid(LengthPrefix(100'000'000) + "{}",
                    {"header length 100000000 runs past the end of the file"});
}

TEST(SafetensorsMalformedTest, HeaderLengthPastEndOfFile) {
  ExpectOpenInvalid(LengthPrefix(100) + "{}",
                    {"header length 100 runs past the end of the file", "2 bytes follow"});
}

TEST(SafetensorsMalformedTest, HeaderNotJson) {
  ExpectOpenInvalid(RawFile("{not json}"), {"header is not valid UTF-8 JSON", "parse error"});
  ExpectOpenInvalid(RawFile("{} trailing"), {"header is not valid UTF-8 JSON"});
  ExpectOpenInvalid(RawFile("{\"w\":"), {"header is not valid UTF-8 JSON"});
  // nlohmann's lexer would stop at a NUL and ignore what follows.
  ExpectOpenInvalid(RawFile(std::string("{}\0\0", 4)),
                    {"header is not valid UTF-8 JSON: NUL byte at header offset 2"});
  ExpectOpenInvalid(RawFile(std::string("{}\0{\"hidden\":1}", 15)), {"NUL byte"});
}

TEST(SafetensorsMalformedTest, HeaderNotUtf8) {
  ExpectOpenInvalid(RawFile("{\"__metadata__\":{\"k\":\"\xff\xfe\"}}"),
                    {"header is not valid UTF-8 JSON", "UTF-8"});
  // An encoded surrogate (ED A0 80) and an overlong slash (C0 AF).
  ExpectOpenInvalid(RawFile("{\"\xed\xa0\x80\":1}"), {"not valid UTF-8 JSON"});
  ExpectOpenInvalid(RawFile("{\"\xc0\xaf\":1}"), {"not valid UTF-8 JSON"});
}

TEST(SafetensorsMalformedTest, HeaderNotObject) {
  ExpectOpenInvalid(RawFile("[1, 2]"), {"header is not a JSON object (got array)"});
  ExpectOpenInvalid(RawFile("\"str\""), {"header is not a JSON object (got string)"});
  ExpectOpenInvalid(RawFile("7"), {"header is not a JSON object (got number)"});
}

TEST(SafetensorsMalformedTest, EntryNotObject) {
  ExpectEntryInvalid("5", {"entry is not a JSON object (got 5)"});
  ExpectEntryInvalid("[\"F32\", [4], [0, 16]]", {"entry is not a JSON object (got array)"});
}

TEST(SafetensorsMalformedTest, EntryUnknownKey) {
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16],"scale":1.0})",
                     {"unknown key \"scale\"", "allowed: dtype, shape, data_offsets"});
}

TEST(SafetensorsMalformedTest, EntryMissingKey) {
  ExpectEntryInvalid(R"({"shape":[4],"data_offsets":[0,16]})", {"missing key \"dtype\""});
  ExpectEntryInvalid(R"({"dtype":"F32","data_offsets":[0,16]})", {"missing key \"shape\""});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4]})", {"missing key \"data_offsets\""});
}

TEST(SafetensorsMalformedTest, UnknownDtypeListsAllowedOnes) {
  ExpectEntryInvalid(
      R"({"dtype":"F128","shape":[1],"data_offsets":[0,16]})",
      {"unknown dtype \"F128\"",
       "allowed: F32, F16, BF16, F8_E4M3, F8_E5M2, I8, U8, I16, U16, I32, U32, I64, U64, BOOL, "
       "F64"});
  ExpectEntryInvalid(R"({"dtype":"f32","shape":[4],"data_offsets":[0,16]})",
                     {"unknown dtype \"f32\""});
  ExpectEntryInvalid(R"({"dtype":4,"shape":[4],"data_offsets":[0,16]})",
                     {"dtype is not a string (got 4)"});
}

TEST(SafetensorsMalformedTest, ShapeNotNonNegativeIntegers) {
  ExpectEntryInvalid(R"({"dtype":"F32","shape":4,"data_offsets":[0,16]})",
                     {"shape is not an array (got 4)"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]})",
                     {"shape[1] is not a non-negative integer", "(got -2)"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4.0],"data_offsets":[0,16]})",
                     {"shape[0] is not a non-negative integer", "(got 4.0)"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":["4"],"data_offsets":[0,16]})",
                     {"shape[0] is not a non-negative integer", "(got \"4\")"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[[4]],"data_offsets":[0,16]})",
                     {"shape[0] is not a non-negative integer", "(got array)"});
  // 2^63 fits uint64 but not int64; 2^64 is parsed as a float.
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,16]})",
                     {"shape[0] is not a non-negative integer that fits int64"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,16]})",
                     {"shape[0] is not a non-negative integer"});
}

TEST(SafetensorsMalformedTest, ShapeProductOverflows) {
  ExpectEntryInvalid(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,16]})",
                     {"shape [4294967296, 4294967296] has more elements than fit in int64"});
  // 2^62 elements fit int64, 2^65 bytes of F64 do not fit size_t.
  ExpectEntryInvalid(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,16]})",
                     {"shape [4611686018427387904] of F64 has more bytes than fit in size_t"});
}

TEST(SafetensorsMalformedTest, ZeroDimensionMakesHugeShapeEmpty) {
  // Not an overflow: the product is 0 however large the other dimensions are.
  const std::string path = TempPath();
  WriteAll(
      path,
      RawFile(
          R"({"w":{"dtype":"F64","shape":[4611686018427387904,0,4611686018427387904],"data_offsets":[0,0]}})"));
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const TensorView* w = f->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->numel(), 0);
  EXPECT_EQ(w->bytes, 0u);
}

TEST(SafetensorsMalformedTest, DataOffsetsNotTwoNonNegativeIntegers) {
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4],"data_offsets":16})",
                     {"data_offsets is not an array [begin, end] (got 16)"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4],"data_offsets":[16]})",
                     {"data_offsets is not an array [begin, end]", "of 1 elements"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4],"data_offsets":[0,8,16]})",
                     {"data_offsets is not an array [begin, end]", "of 3 elements"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4],"data_offsets":[-1,15]})",
                     {"data_offsets[0] is not a non-negative integer (got -1)"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16.0]})",
                     {"data_offsets[1] is not a non-negative integer (got 16.0)"});
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[4],"data_offsets":[0,null]})",
                     {"data_offsets[1] is not a non-negative integer (got null)"});
}

TEST(SafetensorsMalformedTest, DataOffsetsBeginAfterEnd) {
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[0],"data_offsets":[16,0]})",
                     {"data_offsets [16, 0] has begin > end"});
}

TEST(SafetensorsMalformedTest, DataOffsetsEndBeyondBuffer) {
  ExpectEntryInvalid(R"({"dtype":"F32","shape":[2],"data_offsets":[12,20]})",
                     {"data_offsets [12, 20] end is beyond the byte buffer (16 bytes)"});
  ExpectEntryInvalid(
      R"({"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]})",
      {"end is beyond the byte buffer"});
}

TEST(SafetensorsMalformedTest, DataOffsetsSizeDisagreesWithShape) {
  ExpectEntryInvalid(
      R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,12]})",
      {"data_offsets [0, 12] cover 12 bytes, but F32 [2, 2] needs 16", "4 elements of 4 bytes"});
  ExpectEntryInvalid(R"({"dtype":"BF16","shape":[],"data_offsets":[0,4]})",
                     {"cover 4 bytes, but BF16 [] needs 2"});
}

TEST(SafetensorsMalformedTest, OverlappingTensors) {
  ExpectOpenInvalid(RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                            std::string(16, '\0')),
                    {"tensors \"a\" [0, 8] and \"b\" [4, 12] overlap"});
  // Same range twice; and one range inside another.
  ExpectOpenInvalid(RawFile(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("y":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})",
                            std::string(4, '\0')),
                    {"\"x\"", "\"y\"", "overlap"});
  ExpectOpenInvalid(RawFile(R"({"outer":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},)"
                            R"("e":{"dtype":"U8","shape":[0],"data_offsets":[3,3]},)"
                            R"("inner":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                            std::string(10, '\0')),
                    {"\"outer\"", "\"inner\"", "overlap"});
}

TEST(SafetensorsMalformedTest, GapsTrailingBytesAndEmptyTensorsInsideOthersAreAllowed) {
  const std::string path = TempPath();
  WriteAll(path,
           RawFile(R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[10,12]},)"
                   R"("a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
                   R"("e":{"dtype":"F32","shape":[0],"data_offsets":[11,11]}})"
                   "   ",  // unpadded header length, trailing spaces
                   std::string("\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d", 14)));
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->tensors().size(), 3u);
  const TensorView* a = f->Find("a");
  const TensorView* b = f->Find("b");
  const TensorView* e = f->Find("e");
  ASSERT_TRUE(a && b && e);
  EXPECT_EQ(a->data[0], 2);
  EXPECT_EQ(b->data[1], 11);
  EXPECT_EQ(e->bytes, 0u);
}

TEST(SafetensorsMalformedTest, MetadataNotObjectOfStrings) {
  ExpectOpenInvalid(RawFile(R"({"__metadata__":["a"]})"),
                    {"__metadata__ is not a JSON object of strings (got array)"});
  ExpectOpenInvalid(RawFile(R"({"__metadata__":{"format":"pt","step":100}})"),
                    {"__metadata__: value of key \"step\" is not a string (got 100)"});
  ExpectOpenInvalid(RawFile(R"({"__metadata__":{"nested":{"a":"b"}}})"),
                    {"value of key \"nested\" is not a string (got object)"});
}

TEST(SafetensorsMalformedTest, DuplicateKeys) {
  const std::string w = R"({"dtype":"U8","shape":[1],"data_offsets":[0,1]})";
  ExpectOpenInvalid(RawFile("{\"w\":" + w + ",\"w\":" + w + "}", "x"),
                    {"tensor \"w\": name appears twice"});
  ExpectOpenInvalid(
      RawFile(R"({"w":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})", "x"),
      {"tensor \"w\": duplicate key \"dtype\""});
  ExpectOpenInvalid(RawFile(R"({"__metadata__":{"k":"1","k":"2"}})"),
                    {"__metadata__: duplicate key \"k\""});
  ExpectOpenInvalid(RawFile(R"({"__metadata__":{},"__metadata__":{}})"),
                    {"__metadata__ appears twice"});
}

TEST(SafetensorsMalformedTest, TooManyTensors) {
  std::string header = "{";
  for (int i = 0; i < 3; ++i) {
    if (i > 0) header += ",";
    header +=
        "\"t" + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}";
  }
  header += ",\"__metadata__\":{}}";
  SafetensorsLimits limits;
  limits.max_tensors = 2;
  ExpectOpenInvalid(RawFile(header), {"more than 2 tensors"}, limits);
  limits.max_tensors = 3;  // __metadata__ does not count
  const std::string path = TempPath("_ok");
  WriteAll(path, RawFile(header));
  EXPECT_TRUE(SafetensorsFile::Open(path, limits).ok());
}

TEST(SafetensorsMalformedTest, EmptyTensorName) {
  ExpectOpenInvalid(RawFile(R"({"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})"),
                    {"tensor \"\": tensor name is empty"});
}

TEST(SafetensorsMalformedTest, DeepNestingIsRejectedWithoutRecursion) {
  ExpectOpenInvalid(RawFile(std::string(200000, '[') + std::string(200000, ']')),
                    {"nested deeper than"});
  // Below an entry nothing nests deeper than a shape's array: refused at the first level
  // too many, with the message the checks after parsing give.
  ExpectOpenInvalid(RawFile("{\"w\":" + std::string(100, '[')),
                    {"tensor \"w\": entry is not a JSON object (got array)"});
  ExpectOpenInvalid(RawFile("{\"w\":{\"shape\":" + std::string(100, '[')),
                    {"tensor \"w\": shape[0] is not a non-negative integer (got array)"});
}

// A small header must not make the parser build a large tree that the checks after
// parsing would refuse anyway: an unknown key in an entry, or a container below one, stops
// the parse where it is read (a 100 MB header of nested objects under an unknown key used
// to take 1.7 GB per rank before its error).
TEST(SafetensorsMalformedTest, UnknownKeysAndNestingInEntriesStopTheParseAtOnce) {
  std::string junk = R"({"w":{"junk":{)";
  for (int i = 0; i < 200000; ++i) junk += (i ? ",\"" : "\"") + std::to_string(i) + "\":{}";
  ExpectOpenInvalid(RawFile(junk + "}}}"),
                    {"tensor \"w\": unknown key \"junk\" (allowed: dtype, shape, data_offsets)"});
  ExpectOpenInvalid(RawFile(R"({"w":{"dtype":{"a":1},"shape":[1],"data_offsets":[0,1]}})"),
                    {"tensor \"w\": dtype is not a string (got object)"});
  ExpectOpenInvalid(RawFile(R"({"w":{"shape":{"a":[1]},"dtype":"U8","data_offsets":[0,1]}})"),
                    {"tensor \"w\": shape is not an array (got object)"});
  ExpectOpenInvalid(RawFile(R"({"__metadata__":[["a"]]})"),
                    {"__metadata__ is not a JSON object of strings (got array)"});
}

TEST(SafetensorsMalformedTest, LongShapesAndHugeMetadataAreRefusedBeforeTheyTakeMemory) {
  // 65 dimensions of 1: a valid product, but no tensor has that many; the
  // parser stops at the 65th element instead of building a DOM of millions.
  std::string dims = "1";
  for (int i = 1; i < 65; ++i) dims += ",1";
  ExpectOpenInvalid(
      RawFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[" + dims + "],\"data_offsets\":[0,4]}}"),
      {"tensor \"w\": an array with more than 64 elements"});
  std::string meta = "{\"__metadata__\":{";
  for (int i = 0; i <= 65536; ++i) meta += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":\"v\"";
  ExpectOpenInvalid(RawFile(meta + "}}"), {"__metadata__: more than 65536 entries"});
}

TEST(SafetensorsMalformedTest, MessagesStayShortAndPrintable) {
  // A megabyte-long string that ends in an invalid byte: nlohmann's message
  // quotes the whole token; ours must not.
  std::string name(1 << 20, 'n');
  const std::string path = TempPath();
  WriteAll(path, RawFile("{\"" + name + "\x01\":1}"));
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  ExpectInvalid(f.status(), path, {"not valid UTF-8 JSON"});
  EXPECT_LT(f.status().message().size(), path.size() + 600);
  const std::string message = f.status().message();
  for (char c : message) EXPECT_GE(static_cast<unsigned char>(c), 0x20);
  // A long tensor name with control characters, reported by the semantic checks.
  ExpectOpenInvalid(RawFile("{\"" + name + "\\u0001\":5}"), {"nnn...\"", "entry is not"});
}

// ---------------------------------------------------------------------------
// Writer validation

void ExpectWriteInvalid(const std::vector<TensorToWrite>& tensors,
                        const std::vector<std::string>& needles,
                        const std::map<std::string, std::string>& metadata = {}) {
  const std::string path = TempPath();
  Status s = WriteSafetensors(path, tensors, metadata);
  ExpectInvalid(s, path, needles);
  EXPECT_FALSE(Exists(path));
  EXPECT_FALSE(Exists(path + ".tmp"));
}

TEST(SafetensorsWriterTest, RejectsBadTensors) {
  std::vector<uint8_t> four(4), eight(8);
  ExpectWriteInvalid({ToWrite("w", StDtype::kF32, {2}, four)},
                     {"tensor \"w\"", "bytes is 4, but F32 [2] needs 8"});
  ExpectWriteInvalid({ToWrite("w", StDtype::kU8, {4}, four), ToWrite("w", StDtype::kU8, {4}, four)},
                     {"tensor \"w\"", "name appears twice"});
  ExpectWriteInvalid({ToWrite("", StDtype::kU8, {4}, four)}, {"tensor name is empty"});
  ExpectWriteInvalid({ToWrite("__metadata__", StDtype::kU8, {4}, four)},
                     {"tensor \"__metadata__\"", "reserved"});
  ExpectWriteInvalid({ToWrite("w", StDtype::kU8, {-4}, four)},
                     {"tensor \"w\"", "negative dimension"});
  ExpectWriteInvalid({ToWrite("w", StDtype::kU8, {1LL << 40, 1LL << 40}, four)},
                     {"tensor \"w\"", "too large"});
  ExpectWriteInvalid({TensorToWrite{"w", StDtype::kU8, {4}, nullptr, 4}},
                     {"tensor \"w\"", "data is null"});
  ExpectWriteInvalid({ToWrite("bad\xff", StDtype::kU8, {4}, four)},
                     {"tensor \"bad\\xff\"", "not valid UTF-8"});
  ExpectWriteInvalid({ToWrite("w", StDtype::kU8, {8}, eight)}, {"__metadata__", "not valid UTF-8"},
                     {{"k", "\xc0\xaf"}});
}

TEST(SafetensorsWriterTest, NullDataIsFineForEmptyTensors) {
  const std::string path = TempPath();
  ASSERT_TRUE(WriteSafetensors(path, {TensorToWrite{"e", StDtype::kF32, {0, 3}, nullptr, 0}}).ok());
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->Get("e", StDtype::kF32, {0, 3}).status().code(), StatusCode::kOk);
}

TEST(SafetensorsWriterTest, MissingDirectoryIsNotFoundNamingThePath) {
  const std::string path = ::testing::TempDir() + "/no_such_dir_st/x.safetensors";
  std::vector<uint8_t> one = {1};
  Status s = WriteSafetensors(path, {ToWrite("x", StDtype::kU8, {1}, one)});
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), path)) << s.message();
}

// ---------------------------------------------------------------------------
// Streaming writer

std::vector<TensorSpec> Specs(const std::vector<TensorToWrite>& tensors) {
  std::vector<TensorSpec> specs;
  for (const TensorToWrite& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  return specs;
}

// Create(path, specs) or the test fails.
SafetensorsStreamWriter MustCreate(const std::string& path, std::vector<TensorSpec> specs,
                                   const std::map<std::string, std::string>& metadata = {}) {
  StatusOr<SafetensorsStreamWriter> w =
      SafetensorsStreamWriter::Create(path, std::move(specs), metadata);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return std::move(w).value();
}

// Three tensors of four-byte U8s, "a" "b" "c", for the error tests.
std::vector<TensorSpec> Abc() {
  return {{"a", StDtype::kU8, {4}}, {"b", StDtype::kU8, {2, 2}}, {"c", StDtype::kU8, {4}}};
}

// After an error: `later` returns the same status, `path` is untouched (does
// not exist, or still holds `old_file`) and no .tmp file is left.
void ExpectFinalError(SafetensorsStreamWriter& w, const Status& first, const std::string& path,
                      const std::string& old_file = "") {
  const std::vector<uint8_t> four(4);
  EXPECT_EQ(w.Write("a", four.data(), 4), first);
  EXPECT_EQ(w.Finish(), first);
  EXPECT_FALSE(Exists(path + ".tmp"));
  if (old_file.empty()) {
    EXPECT_FALSE(Exists(path));
  } else {
    EXPECT_EQ(ReadAll(path), old_file);
  }
}

TEST(SafetensorsStreamWriterTest, WritesWhatWriteSafetensorsWritesAndReadsBack) {
  const std::string streamed = TempPath("_streamed"), whole = TempPath("_whole");
  const std::vector<float> a = {1.5f, -2.0f, 3.25f};
  const std::vector<uint8_t> b = {0x38, 0x40, 0xb8, 0x00, 0x7e};
  const std::vector<int64_t> c = {-7};
  const std::vector<uint8_t> a_bytes = Bytes(a), c_bytes = Bytes(c), none;
  // File order differs from name order; an empty tensor sits in the middle.
  const std::vector<TensorToWrite> tensors = {
      ToWrite("z.a", StDtype::kF32, {3}, a_bytes), ToWrite("e", StDtype::kBF16, {0, 2}, none),
      ToWrite("b.weight", StDtype::kF8E4M3, {5}, b), ToWrite("c", StDtype::kI64, {}, c_bytes)};
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};

  SafetensorsStreamWriter w = MustCreate(streamed, Specs(tensors), metadata);
  EXPECT_EQ(w.path(), streamed);
  EXPECT_EQ(w.tensors().size(), 4u);
  for (const TensorToWrite& t : tensors) {
    ASSERT_EQ(w.Write(t.name, t.data, t.bytes), Status::Ok()) << t.name;
  }
  EXPECT_EQ(w.written(), 4u);
  // Nothing is visible under the final name before Finish.
  EXPECT_TRUE(Exists(streamed + ".tmp"));
  EXPECT_FALSE(Exists(streamed));
  ASSERT_EQ(w.Finish(), Status::Ok());
  EXPECT_FALSE(Exists(streamed + ".tmp"));
  EXPECT_EQ(w.Finish().code(), StatusCode::kFailedPrecondition);  // once only
  EXPECT_EQ(w.Write("c", c_bytes.data(), 8).code(), StatusCode::kFailedPrecondition);

  ASSERT_TRUE(WriteSafetensors(whole, tensors, metadata).ok());
  const std::string bytes = ReadAll(streamed);
  EXPECT_GT(bytes.size(), 8 + 12 + 5 + 8u);
  EXPECT_EQ(bytes, ReadAll(whole));

  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(streamed);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->metadata().at("format"), "pt");
  ASSERT_EQ(f->tensors().size(), 4u);
  StatusOr<const TensorView*> ta = f->Get("z.a", StDtype::kF32, {3});
  ASSERT_TRUE(ta.ok()) << ta.status().ToString();
  float got[3];
  std::memcpy(got, (*ta)->data, sizeof got);
  EXPECT_EQ(got[0], 1.5f);
  EXPECT_EQ(got[2], 3.25f);
  StatusOr<const TensorView*> tb = f->Get("b.weight", StDtype::kF8E4M3, {5});
  ASSERT_TRUE(tb.ok()) << tb.status().ToString();
  EXPECT_EQ(std::vector<uint8_t>((*tb)->data, (*tb)->data + 5), b);
  // Packed in the declared order.
  EXPECT_EQ((*tb)->data, (*ta)->data + 12);
  StatusOr<const TensorView*> tc = f->Get("c", StDtype::kI64, {});
  ASSERT_TRUE(tc.ok()) << tc.status().ToString();
  int64_t cv = 0;
  std::memcpy(&cv, (*tc)->data, 8);
  EXPECT_EQ(cv, -7);
  EXPECT_EQ((*tc)->data, (*tb)->data + 5);
  EXPECT_TRUE(f->Get("e", StDtype::kBF16, {0, 2}).ok());
}

TEST(SafetensorsStreamWriterTest, CreateRejectsWhatWriteSafetensorsRejectsInTheSameWords) {
  std::vector<uint8_t> four(4);
  const std::vector<std::vector<TensorToWrite>> bad = {
      {ToWrite("w", StDtype::kU8, {4}, four), ToWrite("w", StDtype::kU8, {4}, four)},
      {ToWrite("", StDtype::kU8, {4}, four)},
      {ToWrite("__metadata__", StDtype::kU8, {4}, four)},
      {ToWrite("w", StDtype::kU8, {-4}, four)},
      {ToWrite("w", StDtype::kU8, {1LL << 40, 1LL << 40}, four)},
      {ToWrite("bad\xff", StDtype::kU8, {4}, four)},
      {TensorToWrite{"w", static_cast<StDtype>(99), {4}, four.data(), 4}},
      // The first bad tensor is the one named.
      {ToWrite("ok", StDtype::kU8, {4}, four), ToWrite("w", StDtype::kU8, {-1}, four),
       ToWrite("", StDtype::kU8, {4}, four)},
  };
  const std::string path = TempPath();
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const Status whole = WriteSafetensors(path, bad[i]);
    const Status streamed = SafetensorsStreamWriter::Create(path, Specs(bad[i])).status();
    EXPECT_EQ(whole.code(), StatusCode::kInvalidArgument) << whole.ToString();
    EXPECT_EQ(streamed, whole);
    EXPECT_FALSE(Exists(path));
    EXPECT_FALSE(Exists(path + ".tmp"));
  }
  const Status meta = SafetensorsStreamWriter::Create(path, {}, {{"k", "\xc0\xaf"}}).status();
  ExpectInvalid(meta, path, {"__metadata__", "not valid UTF-8"});
  EXPECT_EQ(meta, WriteSafetensors(path, {}, {{"k", "\xc0\xaf"}}));
  EXPECT_FALSE(Exists(path + ".tmp"));
}

TEST(SafetensorsStreamWriterTest, TensorOutOfOrderIsInvalidAndFinal) {
  const std::string path = TempPath();
  SafetensorsStreamWriter w = MustCreate(path, Abc());
  const std::vector<uint8_t> four(4);
  ASSERT_EQ(w.Write("a", four.data(), 4), Status::Ok());
  const Status s = w.Write("c", four.data(), 4);
  ExpectInvalid(s, path,
                {"tensor \"c\"", "out of order", "next declared tensor is \"b\" (2 of 3)"});
  EXPECT_EQ(w.written(), 1u);
  ExpectFinalError(w, s, path);
}

TEST(SafetensorsStreamWriterTest, UndeclaredTensorIsInvalid) {
  const std::string path = TempPath();
  SafetensorsStreamWriter w = MustCreate(path, Abc());
  const std::vector<uint8_t> four(4);
  ExpectInvalid(w.Write("x", four.data(), 4), path, {"tensor \"x\"", "out of order"});
  EXPECT_FALSE(Exists(path + ".tmp"));

  const std::string path2 = TempPath("_extra");
  SafetensorsStreamWriter w2 = MustCreate(path2, {{"a", StDtype::kU8, {4}}});
  ASSERT_EQ(w2.Write("a", four.data(), 4), Status::Ok());
  const Status s = w2.Write("a", four.data(), 4);
  ExpectInvalid(s, path2, {"tensor \"a\"", "all 1 declared tensors are written already"});
  ExpectFinalError(w2, s, path2);
}

TEST(SafetensorsStreamWriterTest, WrongByteCountOrNullDataIsInvalid) {
  const std::string path = TempPath();
  const std::vector<uint8_t> eight(8);
  {
    SafetensorsStreamWriter w = MustCreate(path, {{"w", StDtype::kF32, {2}}});
    const Status s = w.Write("w", eight.data(), 4);
    ExpectInvalid(s, path, {"tensor \"w\"", "bytes is 4, but F32 [2] needs 8"});
    ExpectFinalError(w, s, path);
  }
  {
    SafetensorsStreamWriter w = MustCreate(path, {{"w", StDtype::kF32, {2}}});
    const Status s = w.Write("w", eight.data(), 12);
    ExpectInvalid(s, path, {"tensor \"w\"", "bytes is 12, but F32 [2] needs 8"});
    ExpectFinalError(w, s, path);
  }
  {
    SafetensorsStreamWriter w = MustCreate(path, {{"w", StDtype::kF32, {2}}});
    const Status s = w.Write("w", nullptr, 8);
    ExpectInvalid(s, path, {"tensor \"w\"", "data is null"});
    ExpectFinalError(w, s, path);
  }
}

TEST(SafetensorsStreamWriterTest, FinishWithMissingTensorsKeepsTheOldFile) {
  const std::string path = TempPath();
  const std::vector<uint8_t> one = {1}, four(4);
  ASSERT_TRUE(WriteSafetensors(path, {ToWrite("old", StDtype::kU8, {1}, one)}).ok());
  const std::string old_file = ReadAll(path);
  SafetensorsStreamWriter w = MustCreate(path, Abc());
  ASSERT_EQ(w.Write("a", four.data(), 4), Status::Ok());
  const Status s = w.Finish();
  ExpectInvalid(s, path, {"tensor \"b\"", "not written", "after 1 of 3 declared tensors"});
  ExpectFinalError(w, s, path, old_file);
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_NE(f->Find("old"), nullptr);
}

TEST(SafetensorsStreamWriterTest, DestroyedUnfinishedLeavesNoFileAndNoTmp) {
  const std::string path = TempPath();
  const std::vector<uint8_t> four(4);
  {
    SafetensorsStreamWriter w = MustCreate(path, Abc());
    ASSERT_EQ(w.Write("a", four.data(), 4), Status::Ok());
    ASSERT_EQ(w.Write("b", four.data(), 4), Status::Ok());
    ASSERT_EQ(w.Write("c", four.data(), 4), Status::Ok());
    EXPECT_TRUE(Exists(path + ".tmp"));
  }  // every tensor written, but no Finish
  EXPECT_FALSE(Exists(path + ".tmp"));
  EXPECT_FALSE(Exists(path));
  {
    SafetensorsStreamWriter w = MustCreate(path, Abc());  // nothing written
    EXPECT_TRUE(Exists(path + ".tmp"));
  }
  EXPECT_FALSE(Exists(path + ".tmp"));
  EXPECT_FALSE(Exists(path));
}

TEST(SafetensorsStreamWriterTest, MovedWriterCarriesOnAndTheMovedFromOneLetsGo) {
  const std::string path = TempPath(), other_path = TempPath("_other");
  const std::vector<uint8_t> four = {1, 2, 3, 4};
  SafetensorsStreamWriter w = MustCreate(path, Abc());
  ASSERT_EQ(w.Write("a", four.data(), 4), Status::Ok());
  SafetensorsStreamWriter moved(std::move(w));
  EXPECT_EQ(w.Write("b", four.data(), 4).code(), StatusCode::kFailedPrecondition);  // NOLINT
  ASSERT_EQ(moved.Write("b", four.data(), 4), Status::Ok());
  // Assigning over an unfinished writer abandons its file.
  SafetensorsStreamWriter other = MustCreate(other_path, Abc());
  EXPECT_TRUE(Exists(other_path + ".tmp"));
  other = std::move(moved);
  EXPECT_FALSE(Exists(other_path + ".tmp"));
  EXPECT_EQ(other.written(), 2u);
  ASSERT_EQ(other.Write("c", four.data(), 4), Status::Ok());
  ASSERT_EQ(other.Finish(), Status::Ok());
  StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  StatusOr<const TensorView*> c = f->Get("c", StDtype::kU8, {4});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(std::vector<uint8_t>((*c)->data, (*c)->data + 4), four);
  EXPECT_FALSE(Exists(other_path));
}

TEST(SafetensorsStreamWriterTest, MissingDirectoryIsNotFoundNamingThePath) {
  const std::string path = ::testing::TempDir() + "/no_such_dir_st/x.safetensors";
  const Status s = SafetensorsStreamWriter::Create(path, Abc()).status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), path)) << s.message();
}

// ---------------------------------------------------------------------------
// Robustness

TEST(SafetensorsFuzzTest, EveryTruncatedPrefixIsAnError) {
  const std::string bytes = SmallValidFile();
  ASSERT_TRUE(ParseExact(bytes, bytes.size(), "full", true).ok());
  for (size_t len = 0; len < bytes.size(); ++len) {
    StatusOr<ParsedSafetensors> p = ParseExact(bytes, len, "prefix", false);
    ASSERT_FALSE(p.ok()) << "prefix of " << len << " of " << bytes.size() << " bytes parsed";
    ExpectInvalid(p.status(), "prefix", {});
  }
  // The same through files and mmap, for a sample of lengths.
  const std::string path = TempPath();
  for (size_t len = 0; len < bytes.size(); len += 7) {
    WriteAll(path, bytes.substr(0, len));
    StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok()) << len;
    ExpectInvalid(f.status(), path, {});
  }
}

TEST(SafetensorsFuzzTest, RandomHeaderCorruptionNeverCrashes) {
  const std::string bytes = SmallValidFile();
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  ASSERT_LE(8 + n, bytes.size());
  // Bytes that steer the JSON parser somewhere interesting.
  const std::string interesting = "{}[]\":,0123456789-.eE \\u\xff\x80nulltrue";
  std::mt19937 rng(20261129);
  int parsed = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    std::string mutated = bytes;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = 8 + rng() % n;
      if (rng() % 2 == 0) {
        mutated[pos] = static_cast<char>(mutated[pos] ^ (1u << (rng() % 8)));
      } else {
        mutated[pos] = interesting[rng() % interesting.size()];
      }
    }
    StatusOr<ParsedSafetensors> p = ParseExact(mutated, mutated.size(), "fuzz", true);
    if (p.ok()) {
      ++parsed;
    } else {
      ExpectInvalid(p.status(), "fuzz", {});
    }
    if (::testing::Test::HasFailure()) FAIL() << "iteration " << iter;
  }
  // Some mutations (inside metadata values, say) leave a valid file.
  EXPECT_GT(parsed, 0);
}

TEST(SafetensorsFuzzTest, RandomLengthPrefixesNeverCrash) {
  const std::string bytes = SmallValidFile();
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string mutated = bytes;
    const uint64_t n = iter % 2 == 0 ? rng() : rng() % (bytes.size() + 16);
    mutated.replace(0, 8, LengthPrefix(n));
    StatusOr<ParsedSafetensors> p = ParseExact(mutated, mutated.size(), "len", true);
    if (!p.ok()) ExpectInvalid(p.status(), "len", {});
    if (::testing::Test::HasFailure()) FAIL() << "iteration " << iter << " n=" << n;
  }
}

}  // namespace
}  // namespace tpserve
