// ValidatePlan, ValidatePlanGroup and DescribePlan (layers/overlap_plan.h): the symbolic checks
// of a plan's data flow, one rank at a time and across the ranks of a group.
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "layers/overlap_plan.h"

namespace tpserve {
namespace {

std::string RangeString(RowRange r) {
  return "[" + std::to_string(r.begin) + "," + std::to_string(r.end) + ")";
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
bool Within(RowRange inner, RowRange outer) {
  return inner.empty() || (inner.begin >= outer.begin && inner.end <= outer.end);
}

bool IsPull(StepKind k) {
  return k == StepKind::kPullGather || k == StepKind::kPullRing || k == StepKind::kPullReduce ||
         k == StepKind::kPullColumns;
}

using MessageKey = std::pair<int, int>;  // (peer, msg)

// ValidatePlan's walk over one rank's steps. What a step may use flows along its deps: rows
// present (AG: input rows; RS: partial rows computed), running sums received (RS ring), the
// peers' input columns pulled (full_weight, per K block) and output rows written (full_weight).
// Copy-engine waits also hold for later steps of the same stream, which run in order.
class PlanChecker {
 public:
  explicit PlanChecker(const OverlapPlan& plan)
      : plan_(plan),
        q_(plan.request),
        m_(static_cast<size_t>(plan.request.m)),
        own_(ShardRows(plan.request.m, plan.request.tp, plan.request.rank)),
        ag_(plan.request.op == OverlapOp::kAllGatherGemm),
        n_(plan.steps.size()),
        have_after_(n_, RowSet(m_, false)),
        recv_after_(n_, RowSet(m_, false)),
        written_after_(n_, RowSet(m_, false)),
        cols_after_(n_, std::vector<RowSet>(plan.request.full_weight ? plan.request.tp : 0,
                                            RowSet(m_, false))),
        ancestors_(n_, std::vector<bool>(n_, false)),
        produced_(m_, 0),
        final_rows_(m_, 0),
        block_products_(plan.request.full_weight ? m_ * plan.request.tp : 0, 0),
        next_to_(plan.request.tp, 0),
        next_from_(plan.request.tp, 0) {}

  Status Run() {
    for (size_t i = 0; i < n_; ++i) {
      const int si = static_cast<int>(i);
      TP_RETURN_IF_ERROR(Flow(si));
      TP_RETURN_IF_ERROR(Messages(si));
      TP_RETURN_IF_ERROR(Step(si));
    }
    return Finish();
  }

 private:
  Status Error(int step, const std::string& what) const {
    return InternalError("overlap plan " + std::string(OverlapOpName(q_.op)) + "/" +
                         std::string(OverlapModeName(q_.mode)) + (q_.copy_engine ? "/ce" : "") +
                         (q_.in_place ? "/in_place" : "") + (q_.full_weight ? "/full_weight" : "") +
                         " tp=" + std::to_string(q_.tp) + " rank=" + std::to_string(q_.rank) +
                         " m=" + std::to_string(q_.m) + " chunks=" + std::to_string(q_.chunks) +
                         (step >= 0 ? " step " + std::to_string(step) : std::string()) + ": " +
                         what);
  }

  // What step i starts with: the union over its deps; its ancestors (deps, the previous step
  // of its stream, transitively).
  Status Flow(int i) {
    const PlanStep& s = plan_.steps[i];
    RowSet& have = have_after_[i];
    if (ag_ || q_.full_weight) AddRows(have, own_);
    for (int d : s.deps) {
      if (d < 0 || d >= i) {
        return Error(i, "dependency " + std::to_string(d) + " does not point to an earlier step");
      }
      Union(have, have_after_[d]);
      Union(recv_after_[i], recv_after_[d]);
      Union(written_after_[i], written_after_[d]);
      for (size_t b = 0; b < cols_after_[i].size(); ++b)
        Union(cols_after_[i][b], cols_after_[d][b]);
    }
    std::vector<int> before = s.deps;
    for (int j = i - 1; j >= 0; --j) {
      if (plan_.steps[j].stream == s.stream) {
        before.push_back(j);
        break;
      }
    }
    for (int d : before) {
      ancestors_[i][d] = true;
      for (size_t a = 0; a < n_; ++a) ancestors_[i][a] = ancestors_[i][a] || ancestors_[d][a];
    }
    return Status::Ok();
  }

  // The rows this rank may offer at step i (what it has; full_weight: its input, all there).
  bool CanOffer(int i, RowRange rows) const {
    return q_.full_weight || HasRows(have_after_[i], rows);
  }

  Status Messages(int i) {
    const PlanStep& s = plan_.steps[i];
    const bool messages =
        !s.ready_to.empty() || !s.ready_from.empty() || !s.pulls.empty() || !s.done_to.empty();
    if (messages && !q_.copy_engine) return Error(i, "copy-engine messages without copy_engine");
    if (IsPull(s.kind) && !q_.copy_engine) return Error(i, "a pull step without copy_engine");
    auto bad_peer = [&](const PlanMessage& mm) {
      return mm.peer < 0 || mm.peer >= q_.tp || mm.peer == q_.rank;
    };
    for (const PlanMessage& mm : s.ready_to) {
      if (bad_peer(mm)) return Error(i, "offers a message to rank " + std::to_string(mm.peer));
      if (mm.msg != next_to_[mm.peer]++) {
        return Error(i, "offers message " + std::to_string(mm.msg) + " to rank " +
                            std::to_string(mm.peer) + " out of order");
      }
      if (!CanOffer(i, mm.rows)) {
        return Error(i, "offers rows " + RangeString(mm.rows) + " to rank " +
                            std::to_string(mm.peer) + " before they are there");
      }
    }
    for (const PlanMessage& mm : s.ready_from) {
      if (bad_peer(mm)) return Error(i, "awaits a message from rank " + std::to_string(mm.peer));
      if (mm.msg != next_from_[mm.peer]++) {
        return Error(i, "awaits message " + std::to_string(mm.msg) + " from rank " +
                            std::to_string(mm.peer) + " out of order");
      }
      awaited_[{mm.peer, mm.msg}] = {i, mm.rows};
    }
    for (const PlanMessage& mm : s.pulls) {
      auto it = awaited_.find({mm.peer, mm.msg});
      if (it == awaited_.end() || (it->second.first != i && !ancestors_[i][it->second.first])) {
        return Error(i, "pulls message " + std::to_string(mm.msg) + " of rank " +
                            std::to_string(mm.peer) + " without waiting for it to be ready");
      }
      if (!Within(mm.rows, it->second.second)) {
        return Error(i, "pulls rows " + RangeString(mm.rows) + " outside message " +
                            std::to_string(mm.msg) + " of rank " + std::to_string(mm.peer));
      }
      if (done_.count({mm.peer, mm.msg})) {
        return Error(i, "pulls message " + std::to_string(mm.msg) + " of rank " +
                            std::to_string(mm.peer) + " after its `done`");
      }
      pulled_by_[{mm.peer, mm.msg}].push_back(i);
      if (s.by_reference && s.kind == StepKind::kPullRing) in_place_reads_[{mm.peer, mm.msg}] = i;
    }
    for (const PlanMessage& mm : s.done_to) {
      const MessageKey key{mm.peer, mm.msg};
      if (!awaited_.count(key) || ++done_[key] != 1) {
        return Error(i, "sends a `done` for message " + std::to_string(mm.msg) + " of rank " +
                            std::to_string(mm.peer) + " that it did not await, or twice");
      }
      auto ref = in_place_reads_.find(key);
      if (ref != in_place_reads_.end() &&
          !(s.kind == StepKind::kGemm && s.accumulate &&
            std::count(s.deps.begin(), s.deps.end(), ref->second))) {
        return Error(i, "sends the `done` for message " + std::to_string(mm.msg) + " of rank " +
                            std::to_string(mm.peer) +
                            ", read in place, from a step other than the GEMM that reads it");
      }
      for (int j : pulled_by_[key]) {
        if (j != i && !ancestors_[i][j]) {
          return Error(i, "sends the `done` for message " + std::to_string(mm.msg) + " of rank " +
                              std::to_string(mm.peer) + " before step " + std::to_string(j) +
                              " has read it");
        }
      }
    }
    return Status::Ok();
  }

  // The rows pulled at step i become present.
  void Arrive(int i, RowSet& into) {
    for (const PlanMessage& mm : plan_.steps[i].pulls) AddRows(into, mm.rows);
  }

  Status Collective(int i) {
    const PlanStep& s = plan_.steps[i];
    if (s.rows.size() != static_cast<size_t>(q_.tp)) {
      return Error(i,
                   "collective lists rows for " + std::to_string(s.rows.size()) + " ranks, not tp");
    }
    const bool gather = s.kind == StepKind::kAllGather || s.kind == StepKind::kPullGather;
    if (gather != ag_) {
      return Error(i, std::string(StepKindName(s.kind)) + " in a " +
                          std::string(OverlapOpName(q_.op)) + " plan");
    }
    if (gather) {
      if (s.kind == StepKind::kPullGather) {
        Arrive(i, have_after_[i]);
      } else {
        for (RowRange r : s.rows) AddRows(have_after_[i], r);
      }
      return Status::Ok();
    }
    for (RowRange r : s.rows) {
      if (!HasRows(have_after_[i], r)) {
        return Error(i,
                     "reduces rows " + RangeString(r) + " whose partial is not computed before it");
      }
    }
    const RowRange mine = s.rows[q_.rank];
    if (!Within(mine, own_)) {
      return Error(i, "reduces rows " + RangeString(mine) + " outside this rank's shard " +
                          RangeString(own_));
    }
    if (s.kind == StepKind::kPullReduce && !mine.empty()) {
      std::set<int> from;
      for (const PlanMessage& mm : s.pulls) {
        if (mm.rows == mine) from.insert(mm.peer);
      }
      if (static_cast<int>(from.size()) != q_.tp - 1) {
        return Error(i, "sums rows " + RangeString(mine) + " with the partials of " +
                            std::to_string(from.size()) + " peers, not tp - 1");
      }
    }
    for (int64_t row = mine.begin; row < mine.end; ++row) ++final_rows_[row];
    return Status::Ok();
  }

  Status Exchange(int i) {
    const PlanStep& s = plan_.steps[i];
    if (s.send_peer >= 0 && !HasRows(have_after_[i], s.send_rows)) {
      return Error(i, "sends rows " + RangeString(s.send_rows) + " before they are available");
    }
    RowSet& into = ag_ ? have_after_[i] : recv_after_[i];
    if (s.kind == StepKind::kPullRing) {
      Arrive(i, into);
    } else {
      AddRows(into, s.recv_rows);
    }
    return Status::Ok();
  }

  Status Sum(int i) {
    const PlanStep& s = plan_.steps[i];
    if (ag_) return Error(i, "sum in an ag_gemm plan");
    for (RowRange r : s.rows) {
      if (!HasRows(have_after_[i], r) || !HasRows(recv_after_[i], r)) {
        return Error(i, "sums rows " + RangeString(r) +
                            " before both their partial and the received sum are there");
      }
      if (!Within(r, own_)) {
        return Error(
            i, "sums rows " + RangeString(r) + " outside this rank's shard " + RangeString(own_));
      }
      for (int64_t row = r.begin; row < r.end; ++row) ++final_rows_[row];
    }
    return Status::Ok();
  }

  Status Gemm(int i) {
    const PlanStep& s = plan_.steps[i];
    if (q_.full_weight) return BlockGemm(i);
    for (RowRange r : s.rows) {
      if (ag_ && !HasRows(have_after_[i], r)) {
        return Error(i, "multiplies rows " + RangeString(r) + " before they are gathered");
      }
      if (!ag_ && s.accumulate && !HasRows(recv_after_[i], r)) {
        return Error(
            i, "accumulates into rows " + RangeString(r) + " whose partial sum has not arrived");
      }
      for (int64_t row = r.begin; row < r.end; ++row) ++produced_[row];
      if (ag_) continue;
      AddRows(have_after_[i], r);
      if (s.final_output) {
        if (!Within(r, own_)) {
          return Error(i, "writes final rows " + RangeString(r) + " outside this rank's shard " +
                              RangeString(own_));
        }
        for (int64_t row = r.begin; row < r.end; ++row) ++final_rows_[row];
      }
    }
    return Status::Ok();
  }

  // full_weight: own rows over K blocks whose columns are there; the first GEMM of a row writes
  // it, later ones add to it after it.
  Status BlockGemm(int i) {
    const PlanStep& s = plan_.steps[i];
    if (s.k_blocks.empty()) return Error(i, "a full_weight GEMM without K blocks");
    for (RowRange r : s.rows) {
      if (!Within(r, own_)) {
        return Error(i, "multiplies rows " + RangeString(r) + " outside this rank's shard " +
                            RangeString(own_));
      }
      for (int b : s.k_blocks) {
        if (b < 0 || b >= q_.tp) return Error(i, "K block " + std::to_string(b) + " outside tp");
        if (b != q_.rank && !HasRows(cols_after_[i][b], r)) {
          return Error(i, "multiplies rows " + RangeString(r) + " by K block " + std::to_string(b) +
                              " before that rank's columns are pulled");
        }
        for (int64_t row = r.begin; row < r.end; ++row) ++block_products_[row * q_.tp + b];
      }
      if (s.add_to_output != HasRows(written_after_[i], r)) {
        return Error(i, s.add_to_output
                            ? "adds to rows " + RangeString(r) + " before they are written"
                            : "writes rows " + RangeString(r) + " that an earlier GEMM wrote");
      }
      if (!s.add_to_output) {
        for (int64_t row = r.begin; row < r.end; ++row) ++final_rows_[row];
      }
      AddRows(written_after_[i], r);
    }
    return Status::Ok();
  }

  Status Step(int i) {
    const PlanStep& s = plan_.steps[i];
    switch (s.kind) {
      case StepKind::kAllGather:
      case StepKind::kReduceScatter:
      case StepKind::kPullGather:
      case StepKind::kPullReduce:
        return Collective(i);
      case StepKind::kSendRecv:
      case StepKind::kPullRing:
        return Exchange(i);
      case StepKind::kSum:
        return Sum(i);
      case StepKind::kGemm:
        return Gemm(i);
      case StepKind::kPullColumns:
        if (!q_.full_weight) return Error(i, "pull_columns without full_weight");
        for (const PlanMessage& mm : s.pulls) AddRows(cols_after_[i][mm.peer], mm.rows);
        return Status::Ok();
    }
    return Error(i, "unknown step kind");
  }

  Status Finish() const {
    for (const auto& [key, at] : awaited_) {
      if (!done_.count(key)) {
        return Error(at.first, "never sends the `done` for message " + std::to_string(key.second) +
                                   " of rank " + std::to_string(key.first));
      }
    }
    if (q_.full_weight) {
      for (int64_t row = own_.begin; row < own_.end; ++row) {
        for (int b = 0; b < q_.tp; ++b) {
          if (block_products_[row * q_.tp + b] != 1) {
            return Error(-1, "row " + std::to_string(row) + " is multiplied by K block " +
                                 std::to_string(b) + " " +
                                 std::to_string(block_products_[row * q_.tp + b]) +
                                 " times, not once");
          }
        }
      }
    } else {
      for (size_t row = 0; row < m_; ++row) {
        if (produced_[row] != 1) {
          return Error(-1, std::string(ag_ ? "output" : "partial") + " row " + std::to_string(row) +
                               " is computed " + std::to_string(produced_[row]) +
                               " times, not once");
        }
      }
    }
    if (ag_) return Status::Ok();
    for (int64_t row = own_.begin; row < own_.end; ++row) {
      if (final_rows_[row] != 1) {
        return Error(-1, "output row " + std::to_string(row) + " is written " +
                             std::to_string(final_rows_[row]) + " times, not once");
      }
    }
    return Status::Ok();
  }

  const OverlapPlan& plan_;
  const PlanRequest& q_;
  const size_t m_;
  const RowRange own_;
  const bool ag_;
  const size_t n_;
  std::vector<RowSet> have_after_, recv_after_, written_after_;
  std::vector<std::vector<RowSet>> cols_after_;  // [step][K block]
  std::vector<std::vector<bool>> ancestors_;
  std::vector<int> produced_, final_rows_, block_products_;
  std::vector<int> next_to_, next_from_;
  std::map<MessageKey, std::pair<int, RowRange>> awaited_;  // step that awaited it, its rows
  std::map<MessageKey, std::vector<int>> pulled_by_;
  std::map<MessageKey, int> in_place_reads_;  // by_reference ring pulls: the step that waited
  std::map<MessageKey, int> done_;
};

bool SameRows(const PlanStep& a, const PlanStep& b) { return a.kind == b.kind && a.rows == b.rows; }

bool SameRequest(const PlanRequest& a, const PlanRequest& b) {
  return a.tp == b.tp && a.m == b.m && a.op == b.op && a.mode == b.mode && a.chunks == b.chunks &&
         a.defer_last_sum == b.defer_last_sum && a.copy_engine == b.copy_engine &&
         a.in_place == b.in_place && a.full_weight == b.full_weight;
}

}  // namespace

Status ValidatePlan(const OverlapPlan& plan) { return PlanChecker(plan).Run(); }

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
  // (src, dst) -> copy-engine messages offered by src / awaited by dst, in order.
  std::map<std::pair<int, int>, std::vector<std::pair<int, RowRange>>> offered, awaited;
  for (int r = 0; r < tp; ++r) {
    const OverlapPlan& p = plans[r];
    if (p.request.rank != r || !SameRequest(p.request, plans[0].request)) {
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
      for (const PlanMessage& mm : s.ready_to) offered[{r, mm.peer}].push_back({mm.msg, mm.rows});
      for (const PlanMessage& mm : s.ready_from) awaited[{mm.peer, r}].push_back({mm.msg, mm.rows});
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
  if (offered != awaited) {
    for (const auto& [pair, msgs] : offered) {
      auto it = awaited.find(pair);
      if (it == awaited.end() || it->second != msgs) {
        return InternalError("plan group: copy-engine messages offered by rank " +
                             std::to_string(pair.first) + " to rank " +
                             std::to_string(pair.second) + " do not match what that rank awaits");
      }
    }
    return InternalError("plan group: a rank awaits a copy-engine message that nobody offers");
  }
  return Status::Ok();
}

namespace {

void DescribeMessages(std::ostringstream& os, const char* what,
                      const std::vector<PlanMessage>& msgs) {
  if (msgs.empty()) return;
  os << what;
  for (const PlanMessage& mm : msgs) {
    os << " " << mm.peer << "#" << mm.msg << RangeString(mm.rows);
  }
  os << " ";
}

}  // namespace

std::string DescribePlan(const OverlapPlan& plan) {
  const PlanRequest& q = plan.request;
  std::ostringstream os;
  os << OverlapOpName(q.op) << " mode=" << OverlapModeName(q.mode) << " tp=" << q.tp
     << " rank=" << q.rank << " m=" << q.m << " chunks=" << q.chunks
     << (q.defer_last_sum ? " defer_last_sum" : "") << (q.copy_engine ? " copy_engine" : "")
     << (q.in_place ? " in_place" : "") << (q.full_weight ? " full_weight" : "")
     << " steps=" << plan.steps.size() << " max_step_rows=" << plan.max_step_rows << "\n";
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const PlanStep& s = plan.steps[i];
    os << "  " << i << "\t" << (s.stream == StepStream::kComm ? "comm   " : "compute") << "\t"
       << StepKindName(s.kind) << "\tchunk " << s.chunk << "\t";
    if (s.kind == StepKind::kSendRecv || s.kind == StepKind::kPullRing) {
      if (s.send_peer >= 0)
        os << "send " << RangeString(s.send_rows) << " -> " << s.send_peer << " ";
      if (s.recv_peer >= 0)
        os << "recv " << RangeString(s.recv_rows) << " <- " << s.recv_peer << " ";
    } else {
      const bool per_rank =
          s.kind != StepKind::kGemm && s.kind != StepKind::kSum && s.kind != StepKind::kPullColumns;
      for (size_t k = 0; k < s.rows.size(); ++k) {
        if (per_rank) os << "r" << k << ":";
        os << RangeString(s.rows[k]) << " ";
      }
    }
    if (!s.k_blocks.empty()) {
      os << "k_blocks";
      for (int b : s.k_blocks) os << " " << b;
      os << " ";
    }
    if (s.add_to_output) os << "+out ";
    if (s.accumulate) os << "+recv ";
    if (s.final_output) os << "final ";
    DescribeMessages(os, "ready_to", s.ready_to);
    DescribeMessages(os, "ready_from", s.ready_from);
    DescribeMessages(os, s.by_reference ? "reads" : "pulls", s.pulls);
    DescribeMessages(os, "done_to", s.done_to);
    if (!s.deps.empty()) {
      os << "deps";
      for (int d : s.deps) os << " " << d;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace tpserve
