// How the CUDA model shapes a batch for a captured graph (engine/cuda_model.h),
// as pure functions so that they are tested without a GPU.
//
// Token buckets: the batch's token count is padded up to the smallest bucket
// that holds it. Buckets are multiples of tp (every rank's row shard then has
// the same size, as NCCL collectives need); the largest is max_tokens rounded
// up to a multiple of tp.
//
// Sequence slots: the batch's sequences plus one padding sequence, rounded up
// to a power of two and capped at max_seqs + 1; unused slots are empty
// sequences. The attention grid and the LM head scale with the slots.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/status.h"
#include "engine/token_batch.h"

namespace tpserve {

// Sorted, unique buckets from `requested` (each rounded up to a multiple of
// tp and capped at the largest), plus the largest. Empty `requested`: 256,
// 512, ... below the largest. INVALID_ARGUMENT for max_tokens < 1, tp < 1 or
// a requested bucket < 1.
StatusOr<std::vector<int64_t>> MakeTokenBuckets(int64_t max_tokens, int tp,
                                                const std::vector<int64_t>& requested);

// The smallest bucket >= tokens; INVALID_ARGUMENT when none is.
StatusOr<int64_t> BucketFor(const std::vector<int64_t>& buckets, int64_t tokens);

// Slots for `sequences` (the padding one included): the next power of two,
// at most max_seqs + 1.
int64_t SequenceSlots(int64_t sequences, int64_t max_seqs);

// The batch as the graph of (m, slots) takes it: ids and positions padded to
// m with a padding sequence (token 0, positions 0, 1, ...) when m > tokens,
// and cu_seqlens to slots + 1 entries with empty sequences at the end.
// Preconditions: m >= batch.tokens(), slots >= batch.sequences() + 1.
TokenBatch PadBatch(const TokenBatch& batch, int64_t m, int64_t slots);
// The same, written into caller-owned arrays (ids and positions of m entries, cu_seqlens of
// slots + 1): no allocation, for a pass's pinned upload buffer.
void PadBatchInto(const TokenBatch& batch, int64_t m, int64_t slots, int32_t* ids,
                  int32_t* positions, int32_t* cu_seqlens);

}  // namespace tpserve
