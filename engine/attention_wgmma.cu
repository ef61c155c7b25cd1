// Causal varlen prefill attention on Hopper's warpgroup MMA (engine/attention_wgmma.h).
// Plain CUDA C++17; the kernel body needs sm_90a and traps elsewhere (the launcher is only
// called where TPSERVE_HAS_SM90A is defined and the device is compute capability 9.0).
//
// A block of two consumer warpgroups takes one (sequence, query head) and a tile of 128 query
// rows at a time, 64 rows per warpgroup, and copies the next tile's Q and first K and V tiles
// in while it writes the current one's output; with a work counter the grid is persistent, a
// block an SM, taking units of tiles from the counter (the work order:
// LaunchCausalAttentionWgmma). Q (128 x 128) and three stages each of K and V tiles of 128
// keys sit in shared memory as 128-byte swizzled panels (engine/wgmma.cuh), brought by TMA
// (one thread issues the copies; transaction barriers say when a stage is full, and both
// warpgroups release it when their products have read it). Per key tile j, a warpgroup issues
// S_j = Q K_j^T (eight m64n128k16 products, both operands from shared memory) together with
// O += P_{j-1} V_{j-1} (P from registers: the S accumulator's layout is the A fragment's; V
// read MN-major), then computes the online softmax of S_j in registers, its exponentials
// while P_{j-1} V_{j-1} is still in flight. The two warpgroups
// take turns to issue (two named barriers), so one's softmax runs while the other's products
// occupy the tensor cores.
//
// Rows of the packed buffer past the sequence are read too (TMA stops only at the buffer's
// end, filling zeros there): their keys are masked, and the value rows past the sequence in
// its last key tile are zeroed in shared memory before use, so that a non-finite value of
// another sequence cannot reach this one through 0 * V.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>

#include "comm/cuda_check.h"
#include "engine/attention_fp8.cuh"
#include "engine/attention_store.cuh"
#include "engine/attention_wgmma.h"
#include "engine/device_math.cuh"
#include "engine/launch_checks.h"
#include "engine/mma.cuh"
#include "engine/wgmma.cuh"
#include "layers/fp8_divide.cuh"

namespace tpserve {
namespace {

using namespace device;

constexpr int kHeadDim = 128;
constexpr int kBr = 128;  // query rows per block, 64 per warpgroup
constexpr int kBc = 128;  // keys per tile
constexpr int kWgThreads = 256;
constexpr int kPanelBytes = 128 * 128;  // 128 rows x 128 bytes (one swizzle width, one TMA box)
constexpr int kStages = 3;              // K and V tiles in flight or in use
// A tile of 128 rows of head_dim 128: two panels of 64 BF16 each, or one of 128 E4M3 codes
// (Q, K; the E4M3 V tile is V^T: 128 dims of 128 keys).
template <bool kFp8>
inline constexpr int kTileBytes = (kFp8 ? 1 : 2) * kPanelBytes;
// Shared layout: [Q | K 0..2 | V 0..2].
template <bool kFp8>
inline constexpr int kKOffset = kTileBytes<kFp8>;
template <bool kFp8>
inline constexpr int kVOffset = (1 + kStages) * kTileBytes<kFp8>;
// + slack to align the base to 1024 bytes: BF16 230,400 bytes of the 232,448 a block may have.
template <bool kFp8>
inline constexpr int kSmemBytes = (1 + 2 * kStages) * kTileBytes<kFp8> + 1024;
// E4M3 probabilities are exp2 weights scaled by 2^8 (the row maximum's weight is 256, within
// E4M3's 448): weights down to 2^-17 keep a code instead of 2^-9. The row sums carry the same
// factor, so the output does not change.
constexpr float kFp8WeightLog2 = 8.0f;
// Transaction barriers: Q full / empty, then per stage K full, V full, K empty, V empty.
constexpr int kFullQ = 0, kEmptyQ = 1, kFullK = 2, kFullV = 2 + kStages, kEmptyK = 2 + 2 * kStages,
              kEmptyV = 2 + 3 * kStages, kBarriers = 2 + 4 * kStages;
// Named barriers: warpgroup w may issue its products once barrier kTurn + w completes (the
// other warpgroup arrives on it after issuing its own); kWgLocal + w is warpgroup-local.
constexpr int kTurn = 1, kWgLocal = 3;

// One block's current piece of work: Q tile `tile` of (sequence `seq`, query head `head`),
// and what its copies and masks need. Trivial, so that blocks can hand one over in shared memory;
// resolve sets every field.
struct AttentionUnit {
  int head, seq, begin, len, tile;
  int kv_head, key_len, q_off, vt_begin;
  const int32_t* table;  // paged: the sequence's block table
};

// kPaged: keys and values from the paged cache (k_map = v_map = the cache as 128-element
// rows, boxes of one block), the sequences pk.seqs[item] of the units (y, item, head); a
// sequence's n query rows are the last n of its context. Otherwise from packed rows (k_map, v_map).
// kFp8 (packed rows only): Q, K and V^T as E4M3 (Fp8AttentionInputs, engine/attention_fp8.h),
// q_map and k_map over their rows, v_map over V^T; fp8_scales[0..2] their dequantization
// scales. Both products take E4M3 operands (k32 steps); P is rounded to E4M3.
template <bool kPaged, bool kFp8>
__global__ void __launch_bounds__(kWgThreads, 1)
    CausalAttentionWgmmaKernel(const __grid_constant__ CUtensorMap q_map,
                               const __grid_constant__ CUtensorMap k_map,
                               const __grid_constant__ CUtensorMap v_map, AttentionParams p,
                               WgmmaPagedKeys pk, float scale_log2, const float* fp8_scales,
                               int tile_slots, int32_t* work_counter) {
  static_assert(!(kPaged && kFp8), "E4M3 inputs are packed rows");
  constexpr int kTile = kTileBytes<kFp8>;
  constexpr int kKOff = kKOffset<kFp8>;
  constexpr int kVOff = kVOffset<kFp8>;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t wg_smem_raw[];
  __shared__ __align__(8) uint64_t barriers[kBarriers];
  // 1024-byte aligned base: the swizzle pattern repeats every 1024 bytes of address.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem_raw));
  const uint32_t smem = (raw + 1023u) & ~1023u;
  const uint32_t q_tile = smem;
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(barriers));
  auto bar = [&](int i) { return bar0 + 8u * static_cast<uint32_t>(i); };

