// `tpserve-bench gemm-scales`: one GPU, no communication. Times the FP8 GEMM of each scale
// scheme (layers/cublaslt_gemm.h GemmScaleScheme: per_tensor, per_token_channel, blockwise)
// on a model's linear-layer shapes, and each scheme's activation quantize step
// (layers/quantize_kernels.h) separately, as CUDA-graph replays between CUDA events with the L2
// flushed before each. Writes JSON records and prints a table with each scheme's GEMM time
// relative to per_tensor and whether it is within its limit (--per-token-limit,
// --blockwise-limit, judged at M >= --judge-min-m).
//
// Exit status: 0 when every judged case is within its limit, 3 when the run completed but some
// judged case is not (the JSON is written either way), 1 on an error, 2 on a usage error.
#pragma once

namespace tpserve {

// argv[0] is the subcommand's name ("gemm-scales").
int RunGemmScalesBench(int argc, char** argv);

}  // namespace tpserve
