#!/usr/bin/env python3
"""Renders a results file (benchmarks/README.md's schema: a merged file, or
one impl's file alone) as text tables, and optionally a PNG.

  python3 benchmarks/render_results.py benchmarks/results/X.json [--png X.png]

Per (layer, m, dtype): one row per record (impl, method, chunks, config),
sorted by median, with Min / Max / Mean / StdDev / Median / IQR / Rounds and

  vs seq             tpserve `none` median / this median (speedup over
                     the sequential collective + GEMM)
  vs max(gemm,comm)  max(tpserve gemm_only, comm_only median) / this median
                     (1.0 = perfect overlap; the floor no overlap can beat)

then a summary: per (layer, m, dtype) the best tpserve method, the best
torch method, tpserve none, and the time ratios best-tpserve / none and
best-tpserve / best-torch (< 1: tpserve faster). Records whose correctness
check failed (rel diff > 1e-2), or that carry no check at all (a run with
--no-check; every method but PyTorch's torch_seq, the peer's reference, must
have one), are marked "!" and never chosen as best.

One run per shape: a session may merge several tpserve runs into one file
(run_overlap_bench.sh with TUNE=1: the tuning sweep, then a run of gemm_only,
comm_only, none and auto with the tuned config), each record tagged "run".
Their contexts differ (the sweep interleaves dozens of graphs), so the
summary and the criteria take tpserve's best, none and floor of a shape from
one run: the one holding its auto record (else the one with most records);
the tables list every run's records, named with their run.

The PNG (matplotlib, imported only for --png) has one panel per layer (a row
per dtype): x = m (log2), y = median ms (log) of each impl+method's best
configuration, and the max(gemm_only, comm_only) floor dashed; --relative
plots median / floor instead (linear, floor = 1).
"""

import argparse
import json
import math
import sys

# tpserve diagnostics: parts of a layer, not ways to run one.
DIAGNOSTIC = ("gemm_only", "comm_only", "layer_gemm", "layer_comm")
CHECK_KEYS = ("check_rel_diff_vs_none", "check_rel_diff_vs_seq")
CHECK_TOLERANCE = 1e-2
DTYPE_ORDER = {"fp8": 0, "bf16": 1}
IMPL_ORDER = {"tpserve": 0, "torch": 1}


def load(path):
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError("%s: not a results file (no \"records\" list)" % path)
    for i, r in enumerate(data["records"]):
        if not isinstance(r, dict):
            raise ValueError("%s: records[%d] is not an object" % (path, i))
        for key in ("median_ms", "min_ms", "max_ms", "check_rel_diff_vs_none",
                    "check_rel_diff_vs_seq"):
            v = r.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError("%s: records[%d].%s is not a number (got %r)"
                                 % (path, i, key, v))
        if not isinstance(r.get("config", {}), dict):
            raise ValueError("%s: records[%d].config is not an object" % (path, i))
    return data


def check_failed(r):
    """Whether `r` is not a checked, valid run of its layer: its check failed,
    or a method that must be checked (every layer method of tpserve; every
    PyTorch method but torch_seq, the reference of the others) has none."""
    values = [r.get(key) for key in CHECK_KEYS if r.get(key) is not None]
    if any(not (v <= CHECK_TOLERANCE) for v in values):
        return True
    # The references: PyTorch's torch_seq, and in files from before
    # tpserve-bench computed its reference separately, tpserve's plain none.
    reference = r.get("method") == "torch_seq" or (
        r.get("impl") == "tpserve" and r.get("method") == "none"
        and not (r.get("config") or {}).get("copy_engine"))
    needs_check = r.get("method") not in DIAGNOSTIC and not reference
    return needs_check and not values


def config_summary(r):
    """A few words for the non-default knobs of a record's config. Fields of knobs that no
    longer exist, in older files' records, are not read: those records hold their defaults."""
    c = r.get("config") or {}
    words = []
    if c.get("copy_engine"):
        words.append("ce")
    policy = c.get("cta_policy")
    if policy and policy != "default":
        words.append("cta=%s" % policy)
    lo, hi = c.get("min_ctas") or 0, c.get("max_ctas") or 0
    if lo and hi:
        words.append("ctas=%s-%s" % (lo, hi))
    elif hi:
        words.append("maxctas=%s" % hi)
    elif lo:
        words.append("minctas=%s" % lo)
    if c.get("fast_accum"):
        words.append("fast")
    if c.get("graph") is False:
        words.append("eager")
    return " ".join(words)


