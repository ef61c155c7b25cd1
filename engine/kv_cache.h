// The paged KV cache: fixed-size blocks of tokens' keys and values, one pool
// per rank allocated once at start, shared by all sequences through block
// tables.
//
// Two halves:
// - BlockPool: which blocks are free (pure bookkeeping, owned by the
//   scheduler on rank 0). Every rank's pool has the same block ids; a rank
//   holds its shard of the KV heads of each block.
// - KvCacheLayout / CpuKvCache: where a (layer, K|V, block, head, slot, dim)
//   element lives, and the CPU reference storage. The CUDA cache uses the
//   same layout, so a block table means the same thing on both backends.
//
// Layout (elements, row-major):
//   [layers][2: K, V][num_blocks][kv_heads][block_size][head_dim]
// so that one head's keys of one block are contiguous (block_size * head_dim
// elements): decode attention reads a block per head as one run.
//
// Element types: BF16 (the bits of the rounded FP32 value) or FP8 E4M3
// holding value / scale with saturation, a scale for K and one for V per
// layer (KvScales: the checkpoint's k_scale / v_scale, else 1, where values
// above 448 saturate).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "comm/status.h"

namespace tpserve {

enum class KvCacheDtype { kBFloat16, kFloat8E4M3 };

// One layer's dequantization scales of an E4M3 cache: code c of a key stands for c * k, and a
// key x is stored as the E4M3 code of x / k (FP32 division, round to nearest even, saturating
// at +-448); the same for values with v. From the checkpoint (engine/model_weights.h:
// LayerWeights::kv_scales), else 1. A BF16 cache ignores them.
struct KvScales {
  float k = 1.0f;
  float v = 1.0f;
};
// INVALID_ARGUMENT naming `what` and the scale unless both are finite and > 0.
Status CheckKvScales(const KvScales& s, const std::string& what);

// One line for a start-up log: which scales a cache of `dtype` quantizes with (the range of
// `scales`, one pair a layer, or that they are all 1 and what saturates then; that a BF16 cache
// leaves a checkpoint's unused).
std::string KvScalesSummary(KvCacheDtype dtype, const std::vector<KvScales>& scales);

// A layer's largest |key| (RoPE applied) and |value| over some tokens (CpuModel::MeasureKvAbsMax).
struct KvAbsMax {
  float k = 0.0f;
  float v = 0.0f;
};
// The scales that put those at E4M3's largest code, 448 (layers/fp8.h's ScaleFromAmax: amax /
// 448, 1 for an amax of 0): a calibration of the E4M3 cache, as the checkpoint writers make
// k_scale and v_scale.
KvScales KvScalesForAbsMax(const KvAbsMax& m);

// "bf16" | "fp8"; INVALID_ARGUMENT naming the allowed values otherwise.
StatusOr<KvCacheDtype> ParseKvCacheDtype(const std::string& s);
const char* KvCacheDtypeName(KvCacheDtype d);
inline int64_t KvCacheElementBytes(KvCacheDtype d) { return d == KvCacheDtype::kBFloat16 ? 2 : 1; }

struct KvCacheLayout {
  int64_t layers = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 16;  // tokens per block
  int64_t kv_heads = 0;     // this rank's KV heads
  int64_t head_dim = 0;
  KvCacheDtype dtype = KvCacheDtype::kBFloat16;

  // Bytes one block takes on one rank (all layers, K and V).
  int64_t BlockBytes() const {
    return layers * 2 * kv_heads * block_size * head_dim * KvCacheElementBytes(dtype);
  }
  int64_t Elements() const { return layers * 2 * num_blocks * kv_heads * block_size * head_dim; }
  // Element index of (layer, kv: 0 = K / 1 = V, block, head, slot, 0).
  int64_t Offset(int64_t layer, int kv, int64_t block, int64_t head, int64_t slot) const {
    return ((((layer * 2 + kv) * num_blocks + block) * kv_heads + head) * block_size + slot) *
           head_dim;
  }
  // INVALID_ARGUMENT naming the field for non-positive sizes.
  Status Validate() const;

