// GPU tests of NcclCommunicator, NcclCommPool and NcclSymmetricBuffer (label
// `gpu`; skipped unless at least 2 CUDA devices are visible). Ranks are
// threads of this process: thread r drives device r with its own stream and
// joins one NCCL communicator made from a shared unique id.
//
// Every check uses fresh random data (the seed is printed), poisons outputs
// (0xFF bytes: NaN) before each run, and compares with a CPU computation.
// Waits go through NcclCommunicator::WaitStream (deadline + abort), never
// cudaStreamSynchronize, so a broken collective fails the test instead of
// hanging it; a failing rank aborts every rank's communicators.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/cuda_check.h"
#include "comm/dtype.h"
#include "comm/nccl_communicator.h"

namespace tpserve {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kTimeout{60'000};

// ---- small owners (tests only) ----------------------------------------------------

class DeviceMem {
 public:
  static StatusOr<DeviceMem> Make(size_t bytes) {
    DeviceMem m;
    const cudaError_t err = cudaMalloc(&m.ptr_, bytes);
    if (err != cudaSuccess) {
      m.ptr_ = nullptr;
      return CudaCallError(err, "cudaMalloc", __FILE__, __LINE__)
          .WithContext("test buffer of " + std::to_string(bytes) + " bytes");
    }
    m.bytes_ = bytes;
    return m;
  }
  DeviceMem() = default;
  DeviceMem(DeviceMem&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceMem& operator=(DeviceMem&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceMem() {
    if (ptr_ != nullptr) TP_CUDA_LOG(cudaFree(ptr_));
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class Stream {
 public:
  Status Create() {
    TP_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    return Status::Ok();
  }
  ~Stream() {
    if (s_ != nullptr) TP_CUDA_LOG(cudaStreamDestroy(s_));
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// A captured graph and its executable, destroyed before the communicator.
class Graph {
 public:
  ~Graph() {
    if (exec_ != nullptr) TP_CUDA_LOG(cudaGraphExecDestroy(exec_));
    if (graph_ != nullptr) TP_CUDA_LOG(cudaGraphDestroy(graph_));
  }
  cudaGraph_t* graph() { return &graph_; }
  cudaGraphExec_t* exec() { return &exec_; }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// ---- data ---------------------------------------------------------------------

std::vector<float> RandomFloats(uint64_t seed, int rank, size_t n) {
  std::mt19937_64 rng(seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(rank + 1)));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<BFloat16> RandomBf16(uint64_t seed, int rank, size_t n) {
  std::vector<BFloat16> v(n);
  const std::vector<float> f = RandomFloats(seed, rank, n);
  for (size_t i = 0; i < n; ++i) v[i] = FloatToBFloat16(f[i]);
  return v;
}

Status Upload(void* dev, const void* host, size_t bytes, cudaStream_t s) {
  TP_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s));
  return Status::Ok();
}

Status Poison(void* dev, size_t bytes, cudaStream_t s) {
  TP_CUDA_CHECK(cudaMemsetAsync(dev, 0xFF, bytes, s));
  return Status::Ok();
}

// Copies back after everything on `s`. The stream is drained first with the
// communicator's deadline: a copy into pageable memory may block the host
// until the stream gets there, which must not be behind a stuck collective.
Status Download(NcclCommunicator& comm, void* host, const void* dev, size_t bytes, cudaStream_t s) {
  TP_RETURN_IF_ERROR(comm.WaitStream(s));
  TP_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s));
  return comm.WaitStream(s);
}

// Bit-exact comparison of `got[offset..]` with `want`.
Status ExpectSameFloats(const std::vector<float>& got, size_t offset,
                        const std::vector<float>& want, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&got[offset + i], &want[i], sizeof(float)) != 0) {
      return InternalError(what + ": element " + std::to_string(i) + " is " +
                           std::to_string(got[offset + i]) + ", expected " +
                           std::to_string(want[i]));
    }
  }
  return Status::Ok();
}

// ---- ranks as threads --------------------------------------------------------------

// Runs one function per rank on its own thread. A rank that fails aborts the
// communicators every rank registered, so that the others stop waiting.
class RankGroup {
 public:
  explicit RankGroup(int n) : pools_(n, nullptr) {}

  void Register(int rank, NcclCommPool* pool) {
    std::lock_guard lock(mu_);
    pools_[rank] = pool;
  }
  void Unregister(int rank) {
    std::lock_guard lock(mu_);
    pools_[rank] = nullptr;
  }
  void AbortAll() {
    std::lock_guard lock(mu_);
    for (NcclCommPool* p : pools_) {
      if (p != nullptr) p->Abort();
    }
  }

