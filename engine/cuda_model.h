// CudaModel: one rank of a Llama-family transformer on one GPU — the same
// model as CpuModel (engine/cpu_model.h), built from the overlapped TP layers
// (layers/cuda_linear.h) and the block's kernels (engine/cuda_ops.h).
//
// Per block, with sequence parallelism between blocks (each rank holds its
// row shard of the residual stream in BF16):
//   add & RMSNorm -> FP8 -> attn.qkv (AG+GEMM) -> RoPE -> causal varlen
//   attention -> FP8 -> attn.o (GEMM+RS) -> add & RMSNorm -> FP8 ->
//   mlp.gate_up (AG+GEMM) -> SwiGLU -> FP8 -> mlp.down (GEMM+RS)
// then add & RMSNorm, an AllGather of the normed rows, each sequence's last
// row, the LM head (BF16 rows and weight, FP32 logits, vocabulary split over
// ranks) and an AllGather of the FP32 logits. Residual adds are fused into the
// next RMSNorm. So is the last addition of a row-parallel layer (o, down)
// whose plan ends in a sum step of its own (a one-chunk copy-engine ring,
// CudaLinear::RunSplit): the norm adds its two addends itself, the same FP32
// sum rounded once, instead of a pass that writes the sum for the norm to
// read. FP8 activations use each layer's static input scale, as the CPU model
// does.
//
// Differences from CpuModel that show in the numbers: activations between
// ops are BF16 (CPU: FP32), attention uses BF16 probabilities; tests compare
// logits with a stated tolerance.
//
// Token buckets and CUDA graphs: a batch is padded up to the smallest token
// bucket that holds it (buckets are multiples of tp, so every rank's shard
// has the same rows, as NCCL needs) with a padding sequence (token 0, its
// own positions), and its sequence count (with the padding one) up to a
// power-of-two number of slots with empty sequences (the attention grid and
// the LM head scale with the slots, not with max_seqs); the padding's logits
// are dropped. Everything that depends on the batch's contents (ids,
// positions, boundaries) lives in device buffers, so one CUDA graph per
// (overlap settings, bucket, slots) serves every batch that fits it: the
// first such batch runs eagerly (planning the TP layers and setting up
// NCCL's connections), then the graph is captured and replayed from then on
// (WarmUp() does this for every bucket and slot count at start). TP
// layers are created on first use, one per distinct (op, shape, knobs) —
// layers of the same shape share one CudaLinear, since weights are passed
// per call — and prepared per bucket.
//
// Thread-safety: none; one object per rank, used by that rank's thread (or
// process). Forward is collective: all ranks call it with the same batch.
// Shutdown: destroy before the NcclCommPool.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/cuda_resources.h"
#include "comm/nccl_communicator.h"
#include "engine/attention_fp8.h"
#include "engine/cpu_model.h"
#include "engine/kv_cache.h"
#include "engine/model_config.h"
#include "engine/model_weights.h"
#include "engine/paged_kv_ops.h"
#include "engine/step_batch.h"
#include "engine/tp_layers.h"
#include "layers/cublaslt_gemm.h"
#include "layers/cuda_linear.h"
#include "layers/overlap_config.h"

