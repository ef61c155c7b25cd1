#!/usr/bin/env python3
"""Decode peer of tpserve-bench-decode: HuggingFace transformers' generate on the same shapes.

A LlamaForCausalLM of a tpserve preset's shape (random BF16 weights made on the GPU; the
values do not matter for timing), run as its users run it for speed: a static KV cache, which
makes generate compile its decoding step with torch.compile (CompileConfig, mode
reduce-overhead: CUDA graphs), SDPA attention. For every batch size B, B prompts of --context tokens are generated greedily
with min_new_tokens = max_new_tokens (no early stop), and the time per output token of
the decode phase is

    TPOT = (T(1 + N) - T(1)) / N

where T(n) is the host-timed median of generate(max_new_tokens=n): the prefill and the
first token cancel. The comparison with tpserve is its decode step time at the same batch
and context (tpserve-bench-decode --dtype bf16), both measured in one run.

Writes one JSON document (--out) with a record per batch.
"""

import os

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_name] = _value

import argparse
import json
import statistics
import sys
import time

PRESETS = {
    # hidden, intermediate, heads, kv heads, layers, vocab, rope theta
    "tiny": (512, 512, 8, 4, 2, 1024, 10000.0),
    "llama3-8b": (4096, 14336, 32, 8, 32, 128256, 500000.0),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="llama3-8b",
                   help="tpserve preset whose shape the peer takes")
    p.add_argument("--batches", default="1,64",
                   help="comma-separated batch sizes (each a case)")
    p.add_argument("--context", type=int, default=1024,
                   help="prompt tokens per sequence (the cached context decode starts from)")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="N: decode tokens timed per generate call")
    p.add_argument("--rounds", type=int, default=3, help="timed generate calls per (batch, n)")
    p.add_argument("--no-compile", action="store_true",
                   help="eager forward (a labelled extra row, not the peer of record)")
    p.add_argument("--out", default="hf-generate-peer.json", help="JSON output")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches: {args.batches!r} is not a comma-separated list of integers")
    if any(b < 1 for b in args.batches) or args.context < 1 or args.new_tokens < 1:
        p.error("--batches, --context and --new-tokens must be positive")
    return args


def main(argv):
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv, layers, vocab, theta = PRESETS[args.model]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab,
                      rope_theta=theta, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    print(f"model built on the GPU in {time.time() - t0:.1f} s "
          f"(torch {torch.__version__}, transformers {transformers.__version__})", flush=True)
    gen = model.generation_config
    gen.cache_implementation = "static"
    gen.do_sample = False
    gen.eos_token_id = None
    gen.pad_token_id = 0
    # generate compiles the decoding step itself when the cache is static (transformers'
    # documented path: CompileConfig, mode reduce-overhead = CUDA graphs); compiling
    # model.forward by hand as well breaks its static cache updates under CUDA graphs.
    if args.no_compile:
        gen.disable_compile = True
    else:
        from transformers import CompileConfig
        gen.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")

    def timed_generate(ids, n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, generation_config=gen)
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return time.perf_counter() - t

    records = []
    for b in args.batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        ids = torch.randint(1, vocab, (b, args.context), device="cuda", generator=g)
        t = time.time()
        for _ in range(2):  # compiles (prefill and decode shapes) and warms up
            timed_generate(ids, 1 + args.new_tokens)
        print(f"batch {b}: warm-up (compile) {time.time() - t:.1f} s", flush=True)
        t1 = [timed_generate(ids, 1) for _ in range(args.rounds)]
        tn = [timed_generate(ids, 1 + args.new_tokens) for _ in range(args.rounds)]
        tpot_ms = (statistics.median(tn) - statistics.median(t1)) / args.new_tokens * 1e3
        rec = {"batch": b, "context": args.context, "tpot_ms": tpot_ms,
               "t1_s": t1, "tn_s": tn, "new_tokens": args.new_tokens}
        records.append(rec)
        print(f"batch {b:>4} at context {args.context}: TPOT {tpot_ms:.3f} ms "
              f"(generate of 1 token {statistics.median(t1) * 1e3:.1f} ms, of "
              f"{1 + args.new_tokens} {statistics.median(tn) * 1e3:.1f} ms)", flush=True)
        del ids
        torch.cuda.empty_cache()
    doc = {"meta": {"benchmark": "decode_peer", "impl": "transformers.generate",
                    "model": args.model, "dtype": "bf16", "static_cache": True,
                    "compile": None if args.no_compile else
                    "generate's CompileConfig(mode=reduce-overhead, fullgraph=True)",
                    "attention": "sdpa", "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name()},
           "records": records}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
