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
};
enum class StepStream { kCompute, kComm };

std::string_view StepKindName(StepKind kind);

struct PlanStep {
  StepKind kind = StepKind::kGemm;
  StepStream stream = StepStream::kCompute;
  int chunk = 0;               // chunk index (ring: ring step * chunks + chunk)
  std::vector<RowRange> rows;  // see StepKind
  int send_peer = -1;          // kSendRecv only; -1 = nothing to send
  int recv_peer = -1;          // kSendRecv only; -1 = nothing to receive
  RowRange send_rows;
  RowRange recv_rows;
  bool accumulate = false;    // kGemm of GEMM+RS ring: add the received partial
  bool final_output = false;  // kGemm of GEMM+RS ring: rows are this rank's
                              // own shard, fully reduced (written to Y)
  std::vector<int> deps;      // indices of earlier steps of this plan
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
};

struct OverlapPlan {
  PlanRequest request;
  std::vector<PlanStep> steps;
  // Largest number of rows any rank contributes to one collective or
  // exchange step of this plan (what an executor pads to).
  int64_t max_step_rows = 0;
};

// Builds the plan, or INVALID_ARGUMENT naming the bad field. Limits:
// 1 <= tp <= 1024, 0 <= rank < tp, m >= 1, 1 <= chunks <= 64, mode none with
// chunks == 1, and defer_last_sum with gemm_rs, ring and chunks == 1.
StatusOr<OverlapPlan> MakeOverlapPlan(const PlanRequest& request);

// Checks one rank's plan symbolically: deps point backwards; every step's
// input rows are present (own shard, or brought by a transitively depended-on
// step) when it starts; every output row is produced exactly once. Returns
// INTERNAL describing the first violation.
Status ValidatePlan(const OverlapPlan& plan);

// Checks the plans of all ranks of one group together (plans[r] is rank r's):
// same collectives in the same order with the same rows, and each send
// matched by the peer's receive of the same rows in the same order.
Status ValidatePlanGroup(const std::vector<OverlapPlan>& plans);

// Human-readable listing, one step per line (for `tpserve plan`).
std::string DescribePlan(const OverlapPlan& plan);

}  // namespace tpserve
