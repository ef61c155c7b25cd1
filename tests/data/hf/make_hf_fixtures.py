#!/usr/bin/env python3
"""Writes the HuggingFace fixtures of tests/hf_checkpoint_test.cc and
tests/gpu_hf_checkpoint_test.py: small Llama checkpoints saved by transformers
itself (LlamaConfig + LlamaForCausalLM, save_pretrained: config.json,
model.safetensors with BF16 weights, generation_config.json) and, next to each
one, reference.json with what transformers computes from it:

  prompts      token-id lists (lengths --lengths), random with --seed
  last_logits  per prompt, the FP32 logits of its last position (the model
               loaded in float32 from the saved BF16 weights, eager attention),
               rounded to --decimals decimals
  top2_gap     per prompt, largest minus second-largest logit
  greedy       {prompt, tokens}: model.generate(do_sample=False) of
               --new-tokens tokens, the same as argmax over a full forward
               pass at every step (checked here), with the smallest top-2 gap
               along the way

Runs where torch and transformers are (the GPU host; CPU is enough):
  python3 tests/data/hf/make_hf_fixtures.py --out tests/data/hf

Why the init is not transformers' own: its default (N(0, 0.02) weights, norms
of 1) gives near-uniform logits on a model this small, where a missing RoPE
scaling or a wrong head_dim would still land inside any tolerance. The script
re-initialises every tensor explicitly (see init_weights) so that attention is
sharp and the logits spread over several units; it records in manifest.json,
per checkpoint, how far the logits move when the model is read with a wrong
RoPE (the tests' tolerance must lie well below that) and how far a BF16
activation run of transformers lands (the tolerance must lie above that).
Prompts are redrawn until their last position's top-2 gap is at least
--min-gap; the greedy prompt is the one, of up to --greedy-tries, whose
smallest top-2 gap over the --new-tokens steps is largest (drawing stops once
it reaches --min-gap): a near tie would make "the same top-1" depend on
rounding rather than on correctness. --min-gap (0.5, logits of a few units)
is chosen against BF16 activations (a BF16 engine lands a few hundredths of
the logits' norm away, i.e. about 0.1 per logit); manifest.json records
whether transformers' own BF16-activation run keeps every top-1 and the
greedy tokens.

Shapes: every checkpoint has head_dim 64 (the smaller of the two head sizes
the CUDA attention kernels take), 2 layers, vocab 128, intermediate 64,
max_position_embeddings 128, and at least 2 KV heads so that TP 2 can shard
them (neither engine replicates KV heads). GQA with 2 KV heads then takes 4
query heads, 256 wide; on hidden 128 (kept small: about 0.5 MB of weights a
checkpoint) head_dim is not hidden / heads there either. transformers writes
head_dim into every config.json.
  llama2             MHA (2 heads, 2 KV heads, hidden 128: head_dim 64 =
                     hidden / heads), rope_theta 10000
  llama3             GQA (4 heads, 2 KV heads, hidden 128, head_dim 64),
                     rope_theta 500000
  llama31            llama3 + rope_scaling {rope_type llama3, factor 8,
                     low_freq_factor 1, high_freq_factor 4,
                     original_max_position_embeddings 32}
  llama31-respelled  llama31's files with config.json rewritten in the other
                     spelling than the one this transformers writes
                     (rope_scaling + rope_theta <-> transformers 5's
                     rope_parameters); same weights and references
  tied               llama3 with tie_word_embeddings (no lm_head tensor)
  head-dim           MHA (2 heads, 2 KV heads) on hidden 96 with head_dim 64:
                     hidden / heads would be 48, which no kernel takes and
                     whose q/k/v shapes do not fit the tensors
"""

import argparse
import json
import os
import platform
import shutil
import sys

