// The CUDA TP linear layers against the CPU reference, on 2 GPUs (ranks as
// threads). Skipped without 2 GPUs (the TP = 1 tests need one).
//
// Tolerance: cuBLASLt accumulates in FP32 in its own order and NCCL sums BF16
// partials with per-step rounding, so outputs differ from the reference by
// BF16 rounding: relative Frobenius error <= kRelTol, every element written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/nccl_thread_group.h"
#include "engine/cuda_ops.h"
#include "layers/cuda_linear.h"
#include "layers/linear_problem.h"
#include "layers/quantize_kernels.h"

namespace tpserve {
namespace {

constexpr int kTp = 2;
constexpr double kRelTol = 1e-2;

class GpuLinearTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (CudaDeviceCount() < kTp) return;
    auto g = NcclThreadGroup::Create(kTp);
    if (g.ok()) {
      group_ = std::move(g).value();
    } else {
      init_error_ = g.status().ToString();
    }
  }
  static void TearDownTestSuite() { group_.reset(); }

  void SetUp() override {
    if (CudaDeviceCount() < kTp) GTEST_SKIP() << "needs " << kTp << " GPUs";
    ASSERT_NE(group_, nullptr) << "NCCL init failed: " << init_error_;
  }

  static std::unique_ptr<NcclThreadGroup> group_;
  static std::string init_error_;
};

std::unique_ptr<NcclThreadGroup> GpuLinearTest::group_;
std::string GpuLinearTest::init_error_;

// One rank's device copies of a problem's operands.
struct RankOperands {
  DeviceBuffer w, scales;  // scales: x_scale at 0, w_scale at 16 bytes

  static StatusOr<RankOperands> Upload(const LinearProblem& p, int rank) {
    RankOperands o;
    TP_ASSIGN_OR_RETURN(o.w, DeviceBuffer::Allocate(p.w_local[rank].size(), "test.w"));
    TP_CUDA_CHECK(cudaMemcpy(o.w.data(), p.w_local[rank].data(), p.w_local[rank].size(),
                             cudaMemcpyHostToDevice));
    // The scales 16 bytes apart, as cuBLASLt wants them aligned.
    TP_ASSIGN_OR_RETURN(o.scales, DeviceBuffer::Allocate(8 * sizeof(float), "test.scales"));
    const float s[8] = {p.x_scale, 0, 0, 0, p.w_scale, 0, 0, 0};
    TP_CUDA_CHECK(cudaMemcpy(o.scales.data(), s, sizeof s, cudaMemcpyHostToDevice));
    return o;
  }
  const float* x_scale() const { return scales.as<float>(); }
  const float* w_scale() const { return scales.as<float>() + 4; }
};

struct Config {
  LinearKnobs knobs;
  std::string label;
};

// Every NCCL configuration. (Copy-engine layers need one process per GPU, so
// they are not run here: see CopyEngineWithRanksAsThreadsIsRefused.)
std::vector<Config> AllConfigs() {
  std::vector<Config> out;
  auto add = [&](OverlapMode mode, int chunks) {
    Config c;
    c.knobs.mode = mode;
    c.knobs.chunks = chunks;
    c.label = std::string(OverlapModeName(mode)) + "/chunks=" + std::to_string(chunks);
    out.push_back(c);
  };
  add(OverlapMode::kNone, 1);
  for (int chunks : {1, 2, 4, 8}) {
    add(OverlapMode::kPipeline, chunks);
    add(OverlapMode::kRing, chunks);
  }
  return out;
}

// Rank r's layer `name` for problem p with `knobs`, prepared for p.m rows.
StatusOr<std::unique_ptr<CudaLinear>> PreparedLayer(const std::string& name, const LinearProblem& p,
                                                    const LinearKnobs& knobs, NcclCommPool& pool) {
  CudaLinearShape shape{p.op, p.dtype, p.m, p.n_local(), p.k_local()};
  TP_ASSIGN_OR_RETURN(auto layer, CudaLinear::Create(name, shape, knobs, pool));
  TP_RETURN_IF_ERROR(layer->Prepare(p.m));
  return layer;
}

