// The engine's tensor-core attention (engine/cuda_ops.h: LaunchCausalAttention over packed
// rows; engine/paged_kv_ops.h: the multi-row sequences of LaunchPagedAttention over the paged
// KV cache). Plain CUDA C++17.
//
// BF16 travels as its raw bits (uint16_t).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "comm/cuda_check.h"
#include "engine/attention_store.cuh"
#include "engine/attention_wgmma.h"
#include "engine/cuda_ops.h"
#include "engine/device_math.cuh"
#include "engine/launch_checks.h"
#include "engine/mma.cuh"
#include "engine/paged_kv_ops.h"
#include "layers/fp8_divide.cuh"
#include "layers/kernel_grid.h"

namespace tpserve {
namespace {

using namespace launch_checks;
using namespace device;

std::string Str(int64_t v) { return std::to_string(v); }

// ---------------------------------------------------------------------------------------------
// Causal varlen attention, flash-attention-2 style on mma.sync m16n8k16 (BF16 in, FP32
// accumulate). Keys and values come from packed rows (AttentionParams) or, kPaged, from the
// paged KV cache (PagedKeys): then a sequence's n query rows are the last n of its context,
// row j at position context - n + j. A block owns one (sequence, query head) and a tile of
// kAttnBr query rows; each
// of its warps owns kAttnMTiles m16 tiles of those rows and keeps their O accumulators and
// softmax state in registers, so every K or V fragment read from shared memory feeds
// kAttnMTiles products. Q, K and V tiles are staged through shared memory (K and V double
// buffered, kAttnBc keys each).
//
// Fragment layouts: engine/mma.cuh. The C fragments of two adjacent n8 tiles of S are exactly
// the A fragment of P for the next product, without a trip through shared memory.

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = 32 * kAttnWarps;
constexpr int kAttnMTiles = 2;                          // m16 tiles per warp
constexpr int kAttnBr = 16 * kAttnMTiles * kAttnWarps;  // query rows per tile
constexpr int kAttnBc = 64;                             // keys per tile

// Shared memory of the attention kernel (dynamic): K and V tiles, two of each (the next
// tile loads while this one is used), and the Q tile.
template <int kHeadDim>
constexpr size_t AttentionSmemBytes() {
  return (4 * static_cast<size_t>(kAttnBc) + kAttnBr) * (kHeadDim + 8) * sizeof(uint16_t);
}

// Blocks of the attention kernel resident per SM (its __launch_bounds__); the launcher
// sizes the grid with it.
constexpr int kAttnBlocksPerSm = 2;

// Where the kernel's keys and values come from.
enum KeySource : int {
  kPackedRows = 0,  // AttentionParams k and v rows
  kPagedBf16 = 1,   // the paged cache, BF16: copied to shared memory asynchronously
  kPagedFp8 = 2,    // the paged cache, E4M3: loaded, widened to BF16 (exactly), stored
};

// Where a paged launch finds keys and values, and which sequences it takes:
// seqs[blockIdx.x / q_heads] (a host-made list; a sequence of fewer than two query rows in it
// is skipped). A packed launch leaves it empty.
struct PagedKeys {
  const void* cache = nullptr;
  int64_t k_offset = 0;  // elements (of the cache's type): (layer, K, block 0, head 0, slot 0)
  int64_t v_offset = 0;
  int64_t block_stride = 0;  // kv_heads * block_size * head_dim
  int block_size = 0;
  int num_blocks = 0;
  const int32_t* seqs = nullptr;
  const int32_t* context_lens = nullptr;
  const int32_t* block_tables = nullptr;
  int64_t max_blocks = 0;
  float v_scale = 1.0f;  // kPagedFp8: the layer's value scale (the key scale is in scale_log2)
};

template <int kHeadDim, int kSource>
__global__ void __launch_bounds__(kAttnThreads, kAttnBlocksPerSm)
    CausalAttentionKernel(AttentionParams p, PagedKeys pk, float scale_log2) {
  constexpr bool kPaged = kSource != kPackedRows;
  constexpr bool kFp8 = kSource == kPagedFp8;
  // Rows padded by 8 BF16 (16 bytes): rows stay 16-byte aligned for the copies, and the
  // ldmatrix row addresses of 8 consecutive rows hit distinct banks.
  constexpr int kPitch = kHeadDim + 8;
  constexpr int kVecsPerRow = kHeadDim / 8;
  constexpr int kKSteps = kHeadDim / 16;   // k-steps of Q.K^T
  constexpr int kDimTiles = kHeadDim / 8;  // n8 tiles of O
  constexpr int kKeyTiles = kAttnBc / 8;   // n8 tiles of S
  constexpr int kTileElems = kAttnBc * kPitch;
  constexpr int kWarpRows = 16 * kAttnMTiles;
  // Each thread copies the same 16-byte column of every kRowStep-th row of a tile.
  constexpr int kRowStep = kAttnThreads / kVecsPerRow;
  constexpr int kCopies = kAttnBc / kRowStep;
  constexpr int kQCopies = kAttnBr / kRowStep;
  static_assert(
      kAttnThreads % kVecsPerRow == 0 && kAttnBc % kRowStep == 0 && kAttnBr % kRowStep == 0,
      "tile copies");
  // [K buffer 0 | K buffer 1 | V buffer 0 | V buffer 1 | Q tile]
  extern __shared__ __align__(16) uint16_t attn_smem[];
  uint16_t* q_tile = attn_smem + 4 * kTileElems;

  // The sequence first, so that a block with no tile leaves at once (grid.y is sized for a
  // typical sequence of the bucket: a block whose y is at least its sequence's tile count has
  // nothing to do).
  // The launcher bounds num_seqs * q_heads and tokens by 2^31 - 1: 32-bit from here on.
  const int q_heads = static_cast<int>(p.q_heads);
  const int item = static_cast<int>(blockIdx.x) / q_heads;
  const int head = static_cast<int>(blockIdx.x) - item * q_heads;
  const int seq = kPaged ? pk.seqs[item] : item;
  const Fp8Divisor out_divisor = AttentionOutDivisor(p);
  // Clamped, so that a corrupt cu_seqlens cannot send a block outside [0, tokens).
  const int tokens = static_cast<int>(p.tokens);
  int begin = p.cu_seqlens[seq];
  int end = p.cu_seqlens[seq + 1];
  begin = begin < 0 ? 0 : (begin > tokens ? tokens : begin);
  end = end < begin ? begin : (end > tokens ? tokens : end);
  const int len = end - begin;
  const int num_tiles = len / kAttnBr + (len % kAttnBr != 0 ? 1 : 0);
  if (static_cast<int>(blockIdx.y) >= num_tiles) return;  // uniform over the block
  // Keys 0 .. key_len - 1 exist; query row r (from `begin`) is at position q_off + r.
  int key_len = len, q_off = 0;
  if constexpr (kPaged) {
    if (len < 2) return;  // the split kernels take it
    const int64_t cap = pk.max_blocks * pk.block_size;
    const int64_t c = pk.context_lens[seq];
    key_len = static_cast<int>(c < 0 ? 0 : (c > cap ? cap : c));
    q_off = key_len > len ? key_len - len : 0;
  }

  const int kv_head = head / (q_heads / static_cast<int>(p.kv_heads));
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;

  // Packed: the sequence's first key row. Paged: the layer's K and V at this KV head, and
  // the sequence's block table.
  const int64_t head_off = int64_t{kv_head} * (kPaged ? pk.block_size : 1) * kHeadDim;
  const uint16_t* k_base = nullptr;
  const uint16_t* v_base = nullptr;
  const uint8_t* k_base8 = nullptr;
  const uint8_t* v_base8 = nullptr;
  if constexpr (kFp8) {
    k_base8 = static_cast<const uint8_t*>(pk.cache) + pk.k_offset + head_off;
    v_base8 = static_cast<const uint8_t*>(pk.cache) + pk.v_offset + head_off;
  } else if constexpr (kPaged) {
    k_base = static_cast<const uint16_t*>(pk.cache) + pk.k_offset + head_off;
    v_base = static_cast<const uint16_t*>(pk.cache) + pk.v_offset + head_off;
  } else {
    k_base = reinterpret_cast<const uint16_t*>(p.k) + static_cast<int64_t>(begin) * p.k_row_stride +
             head_off;
    v_base = reinterpret_cast<const uint16_t*>(p.v) + static_cast<int64_t>(begin) * p.v_row_stride +
             head_off;
  }
  const int32_t* table =
      kPaged ? pk.block_tables + static_cast<int64_t>(seq) * pk.max_blocks : nullptr;
  float amax = 0.0f;  // of the BF16-rounded values this thread stores (out_amax)

  // This thread's share of every tile copy: rows copy_row + i * kRowStep, column copy_col.
  const int copy_row = threadIdx.x / kVecsPerRow;
  const int copy_col = (threadIdx.x % kVecsPerRow) * 8;
  const int64_t k_step = kRowStep * p.k_row_stride;
  const int64_t v_step = kRowStep * p.v_row_stride;
  // ldmatrix row addresses: lanes 8i..8i+7 give matrix i's rows.
  const int mat = lane >> 3;

  // Tiles from the last (the most keys) down, so the heaviest are scheduled first (blockIdx.y
  // varies slowest). Every condition below that guards a __syncthreads is uniform over the
  // block.
  for (int tile = num_tiles - 1 - static_cast<int>(blockIdx.y); tile >= 0;
       tile -= static_cast<int>(gridDim.y)) {
    const int q0 = tile * kAttnBr;
    const int warp_row0 = q0 + warp * kWarpRows;  // this warp's first query row
    // Causal: the tile's last row is q0 + kAttnBr - 1, so no key at or beyond kv_end matters;
    // this warp needs keys up to its own last row only.
    const int kv_end = min(q_off + q0 + kAttnBr, key_len);
    const int warp_kv_end = min(q_off + warp_row0 + kWarpRows, kv_end);

    // Starts loading the key tile at kv0 into buffer `buf` (one commit group per thread).
    auto load_tile = [&](int buf, int kv0) {
      uint16_t* k_dst = attn_smem + buf * kTileElems + copy_row * kPitch + copy_col;
      uint16_t* v_dst = attn_smem + (2 + buf) * kTileElems + copy_row * kPitch + copy_col;
      const int rows_left = kv_end - kv0 - copy_row;  // this thread's rows before kv_end
      if constexpr (kPaged) {
#pragma unroll
        for (int i = 0; i < kCopies; ++i) {
          // A key past kv_end, or in a block outside the pool (a corrupt table), is zeros:
          // no read outside the cache.
          const int pos = kv0 + copy_row + i * kRowStep;
          bool zero = i * kRowStep >= rows_left;
          int64_t off = 0;
          if (!zero) {
            const int b = table[pos / pk.block_size];
            zero = b < 0 || b >= pk.num_blocks;
            off = zero ? 0
                       : b * pk.block_stride + static_cast<int64_t>(pos % pk.block_size) * kHeadDim;
          }
          if constexpr (kFp8) {  // synchronous: E4M3 is widened on its way to shared memory
            uint4 kw = make_uint4(0, 0, 0, 0), vw = kw;
            if (!zero) {
              kw = Fp8x8ToBf16x8(*reinterpret_cast<const uint2*>(k_base8 + off + copy_col));
              vw = Fp8x8ToBf16x8(*reinterpret_cast<const uint2*>(v_base8 + off + copy_col));
            }
            *reinterpret_cast<uint4*>(k_dst + i * kRowStep * kPitch) = kw;
            *reinterpret_cast<uint4*>(v_dst + i * kRowStep * kPitch) = vw;
          } else {
            CopyAsync16(k_dst + i * kRowStep * kPitch, k_base + off + copy_col, zero);
            CopyAsync16(v_dst + i * kRowStep * kPitch, v_base + off + copy_col, zero);
          }
        }
      } else {
        const int64_t first = static_cast<int64_t>(kv0 + copy_row);
        const uint16_t* k_src = k_base + first * p.k_row_stride + copy_col;
        const uint16_t* v_src = v_base + first * p.v_row_stride + copy_col;
#pragma unroll
        for (int i = 0; i < kCopies; ++i) {
          // Zeros past kv_end: such keys are masked, and 0 * V must not meet a NaN there.
          // The address stays valid (the sequence's first row) when nothing is read.
          const bool past = i * kRowStep >= rows_left;
          CopyAsync16(k_dst + i * kRowStep * kPitch, past ? k_base + copy_col : k_src, past);
          CopyAsync16(v_dst + i * kRowStep * kPitch, past ? v_base + copy_col : v_src, past);
          k_src += k_step;
          v_src += v_step;
        }
      }
    };
    // The Q tile (zeros past the sequence) joins the first key tile's commit group.
    {
      const uint16_t* q_base = reinterpret_cast<const uint16_t*>(p.q) +
                               static_cast<int64_t>(begin) * p.q_row_stride +
                               int64_t{head} * kHeadDim;
      const int rows_left = len - q0 - copy_row;
      const uint16_t* q_src =
          q_base + static_cast<int64_t>(q0 + copy_row) * p.q_row_stride + copy_col;
      const int64_t q_step = kRowStep * p.q_row_stride;
#pragma unroll
      for (int i = 0; i < kQCopies; ++i) {
        const bool past = i * kRowStep >= rows_left;
        CopyAsync16(q_tile + (copy_row + i * kRowStep) * kPitch + copy_col,
                    past ? q_base + copy_col : q_src, past);
        q_src += q_step;
      }
    }
    load_tile(0, 0);
    CopyAsyncCommit();

    float o[kAttnMTiles][kDimTiles][4];
#pragma unroll
    for (int mt = 0; mt < kAttnMTiles; ++mt) {
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
      }
    }
    // Per m-tile and half (rows g, g + 8): the running max of the raw scores Q.K (the
    // positive scale is applied inside the exponent) and this thread's share of the sum.
    float row_max[kAttnMTiles][2], row_sum[kAttnMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kAttnMTiles; ++mt) {
      row_max[mt][0] = row_max[mt][1] = -INFINITY;
      row_sum[mt][0] = row_sum[mt][1] = 0.0f;
    }

    int buf = 0;
    for (int kv0 = 0; kv0 < kv_end; kv0 += kAttnBc, buf ^= 1) {
      // The next tile loads into the other buffer (everyone finished reading it at the end
      // of the previous step) while this one is used.
      if (kv_end - kv0 > kAttnBc) {
        load_tile(buf ^ 1, kv0 + kAttnBc);
        CopyAsyncCommit();
        CopyAsyncWait<1>();
      } else {
        CopyAsyncWait<0>();
      }
      __syncthreads();  // this tile (and the Q tile), from every thread's copies

      // A warp whose rows all precede the tile has nothing to add (causal); it only keeps
      // the block's barriers.
      if (kv0 < warp_kv_end) {
        const uint16_t* k_tile = attn_smem + buf * kTileElems;
        const uint16_t* v_tile = attn_smem + (2 + buf) * kTileElems;

        // S = Q K^T for this warp's rows and the tile's kAttnBc keys.
        float s[kAttnMTiles][kKeyTiles][4];
#pragma unroll
        for (int mt = 0; mt < kAttnMTiles; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
            s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
          }
        }
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          // A = Q rows (16 per m-tile) x dims ks*16..: matrices (rows 0-7 / 8-15, dims
          // 0-7 / 8-15), in the A register order.
          uint32_t a[kAttnMTiles][4];
#pragma unroll
          for (int mt = 0; mt < kAttnMTiles; ++mt) {
            LoadMatrixX4<false>(
                a[mt], q_tile + (warp * kWarpRows + mt * 16 + (mat & 1) * 8 + (lane & 7)) * kPitch +
                           ks * 16 + (mat >> 1) * 8);
          }
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; nt += 2) {
            // B[k = dim][n = key] = K[key][dim]: matrices (keys nt*8.., dims ks*16 + 0 / 8)
            // and the same for keys (nt+1)*8..; each lane's pair is (key g, dims 2t, 2t+1).
            uint32_t b[4];
            LoadMatrixX4<false>(b, k_tile + ((nt + (mat >> 1)) * 8 + (lane & 7)) * kPitch +
                                       ks * 16 + (mat & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < kAttnMTiles; ++mt) {
              MmaBf16(s[mt][nt], a[mt], b[0], b[1]);
              MmaBf16(s[mt][nt + 1], a[mt], b[2], b[3]);
            }
          }
        }

        uint32_t p_frag[kAttnMTiles][kAttnBc / 16][4];
#pragma unroll
        for (int mt = 0; mt < kAttnMTiles; ++mt) {
          const int row_lo = warp_row0 + mt * 16 + g;  // this thread's two rows
          // Masks: a key after the row (causal) or past the sequence. Only tiles that reach
          // the m-tile's diagonal or the sequence's end have any (warp-uniform).
          if (kv0 + kAttnBc - 1 > q_off + warp_row0 + mt * 16 || key_len - kv0 < kAttnBc) {
            // Element (nt, e) holds key kv0 + nt*8 + 2t + (e & 1) of row row_lo (e < 2) or
            // row_lo + 8: it is visible iff nt*8 + (e & 1) <= limit[e >> 1].
            const int last_key = key_len - 1 - kv0 - 2 * t;
            const int limit[2] = {min(q_off + row_lo - kv0 - 2 * t, last_key),
                                  min(q_off + row_lo + 8 - kv0 - 2 * t, last_key)};
#pragma unroll
            for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                if (nt * 8 + (e & 1) > limit[e >> 1]) s[mt][nt][e] = -INFINITY;
              }
            }
          }
          // The tile's row maxima (over the 4 lanes of a row).
          float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[mt][nt][e]);
          }
          float alpha[2];
          float base[2];  // the new max, in log2 units
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            alpha[i] = SoftmaxRowStep(tile_max[i], row_max[mt][i], scale_log2, base[i]);
          }
          // P, packed to BF16 at once (the A fragments of P V; it frees S's registers):
          // n8 tiles 2kk and 2kk+1 of S are the A fragment kk.
          float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
          for (int nt = 0; nt < kKeyTiles; ++nt) {
            float pr[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              pr[e] = Exp2Approx(fmaf(s[mt][nt][e], scale_log2, -base[e >> 1]));
              tile_sum[e >> 1] += pr[e];
            }
            p_frag[mt][nt >> 1][(nt & 1) * 2] = PackBf16x2(pr[0], pr[1]);
            p_frag[mt][nt >> 1][(nt & 1) * 2 + 1] = PackBf16x2(pr[2], pr[3]);
          }
