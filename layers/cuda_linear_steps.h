// The steps CudaLinear enqueues for one M (private to layers/cuda_linear*.cc): where each GEMM
// reads and writes, what each communication step sends, pulls and sums, on which stream, after
// which steps. BuildPreparedSteps derives them, on the host only, from the OverlapPlan: one
// prepared step per plan step (its copy-engine messages become the signal flags, message k on
// slot k), except that a full_weight whole-K GEMM is preceded by the copy of the own input
// columns on the copy stream, a layout step the plan does not need. CudaLinear::Run maps each
// step to its launches in step order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/peer_memory.h"
#include "layers/cublaslt_gemm.h"
#include "layers/cuda_linear.h"
#include "layers/overlap_plan.h"

namespace tpserve::cuda_linear_detail {

// A place in one of the layer's buffers (or the caller's w / y).
struct BufRef {
  enum Base : uint8_t {
    kNone,
    kInput,
    kGather,
    kPartial,
    kReceived,
    kScratch,
    kY,
    kScales,  // the scale slots (layers/scale_slots.h); an AllGather layer's peers map them
  } base = kNone;
  size_t offset = 0;  // bytes
  int peer = -1;      // >= 0: in that rank's copy of `base` (a PeerBuffer mapped here)
};

struct GemmCall {
  GemmParams params;  // scale pointers filled in at Run
  BufRef a, c, d;
  size_t b_offset = 0;  // bytes into the weight (full_weight's ring lead: a column block)
  // A fine scale scheme's A scales, a slot of kScales (Prepared::scatter_scales); kNone: the
  // caller's x_scale as it is.
  BufRef a_scale;
};

struct CommCall {
  StepKind kind = StepKind::kAllGather;
  BufRef send, recv;
  size_t send_bytes = 0;  // AllGather: bytes per rank; ReduceScatter: elements per rank
  size_t recv_bytes = 0;  // SendRecv only
  int send_peer = -1, recv_peer = -1;
  BufRef copy_src, copy_dst;  // ReduceScatter with a short own chunk: scratch -> y;
  size_t copy_bytes = 0;      // copy-engine AllGather: own rows input -> gather slot
  // copy_height > 0: the copy is 2D, copy_height rows of copy_bytes bytes at these pitches
  // (full_weight: the own input columns into the gather buffer's column block).
  size_t copy_height = 0, copy_src_pitch = 0, copy_dst_pitch = 0;
  // Over NCCL, with a fine scale scheme's AllGather layer: the rows' scale slots, moved by a
  // second call of the same kind (AllGather: in place, scale_send_bytes per rank; SendRecv:
  // to and from the same peers). 0 bytes: none. Copy engines pull them instead (`pulls`).
  bool scales = false;
  BufRef scale_send, scale_recv;
  size_t scale_send_bytes = 0, scale_recv_bytes = 0;

