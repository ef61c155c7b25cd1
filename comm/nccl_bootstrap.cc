#include "comm/nccl_bootstrap.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "comm/deadline.h"

extern char** environ;

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kIdBytes = sizeof(ncclUniqueId);
static_assert(kIdBytes == NCCL_UNIQUE_ID_BYTES);
constexpr size_t kHelloBytes = sizeof(kRendezvousHello);
// A client gets this long to greet and read its reply.
constexpr auto kPerClientIo = std::chrono::seconds(2);
// Pause between connection attempts of a fetcher.
constexpr auto kRetryInterval = std::chrono::milliseconds(100);

std::string ErrnoText(int err) { return std::string(std::strerror(err)); }

// Milliseconds until `deadline`, clamped to [0, INT_MAX] for poll().
int MillisUntil(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

// ---- environment parsing ---------------------------------------------------

const char* Get(const EnvLookup& env, const char* name) {
  const char* v = env ? env(name) : nullptr;
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

// Parses the whole of `value` as a decimal int in [min, max].
StatusOr<int> ParseIntVar(const char* name, const char* value, int min, int max) {
  const std::string_view text(value);
  int out = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (ec != std::errc() || end != text.data() + text.size()) {
    return InvalidArgumentError(std::string(name) + "='" + std::string(text) +
                                "' is not a decimal integer");
  }
  if (out < min || out > max) {
    return InvalidArgumentError(std::string(name) + "=" + std::string(text) + " is out of range [" +
                                std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return out;
}

StatusOr<int> RequireIntVar(const EnvLookup& env, const char* name, const char* set_name, int min,
                            int max) {
  const char* v = Get(env, name);
  if (v == nullptr) {
    return InvalidArgumentError(std::string(set_name) + " variables are present but " + name +
                                " is not set");
  }
  return ParseIntVar(name, v, min, max);
}

constexpr int kMaxWorld = 1 << 20;

Status CheckRankInWorld(const char* rank_name, int rank, const char* world_name, int world) {
  if (rank >= world) {
    return InvalidArgumentError(std::string(rank_name) + "=" + std::to_string(rank) +
                                " is not below " + world_name + "=" + std::to_string(world));
  }
  return Status::Ok();
}

StatusOr<RankInfo> FromTpserveVars(const EnvLookup& env) {
  RankInfo info;
  info.source = "tpserve";
  TP_ASSIGN_OR_RETURN(info.world_size,
                      RequireIntVar(env, kEnvWorldSize, "TPSERVE_*", 1, kMaxWorld));
  TP_ASSIGN_OR_RETURN(info.rank, RequireIntVar(env, kEnvRank, "TPSERVE_*", 0, kMaxWorld));
  TP_RETURN_IF_ERROR(CheckRankInWorld(kEnvRank, info.rank, kEnvWorldSize, info.world_size));
  if (const char* v = Get(env, kEnvLocalRank)) {
    TP_ASSIGN_OR_RETURN(info.local_rank, ParseIntVar(kEnvLocalRank, v, 0, kMaxWorld));
    TP_RETURN_IF_ERROR(
        CheckRankInWorld(kEnvLocalRank, info.local_rank, kEnvWorldSize, info.world_size));
  } else {
    info.local_rank = info.rank;
  }
  return info;
}

StatusOr<RankInfo> FromMpirunVars(const EnvLookup& env) {
  RankInfo info;
  info.source = "mpirun";
  TP_ASSIGN_OR_RETURN(info.world_size, RequireIntVar(env, "OMPI_COMM_WORLD_SIZE",
                                                     "OMPI_COMM_WORLD_*", 1, kMaxWorld));
  TP_ASSIGN_OR_RETURN(
      info.rank, RequireIntVar(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_*", 0, kMaxWorld));
  TP_RETURN_IF_ERROR(
      CheckRankInWorld("OMPI_COMM_WORLD_RANK", info.rank, "OMPI_COMM_WORLD_SIZE", info.world_size));
  TP_ASSIGN_OR_RETURN(info.local_rank, RequireIntVar(env, "OMPI_COMM_WORLD_LOCAL_RANK",
                                                     "OMPI_COMM_WORLD_*", 0, kMaxWorld));
  TP_RETURN_IF_ERROR(CheckRankInWorld("OMPI_COMM_WORLD_LOCAL_RANK", info.local_rank,
                                      "OMPI_COMM_WORLD_SIZE", info.world_size));
  return info;
}

StatusOr<RankInfo> FromLwsVars(const EnvLookup& env) {
  RankInfo info;
  info.source = "lws";
  int group_size = 0;
  int index = 0;
  int gpus_per_node = 1;
  TP_ASSIGN_OR_RETURN(group_size, RequireIntVar(env, "LWS_GROUP_SIZE", "LWS_*", 1, kMaxWorld));
  TP_ASSIGN_OR_RETURN(index, RequireIntVar(env, "LWS_WORKER_INDEX", "LWS_*", 0, kMaxWorld));
  TP_RETURN_IF_ERROR(CheckRankInWorld("LWS_WORKER_INDEX", index, "LWS_GROUP_SIZE", group_size));
  if (const char* v = Get(env, "TPSERVE_GPUS_PER_NODE")) {
    TP_ASSIGN_OR_RETURN(gpus_per_node, ParseIntVar("TPSERVE_GPUS_PER_NODE", v, 1, 1024));
  }
  if (static_cast<int64_t>(group_size) * gpus_per_node > kMaxWorld) {
    return InvalidArgumentError("LWS_GROUP_SIZE=" + std::to_string(group_size) +
                                " times TPSERVE_GPUS_PER_NODE=" + std::to_string(gpus_per_node) +
                                " is too many ranks");
  }
  info.world_size = group_size * gpus_per_node;
  info.rank = index * gpus_per_node;
  info.local_rank = 0;
  info.spawn_local = gpus_per_node - 1;
  return info;
}

// ---- sockets -----------------------------------------------------------------

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Reset(); }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Waits until `fd` is ready for `events` or the deadline passes.
// Returns "" on readiness, else an error text.
std::string WaitFd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, MillisUntil(deadline));
    if (n > 0) {
      if ((p.revents & events) != 0) return "";
      if ((p.revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return "connection error or hang-up";
      continue;
    }
    if (n == 0) return "timed out";
    if (errno != EINTR) return "poll: " + ErrnoText(errno);
  }
}

// Reads exactly n bytes from a non-blocking socket. "" on success.
std::string ReadAll(int fd, void* buf, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(buf);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, p + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return "peer closed the connection after " + std::to_string(got) + " bytes";
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return "recv: " + ErrnoText(errno);
    if (std::string e = WaitFd(fd, POLLIN, deadline); !e.empty()) return "reading: " + e;
  }
  return "";
}

// Writes exactly n bytes to a non-blocking socket. "" on success.
std::string WriteAll(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const char*>(buf);
  size_t put = 0;
  while (put < n) {
    const ssize_t r = ::send(fd, p + put, n - put, MSG_NOSIGNAL);
    if (r >= 0) {
      put += static_cast<size_t>(r);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return "send: " + ErrnoText(errno);
    if (std::string e = WaitFd(fd, POLLOUT, deadline); !e.empty()) return "writing: " + e;
  }
  return "";
}

// Connects a non-blocking socket to `ai` before the deadline. "" on success.
std::string ConnectTo(const addrinfo* ai, Clock::time_point deadline, Fd* out) {
  Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
  if (fd.get() < 0) return "socket: " + ErrnoText(errno);
  if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) return "connect: " + ErrnoText(errno);
    if (std::string e = WaitFd(fd.get(), POLLOUT, deadline); !e.empty()) return "connect: " + e;
    int err = 0;
    socklen_t len = sizeof err;
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
      return "getsockopt: " + ErrnoText(errno);
    }
    if (err != 0) return "connect: " + ErrnoText(err);
  }
  *out = std::move(fd);
  return "";
}

// One attempt: resolve, connect, greet, read. "" on success.
std::string TryFetch(const std::string& host, uint16_t port, Clock::time_point deadline,
                     ncclUniqueId* id) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int gai = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  if (gai != 0) return "resolving '" + host + "': " + ::gai_strerror(gai);
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
  std::string last = "no addresses";
  for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd;
    // One address may not eat the whole budget: leave time for the others.
    const Clock::time_point attempt_deadline =
        std::min(deadline, Clock::now() + std::chrono::seconds(1));
    if (std::string e = ConnectTo(ai, attempt_deadline, &fd); !e.empty()) {
      last = e;
      continue;
    }
    const Clock::time_point io_deadline = std::min(deadline, Clock::now() + kPerClientIo);
    if (std::string e = WriteAll(fd.get(), kRendezvousHello, kHelloBytes, io_deadline);
        !e.empty()) {
      last = e;
      continue;
    }
    char reply[kHelloBytes + kIdBytes];
    if (std::string e = ReadAll(fd.get(), reply, sizeof reply, io_deadline); !e.empty()) {
      last = e;
      continue;
    }
    if (std::memcmp(reply, kRendezvousHello, kHelloBytes) != 0) {
      last = "the server's reply does not start with the tpserve rendezvous greeting";
      continue;
    }
    std::memcpy(id->internal, reply + kHelloBytes, kIdBytes);
    return "";
  }
  return last;
}

