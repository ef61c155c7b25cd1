// The E4M3 attention's producer and checks (engine/attention_fp8.h); the attention kernel is
// engine/attention_wgmma.cu's, its launcher in engine/attention.cu. Plain CUDA C++17.
//
// A block takes 16 rows of one sequence at a time (one group of V^T's keys) and every head of
// them: the Q and K rows are quantized in place (row-major in, row-major out; with RoPE each
// pair rotated first, its angles computed once a row for all heads), and V's rows go through
// shared memory two KV heads at a time to be written transposed, a thread writing the group's
// 16 codes of one dim.
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
constexpr int kRows = 16;  // rows of a sequence a block takes at a time: one 16-key group
constexpr int kProducerThreads = 256;
constexpr int kVtHeads = kProducerThreads / kHeadDim;  // KV heads a V^T pass transposes
constexpr int kUnroll = 2;  // Q/K items a thread loads before it converts them

// Where the producer finds RoPE's angles (LaunchFp8AttentionInputs' rope).
struct RopeArgs {
  const int32_t* positions = nullptr;
  const double* inv_freq = nullptr;
  double theta = 0;
};

// How values become codes: value / scale by IEEE division, by the fast exact path
// (Fp8Divisor.inv != 0), or, every scale being 1 (the engine's), the value itself.
enum class Divide { kIeee, kFast, kNone };

template <Divide kDivide>
__device__ __forceinline__ uint2 Codes8(const float (&f)[8], const Fp8Divisor& d) {
  if constexpr (kDivide == Divide::kNone) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] =
          __nv_cvt_float2_to_fp8x2(make_float2(f[2 * i], f[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    }
    return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
  } else {
    return Fp8Codes8<kDivide == Divide::kFast>(f, d);
  }
}

// One block: sequence blockIdx.x, rows in chunks of kRows.
template <Divide kDivide, bool kRope>
__device__ __forceinline__ void QuantizeRows(const AttentionParams& p, const Fp8AttentionInputs& in,
                                             const RopeArgs& rope, const Fp8Divisor (&div)[3],
                                             int seq, int begin, int len,
                                             float2 (*angles)[kHeadDim / 2],
                                             uint16_t (*v_tile)[kRows][kHeadDim]) {
  const int q_heads = static_cast<int>(p.q_heads), kv_heads = static_cast<int>(p.kv_heads);
  const int64_t q_width = p.q_heads * kHeadDim, kv_width = p.kv_heads * kHeadDim;
  const int vt0 = Fp8VtBegin(begin, seq);
  const int tid = static_cast<int>(threadIdx.x);
  const auto* q = reinterpret_cast<const uint16_t*>(p.q);
  const auto* k = reinterpret_cast<const uint16_t*>(p.k);
  const auto* v = reinterpret_cast<const uint16_t*>(p.v);
  // A Q/K item: dims 8j .. 8j + 7 and their RoPE partners 64 + 8j .. of one head of one row
  // (8 items a head row; Q's heads, then K's).
  const int per_row = (q_heads + kv_heads) * 8;
  for (int c0 = static_cast<int>(blockIdx.y) * kRows; c0 < len;
       c0 += static_cast<int>(gridDim.y) * kRows) {
    const int rows = min(kRows, len - c0);
    if constexpr (kRope) {  // the chunk's angles, each once for all heads
      for (int i = tid; i < rows * (kHeadDim / 2); i += kProducerThreads) {
        const int r = i / (kHeadDim / 2), pair = i % (kHeadDim / 2);
        angles[r][pair] =
            RopeCosSin(rope.positions[begin + c0 + r], pair, kHeadDim, rope.inv_freq, rope.theta);
      }
      __syncthreads();
    }
    const int items = rows * per_row;
    struct Item {
      int r, h, j;  // row of the chunk, head (Q's, then K's), first dim
      int64_t row;  // packed row
    };
    auto locate = [&](int i) {
      const int r = i / per_row, item = i - r * per_row;
      return Item{r, item >> 3, (item & 7) * 8, begin + c0 + r};
    };
    for (int i0 = tid; i0 < items; i0 += kUnroll * kProducerThreads) {
      // kUnroll items' loads in flight before any is converted.
      uint4 raw_x[kUnroll], raw_y[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kProducerThreads;
        if (i >= items) break;
        const auto [r, h, j, row] = locate(i);
        const uint16_t* src = h < q_heads
                                  ? q + row * p.q_row_stride + int64_t{h} * kHeadDim + j
                                  : k + row * p.k_row_stride + int64_t{h - q_heads} * kHeadDim + j;
        raw_x[u] = *reinterpret_cast<const uint4*>(src);
        raw_y[u] = *reinterpret_cast<const uint4*>(src + kHeadDim / 2);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kProducerThreads;
        if (i >= items) break;
        const auto [r, h, j, row] = locate(i);
        float x[8], y[8];
        UnpackBf16x8(raw_x[u], x);
        UnpackBf16x8(raw_y[u], y);
        if constexpr (kRope) {  // rotated and rounded to BF16, as LaunchRope writes them
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float rx, ry;
            RotatePair(x[e], y[e], angles[r][j + e], &rx, &ry);
            x[e] = Bf16ToFloat(FloatToBf16(rx));
            y[e] = Bf16ToFloat(FloatToBf16(ry));
          }
        }
        const bool is_q = h < q_heads;
        uint8_t* dst = is_q ? in.q + row * q_width + int64_t{h} * kHeadDim + j
                            : in.k + row * kv_width + int64_t{h - q_heads} * kHeadDim + j;
        const Fp8Divisor d = is_q ? div[0] : div[1];
        *reinterpret_cast<uint2*>(dst) = Codes8<kDivide>(x, d);
        *reinterpret_cast<uint2*>(dst + kHeadDim / 2) = Codes8<kDivide>(y, d);
      }
    }
    // V^T, kVtHeads KV heads a pass: their rows into shared memory (zeros past the sequence:
    // the last group's empty slots), then a thread per (head, dim) writes the group's codes.
    for (int h0 = 0; h0 < kv_heads; h0 += kVtHeads) {
      for (int i = tid; i < kVtHeads * kRows * 16; i += kProducerThreads) {
        const int hh = i / (kRows * 16), r = (i / 16) % kRows, col = (i % 16) * 8;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r < rows && h0 + hh < kv_heads) {
          x = *reinterpret_cast<const uint4*>(v + (begin + c0 + r) * p.v_row_stride +
                                              int64_t{h0 + hh} * kHeadDim + col);
        }
        *reinterpret_cast<uint4*>(&v_tile[hh][r][col]) = x;
      }
      __syncthreads();
      const int d = tid % kHeadDim, hh = tid / kHeadDim;
      if (h0 + hh < kv_heads) {
        float lo[8], hi[8];  // slots 0..7 and 8..15
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          lo[s] = Bf16ToFloat(v_tile[hh][Fp8VtKeyAtSlot(s)][d]);
          hi[s] = Bf16ToFloat(v_tile[hh][Fp8VtKeyAtSlot(8 + s)][d]);
        }
        const uint2 a = Codes8<kDivide>(lo, div[2]), b = Codes8<kDivide>(hi, div[2]);
        uint8_t* dst = in.vt + (int64_t{h0 + hh} * kHeadDim + d) * in.vt_columns + vt0 + c0;
        *reinterpret_cast<uint4*>(dst) = make_uint4(a.x, a.y, b.x, b.y);
      }
      __syncthreads();  // v_tile and (with RoPE) angles are rewritten next
    }
  }
}

