// Reading and writing safetensors files: an 8-byte little-endian u64 header
// length N, N bytes of UTF-8 JSON header, then the byte buffer that the
// header's data_offsets are relative to. Tensors are row-major, little-endian.
//
// The reader validates the whole header before handing out any tensor and is
// meant to survive hostile input (it is fuzzed): every malformed file gives
// INVALID_ARGUMENT naming the file and, where there is one, the tensor. It is
// deliberately stricter than the format in places (unknown keys in a tensor
// entry, duplicate JSON keys and empty tensor names are errors) and more lenient
// in one: tensors need not be packed, so gaps between them and bytes after
// the last one are accepted.
//
// Thread-safety: the const methods of SafetensorsFile and ParsedSafetensors
// may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/status.h"

namespace tpserve {

// The element types of the format. Spec names: F32 F16 BF16 F8_E4M3 F8_E5M2 I8
// U8 I16 I32 I64 BOOL F64.
enum class StDtype {
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI8,
  kU8,
  kI16,
  kU16,
  kI32,
  kU32,
  kI64,
  kU64,
  kBool,
  kF64
};

// The spec name ("F32", "F8_E4M3", "BOOL", ...).
std::string_view StDtypeName(StDtype dtype);
// Bytes per element (BOOL is one byte).
size_t StDtypeSize(StDtype dtype);
// Inverse of StDtypeName (exact, case-sensitive); nullopt for unknown names.
std::optional<StDtype> StDtypeFromName(std::string_view name);

// One tensor of a parsed file. `data` points into the parsed bytes (for a
// SafetensorsFile: its mapping) and is only valid while those live. It is not
// necessarily aligned for the element type: files written by other tools may
// have any header length. Read through memcpy or copy to aligned memory.
struct TensorView {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  const uint8_t* data = nullptr;
  size_t bytes = 0;  // == numel() * StDtypeSize(dtype), checked by the parser

  // Product of shape (1 for a scalar). Does not overflow for a parsed view.
  int64_t numel() const;
};

// Caps that bound the work and memory a hostile file can cause.
struct SafetensorsLimits {
  // Largest accepted header length N (the JSON text). Matches the reference
  // implementation's cap of 100,000,000 bytes (decimal, not 100 MiB), so
  // that every file WriteSafetensors accepts to write, it accepts to read.
  uint64_t max_header_bytes = 100'000'000;
  // Most tensor entries (not counting "__metadata__").
  size_t max_tensors = 1 << 20;
};

// The validated contents of a safetensors file.
struct ParsedSafetensors {
  std::vector<TensorView> tensors;              // sorted by name; names are unique
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty if absent
  uint64_t header_bytes = 0;                    // N
  size_t data_begin = 0;                        // offset of the byte buffer in the file (8 + N)

  // Binary search by name; nullptr if absent.
  const TensorView* Find(std::string_view name) const;
};

// Parses and validates a whole in-memory file (header and byte buffer). Never
// reads outside [data, data + size). The returned views point into `data`.
// Errors are INVALID_ARGUMENT and start with `source` (a path or a label).
StatusOr<ParsedSafetensors> ParseSafetensors(const uint8_t* data, size_t size,
                                             const std::string& source,
                                             const SafetensorsLimits& limits = {});

// A safetensors file, validated and memory-mapped (read-only, MAP_PRIVATE) for
// as long as the object lives; tensor data is paged in on first touch. The
// file must not be truncated or rewritten in place while it is open (the
// mapping would then fault with SIGBUS); WriteSafetensors replaces files by
// rename, which is safe. Move-only; moving keeps the views and pointers that
// Find/Get returned valid.
class SafetensorsFile {
 public:
  // NOT_FOUND if the path does not exist, PERMISSION_DENIED if it cannot be
  // read, INVALID_ARGUMENT if it is not a regular file or not a valid
  // safetensors file (see ParseSafetensors), RESOURCE_EXHAUSTED or UNKNOWN if
  // mmap or another system call fails. Every message starts with the path.
  static StatusOr<SafetensorsFile> Open(const std::string& path,
                                        const SafetensorsLimits& limits = {});

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // nullptr if absent.
  const TensorView* Find(std::string_view name) const { return contents_.Find(name); }
  // NOT_FOUND naming the file and the tensor.
  StatusOr<const TensorView*> Get(std::string_view name) const;
  // Get, plus INVALID_ARGUMENT naming the file, the tensor, and the expected
  // and actual dtype and shape if they differ.
  StatusOr<const TensorView*> Get(std::string_view name, StDtype dtype,
                                  const std::vector<int64_t>& shape) const;

  const std::vector<TensorView>& tensors() const { return contents_.tensors; }  // sorted by name
  const std::map<std::string, std::string>& metadata() const { return contents_.metadata; }
  const std::string& path() const { return path_; }
  size_t file_bytes() const { return map_bytes_; }

 private:
  SafetensorsFile(std::string path, void* map, size_t map_bytes, ParsedSafetensors contents);
  void Unmap() noexcept;

