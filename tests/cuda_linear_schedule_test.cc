// The schedule that runs on the GPU, executed on the CPU. For every mode the tuner can emit, at
// tp 2, 3, 4 and 8, this test builds every rank's steps as CudaLinear::Prepare does
// (cuda_linear_detail::BuildPreparedSteps, host only) and runs them as CudaLinear::Enqueue
// enqueues them: per rank the caller's stream, the comm stream and the copy stream as in-order
// queues; cross-stream dependencies as events recorded and awaited; copy-engine messages as the
// peer flags (`ready` / `done`: set by Signal, awaited and re-armed by Wait); NCCL AllGather and
// ReduceScatter as collectives that run when every rank has reached its next one, SendRecv as
// messages matched per pair of ranks in the order posted; pulls, copies, sums and GEMMs
// on byte buffers per rank, which the peers read where a step says so. Which runnable operation
// goes next is drawn at random (several seeds per case), so an operation that the schedule
// does not order after the write it reads runs early in some interleaving.
//
// gemm_rs cases also run as RunSplit (the engine's o and down), its skipped sum done by the check.
//
// Checks, per case and seed: two consecutive Runs (different inputs, as a layer serves
// consecutive batches) finish without deadlock; each Run's output equals the unsharded product
// exactly (inputs and weights in {-1, 0, 1}: every sum is an integer that BF16 and FP8 hold
// exactly, so any wrong row, offset, peer or missing wait shows as a wrong value; fresh buffer
// bytes are NaN codes, so a read of anything never written shows too); no flag is signalled
// while still set (a lost signal); at the end no flag is left set beyond what an in_place
// layer's next Run will consume.
//
// This is what ValidatePlan / ValidatePlanGroup do for the pure plans, done for the steps that
// actually run: the copy-engine pulls and their signals, peer and deferred sums, full_weight's
// lead and in_place's reads of the peers' running sums.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "comm/dtype.h"
#include "layers/cuda_linear_steps.h"
#include "layers/fp8.h"
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
using cuda_linear_detail::StreamKey;
using Flag = PeerSignals::Flag;

constexpr uint8_t kPoison = 0xff;  // FP8 E4M3 NaN; 0xffff is a BF16 NaN
constexpr int kBases = 7;          // BufRef::Base values
constexpr int kRuns = 2;
// Events beyond the steps' own (a step's event id is its index).
constexpr int kForkEvent = 1 << 20, kJoinEvent = kForkEvent + 1, kCopyJoinEvent = kForkEvent + 2;

float Bf16At(const uint8_t* p) {
  BFloat16 v;
  std::memcpy(&v.bits, p, 2);
  return BFloat16ToFloat(v);
}
void PutBf16(uint8_t* p, float f) {
  const BFloat16 v = FloatToBFloat16(f);
  std::memcpy(p, &v.bits, 2);
}
float Fp8Value(uint8_t code) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[c] = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    return v;
  }();
  return table[code];
}
float ElementAt(const uint8_t* p, DataType t) {
  return t == DataType::kFloat8E4M3 ? Fp8Value(*p) : Bf16At(p);
}

// An NCCL send/receive pair in flight: NCCL matches a pair of ranks' point-to-point messages
// in the order they were posted, whichever steps post them. The send is posted (its buffer read)
// when the call reaches the head of its stream; the call completes once its receive has taken
// the sender's message and its own message has been taken.
struct P2p {
  bool posted = false;
  bool received = false;
  std::shared_ptr<bool> taken;  // of this call's own message
};

struct Op {
  std::string what;  // for a deadlock's report
  std::function<bool()> ready;
  std::function<void()> run;
  int collective = -1;  // >= 0: this rank's collective-th AllGather / ReduceScatter
  const CommCall* comm = nullptr;
  std::shared_ptr<P2p> p2p;  // a SendRecv
};

struct Message {
  std::vector<uint8_t> data;
  std::shared_ptr<bool> taken;
};

class Sim {
 public:
  // split: RunSplit instead of Run (the output's last sum left to its consumer, which the
  // check then does).
  Sim(const TunerMode& md, int tp, int64_t m, uint32_t seed, bool split = false)
      : md_(md), tp_(tp), m_(m), split_(split), rng_(seed), ranks_(tp) {}

  // Builds the steps, the data and the queues; false (with a test failure) if a rank's steps
  // cannot be built.
  bool Build();
  // Runs to the end or to the first fatal error.
  void Execute();
  // What went wrong, each naming the case; empty when the schedule computed the product.
  const std::vector<std::string>& errors() const { return errors_; }

