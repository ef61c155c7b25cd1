#!/usr/bin/env python3
"""PyTorch peer of tpserve-bench-model: the same Llama prefill in PyTorch.

One process per GPU (NCCL), tensor parallel and sequence parallel like
tpserve's CUDA model (engine/cuda_model.h): per block, RMSNorm on the rank's
row shard, AllGather of the FP8 (or BF16) activations and the column-parallel
QKV GEMM (torch._scaled_mm with per-tensor scales, or torch.mm), RoPE, causal
attention per sequence (scaled_dot_product_attention with GQA), the
row-parallel O GEMM and ReduceScatter, residual add, RMSNorm, gate/up,
SwiGLU, down, ReduceScatter; then the final norm, an AllGather, each
sequence's last row and the LM head. Random weights of the model's shapes
(the numbers are not compared with tpserve's: this measures speed).

  python3 benchmarks/torch_model.py --model llama3-70b --layers 0 --tp 2 \\
      --batches 8x1024 16x1024 --rounds 10 --out torch-model.json

Each batch runs --warmup times, then --rounds timed forward passes (host
clock around the whole pass after a barrier, as tpserve-bench-model does: the
token ids and positions uploaded from the host, the logits downloaded to it;
eager: attention per sequence cannot be one CUDA graph across batch shapes).
Rank 0 writes records with impl "torch", method "torch_eager".
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

from torch_peer import free_port, run_and_exit

PRESETS = {  # hidden, intermediate, heads, kv heads, layers, vocab, rope theta
    "tiny": (512, 512, 8, 4, 2, 1024, 10000.0),
    "llama3-8b": (4096, 14336, 32, 8, 32, 128256, 500000.0),
    "llama3-70b": (8192, 28672, 64, 8, 80, 128256, 500000.0),
}
FP8_MAX = 448.0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-70b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="blocks (0 = all of the preset's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--batches", nargs="+", default=["8x1024", "16x1024"],
                    help="SEQSxLEN batch shapes")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="torch-model.json")
    ap.add_argument("--timeout", type=int, default=600, help="NCCL timeout, seconds")
    args = ap.parse_args(argv)
    args.shapes = parse_shapes(ap, args.batches)
    return args


def parse_shapes(ap, batches):
    """--batches' SEQSxLEN values as (seqs, len) pairs; ap.error names a bad one."""
    shapes = []
    for b in batches:
        try:
            seqs, length = (int(v) for v in b.split("x"))
        except ValueError:
            ap.error("--batches: %r is not SEQSxLEN" % b)
        if seqs < 1 or length < 1:
            ap.error("--batches: %r must be positive" % b)
        shapes.append((seqs, length))
    return shapes


