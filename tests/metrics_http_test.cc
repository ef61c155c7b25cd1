#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace tpserve {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// --- the parser --------------------------------------------------------------------------

HttpParse Parse(std::string_view text, HttpRequestHead* head, size_t* bytes = nullptr,
                size_t max = 8192) {
  size_t unused = 0;
  return ParseHttpRequestHead(text, max, head, bytes != nullptr ? bytes : &unused);
}

TEST(ParseHttpRequestHead, ReadsTheRequestLineAndWhatDecidesTheConnection) {
  HttpRequestHead h;
  size_t bytes = 0;
  const std::string get = "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept: */*\r\n\r\n";
  const std::string pipelined = get + "GET /next";  // outlives the views into it
  ASSERT_EQ(Parse(pipelined, &h, &bytes), HttpParse::kComplete);
  EXPECT_EQ(h.method, "GET");
  EXPECT_EQ(h.target, "/metrics?x=1");
  EXPECT_EQ(h.minor_version, 1);
  EXPECT_TRUE(h.keep_alive);
  EXPECT_FALSE(h.has_body);
  EXPECT_EQ(bytes, get.size());  // a pipelined request after it is not consumed

  ASSERT_EQ(Parse("GET / HTTP/1.1\r\nconnection: Upgrade, CLOSE\r\n\r\n", &h),
            HttpParse::kComplete);
  EXPECT_FALSE(h.keep_alive);
  ASSERT_EQ(Parse("GET / HTTP/1.0\r\n\r\n", &h), HttpParse::kComplete);
  EXPECT_FALSE(h.keep_alive);
  ASSERT_EQ(Parse("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", &h), HttpParse::kComplete);
  EXPECT_TRUE(h.keep_alive);
  // Bare LF line ends and leading empty lines are accepted.
  ASSERT_EQ(Parse("\r\n\nHEAD /metrics HTTP/1.1\nHost: a\n\n", &h), HttpParse::kComplete);
  EXPECT_EQ(h.method, "HEAD");
}

TEST(ParseHttpRequestHead, NotesABodyWithoutReadingIt) {
  HttpRequestHead h;
  ASSERT_EQ(Parse("POST /metrics HTTP/1.1\r\nContent-Length: 300000000\r\n\r\n", &h),
            HttpParse::kComplete);
  EXPECT_TRUE(h.has_body);
  ASSERT_EQ(Parse("GET /metrics HTTP/1.1\r\nContent-Length: 000\r\n\r\n", &h),
            HttpParse::kComplete);
  EXPECT_FALSE(h.has_body);
  ASSERT_EQ(Parse("GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", &h),
            HttpParse::kComplete);
  EXPECT_TRUE(h.has_body);
  // A length that overflows any integer is still only digits: a body, not a crash.
  ASSERT_EQ(Parse("GET / HTTP/1.1\r\nContent-Length: 99999999999999999999999999\r\n\r\n", &h),
            HttpParse::kComplete);
  EXPECT_TRUE(h.has_body);
}

TEST(ParseHttpRequestHead, RefusesMalformedRequests) {
  HttpRequestHead h;
  for (const char* bad :
       {"GET\r\n\r\n", "GET /metrics\r\n\r\n", "GET  /metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1 x\r\n\r\n", "GET /metrics HTTP/x.1\r\n\r\n",
        "G(T /metrics HTTP/1.1\r\n\r\n", "GET /metrics HTTP/1.1\r\nNo colon\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nName : v\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nA: b\r\n folded\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n"}) {
    EXPECT_EQ(Parse(bad, &h), HttpParse::kBad) << bad;
  }
  EXPECT_EQ(Parse("GET /metrics HTTP/2.0\r\n\r\n", &h), HttpParse::kBadVersion);
  EXPECT_EQ(Parse("GET /metrics HTTP/1.2\r\n\r\n", &h), HttpParse::kBadVersion);
}

TEST(ParseHttpRequestHead, StopsAtTheHeaderCap) {
  HttpRequestHead h;
  EXPECT_EQ(Parse("GET /metrics HTTP/1.1\r\nA: b\r\n", &h), HttpParse::kIncomplete);
  std::string many = "GET /metrics HTTP/1.1\r\n";
  while (many.size() < 200) many += "X: y\r\n";
  EXPECT_EQ(Parse(many, &h, nullptr, 100), HttpParse::kTooLarge);
  // A blank line beyond the cap does not count.
  EXPECT_EQ(Parse(many + "\r\n", &h, nullptr, 100), HttpParse::kTooLarge);
  EXPECT_EQ(Parse(many + "\r\n", &h, nullptr, many.size() + 2), HttpParse::kComplete);
}

