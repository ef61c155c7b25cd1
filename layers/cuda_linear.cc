#include "layers/cuda_linear.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>
#include <utility>

#include "comm/cuda_check.h"
#include "comm/peer_memory.h"
#include "layers/cuda_linear_steps.h"
#include "layers/scale_slots.h"
#include "layers/small_m_gemm.h"
#include "layers/sum_kernels.h"

namespace tpserve {

using cuda_linear_detail::BufRef;
using cuda_linear_detail::CommCall;
using cuda_linear_detail::GemmCall;
using cuda_linear_detail::Prepared;
using cuda_linear_detail::PreparedStep;
using cuda_linear_detail::StreamKey;

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

struct CudaLinear::Impl {
  NcclCommunicator* comm = nullptr;
  CublasLtGemm gemm;
  CudaStream comm_stream;
  CudaEvent fork, join;
  // full_weight with copy engines: the stream of the local copies of the own input columns,
  // and its join event.
  CudaStream copy_stream;
  CudaEvent copy_join;
  std::vector<CudaEvent> step_events;
  // Plain buffers; with copy engines, the buffers that peers pull from are
  // PeerBuffers instead (mapped on every rank).
  DeviceBuffer input, gather, partial, received, scratch, unit_scales, scales;
  PeerBuffer peer_input, peer_gather, peer_partial, peer_scales;
  PeerSignals signals;
  std::map<int64_t, Prepared> prepared;
  // in_place: the (peer, slot) `done` flags set at Create, which every plan's waits must use.
  std::set<std::pair<int, int>> done_tokens;

  void* InputBase() const { return peer_input.data() ? peer_input.data() : input.data(); }
  void* GatherBase() const { return peer_gather.data() ? peer_gather.data() : gather.data(); }
  void* PartialBase() const { return peer_partial.data() ? peer_partial.data() : partial.data(); }
  void* ScalesBase() const { return peer_scales.data() ? peer_scales.data() : scales.data(); }
  // The peer-mapped buffer behind `base` (copy engine only), or null.
  const PeerBuffer* PeerOf(BufRef::Base base) const {
    const PeerBuffer* b = base == BufRef::kInput     ? &peer_input
                          : base == BufRef::kGather  ? &peer_gather
                          : base == BufRef::kPartial ? &peer_partial
                          : base == BufRef::kScales  ? &peer_scales
                                                     : nullptr;
    return b != nullptr && b->data() != nullptr ? b : nullptr;
  }
  // Create's phases.
  Status CreateStreams(const std::string& name, const LinearKnobs& knobs,
                       GemmAlgoSelection gemm_algo);
  // The buffers the knobs' mode needs, for shape.max_m rows (copy engine: PeerBuffers where
  // peers pull from). INVALID_ARGUMENT for a copy-engine pipelined gemm_rs over more than
  // kMaxSumSlots ranks.
  Status AllocateBuffers(const std::string& name, const CudaLinearShape& shape,
                         const LinearKnobs& knobs, int tp);
  // Copy engine: FAILED_PRECONDITION if a peer of a PeerBuffer is a thread of this process.
  Status CheckPeersAreProcesses(const std::string& ctx, int tp) const;
  Status CreateUnitScales(const std::string& name);
  // in_place: sets every `done` flag that `largest` (the largest M's plan) sends, records the
  // flags it waits for in done_tokens, and waits until every rank has done the same.
  Status PrimeDoneFlags(const Prepared& largest);

