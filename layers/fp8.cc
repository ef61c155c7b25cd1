#include "layers/fp8.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <limits>

namespace tpserve {
namespace {

// Describes one FP8 format in terms of float32 bit patterns, so that encoding works on the
// float's bits directly. CUDA's host code widens to double first; float -> double is exact,
// so rounding the float directly gives the same bits and is several times faster.
struct Fp8Spec {
  int mantissa_bits;
  int bias;
  // |x| bits above this saturate. It is max + half an ulp for E4M3 (a tie at 464 rounds
  // down to even 448). For E5M2 the tie at 61440 would round up to the odd-mantissa
  // neighbour (inf), so CUDA saturates it as well: threshold is one float below 61440.
  uint32_t overflow_threshold_bits;
  uint8_t max_code;
  bool has_inf;
};

constexpr Fp8Spec kE4M3Spec{3, 7, 0x43E80000u /*464*/, 0x7E, false};
constexpr Fp8Spec kE5M2Spec{2, 15, 0x47700000u /*61440*/ - 1u, 0x7B, true};

constexpr uint32_t kFloatAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kFloatInfBits = 0x7F800000u;
constexpr uint32_t kFloatMantissaMask = 0x007FFFFFu;
constexpr uint32_t kFloatImplicitBit = 0x00800000u;
constexpr int kFloatMantissaBits = 23;
constexpr int kFloatBias = 127;
// CUDA canonicalises every NaN (sign and payload) before converting; both formats end up
// with all exponent and mantissa bits set.
constexpr uint8_t kFp8NanCode = 0x7F;

template <const Fp8Spec& kSpec>
inline uint8_t EncodeFloat(float x) {
  constexpr int kM = kSpec.mantissa_bits;
  constexpr int kDroppedBits = kFloatMantissaBits - kM;
  // Smallest float exponent (biased) that is a normal number in the FP8 format.
  constexpr uint32_t kMinNormalExp = static_cast<uint32_t>(kFloatBias + 1 - kSpec.bias);
  // Below half the smallest subnormal (2^(-bias-M)) everything rounds to zero; exactly half
  // is a tie that rounds to even zero, which the subnormal path below handles.
  constexpr uint32_t kMinSubnormalHalfExp = static_cast<uint32_t>(kFloatBias - kSpec.bias - kM);

  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & kFloatAbsMask;

  if (abs_bits > kFloatInfBits) return kFp8NanCode;
  if (abs_bits > kSpec.overflow_threshold_bits) return sign | kSpec.max_code;

  const uint32_t exp = abs_bits >> kFloatMantissaBits;
  if (exp >= kMinNormalExp) {
    // Rebias the exponent in place; a mantissa carry out of the rounding increments the
    // exponent, which is exactly the next binade's encoding.
    uint32_t v = abs_bits - ((kMinNormalExp - 1) << kFloatMantissaBits);
    v += ((1u << (kDroppedBits - 1)) - 1) + ((v >> kDroppedBits) & 1u);
    return sign | static_cast<uint8_t>(v >> kDroppedBits);
  }
  if (exp < kMinSubnormalHalfExp) return sign;

  // Subnormal result: the value in units of the smallest subnormal 2^(1-bias-M) is
  // mantissa * 2^-shift. A carry into bit M yields the smallest normal code, as it should.
  const uint32_t mantissa = (abs_bits & kFloatMantissaMask) | kFloatImplicitBit;
  const uint32_t shift =
      static_cast<uint32_t>(kFloatBias + kFloatMantissaBits + 1 - kSpec.bias - kM) - exp;
  uint32_t q = mantissa >> shift;
  const uint32_t rem = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint8_t>(q);
}

template <const Fp8Spec& kSpec>
constexpr float DecodeCode(uint8_t v) {
  constexpr int kM = kSpec.mantissa_bits;
  constexpr uint32_t kMantissaMask = (1u << kM) - 1u;
  constexpr uint32_t kExpMask = (1u << (7 - kM)) - 1u;
  const bool negative = (v & 0x80u) != 0;
  const uint32_t exp = (v >> kM) & kExpMask;
  const uint32_t mantissa = v & kMantissaMask;

  float magnitude;
  if (kSpec.has_inf && exp == kExpMask) {
    if (mantissa != 0) return std::numeric_limits<float>::quiet_NaN();
    magnitude = std::numeric_limits<float>::infinity();
  } else if (!kSpec.has_inf && exp == kExpMask && mantissa == kMantissaMask) {
    return std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    // mantissa * 2^(1-bias-M), built as a power of two so that it is exact in constexpr.
    const float unit = std::bit_cast<float>(static_cast<uint32_t>(kFloatBias + 1 - kSpec.bias - kM)
                                            << kFloatMantissaBits);
    magnitude = static_cast<float>(mantissa) * unit;
  } else {
    magnitude = std::bit_cast<float>(
        ((exp - static_cast<uint32_t>(kSpec.bias) + kFloatBias) << kFloatMantissaBits) |
        (mantissa << (kFloatMantissaBits - kM)));
  }
  return negative ? -magnitude : magnitude;
}

template <const Fp8Spec& kSpec>
constexpr std::array<float, 256> MakeDecodeTable() {
  std::array<float, 256> table{};
  for (size_t i = 0; i < table.size(); ++i) {
    table[i] = DecodeCode<kSpec>(static_cast<uint8_t>(i));
  }
  return table;
}

constexpr std::array<float, 256> kE4M3Table = MakeDecodeTable<kE4M3Spec>();
constexpr std::array<float, 256> kE5M2Table = MakeDecodeTable<kE5M2Spec>();

template <const Fp8Spec& kSpec>
void QuantizeImpl(std::span<const float> in, float scale, std::span<uint8_t> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = EncodeFloat<kSpec>(in[i] / scale);
}

void DequantizeImpl(std::span<const uint8_t> in, float scale, const std::array<float, 256>& table,
                    std::span<float> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = table[in[i]] * scale;
}

}  // namespace

uint8_t FloatToFp8E4M3(float x) { return EncodeFloat<kE4M3Spec>(x); }
uint8_t FloatToFp8E5M2(float x) { return EncodeFloat<kE5M2Spec>(x); }

float Fp8E4M3ToFloat(uint8_t v) { return kE4M3Table[v]; }
float Fp8E5M2ToFloat(uint8_t v) { return kE5M2Table[v]; }

uint8_t FloatToFp8(float x, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? FloatToFp8E4M3(x) : FloatToFp8E5M2(x);
}

float Fp8ToFloat(uint8_t v, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? Fp8E4M3ToFloat(v) : Fp8E5M2ToFloat(v);
}

float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3 ? kFp8E4M3Max : kFp8E5M2Max; }

float Amax(std::span<const float> x) {
  float amax = 0.0f;
  // std::max(a, b) keeps a when b is NaN, which is what skips NaN elements.
  for (float v : x) amax = std::max(amax, std::fabs(v));
  return amax;
}

float ScaleFromAmax(float amax, Fp8Format f) {
  if (amax == 0.0f) return 1.0f;
  return std::max(amax / Fp8Max(f), std::numeric_limits<float>::denorm_min());
}

void QuantizeFp8(std::span<const float> in, float scale, Fp8Format f, std::span<uint8_t> out) {
  assert(in.size() == out.size());
  if (f == Fp8Format::kE4M3) {
    QuantizeImpl<kE4M3Spec>(in, scale, out);
  } else {
    QuantizeImpl<kE5M2Spec>(in, scale, out);
  }
}

void DequantizeFp8(std::span<const uint8_t> in, float scale, Fp8Format f, std::span<float> out) {
  assert(in.size() == out.size());
  DequantizeImpl(in, scale, f == Fp8Format::kE4M3 ? kE4M3Table : kE5M2Table, out);
}

}  // namespace tpserve