// Binds and listens on `port` for the given family. "" on success.
std::string ListenOn(int family, uint16_t port, Fd* out) {
  Fd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return "socket: " + ErrnoText(errno);
  const int one = 1;
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) {
    return "setsockopt(SO_REUSEADDR): " + ErrnoText(errno);
  }
  int rc = 0;
  if (family == AF_INET6) {
    const int zero = 0;  // dual-stack: accept IPv4-mapped connections too
    if (::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero) != 0) {
      return "setsockopt(IPV6_V6ONLY): " + ErrnoText(errno);
    }
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(port);
    rc = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(port);
    rc = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a);
  }
  if (rc != 0) return "bind to port " + std::to_string(port) + ": " + ErrnoText(errno);
  if (::listen(fd.get(), SOMAXCONN) != 0) return "listen: " + ErrnoText(errno);
  *out = std::move(fd);
  return "";
}

uint16_t BoundPort(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
}

// ---- process spawning ----------------------------------------------------------

bool IsOverriddenVar(const char* entry) {
  for (const char* name : {kEnvRank, kEnvWorldSize, kEnvLocalRank, kEnvNcclId}) {
    const size_t n = std::strlen(name);
    if (std::strncmp(entry, name, n) == 0 && entry[n] == '=') return true;
  }
  return false;
}