namespace tpserve {

struct CudaModelOptions {
  int64_t max_tokens = 8192;  // most tokens per batch (before padding to a bucket)
  int64_t max_seqs = 64;      // most sequences per batch
  // Token buckets (each rounded up to a multiple of tp; the largest is
  // always max_tokens rounded up). Empty: 256 tokens doubling up to that.
  std::vector<int64_t> buckets;
  bool cuda_graphs = true;  // replay a captured graph per bucket (false: always eager)
  // Fault injection for tests: the first this many captures of a decode step's graph fail
  // (as a capture the driver refuses would), so that CudaModel::Step's fallback can be
  // exercised: a decode step whose capture fails keeps its result, and that (bucket, slots)
  // then runs eagerly.
  int injected_capture_failures = 0;
  bool time_passes = false;  // time each Forward's pass on the GPU (CudaModel::last_pass_ms)
  // > 0: capture a bucket's pass as one graph per this many blocks (the embedding with the
  // first, the head with the last), launched one after another, instead of one graph for
  // the whole pass. For measuring what a graph's size costs.
  int64_t graph_blocks = 0;
  // CreateRandom only: every FP8 layer scales its input per batch, as the
  // layers of a checkpoint without input scales do (to measure that cost).
  bool dynamic_input_scales = false;
  // CreateRandom only, FP8 at tp 1: every layer's weight scaled as this scheme says (all its
  // scales equal) and its input quantized per row / 1x128 group for every batch, as the layers
  // of a per-channel or block-wise checkpoint are (to measure what the scheme costs).
  GemmScaleScheme scale_scheme = GemmScaleScheme::kPerTensor;
  // CreateRandom only: o's and down's weights (the layers that write into the residual stream)
  // scaled by this gain. With gain 1 (Llama's init everywhere) an 80-block random model is
  // chaotic: two correct schedules, rounding differently, give unrelated logits. A small gain
  // keeps every block a small step on the residual stream, so rounding differences stay small
  // while a wrong sum in any layer still moves the logits (for logits checks between schedules).
  float residual_gain = 1.0f;
  // Generation (Step): a paged KV cache of kv_blocks blocks of kv_block_size tokens, this
  // rank's KV heads, allocated at Create. 0 blocks: no cache, Step answers
  // FAILED_PRECONDITION.
  int64_t kv_blocks = 0;
  int64_t kv_block_size = 16;
  KvCacheDtype kv_dtype = KvCacheDtype::kBFloat16;
  // How every GEMM (the TP layers' and the LM head's) chooses its cuBLASLt algorithm, and how
  // the pass's graphs prioritise their kernels (comm/cuda_resources.h): per node keeps the
  // layers' comm streams ahead of their GEMMs, as eagerly.
  GemmAlgoSelection gemm_algo = GemmAlgoSelection::kTimed;
  CudaGraphExec::Priority graph_priority = CudaGraphExec::Priority::kPerNode;
  // At tp 1 with per-tensor FP8 scales (or BF16 weights), o and down add their products into
  // the residual stream in their GEMMs' epilogue (CudaLinearShape::accumulate: x = bf16(x +
  // product), the sum in FP32), so that the add & norm after each reads x alone instead of x
  // and a separate product. false: they write a buffer of their own and the norm adds it
  // (x = bf16(x + bf16(product)), the CPU reference's rounding), as at tp > 1, where a
  // ReduceScatter's output cannot add into x.
  bool residual_in_gemm = true;
  // Prefill passes (Forward) run attention in E4M3 (engine/attention_fp8.h): Q quantized with
  // scale 1, K and V with the layer's KV cache scales (LayerWeights::kv_scales, 1 unless the
  // checkpoint gives them), as the E4M3 KV cache stores them (values saturate at 448 x scale), and
  // the probabilities rounded to E4M3 for P V. Hopper and head_dim 128 only (Create fails
  // UNIMPLEMENTED elsewhere). Generation's prefill chunks attend over the paged cache as before.
  bool fp8_attention = false;
  // The decode step's fusions, each on by default; off only to measure what one is worth
  // (tpserve-bench-decode --unfused). Off or on, a step's results are the same (bit for bit but
  // for cluster_merge, which changes the rounding of the splits' merge).
  struct DecodeFusions {
    // Pure decode steps of at most 8 rows rotate q and store the step's keys and values inside
    // the attention kernel (PagedAttentionParams::rope); off, and at more rows (where every
    // CTA's own angles cost more than the kernel they save): the RoPE kernel does both.
    bool rope_in_attention = true;
    // FP8 with a static input scale for o: paged attention writes o's E4M3 input itself
    // (PagedAttentionParams::out_fp8); off: it writes BF16, then a quantize pass.
    bool attention_out_fp8 = true;
    // The decode kernel's splits merge in a thread-block cluster
    // (PagedAttentionParams::cluster_merge); off (the default: the combine pass was faster at
    // batch 1 and 8, benchmarks/PERFORMANCE.md): the combine pass.
    bool cluster_merge = false;
    // PagedAttentionParams::context_constant: the decode kernel loads metadata and earlier keys
    // before its PDL wait; off: after it.
    bool early_loads = true;
    // FP8 at tp 1 with static per-tensor input scales, a step whose gate_up runs on the small-M
    // kernel (at most 8 rows): SwiGLU in that GEMM's epilogue (CudaLinear::RunSwiGlu), writing
    // down's E4M3 input; off: the GEMM writes BF16, then the SwiGLU pass.
    bool swiglu_in_gemm = true;
  };
  DecodeFusions decode_fusions;
};

class CudaModel {
 public:
  // Uploads this rank's weights to the communicator's device and allocates
  // the activation buffers for options.max_tokens. `overlap` may be null
  // (every layer mode none) and must outlive the model. UNIMPLEMENTED for a
  // head_dim the attention kernel lacks (64 and 128 exist).
  static StatusOr<std::unique_ptr<CudaModel>> Create(const ModelConfig& config,
                                                     const RankWeights& weights,
                                                     const OverlapConfig* overlap,
                                                     NcclCommPool& pool,
                                                     const CudaModelOptions& options = {});
  // The same model with random weights generated on the device (seconds,
  // also for llama3-70b shapes, where host-side generation and upload would
  // take minutes): norms 1, weights ~ U(-0.035, 0.035) (std 0.02), FP8 input
  // scales 8/448. Not the weights MakeRandomRankWeights draws: for benchmarks
  // and load tests, not for comparisons with the CPU model.
  static StatusOr<std::unique_ptr<CudaModel>> CreateRandom(const ModelConfig& config,
                                                           DataType dtype, uint64_t seed,
                                                           const OverlapConfig* overlap,
                                                           NcclCommPool& pool,
                                                           const CudaModelOptions& options = {});
  ~CudaModel();

