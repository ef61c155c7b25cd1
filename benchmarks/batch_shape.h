// SEQSxLEN batch shapes of the prefill benchmarks (tpserve-bench-model --batches,
// tpserve-bench-attention --shapes): SEQS sequences of LEN tokens each.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "comm/status.h"

namespace tpserve {

struct BatchShape {
  int64_t seqs = 0, len = 0;
};

// "8x1024" -> {8, 1024}; anything else (or a zero) is INVALID_ARGUMENT naming `flag`.
inline StatusOr<BatchShape> ParseBatch(const std::string& text,
                                       const std::string& flag = "--batches") {
  BatchShape b;
  char x = 0;
  std::istringstream in(text);
  if (!(in >> b.seqs >> x >> b.len) || x != 'x' || !in.eof() || b.seqs < 1 || b.len < 1) {
    return InvalidArgumentError(flag + ": '" + text + "' is not SEQSxLEN (e.g. 8x1024)");
  }
  return b;
}

}  // namespace tpserve
