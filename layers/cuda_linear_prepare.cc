// BuildPreparedSteps: one M's steps of a CudaLinear, derived on the host from its OverlapPlan.
#include "layers/cuda_linear_steps.h"

#include <algorithm>
#include <utility>

#include "layers/scale_slots.h"

namespace tpserve::cuda_linear_detail {
namespace {

// Scale columns per row of X: k / 128 for blockwise, else 1.
int64_t ScaleGroups(const CudaLinearShape& shape) {
  return shape.scale_scheme == GemmScaleScheme::kBlockwise ? shape.k / kGemmScaleBlock : 1;
}

// One BuildPreparedSteps call: the layer's facts, the plan, and the steps built so far.
class StepBuilder {
 public:
  StepBuilder(const StepsInput& in, const OverlapPlan& plan);
  StatusOr<Prepared> Build();

 private:
  GemmCall Single(int64_t rows, BufRef a, BufRef d) const;
  template <typename AOf, typename DOf>
  std::vector<GemmCall> SlotGemms(const std::vector<RowRange>& rows, int64_t slot_rows,
                                  const AOf& a_of, const DOf& d_of) const;

  // full_weight: the plan's steps, each whole-K GEMM after a copy of the own columns.
  Status BuildFullWeight();
  Status AddColumnPulls(const PlanStep& s, bool packed);
  void AddWholeKGemm(RowRange rows, int64_t at_row, int comm_step);
  void AddLeadGemm(const PlanStep& s, std::vector<int> deps);

  // The plan's steps. Copy engine: message k between two ranks uses signal slot k.
  StatusOr<std::vector<PeerSignals::Flag>> Flags(const std::vector<PlanMessage>& msgs) const;
  Status Signals(CommCall& c, const PlanStep& s);
  Status PrepareAllGather(size_t i, int64_t slot_rows);
  Status PrepareReduceScatter(size_t i, int64_t slot_rows);
  Status PreparePeerReduceScatter(size_t i, int64_t slot_rows, BufRef dst);
  Status PrepareSendRecv(size_t i);
  Status PrepareGemm(size_t i);
  void PrepareSlotGemmsAllGather(size_t i);
  void PrepareSlotGemmsReduceScatter(size_t i);
  Status PrepareRangeGemm(size_t i, RowRange r);
  Status PrepareInPlaceGemm(size_t i, RowRange r, BufRef a, BufRef d);
  void PrepareSum(size_t i);
  Status AccumulateIntoY();
  // Scale slots (UsesScaleSlots): slot (shard, chunk), and the slot of `rows` (kNone for rows
  // that are no slot's).
  BufRef SlotRef(int shard, int chunk) const;
  BufRef ScaleSlot(RowRange rows) const;
  Status CheckScaleSlots() const;

