// Programmatic dependent launch (Hopper and later): a kernel launched with LaunchPdl may be
// scheduled before the kernel ahead of it in the stream has finished, and waits in PdlEnter
// until that kernel has completed and its writes are visible. The launch latency between two
// short kernels (a decode step's norms, RoPE, cache writes and attention, each a few
// microseconds) then overlaps the kernel before. Plain CUDA C++17.
//
// Contract: a kernel launched with LaunchPdl calls PdlEnter() before its first global memory
// access (read or write), on every thread, except reads of memory that held its values before
// the kernel ahead of it started (a weight: see GemmParams::b_constant; a generation step's
// metadata and earlier keys: PagedAttentionParams::context_constant). A grid of at most
// kPdlEarlyTriggerCtas CTAs (one wave on any Hopper part) also lets the next PDL-launched kernel be
// scheduled at once; a larger grid does so as its CTAs exit, so that waiting CTAs of the next
// kernel never take the place of its own later waves. Before sm_90 both are no-ops and LaunchPdl
// launches plainly.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace tpserve {

inline constexpr unsigned kPdlEarlyTriggerCtas = 64;

__device__ __forceinline__ void PdlEnter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (gridDim.x * gridDim.y * gridDim.z <= kPdlEarlyTriggerCtas) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// cudaLaunchKernelEx with programmatic stream serialization allowed; returns its error.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchPdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Launch attributes for cudaLaunchKernelEx: [0] programmatic stream serialization allowed (as
// LaunchPdl), [1] the thread-block cluster's shape.
inline void PdlAndClusterAttributes(cudaLaunchAttribute (&attribute)[2], dim3 cluster) {
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  attribute[1].id = cudaLaunchAttributeClusterDimension;
  attribute[1].val.clusterDim.x = cluster.x;
  attribute[1].val.clusterDim.y = cluster.y;
  attribute[1].val.clusterDim.z = cluster.z;
}

}  // namespace tpserve
