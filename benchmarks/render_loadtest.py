#!/usr/bin/env python3
"""Latency-vs-load PNG and table of a tpserve-loadtest JSON report.

  python3 benchmarks/render_loadtest.py REPORT.json [--png OUT.png] [--table OUT.md|-]
      [--title TEXT]

Panels over the sweep's load axis (concurrency, or request rate). A logits
report (--mode logits): latency percentiles p50 / p90 / p99 in ms, and
throughput in tokens/s. A generation report (--mode generate): end-to-end
latency, time to first token and time per output token / inter-token latency
percentiles in ms, output and total tokens/s, and requests/s beside goodput
(requests/s meeting the report's objectives). Figures the run could not
observe (TTFT, TPOT and ITL without streaming) are null in the report and left
out of the picture, with a note. Steps with errors are marked with a red tick.
--table writes the same figures as a Markdown table (- for stdout).

Uses matplotlib when it is installed; otherwise a small built-in rasteriser
(lines, markers, a 5x7 pixel font, zlib-compressed PNG), so that CI machines
without matplotlib still produce the picture.
"""
import argparse
import json
import math
import struct
import sys
import zlib

SERIES = (("p50_ms", "p50", (31, 119, 180)), ("p90_ms", "p90", (255, 127, 14)),
          ("p99_ms", "p99", (214, 39, 40)))
THROUGHPUT = ("tokens_per_sec", "tokens/s", (44, 160, 44))

# Generation reports: (title, unit, [(field, label, colour)]) per panel.
GENERATE_PANELS = (
    ("end to end latency", "ms", SERIES),
    ("time to first token", "ms", (("ttft_p50_ms", "p50", (31, 119, 180)),
                                   ("ttft_p90_ms", "p90", (255, 127, 14)),
                                   ("ttft_p99_ms", "p99", (214, 39, 40)))),
    ("time per output token", "ms", (("tpot_p50_ms", "tpot p50", (148, 103, 189)),
                                     ("tpot_p99_ms", "tpot p99", (140, 86, 75)),
                                     ("itl_p50_ms", "itl p50", (23, 190, 207)),
                                     ("itl_p99_ms", "itl p99", (188, 189, 34)))),
    ("throughput", "tokens/s", (("output_tokens_per_sec", "output", (44, 160, 44)),
                                ("total_tokens_per_sec", "total", (127, 127, 127)))),
    ("requests", "requests/s", (("requests_per_sec", "requests", (31, 119, 180)),
                                ("goodput_per_sec", "goodput", (227, 119, 194)))),
)

# The table's columns: (field, heading, decimals).
LOGITS_COLUMNS = (("requests_per_sec", "req/s", 1), ("tokens_per_sec", "tok/s", 1),
                  ("p50_ms", "p50 ms", 2), ("p90_ms", "p90 ms", 2), ("p99_ms", "p99 ms", 2),
                  ("error_count", "errors", 0))
GENERATE_COLUMNS = (("requests_per_sec", "req/s", 2), ("goodput_per_sec", "goodput/s", 2),
                    ("output_tokens_per_sec", "output tok/s", 1),
                    ("total_tokens_per_sec", "total tok/s", 1),
                    ("ttft_p50_ms", "TTFT p50", 1), ("ttft_p99_ms", "TTFT p99", 1),
                    ("tpot_p50_ms", "TPOT p50", 2), ("tpot_p99_ms", "TPOT p99", 2),
                    ("itl_p50_ms", "ITL p50", 2), ("itl_p99_ms", "ITL p99", 2),
                    ("p50_ms", "e2e p50", 1), ("p90_ms", "e2e p90", 1), ("p99_ms", "e2e p99", 1),
                    ("error_count", "errors", 0))


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load(path):
    with open(path) as f:
        doc = json.load(f)
    steps = doc.get("steps") if isinstance(doc, dict) else None
    if not isinstance(steps, list) or not steps:
        raise ValueError("%s: no 'steps' (is it a tpserve-loadtest --json report?)" % path)
    first = steps[0] if isinstance(steps[0], dict) else {}
    key = "concurrency" if "concurrency" in first else "request_rate"
    for i, s in enumerate(steps):
        if not isinstance(s, dict) or not is_number(s.get(key)):
            raise ValueError("%s: step %d has no numeric '%s' (the first step's load axis)"
                             % (path, i, key))
    steps = sorted(steps, key=lambda s: s[key])
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        raise ValueError("%s: 'meta' is not an object" % path)
    return meta, key, steps


def is_generate(meta, steps):
    """Whether the report is of --mode generate (older reports have no meta.mode)."""
    return meta.get("mode") == "generate" or any("output_tokens_per_sec" in s for s in steps)


