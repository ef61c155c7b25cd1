#include "layers/cublaslt_gemm.h"

#include <cublasLt.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "layers/gemm_scale_scheme.h"
#include "layers/quantize_kernels.h"
#include "layers/random_fill.h"
#include "layers/small_m_gemm.h"

namespace tpserve {
namespace {

// Every pointer, leading dimension and batch stride is promised to cuBLASLt at this alignment
// (see the header); FP8 kernels on Hopper need it, and promising it for BF16 too lets one
// cached algorithm serve every row-block offset of a shape.
constexpr int64_t kAlignBytes = 16;
constexpr int kMaxHeuristicResults = 8;

struct DescDeleter {
  void operator()(cublasLtMatmulDesc_t d) const noexcept {
    TP_CUBLAS_LOG(cublasLtMatmulDescDestroy(d));
  }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayout_t l) const noexcept {
    TP_CUBLAS_LOG(cublasLtMatrixLayoutDestroy(l));
  }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreference_t p) const noexcept {
    TP_CUBLAS_LOG(cublasLtMatmulPreferenceDestroy(p));
  }
};
using DescPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>, DescDeleter>;
using LayoutPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>, LayoutDeleter>;
using PreferencePtr =
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, PreferenceDeleter>;

bool IsFp8Gemm(const GemmParams& p) {
  return p.a_type == DataType::kFloat8E4M3 && p.b_type == DataType::kFloat8E4M3;
}
bool UsesC(const GemmParams& p) { return p.beta != 0.0f; }
// C's type: FP32 with an FP32 D (cuBLASLt needs C's type to equal D's there), else BF16 (also
// for an FP8 D, whose C cuBLASLt wants BF16).
DataType CType(const GemmParams& p) {
  return p.d_type == DataType::kFloat32 ? DataType::kFloat32 : DataType::kBFloat16;
}

int64_t Bytes(int64_t elements, DataType t) {
  return elements * static_cast<int64_t>(DataTypeSize(t));
}

std::string Str(int64_t v) { return std::to_string(v); }
std::string Str(DataType t) { return std::string(DataTypeName(t)); }

// GemmParams with defaults filled in and the fields that do not matter zeroed, so that equal
// problems get equal plan keys (ResolveGemmParams, below, outside this file).
GemmParams Resolve(const GemmParams& p) {
  GemmParams r = p;
  if (r.lda == 0) r.lda = r.k;
  if (r.ldb == 0) r.ldb = r.k;
  if (r.ldd == 0) r.ldd = r.n;
  if (r.ldc == 0) r.ldc = r.ldd;
  if (r.batch <= 1) r.stride_a = r.stride_b = r.stride_c = r.stride_d = 0;
  if (!UsesC(r)) {
    // C is not read: describe it like D so that no stray ldc splits the cache.
    r.ldc = r.ldd;
    r.stride_c = r.stride_d;
  }
  if (!IsFp8Gemm(r)) r.fast_accum = false;
  return r;
}

// Everything in the resolved params that shapes the descriptors or the heuristic's answer.
struct PlanKey {
  int64_t m, n, k;
  DataType a_type, b_type, d_type;
  int64_t lda, ldb, ldc, ldd;
  int batch;
  int64_t stride_a, stride_b, stride_c, stride_d;
  bool has_a_scale, has_b_scale, has_d_scale, has_amax, uses_c, fast_accum;
  GemmScaleScheme scale_scheme;

  auto operator<=>(const PlanKey&) const = default;
};

PlanKey KeyOf(const GemmParams& r) {
  return PlanKey{r.m,
                 r.n,
                 r.k,
                 r.a_type,
                 r.b_type,
                 r.d_type,
                 r.lda,
                 r.ldb,
                 r.ldc,
                 r.ldd,
                 r.batch,
                 r.stride_a,
                 r.stride_b,
                 r.stride_c,
                 r.stride_d,
                 r.a_scale != nullptr,
                 r.b_scale != nullptr,
                 r.d_quant_scale != nullptr,
                 r.d_amax != nullptr,
                 UsesC(r),
                 r.fast_accum,
                 r.scale_scheme};
}

