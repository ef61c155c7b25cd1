// tpserve-probe-peer-gemm: can a GEMM feed NVLink itself? For GEMM+RS at
// TP = 2, the half of a rank's partial that belongs to the peer must cross
// the link. tpserve's copy-engine methods compute it locally and copy it; this
// probe measures the alternative of letting cuBLASLt's epilogue store it
// straight into the peer GPU's memory (peer access over NVLink), against the
// same GEMM with a local output and against the copy engine moving the same
// bytes. Every algorithm the heuristic offers is timed, since the epilogue's
// store pattern decides how well remote stores stream.
//
// Two GPUs of this process with peer access; one host thread drives both.
// Per case: 3 warm-up launches, then --iters launches timed one by one with
// CUDA events on GPU 0's stream; the median is printed (and written with
// --json). "Both GPUs" cases run the same on GPU 1 at the same time (each
// pushes to the other), as the layer does. Correctness: the peer-written
// output of one algorithm is compared bit for bit with the local one.
//
// Pointer-array cases (--items N > 1, cuBLASLt's CUBLASLT_BATCH_MODE_POINTER_ARRAY):
// the same m rows as N items of m/N rows, one launch, each item's output
// anywhere; as a GEMM+RS with mode none at TP = N would write each rank's
// rows straight into that rank's memory. Here item 1 of GPU 0 (item 0 of
// GPU 1) goes to the other GPU, the rest stays local.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/write_replacing.h"
#include "comm/cuda_check.h"
#include "comm/status.h"
#include "layers/random_fill.h"
#include "layers/sum_kernels.h"

namespace tpserve {
namespace {

struct Options {
  int64_t m = 4096;  // rows: one rank's half of o at M = 8192, TP = 2
  int64_t n = 8192;
  int64_t k = 4096;
  int iters = 20;
  int max_algos = 8;
  int items = 2;  // pointer-array cases; 1 = skip them
  std::string json_path;
};

// D[m,n] (BF16, row-major) = A[m,k] · B[n,k]^T (FP8 E4M3) + beta · C, in
// cuBLASLt's column-major terms D^T = B · A^T with transa = T.
class Fp8Gemm {
 public:
  // items > 1: pointer-array batch of `items` GEMMs of m / items rows each.
  Status Init(const Options& o, float beta, int items = 1) {
    beta_ = beta;
    const int64_t rows = o.m / items;
    TP_CUBLAS_CHECK(cublasLtCreate(&handle_));
    TP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    TP_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    TP_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt));
    TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_layout_, CUDA_R_8F_E4M3, o.k, o.n, o.k));
    TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_layout_, CUDA_R_8F_E4M3, o.k, rows, o.k));
    TP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d_layout_, CUDA_R_16BF, o.n, rows, o.n));
    if (items > 1) {
      const int32_t count = items;
      const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
      for (auto l : {a_layout_, b_layout_, d_layout_}) {
        TP_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                         &count, sizeof count));
        TP_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE,
                                                         &mode, sizeof mode));
      }
    }
    TP_CUDA_CHECK(cudaMalloc(&workspace_, kWorkspace));
    cublasLtMatmulPreference_t pref = nullptr;
    TP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = kWorkspace;
    TP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    algos_.resize(o.max_algos);
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle_, desc_, b_layout_, a_layout_, d_layout_, d_layout_,
                                       pref, o.max_algos, algos_.data(), &found);
    cublasLtMatmulPreferenceDestroy(pref);
    TP_CUBLAS_CHECK(st);
    if (found == 0) {
      return UnimplementedError(std::string("cuBLASLt has no algorithm for this shape") +
                                (items > 1 ? " as a pointer-array batch" : ""));
    }
    algos_.resize(found);
    return Status::Ok();
  }
  ~Fp8Gemm() {
    if (workspace_ != nullptr) cudaFree(workspace_);
    for (auto l : {a_layout_, b_layout_, d_layout_}) {
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    }
    if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
    if (handle_ != nullptr) cublasLtDestroy(handle_);
  }
  size_t algos() const { return algos_.size(); }
  Status Run(size_t algo, const void* a, const void* b, const void* c, void* d, cudaStream_t s) {
    const float alpha = 1.0f;
    TP_CUBLAS_CHECK(cublasLtMatmul(handle_, desc_, &alpha, b, b_layout_, a, a_layout_, &beta_,
                                   c != nullptr ? c : d, d_layout_, d, d_layout_,
                                   &algos_[algo].algo, workspace_, kWorkspace, s));
    return Status::Ok();
  }

 private:
  static constexpr size_t kWorkspace = size_t{32} << 20;
  float beta_ = 0.0f;
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_layout_ = nullptr, b_layout_ = nullptr, d_layout_ = nullptr;
  void* workspace_ = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> algos_;
};

