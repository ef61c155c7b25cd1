#include "server/metrics_http.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <vector>

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;

// Unread bytes of a request that is answered without being read whole (a body, headers
// beyond the cap) are discarded for at most this long before the connection is closed:
// closing with unread bytes sends a reset, which can destroy the response before the
// client reads it.
constexpr std::chrono::milliseconds kMaxDrain{1000};
// Warnings a client can cause (displaced connections, accept failures) at most this often.
constexpr std::chrono::seconds kWarnEvery{60};

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// RFC 9110 tchar.
bool IsTokenChar(char c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
  return c != '\0' && std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

bool IsToken(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), IsTokenChar);
}

// The comma-separated tokens of a Connection header: close / keep-alive.
void ReadConnectionHeader(std::string_view value, bool* close, bool* keep_alive) {
  while (!value.empty()) {
    const size_t comma = value.find(',');
    const std::string_view token = Trim(value.substr(0, comma));
    if (EqualsIgnoreCase(token, "close")) *close = true;
    if (EqualsIgnoreCase(token, "keep-alive")) *keep_alive = true;
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
}

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Internal Server Error";
  }
}

std::string Response(int status, std::string_view content_type, const std::string& body,
                     bool send_body, bool keep_alive, std::string_view extra_headers = {}) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + Reason(status) + "\r\n";
  out += "Content-Type: ";
  out += content_type;
  out += "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  out += extra_headers;
  out += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  if (send_body) out += body;
  return out;
}

}  // namespace

Status ValidateMetricsHttpOptions(const MetricsHttpOptions& o) {
  if (o.port < 0 || o.port > 65535) return InvalidArgumentError("metrics port: 0 to 65535");
  if (o.max_connections < 1) return InvalidArgumentError("metrics max_connections: at least 1");
  if (o.max_header_bytes < 64) {
    return InvalidArgumentError("metrics max_header_bytes: at least 64");
  }
  if (o.read_timeout.count() < 1 || o.write_timeout.count() < 1) {
    return InvalidArgumentError("metrics read/write timeouts: at least 1 ms");
  }
  return Status::Ok();
}

StatusOr<int> BindListenSocket(std::string host, int port) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return InvalidArgumentError(host + ": not an address or a name that resolves (" +
                                gai_strerror(rc) + ")");
  }
  const int fd = socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                        found->ai_protocol);
  if (fd < 0) {
    const int err = errno;
    freeaddrinfo(found);
    return UnavailableError(host + ": cannot listen there (" + std::strerror(err) + ")");
  }
  const int one = 1;
  int err = 0;
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
    err = errno;
  }
  freeaddrinfo(found);
  if (err != 0) {
    close(fd);
    if (err == EADDRINUSE) {
      return Status(StatusCode::kAlreadyExists, service + ": in use on " + host);
    }
    return UnavailableError(host + ": cannot listen there (" + std::strerror(err) + ")");
  }
  return fd;
}

HttpParse ParseHttpRequestHead(std::string_view buf, size_t max_header_bytes, HttpRequestHead* head,
                               size_t* head_bytes) {
  if (buf.size() > max_header_bytes) buf = buf.substr(0, max_header_bytes);
  // Lines end in LF (CR before it optional, as RFC 9112 allows a recipient to accept).
  std::vector<std::string_view> lines;
  size_t pos = 0;
  size_t end = std::string_view::npos;
  while (pos < buf.size()) {
    const size_t nl = buf.find('\n', pos);
    if (nl == std::string_view::npos) break;
    std::string_view line = buf.substr(pos, nl - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    pos = nl + 1;
    if (line.empty()) {
      if (lines.empty()) continue;  // empty lines before the request line are ignored
      end = pos;
      break;
    }
    lines.push_back(line);
  }
  if (end == std::string_view::npos) {
    return buf.size() >= max_header_bytes ? HttpParse::kTooLarge : HttpParse::kIncomplete;
  }
  *head_bytes = end;
  HttpRequestHead h;
  // Request line: METHOD SP TARGET SP HTTP/1.x
  const std::string_view request_line = lines[0];
  const size_t sp1 = request_line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : request_line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || request_line.find(' ', sp2 + 1) != std::string_view::npos) {
    return HttpParse::kBad;
  }
  h.method = request_line.substr(0, sp1);
  h.target = request_line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = request_line.substr(sp2 + 1);
  if (!IsToken(h.method) || h.target.empty()) return HttpParse::kBad;
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || version[6] != '.' ||
      version[5] < '0' || version[5] > '9' || version[7] < '0' || version[7] > '9') {
    return HttpParse::kBad;
  }
  if (version[5] != '1' || (version[7] != '0' && version[7] != '1')) return HttpParse::kBadVersion;
  h.minor_version = version[7] - '0';
  bool says_close = false, says_keep_alive = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    const size_t colon = line.find(':');
    // No whitespace before the colon; no obsolete line folding (a line starting with
    // whitespace).
    if (colon == std::string_view::npos || !IsToken(line.substr(0, colon))) return HttpParse::kBad;
    const std::string_view name = line.substr(0, colon);
    const std::string_view value = Trim(line.substr(colon + 1));
    if (EqualsIgnoreCase(name, "Content-Length")) {
      if (value.empty() ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        return HttpParse::kBad;
      }
      if (value.find_first_not_of('0') != std::string_view::npos) h.has_body = true;
    } else if (EqualsIgnoreCase(name, "Transfer-Encoding")) {
      h.has_body = true;
    } else if (EqualsIgnoreCase(name, "Connection")) {
      ReadConnectionHeader(value, &says_close, &says_keep_alive);
    }
  }
  h.keep_alive = !says_close && (h.minor_version == 1 || says_keep_alive);
  *head = h;
  return HttpParse::kComplete;
}

