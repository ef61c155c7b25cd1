// `tpserve layer`: runs one TP linear layer on random data through an
// executor, checks it against the unsharded reference and reports timing.
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "layers/linear_problem.h"
#include "server/cli.h"
#include "server/cli_cuda_only.h"
#include "server/cli_gemm_algo.h"
#include "server/cli_layer.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

// `given_cuda_only`: the cuda-only flags (CudaOnly) on the command line.
int RunLayer(LayerFlags f, const std::vector<std::string>& argv,
             const std::vector<std::string>& given_cuda_only) {
  std::string e = CudaOnlyFlagsError(f.backend, given_cuda_only, /*offers_auto=*/false);
  if (e.empty()) e = ChunksForMode(f.mode == "none", f.chunks_given, &f.chunks);
  if (e.empty() && f.split_output && f.op != "gemm_rs") {
    e = "--split-output applies to --op gemm_rs only (an AllGather+GEMM has no sum to leave)";
  }
  if (e.empty() && f.in_place && (f.op != "gemm_rs" || f.mode != "ring" || !f.copy_engine)) {
    e = "--in-place applies to --op gemm_rs --mode ring --copy-engine (got --op " + f.op +
        " --mode " + f.mode + (f.copy_engine ? " --copy-engine" : "") + ")";
  }
  if (e.empty() && f.full_weight && (f.op != "gemm_rs" || !f.copy_engine)) {
    e = "--full-weight applies to --op gemm_rs --copy-engine (got --op " + f.op + " --mode " +
        f.mode + (f.copy_engine ? " --copy-engine" : "") + ")";
  }
  if (e.empty() && f.full_weight && f.in_place) {
    e = "--full-weight and --in-place do not combine (the peers pull this rank's input, which "
        "must not be rewritten before they are done; --in-place lets a run return before that)";
  }
  if (!e.empty()) {
    std::fprintf(stderr, "error: %s\n", e.c_str());
    return 2;
  }
  if (f.backend == "cuda") {
#if TPSERVE_WITH_CUDA
    return RunLayerCuda(f, argv);
#else
    (void)argv;
    std::fprintf(stderr, "error: --backend cuda: this build has no CUDA backend\n");
    return 2;
#endif
  }
  auto op = ParseOverlapOp(f.op);
  auto mode = ParseOverlapMode(f.mode);
  if (!op.ok() || !mode.ok()) {
    std::fprintf(stderr, "error: %s\n", (!op.ok() ? op.status() : mode.status()).message().c_str());
    return 2;
  }
  const DataType dtype = f.dtype == "bf16" ? DataType::kBFloat16 : DataType::kFloat8E4M3;
  spdlog::info("layer {} mode={} dtype={} tp={} m={} n={} k={} chunks={}: preparing operands", f.op,
               f.mode, f.dtype, f.tp, f.m, f.n, f.k, f.chunks);
  const Fp8Scheme scheme = ParseFp8Scheme(f.fp8_scheme).value_or(Fp8Scheme::kPerTensor);
  auto problem = MakeRandomLinearProblem(*op, dtype, f.tp, f.m, f.n, f.k, f.seed, scheme);
  if (!problem.ok()) {
    std::fprintf(stderr, "error: %s\n", problem.status().message().c_str());
    return 2;
  }
  double best_ms = 1e300;
  StatusOr<std::vector<std::vector<BFloat16>>> y = InternalError("no iteration ran");
  for (int it = 0; it < f.iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    y = RunCpuLinearGroup(*problem, *mode, f.chunks);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!y.ok()) {
      std::fprintf(stderr, "error: %s\n", y.status().ToString().c_str());
      return 1;
    }
    best_ms = std::min(best_ms, ms);
    spdlog::info("iteration {}/{}: {:.3f} ms", it + 1, f.iters, ms);
  }
  auto err = CompareWithReference(*problem, *y);
  if (!err.ok()) {
    std::fprintf(stderr, "error: %s\n", err.status().message().c_str());
    return 1;
  }
  const bool pass = err->unwritten == 0 && err->rel_frobenius <= f.tolerance;
  std::printf(
      "%s %s %s tp=%d m=%lld n=%lld k=%lld chunks=%d backend=%s: best %.3f ms; vs reference: "
      "rel_frobenius=%.3g max_abs=%.3g differing=%lld unwritten=%lld -> %s (tolerance %g)\n",
      f.op.c_str(), f.mode.c_str(),
      (f.dtype + (scheme == Fp8Scheme::kPerTensor ? "" : "/" + f.fp8_scheme)).c_str(), f.tp,
      static_cast<long long>(f.m), static_cast<long long>(f.n), static_cast<long long>(f.k),
      f.chunks, f.backend.c_str(), best_ms, err->rel_frobenius, err->max_abs,
      static_cast<long long>(err->differing), static_cast<long long>(err->unwritten),
      pass ? "PASS" : "FAIL", f.tolerance);
  return pass ? 0 : 1;
}

}  // namespace

