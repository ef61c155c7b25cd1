#include "layers/overlap_plan.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>

namespace tpserve {
namespace {

constexpr int kMaxTp = 1024;
constexpr int kMaxChunks = 64;

std::string RangeString(RowRange r) {
  return "[" + std::to_string(r.begin) + "," + std::to_string(r.end) + ")";
}

// Builds one rank's steps; `Add` returns the new step's index.
class PlanBuilder {
 public:
  explicit PlanBuilder(const PlanRequest& req) : req_(req) {
    for (int s = 0; s < req.tp; ++s) shards_.push_back(ShardRows(req.m, req.tp, s));
  }

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

  OverlapPlan Finish() && {
    OverlapPlan plan;
    plan.request = req_;
    for (const PlanStep& s : steps_) {
      for (RowRange r : s.rows) {
        if (s.kind != StepKind::kGemm && s.kind != StepKind::kSum) {
          plan.max_step_rows = std::max(plan.max_step_rows, r.size());
        }
      }
      plan.max_step_rows = std::max({plan.max_step_rows, s.send_rows.size(), s.recv_rows.size()});
    }
    plan.steps = std::move(steps_);
    return plan;
  }

 private:
  const PlanRequest& req_;
  std::vector<RowRange> shards_;
  std::vector<PlanStep> steps_;
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
        const int ag = b.AddCollective(StepKind::kAllGather, c, rows, {});
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
            exchange = b.AddSendRecv(idx, next, b.Chunk(held, j), prev, b.Chunk(incoming, j), have);
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
        b.AddCollective(StepKind::kReduceScatter, c, rows, DepsOf(g));
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
                b.AddSendRecv(idx, prev, b.Chunk(dest, j), next, b.Chunk(incoming, j), DepsOf(g));
          }
        }
      }
      break;
    }
  }
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
  return Status::Ok();
}

// Rows as a bitmap over [0, m), for the symbolic checks.
using RowSet = std::vector<bool>;

void AddRows(RowSet& set, RowRange r) {
  for (int64_t i = r.begin; i < r.end; ++i) set[i] = true;
}
bool HasRows(const RowSet& set, RowRange r) {
  for (int64_t i = r.begin; i < r.end; ++i) {
    if (!set[i]) return false;
  }
  return true;
}
void Union(RowSet& into, const RowSet& from) {
  for (size_t i = 0; i < into.size(); ++i) into[i] = into[i] || from[i];
}

Status PlanError(const OverlapPlan& plan, int step, const std::string& what) {
  const PlanRequest& q = plan.request;
  return InternalError("overlap plan " + std::string(OverlapOpName(q.op)) + "/" +
                       std::string(OverlapModeName(q.mode)) + " tp=" + std::to_string(q.tp) +
                       " rank=" + std::to_string(q.rank) + " m=" + std::to_string(q.m) +
                       " chunks=" + std::to_string(q.chunks) +
                       (step >= 0 ? " step " + std::to_string(step) : std::string()) + ": " + what);
}

bool SameRows(const PlanStep& a, const PlanStep& b) { return a.kind == b.kind && a.rows == b.rows; }

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
  if (request.op == OverlapOp::kAllGatherGemm) {
    BuildAllGatherGemm(b, request);
  } else {
    BuildGemmReduceScatter(b, request);
  }
  return std::move(b).Finish();
}

