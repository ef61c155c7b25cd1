// CudaLinear: one rank's TP linear layer on a GPU — cuBLASLt FP8 (or BF16)
// GEMM with its NCCL communication overlapped as the layer's knobs say.
//
// The layer runs OverlapPlans (layers/overlap_plan.h; a gemm_rs layer with
// knobs.full_weight builds its own steps, see LinearKnobs::full_weight): GEMM steps on the
// caller's stream, communication steps on the layer's own high-priority comm stream
// (full_weight's local copies of its own input columns on a copy stream of the layer's, beside
// the comm stream's pulls), dependencies as events. The layer's streams fork from and join back
// into the caller's stream inside Run(), so a Run can be captured into a CUDA graph (and a whole
// model of them into one).
//
// Buffers are allocated once, in Create(), for the largest M; Prepare(m)
// builds the plan and the GEMM algorithms for one M ahead of time (host only).
// Run() neither allocates nor synchronises.
//
// Data layout (row-major, device memory):
//  - AG+GEMM: the caller writes this rank's row shard of X ([shard rows, k])
//    at input(m); Run writes Y_r = X · W_r^T, [m, n], to y.
//  - GEMM+RS: the caller writes X_r ([m, k], its K slice) at input(m); Run
//    writes this rank's row shard of sum_r X_r · W_r^T, [shard rows, n].
//  Rows are sharded as ShardRows(m, tp, rank). w is [n, k]. FP8: x_scale and
//  w_scale are device pointers to dequantization scales laid out as shape.scale_scheme says
//  (one float each for per-tensor).
//  - GEMM+RS with knobs.full_weight: w is the whole weight [n, tp * k] (rank r's
//    K slice in columns [r * k, (r + 1) * k)); X_r and the output as above.
//
// Thread-safety: none; one object per rank, used by that rank's thread.
// Shutdown: destroy graphs that captured Run() before the layer, and the
// layer before its communicator.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/cuda_resources.h"
#include "comm/nccl_communicator.h"
#include "layers/cublaslt_gemm.h"
#include "layers/linear_knobs.h"
#include "layers/overlap_plan.h"

namespace tpserve {

struct CudaLinearShape {
  OverlapOp op = OverlapOp::kAllGatherGemm;
  DataType dtype = DataType::kFloat8E4M3;  // of X and W: kFloat8E4M3 or kBFloat16
  int64_t max_m = 0;                       // largest global M that Run accepts
  int64_t n = 0;  // local output features (AG: N / tp; RS: N); multiple of 16
  int64_t k = 0;  // local input features (AG: K; RS: K / tp); multiple of 16
  // FP8 only: how x_scale and w_scale are laid out (layers/cublaslt_gemm.h). Besides
  // kPerTensor, the layer runs kPerTokenChannel (x_scale: one float per row of X as the caller
  // wrote it, the own shard's rows for AG and all m rows for RS; w_scale: n floats) and
  // kBlockwise (x_scale: the 1x128 groups' scales of those rows as the dynamic quantize kernel
  // writes them; w_scale: the weight's 128x128 blocks at BlockwiseWeightScalePitch(k)). At tp 1
  // with one chunk the GEMM reads x_scale as it is; otherwise Run first copies it into scale
  // slots, one per (shard, chunk) of the rows (layers/scale_slots.h), and an AG layer's
  // transfers bring the peers' slots with their rows. Create refuses them with full_weight,
  // Prepare for an M whose plan has a GEMM that adds into C (UNIMPLEMENTED: cuBLASLt takes these
  // scales with beta 0 only) and, blockwise, a GEMM m that is not a multiple of 4 (cuBLASLt's
  // condition).
  GemmScaleScheme scale_scheme = GemmScaleScheme::kPerTensor;
  // GEMM+RS at tp 1 only (the layer is then its GEMMs alone, in any mode), per-tensor scales
  // (cuBLASLt adds into C with those only): Run adds the product into y, y = bf16(y + X W^T)
  // with the sum in FP32 (cuBLASLt's C and D both y, beta 1), instead of overwriting it. A
  // model's residual add lands in the GEMM's epilogue that way, and the add & norm after it
  // reads the residual stream alone. Create refuses it at tp > 1 and for an AllGather layer
  // (UNIMPLEMENTED: the output is then a collective's, which cannot add into y).
  bool accumulate = false;
};

// What a layer takes from its owner beyond the tuned knobs: the process's choices (a server's or
// a benchmark's flags), the same for every layer it builds.
struct CudaLinearOptions {
  // How its GEMMs choose their cuBLASLt algorithms (layers/cublaslt_gemm.h).
  GemmAlgoSelection gemm_algo = GemmAlgoSelection::kTimed;
};

class CudaLinear {
 public:
  // Allocates the layer's buffers on the communicator's device and creates
  // its streams and GEMM. `pool` provides the communicator variant named by
  // knobs.comm (collective: all ranks create the same layers in the same
  // order). `name` (e.g. "layers.3.mlp.down") appears in errors.
  static StatusOr<std::unique_ptr<CudaLinear>> Create(std::string name,
                                                      const CudaLinearShape& shape,
                                                      const LinearKnobs& knobs, NcclCommPool& pool,
                                                      const CudaLinearOptions& options = {});
  ~CudaLinear();