#pragma unroll
          for (int i = 0; i < 2; ++i) row_sum[mt][i] = row_sum[mt][i] * alpha[i] + tile_sum[i];
#pragma unroll
          for (int dt = 0; dt < kDimTiles; ++dt) {
            o[mt][dt][0] *= alpha[0];
            o[mt][dt][1] *= alpha[0];
            o[mt][dt][2] *= alpha[1];
            o[mt][dt][3] *= alpha[1];
          }
        }

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < kAttnBc / 16; ++kk) {
#pragma unroll
          for (int dt = 0; dt < kDimTiles; dt += 2) {
            // B[k = key][n = dim] = V[key][dim], transposed on load: matrices (keys
            // kk*16 + 0 / 8.., dims dt*8..) and the same for dims (dt+1)*8..; each lane's
            // pair is (keys 2t, 2t+1 of its half, dim g).
            uint32_t b[4];
            LoadMatrixX4<true>(b, v_tile + (kk * 16 + (mat & 1) * 8 + (lane & 7)) * kPitch +
                                      (dt + (mat >> 1)) * 8);
#pragma unroll
            for (int mt = 0; mt < kAttnMTiles; ++mt) {
              MmaBf16(o[mt][dt], p_frag[mt][kk], b[0], b[1]);
              MmaBf16(o[mt][dt + 1], p_frag[mt][kk], b[2], b[3]);
            }
          }
        }
      }
      __syncthreads();  // everyone is done with this buffer before it loads again
    }

    // This thread's two adjacent values per n8 tile of each of its rows: BF16, and/or the
    // E4M3 codes of those BF16 values (what a quantize pass over `out` would give).
    const AttentionOut out = MakeAttentionOut(p, begin, head, kHeadDim, out_divisor);
    // Instantiated twice: with the branch-free division (checked once here) and with the
    // IEEE fallback; a per-value branch made this epilogue a third of the kernel's stalls
    // under a profiler.
    auto store = [&](auto fast_divide) {
#pragma unroll
      for (int mt = 0; mt < kAttnMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          StoreAttentionRow<decltype(fast_divide)::value, kDimTiles>(
              out, warp_row0 + mt * 16 + g + 8 * half, len, t, row_sum[mt][half], amax,
              [&](int dt) {
                if constexpr (kFp8) {  // the products read the values' codes
                  return make_float2(o[mt][dt][2 * half] * pk.v_scale,
                                     o[mt][dt][2 * half + 1] * pk.v_scale);
                } else {
                  return make_float2(o[mt][dt][2 * half], o[mt][dt][2 * half + 1]);
                }
              });
        }
      }
    };
    if (out.divisor.inv != 0.0f) {
      store(std::true_type{});
    } else {
      store(std::false_type{});
    }
    // The next tile's Q copy overwrites q_tile: every warp must be done reading it (the last
    // key step's barrier already ensures that; no extra barrier needed).
  }
  // Every thread of the block gets here (the tile loop's bounds are uniform).
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
}

