// tpserve-loadtest: a load generator for the KServe v2 gRPC API
// (inference.GRPCInferenceService/ModelInfer, and ModelStreamInfer for streamed generation).
//
// Closed loop (--concurrency-range): N requests always outstanding. Open loop
// (--request-rate-range): a scheduler thread issues requests at target times
// (constant spacing or exponential gaps) with async calls, so a slow server
// does not slow the arrival process (loadtest_driver.h). --mode logits sends
// one ModelInfer per prompt, answered with the next token's logits (all calls
// async on one CompletionQueue drained by one polling thread); --mode generate
// sends generation requests (loadtest_generate.h).
//
// Each step runs a warmup, then measurement windows until 3 consecutive
// windows' requests/s agree within --stability percent (or --max-trials); the
// step reports the last (up to) 3 windows together.
//
// Results (--json, --csv) are rewritten after every step, each time to
// FILE.tmp and renamed over FILE, so a run stopped part way keeps the steps
// it finished and a run that fails before its first step leaves FILE as it
// was.
//
// Exit: 0 run completed (errors are counted and reported), 1 every measured
// request failed, 2 usage error, unreachable server or unknown model.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "benchmarks/loadtest_driver.h"
#include "benchmarks/loadtest_generate.h"
#include "benchmarks/loadtest_stats.h"
#include "benchmarks/write_replacing.h"
#include "proto/grpc_service.grpc.pb.h"
#include "server/cli_numbers.h"

namespace {

using tpserve::WriteReplacing;
using tpserve::loadtest::AddGenerateFields;
using tpserve::loadtest::Clock;
using tpserve::loadtest::GenerateFields;
using tpserve::loadtest::GenerateMeta;
using tpserve::loadtest::GenerateOptions;
using tpserve::loadtest::GenerateStepLine;
using tpserve::loadtest::kMaxRangeValues;
using tpserve::loadtest::kStableWindows;
using tpserve::loadtest::LoadDriver;
using tpserve::loadtest::NearestRankPercentile;
using tpserve::loadtest::Outcome;
using tpserve::loadtest::ParseDouble;
using tpserve::loadtest::ParseRange;
using tpserve::loadtest::PrintGenerateTable;
using tpserve::loadtest::Split;
using tpserve::loadtest::Stable;
using tpserve::loadtest::StatusName;
using tpserve::loadtest::Window;

using Json = nlohmann::json;

struct Flags {
  std::string url = "127.0.0.1:8001";
  std::string model = "tiny";
  std::string input_name = "input_ids";
  std::string datatype = "INT32";
  int64_t prompt_len = 16;
  std::string prompt_len_range;
  std::string prompt_file;
  int64_t vocab = 1024;
  uint64_t seed = 1;
  std::string concurrency_range;
  std::string request_rate_range;
  std::string distribution = "constant";
  double duration_s = 2;
  int64_t requests = 0;  // 0: not given (windows of --duration)
  bool requests_given = false;
  double warmup_s = 1;
  double stability_pct = 10;
  int max_trials = 5;
  int64_t timeout_ms = 10000;
  std::string csv;
  std::string json;
  // TLS (any of these turns it on): the CA that signed the server's certificate (default:
  // the system's roots), a client certificate and key for mutual TLS, and the name to
  // check the server's certificate against when it differs from --url's host.
  bool tls = false;
  std::string tls_ca, tls_cert, tls_key, tls_server_name;
  GenerateOptions gen;  // --mode and the generation flags
};

// A PEM file's text, or why it cannot be read ("" text and the message in *err): it must
// hold a block whose label ends with `label` ("CERTIFICATE", "PRIVATE KEY").
std::string ReadPemFile(const std::string& path, const char* flag, const std::string& label,
                        std::string* err) {
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  const std::string& t = text.str();
  const size_t begin = t.find("-----BEGIN ");
  const size_t end = begin == std::string::npos ? begin : t.find("-----", begin + 11);
  if (!in || end == std::string::npos || !t.substr(begin + 11, end - begin - 11).ends_with(label)) {
    *err = std::string(flag) + " " + path +
           (in ? ": not a PEM file holding a " + label : std::string(": cannot read the file"));
    return "";
  }
  return t;
}

// Whether any TLS flag is given (each of them turns TLS on).
bool UsesTls(const Flags& f) {
  return f.tls || !f.tls_ca.empty() || !f.tls_cert.empty() || !f.tls_server_name.empty();
}

// The channel's credentials from the TLS flags; null with the reason in *err.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const Flags& f, std::string* err) {
  if (!UsesTls(f)) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  for (auto [path, flag, label, out] :
       {std::tuple{&f.tls_ca, "--tls-ca", "CERTIFICATE", &ssl.pem_root_certs},
        std::tuple{&f.tls_cert, "--tls-cert", "CERTIFICATE", &ssl.pem_cert_chain},
        std::tuple{&f.tls_key, "--tls-key", "PRIVATE KEY", &ssl.pem_private_key}}) {
    if (path->empty()) continue;
    *out = ReadPemFile(*path, flag, label, err);
    if (!err->empty()) return nullptr;
  }
  return grpc::SslCredentials(ssl);
}

