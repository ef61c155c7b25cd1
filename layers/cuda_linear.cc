#include "layers/cuda_linear.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>
#include <utility>

#include "comm/cuda_check.h"
#include "comm/peer_memory.h"
#include "layers/sum_kernels.h"

namespace tpserve {
namespace {

// A place in one of the layer's buffers (or the caller's w / y).
struct BufRef {
  enum Base : uint8_t { kNone, kInput, kGather, kPartial, kReceived, kScratch, kY } base = kNone;
  size_t offset = 0;  // bytes
  int peer = -1;      // >= 0: in that rank's copy of `base` (a PeerBuffer mapped here)
};

struct GemmCall {
  GemmParams params;  // scale pointers filled in at Run
  BufRef a, c, d;
  size_t b_offset = 0;  // bytes into the weight (full_weight's ring lead: a column block)
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
  // 0 = the caller's stream, 1 = the layer's second stream (GEMM steps with gemm_lanes 2;
  // full_weight's copies of the own input columns)
  int lane = 0;
};

struct Prepared {
  OverlapPlan plan;
  std::vector<PreparedStep> steps;
  std::vector<PeerSignals::Flag> done_from;  // copy engine: waited for at the end of Run
  // The step that sums this rank's whole output from two addends (a one-chunk copy-engine
  // ring's last addition), which RunSplit skips; -1 if the plan has none.
  int split_sum_step = -1;
  bool uses_lane = false;  // some GEMM step runs on the second GEMM stream
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The stream a step runs on: 0 the caller's, 1 the second stream, 2 the comm stream.
int StreamKey(const PreparedStep& ps) { return ps.stream == StepStream::kComm ? 2 : ps.lane; }

// LinearKnobs::gemm_lanes == 2: a GEMM step that depends neither directly nor through other
// steps on the GEMM step before it goes on the other lane than that one, so that its CTAs can
// take the SMs the earlier GEMM's last wave leaves idle; a dependent one stays on its lane.
// Steps' deps point backwards (ValidatePlan; the deferred sums come last). Returns whether any
// step went on lane 1.
bool AssignGemmLanes(std::vector<PreparedStep>& steps) {
  const size_t n = steps.size();
  std::vector<std::vector<bool>> after(n, std::vector<bool>(n, false));  // [i][j]: i waits for j
  for (size_t i = 0; i < n; ++i) {
    for (int d : steps[i].deps) {
      after[i][d] = true;
      for (size_t j = 0; j < n; ++j) after[i][j] = after[i][j] || after[d][j];
    }
  }
  int prev = -1;
  bool used = false;
  for (size_t i = 0; i < n; ++i) {
    if (!steps[i].is_gemm) continue;
    if (prev >= 0) steps[i].lane = after[i][prev] ? steps[prev].lane : 1 - steps[prev].lane;
    used = used || steps[i].lane == 1;
    prev = static_cast<int>(i);
  }
  return used;
}

}  // namespace

struct CudaLinear::Impl {
  NcclCommunicator* comm = nullptr;
  CublasLtGemm gemm;
  CudaStream comm_stream;
  CudaEvent fork, join;
  // gemm_lanes 2: the second GEMM stream, its own cuBLASLt workspace, and its join event.
  CublasLtGemm lane_gemm;
  CudaStream lane_stream;
  CudaEvent lane_join;
  std::vector<CudaEvent> step_events;
  // Plain buffers; with copy engines, the buffers that peers pull from are
  // PeerBuffers instead (mapped on every rank).
  DeviceBuffer input, gather, partial, received, scratch, unit_scales;
  PeerBuffer peer_input, peer_gather, peer_partial;
  PeerSignals signals;
  std::map<int64_t, Prepared> prepared;
  // in_place: the (peer, slot) `done` flags set at Create, which every plan's waits must use.
  std::set<std::pair<int, int>> done_tokens;

