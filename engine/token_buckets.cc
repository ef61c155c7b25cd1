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

TokenBatch PadBatch(const TokenBatch& batch, int64_t m, int64_t slots) {
  TokenBatch out = batch;
  const int64_t pad = m - batch.tokens();
  for (int64_t i = 0; i < pad; ++i) {
    out.ids.push_back(0);
    out.positions.push_back(static_cast<int32_t>(i));
  }
  while (static_cast<int64_t>(out.cu_seqlens.size()) < slots + 1) {
    out.cu_seqlens.push_back(static_cast<int32_t>(m));
  }
  return out;
}

}  // namespace tpserve
