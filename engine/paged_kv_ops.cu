// Kernels and launchers for engine/paged_kv_ops.h. Plain CUDA C++17: host logic beyond
// argument checks and launch shapes belongs in .cc files (nvcc 13.0's front end is fragile,
// see GPU_HOST.md).
//
// BF16 travels as its raw bits (uint16_t), eight to a 16-byte vector.
#include "engine/paged_kv_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "comm/cuda_check.h"
#include "engine/device_math.cuh"
#include "engine/launch_checks.h"
#include "engine/mma.cuh"
#include "layers/kernel_grid.h"

namespace tpserve {
namespace {

using namespace launch_checks;
using namespace device;

std::string Str(int64_t v) { return std::to_string(v); }

// ---------------------------------------------------------------------------------------------
// Paged attention.
//
// A CTA of kAttnWarps warps owns up to kPairsPerCta = kAttnWarps x kPpw (query row, head) pairs
// of one (sequence, KV head), kPpw being PairsPerWarp's 1, 2 or 4: the pairs of a sequence and KV
// head are numbered row-major (pair = j * group + g), and tile t is pairs [t * kPairsPerCta, ...).
// Warp w holds pairs w, w + kAttnWarps, ... in registers (its running max, sum and kHeadDim / 32
// output dims per lane). The keys go by tiles of 32, staged in shared memory as FP32 (K padded by
// one column so that lane = key reads are conflict-free); a lane scores one key against each of the
// warp's pairs, then the warp's pairs accumulate P.V with lane = output dims. Scores are in log2
// units (q is scaled by log2(e) / sqrt(head_dim) when staged).

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * 32;
// Pairs per warp: 4 when a CTA's tile has query rows enough (prefill), fewer when it has
// only one row's group of heads (decode), so that no warp computes scores for pairs that do
// not exist; the kernel is instantiated for 1, 2 and 4.
constexpr int kMaxPairsPerWarp = 4;
constexpr int kKeyTile = 32;
constexpr int64_t kMinSplitKeys = 256;
constexpr int64_t kMaxSplits = 32;

struct AttnArgs {
  const BFloat16* q;
  int64_t q_row_stride;
  const uint8_t* cache;  // bytes
  int64_t k_offset;      // elements: (layer, K, block 0, head 0, slot 0)
  int64_t v_offset;
  int num_blocks;
  int block_size;
  int kv_heads;
  int q_heads;
  int group;
  const int32_t* cu_seqlens;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int64_t max_blocks;
  int tokens;
  BFloat16* out;
  int64_t out_row_stride;
  float* ws_acc;  // [splits][tokens][q_heads][head_dim]
  float* ws_ml;   // [splits][tokens][q_heads][2]: running max (log2 units), sum
  int splits;
  int chunk;  // keys per split (a multiple of kKeyTile); the last split takes the rest
  float scale_log2;
  int max_rows;     // sequences of more query rows are another kernel's (multi_row_seqs)
  int block_shift;  // log2(block_size) when it is a power of two, else -1
};

// The query rows of sequence s, clamped: [*begin, *begin + *n), and its context length.
__device__ __forceinline__ void SequenceRows(const AttnArgs& a, int s, int* begin, int* n,
                                             int* ctx) {
  int b = a.cu_seqlens[s], e = a.cu_seqlens[s + 1];
  b = min(max(b, 0), a.tokens);
  e = min(max(e, b), a.tokens);
  *begin = b;
  *n = e - b;
  const int64_t cap = a.max_blocks * a.block_size;
  const int64_t c = a.context_lens[s];
  *ctx = static_cast<int>(c < 0 ? 0 : (c > cap ? cap : c));
}

template <int kHeadDim, bool kFp8, int kPpw>
__global__ void __launch_bounds__(kAttnThreads) PagedAttentionKernel(AttnArgs a) {
  constexpr int kPairsPerCta = kAttnWarps * kPpw;
  constexpr int kPerLane = kHeadDim / 32;
  constexpr int kVecs = kHeadDim / 8;
  __shared__ float k_s[kKeyTile][kHeadDim + 1];
  __shared__ __align__(16) float v_s[kKeyTile][kHeadDim];
  __shared__ __align__(16) float q_s[kPairsPerCta][kHeadDim];
  __shared__ float p_s[kAttnWarps][kPpw][32];
  __shared__ int64_t key_off_s[kKeyTile];  // element offset of the key's (block, head, slot); -1

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int s = blockIdx.x / a.kv_heads, kvh = blockIdx.x % a.kv_heads;
  const int split = blockIdx.z;
  int row_begin, n, ctx;
  SequenceRows(a, s, &row_begin, &n, &ctx);
  if (n > a.max_rows) return;
  const int total_pairs = n * a.group;
  const int num_tiles = (total_pairs + kPairsPerCta - 1) / kPairsPerCta;
  const int key_lo = split * a.chunk;
  const int key_hi = split == a.splits - 1 ? INT_MAX : key_lo + a.chunk;
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks;
  const int64_t head_stride = static_cast<int64_t>(a.block_size) * kHeadDim;
  const int64_t block_stride = a.kv_heads * head_stride;
  const int first_pos = ctx - n;  // position of query row 0 (negative: corrupt lengths)

  for (int tile = blockIdx.y; tile < num_tiles; tile += gridDim.y) {
    const int pair0 = tile * kPairsPerCta;
    const int npairs = min(kPairsPerCta, total_pairs - pair0);
    for (int i = threadIdx.x; i < kPairsPerCta * kVecs; i += kAttnThreads) {
      const int pr = i / kVecs, c = i % kVecs;
      float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (pr < npairs) {
        const int pair = pair0 + pr, j = pair / a.group, g = pair % a.group;
        const int head = kvh * a.group + g;
        const BFloat16* src = a.q + static_cast<int64_t>(row_begin + j) * a.q_row_stride +
                              static_cast<int64_t>(head) * kHeadDim + c * 8;
        UnpackBf16x8(*reinterpret_cast<const uint4*>(src), f);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) q_s[pr][c * 8 + e] = f[e] * a.scale_log2;
    }
    // Keys this tile needs: up to the last pair's position, inside this split's range.
    const int last_row = (pair0 + npairs - 1) / a.group;
    const int key_end = min(first_pos + last_row + 1, key_hi);
    int my_pos[kPpw];
    float m[kPpw], l[kPpw], acc[kPpw][kPerLane];
#pragma unroll
    for (int k = 0; k < kPpw; ++k) {
      const int pr = warp + k * kAttnWarps;
      my_pos[k] = pr < npairs ? first_pos + (pair0 + pr) / a.group : -1;
      m[k] = -INFINITY;
      l[k] = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[k][i] = 0.0f;
    }
    __syncthreads();  // q_s

    for (int t0 = key_lo; t0 < key_end; t0 += kKeyTile) {
      if (threadIdx.x < kKeyTile) {
        const int pos = t0 + threadIdx.x;
        int64_t off = -1;
        if (pos < key_end) {
          const int b = table[pos / a.block_size];
          if (b >= 0 && b < a.num_blocks) {
            off = b * block_stride + kvh * head_stride +
                  static_cast<int64_t>(pos % a.block_size) * kHeadDim;
          }
        }
        key_off_s[threadIdx.x] = off;
      }
      __syncthreads();
      for (int i = threadIdx.x; i < kKeyTile * kVecs; i += kAttnThreads) {
        const int key = i / kVecs, c = i % kVecs;
        const int64_t off = key_off_s[key];
        float kf[8] = {0, 0, 0, 0, 0, 0, 0, 0}, vf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (off >= 0) {
          if (kFp8) {
            UnpackFp8x8(*reinterpret_cast<const uint2*>(a.cache + a.k_offset + off + c * 8), kf);
            UnpackFp8x8(*reinterpret_cast<const uint2*>(a.cache + a.v_offset + off + c * 8), vf);
          } else {
            const uint16_t* base = reinterpret_cast<const uint16_t*>(a.cache);
            UnpackBf16x8(*reinterpret_cast<const uint4*>(base + a.k_offset + off + c * 8), kf);
            UnpackBf16x8(*reinterpret_cast<const uint4*>(base + a.v_offset + off + c * 8), vf);
          }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) k_s[key][c * 8 + e] = kf[e];
        *reinterpret_cast<float4*>(&v_s[key][c * 8]) = make_float4(vf[0], vf[1], vf[2], vf[3]);
        *reinterpret_cast<float4*>(&v_s[key][c * 8 + 4]) = make_float4(vf[4], vf[5], vf[6], vf[7]);
      }
      __syncthreads();

      // Scores: lane = key.
      float sc[kPpw];
#pragma unroll
      for (int k = 0; k < kPpw; ++k) sc[k] = 0.0f;
#pragma unroll 8
      for (int d = 0; d < kHeadDim; d += 4) {
        const float k0 = k_s[lane][d], k1 = k_s[lane][d + 1], k2 = k_s[lane][d + 2],
                    k3 = k_s[lane][d + 3];
#pragma unroll
        for (int k = 0; k < kPpw; ++k) {
          const float4 qv = *reinterpret_cast<const float4*>(&q_s[warp + k * kAttnWarps][d]);
          sc[k] = fmaf(qv.x, k0, sc[k]);
          sc[k] = fmaf(qv.y, k1, sc[k]);
          sc[k] = fmaf(qv.z, k2, sc[k]);
          sc[k] = fmaf(qv.w, k3, sc[k]);
        }
      }
      const int key_pos = t0 + lane;
      const bool key_ok = key_off_s[lane] >= 0;
#pragma unroll
      for (int k = 0; k < kPpw; ++k) {
        const float score = key_ok && key_pos <= my_pos[k] ? sc[k] : -INFINITY;
        const float m_new = fmaxf(m[k], WarpMax(score));
        float p = 0.0f, alpha = 1.0f;
        if (m_new != -INFINITY) {  // warp-uniform
          p = exp2f(score - m_new);
          alpha = exp2f(m[k] - m_new);
        }
        l[k] = l[k] * alpha + WarpSum(p);
        m[k] = m_new;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[k][i] *= alpha;
        p_s[warp][k][lane] = p;
      }
      __syncwarp();
      for (int key = 0; key < kKeyTile; ++key) {
        float vv[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) vv[i] = v_s[key][lane + 32 * i];
#pragma unroll
        for (int k = 0; k < kPpw; ++k) {
          const float p = p_s[warp][k][key];
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) acc[k][i] = fmaf(p, vv[i], acc[k][i]);
        }
      }
      __syncthreads();  // k_s, v_s, p_s and key_off_s are rewritten next
    }

#pragma unroll
    for (int k = 0; k < kPpw; ++k) {
      const int pr = warp + k * kAttnWarps;
      if (pr >= npairs) continue;
      const int pair = pair0 + pr, j = pair / a.group, g = pair % a.group;
      const int head = kvh * a.group + g;
      const int64_t tok = row_begin + j;
      if (a.splits == 1) {
        const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
        uint16_t* dst = reinterpret_cast<uint16_t*>(a.out) + tok * a.out_row_stride +
                        static_cast<int64_t>(head) * kHeadDim;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          dst[lane + 32 * i] = static_cast<uint16_t>(FloatToBf16(acc[k][i] * inv));
        }
      } else {
        const int64_t slot = (static_cast<int64_t>(split) * a.tokens + tok) * a.q_heads + head;
        float* dst = a.ws_acc + slot * kHeadDim;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) dst[lane + 32 * i] = acc[k][i];
        if (lane == 0) {
          a.ws_ml[2 * slot] = m[k];
          a.ws_ml[2 * slot + 1] = l[k];
        }
      }
    }
    // The next tile rewrites q_s: every warp must be done reading it (a tile with no keys
    // runs no key loop, whose barriers would otherwise cover this).
    __syncthreads();
  }
}