std::string Describe(const std::string& name, const GemmParams& r) {
  std::string s = "gemm '" + name + "' (m=" + Str(r.m) + " n=" + Str(r.n) + " k=" + Str(r.k) +
                  ", " + Str(r.a_type) + " x " + Str(r.b_type) + " -> " + Str(r.d_type) +
                  ", lda=" + Str(r.lda) + " ldb=" + Str(r.ldb) + " ldd=" + Str(r.ldd);
  if (UsesC(r)) s += " ldc=" + Str(r.ldc);
  if (r.batch > 1) {
    s += ", batch=" + Str(r.batch) + " strides a/b/c/d=" + Str(r.stride_a) + "/" + Str(r.stride_b) +
         "/" + Str(r.stride_c) + "/" + Str(r.stride_d);
  }
  if (r.scale_scheme != GemmScaleScheme::kPerTensor) {
    s += ", scales " + std::string(GemmScaleSchemeName(r.scale_scheme));
  }
  if (r.fast_accum) s += ", fast_accum";
  return s + ")";
}

cudaDataType_t CudaType(DataType t) {
  switch (t) {
    case DataType::kFloat8E4M3:
      return CUDA_R_8F_E4M3;
    case DataType::kBFloat16:
      return CUDA_R_16BF;
    case DataType::kFloat32:
      return CUDA_R_32F;
    default:
      return CUDA_R_32F;  // not reached: ValidateGemmParams admits only the three above
  }
}

Status CheckLeadingDim(const char* field, int64_t ld, const char* min_name, int64_t min,
                       DataType t) {
  if (ld < min) {
    return InvalidArgumentError(std::string("GemmParams.") + field + " = " + Str(ld) +
                                " is smaller than " + min_name + " = " + Str(min));
  }
  if (Bytes(ld, t) % kAlignBytes != 0) {
    return InvalidArgumentError(std::string("GemmParams.") + field + " = " + Str(ld) + " (" +
                                Str(t) + ") is " + Str(Bytes(ld, t)) +
                                " bytes, not a multiple of 16 bytes (cuBLASLt alignment)");
  }
  return Status::Ok();
}

Status CheckStride(const char* field, int64_t stride, DataType t) {
  if (stride < 0) {
    return InvalidArgumentError(std::string("GemmParams.") + field + " = " + Str(stride) +
                                " is negative");
  }
  if (Bytes(stride, t) % kAlignBytes != 0) {
    return InvalidArgumentError(std::string("GemmParams.") + field + " = " + Str(stride) + " (" +
                                Str(t) + ") is not a multiple of 16 bytes (cuBLASLt alignment)");
  }
  return Status::Ok();
}

Status CheckPointer(const char* what, const void* ptr, size_t alignment) {
  if (reinterpret_cast<uintptr_t>(ptr) % alignment != 0) {
    return InvalidArgumentError(std::string(what) + " pointer " +
                                std::to_string(reinterpret_cast<uintptr_t>(ptr)) +
                                " is not aligned to " + std::to_string(alignment) + " bytes");
  }
  return Status::Ok();
}

template <class T>
Status SetDescAttr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& v) {
  TP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &v, sizeof v));
  return Status::Ok();
}

template <class T>
Status SetLayoutAttr(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, const T& v) {
  TP_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, attr, &v, sizeof v));
  return Status::Ok();
}

template <class T>
Status SetPrefAttr(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
                   const T& v) {
  TP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof v));
  return Status::Ok();
}

// A column-major cuBLASLt layout of rows×cols with leading dimension ld, batched if asked.
StatusOr<LayoutPtr> MakeLayout(DataType t, int64_t rows, int64_t cols, int64_t ld, int batch,
                               int64_t stride) {
  cublasLtMatrixLayout_t raw = nullptr;
  TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, CudaType(t), static_cast<uint64_t>(rows),
                                             static_cast<uint64_t>(cols), ld));
  LayoutPtr layout(raw);
  if (batch > 1) {
    TP_RETURN_IF_ERROR(
        SetLayoutAttr(raw, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<int32_t>(batch)));
    TP_RETURN_IF_ERROR(SetLayoutAttr(raw, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride));
  }
  return layout;
}

}  // namespace