  // A fault put into the enqueued schedule, for the test that shows the checks can fail.
  enum class Fault { kNone, kNoEventWaits, kNoReadyWaits, kNoDoneWaits };
  void Inject(Fault f) { fault_ = f; }

 private:
  struct Rank {
    Prepared prep;
    std::array<std::vector<uint8_t>, kBases> buf;
    std::array<std::deque<Op>, 3> streams;      // StreamKey order: main, copy, comm
    std::map<int, int> recorded;                // event -> runs recorded
    std::vector<uint8_t> w;                     // FP8 weight as Run gets it
    std::array<std::vector<uint8_t>, kRuns> x;  // FP8 input the caller writes, per Run
    int collectives = 0;                        // enqueued so far
  };

  bool ce() const { return md_.copy_engine && tp_ > 1; }
  bool ag() const { return md_.op == OverlapOp::kAllGatherGemm; }
  int64_t n() const { return ag() ? 64 : 48; }  // local
  int64_t k() const { return ag() ? 96 : 32; }  // local
  std::string Name() const;

  // The bytes [offset, offset + bytes) of rank r's buffer `base`, grown with poison.
  uint8_t* At(int r, BufRef::Base base, size_t offset, size_t bytes) {
    std::vector<uint8_t>& b = ranks_[r].buf[base];
    if (b.size() < offset + bytes) b.resize(offset + bytes, kPoison);
    return b.data() + offset;
  }
  uint8_t* Ref(int r, const BufRef& ref, size_t bytes) {
    return At(ref.peer >= 0 ? ref.peer : r, ref.base, ref.offset, bytes);
  }

  int& FlagOf(int owner, PeerSignals::Kind kind, int sender, int slot) {
    return flags_[std::make_tuple(owner, static_cast<int>(kind), sender, slot)];
  }
  void Signal(int r, PeerSignals::Kind kind, const std::vector<Flag>& to);
  void EnqueueSignal(int r, int s, PeerSignals::Kind kind, const std::vector<Flag>& to);
  void EnqueueWaits(int r, int s, PeerSignals::Kind kind, const std::vector<Flag>& from);
  void EnqueueRecord(int r, int s, int event, int run);
  void EnqueueWaitEvent(int r, int s, int event, int run);
  void EnqueueRun(int r, int run);
  void EnqueueStep(int r, size_t i, int run);
  void Gemm(int r, const GemmCall& g);
  void Collective(int seq);
  void Post(int r, Op& op);
  void Receive(int r, Op& op);
  void WriteInput(int r, int run);
  void CheckOutput(int r, int run);
  std::vector<double> Expected(int r, int run) const;

  TunerMode md_;
  int tp_;
  int64_t m_;
  bool split_;
  std::mt19937 rng_;
  std::vector<Rank> ranks_;
  std::map<std::tuple<int, int, int, int>, int> flags_;
  std::map<std::pair<int, int>, std::deque<Message>> channels_;  // (sender, receiver)
  std::vector<std::string> errors_;
  bool fatal_ = false;  // an error after which the run cannot go on
  Fault fault_ = Fault::kNone;

  void Error(const std::string& what, bool fatal = false) {
    errors_.push_back(Name() + ": " + what);
    fatal_ = fatal_ || fatal;
  }
};

std::string Sim::Name() const {
  return std::string(OverlapOpName(md_.op)) + " " + std::string(OverlapModeName(md_.mode)) +
         " chunks=" + std::to_string(md_.chunks) + (md_.copy_engine ? " copy_engine" : "") +
         (md_.full_weight ? " full_weight" : "") + (md_.in_place ? " in_place" : "") +
         " tp=" + std::to_string(tp_) + " m=" + std::to_string(m_);
}