// Decode attention (one query row per sequence) on tensor cores. A CTA per (sequence, KV
// head, split) multiplies the split's keys with the KV head's kGroup query heads, which are
// the n8 columns of S^T = K.Q^T (keys are the m16 rows, so no MMA row is padding), and
// O^T += V^T.P^T. Keys and values stream through shared memory in tiles of kDecodeKeys keys,
// several tiles in flight (cp.async): a decode step is bound by the bytes it keeps in flight.
// Warp w takes keys [16w, 16w + 16) of every tile and keeps its own online softmax (m, l)
// and O^T accumulators in registers, without block barriers beyond the pipeline's; at the end
// the CTA merges its warps'. The MMAs are BF16 with FP32 accumulation (Q and K are BF16
// already: exact products); for P.V, P is split into its BF16 rounding and the BF16 rounding
// of the remainder, two MMAs, so P keeps about 16 bits and the result stays within FP32-math
// error of the reference. An E4M3 cache is copied as codes and each warp widens its own keys
// to BF16 (exactly) before its MMAs.
// A sequence's context is cut into splits on the device, from its own length (at most
// a.splits of at least kDecodeMinSplitKeys keys each), so one graph serves every context; a
// split past the context writes an empty partial (m = -inf, l = 0) for the combine pass.
constexpr int kDecodeKeys = 16 * kAttnWarps;  // keys per tile
constexpr int kDecodeMinSplitKeys = kDecodeKeys;