NAMES = ["llama2", "llama3", "llama31", "llama31-respelled", "tied", "head-dim"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory that gets one folder per checkpoint "
                    "and manifest.json")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 7, 33, 100],
                    help="prompt lengths of the logits references")
    ap.add_argument("--greedy-len", type=int, default=12, help="prompt length of the greedy run")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens generated")
    ap.add_argument("--decimals", type=int, default=4, help="logits rounded to this many decimals")
    ap.add_argument("--min-gap", type=float, default=0.5,
                    help="smallest top-2 logit gap accepted for a prompt's last position and "
                    "along the greedy run (redrawn otherwise)")
    ap.add_argument("--tries", type=int, default=200, help="redraws per prompt at most")
    ap.add_argument("--greedy-tries", type=int, default=4096,
                    help="greedy prompts drawn at most in search of one whose every step clears "
                    "--min-gap")
    ap.add_argument("--only", nargs="*", choices=NAMES, default=None,
                    help="write only these checkpoints (default: all)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (configs, shapes) without torch and exit")
    args = ap.parse_args(argv)
    if (any(n < 1 for n in args.lengths) or args.greedy_len < 1 or args.new_tokens < 1
            or args.tries < 1 or args.greedy_tries < 1):
        ap.error("lengths, --greedy-len, --new-tokens, --tries and --greedy-tries must be >= 1")
    if max(args.lengths + [args.greedy_len + args.new_tokens]) > MAX_POSITIONS:
        ap.error("a prompt (plus the greedy tokens) exceeds max_position_embeddings %d"
                 % MAX_POSITIONS)
    return args


MAX_POSITIONS = 128
VOCAB = 128
GREEDY_BATCH = 256
KERNEL_HEAD_DIM = 64  # engine/cuda_model.cc: the CUDA attention kernels take 64 and 128
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def variants():
    """name -> (description, LlamaConfig fields without RoPE, rope_theta, rope scaling or None)."""
    base = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=MAX_POSITIONS,
                rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mlp_bias=False,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
    return {
        "llama2": ("Llama 2 style: MHA 2/2, head_dim 64 = hidden / heads, rope_theta 10000",
                   dict(base, num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-6),
                   10000.0, None),
        "llama3": ("Llama 3.0 style: GQA 4/2, head_dim 64, rope_theta 500000", dict(base),
                   500000.0, None),
        "llama31": ("Llama 3.1 style: llama3 RoPE scaling (factor 8, original 32 positions)",
                    dict(base), 500000.0, dict(LLAMA3_SCALING)),
        "tied": ("tie_word_embeddings: no lm_head tensor", dict(base, tie_word_embeddings=True),
                 500000.0, None),
        "head-dim": ("explicit head_dim 64 on hidden 96, MHA 2/2 (hidden / heads = 48)",
                     dict(base, hidden_size=96, num_attention_heads=2, num_key_value_heads=2),
                     500000.0, None),
    }


def weight_count(fields):
    """Parameters of a LlamaForCausalLM with these fields (no biases)."""
    h, i, v = fields["hidden_size"], fields["intermediate_size"], fields["vocab_size"]
    hd = fields.get("head_dim") or h // fields["num_attention_heads"]
    q, kv = fields["num_attention_heads"] * hd, fields["num_key_value_heads"] * hd
    layer = h * (2 * q + 2 * kv) + 3 * h * i + 2 * h
    return (fields["num_hidden_layers"] * layer + h
            + v * h * (1 if fields["tie_word_embeddings"] else 2))


def tf_major(transformers):
    return int(transformers.__version__.split(".")[0])


def make_config(transformers, fields, theta, scaling):
    """A LlamaConfig in the RoPE spelling this transformers version takes."""
    fields = dict(fields)
    if tf_major(transformers) >= 5:
        rope = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            rope.update(scaling)
        fields["rope_parameters"] = rope
    else:
        fields["rope_theta"] = theta
        fields["rope_scaling"] = dict(scaling) if scaling else None
    fields["attn_implementation"] = "eager"
    return transformers.LlamaConfig(**fields)