// This process's descriptors above stderr without FD_CLOEXEC (sockets and
// files opened without it, here or in a library): a child must not hold
// them (it would keep their ports and files open, also after we exit).
// Best effort: empty without /proc.
std::vector<int> InheritableFds() {
  std::vector<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  const int own = ::dirfd(dir);
  while (const dirent* entry = ::readdir(dir)) {
    const std::string_view name(entry->d_name);
    int fd = -1;
    const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), fd);
    if (ec != std::errc() || end != name.data() + name.size()) continue;
    if (fd <= STDERR_FILENO || fd == own) continue;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) == 0) fds.push_back(fd);
  }
  ::closedir(dir);
  return fds;
}

void KillAndReap(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) ::kill(pid, SIGKILL);
  for (pid_t pid : pids) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

}  // namespace

Status ReapWorkers(const std::vector<pid_t>& pids, std::chrono::milliseconds timeout) {
  const auto deadline = DeadlineAfter(std::chrono::steady_clock::now(), timeout);
  std::vector<bool> done(pids.size(), false);
  std::string failures;
  auto note = [&](size_t i, const std::string& what) {
    failures += (failures.empty() ? "" : "; ") + std::string("rank ") + std::to_string(i + 1) +
                " (pid " + std::to_string(pids[i]) + ") " + what;
  };
  size_t left = pids.size();
  // waitpid and kill read 0 and negative pids as process groups (-1: every
  // process we may signal): never pass them on.
  for (size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] > 0) continue;
    done[i] = true;
    --left;
    note(i, "is not a process id");
  }
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids[i], &status, WNOHANG);
      if (got == 0) continue;
      if (got < 0 && errno == EINTR) continue;
      done[i] = true;
      --left;
      if (got < 0) {
        note(i, std::string("could not be waited for: ") + std::strerror(errno));
      } else if (WIFSIGNALED(status)) {
        note(i, "was killed by signal " + std::to_string(WTERMSIG(status)));
      } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
        note(i, "exited with status " + std::to_string(WEXITSTATUS(status)));
      }
    }
    if (left == 0 || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (done[i]) continue;
    ::kill(pids[i], SIGKILL);
    int status = 0;
    while (::waitpid(pids[i], &status, 0) < 0 && errno == EINTR) {
    }
    note(i, "did not exit in time and was killed");
  }
  if (failures.empty()) return Status::Ok();
  return InternalError("worker processes: " + failures);
}

