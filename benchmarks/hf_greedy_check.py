#!/usr/bin/env python3
"""Greedy generation of `tpserve serve --backend cuda --dtype bf16` against
HuggingFace transformers on the same checkpoint, over prompt lengths around
the block, bucket and chunk edges (1 ... 1500 tokens).

  source .gpu/env.sh
  python3 benchmarks/hf_greedy_check.py --out gpu-out/hf-greedy-check.json

Steps:
 1. Builds a transformers LlamaForCausalLM (hidden 1024, 8 heads, 2 KV heads,
    4 layers, vocab 32000, max_position_embeddings 4096 by default) with
    random weights drawn with a spread (embeddings N(0, 1); q/k
    N(0, (2/sqrt(H))^2) so that attention is sharp and positions matter;
    v, o, MLP N(0, 1/fan_in); LM head N(0, (3/sqrt(H))^2) so that logits
    spread over a few units; RMSNorm weights U(0.8, 1.2)); transformers'
    own N(0, 0.02) init gives near-uniform logits where every step is a near
    tie. Saves it with save_pretrained in BF16 (--dir, or a temporary one).
 2. transformers' greedy generation (generate, do_sample=False) of
    --new-tokens tokens per prompt, the model loaded from the saved BF16
    weights in FP32 (--ref-dtype fp32, the default; eager attention, TF32
    off): the reference is the exact model of those weights, so that a
    divergence measures tpserve (BF16 activations) against the model and
    not against another rounding of it; --ref-dtype bf16 runs transformers
    in BF16 instead (then both sides round, differently). Each step's top-2
    logits are kept.
 3. Starts `tpserve serve --model DIR --backend cuda --dtype bf16` and asks for
    the same greedy generations (request_output_len --new-tokens).
 4. Per prompt: tokens matched before the first divergence and, there, the
    reference's top-2 gap relative to the top logit, (l1 - l2) / |l1|, and the
    rank of tpserve's token in the reference's logits. A divergence at a gap
    under --near-tie (1 %) is a near tie (rounding may decide it); any other
    divergence fails the check.
 5. Calibration (with the FP32 reference; --no-calibrate skips it): transformers
    itself in BF16 on the same weights, judged against the FP32 reference by the
    same rule. It tells whether the rule separates BF16 arithmetic from a wrong
    model on this checkpoint: where transformers' own BF16 diverges without a
    near tie too, such a divergence of tpserve's is rounding, not a bug.
Writes --out (JSON: meta, summary, one record per prompt, and the calibration's
summary and records), prints a summary line for each, exits 1 if tpserve's
generation diverged without a near tie (2 on usage errors); the calibration's
verdict does not change the exit status.
The tpserve binary is $TPSERVE_BIN, else .gpu/bin/tpserve (--tpserve).
"""
import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_LENGTHS = [1, 2, 3, 7, 31, 64, 127, 128, 129, 255, 256, 511, 512, 1000, 1023, 1024, 1025,
                   1500]

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--ref-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="transformers' activations (the weights are BF16 either way)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="skip the calibration run (transformers in BF16 against the FP32 "
                         "reference, judged by the same rule)")
    ap.add_argument("--near-tie", type=float, default=0.01,
                    help="relative top-2 gap under which a divergence is a near tie")
    ap.add_argument("--dir", default="", help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--tp", type=int, default=1, help="tpserve's tensor-parallel size")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--device", default="cuda", help="transformers' device")
    ap.add_argument("--tpserve", default=os.environ.get(
        "TPSERVE_BIN", os.path.join(ROOT, ".gpu", "bin", "tpserve")))
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    if min(args.lengths) < 1 or args.new_tokens < 1:
        ap.error("--lengths and --new-tokens must be >= 1")
    if max(args.lengths) + args.new_tokens > args.max_positions:
        ap.error("the longest prompt plus --new-tokens (%d) exceeds --max-positions %d"
                 % (max(args.lengths) + args.new_tokens, args.max_positions))
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--heads must divide --hidden and be a multiple of --kv-heads")
    if not 0 < args.near_tie < 1:
        ap.error("--near-tie must lie in (0, 1)")
    return args


# ---------------------------------------------------------------------------
# Comparison (pure: tested without torch or a GPU)


def relative_gap(top):
    """(l1 - l2) / |l1| of a step's two largest logits `top` (descending)."""
    return (top[0] - top[1]) / max(abs(top[0]), 1e-30)


def compare(ours, ref, ref_steps, near_tie):
    """One prompt's record. ref_steps[i]: {"top_values": [...], "top_ids": [...]} of the
    reference's step i, descending (at least two)."""
    n = min(len(ours), len(ref))
    first = next((i for i in range(n) if ours[i] != ref[i]), None)
    if first is None and len(ours) != len(ref):
        first = n  # one side stopped early: a divergence at n
    rec = {"matched": n if first is None else first, "of": len(ref), "ours": ours,
           "reference": ref}
    if first is None:
        rec["verdict"] = "identical"
        return rec
    div = {"index": first,
           "ours": ours[first] if first < len(ours) else None,
           "reference": ref[first] if first < len(ref) else None}
    if first < len(ref_steps):
        step = ref_steps[first]
        gap = relative_gap(step["top_values"])
        div["ref_top2_rel_gap"] = gap
        div["ref_top2_abs_gap"] = step["top_values"][0] - step["top_values"][1]
        div["ours_rank_in_reference"] = (step["top_ids"].index(div["ours"]) + 1
                                         if div["ours"] in step["top_ids"] else None)
        near = gap < near_tie
    else:
        near = False
    div["near_tie"] = near
    rec["first_divergence"] = div
    rec["verdict"] = "near_tie" if near else "diverged"
    return rec


def summarise(records, near_tie):
    verdicts = [r["verdict"] for r in records]
    s = {"prompts": len(records), "identical": verdicts.count("identical"),
         "near_tie_divergences": verdicts.count("near_tie"),
         "unexplained_divergences": verdicts.count("diverged"),
         "tokens_matched": sum(r["matched"] for r in records),
         "tokens": sum(r["of"] for r in records), "near_tie_threshold": near_tie}
    s["pass"] = s["unexplained_divergences"] == 0
    return s


def judge(candidates, refs, lengths, near_tie):
    """Records (one per prompt, with its length) and their summary for `candidates` (token
    lists) against `refs` ((tokens, steps) per prompt)."""
    records = []
    for got, (ref_tokens, steps), n in zip(candidates, refs, lengths):
        rec = compare(got, ref_tokens, steps, near_tie)
        rec["length"] = n
        records.append(rec)
    return records, summarise(records, near_tie)


def summary_line(s, records, who="hf_greedy_check"):
    bad = ["len %d at token %d" % (r["length"], r["first_divergence"]["index"])
           for r in records if r["verdict"] == "diverged"]
    return ("%s: %s: %d prompts, %d identical, %d diverged at a near tie (< %g %%), "
            "%d diverged without one%s; %d/%d tokens matched"
            % (who, "PASS" if s["pass"] else "FAIL", s["prompts"], s["identical"],
               s["near_tie_divergences"], 100 * s["near_tie_threshold"],
               s["unexplained_divergences"], (" (%s)" % ", ".join(bad)) if bad else "",
               s["tokens_matched"], s["tokens"]))


# ---------------------------------------------------------------------------
# transformers


def log(msg):
    print("[hf_greedy_check] %s" % msg, file=sys.stderr, flush=True)


def build_checkpoint(torch, transformers, args, directory):
    major = int(transformers.__version__.split(".")[0])
    fields = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                  intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=args.max_positions, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, attn_implementation="eager")
    if major >= 5:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": args.rope_theta}
    else:
        fields["rope_theta"] = args.rope_theta
    config = transformers.LlamaConfig(**fields)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config)
    h = args.hidden
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.8 + 0.4 * torch.rand(p.shape, generator=gen))
                continue
            if "embed_tokens" in name:
                std = 1.0
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                std = 2.0 / h ** 0.5
            elif name == "lm_head.weight":
                std = 3.0 / h ** 0.5
            else:
                std = 1.0 / p.shape[1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.to(torch.bfloat16)
    try:
        model.save_pretrained(directory, safe_serialization=True)
    except TypeError:  # transformers 5: safetensors only
        model.save_pretrained(directory)
    return major


def reference_generations(torch, transformers, major, args, directory, prompts, dtype_name):
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    kw = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
    model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                          **kw).to(args.device).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p], dtype=torch.long, device=args.device)
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=args.new_tokens, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        tokens = g.sequences[0, len(p):].tolist()
        steps = []
        for t, step_logits in zip(tokens, g.logits):
            row = step_logits[0].float()
            top = torch.topk(row, 5)
            steps.append({"top_values": top.values.tolist(), "top_ids": top.indices.tolist()})
            # In BF16 two logits can be equal; generate() takes the lower id, topk either.
            if row[t].item() != top.values[0].item():
                raise RuntimeError("generate()'s token %d (logit %r) is not its logits' "
                                   "argmax %d (%r)" % (t, row[t].item(), top.indices[0].item(),
                                                       top.values[0].item()))
        out.append((tokens, steps))
        log("transformers %s: prompt of %d tokens done" % (dtype_name, len(p)))
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------
# tpserve