  std::string path_;
  void* map_ = nullptr;  // nullptr for an empty mapping
  size_t map_bytes_ = 0;
  ParsedSafetensors contents_;
};

// One tensor for WriteSafetensors. `data` holds `bytes` bytes, row-major and
// little-endian; it may be null only when bytes == 0.
struct TensorToWrite {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  const void* data = nullptr;
  size_t bytes = 0;
};

// Writes a safetensors file that the reference implementation also accepts:
// tensor data packed back to back in the given order (no gaps), the header
// padded with spaces so that the byte buffer starts at an 8-byte-aligned file
// offset, "__metadata__" only if `metadata` is non-empty. Writes
// `path` + ".tmp", fsyncs it, renames it over `path` and fsyncs the directory
// (SafetensorsStreamWriter::Finish), so readers see the old file or the new
// one, never a partial one; on error the .tmp file is removed.
// Validation errors are INVALID_ARGUMENT naming the path and the tensor:
// empty, duplicate, "__metadata__" or non-UTF-8 names (and metadata), negative
// dimensions, bytes != numel * dtype size, null data with bytes > 0, a header
// over SafetensorsLimits{}.max_header_bytes. I/O errors name the path and
// carry strerror (NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED for a full
// disk, else UNKNOWN). Memory: only what `tensors` already holds (the data is
// written through SafetensorsStreamWriter, not copied).
Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

// A tensor's header entry, declared to SafetensorsStreamWriter before its data.
struct TensorSpec {
  std::string name;
  StDtype dtype = StDtype::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
};

// WriteSafetensors for data that arrives one tensor at a time, so that the
// caller never holds more than one tensor (a checkpoint larger than memory):
// Create declares every tensor and writes the header (the offsets follow from
// the shapes and dtypes), Write appends each tensor's bytes in the declared
// order, Finish makes the file visible. For the same tensors, data and
// metadata the file is WriteSafetensors's, byte for byte.
//
// The bytes go to `path` + ".tmp"; Finish fsyncs it, renames it over `path`
// and fsyncs the directory, so readers see the old file or the new one, never
// a partial one, and the new one survives a crash once Finish returns OK.
// Any error is final: the .tmp file is removed and every later call returns
// that error. Destroying a writer that has not finished also removes the .tmp
// file (`path` itself is then untouched).
//
// Move-only; one thread at a time.
class SafetensorsStreamWriter {
 public:
  // Checks `tensors` and `metadata` with WriteSafetensors's rules (the same
  // INVALID_ARGUMENT messages for names, dtypes, shapes, metadata and the
  // header size), then creates the .tmp file and writes the header. I/O errors
  // as WriteSafetensors's. Nothing is created on a validation error.
  static StatusOr<SafetensorsStreamWriter> Create(
      const std::string& path, std::vector<TensorSpec> tensors,
      const std::map<std::string, std::string>& metadata = {});

  SafetensorsStreamWriter(SafetensorsStreamWriter&& other) noexcept;
  SafetensorsStreamWriter& operator=(SafetensorsStreamWriter&& other) noexcept;
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;
  ~SafetensorsStreamWriter();

  // Appends the data of the next declared tensor: `name` must be that tensor's
  // name and `bytes` its size (numel * dtype size); `data` may be null only
  // when bytes == 0. INVALID_ARGUMENT naming the path and the tensor when it
  // is not the next one (or every tensor is written already), for a wrong
  // byte count or null data; I/O errors as Create's.
  Status Write(std::string_view name, const void* data, size_t bytes);

  // Once every declared tensor is written: fsyncs, closes and renames the
  // .tmp file over `path`. INVALID_ARGUMENT naming the path and the first
  // tensor not written if some are missing; FAILED_PRECONDITION if already
  // finished.
  Status Finish();

  const std::string& path() const { return path_; }
  // The declared tensors, in file order, and how many of them are written.
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  size_t written() const { return next_; }

 private:
  friend Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                                 const std::map<std::string, std::string>& metadata);

  // Creates the .tmp file and writes `header` (already checked) to it.
  static StatusOr<SafetensorsStreamWriter> Start(const std::string& path,
                                                 std::vector<TensorSpec> tensors,
                                                 const std::string& header);
  SafetensorsStreamWriter(std::string path, std::vector<TensorSpec> tensors, int fd);
  // Records `error` as final and removes the .tmp file; returns `error`.
  Status Fail(Status error);
  // Closes and removes the .tmp file if this writer still has it open.
  void Abandon() noexcept;
  // Closes the .tmp file if open, and removes it.
  void RemoveTmp() noexcept;

  std::string path_;
  std::string tmp_;  // path_ + ".tmp"
  std::vector<TensorSpec> tensors_;
  int fd_ = -1;      // the open .tmp file while writing, else -1
  size_t next_ = 0;  // index of the next tensor to write
  bool finished_ = false;
  Status error_;  // the first error; later calls return it
};

}  // namespace tpserve
