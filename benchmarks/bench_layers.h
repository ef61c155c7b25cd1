#pragma once

namespace tpserve {

// tpserve-bench (tune false) and tpserve-tune (tune true): one harness over the TP layers.
// The tuner differs in its defaults (methods none, pipeline, ring; writes overlap.yaml) and
// its help text, and has no gemm-scales subcommand. Returns the process's exit code.
int BenchLayersMain(int argc, char** argv, bool tune);

}  // namespace tpserve
