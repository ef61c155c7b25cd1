// tpserve-probe-split-gemm: what does splitting a layer's GEMM into row chunks
// cost, and does running the chunks on two streams win it back? The
// copy-engine rings compute a layer as c GEMMs of M / c rows (own rows first,
// the peer's when they have arrived). On one stream each chunk's GEMM waits
// for the last CTAs of the one before it, so every chunk pays a partly empty
// last wave; the NOTES put gate_up's two 4096-row GEMMs at 3.029 ms against
// 2.898 for one of 8192 rows. Chunks that do not depend on each other could
// run on two streams, the next chunk's CTAs taking the SMs that the previous
// chunk's tail leaves idle. This probe measures, on one GPU:
//   full    one GEMM of M rows
//   serial  c GEMMs of M / c rows, one stream
//   lanes   the same c GEMMs alternating over two streams (a cuBLASLt
//           object, and so a workspace, per stream)
// each alone and with a device-to-device copy of --copy-mib running beside it
// on a third stream (standing in for the copy engine's transfer; a local copy
// reads and writes HBM, the peer's transfer only writes it, so this
// overstates its HBM traffic). Every case is one CUDA graph; rounds
// interleave the cases; each replay is timed with CUDA events; medians are
// printed and written with --json. Correctness: lanes' output equals serial's
// bit for bit (the same algorithm per chunk shape, chosen by tpserve's timed
// selection as the layers choose it).
//
// With --ksplit (default on) it also measures the GEMM side of a GEMM+RS
// without partial sums: each rank holds the whole weight, receives the
// peer's input columns of its own rows (m / c rows, k FP8 bytes each per
// peer: a quarter of the BF16 partial a reduce-scatter moves when n = 2k)
// and computes its m / c output rows over the whole K = c * k:
//   fullk     one GEMM of m / c rows over K = c * k
//   ksplit    c GEMMs of m / c rows over k each, all but the first
//             accumulating (beta = 1, C = D), the first on the local columns
//   ksplit+copy  the same with the peer's columns copied beside the first
//             GEMM and joined before the second (as the transfer would be)
//   fullk_pipe<s>  fullk in s row chunks, each chunk's other column blocks
//             brought by 2D copies beside the previous chunk's GEMM (the
//             schedule LinearKnobs::full_weight runs, with local copies
//             standing in for the pulls over NVLink)
//   fullk_geo<s>  the same with s growing chunks (each twice the one before,
//             rounded to 128 rows): a small first copy exposed, large GEMMs
//   hybrid2   fullk_pipe2 whose first chunk waits for nothing: a GEMM over the
//             own columns first, the other blocks added by accumulating GEMMs
//             once copied, then the second chunk whole-K
//   lead<q>   a hybrid lead of rows / q rows (own-columns GEMM at once, the other
//             blocks 1D-copied into a packed staging area and added by accumulating
//             GEMMs), the rest of the rows in one whole-K GEMM whose 2D copies run
//             beside the lead's GEMMs: only the lead's short split is paid
//   fullk_pipe<s>_nocopy, fullk_geo<s>_nocopy, lead<q>_nocopy  the same GEMMs without the
//             copies: the schedule's split alone
//   copy2d / copy1d  those copies alone, 2D into the column blocks and 1D
// Correctness: ksplit's output against fullk's, relative error printed and
// bounded (they differ by the BF16 rounding of the partial sums); fullk_pipe's,
// hybrid2's and lead's against fullk's likewise.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/write_replacing.h"
#include "comm/cuda_check.h"
#include "comm/cuda_resources.h"
#include "comm/dtype.h"
#include "comm/status.h"
#include "layers/cublaslt_gemm.h"
#include "layers/random_fill.h"