def tpserve_generations(args, directory, prompts):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    os.environ["TPSERVE_BIN"] = args.tpserve
    os.environ.setdefault("PROTO_DIR", ROOT)
    import grpc
    from grpc_interop_test import compile_messages, start_server

    tmp = tempfile.TemporaryDirectory()
    pb = compile_messages(tmp.name)
    log_path = os.path.join(tmp.name, "server.log")
    server_log = open(log_path, "w")
    flags = ["--model", directory, "--model-name", "ref", "--tp", str(args.tp), "--backend",
             args.backend, "--dtype", "bf16"]
    if args.backend == "cuda":
        flags += ["--rank-timeout-s", "120"]
    log("starting tpserve serve %s" % " ".join(flags))
    server, port = start_server(flags, stderr=server_log)
    out = []
    try:
        channel = grpc.insecure_channel("127.0.0.1:%d" % port)
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=pb.ModelInferResponse.FromString)
        for p in prompts:
            req = pb.ModelInferRequest(model_name="ref")
            for name, shape, values in (("input_ids", [1, len(p)], p),
                                        ("input_lengths", [1, 1], [len(p)]),
                                        ("request_output_len", [1, 1], [args.new_tokens])):
                req.inputs.add(name=name, datatype="INT32", shape=shape)
                req.raw_input_contents.append(struct.pack("<%di" % len(values), *values))
            resp = infer(req, timeout=600)
            ids = []
            for o, raw in zip(resp.outputs, resp.raw_output_contents):
                if o.name == "output_ids":
                    ids = list(struct.unpack("<%di" % (len(raw) // 4), raw))
            if ids[:len(p)] != p:
                raise RuntimeError("output_ids of the prompt of %d tokens does not start with "
                                   "the prompt" % len(p))
            out.append(ids[len(p):])
        channel.close()
    finally:
        server.send_signal(15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log.close()
        with open(log_path, errors="replace") as f:
            sys.stderr.write("---- tpserve log (tail) ----\n%s\n---- end ----\n" % f.read()[-3000:])
        tmp.cleanup()
    return out


def main(argv=None):
    args = parse_args(argv)
    if not os.access(args.tpserve, os.X_OK):
        print("no tpserve binary at %s (set TPSERVE_BIN or --tpserve)" % args.tpserve,
              file=sys.stderr)
        return 2
    import torch
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, args.vocab, (n,), generator=rng).tolist() for n in args.lengths]

    tmpdir = None
    directory = args.dir
    if not directory:
        tmpdir = tempfile.TemporaryDirectory()
        directory = os.path.join(tmpdir.name, "hf-llama")
    t0 = time.time()
    major = build_checkpoint(torch, transformers, args, directory)
    log("checkpoint written to %s (%.1f s)" % (directory, time.time() - t0))
    refs = reference_generations(torch, transformers, major, args, directory, prompts,
                                 args.ref_dtype)
    lengths = [len(p) for p in prompts]
    calibration = None
    if args.calibrate and args.ref_dtype == "fp32":
        own = reference_generations(torch, transformers, major, args, directory, prompts, "bf16")
        cal_records, cal_summary = judge([t for t, _ in own], refs, lengths, args.near_tie)
        calibration = {"candidate": "transformers generate(do_sample=False), bf16 activations",
                       "summary": cal_summary, "records": cal_records}
    ours = tpserve_generations(args, directory, prompts)
    records, summary = judge(ours, refs, lengths, args.near_tie)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": args.commit,
            "args": vars(args), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device": (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"),
            "reference": "transformers generate(do_sample=False), %s activations from the "
                         "saved BF16 weights, eager attention" % args.ref_dtype}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        doc = {"meta": meta, "summary": summary, "records": records}
        if calibration is not None:
            doc["calibration"] = calibration
        json.dump(doc, f, indent=1)
        f.write("\n")
    for r in records:
        d = r.get("first_divergence")
        log("len %5d: %2d/%d matched%s" % (
            r["length"], r["matched"], r["of"],
            "" if d is None else ", diverged (ours %s, reference %s, top-2 gap %.3g %%, %s)"
            % (d["ours"], d["reference"], 100 * d.get("ref_top2_rel_gap", float("nan")),
               "near tie" if d["near_tie"] else "NOT a near tie")))
    print(summary_line(summary, records))
    if calibration is not None:
        print(summary_line(calibration["summary"], calibration["records"],
                           "calibration, transformers bf16"))
    if tmpdir is not None:
        tmpdir.cleanup()
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
