#include "engine/kv_calibration.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "comm/local_communicator.h"
#include "engine/cpu_model.h"
#include "engine/safetensors.h"
#include "engine/token_batch.h"

namespace tpserve {
namespace {

// Runs every prompt through the rank's model and keeps each layer's largest values.
Status MeasureAll(CpuModel& model, const ModelConfig& config, const Prompts& prompts,
                  const std::function<void(size_t)>& progress, std::vector<KvAbsMax>* most) {
  most->assign(static_cast<size_t>(config.num_hidden_layers), KvAbsMax{});
  for (size_t p = 0; p < prompts.size(); ++p) {
    const std::string what = "calibration prompt " + std::to_string(p) + " (" +
                             std::to_string(prompts[p].size()) + " tokens)";
    auto batch = PackSequences({prompts[p]}, config.vocab_size, config.max_position_embeddings);
    if (!batch.ok()) return batch.status().WithContext(what);
    auto layers = model.MeasureKvAbsMax(*batch);
    if (!layers.ok()) return layers.status().WithContext(what);
    for (size_t l = 0; l < most->size(); ++l) {
      (*most)[l].k = std::max((*most)[l].k, (*layers)[l].k);
      (*most)[l].v = std::max((*most)[l].v, (*layers)[l].v);
    }
    if (progress) progress(p + 1);
  }
  return Status::Ok();
}

}  // namespace

Prompts DefaultPrompts(int64_t count, int64_t length, int64_t vocab, uint64_t seed) {
  uint64_t state = seed;
  auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  Prompts out(std::max<int64_t>(count, 0));
  for (auto& p : out) {
    p.resize(std::max<int64_t>(length, 0));
    for (auto& id : p) id = static_cast<int32_t>(next() % static_cast<uint64_t>(vocab));
  }
  return out;
}

StatusOr<Prompts> ReadPrompts(const std::string& path, int64_t vocab, int64_t max_positions) {
  std::ifstream in(path);
  if (!in) return NotFoundError(path + ": cannot open the prompts file");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError(path + ": not JSON");
  const nlohmann::json* list = &j;
  if (j.is_object()) {
    if (!j.contains("prompts")) {
      return InvalidArgumentError(path +
                                  ": an object without \"prompts\" (want a list of "
                                  "token-id lists, or an object holding one as \"prompts\")");
    }
    list = &j["prompts"];
  }
  if (!list->is_array() || list->empty()) {
    return InvalidArgumentError(path + ": prompts must be a non-empty list of token-id lists");
  }
  Prompts out;
  for (size_t p = 0; p < list->size(); ++p) {
    const nlohmann::json& ids = (*list)[p];
    const std::string where = path + ": prompt " + std::to_string(p);
    if (!ids.is_array() || ids.empty()) {
      return InvalidArgumentError(where + " is not a non-empty list of token ids");
    }
    if (static_cast<int64_t>(ids.size()) > max_positions) {
      return InvalidArgumentError(where + " has " + std::to_string(ids.size()) +
                                  " tokens, the model takes at most " +
                                  std::to_string(max_positions) + " (max_position_embeddings)");
    }
    std::vector<int32_t> prompt;
    for (size_t t = 0; t < ids.size(); ++t) {
      const nlohmann::json& id = ids[t];
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab) {
        return InvalidArgumentError(where + ", token " + std::to_string(t) + ": " + id.dump() +
                                    " is not a token id in [0, " + std::to_string(vocab) + ")");
      }
      prompt.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    out.push_back(std::move(prompt));
  }
  return out;
}

StatusOr<std::vector<KvAbsMax>> CalibrateKvAbsMax(const ModelConfig& config,
                                                  const RankWeights& weights,
                                                  const Prompts& prompts,
                                                  const std::function<void(size_t)>& progress) {
  std::vector<KvAbsMax> most;
  TP_RETURN_IF_ERROR(RunOnLocalRanks(1, [&](Communicator& comm) -> Status {
    // CpuModel owns its weights: one copy, the price of leaving the caller's unchanged.
    TP_ASSIGN_OR_RETURN(auto model, CpuModel::Create(config, weights, nullptr, comm));
    return MeasureAll(*model, config, prompts, progress, &most);
  }));
  return most;
}

StatusOr<std::vector<KvAbsMax>> CalibrateKvAbsMax(const ModelConfig& config, const std::string& dir,
                                                  DataType dtype, int tp, const Prompts& prompts,
                                                  const std::function<void(size_t)>& progress) {
  TP_RETURN_IF_ERROR(config.ValidateForTp(tp));
  std::vector<KvAbsMax> most;
  TP_RETURN_IF_ERROR(RunOnLocalRanks(tp, [&](Communicator& comm) -> Status {
    TP_ASSIGN_OR_RETURN(RankWeights w, LoadRankWeights(dir, config, tp, comm.rank(), dtype));
    TP_ASSIGN_OR_RETURN(auto model, CpuModel::Create(config, std::move(w), nullptr, comm));
    std::vector<KvAbsMax> mine;
    TP_RETURN_IF_ERROR(
        MeasureAll(*model, config, prompts, comm.rank() == 0 ? progress : nullptr, &mine));
    if (comm.rank() == 0) most = std::move(mine);  // every rank's are the same (combined)
    return Status::Ok();
  }));
  return most;
}

Status WriteKvScales(const std::string& path, const std::vector<KvScales>& scales,
                     const std::map<std::string, std::string>& metadata) {
  std::vector<TensorToWrite> tensors;
  for (size_t l = 0; l < scales.size(); ++l) {
    const std::string p = HfLayerPrefix(static_cast<int64_t>(l)) + ".self_attn.";
    tensors.push_back({p + "k_scale", StDtype::kF32, {}, &scales[l].k, sizeof(float)});
    tensors.push_back({p + "v_scale", StDtype::kF32, {}, &scales[l].v, sizeof(float)});
  }
  return WriteSafetensors(path, tensors, metadata);
}

}  // namespace tpserve
