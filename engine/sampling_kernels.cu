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
constexpr double kMassScale = 17592186044416.0;  // 2^44: 2^17 tokens of mass <= 1 fit in 2^61

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

struct SampleShared {
  unsigned long long weight[256];
  unsigned int count[256];
  unsigned long long u64[kSampleWarps];
  double f64[kSampleWarps];
  unsigned long long result[4];  // prefix, threshold, weight ahead, chosen weight
};

__device__ unsigned long long BlockMaxU64(unsigned long long v, SampleShared& sm) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const unsigned long long o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  __syncthreads();  // sm.u64 may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) sm.u64[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned long long r = 0;
  for (int w = 0; w < kSampleWarps; ++w) r = sm.u64[w] > r ? sm.u64[w] : r;
  return r;
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

__device__ double BlockSumF64(double v, SampleShared& sm) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm.f64[threadIdx.x >> 5] = v;
  __syncthreads();
  double r = 0;
  for (int w = 0; w < kSampleWarps; ++w) r += sm.f64[w];  // same order in every thread
  return r;
}

// exp(logit / T - max / T) as SampleToken computes it, in 2^-44 fixed point.
__device__ __forceinline__ unsigned long long Mass(float logit, double inv_t, double top) {
  const double p = exp(static_cast<double>(logit) * inv_t - top);
  return static_cast<unsigned long long>(p * kMassScale + 0.5);
}

struct Selected {
  uint64_t key;
  unsigned long long cumulative;  // weight of the candidates up to and including it
};

