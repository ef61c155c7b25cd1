// Every overlap mode the tuner or a shipped config can choose, at TP = 2 in the production
// process model: `tpserve layer --backend cuda --tp 2` (rank 0 starts rank 1 as a process, one
// GPU each), each rank checking its eager output against the CPU reference and its graph
// replays bit for bit against the eager run (server/cli_layer.cc).
//
// Needs two GPUs: NCCL refuses two ranks of one communicator on one device, and every mode here
// sets up its communicator (the copy-engine modes exchange their CUDA IPC handles and signals
// over it), so no case can run both ranks on one GPU. Below two GPUs the test skips.
//
// The `tpserve` binary: $TPSERVE_BIN, else the one beside this test binary (the build's bin/,
// or the staged .gpu/bin/ on the GPU host).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "tests/gpu_test_util.h"

namespace tpserve {
namespace {

std::string TpserveBinary() {
  if (const char* env = std::getenv("TPSERVE_BIN"); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("tpserve") : (self.parent_path() / "tpserve").string();
}

struct RunResult {
  int exit_code = -1;
  std::string output;
};

RunResult RunCommand(const std::string& command) {
  RunResult r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++count;
  }
  return count;
}

// m, then the flags; awkward m (37, 1 row per rank or none) included. A --split-output case
// says which kind it got: `addends` ranks with two addends (the plan's last sum left to the
// consumer), the others "the plan has no sum step" (a one-chunk ring's rank without rows, a
// two-chunk ring, in_place, full_weight).
struct LayerCase {
  int m;
  const char* flags;
  int addends = -1;  // --split-output: ranks expected to get two addends (-1: not a split case)
};

constexpr LayerCase kCases[] = {
    {4099, "--op ag_gemm --mode none --chunks 1"},
    {4099, "--op ag_gemm --mode pipeline --chunks 4"},
    {4099, "--op ag_gemm --mode ring --chunks 2 --dtype bf16"},
    {4099, "--op ag_gemm --mode none --chunks 1 --copy-engine"},
    {4099, "--op ag_gemm --mode pipeline --chunks 2 --copy-engine"},
    {1002, "--op ag_gemm --mode pipeline --chunks 8 --copy-engine --dtype bf16"},
    {4099, "--op ag_gemm --mode ring --chunks 2 --copy-engine"},
    {37, "--op ag_gemm --mode ring --chunks 4 --copy-engine"},
    {4099, "--op ag_gemm --mode ring --chunks 1 --copy-engine"},
    {37, "--op ag_gemm --mode pipeline --chunks 4 --copy-engine"},
    {4099, "--op gemm_rs --mode none --chunks 1 --dtype bf16"},
    {4099, "--op gemm_rs --mode pipeline --chunks 4 --max-ctas 8"},
    {4099, "--op gemm_rs --mode ring --chunks 2"},
    {4099, "--op gemm_rs --mode pipeline --chunks 4"},
    {4099, "--op gemm_rs --mode none --chunks 1 --copy-engine"},
    {1, "--op gemm_rs --mode none --chunks 1 --copy-engine"},
    {37, "--op gemm_rs --mode none --chunks 1 --copy-engine --dtype bf16"},
    {4099, "--op gemm_rs --mode pipeline --chunks 4 --copy-engine"},
    {37, "--op gemm_rs --mode pipeline --chunks 8 --copy-engine"},
    {4099, "--op gemm_rs --mode ring --chunks 4 --copy-engine"},
    {1002, "--op gemm_rs --mode ring --chunks 1 --copy-engine --dtype bf16"},
    {4099, "--op gemm_rs --mode ring --chunks 1 --copy-engine"},
    {4099, "--op gemm_rs --mode ring --chunks 1 --copy-engine --split-output", 2},
    {37, "--op gemm_rs --mode ring --chunks 1 --copy-engine --split-output --dtype bf16", 2},
    {1, "--op gemm_rs --mode ring --chunks 1 --copy-engine --split-output", 1},
    {4099, "--op gemm_rs --mode ring --chunks 2 --copy-engine --split-output", 0},
    {4099, "--op gemm_rs --mode ring --chunks 1 --copy-engine --in-place"},
    {37, "--op gemm_rs --mode ring --chunks 1 --copy-engine --in-place --dtype bf16"},
    {4099, "--op gemm_rs --mode ring --chunks 2 --copy-engine --in-place --split-output", 0},
    {4099, "--op gemm_rs --mode ring --chunks 2 --copy-engine --in-place"},
    {4099, "--op gemm_rs --mode none --chunks 1 --copy-engine --full-weight"},
    {4099, "--op gemm_rs --mode pipeline --chunks 2 --copy-engine --full-weight"},
    {37, "--op gemm_rs --mode pipeline --chunks 8 --copy-engine --full-weight --dtype bf16"},
    {1, "--op gemm_rs --mode pipeline --chunks 4 --copy-engine --full-weight"},
    {4099, "--op gemm_rs --mode pipeline --chunks 4 --copy-engine --full-weight"},
    {4099, "--op gemm_rs --mode pipeline --chunks 2 --copy-engine --full-weight --split-output", 0},
    {4099, "--op gemm_rs --mode ring --chunks 1 --copy-engine --full-weight"},
    {4099, "--op gemm_rs --mode ring --chunks 2 --copy-engine --full-weight --dtype bf16"},
    {37, "--op gemm_rs --mode ring --chunks 1 --copy-engine --full-weight"},
    {1, "--op gemm_rs --mode ring --chunks 2 --copy-engine --full-weight"},
    {4099, "--op gemm_rs --mode ring --chunks 2 --copy-engine --full-weight"},
    {4099, "--op gemm_rs --mode ring --chunks 4 --copy-engine --full-weight --split-output", 0},
    // Fine FP8 scales (--fp8-scheme: a scale per row or 1x128 group of X and per row or 128x128
    // block of W, each drawn on its own): every GEMM reads its rows' scales from a scale slot
    // (layers/scale_slots.h), AllGather layers move the peers' slots with their rows. Block
    // cases keep every GEMM's m a multiple of 4 (m 4096).
    {4099, "--op ag_gemm --mode none --chunks 1 --fp8-scheme channel"},
    {4099, "--op ag_gemm --mode pipeline --chunks 2 --copy-engine --fp8-scheme channel"},
    {37, "--op ag_gemm --mode ring --chunks 2 --fp8-scheme channel"},
    {4099, "--op ag_gemm --mode ring --chunks 1 --copy-engine --fp8-scheme channel"},
    {4096, "--op ag_gemm --mode ring --chunks 2 --fp8-scheme block"},
    {4096, "--op ag_gemm --mode pipeline --chunks 4 --copy-engine --fp8-scheme block"},
    {4099, "--op gemm_rs --mode none --chunks 1 --copy-engine --fp8-scheme channel"},
    {1002, "--op gemm_rs --mode pipeline --chunks 4 --fp8-scheme channel"},
    {4099, "--op gemm_rs --mode ring --chunks 1 --copy-engine --fp8-scheme channel"},
    {4096, "--op gemm_rs --mode ring --chunks 1 --copy-engine --fp8-scheme block --split-output",
     2},
    {4096, "--op gemm_rs --mode pipeline --chunks 2 --copy-engine --fp8-scheme block"},
};

// Overlap modes whose GEMMs add the received running sum into C cannot take per-row scales
// (cuBLASLt does that with per-tensor scales only): refused, naming the scheme, before any run.
TEST(GpuLayerProcessesTest, FineScalesRefuseModesThatAddIntoC) {
  if (CudaDeviceCount() < 2) {
    GTEST_SKIP() << "needs two GPUs (NCCL takes one rank per GPU; this host has "
                 << CudaDeviceCount() << ")";
  }
  const std::string bin = TpserveBinary();
  for (const char* flags : {"--op gemm_rs --mode ring --chunks 2 --copy-engine",
                            "--op gemm_rs --mode ring --chunks 1"}) {
    const std::string command =
        bin + " layer --backend cuda --tp 2 --n 1024 --k 1024 --iters 1 --m 512 " + flags +
        " --fp8-scheme channel";
    SCOPED_TRACE(command);
    const RunResult r = RunCommand(command);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("scale_scheme per_token_channel"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("adds into C"), std::string::npos) << r.output;
  }
}

TEST(GpuLayerProcessesTest, EveryShippedModeMatchesTheCpuReferenceAtTp2) {
  if (CudaDeviceCount() < 2) {
    GTEST_SKIP() << "needs two GPUs (NCCL takes one rank per GPU; this host has "
                 << CudaDeviceCount() << ")";
  }
  const std::string bin = TpserveBinary();
  ASSERT_EQ(access(bin.c_str(), X_OK), 0)
      << "no executable tpserve at " << bin << " (set TPSERVE_BIN)";
  for (const LayerCase& c : kCases) {
    const std::string command = bin +
                                " layer --backend cuda --tp 2 --n 1024 --k 1024 --iters 5 --m " +
                                std::to_string(c.m) + " " + c.flags;
    SCOPED_TRACE(command);
    const RunResult r = RunCommand(command);
    const std::string tail =
        r.output.size() > 3000 ? r.output.substr(r.output.size() - 3000) : r.output;
    EXPECT_EQ(r.exit_code, 0) << tail;
    EXPECT_EQ(Count(r.output, "-> PASS"), 2u) << tail;  // one per rank
    EXPECT_EQ(Count(r.output, "-> FAIL"), 0u) << tail;
    if (c.addends >= 0) {
      EXPECT_EQ(Count(r.output, "--split-output: two addends"), static_cast<size_t>(c.addends))
          << tail;
      EXPECT_EQ(Count(r.output, "--split-output: the plan has no sum step"),
                static_cast<size_t>(2 - c.addends))
          << tail;
    }
  }
}

}  // namespace
}  // namespace tpserve
