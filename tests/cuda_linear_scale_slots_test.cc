// A fine FP8 scale scheme (per token, per 1x128 group) at tp > 1 or with chunks: every GEMM of
// CudaLinear reads its rows' activation scales from a scale slot (layers/scale_slots.h), and an
// AllGather layer's transfers bring each peer's slots with its rows. This test takes the steps
// that BuildPreparedSteps makes for every rank (host only, no GPU) to a symbolic machine whose
// scale slots hold "the scales of rows [a, b)": the scatter fills the slots Run fills first,
// NCCL AllGathers and SendRecvs (paired in order) and copy-engine pulls move slots between
// ranks, and each GEMM must find, in the slot it reads, the scales of exactly the rows it
// computes. Modes whose GEMMs add into C (cuBLASLt takes per-row scales with beta 0 only) must
// be refused naming the scheme.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "layers/cuda_linear_steps.h"
#include "layers/linear_knobs.h"
#include "layers/overlap_plan.h"
#include "layers/scale_slots.h"

namespace tpserve {
namespace {

using cuda_linear_detail::BufRef;
using cuda_linear_detail::CommCall;
using cuda_linear_detail::GemmCall;
using cuda_linear_detail::Prepared;
using cuda_linear_detail::PreparedStep;
using cuda_linear_detail::StepsInput;

alignas(16) const float kUnitScales[8] = {1, 1, 1, 1, 1, 1, 1, 1};

struct Mode {
  OverlapMode mode;
  int chunks;
  bool copy_engine;
};

// Each rank's scale slots by byte offset: whose rows' scales they hold.
using Slots = std::map<size_t, RowRange>;

StepsInput Input(OverlapOp op, GemmScaleScheme scheme, const Mode& mode, int tp, int rank,
                 int64_t m) {
  StepsInput in;
  in.name = "fine";
  in.shape.op = op;
  in.shape.max_m = 5000;
  in.shape.n = 256;
  in.shape.k = 512;
  in.shape.scale_scheme = scheme;
  in.knobs.mode = mode.mode;
  in.knobs.chunks = mode.chunks;
  in.knobs.copy_engine = mode.copy_engine;
  in.tp = tp;
  in.rank = rank;
  in.m = m;
  in.unit_scales = kUnitScales;
  in.signal_slots = 64;
  return in;
}

// Where a GEMM's rows start: an AllGather layer writes global rows of y, a GEMM+RS layer
// reads global rows of its input.
int64_t GemmFirstRow(const GemmCall& g, const CudaLinearShape& shape) {
  if (shape.op == OverlapOp::kAllGatherGemm) return g.d.offset / (shape.n * 2);
  return g.a.offset / shape.k;  // FP8: one byte per element
}

// One case: every rank's steps, run together on the symbolic slots.
void RunCase(OverlapOp op, GemmScaleScheme scheme, const Mode& mode, int tp, int64_t m) {
  const int64_t groups = scheme == GemmScaleScheme::kBlockwise ? 512 / 128 : 1;
  const bool ag = op == OverlapOp::kAllGatherGemm;
  std::vector<Prepared> preps;
  for (int r = 0; r < tp; ++r) {
    const StepsInput in = Input(op, scheme, mode, tp, r, m);
    auto plan = MakeOverlapPlan(cuda_linear_detail::LayerPlanRequest(in));
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    bool accumulates = false;
    for (const PlanStep& s : plan->steps) accumulates = accumulates || s.accumulate;
    StatusOr<Prepared> prep = cuda_linear_detail::BuildPreparedSteps(in, *plan);
    if (accumulates) {
      ASSERT_EQ(prep.status().code(), StatusCode::kUnimplemented) << "rank " << r;
      EXPECT_NE(prep.status().message().find(std::string(GemmScaleSchemeName(scheme))),
                std::string::npos)
          << prep.status().ToString();
      return;
    }
    ASSERT_TRUE(prep.ok()) << "rank " << r << ": " << prep.status().ToString();
    ASSERT_TRUE(prep->scatter_scales);
    EXPECT_EQ(prep->scale_groups, groups);
    EXPECT_EQ(prep->scale_pitch, ScaleSlotPitch(m, tp, mode.chunks, groups));
    EXPECT_EQ(prep->scale_only_shard, ag ? r : -1);
    preps.push_back(std::move(*prep));
  }
  // What Run's scatter writes before the first step.
  const int64_t pitch = preps[0].scale_pitch;
  std::vector<Slots> slots(tp);
  for (int r = 0; r < tp; ++r) {
    for (int p = 0; p < tp; ++p) {
      if (ag && p != r) continue;
      for (int c = 0; c < mode.chunks; ++c) {
        const RowRange rows = ChunkRows(ShardRows(m, tp, p), mode.chunks, c);
        if (!rows.empty()) slots[r][ScaleSlotOffset(tp, p, c, pitch) * 4] = rows;
      }
    }
  }
  auto holds = [&](int r, size_t offset) {
    auto it = slots[r].find(offset);
    return it == slots[r].end() ? RowRange{} : it->second;
  };
  // Each rank's NCCL collectives of one kind pair up in order (ValidatePlanGroup).
  std::vector<std::vector<const CommCall*>> gathers(tp), exchanges(tp);
  for (int r = 0; r < tp; ++r) {
    for (const PreparedStep& ps : preps[r].steps) {
      if (!ps.comm.scales) continue;
      // Every side names a scale buffer, an empty one too (NCCL gets a real pointer).
      EXPECT_EQ(ps.comm.scale_send.base, BufRef::kScales);
      EXPECT_EQ(ps.comm.scale_recv.base, BufRef::kScales);
      (ps.comm.kind == StepKind::kAllGather ? gathers : exchanges)[r].push_back(&ps.comm);
    }
  }
  for (int r = 1; r < tp; ++r) ASSERT_EQ(gathers[r].size(), gathers[0].size());
  // A receive from q pairs with q's send to this rank of the same order, as NCCL pairs them.
  auto matching_send = [&](int r, size_t j) -> const CommCall* {
    const int q = exchanges[r][j]->recv_peer;
    int nth = 0;
    for (size_t i = 0; i < j; ++i) nth += exchanges[r][i]->recv_peer == q;
    for (const CommCall* c : exchanges[q]) {
      if (c->send_peer == r && nth-- == 0) return c;
    }
    return nullptr;
  };
  // Slots are written once per Run, so moving every transfer's rows until nothing changes
  // leaves each slot with what it holds when its GEMM reads it (the transfers' order is the
  // rows' own: the same steps and signals).
  for (bool changed = true; changed;) {
    changed = false;
    auto put = [&](int r, size_t offset, RowRange rows) {
      if (rows.empty()) return;
      RowRange& at = slots[r][offset];
      if (at.empty()) {
        at = rows;
        changed = true;
      }
      EXPECT_EQ(at, rows) << "rank " << r << " slot " << offset << " written twice";
    };
    for (int r = 0; r < tp; ++r) {
      for (size_t j = 0; j < gathers[r].size(); ++j) {
        const CommCall& c = *gathers[r][j];
        // In place: this rank's slot is its part of the gathered ones.
        EXPECT_EQ(c.scale_send.offset, c.scale_recv.offset + r * c.scale_send_bytes);
        for (int k = 0; k < tp; ++k) {
          const CommCall& theirs = *gathers[k][j];
          ASSERT_EQ(theirs.scale_send_bytes, c.scale_send_bytes);
          put(r, c.scale_recv.offset + k * c.scale_send_bytes, holds(k, theirs.scale_send.offset));
        }
      }
      for (size_t j = 0; j < exchanges[r].size(); ++j) {
        const CommCall& c = *exchanges[r][j];
        if (c.recv_peer < 0) continue;
        const CommCall* theirs = matching_send(r, j);
        if (c.scale_recv_bytes == 0) {  // an empty message: its buffer is never written
          ASSERT_NE(theirs, nullptr);
          EXPECT_EQ(theirs->scale_send_bytes, 0u);
          continue;
        }
        ASSERT_NE(theirs, nullptr)
            << "rank " << r << " receives from " << c.recv_peer << ", which sends it nothing";
        ASSERT_EQ(theirs->scale_send_bytes, c.scale_recv_bytes);
        put(r, c.scale_recv.offset, holds(c.recv_peer, theirs->scale_send.offset));
      }
      for (const PreparedStep& ps : preps[r].steps) {
        for (const CommCall::Pull& pull : ps.comm.pulls) {
          if (pull.src.base != BufRef::kScales) continue;
          ASSERT_EQ(pull.dst.base, BufRef::kScales);
          put(r, pull.dst.offset, holds(pull.peer, pull.src.offset));
        }
      }
    }
  }
  std::vector<std::map<int64_t, int>> computed(tp);  // first row -> GEMMs over it, per rank
  for (int r = 0; r < tp; ++r) {
    for (size_t j = 0; j < exchanges[r].size(); ++j) {
      const CommCall& c = *exchanges[r][j];
      if (c.recv_peer < 0 || c.scale_recv_bytes == 0) continue;
      EXPECT_EQ(c.scale_recv.base, BufRef::kScales);
      const RowRange rows = holds(c.recv_peer, matching_send(r, j)->scale_send.offset);
      EXPECT_EQ(static_cast<size_t>(rows.size() * groups * 4), c.scale_recv_bytes);
    }
    const CudaLinearShape shape = Input(op, scheme, mode, tp, r, m).shape;
    for (size_t i = 0; i < preps[r].steps.size(); ++i) {
      SCOPED_TRACE("rank " + std::to_string(r) + " step " + std::to_string(i));
      const PreparedStep& ps = preps[r].steps[i];
      for (const CommCall::Pull& pull : ps.comm.pulls) {
        if (pull.src.base != BufRef::kScales) continue;
        const RowRange rows = holds(pull.peer, pull.src.offset);
        EXPECT_FALSE(rows.empty()) << "a pull from a slot rank " << pull.peer << " never fills";
        EXPECT_EQ(static_cast<size_t>(rows.size() * groups * 4), pull.bytes);
      }
      for (const GemmCall& g : ps.gemms) {
        ASSERT_EQ(g.a_scale.base, BufRef::kScales);
        EXPECT_EQ(g.a_scale.offset % 16, 0u);
        const RowRange got = holds(r, g.a_scale.offset);
        EXPECT_EQ(got.size(), g.params.m) << "slot " << g.a_scale.offset;
        EXPECT_EQ(got.begin, GemmFirstRow(g, shape)) << "slot " << g.a_scale.offset;
        ++computed[r][got.begin];
      }
    }
  }
  // Every rank computed each (shard, chunk) of its rows once: all of them for an AllGather
  // layer, every chunk of m for a GEMM+RS layer's partials.
  for (int r = 0; r < tp; ++r) {
    std::map<int64_t, int> want;
    for (int p = 0; p < tp; ++p) {
      for (int c = 0; c < mode.chunks; ++c) {
        const RowRange rows = ChunkRows(ShardRows(m, tp, p), mode.chunks, c);
        if (!rows.empty()) ++want[rows.begin];
      }
    }
    EXPECT_EQ(computed[r], want) << "rank " << r;
  }
}

TEST(CudaLinearScaleSlots, EveryGemmReadsTheScalesOfItsOwnRows) {
  const Mode kModes[] = {
      {OverlapMode::kNone, 1, false},     {OverlapMode::kPipeline, 2, false},
      {OverlapMode::kPipeline, 4, false}, {OverlapMode::kRing, 1, false},
      {OverlapMode::kRing, 2, false},     {OverlapMode::kNone, 1, true},
      {OverlapMode::kPipeline, 2, true},  {OverlapMode::kPipeline, 4, true},
      {OverlapMode::kRing, 1, true},      {OverlapMode::kRing, 2, true},
  };
  for (OverlapOp op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
    for (GemmScaleScheme scheme :
         {GemmScaleScheme::kPerTokenChannel, GemmScaleScheme::kBlockwise}) {
      for (const Mode& mode : kModes) {
        for (int tp : {1, 2, 3, 4}) {
          if (tp == 1 && (mode.chunks == 1 || mode.copy_engine)) continue;
          for (int64_t m : {int64_t{1}, int64_t{5}, int64_t{37}, int64_t{1000}, int64_t{4099}}) {
            SCOPED_TRACE(std::string(OverlapOpName(op)) + " " +
                         std::string(GemmScaleSchemeName(scheme)) + " " +
                         std::string(OverlapModeName(mode.mode)) + " chunks " +
                         std::to_string(mode.chunks) + (mode.copy_engine ? " ce" : "") + " tp " +
                         std::to_string(tp) + " m " + std::to_string(m));
            RunCase(op, scheme, mode, tp, m);
          }
        }
      }
    }
  }
}

// The shipped TP = 2 configuration's modes run with fine scales: an AllGather ring and a
// GEMM+RS one-chunk ring on copy engines (its last sum deferred, so no GEMM adds into C).
TEST(CudaLinearScaleSlots, ShippedCopyEngineRingsRunAtTp2AndAccumulatingRingsAreRefused) {
  for (OverlapOp op : {OverlapOp::kAllGatherGemm, OverlapOp::kGemmReduceScatter}) {
    const StepsInput in =
        Input(op, GemmScaleScheme::kPerTokenChannel, {OverlapMode::kRing, 1, true}, 2, 0, 4099);
    auto plan = MakeOverlapPlan(cuda_linear_detail::LayerPlanRequest(in));
    ASSERT_TRUE(plan.ok());
    EXPECT_TRUE(cuda_linear_detail::BuildPreparedSteps(in, *plan).ok())
        << std::string(OverlapOpName(op));
  }
  const StepsInput nccl_ring = Input(OverlapOp::kGemmReduceScatter, GemmScaleScheme::kBlockwise,
                                     {OverlapMode::kRing, 1, false}, 2, 1, 4096);
  auto plan = MakeOverlapPlan(cuda_linear_detail::LayerPlanRequest(nccl_ring));
  ASSERT_TRUE(plan.ok());
  const Status refused = cuda_linear_detail::BuildPreparedSteps(nccl_ring, *plan).status();
  EXPECT_EQ(refused.code(), StatusCode::kUnimplemented);
  EXPECT_NE(refused.message().find("layer fine: scale_scheme blockwise"), std::string::npos)
      << refused.ToString();
  EXPECT_NE(refused.message().find("adds into C"), std::string::npos) << refused.ToString();
}

// Fine schemes: fp8 only, never with full_weight; blockwise needs 128-multiples and no
// fast_accum. Each refusal names the layer.
TEST(CudaLinearScaleSlots, SchemeChecksNameTheLayer) {
  CudaLinearShape shape;
  shape.op = OverlapOp::kGemmReduceScatter;
  shape.n = 256;
  shape.k = 512;
  shape.scale_scheme = GemmScaleScheme::kPerTokenChannel;
  LinearKnobs knobs;
  EXPECT_TRUE(cuda_linear_detail::CheckScaleScheme("layer x", shape, knobs).ok());
  knobs.copy_engine = true;
  knobs.full_weight = true;
  const Status fw = cuda_linear_detail::CheckScaleScheme("layer x", shape, knobs);
  EXPECT_EQ(fw.code(), StatusCode::kUnimplemented);
  EXPECT_NE(fw.message().find("layer x: scale_scheme per_token_channel"), std::string::npos)
      << fw.ToString();
  knobs = LinearKnobs{};
  shape.dtype = DataType::kBFloat16;
  EXPECT_EQ(cuda_linear_detail::CheckScaleScheme("layer x", shape, knobs).code(),
            StatusCode::kInvalidArgument);
  shape.dtype = DataType::kFloat8E4M3;
  shape.scale_scheme = GemmScaleScheme::kBlockwise;
  shape.n = 200;
  EXPECT_EQ(cuda_linear_detail::CheckScaleScheme("layer x", shape, knobs).code(),
            StatusCode::kInvalidArgument);
  shape.n = 256;
  knobs.fast_accum = true;
  EXPECT_EQ(cuda_linear_detail::CheckScaleScheme("layer x", shape, knobs).code(),
            StatusCode::kInvalidArgument);
  // Per tensor, or without chunks at tp 1, no slots: the GEMM reads x_scale as it is.
  knobs = LinearKnobs{};
  EXPECT_FALSE(cuda_linear_detail::UsesScaleSlots(shape, knobs, 1));
  EXPECT_TRUE(cuda_linear_detail::UsesScaleSlots(shape, knobs, 2));
  shape.scale_scheme = GemmScaleScheme::kPerTensor;
  EXPECT_FALSE(cuda_linear_detail::UsesScaleSlots(shape, knobs, 2));
  EXPECT_EQ(cuda_linear_detail::ScaleSlotsFloats(shape, knobs, 2), 0);
}

}  // namespace
}  // namespace tpserve
