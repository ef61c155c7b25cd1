#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/nccl_bootstrap.h"
#include "comm/nccl_communicator.h"
#include "layers/cuda_linear.h"
#include "layers/linear_problem.h"
#include "layers/quantize_kernels.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_layer.h"

namespace tpserve {
namespace {

struct RankResult {
  LinearError err;
  float median_ms = 0;
  // After the timed replays: kCheckedReplays replays into a poisoned output,
  // the input alternating between X and X with its rows reversed, each
  // compared bit for bit with the eager run of the same input. A transfer
  // that a replay skips or reads too early (stale rows of the other input)
  // shows as a difference.
  bool replay_identical = false;
};

constexpr int kCheckedReplays = 10;

// One rank's whole run: communicator, layer, check, timed graph replays.
StatusOr<RankResult> RunRank(const LayerFlags& f, const RankInfo& who, const ncclUniqueId& id) {
  SetCurrentRank(who.rank);
  TP_ASSIGN_OR_RETURN(OverlapOp op, ParseOverlapOp(f.op));
  TP_ASSIGN_OR_RETURN(OverlapMode mode, ParseOverlapMode(f.mode));
  LinearKnobs knobs;
  knobs.mode = mode;
  knobs.chunks = f.chunks;
  knobs.comm.max_ctas = f.max_ctas;
  TP_ASSIGN_OR_RETURN(knobs.comm.cta_policy, ParseCtaPolicy(f.cta_policy));
  knobs.copy_engine = f.copy_engine;
  knobs.in_place = f.in_place;
  knobs.full_weight = f.full_weight;
  const DataType dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  const Fp8Scheme scheme = ParseFp8Scheme(f.fp8_scheme).value_or(Fp8Scheme::kPerTensor);

  spdlog::info("rank {}/{}: preparing operands and the CPU reference", who.rank, f.tp);
  TP_ASSIGN_OR_RETURN(LinearProblem p,
                      MakeRandomLinearProblem(op, dtype, f.tp, f.m, f.n, f.k, f.seed, scheme));
  TP_ASSIGN_OR_RETURN(auto base,
                      NcclCommunicator::Create(id, f.tp, who.rank, who.local_rank, NcclCommConfig{},
                                               std::chrono::seconds(120)));
  NcclCommPool pool(std::move(base));
  TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  cudaStream_t st = stream.get();
  const int r = who.rank;
  CudaLinearShape shape{op, dtype, f.m, p.n_local(), p.k_local(), GemmScaleSchemeOf(scheme)};
  CudaLinearOptions lo;
  lo.gemm_algo = GemmAlgoFromFlag(f.gemm_algo);
  TP_ASSIGN_OR_RETURN(auto layer, CudaLinear::Create("cli.layer", shape, knobs, pool, lo));
  TP_RETURN_IF_ERROR(layer->Prepare(f.m));
  // full_weight: the whole weight W [n, k] (GEMM+RS splits it on k), every rank the same.
  const std::vector<uint8_t>& w_host = f.full_weight ? p.w : p.w_local[r];
  TP_ASSIGN_OR_RETURN(DeviceBuffer w, DeviceBuffer::Allocate(w_host.size(), "cli.w"));
  TP_CUDA_CHECK(
      cudaMemcpyAsync(w.data(), w_host.data(), w_host.size(), cudaMemcpyHostToDevice, st));
  // The two scales 16 bytes apart: cuBLASLt wants them 16-byte aligned.
  TP_ASSIGN_OR_RETURN(DeviceBuffer scales, DeviceBuffer::Allocate(8 * sizeof(float), "scales"));
  const float sc[8] = {p.x_scale, 0, 0, 0, p.w_scale, 0, 0, 0};
  TP_CUDA_CHECK(cudaMemcpyAsync(scales.data(), sc, sizeof sc, cudaMemcpyHostToDevice, st));
  // A finer scheme's scales as the layer takes them (CudaLinearShape::scale_scheme).
  DeviceBuffer fine_x, fine_w;
  std::vector<float> fine_x_host, fine_w_host;  // alive until the copies below have run
  if (scheme != Fp8Scheme::kPerTensor) {
    fine_x_host = p.x_scales_local[r];
    fine_w_host = p.w_scales_local[r];
    if (scheme == Fp8Scheme::kBlock) {  // x [rows][groups] -> [groups][rows]; w rows padded
      const int64_t groups = p.k_local() / kFp8BlockSize;
      const int64_t rows = static_cast<int64_t>(fine_x_host.size()) / groups;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t g = 0; g < groups; ++g) {
          fine_x_host[g * rows + i] = p.x_scales_local[r][i * groups + g];
        }
      }
      fine_w_host = BlockwiseWeightScalesForGemm(p.w_scales_local[r], p.n_local(), p.k_local());
    }
    TP_ASSIGN_OR_RETURN(fine_x, DeviceBuffer::Allocate(std::max<size_t>(fine_x_host.size(), 4) * 4,
                                                       "cli.x_scales"));
    TP_ASSIGN_OR_RETURN(fine_w, DeviceBuffer::Allocate(fine_w_host.size() * 4, "cli.w_scales"));
    TP_CUDA_CHECK(cudaMemcpyAsync(fine_x.data(), fine_x_host.data(), fine_x_host.size() * 4,
                                  cudaMemcpyHostToDevice, st));
    TP_CUDA_CHECK(cudaMemcpyAsync(fine_w.data(), fine_w_host.data(), fine_w_host.size() * 4,
                                  cudaMemcpyHostToDevice, st));
  }
  // Host-to-device copies on `st`, the stream the layer runs on: a cudaMemcpy
  // from pageable memory may return before its DMA lands, and `st` is
  // non-blocking.
  TP_CUDA_CHECK(cudaMemcpyAsync(layer->input(f.m), p.x_local[r].data(), p.x_local[r].size(),
                                cudaMemcpyHostToDevice, st));
  const int64_t out = layer->output_elements(f.m);
  TP_ASSIGN_OR_RETURN(DeviceBuffer y, DeviceBuffer::Allocate(std::max<int64_t>(out, 1) * 2, "y"));
  TP_RETURN_IF_ERROR(LaunchPoisonFill(y.data(), DataType::kBFloat16, out, st));
  CudaLinear::SplitOutput split;
  auto run = [&] {
    const bool fine = scheme != Fp8Scheme::kPerTensor;
    const float* x_scale = fine ? fine_x.as<float>() : scales.as<float>();
    const float* w_scale = fine ? fine_w.as<float>() : scales.as<float>() + 4;
    if (f.split_output) {
      return layer->RunSplit(f.m, w.data(), x_scale, w_scale, y.data(), st, &split);
    }
    return layer->Run(f.m, w.data(), x_scale, w_scale, y.data(), st);
  };
  // This rank's output after a run: y, or with --split-output the sum of the
  // two addends that RunSplit left, as a consumer adds them.
  auto fetch = [&](std::vector<BFloat16>* dst) -> Status {
    dst->resize(out);
    if (split.second == nullptr) {
      TP_CUDA_CHECK(cudaMemcpy(dst->data(), y.data(), out * 2, cudaMemcpyDeviceToHost));
      return Status::Ok();
    }
    std::vector<BFloat16> second(out);
    TP_CUDA_CHECK(cudaMemcpy(dst->data(), split.first, out * 2, cudaMemcpyDeviceToHost));
    TP_CUDA_CHECK(cudaMemcpy(second.data(), split.second, out * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < out; ++i) {
      (*dst)[i] = FloatToBFloat16(BFloat16ToFloat((*dst)[i]) + BFloat16ToFloat(second[i]));
    }
    return Status::Ok();
  };
  TP_RETURN_IF_ERROR(run());
  NcclCommunicator& comm = pool.base();
  TP_RETURN_IF_ERROR(comm.WaitStream(st));
  if (f.split_output) {
    spdlog::info("rank {}: --split-output: {}", r,
                 split.second != nullptr ? "two addends, summed by the check"
                                         : "the plan has no sum step of its own; y as usual");
  }
  std::vector<BFloat16> host;
  TP_RETURN_IF_ERROR(fetch(&host));
  RankResult res;
  TP_ASSIGN_OR_RETURN(res.err, CompareRankWithReference(p, r, host));

  // The second input: this rank's X with its rows in reverse order, and the
  // eager output for it (the expectation of the alternating replays below).
  const std::vector<uint8_t>& x1 = p.x_local[r];
  const size_t row_bytes = static_cast<size_t>(p.k_local()) * DataTypeSize(dtype);
  const size_t rows = row_bytes > 0 ? x1.size() / row_bytes : 0;
  std::vector<uint8_t> x2(x1.size());
  for (size_t i = 0; i < rows; ++i) {
    std::copy_n(x1.begin() + static_cast<std::ptrdiff_t>((rows - 1 - i) * row_bytes), row_bytes,
                x2.begin() + static_cast<std::ptrdiff_t>(i * row_bytes));
  }
  auto set_input = [&](const std::vector<uint8_t>& x) -> Status {
    TP_CUDA_CHECK(
        cudaMemcpyAsync(layer->input(f.m), x.data(), x.size(), cudaMemcpyHostToDevice, st));
    return LaunchPoisonFill(y.data(), DataType::kBFloat16, out, st);
  };
  TP_RETURN_IF_ERROR(set_input(x2));
  TP_RETURN_IF_ERROR(run());
  TP_RETURN_IF_ERROR(comm.WaitStream(st));
  std::vector<BFloat16> host2;
  TP_RETURN_IF_ERROR(fetch(&host2));
  TP_RETURN_IF_ERROR(set_input(x1));

  TP_ASSIGN_OR_RETURN(CudaGraphExec graph,
                      CudaGraphExec::Capture(st, cudaStreamCaptureModeThreadLocal, run));
  std::vector<float> times;
  TP_ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::Create(true));
  TP_ASSIGN_OR_RETURN(CudaEvent stop, CudaEvent::Create(true));
  for (int i = 0; i < f.iters; ++i) {
    TP_RETURN_IF_ERROR(start.Record(st));
    TP_RETURN_IF_ERROR(graph.Launch(st));
    TP_RETURN_IF_ERROR(stop.Record(st));
    TP_RETURN_IF_ERROR(comm.WaitStream(st));
    TP_ASSIGN_OR_RETURN(float ms, CudaEvent::ElapsedMs(start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  res.median_ms = times[times.size() / 2];
  res.replay_identical = true;
  std::vector<BFloat16> replayed;
  for (int i = 0; i < kCheckedReplays; ++i) {
    const bool second = i % 2 == 0;  // the first checked replay changes the input
    TP_RETURN_IF_ERROR(set_input(second ? x2 : x1));
    TP_RETURN_IF_ERROR(graph.Launch(st));
    TP_RETURN_IF_ERROR(comm.WaitStream(st));
    TP_RETURN_IF_ERROR(fetch(&replayed));
    const std::vector<BFloat16>& want = second ? host2 : host;
    if (!std::equal(replayed.begin(), replayed.end(), want.begin(),
                    [](BFloat16 a, BFloat16 b) { return a.bits == b.bits; })) {
      spdlog::error("rank {}: checked replay {} ({} input) differs from the eager run", r, i,
                    second ? "row-reversed" : "original");
      res.replay_identical = false;
    }
  }
  graph = CudaGraphExec();  // graphs before the layer and its communicators
  TP_RETURN_IF_ERROR(layer->Close());
  TP_RETURN_IF_ERROR(comm.Barrier());
  return res;
}

}  // namespace

int RunLayerCuda(const LayerFlags& f, const std::vector<std::string>& argv) {
  RankInfo who;
  ncclUniqueId id{};
  std::vector<pid_t> workers;
  auto env_rank = RankInfoFromEnv();
  if (env_rank.ok()) {
    who = *env_rank;
    if (who.world_size != f.tp) {
      spdlog::error("rank {}: the launcher says {} ranks but --tp is {}", who.rank, who.world_size,
                    f.tp);
      return 2;
    }
    auto env_id = UniqueIdFromEnv();
    if (!env_id.ok()) {
      spdlog::error("rank {}: {}", who.rank, env_id.status().ToString());
      return 2;
    }
    id = *env_id;
  } else if (env_rank.status().code() == StatusCode::kNotFound) {
    // The leader: rank 0, starts the other ranks on this node.
    who.rank = 0;
    who.world_size = f.tp;
    who.local_rank = 0;
    if (ncclGetUniqueId(&id) != ncclSuccess) {
      spdlog::error("ncclGetUniqueId failed");
      return 1;
    }
    std::vector<std::string> child_argv = argv;
    child_argv[0] = "/proc/self/exe";
    auto pids = SpawnLocalWorkers(child_argv, f.tp, id);
    if (!pids.ok()) {
      spdlog::error("{}", pids.status().ToString());
      return 1;
    }
    workers = *pids;
    spdlog::info("rank 0 started {} worker process(es)", workers.size());
  } else {
    spdlog::error("{}", env_rank.status().ToString());
    return 2;
  }

  auto res = RunRank(f, who, id);
  bool pass = res.ok() && res->err.unwritten == 0 && res->err.rel_frobenius <= f.tolerance &&
              res->replay_identical;
  if (!res.ok()) {
    spdlog::error("rank {}: {}", who.rank, res.status().ToString());
  } else {
    std::printf(
        "rank %d/%d %s %s %s m=%lld n=%lld k=%lld chunks=%d backend=cuda: graph replay median "
        "%.4f ms over %d; vs CPU reference: rel_frobenius=%.3g max_abs=%.3g unwritten=%lld; "
        "%d graph replays, two inputs alternating, vs eager: %s -> %s (tolerance %.g)\n",
        who.rank, f.tp, f.op.c_str(), f.mode.c_str(),
        (f.dtype + (f.fp8_scheme == "tensor" ? "" : "/" + f.fp8_scheme)).c_str(),
        static_cast<long long>(f.m), static_cast<long long>(f.n), static_cast<long long>(f.k),
        f.chunks, res->median_ms, f.iters, res->err.rel_frobenius, res->err.max_abs,
        static_cast<long long>(res->err.unwritten), kCheckedReplays,
        res->replay_identical ? "bit-identical" : "DIFFERS", pass ? "PASS" : "FAIL", f.tolerance);
    std::fflush(stdout);
  }
  if (!res.ok()) {
    // The workers would wait for this rank until their NCCL deadline.
    for (pid_t pid : workers) kill(pid, SIGTERM);
  }
  if (!workers.empty()) {
    const Status reaped = ReapWorkers(workers, std::chrono::seconds(180));
    if (!reaped.ok()) {
      spdlog::error("{}", reaped.ToString());
      pass = false;
    }
  }
  return pass ? 0 : 1;
}

}  // namespace tpserve
