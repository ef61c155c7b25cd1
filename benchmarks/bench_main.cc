// tpserve-bench: times the TP linear layers (benchmarks/bench_layers.h).
#include "benchmarks/bench_layers.h"

int main(int argc, char** argv) { return tpserve::BenchLayersMain(argc, argv, /*tune=*/false); }
