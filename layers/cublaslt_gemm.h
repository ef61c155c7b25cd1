// CublasLtGemm: the GEMM of one TP linear layer, on cuBLASLt.
//
// Callers think row-major:
//
//   D[m,n] = alpha * (a_scale * A[m,k]) · (b_scale * B[n,k])^T + beta * C[m,n]
//
// with A the activations (row-major m×k) and B the weight (row-major n×k, i.e. one row per
// output feature). That is the "TN" layout Hopper's FP8 kernels require; in cuBLAS's
// column-major terms this class computes D^T = B·A^T with transa = T on B.
//
// Supported types (all with FP32 accumulation and FP32 alpha/beta):
//   A, B FP8 E4M3 → D BF16          per-tensor a_scale / b_scale, optional C (BF16) and beta
//   A, B FP8 E4M3 → D FP8 E4M3      plus d_quant_scale and d_amax; no C (beta must be 0)
//   A, B BF16     → D BF16          optional C (BF16) and beta
//   A, B BF16     → D FP32          optional C (FP32) and beta (e.g. an LM head's logits,
//                                   kept unrounded)
// C, when used, is FP32 with an FP32 D (cuBLASLt needs C's type to equal D's there), else BF16.
//
// FP8 scale schemes (GemmScaleScheme below): besides one scale per tensor, a scale per row of
// A (token) and per row of B (output channel), or per 1x128 group of A and per 128x128 block
// of B. Those two need D BF16, beta 0 and batch 1 (what cuBLASLt documents and this class
// tests); the block scheme also k % 128 == 0, n % 128 == 0, m % 4 == 0 and no fast_accum.
//
// Strided batch: item i reads A + i*stride_a, B + i*stride_b (0: the same weight for every
// item), C + i*stride_c and writes D + i*stride_d (all strides in elements). The AG+GEMM
// executor uses this to compute the tp row blocks of one chunk in one launch.
//
// Small M: a GEMM of at most 8 rows of FP8 activations with per-tensor scales (a decode step's;
// SmallMGemmFits in layers/small_m_gemm.h says exactly which) runs on tpserve's own
// weight-streaming tensor-core kernel instead of cuBLASLt, with neither a plan nor timing.
//
// Plans: the matmul descriptor, the four layouts and the algorithm (GemmAlgoSelection below)
// are cached per GemmParams shape/config (everything but the pointer values, alpha, and beta
// beyond whether it is 0), so the heuristic runs once per shape. Prepare() builds the
// plan ahead of time; after that Run() for that shape neither allocates nor synchronises and
// can be captured in a CUDA graph. A Run() that would need a new plan while its stream is
// capturing fails with FAILED_PRECONDITION instead.
//
// Alignment contract: every matrix pointer and every scale/amax pointer is 16-byte aligned
// (cublasLtMatmul answers NOT_SUPPORTED for a scale pointer 4 bytes past an allocation's
// start), and every leading dimension and batch stride is a multiple of 16 bytes. The
// heuristic is told exactly that (not cuBLASLt's default assumption of 256-byte alignment), so
// row-block offsets into a buffer are fine.
//
// Thread safety: none. One object per layer per rank thread. All Run()s of one object share
// its workspace, so they must be ordered on one stream (or joined by events); two concurrent
// Runs of the same object on unordered streams race on the workspace.
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "comm/dtype.h"
#include "comm/status.h"
#include "layers/scale_scheme.h"

namespace tpserve {

struct GemmParams {
  // Problem size: D is m×n, the reduction is over k. All must be > 0. FP8: k % 16 == 0 and
  // n % 16 == 0 (cuBLASLt FP8 on Hopper); m is free.
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;

  // kFloat8E4M3 (A and B both) or kBFloat16 (A and B both).
  DataType a_type = DataType::kFloat8E4M3;
  DataType b_type = DataType::kFloat8E4M3;
  // kBFloat16; or kFloat8E4M3 when A and B are FP8; or kFloat32 when A and B are BF16.
  DataType d_type = DataType::kBFloat16;

  // Row pitches in elements; 0 means packed (lda = ldb = k, ldc = ldd = n). Must be at least
  // the row length (k for A and B, n for C and D) and a multiple of 16 bytes.
  int64_t lda = 0;
  int64_t ldb = 0;
  int64_t ldc = 0;
  int64_t ldd = 0;

  // Strided batch: `batch` independent GEMMs of the shape above; strides in elements between
  // consecutive items, multiples of 16 bytes, >= 0. For batch > 1, stride_d must be at least
  // m * ldd (outputs may not overlap); stride_a / stride_b may be 0 (broadcast). Ignored when
  // batch == 1.
  int batch = 1;
  int64_t stride_a = 0;
  int64_t stride_b = 0;
  int64_t stride_c = 0;
  int64_t stride_d = 0;

  // *Dequantization* scales of A and B (real value = fp8 code * scale), as float device
  // pointers laid out as scale_scheme says (GemmAScaleCount / GemmBScaleCount floats).
  // FP8 only; must be nullptr for BF16 inputs. kPerTensor: nullptr means 1; the other
  // schemes need both.
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  // FP8 only (BF16 inputs must leave it kPerTensor). Part of the plan key.
  GemmScaleScheme scale_scheme = GemmScaleScheme::kPerTensor;
  // FP8 output only: the *quantization multiplier* of D, cuBLASLt's D_SCALE_POINTER:
  // D = sat_e4m3(*d_quant_scale * result), i.e. 1 / (D's dequantization scale). nullptr: 1.
  const float* d_quant_scale = nullptr;
  // FP8 output only: if set, cuBLASLt stores max |result| there, result being the value before
  // d_quant_scale and rounding (float, device pointer).
  float* d_amax = nullptr;

