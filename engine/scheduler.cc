#include "engine/scheduler.h"

#include <algorithm>
#include <cassert>
#include <iterator>

namespace tpserve {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

template <class Container>
void InsertByArrival(Container& c, typename Container::value_type seq) {
  auto pos = std::find_if(c.begin(), c.end(),
                          [&](const auto& other) { return other->arrival > seq->arrival; });
  c.insert(pos, std::move(seq));
}

}  // namespace

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEndId:
      return "end_id";
    case FinishReason::kStopWords:
      return "stop_words";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

Scheduler::Scheduler(SchedulerOptions options) : options_(options), pool_(options.num_blocks) {}

Status Scheduler::Add(uint64_t id, std::vector<int32_t> prompt, GenerationParams params) {
  const SchedulerOptions& o = options_;
  if (prompt.empty()) return InvalidArgumentError("input_ids is empty: the prompt needs a token");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= o.vocab) {
      return InvalidArgumentError("input_ids[" + Str(static_cast<int64_t>(i)) + "] is " +
                                  Str(prompt[i]) + ", outside the vocabulary [0, " + Str(o.vocab) +
                                  ")");
    }
  }
  if (params.max_new_tokens < 1 || params.max_new_tokens > o.max_new_tokens) {
    return InvalidArgumentError("request_output_len is " + Str(params.max_new_tokens) +
                                ", needs 1 to " + Str(o.max_new_tokens));
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + params.max_new_tokens;
  if (total > o.max_positions) {
    return InvalidArgumentError(
        "input_ids (" + Str(static_cast<int64_t>(prompt.size())) + " tokens) plus " +
        "request_output_len (" + Str(params.max_new_tokens) + ") is " + Str(total) +
        " tokens, more than the model's " + Str(o.max_positions) + " positions");
  }
  if (BlocksFor(total, o.block_size) > o.num_blocks) {
    return InvalidArgumentError("input_ids plus request_output_len is " + Str(total) +
                                " tokens, more than the whole KV cache holds (" +
                                Str(o.num_blocks) + " blocks of " + Str(o.block_size) + ")");
  }
  if (params.end_id < -1 || params.end_id >= o.vocab) {
    return InvalidArgumentError("end_id is " + Str(params.end_id) + ", outside [0, " +
                                Str(o.vocab) + ")");
  }
  for (size_t w = 0; w < params.stop_words.size(); ++w) {
    if (params.stop_words[w].empty()) {
      return InvalidArgumentError("stop_words_list word " + Str(static_cast<int64_t>(w)) +
                                  " is empty");
    }
    for (int32_t t : params.stop_words[w]) {
      if (t < 0 || t >= o.vocab) {
        return InvalidArgumentError("stop_words_list word " + Str(static_cast<int64_t>(w)) +
                                    " holds token " + Str(t) + ", outside [0, " + Str(o.vocab) +
                                    ")");
      }
    }
  }
  TP_RETURN_IF_ERROR(ValidateSamplingParams(params.sampling));
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->arrival = next_arrival_++;
  s->prompt_len = static_cast<int64_t>(prompt.size());
  s->tokens = std::move(prompt);
  s->params = std::move(params);
  waiting_.push_back(std::move(s));
  return Status::Ok();
}

bool Scheduler::Remove(uint64_t id) {
  assert(planned_.empty());
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if ((*it)->id == id) {
      pool_.Release(&(*it)->blocks);
      running_.erase(it);
      return true;
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->id == id) {
      waiting_.erase(it);
      return true;
    }
  }
  return false;
}

std::vector<uint64_t> Scheduler::ids() const {
  std::vector<uint64_t> out;
  for (const auto& s : running_) out.push_back(s->id);
  for (const auto& s : waiting_) out.push_back(s->id);
  return out;
}

std::vector<uint64_t> Scheduler::scheduled_ids() const {
  std::vector<uint64_t> out;
  for (const Planned& p : planned_) out.push_back(p.seq->id);
  return out;
}

void Scheduler::Preempt(std::list<SeqPtr>::iterator it) {
  SeqPtr s = std::move(*it);
  running_.erase(it);
  pool_.Release(&s->blocks);
  s->computed = 0;
  ++preemptions_;
  InsertByArrival(waiting_, std::move(s));
}