struct Gpu {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  void *a = nullptr, *b = nullptr, *c = nullptr, *d_local = nullptr, *d_from_peer = nullptr;
  Fp8Gemm plain, accumulate, items;
  // Device arrays of pointers for the pointer-array cases: A, B, D with
  // every item local, and D with the remote item in the peer's memory.
  void** ptrs = nullptr;  // [A x items][B x items][D local x items][D mixed x items]
};

Status Probe(const Options& o) {
  int devices = 0;
  TP_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    return FailedPreconditionError("needs 2 GPUs, found " + std::to_string(devices));
  }
  int can = 0;
  TP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (can == 0) return FailedPreconditionError("GPU 0 cannot access GPU 1's memory (peer access)");
  const size_t out_bytes = o.m * o.n * 2;
  std::array<Gpu, 2> gpu;
  for (int g = 0; g < 2; ++g) {
    Gpu& x = gpu[g];
    TP_CUDA_CHECK(cudaSetDevice(g));
    TP_CUDA_CHECK(cudaDeviceEnablePeerAccess(1 - g, 0));
    TP_CUDA_CHECK(cudaStreamCreateWithFlags(&x.stream, cudaStreamNonBlocking));
    TP_CUDA_CHECK(cudaEventCreate(&x.start));
    TP_CUDA_CHECK(cudaEventCreate(&x.stop));
    TP_CUDA_CHECK(cudaMalloc(&x.a, o.m * o.k));
    TP_CUDA_CHECK(cudaMalloc(&x.b, o.n * o.k));
    TP_CUDA_CHECK(cudaMalloc(&x.c, out_bytes));
    TP_CUDA_CHECK(cudaMalloc(&x.d_local, out_bytes));
    TP_CUDA_CHECK(cudaMalloc(&x.d_from_peer, out_bytes));
    // Full-range operands, as tpserve-bench uses (values decide the GEMM's power draw).
    TP_RETURN_IF_ERROR(
        LaunchRandomUniform(x.a, DataType::kFloat8E4M3, o.m * o.k, 11 + g, 448.0f, x.stream));
    TP_RETURN_IF_ERROR(
        LaunchRandomUniform(x.b, DataType::kFloat8E4M3, o.n * o.k, 21 + g, 448.0f, x.stream));
    TP_RETURN_IF_ERROR(
        LaunchRandomUniform(x.c, DataType::kBFloat16, o.m * o.n, 31 + g, 1.0f, x.stream));
    TP_RETURN_IF_ERROR(x.plain.Init(o, 0.0f));
    TP_RETURN_IF_ERROR(x.accumulate.Init(o, 1.0f));
    if (o.items > 1) TP_RETURN_IF_ERROR(x.items.Init(o, 0.0f, o.items));
    TP_CUDA_CHECK(cudaStreamSynchronize(x.stream));
  }

  // Median ms on GPU 0 of `body(g)`, run on GPU 0 alone or on both at once.
  auto time = [&](const std::function<Status(int)>& body, bool both) -> StatusOr<double> {
    const int gpus = both ? 2 : 1;
    std::vector<double> ms;
    for (int i = -3; i < o.iters; ++i) {
      for (int g = 0; g < gpus; ++g) {
        TP_CUDA_CHECK(cudaSetDevice(g));
        TP_CUDA_CHECK(cudaEventRecord(gpu[g].start, gpu[g].stream));
        TP_RETURN_IF_ERROR(body(g));
        TP_CUDA_CHECK(cudaEventRecord(gpu[g].stop, gpu[g].stream));
      }
      for (int g = 0; g < gpus; ++g) TP_CUDA_CHECK(cudaEventSynchronize(gpu[g].stop));
      float t = 0;
      TP_CUDA_CHECK(cudaEventElapsedTime(&t, gpu[0].start, gpu[0].stop));
      if (i >= 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };

  nlohmann::json records = nlohmann::json::array();
  auto report = [&](const std::string& what, int algo, double ms) {
    std::printf("%-58s algo %d  %.4f ms\n", what.c_str(), algo, ms);
    records.push_back({{"case", what}, {"algo", algo}, {"median_ms", ms}});
  };
  auto plain = [&](bool to_peer, size_t algo) {
    return [&, to_peer, algo](int g) {
      Gpu& x = gpu[g];
      void* d = to_peer ? gpu[1 - g].d_from_peer : x.d_local;
      return x.plain.Run(algo, x.a, x.b, nullptr, d, x.stream);
    };
  };
  for (size_t algo = 0; algo < gpu[0].plain.algos(); ++algo) {
    TP_ASSIGN_OR_RETURN(double local, time(plain(false, algo), false));
    TP_ASSIGN_OR_RETURN(double peer_one, time(plain(true, algo), false));
    TP_ASSIGN_OR_RETURN(double peer_both, time(plain(true, algo), true));
    report("GEMM, D local", static_cast<int>(algo), local);
    report("GEMM, D in the peer's memory, GPU 0 alone", static_cast<int>(algo), peer_one);
    report("GEMM, D in the peer's memory, both GPUs at once", static_cast<int>(algo), peer_both);
  }
  // Pointer arrays (after every GPU's buffers exist: the mixed D points across).
  const int64_t item_rows = o.m / std::max(1, o.items);
  for (int g = 0; o.items > 1 && g < 2; ++g) {
    Gpu& x = gpu[g];
    TP_CUDA_CHECK(cudaSetDevice(g));
    std::vector<void*> host(4 * o.items);
    const int remote_item = g == 0 ? 1 : 0;
    for (int i = 0; i < o.items; ++i) {
      host[i] = static_cast<char*>(x.a) + i * item_rows * o.k;
      host[o.items + i] = x.b;
      host[2 * o.items + i] = static_cast<char*>(x.d_local) + i * item_rows * o.n * 2;
      host[3 * o.items + i] =
          static_cast<char*>(i == remote_item ? gpu[1 - g].d_from_peer : x.d_local) +
          i * item_rows * o.n * 2;
    }
    TP_CUDA_CHECK(cudaMalloc(&x.ptrs, host.size() * sizeof(void*)));
    TP_CUDA_CHECK(
        cudaMemcpy(x.ptrs, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
  }
  auto items = [&](bool mixed, size_t algo) {
    return [&, mixed, algo](int g) {
      Gpu& x = gpu[g];
      void** d = x.ptrs + (mixed ? 3 : 2) * o.items;
      return x.items.Run(algo, x.ptrs, x.ptrs + o.items, nullptr, d, x.stream);
    };
  };
  for (size_t algo = 0; o.items > 1 && algo < gpu[0].items.algos(); ++algo) {
    const std::string what = std::to_string(o.items) + " pointer-array items";
    TP_ASSIGN_OR_RETURN(double local, time(items(false, algo), false));
    TP_ASSIGN_OR_RETURN(double mixed, time(items(true, algo), true));
    report("GEMM as " + what + ", all local", static_cast<int>(algo), local);
    report("GEMM as " + what + ", one in the peer's, both GPUs", static_cast<int>(algo), mixed);
  }
  for (size_t algo = 0; algo < gpu[0].accumulate.algos(); ++algo) {
    TP_ASSIGN_OR_RETURN(double acc, time(
                                        [&](int g) {
                                          Gpu& x = gpu[g];
                                          return x.accumulate.Run(algo, x.a, x.b, x.c, x.d_local,
                                                                  x.stream);
                                        },
                                        false));
    report("GEMM + C (beta 1), C and D local", static_cast<int>(algo), acc);
    // The own rows' GEMM adding the peer's partial of them where it lies, in the peer's
    // memory (read over NVLink by the epilogue): a GEMM+RS at TP = 2 with no copy and no sum
    // pass, both GPUs at once as the layer would run it.
    TP_ASSIGN_OR_RETURN(double acc_remote, time(
                                               [&](int g) {
                                                 Gpu& x = gpu[g];
                                                 return x.accumulate.Run(algo, x.a, x.b,
                                                                         gpu[1 - g].c, x.d_local,
                                                                         x.stream);
                                               },
                                               true));
    report("GEMM + C (beta 1), C in the peer's memory, both GPUs", static_cast<int>(algo),
           acc_remote);
  }
  auto copy = [&](int g) -> Status {
    TP_CUDA_CHECK(cudaMemcpyPeerAsync(gpu[1 - g].d_from_peer, 1 - g, gpu[g].d_local, g, out_bytes,
                                      gpu[g].stream));
    return Status::Ok();
  };
  // The other half of the question: once the peer's partial of this GPU's
  // rows lies in the peer's memory, adding it by reading it over NVLink (what
  // mode none with copy engines does), against adding it after it was
  // written here (what a push would leave to do), for one item's rows.
  const int64_t half = (o.m / 2) * o.n;
  auto sum = [&](bool remote) {
    return [&, remote](int g) {
      Gpu& x = gpu[g];
      SumSlotsParams sp;
      sp.dst = x.c;
      sp.num_slots = 2;
      sp.slots[0] = x.d_local;
      sp.slots[1] = remote ? gpu[1 - g].d_local : x.d_from_peer;
      sp.count = half;
      return LaunchSumSlotsBf16(sp, x.stream);
    };
  };
  TP_ASSIGN_OR_RETURN(double sum_local, time(sum(false), true));
  TP_ASSIGN_OR_RETURN(double sum_remote, time(sum(true), true));
  report("sum of 2 slots of m/2 rows, both local", -1, sum_local);
  report("sum of 2 slots of m/2 rows, one read in the peer's memory", -1, sum_remote);
  auto copy_half = [&](int g) -> Status {
    TP_CUDA_CHECK(cudaMemcpyPeerAsync(gpu[1 - g].d_from_peer, 1 - g, gpu[g].d_local, g, half * 2,
                                      gpu[g].stream));
    return Status::Ok();
  };
  TP_ASSIGN_OR_RETURN(double ce_half, time(copy_half, true));
  report("copy engine, m/2 rows to the peer, both GPUs at once", -1, ce_half);
  TP_ASSIGN_OR_RETURN(double ce_one, time(copy, false));
  TP_ASSIGN_OR_RETURN(double ce_both, time(copy, true));
  report("copy engine, D to the peer, GPU 0 alone", -1, ce_one);
  report("copy engine, D to the peer, both GPUs at once", -1, ce_both);

  // The peer-written output must equal the local one (same algorithm, same operands).
  TP_CUDA_CHECK(cudaSetDevice(0));
  TP_RETURN_IF_ERROR(
      gpu[0].plain.Run(0, gpu[0].a, gpu[0].b, nullptr, gpu[0].d_local, gpu[0].stream));
  TP_RETURN_IF_ERROR(
      gpu[0].plain.Run(0, gpu[0].a, gpu[0].b, nullptr, gpu[1].d_from_peer, gpu[0].stream));
  TP_CUDA_CHECK(cudaStreamSynchronize(gpu[0].stream));
  std::vector<uint16_t> local(o.m * o.n), remote(o.m * o.n);
  TP_CUDA_CHECK(cudaMemcpy(local.data(), gpu[0].d_local, out_bytes, cudaMemcpyDefault));
  TP_CUDA_CHECK(cudaMemcpy(remote.data(), gpu[1].d_from_peer, out_bytes, cudaMemcpyDefault));
  size_t differ = 0;
  for (size_t i = 0; i < local.size(); ++i) differ += local[i] != remote[i];
  std::printf("peer-written D vs local D: %zu of %zu elements differ\n", differ, local.size());
  {
    // GEMM + C with C read in GPU 1's memory against the same C copied here first.
    // On GPU 0's (non-blocking) stream, so that the GEMM reads the copy, not what was there.
    TP_CUDA_CHECK(
        cudaMemcpyPeerAsync(gpu[0].d_from_peer, 0, gpu[1].c, 1, out_bytes, gpu[0].stream));
    TP_RETURN_IF_ERROR(gpu[0].accumulate.Run(0, gpu[0].a, gpu[0].b, gpu[0].d_from_peer,
                                             gpu[0].d_local, gpu[0].stream));
    TP_CUDA_CHECK(cudaStreamSynchronize(gpu[0].stream));
    TP_CUDA_CHECK(cudaMemcpy(local.data(), gpu[0].d_local, out_bytes, cudaMemcpyDefault));
    TP_RETURN_IF_ERROR(
        gpu[0].accumulate.Run(0, gpu[0].a, gpu[0].b, gpu[1].c, gpu[0].d_local, gpu[0].stream));
    TP_CUDA_CHECK(cudaStreamSynchronize(gpu[0].stream));
    TP_CUDA_CHECK(cudaMemcpy(remote.data(), gpu[0].d_local, out_bytes, cudaMemcpyDefault));
    size_t c_differ = 0;
    for (size_t i = 0; i < local.size(); ++i) c_differ += local[i] != remote[i];
    std::printf("GEMM + C with C in the peer's memory vs C local: %zu of %zu elements differ\n",
                c_differ, local.size());
    differ += c_differ;
  }
  if (o.items > 1) {
    // GPU 0's item 1, written into GPU 1's memory, against the same item computed locally.
    TP_RETURN_IF_ERROR(items(false, 0)(0));
    TP_RETURN_IF_ERROR(items(true, 0)(0));
    TP_CUDA_CHECK(cudaStreamSynchronize(gpu[0].stream));
    const size_t item_bytes = item_rows * o.n * 2, at = item_bytes;  // item 1
    TP_CUDA_CHECK(cudaMemcpy(local.data(), static_cast<char*>(gpu[0].d_local) + at, item_bytes,
                             cudaMemcpyDefault));
    TP_CUDA_CHECK(cudaMemcpy(remote.data(), static_cast<char*>(gpu[1].d_from_peer) + at, item_bytes,
                             cudaMemcpyDefault));
    size_t item_differ = 0;
    for (size_t i = 0; i < item_bytes / 2; ++i) item_differ += local[i] != remote[i];
    std::printf("pointer-array item written to the peer vs local: %zu of %zu elements differ\n",
                item_differ, item_bytes / 2);
    differ += item_differ;
  }

  for (Gpu& x : gpu) {
    for (void* p : {x.a, x.b, x.c, x.d_local, x.d_from_peer}) cudaFree(p);
    cudaEventDestroy(x.start);
    cudaEventDestroy(x.stop);
    cudaStreamDestroy(x.stream);
    if (x.ptrs != nullptr) cudaFree(x.ptrs);
  }
  if (differ != 0) return InternalError("the GEMM's output written to the peer differs");
  if (!o.json_path.empty()) {
    const nlohmann::json out = {
        {"m", o.m}, {"n", o.n}, {"k", o.k}, {"iters", o.iters}, {"records", records}};
    if (std::string err = WriteReplacing(o.json_path, out.dump(1) + "\n"); !err.empty()) {
      return InternalError(err);
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  tpserve::Options o;
  CLI::App app{
      "Times a cuBLASLt FP8 GEMM (D[m,n] = A[m,k] B[n,k]^T, BF16 out) writing D into the peer "
      "GPU's memory over NVLink, against D local, an accumulating GEMM and the copy engine "
      "moving D. Needs 2 GPUs with peer access."};
  app.add_option("--m", o.m, "rows of A and D (default 4096: one rank's half of o at M=8192)")
      ->check(CLI::Range(int64_t{16}, int64_t{1} << 20));
  app.add_option("--n", o.n, "columns of D (multiple of 16)")
      ->check(CLI::Range(int64_t{16}, int64_t{1} << 20));
  app.add_option("--k", o.k, "reduction length (multiple of 16)")
      ->check(CLI::Range(int64_t{16}, int64_t{1} << 20));
  app.add_option("--iters", o.iters, "timed launches per case (median reported)")
      ->check(CLI::Range(1, 10000));
  app.add_option("--algos", o.max_algos, "heuristic answers to time")->check(CLI::Range(1, 64));
  app.add_option("--items", o.items,
                 "pointer-array cases: the m rows as this many items, one of them written into "
                 "the peer's memory (m must divide evenly; 1 = skip)")
      ->check(CLI::Range(1, 64));
  app.add_option("--json", o.json_path, "also write the medians to this JSON file");
  CLI11_PARSE(app, argc, argv);
  if (o.n % 16 != 0 || o.k % 16 != 0) {
    std::fprintf(stderr, "error: --n and --k must be multiples of 16 (FP8 GEMM), got %lld, %lld\n",
                 static_cast<long long>(o.n), static_cast<long long>(o.k));
    return 2;
  }
  if (o.m % o.items != 0 || (o.m / o.items) * o.n * 2 % 16 != 0) {
    std::fprintf(stderr,
                 "error: --m (%lld) must split into --items (%d) equal, 16-byte aligned "
                 "items\n",
                 static_cast<long long>(o.m), o.items);
    return 2;
  }
  const tpserve::Status st = tpserve::Probe(o);
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