Status ValidateGemmParams(const GemmParams& p) {
  if (p.m <= 0) return InvalidArgumentError("GemmParams.m = " + Str(p.m) + ": must be > 0");
  if (p.n <= 0) return InvalidArgumentError("GemmParams.n = " + Str(p.n) + ": must be > 0");
  if (p.k <= 0) return InvalidArgumentError("GemmParams.k = " + Str(p.k) + ": must be > 0");
  if (p.batch < 1) {
    return InvalidArgumentError("GemmParams.batch = " + Str(p.batch) + ": must be >= 1");
  }

  const bool fp8 = IsFp8Gemm(p);
  const bool bf16 = p.a_type == DataType::kBFloat16 && p.b_type == DataType::kBFloat16;
  if (!fp8 && !bf16) {
    return UnimplementedError("GemmParams.a_type = " + Str(p.a_type) +
                              " with b_type = " + Str(p.b_type) +
                              " is not supported; supported: both fp8_e4m3 or both bf16");
  }
  if (fp8 && p.d_type != DataType::kBFloat16 && p.d_type != DataType::kFloat8E4M3) {
    return UnimplementedError("GemmParams.d_type = " + Str(p.d_type) +
                              " is not supported for FP8 inputs; supported: bf16, fp8_e4m3");
  }
  if (bf16 && p.d_type != DataType::kBFloat16 && p.d_type != DataType::kFloat32) {
    return UnimplementedError("GemmParams.d_type = " + Str(p.d_type) +
                              " is not supported for BF16 inputs; supported: bf16, f32");
  }
  const bool fp8_out = p.d_type == DataType::kFloat8E4M3;

  if (fp8) {
    // cuBLASLt's FP8 kernels need 16-byte aligned K-major tiles of A and B ("TN").
    if (p.k % 16 != 0) {
      return InvalidArgumentError("GemmParams.k = " + Str(p.k) +
                                  ": FP8 GEMMs need k % 16 == 0 (cuBLASLt FP8 on Hopper)");
    }
    if (p.n % 16 != 0) {
      return InvalidArgumentError("GemmParams.n = " + Str(p.n) +
                                  ": FP8 GEMMs need n % 16 == 0 (cuBLASLt FP8 on Hopper)");
    }
  } else {
    if (p.a_scale != nullptr || p.b_scale != nullptr) {
      return InvalidArgumentError(
          "GemmParams.a_scale / b_scale must be nullptr for BF16 inputs (FP8 only)");
    }
  }
  if (!fp8_out && (p.d_quant_scale != nullptr || p.d_amax != nullptr)) {
    // cuBLASLt rejects amax for non-FP8 outputs of FP8 GEMMs (and D scaling is meaningless).
    return InvalidArgumentError(
        "GemmParams.d_quant_scale / d_amax need d_type = fp8_e4m3, got d_type = " + Str(p.d_type));
  }
  if (fp8_out && UsesC(p)) {
    return UnimplementedError("GemmParams.beta = " + std::to_string(p.beta) +
                              ": accumulating into C is not supported with an FP8 output");
  }

  if (p.scale_scheme != GemmScaleScheme::kPerTensor &&
      p.scale_scheme != GemmScaleScheme::kPerTokenChannel &&
      p.scale_scheme != GemmScaleScheme::kBlockwise) {
    return InvalidArgumentError(
        "GemmParams.scale_scheme = " + std::to_string(static_cast<int>(p.scale_scheme)) +
        " is not a GemmScaleScheme value");
  }
  if (p.scale_scheme != GemmScaleScheme::kPerTensor) {
    TP_RETURN_IF_ERROR(CheckGemmScaleScheme(p, fp8));
  }

  const GemmParams r = Resolve(p);
  TP_RETURN_IF_ERROR(CheckLeadingDim("lda", r.lda, "k", r.k, r.a_type));
  TP_RETURN_IF_ERROR(CheckLeadingDim("ldb", r.ldb, "k", r.k, r.b_type));
  TP_RETURN_IF_ERROR(CheckLeadingDim("ldd", r.ldd, "n", r.n, r.d_type));
  if (UsesC(r)) TP_RETURN_IF_ERROR(CheckLeadingDim("ldc", r.ldc, "n", r.n, CType(r)));

  if (r.batch > 1) {
    TP_RETURN_IF_ERROR(CheckStride("stride_a", r.stride_a, r.a_type));
    TP_RETURN_IF_ERROR(CheckStride("stride_b", r.stride_b, r.b_type));
    TP_RETURN_IF_ERROR(CheckStride("stride_d", r.stride_d, r.d_type));
    if (UsesC(r)) TP_RETURN_IF_ERROR(CheckStride("stride_c", r.stride_c, CType(r)));
    if (r.stride_d < r.m * r.ldd) {
      return InvalidArgumentError("GemmParams.stride_d = " + Str(r.stride_d) +
                                  " is smaller than m * ldd = " + Str(r.m * r.ldd) +
                                  ": batch items would overwrite each other");
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------

namespace {

// Descriptors and algorithm for one PlanKey. cuBLAS names are column-major: its "A" is our
// weight B (transposed), its "B" is our activations A.
struct Plan {
  DescPtr desc;
  LayoutPtr weight_layout;  // cuBLAS A: k×n, ld = ldb, op T
  LayoutPtr act_layout;     // cuBLAS B: k×m, ld = lda, op N
  LayoutPtr c_layout;       // n×m, ld = ldc, BF16
  LayoutPtr d_layout;       // n×m, ld = ldd
  cublasLtMatmulAlgo_t algo{};
  // The heuristic's usable answers, best first (algo is one of them).
  std::vector<cublasLtMatmulAlgo_t> candidates;
};

// GemmAlgoSelection::kTimed's choices, shared by every CublasLtGemm of the process, per
// device (ranks as threads drive several GPUs from one process; each times its own).
using ChoiceKey = std::pair<int, PlanKey>;
ChoiceKey ChoiceKeyOf(const GemmParams& r) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) (void)cudaGetLastError();
  return {device, KeyOf(r)};
}
struct TimedChoices {
  std::mutex mu;
  std::map<ChoiceKey, cublasLtMatmulAlgo_t> chosen;
};
TimedChoices& Choices() {
  static TimedChoices* c = new TimedChoices;  // never destroyed: used until exit
  return *c;
}

bool SameAlgo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::equal(std::begin(a.data), std::end(a.data), std::begin(b.data));
}

// Elements a batched operand spans: the last item's start plus one item.
int64_t Span(int64_t cols, int64_t ld, int batch, int64_t stride) {
  return (batch > 1 ? (batch - 1) * stride : 0) + cols * ld;
}

// Sets the per-call pointer attributes. Host-side writes into the descriptor: no allocation,
// nothing enqueued; cublasLtMatmul reads them when it enqueues.
Status SetScalePointers(cublasLtMatmulDesc_t desc, const GemmParams& r) {
  if (!IsFp8Gemm(r)) return Status::Ok();
  // Swapped on purpose: cuBLAS's A is our B (the weight).
  TP_RETURN_IF_ERROR(
      SetDescAttr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(r.b_scale)));
  TP_RETURN_IF_ERROR(
      SetDescAttr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(r.a_scale)));
  if (r.d_type == DataType::kFloat8E4M3) {
    TP_RETURN_IF_ERROR(SetDescAttr(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER,
                                   static_cast<const void*>(r.d_quant_scale)));
    TP_RETURN_IF_ERROR(
        SetDescAttr(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void*>(r.d_amax)));
  }
  return Status::Ok();
}

}  // namespace

