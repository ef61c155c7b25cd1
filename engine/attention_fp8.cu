// The E4M3 attention's producer and checks (engine/attention_fp8.h); the attention kernel is
// engine/attention_wgmma.cu's, its launcher in engine/attention.cu. Plain CUDA C++17.
//
// A block takes one (sequence, KV head) and 32 rows of it at a time: the Q rows of the KV
// head's query heads and its K rows are quantized in place (row-major in, row-major out; with
// RoPE each pair rotated first, its angles computed once a row for the block's heads), and its
// V rows go through shared memory to be written transposed, a thread writing one 16-key group
// (16 consecutive codes) of one dim.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "comm/cuda_check.h"
#include "engine/attention_fp8.cuh"
#include "engine/attention_wgmma.h"
#include "engine/device_math.cuh"
#include "engine/launch_checks.h"
#include "engine/rope.cuh"
#include "layers/fp8_divide.cuh"

namespace tpserve {
namespace {

using namespace device;
using namespace launch_checks;

constexpr int kHeadDim = 128;
constexpr int kRows = 32;  // rows of a sequence a block takes at a time: two 16-key groups
constexpr int kProducerThreads = 256;

// Where the producer finds RoPE's angles (LaunchFp8AttentionInputs' rope).
struct RopeArgs {
  const int32_t* positions = nullptr;
  const double* inv_freq = nullptr;
  double theta = 0;
};

// One block: (sequence blockIdx.x, KV head blockIdx.z), rows in chunks of kRows.
template <bool kFast, bool kRope>
__device__ __forceinline__ void QuantizeRows(const AttentionParams& p, const Fp8AttentionInputs& in,
                                             const RopeArgs& rope, const Fp8Divisor (&div)[3],
                                             int seq, int begin, int len,
                                             float2 (*angles)[kHeadDim / 2],
                                             uint16_t (*v_tile)[kHeadDim]) {
  const int kv_head = static_cast<int>(blockIdx.z);
  const int group = static_cast<int>(p.q_heads / p.kv_heads);
  const int64_t q_width = p.q_heads * kHeadDim, kv_width = p.kv_heads * kHeadDim;
  const int vt0 = Fp8VtBegin(begin, seq);
  const int tid = static_cast<int>(threadIdx.x);
  const auto* q = reinterpret_cast<const uint16_t*>(p.q);
  const auto* k = reinterpret_cast<const uint16_t*>(p.k);
  const auto* v = reinterpret_cast<const uint16_t*>(p.v);
  for (int c0 = static_cast<int>(blockIdx.y) * kRows; c0 < len;
       c0 += static_cast<int>(gridDim.y) * kRows) {
    const int rows = min(kRows, len - c0);
    if constexpr (kRope) {  // the chunk's angles, each once for the heads of the block
      for (int i = tid; i < rows * (kHeadDim / 2); i += kProducerThreads) {
        const int r = i / (kHeadDim / 2), pair = i % (kHeadDim / 2);
        angles[r][pair] =
            RopeCosSin(rope.positions[begin + c0 + r], pair, kHeadDim, rope.inv_freq, rope.theta);
      }
    }
    // V's rows into shared memory, zeros past the sequence (the last group's empty slots).
    for (int i = tid; i < kRows * 16; i += kProducerThreads) {
      const int r = i >> 4, col = (i & 15) * 8;
      uint4 x = make_uint4(0, 0, 0, 0);
      if (r < rows) {
        x = *reinterpret_cast<const uint4*>(v + (begin + c0 + r) * p.v_row_stride +
                                            int64_t{kv_head} * kHeadDim + col);
      }
      *reinterpret_cast<uint4*>(&v_tile[r][col]) = x;
    }
    __syncthreads();
    // Q of the group's heads, then K: a thread takes dims 8j .. 8j + 7 and their RoPE
    // partners 64 + 8j .. of one head row (8 such pairs of vectors a row).
    const int items = (group + 1) * 8;
    for (int i = tid; i < rows * items; i += kProducerThreads) {
      const int r = i / items, item = i - r * items;
      const int h = item >> 3, j = (item & 7) * 8;
      const int64_t row = begin + c0 + r;
      const bool is_q = h < group;
      const int64_t col = (is_q ? int64_t{kv_head * group + h} : int64_t{kv_head}) * kHeadDim + j;
      const uint16_t* src = is_q ? q + row * p.q_row_stride + col : k + row * p.k_row_stride + col;
      float x[8], y[8];
      UnpackBf16x8(*reinterpret_cast<const uint4*>(src), x);
      UnpackBf16x8(*reinterpret_cast<const uint4*>(src + kHeadDim / 2), y);
      if constexpr (kRope) {  // rotated and rounded to BF16, as LaunchRope writes them
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float rx, ry;
          RotatePair(x[e], y[e], angles[r][j + e], &rx, &ry);
          x[e] = Bf16ToFloat(FloatToBf16(rx));
          y[e] = Bf16ToFloat(FloatToBf16(ry));
        }
      }
      const Fp8Divisor d = is_q ? div[0] : div[1];
      uint8_t* dst = is_q ? in.q + row * q_width + col : in.k + row * kv_width + col;
      *reinterpret_cast<uint2*>(dst) = Fp8Codes8<kFast>(x, d);
      *reinterpret_cast<uint2*>(dst + kHeadDim / 2) = Fp8Codes8<kFast>(y, d);
    }
    // V^T: dim d, group g of these 32 keys (16 consecutive codes); a warp reads one key row's
    // 32 consecutive dims at a time.
    const int d = tid & (kHeadDim - 1), g = tid >> 7;
    if (c0 + 16 * g < len) {
      float lo[8], hi[8];  // slots 0..7 and 8..15
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        lo[s] = Bf16ToFloat(v_tile[16 * g + Fp8VtKeyAtSlot(s)][d]);
        hi[s] = Bf16ToFloat(v_tile[16 * g + Fp8VtKeyAtSlot(8 + s)][d]);
      }
      const uint2 a = Fp8Codes8<kFast>(lo, div[2]), b = Fp8Codes8<kFast>(hi, div[2]);
      uint8_t* dst = in.vt + (int64_t{kv_head} * kHeadDim + d) * in.vt_columns + vt0 + c0 + 16 * g;
      *reinterpret_cast<uint4*>(dst) = make_uint4(a.x, a.y, b.x, b.y);
    }
    __syncthreads();
  }
}

