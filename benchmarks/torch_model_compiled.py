#!/usr/bin/env python3
"""Compiled PyTorch peer of tpserve-bench-model: PyTorch as its users run it for speed.

The same Llama prefill as benchmarks/torch_model.py (random weights of the preset's shapes;
speed only, the numbers are not compared with tpserve's), written the way a PyTorch user tunes
it:
- each block's work around attention is torch.compile'd (inductor; `--compile-mode`,
  max-autotune-no-cudagraphs by default: autotuned GEMM templates, fused RMSNorm + FP8
  quantize, RoPE, residual add, SwiGLU + quantize); one compiled graph serves every block;
- FP8 GEMMs are torch._scaled_mm with per-tensor scales, with and without fast accumulation
  (`--fast-accum`);
- attention is one batched scaled_dot_product_attention per block (the batch's sequences all
  have one length, so no per-sequence loop), on the fastest SDPA backend for that batch shape:
  each available backend (cuDNN, flash, memory-efficient) is timed first and the fastest kept
  (`--sdpa` forces one); K and V heads are expanded for a backend that refuses GQA;
- the whole pass (embedding, blocks, final norm, each sequence's last row, LM head) is captured
  as one CUDA graph per batch shape and replayed.

At --tp above 1 (one process per GPU), the layout is torch_model.py's (sequence parallel
between blocks, tensor parallel inside them) and the collectives are functional collectives
inside the compiled pieces, so that inductor's micro-pipeline async TP (`--async-tp on`,
torch._inductor.config._micro_pipeline_tp, symmetric memory) can replace each AllGather + GEMM
and GEMM + ReduceScatter by PyTorch's fused symm_mem ops; `--async-tp off` leaves them NCCL
collectives. How many fused ops a pass ran is counted with the profiler and recorded
(`async_tp_fused_ops`), so a pass the pattern matcher did not rewrite is visible. If the
whole pass cannot be captured as a CUDA graph, it is replayed eagerly and `cuda_graph` says so.

Host-timed like tpserve-bench-model's Forward(): token ids copied from the host into the
graph's input, replay, logits downloaded, synchronised; median of --rounds.

`--attention-only` adds SDPA alone for each backend at each batch shape (causal, BF16): its
time and TFLOP/s counting 4 * L^2 / 2 * head_dim * heads per sequence (the causal half).

  python3 benchmarks/torch_model_compiled.py --model llama3-8b --batches 8x1024 1x8192 64x128 \\
      --fast-accum both --attention-only --out torch-compiled.json
"""

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value

import argparse
import datetime
import json
import sys
import time

from torch_model import FP8_MAX, PRESETS, parse_shapes  # the eager peer's shapes and parsing
from torch_peer import free_port, run_and_exit