struct CublasLtGemm::Impl {
  std::string name;
  GemmAlgoSelection selection = GemmAlgoSelection::kTimed;
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer workspace;
  // Node-based: a Plan stays where it is while others are added.
  std::map<PlanKey, std::unique_ptr<Plan>> plans;

  ~Impl() {
    plans.clear();  // descriptors before the handle
    if (handle != nullptr) TP_CUBLAS_LOG(cublasLtDestroy(handle));
  }

  StatusOr<std::unique_ptr<Plan>> BuildPlan(const GemmParams& r) const;
  StatusOr<Plan*> FindOrBuildPlan(const GemmParams& r, const cudaStream_t* stream);
  // GemmAlgoSelection::kTimed: times plan's candidates, keeps the fastest, remembers it.
  Status TimeCandidates(const GemmParams& r, Plan& plan);
};

Status CublasLtGemm::Impl::TimeCandidates(const GemmParams& r, Plan& plan) {
  const ChoiceKey key = ChoiceKeyOf(r);
  {
    TimedChoices& tc = Choices();
    std::lock_guard<std::mutex> lock(tc.mu);
    if (tc.chosen.count(key)) return Status::Ok();  // BuildPlan took it
  }
  auto remember = [&key](const cublasLtMatmulAlgo_t& algo) {
    TimedChoices& tc = Choices();
    std::lock_guard<std::mutex> lock(tc.mu);
    tc.chosen.emplace(key, algo);
  };
  const int n = static_cast<int>(plan.candidates.size());
  if (n < 2) {  // nothing to choose between
    remember(plan.algo);
    return Status::Ok();
  }
  const std::string what = Describe(name, r);
  TP_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create());
  cudaStream_t s = stream.get();
  // Random operands of the shape (timing on zeros would flatter every candidate's power draw),
  // and a workspace of its own: Runs of this object may still be in flight on other streams.
  const int64_t a_elems = Span(r.m, r.lda, r.batch, r.stride_a);
  const int64_t b_elems = Span(r.n, r.ldb, r.batch, r.stride_b);
  const int64_t c_elems = UsesC(r) ? Span(r.m, r.ldc, r.batch, r.stride_c) : 0;
  const int64_t d_elems = Span(r.m, r.ldd, r.batch, r.stride_d);
  // Scale / amax slots 16 bytes apart (cuBLASLt's alignment): A's scales, B's, D's, amax.
  auto round4 = [](int64_t v) { return (v + 3) / 4 * 4; };
  const int64_t a_scales = round4(GemmAScaleCount(r)), b_scales = round4(GemmBScaleCount(r));
  const int64_t scale_floats = a_scales + b_scales + 8;
  DeviceBuffer ws, a, b, c, d, scales;
  Status allocated = [&]() -> Status {
    TP_ASSIGN_OR_RETURN(ws, DeviceBuffer::Allocate(workspace.size(), name + ".time_ws"));
    TP_ASSIGN_OR_RETURN(a, DeviceBuffer::Allocate(Bytes(a_elems, r.a_type), name + ".time_a"));
    TP_ASSIGN_OR_RETURN(b, DeviceBuffer::Allocate(Bytes(b_elems, r.b_type), name + ".time_b"));
    TP_ASSIGN_OR_RETURN(d, DeviceBuffer::Allocate(Bytes(d_elems, r.d_type), name + ".time_d"));
    TP_ASSIGN_OR_RETURN(c, DeviceBuffer::Allocate(Bytes(c_elems, CType(r)), name + ".time_c"));
    TP_ASSIGN_OR_RETURN(
        scales, DeviceBuffer::Allocate(scale_floats * sizeof(float), name + ".time_scales"));
    return Status::Ok();
  }();
  if (allocated.code() == StatusCode::kResourceExhausted) {
    // Timing is an optimisation: without the memory for it, the heuristic's answer serves.
    spdlog::warn("{}: not timing its algorithms, keeping the heuristic's first ({})", what,
                 allocated.ToString());
    remember(plan.algo);
    return Status::Ok();
  }
  TP_RETURN_IF_ERROR(allocated);
  if (c_elems > 0) {
    TP_RETURN_IF_ERROR(LaunchRandomUniform(c.data(), CType(r), c_elems, 3, 1.0f, s));
  }
  TP_RETURN_IF_ERROR(LaunchRandomUniform(a.data(), r.a_type, a_elems, 1, 1.0f, s));
  TP_RETURN_IF_ERROR(LaunchRandomUniform(b.data(), r.b_type, b_elems, 2, 1.0f, s));
  // All scales 1 (the bits of 1.0f).
  TP_RETURN_IF_ERROR(LaunchFillPattern(scales.data(), static_cast<size_t>(scale_floats),
                                       sizeof(float), 0x3F800000u, s));
  GemmParams t = r;
  float* sc = scales.as<float>();
  if (t.a_scale != nullptr) t.a_scale = sc;
  if (t.b_scale != nullptr) t.b_scale = sc + a_scales;
  if (t.d_quant_scale != nullptr) t.d_quant_scale = sc + a_scales + b_scales;
  if (t.d_amax != nullptr) t.d_amax = sc + a_scales + b_scales + 4;
  TP_RETURN_IF_ERROR(SetScalePointers(plan.desc.get(), t));
  const void* c_arg =
      c_elems > 0 ? c.data() : (r.d_type != DataType::kFloat8E4M3 ? d.data() : nullptr);

  // Rounds over all candidates (round 0 warms up), so that drift hits each alike.
  constexpr int kRounds = 6;
  std::vector<CudaEvent> events;
  for (int i = 0; i < 2 * n * kRounds; ++i) {
    TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(true));
    events.push_back(std::move(e));
  }
  std::vector<bool> ok(n, true);
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < n; ++i) {
      const int ev = 2 * (round * n + i);
      TP_RETURN_IF_ERROR(events[ev].Record(s));
      if (ok[i]) {
        const cublasStatus_t st = cublasLtMatmul(
            handle, plan.desc.get(), &t.alpha, b.data(), plan.weight_layout.get(), a.data(),
            plan.act_layout.get(), &t.beta, c_arg, plan.c_layout.get(), d.data(),
            plan.d_layout.get(), &plan.candidates[i], ws.data(), ws.size(), s);
        ok[i] = st == CUBLAS_STATUS_SUCCESS;
      }
      TP_RETURN_IF_ERROR(events[ev + 1].Record(s));
    }
  }
  TP_RETURN_IF_ERROR(stream.Synchronize().WithContext(what + ": timing its algorithms"));
  std::vector<float> median(n, 0.0f);
  for (int i = 0; i < n; ++i) {
    std::vector<float> ms;
    for (int round = 1; round < kRounds; ++round) {
      const int ev = 2 * (round * n + i);
      TP_ASSIGN_OR_RETURN(float t_ms, CudaEvent::ElapsedMs(events[ev], events[ev + 1]));
      ms.push_back(t_ms);
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    median[i] = ms[ms.size() / 2];
  }
  int best = -1;
  for (int i = 0; i < n; ++i) {
    if (ok[i] && (best < 0 || median[i] < median[best])) best = i;
  }
  if (best < 0) return Status::Ok();  // none ran: the heuristic's stays (Run will report)
  plan.algo = plan.candidates[best];
  std::string all;
  for (int i = 0; i < n; ++i) {
    all += (i ? " " : "") + (ok[i] ? fmt::format("{:.4f}", median[i]) : std::string("failed"));
  }
  spdlog::info("{}: timed {} algorithms (ms: {}), chose #{}{}", what, n, all, best,
               best == 0
                   ? " (the heuristic's first)"
                   : fmt::format(", {:.1f}% faster than the heuristic's first",
                                 ok[0] ? 100.0 * (median[0] - median[best]) / median[0] : 0.0));
  remember(plan.algo);
  return Status::Ok();
}

