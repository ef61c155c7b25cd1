#!/usr/bin/env python3
"""PyTorch peer of tpserve-bench: the same TP linear layers, timed with PyTorch.

Spawns one process per GPU (NCCL backend, rank r on cuda:r) and times, per
(shape, dtype), three ways PyTorch can run an AllGather+GEMM (ag_gemm) or a
GEMM+ReduceScatter (gemm_rs):

  torch_seq       all_gather_into_tensor then one GEMM / one GEMM then
                  reduce_scatter_tensor (fp8: torch._scaled_mm with per-tensor
                  scales, bf16: torch.mm)
  torch_chunked   each rank's row shard cut into C chunks; chunk i's
                  collective runs on a second stream under chunk i-1's GEMMs
  torch_symm_mem  PyTorch's async-TP ops in torch.ops.symm_mem
                  (fused_all_gather_[scaled_]matmul,
                  fused_[scaled_]matmul_reduce_scatter)

and, when asked for (--methods), two parts of torch_seq as diagnostics, as
tpserve-bench has them: gemm_only (the rank's GEMM alone, on the whole m:
after the gather for ag_gemm, the partial sums for gemm_rs) and comm_only (the
collective alone). They are not ways to run the layer: the renderer leaves
them out of PyTorch's best, and their outputs are not checked.

Shapes are those of MakeShapes in benchmarks/bench_layers.cc. Every method is
warmed up eagerly, captured into a CUDA graph (eager timing when capture
fails) and timed over --rounds replays with CUDA events; rank 0 writes the
records of benchmarks/README.md's schema (impl "torch"). Each method's output
is checked against torch_seq's (relative Frobenius distance <= 1e-2).

The file is rewritten after every method, so a crash keeps the methods done so
far. Workers end with os._exit: a process that captured NCCL collectives in a
CUDA graph can hang in destroy_process_group (../shared/GPU_HOST.md).
"""

import os

# NVLink multicast must stay off on the GPU host (../shared/GPU_HOST.md). Set
# before torch is imported, here and (inherited) in every spawned worker.
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_name] = _value

import argparse
import datetime
import json
import math
import shlex
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

from bench_stats import summarize

METHODS = ("torch_seq", "torch_chunked", "torch_symm_mem")
DIAGNOSTICS = ("gemm_only", "comm_only")  # parts of torch_seq; only when asked for
DTYPES = ("fp8", "bf16")
SHAPE_PRESETS = ("llama70b", "seed", "small")
CHECK_TOLERANCE = 1e-2
FP8_SCALE = 1.0 / 16  # per-tensor scale of X and of W, as in bench_layers.cc


# --------------------------------------------------------------------------
# Plan (pure Python, no torch): shapes, cases, statistics.


@dataclass(frozen=True)
class ShapeCase:
    layer: str  # e.g. "llama70b.gate_up"
    op: str  # "ag_gemm" | "gemm_rs"
    m: int  # global problem
    n: int
    k: int


def make_shapes(preset, ms, tp):
    """Exactly MakeShapes of benchmarks/bench_layers.cc."""
    out = []
    if preset == "llama70b":
        for m in ms:
            out.append(ShapeCase("llama70b.qkv", "ag_gemm", m, 10240, 8192))
            out.append(ShapeCase("llama70b.o", "gemm_rs", m, 8192, 8192))
            out.append(ShapeCase("llama70b.gate_up", "ag_gemm", m, 57344, 8192))
            out.append(ShapeCase("llama70b.down", "gemm_rs", m, 8192, 28672))
    elif preset == "seed":
        out.append(ShapeCase("seed.ag_gemm", "ag_gemm", 65536, 1024 * tp, 4096))
    elif preset == "small":
        for m in ms:
            out.append(ShapeCase("small.ag", "ag_gemm", m, 1024, 1024))
            out.append(ShapeCase("small.rs", "gemm_rs", m, 1024, 1024))
    return out


def method_variants(methods, chunks):
    """(method, chunks) pairs in run order; torch_seq first (the reference)."""
    out = []
    for name in METHODS + DIAGNOSTICS:  # fixed order whatever the command line's order
        if name not in methods:
            continue
        if name == "torch_chunked":
            out.extend((name, c) for c in chunks)
        else:
            out.append((name, 1))
    return out


def shape_problem(sc, tp):
    """Why a shape cannot run at this tp, or None."""
    if sc.m % tp:
        return "m=%d not divisible by tp=%d" % (sc.m, tp)
    if sc.op == "ag_gemm" and sc.n % tp:
        return "n=%d not divisible by tp=%d" % (sc.n, tp)
    if sc.op == "gemm_rs" and sc.k % tp:
        return "k=%d not divisible by tp=%d" % (sc.k, tp)
    return None


