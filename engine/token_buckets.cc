#include "engine/token_buckets.h"

#include <algorithm>
#include <string>

namespace tpserve {
namespace {

int64_t RoundUp(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

}  // namespace

StatusOr<std::vector<int64_t>> MakeTokenBuckets(int64_t max_tokens, int tp,
                                                const std::vector<int64_t>& requested) {
  if (max_tokens < 1 || tp < 1) {
    return InvalidArgumentError("token buckets need max_tokens >= 1 and tp >= 1, got " +
                                std::to_string(max_tokens) + " and " + std::to_string(tp));
  }
  const int64_t largest = RoundUp(max_tokens, tp);
  std::vector<int64_t> out;
  if (requested.empty()) {
    for (int64_t b = 256; b < largest; b *= 2) out.push_back(RoundUp(b, tp));
  }
  for (int64_t b : requested) {
    if (b < 1) return InvalidArgumentError("token buckets must be >= 1, got " + std::to_string(b));
    out.push_back(std::min(RoundUp(b, tp), largest));
  }
  out.push_back(largest);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

StatusOr<int64_t> BucketFor(const std::vector<int64_t>& buckets, int64_t tokens) {
  for (int64_t b : buckets) {
    if (b >= tokens) return b;
  }
  return InvalidArgumentError("no token bucket holds " + std::to_string(tokens) + " tokens");
}

int64_t SequenceSlots(int64_t sequences, int64_t max_seqs) {
  int64_t slots = 1;
  while (slots < sequences) slots *= 2;
  return std::min(slots, max_seqs + 1);
}

void PadBatchInto(const TokenBatch& batch, int64_t m, int64_t slots, int32_t* ids,
                  int32_t* positions, int32_t* cu_seqlens) {
  const int64_t tokens = batch.tokens();
  std::copy(batch.ids.begin(), batch.ids.end(), ids);
  std::copy(batch.positions.begin(), batch.positions.end(), positions);
  for (int64_t i = 0; i < m - tokens; ++i) {
    ids[tokens + i] = 0;
    positions[tokens + i] = static_cast<int32_t>(i);
  }
  const int64_t given = static_cast<int64_t>(batch.cu_seqlens.size());
  std::copy(batch.cu_seqlens.begin(), batch.cu_seqlens.end(), cu_seqlens);
  for (int64_t i = given; i < slots + 1; ++i) cu_seqlens[i] = static_cast<int32_t>(m);
}

TokenBatch PadBatch(const TokenBatch& batch, int64_t m, int64_t slots) {
  TokenBatch out;
  out.ids.resize(static_cast<size_t>(m));
  out.positions.resize(static_cast<size_t>(m));
  out.cu_seqlens.resize(static_cast<size_t>(
      std::max<int64_t>(slots + 1, static_cast<int64_t>(batch.cu_seqlens.size()))));
  PadBatchInto(batch, m, slots, out.ids.data(), out.positions.data(), out.cu_seqlens.data());
  return out;
}

}  // namespace tpserve
