#include "engine/cuda_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>
#include <utility>

#include "comm/cuda_check.h"
#include "comm/nccl_thread_group.h"
#include "engine/cuda_model_internal.h"
#include "engine/cuda_ops.h"
#include "engine/fp8_checkpoint_scales.h"
#include "engine/gather_rows.h"
#include "engine/token_buckets.h"
#include "engine/tp_layers.h"
#include "layers/quantize_kernels.h"
#include "layers/random_fill.h"

namespace tpserve {

StatusOr<std::array<CudaLinear*, 4>> CudaModel::BlockLayers(int64_t block, int64_t m) {
  std::array<CudaLinear*, 4> out{};
  for (const TpLayerShape& s : TpLayerShapes(config_)) {
    TP_ASSIGN_OR_RETURN(out[s.index], LayerFor(s, block, m));
  }
  return out;
}

StatusOr<CudaLinear*> CudaModel::LayerFor(const TpLayerShape& s, int64_t block, int64_t m) {
  const GemmScaleScheme scheme = layers_[block].at(s.index).scheme;
  LinearKnobs knobs;
  if (overlap_ != nullptr) {
    TP_ASSIGN_OR_RETURN(knobs, overlap_->Resolve(s.Name(block), s.op, s.n, s.k, m, tp_, scheme));
  }
  const int64_t n_local = s.local_n(tp_), k_local = s.local_k(tp_);
  std::string key = std::string(OverlapOpName(s.op)) + " " + std::to_string(n_local) + "x" +
                    std::to_string(k_local) + " " + knobs.ToString();
  if (scheme != GemmScaleScheme::kPerTensor) key += " " + std::string(GemmScaleSchemeName(scheme));
  const bool accumulate = s.op == OverlapOp::kGemmReduceScatter && ResidualInGemm();
  if (accumulate) key += " accumulate";
  auto it = linears_.find(key);
  if (it == linears_.end()) {
    CudaLinearShape shape{s.op, dtype_, max_m_, n_local, k_local, scheme};
    shape.accumulate = accumulate;
    CudaLinearOptions lo;
    lo.gemm_algo = options_.gemm_algo;
    TP_ASSIGN_OR_RETURN(auto layer, CudaLinear::Create("model." + key, shape, knobs, *pool_, lo));
    it = linears_.emplace(key, std::move(layer)).first;
  }
  TP_RETURN_IF_ERROR(it->second->Prepare(m));
  return it->second.get();
}

Status CudaModel::RunLinear(CudaLinear& layer, const Linear& w, int64_t m, void* y,
                            CudaLinear::SplitOutput* split) {
  const bool fp8 = dtype_ == DataType::kFloat8E4M3;
  const float* x_scale = !fp8 ? nullptr : w.fine() ? a_scales_.as<float>() : w.x_scale();
  const float* w_scale = !fp8 ? nullptr : w.fine() ? w.w_scales.as<float>() : w.w_scale();
  const void* weight = w.w.data();
  if (layer.knobs().full_weight) {
    weight = w.w_full.data();
    if (weight == nullptr) {
      return FailedPreconditionError("layer " + layer.name() +
                                     ": full_weight without the whole weight (PrepareBucket " +
                                     std::to_string(m) + " has not run)");
    }
  }
  if (split != nullptr) return layer.RunSplit(m, weight, x_scale, w_scale, y, stream_.get(), split);
  return layer.Run(m, weight, x_scale, w_scale, y, stream_.get());
}

namespace {

// The residual of an add & norm is a row-parallel layer's output, possibly split in two addends
// (CudaLinear::RunSplit), which the norm adds first; the sum goes back into the stream x.
void SetResidual(const CudaLinear::SplitOutput& r, BFloat16* x, RmsNormParams& p) {
  p.residual = static_cast<const BFloat16*>(r.first);
  p.residual2 = static_cast<const BFloat16*>(r.second);
  p.residual_out = r.first != nullptr ? x : nullptr;
}

}  // namespace

Status CudaModel::Mark(const char* stage) {
  if (stage_marks_ == nullptr) return Status::Ok();
  TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(/*enable_timing=*/true));
  TP_RETURN_IF_ERROR(e.Record(stream_.get()));
  stage_marks_->emplace_back(stage, std::move(e));
  return Status::Ok();
}