// Runs `problem` through a CudaLinear with `knobs` on every rank; returns the
// ranks' outputs (poisoned before the run). With `split_out`, through RunSplit:
// (*split_out)[r] tells whether rank r got two addends (summed here, FP32 sum
// rounded once, as a consumer adds them) rather than y.
StatusOr<std::vector<std::vector<BFloat16>>> RunOnGpus(NcclThreadGroup& group,
                                                       const LinearProblem& p,
                                                       const LinearKnobs& knobs,
                                                       std::vector<bool>* split_out = nullptr) {
  if (split_out != nullptr) split_out->assign(p.tp, false);
  std::vector<std::vector<BFloat16>> y(p.tp);
  TP_RETURN_IF_ERROR(group.Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(RankOperands ops, RankOperands::Upload(p, r));
    TP_ASSIGN_OR_RETURN(auto layer, PreparedLayer("test.layer", p, knobs, group.pool(r)));
    TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
    TP_CUDA_CHECK(cudaMemcpy(layer->input(p.m), p.x_local[r].data(), p.x_local[r].size(),
                             cudaMemcpyHostToDevice));
    const int64_t out = layer->output_elements(p.m);
    TP_ASSIGN_OR_RETURN(DeviceBuffer dy, DeviceBuffer::Allocate(out * 2 + 16, "test.y"));
    TP_RETURN_IF_ERROR(LaunchPoisonFill(dy.data(), DataType::kBFloat16, out, stream.get()));
    CudaLinear::SplitOutput split{dy.data(), nullptr};
    if (split_out != nullptr) {
      TP_RETURN_IF_ERROR(layer->RunSplit(p.m, ops.w.data(), ops.x_scale(), ops.w_scale(), dy.data(),
                                         stream.get(), &split));
    } else {
      TP_RETURN_IF_ERROR(
          layer->Run(p.m, ops.w.data(), ops.x_scale(), ops.w_scale(), dy.data(), stream.get()));
    }
    TP_RETURN_IF_ERROR(group.pool(r).base().WaitStream(stream.get()));
    // RunSplit's contract: a plan without a sum step of its own answers {y, nullptr}. Only y
    // is poisoned, so reading any other first addend could pass on stale data.
    if (split.second == nullptr && split.first != dy.data()) {
      return InternalError("rank " + std::to_string(r) +
                           ": RunSplit gave one addend that is not y");
    }
    y[r].resize(out);
    TP_CUDA_CHECK(cudaMemcpy(y[r].data(), split.first, out * 2, cudaMemcpyDeviceToHost));
    if (split.second != nullptr) {
      (*split_out)[r] = true;
      std::vector<BFloat16> second(out);
      TP_CUDA_CHECK(cudaMemcpy(second.data(), split.second, out * 2, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < out; ++i) {
        y[r][i] = FloatToBFloat16(BFloat16ToFloat(y[r][i]) + BFloat16ToFloat(second[i]));
      }
    }
    return Status::Ok();
  }));
  return y;
}

void CheckAllConfigs(NcclThreadGroup& group, OverlapOp op, DataType dtype) {
  const bool ag = op == OverlapOp::kAllGatherGemm;
  for (int64_t m : {37, 1002, 4099, 8192}) {
    // Global N and K small enough for the CPU reference, multiples of 16 per rank.
    const int64_t n = ag ? 64 * kTp : 96, k = ag ? 128 : 64 * kTp;
    auto p = MakeRandomLinearProblem(op, dtype, kTp, m, n, k, static_cast<uint32_t>(m));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    for (const Config& c : AllConfigs()) {
      SCOPED_TRACE("m=" + std::to_string(m) + " " + c.label);
      auto y = RunOnGpus(group, *p, c.knobs);
      ASSERT_TRUE(y.ok()) << y.status().ToString();
      auto err = CompareWithReference(*p, *y);
      ASSERT_TRUE(err.ok()) << err.status().ToString();
      EXPECT_EQ(err->unwritten, 0);
      EXPECT_LE(err->rel_frobenius, kRelTol) << "max_abs " << err->max_abs;
    }
  }
}

// RunSplit on NCCL plans, which have no sum step of their own: each rank's
// output in y, as Run writes it, and no second addend. (The copy-engine ring
// whose last sum RunSplit leaves to the consumer needs one process per GPU:
// GpuLayerProcessesTest checks it with `tpserve layer --split-output`.)
TEST_F(GpuLinearTest, RunSplitOfAPlanWithoutItsOwnSumStepWritesY) {
  for (OverlapOp op : {OverlapOp::kGemmReduceScatter, OverlapOp::kAllGatherGemm}) {
    const bool ag = op == OverlapOp::kAllGatherGemm;
    auto p = MakeRandomLinearProblem(op, DataType::kFloat8E4M3, kTp, 1002, ag ? 64 * kTp : 96,
                                     ag ? 128 : 64 * kTp, 5);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    for (const Config& c : AllConfigs()) {
      SCOPED_TRACE(std::string(OverlapOpName(op)) + " " + c.label);
      std::vector<bool> split;
      auto y = RunOnGpus(*group_, *p, c.knobs, &split);
      ASSERT_TRUE(y.ok()) << y.status().ToString();
      for (int r = 0; r < kTp; ++r) EXPECT_FALSE(split[r]) << "rank " << r << " got two addends";
      auto err = CompareWithReference(*p, *y);
      ASSERT_TRUE(err.ok()) << err.status().ToString();
      EXPECT_EQ(err->unwritten, 0);
      EXPECT_LE(err->rel_frobenius, kRelTol) << "max_abs " << err->max_abs;
    }
  }
}

