#include "layers/overlap_plan.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>

namespace tpserve {
namespace {

constexpr int kMaxTp = 1024;
constexpr int kMaxChunks = 64;

// Builds one rank's steps; `Add` returns the new step's index.
class PlanBuilder {
 public:
  explicit PlanBuilder(const PlanRequest& req)
      : req_(req), next_to_(req.tp, 0), next_from_(req.tp, 0) {
    for (int s = 0; s < req.tp; ++s) shards_.push_back(ShardRows(req.m, req.tp, s));
  }

  // The next message this rank offers to `peer` / awaits from `peer` (copy engine).
  PlanMessage Offer(int peer, RowRange rows) { return {peer, next_to_[peer]++, rows}; }
  PlanMessage Await(int peer, RowRange rows) { return {peer, next_from_[peer]++, rows}; }

  RowRange Chunk(int shard, int chunk) const {
    return ChunkRows(shards_[shard], req_.chunks, chunk);
  }
  const std::vector<RowRange>& shards() const { return shards_; }

  PlanStep& step(int i) { return steps_[i]; }

  int Add(PlanStep step) {
    steps_.push_back(std::move(step));
    return static_cast<int>(steps_.size()) - 1;
  }

  // A collective over per-rank rows; -1 when every rank's rows are empty.
  int AddCollective(StepKind kind, int chunk, std::vector<RowRange> rows, std::vector<int> deps) {
    if (std::all_of(rows.begin(), rows.end(), [](RowRange r) { return r.empty(); })) return -1;
    PlanStep s;
    s.kind = kind;
    s.stream = StepStream::kComm;
    s.chunk = chunk;
    s.rows = std::move(rows);
    s.deps = std::move(deps);
    return Add(std::move(s));
  }

  // A GEMM over the non-empty `rows`; -1 when all are empty.
  int AddGemm(int chunk, const std::vector<RowRange>& rows, std::vector<int> deps) {
    PlanStep s;
    s.kind = StepKind::kGemm;
    s.stream = StepStream::kCompute;
    s.chunk = chunk;
    for (RowRange r : rows) {
      if (!r.empty()) s.rows.push_back(r);
    }
    if (s.rows.empty()) return -1;
    s.deps = std::move(deps);
    return Add(std::move(s));
  }

  // The deferred last sum of `rows` (this rank's own), on the comm stream.
  int AddSum(int chunk, RowRange rows, std::vector<int> deps) {
    PlanStep s;
    s.kind = StepKind::kSum;
    s.stream = StepStream::kComm;
    s.chunk = chunk;
    s.rows = {rows};
    s.final_output = true;
    s.deps = std::move(deps);
    return Add(std::move(s));
  }

  int AddSendRecv(int chunk, int send_peer, RowRange send_rows, int recv_peer, RowRange recv_rows,
                  std::vector<int> deps) {
    if (send_rows.empty() && recv_rows.empty()) return -1;
    PlanStep s;
    s.kind = StepKind::kSendRecv;
    s.stream = StepStream::kComm;
    s.chunk = chunk;
    s.send_peer = send_rows.empty() ? -1 : send_peer;
    s.send_rows = send_rows.empty() ? RowRange{} : send_rows;
    s.recv_peer = recv_rows.empty() ? -1 : recv_peer;
    s.recv_rows = recv_rows.empty() ? RowRange{} : recv_rows;
    s.deps = std::move(deps);
    return Add(std::move(s));
  }

  // Copy engine, AG+GEMM none/pipeline: this rank's rows offered to every peer, theirs pulled.
  int AddPullGather(int chunk, std::vector<RowRange> rows) {
    const int i = AddCollective(StepKind::kPullGather, chunk, std::move(rows), {});
    if (i < 0) return i;
    PlanStep& s = steps_[i];
    for (int p = 0; p < req_.tp; ++p) {
      if (p == req_.rank) continue;
      s.ready_to.push_back(Offer(p, s.rows[req_.rank]));
      const PlanMessage in = Await(p, s.rows[p]);
      s.ready_from.push_back(in);
      if (!in.rows.empty()) s.pulls.push_back(in);
      s.done_to.push_back(in);
    }
    return i;
  }