BACKENDS = ("cudnn", "flash", "efficient")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0,
                    help="blocks (0 = all of the preset's)")
    ap.add_argument("--dtype", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--batches", nargs="+", default=["8x1024", "1x8192", "64x128"],
                    help="SEQSxLEN batch shapes (every sequence of a batch has length LEN)")
    ap.add_argument("--fast-accum", default="both", choices=("on", "off", "both"),
                    help="FP8 only: _scaled_mm's use_fast_accum; both = one record each")
    ap.add_argument("--sdpa", default="auto", choices=("auto",) + BACKENDS,
                    help="SDPA backend; auto = the fastest for each batch shape")
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs",
                    choices=("default", "max-autotune-no-cudagraphs"),
                    help="torch.compile mode of the block pieces (CUDA graphs are taken "
                         "over the whole pass either way)")
    ap.add_argument("--attention-only", action="store_true",
                    help="also time SDPA alone per backend and batch shape")
    ap.add_argument("--skip-model", action="store_true",
                    help="with --attention-only: time SDPA alone and stop (no model is built "
                         "or compiled)")
    ap.add_argument("--tp", type=int, default=1,
                    help="GPUs, one process each (above 1: sequence + tensor parallel)")
    ap.add_argument("--async-tp", default="on", choices=("on", "off"),
                    help="tp > 1: inductor's micro-pipeline async TP on the compiled pieces' "
                         "AllGather + GEMM and GEMM + ReduceScatter (on), or plain NCCL "
                         "collectives (off)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="torch-compiled.json")
    args = ap.parse_args(argv)
    if args.skip_model and not args.attention_only:
        ap.error("--skip-model needs --attention-only")
    args.shapes = parse_shapes(ap, args.batches)
    if args.layers < 0:
        ap.error("--layers: %d is negative" % args.layers)
    if args.warmup < 1 or args.rounds < 1:
        ap.error("--warmup and --rounds must be at least 1")
    if args.tp < 1:
        ap.error("--tp: %d is not a GPU count" % args.tp)
    if args.tp > 1:
        h, inter, nh, nkv = PRESETS[args.model][:4]
        if nkv % args.tp or inter % args.tp or PRESETS[args.model][5] % args.tp:
            ap.error("--tp %d does not divide %s's KV heads, intermediate size and vocabulary"
                     % (args.tp, args.model))
        if any(seqs * length % args.tp for seqs, length in args.shapes):
            ap.error("--tp %d: every batch's tokens must be a multiple of it (rows are "
                     "sharded between blocks)" % args.tp)
        if args.attention_only:
            ap.error("--attention-only runs at --tp 1")
    return args


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def sdpa_backend(torch, name):
    b = torch.nn.attention.SDPBackend
    return {"cudnn": b.CUDNN_ATTENTION, "flash": b.FLASH_ATTENTION,
            "efficient": b.EFFICIENT_ATTENTION}[name]


class Attention:
    """Batched causal SDPA on one backend: q [B, H, L, D], k/v [B, KV, L, D] -> [B, H, L, D].
    GQA natively where the backend takes enable_gqa, else K/V heads expanded first."""

    def __init__(self, torch, backend, groups):
        self.torch, self.backend, self.groups = torch, backend, groups
        self.native_gqa = True

    def __call__(self, q, k, v):
        t = self.torch
        F = t.nn.functional
        with t.nn.attention.sdpa_kernel([sdpa_backend(t, self.backend)]):
            if self.native_gqa:
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=True)
                except RuntimeError:
                    self.native_gqa = False
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Model:
    """The whole model at TP 1; with `rank` and `tp`, that rank's shard of it (heads, the
    intermediate size and the LM head's vocabulary split over tp; its own seed)."""

    def __init__(self, torch, args, fast_accum, rank=0, tp=1):
        self.torch, self.args, self.rank, self.tp = torch, args, rank, tp
        h, inter, nh, nkv, layers, vocab, theta = PRESETS[args.model]
        if args.layers > 0:
            layers = min(layers, args.layers)
        self.hd = h // nh
        self.h, self.vocab = h, vocab
        self.inter, self.nh, self.nkv = inter // tp, nh // tp, nkv // tp
        inter, nh, nkv = self.inter, self.nh, self.nkv
        self.fp8 = args.dtype == "fp8"
        self.fast_accum = fast_accum
        dev = self.dev = torch.device("cuda", rank)
        g = torch.Generator(device=dev)
        g.manual_seed(1234 + rank)
        a = 0.02 * 3 ** 0.5

        def weight(n, k):
            w = torch.rand(n, k, device=dev, generator=g) * 2 - 1
            if self.fp8:  # [n, k] codes; _scaled_mm takes its transpose (column major)
                return (w * FP8_MAX).to(torch.float8_e4m3fn), torch.tensor(a / FP8_MAX,
                                                                           device=dev)
            return (w * a).to(torch.bfloat16), None

        qkv_n = (nh + 2 * nkv) * self.hd
        self.layers = []
        for _ in range(layers):
            self.layers.append({
                "qkv": weight(qkv_n, h), "o": weight(h, nh * self.hd),
                "gate_up": weight(2 * inter, h), "down": weight(h, inter),
                "n1": torch.ones(h, device=dev, dtype=torch.bfloat16),
                "n2": torch.ones(h, device=dev, dtype=torch.bfloat16)})
        self.embed = (torch.rand(vocab, h, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        self.final_norm = torch.ones(h, device=dev, dtype=torch.bfloat16)
        self.lm_head = ((torch.rand(vocab // tp, h, device=dev, generator=g) * 2 - 1) * a).to(
            torch.bfloat16)
        self.x_scale = torch.tensor(8.0 / FP8_MAX, device=dev)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.hd, 2, device=dev,
                                                      dtype=torch.float64) / self.hd))
        mode = args.compile_mode
        self.pre = torch.compile(self._pre, mode=mode, fullgraph=True, dynamic=False)
        self.post = torch.compile(self._post, mode=mode, fullgraph=True, dynamic=False)
        self.attention = None

    # The compiled pieces: everything of a block but attention.
    def _linear(self, x, wt):
        t = self.torch
        w, w_scale = wt
        if self.fp8:
            xq = (x.float() / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(t.float8_e4m3fn)
            return t._scaled_mm(xq, w.t(), scale_a=self.x_scale, scale_b=w_scale,
                                out_dtype=t.bfloat16, use_fast_accum=self.fast_accum)
        return x.to(t.bfloat16) @ w.t()

    def _norm(self, x, w):
        t = self.torch
        xf = x.float()
        return xf * t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

    def _rope(self, x, cos, sin):
        t = self.torch
        half = self.hd // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return t.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(t.bfloat16)

    def _pre(self, x, n1, qkv_w, cos, sin, seqs):
        m = x.shape[0]
        length = m // seqs
        qkv = self._linear(self._norm(x, n1), qkv_w)
        qn, kn = self.nh * self.hd, self.nkv * self.hd
        q = self._rope(qkv[:, :qn].view(m, self.nh, self.hd), cos, sin)
        k = self._rope(qkv[:, qn:qn + kn].view(m, self.nkv, self.hd), cos, sin)
        v = qkv[:, qn + kn:].view(m, self.nkv, self.hd)

        def heads_first(y):  # [seqs*L, H, D] -> [seqs, H, L, D]
            return y.view(seqs, length, y.shape[1], self.hd).transpose(1, 2).contiguous()
        return heads_first(q), heads_first(k), heads_first(v)

    def _post(self, attn, x, o_w, n2, gu_w, down_w):
        t = self.torch
        F = t.nn.functional
        m = x.shape[0]
        a = attn.transpose(1, 2).reshape(m, self.nh * self.hd)
        x = (x.float() + self._linear(a, o_w).float()).to(t.bfloat16)
        gu = self._linear(self._norm(x, n2), gu_w)
        act = F.silu(gu[:, :self.inter].float()) * gu[:, self.inter:].float()
        return (x.float() + self._linear(act, down_w).float()).to(t.bfloat16)

    def forward(self, ids, cos, sin, seqs):
        t = self.torch
        x = self.embed[ids]
        for L in self.layers:
            q, k, v = self.pre(x, L["n1"], L["qkv"], cos, sin, seqs)
            x = self.post(self.attention(q, k, v), x, L["o"], L["n2"], L["gate_up"], L["down"])
        m = x.shape[0]
        last = x.view(seqs, m // seqs, self.h)[:, -1]
        normed = self._norm(last, self.final_norm).to(t.bfloat16)
        return normed @ self.lm_head.t()

    def rope_tables(self, seqs, length):
        t = self.torch
        pos = t.arange(length, device=self.dev, dtype=t.float64).repeat(seqs)
        ang = (pos[:, None] * self.inv_freq[None, :]).float()
        return ang.cos()[:, None, :].contiguous(), ang.sin()[:, None, :].contiguous()


def time_attention(torch, model, backend, seqs, length, rounds):
    """SDPA alone: median ms over `rounds` CUDA-event-timed calls, or None if unavailable."""
    q = torch.randn(seqs, model.nh, length, model.hd, device=model.dev, dtype=torch.bfloat16)
    k = torch.randn(seqs, model.nkv, length, model.hd, device=model.dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    att = Attention(torch, backend, model.nh // model.nkv)
    try:
        for _ in range(3):
            att(q, k, v)
        torch.cuda.synchronize()
    except RuntimeError as e:
        print("  sdpa %s unavailable at %dx%d: %s" % (backend, seqs, length,
                                                      str(e).splitlines()[0][:120]))
        return None, att.native_gqa
    times = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        att(q, k, v)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return median(times), att.native_gqa


def run_setting(torch, args, fast_accum, records, attention_choice):
    model = Model(torch, args, fast_accum)
    label = "torch_compiled" + ("_fast_accum" if fast_accum and model.fp8 else "")
    for seqs, length in args.shapes:
        tokens = seqs * length
        backend = attention_choice[(seqs, length)]
        model.attention = Attention(torch, backend, model.nh // model.nkv)
        ids_host = (torch.arange(tokens) * 7919 % model.vocab).to(torch.int64).pin_memory()
        ids = torch.empty(tokens, dtype=torch.int64, device=model.dev)
        cos, sin = model.rope_tables(seqs, length)
        ids.copy_(ids_host)
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(2):  # compile (and autotune) outside the capture
                model.forward(ids, cos, sin, seqs)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model.forward(ids, cos, sin, seqs)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                logits = model.forward(ids, cos, sin, seqs)
            times = []
            for r in range(args.warmup + args.rounds):
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                ids.copy_(ids_host, non_blocking=True)
                graph.replay()
                out = logits.cpu()  # synchronises
                if r >= args.warmup:
                    times.append((time.perf_counter() - t1) * 1000)
            if not bool(torch.isfinite(out.float()).all()):
                raise RuntimeError("non-finite logits at %dx%d" % (seqs, length))
        med = median(times)
        records.append({
            "impl": "torch", "method": label, "model": args.model, "layers": len(model.layers),
            "tp": 1, "dtype": args.dtype, "seqs": seqs, "seq_len": length, "tokens": tokens,
            "median_ms": med, "min_ms": min(times), "max_ms": max(times),
            "rounds": len(times), "tokens_per_sec": tokens / (med / 1000),
            "sdpa_backend": backend, "native_gqa": model.attention.native_gqa,
            "fast_accum": bool(fast_accum and model.fp8), "compile_mode": args.compile_mode,
            "compile_and_first_pass_s": compile_s})
        print("%s %dx%d (sdpa %s): median %.3f ms, %.0f tokens/s" % (
            label, seqs, length, backend, med, tokens / (med / 1000)), flush=True)
        del graph, logits
    del model
    torch.cuda.empty_cache()


class TpModel(Model):
    """One rank's shard at --tp > 1: x holds the rank's rows between blocks (sequence parallel);
    each block gathers them before qkv and gate_up and reduce-scatters after o and down, all
    inside the compiled pieces as functional collectives (what the async-TP pass rewrites)."""

    def __init__(self, torch, args, fast_accum, rank, group):
        import torch.distributed._functional_collectives as funcol
        self.group, self.funcol = group, funcol
        super().__init__(torch, args, fast_accum, rank, args.tp)

    def _gather_linear(self, x, wt):
        """AllGather of the rank's rows (FP8 after quantizing, or BF16), then the GEMM."""
        t = self.torch
        w, w_scale = wt
        if self.fp8:
            xq = (x.float() / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(t.float8_e4m3fn)
            full = self.funcol.all_gather_tensor(xq, 0, self.group)
            return t._scaled_mm(full, w.t(), scale_a=self.x_scale, scale_b=w_scale,
                                out_dtype=t.bfloat16, use_fast_accum=self.fast_accum)
        return self.funcol.all_gather_tensor(x.to(t.bfloat16), 0, self.group) @ w.t()

    def _linear_scatter(self, x, wt):
        return self.funcol.reduce_scatter_tensor(self._linear(x, wt), "sum", 0, self.group)

    def _pre(self, x, n1, qkv_w, cos, sin, seqs):
        qkv = self._gather_linear(self._norm(x, n1), qkv_w)
        m = qkv.shape[0]
        length = m // seqs
        qn, kn = self.nh * self.hd, self.nkv * self.hd
        q = self._rope(qkv[:, :qn].view(m, self.nh, self.hd), cos, sin)
        k = self._rope(qkv[:, qn:qn + kn].view(m, self.nkv, self.hd), cos, sin)
        v = qkv[:, qn + kn:].view(m, self.nkv, self.hd)

        def heads_first(y):
            return y.view(seqs, length, y.shape[1], self.hd).transpose(1, 2).contiguous()
        return heads_first(q), heads_first(k), heads_first(v)

    def _post(self, attn, x, o_w, n2, gu_w, down_w):
        t = self.torch
        F = t.nn.functional
        m = attn.shape[0] * attn.shape[2]
        a = attn.transpose(1, 2).reshape(m, self.nh * self.hd)
        x = (x.float() + self._linear_scatter(a, o_w).float()).to(t.bfloat16)
        gu = self._gather_linear(self._norm(x, n2), gu_w)
        act = F.silu(gu[:, :self.inter].float()) * gu[:, self.inter:].float()
        return (x.float() + self._linear_scatter(act, down_w).float()).to(t.bfloat16)

    def _all_gather(self, x):
        """Eager AllGather (outside the compiled pieces): a stream-ordered NCCL call, which a
        CUDA graph captures (a functional collective's handle would be waited on at replay)."""
        t = self.torch
        out = t.empty((x.shape[0] * self.tp,) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
        t.distributed.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def forward(self, ids, cos, sin, seqs):
        t = self.torch
        rows = ids.shape[0] // self.tp
        x = self.embed[ids[self.rank * rows:(self.rank + 1) * rows]]
        for L in self.layers:
            q, k, v = self.pre(x, L["n1"], L["qkv"], cos, sin, seqs)
            x = self.post(self.attention(q, k, v), x, L["o"], L["n2"], L["gate_up"], L["down"])
        normed = self._norm(x, self.final_norm).to(t.bfloat16)
        last = self._all_gather(normed).view(seqs, -1, self.h)[:, -1]
        return self._all_gather(last @ self.lm_head.t())  # [seqs * tp, vocab / tp]


FUSED_OP_NAMES = ("fused_all_gather_matmul", "fused_all_gather_scaled_matmul",
                  "fused_matmul_reduce_scatter", "fused_scaled_matmul_reduce_scatter")


def count_fused_ops(torch, fn):
    """PyTorch's async-TP ops one call of fn ran (profiler, CPU side)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if any(n in e.key for n in FUSED_OP_NAMES))


def tp_worker(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.tp), LOCAL_RANK=str(rank))
    import torch
    import torch._dynamo
    import torch._inductor.config
    import torch.distributed as dist
    import torch.nn.attention  # noqa: F401
    torch._dynamo.config.cache_size_limit = 64
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD
    if args.async_tp == "on":
        import torch.distributed._symmetric_memory as symm_mem
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required up to torch 2.9, a no-op later
            enable(group.group_name)
        torch._inductor.config._micro_pipeline_tp = True
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.fast_accum]
    if args.dtype == "bf16":
        settings = [False]
    records = []
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(rank),
            "model": args.model, "dtype": args.dtype, "compile_mode": args.compile_mode,
            "tp": args.tp, "async_tp": args.async_tp, "command": " ".join(sys.argv)}
    for fast in settings:
        model = TpModel(torch, args, fast, rank, group)
        label = "torch_compiled" + ("_async_tp" if args.async_tp == "on" else "_tp") + (
            "_fast_accum" if fast and model.fp8 else "")
        for seqs, length in args.shapes:
            tokens = seqs * length
            timed = {}
            for b in BACKENDS if args.sdpa == "auto" else (args.sdpa,):
                ms, _ = time_attention(torch, model, b, seqs, length, 10)
                if ms is not None:
                    timed[b] = ms
            # Every rank uses rank 0's choice: one graph shape on all of them.
            backend = [min(timed, key=timed.get) if timed else None]
            dist.broadcast_object_list(backend, src=0)
            model.attention = Attention(torch, backend[0], model.nh // model.nkv)
            ids_host = (torch.arange(tokens) * 7919 % model.vocab).to(torch.int64).pin_memory()
            ids = torch.empty(tokens, dtype=torch.int64, device=model.dev)
            ids.copy_(ids_host)
            cos, sin = model.rope_tables(seqs, length)
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(2):
                    model.forward(ids, cos, sin, seqs)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                fused = count_fused_ops(torch, lambda: model.forward(ids, cos, sin, seqs))
                graph, logits, graph_error = None, None, None
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        model.forward(ids, cos, sin, seqs)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        logits = model.forward(ids, cos, sin, seqs)
                    graph.replay()  # a graph that cannot replay is caught here
                    logits.cpu()
                except Exception as e:  # replay eagerly, and say so in the record
                    graph_error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                    graph = None
                    torch.cuda.synchronize()
                dist.barrier()
                times = []
                for r in range(args.warmup + args.rounds):
                    torch.cuda.synchronize()
                    dist.barrier()
                    t1 = time.perf_counter()
                    ids.copy_(ids_host, non_blocking=True)
                    if graph is not None:
                        graph.replay()
                        out = logits.cpu()
                    else:
                        out = model.forward(ids, cos, sin, seqs).cpu()
                    if r >= args.warmup:
                        times.append((time.perf_counter() - t1) * 1000)
                if not bool(torch.isfinite(out.float()).all()):
                    raise RuntimeError("non-finite logits at %dx%d" % (seqs, length))
            med = median(times)
            records.append({
                "impl": "torch", "method": label, "model": args.model,
                "layers": len(model.layers), "tp": args.tp, "dtype": args.dtype, "seqs": seqs,
                "seq_len": length, "tokens": tokens, "median_ms": med, "min_ms": min(times),
                "max_ms": max(times), "rounds": len(times),
                "tokens_per_sec": tokens / (med / 1000), "sdpa_backend": backend[0],
                "fast_accum": bool(fast and model.fp8), "compile_mode": args.compile_mode,
                "async_tp": args.async_tp, "async_tp_fused_ops": fused,
                "cuda_graph": graph is not None, "graph_error": graph_error,
                "compile_and_first_pass_s": compile_s})
            if rank == 0:
                print("%s %dx%d (sdpa %s, %d fused async-TP ops a pass, %s): median %.3f ms, "
                      "%.0f tokens/s" % (label, seqs, length, backend[0], fused,
                                         "CUDA graph" if graph is not None else
                                         "eager: " + str(graph_error), med,
                                         tokens / (med / 1000)), flush=True)
                with open(args.out, "w") as f:  # after every shape: a cut run keeps its rows
                    json.dump({"meta": meta, "records": records}, f, indent=1)
            del graph, logits
        del model
        torch.cuda.empty_cache()
    dist.barrier()
    return 0


def main_tp(args):
    import torch.multiprocessing as mp
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_and_exit, args=(tp_worker, r, args, port))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.stderr.write("torch_model_compiled: rank exit codes %s\n"
                         % [p.exitcode for p in procs])
        return 1
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.tp > 1:
        return main_tp(args)
    import torch
    import torch._dynamo
    import torch.nn.attention  # noqa: F401 (sdpa_kernel, SDPBackend)
    # One compiled piece per batch shape and setting: more than dynamo's default of 8.
    torch._dynamo.config.cache_size_limit = 64
    records, attention = [], []
    # Attention backends first, on a model-free shape holder.
    probe = Model.__new__(Model)
    probe.dev = torch.device("cuda", 0)
    _, _, probe.nh, probe.nkv, _, _, _ = PRESETS[args.model]
    probe.hd = PRESETS[args.model][0] // probe.nh
    choice = {}
    for seqs, length in args.shapes:
        timed = {}
        for b in BACKENDS if args.sdpa == "auto" else (args.sdpa,):
            ms, native = time_attention(torch, probe, b, seqs, length, 20)
            if ms is None:
                continue
            timed[b] = ms
            flops = seqs * 4.0 * length * length / 2 * probe.hd * probe.nh
            attention.append({"backend": b, "seqs": seqs, "seq_len": length, "median_ms": ms,
                              "tflops": flops / (ms / 1000) / 1e12, "native_gqa": native,
                              "heads": probe.nh, "kv_heads": probe.nkv, "head_dim": probe.hd})
            if args.attention_only:
                print("sdpa %-9s %dx%d: %.3f ms, %.0f TFLOP/s (causal half)%s" % (
                    b, seqs, length, ms, flops / (ms / 1000) / 1e12,
                    "" if native else ", K/V heads expanded"), flush=True)
        if not timed:
            sys.stderr.write("no SDPA backend runs %dx%d\n" % (seqs, length))
            return 1
        choice[(seqs, length)] = min(timed, key=timed.get)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "model": args.model, "dtype": args.dtype, "compile_mode": args.compile_mode,
            "command": " ".join(sys.argv)}

    def write():  # after every setting: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records,
                       "attention": attention if args.attention_only else []}, f, indent=1)
    write()
    if args.skip_model:
        return 0
    # Fast accumulation first: it is the setting tpserve is compared with when it uses it.
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.fast_accum]
    if args.dtype == "bf16":
        settings = [False]
    for fast in settings:
        run_setting(torch, args, fast, records, choice)
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