TEST_F(GpuLinearTest, RunSplitNeedsItsOutput) {
  auto p = MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, DataType::kFloat8E4M3, kTp, 64,
                                   96, 64 * kTp, 6);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  Status s = group_->Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(RankOperands ops, RankOperands::Upload(*p, r));
    TP_ASSIGN_OR_RETURN(auto layer,
                        PreparedLayer("test.layer", *p, LinearKnobs{}, group_->pool(r)));
    TP_ASSIGN_OR_RETURN(DeviceBuffer dy, DeviceBuffer::Allocate(4096, "test.y"));
    const Status refused = layer->RunSplit(p->m, ops.w.data(), ops.x_scale(), ops.w_scale(),
                                           dy.data(), nullptr, nullptr);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    EXPECT_NE(refused.message().find("SplitOutput"), std::string::npos) << refused.ToString();
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST_F(GpuLinearTest, AllGatherGemmFp8MatchesCpuReferenceInEveryMode) {
  CheckAllConfigs(*group_, OverlapOp::kAllGatherGemm, DataType::kFloat8E4M3);
}
TEST_F(GpuLinearTest, AllGatherGemmBf16MatchesCpuReferenceInEveryMode) {
  CheckAllConfigs(*group_, OverlapOp::kAllGatherGemm, DataType::kBFloat16);
}
TEST_F(GpuLinearTest, GemmReduceScatterFp8MatchesCpuReferenceInEveryMode) {
  CheckAllConfigs(*group_, OverlapOp::kGemmReduceScatter, DataType::kFloat8E4M3);
}
TEST_F(GpuLinearTest, GemmReduceScatterBf16MatchesCpuReferenceInEveryMode) {
  CheckAllConfigs(*group_, OverlapOp::kGemmReduceScatter, DataType::kBFloat16);
}

// Graph replay must reproduce eager execution bit for bit, 100 times, and
// allocate nothing on the device while replaying (after the first launch). The input alternates
// between two tensors from one replay to the next, so a transfer that is
// skipped or stale in the graph (old rows left in a buffer) shows as a
// mismatch.
void CheckGraphReplay(NcclThreadGroup& group, OverlapOp op, OverlapMode mode, int chunks) {
  const bool ag = op == OverlapOp::kAllGatherGemm;
  const int tp = group.size();
  const int64_t m = 4099, n = ag ? 256 * tp : 256, k = ag ? 512 : 256 * tp;
  auto p = MakeRandomLinearProblem(op, DataType::kFloat8E4M3, tp, m, n, k, 99);
  auto other = MakeRandomLinearProblem(op, DataType::kFloat8E4M3, tp, m, n, k, 100);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  LinearKnobs knobs;
  knobs.mode = mode;
  knobs.chunks = chunks;
  Status s = group.Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(RankOperands ops, RankOperands::Upload(*p, r));
    CudaLinearShape shape{p->op, p->dtype, p->m, p->n_local(), p->k_local()};
    TP_ASSIGN_OR_RETURN(auto layer, CudaLinear::Create("test.graph", shape, knobs, group.pool(r)));
    TP_RETURN_IF_ERROR(layer->Prepare(m));
    TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
    // The two inputs (same W and scales), kept on the device.
    const size_t in_bytes = layer->input_bytes(m);
    std::vector<DeviceBuffer> inputs;
    for (const LinearProblem* q : {&*p, &*other}) {
      if (q->x_local[r].size() != in_bytes) return InternalError("unexpected input size");
      TP_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(in_bytes, "test.x"));
      TP_CUDA_CHECK(cudaMemcpy(b.data(), q->x_local[r].data(), in_bytes, cudaMemcpyHostToDevice));
      inputs.push_back(std::move(b));
    }
    const int64_t out = layer->output_elements(m);
    TP_ASSIGN_OR_RETURN(DeviceBuffer dy, DeviceBuffer::Allocate(out * 2 + 16, "test.y"));
    auto set_input = [&](int which) -> Status {
      TP_CUDA_CHECK(cudaMemcpyAsync(layer->input(m), inputs[which].data(), in_bytes,
                                    cudaMemcpyDeviceToDevice, stream.get()));
      return LaunchPoisonFill(dy.data(), DataType::kBFloat16, out, stream.get());
    };
    auto run = [&] {
      return layer->Run(m, ops.w.data(), ops.x_scale(), ops.w_scale(), dy.data(), stream.get());
    };
    // Eager first (also sets up NCCL's connections outside the graph).
    std::vector<std::vector<uint16_t>> eager(2, std::vector<uint16_t>(out));
    for (int which : {0, 1}) {
      TP_RETURN_IF_ERROR(set_input(which));
      TP_RETURN_IF_ERROR(run());
      TP_RETURN_IF_ERROR(group.pool(r).base().WaitStream(stream.get()));
      TP_CUDA_CHECK(cudaMemcpy(eager[which].data(), dy.data(), out * 2, cudaMemcpyDeviceToHost));
    }
    if (out > 0 && eager[0] == eager[1]) return InternalError("the two inputs give one output");
    std::vector<uint16_t> replay(out);

    TP_ASSIGN_OR_RETURN(
        CudaGraphExec graph,
        CudaGraphExec::Capture(stream.get(), cudaStreamCaptureModeThreadLocal, run));
    // The first launch may set up driver resources for the graph (seen: 2 MiB
    // once for a graph with peer-to-peer copies); replays after it must not
    // allocate.
    size_t free_before = 0, free_after = 0, total = 0;
    for (int i = 0; i < 100; ++i) {
      TP_RETURN_IF_ERROR(set_input(i % 2));
      TP_RETURN_IF_ERROR(graph.Launch(stream.get()));
      TP_RETURN_IF_ERROR(group.pool(r).base().WaitStream(stream.get()));
      if (i == 0) TP_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
      TP_CUDA_CHECK(cudaMemcpy(replay.data(), dy.data(), out * 2, cudaMemcpyDeviceToHost));
      if (replay != eager[i % 2]) {
        return InternalError("replay " + std::to_string(i) + " (input " + std::to_string(i % 2) +
                             ") differs from eager execution");
      }
    }
    TP_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
    if (free_after != free_before) {
      return InternalError("device free memory changed during replays: " +
                           std::to_string(free_before) + " -> " + std::to_string(free_after));
    }
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
}

