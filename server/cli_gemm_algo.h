// --gemm-algo, the command-line face of GemmAlgoSelection (layers/cublaslt_gemm.h), for the
// `tpserve` commands and the benchmarks alike. Header-only: CLI11 belongs to the executables
// that include it, not to tpserve_layers. The choice travels in the options of what a command
// builds (CudaModelOptions, CudaLinearOptions, CublasLtGemm::Create); in a build without CUDA
// the flag is accepted and means nothing.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#if TPSERVE_WITH_CUDA
#include "layers/cublaslt_gemm.h"
#endif

namespace tpserve {

// Registers --gemm-algo (timed | heuristic) on `cmd`, storing it in *value.
inline void AddGemmAlgoFlag(CLI::App* cmd, std::string* value) {
  cmd->add_option("--gemm-algo", *value,
                  "cuda: how each GEMM shape's cuBLASLt algorithm is chosen: timed (the "
                  "heuristic's answers are timed once per shape on the GPU when the shape is "
                  "first planned, the fastest kept) or heuristic (cuBLASLt's first answer, no "
                  "timing)")
      ->check(CLI::IsMember({"timed", "heuristic"}))
      ->capture_default_str();
}

#if TPSERVE_WITH_CUDA
// The selection a value AddGemmAlgoFlag's check accepted names.
inline GemmAlgoSelection GemmAlgoFromFlag(const std::string& value) {
  return ParseGemmAlgoSelection(value).value();
}
#endif

}  // namespace tpserve
