// StepBatch: one generation step as every rank runs it. The scheduler
// (engine/scheduler.h) forms it on rank 0; the engine broadcasts it.
//
// A step holds, per sequence, the tokens whose keys and values enter the
// cache in this step (one for a decoding sequence, a chunk of the prompt for
// one in prefill), packed back to back as in TokenBatch, plus where the
// sequence's cache lives (its block table) and how long its context is after
// the step. Query row j of sequence s has position context_lens[s] - n_s + j
// (n_s = its token count in the step) and attends to every cached position up
// to its own.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/status.h"
#include "engine/sampling.h"

namespace tpserve {

struct StepBatch {
  std::vector<int32_t> ids;           // [tokens]
  std::vector<int32_t> positions;     // [tokens]
  std::vector<int32_t> cu_seqlens;    // [seqs + 1], rows of each sequence
  std::vector<int32_t> context_lens;  // [seqs], cached tokens after the step
  int64_t max_blocks = 0;             // block table width
  std::vector<int32_t> block_tables;  // [seqs * max_blocks], unused entries -1
  // Per sequence: sample a token from its last row's logits after the step
  // (its whole context is then cached), with these parameters and index.
  std::vector<uint8_t> sample;           // [seqs], 0 or 1
  std::vector<SamplingParams> sampling;  // [seqs]
  std::vector<uint64_t> sample_index;    // [seqs], tokens generated before this one

  int64_t tokens() const { return static_cast<int64_t>(ids.size()); }
  int64_t sequences() const { return static_cast<int64_t>(context_lens.size()); }
  int64_t sampled() const;  // sequences with sample == 1
};

// One sampled token per sequence with sample == 1, in sequence order.
struct StepResult {
  std::vector<SampledToken> tokens;
};

// Checks the step as an engine receives it (INVALID_ARGUMENT naming what is
// wrong): array sizes agree; cu_seqlens rises from 0 to the token count; each
// sequence has 0 < n_s <= context_lens[s] <= max_positions, positions
// context_lens[s] - n_s + j, enough valid blocks (in [0, num_blocks)) for its
// context; ids in [0, vocab); sampling parameters valid.
Status ValidateStepBatch(const StepBatch& step, int64_t vocab, int64_t max_positions,
                         int64_t num_blocks, int64_t block_size);

}  // namespace tpserve