  // Orderly teardown, collective: destroys the graphs, then CudaLinear::Close
  // on every layer (unmap the peers' buffers, barrier, free). Call on every
  // rank before destruction when all ranks are alive; Forward answers
  // FAILED_PRECONDITION afterwards. Returns the first error; closes all.
  Status Close();

  // Logits [sequences, vocab] of the last token of every sequence, on every
  // rank: the LM head GEMM's FP32 results as they are (never rounded to BF16).
  // INVALID_ARGUMENT for a batch over the options' limits.
  StatusOr<std::vector<float>> Forward(const TokenBatch& batch);
  // Forward without a copy: the logits stay in this model's pinned host buffer, which the
  // pass's download writes at the link's speed; the view is valid until the next Forward,
  // ForwardView, Run, Step or Close. The batch goes up from pinned memory too, and the
  // pass's end is signalled (NcclCommunicator::WaitStream): after warm-up a pass allocates
  // nothing.
  StatusOr<std::span<const float>> ForwardView(const TokenBatch& batch);
  // The pass without downloading logits: what a rank whose logits nobody reads runs (the
  // CUDA engine's workers). Collective with the other ranks' Forward/ForwardView.
  Status Run(const TokenBatch& batch);

  // One generation step (engine/step_batch.h), engine/cuda_generation.cc: the blocks as in
  // Forward, but each layer's RoPE launch also writes the step's keys and values into the
  // paged KV cache (RopeParams::kv_store) and the layer attends over it (LaunchPagedAttention);
  // then the final norm, the LM head on the last row of each sequence marked `sample`, and
  // sampling on the device (LaunchSampling). Returns the sampled tokens, in sequence order, on
  // every rank. The step's inputs and sampling parameters go up in one copy from pinned memory; no
  // device memory is allocated. The token count is padded to a step bucket (powers of two up to
  // max_seqs, then the token buckets); a pure decode step (one token per sequence) replays a graph
  // captured per (bucket, sequence slots), other steps run eagerly.
  // INVALID_ARGUMENT (nothing computed) for a step that ValidateStepBatch refuses or that
  // is over the options' limits; FAILED_PRECONDITION without a KV cache. Collective.
  StatusOr<StepResult> Step(const StepBatch& step);
  // This rank's KV cache (num_blocks 0: none).
  const KvCacheLayout& kv_layout() const { return kv_layout_; }

