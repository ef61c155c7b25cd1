// Scale slots: where the GEMMs of a CudaLinear with a fine FP8 scale scheme (per token, or per
// 1x128 group: CudaLinearShape::scale_scheme) read their activations' scales when the layer is
// more than one GEMM over X as the caller wrote it (tp > 1, or chunks > 1).
//
// cuBLASLt reads a per-row (OUTER_VEC) or per-group (VEC128) scale tensor of exactly the GEMM's
// m rows from a 16-byte aligned address, so a GEMM over a chunk of rows cannot read its scales
// at an offset into the caller's vector. Every (shard p, chunk c) of the rows, that is
// ChunkRows(ShardRows(m, tp, p), chunks, c) of layers/overlap_plan.h, therefore gets a slot of
// its own: `groups` columns of its rows' scales ([groups][rows], token-major, as the quantize
// kernels write them), at float offset ScaleSlotOffset(tp, p, c, pitch) = (c * tp + p) * pitch.
// For one chunk c the tp slots are consecutive, so an NCCL AllGather of chunk c's scales is an
// in-place AllGather of `pitch` floats per rank, and a ring's send of rows (p, c) moves slot
// (p, c) alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/status.h"

namespace tpserve {

// Floats per slot for m rows: groups x the largest chunk's rows, rounded up to 4 (16 bytes).
inline int64_t ScaleSlotPitch(int64_t m, int tp, int chunks, int64_t groups) {
  const int64_t shard = (m + tp - 1) / tp;
  const int64_t chunk = (shard + chunks - 1) / chunks;
  return (groups * chunk + 3) / 4 * 4;
}

// Float offset of slot (shard, chunk).
inline int64_t ScaleSlotOffset(int tp, int shard, int chunk, int64_t pitch) {
  return (static_cast<int64_t>(chunk) * tp + shard) * pitch;
}

// Copies the caller's scales into the slots: src holds [groups][src rows] floats, the rows of
// shard `only_shard` (>= 0) or all m rows (-1); each row's scales land in its (shard, chunk)
// slot of dst. One launch, no allocation (capturable). INVALID_ARGUMENT for bad sizes or null
// pointers; dst 16-byte aligned.
struct ScatterScaleSlotsParams {
  const float* src = nullptr;
  float* dst = nullptr;
  int64_t m = 0;
  int tp = 1;
  int chunks = 1;
  int64_t groups = 1;
  int64_t pitch = 0;    // ScaleSlotPitch(m, tp, chunks, groups)
  int only_shard = -1;  // >= 0: src holds that shard's rows only (and only its slots are written)
};
Status LaunchScatterScaleSlots(const ScatterScaleSlotsParams& p, cudaStream_t stream);

}  // namespace tpserve