  // Returns the first failure in rank order, naming the rank.
  Status Run(const std::function<Status(int rank)>& fn) {
    const int n = static_cast<int>(pools_.size());
    std::vector<Status> results(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        SetCurrentRank(r);
        results[r] = fn(r);
        if (!results[r].ok()) AbortAll();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      if (!results[r].ok()) return results[r].WithContext("rank " + std::to_string(r));
    }
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::vector<NcclCommPool*> pools_;
};

class GpuNcclTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The GPU hosts require NVLink multicast off; keep an explicit setting.
    ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  }

  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count < 2) {
      GTEST_SKIP() << "needs at least 2 CUDA devices; cudaGetDeviceCount: "
                   << (err == cudaSuccess ? std::to_string(count) + " device(s)"
                                          : std::string(cudaGetErrorString(err)));
    }
    nranks_ = std::min(count, 8);
    ASSERT_EQ(ncclGetUniqueId(&id_), ncclSuccess);
    seed_ = (static_cast<uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
    std::cout << "[ seed     ] " << seed_ << " (" << nranks_ << " ranks)" << std::endl;
  }

  // Creates rank r's base communicator in a registered pool, runs fn.
  Status WithPool(RankGroup& group, int r, milliseconds timeout,
                  const std::function<Status(NcclCommPool&)>& fn) {
    TP_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> base,
                        NcclCommunicator::Create(id_, nranks_, r, r, NcclCommConfig{}, timeout));
    NcclCommPool pool(std::move(base));
    group.Register(r, &pool);
    Status s = fn(pool);
    // Say at once which rank failed and why: its peers may only notice at
    // their deadline, long after.
    if (!s.ok()) spdlog::error("rank {} failed: {}", r, s.ToString());
    group.Unregister(r);
    return s;
  }

  Status RunWithPools(const std::function<Status(int r, NcclCommPool&)>& fn,
                      milliseconds timeout = kTimeout) {
    RankGroup group(nranks_);
    return group.Run([&](int r) {
      return WithPool(group, r, timeout, [&](NcclCommPool& pool) { return fn(r, pool); });
    });
  }

  int nranks_ = 0;
  ncclUniqueId id_{};
  uint64_t seed_ = 0;
};

// AllGather of `count` floats per rank from `send` into `recv` (which may be
// the in-place slot), checked on the host. Buffers are the caller's.
Status CheckAllGather(NcclCommunicator& comm, void* send, void* recv, size_t count, uint64_t seed,
                      cudaStream_t s, const std::string& what) {
  const int n = comm.size();
  const int r = comm.rank();
  const size_t bytes = count * sizeof(float);
  const std::vector<float> mine = RandomFloats(seed, r, count);
  TP_RETURN_IF_ERROR(Poison(recv, bytes * n, s));
  TP_RETURN_IF_ERROR(Upload(send, mine.data(), bytes, s));
  TP_RETURN_IF_ERROR(comm.AllGather(send, recv, bytes, s));
  TP_RETURN_IF_ERROR(comm.WaitStream(s));
  std::vector<float> got(count * n);
  TP_RETURN_IF_ERROR(Download(comm, got.data(), recv, bytes * n, s));
  for (int q = 0; q < n; ++q) {
    TP_RETURN_IF_ERROR(ExpectSameFloats(got, q * count, RandomFloats(seed, q, count),
                                        what + ", block of rank " + std::to_string(q)));
  }
  return Status::Ok();
}

