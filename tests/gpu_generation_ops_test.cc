// GPU tests for the generation kernels (engine/paged_kv_ops.h, engine/sampling_kernels.h)
// against the CPU references: CpuKvCache::Write and PagedAttention (engine/kv_cache.h),
// SampleToken (engine/sampling.h).
//
// Inputs are random from fixed seeds at awkward shapes: odd sequence counts, contexts that are
// not multiples of the block size, block tables in shuffled order, prefill chunks that start
// mid-block, decode contexts from 1 to 5000 (so that the context is split over CTAs). Outputs
// are poisoned first, so that an element the GPU did not write fails, and padding columns are
// checked to still hold the poison. Tolerances:
//   KV write:   the cache bytes decode (E4M3: times the layer's scale) to exactly what
//               CpuKvCache::Read gives, everywhere in the pool (the other layer and unused
//               slots included: they must stay zero).
//   Attention:  |gpu - ref| <= 2^-8 |ref| + 2e-5 per element (the BF16 output rounding is
//               2^-9 |ref|; the FP32 scores and sums are ~1e-6 off the double reference), and
//               ||gpu - ref|| / ||ref|| <= 1e-2. A key too many or too few changes outputs by
//               about |v| / context, which the small contexts of every case catch.
//   Sampling:   greedy tokens identical; sampled tokens equal SampleToken's in >= 99% of 2000
//               random cases (the kernel sums in fixed point, the reference in double: they
//               can differ only where u sits on a boundary, so in practice all agree);
//               log_prob within 1e-5 absolute; the empirical distribution over 40000 seeds
//               within 5 sigma of the rule's probabilities for every token.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "comm/status.h"
#include "engine/cuda_ops.h"
#include "engine/kv_cache.h"
#include "engine/paged_kv_ops.h"
#include "engine/sampling.h"
#include "engine/sampling_kernels.h"
#include "layers/fp8.h"
#include "layers/quantize_kernels.h"
#include "layers/random_fill.h"
#include "layers/small_m_gemm.h"
#include "tests/gpu_test_util.h"

namespace tpserve {
namespace {

#define TP_CUDA_CHECK_FOR_TEST(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

class GpuGenerationOpsTest : public GpuStreamTest {};

// The float a cache element holds, decoded as the reference does.
float DecodeCache(const std::vector<uint8_t>& bytes, KvCacheDtype dtype, int64_t e) {
  if (dtype == KvCacheDtype::kBFloat16) {
    BFloat16 b;
    b.bits = static_cast<uint16_t>(bytes[2 * e] | (bytes[2 * e + 1] << 8));
    return BFloat16ToFloat(b);
  }
  return Fp8E4M3ToFloat(bytes[e]);
}

// ---------------------------------------------------------------------------------------------
// A step over a paged cache: sequences with their contexts (after the step) and query rows,
// the cache filled through LaunchPagedKvWrite (GPU) and CpuKvCache::Write (CPU) from the same
// fused QKV rows.

struct PagedCase {
  std::vector<int32_t> context;  // context_lens after the step
  std::vector<int32_t> query;    // query rows per sequence in the step (<= context)
  int64_t q_heads = 8, kv_heads = 2, head_dim = 128, block_size = 16;
  KvCacheDtype dtype = KvCacheDtype::kBFloat16;
  float q_range = 2.0f;        // q uniform in [-q_range, q_range]
  float kv_range = 1.0f;       // k, v uniform in [-kv_range, kv_range]
  int64_t splits = 0;          // PagedAttentionParams::splits
  int64_t max_query_rows = 0;  // 0: the true maximum (1 in decode: the decode kernel)
  bool with_workspace = true;  // false: no workspace (one split)
  // Lists the sequences of two or more query rows (PagedAttentionParams::multi_row_seqs):
  // they take the tensor-core kernel, whose P.V product rounds P to BF16.
  bool multi_row_list = false;
  KvScales scales;  // the layer's (an E4M3 cache's): both sides store x / scale
};

std::string Describe(const PagedCase& c) {
  std::string s = "heads=" + std::to_string(c.q_heads) + "/" + std::to_string(c.kv_heads) +
                  " head_dim=" + std::to_string(c.head_dim) +
                  " block=" + std::to_string(c.block_size) + " " + KvCacheDtypeName(c.dtype) +
                  " splits=" + std::to_string(c.splits) +
                  (c.multi_row_list ? " multi-row list" : "") +
                  (c.scales.k != 1.0f || c.scales.v != 1.0f
                       ? " scales=" + std::to_string(c.scales.k) + "/" + std::to_string(c.scales.v)
                       : "") +
                  " ctx/query=";
  for (size_t i = 0; i < c.context.size(); ++i) {
    s += std::to_string(c.context[i]) + "/" + std::to_string(c.query[i]) + ",";
  }
  return s;
}

// Everything a paged step needs, on the host and the device.
struct PagedStep {
  KvCacheLayout layout;
  int64_t layer = 1;
  int64_t max_blocks = 0;
  std::vector<int32_t> block_tables, cu_seqlens{0};
  int64_t tokens = 0, q_width = 0, qkv_stride = 0;
  std::vector<BFloat16> q_qkv;  // [tokens, qkv_stride]: the step's q rows (k, v columns unused)
  std::vector<float> q_f;       // [tokens, q_heads * head_dim]
  DeviceBuffer d_cache, d_q, d_cu, d_ctx, d_tables;
};

// Builds the case: the KV rows of every context token go through one LaunchPagedKvWrite
// (with padding rows and a corrupt slot the kernel must skip), the same rows through
// CpuKvCache::Write; checks the GPU pool against the CPU one byte for byte (as floats).
void BuildStep(cudaStream_t stream, const PagedCase& c, uint32_t seed, PagedStep* st,
               CpuKvCache** cpu_out, std::vector<std::unique_ptr<CpuKvCache>>* owner) {
  const int64_t seqs = static_cast<int64_t>(c.context.size());
  const int64_t hd = c.head_dim;
  int64_t blocks_needed = 0, most_blocks = 1;
  for (int32_t ctx : c.context) {
    blocks_needed += BlocksFor(ctx, c.block_size);
    most_blocks = std::max(most_blocks, BlocksFor(ctx, c.block_size));
  }
  st->layout.layers = 2;
  st->layout.num_blocks = blocks_needed + 7;  // some never used
  st->layout.block_size = c.block_size;
  st->layout.kv_heads = c.kv_heads;
  st->layout.head_dim = hd;
  st->layout.dtype = c.dtype;
  st->max_blocks = most_blocks + 1;
  owner->push_back(std::make_unique<CpuKvCache>(st->layout));
  CpuKvCache* cpu = owner->back().get();
  *cpu_out = cpu;
  TP_ASSERT_OK(cpu->SetScales(st->layer, c.scales));

  // Shuffled block ids; unused table entries hold -1 (never read).
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(st->layout.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  st->block_tables.assign(static_cast<size_t>(seqs * st->max_blocks), -1);
  size_t next = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t b = 0; b < BlocksFor(c.context[s], c.block_size); ++b) {
      st->block_tables[s * st->max_blocks + b] = ids[next++];
    }
  }

  // KV rows: every context token of every sequence, with a padding row (slot -1) after each
  // sequence and one corrupt slot (past the pool) at the end.
  st->q_width = c.q_heads * hd;
  const int64_t kv_width = c.kv_heads * hd;
  st->qkv_stride = st->q_width + 2 * kv_width;
  std::vector<int32_t> slots;
  std::vector<BFloat16> kv_qkv;
  std::uniform_real_distribution<float> dist(-c.kv_range, c.kv_range);
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t ctx = c.context[s];
    std::vector<float> k(ctx * kv_width), v(ctx * kv_width);
    std::vector<int32_t> positions(ctx);
    for (int64_t t = 0; t < ctx; ++t) {
      positions[t] = static_cast<int32_t>(t);
      const int32_t block = st->block_tables[s * st->max_blocks + t / c.block_size];
      slots.push_back(static_cast<int32_t>(block * c.block_size + t % c.block_size));
      const size_t row = kv_qkv.size();
      kv_qkv.resize(row + st->qkv_stride, FloatToBFloat16(7.0f));  // q columns: unused
      for (int64_t j = 0; j < kv_width; ++j) {
        const BFloat16 kb = FloatToBFloat16(dist(rng)), vb = FloatToBFloat16(dist(rng));
        kv_qkv[row + st->q_width + j] = kb;
        kv_qkv[row + st->q_width + kv_width + j] = vb;
        k[t * kv_width + j] = BFloat16ToFloat(kb);
        v[t * kv_width + j] = BFloat16ToFloat(vb);
      }
    }
    cpu->Write(st->layer, k.data(), v.data(), ctx, positions.data(),
               st->block_tables.data() + s * st->max_blocks);
    slots.push_back(-1);
    kv_qkv.resize(kv_qkv.size() + st->qkv_stride, FloatToBFloat16(100.0f));
  }
  slots.push_back(static_cast<int32_t>(st->layout.num_blocks * c.block_size));  // corrupt
  kv_qkv.resize(kv_qkv.size() + st->qkv_stride, FloatToBFloat16(100.0f));
  const int64_t kv_rows = static_cast<int64_t>(slots.size());

