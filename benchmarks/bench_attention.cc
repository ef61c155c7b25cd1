// tpserve-bench-attention: the prefill attention kernels alone (LaunchCausalAttention), the
// Hopper warpgroup-MMA kernel and the mma.sync kernel interleaved round by round on the same
// inputs, as the model calls them (Q, K and V slices of one fused QKV buffer, BF16 output).
// TFLOP/s count the causal half, 4 * len^2 / 2 * head_dim * heads per sequence, as
// torch_model_compiled.py --attention-only counts SDPA's. The two kernels' outputs are
// compared (relative Frobenius difference): a run whose kernels disagree fails. With --fp8,
// where the E4M3 kernel runs (engine/attention_fp8.h), it is timed too, twice: the attention
// alone (wgmma_fp8), and as the model's stage runs: RoPE and the BF16 Hopper kernel
// (rope+wgmma) against the producer (rotating, quantizing Q, K and V, V transposed) and the E4M3
// kernel (fp8_inputs+attn); its output (before any rotation) compared with the BF16 Hopper
// kernel's (reported, and held to --max-fp8-rel-diff).
// With --decode it times the decode attention kernel instead (LaunchPagedAttention, one query
// row per sequence, as a generation step calls it) over a paged cache of each --kv-dtypes, each
// batch against its bytes floor: the cache bytes it must read (K and V of every context token)
// plus Q and the output, over the bandwidth of a device-to-device copy timed in the same run (the
// best of five 4 GiB copies, as tpserve-bench-decode's floor).
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/batch_shape.h"
#include "benchmarks/kernel_timing.h"
#include "benchmarks/median.h"
#include "benchmarks/write_replacing.h"
#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "engine/attention_fp8.h"
#include "engine/attention_wgmma.h"
#include "engine/cuda_ops.h"
#include "engine/kv_cache.h"
#include "engine/paged_kv_ops.h"
#include "layers/random_fill.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

using json = nlohmann::json;

struct Flags {
  std::vector<std::string> shapes = {"1x8192", "8x1024", "64x128"};
  int64_t heads = 32, kv_heads = 8, head_dim = 128;
  int warmup = 3, rounds = 20;
  double max_rel_diff = 1e-2;
  bool fp8 = false;  // also the E4M3 kernel
  // E4M3 q and k (through the scores), v and P, each about 2.5 % RMS: about 6 % on these
  // inputs (q, k, v in [-2, 2]).
  double max_fp8_rel_diff = 0.1;
  bool fp8_out = false;
  std::string out = "attention.json";
  bool decode = false;
  std::vector<int64_t> batches = {1, 8, 64, 256};
  int64_t context = 1024, block_size = 16, max_context = 8192;
  std::vector<std::string> kv_dtypes = {"bf16", "fp8"};
  std::vector<int64_t> splits = {0};
  // PagedAttentionParams::cluster_merge; off, as the engine runs (CudaModelOptions'
  // decode_fusions.cluster_merge): the combine pass.
  bool cluster_merge = false;
  bool rope = false;  // PagedAttentionParams::rope: the launch rotates and stores
};

// Relative Frobenius difference of two BF16 tensors.
double RelDiff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = BFloat16ToFloat(BFloat16{a[i]}), y = BFloat16ToFloat(BFloat16{b[i]});
    err += (x - y) * (x - y);
    ref += y * y;
  }
  return ref > 0 ? std::sqrt(err / ref) : std::sqrt(err);
}

struct KernelRun {
  const char* name;
  AttentionKernel kernel;
  std::vector<double> ms;
  bool work_counter = true;  // AttentionParams::work_counter set, as the engine runs
};

// `v` on the device, copied on `stream` (from pageable memory: staged before this returns).
StatusOr<DeviceBuffer> UploadInt32(const std::vector<int32_t>& v, const char* what,
                                   cudaStream_t stream) {
  TP_ASSIGN_OR_RETURN(DeviceBuffer d, DeviceBuffer::Allocate(v.size() * 4, what));
  TP_CUDA_CHECK(cudaMemcpyAsync(d.data(), v.data(), v.size() * 4, cudaMemcpyHostToDevice, stream));
  return d;
}

