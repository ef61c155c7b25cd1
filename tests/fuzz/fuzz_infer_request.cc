// libFuzzer target: ValidateInferRequest on arbitrary serialized
// ModelInferRequests. Must never crash; an accepted request must satisfy the
// documented invariants (1..max_tokens ids, each in [0, vocab)).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "proto/grpc_service.pb.h"
#include "server/request_validation.h"

namespace {
constexpr int64_t kVocab = 1024;
constexpr int64_t kMaxTokens = 64;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "fuzz_infer_request: invariant violated: %s\n", what);
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  inference::ModelInferRequest q;
  if (!q.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto r = tpserve::ValidateInferRequest(q, {kVocab, kMaxTokens});
  if (!r.ok()) {
    if (r.status().message().empty()) Fail("error without a message");
    return 0;
  }
  const tpserve::ParsedRequest& p = *r;
  if (p.ids.empty()) Fail("ids empty");
  if (static_cast<int64_t>(p.ids.size()) > kMaxTokens) Fail("more than max_tokens ids");
  for (int32_t id : p.ids) {
    if (id < 0 || id >= kVocab) Fail("id out of [0, vocab)");
  }
  if (!p.want_logits && !p.want_next) Fail("no output wanted");
  return 0;
}
