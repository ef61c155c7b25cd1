// tpserve-tune: the layer harness with the tuner's defaults (benchmarks/bench_layers.h).
#include "benchmarks/bench_layers.h"

int main(int argc, char** argv) { return tpserve::BenchLayersMain(argc, argv, /*tune=*/true); }
