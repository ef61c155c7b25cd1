#!/usr/bin/env python3
"""Merges tpserve-bench's JSON (impl "tpserve") and torch_peer.py's JSON
(impl "torch") of one run into one results file (benchmarks/README.md):

  python3 benchmarks/merge_results.py --ours A.json --peer B.json \
      --commit SHA --date YYYY-MM-DD --device "2x NVIDIA H200" \
      --command "benchmarks/run_overlap_bench.sh ..." \
      --out benchmarks/results/<date>-<what>.json

meta: commit, date, device and command from the arguments (defaults: the
inputs' own); nccl and cublaslt from ours; torch from peer. records: ours,
then peer's. Entries of peer's "skipped" list (methods that could not run)
are kept under "skipped" when there are any. Needs only the standard library.

--pool-peer-passes: when the peer ran more than once in the call (run before
and after tpserve's runs, so that both implementations are measured over the
same stretch of the GPUs' clock and power drift), records of the same case
and method from the several --peer files become one: its rounds are every
pass's rounds (the records' "times_ms"), its statistics computed over all of
them, and "passes" says how many were pooled.
"""

import argparse
import datetime
import json
import os
import re
import sys

from bench_stats import summarize

REQUIRED = ("impl", "layer", "op", "method", "dtype", "tp", "m", "n", "k", "chunks",
            "config", "median_ms", "min_ms", "max_ms", "mean_ms", "stddev_ms", "iqr_ms",
            "rounds")


def warn(msg):
    sys.stderr.write("merge_results: warning: %s\n" % msg)