  // Builds (once per m) the plan and the GEMM algorithms of every GEMM step.
  // Host only; must precede Run(m) and its capture.
  Status Prepare(int64_t m);

  // Where the caller puts this rank's X for a run with `m` rows.
  void* input(int64_t m) const;
  // Bytes of X the caller writes at input(m).
  size_t input_bytes(int64_t m) const;
  // Elements of this rank's output for `m` rows.
  int64_t output_elements(int64_t m) const;

  // Enqueues the layer on `stream`. FAILED_PRECONDITION if Prepare(m) has not
  // run; INVALID_ARGUMENT for m out of range or a missing pointer.
  Status Run(int64_t m, const void* w, const float* x_scale, const float* w_scale, void* y,
             cudaStream_t stream);

  // A GEMM+RS output left as two addends: this rank's output is bf16(first + second)
  // elementwise (the FP32 sum rounded once, as the layer's own sum kernel adds them, except
  // that the kernel starts from +0: -0 + -0 gives +0 there), each [shard rows, n] BF16,
  // contiguous, in the layer's buffers; y is then not written. second == nullptr: first is
  // y, already summed. The addends are valid for work enqueued on RunSplit's stream after
  // it and before the layer's next Run, RunSplit, RunGemmOnly, RunCommOnly or Close (which
  // start with that stream's work done, not another stream's).
  struct SplitOutput {
    const void* first = nullptr;
    const void* second = nullptr;
  };
  // Run, but a GEMM+RS plan that ends in a sum step of its own (ring with copy engines and
  // one chunk: the own rows' partial plus the running sum the copy engine brought in) skips
  // that step and leaves the addition to the output's consumer, which reads both addends
  // anyway (the engine's add & norm), instead of a pass that reads both and writes y. Any
  // other plan runs as Run does and answers {y, nullptr}. `split` is required.
  Status RunSplit(int64_t m, const void* w, const float* x_scale, const float* w_scale, void* y,
                  cudaStream_t stream, SplitOutput* split);

  // Llama's gate_up layer (its output's halves are gate and up) with SwiGLU in its GEMM's
  // epilogue (layers/small_m_gemm.h: LaunchSmallMGemmSwiGlu): `out` [m, n/2] gets the E4M3
  // codes of silu(gate) * up over *out_scale, bit-identical to Run and then the SwiGLU pass,
  // and y is not written. Only where the layer for m is one GEMM on the small-M kernel and
  // nothing else (tp 1, one chunk, per-tensor FP8 scales, no accumulate): CanRunSwiGlu(m);
  // FAILED_PRECONDITION otherwise, with nothing enqueued.
  bool CanRunSwiGlu(int64_t m) const;
  Status RunSwiGlu(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                   uint8_t* out, const float* out_scale, cudaStream_t stream);

  // For benchmarks: enqueue only the GEMM steps (skip communication), to
  // measure the GEMM's cost inside the layer.
  Status RunGemmOnly(int64_t m, const void* w, const float* x_scale, const float* w_scale, void* y,
                     cudaStream_t stream);
  // For benchmarks: enqueue only the communication steps (their signals,
  // transfers and, for a peer-memory ReduceScatter, the sum; no GEMM, so the
  // data is meaningless), to measure what the transfers cost inside the
  // layer. Every rank must run the same.
  Status RunCommOnly(int64_t m, void* y, cudaStream_t stream);

  // Orderly teardown, collective (every rank closes the same layers in the
  // same order, after the graphs that captured them): unmaps the peers'
  // buffers, waits on a barrier until every rank has, then frees this rank's
  // peer-mapped buffers, which a peer may no longer have mapped when freed
  // (PeerBuffer). A layer without peer memory returns at once. Afterwards
  // Prepare and Run answer FAILED_PRECONDITION. The barrier's error, if any,
  // is returned after the buffers are freed anyway. Destruction alone skips
  // the barrier (for error paths, where a peer may be gone).
  Status Close();

  const std::string& name() const { return name_; }
  const LinearKnobs& knobs() const { return knobs_; }
  const CudaLinearShape& shape() const { return shape_; }
  int tp() const { return tp_; }
  int rank() const { return rank_; }
  // Device memory the layer owns (buffers + GEMM workspace).
  size_t device_bytes() const;

  struct Impl;  // prepared plans and buffers; defined in cuda_linear.cc

 private:
  CudaLinear() = default;
  enum class Steps { kAll, kGemm, kComm };
  Status Enqueue(int64_t m, const void* w, const float* x_scale, const float* w_scale, void* y,
                 cudaStream_t stream, Steps steps, SplitOutput* split = nullptr);

  std::string name_;
  CudaLinearShape shape_;
  LinearKnobs knobs_;
  int tp_ = 1;
  int rank_ = 0;
  bool closed_ = false;
  bool in_place_ = false;  // gemm_rs ring over peer memory with knobs_.in_place
  std::unique_ptr<Impl> impl_;
};

}  // namespace tpserve
