#include "server/batcher.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>
#include <string>

namespace tpserve {

TokenBatcher::TokenBatcher(BatcherOptions options, int64_t vocab, BatchForward forward)
    : options_(options), vocab_(vocab), forward_(std::move(forward)) {
  worker_ = std::thread(&TokenBatcher::Loop, this);
}

TokenBatcher::~TokenBatcher() {
  Stop();
  if (worker_.joinable()) worker_.join();
}

void TokenBatcher::Stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
}

void TokenBatcher::Flush() {
  {
    std::lock_guard lock(mu_);
    flushing_ = true;
  }
  cv_.notify_all();
}

size_t TokenBatcher::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

Status TokenBatcher::Submit(std::vector<int32_t> ids, Clock::time_point deadline,
                            std::shared_ptr<std::atomic<bool>> cancelled, Done done,
                            std::string client) {
  Item item;
  item.client = std::move(client);
  item.ids = std::move(ids);
  item.enqueued = Clock::now();
  item.deadline = deadline;
  item.cancelled = std::move(cancelled);
  item.done = std::move(done);
  {
    std::lock_guard lock(mu_);
    if (stopping_) return UnavailableError("the server is shutting down");
    if (queue_.size() >= options_.max_queue_size) {
      return ResourceExhaustedError("the request queue is full (" +
                                    std::to_string(options_.max_queue_size) +
                                    " requests waiting); retry later");
    }
    queue_.push_back(std::move(item));
  }
  cv_.notify_all();
  return Status::Ok();
}

StatusOr<std::future<StatusOr<BatchResult>>> TokenBatcher::Submit(
    std::vector<int32_t> ids, Clock::time_point deadline,
    std::shared_ptr<std::atomic<bool>> cancelled) {
  auto promise = std::make_shared<std::promise<StatusOr<BatchResult>>>();
  auto future = promise->get_future();
  TP_RETURN_IF_ERROR(
      Submit(std::move(ids), deadline, std::move(cancelled),
             [promise](StatusOr<BatchResult> r) { promise->set_value(std::move(r)); }));
  return future;
}

void TokenBatcher::Loop() {
  while (true) {
    std::vector<Item> batch;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      // Wait for batch-mates until the token budget fills or the oldest
      // request has waited max_queue_delay (no wait when draining); wake
      // earlier when a queued request's deadline comes, to answer it then.
      const auto flush_at = queue_.front().enqueued + options_.max_queue_delay;
      const int64_t max_sequences = std::max<int64_t>(1, options_.max_batch_sequences);
      auto ready = [&] {
        if (stopping_ || flushing_) return true;
        if (static_cast<int64_t>(queue_.size()) >= max_sequences) return true;
        int64_t tokens = 0;
        for (const Item& it : queue_) tokens += static_cast<int64_t>(it.ids.size());
        return tokens >= options_.max_batch_tokens;
      };
      auto wake = flush_at;
      for (const Item& it : queue_) wake = std::min(wake, it.deadline);
      // A request queued meanwhile may have an earlier deadline: wake for it
      // too, and recompute (the loop comes back here).
      const size_t seen = queue_.size();
      cv_.wait_until(lock, wake, [&] { return ready() || queue_.size() != seen; });
      const bool flush = ready() || Clock::now() >= flush_at;
      // Requests cancelled or past their deadline anywhere in the queue are
      // answered now, without being computed.
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (it->cancelled && it->cancelled->load()) {
          it->done(CancelledError("the client cancelled the request"));
        } else if (it->deadline <= Clock::now()) {
          it->done(DeadlineExceededError("the deadline passed while queued"));
        } else {
          ++it;
          continue;
        }
        it = queue_.erase(it);
      }
      if (!flush || queue_.empty()) continue;
      // Fair share: the batch takes one request of each client in turn (a
      // client's own in arrival order), so that one client's flood cannot
      // push another client's requests behind all of it.
      int64_t tokens = 0;
      bool full = false;
      while (!full && !queue_.empty()) {
        std::set<std::string> this_round;
        bool took = false;
        for (auto it = queue_.begin(); it != queue_.end();) {
          if (!this_round.insert(it->client).second) {
            ++it;
            continue;
          }
          const int64_t n = static_cast<int64_t>(it->ids.size());
          if ((!batch.empty() && tokens + n > options_.max_batch_tokens) ||
              static_cast<int64_t>(batch.size()) >= max_sequences) {
            full = true;
            break;
          }
          tokens += n;
          batch.push_back(std::move(*it));
          it = queue_.erase(it);
          took = true;
        }
        if (!took) break;
      }
    }
    if (batch.empty()) continue;
    TokenBatch tb;
    tb.cu_seqlens.push_back(0);
    for (const Item& it : batch) {
      for (size_t i = 0; i < it.ids.size(); ++i) {
        tb.ids.push_back(it.ids[i]);
        tb.positions.push_back(static_cast<int32_t>(i));
      }
      tb.cu_seqlens.push_back(static_cast<int32_t>(tb.ids.size()));
    }
    const auto start = Clock::now();
    // An exception must not end this thread (std::terminate): every request
    // of the batch gets the error, and the server keeps serving.
    StatusOr<std::vector<float>> logits = CallCatching("the engine", [&] { return forward_(tb); });
    if (logits.ok() && logits->size() != batch.size() * static_cast<size_t>(vocab_)) {
      logits = InternalError("the engine returned " + std::to_string(logits->size()) +
                             " logits for " + std::to_string(batch.size()) +
                             " sequences of vocabulary " + std::to_string(vocab_));
    }
    if (!logits.ok())
      spdlog::error("batch of {} requests: {}", batch.size(), logits.status().ToString());
    const auto end = Clock::now();
    batches_.fetch_add(1);
    batch_tokens_.fetch_add(static_cast<uint64_t>(tb.tokens()));
    batch_sequences_.fetch_add(batch.size());
    last_batch_tokens_.store(tb.tokens());
    for (size_t s = 0; s < batch.size(); ++s) {
      if (!logits.ok()) {
        batch[s].done(logits.status());
        continue;
      }
      BatchResult r;
      r.logits.assign(logits->begin() + s * vocab_, logits->begin() + (s + 1) * vocab_);
      r.queue_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(start - batch[s].enqueued).count();
      r.compute_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
      r.batch_sequences = static_cast<int>(batch.size());
      batch[s].done(std::move(r));
    }
  }
}

}  // namespace tpserve