TEST_F(GpuLinearTest, AllGatherGemmPipelineGraphReplayIsBitIdenticalAndAllocationFree) {
  CheckGraphReplay(*group_, OverlapOp::kAllGatherGemm, OverlapMode::kPipeline, 4);
}
// Copy-engine layers with ranks as threads of one process: eager runs hung
// until peer copies used cudaMemcpyPeerAsync; graph replays of a copy-engine
// ReduceScatter hung (ring and pipeline), and so did, rarely, those of the
// AllGather (pipeline, 4 chunks: once in 14 repeats of its test,
// benchmarks/results/ce-thread-tests.log.gz).
// CudaLinear refuses copy engines with ranks as threads, for both ops. In the
// production process model (one process per GPU, CUDA IPC) every copy-engine
// mode of both ops is checked by `tpserve layer --copy-engine`
// (GpuLayerProcessesTest: the eager output against the CPU reference,
// and 10 graph replays, the input alternating between two tensors, against
// the eager outputs bit for bit).
TEST_F(GpuLinearTest, CopyEngineWithRanksAsThreadsIsRefused) {
  for (OverlapOp op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
    for (OverlapMode mode : {OverlapMode::kNone, OverlapMode::kPipeline, OverlapMode::kRing}) {
      SCOPED_TRACE(std::string(OverlapOpName(op)) + " " + std::string(OverlapModeName(mode)));
      LinearKnobs knobs;
      knobs.mode = mode;
      knobs.chunks = mode == OverlapMode::kNone ? 1 : 2;
      knobs.copy_engine = true;
      std::vector<Status> got(kTp);
      const Status s = group_->Run([&](int r) -> Status {
        CudaLinearShape shape{op, DataType::kFloat8E4M3, 256, 64, 64};
        got[r] = CudaLinear::Create("test.refused", shape, knobs, group_->pool(r)).status();
        return Status::Ok();
      });
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (int r = 0; r < kTp; ++r) {
        EXPECT_EQ(got[r].code(), StatusCode::kFailedPrecondition) << got[r].ToString();
        EXPECT_NE(got[r].message().find("needs one process per GPU"), std::string::npos)
            << got[r].ToString();
      }
    }
  }
}
// Close (the orderly, collective teardown) is idempotent, and a closed layer
// refuses Prepare and Run instead of touching freed buffers. (With ranks as
// threads no layer has peer memory, so the unmap-barrier-free sequence itself
// runs in the process model: `tpserve layer --copy-engine`, the CUDA engine.)
TEST_F(GpuLinearTest, AClosedLayerRefusesPrepareAndRun) {
  const int64_t m = 256;
  auto p = MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, DataType::kFloat8E4M3, kTp, m, 64,
                                   64 * kTp, 5);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  LinearKnobs knobs;
  knobs.mode = OverlapMode::kRing;
  knobs.chunks = 2;
  std::vector<Status> prepare(kTp), run(kTp);
  const Status s = group_->Run([&](int r) -> Status {
    TP_ASSIGN_OR_RETURN(RankOperands ops, RankOperands::Upload(*p, r));
    TP_ASSIGN_OR_RETURN(auto layer, PreparedLayer("test.closed", *p, knobs, group_->pool(r)));
    TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
    TP_ASSIGN_OR_RETURN(DeviceBuffer dy,
                        DeviceBuffer::Allocate(layer->output_elements(m) * 2 + 16, "test.y"));
    TP_RETURN_IF_ERROR(
        layer->Run(m, ops.w.data(), ops.x_scale(), ops.w_scale(), dy.data(), stream.get()));
    TP_RETURN_IF_ERROR(group_->pool(r).base().WaitStream(stream.get()));
    TP_RETURN_IF_ERROR(layer->Close());
    TP_RETURN_IF_ERROR(layer->Close());
    prepare[r] = layer->Prepare(m);
    run[r] = layer->Run(m, ops.w.data(), ops.x_scale(), ops.w_scale(), dy.data(), stream.get());
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (int r = 0; r < kTp; ++r) {
    EXPECT_EQ(prepare[r].code(), StatusCode::kFailedPrecondition) << prepare[r].ToString();
    EXPECT_EQ(run[r].code(), StatusCode::kFailedPrecondition) << run[r].ToString();
    EXPECT_NE(run[r].message().find("test.closed is closed"), std::string::npos)
        << run[r].ToString();
  }
}

// A Run that cuBLASLt would refuse (an output not 16-byte aligned) is refused
// before anything is enqueued, naming the layer, and the layer then runs
// correctly: nothing half-done is left on the streams or with the peers.
TEST_F(GpuLinearTest, ARefusedRunEnqueuesNothingAndTheLayerStaysUsable) {
  const int64_t m = 1002, n = 64 * kTp, k = 128;
  auto p =
      MakeRandomLinearProblem(OverlapOp::kAllGatherGemm, DataType::kFloat8E4M3, kTp, m, n, k, 7);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (OverlapMode mode : {OverlapMode::kNone, OverlapMode::kRing}) {
    SCOPED_TRACE(OverlapModeName(mode));
    LinearKnobs knobs;
    knobs.mode = mode;
    knobs.chunks = mode == OverlapMode::kNone ? 1 : 2;
    std::vector<std::vector<BFloat16>> y(kTp);
    const Status s = group_->Run([&](int r) -> Status {
      TP_ASSIGN_OR_RETURN(RankOperands ops, RankOperands::Upload(*p, r));
      TP_ASSIGN_OR_RETURN(auto layer, PreparedLayer("test.misaligned", *p, knobs, group_->pool(r)));
      TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
      TP_CUDA_CHECK(cudaMemcpy(layer->input(m), p->x_local[r].data(), p->x_local[r].size(),
                               cudaMemcpyHostToDevice));
      const int64_t out = layer->output_elements(m);
      TP_ASSIGN_OR_RETURN(DeviceBuffer dy, DeviceBuffer::Allocate(out * 2 + 16, "test.y"));
      const Status refused = layer->Run(m, ops.w.data(), ops.x_scale(), ops.w_scale(),
                                        static_cast<char*>(dy.data()) + 2, stream.get());
      if (refused.code() != StatusCode::kInvalidArgument ||
          refused.message().find("layer 'test.misaligned'") == std::string::npos) {
        return InternalError("rank " + std::to_string(r) + ": the misaligned run gave " +
                             refused.ToString());
      }
      TP_RETURN_IF_ERROR(LaunchPoisonFill(dy.data(), DataType::kBFloat16, out, stream.get()));
      TP_RETURN_IF_ERROR(
          layer->Run(m, ops.w.data(), ops.x_scale(), ops.w_scale(), dy.data(), stream.get()));
      TP_RETURN_IF_ERROR(group_->pool(r).base().WaitStream(stream.get()));
      y[r].resize(out);
      TP_CUDA_CHECK(cudaMemcpy(y[r].data(), dy.data(), out * 2, cudaMemcpyDeviceToHost));
      return Status::Ok();
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
    auto err = CompareWithReference(*p, y);
    ASSERT_TRUE(err.ok()) << err.status().ToString();
    EXPECT_EQ(err->unwritten, 0);
    EXPECT_LE(err->rel_frobenius, kRelTol) << "max_abs " << err->max_abs;
  }
}

TEST_F(GpuLinearTest, AllGatherGemmRingGraphReplayIsBitIdenticalAndAllocationFree) {
  CheckGraphReplay(*group_, OverlapOp::kAllGatherGemm, OverlapMode::kRing, 2);
}
TEST_F(GpuLinearTest, GemmReduceScatterPipelineGraphReplayIsBitIdenticalAndAllocationFree) {
  CheckGraphReplay(*group_, OverlapOp::kGemmReduceScatter, OverlapMode::kPipeline, 4);
}
TEST_F(GpuLinearTest, GemmReduceScatterRingGraphReplayIsBitIdenticalAndAllocationFree) {
  CheckGraphReplay(*group_, OverlapOp::kGemmReduceScatter, OverlapMode::kRing, 2);
}

// A chunked layer on one GPU (TP = 1: each chunk one GEMM, no communication): the output matches
// the CPU reference within kRelTol, every element written; graph replays reproduce eager runs.
// Runs where only one GPU is present.
TEST(GpuLinearOneGpuTest, PipelineAtTpOneMatchesTheCpuReference) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto group = NcclThreadGroup::Create(1);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  for (OverlapOp op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
    for (int64_t m : {37, 4099}) {
      auto p = MakeRandomLinearProblem(op, DataType::kFloat8E4M3, 1, m, 96, 128,
                                       static_cast<uint32_t>(m));
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      SCOPED_TRACE(std::string(OverlapOpName(op)) + " m=" + std::to_string(m));
      LinearKnobs knobs;
      knobs.mode = OverlapMode::kPipeline;
      knobs.chunks = 4;
      auto y = RunOnGpus(**group, *p, knobs);
      ASSERT_TRUE(y.ok()) << y.status().ToString();
      auto err = CompareWithReference(*p, *y);
      ASSERT_TRUE(err.ok()) << err.status().ToString();
      EXPECT_EQ(err->unwritten, 0);
      EXPECT_LE(err->rel_frobenius, kRelTol) << "max_abs " << err->max_abs;
    }
  }
  CheckGraphReplay(**group, OverlapOp::kAllGatherGemm, OverlapMode::kRing, 4);
  CheckGraphReplay(**group, OverlapOp::kGemmReduceScatter, OverlapMode::kPipeline, 4);
}

// full_weight at TP = 1 (no peers, so no pulls: the chunks' whole-K GEMMs read the input
// where the caller wrote it): every chunk count's output matches the CPU reference within
// kRelTol, every element written; mode ring too (its lead's GEMM over the own column block,
// read at the weight's pitch from block 0, then the rest; m = 4099 gives a 2048- or 1024-row
// lead, m = 37 an unrounded one, m = 1 none). The pulls and the lead's accumulating GEMMs need
// one process per GPU and are checked by `tpserve layer --full-weight`
// (GpuLayerProcessesTest).
TEST(GpuLinearOneGpuTest, FullWeightAtTpOneMatchesTheCpuReference) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto group = NcclThreadGroup::Create(1);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  for (DataType dtype : {DataType::kFloat8E4M3, DataType::kBFloat16}) {
    for (int64_t m : {1, 37, 4099}) {
      auto p = MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, dtype, 1, m, 96, 128,
                                       static_cast<uint32_t>(m));
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      for (auto [mode, chunks] : {std::pair{OverlapMode::kNone, 1},
                                  {OverlapMode::kPipeline, 4},
                                  {OverlapMode::kRing, 1},
                                  {OverlapMode::kRing, 2}}) {
        SCOPED_TRACE(std::string(DataTypeName(dtype)) + " m=" + std::to_string(m) + " mode " +
                     std::string(OverlapModeName(mode)) + " chunks=" + std::to_string(chunks));
        LinearKnobs knobs;
        knobs.mode = mode;
        knobs.chunks = chunks;
        knobs.copy_engine = true;
        knobs.full_weight = true;
        auto y = RunOnGpus(**group, *p, knobs);
        ASSERT_TRUE(y.ok()) << y.status().ToString();
        auto err = CompareWithReference(*p, *y);
        ASSERT_TRUE(err.ok()) << err.status().ToString();
        EXPECT_EQ(err->unwritten, 0);
        EXPECT_LE(err->rel_frobenius, kRelTol) << "max_abs " << err->max_abs;
      }
    }
  }
}

