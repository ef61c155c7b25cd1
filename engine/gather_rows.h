// Gathers each packed sequence's last row into a dense BF16 matrix: the rows
// the LM head multiplies. (engine/cuda_ops.h's LaunchGatherLastTokens does
// the same into FP32 for inspection; the GEMM wants BF16.)
//
// out[s, :] = input[cu_seqlens[s+1] - 1, :] for s < num_seqs; an empty
// sequence, or a row outside [0, tokens) from a corrupt cu_seqlens, gives
// zeros. input: [tokens, dim] with row stride input_row_stride (elements);
// out: [num_seqs, dim] contiguous. No allocation or synchronisation
// (capturable). Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "comm/dtype.h"
#include "comm/status.h"

namespace tpserve {

struct GatherRowsParams {
  const BFloat16* input = nullptr;
  int64_t input_row_stride = 0;         // >= dim
  int64_t tokens = 0;                   // >= 0
  int64_t dim = 0;                      // >= 1
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], device
  int64_t num_seqs = 0;                 // >= 0; 0 launches nothing
  BFloat16* out = nullptr;
};
Status LaunchGatherLastRowsBf16(const GatherRowsParams& p, cudaStream_t stream);

}  // namespace tpserve