  // Spelled out: the header is also compiled as C++17 (CUDA sources).
  friend bool operator==(const KvCacheLayout& a, const KvCacheLayout& b) {
    return a.layers == b.layers && a.num_blocks == b.num_blocks && a.block_size == b.block_size &&
           a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.dtype == b.dtype;
  }
};

// Blocks a sequence of `tokens` tokens needs.
inline int64_t BlocksFor(int64_t tokens, int64_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

// Free-list bookkeeping of `num_blocks` block ids. Not thread-safe (the
// scheduler's thread owns it).
class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks);

  int64_t total() const { return total_; }
  int64_t free() const { return static_cast<int64_t>(free_.size()); }
  int64_t used() const { return total_ - free(); }

  // Appends `n` block ids to `table`; false (nothing taken) when fewer than
  // `n` are free.
  bool Allocate(int64_t n, std::vector<int32_t>* table);
  // Returns every block of `table` and clears it.
  void Release(std::vector<int32_t>* table);

 private:
  int64_t total_;
  std::vector<int32_t> free_;  // a stack: the most recently freed is reused first
};

// One rank's cache in host memory (the CPU reference backend).
class CpuKvCache {
 public:
  explicit CpuKvCache(const KvCacheLayout& layout);

  const KvCacheLayout& layout() const { return layout_; }

  // Layer `layer`'s scales (every layer's are 1 until set); CheckKvScales' INVALID_ARGUMENT
  // for a bad one, nothing changed. Set before the layer's first Write.
  Status SetScales(int64_t layer, const KvScales& scales);
  const KvScales& scales(int64_t layer) const { return scales_[static_cast<size_t>(layer)]; }

  // Stores `rows` tokens' keys and values of `layer`: k, v are
  // [rows, kv_heads, head_dim]; token i goes to slot positions[i] of the
  // sequence whose block table is `table` (positions[i] / block_size-th
  // block). Rounds to the cache's element type (E4M3: the codes of x / the
  // layer's scale).
  void Write(int64_t layer, const float* k, const float* v, int64_t rows, const int32_t* positions,
             const int32_t* table);

  // The value stored at (layer, kv, block, head, slot, d), as FP32 (E4M3: the
  // code's value times the layer's scale).
  float Read(int64_t layer, int kv, int64_t block, int64_t head, int64_t slot, int64_t d) const;

 private:
  KvCacheLayout layout_;
  std::vector<KvScales> scales_;  // one per layer
  // Zeros from calloc: the OS supplies zero pages as sequences reach them,
  // so a large pool costs memory only where it is used.
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
};

// Causal attention of a step's query tokens over the paged cache (after the
// step's keys and values were written):
//   q:   [tokens, q_heads, head_dim] (RoPE applied)
//   cu_seqlens: [seqs + 1] query rows per sequence
//   context_lens: [seqs] tokens in the cache for the sequence after the step;
//     query row j of sequence s sits at position context_lens[s] - n_s + j
//     and attends to positions 0 .. itself
//   block_tables: [seqs * max_blocks], row s = sequence s's blocks
//   out: [tokens, q_heads, head_dim]
// Grouped-query as CausalAttentionVarlen, scores and softmax in double over
// the cache's stored (rounded) keys and values, so a token's output does not
// depend on how its sequence's tokens were split over steps, nor on other
// sequences. INVALID_ARGUMENT (naming what) for inconsistent arguments.
Status PagedAttention(const CpuKvCache& cache, int64_t layer, const float* q, int64_t q_heads,
                      const std::vector<int32_t>& cu_seqlens,
                      const std::vector<int32_t>& context_lens,
                      const std::vector<int32_t>& block_tables, int64_t max_blocks, float* out);

}  // namespace tpserve
