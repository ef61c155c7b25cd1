// Kernel timestamps from CUPTI's activity API for benchmarks/kernel_timeline.h: every kernel
// the process runs (graph nodes included) with the GPU's start and end times, on the clock of
// CuptiTimestampNs(). Tracing is process-wide and costs little per kernel, but it is not free:
// a benchmark reports its traced steps apart from its untraced ones.
//
// Built only where the CUDA toolkit has CUPTI (TPSERVE_HAVE_CUPTI); elsewhere Start returns
// UNIMPLEMENTED.
#pragma once

#include <cstdint>
#include <vector>

#include "benchmarks/kernel_timeline.h"
#include "comm/status.h"

namespace tpserve {

// Enables kernel tracing. Call before the CUDA graphs to be traced are captured: CUPTI records
// a graph's kernels only when tracing was on as the graph was made. FAILED_PRECONDITION if
// tracing is already on; UNIMPLEMENTED without CUPTI; INTERNAL with CUPTI's message.
Status StartKernelTracing();

// The host's timestamp on the records' clock (0 without CUPTI).
uint64_t CuptiTimestampNs();

// Flushes and returns the kernels recorded since StartKernelTracing (or since the last call),
// labelled by ShortKernelLabel; the number of records CUPTI dropped (buffers full) in *dropped.
// Tracing stays on.
StatusOr<std::vector<KernelRecord>> CollectKernelRecords(uint64_t* dropped);

}  // namespace tpserve