def chunk_problem(sc, tp, chunks):
    """Why a chunk count cannot run on this shape, or None."""
    if chunks < 1:
        return "chunks=%d < 1" % chunks
    if (sc.m // tp) % chunks:
        return "rows per rank m/tp=%d not divisible by chunks=%d" % (sc.m // tp, chunks)
    return None


def skip_entry(sc, dtype, method, chunks, reason):
    return {
        "impl": "torch",
        "layer": sc.layer,
        "op": sc.op,
        "method": method,
        "dtype": dtype,
        "m": sc.m,
        "n": sc.n,
        "k": sc.k,
        "chunks": chunks,
        "reason": reason,
    }


def plan(args):
    """(cases, skipped): cases = [(ShapeCase, dtype, [(method, chunks)])]."""
    cases, skipped = [], []
    variants = method_variants(args.methods, args.chunks)
    for sc in make_shapes(args.shapes, args.m, args.tp):
        for dtype in args.dtype:
            why = shape_problem(sc, args.tp)
            if why:
                for method, c in variants:
                    skipped.append(skip_entry(sc, dtype, method, c, why))
                continue
            runnable = []
            for method, c in variants:
                why = chunk_problem(sc, args.tp, c) if method == "torch_chunked" else None
                if why:
                    skipped.append(skip_entry(sc, dtype, method, c, why))
                else:
                    runnable.append((method, c))
            if runnable:
                cases.append((sc, dtype, runnable))
    return cases, skipped


def write_output(path, meta, records, skipped):
    """Atomic rewrite: a crash mid-write leaves the previous file."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "records": records, "skipped": skipped}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="PyTorch peer of tpserve-bench: times all_gather+GEMM and "
        "GEMM+reduce_scatter (sequential, chunked on two streams, torch symm_mem "
        "async-TP ops) on the GPUs of this host; writes JSON records "
        "(benchmarks/README.md).")
    p.add_argument("--tp", type=int, default=2, help="GPUs (one process each)")
    p.add_argument("--shapes", default="llama70b", choices=SHAPE_PRESETS,
                   help="shape preset, as tpserve-bench --shapes")
    p.add_argument("--m", type=int, nargs="+", default=[512, 2048, 8192, 16384],
                   help="global M values (tokens) for llama70b/small")
    p.add_argument("--dtype", nargs="+", default=["fp8"], choices=DTYPES,
                   help="operand types")
    p.add_argument("--chunks", type=int, nargs="+", default=[2, 4],
                   help="chunk counts for torch_chunked")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + DIAGNOSTICS,
                   help="methods to time (torch_seq always runs first when selected; "
                        "gemm_only and comm_only, parts of torch_seq timed alone, only "
                        "when named)")
    p.add_argument("--rounds", type=int, default=30, help="timed replays per method")
    p.add_argument("--warmup", type=int, default=5,
                   help="eager calls (at least 2) before capture, and replays before timing")
    p.add_argument("--l2-flush-mib", type=int, default=128,
                   help="before each timed replay (outside its timing) write this many MiB, "
                        "so that no method finds its operands in the GPU's L2 cache, as "
                        "tpserve-bench does (0: off)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip comparing each method's output with torch_seq's")
    p.add_argument("--no-graph", dest="graph", action="store_false",
                   help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--fast-accum", action="store_true",
                   help="FP8 fast accumulation in every _scaled_mm")
    p.add_argument("--out", default="torch_peer.json", help="JSON output file (rank 0)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds the parent waits for the workers before killing them")
    p.add_argument("--nccl-timeout", type=float, default=600.0,
                   help="process-group timeout in seconds")
    p.add_argument("--master-port", type=int, default=0,
                   help="rendezvous port on 127.0.0.1 (0: pick a free one)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the planned cases and exit (needs no torch)")
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if args.l2_flush_mib < 0:
        p.error("--l2-flush-mib must be >= 0")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if any(c < 1 for c in args.chunks):
        p.error("--chunks must be >= 1")
    if any(m < 1 for m in args.m):
        p.error("--m must be >= 1")
    args.command = " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)
    return args


def log(msg):
    print(msg, flush=True)


# --------------------------------------------------------------------------
# Worker (one process per GPU). Everything below imports torch lazily.


class Ctx:
    """Per-process state shared by all cases."""

    def __init__(self, rank, args):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.rank = rank
        self.tp = args.tp
        self.args = args
        self.dev = torch.device("cuda", rank)
        self.cpu_group = None
        self.comm_stream = None
        self.group_name = None
        self.symm_mem_ready = None  # None: not tried; True/False after

    def gather_objects(self, tag, obj):
        """obj from every rank (gloo group when there is one: CPU only, so it
        does not queue behind the GPU's collectives). `tag` names the step:
        ranks that reach different steps (one rank failed where the others
        did not) raise instead of pairing unrelated exchanges."""
        out = [None] * self.tp
        if self.cpu_group is not None:
            self.dist.all_gather_object(out, (tag, obj), group=self.cpu_group)
        else:
            self.dist.all_gather_object(out, (tag, obj))
        tags = [t for t, _ in out]
        if any(t != tag for t in tags):
            raise RuntimeError("ranks out of step: %s" % tags)
        return [v for _, v in out]

    def sum_floats(self, values):
        torch = self.torch
        if self.cpu_group is not None:
            t = torch.tensor(values, dtype=torch.float64)
            self.dist.all_reduce(t, group=self.cpu_group)
        else:
            t = torch.tensor(values, dtype=torch.float64, device=self.dev)
            self.dist.all_reduce(t)
        return [float(v) for v in t.cpu().tolist()]

    def barrier(self):
        self.torch.cuda.synchronize()
        try:
            self.dist.barrier(device_ids=[self.rank])
        except TypeError:
            self.dist.barrier()
        self.torch.cuda.synchronize()


def _short(exc):
    text = "%s: %s" % (type(exc).__name__, exc)
    text = " ".join(text.split())
    return text if len(text) <= 600 else text[:600] + " ..."


def call_by_schema(op_packet, values):
    """Calls a torch.ops overload packet with the arguments its schema names,
    taken from `values` (extra keys are ignored). The symm_mem ops' argument
    lists changed between releases (e.g. fused_scaled_matmul_reduce_scatter's
    scatter_dim became orig_scatter_dim + scatter_dim_after_maybe_reshape +
    output_shape); reading the schema of the installed torch keeps this script
    working across them. Raises when a required argument has no value."""
    schema = op_packet.default._schema
    args, kwargs = [], {}
    positional = True
    for a in schema.arguments:
        if a.name in values:
            if positional and not getattr(a, "kwarg_only", False):
                args.append(values[a.name])
            else:
                kwargs[a.name] = values[a.name]
            continue
        has_default = getattr(a, "has_default_value", None)
        if callable(has_default) and has_default():
            positional = False  # later arguments go by keyword
            continue
        raise RuntimeError("no value for argument %r of %s" % (a.name, schema))
    return op_packet(*args, **kwargs)


class Operands:
    """One (shape, dtype) case's operands on this rank."""

    def __init__(self, ctx, sc, dtype):
        torch = ctx.torch
        tp, rank = ctx.tp, ctx.rank
        self.sc = sc
        self.ag = sc.op == "ag_gemm"
        self.fp8 = dtype == "fp8"
        self.n_local = sc.n // tp if self.ag else sc.n
        self.k_local = sc.k if self.ag else sc.k // tp
        self.rows = sc.m // tp  # rows of one rank's shard
        self.tdtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        amp = 16.0 if self.fp8 else 1.0  # as bench_layers.cc
        self.w = _uniform(ctx, (self.n_local, self.k_local), self.tdtype, amp, 1000 + rank)
        x_shape = (self.rows, sc.k) if self.ag else (sc.m, self.k_local)
        self.x = _uniform(ctx, x_shape, self.tdtype, amp, 2000 + rank)
        self.w_t = self.w.t()  # [k_local, n_local], column-major as _scaled_mm wants
        self.scale_a = torch.full((), FP8_SCALE, dtype=torch.float32, device=ctx.dev)
        self.scale_b = torch.full((), FP8_SCALE, dtype=torch.float32, device=ctx.dev)
        self.fast_accum = bool(ctx.args.fast_accum) and self.fp8
        self.torch = torch
        torch.cuda.synchronize()

    def gemm(self, a, b, out=None):
        """a [r, k] row-major @ b [k, n] column-major -> bf16 [r, n]."""
        torch = self.torch
        if self.fp8:
            if out is None:
                return torch._scaled_mm(a, b, self.scale_a, self.scale_b,
                                        out_dtype=torch.bfloat16,
                                        use_fast_accum=self.fast_accum)
            torch.ops.aten._scaled_mm.out(a, b, self.scale_a, self.scale_b,
                                          out_dtype=torch.bfloat16,
                                          use_fast_accum=self.fast_accum, out=out)
            return out
        if out is None:
            return torch.mm(a, b)
        torch.mm(a, b, out=out)
        return out

    def base_config(self):
        cfg = {"gemm": "torch._scaled_mm" if self.fp8 else "torch.mm"}
        if self.fp8:
            cfg["fast_accum"] = self.fast_accum
        return cfg


def _torch():
    import torch
    return torch


def _uniform(ctx, shape, dtype, amp, seed):
    """Uniform in [-1, 1) * amp, drawn in float32 from a seeded generator,
    then cast."""
    torch = ctx.torch
    g = torch.Generator(device=ctx.dev)
    g.manual_seed(seed)
    t = torch.rand(shape, generator=g, device=ctx.dev, dtype=torch.float32)
    t.mul_(2.0).sub_(1.0).mul_(amp)
    out = t.to(dtype)
    del t
    return out


def _as_comm(t):
    """NCCL moves FP8 as bytes (no reduction on them here)."""
    torch = _torch()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# Each builder returns (fn, config, keep): fn() runs the layer once on the
# current stream and returns its output tensor; keep holds what must outlive
# the timing (buffers, events).


def build_seq(ctx, o):
    torch, dist = ctx.torch, ctx.dist
    sc = o.sc
    cfg = dict(o.base_config(), comm="nccl")
    if o.ag:
        gathered = torch.empty((sc.m, sc.k), dtype=o.tdtype, device=ctx.dev)
        x_c, g_c = _as_comm(o.x), _as_comm(gathered)

        def fn():
            dist.all_gather_into_tensor(g_c, x_c)
            return o.gemm(gathered, o.w_t)

        return fn, cfg, [gathered]
    out = torch.empty((o.rows, sc.n), dtype=torch.bfloat16, device=ctx.dev)

    def fn():
        partial = o.gemm(o.x, o.w_t)  # [m, n] partial sums of this rank
        dist.reduce_scatter_tensor(out, partial)
        return out

    return fn, cfg, [out]


def build_part(ctx, o, part):
    """torch_seq's GEMM alone or its collective alone (diagnostics)."""
    torch, dist = ctx.torch, ctx.dist
    sc = o.sc
    if part == "gemm_only":
        cfg = dict(o.base_config())
        # ag_gemm: an [m, k] input, as torch_seq's GEMM reads after the gather.
        a = o.x.repeat(ctx.tp, 1) if o.ag else o.x

        def fn():
            return o.gemm(a, o.w_t)

        return fn, cfg, [a]
    cfg = {"comm": "nccl"}
    if o.ag:
        gathered = torch.empty((sc.m, sc.k), dtype=o.tdtype, device=ctx.dev)
        x_c, g_c = _as_comm(o.x), _as_comm(gathered)

        def fn():
            dist.all_gather_into_tensor(g_c, x_c)
            return gathered

        return fn, cfg, [gathered]
    partial = torch.empty((sc.m, sc.n), dtype=torch.bfloat16, device=ctx.dev)
    partial.copy_(o.gemm(o.x, o.w_t))
    out = torch.empty((o.rows, sc.n), dtype=torch.bfloat16, device=ctx.dev)

    def fn():
        dist.reduce_scatter_tensor(out, partial)
        return out

    return fn, cfg, [partial, out]


def build_chunked(ctx, o, chunks):
    """Chunk i = rows [i*rc, (i+1)*rc) of every rank's shard (rc = m/tp/chunks).
    The collectives run on ctx.comm_stream, the GEMMs on the current stream;
    one GEMM per (chunk, source rank) so that every GEMM reads and writes
    contiguous rows of the natural [rank, row] layout (no re-layout copies)."""
    torch, dist = ctx.torch, ctx.dist
    sc, tp = o.sc, ctx.tp
    rc = o.rows // chunks
    comm = ctx.comm_stream
    events = [torch.cuda.Event() for _ in range(chunks)]
    cfg = dict(o.base_config(), comm="nccl", streams=2, gemms_per_chunk=tp)
    if o.ag:
        gathered = [torch.empty((tp * rc, sc.k), dtype=o.tdtype, device=ctx.dev)
                    for _ in range(chunks)]
        g_c = [_as_comm(g) for g in gathered]
        x_c = [_as_comm(o.x[i * rc:(i + 1) * rc]) for i in range(chunks)]
        out = torch.empty((sc.m, o.n_local), dtype=torch.bfloat16, device=ctx.dev)
        out_v = out.view(tp, o.rows, o.n_local)

        def fn():
            cur = torch.cuda.current_stream()
            comm.wait_stream(cur)
            with torch.cuda.stream(comm):
                for i in range(chunks):
                    dist.all_gather_into_tensor(g_c[i], x_c[i])
                    events[i].record(comm)
            for i in range(chunks):
                cur.wait_event(events[i])
                for j in range(tp):
                    o.gemm(gathered[i][j * rc:(j + 1) * rc], o.w_t,
                           out=out_v[j, i * rc:(i + 1) * rc])
            cur.wait_stream(comm)
            return out

        return fn, cfg, [gathered, g_c, x_c, out, events]

    parts = [torch.empty((tp * rc, sc.n), dtype=torch.bfloat16, device=ctx.dev)
             for _ in range(chunks)]
    out = torch.empty((o.rows, sc.n), dtype=torch.bfloat16, device=ctx.dev)

    def fn():
        cur = torch.cuda.current_stream()
        comm.wait_stream(cur)
        for i in range(chunks):
            for j in range(tp):
                r0 = j * o.rows + i * rc
                o.gemm(o.x[r0:r0 + rc], o.w_t, out=parts[i][j * rc:(j + 1) * rc])
            events[i].record(cur)
            with torch.cuda.stream(comm):
                comm.wait_event(events[i])
                dist.reduce_scatter_tensor(out[i * rc:(i + 1) * rc], parts[i])
        cur.wait_stream(comm)
        return out

    return fn, cfg, [parts, out, events]


def _ensure_symm_mem(ctx):
    """Imports torch.distributed._symmetric_memory (it registers the
    torch.ops.symm_mem ops) and, where it still exists, calls
    enable_symm_mem_for_group: required up to torch 2.9, deprecated (a no-op
    need) since. Returns the module."""
    import torch.distributed._symmetric_memory as symm_mem

    if ctx.symm_mem_ready is None:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(ctx.group_name)
        ctx.symm_mem_ready = True
    return symm_mem


def build_symm_mem(ctx, o):
    torch = ctx.torch
    symm_mem = _ensure_symm_mem(ctx)
    sc = o.sc
    ops = torch.ops.symm_mem
    cfg = dict(o.base_config())
    try:
        cfg["symm_mem_backend"] = str(symm_mem.get_backend(ctx.dev))
    except Exception:  # older torch: no get_backend
        pass
    gname = ctx.group_name
    if o.ag:
        if o.fp8:
            op = ops.fused_all_gather_scaled_matmul
            values = dict(A=o.x, Bs=[o.w_t], A_scale=o.scale_a, B_scales=[o.scale_b],
                          gather_dim=0, group_name=gname, biases=[None],
                          result_scales=[None], out_dtypes=[torch.bfloat16],
                          use_fast_accum=[o.fast_accum])
        else:
            op = ops.fused_all_gather_matmul
            values = dict(A=o.x, Bs=[o.w_t], gather_dim=0, group_name=gname,
                          return_A=False)
        cfg["op"] = "symm_mem." + ("fused_all_gather_scaled_matmul" if o.fp8
                                   else "fused_all_gather_matmul")

        def fn():
            _, outs = call_by_schema(op, values)
            return outs[0]  # [m, n_local]
    else:
        if o.fp8:
            op = ops.fused_scaled_matmul_reduce_scatter
            cfg["op"] = "symm_mem.fused_scaled_matmul_reduce_scatter"

            def fn():
                # Fresh output_shape list per call: the op divides it in place.
                values = dict(A=o.x, B=o.w_t, A_scale=o.scale_a, B_scale=o.scale_b,
                              reduce_op="sum", scatter_dim=0, orig_scatter_dim=0,
                              scatter_dim_after_maybe_reshape=0, group_name=gname,
                              output_shape=[sc.m, sc.n], bias=None, result_scale=None,
                              out_dtype=torch.bfloat16, use_fast_accum=o.fast_accum)
                return call_by_schema(op, values)  # [m/tp, n]
        else:
            op = ops.fused_matmul_reduce_scatter
            cfg["op"] = "symm_mem.fused_matmul_reduce_scatter"
            values = dict(A=o.x, B=o.w_t, reduce_op="sum", scatter_dim=0, group_name=gname)

            def fn():
                return call_by_schema(op, values)
    if ctx.rank == 0:
        log("  schema: %s" % op.default._schema)
    return fn, cfg, []


def time_method(ctx, fn, use_graph):
    """Eager warm-up, CUDA-graph capture (all ranks agree, else eager),
    `rounds` timed runs with an event pair each. Returns
    (times_ms, graph_used, output, graph_error, graph_obj)."""
    torch = ctx.torch
    args = ctx.args
    out = None
    for _ in range(max(2, args.warmup)):
        out = fn()
    torch.cuda.synchronize()

    graph, static_out, graph_error = None, None, None
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            try:
                capture = torch.cuda.graph(graph, capture_error_mode="thread_local")
            except TypeError:
                capture = torch.cuda.graph(graph)
            with capture:
                static_out = fn()
            torch.cuda.synchronize()
        except Exception as e:  # capture unsupported for this method
            graph_error = _short(e)
            graph, static_out = None, None
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
    errors = ctx.gather_objects("capture", graph_error if use_graph else None)
    graph_used = use_graph and all(e is None for e in errors)
    if use_graph and not graph_used:
        if graph_error is None:
            graph_error = "capture failed on another rank: " + "; ".join(
                str(e) for e in errors if e)
        graph, static_out = None, None
        if ctx.rank == 0:
            log("  CUDA graph capture failed, timing eager calls: %s" % graph_error)

    run = graph.replay if graph_used else fn
    if graph_used:
        out = static_out
        for _ in range(args.warmup):
            graph.replay()
    ctx.barrier()

    stream = torch.cuda.current_stream()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.rounds)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.rounds)]
    # Back-to-back replays would find the weights of the previous one in L2;
    # a write of --l2-flush-mib before each (outside the events) evicts them.
    flush = (torch.empty(args.l2_flush_mib << 20, dtype=torch.uint8, device="cuda")
             if args.l2_flush_mib > 0 else None)
    for i in range(args.rounds):
        if flush is not None:
            flush.fill_(i & 0xff)
        starts[i].record(stream)
        r = run()
        ends[i].record(stream)
        if not graph_used:
            out = r
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return times, graph_used, out, graph_error, graph


