// --graph-priority, the command-line face of CudaGraphExec::Priority (comm/cuda_resources.h), for
// the benchmarks that compare the two. Header-only: CLI11 belongs to the executables that include
// it. The choice travels in the options of what a benchmark builds (CudaModelOptions) or in its
// own captures; in a build without CUDA the flag is accepted and means nothing.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#if TPSERVE_WITH_CUDA
#include "comm/cuda_resources.h"
#endif

namespace tpserve {

// Registers --graph-priority (node | stream) on `cmd`, storing it in *value.
inline void AddGraphPriorityFlag(CLI::App* cmd, std::string* value) {
  cmd->add_option("--graph-priority", *value,
                  "cuda: the priority of a CUDA graph's kernels: node (each keeps its capture "
                  "stream's, as when enqueued eagerly: the layers' comm streams outrank their "
                  "GEMMs'; what tpserve serves with) or stream (CUDA's default: all run at the "
                  "launch stream's priority)")
      ->check(CLI::IsMember({"node", "stream"}))
      ->capture_default_str();
}

#if TPSERVE_WITH_CUDA
// The priority a value AddGraphPriorityFlag's check accepted names.
inline CudaGraphExec::Priority GraphPriorityFromFlag(const std::string& value) {
  return CudaGraphExec::ParsePriority(value).value();
}
#endif

}  // namespace tpserve
