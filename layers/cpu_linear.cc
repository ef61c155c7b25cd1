#include "layers/cpu_linear.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
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

std::vector<float> DecodeAll(DataType dtype, const void* w, int64_t count) {
  std::vector<float> out(count);
  Decode(dtype, w, count, out.data());
  return out;
}

// One rank's GEMM operands. X rows are handled as records: a row's codes
// followed by its FP32 scales (none for per-tensor and BF16), so that rows
// moved between ranks carry their scales.
struct Gemm {
  DataType dtype = DataType::kBFloat16;
  Fp8Scheme scheme = Fp8Scheme::kPerTensor;
  int64_t n = 0, k = 0;
  std::vector<float> w;  // decoded [n, k]
  std::span<const float> w_scales;
  float scale = 1.0f;  // per-tensor FP8: x_scale * w_scale; otherwise 1
  int64_t x_scales_per_row = 0;
  size_t code_bytes = 0;    // k * element size
  size_t record_bytes = 0;  // code_bytes + 4 * x_scales_per_row

  explicit Gemm(const CpuLinearArgs& a)
      : dtype(a.dtype),
        scheme(a.dtype == DataType::kFloat8E4M3 ? a.scheme : Fp8Scheme::kPerTensor),
        n(a.n),
        k(a.k),
        w(DecodeAll(a.dtype, a.w, a.n * a.k)),
        w_scales(a.w_scales),
        scale(a.dtype == DataType::kFloat8E4M3 ? a.x_scale * a.w_scale : 1.0f),
        x_scales_per_row(Fp8ActivationScalesPerRow(scheme, a.k)),
        code_bytes(static_cast<size_t>(a.k) * DataTypeSize(a.dtype)),
        record_bytes(code_bytes + 4 * x_scales_per_row) {}

  // `rows` rows of x (codes) and their scales as records.
  std::vector<std::byte> Pack(const void* x, std::span<const float> x_scales, int64_t rows) const {
    std::vector<std::byte> out(rows * record_bytes);
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(out.data() + i * record_bytes, static_cast<const std::byte*>(x) + i * code_bytes,
                  code_bytes);
      if (x_scales_per_row > 0) {
        std::memcpy(out.data() + i * record_bytes + code_bytes,
                    x_scales.data() + i * x_scales_per_row, 4 * x_scales_per_row);
      }
    }
    return out;
  }

  // y[i, :] = round_bf16(x[i, :] · w^T, scaled per the scheme (+ acc[i, :]))
  // for `rows` records.
  void Rows(const std::byte* x, int64_t rows, const BFloat16* acc, BFloat16* y) const {
    std::vector<float> xrow(k), xs(std::max<int64_t>(x_scales_per_row, 1));
    for (int64_t i = 0; i < rows; ++i) {
      const std::byte* rec = x + i * record_bytes;
      Decode(dtype, rec, k, xrow.data());
      if (x_scales_per_row > 0) std::memcpy(xs.data(), rec + code_bytes, 4 * x_scales_per_row);
      for (int64_t j = 0; j < n; ++j) {
        float v = Dot(xrow.data(), xs.data(), j);
        if (acc != nullptr) v += BFloat16ToFloat(acc[i * n + j]);
        y[i * n + j] = FloatToBFloat16(v);
      }
    }
  }

 private:
  // The scaled dot product of a decoded x row (scales xs) with W's row j.
  float Dot(const float* xrow, const float* xs, int64_t j) const {
    const float* wr = w.data() + j * k;
    if (scheme == Fp8Scheme::kBlock) {
      const int64_t kb = Fp8BlockCount(k);
      const float* ws = w_scales.data() + (j / kFp8BlockSize) * kb;
      float sum = 0.0f;
      for (int64_t g = 0; g < kb; ++g) {
        const int64_t end = std::min(k, (g + 1) * kFp8BlockSize);
        float dot = 0.0f;
        for (int64_t t = g * kFp8BlockSize; t < end; ++t) dot += xrow[t] * wr[t];
        sum += dot * (xs[g] * ws[g]);
      }
      return sum;
    }
    float dot = 0.0f;
    for (int64_t t = 0; t < k; ++t) dot += xrow[t] * wr[t];
    if (scheme == Fp8Scheme::kPerChannel) return dot * (xs[0] * w_scales[j]);
    return dot * scale;
  }
};