  // Where one eager pass of `batch` spends its time on this rank: each
  // stage's total over all blocks in milliseconds, between CUDA events on the
  // model's stream (a TP layer's side streams and copy engines join it before
  // the layer returns), in the order the stages first run: embedding, norm
  // (add & norm, and the quantization of its output), qkv, rope, attention,
  // o, gate_up, swiglu, down, head (final norm, row gather, LM head, logits
  // gather). Eager, not the graph: a stage's time includes its launch gaps,
  // and a collective's includes waiting for the slowest rank. The logits are
  // not returned. Collective: all ranks call it with the same batch.
  // `block_ms` (optional): the same pass per transformer block, in order (its stages from
  // the first add & norm to down), to see whether blocks slow down along a long pass.
  StatusOr<std::vector<std::pair<std::string, double>>> ProfileStages(
      const TokenBatch& batch, std::vector<double>* block_ms = nullptr);

  // ProfileStages for one generation step, run eagerly (not its graph): the same stages,
  // attention being the paged KV write and paged attention, and head including sampling.
  // The step's keys and values are written into the cache as Step would. Collective.
  StatusOr<std::vector<std::pair<std::string, double>>> ProfileStep(const StepBatch& step);

  // Runs one batch per (bucket, sequence slots) that requests can reach
  // (eager, then capture): every graph exists before the first request, so
  // no request pays for planning or capture. Collective.
  Status WarmUp();

  const std::vector<int64_t>& buckets() const { return buckets_; }

  // With options.time_passes, the last Forward's (or Step's) pass on the GPU, in milliseconds: from
  // an event recorded just before its graph launch (or its eager enqueue) to one just after, on the
  // model's stream — the graph's execution and launch latency, without the batch upload, the logits
  // download or the host's own time (NaN if the events could not be read; 0 without time_passes).
  // For benchmarks separating the two.
  double last_pass_ms() const { return last_pass_ms_; }
  // With options.time_passes, the last Forward's copies behind its pass on the GPU (error flag
  // and logits to the host), in milliseconds (NaN if unreadable; 0 without time_passes).
  double last_copy_ms() const { return last_copy_ms_; }

  // Switches every layer's overlap settings (may be null: mode none; must
  // outlive the model). Graphs are kept per (settings, bucket), so switching
  // back and forth captures each once. For benchmarks comparing
  // configurations on one set of weights. Collective (all ranks alike); not
  // while a Forward runs.
  void SetOverlap(const OverlapConfig* overlap);

  const ModelConfig& config() const { return config_; }
  // Device memory held (weights, activations, TP layers).
  size_t device_bytes() const;
  // The FP8 scale scheme of the first block's layers (a checkpoint's, or the random weights').
  GemmScaleScheme scale_scheme() const;

  struct Linear;  // one TP layer's weights on the device
  struct Layer;   // one block's weights on the device