StatusOr<std::unique_ptr<Plan>> CublasLtGemm::Impl::BuildPlan(const GemmParams& r) const {
  auto plan = std::make_unique<Plan>();

  cublasLtMatmulDesc_t raw_desc = nullptr;
  TP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  plan->desc.reset(raw_desc);
  TP_RETURN_IF_ERROR(SetDescAttr(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  TP_RETURN_IF_ERROR(SetDescAttr(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  if (IsFp8Gemm(r)) {
    TP_RETURN_IF_ERROR(SetDescAttr(raw_desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                   static_cast<int8_t>(r.fast_accum ? 1 : 0)));
  }
  if (IsFp8Gemm(r) && r.scale_scheme != GemmScaleScheme::kPerTensor) {
    // Swapped as the scale pointers are: cuBLAS's A is our weight B, its B our activations A.
    // Per token/channel: cuBLAS's A scale has one float per row of its op(A) (= our n), its B
    // scale one per column of op(B) (= our m). Blockwise: our weight's 128x128 blocks are its
    // A's BLK128x128 (K-major), our activations' 1x128 groups its B's VEC128 (N-major).
    const bool outer = r.scale_scheme == GemmScaleScheme::kPerTokenChannel;
    const int32_t weight_mode = outer ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                                      : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t act_mode = outer ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                                   : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    TP_RETURN_IF_ERROR(SetDescAttr(raw_desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, weight_mode));
    TP_RETURN_IF_ERROR(SetDescAttr(raw_desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, act_mode));
  }
  // The heuristic may depend on which scale/amax pointers are set (not on their values).
  TP_RETURN_IF_ERROR(SetScalePointers(raw_desc, r));

  TP_ASSIGN_OR_RETURN(plan->weight_layout,
                      MakeLayout(r.b_type, r.k, r.n, r.ldb, r.batch, r.stride_b));
  TP_ASSIGN_OR_RETURN(plan->act_layout, MakeLayout(r.a_type, r.k, r.m, r.lda, r.batch, r.stride_a));
  TP_ASSIGN_OR_RETURN(plan->c_layout, MakeLayout(CType(r), r.n, r.m, r.ldc, r.batch, r.stride_c));
  TP_ASSIGN_OR_RETURN(plan->d_layout, MakeLayout(r.d_type, r.n, r.m, r.ldd, r.batch, r.stride_d));

  cublasLtMatmulPreference_t raw_pref = nullptr;
  TP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw_pref));
  PreferencePtr pref(raw_pref);
  TP_RETURN_IF_ERROR(SetPrefAttr(raw_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                 static_cast<uint64_t>(workspace.size())));
  const uint32_t align = static_cast<uint32_t>(kAlignBytes);
  TP_RETURN_IF_ERROR(SetPrefAttr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align));
  TP_RETURN_IF_ERROR(SetPrefAttr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align));
  TP_RETURN_IF_ERROR(SetPrefAttr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align));
  TP_RETURN_IF_ERROR(SetPrefAttr(raw_pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align));

  cublasLtMatmulHeuristicResult_t results[kMaxHeuristicResults] = {};
  int returned = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(
      handle, raw_desc, plan->weight_layout.get(), plan->act_layout.get(), plan->c_layout.get(),
      plan->d_layout.get(), raw_pref, kMaxHeuristicResults, results, &returned);
  if (hs != CUBLAS_STATUS_SUCCESS) {
    return CublasCallError(hs, "cublasLtMatmulAlgoGetHeuristic(...)", __FILE__, __LINE__)
        .WithContext(Describe(name, r));
  }
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace.size()) {
      plan->candidates.push_back(results[i].algo);
    }
  }
  if (!plan->candidates.empty()) {
    plan->algo = plan->candidates.front();
    if (selection != GemmAlgoSelection::kTimed) return plan;
    // A choice timed earlier in this process (by any object) for the same shape.
    TimedChoices& tc = Choices();
    std::lock_guard<std::mutex> lock(tc.mu);
    if (auto it = tc.chosen.find(ChoiceKeyOf(r)); it != tc.chosen.end()) {
      for (const cublasLtMatmulAlgo_t& c : plan->candidates) {
        if (SameAlgo(c, it->second)) plan->algo = c;
      }
    }
    return plan;
  }
  return UnimplementedError(Describe(name, r) + ": cuBLASLt has no algorithm for it within a " +
                            std::to_string(workspace.size()) + "-byte workspace");
}

