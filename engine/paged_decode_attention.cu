// The decode attention kernel of engine/paged_kv_ops.h (one query row per sequence, on
// tensor cores) and its launcher. Plain CUDA C++17 (see paged_kv_ops.cu).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/device_math.cuh"
#include "engine/mma.cuh"
#include "engine/paged_attention_args.cuh"
#include "engine/paged_kv_store.cuh"
#include "engine/rope.cuh"
#include "layers/mma_e4m3.cuh"
#include "layers/pdl.cuh"

namespace tpserve::paged_attn {
namespace {

using namespace device;

// Decode attention (one query row per sequence) on tensor cores. A CTA per (sequence, KV
// head, split) multiplies the split's keys with the KV head's kGroup query heads, which are
// the n8 columns of S^T = K.Q^T (keys are the m16 rows, so no MMA row is padding), and
// O^T += V^T.P^T. Keys and values stream through shared memory in tiles of kDecodeKeys keys,
// several tiles in flight (cp.async): a decode step is bound by the bytes it keeps in flight.
// Warp w takes keys [16w, 16w + 16) of every tile and keeps its own online softmax (m, l)
// and O^T accumulators in registers, without block barriers beyond the pipeline's; at the end
// the CTA merges its warps'. Over a BF16 cache the MMAs are BF16 with FP32 accumulation (Q
// and K are BF16 already: exact products), and for P.V P is split into its BF16 rounding and
// the BF16 rounding of the remainder, two MMAs, so P keeps about 16 bits and the result stays
// within FP32-math error of the reference. An E4M3 cache is copied as codes and both products
// run on the 8-bit MMA straight from them, so no code is widened. S^T = K.Q^T: each query row
// is scaled by a power of two (its largest |q| to [128, 256)) and split into two E4M3 parts,
// hi = e4m3(q) and lo = e4m3(16 (q - hi)), which hold a BF16 q exactly (down to 2^-13 of the
// row's largest |q|), and S^T = K.hi^T + K.lo^T / 16, unscaled with the softmax scale. O^T +=
// V^T.P^T: P (2^8 times the weights, the row sums likewise) is split the same way, hi and
// lo = e4m3(p - hi), and one k32 MMA takes a warp's 16 keys twice, hi in the low half of k and
// lo in the high half, so P keeps about 8 bits (within 2^-8 of the reference output, as a
// single BF16 rounding of P would be); each lane gathers its V^T fragments from four value rows
// with byte permutes, its own dims of O^T chosen so that it reads whole 16-byte pieces of rows.
// Beyond the roundings of P the only difference from exact products is the 8-bit MMA's own
// accumulation.
// A sequence's context is cut into splits on the device, from its own length (at most
// a.splits of at least kDecodeMinSplitKeys keys each), so one graph serves every context; a
// split past the context writes an empty partial (m = -inf, l = 0) for the merge.
// The splits' partials are merged by the combine pass (through the workspace), or with
// a.cluster_merge by the splits themselves: the a.splits CTAs of a (sequence, KV head) are one
// thread-block cluster, each leaves its partial in its shared memory, and after a cluster
// barrier split r reads every split's partial (distributed shared memory) for its share of the
// outputs: no second kernel and no workspace round trip.
// With a.rope_positions (PagedAttentionParams::rope) the kernel also does the RoPE kernel's
// work for a pure decode step: it rotates its query heads in shared memory, and stores the
// step's keys (rotated) and values into the cache before it reads them (see below).
constexpr int kDecodeKeys = 16 * kAttnWarps;  // keys per tile

// Dynamic shared memory of the decode kernel:
// [stages x (K tile | V tile)] [Q tile] [key flags].
// A step's loads wait on a loaded HBM's latency, so the bytes in flight per SM bound its speed
// (each CTA has up to stages - 1 tiles in flight while it computes). A BF16 step moves
// bytes near the HBM's rate with two CTAs an SM (3 stages of 34 KiB at head_dim 128); an
// E4M3 step moves half as many for the same MMAs and softmax, so it is bound by the latency
// of each warp's chain instead, and takes four CTAs an SM (2 stages of 18 KiB, at most 128
// registers a thread): more warps to issue from, the same bytes in flight an SM give or take.
// With RoPE (kRope: pure decode of at most 8 rows, where few CTAs run anyway) it keeps three
// CTAs an SM with 3 stages: the RoPE path spills at 128 registers, and a CTA loads its first
// kStages - 1 tiles before its PDL wait.
template <int kHeadDim, bool kFp8, bool kRope>
struct DecodeSmem {
  static constexpr bool kFourCtas = kFp8 && !kRope;
  static constexpr int kStages = kFourCtas ? 2 : 3;
  static constexpr int kCtasPerSm = !kFp8       ? kDecodeCtasPerSmBf16
                                    : kFourCtas ? kDecodeCtasPerSmFp8
                                                : kDecodeCtasPerSmFp8Rope;
  // Rows padded by 16 bytes: they stay 16-byte aligned for cp.async, and (BF16) the ldmatrix
  // row addresses of 8 consecutive rows fall on distinct banks.
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kRowBytes = kFp8 ? kHeadDim + 16 : 2 * kPitch;    // a cache row staged
  static constexpr int kPieces = (kFp8 ? kHeadDim : 2 * kHeadDim) / 16;  // 16 B copies a row
  static constexpr int kTileBytes = kDecodeKeys * kRowBytes;
  static constexpr int kStagesBytes = kStages * 2 * kTileBytes;
  static constexpr int kQBytes = 8 * kPitch * 2;
  static constexpr int kFlagBytes = kStages * kDecodeKeys * 4;
  static constexpr int kBytes = kStagesBytes + kQBytes + kFlagBytes;
  // 228 KiB of shared memory an SM, 1 KiB of it reserved per CTA.
  static_assert(kCtasPerSm * (kBytes + 1024) <= 228 * 1024, "CTAs per SM");
  // The warps' merge reuses the stages once the pipeline has drained; the CTA's partial for
  // a cluster merge ([8][kHeadDim] sums, [8][2] max and sum) follows it there.
  static constexpr int kMergeBytes = kAttnWarps * 8 * (kHeadDim + 2) * 4;
  static constexpr int kPartialBytes = 8 * (kHeadDim + 2) * 4;
  static_assert(kMergeBytes + kPartialBytes <= kStagesBytes, "merge area");
};

template <int kHeadDim, bool kFp8, int kGroup, bool kRope>
__global__ void __launch_bounds__(kAttnThreads, DecodeSmem<kHeadDim, kFp8, kRope>::kCtasPerSm)
    PagedDecodeAttentionKernel(AttnArgs a) {
  using L = DecodeSmem<kHeadDim, kFp8, kRope>;
  constexpr int kPitch = L::kPitch;
  constexpr int kKSteps = kHeadDim / 16;  // k-steps of K.Q^T
  constexpr int kMTiles = kHeadDim / 16;  // m16 tiles (of dims) of O^T
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  // P.V with P in two BF16 parts over a BF16 cache; over E4M3 values (2^-4 apart relatively)
  // P's own BF16 rounding (2^-8) is the smaller error, and one MMA a tile of dims is enough.
  // E4M3: the dims of V^T (and O^T) a lane holds, kLaneDims g .. kLaneDims g + kLaneDims - 1;
  // its P weights are 2^kPLog2 times the exp2 weights (at most 256, within E4M3's 448), and so
  // are the row sums, which leaves the output as it is.
  constexpr int kLaneDims = kHeadDim / 8;
  constexpr float kPLog2 = kFp8 ? 8.0f : 0.0f;
  // Each thread copies the same 16-byte piece of every kRowStep-th row of a tile.
  constexpr int kRowStep = kAttnThreads / L::kPieces;
  constexpr int kCopies = kDecodeKeys / kRowStep;
  static_assert(kAttnThreads % L::kPieces == 0 && kDecodeKeys % kRowStep == 0, "tile copies");
  static_assert(kGroup <= 8, "the query heads of a KV head are the n8 columns of S^T");
  extern __shared__ __align__(16) uint8_t decode_smem[];
  uint8_t* stages = decode_smem;
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(decode_smem + L::kStagesBytes);
  int* key_ok = reinterpret_cast<int*>(decode_smem + L::kStagesBytes + L::kQBytes);
  // With a.context_constant the sequence metadata, the block table and the first stages' tiles
  // of keys written before this step are read before the PDL wait (see AttnArgs); otherwise
  // nothing is read before it.
  bool waited = !a.context_constant;
  if (waited) PdlEnter();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3, mat = lane >> 3;
  const int s = blockIdx.x / a.kv_heads, kvh = blockIdx.x % a.kv_heads;
  const int split = blockIdx.z;
  int row_begin, n, ctx;
  SequenceRows(a, s, &row_begin, &n, &ctx);
  // Every CTA waits before it ends, work or none: a PDL grid none of whose CTAs waited could
  // end before the kernel ahead of it, and the next kernel's wait would not cover that one.
  if (n > a.max_rows) {
    if (!waited) PdlEnter();
    return;
  }
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks;
  const int64_t head_stride = static_cast<int64_t>(a.block_size) * kHeadDim;
  const int64_t block_stride = a.kv_heads * head_stride;
  // This sequence's splits: as many as have kDecodeMinSplitKeys keys, at most a.splits.
  const int used = max(1, min(a.splits, (ctx + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys));
  const int chunk = ((ctx + used - 1) / used + kDecodeKeys - 1) / kDecodeKeys * kDecodeKeys;
  const int key_lo = split < used ? split * chunk : ctx;
  const int key_hi = split < used ? min(ctx, key_lo + chunk) : ctx;
  const int piece = threadIdx.x % L::kPieces, copy_row = threadIdx.x / L::kPieces;

  // With a.rope_positions (PagedAttentionParams::rope) q and the step's keys are unrotated:
  // thread x rotates pair x % (kHeadDim / 2) of whatever heads it takes (one cos and sin a row),
  // and before its first load of a key of the step's rows the CTA stores the rows whose
  // positions fall in its share [key_lo, key_hi): keys rotated, values as they are (the
  // unfused RoPE kernel's bits). Each step row's key position lies in exactly one split's share,
  // and no other CTA reads it.
  constexpr int kHalf = kHeadDim / 2;
  // kRope: a.rope_positions != nullptr, chosen by the launcher, so that a launch without RoPE
  // carries none of its code (its double-precision angles cost registers and a stack frame).
  constexpr bool rope = kRope;
  const int pair = threadIdx.x % kHalf;
  bool stored = !rope;
  auto store_rows = [&](int j_now, float2 cs_now) {
    uint16_t* k_row = q_tile;  // free until this row's Q is loaded
    constexpr int kVecs = kHeadDim / 8;
    for (int j = 0; j < n; ++j) {
      const int key = ctx - n + j;
      if (key < key_lo || key >= key_hi) continue;  // CTA-uniform, as below
      const int64_t tk = row_begin + j;
      const int32_t slot = a.rope_slots[tk];
      if (slot < 0 || slot >= a.num_slots) continue;  // padding, or corrupt: not stored
      const float2 cs = j == j_now ? cs_now
                                   : RopeCosSin(a.rope_positions[tk], pair, kHeadDim,
                                                a.rope_inv_freq, a.rope_theta);
      if (threadIdx.x < kHalf) {
        const uint16_t* k = reinterpret_cast<const uint16_t*>(a.rope_k + tk * a.rope_k_row_stride +
                                                              static_cast<int64_t>(kvh) * kHeadDim);
        float x, y;
        RotatePair(Bf16ToFloat(k[pair]), Bf16ToFloat(k[pair + kHalf]), cs, &x, &y);
        k_row[pair] = static_cast<uint16_t>(FloatToBf16(x));
        k_row[pair + kHalf] = static_cast<uint16_t>(FloatToBf16(y));
      }
      __syncthreads();  // k_row
      const int64_t block = slot / a.block_size;
      const int64_t at =
          ((block * a.kv_heads + kvh) * a.block_size + (slot - block * a.block_size)) * kHeadDim;
      if (threadIdx.x < kVecs) {
        StoreKv8<kFp8>(a.rope_cache, a.k_offset + at + 8 * threadIdx.x,
                       *reinterpret_cast<const uint4*>(k_row + 8 * threadIdx.x), a.k_scale);
      } else if (threadIdx.x < 2 * kVecs) {
        const int c = threadIdx.x - kVecs;
        StoreKv8<kFp8>(
            a.rope_cache, a.v_offset + at + 8 * c,
            *reinterpret_cast<const uint4*>(a.rope_v + tk * a.rope_v_row_stride +
                                            static_cast<int64_t>(kvh) * kHeadDim + 8 * c),
            a.v_scale);
      }
      __syncthreads();  // k_row is rewritten for the next row
    }
    // The stores reach L2 (where cp.async.cg reads) before any thread of the CTA loads them.
    __threadfence();
    __syncthreads();
  };

  for (int j = 0; j < n; ++j) {  // one row per sequence in decode; more are taken in turn
    const int64_t tok = row_begin + j;
    // The row's angles (positions are metadata: read before the wait with context_constant).
    const float2 cs =
        rope ? RopeCosSin(a.rope_positions[tok], pair, kHeadDim, a.rope_inv_freq, a.rope_theta)
             : make_float2(1.0f, 0.0f);
    // The PDL wait, then (rope) the stores of the step's rows: before the first tile with a
    // key of the step's rows, and before Q. CTA-uniform.
    auto wait_for_step = [&]() {
      if (!waited) {
        PdlEnter();
        waited = true;
      }
      if (!stored) {
        store_rows(j, cs);
        stored = true;
      }
    };
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
    // Keys below history_end were written before this step (its rows are the sequence's last
    // n positions): a tile whose keys all lie there may load before the PDL wait, the first
    // tile with a key of this step's rows waits for it. CTA-uniform, as PdlEnter needs.
    const int history_end = ctx - n;
#pragma unroll
    for (int i = 0; i < L::kStages - 1; ++i) {
      if (!(waited && stored) && i < tiles &&
          min(key_lo + (i + 1) * kDecodeKeys, key_end) > history_end) {
        wait_for_step();
      }
      if (i < tiles) {
        fetch_blocks(i);
        load_tile(i);
      }
      CopyAsyncCommit();  // empty groups too: the wait below counts groups
    }
    if (L::kStages - 1 < tiles) fetch_blocks(L::kStages - 1);
    wait_for_step();  // before Q (the kernel ahead writes it) and before any write

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
    // Rotated in place: thread x takes pair x % kHalf of rows x / kHalf + ...
    if constexpr (rope) {
      for (int r = threadIdx.x / kHalf; r < kGroup; r += kAttnThreads / kHalf) {
        uint16_t* row = q_tile + r * kPitch;
        float x, y;
        RotatePair(Bf16ToFloat(row[pair]), Bf16ToFloat(row[pair + kHalf]), cs, &x, &y);
        row[pair] = static_cast<uint16_t>(FloatToBf16(x));
        row[pair + kHalf] = static_cast<uint16_t>(FloatToBf16(y));
      }
      __syncthreads();  // q_tile, rotated
    }
    // B fragments of Q^T (k = dims, n = queries). BF16 cache: two k-steps at a time in dim
    // order, by ldmatrix. E4M3 cache: query g's two E4M3 parts (see the top), dims
    // 64b + 16t .. 64b + 16t + 15 of 64-dim block b in the lane, the layout of MmaBlockE4m3;
    // q_unscale[c]: 2^-e of query 2t + c, the column this lane's scores hold.
    uint32_t qb[kFp8 ? 1 : kKSteps][2];
    uint4 q_hi[kFp8 ? kHeadDim / 64 : 1], q_lo[kFp8 ? kHeadDim / 64 : 1];
    float q_unscale[2] = {1.0f, 1.0f};
    if constexpr (kFp8) {
      static_assert(kHeadDim % 64 == 0, "64-dim blocks");
      constexpr int kBlocks = kHeadDim / 64;
      // Dims 64b + 16t + 8h .. + 7 of query g (read twice: for the amax, then the codes).
      auto q_dims = [&](int b, int h, float(&f)[8]) {
        UnpackBf16x8(*reinterpret_cast<const uint4*>(q_tile + g * kPitch + 64 * b + 16 * t + 8 * h),
                     f);
      };
      float amax = 0.0f;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float f[8];
          q_dims(b, h, f);
#pragma unroll
          for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
        }
      }
      // The four lanes of a quad hold query g's whole row.
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      // 2^e with amax 2^e in [128, 256) (amax's exponent field f: amax in [2^(f-127),
      // 2^(f-126))), e within [-126, 126] so that 2^e and 2^-e are normal floats; an all-zero
      // row takes 2^126 and stays zero. A NaN stays NaN through both parts.
      const int field = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFFu);
      const int e = min(126, max(-126, 134 - field));
      const float up = __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
      const float down = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        uint32_t hw[4], lw[4];
        float f[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          if ((w & 1) == 0) q_dims(b, w >> 1, f);
          uint32_t hp[2], lp[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float x0 = f[4 * (w & 1) + 2 * h] * up, x1 = f[4 * (w & 1) + 2 * h + 1] * up;
            const __nv_fp8x2_storage_t hi2 =
                __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
            const float2 back = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(hi2, __NV_E4M3)));
            const __nv_fp8x2_storage_t lo2 =
                __nv_cvt_float2_to_fp8x2(make_float2(16.0f * (x0 - back.x), 16.0f * (x1 - back.y)),
                                         __NV_SATFINITE, __NV_E4M3);
            hp[h] = hi2;
            lp[h] = lo2;
          }
          hw[w] = hp[0] | (hp[1] << 16);
          lw[w] = lp[0] | (lp[1] << 16);
        }
        q_hi[b] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
        q_lo[b] = make_uint4(lw[0], lw[1], lw[2], lw[3]);
      }
      // Query c's 2^-e from the quad of lanes 4c .. 4c + 3.
      q_unscale[0] = __shfl_sync(0xffffffffu, down, 8 * t);
      q_unscale[1] = __shfl_sync(0xffffffffu, down, 8 * t + 4);
    } else {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ks += 2) {
        uint32_t r[4];
        LoadMatrixX4<false>(r, q_tile + (lane & 7) * kPitch + ks * 16 + mat * 8);
        qb[ks][0] = r[0];
        qb[ks][1] = r[1];
        qb[ks + 1][0] = r[2];
        qb[ks + 1][1] = r[3];
      }
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
      // E4M3: value codes for keys 4t .. 4t + 3 (of the warp's 16), dims kLaneDims g .. + kLaneDims
      // - 1: the lane's share of V^T (loaded first, so that the loads overlap S and the softmax).
      uint32_t vw[kFp8 ? 4 : 1][kFp8 ? kLaneDims / 4 : 1];
      if constexpr (kFp8) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const uint8_t* row =
              st + L::kTileBytes + (16 * warp + 4 * t + r) * L::kRowBytes + kLaneDims * g;
          if constexpr (kLaneDims == 16) {
            const uint4 four = *reinterpret_cast<const uint4*>(row);
            vw[r][0] = four.x, vw[r][1] = four.y, vw[r][2] = four.z, vw[r][3] = four.w;
          } else {
#pragma unroll
            for (int w = 0; w < kLaneDims / 4; w += 2) {
              const uint2 two = *reinterpret_cast<const uint2*>(row + 4 * w);
              vw[r][w] = two.x;
              vw[r][w + 1] = two.y;
            }
          }
        }
      }
      // S^T = K.Q^T: the warp's 16 keys (rows) by the 8 query columns.
      // Two accumulators (BF16: even and odd k-steps; E4M3: the hi and lo parts of Q) halve
      // the chain of dependent MMAs.
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sc_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (kFp8) {
        // Keys g and g + 8, dims 64b + 16t .. + 15: the cache's codes as they are.
#pragma unroll
        for (int b = 0; b < kHeadDim / 64; ++b) {
          const uint8_t* row = st + (16 * warp + g) * L::kRowBytes + 64 * b + 16 * t;
          const uint4 lo = *reinterpret_cast<const uint4*>(row);
          const uint4 hi = *reinterpret_cast<const uint4*>(row + 8 * L::kRowBytes);
          MmaBlockE4m3(sc, lo, hi, q_hi[b]);
          MmaBlockE4m3(sc_odd, lo, hi, q_lo[b]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[e] = fmaf(sc_odd[e], 0.0625f, sc[e]) * q_unscale[e & 1];
      } else {
#pragma unroll
        for (int ks = 0; ks < kKSteps; ks += 2) {
          uint32_t ka[4], kb[4];
          const uint16_t* k_rows = reinterpret_cast<const uint16_t*>(st) + 16 * warp * kPitch;
          LoadMatrixX4<false>(
              ka, k_rows + ((mat & 1) * 8 + (lane & 7)) * kPitch + ks * 16 + (mat >> 1) * 8);
          LoadMatrixX4<false>(
              kb, k_rows + ((mat & 1) * 8 + (lane & 7)) * kPitch + ks * 16 + 16 + (mat >> 1) * 8);
          MmaBf16(sc, ka, qb[ks][0], qb[ks][1]);
          MmaBf16(sc_odd, kb, qb[ks + 1][0], qb[ks + 1][1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[e] += sc_odd[e];
      }
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
        pr[q] = Exp2Approx(v[q] - (base - kPLog2));
        pr[q + 2] = Exp2Approx(v[q + 2] - (base - kPLog2));
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
      if constexpr (kFp8) {
        // P (pr: 2^8 times the exp2 weights, at most 256) as two E4M3 parts, hi = e4m3(p) and
        // lo = e4m3(p - hi), of keys g, g + 8 (elements 0, 1 and 2, 3: queries 2t, 2t + 1):
        // a word a key, bytes hi(2t), hi(2t + 1), lo(2t), lo(2t + 1).
        uint32_t pk[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const __nv_fp8x2_storage_t h2 = __nv_cvt_float2_to_fp8x2(
              make_float2(pr[2 * k], pr[2 * k + 1]), __NV_SATFINITE, __NV_E4M3);
          const float2 back = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(h2, __NV_E4M3)));
          const __nv_fp8x2_storage_t l2 = __nv_cvt_float2_to_fp8x2(
              make_float2(pr[2 * k] - back.x, pr[2 * k + 1] - back.y), __NV_SATFINITE, __NV_E4M3);
          pk[k] = static_cast<uint32_t>(h2) | (static_cast<uint32_t>(l2) << 16);
        }
        // P^T's B fragment (k32 x n8) for query g: k slots 4t + i take hi and 16 + 4t + i lo of
        // key 4t + i (i < 4), which lane 4 ((4t + i) % 8) + g / 2 holds as key (4t + i) / 8 in
        // its byte g % 2 (hi) and 2 + g % 2 (lo).
        const int key_half = t >> 1;
        const unsigned pick = (g & 1) ? 0x7351u : 0x6240u;  // hi, hi', lo, lo' of byte g % 2
        uint32_t two[2];
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
          const int src0 = 4 * (4 * (t & 1) + i) + (g >> 1), src1 = src0 + 4;
          const uint32_t a0 = __shfl_sync(0xffffffffu, pk[0], src0);
          const uint32_t a1 = __shfl_sync(0xffffffffu, pk[1], src0);
          const uint32_t b0 = __shfl_sync(0xffffffffu, pk[0], src1);
          const uint32_t b1 = __shfl_sync(0xffffffffu, pk[1], src1);
          two[i >> 1] = __byte_perm(key_half ? a1 : a0, key_half ? b1 : b0, pick);
        }
        const uint32_t p_hi = __byte_perm(two[0], two[1], 0x5410u);
        const uint32_t p_lo = __byte_perm(two[0], two[1], 0x7632u);
        // O^T += V^T.P^T on the 8-bit MMA: m16 tile mt's rows g and g + 8 are dims
        // kLaneDims g + 2mt and + 1 (so each lane reads whole rows of its own dims), their
        // codes of keys 4t .. 4t + 3 gathered from the four rows by byte permutes (a 4 x 4 byte
        // transpose a word), the same keys in the hi and the lo half of k.
#pragma unroll
        for (int w = 0; w < kLaneDims / 4; ++w) {
          const uint32_t t0 = __byte_perm(vw[0][w], vw[1][w], 0x5140u);
          const uint32_t t1 = __byte_perm(vw[2][w], vw[3][w], 0x5140u);
          const uint32_t t2 = __byte_perm(vw[0][w], vw[1][w], 0x7362u);
          const uint32_t t3 = __byte_perm(vw[2][w], vw[3][w], 0x7362u);
          const uint32_t d0 = __byte_perm(t0, t1, 0x5410u), d1 = __byte_perm(t0, t1, 0x7632u);
          const uint32_t d2 = __byte_perm(t2, t3, 0x5410u), d3 = __byte_perm(t2, t3, 0x7632u);
          MmaE4m3(o[2 * w], d0, d1, d0, d1, p_hi, p_lo);
          MmaE4m3(o[2 * w + 1], d2, d3, d2, d3, p_hi, p_lo);
        }
      } else {
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
        // O^T += V^T.P^T: A fragments of V^T (dims x keys) by ldmatrix.trans of the V rows.
        const uint16_t* v_rows =
            reinterpret_cast<const uint16_t*>(st + L::kTileBytes) + 16 * warp * kPitch;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          uint32_t va[4];
          LoadMatrixX4<true>(
              va, v_rows + ((mat >> 1) * 8 + (lane & 7)) * kPitch + mt * 16 + (mat & 1) * 8);
          MmaBf16(o[mt], va, ph[0], ph[1]);
          MmaBf16(o[mt], va, pl[0], pl[1]);
        }
      }
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
    // The CTA's partial for a cluster merge: [kGroup][kHeadDim] sums, [kGroup][2] max, sum.
    float* part_acc = reinterpret_cast<float*>(stages + L::kMergeBytes);
    float* part_ml = part_acc + kGroup * kHeadDim;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int qi = 2 * t + q;
      if (qi < kGroup) {
        float* row = acc_s + (warp * kGroup + qi) * kHeadDim;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          // O^T's rows g and g + 8 of tile mt: dims 16 mt + g and + 8, or (E4M3, see P.V)
          // kLaneDims g + 2 mt and + 1.
          const int d_lo = kFp8 ? kLaneDims * g + 2 * mt : mt * 16 + g;
          const int d_hi = kFp8 ? d_lo + 1 : d_lo + 8;
          row[d_lo] = o[mt][q];
          row[d_hi] = o[mt][q + 2];
        }
        if (g == 0) {
          ml_s[(warp * kGroup + qi) * 2] = m_run[q];
          ml_s[(warp * kGroup + qi) * 2 + 1] = l_run[q];
        }
      }
    }
    __syncthreads();  // acc_s, ml_s
    const Fp8Divisor divisor = OutDivisor(a);
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
        StoreOutput(a, divisor, tok, static_cast<int64_t>(head) * kHeadDim + d,
                    den > 0.0f ? num / den : 0.0f);
      } else if (a.cluster_merge) {
        part_acc[i] = num;
        if (d == 0) {
          part_ml[2 * gi] = big;
          part_ml[2 * gi + 1] = den;
        }
      } else {
        const int64_t slot = (static_cast<int64_t>(split) * a.tokens + tok) * a.q_heads + head;
        a.ws_acc[slot * kHeadDim + d] = num;
        if (d == 0) {
          a.ws_ml[2 * slot] = big;
          a.ws_ml[2 * slot + 1] = den;
        }
      }
    }
    if (a.cluster_merge) {  // the launcher sets it with splits > 1 only
      // Every split's partial, for this CTA's share of the kGroup x kHeadDim outputs (cluster
      // rank r takes outputs [128 r, 128 r + 128), then the same 128 x splits further on):
      // out = sum_r 2^(m_r - M) acc_r / sum_r 2^(m_r - M) l_r, M the largest m_r.
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      const int rank = static_cast<int>(cluster.block_rank());
      cluster.sync();  // every split's partial is written (and visible to the cluster)
      for (int i = rank * kAttnThreads + threadIdx.x; i < kGroup * kHeadDim;
           i += a.splits * kAttnThreads) {
        const int gi = i / kHeadDim, d = i % kHeadDim;
        float big = -INFINITY;
        for (int r = 0; r < a.splits; ++r) {
          big = fmaxf(big, cluster.map_shared_rank(part_ml, r)[2 * gi]);
        }
        float num = 0.0f, den = 0.0f;
        if (big != -INFINITY) {
          for (int r = 0; r < a.splits; ++r) {
            const float* ml = cluster.map_shared_rank(part_ml, r);
            const float m = ml[2 * gi];
            const float wt = m == -INFINITY ? 0.0f : exp2f(m - big);  // 0 for an empty split
            num = fmaf(wt, cluster.map_shared_rank(part_acc, r)[i], num);
            den = fmaf(wt, ml[2 * gi + 1], den);
          }
        }
        const int head = kvh * kGroup + gi;
        StoreOutput(a, divisor, tok, static_cast<int64_t>(head) * kHeadDim + d,
                    den > 0.0f ? num / den : 0.0f);
      }
      cluster.sync();  // no split's partial is overwritten (nor its CTA gone) while read
    }
    __syncthreads();  // the merge area, q_tile and key_ok are rewritten for the next row
  }
  if (!waited) PdlEnter();  // no rows (an empty slot): see the early return above
}

