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
#include <span>

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

}  // namespace tpserve