// Dynamic shared memory of the decode kernel:
// [stages x (K tile | V tile)] [FP8: per-warp BF16 rows] [Q tile] [key flags].
// A step's loads wait on a loaded HBM's latency, so the bytes in flight per SM set its speed:
// as many stages as let two CTAs share an SM (head_dim 128: 3 BF16 stages of 34 KiB, 5 E4M3
// stages of 18 KiB; each CTA has up to stages - 1 tiles in flight while it computes).
template <int kHeadDim, bool kFp8>
struct DecodeSmem {
  static constexpr int kStages = kFp8 ? 5 : 3;
  // BF16 rows padded by 16 bytes: rows stay 16-byte aligned for cp.async, and the ldmatrix
  // row addresses of 8 consecutive rows fall on distinct banks.
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kRowBytes = kFp8 ? kHeadDim + 16 : 2 * kPitch;    // a cache row staged
  static constexpr int kPieces = (kFp8 ? kHeadDim : 2 * kHeadDim) / 16;  // 16 B copies a row
  static constexpr int kTileBytes = kDecodeKeys * kRowBytes;
  static constexpr int kStagesBytes = kStages * 2 * kTileBytes;
  static constexpr int kWidenBytes = kFp8 ? kAttnWarps * 16 * kPitch * 2 : 0;
  static constexpr int kQBytes = 8 * kPitch * 2;
  static constexpr int kFlagBytes = kStages * kDecodeKeys * 4;
  static constexpr int kBytes = kStagesBytes + kWidenBytes + kQBytes + kFlagBytes;
  // Two CTAs per SM: 228 KiB of shared memory, 1 KiB of it reserved per CTA.
  static_assert(2 * (kBytes + 1024) <= 228 * 1024, "two CTAs per SM");
  // The warps' merge reuses the stages once the pipeline has drained.
  static_assert(kAttnWarps * 8 * (kHeadDim + 2) * 4 <= kStagesBytes, "merge area");
};