bool Sim::Build() {
  alignas(16) static const float kUnitScales[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  std::uniform_int_distribution<int> ternary(-1, 1);
  const int64_t wk = md_.full_weight ? tp_ * k() : k();
  std::vector<uint8_t> whole_w(n() * wk);  // full_weight: the same on every rank
  for (uint8_t& v : whole_w) v = FloatToFp8E4M3(static_cast<float>(ternary(rng_)));
  for (int r = 0; r < tp_; ++r) {
    StepsInput in;
    in.name = "sim";
    in.shape.op = md_.op;
    in.shape.dtype = DataType::kFloat8E4M3;
    in.shape.max_m = m_;
    in.shape.n = n();
    in.shape.k = k();
    in.knobs.mode = md_.mode;
    in.knobs.chunks = md_.chunks;
    in.knobs.copy_engine = md_.copy_engine;
    in.knobs.full_weight = md_.full_weight;
    in.knobs.in_place = md_.in_place;
    in.tp = tp_;
    in.rank = r;
    in.m = m_;
    in.in_place = ce() && md_.in_place;
    in.unit_scales = kUnitScales;
    in.signal_slots = ce() ? md_.chunks * std::max(1, tp_ - 1) : 0;
    auto plan = MakeOverlapPlan(cuda_linear_detail::LayerPlanRequest(in));
    if (!plan.ok()) {
      Error("rank " + std::to_string(r) + ": " + plan.status().ToString(), true);
      return false;
    }
    StatusOr<Prepared> prep = cuda_linear_detail::BuildPreparedSteps(in, *plan);
    if (!prep.ok()) {
      Error("rank " + std::to_string(r) + ": " + prep.status().ToString(), true);
      return false;
    }
    Rank& rk = ranks_[r];
    rk.prep = std::move(*prep);
    // As Prepare: a step that a step on another stream waits for records its event.
    std::vector<PreparedStep>& steps = rk.prep.steps;
    for (size_t i = 0; i < steps.size(); ++i) {
      for (int d : steps[i].deps) {
        if (StreamKey(steps[d]) != StreamKey(steps[i])) steps[d].record_event = true;
      }
    }
    if (md_.full_weight) {
      rk.w = whole_w;
    } else {
      rk.w.resize(n() * k());
      for (uint8_t& v : rk.w) v = FloatToFp8E4M3(static_cast<float>(ternary(rng_)));
    }
    const int64_t x_rows = ag() ? ShardRows(m_, tp_, r).size() : m_;
    for (auto& x : rk.x) {
      x.resize(x_rows * k());
      for (uint8_t& v : x) v = FloatToFp8E4M3(static_cast<float>(ternary(rng_)));
    }
  }
  // As PrimeDoneFlags for an in_place layer: every `done` its plan sends is set before the
  // first Run, whose start awaits them.
  if (ce() && md_.in_place) {
    for (int r = 0; r < tp_; ++r) {
      std::vector<Flag> tokens;
      for (const PreparedStep& ps : ranks_[r].prep.steps) {
        tokens.insert(tokens.end(), ps.done_to.begin(), ps.done_to.end());
        tokens.insert(tokens.end(), ps.comm.done_to.begin(), ps.comm.done_to.end());
      }
      Signal(r, PeerSignals::kDone, tokens);
    }
  }
  for (int run = 0; run < kRuns; ++run) {
    for (int r = 0; r < tp_; ++r) EnqueueRun(r, run);
  }
  return true;
}

void Sim::Signal(int r, PeerSignals::Kind kind, const std::vector<Flag>& to) {
  for (const Flag& f : to) {
    int& flag = FlagOf(f.peer, kind, r, f.slot);
    if (flag != 0) {
      Error("rank " + std::to_string(r) + " signals " +
            (kind == PeerSignals::kReady ? "ready" : "done") + " to rank " +
            std::to_string(f.peer) + " slot " + std::to_string(f.slot) +
            " while that flag is still set: the signal is lost");
    }
    flag = 1;
  }
}

void Sim::EnqueueSignal(int r, int s, PeerSignals::Kind kind, const std::vector<Flag>& to) {
  if (to.empty()) return;
  ranks_[r].streams[s].push_back(
      {"signal", [] { return true; }, [=, this] { Signal(r, kind, to); }});
}

void Sim::EnqueueWaits(int r, int s, PeerSignals::Kind kind, const std::vector<Flag>& from) {
  if ((kind == PeerSignals::kReady && fault_ == Fault::kNoReadyWaits) ||
      (kind == PeerSignals::kDone && fault_ == Fault::kNoDoneWaits)) {
    return;
  }
  // One operation per flag, in order, as the batch of stream memory operations runs them.
  for (const Flag& f : from) {
    const std::string what = std::string("wait ") +
                             (kind == PeerSignals::kReady ? "ready" : "done") + " from rank " +
                             std::to_string(f.peer) + " slot " + std::to_string(f.slot);
    ranks_[r].streams[s].push_back({what,
                                    [=, this] { return FlagOf(r, kind, f.peer, f.slot) == 1; },
                                    [=, this] { FlagOf(r, kind, f.peer, f.slot) = 0; }});
  }
}

void Sim::EnqueueRecord(int r, int s, int event, int run) {
  ranks_[r].streams[s].push_back({"record " + std::to_string(event), [] { return true; },
                                  [=, this] { ranks_[r].recorded[event] = run + 1; }});
}

void Sim::EnqueueWaitEvent(int r, int s, int event, int run) {
  ranks_[r].streams[s].push_back({"wait event " + std::to_string(event),
                                  [=, this] {
                                    auto it = ranks_[r].recorded.find(event);
                                    return it != ranks_[r].recorded.end() && it->second >= run + 1;
                                  },
                                  [] {}});
}

// What CudaLinear::Enqueue issues for one Run (Steps::kAll), preceded by the caller writing
// the input and followed by the caller reading the output, both on the caller's stream.
void Sim::EnqueueRun(int r, int run) {
  Rank& rk = ranks_[r];
  const Prepared& prep = rk.prep;
  constexpr int kMain = 0, kCopy = 1, kComm = 2;
  rk.streams[kMain].push_back(
      {"write input", [] { return true; }, [=, this] { WriteInput(r, run); }});
  const bool in_place = ce() && md_.in_place;
  if (in_place && !prep.done_from.empty())
    EnqueueWaits(r, kMain, PeerSignals::kDone, prep.done_from);
  EnqueueRecord(r, kMain, kForkEvent, run);
  EnqueueWaitEvent(r, kComm, kForkEvent, run);
  if (prep.uses_copy_stream) EnqueueWaitEvent(r, kCopy, kForkEvent, run);
  for (size_t i = 0; i < prep.steps.size(); ++i) {
    if (split_ && static_cast<int>(i) == prep.split_sum_step) continue;  // RunSplit skips it
    EnqueueStep(r, i, run);
  }
  if (!prep.done_from.empty() && !in_place)
    EnqueueWaits(r, kComm, PeerSignals::kDone, prep.done_from);
  if (prep.uses_copy_stream) {
    EnqueueRecord(r, kCopy, kCopyJoinEvent, run);
    EnqueueWaitEvent(r, kMain, kCopyJoinEvent, run);
  }
  EnqueueRecord(r, kComm, kJoinEvent, run);
  EnqueueWaitEvent(r, kMain, kJoinEvent, run);
  rk.streams[kMain].push_back(
      {"read output", [] { return true; }, [=, this] { CheckOutput(r, run); }});
}

void Sim::EnqueueStep(int r, size_t i, int run) {
  Rank& rk = ranks_[r];
  const PreparedStep& ps = rk.prep.steps[i];
  const int s = StreamKey(ps);
  std::deque<Op>& q = rk.streams[s];
  for (int d : ps.deps) {
    if (StreamKey(rk.prep.steps[d]) != s && fault_ != Fault::kNoEventWaits) {
      EnqueueWaitEvent(r, s, d, run);
    }
  }
  const std::string step = "step " + std::to_string(i);
  if (ps.is_gemm) {
    for (const GemmCall& g : ps.gemms) {
      q.push_back({step + " gemm", [] { return true; }, [=, this, &g] { Gemm(r, g); }});
    }
    EnqueueSignal(r, s, PeerSignals::kDone, ps.done_to);
    if (ps.record_event) EnqueueRecord(r, s, static_cast<int>(i), run);
    return;
  }
  const CommCall& c = ps.comm;
  if (!c.copy_engine) {
    Op op{step + " nccl " + std::string(StepKindName(c.kind)), [] { return true; }, [] {}};
    op.comm = &c;
    if (c.kind == StepKind::kSendRecv) {
      op.p2p = std::make_shared<P2p>();
      op.ready = [&c, st = op.p2p] {
        return st->posted && (c.recv_peer < 0 || st->received) && (c.send_peer < 0 || *st->taken);
      };
    } else {
      op.collective = rk.collectives++;
    }
    q.push_back(std::move(op));
    if (ps.record_event) EnqueueRecord(r, s, static_cast<int>(i), run);
    return;
  }
  EnqueueSignal(r, s, PeerSignals::kReady, c.ready_to);
  if (c.copy_bytes > 0) {
    q.push_back({step + " copy", [] { return true; },
                 [=, this, &c] {
                   const size_t rows = c.copy_height > 0 ? c.copy_height : 1;
                   const size_t sp = c.copy_height > 0 ? c.copy_src_pitch : c.copy_bytes;
                   const size_t dp = c.copy_height > 0 ? c.copy_dst_pitch : c.copy_bytes;
                   for (size_t row = 0; row < rows; ++row) {
                     BufRef src = c.copy_src, dst = c.copy_dst;
                     src.offset += row * sp;
                     dst.offset += row * dp;
                     std::memcpy(Ref(r, dst, c.copy_bytes), Ref(r, src, c.copy_bytes),
                                 c.copy_bytes);
                   }
                 }});
  }
  EnqueueWaits(r, s, PeerSignals::kReady, c.ready_from);
  for (const CommCall::Pull& p : c.pulls) {
    q.push_back({step + " pull from " + std::to_string(p.peer), [] { return true; },
                 [=, this, &p] {
                   const size_t rows = p.height > 0 ? p.height : 1;
                   const size_t sp = p.height > 0 ? p.src_pitch : p.bytes;
                   const size_t dp = p.height > 0 ? p.dst_pitch : p.bytes;
                   for (size_t row = 0; row < rows; ++row) {
                     const uint8_t* src = At(p.peer, p.src.base, p.src.offset + row * sp, p.bytes);
                     BufRef dst = p.dst;
                     dst.offset += row * dp;
                     std::memcpy(Ref(r, dst, p.bytes), src, p.bytes);
                   }
                 }});
  }
  if (c.sum) {
    const bool direct = c.sum_args.direct;
    if (!direct) EnqueueSignal(r, s, PeerSignals::kDone, c.done_to);
    q.push_back({step + " sum", [] { return true; },
                 [=, this, &c] {
                   const int64_t count = c.sum_args.count;
                   std::vector<float> acc(count, 0.0f);
                   for (const BufRef& slot : c.sum_args.slots) {
                     const uint8_t* p = Ref(r, slot, count * 2);
                     for (int64_t e = 0; e < count; ++e) acc[e] += Bf16At(p + 2 * e);
                   }
                   uint8_t* d = Ref(r, c.sum_args.dst, count * 2);
                   for (int64_t e = 0; e < count; ++e) PutBf16(d + 2 * e, acc[e]);
                 }});
    if (direct) EnqueueSignal(r, s, PeerSignals::kDone, c.done_to);
    if (ps.record_event) EnqueueRecord(r, s, static_cast<int>(i), run);
    return;
  }
  if (ps.record_event) EnqueueRecord(r, s, static_cast<int>(i), run);
  EnqueueSignal(r, s, PeerSignals::kDone, c.done_to);
}

// D = alpha * A . B^T (+ beta * C), B the rank's weight at b_offset; strided batch.
void Sim::Gemm(int r, const GemmCall& g) {
  const GemmParams& p = g.params;
  if (p.d_type != DataType::kBFloat16) return Error("a GEMM with a non-BF16 output", true);
  const size_t as = DataTypeSize(p.a_type), bs = DataTypeSize(p.b_type);
  const int64_t lda = p.lda ? p.lda : p.k, ldb = p.ldb ? p.ldb : p.k, ldd = p.ldd ? p.ldd : p.n;
  const int64_t ldc = p.ldc ? p.ldc : ldd;
  const bool uses_c = p.beta != 0.0f;
  for (int bi = 0; bi < std::max(1, p.batch); ++bi) {
    const int64_t off_a = p.batch > 1 ? bi * p.stride_a : 0,
                  off_b = p.batch > 1 ? bi * p.stride_b : 0;
    const int64_t off_c = p.batch > 1 ? bi * p.stride_c : 0,
                  off_d = p.batch > 1 ? bi * p.stride_d : 0;
    BufRef a = g.a, c = g.c, d = g.d;
    a.offset += off_a * as;
    c.offset += off_c * 2;
    d.offset += off_d * 2;
    const uint8_t* pa = Ref(r, a, ((p.m - 1) * lda + p.k) * as);
    const size_t b_begin = g.b_offset + off_b * bs, b_bytes = ((p.n - 1) * ldb + p.k) * bs;
    if (b_begin + b_bytes > ranks_[r].w.size()) return Error("a GEMM reads past the weight", true);
    const uint8_t* pb = ranks_[r].w.data() + b_begin;
    // C may be D itself (in place): read it whole first.
    std::vector<float> cv;
    if (uses_c) {
      const uint8_t* pc = Ref(r, c, ((p.m - 1) * ldc + p.n) * 2);
      cv.resize(p.m * p.n);
      for (int64_t i = 0; i < p.m; ++i) {
        for (int64_t j = 0; j < p.n; ++j) cv[i * p.n + j] = Bf16At(pc + 2 * (i * ldc + j));
      }
    }
    uint8_t* pd = Ref(r, d, ((p.m - 1) * ldd + p.n) * 2);
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = 0; j < p.n; ++j) {
        double acc = 0.0;
        for (int64_t kk = 0; kk < p.k; ++kk) {
          acc += static_cast<double>(ElementAt(pa + (i * lda + kk) * as, p.a_type)) *
                 ElementAt(pb + (j * ldb + kk) * bs, p.b_type);
        }
        double v = p.alpha * acc;
        if (uses_c) v += p.beta * cv[i * p.n + j];
        PutBf16(pd + 2 * (i * ldd + j), static_cast<float>(v));
      }
    }
  }
}