// RoPE (Llama 3's theta) over the q and k slices of a fused QKV buffer of `rows` rows.
RopeParams FusedQkvRope(const Flags& f, BFloat16* qkv, const int32_t* positions, int64_t rows) {
  const int64_t q_width = f.heads * f.head_dim;
  RopeParams rope;
  rope.q = qkv;
  rope.q_row_stride = q_width + 2 * f.kv_heads * f.head_dim;
  rope.q_heads = f.heads;
  rope.k = qkv + q_width;
  rope.k_row_stride = rope.q_row_stride;
  rope.kv_heads = f.kv_heads;
  rope.head_dim = f.head_dim;
  rope.positions = positions;
  rope.rows = rows;
  rope.theta = 500000.0;
  return rope;
}

Status RunShape(const Flags& f, const BatchShape& b, cudaStream_t stream, json& records,
                bool& agree) {
  const int64_t tokens = b.seqs * b.len;
  const int64_t q_width = f.heads * f.head_dim, kv_width = f.kv_heads * f.head_dim;
  const int64_t stride = q_width + 2 * kv_width;
  TP_ASSIGN_OR_RETURN(DeviceBuffer qkv,
                      DeviceBuffer::Allocate(tokens * stride * 2, "attention qkv"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer out, DeviceBuffer::Allocate(tokens * q_width * 2, "out"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer codes, DeviceBuffer::Allocate(tokens * q_width, "out_fp8"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer scale, DeviceBuffer::Allocate(4, "out_fp8_scale"));
  const float scale_value = 1.0f / 448;  // |out| <= max |v| = 2
  TP_CUDA_CHECK(cudaMemcpyAsync(scale.data(), &scale_value, 4, cudaMemcpyHostToDevice, stream));
  TP_RETURN_IF_ERROR(LaunchRandomUniform(qkv.data(), DataType::kBFloat16,
                                         static_cast<size_t>(tokens * stride), 17, 2.0f, stream));
  std::vector<int32_t> cu_host(b.seqs + 1);
  for (int64_t s = 0; s <= b.seqs; ++s) cu_host[s] = static_cast<int32_t>(s * b.len);
  TP_ASSIGN_OR_RETURN(DeviceBuffer cu, UploadInt32(cu_host, "cu_seqlens", stream));

  AttentionParams p;
  p.q = qkv.as<BFloat16>();
  p.k = qkv.as<BFloat16>() + q_width;
  p.v = qkv.as<BFloat16>() + q_width + kv_width;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = stride;
  p.out = out.as<BFloat16>();
  p.out_row_stride = q_width;
  p.cu_seqlens = cu.as<int32_t>();
  p.num_seqs = b.seqs;
  p.tokens = tokens;
  p.max_seqlen = b.len;
  p.q_heads = f.heads;
  p.kv_heads = f.kv_heads;
  p.head_dim = f.head_dim;

  // The Hopper kernel as the engine runs it (persistent, with a work counter) and with a
  // block per unit (no counter), which must give the same bits.
  TP_ASSIGN_OR_RETURN(DeviceBuffer counter, DeviceBuffer::Allocate(8, "work_counter"));
  TP_CUDA_CHECK(cudaMemsetAsync(counter.data(), 0, 8, stream));
  std::vector<KernelRun> runs = {{"mma_sync", AttentionKernel::kMmaSync, {}}};
  if (WgmmaAttentionSupports(f.head_dim)) {
    runs.push_back({"wgmma", AttentionKernel::kWgmma, {}});
    runs.push_back({"wgmma_unit_blocks", AttentionKernel::kWgmma, {}, false});
  }
  // The E4M3 path: codes of q, k, v at scale 1, as the engine quantizes them (the producer
  // then skips the division).
  const bool fp8 = f.fp8 && Fp8AttentionSupports(f.head_dim);
  DeviceBuffer q8, k8, vt8, scales, positions;  // allocated only with fp8
  Fp8AttentionInputs in;
  RopeParams rope;
  // wgmma_fp8: the E4M3 attention alone; rope+wgmma: RoPE and the BF16 Hopper kernel;
  // fp8_inputs+attn: the producer with RoPE and the E4M3 attention.
  std::vector<KernelRun> fp8_runs;
  if (fp8) {
    const int64_t vt_columns = Fp8AttentionVtColumns(tokens, b.seqs);
    TP_ASSIGN_OR_RETURN(q8, DeviceBuffer::Allocate(tokens * q_width, "q8"));
    TP_ASSIGN_OR_RETURN(k8, DeviceBuffer::Allocate(tokens * kv_width, "k8"));
    TP_ASSIGN_OR_RETURN(vt8, DeviceBuffer::Allocate(kv_width * vt_columns, "vt8"));
    TP_ASSIGN_OR_RETURN(scales, DeviceBuffer::Allocate(3 * sizeof(float), "scales"));
    const float qkv_scales[3] = {1.0f, 1.0f, 1.0f};
    TP_CUDA_CHECK(cudaMemcpyAsync(scales.data(), qkv_scales, sizeof qkv_scales,
                                  cudaMemcpyHostToDevice, stream));
    in.q = q8.as<uint8_t>();
    in.k = k8.as<uint8_t>();
    in.vt = vt8.as<uint8_t>();
    in.vt_columns = vt_columns;
    in.scales = scales.as<float>();
    // The stage as the model runs it: RoPE, then attention (BF16), or the producer rotating
    // as it quantizes, then attention (E4M3). Positions count from each sequence's start.
    std::vector<int32_t> positions_host(tokens);
    for (int64_t t = 0; t < tokens; ++t) positions_host[t] = static_cast<int32_t>(t % b.len);
    TP_ASSIGN_OR_RETURN(positions, UploadInt32(positions_host, "positions", stream));
    rope = FusedQkvRope(f, qkv.as<BFloat16>(), positions.as<int32_t>(), tokens);
    fp8_runs = {{"wgmma_fp8", AttentionKernel::kWgmma, {}},
                {"rope+wgmma", AttentionKernel::kWgmma, {}},
                {"fp8_inputs+attn", AttentionKernel::kWgmma, {}}};
  }

  std::vector<std::vector<uint16_t>> outputs;
  auto download = [&]() -> Status {
    std::vector<uint16_t> host(tokens * q_width);
    TP_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), out.data(), host.size() * 2, cudaMemcpyDeviceToHost, stream));
    TP_CUDA_CHECK(cudaStreamSynchronize(stream));
    outputs.push_back(std::move(host));
    return Status::Ok();
  };
  for (KernelRun& r : runs) {
    p.kernel = r.kernel;
    p.work_counter = r.work_counter ? counter.as<int32_t>() : nullptr;
    for (int i = 0; i < f.warmup; ++i) TP_RETURN_IF_ERROR(LaunchCausalAttention(p, stream));
    TP_RETURN_IF_ERROR(download());
  }
  p.work_counter = counter.as<int32_t>();
  if (fp8) {
    for (int i = 0; i < f.warmup; ++i) {
      TP_RETURN_IF_ERROR(LaunchFp8AttentionInputs(p, in, nullptr, stream));
      TP_RETURN_IF_ERROR(LaunchCausalAttentionFp8(p, in, stream));
    }
    TP_RETURN_IF_ERROR(download());
  }
  // Timed: BF16 out, or (--fp8-out) only the E4M3 codes, as the FP8 model's o input.
  if (f.fp8_out) {
    p.out = nullptr;
    p.out_row_stride = 0;
    p.out_fp8 = codes.as<uint8_t>();
    p.out_fp8_row_stride = q_width;
    p.out_fp8_scale = scale.as<float>();
  }
  TP_ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::Create(true));
  TP_ASSIGN_OR_RETURN(CudaEvent end, CudaEvent::Create(true));
  for (int round = 0; round < f.rounds; ++round) {
    // Interleaved, so that clocks and temperature drift hit every kernel alike, and in the
    // reverse order every other round: the same launch measured right after another can
    // differ by a few per cent with its place in the round.
    for (size_t k = 0; k < runs.size(); ++k) {
      KernelRun& r = runs[round % 2 == 0 ? k : runs.size() - 1 - k];
      p.kernel = r.kernel;
      p.work_counter = r.work_counter ? counter.as<int32_t>() : nullptr;
      TP_ASSIGN_OR_RETURN(const double ms, TimeLaunchMs(stream, start, end, [&] {
                            return LaunchCausalAttention(p, stream);
                          }));
      r.ms.push_back(ms);
    }
    p.work_counter = counter.as<int32_t>();
    for (size_t i = 0; i < fp8_runs.size(); ++i) {
      TP_ASSIGN_OR_RETURN(const double ms, TimeLaunchMs(stream, start, end, [&]() -> Status {
                            if (i == 1) {  // rotates q and k in place: timing only
                              TP_RETURN_IF_ERROR(LaunchRope(rope, stream));
                              p.kernel = AttentionKernel::kWgmma;
                              return LaunchCausalAttention(p, stream);
                            }
                            if (i == 2) {
                              TP_RETURN_IF_ERROR(LaunchFp8AttentionInputs(p, in, &rope, stream));
                            }
                            return LaunchCausalAttentionFp8(p, in, stream);
                          }));
      fp8_runs[i].ms.push_back(ms);
    }
  }
  const double flops = static_cast<double>(b.seqs) * 4.0 * static_cast<double>(b.len) *
                       static_cast<double>(b.len) / 2 * static_cast<double>(f.head_dim * f.heads);
  const double diff = runs.size() > 1 ? RelDiff(outputs[1], outputs[0]) : 0.0;
  if (diff > f.max_rel_diff) agree = false;
  // The work order changes no value: each tile's arithmetic is the same.
  const bool same_bits = runs.size() < 3 || outputs[2] == outputs[1];
  if (!same_bits) {
    std::printf("         wgmma with and without the work counter: outputs differ\n");
    agree = false;
  }
  // E4M3 against the BF16 Hopper kernel (codes of q, k, v and P rounded to E4M3).
  const double fp8_diff = fp8 ? RelDiff(outputs.back(), outputs[runs.size() - 1]) : 0.0;
  if (fp8_diff > f.max_fp8_rel_diff) agree = false;
  for (KernelRun& r : fp8_runs) runs.push_back(std::move(r));
  for (const KernelRun& r : runs) {
    const double med = Median(r.ms);
    std::printf("%-15s %4ldx%-5ld %8.3f ms  %6.1f TFLOP/s (causal half)\n", r.name,
                static_cast<long>(b.seqs), static_cast<long>(b.len), med,
                flops / (med / 1e3) / 1e12);
    records.push_back({{"kernel", r.name},
                       {"seqs", b.seqs},
                       {"seq_len", b.len},
                       {"median_ms", med},
                       {"times_ms", r.ms},
                       {"tflops", flops / (med / 1e3) / 1e12},
                       {"rel_diff_vs_mma_sync", diff},
                       {"rel_diff_fp8_vs_wgmma", fp8_diff},
                       {"output", f.fp8_out ? "fp8" : "bf16"}});
  }
  if (outputs.size() > 1) {
    std::printf("         wgmma vs mma_sync: rel. Frobenius difference %.2e%s\n", diff,
                diff > f.max_rel_diff ? "  ** over --max-rel-diff **" : "");
  }
  if (fp8) {
    std::printf("         wgmma_fp8 vs wgmma: rel. Frobenius difference %.2e%s\n", fp8_diff,
                fp8_diff > f.max_fp8_rel_diff ? "  ** over --max-fp8-rel-diff **" : "");
  }
  std::fflush(stdout);
  return Status::Ok();
}

