// tpserve-probe-free-sync: does a CUDA allocation call on one GPU wait for
// work queued on another GPU of the same process?
//
// Why: the GPU tests run ranks as threads of one process. A copy-engine test
// hung (rarely) with both ranks' streams stuck, while one process per GPU
// never did. NCCL's maintainers describe cudaFree (and cudaMalloc) as
// synchronising not only the calling GPU but every GPU it has peer access
// with. If so, rank 0's thread freeing memory while rank 1's stream waits for
// a signal that rank 0 has not enqueued yet can never return: a deadlock that
// only timing decides. This probe measures the premise without deadlocking.
//
// Per case: GPU 1's stream waits (a stream memory operation, as the copy-
// engine layers use) on a flag in mapped host memory; 50 ms later the host
// thread makes one allocation call on GPU 0 and times it; a watchdog thread
// sets the flag --release-ms after the wait was queued. A call that takes
// about --release-ms - 50 ms waited for GPU 1; a call of microseconds did not.
// Every case runs first without peer access between the GPUs, then with it
// (cudaDeviceEnablePeerAccess both ways, as PeerBuffer does).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/status.h"

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;
using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct Case {
  std::string name;
  // Runs on the host thread with GPU 0 current; what it does is timed.
  std::function<Status()> call;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// GPU 1 waits on *flag == 1 (queued on `stream`), GPU 0's `call` is timed,
// the watchdog releases GPU 1 after `release_ms`. Returns the call's time.
StatusOr<double> TimeWhilePeerWaits(WaitValueFn wait_value, volatile uint32_t* flag,
                                    cudaStream_t stream1, const Case& c, int release_ms) {
  *flag = 0;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  TP_CUDA_CHECK(cudaSetDevice(1));
  void* dflag = nullptr;
  TP_CUDA_CHECK(cudaHostGetDevicePointer(&dflag, const_cast<uint32_t*>(flag), 0));
  const CUresult r = wait_value(reinterpret_cast<CUstream>(stream1),
                                reinterpret_cast<CUdeviceptr>(dflag), 1, CU_STREAM_WAIT_VALUE_EQ);
  if (r != CUDA_SUCCESS) return InternalError("cuStreamWaitValue32 failed: " + std::to_string(r));
  std::thread watchdog([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(release_ms));
    *flag = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  Status s = cudaSetDevice(0) == cudaSuccess ? Status::Ok() : InternalError("cudaSetDevice(0)");
  const auto t0 = Clock::now();
  if (s.ok()) s = c.call();
  const double ms = Ms(Clock::now() - t0);
  watchdog.join();
  TP_CUDA_CHECK(cudaSetDevice(1));
  TP_CUDA_CHECK(cudaStreamSynchronize(stream1));
  TP_CUDA_CHECK(cudaSetDevice(0));
  TP_RETURN_IF_ERROR(s.WithContext(c.name));
  return ms;
}

Status Main(int argc, char** argv) {
  CLI::App app{
      "tpserve-probe-free-sync: times CUDA allocation calls on GPU 0 while GPU 1's stream waits "
      "for the host, without and with peer access between the two GPUs (see the file comment)"};
  int release_ms = 1000;
  int64_t mib = 256;
  std::string json_path;
  app.add_option("--release-ms", release_ms,
                 "how long GPU 1's stream is held in each case (ms); a call that waited for GPU 1 "
                 "takes about this minus 50")
      ->check(CLI::Range(200, 60000));
  app.add_option("--mib", mib, "size of the large allocations (MiB)")->check(CLI::Range(1, 65536));
  app.add_option("--json", json_path, "also write the results to this JSON file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  int devices = 0;
  TP_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) return FailedPreconditionError("needs 2 GPUs, found " + std::to_string(devices));

  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  TP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000,
                                                 cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return UnimplementedError("the driver has no cuStreamWaitValue32");
  }
  const auto wait_value = reinterpret_cast<WaitValueFn>(fn);

  uint32_t* flag = nullptr;
  TP_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag), 64,
                              cudaHostAllocMapped | cudaHostAllocPortable));
  cudaStream_t stream0 = nullptr, stream1 = nullptr;
  TP_CUDA_CHECK(cudaSetDevice(1));
  TP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream1, cudaStreamNonBlocking));
  TP_CUDA_CHECK(cudaSetDevice(0));
  TP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream0, cudaStreamNonBlocking));

  const size_t big = static_cast<size_t>(mib) << 20, small = 1 << 20;
  void* pre_big = nullptr;
  void* pre_small = nullptr;
  std::vector<char> host(small, 1);
  const std::vector<Case> cases = {
      {"cudaMalloc " + std::to_string(mib) + " MiB",
       [&]() -> Status {
         void* p = nullptr;
         TP_CUDA_CHECK(cudaMalloc(&p, big));
         pre_big = p;  // freed by the next case
         return Status::Ok();
       }},
      {"cudaFree " + std::to_string(mib) + " MiB",
       [&]() -> Status {
         TP_CUDA_CHECK(cudaFree(pre_big));
         pre_big = nullptr;
         return Status::Ok();
       }},
      {"cudaMalloc 1 MiB",
       [&]() -> Status {
         TP_CUDA_CHECK(cudaMalloc(&pre_small, small));
         return Status::Ok();
       }},
      {"cudaFree 1 MiB",
       [&]() -> Status {
         TP_CUDA_CHECK(cudaFree(pre_small));
         pre_small = nullptr;
         return Status::Ok();
       }},
      {"cudaMallocAsync+cudaFreeAsync " + std::to_string(mib) + " MiB, stream synchronised",
       [&]() -> Status {
         void* p = nullptr;
         TP_CUDA_CHECK(cudaMallocAsync(&p, big, stream0));
         TP_CUDA_CHECK(cudaFreeAsync(p, stream0));
         TP_CUDA_CHECK(cudaStreamSynchronize(stream0));
         return Status::Ok();
       }},
      {"cudaMemcpy 1 MiB pageable host to device",
       [&]() -> Status {
         void* p = nullptr;
         TP_CUDA_CHECK(cudaMallocAsync(&p, small, stream0));
         TP_CUDA_CHECK(cudaStreamSynchronize(stream0));
         const auto t = Clock::now();
         TP_CUDA_CHECK(cudaMemcpy(p, host.data(), small, cudaMemcpyHostToDevice));
         std::printf("    (the copy alone %.3f ms)\n", Ms(Clock::now() - t));
         TP_CUDA_CHECK(cudaFreeAsync(p, stream0));
         TP_CUDA_CHECK(cudaStreamSynchronize(stream0));
         return Status::Ok();
       }},
      {"cudaStreamCreate + cudaStreamDestroy",
       [&]() -> Status {
         cudaStream_t s = nullptr;
         TP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
         TP_CUDA_CHECK(cudaStreamDestroy(s));
         return Status::Ok();
       }},
  };

  nlohmann::json out = nlohmann::json::array();
  for (const bool peer : {false, true}) {
    if (peer) {
      for (const auto& [dev, other] : {std::pair{0, 1}, std::pair{1, 0}}) {
        TP_CUDA_CHECK(cudaSetDevice(dev));
        const cudaError_t e = cudaDeviceEnablePeerAccess(other, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) TP_CUDA_CHECK(e);
        (void)cudaGetLastError();
      }
      TP_CUDA_CHECK(cudaSetDevice(0));
    }
    std::printf("peer access %s (GPU 1 held %d ms per case):\n", peer ? "ON" : "off", release_ms);
    for (const Case& c : cases) {
      TP_ASSIGN_OR_RETURN(double ms, TimeWhilePeerWaits(wait_value, flag, stream1, c, release_ms));
      const bool waited = ms > 0.5 * (release_ms - 50);
      std::printf("  %-60s %9.3f ms  %s\n", c.name.c_str(), ms,
                  waited ? "WAITED for GPU 1" : "did not wait");
      out.push_back({{"peer_access", peer},
                     {"call", c.name},
                     {"ms", ms},
                     {"release_ms", release_ms},
                     {"waited_for_peer_gpu", waited}});
    }
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << nlohmann::json{{"probe", "free_sync"}, {"records", out}}.dump(1) << "\n";
    if (!f) return InternalError("cannot write " + json_path);
  }
  TP_CUDA_CHECK(cudaFreeHost(flag));
  return Status::Ok();
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  const tpserve::Status s = tpserve::Main(argc, argv);
  if (!s.ok()) {
    std::fprintf(stderr, "tpserve-probe-free-sync: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