def load(path, impl):
    """The input's dict; its records checked (warnings, not errors)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError("%s: not a results file (no \"records\" list)" % path)
    if not isinstance(data.get("meta", {}), dict):
        raise ValueError("%s: \"meta\" is not an object" % path)
    for i, r in enumerate(data["records"]):
        if not isinstance(r, dict):
            raise ValueError("%s: record %d is not an object" % (path, i))
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            warn("%s: record %d lacks %s" % (path, i, ", ".join(missing)))
        if r.get("impl") not in (None, impl):
            warn("%s: record %d has impl %r, expected %r" % (path, i, r.get("impl"), impl))
    return data


def load_all(paths, impl, missing):
    """The inputs of one impl concatenated (meta from the first), or None.
    An input that does not exist (its tool died before writing it) is left
    out with a warning and appended to `missing`, so that what the other
    inputs hold is still written."""
    out = None
    for path in paths or []:
        if not os.path.exists(path):
            warn("%s: no such file (left out)" % path)
            missing.append(path)
            continue
        part = load(path, impl)
        planned = part.get("meta", {}).get("planned_cases") or []
        if out is None:
            out = part
            out["skipped"] = list(out.get("skipped") or [])
            out["planned_cases"] = []
        else:
            out["records"].extend(part["records"])
            out["skipped"].extend(part.get("skipped") or [])
        for case in planned:
            if case not in out["planned_cases"]:
                out["planned_cases"].append(case)
    return out


# What makes two records the same measurement (config compared as JSON).
POOL_KEY = ("impl", "layer", "op", "method", "dtype", "tp", "m", "n", "k", "chunks")


def pool_passes(records):
    """Records of the same case and method pooled into one (see the module
    doc); a group in which a record lacks "times_ms" is left as it is, with a
    warning. Order: each group where its first record was."""
    groups = {}
    order = []
    for r in records:
        key = json.dumps([r.get(k) for k in POOL_KEY] + [r.get("config")], sort_keys=True)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(r)
    out = []
    for key in order:
        group = groups[key]
        if len(group) == 1:
            out.append(group[0])
            continue
        if not all(isinstance(r.get("times_ms"), list) and r["times_ms"] for r in group):
            warn("%s %s m=%s: %d passes without times_ms, not pooled" % (
                group[0].get("layer"), group[0].get("method"), group[0].get("m"), len(group)))
            out.extend(group)
            continue
        pooled = dict(group[0])
        times = [t for r in group for t in r["times_ms"]]
        pooled.update(summarize(times))
        pooled["times_ms"] = times
        pooled["passes"] = len(group)
        checks = [r["check_rel_diff_vs_seq"] for r in group
                  if isinstance(r.get("check_rel_diff_vs_seq"), (int, float))]
        if checks:
            pooled["check_rel_diff_vs_seq"] = max(checks)
        out.append(pooled)
    return out


def merge(ours, peer, commit=None, date=None, device=None, command=None):
    """ours / peer: loaded inputs or None. Returns the merged dict."""
    om = (ours or {}).get("meta", {})
    pm = (peer or {}).get("meta", {})
    if om.get("device") and pm.get("device") and om["device"] != pm["device"]:
        warn("devices differ: ours %r, peer %r" % (om["device"], pm["device"]))
    if command is None:
        parts = [m["command"] for m in (om, pm) if m.get("command")]
        command = " && ".join(parts) if parts else None
    meta = {
        "commit": commit or om.get("commit") or "unknown",
        "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": device or om.get("device") or pm.get("device"),
        "nccl": om.get("nccl", pm.get("nccl")),
        "cublaslt": om.get("cublaslt"),
        "torch": pm.get("torch"),
        "command": command,
    }
    if om.get("gemm_algo"):
        meta["gemm_algo"] = om["gemm_algo"]
    # The cases tpserve's runs meant to measure (tpserve-bench's
    # meta.planned_cases, every --ours file's).
    if (ours or {}).get("planned_cases"):
        meta["planned_cases"] = ours["planned_cases"]
    records = list((ours or {}).get("records", [])) + list((peer or {}).get("records", []))
    out = {"meta": meta, "records": records}
    skipped = []
    for data, impl in ((ours, "tpserve"), (peer, "torch")):
        for s in (data or {}).get("skipped", []) or []:
            entry = dict(s)
            entry.setdefault("impl", impl)
            skipped.append(entry)
    if skipped:
        out["skipped"] = skipped
    return out


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Merge tpserve-bench and torch_peer.py JSON results of one run "
        "into one file (schema: benchmarks/README.md).")
    p.add_argument("--ours", action="append",
                   help="tpserve-bench --out file (impl tpserve); repeat for several runs "
                   "of one session (their records are concatenated, meta from the first)")
    p.add_argument("--peer", action="append",
                   help="torch_peer.py --out file (impl torch); repeat likewise")
    p.add_argument("--pool-peer-passes", action="store_true",
                   help="pool the --peer files' records of the same case and method into "
                   "one (the peer ran several times in the call; see the module doc)")
    p.add_argument("--commit", help="commit measured (default: ours' meta.commit)")
    p.add_argument("--date", help="YYYY-MM-DD (default: today, UTC)")
    p.add_argument("--device", help='e.g. "2x NVIDIA H200" (default: the inputs\')')
    p.add_argument("--command", help="the command of the whole run (default: the "
                   "inputs' commands joined)")
    p.add_argument("--out", required=True, help="merged JSON file to write")
    args = p.parse_args(argv)
    if not args.ours and not args.peer:
        p.error("give --ours, --peer or both")
    if args.date:
        try:
            datetime.date.fromisoformat(args.date)
            valid = re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.date) is not None
        except ValueError:
            valid = False
        if not valid:
            p.error("--date must be a date YYYY-MM-DD, got %r" % args.date)
    missing = []
    try:
        ours = load_all(args.ours, "tpserve", missing)
        peer = load_all(args.peer, "torch", missing)
        if peer is not None and args.pool_peer_passes:
            peer["records"] = pool_passes(peer["records"])
    except (OSError, ValueError) as e:
        sys.stderr.write("merge_results: %s\n" % e)
        return 1
    except (TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        sys.stderr.write("merge_results: malformed input (%s: %s)\n" % (type(e).__name__, e))
        return 1
    if ours is None:
        warn("no --ours: the file holds PyTorch records only")
    if peer is None:
        warn("no --peer: the file holds tpserve records only")
    if ours is None and peer is None:
        sys.stderr.write("merge_results: none of the inputs exists: %s\n" % ", ".join(missing))
        return 1
    out = merge(ours, peer, args.commit, args.date, args.device, args.command)
    if missing:
        out["missing_inputs"] = missing
    tmp = args.out + ".tmp"
    try:
        if os.path.isdir(args.out):
            raise IsADirectoryError("%s is a directory" % args.out)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.out)
    except OSError as e:
        if os.path.isfile(tmp):
            os.remove(tmp)
        sys.stderr.write("merge_results: cannot write --out %s: %s\n" % (args.out, e))
        return 1
    n_ours = len((ours or {}).get("records", []))
    n_peer = len((peer or {}).get("records", []))
    print("wrote %s: %d tpserve + %d torch records%s" % (
        args.out, n_ours, n_peer,
        ", %d skipped" % len(out["skipped"]) if "skipped" in out else ""))
    # Written, but not a complete run: the caller must notice.
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