// One decode launch: `batch` sequences of `context` cached tokens (this step's token
// included), their blocks scattered over the pool in a shuffled order as a running server's
// are, the split count the launcher picks for a table as wide as --max-context.
Status RunDecode(const Flags& f, KvCacheDtype dtype, int64_t batch, int64_t want_splits,
                 double copy_gbs, cudaStream_t stream, json& records) {
  const int64_t per_seq = (f.context + f.block_size - 1) / f.block_size;
  const int64_t width = std::max(per_seq, (f.max_context + f.block_size - 1) / f.block_size);
  KvCacheLayout layout;
  layout.layers = 1;
  layout.num_blocks = batch * per_seq;
  layout.block_size = f.block_size;
  layout.kv_heads = f.kv_heads;
  layout.head_dim = f.head_dim;
  layout.dtype = dtype;
  const int64_t q_width = f.heads * f.head_dim, kv_width = f.kv_heads * f.head_dim;
  const int64_t stride = q_width + 2 * kv_width;
  const size_t elem = static_cast<size_t>(KvCacheElementBytes(dtype));
  TP_ASSIGN_OR_RETURN(
      DeviceBuffer cache,
      DeviceBuffer::Allocate(static_cast<size_t>(layout.Elements()) * elem, "cache"));
  TP_RETURN_IF_ERROR(LaunchRandomUniform(
      cache.data(), dtype == KvCacheDtype::kBFloat16 ? DataType::kBFloat16 : DataType::kFloat8E4M3,
      static_cast<size_t>(layout.Elements()), 23, 1.0f, stream));
  TP_ASSIGN_OR_RETURN(DeviceBuffer qkv, DeviceBuffer::Allocate(batch * stride * 2, "qkv"));
  TP_RETURN_IF_ERROR(LaunchRandomUniform(qkv.data(), DataType::kBFloat16,
                                         static_cast<size_t>(batch * stride), 29, 2.0f, stream));
  TP_ASSIGN_OR_RETURN(DeviceBuffer out, DeviceBuffer::Allocate(batch * q_width * 2, "out"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer codes, DeviceBuffer::Allocate(batch * q_width, "out_fp8"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer scale, DeviceBuffer::Allocate(sizeof(float), "out_fp8_scale"));
  const float unit = 1.0f;
  TP_CUDA_CHECK(cudaMemcpyAsync(scale.data(), &unit, sizeof unit, cudaMemcpyHostToDevice, stream));
  std::vector<int32_t> ids(static_cast<size_t>(layout.num_blocks));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::mt19937 rng(31);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(batch * width), -1), cu(batch + 1),
      ctx(batch, static_cast<int32_t>(f.context));
  for (int64_t s = 0; s < batch; ++s) {
    for (int64_t b = 0; b < per_seq; ++b) tables[s * width + b] = ids[s * per_seq + b];
  }
  for (int64_t s = 0; s <= batch; ++s) cu[s] = static_cast<int32_t>(s);
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_tables, UploadInt32(tables, "block_tables", stream));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_cu, UploadInt32(cu, "cu_seqlens", stream));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_ctx, UploadInt32(ctx, "context_lens", stream));
  const size_t ws_bytes =
      PagedAttentionWorkspaceBytes(batch, f.heads, f.head_dim, width * f.block_size);
  TP_ASSIGN_OR_RETURN(DeviceBuffer ws, DeviceBuffer::Allocate(ws_bytes, "workspace"));

  PagedAttentionParams p;
  p.q = qkv.as<BFloat16>();
  p.q_row_stride = stride;
  p.q_heads = f.heads;
  p.cache = cache.data();
  p.layout = layout;
  p.cu_seqlens = d_cu.as<int32_t>();
  p.context_lens = d_ctx.as<int32_t>();
  p.block_tables = d_tables.as<int32_t>();
  p.num_seqs = batch;
  p.tokens = batch;
  p.max_blocks = width;
  p.max_query_rows = 1;
  p.max_context = width * f.block_size;
  if (f.fp8_out) {  // E4M3 codes only, as the FP8 model's o input
    p.out_fp8 = codes.as<uint8_t>();
    p.out_fp8_row_stride = q_width;
    p.out_fp8_scale = scale.as<float>();
  } else {
    p.out = out.as<BFloat16>();
    p.out_row_stride = q_width;
  }
  p.workspace = ws.data();
  p.workspace_bytes = ws_bytes;
  p.splits = want_splits;
  p.cluster_merge = f.cluster_merge;
  // --rope: q and each sequence's newest key arrive unrotated (the qkv rows' k and v columns),
  // at position context - 1, stored into its slot by the launch (the same bytes every launch).
  std::vector<int32_t> positions(static_cast<size_t>(batch), static_cast<int32_t>(f.context - 1)),
      slots(static_cast<size_t>(batch));
  for (int64_t s = 0; s < batch; ++s) {
    const int64_t pos = f.context - 1;
    slots[s] = static_cast<int32_t>(tables[s * width + pos / f.block_size] * f.block_size +
                                    pos % f.block_size);
  }
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_positions, UploadInt32(positions, "positions", stream));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_slots, UploadInt32(slots, "slot_mapping", stream));
  PagedKvWriteParams store;
  store.k = qkv.as<BFloat16>() + q_width;
  store.k_row_stride = stride;
  store.v = qkv.as<BFloat16>() + q_width + kv_width;
  store.v_row_stride = stride;
  store.slot_mapping = d_slots.as<int32_t>();
  store.rows = batch;
  store.cache = cache.data();
  store.layout = layout;
  RopeParams rope = FusedQkvRope(f, qkv.as<BFloat16>(), d_positions.as<int32_t>(), batch);
  rope.kv_store = &store;
  if (f.rope) p.rope = &rope;
  int device = 0, sms = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  TP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t splits = PagedAttentionSplitsFor(p, sms);
  TP_ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::Create(true));
  TP_ASSIGN_OR_RETURN(CudaEvent end, CudaEvent::Create(true));
  std::vector<double> ms;
  for (int i = 0; i < f.warmup + f.rounds; ++i) {
    TP_ASSIGN_OR_RETURN(const double t, TimeLaunchMs(stream, start, end, [&] {
                          return LaunchPagedAttention(p, stream);
                        }));
    if (i >= f.warmup) ms.push_back(t);
  }
  const double med = Median(ms);
  const double bytes = static_cast<double>(batch) * static_cast<double>(f.context) *
                           static_cast<double>(2 * kv_width) * static_cast<double>(elem) +
                       static_cast<double>(batch) * static_cast<double>(2 * q_width) * 2.0;
  const double floor_ms = bytes / (copy_gbs * 1e9) * 1e3;
  std::printf(
      "decode %-4s batch %4ld ctx %5ld: %8.3f ms (%ld splits%s%s)  %7.0f GB/s  floor %.3f ms  "
      "%.2fx\n",
      KvCacheDtypeName(dtype), static_cast<long>(batch), static_cast<long>(f.context), med,
      static_cast<long>(splits), f.cluster_merge ? ", cluster merge" : "", f.rope ? ", rope" : "",
      bytes / (med / 1e3) / 1e9, floor_ms, med / floor_ms);
  std::fflush(stdout);
  records.push_back({{"kernel", "paged_decode"},
                     {"kv_dtype", KvCacheDtypeName(dtype)},
                     {"output", f.fp8_out ? "fp8" : "bf16"},
                     {"batch", batch},
                     {"context", f.context},
                     {"block_size", f.block_size},
                     {"splits", splits},
                     {"splits_asked", want_splits},
                     {"cluster_merge", f.cluster_merge},
                     {"rope", f.rope},
                     {"median_ms", med},
                     {"times_ms", ms},
                     {"bytes", bytes},
                     {"gb_per_s", bytes / (med / 1e3) / 1e9},
                     {"floor_ms", floor_ms},
                     {"x_floor", med / floor_ms}});
  return Status::Ok();
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "tpserve-bench-attention: times the prefill attention kernels (the Hopper warpgroup-MMA "
      "kernel where it applies, persistent with a work counter as the engine runs it and with "
      "a block per unit (wgmma_unit_blocks), and the mma.sync kernel) on causal batches, "
      "interleaved round by round, and checks that their outputs agree; with --decode, the "
      "decode attention kernel over a paged cache against its bytes floor"};
  StrictNumbers(app);
  app.add_option("--shapes", f.shapes, "batch shapes SEQSxLEN: SEQS sequences of LEN tokens")
      ->capture_default_str();
  app.add_option("--heads", f.heads, "query heads")->check(Positive())->capture_default_str();
  app.add_option("--kv-heads", f.kv_heads, "key/value heads (divides --heads)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--head-dim", f.head_dim, "64 or 128 (the Hopper kernel: 128)")
      ->capture_default_str();
  app.add_option("--warmup", f.warmup, "untimed launches per kernel and shape")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--rounds", f.rounds, "timed launches per kernel and shape (median reported)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--max-rel-diff", f.max_rel_diff,
                 "fail when the kernels' outputs differ by more (relative Frobenius)")
      ->capture_default_str();
  app.add_flag("--fp8", f.fp8,
               "also time the E4M3 attention (Q, K, V and P in E4M3; Hopper, head_dim 128), "
               "alone and with the pass that quantizes its inputs");
  app.add_option("--max-fp8-rel-diff", f.max_fp8_rel_diff,
                 "fail when the E4M3 kernel's output differs from the BF16 Hopper kernel's by "
                 "more (relative Frobenius; E4M3 q, k, v and P)")
      ->capture_default_str();
  app.add_flag("--fp8-out", f.fp8_out,
               "time with the output as E4M3 codes only (out_fp8, as the FP8 model calls it) "
               "instead of BF16; the kernels are compared on BF16 either way (with --decode: "
               "the decode kernel's out_fp8, scale 1)");
  app.add_option("--out", f.out, "JSON results, rewritten after every shape")
      ->capture_default_str();
  app.add_flag("--decode", f.decode,
               "time the decode attention kernel (one query row per sequence over a paged "
               "cache) instead of the prefill kernels; --shapes is then not used");
  app.add_option("--batches", f.batches, "--decode: sequences per launch (a case each)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--context", f.context, "--decode: cached tokens per sequence")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--kv-dtypes", f.kv_dtypes, "--decode: cache element types (bf16, fp8)")
      ->capture_default_str();
  app.add_option("--splits", f.splits,
                 "--decode: context splits to ask the kernel for (a case each; 0: the "
                 "launcher's own choice, PagedAttentionSplitsFor; others are capped as it caps)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("--cluster-merge,!--no-cluster-merge", f.cluster_merge,
               "--decode: merge the splits within a thread-block cluster "
               "(PagedAttentionParams::cluster_merge) instead of the combine pass; "
               "--no-cluster-merge (the default, as the engine runs): the combine pass");
  app.add_flag("--rope", f.rope,
               "--decode: the launch also rotates q and stores each sequence's newest key and "
               "value (PagedAttentionParams::rope), as a pure decode step's does");
  app.add_option("--kv-block-size", f.block_size, "--decode: tokens per cache block")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--max-context", f.max_context,
                 "--decode: block-table width in tokens, which sizes the split count as a "
                 "server's longest context does (llama3-8b: 8192)")
      ->check(Positive())
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (f.heads % f.kv_heads != 0) {
    spdlog::error("--heads {} is not a multiple of --kv-heads {}", f.heads, f.kv_heads);
    return 2;
  }
  std::vector<BatchShape> shapes;
  for (const std::string& s : f.shapes) {
    auto b = ParseBatch(s, "--shapes");
    if (!b.ok()) {
      spdlog::error("{}", b.status().ToString());
      return 2;
    }
    shapes.push_back(*b);
  }
  auto stream = CudaStream::Create();
  if (!stream.ok()) {
    spdlog::error("{}", stream.status().ToString());
    return 1;
  }
  json doc = {{"meta",
               {{"gpu", DeviceName()},
                {"heads", f.heads},
                {"kv_heads", f.kv_heads},
                {"head_dim", f.head_dim},
                {"rounds", f.rounds},
                {"flops", "4 * len^2 / 2 * head_dim * heads per sequence (causal half)"}}},
              {"records", json::array()}};
  if (f.decode) {
    std::vector<KvCacheDtype> dtypes;
    for (const std::string& name : f.kv_dtypes) {
      auto d = ParseKvCacheDtype(name);
      if (!d.ok()) {
        spdlog::error("--kv-dtypes: {}", d.status().ToString());
        return 2;
      }
      dtypes.push_back(*d);
    }
    auto bw = MeasureHbmBandwidth(size_t{1} << 32, 5);
    if (!bw.ok()) {
      spdlog::error("copy bandwidth: {}", bw.status().ToString());
      return 1;
    }
    const double gbs = *bw / 1e9;
    std::printf("device-to-device copy %.0f GB/s (the floors' bandwidth)\n", gbs);
    doc["meta"]["copy_gb_per_s"] = gbs;
    doc["meta"]["floor"] = "(K and V bytes of every context token + Q and output) / copy GB/s";
    for (KvCacheDtype d : dtypes) {
      for (int64_t batch : f.batches) {
        for (int64_t splits : f.splits) {
          Status st = RunDecode(f, d, batch, splits, gbs, stream->get(), doc["records"]);
          if (!st.ok()) {
            spdlog::error("decode {} batch {}: {}", KvCacheDtypeName(d), batch, st.ToString());
            return 1;
          }
          if (std::string err = WriteReplacing(f.out, doc.dump(1)); !err.empty()) {
            spdlog::error("{}", err);
            return 1;
          }
        }
      }
    }
    return 0;
  }
  bool agree = true;
  for (const BatchShape& b : shapes) {
    Status st = RunShape(f, b, stream->get(), doc["records"], agree);
    if (!st.ok()) {
      spdlog::error("{}x{}: {}", b.seqs, b.len, st.ToString());
      return 1;
    }
    if (std::string err = WriteReplacing(f.out, doc.dump(1)); !err.empty()) {
      spdlog::error("{}", err);
      return 1;
    }
  }
  if (!agree) {
    spdlog::error(
        "the kernels' outputs differ by more than --max-rel-diff {} (--max-fp8-rel-diff {} for "
        "the E4M3 kernel)",
        f.max_rel_diff, f.max_fp8_rel_diff);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
