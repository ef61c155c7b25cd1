#include "engine/engine.h"

#include <map>
#include <tuple>

#include "engine/tp_layers.h"

namespace tpserve {

StatusOr<StepResult> Engine::Step(const StepBatch&) {
  return UnimplementedError("this backend has no token generation (use --backend cpu)");
}

std::vector<OverlapSettingCount> OverlapSettingsAt(const ModelConfig& c,
                                                   const OverlapConfig* overlap, int tp, int64_t m,
                                                   GemmScaleScheme scheme) {
  std::map<std::tuple<std::string, std::string>, OverlapSettingCount> counts;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (const TpLayerShape& kind : TpLayerShapes(c)) {
      OverlapSettingCount e;
      e.kind = kind.kind;
      e.op = std::string(OverlapOpName(kind.op));
      LinearKnobs knobs;
      if (overlap != nullptr) {
        auto resolved = overlap->Resolve(kind.Name(l), kind.op, kind.n, kind.k, m, tp, scheme);
        if (!resolved.ok()) {
          e.knobs = "error: " + resolved.status().message();
          e.mode = "error";
        } else {
          knobs = *resolved;
        }
      }
      if (e.mode.empty()) {
        e.knobs = knobs.ToString();
        e.mode = std::string(OverlapModeName(knobs.mode));
      }
      ++counts.try_emplace({e.kind, e.knobs}, e).first->second.layers;
    }
  }
  std::vector<OverlapSettingCount> out;
  for (auto& [key, e] : counts) out.push_back(e);
  return out;
}

}  // namespace tpserve