def respell(config_json):
    """config.json text in the other RoPE spelling: rope_theta + rope_scaling <->
    rope_parameters. Returns (new dict, spelling written)."""
    c = dict(config_json)
    if c.get("rope_parameters") is not None:
        rope = dict(c.pop("rope_parameters"))
        c["rope_theta"] = rope.pop("rope_theta")
        kind = rope.get("rope_type", "default")
        c["rope_scaling"] = None if kind == "default" else rope
        return c, "rope_scaling"
    rope = {"rope_type": "default", "rope_theta": c.pop("rope_theta", 10000.0)}
    scaling = c.pop("rope_scaling", None)
    if scaling:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        rope.update(scaling)
    c["rope_parameters"] = rope
    return c, "rope_parameters"


def spelling_of(config_json):
    if config_json.get("rope_parameters") is not None:
        return "rope_parameters"
    return "rope_scaling" if "rope_scaling" in config_json else "rope_theta only"


def init_weights(torch, model, config, gen):
    """Explicit init with a spread (see the module comment): embeddings N(0, 1);
    q/k N(0, (2/sqrt(H))^2) (attention scores of several units: RoPE decides
    where attention goes); v, o, MLP N(0, 1/fan_in); LM head N(0, (3/sqrt(H))^2)
    (logits of a few units); every RMSNorm weight U(0.8, 1.2)."""
    h = config.hidden_size
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            std = None
        elif "embed_tokens" in name:
            std = 1.0
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            std = 2.0 / h ** 0.5
        elif name == "lm_head.weight":
            std = 3.0 / h ** 0.5
        elif name.endswith(".weight"):
            std = 1.0 / p.shape[1] ** 0.5
        else:
            raise RuntimeError("unexpected parameter %s" % name)
        with torch.no_grad():
            if std is None:
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def save(model, directory):
    try:
        model.save_pretrained(directory, safe_serialization=True)
    except TypeError:  # transformers 5: safetensors only, no such argument
        model.save_pretrained(directory)


def load_f32(torch, transformers, directory, config=None):
    kw = {"dtype": torch.float32} if tf_major(transformers) >= 5 else {"torch_dtype": torch.float32}
    kw["attn_implementation"] = "eager"
    if config is not None:
        kw["config"] = config
    model = transformers.LlamaForCausalLM.from_pretrained(directory, **kw)
    model.eval()
    return model


def last_logits(torch, model, ids):
    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.long)).logits
    return out[0, -1].float()


def gap(torch, logits):
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def rel_err(torch, a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def draw_prompt(torch, model, gen, length, min_gap, tries):
    """A random prompt whose last position's top-2 gap is at least min_gap (or the best of
    `tries`)."""
    best = None
    for _ in range(tries):
        ids = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        g = gap(torch, last_logits(torch, model, ids))
        if best is None or g > best[1]:
            best = (ids, g)
        if g >= min_gap:
            break
    return best


def greedy_by_recompute(torch, model, ids, n):
    """n greedy tokens by a full forward pass per step, and each step's top-2 gap."""
    seq, tokens, gaps = list(ids), [], []
    for _ in range(n):
        logits = last_logits(torch, model, seq)
        tokens.append(int(torch.argmax(logits)))
        gaps.append(gap(torch, logits))
        seq.append(tokens[-1])
    return tokens, gaps


def draw_greedy(torch, model, gen, args):
    """The greedy prompt whose smallest top-2 gap over the run is largest, of up to
    args.greedy_tries drawn in batches of GREEDY_BATCH (all of --greedy-len tokens, so a batch
    stays rectangular and needs no mask); stops after a batch whose best clears args.min_gap.
    The batch only picks the prompt: its gaps are recomputed below one prompt at a time."""
    best, best_min, drawn = None, -1.0, 0
    while drawn < args.greedy_tries and best_min < args.min_gap:
        n = min(GREEDY_BATCH, args.greedy_tries - drawn)
        drawn += n
        ids = torch.randint(0, VOCAB, (n, args.greedy_len), generator=gen)
        seq, mins = ids, torch.full((n,), float("inf"))
        with torch.no_grad():
            for _ in range(args.new_tokens):
                logits = model(seq).logits[:, -1].float()
                top = torch.topk(logits, 2, dim=-1).values
                mins = torch.minimum(mins, top[:, 0] - top[:, 1])
                seq = torch.cat([seq, torch.argmax(logits, dim=-1, keepdim=True)], dim=1)
        i = int(torch.argmax(mins))
        if float(mins[i]) > best_min:
            best, best_min = ids[i].tolist(), float(mins[i])
    ids = best
    tokens, gaps = greedy_by_recompute(torch, model, ids, args.new_tokens)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], dtype=torch.long),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=args.new_tokens,
                             pad_token_id=0)
    generated = out[0, len(ids):].tolist()
    if generated != tokens:
        raise RuntimeError("generate() %s differs from argmax recompute %s" % (generated, tokens))
    return ids, tokens, gaps


