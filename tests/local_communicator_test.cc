#include "comm/local_communicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

namespace tpserve {
namespace {

using std::chrono::milliseconds;

class LocalCommTest : public ::testing::TestWithParam<int> {};

TEST_P(LocalCommTest, AllGatherPlacesEachRanksBlock) {
  const int n = GetParam();
  ASSERT_TRUE(RunOnLocalRanks(n, [&](Communicator& c) -> Status {
                std::vector<int> send(3);
                for (int i = 0; i < 3; ++i) send[i] = c.rank() * 100 + i;
                std::vector<int> recv(3 * n, -1);
                TP_RETURN_IF_ERROR(c.AllGather(send.data(), recv.data(), 3 * sizeof(int), nullptr));
                for (int r = 0; r < n; ++r) {
                  for (int i = 0; i < 3; ++i) {
                    if (recv[r * 3 + i] != r * 100 + i) return InternalError("wrong element");
                  }
                }
                return Status::Ok();
              }).ok());
}

TEST_P(LocalCommTest, AllGatherInPlace) {
  const int n = GetParam();
  ASSERT_TRUE(RunOnLocalRanks(n, [&](Communicator& c) -> Status {
                std::vector<int> buf(n, -1);
                buf[c.rank()] = c.rank() + 7;
                TP_RETURN_IF_ERROR(c.AllGather(&buf[c.rank()], buf.data(), sizeof(int), nullptr));
                for (int r = 0; r < n; ++r) {
                  if (buf[r] != r + 7) return InternalError("wrong element");
                }
                return Status::Ok();
              }).ok());
}

TEST_P(LocalCommTest, ReduceScatterSumsFloat) {
  const int n = GetParam();
  ASSERT_TRUE(RunOnLocalRanks(n, [&](Communicator& c) -> Status {
                const int count = 5;
                std::vector<float> send(count * n);
                for (int i = 0; i < count * n; ++i) send[i] = float(i + c.rank());
                std::vector<float> recv(count, -1.0f);
                TP_RETURN_IF_ERROR(
                    c.ReduceScatter(send.data(), recv.data(), count, DataType::kFloat32, nullptr));
                for (int i = 0; i < count; ++i) {
                  const int idx = c.rank() * count + i;
                  const float want = float(n * idx + n * (n - 1) / 2);
                  if (recv[i] != want) return InternalError("wrong sum");
                }
                return Status::Ok();
              }).ok());
}

TEST_P(LocalCommTest, ReduceScatterBf16RoundsOnceFromFp32Sum) {
  const int n = GetParam();
  // Rank 0 gives 1, the other n - 1 ranks e each, with (n - 1) * e = 3 * 2^-9 (3/4 of BF16's
  // spacing 2^-7 at 1). For n >= 3, e <= 1.5 * 2^-9 is below half that spacing, so each e
  // alone is lost adding to 1 in BF16 and a sum rounded per step stays 1, while the FP32 sum
  // rounded once is 1 + 2^-7. n = 1 and 2 have at most one addition, where rounding once and
  // per step agree: they check the sum only.
  const float e = BFloat16ToFloat(FloatToBFloat16(n > 1 ? 3.0f / 512 / (n - 1) : 0.0f));
  double exact = 1.0;
  for (int r = 1; r < n; ++r) exact += e;
  const float want = BFloat16ToFloat(FloatToBFloat16(static_cast<float>(exact)));
  if (n >= 3) {
    ASSERT_EQ(want, 1.0f + 1.0f / 128) << "the case must tell the two roundings apart";
  }
  ASSERT_TRUE(RunOnLocalRanks(n, [&](Communicator& c) -> Status {
                std::vector<BFloat16> send(n, FloatToBFloat16(c.rank() == 0 ? 1.0f : e));
                BFloat16 out;
                TP_RETURN_IF_ERROR(
                    c.ReduceScatter(send.data(), &out, 1, DataType::kBFloat16, nullptr));
                if (BFloat16ToFloat(out) != want) {
                  return InternalError("bf16 sum " + std::to_string(BFloat16ToFloat(out)) +
                                       ", want " + std::to_string(want));
                }
                return Status::Ok();
              }).ok());
}

TEST_P(LocalCommTest, BroadcastFromEveryRoot) {
  const int n = GetParam();
  ASSERT_TRUE(RunOnLocalRanks(n, [&](Communicator& c) -> Status {
                for (int root = 0; root < n; ++root) {
                  int v = c.rank() == root ? 1000 + root : -1;
                  TP_RETURN_IF_ERROR(c.Broadcast(&v, sizeof v, root, nullptr));
                  if (v != 1000 + root) return InternalError("wrong broadcast value");
                }
                return Status::Ok();
              }).ok());
}

TEST_P(LocalCommTest, SendRecvRing) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "a ring needs two ranks";
  ASSERT_TRUE(RunOnLocalRanks(n, [&](Communicator& c) -> Status {
                const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
                int v = c.rank(), got = -1;
                TP_RETURN_IF_ERROR(c.Send(&v, sizeof v, next, nullptr));
                TP_RETURN_IF_ERROR(c.Recv(&got, sizeof got, prev, nullptr));
                if (got != prev) return InternalError("got message from the wrong rank");
                return c.Barrier();
              }).ok());
}

INSTANTIATE_TEST_SUITE_P(GroupSizes, LocalCommTest, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "ranks" + std::to_string(param_info.param);
                         });

