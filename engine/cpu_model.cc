#include "engine/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "comm/local_communicator.h"
#include "engine/cpu_ops.h"
#include "engine/kv_cache.h"
#include "layers/cpu_linear.h"
#include "layers/fp8.h"
#include "layers/linear_knobs.h"

namespace tpserve {

StatusOr<std::unique_ptr<CpuModel>> CpuModel::Create(const ModelConfig& config, RankWeights weights,
                                                     const OverlapConfig* overlap,
                                                     Communicator& comm) {
  TP_RETURN_IF_ERROR(ValidateRankWeights(config, weights, comm.size(), comm.rank()));
  return std::unique_ptr<CpuModel>(new CpuModel(config, std::move(weights), overlap, comm));
}

StatusOr<std::vector<uint8_t>> CpuModel::GatherWholeWeight(const std::string& name,
                                                           const LinearWeight& w) {
  const int tp = comm_.size();
  const size_t row = static_cast<size_t>(w.k) * DataTypeSize(w.dtype);
  std::vector<uint8_t> shards(tp * w.data.size()), whole(w.data.size() * tp);
  TP_RETURN_IF_ERROR(comm_.AllGather(w.data.data(), shards.data(), w.data.size(), nullptr)
                         .WithContext("layer " + name + ": full_weight's whole weight"));
  std::vector<float> scales(tp);
  TP_RETURN_IF_ERROR(comm_.AllGather(&w.weight_scale, scales.data(), sizeof(float), nullptr)
                         .WithContext("layer " + name + ": full_weight's weight scale"));
  if (std::any_of(scales.begin(), scales.end(), [&](float v) { return v != scales[0]; })) {
    return FailedPreconditionError("layer " + name +
                                   ": full_weight needs one weight scale on every rank");
  }
  for (int64_t j = 0; j < w.n; ++j) {
    for (int r = 0; r < tp; ++r) {
      std::memcpy(whole.data() + (j * tp + r) * row, shards.data() + r * w.data.size() + j * row,
                  row);
    }
  }
  return whole;
}

Status CpuModel::Linear(const std::string& name, OverlapOp op, const LinearWeight& w,
                        int64_t global_n, int64_t global_k, int64_t m, const std::vector<float>& x,
                        std::vector<float>* y) {
  LinearKnobs knobs;
  if (overlap_ != nullptr) {
    const GemmScaleScheme scheme = w.dtype == DataType::kFloat8E4M3 ? GemmScaleSchemeOf(w.scheme)
                                                                    : GemmScaleScheme::kPerTensor;
    TP_ASSIGN_OR_RETURN(knobs,
                        overlap_->Resolve(name, op, global_n, global_k, m, comm_.size(), scheme));
  }
  // The schedule the GPU layer runs for these knobs (its deferred last sum included).
  TP_ASSIGN_OR_RETURN(OverlapPlan plan,
                      MakeOverlapPlan(LinearPlanRequest(op, knobs, comm_.size(), comm_.rank(), m)));
  // Activations in the layer's operand type.
  std::vector<uint8_t> xq;
  std::vector<float> x_scales;  // per token / per 1x128 group (CpuLinearArgs)
  float x_scale = w.input_scale;
  if (w.dtype == DataType::kFloat8E4M3 && w.scheme != Fp8Scheme::kPerTensor) {
    // Scales of this rank's operand rows only: nothing to agree on across ranks.
    xq.resize(x.size());
    x_scales.resize(x.size() / w.k * Fp8ActivationScalesPerRow(w.scheme, w.k));
    QuantizeActivationsFp8(w.scheme, x, w.k, xq, x_scales);
  } else if (w.dtype == DataType::kFloat8E4M3) {
    if (w.dynamic_input) {
      // This batch's scale from the whole input's amax, the largest over
      // the ranks' parts (rows for a column-parallel layer, columns for a
      // row-parallel one): the scale an unsharded model would compute, so
      // the TP size does not change it (as in CudaModel).
      float amax = Amax(x);
      if (comm_.size() > 1) {
        std::vector<float> all(comm_.size());
        TP_RETURN_IF_ERROR(comm_.AllGather(&amax, all.data(), sizeof(float), nullptr)
                               .WithContext("layer " + name + ": input amax"));
        amax = *std::max_element(all.begin(), all.end());
      }
      x_scale = ScaleFromAmax(amax, Fp8Format::kE4M3);
    }
    xq.resize(x.size());
    QuantizeFp8(x, x_scale, Fp8Format::kE4M3, xq);
  } else {
    xq.resize(x.size() * 2);
    for (size_t i = 0; i < x.size(); ++i) {
      const BFloat16 b = FloatToBFloat16(x[i]);
      std::memcpy(xq.data() + 2 * i, &b.bits, 2);
    }
  }
  const int64_t out_rows =
      op == OverlapOp::kAllGatherGemm ? m : ShardRows(m, comm_.size(), comm_.rank()).size();
  std::vector<BFloat16> out(out_rows * w.n);
  CpuLinearArgs a{w.dtype, w.n, w.k, xq.data(), x_scale, w.data.data(), w.weight_scale, out.data()};
  a.scheme = w.scheme;
  a.x_scales = x_scales;
  a.w_scales = w.weight_scales;
  if (plan.request.full_weight) {
    // Gathered once a layer, by every rank at the same call (the knobs resolve alike on all).
    auto it = whole_weights_.find(name);
    if (it == whole_weights_.end()) {
      TP_ASSIGN_OR_RETURN(std::vector<uint8_t> whole, GatherWholeWeight(name, w));
      it = whole_weights_.emplace(name, std::move(whole)).first;
    }
    a.w_full = it->second.data();
  }
  TP_RETURN_IF_ERROR(RunCpuLinear(plan, comm_, a).WithContext("layer " + name));
  y->resize(out.size());
  for (size_t i = 0; i < out.size(); ++i) (*y)[i] = BFloat16ToFloat(out[i]);
  return Status::Ok();
}

StatusOr<std::vector<float>> CpuModel::Forward(const TokenBatch& batch) {
  return Prefill(batch, /*all_rows=*/false);
}

StatusOr<std::vector<float>> CpuModel::ForwardAllTokens(const TokenBatch& batch) {
  return Prefill(batch, /*all_rows=*/true);
}

StatusOr<std::vector<KvAbsMax>> CpuModel::MeasureKvAbsMax(const TokenBatch& batch) {
  TP_RETURN_IF_ERROR(
      ValidateTokenBatch(batch, config_.vocab_size, config_.max_position_embeddings));
  const int64_t q_heads = config_.num_attention_heads / comm_.size();
  const int64_t kv_heads = config_.num_key_value_heads / comm_.size();
  const int64_t n = batch.tokens() * kv_heads * config_.head_dim();
  // [layer][k, v]: this rank's, then every rank's.
  std::vector<float> mine(2 * static_cast<size_t>(config_.num_hidden_layers), 0.0f);
  std::vector<float> normed;
  TP_RETURN_IF_ERROR(Blocks(
      batch.ids, batch.positions,
      [&](int64_t layer, const float* q, const float* k, const float* v, float* out) -> Status {
        for (int part = 0; part < 2; ++part) {
          const float* x = part == 0 ? k : v;
          float& m = mine[2 * layer + part];
          for (int64_t i = 0; i < n; ++i) {
            if (!std::isfinite(x[i])) {
              return InvalidArgumentError("KV abs max: layer " + std::to_string(layer) + "'s " +
                                          (part == 0 ? "keys" : "values") +
                                          " hold a non-finite value");
            }
            m = std::max(m, std::abs(x[i]));
          }
        }
        return CausalAttentionVarlen(q, k, v, batch.tokens(), q_heads, kv_heads, config_.head_dim(),
                                     batch.cu_seqlens, out);
      },
      &normed));
  std::vector<float> all(mine.size() * comm_.size());
  TP_RETURN_IF_ERROR(comm_.AllGather(mine.data(), all.data(), mine.size() * sizeof(float), nullptr)
                         .WithContext("KV abs max"));
  std::vector<KvAbsMax> out(static_cast<size_t>(config_.num_hidden_layers));
  for (int r = 0; r < comm_.size(); ++r) {
    for (size_t l = 0; l < out.size(); ++l) {
      out[l].k = std::max(out[l].k, all[r * mine.size() + 2 * l]);
      out[l].v = std::max(out[l].v, all[r * mine.size() + 2 * l + 1]);
    }
  }
  return out;
}

StatusOr<std::vector<float>> CpuModel::Prefill(const TokenBatch& batch, bool all_rows) {
  // Every rank checks the same batch and so fails alike, before any
  // collective (an empty sequence would otherwise never find its owner).
  TP_RETURN_IF_ERROR(
      ValidateTokenBatch(batch, config_.vocab_size, config_.max_position_embeddings));
  const int64_t q_heads = config_.num_attention_heads / comm_.size();
  const int64_t kv_heads = config_.num_key_value_heads / comm_.size();
  std::vector<float> normed;
  TP_RETURN_IF_ERROR(Blocks(
      batch.ids, batch.positions,
      [&](int64_t, const float* q, const float* k, const float* v, float* out) {
        return CausalAttentionVarlen(q, k, v, batch.tokens(), q_heads, kv_heads, config_.head_dim(),
                                     batch.cu_seqlens, out);
      },
      &normed));
  std::vector<int64_t> rows;
  if (all_rows) {
    rows.resize(batch.tokens());
    std::iota(rows.begin(), rows.end(), int64_t{0});
  } else {
    for (int64_t s = 0; s < batch.sequences(); ++s) rows.push_back(batch.cu_seqlens[s + 1] - 1);
  }
  return Head(normed, batch.tokens(), rows);
}

StatusOr<std::vector<float>> CpuModel::Step(const StepBatch& step, CpuKvCache& cache) {
  const KvCacheLayout& L = cache.layout();
  TP_RETURN_IF_ERROR(ValidateStepBatch(step, config_.vocab_size, config_.max_position_embeddings,
                                       L.num_blocks, L.block_size));
  const int64_t q_heads = config_.num_attention_heads / comm_.size();
  const int64_t m = step.tokens(), kv_width = L.kv_heads * L.head_dim;
  // Each row's sequence, for its block table.
  std::vector<int64_t> seq_of(m);
  for (int64_t s = 0; s < step.sequences(); ++s) {
    for (int32_t r = step.cu_seqlens[s]; r < step.cu_seqlens[s + 1]; ++r) seq_of[r] = s;
  }
  std::vector<float> normed;
  TP_RETURN_IF_ERROR(Blocks(
      step.ids, step.positions,
      [&](int64_t layer, const float* q, const float* k, const float* v, float* out) -> Status {
        for (int64_t r = 0; r < m; ++r) {
          cache.Write(layer, k + r * kv_width, v + r * kv_width, 1, &step.positions[r],
                      step.block_tables.data() + seq_of[r] * step.max_blocks);
        }
        return PagedAttention(cache, layer, q, q_heads, step.cu_seqlens, step.context_lens,
                              step.block_tables, step.max_blocks, out);
      },
      &normed));
  std::vector<int64_t> rows;
  for (int64_t s = 0; s < step.sequences(); ++s) {
    if (step.sample[s] != 0) rows.push_back(step.cu_seqlens[s + 1] - 1);
  }
  if (rows.empty()) return std::vector<float>{};
  return Head(normed, m, rows);
}

Status CpuModel::Blocks(const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                        const AttendFn& attend, std::vector<float>* normed_out) {
  const ModelConfig& c = config_;
  const int tp = comm_.size(), rank = comm_.rank();
  const int64_t m = static_cast<int64_t>(ids.size()), h = c.hidden_size, hd = c.head_dim();
  const int64_t nh_l = c.num_attention_heads / tp, nkv_l = c.num_key_value_heads / tp;
  const int64_t inter_l = c.intermediate_size / tp;
  const std::vector<double> inv_freq = RopeInverseFrequencies(c);  // plain or scaled RoPE
  const RowRange shard = ShardRows(m, tp, rank);
  const int64_t rows = shard.size();

  // The residual stream: this rank's rows.
  std::vector<float> x(rows * h);
  TP_RETURN_IF_ERROR(
      EmbeddingLookup(w_.embed.data(), c.vocab_size, h, ids.data() + shard.begin, rows, x.data()));
  std::vector<float> normed(rows * h), qkv, attn(m * nh_l * hd), mlp_in, mlp_act(m * inter_l), proj;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w_.layers[l];
    const std::string p = "layers." + std::to_string(l);
    RmsNorm(x.data(), lw.input_norm.data(), rows, h, c.rms_norm_eps, normed.data());
    const int64_t qkv_n = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd;
    TP_RETURN_IF_ERROR(
        Linear(p + ".attn.qkv", OverlapOp::kAllGatherGemm, lw.qkv, qkv_n, h, m, normed, &qkv));
    // Split the fused rows into q, k, v of this rank's heads.
    const int64_t row_n = lw.qkv.n, qn = nh_l * hd, kn = nkv_l * hd;
    std::vector<float> q(m * qn), k(m * kn), v(m * kn);
    for (int64_t i = 0; i < m; ++i) {
      std::copy_n(qkv.data() + i * row_n, qn, q.data() + i * qn);
      std::copy_n(qkv.data() + i * row_n + qn, kn, k.data() + i * kn);
      std::copy_n(qkv.data() + i * row_n + qn + kn, kn, v.data() + i * kn);
    }
    TP_RETURN_IF_ERROR(ApplyRope(q.data(), m, nh_l, hd, positions.data(), inv_freq));
    TP_RETURN_IF_ERROR(ApplyRope(k.data(), m, nkv_l, hd, positions.data(), inv_freq));
    TP_RETURN_IF_ERROR(attend(l, q.data(), k.data(), v.data(), attn.data()));
    TP_RETURN_IF_ERROR(Linear(p + ".attn.o", OverlapOp::kGemmReduceScatter, lw.o, h,
                              c.num_attention_heads * hd, m, attn, &proj));
    for (int64_t i = 0; i < rows * h; ++i) x[i] += proj[i];

    RmsNorm(x.data(), lw.post_norm.data(), rows, h, c.rms_norm_eps, normed.data());
    TP_RETURN_IF_ERROR(Linear(p + ".mlp.gate_up", OverlapOp::kAllGatherGemm, lw.gate_up,
                              2 * c.intermediate_size, h, m, normed, &mlp_in));
    SwiGlu(mlp_in.data(), m, inter_l, mlp_act.data());
    TP_RETURN_IF_ERROR(Linear(p + ".mlp.down", OverlapOp::kGemmReduceScatter, lw.down, h,
                              c.intermediate_size, m, mlp_act, &proj));
    for (int64_t i = 0; i < rows * h; ++i) x[i] += proj[i];
  }
  RmsNorm(x.data(), w_.final_norm.data(), rows, h, c.rms_norm_eps, normed.data());
  *normed_out = std::move(normed);
  return Status::Ok();
}

