// TokenBatcher: packs concurrent requests (token sequences) into one batch
// for the engine, up to a token budget, waiting at most a queue delay for
// batch-mates. A request's result does not depend on its batch-mates (the
// engine's per-sequence computation is batch-invariant).
//
// Admission: a full queue answers RESOURCE_EXHAUSTED at once; after Stop()
// every Submit answers UNAVAILABLE. Requests whose deadline passed or that
// were cancelled while queued are answered (DEADLINE_EXCEEDED at the deadline,
// CANCELLED when next looked at)
// without being computed, so they cost the others nothing.
//
// Thread-safety: Submit, Stop and the statistics may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/token_batch.h"

namespace tpserve {

struct BatcherOptions {
  int64_t max_batch_tokens = 8192;  // tokens per engine batch (a request is never split)
  std::chrono::microseconds max_queue_delay{2000};  // longest wait for batch-mates
  size_t max_queue_size = 1024;       // queued requests beyond this: RESOURCE_EXHAUSTED
  int64_t max_batch_sequences = 256;  // requests per engine batch (the GPU engine sizes its
                                      // per-sequence buffers, e.g. logits, by it)
};

struct BatchResult {
  std::vector<float> logits;  // [vocab], last position
  uint64_t queue_ns = 0;      // submit -> batch start
  uint64_t compute_ns = 0;    // the batch's engine time
  int batch_sequences = 0;    // how many requests shared the batch
};

// Runs one packed batch; returns logits [sequences, vocab].
using BatchForward = std::function<StatusOr<std::vector<float>>(const TokenBatch&)>;

class TokenBatcher {
 public:
  using Clock = std::chrono::steady_clock;

  TokenBatcher(BatcherOptions options, int64_t vocab, BatchForward forward);
  ~TokenBatcher();  // Stop(), then joins

  // Called once with the request's result, on the batcher's thread: must not
  // block.
  using Done = std::function<void(StatusOr<BatchResult>)>;

  // Queues a request; `done` is called exactly once unless this returns an
  // error. `cancelled` (may be null) is read while queued (Wake() makes the
  // batcher look at once).
  // `client` (e.g. the peer's address) is what fair sharing tells apart:
  // batches take the clients' requests in turn.
  Status Submit(std::vector<int32_t> ids, Clock::time_point deadline,
                std::shared_ptr<std::atomic<bool>> cancelled, Done done, std::string client = "");
  // The same, with the result as a future.
  StatusOr<std::future<StatusOr<BatchResult>>> Submit(std::vector<int32_t> ids,
                                                      Clock::time_point deadline,
                                                      std::shared_ptr<std::atomic<bool>> cancelled);
  // Makes the batcher re-examine its queue now (after a cancellation).
  void Wake() { cv_.notify_all(); }

  // Stops accepting; computes what is queued (drain), then returns.
  void Stop();
  // Runs what is queued without waiting for batch-mates (a drain has begun);
  // still accepts requests.
  void Flush();

  size_t queued() const;
  uint64_t batches() const { return batches_.load(); }
  uint64_t batch_tokens() const { return batch_tokens_.load(); }        // summed over batches
  uint64_t batch_sequences() const { return batch_sequences_.load(); }  // summed over batches
  int64_t last_batch_tokens() const { return last_batch_tokens_.load(); }

 private:
  struct Item {
    std::vector<int32_t> ids;
    std::string client;
    Clock::time_point enqueued, deadline;
    std::shared_ptr<std::atomic<bool>> cancelled;
    Done done;
  };
  void Loop();

  const BatcherOptions options_;
  const int64_t vocab_;
  BatchForward forward_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  bool flushing_ = false;  // Flush(): no waiting for batch-mates
  std::atomic<uint64_t> batches_{0};
  std::atomic<uint64_t> batch_tokens_{0};
  std::atomic<uint64_t> batch_sequences_{0};
  std::atomic<int64_t> last_batch_tokens_{0};
  std::thread worker_;
};

}  // namespace tpserve