// A request ready to send and the number of prompt tokens in it.
struct Prompt {
  inference::ModelInferRequest request;
  int64_t tokens = 0;
};

Prompt MakePrompt(const Flags& f, const std::vector<int64_t>& ids) {
  Prompt p;
  p.tokens = static_cast<int64_t>(ids.size());
  p.request.set_model_name(f.model);
  auto* in = p.request.add_inputs();
  in->set_name(f.input_name);
  in->set_datatype(f.datatype);
  in->add_shape(p.tokens);
  std::string raw;
  if (f.datatype == "INT64") {
    raw.resize(ids.size() * sizeof(int64_t));
    std::memcpy(raw.data(), ids.data(), raw.size());
  } else {
    std::vector<int32_t> ids32(ids.begin(), ids.end());
    raw.resize(ids32.size() * sizeof(int32_t));
    std::memcpy(raw.data(), ids32.data(), raw.size());
  }
  p.request.add_raw_input_contents(std::move(raw));
  return p;
}

// The prompts: from --prompt-file, else random ids of a fixed or uniformly
// drawn length. Returns an error message on failure.
std::string BuildPrompts(const Flags& f, std::vector<Prompt>* prompts) {
  constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
  if (!f.prompt_file.empty()) {
    std::ifstream in(f.prompt_file);
    if (!in) return "cannot read --prompt-file " + f.prompt_file;
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      std::replace(line.begin(), line.end(), ',', ' ');
      std::istringstream ss(line);
      std::vector<int64_t> ids;
      std::string tok;
      while (ss >> tok) {
        try {
          size_t pos = 0;
          const long long v = std::stoll(tok, &pos);
          if (pos != tok.size()) throw std::invalid_argument(tok);
          ids.push_back(v);
        } catch (const std::exception&) {
          return f.prompt_file + ":" + std::to_string(lineno) + ": bad token id '" + tok + "'";
        }
        const int64_t most =
            f.datatype == "INT32" ? std::numeric_limits<int32_t>::max() : kMaxInt64;
        if (ids.back() < 0 || ids.back() > most) {
          return f.prompt_file + ":" + std::to_string(lineno) + ": token id " + tok +
                 " out of range for --datatype " + f.datatype + " (0.." + std::to_string(most) +
                 ")";
        }
      }
      if (!ids.empty()) prompts->push_back(MakePrompt(f, ids));
    }
    if (prompts->empty()) return "--prompt-file " + f.prompt_file + " has no prompts";
    return "";
  }
  int64_t lo = f.prompt_len, hi = f.prompt_len;
  if (!f.prompt_len_range.empty()) {
    auto parts = Split(f.prompt_len_range, ':');
    double a = 0, b = 0;
    if (parts.size() != 2 || !ParseDouble(parts[0], &a) || !ParseDouble(parts[1], &b) || a < 1 ||
        b < a || a != std::floor(a) || b != std::floor(b)) {
      return "--prompt-len-range must be MIN:MAX, whole numbers with 1 <= MIN <= MAX, got '" +
             f.prompt_len_range + "'";
    }
    lo = static_cast<int64_t>(a);
    hi = static_cast<int64_t>(b);
  }
  if (lo < 1) return "--prompt-len must be >= 1";
  constexpr int64_t kMaxPromptLen = int64_t{1} << 20;
  if (hi > kMaxPromptLen) {
    return std::string(f.prompt_len_range.empty() ? "--prompt-len" : "--prompt-len-range") +
           ": prompts of at most " + std::to_string(kMaxPromptLen) + " tokens, got " +
           std::to_string(hi);
  }
  if (f.vocab < 1) return "--vocab must be >= 1";
  std::mt19937_64 rng(f.seed);
  std::uniform_int_distribution<int64_t> len(lo, hi), id(0, f.vocab - 1);
  for (int i = 0; i < 512; ++i) {
    std::vector<int64_t> ids(static_cast<size_t>(len(rng)));
    for (auto& v : ids) v = id(rng);
    prompts->push_back(MakePrompt(f, ids));
  }
  return "";
}

// Logits requests: async ModelInfer calls on one CompletionQueue, drained by one polling
// thread.
class LogitsDriver : public LoadDriver {
 public:
  LogitsDriver(std::shared_ptr<grpc::Channel> channel, const std::vector<Prompt>* prompts,
               int64_t timeout_ms)
      : stub_(inference::GRPCInferenceService::NewStub(channel)),
        prompts_(prompts),
        timeout_ms_(timeout_ms) {
    poller_ = std::thread([this] { Poll(); });
  }
  ~LogitsDriver() override {
    StopLoad();
    cq_.Shutdown();
    poller_.join();
  }