EnvLookup ProcessEnv() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

// ---- hex -------------------------------------------------------------------------

std::string NcclUniqueIdToHex(const ncclUniqueId& id) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * kIdBytes, '0');
  for (size_t i = 0; i < kIdBytes; ++i) {
    const auto b = static_cast<unsigned char>(id.internal[i]);
    out[2 * i] = kDigits[b >> 4];
    out[2 * i + 1] = kDigits[b & 0xf];
  }
  return out;
}

StatusOr<ncclUniqueId> NcclUniqueIdFromHex(std::string_view hex) {
  if (hex.size() != 2 * kIdBytes) {
    return InvalidArgumentError("NCCL unique id: expected " + std::to_string(2 * kIdBytes) +
                                " hex characters (" + std::to_string(kIdBytes) + " bytes), got " +
                                std::to_string(hex.size()));
  }
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  ncclUniqueId id;
  for (size_t i = 0; i < kIdBytes; ++i) {
    const int hi = nibble(hex[2 * i]);
    const int lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      const size_t pos = hi < 0 ? 2 * i : 2 * i + 1;
      const auto c = static_cast<unsigned char>(hex[pos]);
      char code[8];
      std::snprintf(code, sizeof code, "0x%02x", c);
      std::string shown = (c >= 0x20 && c < 0x7f) ? std::string("'") + hex[pos] + "' " : "";
      return InvalidArgumentError("NCCL unique id: invalid hex character " + shown + "(" + code +
                                  ") at position " + std::to_string(pos));
    }
    id.internal[i] = static_cast<char>((hi << 4) | lo);
  }
  return id;
}

// ---- environment -----------------------------------------------------------

StatusOr<RankInfo> RankInfoFromEnv(const EnvLookup& env) {
  const auto any = [&](std::initializer_list<const char*> names) {
    return std::any_of(names.begin(), names.end(),
                       [&](const char* n) { return Get(env, n) != nullptr; });
  };
  if (any({kEnvRank, kEnvWorldSize, kEnvLocalRank})) return FromTpserveVars(env);
  if (any({"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"})) {
    return FromMpirunVars(env);
  }
  if (any({"LWS_WORKER_INDEX", "LWS_GROUP_SIZE"})) return FromLwsVars(env);
  return NotFoundError(
      "no rank in the environment: set TPSERVE_RANK and TPSERVE_WORLD_SIZE, run under mpirun "
      "(OMPI_COMM_WORLD_*), or in a LeaderWorkerSet (LWS_WORKER_INDEX, LWS_GROUP_SIZE)");
}

StatusOr<ncclUniqueId> UniqueIdFromEnv(const EnvLookup& env) {
  const char* v = Get(env, kEnvNcclId);
  if (v == nullptr) return NotFoundError(std::string(kEnvNcclId) + " is not set");
  auto id = NcclUniqueIdFromHex(v);
  if (!id.ok()) return id.status().WithContext(kEnvNcclId);
  return id;
}

