// Argument errors of the kernel launchers (engine/cuda_ops.h, engine/paged_kv_ops.h,
// engine/sampling_kernels.h), each naming the params struct and its field, and the grid limits
// they check against. Host code, C++17 (the .cu files include it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "comm/status.h"
#include "layers/kernel_grid.h"

namespace tpserve::launch_checks {

inline constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1
inline constexpr int64_t kMaxGridY = 65535;

// "RmsNormParams.dim (12) must be a multiple of 8".
inline Status BadField(const char* params, const char* field, int64_t value,
                       const std::string& what) {
  return InvalidArgumentError(std::string(params) + "." + field + " (" + std::to_string(value) +
                              ") " + what);
}
inline Status NullField(const char* params, const char* field, const std::string& when = "") {
  return InvalidArgumentError(std::string(params) + "." + field + " must not be null" +
                              (when.empty() ? "" : " " + when));
}
inline Status MisalignedField(const char* params, const char* field, size_t alignment) {
  return InvalidArgumentError(std::string(params) + "." + field + " is not aligned to " +
                              std::to_string(alignment) + " bytes");
}

// An optional scale pointer: float-aligned.
inline Status CheckScale(const char* params, const char* field, const float* scale) {
  if (!IsAligned(scale, alignof(float))) return MisalignedField(params, field, alignof(float));
  return Status::Ok();
}

// An optional out_amax: checked (it is the BF16 output's amax, so `out`
// must be set) and zeroed on `stream` before the kernel adds to it.
inline Status ZeroAmax(const char* params, float* amax, const void* out, cudaStream_t stream) {
  if (amax == nullptr) return Status::Ok();
  if (out == nullptr) return NullField(params, "out", "when out_amax is set");
  if (!IsAligned(amax, alignof(float))) {
    return MisalignedField(params, "out_amax", alignof(float));
  }
  TP_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  return Status::Ok();
}

}  // namespace tpserve::launch_checks