// Every rank's `seq`-th NCCL call, run together (they are the same collective: ValidatePlanGroup).
void Sim::Collective(int seq) {
  std::vector<const CommCall*> calls(tp_);
  for (int r = 0; r < tp_; ++r) {
    const Op& head = ranks_[r].streams[2].front();
    calls[r] = head.comm;
    if (calls[r]->kind != calls[0]->kind) {
      return Error("NCCL collective " + std::to_string(seq) + " differs between ranks", true);
    }
  }
  switch (calls[0]->kind) {
    case StepKind::kAllGather: {
      const size_t bytes = calls[0]->send_bytes;
      std::vector<std::vector<uint8_t>> sent(tp_);
      for (int q = 0; q < tp_; ++q) {
        if (calls[q]->send_bytes != bytes) return Error("AllGather sizes differ", true);
        const uint8_t* src = Ref(q, calls[q]->send, bytes);
        sent[q].assign(src, src + bytes);
      }
      for (int r = 0; r < tp_; ++r) {
        for (int q = 0; q < tp_; ++q) {
          BufRef dst = calls[r]->recv;
          dst.offset += q * bytes;
          std::memcpy(Ref(r, dst, bytes), sent[q].data(), bytes);
        }
      }
      break;
    }
    case StepKind::kReduceScatter: {
      const size_t count = calls[0]->send_bytes;  // elements per rank
      std::vector<std::vector<float>> sums(tp_, std::vector<float>(count, 0.0f));
      for (int q = 0; q < tp_; ++q) {
        const uint8_t* src = Ref(q, calls[q]->send, tp_ * count * 2);
        for (int r = 0; r < tp_; ++r) {
          for (size_t e = 0; e < count; ++e) sums[r][e] += Bf16At(src + 2 * (r * count + e));
        }
      }
      for (int r = 0; r < tp_; ++r) {
        uint8_t* dst = Ref(r, calls[r]->recv, count * 2);
        for (size_t e = 0; e < count; ++e) PutBf16(dst + 2 * e, sums[r][e]);
        const CommCall& c = *calls[r];
        if (c.copy_bytes > 0) {
          std::memcpy(Ref(r, c.copy_dst, c.copy_bytes), Ref(r, c.copy_src, c.copy_bytes),
                      c.copy_bytes);
        }
      }
      break;
    }
    default:  // kSendRecv, and kinds that CommCall::kind never holds
      return Error("not a collective at NCCL collective " + std::to_string(seq), true);
  }
}

