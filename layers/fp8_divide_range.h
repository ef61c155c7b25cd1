// The scales for which the GPU's quantize kernels divide by the scale's reciprocal and one FMA
// correction (layers/fp8_divide.cuh) instead of the IEEE division; both give the CPU's
// RN(x / scale) wherever it decides an E4M3 code. Below 2^-64 the correction's remainder can
// round (tests/fp8_test.cc models the step on the CPU). Plain C++17: included by .cu files.
#pragma once

namespace tpserve {

inline constexpr float kFp8FastDivideMinScale = 0x1p-64f;
inline constexpr float kFp8FastDivideMaxScale = 0x1p126f;

}  // namespace tpserve
