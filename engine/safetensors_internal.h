// What the safetensors reader (engine/safetensors.cc) and writer (engine/safetensors_writer.cc)
// share: the format's fixed names and sizes, and the wording of their errors, so that a file
// the writer refuses is described as the reader would describe it. Private to engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/status.h"

namespace tpserve::safetensors_detail {

// The header's reserved key for string metadata.
inline constexpr std::string_view kMetadataKey = "__metadata__";
// The little-endian u64 header length before the header; also the alignment of the byte buffer.
inline constexpr size_t kLengthPrefixBytes = 8;

// Well-formed UTF-8 (RFC 3629: no overlongs, no surrogates, at most U+10FFFF): the same rules
// as nlohmann's lexer, so that what the writer accepts the reader accepts too.
bool IsValidUtf8(std::string_view s);
// `s` in double quotes, made safe and short for an error message (escaped, cut).
std::string Quote(std::string_view s);
// "tensor \"name\": ", the prefix of errors about one tensor.
std::string TensorContext(std::string_view name);
// "[2, 3]".
std::string ShapeString(const std::vector<int64_t>& shape);
// Element count of `shape`, or nullopt if it does not fit int64 or a dimension is negative.
// A zero dimension makes the product zero however large the others are.
std::optional<int64_t> CheckedNumel(const std::vector<int64_t>& shape);
// Maps a failed system call's errno onto a status whose message names the path and the call:
// NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED, else UNKNOWN.
Status ErrnoError(int err, const std::string& path, std::string_view call);

}  // namespace tpserve::safetensors_detail