// The kernel's tiles take more than the 48 KiB of shared memory a launch gets by default
// (head_dim 128: 104,448 bytes). The opt-in holds per device (context), and ranks may be
// threads of one process on several devices: set before every launch (a host-side call,
// allowed while a stream is captured; a graph replay does not repeat it).
template <int kHeadDim, int kSource>
Status LaunchAttention(dim3 grid, const AttentionParams& p, const PagedKeys& pk, float scale_log2,
                       cudaStream_t stream) {
  constexpr size_t kSmem = AttentionSmemBytes<kHeadDim>();
  TP_CUDA_CHECK(cudaFuncSetAttribute(CausalAttentionKernel<kHeadDim, kSource>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kSmem)));
  CausalAttentionKernel<kHeadDim, kSource>
      <<<grid, kAttnThreads, kSmem, stream>>>(p, pk, scale_log2);
  return Status::Ok();
}

constexpr double kLog2E = 1.4426950408889634;  // exp(x) = exp2(x * log2(e))

// The scores' factor in log2 units: exp(q.k / sqrt(head_dim)) = exp2(q.k * this).
float ScaleLog2(int64_t head_dim) {
  return static_cast<float>(kLog2E / std::sqrt(static_cast<double>(head_dim)));
}

// Query tiles of packed rows (p checked, at least one token and sequence): of the longest
// sequence (max_seqlen, capped by tokens) and of the average one.
struct QueryTiles {
  int64_t most, average;
};
QueryTiles CountQueryTiles(const AttentionParams& p) {
  const int64_t longest = p.max_seqlen < p.tokens ? p.max_seqlen : p.tokens;
  return {(longest + kAttnBr - 1) / kAttnBr,
          ((p.tokens + p.num_seqs - 1) / p.num_seqs + kAttnBr - 1) / kAttnBr};
}

}  // namespace

