#include "layers/linear_problem.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>

#include "comm/local_communicator.h"
#include "layers/fp8.h"

namespace tpserve {

int64_t LinearProblem::OutputElements(int rank) const {
  if (op == OverlapOp::kAllGatherGemm) return m * n_local();
  return ShardRows(m, tp, rank).size() * n;
}

CpuLinearArgs LinearProblem::ArgsFor(int rank, BFloat16* y) const {
  CpuLinearArgs a;
  a.dtype = dtype;
  a.n = n_local();
  a.k = k_local();
  a.x = x_local[rank].data();
  a.x_scale = x_scale;
  a.w = w_local[rank].data();
  a.w_scale = w_scale;
  a.y = y;
  if (op == OverlapOp::kGemmReduceScatter) a.w_full = w.data();  // [n, tp * k_local]
  if (scheme != Fp8Scheme::kPerTensor) {
    a.scheme = scheme;
    a.x_scales = x_scales_local[rank];
    a.w_scales = w_scales_local[rank];
  }
  return a;
}

namespace {

// Fine scales: for each row of X and of W (per channel) or each 1x128 group of X and 128x128
// block of W (block), 4 sigma / 448 times 2^e, e drawn from -2 .. 2; X and W quantized with
// them; and each rank's share of codes and scales.
Status FillFineScaled(LinearProblem& p, std::mt19937& rng) {
  const bool block = p.scheme == Fp8Scheme::kBlock;
  const int64_t m = p.m, n = p.n, k = p.k, tp = p.tp;
  const int64_t nl = p.n_local(), kl = p.k_local();
  const bool ag = p.op == OverlapOp::kAllGatherGemm;
  if (block && (nl % kFp8BlockSize != 0 || kl % kFp8BlockSize != 0)) {
    return InvalidArgumentError(
        "linear problem: scheme block needs each rank's n and k to be "
        "multiples of 128, got n=" +
        std::to_string(nl) + " k=" + std::to_string(kl));
  }
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-2, 2);
  const float base = 4.0f / kFp8E4M3Max;
  auto draw = [&](std::vector<float>& s, int64_t count) {
    s.resize(count);
    for (float& v : s) v = std::ldexp(base, exponent(rng));
  };
  const int64_t gk = block ? k / kFp8BlockSize : 1;  // X scales per row
  draw(p.x_scales, m * gk);
  draw(p.w_scales, Fp8WeightScaleCount(p.scheme, n, k));
  p.x.resize(m * k);
  p.w.resize(n * k);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < k; ++c) {
      p.x[i * k + c] = FloatToFp8E4M3(dist(rng) / p.x_scales[i * gk + (block ? c / 128 : 0)]);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < k; ++c) {
      const float s = block ? p.w_scales[(j / 128) * gk + c / 128] : p.w_scales[j];
      p.w[j * k + c] = FloatToFp8E4M3(dist(rng) / s);
    }
  }
  p.x_scales_local.resize(tp);
  p.w_scales_local.resize(tp);
  const int64_t gl = block ? kl / kFp8BlockSize : 1;  // a rank's X scales per row
  for (int r = 0; r < tp; ++r) {
    std::vector<float>& xs = p.x_scales_local[r];
    std::vector<float>& ws = p.w_scales_local[r];
    if (ag) {  // the shard's rows; W's rows [r * nl, (r + 1) * nl)
      const RowRange s = ShardRows(m, static_cast<int>(tp), r);
      xs.assign(p.x_scales.begin() + s.begin * gk, p.x_scales.begin() + s.end * gk);
      const int64_t w_rows = block ? nl / kFp8BlockSize : nl;
      ws.assign(p.w_scales.begin() + r * w_rows * gk, p.w_scales.begin() + (r + 1) * w_rows * gk);
    } else if (!block) {  // every row, each K slice with its row's scale; W's rows all
      xs = p.x_scales;
      ws = p.w_scales;
    } else {  // the groups and blocks of columns [r * kl, (r + 1) * kl)
      for (int64_t i = 0; i < m; ++i) {
        xs.insert(xs.end(), p.x_scales.begin() + i * gk + r * gl,
                  p.x_scales.begin() + i * gk + (r + 1) * gl);
      }
      for (int64_t b = 0; b < n / kFp8BlockSize; ++b) {
        ws.insert(ws.end(), p.w_scales.begin() + b * gk + r * gl,
                  p.w_scales.begin() + b * gk + (r + 1) * gl);
      }
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<LinearProblem> MakeRandomLinearProblem(OverlapOp op, DataType dtype, int tp, int64_t m,
                                                int64_t n, int64_t k, uint32_t seed,
                                                Fp8Scheme scheme) {
  if (dtype != DataType::kFloat8E4M3 && dtype != DataType::kBFloat16) {
    return InvalidArgumentError("linear problem: dtype must be fp8_e4m3 or bf16");
  }
  if (tp < 1 || m < 1 || n < 1 || k < 1) {
    return InvalidArgumentError("linear problem: tp, m, n, k must be >= 1");
  }
  // Each operand and the output is held on the host (several copies): m x k, n x k and m x n
  // elements each at most 2^34, which also keeps every byte count within int64.
  constexpr int64_t kMaxElements = int64_t{1} << 34;
  const std::tuple<int64_t, int64_t, const char*> products[] = {
      {m, k, "m x k"}, {n, k, "n x k"}, {m, n, "m x n"}};
  for (const auto& [a, b, what] : products) {
    if (a > kMaxElements / b) {
      return InvalidArgumentError("linear problem: " + std::string(what) + " = " +
                                  std::to_string(a) + " x " + std::to_string(b) +
                                  " elements, more than 2^34 (17179869184)");
    }
  }
  const bool ag = op == OverlapOp::kAllGatherGemm;
  if ((ag ? n : k) % tp != 0) {
    return InvalidArgumentError(std::string("linear problem: ") + (ag ? "n" : "k") + "=" +
                                std::to_string(ag ? n : k) +
                                " does not divide by tp=" + std::to_string(tp));
  }
  LinearProblem p;
  p.op = op;
  p.dtype = dtype;
  p.tp = tp;
  p.m = m;
  p.n = n;
  p.k = k;
  const size_t e = DataTypeSize(dtype);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  if (dtype == DataType::kFloat8E4M3) {
    p.x_scale = 4.0f / kFp8E4M3Max;
    p.w_scale = 4.0f / kFp8E4M3Max;
  }
  if (scheme != Fp8Scheme::kPerTensor && dtype != DataType::kFloat8E4M3) {
    return InvalidArgumentError("linear problem: a scale scheme other than per tensor needs fp8");
  }
  p.scheme = scheme;
  auto fill = [&](std::vector<uint8_t>& buf, int64_t count, float scale) {
    buf.resize(count * e);
    for (int64_t i = 0; i < count; ++i) {
      const float v = dist(rng);
      if (dtype == DataType::kFloat8E4M3) {
        buf[i] = FloatToFp8E4M3(v / scale);
      } else {
        const BFloat16 b = FloatToBFloat16(v);
        std::memcpy(buf.data() + 2 * i, &b, 2);
      }
    }
  };
  if (scheme == Fp8Scheme::kPerTensor) {
    fill(p.x, m * k, p.x_scale);
    fill(p.w, n * k, p.w_scale);
  } else {
    TP_RETURN_IF_ERROR(FillFineScaled(p, rng));
  }

  const int64_t nl = p.n_local(), kl = p.k_local();
  p.x_local.resize(tp);
  p.w_local.resize(tp);
  for (int r = 0; r < tp; ++r) {
    if (ag) {
      const RowRange s = ShardRows(m, tp, r);
      p.x_local[r].assign(p.x.begin() + s.begin * k * e, p.x.begin() + s.end * k * e);
      p.w_local[r].assign(p.w.begin() + r * nl * k * e, p.w.begin() + (r + 1) * nl * k * e);
    } else {
      p.x_local[r].resize(m * kl * e);
      p.w_local[r].resize(n * kl * e);
      for (int64_t i = 0; i < m; ++i) {
        std::memcpy(&p.x_local[r][i * kl * e], &p.x[(i * k + r * kl) * e], kl * e);
      }
      for (int64_t j = 0; j < n; ++j) {
        std::memcpy(&p.w_local[r][j * kl * e], &p.w[(j * k + r * kl) * e], kl * e);
      }
    }
  }
  p.reference.resize(m * n);
  if (scheme != Fp8Scheme::kPerTensor) {
    TP_RETURN_IF_ERROR(
        ReferenceLinearFp8(scheme, m, n, k, p.x, p.x_scales, p.w, p.w_scales, p.reference));
    return p;
  }
  TP_RETURN_IF_ERROR(
      ReferenceLinear(dtype, m, n, k, p.x.data(), p.x_scale, p.w.data(), p.w_scale, p.reference));
  return p;
}

StatusOr<std::vector<std::vector<BFloat16>>> RunCpuLinearGroup(const LinearProblem& p,
                                                               OverlapMode mode, int chunks,
                                                               bool defer_last_sum) {
  std::vector<std::vector<BFloat16>> y(p.tp);
  for (int r = 0; r < p.tp; ++r) y[r].assign(p.OutputElements(r), BFloat16{kPoisonBf16});
  TP_RETURN_IF_ERROR(RunOnLocalRanks(p.tp, [&](Communicator& c) -> Status {
    PlanRequest q{p.op, mode, p.tp, c.rank(), p.m, chunks};
    q.defer_last_sum = defer_last_sum;
    TP_ASSIGN_OR_RETURN(OverlapPlan plan, MakeOverlapPlan(q));
    return RunCpuLinear(plan, c, p.ArgsFor(c.rank(), y[c.rank()].data()));
  }));
  return y;
}

namespace {

// Adds rank r's output to `err` and to the Frobenius sums.
Status AccumulateRank(const LinearProblem& p, int r, const std::vector<BFloat16>& out,
                      LinearError& err, double& num, double& den) {
  if (r < 0 || r >= p.tp) {
    return InvalidArgumentError("compare: rank " + std::to_string(r) +
                                " outside tp=" + std::to_string(p.tp));
  }
  if (static_cast<int64_t>(out.size()) != p.OutputElements(r)) {
    return InvalidArgumentError("compare: rank " + std::to_string(r) + " output has " +
                                std::to_string(out.size()) + " elements, expected " +
                                std::to_string(p.OutputElements(r)));
  }
  const int64_t nl = p.n_local();
  const RowRange shard = ShardRows(p.m, p.tp, r);
  for (size_t idx = 0; idx < out.size(); ++idx) {
    const int64_t i = static_cast<int64_t>(idx) / nl, j = static_cast<int64_t>(idx) % nl;
    const int64_t global =
        p.op == OverlapOp::kAllGatherGemm ? i * p.n + r * nl + j : (shard.begin + i) * p.n + j;
    const BFloat16 got = out[idx], want = p.reference[global];
    if (got.bits == kPoisonBf16) ++err.unwritten;
    if (got.bits != want.bits) ++err.differing;
    const double g = BFloat16ToFloat(got), w = BFloat16ToFloat(want);
    const double d = std::isnan(g) ? INFINITY : std::fabs(g - w);
    err.max_abs = std::max(err.max_abs, d);
    num += d * d;
    den += w * w;
  }
  return Status::Ok();
}

}  // namespace

StatusOr<LinearError> CompareWithReference(const LinearProblem& p,
                                           const std::vector<std::vector<BFloat16>>& outputs) {
  if (static_cast<int>(outputs.size()) != p.tp) {
    return InvalidArgumentError("compare: " + std::to_string(outputs.size()) +
                                " outputs for tp=" + std::to_string(p.tp));
  }
  LinearError err;
  double num = 0, den = 0;
  for (int r = 0; r < p.tp; ++r)
    TP_RETURN_IF_ERROR(AccumulateRank(p, r, outputs[r], err, num, den));
  err.rel_frobenius = std::sqrt(num / std::max(den, 1e-30));
  return err;
}

StatusOr<LinearError> CompareRankWithReference(const LinearProblem& p, int rank,
                                               const std::vector<BFloat16>& output) {
  LinearError err;
  double num = 0, den = 0;
  TP_RETURN_IF_ERROR(AccumulateRank(p, rank, output, err, num, den));
  err.rel_frobenius = std::sqrt(num / std::max(den, 1e-30));
  return err;
}

}  // namespace tpserve