TEST(LocalComm, RejectsBadGroupSize) {
  EXPECT_EQ(MakeLocalCommunicators(0).status().code(), StatusCode::kInvalidArgument);
}

TEST(LocalComm, RejectsStreamAndBadPeer) {
  auto comms = MakeLocalCommunicators(2);
  ASSERT_TRUE(comms.ok());
  int v = 0;
  int dummy_stream = 0;
  EXPECT_EQ((*comms)[0]->Send(&v, sizeof v, 0, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*comms)[0]->Send(&v, sizeof v, 2, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*comms)[0]->Send(&v, sizeof v, 1, &dummy_stream).code(), StatusCode::kInvalidArgument);
}

TEST(LocalComm, RecvSizeMismatchIsAnError) {
  Status s = RunOnLocalRanks(2, [](Communicator& c) -> Status {
    if (c.rank() == 0) {
      int v = 1;
      return c.Send(&v, sizeof v, 1, nullptr);
    }
    int64_t w = 0;
    return c.Recv(&w, sizeof w, 0, nullptr);
  });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sent 4"), std::string::npos) << s.ToString();
}

TEST(LocalComm, MissingPeerTimesOutInsteadOfHanging) {
  LocalCommOptions opts;
  opts.timeout = milliseconds(100);
  const auto start = std::chrono::steady_clock::now();
  Status s = RunOnLocalRanks(
      2,
      [](Communicator& c) -> Status {
        if (c.rank() == 1) return Status::Ok();  // never joins the barrier
        return c.Barrier();
      },
      opts);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// Three ranks, where `fail` ends one of them and the others wait in a barrier:
// the group's status, which must come well before the 30 s timeout (the
// abort, not the timeout, must end the others).
Status RunWithOneFailingRank(const std::function<Status(Communicator&)>& fail) {
  LocalCommOptions opts;
  opts.timeout = milliseconds(30000);
  const auto start = std::chrono::steady_clock::now();
  Status s = RunOnLocalRanks(3, fail, opts);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  return s;
}

TEST(LocalComm, FailingRankAbortsTheOthers) {
  Status s = RunWithOneFailingRank([](Communicator& c) -> Status {
    if (c.rank() == 2) return InternalError("rank 2 failed");
    return c.Barrier();
  });
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(), "rank 2 failed");
}

TEST(LocalComm, OperationsAfterAbortReturnAborted) {
  auto comms = MakeLocalCommunicators(2);
  ASSERT_TRUE(comms.ok());
  (*comms)[1]->Abort();
  (*comms)[1]->Abort();  // idempotent
  EXPECT_EQ((*comms)[0]->Barrier().code(), StatusCode::kAborted);
  int v = 0;
  EXPECT_EQ((*comms)[0]->Recv(&v, sizeof v, 1, nullptr).code(), StatusCode::kAborted);
}

// milliseconds::max() ("no practical limit") used to wrap to a deadline in
// the past: every wait timed out at once and aborted the group.
TEST(LocalComm, HugeTimeoutDoesNotExpireAtOnce) {
  LocalCommOptions opts;
  opts.timeout = milliseconds::max();
  Status s = RunOnLocalRanks(
      2,
      [](Communicator& c) -> Status {
        int v = 7;
        if (c.rank() == 1) {
          std::this_thread::sleep_for(milliseconds(100));  // rank 0 waits in Recv
          TP_RETURN_IF_ERROR(c.Send(&v, sizeof v, 0, nullptr));
          std::this_thread::sleep_for(milliseconds(100));  // rank 0 waits in Barrier
          return c.Barrier();
        }
        int got = 0;
        TP_RETURN_IF_ERROR(c.Recv(&got, sizeof got, 1, nullptr));
        if (got != 7) return InternalError("received " + std::to_string(got));
        return c.Barrier();
      },
      opts);
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(LocalComm, BarrierTimeoutNamesTheMissingRanks) {
  LocalCommOptions opts;
  opts.timeout = milliseconds(100);
  Status s = RunOnLocalRanks(
      4,
      [](Communicator& c) -> Status {
        if (c.rank() == 1 || c.rank() == 3) return Status::Ok();  // never arrive
        return c.Barrier();
      },
      opts);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("rank(s) 1, 3 did not arrive"), std::string::npos) << s.ToString();
}

// An exception in a rank used to escape its std::thread and end the process
// (std::terminate), defeating the callers' CallCatching.
TEST(LocalComm, ThrowingRankFailsLikeAnErrorAndAbortsTheOthers) {
  Status s = RunWithOneFailingRank([](Communicator& c) -> Status {
    if (c.rank() == 1) throw std::runtime_error("boom");
    return c.Barrier();
  });
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();
  EXPECT_EQ(s.message(), "rank 1 threw: boom");
}

// Only -1 means "no peer" (as in NcclCommunicator::SendRecv); the default
// SendRecv used to skip every negative peer silently.
TEST(LocalComm, SendRecvRejectsNegativePeersOtherThanMinusOne) {
  auto comms = MakeLocalCommunicators(2);
  ASSERT_TRUE(comms.ok());
  int v = 1;
  int w = 0;
  EXPECT_EQ((*comms)[0]->SendRecv(&v, sizeof v, -2, &w, sizeof w, -1, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*comms)[0]->SendRecv(&v, sizeof v, -1, &w, sizeof w, -5, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE((*comms)[0]->SendRecv(&v, sizeof v, -1, &w, sizeof w, -1, nullptr).ok());
}

}  // namespace
}  // namespace tpserve
