// Kernels and launchers for layers/quantize_kernels.h. Plain CUDA C++17: host logic beyond
// argument checks belongs in .cc files (nvcc 13.0's front end is fragile, see GPU_HOST.md).
#include "layers/quantize_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "comm/cuda_check.h"
#include "layers/fp8_divide.cuh"
#include "layers/kernel_grid.h"

namespace tpserve {
namespace {

// BF16 travels as its raw bits (uint16_t) so that no operator overloads get in the way.
__device__ __forceinline__ float ToFloat(uint16_t bf16_bits) {
  return __uint_as_float(static_cast<uint32_t>(bf16_bits) << 16);
}
__device__ __forceinline__ float ToFloat(float x) { return x; }

__device__ __forceinline__ void FromFloat(float x, uint16_t* bf16_bits) {
  *bf16_bits = __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ void FromFloat(float x, float* out) { *out = x; }

__device__ __forceinline__ float DecodeE4M3(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ size_t GlobalThread() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t GridThreads() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

// in: 16-byte loads of kVec elements for the first vec_count groups, then scalars.
template <typename In>
__global__ void QuantizeKernel(const In* __restrict__ in, uint8_t* __restrict__ out, size_t count,
                               size_t vec_count, const float* __restrict__ scale) {
  constexpr int kVec = 16 / sizeof(In);
  using OutVec = typename std::conditional<kVec == 8, uint2, uint32_t>::type;
  static_assert(sizeof(OutVec) == kVec, "one output byte per input element");
  const Fp8Divisor d = MakeFp8Divisor(*scale);
  const size_t stride = GridThreads();
  for (size_t v = GlobalThread(); v < vec_count; v += stride) {
    const uint4 raw = reinterpret_cast<const uint4*>(in)[v];
    In vals[kVec];
    memcpy(vals, &raw, sizeof raw);
    uint16_t q[kVec / 2];  // codes in pairs, the lower element in the low byte
#pragma unroll
    for (int i = 0; i < kVec; i += 2) {
      q[i / 2] = QuantizeToE4M3x2(ToFloat(vals[i]), ToFloat(vals[i + 1]), d);
    }
    OutVec o;
    memcpy(&o, q, sizeof o);
    reinterpret_cast<OutVec*>(out)[v] = o;
  }
  for (size_t i = vec_count * kVec + GlobalThread(); i < count; i += stride) {
    out[i] = QuantizeToE4M3(ToFloat(in[i]), d);
  }
}

__device__ __forceinline__ float WarpMax(float m) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  return m;
}

// *amax must be 0 on entry. fmaxf skips NaN, like layers/fp8.h's Amax.
template <typename In>
__global__ void AbsMaxKernel(const In* __restrict__ in, size_t count, size_t vec_count,
                             float* __restrict__ amax) {
  constexpr int kVec = 16 / sizeof(In);
  float m = 0.0f;
  const size_t stride = GridThreads();
  for (size_t v = GlobalThread(); v < vec_count; v += stride) {
    const uint4 raw = reinterpret_cast<const uint4*>(in)[v];
    In vals[kVec];
    memcpy(vals, &raw, sizeof raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) m = fmaxf(m, fabsf(ToFloat(vals[i])));
  }
  for (size_t i = vec_count * kVec + GlobalThread(); i < count; i += stride) {
    m = fmaxf(m, fabsf(ToFloat(in[i])));
  }

  __shared__ float warp_max[kThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  m = WarpMax(m);
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < kThreads / 32 ? warp_max[lane] : 0.0f;
    m = WarpMax(m);
    // Non-negative floats order like their bit patterns read as ints.
    if (lane == 0 && m > 0.0f) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
  }
}

// 16 codes per 16-byte load; their 16 outputs go out as 16-byte stores.
template <typename Out>
__global__ void DequantizeKernel(const uint8_t* __restrict__ in, Out* __restrict__ out,
                                 size_t count, size_t vec_count, const float* __restrict__ scale) {
  constexpr int kVec = 16;
  constexpr int kOutPerStore = 16 / sizeof(Out);
  const float s = *scale;
  const size_t stride = GridThreads();
  for (size_t v = GlobalThread(); v < vec_count; v += stride) {
    const uint4 raw = reinterpret_cast<const uint4*>(in)[v];
    uint8_t codes[kVec];
    memcpy(codes, &raw, sizeof raw);
    Out o[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) FromFloat(DecodeE4M3(codes[i]) * s, &o[i]);
    uint4* dst = reinterpret_cast<uint4*>(out + v * kVec);
#pragma unroll
    for (int j = 0; j < kVec / kOutPerStore; ++j) {
      uint4 w;
      memcpy(&w, o + j * kOutPerStore, sizeof w);
      dst[j] = w;
    }
  }
  for (size_t i = vec_count * kVec + GlobalThread(); i < count; i += stride) {
    FromFloat(DecodeE4M3(in[i]) * s, &out[i]);
  }
}

__global__ void ScaleFromAmaxKernel(const float* __restrict__ amax, int count,
                                    float* __restrict__ scale) {
  float m = 0.0f;
  for (int i = 0; i < count; ++i) m = fmaxf(m, amax[i]);
  // As ScaleFromAmax (layers/fp8.cc): IEEE division, never below the
  // smallest subnormal, 1 for an all-zero input.
  *scale = m == 0.0f ? 1.0f : fmaxf(__fdiv_rn(m, 448.0f), 1.40129846e-45f);
}

// One block per row (grid-stride over rows): a pass for the row's amax, then a pass that
// quantizes (the second reads the row from L1/L2). 8 BF16 per 16-byte load.
__global__ void QuantizePerRowKernel(const uint16_t* __restrict__ in, uint8_t* __restrict__ out,
                                     float* __restrict__ scales, int64_t rows, int64_t cols,
                                     int64_t in_ld, int64_t out_ld) {
  constexpr int kVec = 8;
  __shared__ float warp_max[kThreads / 32];
  __shared__ float row_scale;
  const int64_t vecs = cols / kVec;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(in + row * in_ld);
    float m = 0.0f;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const uint4 raw = src[v];
      uint16_t vals[kVec];
      memcpy(vals, &raw, sizeof raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) m = fmaxf(m, fabsf(ToFloat(vals[i])));
    }
    m = WarpMax(m);
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
    if (warp == 0) {
      m = lane < kThreads / 32 ? warp_max[lane] : 0.0f;
      m = WarpMax(m);
      if (lane == 0) {
        row_scale = ScaleFromAmaxE4M3(m);
        scales[row] = row_scale;
      }
    }
    __syncthreads();
    const Fp8Divisor d = MakeFp8Divisor(row_scale);
    uint2* dst = reinterpret_cast<uint2*>(out + row * out_ld);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const uint4 raw = src[v];
      uint16_t vals[kVec];
      memcpy(vals, &raw, sizeof raw);
      uint16_t q[kVec / 2];  // codes in pairs, the lower element in the low byte
#pragma unroll
      for (int i = 0; i < kVec; i += 2) {
        q[i / 2] = QuantizeToE4M3x2(ToFloat(vals[i]), ToFloat(vals[i + 1]), d);
      }
      uint2 o;
      memcpy(&o, q, sizeof o);
      dst[v] = o;
    }
    __syncthreads();  // warp_max and row_scale are reused by the next row
  }
}

