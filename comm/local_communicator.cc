#include "comm/local_communicator.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "comm/deadline.h"

namespace tpserve {
namespace {

// State shared by all ranks of one group.
class LocalGroup {
 public:
  LocalGroup(int size, LocalCommOptions options)
      : size_(size), options_(options), slots_(size, nullptr), present_(size, false) {}

  int size() const { return size_; }

  // Generation barrier with a deadline; aborts the group on timeout.
  Status ArriveAndWait(int rank, const char* what) {
    std::unique_lock lock(mu_);
    if (aborted_) return Aborted(what);
    const uint64_t gen = generation_;
    present_[rank] = true;
    if (++arrived_ == size_) {
      arrived_ = 0;
      present_.assign(size_, false);
      ++generation_;
      cv_.notify_all();
      return Status::Ok();
    }
    const bool done =
        cv_.wait_until(lock, DeadlineAfter(std::chrono::steady_clock::now(), options_.timeout),
                       [&] { return generation_ != gen || aborted_; });
    if (generation_ != gen) return Status::Ok();
    if (!done) {
      aborted_ = true;
      cv_.notify_all();
      std::string missing;
      for (int r = 0; r < size_; ++r) {
        if (!present_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      return DeadlineExceededError("local communicator: rank " + std::to_string(rank) + " waited " +
                                   std::to_string(options_.timeout.count()) + " ms in " + what +
                                   " for its peers; rank(s) " + missing +
                                   " did not arrive; group aborted");
    }
    return Aborted(what);
  }

  void Publish(int rank, const void* p) {
    std::lock_guard lock(mu_);
    slots_[rank] = p;
  }
  const void* Slot(int rank) {
    std::lock_guard lock(mu_);
    return slots_[rank];
  }

  void PostMessage(int src, int dst, const void* buf, size_t bytes) {
    std::vector<std::byte> msg(bytes);
    if (bytes) std::memcpy(msg.data(), buf, bytes);
    std::lock_guard lock(mu_);
    mailboxes_[{src, dst}].push_back(std::move(msg));
    cv_.notify_all();
  }

  Status TakeMessage(int src, int dst, void* buf, size_t bytes) {
    std::unique_lock lock(mu_);
    auto& box = mailboxes_[{src, dst}];
    const bool got =
        cv_.wait_until(lock, DeadlineAfter(std::chrono::steady_clock::now(), options_.timeout),
                       [&] { return !box.empty() || aborted_; });
    if (!box.empty()) {
      std::vector<std::byte> msg = std::move(box.front());
      box.pop_front();
      if (msg.size() != bytes) {
        return InvalidArgumentError("local communicator: rank " + std::to_string(dst) +
                                    " posted a Recv of " + std::to_string(bytes) +
                                    " bytes from rank " + std::to_string(src) + ", which sent " +
                                    std::to_string(msg.size()));
      }
      if (bytes) std::memcpy(buf, msg.data(), bytes);
      return Status::Ok();
    }
    if (!got) {
      aborted_ = true;
      cv_.notify_all();
      return DeadlineExceededError("local communicator: rank " + std::to_string(dst) + " waited " +
                                   std::to_string(options_.timeout.count()) +
                                   " ms for a message from rank " + std::to_string(src) +
                                   "; group aborted");
    }
    return Aborted("Recv");
  }

  void Abort() {
    std::lock_guard lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

  bool aborted() {
    std::lock_guard lock(mu_);
    return aborted_;
  }

 private:
  static Status Aborted(const char* what) {
    return AbortedError(std::string("local communicator: group aborted (in ") + what + ")");
  }

  const int size_;
  const LocalCommOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<const void*> slots_;
  std::vector<bool> present_;  // ranks that have arrived at the current barrier
  std::map<std::pair<int, int>, std::deque<std::vector<std::byte>>> mailboxes_;
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  Status AllGather(const void* send, void* recv, size_t bytes_per_rank,
                   StreamHandle stream) override {
    TP_RETURN_IF_ERROR(CheckStream(stream, "AllGather"));
    group_->Publish(rank_, send);
    TP_RETURN_IF_ERROR(group_->ArriveAndWait(rank_, "AllGather"));
    auto* out = static_cast<std::byte*>(recv);
    for (int r = 0; r < size(); ++r) {
      const void* src = group_->Slot(r);
      std::byte* dst = out + static_cast<size_t>(r) * bytes_per_rank;
      // `send` may alias our own slot in `recv` (in-place AllGather).
      if (src != dst && bytes_per_rank) std::memmove(dst, src, bytes_per_rank);
    }
    // Nobody may reuse its send buffer until every rank has read it.
    return group_->ArriveAndWait(rank_, "AllGather");
  }

  Status ReduceScatter(const void* send, void* recv, size_t count, DataType dtype,
                       StreamHandle stream) override {
    TP_RETURN_IF_ERROR(CheckStream(stream, "ReduceScatter"));
    if (dtype != DataType::kFloat32 && dtype != DataType::kBFloat16) {
      return InvalidArgumentError("local communicator: ReduceScatter supports f32 and bf16, not " +
                                  std::string(DataTypeName(dtype)));
    }
    group_->Publish(rank_, send);
    TP_RETURN_IF_ERROR(group_->ArriveAndWait(rank_, "ReduceScatter"));
    // Sum in FP32 in rank order, so that every run gives the same bits.
    const size_t offset = static_cast<size_t>(rank_) * count;
    if (dtype == DataType::kFloat32) {
      std::vector<float> acc(count, 0.0f);
      for (int r = 0; r < size(); ++r) {
        const float* src = static_cast<const float*>(group_->Slot(r)) + offset;
        for (size_t i = 0; i < count; ++i) acc[i] += src[i];
      }
      TP_RETURN_IF_ERROR(group_->ArriveAndWait(rank_, "ReduceScatter"));
      std::memcpy(recv, acc.data(), count * sizeof(float));
    } else {
      std::vector<float> acc(count, 0.0f);
      for (int r = 0; r < size(); ++r) {
        const auto* src = static_cast<const BFloat16*>(group_->Slot(r)) + offset;
        for (size_t i = 0; i < count; ++i) acc[i] += BFloat16ToFloat(src[i]);
      }
      TP_RETURN_IF_ERROR(group_->ArriveAndWait(rank_, "ReduceScatter"));
      auto* out = static_cast<BFloat16*>(recv);
      for (size_t i = 0; i < count; ++i) out[i] = FloatToBFloat16(acc[i]);
    }
    return Status::Ok();
  }

  Status Send(const void* buf, size_t bytes, int peer, StreamHandle stream) override {
    TP_RETURN_IF_ERROR(CheckStream(stream, "Send"));
    TP_RETURN_IF_ERROR(CheckPeer(peer, "Send"));
    if (group_->aborted()) return AbortedError("local communicator: group aborted (in Send)");
    group_->PostMessage(rank_, peer, buf, bytes);
    return Status::Ok();
  }

  Status Recv(void* buf, size_t bytes, int peer, StreamHandle stream) override {
    TP_RETURN_IF_ERROR(CheckStream(stream, "Recv"));
    TP_RETURN_IF_ERROR(CheckPeer(peer, "Recv"));
    return group_->TakeMessage(peer, rank_, buf, bytes);
  }

  Status Broadcast(void* buf, size_t bytes, int root, StreamHandle stream) override {
    TP_RETURN_IF_ERROR(CheckStream(stream, "Broadcast"));
    TP_RETURN_IF_ERROR(CheckPeer(root, "Broadcast"));
    group_->Publish(rank_, buf);
    TP_RETURN_IF_ERROR(group_->ArriveAndWait(rank_, "Broadcast"));
    if (rank_ != root && bytes) std::memcpy(buf, group_->Slot(root), bytes);
    return group_->ArriveAndWait(rank_, "Broadcast");
  }

  Status Barrier() override { return group_->ArriveAndWait(rank_, "Barrier"); }

  void Abort() override { group_->Abort(); }

 private:
  static Status CheckStream(StreamHandle stream, const char* what) {
    if (stream != nullptr) {
      return InvalidArgumentError(std::string("local communicator: ") + what +
                                  " was given a stream; this implementation has none");
    }
    return Status::Ok();
  }
  Status CheckPeer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || (peer == rank_ && std::string(what) != "Broadcast")) {
      return InvalidArgumentError(std::string("local communicator: ") + what + " peer " +
                                  std::to_string(peer) + " is not another rank of a group of " +
                                  std::to_string(size()) + " (this is rank " +
                                  std::to_string(rank_) + ")");
    }
    return Status::Ok();
  }

  std::shared_ptr<LocalGroup> group_;
  int rank_;
};

}  // namespace

StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeLocalCommunicators(
    int size, LocalCommOptions options) {
  if (size < 1) {
    return InvalidArgumentError("local communicator: group size must be >= 1, got " +
                                std::to_string(size));
  }
  if (options.timeout.count() <= 0) {
    return InvalidArgumentError("local communicator: timeout must be positive");
  }
  auto group = std::make_shared<LocalGroup>(size, options);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(size);
  for (int r = 0; r < size; ++r) {
    comms.push_back(std::make_unique<LocalCommunicator>(group, r));
  }
  return comms;
}

Status RunOnLocalRanks(int size, const std::function<Status(Communicator&)>& fn,
                       LocalCommOptions options) {
  TP_ASSIGN_OR_RETURN(auto comms, MakeLocalCommunicators(size, options));
  std::vector<Status> results(size);
  std::vector<std::thread> threads;
  threads.reserve(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      // An exception must fail this rank like an error, not end the process.
      results[r] = CallCatching("rank " + std::to_string(r), [&] { return fn(*comms[r]); });
      if (!results[r].ok()) comms[r]->Abort();
    });
  }
  for (auto& t : threads) t.join();
  // Prefer the root cause over the ABORTED errors it caused in other ranks.
  for (const Status& s : results) {
    if (!s.ok() && s.code() != StatusCode::kAborted) return s;
  }
  for (const Status& s : results) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace tpserve