Status CudaModel::QuantizeInput(const BFloat16* src, int64_t rows, int64_t cols, const Linear& w,
                                void* out) {
  cudaStream_t st = stream_.get();
  if (w.fine()) {
    QuantizeFp8DynamicParams q;
    q.input = src;
    q.output = static_cast<uint8_t*>(out);
    q.scales = a_scales_.as<float>();
    q.rows = rows;
    q.cols = cols;
    q.granularity = w.granularity();
    return LaunchQuantizeFp8Dynamic(q, st);
  }
  if (w.dynamic) {
    float* amax = amax_.as<float>();
    const bool gather = tp_ > 1;
    if (gather) TP_RETURN_IF_ERROR(pool_->base().AllGather(amax, amax + 4, sizeof(float), st));
    TP_RETURN_IF_ERROR(
        LaunchScaleFromAmax(gather ? amax + 4 : amax, gather ? tp_ : 1, w.scales.as<float>(), st));
  }
  QuantizeFp8Params q;
  q.input = src;
  q.input_type = DataType::kBFloat16;
  q.output = static_cast<uint8_t*>(out);
  q.count = static_cast<size_t>(rows * cols);
  q.scale = w.x_scale();
  return LaunchQuantizeToFp8E4M3(q, st);
}

Status CudaModel::AddNorm(const CudaLinear::SplitOutput& residual, const DeviceBuffer& weight,
                          CudaLinear& next, const Linear& next_w, int64_t m, int64_t rows) {
  const bool fp8 = dtype_ == DataType::kFloat8E4M3;
  RmsNormParams p;
  p.input = x_.as<BFloat16>();
  SetResidual(residual, x_.as<BFloat16>(), p);
  p.weight = weight.as<BFloat16>();
  if (fp8 && next_w.fine()) {  // codes and their scales in one pass
    p.out_fp8 = static_cast<uint8_t*>(next.input(m));
    p.out_fp8_scales = a_scales_.as<float>();
    p.out_fp8_granularity = next_w.granularity();
  } else if (fp8 && !next_w.dynamic) {
    p.out_fp8 = static_cast<uint8_t*>(next.input(m));
    p.out_fp8_scale = next_w.x_scale();
  } else if (fp8) {  // BF16 staging (and its amax for a dynamic scale)
    p.out = normed_.as<BFloat16>();
    p.out_amax = next_w.dynamic ? amax_.as<float>() : nullptr;
  } else {
    p.out = static_cast<BFloat16*>(next.input(m));
  }
  p.rows = rows;
  p.dim = config_.hidden_size;
  p.eps = static_cast<float>(config_.rms_norm_eps);
  TP_RETURN_IF_ERROR(LaunchRmsNorm(p, stream_.get()));
  if (!fp8 || !next_w.dynamic) return Status::Ok();
  return QuantizeInput(normed_.as<BFloat16>(), rows, config_.hidden_size, next_w, next.input(m));
}

Status CudaModel::Enqueue(int64_t m, int64_t seq_slots, int64_t first_block, int64_t end_block) {
  const ModelConfig& c = config_;
  const int64_t blocks = static_cast<int64_t>(layers_.size());
  if (end_block < 0) end_block = blocks;
  if (first_block < 0 || first_block > end_block || end_block > blocks) {
    return InvalidArgumentError("CudaModel::Enqueue: blocks [" + std::to_string(first_block) +
                                ", " + std::to_string(end_block) + ") of " +
                                std::to_string(blocks));
  }
  const bool with_embedding = first_block == 0, with_head = end_block == blocks;
  const RowRange shard = ShardRows(m, tp_, rank_);
  const int64_t rows = shard.size();
  TP_RETURN_IF_ERROR(Mark(nullptr));  // ProfileStages' start

  if (with_embedding) {
    EmbeddingParams emb;
    emb.table = embed_.as<BFloat16>();
    emb.vocab = c.vocab_size;
    emb.dim = c.hidden_size;
    emb.ids = (stepping_ ? step_ids_ : ids_.as<int32_t>()) + shard.begin;
    emb.n = rows;
    emb.out = x_.as<BFloat16>();
    emb.error_flag = error_flag_.as<int32_t>();
    TP_RETURN_IF_ERROR(LaunchEmbeddingLookup(emb, stream_.get()));
    TP_RETURN_IF_ERROR(Mark("embedding"));
  }
  // The block output still to be added to x: none before the first block; a segment that
  // starts later continues from where the one before it stopped (pending_).
  if (with_embedding) pending_ = CudaLinear::SplitOutput{};
  for (int64_t l = first_block; l < end_block; ++l) {
    TP_RETURN_IF_ERROR(EnqueueBlock(l, m, seq_slots, rows, pending_));
  }
  if (!with_head) return Status::Ok();
  return EnqueueHead(m, seq_slots, rows, pending_);
}