StatusOr<Plan*> CublasLtGemm::Impl::FindOrBuildPlan(const GemmParams& r,
                                                    const cudaStream_t* stream) {
  const PlanKey key = KeyOf(r);
  if (auto it = plans.find(key); it != plans.end()) return it->second.get();
  if (stream != nullptr) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TP_CUDA_CHECK(cudaStreamIsCapturing(*stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      return FailedPreconditionError(Describe(name, r) +
                                     ": no plan for this shape while the stream is capturing a "
                                     "CUDA graph; call Prepare() before capture");
    }
  }
  TP_ASSIGN_OR_RETURN(std::unique_ptr<Plan> plan, BuildPlan(r));
  Plan* p = plan.get();
  plans.emplace(key, std::move(plan));
  return p;
}

// ---------------------------------------------------------------------------------------------

StatusOr<CublasLtGemm> CublasLtGemm::Create(std::string name, GemmAlgoSelection selection,
                                            size_t workspace_bytes) {
  auto impl = std::make_unique<Impl>();
  impl->name = std::move(name);
  impl->selection = selection;
  TP_CUBLAS_CHECK(cublasLtCreate(&impl->handle));
  TP_ASSIGN_OR_RETURN(impl->workspace,
                      DeviceBuffer::Allocate(workspace_bytes, impl->name + ".cublaslt_workspace"));
  return CublasLtGemm(std::move(impl));
}

