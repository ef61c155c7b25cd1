#include "engine/step_batch.h"

#include <string>

#include "engine/kv_cache.h"

namespace tpserve {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

int64_t StepBatch::sampled() const {
  int64_t n = 0;
  for (uint8_t s : sample) n += s != 0;
  return n;
}

Status ValidateStepBatch(const StepBatch& b, int64_t vocab, int64_t max_positions,
                         int64_t num_blocks, int64_t block_size) {
  const int64_t seqs = b.sequences();
  if (seqs < 1 || static_cast<int64_t>(b.cu_seqlens.size()) != seqs + 1 ||
      static_cast<int64_t>(b.sample.size()) != seqs ||
      static_cast<int64_t>(b.sampling.size()) != seqs ||
      static_cast<int64_t>(b.sample_index.size()) != seqs || b.max_blocks < 1 ||
      static_cast<int64_t>(b.block_tables.size()) != seqs * b.max_blocks ||
      b.positions.size() != b.ids.size()) {
    return InvalidArgumentError("step: the per-sequence arrays disagree (" + Str(seqs) +
                                " sequences, " + Str(b.tokens()) + " tokens)");
  }
  if (b.cu_seqlens.front() != 0 || b.cu_seqlens.back() != b.tokens()) {
    return InvalidArgumentError("step: cu_seqlens must run from 0 to the token count");
  }
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = b.cu_seqlens[s + 1] - b.cu_seqlens[s], ctx = b.context_lens[s];
    if (n < 1 || ctx < n || ctx > max_positions) {
      return InvalidArgumentError("step: sequence " + Str(s) + " has " + Str(n) +
                                  " tokens and a context of " + Str(ctx) + " (at most " +
                                  Str(max_positions) + ")");
    }
    const int64_t need = BlocksFor(ctx, block_size);
    if (need > b.max_blocks) {
      return InvalidArgumentError("step: sequence " + Str(s) + " needs " + Str(need) +
                                  " blocks, the table holds " + Str(b.max_blocks));
    }
    for (int64_t k = 0; k < need; ++k) {
      const int32_t block = b.block_tables[s * b.max_blocks + k];
      if (block < 0 || block >= num_blocks) {
        return InvalidArgumentError("step: sequence " + Str(s) + " block " + Str(k) + " is " +
                                    Str(block) + ", outside the pool of " + Str(num_blocks));
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t row = b.cu_seqlens[s] + j;
      if (b.positions[row] != ctx - n + j) {
        return InvalidArgumentError("step: row " + Str(row) + " has position " +
                                    Str(b.positions[row]) + ", expected " + Str(ctx - n + j));
      }
      if (b.ids[row] < 0 || b.ids[row] >= vocab) {
        return InvalidArgumentError("step: row " + Str(row) + " has id " + Str(b.ids[row]) +
                                    ", outside [0, " + Str(vocab) + ")");
      }
    }
    if (b.sample[s] != 0) TP_RETURN_IF_ERROR(ValidateSamplingParams(b.sampling[s]));
  }
  return Status::Ok();
}

}  // namespace tpserve
