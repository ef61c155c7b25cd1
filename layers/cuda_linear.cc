#include "layers/cuda_linear.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "comm/cuda_check.h"

namespace tpserve {
namespace {

// A place in one of the layer's buffers (or the caller's w / y).
struct BufRef {
  enum Base : uint8_t { kNone, kInput, kGather, kPartial, kReceived, kScratch, kY } base = kNone;
  size_t offset = 0;  // bytes
};

struct GemmCall {
  GemmParams params;  // scale pointers filled in at Run
  BufRef a, c, d;
};

struct CommCall {
  StepKind kind = StepKind::kAllGather;
  BufRef send, recv;
  size_t send_bytes = 0;  // AllGather: bytes per rank; ReduceScatter: elements per rank
  size_t recv_bytes = 0;  // SendRecv only
  int send_peer = -1, recv_peer = -1;
  BufRef copy_src, copy_dst;  // ReduceScatter with a short own chunk: scratch -> y
  size_t copy_bytes = 0;
};

struct PreparedStep {
  StepStream stream = StepStream::kCompute;
  std::vector<int> deps;
  bool is_gemm = false;
  std::vector<GemmCall> gemms;
  CommCall comm;
  bool record_event = false;  // a later step on the other stream waits for it
};

struct Prepared {
  OverlapPlan plan;
  std::vector<PreparedStep> steps;
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

struct CudaLinear::Impl {
  NcclCommunicator* comm = nullptr;
  CublasLtGemm gemm;
  CudaStream comm_stream;
  CudaEvent fork, join;
  std::vector<CudaEvent> step_events;
  // Plain buffers, or symmetric NCCL windows for copy-engine AllGather.
  DeviceBuffer input, gather, partial, received, scratch, unit_scales;
  NcclSymmetricBuffer sym_input, sym_gather;
  std::map<int64_t, Prepared> prepared;

  void* InputBase() const { return sym_input.data() ? sym_input.data() : input.data(); }
  void* GatherBase() const { return sym_gather.data() ? sym_gather.data() : gather.data(); }
  size_t Bytes() const {
    return input.size() + gather.size() + partial.size() + received.size() + scratch.size() +
           sym_input.bytes() + sym_gather.bytes() + gemm.workspace_bytes();
  }
};

CudaLinear::~CudaLinear() = default;

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
  if (shape.op == OverlapOp::kAllGatherGemm) {
    if (ring) {
      TP_RETURN_IF_ERROR(alloc(im.gather, shape.max_m * row_x, "gather"));
    } else {
      // One row of slack: a short chunk is sent padded to its step's size.
      const size_t input_bytes = (shard_max + 1) * row_x;
      const size_t gather_bytes = tp * (shard_max + chunks) * row_x;
      if (knobs.copy_engine) {
        TP_ASSIGN_OR_RETURN(im.sym_input, NcclSymmetricBuffer::Create(*im.comm, input_bytes,
                                                                      layer->name_ + ".input"));
        TP_ASSIGN_OR_RETURN(im.sym_gather, NcclSymmetricBuffer::Create(*im.comm, gather_bytes,
                                                                       layer->name_ + ".gather"));
      } else {
        TP_RETURN_IF_ERROR(alloc(im.input, input_bytes, "input"));
        TP_RETURN_IF_ERROR(alloc(im.gather, gather_bytes, "gather"));
      }
    }
  } else {
    TP_RETURN_IF_ERROR(alloc(im.input, shape.max_m * row_x, "input"));
    if (ring) {
      TP_RETURN_IF_ERROR(alloc(im.partial, shape.max_m * row_y, "partial"));
      TP_RETURN_IF_ERROR(alloc(im.received, shape.max_m * row_y, "received"));
    } else {
      TP_RETURN_IF_ERROR(alloc(im.partial, tp * (shard_max + chunks) * row_y, "partial"));
      TP_RETURN_IF_ERROR(alloc(im.scratch, (CeilDiv(shard_max, chunks) + 1) * row_y, "scratch"));
    }
  }
  // Scales of 1.0 used while planning GEMMs (only the pointers' presence
  // matters for the algorithm choice).
  // Two scales 16 bytes apart: cuBLASLt wants scale pointers 16-byte aligned.
  TP_RETURN_IF_ERROR(alloc(im.unit_scales, 8 * sizeof(float), "unit_scales"));
  const float ones[8] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  TP_CUDA_CHECK(cudaMemcpy(im.unit_scales.data(), ones, sizeof ones, cudaMemcpyHostToDevice));
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
  prep.steps.resize(plan.steps.size());
  // AG slot layout: where each AllGather step's slots start, and their rows.
  std::vector<size_t> region(plan.steps.size(), 0);
  std::vector<int64_t> slot_rows_of(plan.steps.size(), 0);
  size_t next_region = 0;