CublasLtGemm::CublasLtGemm() = default;
CublasLtGemm::CublasLtGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CublasLtGemm::~CublasLtGemm() = default;
CublasLtGemm::CublasLtGemm(CublasLtGemm&&) noexcept = default;
CublasLtGemm& CublasLtGemm::operator=(CublasLtGemm&&) noexcept = default;

size_t CublasLtGemm::timed_shapes() {
  TimedChoices& tc = Choices();
  std::lock_guard<std::mutex> lock(tc.mu);
  return tc.chosen.size();
}

size_t CublasLtGemm::num_plans() const { return impl_ ? impl_->plans.size() : 0; }

const std::string& CublasLtGemm::name() const {
  static const std::string kEmpty;
  return impl_ ? impl_->name : kEmpty;
}

size_t CublasLtGemm::workspace_bytes() const { return impl_ ? impl_->workspace.size() : 0; }

GemmAlgoSelection CublasLtGemm::selection() const {
  return impl_ ? impl_->selection : GemmAlgoSelection::kTimed;
}

GemmParams ResolveGemmParams(const GemmParams& p) { return Resolve(p); }

Status CublasLtGemm::Prepare(const GemmParams& p) {
  if (!impl_) return FailedPreconditionError("CublasLtGemm::Prepare on an empty object");
  if (Status s = ValidateGemmParams(p); !s.ok()) return s.WithContext("gemm '" + impl_->name + "'");
  const GemmParams r = Resolve(p);
  if (SmallMGemmFits(r)) return Status::Ok();  // Run takes tpserve's own kernel: no plan
  TP_ASSIGN_OR_RETURN(Plan * plan, impl_->FindOrBuildPlan(r, nullptr));
  if (impl_->selection != GemmAlgoSelection::kTimed) return Status::Ok();
  return impl_->TimeCandidates(r, *plan);
}

