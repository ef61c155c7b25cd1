// libFuzzer target: ParseSafetensors on arbitrary bytes. Must never read
// outside the buffer (ASan); an accepted file must have every tensor's data
// inside the buffer, after the header, with bytes == numel * dtype size.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "engine/safetensors.h"

namespace {
[[noreturn]] void Fail(const char* what, const std::string& name) {
  std::fprintf(stderr, "fuzz_safetensors: invariant violated: %s (tensor '%s')\n", what,
               name.c_str());
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Copy into an exactly sized heap buffer so that ASan catches any read past
  // the end (libFuzzer's own buffer is exactly sized too, but be explicit).
  std::vector<uint8_t> buf(data, data + size);
  const uint8_t* begin = buf.data();
  tpserve::SafetensorsLimits limits;
  limits.max_header_bytes = 1 << 16;
  limits.max_tensors = 1024;
  auto r = tpserve::ParseSafetensors(begin, size, "fuzz", limits);
  if (!r.ok()) {
    if (r.status().message().empty()) Fail("error without a message", "");
    return 0;
  }
  const tpserve::ParsedSafetensors& p = *r;
  if (p.data_begin != 8 + p.header_bytes) Fail("data_begin != 8 + header_bytes", "");
  if (p.data_begin > size) Fail("data_begin past the end", "");
  const std::string* prev = nullptr;
  for (const auto& t : p.tensors) {
    if (t.name.empty()) Fail("empty name", t.name);
    if (prev && !(*prev < t.name)) Fail("names not sorted and unique", t.name);
    prev = &t.name;
    if (p.Find(t.name) != &t) Fail("Find does not return the tensor", t.name);
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) Fail("negative dimension", t.name);
      if (d != 0 && numel > INT64_MAX / d) Fail("numel overflows", t.name);
      numel *= d;
    }
    if (numel != t.numel()) Fail("numel() disagrees with shape", t.name);
    const size_t es = tpserve::StDtypeSize(t.dtype);
    if (static_cast<uint64_t>(numel) > SIZE_MAX / es) Fail("bytes overflow", t.name);
    if (t.bytes != static_cast<size_t>(numel) * es) Fail("bytes != numel * dtype size", t.name);
    if (t.bytes > 0) {
      if (t.data == nullptr) Fail("null data with bytes > 0", t.name);
      if (t.data < begin + p.data_begin) Fail("data before the byte buffer", t.name);
      const size_t off = static_cast<size_t>(t.data - begin);
      if (off > size || t.bytes > size - off) Fail("data past the end of the buffer", t.name);
      // Touch the first and last byte (ASan checks the access).
      volatile uint8_t sink = t.data[0];
      sink = t.data[t.bytes - 1];
      (void)sink;
    }
  }
  return 0;
}