// INVALID_ARGUMENT unless x_scales holds `rows` rows' scales and w_scales
// W's, for a scheme other than per-tensor (whose spans are unused).
Status CheckScales(const CpuLinearArgs& a, int64_t rows) {
  if (a.dtype != DataType::kFloat8E4M3 || a.scheme == Fp8Scheme::kPerTensor) return Status::Ok();
  const int64_t want_x = rows * Fp8ActivationScalesPerRow(a.scheme, a.k);
  const int64_t want_w = Fp8WeightScaleCount(a.scheme, a.n, a.k);
  if (static_cast<int64_t>(a.x_scales.size()) != want_x ||
      static_cast<int64_t>(a.w_scales.size()) != want_w) {
    return InvalidArgumentError(
        std::string("cpu linear: fp8 scheme ") + Fp8SchemeName(a.scheme) + " with " +
        std::to_string(rows) + " x rows, n=" + std::to_string(a.n) + " k=" + std::to_string(a.k) +
        " needs " + std::to_string(want_x) + " x scales and " + std::to_string(want_w) +
        " w scales, got " + std::to_string(a.x_scales.size()) + " and " +
        std::to_string(a.w_scales.size()));
  }
  return Status::Ok();
}

// Copy-engine messages (PlanRequest::copy_engine) between ranks as threads. The sender keeps
// a message's rows unchanged until the peer's `done`, so what the peer pulls is what was there
// when it was offered: an offer sends the rows at once (the communicator's Send does not wait),
// an await receives them, and a pull copies from what arrived. `done`s order nothing here.
class Mailbox {
 public:
  Mailbox(Communicator& comm, size_t row_bytes) : comm_(comm), row_bytes_(row_bytes) {}

  // Offers `mm.rows` of `rows_base` (the buffer's global row 0) to mm.peer.
  Status Offer(const PlanMessage& mm, const std::byte* rows_base) {
    if (mm.rows.empty()) return Status::Ok();
    return comm_.Send(rows_base + mm.rows.begin * row_bytes_, mm.rows.size() * row_bytes_, mm.peer,
                      nullptr);
  }
  Status Await(const PlanMessage& mm) {
    std::vector<std::byte>& box = inbox_[{mm.peer, mm.msg}];
    box.resize(mm.rows.size() * row_bytes_);
    rows_[{mm.peer, mm.msg}] = mm.rows;
    if (mm.rows.empty()) return Status::Ok();
    return comm_.Recv(box.data(), box.size(), mm.peer, nullptr);
  }
  // The pulled rows as they arrived (a plan ValidatePlan accepts awaited them first).
  StatusOr<const std::byte*> Pulled(const PlanMessage& pull) const {
    auto it = inbox_.find({pull.peer, pull.msg});
    if (it == inbox_.end()) {
      return InternalError("cpu linear: a pull of message " + std::to_string(pull.msg) +
                           " of rank " + std::to_string(pull.peer) + " before it was awaited");
    }
    const RowRange rows = rows_.at({pull.peer, pull.msg});
    return it->second.data() + (pull.rows.begin - rows.begin) * row_bytes_;
  }
  // Offers and awaits of `s`, in that order.
  Status Exchange(const PlanStep& s, const std::byte* rows_base) {
    for (const PlanMessage& mm : s.ready_to) TP_RETURN_IF_ERROR(Offer(mm, rows_base));
    for (const PlanMessage& mm : s.ready_from) TP_RETURN_IF_ERROR(Await(mm));
    return Status::Ok();
  }
  // Copies every pull of `s` to its rows of `dst_base` (global row 0).
  Status PullInto(const PlanStep& s, std::byte* dst_base) const {
    for (const PlanMessage& mm : s.pulls) {
      TP_ASSIGN_OR_RETURN(const std::byte* src, Pulled(mm));
      std::memcpy(dst_base + mm.rows.begin * row_bytes_, src, mm.rows.size() * row_bytes_);
    }
    return Status::Ok();
  }