  const int q_heads = static_cast<int>(p.q_heads);
  const int tokens = static_cast<int>(p.tokens);
  const Fp8Divisor out_divisor = AttentionOutDivisor(p);
  const int64_t units_per_slot = p.num_seqs * p.q_heads;
  const int64_t total_units = units_per_slot * tile_slots;
  // E4M3: the dequantization scales (Q's and K's into the scores' exponent, V's into the row
  // sums).
  float inv_v_scale = 1.0f;
  if constexpr (kFp8) {
    scale_log2 *= fp8_scales[0] * fp8_scales[1];
    inv_v_scale = 1.0f / fp8_scales[2];
  }
  // Unit v is (slot y, listed sequence, head), y-major, so the heaviest come first; it has no
  // tile where y >= the sequence's tile count, nor (paged) for sequences of fewer than two
  // query rows, which the split kernels take. A paged sequence with a corrupt context length
  // has nothing to attend: its unit's rows are written as zeros and it has no tile either
  // (paged units are never persistent, so the whole block resolves them).
  auto resolve = [&](int64_t v, AttentionUnit& u) {
    const int64_t y = v / units_per_slot;
    const int64_t rem = v - y * units_per_slot;
    const int item = static_cast<int>(rem / q_heads);
    u.head = static_cast<int>(rem - int64_t{item} * q_heads);
    u.seq = kPaged ? pk.seqs[item] : item;
    int begin = p.cu_seqlens[u.seq];
    int end = p.cu_seqlens[u.seq + 1];
    begin = begin < 0 ? 0 : (begin > tokens ? tokens : begin);
    end = end < begin ? begin : (end > tokens ? tokens : end);
    u.begin = begin;
    u.len = end - begin;
    const int num_tiles = (u.len + kBr - 1) / kBr;
    if (y >= num_tiles) return false;
    u.tile = num_tiles - 1 - static_cast<int>(y);
    u.kv_head = u.head / (q_heads / static_cast<int>(p.kv_heads));
    u.vt_begin = kFp8 ? Fp8VtBegin(begin, u.seq) : 0;
    u.table = nullptr;
    // Keys 0 .. key_len - 1 exist; query row r (from `begin`) is at position q_off + r.
    u.key_len = u.len;
    u.q_off = 0;
    if constexpr (kPaged) {
      if (u.len < 2) return false;
      const int64_t cap = pk.max_blocks * pk.block_size;
      const int64_t c = pk.context_lens[u.seq];
      u.key_len = static_cast<int>(c < 0 ? 0 : (c > cap ? cap : c));
      u.q_off = u.key_len > u.len ? u.key_len - u.len : 0;
      u.table = pk.block_tables + static_cast<int64_t>(u.seq) * pk.max_blocks;
      if (u.key_len < 1) {
        uint16_t* out = reinterpret_cast<uint16_t*>(p.out);
        for (int tile = u.tile; tile >= 0; tile -= tile_slots) {
          const int rows = min(kBr, u.len - tile * kBr);
          for (int i = static_cast<int>(threadIdx.x); i < rows * kHeadDim; i += kWgThreads) {
            out[static_cast<int64_t>(begin + tile * kBr + i / kHeadDim) * p.out_row_stride +
                int64_t{u.head} * kHeadDim + i % kHeadDim] = 0;
          }
        }
        return false;
      }
    }
    return true;
  };
  // Persistent (work_counter set; packed rows only): the issuer takes units from the counter,
  // v first, until one has a tile; -1 when none is left. A unit without a tile means its
  // sequence has none at that slot for any head: the counter skips the rest of its heads (a
  // batch padded with empty sequence slots would otherwise cost a take each, at the grid's
  // tail).
  const bool persistent = !kPaged && work_counter != nullptr;
  auto take_unit = [&](int64_t v, AttentionUnit& n) -> int64_t {
    for (;; v = atomicAdd(work_counter, 1)) {
      if (v >= total_units) return -1;
      if (resolve(v, n)) return v;
      const int64_t next_item = (v / q_heads + 1) * q_heads;
      if (next_item - v > 1) atomicMax(work_counter, static_cast<int>(next_item));
    }
  };
  // Persistent: the units the issuer took, alternately, whole (so that the others need not
  // read cu_seqlens and the rest again), and whether there was one.
  __shared__ AttentionUnit unit_slot[2];
  __shared__ int unit_found[2];