def unobserved_note(meta, steps):
    """Why TTFT / TPOT / ITL are missing, or ''."""
    if any(is_number(s.get("ttft_p50_ms")) for s in steps):
        return ""
    if meta.get("streaming") is False:
        return "ttft tpot itl: not observed without streaming"
    return "ttft tpot itl: no values"


def table(meta, key, steps):
    """The steps as a Markdown table (the figures of the picture, and goodput)."""
    cols = GENERATE_COLUMNS if is_generate(meta, steps) else LOGITS_COLUMNS
    lines = ["| %s | %s |" % (key.replace("_", " "), " | ".join(h for _, h, _ in cols)),
             "|" + "---:|" * (len(cols) + 1)]
    for s in steps:
        cells = []
        for field, _, prec in cols:
            v = s.get(field)
            cells.append("%.*f" % (prec, v) if is_number(v) else "-")
        lines.append("| %s | %s |" % (fmt_tick(s[key]), " | ".join(cells)))
    out = "\n".join(lines) + "\n"
    note = unobserved_note(meta, steps) if is_generate(meta, steps) else ""
    slo = [("TTFT <= %g ms" % meta["slo_ttft_ms"]) if is_number(meta.get("slo_ttft_ms")) else "",
           ("TPOT <= %g ms" % meta["slo_tpot_ms"]) if is_number(meta.get("slo_tpot_ms")) else ""]
    slo = " and ".join(x for x in slo if x)
    if is_generate(meta, steps):
        out += ("\nGoodput: requests/s meeting %s.\n" % slo if slo else
                "\nGoodput: no objective given (--slo-ttft-ms, --slo-tpot-ms), none reported.\n")
    if note:
        out += "\n%s (null in the report).\n" % note.replace("ttft tpot itl", "TTFT, TPOT, ITL")
    return out


def values(steps, key, field):
    """(load, value) per step; value None where the step has none (every
    request failed), so that lines break there instead of bridging it."""
    return [(s[key], s[field] if is_number(s.get(field)) else None) for s in steps]


# --- matplotlib path --------------------------------------------------------