// Four blocks an SM (64 registers): a shape's 512 blocks (8192 rows) in one wave of 132 SMs,
// and enough loads in flight to stream at the bandwidth.
template <bool kRope>
__global__ void __launch_bounds__(kProducerThreads, 4)
    Fp8AttentionInputsKernel(AttentionParams p, Fp8AttentionInputs in, RopeArgs rope) {
  static_assert(kProducerThreads % kHeadDim == 0 && kRows == 16, "a thread per V^T dim");
  __shared__ __align__(16) uint16_t v_tile[kVtHeads][kRows][kHeadDim];
  __shared__ float2 angles[kRope ? kRows : 1][kHeadDim / 2];
  const int seq = static_cast<int>(blockIdx.x);
  const int tokens = static_cast<int>(p.tokens);
  int begin = p.cu_seqlens[seq];
  int end = p.cu_seqlens[seq + 1];
  begin = begin < 0 ? 0 : (begin > tokens ? tokens : begin);
  end = end < begin ? begin : (end > tokens ? tokens : end);
  const Fp8Divisor div[3] = {MakeFp8Divisor(in.scales[0]), MakeFp8Divisor(in.scales[1]),
                             MakeFp8Divisor(in.scales[2])};
  if (div[0].scale == 1.0f && div[1].scale == 1.0f && div[2].scale == 1.0f) {
    QuantizeRows<Divide::kNone, kRope>(p, in, rope, div, seq, begin, end - begin, angles, v_tile);
  } else if (div[0].inv != 0.0f && div[1].inv != 0.0f && div[2].inv != 0.0f) {
    QuantizeRows<Divide::kFast, kRope>(p, in, rope, div, seq, begin, end - begin, angles, v_tile);
  } else {
    QuantizeRows<Divide::kIeee, kRope>(p, in, rope, div, seq, begin, end - begin, angles, v_tile);
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
  TP_RETURN_IF_ERROR(CheckFp8AttentionInputs(p, in));  // first, as LaunchCausalAttentionFp8's
  TP_RETURN_IF_ERROR(CheckCausalAttentionParams(p, true, false, stream));
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
  // grid.y: chunks of the average sequence (blocks loop over longer ones), within the
  // longest's; a bucket's max_seqlen is its whole size, and a block per chunk of that for every
  // sequence of a batch of many short ones would mostly find nothing to do.
  const int64_t longest = std::min(p.max_seqlen, p.tokens);
  const int64_t average = (p.tokens + p.num_seqs - 1) / p.num_seqs;
  const int64_t chunks =
      std::min({(average + kRows - 1) / kRows, (longest + kRows - 1) / kRows, kMaxGridY});
  const dim3 grid(static_cast<unsigned>(p.num_seqs),
                  static_cast<unsigned>(std::max<int64_t>(1, chunks)));
  if (rope != nullptr) {
    Fp8AttentionInputsKernel<true><<<grid, kProducerThreads, 0, stream>>>(p, in, angles);
  } else {
    Fp8AttentionInputsKernel<false><<<grid, kProducerThreads, 0, stream>>>(p, in, angles);
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
