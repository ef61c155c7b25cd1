// What CudaLinear enqueues, per mode, recorded: for every mode the tuner can emit (ag_gemm and
// gemm_rs; none / pipeline / ring; NCCL or copy engines; chunks 1, 2, 4; gemm_rs full_weight
// and in_place), at tp 2, 3, 4 and 8, every rank, and a few M values per tp (Grid), this test
// builds the steps that CudaLinear::Run maps to its launches (cuda_linear_detail::
// BuildPreparedSteps, host only: no GPU is touched) and writes them down. The recording must
// equal tests/data/cuda_linear_steps.golden, so that a refactor of the layer cannot change what
// runs without the change showing here; a difference fails the test with the cases that differ
// and their first differing lines (- golden, + now).
//
// A deliberate change of what the layer enqueues: rerun with TPSERVE_REGENERATE_GOLDEN=1 in the
// environment, which rewrites the golden file instead of comparing, and review its diff:
//   TPSERVE_REGENERATE_GOLDEN=1 build/bin/tpserve_unit_tests --gtest_filter='CudaLinearSteps.*'
//
// Format, one block per case:
//   case <op> <mode> chunks=<c> [copy_engine] [full_weight] [in_place] tp=<tp> rank=<r> m=<m>
//     (n=<local n> k=<local k>)
//   [  fork_second_stream] [split_sum_step=<i>] [wait_done_from=<flags>]   (what Run does around
//     the steps: fork and join the layer's second stream, its copy stream; the step RunSplit
//     skips; the `done` flags awaited, at the end of Run or, in_place, at the start of the next)
//   then one line per operation, in enqueue order, each "<step>[.<gemm>] <stream>" (main: the
//   caller's stream, second: the layer's copy stream, comm: its comm stream), then
//     gemm m=.. [n=.. k=.. where not the layer's] [other GemmParams where not the defaults]
//          a=<ref> [b_offset=<bytes into w>] [c=<ref>] d=<ref>
//     nccl <kind> send=<ref>/<bytes; ReduceScatter: elements per rank> [to=<peer>] recv=<ref>
//          [recv_bytes=..] [from=<peer>] [copy=<copy>]
//     ce [copy=<copy>] [ready_to=<flags>] [ready_from=<flags>] [pull=<peer>:<copy>]...
//          [sum[_direct]=<ref>,<ref>...><ref>/<elements>] [done_to=<flags>]
//   and at the end [after=<steps waited for>] [done_to=<flags signalled after a GEMM>].
//   <ref>: <buffer>+<byte offset>[@<peer whose copy it is>]; <copy>: <ref>><ref>/<bytes>, or
//   for a 2D copy <ref>><ref>/<bytes per row>*<rows>@<src pitch>,<dst pitch>; <flags>:
//   <peer>:<slot>, consecutive peers with one slot as <first>-<last>:<slot>, comma-separated.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "layers/cuda_linear_steps.h"
#include "layers/linear_knobs.h"
#include "layers/overlap_plan.h"
#include "tests/cuda_linear_test_modes.h"