 private:
  Communicator& comm_;
  size_t row_bytes_;
  std::map<std::pair<int, int>, std::vector<std::byte>> inbox_;
  std::map<std::pair<int, int>, RowRange> rows_;
};

Status RunAllGatherGemm(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& a) {
  const PlanRequest& q = plan.request;
  const Gemm gemm(a);
  const size_t row_bytes = gemm.record_bytes;
  const RowRange own = ShardRows(q.m, q.tp, q.rank);
  // The gathered X records in global row order; rows arrive step by step.
  std::vector<std::byte> gathered(static_cast<size_t>(q.m) * row_bytes);
  if (!own.empty()) {
    const std::vector<std::byte> mine = gemm.Pack(a.x, a.x_scales, own.size());
    std::memcpy(gathered.data() + own.begin * row_bytes, mine.data(), mine.size());
  }

  Mailbox mail(comm, row_bytes);
  for (const PlanStep& s : plan.steps) {
    switch (s.kind) {
      case StepKind::kPullGather:
      case StepKind::kPullRing:
        TP_RETURN_IF_ERROR(mail.Exchange(s, gathered.data()));
        TP_RETURN_IF_ERROR(mail.PullInto(s, gathered.data()));
        break;
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
          gemm.Rows(gathered.data() + r.begin * row_bytes, r.size(), nullptr, a.y + r.begin * a.n);
        }
        break;
      case StepKind::kReduceScatter:
      case StepKind::kPullReduce:
      case StepKind::kSum:
      case StepKind::kPullColumns:
        return InternalError("cpu linear: " + std::string(StepKindName(s.kind)) +
                             " step in an ag_gemm plan");
    }
  }
  return Status::Ok();
}

