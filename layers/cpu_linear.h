// CPU reference executor for the TP linear layers: runs an OverlapPlan on a
// Communicator (normally a LocalCommunicator, ranks as threads) with FP8
// (emulated: E4M3 codes + per-tensor dequantization scales) or BF16 operands,
// FP32 accumulation and BF16 output. It is the numeric truth the GPU layers
// are tested against, and the backend of the server on machines without GPUs.
//
// Numerics, chosen to mirror the GPU path: each output element is one FP32
// dot product over k in increasing order, times x_scale * w_scale, plus (ring
// GEMM+RS) the received BF16 partial, rounded once to BF16. Partials that
// cross ranks are BF16; ReduceScatter sums them in FP32 in rank order.
//
// FP8 scale schemes (layers/fp8.h): the rule the GPU GEMM must match is
// Y = dequant(Xq) · dequant(Wq)^T per scheme.
//   kPerTensor  dot * (x_scale * w_scale), as above.
//   kPerChannel dot * (x_scales[row] * w_scales[col]): per-token X, per-channel W.
//   kBlock      sum over the 128-long k groups g, in increasing order, of the
//               group's FP32 dot * (x_scales[row, g] * w_scales[col / 128, g]),
//               summed in FP32.
// The X rows' scales travel with their codes: an AllGather of FP8 rows
// carries each row's scale(s), as the GPU's must. In GEMM+RS each rank's
// X_r has its own row/group scales (of its slice of K): a row's scale is the
// amax of what that rank's GEMM takes, not of the whole row across ranks.
#pragma once

#include <cstdint>
#include <span>

#include "comm/communicator.h"
#include "comm/dtype.h"
#include "layers/fp8.h"
#include "layers/overlap_plan.h"

namespace tpserve {

// One rank's operands. Row-major, contiguous.
//  AG+GEMM (column-parallel): x = this rank's shard of X, [shard rows, k];
//    w = W_r, [n, k] (n = this rank's output columns); y = [M, n].
//  GEMM+RS (row-parallel): x = X_r, [M, k] (k = this rank's slice of K);
//    w = W_r, [n, k]; y = this rank's shard of the summed output, [shard rows, n].
struct CpuLinearArgs {
  DataType dtype = DataType::kFloat8E4M3;  // of x and w: kFloat8E4M3 or kBFloat16
  int64_t n = 0;
  int64_t k = 0;
  const void* x = nullptr;
  float x_scale = 1.0f;  // FP8 dequantization scales (ignored for BF16)
  const void* w = nullptr;
  float w_scale = 1.0f;
  BFloat16* y = nullptr;
  // FP8 only. kPerTensor uses x_scale and w_scale; the others x_scales
  // (Fp8ActivationScalesPerRow per row of x, row-major, for the rows x holds)
  // and w_scales (Fp8WeightScaleCount(scheme, n, k), of this rank's [n, k] W).
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  std::span<const float> x_scales;
  std::span<const float> w_scales;
  // Plans with PlanRequest::full_weight (gemm_rs, per-tensor scales or BF16): the whole weight,
  // [n, tp * k], rank r's W_r being columns [r * k, (r + 1) * k), with w_scale its scale and
  // x_scale every rank's (one GEMM over the whole K takes one). w is not read.
  const void* w_full = nullptr;
};

// Runs `plan` (made for comm.rank() of comm.size()) on this rank. Blocks
// until this rank's part is done. Copy-engine steps exchange their messages as
// point-to-point messages (what a peer pulls is what was offered). full_weight
// GEMMs: a writing GEMM is one dot product over its K blocks' columns in order;
// an adding GEMM adds each block's product in turn, rounding each time (as the
// GPU's GEMMs with beta 1 do). Errors: INVALID_ARGUMENT for a plan that
// does not match the communicator or bad args; the communicator's errors.
Status RunCpuLinear(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& args);

// Unsharded reference: y[m, n] = x[m, k] · w[n, k]^T with the numerics above.
Status ReferenceLinear(DataType dtype, int64_t m, int64_t n, int64_t k, const void* x,
                       float x_scale, const void* w, float w_scale, std::span<BFloat16> y);

// Unsharded FP8 reference of any scheme: x [m, k] and w [n, k] are E4M3
// codes with scales laid out as in CpuLinearArgs (kPerTensor: one of each).
// INVALID_ARGUMENT for sizes that do not fit.
Status ReferenceLinearFp8(Fp8Scheme scheme, int64_t m, int64_t n, int64_t k,
                          std::span<const uint8_t> x, std::span<const float> x_scales,
                          std::span<const uint8_t> w, std::span<const float> w_scales,
                          std::span<BFloat16> y);

}  // namespace tpserve
