// Scheduler: in-flight (continuous) batching over a paged KV cache. Pure
// bookkeeping, no threads and no engine: Generator (engine/generator.h) drives
// it, tests drive it directly.
//
// A sequence's tokens are its prompt followed by what it generated; the first
// `computed` of them have their keys and values in the cache. Each step feeds
// every scheduled sequence the tokens it has not computed yet: one for a
// decoding sequence, a chunk of the prompt for one in prefill (chunked prefill
// under the step's token budget). After a step that computes all of a
// sequence's tokens, a token is sampled for it.
//
// Policy, per step, under max_step_tokens and max_running:
// 1. Running sequences, oldest first, get their next tokens. A decoding
//    sequence that needs a new block and finds none free preempts the newest
//    running sequence (frees its blocks; it returns to the front of the queue
//    and later recomputes its prompt and generated tokens), itself if it is
//    the newest.
// 2. Then waiting sequences, first come first served, are admitted while the
//    budget lasts and the blocks for all their current tokens are free; the
//    first that does not fit stops admission (no overtaking, so a long prompt
//    is not starved).
// A sequence whose prompt and maximum output need more blocks than the pool
// has is refused at Add, so the oldest sequence can always finish: nothing
// is lost and nothing waits forever.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/sampling.h"
#include "engine/step_batch.h"

namespace tpserve {

struct GenerationParams {
  int64_t max_new_tokens = 16;                   // request_output_len, >= 1
  int32_t end_id = -1;                           // -1: none
  std::vector<std::vector<int32_t>> stop_words;  // each non-empty
  SamplingParams sampling;
  bool return_log_probs = false;
};

enum class FinishReason { kNone, kLength, kEndId, kStopWords, kCancelled };
const char* FinishReasonName(FinishReason r);

struct SchedulerOptions {
  int64_t num_blocks = 0;
  int64_t block_size = 16;
  int64_t max_step_tokens = 2048;  // tokens per step, decode and prefill together
  int64_t max_running = 256;       // sequences holding cache blocks
  int64_t vocab = 0;
  int64_t max_positions = 0;      // prompt + output tokens at most
  int64_t max_new_tokens = 4096;  // largest request_output_len accepted
};

// What a step did for one sequence.
struct SequenceUpdate {
  uint64_t id = 0;
  std::vector<int32_t> new_tokens;  // 0 or 1 token
  std::vector<float> new_log_probs;
  FinishReason finish = FinishReason::kNone;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);

  // Queues a sequence. INVALID_ARGUMENT naming the protocol tensor
  // (input_ids, request_output_len, end_id, stop_words_list, the sampling
  // inputs) when the request cannot be served by this model and pool.
  Status Add(uint64_t id, std::vector<int32_t> prompt, GenerationParams params);

  // Removes a sequence wherever it is and frees its blocks; false when it is
  // not here (finished already).
  bool Remove(uint64_t id);

  // The next step; nullopt-like empty step (sequences() == 0) when nothing
  // can run. Remembers what it scheduled for Complete().
  StepBatch Schedule();

  // Applies the sampled tokens of the step Schedule() returned last: advances
  // the sequences, appends tokens, decides which finished (and frees them).
  std::vector<SequenceUpdate> Complete(const StepResult& result);

  // Forgets the last scheduled step without applying it (the engine failed):
  // its sequences keep the state they had before it.
  void Abandon();

  int64_t waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t running() const { return static_cast<int64_t>(running_.size()); }
  bool empty() const { return waiting_.empty() && running_.empty(); }
  int64_t blocks_used() const { return pool_.used(); }
  int64_t blocks_free() const { return pool_.free(); }
  uint64_t preemptions() const { return preemptions_; }
  const SchedulerOptions& options() const { return options_; }
  // The ids of the last Schedule()'s sequences, in step order (empty after
  // Complete or Abandon).
  std::vector<uint64_t> scheduled_ids() const;
  // Every sequence id, waiting or running.
  std::vector<uint64_t> ids() const;

 private:
  struct Sequence {
    uint64_t id = 0;
    uint64_t arrival = 0;  // admission order: smaller is older
    std::vector<int32_t> tokens;
    int64_t prompt_len = 0;
    int64_t computed = 0;
    std::vector<int32_t> blocks;
    GenerationParams params;
    int64_t generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
  };
  using SeqPtr = std::unique_ptr<Sequence>;
  struct Planned {
    Sequence* seq;
    int64_t tokens;
    bool sample;
  };

  void Preempt(std::list<SeqPtr>::iterator it);
  FinishReason Finished(const Sequence& s) const;

  const SchedulerOptions options_;
  BlockPool pool_;
  std::deque<SeqPtr> waiting_;  // preempted ones first, by arrival
  std::list<SeqPtr> running_;   // by arrival, oldest first
  std::vector<Planned> planned_;
  uint64_t next_arrival_ = 0;
  uint64_t preemptions_ = 0;
};

}  // namespace tpserve