  for (size_t i = 0; i < plan.steps.size(); ++i) {
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
        break;
      }
      case StepKind::kReduceScatter: {
        const int g = s.deps.at(0);
        ps.comm.kind = s.kind;
        ps.comm.send = {BufRef::kPartial, region[g]};
        ps.comm.send_bytes = slot_rows * n;  // elements
        const RowRange mine = s.rows[rank_];
        const BufRef dst{BufRef::kY, (mine.begin - own.begin) * row_y};
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
            GemmCall call = single(r.size(), a, d);
            if (s.accumulate) {
              call.c = {BufRef::kReceived, r.begin * row_y};
              call.params.beta = 1.0f;
            }
            ps.gemms.push_back(call);
          }
        }
        for (const GemmCall& call : ps.gemms) {
          TP_RETURN_IF_ERROR(im.gemm.Prepare(call.params).WithContext("layer " + name_));
        }
        break;
      }
    }
  }
  for (size_t i = 0; i < prep.steps.size(); ++i) {
    for (int d : prep.steps[i].deps) {
      if (prep.steps[d].stream != prep.steps[i].stream) prep.steps[d].record_event = true;
    }
  }
  while (im.step_events.size() < prep.steps.size()) {
    TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(false));
    im.step_events.push_back(std::move(e));
  }
  prep.plan = std::move(plan);
  im.prepared.emplace(m, std::move(prep));
  return Status::Ok();
}

Status CudaLinear::Run(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                       void* y, cudaStream_t stream) {
  return Enqueue(m, w, x_scale, w_scale, y, stream, /*with_comm=*/true);
}

Status CudaLinear::RunGemmOnly(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                               void* y, cudaStream_t stream) {
  return Enqueue(m, w, x_scale, w_scale, y, stream, /*with_comm=*/false);
}

Status CudaLinear::Enqueue(int64_t m, const void* w, const float* x_scale, const float* w_scale,
                           void* y, cudaStream_t stream, bool with_comm) {
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
        base = im.partial.as<char>();
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
  auto stream_of = [&](const PreparedStep& ps) {
    return ps.stream == StepStream::kComm ? side : stream;
  };

  TP_RETURN_IF_ERROR(im.fork.Record(stream));
  TP_RETURN_IF_ERROR(im.fork.WaitOn(side));
  for (size_t i = 0; i < prep.steps.size(); ++i) {
    const PreparedStep& ps = prep.steps[i];
    if (!ps.is_gemm && !with_comm) continue;
    cudaStream_t s = stream_of(ps);
    for (int d : ps.deps) {
      if (!with_comm && !prep.steps[d].is_gemm) continue;
      if (stream_of(prep.steps[d]) != s) TP_RETURN_IF_ERROR(im.step_events[d].WaitOn(s));
    }
    if (ps.is_gemm) {
      for (const GemmCall& call : ps.gemms) {
        GemmParams p = call.params;
        if (fp8) {
          p.a_scale = x_scale;
          p.b_scale = w_scale;
        }
        TP_RETURN_IF_ERROR(im.gemm.Run(p, resolve(call.a), w, resolve(call.c), resolve(call.d), s));
      }
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
  TP_RETURN_IF_ERROR(im.join.Record(side));
  return im.join.WaitOn(stream);
}

}  // namespace tpserve