namespace {

// The most rows of a pure decode step whose RoPE the attention kernel does itself
// (CudaModelOptions::DecodeFusions::rope_in_attention): beyond, every CTA's own angles cost
// more than the kernel they save.
constexpr int64_t kRopeInAttentionMaxRows = 8;

}  // namespace

Status CudaModel::EnqueueBlock(int64_t l, int64_t m, int64_t seq_slots, int64_t rows,
                               CudaLinear::SplitOutput& pending) {
  using Split = CudaLinear::SplitOutput;
  const ModelConfig& c = config_;
  const int64_t hd = c.head_dim();
  const int64_t nh_l = c.num_attention_heads / tp_, nkv_l = c.num_key_value_heads / tp_;
  const int64_t inter_l = c.intermediate_size / tp_;
  const int64_t qkv_n_l = TpLayerShapes(c)[0].local_n(tp_);
  const bool fp8 = dtype_ == DataType::kFloat8E4M3;
  cudaStream_t st = stream_.get();
  const Layer& lw = layers_[l];
  TP_ASSIGN_OR_RETURN(const auto block, BlockLayers(l, m));
  CudaLinear *qkv = block[0], *o = block[1], *gate_up = block[2], *down = block[3];

  TP_RETURN_IF_ERROR(AddNorm(pending, lw.input_norm, *qkv, lw.qkv, m, rows));
  TP_RETURN_IF_ERROR(Mark("norm"));
  auto* qkv_y = qkv_out_.as<BFloat16>();
  TP_RETURN_IF_ERROR(RunLinear(*qkv, lw.qkv, m, qkv_y));
  TP_RETURN_IF_ERROR(Mark("qkv"));

  RopeParams rope;
  rope.q = qkv_y;
  rope.q_row_stride = qkv_n_l;
  rope.q_heads = nh_l;
  rope.k = qkv_y + nh_l * hd;
  rope.k_row_stride = qkv_n_l;
  rope.kv_heads = nkv_l;
  rope.head_dim = hd;
  rope.positions = stepping_ ? step_positions_ : positions_.as<int32_t>();
  rope.rows = m;
  rope.theta = c.rope_theta;
  rope.inv_freq = rope_inv_freq_.as<double>();
  // Stepping, the same launch stores the step's keys and values in the paged cache; in a pure
  // decode step the attention kernel does both (PagedAttentionParams::rope), one kernel fewer.
  PagedKvWriteParams kv_store;
  bool rope_in_attention = false;
  if (stepping_) {
    kv_store = KvStore(l, m, qkv_y);
    rope.kv_store = &kv_store;
    rope_in_attention = options_.decode_fusions.rope_in_attention && m <= kRopeInAttentionMaxRows &&
                        PagedAttentionTakesRope(PagedParams(l, m, seq_slots, qkv_y));
  }
  // A prefill pass with E4M3 attention rotates q and k in the pass that quantizes them.
  const bool fp8_attention = !stepping_ && fp8_attn_.q != nullptr;
  if (!rope_in_attention && !fp8_attention) TP_RETURN_IF_ERROR(LaunchRope(rope, st));
  TP_RETURN_IF_ERROR(Mark("rope"));

  // FP8: o's input staged as BF16 in attn_, then QuantizeInput (dynamic or fine scales, or a
  // decode step without the out_fp8 fusion).
  bool quantize_o = fp8 && lw.o.staged();
  if (stepping_) {
    // Into o's input, as the prefill pass below: BF16 layers read the output as is; FP8 layers
    // with a static scale get its E4M3 codes from the kernel; the others stage BF16 in attn_
    // (dynamic ones with its amax) for QuantizeInput.
    const bool codes = fp8 && !lw.o.staged() && options_.decode_fusions.attention_out_fp8;
    quantize_o = fp8 && !codes;
    BFloat16* out =
        !fp8 ? static_cast<BFloat16*>(o->input(m)) : (codes ? nullptr : attn_.as<BFloat16>());
    TP_RETURN_IF_ERROR(EnqueuePagedAttention(
        l, m, seq_slots, qkv_y, out, fp8 && lw.o.dynamic ? amax_.as<float>() : nullptr,
        codes ? static_cast<uint8_t*>(o->input(m)) : nullptr, codes ? lw.o.x_scale() : nullptr,
        rope_in_attention ? &rope : nullptr));
  } else {
    AttentionParams at;
    at.q = qkv_y;
    at.q_row_stride = qkv_n_l;
    at.k = qkv_y + nh_l * hd;
    at.k_row_stride = qkv_n_l;
    at.v = qkv_y + (nh_l + nkv_l) * hd;
    at.v_row_stride = qkv_n_l;
    // Into o's input: BF16 layers read the output as is; FP8 layers with a static scale get
    // its E4M3 codes from the kernel; the others stage BF16 (dynamic ones with its amax) for
    // QuantizeInput.
    if (!fp8) {
      at.out = static_cast<BFloat16*>(o->input(m));
      at.out_row_stride = nh_l * hd;
    } else if (!lw.o.staged()) {
      at.out_fp8 = static_cast<uint8_t*>(o->input(m));
      at.out_fp8_row_stride = nh_l * hd;
      at.out_fp8_scale = lw.o.x_scale();
    } else {
      at.out = attn_.as<BFloat16>();
      at.out_row_stride = nh_l * hd;
      at.out_amax = lw.o.dynamic ? amax_.as<float>() : nullptr;
    }
    at.cu_seqlens = cu_seqlens_.as<int32_t>();
    at.num_seqs = seq_slots;
    at.tokens = m;
    at.max_seqlen = m;  // fixed per bucket: a graph cannot depend on the batch
    at.q_heads = nh_l;
    at.kv_heads = nkv_l;
    at.head_dim = hd;
    at.work_counter = attn_counter_.as<int32_t>();
    if (fp8_attention) {
      Fp8AttentionInputs in = fp8_attn_;
      in.scales += 3 * l;  // this layer's
      TP_RETURN_IF_ERROR(LaunchFp8AttentionInputs(at, in, &rope, st));
      TP_RETURN_IF_ERROR(LaunchCausalAttentionFp8(at, in, st));
    } else {
      TP_RETURN_IF_ERROR(LaunchCausalAttention(at, st));
    }
  }
  if (quantize_o) {
    TP_RETURN_IF_ERROR(QuantizeInput(attn_.as<BFloat16>(), m, nh_l * hd, lw.o, o->input(m)));
  }
  TP_RETURN_IF_ERROR(Mark("attention"));
  Split o_out;
  // With the residual in the GEMM x already holds the sum: nothing is left for the norm to add.
  const bool into_x = ResidualInGemm();
  TP_RETURN_IF_ERROR(RunLinear(*o, lw.o, m, into_x ? x_.data() : o_out_.data(), &o_out));
  if (into_x) o_out = Split{};
  TP_RETURN_IF_ERROR(Mark("o"));

  TP_RETURN_IF_ERROR(AddNorm(o_out, lw.post_norm, *gate_up, lw.gate_up, m, rows));
  TP_RETURN_IF_ERROR(Mark("norm"));
  auto run_down = [&]() -> Status {
    TP_RETURN_IF_ERROR(
        RunLinear(*down, lw.down, m, into_x ? x_.data() : down_out_.data(), &pending));
    if (into_x) pending = Split{};
    return Mark("down");
  };
  // A step's gate_up on the small-M kernel writes down's E4M3 input itself (SwiGLU in its
  // epilogue): static per-tensor scales on both sides, the layer one GEMM.
  if (stepping_ && options_.decode_fusions.swiglu_in_gemm && fp8 && !lw.gate_up.staged() &&
      !lw.down.staged() && !gate_up->knobs().full_weight && gate_up->CanRunSwiGlu(m)) {
    TP_RETURN_IF_ERROR(
        gate_up->RunSwiGlu(m, lw.gate_up.w.data(), lw.gate_up.x_scale(), lw.gate_up.w_scale(),
                           static_cast<uint8_t*>(down->input(m)), lw.down.x_scale(), st));
    TP_RETURN_IF_ERROR(Mark("gate_up"));
    TP_RETURN_IF_ERROR(Mark("swiglu"));
    return run_down();
  }
  TP_RETURN_IF_ERROR(RunLinear(*gate_up, lw.gate_up, m, gate_up_out_.data()));
  TP_RETURN_IF_ERROR(Mark("gate_up"));
  SwiGluParams sw;
  sw.gate_up = gate_up_out_.as<BFloat16>();
  if (fp8 && lw.down.fine()) {  // codes and their scales in one pass
    sw.out_fp8 = static_cast<uint8_t*>(down->input(m));
    sw.out_fp8_scales = a_scales_.as<float>();
    sw.out_fp8_granularity = lw.down.granularity();
  } else if (fp8 && !lw.down.dynamic) {
    sw.out_fp8 = static_cast<uint8_t*>(down->input(m));
    sw.out_fp8_scale = lw.down.x_scale();
  } else if (fp8) {  // BF16 staging (and its amax for a dynamic scale)
    sw.out = act_.as<BFloat16>();
    sw.out_amax = lw.down.dynamic ? amax_.as<float>() : nullptr;
  } else {
    sw.out = static_cast<BFloat16*>(down->input(m));
  }
  sw.rows = m;
  sw.inter = inter_l;
  TP_RETURN_IF_ERROR(LaunchSwiGlu(sw, st));
  if (fp8 && lw.down.dynamic) {
    TP_RETURN_IF_ERROR(QuantizeInput(act_.as<BFloat16>(), m, inter_l, lw.down, down->input(m)));
  }
  TP_RETURN_IF_ERROR(Mark("swiglu"));
  return run_down();
}