  // Copy engine, GEMM+RS none/pipeline: the partial of each peer's rows offered to it, the
  // peers' partials of this rank's rows pulled (mode none: read where they are) and summed.
  int AddPullReduce(int chunk, std::vector<RowRange> rows, std::vector<int> deps) {
    const int i = AddCollective(StepKind::kPullReduce, chunk, std::move(rows), std::move(deps));
    if (i < 0) return i;
    PlanStep& s = steps_[i];
    s.by_reference = req_.mode == OverlapMode::kNone;
    const RowRange mine = s.rows[req_.rank];
    for (int p = 0; p < req_.tp; ++p) {
      if (p == req_.rank) continue;
      s.ready_to.push_back(Offer(p, s.rows[p]));
      const PlanMessage in = Await(p, mine);
      s.ready_from.push_back(in);
      if (!mine.empty()) s.pulls.push_back(in);
      s.done_to.push_back(in);
    }
    return i;
  }

  // A ring exchange: kSendRecv, or on copy engines kPullRing (the received rows pulled, or
  // with in_place left where they are for the GEMM that adds them, which sends the `done`).
  int AddExchange(int chunk, int send_peer, RowRange send_rows, int recv_peer, RowRange recv_rows,
                  std::vector<int> deps) {
    const int i = AddSendRecv(chunk, send_peer, send_rows, recv_peer, recv_rows, std::move(deps));
    if (i < 0 || !req_.copy_engine) return i;
    PlanStep& s = steps_[i];
    s.kind = StepKind::kPullRing;
    s.by_reference = req_.in_place;
    if (s.send_peer >= 0) s.ready_to.push_back(Offer(s.send_peer, s.send_rows));
    if (s.recv_peer >= 0) {
      const PlanMessage in = Await(s.recv_peer, s.recv_rows);
      s.ready_from.push_back(in);
      s.pulls.push_back(in);
      if (!req_.in_place) s.done_to.push_back(in);
    }
    return i;
  }

  // full_weight: pulls of every peer's input columns of `rows` (this rank's); the first such
  // step offers this rank's whole input to every peer (the peer's shard of rows) and awaits
  // theirs, the last sends the `done`s. Kept when `rows` is empty, so the signals pair up.
  int AddPullColumns(int chunk, RowRange rows, bool first, bool last) {
    PlanStep s;
    s.kind = StepKind::kPullColumns;
    s.stream = StepStream::kComm;
    s.chunk = chunk;
    s.rows = {rows};
    for (int p = 0; p < req_.tp; ++p) {
      if (p == req_.rank) continue;
      const PlanMessage in{p, 0, shards_[req_.rank]};
      if (first) s.ready_to.push_back({p, 0, shards_[p]});
      if (first) s.ready_from.push_back(in);
      if (!rows.empty()) s.pulls.push_back({p, 0, rows});
      if (last) s.done_to.push_back(in);
    }
    return Add(std::move(s));
  }

  // full_weight: a GEMM of `rows` over the K blocks `blocks`; -1 for empty rows.
  int AddBlockGemm(int chunk, RowRange rows, std::vector<int> blocks, bool add,
                   std::vector<int> deps) {
    const int i = AddGemm(chunk, {rows}, std::move(deps));
    if (i >= 0) {
      steps_[i].k_blocks = std::move(blocks);
      steps_[i].add_to_output = add;
      steps_[i].final_output = true;
    }
    return i;
  }

  OverlapPlan Finish() && {
    OverlapPlan plan;
    plan.request = req_;
    for (const PlanStep& s : steps_) {
      for (RowRange r : s.rows) {
        if (s.kind != StepKind::kGemm && s.kind != StepKind::kSum &&
            s.kind != StepKind::kPullColumns) {
          plan.max_step_rows = std::max(plan.max_step_rows, r.size());
        }
      }
      plan.max_step_rows = std::max({plan.max_step_rows, s.send_rows.size(), s.recv_rows.size()});
      for (const PlanMessage& mm : s.pulls) {
        plan.max_step_rows = std::max(plan.max_step_rows, mm.rows.size());
      }
    }
    plan.steps = std::move(steps_);
    return plan;
  }

