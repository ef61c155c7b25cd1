#include "layers/cpu_linear.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "layers/fp8.h"

namespace tpserve {
namespace {

Status CheckDType(DataType dtype) {
  if (dtype != DataType::kFloat8E4M3 && dtype != DataType::kBFloat16) {
    return InvalidArgumentError("cpu linear: operand dtype must be fp8_e4m3 or bf16, got " +
                                std::string(DataTypeName(dtype)));
  }
  return Status::Ok();
}

// Decodes `count` elements of `dtype` to float (exact for both types).
void Decode(DataType dtype, const void* src, int64_t count, float* dst) {
  if (dtype == DataType::kFloat8E4M3) {
    static const std::vector<float> lut = [] {
      std::vector<float> t(256);
      for (int c = 0; c < 256; ++c) t[c] = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
      return t;
    }();
    const auto* p = static_cast<const uint8_t*>(src);
    for (int64_t i = 0; i < count; ++i) dst[i] = lut[p[i]];
  } else {
    const auto* p = static_cast<const BFloat16*>(src);
    for (int64_t i = 0; i < count; ++i) dst[i] = BFloat16ToFloat(p[i]);
  }
}

// y[i, :] = round_bf16(scale * x[i, :] · w^T (+ acc[i, :])) for `rows` rows.
// `w` is already decoded ([n, k] floats).
void GemmRows(DataType dtype, const std::byte* x, int64_t rows, const std::vector<float>& w,
              int64_t n, int64_t k, float scale, const BFloat16* acc, BFloat16* y) {
  const size_t row_bytes = static_cast<size_t>(k) * DataTypeSize(dtype);
  std::vector<float> xrow(k);
  for (int64_t i = 0; i < rows; ++i) {
    Decode(dtype, x + i * row_bytes, k, xrow.data());
    for (int64_t j = 0; j < n; ++j) {
      const float* wr = w.data() + j * k;
      float dot = 0.0f;
      for (int64_t t = 0; t < k; ++t) dot += xrow[t] * wr[t];
      float v = dot * scale;
      if (acc != nullptr) v += BFloat16ToFloat(acc[i * n + j]);
      y[i * n + j] = FloatToBFloat16(v);
    }
  }
}

std::vector<float> DecodeAll(DataType dtype, const void* w, int64_t count) {
  std::vector<float> out(count);
  Decode(dtype, w, count, out.data());
  return out;
}

Status RunAllGatherGemm(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& a) {
  const PlanRequest& q = plan.request;
  const size_t row_bytes = static_cast<size_t>(a.k) * DataTypeSize(a.dtype);
  const RowRange own = ShardRows(q.m, q.tp, q.rank);
  // The gathered X in global row order; rows arrive step by step.
  std::vector<std::byte> gathered(static_cast<size_t>(q.m) * row_bytes);
  if (!own.empty()) {
    std::memcpy(gathered.data() + own.begin * row_bytes, a.x, own.size() * row_bytes);
  }
  const std::vector<float> w = DecodeAll(a.dtype, a.w, a.n * a.k);
  const float scale = a.dtype == DataType::kFloat8E4M3 ? a.x_scale * a.w_scale : 1.0f;

  for (const PlanStep& s : plan.steps) {
    switch (s.kind) {
      case StepKind::kAllGather: {
        // Equal-size contributions, as NCCL needs: pad to the largest.
        int64_t max_rows = 0;
        for (RowRange r : s.rows) max_rows = std::max(max_rows, r.size());
        const size_t slot = static_cast<size_t>(max_rows) * row_bytes;
        std::vector<std::byte> send(slot), recv(slot * q.tp);
        const RowRange mine = s.rows[q.rank];
        if (!mine.empty()) {
          std::memcpy(send.data(), gathered.data() + mine.begin * row_bytes,
                      mine.size() * row_bytes);
        }
        TP_RETURN_IF_ERROR(comm.AllGather(send.data(), recv.data(), slot, nullptr));
        for (int r = 0; r < q.tp; ++r) {
          if (r == q.rank || s.rows[r].empty()) continue;
          std::memcpy(gathered.data() + s.rows[r].begin * row_bytes, recv.data() + r * slot,
                      s.rows[r].size() * row_bytes);
        }
        break;
      }
      case StepKind::kSendRecv:
        TP_RETURN_IF_ERROR(comm.SendRecv(gathered.data() + s.send_rows.begin * row_bytes,
                                         s.send_rows.size() * row_bytes, s.send_peer,
                                         gathered.data() + s.recv_rows.begin * row_bytes,
                                         s.recv_rows.size() * row_bytes, s.recv_peer, nullptr));
        break;
      case StepKind::kGemm:
        for (RowRange r : s.rows) {
          GemmRows(a.dtype, gathered.data() + r.begin * row_bytes, r.size(), w, a.n, a.k, scale,
                   nullptr, a.y + r.begin * a.n);
        }
        break;
      case StepKind::kReduceScatter:
        return InternalError("cpu linear: reducescatter step in an ag_gemm plan");
    }
  }
  return Status::Ok();
}

Status RunGemmReduceScatter(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& a) {
  const PlanRequest& q = plan.request;
  const size_t row_bytes = static_cast<size_t>(a.k) * DataTypeSize(a.dtype);
  const RowRange own = ShardRows(q.m, q.tp, q.rank);
  const auto* x = static_cast<const std::byte*>(a.x);
  const std::vector<float> w = DecodeAll(a.dtype, a.w, a.n * a.k);
  const float scale = a.dtype == DataType::kFloat8E4M3 ? a.x_scale * a.w_scale : 1.0f;
  const size_t out_row = static_cast<size_t>(a.n);
  // This rank's partials and the partial sums received from its ring
  // neighbour, both in global row order.
  std::vector<BFloat16> partial(static_cast<size_t>(q.m) * out_row);
  std::vector<BFloat16> received(static_cast<size_t>(q.m) * out_row);

  for (const PlanStep& s : plan.steps) {
    switch (s.kind) {
      case StepKind::kGemm:
        for (RowRange r : s.rows) {
          BFloat16* dst = s.final_output ? a.y + (r.begin - own.begin) * out_row
                                         : partial.data() + r.begin * out_row;
          const BFloat16* acc = s.accumulate ? received.data() + r.begin * out_row : nullptr;
          GemmRows(a.dtype, x + r.begin * row_bytes, r.size(), w, a.n, a.k, scale, acc, dst);
        }
        break;
      case StepKind::kReduceScatter: {
        int64_t max_rows = 0;
        for (RowRange r : s.rows) max_rows = std::max(max_rows, r.size());
        const size_t slot = static_cast<size_t>(max_rows) * out_row;
        std::vector<BFloat16> send(slot * q.tp), recv(slot);
        for (int r = 0; r < q.tp; ++r) {
          if (s.rows[r].empty()) continue;
          std::memcpy(send.data() + r * slot, partial.data() + s.rows[r].begin * out_row,
                      s.rows[r].size() * out_row * sizeof(BFloat16));
        }
        TP_RETURN_IF_ERROR(
            comm.ReduceScatter(send.data(), recv.data(), slot, DataType::kBFloat16, nullptr));
        const RowRange mine = s.rows[q.rank];
        if (!mine.empty()) {
          std::memcpy(a.y + (mine.begin - own.begin) * out_row, recv.data(),
                      mine.size() * out_row * sizeof(BFloat16));
        }
        break;
      }
      case StepKind::kSendRecv:
        TP_RETURN_IF_ERROR(comm.SendRecv(partial.data() + s.send_rows.begin * out_row,
                                         s.send_rows.size() * out_row * sizeof(BFloat16),
                                         s.send_peer, received.data() + s.recv_rows.begin * out_row,
                                         s.recv_rows.size() * out_row * sizeof(BFloat16),
                                         s.recv_peer, nullptr));
        break;
      case StepKind::kAllGather:
        return InternalError("cpu linear: allgather step in a gemm_rs plan");
    }
  }
  return Status::Ok();
}

}  // namespace

Status RunCpuLinear(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& args) {
  const PlanRequest& q = plan.request;
  if (comm.size() != q.tp || comm.rank() != q.rank) {
    return InvalidArgumentError("cpu linear: plan is for rank " + std::to_string(q.rank) + " of " +
                                std::to_string(q.tp) + " but the communicator is rank " +
                                std::to_string(comm.rank()) + " of " + std::to_string(comm.size()));
  }
  TP_RETURN_IF_ERROR(CheckDType(args.dtype));
  if (args.n < 1 || args.k < 1) {
    return InvalidArgumentError("cpu linear: n and k must be >= 1, got n=" +
                                std::to_string(args.n) + " k=" + std::to_string(args.k));
  }
  // x (AG+GEMM) or y (GEMM+RS) is empty, and may be null, on a rank whose
  // shard has no rows.
  const bool ag = q.op == OverlapOp::kAllGatherGemm;
  const bool shard_empty = ShardRows(q.m, q.tp, q.rank).empty();
  if (args.w == nullptr || (args.x == nullptr && !(ag && shard_empty)) ||
      (args.y == nullptr && !(!ag && shard_empty))) {
    return InvalidArgumentError("cpu linear: x, w and y must be non-null");
  }
  if (ag) return RunAllGatherGemm(plan, comm, args);
  return RunGemmReduceScatter(plan, comm, args);
}

Status ReferenceLinear(DataType dtype, int64_t m, int64_t n, int64_t k, const void* x,
                       float x_scale, const void* w, float w_scale, std::span<BFloat16> y) {
  TP_RETURN_IF_ERROR(CheckDType(dtype));
  if (m < 1 || n < 1 || k < 1) {
    return InvalidArgumentError("reference linear: m, n, k must be >= 1");
  }
  if (y.size() != static_cast<size_t>(m * n)) {
    return InvalidArgumentError("reference linear: y has " + std::to_string(y.size()) +
                                " elements, expected m*n = " + std::to_string(m * n));
  }
  const float scale = dtype == DataType::kFloat8E4M3 ? x_scale * w_scale : 1.0f;
  GemmRows(dtype, static_cast<const std::byte*>(x), m, DecodeAll(dtype, w, n * k), n, k, scale,
           nullptr, y.data());
  return Status::Ok();
}

}  // namespace tpserve
