// Random tensors generated on the GPU (benchmarks, random-weight models):
// (and a delay kernel and an L2 flush for benchmarks, at the end)
// element i depends only on (seed, i), so every run and every launch
// configuration gives the same tensor.
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "comm/dtype.h"
#include "comm/status.h"

namespace tpserve {

// dst[i] = to_type(u_i * scale), u_i uniform in [-1, 1). FP8: converted with
// saturation and RNE (dequantization scale 1 is implied: the codes hold the
// values). Types: kFloat8E4M3, kBFloat16, kFloat32.
Status LaunchRandomUniform(void* dst, DataType type, size_t count, uint64_t seed, float scale,
                           cudaStream_t stream);

// One thread that spins for `ns` nanoseconds (globaltimer), keeping the
// stream busy so that the host can queue what follows before the GPU reaches
// it: benchmarks put it before a round of timed launches, so that no timed
// interval includes host launch latency. ns <= 0 launches nothing.
// let_next_start: launched with programmatic dependent launch (layers/pdl.cuh), it lets the
// next PDL kernel in the stream be scheduled at once, so that kernel runs its part before
// its PDL wait while this one spins: tests put it ahead of a kernel that reads memory before
// its wait, to show which loads wait.
Status LaunchGpuDelay(int64_t ns, cudaStream_t stream, bool let_next_start = false);

// Reads `bytes` of `buffer` (16-byte aligned, bytes a multiple of 16) into L2 and nowhere
// else: a benchmark's L2 flush that leaves only clean lines behind, where a flush by writing
// (cudaMemset) leaves dirty lines whose write-back the next timed kernel pays. Writes nothing.
Status LaunchL2FlushByReading(const void* buffer, size_t bytes, cudaStream_t stream);

}  // namespace tpserve
