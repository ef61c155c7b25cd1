// Element types that cross tpserve's module boundaries, and the BF16 <-> FP32
// conversion that the CPU reference uses (bit-exact with CUDA's __float2bfloat16:
// round to nearest even, NaN kept quiet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace tpserve {

enum class DataType : int {
  kFloat32,
  kBFloat16,
  kFloat8E4M3,
  kFloat8E5M2,
  kInt32,
  kInt64,
  kUInt8,
};

size_t DataTypeSize(DataType t);
std::string_view DataTypeName(DataType t);  // "f32", "bf16", "fp8_e4m3", ...

// BF16 stored as its 16 raw bits.
struct BFloat16 {
  uint16_t bits = 0;
};

inline float BFloat16ToFloat(BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline BFloat16 FloatToBFloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet bit
    return BFloat16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest, ties to even
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

}  // namespace tpserve