Status CheckCausalAttentionParams(const AttentionParams& p, bool reads_qkv, bool writes_out,
                                  cudaStream_t stream) {
  constexpr const char* kP = "AttentionParams";
  if (p.head_dim != 64 && p.head_dim != 128) {
    return UnimplementedError(std::string(kP) + ".head_dim = " + Str(p.head_dim) +
                              " is unsupported; supported: 64, 128");
  }
  if (p.kv_heads < 1) return BadField(kP, "kv_heads", p.kv_heads, "must be >= 1");
  if (p.q_heads < 1 || p.q_heads % p.kv_heads != 0) {
    return BadField(kP, "q_heads", p.q_heads,
                    "must be a positive multiple of kv_heads (" + Str(p.kv_heads) + ")");
  }
  if (p.num_seqs < 0) return BadField(kP, "num_seqs", p.num_seqs, "must be >= 0");
  // cu_seqlens are int32, and the kernel's row arithmetic (32-bit) runs up to a tile past
  // the last token.
  if (p.tokens < 0 || p.tokens > std::numeric_limits<int32_t>::max() - kAttnBr) {
    return BadField(kP, "tokens", p.tokens, "must be in [0, 2^31 - 1 - " + Str(kAttnBr) + "]");
  }
  if (writes_out && p.out == nullptr && p.out_fp8 == nullptr) {
    return InvalidArgumentError(std::string(kP) + ": out and out_fp8 are both null");
  }
  if (writes_out && p.out_fp8 != nullptr && p.out_fp8_scale == nullptr) {
    return NullField(kP, "out_fp8_scale", "when out_fp8 is set");
  }
  const struct {
    const char* name;
    int64_t stride;
    int64_t min;
    bool used;
  } strides[] = {
      {"q_row_stride", p.q_row_stride, p.q_heads * p.head_dim, reads_qkv},
      {"k_row_stride", p.k_row_stride, p.kv_heads * p.head_dim, reads_qkv},
      {"v_row_stride", p.v_row_stride, p.kv_heads * p.head_dim, reads_qkv},
      {"out_row_stride", p.out_row_stride, p.q_heads * p.head_dim, writes_out && p.out != nullptr},
      {"out_fp8_row_stride", p.out_fp8_row_stride, p.q_heads * p.head_dim,
       writes_out && p.out_fp8 != nullptr}};
  for (const auto& s : strides) {
    if (s.used && (s.stride < s.min || s.stride % 8 != 0)) {
      return BadField(kP, s.name, s.stride,
                      "must be a multiple of 8 and >= heads * head_dim (" + Str(s.min) + ")");
    }
  }
  // Nothing to attend: amax 0.
  if (writes_out) TP_RETURN_IF_ERROR(ZeroAmax(kP, p.out_amax, p.out, stream));
  if (p.num_seqs == 0 || p.tokens == 0) return Status::Ok();
  if (p.max_seqlen < 1) return BadField(kP, "max_seqlen", p.max_seqlen, "must be >= 1");
  if (p.num_seqs * p.q_heads > kMaxGridX) {
    return InvalidArgumentError(std::string(kP) + ": num_seqs * q_heads (" +
                                Str(p.num_seqs * p.q_heads) + ") exceeds 2^31 - 1");
  }
  TP_RETURN_IF_ERROR(CheckPointers(kP, {{"q", p.q, 16, reads_qkv},
                                        {"k", p.k, 16, reads_qkv},
                                        {"v", p.v, 16, reads_qkv},
                                        {"cu_seqlens", p.cu_seqlens, 4},
                                        {"work_counter", p.work_counter, 4, false}}));
  if (!writes_out) return Status::Ok();
  TP_RETURN_IF_ERROR(
      CheckPointers(kP, {{"out", p.out, 16, false}, {"out_fp8", p.out_fp8, 16, false}}));
  if (p.out_fp8 != nullptr) TP_RETURN_IF_ERROR(CheckScale(kP, "out_fp8_scale", p.out_fp8_scale));
  return Status::Ok();
}