namespace tpserve {
namespace {

struct Shape {
  std::string name;
  int64_t n = 0;
  int64_t k = 0;
};

struct Options {
  // Per-rank GEMMs of Llama-3-70B at TP = 2 (name:n:k).
  std::vector<std::string> shapes = {"qkv:5120:8192", "o:8192:4096", "gate_up:28672:8192",
                                     "down:8192:14336"};
  std::vector<int64_t> ms = {8192, 16384};
  std::vector<int> chunks = {2};
  int iters = 10;
  int rounds = 5;
  double copy_mib = 64;
  bool ksplit = true;
  std::string json_path;
};

StatusOr<Shape> ParseShape(const std::string& s) {
  Shape out;
  std::stringstream in(s);
  std::string n, k;
  if (!std::getline(in, out.name, ':') || !std::getline(in, n, ':') || !std::getline(in, k) ||
      out.name.empty()) {
    return InvalidArgumentError("--shape '" + s + "': expected name:n:k");
  }
  try {
    out.n = std::stoll(n);
    out.k = std::stoll(k);
  } catch (const std::exception&) {
    return InvalidArgumentError("--shape '" + s + "': n and k must be integers");
  }
  if (out.n <= 0 || out.k <= 0 || out.n % 16 != 0 || out.k % 16 != 0) {
    return InvalidArgumentError("--shape '" + s + "': n and k must be positive multiples of 16");
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Status Probe(const Options& o) {
  int devices = 0;
  TP_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 1) return FailedPreconditionError("needs a GPU, found none");
  TP_CUDA_CHECK(cudaSetDevice(0));
  std::vector<Shape> shapes;
  for (const std::string& s : o.shapes) {
    TP_ASSIGN_OR_RETURN(Shape sh, ParseShape(s));
    shapes.push_back(sh);
  }
  for (int64_t m : o.ms) {
    for (int c : o.chunks) {
      if (m <= 0 || c < 1 || m % c != 0) {
        return InvalidArgumentError("--m " + std::to_string(m) + " does not split into --chunks " +
                                    std::to_string(c));
      }
    }
  }
  TP_ASSIGN_OR_RETURN(CudaStream main, CudaStream::Create());
  TP_ASSIGN_OR_RETURN(CudaStream lane1, CudaStream::Create());
  TP_ASSIGN_OR_RETURN(CudaStream copier, CudaStream::Create());
  TP_ASSIGN_OR_RETURN(CublasLtGemm gemm0, CublasLtGemm::Create("lane0"));
  TP_ASSIGN_OR_RETURN(CublasLtGemm gemm1, CublasLtGemm::Create("lane1"));
  std::vector<CudaEvent> events;
  for (int i = 0; i < 3; ++i) {  // fork, the copy's join, lane 1's join
    TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create());
    events.push_back(std::move(e));
  }
  std::vector<CudaEvent> pipe_events;  // --ksplit's pipelined fullk: one per chunk
  for (int i = 0; i < 4; ++i) {
    TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create());
    pipe_events.push_back(std::move(e));
  }
  std::vector<CudaEvent> marks;  // start and end of each timed replay of a round
  for (int i = 0; i < 2 * o.iters; ++i) {
    TP_ASSIGN_OR_RETURN(CudaEvent e, CudaEvent::Create(true));
    marks.push_back(std::move(e));
  }
  const size_t copy_bytes = static_cast<size_t>(o.copy_mib * 1024 * 1024) / 16 * 16;
  TP_ASSIGN_OR_RETURN(DeviceBuffer copy_src, DeviceBuffer::Allocate(copy_bytes + 16, "copy_src"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer copy_dst, DeviceBuffer::Allocate(copy_bytes + 16, "copy_dst"));
  TP_ASSIGN_OR_RETURN(DeviceBuffer scales, DeviceBuffer::Allocate(16, "scales"));
  const float ones[2] = {1.0f / 448, 1.0f / 448};
  TP_CUDA_CHECK(cudaMemcpy(scales.data(), ones, sizeof ones, cudaMemcpyHostToDevice));
  const float* scale = static_cast<const float*>(scales.data());

  nlohmann::json records = nlohmann::json::array();
  for (const Shape& sh : shapes) {
    for (int64_t m : o.ms) {
      TP_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Allocate(m * sh.k, "a"));
      TP_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(sh.n * sh.k, "b"));
      TP_ASSIGN_OR_RETURN(DeviceBuffer d_serial, DeviceBuffer::Allocate(m * sh.n * 2, "d_serial"));
      TP_ASSIGN_OR_RETURN(DeviceBuffer d_lanes, DeviceBuffer::Allocate(m * sh.n * 2, "d_lanes"));
      // Full-range operands, as tpserve-bench uses (values decide the GEMM's power draw).
      TP_RETURN_IF_ERROR(
          LaunchRandomUniform(a.data(), DataType::kFloat8E4M3, m * sh.k, 11, 448.0f, main.get()));
      TP_RETURN_IF_ERROR(LaunchRandomUniform(b.data(), DataType::kFloat8E4M3, sh.n * sh.k, 21,
                                             448.0f, main.get()));
      TP_CUDA_CHECK(cudaStreamSynchronize(main.get()));
      auto params = [&](int64_t rows) {
        GemmParams p;
        p.m = rows;
        p.n = sh.n;
        p.k = sh.k;
        p.a_scale = scale;
        p.b_scale = scale;
        return p;
      };
      // Chunk i of `rows` rows: A rows and D rows from i * rows.
      auto chunk = [&](CublasLtGemm& g, int64_t rows, int64_t i, void* d, cudaStream_t s) {
        return g.Run(params(rows), a.as<char>() + i * rows * sh.k, b.data(), nullptr,
                     static_cast<char*>(d) + i * rows * sh.n * 2, s);
      };
      struct Case {
        std::string name;
        int chunks;
        bool copy;
        double copy_mib;  // MiB copied beside the GEMMs (0: none)
        CudaGraphExec graph;
        std::vector<double> ms;
      };
      std::vector<Case> cases;
      for (int c : o.chunks) {
        const int64_t rows = m / c;
        TP_RETURN_IF_ERROR(gemm0.Prepare(params(rows)));
        TP_RETURN_IF_ERROR(gemm1.Prepare(params(rows)));
        for (bool copy : {false, true}) {
          if (copy && copy_bytes == 0) continue;
          for (const char* kind : {"serial", "lanes"}) {
            if (c == 1 && std::string(kind) == "lanes") continue;
            const bool lanes = std::string(kind) == "lanes";
            void* d = lanes ? d_lanes.data() : d_serial.data();
            auto body = [&]() -> Status {
              cudaStream_t s0 = main.get(), s1 = lane1.get(), sc = copier.get();
              TP_RETURN_IF_ERROR(events[0].Record(s0));
              if (copy) {
                TP_RETURN_IF_ERROR(events[0].WaitOn(sc));
                TP_CUDA_CHECK(cudaMemcpyAsync(copy_dst.data(), copy_src.data(), copy_bytes,
                                              cudaMemcpyDeviceToDevice, sc));
                TP_RETURN_IF_ERROR(events[1].Record(sc));
              }
              if (lanes) TP_RETURN_IF_ERROR(events[0].WaitOn(s1));
              for (int64_t i = 0; i < c; ++i) {
                const bool on1 = lanes && i % 2 == 1;
                TP_RETURN_IF_ERROR(chunk(on1 ? gemm1 : gemm0, rows, i, d, on1 ? s1 : s0));
              }
              if (lanes) {
                TP_RETURN_IF_ERROR(events[2].Record(s1));
                TP_RETURN_IF_ERROR(events[2].WaitOn(s0));
              }
              if (copy) TP_RETURN_IF_ERROR(events[1].WaitOn(s0));
              return Status::Ok();
            };
            TP_ASSIGN_OR_RETURN(
                CudaGraphExec g,
                CudaGraphExec::Capture(main.get(), cudaStreamCaptureModeThreadLocal, body));
            const std::string name =
                (c == 1 ? std::string("full") : std::string(kind) + "_c" + std::to_string(c)) +
                (copy ? "+copy" : "");
            cases.push_back({name, c, copy, copy ? o.copy_mib : 0.0, std::move(g), {}});
          }
        }
      }
      // GEMM+RS without partial sums (see the top of the file). The c local K blocks of A are
      // the row chunks of `a` ((m / c) x k each, contiguous, as the own columns and each
      // received block would be); the weight's c K blocks are contiguous [n, k] blocks.
      DeviceBuffer b_blocks, a_full, b_full, d_fullk, d_ksplit, ks_src, ks_dst, a_pipe, d_pipe,
          d_hybrid, d_lead;
      bool lead_ran = false;  // a lead<q> case wrote d_lead
      if (o.ksplit) {
        int64_t max_c = 1;
        for (int c : o.chunks) max_c = std::max<int64_t>(max_c, c);
        TP_ASSIGN_OR_RETURN(b_blocks, DeviceBuffer::Allocate(max_c * sh.n * sh.k, "b_blocks"));
        TP_ASSIGN_OR_RETURN(a_full, DeviceBuffer::Allocate(m * sh.k, "a_full"));
        TP_ASSIGN_OR_RETURN(b_full, DeviceBuffer::Allocate(max_c * sh.n * sh.k, "b_full"));
        TP_ASSIGN_OR_RETURN(d_fullk, DeviceBuffer::Allocate(m * sh.n * 2, "d_fullk"));
        TP_ASSIGN_OR_RETURN(d_ksplit, DeviceBuffer::Allocate(m * sh.n * 2, "d_ksplit"));
        TP_ASSIGN_OR_RETURN(ks_src, DeviceBuffer::Allocate(m * sh.k + 16, "ks_src"));
        TP_ASSIGN_OR_RETURN(ks_dst, DeviceBuffer::Allocate(m * sh.k + 16, "ks_dst"));
        TP_ASSIGN_OR_RETURN(a_pipe, DeviceBuffer::Allocate(m * sh.k, "a_pipe"));
        TP_ASSIGN_OR_RETURN(d_pipe, DeviceBuffer::Allocate(m * sh.n * 2, "d_pipe"));
        TP_ASSIGN_OR_RETURN(d_hybrid, DeviceBuffer::Allocate(m * sh.n * 2, "d_hybrid"));
        TP_ASSIGN_OR_RETURN(d_lead, DeviceBuffer::Allocate(m * sh.n * 2, "d_lead"));
        TP_RETURN_IF_ERROR(LaunchRandomUniform(b_blocks.data(), DataType::kFloat8E4M3,
                                               max_c * sh.n * sh.k, 31, 448.0f, main.get()));
      }
      for (int c : o.chunks) {
        if (!o.ksplit || c == 1) continue;
        const int64_t rows = m / c;
        const int64_t kk = c * sh.k;
        // fullk's operands: A [rows, c*k] and B [n, c*k], block i in columns i*k.
        for (int64_t i = 0; i < c; ++i) {
          TP_CUDA_CHECK(cudaMemcpy2DAsync(a_full.as<char>() + i * sh.k, kk,
                                          a.as<char>() + i * rows * sh.k, sh.k, sh.k, rows,
                                          cudaMemcpyDeviceToDevice, main.get()));
          TP_CUDA_CHECK(cudaMemcpy2DAsync(b_full.as<char>() + i * sh.k, kk,
                                          b_blocks.as<char>() + i * sh.n * sh.k, sh.k, sh.k, sh.n,
                                          cudaMemcpyDeviceToDevice, main.get()));
        }
        GemmParams full = params(rows);
        full.k = kk;
        GemmParams first = params(rows);
        GemmParams acc = params(rows);
        acc.beta = 1.0f;
        for (const GemmParams* p : {&full, &first, &acc}) TP_RETURN_IF_ERROR(gemm0.Prepare(*p));
        const size_t ks_bytes = static_cast<size_t>((c - 1) * rows * sh.k);
        for (int kind = 0; kind < 3; ++kind) {  // fullk, ksplit, ksplit+copy
          auto body = [&]() -> Status {
            cudaStream_t s0 = main.get(), sc = copier.get();
            if (kind == 0) {
              return gemm0.Run(full, a_full.data(), b_full.data(), nullptr, d_fullk.data(), s0);
            }
            if (kind == 2) {
              TP_RETURN_IF_ERROR(events[0].Record(s0));
              TP_RETURN_IF_ERROR(events[0].WaitOn(sc));
              TP_CUDA_CHECK(cudaMemcpyAsync(ks_dst.data(), ks_src.data(), ks_bytes,
                                            cudaMemcpyDeviceToDevice, sc));
              TP_RETURN_IF_ERROR(events[1].Record(sc));
            }
            for (int64_t i = 0; i < c; ++i) {
              if (i == 1 && kind == 2) TP_RETURN_IF_ERROR(events[1].WaitOn(s0));
              TP_RETURN_IF_ERROR(gemm0.Run(i == 0 ? first : acc, a.as<char>() + i * rows * sh.k,
                                           b_blocks.as<char>() + i * sh.n * sh.k,
                                           i == 0 ? nullptr : d_ksplit.data(), d_ksplit.data(),
                                           s0));
            }
            return Status::Ok();
          };
          TP_ASSIGN_OR_RETURN(
              CudaGraphExec g,
              CudaGraphExec::Capture(main.get(), cudaStreamCaptureModeThreadLocal, body));
          const char* names[] = {"fullk_c", "ksplit_c", "ksplit_c"};
          cases.push_back({names[kind] + std::to_string(c) + (kind == 2 ? "+copy" : ""),
                           c,
                           kind == 2,
                           kind == 2 ? ks_bytes / 1048576.0 : 0.0,
                           std::move(g),
                           {}});
        }
        // Rows [at, at + count) of blocks 1..c-1 from ks_src into a_pipe (pitch kk) on `st`.
        auto copy_blocks = [&](int64_t at, int64_t count, cudaStream_t st) -> Status {
          for (int64_t blk = 1; blk < c; ++blk) {
            TP_CUDA_CHECK(cudaMemcpy2DAsync(a_pipe.as<char>() + at * kk + blk * sh.k, kk,
                                            ks_src.as<char>() + ((blk - 1) * rows + at) * sh.k,
                                            sh.k, sh.k, count, cudaMemcpyDeviceToDevice, st));
          }
          return Status::Ok();
        };
        // The schedule of LinearKnobs::full_weight: the rows in `sub` chunks; chunk j's other
        // column blocks arrive by 2D copies (standing in for the pulls from the peers: a local
        // copy is faster than NVLink) into a_pipe, beside chunk j - 1's whole-K GEMM. ks_src
        // holds what a_full's blocks 1.. hold, so d_pipe is fullk's result (checked below).
        TP_CUDA_CHECK(cudaMemcpyAsync(a_pipe.data(), a_full.data(), rows * kk,
                                      cudaMemcpyDeviceToDevice, main.get()));
        TP_CUDA_CHECK(cudaMemcpyAsync(ks_src.data(), a.as<char>() + rows * sh.k, ks_bytes,
                                      cudaMemcpyDeviceToDevice, main.get()));
        // Row chunks of each schedule: equal (pipe2, pipe4), or growing (geo2, geo3: each chunk
        // twice the one before, rounded to 128 rows, so that the first chunk's exposed copy is
        // small while the later GEMMs stay large).
        std::vector<std::pair<std::string, std::vector<int64_t>>> schedules;
        for (int sub : {2, 4}) {
          if (rows % sub != 0) continue;
          schedules.push_back(
              {"fullk_pipe" + std::to_string(sub), std::vector<int64_t>(sub, rows / sub)});
        }
        for (int sub : {2, 3}) {
          std::vector<int64_t> sizes;
          int64_t size = std::max<int64_t>(128, rows / ((int64_t{1} << sub) - 1) / 128 * 128);
          int64_t left = rows;
          for (int q = 0; q < sub && left > 0; ++q, size *= 2) {
            const int64_t take = q == sub - 1 ? left : std::min(size, left);
            sizes.push_back(take);
            left -= take;
          }
          schedules.push_back({"fullk_geo" + std::to_string(sub), sizes});
        }
        // Each schedule also without its copies (`_nocopy`: a_pipe keeps what the copying
        // variant, timed before it in every round, left there): what its GEMMs' split costs
        // apart from what the copies beside them cost.
        for (const auto& [label, sizes] : schedules) {
          if (sizes.size() > pipe_events.size()) continue;
          for (int64_t sz : sizes) {
            GemmParams part = params(sz);
            part.k = kk;
            TP_RETURN_IF_ERROR(gemm0.Prepare(part));
          }
          for (bool copies : {true, false}) {
            auto body = [&]() -> Status {
              cudaStream_t s0 = main.get(), sc = copier.get();
              TP_RETURN_IF_ERROR(events[0].Record(s0));
              TP_RETURN_IF_ERROR(events[0].WaitOn(sc));
              int64_t at = 0;
              for (size_t q = 0; q < sizes.size(); at += sizes[q], ++q) {
                if (copies) TP_RETURN_IF_ERROR(copy_blocks(at, sizes[q], sc));
                TP_RETURN_IF_ERROR(pipe_events[q].Record(sc));
              }
              at = 0;
              for (size_t q = 0; q < sizes.size(); at += sizes[q], ++q) {
                GemmParams part = params(sizes[q]);
                part.k = kk;
                TP_RETURN_IF_ERROR(pipe_events[q].WaitOn(s0));
                TP_RETURN_IF_ERROR(gemm0.Run(part, a_pipe.as<char>() + at * kk, b_full.data(),
                                             nullptr, d_pipe.as<char>() + at * sh.n * 2, s0));
              }
              return Status::Ok();
            };
            TP_ASSIGN_OR_RETURN(
                CudaGraphExec g,
                CudaGraphExec::Capture(main.get(), cudaStreamCaptureModeThreadLocal, body));
            cases.push_back({label + "_c" + std::to_string(c) + (copies ? "" : "_nocopy"),
                             c,
                             copies,
                             copies ? ks_bytes / 1048576.0 : 0.0,
                             std::move(g),
                             {}});
          }
        }
        // full_weight's schedule with a first chunk that waits for nothing: its GEMM over the
        // own columns (block 0, where the caller wrote them: `a`'s first rows) while every
        // chunk's other blocks are copied, then one accumulating GEMM per other block (a_pipe's
        // block at pitch kk, the weight's block at pitch kk), then the second chunk whole-K.
        if (rows % 2 == 0) {
          const int64_t srows = rows / 2;
          GemmParams part = params(srows);
          part.k = kk;
          GemmParams own = params(srows);
          own.ldb = kk;
          GemmParams add = own;
          add.lda = kk;
          add.beta = 1.0f;
          for (const GemmParams* p : {&part, &own, &add}) TP_RETURN_IF_ERROR(gemm0.Prepare(*p));
          auto body = [&]() -> Status {
            cudaStream_t s0 = main.get(), sc = copier.get();
            TP_RETURN_IF_ERROR(events[0].Record(s0));
            TP_RETURN_IF_ERROR(events[0].WaitOn(sc));
            for (int j = 0; j < 2; ++j) {
              TP_RETURN_IF_ERROR(copy_blocks(j * srows, srows, sc));
              TP_RETURN_IF_ERROR(pipe_events[j].Record(sc));
            }
            TP_RETURN_IF_ERROR(
                gemm0.Run(own, a.data(), b_full.data(), nullptr, d_hybrid.data(), s0));
            TP_RETURN_IF_ERROR(pipe_events[0].WaitOn(s0));
            for (int64_t blk = 1; blk < c; ++blk) {
              TP_RETURN_IF_ERROR(gemm0.Run(add, a_pipe.as<char>() + blk * sh.k,
                                           b_full.as<char>() + blk * sh.k, d_hybrid.data(),
                                           d_hybrid.data(), s0));
            }
            TP_RETURN_IF_ERROR(pipe_events[1].WaitOn(s0));
            return gemm0.Run(part, a_pipe.as<char>() + srows * kk, b_full.data(), nullptr,
                             d_hybrid.as<char>() + srows * sh.n * 2, s0);
          };
          TP_ASSIGN_OR_RETURN(
              CudaGraphExec g,
              CudaGraphExec::Capture(main.get(), cudaStreamCaptureModeThreadLocal, body));
          cases.push_back(
              {"hybrid2_c" + std::to_string(c), c, true, ks_bytes / 1048576.0, std::move(g), {}});
        }
        // A short hybrid lead, then the rest whole-K: the first rows / q rows start at once with
        // a GEMM over the own columns (block 0, `a`'s first rows, the weight's block 0 at pitch
        // kk), while their other blocks arrive by 1D copies into a packed staging area (d_lead's
        // rows need no interleaving: each accumulating GEMM reads one block, lda = k); the rest
        // of the rows come by 2D copies into a_pipe beside the lead's GEMMs and are multiplied
        // in one whole-K GEMM. What stays exposed: nothing but the lead's short split.
        for (int q : {4, 8}) {
          const int64_t lead = rows / q / 128 * 128;
          if (lead <= 0 || lead >= rows) continue;
          const int64_t rest = rows - lead;
          GemmParams own = params(lead);
          own.ldb = kk;
          GemmParams add = own;
          add.beta = 1.0f;
          GemmParams tail = params(rest);
          tail.k = kk;
          for (const GemmParams* p : {&own, &add, &tail}) TP_RETURN_IF_ERROR(gemm0.Prepare(*p));
          for (bool copies : {true, false}) {  // `_nocopy` as for the schedules above
            auto body = [&]() -> Status {
              cudaStream_t s0 = main.get(), sc = copier.get();
              TP_RETURN_IF_ERROR(events[0].Record(s0));
              TP_RETURN_IF_ERROR(events[0].WaitOn(sc));
              for (int64_t blk = 1; blk < c && copies; ++blk) {
                TP_CUDA_CHECK(cudaMemcpyAsync(ks_dst.as<char>() + (blk - 1) * lead * sh.k,
                                              ks_src.as<char>() + (blk - 1) * rows * sh.k,
                                              lead * sh.k, cudaMemcpyDeviceToDevice, sc));
              }
              TP_RETURN_IF_ERROR(pipe_events[0].Record(sc));
              if (copies) TP_RETURN_IF_ERROR(copy_blocks(lead, rest, sc));
              TP_RETURN_IF_ERROR(pipe_events[1].Record(sc));
              TP_RETURN_IF_ERROR(
                  gemm0.Run(own, a.data(), b_full.data(), nullptr, d_lead.data(), s0));
              TP_RETURN_IF_ERROR(pipe_events[0].WaitOn(s0));
              for (int64_t blk = 1; blk < c; ++blk) {
                TP_RETURN_IF_ERROR(gemm0.Run(add, ks_dst.as<char>() + (blk - 1) * lead * sh.k,
                                             b_full.as<char>() + blk * sh.k, d_lead.data(),
                                             d_lead.data(), s0));
              }
              TP_RETURN_IF_ERROR(pipe_events[1].WaitOn(s0));
              return gemm0.Run(tail, a_pipe.as<char>() + lead * kk, b_full.data(), nullptr,
                               d_lead.as<char>() + lead * sh.n * 2, s0);
            };
            TP_ASSIGN_OR_RETURN(
                CudaGraphExec g,
                CudaGraphExec::Capture(main.get(), cudaStreamCaptureModeThreadLocal, body));
            lead_ran = true;
            cases.push_back(
                {"lead" + std::to_string(q) + "_c" + std::to_string(c) + (copies ? "" : "_nocopy"),
                 c,
                 copies,
                 copies ? ks_bytes / 1048576.0 : 0.0,
                 std::move(g),
                 {}});
          }
        }
        // The copies alone: 2D into the column blocks, as above, and 1D of the same bytes.
        for (bool two_d : {true, false}) {
          auto body = [&]() -> Status {
            if (two_d) return copy_blocks(0, rows, main.get());
            TP_CUDA_CHECK(cudaMemcpyAsync(ks_dst.data(), ks_src.data(), ks_bytes,
                                          cudaMemcpyDeviceToDevice, main.get()));
            return Status::Ok();
          };
          TP_ASSIGN_OR_RETURN(
              CudaGraphExec g,
              CudaGraphExec::Capture(main.get(), cudaStreamCaptureModeThreadLocal, body));
          cases.push_back({std::string(two_d ? "copy2d_c" : "copy1d_c") + std::to_string(c),
                           c,
                           true,
                           ks_bytes / 1048576.0,
                           std::move(g),
                           {}});
        }
      }
      // A copy alone, for reference.
      if (copy_bytes > 0) {
        auto body = [&]() -> Status {
          TP_CUDA_CHECK(cudaMemcpyAsync(copy_dst.data(), copy_src.data(), copy_bytes,
                                        cudaMemcpyDeviceToDevice, main.get()));
          return Status::Ok();
        };
        TP_ASSIGN_OR_RETURN(
            CudaGraphExec g,
            CudaGraphExec::Capture(main.get(), cudaStreamCaptureModeThreadLocal, body));
        cases.push_back({"copy_only", 1, true, o.copy_mib, std::move(g), {}});
      }
      // Each case's replays of a round are queued behind a GPU-side delay, so that no timed
      // interval holds host launch latency; replays run back to back, as layers do.
      for (int r = -1; r < o.rounds; ++r) {
        for (Case& cs : cases) {
          TP_RETURN_IF_ERROR(LaunchGpuDelay(200000, main.get()));
          for (int i = 0; i < o.iters; ++i) {
            TP_RETURN_IF_ERROR(marks[2 * i].Record(main.get()));
            TP_RETURN_IF_ERROR(cs.graph.Launch(main.get()));
            TP_RETURN_IF_ERROR(marks[2 * i + 1].Record(main.get()));
          }
          TP_CUDA_CHECK(cudaStreamSynchronize(main.get()));
          for (int i = 0; i < o.iters && r >= 0; ++i) {
            TP_ASSIGN_OR_RETURN(float t, CudaEvent::ElapsedMs(marks[2 * i], marks[2 * i + 1]));
            cs.ms.push_back(t);
          }
        }
      }
      // lanes == serial, bit for bit: the last round wrote both with the last chunk count.
      if (o.chunks.size() > 1) {
        std::vector<char> hs(m * sh.n * 2), hl(m * sh.n * 2);
        TP_CUDA_CHECK(cudaMemcpy(hs.data(), d_serial.data(), hs.size(), cudaMemcpyDeviceToHost));
        TP_CUDA_CHECK(cudaMemcpy(hl.data(), d_lanes.data(), hl.size(), cudaMemcpyDeviceToHost));
        if (hs != hl) {
          return InternalError(sh.name + " m " + std::to_string(m) + ": lanes' output differs " +
                               "from serial's");
        }
      }
      // Every other whole-K schedule against fullk (the last round wrote them all with the last
      // chunk count > 1): the same product, up to the BF16 rounding of a partial (hybrid2's
      // first half, ksplit: ~2^-9 relative per element) or bit for bit (fullk_pipe/geo).
      if (o.ksplit && o.chunks.back() > 1) {
        const int64_t rows = m / o.chunks.back();
        std::vector<BFloat16> hf(rows * sh.n), other(rows * sh.n);
        TP_CUDA_CHECK(cudaMemcpy(hf.data(), d_fullk.data(), hf.size() * 2, cudaMemcpyDeviceToHost));
        const std::pair<const char*, const DeviceBuffer*> against[] = {{"hybrid2", &d_hybrid},
                                                                       {"fullk_pipe", &d_pipe},
                                                                       {"ksplit", &d_ksplit},
                                                                       {"lead", &d_lead}};
        for (const auto& [name, buf] : against) {
          if (buf == &d_lead && !lead_ran) continue;
          TP_CUDA_CHECK(
              cudaMemcpy(other.data(), buf->data(), other.size() * 2, cudaMemcpyDeviceToHost));
          double num = 0, den = 0;
          for (size_t i = 0; i < hf.size(); ++i) {
            const double f = BFloat16ToFloat(hf[i]), g = BFloat16ToFloat(other[i]);
            num += (f - g) * (f - g);
            den += f * f;
          }
          const double rel = den > 0 ? std::sqrt(num / den) : 0;
          std::printf("%-8s m %6lld  %s vs fullk: relative error %.2e\n", sh.name.c_str(),
                      static_cast<long long>(m), name, rel);
          if (!(rel < 1e-2) || den == 0) {
            return InternalError(sh.name + " m " + std::to_string(m) + ": " + name +
                                 "'s output differs from fullk's (relative error " +
                                 std::to_string(rel) + ")");
          }
        }
      }
      double full_ms = 0;
      for (const Case& cs : cases) {
        if (cs.name == "full") full_ms = Median(cs.ms);
      }
      for (const Case& cs : cases) {
        const double med = Median(cs.ms);
        std::printf("%-8s m %6lld n %6lld k %6lld  %-16s %.4f ms", sh.name.c_str(),
                    static_cast<long long>(m), static_cast<long long>(sh.n),
                    static_cast<long long>(sh.k), cs.name.c_str(), med);
        if (full_ms > 0) std::printf("  (%.3f x full)", med / full_ms);
        std::printf("\n");
        records.push_back({{"shape", sh.name},
                           {"m", m},
                           {"n", sh.n},
                           {"k", sh.k},
                           {"case", cs.name},
                           {"chunks", cs.chunks},
                           {"copy_mib", cs.copy_mib},
                           {"median_ms", med},
                           {"min_ms", *std::min_element(cs.ms.begin(), cs.ms.end())},
                           {"max_ms", *std::max_element(cs.ms.begin(), cs.ms.end())},
                           {"samples", cs.ms.size()}});
      }
      std::fflush(stdout);
    }
  }
  if (!o.json_path.empty()) {
    cudaDeviceProp prop{};
    TP_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    nlohmann::json out = {{"meta", {{"device", prop.name}, {"copy_mib", o.copy_mib}}},
                          {"records", records}};
    if (std::string err = WriteReplacing(o.json_path, out.dump(1) + "\n"); !err.empty()) {
      return InternalError(err);
    }
  }
  return Status::Ok();
}

}  // namespace
}  // namespace tpserve