 private:
  struct Call {
    grpc::ClientContext ctx;
    inference::ModelInferResponse response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<inference::ModelInferResponse>> reader;
    Clock::time_point start;
    int64_t tokens = 0;
  };

  void Send() override {
    const Prompt& p = (*prompts_)[next_prompt_.fetch_add(1) % prompts_->size()];
    auto* call = new Call;
    call->tokens = p.tokens;
    call->ctx.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::milliseconds(timeout_ms_));
    call->start = Clock::now();
    call->reader = stub_->PrepareAsyncModelInfer(&call->ctx, p.request, &cq_);
    call->reader->StartCall();
    call->reader->Finish(&call->response, &call->status, call);
  }

  void Poll() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
      std::unique_ptr<Call> call(static_cast<Call*>(tag));
      Outcome o;
      o.latency_ms = std::chrono::duration<double, std::milli>(Clock::now() - call->start).count();
      o.prompt_tokens = call->tokens;
      if (!ok || !call->status.ok()) {
        o.error = ok ? StatusName(call->status.error_code()) : "CANCELLED";
      }
      Finish(std::move(o));
    }
  }

  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
  const std::vector<Prompt>* prompts_;
  const int64_t timeout_ms_;
  grpc::CompletionQueue cq_;
  std::thread poller_;
  std::atomic<uint64_t> next_prompt_{0};
};

struct ServerStats {
  uint64_t count = 0, queue_ns = 0, compute_ns = 0;
};

std::optional<ServerStats> GetServerStats(inference::GRPCInferenceService::Stub* stub,
                                          const std::string& model) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  inference::ModelStatisticsRequest req;
  req.set_name(model);
  inference::ModelStatisticsResponse resp;
  if (!stub->ModelStatistics(&ctx, req, &resp).ok()) return std::nullopt;
  for (const auto& m : resp.model_stats()) {
    if (m.name() != model && resp.model_stats_size() > 1) continue;
    const auto& s = m.inference_stats();
    return ServerStats{s.success().count(), s.queue().ns(), s.compute_infer().ns()};
  }
  return std::nullopt;
}

double RequestsPerSec(const Window& w) { return w.seconds > 0 ? w.ok / w.seconds : 0; }

Json NumberOrNull(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

// One step's result from its reported windows.
Json StepResult(const std::string& key, double value, const std::vector<Window>& windows,
                size_t trials, const Json& stable) {
  Window all;
  bool have_server = true;
  for (const auto& w : windows) {
    all.seconds += w.seconds;
    all.ok += w.ok;
    all.failed += w.failed;
    all.tokens += w.tokens;
    all.issued += w.issued;
    all.latencies_ms.insert(all.latencies_ms.end(), w.latencies_ms.begin(), w.latencies_ms.end());
    for (const auto& [name, n] : w.errors) all.errors[name] += n;
    have_server = have_server && w.have_server;
    all.server_count += w.server_count;
    all.server_queue_ns += w.server_queue_ns;
    all.server_compute_ns += w.server_compute_ns;
  }
  auto& lat = all.latencies_ms;
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) { return NearestRankPercentile(lat, p); };
  const double secs = all.seconds > 0 ? all.seconds : std::nan("");
  Json r;
  r[key] = (key == "concurrency") ? Json(static_cast<int64_t>(std::llround(value))) : Json(value);
  r["requests_per_sec"] = NumberOrNull(all.ok / secs);
  r["tokens_per_sec"] = NumberOrNull(all.tokens / secs);  // prompt tokens
  r["p50_ms"] = NumberOrNull(pct(50));
  r["p90_ms"] = NumberOrNull(pct(90));
  r["p95_ms"] = NumberOrNull(pct(95));
  r["p99_ms"] = NumberOrNull(pct(99));
  r["max_ms"] = NumberOrNull(lat.empty() ? std::nan("") : lat.back());
  r["requests"] = all.ok;
  r["error_count"] = all.failed;
  // The percentiles above are over successful requests only: read them with
  // the share of requests that failed (timeouts included).
  r["error_share"] =
      NumberOrNull(static_cast<double>(all.failed) / static_cast<double>(all.ok + all.failed));
  r["errors"] = Json::object();
  for (const auto& [name, n] : all.errors) r["errors"][name] = n;
  const double n = (have_server && all.server_count > 0) ? all.server_count : std::nan("");
  r["server_queue_ms"] = NumberOrNull(all.server_queue_ns / n / 1e6);
  r["server_compute_ms"] = NumberOrNull(all.server_compute_ns / n / 1e6);
  r["window_s"] = all.seconds;  // the reported windows together
  // Open loop: the rate the client really issued at; below the step's rate when the client
  // could not keep up (the step's figures are then for this rate). Closed loop: null.
  r["offered_per_sec"] = key == "request_rate" ? NumberOrNull(all.issued / secs) : Json(nullptr);
  // Requests the last window left outstanding: their outcome falls in no
  // window. With --request-rate-range a server that stops answering shows
  // here, not as errors; in closed loop it always equals the concurrency.
  r["in_flight_at_end"] = windows.empty() ? 0 : windows.back().in_flight_at_end;
  r["trials"] = trials;
  r["stable"] = stable;
  return r;
}

