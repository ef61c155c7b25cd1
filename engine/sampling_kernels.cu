// Kernel and launcher for engine/sampling_kernels.h. Plain CUDA C++17: host logic beyond
// argument checks and launch shapes belongs in .cc files (nvcc 13.0's front end is fragile,
// see GPU_HOST.md).
#include "engine/sampling_kernels.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

#include "comm/cuda_check.h"
#include "engine/launch_checks.h"
#include "layers/kernel_grid.h"
#include "layers/pdl.cuh"

namespace tpserve {
namespace {

using namespace launch_checks;

// ---------------------------------------------------------------------------------------------
// Sampling: one cluster of CTAs per sequence (SamplingLaunchParams::ctas_per_seq), each CTA
// walking an interleaved slice of the row; the clusters' CTAs add their histograms and sums
// through distributed shared memory and so all make the same choices. One CTA a sequence runs
// an instantiation without the cluster's barriers and sums (SamplingKernel<false>), launched
// without a cluster.
//
// Candidates are ordered by a 64-bit key, larger first: the logit's order-preserving bits
// above, ~id below, so that equal logits put the lower id first. The inverse CDF, the top-k
// cut and the top-p cut are each "the first candidate whose cumulative weight exceeds T"
// (weights: 1 for top-k, the fixed-point probability mass otherwise), found by an MSB-first
// radix descent over the key: 8 passes of 8 bits, each a histogram of the weights of the
// candidates that share the prefix chosen so far.

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
// 2^44: kSamplingMaxVocab masses <= 1 sum below 2^63.
constexpr double kMassScale = 17592186044416.0;

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ double SampleUniformDevice(uint64_t seed, uint64_t index) {
  return static_cast<double>(SplitMix64(seed ^ SplitMix64(index)) >> 11) * 0x1.0p-53;
}

// Larger key = earlier candidate. -0 is +0 (equal logits); NaN sorts last.
__device__ __forceinline__ uint64_t CandidateKey(float logit, int id) {
  uint32_t u = __float_as_uint(logit);
  if (u == 0x80000000u) u = 0;
  uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  if (isnan(logit)) ordered = 0;
  return (static_cast<uint64_t>(ordered) << 32) | static_cast<uint64_t>(0xFFFFFFFFu - id);
}

__device__ __forceinline__ int KeyId(uint64_t key) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

// The logit a key was made from (CandidateKey's order bits undone; -0 comes back as +0, a NaN
// as a NaN).
__device__ __forceinline__ float KeyLogit(uint64_t key) {
  const uint32_t o = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);
}

// ---------------------------------------------------------------------------------------------
// Row statistics: one CTA per (sequence, chunk of kSamplingChunk logits), every thread's
// kStatPerThread logits loaded before any is used. A single CTA walking a whole row waits out
// one load latency per logit of a thread, which made the step's sampling tens of microseconds.

constexpr int kStatThreads = 256;
constexpr int kStatPerThread = static_cast<int>(kSamplingChunk) / kStatThreads;
constexpr int kStatWarps = kStatThreads / 32;

struct RowPartial {
  unsigned long long key;  // the chunk's largest CandidateKey (never 0: a chunk is not empty)
  double sum;  // sum of expf(logit - KeyLogit(key)) over the chunk; 0 where that max is -inf
};
static_assert(sizeof(RowPartial) == 16, "SamplingWorkspaceBytes counts 16 bytes a chunk");
static_assert((kSamplingMaxVocab + kSamplingChunk - 1) / kSamplingChunk <= 65535,
              "a row's chunks are grid.y");

struct RowStatsArgs {
  const float* logits;
  int64_t logits_row_stride;
  int vocab;
  RowPartial* partials;  // [num_seqs, gridDim.y]
};

__global__ void __launch_bounds__(kStatThreads) RowStatsKernel(RowStatsArgs a) {
  __shared__ unsigned long long best_w[kStatWarps];
  __shared__ double sum_w[kStatWarps];
  const int s = blockIdx.x;
  const float* row = a.logits + static_cast<int64_t>(s) * a.logits_row_stride;
  const int begin = static_cast<int>(blockIdx.y) * static_cast<int>(kSamplingChunk);
  float v[kStatPerThread];
#pragma unroll
  for (int k = 0; k < kStatPerThread; ++k) {
    const int i = begin + k * kStatThreads + static_cast<int>(threadIdx.x);
    v[k] = i < a.vocab ? row[i] : 0.0f;
  }
  unsigned long long best = 0;
#pragma unroll
  for (int k = 0; k < kStatPerThread; ++k) {
    const int i = begin + k * kStatThreads + static_cast<int>(threadIdx.x);
    if (i < a.vocab) {
      const unsigned long long key = CandidateKey(v[k], i);
      best = key > best ? key : best;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long o = __shfl_xor_sync(0xffffffffu, best, offset);
    best = o > best ? o : best;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) best_w[warp] = best;
  __syncthreads();
  best = 0;
#pragma unroll
  for (int w = 0; w < kStatWarps; ++w) best = best_w[w] > best ? best_w[w] : best;
  const float m = KeyLogit(best);
  double sum = 0.0;
  if (m > -INFINITY) {  // false for -inf and NaN: the chunk adds nothing
#pragma unroll
    for (int k = 0; k < kStatPerThread; ++k) {
      const int i = begin + k * kStatThreads + static_cast<int>(threadIdx.x);
      if (i < a.vocab) sum += expf(v[k] - m);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) sum_w[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < kStatWarps; ++w) total += sum_w[w];
    RowPartial r;
    r.key = best;
    r.sum = total;
    a.partials[static_cast<int64_t>(s) * gridDim.y + blockIdx.y] = r;
  }
}

struct SampleShared {
  unsigned long long weight[256];  // this CTA's histogram of a level (read by the cluster)
  unsigned int count[256];
  unsigned long long total_weight[256];  // the cluster's (the sum of its CTAs' histograms)
  unsigned int total_count[256];
  unsigned long long u64[kSampleWarps];
  double f64[kSampleWarps];
  unsigned long long result[4];   // prefix, threshold, weight ahead, chosen weight
  unsigned long long found;       // the key a single-candidate walk found in this CTA's slice
  unsigned long long block_kept;  // this CTA's kept mass (read by the cluster's CTAs)
  unsigned int list_size;         // candidates offered to the list (may exceed its capacity)
  unsigned int chosen_count;      // candidates in the bucket a selection level chose
};

namespace cg = cooperative_groups;

// kCluster: the kernel runs in clusters of several CTAs a sequence; false: one CTA a
// sequence, launched without a cluster, whose barriers are then block barriers and whose sums
// over the cluster are its own values (a cluster barrier and reads through distributed shared
// memory cost a one-CTA cluster more than that).

// A barrier of the sequence's CTAs: what each wrote to its shared memory before it is visible
// to the others after it.
template <bool kCluster>
__device__ __forceinline__ void ClusterSync() {
  if constexpr (kCluster) {
    cg::this_cluster().sync();
  } else {
    __syncthreads();
  }
}

// The sum over the sequence's CTAs of a value of each one's shared memory (after a
// ClusterSync that follows its writes; rank order, so every CTA gets the same bits).
template <bool kCluster, typename T>
__device__ __forceinline__ T ClusterSum(T* mine) {
  if constexpr (!kCluster) {
    return *mine;
  } else {
    cg::cluster_group cluster = cg::this_cluster();
    T sum = 0;
    for (unsigned r = 0; r < cluster.num_blocks(); ++r) sum += *cluster.map_shared_rank(mine, r);
    return sum;
  }
}

__device__ unsigned long long BlockSumU64(unsigned long long v, SampleShared& sm) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm.u64[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned long long r = 0;
  for (int w = 0; w < kSampleWarps; ++w) r += sm.u64[w];
  return r;
}

// exp((logit - max) / T) in FP32, as 2^-44 fixed point (0 for a NaN). SampleToken computes it
// in double; the integer weights keep every sum exact and order-free either way, and FP32 moves
// a token only where u falls within ~1e-6 of a boundary of the cumulative sums. (A double exp a
// candidate made a sampled token's walks of the row compute-bound on its one SM.) inv_t is
// 1 / T clamped to FLT_MAX, so that the top logit's mass is 1 however small T is.
__device__ __forceinline__ unsigned long long Mass(float logit, float lmax, float inv_t) {
  const float p = expf((logit - lmax) * inv_t);
  return p > 0.0f ? __float2ull_rn(p * static_cast<float>(kMassScale)) : 0ull;
}

// This CTA's slice of a row: the ids first + j * stride (first = its rank in the cluster *
// kSampleThreads + threadIdx.x, stride = kSampleThreads * the cluster's CTAs).
struct Slice {
  int first;
  int stride;
};

// Calls f(logit, id) for this thread's logits of a row in id order, kLoadAhead loads issued
// before the first is used: the row is walked many times a sampled token, and one load in
// flight a thread leaves each walk latency-bound.
constexpr int kLoadAhead = 8;
template <typename F>
__device__ __forceinline__ void ForThreadLogits(const float* row, int vocab, Slice slice, F&& f) {
  int i = slice.first;
  for (; i + (kLoadAhead - 1) * slice.stride < vocab; i += kLoadAhead * slice.stride) {
    float v[kLoadAhead];
#pragma unroll
    for (int k = 0; k < kLoadAhead; ++k) v[k] = row[i + k * slice.stride];
#pragma unroll
    for (int k = 0; k < kLoadAhead; ++k) f(v[k], i + k * slice.stride);
  }
  // The rest, fewer than kLoadAhead, also loaded before the first is used.
  float v[kLoadAhead - 1];
#pragma unroll
  for (int k = 0; k < kLoadAhead - 1; ++k) {
    const int id = i + k * slice.stride;
    v[k] = id < vocab ? row[id] : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kLoadAhead - 1; ++k) {
    const int id = i + k * slice.stride;
    if (id < vocab) f(v[k], id);
  }
}

// Dynamic shared memory of the sampling kernel: a sampled token's candidates of nonzero mass,
// listed (16 bytes each) when they fit, so that the selections walk the list instead of the
// row; then one histogram a warp (256 weights and counts).
constexpr int kListCapacity = 4096;
constexpr size_t kListBytes = size_t{kListCapacity} * 2 * sizeof(unsigned long long);
constexpr size_t kSampleSmemBytes =
    kListBytes + size_t{kSampleWarps} * 256 * (sizeof(unsigned long long) + sizeof(unsigned int));

struct WarpHistograms {
  unsigned long long* weight;  // [kSampleWarps, 256]
  unsigned int* count;         // [kSampleWarps, 256]
};

struct Selected {
  uint64_t key;
  unsigned long long cumulative;  // weight of the candidates up to and including it
};

// The first candidate (key >= min_key, in key-descending order) whose cumulative weight
// exceeds `threshold`; the last such candidate if none does. for_each(g) calls g(key, weight)
// for each of this thread's candidates (of its CTA's slice), weight() giving its weight
// (Mass(), or 1 for a count). Every CTA of the cluster calls it with the same arguments and gets
// the same result.
template <bool kCluster, typename ForEach>
__device__ Selected SelectFirstExceeding(ForEach&& for_each, uint64_t min_key,
                                         unsigned long long threshold, SampleShared& sm,
                                         const WarpHistograms& wh) {
  uint64_t prefix = 0;
  unsigned long long before = 0;  // weight of the candidates ahead of the prefix
  unsigned long long chosen_weight = 0;
  const int warp = static_cast<int>(threadIdx.x >> 5);
  unsigned long long* my_weight = wh.weight + warp * 256;
  unsigned int* my_count = wh.count + warp * 256;
  for (int level = 0; level < 8; ++level) {
    const int shift = 56 - 8 * level;
    for (int i = threadIdx.x; i < kSampleWarps * 256; i += kSampleThreads) {
      wh.weight[i] = 0;
      wh.count[i] = 0;
    }
    __syncthreads();
    // Each warp counts into its own histogram (one shared by the block's 1024 threads made its
    // few busy digits' atomics the walk's bottleneck). Run-length aggregation: neighbouring
    // candidates of one thread often share a digit, so it flushes on a change only.
    int run_digit = -1;
    unsigned long long run_weight = 0;
    unsigned int run_count = 0;
    for_each([&](uint64_t key, auto weight) {
      if (key < min_key) return;
      if (level > 0 && (key >> (shift + 8)) != (prefix >> (shift + 8))) return;
      const int digit = static_cast<int>((key >> shift) & 0xFF);
      const unsigned long long w = weight();
      if (digit != run_digit) {
        if (run_count > 0) {
          atomicAdd(&my_weight[run_digit], run_weight);
          atomicAdd(&my_count[run_digit], run_count);
        }
        run_digit = digit;
        run_weight = 0;
        run_count = 0;
      }
      run_weight += w;
      ++run_count;
    });
    if (run_count > 0) {
      atomicAdd(&my_weight[run_digit], run_weight);
      atomicAdd(&my_count[run_digit], run_count);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < 256; d += kSampleThreads) {  // integer sums: any order
      unsigned long long w = 0;
      unsigned int c = 0;
      for (int k = 0; k < kSampleWarps; ++k) {
        w += wh.weight[k * 256 + d];
        c += wh.count[k * 256 + d];
      }
      sm.weight[d] = w;
      sm.count[d] = c;
    }
    ClusterSync<kCluster>();  // every CTA's histogram of its slice is complete
    // The cluster's histogram, in every CTA (one CTA's own is the whole). Warp 0 picks the
    // bucket: lane l holds digits 255 - 8l down to 248 - 8l (the key order), the lanes' weights
    // are scanned by shuffles, and the lane where the cumulative weight first exceeds the
    // threshold walks its eight buckets. Nothing exceeding, it is the last nonempty bucket (none
    // at all cannot happen). The same choice as one thread walking all 256 buckets in order,
    // which took microseconds a level.
    const unsigned long long* total_weight = sm.weight;
    const unsigned int* total_count = sm.count;
    if constexpr (kCluster) {
      for (int d = threadIdx.x; d < 256; d += kSampleThreads) {
        sm.total_weight[d] = ClusterSum<kCluster>(&sm.weight[d]);
        sm.total_count[d] = ClusterSum<kCluster>(&sm.count[d]);
      }
      __syncthreads();
      total_weight = sm.total_weight;
      total_count = sm.total_count;
    }
    if (threadIdx.x < 32) {
      const int lane = static_cast<int>(threadIdx.x);
      unsigned long long lane_weight = 0;
      int lane_last = -1;  // this lane's last nonempty bucket
      for (int k = 0; k < 8; ++k) {
        const int d = 255 - 8 * lane - k;
        if (total_count[d] != 0) {
          lane_weight += total_weight[d];
          lane_last = d;
        }
      }
      unsigned long long inclusive = lane_weight;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
      }
      const unsigned exceeds = __ballot_sync(0xffffffffu, inclusive > threshold);
      const unsigned nonempty = __ballot_sync(0xffffffffu, lane_last >= 0);
      const int owner =
          exceeds != 0 ? __ffs(exceeds) - 1 : (nonempty != 0 ? 31 - __clz(nonempty) : 0);
      if (lane == owner) {
        unsigned long long acc = inclusive - lane_weight;  // weight of the earlier lanes
        int chosen = -1;
        if (exceeds != 0) {
          for (int k = 0; k < 8 && chosen < 0; ++k) {
            const int d = 255 - 8 * lane - k;
            if (total_count[d] == 0) continue;
            if (acc + total_weight[d] > threshold) {
              chosen = d;
            } else {
              acc += total_weight[d];
            }
          }
        } else if (lane_last >= 0) {
          chosen = lane_last;
          acc = inclusive - total_weight[lane_last];
        } else {
          acc = 0;
        }
        sm.result[0] = prefix | (static_cast<uint64_t>(chosen < 0 ? 0 : chosen) << shift);
        sm.result[1] = threshold - acc;  // relative to the chosen bucket's first candidate
        sm.result[2] = acc;              // weight ahead of the chosen bucket within the prefix
        sm.result[3] = chosen < 0 ? 0 : total_weight[chosen];
        sm.chosen_count = chosen < 0 ? 0u : total_count[chosen];
      }
    }
    __syncthreads();
    prefix = sm.result[0];
    threshold = sm.result[1];
    before += sm.result[2];
    chosen_weight = sm.result[3];  // at the last level: the one candidate's own weight
    const bool single = sm.chosen_count == 1 && level < 7;
    // result is rewritten next, and the histograms: not before the cluster's CTAs have read
    // this one's.
    ClusterSync<kCluster>();
    if (single) {
      // One candidate left under the prefix: one walk finds its key, instead of a walk for
      // each of the remaining levels (after two or three levels this is the common case). It
      // lies in one CTA's slice; the others find nothing (0).
      const uint64_t want = prefix >> shift;
      if (threadIdx.x == 0) sm.found = 0;
      __syncthreads();
      for_each([&](uint64_t key, auto) {
        if (key >= min_key && (key >> shift) == want) sm.found = key;
      });
      ClusterSync<kCluster>();
      Selected r;
      r.key = ClusterSum<kCluster>(&sm.found);
      r.cumulative = before + chosen_weight;
      // found is rewritten by a later selection only after that selection's first ClusterSync,
      // which no CTA passes before it has read everyone's here.
      return r;
    }
  }
  Selected r;
  r.key = prefix;
  r.cumulative = before + chosen_weight;
  return r;
}

struct SampleArgs {
  const float* logits;
  int64_t logits_row_stride;
  int vocab;
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const uint64_t* seed;
  const uint64_t* index;
  int32_t* token;
  float* log_prob;
  const RowPartial* partials;  // RowStatsKernel's, [num_seqs, chunks]
  int chunks;
};

// Launched with PDL after RowStatsKernel, in clusters of a sequence's CTAs (gridDim.x = the
// sequences times the cluster size), or (!kCluster) one CTA a sequence.
template <bool kCluster>
__global__ void __launch_bounds__(kSampleThreads) SamplingKernel(SampleArgs a) {
  __shared__ SampleShared sm;
  extern __shared__ unsigned long long list[];  // kSampleSmemBytes: the list, then wh
  WarpHistograms wh;
  wh.weight = list + 2 * kListCapacity;
  wh.count = reinterpret_cast<unsigned int*>(wh.weight + kSampleWarps * 256);
  PdlEnter();
  const int ctas = kCluster ? static_cast<int>(cg::this_cluster().num_blocks()) : 1;
  const int rank = kCluster ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int s = static_cast<int>(blockIdx.x) / ctas;
  const Slice slice{rank * kSampleThreads + static_cast<int>(threadIdx.x), ctas * kSampleThreads};
  const float* row = a.logits + static_cast<int64_t>(s) * a.logits_row_stride;
  const int vocab = a.vocab;

  // The chunks' statistics merged by warp 0: the greedy choice is the largest key (largest
  // logit, lowest id among equal ones); log_softmax's denominator the chunks' sums, each
  // rescaled from its own max to the row's in double, added in a fixed order.
  if (threadIdx.x < 32) {
    const RowPartial* part = a.partials + static_cast<int64_t>(s) * a.chunks;
    unsigned long long best = 0;
    for (int c = threadIdx.x; c < a.chunks; c += 32) {
      const unsigned long long k = part[c].key;
      best = k > best ? k : best;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const unsigned long long o = __shfl_xor_sync(0xffffffffu, best, offset);
      best = o > best ? o : best;
    }
    const double top = static_cast<double>(KeyLogit(best));
    double sum = 0.0;
    for (int c = threadIdx.x; c < a.chunks; c += 32) {
      const RowPartial pc = part[c];
      if (pc.sum != 0.0) sum += pc.sum * exp(static_cast<double>(KeyLogit(pc.key)) - top);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) {
      sm.result[0] = best;
      sm.f64[0] = sum;
    }
  }
  __syncthreads();
  const unsigned long long best = sm.result[0];
  const double sum = sm.f64[0];
  __syncthreads();  // sm.result and sm.f64 are reused by the selection below
  const int argmax = KeyId(best);
  const float lmax = KeyLogit(best);

  const float temperature = a.temperature[s];
  const int32_t top_k = a.top_k[s];
  const float top_p = a.top_p[s];
  int token = argmax;
  const bool greedy = !(temperature > 0.0f && temperature <= 3.402823466e38f) || top_k == 1;
  if (!greedy) {
    const float inv_t = fminf(1.0f / temperature, 3.402823466e38f);
    // The row's candidates, counted (the top-k cut) or weighed by Mass().
    auto counted = [&](auto&& g) {
      ForThreadLogits(row, vocab, slice,
                      [&](float logit, int i) { g(CandidateKey(logit, i), [] { return 1ull; }); });
    };
    auto weighed = [&](auto&& g) {
      ForThreadLogits(row, vocab, slice, [&](float logit, int i) {
        g(CandidateKey(logit, i), [&] { return Mass(logit, lmax, inv_t); });
      });
    };
    uint64_t min_key = 0;  // the candidates kept so far: keys >= min_key
    if (top_k > 0 && top_k < vocab) {
      min_key = SelectFirstExceeding<kCluster>(counted, 0,
                                               static_cast<unsigned long long>(top_k - 1), sm, wh)
                    .key;
    }
    // One walk of the row: the kept mass, and the kept candidates of nonzero mass listed in
    // shared memory (each CTA its slice's). The selections below weigh by mass, where a
    // candidate of zero mass never decides (the first candidate whose cumulative mass exceeds a
    // threshold below the total has a mass), so when every CTA's list holds its slice's they
    // walk the lists instead of the row.
    unsigned long long* list_key = list;
    unsigned long long* list_mass = list + kListCapacity;
    if (threadIdx.x == 0) sm.list_size = 0;
    __syncthreads();
    unsigned long long kept = 0;
    ForThreadLogits(row, vocab, slice, [&](float logit, int i) {
      const uint64_t key = CandidateKey(logit, i);
      if (key < min_key) return;
      const unsigned long long m = Mass(logit, lmax, inv_t);
      if (m == 0) return;
      kept += m;
      const unsigned int j = atomicAdd(&sm.list_size, 1u);
      if (j < kListCapacity) {
        list_key[j] = key;
        list_mass[j] = m;
      }
    });
    kept = BlockSumU64(kept, sm);  // its barriers also complete the list
    if (threadIdx.x == 0) sm.block_kept = kept;
    ClusterSync<kCluster>();
    kept = ClusterSum<kCluster>(&sm.block_kept);
    const int listed = static_cast<int>(sm.list_size);
    bool lists_fit = true;  // the same for every CTA of the cluster
    unsigned long long listed_total = 0;
    for (int r = 0; r < ctas; ++r) {
      const unsigned int n =
          kCluster ? *cg::this_cluster().map_shared_rank(&sm.list_size, r) : sm.list_size;
      lists_fit = lists_fit && n <= kListCapacity;
      listed_total += n;
    }
    auto listed_candidates = [&](auto&& g) {
      for (int j = threadIdx.x; j < listed; j += kSampleThreads) {
        const unsigned long long m = list_mass[j];
        g(list_key[j], [m] { return m; });
      }
    };
    // The same choice either way, and every thread of the cluster takes the same branch. Empty
    // lists (every mass zero: a row of -inf, outside the contract) walk the row, whose fallback
    // keeps the token in range.
    const bool use_list = lists_fit && listed_total >= 1;
    auto select = [&](uint64_t from, unsigned long long threshold) {
      return use_list ? SelectFirstExceeding<kCluster>(listed_candidates, from, threshold, sm, wh)
                      : SelectFirstExceeding<kCluster>(weighed, from, threshold, sm, wh);
    };
    if (top_p < 1.0f) {
      // The shortest prefix whose sum reaches top_p * kept: the first candidate whose
      // cumulative weight is >= that, i.e. > ceil(it) - 1 for integer weights.
      const double target = ceil(static_cast<double>(top_p) * static_cast<double>(kept));
      const unsigned long long threshold =
          target >= 1.0 ? static_cast<unsigned long long>(target) - 1ull : 0ull;
      const Selected cut = select(min_key, threshold);
      min_key = cut.key;
      kept = cut.cumulative;
    }
    const double u = SampleUniformDevice(a.seed[s], a.index[s]);
    // cumulative > u * kept  <=>  cumulative > floor(u * kept) for integer cumulatives.
    const unsigned long long threshold =
        static_cast<unsigned long long>(floor(u * static_cast<double>(kept)));
    token = KeyId(select(min_key, threshold).key);
  }
  // No CTA leaves while the cluster's others may still read its shared memory.
  if constexpr (kCluster) ClusterSync<kCluster>();
  if (rank == 0 && threadIdx.x == 0) {
    a.token[s] = token;
    if (a.log_prob != nullptr) {
      a.log_prob[s] = static_cast<float>(static_cast<double>(row[token]) -
                                         static_cast<double>(lmax) - log(sum));
    }
  }
}

// The sampling kernel in clusters of `ctas` CTAs a sequence (one CTA: the kernel without a
// cluster), launched with PDL.
cudaError_t LaunchSamplingKernel(const SampleArgs& a, int64_t num_seqs, int ctas,
                                 cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(num_seqs * ctas));
  config.blockDim = dim3(kSampleThreads);
  config.dynamicSmemBytes = kSampleSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  PdlAndClusterAttributes(attribute, dim3(static_cast<unsigned>(ctas)));
  config.attrs = attribute;
  if (ctas == 1) {
    config.numAttrs = 1;  // PDL alone
    return cudaLaunchKernelEx(&config, SamplingKernel<false>, a);
  }
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, SamplingKernel<true>, a);
}

