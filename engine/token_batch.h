// TokenBatch: the packed prompt batch every engine takes (the CPU reference, the CUDA engine,
// the server's batcher), with its packing and its check at the engines' boundary.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/status.h"

namespace tpserve {

// Packed sequences: token ids back to back, sequence s owning rows
// [cu_seqlens[s], cu_seqlens[s+1]); positions restart at 0 per sequence.
struct TokenBatch {
  std::vector<int32_t> ids;
  std::vector<int32_t> cu_seqlens;
  std::vector<int32_t> positions;

  int64_t tokens() const { return static_cast<int64_t>(ids.size()); }
  int64_t sequences() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
};

// INVALID_ARGUMENT for no sequences, an empty sequence, an id outside
// [0, vocab) or a sequence longer than max_positions (naming which).
StatusOr<TokenBatch> PackSequences(const std::vector<std::vector<int32_t>>& sequences,
                                   int64_t vocab, int64_t max_positions);

// Checks a packed batch as the engines receive it (naming what is wrong):
// cu_seqlens starts at 0, rises strictly (no empty sequence) and ends at the
// token count; one position per token, each in [0, max_positions); ids in
// [0, vocab). The engines refuse a bad batch with INVALID_ARGUMENT before any
// rank computes, and keep serving.
Status ValidateTokenBatch(const TokenBatch& batch, int64_t vocab, int64_t max_positions);

}  // namespace tpserve