Status CudaModel::EnqueueHead(int64_t m, int64_t seq_slots, int64_t rows,
                              const CudaLinear::SplitOutput& pending) {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size;
  cudaStream_t st = stream_.get();
  NcclCommunicator& comm = pool_->base();
  // Final add & norm, then the LM head on each sequence's last row.
  RmsNormParams fin;
  fin.input = x_.as<BFloat16>();
  SetResidual(pending, x_.as<BFloat16>(), fin);
  fin.weight = final_norm_.as<BFloat16>();
  fin.out = normed_.as<BFloat16>();
  fin.rows = rows;
  fin.dim = h;
  fin.eps = static_cast<float>(c.rms_norm_eps);
  TP_RETURN_IF_ERROR(LaunchRmsNorm(fin, st));
  TP_RETURN_IF_ERROR(comm.AllGather(normed_.data(), full_.data(), rows * h * 2, st));
  GatherRowsParams g;
  g.input = full_.as<BFloat16>();
  g.input_row_stride = h;
  g.tokens = m;
  g.dim = h;
  g.cu_seqlens = stepping_ ? step_head_cu_ : cu_seqlens_.as<int32_t>();
  g.num_seqs = seq_slots;
  g.out = last_.as<BFloat16>();
  TP_RETURN_IF_ERROR(LaunchGatherLastRowsBf16(g, st));
  const int64_t vocab_l = c.vocab_size / tp_;
  // BF16 rows x BF16 weight -> FP32 logits: rounded to BF16 (steps of 2^-8 of the value),
  // two logits closer than a step could tie or swap, flipping greedy tokens.
  GemmParams lm;
  lm.m = seq_slots;
  lm.n = vocab_l;
  lm.k = h;
  lm.a_type = lm.b_type = DataType::kBFloat16;
  lm.d_type = DataType::kFloat32;
  void* local = tp_ == 1 ? logits_all_.data() : logits_local_.data();
  TP_RETURN_IF_ERROR(lm_gemm_.Run(lm, last_.data(), lm_head_.data(), nullptr, local, st));
  if (tp_ > 1) {
    TP_RETURN_IF_ERROR(comm.AllGather(logits_local_.data(), logits_all_.data(),
                                      seq_slots * vocab_l * sizeof(float), st));
  }
  if (stepping_) TP_RETURN_IF_ERROR(EnqueueSampling(seq_slots));
  return Mark("head");
}

