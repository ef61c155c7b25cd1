// MetricsHttpServer: the Prometheus endpoint of `tpserve serve`, a small HTTP/1.1 server
// that answers GET (and HEAD) /metrics and nothing else, with hard bounds whatever clients
// send:
//   - memory: a request's line and headers are read into at most `max_header_bytes` per
//     connection (431 beyond); a request body is never read into memory (a request that
//     announces one is answered, then the connection is closed after its unread bytes are
//     discarded for at most a second); at most `max_connections` connections are open;
//   - time: a request must arrive whole within `read_timeout` of the connection's accept
//     (or of the previous response on a kept-alive connection) and its response must be
//     taken within `write_timeout`; a connection that trickles bytes is closed at its
//     deadline, not kept alive by each byte;
//   - fairness: one thread multiplexes every connection with poll(), so no connection waits
//     for another; a new connection beyond `max_connections` displaces an open one: one
//     being drained, else the one whose current read (a request arriving, or an idle wait
//     between requests) began first, else the oldest write. Slow and idle clients go, not a
//     scrape that has just connected.
// Answers: 200 for GET/HEAD /metrics (query ignored), 404 for other paths, 405 (Allow: GET,
// HEAD) for other methods on /metrics, 400 for a malformed request, 431 for headers beyond
// the cap, 505 for an HTTP version other than 1.0 and 1.1, 500 if the body function throws.
// Every response carries Content-Length; connections are kept alive per HTTP/1.1 unless the
// request says close, is HTTP/1.0 without keep-alive, or has a body.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "comm/status.h"

namespace tpserve {

struct MetricsHttpOptions {
  // Bind address: a name, an IPv4 or an IPv6 address (with or without brackets).
  std::string host = "127.0.0.1";
  // TCP port; 0 picks a free one (see MetricsHttpServer::port()).
  int port = 8002;
  // Open connections at most; one more displaces the longest-waiting one (see above).
  int max_connections = 64;
  // Bytes of request line and headers per request at most (431 beyond).
  size_t max_header_bytes = 8192;
  // A request's line and headers must arrive within this (an idle kept-alive connection is
  // closed after it too). Well under Prometheus's default scrape timeout (10 s).
  std::chrono::milliseconds read_timeout{5000};
  // A response must be taken by the client within this, else the connection is closed.
  std::chrono::milliseconds write_timeout{5000};
};

// Checks `options` (positive limits); InvalidArgument names the field.
Status ValidateMetricsHttpOptions(const MetricsHttpOptions& options);

// A TCP socket bound to host:port with the options of every tpserve listener: SO_REUSEADDR
// (as gRPC's own listeners have it, so that a restart binds while the previous process's
// connections sit in TIME_WAIT; the TIME_WAIT sockets inherit the option from the listener,
// and the kernel lets a new socket share the port only when both have it), close-on-exec,
// non-blocking. `host` is resolved with getaddrinfo (AI_PASSIVE, the first answer; brackets
// around an IPv6 address removed). Errors: InvalidArgument "HOST: not an address or a name
// that resolves (why)"; AlreadyExists "PORT: in use on HOST"; Unavailable "HOST: cannot
// listen there (why)". The caller owns the descriptor.
StatusOr<int> BindListenSocket(std::string host, int port);

// The parsed line and headers of one request (views into the caller's buffer).
struct HttpRequestHead {
  std::string_view method;
  std::string_view target;
  int minor_version = 1;   // HTTP/1.x
  bool keep_alive = true;  // HTTP/1.1 without "Connection: close", or 1.0 with keep-alive
  bool has_body = false;   // Content-Length > 0 or any Transfer-Encoding
};

enum class HttpParse {
  kIncomplete,  // no blank line yet
  kComplete,    // *head and *head_bytes are set
  kBad,         // malformed: 400
  kBadVersion,  // not HTTP/1.0 or 1.1: 505
  kTooLarge,    // no blank line within max_header_bytes: 431
};

// Parses the request line and headers at the start of `buf` (leading empty lines skipped).
// *head_bytes: the bytes up to and including the blank line. Pure; never reads past `buf`.
HttpParse ParseHttpRequestHead(std::string_view buf, size_t max_header_bytes, HttpRequestHead* head,
                               size_t* head_bytes);

// Thread-safety: Listen, Start, Stop and the destructor from one thread; `body` runs on the
// server's thread.
class MetricsHttpServer {
 public:
  // Binds and listens (BindListenSocket's errors) without serving yet: connections wait in
  // the kernel's backlog until Start.
  static StatusOr<std::unique_ptr<MetricsHttpServer>> Listen(const MetricsHttpOptions& options);
  ~MetricsHttpServer();  // Stop()
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

  // Serves until Stop on a thread of its own; `body` makes each 200 response's body (the
  // Prometheus text exposition). Once only.
  void Start(std::function<std::string()> body);

  // Closes the listener and every connection and joins the thread; `body` is not called
  // after it returns. Idempotent.
  void Stop();

 private:
  class Loop;
  MetricsHttpServer() = default;
  MetricsHttpOptions options_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: Stop wakes the thread's poll
  int port_ = 0;
  std::unique_ptr<Loop> loop_;  // runs on thread_
  std::thread thread_;
};

}  // namespace tpserve
