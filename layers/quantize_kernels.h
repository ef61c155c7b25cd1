// Element-wise FP8 kernels: quantize, absolute maximum, dequantize, and a poison fill for tests.
//
// Launchers only; the kernels live in quantize_kernels.cu, so .cc files can include this.
// Each launcher checks its arguments (INVALID_ARGUMENT naming the field, UNIMPLEMENTED for an
// unsupported type), enqueues onto `stream` and returns. None allocates or synchronises, so
// all can be captured in a CUDA graph. Pointers are device pointers; `count` is in elements.
// Any alignment works; 16-byte aligned buffers take the vectorised path.
//
// Numerics are bit-exact with the CPU reference in layers/fp8.h (FloatToFp8E4M3, Amax,
// QuantizeFp8): scales are *dequantization* scales (real value = fp8 code * scale), quantizing
// divides by the scale (IEEE division, not a reciprocal multiply), and rounding is to nearest
// even with saturation to +-448 (__nv_cvt_float_to_fp8 with __NV_SATFINITE).
//
// Only compiled when TPSERVE_WITH_CUDA is on.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "comm/dtype.h"
#include "comm/status.h"

namespace tpserve {

// out[i] = FloatToFp8E4M3(in[i] / *scale).
struct QuantizeFp8Params {
  const void* input = nullptr;                // count elements of input_type
  DataType input_type = DataType::kBFloat16;  // kBFloat16 or kFloat32
  uint8_t* output = nullptr;                  // count FP8 E4M3 codes
  size_t count = 0;
  const float* scale = nullptr;  // one float, dequantization scale, finite and > 0
};
Status LaunchQuantizeToFp8E4M3(const QuantizeFp8Params& p, cudaStream_t stream);

// *amax = max |in[i]| (0 for count == 0). NaN elements are skipped, as in layers/fp8.h's Amax;
// an infinite element gives inf. The launcher zeroes *amax first (cudaMemsetAsync on the same
// stream), so *amax must not be read by other streams until this work completes.
struct AbsMaxParams {
  const void* input = nullptr;
  DataType input_type = DataType::kBFloat16;  // kBFloat16 or kFloat32
  size_t count = 0;
  float* amax = nullptr;  // one float
};
Status LaunchAbsMax(const AbsMaxParams& p, cudaStream_t stream);

// *scale = ScaleFromAmax(max(amax[0..count)), E4M3) of layers/fp8.h: the dequantization scale
// that maps the largest of `count` partial amaxes (one per rank, say) to 448; 1 when it is 0.
// One thread; amax and scale on the device (run-time, dynamic activation scaling).
Status LaunchScaleFromAmax(const float* amax, int count, float* scale, cudaStream_t stream);

// out[i] = Fp8E4M3ToFloat(in[i]) * *scale, rounded to output_type (RNE for BF16).
struct DequantizeFp8Params {
  const uint8_t* input = nullptr;              // count FP8 E4M3 codes
  void* output = nullptr;                      // count elements of output_type
  DataType output_type = DataType::kBFloat16;  // kBFloat16 or kFloat32
  size_t count = 0;
  const float* scale = nullptr;  // one float, dequantization scale
};
Status LaunchDequantizeFp8E4M3(const DequantizeFp8Params& p, cudaStream_t stream);

// Dynamic quantization of a BF16 matrix to FP8 E4M3 with scales computed on the fly, for the
// GEMM's per-token and blockwise scale schemes (layers/cublaslt_gemm.h, GemmScaleScheme):
//   kPerRow:      scales[i] = ScaleFromAmax(max_c |in[i][c]|), one float per row (token),
//                 the layout of GemmScaleScheme::kPerTokenChannel's a_scale.
//   kPerGroup128: scales[g * rows + i] = ScaleFromAmax(max |in[i][128g .. 128g+127]|), one
//                 float per 1x128 group, token-major (column g of the groups is `rows`
//                 consecutive floats): the layout of GemmScaleScheme::kBlockwise's a_scale
//                 (cuBLASLt VEC128_32F) when rows is the GEMM's m.
// ScaleFromAmax is layers/fp8.h's: amax / 448 (IEEE division, at least the smallest
// subnormal), and 1 for an all-zero row or group (its codes are then zeros, and any scale
// would dequantize them to zero; 1 keeps the scale finite and harmless). NaN elements are
// skipped by the amax (their codes stay NaN); an infinite element makes the scale inf.
// out[i][c] = FloatToFp8E4M3(in[i][c] / scale) exactly as layers/fp8.h computes it, so a CPU
// reference built from layers/fp8.h matches bit for bit.
// Contract: input and output 16-byte aligned, row pitches multiples of 16 bytes (input_ld % 8,
// output_ld % 16), cols % 8 == 0 for kPerRow and cols % 128 == 0 for kPerGroup128; scales
// 4-byte aligned (the GEMM wants 16). One launch, no allocation, no synchronisation.
enum class Fp8ScaleGranularity { kPerRow, kPerGroup128 };
struct QuantizeFp8DynamicParams {
  const void* input = nullptr;  // rows x cols BF16, row pitch input_ld
  uint8_t* output = nullptr;    // rows x cols FP8 E4M3 codes, row pitch output_ld
  float* scales = nullptr;      // rows (kPerRow) or rows * cols / 128 (kPerGroup128) floats
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t input_ld = 0;   // elements; 0 = cols
  int64_t output_ld = 0;  // elements; 0 = cols
  Fp8ScaleGranularity granularity = Fp8ScaleGranularity::kPerRow;
};
Status LaunchQuantizeFp8Dynamic(const QuantizeFp8DynamicParams& p, cudaStream_t stream);

// NaN bit patterns that arithmetic never produces (CUDA's canonical NaNs are 0x7FFF /
// 0x7FFFFFFF; E4M3 has only 0x7F/0xFF), so a poisoned element that survives a kernel is
// recognisably unwritten.
inline constexpr uint16_t kBf16PoisonBits = 0x7FC1;
inline constexpr uint8_t kFp8E4M3PoisonBits = 0x7F;
inline constexpr uint32_t kFp32PoisonBits = 0x7FC00001u;

// Fills count elements of element_bytes (1, 2 or 4) with `pattern` (its low bytes).
// dst must be aligned to element_bytes.
Status LaunchFillPattern(void* dst, size_t count, size_t element_bytes, uint32_t pattern,
                         cudaStream_t stream);

// Fills count elements of `type` with its poison pattern above (kBFloat16, kFloat8E4M3,
// kFloat32).
Status LaunchPoisonFill(void* dst, DataType type, size_t count, cudaStream_t stream);

}  // namespace tpserve
