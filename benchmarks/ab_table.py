#!/usr/bin/env python3
"""Side-by-side table of builds measured in one device call (an A/B run, see
run_decode_ab.sh): for every batch, each build's median decode step (host-timed,
from tpserve-bench-decode's step_host_ms_median) in every round, the median over
the rounds, and its ratio to the first build's.

  benchmarks/ab_table.py --run before=a-r1.json --run before=a-r2.json \\
                         --run after=b-r1.json --run after=b-r2.json [--json OUT]

--run LABEL=FILE may repeat a label (one file a round); labels keep the order of
their first --run. Files of tpserve-bench-attention --decode (records with
median_ms) are read too: their batches are keyed by KV dtype (and a split count
asked for). A file that is missing or unreadable is named on stderr and left out;
the exit status is then 1 (2 on usage errors). --json writes {label: {batch key: [ms per round]}},
the shape PERFORMANCE.md's files of record keep under "ab_same_call".
"""
import argparse
import json
import re
import statistics
import sys


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=FILE",
                    help="a build's results file of one round (repeat per round and build)")
    ap.add_argument("--json", default="", help="also write the table's numbers here")
    args = ap.parse_args(argv)
    runs = []
    for item in args.run:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            ap.error(f"--run {item!r}: expected LABEL=FILE")
        runs.append((label, path))
    return args, runs


def step_times(doc):
    """{batch key: ms} of one results file."""
    out = {}
    for r in doc.get("records", []):
        if "step_host_ms_median" in r:
            out[str(r["batch"])] = float(r["step_host_ms_median"])
        elif "median_ms" in r and "batch" in r:
            key = f'{r.get("kv_dtype", "?")}/b{r["batch"]}'
            if r.get("splits_asked"):
                key += f'/s{r["splits_asked"]}'
            out[key] = float(r["median_ms"])
    return out


def collect(runs):
    """({label: {key: [ms per round]}}, [unreadable files])."""
    table, bad = {}, []
    for label, path in runs:
        table.setdefault(label, {})
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            bad.append(f"{path}: {e}")
            continue
        for key, ms in step_times(doc).items():
            table[label].setdefault(key, []).append(ms)
    return table, bad


def sort_key(key):
    """Natural order: numbers inside a key compare as numbers (b8 before b64)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def render(table):
    labels = list(table)
    keys = sorted({k for per in table.values() for k in per}, key=sort_key)
    lines = ["| batch | " + " | ".join(f"{lb} (rounds; median)" for lb in labels) +
             "".join(f" | {lb} / {labels[0]}" for lb in labels[1:]) + " |",
             "|---" * (1 + 2 * len(labels) - 1) + "|"]
    for key in keys:
        cells, medians = [], []
        for lb in labels:
            ms = table[lb].get(key, [])
            med = statistics.median(ms) if ms else None
            medians.append(med)
            cells.append(("/".join(f"{x:.3f}" for x in ms) + f"; {med:.3f}") if ms else "–")
        ratios = [f"{m / medians[0]:.3f}" if m and medians[0] else "–" for m in medians[1:]]
        lines.append(f"| {key} | " + " | ".join(cells) +
                     "".join(f" | {r}" for r in ratios) + " |")
    return "\n".join(lines)


def main(argv=None):
    args, runs = parse_args(argv)
    table, bad = collect(runs)
    for b in bad:
        print(f"ab_table: left out {b}", file=sys.stderr)
    print(render(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
