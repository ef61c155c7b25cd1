#include "engine/cpu_ops.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "engine/model_config.h"

namespace tpserve {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

Status NeedAtLeast(const char* fn, const char* arg, int64_t value, int64_t min) {
  if (value < min) {
    return InvalidArgumentError(std::string(fn) + ": " + arg + " (" + Str(value) +
                                ") must be >= " + Str(min));
  }
  return Status::Ok();
}

Status NeedPointer(const char* fn, const char* arg, const void* p) {
  if (p == nullptr) {
    return InvalidArgumentError(std::string(fn) + ": " + arg + " is null for a non-empty tensor");
  }
  return Status::Ok();
}

}  // namespace

void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps,
             float* out) {
  assert(rows >= 0 && dim > 0 && eps >= 0);
  assert(rows == 0 || (x != nullptr && weight != nullptr && out != nullptr));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* outr = out + r * dim;
    double sum_sq = 0;
    for (int64_t i = 0; i < dim; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(dim) + eps);
    // Reads xr[i] before writing outr[i]: in place (out == x) is fine.
    for (int64_t i = 0; i < dim; ++i) {
      outr[i] = static_cast<float>(static_cast<double>(xr[i]) * inv_rms * weight[i]);
    }
  }
}

Status ApplyRope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                 const std::vector<double>& inv_freq) {
  constexpr const char* kFn = "ApplyRope";
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "rows", rows, 0));
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "heads", heads, 1));
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "head_dim", head_dim, 2));
  if (head_dim % 2 != 0) {
    return InvalidArgumentError(std::string(kFn) + ": head_dim (" + Str(head_dim) +
                                ") must be even (elements are rotated in pairs)");
  }
  const int64_t half = head_dim / 2;
  if (static_cast<int64_t>(inv_freq.size()) != half) {
    return InvalidArgumentError(std::string(kFn) + ": inv_freq has " +
                                Str(static_cast<int64_t>(inv_freq.size())) +
                                " entries; head_dim (" + Str(head_dim) + ") needs " + Str(half));
  }
  for (int64_t i = 0; i < half; ++i) {
    if (!(inv_freq[i] > 0) || !std::isfinite(inv_freq[i])) {
      return InvalidArgumentError(std::string(kFn) + ": inv_freq[" + Str(i) + "] (" +
                                  std::to_string(inv_freq[i]) +
                                  ") must be a positive finite number");
    }
  }
  if (rows == 0) return Status::Ok();
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "x", x));
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "positions", positions));
  // Check every position before touching x, so that x is unchanged on error.
  for (int64_t r = 0; r < rows; ++r) {
    if (positions[r] < 0) {
      return InvalidArgumentError(std::string(kFn) + ": positions[" + Str(r) + "] (" +
                                  Str(positions[r]) + ") is negative");
    }
  }

  std::vector<double> cos_a(half), sin_a(half);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[r]) * inv_freq[i];
      cos_a[i] = std::cos(angle);
      sin_a[i] = std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = x + (r * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const double a = xh[i];
        const double b = xh[i + half];
        xh[i] = static_cast<float>(a * cos_a[i] - b * sin_a[i]);
        xh[i + half] = static_cast<float>(b * cos_a[i] + a * sin_a[i]);
      }
    }
  }
  return Status::Ok();
}

Status ApplyRope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                 double theta) {
  if (!(theta > 0) || !std::isfinite(theta)) {
    return InvalidArgumentError("ApplyRope: theta (" + std::to_string(theta) +
                                ") must be a positive finite number");
  }
  // A head_dim the table form refuses gets an empty table, so that its error is the
  // head_dim's.
  const bool table_ok = head_dim >= 2 && head_dim % 2 == 0;
  return ApplyRope(
      x, rows, heads, head_dim, positions,
      table_ok ? RopeInverseFrequencies(theta, head_dim, RopeScaling{}) : std::vector<double>{});
}