def transport_suffix(cfg):
    """How a method moves its data, as the bench names it: _inplace (ring over
    peer memory, no pulls), _fullw (the whole weight, the peers' input columns
    pulled), _ce (copy-engine pulls), or nothing (NCCL)."""
    if cfg.get("in_place"):
        return "_inplace"
    if cfg.get("full_weight"):
        return "_fullw"
    return "_ce" if cfg.get("copy_engine") else ""


def variant(r):
    """impl+method, with the copy-engine pipeline as its own method (the
    bench's pipeline_ce)."""
    name = "%s %s" % (r.get("impl", "?"), r.get("method", "?"))
    return name + transport_suffix(r.get("config") or {})


def row_name(r):
    name = variant(r)
    method = r.get("method", "")
    cfg = r.get("config") or {}
    mode = cfg.get("mode", "none")
    # A --breakdown part (every layer_comm; a layer_gemm under other than the
    # plain none knobs) is named after the method it belongs to.
    part = method == "layer_comm" or (method == "layer_gemm" and
                                      (mode != "none" or cfg.get("copy_engine")))
    if part:
        name = "%s %s of %s%s c=%s" % (r.get("impl", "?"), method, mode, transport_suffix(cfg),
                                       r.get("chunks"))
    elif r.get("chunks", 1) != 1 or method in ("pipeline", "ring", "torch_chunked"):
        name += " c=%s" % r.get("chunks")
    extra = config_summary(r)
    # "ce" is already in the variant name.
    extra = " ".join(w for w in extra.split() if w != "ce")
    if extra:
        name += " [%s]" % extra
    if r.get("run") is not None:
        name += " (run %s)" % r["run"]
    if check_failed(r):
        name += " !"
    return name


def group_key(r):
    return (r.get("layer", "?"), r.get("m", 0), r.get("dtype", "?"), r.get("tp", 0))


def groups(records):
    """{key: [records]} in display order: layers in order of first
    appearance, then m, dtype (fp8 first), tp."""
    layer_order = {}
    out = {}
    for r in records:
        layer_order.setdefault(r.get("layer", "?"), len(layer_order))
        out.setdefault(group_key(r), []).append(r)

    def order(k):
        return (layer_order[k[0]], k[1], DTYPE_ORDER.get(k[2], 9), str(k[2]), k[3])

    return {k: out[k] for k in sorted(out, key=order)}


def median_of(recs, impl, method):
    vals = [r["median_ms"] for r in recs
            if r.get("impl") == impl and r.get("method") == method and "median_ms" in r]
    return min(vals) if vals else None


def judged_run(recs):
    """The tpserve records of a shape that the summary and criteria judge:
    those of one run (see the module doc), or all when they carry no run."""
    ours = [r for r in recs if r.get("impl") == "tpserve"]
    runs = []
    for r in ours:
        if r.get("run") not in runs:
            runs.append(r.get("run"))
    if len(runs) <= 1:
        return recs
    with_auto = [run for run in runs
                 if any(r.get("run") == run and r.get("method") == "auto" for r in ours)]
    if with_auto:
        chosen = with_auto[-1]
    else:
        chosen = max(runs, key=lambda run: sum(1 for r in ours if r.get("run") == run))
    return [r for r in recs if r.get("impl") != "tpserve" or r.get("run") == chosen]


def references(recs, fallback=False):
    """(none median, floor = max(gemm_only, comm_only) median) of tpserve.
    fallback: without a tpserve none, torch_seq's median stands in."""
    none = median_of(recs, "tpserve", "none")
    if none is None and fallback:
        none = median_of(recs, "torch", "torch_seq")
    gemm = median_of(recs, "tpserve", "gemm_only")
    comm = median_of(recs, "tpserve", "comm_only")
    floor = max(gemm, comm) if gemm is not None and comm is not None else None
    return none, floor