void Sim::Post(int r, Op& op) {
  const CommCall& c = *op.comm;
  op.p2p->posted = true;
  if (c.send_peer < 0) return;
  const uint8_t* src = Ref(r, c.send, c.send_bytes);
  Message msg{std::vector<uint8_t>(src, src + c.send_bytes), std::make_shared<bool>(false)};
  op.p2p->taken = msg.taken;
  channels_[{r, c.send_peer}].push_back(std::move(msg));
}

void Sim::Receive(int r, Op& op) {
  const CommCall& c = *op.comm;
  std::deque<Message>& ch = channels_[{c.recv_peer, r}];
  Message msg = std::move(ch.front());
  ch.pop_front();
  if (msg.data.size() != c.recv_bytes) {
    return Error("rank " + std::to_string(r) + " receives " + std::to_string(c.recv_bytes) +
                     " bytes from rank " + std::to_string(c.recv_peer) +
                     ", whose next message to it has " + std::to_string(msg.data.size()),
                 true);
  }
  std::memcpy(Ref(r, c.recv, c.recv_bytes), msg.data.data(), c.recv_bytes);
  *msg.taken = true;
  op.p2p->received = true;
}

void Sim::WriteInput(int r, int run) {
  const std::vector<uint8_t>& x = ranks_[r].x[run];
  BufRef at;
  at.base = BufRef::kInput;
  if (ag() && md_.mode == OverlapMode::kRing) {  // CudaLinear::input(m)
    at.base = BufRef::kGather;
    at.offset = ShardRows(m_, tp_, r).begin * k();
  }
  if (!x.empty()) std::memcpy(Ref(r, at, x.size()), x.data(), x.size());
}