void AddLayerCommand(CLI::App& app, int* exit_code, const std::vector<std::string>& argv) {
  auto f = std::make_shared<LayerFlags>();
  CLI::App* cmd = app.add_subcommand(
      "layer",
      "Run one TP linear layer (AllGather+GEMM or GEMM+ReduceScatter) on random data, check it "
      "against the unsharded reference GEMM and print the timing");
  cmd->add_option("--backend", f->backend,
                  "Executor: cpu (ranks are threads, FP8 emulated) or cuda (one process per GPU: "
                  "this process is rank 0 and starts the others)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--op", f->op, "ag_gemm (column-parallel) or gemm_rs (row-parallel)")
      ->check(CLI::IsMember({"ag_gemm", "gemm_rs"}))
      ->capture_default_str();
  cmd->add_option("--mode", f->mode, "Overlap mode: none, pipeline or ring")
      ->check(CLI::IsMember({"none", "pipeline", "ring"}))
      ->capture_default_str();
  cmd->add_option("--dtype", f->dtype, "Operand type: fp8 (E4M3) or bf16")
      ->check(CLI::IsMember({"fp8", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--fp8-scheme", f->fp8_scheme,
                  "FP8 scale layout: tensor (one scale per tensor), channel (a scale per row of "
                  "X and of W: per token and per output channel) or block (per 1x128 group of X "
                  "and 128x128 block of W; each rank's n and k whole 128s). Every row, group or "
                  "block draws its own scale, so a row read with another's scale fails the check")
      ->check(CLI::IsMember({"tensor", "channel", "block"}))
      ->capture_default_str();
  cmd->add_option("--tp", f->tp, "Tensor-parallel size")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--m", f->m, "Global rows (tokens)")->check(Positive())->capture_default_str();
  cmd->add_option("--n", f->n, "Global output features (ag_gemm: split over ranks)")
      ->check(Positive())
      ->capture_default_str();
  cmd->add_option("--k", f->k, "Global input features (gemm_rs: split over ranks)")
      ->check(Positive())
      ->capture_default_str();
  CLI::Option* chunks = AddChunksOption(cmd, &f->chunks);
  cmd->add_option("--seed", f->seed, "Random seed of the operands")->capture_default_str();
  cmd->add_option("--iters", f->iters,
                  "Timed iterations (cpu: the best is reported; cuda: the median graph replay, "
                  "then 10 replays with the input alternating between two tensors, each "
                  "checked bit for bit against the eager run of its input)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cmd->add_option("--tolerance", f->tolerance,
                  "Largest relative Frobenius error vs the reference that passes (>= 0)")
      ->check(NonNegative())
      ->capture_default_str();
  // The flags only the cuda backend reads (CudaOnly), for the callback.
  auto cuda_only = std::make_shared<std::vector<const CLI::Option*>>();
  CudaOnly(cmd->add_option("--max-ctas", f->max_ctas,
                           "NCCL max CTAs of the layer's communicator (0 = NCCL's default)")
               ->check(CLI::Range(0, 64))
               ->capture_default_str(),
           cuda_only.get());
  CudaOnly(cmd->add_option("--cta-policy", f->cta_policy,
                           "NCCL CTA policy of the layer's communicator: default, efficiency, zero")
               ->check(CLI::IsMember({"default", "efficiency", "zero"}))
               ->capture_default_str(),
           cuda_only.get());
  CudaOnly(cmd->add_flag("--copy-engine", f->copy_engine,
                         "move data with copy engines (peers pull from CUDA-IPC-mapped buffers; "
                         "no SMs): any op and mode; all ranks on one node"),
           cuda_only.get());
  CudaOnly(cmd->add_flag("--split-output", f->split_output,
                         "gemm_rs: run the layer as the engine runs o and down (RunSplit): a "
                         "plan that ends in a sum step of its own (ring, --chunks 1, "
                         "--copy-engine) leaves that addition to the consumer, here the check, "
                         "which adds the two addends (FP32 sum rounded to BF16) before comparing; "
                         "other plans write their output as usual"),
           cuda_only.get());
  CudaOnly(cmd->add_flag("--in-place", f->in_place,
                         "gemm_rs, mode ring, --copy-engine: each accumulating GEMM reads the "
                         "running sum in the peer's memory over NVLink instead of a copy-engine "
                         "pull (no copy; with --chunks 1 no separate sum either)"),
           cuda_only.get());
  CudaOnly(cmd->add_flag("--full-weight", f->full_weight,
                         "gemm_rs, --copy-engine: every rank holds the whole weight and pulls "
                         "the peers' input columns of its own rows, then computes them over the "
                         "whole K (no partial sums; tp x the weight memory). With --mode ring a "
                         "lead of rows / (2 * chunks) rows starts on the own columns at once "
                         "and adds the peers' blocks as they arrive"),
           cuda_only.get());
  AddGemmAlgoFlag(cmd, &f->gemm_algo);
  CudaOnly(cmd->get_option("--gemm-algo"), cuda_only.get());
  cmd->callback([f, exit_code, argv, chunks, cuda_only] {
    f->chunks_given = chunks->count() > 0;
    *exit_code = RunLayer(*f, argv, GivenFlags(*cuda_only));
  });
}

}  // namespace tpserve