// The clusters of `ctas` sampling CTAs the current device can run at once (0 if none or the
// query fails), asked once per device and size.
constexpr int kMaxDevicesCached = 64;
int MaxActiveSamplingClusters(int ctas) {
  static std::atomic<int> cache[kMaxDevicesCached][4];  // by log2(ctas); 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevicesCached) {
    (void)cudaGetLastError();
    return 0;
  }
  const int slot = ctas == 1 ? 0 : ctas == 2 ? 1 : ctas == 4 ? 2 : 3;
  const int known = cache[device][slot].load(std::memory_order_relaxed);
  if (known != 0) return known - 1;
  cudaLaunchConfig_t query = {};
  query.gridDim = dim3(static_cast<unsigned>(ctas));
  query.blockDim = dim3(kSampleThreads);
  query.dynamicSmemBytes = kSampleSmemBytes;
  cudaLaunchAttribute attribute[2];
  PdlAndClusterAttributes(attribute, dim3(static_cast<unsigned>(ctas)));
  query.attrs = &attribute[1];  // the cluster alone: PDL is no part of placement
  query.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, SamplingKernel<true>, &query) != cudaSuccess) {
    (void)cudaGetLastError();  // a refused query is not the launch's error
    clusters = 0;
  }
  cache[device][slot].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