// The poll loop: one per server, on its thread.
class MetricsHttpServer::Loop {
 public:
  Loop(const MetricsHttpOptions& options, int listen_fd, int wake_fd,
       std::function<std::string()> body)
      : o_(options), listen_fd_(listen_fd), wake_fd_(wake_fd), body_(std::move(body)) {}

  ~Loop() {
    for (Conn& c : conns_) Abort(c);
  }

  void Run() {
    std::vector<pollfd> fds;
    for (;;) {
      const Clock::time_point now = Clock::now();
      fds.clear();
      fds.push_back({wake_fd_, POLLIN, 0});
      const bool accepting = now >= accept_paused_until_;
      fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
      Clock::time_point next = accepting ? now + std::chrono::seconds(1) : accept_paused_until_;
      for (const Conn& c : conns_) {
        fds.push_back({c.fd, static_cast<short>(c.phase == Phase::kWriting ? POLLOUT : POLLIN), 0});
        next = std::min(next, c.deadline);
      }
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - now);
      const int ready =
          poll(fds.data(), fds.size(),
               static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(wait.count(), 1000))));
      if (ready < 0 && errno != EINTR) {
        spdlog::error("metrics: poll failed ({}); the metrics endpoint stops",
                      std::strerror(errno));
        return;
      }
      if (ready > 0 && fds[0].revents != 0) return;  // Stop
      // Connections first (their slots are fds[2...]), then new ones, which may displace.
      for (size_t i = 0; i < conns_.size(); ++i) {
        if (ready > 0 && fds[i + 2].revents != 0) Progress(conns_[i]);
      }
      const Clock::time_point after = Clock::now();
      for (Conn& c : conns_) {
        // Past its deadline (a request that never arrived whole, a response not taken, a
        // drain): closed without an answer, which the client would not wait for either.
        if (c.fd >= 0 && after >= c.deadline) Abort(c);
      }
      conns_.erase(
          std::remove_if(conns_.begin(), conns_.end(), [](const Conn& c) { return c.fd < 0; }),
          conns_.end());
      if (ready > 0 && fds[1].revents != 0) Accept();
    }
  }

 private:
  enum class Phase {
    kReading,   // the request's line and headers are read
    kWriting,   // the response is written
    kDraining,  // answered; unread request bytes are discarded until EOF or the deadline
  };
  struct Conn {
    int fd = -1;
    Phase phase = Phase::kReading;
    Clock::time_point phase_start;
    Clock::time_point deadline;
    std::string in;      // at most max_header_bytes: the request head being read
    size_t scanned = 0;  // bytes of `in` known to hold no complete head
    std::string out;     // the response being written
    size_t written = 0;
    bool close_after = false;  // close once the response is written
    bool drain = false;        // unread request bytes may follow: drain before closing
  };

  void StartPhase(Conn& c, Phase phase) {
    c.phase = phase;
    c.phase_start = Clock::now();
    const auto limit = phase == Phase::kReading   ? o_.read_timeout
                       : phase == Phase::kWriting ? o_.write_timeout
                                                  : std::min(o_.read_timeout, kMaxDrain);
    c.deadline = c.phase_start + limit;
  }

  static void Close(Conn& c) {
    if (c.fd >= 0) close(c.fd);
    c.fd = -1;
  }

  // Closes `c` at once: one that is writing with a reset, so that the kernel does not keep
  // sending what is left of its response (megabytes, to a client that reads slowly, for as
  // long as the client keeps its window open a crack).
  static void Abort(Conn& c) {
    if (c.fd >= 0 && c.phase == Phase::kWriting) {
      const linger reset{1, 0};
      setsockopt(c.fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
    }
    Close(c);
  }

  void Accept() {
    for (int i = 0; i < 64; ++i) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) return;
        // Out of descriptors (EMFILE, ENFILE) or memory: the listener stays readable, so
        // accepting pauses instead of spinning.
        accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
        accept_failed_.Log(std::string("metrics: accept failed (") + std::strerror(err) +
                           "); pausing new connections for 100 ms");
        return;
      }
      // Each response is one send: Nagle's algorithm would only hold a kept-alive
      // connection's next response until the client's delayed acknowledgement of the last.
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      if (static_cast<int>(conns_.size()) >= o_.max_connections) Displace();
      Conn c;
      c.fd = fd;
      StartPhase(c, Phase::kReading);
      conns_.push_back(std::move(c));
    }
  }

  // Closes the connection that is furthest from answering: one draining if any, else the
  // one whose read (or else write) began first.
  void Displace() {
    auto rank = [](const Conn& c) {
      return c.phase == Phase::kDraining ? 0 : c.phase == Phase::kReading ? 1 : 2;
    };
    auto victim = std::min_element(conns_.begin(), conns_.end(), [&](const Conn& a, const Conn& b) {
      return rank(a) != rank(b) ? rank(a) < rank(b) : a.phase_start < b.phase_start;
    });
    Abort(*victim);
    conns_.erase(victim);
    displaced_.Log("metrics: a connection beyond the cap of " + std::to_string(o_.max_connections) +
                   " (--metrics-max-connections) displaced the longest-waiting one");
  }

  // A warning that clients can cause as often as they like: logged at most once per
  // kWarnEvery, with how often it happened since.
  struct RateLimitedWarning {
    int64_t count = 0;
    Clock::time_point last;
    void Log(const std::string& message) {
      ++count;
      const Clock::time_point now = Clock::now();
      if (last != Clock::time_point{} && now - last < kWarnEvery) return;
      last = now;
      if (count == 1) {
        spdlog::warn("{}", message);
      } else {
        spdlog::warn("{} ({} times since the last such warning)", message, count);
      }
      count = 0;
    }
  };

  // Moves `c` on as far as its socket allows.
  void Progress(Conn& c) {
    for (;;) {
      switch (c.phase) {
        case Phase::kReading:
          if (!Read(c)) return;
          break;
        case Phase::kWriting:
          if (!Write(c)) return;
          break;
        case Phase::kDraining:
          Drain(c);
          return;
      }
      if (c.fd < 0) return;
    }
  }

  // Reads what has arrived of the request head; true when it moved on to writing.
  bool Read(Conn& c) {
    if (!Answer(c)) {
      const size_t room = o_.max_header_bytes - c.in.size();  // > 0: Answer took a full one
      const size_t old = c.in.size();
      c.in.resize(old + room);
      const ssize_t n = recv(c.fd, c.in.data() + old, room, 0);
      c.in.resize(old + static_cast<size_t>(std::max<ssize_t>(n, 0)));
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        Close(c);  // the client went away (or half-closed before a whole request)
        return false;
      }
      if (n < 0 || !Answer(c)) return false;
    }
    return true;
  }

  // If `c.in` holds a whole head (or can never hold one), prepares the answer and switches to
  // writing; false if more bytes are needed.
  bool Answer(Conn& c) {
    // Empty lines before a request line are ignored (RFC 9112 section 2.2).
    if (c.scanned == 0) {
      const size_t text = c.in.find_first_not_of("\r\n");
      c.in.erase(0, text == std::string::npos ? c.in.size() : text);
    }
    // Only the bytes since the last look (and 2 before: a split blank line) are searched
    // for the blank line, so that a trickle costs linear, not quadratic, work.
    const size_t from = c.scanned > 2 ? c.scanned - 2 : 0;
    const std::string_view view(c.in);
    const bool blank_line = view.find("\n\r\n", from) != std::string_view::npos ||
                            view.find("\n\n", from) != std::string_view::npos;
    if (!blank_line && c.in.size() < o_.max_header_bytes) {
      c.scanned = c.in.size();
      return false;
    }
    HttpRequestHead head;
    size_t head_bytes = 0;
    const HttpParse parsed = ParseHttpRequestHead(view, o_.max_header_bytes, &head, &head_bytes);
    if (parsed == HttpParse::kIncomplete) {  // not reached: a blank line or a full buffer
      c.scanned = c.in.size();
      return false;
    }
    c.written = 0;
    c.drain = false;
    if (parsed != HttpParse::kComplete) {
      const int status = parsed == HttpParse::kBadVersion ? 505
                         : parsed == HttpParse::kTooLarge ? 431
                                                          : 400;
      c.out = Response(status, "text/plain; charset=utf-8", std::string(Reason(status)) + "\n",
                       true, false);
      c.close_after = true;
      c.drain = true;
      c.in.clear();
    } else {
      c.close_after = !head.keep_alive || head.has_body;
      c.drain = head.has_body;
      c.out = ResponseFor(head, !c.close_after);
      if (c.close_after) {
        c.in.clear();
      } else {
        c.in.erase(0, head_bytes);  // a pipelined next request stays
      }
    }
    c.scanned = 0;
    StartPhase(c, Phase::kWriting);
    return true;
  }

  std::string ResponseFor(const HttpRequestHead& head, bool keep_alive) {
    const std::string_view path = head.target.substr(0, head.target.find('?'));
    if (path != "/metrics") {
      return Response(404, "text/plain; charset=utf-8", "not found: only /metrics is served\n",
                      head.method != "HEAD", keep_alive);
    }
    if (head.method != "GET" && head.method != "HEAD") {
      return Response(405, "text/plain; charset=utf-8", "method not allowed: GET /metrics\n", true,
                      keep_alive, "Allow: GET, HEAD\r\n");
    }
    std::string body;
    try {
      body = body_();
    } catch (const std::exception& e) {
      spdlog::error("metrics: making the body failed: {}", e.what());
      return Response(500, "text/plain; charset=utf-8", "internal error\n", true, keep_alive);
    } catch (...) {
      spdlog::error("metrics: making the body failed");
      return Response(500, "text/plain; charset=utf-8", "internal error\n", true, keep_alive);
    }
    return Response(200, "text/plain; version=0.0.4; charset=utf-8", body, head.method == "GET",
                    keep_alive);
  }

  // Writes what the socket takes; true when the response is out and the connection moved
  // on (reading the next request, or draining).
  bool Write(Conn& c) {
    while (c.written < c.out.size()) {
      const ssize_t n = send(c.fd, c.out.data() + c.written, c.out.size() - c.written,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) Close(c);
        return false;
      }
      c.written += static_cast<size_t>(n);
    }
    std::string().swap(c.out);  // a kept-alive connection holds no response between requests
    c.written = 0;
    if (!c.close_after) {
      StartPhase(c, Phase::kReading);
      return true;  // a pipelined request may already be whole in c.in
    }
    if (!c.drain) {
      Close(c);
      return false;
    }
    shutdown(c.fd, SHUT_WR);  // the response ends here; the client sees EOF after it
    StartPhase(c, Phase::kDraining);
    return true;
  }

  void Drain(Conn& c) {
    char scratch[16384];
    for (int i = 0; i < 16; ++i) {  // a bounded share of this turn of the loop
      const ssize_t n = recv(c.fd, scratch, sizeof scratch, 0);
      if (n > 0) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      Close(c);  // EOF or error: done
      return;
    }
  }

  const MetricsHttpOptions o_;
  const int listen_fd_;
  const int wake_fd_;
  const std::function<std::string()> body_;
  std::vector<Conn> conns_;
  Clock::time_point accept_paused_until_;
  RateLimitedWarning displaced_, accept_failed_;
};

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Listen(
    const MetricsHttpOptions& options) {
  TP_RETURN_IF_ERROR(ValidateMetricsHttpOptions(options));
  TP_ASSIGN_OR_RETURN(const int fd, BindListenSocket(options.host, options.port));
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->options_ = options;
  server->listen_fd_ = fd;
  if (listen(fd, SOMAXCONN) != 0) {
    return UnavailableError(options.host + ":" + std::to_string(options.port) +
                            ": cannot listen (" + std::strerror(errno) + ")");
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return InternalError(std::string("metrics: getsockname: ") + std::strerror(errno));
  }
  server->port_ =
      ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port
                                       : reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  server->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (server->wake_fd_ < 0) {
    return InternalError(std::string("metrics: eventfd: ") + std::strerror(errno));
  }
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void MetricsHttpServer::Start(std::function<std::string()> body) {
  if (thread_.joinable() || listen_fd_ < 0) return;
  loop_ = std::make_unique<Loop>(options_, listen_fd_, wake_fd_, std::move(body));
  thread_ = std::thread([loop = loop_.get()] { loop->Run(); });
}

void MetricsHttpServer::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof one) < 0) {
      spdlog::error("metrics: waking the server thread failed: {}", std::strerror(errno));
    }
    thread_.join();
  }
  loop_.reset();  // closes its connections
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
}

}  // namespace tpserve