Status CudaModel::PrepareBucket(int64_t m, int64_t seq_slots) {
  // Everything that allocates or plans, ahead of any capture: the TP layers
  // of every block at this M, and the LM head GEMM.
  for (size_t l = 0; l < layers_.size(); ++l) {
    TP_ASSIGN_OR_RETURN(const auto block, BlockLayers(static_cast<int64_t>(l), m));
    for (const TpLayerShape& s : TpLayerShapes(config_)) {
      Linear& w = layers_[l].at(s.index);
      if (block[s.index]->knobs().full_weight && w.w_full.data() == nullptr) {
        TP_RETURN_IF_ERROR(GatherWholeWeight(w, s.Name(static_cast<int64_t>(l))));
      }
    }
  }
  GemmParams lm;
  lm.m = seq_slots;
  lm.n = config_.vocab_size / tp_;
  lm.k = config_.hidden_size;
  lm.a_type = lm.b_type = DataType::kBFloat16;
  lm.d_type = DataType::kFloat32;  // as Enqueue's head runs it
  return lm_gemm_.Prepare(lm);
}

StatusOr<std::pair<int64_t, int64_t>> CudaModel::UploadBatch(const TokenBatch& batch) {
  const int64_t tokens = batch.tokens(), seqs = batch.sequences();
  if (tokens < 1 || seqs < 1 || tokens > options_.max_tokens || seqs > options_.max_seqs) {
    return InvalidArgumentError(
        "batch of " + std::to_string(tokens) + " tokens in " + std::to_string(seqs) +
        " sequences is outside this model's limits (1.." + std::to_string(options_.max_tokens) +
        " tokens, 1.." + std::to_string(options_.max_seqs) + " sequences)");
  }
  // Pad to the bucket with a padding sequence (token 0, its own positions),
  // and the sequence boundaries to the fixed slot count with empty sequences.
  TP_ASSIGN_OR_RETURN(const int64_t m, BucketFor(buckets_, tokens));
  // Sequence slots: the batch's sequences and the padding one, rounded up to
  // a power of two (the attention grid and the LM head scale with them).
  const int64_t seq_slots = SequenceSlots(seqs + 1, options_.max_seqs);
  const HostUpload host = host_upload();
  PadBatchInto(batch, m, seq_slots, host.ids, host.positions, host.cu_seqlens);
  TP_CUDA_CHECK(cudaSetDevice(pool_->base().device()));
  cudaStream_t st = stream_.get();
  TP_CUDA_CHECK(cudaMemcpyAsync(ids_.data(), host.ids, m * 4, cudaMemcpyHostToDevice, st));
  TP_CUDA_CHECK(
      cudaMemcpyAsync(positions_.data(), host.positions, m * 4, cudaMemcpyHostToDevice, st));
  TP_CUDA_CHECK(cudaMemcpyAsync(cu_seqlens_.data(), host.cu_seqlens, (seq_slots + 1) * 4,
                                cudaMemcpyHostToDevice, st));
  // The pinned source is rewritten by the next pass only, after this one's wait.
  return std::pair<int64_t, int64_t>{m, seq_slots};
}

