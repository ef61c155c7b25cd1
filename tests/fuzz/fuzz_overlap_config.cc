// libFuzzer target: OverlapConfig::Parse on arbitrary text. Must never crash;
// an accepted config must resolve layers without crashing and its ToYaml()
// must parse back to a config that prints the same.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "layers/overlap_config.h"

namespace {
[[noreturn]] void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_overlap_config: invariant violated: %s\n%s\n", what, detail.c_str());
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 16)) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto r = tpserve::OverlapConfig::Parse(text, "fuzz.yaml");
  if (!r.ok()) {
    if (r.status().message().empty()) Fail("error without a message", "");
    return 0;
  }
  const tpserve::OverlapConfig& cfg = *r;
  static const char* const kLayers[] = {"layers.0.mlp.down",
                                        "layers.13.self_attn.o_proj",
                                        "layers.3.self_attn.qkv_proj",
                                        "layers.0.mlp.gate_up",
                                        "",
                                        "x"};
  static const int64_t kMs[] = {1, 2, 63, 64, 1000, 1024, 1025, 8192, INT64_MAX};
  const int tp = cfg.tp() > 0 ? cfg.tp() : 2;
  for (const char* layer : kLayers) {
    for (int64_t m : kMs) {
      for (auto op : {tpserve::OverlapOp::kAllGatherGemm, tpserve::OverlapOp::kGemmReduceScatter}) {
        // Resolve may refuse what it resolves to (e.g. chunks above 1 with
        // mode none); it must say why, not crash.
        auto k = cfg.Resolve(layer, op, 8192, 28672, m, tp);
        if (!k.ok() && k.status().message().empty()) Fail("Resolve error without a message", "");
      }
    }
  }
  const std::string yaml = cfg.ToYaml();
  auto again = tpserve::OverlapConfig::Parse(yaml, "fuzz-roundtrip.yaml");
  if (!again.ok()) Fail("ToYaml() output does not parse", again.status().ToString() + "\n" + yaml);
  const std::string yaml2 = again->ToYaml();
  if (yaml2 != yaml) Fail("ToYaml() is not stable", yaml + "\n----\n" + yaml2);
  return 0;
}
