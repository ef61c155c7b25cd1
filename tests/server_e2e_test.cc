// End to end: a real gRPC server (CPU backend, tiny model, TP=2) and a gRPC
// client over loopback. Every RPC, the model interface, each bad input's
// status, batch invariance under 64 concurrent requests, deadlines, and a
// graceful shutdown that loses no accepted request.
//
// The same suite runs against the CUDA engine (one process per GPU) on a
// host with 2 GPUs: TPSERVE_E2E_BACKEND=cuda and TPSERVE_BIN=<tpserve>
// (which the engine starts as `tpserve worker`). Logits are then compared
// within kCudaLogitsRelTol (relative Frobenius) with the same argmax, since
// the GPU's GEMM algorithm depends on the batch's token bucket; on the CPU
// backend they must be bit-identical.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "engine/cpu_engine.h"
#if TPSERVE_WITH_CUDA
#include "engine/cuda_engine.h"
#endif
#include "proto/grpc_service.grpc.pb.h"
#include "server/cli.h"
#include "server/inference_server.h"

namespace tpserve {
namespace {

using ::testing::HasSubstr;
using Stub = inference::GRPCInferenceService::Stub;

constexpr double kCudaLogitsRelTol = 2e-2;

bool CudaBackend() {
  const char* b = std::getenv("TPSERVE_E2E_BACKEND");
  return b != nullptr && std::string(b) == "cuda";
}

// Served logits against the engine's own answer (see the file comment).
void ExpectSameLogits(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  if (!CudaBackend()) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_FALSE(want.empty()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * static_cast<double>(got[i] - want[i]);
    den += want[i] * static_cast<double>(want[i]);
  }
  EXPECT_LE(std::sqrt(num / den), kCudaLogitsRelTol) << what;
  EXPECT_EQ(std::max_element(got.begin(), got.end()) - got.begin(),
            std::max_element(want.begin(), want.end()) - want.begin())
      << what;
}

// The value of `name{model="tiny",version="1"}` in a metrics text, or -1.
long long MetricValue(const std::string& metrics, const std::string& name) {
  const std::string key = name + "{model=\"tiny\",version=\"1\"} ";
  const size_t at = metrics.find(key);
  return at == std::string::npos ? -1 : std::stoll(metrics.substr(at + key.size()));
}

class ServerE2eTest : public ::testing::Test {
 protected:
  void Start(BatcherOptions batcher = {}, size_t max_streams = ServerOptions{}.max_streams) {
    if (CudaBackend()) {
      StartCuda(batcher);
      if (engine_ == nullptr) return;  // failed or skipped
    } else {
      CpuEngineOptions o;
      o.config = *ModelPreset("tiny");
      o.tp = 2;
      auto engine = CpuEngine::Start(o);
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      engine_ = std::shared_ptr<CpuEngine>(std::move(engine).value());
    }
    ServerOptions so;
    so.model_name = "tiny";
    so.grpc_address = "127.0.0.1:0";
    so.max_tokens_per_request = 64;
    so.batcher = batcher;
    so.max_streams = max_streams;
    auto server = InferenceServer::Start(so, engine_);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = inference::GRPCInferenceService::NewStub(channel_);
  }
  void TearDown() override {
    server_.reset();
    engine_.reset();
  }

  // The CUDA engine as `tpserve serve --backend cuda --model tiny --tp 2`
  // starts it (same random weights: seed 7, FP8).
  void StartCuda(const BatcherOptions& batcher) {
#if TPSERVE_WITH_CUDA
    const char* bin = std::getenv("TPSERVE_BIN");
    ASSERT_NE(bin, nullptr) << "TPSERVE_E2E_BACKEND=cuda needs TPSERVE_BIN (the tpserve binary)";
    CudaEngineOptions o;
    o.config = *ModelPreset("tiny");
    o.tp = 2;
    o.model.max_tokens = batcher.max_batch_tokens;
    o.model.max_seqs = batcher.max_batch_sequences;
    o.timeout = std::chrono::seconds(60);
    o.worker_argv = {bin,
                     "worker",
                     "--model",
                     "tiny",
                     "--tp",
                     "2",
                     "--dtype",
                     "fp8",
                     "--seed",
                     std::to_string(o.seed),
                     "--max-batch-tokens",
                     std::to_string(batcher.max_batch_tokens),
                     "--max-batch-sequences",
                     std::to_string(batcher.max_batch_sequences),
                     "--rank-timeout-s",
                     "60"};
    auto engine = CudaEngine::Start(o);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::shared_ptr<CudaEngine>(std::move(engine).value());
#else
    (void)batcher;
    GTEST_SKIP() << "TPSERVE_E2E_BACKEND=cuda: this build has no CUDA backend";
#endif
  }

