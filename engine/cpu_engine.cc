#include "engine/cpu_engine.h"

#include <spdlog/spdlog.h>

#include "comm/local_communicator.h"
#include "engine/sampling.h"

namespace tpserve {

StatusOr<std::unique_ptr<CpuEngine>> CpuEngine::Start(CpuEngineOptions options) {
  TP_RETURN_IF_ERROR(options.config.ValidateForTp(options.tp));
  auto engine = std::unique_ptr<CpuEngine>(new CpuEngine(std::move(options)));
  const CpuEngineOptions& o = engine->options_;
  if (o.kv_blocks > 0) {
    const ModelConfig& c = o.config;
    engine->kv_layout_ = {c.num_hidden_layers,          o.kv_blocks,  o.kv_block_size,
                          c.num_key_value_heads / o.tp, c.head_dim(), o.kv_dtype};
    TP_RETURN_IF_ERROR(engine->kv_layout_.Validate());
  }
  TP_ASSIGN_OR_RETURN(engine->comms_, MakeLocalCommunicators(engine->options_.tp));
  // Create spdlog's default logger here, before the rank threads log
  // concurrently: its lazy creation inside the library is then ordered before
  // them (thread creation), for TSan too, which cannot see the guard in
  // Debian's uninstrumented libspdlog.
  spdlog::default_logger_raw()->should_log(spdlog::level::info);
  for (int r = 0; r < engine->options_.tp; ++r) {
    engine->threads_.emplace_back(&CpuEngine::RankLoop, engine.get(), r, engine->comms_[r].get());
  }
  // Wait until every rank has its weights (or one failed).
  std::unique_lock lock(engine->mu_);
  engine->cv_.wait(lock,
                   [&] { return engine->started_ == engine->options_.tp || engine->broken_; });
  if (engine->broken_) {
    Status s = engine->first_error_;
    lock.unlock();
    return s.WithContext("starting the CPU engine");  // the destructor joins the threads
  }
  return engine;
}

CpuEngine::~CpuEngine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& c : comms_) c->Abort();  // ranks blocked in a collective return at once
  for (auto& t : threads_) t.join();
}

GemmScaleScheme CpuEngine::scale_scheme() const {
  std::lock_guard lock(mu_);
  return scale_scheme_;
}

bool CpuEngine::healthy() const {
  std::lock_guard lock(mu_);
  return !broken_;
}

void CpuEngine::RankLoop(int rank, Communicator* comm) {
  auto fail = [&](const Status& s) {
    spdlog::error("CPU engine rank {}: {}", rank, s.ToString());
    comm->Abort();
    std::lock_guard lock(mu_);
    if (!broken_) first_error_ = s;
    broken_ = true;
    cv_.notify_all();
  };
  const CpuEngineOptions& o = options_;
  StatusOr<RankWeights> w = CallCatching("loading the weights", [&]() -> StatusOr<RankWeights> {
    return o.checkpoint_dir.empty()
               ? MakeRandomRankWeights(o.config, o.dtype, o.tp, rank, o.seed)
               : LoadRankWeights(o.checkpoint_dir, o.config, o.tp, rank, o.dtype);
  });
  if (!w.ok()) return fail(w.status());
  if (rank == 0 && !w->layers.empty() && w->layers[0].qkv.dtype == DataType::kFloat8E4M3) {
    std::lock_guard lock(mu_);
    scale_scheme_ = GemmScaleSchemeOf(w->layers[0].qkv.scheme);
  }
  std::vector<KvScales> kv_scales;
  for (const LayerWeights& l : w->layers) kv_scales.push_back(l.kv_scales);
  auto model = CallCatching("building the model", [&] {
    return CpuModel::Create(o.config, std::move(w).value(), o.overlap.get(), *comm);
  });
  if (!model.ok()) return fail(model.status());
  std::unique_ptr<CpuKvCache> cache;
  if (kv_layout_.num_blocks > 0) {
    auto made =
        CallCatching("allocating the KV cache", [&]() -> StatusOr<std::unique_ptr<CpuKvCache>> {
          auto c = std::make_unique<CpuKvCache>(kv_layout_);
          for (size_t l = 0; l < kv_scales.size(); ++l) {
            TP_RETURN_IF_ERROR(c->SetScales(static_cast<int64_t>(l), kv_scales[l]));
          }
          return c;
        });
    if (!made.ok()) return fail(made.status());
    cache = std::move(made).value();
    if (rank == 0) spdlog::info("CPU engine: {}", KvScalesSummary(kv_layout_.dtype, kv_scales));
  }
  uint64_t seen = 0;
  {
    std::lock_guard lock(mu_);
    ++started_;
  }
  cv_.notify_all();
  while (true) {
    const Job* job = nullptr;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || broken_ || generation_ != seen; });
      if (stop_ || broken_) return;
      seen = generation_;
      job = job_;
      ++running_;
    }
    auto logits = CallCatching("the forward pass", [&] { return (*job)(**model, cache.get()); });
    {
      std::lock_guard lock(mu_);
      --running_;  // this rank no longer reads the caller's batch
      if (logits.ok()) {
        if (rank == 0) logits_ = std::move(logits).value();
        ++finished_;
      }
    }
    if (!logits.ok()) return fail(logits.status());
    cv_.notify_all();
  }
}

StatusOr<std::vector<float>> CpuEngine::Forward(const TokenBatch& batch) {
  // A bad batch is the caller's error: refused before the ranks see it.
  TP_RETURN_IF_ERROR(ValidateTokenBatch(batch, options_.config.vocab_size,
                                        options_.config.max_position_embeddings));
  return Run([&](CpuModel& m, CpuKvCache*) { return m.Forward(batch); });
}

StatusOr<StepResult> CpuEngine::Step(const StepBatch& step) {
  if (kv_layout_.num_blocks == 0) {
    return FailedPreconditionError("the CPU engine was started without a KV cache");
  }
  TP_RETURN_IF_ERROR(ValidateStepBatch(step, options_.config.vocab_size,
                                       options_.config.max_position_embeddings,
                                       kv_layout_.num_blocks, kv_layout_.block_size));
  TP_ASSIGN_OR_RETURN(std::vector<float> logits,
                      Run([&](CpuModel& m, CpuKvCache* cache) { return m.Step(step, *cache); }));
  const int64_t vocab = options_.config.vocab_size;
  StepResult r;
  int64_t k = 0;
  for (int64_t s = 0; s < step.sequences(); ++s) {
    if (step.sample[s] == 0) continue;
    r.tokens.push_back(SampleToken(std::span<const float>(logits.data() + k * vocab, vocab),
                                   step.sampling[s], step.sample_index[s]));
    ++k;
  }
  return r;
}

StatusOr<std::vector<float>> CpuEngine::Run(const Job& job) {
  std::lock_guard one_at_a_time(forward_mu_);
  std::unique_lock lock(mu_);
  if (broken_) {
    return UnavailableError("CPU engine is down after an earlier failure: " +
                            first_error_.ToString());
  }
  job_ = &job;
  finished_ = 0;
  ++generation_;
  cv_.notify_all();
  // On a failure, the ranks still inside the job read the caller's batch
  // until their next collective fails: it must outlive them, so wait for
  // every one.
  cv_.wait(lock, [&] { return finished_ == options_.tp || (broken_ && running_ == 0); });
  job_ = nullptr;
  if (broken_) return UnavailableError("CPU engine failed: " + first_error_.ToString());
  return std::move(logits_);
}

}  // namespace tpserve
