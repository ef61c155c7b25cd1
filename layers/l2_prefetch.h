// A hint that a kernel may carry: device memory another kernel will read soon (the next GEMM's
// weight in a decode step), which the kernel's CTAs ask into L2 while HBM would otherwise sit
// idle (a latency-bound attention kernel, a GEMM's last CTAs). The hint never changes a result:
// the bytes are only read, and a kernel that ignores it is still correct. Plain C++17; the
// split arithmetic is usable on the device too (layers/l2_prefetch.cuh issues the requests).
#pragma once

#include <cstdint>
#include <string>

#include "comm/status.h"

#if defined(__CUDACC__)
#define TP_L2_PREFETCH_HD __host__ __device__
#else
#define TP_L2_PREFETCH_HD
#endif

namespace tpserve {

// Up to two device ranges (a gate_up weight's first rows are two: gate rows and up rows).
// A range with bytes == 0 is unused. Each used range starts 16-byte aligned and spans a
// multiple of 16 bytes (the bulk prefetch's unit). Read by value at launch.
struct L2Prefetch {
  static constexpr int kRanges = 2;
  const void* ptr[kRanges] = {nullptr, nullptr};
  uint64_t bytes[kRanges] = {0, 0};

  TP_L2_PREFETCH_HD uint64_t total() const { return bytes[0] + bytes[1]; }
  TP_L2_PREFETCH_HD bool empty() const { return total() == 0; }
};

// OK, or INVALID_ARGUMENT naming `what` and the range: a used range whose pointer is null or
// not 16-byte aligned, or whose byte count is not a multiple of 16. Pure.
Status CheckL2Prefetch(const L2Prefetch& p, const std::string& what);

// The part of the ranges, taken end to end, that issuer `part` of `parts` (> 0) asks for:
// bytes [*begin, *end) of the concatenation, cut at 16-byte units so that the parts tile it
// exactly, in order, each within one unit of the others' sizes. Pure.
TP_L2_PREFETCH_HD inline void L2PrefetchPart(const L2Prefetch& p, uint64_t part, uint64_t parts,
                                             uint64_t* begin, uint64_t* end) {
  const uint64_t units = p.total() / 16;
  *begin = units * part / parts * 16;
  *end = units * (part + 1) / parts * 16;
}

// A whole weight of `bytes`, capped at `cap` bytes (rounded down to 16): its first bytes.
L2Prefetch L2PrefetchOf(const void* ptr, uint64_t bytes, uint64_t cap);

}  // namespace tpserve