  const size_t cache_bytes =
      static_cast<size_t>(st->layout.Elements() * KvCacheElementBytes(c.dtype));
  TP_ASSERT_OK_AND_ASSIGN(st->d_cache, DeviceBuffer::Allocate(cache_bytes, "cache"));
  TP_CUDA_CHECK_FOR_TEST(cudaMemsetAsync(st->d_cache.data(), 0, cache_bytes, stream));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_kv, Upload(kv_qkv, "kv_qkv"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_slots, Upload(slots, "slots"));
  PagedKvWriteParams w;
  w.k = d_kv.as<BFloat16>() + st->q_width;
  w.k_row_stride = st->qkv_stride;
  w.v = d_kv.as<BFloat16>() + st->q_width + kv_width;
  w.v_row_stride = st->qkv_stride;
  w.slot_mapping = d_slots.as<int32_t>();
  w.rows = kv_rows;
  w.cache = st->d_cache.data();
  w.layout = st->layout;
  w.layer = st->layer;
  w.scales = c.scales;
  TP_ASSERT_OK(LaunchPagedKvWrite(w, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(auto bytes, Download<uint8_t>(st->d_cache.data(), cache_bytes));
  size_t mismatches = 0;
  const KvCacheLayout& L = st->layout;
  for (int64_t layer = 0; layer < L.layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t b = 0; b < L.num_blocks; ++b) {
        for (int64_t h = 0; h < L.kv_heads; ++h) {
          for (int64_t slot = 0; slot < L.block_size; ++slot) {
            const int64_t e0 = L.Offset(layer, kv, b, h, slot);
            // An E4M3 code counts as code x the layer's scale (1 over BF16).
            const KvScales& sc = cpu->scales(layer);
            const float scale = c.dtype == KvCacheDtype::kBFloat16 ? 1.0f : kv == 0 ? sc.k : sc.v;
            for (int64_t d = 0; d < hd; ++d) {
              const float want = cpu->Read(layer, kv, b, h, slot, d);
              const float got = DecodeCache(bytes, c.dtype, e0 + d) * scale;
              if (!(got == want) && ++mismatches <= 5) {
                ADD_FAILURE() << "kv write " << Describe(c) << ": layer " << layer << " kv " << kv
                              << " block " << b << " head " << h << " slot " << slot << " d " << d
                              << ": gpu " << got << " cpu " << want;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << "kv write " << Describe(c);

  // The step's query rows: the last query[s] positions of each sequence.
  for (int64_t s = 0; s < seqs; ++s) st->cu_seqlens.push_back(st->cu_seqlens.back() + c.query[s]);
  st->tokens = st->cu_seqlens.back();
  st->q_qkv = RandomBf16(static_cast<size_t>(std::max<int64_t>(st->tokens, 1) * st->qkv_stride),
                         -c.q_range, c.q_range, seed + 1);
  st->q_f.resize(static_cast<size_t>(st->tokens * st->q_width));
  for (int64_t r = 0; r < st->tokens; ++r) {
    for (int64_t j = 0; j < st->q_width; ++j) {
      st->q_f[r * st->q_width + j] = BFloat16ToFloat(st->q_qkv[r * st->qkv_stride + j]);
    }
  }
  TP_ASSERT_OK_AND_ASSIGN(st->d_q, Upload(st->q_qkv, "q"));
  TP_ASSERT_OK_AND_ASSIGN(st->d_cu, Upload(st->cu_seqlens, "cu_seqlens"));
  TP_ASSERT_OK_AND_ASSIGN(st->d_ctx, Upload(c.context, "context_lens"));
  TP_ASSERT_OK_AND_ASSIGN(st->d_tables, Upload(st->block_tables, "block_tables"));
}

PagedAttentionParams AttentionParamsFor(const PagedCase& c, const PagedStep& st) {
  PagedAttentionParams p;
  p.q = st.d_q.as<BFloat16>();
  p.q_row_stride = st.qkv_stride;
  p.q_heads = c.q_heads;
  p.cache = st.d_cache.data();
  p.layout = st.layout;
  p.layer = st.layer;
  p.scales = c.scales;
  p.cu_seqlens = st.d_cu.as<int32_t>();
  p.context_lens = st.d_ctx.as<int32_t>();
  p.block_tables = st.d_tables.as<int32_t>();
  p.num_seqs = static_cast<int64_t>(c.context.size());
  p.tokens = st.tokens;
  p.max_blocks = st.max_blocks;
  p.max_query_rows = c.max_query_rows > 0
                         ? c.max_query_rows
                         : std::max<int64_t>(1, *std::max_element(c.query.begin(), c.query.end()));
  p.out_row_stride = st.q_width + 8;  // padding that must stay poisoned
  p.splits = c.splits;
  return p;
}

// A workspace for the case's largest split count (none without c.with_workspace), attached
// to *p; the caller keeps the buffer alive through the launch.
StatusOr<DeviceBuffer> AttachWorkspace(const PagedCase& c, const PagedStep& st,
                                       PagedAttentionParams* p) {
  const size_t bytes = c.with_workspace
                           ? PagedAttentionWorkspaceBytes(st.tokens, c.q_heads, c.head_dim,
                                                          st.max_blocks * c.block_size)
                           : 0;
  TP_ASSIGN_OR_RETURN(DeviceBuffer ws, DeviceBuffer::Allocate(bytes, "workspace"));
  p->workspace = ws.data();
  p->workspace_bytes = bytes;
  return ws;
}

// Whether the case's single-row sequences take the decode kernel (LaunchPagedAttention's
// choice: one query row per sequence in the launch's sizing, or every multi-row sequence
// listed, and a group of 1, 2, 4 or 8) rather than the split kernels of several rows.
bool TakesDecodeKernel(const PagedCase& c, const PagedAttentionParams& p) {
  const int64_t group = c.q_heads / c.kv_heads;
  return (c.multi_row_list || p.max_query_rows == 1) &&
         (group == 1 || group == 2 || group == 4 || group == 8);
}

// Compares BF16 attention output rows (row stride q_width + 8) with the reference.
void ExpectAttentionNear(const std::vector<BFloat16>& out, const std::vector<float>& ref,
                         int64_t tokens, int64_t q_width, double abs_tol, const std::string& what) {
  const int64_t stride = q_width + 8;
  size_t bad = 0, padding_written = 0;
  double err_sq = 0, ref_sq = 0;
  for (int64_t r = 0; r < tokens; ++r) {
    for (int64_t j = 0; j < q_width; ++j) {
      const double g = BFloat16ToFloat(out[r * stride + j]), want = ref[r * q_width + j];
      const double err = std::fabs(g - want);
      err_sq += (g - want) * (g - want);
      ref_sq += want * want;
      if (!(err <= std::ldexp(std::fabs(want), -8) + abs_tol) && ++bad <= 5) {
        ADD_FAILURE() << what << ": row " << r << " col " << j << " gpu " << g << " ref " << want;
      }
    }
    for (int64_t j = q_width; j < stride; ++j) {
      padding_written += out[r * stride + j].bits != kBf16PoisonBits;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": elements out of tolerance";
  EXPECT_EQ(padding_written, 0u) << what << ": wrote past q_heads * head_dim";
  if (ref_sq > 0) {
    EXPECT_LE(std::sqrt(err_sq / ref_sq), 1e-2) << what;
  }
}

// Two copies of a case's step, each with its own cache and QKV rows, set up for RoPE inside
// the decode kernel (PagedAttentionParams::rope): the step rows' positions and slots, new keys
// and values for them (the random k and v columns of their QKV rows, unrotated), and the
// launch's parameters, compared bit for bit after the caller has run them.
struct RopeRun {
  DeviceBuffer cache, qkv, out;
  RopeParams rope;
  PagedKvWriteParams store;
  PagedAttentionParams p;
};
struct RopeRuns {
  DeviceBuffer d_pos, d_slots, d_inv;
  size_t cache_bytes = 0, out_elems = 0;
  RopeRun run[2];  // rope.kv_store points into each: filled in place, never moved
};

// `table`: rotate with an inverse-frequency table (a scaled one's shape), else with theta.
void SetUpRopeRuns(cudaStream_t stream, const PagedCase& c, const PagedStep& st,
                   const PagedAttentionParams& base, bool table, RopeRuns* rr) {
  const int64_t hd = c.head_dim, kv_width = c.kv_heads * hd;
  std::vector<int32_t> positions, slots;
  for (size_t s = 0; s < c.context.size(); ++s) {
    for (int32_t j = 0; j < c.query[s]; ++j) {
      const int32_t pos = c.context[s] - c.query[s] + j;
      const int32_t block = st.block_tables[s * st.max_blocks + pos / c.block_size];
      positions.push_back(pos);
      slots.push_back(static_cast<int32_t>(block * c.block_size + pos % c.block_size));
    }
  }
  std::vector<double> inv_freq(static_cast<size_t>(hd / 2));
  for (int64_t i = 0; i < hd / 2; ++i) {
    inv_freq[i] = std::pow(500000.0, -2.0 * i / hd) * (i < hd / 8 ? 1.0 : 0.125);
  }
  TP_ASSERT_OK_AND_ASSIGN(rr->d_pos, Upload(positions, "positions"));
  TP_ASSERT_OK_AND_ASSIGN(rr->d_slots, Upload(slots, "slots"));
  TP_ASSERT_OK_AND_ASSIGN(rr->d_inv, Upload(inv_freq, "inv_freq"));
  rr->cache_bytes = static_cast<size_t>(st.layout.Elements() * KvCacheElementBytes(c.dtype));
  rr->out_elems = static_cast<size_t>(st.tokens * base.out_row_stride);
  for (RopeRun& r : rr->run) {
    TP_ASSERT_OK_AND_ASSIGN(r.cache, DeviceBuffer::Allocate(rr->cache_bytes, "cache"));
    TP_CUDA_CHECK_FOR_TEST(cudaMemcpyAsync(r.cache.data(), st.d_cache.data(), rr->cache_bytes,
                                           cudaMemcpyDeviceToDevice, stream));
    TP_ASSERT_OK_AND_ASSIGN(r.qkv, Upload(st.q_qkv, "qkv"));
    TP_ASSERT_OK_AND_ASSIGN(r.out,
                            PoisonedBuffer(DataType::kBFloat16, rr->out_elems, "out", stream));
    BFloat16* qkv = r.qkv.as<BFloat16>();
    r.rope.q = qkv;
    r.rope.q_row_stride = st.qkv_stride;
    r.rope.q_heads = c.q_heads;
    r.rope.k = qkv + st.q_width;
    r.rope.k_row_stride = st.qkv_stride;
    r.rope.kv_heads = c.kv_heads;
    r.rope.head_dim = hd;
    r.rope.positions = rr->d_pos.as<int32_t>();
    r.rope.rows = st.tokens;
    r.rope.theta = 10000.0;
    r.rope.inv_freq = table ? rr->d_inv.as<double>() : nullptr;
    r.store.k = r.rope.k;
    r.store.k_row_stride = st.qkv_stride;
    r.store.v = qkv + st.q_width + kv_width;
    r.store.v_row_stride = st.qkv_stride;
    r.store.slot_mapping = rr->d_slots.as<int32_t>();
    r.store.rows = st.tokens;
    r.store.cache = r.cache.data();
    r.store.layout = st.layout;
    r.store.layer = st.layer;
    r.store.scales = c.scales;
    r.rope.kv_store = &r.store;
    r.p = base;
    r.p.q = qkv;
    r.p.cache = r.cache.data();
    r.p.out = r.out.as<BFloat16>();
    r.p.out_fp8 = nullptr;
    r.p.context_constant = true;
  }
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
}

// The two runs' caches and outputs, bit for bit (after both have run and been waited for);
// and the step's rows did change the cache (else the case would be weak).
void ExpectRopeRunsAgree(const PagedStep& st, const RopeRuns& rr, const std::string& what) {
  const size_t bytes = rr.cache_bytes;
  TP_ASSERT_OK_AND_ASSIGN(auto before, Download<uint8_t>(st.d_cache.data(), bytes));
  TP_ASSERT_OK_AND_ASSIGN(auto cache_ref, Download<uint8_t>(rr.run[0].cache.data(), bytes));
  TP_ASSERT_OK_AND_ASSIGN(auto cache_got, Download<uint8_t>(rr.run[1].cache.data(), bytes));
  size_t stored = 0, cache_differ = 0;
  for (size_t i = 0; i < bytes; ++i) {
    stored += cache_ref[i] != before[i];
    cache_differ += cache_got[i] != cache_ref[i];
  }
  EXPECT_GT(stored, 0u) << what << ": the step's rows did not change the cache (a weak case)";
  EXPECT_EQ(cache_differ, 0u) << what << ": the cache bytes differ";
  TP_ASSERT_OK_AND_ASSIGN(auto out_ref, Download<BFloat16>(rr.run[0].out.data(), rr.out_elems));
  TP_ASSERT_OK_AND_ASSIGN(auto out_got, Download<BFloat16>(rr.run[1].out.data(), rr.out_elems));
  size_t out_differ = 0;
  for (size_t i = 0; i < rr.out_elems; ++i) {
    if (out_got[i].bits != out_ref[i].bits && ++out_differ <= 5) {
      ADD_FAILURE() << what << ": output element " << i << " " << BFloat16ToFloat(out_got[i])
                    << ", against " << BFloat16ToFloat(out_ref[i]);
    }
  }
  EXPECT_EQ(out_differ, 0u) << what << ": the outputs differ";
}

// RoPE and the cache store inside the decode kernel against LaunchRope (storing the step's
// rows) and then the same launch: output and the whole cache bit for bit, q left as it was. A
// kernel that attended the cache's old rows, or rotated with another angle, would differ. Odd
// seeds rotate with an inverse-frequency table, even ones with theta.
void CheckRopeInAttention(cudaStream_t stream, const PagedCase& c, const PagedStep& st,
                          const PagedAttentionParams& base, uint32_t seed,
                          const std::string& what) {
  RopeRuns rr;
  SetUpRopeRuns(stream, c, st, base, seed % 2 == 1, &rr);
  if (::testing::Test::HasFatalFailure()) return;
  RopeRun& unfused = rr.run[0];
  RopeRun& fused = rr.run[1];
  fused.p.rope = &fused.rope;
  ASSERT_TRUE(PagedAttentionTakesRope(fused.p)) << what;
  TP_ASSERT_OK(LaunchRope(unfused.rope, stream));
  TP_ASSERT_OK(LaunchPagedAttention(unfused.p, stream));
  TP_ASSERT_OK(LaunchPagedAttention(fused.p, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  ExpectRopeRunsAgree(st, rr, what + ", rope in the kernel against LaunchRope first");
  TP_ASSERT_OK_AND_ASSIGN(auto q_after, Download<BFloat16>(fused.qkv.data(), st.q_qkv.size()));
  size_t q_written = 0;
  for (size_t i = 0; i < q_after.size(); ++i) q_written += q_after[i].bits != st.q_qkv[i].bits;
  EXPECT_EQ(q_written, 0u) << what << ": rope in the kernel wrote its QKV rows";
}

void CheckPagedAttention(cudaStream_t stream, const PagedCase& c, uint32_t seed) {
  const std::string what = "paged attention " + Describe(c);
  PagedStep st;
  CpuKvCache* cpu = nullptr;
  std::vector<std::unique_ptr<CpuKvCache>> owner;
  BuildStep(stream, c, seed, &st, &cpu, &owner);
  if (::testing::Test::HasFatalFailure()) return;

  std::vector<float> ref(static_cast<size_t>(st.tokens * st.q_width));
  TP_ASSERT_OK(PagedAttention(*cpu, st.layer, st.q_f.data(), c.q_heads, st.cu_seqlens, c.context,
                              st.block_tables, st.max_blocks, ref.data()));

  PagedAttentionParams p = AttentionParamsFor(c, st);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_ws, AttachWorkspace(c, st, &p));
  std::vector<int32_t> multi;
  for (size_t s = 0; s < c.query.size(); ++s) {
    if (c.query[s] >= 2) multi.push_back(static_cast<int32_t>(s));
  }
  DeviceBuffer d_multi;
  if (c.multi_row_list) {
    TP_ASSERT_OK_AND_ASSIGN(d_multi, Upload(multi, "multi_row_seqs"));
    p.multi_row_seqs = d_multi.as<int32_t>();
    p.multi_row_count = static_cast<int64_t>(multi.size());
  }
  const size_t out_elems = static_cast<size_t>(std::max<int64_t>(st.tokens, 1) * p.out_row_stride);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_out,
                          PoisonedBuffer(DataType::kBFloat16, out_elems, "out", stream));
  p.out = d_out.as<BFloat16>();
  int device = 0, sms = 0;
  TP_CUDA_CHECK_FOR_TEST(cudaGetDevice(&device));
  TP_CUDA_CHECK_FOR_TEST(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t splits = PagedAttentionSplitsFor(p, sms);
  if (c.splits > 0 && c.with_workspace) {
    EXPECT_EQ(splits, std::min(c.splits, PagedAttentionMaxSplits(st.max_blocks * c.block_size)))
        << what;
  }
  if (!c.with_workspace) {
    EXPECT_EQ(splits, 1) << what;
  }
  TP_ASSERT_OK(LaunchPagedAttention(p, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_out.data(), out_elems));
  // The tensor-core prefill kernel's P is BF16: up to 2^-8 of max |v| = 1 per output (the
  // packed kernel's bound in gpu_ops_test.cc); so is the decode kernel's over an E4M3 cache
  // (2^-8 of max |v|). The split kernels stay in FP32, and the decode kernel's P over a BF16
  // cache keeps about 16 bits (a BF16 high part and remainder), within the FP32 bound. Both
  // scale with the values' range.
  const bool decode_kernel = TakesDecodeKernel(c, p);
  const bool bf16_p = c.multi_row_list || (decode_kernel && c.dtype == KvCacheDtype::kFloat8E4M3);
  const double abs_tol = (bf16_p ? std::ldexp(1.0, -8) : 2e-5) * c.kv_range;
  ExpectAttentionNear(out, ref, st.tokens, st.q_width, abs_tol,
                      what + " (" + std::to_string(splits) + " splits" +
                          (decode_kernel ? ", decode kernel)" : ")"));

  // context_constant moves the decode kernel's loads of earlier keys before its PDL wait; what
  // it computes stays the same, bit for bit (no kernel runs ahead here: the order is all).
  PagedAttentionParams early = p;
  early.context_constant = true;
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_early,
                          PoisonedBuffer(DataType::kBFloat16, out_elems, "early", stream));
  early.out = d_early.as<BFloat16>();
  TP_ASSERT_OK(LaunchPagedAttention(early, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(auto out_early, Download<BFloat16>(d_early.data(), out_elems));
  size_t differ = 0;
  for (size_t i = 0; i < out_elems; ++i) differ += out[i].bits != out_early[i].bits;
  EXPECT_EQ(differ, 0u) << what << ": context_constant changed the output";

  // E4M3 codes instead of BF16 (o's input): each the code of the BF16 output over the scale,
  // as LaunchQuantizeToFp8E4M3 (and the CPU's FloatToFp8E4M3 of the float quotient) gives it;
  // a scale that puts the largest outputs near E4M3's 448, and a row stride of its own.
  PagedAttentionParams codes = p;
  codes.out = nullptr;
  codes.out_fp8_row_stride = st.q_width + 16;
  const size_t fp8_elems = static_cast<size_t>(std::max<int64_t>(st.tokens, 1)) *
                           static_cast<size_t>(codes.out_fp8_row_stride);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_codes,
                          PoisonedBuffer(DataType::kFloat8E4M3, fp8_elems, "codes", stream));
  const float scale = c.kv_range / 256.0f;
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_scale, Upload(std::vector<float>{scale}, "scale"));
  codes.out_fp8 = d_codes.as<uint8_t>();
  codes.out_fp8_scale = d_scale.as<float>();
  TP_ASSERT_OK(LaunchPagedAttention(codes, stream));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream));
  TP_ASSERT_OK_AND_ASSIGN(auto got, Download<uint8_t>(d_codes.data(), fp8_elems));
  size_t wrong = 0, padding = 0;
  for (int64_t r = 0; r < st.tokens; ++r) {
    for (int64_t j = 0; j < codes.out_fp8_row_stride; ++j) {
      const uint8_t have = got[r * codes.out_fp8_row_stride + j];
      if (j >= st.q_width) {
        padding += have != kFp8E4M3PoisonBits;
        continue;
      }
      const uint8_t want = FloatToFp8E4M3(BFloat16ToFloat(out[r * p.out_row_stride + j]) / scale);
      if (have != want && ++wrong <= 5) {
        ADD_FAILURE() << what << ": E4M3 out row " << r << " col " << j << " code " << int{have}
                      << ", want " << int{want};
      }
    }
  }
  EXPECT_EQ(wrong, 0u) << what << ": E4M3 codes differ from the BF16 output's";
  EXPECT_EQ(padding, 0u) << what << ": E4M3 out wrote past q_heads * head_dim";

  if (decode_kernel && !c.multi_row_list) CheckRopeInAttention(stream, c, st, p, seed, what);
}

// ---------------------------------------------------------------------------------------------
// KV write and attention

TEST_F(GpuGenerationOpsTest, DecodeMatchesReferenceWithSplitContexts) {
  TP_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> ctx{1, 2, 15, 17, 100, 257, 1023, 4097, 5000};
  const std::vector<int32_t> one(ctx.size(), 1);
  // GQA 8:2, head_dim 128, BF16 cache, block 16, the launcher's own split choice.
  PagedCase a{ctx, one};
  CheckPagedAttention(stream(), a, 400);
  // The same rows sized as if a sequence could have several (max_query_rows = tokens): the
  // split kernels of several rows instead of the decode kernel.
  PagedCase rows = a;
  rows.max_query_rows = static_cast<int64_t>(ctx.size());
  CheckPagedAttention(stream(), rows, 400);
  // GQA 4:4, head_dim 64, FP8 cache, block 32, a forced split count.
  PagedCase b{ctx, one, 4, 4, 64, 32, KvCacheDtype::kFloat8E4M3};
  b.splits = 7;
  CheckPagedAttention(stream(), b, 401);
  // The same without a workspace: one split.
  b.with_workspace = false;
  CheckPagedAttention(stream(), b, 402);
  // FP8 at head_dim 128 / block 32 and BF16 at head_dim 64 / block 16, peaky softmax.
  PagedCase c2{ctx, one, 8, 2, 128, 32, KvCacheDtype::kFloat8E4M3};
  c2.q_range = 6.0f;
  c2.splits = 20;
  CheckPagedAttention(stream(), c2, 403);
  PagedCase d{ctx, one, 8, 2, 64, 16, KvCacheDtype::kBFloat16};
  d.q_range = 6.0f;
  CheckPagedAttention(stream(), d, 404);
  // Eight query heads per KV head (every query column of the decode kernel's MMAs) and two;
  // a block size that is not a power of two (the kernel's division path).
  PagedCase e{ctx, one, 16, 2, 128, 16, KvCacheDtype::kBFloat16};
  e.q_range = 6.0f;
  CheckPagedAttention(stream(), e, 405);
  PagedCase f{ctx, one, 4, 2, 128, 24, KvCacheDtype::kFloat8E4M3};
  CheckPagedAttention(stream(), f, 406);
  // Keys and values up to E4M3's largest finite value: with the cases above ([-1, 1], whose
  // codes include every subnormal) every code the cache writer can store is widened.
  PagedCase wide{ctx, one, 8, 2, 128, 16, KvCacheDtype::kFloat8E4M3};
  wide.kv_range = 448.0f;
  wide.q_range = 0.002f;
  CheckPagedAttention(stream(), wide, 407);
  // Queries outside E4M3's range either way (above 448; far below its smallest code): over an
  // E4M3 cache only the keys and values are codes, and a kernel that took q to E4M3 too would
  // have to scale it first.
  PagedCase big_q{ctx, one, 8, 2, 128, 16, KvCacheDtype::kFloat8E4M3};
  big_q.q_range = 600.0f;
  big_q.kv_range = 0.02f;
  CheckPagedAttention(stream(), big_q, 408);
  PagedCase tiny_q = big_q;
  tiny_q.q_range = 1e-20f;
  tiny_q.kv_range = 1.0f;
  CheckPagedAttention(stream(), tiny_q, 409);
}

TEST_F(GpuGenerationOpsTest, PrefillChunksStartingMidBlockMatchReference) {
  TP_SKIP_WITHOUT_GPU();
  // A mixed step: a whole prompt, chunks that start mid-block (50 = 3 * 16 + 2, 100 = 6 * 16 +
  // 4), decode rows, and a sequence with no query rows this step.
  const std::vector<int32_t> ctx{37, 100, 129, 5, 300, 10, 1};
  const std::vector<int32_t> query{37, 50, 29, 5, 1, 0, 1};
  PagedCase a{ctx, query};  // 8:2, 128, block 16, BF16
  CheckPagedAttention(stream(), a, 410);
  PagedCase b{ctx, query, 4, 4, 64, 32, KvCacheDtype::kFloat8E4M3};
  CheckPagedAttention(stream(), b, 411);
  PagedCase c2{ctx, query, 8, 2, 64, 32, KvCacheDtype::kBFloat16};
  c2.splits = 3;  // prefill rows through the split path too
  CheckPagedAttention(stream(), c2, 412);
  // max_query_rows underestimated: CTAs loop over the pair tiles.
  PagedCase d{ctx, query, 4, 4, 128, 16, KvCacheDtype::kFloat8E4M3};
  d.max_query_rows = 1;
  CheckPagedAttention(stream(), d, 413);
  // A long chunk in the middle of a long context, split.
  PagedCase e{{2000, 3}, {300, 3}, 8, 2, 128, 16, KvCacheDtype::kBFloat16};
  e.splits = 5;
  CheckPagedAttention(stream(), e, 414);
}

TEST_F(GpuGenerationOpsTest, MultiRowSequencesOnTheTensorCoreKernelMatchReference) {
  TP_SKIP_WITHOUT_GPU();
  // Whole prompts (no cached prefix), chunks after a prefix that start mid-block, decode rows
  // over long contexts, a sequence with no rows and one-row chunks: multi-row sequences go to
  // the tensor-core kernel, the rest to the split kernels, in one launch.
  const std::vector<int32_t> ctx{37, 100, 129, 5, 3000, 10, 1, 700, 2, 64};
  const std::vector<int32_t> query{37, 50, 29, 5, 1, 0, 1, 300, 2, 1};
  PagedCase a{ctx, query};  // 8:2, 128, block 16, BF16
  a.multi_row_list = true;
  CheckPagedAttention(stream(), a, 420);
  PagedCase b{ctx, query, 4, 4, 64, 32, KvCacheDtype::kBFloat16};
  b.multi_row_list = true;
  b.q_range = 6.0f;  // peaky softmax
  CheckPagedAttention(stream(), b, 421);
  // An E4M3 cache (widened to BF16 on the tensor-core kernel's way to shared memory).
  PagedCase f{ctx, query, 8, 2, 128, 32, KvCacheDtype::kFloat8E4M3};
  f.multi_row_list = true;
  CheckPagedAttention(stream(), f, 424);
  PagedCase f64{ctx, query, 4, 4, 64, 16, KvCacheDtype::kFloat8E4M3};
  f64.multi_row_list = true;
  CheckPagedAttention(stream(), f64, 425);
  // Every sequence multi-row (the split kernels launch nothing), max_query_rows
  // underestimated (blocks loop over the query tiles), a 1536-row prompt and a 1000-row chunk
  // after 2072 cached tokens.
  PagedCase c2{{1536, 3072, 130}, {1536, 1000, 130}, 8, 2, 128, 16, KvCacheDtype::kBFloat16};
  c2.multi_row_list = true;
  c2.max_query_rows = 200;
  CheckPagedAttention(stream(), c2, 422);
}

TEST_F(GpuGenerationOpsTest, Fp8CacheScalesMatchReference) {
  TP_SKIP_WITHOUT_GPU();
  // A checkpoint's KV cache scales (PagedAttentionParams::scales): the cache holds x / scale,
  // the kernels fold the scales into the scores and the output; the reference stores and reads
  // through CpuKvCache with the same scales, and the cache bytes must equal its codes.
  // Keys and values up to 1000 with scales 4 and 8 (codes up to 250 and 125: at scale 1 they
  // would saturate at 448, far outside the tolerance), then scales that are not powers of two
  // (the division's rounding path) and below 1; decode rows over split contexts, the split
  // kernels' prefill rows, and the tensor-core kernel's multi-row sequences.
  const std::vector<int32_t> ctx{1, 17, 100, 1023, 4097};
  const std::vector<int32_t> one(ctx.size(), 1);
  const std::vector<int32_t> pctx{37, 100, 129, 5, 300};
  const std::vector<int32_t> pquery{37, 50, 29, 5, 1};
  uint32_t seed = 430;
  for (const KvScales scales : {KvScales{4.0f, 8.0f}, KvScales{0.37f, 2.9f}}) {
    const float range = scales.k == 4.0f ? 1000.0f : 1.0f;
    for (const int64_t hd : {int64_t{128}, int64_t{64}}) {
      PagedCase decode{ctx, one, 8, 2, hd, 16, KvCacheDtype::kFloat8E4M3};
      PagedCase rows{pctx, pquery, 4, 4, hd, 32, KvCacheDtype::kFloat8E4M3};
      PagedCase multi = rows;
      multi.multi_row_list = true;
      for (PagedCase* c : {&decode, &rows, &multi}) {
        c->scales = scales;
        c->kv_range = range;
        c->q_range = 2.0f / range;  // scores of a few units
        CheckPagedAttention(stream(), *c, seed++);
      }
    }
  }
}

TEST_F(GpuGenerationOpsTest, MultiRowListRejectsACountAboveNumSeqs) {
  TP_SKIP_WITHOUT_GPU();
  PagedCase c{{40, 3}, {40, 1}};
  PagedStep st;
  CpuKvCache* cpu = nullptr;
  std::vector<std::unique_ptr<CpuKvCache>> owner;
  BuildStep(stream(), c, 423, &st, &cpu, &owner);
  if (HasFatalFailure()) return;
  PagedAttentionParams p = AttentionParamsFor(c, st);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_multi, Upload(std::vector<int32_t>{0}, "multi"));
  TP_ASSERT_OK_AND_ASSIGN(
      DeviceBuffer d_out,
      PoisonedBuffer(DataType::kBFloat16, static_cast<size_t>(st.tokens * p.out_row_stride), "out",
                     stream()));
  p.out = d_out.as<BFloat16>();
  p.multi_row_seqs = d_multi.as<int32_t>();
  p.multi_row_count = 3;  // num_seqs is 2
  const Status s = LaunchPagedAttention(p, stream());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("multi_row_count"), std::string::npos) << s.ToString();
}

TEST_F(GpuGenerationOpsTest, KvWriteSaturatesFp8LikeTheReference) {
  TP_SKIP_WITHOUT_GPU();
  // Values beyond E4M3's 448 and in its subnormal range, written to an FP8 cache.
  const KvCacheLayout layout{/*layers=*/3,      /*num_blocks=*/5,
                             /*block_size=*/16, /*kv_heads=*/3,
                             /*head_dim=*/64,   KvCacheDtype::kFloat8E4M3};
  CpuKvCache cpu(layout);
  const int64_t rows = 37, width = layout.kv_heads * layout.head_dim, stride = 2 * width + 16;
  std::vector<BFloat16> kv = RandomBf16(rows * stride, -1000.0f, 1000.0f, 420);
  const std::vector<BFloat16> tiny = RandomBf16(rows * stride, -0.01f, 0.01f, 421);
  for (size_t i = 0; i < kv.size(); i += 3) kv[i] = tiny[i];
  std::vector<int32_t> table{4, 0, 3};
  std::vector<int32_t> positions(rows), slots(rows);
  std::vector<float> k(rows * width), v(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    positions[r] = static_cast<int32_t>(r + 5);  // starts mid-block
    slots[r] = table[positions[r] / 16] * 16 + positions[r] % 16;
    for (int64_t j = 0; j < width; ++j) {
      k[r * width + j] = BFloat16ToFloat(kv[r * stride + j]);
      v[r * width + j] = BFloat16ToFloat(kv[r * stride + width + j]);
    }
  }
  cpu.Write(2, k.data(), v.data(), rows, positions.data(), table.data());
  const size_t bytes = static_cast<size_t>(layout.Elements());
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_cache, DeviceBuffer::Allocate(bytes, "cache"));
  TP_CUDA_CHECK_FOR_TEST(cudaMemsetAsync(d_cache.data(), 0, bytes, stream()));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_kv, Upload(kv, "kv"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_slots, Upload(slots, "slots"));
  PagedKvWriteParams w;
  w.k = d_kv.as<BFloat16>();
  w.k_row_stride = stride;
  w.v = d_kv.as<BFloat16>() + width;
  w.v_row_stride = stride;
  w.slot_mapping = d_slots.as<int32_t>();
  w.rows = rows;
  w.cache = d_cache.data();
  w.layout = layout;
  w.layer = 2;
  TP_ASSERT_OK(LaunchPagedKvWrite(w, stream()));
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(auto got, Download<uint8_t>(d_cache.data(), bytes));
  size_t mismatches = 0;
  for (int64_t layer = 0; layer < layout.layers; ++layer) {
    for (int kvi = 0; kvi < 2; ++kvi) {
      for (int64_t b = 0; b < layout.num_blocks; ++b) {
        for (int64_t h = 0; h < layout.kv_heads; ++h) {
          for (int64_t s = 0; s < layout.block_size; ++s) {
            for (int64_t d = 0; d < layout.head_dim; ++d) {
              const float want = cpu.Read(layer, kvi, b, h, s, d);
              const float have = Fp8E4M3ToFloat(got[layout.Offset(layer, kvi, b, h, s) + d]);
              mismatches += !(want == have);
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

// RoPE that also stores K and V in the paged cache (RopeParams::kv_store, one kernel) leaves
// the QKV rows and the whole pool bit for bit as RoPE followed by LaunchPagedKvWrite: BF16 and
// E4M3 caches, padding and corrupt slots skipped, and a head_dim the fused kernel does not
// take (two kernels then).
TEST_F(GpuGenerationOpsTest, RopeStoringTheCacheEqualsRopeThenKvWrite) {
  TP_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t head_dim;
    KvCacheDtype dtype;
  };
  for (const Case& c : {Case{128, KvCacheDtype::kBFloat16}, Case{128, KvCacheDtype::kFloat8E4M3},
                        Case{24, KvCacheDtype::kBFloat16}}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << c.head_dim << ", "
                                      << (c.dtype == KvCacheDtype::kBFloat16 ? "bf16" : "fp8"));
    const KvCacheLayout layout{/*layers=*/2,      /*num_blocks=*/6,
                               /*block_size=*/16, /*kv_heads=*/2,   c.head_dim, c.dtype};
    const int64_t q_heads = 4, rows = 21, hd = c.head_dim;
    const int64_t stride = (q_heads + 2 * layout.kv_heads) * hd + 8;
    const std::vector<BFloat16> qkv = RandomBf16(rows * stride, -4.0f, 4.0f, 77);
    std::vector<int32_t> positions(rows), slots(rows);
    for (int64_t r = 0; r < rows; ++r) {
      positions[r] = static_cast<int32_t>(37 * r + 3);
      slots[r] = static_cast<int32_t>((r * 5) % (layout.num_blocks * 16));
    }
    slots[4] = -1;                                                // padding
    slots[9] = static_cast<int32_t>(layout.num_blocks * 16 + 2);  // corrupt
    const size_t bytes = static_cast<size_t>(layout.Elements()) * KvCacheElementBytes(c.dtype);
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_pos, Upload(positions, "positions"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_slots, Upload(slots, "slots"));
    std::vector<uint8_t> got_cache[2];
    std::vector<BFloat16> got_qkv[2];
    for (int fused = 0; fused < 2; ++fused) {
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_qkv, Upload(qkv, "qkv"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_cache, DeviceBuffer::Allocate(bytes, "cache"));
      TP_CUDA_CHECK_FOR_TEST(cudaMemsetAsync(d_cache.data(), 0, bytes, stream()));
      RopeParams p;
      p.q = d_qkv.as<BFloat16>();
      p.q_row_stride = stride;
      p.q_heads = q_heads;
      p.k = p.q + q_heads * hd;
      p.k_row_stride = stride;
      p.kv_heads = layout.kv_heads;
      p.head_dim = hd;
      p.positions = d_pos.as<int32_t>();
      p.rows = rows;
      p.theta = 500000.0;
      PagedKvWriteParams w;
      w.k = p.k;
      w.k_row_stride = stride;
      w.v = p.k + layout.kv_heads * hd;
      w.v_row_stride = stride;
      w.slot_mapping = d_slots.as<int32_t>();
      w.rows = rows;
      w.cache = d_cache.data();
      w.layout = layout;
      w.layer = 1;
      if (fused == 1) {
        p.kv_store = &w;
        TP_ASSERT_OK(LaunchRope(p, stream()));
      } else {
        TP_ASSERT_OK(LaunchRope(p, stream()));
        TP_ASSERT_OK(LaunchPagedKvWrite(w, stream()));
      }
      TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
      TP_ASSERT_OK_AND_ASSIGN(got_cache[fused], Download<uint8_t>(d_cache.data(), bytes));
      TP_ASSERT_OK_AND_ASSIGN(got_qkv[fused], Download<BFloat16>(d_qkv.data(), qkv.size()));
    }
    // 19 rows have a slot: their K and V bytes, nearly all non-zero (random values).
    const size_t row_bytes = 2 * layout.kv_heads * hd * KvCacheElementBytes(c.dtype);
    size_t stored = 0;
    for (uint8_t b : got_cache[0]) stored += b != 0;
    EXPECT_GT(stored, 19 * row_bytes * 3 / 4) << "the reference wrote (almost) nothing";
    EXPECT_LE(stored, 19 * row_bytes) << "more than the rows with a slot";
    EXPECT_TRUE(got_cache[0] == got_cache[1]) << "the caches differ";
    size_t qkv_diff = 0, rotated = 0;
    for (size_t i = 0; i < qkv.size(); ++i) {
      qkv_diff += got_qkv[0][i].bits != got_qkv[1][i].bits;
      rotated += got_qkv[0][i].bits != qkv[i].bits;
    }
    EXPECT_EQ(qkv_diff, 0u);
    EXPECT_GT(rotated, 0u);
  }
}

TEST_F(GpuGenerationOpsTest, DecodeAttentionReplaysInACudaGraph) {
  TP_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> ctx{1, 33, 700, 4999, 2500};
  PagedCase c{ctx, std::vector<int32_t>(ctx.size(), 1)};
  PagedStep st;
  CpuKvCache* cpu = nullptr;
  std::vector<std::unique_ptr<CpuKvCache>> owner;
  BuildStep(stream(), c, 430, &st, &cpu, &owner);
  if (HasFatalFailure()) return;
  PagedAttentionParams p = AttentionParamsFor(c, st);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_ws, AttachWorkspace(c, st, &p));
  const size_t out_elems = static_cast<size_t>(st.tokens * p.out_row_stride);
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_eager,
                          PoisonedBuffer(DataType::kBFloat16, out_elems, "eager", stream()));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_graph,
                          PoisonedBuffer(DataType::kBFloat16, out_elems, "graph", stream()));
  int device = 0, sms = 0;
  TP_CUDA_CHECK_FOR_TEST(cudaGetDevice(&device));
  TP_CUDA_CHECK_FOR_TEST(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  EXPECT_GT(PagedAttentionSplitsFor(p, sms), 1) << "the graph should hold the split path";

  PagedAttentionParams eager = p;
  eager.out = d_eager.as<BFloat16>();
  PagedAttentionParams graphed = p;
  graphed.out = d_graph.as<BFloat16>();
  TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
  TP_ASSERT_OK_AND_ASSIGN(CudaGraphExec graph,
                          CudaGraphExec::Capture(stream(), cudaStreamCaptureModeThreadLocal, [&]() {
                            return LaunchPagedAttention(graphed, stream());
                          }));

  // Two rounds: the captured values, then new contexts and queries written into the same
  // device buffers (the graph reads them at replay).
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      // Within each sequence's blocks (slots past the written tokens hold zeros on both sides).
      std::vector<int32_t> ctx2{16, 1, 704, 1200, 2512};
      std::vector<BFloat16> q2 =
          RandomBf16(static_cast<size_t>(st.tokens * st.qkv_stride), -2.0f, 2.0f, 431);
      TP_CUDA_CHECK_FOR_TEST(
          cudaMemcpy(st.d_ctx.data(), ctx2.data(), ctx2.size() * 4, cudaMemcpyHostToDevice));
      TP_CUDA_CHECK_FOR_TEST(
          cudaMemcpy(st.d_q.data(), q2.data(), q2.size() * 2, cudaMemcpyHostToDevice));
      TP_CUDA_CHECK_FOR_TEST(cudaDeviceSynchronize());
      std::vector<float> q_f(static_cast<size_t>(st.tokens * st.q_width));
      for (int64_t r = 0; r < st.tokens; ++r) {
        for (int64_t j = 0; j < st.q_width; ++j) {
          q_f[r * st.q_width + j] = BFloat16ToFloat(q2[r * st.qkv_stride + j]);
        }
      }
      std::vector<float> ref(q_f.size());
      TP_ASSERT_OK(PagedAttention(*cpu, st.layer, q_f.data(), c.q_heads, st.cu_seqlens, ctx2,
                                  st.block_tables, st.max_blocks, ref.data()));
      TP_ASSERT_OK(graph.Launch(stream()));
      TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
      TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_graph.data(), out_elems));
      ExpectAttentionNear(out, ref, st.tokens, st.q_width, 2e-5, "graph replay, new contexts");
    }
    TP_ASSERT_OK(LaunchPagedAttention(eager, stream()));
    TP_ASSERT_OK(graph.Launch(stream()));
    TP_ASSERT_OK(graph.Launch(stream()));  // replays are repeatable
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK_AND_ASSIGN(auto e, Download<BFloat16>(d_eager.data(), out_elems));
    TP_ASSERT_OK_AND_ASSIGN(auto g, Download<BFloat16>(d_graph.data(), out_elems));
    size_t differ = 0;
    for (size_t i = 0; i < out_elems; ++i) differ += e[i].bits != g[i].bits;
    EXPECT_EQ(differ, 0u) << "round " << round << ": graph replay differs from the eager launch";
  }
}

// The cases of the tests below that queue a write ahead of the decode kernel: contexts of 1 to
// 4097 keys (one tile to several splits), one query row each, GQA 8:2, head_dim 128.
PagedCase WaitCase(KvCacheDtype dtype) {
  const std::vector<int32_t> ctx{1, 2, 17, 64, 65, 100, 1023, 4097};
  return PagedCase{ctx, std::vector<int32_t>(ctx.size(), 1), 8, 2, 128, 16, dtype};
}

// With context_constant the decode kernel loads keys written before the step ahead of its PDL
// wait. Here the kernel ahead (a PDL cache write of each sequence's newest row, new keys and
// values over the old) is held back by a 200 us delay kernel that lets both start at once: the
// attention kernel's CTAs run their part before the wait while the write has not happened yet.
// Output computed with the old newest row instead of the new one shows a load that did not
// wait: at context 1 the output is that row's value itself.
TEST_F(GpuGenerationOpsTest, DecodeAttentionWaitsForTheWriteOfItsRows) {
  TP_SKIP_WITHOUT_GPU();
  for (const KvCacheDtype dtype : {KvCacheDtype::kBFloat16, KvCacheDtype::kFloat8E4M3}) {
    const PagedCase c = WaitCase(dtype);
    const std::string what = "write ahead of attention, " + Describe(c);
    PagedStep st;
    CpuKvCache* cpu = nullptr;
    std::vector<std::unique_ptr<CpuKvCache>> owner;
    BuildStep(stream(), c, 440, &st, &cpu, &owner);
    if (HasFatalFailure()) return;

    // New keys and values for position ctx - 1 of every sequence: into the CPU cache now, into
    // the GPU's by the write queued ahead of attention.
    const std::vector<int32_t>& ctx = c.context;
    const int64_t seqs = static_cast<int64_t>(ctx.size());
    const int64_t kv_width = c.kv_heads * c.head_dim;
    const std::vector<BFloat16> k_new =
        RandomBf16(static_cast<size_t>(seqs * kv_width), -c.kv_range, c.kv_range, 441);
    const std::vector<BFloat16> v_new =
        RandomBf16(static_cast<size_t>(seqs * kv_width), -c.kv_range, c.kv_range, 442);
    std::vector<int32_t> slots(ctx.size());
    for (int64_t s = 0; s < seqs; ++s) {
      const int32_t pos = ctx[s] - 1;
      const int32_t* table = st.block_tables.data() + s * st.max_blocks;
      slots[s] =
          static_cast<int32_t>(table[pos / c.block_size] * c.block_size + pos % c.block_size);
      std::vector<float> k(kv_width), v(kv_width);
      for (int64_t j = 0; j < kv_width; ++j) {
        k[j] = BFloat16ToFloat(k_new[s * kv_width + j]);
        v[j] = BFloat16ToFloat(v_new[s * kv_width + j]);
      }
      cpu->Write(st.layer, k.data(), v.data(), 1, &pos, table);
    }
    std::vector<float> ref(static_cast<size_t>(st.tokens * st.q_width));
    TP_ASSERT_OK(PagedAttention(*cpu, st.layer, st.q_f.data(), c.q_heads, st.cu_seqlens, c.context,
                                st.block_tables, st.max_blocks, ref.data()));

    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_k, Upload(k_new, "k_new"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_v, Upload(v_new, "v_new"));
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_slots, Upload(slots, "slots"));
    PagedKvWriteParams w;
    w.k = d_k.as<BFloat16>();
    w.k_row_stride = kv_width;
    w.v = d_v.as<BFloat16>();
    w.v_row_stride = kv_width;
    w.slot_mapping = d_slots.as<int32_t>();
    w.rows = seqs;
    w.cache = st.d_cache.data();
    w.layout = st.layout;
    w.layer = st.layer;

    PagedAttentionParams p = AttentionParamsFor(c, st);
    ASSERT_TRUE(TakesDecodeKernel(c, p)) << what;
    p.context_constant = true;
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_ws, AttachWorkspace(c, st, &p));
    const size_t out_elems = static_cast<size_t>(st.tokens * p.out_row_stride);
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_out,
                            PoisonedBuffer(DataType::kBFloat16, out_elems, "out", stream()));
    p.out = d_out.as<BFloat16>();
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK(LaunchGpuDelay(200 * 1000, stream(), /*let_next_start=*/true));
    TP_ASSERT_OK(LaunchPagedKvWrite(w, stream()));
    TP_ASSERT_OK(LaunchPagedAttention(p, stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK_AND_ASSIGN(auto out, Download<BFloat16>(d_out.data(), out_elems));
    const double abs_tol =
        (dtype == KvCacheDtype::kFloat8E4M3 ? std::ldexp(1.0, -8) : 2e-5) * c.kv_range;
    ExpectAttentionNear(out, ref, st.tokens, st.q_width, abs_tol, what);
  }
}

// With rope the decode kernel reads q, the step's keys and values after its PDL wait only
// (positions, slots and earlier keys may come before it). Here the kernel ahead rotates every
// q and k element in place (a RoPE launch at another position, no store), held back by a
// 200 us delay kernel that lets both start at once; run 0 waits for it on the host first. A
// read before the wait would see the unrotated rows, and the outputs or caches would differ.
TEST_F(GpuGenerationOpsTest, DecodeAttentionWithRopeWaitsForItsInputs) {
  TP_SKIP_WITHOUT_GPU();
  for (const KvCacheDtype dtype : {KvCacheDtype::kBFloat16, KvCacheDtype::kFloat8E4M3}) {
    const PagedCase c = WaitCase(dtype);
    const std::string what = "rope ahead of attention, " + Describe(c);
    PagedStep st;
    CpuKvCache* cpu = nullptr;
    std::vector<std::unique_ptr<CpuKvCache>> owner;
    BuildStep(stream(), c, 450, &st, &cpu, &owner);
    if (HasFatalFailure()) return;
    PagedAttentionParams base = AttentionParamsFor(c, st);
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d_ws, AttachWorkspace(c, st, &base));
    RopeRuns rr;
    SetUpRopeRuns(stream(), c, st, base, /*table=*/true, &rr);
    if (HasFatalFailure()) return;
    TP_ASSERT_OK_AND_ASSIGN(
        DeviceBuffer d_ahead,
        Upload(std::vector<int32_t>(static_cast<size_t>(st.tokens), 777), "ahead positions"));
    RopeParams ahead[2];
    for (int i = 0; i < 2; ++i) {
      ahead[i] = rr.run[i].rope;
      ahead[i].kv_store = nullptr;
      ahead[i].positions = d_ahead.as<int32_t>();
      rr.run[i].p.rope = &rr.run[i].rope;
      ASSERT_TRUE(PagedAttentionTakesRope(rr.run[i].p)) << what;
    }
    TP_ASSERT_OK(LaunchRope(ahead[0], stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK(LaunchPagedAttention(rr.run[0].p, stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    TP_ASSERT_OK(LaunchGpuDelay(200 * 1000, stream(), /*let_next_start=*/true));
    TP_ASSERT_OK(LaunchRope(ahead[1], stream()));
    TP_ASSERT_OK(LaunchPagedAttention(rr.run[1].p, stream()));
    TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
    ExpectRopeRunsAgree(st, rr, what);
  }
}

// SwiGLU in the small-M GEMM's epilogue (layers/small_m_gemm.h: LaunchSmallMGemmSwiGlu) against
// the GEMM and then the SwiGLU pass with a static E4M3 scale, as a decode step ran them: every
// code the same, the output's row padding untouched. Shapes from one 64-column block to
// llama3-8b's gate_up (28672 x 4096), 1 to 8 rows, an E4M3 scale that saturates some outputs.
TEST_F(GpuGenerationOpsTest, SmallMGemmSwiGluEqualsGemmThenSwiGlu) {
  TP_SKIP_WITHOUT_GPU();
  struct Shape {
    int64_t n, k;
  };
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer a_scale, Upload(std::vector<float>{0.5f}, "a_scale"));
  TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer b_scale, Upload(std::vector<float>{0.03f}, "b_scale"));
  // n = 48 and 1040: the up half starts in the middle of a 16-row tile of the unfused GEMM.
  for (const Shape s :
       {Shape{32, 64}, Shape{48, 64}, Shape{1040, 512}, Shape{2048, 512}, Shape{28672, 4096}}) {
    // gate and up have a variance of about 6.4e-3 k (codes uniform in [-4, 4), scales 0.5 and
    // 0.03): E4M3's 448 stands for 2.5 variances of silu(gate) * up, so that about 1 % of the
    // outputs saturate and the typical one lands near code 50.
    const float scale = 3.57e-5f * static_cast<float>(s.k);
    TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer out_scale, Upload(std::vector<float>{scale}, "scale"));
    for (const int64_t m : {int64_t{1}, int64_t{3}, int64_t{8}}) {
      const std::string what =
          "m=" + std::to_string(m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k);
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer a, DeviceBuffer::Allocate(m * s.k, "a"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer b, DeviceBuffer::Allocate(s.n * s.k, "b"));
      TP_ASSERT_OK(LaunchRandomUniform(a.data(), DataType::kFloat8E4M3,
                                       static_cast<size_t>(m * s.k), 81 + m, 4.0f, stream()));
      TP_ASSERT_OK(LaunchRandomUniform(b.data(), DataType::kFloat8E4M3,
                                       static_cast<size_t>(s.n * s.k), 82, 4.0f, stream()));
      // b_constant promises B held its values before any kernel ahead started: filled first.
      TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
      GemmParams p;
      p.m = m;
      p.n = s.n;
      p.k = s.k;
      p.lda = p.k;
      p.ldb = p.k;
      p.ldc = p.ldd = p.n;
      p.a_scale = a_scale.as<float>();
      p.b_scale = b_scale.as<float>();
      p.b_constant = true;
      ASSERT_TRUE(SmallMGemmFits(p)) << what;
      const int64_t inter = s.n / 2, ldo = inter + 16;
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer d, DeviceBuffer::Allocate(m * s.n * 2, "gate_up"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer want, DeviceBuffer::Allocate(m * inter, "want"));
      TP_ASSERT_OK_AND_ASSIGN(DeviceBuffer got,
                              PoisonedBuffer(DataType::kFloat8E4M3, m * ldo, "got", stream()));
      TP_ASSERT_OK(LaunchSmallMGemm(p, a.data(), b.data(), nullptr, d.data(), stream()));
      SwiGluParams sw;
      sw.gate_up = d.as<BFloat16>();
      sw.out_fp8 = want.as<uint8_t>();
      sw.out_fp8_scale = out_scale.as<float>();
      sw.rows = m;
      sw.inter = inter;
      TP_ASSERT_OK(LaunchSwiGlu(sw, stream()));
      TP_ASSERT_OK(LaunchSmallMGemmSwiGlu(p, a.data(), b.data(), got.as<uint8_t>(), ldo,
                                          out_scale.as<float>(), stream()));
      TP_CUDA_CHECK_FOR_TEST(cudaStreamSynchronize(stream()));
      TP_ASSERT_OK_AND_ASSIGN(auto w, Download<uint8_t>(want.data(), m * inter));
      TP_ASSERT_OK_AND_ASSIGN(auto g, Download<uint8_t>(got.data(), m * ldo));
      size_t differ = 0, padding = 0, saturated = 0, zero = 0;
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t j = 0; j < ldo; ++j) {
          const uint8_t have = g[r * ldo + j];
          if (j >= inter) {
            padding += have != kFp8E4M3PoisonBits;
            continue;
          }
          const uint8_t code = w[r * inter + j];
          saturated += (code & 0x7F) == 0x7E;
          zero += (code & 0x7F) == 0;
          if (have != code && ++differ <= 5) {
            ADD_FAILURE() << what << ": row " << r << " col " << j << " code " << int{have}
                          << ", want " << int{code};
          }
        }
      }
      EXPECT_EQ(differ, 0u) << what;
      EXPECT_EQ(padding, 0u) << what << ": wrote past n / 2";
      // A case that exercises the codes: most nonzero, some at E4M3's largest.
      EXPECT_LT(zero, static_cast<size_t>(m * inter / 4)) << what;
      if (s.n >= 2048) {
        EXPECT_GT(saturated, 0u) << what;
      }
    }
  }
}