 private:
  CudaModel() = default;
  // Validates the batch against the options, pads it to its bucket and
  // uploads ids, positions and sequence boundaries on stream_: {bucket m,
  // sequence slots}.
  StatusOr<std::pair<int64_t, int64_t>> UploadBatch(const TokenBatch& batch);
  // upload_host_'s parts (its one layout): ids [max_m], positions [max_m], cu_seqlens
  // [max_seqs + 2], the error flag read back [1].
  struct HostUpload {
    int32_t *ids, *positions, *cu_seqlens, *error_flag;
  };
  HostUpload host_upload() const;
  // Forward, Run and ForwardView: the pass, and with `download` the logits into
  // logits_host_ ([sequences, vocab] of them in the returned view; empty without).
  StatusOr<std::span<const float>> Pass(const TokenBatch& batch, bool download);
  // Validates, and sets up everything but the weights and activations.
  static StatusOr<std::unique_ptr<CudaModel>> NewShell(const ModelConfig& config, DataType dtype,
                                                       const OverlapConfig* overlap,
                                                       NcclCommPool& pool,
                                                       const CudaModelOptions& options,
                                                       int64_t row_multiple = 1);
  Status AllocateActivations();
  // Generation's buffers (KV pool, step upload, sampling), for options_.kv_blocks > 0.
  Status AllocateGeneration();
  // Where the layer's keys and values of a step go in the cache while stepping_ (qkv: the
  // QKV output, K rotated by then): the RoPE launch stores them (RopeParams::kv_store), or the
  // attention launch that rotates (PagedAttentionParams::rope).
  PagedKvWriteParams KvStore(int64_t layer, int64_t m, BFloat16* qkv) const;
  // The paged attention launch of layer `layer` while stepping_ over the QKV output `qkv`,
  // without its outputs, workspace aside.
  PagedAttentionParams PagedParams(int64_t layer, int64_t m, int64_t seq_slots,
                                   BFloat16* qkv) const;
  // Enqueue's attention while stepping_, after KvStore's rows are in the cache (or with `rope`,
  // which PagedAttentionTakesRope(PagedParams(...)) allows, rotating and storing them itself):
  // paged attention of its queries into `out` (BF16 [m, heads/tp x head_dim]) and/or `out_fp8`
  // (its E4M3 codes over *out_fp8_scale, PagedAttentionParams::out_fp8), and with `amax`
  // (needs out) the output's absolute maximum into *amax (dynamic FP8 input scales).
  Status EnqueuePagedAttention(int64_t layer, int64_t m, int64_t seq_slots, BFloat16* qkv,
                               BFloat16* out, float* amax, uint8_t* out_fp8,
                               const float* out_fp8_scale, const RopeParams* rope);
  // Enqueue's head while stepping_, after the logits' AllGather: a token for each slot,
  // sampled from its FP32 logits (logits_all_ itself at tp 1; the ranks' vocabulary slices
  // interleaved into one row per slot first otherwise).
  Status EnqueueSampling(int64_t seq_slots);
  size_t GenerationBytes() const;  // device memory of gen_ (0 without)
  // Step's halves: validates the step and uploads it (one copy from pinned memory) on
  // stream_; waits for the stream and reads the sampled tokens.
  struct StepShape {
    int64_t m = 0, seq_slots = 0, sampled = 0, query_rows = 0;
  };
  StatusOr<StepShape> UploadStep(const StepBatch& step);
  StatusOr<StepResult> DownloadStep(int64_t sampled);
  // ProfileStages' events (a null name at the start, then each stage's end) as stage totals
  // in first-run order, and optionally per block.
  static StatusOr<std::vector<std::pair<std::string, double>>> StagesFromMarks(
      const std::vector<std::pair<const char*, CudaEvent>>& marks, std::vector<double>* block_ms);
  Status SetScales(Linear* out, float input_scale, float weight_scale, const std::string& name);
  // A per-channel or block-wise FP8 weight's scales as the GEMM reads them (Linear::w_scales),
  // at tp 1; INVALID_ARGUMENT naming the layer for a block-wise shape the GEMM cannot take.
  Status SetFineScales(Linear* out, const LinearWeight& lw, const std::string& name);
  // The TP layer `s` of block `block` at bucket `m` (its overlap knobs
  // resolved by name), made on first use and prepared for m.
  StatusOr<CudaLinear*> LayerFor(const TpLayerShape& s, int64_t block, int64_t m);
  // The block's four TP layers at bucket m, in TpLayerShape::index order.
  StatusOr<std::array<CudaLinear*, 4>> BlockLayers(int64_t block, int64_t m);
  // A layer whose knobs say full_weight reads the whole weight [n, tp * k]: gathered once from
  // the ranks' shards (collective: every rank calls it for the same layers in the same order,
  // as PrepareBucket does). FAILED_PRECONDITION when the ranks' scales differ (one GEMM over
  // every rank's columns needs one input and one weight scale).
  Status GatherWholeWeight(Linear& w, const std::string& name);
  // `split` (row-parallel layers): CudaLinear::RunSplit, the output left in two addends
  // where the layer's plan allows it.
  Status RunLinear(CudaLinear& layer, const Linear& w, int64_t m, void* y,
                   CudaLinear::SplitOutput* split = nullptr);
  // Plans what bucket m needs (layers, GEMMs); allocates on first use.
  Status PrepareBucket(int64_t m, int64_t seq_slots);
  // Enqueues the forward pass of bucket m on stream_: no allocation, no
  // synchronisation (what a graph captures), with seq_slots sequence slots
  // (empty ones past the batch's). PrepareBucket(m, seq_slots) first.
  // Blocks [first_block, end_block) only (a negative end_block: to the last), the
  // embedding with block 0 and the head with the last: a segment continues
  // from the one before it, which must have been enqueued (or captured) first.
  Status Enqueue(int64_t m, int64_t seq_slots, int64_t first_block = 0, int64_t end_block = -1);
  // Enqueue's parts. Mark: while ProfileStages runs, an event at the end of `stage` (null: the
  // start). QuantizeInput: a TP layer's FP8 input from BF16 [rows, cols] at `src`, quantized
  // with the layer's x_scale (which its GEMM reads); a dynamic layer first sets x_scale from this
  // batch: the amax of `src`, which its producer (RMSNorm, attention, SwiGLU) left in amax_[0],
  // the largest over all ranks' parts (the whole input's, and one scale for a gathered operand);
  // a fine layer's scales are computed per row / 1x128 group into a_scales_.
  // AddNorm: add & norm of the stream x_ and `residual` (possibly two addends) into `next`'s
  // input, FP8 with its input scale (static, or from this batch via BF16 in normed_) or BF16.
  // EnqueueBlock: block l; `pending` is the previous block's output still to be added, and
  // becomes this block's. EnqueueHead: the final add & norm, then the LM head on each
  // sequence's last row (and sampling while stepping_).
  Status Mark(const char* stage);
  // Whether o and down add into x themselves (CudaModelOptions::residual_in_gemm): at tp 1
  // with per-tensor scales (cuBLASLt adds into C only with those), known once the weights are.
  bool ResidualInGemm() const { return tp_ == 1 && options_.residual_in_gemm && !fine_inputs_; }
  Status QuantizeInput(const BFloat16* src, int64_t rows, int64_t cols, const Linear& w, void* out);
  Status AddNorm(const CudaLinear::SplitOutput& residual, const DeviceBuffer& weight,
                 CudaLinear& next, const Linear& next_w, int64_t m, int64_t rows);
  Status EnqueueBlock(int64_t l, int64_t m, int64_t seq_slots, int64_t rows,
                      CudaLinear::SplitOutput& pending);
  Status EnqueueHead(int64_t m, int64_t seq_slots, int64_t rows,
                     const CudaLinear::SplitOutput& pending);
  // The segments a bucket's pass is captured in: [begin, end) block ranges.
  std::vector<std::pair<int64_t, int64_t>> GraphSegments() const;