// CudaLinearShape::accumulate at TP = 1 (the model's residual add in the GEMM's epilogue): a
// gemm_rs layer run into a y holding y0 leaves bf16(y0 + X W^T), the sum in FP32 rounded once:
// within two BF16 roundings of y0 plus the plain layer's output, element by element, in FP8 and
// BF16, mode none and four chunks, eagerly and from a graph replay (the same bits). An AllGather
// layer that asks for it is refused.
TEST(GpuLinearOneGpuTest, AccumulateAddsTheProductIntoY) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto group = NcclThreadGroup::Create(1);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  NcclCommPool& pool = (*group)->pool(0);
  for (DataType dtype : {DataType::kFloat8E4M3, DataType::kBFloat16}) {
    for (auto [mode, chunks] : {std::pair{OverlapMode::kNone, 1}, {OverlapMode::kPipeline, 4}}) {
      const int64_t m = 4099;
      auto p = MakeRandomLinearProblem(OverlapOp::kGemmReduceScatter, dtype, 1, m, 96, 128, 7);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      SCOPED_TRACE(std::string(DataTypeName(dtype)) + " chunks " + std::to_string(chunks));
      LinearKnobs knobs;
      knobs.mode = mode;
      knobs.chunks = chunks;
      auto ops = RankOperands::Upload(*p, 0);
      ASSERT_TRUE(ops.ok()) << ops.status().ToString();
      auto plain = PreparedLayer("test.plain", *p, knobs, pool);
      ASSERT_TRUE(plain.ok()) << plain.status().ToString();
      CudaLinearShape shape{p->op, p->dtype, p->m, p->n_local(), p->k_local()};
      shape.accumulate = true;
      auto acc = CudaLinear::Create("test.accumulate", shape, knobs, pool);
      ASSERT_TRUE(acc.ok()) << acc.status().ToString();
      ASSERT_TRUE((*acc)->Prepare(m).ok());
      auto stream = CudaStream::Create();
      ASSERT_TRUE(stream.ok());
      const int64_t out = m * p->n;
      std::vector<BFloat16> y0(out);
      for (int64_t i = 0; i < out; ++i) {
        y0[i] = FloatToBFloat16(static_cast<float>((i * 7919) % 2001 - 1000) / 250.0f);
      }
      auto dy = DeviceBuffer::Allocate(out * 2, "test.y");
      auto dy0 = DeviceBuffer::Allocate(out * 2, "test.y0");
      auto dplain = DeviceBuffer::Allocate(out * 2, "test.plain_y");
      ASSERT_TRUE(dy.ok() && dy0.ok() && dplain.ok());
      ASSERT_EQ(cudaMemcpy(dy0->data(), y0.data(), out * 2, cudaMemcpyHostToDevice), cudaSuccess);
      for (CudaLinear* layer : {plain->get(), acc->get()}) {
        ASSERT_EQ(cudaMemcpy(layer->input(m), p->x_local[0].data(), p->x_local[0].size(),
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      auto run_both = [&]() -> Status {
        TP_CUDA_CHECK(cudaMemcpyAsync(dy->data(), dy0->data(), out * 2, cudaMemcpyDeviceToDevice,
                                      stream->get()));
        TP_RETURN_IF_ERROR((*plain)->Run(m, ops->w.data(), ops->x_scale(), ops->w_scale(),
                                         dplain->data(), stream->get()));
        return (*acc)->Run(m, ops->w.data(), ops->x_scale(), ops->w_scale(), dy->data(),
                           stream->get());
      };
      ASSERT_TRUE(run_both().ok());
      std::vector<BFloat16> got(out), product(out), replayed(out);
      ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(got.data(), dy->data(), out * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(product.data(), dplain->data(), out * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      int64_t off = 0;
      for (int64_t i = 0; i < out; ++i) {
        const double a = BFloat16ToFloat(y0[i]), b = BFloat16ToFloat(product[i]);
        const double bound = (std::abs(a) + 2 * std::abs(b)) * std::ldexp(1.0, -8) + 1e-30;
        off += !(std::abs(BFloat16ToFloat(got[i]) - (a + b)) <= bound);
      }
      EXPECT_EQ(off, 0) << "of " << out << " elements";
      // A graph of the same runs gives the same bits.
      auto graph =
          CudaGraphExec::Capture(stream->get(), cudaStreamCaptureModeThreadLocal, run_both);
      ASSERT_TRUE(graph.ok()) << graph.status().ToString();
      ASSERT_TRUE(graph->Launch(stream->get()).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(replayed.data(), dy->data(), out * 2, cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(std::memcmp(replayed.data(), got.data(), out * 2), 0);
    }
  }
  CudaLinearShape ag{OverlapOp::kAllGatherGemm, DataType::kFloat8E4M3, 64, 96, 128};
  ag.accumulate = true;
  auto refused = CudaLinear::Create("test.ag", ag, LinearKnobs{}, pool);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(refused.status().message().find("test.ag"), std::string::npos);
}

// RunSwiGlu (a gate_up layer with SwiGLU in its small-M GEMM's epilogue) against Run and then
// the SwiGLU pass with the same static E4M3 scale: the same codes at 1 and 8 rows, the layer
// reading its input where the caller wrote it (input(m)). Where the layer for m is not one
// small-M GEMM (9 rows, BF16, four chunks) CanRunSwiGlu is false and RunSwiGlu refused.
TEST(GpuLinearOneGpuTest, RunSwiGluEqualsRunThenTheSwiGluPass) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "needs a GPU";
  auto group = NcclThreadGroup::Create(1);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  NcclCommPool& pool = (*group)->pool(0);
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  const float scale_value = 0.01f;
  auto scale = DeviceBuffer::Allocate(sizeof(float), "test.scale");
  ASSERT_TRUE(scale.ok());
  ASSERT_EQ(cudaMemcpy(scale->data(), &scale_value, sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  for (int64_t m : {1, 8, 9}) {
    const int64_t n = 1040, k = 512, inter = n / 2;
    auto p = MakeRandomLinearProblem(OverlapOp::kAllGatherGemm, DataType::kFloat8E4M3, 1, m, n, k,
                                     static_cast<uint32_t>(m + 3));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    SCOPED_TRACE("m=" + std::to_string(m));
    auto ops = RankOperands::Upload(*p, 0);
    ASSERT_TRUE(ops.ok()) << ops.status().ToString();
    auto layer = PreparedLayer("test.gate_up", *p, LinearKnobs{}, pool);
    ASSERT_TRUE(layer.ok()) << layer.status().ToString();
    ASSERT_EQ(cudaMemcpy((*layer)->input(m), p->x_local[0].data(), p->x_local[0].size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    auto got = DeviceBuffer::Allocate(m * inter, "test.got");
    ASSERT_TRUE(got.ok());
    if (m > 8) {
      EXPECT_FALSE((*layer)->CanRunSwiGlu(m));
      const Status st = (*layer)->RunSwiGlu(m, ops->w.data(), ops->x_scale(), ops->w_scale(),
                                            got->as<uint8_t>(), scale->as<float>(), stream->get());
      EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
      continue;
    }
    ASSERT_TRUE((*layer)->CanRunSwiGlu(m));
    auto y = DeviceBuffer::Allocate(m * n * 2, "test.y");
    auto want = DeviceBuffer::Allocate(m * inter, "test.want");
    ASSERT_TRUE(y.ok() && want.ok());
    ASSERT_TRUE(
        (*layer)
            ->Run(m, ops->w.data(), ops->x_scale(), ops->w_scale(), y->data(), stream->get())
            .ok());
    SwiGluParams sw;
    sw.gate_up = y->as<BFloat16>();
    sw.out_fp8 = want->as<uint8_t>();
    sw.out_fp8_scale = scale->as<float>();
    sw.rows = m;
    sw.inter = inter;
    ASSERT_TRUE(LaunchSwiGlu(sw, stream->get()).ok());
    const Status fused = (*layer)->RunSwiGlu(m, ops->w.data(), ops->x_scale(), ops->w_scale(),
                                             got->as<uint8_t>(), scale->as<float>(), stream->get());
    ASSERT_TRUE(fused.ok()) << fused.ToString();
    ASSERT_EQ(cudaStreamSynchronize(stream->get()), cudaSuccess);
    std::vector<uint8_t> a(m * inter), b(m * inter);
    ASSERT_EQ(cudaMemcpy(a.data(), want->data(), a.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b.data(), got->data(), b.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t differ = 0, nonzero = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      differ += a[i] != b[i];
      nonzero += (a[i] & 0x7F) != 0;
    }
    EXPECT_EQ(differ, 0) << "of " << a.size() << " codes";
    EXPECT_GT(nonzero, static_cast<int64_t>(a.size() / 2)) << "a weak case: mostly zero codes";
  }
  // BF16, and FP8 in four chunks: the layer is not one small-M GEMM.
  auto bf16 =
      MakeRandomLinearProblem(OverlapOp::kAllGatherGemm, DataType::kBFloat16, 1, 4, 64, 128, 5);
  ASSERT_TRUE(bf16.ok());
  auto bf16_layer = PreparedLayer("test.bf16", *bf16, LinearKnobs{}, pool);
  ASSERT_TRUE(bf16_layer.ok()) << bf16_layer.status().ToString();
  EXPECT_FALSE((*bf16_layer)->CanRunSwiGlu(4));
  auto fp8 =
      MakeRandomLinearProblem(OverlapOp::kAllGatherGemm, DataType::kFloat8E4M3, 1, 8, 64, 128, 6);
  ASSERT_TRUE(fp8.ok());
  LinearKnobs chunked;
  chunked.mode = OverlapMode::kPipeline;
  chunked.chunks = 4;
  auto chunked_layer = PreparedLayer("test.chunks", *fp8, chunked, pool);
  ASSERT_TRUE(chunked_layer.ok()) << chunked_layer.status().ToString();
  EXPECT_FALSE((*chunked_layer)->CanRunSwiGlu(8));
}

}  // namespace
}  // namespace tpserve