StatusOr<std::vector<std::pair<std::string, double>>> CudaModel::ProfileStages(
    const TokenBatch& batch, std::vector<double>* block_ms) {
  TP_ASSIGN_OR_RETURN(const auto shape, UploadBatch(batch));
  const auto [m, seq_slots] = shape;
  TP_RETURN_IF_ERROR(PrepareBucket(m, seq_slots));
  std::vector<std::pair<const char*, CudaEvent>> marks;
  stage_marks_ = &marks;
  const Status enqueued = Enqueue(m, seq_slots);
  stage_marks_ = nullptr;
  TP_RETURN_IF_ERROR(enqueued);
  TP_RETURN_IF_ERROR(pool_->base().WaitStream(stream_.get()));
  return StagesFromMarks(marks, block_ms);
}

StatusOr<std::vector<std::pair<std::string, double>>> CudaModel::StagesFromMarks(
    const std::vector<std::pair<const char*, CudaEvent>>& marks, std::vector<double>* block_ms) {
  std::vector<std::pair<std::string, double>> stages;
  if (block_ms != nullptr) block_ms->clear();
  double block = 0;  // the running block's stages so far
  for (size_t i = 1; i < marks.size(); ++i) {
    TP_ASSIGN_OR_RETURN(const float ms, CudaEvent::ElapsedMs(marks[i - 1].second, marks[i].second));
    // A block runs from the stage after the embedding (or the previous block's down) to
    // its own down.
    const std::string_view name = marks[i].first;
    if (name != "embedding" && name != "head") block += ms;
    if (name == "down") {
      if (block_ms != nullptr) block_ms->push_back(block);
      block = 0;
    }
    auto it = std::find_if(stages.begin(), stages.end(),
                           [&](const auto& s) { return s.first == marks[i].first; });
    if (it == stages.end()) {
      stages.emplace_back(marks[i].first, ms);
    } else {
      it->second += ms;
    }
  }
  return stages;
}

std::vector<std::pair<int64_t, int64_t>> CudaModel::GraphSegments() const {
  const int64_t blocks = static_cast<int64_t>(layers_.size());
  const int64_t per = options_.graph_blocks > 0 ? options_.graph_blocks : blocks;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t b = 0; b < blocks; b += per) out.push_back({b, std::min(b + per, blocks)});
  if (out.empty()) out.push_back({0, 0});  // no blocks: embedding and head in one
  return out;
}