template <int kHeadDim, bool kFp8, int kGroup>
__global__ void __launch_bounds__(kAttnThreads, 2) PagedDecodeAttentionKernel(AttnArgs a) {
  using L = DecodeSmem<kHeadDim, kFp8>;
  constexpr int kPitch = L::kPitch;
  constexpr int kKSteps = kHeadDim / 16;  // k-steps of K.Q^T
  constexpr int kMTiles = kHeadDim / 16;  // m16 tiles (of dims) of O^T
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  // Each thread copies the same 16-byte piece of every kRowStep-th row of a tile.
  constexpr int kRowStep = kAttnThreads / L::kPieces;
  constexpr int kCopies = kDecodeKeys / kRowStep;
  static_assert(kAttnThreads % L::kPieces == 0 && kDecodeKeys % kRowStep == 0, "tile copies");
  static_assert(kGroup <= 8, "the query heads of a KV head are the n8 columns of S^T");
  extern __shared__ __align__(16) uint8_t decode_smem[];
  uint8_t* stages = decode_smem;
  uint16_t* widen = reinterpret_cast<uint16_t*>(decode_smem + L::kStagesBytes);
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(decode_smem + L::kStagesBytes + L::kWidenBytes);
  int* key_ok = reinterpret_cast<int*>(decode_smem + L::kStagesBytes + L::kWidenBytes + L::kQBytes);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3, mat = lane >> 3;
  const int s = blockIdx.x / a.kv_heads, kvh = blockIdx.x % a.kv_heads;
  const int split = blockIdx.z;
  int row_begin, n, ctx;
  SequenceRows(a, s, &row_begin, &n, &ctx);
  if (n > a.max_rows) return;
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks;
  const int64_t head_stride = static_cast<int64_t>(a.block_size) * kHeadDim;
  const int64_t block_stride = a.kv_heads * head_stride;
  // This sequence's splits: as many as have kDecodeMinSplitKeys keys, at most a.splits.
  const int used = max(1, min(a.splits, (ctx + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys));
  const int chunk = ((ctx + used - 1) / used + kDecodeKeys - 1) / kDecodeKeys * kDecodeKeys;
  const int key_lo = split < used ? split * chunk : ctx;
  const int key_hi = split < used ? min(ctx, key_lo + chunk) : ctx;
  const int piece = threadIdx.x % L::kPieces, copy_row = threadIdx.x / L::kPieces;

  for (int j = 0; j < n; ++j) {  // one row per sequence in decode; more are taken in turn
    const int64_t tok = row_begin + j;
    const int key_end = min(ctx - n + j + 1, key_hi);  // causal: keys up to the row's position
    const int tiles = key_end > key_lo ? (key_end - key_lo + kDecodeKeys - 1) / kDecodeKeys : 0;

    // Tile i's keys key_lo + i * kDecodeKeys + r: first their block ids (a global load whose
    // latency the next tile's compute hides: fetched one tile before they are used), then
    // their K and V rows into stage i % kStages (zeros for a key past key_end or behind a bad
    // table entry, flagged in key_ok).
    int blocks[kCopies];
    auto fetch_blocks = [&](int i) {
#pragma unroll
      for (int c = 0; c < kCopies; ++c) {
        const int pos = key_lo + i * kDecodeKeys + copy_row + c * kRowStep;
        const int bi = a.block_shift >= 0 ? pos >> a.block_shift : pos / a.block_size;
        blocks[c] = pos < key_end ? table[bi] : -1;
      }
    };
    auto load_tile = [&](int i) {
      uint8_t* st = stages + (i % L::kStages) * 2 * L::kTileBytes;
      int* ok = key_ok + (i % L::kStages) * kDecodeKeys;
#pragma unroll
      for (int c = 0; c < kCopies; ++c) {
        const int r = copy_row + c * kRowStep;
        const int pos = key_lo + i * kDecodeKeys + r;
        const int b = blocks[c];
        const bool zero = b < 0 || b >= a.num_blocks;  // also past key_end (b = -1)
        const int slot = a.block_shift >= 0 ? pos & (a.block_size - 1) : pos % a.block_size;
        const int64_t off =
            zero ? 0 : b * block_stride + kvh * head_stride + static_cast<int64_t>(slot) * kHeadDim;
        const uint8_t* k_src = a.cache + (zero ? 0 : (a.k_offset + off) * kElemBytes) + piece * 16;
        const uint8_t* v_src = a.cache + (zero ? 0 : (a.v_offset + off) * kElemBytes) + piece * 16;
        uint8_t* k_dst = st + r * L::kRowBytes + piece * 16;
        CopyAsync16(reinterpret_cast<uint16_t*>(k_dst), reinterpret_cast<const uint16_t*>(k_src),
                    zero);
        CopyAsync16(reinterpret_cast<uint16_t*>(k_dst + L::kTileBytes),
                    reinterpret_cast<const uint16_t*>(v_src), zero);
        if (piece == 0) ok[r] = zero ? 0 : 1;
      }
    };
#pragma unroll
    for (int i = 0; i < L::kStages - 1; ++i) {
      if (i < tiles) {
        fetch_blocks(i);
        load_tile(i);
      }
      CopyAsyncCommit();  // empty groups too: the wait below counts groups
    }
    if (L::kStages - 1 < tiles) fetch_blocks(L::kStages - 1);

    // Q: this KV head's kGroup query heads as rows 0 .. kGroup - 1 of an 8-row tile (the
    // others zero), the n8 columns of S^T = K.Q^T.
    constexpr int kQVecs = kHeadDim / 8;
    for (int i = threadIdx.x; i < 8 * kQVecs; i += kAttnThreads) {
      const int r = i / kQVecs, c = i % kQVecs;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < kGroup) {
        v = *reinterpret_cast<const uint4*>(
            a.q + tok * a.q_row_stride + static_cast<int64_t>(kvh * kGroup + r) * kHeadDim + c * 8);
      }
      *reinterpret_cast<uint4*>(q_tile + r * kPitch + c * 8) = v;
    }
    __syncthreads();  // q_tile
    // B fragments of Q^T (k = dims, n = queries), two k-steps per ldmatrix.
    uint32_t qb[kKSteps][2];
#pragma unroll
    for (int ks = 0; ks < kKSteps; ks += 2) {
      uint32_t r[4];
      LoadMatrixX4<false>(r, q_tile + (lane & 7) * kPitch + ks * 16 + mat * 8);
      qb[ks][0] = r[0];
      qb[ks][1] = r[1];
      qb[ks + 1][0] = r[2];
      qb[ks + 1][1] = r[3];
    }

    // Queries 2t and 2t + 1 (the columns this lane holds): running max (log2 units) and this
    // lane's share of the sum; O^T's m16 tiles of dims (rows g, g + 8) x those queries.
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    float o[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    // The P^T fragment of lane (g, t) holds keys 2t, 2t + 1 (+ 8) of query g: those keys'
    // scores sit in lanes 8t + g / 2 (keys 2t, 2t + 8) and 8t + 4 + g / 2 (keys 2t + 1, 2t + 9),
    // in their query half g % 2.
    const int src_even = 8 * t + (g >> 1), src_odd = src_even + 4;
    const unsigned half_sel = (g & 1) ? 0x7632u : 0x5410u;  // __byte_perm: high or low halves

    for (int i = 0; i < tiles; ++i) {
      CopyAsyncWait<L::kStages - 2>();
      __syncthreads();  // tile i has landed for every thread; tile i - 1's stage is free
      if (i + L::kStages - 1 < tiles) {
        load_tile(i + L::kStages - 1);
        if (i + L::kStages < tiles) fetch_blocks(i + L::kStages);
      }
      CopyAsyncCommit();
      const int stage = i % L::kStages;
      if (key_lo + i * kDecodeKeys + 16 * warp >= key_end) continue;  // warp-uniform
      const uint8_t* st = stages + stage * 2 * L::kTileBytes;
      const int* ok = key_ok + stage * kDecodeKeys + 16 * warp;
      // An E4M3 tile's rows are widened into the warp's BF16 rows, K first, then V (after
      // the S product has read K).
      uint16_t* w = kFp8 ? widen + warp * 16 * kPitch : nullptr;
      auto widen_rows = [&](int kv) {
#pragma unroll
        for (int e = lane; e < 16 * kQVecs; e += 32) {
          const int r = e / kQVecs, c = e % kQVecs;
          const uint2 raw = *reinterpret_cast<const uint2*>(st + kv * L::kTileBytes +
                                                            (16 * warp + r) * L::kRowBytes + c * 8);
          *reinterpret_cast<uint4*>(w + r * kPitch + c * 8) = Fp8x8ToBf16x8(raw);
        }
        __syncwarp();
      };
      const uint16_t* k_rows;
      const uint16_t* v_rows;
      if constexpr (kFp8) {
        widen_rows(0);
        k_rows = w;
        v_rows = w;
      } else {
        k_rows = reinterpret_cast<const uint16_t*>(st) + 16 * warp * kPitch;
        v_rows = reinterpret_cast<const uint16_t*>(st + L::kTileBytes) + 16 * warp * kPitch;
      }
      // S^T = K.Q^T: the warp's 16 keys (rows) by the 8 query columns.
      // Two accumulators (even and odd k-steps) halve the chain of dependent MMAs.
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sc_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t ka[4];
        LoadMatrixX4<false>(
            ka, k_rows + ((mat & 1) * 8 + (lane & 7)) * kPitch + ks * 16 + (mat >> 1) * 8);
        MmaBf16((ks & 1) ? sc_odd : sc, ka, qb[ks][0], qb[ks][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[e] += sc_odd[e];
      // sc: (key g, queries 2t, 2t + 1), (key g + 8, same queries); log2 units, masked -inf.
      const bool ok_lo = ok[g] != 0, ok_hi = ok[g + 8] != 0;
      float v[4];
      v[0] = ok_lo ? sc[0] * a.scale_log2 : -INFINITY;
      v[1] = ok_lo ? sc[1] * a.scale_log2 : -INFINITY;
      v[2] = ok_hi ? sc[2] * a.scale_log2 : -INFINITY;
      v[3] = ok_hi ? sc[3] * a.scale_log2 : -INFINITY;
      float pr[4], alpha[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        float mx = fmaxf(v[q], v[q + 2]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m_run[q], mx);
        const float base = m_new == -INFINITY ? 0.0f : m_new;
        alpha[q] = Exp2Approx(m_run[q] - base);  // 0 while m_run is -inf
        pr[q] = Exp2Approx(v[q] - base);
        pr[q + 2] = Exp2Approx(v[q + 2] - base);
        l_run[q] = l_run[q] * alpha[q] + pr[q] + pr[q + 2];
        m_run[q] = m_new;
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        o[mt][0] *= alpha[0];
        o[mt][1] *= alpha[1];
        o[mt][2] *= alpha[0];
        o[mt][3] *= alpha[1];
      }
      // P as BF16 pairs (queries 2t, 2t + 1) of keys g and g + 8: its rounding and the
      // rounding of the remainder; then moved to the P^T fragment layout.
      uint32_t hi[2], lo[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        hi[k] = PackBf16x2(pr[2 * k], pr[2 * k + 1]);
        lo[k] = PackBf16x2(pr[2 * k] - Bf16ToFloat(hi[k] & 0xFFFFu),
                           pr[2 * k + 1] - Bf16ToFloat(hi[k] >> 16));
      }
      uint32_t ph[2], pl[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {  // k = 0: keys 2t, 2t + 1; k = 1: keys 2t + 8, 2t + 9
        ph[k] = __byte_perm(__shfl_sync(0xffffffffu, hi[k], src_even),
                            __shfl_sync(0xffffffffu, hi[k], src_odd), half_sel);
        pl[k] = __byte_perm(__shfl_sync(0xffffffffu, lo[k], src_even),
                            __shfl_sync(0xffffffffu, lo[k], src_odd), half_sel);
      }
      if constexpr (kFp8) {
        __syncwarp();  // every lane's K fragments are read
        widen_rows(1);
      }
      // O^T += V^T.P^T: A fragments of V^T (dims x keys) by ldmatrix.trans of the V rows.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t va[4];
        LoadMatrixX4<true>(
            va, v_rows + ((mat >> 1) * 8 + (lane & 7)) * kPitch + mt * 16 + (mat & 1) * 8);
        MmaBf16(o[mt], va, ph[0], ph[1]);
        MmaBf16(o[mt], va, pl[0], pl[1]);
      }
      if constexpr (kFp8) __syncwarp();  // the widened rows are rewritten for the next tile
    }
    CopyAsyncWait<0>();
    __syncthreads();  // the pipeline has drained: its stages become the merge area

#pragma unroll
    for (int q = 0; q < 2; ++q) {
      l_run[q] += __shfl_xor_sync(0xffffffffu, l_run[q], 4);
      l_run[q] += __shfl_xor_sync(0xffffffffu, l_run[q], 8);
      l_run[q] += __shfl_xor_sync(0xffffffffu, l_run[q], 16);
    }
    float* acc_s = reinterpret_cast<float*>(stages);       // [warps][kGroup][kHeadDim]
    float* ml_s = acc_s + kAttnWarps * kGroup * kHeadDim;  // [warps][kGroup][2]
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int qi = 2 * t + q;
      if (qi < kGroup) {
        float* row = acc_s + (warp * kGroup + qi) * kHeadDim;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          row[mt * 16 + g] = o[mt][q];
          row[mt * 16 + g + 8] = o[mt][q + 2];
        }
        if (g == 0) {
          ml_s[(warp * kGroup + qi) * 2] = m_run[q];
          ml_s[(warp * kGroup + qi) * 2 + 1] = l_run[q];
        }
      }
    }
    __syncthreads();  // acc_s, ml_s
    for (int i = threadIdx.x; i < kGroup * kHeadDim; i += kAttnThreads) {
      const int gi = i / kHeadDim, d = i % kHeadDim;
      float big = -INFINITY;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) big = fmaxf(big, ml_s[(w * kGroup + gi) * 2]);
      float num = 0.0f, den = 0.0f;
      if (big != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) {
          const float wt = exp2f(ml_s[(w * kGroup + gi) * 2] - big);  // 0 for a warp without keys
          num = fmaf(wt, acc_s[(w * kGroup + gi) * kHeadDim + d], num);
          den = fmaf(wt, ml_s[(w * kGroup + gi) * 2 + 1], den);
        }
      }
      const int head = kvh * kGroup + gi;
      if (a.splits == 1) {
        const float y = den > 0.0f ? num / den : 0.0f;
        reinterpret_cast<uint16_t*>(
            a.out)[tok * a.out_row_stride + static_cast<int64_t>(head) * kHeadDim + d] =
            static_cast<uint16_t>(FloatToBf16(y));
      } else {
        const int64_t slot = (static_cast<int64_t>(split) * a.tokens + tok) * a.q_heads + head;
        a.ws_acc[slot * kHeadDim + d] = num;
        if (d == 0) {
          a.ws_ml[2 * slot] = big;
          a.ws_ml[2 * slot + 1] = den;
        }
      }
    }
    __syncthreads();  // the merge area, q_tile and key_ok are rewritten for the next row
  }
}