// One warp per 1x128 group (grid-stride over groups, row-major order of (row, group)): each
// lane loads 4 BF16 (8 bytes), the warp reduces the amax, each lane stores 4 codes.
__global__ void QuantizePerGroup128Kernel(const uint16_t* __restrict__ in,
                                          uint8_t* __restrict__ out, float* __restrict__ scales,
                                          int64_t rows, int64_t groups_per_row, int64_t in_ld,
                                          int64_t out_ld) {
  const int lane = threadIdx.x & 31;
  const int64_t total = rows * groups_per_row;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < total;
       w += warps) {
    const int64_t row = w / groups_per_row;
    const int64_t g = w % groups_per_row;
    const uint2 raw = reinterpret_cast<const uint2*>(in + row * in_ld + g * 128)[lane];
    uint16_t vals[4];
    memcpy(vals, &raw, sizeof raw);
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) m = fmaxf(m, fabsf(ToFloat(vals[i])));
    m = WarpMax(m);
    const float scale = ScaleFromAmaxE4M3(m);
    if (lane == 0) scales[g * rows + row] = scale;
    const Fp8Divisor d = MakeFp8Divisor(scale);
    const uint16_t q[2] = {QuantizeToE4M3x2(ToFloat(vals[0]), ToFloat(vals[1]), d),
                           QuantizeToE4M3x2(ToFloat(vals[2]), ToFloat(vals[3]), d)};
    uint32_t o;
    memcpy(&o, q, sizeof o);
    reinterpret_cast<uint32_t*>(out + row * out_ld + g * 128)[lane] = o;
  }
}

