#include "engine/token_batch.h"

#include <string>

namespace tpserve {

StatusOr<TokenBatch> PackSequences(const std::vector<std::vector<int32_t>>& sequences,
                                   int64_t vocab, int64_t max_positions) {
  if (sequences.empty()) return InvalidArgumentError("batch has no sequences");
  TokenBatch b;
  b.cu_seqlens.push_back(0);
  for (size_t s = 0; s < sequences.size(); ++s) {
    const auto& seq = sequences[s];
    if (seq.empty()) return InvalidArgumentError("sequence " + std::to_string(s) + " is empty");
    if (static_cast<int64_t>(seq.size()) > max_positions) {
      return InvalidArgumentError("sequence " + std::to_string(s) + " has " +
                                  std::to_string(seq.size()) + " tokens, the model takes at most " +
                                  std::to_string(max_positions));
    }
    for (size_t i = 0; i < seq.size(); ++i) {
      if (seq[i] < 0 || seq[i] >= vocab) {
        return InvalidArgumentError("sequence " + std::to_string(s) + " token " +
                                    std::to_string(i) + " has id " + std::to_string(seq[i]) +
                                    ", outside [0, " + std::to_string(vocab) + ")");
      }
      b.ids.push_back(seq[i]);
      b.positions.push_back(static_cast<int32_t>(i));
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.ids.size()));
  }
  return b;
}

Status ValidateTokenBatch(const TokenBatch& b, int64_t vocab, int64_t max_positions) {
  if (b.cu_seqlens.size() < 2 || b.cu_seqlens.front() != 0 ||
      b.cu_seqlens.back() != static_cast<int64_t>(b.ids.size())) {
    return InvalidArgumentError("batch: cu_seqlens must run from 0 to the token count (" +
                                std::to_string(b.ids.size()) + ") over at least one sequence");
  }
  for (size_t s = 1; s < b.cu_seqlens.size(); ++s) {
    if (b.cu_seqlens[s] <= b.cu_seqlens[s - 1]) {
      return InvalidArgumentError(
          "batch: sequence " + std::to_string(s - 1) + " is empty or cu_seqlens falls (" +
          std::to_string(b.cu_seqlens[s - 1]) + " -> " + std::to_string(b.cu_seqlens[s]) + ")");
    }
  }
  if (b.positions.size() != b.ids.size()) {
    return InvalidArgumentError("batch: " + std::to_string(b.positions.size()) + " positions for " +
                                std::to_string(b.ids.size()) + " tokens");
  }
  for (size_t i = 0; i < b.ids.size(); ++i) {
    if (b.ids[i] < 0 || b.ids[i] >= vocab) {
      return InvalidArgumentError("batch: token " + std::to_string(i) + " has id " +
                                  std::to_string(b.ids[i]) + ", outside [0, " +
                                  std::to_string(vocab) + ")");
    }
    if (b.positions[i] < 0 || b.positions[i] >= max_positions) {
      return InvalidArgumentError("batch: token " + std::to_string(i) + " has position " +
                                  std::to_string(b.positions[i]) + ", outside [0, " +
                                  std::to_string(max_positions) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace tpserve
