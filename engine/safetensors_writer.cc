// SafetensorsStreamWriter and WriteSafetensors (engine/safetensors.h): headers built and checked
// by the same rules as the reader's, data written to "<path>.tmp" and renamed into place.
#include "engine/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <utility>

#include "engine/safetensors_internal.h"

namespace tpserve {

using namespace safetensors_detail;  // the format names and error wording both halves share

namespace {

using Json = nlohmann::json;

Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    // Linux writes at most ~2 GiB per call; ask for 1 GiB at a time.
    const ssize_t n = ::write(fd, p, std::min<size_t>(size, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, path, "write");
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

// "bytes is 4, but F32 [2] needs 8": the same words from WriteSafetensors
// and SafetensorsStreamWriter::Write.
std::string BytesMismatch(size_t bytes, StDtype dtype, const std::vector<int64_t>& shape,
                          uint64_t needed) {
  return "bytes is " + std::to_string(bytes) + ", but " + std::string(StDtypeName(dtype)) + " " +
         ShapeString(shape) + " needs " + std::to_string(needed);
}

// Bytes of a tensor whose shape BuildHeader accepted (no overflow).
uint64_t SpecBytes(const TensorSpec& t) {
  return static_cast<uint64_t>(*CheckedNumel(t.shape)) * StDtypeSize(t.dtype);
}

// Checks a tensor beyond its spec (WriteSafetensors: its data) once its size
// is known: the problem after "tensor "name": ", or "" if there is none.
using ExtraCheck = std::function<std::string(size_t index, uint64_t needed)>;

// The header text of a file holding `tensors` back to back in this order,
// padded to a multiple of 8 bytes, after checking every rule of
// WriteSafetensors (errors: INVALID_ARGUMENT "path: ..."). `extra`, if set,
// runs for each tensor between its shape check and its offset.
StatusOr<std::string> BuildHeader(const std::string& path, const std::vector<TensorSpec>& tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  const ExtraCheck& extra = nullptr) {
  auto error = [&](const std::string& what) { return InvalidArgumentError(path + ": " + what); };

  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) {
      if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
        return error(std::string(kMetadataKey) + ": key " + Quote(key) +
                     ": key or value is not valid UTF-8");
      }
      meta[key] = value;
    }
    header[std::string(kMetadataKey)] = std::move(meta);
  }

  std::unordered_set<std::string_view> names;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const std::string where = TensorContext(t.name);
    if (t.name.empty()) return error(where + "tensor name is empty");
    if (t.name == kMetadataKey) return error(where + "name is reserved for the metadata");
    if (!IsValidUtf8(t.name)) return error(where + "name is not valid UTF-8");
    if (!names.insert(t.name).second) return error(where + "name appears twice");
    if (StDtypeSize(t.dtype) == 0) {
      return error(where + "invalid dtype value " + std::to_string(static_cast<int>(t.dtype)));
    }
    for (int64_t d : t.shape) {
      if (d < 0)
        return error(where + "shape " + ShapeString(t.shape) + " has a negative dimension");
    }
    std::optional<int64_t> numel = CheckedNumel(t.shape);
    uint64_t needed = 0;
    if (!numel ||
        __builtin_mul_overflow(static_cast<uint64_t>(*numel), StDtypeSize(t.dtype), &needed)) {
      return error(where + "shape " + ShapeString(t.shape) + " is too large");
    }
    if (extra) {
      if (std::string problem = extra(i, needed); !problem.empty()) return error(where + problem);
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(offset, needed, &end)) return error(where + "total size overflows");
    header[t.name] = {{"dtype", StDtypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", Json::array({offset, end})}};
    offset = end;
  }

  // Strings were checked to be UTF-8 above, so dump cannot throw.
  std::string text = header.dump();
  // Spaces after the JSON are allowed by the format; they align the byte
  // buffer to 8 bytes in the file (and in a page-aligned mapping of it).
  text.append((kLengthPrefixBytes - text.size() % kLengthPrefixBytes) % kLengthPrefixBytes, ' ');
  const uint64_t limit = SafetensorsLimits{}.max_header_bytes;
  if (text.size() > limit) {
    return error("header would be " + std::to_string(text.size()) +
                 " bytes, more than readers accept (" + std::to_string(limit) + ")");
  }
  return text;
}

}  // namespace

StatusOr<SafetensorsStreamWriter> SafetensorsStreamWriter::Create(
    const std::string& path, std::vector<TensorSpec> tensors,
    const std::map<std::string, std::string>& metadata) {
  TP_ASSIGN_OR_RETURN(const std::string header, BuildHeader(path, tensors, metadata));
  return Start(path, std::move(tensors), header);
}

StatusOr<SafetensorsStreamWriter> SafetensorsStreamWriter::Start(const std::string& path,
                                                                 std::vector<TensorSpec> tensors,
                                                                 const std::string& header) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(errno, tmp, "open");
  // Owns the .tmp file from here: an error below removes it.
  SafetensorsStreamWriter w(path, std::move(tensors), fd);
  std::array<uint8_t, kLengthPrefixBytes> prefix{};
  const uint64_t n = header.size();
  for (size_t i = 0; i < prefix.size(); ++i) prefix[i] = static_cast<uint8_t>(n >> (8 * i));
  if (Status s = WriteAll(fd, prefix.data(), prefix.size(), tmp); !s.ok()) return w.Fail(s);
  if (Status s = WriteAll(fd, header.data(), header.size(), tmp); !s.ok()) return w.Fail(s);
  return w;
}

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path, std::vector<TensorSpec> tensors,
                                                 int fd)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), tensors_(std::move(tensors)), fd_(fd) {}