namespace tpserve {
namespace {

using cuda_linear_detail::BufRef;
using cuda_linear_detail::CommCall;
using cuda_linear_detail::GemmCall;
using cuda_linear_detail::Prepared;
using cuda_linear_detail::PreparedStep;
using cuda_linear_detail::StepsInput;

std::string GoldenPath() {
  return std::string(TPSERVE_SOURCE_DIR) + "/tests/data/cuda_linear_steps.golden";
}

const char* BaseName(BufRef::Base b) {
  switch (b) {
    case BufRef::kNone:
      return "none";
    case BufRef::kInput:
      return "input";
    case BufRef::kGather:
      return "gather";
    case BufRef::kPartial:
      return "partial";
    case BufRef::kReceived:
      return "received";
    case BufRef::kScratch:
      return "scratch";
    case BufRef::kY:
      return "y";
    case BufRef::kScales:
      return "scales";
  }
  return "?";
}

std::string Ref(const BufRef& r) {
  std::string s = std::string(BaseName(r.base)) + "+" + std::to_string(r.offset);
  if (r.peer >= 0) s += "@" + std::to_string(r.peer);
  return s;
}

// Flags as peer:slot, runs of consecutive peers with one slot as first-last:slot, e.g.
// "0-2:0,4-7:0".
std::string Flags(const std::vector<PeerSignals::Flag>& flags) {
  std::string s;
  for (size_t i = 0; i < flags.size();) {
    size_t j = i;
    while (j + 1 < flags.size() && flags[j + 1].slot == flags[i].slot &&
           flags[j + 1].peer == flags[j].peer + 1) {
      ++j;
    }
    s += (s.empty() ? "" : ",") + std::to_string(flags[i].peer) +
         (j > i ? "-" + std::to_string(flags[j].peer) : "") + ":" + std::to_string(flags[i].slot);
    i = j + 1;
  }
  return s;
}

std::string Ints(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

const char* StreamName(const PreparedStep& ps) {
  switch (cuda_linear_detail::StreamKey(ps)) {
    case 0:
      return "main";
    case 1:
      return "second";
    case 2:
      return "comm";
  }
  return "?";
}

// Appends " key=value" when value differs from its default.
template <typename T>
void Opt(std::ostringstream& out, const char* key, T value, T default_value) {
  if (value != default_value) out << " " << key << "=" << value;
}

// One GEMM launch: m (n and k only where they differ from the layer's), the other parameters
// where they differ from GemmParams' defaults, and its operands. The scale pointers are checked
// (the layer's unit scales, which Run replaces), not printed; so is b_constant (always set).
std::string DescribeGemm(const GemmCall& g, const CudaLinearShape& shape, const float* unit) {
  const GemmParams& p = g.params;
  const GemmParams d;  // defaults
  std::ostringstream out;
  out << "gemm m=" << p.m;
  Opt(out, "n", p.n, shape.n);
  Opt(out, "k", p.k, shape.k);
  Opt(out, "batch", p.batch, d.batch);
  Opt(out, "stride_a", p.stride_a, d.stride_a);
  Opt(out, "stride_b", p.stride_b, d.stride_b);
  Opt(out, "stride_c", p.stride_c, d.stride_c);
  Opt(out, "stride_d", p.stride_d, d.stride_d);
  Opt(out, "lda", p.lda, d.lda);
  Opt(out, "ldb", p.ldb, d.ldb);
  Opt(out, "ldc", p.ldc, d.ldc);
  Opt(out, "ldd", p.ldd, d.ldd);
  Opt(out, "alpha", p.alpha, d.alpha);
  Opt(out, "beta", p.beta, d.beta);
  Opt(out, "fast_accum", p.fast_accum, d.fast_accum);
  if (p.a_type != shape.dtype || p.b_type != shape.dtype || p.d_type != d.d_type) {
    out << " types=" << DataTypeName(p.a_type) << "," << DataTypeName(p.b_type) << ","
        << DataTypeName(p.d_type);
  }
  if (p.scale_scheme != d.scale_scheme) out << " scales=" << GemmScaleSchemeName(p.scale_scheme);
  EXPECT_EQ(p.a_scale, unit);
  EXPECT_EQ(p.b_scale, unit + 4);
  EXPECT_EQ(p.d_quant_scale, nullptr);
  EXPECT_EQ(p.d_amax, nullptr);
  // B is always the layer's weight, set at load: the small-M kernel may read it early.
  EXPECT_TRUE(p.b_constant);
  out << " a=" << Ref(g.a);
  if (g.a_scale.base != BufRef::kNone) out << " a_scale=" << Ref(g.a_scale);
  Opt(out, "b_offset", g.b_offset, size_t{0});
  if (g.c.base != BufRef::kNone) out << " c=" << Ref(g.c);
  out << " d=" << Ref(g.d);
  return out.str();
}

// A copy of `bytes` bytes (height > 0: `height` rows of `bytes` at pitches src_pitch,
// dst_pitch): "src>dst/bytes" or "src>dst/bytes*height@src_pitch,dst_pitch".
std::string Copy(const BufRef& src, const BufRef& dst, size_t bytes, size_t height = 0,
                 size_t src_pitch = 0, size_t dst_pitch = 0) {
  std::string s = Ref(src) + ">" + Ref(dst) + "/" + std::to_string(bytes);
  if (height > 0) {
    s += "*" + std::to_string(height) + "@" + std::to_string(src_pitch) + "," +
         std::to_string(dst_pitch);
  }
  return s;
}

// One communication step as Run enqueues it. NCCL: the collective's kind, buffers, byte counts
// (ReduceScatter: elements per rank) and peers, and a copy after it. Copy engine ("ce"): what
// EnqueueCopyEngineStep does, in its order: a local copy, the ready flags signalled and waited
// for, the pulls (peer:src>dst/bytes), the sum (direct: reading the peers' memory), and the
// done flags signalled.
std::string DescribeComm(const CommCall& c) {
  std::ostringstream out;
  if (!c.copy_engine) {
    out << "nccl " << StepKindName(c.kind) << " send=" << Ref(c.send) << "/" << c.send_bytes;
    Opt(out, "to", c.send_peer, -1);
    out << " recv=" << Ref(c.recv);
    Opt(out, "recv_bytes", c.recv_bytes, size_t{0});
    Opt(out, "from", c.recv_peer, -1);
    if (c.copy_bytes > 0) out << " copy=" << Copy(c.copy_src, c.copy_dst, c.copy_bytes);
    if (c.scales) {
      out << " scales=" << Ref(c.scale_send) << "/" << c.scale_send_bytes << ">"
          << Ref(c.scale_recv) << "/" << c.scale_recv_bytes;
    }
    return out.str();
  }
  out << "ce";
  if (c.copy_bytes > 0) {
    out << " copy="
        << Copy(c.copy_src, c.copy_dst, c.copy_bytes, c.copy_height, c.copy_src_pitch,
                c.copy_dst_pitch);
  }
  if (!c.ready_to.empty()) out << " ready_to=" << Flags(c.ready_to);
  if (!c.ready_from.empty()) out << " ready_from=" << Flags(c.ready_from);
  for (const CommCall::Pull& p : c.pulls) {
    out << " pull=" << p.peer << ":"
        << Copy(p.src, p.dst, p.bytes, p.height, p.src_pitch, p.dst_pitch);
  }
  if (c.sum) {
    out << " sum" << (c.sum_args.direct ? "_direct" : "") << "=";
    for (size_t i = 0; i < c.sum_args.slots.size(); ++i) {
      out << (i ? "," : "") << Ref(c.sum_args.slots[i]);
    }
    out << ">" << Ref(c.sum_args.dst) << "/" << c.sum_args.count;
  }
  if (!c.done_to.empty()) out << " done_to=" << Flags(c.done_to);
  return out.str();
}

using Mode = TunerMode;

// The TP sizes and, per size, the M values recorded (every rank of each). The M values are
// chosen to reach the plans' edge cases within a golden file of a few hundred KB (a tp 8 case
// with every step costs 8 ranks' worth of long peer lists): 1 (decode: one rank has the row,
// the others none), 7 (fewer rows than ranks x chunks: empty chunks, and at tp 8 an empty
// rank), 1000 (every step present; at tp 3 shards, and at every tp chunks, of unequal sizes).
struct TpCases {
  int tp;
  std::vector<int64_t> ms;
};
const std::vector<TpCases>& Grid() {
  static const std::vector<TpCases> grid = {{2, {1, 7, 1000}}, {3, {1, 1000}}, {4, {7}}, {8, {7}}};
  return grid;
}

// One case's block: its header line ("case ..."), a line of what Run does around the steps
// (where it does anything), then its steps. A failure to build the steps is a test failure
// (and recorded as such).
void RecordCase(const Mode& md, int tp, int rank, int64_t m, std::ostringstream& out) {
  // Two scales 16 bytes apart, as CudaLinear's unit scales; BuildPreparedSteps only copies
  // the pointers into the GEMM parameters (checked in DescribeGemm), never reads them.
  alignas(16) static const float kUnitScales[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  const bool ag = md.op == OverlapOp::kAllGatherGemm;
  StepsInput in;
  in.name = "test";
  in.shape.op = md.op;
  in.shape.dtype = DataType::kFloat8E4M3;
  in.shape.max_m = 1000;
  in.shape.n = ag ? 64 : 128;  // local (CudaLinearShape)
  in.shape.k = ag ? 128 : 32;
  in.knobs.mode = md.mode;
  in.knobs.chunks = md.chunks;
  in.knobs.copy_engine = md.copy_engine;
  in.knobs.full_weight = md.full_weight;
  in.knobs.in_place = md.in_place;
  in.tp = tp;
  in.rank = rank;
  in.m = m;
  // As CudaLinear::Create and Prepare set them.
  const bool ce = md.copy_engine && tp > 1;
  in.in_place = ce && md.in_place;
  in.unit_scales = kUnitScales;
  in.signal_slots = ce ? md.chunks * std::max(1, tp - 1) : 0;
  out << "case " << OverlapOpName(md.op) << " " << OverlapModeName(md.mode)
      << " chunks=" << md.chunks << (md.copy_engine ? " copy_engine" : "")
      << (md.full_weight ? " full_weight" : "") << (md.in_place ? " in_place" : "") << " tp=" << tp
      << " rank=" << rank << " m=" << m << " (n=" << in.shape.n << " k=" << in.shape.k << ")\n";
  const Status valid = ValidateLinearKnobs(in.knobs, md.op);
  EXPECT_TRUE(valid.ok()) << valid.ToString();
  auto plan = MakeOverlapPlan(cuda_linear_detail::LayerPlanRequest(in));
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  if (!plan.ok()) {
    out << "  plan error: " << plan.status().ToString() << "\n";
    return;
  }
  StatusOr<Prepared> prep = cuda_linear_detail::BuildPreparedSteps(in, *plan);
  EXPECT_TRUE(prep.ok()) << prep.status().ToString();
  if (!prep.ok()) {
    out << "  steps error: " << prep.status().ToString() << "\n";
    return;
  }
  if (prep->uses_copy_stream || prep->split_sum_step >= 0 || !prep->done_from.empty()) {
    out << " ";
    if (prep->uses_copy_stream) out << " fork_second_stream";
    if (prep->split_sum_step >= 0) out << " split_sum_step=" << prep->split_sum_step;
    if (!prep->done_from.empty()) out << " wait_done_from=" << Flags(prep->done_from);
    out << "\n";
  }
  bool on_second = false;
  for (size_t i = 0; i < prep->steps.size(); ++i) {
    const PreparedStep& ps = prep->steps[i];
    on_second = on_second || cuda_linear_detail::StreamKey(ps) == 1;
    const std::string stream = StreamName(ps);
    const std::string tail = (ps.deps.empty() ? "" : " after=" + Ints(ps.deps)) +
                             (ps.done_to.empty() ? "" : " done_to=" + Flags(ps.done_to));
    if (ps.is_gemm) {
      EXPECT_TRUE(ps.comm.pulls.empty() && !ps.comm.sum && !ps.comm.copy_engine);
      if (ps.gemms.empty()) out << "  " << i << " " << stream << " no gemm" << tail << "\n";
      for (size_t g = 0; g < ps.gemms.size(); ++g) {
        out << "  " << i << (ps.gemms.size() > 1 ? "." + std::to_string(g) : "") << " " << stream
            << " " << DescribeGemm(ps.gemms[g], in.shape, kUnitScales) << tail << "\n";
      }
    } else {
      EXPECT_TRUE(ps.gemms.empty());
      out << "  " << i << " " << stream << " " << DescribeComm(ps.comm) << tail << "\n";
    }
  }
  // Run forks the copy stream from the caller's (and joins it back) exactly when some step
  // runs there.
  EXPECT_EQ(prep->uses_copy_stream, on_second);
}

// The recording of every case.
std::string Record() {
  std::ostringstream out;
  out << "# What CudaLinear enqueues per mode: tests/cuda_linear_steps_test.cc (format there; "
         "TPSERVE_REGENERATE_GOLDEN=1 rewrites this file)\n";
  for (const Mode& md : TunerModes()) {
    for (const TpCases& g : Grid()) {
      for (int64_t m : g.ms) {
        for (int rank = 0; rank < g.tp; ++rank) RecordCase(md, g.tp, rank, m, out);
      }
    }
  }
  return out.str();
}

// The blocks of a recording by header line, in order.
std::vector<std::pair<std::string, std::vector<std::string>>> Blocks(const std::string& text) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("case ", 0) == 0 || out.empty()) {
      out.push_back({line, {}});
    } else {
      out.back().second.push_back(line);
    }
  }
  return out;
}

// The first differences between two recordings, readable: missing and extra cases, and for
// each differing case its first differing lines. Empty when they are equal.
std::string Diff(const std::string& golden, const std::string& now) {
  const auto want = Blocks(golden), got = Blocks(now);
  std::map<std::string, const std::vector<std::string>*> want_of;
  for (const auto& [head, lines] : want) want_of[head] = &lines;
  std::map<std::string, bool> seen;
  std::ostringstream out;
  int differing = 0;
  constexpr int kShowCases = 8, kShowLines = 6;
  for (const auto& [head, lines] : got) {
    seen[head] = true;
    auto it = want_of.find(head);
    if (it == want_of.end()) {
      if (++differing <= kShowCases) out << "not in the golden file: " << head << "\n";
      continue;
    }
    const std::vector<std::string>& w = *it->second;
    if (w == lines) continue;
    if (++differing > kShowCases) continue;
    out << head << "\n";
    size_t first = 0;
    while (first < w.size() && first < lines.size() && w[first] == lines[first]) ++first;
    // From one line before the first difference (context), kShowLines lines.
    for (size_t i = first > 0 ? first - 1 : 0;
         i < first + kShowLines && (i < w.size() || i < lines.size()); ++i) {
      if (i < w.size() && i < lines.size() && w[i] == lines[i]) {
        out << "    " << w[i] << "\n";
        continue;
      }
      if (i < w.size()) out << "  - " << w[i] << "\n";
      if (i < lines.size()) out << "  + " << lines[i] << "\n";
    }
  }
  for (const auto& [head, lines] : want) {
    if (!seen.count(head) && ++differing <= kShowCases) {
      out << "not recorded now (golden only): " << head << "\n";
    }
  }
  if (differing == 0) return "";
  return std::to_string(differing) + " case(s) differ from " + GoldenPath() +
         " (- golden, + now; first " + std::to_string(kShowCases) + " shown):\n" + out.str();
}

TEST(CudaLinearSteps, EveryTunerModeEnqueuesWhatTheGoldenRecordingSays) {
  const std::string now = Record();
  const char* regenerate = std::getenv("TPSERVE_REGENERATE_GOLDEN");
  if (regenerate != nullptr && std::string(regenerate) == "1") {
    std::ofstream f(GoldenPath(), std::ios::binary | std::ios::trunc);
    f << now;
    f.close();
    ASSERT_TRUE(f.good()) << "cannot write " << GoldenPath();
    std::cout << "rewrote " << GoldenPath() << " (" << now.size() << " bytes)\n";
    return;
  }
  std::ifstream f(GoldenPath(), std::ios::binary);
  ASSERT_TRUE(f.good()) << "cannot read " << GoldenPath()
                        << " (TPSERVE_REGENERATE_GOLDEN=1 writes it)";
  std::stringstream golden;
  golden << f.rdbuf();
  const std::string diff = Diff(golden.str(), now);
  EXPECT_TRUE(diff.empty()) << diff
                            << "If the change is meant, rerun with TPSERVE_REGENERATE_GOLDEN=1 "
                               "and review the golden file's diff.";
}

// CudaLinearShape::accumulate at tp 1: every GEMM (one per chunk) reads C where it writes D, a
// part of y, with beta 1, and nothing else runs; where the output is a ReduceScatter's (tp 2),
// for an AllGather layer or with full_weight the layer refuses it, naming the layer.
TEST(CudaLinearSteps, AccumulateAddsEveryGemmIntoYAtTpOne) {
  alignas(16) static const float kUnitScales[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  for (int chunks : {1, 2, 4}) {
    for (OverlapMode mode : {OverlapMode::kNone, OverlapMode::kPipeline, OverlapMode::kRing}) {
      for (bool full_weight : {false, true}) {
        if (mode == OverlapMode::kNone && chunks > 1) continue;
        SCOPED_TRACE("chunks " + std::to_string(chunks) + " " + std::string(OverlapModeName(mode)) +
                     (full_weight ? " full_weight" : ""));
        StepsInput in;
        in.name = "acc";
        in.shape.op = OverlapOp::kGemmReduceScatter;
        in.shape.max_m = 1000;
        in.shape.n = 128;
        in.shape.k = 64;
        in.shape.accumulate = true;
        in.knobs.mode = mode;
        in.knobs.chunks = chunks;
        in.knobs.full_weight = full_weight;
        in.m = 1000;
        in.unit_scales = kUnitScales;
        auto plan = MakeOverlapPlan(cuda_linear_detail::LayerPlanRequest(in));
        ASSERT_TRUE(plan.ok()) << plan.status().ToString();
        StatusOr<Prepared> prep = cuda_linear_detail::BuildPreparedSteps(in, *plan);
        ASSERT_TRUE(prep.ok()) << prep.status().ToString();
        int64_t rows = 0;
        for (const PreparedStep& ps : prep->steps) {
          ASSERT_TRUE(ps.is_gemm);
          for (const GemmCall& call : ps.gemms) {
            EXPECT_EQ(call.d.base, BufRef::kY);
            EXPECT_EQ(call.c.base, BufRef::kY);
            EXPECT_EQ(call.c.offset, call.d.offset);
            EXPECT_EQ(call.params.beta, 1.0f);
            rows += call.params.m;
          }
        }
        EXPECT_EQ(rows, in.m);  // the GEMMs cover y once
        // The same plan without accumulate overwrites y first.
        in.shape.accumulate = false;
        StatusOr<Prepared> plain = cuda_linear_detail::BuildPreparedSteps(in, *plan);
        ASSERT_TRUE(plain.ok());
        EXPECT_EQ(plain->steps.at(0).gemms.at(0).params.beta, 0.0f);
      }
    }
  }
  CudaLinearShape shape;
  shape.op = OverlapOp::kGemmReduceScatter;
  shape.accumulate = true;
  EXPECT_TRUE(cuda_linear_detail::CheckAccumulate("layer x", shape, 1).ok());
  const Status tp2 = cuda_linear_detail::CheckAccumulate("layer x", shape, 2);
  EXPECT_EQ(tp2.code(), StatusCode::kUnimplemented);
  EXPECT_NE(tp2.message().find("layer x"), std::string::npos) << tp2.ToString();
  EXPECT_NE(tp2.message().find("tp 2"), std::string::npos) << tp2.ToString();
  shape.scale_scheme = GemmScaleScheme::kPerTokenChannel;
  const Status fine = cuda_linear_detail::CheckAccumulate("layer x", shape, 1);
  EXPECT_EQ(fine.code(), StatusCode::kUnimplemented);
  EXPECT_NE(fine.message().find("per_token_channel"), std::string::npos) << fine.ToString();
  shape.scale_scheme = GemmScaleScheme::kPerTensor;
  shape.op = OverlapOp::kAllGatherGemm;
  EXPECT_EQ(cuda_linear_detail::CheckAccumulate("layer x", shape, 1).code(),
            StatusCode::kUnimplemented);
}

// The comparison itself: a changed line is reported with its case, a missing case by name.
TEST(CudaLinearSteps, DiffNamesTheCaseAndTheFirstDifferingLine) {
  const std::string golden = "case a\n  0 main x\n  1 comm y\ncase b\n  0 main z\n";
  EXPECT_EQ(Diff(golden, golden), "");
  const std::string changed = "case a\n  0 main x\n  1 comm Y\n";
  const std::string diff = Diff(golden, changed);
  EXPECT_NE(diff.find("case a\n      0 main x\n  -   1 comm y\n  +   1 comm Y\n"),
            std::string::npos)
      << diff;
  EXPECT_NE(diff.find("not recorded now (golden only): case b"), std::string::npos) << diff;
  EXPECT_NE(diff.find("2 case(s) differ"), std::string::npos) << diff;
}

}  // namespace
}  // namespace tpserve
