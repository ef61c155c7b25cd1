// Helpers shared by the generation tests (CPU and GPU): submit prompts to a
// Generator and collect each one's tokens and end.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <vector>

#include "engine/generator.h"

namespace tpserve {

struct GenerationOutcome {
  std::vector<int32_t> tokens;
  std::vector<float> log_probs;
  FinishReason finish = FinishReason::kNone;
  Status error;
  int events = 0;
};

// Submits every prompt at once and waits (at most `timeout`) for all of them;
// a request that does not finish in time is a test failure.
inline std::vector<GenerationOutcome> GenerateAll(Generator& g,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  const GenerationParams& params,
                                                  std::chrono::seconds timeout) {
  std::vector<GenerationOutcome> out(prompts.size());
  std::vector<std::promise<void>> done(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = g.Submit(prompts[i], params, Generator::Clock::time_point::max(),
                       [&out, &done, i](GenerationEvent e) {
                         GenerationOutcome& o = out[i];
                         ++o.events;
                         o.tokens.insert(o.tokens.end(), e.new_tokens.begin(), e.new_tokens.end());
                         o.log_probs.insert(o.log_probs.end(), e.new_log_probs.begin(),
                                            e.new_log_probs.end());
                         if (e.last()) {
                           o.finish = e.finish;
                           o.error = e.error;
                           done[i].set_value();
                         }
                       });
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    if (!id.ok()) done[i].set_value();
  }
  for (auto& d : done) {
    if (d.get_future().wait_for(timeout) != std::future_status::ready) {
      ADD_FAILURE() << "a generation did not finish";
    }
  }
  return out;
}

}  // namespace tpserve