// --- the server over loopback ------------------------------------------------------------

// A blocking loopback client with a receive timeout.
class Client {
 public:
  explicit Client(int port, std::chrono::milliseconds timeout = 3000ms) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    timeval tv{};
    tv.tv_sec = timeout.count() / 1000;
    tv.tv_usec = (timeout.count() % 1000) * 1000;
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  ~Client() { close(fd_); }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }

  // False if the server closed or reset first.
  bool Send(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // One response: "STATUS\n" + headers + body, or "" on EOF, error or timeout.
  std::string Response() {
    for (;;) {
      const size_t end = buf_.find("\r\n\r\n");
      if (end != std::string::npos) {
        const std::string head = buf_.substr(0, end + 4);
        size_t length = 0;
        if (const size_t cl = head.find("Content-Length: "); cl != std::string::npos) {
          length = std::stoul(head.substr(cl + 16));
        }
        const bool head_only = last_was_head_;
        if (head_only) length = 0;
        while (buf_.size() < end + 4 + length) {
          if (!Fill()) return "";
        }
        std::string r = buf_.substr(0, end + 4 + length);
        buf_.erase(0, end + 4 + length);
        return r;
      }
      if (!Fill()) return "";
    }
  }
  void ExpectHeadResponse() { last_was_head_ = true; }

  // True if the server closes the connection (EOF or reset) within the receive timeout,
  // discarding what comes before.
  bool ClosedByServer() {
    char b[4096];
    for (;;) {
      const ssize_t n = recv(fd_, b, sizeof b, 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }

 private:
  bool Fill() {
    char b[65536];
    const ssize_t n = recv(fd_, b, sizeof b, 0);
    if (n <= 0) return false;
    buf_.append(b, static_cast<size_t>(n));
    return true;
  }
  int fd_ = -1;
  bool connected_ = false;
  bool last_was_head_ = false;
  std::string buf_;
};

int StatusOf(const std::string& response) {
  return response.size() > 12 ? std::stoi(response.substr(9, 3)) : 0;
}

std::string BodyOf(const std::string& response) {
  const size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? "" : response.substr(end + 4);
}

class MetricsHttpServerTest : public ::testing::Test {
 protected:
  void StartServer(MetricsHttpOptions o = {}) {
    o.host = "127.0.0.1";
    o.port = 0;
    auto s = MetricsHttpServer::Listen(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value();
    server_->Start([this] {
      const int call = ++calls_;
      return call == 1 && !first_body_.empty() ? first_body_ : body_;
    });
  }
  int port() const { return server_->port(); }
  std::string Get(Client& c, const std::string& path = "/metrics") {
    EXPECT_TRUE(c.Send("GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n"));
    return c.Response();
  }

  // Fixed before StartServer (read on the server's thread): the first response's body if
  // not empty, and every other's.
  std::string first_body_;
  std::string body_ = "tpserve_requests_total 1\n";
  std::atomic<int> calls_{0};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpServerTest, ServesMetricsAndKeepsTheConnection) {
  StartServer();
  Client c(port());
  ASSERT_TRUE(c.connected());
  for (int i = 0; i < 3; ++i) {
    const std::string r = Get(c);
    EXPECT_EQ(StatusOf(r), 200) << r;
    EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << r;
    EXPECT_NE(r.find("Content-Length: " + std::to_string(body_.size())), std::string::npos);
    EXPECT_EQ(BodyOf(r), body_);
  }
  // Two pipelined requests in one write: two answers, in order.
  ASSERT_TRUE(c.Send("GET /nope HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n"));
  EXPECT_EQ(StatusOf(c.Response()), 404);
  EXPECT_EQ(StatusOf(c.Response()), 200);
  c.ExpectHeadResponse();
  ASSERT_TRUE(c.Send("HEAD /metrics HTTP/1.1\r\n\r\n"));
  const std::string head = c.Response();
  EXPECT_EQ(StatusOf(head), 200);
  EXPECT_EQ(BodyOf(head), "");
  EXPECT_EQ(calls_.load(), 5);
}

TEST_F(MetricsHttpServerTest, AnswersOtherPathsAndMethodsAndBadRequests) {
  StartServer();
  {
    Client c(port());
    EXPECT_EQ(StatusOf(Get(c, "/../../etc/passwd")), 404);
    ASSERT_TRUE(c.Send("DELETE /metrics HTTP/1.1\r\n\r\n"));
    const std::string r = c.Response();
    EXPECT_EQ(StatusOf(r), 405);
    EXPECT_NE(r.find("Allow: GET, HEAD"), std::string::npos);
  }
  for (const auto& [request, status] :
       std::vector<std::pair<std::string, int>>{{"\x16\x03\x01garbage\r\n\r\n", 400},
                                                {"GET /metrics HTTP/2.0\r\n\r\n", 505},
                                                {"GET /metrics HTTP/1.1\r\nA b\r\n\r\n", 400}}) {
    Client c(port());
    ASSERT_TRUE(c.Send(request));
    const std::string r = c.Response();
    EXPECT_EQ(StatusOf(r), status) << request;
    EXPECT_NE(r.find("Connection: close"), std::string::npos);
    EXPECT_TRUE(c.ClosedByServer()) << request;
  }
  EXPECT_EQ(calls_.load(), 0);
}

TEST_F(MetricsHttpServerTest, NeverReadsABodyAndClosesAfterAnswering) {
  StartServer();
  Client c(port());
  // 1 GB announced, 4 MB sent (the server answers after the headers and stops reading).
  ASSERT_TRUE(c.Send("POST /metrics HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n"));
  const std::string r = c.Response();
  EXPECT_EQ(StatusOf(r), 405) << r;
  EXPECT_NE(r.find("Connection: close"), std::string::npos);
  const std::string chunk(1 << 20, 'x');
  for (int i = 0; i < 4 && c.Send(chunk); ++i) {
  }
  EXPECT_TRUE(c.ClosedByServer());
  // A GET with a body is answered, then closed too.
  Client g(port());
  ASSERT_TRUE(g.Send("GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"));
  EXPECT_EQ(StatusOf(g.Response()), 200);
  EXPECT_TRUE(g.ClosedByServer());
}

TEST_F(MetricsHttpServerTest, CapsHeaderBytes) {
  MetricsHttpOptions o;
  o.max_header_bytes = 1024;
  StartServer(o);
  Client c(port());
  std::string request = "GET /metrics HTTP/1.1\r\n";
  while (request.size() < 64 * 1024) request += "X-Filler: 0123456789\r\n";
  c.Send(request);  // may fail part-way: the server answers and closes at 1 KiB
  const std::string r = c.Response();
  EXPECT_EQ(StatusOf(r), 431) << r;
  EXPECT_TRUE(c.ClosedByServer());
  // Just under the cap is served.
  Client ok(port());
  std::string fits = "GET /metrics HTTP/1.1\r\n";
  while (fits.size() < 1000) fits += "X: y\r\n";
  ASSERT_TRUE(ok.Send(fits + "\r\n"));
  EXPECT_EQ(StatusOf(ok.Response()), 200);
}

TEST_F(MetricsHttpServerTest, ATrickleDoesNotExtendTheReadDeadline) {
  MetricsHttpOptions o;
  o.read_timeout = 300ms;
  StartServer(o);
  Client c(port(), 3000ms);
  const auto start = Clock::now();
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const std::string request = "GET /metrics HTTP/1.1\r\nX-Slow: " + std::string(1000, 'a');
    for (char ch : request) {
      if (stop || !c.Send(std::string_view(&ch, 1))) return;
      std::this_thread::sleep_for(20ms);
    }
  });
  EXPECT_TRUE(c.ClosedByServer());
  const auto took = Clock::now() - start;
  stop = true;
  trickle.join();
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 2000ms);
  // An idle kept-alive connection is closed after the same time.
  Client idle(port(), 3000ms);
  EXPECT_EQ(StatusOf(Get(idle)), 200);
  EXPECT_TRUE(idle.ClosedByServer());
}

