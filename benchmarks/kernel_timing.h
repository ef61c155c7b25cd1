// What the one-GPU kernel benchmarks share (tpserve-bench-attention, tpserve-bench-elementwise,
// tpserve-bench-decode): a launch timed between two CUDA events, the device-to-device copy
// bandwidth their floors are stated against, and the device's name for the results' meta.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
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

// Device-to-device copy bandwidth (bytes read + written per second) over `bytes`, the best
// of `rounds` after one untimed copy.
inline StatusOr<double> MeasureHbmBandwidth(size_t bytes, int rounds) {
  TP_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Allocate(bytes, "bandwidth_src"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(bytes, "bandwidth_dst"));
  TP_ASSIGN_OR_RETURN(CudaStream st, CudaStream::Create());
  TP_ASSIGN_OR_RETURN(CudaEvent e0, CudaEvent::Create(true));
  TP_ASSIGN_OR_RETURN(CudaEvent e1, CudaEvent::Create(true));
  TP_CUDA_CHECK(cudaMemsetAsync(a.data(), 1, bytes, st.get()));
  double best = 0;
  for (int r = 0; r < rounds + 1; ++r) {
    TP_RETURN_IF_ERROR(e0.Record(st.get()));
    TP_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, st.get()));
    TP_RETURN_IF_ERROR(e1.Record(st.get()));
    TP_CUDA_CHECK(cudaStreamSynchronize(st.get()));
    TP_ASSIGN_OR_RETURN(const float ms, CudaEvent::ElapsedMs(e0, e1));
    if (r > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) / (ms * 1e-3));
  }
  return best;
}

// Device 0's name; empty where it cannot be read.
inline std::string DeviceName() {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? std::string(prop.name) : "";
}

}  // namespace tpserve
