// The four tensor-parallel linear layers of a Llama block, in block order,
// with their names (what overlap configs match) and global shapes: one
// table for the CPU model's callers, the CUDA model and the metrics.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "engine/model_config.h"
#include "layers/overlap_plan.h"

namespace tpserve {

struct TpLayerShape {
  int index = 0;          // 0 qkv, 1 o, 2 gate_up, 3 down (block order)
  const char* kind = "";  // "attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"
  OverlapOp op = OverlapOp::kAllGatherGemm;
  int64_t n = 0, k = 0;  // global: column-parallel split n, row-parallel split k

  // This rank's weight shape [n, k] with tp ranks.
  int64_t local_n(int tp) const { return op == OverlapOp::kAllGatherGemm ? n / tp : n; }
  int64_t local_k(int tp) const { return op == OverlapOp::kAllGatherGemm ? k : k / tp; }
  // "layers.<block>.<kind>", e.g. "layers.3.mlp.down".
  std::string Name(int64_t block) const { return "layers." + std::to_string(block) + "." + kind; }
};

inline std::array<TpLayerShape, 4> TpLayerShapes(const ModelConfig& c) {
  const int64_t hd = c.head_dim(), h = c.hidden_size;
  return {{
      {0, "attn.qkv", OverlapOp::kAllGatherGemm,
       (c.num_attention_heads + 2 * c.num_key_value_heads) * hd, h},
      {1, "attn.o", OverlapOp::kGemmReduceScatter, h, c.num_attention_heads * hd},
      {2, "mlp.gate_up", OverlapOp::kAllGatherGemm, 2 * c.intermediate_size, h},
      {3, "mlp.down", OverlapOp::kGemmReduceScatter, h, c.intermediate_size},
  }};
}

}  // namespace tpserve