StatusOr<RendezvousAddress> ParseHostPort(std::string_view text) {
  RendezvousAddress addr;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return InvalidArgumentError("'" + std::string(text) + "' is not [address]:port");
    }
    addr.host = std::string(text.substr(1, close - 1));
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      return InvalidArgumentError("'" + std::string(text) + "' is not host:port (no ':')");
    }
    addr.host = std::string(text.substr(0, colon));
    if (addr.host.find(':') != std::string::npos) {
      return InvalidArgumentError("'" + std::string(text) +
                                  "': write IPv6 addresses in brackets, [address]:port");
    }
    port_text = text.substr(colon + 1);
  }
  if (addr.host.empty()) return InvalidArgumentError("'" + std::string(text) + "' has no host");
  int port = 0;
  const auto [end, ec] =
      std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port < 1 || port > 65535) {
    return InvalidArgumentError("'" + std::string(text) + "': port '" + std::string(port_text) +
                                "' is not a number in [1, 65535]");
  }
  addr.port = static_cast<uint16_t>(port);
  return addr;
}

StatusOr<RendezvousAddress> RendezvousAddressFromEnv(const EnvLookup& env) {
  if (const char* v = Get(env, "TPSERVE_RENDEZVOUS")) {
    auto addr = ParseHostPort(v);
    if (!addr.ok()) return addr.status().WithContext("TPSERVE_RENDEZVOUS");
    return addr;
  }
  const char* leader = Get(env, "LWS_LEADER_ADDRESS");
  if (leader == nullptr) {
    return NotFoundError(
        "no rendezvous address: set TPSERVE_RENDEZVOUS=host:port (or run in a LeaderWorkerSet, "
        "which sets LWS_LEADER_ADDRESS)");
  }
  RendezvousAddress addr;
  addr.host = leader;
  addr.port = kDefaultRendezvousPort;
  if (const char* p = Get(env, "TPSERVE_RENDEZVOUS_PORT")) {
    TP_ASSIGN_OR_RETURN(const int port, ParseIntVar("TPSERVE_RENDEZVOUS_PORT", p, 1, 65535));
    addr.port = static_cast<uint16_t>(port);
  }
  return addr;
}

// ---- spawning ----------------------------------------------------------------

StatusOr<std::vector<pid_t>> SpawnLocalWorkers(const std::vector<std::string>& argv, int world_size,
                                               const ncclUniqueId& id) {
  if (world_size < 1) {
    return InvalidArgumentError("SpawnLocalWorkers: world_size " + std::to_string(world_size) +
                                " < 1");
  }
  std::vector<int> ranks;
  for (int r = 1; r < world_size; ++r) ranks.push_back(r);
  return SpawnWorkers(argv, world_size, ranks, id);
}