  void* InputBase() const { return peer_input.data() ? peer_input.data() : input.data(); }
  void* GatherBase() const { return peer_gather.data() ? peer_gather.data() : gather.data(); }
  void* PartialBase() const { return peer_partial.data() ? peer_partial.data() : partial.data(); }
  // The peer-mapped buffer behind `base` (copy engine only), or null.
  const PeerBuffer* PeerOf(BufRef::Base base) const {
    const PeerBuffer* b = base == BufRef::kInput     ? &peer_input
                          : base == BufRef::kGather  ? &peer_gather
                          : base == BufRef::kPartial ? &peer_partial
                                                     : nullptr;
    return b != nullptr && b->data() != nullptr ? b : nullptr;
  }
  size_t Bytes() const {
    return input.size() + gather.size() + partial.size() + received.size() + scratch.size() +
           peer_input.bytes() + peer_gather.bytes() + peer_partial.bytes() +
           gemm.workspace_bytes() + lane_gemm.workspace_bytes();
  }
};

CudaLinear::~CudaLinear() = default;

Status CudaLinear::Close() {
  if (closed_) return Status::Ok();
  closed_ = true;
  Impl& im = *impl_;
  im.prepared.clear();
  const bool peer_memory = im.signals.slots() > 0 || im.PeerOf(BufRef::kInput) != nullptr ||
                           im.PeerOf(BufRef::kGather) != nullptr ||
                           im.PeerOf(BufRef::kPartial) != nullptr;
  if (!peer_memory) return Status::Ok();  // the same on every rank: same knobs
  for (PeerBuffer* b : {&im.peer_input, &im.peer_gather, &im.peer_partial}) b->CloseImports();
  im.signals.CloseImports();
  // No rank frees what a peer still maps; a failed barrier (a peer gone)
  // still frees, as destruction would.
  const Status all_unmapped = im.comm->Barrier();
  im.peer_input = PeerBuffer();
  im.peer_gather = PeerBuffer();
  im.peer_partial = PeerBuffer();
  im.signals = PeerSignals();
  return all_unmapped.WithContext("closing layer " + name_);
}

StatusOr<std::unique_ptr<CudaLinear>> CudaLinear::Create(std::string name,
                                                         const CudaLinearShape& shape,
                                                         const LinearKnobs& knobs,
                                                         NcclCommPool& pool) {
  const std::string ctx = "layer " + name;
  if (shape.dtype != DataType::kFloat8E4M3 && shape.dtype != DataType::kBFloat16) {
    return InvalidArgumentError(ctx + ": dtype must be fp8_e4m3 or bf16, got " +
                                std::string(DataTypeName(shape.dtype)));
  }
  if (shape.max_m < 1 || shape.n < 16 || shape.k < 16 || shape.n % 16 != 0 || shape.k % 16 != 0) {
    return InvalidArgumentError(
        ctx + ": needs max_m >= 1 and n, k positive multiples of 16 " +
        "(cuBLASLt FP8 alignment), got max_m=" + std::to_string(shape.max_m) +
        " n=" + std::to_string(shape.n) + " k=" + std::to_string(shape.k));
  }
  TP_RETURN_IF_ERROR(ValidateLinearKnobs(knobs, shape.op).WithContext(ctx));

  auto layer = std::unique_ptr<CudaLinear>(new CudaLinear());
  layer->name_ = std::move(name);
  layer->shape_ = shape;
  layer->knobs_ = knobs;
  layer->impl_ = std::make_unique<Impl>();
  Impl& im = *layer->impl_;
  TP_ASSIGN_OR_RETURN(im.comm, pool.Get(knobs.comm));
  layer->tp_ = im.comm->size();
  layer->rank_ = im.comm->rank();
  TP_CUDA_CHECK(cudaSetDevice(im.comm->device()));

  int least = 0, greatest = 0;
  TP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  // The comm stream outranks the GEMM's so that NCCL's kernels get SMs as
  // soon as they are launched instead of waiting behind GEMM waves.
  TP_ASSIGN_OR_RETURN(im.comm_stream, CudaStream::Create(true, greatest));
  TP_ASSIGN_OR_RETURN(im.fork, CudaEvent::Create(false));
  TP_ASSIGN_OR_RETURN(im.join, CudaEvent::Create(false));
  TP_ASSIGN_OR_RETURN(im.gemm, CublasLtGemm::Create(layer->name_));
  // The second stream: GEMMs (gemm_lanes 2), or full_weight's local copies of the own input
  // columns, which then run beside the pulls instead of before them on the comm stream.
  if (knobs.gemm_lanes == 2 || (knobs.full_weight && knobs.copy_engine)) {
    // At the least priority (a lane 0 one level above it gained nothing).
    TP_ASSIGN_OR_RETURN(im.lane_stream, CudaStream::Create(true, least));
    TP_ASSIGN_OR_RETURN(im.lane_join, CudaEvent::Create(false));
  }
  if (knobs.gemm_lanes == 2) {
    TP_ASSIGN_OR_RETURN(im.lane_gemm, CublasLtGemm::Create(layer->name_ + ".lane1"));
  }

  const int tp = layer->tp_;
  const int64_t chunks = knobs.chunks;
  const size_t row_x = shape.k * DataTypeSize(shape.dtype);
  const size_t row_y = shape.n * sizeof(uint16_t);
  const int64_t shard_max = CeilDiv(shape.max_m, tp);
  const bool ring = knobs.mode == OverlapMode::kRing;
  auto alloc = [&](DeviceBuffer& buf, size_t bytes, const char* what) -> Status {
    TP_ASSIGN_OR_RETURN(buf, DeviceBuffer::Allocate(bytes, layer->name_ + "." + what));
    return Status::Ok();
  };
  const bool ce = knobs.copy_engine && tp > 1;
  auto alloc_peer = [&](PeerBuffer& buf, size_t bytes, const char* what) -> Status {
    TP_ASSIGN_OR_RETURN(buf, PeerBuffer::Create(*im.comm, bytes, layer->name_ + "." + what));
    return Status::Ok();
  };
  if (shape.op == OverlapOp::kAllGatherGemm) {
    if (ring) {
      if (ce) {
        TP_RETURN_IF_ERROR(alloc_peer(im.peer_gather, shape.max_m * row_x, "gather"));
      } else {
        TP_RETURN_IF_ERROR(alloc(im.gather, shape.max_m * row_x, "gather"));
      }
    } else {
      // One row of slack: a short chunk is sent padded to its step's size.
      const size_t input_bytes = (shard_max + 1) * row_x;
      if (ce) {
        TP_RETURN_IF_ERROR(alloc_peer(im.peer_input, input_bytes, "input"));
      } else {
        TP_RETURN_IF_ERROR(alloc(im.input, input_bytes, "input"));
      }
      TP_RETURN_IF_ERROR(alloc(im.gather, tp * (shard_max + chunks) * row_x, "gather"));
    }
  } else if (knobs.full_weight) {
    // Peers pull their rows' columns of this rank's input; the rank's own rows gather all
    // ranks' columns ([shard rows, tp * k]) for its whole-K GEMM.
    if (ce) {
      TP_RETURN_IF_ERROR(alloc_peer(im.peer_input, shape.max_m * row_x, "input"));
      TP_RETURN_IF_ERROR(alloc(im.gather, shard_max * tp * row_x, "gather"));
    } else {
      TP_RETURN_IF_ERROR(alloc(im.input, shape.max_m * row_x, "input"));
    }
  } else {
    TP_RETURN_IF_ERROR(alloc(im.input, shape.max_m * row_x, "input"));
    if (ring) {
      if (ce) {
        TP_RETURN_IF_ERROR(alloc_peer(im.peer_partial, shape.max_m * row_y, "partial"));
      } else {
        TP_RETURN_IF_ERROR(alloc(im.partial, shape.max_m * row_y, "partial"));
      }
      // in_place: the running sums are read where the peers left them, never copied here.
      if (!(ce && knobs.in_place)) {
        TP_RETURN_IF_ERROR(alloc(im.received, shape.max_m * row_y, "received"));
      }
    } else {
      const size_t partial_bytes = tp * (shard_max + chunks) * row_y;
      if (ce) {
        if (tp > kMaxSumSlots) {
          return InvalidArgumentError(ctx + ": copy_engine with gemm_rs mode " +
                                      std::string(OverlapModeName(knobs.mode)) +
                                      " supports up to " + std::to_string(kMaxSumSlots) +
                                      " ranks, got " + std::to_string(tp));
        }
        // Peers read their rows' slots; pipelined, theirs are pulled into
        // `received` (same layout); mode none reads them in place.
        TP_RETURN_IF_ERROR(alloc_peer(im.peer_partial, partial_bytes, "partial"));
        if (knobs.mode != OverlapMode::kNone) {
          TP_RETURN_IF_ERROR(alloc(im.received, partial_bytes, "received"));
        }
      } else {
        TP_RETURN_IF_ERROR(alloc(im.partial, partial_bytes, "partial"));
        TP_RETURN_IF_ERROR(alloc(im.scratch, (CeilDiv(shard_max, chunks) + 1) * row_y, "scratch"));
      }
    }
  }
  if (ce) {
    for (const PeerBuffer* b : {&im.peer_input, &im.peer_gather, &im.peer_partial}) {
      if (b->data() == nullptr) continue;
      for (int r = 0; r < tp; ++r) {
        if (!b->same_process(r)) continue;
        // Seen on the 2xH200 host with ranks as threads: graph replays of
        // copy-engine layers hung, gemm_rs (ring, pipeline) and ag_gemm
        // (pipeline: 1 in 14 repeats of its test), while one process per GPU
        // passes every mode. Refused rather than left to hang.
        return FailedPreconditionError(
            ctx + ": copy_engine needs one process per GPU (CUDA IPC peers); rank " +
            std::to_string(r) +
            " is a thread of this process, where graph replays of copy-engine layers hung "
            "(run tpserve serve/layer, or tpserve-bench --ranks processes)");
      }
    }
  }
  if (ce) {
    // Messages between one pair of ranks per Run: at most chunks per
    // AllGather step, or (tp - 1) * chunks ring steps.
    TP_ASSIGN_OR_RETURN(im.signals, PeerSignals::Create(*im.comm, chunks * std::max(1, tp - 1),
                                                        layer->name_ + ".signals"));
  }
  // Scales of 1.0 used while planning GEMMs (only the pointers' presence
  // matters for the algorithm choice).
  // Two scales 16 bytes apart: cuBLASLt wants scale pointers 16-byte aligned.
  TP_RETURN_IF_ERROR(alloc(im.unit_scales, 8 * sizeof(float), "unit_scales"));
  const float ones[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  TP_CUDA_CHECK(cudaMemcpy(im.unit_scales.data(), ones, sizeof ones, cudaMemcpyHostToDevice));
  // A cudaMemcpy from pageable memory may return before its DMA lands; the
  // layer's streams are non-blocking, so wait for it (the legacy stream).
  TP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  // ValidateLinearKnobs allows in_place only for gemm_rs rings with copy_engine.
  layer->in_place_ = ce && knobs.in_place;
  if (layer->in_place_) {
    // in_place: a peer reads this rank's `partial` until its last GEMM ends, so the wait for
    // its `done` (before `partial` may be written again) moves from the end of this Run,
    // where it would cost the ranks' skew, to the start of the next. Each `done` flag starts
    // set, as if a Run had gone before. The flags are those of the largest M's plan; a
    // smaller M's plan uses some of them (Prepare checks, once done_tokens is filled).
    TP_RETURN_IF_ERROR(layer->Prepare(shape.max_m));
    const Prepared& largest = im.prepared.at(shape.max_m);
    std::vector<PeerSignals::Flag> tokens;
    for (const PreparedStep& ps : largest.steps) {
      // A GEMM's, or a receive step's whose GEMM had no rows to read.
      tokens.insert(tokens.end(), ps.done_to.begin(), ps.done_to.end());
      tokens.insert(tokens.end(), ps.comm.done_to.begin(), ps.comm.done_to.end());
    }
    for (const PeerSignals::Flag& f : largest.done_from) {
      im.done_tokens.insert({f.peer, f.slot});
    }
    TP_RETURN_IF_ERROR(im.signals.Signal(PeerSignals::kDone, tokens, im.comm_stream.get()));
    TP_CUDA_CHECK(cudaStreamSynchronize(im.comm_stream.get()));
    TP_RETURN_IF_ERROR(im.comm->Barrier());  // every rank's flags set before any Run
  }
  spdlog::debug("{}: rank {}/{} {} knobs {} device bytes {}", layer->name_, layer->rank_, tp,
                OverlapOpName(shape.op), knobs.ToString(), im.Bytes());
  return layer;
}

size_t CudaLinear::device_bytes() const { return impl_->Bytes(); }

void* CudaLinear::input(int64_t m) const {
  if (shape_.op == OverlapOp::kAllGatherGemm && knobs_.mode == OverlapMode::kRing) {
    const size_t row_x = shape_.k * DataTypeSize(shape_.dtype);
    return static_cast<char*>(impl_->GatherBase()) + ShardRows(m, tp_, rank_).begin * row_x;
  }
  return impl_->InputBase();
}

size_t CudaLinear::input_bytes(int64_t m) const {
  const int64_t rows = shape_.op == OverlapOp::kAllGatherGemm ? ShardRows(m, tp_, rank_).size() : m;
  return rows * shape_.k * DataTypeSize(shape_.dtype);
}

int64_t CudaLinear::output_elements(int64_t m) const {
  return shape_.op == OverlapOp::kAllGatherGemm ? m * shape_.n
                                                : ShardRows(m, tp_, rank_).size() * shape_.n;
}

Status CudaLinear::Prepare(int64_t m) {
  if (m < 1 || m > shape_.max_m) {
    return InvalidArgumentError("layer " + name_ + ": m=" + std::to_string(m) +
                                " outside [1, max_m=" + std::to_string(shape_.max_m) + "]");
  }
  if (closed_) return FailedPreconditionError("layer " + name_ + " is closed");
  Impl& im = *impl_;
  if (im.prepared.count(m)) return Status::Ok();
  TP_ASSIGN_OR_RETURN(OverlapPlan plan,
                      MakeOverlapPlan({shape_.op, knobs_.mode, tp_, rank_, m, knobs_.chunks}));

  const bool ag = shape_.op == OverlapOp::kAllGatherGemm;
  const bool ring = knobs_.mode == OverlapMode::kRing;
  const int64_t n = shape_.n, k = shape_.k;
  const size_t row_x = k * DataTypeSize(shape_.dtype);
  const size_t row_y = n * sizeof(uint16_t);
  const RowRange own = ShardRows(m, tp_, rank_);
  const bool fp8 = shape_.dtype == DataType::kFloat8E4M3;

  GemmParams base;
  base.n = n;
  base.k = k;
  base.a_type = base.b_type = shape_.dtype;
  base.d_type = DataType::kBFloat16;
  base.fast_accum = fp8 && knobs_.fast_accum;
  base.sm_count_target = knobs_.gemm_sm_count;
  if (fp8) {
    base.a_scale = im.unit_scales.as<float>();
    base.b_scale = im.unit_scales.as<float>() + 4;
  }
  auto single = [&](int64_t rows, BufRef a, BufRef d) {
    GemmCall g;
    g.params = base;
    g.params.m = rows;
    g.a = a;
    g.d = d;
    return g;
  };
  // GEMMs over the per-rank slots of one chunk: one launch when the slots
  // are full and evenly spaced on both sides, else one launch per slot.
  auto slot_gemms = [&](const std::vector<RowRange>& rows, int64_t slot_rows, auto a_of,
                        auto d_of) {
    std::vector<GemmCall> calls;
    bool uniform = static_cast<int>(rows.size()) == tp_;
    for (size_t s = 1; uniform && s < rows.size(); ++s) {
      uniform = rows[s].begin - rows[s - 1].begin == rows[1].begin - rows[0].begin;
    }
    for (size_t s = 0; uniform && s < rows.size(); ++s) uniform = rows[s].size() == slot_rows;
    if (uniform) {
      GemmCall g = single(slot_rows, a_of(0), d_of(0));
      if (tp_ > 1) {
        const size_t a_step = a_of(1).offset - a_of(0).offset;
        const size_t d_step = d_of(1).offset - d_of(0).offset;
        if (a_step == slot_rows * row_x && d_step == slot_rows * row_y) {
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
      if (!rows[s].empty()) calls.push_back(single(rows[s].size(), a_of(s), d_of(s)));
    }
    return calls;
  };

  Prepared prep;
  if (knobs_.full_weight) {
    // No partial sums (LinearKnobs::full_weight): this rank's rows over the whole K, their
    // peers' input columns pulled into the gather buffer's column blocks ([shard rows, tp * k];
    // the own columns copied into block `rank` on the second stream, beside the pulls).
    // Mode none / pipeline: per chunk of the rows, a comm step of pulls, then one whole-K GEMM
    // after that step and the own copy. Mode ring: a lead of rows / (2 * chunks) rows that
    // waits for nothing (a GEMM over the own columns, where the caller wrote them, then one
    // accumulating GEMM per peer block once it is pulled, 1D, into a packed staging area at the
    // start of the gather buffer), then the rest of the rows in one whole-K GEMM, whose pulls
    // run under the lead's GEMMs. The first comm step signals this rank's input ready and waits
    // for the peers'; the last tells the peers that their input has been read. Every rank has
    // every comm step (the same chunk count), even where its rows are few or none, so the
    // flags always pair up.
    const int64_t kk = tp_ * k;
    const size_t row_g = kk * DataTypeSize(shape_.dtype);
    const bool ce = knobs_.copy_engine && tp_ > 1;
    std::vector<PeerSignals::Flag> peers;
    for (int p = 0; p < tp_; ++p) {
      if (p != rank_) peers.push_back({p, 0});
    }
    // A comm step: signals as said above, and a 2D pull of each peer's columns of `rows` into
    // gather row `at_row`'s column blocks (none for empty rows).
    auto add_comm_step = [&](bool first, bool last, RowRange rows, int64_t at_row) {
      PreparedStep cs;
      cs.stream = StepStream::kComm;
      CommCall& c = cs.comm;
      c.copy_engine = true;
      if (first) c.ready_to = c.ready_from = peers;
      if (last) c.done_to = peers;
      for (const PeerSignals::Flag& f : rows.empty() ? std::vector<PeerSignals::Flag>{} : peers) {
        c.pulls.push_back({f.peer,
                           {BufRef::kInput, rows.begin * row_x},
                           {BufRef::kGather, at_row * row_g + f.peer * row_x},
                           row_x,
                           static_cast<size_t>(rows.size()),
                           row_x,
                           row_g});
      }
      prep.steps.push_back(std::move(cs));
      return static_cast<int>(prep.steps.size()) - 1;
    };
    // The whole-K GEMM of `rows` (gather row `at_row` on), after `comm_step` (if any) and a copy
    // of the own columns on the second stream.
    auto add_whole_k = [&](RowRange rows, int64_t at_row, int comm_step) {
      if (rows.empty()) return;
      PreparedStep gs;
      gs.is_gemm = true;
      if (comm_step >= 0) {
        PreparedStep own_copy;
        own_copy.lane = 1;
        CommCall& c = own_copy.comm;
        c.copy_engine = true;
        c.copy_src = {BufRef::kInput, rows.begin * row_x};
        c.copy_dst = {BufRef::kGather, at_row * row_g + rank_ * row_x};
        c.copy_bytes = row_x;
        c.copy_height = rows.size();
        c.copy_src_pitch = row_x;
        c.copy_dst_pitch = row_g;
        gs.deps = {comm_step, static_cast<int>(prep.steps.size())};
        prep.steps.push_back(std::move(own_copy));
        prep.uses_lane = true;
      }
      GemmCall call = single(
          rows.size(),
          ce ? BufRef{BufRef::kGather, at_row * row_g} : BufRef{BufRef::kInput, rows.begin * row_x},
          {BufRef::kY, (rows.begin - own.begin) * row_y});
      call.params.k = kk;
      gs.gemms.push_back(call);
      prep.steps.push_back(std::move(gs));
    };
    if (ring) {
      int64_t lead = own.size() / (2 * knobs_.chunks);
      if (lead >= 128) lead = lead / 128 * 128;  // whole 128-row tiles
      const RowRange head{own.begin, own.begin + lead}, rest{own.begin + lead, own.end};
      int head_comm = -1, rest_comm = -1;
      if (ce) {
        PreparedStep cs;
        cs.stream = StepStream::kComm;
        CommCall& c = cs.comm;
        c.copy_engine = true;
        c.ready_to = c.ready_from = peers;
        for (size_t i = 0; i < peers.size() && lead > 0; ++i) {  // packed: [lead, k] per peer
          c.pulls.push_back({peers[i].peer,
                             {BufRef::kInput, head.begin * row_x},
                             {BufRef::kGather, i * lead * row_x},
                             lead * row_x});
        }
        prep.steps.push_back(std::move(cs));
        head_comm = static_cast<int>(prep.steps.size()) - 1;
        rest_comm = add_comm_step(false, true, rest, lead);
      }
      if (lead > 0) {
        PreparedStep own_gemm;  // no deps: the own columns are where the caller wrote them
        own_gemm.is_gemm = true;
        GemmCall call = single(lead, {BufRef::kInput, head.begin * row_x}, {BufRef::kY, 0});
        call.params.ldb = kk;
        call.b_offset = rank_ * row_x;
        own_gemm.gemms.push_back(call);
        prep.steps.push_back(std::move(own_gemm));
        if (ce) {
          // After the pulls, and after the own GEMM, whose output it adds to (gemm_lanes 2
          // must not put the two on different streams without that edge).
          PreparedStep add;
          add.is_gemm = true;
          add.deps = {head_comm, static_cast<int>(prep.steps.size()) - 1};
          for (size_t i = 0; i < peers.size(); ++i) {
            GemmCall acc = single(lead, {BufRef::kGather, i * lead * row_x}, {BufRef::kY, 0});
            acc.c = acc.d;
            acc.params.beta = 1.0f;
            acc.params.ldb = kk;
            acc.b_offset = peers[i].peer * row_x;
            add.gemms.push_back(acc);
          }
          prep.steps.push_back(std::move(add));
        }
      }
      add_whole_k(rest, lead, rest_comm);
    } else {
      for (int j = 0; j < knobs_.chunks; ++j) {
        const RowRange rows = ChunkRows(own, knobs_.chunks, j);
        const int64_t at_row = rows.begin - own.begin;
        const int comm_step = ce ? add_comm_step(j == 0, j == knobs_.chunks - 1, rows, at_row) : -1;
        add_whole_k(rows, at_row, comm_step);
      }
    }
    if (ce) prep.done_from = peers;
  } else {
    prep.steps.resize(plan.steps.size());
  }
  // AG slot layout: where each AllGather step's slots start, and their rows.
  std::vector<size_t> region(plan.steps.size(), 0);
  std::vector<int64_t> slot_rows_of(plan.steps.size(), 0);
  size_t next_region = 0;
  // Copy engine: messages so far to / from each peer. The k-th message from
  // a to b uses flag slot k on both sides (plans issue matching sends and
  // receives in the same order: ValidatePlanGroup).
  const bool ce = knobs_.copy_engine && tp_ > 1;
  std::vector<int> sent(tp_, 0), received(tp_, 0);
  auto next_slot = [&](std::vector<int>& seq, int peer) -> StatusOr<int> {
    if (seq[peer] >= im.signals.slots()) {
      return InternalError("layer " + name_ + ": copy-engine plan for m=" + std::to_string(m) +
                           " needs more than " + std::to_string(im.signals.slots()) +
                           " messages to/from rank " + std::to_string(peer));
    }
    return seq[peer]++;
  };
  // This rank's next message to `peer` in `c`: it signals `ready` there and
  // waits for the peer's `done` at the end of Run.
  auto add_send = [&](CommCall& c, int peer) -> Status {
    TP_ASSIGN_OR_RETURN(int slot, next_slot(sent, peer));
    c.ready_to.push_back({peer, slot});
    prep.done_from.push_back({peer, slot});
    return Status::Ok();
  };
  // The next message from `peer` in `c`: wait for its `ready`, signal `done`.
  auto add_receive = [&](CommCall& c, int peer) -> Status {
    TP_ASSIGN_OR_RETURN(int slot, next_slot(received, peer));
    c.ready_from.push_back({peer, slot});
    c.done_to.push_back({peer, slot});
    return Status::Ok();
  };

  // Ring gemm_rs with copy engines: the sum steps of the last step's
  // additions (see below), appended after the plan's own steps.
  std::vector<PreparedStep> deferred_sums;

  const size_t planned = knobs_.full_weight ? 0 : plan.steps.size();  // full_weight: above
  for (size_t i = 0; i < planned; ++i) {
    const PlanStep& s = plan.steps[i];
    PreparedStep& ps = prep.steps[i];
    ps.stream = s.stream;
    ps.deps = s.deps;
    ps.is_gemm = s.kind == StepKind::kGemm;
    int64_t slot_rows = 0;
    for (RowRange r : s.rows) slot_rows = std::max(slot_rows, r.size());
    switch (s.kind) {
      case StepKind::kAllGather: {
        region[i] = next_region;
        slot_rows_of[i] = slot_rows;
        next_region += tp_ * slot_rows * row_x;
        ps.comm.kind = s.kind;
        ps.comm.send = {BufRef::kInput, (s.rows[rank_].begin - own.begin) * row_x};
        ps.comm.recv = {BufRef::kGather, region[i]};
        ps.comm.send_bytes = slot_rows * row_x;
        if (ce) {
          CommCall& c = ps.comm;
          c.copy_engine = true;
          for (int p = 0; p < tp_; ++p) {
            const size_t slot_offset = region[i] + p * slot_rows * row_x;
            if (p == rank_) {
              c.copy_src = c.send;
              c.copy_dst = {BufRef::kGather, slot_offset};
              c.copy_bytes = s.rows[p].size() * row_x;
              continue;
            }
            TP_RETURN_IF_ERROR(add_send(c, p));
            TP_RETURN_IF_ERROR(add_receive(c, p));
            if (!s.rows[p].empty()) {
              const size_t src = (s.rows[p].begin - ShardRows(m, tp_, p).begin) * row_x;
              c.pulls.push_back({p,
                                 {BufRef::kInput, src},
                                 {BufRef::kGather, slot_offset},
                                 static_cast<size_t>(s.rows[p].size()) * row_x});
            }
          }
        }
        break;
      }
      case StepKind::kReduceScatter: {
        const int g = s.deps.at(0);
        ps.comm.kind = s.kind;
        ps.comm.send = {BufRef::kPartial, region[g]};
        ps.comm.send_bytes = slot_rows * n;  // elements
        const RowRange mine = s.rows[rank_];
        const BufRef dst{BufRef::kY, (mine.begin - own.begin) * row_y};
        if (ce) {
          // Every peer's partial of this rank's rows (slot rank_ of the
          // peer's region) is added to this rank's own. Pipelined, copy
          // engines pull them while later chunks' GEMMs run, and the sum
          // reads local copies; in mode none nothing runs alongside, so the
          // sum kernel reads them over NVLink itself (one pass, no copy).
          CommCall& c = ps.comm;
          c.copy_engine = true;
          const bool direct = knobs_.mode == OverlapMode::kNone;
          const size_t slot_bytes = slot_rows * row_y;
          for (int p = 0; p < tp_; ++p) {
            if (p == rank_) continue;
            TP_RETURN_IF_ERROR(add_send(c, p));
            TP_RETURN_IF_ERROR(add_receive(c, p));
            if (!mine.empty() && !direct) {
              c.pulls.push_back({p,
                                 {BufRef::kPartial, region[g] + rank_ * slot_bytes},
                                 {BufRef::kReceived, region[g] + p * slot_bytes},
                                 static_cast<size_t>(mine.size()) * row_y});
            }
          }
          if (!mine.empty()) {
            c.sum = true;
            c.sum_args.direct = direct;
            c.sum_args.dst = dst;
            c.sum_args.count = mine.size() * n;
            for (int p = 0; p < tp_; ++p) {
              if (p == rank_) {
                c.sum_args.slots.push_back({BufRef::kPartial, region[g] + rank_ * slot_bytes});
              } else if (direct) {
                c.sum_args.slots.push_back({BufRef::kPartial, region[g] + rank_ * slot_bytes, p});
              } else {
                c.sum_args.slots.push_back({BufRef::kReceived, region[g] + p * slot_bytes});
              }
            }
          }
          break;
        }
        if (mine.size() == slot_rows) {
          ps.comm.recv = dst;
        } else {
          ps.comm.recv = {BufRef::kScratch, 0};
          if (!mine.empty()) {
            ps.comm.copy_src = {BufRef::kScratch, 0};
            ps.comm.copy_dst = dst;
            ps.comm.copy_bytes = mine.size() * row_y;
          }
        }
        break;
      }
      case StepKind::kSendRecv: {
        const size_t row = ag ? row_x : row_y;
        const auto src = ag ? BufRef::kGather : BufRef::kPartial;
        const auto dst = ag ? BufRef::kGather : BufRef::kReceived;
        ps.comm.kind = s.kind;
        ps.comm.send = {src, s.send_rows.begin * row};
        ps.comm.send_bytes = s.send_rows.size() * row;
        ps.comm.send_peer = s.send_peer;
        ps.comm.recv = {dst, s.recv_rows.begin * row};
        ps.comm.recv_bytes = s.recv_rows.size() * row;
        ps.comm.recv_peer = s.recv_peer;
        if (ce) {
          CommCall& c = ps.comm;
          c.copy_engine = true;
          if (c.send_peer >= 0) {
            TP_RETURN_IF_ERROR(add_send(c, c.send_peer));
          }
          if (c.recv_peer >= 0) {
            TP_RETURN_IF_ERROR(add_receive(c, c.recv_peer));
            // The sender's copy of the same buffer holds the rows at the
            // same offset (ring buffers are indexed by global row).
            if (c.recv_bytes > 0 && !in_place_) {  // in_place_: read there, not pulled
              c.pulls.push_back({c.recv_peer, {src, c.recv.offset}, c.recv, c.recv_bytes});
            }
          }
        }
        break;
      }
      case StepKind::kGemm: {
        if (ag && !ring && tp_ > 1) {
          // Rows come from the slots of the AllGather this GEMM waits for.
          const int g = s.deps.at(0);
          const PlanStep& gather = plan.steps[g];
          const int64_t srows = slot_rows_of[g];
          auto slot_of = [&](size_t idx) {
            for (int r = 0; r < tp_; ++r) {
              if (gather.rows[r] == s.rows[idx]) return r;
            }
            return -1;
          };
          auto a_of = [&](size_t idx) {
            return BufRef{BufRef::kGather, region[g] + slot_of(idx) * srows * row_x};
          };
          auto d_of = [&](size_t idx) { return BufRef{BufRef::kY, s.rows[idx].begin * row_y}; };
          ps.gemms = slot_gemms(s.rows, srows, a_of, d_of);
        } else if (!ag && !ring && tp_ > 1) {
          // Partials go to the send slots of the ReduceScatter that follows.
          region[i] = next_region;
          int64_t srows = 0;
          for (int r = 0; r < tp_; ++r) {
            srows = std::max(srows, ChunkRows(ShardRows(m, tp_, r), knobs_.chunks, s.chunk).size());
          }
          next_region += tp_ * srows * row_y;
          auto slot_of = [&](size_t idx) {
            for (int r = 0; r < tp_; ++r) {
              if (ChunkRows(ShardRows(m, tp_, r), knobs_.chunks, s.chunk) == s.rows[idx]) return r;
            }
            return -1;
          };
          auto a_of = [&](size_t idx) { return BufRef{BufRef::kInput, s.rows[idx].begin * row_x}; };
          auto d_of = [&](size_t idx) {
            return BufRef{BufRef::kPartial, region[i] + slot_of(idx) * srows * row_y};
          };
          ps.gemms = slot_gemms(s.rows, srows, a_of, d_of);
        } else {
          // Ring steps and tp = 1: each range is contiguous in global rows.
          for (RowRange r : s.rows) {
            BufRef a = ag ? BufRef{ring ? BufRef::kGather : BufRef::kInput,
                                   (ring ? r.begin : r.begin - own.begin) * row_x}
                          : BufRef{BufRef::kInput, r.begin * row_x};
            BufRef d;
            if (ag) {
              d = {BufRef::kY, r.begin * row_y};
            } else if (s.final_output) {
              d = {BufRef::kY, (r.begin - own.begin) * row_y};
            } else {
              d = {BufRef::kPartial, r.begin * row_y};
            }
            if (in_place_ && s.accumulate) {
              // in_place_: C is the running sum in the sender's `partial` (the receive step this
              // GEMM waits for says who sent it); that peer may reuse it after this GEMM.
              int recv_step = -1;
              for (int dep : s.deps) {
                if (plan.steps[dep].kind == StepKind::kSendRecv) recv_step = dep;
              }
              if (recv_step < 0 || prep.steps[recv_step].comm.recv_peer < 0) {
                return InternalError("layer " + name_ + ": in_place GEMM step " +
                                     std::to_string(i) + " has no receive step to read from");
              }
              CommCall& recv = prep.steps[recv_step].comm;
              GemmCall call = single(r.size(), a, d);
              call.c = {BufRef::kPartial, r.begin * row_y, recv.recv_peer};
              call.params.beta = 1.0f;
              ps.gemms.push_back(call);
              ps.done_to.insert(ps.done_to.end(), recv.done_to.begin(), recv.done_to.end());
              recv.done_to.clear();
              continue;
            }
            if (!ag && ce && knobs_.chunks == 1 && s.final_output && s.accumulate) {
              // The ring's last step with copy engines and one chunk: rather
              // than wait for the running sum to arrive and add it in the
              // GEMM's epilogue, compute this rank's own partial at once
              // (into its rows of `partial`, which no peer reads), while the
              // copy engine brings the running sum in, and add the two
              // afterwards with the sum kernel (deferred_sums). The last
              // transfer then hides under the last GEMM instead of sitting
              // between two GEMMs. With more chunks the accumulating GEMMs
              // already overlap each chunk's transfer with the next chunk's
              // GEMM, and the extra passes of the sums cost more than they
              // hide.
              d = {BufRef::kPartial, r.begin * row_y};
              // The GEMM waits for earlier GEMMs only; the sum, on the comm
              // stream, for the GEMM and the running sum's arrival.
              PreparedStep sum;
              sum.stream = StepStream::kComm;
              ps.deps.clear();
              for (int dep : s.deps) {
                (plan.steps[dep].kind == StepKind::kGemm ? ps.deps : sum.deps).push_back(dep);
              }
              sum.deps.push_back(static_cast<int>(i));
              sum.comm.copy_engine = true;  // no transfer of its own: the sum kernel alone
              sum.comm.sum = true;
              sum.comm.sum_args.slots = {d, {BufRef::kReceived, r.begin * row_y}};
              sum.comm.sum_args.dst = {BufRef::kY, (r.begin - own.begin) * row_y};
              sum.comm.sum_args.count = r.size() * n;
              deferred_sums.push_back(std::move(sum));
              ps.gemms.push_back(single(r.size(), a, d));
              continue;
            }
            GemmCall call = single(r.size(), a, d);
            if (s.accumulate) {
              call.c = {BufRef::kReceived, r.begin * row_y};
              call.params.beta = 1.0f;
            }
            ps.gemms.push_back(call);
          }
        }
        break;
      }
    }
  }
  if (deferred_sums.size() == 1) {
    const CommCall::Sum& sum = deferred_sums[0].comm.sum_args;
    if (sum.slots.size() == 2 && sum.dst.offset == 0 && sum.count == own.size() * n) {
      prep.split_sum_step = static_cast<int>(prep.steps.size());
    }
  }
  for (PreparedStep& sum : deferred_sums) prep.steps.push_back(std::move(sum));
  if (knobs_.gemm_lanes == 2) {
    const bool gemm_on_lane = AssignGemmLanes(prep.steps);
    prep.uses_lane = prep.uses_lane || gemm_on_lane;  // full_weight's copies may use it too
  }
  for (const PreparedStep& ps : prep.steps) {
    for (const GemmCall& call : ps.gemms) {
      TP_RETURN_IF_ERROR((ps.lane == 1 ? im.lane_gemm : im.gemm)
                             .Prepare(call.params)
                             .WithContext("layer " + name_));
    }
  }
  for (size_t i = 0; i < prep.steps.size(); ++i) {
    for (int d : prep.steps[i].deps) {
      if (StreamKey(prep.steps[d]) != StreamKey(prep.steps[i])) prep.steps[d].record_event = true;
    }
  }
  while (im.step_events.size() < prep.steps.size()) {
    TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(false));
    im.step_events.push_back(std::move(e));
  }
  if (in_place_ && !im.done_tokens.empty()) {  // empty: Create's own Prepare, before priming
    for (const PeerSignals::Flag& f : prep.done_from) {
      if (!im.done_tokens.count({f.peer, f.slot})) {
        return InternalError("layer " + name_ + ": the in_place plan for m=" + std::to_string(m) +
                             " waits for a `done` from rank " + std::to_string(f.peer) + " slot " +
                             std::to_string(f.slot) + " that the largest M's plan does not have");
      }
    }
  }
  prep.plan = std::move(plan);
  im.prepared.emplace(m, std::move(prep));
  return Status::Ok();
}

namespace {

// A copy-engine step on the comm stream `s`: signal this rank's messages
// ready, copy its own rows (AllGather), wait for the peers' messages and pull
// them.
template <typename Resolve>
Status EnqueuePeerTransfer(const CudaLinear::Impl& im, const CommCall& c, const Resolve& resolve,
                           cudaStream_t s) {
  if (c.copy_bytes > 0) {
    // The own rows' copy runs while the peers get ready.
    TP_RETURN_IF_ERROR(im.signals.Signal(PeerSignals::kReady, c.ready_to, s));
    if (c.copy_height > 0) {
      TP_CUDA_CHECK(cudaMemcpy2DAsync(resolve(c.copy_dst), c.copy_dst_pitch, resolve(c.copy_src),
                                      c.copy_src_pitch, c.copy_bytes, c.copy_height,
                                      cudaMemcpyDeviceToDevice, s));
    } else {
      TP_CUDA_CHECK(cudaMemcpyAsync(resolve(c.copy_dst), resolve(c.copy_src), c.copy_bytes,
                                    cudaMemcpyDeviceToDevice, s));
    }
    TP_RETURN_IF_ERROR(im.signals.Wait(PeerSignals::kReady, c.ready_from, s));
  } else {
    TP_RETURN_IF_ERROR(im.signals.SignalThenWait(PeerSignals::kReady, c.ready_to,
                                                 PeerSignals::kReady, c.ready_from, s));
  }
  for (const CommCall::Pull& p : c.pulls) {
    const PeerBuffer* src = im.PeerOf(p.src.base);
    if (src == nullptr) return InternalError("copy-engine pull from a buffer peers cannot map");
    if (p.height > 0) {
      TP_RETURN_IF_ERROR(src->CopyFromPeer2D(p.peer, p.src.offset, p.src_pitch, resolve(p.dst),
                                             p.dst_pitch, p.bytes, p.height, s));
    } else {
      TP_RETURN_IF_ERROR(src->CopyFromPeer(p.peer, p.src.offset, resolve(p.dst), p.bytes, s));
    }
  }
  return Status::Ok();
}

}  // namespace

Status CudaLinear::Run(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                       void* y, cudaStream_t stream) {
  return Enqueue(m, w, x_scale, w_scale, y, stream, Steps::kAll);
}

Status CudaLinear::RunSplit(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                            void* y, cudaStream_t stream, SplitOutput* split) {
  if (split == nullptr) {
    return InvalidArgumentError("layer " + name_ + ": RunSplit needs a SplitOutput");
  }
  return Enqueue(m, w, x_scale, w_scale, y, stream, Steps::kAll, split);
}

Status CudaLinear::RunGemmOnly(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                               void* y, cudaStream_t stream) {
  return Enqueue(m, w, x_scale, w_scale, y, stream, Steps::kGemm);
}

Status CudaLinear::RunCommOnly(int64_t m, void* y, cudaStream_t stream) {
  // The GEMM operands are never read; non-null placeholders pass the checks.
  const float* unit = impl_->unit_scales.as<float>();
  return Enqueue(m, impl_->unit_scales.data(), unit, unit + 4, y, stream, Steps::kComm);
}

Status CudaLinear::Enqueue(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                           void* y, cudaStream_t stream, Steps steps, SplitOutput* split) {
  const bool with_comm = steps != Steps::kGemm;
  const bool with_gemm = steps != Steps::kComm;
  if (closed_) return FailedPreconditionError("layer " + name_ + " is closed");
  Impl& im = *impl_;
  auto it = im.prepared.find(m);
  if (it == im.prepared.end()) {
    return FailedPreconditionError("layer " + name_ + ": Prepare(" + std::to_string(m) +
                                   ") has not run");
  }
  const bool fp8 = shape_.dtype == DataType::kFloat8E4M3;
  if (w == nullptr || (y == nullptr && output_elements(m) > 0) ||
      (fp8 && (x_scale == nullptr || w_scale == nullptr))) {
    return InvalidArgumentError("layer " + name_ + ": w, y" +
                                std::string(fp8 ? ", x_scale and w_scale" : "") +
                                " must be non-null");
  }
  const Prepared& prep = it->second;
  auto resolve = [&](BufRef r) -> char* {
    if (r.peer >= 0) {
      const PeerBuffer* b = im.PeerOf(r.base);
      return b == nullptr ? nullptr : static_cast<char*>(b->peer(r.peer)) + r.offset;
    }
    char* base = nullptr;
    switch (r.base) {
      case BufRef::kNone:
        return nullptr;
      case BufRef::kInput:
        base = static_cast<char*>(im.InputBase());
        break;
      case BufRef::kGather:
        base = static_cast<char*>(im.GatherBase());
        break;
      case BufRef::kPartial:
        base = static_cast<char*>(im.PartialBase());
        break;
      case BufRef::kReceived:
        base = im.received.as<char>();
        break;
      case BufRef::kScratch:
        base = im.scratch.as<char>();
        break;
      case BufRef::kY:
        base = static_cast<char*>(y);
        break;
    }
    return base + r.offset;
  };
  cudaStream_t side = im.comm_stream.get();
  cudaStream_t lane = im.lane_stream.get();
  auto stream_of = [&](const PreparedStep& ps) {
    const int key = StreamKey(ps);
    return key == 2 ? side : key == 1 ? lane : stream;
  };

  // Everything that can be refused is checked before the first enqueue: a
  // step refused after a peer was signalled would leave the peer waiting for
  // the rest, and this rank's flags half-set for the next Run.
  // A GEMM call's parameters with this run's scales.
  auto params_of = [&](const GemmCall& call) {
    GemmParams p = call.params;
    if (fp8) {
      p.a_scale = x_scale;
      p.b_scale = w_scale;
    }
    return p;
  };
  for (const PreparedStep& ps : prep.steps) {
    if (!ps.is_gemm || !with_gemm) continue;
    for (const GemmCall& call : ps.gemms) {
      if (Status st = CublasLtGemm::CheckPointers(params_of(call), resolve(call.a),
                                                  static_cast<const char*>(w) + call.b_offset,
                                                  resolve(call.c), resolve(call.d));
          !st.ok()) {
        return st.WithContext("layer '" + name_ + "'");
      }
    }
  }
  // RunSplit: the skipped sum step and the addends it would have read.
  const int skip = split != nullptr ? prep.split_sum_step : -1;
  if (split != nullptr) {
    *split = {y, nullptr};
    if (skip >= 0) {
      const std::vector<BufRef>& slots = prep.steps[skip].comm.sum_args.slots;
      *split = {resolve(slots[0]), resolve(slots[1])};
    }
  }
  if (with_comm && in_place_ && !prep.done_from.empty()) {
    // The peers have read what the last Run left in `partial`: it may be written again.
    TP_RETURN_IF_ERROR(im.signals.Wait(PeerSignals::kDone, prep.done_from, stream));
  }
  TP_RETURN_IF_ERROR(im.fork.Record(stream));
  TP_RETURN_IF_ERROR(im.fork.WaitOn(side));
  if (prep.uses_lane) TP_RETURN_IF_ERROR(im.fork.WaitOn(lane));
  for (size_t i = 0; i < prep.steps.size(); ++i) {
    if (static_cast<int>(i) == skip) continue;
    const PreparedStep& ps = prep.steps[i];
    if (!ps.is_gemm && !with_comm) continue;
    // Without GEMMs (RunCommOnly), a GEMM step that owes peers a `done` still sends it.
    if (ps.is_gemm && !with_gemm && ps.done_to.empty()) continue;
    cudaStream_t s = stream_of(ps);
    for (int d : ps.deps) {
      if (!with_comm && !prep.steps[d].is_gemm) continue;
      if (!with_gemm && prep.steps[d].is_gemm) continue;
      if (stream_of(prep.steps[d]) != s) TP_RETURN_IF_ERROR(im.step_events[d].WaitOn(s));
    }
    if (ps.is_gemm) {
      for (const GemmCall& call : ps.gemms) {
        if (!with_gemm) break;
        CublasLtGemm& gemm = ps.lane == 1 ? im.lane_gemm : im.gemm;
        TP_RETURN_IF_ERROR(gemm.Run(params_of(call), resolve(call.a),
                                    static_cast<const char*>(w) + call.b_offset, resolve(call.c),
                                    resolve(call.d), s));
      }
      if (with_comm) TP_RETURN_IF_ERROR(im.signals.Signal(PeerSignals::kDone, ps.done_to, s));
    } else if (ps.comm.copy_engine) {
      const CommCall& c = ps.comm;
      TP_RETURN_IF_ERROR(EnqueuePeerTransfer(im, c, resolve, s));
      if (c.sum) {
        // Pulled: the peers may reuse their partials now, then add. Direct:
        // they may once the sum has read them.
        const bool direct = c.sum_args.direct;
        if (!direct) TP_RETURN_IF_ERROR(im.signals.Signal(PeerSignals::kDone, c.done_to, s));
        SumSlotsParams sp;
        sp.dst = resolve(c.sum_args.dst);
        sp.num_slots = static_cast<int>(c.sum_args.slots.size());
        for (int k = 0; k < sp.num_slots && k < kMaxSumSlots; ++k) {
          sp.slots[k] = resolve(c.sum_args.slots[k]);
        }
        sp.count = c.sum_args.count;
        TP_RETURN_IF_ERROR(LaunchSumSlotsBf16(sp, s));
        if (direct) TP_RETURN_IF_ERROR(im.signals.Signal(PeerSignals::kDone, c.done_to, s));
        if (ps.record_event) TP_RETURN_IF_ERROR(im.step_events[i].Record(s));
        continue;
      }
      // GEMMs may start once the data is here; the `done` signal follows.
      if (ps.record_event) TP_RETURN_IF_ERROR(im.step_events[i].Record(s));
      TP_RETURN_IF_ERROR(im.signals.Signal(PeerSignals::kDone, c.done_to, s));
      continue;
    } else {
      const CommCall& c = ps.comm;
      switch (c.kind) {
        case StepKind::kAllGather:
          TP_RETURN_IF_ERROR(im.comm->AllGather(resolve(c.send), resolve(c.recv), c.send_bytes, s));
          break;
        case StepKind::kReduceScatter:
          TP_RETURN_IF_ERROR(im.comm->ReduceScatter(resolve(c.send), resolve(c.recv), c.send_bytes,
                                                    DataType::kBFloat16, s));
          if (c.copy_bytes > 0) {
            TP_CUDA_CHECK(cudaMemcpyAsync(resolve(c.copy_dst), resolve(c.copy_src), c.copy_bytes,
                                          cudaMemcpyDeviceToDevice, s));
          }
          break;
        case StepKind::kSendRecv:
          TP_RETURN_IF_ERROR(im.comm->SendRecv(resolve(c.send), c.send_bytes, c.send_peer,
                                               resolve(c.recv), c.recv_bytes, c.recv_peer, s));
          break;
        case StepKind::kGemm:
          break;
      }
    }
    if (ps.record_event) TP_RETURN_IF_ERROR(im.step_events[i].Record(s));
  }
  if (with_comm && !prep.done_from.empty() && !in_place_) {
    // Peers have pulled everything this rank sent: the caller may overwrite it.
    TP_RETURN_IF_ERROR(im.signals.Wait(PeerSignals::kDone, prep.done_from, side));
  }
  if (prep.uses_lane) {
    TP_RETURN_IF_ERROR(im.lane_join.Record(lane));
    TP_RETURN_IF_ERROR(im.lane_join.WaitOn(stream));
  }
  TP_RETURN_IF_ERROR(im.join.Record(side));
  return im.join.WaitOn(stream);
}

}  // namespace tpserve
