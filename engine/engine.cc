#include "engine/engine.h"

#include <map>
#include <tuple>

namespace tpserve {

std::vector<OverlapSettingCount> OverlapSettingsAt(const ModelConfig& c,
                                                   const OverlapConfig* overlap, int tp,
                                                   int64_t m) {
  const int64_t hd = c.head_dim(), h = c.hidden_size;
  struct Kind {
    const char* name;
    OverlapOp op;
    int64_t n, k;  // global
  };
  const Kind kinds[] = {
      {"attn.qkv", OverlapOp::kAllGatherGemm,
       (c.num_attention_heads + 2 * c.num_key_value_heads) * hd, h},
      {"attn.o", OverlapOp::kGemmReduceScatter, h, c.num_attention_heads * hd},
      {"mlp.gate_up", OverlapOp::kAllGatherGemm, 2 * c.intermediate_size, h},
      {"mlp.down", OverlapOp::kGemmReduceScatter, h, c.intermediate_size},
  };
  std::map<std::tuple<std::string, std::string>, OverlapSettingCount> counts;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (const Kind& kind : kinds) {
      OverlapSettingCount e;
      e.kind = kind.name;
      e.op = std::string(OverlapOpName(kind.op));
      LinearKnobs knobs;
      if (overlap != nullptr) {
        auto resolved = overlap->Resolve("layers." + std::to_string(l) + "." + kind.name, kind.op,
                                         kind.n, kind.k, m, tp);
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
      auto [it, fresh] = counts.try_emplace({e.kind, e.knobs}, e);
      ++it->second.layers;
      (void)fresh;
    }
  }
  std::vector<OverlapSettingCount> out;
  for (auto& [key, e] : counts) out.push_back(e);
  return out;
}

}  // namespace tpserve
