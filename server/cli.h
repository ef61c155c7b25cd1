// Subcommands of the `tpserve` executable. Each Add*Command registers its
// flags on `app`; the callback runs the command and stores the process exit
// code in *exit_code (0 = success).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace tpserve {

void AddPlanCommand(CLI::App& app, int* exit_code);
void AddModelCommands(CLI::App& app, int* exit_code);
void AddServeCommand(CLI::App& app, int* exit_code);
void AddLayerCommand(CLI::App& app, int* exit_code, const std::vector<std::string>& argv);

}  // namespace tpserve