// AG: Y_r = X . W_r^T over all m rows (X: every rank's shard); RS: this rank's rows of
// sum_q X_q . W_q^T (full_weight: W's column block q).
std::vector<double> Sim::Expected(int r, int run) const {
  const int64_t N = n(), K = k();
  if (ag()) {
    std::vector<double> y(m_ * N, 0.0);
    for (int q = 0; q < tp_; ++q) {
      const RowRange rows = ShardRows(m_, tp_, q);
      const std::vector<uint8_t>& x = ranks_[q].x[run];
      for (int64_t i = 0; i < rows.size(); ++i) {
        for (int64_t j = 0; j < N; ++j) {
          double acc = 0.0;
          for (int64_t kk = 0; kk < K; ++kk) {
            acc += static_cast<double>(Fp8Value(x[i * K + kk])) * Fp8Value(ranks_[r].w[j * K + kk]);
          }
          y[(rows.begin + i) * N + j] = acc;
        }
      }
    }
    return y;
  }
  const RowRange rows = ShardRows(m_, tp_, r);
  std::vector<double> y(rows.size() * N, 0.0);
  for (int q = 0; q < tp_; ++q) {
    const std::vector<uint8_t>& x = ranks_[q].x[run];
    const std::vector<uint8_t>& w = ranks_[md_.full_weight ? r : q].w;
    const int64_t ldw = md_.full_weight ? tp_ * K : K, col0 = md_.full_weight ? q * K : 0;
    for (int64_t i = 0; i < rows.size(); ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double acc = 0.0;
        for (int64_t kk = 0; kk < K; ++kk) {
          acc += static_cast<double>(Fp8Value(x[(rows.begin + i) * K + kk])) *
                 Fp8Value(w[j * ldw + col0 + kk]);
        }
        y[i * N + j] += acc;
      }
    }
  }
  return y;
}