// The decode kernel's tiles take more than the 48 KiB of shared memory a launch gets by
// default; the opt-in holds per device (context) and ranks may be threads of one process on
// several devices: set before every launch (a host-side call, allowed while a stream is
// captured; a graph replay does not repeat it).
// With a->cluster_merge the a->splits CTAs of a (sequence, KV head) are one cluster (grid.z is
// the splits; beyond 8 CTAs a cluster is non-portable, Hopper takes 16). A cluster the device
// cannot place (no GPC with room for it) falls back to the combine pass: a->cluster_merge is
// cleared, and the caller launches that pass.
template <int kHeadDim, bool kFp8, int kGroup, bool kRope>
cudaError_t LaunchDecodeKernelAs(dim3 grid, AttnArgs* a, cudaStream_t stream) {
  constexpr int kSmem = DecodeSmem<kHeadDim, kFp8, kRope>::kBytes;
  const auto kernel = PagedDecodeAttentionKernel<kHeadDim, kFp8, kGroup, kRope>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  // All of the SM's unified memory as shared memory, so that two CTAs fit (the kernel reads
  // nothing twice: L1 has nothing to keep).
  if (e == cudaSuccess) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  }
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kAttnThreads);
  config.dynamicSmemBytes = kSmem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  PdlAndClusterAttributes(attribute, dim3(1, 1, static_cast<unsigned>(a->splits)));
  config.attrs = attribute;
  config.numAttrs = 2;
  if (a->cluster_merge) {
    // The occupancy query sees the cluster attribute alone (PDL is no part of placement).
    cudaLaunchConfig_t query = config;
    query.attrs = &attribute[1];
    query.numAttrs = 1;
    int clusters = 0;
    if ((a->splits > 8 &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
             cudaSuccess) ||
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &query) != cudaSuccess || clusters < 1) {
      (void)cudaGetLastError();  // a refused query is not the launch's error
      a->cluster_merge = false;
    }
  }
  config.numAttrs = a->cluster_merge ? 2 : 1;
  cudaError_t launched = cudaLaunchKernelEx(&config, kernel, *a);
  if (launched != cudaSuccess && a->cluster_merge) {
    // A cluster the launch itself could not place (the query above can be optimistic, e.g.
    // beside other processes' work): the same kernel without one, merged by the combine pass.
    (void)cudaGetLastError();
    a->cluster_merge = false;
    config.numAttrs = 1;
    launched = cudaLaunchKernelEx(&config, kernel, *a);
  }
  return launched;
}