  const int wg = static_cast<int>(threadIdx.x) >> 7;          // warpgroup: rows 64 wg ..
  const int wg_thread = static_cast<int>(threadIdx.x) & 127;  // thread in the warpgroup
  const int warp = wg_thread >> 5;                            // warp in the warpgroup
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  // The copies are issued by the first thread of warpgroup 1, which issues its products
  // after warpgroup 0: by then warpgroup 0 has released what the copies overwrite.
  const bool issuer = threadIdx.x == 128;

  if (threadIdx.x == 0) {
    MbarInit(bar(kFullQ), 1);
    MbarInit(bar(kEmptyQ), 2);
    for (int s = 0; s < kStages; ++s) {
      MbarInit(bar(kFullK + s), 1);
      MbarInit(bar(kFullV + s), 1);
      MbarInit(bar(kEmptyK + s), 2);
      MbarInit(bar(kEmptyV + s), 2);
    }
    MbarInitFence();
  }
  AttentionUnit cur;
  if (persistent && issuer) {
    unit_found[0] = take_unit(atomicAdd(work_counter, 1), unit_slot[0]) >= 0;
  }
  __syncthreads();
  bool have = false;
  if (persistent) {
    have = unit_found[0] != 0;
    cur = unit_slot[0];
  } else {
    have = resolve(blockIdx.x, cur);
  }
  int units_taken = 1;
  float amax = 0.0f;
  if (have) {
    // Key tiles and Q tiles this block has used before the current Q tile: a tile's stage
    // and the parity of its barriers' phase follow from its running index.
    uint32_t kv_used = 0, q_used = 0;
    auto issue_kv = [&](const AttentionUnit& u, int key_tile, bool values) {
      const uint32_t n = kv_used + static_cast<uint32_t>(key_tile);
      const int stage = static_cast<int>(n % kStages);
      const uint32_t use = n / kStages;
      if (use > 0) MbarWait(bar((values ? kEmptyV : kEmptyK) + stage), (use - 1) & 1);
      const uint32_t full = bar((values ? kFullV : kFullK) + stage);
      const uint32_t dst = smem + (values ? kVOff : kKOff) + stage * kTile;
      if constexpr (kPaged) {
        // One box per cache block up to the context's end (key_tile * kBc < key_len); rows past
        // it are masked (keys) or zeroed before use (values).
        const int bs = pk.block_size;
        const int kv0 = key_tile * kBc;
        const int count = (min(kv0 + kBc, u.key_len) - kv0 + bs - 1) / bs;
        MbarArriveExpectTx(full, static_cast<uint32_t>(count * bs * 256));
        for (int i = 0; i < count; ++i) {
          int b = u.table[kv0 / bs + i];
          if (b < 0 || b >= pk.num_blocks) b = 0;  // a corrupt table: never outside the cache
          const int row = static_cast<int>((values ? pk.v_row0 : pk.k_row0) +
                                           static_cast<int64_t>(b) * pk.block_rows +
                                           static_cast<int64_t>(u.kv_head) * bs);
          TmaLoad2d(dst + i * bs * 128, &k_map, 0, row, full);
          TmaLoad2d(dst + kPanelBytes + i * bs * 128, &k_map, 64, row, full);
        }
      } else if constexpr (kFp8) {
        MbarArriveExpectTx(full, kTile);
        if (values) {
          TmaLoad2d(dst, &v_map, u.vt_begin + key_tile * kBc, u.kv_head * kHeadDim, full);
        } else {
          TmaLoad2d(dst, &k_map, u.kv_head * kHeadDim, u.begin + key_tile * kBc, full);
        }
      } else {
        MbarArriveExpectTx(full, kTile);
        const int row = u.begin + key_tile * kBc;
        const CUtensorMap* map = values ? &v_map : &k_map;
        TmaLoad2d(dst, map, u.kv_head * kHeadDim, row, full);
        TmaLoad2d(dst + kPanelBytes, map, u.kv_head * kHeadDim + 64, row, full);
      }
    };
    auto wait_kv = [&](int key_tile, bool values) {
      const uint32_t n = kv_used + static_cast<uint32_t>(key_tile);
      MbarWait(bar((values ? kFullV : kFullK) + static_cast<int>(n % kStages)), (n / kStages) & 1);
    };
    auto release_kv = [&](int key_tile, bool values) {
      const uint32_t n = kv_used + static_cast<uint32_t>(key_tile);
      if (wg_thread == 0)
        MbarArrive(bar((values ? kEmptyV : kEmptyK) + static_cast<int>(n % kStages)));
    };
    auto stage_of = [&](int key_tile) {
      return static_cast<int>((kv_used + static_cast<uint32_t>(key_tile)) % kStages);
    };

    // This warpgroup's Q rows: BF16 k-step s reads panel s / 4, 32 bytes in per step; an E4M3
    // step (k32) reads the one panel, 32 bytes in per step.
    auto q_desc = [&](int s) {
      if constexpr (kFp8) return SmemDescSw128(q_tile + wg * 64 * 128 + s * 32, 0, 1024);
      return SmemDescSw128(q_tile + (s >> 2) * kPanelBytes + wg * 64 * 128 + (s & 3) * 32, 0, 1024);
    };
    auto k_desc = [&](int stage, int s) {
      if constexpr (kFp8) return SmemDescSw128(smem + kKOff + stage * kTile + s * 32, 0, 1024);
      return SmemDescSw128(smem + kKOff + stage * kTile + (s >> 2) * kPanelBytes + (s & 3) * 32, 0,
                           1024);
    };
    // BF16 V as B of P V: K = keys on the rows (16 per step: 2048 bytes), N = dims across the
    // two panels (LBO), 8-key groups 1024 bytes apart (SBO). E4M3 V^T: K-major, N = dims on the
    // rows, 32 keys per step.
    auto v_desc = [&](int stage, int s) {
      if constexpr (kFp8) return SmemDescSw128(smem + kVOff + stage * kTile + s * 32, 0, 1024);
      return SmemDescSw128(smem + kVOff + stage * kTile + s * 2048, kPanelBytes, 1024);
    };
    constexpr int kKSteps = kFp8 ? 4 : 8;  // k-steps of either product over 128

    const int my_turn = kTurn + wg, other_turn = kTurn + (wg ^ 1);
    if (wg == 1) NamedBarrierArrive(kTurn, kWgThreads);  // warpgroup 0 issues first

    // Key tiles of u's Q tile (causal: none past its last row).
    auto key_tiles = [&](const AttentionUnit& u) {
      return (min(u.q_off + u.tile * kBr + kBr, u.key_len) + kBc - 1) / kBc;
    };
    // The copies that start u's Q tile: Q, K0, V0 and K1 (kv_used and q_used count the tiles
    // before it). For every tile after the block's first, the issuer starts them as soon as both
    // warpgroups are done with the previous Q, so that they land during its output stage.
    auto issue_start = [&](const AttentionUnit& u) {
      if (q_used > 0) MbarWait(bar(kEmptyQ), (q_used - 1) & 1);
      MbarArriveExpectTx(bar(kFullQ), kTile);
      const int row = u.begin + u.tile * kBr;
      TmaLoad2d(q_tile, &q_map, u.head * kHeadDim, row, bar(kFullQ));
      if constexpr (!kFp8) {
        TmaLoad2d(q_tile + kPanelBytes, &q_map, u.head * kHeadDim + 64, row, bar(kFullQ));
      }
      issue_kv(u, 0, false);
      issue_kv(u, 0, true);
      if (key_tiles(u) > 1) issue_kv(u, 1, false);
    };
    if (issuer) issue_start(cur);

    // Each unit's tiles from the last (the most keys) down, so the heaviest go first.
    for (;;) {
      // The work after this tile: the unit's next tile (tile_slots fewer), which every thread
      // knows, else (persistent) the next unit from the counter, which the issuer takes during
      // this tile (it reads the answer under the tile's last products) to start its copies, and
      // the others learn after it; else none.
      const bool same_unit = cur.tile - tile_slots >= 0;
      const bool take = persistent && issuer && !same_unit;
      AttentionUnit next = cur;
      bool has_next = same_unit;
      next.tile -= tile_slots;
      const int64_t taken = take ? atomicAdd(work_counter, 1) : 0;
      const AttentionUnit& u = cur;
      const int q_off = u.q_off, key_len = u.key_len;
      const int q0 = u.tile * kBr;
      const int n_kv = key_tiles(u);
      const int row_lo = q0 + wg * 64 + warp * 16 + g;  // this thread's rows: row_lo, row_lo + 8
      auto pass_turn = [&]() { NamedBarrierArrive(other_turn, kWgThreads); };

      // After step j's products: K(j + 2) and V(j + 1), two steps ahead of their use.
      auto issue_ahead = [&](int j) {
        if (!issuer) return;
        if (j + 2 < n_kv) issue_kv(u, j + 2, false);
        if (j + 1 < n_kv) issue_kv(u, j + 1, true);
      };

      float s_acc[64];
      float o[64];
      uint32_t p_frag[kKSteps][4];
#pragma unroll
      for (int i = 0; i < 64; ++i) o[i] = s_acc[i] = 0.0f;
      float row_max[2] = {-INFINITY, -INFINITY};
      float row_sum[2] = {0.0f, 0.0f};

      // The online softmax of S_j, in two parts so that the first runs while P_{j-1} V_{j-1}
      // is still in flight (it reads p_frag and writes o): the scores become exp2 weights in
      // place and the row sums are updated; then P_j is packed into p_frag and O rescaled.
      float alpha[2];
      auto softmax_weights = [&](int j) {
        const int kv0 = j * kBc;
        // Masks: keys after the row (causal) or past the sequence; only the tiles that reach
        // this warp's diagonal or the sequence's end have any (warp-uniform).
        if (kv0 + kBc - 1 > q_off + q0 + wg * 64 + warp * 16 || key_len - kv0 < kBc) {
          // Element (nt, e) is key kv0 + 8 nt + 2t + (e & 1) of row row_lo + 8 (e >> 1), at
          // position q_off + that row.
          const int last_key = key_len - 1 - kv0 - 2 * t;
          const int limit[2] = {min(q_off + row_lo - kv0 - 2 * t, last_key),
                                min(q_off + row_lo + 8 - kv0 - 2 * t, last_key)};
#pragma unroll
          for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (nt * 8 + (e & 1) > limit[e >> 1]) s_acc[4 * nt + e] = -INFINITY;
            }
          }
        }
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 64; ++i)
          tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], s_acc[i]);
        float base[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          alpha[h] = SoftmaxRowStep(tile_max[h], row_max[h], scale_log2, base[h]);
          if constexpr (kFp8) base[h] -= kFp8WeightLog2;
        }
        float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 64; ++i) {
          s_acc[i] = Exp2Approx(fmaf(s_acc[i], scale_log2, -base[(i >> 1) & 1]));
          tile_sum[(i >> 1) & 1] += s_acc[i];
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
      };
      auto softmax_finish = [&]() {
        if constexpr (kFp8) {
          // n8 tiles 4kk .. 4kk + 3 of S are the A fragment kk of P V: a register takes two
          // tiles' pairs of one row, so k slot 4t + i of a 16-key half holds key
          // 2t + (i & 1) + 8 (i >> 1) of it, the order Fp8AttentionInputs' V^T keeps.
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int nt = 4 * kk + 2 * (r >> 1), e = 2 * (r & 1);
              p_frag[kk][r] = PackE4M3x4(s_acc[4 * nt + e], s_acc[4 * nt + e + 1],
                                         s_acc[4 * nt + 4 + e], s_acc[4 * nt + 4 + e + 1]);
            }
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < 16; ++nt) {
            // n8 tiles 2kk and 2kk + 1 of S are the A fragment kk of P V.
            p_frag[nt >> 1][(nt & 1) * 2] = PackBf16x2(s_acc[4 * nt], s_acc[4 * nt + 1]);
            p_frag[nt >> 1][(nt & 1) * 2 + 1] = PackBf16x2(s_acc[4 * nt + 2], s_acc[4 * nt + 3]);
          }
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
      };
      auto issue_s = [&](int j) {
#pragma unroll
        for (int s = 0; s < kKSteps; ++s) {
          if constexpr (kFp8) {
            WgmmaSS64x128x32E4M3(s_acc, q_desc(s), k_desc(stage_of(j), s), s > 0 ? 1 : 0);
          } else {
            WgmmaSS64x128x16(s_acc, q_desc(s), k_desc(stage_of(j), s), s > 0 ? 1 : 0);
          }
        }
      };
      auto issue_pv = [&](int j) {
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) {
          if constexpr (kFp8) {
            WgmmaRS64x128x32E4M3(o, p_frag[kk], v_desc(stage_of(j), kk));
          } else {
            WgmmaRS64x128x16TransB(o, p_frag[kk], v_desc(stage_of(j), kk));
          }
        }
      };
      auto wait_products = [&]() {
        WgmmaWait<0>();
        PinRegisters(o);
        PinRegisters(s_acc);
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) PinRegisters(p_frag[kk]);
      };

      // Step 0: S_0 alone.
      MbarWait(bar(kFullQ), q_used & 1);
      wait_kv(0, false);
      NamedBarrierSync(my_turn, kWgThreads);
      WgmmaFence();
      issue_s(0);
      WgmmaCommit();
      pass_turn();
      wait_products();
      release_kv(0, false);
      issue_ahead(0);
      softmax_weights(0);
      softmax_finish();
      // Step j: S_j, then P_{j-1} V_{j-1} (two groups: S_j's weights are computed while the
      // second is in flight).
      for (int j = 1; j < n_kv; ++j) {
        wait_kv(j, false);
        wait_kv(j - 1, true);
        NamedBarrierSync(my_turn, kWgThreads);
        WgmmaFence();
        issue_s(j);
        WgmmaCommit();
        issue_pv(j - 1);
        WgmmaCommit();
        pass_turn();
        WgmmaWait<1>();
        PinRegisters(s_acc);
        release_kv(j, false);
        softmax_weights(j);
        wait_products();
        release_kv(j - 1, true);
        issue_ahead(j);
        softmax_finish();
      }
      // Last: P_{n-1} V_{n-1}, its value rows past the sequence zeroed first.
      wait_kv(n_kv - 1, true);
      {
        const int valid = key_len - (n_kv - 1) * kBc;
        if (valid < kBc) {
          uint8_t* v_tile = wg_smem_raw + (smem - raw) + kVOff + stage_of(n_kv - 1) * kTile;
          if constexpr (kFp8) {
            // V^T: row = dim, 16-byte chunk c = keys 16c .. 16c + 15. The producer zeroed the
            // slots past the sequence in its last group; the groups after it are another
            // sequence's (or never written).
            for (int c = (valid + 15) >> 4; c < kBc / 16; ++c) {
              *reinterpret_cast<uint4*>(v_tile + wg_thread * 128 + ((c ^ (wg_thread & 7)) << 4)) =
                  make_uint4(0, 0, 0, 0);
            }
          } else {
            for (int i = wg_thread; i < (kBc - valid) * 16; i += 128) {
              const int r = valid + (i >> 4), c = i & 15;
              *reinterpret_cast<uint4*>(v_tile + (c >> 3) * kPanelBytes + r * 128 + (c & 7) * 16) =
                  make_uint4(0, 0, 0, 0);
            }
          }
          FenceProxyAsyncShared();
          NamedBarrierSync(kWgLocal + wg, 128);
        }
      }
      NamedBarrierSync(my_turn, kWgThreads);
      WgmmaFence();
      issue_pv(n_kv - 1);
      WgmmaCommit();
      pass_turn();
      if (take) {
        has_next = take_unit(taken, next) >= 0;
        unit_slot[units_taken & 1] = next;
        unit_found[units_taken & 1] = has_next;
      }
      wait_products();
      release_kv(n_kv - 1, true);
      if (wg_thread == 0) MbarArrive(bar(kEmptyQ));
      kv_used += static_cast<uint32_t>(n_kv);
      ++q_used;
      if (issuer && has_next) issue_start(next);

      const AttentionOut out = MakeAttentionOut(p, u.begin, u.head, kHeadDim, out_divisor);
      auto store = [&](auto fast_divide) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          StoreAttentionRow<decltype(fast_divide)::value, 16>(
              out, row_lo + 8 * h, u.len, t, row_sum[h] * inv_v_scale, amax,
              [&](int dt) { return make_float2(o[4 * dt + 2 * h], o[4 * dt + 2 * h + 1]); });
        }
      };
      if (out.divisor.inv != 0.0f) {
        store(std::true_type{});
      } else {
        store(std::false_type{});
      }
      if (same_unit) {
        cur = next;
        continue;
      }
      if (!persistent) break;
      __syncthreads();  // the issuer's unit_slot write is visible
      const int k = units_taken++ & 1;
      if (!unit_found[k]) break;
      cur = unit_slot[k];
    }
    // Warpgroup 1 handed the turn over after its last products too: take it, so that no
    // arrival is left pending on the barrier.
    if (wg == 0) NamedBarrierSync(kTurn, kWgThreads);
  }
  if (persistent && threadIdx.x == 0) {
    // The last block out (all blocks' last take has found the counter past the units) zeroes
    // the counter for the next launch.
    __threadfence();
    if (atomicAdd(work_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(work_counter, 0);
      atomicExch(work_counter + 1, 0);
    }
  }
  if (p.out_amax != nullptr) BlockAmaxInto(p.out_amax, amax);
#else
  (void)q_map, (void)k_map, (void)v_map, (void)p, (void)pk, (void)scale_log2, (void)fp8_scales;
  (void)tile_slots, (void)work_counter;
  __trap();
#endif
}

