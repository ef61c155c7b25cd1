// The per-layer knobs of a TP linear layer: how it overlaps communication
// with its GEMM. Filled in from the overlap config file (or by hand / the
// autotuner); validated once, before any buffer is allocated.
#pragma once

#include <string>

#include "comm/nccl_config.h"
#include "comm/status.h"
#include "layers/overlap_plan.h"

namespace tpserve {

struct LinearKnobs {
  // none: collective, then one GEMM; pipeline: chunk i's collective under
  // chunk i-1's GEMM; ring: point-to-point ring steps under the GEMM of the
  // chunk in hand.
  OverlapMode mode = OverlapMode::kNone;
  // Chunks per rank's row shard (mode none: 1). More chunks hide more of the
  // communication but make each GEMM smaller (worse wave quantisation).
  int chunks = 1;
  // The communicator variant the layer's collectives run on (CTA limits and
  // policy). NcclCommConfig{} is the base communicator.
  NcclCommConfig comm;
  // Move data with copy engines instead of NCCL kernels: ranks pull each
  // other's rows from peer-mapped buffers (comm/peer_memory.h: CUDA IPC
  // between processes, ready/done flags as stream memory operations), so the
  // transfer takes no SMs from the GEMM. ag_gemm, any mode: the AllGather (or
  // the ring's send/recv) becomes pulls. gemm_rs: mode ring pulls each step's
  // partial and the next GEMM adds it; mode pipeline pulls the peers'
  // partials of this rank's rows while later chunks' GEMMs run and one
  // element-wise kernel adds them; mode none (nothing to overlap with) has
  // that kernel read the peers' partials in place over NVLink instead. All ranks on one node.
  // Captures into CUDA graphs. Verified with one process per GPU, as tpserve serves. With ranks
  // as threads of one process, graph replays of copy-engine layers hung (gemm_rs always,
  // ag_gemm rarely), so CudaLinear refuses copy engines there (FAILED_PRECONDITION).
  bool copy_engine = false;
  // FP8 fast accumulation (no periodic promotion to FP32 inside the GEMM).
  bool fast_accum = false;
  // gemm_rs, mode ring, copy_engine only: each accumulating GEMM reads the running sum where
  // the peer left it (its C operand in the peer's memory, over NVLink) instead of a copy
  // engine pulling it here first; no copy, and with one chunk no separate sum pass either
  // (the last GEMM writes the finished output). The peers' `done` (they have read this
  // rank's partial) is awaited at the start of the next Run rather than the end of this one.
  bool in_place = false;
  // gemm_rs, copy_engine: no partial sums. Every rank holds the whole
  // weight [n, tp * k] (rank r's shard is columns [r * k, (r + 1) * k)); instead of reduce-
  // scattering BF16 partials of every row, each rank pulls the peers' FP8 input columns of its
  // own rows (m / tp * k bytes per peer: at TP = 2 and n = 2k a quarter of the partials'
  // bytes) and computes its rows over the whole K in one GEMM per chunk. Pipeline: the rows in
  // `chunks` chunks, chunk j's pulls under chunk j - 1's GEMM; the own columns are copied into
  // place on a second stream, beside the pulls. Ring: a lead of rows / (2 * chunks) rows starts
  // at once on the own columns (one GEMM over k, then one accumulating GEMM per peer's pulled
  // block), and the rest of the rows follow in one whole-K GEMM whose pulls run under the
  // lead's GEMMs, so neither the ranks' meeting nor a first pull is exposed. Costs tp x the
  // layer's weight memory. Worth it where the whole-K GEMM of the rank's rows is faster than
  // the sharded GEMM of the same FLOPs (half the output), as for o.
  bool full_weight = false;

  // One line, e.g. "mode=pipeline chunks=4 comm{...} copy_engine=0 fast_accum=0"
  // (" in_place=1" and " full_weight=1" appended when set).
  std::string ToString() const;
};

// INVALID_ARGUMENT naming the field: chunks in [1, 64] and 1 with mode none; the comm knobs
// valid; in_place only for gemm_rs in mode ring with copy_engine; full_weight only for gemm_rs
// with copy_engine. Every other knob goes with every op and mode.
Status ValidateLinearKnobs(const LinearKnobs& knobs, OverlapOp op);

// The plan request of one layer run over m rows: the knobs' mode, chunks, copy_engine (at
// tp > 1), in_place and full_weight, and PlanRequest::defer_last_sum exactly where CudaLinear
// runs its ring that way (gemm_rs, ring, copy_engine, tp > 1, one chunk, neither in_place nor
// full_weight), so that the CPU executor and the GPU layer run the same schedule for the same
// knobs.
PlanRequest LinearPlanRequest(OverlapOp op, const LinearKnobs& knobs, int tp, int rank, int64_t m);

}  // namespace tpserve