def wrong_rope_config(transformers, name, fields, theta, scaling):
    """The config a reader with a RoPE bug would see, or None where there is none to make."""
    if name == "llama31":
        return "rope_scaling dropped", make_config(transformers, fields, theta, None)
    if name == "llama2":
        return "rope_theta 500000 instead of 10000", make_config(transformers, fields, 500000.0,
                                                                 None)
    return "rope_theta 10000 instead of 500000", make_config(transformers, fields, 10000.0, None)


def write_checkpoint(torch, transformers, args, name, spec, out_dir, seed):
    description, fields, theta, scaling = spec
    directory = os.path.join(out_dir, name)
    if os.path.exists(directory):
        shutil.rmtree(directory)
    config = make_config(transformers, fields, theta, scaling)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    init_weights(torch, model, config, gen)
    model.to(torch.bfloat16)
    save(model, directory)

    from safetensors import safe_open
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = sorted({str(f.get_tensor(k).dtype) for k in keys})
    if fields["tie_word_embeddings"] == ("lm_head.weight" in keys):
        raise RuntimeError("%s: lm_head.weight present=%s with tie_word_embeddings=%s"
                           % (name, "lm_head.weight" in keys, fields["tie_word_embeddings"]))
    if dtypes != ["torch.bfloat16"]:
        raise RuntimeError("%s: saved dtypes %s, want BF16 only" % (name, dtypes))

    ref = load_f32(torch, transformers, directory)
    prompts, logits, gaps = [], [], []
    for length in args.lengths:
        ids, g = draw_prompt(torch, ref, gen, length, args.min_gap, args.tries)
        prompts.append(ids)
        logits.append(last_logits(torch, ref, ids))
        gaps.append(g)
    g_ids, g_tokens, g_gaps = draw_greedy(torch, ref, gen, args)

    # How far the tolerance sits from a wrong reading and from BF16 activations.
    what, wrong_cfg = wrong_rope_config(transformers, name, fields, theta, scaling)
    wrong = load_f32(torch, transformers, directory, wrong_cfg)
    bf16 = load_f32(torch, transformers, directory).to(torch.bfloat16)
    sensitivity = {"what": what,
                   "rel_err": [round(rel_err(torch, last_logits(torch, wrong, p), l), 4)
                               for p, l in zip(prompts, logits)]}
    bf16_logits = [last_logits(torch, bf16, p) for p in prompts]
    bf16_err = [round(rel_err(torch, b, l), 5) for b, l in zip(bf16_logits, logits)]
    bf16_top1 = all(int(torch.argmax(b)) == int(torch.argmax(l))
                    for b, l in zip(bf16_logits, logits))
    bf16_greedy = greedy_by_recompute(torch, bf16, g_ids, args.new_tokens)[0] == g_tokens

    with open(os.path.join(directory, "config.json")) as f:
        config_json = json.load(f)
    if config_json.get("head_dim") != KERNEL_HEAD_DIM:
        raise RuntimeError("%s: config.json head_dim %s, want %d (the CUDA attention kernels')"
                           % (name, config_json.get("head_dim"), KERNEL_HEAD_DIM))
    reference = {
        "prompts": prompts,
        "last_logits": [[round(float(x), args.decimals) for x in l] for l in logits],
        "top1": [int(torch.argmax(l)) for l in logits],
        "top2_gap": [round(g, 4) for g in gaps],
        "greedy": {"prompt": g_ids, "tokens": g_tokens, "min_top2_gap": round(min(g_gaps), 4)},
    }
    with open(os.path.join(directory, "reference.json"), "w") as f:
        json.dump(reference, f, separators=(",", ":"))
        f.write("\n")
    entry = {"name": name, "description": description, "seed": seed,
             "rope_spelling": spelling_of(config_json), "tensors": sorted(keys),
             "prompt_top2_gap": reference["top2_gap"],
             "greedy_min_top2_gap": reference["greedy"]["min_top2_gap"],
             "wrong_rope": sensitivity, "bf16_activations_rel_err": bf16_err,
             "bf16_activations_same_top1": bf16_top1,
             "bf16_activations_same_greedy": bf16_greedy}
    print("%-18s %s; wrong rope rel err %s; bf16 activations %s (same top-1 %s, same greedy %s); "
          "gaps %s; greedy min gap %.3f"
          % (name, entry["rope_spelling"], sensitivity["rel_err"], bf16_err, bf16_top1,
             bf16_greedy, reference["top2_gap"], min(g_gaps)), flush=True)
    return entry, ref, prompts, logits


