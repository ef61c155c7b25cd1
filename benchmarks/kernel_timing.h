// What the one-GPU kernel benchmarks share (tpserve-bench-attention, tpserve-bench-elementwise):
// a launch timed between two CUDA events, and the device's name for the results' meta.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"

namespace tpserve {

// Milliseconds between `start` and `end` recorded around `launch` on `stream`, once both
// have happened.
inline StatusOr<double> TimeLaunchMs(cudaStream_t stream, const CudaEvent& start,
                                     const CudaEvent& end, const std::function<Status()>& launch) {
  TP_CUDA_CHECK(cudaEventRecord(start.get(), stream));
  TP_RETURN_IF_ERROR(launch());
  TP_CUDA_CHECK(cudaEventRecord(end.get(), stream));
  TP_CUDA_CHECK(cudaEventSynchronize(end.get()));
  TP_ASSIGN_OR_RETURN(float ms, CudaEvent::ElapsedMs(start, end));
  return static_cast<double>(ms);
}

// Device 0's name; empty where it cannot be read.
inline std::string DeviceName() {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? std::string(prop.name) : "";
}

}  // namespace tpserve