Status ValidatePlan(const OverlapPlan& plan) {
  const PlanRequest& q = plan.request;
  const size_t m = static_cast<size_t>(q.m);
  const RowRange own = ShardRows(q.m, q.tp, q.rank);
  const bool ag = q.op == OverlapOp::kAllGatherGemm;

  // AG+GEMM tracks input rows present; GEMM+RS tracks partial rows computed
  // (`have`) and received sums (`recv`). Availability flows along deps.
  std::vector<RowSet> have_after(plan.steps.size(), RowSet(m, false));
  std::vector<RowSet> recv_after(plan.steps.size(), RowSet(m, false));
  std::vector<int> produced(m, 0);  // AG: output rows; RS: partial rows
  std::vector<int> final_rows(m, 0);

  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const PlanStep& s = plan.steps[i];
    const int si = static_cast<int>(i);
    RowSet have(m, false), recv(m, false);
    if (ag) AddRows(have, own);
    for (int d : s.deps) {
      if (d < 0 || d >= si)
        return PlanError(plan, si,
                         "dependency " + std::to_string(d) + " does not point to an earlier step");
      Union(have, have_after[d]);
      Union(recv, recv_after[d]);
    }
    have_after[i] = have;
    recv_after[i] = recv;
    switch (s.kind) {
      case StepKind::kAllGather:
      case StepKind::kReduceScatter: {
        if (s.rows.size() != static_cast<size_t>(q.tp)) {
          return PlanError(
              plan, si,
              "collective lists rows for " + std::to_string(s.rows.size()) + " ranks, not tp");
        }
        if (s.kind == StepKind::kAllGather) {
          if (!ag) return PlanError(plan, si, "allgather in a gemm_rs plan");
          for (RowRange r : s.rows) AddRows(have_after[i], r);
        } else {
          if (ag) return PlanError(plan, si, "reducescatter in an ag_gemm plan");
          for (RowRange r : s.rows) {
            if (!HasRows(have, r)) {
              return PlanError(
                  plan, si,
                  "reduces rows " + RangeString(r) + " whose partial is not computed before it");
            }
          }
          const RowRange mine = s.rows[q.rank];
          if (mine.begin < own.begin || mine.end > own.end) {
            return PlanError(plan, si,
                             "reduces rows " + RangeString(mine) + " outside this rank's shard " +
                                 RangeString(own));
          }
          for (int64_t row = mine.begin; row < mine.end; ++row) ++final_rows[row];
        }
        break;
      }
      case StepKind::kSendRecv: {
        if (s.send_peer >= 0 && !HasRows(have, s.send_rows)) {
          return PlanError(plan, si,
                           "sends rows " + RangeString(s.send_rows) + " before they are available");
        }
        if (ag) {
          AddRows(have_after[i], s.recv_rows);
        } else {
          AddRows(recv_after[i], s.recv_rows);
        }
        break;
      }
      case StepKind::kSum: {
        if (ag) return PlanError(plan, si, "sum in an ag_gemm plan");
        for (RowRange r : s.rows) {
          if (!HasRows(have, r) || !HasRows(recv, r)) {
            return PlanError(plan, si,
                             "sums rows " + RangeString(r) +
                                 " before both their partial and the received sum are there");
          }
          if (r.begin < own.begin || r.end > own.end) {
            return PlanError(
                plan, si,
                "sums rows " + RangeString(r) + " outside this rank's shard " + RangeString(own));
          }
          for (int64_t row = r.begin; row < r.end; ++row) ++final_rows[row];
        }
        break;
      }
      case StepKind::kGemm: {
        for (RowRange r : s.rows) {
          if (ag && !HasRows(have, r)) {
            return PlanError(plan, si,
                             "multiplies rows " + RangeString(r) + " before they are gathered");
          }
          if (!ag && s.accumulate && !HasRows(recv, r)) {
            return PlanError(
                plan, si,
                "accumulates into rows " + RangeString(r) + " whose partial sum has not arrived");
          }
          for (int64_t row = r.begin; row < r.end; ++row) ++produced[row];
          if (!ag) {
            AddRows(have_after[i], r);
            if (s.final_output) {
              if (r.begin < own.begin || r.end > own.end) {
                return PlanError(plan, si,
                                 "writes final rows " + RangeString(r) +
                                     " outside this rank's shard " + RangeString(own));
              }
              for (int64_t row = r.begin; row < r.end; ++row) ++final_rows[row];
            }
          }
        }
        break;
      }
    }
  }
  for (size_t row = 0; row < m; ++row) {
    if (produced[row] != 1) {
      return PlanError(plan, -1,
                       std::string(ag ? "output" : "partial") + " row " + std::to_string(row) +
                           " is computed " + std::to_string(produced[row]) + " times, not once");
    }
  }
  if (!ag) {
    for (int64_t row = own.begin; row < own.end; ++row) {
      if (final_rows[row] != 1) {
        return PlanError(plan, -1,
                         "output row " + std::to_string(row) + " is written " +
                             std::to_string(final_rows[row]) + " times, not once");
      }
    }
  }
  return Status::Ok();
}