def write_respelled(torch, transformers, out_dir, source_entry, ref_logits, prompts):
    src = os.path.join(out_dir, "llama31")
    directory = os.path.join(out_dir, "llama31-respelled")
    if os.path.exists(directory):
        shutil.rmtree(directory)
    shutil.copytree(src, directory)
    with open(os.path.join(src, "config.json")) as f:
        config_json = json.load(f)
    new, spelling = respell(config_json)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(new, f, indent=2, sort_keys=True)
        f.write("\n")
    # Whether this transformers reads the other spelling back to the same model (transformers 5
    # still reads rope_scaling; 4.x ignores rope_parameters): recorded, not required.
    try:
        again = load_f32(torch, transformers, directory)
        errs = [rel_err(torch, last_logits(torch, again, p), l)
                for p, l in zip(prompts, ref_logits)]
        reads = max(errs) < 1e-6
    except Exception as e:  # noqa: BLE001 - recorded in the manifest
        reads = "error: %s" % e
    entry = dict(source_entry, name="llama31-respelled", rope_spelling=spelling,
                 description="llama31's files, config.json rewritten to the %s spelling" % spelling,
                 transformers_reads_it_back=reads)
    print("%-18s %s (transformers reads it back: %s)" % ("llama31-respelled", spelling, reads),
          flush=True)
    return entry


def main(argv=None):
    args = parse_args(argv)
    names = args.only or NAMES
    specs = variants()
    if args.dry_run:
        for n in names:
            spec = specs.get(n if n != "llama31-respelled" else "llama31")
            print("%-18s %s; rope_theta %g, scaling %s; %d BF16 weights (%d bytes); %s"
                  % (n, spec[0], spec[2], spec[3], weight_count(spec[1]),
                     2 * weight_count(spec[1]), spec[1]))
        return 0
    import safetensors
    import tokenizers  # noqa: F401 - recorded only
    import torch
    import transformers
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "safetensors": safetensors.__version__}
    print("versions: %s" % versions, flush=True)
    entries = []
    llama31 = None
    for i, n in enumerate(NAMES):
        if n not in names:
            continue
        if n == "llama31-respelled":
            if llama31 is None:
                raise SystemExit("llama31-respelled needs llama31 in the same run")
            entries.append(write_respelled(torch, transformers, args.out, *llama31))
            continue
        entry, _, prompts, logits = write_checkpoint(torch, transformers, args, n, specs[n],
                                                      args.out, args.seed + 1000 * i)
        entries.append(entry)
        if n == "llama31":
            llama31 = (entry, logits, prompts)
    manifest = {"generator": "tests/data/hf/make_hf_fixtures.py",
                "argv": sys.argv[1:] if argv is None else argv, "args": vars(args),
                "versions": versions, "checkpoints": entries}
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