def best(recs, impl):
    cands = [r for r in recs if r.get("impl") == impl and r.get("method") not in DIAGNOSTIC
             and "median_ms" in r and not check_failed(r)]
    return min(cands, key=lambda r: r["median_ms"]) if cands else None


def fmt(v, digits=4):
    return "-" if v is None else "%.*f" % (digits, v)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table(headers, rows, align):
    """Plain-text table; align: one of 'l'/'r' per column."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def render_group(key, recs):
    layer, m, dtype, tp = key
    first = recs[0]
    none, floor = references(recs, fallback=True)
    title = "%s  %s  m=%s n=%s k=%s  %s  tp=%s" % (
        layer, first.get("op", "?"), m, first.get("n", "?"), first.get("k", "?"), dtype, tp)
    if median_of(recs, "tpserve", "none") is None and none is not None:
        title += "  (no tpserve none: vs seq = vs torch_seq)"
    rows = []
    for r in sorted(recs, key=lambda r: (r.get("median_ms", float("inf")),
                                         IMPL_ORDER.get(r.get("impl"), 9))):
        med = r.get("median_ms")
        rows.append([
            row_name(r), fmt(r.get("min_ms")), fmt(r.get("max_ms")), fmt(r.get("mean_ms")),
            fmt(r.get("stddev_ms")), fmt(med), fmt(r.get("iqr_ms")), str(r.get("rounds", "-")),
            fmt(ratio(none, med), 2), fmt(ratio(floor, med), 2)])
    headers = ["Name (time in ms)", "Min", "Max", "Mean", "StdDev", "Median", "IQR", "Rounds",
               "vs seq", "vs max(gemm,comm)"]
    body = table(headers, rows, "l" + "r" * 9)
    bar = "-" * max(len(title) + 8, 40)
    return "%s\n--- %s ---\n%s\n%s" % (bar, title, bar, body)


def summary_rows(grouped):
    rows = []
    for key, recs in grouped.items():
        layer, m, dtype, tp = key
        recs = judged_run(recs)
        none, floor = references(recs)
        bt, bp = best(recs, "tpserve"), best(recs, "torch")
        bt_med = bt["median_ms"] if bt else None
        bp_med = bp["median_ms"] if bp else None
        rows.append([
            layer, str(m), dtype,
            row_name(bt) if bt else "-", fmt(bt_med),
            row_name(bp) if bp else "-", fmt(bp_med),
            fmt(none), fmt(floor),
            fmt(ratio(bt_med, none), 3), fmt(ratio(bt_med, bp_med), 3)])
    return rows


def criteria(grouped, dtype="fp8", planned=None, missing_inputs=None):
    """The overlap criteria of the project (issue 4), for records of `dtype`:
    (name, passed or None when unmeasured, detail). Ratios are times.

    A criterion is measured once any shape of `dtype` has what it compares
    (PyTorch records; gemm_only and comm_only at m >= 4096; an auto record).
    From then on every shape must have it: a shape without a valid record on
    one side (the peer failed there, or every tpserve method failed its
    correctness check) fails the criterion instead of dropping out of it, and
    an auto record that failed its check counts as infinitely slow.

    planned: the cases tpserve's runs meant to measure (meta.planned_cases:
    [{"layer", "m", "dtype", "run"}]); one of `dtype` without a tpserve record
    of its run fails every criterion it belongs to, so that a run cut short
    cannot pass on the shapes it reached. missing_inputs: input files the
    merge could not find (a tool died before writing): every criterion fails."""
    keys = [k for k in grouped if k[2] == dtype]
    # Every run's records count as present (before judging within one run).
    present = {(r.get("layer"), int(r.get("m", -1)), r.get("run"))
               for k in keys for r in grouped[k] if r.get("impl") == "tpserve"}
    grouped = {k: judged_run(grouped[k]) for k in keys}
    has_torch = any(r.get("impl") == "torch" for k in keys for r in grouped[k])
    has_floor = any(references(grouped[k])[1] is not None for k in keys if int(k[1]) >= 4096)
    has_auto = any(r.get("impl") == "tpserve" and r.get("method") == "auto"
                   for k in keys for r in grouped[k])
    over_torch, speedups, over_floor, auto_over_none = [], [], [], []
    missing = {"torch": [], "floor": [], "auto": []}
    unmeasured = []
    present_any_run = {p[:2] for p in present}
    for case in planned or []:
        key = (case.get("layer"), int(case.get("m", -1)), case.get("run"))
        found = key in present if "run" in case else key[:2] in present_any_run
        if case.get("dtype") == dtype and not found and key[:2] not in unmeasured:
            unmeasured.append(key[:2])
    for layer, m in unmeasured:
        name = "%s m=%s (planned, no record)" % (layer, m)
        missing["torch"].append(name)
        if m >= 4096:
            missing["floor"].append(name)
        missing["auto"].append(name)
    for path in missing_inputs or []:
        name = "input %s missing" % path
        for lost in missing.values():
            lost.append(name)
    mismatched = []
    for key in keys:
        layer, m, d, tp = key
        recs = grouped[key]
        none, floor = references(recs)
        bt, bp = best(recs, "tpserve"), best(recs, "torch")
        name = "%s m=%s" % (layer, m)
        if bt and bp:
            # Both sides must have been measured alike.
            for field, get in (("l2_flush_mib", lambda r: r.get("l2_flush_mib")),
                               ("rank_times", lambda r: r.get("rank_times")),
                               ("fast_accum", lambda r: bool((r.get("config") or {})
                                                             .get("fast_accum")))):
                if get(bt) != get(bp):
                    mismatched.append("%s (%s %s vs %s)" % (name, field, get(bt), get(bp)))
        if bt and bp:
            over_torch.append((bt["median_ms"] / bp["median_ms"], name))
            speedups.append(bp["median_ms"] / bt["median_ms"])
        elif has_torch:
            missing["torch"].append(name + (" (no valid tpserve record)" if not bt
                                            else " (no PyTorch record)"))
        if int(m) >= 4096 and has_floor:
            if bt and floor:
                over_floor.append((bt["median_ms"] / floor, name))
            else:
                missing["floor"].append(name + (" (no valid tpserve record)" if not bt
                                                else " (no gemm_only/comm_only)"))
        if has_auto:
            autos = [r for r in recs if r.get("impl") == "tpserve" and r.get("method") == "auto"
                     and "median_ms" in r]
            if autos and none:
                worst_auto = max(float("inf") if check_failed(r) else r["median_ms"]
                                 for r in autos)
                auto_over_none.append((worst_auto / none, name))
            else:
                missing["auto"].append(name + (" (no auto record)" if not autos
                                                else " (no none record)"))

    def worst(pairs, lost, limit, what):
        if not pairs and not lost:
            return (what, None, "not measured")
        bad = [(r, n) for r, n in pairs if r > limit]
        detail = "%d of %d cases above %.2f" % (len(bad), len(pairs), limit)
        if pairs:
            top = max(pairs)
            detail += "; worst %.3f (%s)" % (top[0], top[1])
        if lost:
            detail += "; %d shape(s) without a comparison: %s" % (len(lost), ", ".join(lost))
        return (what, not bad and not lost, detail)

    over_torch_lost = missing["torch"] + [m + ": measured differently" for m in mismatched]
    out = [worst(over_torch, over_torch_lost, 1.02,
                 "best tpserve <= 1.02 x best PyTorch, every shape")]
    geo_what = "geometric-mean speedup over best PyTorch >= 1.10"
    if speedups:
        geo = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
        detail = "%.3f over %d shapes" % (geo, len(speedups))
        if missing["torch"]:
            detail += "; %d shape(s) left out, without a comparison" % len(missing["torch"])
        if mismatched:
            detail += "; %d shape(s) measured differently on the two sides" % len(mismatched)
        out.append((geo_what, geo >= 1.10 and not missing["torch"] and not mismatched, detail))
    elif missing["torch"]:
        out.append((geo_what, False, "no shape with both sides: %s" % ", ".join(missing["torch"])))
    else:
        out.append((geo_what, None, "not measured"))
    out.append(worst(over_floor, missing["floor"], 1.05,
                     "m >= 4096: best <= 1.05 x max(gemm_only, comm_only)"))
    out.append(worst(auto_over_none, missing["auto"], 1.02, "auto <= 1.02 x none, every shape"))
    return out


def render_criteria(grouped, dtype="fp8", planned=None, missing_inputs=None):
    lines = ["=== criteria (%s) ===" % dtype]
    for what, ok, detail in criteria(grouped, dtype, planned, missing_inputs):
        mark = "n/a " if ok is None else ("PASS" if ok else "FAIL")
        lines.append("%s  %s: %s" % (mark, what, detail))
    return "\n".join(lines)


def render_text(data):
    records = data["records"]
    grouped = groups(records)
    parts = []
    meta = data.get("meta") or {}
    if meta:
        head = "meta: " + ", ".join("%s=%s" % (k, meta[k]) for k in meta if k != "command")
        if meta.get("command"):
            head += "\ncommand: %s" % meta["command"]
        parts.append(head)
    for key, recs in grouped.items():
        parts.append(render_group(key, recs))
    if any(check_failed(r) for r in records):
        parts.append("! = output differs from the reference by more than %g (relative "
                     "Frobenius norm), or was not checked: not a valid run of the layer, never "
                     "chosen as best" % CHECK_TOLERANCE)
    headers = ["layer", "m", "dtype", "best tpserve", "median", "best torch", "median",
               "tpserve none", "max(gemm,comm)", "best/none", "best/torch"]
    parts.append("=== summary (medians in ms; ratios are times: < 1 means best tpserve is "
                 "faster) ===\n" + table(headers, summary_rows(grouped),
                                          "llllrlrrrrr"))
    parts.append(render_criteria(grouped, planned=meta.get("planned_cases"),
                                 missing_inputs=data.get("missing_inputs")))
    skipped = data.get("skipped") or []
    if skipped:
        lines = ["=== skipped (%d) ===" % len(skipped)]
        for s in skipped:
            lines.append("%s %s m=%s %s %s chunks=%s: %s" % (
                s.get("impl", "?"), s.get("layer", "?"), s.get("m", "?"), s.get("dtype", "?"),
                s.get("method", "?"), s.get("chunks", "?"), s.get("reason", "")))
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot_series(records):
    """{dtype: {layer: {"lines": {variant: {m: best median}}, "floor": {m: v}}}}
    with layers in order of first appearance."""
    out = {}
    for key, recs in groups(records).items():
        layer, m, dtype, _ = key
        panel = out.setdefault(dtype, {}).setdefault(layer, {"lines": {}, "floor": {}})
        _, floor = references(recs)
        if floor is not None:
            panel["floor"][m] = floor
        for r in recs:
            if r.get("method") in DIAGNOSTIC or "median_ms" not in r or check_failed(r):
                continue
            line = panel["lines"].setdefault(variant(r), {})
            line[m] = min(line.get(m, float("inf")), r["median_ms"])
    return out


def render_png(data, path, relative=False):
    """relative: y = median / max(gemm_only, comm_only) (the floor at 1.0),
    linear, instead of the median in ms on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    series = plot_series(data["records"])
    if not series:
        raise ValueError("no records to plot")
    dtypes = sorted(series, key=lambda d: (DTYPE_ORDER.get(d, 9), d))
    layers = []
    for d in dtypes:
        for layer in series[d]:
            if layer not in layers:
                layers.append(layer)
    variants = sorted({v for d in dtypes for p in series[d].values() for v in p["lines"]},
                      key=lambda v: (IMPL_ORDER.get(v.split()[0], 9), v))
    cmap = plt.get_cmap("tab10" if len(variants) <= 10 else "tab20")
    colors = {v: cmap(i % cmap.N) for i, v in enumerate(variants)}
    nrows, ncols = len(dtypes), len(layers)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.8 * nrows), squeeze=False)
    handles = {}
    for i, d in enumerate(dtypes):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            panel = series[d].get(layer)
            ax.set_title("%s  %s" % (layer, d), fontsize=10)
            if panel is None:
                ax.set_axis_off()
                continue
            ms = set(panel["floor"])
            for v in variants:
                pts = panel["lines"].get(v)
                if relative and pts:
                    pts = {x: y / panel["floor"][x] for x, y in pts.items()
                           if panel["floor"].get(x)}
                if not pts:
                    continue
                xs = sorted(pts)
                ms.update(xs)
                torch_line = v.startswith("torch ")
                (h,) = ax.plot(xs, [pts[x] for x in xs], color=colors[v],
                               linestyle=":" if torch_line else "-",
                               marker="s" if torch_line else "o", markersize=4, linewidth=1.4)
                handles.setdefault(v, h)
            if panel["floor"]:
                xs = sorted(panel["floor"])
                ys = [1.0 if relative else panel["floor"][x] for x in xs]
                (h,) = ax.plot(xs, ys, color="black", linestyle="--", linewidth=1.2)
                handles.setdefault("max(gemm_only, comm_only)", h)
            ax.set_xscale("log", base=2)
            if not relative:
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
                ax.yaxis.set_minor_formatter(NullFormatter())
            if ms:
                ticks = sorted(ms)
                ax.set_xticks(ticks)
                ax.set_xticklabels([str(t) for t in ticks], fontsize=8)
                ax.minorticks_off()
            ax.set_xlabel("m (tokens)", fontsize=9)
            if j == 0:
                ax.set_ylabel("median / max(gemm, comm)" if relative else "median ms",
                              fontsize=9)
            ax.grid(True, which="major", alpha=0.3)
    meta = data.get("meta") or {}
    fig.suptitle("TP linear layers: %s per impl+method's best config (%s%s)" % (
        "median / max(gemm_only, comm_only)" if relative else "median time",
        meta.get("device") or "?", (", " + str(meta.get("commit"))[:10])
        if meta.get("commit") else ""), fontsize=11)
    names = list(handles)
    fig.legend([handles[n] for n in names], names, loc="lower center",
               ncol=min(len(names), 5), fontsize=8, frameon=False)
    rows_of_legend = (len(names) + 4) // 5
    fig.tight_layout(rect=(0, 0.04 + 0.035 * rows_of_legend, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_vs_gemm(data):
    """One line per layer case (op, n, k, m): each record's name and median, and its ratio
    to that case's gemm_only where the case has one (what the layer costs above its GEMM)."""
    cases = {}
    for r in data["records"]:
        key = (r.get("op", "?"), r.get("n"), r.get("k"), r.get("m"), r.get("dtype", "?"))
        cases.setdefault(key, []).append(r)
    out = []
    for key in sorted(cases, key=lambda k: (str(k[0]), k[1] or 0, k[2] or 0, k[3] or 0, str(k[4]))):
        gemm = [r["median_ms"] for r in cases[key] if r.get("method") == "gemm_only"]
        words = []
        for r in sorted(cases[key], key=row_name):
            words.append("%s %.4f%s" % (row_name(r), r["median_ms"],
                                        " (%.3f x gemm)" % (r["median_ms"] / gemm[0])
                                        if gemm else ""))
        out.append("%s n=%s k=%s m=%s %s: %s" % (key[0], key[1], key[2], key[3], key[4],
                                               "  ".join(words)))
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Render a benchmarks/results JSON file as tables (and a PNG).")
    p.add_argument("file", help="results JSON (merged, or one impl's)")
    p.add_argument("--png", help="also draw the medians into this PNG (needs matplotlib)")
    p.add_argument("--relative", action="store_true",
                   help="PNG: plot median / max(gemm_only, comm_only) instead of ms")
    p.add_argument("--vs-gemm", action="store_true",
                   help="instead of the tables: one line per layer case, each method's median "
                        "and its ratio to the case's gemm_only")
    args = p.parse_args(argv)
    try:
        data = load(args.file)
        if args.vs_gemm:
            sys.stdout.write(render_vs_gemm(data))
            return 0
        sys.stdout.write(render_text(data))
    except (OSError, ValueError) as e:
        sys.stderr.write("render_results: %s\n" % e)
        return 1
    except (TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        sys.stderr.write("render_results: %s: malformed records (%s: %s)\n"
                         % (args.file, type(e).__name__, e))
        return 1
    if args.png:
        try:
            render_png(data, args.png, relative=args.relative)
        except ImportError as e:
            sys.stderr.write("render_results: no PNG (matplotlib missing: %s)\n" % e)
            return 1
        print("wrote %s" % args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