Status ValidatePlanGroup(const std::vector<OverlapPlan>& plans) {
  if (plans.empty()) return InvalidArgumentError("plan group: no plans");
  const int tp = plans[0].request.tp;
  if (static_cast<int>(plans.size()) != tp) {
    return InternalError("plan group: " + std::to_string(plans.size()) +
                         " plans for tp=" + std::to_string(tp));
  }
  std::vector<std::vector<const PlanStep*>> collectives(tp);
  // (src, dst) -> rows sent in order; and rows received in order.
  std::map<std::pair<int, int>, std::vector<RowRange>> sent, received;
  for (int r = 0; r < tp; ++r) {
    const OverlapPlan& p = plans[r];
    if (p.request.rank != r || p.request.tp != tp || p.request.m != plans[0].request.m ||
        p.request.op != plans[0].request.op || p.request.mode != plans[0].request.mode ||
        p.request.chunks != plans[0].request.chunks ||
        p.request.defer_last_sum != plans[0].request.defer_last_sum) {
      return InternalError("plan group: plan " + std::to_string(r) +
                           " was made for another request");
    }
    for (const PlanStep& s : p.steps) {
      if (s.kind == StepKind::kAllGather || s.kind == StepKind::kReduceScatter) {
        collectives[r].push_back(&s);
      } else if (s.kind == StepKind::kSendRecv) {
        if (s.send_peer >= 0) sent[{r, s.send_peer}].push_back(s.send_rows);
        if (s.recv_peer >= 0) received[{s.recv_peer, r}].push_back(s.recv_rows);
      }
    }
  }
  for (int r = 1; r < tp; ++r) {
    if (collectives[r].size() != collectives[0].size()) {
      return InternalError("plan group: rank " + std::to_string(r) + " issues " +
                           std::to_string(collectives[r].size()) + " collectives, rank 0 " +
                           std::to_string(collectives[0].size()));
    }
    for (size_t i = 0; i < collectives[0].size(); ++i) {
      if (!SameRows(*collectives[r][i], *collectives[0][i])) {
        return InternalError("plan group: collective " + std::to_string(i) + " of rank " +
                             std::to_string(r) + " differs from rank 0's");
      }
    }
  }
  if (sent != received) {
    for (const auto& [pair, rows] : sent) {
      auto it = received.find(pair);
      if (it == received.end() || it->second != rows) {
        return InternalError("plan group: sends from rank " + std::to_string(pair.first) +
                             " to rank " + std::to_string(pair.second) +
                             " do not match that rank's receives");
      }
    }
    return InternalError("plan group: a rank receives a message that nobody sends");
  }
  return Status::Ok();
}

std::string DescribePlan(const OverlapPlan& plan) {
  const PlanRequest& q = plan.request;
  std::ostringstream os;
  os << OverlapOpName(q.op) << " mode=" << OverlapModeName(q.mode) << " tp=" << q.tp
     << " rank=" << q.rank << " m=" << q.m << " chunks=" << q.chunks
     << (q.defer_last_sum ? " defer_last_sum" : "") << " steps=" << plan.steps.size()
     << " max_step_rows=" << plan.max_step_rows << "\n";
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const PlanStep& s = plan.steps[i];
    os << "  " << i << "\t" << (s.stream == StepStream::kComm ? "comm   " : "compute") << "\t"
       << StepKindName(s.kind) << "\tchunk " << s.chunk << "\t";
    if (s.kind == StepKind::kSendRecv) {
      if (s.send_peer >= 0)
        os << "send " << RangeString(s.send_rows) << " -> " << s.send_peer << " ";
      if (s.recv_peer >= 0)
        os << "recv " << RangeString(s.recv_rows) << " <- " << s.recv_peer << " ";
    } else {
      for (size_t k = 0; k < s.rows.size(); ++k) {
        if (s.kind != StepKind::kGemm && s.kind != StepKind::kSum) os << "r" << k << ":";
        os << RangeString(s.rows[k]) << " ";
      }
    }
    if (s.accumulate) os << "+recv ";
    if (s.final_output) os << "final ";
    if (!s.deps.empty()) {
      os << "deps";
      for (int d : s.deps) os << " " << d;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace tpserve
