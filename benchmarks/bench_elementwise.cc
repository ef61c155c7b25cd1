// tpserve-bench-elementwise: the model's element-wise passes alone (engine/cuda_ops.h), each
// against its bytes-moved floor: the bytes it must read and write divided by the bandwidth of a
// device-to-device copy (cudaMemcpyAsync, which reads and writes every byte once) measured in
// the same call. The passes are those of an FP8 block with static per-tensor scales:
//   add_norm_fp8  x += residual, RMSNorm, E4M3 codes out   (read x, residual; write x, codes)
//   norm_fp8      RMSNorm of x, E4M3 codes out             (read x; write codes): the pass
//                 that remains when the residual is added in the GEMM's epilogue
//   swiglu_fp8    silu(gate) * up, E4M3 codes out          (read gate_up; write codes)
//   rope          rotate q and k in place                  (read and write q, k)
// CUDA-event medians of every pass, interleaved round by round so that clock and temperature
// drift hit all alike.
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/kernel_timing.h"
#include "benchmarks/median.h"
#include "benchmarks/write_replacing.h"
#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "engine/cuda_ops.h"
#include "layers/random_fill.h"
#include "server/cli_numbers.h"

namespace tpserve {
namespace {

using json = nlohmann::json;

struct Flags {
  std::vector<int64_t> rows = {8192};
  int64_t hidden = 4096, inter = 14336, heads = 32, kv_heads = 8, head_dim = 128;
  int warmup = 3, rounds = 20;
  std::vector<int> norm_vecs;  // RmsNormParams::vecs_per_thread besides the default
  std::string out = "elementwise.json";
};

struct Pass {
  std::string name;
  double bytes = 0;  // read + written, the floor's numerator
  std::function<Status(cudaStream_t)> launch;
  std::vector<double> ms;
};

Status RunRows(const Flags& f, int64_t rows, cudaStream_t stream, json& records) {
  const int64_t h = f.hidden, inter = f.inter;
  const int64_t qkv_n = (f.heads + 2 * f.kv_heads) * f.head_dim;
  auto alloc = [](int64_t bytes, const char* what) { return DeviceBuffer::Allocate(bytes, what); };
  TP_ASSIGN_OR_RETURN(DeviceBuffer x, alloc(rows * h * 2, "x"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer residual, alloc(rows * h * 2, "residual"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer weight, alloc(h * 2, "norm weight"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer codes, alloc(rows * std::max(h, inter), "codes"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer gate_up, alloc(rows * 2 * inter * 2, "gate_up"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer copy_dst, alloc(rows * 2 * inter * 2, "copy destination"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer qkv, alloc(rows * qkv_n * 2, "qkv"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer positions, alloc(rows * 4, "positions"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer scale, alloc(4, "scale"));
  const float scale_value = 1.0f / 64;
  TP_CUDA_CHECK(cudaMemcpyAsync(scale.data(), &scale_value, 4, cudaMemcpyHostToDevice, stream));
  std::vector<int32_t> pos(rows);
  for (int64_t r = 0; r < rows; ++r) pos[r] = static_cast<int32_t>(r % 1024);
  TP_CUDA_CHECK(
      cudaMemcpyAsync(positions.data(), pos.data(), rows * 4, cudaMemcpyHostToDevice, stream));
  struct Fill {
    DeviceBuffer* buf;
    size_t count;
    float scale;
  } fills[] = {{&x, size_t(rows * h), 1.0f},
               {&residual, size_t(rows * h), 1.0f},
               {&weight, size_t(h), 1.0f},
               {&gate_up, size_t(rows * 2 * inter), 4.0f},
               {&qkv, size_t(rows * qkv_n), 1.0f}};
  uint64_t seed = 1;
  for (const Fill& fill : fills) {
    TP_RETURN_IF_ERROR(LaunchRandomUniform(fill.buf->data(), DataType::kBFloat16, fill.count,
                                           seed++, fill.scale, stream));
  }

  RmsNormParams add_norm;
  add_norm.input = x.as<BFloat16>();
  add_norm.residual = residual.as<BFloat16>();
  add_norm.residual_out = x.as<BFloat16>();
  add_norm.weight = weight.as<BFloat16>();
  add_norm.out_fp8 = codes.as<uint8_t>();
  add_norm.out_fp8_scale = scale.as<float>();
  add_norm.rows = rows;
  add_norm.dim = h;
  RmsNormParams norm = add_norm;
  norm.residual = nullptr;
  norm.residual_out = nullptr;
  SwiGluParams swiglu;
  swiglu.gate_up = gate_up.as<BFloat16>();
  swiglu.out_fp8 = codes.as<uint8_t>();
  swiglu.out_fp8_scale = scale.as<float>();
  swiglu.rows = rows;
  swiglu.inter = inter;
  RopeParams rope;
  rope.q = qkv.as<BFloat16>();
  rope.q_row_stride = qkv_n;
  rope.q_heads = f.heads;
  rope.k = qkv.as<BFloat16>() + f.heads * f.head_dim;
  rope.k_row_stride = qkv_n;
  rope.kv_heads = f.kv_heads;
  rope.head_dim = f.head_dim;
  rope.positions = positions.as<int32_t>();
  rope.rows = rows;
  rope.theta = 500000.0;

  const double act = static_cast<double>(rows * h);
  const double copy_bytes = static_cast<double>(gate_up.size());
  std::vector<Pass> passes = {
      {"copy", 2 * copy_bytes,
       [&](cudaStream_t s) -> Status {
         TP_CUDA_CHECK(cudaMemcpyAsync(copy_dst.data(), gate_up.data(), gate_up.size(),
                                       cudaMemcpyDeviceToDevice, s));
         return Status::Ok();
       }},
      {"add_norm_fp8", act * (2 + 2 + 2 + 1),
       [&](cudaStream_t s) { return LaunchRmsNorm(add_norm, s); }},
      {"norm_fp8", act * (2 + 1), [&](cudaStream_t s) { return LaunchRmsNorm(norm, s); }},
      {"swiglu_fp8", static_cast<double>(rows * inter) * (2 * 2 + 1),
       [&](cudaStream_t s) { return LaunchSwiGlu(swiglu, s); }},
      {"rope", static_cast<double>(rows * (f.heads + f.kv_heads) * f.head_dim) * 2 * 2 + 4.0 * rows,
       [&](cudaStream_t s) { return LaunchRope(rope, s); }},
  };
  // The other thread shapes of the norms (RmsNormParams::vecs_per_thread), labelled, with
  // their base pass's bytes (passes 1 and 2; a deque keeps each copy where its pass points).
  std::deque<RmsNormParams> shaped;
  for (int vecs : f.norm_vecs) {
    if (vecs == add_norm.vecs_per_thread) continue;
    for (const auto& [base, at] : {std::pair{&add_norm, 1}, std::pair{&norm, 2}}) {
      RmsNormParams& q = shaped.emplace_back(*base);
      q.vecs_per_thread = vecs;
      Pass variant{passes[at].name + "/v" + std::to_string(vecs), passes[at].bytes,
                   [&q](cudaStream_t s) { return LaunchRmsNorm(q, s); }};
      passes.push_back(std::move(variant));
    }
  }
  for (Pass& p : passes) {
    for (int i = 0; i < f.warmup; ++i) TP_RETURN_IF_ERROR(p.launch(stream));
  }
  TP_ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::Create(true));
  TP_ASSIGN_OR_RETURN(CudaEvent end, CudaEvent::Create(true));
  for (int round = 0; round < f.rounds; ++round) {
    for (Pass& p : passes) {
      TP_ASSIGN_OR_RETURN(const double ms,
                          TimeLaunchMs(stream, start, end, [&] { return p.launch(stream); }));
      p.ms.push_back(ms);
    }
  }
  const double copy_gbs = passes[0].bytes / (Median(passes[0].ms) / 1e3) / 1e9;
  std::printf("rows %ld: device-to-device copy %.0f GB/s (the floors' bandwidth)\n",
              static_cast<long>(rows), copy_gbs);
  for (const Pass& p : passes) {
    const double med = Median(p.ms);
    const double gbs = p.bytes / (med / 1e3) / 1e9;
    const double floor_us = p.bytes / (copy_gbs * 1e9) * 1e6;
    std::printf("  %-13s %7.1f MB  %8.1f us  %6.0f GB/s  floor %7.1f us  %5.2f x floor\n",
                p.name.c_str(), p.bytes / 1e6, med * 1e3, gbs, floor_us, med * 1e3 / floor_us);
    records.push_back({{"pass", p.name},
                       {"rows", rows},
                       {"bytes", p.bytes},
                       {"median_us", med * 1e3},
                       {"times_ms", p.ms},
                       {"gb_per_s", gbs},
                       {"floor_us", floor_us},
                       {"over_floor", med * 1e3 / floor_us}});
  }
  std::fflush(stdout);
  return Status::Ok();
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "tpserve-bench-elementwise: times the model's element-wise passes (add & RMSNorm with "
      "FP8 codes out, RMSNorm alone, SwiGLU with FP8 codes out, RoPE) and states each against "
      "its bytes-moved floor, the bytes it reads and writes over the bandwidth of a "
      "device-to-device copy timed in the same call"};
  StrictNumbers(app);
  app.add_option("--rows", f.rows, "token rows per pass (one run per value)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--hidden", f.hidden, "hidden size (the norms' row length), multiple of 8")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--inter", f.inter, "intermediate size (SwiGLU's output row), multiple of 8")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--heads", f.heads, "query heads (RoPE)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--kv-heads", f.kv_heads, "key/value heads (RoPE)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--head-dim", f.head_dim, "head dimension (RoPE), even")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--norm-vecs", f.norm_vecs,
                 "also time the norms with these vectors of 8 per thread (1, 2, 4, 8; "
                 "RmsNormParams::vecs_per_thread), labelled /vN")
      ->check(CLI::IsMember({1, 2, 4, 8}));
  app.add_option("--warmup", f.warmup, "untimed launches per pass")
      ->check(NonNegative())
      ->capture_default_str();
  app.add_option("--rounds", f.rounds, "timed launches per pass (median reported)")
      ->check(Positive())
      ->capture_default_str();
  app.add_option("--out", f.out, "JSON results, rewritten after every --rows value")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  auto stream = CudaStream::Create();
  if (!stream.ok()) {
    spdlog::error("{}", stream.status().ToString());
    return 1;
  }
  json doc = {{"meta",
               {{"gpu", DeviceName()},
                {"hidden", f.hidden},
                {"inter", f.inter},
                {"heads", f.heads},
                {"kv_heads", f.kv_heads},
                {"head_dim", f.head_dim},
                {"rounds", f.rounds},
                {"floor",
                 "bytes read + written / the device-to-device copy's bandwidth "
                 "(2 x bytes copied / time) in the same call"}}},
              {"records", json::array()}};
  for (int64_t rows : f.rows) {
    if (Status st = RunRows(f, rows, stream->get(), doc["records"]); !st.ok()) {
      spdlog::error("rows {}: {}", rows, st.ToString());
      return 1;
    }
    if (std::string err = WriteReplacing(f.out, doc.dump(1)); !err.empty()) {
      spdlog::error("{}", err);
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) { return tpserve::Main(argc, argv); }
