// CheckL2Prefetch and L2PrefetchOf (layers/l2_prefetch.h).
#include "layers/l2_prefetch.h"

#include <algorithm>
#include <cstdint>
#include <string>

namespace tpserve {

Status CheckL2Prefetch(const L2Prefetch& p, const std::string& what) {
  for (int i = 0; i < L2Prefetch::kRanges; ++i) {
    if (p.bytes[i] == 0) continue;
    const std::string range = what + ".ptr[" + std::to_string(i) + "]";
    if (p.ptr[i] == nullptr) {
      return InvalidArgumentError(range + " is null with " + std::to_string(p.bytes[i]) +
                                  " bytes to prefetch");
    }
    if (reinterpret_cast<uintptr_t>(p.ptr[i]) % 16 != 0) {
      return InvalidArgumentError(range + " must be 16-byte aligned");
    }
    if (p.bytes[i] % 16 != 0) {
      return InvalidArgumentError(what + ".bytes[" + std::to_string(i) + "] = " +
                                  std::to_string(p.bytes[i]) + ": must be a multiple of 16");
    }
  }
  return Status::Ok();
}

L2Prefetch L2PrefetchOf(const void* ptr, uint64_t bytes, uint64_t cap) {
  L2Prefetch p;
  if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return p;
  p.ptr[0] = ptr;
  p.bytes[0] = std::min(bytes, cap) / 16 * 16;
  return p;
}

}  // namespace tpserve