std::string Fmt(const Json& v, int prec = 2) {
  if (v.is_null()) return "-";
  if (v.is_boolean()) return v.get<bool>() ? "yes" : "no";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number()) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", prec, v.get<double>());
    return buf;
  }
  return v.dump();
}

std::string ErrorsString(const Json& errors) {
  std::string s;
  for (const auto& [name, n] : errors.items()) {
    s += (s.empty() ? "" : ";") + name + ":" + std::to_string(n.get<int64_t>());
  }
  return s;
}

const std::vector<std::string> kScalarFields = {
    "requests_per_sec", "tokens_per_sec",   "p50_ms",          "p90_ms",
    "p95_ms",           "p99_ms",           "max_ms",          "requests",
    "error_count",      "error_share",      "server_queue_ms", "server_compute_ms",
    "window_s",         "in_flight_at_end", "trials",          "stable",
    "offered_per_sec"};

std::string UtcNow() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Whether results can be written next to `path` (creates and removes
// `path`.tmp; `path` itself is not touched). Returns an error message or "".
std::string CheckWritable(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return "cannot write " + path + ": a directory";
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  if (!out) return "cannot write " + path + " (tried " + tmp + ")";
  out.close();
  std::remove(tmp.c_str());
  return "";
}

// The --json and --csv files of the steps so far; `complete` is false while
// the sweep still runs (meta.complete in the JSON).
std::string WriteResults(const Flags& f, const std::string& key, const Json& steps,
                         const std::string& command, bool complete) {
  if (!f.json.empty()) {
    Json doc;
    doc["meta"] = {{"url", f.url},
                   {"model", f.model},
                   {"command", command},
                   {"date", UtcNow()},
                   {"complete", complete}};
    doc["meta"].update(GenerateMeta(f.gen));
    doc["steps"] = steps;
    // Invalid UTF-8 (a path, model name or argument in another encoding)
    // becomes U+FFFD rather than an exception that would lose the results.
    const std::string text = doc.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
    if (std::string err = WriteReplacing(f.json, text); !err.empty()) return err;
  }
  if (!f.csv.empty()) {
    std::vector<std::string> fields = kScalarFields;
    if (f.gen.mode == "generate") {
      fields.insert(fields.end(), GenerateFields().begin(), GenerateFields().end());
    }
    std::ostringstream out;
    out << key;
    for (const auto& name : fields) out << "," << name;
    out << ",errors\n";
    for (const auto& r : steps) {
      out << Fmt(r[key], 6);
      for (const auto& name : fields) {
        const Json& v = r[name];
        out << "," << (v.is_null() ? std::string() : v.is_boolean() ? v.dump() : Fmt(v, 6));
      }
      out << "," << ErrorsString(r["errors"]) << "\n";
    }
    if (std::string err = WriteReplacing(f.csv, out.str()); !err.empty()) return err;
  }
  return "";
}

// Bounds of the sweep: outstanding requests, requests per second, and the
// shortest measurement window. The upper bounds on times (and the lower one
// on the rate, whose inverse is the gap between requests) keep them within
// the nanosecond clocks: beyond, they would wrap (a window that ends at once,
// no warmup, every request past its deadline, requests sent flat out).
constexpr double kMaxConcurrency = 65536;
constexpr double kMinRate = 1e-3;
constexpr double kMaxRate = 1e6;
constexpr double kMinDurationS = 0.1;
constexpr double kMaxSeconds = 1e6;
constexpr int64_t kMaxTimeoutMs = 1'000'000'000;

int Run(const Flags& f, const std::string& command) {
  std::vector<double> levels;
  const bool rate_mode = !f.request_rate_range.empty();
  {
    const std::string& spec =
        rate_mode ? f.request_rate_range
                  : (f.concurrency_range.empty() ? std::string("1") : f.concurrency_range);
    auto r = ParseRange(spec);
    if (!r || r->empty()) {
      std::cerr << "error: " << (rate_mode ? "--request-rate-range" : "--concurrency-range")
                << " must be start[:end[:step]] with 0 < start <= end, step > 0 and at most "
                << kMaxRangeValues << " values, got '" << spec << "'\n";
      return 2;
    }
    levels = *r;
  }
  if (!rate_mode) {
    for (double v : levels) {
      if (v < 1 || std::abs(v - std::round(v)) > 1e-9 || v > kMaxConcurrency) {
        std::cerr << "error: --concurrency-range values are outstanding requests: whole numbers "
                     "from 1 to "
                  << kMaxConcurrency << ", got " << v << "\n";
        return 2;
      }
    }
  } else if (levels.back() > kMaxRate) {
    std::cerr << "error: --request-rate-range values are requests per second, at most " << kMaxRate
              << ", got " << levels.back() << "\n";
    return 2;
  } else if (levels.front() < kMinRate) {
    std::cerr << "error: --request-rate-range values are requests per second, at least " << kMinRate
              << ", got " << levels.front() << "\n";
    return 2;
  }
  if (f.requests_given && f.requests < 1) {
    std::cerr << "error: --requests must be >= 1, got " << f.requests << "\n";
    return 2;
  }
  if (f.datatype == "INT32" && f.vocab > std::numeric_limits<int32_t>::max()) {
    std::cerr << "error: --vocab " << f.vocab << " does not fit --datatype INT32\n";
    return 2;
  }
  // Where results go is tried before any load runs (FILE.tmp, created and
  // removed; FILE itself is left alone until the first step's results).
  if (!f.json.empty() && !f.csv.empty()) {
    // Absolute first: weakly_canonical leaves a relative path to a file that does not exist
    // yet relative, so "a.json" and "./a.json" would compare different.
    std::error_code ec1, ec2;
    if (std::filesystem::weakly_canonical(std::filesystem::absolute(f.json, ec1), ec1) ==
        std::filesystem::weakly_canonical(std::filesystem::absolute(f.csv, ec2), ec2)) {
      std::cerr << "error: --json and --csv name the same file " << f.json
                << " (each step's CSV would replace the JSON)\n";
      return 2;
    }
  }
  for (const std::string* path : {&f.json, &f.csv}) {
    if (path->empty()) continue;
    if (std::string err = CheckWritable(*path); !err.empty()) {
      std::cerr << "error: " << err << "\n";
      return 2;
    }
  }
  if (f.requests <= 0 && !(std::isfinite(f.duration_s) && f.duration_s >= kMinDurationS &&
                           f.duration_s <= kMaxSeconds)) {
    std::cerr << "error: --duration must be at least " << kMinDurationS << " s and at most "
              << kMaxSeconds << " s, got " << f.duration_s << "\n";
    return 2;
  }
  if (f.max_trials < 1 || f.timeout_ms < 1 || !std::isfinite(f.stability_pct) ||
      f.stability_pct < 0 || !std::isfinite(f.warmup_s) || f.warmup_s < 0) {
    std::cerr << "error: --max-trials and --timeout-ms must be >= 1, --stability and --warmup "
                 "finite and >= 0\n";
    return 2;
  }
  if (f.warmup_s > kMaxSeconds) {
    std::cerr << "error: --warmup must be at most " << kMaxSeconds << " s, got " << f.warmup_s
              << "\n";
    return 2;
  }
  if (f.timeout_ms > kMaxTimeoutMs) {
    std::cerr << "error: --timeout-ms must be at most " << kMaxTimeoutMs
              << " (about 11.6 days), got " << f.timeout_ms << "\n";
    return 2;
  }
  if (f.requests > 0 && !rate_mode && f.requests < 4 * static_cast<int64_t>(levels.back())) {
    std::cerr << "warning: --requests " << f.requests << " is less than 4 x concurrency "
              << levels.back()
              << ": a window closes at its last completion, so when requests finish in batches "
                 "its requests/s can read high; use --duration for throughput\n";
  }
  const bool generate = f.gen.mode == "generate";
  if (generate && f.datatype != "INT32") {
    std::cerr << "error: --mode generate sends input_ids as INT32 (--datatype " << f.datatype
              << " is for --mode logits)\n";
    return 2;
  }
  std::vector<Prompt> prompts;
  if (auto err = BuildPrompts(f, &prompts); !err.empty()) {
    std::cerr << "error: " << err << "\n";
    return 2;
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (!f.tls_server_name.empty()) args.SetSslTargetNameOverride(f.tls_server_name);
  std::string tls_error;
  auto credentials = ChannelCredentials(f, &tls_error);
  if (!credentials) {
    std::cerr << "error: " << tls_error << "\n";
    return 2;
  }
  auto channel = grpc::CreateCustomChannel(f.url, credentials, args);
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    inference::ServerLiveResponse live;
    grpc::Status s = stub->ServerLive(&ctx, inference::ServerLiveRequest(), &live);
    if (!s.ok() || !live.live()) {
      const bool tls = UsesTls(f);
      std::cerr << "cannot reach the server at " << f.url << ": "
                << (s.ok() ? std::string("server is not live")
                           : std::string(StatusName(s.error_code())) + ": " + s.error_message())
                << (s.ok() ? ""
                    : tls  ? " (connecting over TLS: is the server's certificate signed by "
                             "--tls-ca, and for --tls-server-name or --url's host?)"
                           : " (a server that serves TLS needs --tls or --tls-ca)")
                << "\n";
      return 2;
    }
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    inference::ModelReadyRequest req;
    req.set_name(f.model);
    inference::ModelReadyResponse ready;
    grpc::Status s = stub->ModelReady(&ctx, req, &ready);
    if (!s.ok() || !ready.ready()) {
      std::cerr << "model '" << f.model << "' is not ready at " << f.url << ": "
                << (s.ok() ? std::string("the server says not ready")
                           : std::string(StatusName(s.error_code())) + ": " + s.error_message())
                << "\n";
      return 2;
    }
  }

  if (generate) {
    if (std::string err =
            tpserve::loadtest::CheckGenerationModel(stub.get(), f.model, f.input_name);
        !err.empty()) {
      std::cerr << err << "\n";
      return 2;
    }
  }

  const bool tty = isatty(STDOUT_FILENO) != 0;
  const std::string key = rate_mode ? "request_rate" : "concurrency";
  Json steps = Json::array();
  std::unique_ptr<LoadDriver> driver_owner;
  if (generate) {
    std::vector<tpserve::loadtest::PromptIds> ids;
    for (const Prompt& p : prompts) ids.push_back({&p.request.raw_input_contents(0), p.tokens});
    driver_owner = tpserve::loadtest::MakeGenerateDriver(channel, f.model, f.input_name, ids, f.gen,
                                                         f.timeout_ms, f.seed);
  } else {
    driver_owner = std::make_unique<LogitsDriver>(channel, &prompts, f.timeout_ms);
  }
  LoadDriver& driver = *driver_owner;
  uint64_t step_seed = f.seed;
  for (double level : levels) {
    if (rate_mode) {
      driver.StartRate(level, f.distribution == "poisson", ++step_seed);
    } else {
      driver.StartConcurrency(static_cast<int>(std::llround(level)));
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(f.warmup_s));
    std::vector<Window> windows;
    std::vector<double> rps;
    Json stable = nullptr;
    // Windows back to back: each begins when the one before ends (RollWindow), and the
    // server's statistics are fetched after that, so a slow fetch delays no window's end
    // and loses no completion. Each window's server figures are the difference between the
    // fetches that follow its start and its end.
    auto before = GetServerStats(stub.get(), f.model);
    driver.BeginWindow();
    auto start = Clock::now();
    for (int trial = 1; trial <= f.max_trials; ++trial) {
      const auto end = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(f.duration_s));
      for (;;) {
        const auto now = Clock::now();
        if (f.requests > 0) {
          auto [ok, failed] = driver.WindowCounts();
          if (ok + failed >= f.requests) break;
          driver.WaitForCompletions(f.requests, std::chrono::milliseconds(250));
        } else {
          if (now >= end) break;
          std::this_thread::sleep_for(
              std::min<Clock::duration>(end - now, std::chrono::milliseconds(250)));
        }
        if (tty) {
          auto [ok, failed] = driver.WindowCounts();
          const double el = std::chrono::duration<double>(Clock::now() - start).count();
          std::printf("\r\033[K%s %g  trial %d/%d  %.1fs  %lld ok  %lld errors  %.1f req/s",
                      key.c_str(), level, trial, f.max_trials, el, static_cast<long long>(ok),
                      static_cast<long long>(failed), el > 0 ? ok / el : 0.0);
          std::fflush(stdout);
        }
      }
      Window w = driver.RollWindow();
      start = Clock::now();
      auto after = GetServerStats(stub.get(), f.model);
      if (before && after && after->count >= before->count) {
        w.have_server = true;
        w.server_count = after->count - before->count;
        w.server_queue_ns = after->queue_ns - before->queue_ns;
        w.server_compute_ns = after->compute_ns - before->compute_ns;
      }
      before = after;
      rps.push_back(RequestsPerSec(w));
      windows.push_back(std::move(w));
      const std::optional<bool> verdict = Stable(rps, f.stability_pct);
      stable = verdict ? Json(*verdict) : Json(nullptr);
      if (verdict == true) break;
    }
    driver.EndWindow();  // the window begun after the last one measured: not reported
    driver.StopLoad();
    if (tty) std::printf("\r\033[K");
    const size_t keep = std::min(kStableWindows, windows.size());
    std::vector<Window> last(windows.end() - static_cast<std::ptrdiff_t>(keep), windows.end());
    Json r = StepResult(key, level, last, windows.size(), stable);
    if (generate) AddGenerateFields(last, f.gen, &r);
    std::printf(
        "%s %s: %s req/s, %s tok/s, p50 %s ms, p90 %s ms, p95 %s ms, p99 %s ms, max %s ms, "
        "server queue %s ms, compute %s ms, errors %s (%s of requests), %s after %zu trials\n",
        key.c_str(), Fmt(r[key]).c_str(), Fmt(r["requests_per_sec"], 1).c_str(),
        Fmt(r["tokens_per_sec"], 1).c_str(), Fmt(r["p50_ms"], 3).c_str(),
        Fmt(r["p90_ms"], 3).c_str(), Fmt(r["p95_ms"], 3).c_str(), Fmt(r["p99_ms"], 3).c_str(),
        Fmt(r["max_ms"], 3).c_str(), Fmt(r["server_queue_ms"], 3).c_str(),
        Fmt(r["server_compute_ms"], 3).c_str(), r["errors"].dump().c_str(),
        Fmt(r["error_share"], 3).c_str(),
        stable.is_null()     ? "stability unchecked (fewer than 3 windows, or none succeeded)"
        : stable.get<bool>() ? "stable"
                             : "NOT stable",
        windows.size());
    if (generate) std::printf("%s\n", GenerateStepLine(r).c_str());
    if (rate_mode && r["offered_per_sec"].is_number() &&
        r["offered_per_sec"].get<double>() < 0.95 * level) {
      std::printf(
          "warning: the client issued %.1f requests/s of the %g asked for (it fell "
          "behind); this step's figures are for that rate\n",
          r["offered_per_sec"].get<double>(), level);
    }
    std::fflush(stdout);
    steps.push_back(std::move(r));
    if (std::string err = WriteResults(f, key, steps, command, /*complete=*/false); !err.empty()) {
      std::cerr << "error: " << err << "\n";
      return 2;
    }
  }
  driver.StopLoad();

  // Summary table.
  std::printf("\n%12s %10s %11s %9s %9s %9s %9s %9s %9s %9s %7s %6s\n", key.c_str(), "req/s",
              "tok/s", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "max_ms", "queue_ms", "comp_ms",
              "errors", "stable");
  for (const auto& r : steps) {
    std::printf("%12s %10s %11s %9s %9s %9s %9s %9s %9s %9s %7s %6s\n", Fmt(r[key]).c_str(),
                Fmt(r["requests_per_sec"], 1).c_str(), Fmt(r["tokens_per_sec"], 1).c_str(),
                Fmt(r["p50_ms"], 3).c_str(), Fmt(r["p90_ms"], 3).c_str(),
                Fmt(r["p95_ms"], 3).c_str(), Fmt(r["p99_ms"], 3).c_str(),
                Fmt(r["max_ms"], 3).c_str(), Fmt(r["server_queue_ms"], 3).c_str(),
                Fmt(r["server_compute_ms"], 3).c_str(), Fmt(r["error_count"]).c_str(),
                Fmt(r["stable"]).c_str());
  }
  if (generate) PrintGenerateTable(key, steps);
  std::fflush(stdout);

  if (std::string err = WriteResults(f, key, steps, command, /*complete=*/true); !err.empty()) {
    std::cerr << "error: " << err << "\n";
    return 2;
  }
  int64_t measured_ok = 0, measured_failed = 0;
  for (const auto& r : steps) {
    measured_ok += r["requests"].get<int64_t>();
    measured_failed += r["error_count"].get<int64_t>();
  }
  if (measured_ok == 0) {
    std::cerr << "error: every measured request failed (" << measured_failed << " requests)\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "tpserve-loadtest: load generator for the KServe v2 gRPC API (ModelInfer; "
      "ModelStreamInfer with --mode generate)"};
  app.add_option("-u,--url", f.url, "server address HOST:PORT")->capture_default_str();
  app.add_option("-m,--model-name", f.model, "model to call")->capture_default_str();
  app.add_option("--input-name", f.input_name, "name of the token-id input tensor")
      ->capture_default_str();
  app.add_option("--datatype", f.datatype, "datatype of the input tensor")
      ->check(CLI::IsMember({"INT32", "INT64"}))
      ->capture_default_str();
  auto* len = app.add_option("--prompt-len", f.prompt_len, "tokens per prompt (random ids)")
                  ->capture_default_str();
  auto* range = app.add_option("--prompt-len-range", f.prompt_len_range,
                               "MIN:MAX tokens per prompt, uniformly drawn (random ids)");
  auto* file = app.add_option("--prompt-file", f.prompt_file,
                              "file with one prompt per line: comma- or space-separated token ids");
  len->excludes(range)->excludes(file);
  range->excludes(file);
  app.add_option("--vocab", f.vocab, "random ids are drawn from [0, vocab)")->capture_default_str();
  app.add_flag("--tls", f.tls,
               "connect over TLS, checking the server's certificate against the system's "
               "root CAs (implied by the other --tls-* flags)");
  app.add_option("--tls-ca", f.tls_ca,
                 "PEM file of the CA (or self-signed certificate) to check the server's "
                 "certificate against, instead of the system's roots")
      ->check(CLI::ExistingFile);
  auto* tls_cert =
      app.add_option("--tls-cert", f.tls_cert,
                     "PEM client certificate chain, for a server that requires one (mutual "
                     "TLS, `tpserve serve --tls-client-ca`); needs --tls-key")
          ->check(CLI::ExistingFile);
  auto* tls_key = app.add_option("--tls-key", f.tls_key, "PEM private key of --tls-cert")
                      ->check(CLI::ExistingFile);
  tls_cert->needs(tls_key);
  tls_key->needs(tls_cert);
  app.add_option("--tls-server-name", f.tls_server_name,
                 "name the server's certificate must carry, when it is not --url's host (e.g. "
                 "--url 127.0.0.1:8001 against a certificate for localhost)");
  app.add_option("--seed", f.seed, "random seed (prompts, poisson arrivals, --output-len ranges)")
      ->capture_default_str();
  auto* conc = app.add_option("--concurrency-range", f.concurrency_range,
                              "closed loop: start:end:step outstanding requests, whole numbers "
                              "from 1 to 65536 (default 1)");
  auto* rate = app.add_option("--request-rate-range", f.request_rate_range,
                              "open loop: start:end:step requests per second (from 1e-3 to 1e6)");
  conc->excludes(rate);
  app.add_option("--distribution", f.distribution,
                 "arrival process of --request-rate-range: constant or poisson")
      ->check(CLI::IsMember({"constant", "poisson"}))
      ->needs(rate)
      ->capture_default_str();
  auto* dur =
      app.add_option("--duration", f.duration_s,
                     "seconds per measurement window (0.1 to 1e6); a step's windows run back "
                     "to back, and one runs longer while the server's statistics, fetched "
                     "at its start, take longer than this")
          ->capture_default_str();
  auto* reqs =
      app.add_option("--requests", f.requests,
                     "completed requests (successes and failures) per measurement window, "
                     "instead of --duration; the window closes at the last one, so with fewer "
                     "requests than complete together in a server batch its requests/s reads "
                     "high");
  dur->excludes(reqs);
  app.add_option("--warmup", f.warmup_s, "seconds of load before measuring, per step (at most 1e6)")
      ->capture_default_str();
  app.add_option("--stability", f.stability_pct,
                 "a step is stable when its last 3 windows' requests/s agree within this percent "
                 "(with --max-trials < 3 stability is not checked and reported as '-')")
      ->capture_default_str();
  app.add_option("--max-trials", f.max_trials,
                 "most measurement windows per step (a step ends early once stable)")
      ->capture_default_str();
  app.add_option("--timeout-ms", f.timeout_ms,
                 "deadline of each request in milliseconds (1 to 1e9)")
      ->capture_default_str();
  app.add_option("--csv", f.csv, "write one CSV row per step to FILE");
  app.footer(
      "Per step (the last 3 windows together): latency percentiles, requests/s and 'requests' "
      "count successful requests; error_count and error_share (timeouts included) say how many "
      "failed; window_s is the measured seconds of those windows; in_flight_at_end the requests "
      "still outstanding when the last window closed (open loop: a server that stops answering "
      "shows there; closed loop: always the concurrency). --json/--csv are rewritten after every "
      "step (meta.complete false until the sweep ends). Exit status: 0; 1 when every measured "
      "request failed; 2 on bad arguments, an output file that cannot be written, an "
      "unreachable server or a model that is not ready (with --mode generate: or that takes no "
      "request_output_len input).\n\n"
      "--mode generate adds per step: ttft (time to the first response carrying a token), tpot "
      "((end to end - TTFT) / (tokens - 1), per request), itl (gaps between streamed responses "
      "carrying tokens), each as _mean_ms, _p50_ms, _p90_ms, _p99_ms (null without streaming, "
      "which does not show when the first token came); p50_ms..max_ms are end to end; "
      "output_tokens_per_sec, total_tokens_per_sec (prompt and output tokens; tokens_per_sec "
      "counts prompt tokens alone), goodput_per_sec (requests/s meeting --slo-ttft-ms and "
      "--slo-tpot-ms; null without them). A response with more tokens than --output-len asked "
      "for (LONG_OUTPUT), or fewer with --ignore-eos (SHORT_OUTPUT), or without a well-formed "
      "output_ids (BAD_RESPONSE) counts as an error; a streamed request's error carries the "
      "status code's name that its error_message starts with.");
  app.add_option("--json", f.json, "write the results as JSON to FILE");
  const auto check_generate = tpserve::loadtest::AddGenerateFlags(app, &f.gen);
  // Integers decimal and in range (a negative --seed wrapped); Run checks the floats itself.
  tpserve::StrictNumbers(app, /*finite_floats=*/false);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  f.requests_given = reqs->count() > 0;
  if (std::string err = check_generate(); !err.empty()) {
    std::cerr << "error: " << err << "\n";
    return 2;
  }
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  return Run(f, command);
}
