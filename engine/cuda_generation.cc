// CudaModel's generation step (engine/cuda_model.h: Step): the paged KV cache, the step's
// upload, and the hooks Enqueue calls while stepping_ (paged attention, sampling).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "comm/cuda_check.h"
#include "engine/cuda_model.h"
#include "engine/cuda_model_internal.h"
#include "engine/cuda_ops.h"
#include "engine/paged_kv_ops.h"
#include "engine/sampling_kernels.h"
#include "engine/token_buckets.h"
#include "layers/quantize_kernels.h"

namespace tpserve {
namespace {

int64_t Align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

}  // namespace

struct CudaModel::Generation {
  DeviceBuffer pool;       // the KV cache, kv_layout_.Elements() elements
  DeviceBuffer workspace;  // paged attention's split partials
  int64_t width = 0;       // block table columns on the device
  int64_t slots = 0;       // the most sequence slots: max_seqs + 1
  std::vector<int64_t> buckets;
  // Max query rows of the step being enqueued (1 for pure decode; sizes the attention grid).
  int64_t query_rows = 1;
  // Sequences of two or more query rows in that step (listed at `multi_rows`): paged
  // attention gives them its tensor-core kernel.
  int64_t multi_row_count = 0;

  // The step's upload: byte offsets into `host` (pinned) and `dev` alike. The block tables
  // come last, so that a step copies only the rows of its slots.
  struct Offsets {
    int64_t ids, positions, slot_mapping, cu_seqlens, head_cu, context_lens, top_k;
    int64_t temperature, top_p, seed, index, multi_rows, block_tables, end;
  } at{};
  PinnedHostBuffer host;
  DeviceBuffer dev;
  template <class T>
  T* h(int64_t offset) {
    return reinterpret_cast<T*>(host.as<uint8_t>() + offset);
  }
  template <class T>
  T* d(int64_t offset) const {
    return reinterpret_cast<T*>(dev.as<uint8_t>() + offset);
  }