def rel_diff_global(ctx, out, ref):
    """Relative Frobenius distance ||out - ref|| / ||ref|| over all ranks'
    outputs (squared sums added over ranks)."""
    torch = ctx.torch
    if tuple(out.shape) != tuple(ref.shape):
        raise RuntimeError("output shape %s != reference shape %s"
                           % (tuple(out.shape), tuple(ref.shape)))
    a = out.reshape(-1, out.shape[-1])
    b = ref.reshape(-1, ref.shape[-1])
    block = max(1, (1 << 25) // max(1, a.shape[1]))
    num = torch.zeros((), dtype=torch.float64, device=ctx.dev)
    den = torch.zeros((), dtype=torch.float64, device=ctx.dev)
    for r0 in range(0, a.shape[0], block):
        da = a[r0:r0 + block].float()
        db = b[r0:r0 + block].float()
        d = da - db
        num += torch.sum(d * d, dtype=torch.float64)
        den += torch.sum(db * db, dtype=torch.float64)
        del da, db, d
    num_v, den_v = ctx.sum_floats([float(num.item()), float(den.item())])
    if math.isnan(num_v) or math.isnan(den_v) or den_v == 0.0:
        return float("inf")  # NaN, or an all-zero reference: no valid comparison
    return math.sqrt(num_v / max(den_v, 1e-30))


class Writer:
    """Rank 0's output: rewritten after every method."""

    def __init__(self, ctx, skipped):
        self.ctx = ctx
        self.records = []
        self.skipped = list(skipped)
        self.check_failures = []
        torch = ctx.torch
        nccl = "unknown"
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else str(v)
        except Exception:
            pass
        self.meta = {
            "torch": torch.__version__,
            "nccl": nccl,
            "device": "%dx %s" % (ctx.tp, torch.cuda.get_device_name(ctx.dev)),
            "command": ctx.args.command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "check_failures": 0,
        }

    def flush(self):
        if self.ctx.rank != 0:
            return
        self.meta["check_failures"] = len(self.check_failures)
        write_output(self.ctx.args.out, self.meta, self.records, self.skipped)


def run_method(ctx, o, sc, dtype, method, chunks, ref_holder, writer):
    """Builds, times and checks one method; appends its record on rank 0.
    All ranks agree (gloo) on success before anything is recorded."""
    torch = ctx.torch
    args = ctx.args
    label = "%s %s m=%d %s %s chunks=%d" % (sc.layer, sc.op, sc.m, dtype, method, chunks)
    err = None
    rec = None
    times = None
    fn = keep = graph = out = None
    try:
        if method == "torch_seq":
            fn, cfg, keep = build_seq(ctx, o)
        elif method == "torch_chunked":
            fn, cfg, keep = build_chunked(ctx, o, chunks)
        elif method in DIAGNOSTICS:
            fn, cfg, keep = build_part(ctx, o, method)
        else:
            fn, cfg, keep = build_symm_mem(ctx, o)
        times, graph_used, out, graph_error, graph = time_method(ctx, fn, args.graph)
        cfg = dict({"graph": graph_used}, **cfg)
        if graph_error and args.graph:
            cfg["graph_error"] = graph_error[:300]
        rec = {
            "impl": "torch",
            "layer": sc.layer,
            "op": sc.op,
            "method": method,
            "dtype": dtype,
            "tp": ctx.tp,
            "m": sc.m,
            "n": sc.n,
            "k": sc.k,
            "chunks": chunks,
            "config": cfg,
            "l2_flush_mib": args.l2_flush_mib,
            "rank_times": "max" if ctx.tp > 1 else "rank0",
        }
        if method == "torch_seq":
            ref_holder["ref"] = out.clone()
    except Exception as e:
        err = _short(e)
        sys.stderr.write("[rank %d] %s failed:\n" % (ctx.rank, label))
        traceback.print_exc()
        sys.stderr.flush()

    # Every rank's outcome and round times in one exchange (a rank that failed
    # still reaches it, so the ranks stay in step).
    results = ctx.gather_objects("method " + label, (err, times if err is None else None))
    errors = [e for e, _ in results]
    failed = [e for e in errors if e]
    if not failed:
        every = [t for _, t in results]
        if any(len(t) != len(every[0]) for t in every):
            errors = ["timed %d rounds" % len(t) for t in every]
            failed = errors
        else:
            # Each round's time is the slowest rank's, as tpserve-bench reports
            # its own (rank_times "max"): the op is done when its last rank is.
            times = [max(t[i] for t in every) for i in range(len(every[0]))]
            rec.update(summarize(times))
            # Every round's time, so that merge_results.py --pool-peer-passes
            # can pool this method's rounds from several passes of the peer.
            rec["times_ms"] = [round(float(t), 6) for t in times]
    check = None
    if not failed and args.check and method != "torch_seq" and method not in DIAGNOSTICS:
        check_err = None
        try:
            if ref_holder.get("ref") is None:
                raise RuntimeError("no torch_seq reference")
            check = rel_diff_global(ctx, out, ref_holder["ref"])
        except Exception as e:
            check_err = _short(e)
        check_errors = ctx.gather_objects("check " + label, check_err)
        bad = [e for e in check_errors if e]
        if bad:
            check = None
            if ctx.rank == 0:
                log("  check not computed: %s" % "; ".join(bad))

    # Release this method's buffers and graph pool before the next one.
    del fn, keep, graph, out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ctx.barrier()

    if ctx.rank != 0:
        return
    if failed:
        reason = "; ".join("rank %d: %s" % (r, e) for r, e in enumerate(errors) if e)
        log("  SKIPPED %s: %s" % (label, reason))
        writer.skipped.append(skip_entry(sc, dtype, method, chunks, reason))
        return
    if check is not None:
        rec["check_rel_diff_vs_seq"] = check
        if not check <= CHECK_TOLERANCE:
            writer.check_failures.append(label)
            log("!!!!! CHECK FAILED: %s differs from torch_seq: rel %.3g > %g !!!!!"
                % (label, check, CHECK_TOLERANCE))
    writer.records.append(rec)
    log("  %-14s chunks=%d graph=%-5s median %.4f ms (min %.4f, iqr %.4f)%s" % (
        method, chunks, rec["config"]["graph"], rec["median_ms"], rec["min_ms"],
        rec["iqr_ms"], "" if check is None else " rel_diff %.2e" % check))


def run_case(ctx, index, total, sc, dtype, variants, writer):
    torch = ctx.torch
    args = ctx.args
    if ctx.rank == 0:
        log("[%d/%d] %s %s m=%d n=%d k=%d %s tp=%d" % (
            index, total, sc.layer, sc.op, sc.m, sc.n, sc.k, dtype, ctx.tp))
    err = None
    o = None
    try:
        o = Operands(ctx, sc, dtype)
    except Exception as e:
        err = _short(e)
        traceback.print_exc()
    errors = ctx.gather_objects("operands %s m=%d %s" % (sc.layer, sc.m, dtype), err)
    if any(errors):
        o = None
        torch.cuda.empty_cache()
        if ctx.rank == 0:
            reason = "operands: " + "; ".join(
                "rank %d: %s" % (r, e) for r, e in enumerate(errors) if e)
            log("  SKIPPED case: %s" % reason)
            for method, c in variants:
                writer.skipped.append(skip_entry(sc, dtype, method, c, reason))
            writer.flush()
        ctx.barrier()
        return

    ref_holder = {"ref": None}
    if args.check and all(m != "torch_seq" for m, _ in variants):
        # The reference without timing it.
        try:
            fn, _, keep = build_seq(ctx, o)
            ref_holder["ref"] = fn().clone()
            torch.cuda.synchronize()
            del keep
        except Exception:
            traceback.print_exc()
    for method, chunks in variants:
        run_method(ctx, o, sc, dtype, method, chunks, ref_holder, writer)
        writer.flush()
    del o, ref_holder
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ctx.barrier()


def worker_main(rank, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(args.tp)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    ctx = Ctx(rank, args)
    init = dict(backend="nccl", rank=rank, world_size=args.tp,
                timeout=datetime.timedelta(seconds=args.nccl_timeout))
    try:
        dist.init_process_group(device_id=ctx.dev, **init)
    except TypeError:  # torch without device_id
        dist.init_process_group(**init)
    try:
        ctx.cpu_group = dist.new_group(backend="gloo")
    except Exception as e:
        if rank == 0:
            log("no gloo group (%s); agreeing over NCCL" % _short(e))
        ctx.cpu_group = None
    ctx.comm_stream = torch.cuda.Stream(device=ctx.dev)
    ctx.group_name = dist.group.WORLD.group_name

    cases, skipped = plan(args)
    writer = Writer(ctx, skipped)
    if rank == 0:
        log("torch %s, NCCL %s, %s; %d cases, %d skipped at plan time" % (
            writer.meta["torch"], writer.meta["nccl"], writer.meta["device"],
            len(cases), len(skipped)))
        for s in skipped:
            log("  skipped: %s m=%d %s %s chunks=%d: %s" % (
                s["layer"], s["m"], s["dtype"], s["method"], s["chunks"], s["reason"]))
    writer.flush()
    ctx.barrier()
    for i, (sc, dtype, variants) in enumerate(cases, 1):
        run_case(ctx, i, len(cases), sc, dtype, variants, writer)
    writer.flush()
    ctx.barrier()
    if rank == 0:
        log("wrote %d records, %d skipped, %d check failures to %s" % (
            len(writer.records), len(writer.skipped), len(writer.check_failures),
            args.out))
    return 0


def run_and_exit(main_fn, rank, *args):
    """Process target running main_fn(rank, *args). Never returns: os._exit
    skips destroy_process_group, which can hang after NCCL collectives were
    captured in a CUDA graph (shared by torch_model.py)."""
    code = 1
    try:
        code = main_fn(rank, *args)
    except BaseException:
        sys.stderr.write("[rank %d] fatal:\n" % rank)
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_entry(rank, args, port):
    run_and_exit(worker_main, rank, args, port)


# --------------------------------------------------------------------------
# Parent.


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_plan(args):
    cases, skipped = plan(args)
    for sc, dtype, variants in cases:
        log("%-18s %-7s m=%-6d n=%-6d k=%-6d %-4s %s" % (
            sc.layer, sc.op, sc.m, sc.n, sc.k, dtype,
            " ".join("%s/%d" % (m, c) for m, c in variants)))
    for s in skipped:
        log("skipped: %s m=%d %s %s chunks=%d: %s" % (
            s["layer"], s["m"], s["dtype"], s["method"], s["chunks"], s["reason"]))
    log("%d cases, %d method runs, %d skipped" % (
        len(cases), sum(len(v) for _, _, v in cases), len(skipped)))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        print_plan(args)
        return 0
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp:
        log("need %d CUDA devices, found %d" % (
            args.tp, torch.cuda.device_count() if torch.cuda.is_available() else 0))
        return 1
    port = args.master_port or free_port()
    if os.path.exists(args.out):
        os.remove(args.out)  # never mistake an old file for this run's
    mpctx = mp.get_context("spawn")
    procs = [mpctx.Process(target=worker_entry, args=(r, args, port), daemon=False)
             for r in range(args.tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    first_failure = None

    def stop_workers():
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)

    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            for p in procs:
                if not p.is_alive() and p.exitcode not in (0, None) and first_failure is None:
                    first_failure = now
                    log("worker pid %d exited with %s; waiting 60 s for the others"
                        % (p.pid, p.exitcode))
            if now > deadline or (first_failure is not None and now > first_failure + 60):
                log("timeout: terminating workers")
                stop_workers()
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        log("interrupted: terminating workers")
        stop_workers()
    codes = [p.exitcode for p in procs]
    rc = 0 if all(c == 0 for c in codes) else 1
    try:
        with open(args.out) as f:
            data = json.load(f)
        failures = data.get("meta", {}).get("check_failures", 0)
        log("%s: %d records, %d skipped, %d check failures" % (
            args.out, len(data.get("records", [])), len(data.get("skipped", [])), failures))
        if failures and rc == 0:
            rc = 2
    except (OSError, ValueError) as e:
        log("no readable output %s: %s" % (args.out, e))
        rc = 1
    if rc:
        log("worker exit codes: %s" % codes)
    return rc


if __name__ == "__main__":
    sys.exit(main())