template <typename T>
__global__ void FillKernel(T* __restrict__ dst, size_t count, T value) {
  const size_t stride = GridThreads();
  for (size_t i = GlobalThread(); i < count; i += stride) dst[i] = value;
}

std::string TypeName(DataType t) { return std::string(DataTypeName(t)); }

template <typename In>
Status LaunchQuantizeTyped(const QuantizeFp8Params& p, cudaStream_t stream) {
  constexpr size_t kVec = 16 / sizeof(In);
  const In* in = static_cast<const In*>(p.input);
  if (!IsAligned(in, sizeof(In))) {
    return InvalidArgumentError("QuantizeFp8Params.input is not aligned to its element size");
  }
  const size_t vec_count = IsAligned(in, 16) && IsAligned(p.output, kVec) ? p.count / kVec : 0;
  QuantizeKernel<In><<<GridFor(vec_count > 0 ? vec_count : p.count), kThreads, 0, stream>>>(
      in, p.output, p.count, vec_count, p.scale);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

template <typename In>
Status LaunchAbsMaxTyped(const AbsMaxParams& p, cudaStream_t stream) {
  constexpr size_t kVec = 16 / sizeof(In);
  const In* in = static_cast<const In*>(p.input);
  const size_t vec_count = IsAligned(in, 16) ? p.count / kVec : 0;
  AbsMaxKernel<In><<<GridFor(vec_count > 0 ? vec_count : p.count), kThreads, 0, stream>>>(
      in, p.count, vec_count, p.amax);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

template <typename Out>
Status LaunchDequantizeTyped(const DequantizeFp8Params& p, cudaStream_t stream) {
  Out* out = static_cast<Out*>(p.output);
  const size_t vec_count = IsAligned(p.input, 16) && IsAligned(out, 16) ? p.count / 16 : 0;
  DequantizeKernel<Out><<<GridFor(vec_count > 0 ? vec_count : p.count), kThreads, 0, stream>>>(
      p.input, out, p.count, vec_count, p.scale);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status LaunchFillTyped(void* dst, size_t count, T value, cudaStream_t stream) {
  FillKernel<T><<<GridFor(count), kThreads, 0, stream>>>(static_cast<T*>(dst), count, value);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status LaunchQuantizeToFp8E4M3(const QuantizeFp8Params& p, cudaStream_t stream) {
  if (p.count == 0) return Status::Ok();
  if (p.input == nullptr || p.output == nullptr || p.scale == nullptr) {
    return InvalidArgumentError("QuantizeFp8Params: input, output and scale must not be null");
  }
  if (!IsAligned(p.scale, alignof(float))) {
    return InvalidArgumentError("QuantizeFp8Params.scale is not aligned to 4 bytes");
  }
  switch (p.input_type) {
    case DataType::kBFloat16:
      return LaunchQuantizeTyped<uint16_t>(p, stream);
    case DataType::kFloat32:
      return LaunchQuantizeTyped<float>(p, stream);
    default:
      return UnimplementedError("QuantizeFp8Params.input_type = " + TypeName(p.input_type) +
                                " is not supported; supported: bf16, f32");
  }
}

Status LaunchAbsMax(const AbsMaxParams& p, cudaStream_t stream) {
  if (p.amax == nullptr) return InvalidArgumentError("AbsMaxParams.amax must not be null");
  if (!IsAligned(p.amax, alignof(float))) {
    return InvalidArgumentError("AbsMaxParams.amax is not aligned to 4 bytes");
  }
  if (p.count > 0 && p.input == nullptr) {
    return InvalidArgumentError("AbsMaxParams.input must not be null");
  }
  if (p.input_type != DataType::kBFloat16 && p.input_type != DataType::kFloat32) {
    return UnimplementedError("AbsMaxParams.input_type = " + TypeName(p.input_type) +
                              " is not supported; supported: bf16, f32");
  }
  if (!IsAligned(p.input, DataTypeSize(p.input_type))) {
    return InvalidArgumentError("AbsMaxParams.input is not aligned to its element size");
  }
  TP_CUDA_CHECK(cudaMemsetAsync(p.amax, 0, sizeof(float), stream));
  if (p.count == 0) return Status::Ok();
  if (p.input_type == DataType::kBFloat16) return LaunchAbsMaxTyped<uint16_t>(p, stream);
  return LaunchAbsMaxTyped<float>(p, stream);
}

Status LaunchScaleFromAmax(const float* amax, int count, float* scale, cudaStream_t stream) {
  if (amax == nullptr || scale == nullptr || count < 1) {
    return InvalidArgumentError("LaunchScaleFromAmax: amax and scale non-null, count >= 1");
  }
  if (!IsAligned(amax, alignof(float)) || !IsAligned(scale, alignof(float))) {
    return InvalidArgumentError("LaunchScaleFromAmax: amax and scale aligned to 4 bytes");
  }
  ScaleFromAmaxKernel<<<1, 1, 0, stream>>>(amax, count, scale);
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchDequantizeFp8E4M3(const DequantizeFp8Params& p, cudaStream_t stream) {
  if (p.count == 0) return Status::Ok();
  if (p.input == nullptr || p.output == nullptr || p.scale == nullptr) {
    return InvalidArgumentError("DequantizeFp8Params: input, output and scale must not be null");
  }
  if (!IsAligned(p.scale, alignof(float))) {
    return InvalidArgumentError("DequantizeFp8Params.scale is not aligned to 4 bytes");
  }
  if (!IsAligned(p.output, DataTypeSize(p.output_type))) {
    return InvalidArgumentError("DequantizeFp8Params.output is not aligned to its element size");
  }
  switch (p.output_type) {
    case DataType::kBFloat16:
      return LaunchDequantizeTyped<uint16_t>(p, stream);
    case DataType::kFloat32:
      return LaunchDequantizeTyped<float>(p, stream);
    default:
      return UnimplementedError("DequantizeFp8Params.output_type = " + TypeName(p.output_type) +
                                " is not supported; supported: bf16, f32");
  }
}

Status LaunchQuantizeFp8Dynamic(const QuantizeFp8DynamicParams& p, cudaStream_t stream) {
  const bool per_row = p.granularity == Fp8ScaleGranularity::kPerRow;
  if (!per_row && p.granularity != Fp8ScaleGranularity::kPerGroup128) {
    return UnimplementedError(
        "QuantizeFp8DynamicParams.granularity is not kPerRow or kPerGroup128");
  }
  if (p.rows < 0 || p.cols < 0) {
    return InvalidArgumentError("QuantizeFp8DynamicParams: rows = " + std::to_string(p.rows) +
                                ", cols = " + std::to_string(p.cols) + " must be >= 0");
  }
  if (p.rows == 0 || p.cols == 0) return Status::Ok();
  const int64_t in_ld = p.input_ld == 0 ? p.cols : p.input_ld;
  const int64_t out_ld = p.output_ld == 0 ? p.cols : p.output_ld;
  if (p.input == nullptr || p.output == nullptr || p.scales == nullptr) {
    return InvalidArgumentError(
        "QuantizeFp8DynamicParams: input, output and scales must not be null");
  }
  const int64_t multiple = per_row ? 8 : 128;
  if (p.cols % multiple != 0) {
    return InvalidArgumentError("QuantizeFp8DynamicParams.cols = " + std::to_string(p.cols) +
                                " must be a multiple of " + std::to_string(multiple) +
                                (per_row ? " (16-byte loads)" : " (whole 1x128 groups)"));
  }
  if (in_ld < p.cols || in_ld % 8 != 0) {
    return InvalidArgumentError("QuantizeFp8DynamicParams.input_ld = " + std::to_string(in_ld) +
                                " must be >= cols = " + std::to_string(p.cols) +
                                " and a multiple of 8 (16 bytes of BF16)");
  }
  if (out_ld < p.cols || out_ld % 16 != 0) {
    return InvalidArgumentError("QuantizeFp8DynamicParams.output_ld = " + std::to_string(out_ld) +
                                " must be >= cols = " + std::to_string(p.cols) +
                                " and a multiple of 16 (16 bytes of FP8)");
  }
  if (!IsAligned(p.input, 16) || !IsAligned(p.output, 16)) {
    return InvalidArgumentError(
        "QuantizeFp8DynamicParams: input and output must be 16-byte aligned");
  }
  if (!IsAligned(p.scales, alignof(float))) {
    return InvalidArgumentError("QuantizeFp8DynamicParams.scales is not aligned to 4 bytes");
  }
  const uint16_t* in = static_cast<const uint16_t*>(p.input);
  if (per_row) {
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(p.rows, 65535));
    QuantizePerRowKernel<<<blocks, kThreads, 0, stream>>>(in, p.output, p.scales, p.rows, p.cols,
                                                          in_ld, out_ld);
  } else {
    const int64_t groups = p.cols / 128;
    QuantizePerGroup128Kernel<<<GridFor(p.rows * groups * 32), kThreads, 0, stream>>>(
        in, p.output, p.scales, p.rows, groups, in_ld, out_ld);
  }
  TP_CUDA_CHECK(cudaGetLastError());
  return Status::Ok();
}

Status LaunchFillPattern(void* dst, size_t count, size_t element_bytes, uint32_t pattern,
                         cudaStream_t stream) {
  if (count == 0) return Status::Ok();
  if (dst == nullptr) return InvalidArgumentError("LaunchFillPattern: dst must not be null");
  if (element_bytes != 1 && element_bytes != 2 && element_bytes != 4) {
    return InvalidArgumentError("LaunchFillPattern: element_bytes = " +
                                std::to_string(element_bytes) + "; must be 1, 2 or 4");
  }
  if (!IsAligned(dst, element_bytes)) {
    return InvalidArgumentError("LaunchFillPattern: dst is not aligned to element_bytes = " +
                                std::to_string(element_bytes));
  }
  switch (element_bytes) {
    case 1:
      TP_CUDA_CHECK(cudaMemsetAsync(dst, static_cast<int>(pattern & 0xFFu), count, stream));
      return Status::Ok();
    case 2:
      return LaunchFillTyped<uint16_t>(dst, count, static_cast<uint16_t>(pattern), stream);
    default:
      return LaunchFillTyped<uint32_t>(dst, count, pattern, stream);
  }
}

Status LaunchPoisonFill(void* dst, DataType type, size_t count, cudaStream_t stream) {
  switch (type) {
    case DataType::kBFloat16:
      return LaunchFillPattern(dst, count, 2, kBf16PoisonBits, stream);
    case DataType::kFloat8E4M3:
      return LaunchFillPattern(dst, count, 1, kFp8E4M3PoisonBits, stream);
    case DataType::kFloat32:
      return LaunchFillPattern(dst, count, 4, kFp32PoisonBits, stream);
    default:
      return UnimplementedError("LaunchPoisonFill: type " + TypeName(type) +
                                " has no poison pattern; supported: bf16, fp8_e4m3, f32");
  }
}

}  // namespace tpserve
