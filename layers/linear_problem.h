// A whole TP linear-layer problem with random operands: the global X and W,
// each rank's slices as the layers take them, and the unsharded reference
// output. Shared by tests, `tpserve layer` and the GPU benchmarks so that
// every executor is checked against the same truth.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/dtype.h"
#include "comm/status.h"
#include "layers/cpu_linear.h"
#include "layers/overlap_plan.h"

namespace tpserve {

struct LinearProblem {
  OverlapOp op = OverlapOp::kAllGatherGemm;
  DataType dtype = DataType::kFloat8E4M3;
  int tp = 1;
  int64_t m = 0, n = 0, k = 0;  // global: Y[m,n] = X[m,k] · W[n,k]^T
  float x_scale = 1.0f, w_scale = 1.0f;
  // FP8 scales of a finer scheme (kPerTensor: x_scale and w_scale above), laid out as
  // CpuLinearArgs takes them: x per row ([m] per channel's per-token scales, [m][k / 128] per
  // 1x128 group, row-major), w per scheme over the whole [n, k]; and each rank's share of them,
  // for the rows and columns x_local and w_local hold. A GEMM+RS rank's K slice keeps its
  // row's per-token scale (every slice of a row quantized with the one scale).
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  std::vector<float> x_scales, w_scales;
  std::vector<std::vector<float>> x_scales_local, w_scales_local;
  std::vector<uint8_t> x, w;  // raw elements of dtype, row-major
  // Per rank: AG+GEMM: x = shard rows of X, w = rows [r*n/tp, ...) of W.
  //           GEMM+RS: x = X[:, k slice], w = W[:, k slice].
  std::vector<std::vector<uint8_t>> x_local, w_local;
  std::vector<BFloat16> reference;  // [m, n]

  int64_t n_local() const { return op == OverlapOp::kAllGatherGemm ? n / tp : n; }
  int64_t k_local() const { return op == OverlapOp::kAllGatherGemm ? k : k / tp; }
  // Elements of rank r's output: AG [m, n/tp]; RS [shard rows, n].
  int64_t OutputElements(int rank) const;
  CpuLinearArgs ArgsFor(int rank, BFloat16* y) const;
};

// Draws X and W from N(0, 1) (FP8: quantized with scales that keep 4 sigma
// in range), slices them and computes the reference. INVALID_ARGUMENT unless
// the split dimension (n for AG+GEMM, k for GEMM+RS) divides by tp.
// `scheme` (FP8 only): per channel or block, each row / group / block of X and W gets a scale
// of its own, 4 sigma / 448 times a power of two in [1/4, 4] drawn for it, so that a row read
// with another's scale is off by up to 16x; block needs the rank's n and k to be whole 128s.
StatusOr<LinearProblem> MakeRandomLinearProblem(OverlapOp op, DataType dtype, int tp, int64_t m,
                                                int64_t n, int64_t k, uint32_t seed,
                                                Fp8Scheme scheme = Fp8Scheme::kPerTensor);

// BF16 NaN pattern written into outputs before a run; no computation makes it.
inline constexpr uint16_t kPoisonBf16 = 0x7FC1;

// Runs the problem on the CPU executor (ranks as threads) with poisoned
// outputs; returns each rank's output. `defer_last_sum`: PlanRequest's (gemm_rs ring, one
// chunk), the plan a layer on copy engines runs.
StatusOr<std::vector<std::vector<BFloat16>>> RunCpuLinearGroup(const LinearProblem& p,
                                                               OverlapMode mode, int chunks,
                                                               bool defer_last_sum = false);

struct LinearError {
  int64_t unwritten = 0;     // elements still holding the poison
  int64_t differing = 0;     // elements whose bits differ from the reference
  double max_abs = 0;        // max |got - ref|
  double rel_frobenius = 0;  // ||got - ref|| / ||ref||
};

// Puts the ranks' outputs back into the global [m, n] layout and compares.
StatusOr<LinearError> CompareWithReference(const LinearProblem& p,
                                           const std::vector<std::vector<BFloat16>>& outputs);

// Compares one rank's output with its part of the reference (what a process
// that holds only its own output can check).
StatusOr<LinearError> CompareRankWithReference(const LinearProblem& p, int rank,
                                               const std::vector<BFloat16>& output);

}  // namespace tpserve