  size_t Bytes() const {
    return input.size() + gather.size() + partial.size() + received.size() + scratch.size() +
           scales.size() + peer_input.bytes() + peer_gather.bytes() + peer_partial.bytes() +
           peer_scales.bytes() + gemm.workspace_bytes();
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
                                                         NcclCommPool& pool,
                                                         const CudaLinearOptions& options) {
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
  TP_RETURN_IF_ERROR(cuda_linear_detail::CheckScaleScheme(ctx, shape, knobs));
  TP_RETURN_IF_ERROR(cuda_linear_detail::CheckAccumulate(ctx, shape, pool.base().size()));

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
  TP_RETURN_IF_ERROR(im.CreateStreams(layer->name_, knobs, options.gemm_algo));

  const int tp = layer->tp_;
  TP_RETURN_IF_ERROR(im.AllocateBuffers(layer->name_, shape, knobs, tp));
  const int64_t chunks = knobs.chunks;
  const bool ce = knobs.copy_engine && tp > 1;
  if (ce) {
    TP_RETURN_IF_ERROR(im.CheckPeersAreProcesses(ctx, tp));
    // Messages between one pair of ranks per Run: at most chunks per
    // AllGather step, or (tp - 1) * chunks ring steps.
    TP_ASSIGN_OR_RETURN(im.signals, PeerSignals::Create(*im.comm, chunks * std::max(1, tp - 1),
                                                        layer->name_ + ".signals"));
  }
  TP_RETURN_IF_ERROR(im.CreateUnitScales(layer->name_));
  // ValidateLinearKnobs allows in_place only for gemm_rs rings with copy_engine.
  layer->in_place_ = ce && knobs.in_place;
  if (layer->in_place_) {
    // in_place: a peer reads this rank's `partial` until its last GEMM ends, so the wait for
    // its `done` (before `partial` may be written again) moves from the end of this Run,
    // where it would cost the ranks' skew, to the start of the next. Each `done` flag starts
    // set, as if a Run had gone before. The flags are those of the largest M's plan; a
    // smaller M's plan uses some of them (Prepare checks, once done_tokens is filled).
    TP_RETURN_IF_ERROR(layer->Prepare(shape.max_m));
    TP_RETURN_IF_ERROR(im.PrimeDoneFlags(im.prepared.at(shape.max_m)));
  }
  spdlog::debug("{}: rank {}/{} {} knobs {} device bytes {}", layer->name_, layer->rank_, tp,
                OverlapOpName(shape.op), knobs.ToString(), im.Bytes());
  return layer;
}

Status CudaLinear::Impl::CreateStreams(const std::string& name, const LinearKnobs& knobs,
                                       GemmAlgoSelection gemm_algo) {
  int least = 0, greatest = 0;
  TP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  // The comm stream outranks the GEMM's so that NCCL's kernels get SMs as
  // soon as they are launched instead of waiting behind GEMM waves.
  TP_ASSIGN_OR_RETURN(comm_stream, CudaStream::Create(true, greatest));
  TP_ASSIGN_OR_RETURN(fork, CudaEvent::Create(false));
  TP_ASSIGN_OR_RETURN(join, CudaEvent::Create(false));
  TP_ASSIGN_OR_RETURN(gemm, CublasLtGemm::Create(name, gemm_algo));
  // full_weight's local copies of the own input columns, which then run beside the pulls
  // instead of before them on the comm stream.
  if (knobs.full_weight && knobs.copy_engine) {
    TP_ASSIGN_OR_RETURN(copy_stream, CudaStream::Create(true, least));
    TP_ASSIGN_OR_RETURN(copy_join, CudaEvent::Create(false));
  }
  return Status::Ok();
}

Status CudaLinear::Impl::AllocateBuffers(const std::string& name, const CudaLinearShape& shape,
                                         const LinearKnobs& knobs, int tp) {
  const std::string ctx = "layer " + name;
  const int64_t chunks = knobs.chunks;
  const size_t row_x = shape.k * DataTypeSize(shape.dtype);
  const size_t row_y = shape.n * sizeof(uint16_t);
  const int64_t shard_max = CeilDiv(shape.max_m, tp);
  const bool ring = knobs.mode == OverlapMode::kRing;
  // Every buffer starts as zeros: rows a pass leaves unwritten (the padding rows past a
  // batch's tokens, which the engine's attention does not write into o's input) then hold
  // zeros or values of earlier rows, never what the allocation held (E4M3 NaN codes among it).
  auto alloc = [&](DeviceBuffer& buf, size_t bytes, const char* what) -> Status {
    TP_ASSIGN_OR_RETURN(buf, DeviceBuffer::Allocate(bytes, name + "." + what));
    if (bytes > 0) TP_CUDA_CHECK(cudaMemset(buf.data(), 0, bytes));
    return Status::Ok();
  };
  const bool ce = knobs.copy_engine && tp > 1;
  auto alloc_peer = [&](PeerBuffer& buf, size_t bytes, const char* what) -> Status {
    TP_ASSIGN_OR_RETURN(buf, PeerBuffer::Create(*comm, bytes, name + "." + what));
    if (bytes > 0) TP_CUDA_CHECK(cudaMemset(buf.data(), 0, bytes));
    return Status::Ok();
  };
  if (shape.op == OverlapOp::kAllGatherGemm) {
    if (ring) {
      if (ce) {
        TP_RETURN_IF_ERROR(alloc_peer(peer_gather, shape.max_m * row_x, "gather"));
      } else {
        TP_RETURN_IF_ERROR(alloc(gather, shape.max_m * row_x, "gather"));
      }
    } else {
      // One row of slack: a short chunk is sent padded to its step's size.
      const size_t input_bytes = (shard_max + 1) * row_x;
      if (ce) {
        TP_RETURN_IF_ERROR(alloc_peer(peer_input, input_bytes, "input"));
      } else {
        TP_RETURN_IF_ERROR(alloc(input, input_bytes, "input"));
      }
      TP_RETURN_IF_ERROR(alloc(gather, tp * (shard_max + chunks) * row_x, "gather"));
    }
  } else if (knobs.full_weight) {
    // Peers pull their rows' columns of this rank's input; the rank's own rows gather all
    // ranks' columns ([shard rows, tp * k]) for its whole-K GEMM.
    if (ce) {
      TP_RETURN_IF_ERROR(alloc_peer(peer_input, shape.max_m * row_x, "input"));
      TP_RETURN_IF_ERROR(alloc(gather, shard_max * tp * row_x, "gather"));
    } else {
      TP_RETURN_IF_ERROR(alloc(input, shape.max_m * row_x, "input"));
    }
  } else {
    TP_RETURN_IF_ERROR(alloc(input, shape.max_m * row_x, "input"));
    if (ring) {
      if (ce) {
        TP_RETURN_IF_ERROR(alloc_peer(peer_partial, shape.max_m * row_y, "partial"));
      } else {
        TP_RETURN_IF_ERROR(alloc(partial, shape.max_m * row_y, "partial"));
      }
      // in_place: the running sums are read where the peers left them, never copied here.
      if (!(ce && knobs.in_place)) {
        TP_RETURN_IF_ERROR(alloc(received, shape.max_m * row_y, "received"));
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
        TP_RETURN_IF_ERROR(alloc_peer(peer_partial, partial_bytes, "partial"));
        if (knobs.mode != OverlapMode::kNone) {
          TP_RETURN_IF_ERROR(alloc(received, partial_bytes, "received"));
        }
      } else {
        TP_RETURN_IF_ERROR(alloc(partial, partial_bytes, "partial"));
        TP_RETURN_IF_ERROR(alloc(scratch, (CeilDiv(shard_max, chunks) + 1) * row_y, "scratch"));
      }
    }
  }
  // Scale slots; an AllGather layer's peers pull theirs on copy engines.
  const int64_t scale_floats = cuda_linear_detail::ScaleSlotsFloats(shape, knobs, tp);
  if (scale_floats > 0 && ce && shape.op == OverlapOp::kAllGatherGemm) {
    TP_RETURN_IF_ERROR(alloc_peer(peer_scales, scale_floats * sizeof(float), "scales"));
  } else if (scale_floats > 0) {
    TP_RETURN_IF_ERROR(alloc(scales, scale_floats * sizeof(float), "scales"));
  }
  // The memsets ran on the legacy stream; the layer's streams are non-blocking.
  TP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  return Status::Ok();
}

Status CudaLinear::Impl::CheckPeersAreProcesses(const std::string& ctx, int tp) const {
  for (const PeerBuffer* b : {&peer_input, &peer_gather, &peer_partial, &peer_scales}) {
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
  return Status::Ok();
}

Status CudaLinear::Impl::CreateUnitScales(const std::string& name) {
  // Scales of 1.0 used while planning GEMMs (only the pointers' presence
  // matters for the algorithm choice).
  // Two scales 16 bytes apart: cuBLASLt wants scale pointers 16-byte aligned.
  TP_ASSIGN_OR_RETURN(unit_scales,
                      DeviceBuffer::Allocate(8 * sizeof(float), name + ".unit_scales"));
  const float ones[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  TP_CUDA_CHECK(cudaMemcpy(unit_scales.data(), ones, sizeof ones, cudaMemcpyHostToDevice));
  // A cudaMemcpy from pageable memory may return before its DMA lands; the
  // layer's streams are non-blocking, so wait for it (the legacy stream).
  TP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  return Status::Ok();
}

Status CudaLinear::Impl::PrimeDoneFlags(const Prepared& largest) {
  std::vector<PeerSignals::Flag> tokens;
  for (const PreparedStep& ps : largest.steps) {
    // A GEMM's, or a receive step's whose GEMM had no rows to read.
    tokens.insert(tokens.end(), ps.done_to.begin(), ps.done_to.end());
    tokens.insert(tokens.end(), ps.comm.done_to.begin(), ps.comm.done_to.end());
  }
  for (const PeerSignals::Flag& f : largest.done_from) {
    done_tokens.insert({f.peer, f.slot});
  }
  TP_RETURN_IF_ERROR(signals.Signal(PeerSignals::kDone, tokens, comm_stream.get()));
  TP_CUDA_CHECK(cudaStreamSynchronize(comm_stream.get()));
  return comm->Barrier();  // every rank's flags set before any Run
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
  cuda_linear_detail::StepsInput in;
  in.name = name_;
  in.shape = shape_;
  in.knobs = knobs_;
  in.tp = tp_;
  in.rank = rank_;
  in.m = m;
  in.in_place = in_place_;
  in.unit_scales = im.unit_scales.as<float>();
  in.signal_slots = im.signals.slots();
  TP_ASSIGN_OR_RETURN(OverlapPlan plan, MakeOverlapPlan(cuda_linear_detail::LayerPlanRequest(in)));
  TP_ASSIGN_OR_RETURN(Prepared prep, cuda_linear_detail::BuildPreparedSteps(in, plan));
  for (const PreparedStep& ps : prep.steps) {
    for (const GemmCall& call : ps.gemms) {
      TP_RETURN_IF_ERROR(im.gemm.Prepare(call.params).WithContext("layer " + name_));
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

// The address of `r` for a Run whose output is `y`.
char* ResolveRef(const CudaLinear::Impl& im, void* y, BufRef r) {
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
    case BufRef::kScales:
      base = static_cast<char*>(im.ScalesBase());
      break;
  }
  return base + r.offset;
}

// Copy-engine step `i` (`ps`) on stream `s`: its transfer, then either its sum (with the
// `done` signal before the sum when the sum reads pulled copies, after it when it reads the
// peers' memory) or, for a plain transfer, its event and then its `done` signal.
template <typename Resolve>
Status EnqueueCopyEngineStep(const CudaLinear::Impl& im, const PreparedStep& ps, size_t i,
                             const Resolve& resolve, cudaStream_t s) {
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
    return Status::Ok();
  }
  // GEMMs may start once the data is here; the `done` signal follows.
  if (ps.record_event) TP_RETURN_IF_ERROR(im.step_events[i].Record(s));
  return im.signals.Signal(PeerSignals::kDone, c.done_to, s);
}

// An NCCL communication step on stream `s` (its event is the caller's).
template <typename Resolve>
Status EnqueueNcclStep(const CudaLinear::Impl& im, const CommCall& c, const Resolve& resolve,
                       cudaStream_t s) {
  switch (c.kind) {
    case StepKind::kAllGather:
      TP_RETURN_IF_ERROR(im.comm->AllGather(resolve(c.send), resolve(c.recv), c.send_bytes, s));
      if (c.scales) {
        TP_RETURN_IF_ERROR(im.comm->AllGather(resolve(c.scale_send), resolve(c.scale_recv),
                                              c.scale_send_bytes, s));
      }
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
      if (c.scales) {
        TP_RETURN_IF_ERROR(im.comm->SendRecv(resolve(c.scale_send), c.scale_send_bytes, c.send_peer,
                                             resolve(c.scale_recv), c.scale_recv_bytes, c.recv_peer,
                                             s));
      }
      break;
    case StepKind::kGemm:
    case StepKind::kSum:  // copy-engine steps (their sum kernel), never NCCL's
    case StepKind::kPullGather:
    case StepKind::kPullRing:
    case StepKind::kPullReduce:
    case StepKind::kPullColumns:
      break;
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

namespace {

// The one GEMM call of the layer's plan for m when the layer is that call alone, on the
// small-M kernel, over the whole input into the whole output (RunSwiGlu's condition); else null.
const GemmCall* SoleSmallMCall(const CudaLinear::Impl& im, int tp, int64_t m) {
  auto it = im.prepared.find(m);
  if (tp != 1 || it == im.prepared.end()) return nullptr;
  const Prepared& prep = it->second;
  if (prep.steps.size() != 1 || !prep.steps[0].is_gemm || prep.steps[0].gemms.size() != 1 ||
      prep.uses_copy_stream || prep.scatter_scales || StreamKey(prep.steps[0]) != 0) {
    return nullptr;
  }
  const GemmCall& call = prep.steps[0].gemms[0];
  const GemmParams& p = call.params;
  const bool whole = p.m == m && call.d.base == BufRef::kY && call.d.offset == 0 &&
                     call.d.peer < 0 && call.c.base == BufRef::kNone &&
                     call.a_scale.base == BufRef::kNone && call.b_offset == 0;
  return whole && p.beta == 0.0f && SmallMGemmFits(ResolveGemmParams(p)) ? &call : nullptr;
}

}  // namespace

bool CudaLinear::CanRunSwiGlu(int64_t m) const {
  return !closed_ && SoleSmallMCall(*impl_, tp_, m) != nullptr;
}

Status CudaLinear::RunSwiGlu(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                             uint8_t* out, const float* out_scale, cudaStream_t stream) {
  if (closed_) return FailedPreconditionError("layer " + name_ + " is closed");
  const GemmCall* call = SoleSmallMCall(*impl_, tp_, m);
  if (call == nullptr) {
    return FailedPreconditionError("layer " + name_ + ": RunSwiGlu(" + std::to_string(m) +
                                   "): its plan is not one small-M GEMM (CanRunSwiGlu)");
  }
  if (w == nullptr || x_scale == nullptr || w_scale == nullptr) {
    return InvalidArgumentError("layer " + name_ + ": w, x_scale and w_scale must be non-null");
  }
  GemmParams p = ResolveGemmParams(call->params);
  p.a_scale = x_scale;
  p.b_scale = w_scale;
  return LaunchSmallMGemmSwiGlu(p, ResolveRef(*impl_, nullptr, call->a), w, out, p.n / 2, out_scale,
                                stream)
      .WithContext("layer " + name_);
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
  auto resolve = [&](BufRef r) -> char* { return ResolveRef(im, y, r); };
  cudaStream_t side = im.comm_stream.get();
  cudaStream_t copies = im.copy_stream.get();
  auto stream_of = [&](const PreparedStep& ps) {
    const int key = StreamKey(ps);
    return key == 2 ? side : key == 1 ? copies : stream;
  };

  // Everything that can be refused is checked before the first enqueue: a
  // step refused after a peer was signalled would leave the peer waiting for
  // the rest, and this rank's flags half-set for the next Run.
  // A GEMM call's parameters with this run's scales.
  auto params_of = [&](const GemmCall& call) {
    GemmParams p = call.params;
    if (fp8) {
      p.a_scale = call.a_scale.base != BufRef::kNone
                      ? reinterpret_cast<const float*>(resolve(call.a_scale))
                      : x_scale;
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
  if (prep.scatter_scales && with_gemm) {  // before the first transfer reads a slot
    ScatterScaleSlotsParams sp;
    sp.src = x_scale;
    sp.dst = static_cast<float*>(im.ScalesBase());
    sp.m = m;
    sp.tp = tp_;
    sp.chunks = knobs_.chunks;
    sp.groups = prep.scale_groups;
    sp.pitch = prep.scale_pitch;
    sp.only_shard = prep.scale_only_shard;
    TP_RETURN_IF_ERROR(LaunchScatterScaleSlots(sp, stream).WithContext("layer " + name_));
  }
  TP_RETURN_IF_ERROR(im.fork.Record(stream));
  TP_RETURN_IF_ERROR(im.fork.WaitOn(side));
  if (prep.uses_copy_stream) TP_RETURN_IF_ERROR(im.fork.WaitOn(copies));
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
        TP_RETURN_IF_ERROR(im.gemm.Run(params_of(call), resolve(call.a),
                                       static_cast<const char*>(w) + call.b_offset, resolve(call.c),
                                       resolve(call.d), s));
      }
      if (with_comm) TP_RETURN_IF_ERROR(im.signals.Signal(PeerSignals::kDone, ps.done_to, s));
    } else if (ps.comm.copy_engine) {
      TP_RETURN_IF_ERROR(EnqueueCopyEngineStep(im, ps, i, resolve, s));
      continue;  // its event is recorded inside
    } else {
      TP_RETURN_IF_ERROR(EnqueueNcclStep(im, ps.comm, resolve, s));
    }
    if (ps.record_event) TP_RETURN_IF_ERROR(im.step_events[i].Record(s));
  }
  if (with_comm && !prep.done_from.empty() && !in_place_) {
    // Peers have pulled everything this rank sent: the caller may overwrite it.
    TP_RETURN_IF_ERROR(im.signals.Wait(PeerSignals::kDone, prep.done_from, side));
  }
  if (prep.uses_copy_stream) {
    TP_RETURN_IF_ERROR(im.copy_join.Record(copies));
    TP_RETURN_IF_ERROR(im.copy_join.WaitOn(stream));
  }
  TP_RETURN_IF_ERROR(im.join.Record(side));
  return im.join.WaitOn(stream);
}

}  // namespace tpserve
