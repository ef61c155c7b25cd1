// Argument errors of the kernel launchers (engine/cuda_ops.h, engine/paged_kv_ops.h,
// engine/sampling_kernels.h), each naming the params struct and its field, and the grid limits
// they check against. Host code, C++17 (the .cu files include it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include <cuda_runtime.h>

#include "comm/cuda_check.h"
#include "comm/status.h"
#include "engine/kv_cache.h"
#include "layers/kernel_grid.h"

namespace tpserve::launch_checks {

inline constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1
inline constexpr int64_t kMaxGridY = 65535;

// Streaming multiprocessors of the current device (launchers size their grids with it).
inline StatusOr<int> CurrentDeviceSms() {
  int device = 0, sms = 0;
  TP_CUDA_CHECK(cudaGetDevice(&device));
  TP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

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

// A device pointer argument: its field name, the alignment it needs, and whether null is
// allowed (an optional argument: then only a non-null one is checked).
struct DevicePointer {
  const char* name;
  const void* ptr;
  size_t alignment;
  bool required = true;
};
// The first required pointer that is null, or pointer that is misaligned, as an
// INVALID_ARGUMENT naming its field.
inline Status CheckPointers(const char* params, std::initializer_list<DevicePointer> ptrs) {
  for (const DevicePointer& t : ptrs) {
    if (t.ptr == nullptr) {
      if (t.required) return NullField(params, t.name);
      continue;
    }
    if (!IsAligned(t.ptr, t.alignment)) return MisalignedField(params, t.name, t.alignment);
  }
  return Status::Ok();
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

// The layout's fields as a launcher can trust them (Validate() lives in kv_cache.cc, which the
// launchers do not need to link against): positive sizes, a layer inside it.
inline Status CheckKvLayout(const char* params, const KvCacheLayout& l, int64_t layer) {
  const struct {
    const char* name;
    int64_t value;
  } sizes[] = {{"layout.layers", l.layers},
               {"layout.num_blocks", l.num_blocks},
               {"layout.block_size", l.block_size},
               {"layout.kv_heads", l.kv_heads},
               {"layout.head_dim", l.head_dim}};
  for (const auto& s : sizes) {
    if (s.value < 1) return BadField(params, s.name, s.value, "must be >= 1");
  }
  if (layer < 0 || layer >= l.layers) {
    return BadField(params, "layer", layer,
                    "must be in [0, layout.layers = " + std::to_string(l.layers) + ")");
  }
  if (l.num_blocks * l.block_size > std::numeric_limits<int32_t>::max()) {
    return InvalidArgumentError(std::string(params) +
                                ": num_blocks * block_size exceeds 2^31 - 1 (slots are int32)");
  }
  return Status::Ok();
}

}  // namespace tpserve::launch_checks