  // Copy-engine transfers (knobs.copy_engine): this rank pulls each message
  // from the sender's PeerBuffer. The sender signals `ready` when the data is
  // in place; the receiver waits, pulls, and signals `done`; the sender waits
  // for every `done` before its Run ends (then the caller may overwrite it).
  struct Pull {
    int peer = -1;
    BufRef src;        // in `peer`'s copy of the buffer
    BufRef dst;        // local
    size_t bytes = 0;  // height > 0: bytes per row of a 2D copy of `height` rows
    size_t height = 0, src_pitch = 0, dst_pitch = 0;
  };
  bool copy_engine = false;
  std::vector<PeerSignals::Flag> ready_to, ready_from, done_to;
  std::vector<Pull> pulls;
  // Peer-memory ReduceScatter: dst = the sum of every rank's partial of this
  // rank's rows, slot r holding rank r's: pulled into `received` (after the
  // pulls), or read in the peer's memory by the kernel itself (`direct`:
  // then the peers may reuse their partials only after the sum).
  struct Sum {
    std::vector<BufRef> slots;
    BufRef dst;
    int64_t count = 0;  // elements
    bool direct = false;
  };
  bool sum = false;
  Sum sum_args;
};

struct PreparedStep {
  StepStream stream = StepStream::kCompute;
  std::vector<int> deps;
  bool is_gemm = false;
  std::vector<GemmCall> gemms;
  CommCall comm;
  bool record_event = false;  // a later step on the other stream waits for it
  // A GEMM that read peers' memory (in_place): they may reuse it once the GEMM is done.
  std::vector<PeerSignals::Flag> done_to;
  // On the layer's copy stream (full_weight's copies of the own input columns, beside the
  // pulls on the comm stream) rather than on `stream`.
  bool on_copy_stream = false;
};

struct Prepared {
  OverlapPlan plan;
  std::vector<PreparedStep> steps;
  std::vector<PeerSignals::Flag> done_from;  // copy engine: waited for at the end of Run
  // The step that sums this rank's whole output from two addends (a one-chunk copy-engine
  // ring's last addition), which RunSplit skips; -1 if the plan has none.
  int split_sum_step = -1;
  bool uses_copy_stream = false;  // some step runs on the layer's copy stream
  // A fine scale scheme over more than one GEMM: before anything else, the caller's x_scale is
  // copied into the slots at kScales (LaunchScatterScaleSlots with these fields; the own
  // shard's rows only for an AllGather layer, whose peers' rows arrive with their slots).
  bool scatter_scales = false;
  int64_t scale_groups = 1;
  int64_t scale_pitch = 0;  // floats per slot
  int scale_only_shard = -1;
};

// Whether a layer's GEMMs read their A scales from scale slots: a fine FP8 scale scheme where
// the layer is more than one GEMM over X as the caller wrote it (tp > 1 or chunks > 1).
bool UsesScaleSlots(const CudaLinearShape& shape, const LinearKnobs& knobs, int tp);
// Floats of the kScales buffer for up to shape.max_m rows (0 without scale slots).
int64_t ScaleSlotsFloats(const CudaLinearShape& shape, const LinearKnobs& knobs, int tp);

// The scale schemes beyond one per tensor (CudaLinearShape::scale_scheme): fp8 only, not with
// full_weight (INVALID_ARGUMENT / UNIMPLEMENTED naming the layer `ctx`), blockwise with n and
// k multiples of 128 and without fast_accum. Modes whose GEMMs add into C (a ring's
// accumulating steps, in_place) are refused by BuildPreparedSteps, per M.
Status CheckScaleScheme(const std::string& ctx, const CudaLinearShape& shape,
                        const LinearKnobs& knobs);

// The stream a step runs on: 0 the caller's, 1 the copy stream, 2 the comm stream.
inline int StreamKey(const PreparedStep& ps) {
  return ps.stream == StepStream::kComm ? 2 : ps.on_copy_stream ? 1 : 0;
}

// What BuildPreparedSteps needs to know of the layer and its M.
struct StepsInput {
  std::string name;  // the layer's, for errors
  CudaLinearShape shape;
  LinearKnobs knobs;
  int tp = 1;
  int rank = 0;
  int64_t m = 0;
  bool in_place = false;  // CudaLinear's in_place_
  // The layer's unit scales (two floats 16 bytes apart), the FP8 GEMMs' planning scales.
  const float* unit_scales = nullptr;
  int signal_slots = 0;  // PeerSignals slots per pair of ranks
};

// CudaLinearShape::accumulate's conditions (gemm_rs at tp 1 with per-tensor scales; every
// mode of such a layer is its GEMMs alone): UNIMPLEMENTED naming the layer (`ctx`) and what
// stands in the way; OK when the shape does not accumulate.
Status CheckAccumulate(const std::string& ctx, const CudaLinearShape& shape, int tp);

// The plan request of a layer's M: LinearPlanRequest (layers/linear_knobs.h) of its op and
// knobs: copy_engine at tp > 1, in_place, full_weight, and defer_last_sum for a gemm_rs ring on
// copy engines at one chunk, neither in_place nor full_weight.
PlanRequest LayerPlanRequest(const StepsInput& in);

// The steps of `plan` (the layer's plan for in.m, made from LayerPlanRequest(in)), with
// split_sum_step set; `plan` itself is left to the caller to store. Neither prepares GEMMs nor
// creates events. With in.shape.accumulate every GEMM reads C at its own D in y with beta 1.
// INTERNAL when a copy-engine plan needs more than in.signal_slots messages between two ranks, an
// in_place GEMM step has no receive step, or an accumulating plan has a step other than a GEMM into
// y; CheckAccumulate's answer for a shape that cannot accumulate; UNIMPLEMENTED naming the scheme
// when a fine scale scheme meets a GEMM that adds into C (cuBLASLt takes those scales with beta 0
// only: a ring's accumulating steps, in_place).
StatusOr<Prepared> BuildPreparedSteps(const StepsInput& in, const OverlapPlan& plan);

}  // namespace tpserve::cuda_linear_detail