// Merges the splits' partial results: out = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i.
// Grid (sequence, row slots, query head), one thread per output dimension; a CTA loops over
// its sequence's rows. The first warp turns the splits' (m, l) into weights (one split per
// lane: splits <= kMaxSplits = 32), so each dimension is one pass over the splits' partials.
static_assert(kMaxSplits <= 32, "the combine kernel's first warp holds one split per lane");
template <int kHeadDim>
__global__ void __launch_bounds__(kHeadDim) PagedAttentionCombineKernel(AttnArgs a) {
  __shared__ float w_s[32];
  const int s = blockIdx.x, head = blockIdx.z;
  int row_begin, n, ctx;
  SequenceRows(a, s, &row_begin, &n, &ctx);
  if (n > a.max_rows) return;
  for (int j = blockIdx.y; j < n; j += gridDim.y) {
    const int64_t tok = row_begin + j;
    if (threadIdx.x < 32) {
      const int sp = threadIdx.x;
      const int64_t slot = (static_cast<int64_t>(sp) * a.tokens + tok) * a.q_heads + head;
      const float m = sp < a.splits ? a.ws_ml[2 * slot] : -INFINITY;
      const float l = sp < a.splits ? a.ws_ml[2 * slot + 1] : 0.0f;
      const float big = WarpMax(m);
      const float w = big != -INFINITY ? exp2f(m - big) : 0.0f;  // 0 for an empty split
      const float den = WarpSum(w * l);
      w_s[sp] = den > 0.0f ? w / den : 0.0f;
    }
    __syncthreads();
    float y = 0.0f;
    for (int sp = 0; sp < a.splits; ++sp) {
      const int64_t slot = (static_cast<int64_t>(sp) * a.tokens + tok) * a.q_heads + head;
      y = fmaf(w_s[sp], a.ws_acc[slot * kHeadDim + threadIdx.x], y);
    }
    reinterpret_cast<uint16_t*>(
        a.out)[tok * a.out_row_stride + static_cast<int64_t>(head) * kHeadDim + threadIdx.x] =
        static_cast<uint16_t>(FloatToBf16(y));
    __syncthreads();  // w_s is rewritten for the next row
  }
}

