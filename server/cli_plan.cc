// `tpserve plan`: prints the overlap plan of every rank and checks it.
#include <iostream>
#include <string>
#include <vector>

#include "layers/linear_knobs.h"
#include "layers/overlap_plan.h"
#include "server/cli.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

struct PlanFlags {
  std::string op = "ag_gemm";
  std::string mode = "pipeline";
  int tp = 2;
  int64_t m = 37;
  int chunks = 4;
  bool chunks_given = false;  // --chunks on the command line (mode none defaults to 1)
  int rank = -1;              // -1: every rank
  bool defer_last_sum = false;
  bool copy_engine = false;
  bool in_place = false;
  bool full_weight = false;
};

int RunPlan(PlanFlags f) {
  auto op = ParseOverlapOp(f.op);
  auto mode = ParseOverlapMode(f.mode);
  if (!op.ok() || !mode.ok()) {
    std::cerr << "error: " << (!op.ok() ? op.status() : mode.status()).message() << "\n";
    return 2;
  }
  if (const std::string e = ChunksForMode(*mode == OverlapMode::kNone, f.chunks_given, &f.chunks);
      !e.empty()) {
    std::cerr << "error: " << e << "\n";
    return 2;
  }
  if (f.rank != -1 && (f.rank < 0 || f.rank >= f.tp)) {
    std::cerr << "error: --rank " << f.rank << ": the ranks are 0 to " << f.tp - 1 << " (--tp "
              << f.tp << ")\n";
    return 2;
  }
  LinearKnobs knobs;
  knobs.mode = *mode;
  knobs.chunks = f.chunks;
  knobs.copy_engine = f.copy_engine;
  knobs.in_place = f.in_place;
  knobs.full_weight = f.full_weight;
  if (Status s = ValidateLinearKnobs(knobs, *op); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  std::vector<OverlapPlan> plans;
  for (int r = 0; r < f.tp; ++r) {
    // The plan a layer with these knobs runs (LinearPlanRequest), plus --defer-last-sum.
    PlanRequest q = LinearPlanRequest(*op, knobs, f.tp, r, f.m);
    q.defer_last_sum = q.defer_last_sum || f.defer_last_sum;
    auto plan = MakeOverlapPlan(q);
    if (!plan.ok()) {
      std::cerr << "error: " << plan.status().message() << "\n";
      return 2;
    }
    // ValidatePlan follows every row through every step: two bits per row and step and
    // eight bytes per row. Refused beyond 4 GiB, before the system's OOM killer would.
    constexpr double kMaxCheckBytes = 4.0 * (1ull << 30);
    const double check_bytes = (plan->steps.size() / 4.0 + 8.0) * static_cast<double>(f.m);
    if (check_bytes > kMaxCheckBytes) {
      std::cerr << "error: --m " << f.m << ": checking rank " << r << "'s plan of "
                << plan->steps.size() << " steps would take " << check_bytes / (1ull << 30)
                << " GiB (at most 4); a smaller --m gives the same steps with fewer rows\n";
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

CLI::Option* AddChunksOption(CLI::App* cmd, int* chunks) {
  return cmd
      ->add_option("--chunks", *chunks,
                   "Chunks per rank's shard, for pipeline and ring (mode none: 1, its default)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
}

std::string ChunksForMode(bool mode_is_none, bool given, int* chunks) {
  if (!mode_is_none || *chunks == 1) return "";
  if (given) {
    return "--chunks " + std::to_string(*chunks) +
           ": mode none runs one chunk (--chunks 1); chunks are for pipeline and ring";
  }
  *chunks = 1;
  return "";
}

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
      ->check(Positive())
      ->capture_default_str();
  CLI::Option* chunks = AddChunksOption(cmd, &flags->chunks);
  cmd->add_option("--rank", flags->rank,
                  "Print only this rank's plan, 0 to --tp - 1 (default: all ranks; all are "
                  "checked either way)");
  cmd->add_flag("--defer-last-sum", flags->defer_last_sum,
                "gemm_rs ring with --chunks 1: the last GEMM computes the own rows' partial alone "
                "and a sum step adds the received running sum (the plan a layer on copy engines "
                "runs over NCCL; on copy engines it is the default there)");
  cmd->add_flag("--copy-engine", flags->copy_engine,
                "Transfers on copy engines (tp > 1): each rank pulls its peers' rows, with ready "
                "and done signals (pull_* steps), instead of NCCL collectives");
  cmd->add_flag("--in-place", flags->in_place,
                "gemm_rs ring with --copy-engine: each accumulating GEMM reads the running sum "
                "in the peer's memory and sends the peer its done");
  cmd->add_flag("--full-weight", flags->full_weight,
                "gemm_rs with --copy-engine (at --tp > 1): every rank holds the whole weight and "
                "pulls its peers' input columns of its own rows instead of summing partials");
  cmd->callback([flags, exit_code, chunks] {
    flags->chunks_given = chunks->count() > 0;
    *exit_code = RunPlan(*flags);
  });
}

}  // namespace tpserve
