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

const char* Fp8SchemeName(Fp8Scheme scheme) {
  switch (scheme) {
    case Fp8Scheme::kPerTensor:
      return "tensor";
    case Fp8Scheme::kPerChannel:
      return "channel";
    case Fp8Scheme::kBlock:
      return "block";
  }
  return "?";
}

std::optional<Fp8Scheme> ParseFp8Scheme(std::string_view name) {
  for (Fp8Scheme s : {Fp8Scheme::kPerTensor, Fp8Scheme::kPerChannel, Fp8Scheme::kBlock}) {
    if (name == Fp8SchemeName(s)) return s;
  }
  return std::nullopt;
}

int64_t Fp8ActivationScalesPerRow(Fp8Scheme scheme, int64_t k) {
  switch (scheme) {
    case Fp8Scheme::kPerChannel:
      return 1;
    case Fp8Scheme::kBlock:
      return Fp8BlockCount(k);
    case Fp8Scheme::kPerTensor:
      break;
  }
  return 0;
}

int64_t Fp8WeightScaleCount(Fp8Scheme scheme, int64_t n, int64_t k) {
  switch (scheme) {
    case Fp8Scheme::kPerChannel:
      return n;
    case Fp8Scheme::kBlock:
      return Fp8BlockCount(n) * Fp8BlockCount(k);
    case Fp8Scheme::kPerTensor:
      break;
  }
  return 1;
}

void QuantizeActivationsFp8(Fp8Scheme scheme, std::span<const float> x, int64_t k,
                            std::span<uint8_t> codes, std::span<float> scales) {
  assert(k > 0 && x.size() % k == 0 && codes.size() == x.size());
  const int64_t rows = static_cast<int64_t>(x.size()) / k;
  if (scheme == Fp8Scheme::kPerTensor) {
    assert(scales.size() == 1);
    scales[0] = ScaleFromAmax(Amax(x), Fp8Format::kE4M3);
    QuantizeFp8(x, scales[0], Fp8Format::kE4M3, codes);
    return;
  }
  // A row (per token) is one group of length k; block groups are 128 long (the last partial).
  const int64_t group = scheme == Fp8Scheme::kBlock ? kFp8BlockSize : k;
  const int64_t per_row = Fp8ActivationScalesPerRow(scheme, k);
  assert(static_cast<int64_t>(scales.size()) == rows * per_row);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < per_row; ++g) {
      const size_t begin = r * k + g * group;
      const size_t len = std::min(group, k - g * group);
      const float s = ScaleFromAmax(Amax(x.subspan(begin, len)), Fp8Format::kE4M3);
      scales[r * per_row + g] = s;
      QuantizeFp8(x.subspan(begin, len), s, Fp8Format::kE4M3, codes.subspan(begin, len));
    }
  }
}

void DequantizeActivationsFp8(Fp8Scheme scheme, std::span<const uint8_t> codes,
                              std::span<const float> scales, int64_t k, std::span<float> out) {
  assert(k > 0 && codes.size() % k == 0 && out.size() == codes.size());
  const int64_t rows = static_cast<int64_t>(codes.size()) / k;
  const int64_t per_row = Fp8ActivationScalesPerRow(scheme, k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float s =
          scheme == Fp8Scheme::kPerTensor
              ? scales[0]
              : scales[r * per_row + (scheme == Fp8Scheme::kBlock ? c / kFp8BlockSize : 0)];
      out[r * k + c] = Fp8E4M3ToFloat(codes[r * k + c]) * s;
    }
  }
}

void QuantizeWeightsFp8(Fp8Scheme scheme, std::span<const float> w, int64_t n, int64_t k,
                        std::span<uint8_t> codes, std::span<float> scales) {
  assert(w.size() == static_cast<size_t>(n * k) && codes.size() == w.size());
  assert(static_cast<int64_t>(scales.size()) == Fp8WeightScaleCount(scheme, n, k));
  if (scheme != Fp8Scheme::kBlock) {
    // A weight row is an output channel: the per-token layout of activations.
    QuantizeActivationsFp8(scheme, w, k, codes, scales);
    return;
  }
  const int64_t kb = Fp8BlockCount(k);
  for (int64_t br = 0; br < Fp8BlockCount(n); ++br) {
    const int64_t r0 = br * kFp8BlockSize, r1 = std::min(n, r0 + kFp8BlockSize);
    for (int64_t bc = 0; bc < kb; ++bc) {
      const int64_t c0 = bc * kFp8BlockSize, len = std::min(kFp8BlockSize, k - c0);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, Amax(w.subspan(r * k + c0, len)));
      const float s = ScaleFromAmax(amax, Fp8Format::kE4M3);
      scales[br * kb + bc] = s;
      for (int64_t r = r0; r < r1; ++r) {
        QuantizeFp8(w.subspan(r * k + c0, len), s, Fp8Format::kE4M3,
                    codes.subspan(r * k + c0, len));
      }
    }
  }
}

void DequantizeWeightsFp8(Fp8Scheme scheme, std::span<const uint8_t> codes,
                          std::span<const float> scales, int64_t n, int64_t k,
                          std::span<float> out) {
  assert(codes.size() == static_cast<size_t>(n * k) && out.size() == codes.size());
  assert(static_cast<int64_t>(scales.size()) == Fp8WeightScaleCount(scheme, n, k));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      out[r * k + c] =
          Fp8E4M3ToFloat(codes[r * k + c]) * scales[Fp8WeightScaleIndex(scheme, k, r, c)];
    }
  }
}

}  // namespace tpserve
