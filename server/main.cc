// tpserve: tensor-parallel FP8 inference server and its tools.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <new>

#include "server/cli.h"
#include "server/cli_numbers.h"

int main(int argc, char** argv) {
  // Logs go to stderr: stdout carries results (e.g. `tpserve run --json`).
  spdlog::set_default_logger(spdlog::stderr_color_mt("tpserve"));
  CLI::App app{
      "tpserve: tensor-parallel FP8 transformer inference with communication hidden under "
      "the GEMMs.\nRun `tpserve <command> --help` for a command's flags."};
  app.require_subcommand(1);
  int exit_code = 0;
  tpserve::AddPlanCommand(app, &exit_code);
  tpserve::AddModelCommands(app, &exit_code);
  tpserve::AddServeCommand(app, &exit_code);
  tpserve::AddLayerCommand(app, &exit_code, std::vector<std::string>(argv, argv + argc));
  tpserve::StrictNumbers(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help is 0; every usage error is 2, as the commands' own checks exit (CLI11's codes
    // are 100 and up, a different one per kind of mistake).
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const std::bad_alloc&) {
    // Sizes from the command line (e.g. `plan --m`) too large for this machine's memory.
    spdlog::error("out of memory: the sizes given are too large for this machine");
    return 1;
  }
  // Results go to stdout (`run --json`, `plan`): a write that failed (a full disk, a closed
  // pipe's reader) must not end as success with nothing written.
  std::cout.flush();
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || std::cout.fail()) {
    spdlog::error("could not write the results to standard output");
    return exit_code != 0 ? exit_code : 1;
  }
  return exit_code;
}
