// OverlapConfig: the per-layer overlap settings of a model, read from a YAML
// file (written by hand or by the autotuner) and resolved per layer and M.
//
// File format (version 1):
//
//   version: 1
//   tp: 2                          # optional: the TP size the file was made for
//   defaults:                      # optional: knobs for layers no rule matches
//     mode: none                   # none | pipeline | ring | auto
//     chunks: 1
//     comm: {min_ctas: 0, max_ctas: 0, cta_policy: default, cga_cluster_size: 0}
//     copy_engine: false
//     fast_accum: false
//     in_place: false              # gemm_rs ring on copy engines: read the peer's running sum
//     full_weight: false           # gemm_rs on copy engines (any mode): each rank holds
//                                  # the whole weight and pulls the peers' input columns of
//                                  # its rows (no partial sums; tp x the weight memory)
//   layers:                        # rules, first match wins
//     - match: "layers.*.mlp.down" # glob on the layer name: * any run, ? one char
//       mode: ring                 # knobs for every M ...
//       chunks: 4
//       m_ranges:                  # ... or per M range (inclusive; m_max omitted = no limit)
//         - {m_min: 1, m_max: 1024, mode: none}
//         - {m_min: 1025, mode: ring, chunks: 4}
//   tuned:                         # measured best knobs per layer shape and M (autotuner)
//     - {op: gemm_rs, n: 8192, k: 28672, m: 8192, mode: ring, chunks: 4,
//        median_ms: 1.68, none_ms: 1.75}
//     - {op: gemm_rs, n: 8192, k: 28672, m: 8192, scale_scheme: per_token_channel,
//        mode: pipeline, chunks: 2}  # FP8 scale scheme (omitted: per_tensor)
//
// Knobs given at an outer level are inherited by inner levels (defaults ->
// rule -> m range). A rule whose m ranges leave gaps does not apply to an M in
// a gap: the next rule that matches the layer applies, else the defaults. `mode: auto` resolves to
// the `tuned` entry of the layer's shape (op, global n, global k, FP8 scale scheme) whose m is the
// largest one <= M (else the smallest), and to `none` when the table has no entry for the shape:
// a layer with per-token or block-wise scales is not given knobs tuned for per-tensor ones,
// which may not run with its scheme (layers/cuda_linear.h, CudaLinearShape::scale_scheme).
//
// The loader is strict: unknown keys, values of the wrong type or outside
// their range, overlapping M ranges of one rule, two tuned entries for one
// (op, n, k, scale_scheme, m), more than one YAML document and an unsupported version are
// errors (INVALID_ARGUMENT) that name the file, the line, the key and the
// allowed values. The knobs gemm_sm_count and gemm_lanes were removed (every
// GEMM runs on the caller's stream over all SMs, which no tuned or shipped
// config ever changed); a file that still names one is refused, saying so.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/status.h"
#include "layers/linear_knobs.h"
#include "layers/overlap_plan.h"
#include "layers/scale_scheme.h"

namespace tpserve {

class OverlapConfig {
 public:
  static constexpr int kVersion = 1;

  // A layer's settings for one M range. `auto_mode` marks `mode: auto`.
  struct Setting {
    int64_t m_min = 1;
    int64_t m_max = INT64_MAX;  // inclusive
    LinearKnobs knobs;
    bool auto_mode = false;
  };
  struct Rule {
    std::string match;              // glob on the layer name
    std::vector<Setting> settings;  // disjoint M ranges, sorted by m_min
    int line = 0;                   // 1-based line of the rule in its file
  };
  struct Tuned {
    OverlapOp op = OverlapOp::kAllGatherGemm;
    int64_t n = 0, k = 0, m = 0;                                 // global problem
    GemmScaleScheme scale_scheme = GemmScaleScheme::kPerTensor;  // FP8 only
    LinearKnobs knobs;
    double median_ms = 0, none_ms = 0;  // as measured by the autotuner (0 = unknown)
  };

  // An empty config: every layer gets LinearKnobs{} (mode none).
  OverlapConfig() = default;

  static StatusOr<OverlapConfig> LoadFile(const std::string& path);
  // `source` names the text in errors (a file name).
  static StatusOr<OverlapConfig> Parse(std::string_view yaml, const std::string& source);

  // The knobs of `layer_name` (shape: op, global n and k, its FP8 scale scheme) at `m` rows,
  // with `auto` resolved. INVALID_ARGUMENT if the config was made for another TP size (`tp` > 0
  // and != the given tp).
  StatusOr<LinearKnobs> Resolve(std::string_view layer_name, OverlapOp op, int64_t n, int64_t k,
                                int64_t m, int tp,
                                GemmScaleScheme scheme = GemmScaleScheme::kPerTensor) const;

  // Adds (or replaces) the tuned entry for (op, n, k, scale_scheme, m).
  void AddTuned(const Tuned& t);

  // YAML text that Parse() reads back to an equal config.
  std::string ToYaml() const;

  int tp() const { return tp_; }
  void set_tp(int tp) { tp_ = tp; }
  const Setting& defaults() const { return defaults_; }
  Setting& mutable_defaults() { return defaults_; }
  const std::vector<Rule>& rules() const { return rules_; }
  std::vector<Rule>& mutable_rules() { return rules_; }
  const std::vector<Tuned>& tuned() const { return tuned_; }
  const std::string& source() const { return source_; }

 private:
  std::string source_ = "<empty>";
  int tp_ = 0;
  Setting defaults_;
  std::vector<Rule> rules_;
  std::vector<Tuned> tuned_;
};

// Glob match: `*` matches any run of characters (dots included), `?` one.
bool GlobMatch(std::string_view pattern, std::string_view text);

}  // namespace tpserve
