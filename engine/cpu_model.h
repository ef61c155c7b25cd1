// CpuModel: one rank of a Llama-family transformer on the CPU reference
// executor (ranks are threads with a LocalCommunicator). The numeric
// reference for the GPU engine and the server's backend without GPUs.
//
// Per block, with sequence parallelism between blocks (each rank holds its
// row shard of the residual stream, ShardRows(M, tp, rank)):
//   RMSNorm -> attn.qkv (AG+GEMM) -> RoPE -> causal attention over packed
//   sequences -> attn.o (GEMM+RS) -> +residual -> RMSNorm -> mlp.gate_up
//   (AG+GEMM) -> SwiGLU -> mlp.down (GEMM+RS) -> +residual
// then the final RMSNorm, and the LM head on the last token of each sequence.
// The four TP layers run the overlap plans chosen by the overlap config for
// their name ("layers.3.attn.qkv", "layers.3.attn.o", "layers.3.mlp.gate_up",
// "layers.3.mlp.down") at the batch's M. FP8 activations use the layer's
// static input scale.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/kv_cache.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "engine/step_batch.h"
#include "engine/token_batch.h"
#include "layers/overlap_config.h"

namespace tpserve {

class CpuModel {
 public:
  // `overlap` may be null (every layer: mode none). Not thread-safe; one
  // object per rank thread.
  static StatusOr<std::unique_ptr<CpuModel>> Create(const ModelConfig& config, RankWeights weights,
                                                    const OverlapConfig* overlap,
                                                    Communicator& comm);

  // Logits of the last token of every sequence, [sequences, vocab], on every
  // rank. Collective: all ranks call it with the same batch.
  StatusOr<std::vector<float>> Forward(const TokenBatch& batch);
  // The same pass with the LM head on every token: logits [tokens, vocab],
  // row i of the batch's token i, on every rank (benchmarks/accuracy_eval.h
  // compares every position of its prompts). Collective.
  StatusOr<std::vector<float>> ForwardAllTokens(const TokenBatch& batch);
  // Forward's pass without the LM head, recording each layer's largest |key| (RoPE applied)
  // and |value| over the batch, every KV head's (the ranks' maxima combined): what
  // KvScalesForAbsMax turns into the E4M3 cache's scales. A non-finite key or value is an
  // INVALID_ARGUMENT naming the layer. Collective.
  StatusOr<std::vector<KvAbsMax>> MeasureKvAbsMax(const TokenBatch& batch);

  // One generation step over this rank's paged KV cache: the step's keys and
  // values are written into `cache`, attention reads the cache
  // (PagedAttention), so a token's result does not depend on how its
  // sequence was split over steps. Returns the logits of the last row of each
  // sequence marked `sample`, [sampled, vocab], on every rank. Collective.
  StatusOr<std::vector<float>> Step(const StepBatch& step, CpuKvCache& cache);

 private:
  // Forward's pass; the LM head on every row (all_rows) or on each
  // sequence's last.
  StatusOr<std::vector<float>> Prefill(const TokenBatch& batch, bool all_rows);
  // Attention of one layer: q [m, q_heads_l, hd], k and v [m, kv_heads_l, hd]
  // (RoPE applied) -> out [m, q_heads_l, hd].
  using AttendFn = std::function<Status(int64_t layer, const float* q, const float* k,
                                        const float* v, float* out)>;
  // The blocks and the final norm over the tokens `ids` at `positions`;
  // `normed` gets this rank's row shard of the final-normed stream.
  Status Blocks(const std::vector<int32_t>& ids, const std::vector<int32_t>& positions,
                const AttendFn& attend, std::vector<float>* normed);
  // LM-head logits [rows.size(), vocab] of the given rows of the m-row batch.
  StatusOr<std::vector<float>> Head(const std::vector<float>& normed, int64_t m,
                                    const std::vector<int64_t>& rows);

  CpuModel(const ModelConfig& config, RankWeights weights, const OverlapConfig* overlap,
           Communicator& comm)
      : config_(config), w_(std::move(weights)), overlap_(overlap), comm_(comm) {}

  // y = x · W^T through the TP layer `name` (AG+GEMM or GEMM+RS).
  Status Linear(const std::string& name, OverlapOp op, const LinearWeight& w, int64_t global_n,
                int64_t global_k, int64_t m, const std::vector<float>& x, std::vector<float>* y);
  // A gemm_rs layer with full_weight: every rank's W_r gathered into the whole [n, tp * k]
  // weight the plan multiplies by (FAILED_PRECONDITION if the ranks' scales differ).
  StatusOr<std::vector<uint8_t>> GatherWholeWeight(const std::string& name, const LinearWeight& w);

  ModelConfig config_;
  RankWeights w_;
  const OverlapConfig* overlap_;
  Communicator& comm_;
  // full_weight layers' whole weights, by layer name (this rank's thread only, as Linear).
  std::map<std::string, std::vector<uint8_t>> whole_weights_;
};

// Runs Forward on `tp` threads (LocalCommunicator) with random weights from
// `seed`, or loaded from `checkpoint_dir` when it is non-empty; returns the
// logits [sequences, vocab].
StatusOr<std::vector<float>> RunCpuModel(const ModelConfig& config, int tp, DataType dtype,
                                         uint64_t seed, const std::string& checkpoint_dir,
                                         const OverlapConfig* overlap, const TokenBatch& batch);

}  // namespace tpserve
