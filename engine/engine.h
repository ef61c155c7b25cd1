// Engine: what the server needs from a model backend. CpuEngine (ranks as
// threads on the CPU reference executor) implements it; the CUDA engine
// (one process per GPU) will too.
#pragma once

#include <vector>

#include "engine/cpu_model.h"

namespace tpserve {

class Engine {
 public:
  virtual ~Engine() = default;

  // Logits [sequences, vocab] of the last token of every sequence of the
  // packed batch. Thread-safe (calls may be serialised).
  virtual StatusOr<std::vector<float>> Forward(const TokenBatch& batch) = 0;

  virtual const ModelConfig& config() const = 0;
  // False once the engine cannot serve any more (e.g. a rank failed).
  virtual bool healthy() const = 0;
};

}  // namespace tpserve