TEST_F(GpuNcclTest, AllGatherMatchesInputs) {
  const Status s = RunWithPools([&](int r, NcclCommPool& pool) -> Status {
    NcclCommunicator& comm = pool.base();
    Stream stream;
    TP_RETURN_IF_ERROR(stream.Create());
    uint64_t run = seed_;
    for (size_t count : {size_t{37}, size_t{1002} * 733 + 1}) {
      const size_t bytes = count * sizeof(float);
      TP_ASSIGN_OR_RETURN(DeviceMem send, DeviceMem::Make(bytes));
      TP_ASSIGN_OR_RETURN(DeviceMem recv, DeviceMem::Make(bytes * nranks_));
      TP_RETURN_IF_ERROR(CheckAllGather(comm, send.get(), recv.get(), count, ++run, stream.get(),
                                        "AllGather of " + std::to_string(count) + " floats"));
      // In place: this rank's input already sits in its slot of the output.
      void* slot = static_cast<char*>(recv.get()) + r * bytes;
      const std::vector<float> mine = RandomFloats(++run, r, count);
      TP_RETURN_IF_ERROR(Poison(recv.get(), bytes * nranks_, stream.get()));
      TP_RETURN_IF_ERROR(Upload(slot, mine.data(), bytes, stream.get()));
      TP_RETURN_IF_ERROR(comm.AllGather(slot, recv.get(), bytes, stream.get()));
      std::vector<float> got(count * nranks_);
      TP_RETURN_IF_ERROR(Download(comm, got.data(), recv.get(), bytes * nranks_, stream.get()));
      for (int q = 0; q < nranks_; ++q) {
        TP_RETURN_IF_ERROR(
            ExpectSameFloats(got, q * count, RandomFloats(run, q, count),
                             "in-place AllGather, block of rank " + std::to_string(q)));
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.ToString() << " (seed " << seed_ << ")";
}

TEST_F(GpuNcclTest, ReduceScatterF32MatchesCpuSum) {
  const size_t count = 1003;  // per rank
  const Status s = RunWithPools([&](int r, NcclCommPool& pool) -> Status {
    NcclCommunicator& comm = pool.base();
    Stream stream;
    TP_RETURN_IF_ERROR(stream.Create());
    const size_t total = count * nranks_;
    TP_ASSIGN_OR_RETURN(DeviceMem send, DeviceMem::Make(total * sizeof(float)));
    TP_ASSIGN_OR_RETURN(DeviceMem recv, DeviceMem::Make(count * sizeof(float)));
    const std::vector<float> mine = RandomFloats(seed_, r, total);
    TP_RETURN_IF_ERROR(Upload(send.get(), mine.data(), total * sizeof(float), stream.get()));
    TP_RETURN_IF_ERROR(Poison(recv.get(), count * sizeof(float), stream.get()));
    TP_RETURN_IF_ERROR(
        comm.ReduceScatter(send.get(), recv.get(), count, DataType::kFloat32, stream.get()));
    std::vector<float> got(count);
    TP_RETURN_IF_ERROR(Download(comm, got.data(), recv.get(), count * sizeof(float), stream.get()));
    std::vector<std::vector<float>> all;
    for (int q = 0; q < nranks_; ++q) all.push_back(RandomFloats(seed_, q, total));
    for (size_t i = 0; i < count; ++i) {
      double sum = 0, abs_sum = 0;
      for (int q = 0; q < nranks_; ++q) {
        sum += all[q][r * count + i];
        abs_sum += std::fabs(all[q][r * count + i]);
      }
      // FP32 summation in any order: n-1 roundings of at most 2^-24 relative.
      const double tol = nranks_ * std::ldexp(1.0, -24) * abs_sum + 1e-30;
      if (!(std::fabs(got[i] - sum) <= tol)) {
        return InternalError("f32 ReduceScatter element " + std::to_string(i) + " is " +
                             std::to_string(got[i]) + ", expected " + std::to_string(sum) +
                             " (tolerance " + std::to_string(tol) + ")");
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.ToString() << " (seed " << seed_ << ")";
}

TEST_F(GpuNcclTest, ReduceScatterBf16MatchesCpuSumWithinRounding) {
  const size_t count = 4097;  // per rank
  const Status s = RunWithPools([&](int r, NcclCommPool& pool) -> Status {
    NcclCommunicator& comm = pool.base();
    Stream stream;
    TP_RETURN_IF_ERROR(stream.Create());
    const size_t total = count * nranks_;
    TP_ASSIGN_OR_RETURN(DeviceMem send, DeviceMem::Make(total * sizeof(BFloat16)));
    TP_ASSIGN_OR_RETURN(DeviceMem recv, DeviceMem::Make(count * sizeof(BFloat16)));
    const std::vector<BFloat16> mine = RandomBf16(seed_, r, total);
    TP_RETURN_IF_ERROR(Upload(send.get(), mine.data(), total * sizeof(BFloat16), stream.get()));
    TP_RETURN_IF_ERROR(Poison(recv.get(), count * sizeof(BFloat16), stream.get()));
    TP_RETURN_IF_ERROR(
        comm.ReduceScatter(send.get(), recv.get(), count, DataType::kBFloat16, stream.get()));
    std::vector<BFloat16> got(count);
    TP_RETURN_IF_ERROR(
        Download(comm, got.data(), recv.get(), count * sizeof(BFloat16), stream.get()));
    std::vector<std::vector<BFloat16>> all;
    for (int q = 0; q < nranks_; ++q) all.push_back(RandomBf16(seed_, q, total));
    for (size_t i = 0; i < count; ++i) {
      double sum = 0, abs_sum = 0;
      for (int q = 0; q < nranks_; ++q) {
        const float x = BFloat16ToFloat(all[q][r * count + i]);
        sum += x;
        abs_sum += std::fabs(x);
      }
      // NCCL rounds to BF16 after each of the n-1 additions: each rounding
      // errs by at most 2^-8 of a partial sum, itself at most sum |x|.
      const double tol = (nranks_ - 1) * std::ldexp(1.0, -8) * abs_sum + 1e-30;
      const float g = BFloat16ToFloat(got[i]);
      if (!(std::fabs(g - sum) <= tol)) {
        return InternalError("bf16 ReduceScatter element " + std::to_string(i) + " is " +
                             std::to_string(g) + ", expected " + std::to_string(sum) +
                             " (tolerance " + std::to_string(tol) + ")");
      }
    }
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.ToString() << " (seed " << seed_ << ")";
}

TEST_F(GpuNcclTest, ReduceScatterRejectsUnsupportedType) {
  const Status s = RunWithPools([&](int, NcclCommPool& pool) -> Status {
    const Status r = pool.base().ReduceScatter(nullptr, nullptr, 1, DataType::kInt32, nullptr);
    if (r.code() != StatusCode::kInvalidArgument) {
      return InternalError("expected INVALID_ARGUMENT, got " + r.ToString());
    }
    if (pool.base().aborted()) return InternalError("an argument error aborted the communicator");
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST_F(GpuNcclTest, SendRecvRingAndPlainSendRecv) {
  const size_t count = 4099;
  const size_t bytes = count * sizeof(float);
  const Status s = RunWithPools([&](int r, NcclCommPool& pool) -> Status {
    NcclCommunicator& comm = pool.base();
    Stream stream;
    TP_RETURN_IF_ERROR(stream.Create());
    TP_ASSIGN_OR_RETURN(DeviceMem send, DeviceMem::Make(bytes));
    TP_ASSIGN_OR_RETURN(DeviceMem recv, DeviceMem::Make(bytes));
    const int next = (r + 1) % nranks_;
    const int prev = (r + nranks_ - 1) % nranks_;
    // Ring step: send to rank+1, receive from rank-1, as one group.
    const std::vector<float> mine = RandomFloats(seed_, r, count);
    TP_RETURN_IF_ERROR(Upload(send.get(), mine.data(), bytes, stream.get()));
    TP_RETURN_IF_ERROR(Poison(recv.get(), bytes, stream.get()));
    TP_RETURN_IF_ERROR(
        comm.SendRecv(send.get(), bytes, next, recv.get(), bytes, prev, stream.get()));
    std::vector<float> got(count);
    TP_RETURN_IF_ERROR(Download(comm, got.data(), recv.get(), bytes, stream.get()));
    TP_RETURN_IF_ERROR(
        ExpectSameFloats(got, 0, RandomFloats(seed_, prev, count), "SendRecv ring step"));

    // Plain Send/Recv between ranks 0 and 1 (the others sit out).
    if (r <= 1) {
      const std::vector<float> msg = RandomFloats(seed_ + 1, 0, count);
      if (r == 0) {
        TP_RETURN_IF_ERROR(Upload(send.get(), msg.data(), bytes, stream.get()));
        TP_RETURN_IF_ERROR(comm.Send(send.get(), bytes, 1, stream.get()));
        TP_RETURN_IF_ERROR(comm.WaitStream(stream.get()));
      } else {
        TP_RETURN_IF_ERROR(Poison(recv.get(), bytes, stream.get()));
        TP_RETURN_IF_ERROR(comm.Recv(recv.get(), bytes, 0, stream.get()));
        TP_RETURN_IF_ERROR(Download(comm, got.data(), recv.get(), bytes, stream.get()));
        TP_RETURN_IF_ERROR(ExpectSameFloats(got, 0, msg, "Send 0 -> Recv 1"));
      }
      // One-sided SendRecv (a peer of -1 skips that side): 1 -> 0.
      const std::vector<float> back = RandomFloats(seed_ + 2, 1, count);
      if (r == 1) {
        TP_RETURN_IF_ERROR(Upload(send.get(), back.data(), bytes, stream.get()));
        TP_RETURN_IF_ERROR(comm.SendRecv(send.get(), bytes, 0, nullptr, 0, -1, stream.get()));
        TP_RETURN_IF_ERROR(comm.WaitStream(stream.get()));
      } else {
        TP_RETURN_IF_ERROR(Poison(recv.get(), bytes, stream.get()));
        TP_RETURN_IF_ERROR(comm.SendRecv(nullptr, 0, -1, recv.get(), bytes, 1, stream.get()));
        TP_RETURN_IF_ERROR(Download(comm, got.data(), recv.get(), bytes, stream.get()));
        TP_RETURN_IF_ERROR(ExpectSameFloats(got, 0, back, "SendRecv 1 -> 0, one-sided"));
      }
    }
    TP_RETURN_IF_ERROR(comm.SendRecv(nullptr, 0, -1, nullptr, 0, -1, stream.get()));
    // Bad peers are argument errors that leave the communicator working.
    if (comm.Send(send.get(), bytes, nranks_, stream.get()).code() !=
        StatusCode::kInvalidArgument) {
      return InternalError("Send to rank " + std::to_string(nranks_) + " was not rejected");
    }
    return comm.Barrier();
  });
  EXPECT_TRUE(s.ok()) << s.ToString() << " (seed " << seed_ << ")";
}

TEST_F(GpuNcclTest, BroadcastFromLastRank) {
  const size_t count = 65537;
  const size_t bytes = count * sizeof(float);
  const Status s = RunWithPools([&](int r, NcclCommPool& pool) -> Status {
    NcclCommunicator& comm = pool.base();
    Stream stream;
    TP_RETURN_IF_ERROR(stream.Create());
    TP_ASSIGN_OR_RETURN(DeviceMem buf, DeviceMem::Make(bytes));
    const int root = nranks_ - 1;
    const std::vector<float> data = RandomFloats(seed_, root, count);
    if (r == root) {
      TP_RETURN_IF_ERROR(Upload(buf.get(), data.data(), bytes, stream.get()));
    } else {
      TP_RETURN_IF_ERROR(Poison(buf.get(), bytes, stream.get()));
    }
    TP_RETURN_IF_ERROR(comm.Broadcast(buf.get(), bytes, root, stream.get()));
    std::vector<float> got(count);
    TP_RETURN_IF_ERROR(Download(comm, got.data(), buf.get(), bytes, stream.get()));
    return ExpectSameFloats(got, 0, data, "Broadcast from rank " + std::to_string(root));
  });
  EXPECT_TRUE(s.ok()) << s.ToString() << " (seed " << seed_ << ")";
}

TEST_F(GpuNcclTest, BarrierWaitsForTheSlowestRank) {
  std::atomic<int64_t> rank0_wait_ms{-1};
  const Status s = RunWithPools([&](int r, NcclCommPool& pool) -> Status {
    NcclCommunicator& comm = pool.base();
    TP_RETURN_IF_ERROR(comm.Barrier());  // warm-up: connections exist afterwards
    if (r == nranks_ - 1) std::this_thread::sleep_for(milliseconds(300));
    const auto start = Clock::now();
    TP_RETURN_IF_ERROR(comm.Barrier());
    if (r == 0) {
      rank0_wait_ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
    }
    for (int i = 0; i < 5; ++i) TP_RETURN_IF_ERROR(comm.Barrier());
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(rank0_wait_ms.load(), 250) << "rank 0 left the barrier before the last rank entered";
}

TEST_F(GpuNcclTest, PoolVariantsGatherCorrectly) {
  const size_t count = 733 * 1024 + 5;
  const size_t bytes = count * sizeof(float);
  const Status s = RunWithPools([&](int r, NcclCommPool& pool) -> Status {
    (void)r;
    Stream stream;
    TP_RETURN_IF_ERROR(stream.Create());

    // Capped CTAs, ordinary buffers.
    NcclCommConfig capped;
    capped.max_ctas = 2;
    TP_ASSIGN_OR_RETURN(NcclCommunicator * small, pool.Get(capped));
    TP_ASSIGN_OR_RETURN(NcclCommunicator * again, pool.Get(capped));
    TP_ASSIGN_OR_RETURN(NcclCommunicator * base, pool.Get(NcclCommConfig{}));
    if (small != again || base != &pool.base() || pool.num_variants() != 1) {
      return InternalError("NcclCommPool::Get does not reuse communicators by key");
    }
    if (small->config() != capped || small->rank() != pool.base().rank()) {
      return InternalError("split communicator has the wrong config or rank");
    }
    {
      TP_ASSIGN_OR_RETURN(DeviceMem send, DeviceMem::Make(bytes));
      TP_ASSIGN_OR_RETURN(DeviceMem recv, DeviceMem::Make(bytes * nranks_));
      TP_RETURN_IF_ERROR(CheckAllGather(*small, send.get(), recv.get(), count, seed_, stream.get(),
                                        "AllGather, max_ctas=2"));
    }

    // Zero-CTA policy with symmetric buffers (copy-engine AllGather).
    NcclCommConfig zero;
    zero.cta_policy = NcclCommConfig::CtaPolicy::kZero;
    TP_ASSIGN_OR_RETURN(NcclCommunicator * ce, pool.Get(zero));
    if (pool.num_variants() != 2) return InternalError("expected 2 variants");
    const Status empty = NcclSymmetricBuffer::Create(*ce, 0, "empty").status();
    if (empty.code() != StatusCode::kInvalidArgument ||
        empty.message().find("'empty'") == std::string::npos) {
      return InternalError("a 0-byte symmetric buffer was not rejected by name: " +
                           empty.ToString());
    }
    TP_ASSIGN_OR_RETURN(NcclSymmetricBuffer send,
                        NcclSymmetricBuffer::Create(*ce, bytes, "ag_send"));
    TP_ASSIGN_OR_RETURN(NcclSymmetricBuffer recv,
                        NcclSymmetricBuffer::Create(*ce, bytes * nranks_, "ag_recv"));
    for (int run = 0; run < 2; ++run) {
      TP_RETURN_IF_ERROR(CheckAllGather(*ce, send.data(), recv.data(), count, seed_ + 7 + run,
                                        stream.get(), "AllGather, cta_policy=zero"));
    }
    // Also the base, after the variants exist (shared resources).
    TP_ASSIGN_OR_RETURN(DeviceMem send2, DeviceMem::Make(bytes));
    TP_ASSIGN_OR_RETURN(DeviceMem recv2, DeviceMem::Make(bytes * nranks_));
    return CheckAllGather(pool.base(), send2.get(), recv2.get(), count, seed_ + 99, stream.get(),
                          "AllGather on the base after splits");
  });
  EXPECT_TRUE(s.ok()) << s.ToString() << " (seed " << seed_ << ")";
}

// Captures one AllGather into a graph and replays it with fresh inputs. The
// capture is the communicator's first operation, so NCCL's connection setup
// (and possibly ncclInProgress) happens during the capture.
Status CaptureAndReplayAllGather(NcclCommunicator& comm, void* send, void* recv, size_t count,
                                 uint64_t seed, const std::string& what) {
  const int n = comm.size();
  const int r = comm.rank();
  const size_t bytes = count * sizeof(float);
  Stream stream;
  TP_RETURN_IF_ERROR(stream.Create());
  Graph graph;
  TP_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  Status enqueued = comm.AllGather(send, recv, bytes, stream.get());
  const Status wait_in_capture = comm.WaitStream(stream.get());
  const cudaError_t ended = cudaStreamEndCapture(stream.get(), graph.graph());
  TP_RETURN_IF_ERROR(enqueued.WithContext(what + ": capturing"));
  TP_CUDA_CHECK(ended);
  if (wait_in_capture.code() != StatusCode::kFailedPrecondition) {
    return InternalError("WaitStream on a capturing stream gave " + wait_in_capture.ToString());
  }
  TP_CUDA_CHECK(cudaGraphInstantiate(graph.exec(), *graph.graph(), 0));
  for (int replay = 0; replay < 3; ++replay) {
    const uint64_t run_seed = seed + 1000 * replay;
    const std::vector<float> mine = RandomFloats(run_seed, r, count);
    TP_RETURN_IF_ERROR(Upload(send, mine.data(), bytes, stream.get()));
    TP_RETURN_IF_ERROR(Poison(recv, bytes * n, stream.get()));
    TP_CUDA_CHECK(cudaGraphLaunch(*graph.exec(), stream.get()));
    std::vector<float> got(count * n);
    TP_RETURN_IF_ERROR(Download(comm, got.data(), recv, bytes * n, stream.get()));
    for (int q = 0; q < n; ++q) {
      TP_RETURN_IF_ERROR(ExpectSameFloats(
          got, q * count, RandomFloats(run_seed, q, count),
          what + ", replay " + std::to_string(replay) + ", block of rank " + std::to_string(q)));
    }
  }
  return Status::Ok();
}

// DISABLED: fails on the 2xH200 host (NCCL 2.28.3 there; run log in
// benchmarks/results/ce-allgather-graph-debug.log.gz): the base
// communicator's captured AllGather passes, the eager copy-engine AllGather
// (CTA policy zero, symmetric windows) passes, but the first replay of the
// captured copy-engine AllGather leaves the peer's block unwritten (still the
// poison) on rank 1; the test then hangs in teardown. The layers' copy-engine
// graph test passes only with the same data every replay, so it cannot tell a
// missing or late copy from a correct one: until this is understood, copy
// engines must not be used inside CUDA graphs (see layers/linear_knobs.h).
TEST_F(GpuNcclTest, DISABLED_AllGatherInCapturedGraph) {
  const size_t count = 1002 * 37;
  const size_t bytes = count * sizeof(float);
  const Status s = RunWithPools([&](int, NcclCommPool& pool) -> Status {
    {
      // As the communicator's contract says: one eager run before capturing, so
      // that NCCL sets up its connections outside the graph (capturing a
      // communicator's very first AllGather failed on the H200 host).
      TP_ASSIGN_OR_RETURN(DeviceMem send, DeviceMem::Make(bytes));
      TP_ASSIGN_OR_RETURN(DeviceMem recv, DeviceMem::Make(bytes * nranks_));
      Stream warm;
      TP_RETURN_IF_ERROR(warm.Create());
      TP_RETURN_IF_ERROR(CheckAllGather(pool.base(), send.get(), recv.get(), count, seed_ + 1,
                                        warm.get(), "eager AllGather, base"));
      TP_RETURN_IF_ERROR(CaptureAndReplayAllGather(pool.base(), send.get(), recv.get(), count,
                                                   seed_, "graph AllGather, base"));
    }
    NcclCommConfig zero;
    zero.cta_policy = NcclCommConfig::CtaPolicy::kZero;
    TP_ASSIGN_OR_RETURN(NcclCommunicator * ce, pool.Get(zero));
    TP_ASSIGN_OR_RETURN(NcclSymmetricBuffer send,
                        NcclSymmetricBuffer::Create(*ce, bytes, "g_send"));
    TP_ASSIGN_OR_RETURN(NcclSymmetricBuffer recv,
                        NcclSymmetricBuffer::Create(*ce, bytes * nranks_, "g_recv"));
    // Here the recommended way: one eager run before capturing.
    Stream warm;
    TP_RETURN_IF_ERROR(warm.Create());
    TP_RETURN_IF_ERROR(CheckAllGather(*ce, send.data(), recv.data(), count, seed_ + 3, warm.get(),
                                      "eager AllGather, cta_policy=zero"));
    return CaptureAndReplayAllGather(*ce, send.data(), recv.data(), count, seed_ + 5,
                                     "graph AllGather, cta_policy=zero");
  });
  EXPECT_TRUE(s.ok()) << s.ToString() << " (seed " << seed_ << ")";
}

// Rank 0 waits for a message nobody sends: WaitStream must give up at its
// deadline and abort instead of hanging. The other ranks sit in a barrier
// that rank 0 never joins until another thread aborts them.
TEST_F(GpuNcclTest, WaitStreamDeadlineAbortsInsteadOfHanging) {
  const milliseconds timeout{10'000};
  std::atomic<int64_t> rank0_ms{-1};
  const Status s = RunWithPools(
      [&](int r, NcclCommPool& pool) -> Status {
        NcclCommunicator& comm = pool.base();
        Stream stream;
        TP_RETURN_IF_ERROR(stream.Create());
        TP_ASSIGN_OR_RETURN(DeviceMem buf, DeviceMem::Make(4096));
        TP_ASSIGN_OR_RETURN(DeviceMem buf2, DeviceMem::Make(4096));
        // Warm up so that enqueues below need no connection setup.
        const int next = (r + 1) % nranks_;
        const int prev = (r + nranks_ - 1) % nranks_;
        TP_RETURN_IF_ERROR(
            comm.SendRecv(buf.get(), 4096, next, buf2.get(), 4096, prev, stream.get()));
        TP_RETURN_IF_ERROR(
            comm.SendRecv(buf.get(), 4096, prev, buf2.get(), 4096, next, stream.get()));
        TP_RETURN_IF_ERROR(comm.WaitStream(stream.get()));
        TP_RETURN_IF_ERROR(comm.Barrier());

        if (r == 0) {
          TP_RETURN_IF_ERROR(comm.Recv(buf.get(), 4096, 1, stream.get()));
          const auto start = Clock::now();
          const Status w = comm.WaitStream(stream.get(), start + milliseconds(500));
          rank0_ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
          if (w.code() != StatusCode::kDeadlineExceeded || !comm.aborted()) {
            return InternalError("expected DEADLINE_EXCEEDED and an aborted communicator, got " +
                                 w.ToString());
          }
        } else {
          std::thread aborter([&] {
            std::this_thread::sleep_for(milliseconds(800));
            comm.Abort();
            comm.Abort();  // idempotent
          });
          const auto start = Clock::now();
          const Status b = comm.Barrier();
          const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
          aborter.join();
          if (b.code() != StatusCode::kAborted || ms > 5000) {
            return InternalError("Barrier under Abort() from another thread gave " + b.ToString() +
                                 " after " + std::to_string(ms) + " ms");
          }
        }
        const Status after = comm.AllGather(buf.get(), buf2.get(), 16, stream.get());
        if (after.code() != StatusCode::kAborted) {
          return InternalError("AllGather after abort gave " + after.ToString());
        }
        // The aborted kernels must have left the streams.
        const auto drain_deadline = Clock::now() + std::chrono::seconds(10);
        while (cudaStreamQuery(stream.get()) == cudaErrorNotReady) {
          if (Clock::now() > drain_deadline) {
            std::abort();  // freeing memory under a live kernel would be worse
          }
          std::this_thread::sleep_for(milliseconds(1));
        }
        return Status::Ok();
      },
      timeout);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(rank0_ms.load(), 450);
  EXPECT_LT(rank0_ms.load(), 5000);
}

TEST_F(GpuNcclTest, CreateTimesOutWhenAPeerIsMissing) {
  const auto start = Clock::now();
  // Only rank 0 of 2 shows up.
  StatusOr<std::unique_ptr<NcclCommunicator>> comm = InternalError("not run");
  std::thread t([&] {
    SetCurrentRank(0);
    comm = NcclCommunicator::Create(id_, 2, 0, 0, NcclCommConfig{}, milliseconds(1000));
  });
  t.join();
  const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kDeadlineExceeded) << comm.status().ToString();
  EXPECT_LT(ms, 10'000);
}

// A raised CancelFlag ends the wait for a missing peer long before the
// timeout (rank 0 of CudaEngine, when a worker dies while loading), with
// ABORTED and the flag's reason.
TEST_F(GpuNcclTest, CreateGivesUpWhenItsCancelFlagIsRaised) {
  auto cancel = std::make_shared<CancelFlag>();
  const auto start = Clock::now();
  StatusOr<std::unique_ptr<NcclCommunicator>> comm = InternalError("not run");
  Clock::time_point returned;  // when Create returned, measured on its own thread
  std::thread t([&] {
    SetCurrentRank(0);
    comm = NcclCommunicator::Create(id_, 2, 0, 0, NcclCommConfig{}, milliseconds(60'000), cancel);
    returned = Clock::now();
  });
  std::this_thread::sleep_for(milliseconds(300));
  cancel->Cancel("worker rank 1 exited (test)");
  cancel->Cancel("a second reason is not kept");
  t.join();
  // Create waited for the flag (not the join, which follows the 300 ms sleep anyway).
  const auto ms = std::chrono::duration_cast<milliseconds>(returned - start).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kAborted) << comm.status().ToString();
  EXPECT_NE(comm.status().message().find("worker rank 1 exited (test)"), std::string::npos)
      << comm.status().ToString();
  EXPECT_EQ(cancel->reason(), "worker rank 1 exited (test)");
  EXPECT_GE(ms, 300);
  EXPECT_LT(ms, 10'000);  // the timeout is 60 s
}

TEST_F(GpuNcclTest, CreateRejectsBadArguments) {
  NcclCommConfig bad;
  bad.min_ctas = 4;
  bad.max_ctas = 2;
  EXPECT_EQ(NcclCommunicator::Create(id_, 2, 0, 0, bad, kTimeout).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(id_, 2, 2, 0, NcclCommConfig{}, kTimeout).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(id_, 2, 0, 1000, NcclCommConfig{}, kTimeout).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      NcclCommunicator::Create(id_, 2, 0, 0, NcclCommConfig{}, milliseconds(0)).status().code(),
      StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tpserve
