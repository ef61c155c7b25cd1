#!/usr/bin/env python3
"""Writes the checkpoint tpserve-accuracy measures on the GPU host (benchmarks/run_accuracy.sh):
a Llama-3.1-style model saved by transformers itself (LlamaConfig + LlamaForCausalLM,
rope_scaling llama3, BF16 weights, save_pretrained), larger than the CI fixtures of
tests/data/hf but made the same way: their make_hf_fixtures.py builds the config in the RoPE
spelling of the installed transformers and initialises every tensor with a spread (sharp
attention, logits of a few units; see its module comment), seeded.

  python3 benchmarks/make_accuracy_checkpoint.py --out DIR [--hidden 512 --layers 8 ...]

--dry-run prints the config and the weight count without torch.
"""

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "data", "hf"))
import make_hf_fixtures as fixtures  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--max-positions", type=int, default=512)
    ap.add_argument("--original-max-positions", type=int, default=64,
                    help="rope_scaling original_max_position_embeddings (prompts longer than "
                    "this reach the scaled frequencies)")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--dry-run", action="store_true", help="print the plan without torch")
    args = ap.parse_args(argv)
    if min(args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, args.intermediate,
           args.vocab, args.max_positions, args.original_max_positions) < 1:
        ap.error("every size must be >= 1")
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    return args


def fields_of(args):
    return dict(vocab_size=args.vocab, hidden_size=args.hidden,
                intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.head_dim, max_position_embeddings=args.max_positions,
                rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mlp_bias=False,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)


def scaling_of(args):
    return dict(fixtures.LLAMA3_SCALING, original_max_position_embeddings=args.original_max_positions)


def main(argv=None):
    args = parse_args(argv)
    fields, scaling = fields_of(args), scaling_of(args)
    n = fixtures.weight_count(fields)
    print("llama3.1-style: %s; rope_theta 500000, rope_scaling %s; %d BF16 weights (%.1f MB)"
          % (fields, scaling, n, 2 * n / 1e6), flush=True)
    if args.dry_run:
        return 0
    import shutil

    import safetensors
    import torch
    import transformers
    from safetensors import safe_open
    torch.use_deterministic_algorithms(True)
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    config = fixtures.make_config(transformers, fields, 500000.0, scaling)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config)
    fixtures.init_weights(torch, model, config, gen)
    model.to(torch.bfloat16)
    fixtures.save(model, args.out)
    with safe_open(os.path.join(args.out, "model.safetensors"), "pt") as f:
        dtypes = sorted({str(f.get_tensor(k).dtype) for k in f.keys()})
    if dtypes != ["torch.bfloat16"]:
        raise RuntimeError("%s: saved dtypes %s, want BF16 only" % (args.out, dtypes))
    manifest = {"generator": "benchmarks/make_accuracy_checkpoint.py",
                "argv": sys.argv[1:] if argv is None else argv, "args": vars(args),
                "versions": {"python": platform.python_version(), "torch": torch.__version__,
                             "transformers": transformers.__version__,
                             "safetensors": safetensors.__version__}}
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print("wrote %s (transformers %s)" % (args.out, transformers.__version__), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