template <int kHeadDim, int kGroup>
cudaError_t LaunchDecodeKernel(dim3 grid, bool fp8, AttnArgs* a, cudaStream_t stream) {
  if (a->rope_positions != nullptr) {
    return fp8 ? LaunchDecodeKernelAs<kHeadDim, true, kGroup, true>(grid, a, stream)
               : LaunchDecodeKernelAs<kHeadDim, false, kGroup, true>(grid, a, stream);
  }
  return fp8 ? LaunchDecodeKernelAs<kHeadDim, true, kGroup, false>(grid, a, stream)
             : LaunchDecodeKernelAs<kHeadDim, false, kGroup, false>(grid, a, stream);
}

}  // namespace

cudaError_t LaunchPagedDecodeKernel(int head_dim, dim3 grid, bool fp8, AttnArgs* a,
                                    cudaStream_t stream) {
  const bool h64 = head_dim == 64;
  switch (a->group) {
    case 1:
      return h64 ? LaunchDecodeKernel<64, 1>(grid, fp8, a, stream)
                 : LaunchDecodeKernel<128, 1>(grid, fp8, a, stream);
    case 2:
      return h64 ? LaunchDecodeKernel<64, 2>(grid, fp8, a, stream)
                 : LaunchDecodeKernel<128, 2>(grid, fp8, a, stream);
    case 4:
      return h64 ? LaunchDecodeKernel<64, 4>(grid, fp8, a, stream)
                 : LaunchDecodeKernel<128, 4>(grid, fp8, a, stream);
    default:
      return h64 ? LaunchDecodeKernel<64, 8>(grid, fp8, a, stream)
                 : LaunchDecodeKernel<128, 8>(grid, fp8, a, stream);
  }
}

}  // namespace tpserve::paged_attn