 private:
  const PlanRequest& req_;
  std::vector<RowRange> shards_;
  std::vector<PlanStep> steps_;
  std::vector<int> next_to_, next_from_;  // messages so far to / from each peer
};

std::vector<int> DepsOf(int step) { return step < 0 ? std::vector<int>{} : std::vector<int>{step}; }

void BuildAllGatherGemm(PlanBuilder& b, const PlanRequest& req) {
  const int tp = req.tp, r = req.rank;
  if (tp == 1) {  // nothing to gather
    for (int c = 0; c < req.chunks; ++c) b.AddGemm(c, {b.Chunk(0, c)}, {});
    return;
  }
  switch (req.mode) {
    case OverlapMode::kNone:
    case OverlapMode::kPipeline:
      for (int c = 0; c < req.chunks; ++c) {
        std::vector<RowRange> rows;
        for (int s = 0; s < tp; ++s) rows.push_back(b.Chunk(s, c));
        const int ag = req.copy_engine ? b.AddPullGather(c, rows)
                                       : b.AddCollective(StepKind::kAllGather, c, rows, {});
        b.AddGemm(c, rows, DepsOf(ag));
      }
      break;
    case OverlapMode::kRing: {
      // Ring step k: compute on the shard held, (r - k) mod tp, while passing
      // it on to r+1 and receiving (r - k - 1) mod tp from r-1.
      const int next = (r + 1) % tp, prev = (r - 1 + tp) % tp;
      std::vector<int> arrived(req.chunks, -1);  // step that brought chunk j
      for (int k = 0; k < tp; ++k) {
        const int held = (r - k + tp) % tp;
        const int incoming = (r - k - 1 + 2 * tp) % tp;
        for (int j = 0; j < req.chunks; ++j) {
          const int idx = k * req.chunks + j;
          const std::vector<int> have = DepsOf(arrived[j]);
          int exchange = -1;
          if (k < tp - 1) {
            exchange = b.AddExchange(idx, next, b.Chunk(held, j), prev, b.Chunk(incoming, j), have);
          }
          b.AddGemm(idx, {b.Chunk(held, j)}, have);
          arrived[j] = exchange;
        }
      }
      break;
    }
  }
}

void BuildGemmReduceScatter(PlanBuilder& b, const PlanRequest& req) {
  const int tp = req.tp, r = req.rank;
  if (tp == 1) {  // the partial is the result
    for (int c = 0; c < req.chunks; ++c) {
      const int g = b.AddGemm(c, {b.Chunk(0, c)}, {});
      if (g >= 0) b.step(g).final_output = true;
    }
    return;
  }
  switch (req.mode) {
    case OverlapMode::kNone:
    case OverlapMode::kPipeline:
      for (int c = 0; c < req.chunks; ++c) {
        std::vector<RowRange> rows;
        for (int s = 0; s < tp; ++s) rows.push_back(b.Chunk(s, c));
        const int g = b.AddGemm(c, rows, {});
        if (req.copy_engine) {
          b.AddPullReduce(c, rows, DepsOf(g));
        } else {
          b.AddCollective(StepKind::kReduceScatter, c, rows, DepsOf(g));
        }
      }
      break;
    case OverlapMode::kRing: {
      // Ring step k: compute the partial of shard (r + k + 1) mod tp, add the
      // sum that r+1 passed on, and pass it to r-1; at k = tp-1 the shard is
      // r's own and the sum is complete.
      const int next = (r + 1) % tp, prev = (r - 1 + tp) % tp;
      std::vector<int> arrived(req.chunks, -1);  // step that brought chunk j's sum
      for (int k = 0; k < tp; ++k) {
        const int dest = (r + k + 1) % tp;
        const int incoming = (r + k + 2) % tp;
        for (int j = 0; j < req.chunks; ++j) {
          const int idx = k * req.chunks + j;
          // Deferred: the GEMM waits for nothing it does not read; the sum for both addends.
          const bool defer = req.defer_last_sum && k == tp - 1 && k > 0;
          const int g =
              b.AddGemm(idx, {b.Chunk(dest, j)}, defer ? std::vector<int>{} : DepsOf(arrived[j]));
          if (g >= 0) {
            b.step(g).accumulate = k > 0 && !defer;
            if (req.in_place && b.step(g).accumulate && arrived[j] >= 0) {
              b.step(g).done_to = b.step(arrived[j]).ready_from;  // it reads the peer's sum
            }
            b.step(g).final_output = k == tp - 1 && !defer;
            if (defer) {
              std::vector<int> deps = DepsOf(arrived[j]);
              deps.push_back(g);
              b.AddSum(idx, b.Chunk(dest, j), std::move(deps));
            }
          }
          arrived[j] = -1;
          if (k < tp - 1) {
            arrived[j] =
                b.AddExchange(idx, prev, b.Chunk(dest, j), next, b.Chunk(incoming, j), DepsOf(g));
          }
        }
      }
      break;
    }
  }
}

// PlanRequest::full_weight (see there).
void BuildFullWeight(PlanBuilder& b, const PlanRequest& req) {
  const int tp = req.tp, r = req.rank;
  const RowRange own = b.shards()[r];
  std::vector<int> all(tp), peers;
  for (int p = 0; p < tp; ++p) {
    all[p] = p;
    if (p != r) peers.push_back(p);
  }
  const bool pulls = req.copy_engine;
  if (req.mode != OverlapMode::kRing) {
    for (int c = 0; c < req.chunks; ++c) {
      const RowRange rows = ChunkRows(own, req.chunks, c);
      const int pull = pulls ? b.AddPullColumns(c, rows, c == 0, c == req.chunks - 1) : -1;
      b.AddBlockGemm(c, rows, all, false, DepsOf(pull));
    }
    return;
  }
  int64_t lead = own.size() / (2 * req.chunks);
  if (lead >= 128) lead = lead / 128 * 128;  // whole 128-row tiles
  const RowRange head{own.begin, own.begin + lead}, rest{own.begin + lead, own.end};
  int head_pull = -1, rest_pull = -1;
  if (pulls) {
    head_pull = b.AddPullColumns(0, head, true, false);
    rest_pull = b.AddPullColumns(1, rest, false, true);
  }
  const int own_gemm = b.AddBlockGemm(0, head, {r}, false, {});
  if (own_gemm >= 0 && pulls) b.AddBlockGemm(0, head, peers, true, {head_pull, own_gemm});
  b.AddBlockGemm(1, rest, all, false, DepsOf(rest_pull));
}

Status CheckRequest(const PlanRequest& req) {
  if (req.tp < 1 || req.tp > kMaxTp) {
    return InvalidArgumentError("overlap plan: tp must be in [1, " + std::to_string(kMaxTp) +
                                "], got " + std::to_string(req.tp));
  }
  if (req.rank < 0 || req.rank >= req.tp) {
    return InvalidArgumentError("overlap plan: rank must be in [0, tp=" + std::to_string(req.tp) +
                                "), got " + std::to_string(req.rank));
  }
  if (req.m < 1) {
    return InvalidArgumentError("overlap plan: m (rows) must be >= 1, got " +
                                std::to_string(req.m));
  }
  if (req.chunks < 1 || req.chunks > kMaxChunks) {
    return InvalidArgumentError("overlap plan: chunks must be in [1, " +
                                std::to_string(kMaxChunks) + "], got " +
                                std::to_string(req.chunks));
  }
  if (req.mode == OverlapMode::kNone && req.chunks != 1) {
    return InvalidArgumentError("overlap plan: mode none takes chunks = 1, got " +
                                std::to_string(req.chunks) + " (use mode pipeline to chunk)");
  }
  if (req.defer_last_sum && (req.op != OverlapOp::kGemmReduceScatter ||
                             req.mode != OverlapMode::kRing || req.chunks != 1)) {
    return InvalidArgumentError(
        "overlap plan: defer_last_sum is for gemm_rs ring with chunks = 1, got " +
        std::string(OverlapOpName(req.op)) + " " + std::string(OverlapModeName(req.mode)) +
        " chunks=" + std::to_string(req.chunks));
  }
  const bool rs_ring = req.op == OverlapOp::kGemmReduceScatter && req.mode == OverlapMode::kRing;
  if (req.copy_engine && req.tp < 2) {
    return InvalidArgumentError("overlap plan: copy_engine needs tp > 1 (nothing to transfer)");
  }
  if (req.in_place && !(rs_ring && req.copy_engine)) {
    return InvalidArgumentError(
        "overlap plan: in_place is for gemm_rs ring with copy_engine, got " +
        std::string(OverlapOpName(req.op)) + " " + std::string(OverlapModeName(req.mode)) +
        (req.copy_engine ? " with" : " without") + " copy_engine");
  }
  if (req.full_weight && (req.op != OverlapOp::kGemmReduceScatter ||
                          req.copy_engine != (req.tp > 1) || req.in_place || req.defer_last_sum)) {
    return InvalidArgumentError(
        "overlap plan: full_weight is for gemm_rs, with copy_engine exactly when tp > 1, and "
        "without in_place or defer_last_sum");
  }
  return Status::Ok();
}

}  // namespace

std::string_view OverlapOpName(OverlapOp op) {
  return op == OverlapOp::kAllGatherGemm ? "ag_gemm" : "gemm_rs";
}

std::string_view OverlapModeName(OverlapMode mode) {
  switch (mode) {
    case OverlapMode::kNone:
      return "none";
    case OverlapMode::kPipeline:
      return "pipeline";
    case OverlapMode::kRing:
      return "ring";
  }
  return "unknown";
}

StatusOr<OverlapOp> ParseOverlapOp(std::string_view name) {
  if (name == "ag_gemm") return OverlapOp::kAllGatherGemm;
  if (name == "gemm_rs") return OverlapOp::kGemmReduceScatter;
  return InvalidArgumentError("unknown overlap op '" + std::string(name) +
                              "' (allowed: ag_gemm, gemm_rs)");
}

StatusOr<OverlapMode> ParseOverlapMode(std::string_view name) {
  if (name == "none") return OverlapMode::kNone;
  if (name == "pipeline") return OverlapMode::kPipeline;
  if (name == "ring") return OverlapMode::kRing;
  if (name == "auto") {
    return InvalidArgumentError(
        "overlap mode 'auto' must be resolved by the overlap config for a given M before "
        "planning (allowed here: none, pipeline, ring)");
  }
  return InvalidArgumentError("unknown overlap mode '" + std::string(name) +
                              "' (allowed: none, pipeline, ring)");
}

std::string_view StepKindName(StepKind kind) {
  switch (kind) {
    case StepKind::kAllGather:
      return "allgather";
    case StepKind::kReduceScatter:
      return "reducescatter";
    case StepKind::kSendRecv:
      return "sendrecv";
    case StepKind::kGemm:
      return "gemm";
    case StepKind::kSum:
      return "sum";
    case StepKind::kPullGather:
      return "pull_gather";
    case StepKind::kPullRing:
      return "pull_ring";
    case StepKind::kPullReduce:
      return "pull_reduce";
    case StepKind::kPullColumns:
      return "pull_columns";
  }
  return "unknown";
}

RowRange ShardRows(int64_t m, int tp, int rank) { return ChunkRows(RowRange{0, m}, tp, rank); }

RowRange ChunkRows(RowRange rows, int chunks, int chunk) {
  const int64_t n = std::max<int64_t>(rows.size(), 0);
  const int64_t base = n / chunks, extra = n % chunks;
  const int64_t begin = rows.begin + chunk * base + std::min<int64_t>(chunk, extra);
  const int64_t size = base + (chunk < extra ? 1 : 0);
  return RowRange{begin, begin + size};
}

StatusOr<OverlapPlan> MakeOverlapPlan(const PlanRequest& request) {
  TP_RETURN_IF_ERROR(CheckRequest(request));
  PlanBuilder b(request);
  if (request.full_weight) {
    BuildFullWeight(b, request);
  } else if (request.op == OverlapOp::kAllGatherGemm) {
    BuildAllGatherGemm(b, request);
  } else {
    BuildGemmReduceScatter(b, request);
  }
  return std::move(b).Finish();
}

}  // namespace tpserve