std::string_view GemmAlgoSelectionName(GemmAlgoSelection selection) {
  return selection == GemmAlgoSelection::kTimed ? "timed" : "heuristic";
}

StatusOr<GemmAlgoSelection> ParseGemmAlgoSelection(std::string_view name) {
  if (name == "heuristic") return GemmAlgoSelection::kHeuristic;
  if (name == "timed") return GemmAlgoSelection::kTimed;
  return InvalidArgumentError("GEMM algorithm selection '" + std::string(name) +
                              "': allowed values are heuristic, timed");
}

namespace {

// Run()'s pointer contract (see the header). Builds no strings unless something is wrong, so
// the steady-state Run() does no host allocation either.
Status CheckRunPointers(const GemmParams& r, const void* a, const void* b, const void* c,
                        const void* d) {
  if (a == nullptr || b == nullptr || d == nullptr) {
    return InvalidArgumentError("A, B and D must not be null");
  }
  TP_RETURN_IF_ERROR(CheckPointer("A", a, kAlignBytes));
  TP_RETURN_IF_ERROR(CheckPointer("B", b, kAlignBytes));
  TP_RETURN_IF_ERROR(CheckPointer("D", d, kAlignBytes));
  if (UsesC(r)) {
    if (c == nullptr) {
      return InvalidArgumentError("GemmParams.beta = " + std::to_string(r.beta) +
                                  " needs a C pointer");
    }
    TP_RETURN_IF_ERROR(CheckPointer("C", c, kAlignBytes));
    const bool fp8_out = r.d_type == DataType::kFloat8E4M3;
    if (c == d && (fp8_out || r.ldc != r.ldd || r.stride_c != r.stride_d)) {
      return InvalidArgumentError(
          "in-place accumulation (C == D) needs d_type = bf16 or f32, ldc == ldd and "
          "stride_c == stride_d");
    }
  }
  TP_RETURN_IF_ERROR(CheckPointer("a_scale", r.a_scale, kAlignBytes));
  TP_RETURN_IF_ERROR(CheckPointer("b_scale", r.b_scale, kAlignBytes));
  TP_RETURN_IF_ERROR(CheckPointer("d_quant_scale", r.d_quant_scale, kAlignBytes));
  TP_RETURN_IF_ERROR(CheckPointer("d_amax", r.d_amax, kAlignBytes));
  return Status::Ok();
}

}  // namespace

Status CublasLtGemm::CheckPointers(const GemmParams& p, const void* a, const void* b, const void* c,
                                   const void* d) {
  return CheckRunPointers(p, a, b, c, d);
}

Status CublasLtGemm::Run(const GemmParams& p, const void* a, const void* b, const void* c, void* d,
                         cudaStream_t stream) {
  if (!impl_) return FailedPreconditionError("CublasLtGemm::Run on an empty object");
  const std::string& name = impl_->name;
  if (Status s = ValidateGemmParams(p); !s.ok()) return s.WithContext("gemm '" + name + "'");
  const GemmParams r = Resolve(p);
  if (Status s = CheckRunPointers(r, a, b, c, d); !s.ok()) {
    return s.WithContext("gemm '" + name + "'");
  }
  if (SmallMGemmFits(r)) {
    if (Status s = LaunchSmallMGemm(r, a, b, c, d, stream); !s.ok()) {
      return s.WithContext(Describe(name, r));
    }
    return Status::Ok();
  }

  TP_ASSIGN_OR_RETURN(Plan * plan, impl_->FindOrBuildPlan(r, &stream));
  TP_RETURN_IF_ERROR(SetScalePointers(plan->desc.get(), r));

  // C is not read when beta == 0. cuBLASLt still wants a pointer for its layout: D itself when
  // the types match (in place, identical layouts), else null (FP8 output: C would be BF16).
  const void* c_arg = c;
  if (!UsesC(r)) c_arg = r.d_type != DataType::kFloat8E4M3 ? d : nullptr;

  const cublasStatus_t st = cublasLtMatmul(
      impl_->handle, plan->desc.get(), &r.alpha, /*A=*/b, plan->weight_layout.get(), /*B=*/a,
      plan->act_layout.get(), &r.beta, c_arg, plan->c_layout.get(), d, plan->d_layout.get(),
      &plan->algo, impl_->workspace.data(), impl_->workspace.size(), stream);
  if (st != CUBLAS_STATUS_SUCCESS) {
    return CublasCallError(st, "cublasLtMatmul(...)", __FILE__, __LINE__)
        .WithContext(Describe(name, r));
  }
  return Status::Ok();
}

}  // namespace tpserve
