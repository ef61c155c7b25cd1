// Kernel and launcher for engine/sampling_kernels.h. Plain CUDA C++17: host logic beyond
// argument checks and launch shapes belongs in .cc files (nvcc 13.0's front end is fragile,
// see GPU_HOST.md).
#include "engine/sampling_kernels.h"

#include <cuda_runtime.h>

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
// Sampling: one CTA per sequence.
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
  unsigned long long weight[256];
  unsigned int count[256];
  unsigned long long u64[kSampleWarps];
  double f64[kSampleWarps];
  unsigned long long result[4];  // prefix, threshold, weight ahead, chosen weight
  unsigned int list_size;        // candidates offered to the list (may exceed its capacity)
  unsigned int chosen_count;     // candidates in the bucket a selection level chose
};

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

// Calls f(logit, id) for this thread's logits of a row (ids threadIdx.x + j kSampleThreads) in
// id order, kLoadAhead loads issued before the first is used: the row is walked many times a
// sampled token, and one load in flight a thread leaves each walk latency-bound.
constexpr int kLoadAhead = 8;
template <typename F>
__device__ __forceinline__ void ForThreadLogits(const float* row, int vocab, F&& f) {
  int i = static_cast<int>(threadIdx.x);
  for (; i + (kLoadAhead - 1) * kSampleThreads < vocab; i += kLoadAhead * kSampleThreads) {
    float v[kLoadAhead];
#pragma unroll
    for (int k = 0; k < kLoadAhead; ++k) v[k] = row[i + k * kSampleThreads];
#pragma unroll
    for (int k = 0; k < kLoadAhead; ++k) f(v[k], i + k * kSampleThreads);
  }
  for (; i < vocab; i += kSampleThreads) f(row[i], i);
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
// for each of this thread's candidates, weight() giving its weight (Mass(), or 1 for a count).
template <typename ForEach>
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
    __syncthreads();
    // Warp 0 picks the bucket: lane l holds digits 255 - 8l down to 248 - 8l (the key order),
    // the lanes' weights are scanned by shuffles, and the lane where the cumulative weight
    // first exceeds the threshold walks its eight buckets. Nothing exceeding, it is the last
    // nonempty bucket (none at all cannot happen). The same choice as one thread walking all
    // 256 buckets in order, which took microseconds a level.
    if (threadIdx.x < 32) {
      const int lane = static_cast<int>(threadIdx.x);
      unsigned long long lane_weight = 0;
      int lane_last = -1;  // this lane's last nonempty bucket
      for (int k = 0; k < 8; ++k) {
        const int d = 255 - 8 * lane - k;
        if (sm.count[d] != 0) {
          lane_weight += sm.weight[d];
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
            if (sm.count[d] == 0) continue;
            if (acc + sm.weight[d] > threshold) {
              chosen = d;
            } else {
              acc += sm.weight[d];
            }
          }
        } else if (lane_last >= 0) {
          chosen = lane_last;
          acc = inclusive - sm.weight[lane_last];
        } else {
          acc = 0;
        }
        sm.result[0] = prefix | (static_cast<uint64_t>(chosen < 0 ? 0 : chosen) << shift);
        sm.result[1] = threshold - acc;  // relative to the chosen bucket's first candidate
        sm.result[2] = acc;              // weight ahead of the chosen bucket within the prefix
        sm.result[3] = chosen < 0 ? 0 : sm.weight[chosen];
        sm.chosen_count = chosen < 0 ? 0u : sm.count[chosen];
      }
    }
    __syncthreads();
    prefix = sm.result[0];
    threshold = sm.result[1];
    before += sm.result[2];
    chosen_weight = sm.result[3];  // at the last level: the one candidate's own weight
    const bool single = sm.chosen_count == 1 && level < 7;
    __syncthreads();  // result and the histograms are rewritten next
    if (single) {
      // One candidate left under the prefix: one walk finds its key, instead of a walk for
      // each of the remaining levels (after two or three levels this is the common case).
      const uint64_t want = prefix >> shift;
      for_each([&](uint64_t key, auto) {
        if (key >= min_key && (key >> shift) == want) sm.result[0] = key;
      });
      __syncthreads();
      Selected r;
      r.key = sm.result[0];
      r.cumulative = before + chosen_weight;
      __syncthreads();  // sm.result is rewritten by the next selection
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

// Launched with PDL after RowStatsKernel.
__global__ void __launch_bounds__(kSampleThreads) SamplingKernel(SampleArgs a) {
  __shared__ SampleShared sm;
  extern __shared__ unsigned long long list[];  // kSampleSmemBytes: the list, then wh
  WarpHistograms wh;
  wh.weight = list + 2 * kListCapacity;
  wh.count = reinterpret_cast<unsigned int*>(wh.weight + kSampleWarps * 256);
  PdlEnter();
  const int s = blockIdx.x;
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
      ForThreadLogits(row, vocab,
                      [&](float logit, int i) { g(CandidateKey(logit, i), [] { return 1ull; }); });
    };
    auto weighed = [&](auto&& g) {
      ForThreadLogits(row, vocab, [&](float logit, int i) {
        g(CandidateKey(logit, i), [&] { return Mass(logit, lmax, inv_t); });
      });
    };
    uint64_t min_key = 0;  // the candidates kept so far: keys >= min_key
    if (top_k > 0 && top_k < vocab) {
      min_key =
          SelectFirstExceeding(counted, 0, static_cast<unsigned long long>(top_k - 1), sm, wh).key;
    }
    // One walk of the row: the kept mass, and the kept candidates of nonzero mass listed in
    // shared memory. The selections below weigh by mass, where a candidate of zero mass never
    // decides (the first candidate whose cumulative mass exceeds a threshold below the total
    // has a mass), so when the list holds them all they walk it instead of the row.
    unsigned long long* list_key = list;
    unsigned long long* list_mass = list + kListCapacity;
    if (threadIdx.x == 0) sm.list_size = 0;
    __syncthreads();
    unsigned long long kept = 0;
    ForThreadLogits(row, vocab, [&](float logit, int i) {
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
    const int listed = static_cast<int>(sm.list_size);
    auto listed_candidates = [&](auto&& g) {
      for (int j = threadIdx.x; j < listed; j += kSampleThreads) {
        const unsigned long long m = list_mass[j];
        g(list_key[j], [m] { return m; });
      }
    };
    // The same choice either way; `listed` is the block's, so every thread takes one branch.
    // An empty list (every mass zero: a row of -inf, outside the contract) walks the row, whose
    // fallback keeps the token in range.
    const bool use_list = listed >= 1 && listed <= kListCapacity;
    auto select = [&](uint64_t from, unsigned long long threshold) {
      return use_list ? SelectFirstExceeding(listed_candidates, from, threshold, sm, wh)
                      : SelectFirstExceeding(weighed, from, threshold, sm, wh);
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
  if (threadIdx.x == 0) {
    a.token[s] = token;
    if (a.log_prob != nullptr) {
      a.log_prob[s] = static_cast<float>(static_cast<double>(row[token]) -
                                         static_cast<double>(lmax) - log(sum));
    }
  }
}

}  // namespace

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
  TP_CUDA_CHECK(cudaFuncSetAttribute(SamplingKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kSampleSmemBytes)));
  TP_CUDA_CHECK(LaunchPdl(SamplingKernel, dim3(static_cast<unsigned>(p.num_seqs)),
                          dim3(kSampleThreads), kSampleSmemBytes, stream, a));
  return Status::Ok();
}

}  // namespace tpserve
