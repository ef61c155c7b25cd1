// `tpserve plan`: prints the overlap plan of every rank and checks it.
#include <iostream>
#include <string>
#include <vector>

#include "layers/overlap_plan.h"
#include "server/cli.h"

namespace tpserve {
namespace {

struct PlanFlags {
  std::string op = "ag_gemm";
  std::string mode = "pipeline";
  int tp = 2;
  int64_t m = 37;
  int chunks = 4;
  int rank = -1;
};

int RunPlan(const PlanFlags& f) {
  auto op = ParseOverlapOp(f.op);
  auto mode = ParseOverlapMode(f.mode);
  if (!op.ok() || !mode.ok()) {
    std::cerr << "error: " << (!op.ok() ? op.status() : mode.status()).message() << "\n";
    return 2;
  }
  std::vector<OverlapPlan> plans;
  for (int r = 0; r < f.tp; ++r) {
    auto plan = MakeOverlapPlan({*op, *mode, f.tp, r, f.m, f.chunks});
    if (!plan.ok()) {
      std::cerr << "error: " << plan.status().message() << "\n";
      return 2;
    }
    if (Status s = ValidatePlan(*plan); !s.ok()) {
      std::cerr << "error: " << s.message() << "\n";
      return 1;
    }
    if (f.rank < 0 || f.rank == r) std::cout << DescribePlan(*plan);
    plans.push_back(std::move(plan).value());
  }
  if (Status s = ValidatePlanGroup(plans); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 1;
  }
  std::cout << "plans of all " << f.tp << " ranks checked: every row produced once, "
            << "collectives and messages match\n";
  return 0;
}

}  // namespace

void AddPlanCommand(CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Print the overlap plan (steps, rows, dependencies) of a TP linear layer");
  cmd->add_option("--op", flags->op, "ag_gemm (AllGather+GEMM) or gemm_rs (GEMM+ReduceScatter)")
      ->check(CLI::IsMember({"ag_gemm", "gemm_rs"}))
      ->capture_default_str();
  cmd->add_option("--mode", flags->mode, "Overlap mode: none, pipeline or ring")
      ->check(CLI::IsMember({"none", "pipeline", "ring"}))
      ->capture_default_str();
  cmd->add_option("--tp", flags->tp, "Tensor-parallel size (ranks)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--m", flags->m, "Rows (tokens) of the global problem")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--chunks", flags->chunks, "Chunks per rank's shard (none: 1)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--rank", flags->rank, "Print only this rank's plan (default: all ranks)");
  cmd->callback([flags, exit_code] { *exit_code = RunPlan(*flags); });
}

}  // namespace tpserve
