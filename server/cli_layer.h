// Flags of `tpserve layer`, shared by its CPU and CUDA runners.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tpserve {

struct LayerFlags {
  std::string backend = "cpu";
  std::string op = "ag_gemm";
  std::string mode = "pipeline";
  std::string dtype = "fp8";
  std::string fp8_scheme = "tensor";  // tensor | channel | block (layers/fp8.h, Fp8Scheme)
  int tp = 2;
  int64_t m = 1002;
  int64_t n = 256;
  int64_t k = 256;
  int chunks = 4;
  bool chunks_given = false;  // --chunks on the command line (mode none defaults to 1)
  int max_ctas = 0;
  std::string cta_policy = "default";
  bool copy_engine = false;
  bool split_output = false;  // gemm_rs: CudaLinear::RunSplit, the addends summed on the host
  bool in_place = false;      // gemm_rs ring with --copy-engine: LinearKnobs::in_place
  bool full_weight = false;   // gemm_rs with --copy-engine: LinearKnobs::full_weight
  uint32_t seed = 1;
  int iters = 3;
  double tolerance = 1e-2;
  std::string gemm_algo = "timed";
};

// Runs the layer with one process per GPU: the process started by the user is
// rank 0 and starts ranks 1..tp-1 itself (same arguments, TPSERVE_* variables
// set); a process started by a launcher with TPSERVE_RANK/mpirun/LWS variables
// joins as that rank. Each rank checks its output against the CPU reference.
// Returns the process exit code. `argv` is the process's argument vector.
int RunLayerCuda(const LayerFlags& flags, const std::vector<std::string>& argv);

}  // namespace tpserve