StatusOr<std::vector<float>> CpuModel::Head(const std::vector<float>& normed, int64_t m,
                                            const std::vector<int64_t>& rows_wanted) {
  const ModelConfig& c = config_;
  const int tp = comm_.size();
  const int64_t h = c.hidden_size;
  // Gather the normed rows (padded to the largest shard), keep the wanted
  // rows, and multiply by this rank's vocabulary slice.
  const int64_t max_rows = ShardRows(m, tp, 0).size();
  std::vector<float> mine(max_rows * h, 0.0f), all(max_rows * h * tp);
  std::copy(normed.begin(), normed.end(), mine.begin());
  TP_RETURN_IF_ERROR(
      comm_.AllGather(mine.data(), all.data(), mine.size() * sizeof(float), nullptr));
  const int64_t seqs = static_cast<int64_t>(rows_wanted.size());
  std::vector<uint8_t> last(seqs * h * 2);
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t row = rows_wanted[s];
    int owner = 0;
    while (!(ShardRows(m, tp, owner).begin <= row && row < ShardRows(m, tp, owner).end)) ++owner;
    const float* src = all.data() + (owner * max_rows + row - ShardRows(m, tp, owner).begin) * h;
    for (int64_t j = 0; j < h; ++j) {
      const BFloat16 b = FloatToBFloat16(src[j]);
      std::memcpy(last.data() + 2 * (s * h + j), &b.bits, 2);
    }
  }
  const int64_t v_l = w_.lm_head.n;
  std::vector<BFloat16> logits_l(seqs * v_l);
  TP_RETURN_IF_ERROR(ReferenceLinear(DataType::kBFloat16, seqs, v_l, h, last.data(), 1.0f,
                                     w_.lm_head.data.data(), 1.0f, logits_l));
  std::vector<float> local(seqs * v_l), gathered(seqs * v_l * tp);
  for (size_t i = 0; i < local.size(); ++i) local[i] = BFloat16ToFloat(logits_l[i]);
  TP_RETURN_IF_ERROR(
      comm_.AllGather(local.data(), gathered.data(), local.size() * sizeof(float), nullptr));
  std::vector<float> logits(seqs * c.vocab_size);
  for (int r = 0; r < tp; ++r) {
    for (int64_t s = 0; s < seqs; ++s) {
      std::copy_n(gathered.data() + (r * seqs + s) * v_l, v_l,
                  logits.data() + s * c.vocab_size + r * v_l);
    }
  }
  return logits;
}

StatusOr<std::vector<float>> RunCpuModel(const ModelConfig& config, int tp, DataType dtype,
                                         uint64_t seed, const std::string& checkpoint_dir,
                                         const OverlapConfig* overlap, const TokenBatch& batch) {
  TP_RETURN_IF_ERROR(config.ValidateForTp(tp));
  std::vector<float> result;
  TP_RETURN_IF_ERROR(RunOnLocalRanks(tp, [&](Communicator& comm) -> Status {
    RankWeights w;
    if (checkpoint_dir.empty()) {
      TP_ASSIGN_OR_RETURN(w, MakeRandomRankWeights(config, dtype, tp, comm.rank(), seed));
    } else {
      TP_ASSIGN_OR_RETURN(w, LoadRankWeights(checkpoint_dir, config, tp, comm.rank(), dtype));
    }
    TP_ASSIGN_OR_RETURN(auto model, CpuModel::Create(config, std::move(w), overlap, comm));
    TP_ASSIGN_OR_RETURN(std::vector<float> logits, model->Forward(batch));
    if (comm.rank() == 0) result = std::move(logits);
    return Status::Ok();
  }));
  return result;
}

}  // namespace tpserve
