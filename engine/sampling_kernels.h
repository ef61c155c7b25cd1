// CUDA kernel of the generation step's token sampling: one token per sequence drawn from its
// logits, following the CPU reference engine/sampling.h (SampleToken). The KV cache kernels of
// the step (paged KV write, paged attention) are in engine/paged_kv_ops.h.
//
// Launcher only; the kernel lives in sampling_kernels.cu, so .cc files can include this. As in
// engine/cuda_ops.h, the launcher checks its host-side arguments (INVALID_ARGUMENT naming the
// field), enqueues onto `stream` and returns; it does not allocate, synchronise or read device
// memory on the host, so it can be captured in a CUDA graph. The sampling parameters live on
// the device and are therefore not validated by the launcher; the kernel reads bad values as
// described below and never accesses memory out of bounds, which gives wrong tokens for
// corrupt inputs, never a fault. Pointers are device pointers; row strides are in elements.
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/status.h"

namespace tpserve {

// Samples one token per sequence from its logits by engine/sampling.h's rule, in two kernels:
// the row statistics (the vocabulary cut into chunks of kSamplingChunk entries, one CTA per
// chunk and sequence: each chunk's largest logit and its exp sum, into `workspace`), then a
// cluster of CTAs per sequence (ctas_per_seq) that merges them and samples:
// - greedy when temperature == 0 or top_k == 1: the largest logit, lowest id among equal ones
//   (bit-identical to SampleToken);
// - otherwise the inverse CDF over the candidates in (logit descending, id ascending) order,
//   after the top-k and top-p cuts, with u = SampleUniform(seed, index) computed with the same
//   integer splitmix64. The candidates' weights exp((logit - max) / T) are computed in FP32
//   and summed as 2^-44 fixed point (exact, order-independent integer sums, so a (seed, index)
//   always gives the same token), where the reference computes and sums them in double: a
//   token can differ from SampleToken's only when u falls within ~1e-6 of a boundary of the
//   cumulative sums.
// The candidate order is searched by radix selection on a 64-bit (logit, id) key, not sorted;
// the selections by mass walk shared-memory lists of the candidates of nonzero mass when they
// hold them all (up to 4096 a CTA), else the row. The tokens do not depend on ctas_per_seq.
// log_prob = log_softmax(logits)[token] (temperature 1, nothing cut): each chunk sums
// exp(logit - chunk max) in FP32 terms and a double sum, the chunks' sums are rescaled to the
// row's max in double and added in chunk order (deterministic; within 1e-6 of SampleToken's).
// Logits must not be NaN or +inf (NaN never wins the greedy choice; the rest is undefined but
// in bounds); -inf is a valid logit. Device parameters are not validated; the kernel reads a
// temperature that is not a finite number > 0 as greedy, top_k <= 0 or >= vocab as no cut, and
// top_p >= 1 or NaN as no cut (top_p <= 0 keeps the first candidate).
inline constexpr int64_t kSamplingChunk = 4096;
// The largest vocabulary: 2^19 candidates of mass at most 2^44 (2^-44 fixed point) keep every
// integer sum of masses below 2^63.
inline constexpr int64_t kSamplingMaxVocab = int64_t{1} << 19;

// Bytes of SamplingLaunchParams::workspace for num_seqs rows of `vocab` logits: 16 a chunk.
size_t SamplingWorkspaceBytes(int64_t num_seqs, int64_t vocab);

// The CTAs a sequence LaunchSampling takes for ctas_per_seq = 0 on the current device: the
// most (8 or 4) that leave each CTA at least 8192 logits and run every sequence's cluster at
// once (asked of the device once per size); else 1. A sampled token's walks of the row then
// spread over that many SMs; a batch that fills the GPU with one CTA a sequence gains nothing
// from more.
int SamplingCtasPerSeq(int64_t num_seqs, int64_t vocab);

struct SamplingLaunchParams {
  const float* logits = nullptr;  // [num_seqs, vocab], row stride logits_row_stride; 4-byte aligned
  int64_t logits_row_stride = 0;  // >= vocab
  int64_t vocab = 0;              // 1 .. kSamplingMaxVocab
  int64_t num_seqs = 0;           // >= 0; 0 launches nothing
  const float* temperature = nullptr;  // [num_seqs]
  const int32_t* top_k = nullptr;      // [num_seqs]
  const float* top_p = nullptr;        // [num_seqs]
  const uint64_t* seed = nullptr;      // [num_seqs]
  const uint64_t* index = nullptr;     // [num_seqs]: tokens the sequence generated before
  int32_t* token = nullptr;            // [num_seqs] out
  float* log_prob = nullptr;           // [num_seqs] out; optional
  // The row statistics between the two kernels: SamplingWorkspaceBytes(num_seqs, vocab) bytes
  // at least, 16-byte aligned; written before it is read within one launch, so one buffer serves
  // every step of a stream.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // CTAs (one cluster) sampling each sequence, each walking a slice of the row: 1, 2, 4 or 8;
  // 0 lets the launcher choose (more for a small batch, 1 where one CTA a sequence fills the
  // GPU). The same tokens and log-probs at every value.
  int ctas_per_seq = 0;
};
Status LaunchSampling(const SamplingLaunchParams& p, cudaStream_t stream);

}  // namespace tpserve
