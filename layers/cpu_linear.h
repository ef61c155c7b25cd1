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
#pragma once

#include <cstdint>
#include <span>

#include "comm/communicator.h"
#include "comm/dtype.h"
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
};

// Runs `plan` (made for comm.rank() of comm.size()) on this rank. Blocks
// until this rank's part is done. Errors: INVALID_ARGUMENT for a plan that
// does not match the communicator or bad args; the communicator's errors.
Status RunCpuLinear(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& args);

// Unsharded reference: y[m, n] = x[m, k] · w[n, k]^T with the numerics above.
Status ReferenceLinear(DataType dtype, int64_t m, int64_t n, int64_t k, const void* x,
                       float x_scale, const void* w, float w_scale, std::span<BFloat16> y);

}  // namespace tpserve