TEST_F(MetricsHttpServerTest, SlowConnectionsBeyondTheCapDoNotStarveAScrape) {
  MetricsHttpOptions o;
  o.max_connections = 4;
  o.read_timeout = 10s;  // longer than the test: only displacement frees slots
  StartServer(o);
  std::vector<std::unique_ptr<Client>> slow;
  for (int i = 0; i < 20; ++i) {
    slow.push_back(std::make_unique<Client>(port(), 500ms));
    ASSERT_TRUE(slow.back()->connected());
    ASSERT_TRUE(slow.back()->Send("GET /metrics HTTP/1.1\r\n"));
  }
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    Client scrape(port(), 2000ms);
    EXPECT_EQ(StatusOf(Get(scrape)), 200);
    EXPECT_LT(Clock::now() - start, 1s);
  }
  // The first slow connections were displaced (closed); all at once is not required.
  EXPECT_TRUE(slow.front()->ClosedByServer());
}

TEST_F(MetricsHttpServerTest, AClientThatDoesNotReadIsClosedAtTheWriteDeadline) {
  MetricsHttpOptions o;
  o.write_timeout = 300ms;
  first_body_ = std::string(32 << 20, '#');  // far more than the socket buffers hold
  body_ = "small 1\n";
  StartServer(o);
  Client stuck(port(), 5000ms);
  const int small = 4096;
  setsockopt(stuck.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  ASSERT_TRUE(stuck.Send("GET /metrics HTTP/1.1\r\n\r\n"));
  std::this_thread::sleep_for(100ms);
  // Meanwhile others are served.
  Client other(port());
  EXPECT_EQ(BodyOf(Get(other)), "small 1\n");
  std::this_thread::sleep_for(500ms);
  EXPECT_TRUE(stuck.ClosedByServer());
}

TEST_F(MetricsHttpServerTest, StopClosesConnectionsAndIsIdempotent) {
  StartServer();
  Client c(port());
  ASSERT_TRUE(c.Send("GET /metrics HTTP/1.1\r\n"));
  std::this_thread::sleep_for(50ms);
  server_->Stop();
  EXPECT_TRUE(c.ClosedByServer());
  server_->Stop();
  Client after(port(), 500ms);
  EXPECT_FALSE(after.connected());
}

MetricsHttpOptions Loopback(int port) {
  MetricsHttpOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  return o;
}

TEST(BindListenSocket, NamesWhatIsWrong) {
  auto held = MetricsHttpServer::Listen(Loopback(0));
  ASSERT_TRUE(held.ok());
  const int port = (*held)->port();
  auto busy = BindListenSocket("127.0.0.1", port);
  ASSERT_FALSE(busy.ok());
  EXPECT_EQ(busy.status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(busy.status().message(), std::to_string(port) + ": in use on 127.0.0.1");
  auto bad = BindListenSocket("no-such-host.invalid", 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("no-such-host.invalid: not an address"), std::string::npos);
  auto v6 = BindListenSocket("[::1]", 0);  // brackets removed (a host without IPv6 refuses)
  if (v6.ok()) close(*v6);
}

// Regression: a restart failed for about a minute while the previous listener's connections
// sat in TIME_WAIT (the listener lacked SO_REUSEADDR, which those sockets inherit).
TEST(BindListenSocket, RebindsWhileThePreviousConnectionsAreInTimeWait) {
  int port = 0;
  {
    auto first = MetricsHttpServer::Listen(Loopback(0));
    ASSERT_TRUE(first.ok());
    port = (*first)->port();
    (*first)->Start([] { return std::string("x 1\n"); });
    for (int i = 0; i < 3; ++i) {
      // The server closes first (Connection: close), so its side ends in TIME_WAIT.
      Client c(port);
      ASSERT_TRUE(c.Send("GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n"));
      EXPECT_EQ(StatusOf(c.Response()), 200);
      EXPECT_TRUE(c.ClosedByServer());
    }
    Client still_open(port);  // and one still open when the server stops
    ASSERT_TRUE(still_open.Send("GET /metrics HTTP/1.1\r\n\r\n"));
    EXPECT_EQ(StatusOf(still_open.Response()), 200);
    (*first)->Stop();
  }
  auto check = BindListenSocket("127.0.0.1", port);
  ASSERT_TRUE(check.ok()) << check.status().ToString();
  close(*check);
  auto second = MetricsHttpServer::Listen(Loopback(port));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
}

}  // namespace
}  // namespace tpserve
