#include "engine/kv_cache.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>

#include "comm/dtype.h"
#include "layers/fp8.h"

namespace tpserve {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

StatusOr<KvCacheDtype> ParseKvCacheDtype(const std::string& s) {
  if (s == "bf16") return KvCacheDtype::kBFloat16;
  if (s == "fp8") return KvCacheDtype::kFloat8E4M3;
  return InvalidArgumentError("KV cache dtype '" + s + "': use bf16 or fp8");
}

const char* KvCacheDtypeName(KvCacheDtype d) {
  return d == KvCacheDtype::kBFloat16 ? "bf16" : "fp8";
}

Status CheckKvScales(const KvScales& s, const std::string& what) {
  for (const auto& [name, v] : {std::pair<const char*, float>{"k", s.k}, {"v", s.v}}) {
    if (!std::isfinite(v) || v <= 0.0f) {
      return InvalidArgumentError(what + ": KV cache scale " + name + " is " + std::to_string(v) +
                                  ", needs a finite value > 0");
    }
  }
  return Status::Ok();
}

std::string KvScalesSummary(KvCacheDtype dtype, const std::vector<KvScales>& scales) {
  const bool unit = std::all_of(scales.begin(), scales.end(),
                                [](const KvScales& s) { return s.k == 1.0f && s.v == 1.0f; });
  if (dtype == KvCacheDtype::kBFloat16) {
    return unit ? "bf16 cache: no scales"
                : "bf16 cache: the checkpoint's KV cache scales are not used (they apply to "
                  "--kv-cache-dtype fp8 and --fp8-attention)";
  }
  if (unit) {
    return "fp8 cache at scale 1 (the checkpoint gives no k_scale / v_scale): keys and values "
           "beyond +-448 saturate; tpserve calibrate-kv-scales writes scales for it";
  }
  auto range = [&](bool k) {
    float lo = INFINITY, hi = 0.0f;
    for (const KvScales& s : scales) {
      lo = std::min(lo, k ? s.k : s.v);
      hi = std::max(hi, k ? s.k : s.v);
    }
    char text[64];
    std::snprintf(text, sizeof text, "%.4g to %.4g", lo, hi);
    return std::string(text);
  };
  return "fp8 cache at the checkpoint's scales over " + Str(static_cast<int64_t>(scales.size())) +
         " layers: k_scale " + range(true) + ", v_scale " + range(false);
}

KvScales KvScalesForAbsMax(const KvAbsMax& m) {
  return {ScaleFromAmax(m.k, Fp8Format::kE4M3), ScaleFromAmax(m.v, Fp8Format::kE4M3)};
}

Status KvCacheLayout::Validate() const {
  const std::pair<const char*, int64_t> fields[] = {{"layers", layers},
                                                    {"num_blocks", num_blocks},
                                                    {"block_size", block_size},
                                                    {"kv_heads", kv_heads},
                                                    {"head_dim", head_dim}};
  for (const auto& [name, v] : fields) {
    if (v < 1)
      return InvalidArgumentError("KV cache " + std::string(name) + " is " + Str(v) +
                                  ", needs >= 1");
  }
  if (num_blocks > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError("KV cache num_blocks " + Str(num_blocks) +
                                " exceeds int32 block ids");
  }
  return Status::Ok();
}

BlockPool::BlockPool(int64_t num_blocks) : total_(num_blocks) {
  free_.reserve(static_cast<size_t>(num_blocks));
  // Highest id at the bottom: the first allocations get 0, 1, 2, ...
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

bool BlockPool::Allocate(int64_t n, std::vector<int32_t>* table) {
  if (n > free()) return false;
  for (int64_t i = 0; i < n; ++i) {
    table->push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void BlockPool::Release(std::vector<int32_t>* table) {
  for (auto it = table->rbegin(); it != table->rend(); ++it) free_.push_back(*it);
  table->clear();
}

CpuKvCache::CpuKvCache(const KvCacheLayout& layout)
    : layout_(layout),
      scales_(static_cast<size_t>(std::max<int64_t>(layout.layers, 0))),
      data_(static_cast<uint8_t*>(std::calloc(
          static_cast<size_t>(layout.Elements() * KvCacheElementBytes(layout.dtype)), 1))) {
  if (!data_ && layout.Elements() > 0) throw std::bad_alloc();
}

Status CpuKvCache::SetScales(int64_t layer, const KvScales& scales) {
  if (layer < 0 || layer >= layout_.layers) {
    return InvalidArgumentError("CpuKvCache::SetScales: layer " + Str(layer) +
                                " outside the cache");
  }
  TP_RETURN_IF_ERROR(CheckKvScales(scales, "layer " + Str(layer)));
  scales_[static_cast<size_t>(layer)] = scales;
  return Status::Ok();
}

void CpuKvCache::Write(int64_t layer, const float* k, const float* v, int64_t rows,
                       const int32_t* positions, const int32_t* table) {
  const KvCacheLayout& L = layout_;
  const int64_t bytes = KvCacheElementBytes(L.dtype);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t block = table[positions[i] / L.block_size];
    const int64_t slot = positions[i] % L.block_size;
    assert(block >= 0 && block < L.num_blocks);
    for (int kv = 0; kv < 2; ++kv) {
      const float* src = (kv == 0 ? k : v) + i * L.kv_heads * L.head_dim;
      const float scale = kv == 0 ? scales_[layer].k : scales_[layer].v;
      for (int64_t h = 0; h < L.kv_heads; ++h) {
        uint8_t* dst = data_.get() + L.Offset(layer, kv, block, h, slot) * bytes;
        for (int64_t d = 0; d < L.head_dim; ++d) {
          const float x = src[h * L.head_dim + d];
          if (L.dtype == KvCacheDtype::kBFloat16) {
            const BFloat16 b = FloatToBFloat16(x);
            std::memcpy(dst + 2 * d, &b.bits, 2);
          } else {
            dst[d] = FloatToFp8E4M3(x / scale);
          }
        }
      }
    }
  }
}

float CpuKvCache::Read(int64_t layer, int kv, int64_t block, int64_t head, int64_t slot,
                       int64_t d) const {
  const int64_t e = layout_.Offset(layer, kv, block, head, slot) + d;
  if (layout_.dtype == KvCacheDtype::kBFloat16) {
    BFloat16 b;
    std::memcpy(&b.bits, data_.get() + 2 * e, 2);
    return BFloat16ToFloat(b);
  }
  const KvScales& s = scales_[static_cast<size_t>(layer)];
  return Fp8E4M3ToFloat(data_.get()[e]) * (kv == 0 ? s.k : s.v);
}

Status PagedAttention(const CpuKvCache& cache, int64_t layer, const float* q, int64_t q_heads,
                      const std::vector<int32_t>& cu_seqlens,
                      const std::vector<int32_t>& context_lens,
                      const std::vector<int32_t>& block_tables, int64_t max_blocks, float* out) {
  const KvCacheLayout& L = cache.layout();
  const int64_t seqs = static_cast<int64_t>(cu_seqlens.size()) - 1;
  if (seqs < 0 || static_cast<int64_t>(context_lens.size()) != seqs ||
      static_cast<int64_t>(block_tables.size()) != seqs * max_blocks) {
    return InvalidArgumentError(
        "PagedAttention: " + Str(static_cast<int64_t>(cu_seqlens.size())) + " cu_seqlens, " +
        Str(static_cast<int64_t>(context_lens.size())) + " context_lens and " +
        Str(static_cast<int64_t>(block_tables.size())) +
        " block table entries disagree (max_blocks " + Str(max_blocks) + ")");
  }
  if (q_heads < 1 || q_heads % L.kv_heads != 0) {
    return InvalidArgumentError("PagedAttention: q_heads " + Str(q_heads) +
                                " is not a positive multiple of the cache's kv_heads " +
                                Str(L.kv_heads));
  }
  if (layer < 0 || layer >= L.layers) {
    return InvalidArgumentError("PagedAttention: layer " + Str(layer) + " outside the cache");
  }
  const int64_t hd = L.head_dim, group = q_heads / L.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> scores, acc(static_cast<size_t>(hd));
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = cu_seqlens[s + 1] - cu_seqlens[s], ctx = context_lens[s];
    if (n < 0 || n > ctx || BlocksFor(ctx, L.block_size) > max_blocks) {
      return InvalidArgumentError("PagedAttention: sequence " + Str(s) + " has " + Str(n) +
                                  " query rows for a context of " + Str(ctx) + " tokens (" +
                                  Str(max_blocks) + " blocks of " + Str(L.block_size) +
                                  " at most)");
    }
    const int32_t* table = block_tables.data() + s * max_blocks;
    for (int64_t b = 0; b < BlocksFor(ctx, L.block_size); ++b) {
      if (table[b] < 0 || table[b] >= L.num_blocks) {
        return InvalidArgumentError("PagedAttention: sequence " + Str(s) + " block " + Str(b) +
                                    " is " + Str(table[b]) + ", outside the pool of " +
                                    Str(L.num_blocks));
      }
    }
    scores.resize(static_cast<size_t>(ctx));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t row = cu_seqlens[s] + j, pos = ctx - n + j;
      for (int64_t h = 0; h < q_heads; ++h) {
        const int64_t kvh = h / group;
        const float* qi = q + (row * q_heads + h) * hd;
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t t = 0; t <= pos; ++t) {
          const int64_t block = table[t / L.block_size], slot = t % L.block_size;
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) {
            dot += static_cast<double>(qi[d]) * cache.Read(layer, 0, block, kvh, slot, d);
          }
          scores[t] = dot * scale;
          max_score = std::max(max_score, scores[t]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double denom = 0;
        for (int64_t t = 0; t <= pos; ++t) {
          const double p = std::exp(scores[t] - max_score);
          denom += p;
          const int64_t block = table[t / L.block_size], slot = t % L.block_size;
          for (int64_t d = 0; d < hd; ++d) acc[d] += p * cache.Read(layer, 1, block, kvh, slot, d);
        }
        float* o = out + (row * q_heads + h) * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<float>(acc[d] / denom);
      }
    }
  }
  return Status::Ok();
}

}  // namespace tpserve