StatusOr<std::vector<pid_t>> SpawnWorkers(const std::vector<std::string>& argv, int world_size,
                                          const std::vector<int>& ranks, const ncclUniqueId& id) {
  if (argv.empty() || argv[0].empty()) {
    return InvalidArgumentError(
        "SpawnLocalWorkers: argv is empty (argv[0] must be the executable)");
  }
  for (int rank : ranks) {
    if (rank < 1 || rank >= world_size) {
      return InvalidArgumentError("SpawnWorkers: rank " + std::to_string(rank) + " outside [1, " +
                                  std::to_string(world_size) + ")");
    }
  }
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  std::vector<std::string> base_env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (!IsOverriddenVar(*e)) base_env.emplace_back(*e);
  }
  const std::string id_var = std::string(kEnvNcclId) + "=" + NcclUniqueIdToHex(id);
  const std::string world_var = std::string(kEnvWorldSize) + "=" + std::to_string(world_size);

  // The children start with no signal blocked and the termination signals at
  // their default action, whatever the caller has (tpserve serve blocks
  // SIGTERM/SIGINT/SIGUSR1 for its signal thread before it spawns ranks): a
  // worker's PR_SET_PDEATHSIG SIGTERM, or an operator's SIGTERM, must end it.
  posix_spawnattr_t attr;
  ::posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int sig : {SIGTERM, SIGINT, SIGUSR1, SIGHUP, SIGPIPE}) sigaddset(&defaults, sig);
  ::posix_spawnattr_setsigmask(&attr, &none);
  ::posix_spawnattr_setsigdefault(&attr, &defaults);
  ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  struct AttrGuard {
    posix_spawnattr_t* a;
    ~AttrGuard() { ::posix_spawnattr_destroy(a); }
  } attr_guard{&attr};

  // The children start with stdin, stdout and stderr only.
  posix_spawn_file_actions_t actions;
  if (const int err = ::posix_spawn_file_actions_init(&actions); err != 0) {
    return InternalError("SpawnWorkers: posix_spawn_file_actions_init: " + ErrnoText(err));
  }
  struct ActionsGuard {
    posix_spawn_file_actions_t* a;
    ~ActionsGuard() { ::posix_spawn_file_actions_destroy(a); }
  } actions_guard{&actions};
  for (int fd : InheritableFds()) {
    if (const int err = ::posix_spawn_file_actions_addclose(&actions, fd); err != 0) {
      return InternalError("SpawnWorkers: posix_spawn_file_actions_addclose(" + std::to_string(fd) +
                           "): " + ErrnoText(err));
    }
  }

  std::vector<pid_t> pids;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int rank = ranks[i];
    std::vector<std::string> own = {std::string(kEnvRank) + "=" + std::to_string(rank),
                                    std::string(kEnvLocalRank) + "=" + std::to_string(i + 1),
                                    world_var, id_var};
    std::vector<char*> envp;
    envp.reserve(base_env.size() + own.size() + 1);
    for (const std::string& e : base_env) envp.push_back(const_cast<char*>(e.c_str()));
    for (const std::string& e : own) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);

    pid_t pid = -1;
    const int err = ::posix_spawn(&pid, argv[0].c_str(), &actions, &attr, args.data(), envp.data());
    if (err != 0) {
      KillAndReap(pids);
      return InternalError("SpawnLocalWorkers: starting rank " + std::to_string(rank) + " of " +
                           std::to_string(world_size) + " ('" + argv[0] +
                           "') failed: " + ErrnoText(err) + "; the " + std::to_string(pids.size()) +
                           " rank(s) already started were killed");
    }
    spdlog::info("started rank {} of {} as pid {} ({})", rank, world_size, pid, argv[0]);
    pids.push_back(pid);
  }
  return pids;
}

StatusOr<LaunchPlan> PlanLaunch(const StatusOr<RankInfo>& info, int tp) {
  LaunchPlan plan;
  plan.world_size = tp;
  if (!info.ok()) {
    if (info.status().code() != StatusCode::kNotFound) return info.status();
    for (int r = 1; r < tp; ++r) plan.spawn_ranks.push_back(r);  // a single node
    return plan;
  }
  if (info->world_size != tp) {
    return InvalidArgumentError("the launcher's world size (" + info->source + ": " +
                                std::to_string(info->world_size) + " ranks) is not --tp " +
                                std::to_string(tp));
  }
  plan.rank = info->rank;
  plan.local_rank = info->local_rank;
  plan.role = info->rank == 0 ? LaunchPlan::Role::kLeader : LaunchPlan::Role::kWorker;
  if (info->source == "tpserve") {
    plan.id_from_env = true;  // started by SpawnWorkers, which spawns the node's ranks
    return plan;
  }
  for (int i = 1; i <= info->spawn_local; ++i) plan.spawn_ranks.push_back(info->rank + i);
  const int launched = tp / (info->spawn_local + 1);  // processes the launcher started
  if (info->rank == 0) {
    plan.serve_id_clients = launched - 1;
  } else {
    plan.fetch_id = true;
  }
  return plan;
}

// ---- rendezvous ------------------------------------------------------------------

StatusOr<UniqueIdServer> UniqueIdServer::Listen(uint16_t port) {
  Fd fd;
  std::string err6 = ListenOn(AF_INET6, port, &fd);
  if (!err6.empty()) {
    if (std::string err4 = ListenOn(AF_INET, port, &fd); !err4.empty()) {
      return UnavailableError("NCCL id rendezvous: cannot listen on port " + std::to_string(port) +
                              ": " + err4 + " (IPv6: " + err6 + ")");
    }
  }
  const uint16_t bound = BoundPort(fd.get());
  return UniqueIdServer(fd.release(), bound);
}

