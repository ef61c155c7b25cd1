// Overlap plans: *what* a tensor-parallel linear layer does, step by step,
// separated from *how* an executor (CPU reference, CUDA) runs it.
//
// Problem (global view, tp ranks, sequence parallel):
//  - AG+GEMM (column-parallel): X[M,K] is split by rows over the ranks; rank r
//    holds W_r[N_r,K] and produces Y_r[M,N_r] = X · W_r^T for all M rows.
//  - GEMM+RS (row-parallel): rank r holds X_r[M,K_r] (all rows, its K slice)
//    and W_r[N,K_r]; partials P_r = X_r · W_r^T are summed over ranks and rank
//    r keeps its own row shard of the sum, Y_r[rows of shard r, N].
//
// Row sharding: the M rows are split over the ranks in contiguous, balanced
// shards (the first M % tp ranks get one row more), and each shard into
// `chunks` contiguous, balanced chunks. M need not be divisible by tp or by
// tp*chunks: shards and chunks differ by at most one row, and may be empty
// when M < tp*chunks. A step whose rows are empty on every rank is left out of
// the plan (identically on every rank, since it depends only on M, tp and
// chunks). Executors whose collectives need equal sizes per rank (NCCL) pad
// each rank's contribution to the largest one of that step.
//
// A plan is a list of steps in issue order. A step may start once the steps
// listed in its `deps` have finished; steps on the same stream also run in
// list order. Every plan of a group (one per rank) issues its collectives in
// the same order, and every send has a matching receive (ValidatePlanGroup).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "comm/status.h"

namespace tpserve {

enum class OverlapOp { kAllGatherGemm, kGemmReduceScatter };
enum class OverlapMode { kNone, kPipeline, kRing };

std::string_view OverlapOpName(OverlapOp op);        // "ag_gemm" | "gemm_rs"
std::string_view OverlapModeName(OverlapMode mode);  // "none" | "pipeline" | "ring"
StatusOr<OverlapOp> ParseOverlapOp(std::string_view name);
// "auto" is not a plan mode: the overlap config resolves it per M before
// planning; it is rejected here with a message that says so.
StatusOr<OverlapMode> ParseOverlapMode(std::string_view name);

// Half-open range of global rows [begin, end).
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  friend bool operator==(const RowRange&, const RowRange&) = default;
};

// Rows of rank `rank`'s shard of M rows over tp ranks.
RowRange ShardRows(int64_t m, int tp, int rank);
// Rows of chunk `chunk` of `rows` split into `chunks` balanced chunks.
RowRange ChunkRows(RowRange rows, int chunks, int chunk);

enum class StepKind {
  kAllGather,      // rows[s]: rows that rank s contributes (gathered to all)
  kReduceScatter,  // rows[s]: rows of the partial whose sum lands on rank s
  kSendRecv,       // send `send_rows` to send_peer; receive `recv_rows` from recv_peer
  kGemm,           // rows: global rows computed (AG+GEMM: output rows;
                   //       GEMM+RS: partial rows; with accumulate, added to
                   //       the partial received for those rows)
  kSum,            // GEMM+RS, PlanRequest::defer_last_sum: rows (this rank's own) =
                   // the partial an earlier GEMM computed for them + the running
                   // sum received for them, written to Y
  // Copy-engine transport (PlanRequest::copy_engine): no collective runs. A rank makes rows of
  // its buffer available to a peer (`ready_to`), the peer waits for that (`ready_from`), copies
  // what it needs (`pulls`) and says it is done (`done_to`); the sender may change those rows
  // only after the `done`, which it awaits at the end of the layer's run (PlanRequest::in_place:
  // at the start of the next). Messages are numbered per ordered pair of ranks (PlanMessage).
  kPullGather,   // AG+GEMM none/pipeline: rows[s] as kAllGather; this rank offers its rows to
                 // every peer and pulls theirs
  kPullRing,     // a ring exchange, send_* / recv_* as kSendRecv: the receiver pulls
  kPullReduce,   // GEMM+RS none/pipeline: rows[s] as kReduceScatter; this rank offers its
                 // partial of each peer's rows to that peer, takes the peers' partials of its
                 // own rows (pulled, or read in place: by_reference) and writes its own partial
                 // plus theirs, added in rank order, to Y
  kPullColumns,  // PlanRequest::full_weight: rows[0] (this rank's): pulls every peer's input
                 // columns of those rows (the message's rows are global rows of X)
};
enum class StepStream { kCompute, kComm };

std::string_view StepKindName(StepKind kind);

// One copy-engine message between this rank and `peer`: the `msg`-th one in its direction
// (this rank to the peer for ready_to, the peer to this rank for ready_from / pulls / done_to),
// which is also its signal slot. `rows`: for ready_to / ready_from the rows it makes available,
// for a pull the rows copied (within them).
struct PlanMessage {
  int peer = -1;
  int msg = 0;
  RowRange rows;
  friend bool operator==(const PlanMessage&, const PlanMessage&) = default;
};