  // The engine's own answer for one sequence.
  std::vector<float> Direct(const std::vector<int32_t>& ids) {
    auto b = PackSequences({ids}, 1024, 2048);
    auto l = engine_->Forward(*b);
    EXPECT_TRUE(l.ok());
    return *l;
  }

  static inference::ModelInferRequest Request(const std::vector<int32_t>& ids) {
    inference::ModelInferRequest q;
    q.set_model_name("tiny");
    auto* in = q.add_inputs();
    in->set_name("input_ids");
    in->set_datatype("INT32");
    in->add_shape(static_cast<int64_t>(ids.size()));
    q.add_raw_input_contents(
        std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
    return q;
  }

  grpc::Status Infer(const inference::ModelInferRequest& q, inference::ModelInferResponse* r,
                     std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    return stub_->ModelInfer(&ctx, q, r);
  }

  static std::vector<float> LogitsOf(const inference::ModelInferResponse& r) {
    for (int i = 0; i < r.outputs_size(); ++i) {
      if (r.outputs(i).name() == "logits") {
        const std::string& raw = r.raw_output_contents(i);
        std::vector<float> v(raw.size() / 4);
        std::memcpy(v.data(), raw.data(), raw.size());
        return v;
      }
    }
    return {};
  }

  std::shared_ptr<Engine> engine_;  // also called directly for reference answers
  std::unique_ptr<InferenceServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Stub> stub_;
};

TEST_F(ServerE2eTest, HealthAndMetadataRpcs) {
  Start();
  if (HasFatalFailure() || IsSkipped()) return;
  grpc::ClientContext c1, c2, c3, c4, c5, c6;
  inference::ServerLiveResponse live;
  ASSERT_TRUE(stub_->ServerLive(&c1, {}, &live).ok());
  EXPECT_TRUE(live.live());
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(stub_->ServerReady(&c2, {}, &ready).ok());
  EXPECT_TRUE(ready.ready());
  inference::ModelReadyRequest mr;
  mr.set_name("tiny");
  inference::ModelReadyResponse mready;
  ASSERT_TRUE(stub_->ModelReady(&c3, mr, &mready).ok());
  EXPECT_TRUE(mready.ready());
  inference::ServerMetadataResponse sm;
  ASSERT_TRUE(stub_->ServerMetadata(&c4, {}, &sm).ok());
  EXPECT_EQ(sm.name(), "tpserve");
  inference::ModelMetadataRequest mm;
  mm.set_name("tiny");
  inference::ModelMetadataResponse meta;
  ASSERT_TRUE(stub_->ModelMetadata(&c5, mm, &meta).ok());
  ASSERT_EQ(meta.inputs_size(), 1);
  EXPECT_EQ(meta.inputs(0).name(), "input_ids");
  EXPECT_EQ(meta.inputs(0).datatype(), "INT32");
  ASSERT_EQ(meta.outputs_size(), 2);
  EXPECT_EQ(meta.outputs(0).shape(0), 1024);
  mm.set_name("other");
  grpc::ClientContext c7;
  EXPECT_EQ(stub_->ModelMetadata(&c7, mm, &meta).error_code(), grpc::StatusCode::NOT_FOUND);

  // grpc.health.v1.Health/Check with an empty HealthCheckRequest: SERVING is
  // field 1 = 1 (bytes 08 01).
  grpc::GenericStub generic(channel_);
  grpc::ClientContext hc;
  grpc::ByteBuffer req, resp;
  grpc::Slice empty("");
  req = grpc::ByteBuffer(&empty, 1);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status hs;
  generic.UnaryCall(&hc, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) {
                      std::lock_guard lock(mu);
                      hs = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return done; });
  ASSERT_TRUE(hs.ok()) << hs.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string bytes;
  for (auto& s : slices) bytes += std::string(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

TEST_F(ServerE2eTest, InferReturnsTheEnginesLogitsAndArgmax) {
  Start();
  if (HasFatalFailure() || IsSkipped()) return;
  const std::vector<int32_t> ids = {3, 1, 4, 1, 5, 9, 2, 6};
  inference::ModelInferResponse r;
  ASSERT_TRUE(Infer(Request(ids), &r).ok());
  ASSERT_EQ(r.outputs_size(), 2);
  ASSERT_EQ(r.raw_output_contents_size(), 2);
  ASSERT_EQ(r.raw_output_contents(1).size(), 4u);
  EXPECT_EQ(r.outputs(0).datatype(), "FP32");
  EXPECT_EQ(r.outputs(0).shape_size(), 1);
  const std::vector<float> logits = LogitsOf(r);
  ExpectSameLogits(logits, Direct(ids), "ids 3,1,4,1,5,9,2,6");
  int32_t next;
  std::memcpy(&next, r.raw_output_contents(1).data(), 4);
  EXPECT_EQ(next, std::max_element(logits.begin(), logits.end()) - logits.begin());

  // INT64 typed contents, shape [1, n], only next_token_id requested.
  inference::ModelInferRequest q;
  q.set_model_name("tiny");
  auto* in = q.add_inputs();
  in->set_name("input_ids");
  in->set_datatype("INT64");
  in->add_shape(1);
  in->add_shape(static_cast<int64_t>(ids.size()));
  for (int32_t id : ids) in->mutable_contents()->add_int64_contents(id);
  q.add_outputs()->set_name("next_token_id");
  inference::ModelInferResponse r2;
  ASSERT_TRUE(Infer(q, &r2).ok());
  ASSERT_EQ(r2.outputs_size(), 1);
  ASSERT_EQ(r2.raw_output_contents_size(), 1);
  ASSERT_EQ(r2.raw_output_contents(0).size(), 4u);
  EXPECT_EQ(r2.outputs(0).name(), "next_token_id");
  EXPECT_EQ(r2.outputs(0).shape_size(), 2);
  int32_t next2;
  std::memcpy(&next2, r2.raw_output_contents(0).data(), 4);
  EXPECT_EQ(next2, next);

  grpc::ClientContext sc;
  inference::ModelStatisticsRequest sq;
  inference::ModelStatisticsResponse st;
  ASSERT_TRUE(stub_->ModelStatistics(&sc, sq, &st).ok());
  ASSERT_EQ(st.model_stats_size(), 1);
  EXPECT_EQ(st.model_stats(0).inference_count(), 2u);
  const std::string metrics = server_->MetricsText();
  EXPECT_THAT(metrics, HasSubstr("nv_inference_request_success{model=\"tiny\",version=\"1\"} 2"));
  // Two single-request batches of 8 tokens each.
  EXPECT_THAT(metrics, HasSubstr("tpserve_batch_tokens_total{model=\"tiny\",version=\"1\"} 16"));
  EXPECT_THAT(metrics, HasSubstr("tpserve_batch_sequences_total{model=\"tiny\",version=\"1\"} 2"));
  EXPECT_THAT(metrics, HasSubstr("tpserve_last_batch_tokens{model=\"tiny\",version=\"1\"} 8"));
  // The CPU backend holds no device memory; the CUDA engine reports what rank
  // 0's GPU holds (weights, workspaces, graphs), which is never zero.
  const std::string mem_key = "tpserve_engine_device_memory_bytes{model=\"tiny\",version=\"1\"} ";
  const size_t mem_at = metrics.find(mem_key);
  ASSERT_NE(mem_at, std::string::npos) << metrics;
  const long long mem_bytes = std::stoll(metrics.substr(mem_at + mem_key.size()));
  if (CudaBackend()) {
    EXPECT_GT(mem_bytes, 0);
  } else {
    EXPECT_EQ(mem_bytes, 0);
  }
  // No overlap config: every one of tiny's 2 layers per kind in mode none.
  EXPECT_THAT(metrics, HasSubstr("tpserve_overlap_layers{model=\"tiny\",kind=\"mlp.down\","
                                 "op=\"gemm_rs\",mode=\"none\""));
  EXPECT_THAT(metrics, HasSubstr(",m=\"8\"} 2\n"));
}

TEST_F(ServerE2eTest, EveryBadInputGetsItsStatusAndTheServerKeepsServing) {
  Start();
  if (HasFatalFailure() || IsSkipped()) return;
  struct Case {
    std::function<void(inference::ModelInferRequest&)> mutate;
    grpc::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {[](auto& q) { q.set_model_name("gpt"); }, grpc::StatusCode::NOT_FOUND,
       "unknown model 'gpt'"},
      {[](auto& q) { q.set_model_version("7"); }, grpc::StatusCode::NOT_FOUND, "no version '7'"},
      {[](auto& q) { q.mutable_inputs(0)->set_name("tokens"); }, grpc::StatusCode::INVALID_ARGUMENT,
       "'tokens'"},
      {[](auto& q) { q.mutable_inputs(0)->set_datatype("FP32"); },
       grpc::StatusCode::INVALID_ARGUMENT, "datatype must be INT32 or INT64, got 'FP32'"},
      {[](auto& q) { q.mutable_inputs(0)->add_shape(2); }, grpc::StatusCode::INVALID_ARGUMENT,
       "shape must be [n] or [1, n]"},
      {[](auto& q) { q.mutable_inputs(0)->set_shape(0, 0); }, grpc::StatusCode::INVALID_ARGUMENT,
       "shape must be [n] or [1, n] with n >= 1, got [0]"},
      {[](auto& q) { q.mutable_raw_input_contents(0)->pop_back(); },
       grpc::StatusCode::INVALID_ARGUMENT, "raw contents hold 11 bytes"},
      {[](auto& q) { q.mutable_inputs(0)->mutable_contents()->add_int_contents(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "not both"},
      {[](auto& q) { q.clear_raw_input_contents(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "contents hold 0 values"},
      {[](auto& q) {
         int32_t bad = 1024;
         std::memcpy(q.mutable_raw_input_contents(0)->data() + 4, &bad, 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "token 1 has id 1024, outside [0, 1024)"},
      {[](auto& q) {
         int32_t bad = -5;
         std::memcpy(q.mutable_raw_input_contents(0)->data(), &bad, 4);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "id -5"},
      {[](auto& q) { q.add_outputs()->set_name("probs"); }, grpc::StatusCode::INVALID_ARGUMENT,
       "unknown requested output 'probs'"},
      {[](auto& q) { q = Request(std::vector<int32_t>(65, 1)); },
       grpc::StatusCode::INVALID_ARGUMENT, "65 tokens, at most 64"},
      // Raw INT32 bytes plus values in another datatype's field: refused,
      // not ignored.
      {[](auto& q) { q.mutable_inputs(0)->mutable_contents()->add_int64_contents(7); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "datatype INT32 takes its values in int_contents or raw_input_contents, but "
       "int64_contents holds 1 value(s)"},
      {[](auto& q) {
         q.clear_raw_input_contents();
         for (int i = 0; i < 3; ++i) q.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "but fp32_contents holds 3 value(s)"},
      {[](auto& q) {
         q.add_outputs()->set_name("logits");
         q.add_outputs()->set_name("logits");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "output 'logits' is requested twice"},
      {[](auto& q) {
         auto* o = q.add_outputs();
         o->set_name("logits");
         (*o->mutable_parameters())["classification"].set_int64_param(3);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "output 'logits': parameter 'classification' is not supported"},
      {[](auto& q) { (*q.mutable_parameters())["priority"].set_int64_param(5); },
       grpc::StatusCode::INVALID_ARGUMENT, "request parameter 'priority' is not supported"},
      {[](auto& q) { (*q.mutable_inputs(0)->mutable_parameters())["x"].set_bool_param(true); },
       grpc::StatusCode::INVALID_ARGUMENT, "input 'input_ids': parameter 'x' is not supported"},
      // A client's long or binary string is echoed cut and escaped: the
      // status still fits the client's metadata limit.
      {[](auto& q) { q.set_model_name(std::string(20000, 'm') + "\n"); },
       grpc::StatusCode::NOT_FOUND, "mmm...(20001 bytes)' (this server serves 'tiny')"},
      {[](auto& q) { q.mutable_inputs(0)->set_datatype(std::string("IN\x01T\n", 5)); },
       grpc::StatusCode::INVALID_ARGUMENT, "got 'IN\\x01T\\n'"},
      // A shape of thousands of dimensions is shown cut, with its length.
      {[](auto& q) {
         for (int i = 0; i < 4000; ++i) q.mutable_inputs(0)->add_shape(7);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "got [3,7,7,7,7,7,7,7,...; 4001 dimensions]"},
      // binary_data_size (KServe's and Triton's Python clients send it) must agree with the
      // raw contents, be an int64, and come with raw contents.
      {[](auto& q) {
         (*q.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(8);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "parameter binary_data_size says 8 bytes, raw contents hold 12"},
      {[](auto& q) {
         (*q.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_string_param("12");
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "parameter 'binary_data_size' must be a non-negative int64_param"},
      {[](auto& q) {
         q.clear_raw_input_contents();
         for (int i = 0; i < 3; ++i) q.mutable_inputs(0)->mutable_contents()->add_int_contents(1);
         (*q.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(12);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "binary_data_size is given, but no raw_input_contents"},
      {[](auto& q) {
         auto& params = *q.mutable_inputs(0)->mutable_parameters();
         params["binary_data_size"].set_int64_param(12);
         params["shared_memory_region"].set_string_param("r");
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "parameter 'shared_memory_region' is not supported (only binary_data_size)"},
      {[](auto& q) {
         auto* o = q.add_outputs();
         o->set_name("logits");
         (*o->mutable_parameters())["binary_data"].set_int64_param(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "output 'logits': parameter 'binary_data' must be a bool_param"},
  };
  for (const Case& c : cases) {
    inference::ModelInferRequest q = Request({1, 2, 3});
    c.mutate(q);
    inference::ModelInferResponse r;
    const grpc::Status s = Infer(q, &r);
    EXPECT_EQ(s.error_code(), c.code) << c.message << " / got: " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
  }
  inference::ModelInferResponse r;
  EXPECT_TRUE(Infer(Request({1, 2, 3}), &r).ok());  // still serving
}

// What KServe's and Triton's Python clients send by default with raw contents: the input's
// binary_data_size and the outputs' binary_data. Answered like the plain request.
TEST_F(ServerE2eTest, BinaryDataParametersOfPythonClientsAreAccepted) {
  Start();
  if (HasFatalFailure() || IsSkipped()) return;
  inference::ModelInferRequest q = Request({3, 1, 4});
  (*q.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(12);
  for (const char* name : {"logits", "next_token_id"}) {
    auto* o = q.add_outputs();
    o->set_name(name);
    (*o->mutable_parameters())["binary_data"].set_bool_param(true);
  }
  inference::ModelInferResponse r;
  const grpc::Status s = Infer(q, &r);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectSameLogits(LogitsOf(r), Direct({3, 1, 4}), "binary_data parameters");
  EXPECT_EQ(r.outputs_size(), 2);
}

// Requests on a stream are answered as they complete (an error at once, a
// request in a batch when the batch is done), told apart by their ids.
TEST_F(ServerE2eTest, StreamInferAnswersEachRequestAndReportsErrorsInBand) {
  Start();
  if (HasFatalFailure() || IsSkipped()) return;
  grpc::ClientContext ctx;
  auto stream = stub_->ModelStreamInfer(&ctx);
  inference::ModelInferRequest bad = Request({1, 2});
  bad.set_model_name("nope");
  bad.set_id("bad-2");
  inference::ModelInferRequest first = Request({7, 8, 9}), third = Request({5});
  first.set_id("one");
  third.set_id("three");
  ASSERT_TRUE(stream->Write(first));
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(stream->Write(third));
  stream->WritesDone();
  std::map<std::string, inference::ModelStreamInferResponse> got;
  inference::ModelStreamInferResponse r;
  while (stream->Read(&r)) {
    EXPECT_EQ(got.count(r.infer_response().id()), 0u)
        << "two answers for " << r.infer_response().id();
    got[r.infer_response().id()] = r;
  }
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(got["one"].error_message().empty());
  ExpectSameLogits(LogitsOf(got["one"].infer_response()), Direct({7, 8, 9}), "stream request 1");
  EXPECT_THAT(got["bad-2"].error_message(), HasSubstr("unknown model 'nope'"));
  EXPECT_TRUE(got["three"].error_message().empty());
  ExpectSameLogits(LogitsOf(got["three"].infer_response()), Direct({5}), "stream request 3");
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServerE2eTest, SixtyFourConcurrentRequestsAreBatchInvariant) {
  Start({8192, std::chrono::milliseconds(5), 1024});
  if (HasFatalFailure() || IsSkipped()) return;
  std::mt19937 rng(4);
  std::vector<std::vector<int32_t>> prompts(64);
  for (auto& p : prompts) {
    p.resize(1 + rng() % 40);
    for (auto& id : p) id = static_cast<int32_t>(rng() % 1024);
  }
  std::vector<std::vector<float>> got(64);
  std::vector<grpc::Status> status(64);
  std::vector<std::thread> threads;
  for (int i = 0; i < 64; ++i) {
    threads.emplace_back([&, i] {
      inference::ModelInferResponse r;
      status[i] = Infer(Request(prompts[i]), &r);
      got[i] = LogitsOf(r);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(status[i].ok()) << i << ": " << status[i].error_message();
    ExpectSameLogits(got[i], Direct(prompts[i]), "request " + std::to_string(i));
  }
  // Invariance is only shown if requests shared batches.
  const std::string metrics = server_->MetricsText();
  EXPECT_EQ(MetricValue(metrics, "tpserve_batch_sequences_total"), 64);
  const long long batches = MetricValue(metrics, "nv_inference_exec_count");
  EXPECT_GE(batches, 1);
  EXPECT_LT(batches, 64) << "every request ran alone: nothing was batched";
}

TEST_F(ServerE2eTest, DeadlineExpiringInTheQueueIsDeadlineExceeded) {
  Start({8192, std::chrono::milliseconds(500), 1024});
  if (HasFatalFailure() || IsSkipped()) return;
  inference::ModelInferResponse r;
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status s = Infer(Request({1, 2}), &r, std::chrono::milliseconds(50));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The client gives up at 50 ms whatever the server does; what must hold on
  // the server's side: the request is answered (a failure counted) at its
  // deadline, long before the 500 ms flush, and the engine never runs it.
  const std::string failed = "nv_inference_request_failure{model=\"tiny\",version=\"1\"} 1";
  while (server_->MetricsText().find(failed) == std::string::npos &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(400));
  const std::string metrics = server_->MetricsText();
  EXPECT_THAT(metrics, HasSubstr(failed));
  EXPECT_THAT(metrics, HasSubstr("nv_inference_exec_count{model=\"tiny\",version=\"1\"} 0"));
  EXPECT_THAT(metrics,
              HasSubstr("nv_inference_pending_request_count{model=\"tiny\",version=\"1\"} 0"));
  // And the server keeps serving.
  EXPECT_TRUE(Infer(Request({1, 2}), &r).ok());
}

TEST_F(ServerE2eTest, RequestsLongerThanOneBatchAreRefusedNamingTheInput) {
  // 16 tokens per batch, while the per-request limit (64) would allow more.
  Start({16, std::chrono::milliseconds(1), 1024});
  if (HasFatalFailure() || IsSkipped()) return;
  inference::ModelInferResponse r;
  const grpc::Status s = Infer(Request(std::vector<int32_t>(17, 1)), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("input 'input_ids': 17 tokens, at most 16"));
  EXPECT_TRUE(Infer(Request(std::vector<int32_t>(16, 1)), &r).ok());
}

TEST(GrpcListenAddress, BracketsAnIpv6HostOnce) {
  EXPECT_EQ(GrpcListenAddress("0.0.0.0", 8001), "0.0.0.0:8001");
  EXPECT_EQ(GrpcListenAddress("localhost", 1), "localhost:1");
  EXPECT_EQ(GrpcListenAddress("::1", 8001), "[::1]:8001");
  EXPECT_EQ(GrpcListenAddress("[::]", 0), "[::]:0");
}

TEST(DefaultModelName, IsTheDirectorysLastNameWhateverTheSpelling) {
  EXPECT_EQ(DefaultModelName("tiny", false), "tiny");
  EXPECT_EQ(DefaultModelName("ckpt", true), "ckpt");
  EXPECT_EQ(DefaultModelName("ckpt/", true), "ckpt");  // as tab completion gives it
  EXPECT_EQ(DefaultModelName("./ckpt//", true), "ckpt");
  EXPECT_EQ(DefaultModelName("/models/llama-3/", true), "llama-3");
  EXPECT_EQ(DefaultModelName("/", true), "model");
  const std::string cwd = std::filesystem::current_path().filename().string();
  EXPECT_EQ(DefaultModelName(".", true), cwd.empty() ? "model" : cwd);
}

TEST(PrometheusLabelValue, EscapesBackslashQuoteAndNewline) {
  EXPECT_EQ(PrometheusLabelValue("tiny"), "tiny");
  EXPECT_EQ(PrometheusLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

TEST_F(ServerE2eTest, ShutdownFinishesEveryAcceptedRequest) {
  // Requests wait 2 s for batch-mates, so all 16 are queued when the
  // shutdown starts (checked below: the drain of a queue is what is tested).
  Start({8192, std::chrono::seconds(2), 1024});
  if (HasFatalFailure() || IsSkipped()) return;
  std::vector<grpc::Status> status(16);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      inference::ModelInferResponse r;
      status[i] = Infer(Request({i + 1, 2, 3}), &r);
    });
  }
  bool all_queued = false;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  while (!all_queued && std::chrono::steady_clock::now() < give_up) {
    all_queued = MetricValue(server_->MetricsText(), "nv_inference_pending_request_count") == 16;
    if (!all_queued) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30));
  for (auto& t : threads) t.join();
  EXPECT_TRUE(all_queued) << "the 16 requests were not all queued when the shutdown began";
  for (int i = 0; i < 16; ++i)
    EXPECT_TRUE(status[i].ok()) << i << ": " << status[i].error_message();
  inference::ModelInferResponse r;
  EXPECT_FALSE(Infer(Request({1}), &r, std::chrono::milliseconds(500)).ok());  // no longer serving
  // A metrics scrape during or after the drain reads the stopped server's
  // counters (it read a freed batcher before).
  EXPECT_THAT(server_->MetricsText(),
              HasSubstr("nv_inference_request_success{model=\"tiny\",version=\"1\"} 16"));
}

TEST_F(ServerE2eTest, ShutdownEndsOpenStreamsInsteadOfWaitingForTheirClients) {
  Start();
  if (HasFatalFailure() || IsSkipped()) return;
  // One stream has had its answer and waits for the next request; one was
  // opened and never used. Neither may hold the drain until its deadline.
  grpc::ClientContext used_ctx, idle_ctx;
  auto used = stub_->ModelStreamInfer(&used_ctx);
  auto idle = stub_->ModelStreamInfer(&idle_ctx);
  ASSERT_TRUE(used->Write(Request({4, 5})));
  inference::ModelStreamInferResponse out;
  ASSERT_TRUE(used->Read(&out));
  EXPECT_TRUE(out.error_message().empty()) << out.error_message();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // both handlers running
  const auto start = std::chrono::steady_clock::now();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_FALSE(used->Read(&out));
  EXPECT_FALSE(used->Finish().ok());
  EXPECT_FALSE(idle->Read(&out));
  EXPECT_FALSE(idle->Finish().ok());
}

TEST_F(ServerE2eTest, StreamsBeyondTheirLimitAreResourceExhaustedAndHealthStillAnswers) {
  // At most 8 open streams; the RPC threads are sized for them, the queue (4), a batch's
  // requests and 64 spare, so that open streams never take health and metadata calls' threads.
  Start({8192, std::chrono::milliseconds(1), 4}, 8);
  if (HasFatalFailure() || IsSkipped()) return;
  constexpr int kStreams = 20;
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<
      grpc::ClientReaderWriter<inference::ModelInferRequest, inference::ModelStreamInferResponse>>>
      streams;
  for (int i = 0; i < kStreams; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(stub_->ModelStreamInfer(ctxs.back().get()));
  }
  int answered = 0, exhausted = 0;
  for (int i = 0; i < kStreams; ++i) {
    if (streams[i]->Write(Request({1, 2}))) {
      inference::ModelStreamInferResponse out;
      if (streams[i]->Read(&out) && out.error_message().empty()) ++answered;
    }
  }
  {  // every answered stream is still open: the server still answers health and metadata
    grpc::ClientContext ctx;
    inference::ServerLiveResponse live;
    EXPECT_TRUE(stub_->ServerLive(&ctx, inference::ServerLiveRequest(), &live).ok());
    EXPECT_TRUE(live.live());
  }
  for (int i = 0; i < kStreams; ++i) {
    streams[i]->WritesDone();
    const grpc::Status st = streams[i]->Finish();
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++exhausted;
      EXPECT_THAT(st.error_message(), HasSubstr("8 streams are open, the server's limit "
                                                "(--max-streams)"));
    }
  }
  EXPECT_EQ(answered, 8);
  EXPECT_EQ(exhausted, kStreams - 8);
  inference::ModelInferResponse r;
  EXPECT_TRUE(Infer(Request({1, 2, 3}), &r).ok());  // the streams are closed: serving again
}

// An engine that fails on demand, to see the server notice.
class BreakableEngine final : public Engine {
 public:
  StatusOr<std::vector<float>> Forward(const TokenBatch& b) override {
    if (broken) return UnavailableError("rank 1 died");
    return std::vector<float>(b.sequences() * config_.vocab_size, 0.5f);
  }
  const ModelConfig& config() const override { return config_; }
  bool healthy() const override { return !broken; }
  std::atomic<bool> broken{false};

 private:
  ModelConfig config_ = *ModelPreset("tiny");
};

TEST(ServerHealth, AFailedEngineTurnsTheServerNotReadyAndRequestsUnavailable) {
  auto engine = std::make_shared<BreakableEngine>();
  ServerOptions so;
  so.model_name = "tiny";
  so.grpc_address = "127.0.0.1:0";
  auto server = InferenceServer::Start(so, engine);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  auto ready = [&] {
    grpc::ClientContext ctx;
    inference::ServerReadyResponse r;
    EXPECT_TRUE(stub->ServerReady(&ctx, {}, &r).ok());
    return r.ready();
  };
  EXPECT_TRUE(ready());
  engine->broken = true;
  bool turned = false;
  for (int i = 0; i < 100 && !turned; ++i) {
    turned = !ready();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(turned);
  inference::ModelInferRequest q;
  q.set_model_name("tiny");
  auto* in = q.add_inputs();
  in->set_name("input_ids");
  in->set_datatype("INT32");
  in->add_shape(1);
  in->mutable_contents()->add_int_contents(5);
  grpc::ClientContext ctx;
  inference::ModelInferResponse r;
  const grpc::Status s = stub->ModelInfer(&ctx, q, &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("rank 1 died"));
}

// TLS and mutual TLS with throwaway self-signed certificates (openssl CLI).
class ServerTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("openssl version > /dev/null 2>&1") != 0) GTEST_SKIP() << "needs openssl";
    dir_ = ::testing::TempDir() + "/tpserve_tls_" + std::to_string(::getpid());
    ASSERT_EQ(std::system(("mkdir -p " + dir_).c_str()), 0);
    for (const char* who : {"server", "client"}) {
      const std::string cmd =
          "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
          "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
          dir_ + "/" + who + ".key -out " + dir_ + "/" + who + ".crt > /dev/null 2>&1";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
  }
  void TearDown() override {
    server_.reset();
    if (!dir_.empty()) std::system(("rm -rf " + dir_).c_str());
  }
  std::string Read(const std::string& name) {
    std::ifstream in(dir_ + "/" + name);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  void Start(bool mutual) {
    ServerOptions so;
    so.model_name = "tiny";
    so.grpc_address = "127.0.0.1:0";
    so.tls_cert_file = dir_ + "/server.crt";
    so.tls_key_file = dir_ + "/server.key";
    if (mutual) so.tls_client_ca_file = dir_ + "/client.crt";
    auto server = InferenceServer::Start(so, std::make_shared<BreakableEngine>());
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
  }
  bool Live(std::shared_ptr<grpc::ChannelCredentials> creds) {
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()), creds, args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    inference::ServerLiveResponse r;
    return stub->ServerLive(&ctx, {}, &r).ok() && r.live();
  }
  std::string dir_;
  std::unique_ptr<InferenceServer> server_;
};

TEST_F(ServerTlsTest, TlsServesVerifiedClientsAndRefusesPlaintext) {
  Start(/*mutual=*/false);
  grpc::SslCredentialsOptions ok;
  ok.pem_root_certs = Read("server.crt");
  EXPECT_TRUE(Live(grpc::SslCredentials(ok)));
  EXPECT_FALSE(Live(grpc::InsecureChannelCredentials()));
  grpc::SslCredentialsOptions wrong_root;
  wrong_root.pem_root_certs = Read("client.crt");  // does not sign the server's certificate
  EXPECT_FALSE(Live(grpc::SslCredentials(wrong_root)));
}

TEST_F(ServerTlsTest, MutualTlsRequiresAClientCertificate) {
  Start(/*mutual=*/true);
  grpc::SslCredentialsOptions with_cert;
  with_cert.pem_root_certs = Read("server.crt");
  with_cert.pem_private_key = Read("client.key");
  with_cert.pem_cert_chain = Read("client.crt");
  EXPECT_TRUE(Live(grpc::SslCredentials(with_cert)));
  grpc::SslCredentialsOptions without;
  without.pem_root_certs = Read("server.crt");
  EXPECT_FALSE(Live(grpc::SslCredentials(without)));
}

TEST(ServerTlsOptions, BadTlsSettingsAreClearErrors) {
  ServerOptions so;
  so.grpc_address = "127.0.0.1:0";
  so.tls_cert_file = "/nonexistent/server.crt";
  auto s1 = InferenceServer::Start(so, std::make_shared<BreakableEngine>());
  EXPECT_THAT(s1.status().message(), HasSubstr("both --tls-cert and --tls-key"));
  so.tls_key_file = "/nonexistent/server.key";
  auto s2 = InferenceServer::Start(so, std::make_shared<BreakableEngine>());
  EXPECT_EQ(s2.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s2.status().message(), HasSubstr("/nonexistent/server.crt"));
}

}  // namespace
}  // namespace tpserve