// The sampling kernels' shared memory beyond the default 48 KiB, on the current device (the
// opt-in holds per device, and ranks may be threads of one process on several).
cudaError_t SetSamplingSmem() {
  const cudaError_t e = cudaFuncSetAttribute(
      SamplingKernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSampleSmemBytes);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(SamplingKernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              kSampleSmemBytes);
}

// SamplingCtasPerSeq's least logits a CTA.
constexpr int64_t kMinLogitsPerCta = int64_t{8} * kSampleThreads;

// SamplingCtasPerSeq, SetSamplingSmem() done.
int CtasPerSeq(int64_t num_seqs, int64_t vocab) {
  // Not 2: at batch 64 (2 CTAs a sequence) a sampled step measured 1 % slower than one CTA.
  for (int ctas : {8, 4}) {
    if (vocab >= ctas * kMinLogitsPerCta && num_seqs <= MaxActiveSamplingClusters(ctas)) {
      return ctas;
    }
  }
  return 1;
}

}  // namespace

int SamplingCtasPerSeq(int64_t num_seqs, int64_t vocab) {
  if (SetSamplingSmem() != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  return CtasPerSeq(num_seqs, vocab);
}

size_t SamplingWorkspaceBytes(int64_t num_seqs, int64_t vocab) {
  const int64_t chunks = (vocab + kSamplingChunk - 1) / kSamplingChunk;
  return static_cast<size_t>(num_seqs < 0 ? 0 : num_seqs) *
         static_cast<size_t>(chunks < 0 ? 0 : chunks) * sizeof(RowPartial);
}

Status LaunchSampling(const SamplingLaunchParams& p, cudaStream_t stream) {
  constexpr const char* kP = "SamplingLaunchParams";
  if (p.vocab < 1 || p.vocab > kSamplingMaxVocab) {
    return BadField(kP, "vocab", p.vocab,
                    "must be in [1, " + std::to_string(kSamplingMaxVocab) + "]");
  }
  if (p.logits_row_stride < p.vocab) {
    return BadField(kP, "logits_row_stride", p.logits_row_stride, "must be >= vocab");
  }
  if (p.num_seqs < 0 || p.num_seqs > kMaxGridX) {
    return BadField(kP, "num_seqs", p.num_seqs, "must be in [0, 2^31 - 1]");
  }
  if (p.ctas_per_seq != 0 && p.ctas_per_seq != 1 && p.ctas_per_seq != 2 && p.ctas_per_seq != 4 &&
      p.ctas_per_seq != 8) {
    return BadField(kP, "ctas_per_seq", p.ctas_per_seq, "must be 0 (chosen here), 1, 2, 4 or 8");
  }
  if (p.num_seqs * std::max(p.ctas_per_seq, 1) > kMaxGridX) {
    return BadField(kP, "num_seqs", p.num_seqs, "times ctas_per_seq must be below 2^31");
  }
  if (p.num_seqs == 0) return Status::Ok();
  TP_RETURN_IF_ERROR(CheckPointers(kP, {{"logits", p.logits, 4},
                                        {"temperature", p.temperature, 4},
                                        {"top_k", p.top_k, 4},
                                        {"top_p", p.top_p, 4},
                                        {"seed", p.seed, 8},
                                        {"index", p.index, 8},
                                        {"token", p.token, 4},
                                        {"log_prob", p.log_prob, 4, false},
                                        {"workspace", p.workspace, 16}}));
  const size_t need = SamplingWorkspaceBytes(p.num_seqs, p.vocab);
  if (p.workspace_bytes < need) {
    return BadField(kP, "workspace_bytes", static_cast<int64_t>(p.workspace_bytes),
                    "must be >= SamplingWorkspaceBytes(num_seqs, vocab) = " + std::to_string(need));
  }
  const int chunks = static_cast<int>((p.vocab + kSamplingChunk - 1) / kSamplingChunk);
  RowStatsArgs r;
  r.logits = p.logits;
  r.logits_row_stride = p.logits_row_stride;
  r.vocab = static_cast<int>(p.vocab);
  r.partials = static_cast<RowPartial*>(p.workspace);
  RowStatsKernel<<<dim3(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(chunks)),
                   kStatThreads, 0, stream>>>(r);
  TP_CUDA_CHECK(cudaGetLastError());
  SampleArgs a;
  a.logits = p.logits;
  a.logits_row_stride = p.logits_row_stride;
  a.vocab = static_cast<int>(p.vocab);
  a.temperature = p.temperature;
  a.top_k = p.top_k;
  a.top_p = p.top_p;
  a.seed = p.seed;
  a.index = p.index;
  a.token = p.token;
  a.log_prob = p.log_prob;
  a.partials = r.partials;
  a.chunks = chunks;
  TP_CUDA_CHECK(SetSamplingSmem());
  int ctas = p.ctas_per_seq;
  if (ctas == 0) ctas = CtasPerSeq(p.num_seqs, p.vocab);
  cudaError_t launched = LaunchSamplingKernel(a, p.num_seqs, ctas, stream);
  if (launched != cudaSuccess && ctas > 1 && p.ctas_per_seq == 0) {
    // A cluster the launch could not place (the occupancy query can be optimistic, e.g. beside
    // other processes' work): one CTA a sequence, the same tokens.
    (void)cudaGetLastError();
    launched = LaunchSamplingKernel(a, p.num_seqs, 1, stream);
  }
  TP_CUDA_CHECK(launched);
  return Status::Ok();
}

}  // namespace tpserve