// The first candidate (key >= min_key, in key-descending order) whose cumulative weight
// exceeds `threshold`; the last such candidate if none does. by_mass: weights are Mass(),
// else 1.
__device__ Selected SelectFirstExceeding(const float* row, int vocab, bool by_mass, double inv_t,
                                         double top, uint64_t min_key, unsigned long long threshold,
                                         SampleShared& sm) {
  uint64_t prefix = 0;
  unsigned long long before = 0;  // weight of the candidates ahead of the prefix
  unsigned long long chosen_weight = 0;
  for (int level = 0; level < 8; ++level) {
    const int shift = 56 - 8 * level;
    for (int i = threadIdx.x; i < 256; i += kSampleThreads) {
      sm.weight[i] = 0;
      sm.count[i] = 0;
    }
    __syncthreads();
    // Run-length aggregation: neighbouring candidates of one thread mostly share a digit (the
    // top digits of similar logits are equal), so flush to shared memory on a change only.
    int run_digit = -1;
    unsigned long long run_weight = 0;
    unsigned int run_count = 0;
    for (int i = threadIdx.x; i < vocab; i += kSampleThreads) {
      const float logit = row[i];
      const uint64_t key = CandidateKey(logit, i);
      if (key < min_key) continue;
      if (level > 0 && (key >> (shift + 8)) != (prefix >> (shift + 8))) continue;
      const int digit = static_cast<int>((key >> shift) & 0xFF);
      const unsigned long long w = by_mass ? Mass(logit, inv_t, top) : 1ull;
      if (digit != run_digit) {
        if (run_count > 0) {
          atomicAdd(&sm.weight[run_digit], run_weight);
          atomicAdd(&sm.count[run_digit], run_count);
        }
        run_digit = digit;
        run_weight = 0;
        run_count = 0;
      }
      run_weight += w;
      ++run_count;
    }
    if (run_count > 0) {
      atomicAdd(&sm.weight[run_digit], run_weight);
      atomicAdd(&sm.count[run_digit], run_count);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long acc = 0, acc_last = 0;
      int chosen = -1, last = -1;
      for (int d = 255; d >= 0; --d) {
        if (sm.count[d] == 0) continue;
        last = d;
        acc_last = acc;
        if (acc + sm.weight[d] > threshold) {
          chosen = d;
          break;
        }
        acc += sm.weight[d];
      }
      if (chosen < 0) {  // nothing exceeds: the last candidate (none at all cannot happen)
        chosen = last < 0 ? 0 : last;
        acc = last < 0 ? 0 : acc_last;
      }
      sm.result[0] = prefix | (static_cast<uint64_t>(chosen) << shift);
      sm.result[1] = threshold - acc;  // relative to the chosen bucket's first candidate
      sm.result[2] = acc;              // weight ahead of the chosen bucket within the prefix
      sm.result[3] = last < 0 ? 0 : sm.weight[chosen];
    }
    __syncthreads();
    prefix = sm.result[0];
    threshold = sm.result[1];
    before += sm.result[2];
    chosen_weight = sm.result[3];  // at the last level: the one candidate's own weight
    __syncthreads();               // result and the histograms are rewritten next
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
};

__global__ void __launch_bounds__(kSampleThreads) SamplingKernel(SampleArgs a) {
  __shared__ SampleShared sm;
  const int s = blockIdx.x;
  const float* row = a.logits + static_cast<int64_t>(s) * a.logits_row_stride;
  const int vocab = a.vocab;

  // Greedy choice: the largest key (largest logit, lowest id among equal ones).
  unsigned long long best = 0;
  for (int i = threadIdx.x; i < vocab; i += kSampleThreads) {
    const unsigned long long key = CandidateKey(row[i], i);
    best = key > best ? key : best;
  }
  best = BlockMaxU64(best, sm);
  const int argmax = KeyId(best);
  const float lmax = row[argmax];

  // log_softmax's denominator: each term exp(logit - max) in FP32 (in [0, 1], a few ulp),
  // summed in double. A double exp per vocabulary entry was most of a greedy step's sampling.
  double sum = 0.0;
  if (a.log_prob != nullptr) {
    for (int i = threadIdx.x; i < vocab; i += kSampleThreads) sum += expf(row[i] - lmax);
    sum = BlockSumF64(sum, sm);
  }

  const float temperature = a.temperature[s];
  const int32_t top_k = a.top_k[s];
  const float top_p = a.top_p[s];
  int token = argmax;
  const bool greedy = !(temperature > 0.0f && temperature <= 3.402823466e38f) || top_k == 1;
  if (!greedy) {
    const double inv_t = 1.0 / static_cast<double>(temperature);
    const double top = static_cast<double>(lmax) * inv_t;
    uint64_t min_key = 0;  // the candidates kept so far: keys >= min_key
    if (top_k > 0 && top_k < vocab) {
      min_key = SelectFirstExceeding(row, vocab, false, inv_t, top, 0,
                                     static_cast<unsigned long long>(top_k - 1), sm)
                    .key;
    }
    unsigned long long kept = 0;
    for (int i = threadIdx.x; i < vocab; i += kSampleThreads) {
      const float logit = row[i];
      if (CandidateKey(logit, i) >= min_key) kept += Mass(logit, inv_t, top);
    }
    kept = BlockSumU64(kept, sm);
    if (top_p < 1.0f) {
      // The shortest prefix whose sum reaches top_p * kept: the first candidate whose
      // cumulative weight is >= that, i.e. > ceil(it) - 1 for integer weights.
      const double target = ceil(static_cast<double>(top_p) * static_cast<double>(kept));
      const unsigned long long threshold =
          target >= 1.0 ? static_cast<unsigned long long>(target) - 1ull : 0ull;
      const Selected cut =
          SelectFirstExceeding(row, vocab, true, inv_t, top, min_key, threshold, sm);
      min_key = cut.key;
      kept = cut.cumulative;
    }
    const double u = SampleUniformDevice(a.seed[s], a.index[s]);
    // cumulative > u * kept  <=>  cumulative > floor(u * kept) for integer cumulatives.
    const unsigned long long threshold =
        static_cast<unsigned long long>(floor(u * static_cast<double>(kept)));
    token = KeyId(SelectFirstExceeding(row, vocab, true, inv_t, top, min_key, threshold, sm).key);
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

Status LaunchSampling(const SamplingLaunchParams& p, cudaStream_t stream) {
  constexpr const char* kP = "SamplingLaunchParams";
  if (p.vocab < 1 || p.vocab > std::numeric_limits<int32_t>::max()) {
    return BadField(kP, "vocab", p.vocab, "must be in [1, 2^31 - 1]");
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
                                        {"log_prob", p.log_prob, 4, false}}));
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
  SamplingKernel<<<static_cast<unsigned>(p.num_seqs), kSampleThreads, 0, stream>>>(a);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace tpserve