  const std::string& name_;
  const CudaLinearShape& shape_;
  const LinearKnobs& knobs_;
  const int tp_, rank_;
  const int64_t m_;
  const bool in_place_;
  const int signal_slots_;
  const OverlapPlan& plan_;
  const bool ag_, ring_;
  const int64_t n_, k_;
  const size_t row_x_, row_y_;
  const RowRange own_;
  const bool ce_;             // copy-engine transfers
  const bool slots_;          // UsesScaleSlots
  const int64_t slot_pitch_;  // floats per scale slot
  GemmParams base_;
  Prepared prep_;
  // AG slot layout: where each AllGather step's slots start, and their rows.
  std::vector<size_t> region_;
  std::vector<int64_t> slot_rows_of_;
  size_t next_region_ = 0;
};

StepBuilder::StepBuilder(const StepsInput& in, const OverlapPlan& plan)
    : name_(in.name),
      shape_(in.shape),
      knobs_(in.knobs),
      tp_(in.tp),
      rank_(in.rank),
      m_(in.m),
      in_place_(in.in_place),
      signal_slots_(in.signal_slots),
      plan_(plan),
      ag_(in.shape.op == OverlapOp::kAllGatherGemm),
      ring_(in.knobs.mode == OverlapMode::kRing),
      n_(in.shape.n),
      k_(in.shape.k),
      row_x_(in.shape.k * DataTypeSize(in.shape.dtype)),
      row_y_(in.shape.n * sizeof(uint16_t)),
      own_(ShardRows(in.m, in.tp, in.rank)),
      ce_(plan.request.copy_engine),
      slots_(UsesScaleSlots(in.shape, in.knobs, in.tp)),
      slot_pitch_(slots_ ? ScaleSlotPitch(in.m, in.tp, in.knobs.chunks, ScaleGroups(in.shape)) : 0),
      region_(plan.steps.size(), 0),
      slot_rows_of_(plan.steps.size(), 0) {
  const bool fp8 = shape_.dtype == DataType::kFloat8E4M3;
  base_.n = n_;
  base_.k = k_;
  base_.a_type = base_.b_type = shape_.dtype;
  base_.d_type = DataType::kBFloat16;
  base_.fast_accum = fp8 && knobs_.fast_accum;
  base_.b_constant = true;  // B is the layer's weight (or its whole gathered copy), set at load
  if (fp8) base_.scale_scheme = shape_.scale_scheme;
  if (fp8) {
    base_.a_scale = in.unit_scales;
    base_.b_scale = in.unit_scales + 4;
  }
}

StatusOr<Prepared> StepBuilder::Build() {
  if (plan_.request.full_weight) {
    TP_RETURN_IF_ERROR(BuildFullWeight());
  } else {
    prep_.steps.resize(plan_.steps.size());
    for (size_t i = 0; i < plan_.steps.size(); ++i) {
      const PlanStep& s = plan_.steps[i];
      PreparedStep& ps = prep_.steps[i];
      ps.stream = s.stream;
      ps.deps = s.deps;
      ps.is_gemm = s.kind == StepKind::kGemm;
      int64_t slot_rows = 0;
      for (RowRange r : s.rows) slot_rows = std::max(slot_rows, r.size());
      switch (s.kind) {
        case StepKind::kAllGather:
        case StepKind::kPullGather:
          TP_RETURN_IF_ERROR(PrepareAllGather(i, slot_rows));
          break;
        case StepKind::kReduceScatter:
        case StepKind::kPullReduce:
          TP_RETURN_IF_ERROR(PrepareReduceScatter(i, slot_rows));
          break;
        case StepKind::kSendRecv:
        case StepKind::kPullRing:
          TP_RETURN_IF_ERROR(PrepareSendRecv(i));
          break;
        case StepKind::kPullColumns:
          return InternalError("layer " + name_ + ": pull_columns in a plan without full_weight");
        case StepKind::kGemm:
          TP_RETURN_IF_ERROR(PrepareGemm(i));
          break;
        case StepKind::kSum:
          PrepareSum(i);
          break;
      }
    }
  }
  if (shape_.accumulate) TP_RETURN_IF_ERROR(AccumulateIntoY());
  if (slots_) {
    TP_RETURN_IF_ERROR(CheckScaleSlots());
    prep_.scatter_scales = true;
    prep_.scale_groups = ScaleGroups(shape_);
    prep_.scale_pitch = slot_pitch_;
    prep_.scale_only_shard = ag_ ? rank_ : -1;
  }
  return std::move(prep_);
}

BufRef StepBuilder::SlotRef(int shard, int chunk) const {
  return {BufRef::kScales,
          static_cast<size_t>(ScaleSlotOffset(tp_, shard, chunk, slot_pitch_)) * sizeof(float)};
}

BufRef StepBuilder::ScaleSlot(RowRange rows) const {
  if (rows.empty()) return {};
  for (int p = 0; p < tp_; ++p) {
    const RowRange shard = ShardRows(m_, tp_, p);
    if (rows.begin < shard.begin || rows.end > shard.end) continue;
    for (int c = 0; c < knobs_.chunks; ++c) {
      if (ChunkRows(shard, knobs_.chunks, c) == rows) return SlotRef(p, c);
    }
  }
  return {};
}

// Every GEMM reads its scales from a slot, and none adds into C: cuBLASLt takes per-row and
// per-group scales with beta 0 only.
Status StepBuilder::CheckScaleSlots() const {
  for (size_t i = 0; i < prep_.steps.size(); ++i) {
    for (const GemmCall& g : prep_.steps[i].gemms) {
      if (g.params.beta != 0.0f || g.c.base != BufRef::kNone) {
        return UnimplementedError(
            "layer " + name_ + ": scale_scheme " +
            std::string(GemmScaleSchemeName(shape_.scale_scheme)) + " with " + knobs_.ToString() +
            " at tp " + std::to_string(tp_) + ": step " + std::to_string(i) +
            "'s GEMM adds into C, which cuBLASLt does with per-tensor scales only (modes "
            "without accumulating GEMMs: none, pipeline, and on copy engines a one-chunk ring "
            "at tp 2, not in_place)");
      }
      if (g.a_scale.base != BufRef::kScales) {
        return InternalError("layer " + name_ + ": step " + std::to_string(i) +
                             "'s GEMM has no scale slot");
      }
    }
  }
  return Status::Ok();
}

// CudaLinearShape::accumulate: each GEMM that writes a part of y reads it as its C too; one
// that already adds into its own D there (full_weight's ring at tp 1, after its lead) stays.
Status StepBuilder::AccumulateIntoY() {
  for (size_t i = 0; i < prep_.steps.size(); ++i) {
    PreparedStep& ps = prep_.steps[i];
    if (!ps.is_gemm) {
      return InternalError("layer " + name_ + ": accumulate with a communication step (" +
                           std::to_string(i) + ")");
    }
    for (GemmCall& call : ps.gemms) {
      const bool into_y = call.d.base == BufRef::kY && call.d.peer < 0;
      const bool adds_to_d = call.c.base == call.d.base && call.c.offset == call.d.offset &&
                             call.c.peer == call.d.peer;
      if (!into_y || (call.params.beta != 0.0f && !adds_to_d)) {
        return InternalError("layer " + name_ + ": accumulate with a GEMM (step " +
                             std::to_string(i) + ") that does not write y alone");
      }
      call.c = call.d;
      call.params.beta = 1.0f;
    }
  }
  return Status::Ok();
}

GemmCall StepBuilder::Single(int64_t rows, BufRef a, BufRef d) const {
  GemmCall g;
  g.params = base_;
  g.params.m = rows;
  g.a = a;
  g.d = d;
  return g;
}

// GEMMs over the per-rank slots of one chunk: one launch when the slots
// are full and evenly spaced on both sides, else one launch per slot.
template <typename AOf, typename DOf>
std::vector<GemmCall> StepBuilder::SlotGemms(const std::vector<RowRange>& rows, int64_t slot_rows,
                                             const AOf& a_of, const DOf& d_of) const {
  std::vector<GemmCall> calls;
  bool uniform = static_cast<int>(rows.size()) == tp_;
  // Scale slots: one GEMM per slot, each reading its own.
  uniform = uniform && !slots_;
  for (size_t s = 1; uniform && s < rows.size(); ++s) {
    uniform = rows[s].begin - rows[s - 1].begin == rows[1].begin - rows[0].begin;
  }
  for (size_t s = 0; uniform && s < rows.size(); ++s) uniform = rows[s].size() == slot_rows;
  if (uniform) {
    GemmCall g = Single(slot_rows, a_of(0), d_of(0));
    if (tp_ > 1) {
      const size_t a_step = a_of(1).offset - a_of(0).offset;
      const size_t d_step = d_of(1).offset - d_of(0).offset;
      if (a_step == slot_rows * row_x_ && d_step == slot_rows * row_y_) {
        g.params.m = slot_rows * tp_;  // contiguous on both sides: one plain GEMM
      } else {
        g.params.batch = tp_;
        g.params.stride_a = a_step / DataTypeSize(shape_.dtype);
        g.params.stride_d = d_step / sizeof(uint16_t);
      }
    }
    calls.push_back(g);
    return calls;
  }
  for (size_t s = 0; s < rows.size(); ++s) {
    if (rows[s].empty()) continue;
    calls.push_back(Single(rows[s].size(), a_of(s), d_of(s)));
    if (slots_) calls.back().a_scale = ScaleSlot(rows[s]);
  }
  return calls;
}

// No partial sums (PlanRequest::full_weight): this rank's rows over the whole K, their
// peers' input columns pulled into the gather buffer's column blocks ([shard rows, tp * k];
// the own columns copied into block `rank` on the copy stream, beside the pulls), except the
// ring's lead (its chunk-0 steps): pulled, 1D, into a packed staging area at the start of the
// gather buffer, one [lead, k] block per peer, and multiplied block by block.
Status StepBuilder::BuildFullWeight() {
  std::vector<int> at(plan_.steps.size(), -1);  // each plan step's prepared step
  auto mapped = [&](const std::vector<int>& deps) {
    std::vector<int> out;
    for (int d : deps) out.push_back(at.at(d));
    return out;
  };
  for (size_t i = 0; i < plan_.steps.size(); ++i) {
    const PlanStep& s = plan_.steps[i];
    const bool lead = ring_ && s.chunk == 0;
    if (s.kind == StepKind::kPullColumns) {
      TP_RETURN_IF_ERROR(AddColumnPulls(s, lead));
    } else if (s.kind != StepKind::kGemm || s.rows.size() != 1) {
      return InternalError("layer " + name_ + ": full_weight plan step " + std::to_string(i) +
                           " is a " + std::string(StepKindName(s.kind)));
    } else if (lead) {
      AddLeadGemm(s, mapped(s.deps));
    } else {
      const RowRange rows = s.rows[0];
      AddWholeKGemm(rows, rows.begin - own_.begin, s.deps.empty() ? -1 : at.at(s.deps[0]));
    }
    at[i] = static_cast<int>(prep_.steps.size()) - 1;
  }
  return Status::Ok();
}

// full_weight: a comm step with the plan step's signals and its pulls of each peer's columns
// of this rank's rows: 2D into the gather buffer's column blocks, or `packed` (the lead).
Status StepBuilder::AddColumnPulls(const PlanStep& s, bool packed) {
  const size_t row_g = tp_ * k_ * DataTypeSize(shape_.dtype);
  PreparedStep cs;
  cs.stream = StepStream::kComm;
  CommCall& c = cs.comm;
  c.copy_engine = true;
  TP_RETURN_IF_ERROR(Signals(c, s));
  for (size_t i = 0; i < s.pulls.size(); ++i) {
    const PlanMessage& mm = s.pulls[i];
    const BufRef src{BufRef::kInput, mm.rows.begin * row_x_};
    if (packed) {
      c.pulls.push_back(
          {mm.peer, src, {BufRef::kGather, i * mm.rows.size() * row_x_}, mm.rows.size() * row_x_});
    } else {
      const size_t at_row = mm.rows.begin - own_.begin;
      c.pulls.push_back({mm.peer,
                         src,
                         {BufRef::kGather, at_row * row_g + mm.peer * row_x_},
                         row_x_,
                         static_cast<size_t>(mm.rows.size()),
                         row_x_,
                         row_g});
    }
  }
  prep_.steps.push_back(std::move(cs));
  return Status::Ok();
}

// full_weight: the whole-K GEMM of `rows` (gather row `at_row` on), after `comm_step` (if any)
// and a copy of the own columns on the copy stream.
void StepBuilder::AddWholeKGemm(RowRange rows, int64_t at_row, int comm_step) {
  const int64_t kk = tp_ * k_;
  const size_t row_g = kk * DataTypeSize(shape_.dtype);
  PreparedStep gs;
  gs.is_gemm = true;
  if (comm_step >= 0) {
    PreparedStep own_copy;
    own_copy.on_copy_stream = true;
    CommCall& c = own_copy.comm;
    c.copy_engine = true;
    c.copy_src = {BufRef::kInput, rows.begin * row_x_};
    c.copy_dst = {BufRef::kGather, at_row * row_g + rank_ * row_x_};
    c.copy_bytes = row_x_;
    c.copy_height = rows.size();
    c.copy_src_pitch = row_x_;
    c.copy_dst_pitch = row_g;
    gs.deps = {comm_step, static_cast<int>(prep_.steps.size())};
    prep_.steps.push_back(std::move(own_copy));
    prep_.uses_copy_stream = true;
  }
  GemmCall call = Single(
      rows.size(),
      ce_ ? BufRef{BufRef::kGather, at_row * row_g} : BufRef{BufRef::kInput, rows.begin * row_x_},
      {BufRef::kY, (rows.begin - own_.begin) * row_y_});
  call.params.k = kk;
  gs.gemms.push_back(call);
  prep_.steps.push_back(std::move(gs));
}

// full_weight, the ring's lead: a GEMM of the own K block (its columns where the caller wrote
// them; no deps), or one that adds each peer's block from the packed staging area.
void StepBuilder::AddLeadGemm(const PlanStep& s, std::vector<int> deps) {
  const RowRange rows = s.rows[0];
  const BufRef y{BufRef::kY, (rows.begin - own_.begin) * row_y_};
  PreparedStep gs;
  gs.is_gemm = true;
  gs.deps = std::move(deps);
  for (size_t i = 0; i < s.k_blocks.size(); ++i) {
    const int b = s.k_blocks[i];
    GemmCall call = Single(rows.size(),
                           s.add_to_output ? BufRef{BufRef::kGather, i * rows.size() * row_x_}
                                           : BufRef{BufRef::kInput, rows.begin * row_x_},
                           y);
    if (s.add_to_output) {
      call.c = call.d;
      call.params.beta = 1.0f;
    }
    call.params.ldb = tp_ * k_;
    call.b_offset = b * row_x_;
    gs.gemms.push_back(call);
  }
  prep_.steps.push_back(std::move(gs));
}

StatusOr<std::vector<PeerSignals::Flag>> StepBuilder::Flags(
    const std::vector<PlanMessage>& msgs) const {
  std::vector<PeerSignals::Flag> out;
  for (const PlanMessage& mm : msgs) {
    if (mm.msg >= signal_slots_) {
      return InternalError("layer " + name_ + ": copy-engine plan for m=" + std::to_string(m_) +
                           " needs more than " + std::to_string(signal_slots_) +
                           " messages to/from rank " + std::to_string(mm.peer));
    }
    out.push_back({mm.peer, mm.msg});
  }
  return out;
}

// The plan step's signals: `ready` to the peers it offers messages to (whose `done` Run awaits
// at its end, in_place at the start of the next), `ready` awaited and `done` sent for the
// messages it takes.
Status StepBuilder::Signals(CommCall& c, const PlanStep& s) {
  TP_ASSIGN_OR_RETURN(c.ready_to, Flags(s.ready_to));
  TP_ASSIGN_OR_RETURN(c.ready_from, Flags(s.ready_from));
  TP_ASSIGN_OR_RETURN(c.done_to, Flags(s.done_to));
  prep_.done_from.insert(prep_.done_from.end(), c.ready_to.begin(), c.ready_to.end());
  return Status::Ok();
}

Status StepBuilder::PrepareAllGather(size_t i, int64_t slot_rows) {
  const PlanStep& s = plan_.steps[i];
  PreparedStep& ps = prep_.steps[i];
  region_[i] = next_region_;
  slot_rows_of_[i] = slot_rows;
  next_region_ += tp_ * slot_rows * row_x_;
  ps.comm.kind = StepKind::kAllGather;  // the copy-engine step of that shape too
  ps.comm.send = {BufRef::kInput, (s.rows[rank_].begin - own_.begin) * row_x_};
  ps.comm.recv = {BufRef::kGather, region_[i]};
  ps.comm.send_bytes = slot_rows * row_x_;
  // Scale slots of chunk s.chunk: rank p's at slot (p, chunk), consecutive over p.
  if (slots_ && !ce_) {
    ps.comm.scales = true;
    ps.comm.scale_send = SlotRef(rank_, s.chunk);
    ps.comm.scale_recv = SlotRef(0, s.chunk);
    ps.comm.scale_send_bytes = slot_pitch_ * sizeof(float);
  }
  if (s.kind != StepKind::kPullGather) return Status::Ok();
  // Copy engine: the own rows copied into their slot; each peer's pulled from its input.
  CommCall& c = ps.comm;
  c.copy_engine = true;
  c.copy_src = c.send;
  c.copy_dst = {BufRef::kGather, region_[i] + rank_ * slot_rows * row_x_};
  c.copy_bytes = s.rows[rank_].size() * row_x_;
  TP_RETURN_IF_ERROR(Signals(c, s));
  for (const PlanMessage& mm : s.pulls) {
    const int p = mm.peer;
    const size_t src = (mm.rows.begin - ShardRows(m_, tp_, p).begin) * row_x_;
    c.pulls.push_back({p,
                       {BufRef::kInput, src},
                       {BufRef::kGather, region_[i] + p * slot_rows * row_x_},
                       static_cast<size_t>(mm.rows.size()) * row_x_});
    if (slots_) {
      c.pulls.push_back({p, SlotRef(p, s.chunk), SlotRef(p, s.chunk),
                         static_cast<size_t>(mm.rows.size() * ScaleGroups(shape_)) * 4});
    }
  }
  return Status::Ok();
}

Status StepBuilder::PrepareReduceScatter(size_t i, int64_t slot_rows) {
  const PlanStep& s = plan_.steps[i];
  PreparedStep& ps = prep_.steps[i];
  const int g = s.deps.at(0);
  ps.comm.kind = StepKind::kReduceScatter;  // the copy-engine step of that shape too
  ps.comm.send = {BufRef::kPartial, region_[g]};
  ps.comm.send_bytes = slot_rows * n_;  // elements
  const RowRange mine = s.rows[rank_];
  const BufRef dst{BufRef::kY, (mine.begin - own_.begin) * row_y_};
  if (s.kind == StepKind::kPullReduce) return PreparePeerReduceScatter(i, slot_rows, dst);
  if (mine.size() == slot_rows) {
    ps.comm.recv = dst;
  } else {
    ps.comm.recv = {BufRef::kScratch, 0};
    if (!mine.empty()) {
      ps.comm.copy_src = {BufRef::kScratch, 0};
      ps.comm.copy_dst = dst;
      ps.comm.copy_bytes = mine.size() * row_y_;
    }
  }
  return Status::Ok();
}

// Copy engine: every peer's partial of this rank's rows (slot rank_ of the
// peer's region) is added to this rank's own. Pipelined, copy
// engines pull them while later chunks' GEMMs run, and the sum
// reads local copies; in mode none nothing runs alongside, so the
// sum kernel reads them over NVLink itself (one pass, no copy).
Status StepBuilder::PreparePeerReduceScatter(size_t i, int64_t slot_rows, BufRef dst) {
  const PlanStep& s = plan_.steps[i];
  const int g = s.deps.at(0);
  const RowRange mine = s.rows[rank_];
  CommCall& c = prep_.steps[i].comm;
  c.copy_engine = true;
  const bool direct = s.by_reference;
  const size_t slot_bytes = slot_rows * row_y_;
  TP_RETURN_IF_ERROR(Signals(c, s));
  for (const PlanMessage& mm : s.pulls) {
    if (direct) break;  // the sum kernel reads them where they are
    c.pulls.push_back({mm.peer,
                       {BufRef::kPartial, region_[g] + rank_ * slot_bytes},
                       {BufRef::kReceived, region_[g] + mm.peer * slot_bytes},
                       static_cast<size_t>(mm.rows.size()) * row_y_});
  }
  if (!mine.empty()) {
    c.sum = true;
    c.sum_args.direct = direct;
    c.sum_args.dst = dst;
    c.sum_args.count = mine.size() * n_;
    for (int p = 0; p < tp_; ++p) {
      if (p == rank_) {
        c.sum_args.slots.push_back({BufRef::kPartial, region_[g] + rank_ * slot_bytes});
      } else if (direct) {
        c.sum_args.slots.push_back({BufRef::kPartial, region_[g] + rank_ * slot_bytes, p});
      } else {
        c.sum_args.slots.push_back({BufRef::kReceived, region_[g] + p * slot_bytes});
      }
    }
  }
  return Status::Ok();
}

Status StepBuilder::PrepareSendRecv(size_t i) {
  const PlanStep& s = plan_.steps[i];
  PreparedStep& ps = prep_.steps[i];
  const size_t row = ag_ ? row_x_ : row_y_;
  const auto src = ag_ ? BufRef::kGather : BufRef::kPartial;
  const auto dst = ag_ ? BufRef::kGather : BufRef::kReceived;
  ps.comm.kind = StepKind::kSendRecv;  // the copy-engine step of that shape too
  ps.comm.send = {src, s.send_rows.begin * row};
  ps.comm.send_bytes = s.send_rows.size() * row;
  ps.comm.send_peer = s.send_peer;
  ps.comm.recv = {dst, s.recv_rows.begin * row};
  ps.comm.recv_bytes = s.recv_rows.size() * row;
  ps.comm.recv_peer = s.recv_peer;
  // An AllGather ring's rows bring their scale slots (a GEMM+RS ring sends partials only).
  const bool scales = slots_ && ag_;
  const size_t row_scales = static_cast<size_t>(ScaleGroups(shape_)) * 4;
  if (scales && !ce_) {
    // An empty side still names a buffer (its 0-byte message is posted, as the codes' is).
    auto slot_or_base = [&](RowRange r) {
      const BufRef slot = ScaleSlot(r);
      return slot.base == BufRef::kNone ? BufRef{BufRef::kScales, 0} : slot;
    };
    ps.comm.scales = true;
    ps.comm.scale_send = slot_or_base(s.send_rows);
    ps.comm.scale_send_bytes = s.send_rows.size() * row_scales;
    ps.comm.scale_recv = slot_or_base(s.recv_rows);
    ps.comm.scale_recv_bytes = s.recv_rows.size() * row_scales;
  }
  if (s.kind == StepKind::kPullRing) {
    CommCall& c = ps.comm;
    c.copy_engine = true;
    TP_RETURN_IF_ERROR(Signals(c, s));
    // The sender's copy of the same buffer holds the rows at the same offset (ring buffers are
    // indexed by global row). by_reference (in_place): read there by the GEMM, not pulled.
    for (const PlanMessage& mm : s.pulls) {
      if (s.by_reference) break;
      const BufRef at{dst, mm.rows.begin * row};
      c.pulls.push_back({mm.peer, {src, at.offset}, at, mm.rows.size() * row});
      if (scales) {
        const BufRef slot = ScaleSlot(mm.rows);
        c.pulls.push_back({mm.peer, slot, slot, mm.rows.size() * row_scales});
      }
    }
  }
  return Status::Ok();
}

Status StepBuilder::PrepareGemm(size_t i) {
  if (ag_ && !ring_ && tp_ > 1) {
    PrepareSlotGemmsAllGather(i);
  } else if (!ag_ && !ring_ && tp_ > 1) {
    PrepareSlotGemmsReduceScatter(i);
  } else {
    // Ring steps and tp = 1: each range is contiguous in global rows.
    for (RowRange r : plan_.steps[i].rows) TP_RETURN_IF_ERROR(PrepareRangeGemm(i, r));
  }
  return Status::Ok();
}

// AG, mode none / pipeline: rows come from the slots of the AllGather this GEMM waits for.
void StepBuilder::PrepareSlotGemmsAllGather(size_t i) {
  const PlanStep& s = plan_.steps[i];
  const int g = s.deps.at(0);
  const PlanStep& gather = plan_.steps[g];
  const int64_t srows = slot_rows_of_[g];
  auto slot_of = [&](size_t idx) {
    for (int r = 0; r < tp_; ++r) {
      if (gather.rows[r] == s.rows[idx]) return r;
    }
    return -1;
  };
  auto a_of = [&](size_t idx) {
    return BufRef{BufRef::kGather, region_[g] + slot_of(idx) * srows * row_x_};
  };
  auto d_of = [&](size_t idx) { return BufRef{BufRef::kY, s.rows[idx].begin * row_y_}; };
  prep_.steps[i].gemms = SlotGemms(s.rows, srows, a_of, d_of);
}

// RS, mode none / pipeline: partials go to the send slots of the ReduceScatter that follows.
void StepBuilder::PrepareSlotGemmsReduceScatter(size_t i) {
  const PlanStep& s = plan_.steps[i];
  region_[i] = next_region_;
  int64_t srows = 0;
  for (int r = 0; r < tp_; ++r) {
    srows = std::max(srows, ChunkRows(ShardRows(m_, tp_, r), knobs_.chunks, s.chunk).size());
  }
  next_region_ += tp_ * srows * row_y_;
  auto slot_of = [&](size_t idx) {
    for (int r = 0; r < tp_; ++r) {
      if (ChunkRows(ShardRows(m_, tp_, r), knobs_.chunks, s.chunk) == s.rows[idx]) return r;
    }
    return -1;
  };
  auto a_of = [&](size_t idx) { return BufRef{BufRef::kInput, s.rows[idx].begin * row_x_}; };
  auto d_of = [&](size_t idx) {
    return BufRef{BufRef::kPartial, region_[i] + slot_of(idx) * srows * row_y_};
  };
  prep_.steps[i].gemms = SlotGemms(s.rows, srows, a_of, d_of);
}

// A ring step's (or tp = 1's) GEMM of the global rows `r`.
Status StepBuilder::PrepareRangeGemm(size_t i, RowRange r) {
  const PlanStep& s = plan_.steps[i];
  BufRef a = ag_ ? BufRef{ring_ ? BufRef::kGather : BufRef::kInput,
                          (ring_ ? r.begin : r.begin - own_.begin) * row_x_}
                 : BufRef{BufRef::kInput, r.begin * row_x_};
  BufRef d;
  if (ag_) {
    d = {BufRef::kY, r.begin * row_y_};
  } else if (s.final_output) {
    d = {BufRef::kY, (r.begin - own_.begin) * row_y_};
  } else {
    d = {BufRef::kPartial, r.begin * row_y_};
  }
  if (in_place_ && s.accumulate) return PrepareInPlaceGemm(i, r, a, d);
  GemmCall call = Single(r.size(), a, d);
  if (slots_) call.a_scale = ScaleSlot(r);
  if (s.accumulate) {
    call.c = {BufRef::kReceived, r.begin * row_y_};
    call.params.beta = 1.0f;
  }
  prep_.steps[i].gemms.push_back(call);
  return Status::Ok();
}

// in_place_: C is the running sum in the sender's `partial` (the receive step this
// GEMM waits for says who sent it); that peer may reuse it after this GEMM.
Status StepBuilder::PrepareInPlaceGemm(size_t i, RowRange r, BufRef a, BufRef d) {
  const PlanStep& s = plan_.steps[i];
  PreparedStep& ps = prep_.steps[i];
  int recv_step = -1;
  for (int dep : s.deps) {
    if (plan_.steps[dep].kind == StepKind::kPullRing) recv_step = dep;
  }
  if (recv_step < 0 || plan_.steps[recv_step].recv_peer < 0 || s.done_to.empty()) {
    return InternalError("layer " + name_ + ": in_place GEMM step " + std::to_string(i) +
                         " has no receive step to read from, or owes its peer no `done`");
  }
  GemmCall call = Single(r.size(), a, d);
  call.c = {BufRef::kPartial, r.begin * row_y_, plan_.steps[recv_step].recv_peer};
  call.params.beta = 1.0f;
  ps.gemms.push_back(call);
  TP_ASSIGN_OR_RETURN(ps.done_to, Flags(s.done_to));  // the plan moved it here
  return Status::Ok();
}

// The plan's deferred last sum (PlanRequest::defer_last_sum, which LayerPlanRequest asks for
// on copy engines at one chunk): the GEMM before it computed this rank's own partial at once
// (into its rows of `partial`, which no peer reads) while the copy engine brought the running
// sum in; the layer's sum kernel adds the two into y. The last transfer then hides under the
// last GEMM instead of sitting between two GEMMs. With more chunks the accumulating GEMMs
// already overlap each chunk's transfer with the next chunk's GEMM, and the extra passes of
// the sums cost more than they hide. A sum of the whole own shard is the one RunSplit skips.
void StepBuilder::PrepareSum(size_t i) {
  const RowRange r = plan_.steps[i].rows.at(0);
  CommCall& c = prep_.steps[i].comm;
  c.kind = StepKind::kSum;
  c.copy_engine = true;  // no transfer of its own: the sum kernel alone
  c.sum = true;
  c.sum_args.slots = {{BufRef::kPartial, r.begin * row_y_}, {BufRef::kReceived, r.begin * row_y_}};
  c.sum_args.dst = {BufRef::kY, (r.begin - own_.begin) * row_y_};
  c.sum_args.count = r.size() * n_;
  if (r == own_) prep_.split_sum_step = static_cast<int>(i);
}

}  // namespace

bool UsesScaleSlots(const CudaLinearShape& shape, const LinearKnobs& knobs, int tp) {
  return shape.dtype == DataType::kFloat8E4M3 &&
         shape.scale_scheme != GemmScaleScheme::kPerTensor && (tp > 1 || knobs.chunks > 1);
}

int64_t ScaleSlotsFloats(const CudaLinearShape& shape, const LinearKnobs& knobs, int tp) {
  if (!UsesScaleSlots(shape, knobs, tp)) return 0;
  return static_cast<int64_t>(tp) * knobs.chunks *
         ScaleSlotPitch(shape.max_m, tp, knobs.chunks, ScaleGroups(shape));
}

Status CheckScaleScheme(const std::string& ctx, const CudaLinearShape& shape,
                        const LinearKnobs& knobs) {
  const GemmScaleScheme scheme = shape.scale_scheme;
  if (scheme == GemmScaleScheme::kPerTensor) return Status::Ok();
  const std::string name(GemmScaleSchemeName(scheme));
  if (shape.dtype != DataType::kFloat8E4M3) {
    return InvalidArgumentError(ctx + ": scale_scheme " + name + " needs fp8_e4m3, got " +
                                std::string(DataTypeName(shape.dtype)));
  }
  if (knobs.full_weight) {
    return UnimplementedError(ctx + ": scale_scheme " + name +
                              " does not run with full_weight (its whole-K GEMMs would need " +
                              "every rank's column scales of each row)");
  }
  if (scheme == GemmScaleScheme::kBlockwise) {
    if (shape.n % kGemmScaleBlock != 0 || shape.k % kGemmScaleBlock != 0) {
      return InvalidArgumentError(
          ctx + ": scale_scheme blockwise needs n and k multiples of 128, " +
          "got n=" + std::to_string(shape.n) + " k=" + std::to_string(shape.k));
    }
    if (knobs.fast_accum) {
      return InvalidArgumentError(ctx + ": scale_scheme blockwise runs without fast_accum " +
                                  "(cuBLASLt's blockwise FP8 GEMM has no fast accumulation)");
    }
  }
  return Status::Ok();
}

Status CheckAccumulate(const std::string& ctx, const CudaLinearShape& shape, int tp) {
  if (!shape.accumulate) return Status::Ok();
  if (shape.op != OverlapOp::kGemmReduceScatter || tp != 1) {
    return UnimplementedError(ctx + ": accumulate (y += X W^T) runs for gemm_rs at tp 1 (got " +
                              std::string(OverlapOpName(shape.op)) + " at tp " +
                              std::to_string(tp) + "): a ReduceScatter's output cannot add into y");
  }
  if (shape.dtype == DataType::kFloat8E4M3 && shape.scale_scheme != GemmScaleScheme::kPerTensor) {
    return UnimplementedError(ctx + ": accumulate (y += X W^T) with scale_scheme " +
                              std::string(GemmScaleSchemeName(shape.scale_scheme)) +
                              ": cuBLASLt adds into C with per-tensor scales only");
  }
  return Status::Ok();
}

PlanRequest LayerPlanRequest(const StepsInput& in) {
  // in.in_place is knobs.in_place on copy engines at tp > 1, which defer_last_sum needs anyway.
  return LinearPlanRequest(in.shape.op, in.knobs, in.tp, in.rank, in.m);
}

StatusOr<Prepared> BuildPreparedSteps(const StepsInput& in, const OverlapPlan& plan) {
  TP_RETURN_IF_ERROR(CheckAccumulate("layer " + in.name, in.shape, in.tp));
  if (!in.knobs.full_weight && plan.request.defer_last_sum != LayerPlanRequest(in).defer_last_sum) {
    return InternalError("layer " + in.name + ": its plan was not made by LayerPlanRequest (" +
                         "defer_last_sum " + (plan.request.defer_last_sum ? "on" : "off") + ")");
  }
  return StepBuilder(in, plan).Build();
}

}  // namespace tpserve::cuda_linear_detail