// cuTensorMapEncodeTiled, from the driver through the runtime (no link to libcuda).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

StatusOr<EncodeTiledFn> EncodeTiled() {
  static std::once_flag once;
  static EncodeTiledFn fn = nullptr;
  static std::string error;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query{};
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                           cudaEnableDefault, &query);
    if (e != cudaSuccess || query != cudaDriverEntryPointSuccess || ptr == nullptr) {
      error = std::string("cuTensorMapEncodeTiled is not available from the driver: ") +
              cudaGetErrorString(e);
      return;
    }
    fn = reinterpret_cast<EncodeTiledFn>(ptr);
  });
  if (fn == nullptr) return InternalError(error);
  return fn;
}

// A [rows, columns] BF16 matrix (codes: of E4M3 bytes) with row stride `stride` elements,
// read in boxes of `box_rows` rows x 128 bytes (64 BF16 or 128 codes: one 128-byte swizzled
// panel); rows and columns past the matrix read as 0.
StatusOr<CUtensorMap> PanelMap(EncodeTiledFn encode, const void* base, int64_t columns,
                               int64_t rows, int64_t stride, int box_rows, const char* name,
                               bool codes = false) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * (codes ? 1 : 2)};
  const cuuint32_t box[2] = {codes ? 128u : 64u, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      encode(&map, codes ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
             const_cast<void*>(base), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return InternalError(std::string(name) + ": cuTensorMapEncodeTiled failed (CUresult " +
                         std::to_string(r) + ")");
  }
  return map;
}