StepBatch Scheduler::Schedule() {
  assert(planned_.empty());
  const int64_t bs = options_.block_size;
  int64_t budget = options_.max_step_tokens;
  for (auto it = running_.begin(); it != running_.end() && budget > 0;) {
    Sequence& s = **it;
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(s.tokens.size()) - s.computed, budget);
    const int64_t need = BlocksFor(s.computed + n, bs) - static_cast<int64_t>(s.blocks.size());
    bool preempted_self = false;
    while (need > pool_.free()) {
      auto newest = std::prev(running_.end());
      preempted_self = newest == it;
      Preempt(newest);
      if (preempted_self) break;
    }
    if (preempted_self) break;  // it was the newest: nothing runs after it
    pool_.Allocate(std::max<int64_t>(need, 0), &s.blocks);
    planned_.push_back({&s, n, s.computed + n == static_cast<int64_t>(s.tokens.size())});
    budget -= n;
    ++it;
  }
  while (budget > 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < options_.max_running) {
    Sequence& s = *waiting_.front();
    const int64_t total = static_cast<int64_t>(s.tokens.size());
    if (!pool_.Allocate(BlocksFor(total, bs), &s.blocks)) break;
    const int64_t n = std::min(total, budget);
    planned_.push_back({&s, n, n == total});
    budget -= n;
    InsertByArrival(running_, std::move(waiting_.front()));
    waiting_.pop_front();
  }

  StepBatch b;
  if (planned_.empty()) return b;
  for (const Planned& p : planned_) {
    b.max_blocks = std::max<int64_t>(b.max_blocks, static_cast<int64_t>(p.seq->blocks.size()));
  }
  b.cu_seqlens.push_back(0);
  for (const Planned& p : planned_) {
    const Sequence& s = *p.seq;
    for (int64_t j = 0; j < p.tokens; ++j) {
      b.ids.push_back(s.tokens[s.computed + j]);
      b.positions.push_back(static_cast<int32_t>(s.computed + j));
    }
    b.cu_seqlens.push_back(static_cast<int32_t>(b.ids.size()));
    b.context_lens.push_back(static_cast<int32_t>(s.computed + p.tokens));
    const size_t row = b.block_tables.size();
    b.block_tables.resize(row + b.max_blocks, -1);
    std::copy(s.blocks.begin(), s.blocks.end(), b.block_tables.begin() + row);
    b.sample.push_back(p.sample ? 1 : 0);
    b.sampling.push_back(s.params.sampling);
    b.sample_index.push_back(static_cast<uint64_t>(s.generated()));
  }
  return b;
}

FinishReason Scheduler::Finished(const Sequence& s) const {
  const auto& gen_begin = s.tokens.begin() + s.prompt_len;
  for (const auto& word : s.params.stop_words) {
    const int64_t w = static_cast<int64_t>(word.size());
    if (s.generated() >= w && std::equal(word.begin(), word.end(), s.tokens.end() - w) &&
        s.tokens.end() - w >= gen_begin) {
      return FinishReason::kStopWords;
    }
  }
  if (s.generated() >= s.params.max_new_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

std::vector<SequenceUpdate> Scheduler::Complete(const StepResult& result) {
  std::vector<SequenceUpdate> updates;
  size_t k = 0;
  std::vector<uint64_t> done;
  for (const Planned& p : planned_) {
    Sequence& s = *p.seq;
    s.computed += p.tokens;
    if (!p.sample) continue;
    assert(k < result.tokens.size());
    const SampledToken t = result.tokens[k++];
    SequenceUpdate u;
    u.id = s.id;
    if (s.params.end_id >= 0 && t.token == s.params.end_id) {
      u.finish = FinishReason::kEndId;
    } else {
      s.tokens.push_back(t.token);
      u.new_tokens.push_back(t.token);
      if (s.params.return_log_probs) u.new_log_probs.push_back(t.log_prob);
      u.finish = Finished(s);
    }
    if (u.finish != FinishReason::kNone) done.push_back(s.id);
    updates.push_back(std::move(u));
  }
  planned_.clear();
  for (uint64_t id : done) Remove(id);
  return updates;
}

void Scheduler::Abandon() { planned_.clear(); }

}  // namespace tpserve