int main(int argc, char** argv) {
  tpserve::Options o;
  CLI::App app{
      "tpserve-probe-split-gemm: one FP8 GEMM of M rows against the same GEMM in row chunks, "
      "serial on one stream or alternating over two, with and without a copy beside it (one "
      "GPU; prints medians)"};
  app.add_option("--shape", o.shapes, "name:n:k per-rank GEMM shapes (repeatable)")
      ->capture_default_str();
  app.add_option("--m", o.ms, "rows M (repeatable)")->capture_default_str();
  app.add_option("--chunks", o.chunks, "chunk counts c (1 = the full GEMM); 1 is always added")
      ->capture_default_str();
  app.add_option("--iters", o.iters, "timed replays per case per round")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--rounds", o.rounds, "interleaved rounds (after one warm-up round)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--copy-mib", o.copy_mib, "MiB copied device to device beside the GEMMs; 0: none")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--ksplit", o.ksplit,
                 "also time GEMM+RS without partial sums: fullk, ksplit, ksplit+copy (see the "
                 "source's header)")
      ->capture_default_str();
  app.add_option("--json", o.json_path, "write the medians as JSON here");
  CLI11_PARSE(app, argc, argv);
  if (std::find(o.chunks.begin(), o.chunks.end(), 1) == o.chunks.end()) {
    o.chunks.insert(o.chunks.begin(), 1);
  }
  tpserve::SetGemmAlgoSelection(tpserve::GemmAlgoSelection::kTimed);
  if (tpserve::Status st = tpserve::Probe(o); !st.ok()) {
    std::fprintf(stderr, "tpserve-probe-split-gemm: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