template <int kHeadDim, int kPpw>
void LaunchAttentionKernel(dim3 grid, bool fp8, const AttnArgs& a, cudaStream_t stream) {
  if (fp8) {
    PagedAttentionKernel<kHeadDim, true, kPpw><<<grid, kAttnThreads, 0, stream>>>(a);
  } else {
    PagedAttentionKernel<kHeadDim, false, kPpw><<<grid, kAttnThreads, 0, stream>>>(a);
  }
}

// The decode kernel's tiles take more than the 48 KiB of shared memory a launch gets by
// default; the opt-in holds per device (context) and ranks may be threads of one process on
// several devices: set before every launch (a host-side call, allowed while a stream is
// captured; a graph replay does not repeat it).
template <int kHeadDim, bool kFp8, int kGroup>
cudaError_t LaunchDecodeKernelAs(dim3 grid, const AttnArgs& a, cudaStream_t stream) {
  constexpr int kSmem = DecodeSmem<kHeadDim, kFp8>::kBytes;
  const auto kernel = PagedDecodeAttentionKernel<kHeadDim, kFp8, kGroup>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  // All of the SM's unified memory as shared memory, so that two CTAs fit (the kernel reads
  // nothing twice: L1 has nothing to keep).
  if (e == cudaSuccess) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  }
  if (e != cudaSuccess) return e;
  PagedDecodeAttentionKernel<kHeadDim, kFp8, kGroup><<<grid, kAttnThreads, kSmem, stream>>>(a);
  return cudaGetLastError();
}

template <int kHeadDim, int kGroup>
cudaError_t LaunchDecodeKernel(dim3 grid, bool fp8, const AttnArgs& a, cudaStream_t stream) {
  return fp8 ? LaunchDecodeKernelAs<kHeadDim, true, kGroup>(grid, a, stream)
             : LaunchDecodeKernelAs<kHeadDim, false, kGroup>(grid, a, stream);
}