// How a launch covers p's num_seqs * q_heads * tile_slots units.
struct WgmmaGrid {
  int64_t tile_slots = 1;
  int32_t* counter = nullptr;  // p.work_counter where the persistent grid is used
  unsigned blocks = 1;
};

// tile_slots: for sequences of up to 16 tiles (on average) a quarter of their tiles a unit
// (faster there than a unit a tile, persistent or not), for longer ones a tile a unit; at least
// two units per SM; within [1, most_tiles], and grid.x bounds the units of a block per unit.
// The persistent grid (a block per SM, one fits by its shared memory; never more blocks than
// units) where it measured faster than a block per unit: one-tile sequences (the next unit
// without a launch, its copies under the current one's output) and long ones (better
// balance); at 2 to 16 tiles a block per unit stays faster. And only where the counter's 32
// bits hold every take (each block's last passes the units by one, a skip by up to q_heads).
WgmmaGrid PlanWgmmaGrid(const AttentionParams& p, int64_t most_tiles, int64_t average_tiles,
                        int sms) {
  const int64_t items = p.num_seqs * p.q_heads;
  const int64_t per_unit = average_tiles > 16 ? 1 : 4;
  const int64_t wanted = (average_tiles + per_unit - 1) / per_unit;
  const int64_t fill = items > 0 ? (2 * int64_t{sms} + items - 1) / items : 1;
  WgmmaGrid g;
  g.tile_slots =
      std::max<int64_t>(1, std::min({std::max(wanted, fill), most_tiles,
                                     launch_checks::kMaxGridX / std::max<int64_t>(1, items)}));
  const int64_t units = items * g.tile_slots;
  const bool pays = average_tiles <= 1 || average_tiles > 16;
  if (pays && units + sms + p.q_heads < std::numeric_limits<int32_t>::max()) {
    g.counter = p.work_counter;
  }
  g.blocks = static_cast<unsigned>(
      std::max<int64_t>(1, g.counter != nullptr ? std::min<int64_t>(units, sms) : units));
  return g;
}

}  // namespace

