#include "server/batcher.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>

#include <atomic>
#include <stdexcept>
#include <thread>

namespace tpserve {
namespace {

using namespace std::chrono_literals;
using Clock = TokenBatcher::Clock;

constexpr int64_t kVocab = 4;

// A fake engine: logits of sequence s = [first id, length, batch size, call#].
struct FakeEngine {
  std::atomic<int> calls{0};
  std::atomic<int> max_batch{0};
  std::chrono::milliseconds delay{0};
  Status fail;
  StatusOr<std::vector<float>> operator()(const TokenBatch& b) {
    const int call = ++calls;
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (!fail.ok()) return fail;
    max_batch = std::max<int>(max_batch, b.sequences());
    std::vector<float> out;
    for (int64_t s = 0; s < b.sequences(); ++s) {
      out.push_back(b.ids[b.cu_seqlens[s]]);
      out.push_back(b.cu_seqlens[s + 1] - b.cu_seqlens[s]);
      out.push_back(b.sequences());
      out.push_back(call);
    }
    return out;
  }
};

BatchForward Forward(FakeEngine& e) {
  return [&e](const TokenBatch& b) { return e(b); };
}

Clock::time_point Far() { return Clock::now() + 60s; }

// Waits (at most 10 s) until the worker has taken a batch into the engine:
// FakeEngine counts a call before its delay, so the engine is busy from here.
bool WaitForEngineCalls(const FakeEngine& e, int calls) {
  const auto give_up = Clock::now() + 10s;
  while (e.calls.load() < calls) {
    if (Clock::now() > give_up) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(TokenBatcher, PacksConcurrentRequestsIntoOneBatchAndRoutesResults) {
  FakeEngine e;
  TokenBatcher b({8192, 100ms, 64}, kVocab, Forward(e));
  std::vector<std::future<StatusOr<BatchResult>>> futures;
  for (int i = 0; i < 5; ++i) {
    auto f = b.Submit(std::vector<int32_t>(i + 1, 10 * i), Far(), nullptr);
    ASSERT_TRUE(f.ok());
    futures.push_back(std::move(f).value());
  }
  for (int i = 0; i < 5; ++i) {
    auto r = futures[i].get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->logits[0], 10 * i);  // its own first token
    EXPECT_EQ(r->logits[1], i + 1);   // its own length
    EXPECT_EQ(r->batch_sequences, 5);
  }
  EXPECT_EQ(e.calls.load(), 1);
}

TEST(TokenBatcher, RespectsTheTokenBudget) {
  FakeEngine e;
  TokenBatcher b({10, 50ms, 64}, kVocab, Forward(e));
  std::vector<std::future<StatusOr<BatchResult>>> futures;
  for (int i = 0; i < 4; ++i)
    futures.push_back(*b.Submit(std::vector<int32_t>(4, i), Far(), nullptr));
  for (auto& f : futures) ASSERT_TRUE(f.get().ok());
  EXPECT_EQ(e.max_batch.load(), 2);  // 4 + 4 <= 10 < 12
  EXPECT_EQ(e.calls.load(), 2);
}

TEST(TokenBatcher, RespectsTheSequenceLimit) {
  FakeEngine e;
  BatcherOptions o{8192, 50ms, 64};
  o.max_batch_sequences = 3;
  TokenBatcher b(o, kVocab, Forward(e));
  std::vector<std::future<StatusOr<BatchResult>>> futures;
  for (int i = 0; i < 7; ++i)
    futures.push_back(*b.Submit(std::vector<int32_t>(2, i), Far(), nullptr));
  for (auto& f : futures) ASSERT_TRUE(f.get().ok());
  EXPECT_EQ(e.max_batch.load(), 3);  // 7 two-token requests: at most 3 per batch
  EXPECT_GE(e.calls.load(), 3);
}

TEST(TokenBatcher, FullQueueIsResourceExhausted) {
  FakeEngine e;
  e.delay = 200ms;
  TokenBatcher b({8192, 0ms, 2}, kVocab, Forward(e));
  auto first = b.Submit({1}, Far(), nullptr);  // taken by the worker at once
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(WaitForEngineCalls(e, 1));  // the queue is empty again, the engine busy
  ASSERT_TRUE(b.Submit({2}, Far(), nullptr).ok());
  ASSERT_TRUE(b.Submit({3}, Far(), nullptr).ok());
  auto over = b.Submit({4}, Far(), nullptr);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), ::testing::HasSubstr("queue is full"));
}

TEST(TokenBatcher, ExpiredAndCancelledRequestsAreAnsweredWithoutComputing) {
  FakeEngine e;
  e.delay = 100ms;
  TokenBatcher b({8192, 0ms, 64}, kVocab, Forward(e));
  auto busy = *b.Submit({1}, Far(), nullptr);  // occupies the engine
  ASSERT_TRUE(WaitForEngineCalls(e, 1));
  auto expired = *b.Submit({2}, Clock::now() + 10ms, nullptr);
  auto flag = std::make_shared<std::atomic<bool>>(false);
  auto cancelled = *b.Submit({3}, Far(), flag);
  flag->store(true);
  EXPECT_EQ(expired.get().status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.get().status().code(), StatusCode::kCancelled);
  EXPECT_TRUE(busy.get().ok());
  EXPECT_EQ(e.calls.load(), 1);
}

// A request whose deadline comes while it waits for batch-mates is answered
// at its deadline, not when the batch would have flushed, and the requests
// still waiting are batched at their own time.
TEST(TokenBatcher, ADeadlineWhileWaitingForBatchMatesIsAnsweredAtTheDeadline) {
  FakeEngine e;
  TokenBatcher b({8192, 2s, 64}, kVocab, Forward(e));
  const auto start = Clock::now();
  auto patient = *b.Submit({1, 2}, Far(), nullptr);
  // The batcher is already waiting for the flush at 2 s when the hurried
  // request arrives: it must wake earlier for the new, nearer deadline.
  std::this_thread::sleep_for(50ms);
  auto hurried = *b.Submit({3}, Clock::now() + 50ms, nullptr);
  EXPECT_EQ(hurried.get().status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(Clock::now() - start, 1s);  // the flush comes only at 2 s
  EXPECT_EQ(e.calls.load(), 0);
  auto r = patient.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GE(Clock::now() - start, 2s);
  EXPECT_EQ(r->batch_sequences, 1);
  EXPECT_EQ(e.calls.load(), 1);
}

// One client's flood does not push another client's request behind all of
// it: batches take the clients' requests in turn.
TEST(TokenBatcher, BatchesTakeTheClientsRequestsInTurn) {
  FakeEngine e;
  e.delay = 30ms;
  TokenBatcher b({8192, 0ms, 1024, 4}, kVocab, Forward(e));  // 4 requests per batch
  auto done = [](std::promise<StatusOr<BatchResult>>* p) {
    return [p](StatusOr<BatchResult> r) { p->set_value(std::move(r)); };
  };
  std::promise<StatusOr<BatchResult>> busy;
  ASSERT_TRUE(b.Submit({1}, Far(), nullptr, done(&busy), "flood").ok());
  ASSERT_TRUE(WaitForEngineCalls(e, 1));  // the engine is busy: the rest queue up
  std::vector<std::promise<StatusOr<BatchResult>>> flood(20);
  for (auto& p : flood) ASSERT_TRUE(b.Submit({2}, Far(), nullptr, done(&p), "flood").ok());
  std::promise<StatusOr<BatchResult>> polite;
  ASSERT_TRUE(b.Submit({3}, Far(), nullptr, done(&polite), "polite").ok());
  auto r = polite.get_future().get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->logits[3], 2.0f);  // the second engine call, not the sixth
  for (auto& p : flood) EXPECT_TRUE(p.get_future().get().ok());
}

TEST(TokenBatcher, StopDrainsWhatIsQueuedThenRefuses) {
  FakeEngine e;
  e.delay = 30ms;
  TokenBatcher b({4, 0ms, 64}, kVocab, Forward(e));
  std::vector<std::future<StatusOr<BatchResult>>> futures;
  for (int i = 0; i < 6; ++i) futures.push_back(*b.Submit({i, i, i}, Far(), nullptr));
  b.Stop();
  EXPECT_EQ(b.Submit({9}, Far(), nullptr).status().code(), StatusCode::kUnavailable);
  for (auto& f : futures) EXPECT_TRUE(f.get().ok());  // none lost
}

TEST(TokenBatcher, EngineErrorsReachEveryRequestOfTheBatch) {
  FakeEngine e;
  e.fail = UnavailableError("engine down");
  TokenBatcher b({8192, 20ms, 64}, kVocab, Forward(e));
  auto a = *b.Submit({1}, Far(), nullptr);
  auto c = *b.Submit({2}, Far(), nullptr);
  EXPECT_EQ(a.get().status().message(), "engine down");
  EXPECT_EQ(c.get().status().code(), StatusCode::kUnavailable);
}

TEST(TokenBatcher, AnEngineThatThrowsOrMiscountsFailsItsBatchAndTheBatcherKeepsServing) {
  std::atomic<int> calls{0};
  TokenBatcher b({8192, 0ms, 64}, kVocab,
                 [&](const TokenBatch& tb) -> StatusOr<std::vector<float>> {
                   const int call = ++calls;
                   if (call == 1) throw std::runtime_error("out of host memory");
                   if (call == 2) return std::vector<float>(kVocab * tb.sequences() - 1, 0.0f);
                   return std::vector<float>(kVocab * tb.sequences(), 1.0f);
                 });
  auto thrown = b.Submit({1}, Far(), nullptr)->get();
  EXPECT_EQ(thrown.status().code(), StatusCode::kInternal);
  EXPECT_THAT(thrown.status().message(),
              ::testing::HasSubstr("the engine threw: out of host memory"));
  auto short_output = b.Submit({2}, Far(), nullptr)->get();
  EXPECT_EQ(short_output.status().code(), StatusCode::kInternal);
  EXPECT_THAT(short_output.status().message(),
              ::testing::HasSubstr("the engine returned 3 logits for 1 sequences of vocabulary 4"));
  auto fine = b.Submit({3}, Far(), nullptr)->get();  // the worker thread is still there
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(fine->logits, std::vector<float>(kVocab, 1.0f));
}

}  // namespace
}  // namespace tpserve