void Sim::CheckOutput(int r, int run) {
  const std::vector<double> want = Expected(r, run);
  BufRef y;
  y.base = BufRef::kY;
  const uint8_t* got = Ref(r, y, want.size() * 2);
  // RunSplit of a plan with a sum step of its own: the output is first + second, rounded once.
  const int skipped = split_ ? ranks_[r].prep.split_sum_step : -1;
  const uint8_t* second = nullptr;
  if (skipped >= 0) {
    const std::vector<BufRef>& slots = ranks_[r].prep.steps[skipped].comm.sum_args.slots;
    if (slots.size() != 2) return Error("the split sum step does not have two addends", true);
    got = Ref(r, slots[0], want.size() * 2);
    second = Ref(r, slots[1], want.size() * 2);
  }
  int64_t bad = 0;
  std::string first;
  for (size_t e = 0; e < want.size(); ++e) {
    float v = Bf16At(got + 2 * e);
    if (second != nullptr) v = BFloat16ToFloat(FloatToBFloat16(v + Bf16At(second + 2 * e)));
    if (!(v == static_cast<float>(want[e]))) {
      if (bad++ == 0) {
        first = "element " + std::to_string(e) + " (row " + std::to_string(e / n()) +
                ") = " + std::to_string(v) + ", want " + std::to_string(want[e]);
      }
    }
  }
  if (bad > 0) {
    Error("rank " + std::to_string(r) + " run " + std::to_string(run) + ": " + std::to_string(bad) +
          " output elements wrong, first " + first);
  }
}

void Sim::Execute() {
  // A choice: (rank, stream) runs that stream's head; (rank, 3) lets the rank's SendRecv at the
  // head of its comm stream take its message; (-1, 2) runs the next collective on all ranks.
  std::vector<std::pair<int, int>> ready;
  for (;;) {
    ready.clear();
    // Post first: a message posted now may be what another rank's receive waits for.
    for (int r = 0; r < tp_; ++r) {
      std::deque<Op>& comm = ranks_[r].streams[2];
      if (!comm.empty() && comm.front().p2p != nullptr && !comm.front().p2p->posted) {
        Post(r, comm.front());
        if (fatal_) return;
      }
    }
    bool any = false, all_at_collective = true;
    int seq = -1;
    for (int r = 0; r < tp_; ++r) {
      for (int s = 0; s < 3; ++s) {
        std::deque<Op>& q = ranks_[r].streams[s];
        if (q.empty()) continue;
        any = true;
        Op& head = q.front();
        if (head.p2p != nullptr) {
          const CommCall& c = *head.comm;
          if (c.recv_peer >= 0 && !head.p2p->received && !channels_[{c.recv_peer, r}].empty()) {
            ready.push_back({r, 3});
          }
        }
        if (head.collective < 0 && head.ready()) ready.push_back({r, s});
      }
      const std::deque<Op>& comm = ranks_[r].streams[2];
      if (comm.empty() || comm.front().collective < 0 ||
          (seq >= 0 && comm.front().collective != seq)) {
        all_at_collective = false;
      } else {
        seq = comm.front().collective;
      }
    }
    if (!any) break;
    if (all_at_collective && seq >= 0) ready.push_back({-1, 2});
    if (ready.empty()) {
      std::string heads;
      for (int r = 0; r < tp_; ++r) {
        for (int s = 0; s < 3; ++s) {
          const std::deque<Op>& q = ranks_[r].streams[s];
          if (q.empty()) continue;
          heads += "\n  rank " + std::to_string(r) + " stream " + std::to_string(s) + ": " +
                   q.front().what;
          if (const P2p* st = q.front().p2p.get()) {
            heads += std::string(" (") + (st->received ? "received" : "nothing received") +
                     (st->taken != nullptr && *st->taken ? ", sent" : "") + ")";
          }
        }
      }
      return Error("deadlock; waiting at" + heads, true);
    }
    const auto [r, s] = ready[std::uniform_int_distribution<size_t>(0, ready.size() - 1)(rng_)];
    if (r < 0) {
      Collective(seq);
      if (fatal_) return;
      for (Rank& rk : ranks_) rk.streams[2].pop_front();
    } else if (s == 3) {
      Receive(r, ranks_[r].streams[2].front());
    } else {
      Op op = std::move(ranks_[r].streams[s].front());
      ranks_[r].streams[s].pop_front();
      op.run();
    }
    if (fatal_) return;
  }
  // Flags left set: only the `done` tokens an in_place layer's next Run starts by consuming.
  for (const auto& [key, value] : flags_) {
    if (value == 0) continue;
    const auto [owner, kind, sender, slot] = key;
    const bool token = ce() && md_.in_place && kind == PeerSignals::kDone;
    if (!token) {
      Error(std::string("flag ") + (kind == 0 ? "ready" : "done") + " on rank " +
            std::to_string(owner) + " from rank " + std::to_string(sender) + " slot " +
            std::to_string(slot) + " left set after the last Run");
    }
  }
}