UniqueIdServer::UniqueIdServer(UniqueIdServer&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), port_(other.port_) {}

UniqueIdServer& UniqueIdServer::operator=(UniqueIdServer&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    port_ = other.port_;
  }
  return *this;
}

UniqueIdServer::~UniqueIdServer() {
  if (fd_ >= 0) ::close(fd_);
}

Status UniqueIdServer::Serve(const ncclUniqueId& id, int expected_clients,
                             Clock::time_point deadline) {
  if (fd_ < 0) return FailedPreconditionError("UniqueIdServer::Serve on a moved-from server");
  if (expected_clients < 0) {
    return InvalidArgumentError("UniqueIdServer::Serve: expected_clients " +
                                std::to_string(expected_clients) + " < 0");
  }
  char reply[kHelloBytes + kIdBytes];
  std::memcpy(reply, kRendezvousHello, kHelloBytes);
  std::memcpy(reply + kHelloBytes, id.internal, kIdBytes);

  int served = 0;
  while (served < expected_clients) {
    if (Clock::now() >= deadline) {
      return DeadlineExceededError("NCCL id rendezvous on port " + std::to_string(port_) +
                                   ": served " + std::to_string(served) + " of " +
                                   std::to_string(expected_clients) + " ranks before the deadline");
    }
    if (std::string e = WaitFd(fd_, POLLIN, deadline); !e.empty()) {
      if (e == "timed out") continue;  // the deadline check above reports it
      return UnavailableError("NCCL id rendezvous on port " + std::to_string(port_) + ": " + e);
    }
    Fd conn(::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (conn.get() < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) {
        continue;
      }
      return UnavailableError("NCCL id rendezvous on port " + std::to_string(port_) +
                              ": accept: " + ErrnoText(errno));
    }
    const Clock::time_point io_deadline = std::min(deadline, Clock::now() + kPerClientIo);
    char hello[kHelloBytes];
    std::string e = ReadAll(conn.get(), hello, kHelloBytes, io_deadline);
    if (e.empty() && std::memcmp(hello, kRendezvousHello, kHelloBytes) != 0) {
      e = "it did not send the tpserve rendezvous greeting";
    }
    // A fetcher that gave up waiting (its connection sat in the backlog) has
    // closed its end and retries on a new connection: the reply would still
    // be "sent", and counting it would leave the retrying rank unserved.
    if (char c; e.empty() && ::recv(conn.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0) {
      e = "the client had already closed the connection";
    }
    if (e.empty()) e = WriteAll(conn.get(), reply, sizeof reply, io_deadline);
    if (!e.empty()) {
      spdlog::debug("NCCL id rendezvous on port {}: dropped a connection: {}", port_, e);
      continue;
    }
    ++served;
  }
  return Status::Ok();
}

Status ServeUniqueId(const ncclUniqueId& id, uint16_t port, int expected_clients,
                     Clock::time_point deadline) {
  TP_ASSIGN_OR_RETURN(UniqueIdServer server, UniqueIdServer::Listen(port));
  return server.Serve(id, expected_clients, deadline);
}

StatusOr<ncclUniqueId> FetchUniqueId(const std::string& host, uint16_t port,
                                     Clock::time_point deadline) {
  const Clock::time_point start = Clock::now();
  std::string last = "no attempt made before the deadline";
  int attempts = 0;
  while (Clock::now() < deadline) {
    ncclUniqueId id;
    ++attempts;
    std::string e = TryFetch(host, port, deadline, &id);
    if (e.empty()) return id;
    last = std::move(e);
    const Clock::time_point wake = std::min(deadline, Clock::now() + kRetryInterval);
    std::this_thread::sleep_until(wake);
  }
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  return DeadlineExceededError("could not fetch the NCCL unique id from " + host + ":" +
                               std::to_string(port) + " within " + std::to_string(waited) +
                               " ms (" + std::to_string(attempts) +
                               " attempts); last error: " + last);
}

}  // namespace tpserve
