#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "engine/gather_rows.h"

namespace tpserve {
namespace {

__global__ void GatherLastRowsKernel(const uint16_t* input, int64_t stride, int64_t tokens,
                                     int64_t dim, const int32_t* cu_seqlens, uint16_t* out) {
  const int64_t s = blockIdx.x;
  const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
  const int64_t row = end - 1;
  const bool valid = end > begin && row >= 0 && row < tokens;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    out[s * dim + j] = valid ? input[row * stride + j] : uint16_t{0};
  }
}

}  // namespace

Status LaunchGatherLastRowsBf16(const GatherRowsParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.tokens < 0 || p.dim < 1 || p.input_row_stride < p.dim) {
    return InvalidArgumentError(
        "gather last rows: needs num_seqs >= 0, tokens >= 0, dim >= 1 and "
        "input_row_stride >= dim");
  }
  if (p.num_seqs == 0) return Status::Ok();
  if (p.input == nullptr || p.out == nullptr || p.cu_seqlens == nullptr) {
    return InvalidArgumentError("gather last rows: input, cu_seqlens and out must be non-null");
  }
  if (p.num_seqs > (int64_t{1} << 31) - 1) {
    return InvalidArgumentError("gather last rows: num_seqs too large");
  }
  GatherLastRowsKernel<<<static_cast<unsigned>(p.num_seqs), 256, 0, stream>>>(
      reinterpret_cast<const uint16_t*>(p.input), p.input_row_stride, p.tokens, p.dim, p.cu_seqlens,
      reinterpret_cast<uint16_t*>(p.out));
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