Status CausalAttentionVarlen(const float* q, const float* k, const float* v, int64_t tokens,
                             int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                             const std::vector<int32_t>& cu_seqlens, float* out) {
  constexpr const char* kFn = "CausalAttentionVarlen";
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "tokens", tokens, 0));
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "q_heads", q_heads, 1));
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "kv_heads", kv_heads, 1));
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "head_dim", head_dim, 1));
  if (q_heads % kv_heads != 0) {
    return InvalidArgumentError(std::string(kFn) + ": q_heads (" + Str(q_heads) +
                                ") must be a multiple of kv_heads (" + Str(kv_heads) + ")");
  }
  if (cu_seqlens.empty()) {
    return InvalidArgumentError(std::string(kFn) +
                                ": cu_seqlens is empty (it needs num_seqs + 1 entries)");
  }
  if (cu_seqlens.front() != 0) {
    return InvalidArgumentError(std::string(kFn) + ": cu_seqlens[0] (" + Str(cu_seqlens[0]) +
                                ") must be 0");
  }
  int64_t max_len = 0;
  for (size_t s = 1; s < cu_seqlens.size(); ++s) {
    if (cu_seqlens[s] < cu_seqlens[s - 1]) {
      return InvalidArgumentError(
          std::string(kFn) + ": cu_seqlens must be non-decreasing, but " + "cu_seqlens[" +
          Str(static_cast<int64_t>(s)) + "] (" + Str(cu_seqlens[s]) + ") < cu_seqlens[" +
          Str(static_cast<int64_t>(s - 1)) + "] (" + Str(cu_seqlens[s - 1]) + ")");
    }
    max_len = std::max<int64_t>(max_len, cu_seqlens[s] - cu_seqlens[s - 1]);
  }
  if (cu_seqlens.back() != tokens) {
    return InvalidArgumentError(
        std::string(kFn) + ": cu_seqlens[" + Str(static_cast<int64_t>(cu_seqlens.size() - 1)) +
        "] (" + Str(cu_seqlens.back()) + ") must equal tokens (" + Str(tokens) + ")");
  }
  if (tokens == 0) return Status::Ok();
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "q", q));
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "k", k));
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "v", v));
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "out", out));

  const int64_t group = q_heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  std::vector<double> scores(static_cast<size_t>(max_len));
  std::vector<double> acc(static_cast<size_t>(head_dim));
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t begin = cu_seqlens[s];
    const int64_t end = cu_seqlens[s + 1];
    for (int64_t h = 0; h < q_heads; ++h) {
      const int64_t kvh = h / group;
      for (int64_t i = begin; i < end; ++i) {
        const float* qi = q + (i * q_heads + h) * head_dim;
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = begin; j <= i; ++j) {
          const float* kj = k + (j * kv_heads + kvh) * head_dim;
          double dot = 0;
          for (int64_t d = 0; d < head_dim; ++d) dot += static_cast<double>(qi[d]) * kj[d];
          scores[j - begin] = dot * scale;
          max_score = std::max(max_score, scores[j - begin]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double denom = 0;
        for (int64_t j = begin; j <= i; ++j) {
          const double p = std::exp(scores[j - begin] - max_score);
          denom += p;
          const float* vj = v + (j * kv_heads + kvh) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * vj[d];
        }
        float* oi = out + (i * q_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) oi[d] = static_cast<float>(acc[d] / denom);
      }
    }
  }
  return Status::Ok();
}

void SwiGlu(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  assert(rows >= 0 && inter > 0);
  assert(rows == 0 || (gate_up != nullptr && out != nullptr));
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * inter;
    const float* up = gate + inter;
    float* outr = out + r * inter;
    // In place (out == gate_up), outr[j] lies at or before gate[j]: already read.
    for (int64_t j = 0; j < inter; ++j) {
      const double g = gate[j];
      const double u = up[j];
      outr[j] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
    }
  }
}

Status EmbeddingLookup(const float* table, int64_t vocab, int64_t dim, const int32_t* ids,
                       int64_t n, float* out) {
  constexpr const char* kFn = "EmbeddingLookup";
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "vocab", vocab, 1));
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "dim", dim, 1));
  TP_RETURN_IF_ERROR(NeedAtLeast(kFn, "n", n, 0));
  if (n == 0) return Status::Ok();
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "table", table));
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "ids", ids));
  TP_RETURN_IF_ERROR(NeedPointer(kFn, "out", out));
  for (int64_t t = 0; t < n; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab) {
      return InvalidArgumentError(std::string(kFn) + ": ids[" + Str(t) + "] (" + Str(ids[t]) +
                                  ") is out of range [0, " + Str(vocab) + ")");
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(out + t * dim, table + static_cast<int64_t>(ids[t]) * dim,
                static_cast<size_t>(dim) * sizeof(float));
  }
  return Status::Ok();
}

}  // namespace tpserve
