// tpserve-accuracy's CUDA backend: PromptLogits (benchmarks/accuracy_eval.h) on the CUDA engine
// (engine/cuda_model.h) at tp 1, on GPU 0. Built with the CUDA backend only.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "benchmarks/accuracy_eval.h"

namespace tpserve {

// Every position's logits of every prompt, [sum of prompt lengths, vocab], as PromptLogits
// gives them, from CudaModel::Forward, which returns each sequence's last-row logits: a
// prompt of L tokens runs as one batch of its L prefixes (L(L+1)/2 tokens; causal attention
// makes the last row of prefix i position i of the prompt). Eager passes (no graphs), FP32
// logits. The weights' FP8 schemes run as the engine runs them at tp 1 (per-tensor inputs
// scaled per batch when the weights have no input scale: here one prompt's prefixes).
// fp8_attention: FP8 weights' passes run attention in E4M3 (CudaModelOptions::fp8_attention;
// BF16 weights' passes, the reference, keep BF16 attention).
// Errors: the model's, naming the prompt; FAILED_PRECONDITION without a GPU.
StatusOr<std::vector<float>> CudaPromptLogits(const ModelConfig& config, const RankWeights& weights,
                                              const Prompts& prompts,
                                              const std::function<void(size_t done)>& progress,
                                              bool fp8_attention = false);

}  // namespace tpserve