def render_matplotlib(meta, key, steps, png, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if is_generate(meta, steps):
        return render_matplotlib_generate(meta, key, steps, png, title, plt)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for field, label, color in SERIES:
        pts = values(steps, key, field)
        if any(y is not None for _, y in pts):
            ax1.plot([p[0] for p in pts], [math.nan if p[1] is None else p[1] for p in pts],
                     "o-", label=label, color=[c / 255 for c in color])
    bad = [s[key] for s in steps if s.get("error_count")]
    for x in bad:
        ax1.axvline(x, color="red", alpha=0.3)
    ax1.set_xlabel(key.replace("_", " "))
    ax1.set_ylabel("latency (ms)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    pts = values(steps, key, THROUGHPUT[0])
    ax2.plot([p[0] for p in pts], [math.nan if p[1] is None else p[1] for p in pts], "o-",
             color="green", label="tokens/s")
    ax2.set_xlabel(key.replace("_", " "))
    ax2.set_ylabel("tokens/s")
    ax2.grid(alpha=0.3)
    fig.suptitle(title or "tpserve-loadtest: %s" % meta.get("model", ""))
    fig.tight_layout()
    fig.savefig(png, dpi=100, format="png")  # at --png as given, whatever its suffix


def render_matplotlib_generate(meta, key, steps, png, title, plt):
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    bad = [s[key] for s in steps if s.get("error_count")]
    for ax, (name, unit, series) in zip(axes.flat, GENERATE_PANELS):
        for field, label, color in series:
            pts = values(steps, key, field)
            if any(y is not None for _, y in pts):
                ax.plot([p[0] for p in pts], [math.nan if p[1] is None else p[1] for p in pts],
                        "o-", label=label, color=[c / 255 for c in color])
        for x in bad:
            ax.axvline(x, color="red", alpha=0.3)
        ax.set_title(name)
        ax.set_xlabel(key.replace("_", " "))
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    axes.flat[5].axis("off")
    note = unobserved_note(meta, steps)
    if note:
        axes.flat[5].text(0, 0.5, note, fontsize=11)
    fig.suptitle(title or "tpserve-loadtest generate: %s" % meta.get("model", ""))
    fig.tight_layout()
    fig.savefig(png, dpi=100, format="png")


# --- built-in rasteriser ----------------------------------------------------

# 5x7 glyphs: seven rows of five columns per character (# = ink).
FONT = {
    '0': (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    '1': ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    '2': (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    '3': ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    '4': ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    '5': ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    '6': ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    '7': ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    '8': (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    '9': (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    '.': (".....", ".....", ".....", ".....", ".....", ".##..", ".##.."),
    '-': (".....", ".....", ".....", "#####", ".....", ".....", "....."),
    '/': ("....#", "....#", "...#.", "..#..", ".#...", "#....", "#...."),
    '%': ("##..#", "##..#", "...#.", "..#..", ".#...", "#..##", "#..##"),
    '(': ("...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."),
    ')': (".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."),
    ':': (".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."),
    ' ': (".....", ".....", ".....", ".....", ".....", ".....", "....."),
    'a': (".....", ".....", ".###.", "....#", ".####", "#...#", ".####"),
    'b': ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "####."),
    'c': (".....", ".....", ".###.", "#....", "#....", "#...#", ".###."),
    'd': ("....#", "....#", ".##.#", "#..##", "#...#", "#...#", ".####"),
    'e': (".....", ".....", ".###.", "#...#", "#####", "#....", ".###."),
    'f': ("..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."),
    'g': (".....", ".####", "#...#", "#...#", ".####", "....#", ".###."),
    'h': ("#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    'i': ("..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."),
    'j': ("...#.", ".....", "..##.", "...#.", "...#.", "#..#.", ".##.."),
    'k': ("#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."),
    'l': (".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    'm': (".....", ".....", "##.#.", "#.#.#", "#.#.#", "#...#", "#...#"),
    'n': (".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"),
    'o': (".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."),
    'p': (".....", ".....", "####.", "#...#", "####.", "#....", "#...."),
    'q': (".....", ".....", ".##.#", "#..##", ".####", "....#", "....#"),
    'r': (".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."),
    's': (".....", ".....", ".###.", "#....", ".###.", "....#", "####."),
    't': (".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."),
    'u': (".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#"),
    'v': (".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    'w': (".....", ".....", "#...#", "#...#", "#.#.#", "#.#.#", ".#.#."),
    'x': (".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#"),
    'y': (".....", ".....", "#...#", "#...#", ".####", "....#", ".###."),
    'z': (".....", ".....", "#####", "...#.", "..#..", ".#...", "#####"),
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray([255] * (w * h * 3))

    def set(self, x, y, rgb):
        x, y = int(round(x)), int(round(y))
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(rgb)

    def line(self, x0, y0, x1, y1, rgb, width=1):
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(steps + 1):
            t = i / steps
            x, y = x0 + (x1 - x0) * t, y0 + (y1 - y0) * t
            for d in range(-(width // 2), width // 2 + 1):
                self.set(x + d, y, rgb)
                self.set(x, y + d, rgb)

    def box(self, x, y, r, rgb):
        for dx in range(-r, r + 1):
            for dy in range(-r, r + 1):
                self.set(x + dx, y + dy, rgb)

    def text(self, x, y, s, rgb=(0, 0, 0)):
        for ch in s.lower():
            for row, bits in enumerate(FONT.get(ch, FONT[" "])):
                for col, bit in enumerate(bits):
                    if bit == "#":
                        self.set(x + col, y + row, rgb)
            x += 6

    def png(self):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3])
                       for y in range(self.h))

        def chunk(tag, data):
            return (struct.pack(">I", len(data)) + tag + data +
                    struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))
        return (b"\x89PNG\r\n\x1a\n" +
                chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)) +
                chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def nice_ticks(lo, hi, n=5):
    if hi <= lo:
        hi = lo + 1
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    t = math.floor(lo / step) * step
    out = []
    while t <= hi + 1e-9:
        out.append(t)
        t += step
    if out[-1] < hi - 1e-9:
        out.append(out[-1] + step)
    return out


def fmt_tick(v):
    return ("%d" % v) if abs(v - round(v)) < 1e-9 else ("%.3g" % v)


def panel(cv, x0, y0, w, h, series, xlabel, ylabel, bad_x):
    xs = [x for _, pts, _ in series for x, _ in pts] or [0, 1]
    ys = [y for _, pts, _ in series for _, y in pts if y is not None] or [0, 1]
    xt = nice_ticks(min(xs), max(xs))
    yt = nice_ticks(0, max(ys) * 1.05)
    xlo, xhi, ylo, yhi = xt[0], xt[-1], yt[0], yt[-1]

    def to(x, y):
        return (x0 + (x - xlo) / ((xhi - xlo) or 1) * w, y0 + h - (y - ylo) / ((yhi - ylo) or 1) * h)
    for t in yt:
        _, py = to(xlo, t)
        cv.line(x0, py, x0 + w, py, (225, 225, 225))
        cv.text(x0 - 6 * len(fmt_tick(t)) - 4, py - 3, fmt_tick(t))
    for t in xt:
        px, _ = to(t, ylo)
        cv.line(px, y0, px, y0 + h, (225, 225, 225))
        cv.text(px - 3 * len(fmt_tick(t)), y0 + h + 6, fmt_tick(t))
    cv.line(x0, y0 + h, x0 + w, y0 + h, (0, 0, 0))
    cv.line(x0, y0, x0, y0 + h, (0, 0, 0))
    for x in bad_x:
        px, _ = to(x, ylo)
        cv.line(px, y0 + h - 10, px, y0 + h, (220, 0, 0), width=3)
    for i, (label, pts, rgb) in enumerate(series):
        prev = None
        for x, y in pts:
            if y is None:  # no value at this step: the line breaks
                prev = None
                continue
            p = to(x, y)
            cv.box(p[0], p[1], 2, rgb)
            if prev:
                cv.line(prev[0], prev[1], p[0], p[1], rgb, width=2)
            prev = p
        cv.box(x0 + 12, y0 + 10 + 12 * i, 3, rgb)
        cv.text(x0 + 20, y0 + 7 + 12 * i, label)
    cv.text(x0 + w // 2 - 3 * len(xlabel), y0 + h + 20, xlabel)
    cv.text(x0, y0 - 14, ylabel)


def render_builtin_generate(meta, key, steps, png, title):
    cv = Canvas(1500, 820)
    bad = [s[key] for s in steps if s.get("error_count")]
    for i, (name, unit, series) in enumerate(GENERATE_PANELS):
        x0, y0 = 80 + 490 * (i % 3), 60 + 390 * (i // 3)
        pts = [(label, values(steps, key, field), rgb) for field, label, rgb in series]
        panel(cv, x0, y0, 380, 300, pts, key.replace("_", " "), "%s (%s)" % (name, unit), bad)
        if not any(y is not None for _, p, _ in pts for _, y in p):
            cv.text(x0 + 100, y0 + 150, "no values in the report")
    note = unobserved_note(meta, steps)
    if note:
        cv.text(80 + 490 * 2, 60 + 390 + 150, note)
    cv.text(80, 15, title or "tpserve-loadtest generate: %s" % meta.get("model", ""))
    with open(png, "wb") as f:
        f.write(cv.png())


def render_builtin(meta, key, steps, png, title):
    if is_generate(meta, steps):
        return render_builtin_generate(meta, key, steps, png, title)
    cv = Canvas(1000, 420)
    bad = [s[key] for s in steps if s.get("error_count")]
    lat = [(label, values(steps, key, field), rgb) for field, label, rgb in SERIES]
    panel(cv, 70, 50, 380, 300, lat, key.replace("_", " "), "latency (ms)", bad)
    thr = [(THROUGHPUT[1], values(steps, key, THROUGHPUT[0]), THROUGHPUT[2])]
    panel(cv, 580, 50, 380, 300, thr, key.replace("_", " "), "throughput (tokens/s)", bad)
    cv.text(70, 15, title or "tpserve-loadtest: %s" % meta.get("model", ""))
    with open(png, "wb") as f:
        f.write(cv.png())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="tpserve-loadtest --json output")
    ap.add_argument("--png", help="where to write the picture")
    ap.add_argument("--table", help="where to write the Markdown table (- for stdout)")
    ap.add_argument("--title", default="", help="title (default: the model name)")
    ap.add_argument("--builtin", action="store_true",
                    help="use the built-in rasteriser even when matplotlib is installed")
    args = ap.parse_args(argv)
    if not args.png and not args.table:
        ap.error("give --png, --table or both")
    try:
        meta, key, steps = load(args.report)
    except (OSError, ValueError) as e:
        sys.stderr.write("render_loadtest: %s\n" % e)
        return 2
    except (TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        sys.stderr.write("render_loadtest: %s: malformed report (%s: %s)\n"
                         % (args.report, type(e).__name__, e))
        return 2
    if args.table:
        try:
            text = table(meta, key, steps)
            if args.table == "-":
                sys.stdout.write(text)
            else:
                with open(args.table, "w") as f:
                    f.write(text)
        except OSError as e:
            sys.stderr.write("render_loadtest: cannot write %s: %s\n" % (args.table, e))
            return 2
        except (TypeError, KeyError, AttributeError, OverflowError, ValueError) as e:
            sys.stderr.write("render_loadtest: %s: malformed report (%s: %s)\n"
                             % (args.report, type(e).__name__, e))
            return 2
    if not args.png:
        return 0
    try:
        try:
            if args.builtin:
                raise ImportError("--builtin")
            render_matplotlib(meta, key, steps, args.png, args.title)
        except ImportError:
            render_builtin(meta, key, steps, args.png, args.title)
    except OSError as e:  # --png not writable
        sys.stderr.write("render_loadtest: cannot write %s: %s\n" % (args.png, e))
        return 2
    except (TypeError, KeyError, AttributeError, OverflowError, ValueError) as e:
        sys.stderr.write("render_loadtest: %s: malformed report (%s: %s)\n"
                         % (args.report, type(e).__name__, e))
        return 2
    print("wrote %s (%d steps, x = %s)" % (args.png, len(steps), key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
