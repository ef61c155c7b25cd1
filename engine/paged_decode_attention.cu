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
// the CTA merges its warps'. The MMAs are BF16 with FP32 accumulation (Q and K are BF16
// already: exact products); for P.V over a BF16 cache, P is split into its BF16 rounding and
// the BF16 rounding of the remainder, two MMAs, so P keeps about 16 bits and the result stays
// within FP32-math error of the reference; over an E4M3 cache P is rounded to BF16 once (an
// output is then within 2^-8 of max |v| of the reference: an E4M3 step is bound by its warps'
// chains, and the second MMA would only refine P past the values' own precision). An E4M3
// cache is copied as codes: each lane widens its own key fragments to BF16 (exactly) in
// registers, reading the dims of a 32-dim slice in an order of its own (Q's fragments follow
// the same order, so the dot products are the same sums), and each warp widens its value rows
// into shared memory for ldmatrix's transpose, first thing in the tile so that those loads and
// stores overlap the S product and the softmax.
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
// [stages x (K tile | V tile)] [FP8: per-warp BF16 rows] [Q tile] [key flags].
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
  static constexpr int kWidenBytes = kFp8 ? kAttnWarps * 16 * kPitch * 2 : 0;
  static constexpr int kQBytes = 8 * kPitch * 2;
  static constexpr int kFlagBytes = kStages * kDecodeKeys * 4;
  static constexpr int kBytes = kStagesBytes + kWidenBytes + kQBytes + kFlagBytes;
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
  constexpr bool kSplitP = !kFp8;
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
    // B fragments of Q^T (k = dims, n = queries), two k-steps at a time. BF16 cache: in dim
    // order, by ldmatrix. E4M3 cache: k-steps 2c and 2c + 1 of lane (g, t) take dims
    // 32c + 8t .. 32c + 8t + 7 of query g, in the order the lane widens its keys' codes
    // (k-step 2c: dims +0..3, 2c + 1: +4..7; low k-rows 2t, 2t + 1 first).
    uint32_t qb[kKSteps][2];
#pragma unroll
    for (int ks = 0; ks < kKSteps; ks += 2) {
      uint32_t r[4];
      if constexpr (kFp8) {
        const uint4 v = *reinterpret_cast<const uint4*>(q_tile + g * kPitch + ks * 16 + 8 * t);
        r[0] = v.x, r[1] = v.y, r[2] = v.z, r[3] = v.w;
      } else {
        LoadMatrixX4<false>(r, q_tile + (lane & 7) * kPitch + ks * 16 + mat * 8);
      }
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
      const uint16_t* v_rows;
      if constexpr (kFp8) {
        // The warp's 16 value rows widened into its BF16 rows (read back after the softmax).
        uint16_t* w = widen + warp * 16 * kPitch;
#pragma unroll
        for (int e = lane; e < 16 * kQVecs; e += 32) {
          const int r = e / kQVecs, c = e % kQVecs;
          const uint2 raw = *reinterpret_cast<const uint2*>(st + L::kTileBytes +
                                                            (16 * warp + r) * L::kRowBytes + c * 8);
          *reinterpret_cast<uint4*>(w + r * kPitch + c * 8) = Fp8x8ToBf16x8(raw);
        }
        v_rows = w;
      } else {
        v_rows = reinterpret_cast<const uint16_t*>(st + L::kTileBytes) + 16 * warp * kPitch;
      }
      // S^T = K.Q^T: the warp's 16 keys (rows) by the 8 query columns.
      // Two accumulators (even and odd k-steps) halve the chain of dependent MMAs.
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sc_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ks += 2) {
        uint32_t ka[4], kb[4];
        if constexpr (kFp8) {
          // Keys g and g + 8, dims 16 ks + 8t .. + 7, widened in registers (see qb).
          const uint8_t* row = st + (16 * warp + g) * L::kRowBytes + ks * 16 + 8 * t;
          const uint4 lo = Fp8x8ToBf16x8(*reinterpret_cast<const uint2*>(row));
          const uint4 hi = Fp8x8ToBf16x8(*reinterpret_cast<const uint2*>(row + 8 * L::kRowBytes));
          ka[0] = lo.x, ka[1] = hi.x, ka[2] = lo.y, ka[3] = hi.y;
          kb[0] = lo.z, kb[1] = hi.z, kb[2] = lo.w, kb[3] = hi.w;
        } else {
          const uint16_t* k_rows = reinterpret_cast<const uint16_t*>(st) + 16 * warp * kPitch;
          LoadMatrixX4<false>(
              ka, k_rows + ((mat & 1) * 8 + (lane & 7)) * kPitch + ks * 16 + (mat >> 1) * 8);
          LoadMatrixX4<false>(
              kb, k_rows + ((mat & 1) * 8 + (lane & 7)) * kPitch + ks * 16 + 16 + (mat >> 1) * 8);
        }
        MmaBf16(sc, ka, qb[ks][0], qb[ks][1]);
        MmaBf16(sc_odd, kb, qb[ks + 1][0], qb[ks + 1][1]);
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
      // P as BF16 pairs (queries 2t, 2t + 1) of keys g and g + 8: its rounding and (kSplitP)
      // the rounding of the remainder; then moved to the P^T fragment layout.
      uint32_t hi[2], lo[2] = {0u, 0u};
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        hi[k] = PackBf16x2(pr[2 * k], pr[2 * k + 1]);
        if constexpr (kSplitP) {
          lo[k] = PackBf16x2(pr[2 * k] - Bf16ToFloat(hi[k] & 0xFFFFu),
                             pr[2 * k + 1] - Bf16ToFloat(hi[k] >> 16));
        }
      }
      uint32_t ph[2], pl[2] = {0u, 0u};
#pragma unroll
      for (int k = 0; k < 2; ++k) {  // k = 0: keys 2t, 2t + 1; k = 1: keys 2t + 8, 2t + 9
        ph[k] = __byte_perm(__shfl_sync(0xffffffffu, hi[k], src_even),
                            __shfl_sync(0xffffffffu, hi[k], src_odd), half_sel);
        if constexpr (kSplitP) {
          pl[k] = __byte_perm(__shfl_sync(0xffffffffu, lo[k], src_even),
                              __shfl_sync(0xffffffffu, lo[k], src_odd), half_sel);
        }
      }
      if constexpr (kFp8) {
        __syncwarp();  // every lane's value rows are widened before any lane reads them
      }
      // O^T += V^T.P^T: A fragments of V^T (dims x keys) by ldmatrix.trans of the V rows.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t va[4];
        LoadMatrixX4<true>(
            va, v_rows + ((mat >> 1) * 8 + (lane & 7)) * kPitch + mt * 16 + (mat & 1) * 8);
        MmaBf16(o[mt], va, ph[0], ph[1]);
        if constexpr (kSplitP) MmaBf16(o[mt], va, pl[0], pl[1]);
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