struct TpCase {
  int tp;
  std::vector<int64_t> ms;
};
// m = 1 (one rank has the row), 7 (empty chunks, at tp 8 an empty rank), 37 and 100 (unequal
// shards and chunks).
const std::vector<TpCase>& Grid() {
  static const std::vector<TpCase> grid = {
      {2, {1, 7, 100}}, {3, {1, 37}}, {4, {7, 37}}, {8, {7, 37}}};
  return grid;
}

// Runs every mode of the grid with `seeds` seeds each, `fault` injected; returns the first
// error of each failing case, and counts the cases run.
std::vector<std::string> RunGrid(int seeds, Sim::Fault fault, int* cases) {
  std::vector<std::string> failures;
  *cases = 0;
  for (const TunerMode& md : TunerModes()) {
    for (const TpCase& g : Grid()) {
      for (int64_t m : g.ms) {
        for (int seed = 0; seed < seeds; ++seed) {
          // gemm_rs also as RunSplit (the engine's o and down), on every other seed.
          const bool split = md.op == OverlapOp::kGemmReduceScatter && seed % 2 == 1;
          Sim sim(md, g.tp, m, 1000u * static_cast<uint32_t>(m) + 17u * g.tp + seed, split);
          sim.Inject(fault);
          if (sim.Build()) sim.Execute();
          ++*cases;
          if (!sim.errors().empty()) failures.push_back(sim.errors().front());
        }
      }
    }
  }
  return failures;
}

TEST(CudaLinearSchedule, EveryTunerModeComputesTheProductInEveryInterleaving) {
  constexpr int kSeeds = 4;
  int cases = 0;
  const std::vector<std::string> failures = RunGrid(kSeeds, Sim::Fault::kNone, &cases);
  EXPECT_EQ(cases, static_cast<int>(TunerModes().size()) * 9 * kSeeds);
  EXPECT_TRUE(failures.empty()) << failures.size() << " of " << cases
                                << " cases failed; the first: " << failures.front();
}

// The checks can fail: each kind of wait the schedule relies on, left out, breaks some case
// (wrong or unwritten outputs, a lost signal, a deadlock), and each kind named here is caught.
TEST(CudaLinearSchedule, LeavingOutAnyKindOfWaitIsCaught) {
  const struct {
    Sim::Fault fault;
    const char* name;
  } faults[] = {{Sim::Fault::kNoEventWaits, "no waits for other streams' steps"},
                {Sim::Fault::kNoReadyWaits, "no waits for the peers' `ready`"},
                {Sim::Fault::kNoDoneWaits, "no waits for the peers' `done`"}};
  for (const auto& f : faults) {
    int cases = 0;
    const std::vector<std::string> failures = RunGrid(1, f.fault, &cases);
    std::cout << f.name << ": " << failures.size() << " of " << cases << " cases fail"
              << (failures.empty() ? "" : "; the first: " + failures.front()) << "\n";
    EXPECT_GT(failures.size(), 0u) << f.name << " went unnoticed";
  }
}

}  // namespace
}  // namespace tpserve