TEST_F(GpuGenerationOpsTest, SmallMGemmSwiGluRefusesWhatItCannotRun) {
  // Host-side checks return before touching CUDA: these run without a GPU too.
  alignas(16) static uint8_t dummy[1024];
  const float* scale = reinterpret_cast<const float*>(dummy);
  GemmParams p;
  p.m = 2;
  p.n = 32;
  p.k = 64;
  p.lda = p.ldb = 64;
  p.ldc = p.ldd = 32;
  auto refused = [&](const GemmParams& q, int64_t ldo, const float* s, const std::string& text) {
    const Status st = LaunchSmallMGemmSwiGlu(q, dummy, dummy, dummy, ldo, s, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << text << ": " << st.ToString();
    EXPECT_NE(st.message().find(text), std::string::npos) << st.ToString();
  };
  refused(p, 15, scale, "ldo (15)");
  refused(p, 16, nullptr, "out_scale");
  GemmParams nine = p;
  nine.m = 9;  // beyond the small-M kernel
  refused(nine, 16, scale, "do not fit");
  GemmParams beta = p;
  beta.beta = 1.0f;
  refused(beta, 16, scale, "beta");
  GemmParams packed = p;
  packed.lda = 0;  // "packed", unresolved
  refused(packed, 16, scale, "lda and ldb");
}

TEST_F(GpuGenerationOpsTest, SplitChoiceFollowsTheLaunchShape) {
  // Host arithmetic only: runs without a GPU too. llama3-8b's heads (32 / 8, head_dim 128),
  // one H200 (132 SMs), a table of 8192 tokens, pure decode (one row per sequence).
  PagedAttentionParams p;
  p.layout = KvCacheLayout{32, 8192, 16, 8, 128, KvCacheDtype::kBFloat16};
  p.q_heads = 32;
  p.max_blocks = 512;
  p.max_query_rows = 1;
  alignas(16) static uint8_t ws[1];
  p.workspace = ws;
  p.workspace_bytes = PagedAttentionWorkspaceBytes(256, 32, 128, 8192);
  auto splits_for = [&](int64_t seqs) {
    p.num_seqs = p.tokens = seqs;
    return PagedAttentionSplitsFor(p, 132);
  };
  // Batch 1 and 8: enough splits to cover the GPU, at most a cluster's 16 (merged in the
  // cluster: no combine pass).
  EXPECT_EQ(splits_for(1), 16);
  EXPECT_EQ(splits_for(8), 9);  // 4 x 132 CTAs over 64 (sequence, KV head) pairs
  // Batch 64: 512 CTAs fill the 264 slots of a BF16 cache's two an SM: not split.
  EXPECT_EQ(splits_for(64), 1);
  // Two rows a sequence (the split kernels, merged by the combine pass): not held to 16.
  // 16 CTAs (2 sequences x 8 KV heads, 8 pairs each) and two an SM: 264 / 16, rounded up.
  p.max_query_rows = 2;
  EXPECT_EQ(splits_for(2), 17);
  p.max_query_rows = 1;
  // Asked for: as many as asked, past a cluster (then merged by the combine pass).
  p.splits = 20;
  EXPECT_EQ(splits_for(1), 20);
  p.splits = 0;
  // No workspace: one split.
  p.workspace = nullptr;
  p.workspace_bytes = 0;
  EXPECT_EQ(splits_for(1), 1);
}

TEST_F(GpuGenerationOpsTest, RopeInAttentionOnlyInAPureDecodeLaunch) {
  // Host-side checks return before touching CUDA: these run without a GPU too.
  alignas(16) static uint8_t dummy[4096];
  PagedAttentionParams p;
  p.layout = KvCacheLayout{2, 4, 16, 2, 64, KvCacheDtype::kBFloat16};
  p.layer = 1;
  p.q_heads = 4;
  p.q = reinterpret_cast<const BFloat16*>(dummy);
  p.q_row_stride = 8 * 64;
  p.cache = dummy;
  p.max_blocks = 2;
  p.num_seqs = 3;
  p.tokens = 3;
  p.max_query_rows = 1;
  p.out = reinterpret_cast<BFloat16*>(dummy);
  p.out_row_stride = 4 * 64;
  RopeParams r;
  r.q = const_cast<BFloat16*>(p.q);
  r.q_row_stride = p.q_row_stride;
  r.q_heads = 4;
  r.k = r.q + 4 * 64;
  r.k_row_stride = p.q_row_stride;
  r.kv_heads = 2;
  r.head_dim = 64;
  r.positions = reinterpret_cast<const int32_t*>(dummy);
  r.rows = 3;
  PagedKvWriteParams store;
  store.k = r.k;
  store.k_row_stride = store.v_row_stride = p.q_row_stride;
  store.v = r.k + 2 * 64;
  store.slot_mapping = reinterpret_cast<const int32_t*>(dummy);
  store.rows = 3;
  store.cache = dummy;
  store.layout = p.layout;
  store.layer = 1;
  r.kv_store = &store;
  p.rope = &r;
  EXPECT_TRUE(PagedAttentionTakesRope(p));
  auto refused = [&](const std::string& field) {
    const Status st = LaunchPagedAttention(p, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << field << ": " << st.ToString();
    EXPECT_NE(st.message().find(field), std::string::npos) << st.ToString();
  };
  // Launches the decode kernel does not take whole: several rows a sequence, a multi-row
  // list (those rows go to another kernel), a group the decode kernel lacks.
  p.max_query_rows = 2;
  EXPECT_FALSE(PagedAttentionTakesRope(p));
  refused("decode kernel");
  p.max_query_rows = 0;  // tokens: 3 rows a sequence at most
  EXPECT_FALSE(PagedAttentionTakesRope(p));
  p.max_query_rows = 1;
  alignas(4) static int32_t multi[1] = {0};
  p.multi_row_seqs = multi;
  p.multi_row_count = 1;
  EXPECT_FALSE(PagedAttentionTakesRope(p));
  refused("decode kernel");
  p.multi_row_seqs = nullptr;
  p.multi_row_count = 0;
  PagedAttentionParams three = p;
  three.q_heads = 6;
  EXPECT_FALSE(PagedAttentionTakesRope(three));
  // Rope arguments that are not this launch's, or incomplete.
  r.kv_store = nullptr;
  refused("kv_store");
  r.kv_store = &store;
  r.q += 8;
  refused("rope->q");
  r.q -= 8;
  r.rows = 2;
  store.rows = 2;
  refused("rope->rows");
  r.rows = store.rows = 3;
  store.cache = dummy + 64;
  refused("kv_store->cache");
  store.cache = dummy;
  store.layout.dtype = KvCacheDtype::kFloat8E4M3;
  refused("kv_store->layout");
  store.layout.dtype = KvCacheDtype::kBFloat16;
  store.layer = 0;
  refused("kv_store->layer");
  store.layer = 1;
  store.scales.k = 2.0f;
  refused("kv_store->scales");
  store.scales.k = 1.0f;
  r.theta = -1.0;  // CheckRope's own checks apply
  refused("theta");
}

TEST_F(GpuGenerationOpsTest, LaunchersRejectBadArguments) {
  // Host-side checks return before touching CUDA: these run without a GPU too.
  PagedAttentionParams p;
  p.layout = KvCacheLayout{1, 4, 16, 2, 96, KvCacheDtype::kBFloat16};
  p.q_heads = 4;
  p.max_blocks = 2;
  p.q_row_stride = p.out_row_stride = 4 * 96;
  EXPECT_EQ(LaunchPagedAttention(p, nullptr).code(), StatusCode::kUnimplemented);
  p.layout.head_dim = 64;
  p.q_heads = 3;
  EXPECT_EQ(LaunchPagedAttention(p, nullptr).code(), StatusCode::kInvalidArgument);
  p.q_heads = 4;
  p.layer = 1;
  EXPECT_EQ(LaunchPagedAttention(p, nullptr).code(), StatusCode::kInvalidArgument);
  p.layer = 0;
  Status bad = LaunchPagedAttention(p, nullptr);  // neither out nor out_fp8
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_NE(bad.message().find("out_fp8"), std::string::npos) << bad.ToString();
  alignas(16) static uint8_t codes[64];
  p.out_fp8 = codes;
  p.out_fp8_row_stride = p.out_row_stride;
  bad = LaunchPagedAttention(p, nullptr);  // codes without their scale
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_NE(bad.message().find("out_fp8_scale"), std::string::npos) << bad.ToString();
  p.out_fp8 = nullptr;
  for (const float bad_scale : {0.0f, -1.0f, std::nanf(""), INFINITY}) {
    p.scales.v = bad_scale;
    bad = LaunchPagedAttention(p, nullptr);
    EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
    EXPECT_NE(bad.message().find("scales"), std::string::npos) << bad.ToString();
  }
  p.scales.v = 1.0f;

  PagedKvWriteParams w;
  w.layout = KvCacheLayout{1, 4, 16, 2, 60, KvCacheDtype::kFloat8E4M3};
  w.k_row_stride = w.v_row_stride = 120;
  EXPECT_EQ(LaunchPagedKvWrite(w, nullptr).code(), StatusCode::kInvalidArgument);
  w.layout.head_dim = 64;
  w.scales.k = -2.0f;
  bad = LaunchPagedKvWrite(w, nullptr);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.ToString();
  EXPECT_NE(bad.message().find("scales"), std::string::npos) << bad.ToString();

  // RoPE storing the cache: its store's checks, and a store that is not this launch's rows.
  alignas(16) static uint8_t dummy[4096];
  RopeParams r;
  r.q = reinterpret_cast<BFloat16*>(dummy);
  r.q_row_stride = 8 * 64;
  r.q_heads = 4;
  r.head_dim = 64;
  r.positions = reinterpret_cast<const int32_t*>(dummy);
  r.rows = 3;
  PagedKvWriteParams store;
  store.k = r.q + 4 * 64;
  store.k_row_stride = store.v_row_stride = 8 * 64;
  store.v = store.k + 2 * 64;
  store.slot_mapping = reinterpret_cast<const int32_t*>(dummy);
  store.rows = 3;
  store.cache = dummy;
  store.layout = KvCacheLayout{1, 4, 16, 2, 64, KvCacheDtype::kBFloat16};
  r.kv_store = &store;
  const Status no_k = LaunchRope(r, nullptr);
  EXPECT_EQ(no_k.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_k.message().find("kv_store needs k"), std::string::npos) << no_k.message();
  r.k = const_cast<BFloat16*>(store.k);
  r.k_row_stride = 8 * 64;
  r.kv_heads = 2;
  store.rows = 4;
  const Status rows = LaunchRope(r, nullptr);
  EXPECT_EQ(rows.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rows.message().find("kv_store->rows"), std::string::npos) << rows.message();
  store.rows = 3;
  store.layer = 1;  // the layout has one layer
  const Status layer = LaunchRope(r, nullptr);
  EXPECT_EQ(layer.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(layer.message().find("kv_store"), std::string::npos) << layer.message();

  SamplingLaunchParams s;
  s.vocab = 0;
  s.logits_row_stride = 10;
  EXPECT_EQ(LaunchSampling(s, nullptr).code(), StatusCode::kInvalidArgument);
  s.vocab = 11;
  EXPECT_EQ(LaunchSampling(s, nullptr).code(), StatusCode::kInvalidArgument);
  // Valid but for the workspace: refused, naming it. Nothing is launched (the checks come
  // first), so aligned host addresses stand in for device buffers and no GPU is needed.
  alignas(16) static unsigned char any[256];
  s.vocab = 10;
  s.num_seqs = 3;
  s.logits = reinterpret_cast<const float*>(any);
  s.temperature = reinterpret_cast<const float*>(any);
  s.top_k = reinterpret_cast<const int32_t*>(any);
  s.top_p = reinterpret_cast<const float*>(any);
  s.seed = reinterpret_cast<const uint64_t*>(any);
  s.index = reinterpret_cast<const uint64_t*>(any);
  s.token = reinterpret_cast<int32_t*>(any);
  const Status no_ws = LaunchSampling(s, nullptr);
  EXPECT_EQ(no_ws.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_ws.message().find("workspace"), std::string::npos) << no_ws.message();
  s.workspace = any;
  s.workspace_bytes = SamplingWorkspaceBytes(3, 10) - 1;
  const Status small_ws = LaunchSampling(s, nullptr);
  EXPECT_EQ(small_ws.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small_ws.message().find("workspace_bytes"), std::string::npos) << small_ws.message();
  EXPECT_EQ(SamplingWorkspaceBytes(3, 10), 48u);  // one chunk a row, 16 bytes each
  EXPECT_EQ(SamplingWorkspaceBytes(2, 4097), 64u);
  s.workspace_bytes = SamplingWorkspaceBytes(3, 10);
  s.ctas_per_seq = 3;
  const Status ctas = LaunchSampling(s, nullptr);
  EXPECT_EQ(ctas.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ctas.message().find("ctas_per_seq"), std::string::npos) << ctas.message();
  s.ctas_per_seq = 0;
  s.vocab = kSamplingMaxVocab + 1;
  s.logits_row_stride = s.vocab;
  EXPECT_EQ(LaunchSampling(s, nullptr).code(), StatusCode::kInvalidArgument);

  // The workspace size follows the split cap: none for short contexts.
  EXPECT_EQ(PagedAttentionMaxSplits(1), 1);
  EXPECT_EQ(PagedAttentionMaxSplits(257), 2);
  EXPECT_EQ(PagedAttentionMaxSplits(1 << 20), 32);
  EXPECT_EQ(PagedAttentionWorkspaceBytes(64, 8, 128, 256), 0u);
  EXPECT_EQ(PagedAttentionWorkspaceBytes(3, 8, 128, 8192), size_t{32} * 3 * 8 * 130 * 4);
}

// ---------------------------------------------------------------------------------------------
// Sampling

struct SampleCase {
  std::vector<float> logits;  // [vocab]
  SamplingParams params;
  uint64_t index = 0;
};

struct SampleResult {
  std::vector<int32_t> tokens;
  std::vector<float> log_probs;
};

// All cases share one vocab size; one launch. ctas_per_seq: SamplingLaunchParams's (0: the
// launcher's choice).
StatusOr<SampleResult> RunSampling(cudaStream_t stream, const std::vector<SampleCase>& cases,
                                   int64_t vocab, int ctas_per_seq = 0) {
  const int64_t n = static_cast<int64_t>(cases.size());
  const int64_t stride = vocab + 3;  // a row stride that is not the vocab
  std::vector<float> logits(static_cast<size_t>(n * stride), 1e30f);
  std::vector<float> temperature(n), top_p(n);
  std::vector<int32_t> top_k(n);
  std::vector<uint64_t> seed(n), index(n);
  for (int64_t i = 0; i < n; ++i) {
    std::copy(cases[i].logits.begin(), cases[i].logits.end(), logits.begin() + i * stride);
    temperature[i] = cases[i].params.temperature;
    top_k[i] = cases[i].params.top_k;
    top_p[i] = cases[i].params.top_p;
    seed[i] = cases[i].params.seed;
    index[i] = cases[i].index;
  }
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_logits, Upload(logits, "logits"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_t, Upload(temperature, "temperature"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_k, Upload(top_k, "top_k"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_p, Upload(top_p, "top_p"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_seed, Upload(seed, "seed"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_index, Upload(index, "index"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_token,
                      Upload(std::vector<int32_t>(static_cast<size_t>(n), -7), "token"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_lp,
                      Upload(std::vector<float>(static_cast<size_t>(n), NAN), "log_prob"));
  SamplingLaunchParams p;
  p.logits = d_logits.as<float>();
  p.logits_row_stride = stride;
  p.vocab = vocab;
  p.num_seqs = n;
  p.temperature = d_t.as<float>();
  p.top_k = d_k.as<int32_t>();
  p.top_p = d_p.as<float>();
  p.seed = d_seed.as<uint64_t>();
  p.index = d_index.as<uint64_t>();
  p.token = d_token.as<int32_t>();
  p.log_prob = d_lp.as<float>();
  p.ctas_per_seq = ctas_per_seq;
  TP_ASSIGN_OR_RETURN(DeviceBuffer d_ws, DeviceBuffer::Allocate(SamplingWorkspaceBytes(n, vocab),
                                                                "sampling_workspace"));
  p.workspace = d_ws.data();
  p.workspace_bytes = d_ws.size();
  TP_RETURN_IF_ERROR(LaunchSampling(p, stream));
  TP_CUDA_CHECK(cudaStreamSynchronize(stream));
  SampleResult r;
  TP_ASSIGN_OR_RETURN(r.tokens, Download<int32_t>(d_token.data(), static_cast<size_t>(n)));
  TP_ASSIGN_OR_RETURN(r.log_probs, Download<float>(d_lp.data(), static_cast<size_t>(n)));
  return r;
}

// Random logits: normal with a spread, some rows quantized to 0.5 steps (many equal logits,
// so that the lower-id rule decides).
std::vector<float> RandomLogits(int64_t vocab, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float spreads[] = {0.5f, 1.0f, 3.0f, 8.0f};
  const float spread = spreads[rng() % 4];
  const bool quantized = rng() % 4 == 0;
  std::vector<float> l(static_cast<size_t>(vocab));
  for (auto& x : l) {
    x = normal(rng) * spread;
    if (quantized) x = std::round(x * 2.0f) / 2.0f;
  }
  return l;
}

TEST_F(GpuGenerationOpsTest, GreedyIsIdenticalToReference) {
  TP_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(440);
  // Around the row statistics' chunks of kSamplingChunk (4096) logits too.
  for (int64_t vocab : {1, 2, 37, 1000, 4096, 4097, 8193, 32000, 128256}) {
    std::vector<SampleCase> cases;
    for (int i = 0; i < 37; ++i) {
      SampleCase c;
      c.logits = RandomLogits(vocab, rng);
      if (i % 11 == 3 && vocab > 1) {  // a first chunk of -inf only (its max is -inf)
        std::fill(c.logits.begin(), c.logits.begin() + std::min<int64_t>(vocab - 1, 4096),
                  -INFINITY);
      }
      if (i % 5 == 0) {  // equal maxima: the lowest id wins
        const float top = *std::max_element(c.logits.begin(), c.logits.end());
        c.logits[static_cast<size_t>(rng() % vocab)] = top;
        c.logits[static_cast<size_t>(rng() % vocab)] = top;
      }
      if (i % 7 == 0 && vocab > 1) c.logits[static_cast<size_t>(rng() % vocab)] = -INFINITY;
      c.params.temperature = i % 2 == 0 ? 0.0f : 0.7f;
      c.params.top_k = i % 2 == 0 ? static_cast<int32_t>(i % 3) * 5 : 1;  // top_k 1: greedy
      c.params.top_p = i % 3 == 0 ? 0.5f : 1.0f;
      c.params.seed = rng();
      c.index = rng() % 1000;
      cases.push_back(std::move(c));
    }
    for (int ctas : {0, 1, 2, 8}) {  // the launcher's choice, and clusters of 1, 2 and 8 CTAs
      TP_ASSERT_OK_AND_ASSIGN(SampleResult r, RunSampling(stream(), cases, vocab, ctas));
      for (size_t i = 0; i < cases.size(); ++i) {
        const SampledToken want = SampleToken(cases[i].logits, cases[i].params, cases[i].index);
        EXPECT_EQ(r.tokens[i], want.token)
            << "vocab " << vocab << " case " << i << " ctas " << ctas;
        EXPECT_NEAR(r.log_probs[i], want.log_prob, 1e-5)
            << "vocab " << vocab << " case " << i << " ctas " << ctas;
      }
    }
  }
}

TEST_F(GpuGenerationOpsTest, SampledTokensMatchReference) {
  TP_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(450);
  const int64_t vocabs[] = {2, 7, 100, 1000, 32000, 128256};
  const float temperatures[] = {0.3f, 0.7f, 1.0f, 1.0f, 1.5f, 4.0f};
  const float top_ps[] = {1.0f, 1.0f, 0.95f, 0.8f, 0.5f, 0.1f};
  int total = 0, agree = 0, log_prob_bad = 0;
  for (int64_t vocab : vocabs) {
    const int32_t top_ks[] = {0, 0, 2, 5, 40, 1000, static_cast<int32_t>(vocab) + 5};
    std::vector<SampleCase> cases;
    for (int i = 0; i < 2000 / 6 + 1; ++i) {
      SampleCase c;
      c.logits = RandomLogits(vocab, rng);
      c.params.temperature = temperatures[rng() % 6];
      c.params.top_k = top_ks[rng() % 7];
      c.params.top_p = top_ps[rng() % 6];
      c.params.seed = rng();
      c.index = rng();
      cases.push_back(std::move(c));
    }
    TP_ASSERT_OK_AND_ASSIGN(SampleResult r, RunSampling(stream(), cases, vocab));
    // Same (seed, index) and logits: the same tokens on a second call, in another order.
    std::vector<SampleCase> reversed(cases.rbegin(), cases.rend());
    TP_ASSERT_OK_AND_ASSIGN(SampleResult again, RunSampling(stream(), reversed, vocab));
    // And the same tokens and log-probs, bit for bit, from clusters of 2 and 8 CTAs a sequence
    // (this batch is large enough for the launcher to choose one CTA a sequence).
    for (int ctas : {2, 8}) {
      TP_ASSERT_OK_AND_ASSIGN(SampleResult c, RunSampling(stream(), cases, vocab, ctas));
      int token_diff = 0, log_prob_diff = 0;
      for (size_t i = 0; i < cases.size(); ++i) {
        token_diff += c.tokens[i] != r.tokens[i];
        log_prob_diff += std::memcmp(&c.log_probs[i], &r.log_probs[i], sizeof(float)) != 0;
      }
      EXPECT_EQ(token_diff, 0) << "vocab " << vocab << ", " << ctas << " CTAs a sequence";
      EXPECT_EQ(log_prob_diff, 0) << "vocab " << vocab << ", " << ctas << " CTAs a sequence";
    }
    for (size_t i = 0; i < cases.size(); ++i) {
      const SampledToken want = SampleToken(cases[i].logits, cases[i].params, cases[i].index);
      ++total;
      agree += r.tokens[i] == want.token;
      EXPECT_EQ(r.tokens[i], again.tokens[cases.size() - 1 - i]) << "vocab " << vocab;
      ASSERT_GE(r.tokens[i], 0) << "vocab " << vocab << " case " << i;
      ASSERT_LT(r.tokens[i], vocab) << "vocab " << vocab << " case " << i;
      // log_softmax of the GPU's token: the greedy token's (-log sum) plus the logit gap.
      const float top = *std::max_element(cases[i].logits.begin(), cases[i].logits.end());
      const float lp_want =
          r.tokens[i] == want.token
              ? want.log_prob
              : SampleToken(cases[i].logits, {}, 0).log_prob + (cases[i].logits[r.tokens[i]] - top);
      log_prob_bad += !(std::fabs(r.log_probs[i] - lp_want) <= 1e-5);
      if (r.tokens[i] != want.token) {
        std::cout << "  differs: vocab " << vocab << " case " << i << " gpu " << r.tokens[i]
                  << " cpu " << want.token << " (T " << cases[i].params.temperature << ", top_k "
                  << cases[i].params.top_k << ", top_p " << cases[i].params.top_p << ")\n";
      }
    }
  }
  const double rate = static_cast<double>(agree) / total;
  std::cout << "sampling agreement with SampleToken: " << agree << " / " << total << " = "
            << rate * 100.0 << " %\n";
  RecordProperty("agreement", std::to_string(rate));
  EXPECT_GE(rate, 0.99);
  EXPECT_EQ(log_prob_bad, 0);
}

// Batches small enough for the launcher to sample each sequence on a cluster of CTAs (a decode
// step's batches 1 to 8 at llama3's vocabulary): the same tokens and log-probs as one CTA a
// sequence, bit for bit, and the reference's tokens. Candidates that fit the CTAs' lists and
// rows that do not (top_k 0 at a high temperature: every logit has mass) are both covered.
TEST_F(GpuGenerationOpsTest, SmallBatchesSampleOnClustersLikeOneCta) {
  TP_SKIP_WITHOUT_GPU();
  // On Hopper a cluster of 8 CTAs fits: batch 1 at llama3's vocabulary takes 8.
  EXPECT_EQ(SamplingCtasPerSeq(1, 128256), 8);
  std::cout << "CTAs a sequence at llama3's vocabulary, batch 1 / 8 / 16 / 64 / 256: "
            << SamplingCtasPerSeq(1, 128256) << " / " << SamplingCtasPerSeq(8, 128256) << " / "
            << SamplingCtasPerSeq(16, 128256) << " / " << SamplingCtasPerSeq(64, 128256) << " / "
            << SamplingCtasPerSeq(256, 128256) << "\n";
  EXPECT_EQ(SamplingCtasPerSeq(1, 32768), 4);      // 8192 logits a CTA at least
  EXPECT_EQ(SamplingCtasPerSeq(1, 32000), 1);      // and never 2
  EXPECT_EQ(SamplingCtasPerSeq(1024, 128256), 1);  // more clusters than fit at once
  std::mt19937_64 rng(460);
  int total = 0, agree = 0;
  for (int64_t vocab : {32768, 128256}) {
    for (int batch : {1, 3, 8}) {
      for (int round = 0; round < 6; ++round) {
        std::vector<SampleCase> cases;
        for (int i = 0; i < batch; ++i) {
          SampleCase c;
          c.logits = RandomLogits(vocab, rng);
          const float temperatures[] = {0.7f, 1.0f, 2.0f};
          const int32_t top_ks[] = {0, 0, 50, 2000};
          const float top_ps[] = {1.0f, 0.95f, 0.5f};
          c.params.temperature = temperatures[rng() % 3];
          c.params.top_k = top_ks[rng() % 4];
          c.params.top_p = top_ps[rng() % 3];
          c.params.seed = rng();
          c.index = rng() % 4096;
          cases.push_back(std::move(c));
        }
        TP_ASSERT_OK_AND_ASSIGN(SampleResult one, RunSampling(stream(), cases, vocab, 1));
        TP_ASSERT_OK_AND_ASSIGN(SampleResult chosen, RunSampling(stream(), cases, vocab));
        for (size_t i = 0; i < cases.size(); ++i) {
          EXPECT_EQ(chosen.tokens[i], one.tokens[i]) << "vocab " << vocab << " batch " << batch;
          EXPECT_EQ(std::memcmp(&chosen.log_probs[i], &one.log_probs[i], sizeof(float)), 0)
              << "vocab " << vocab << " batch " << batch;
          ++total;
          agree += chosen.tokens[i] ==
                   SampleToken(cases[i].logits, cases[i].params, cases[i].index).token;
        }
      }
    }
  }
  std::cout << "small batches on clusters: " << agree << " / " << total
            << " tokens equal to SampleToken's\n";
  EXPECT_GE(agree, total - 1);  // a token moves only within ~1e-6 of a cumulative boundary
}

// The rule's probability of each token (sampling.h), computed independently of SampleToken.
std::vector<double> RuleProbabilities(const std::vector<float>& logits, const SamplingParams& p) {
  const size_t vocab = logits.size();
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  size_t keep = p.top_k > 0 ? std::min<size_t>(p.top_k, vocab) : vocab;
  std::vector<double> w(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    w[i] = std::exp((static_cast<double>(logits[order[i]]) - logits[order[0]]) / p.temperature);
    sum += w[i];
  }
  if (p.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < keep; ++i) {
      cum += w[i] / sum;
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += w[i];
  std::vector<double> prob(vocab, 0.0);
  for (size_t i = 0; i < keep; ++i) prob[order[i]] = w[i] / kept;
  return prob;
}

TEST_F(GpuGenerationOpsTest, SampledDistributionMatchesProbabilities) {
  TP_SKIP_WITHOUT_GPU();
  const std::vector<float> logits{2.0f, 1.0f, 1.0f, 0.5f, -1.0f, 3.0f, -INFINITY, 2.5f};
  const int n = 40000;
  for (const SamplingParams base :
       {SamplingParams{0.9f, 0, 1.0f, 0}, SamplingParams{1.3f, 5, 0.9f, 0},
        SamplingParams{0.5f, 0, 0.7f, 0}}) {
    std::vector<SampleCase> cases(n);
    for (int i = 0; i < n; ++i) {
      cases[i].logits = logits;
      cases[i].params = base;
      cases[i].params.seed = 1000003ull * static_cast<uint64_t>(i) + 17;
      cases[i].index = 42;
    }
    TP_ASSERT_OK_AND_ASSIGN(SampleResult r,
                            RunSampling(stream(), cases, static_cast<int64_t>(logits.size())));
    std::vector<int> counts(logits.size(), 0);
    for (int32_t t : r.tokens) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, static_cast<int32_t>(logits.size()));
      ++counts[t];
    }
    const std::vector<double> prob = RuleProbabilities(logits, base);
    for (size_t t = 0; t < logits.size(); ++t) {
      const double f = static_cast<double>(counts[t]) / n;
      const double sigma = std::sqrt(prob[t] * (1 - prob[t]) / n);
      EXPECT_LE(std::fabs(f - prob[t]), 5 * sigma + 1e-12)
          << "token " << t << " frequency " << f << " probability " << prob[t] << " (T "
          << base.temperature << ", top_k " << base.top_k << ", top_p " << base.top_p << ")";
    }
  }
}

}  // namespace
}  // namespace tpserve
