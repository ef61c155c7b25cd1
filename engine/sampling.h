// Token sampling from one position's logits: greedy, temperature, top-k,
// top-p, with a per-request seed that makes the choice reproducible.
//
// The rule (the CPU reference; a GPU sampler follows the same rule):
// 1. Greedy when temperature == 0 or top_k == 1: the largest logit, the
//    lowest token id among equal ones.
// 2. Otherwise the candidates are the tokens sorted by logit, descending
//    (lower id first among equal logits); top_k > 0 keeps the first top_k.
//    Their probabilities are softmax(logit / temperature) over the kept
//    candidates, in double. top_p < 1 keeps the shortest prefix whose
//    probability sum reaches top_p (at least one token). The token is the
//    first candidate whose cumulative probability exceeds u * (sum of the
//    kept probabilities), u = SampleUniform(seed, index).
// 3. The log-probability reported with a token is that of the model's own
//    distribution, log_softmax(logits)[token] (temperature 1, nothing cut),
//    as TensorRT-LLM's and vLLM's defaults report it.
//
// `index` is how many tokens the sequence had generated before this one, so
// a sequence recomputed after preemption draws the same numbers again.
#pragma once

#include <cstdint>
#include <span>

#include "comm/status.h"

namespace tpserve {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;         // 0: no cut
  float top_p = 1.0f;        // in (0, 1]; 1: no cut
  uint64_t seed = 0;
};

// INVALID_ARGUMENT naming the field (as the protocol calls it: temperature,
// runtime_top_k, runtime_top_p) for a negative or non-finite temperature, a
// negative top_k, or top_p outside (0, 1].
Status ValidateSamplingParams(const SamplingParams& p);

// Counter-based uniform in [0, 1): splitmix64(seed ^ splitmix64(index)),
// top 53 bits. Pure integer arithmetic, identical on host and device.
double SampleUniform(uint64_t seed, uint64_t index);

struct SampledToken {
  int32_t token = 0;
  float log_prob = 0.0f;
};

// Samples one token from `logits` (the whole vocabulary) by the rule above.
// Preconditions: params valid, logits non-empty.
SampledToken SampleToken(std::span<const float> logits, const SamplingParams& params,
                         uint64_t index);

}  // namespace tpserve