class Model:
    def __init__(self, torch, rank, tp, args):
        self.torch, self.rank, self.tp, self.args = torch, rank, tp, args
        h, inter, nh, nkv, layers, vocab, theta = PRESETS[args.model]
        if args.layers > 0:
            layers = min(layers, args.layers)
        self.h, self.inter, self.nh, self.nkv, self.vocab, self.theta = h, inter, nh, nkv, vocab, theta
        self.hd = h // nh
        self.nh_l, self.nkv_l, self.inter_l = nh // tp, nkv // tp, inter // tp
        dev = torch.device("cuda", rank)
        self.dev = dev
        self.fp8 = args.dtype == "fp8"
        g = torch.Generator(device=dev)
        g.manual_seed(1234 + rank)
        a = 0.02 * 3 ** 0.5

        def weight(n, k):
            w = (torch.rand(n, k, device=dev, generator=g) * 2 - 1)
            if self.fp8:
                return (w * FP8_MAX).to(torch.float8_e4m3fn), torch.tensor(a / FP8_MAX, device=dev)
            return (w * a).to(torch.bfloat16), None

        qkv_n = (self.nh_l + 2 * self.nkv_l) * self.hd
        self.layers = []
        for _ in range(layers):
            self.layers.append({
                "qkv": weight(qkv_n, h), "o": weight(h, self.nh_l * self.hd),
                "gate_up": weight(2 * self.inter_l, h), "down": weight(h, self.inter_l),
                "n1": torch.ones(h, device=dev, dtype=torch.bfloat16),
                "n2": torch.ones(h, device=dev, dtype=torch.bfloat16)})
        self.embed = (torch.rand(vocab, h, device=dev, generator=g) * 2 - 1).to(torch.bfloat16)
        self.final_norm = torch.ones(h, device=dev, dtype=torch.bfloat16)
        self.lm_head = ((torch.rand(vocab // tp, h, device=dev, generator=g) * 2 - 1) * a).to(
            torch.bfloat16)
        self.x_scale = torch.tensor(8.0 / FP8_MAX, device=dev)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, device=dev, dtype=torch.float64) /
                               self.hd))
        self.inv_freq = inv

    def rmsnorm(self, x, w):
        t = self.torch
        xf = x.float()
        y = xf * t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
        return y

    def linear(self, x, wt):
        """x: FP32/BF16 activations [rows, k]; returns BF16 [rows, n]."""
        t = self.torch
        w, w_scale = wt
        if self.fp8:
            xq = (x.float() / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(t.float8_e4m3fn)
            return t._scaled_mm(xq, w.t(), scale_a=self.x_scale, scale_b=w_scale,
                                out_dtype=t.bfloat16)
        return x.to(t.bfloat16) @ w.t()

    def all_gather(self, x):
        t, dist = self.torch, self.torch.distributed
        out = t.empty((x.shape[0] * self.tp,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        if x.dtype == t.float8_e4m3fn:  # NCCL moves bytes
            dist.all_gather_into_tensor(out.view(t.uint8), x.contiguous().view(t.uint8))
        else:
            dist.all_gather_into_tensor(out, x.contiguous())
        return out

    def reduce_scatter(self, x):
        t, dist = self.torch, self.torch.distributed
        out = t.empty((x.shape[0] // self.tp,) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous())
        return out

    def rope(self, x, pos):
        """x: [tokens, heads, hd] BF16 -> rotated (rotate_half), angles in FP32."""
        t = self.torch
        ang = (pos.double()[:, None] * self.inv_freq[None, :]).float()
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = x[..., : self.hd // 2].float(), x[..., self.hd // 2:].float()
        return t.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(t.bfloat16)

    def forward(self, ids, pos, cu):
        t = self.torch
        F = t.nn.functional
        m = ids.shape[0]
        rows = m // self.tp
        x = self.embed[ids[self.rank * rows:(self.rank + 1) * rows]]
        for L in self.layers:
            hq = self.rmsnorm(x, L["n1"])
            if self.fp8:
                hq = (hq / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(t.float8_e4m3fn)
                full = self.all_gather(hq)
                qkv = t._scaled_mm(full, L["qkv"][0].t(), scale_a=self.x_scale,
                                   scale_b=L["qkv"][1], out_dtype=t.bfloat16)
            else:
                qkv = self.linear(self.all_gather(hq.to(t.bfloat16)), L["qkv"])
            qn, kn = self.nh_l * self.hd, self.nkv_l * self.hd
            q = self.rope(qkv[:, :qn].view(m, self.nh_l, self.hd), pos)
            k = self.rope(qkv[:, qn:qn + kn].view(m, self.nkv_l, self.hd), pos)
            v = qkv[:, qn + kn:].view(m, self.nkv_l, self.hd)
            attn = t.empty(m, self.nh_l, self.hd, device=self.dev, dtype=t.bfloat16)
            for s in range(len(cu) - 1):
                a, b = cu[s], cu[s + 1]
                if b <= a:
                    continue
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                    v[a:b].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
                attn[a:b] = o[0].transpose(0, 1)
            o = self.reduce_scatter(self.linear(attn.view(m, -1), L["o"]))
            x = (x.float() + o.float()).to(t.bfloat16)
            h2 = self.rmsnorm(x, L["n2"])
            if self.fp8:
                h2 = (h2 / self.x_scale).clamp(-FP8_MAX, FP8_MAX).to(t.float8_e4m3fn)
                gu = t._scaled_mm(self.all_gather(h2), L["gate_up"][0].t(),
                                  scale_a=self.x_scale, scale_b=L["gate_up"][1],
                                  out_dtype=t.bfloat16)
            else:
                gu = self.linear(self.all_gather(h2.to(t.bfloat16)), L["gate_up"])
            act = F.silu(gu[:, : self.inter_l].float()) * gu[:, self.inter_l:].float()
            d = self.reduce_scatter(self.linear(act, L["down"]))
            x = (x.float() + d.float()).to(t.bfloat16)
        normed = self.rmsnorm(x, self.final_norm).to(t.bfloat16)
        full = self.all_gather(normed)
        last = full[t.tensor([c - 1 for c in cu[1:]], device=self.dev)]
        logits = last @ self.lm_head.t()
        return self.all_gather(logits.contiguous())


def worker(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.tp), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=args.timeout))
    model = Model(torch, rank, args.tp, args)
    records = []
    for seqs, length in args.shapes:
        tokens = seqs * length
        m = -(-tokens // args.tp) * args.tp
        # On the host, as a server holds a batch: the timed pass uploads them
        # and downloads the logits, as tpserve-bench-model's Forward() does.
        ids_host = torch.arange(m) * 7919 % model.vocab
        pos_host = torch.cat([torch.arange(length)] * seqs + [torch.arange(m - tokens)])
        cu = [i * length for i in range(seqs + 1)] + ([m] if m > tokens else [])
        times = []
        with torch.no_grad():
            for r in range(args.warmup + args.rounds):
                torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                ids = ids_host.to(model.dev)
                pos = pos_host.to(model.dev)
                logits = model.forward(ids, pos, cu).cpu().float()
                torch.cuda.synchronize()
                del logits
                if r >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        med = times[len(times) // 2] if len(times) % 2 else 0.5 * (
            times[len(times) // 2 - 1] + times[len(times) // 2])
        records.append({
            "impl": "torch", "method": "torch_eager", "model": args.model,
            "layers": len(model.layers), "tp": args.tp, "dtype": args.dtype, "seqs": seqs,
            "seq_len": length, "tokens": tokens, "median_ms": med, "min_ms": times[0],
            "max_ms": times[-1], "rounds": len(times), "tokens_per_sec": tokens / (med / 1000)})
        if rank == 0:
            print("torch %d tokens (%dx%d): median %.3f ms, %.0f tokens/s" % (
                tokens, seqs, length, med, tokens / (med / 1000)), flush=True)
    if rank == 0:
        meta = {"torch": torch.__version__, "model": args.model, "layers": len(model.layers),
                "tp": args.tp, "dtype": args.dtype, "command": " ".join(sys.argv)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch.multiprocessing as mp
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_and_exit, args=(worker, r, args, port))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        sys.stderr.write("torch_model: rank exit codes %s\n" % [p.exitcode for p in procs])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