Status LaunchCausalAttention(const AttentionParams& p, cudaStream_t stream) {
  constexpr const char* kP = "AttentionParams";
  TP_RETURN_IF_ERROR(CheckCausalAttentionParams(p, true, true, stream));
  if (p.num_seqs == 0 || p.tokens == 0) return Status::Ok();

  // grid.y: tiles per (sequence, head) in flight at once; a block takes tiles
  // num_tiles - 1 - y, then gridDim.y fewer each time. The longest sequence the bucket
  // allows would need no loop, but the graph is captured once per bucket, and for a batch of
  // many short sequences most of those blocks would find no tile, and each still costs a
  // launch and a read of cu_seqlens. So: the tiles of the average sequence, and at least
  // enough blocks that one long sequence alone occupies every SM.
  const bool wgmma = p.kernel != AttentionKernel::kMmaSync && WgmmaAttentionSupports(p.head_dim);
  if (p.kernel == AttentionKernel::kWgmma && !wgmma) {
    return UnimplementedError(std::string(kP) +
                              ".kernel = kWgmma needs an sm_90a build, a compute capability 9.0 "
                              "device and head_dim 128 (head_dim = " +
                              Str(p.head_dim) + ")");
  }
  static_assert(kWgmmaAttentionRows == kAttnBr, "one tile count for both kernels");
  const QueryTiles q_tiles = CountQueryTiles(p);
  TP_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSms());
  const float scale_log2 = ScaleLog2(p.head_dim);
  if (wgmma) {
    return LaunchCausalAttentionWgmma(p, q_tiles.most, q_tiles.average, sms, scale_log2, stream);
  }
  const int64_t fill = (int64_t{sms} * kAttnBlocksPerSm + p.q_heads - 1) / p.q_heads;
  int64_t tiles = std::max(q_tiles.average, fill);
  tiles = std::min({tiles, q_tiles.most, kMaxGridY});
  const dim3 grid(static_cast<unsigned>(p.num_seqs * p.q_heads), static_cast<unsigned>(tiles));
  if (p.head_dim == 64) {
    TP_RETURN_IF_ERROR(
        (LaunchAttention<64, kPackedRows>(grid, p, PagedKeys{}, scale_log2, stream)));
  } else {
    TP_RETURN_IF_ERROR(
        (LaunchAttention<128, kPackedRows>(grid, p, PagedKeys{}, scale_log2, stream)));
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchCausalAttentionFp8(const AttentionParams& p, const Fp8AttentionInputs& in,
                                cudaStream_t stream) {
  // The E4M3 inputs first: an unsupported head_dim or device is named before anything else.
  TP_RETURN_IF_ERROR(CheckFp8AttentionInputs(p, in));
  TP_RETURN_IF_ERROR(CheckCausalAttentionParams(p, false, true, stream));
  if (p.num_seqs == 0 || p.tokens == 0) return Status::Ok();
  const QueryTiles q_tiles = CountQueryTiles(p);
  TP_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSms());
  return LaunchCausalAttentionWgmmaFp8(p, in, q_tiles.most, q_tiles.average, sms,
                                       ScaleLog2(p.head_dim), stream);
}