  // tp > 1: FP32 [slots, vocab], the ranks' vocabulary slices of logits_all_ interleaved into
  // whole rows for sampling (tp 1 samples logits_all_ itself).
  DeviceBuffer logits;
  DeviceBuffer out;                 // token int32 [slots], then log_prob float [slots]
  DeviceBuffer sampling_workspace;  // LaunchSampling's row statistics
  PinnedHostBuffer out_host;
};

void CudaModel::GenerationDeleter::operator()(Generation* g) const noexcept { delete g; }

size_t CudaModel::GenerationBytes() const {
  if (gen_ == nullptr) return 0;
  const Generation& g = *gen_;
  return g.pool.size() + g.workspace.size() + g.dev.size() + g.logits.size() + g.out.size() +
         g.sampling_workspace.size();
}

Status CudaModel::AllocateGeneration() {
  const ModelConfig& c = config_;
  const CudaModelOptions& o = options_;
  if (o.kv_block_size < 1) {
    return InvalidArgumentError("CudaModelOptions.kv_block_size (" +
                                std::to_string(o.kv_block_size) + ") must be >= 1");
  }
  if (c.vocab_size > kSamplingMaxVocab) {  // refused before any allocation, not at the first step
    return InvalidArgumentError("vocab_size (" + std::to_string(c.vocab_size) +
                                ") exceeds what GPU sampling takes (" +
                                std::to_string(kSamplingMaxVocab) + ")");
  }
  kv_layout_ = {c.num_hidden_layers,         o.kv_blocks,  o.kv_block_size,
                c.num_key_value_heads / tp_, c.head_dim(), o.kv_dtype};
  TP_RETURN_IF_ERROR(kv_layout_.Validate().WithContext("CudaModelOptions KV cache"));
  gen_.reset(new Generation());
  Generation& g = *gen_;
  const int64_t bytes = kv_layout_.Elements() * KvCacheElementBytes(o.kv_dtype);
  TP_ASSIGN_OR_RETURN(g.pool, DeviceBuffer::Allocate(static_cast<size_t>(bytes), "kv_cache"));
  // Unwritten slots are never read, but zeros keep a stray read finite.
  TP_CUDA_CHECK(cudaMemset(g.pool.data(), 0, g.pool.size()));
  // A sequence's table never needs more blocks than its longest context, nor than the pool.
  g.width = std::min(BlocksFor(c.max_position_embeddings, o.kv_block_size), o.kv_blocks);
  g.slots = o.max_seqs + 1;  // SequenceSlots' cap
  // Step buckets: powers of two from 8 (GEMM shapes of a few rows, no smaller) up to
  // max_seqs (decode steps), then the token buckets.
  std::vector<int64_t> wanted = buckets_;
  for (int64_t b = 8; b < std::min(o.max_seqs * 2, max_m_); b *= 2) wanted.push_back(b);
  TP_ASSIGN_OR_RETURN(g.buckets,
                      MakeTokenBuckets(o.max_tokens, static_cast<int>(bucket_multiple_), wanted));
  // Splits for decode-sized launches (larger ones have parallelism enough and get fewer).
  TP_ASSIGN_OR_RETURN(const int64_t ws_tokens, BucketFor(g.buckets, std::min(o.max_seqs, max_m_)));
  const size_t ws = PagedAttentionWorkspaceBytes(ws_tokens, c.num_attention_heads / tp_,
                                                 c.head_dim(), g.width * o.kv_block_size);
  TP_ASSIGN_OR_RETURN(g.workspace, DeviceBuffer::Allocate(ws, "paged_attention_workspace"));

  auto& a = g.at;
  int64_t off = 0;
  auto take = [&](int64_t n) {
    const int64_t at = off;
    off += Align16(n);
    return at;
  };
  const int64_t m = max_m_, s = g.slots;
  a.ids = take(m * 4);
  a.positions = take(m * 4);
  a.slot_mapping = take(m * 4);
  a.cu_seqlens = take((s + 1) * 4);
  a.head_cu = take((s + 1) * 4);
  a.context_lens = take(s * 4);
  a.top_k = take(s * 4);
  a.temperature = take(s * 4);
  a.top_p = take(s * 4);
  a.seed = take(s * 8);
  a.index = take(s * 8);
  a.multi_rows = take(s * 4);
  a.block_tables = take(s * g.width * 4);
  a.end = off;
  TP_ASSIGN_OR_RETURN(g.host, PinnedHostBuffer::Allocate(static_cast<size_t>(off), "step_upload"));
  TP_ASSIGN_OR_RETURN(g.dev, DeviceBuffer::Allocate(static_cast<size_t>(off), "step_upload"));
  step_ids_ = g.d<int32_t>(a.ids);
  step_positions_ = g.d<int32_t>(a.positions);
  step_head_cu_ = g.d<int32_t>(a.head_cu);

  if (tp_ > 1) {
    TP_ASSIGN_OR_RETURN(g.logits,
                        DeviceBuffer::Allocate(s * c.vocab_size * sizeof(float), "step_logits"));
  }
  TP_ASSIGN_OR_RETURN(g.out, DeviceBuffer::Allocate(s * 8, "sampled"));
  TP_ASSIGN_OR_RETURN(
      g.sampling_workspace,
      DeviceBuffer::Allocate(SamplingWorkspaceBytes(s, c.vocab_size), "sampling_workspace"));
  TP_ASSIGN_OR_RETURN(g.out_host, PinnedHostBuffer::Allocate(s * 8, "sampled"));
  // Paged attention leaves the padding rows of its output unwritten; o's FP8 quantization
  // reads them: zeros (and later real rows' values) keep them finite.
  TP_CUDA_CHECK(cudaMemset(attn_.data(), 0, attn_.size()));
  TP_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets, before any stream
  spdlog::info("CudaModel rank {}: KV cache of {} blocks x {} tokens ({}), {:.1f} MiB", rank_,
               o.kv_blocks, o.kv_block_size, KvCacheDtypeName(o.kv_dtype), bytes / 1048576.0);
  if (rank_ == 0) {
    std::vector<KvScales> scales;
    for (const Layer& l : layers_) scales.push_back(l.kv_scales);
    spdlog::info("CudaModel: {}", KvScalesSummary(o.kv_dtype, scales));
  }
  return Status::Ok();
}

PagedKvWriteParams CudaModel::KvStore(int64_t layer, int64_t m, BFloat16* qkv) const {
  const Generation& g = *gen_;
  const ModelConfig& c = config_;
  const int64_t hd = c.head_dim(), nh_l = c.num_attention_heads / tp_;
  const int64_t nkv_l = c.num_key_value_heads / tp_;
  const int64_t qkv_n_l = (nh_l + 2 * nkv_l) * hd;
  PagedKvWriteParams w;
  w.k = qkv + nh_l * hd;
  w.k_row_stride = qkv_n_l;
  w.v = qkv + (nh_l + nkv_l) * hd;
  w.v_row_stride = qkv_n_l;
  w.slot_mapping = g.d<int32_t>(g.at.slot_mapping);
  w.rows = m;
  w.cache = g.pool.data();
  w.layout = kv_layout_;
  w.layer = layer;
  w.scales = layers_[layer].kv_scales;
  return w;
}

PagedAttentionParams CudaModel::PagedParams(int64_t layer, int64_t m, int64_t seq_slots,
                                            BFloat16* qkv) const {
  const Generation& g = *gen_;
  const ModelConfig& c = config_;
  const int64_t hd = c.head_dim(), nh_l = c.num_attention_heads / tp_;
  const int64_t nkv_l = c.num_key_value_heads / tp_;
  const int64_t qkv_n_l = (nh_l + 2 * nkv_l) * hd;
  PagedAttentionParams p;
  p.q = qkv;
  p.q_row_stride = qkv_n_l;
  p.q_heads = nh_l;
  p.cache = g.pool.data();
  p.layout = kv_layout_;
  p.layer = layer;
  p.scales = layers_[layer].kv_scales;
  p.cu_seqlens = g.d<int32_t>(g.at.cu_seqlens);
  p.context_lens = g.d<int32_t>(g.at.context_lens);
  p.block_tables = g.d<int32_t>(g.at.block_tables);
  p.num_seqs = seq_slots;
  p.tokens = m;
  p.max_blocks = g.width;
  p.max_query_rows = g.query_rows;
  // Fixed, not the step's longest context: the split count is then the same for every step
  // of a (bucket, slots) graph.
  p.max_context = g.width * kv_layout_.block_size;
  p.workspace = g.workspace.data();
  p.workspace_bytes = g.workspace.size();
  p.multi_row_seqs = g.d<int32_t>(g.at.multi_rows);
  p.multi_row_count = g.multi_row_count;
  // The step's upload precedes its first kernel; its kernels write only the step's own rows'
  // keys and values (RoPE right before this launch, or this launch itself).
  p.context_constant = options_.decode_fusions.early_loads;
  p.cluster_merge = options_.decode_fusions.cluster_merge;
  return p;
}

Status CudaModel::EnqueuePagedAttention(int64_t layer, int64_t m, int64_t seq_slots, BFloat16* qkv,
                                        BFloat16* out, float* amax, uint8_t* out_fp8,
                                        const float* out_fp8_scale, const RopeParams* rope) {
  const int64_t hd = config_.head_dim(), nh_l = config_.num_attention_heads / tp_;
  PagedAttentionParams p = PagedParams(layer, m, seq_slots, qkv);
  p.out = out;
  p.out_row_stride = nh_l * hd;
  p.out_fp8 = out_fp8;
  p.out_fp8_row_stride = nh_l * hd;
  p.out_fp8_scale = out_fp8_scale;
  p.rope = rope;
  cudaStream_t st = stream_.get();
  TP_RETURN_IF_ERROR(LaunchPagedAttention(p, st));
  if (amax == nullptr) return Status::Ok();
  AbsMaxParams am;
  am.input = out;
  am.count = static_cast<size_t>(m * nh_l * hd);
  am.amax = amax;
  return LaunchAbsMax(am, st);
}

Status CudaModel::EnqueueSampling(int64_t seq_slots) {
  const Generation& g = *gen_;
  const int64_t vocab = config_.vocab_size, vocab_l = vocab / tp_;
  cudaStream_t st = stream_.get();
  // logits_all_ is FP32 [tp, seq_slots, vocab / tp]: at tp 1 that is [seq_slots, vocab],
  // sampled where it lies; otherwise the ranks' vocabulary slices are interleaved into whole
  // rows first (one strided copy per rank, no conversion: the values stay the GEMM's).
  const float* logits = logits_all_.as<float>();
  if (tp_ > 1) {
    for (int r = 0; r < tp_; ++r) {
      TP_CUDA_CHECK(cudaMemcpy2DAsync(g.logits.as<float>() + r * vocab_l, vocab * sizeof(float),
                                      logits_all_.as<float>() + r * seq_slots * vocab_l,
                                      vocab_l * sizeof(float), vocab_l * sizeof(float), seq_slots,
                                      cudaMemcpyDeviceToDevice, st));
    }
    logits = g.logits.as<float>();
  }
  SamplingLaunchParams s;
  s.logits = logits;
  s.logits_row_stride = vocab;
  s.vocab = vocab;
  s.num_seqs = seq_slots;
  s.temperature = g.d<float>(g.at.temperature);
  s.top_k = g.d<int32_t>(g.at.top_k);
  s.top_p = g.d<float>(g.at.top_p);
  s.seed = g.d<uint64_t>(g.at.seed);
  s.index = g.d<uint64_t>(g.at.index);
  s.token = g.out.as<int32_t>();
  s.log_prob = g.out.as<float>() + g.slots;
  s.workspace = g.sampling_workspace.data();
  s.workspace_bytes = g.sampling_workspace.size();
  return LaunchSampling(s, st);
}

StatusOr<CudaModel::StepShape> CudaModel::UploadStep(const StepBatch& step) {
  if (gen_ == nullptr) {
    return FailedPreconditionError(
        "CudaModel was created without a KV cache (CudaModelOptions.kv_blocks = 0)");
  }
  Generation& g = *gen_;
  const ModelConfig& c = config_;
  const int64_t bs = kv_layout_.block_size;
  // Every rank checks the same step and so fails alike, before any collective.
  TP_RETURN_IF_ERROR(
      ValidateStepBatch(step, c.vocab_size, c.max_position_embeddings, kv_layout_.num_blocks, bs));
  const int64_t tokens = step.tokens(), seqs = step.sequences();
  if (tokens > options_.max_tokens || seqs > options_.max_seqs) {
    return InvalidArgumentError(
        "step of " + std::to_string(tokens) + " tokens in " + std::to_string(seqs) +
        " sequences is outside this model's limits (" + std::to_string(options_.max_tokens) +
        " tokens, " + std::to_string(options_.max_seqs) + " sequences)");
  }
  TP_ASSIGN_OR_RETURN(const int64_t m, BucketFor(g.buckets, tokens));
  // As Forward's slots (one more than the sequences, a power of two): the LM head's GEMM
  // takes the same shapes.
  const int64_t seq_slots = SequenceSlots(seqs + 1, options_.max_seqs);
  const auto& a = g.at;

  // The upload: ids and positions padded to m (token 0 at position 0, a row of no sequence:
  // its key is not stored, its query attends to nothing), every row's cache slot, the
  // sequences' bounds and tables padded to the slots with empty sequences, the LM head's
  // rows (head_cu: slot k's row is head_cu[k + 1] - 1, the k-th sampled sequence's last
  // row; empty slots give zero logits) and the sampled sequences' parameters (greedy for
  // empty slots).
  int32_t* ids = g.h<int32_t>(a.ids);
  int32_t* pos = g.h<int32_t>(a.positions);
  int32_t* slot = g.h<int32_t>(a.slot_mapping);
  std::copy(step.ids.begin(), step.ids.end(), ids);
  std::copy(step.positions.begin(), step.positions.end(), pos);
  std::fill(ids + tokens, ids + m, 0);
  std::fill(pos + tokens, pos + m, 0);
  std::fill(slot + tokens, slot + m, -1);
  int32_t* cu = g.h<int32_t>(a.cu_seqlens);
  int32_t* head_cu = g.h<int32_t>(a.head_cu);
  int32_t* ctx = g.h<int32_t>(a.context_lens);
  int32_t* tables = g.h<int32_t>(a.block_tables);
  int32_t* top_k = g.h<int32_t>(a.top_k);
  float* temperature = g.h<float>(a.temperature);
  float* top_p = g.h<float>(a.top_p);
  uint64_t* seed = g.h<uint64_t>(a.seed);
  uint64_t* index = g.h<uint64_t>(a.index);
  const int64_t cols = std::min(step.max_blocks, g.width);
  int32_t* multi_rows = g.h<int32_t>(a.multi_rows);
  int64_t sampled = 0, query_rows = 0, multi_row_count = 0;
  head_cu[0] = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int32_t begin = step.cu_seqlens[s], end = step.cu_seqlens[s + 1];
    query_rows = std::max<int64_t>(query_rows, end - begin);
    if (BlocksFor(step.context_lens[s], bs) > g.width) {
      return InvalidArgumentError("step: sequence " + std::to_string(s) + "'s context of " +
                                  std::to_string(step.context_lens[s]) +
                                  " tokens needs more than " + std::to_string(g.width) +
                                  " blocks (the KV pool's)");
    }
    const int32_t* table = step.block_tables.data() + s * step.max_blocks;
    std::copy(table, table + cols, tables + s * g.width);
    std::fill(tables + s * g.width + cols, tables + (s + 1) * g.width, -1);
    for (int32_t r = begin; r < end; ++r) {
      slot[r] = static_cast<int32_t>(table[step.positions[r] / bs] * bs + step.positions[r] % bs);
    }
    cu[s] = begin;
    ctx[s] = step.context_lens[s];
    if (end - begin >= 2) multi_rows[multi_row_count++] = static_cast<int32_t>(s);
    if (step.sample[s] == 0) continue;
    const SamplingParams& sp = step.sampling[s];
    head_cu[sampled + 1] = end;
    temperature[sampled] = sp.temperature;
    top_k[sampled] = sp.top_k;
    top_p[sampled] = sp.top_p;
    seed[sampled] = sp.seed;
    index[sampled] = step.sample_index[s];
    ++sampled;
  }
  for (int64_t s = seqs; s <= seq_slots; ++s) cu[s] = static_cast<int32_t>(tokens);
  std::fill(ctx + seqs, ctx + seq_slots, 0);
  std::fill(tables + seqs * g.width, tables + seq_slots * g.width, -1);
  for (int64_t k = sampled; k < seq_slots; ++k) {
    head_cu[k + 1] = head_cu[k];
    temperature[k] = 0.0f;
    top_k[k] = 0;
    top_p[k] = 1.0f;
    seed[k] = index[k] = 0;
  }
  cudaStream_t st = stream_.get();
  TP_CUDA_CHECK(cudaSetDevice(pool_->base().device()));
  // One copy; the previous step's has completed (its results were waited for).
  TP_CUDA_CHECK(cudaMemcpyAsync(g.dev.data(), g.host.data(),
                                a.block_tables + seq_slots * g.width * 4, cudaMemcpyHostToDevice,
                                st));
  g.query_rows = query_rows;
  g.multi_row_count = multi_row_count;
  return StepShape{m, seq_slots, sampled, query_rows};
}

