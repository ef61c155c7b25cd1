// The autotuner's choice for one case (layer shape and M), from the timings
// tpserve-bench made: pure logic, header-only, tested on the CPU
// (tests/tune_choice_test.cc).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "layers/linear_knobs.h"

namespace tpserve {

struct TuneCandidate {
  std::string method;   // "none", "pipeline" or "ring" are candidates; others are ignored
  LinearKnobs knobs;    // plain none (the reference) is mode none without copy engines
  double sweep_ms = 0;  // median in the sweep; 0: not measured
  double final_ms = 0;  // median in the finalists' second round; 0: not a finalist
};

struct TuneChoice {
  LinearKnobs knobs;
  double best_ms = 0;  // the chosen knobs' median (of the round chosen from)
  double none_ms = 0;  // plain none's median in that round; 0: not measured
  bool from_finals = false;
};

// The methods the tuner chooses among (layer methods; not the baselines or
// the breakdown's parts).
inline bool IsTuneCandidate(const std::string& method) {
  return method == "none" || method == "pipeline" || method == "ring";
}

// When any candidate has a finalists' time, only the finalists compete, on
// those times (the second round puts them in the same context); otherwise
// every candidate competes on its sweep time. The fastest wins if it beats
// plain none by more than `margin` (1 % by default), else plain none does:
// an overlap method must pay for its extra launches and signals. nullopt
// when no candidate was measured.
inline std::optional<TuneChoice> ChooseTuned(const std::vector<TuneCandidate>& candidates,
                                             double margin = 0.99) {
  bool finals = false;
  for (const TuneCandidate& c : candidates) finals = finals || c.final_ms > 0;
  TuneChoice choice;
  choice.from_finals = finals;
  LinearKnobs none_knobs;
  for (const TuneCandidate& c : candidates) {
    if (!IsTuneCandidate(c.method)) continue;
    const double ms = finals ? c.final_ms : c.sweep_ms;
    if (!(ms > 0)) continue;
    if (c.method == "none" && !c.knobs.copy_engine) {
      choice.none_ms = ms;
      none_knobs = c.knobs;
    }
    if (choice.best_ms == 0 || ms < choice.best_ms) {
      choice.best_ms = ms;
      choice.knobs = c.knobs;
    }
  }
  if (choice.best_ms == 0) return std::nullopt;
  if (choice.none_ms > 0 && !(choice.best_ms < margin * choice.none_ms)) {
    choice.knobs = none_knobs;
    choice.best_ms = choice.none_ms;
  }
  return choice;
}

}  // namespace tpserve
