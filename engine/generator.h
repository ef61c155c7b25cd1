// Generator: token generation on an engine. One thread loops: take the
// cancellations, form a step (Scheduler), run it on the engine (which samples
// on its ranks), report each sequence's new tokens and finish.
//
// Completion is signalled: every request's events go to its callback, called
// on the generator's delivery thread in step order; a callback must not block
// (the server hands the event to the RPC's reactor). The delivery thread is
// not the stepping one, so building and sending the responses of one step
// overlaps the next step on the engine. A request's last event has
// finish != kNone or a non-OK error, and no event follows it.
//
// Thread-safety: all public methods may be called from any thread, callbacks
// included (a callback may call Cancel).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/scheduler.h"

namespace tpserve {

struct GeneratorOptions {
  // Step budget and limits; num_blocks, block_size, vocab and max_positions
  // are taken from the engine at Start.
  SchedulerOptions scheduler;
  size_t max_queued = 1024;  // requests admitted but not finished; beyond: RESOURCE_EXHAUSTED
};

struct GenerationEvent {
  uint64_t id = 0;
  std::vector<int32_t> new_tokens;
  std::vector<float> new_log_probs;  // when asked for, one per new token
  FinishReason finish = FinishReason::kNone;
  Status error;  // non-OK: the request failed; this is its last event
  bool last() const { return finish != FinishReason::kNone || !error.ok(); }
};
using GenerationCallback = std::function<void(GenerationEvent)>;

struct GeneratorStats {
  int64_t running = 0, waiting = 0, blocks_used = 0, blocks_free = 0;
  uint64_t steps = 0, step_tokens = 0, generated_tokens = 0, preemptions = 0;
  uint64_t finished = 0, cancelled = 0, failed = 0;
};

class Generator {
 public:
  using Clock = std::chrono::steady_clock;

  // FAILED_PRECONDITION when the engine has no KV cache.
  static StatusOr<std::unique_ptr<Generator>> Start(GeneratorOptions options,
                                                    std::shared_ptr<Engine> engine);
  ~Generator();  // Stop(now)

  // Queues a request. Errors (nothing queued, the callback never called):
  // INVALID_ARGUMENT naming the tensor (Scheduler::Add), RESOURCE_EXHAUSTED
  // when max_queued requests are in, UNAVAILABLE once stopping.
  // A request still unfinished at `deadline` ends with DEADLINE_EXCEEDED.
  StatusOr<uint64_t> Submit(std::vector<int32_t> prompt, GenerationParams params,
                            Clock::time_point deadline, GenerationCallback callback);

  // Ends the request with finish kCancelled before the next step (its blocks
  // freed). Unknown or finished ids are ignored.
  void Cancel(uint64_t id);

  // Refuses new requests, lets the admitted ones finish until `deadline`,
  // then ends the rest with UNAVAILABLE, and stops the threads: every event
  // has been delivered when it returns. Not from a callback.
  void Stop(Clock::time_point deadline);

  GeneratorStats stats() const;
  const SchedulerOptions& scheduler_options() const { return scheduler_.options(); }

 private:
  Generator(GeneratorOptions options, std::shared_ptr<Engine> engine, SchedulerOptions so)
      : options_(std::move(options)), engine_(std::move(engine)), scheduler_(so) {}
  using Delivery = std::vector<std::pair<GenerationCallback, GenerationEvent>>;
  void Loop();
  // Hands `d`'s events to the delivery thread (in order after earlier ones) and empties it.
  void Post(Delivery* d);
  void DeliveryLoop();
  // Ends `id` with `event` (finish or error): removes it from the scheduler
  // and the callbacks; the event is queued for delivery. Holds mu_.
  void EndLocked(uint64_t id, GenerationEvent event, Delivery* out);

  struct Pending {
    GenerationCallback callback;
    Clock::time_point deadline;
  };

  const GeneratorOptions options_;
  std::shared_ptr<Engine> engine_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Scheduler scheduler_;
  std::map<uint64_t, Pending> pending_;
  std::set<uint64_t> cancels_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  Clock::time_point drain_deadline_ = Clock::time_point::max();
  GeneratorStats stats_;
  // Events on their way to the callbacks (Post -> DeliveryLoop).
  std::mutex delivery_mu_;
  std::condition_variable delivery_cv_;
  std::deque<Delivery> deliveries_;
  bool delivery_done_ = false;  // the stepping thread has posted its last events
  std::thread thread_, delivery_thread_;
};

}  // namespace tpserve