bool WgmmaAttentionSupports(int64_t head_dim) {
#if defined(TPSERVE_HAS_SM90A)
  if (head_dim != kHeadDim) return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
#else
  (void)head_dim;
  return false;
#endif
}

Status LaunchCausalAttentionWgmma(const AttentionParams& p, int64_t most_tiles,
                                  int64_t average_tiles, int sms, float scale_log2,
                                  cudaStream_t stream) {
  TP_ASSIGN_OR_RETURN(EncodeTiledFn encode, EncodeTiled());
  TP_ASSIGN_OR_RETURN(CUtensorMap q_map, PanelMap(encode, p.q, p.q_heads * kHeadDim, p.tokens,
                                                  p.q_row_stride, kBr, "AttentionParams.q"));
  TP_ASSIGN_OR_RETURN(CUtensorMap k_map, PanelMap(encode, p.k, p.kv_heads * kHeadDim, p.tokens,
                                                  p.k_row_stride, kBc, "AttentionParams.k"));
  TP_ASSIGN_OR_RETURN(CUtensorMap v_map, PanelMap(encode, p.v, p.kv_heads * kHeadDim, p.tokens,
                                                  p.v_row_stride, kBc, "AttentionParams.v"));
  constexpr int kSmem = kSmemBytes<false>;
  TP_CUDA_CHECK(cudaFuncSetAttribute(CausalAttentionWgmmaKernel<false, false>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const WgmmaGrid g = PlanWgmmaGrid(p, most_tiles, average_tiles, sms);
  CausalAttentionWgmmaKernel<false, false><<<g.blocks, kWgThreads, kSmem, stream>>>(
      q_map, k_map, v_map, p, WgmmaPagedKeys{}, scale_log2, nullptr, static_cast<int>(g.tile_slots),
      g.counter);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchCausalAttentionWgmmaFp8(const AttentionParams& p, const Fp8AttentionInputs& in,
                                     int64_t most_tiles, int64_t average_tiles, int sms,
                                     float scale_log2, cudaStream_t stream) {
  TP_ASSIGN_OR_RETURN(EncodeTiledFn encode, EncodeTiled());
  const int64_t q_width = p.q_heads * kHeadDim, kv_width = p.kv_heads * kHeadDim;
  TP_ASSIGN_OR_RETURN(CUtensorMap q_map, PanelMap(encode, in.q, q_width, p.tokens, q_width, kBr,
                                                  "Fp8AttentionInputs.q", true));
  TP_ASSIGN_OR_RETURN(CUtensorMap k_map, PanelMap(encode, in.k, kv_width, p.tokens, kv_width, kBc,
                                                  "Fp8AttentionInputs.k", true));
  TP_ASSIGN_OR_RETURN(CUtensorMap v_map,
                      PanelMap(encode, in.vt, in.vt_columns, kv_width, in.vt_columns, kHeadDim,
                               "Fp8AttentionInputs.vt", true));
  constexpr int kSmem = kSmemBytes<true>;
  TP_CUDA_CHECK(cudaFuncSetAttribute(CausalAttentionWgmmaKernel<false, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const WgmmaGrid g = PlanWgmmaGrid(p, most_tiles, average_tiles, sms);
  CausalAttentionWgmmaKernel<false, true><<<g.blocks, kWgThreads, kSmem, stream>>>(
      q_map, k_map, v_map, p, WgmmaPagedKeys{}, scale_log2, in.scales,
      static_cast<int>(g.tile_slots), g.counter);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

bool WgmmaPagedAttentionSupports(int64_t head_dim, int64_t block_size, int64_t cache_rows) {
  return WgmmaAttentionSupports(head_dim) && block_size >= 8 && block_size % 8 == 0 &&
         kBc % block_size == 0 && cache_rows <= std::numeric_limits<int32_t>::max();
}

Status LaunchPagedPrefillAttentionWgmma(const AttentionParams& p, const WgmmaPagedKeys& pk,
                                        int64_t most_tiles, int sms, float scale_log2,
                                        cudaStream_t stream) {
  TP_ASSIGN_OR_RETURN(EncodeTiledFn encode, EncodeTiled());
  TP_ASSIGN_OR_RETURN(CUtensorMap q_map, PanelMap(encode, p.q, p.q_heads * kHeadDim, p.tokens,
                                                  p.q_row_stride, kBr, "PagedAttentionParams.q"));
  TP_ASSIGN_OR_RETURN(CUtensorMap cache_map,
                      PanelMap(encode, pk.cache, kHeadDim, pk.cache_rows, kHeadDim, pk.block_size,
                               "PagedAttentionParams.cache"));
  constexpr int kSmem = kSmemBytes<false>;
  TP_CUDA_CHECK(cudaFuncSetAttribute(CausalAttentionWgmmaKernel<true, false>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  // Never persistent (p carries no counter): a block per unit.
  const WgmmaGrid g = PlanWgmmaGrid(p, most_tiles, most_tiles, sms);
  CausalAttentionWgmmaKernel<true, false>
      <<<g.blocks, kWgThreads, kSmem, stream>>>(q_map, cache_map, cache_map, p, pk, scale_log2,
                                                nullptr, static_cast<int>(g.tile_slots), nullptr);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
