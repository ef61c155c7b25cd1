// CPU FP8 codec: the reference that GPU quantization kernels and cuBLASLt FP8 GEMMs are
// checked against, so every conversion is bit-exact with CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt) and __nv_cvt_fp8_to_halfraw (as verified by
// tests/fp8_test.cc against cuda_fp8.h's host implementation).
//
// Formats (OCP FP8):
//   E4M3: bias 7, no infinities, 0x7F/0xFF are NaN, max finite 448.
//   E5M2: bias 15, IEEE-like (0x7C/0xFC are +-inf, 0x7D..0x7F/0xFD..0xFF NaN), max 57344.
//
// Encoding rounds to nearest, ties to even, subnormals included. It saturates: finite values
// beyond max and +-inf become +-max (an overflowing activation must not turn into NaN/inf
// and poison a whole GEMM row). Every NaN input, whatever its sign or payload, becomes 0x7F
// in both formats, because that is what CUDA produces. The sign of -0 and of values that
// underflow to zero is kept (0x80).
//
// All functions are pure and thread-safe; nothing allocates.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "layers/scale_scheme.h"

namespace tpserve {

enum class Fp8Format { kE4M3, kE5M2 };

inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;

// Bit-exact with __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3 / __NV_E5M2).
uint8_t FloatToFp8E4M3(float x);
uint8_t FloatToFp8E5M2(float x);

// Exact: every FP8 value is a float. NaN codes decode to a positive quiet NaN (CUDA drops
// the sign of NaN too); E5M2's infinity codes decode to +-inf.
float Fp8E4M3ToFloat(uint8_t v);
float Fp8E5M2ToFloat(uint8_t v);

uint8_t FloatToFp8(float x, Fp8Format f);
float Fp8ToFloat(uint8_t v, Fp8Format f);

// Largest finite value of the format (kFp8E4M3Max or kFp8E5M2Max).
float Fp8Max(Fp8Format f);

// max |x[i]|; 0 for an empty span. Input is assumed NaN-free; a NaN element is skipped (like
// CUDA's fmaxf) rather than propagated, so a single NaN does not turn the scale, and hence
// every other element of the tensor, into NaN. The NaN element itself still quantizes to
// the NaN code. An infinite element makes the result inf.
float Amax(std::span<const float> x);

// Per-tensor *dequantization* scale, cuBLASLt convention: real = fp8 * scale, so that amax
// maps to Fp8Max(f). Returns 1.0f for amax == 0 (an all-zero tensor must not produce a zero
// scale that QuantizeFp8 would divide by). For a subnormal amax whose quotient underflows to
// zero the smallest positive float is returned for the same reason (such tensors lose
// precision, but stay finite). amax must be >= 0; a non-finite amax gives a non-finite scale.
float ScaleFromAmax(float amax, Fp8Format f);

// out[i] = FloatToFp8(in[i] / scale, f), with scale a dequantization scale (see above).
// Division, not multiplication by 1/scale, so that a value equal to amax lands on Fp8Max
// (+-1 ulp of float) and hence on the max code. Requires in.size() == out.size()
// (asserted) and a finite scale > 0; in and out must not overlap.
void QuantizeFp8(std::span<const float> in, float scale, Fp8Format f, std::span<uint8_t> out);

// out[i] = Fp8ToFloat(in[i], f) * scale. Requires in.size() == out.size() (asserted).
void DequantizeFp8(std::span<const uint8_t> in, float scale, Fp8Format f, std::span<float> out);

// ---- Scale schemes of an FP8 linear layer Y[m, n] = X[m, k] · W[n, k]^T ----
//
// How the dequantization scales of X (activations, quantized at run time) and W (weights,
// as the checkpoint stores them) are laid out. Every scale follows the convention above:
// real = fp8 * scale, scale = ScaleFromAmax(amax of what it covers).
//   kPerTensor  W: one scale.  X: one scale (static from the checkpoint, or dynamic from the
//               whole input's amax; the caller decides).
//   kPerChannel W: one scale per output channel (row of W), n scales.
//               X: one dynamic scale per row ("per token"): amax(row) / 448.
//   kBlock      W: one scale per 128x128 block, a row-major grid [ceil(n/128), ceil(k/128)]
//               (the last block row/column may be partial).
//               X: one dynamic scale per 1x128 group of a row, [m, ceil(k/128)] row-major.
// Per-channel and block scales keep outliers (a large channel, a large token, a large block)
// from flattening everything else into E4M3's subnormals, as one scale per tensor does.
enum class Fp8Scheme { kPerTensor, kPerChannel, kBlock };

// The GEMM's scheme for an FP8 weight of checkpoint scheme `scheme` (per channel: per token and
// channel; block: blockwise).
inline GemmScaleScheme GemmScaleSchemeOf(Fp8Scheme scheme) {
  return scheme == Fp8Scheme::kPerChannel ? GemmScaleScheme::kPerTokenChannel
         : scheme == Fp8Scheme::kBlock    ? GemmScaleScheme::kBlockwise
                                          : GemmScaleScheme::kPerTensor;
}

// Edge of a weight block and length of an activation group.
inline constexpr int64_t kFp8BlockSize = 128;

// "tensor", "channel", "block" (the spellings of compressed-tensors' weights.strategy).
const char* Fp8SchemeName(Fp8Scheme scheme);
// The inverse of Fp8SchemeName; nullopt for anything else.
std::optional<Fp8Scheme> ParseFp8Scheme(std::string_view name);

// ceil(count / kFp8BlockSize) for count >= 0.
constexpr int64_t Fp8BlockCount(int64_t count) {
  return (count + kFp8BlockSize - 1) / kFp8BlockSize;
}

// Scales of X per row: 0 for kPerTensor (one for the whole tensor), 1, or ceil(k/128).
int64_t Fp8ActivationScalesPerRow(Fp8Scheme scheme, int64_t k);
// Scales of a [n, k] W: 1, n, or ceil(n/128) * ceil(k/128).
int64_t Fp8WeightScaleCount(Fp8Scheme scheme, int64_t n, int64_t k);
// Index into W's scales of element (row, col) of a [n, k] W (0 for kPerTensor).
inline int64_t Fp8WeightScaleIndex(Fp8Scheme scheme, int64_t k, int64_t row, int64_t col) {
  switch (scheme) {
    case Fp8Scheme::kPerChannel:
      return row;
    case Fp8Scheme::kBlock:
      return (row / kFp8BlockSize) * Fp8BlockCount(k) + col / kFp8BlockSize;
    case Fp8Scheme::kPerTensor:
      break;
  }
  return 0;
}

// Dynamic quantization of activations x [rows, k] (rows = x.size() / k) under `scheme`,
// E4M3: codes [rows, k] and scales (kPerTensor: 1 value, from the whole x's amax; kPerChannel:
// rows values; kBlock: rows * ceil(k/128), row-major). Each scale is ScaleFromAmax of the
// amax of what it covers, each code FloatToFp8E4M3(x / its scale). Sizes are asserted.
void QuantizeActivationsFp8(Fp8Scheme scheme, std::span<const float> x, int64_t k,
                            std::span<uint8_t> codes, std::span<float> scales);
// out = code * its scale, for codes/scales laid out as QuantizeActivationsFp8 writes them.
void DequantizeActivationsFp8(Fp8Scheme scheme, std::span<const uint8_t> codes,
                              std::span<const float> scales, int64_t k, std::span<float> out);

// Quantization of a weight w [n, k] under `scheme`, E4M3: codes [n, k] and scales
// (Fp8WeightScaleCount of them, each from the amax of what it covers). Sizes are asserted.
void QuantizeWeightsFp8(Fp8Scheme scheme, std::span<const float> w, int64_t n, int64_t k,
                        std::span<uint8_t> codes, std::span<float> scales);
// out[r, c] = code[r, c] * scales[Fp8WeightScaleIndex(scheme, k, r, c)].
void DequantizeWeightsFp8(Fp8Scheme scheme, std::span<const uint8_t> codes,
                          std::span<const float> scales, int64_t n, int64_t k,
                          std::span<float> out);

}  // namespace tpserve