StatusOr<StepResult> CudaModel::DownloadStep(int64_t sampled) {
  Generation& g = *gen_;
  cudaStream_t st = stream_.get();
  TP_CUDA_CHECK(
      cudaMemcpyAsync(g.out_host.data(), g.out.data(), g.slots * 8, cudaMemcpyDeviceToHost, st));
  TP_RETURN_IF_ERROR(pool_->base().WaitStream(st));
  StepResult result;
  result.tokens.resize(sampled);
  const int32_t* token = g.out_host.as<const int32_t>();
  const float* log_prob = g.out_host.as<const float>() + g.slots;
  for (int64_t k = 0; k < sampled; ++k) result.tokens[k] = {token[k], log_prob[k]};
  return result;
}

StatusOr<StepResult> CudaModel::Step(const StepBatch& step) {
  TP_ASSIGN_OR_RETURN(const StepShape shape, UploadStep(step));
  const int64_t m = shape.m, seq_slots = shape.seq_slots;
  cudaStream_t st = stream_.get();
  // Pure decode steps replay a graph per (bucket, slots); the first one of each runs eagerly
  // (planning, NCCL's connections) and is then captured. Other steps run eagerly, and so do
  // decode steps whose capture failed.
  const GraphKey key{overlap_, m, seq_slots};
  const bool graphable = shape.query_rows == 1 && !eager_steps_.contains(key);
  auto graph = graphable ? step_graphs_.find(key) : step_graphs_.end();
  stepping_ = true;
  struct Reset {
    bool* flag;
    ~Reset() { *flag = false; }
  } reset{&stepping_};
  const bool timed = options_.time_passes;
  if (timed) TP_RETURN_IF_ERROR(pass_start_.Record(st));
  if (graph != step_graphs_.end()) {
    TP_RETURN_IF_ERROR(graph->second.Launch(st));
  } else {
    TP_RETURN_IF_ERROR(PrepareBucket(m, seq_slots));
    TP_RETURN_IF_ERROR(Enqueue(m, seq_slots));
  }
  if (timed) TP_RETURN_IF_ERROR(pass_end_.Record(st));
  TP_ASSIGN_OR_RETURN(StepResult result, DownloadStep(shape.sampled));
  if (timed) {
    const StatusOr<float> pass_ms = CudaEvent::ElapsedMs(pass_start_, pass_end_);
    last_pass_ms_ = pass_ms.ok() ? *pass_ms : std::nan("");
  }
  if (graphable && graph == step_graphs_.end() && options_.cuda_graphs) {
    // A capture that fails (the driver refusing a launch under capture, or the graph's
    // instantiation) costs this (bucket, slots) its graph, not the step: its result stands,
    // and its later steps run eagerly.
    StatusOr<CudaGraphExec> exec = CudaGraphExec::Capture(
        st, cudaStreamCaptureModeThreadLocal,
        [&]() -> Status {
          if (injected_capture_failures_ > 0) {
            --injected_capture_failures_;
            return InternalError("injected capture failure (CudaModelOptions)");
          }
          return Enqueue(m, seq_slots);
        },
        options_.graph_priority);
    if (exec.ok()) {
      step_graphs_.emplace(key, std::move(exec).value());
    } else {
      eager_steps_.insert(key);
      spdlog::warn(
          "CudaModel rank {}: decode steps of {} rows and {} sequence slots could not be "
          "captured as a CUDA graph ({}); they run eagerly",
          rank_, m, seq_slots, exec.status().ToString());
    }
  }
  return result;
}

StatusOr<std::vector<std::pair<std::string, double>>> CudaModel::ProfileStep(
    const StepBatch& step) {
  TP_ASSIGN_OR_RETURN(const StepShape shape, UploadStep(step));
  TP_RETURN_IF_ERROR(PrepareBucket(shape.m, shape.seq_slots));
  stepping_ = true;
  std::vector<std::pair<const char*, CudaEvent>> marks;
  stage_marks_ = &marks;
  const Status enqueued = Enqueue(shape.m, shape.seq_slots);
  stage_marks_ = nullptr;
  stepping_ = false;
  TP_RETURN_IF_ERROR(enqueued);
  TP_RETURN_IF_ERROR(DownloadStep(shape.sampled).status());
  return StagesFromMarks(marks, nullptr);
}

}  // namespace tpserve
