#include "engine/cuda_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string_view>
#include <utility>

#include "comm/cuda_check.h"
#include "comm/nccl_thread_group.h"
#include "engine/cuda_model_internal.h"
#include "engine/cuda_ops.h"
#include "engine/gather_rows.h"
#include "engine/token_buckets.h"
#include "engine/tp_layers.h"
#include "layers/quantize_kernels.h"
#include "layers/random_fill.h"

namespace tpserve {

namespace {

StatusOr<DeviceBuffer> UploadBf16(const std::vector<float>& v, const std::string& name) {
  std::vector<BFloat16> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = FloatToBFloat16(v[i]);
  TP_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::Allocate(h.size() * 2, name));
  TP_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

StatusOr<DeviceBuffer> Alloc(int64_t bytes, const std::string& name) {
  return DeviceBuffer::Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 16)), name);
}

}  // namespace

CudaModel::~CudaModel() = default;

Status CudaModel::Close() {
  graphs_.clear();  // they captured the layers' transfers
  step_graphs_.clear();
  Status first;
  for (auto& [key, layer] : linears_) {  // map order: the same on every rank
    Status s = layer->Close();
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}

StatusOr<std::unique_ptr<CudaModel>> CudaModel::NewShell(const ModelConfig& config, DataType dtype,
                                                         const OverlapConfig* overlap,
                                                         NcclCommPool& pool,
                                                         const CudaModelOptions& options,
                                                         int64_t row_multiple) {
  NcclCommunicator& comm = pool.base();
  const int tp = comm.size(), rank = comm.rank();
  TP_RETURN_IF_ERROR(config.ValidateForTp(tp));
  const int64_t hd = config.head_dim();
  if (hd != 64 && hd != 128) {
    return UnimplementedError(
        "the CUDA attention kernel supports head_dim 64 and 128; the model has " +
        std::to_string(hd));
  }
  if (dtype != DataType::kFloat8E4M3 && dtype != DataType::kBFloat16) {
    return InvalidArgumentError("weights must be fp8_e4m3 or bf16, got " +
                                std::string(DataTypeName(dtype)));
  }
  if (options.max_tokens < 1 || options.max_seqs < 1) {
    return InvalidArgumentError("max_tokens and max_seqs must be >= 1");
  }
  if (options.graph_blocks < 0) {
    return InvalidArgumentError("CudaModelOptions.graph_blocks (" +
                                std::to_string(options.graph_blocks) + ") must be >= 0");
  }
  TP_CUDA_CHECK(cudaSetDevice(comm.device()));
  auto model = std::unique_ptr<CudaModel>(new CudaModel());
  CudaModel& md = *model;
  md.config_ = config;
  md.options_ = options;
  md.injected_capture_failures_ = options.injected_capture_failures;
  md.overlap_ = overlap;
  md.pool_ = &pool;
  md.tp_ = tp;
  md.rank_ = rank;
  md.dtype_ = dtype;
  md.bucket_multiple_ = std::lcm<int64_t>(tp, row_multiple);
  TP_ASSIGN_OR_RETURN(
      md.buckets_,
      MakeTokenBuckets(options.max_tokens, static_cast<int>(md.bucket_multiple_), options.buckets));
  md.max_m_ = md.buckets_.back();
  TP_ASSIGN_OR_RETURN(md.stream_, CudaStream::Create());
  TP_ASSIGN_OR_RETURN(md.pass_start_, CudaEvent::Create(/*enable_timing=*/true));
  TP_ASSIGN_OR_RETURN(md.pass_end_, CudaEvent::Create(/*enable_timing=*/true));
  TP_ASSIGN_OR_RETURN(md.copy_end_, CudaEvent::Create(/*enable_timing=*/true));
  md.layers_.resize(config.num_hidden_layers);
  const std::vector<double> inv_freq = RopeInverseFrequencies(config);
  TP_ASSIGN_OR_RETURN(md.rope_inv_freq_,
                      DeviceBuffer::Allocate(inv_freq.size() * sizeof(double), "rope_inv_freq"));
  TP_CUDA_CHECK(cudaMemcpy(md.rope_inv_freq_.data(), inv_freq.data(),
                           inv_freq.size() * sizeof(double), cudaMemcpyHostToDevice));
  return model;
}

Status CudaModel::AllocateActivations() {
  const ModelConfig& c = config_;
  const int64_t h = c.hidden_size, m = max_m_, rows = m / tp_;
  const int64_t seqs = options_.max_seqs + 1;  // + the padding sequence
  const auto shapes = TpLayerShapes(c);
  const int64_t qkv_n = shapes[0].local_n(tp_);   // this rank's fused q|k|v columns
  const int64_t attn_n = shapes[1].local_k(tp_);  // this rank's heads x head_dim
  const int64_t inter_l = c.intermediate_size / tp_;
  const int64_t vocab_l = c.vocab_size / tp_;
  TP_ASSIGN_OR_RETURN(ids_, Alloc(m * 4, "ids"));
  TP_ASSIGN_OR_RETURN(positions_, Alloc(m * 4, "positions"));
  TP_ASSIGN_OR_RETURN(cu_seqlens_, Alloc((seqs + 1) * 4, "cu_seqlens"));
  TP_ASSIGN_OR_RETURN(error_flag_, Alloc(4, "error_flag"));
  TP_ASSIGN_OR_RETURN(attn_counter_, Alloc(8, "attention_work_counter"));
  TP_CUDA_CHECK(cudaMemset(attn_counter_.data(), 0, attn_counter_.size()));
  TP_ASSIGN_OR_RETURN(x_, Alloc(rows * h * 2, "residual"));
  if (!ResidualInGemm()) {  // else o and down write into x_
    TP_ASSIGN_OR_RETURN(o_out_, Alloc(rows * h * 2, "o_out"));
    TP_ASSIGN_OR_RETURN(down_out_, Alloc(rows * h * 2, "down_out"));
  }
  TP_ASSIGN_OR_RETURN(normed_, Alloc(rows * h * 2, "normed"));
  TP_ASSIGN_OR_RETURN(qkv_out_, Alloc(m * qkv_n * 2, "qkv_out"));
  TP_ASSIGN_OR_RETURN(gate_up_out_, Alloc(m * 2 * inter_l * 2, "gate_up_out"));
  TP_ASSIGN_OR_RETURN(full_, Alloc(m * h * 2, "full_normed"));
  TP_ASSIGN_OR_RETURN(last_, Alloc(seqs * h * 2, "last_rows"));
  // FP32 logits (the LM head's GEMM accumulates in FP32 and writes that, unrounded). At
  // tp 1 the GEMM writes logits_all_ itself: no local buffer, no gather.
  if (tp_ > 1) {
    TP_ASSIGN_OR_RETURN(logits_local_, Alloc(seqs * vocab_l * 4, "logits_local"));
  }
  TP_ASSIGN_OR_RETURN(logits_all_, Alloc(tp_ * seqs * vocab_l * 4, "logits_all"));
  // host_upload()'s parts: ids and positions [m], cu_seqlens [seqs + 1], the error flag.
  TP_ASSIGN_OR_RETURN(upload_host_,
                      PinnedHostBuffer::Allocate((2 * m + seqs + 2) * 4, "batch_upload"));
  TP_ASSIGN_OR_RETURN(logits_host_,
                      PinnedHostBuffer::Allocate(seqs * c.vocab_size * 4, "logits_host"));
  if (tp_ > 1) {
    TP_ASSIGN_OR_RETURN(logits_rows_, Alloc(seqs * c.vocab_size * 4, "logits_rows"));
  }
  TP_ASSIGN_OR_RETURN(lm_gemm_, CublasLtGemm::Create("lm_head", options_.gemm_algo));
  if (fine_inputs_) {
    const int64_t groups = (std::max({h, attn_n, inter_l}) + kGemmScaleBlock - 1) / kGemmScaleBlock;
    TP_ASSIGN_OR_RETURN(a_scales_, Alloc(m * groups * 4, "input_scales"));
  }
  if (dynamic_inputs_ || fine_inputs_ || options_.kv_blocks > 0) {
    // Dynamic input scales: this rank's amax at [0], every rank's at [4..),
    // and the BF16 outputs of attention and SwiGLU staged for o's and down's
    // quantization (static scales quantize in those kernels; paged attention does too unless
    // CudaModelOptions::decode_fusions turns its out_fp8 off).
    TP_ASSIGN_OR_RETURN(amax_, Alloc((4 + tp_) * 4, "input_amax"));
    TP_ASSIGN_OR_RETURN(attn_, Alloc(m * attn_n * 2, "attn"));
    TP_ASSIGN_OR_RETURN(act_, Alloc(m * inter_l * 2, "swiglu_out"));
  }
  if (options_.fp8_attention) {
    const int64_t hd = c.head_dim(), kv_n = c.num_key_value_heads / tp_ * hd;
    if (!Fp8AttentionSupports(hd)) {
      return UnimplementedError(
          "CudaModelOptions::fp8_attention: E4M3 attention needs an sm_90a build, a compute "
          "capability 9.0 GPU and head_dim 128 (this model's head_dim: " +
          std::to_string(hd) + ")");
    }
    // [scales | q | k | vt], each part 256-byte aligned. Scales: a layer's q, k and v at
    // 3 * layer: q's 1, k's and v's the layer's KV cache scales, so that the codes are those
    // the E4M3 cache would hold.
    auto round = [](int64_t b) { return (b + 255) / 256 * 256; };
    const int64_t cols = Fp8AttentionVtColumns(m, seqs);
    const int64_t q_bytes = round(m * attn_n), k_bytes = round(m * kv_n);
    std::vector<float> scales;
    for (const Layer& l : layers_)
      scales.insert(scales.end(), {1.0f, l.kv_scales.k, l.kv_scales.v});
    const int64_t s_bytes = round(std::max<int64_t>(1, static_cast<int64_t>(scales.size())) * 4);
    TP_ASSIGN_OR_RETURN(fp8_attn_buf_,
                        Alloc(s_bytes + q_bytes + k_bytes + kv_n * cols, "fp8_attention_inputs"));
    auto* base = fp8_attn_buf_.as<uint8_t>();
    TP_CUDA_CHECK(cudaMemcpy(base, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
    fp8_attn_.scales = reinterpret_cast<const float*>(base);
    fp8_attn_.q = base + s_bytes;
    fp8_attn_.k = base + s_bytes + q_bytes;
    fp8_attn_.vt = base + s_bytes + q_bytes + k_bytes;
    fp8_attn_.vt_columns = cols;
  }
  if (options_.kv_blocks > 0) TP_RETURN_IF_ERROR(AllocateGeneration());
  // The memset and uploads above ran on the legacy stream (a pageable cudaMemcpy may return
  // before its DMA lands), and the model's streams are non-blocking: wait for them here.
  TP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  spdlog::info("CudaModel rank {}/{}: {} layers, {:.1f} MiB of weights on device {}", rank_, tp_,
               layers_.size(), weight_bytes_ / 1048576.0, pool_->base().device());
  return Status::Ok();
}

StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const ModelConfig& config,
                                                       const RankWeights& weights,
                                                       const OverlapConfig* overlap,
                                                       NcclCommPool& pool,
                                                       const CudaModelOptions& options) {
  const int tp = pool.base().size();
  // Sizes and types against the config, before anything is uploaded.
  TP_RETURN_IF_ERROR(ValidateRankWeights(config, weights, tp, pool.base().rank()));
  // Per-channel and block-wise weights run as they are (CudaLinearShape::scale_scheme), their
  // inputs quantized per token or per 1x128 group.
  auto native = [&](const LinearWeight& w) {
    return w.dtype == DataType::kFloat8E4M3 && w.scheme != Fp8Scheme::kPerTensor;
  };
  bool any_block = false;
  for (const LayerWeights& lw : weights.layers) {
    for (const LinearWeight* w : {&lw.qkv, &lw.o, &lw.gate_up, &lw.down}) {
      any_block = any_block || (native(*w) && w->scheme == Fp8Scheme::kBlock);
    }
  }
  // Block-wise: cuBLASLt's m % 4 for every rank's shard of a bucket.
  TP_ASSIGN_OR_RETURN(
      auto model, NewShell(config, weights.dtype, overlap, pool, options, any_block ? 4 * tp : 1));
  CudaModel& md = *model;
  auto upload_linear = [&](const LinearWeight& lw, const std::string& name, Linear* out) -> Status {
    if (lw.dtype != weights.dtype) {
      return InvalidArgumentError(name + ": mixed weight types are not supported");
    }
    out->n = lw.n;
    out->k = lw.k;
    TP_ASSIGN_OR_RETURN(out->w, Alloc(static_cast<int64_t>(lw.data.size()), name + ".weight"));
    TP_CUDA_CHECK(
        cudaMemcpy(out->w.data(), lw.data.data(), lw.data.size(), cudaMemcpyHostToDevice));
    TP_RETURN_IF_ERROR(md.SetScales(out, lw.input_scale, lw.weight_scale, name));
    if (native(lw)) {
      TP_RETURN_IF_ERROR(md.SetFineScales(out, lw, name));
    } else {
      out->dynamic = lw.dtype == DataType::kFloat8E4M3 && lw.dynamic_input;
    }
    md.dynamic_inputs_ = md.dynamic_inputs_ || out->dynamic;
    md.fine_inputs_ = md.fine_inputs_ || out->fine();
    md.weight_bytes_ += lw.data.size();
    return Status::Ok();
  };
  TP_ASSIGN_OR_RETURN(md.embed_, UploadBf16(weights.embed, "embed"));
  TP_ASSIGN_OR_RETURN(md.final_norm_, UploadBf16(weights.final_norm, "final_norm"));
  if (weights.lm_head.dtype != DataType::kBFloat16 || weights.lm_head.n != config.vocab_size / tp) {
    return InvalidArgumentError("lm_head must be BF16 [vocab / tp, hidden]");
  }
  TP_ASSIGN_OR_RETURN(md.lm_head_,
                      Alloc(static_cast<int64_t>(weights.lm_head.data.size()), "lm_head"));
  TP_CUDA_CHECK(cudaMemcpy(md.lm_head_.data(), weights.lm_head.data.data(),
                           weights.lm_head.data.size(), cudaMemcpyHostToDevice));
  md.weight_bytes_ += md.embed_.size() + weights.lm_head.data.size();
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    const LayerWeights& lw = weights.layers[l];
    Layer& dl = md.layers_[l];
    const std::string p = "layers." + std::to_string(l);
    TP_ASSIGN_OR_RETURN(dl.input_norm, UploadBf16(lw.input_norm, p + ".input_norm"));
    TP_ASSIGN_OR_RETURN(dl.post_norm, UploadBf16(lw.post_norm, p + ".post_norm"));
    dl.kv_scales = lw.kv_scales;
    TP_RETURN_IF_ERROR(upload_linear(lw.qkv, p + ".attn.qkv", &dl.qkv));
    TP_RETURN_IF_ERROR(upload_linear(lw.o, p + ".attn.o", &dl.o));
    TP_RETURN_IF_ERROR(upload_linear(lw.gate_up, p + ".mlp.gate_up", &dl.gate_up));
    TP_RETURN_IF_ERROR(upload_linear(lw.down, p + ".mlp.down", &dl.down));
  }
  // The uploads are cudaMemcpy calls from pageable memory, which may return
  // before their DMA lands; the model's streams are non-blocking, so wait for
  // them here (they ran on the legacy stream).
  TP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  TP_RETURN_IF_ERROR(md.AllocateActivations());
  return model;
}

Status CudaModel::SetScales(Linear* out, float input_scale, float weight_scale,
                            const std::string& name) {
  TP_ASSIGN_OR_RETURN(out->scales, DeviceBuffer::Allocate(8 * sizeof(float), name + ".scales"));
  const float s[8] = {input_scale, 0, 0, 0, weight_scale, 0, 0, 0};
  TP_CUDA_CHECK(cudaMemcpy(out->scales.data(), s, sizeof s, cudaMemcpyHostToDevice));
  return Status::Ok();
}

Status CudaModel::SetFineScales(Linear* out, const LinearWeight& lw, const std::string& name) {
  std::vector<float> s;
  if (lw.scheme == Fp8Scheme::kPerChannel) {
    out->scheme = GemmScaleScheme::kPerTokenChannel;
    if (static_cast<int64_t>(lw.weight_scales.size()) != lw.n) {
      return InvalidArgumentError(name + ": " + std::to_string(lw.weight_scales.size()) +
                                  " per-channel weight scales for " + std::to_string(lw.n) +
                                  " rows");
    }
    s = lw.weight_scales;
  } else {
    out->scheme = GemmScaleScheme::kBlockwise;
    if (lw.n % kGemmScaleBlock != 0 || lw.k % kGemmScaleBlock != 0) {
      return InvalidArgumentError(
          name + ": block-wise FP8 on the GPU needs this rank's weight to be whole 128x128 " +
          "blocks, got [" + std::to_string(lw.n) + ", " + std::to_string(lw.k) + "]");
    }
    const int64_t rows = lw.n / kGemmScaleBlock, cols = lw.k / kGemmScaleBlock;
    if (static_cast<int64_t>(lw.weight_scales.size()) != rows * cols) {
      return InvalidArgumentError(name + ": " + std::to_string(lw.weight_scales.size()) +
                                  " block scales for a grid of " + std::to_string(rows) + "x" +
                                  std::to_string(cols));
    }
    s = BlockwiseWeightScalesForGemm(lw.weight_scales, lw.n, lw.k);
  }
  TP_ASSIGN_OR_RETURN(out->w_scales, Alloc(static_cast<int64_t>(s.size() * 4), name + ".w_scales"));
  TP_CUDA_CHECK(cudaMemcpy(out->w_scales.data(), s.data(), s.size() * 4, cudaMemcpyHostToDevice));
  weight_bytes_ += out->w_scales.size();
  return Status::Ok();
}

Status CudaModel::GatherWholeWeight(Linear& w, const std::string& name) {
  NcclCommunicator& comm = pool_->base();
  cudaStream_t st = stream_.get();
  // Every rank's scales (Linear::scales, 8 floats: x at 0, w at 4): one GEMM multiplies every
  // rank's input columns by its weight columns.
  constexpr size_t kScaleFloats = 8;
  TP_ASSIGN_OR_RETURN(DeviceBuffer scales, Alloc(tp_ * kScaleFloats * 4, name + ".scales_all"));
  TP_RETURN_IF_ERROR(comm.AllGather(w.scales.data(), scales.data(), kScaleFloats * 4, st));
  std::vector<float> all(tp_ * kScaleFloats);
  TP_CUDA_CHECK(cudaMemcpyAsync(all.data(), scales.data(), all.size() * sizeof(float),
                                cudaMemcpyDeviceToHost, st));
  TP_RETURN_IF_ERROR(stream_.Synchronize());
  for (int r = 0; r < tp_; ++r) {
    const float x = all[r * kScaleFloats], ws = all[r * kScaleFloats + 4];
    if (x != all[0] || ws != all[4]) {
      return FailedPreconditionError(
          name + ": full_weight needs one input scale and one weight scale on every rank; rank " +
          std::to_string(r) + " has " + std::to_string(x) + " / " + std::to_string(ws) +
          ", rank 0 " + std::to_string(all[0]) + " / " + std::to_string(all[4]));
    }
  }
  const size_t e = DataTypeSize(dtype_);
  const size_t row = static_cast<size_t>(w.k) * e, shard = static_cast<size_t>(w.n) * row;
  TP_ASSIGN_OR_RETURN(DeviceBuffer shards, Alloc(tp_ * shard, name + ".shards"));
  TP_ASSIGN_OR_RETURN(w.w_full, Alloc(tp_ * shard, name + ".weight_full"));
  TP_RETURN_IF_ERROR(comm.AllGather(w.w.data(), shards.data(), shard, st));
  for (int r = 0; r < tp_; ++r) {  // rank r's K slice into columns [r * k, (r + 1) * k)
    TP_CUDA_CHECK(cudaMemcpy2DAsync(w.w_full.as<char>() + r * row, tp_ * row,
                                    shards.as<char>() + r * shard, row, row, w.n,
                                    cudaMemcpyDeviceToDevice, st));
  }
  TP_RETURN_IF_ERROR(stream_.Synchronize());  // before `shards` is freed
  weight_bytes_ += w.w_full.size();
  return Status::Ok();
}

StatusOr<std::unique_ptr<CudaModel>> CudaModel::CreateRandom(const ModelConfig& config,
                                                             DataType dtype, uint64_t seed,
                                                             const OverlapConfig* overlap,
                                                             NcclCommPool& pool,
                                                             const CudaModelOptions& options) {
  if (!(options.residual_gain > 0.0f) || !std::isfinite(options.residual_gain)) {
    return InvalidArgumentError("residual_gain (" + std::to_string(options.residual_gain) +
                                ") must be positive and finite");
  }
  const GemmScaleScheme scheme =
      dtype == DataType::kFloat8E4M3 ? options.scale_scheme : GemmScaleScheme::kPerTensor;
  TP_ASSIGN_OR_RETURN(auto model,
                      NewShell(config, dtype, overlap, pool, options,
                               scheme == GemmScaleScheme::kBlockwise ? 4 * pool.base().size() : 1));
  CudaModel& md = *model;
  const ModelConfig& c = config;
  const int tp = md.tp_;
  const int64_t h = c.hidden_size;
  cudaStream_t st = md.stream_.get();
  // Weights ~ U(-a, a) with a = 0.02 * sqrt(3) (std 0.02, as HF initialises
  // Llama); FP8 holds uniform codes in [-448, 448) with the matching
  // dequantization scale. Every tensor of every rank gets its own seed.
  const float a = 0.02f * std::sqrt(3.0f);
  uint64_t next_seed = seed * 1000003u + static_cast<uint64_t>(md.rank_) * 7919u;
  auto random = [&](DeviceBuffer* buf, DataType type, int64_t count, float scale,
                    const std::string& name) -> Status {
    TP_ASSIGN_OR_RETURN(*buf, Alloc(count * static_cast<int64_t>(DataTypeSize(type)), name));
    md.weight_bytes_ += buf->size();
    return LaunchRandomUniform(buf->data(), type, static_cast<size_t>(count), next_seed++, scale,
                               st);
  };
  auto ones = [&](DeviceBuffer* buf, const std::string& name) -> Status {
    TP_ASSIGN_OR_RETURN(*buf, Alloc(h * 2, name));
    return LaunchFillPattern(buf->data(), static_cast<size_t>(h), 2, 0x3F80u, st);  // BF16 1.0
  };
  auto linear = [&](Linear* out, int64_t n, int64_t k, const std::string& name,
                    float gain) -> Status {
    out->n = n;
    out->k = k;
    const bool fp8 = dtype == DataType::kFloat8E4M3;
    const float amp = a * gain;
    TP_RETURN_IF_ERROR(random(&out->w, dtype, n * k, fp8 ? 448.0f : amp, name + ".weight"));
    out->dynamic = fp8 && options.dynamic_input_scales && scheme == GemmScaleScheme::kPerTensor;
    md.dynamic_inputs_ = md.dynamic_inputs_ || out->dynamic;
    if (scheme != GemmScaleScheme::kPerTensor) {  // every weight scale a / 448, as per tensor
      out->scheme = scheme;
      md.fine_inputs_ = true;
      if (scheme == GemmScaleScheme::kBlockwise && (n % kGemmScaleBlock || k % kGemmScaleBlock)) {
        return InvalidArgumentError(name + ": block-wise scales need n and k multiples of 128");
      }
      const int64_t count = scheme == GemmScaleScheme::kPerTokenChannel
                                ? n
                                : n / kGemmScaleBlock * BlockwiseWeightScalePitch(k);
      TP_ASSIGN_OR_RETURN(out->w_scales, Alloc(count * 4, name + ".w_scales"));
      const float s = amp / 448.0f;
      uint32_t bits;
      std::memcpy(&bits, &s, 4);
      TP_RETURN_IF_ERROR(LaunchFillPattern(out->w_scales.data(), count, 4, bits, st));
    }
    return md.SetScales(out, 8.0f / 448.0f, fp8 ? amp / 448.0f : 1.0f, name);
  };
  TP_RETURN_IF_ERROR(random(&md.embed_, DataType::kBFloat16, c.vocab_size * h, 1.0f, "embed"));
  TP_RETURN_IF_ERROR(ones(&md.final_norm_, "final_norm"));
  TP_RETURN_IF_ERROR(
      random(&md.lm_head_, DataType::kBFloat16, c.vocab_size / tp * h, a, "lm_head"));
  for (size_t l = 0; l < md.layers_.size(); ++l) {
    Layer& dl = md.layers_[l];
    const std::string p = "layers." + std::to_string(l);
    TP_RETURN_IF_ERROR(ones(&dl.input_norm, p + ".input_norm"));
    TP_RETURN_IF_ERROR(ones(&dl.post_norm, p + ".post_norm"));
    for (const TpLayerShape& s : TpLayerShapes(c)) {
      const bool writes_residual = s.op == OverlapOp::kGemmReduceScatter;  // o and down
      TP_RETURN_IF_ERROR(linear(&dl.at(s.index), s.local_n(tp), s.local_k(tp), s.Name(l),
                                writes_residual ? options.residual_gain : 1.0f));
    }
  }
  TP_RETURN_IF_ERROR(md.stream_.Synchronize());
  TP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));  // SetScales' uploads (see Create)
  TP_RETURN_IF_ERROR(md.AllocateActivations());
  return model;
}

GemmScaleScheme CudaModel::scale_scheme() const {
  return layers_.empty() ? GemmScaleScheme::kPerTensor : layers_[0].qkv.scheme;
}

size_t CudaModel::device_bytes() const {
  size_t total = weight_bytes_ + GenerationBytes();
  for (const DeviceBuffer* b :
       {&rope_inv_freq_, &ids_,          &positions_,   &cu_seqlens_,  &x_,           &o_out_,
        &down_out_,      &normed_,       &qkv_out_,     &attn_,        &gate_up_out_, &full_,
        &last_,          &logits_local_, &logits_all_,  &logits_rows_, &amax_,        &act_,
        &a_scales_,      &fp8_attn_buf_, &attn_counter_}) {
    total += b->size();
  }
  for (const auto& [key, layer] : linears_) total += layer->device_bytes();
  return total;
}

}  // namespace tpserve
