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
// The name `serve` gives a model without --model-name: the preset's, or the directory's last
// component ("ckpt" for "ckpt/", "/models/llama/" or "./ckpt"; "model" if the path has none,
// e.g. "/" or ".").
std::string DefaultModelName(const std::string& model, bool from_dir);

// --chunks of `plan` and `layer`: chunks per rank's shard for pipeline and
// ring (1 to 64). Mode none runs one: see ChunksForMode.
CLI::Option* AddChunksOption(CLI::App* cmd, int* chunks);
// After parsing: with mode none, *chunks becomes 1 unless --chunks was given
// (`given`), in which case a value above 1 is an error. Returns the error
// message ("" when fine).
std::string ChunksForMode(bool mode_is_none, bool given, int* chunks);

void AddPlanCommand(CLI::App& app, int* exit_code);
void AddModelCommands(CLI::App& app, int* exit_code);
void AddServeCommand(CLI::App& app, int* exit_code);
void AddLayerCommand(CLI::App& app, int* exit_code, const std::vector<std::string>& argv);

}  // namespace tpserve