  ModelConfig config_;
  CudaModelOptions options_;
  const OverlapConfig* overlap_ = nullptr;
  NcclCommPool* pool_ = nullptr;
  int tp_ = 1, rank_ = 0;
  DataType dtype_ = DataType::kFloat8E4M3;
  int64_t max_m_ = 0;
  std::vector<int64_t> buckets_;

  CudaStream stream_;
  // Around each Forward's graph launch (or eager pass) on stream_: last_pass_ms_.
  CudaEvent pass_start_, pass_end_, copy_end_;
  double last_pass_ms_ = 0, last_copy_ms_ = 0;
  // Enqueue's block output still to be added to the residual stream, carried from one
  // segment to the next.
  CudaLinear::SplitOutput pending_;
  std::vector<Layer> layers_;
  DeviceBuffer embed_, final_norm_, lm_head_;
  // RoPE's inverse frequencies (RopeInverseFrequencies: plain or scaled), FP64 [head_dim/2],
  // uploaded once at creation; every RoPE launch (Forward and Step) reads it.
  DeviceBuffer rope_inv_freq_;
  // Batch metadata and activations.
  DeviceBuffer ids_, positions_, cu_seqlens_, error_flag_;
  // AttentionParams::work_counter of the prefill attention launches (zeroed once; each
  // launch leaves it zero), one at a time on the model's stream.
  DeviceBuffer attn_counter_;
  // The pass's host side, pinned: the batch going up and the error flag coming back in
  // upload_host_ (host_upload()); the logits in logits_host_ (FP32 [max_seqs + 1, vocab]).
  PinnedHostBuffer upload_host_, logits_host_;
  // tp > 1: FP32 [max_seqs + 1, vocab], the ranks' slices of logits_all_ as whole rows, the
  // source of one contiguous download.
  DeviceBuffer logits_rows_;
  // The LM head's FP32 logits of a pass with seq_slots slots: this rank's [seq_slots,
  // vocab / tp] in logits_local_, every rank's gathered [tp, seq_slots, vocab / tp] in
  // logits_all_ (each sized for max_seqs + 1 slots).
  DeviceBuffer x_, o_out_, down_out_, normed_, qkv_out_, gate_up_out_, full_, last_, logits_local_,
      logits_all_;
  CublasLtGemm lm_gemm_;
  // Layers with dynamic FP8 input scales, and what they need (allocated
  // only then): amaxes [4 + tp] floats, attention's BF16 output
  // [max_m, heads/tp x head_dim], SwiGLU's BF16 output [max_m, I/tp].
  bool dynamic_inputs_ = false;
  DeviceBuffer amax_, attn_, act_;
  // CudaModelOptions::fp8_attention: the E4M3 inputs of attention (views into fp8_attn_buf_,
  // for max_m tokens in max_seqs + 1 sequences); `scales` points at layer 0's three, each
  // layer's at 3 * layer.
  DeviceBuffer fp8_attn_buf_;
  Fp8AttentionInputs fp8_attn_;
  // Layers with per-channel or block-wise weights (Linear::fine): their inputs' scales, one
  // float per row or per 1x128 group of the largest input ([max_m x k_max / 128]).
  bool fine_inputs_ = false;
  DeviceBuffer a_scales_;
  // Token and step buckets are multiples of this: tp, and 4 with block-wise layers (cuBLASLt's
  // blockwise GEMM takes m % 4 == 0 only).
  int64_t bucket_multiple_ = 1;
  std::map<std::string, std::unique_ptr<CudaLinear>> linears_;  // by op/shape/knobs
  // Set by ProfileStages for one eager Enqueue: an event recorded at its
  // start (null name) and at the end of every stage (the stage's name).
  std::vector<std::pair<const char*, CudaEvent>>* stage_marks_ = nullptr;
  size_t weight_bytes_ = 0;
  // Generation (engine/cuda_generation.cc). While stepping_, Enqueue runs a step: it reads
  // ids, positions and the LM head's row selection from the step's upload (step_ids_ ...,
  // views into gen_'s buffer), attends over the paged cache and samples.
  struct Generation;
  struct GenerationDeleter {
    void operator()(Generation* g) const noexcept;
  };
  std::unique_ptr<Generation, GenerationDeleter> gen_;
  KvCacheLayout kv_layout_;  // num_blocks 0: no cache
  bool stepping_ = false;
  const int32_t *step_ids_ = nullptr, *step_positions_ = nullptr, *step_head_cu_ = nullptr;
  // Last members: destroyed first, before the layers and buffers they use.
  using GraphKey = std::tuple<const OverlapConfig*, int64_t, int64_t>;  // settings, bucket, slots
  std::map<GraphKey, std::vector<CudaGraphExec>> graphs_;               // one per segment
  std::map<GraphKey, CudaGraphExec> step_graphs_;                       // pure decode steps
  std::set<GraphKey> eager_steps_;     // pure decode steps whose capture failed: run eagerly
  int injected_capture_failures_ = 0;  // CudaModelOptions::injected_capture_failures left
};

// Runs CudaModel::Forward on `group`'s GPUs (ranks as threads) with random
// weights from `seed` (as RunCpuModel does, so the two are comparable), or
// with each rank's shard loaded from `checkpoint_dir` (LoadRankWeights, as
// `tpserve serve` loads it: `dtype` is the TP layers' weight type the stored
// tensors are converted to) when it is non-empty; returns rank 0's logits. `gemm_algo`: as
// CudaModelOptions's.
class NcclThreadGroup;
StatusOr<std::vector<float>> RunCudaModel(const ModelConfig& config, NcclThreadGroup& group,
                                          DataType dtype, uint64_t seed,
                                          const OverlapConfig* overlap, const TokenBatch& batch,
                                          const std::string& checkpoint_dir = "",
                                          GemmAlgoSelection gemm_algo = GemmAlgoSelection::kTimed);

}  // namespace tpserve