Status RunGemmReduceScatter(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& a) {
  const PlanRequest& q = plan.request;
  const Gemm gemm(a);
  const size_t row_bytes = gemm.record_bytes;
  const RowRange own = ShardRows(q.m, q.tp, q.rank);
  const std::vector<std::byte> records = gemm.Pack(a.x, a.x_scales, q.m);
  const std::byte* x = records.data();
  const size_t out_row = static_cast<size_t>(a.n);
  // This rank's partials and the partial sums received from its ring
  // neighbour, both in global row order.
  std::vector<BFloat16> partial(static_cast<size_t>(q.m) * out_row);
  std::vector<BFloat16> received(static_cast<size_t>(q.m) * out_row);
  const size_t partial_row_bytes = out_row * sizeof(BFloat16);
  Mailbox mail(comm, partial_row_bytes);
  auto* partial_bytes = reinterpret_cast<std::byte*>(partial.data());

  for (const PlanStep& s : plan.steps) {
    switch (s.kind) {
      case StepKind::kPullRing:
        TP_RETURN_IF_ERROR(mail.Exchange(s, partial_bytes));
        TP_RETURN_IF_ERROR(mail.PullInto(s, reinterpret_cast<std::byte*>(received.data())));
        break;
      case StepKind::kPullReduce: {
        // This rank's own partial and the peers' of its rows, in rank order, summed in FP32
        // and rounded once (as the ReduceScatter sums them).
        TP_RETURN_IF_ERROR(mail.Exchange(s, partial_bytes));
        const RowRange mine = s.rows[q.rank];
        if (mine.empty()) break;
        std::vector<const BFloat16*> addends(q.tp, partial.data() + mine.begin * out_row);
        for (const PlanMessage& mm : s.pulls) {
          TP_ASSIGN_OR_RETURN(const std::byte* src, mail.Pulled(mm));
          addends[mm.peer] = reinterpret_cast<const BFloat16*>(src);
        }
        BFloat16* dst = a.y + (mine.begin - own.begin) * out_row;
        for (size_t i = 0; i < static_cast<size_t>(mine.size()) * out_row; ++i) {
          float v = 0.0f;
          for (int r = 0; r < q.tp; ++r) v += BFloat16ToFloat(addends[r][i]);
          dst[i] = FloatToBFloat16(v);
        }
        break;
      }
      case StepKind::kGemm:
        for (RowRange r : s.rows) {
          BFloat16* dst = s.final_output ? a.y + (r.begin - own.begin) * out_row
                                         : partial.data() + r.begin * out_row;
          const BFloat16* acc = s.accumulate ? received.data() + r.begin * out_row : nullptr;
          gemm.Rows(x + r.begin * row_bytes, r.size(), acc, dst);
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
      case StepKind::kSum:
        // The deferred last sum: the own partial (already BF16) plus the received running sum,
        // added in FP32 and rounded once, as the GPU's sum kernel adds them.
        for (RowRange r : s.rows) {
          const size_t count = static_cast<size_t>(r.size()) * out_row;
          const BFloat16* p = partial.data() + r.begin * out_row;
          const BFloat16* q2 = received.data() + r.begin * out_row;
          BFloat16* dst = a.y + (r.begin - own.begin) * out_row;
          for (size_t i = 0; i < count; ++i) {
            dst[i] = FloatToBFloat16(BFloat16ToFloat(p[i]) + BFloat16ToFloat(q2[i]));
          }
        }
        break;
      case StepKind::kAllGather:
      case StepKind::kPullGather:
      case StepKind::kPullColumns:
        return InternalError("cpu linear: " + std::string(StepKindName(s.kind)) +
                             " step in a gemm_rs plan without full_weight");
    }
  }
  return Status::Ok();
}

// PlanRequest::full_weight: this rank's rows over the whole K. Row records of X here are a
// row's k codes of one K block: the own block from x, the peers' pulled (kPullColumns).
Status RunFullWeight(const OverlapPlan& plan, Communicator& comm, const CpuLinearArgs& a) {
  const PlanRequest& q = plan.request;
  if (a.dtype == DataType::kFloat8E4M3 && a.scheme != Fp8Scheme::kPerTensor) {
    return InvalidArgumentError(std::string("cpu linear: full_weight takes per-tensor scales, "
                                            "got fp8 scheme ") +
                                Fp8SchemeName(a.scheme));
  }
  if (a.w_full == nullptr) {
    return InvalidArgumentError("cpu linear: a full_weight plan needs w_full (the whole weight)");
  }
  const RowRange own = ShardRows(q.m, q.tp, q.rank);
  const size_t elt = DataTypeSize(a.dtype);
  const size_t block_bytes = static_cast<size_t>(a.k) * elt;
  // Block b of W ([n, k]) as one GEMM's operand, decoded when a step first multiplies by that
  // block alone (the ring's lead); whole-K steps take the whole W ([n, tp * k]) below.
  std::vector<std::vector<std::byte>> w_blocks(q.tp);
  std::vector<std::optional<Gemm>> block_gemms(q.tp);
  auto block_gemm = [&](int b) -> const Gemm& {
    if (!block_gemms[b]) {
      w_blocks[b].resize(a.n * block_bytes);
      for (int64_t j = 0; j < a.n; ++j) {
        std::memcpy(w_blocks[b].data() + j * block_bytes,
                    static_cast<const std::byte*>(a.w_full) + (j * q.tp + b) * block_bytes,
                    block_bytes);
      }
      CpuLinearArgs ab = a;
      ab.w = w_blocks[b].data();
      block_gemms[b].emplace(ab);
    }
    return *block_gemms[b];
  };
  CpuLinearArgs aw = a;
  aw.k = a.k * q.tp;
  aw.w = a.w_full;
  const Gemm whole(aw);
  // cols[b]: rank b's input columns, by global row (the own block is x itself).
  std::vector<std::vector<std::byte>> cols(q.tp);
  for (int b = 0; b < q.tp; ++b) {
    if (b != q.rank) cols[b].resize(static_cast<size_t>(q.m) * block_bytes);
  }
  auto block_rows = [&](int b, int64_t row) {
    return b == q.rank ? static_cast<const std::byte*>(a.x) + row * block_bytes
                       : cols[b].data() + row * block_bytes;
  };
  Mailbox mail(comm, block_bytes);
  for (const PlanStep& s : plan.steps) {
    if (s.kind == StepKind::kPullColumns) {
      TP_RETURN_IF_ERROR(mail.Exchange(s, static_cast<const std::byte*>(a.x)));
      for (const PlanMessage& mm : s.pulls) {
        TP_ASSIGN_OR_RETURN(const std::byte* src, mail.Pulled(mm));
        std::memcpy(cols[mm.peer].data() + mm.rows.begin * block_bytes, src,
                    mm.rows.size() * block_bytes);
      }
      continue;
    }
    if (s.kind != StepKind::kGemm) {
      return InternalError("cpu linear: " + std::string(StepKindName(s.kind)) +
                           " step in a full_weight plan");
    }
    bool in_order = static_cast<int>(s.k_blocks.size()) == q.tp;
    for (size_t i = 0; in_order && i < s.k_blocks.size(); ++i) {
      in_order = s.k_blocks[i] == static_cast<int>(i);
    }
    for (RowRange r : s.rows) {
      BFloat16* y = a.y + (r.begin - own.begin) * a.n;
      if (!s.add_to_output && s.k_blocks.size() > 1) {
        if (!in_order) {
          return InternalError("cpu linear: a full_weight GEMM writes K blocks out of order");
        }
        std::vector<std::byte> rec(static_cast<size_t>(r.size()) * q.tp * block_bytes);
        for (int64_t row = r.begin; row < r.end; ++row) {
          for (int b = 0; b < q.tp; ++b) {
            std::memcpy(rec.data() + ((row - r.begin) * q.tp + b) * block_bytes, block_rows(b, row),
                        block_bytes);
          }
        }
        whole.Rows(rec.data(), r.size(), nullptr, y);
        continue;
      }
      for (int b : s.k_blocks) {
        std::vector<std::byte> rec(static_cast<size_t>(r.size()) * block_bytes);
        for (int64_t row = r.begin; row < r.end; ++row) {
          std::memcpy(rec.data() + (row - r.begin) * block_bytes, block_rows(b, row), block_bytes);
        }
        const std::vector<BFloat16> acc(y, y + r.size() * a.n);
        block_gemm(b).Rows(rec.data(), r.size(), s.add_to_output ? acc.data() : nullptr, y);
      }
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
  TP_RETURN_IF_ERROR(CheckScales(args, ag ? ShardRows(q.m, q.tp, q.rank).size() : q.m));
  if (q.full_weight) return RunFullWeight(plan, comm, args);
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
  CpuLinearArgs a{dtype, n, k, x, x_scale, w, w_scale, y.data()};
  const Gemm gemm(a);
  gemm.Rows(static_cast<const std::byte*>(x), m, nullptr, y.data());
  return Status::Ok();
}

Status ReferenceLinearFp8(Fp8Scheme scheme, int64_t m, int64_t n, int64_t k,
                          std::span<const uint8_t> x, std::span<const float> x_scales,
                          std::span<const uint8_t> w, std::span<const float> w_scales,
                          std::span<BFloat16> y) {
  if (m < 1 || n < 1 || k < 1) {
    return InvalidArgumentError("reference linear: m, n, k must be >= 1");
  }
  if (x.size() != static_cast<size_t>(m * k) || w.size() != static_cast<size_t>(n * k) ||
      y.size() != static_cast<size_t>(m * n)) {
    return InvalidArgumentError("reference linear: x, w, y have " + std::to_string(x.size()) +
                                ", " + std::to_string(w.size()) + ", " + std::to_string(y.size()) +
                                " elements, expected m*k, n*k, m*n");
  }
  CpuLinearArgs a{DataType::kFloat8E4M3, n, k, x.data(), 1.0f, w.data(), 1.0f, y.data()};
  a.scheme = scheme;
  if (scheme == Fp8Scheme::kPerTensor) {
    if (x_scales.size() != 1 || w_scales.size() != 1) {
      return InvalidArgumentError("reference linear: per-tensor fp8 takes one x and one w scale");
    }
    a.x_scale = x_scales[0];
    a.w_scale = w_scales[0];
  } else {
    a.x_scales = x_scales;
    a.w_scales = w_scales;
    TP_RETURN_IF_ERROR(CheckScales(a, m));
  }
  const Gemm gemm(a);
  const std::vector<std::byte> records = gemm.Pack(x.data(), x_scales, m);
  gemm.Rows(records.data(), m, nullptr, y.data());
  return Status::Ok();
}

}  // namespace tpserve
