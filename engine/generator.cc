#include "engine/generator.h"

#include <spdlog/spdlog.h>

namespace tpserve {
StatusOr<std::unique_ptr<Generator>> Generator::Start(GeneratorOptions options,
                                                      std::shared_ptr<Engine> engine) {
  if (!engine) return InvalidArgumentError("no engine to generate with");
  const KvCacheLayout kv = engine->kv_cache_layout();
  if (kv.num_blocks < 1) {
    return FailedPreconditionError("the engine has no KV cache: generation is unavailable");
  }
  SchedulerOptions so = options.scheduler;
  so.num_blocks = kv.num_blocks;
  so.block_size = kv.block_size;
  so.vocab = engine->config().vocab_size;
  so.max_positions = engine->config().max_position_embeddings;
  if (so.max_step_tokens < 1 || so.max_running < 1) {
    return InvalidArgumentError("generation needs max_step_tokens and max_running >= 1");
  }
  auto g = std::unique_ptr<Generator>(new Generator(std::move(options), std::move(engine), so));
  g->stats_.blocks_free = kv.num_blocks;
  g->delivery_thread_ = std::thread(&Generator::DeliveryLoop, g.get());
  g->thread_ = std::thread(&Generator::Loop, g.get());
  return g;
}

Generator::~Generator() { Stop(Clock::now()); }

StatusOr<uint64_t> Generator::Submit(std::vector<int32_t> prompt, GenerationParams params,
                                     Clock::time_point deadline, GenerationCallback callback) {
  std::lock_guard lock(mu_);
  if (stopping_) return UnavailableError("the server is shutting down: send it to another replica");
  if (pending_.size() >= options_.max_queued) {
    return ResourceExhaustedError(std::to_string(pending_.size()) +
                                  " generation requests are in progress, the limit "
                                  "(--max-queue-size): retry later");
  }
  const uint64_t id = next_id_++;
  TP_RETURN_IF_ERROR(scheduler_.Add(id, std::move(prompt), std::move(params)));
  pending_[id] = Pending{std::move(callback), deadline};
  cv_.notify_all();
  return id;
}

void Generator::Cancel(uint64_t id) {
  std::lock_guard lock(mu_);
  if (pending_.count(id) == 0) return;
  cancels_.insert(id);
  cv_.notify_all();
}

void Generator::Stop(Clock::time_point deadline) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_ || deadline < drain_deadline_) drain_deadline_ = deadline;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard lock(delivery_mu_);
    delivery_done_ = true;
  }
  delivery_cv_.notify_all();
  if (delivery_thread_.joinable()) delivery_thread_.join();
}

void Generator::Post(Delivery* d) {
  if (d->empty()) return;
  {
    std::lock_guard lock(delivery_mu_);
    deliveries_.push_back(std::move(*d));
  }
  d->clear();
  delivery_cv_.notify_one();
}

void Generator::DeliveryLoop() {
  while (true) {
    Delivery d;
    {
      std::unique_lock lock(delivery_mu_);
      delivery_cv_.wait(lock, [&] { return delivery_done_ || !deliveries_.empty(); });
      if (deliveries_.empty()) return;  // done, and everything delivered
      d = std::move(deliveries_.front());
      deliveries_.pop_front();
    }
    for (auto& [callback, event] : d) callback(std::move(event));
  }
}

GeneratorStats Generator::stats() const {
  std::lock_guard lock(mu_);
  GeneratorStats s = stats_;
  s.running = scheduler_.running();
  s.waiting = scheduler_.waiting();
  s.blocks_used = scheduler_.blocks_used();
  s.blocks_free = scheduler_.blocks_free();
  s.preemptions = scheduler_.preemptions();
  return s;
}

void Generator::EndLocked(uint64_t id, GenerationEvent event, Delivery* out) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  scheduler_.Remove(id);
  cancels_.erase(id);
  if (!event.error.ok()) {
    ++stats_.failed;
  } else if (event.finish == FinishReason::kCancelled) {
    ++stats_.cancelled;
  } else {
    ++stats_.finished;
  }
  event.id = id;
  out->emplace_back(std::move(it->second.callback), std::move(event));
  pending_.erase(it);
}

void Generator::Loop() {
  Delivery delivery;
  while (true) {
    StepBatch step;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      const auto now = Clock::now();
      for (uint64_t id : std::set<uint64_t>(cancels_)) {
        GenerationEvent e;
        e.finish = FinishReason::kCancelled;
        EndLocked(id, std::move(e), &delivery);
      }
      const bool drain_over = stopping_ && now >= drain_deadline_;
      std::vector<std::pair<uint64_t, Status>> ends;
      for (const auto& [id, p] : pending_) {
        if (drain_over) {
          ends.emplace_back(id, UnavailableError("the server shut down before this request "
                                                 "finished (--exit-timeout)"));
        } else if (now >= p.deadline) {
          ends.emplace_back(id, DeadlineExceededError("the request's deadline passed during "
                                                      "generation"));
        }
      }
      for (auto& [id, status] : ends) {
        GenerationEvent e;
        e.error = status;
        EndLocked(id, std::move(e), &delivery);
      }
      if (pending_.empty() && stopping_) {
        lock.unlock();
        Post(&delivery);
        return;
      }
      if (!pending_.empty()) step = scheduler_.Schedule();
    }
    const bool ended_some = !delivery.empty();
    Post(&delivery);
    if (step.sequences() == 0) {
      // Everything pending was just ended; otherwise (the scheduler's policy
      // always lets the oldest sequence run) a guard against a hot loop.
      if (!ended_some) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }

    StatusOr<StepResult> result = engine_->Step(step);
    {
      std::lock_guard lock(mu_);
      ++stats_.steps;
      stats_.step_tokens += static_cast<uint64_t>(step.tokens());
      if (result.ok() && static_cast<int64_t>(result->tokens.size()) != step.sampled()) {
        result = InternalError("the engine sampled " + std::to_string(result->tokens.size()) +
                               " tokens for " + std::to_string(step.sampled()) + " sequences");
      }
      if (!result.ok()) {
        // The engine failed: nothing of the step is applied, and every request
        // in progress fails (an engine that lost a rank cannot continue them).
        scheduler_.Abandon();
        spdlog::error("generation step failed: {}", result.status().ToString());
        const Status error = UnavailableError("generation failed: " + result.status().ToString());
        std::vector<uint64_t> ids;
        for (const auto& [id, p] : pending_) ids.push_back(id);
        for (uint64_t id : ids) {
          GenerationEvent e;
          e.error = error;
          EndLocked(id, std::move(e), &delivery);
        }
      } else {
        for (SequenceUpdate& u : scheduler_.Complete(*result)) {
          auto it = pending_.find(u.id);
          if (it == pending_.end()) continue;
          stats_.generated_tokens += u.new_tokens.size();
          GenerationEvent e;
          e.id = u.id;
          e.new_tokens = std::move(u.new_tokens);
          e.new_log_probs = std::move(u.new_log_probs);
          e.finish = u.finish;
          if (e.finish != FinishReason::kNone) {
            // Complete() already removed the sequence from the scheduler.
            ++stats_.finished;
            cancels_.erase(u.id);
            delivery.emplace_back(std::move(it->second.callback), std::move(e));
            pending_.erase(it);
          } else {
            delivery.emplace_back(it->second.callback, std::move(e));
          }
        }
      }
    }
    Post(&delivery);
  }
}

}  // namespace tpserve