CudaModel::HostUpload CudaModel::host_upload() const {
  int32_t* base = upload_host_.as<int32_t>();
  return {base, base + max_m_, base + 2 * max_m_, base + 2 * max_m_ + options_.max_seqs + 2};
}

StatusOr<std::vector<float>> CudaModel::Forward(const TokenBatch& batch) {
  TP_ASSIGN_OR_RETURN(const std::span<const float> logits, Pass(batch, /*download=*/true));
  return std::vector<float>(logits.begin(), logits.end());
}

StatusOr<std::span<const float>> CudaModel::ForwardView(const TokenBatch& batch) {
  return Pass(batch, /*download=*/true);
}

Status CudaModel::Run(const TokenBatch& batch) { return Pass(batch, /*download=*/false).status(); }

StatusOr<std::span<const float>> CudaModel::Pass(const TokenBatch& batch, bool download) {
  const ModelConfig& c = config_;
  const int64_t seqs = batch.sequences();
  TP_ASSIGN_OR_RETURN(const auto shape, UploadBatch(batch));
  const auto [m, seq_slots] = shape;
  cudaStream_t st = stream_.get();

  const GraphKey key{overlap_, m, seq_slots};
  auto graph = graphs_.find(key);
  if (graph == graphs_.end()) {
    // First batch of this bucket: plan, run eagerly (which also sets up
    // NCCL's connections), then capture the bucket's graph for the next ones.
    TP_RETURN_IF_ERROR(PrepareBucket(m, seq_slots));
  }
  const bool timed = options_.time_passes;
  if (timed) TP_RETURN_IF_ERROR(pass_start_.Record(st));
  if (graph != graphs_.end()) {
    for (const CudaGraphExec& segment : graph->second) TP_RETURN_IF_ERROR(segment.Launch(st));
  } else {
    TP_RETURN_IF_ERROR(Enqueue(m, seq_slots));
  }
  if (timed) TP_RETURN_IF_ERROR(pass_end_.Record(st));
  // The error flag and the logits come back behind the pass, into pinned memory, and one
  // wait covers all three. logits_all_ is FP32 [tp, seq_slots, vocab / tp]: at tp > 1 each
  // rank's slice of the batch's sequences' rows first goes into its columns of whole rows on
  // the device (the padding's and the empty slots' rows are not read), so that the download
  // is one contiguous copy (a strided one to the host runs at a fraction of the link's speed).
  int32_t* flag = host_upload().error_flag;
  TP_CUDA_CHECK(cudaMemcpyAsync(flag, error_flag_.data(), 4, cudaMemcpyDeviceToHost, st));
  const int64_t vocab_l = c.vocab_size / tp_;
  float* logits = logits_host_.as<float>();
  if (download) {
    const float* rows = logits_all_.as<float>();
    if (tp_ > 1) {
      for (int r = 0; r < tp_; ++r) {
        TP_CUDA_CHECK(cudaMemcpy2DAsync(
            logits_rows_.as<float>() + r * vocab_l, c.vocab_size * sizeof(float),
            logits_all_.as<float>() + r * seq_slots * vocab_l, vocab_l * sizeof(float),
            vocab_l * sizeof(float), seqs, cudaMemcpyDeviceToDevice, st));
      }
      rows = logits_rows_.as<float>();
    }
    TP_CUDA_CHECK(cudaMemcpyAsync(logits, rows, seqs * c.vocab_size * sizeof(float),
                                  cudaMemcpyDeviceToHost, st));
  }
  if (timed) TP_RETURN_IF_ERROR(copy_end_.Record(st));
  NcclCommunicator& comm = pool_->base();
  TP_RETURN_IF_ERROR(comm.WaitStream(st));
  if (timed) {
    // A measurement only: a failure to read it does not fail the pass.
    const StatusOr<float> pass_ms = CudaEvent::ElapsedMs(pass_start_, pass_end_);
    last_pass_ms_ = pass_ms.ok() ? *pass_ms : std::nan("");
    const StatusOr<float> copy_ms = CudaEvent::ElapsedMs(pass_end_, copy_end_);
    last_copy_ms_ = copy_ms.ok() ? *copy_ms : std::nan("");
  }
  if (graph == graphs_.end() && options_.cuda_graphs) {
    std::vector<CudaGraphExec> segments;
    for (const auto& [begin, end] : GraphSegments()) {
      TP_ASSIGN_OR_RETURN(CudaGraphExec exec, CudaGraphExec::Capture(
                                                  st, cudaStreamCaptureModeThreadLocal,
                                                  [&] { return Enqueue(m, seq_slots, begin, end); },
                                                  options_.graph_priority));
      segments.push_back(std::move(exec));
    }
    graphs_.emplace(key, std::move(segments));
  }

  if (*flag != 0) {
    const RowRange shard = ShardRows(m, tp_, rank_);
    return InvalidArgumentError("token id at position " + std::to_string(shard.begin + *flag - 1) +
                                " is outside [0, " + std::to_string(c.vocab_size) + ")");
  }
  if (!download) return std::span<const float>();
  return std::span<const float>(logits, static_cast<size_t>(seqs * c.vocab_size));
}