struct PlanStep {
  StepKind kind = StepKind::kGemm;
  StepStream stream = StepStream::kCompute;
  int chunk = 0;               // chunk index (ring: ring step * chunks + chunk)
  std::vector<RowRange> rows;  // see StepKind
  int send_peer = -1;          // kSendRecv / kPullRing only; -1 = nothing to send
  int recv_peer = -1;          // kSendRecv / kPullRing only; -1 = nothing to receive
  RowRange send_rows;
  RowRange recv_rows;
  bool accumulate = false;    // kGemm of GEMM+RS ring: add the received partial
  bool final_output = false;  // kGemm of GEMM+RS ring: rows are this rank's
                              // own shard, fully reduced (written to Y)
  std::vector<int> deps;      // indices of earlier steps of this plan
  // Copy engine (kPull*; done_to also on a kGemm that reads a message in place).
  std::vector<PlanMessage> ready_to, ready_from, pulls, done_to;
  // The pulls are not copied: the step that consumes them reads the peer's memory (a GEMM+RS
  // ring's in_place GEMM, whose C is the running sum, and which then sends the `done`; mode
  // none's kPullReduce, which sums the peers' partials where they are).
  bool by_reference = false;
  // kGemm of a full_weight plan: the K blocks multiplied (block b: rank b's input columns).
  // A writing GEMM takes them as one product over their columns in order; an adding one adds
  // each block's product in turn.
  std::vector<int> k_blocks;
  // kGemm of a full_weight plan: adds onto what an earlier GEMM wrote to these output rows.
  bool add_to_output = false;
};

struct PlanRequest {
  OverlapOp op = OverlapOp::kAllGatherGemm;
  OverlapMode mode = OverlapMode::kNone;
  int tp = 1;
  int rank = 0;
  int64_t m = 0;   // global rows (tokens)
  int chunks = 1;  // per-rank chunks (mode none: must be 1)
  // GEMM+RS ring with one chunk only: the last ring step's GEMM computes the own rows' partial
  // without waiting for the running sum, and a kSum step on the comm stream adds the two into
  // Y once both are there, instead of a GEMM that adds the received sum in its epilogue. The
  // last transfer then runs under the last GEMM (what a layer on copy engines runs).
  bool defer_last_sum = false;
  // Transfers on copy engines (tp > 1): kPull* steps instead of collectives and kSendRecv.
  bool copy_engine = false;
  // GEMM+RS ring on copy engines: each accumulating GEMM reads the running sum where the peer
  // left it (by_reference), and sends the `done` itself; the `done`s are awaited at the start
  // of the next run.
  bool in_place = false;
  // GEMM+RS without partial sums: every rank holds the whole weight and computes its own rows
  // over the whole K, with the peers' input columns of those rows pulled (kPullColumns; copy
  // engines at tp > 1). Mode none / pipeline: per chunk of the own rows, the pulls and one
  // whole-K GEMM. Ring: a lead of own rows / (2 * chunks) rows (whole 128-row tiles from 128
  // on) starts at once on the own columns, then one GEMM adds the peers' blocks once pulled;
  // the rest of the rows follow in one whole-K GEMM (the lead's steps are chunk 0, the rest's
  // chunk 1). The first kPullColumns step offers the whole input (one message per peer), the
  // last sends the `done`s.
  bool full_weight = false;
};

struct OverlapPlan {
  PlanRequest request;
  std::vector<PlanStep> steps;
  // Largest number of rows any rank contributes to one collective or
  // exchange step of this plan, or pulls in one message (what an executor pads to).
  int64_t max_step_rows = 0;
};

// Builds the plan, or INVALID_ARGUMENT naming the bad field. Limits:
// 1 <= tp <= 1024, 0 <= rank < tp, m >= 1, 1 <= chunks <= 64, mode none with
// chunks == 1, defer_last_sum with gemm_rs, ring and chunks == 1; copy_engine with tp > 1;
// in_place with gemm_rs, ring and copy_engine; full_weight with gemm_rs, copy_engine at tp > 1,
// and neither in_place nor defer_last_sum.
StatusOr<OverlapPlan> MakeOverlapPlan(const PlanRequest& request);

// Checks one rank's plan symbolically: deps point backwards; every step's
// input rows are present (own shard, or brought by a transitively depended-on
// step) when it starts; every output row is produced exactly once. Copy engine:
// messages to and from each peer numbered 0, 1, ... in step order; a message
// offered only once its rows are there; a pull only after its `ready_from`
// (this step, one it depends on, or an earlier step of its stream) and within
// its rows; every message received gets one `done`, after every pull of it.
// full_weight: every (own row, K block) multiplied exactly once, the first
// GEMM of a row writing it, the later ones adding to it after it. Returns
// INTERNAL describing the first violation.
Status ValidatePlan(const OverlapPlan& plan);

// Checks the plans of all ranks of one group together (plans[r] is rank r's):
// same collectives in the same order with the same rows, each send
// matched by the peer's receive of the same rows in the same order, and each
// copy-engine message offered (ready_to) awaited by its peer (ready_from) with
// the same number and rows.
Status ValidatePlanGroup(const std::vector<OverlapPlan>& plans);

// Human-readable listing, one step per line (for `tpserve plan`).
std::string DescribePlan(const OverlapPlan& plan);

}  // namespace tpserve
