#include "benchmarks/accuracy_cuda.h"

#include <algorithm>
#include <memory>
#include <string>

#include "comm/cuda_check.h"
#include "comm/nccl_thread_group.h"
#include "engine/cuda_model.h"
#include "engine/token_batch.h"

namespace tpserve {

StatusOr<std::vector<float>> CudaPromptLogits(const ModelConfig& config, const RankWeights& weights,
                                              const Prompts& prompts,
                                              const std::function<void(size_t done)>& progress,
                                              bool fp8_attention) {
  if (CudaDeviceCount() < 1) return FailedPreconditionError("the cuda backend needs a GPU");
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, p.size());
  CudaModelOptions o;
  o.max_seqs = std::max<int64_t>(longest, 1);
  o.max_tokens = std::max<int64_t>(longest * (longest + 1) / 2, 1);
  o.cuda_graphs = false;
  o.fp8_attention = fp8_attention && weights.dtype == DataType::kFloat8E4M3;
  TP_ASSIGN_OR_RETURN(auto group, NcclThreadGroup::Create(1));
  std::vector<float> logits;
  TP_RETURN_IF_ERROR(group->Run([&](int rank) -> Status {
    TP_ASSIGN_OR_RETURN(auto model,
                        CudaModel::Create(config, weights, nullptr, group->pool(rank), o));
    for (size_t p = 0; p < prompts.size(); ++p) {
      const std::string what =
          "prompt " + std::to_string(p) + " (" + std::to_string(prompts[p].size()) + " tokens)";
      std::vector<std::vector<int32_t>> prefixes;
      for (size_t i = 1; i <= prompts[p].size(); ++i) {
        prefixes.emplace_back(prompts[p].begin(), prompts[p].begin() + i);
      }
      auto batch = PackSequences(prefixes, config.vocab_size, config.max_position_embeddings);
      if (!batch.ok()) return batch.status().WithContext(what);
      auto rows = model->Forward(*batch);
      if (!rows.ok()) return rows.status().WithContext(what);
      logits.insert(logits.end(), rows->begin(), rows->end());
      if (progress) progress(p + 1);
    }
    return model->Close();
  }));
  return logits;
}

}  // namespace tpserve