void CudaModel::SetOverlap(const OverlapConfig* overlap) { overlap_ = overlap; }

Status CudaModel::WarmUp() {
  // One batch per (bucket, sequence slots) that a request batch can reach:
  // plans, eager run, capture (collective). A slot count s serves batches of
  // s/2 .. s-1 sequences (plus the padding one); it is reachable in bucket m
  // when such a batch can hold more tokens than the bucket below (each
  // sequence at most max_position_embeddings long, each at least one token).
  const int64_t max_pos = config_.max_position_embeddings;
  std::vector<int64_t> slot_counts;  // every value SequenceSlots takes, ascending
  for (int64_t n = 1; n <= options_.max_seqs; ++n) {
    const int64_t s = SequenceSlots(n + 1, options_.max_seqs);
    if (slot_counts.empty() || slot_counts.back() != s) slot_counts.push_back(s);
  }
  int64_t below = 0;
  for (int64_t m : buckets_) {
    const int64_t most = std::min(m, options_.max_tokens);
    for (int64_t s : slot_counts) {
      // The most sequences this slot count takes (their count n satisfies
      // SequenceSlots(n + 1) == s), and as many tokens as fit the bucket.
      int64_t n = std::min({s - 1, options_.max_seqs, most});
      while (n > 1 && SequenceSlots(n + 1, options_.max_seqs) != s) --n;
      if (SequenceSlots(n + 1, options_.max_seqs) != s) continue;
      const int64_t tokens = std::min(most, n * max_pos);
      if (tokens <= below || tokens < n) continue;  // lands in a smaller bucket
      TokenBatch b;
      b.cu_seqlens.push_back(0);
      for (int64_t q = 0; q < n; ++q) {
        const int64_t len = tokens / n + (q < tokens % n ? 1 : 0);
        for (int64_t t = 0; t < len; ++t) {
          b.ids.push_back(static_cast<int32_t>(b.ids.size() % config_.vocab_size));
          b.positions.push_back(static_cast<int32_t>(t));
        }
        b.cu_seqlens.push_back(static_cast<int32_t>(b.ids.size()));
      }
      TP_RETURN_IF_ERROR(Forward(b).status().WithContext("warming up bucket " + std::to_string(m) +
                                                         " with " + std::to_string(s) + " slots"));
    }
    below = m;
  }
  return Status::Ok();
}

StatusOr<std::vector<float>> RunCudaModel(const ModelConfig& config, NcclThreadGroup& group,
                                          DataType dtype, uint64_t seed,
                                          const OverlapConfig* overlap, const TokenBatch& batch,
                                          const std::string& checkpoint_dir,
                                          GemmAlgoSelection gemm_algo) {
  std::vector<float> result;
  CudaModelOptions options;
  options.gemm_algo = gemm_algo;
  options.max_tokens = batch.tokens();
  options.max_seqs = batch.sequences();
  TP_RETURN_IF_ERROR(group.Run([&](int r) -> Status {
    RankWeights w;
    if (checkpoint_dir.empty()) {
      TP_ASSIGN_OR_RETURN(w, MakeRandomRankWeights(config, dtype, group.size(), r, seed));
    } else {
      TP_ASSIGN_OR_RETURN(w, LoadRankWeights(checkpoint_dir, config, group.size(), r, dtype));
    }
    TP_ASSIGN_OR_RETURN(auto model, CudaModel::Create(config, w, overlap, group.pool(r), options));
    TP_ASSIGN_OR_RETURN(std::vector<float> logits, model->Forward(batch));
    if (r == 0) result = std::move(logits);
    return Status::Ok();
  }));
  return result;
}

}  // namespace tpserve