template <bool kRope>
__global__ void __launch_bounds__(kProducerThreads)
    Fp8AttentionInputsKernel(AttentionParams p, Fp8AttentionInputs in, RopeArgs rope) {
  static_assert(kProducerThreads == 2 * kHeadDim && kRows == 32, "a thread per V^T dim and group");
  __shared__ __align__(16) uint16_t v_tile[kRows][kHeadDim];
  __shared__ float2 angles[kRope ? kRows : 1][kHeadDim / 2];
  const int seq = static_cast<int>(blockIdx.x);
  const int tokens = static_cast<int>(p.tokens);
  int begin = p.cu_seqlens[seq];
  int end = p.cu_seqlens[seq + 1];
  begin = begin < 0 ? 0 : (begin > tokens ? tokens : begin);
  end = end < begin ? begin : (end > tokens ? tokens : end);
  const Fp8Divisor div[3] = {MakeFp8Divisor(in.scales[0]), MakeFp8Divisor(in.scales[1]),
                             MakeFp8Divisor(in.scales[2])};
  if (div[0].inv != 0.0f && div[1].inv != 0.0f && div[2].inv != 0.0f) {
    QuantizeRows<true, kRope>(p, in, rope, div, seq, begin, end - begin, angles, v_tile);
  } else {
    QuantizeRows<false, kRope>(p, in, rope, div, seq, begin, end - begin, angles, v_tile);
  }
}

}  // namespace

int64_t Fp8AttentionVtColumns(int64_t tokens, int64_t num_seqs) {
  return (tokens + 15) / 16 * 16 + 32 * num_seqs;
}

bool Fp8AttentionSupports(int64_t head_dim) { return WgmmaAttentionSupports(head_dim); }

Status CheckFp8AttentionInputs(const AttentionParams& p, const Fp8AttentionInputs& in) {
  constexpr const char* kIn = "Fp8AttentionInputs";
  if (!Fp8AttentionSupports(p.head_dim)) {
    return UnimplementedError(std::string("AttentionParams") +
                              ": E4M3 attention needs an sm_90a build, a compute capability 9.0 "
                              "device and head_dim 128 (head_dim = " +
                              std::to_string(p.head_dim) + ")");
  }
  TP_RETURN_IF_ERROR(CheckPointers(
      kIn, {{"q", in.q, 16}, {"k", in.k, 16}, {"vt", in.vt, 16}, {"scales", in.scales, 4}}));
  const int64_t need = Fp8AttentionVtColumns(p.tokens, p.num_seqs);
  if (in.vt_columns % 16 != 0 || in.vt_columns < need || in.vt_columns > kMaxGridX) {
    return BadField(kIn, "vt_columns", in.vt_columns,
                    "must be a multiple of 16 in [" + std::to_string(need) + ", 2^31 - 1]");
  }
  return Status::Ok();
}

Status LaunchFp8AttentionInputs(const AttentionParams& p, const Fp8AttentionInputs& in,
                                const RopeParams* rope, cudaStream_t stream) {
  TP_RETURN_IF_ERROR(CheckCausalAttentionParams(p, true, false, stream));
  TP_RETURN_IF_ERROR(CheckFp8AttentionInputs(p, in));
  RopeArgs angles;
  if (rope != nullptr) {
    TP_RETURN_IF_ERROR(CheckRope(*rope));
    if (rope->rows != p.tokens || rope->head_dim != p.head_dim || rope->positions == nullptr) {
      return InvalidArgumentError(
          "RopeParams for LaunchFp8AttentionInputs: rows (" + std::to_string(rope->rows) +
          ") and head_dim (" + std::to_string(rope->head_dim) +
          ") must be the attention's tokens and head_dim, and positions set");
    }
    angles = RopeArgs{rope->positions, rope->inv_freq, rope->theta};
  }
  if (p.num_seqs == 0 || p.tokens == 0) return Status::Ok();
  if (p.kv_heads > kMaxGridY) {
    return BadField("AttentionParams", "kv_heads", p.kv_heads, "must be at most 65535");
  }
  // grid.y: chunks of the average sequence (blocks loop over longer ones), within the
  // longest's; a bucket's max_seqlen is its whole size, and a block per chunk of that for every
  // sequence of a batch of many short ones would mostly find nothing to do.
  const int64_t longest = std::min(p.max_seqlen, p.tokens);
  const int64_t average = (p.tokens + p.num_seqs - 1) / p.num_seqs;
  const int64_t chunks =
      std::min({(average + kRows - 1) / kRows, (longest + kRows - 1) / kRows, kMaxGridY});
  const dim3 grid(static_cast<unsigned>(p.num_seqs),
                  static_cast<unsigned>(std::max<int64_t>(1, chunks)),
                  static_cast<unsigned>(p.kv_heads));
  if (rope != nullptr) {
    Fp8AttentionInputsKernel<true><<<grid, kProducerThreads, 0, stream>>>(p, in, angles);
  } else {
    Fp8AttentionInputsKernel<false><<<grid, kProducerThreads, 0, stream>>>(p, in, angles);
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