// pairs_per_warp 0: the decode kernel (one query row per sequence, a.group in 1, 2, 4, 8).
template <int kHeadDim>
cudaError_t LaunchAttentionKernels(dim3 grid, int64_t combine_rows, bool fp8, int pairs_per_warp,
                                   const AttnArgs& a, cudaStream_t stream) {
  if (pairs_per_warp == 0) {
    cudaError_t e = cudaSuccess;
    switch (a.group) {
      case 1:
        e = LaunchDecodeKernel<kHeadDim, 1>(grid, fp8, a, stream);
        break;
      case 2:
        e = LaunchDecodeKernel<kHeadDim, 2>(grid, fp8, a, stream);
        break;
      case 4:
        e = LaunchDecodeKernel<kHeadDim, 4>(grid, fp8, a, stream);
        break;
      default:
        e = LaunchDecodeKernel<kHeadDim, 8>(grid, fp8, a, stream);
        break;
    }
    if (e != cudaSuccess) return e;
  } else if (pairs_per_warp == 1) {
    LaunchAttentionKernel<kHeadDim, 1>(grid, fp8, a, stream);
  } else if (pairs_per_warp == 2) {
    LaunchAttentionKernel<kHeadDim, 2>(grid, fp8, a, stream);
  } else {
    LaunchAttentionKernel<kHeadDim, kMaxPairsPerWarp>(grid, fp8, a, stream);
  }
  if (a.splits > 1) {
    const dim3 cgrid(grid.x / static_cast<unsigned>(a.kv_heads),
                     static_cast<unsigned>(combine_rows), static_cast<unsigned>(a.q_heads));
    PagedAttentionCombineKernel<kHeadDim><<<cgrid, kHeadDim, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

// Bytes of workspace one split takes per (token, head).
int64_t SplitBytes(int64_t head_dim) {
  return (head_dim + 2) * static_cast<int64_t>(sizeof(float));
}

int64_t ResolvedMaxContext(const PagedAttentionParams& p) {
  const int64_t cap = p.max_blocks * p.layout.block_size;
  return p.max_context > 0 ? std::min(p.max_context, cap) : cap;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

int64_t PagedAttentionMaxSplits(int64_t max_context) {
  const int64_t splits = (max_context + kMinSplitKeys - 1) / kMinSplitKeys;
  return std::max<int64_t>(1, std::min(splits, kMaxSplits));
}

size_t PagedAttentionWorkspaceBytes(int64_t max_tokens, int64_t q_heads, int64_t head_dim,
                                    int64_t max_context) {
  const int64_t splits = PagedAttentionMaxSplits(max_context);
  if (splits <= 1 || max_tokens <= 0 || q_heads <= 0 || head_dim <= 0) return 0;
  return static_cast<size_t>(splits * max_tokens * q_heads * SplitBytes(head_dim));
}

namespace {

bool HasMultiRowList(const PagedAttentionParams& p) {
  return p.multi_row_seqs != nullptr && p.multi_row_count > 0;
}

// The most query rows the split kernels see in one sequence (1 when the multi-row sequences
// go to the tensor-core kernel).
int64_t QueryRows(const PagedAttentionParams& p) {
  if (HasMultiRowList(p)) return std::min<int64_t>(1, p.tokens);
  return p.max_query_rows > 0 ? std::min(p.max_query_rows, p.tokens) : p.tokens;
}

// The smallest of 1, 2, 4 pairs per warp that holds every pair of a sequence's longest
// query-row range in one tile, else 4.
int PairsPerWarp(const PagedAttentionParams& p) {
  const int64_t pairs = QueryRows(p) * (p.q_heads / p.layout.kv_heads);
  if (pairs <= kAttnWarps) return 1;
  if (pairs <= 2 * kAttnWarps) return 2;
  return kMaxPairsPerWarp;
}

// Pure decode (one query row per sequence) with a group size the decode kernel has.
bool UsesDecodeKernel(const PagedAttentionParams& p) {
  const int64_t group = p.q_heads / p.layout.kv_heads;
  return QueryRows(p) == 1 && (group == 1 || group == 2 || group == 4 || group == 8);
}

int64_t PairTiles(const PagedAttentionParams& p) {
  const int64_t group = p.q_heads / p.layout.kv_heads;
  const int64_t per_cta = int64_t{kAttnWarps} * PairsPerWarp(p);
  return std::min((QueryRows(p) * group + per_cta - 1) / per_cta, kMaxGridY);
}

}  // namespace

int64_t PagedAttentionSplitsFor(const PagedAttentionParams& p, int sm_count) {
  if (p.tokens <= 0 || p.num_seqs <= 0 || p.layout.kv_heads <= 0 || p.q_heads <= 0) return 1;
  const int64_t cap = PagedAttentionMaxSplits(ResolvedMaxContext(p));
  int64_t splits = p.splits;
  if (splits <= 0) {
    // Enough CTAs for two per SM (four for the decode kernel, whose CTAs are lighter); the
    // combine pass costs little next to an idle GPU.
    const int64_t ctas = p.num_seqs * p.layout.kv_heads * std::max<int64_t>(1, PairTiles(p));
    const int64_t per_sm = UsesDecodeKernel(p) ? 4 : 2;
    splits = (per_sm * int64_t{sm_count} + ctas - 1) / ctas;
  }
  splits = std::max<int64_t>(1, std::min(splits, cap));
  if (splits > 1) {
    const int64_t per_split = p.tokens * p.q_heads * SplitBytes(p.layout.head_dim);
    const int64_t fit =
        p.workspace == nullptr ? 0 : static_cast<int64_t>(p.workspace_bytes) / per_split;
    splits = std::max<int64_t>(1, std::min(splits, fit));
  }
  return splits;
}

Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  constexpr const char* kP = "PagedAttentionParams";
  TP_RETURN_IF_ERROR(CheckKvLayout(kP, p.layout, p.layer));
  const int64_t hd = p.layout.head_dim, kv_heads = p.layout.kv_heads;
  if (hd != 64 && hd != 128) {
    return UnimplementedError(std::string(kP) + ".layout.head_dim = " + Str(hd) +
                              " is unsupported; supported: 64, 128");
  }
  if (p.q_heads < 1 || p.q_heads % kv_heads != 0) {
    return BadField(kP, "q_heads", p.q_heads,
                    "must be a positive multiple of layout.kv_heads (" + Str(kv_heads) + ")");
  }
  if (p.num_seqs < 0) return BadField(kP, "num_seqs", p.num_seqs, "must be >= 0");
  if (p.tokens < 0 || p.tokens > std::numeric_limits<int32_t>::max()) {
    return BadField(kP, "tokens", p.tokens, "must be in [0, 2^31 - 1]");
  }
  if (p.max_blocks < 1) return BadField(kP, "max_blocks", p.max_blocks, "must be >= 1");
  if (p.max_blocks * p.layout.block_size > std::numeric_limits<int32_t>::max() / 2) {
    return BadField(kP, "max_blocks", p.max_blocks, "times block_size must be below 2^30");
  }
  if (p.max_query_rows < 0) return BadField(kP, "max_query_rows", p.max_query_rows, "must be >= 0");
  if (p.max_context < 0) return BadField(kP, "max_context", p.max_context, "must be >= 0");
  if (p.splits < 0) return BadField(kP, "splits", p.splits, "must be >= 0");
  const int64_t width = p.q_heads * hd;
  const struct {
    const char* name;
    int64_t stride;
  } strides[] = {{"q_row_stride", p.q_row_stride}, {"out_row_stride", p.out_row_stride}};
  for (const auto& st : strides) {
    if (st.stride < width || st.stride % 8 != 0) {
      return BadField(kP, st.name, st.stride,
                      "must be a multiple of 8 and >= q_heads * head_dim (" + Str(width) + ")");
    }
  }
  if (p.num_seqs == 0 || p.tokens == 0) return Status::Ok();
  if (p.tokens * (p.q_heads / kv_heads) > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(std::string(kP) +
                                ": tokens * (q_heads / kv_heads) exceeds 2^31 - 1");
  }
  if (p.q_heads > 65535) {  // the combine pass's grid has a z index per query head
    return BadField(kP, "q_heads", p.q_heads, "must be at most 65535");
  }
  if (p.num_seqs * kv_heads > kMaxGridX) {
    return InvalidArgumentError(std::string(kP) + ": num_seqs * kv_heads (" +
                                Str(p.num_seqs * kv_heads) + ") exceeds 2^31 - 1");
  }
  TP_RETURN_IF_ERROR(CheckPointers(kP, {{"q", p.q, 16},
                                        {"cache", p.cache, 16},
                                        {"out", p.out, 16},
                                        {"cu_seqlens", p.cu_seqlens, 4},
                                        {"context_lens", p.context_lens, 4},
                                        {"block_tables", p.block_tables, 4},
                                        {"workspace", p.workspace, 16, false},
                                        {"multi_row_seqs", p.multi_row_seqs, 4, false}}));
  const bool flash = HasMultiRowList(p);
  if (p.multi_row_count < 0 || p.multi_row_count > p.num_seqs) {
    return BadField(kP, "multi_row_count", p.multi_row_count,
                    "must be in [0, num_seqs = " + Str(p.num_seqs) + "]");
  }
  if (flash) {
    TP_RETURN_IF_ERROR(LaunchPagedPrefillAttention(p, stream));
    if (p.multi_row_count == p.num_seqs) return Status::Ok();  // nothing left for the others
  }

  int device = 0, sms = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  TP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t splits = PagedAttentionSplitsFor(p, sms);
  const int64_t max_context = ResolvedMaxContext(p);
  int64_t chunk = (max_context + splits - 1) / splits;
  chunk = (chunk + kKeyTile - 1) / kKeyTile * kKeyTile;

  AttnArgs a;
  a.q = p.q;
  a.q_row_stride = p.q_row_stride;
  a.cache = static_cast<const uint8_t*>(p.cache);
  a.k_offset = p.layout.Offset(p.layer, 0, 0, 0, 0);
  a.v_offset = p.layout.Offset(p.layer, 1, 0, 0, 0);
  a.num_blocks = static_cast<int>(p.layout.num_blocks);
  a.block_size = static_cast<int>(p.layout.block_size);
  a.kv_heads = static_cast<int>(kv_heads);
  a.q_heads = static_cast<int>(p.q_heads);
  a.group = static_cast<int>(p.q_heads / kv_heads);
  a.cu_seqlens = p.cu_seqlens;
  a.context_lens = p.context_lens;
  a.block_tables = p.block_tables;
  a.max_blocks = p.max_blocks;
  a.tokens = static_cast<int>(p.tokens);
  a.out = p.out;
  a.out_row_stride = p.out_row_stride;
  a.splits = static_cast<int>(splits);
  a.chunk = static_cast<int>(chunk);
  a.ws_acc = splits > 1 ? static_cast<float*>(p.workspace) : nullptr;
  a.ws_ml = splits > 1 ? a.ws_acc + splits * p.tokens * p.q_heads * hd : nullptr;
  constexpr double kLog2E = 1.4426950408889634;
  a.scale_log2 = static_cast<float>(kLog2E / std::sqrt(static_cast<double>(hd)));
  a.max_rows = flash ? 1 : INT_MAX;
  a.block_shift = -1;
  for (int sh = 0; sh < 31; ++sh) {
    if ((int64_t{1} << sh) == p.layout.block_size) a.block_shift = sh;
  }

  const dim3 grid(static_cast<unsigned>(p.num_seqs * kv_heads),
                  static_cast<unsigned>(std::max<int64_t>(1, PairTiles(p))),
                  static_cast<unsigned>(splits));
  const int64_t combine_rows = std::max<int64_t>(1, std::min(QueryRows(p), kMaxGridY));
  const bool fp8 = p.layout.dtype == KvCacheDtype::kFloat8E4M3;
  const int kernel = UsesDecodeKernel(p) ? 0 : PairsPerWarp(p);
  if (hd == 64) {
    TP_CUDA_CHECK(LaunchAttentionKernels<64>(grid, combine_rows, fp8, kernel, a, stream));
  } else {
    TP_CUDA_CHECK(LaunchAttentionKernels<128>(grid, combine_rows, fp8, kernel, a, stream));
  }
  return Status::Ok();
}

}  // namespace tpserve
