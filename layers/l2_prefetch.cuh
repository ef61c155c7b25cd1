// Device side of layers/l2_prefetch.h: one thread asks its part of the ranges into L2 with
// bulk prefetches (sm_90: cp.async.bulk.prefetch.L2; earlier parts: nothing). Fire and
// forget: no completion to wait for, nothing written, so a kernel may issue it anywhere,
// before its PDL wait included (the ranges are read-only for as long as the hint is in use).
#pragma once

#include <cstdint>

#include "layers/l2_prefetch.h"

namespace tpserve {

__device__ __forceinline__ void IssueL2Prefetch(const L2Prefetch& p, uint64_t part,
                                                uint64_t parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t begin, end;
  L2PrefetchPart(p, part, parts, &begin, &end);
  uint64_t base = 0;
  for (int i = 0; i < L2Prefetch::kRanges; ++i) {
    const uint64_t lo = begin > base ? begin : base;
    const uint64_t hi = end < base + p.bytes[i] ? end : base + p.bytes[i];
    // One request per 64 KiB keeps each within the instruction's 32-bit size.
    for (uint64_t at = lo; at < hi; at += 65536) {
      const uint64_t n = hi - at < 65536 ? hi - at : 65536;
      const char* src = static_cast<const char*>(p.ptr[i]) + (at - base);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src),
                   "r"(static_cast<uint32_t>(n))
                   : "memory");
    }
    base += p.bytes[i];
  }
#else
  (void)p;
  (void)part;
  (void)parts;
#endif
}

}  // namespace tpserve