  // Host values, read when Run() enqueues (captured by value into a CUDA graph).
  float alpha = 1.0f;
  float beta = 0.0f;  // != 0 needs a C pointer in Run(); must be 0 for an FP8 output

  // CUBLASLT_MATMUL_DESC_FAST_ACCUM: faster FP8 accumulation without periodic promotion to
  // full FP32. Ignored for BF16 inputs.
  bool fast_accum = false;

  // The caller's promise that B (and b_scale) hold their values before any kernel enqueued
  // ahead of this GEMM on its stream starts, as a layer's weight does from load time. Lets
  // the small-M kernel (layers/small_m_gemm.h) stream B while the kernel ahead of it still
  // runs (programmatic dependent launch). Not part of the plan key; cuBLASLt ignores it.
  bool b_constant = false;
};

// Floats that a_scale / b_scale must hold for p.scale_scheme (1, m or k/128*m for A; 1, n or
// n/128*BlockwiseWeightScalePitch(k) for B). Pure; meaningful for params that validate.
int64_t GemmAScaleCount(const GemmParams& p);
int64_t GemmBScaleCount(const GemmParams& p);

// Checks a GemmParams against this class's contract (everything but pointer alignment, which
// Run() checks). INVALID_ARGUMENT naming the field for a bad value, UNIMPLEMENTED for a type
// combination that is not supported. Pure; runs without a GPU.
Status ValidateGemmParams(const GemmParams& p);

// `p` as Run reads it: 0 pitches filled in (lda = ldb = k, ldd = n, ldc = ldd), the strides of
// a single item and, where C is not read, ldc zeroed to D's. Pure.
GemmParams ResolveGemmParams(const GemmParams& p);

// How Prepare() picks the algorithm of a shape (each object its own, from Create):
//  - kHeuristic: the first answer of cublasLtMatmulAlgoGetHeuristic.
//  - kTimed (default): Prepare() runs each of the heuristic's answers (up to 8) on the GPU,
//    on random operands of the shape in temporary buffers and on a stream of its own, and
//    keeps the fastest (median of 5 runs each). The choice is remembered process-wide per
//    device and shape/config, so the layers of a model that share a shape are timed once.
//    The heuristic cannot know whether C will be read (beta is a run-time value), nor how a
//    shape's waves fit the SMs for each tile size; timing sees both (the accumulating GEMMs
//    of a ring's last steps gain most).
//    Prepare() then allocates (operands and a workspace of its own) and synchronises its
//    own stream, so it must not run while its thread captures a CUDA graph, nor while any
//    thread captures in global mode. Without the memory for the operands it keeps the
//    heuristic's answer (with a warning). Run() never times: a shape first seen there takes
//    the remembered choice if any, else the heuristic's.
//  - kHeuristic: cuBLASLt's first answer, never a remembered one.
// Each CublasLtGemm has its own (Create's argument; layers and models pass theirs down from
// their options).
enum class GemmAlgoSelection { kHeuristic, kTimed };
std::string_view GemmAlgoSelectionName(GemmAlgoSelection selection);  // "heuristic" | "timed"
// INVALID_ARGUMENT naming the allowed values.
StatusOr<GemmAlgoSelection> ParseGemmAlgoSelection(std::string_view name);

class CublasLtGemm {
 public:
  // cuBLAS's recommended workspace for Hopper.
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;

  // Creates the cuBLASLt handle and allocates the workspace on the current device. `name`
  // (the layer's) appears in error messages and names the workspace buffer; `selection` is how
  // this object's plans choose their algorithms.
  static StatusOr<CublasLtGemm> Create(std::string name,
                                       GemmAlgoSelection selection = GemmAlgoSelection::kTimed,
                                       size_t workspace_bytes = kDefaultWorkspaceBytes);

  CublasLtGemm();  // empty; only assignable
  ~CublasLtGemm();
  CublasLtGemm(CublasLtGemm&&) noexcept;
  CublasLtGemm& operator=(CublasLtGemm&&) noexcept;
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // Validates `p` and builds its plan (descriptors + heuristic query) if not cached yet.
  // With GemmAlgoSelection::kHeuristic host-only: enqueues nothing; with kTimed see above.
  // UNIMPLEMENTED when cuBLASLt has no algorithm for it.
  Status Prepare(const GemmParams& p);

  // Enqueues D = ... (see top of file) on `stream`. A, B, D must be non-null and 16-byte
  // aligned; C may be nullptr when beta == 0. C == D (in place, for accumulation) needs
  // d_type BF16 or FP32 and ldc == ldd (and stride_c == stride_d). Builds the plan on first use
  // of a shape unless Prepare() did.
  Status Run(const GemmParams& p, const void* a, const void* b, const void* c, void* d,
             cudaStream_t stream);

  // Run()'s pointer checks alone, enqueueing nothing: for a caller that must
  // know every GEMM of a sequence will be accepted before it enqueues the first.
  static Status CheckPointers(const GemmParams& p, const void* a, const void* b, const void* c,
                              const void* d);

  // Number of cached plans (distinct shapes/configs seen).
  size_t num_plans() const;
  // (device, shape/config) pairs chosen so far in this process (GemmAlgoSelection::kTimed).
  static size_t timed_shapes();
  const std::string& name() const;
  size_t workspace_bytes() const;
  GemmAlgoSelection selection() const;

 private:
  struct Impl;
  explicit CublasLtGemm(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

}  // namespace tpserve