SafetensorsStreamWriter::SafetensorsStreamWriter(SafetensorsStreamWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tmp_(std::move(other.tmp_)),
      tensors_(std::move(other.tensors_)),
      fd_(std::exchange(other.fd_, -1)),
      next_(std::exchange(other.next_, 0)),
      finished_(std::exchange(other.finished_, false)),
      error_(std::exchange(other.error_, FailedPreconditionError("writer was moved from"))) {}

SafetensorsStreamWriter& SafetensorsStreamWriter::operator=(
    SafetensorsStreamWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    tmp_ = std::move(other.tmp_);
    tensors_ = std::move(other.tensors_);
    fd_ = std::exchange(other.fd_, -1);
    next_ = std::exchange(other.next_, 0);
    finished_ = std::exchange(other.finished_, false);
    error_ = std::exchange(other.error_, FailedPreconditionError("writer was moved from"));
  }
  return *this;
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() { Abandon(); }

void SafetensorsStreamWriter::Abandon() noexcept {
  if (fd_ >= 0) RemoveTmp();
}

void SafetensorsStreamWriter::RemoveTmp() noexcept {
  // Best effort, on a path that is already failing or abandoned.
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  ::unlink(tmp_.c_str());
}

Status SafetensorsStreamWriter::Fail(Status error) {
  RemoveTmp();  // also after Finish closed it
  error_ = error;
  return error;
}

Status SafetensorsStreamWriter::Write(std::string_view name, const void* data, size_t bytes) {
  if (!error_.ok()) return error_;
  if (finished_) return FailedPreconditionError(path_ + ": Write after Finish");
  auto error = [&](const std::string& what) {
    return Fail(InvalidArgumentError(path_ + ": " + TensorContext(name) + what));
  };
  if (next_ == tensors_.size()) {
    return error("all " + std::to_string(tensors_.size()) +
                 " declared tensors are written already");
  }
  const TensorSpec& t = tensors_[next_];
  if (name != t.name) {
    return error("written out of order: the next declared tensor is " + Quote(t.name) + " (" +
                 std::to_string(next_ + 1) + " of " + std::to_string(tensors_.size()) + ")");
  }
  if (const uint64_t needed = SpecBytes(t); bytes != needed) {
    return error(BytesMismatch(bytes, t.dtype, t.shape, needed));
  }
  if (data == nullptr && bytes > 0) return error("data is null");
  if (Status s = WriteAll(fd_, data, bytes, tmp_); !s.ok()) return Fail(s);
  ++next_;
  return Status::Ok();
}

Status SafetensorsStreamWriter::Finish() {
  if (!error_.ok()) return error_;
  if (finished_) return FailedPreconditionError(path_ + ": Finish called twice");
  if (next_ < tensors_.size()) {
    return Fail(InvalidArgumentError(path_ + ": " + TensorContext(tensors_[next_].name) +
                                     "not written (Finish after " + std::to_string(next_) + " of " +
                                     std::to_string(tensors_.size()) + " declared tensors)"));
  }
  if (::fsync(fd_) != 0) return Fail(ErrnoError(errno, tmp_, "fsync"));
  // A deferred write error can surface at close.
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) return Fail(ErrnoError(errno, tmp_, "close"));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) return Fail(ErrnoError(errno, path_, "rename"));
  finished_ = true;
  // The rename survives a crash only once the directory is on disk too. The file is in place
  // either way; a filesystem that cannot fsync a directory says EINVAL, which is not an error.
  std::string dir = std::filesystem::path(path_).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return ErrnoError(errno, dir, "open (to fsync the rename of " + path_ + ")");
  const int sync_rc = ::fsync(dir_fd);
  const int sync_errno = errno;
  ::close(dir_fd);
  if (sync_rc != 0 && sync_errno != EINVAL) {
    return ErrnoError(sync_errno, dir, "fsync (the rename of " + path_ + ")");
  }
  return Status::Ok();
}

Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorToWrite& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  // The data's checks come in the same pass as the specs', so that the first
  // bad tensor is the one reported.
  TP_ASSIGN_OR_RETURN(const std::string header,
                      BuildHeader(path, specs, metadata, [&](size_t i, uint64_t needed) {
                        const TensorToWrite& t = tensors[i];
                        if (t.bytes != needed) {
                          return BytesMismatch(t.bytes, t.dtype, t.shape, needed);
                        }
                        if (t.data == nullptr && t.bytes > 0) return std::string("data is null");
                        return std::string();
                      }));
  TP_ASSIGN_OR_RETURN(SafetensorsStreamWriter w,
                      SafetensorsStreamWriter::Start(path, std::move(specs), header));
  for (const TensorToWrite& t : tensors) TP_RETURN_IF_ERROR(w.Write(t.name, t.data, t.bytes));
  return w.Finish();
}

}  // namespace tpserve