Status LaunchPagedPrefillAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  constexpr const char* kP = "PagedAttentionParams";
  // The rest was checked by LaunchPagedAttention, its only caller.
  if (p.tokens > std::numeric_limits<int32_t>::max() - kAttnBr) {
    return BadField(kP, "tokens", p.tokens, "must be at most 2^31 - 1 - " + Str(kAttnBr));
  }
  if (p.multi_row_count * p.q_heads > kMaxGridX) {
    return InvalidArgumentError(std::string(kP) + ": multi_row_count * q_heads (" +
                                Str(p.multi_row_count * p.q_heads) + ") exceeds 2^31 - 1");
  }
  const int64_t hd = p.layout.head_dim;
  PagedKeys pk;
  pk.cache = p.cache;
  pk.k_offset = p.layout.Offset(p.layer, 0, 0, 0, 0);
  pk.v_offset = p.layout.Offset(p.layer, 1, 0, 0, 0);
  pk.block_stride = p.layout.kv_heads * p.layout.block_size * hd;
  pk.block_size = static_cast<int>(p.layout.block_size);
  pk.num_blocks = static_cast<int>(p.layout.num_blocks);
  pk.seqs = p.multi_row_seqs;
  pk.context_lens = p.context_lens;
  pk.block_tables = p.block_tables;
  pk.max_blocks = p.max_blocks;
  AttentionParams a;
  a.q = p.q;
  a.q_row_stride = p.q_row_stride;
  a.out = p.out;
  a.out_row_stride = p.out_row_stride;
  a.out_fp8 = p.out_fp8;
  a.out_fp8_row_stride = p.out_fp8_row_stride;
  a.out_fp8_scale = p.out_fp8_scale;
  a.cu_seqlens = p.cu_seqlens;
  a.num_seqs = p.multi_row_count;
  a.tokens = p.tokens;
  a.q_heads = p.q_heads;
  a.kv_heads = p.layout.kv_heads;
  a.head_dim = hd;
  // A block per (listed sequence, head, query tile of the longest): blocks past their own
  // sequence's tiles leave at once.
  const int64_t rows = p.max_query_rows > 0 ? std::min(p.max_query_rows, p.tokens) : p.tokens;
  const int64_t tiles = std::min((rows + kAttnBr - 1) / kAttnBr, kMaxGridY);
  const bool fp8_cache = p.layout.dtype == KvCacheDtype::kFloat8E4M3;
  // Over E4M3 the products read the codes: the key scale joins the score scale, the value
  // scale multiplies the output (PagedAttentionParams::scales).
  const float scale = ScaleLog2(hd) * (fp8_cache ? p.scales.k : 1.0f);
  pk.v_scale = fp8_cache ? p.scales.v : 1.0f;
  if (!fp8_cache &&
      WgmmaPagedAttentionSupports(hd, p.layout.block_size, p.layout.Elements() / hd)) {
    WgmmaPagedKeys wk;
    wk.cache = p.cache;
    wk.cache_rows = p.layout.Elements() / hd;
    wk.k_row0 = pk.k_offset / hd;
    wk.v_row0 = pk.v_offset / hd;
    wk.block_rows = p.layout.kv_heads * p.layout.block_size;
    wk.block_size = pk.block_size;
    wk.num_blocks = pk.num_blocks;
    wk.seqs = pk.seqs;
    wk.context_lens = pk.context_lens;
    wk.block_tables = pk.block_tables;
    wk.max_blocks = pk.max_blocks;
    TP_ASSIGN_OR_RETURN(const int sms, CurrentDeviceSms());
    return LaunchPagedPrefillAttentionWgmma(a, wk, std::max<int64_t>(1, tiles), sms, scale, stream);
  }
  const dim3 grid(static_cast<unsigned>(p.multi_row_count * p.q_heads),
                  static_cast<unsigned>(std::max<int64_t>(1, tiles)));
  if (hd == 64) {
    TP_RETURN_IF_ERROR((fp8_cache ? LaunchAttention<64, kPagedFp8>(grid, a, pk, scale, stream)
                                  : LaunchAttention<64, kPagedBf16>(grid, a, pk, scale, stream)));
  } else {
    TP_RETURN_IF_ERROR((fp8_cache ? LaunchAttention<128, kPagedFp8>(grid, a, pk, scale, stream)
                                  : LaunchAttention<128, kPagedBf16>(grid, a, pk, scale, stream)));
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
