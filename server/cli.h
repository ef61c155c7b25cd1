// Subcommands of the `tpserve` executable. Each Add*Command registers its
// flags on `app`; the callback runs the command and stores the process exit
// code in *exit_code (0 = success).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "engine/model_config.h"

namespace tpserve {

// A --model value: a preset name (random weights) or a directory holding a
// HuggingFace config.json and *.safetensors (*from_dir is set to which).
StatusOr<ModelConfig> ResolveModel(const std::string& model, bool* from_dir);

void AddPlanCommand(CLI::App& app, int* exit_code);
void AddModelCommands(CLI::App& app, int* exit_code);
void AddServeCommand(CLI::App& app, int* exit_code);
void AddLayerCommand(CLI::App& app, int* exit_code, const std::vector<std::string>& argv);

}  // namespace tpserve
