#!/usr/bin/env python3
"""Latency-vs-load PNG of a tpserve-loadtest JSON report.

  python3 benchmarks/render_loadtest.py REPORT.json --png OUT.png [--title TEXT]

Two panels over the sweep's load axis (concurrency, or request rate): latency
percentiles p50 / p90 / p99 in ms, and throughput in tokens/s. Steps
with errors are marked with a red tick (the report's JSON holds requests/s
and the rest per step).

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


def values(steps, key, field):
    """(load, value) per step; value None where the step has none (every
    request failed), so that lines break there instead of bridging it."""
    return [(s[key], s[field] if is_number(s.get(field)) else None) for s in steps]


# --- matplotlib path --------------------------------------------------------

def render_matplotlib(meta, key, steps, png, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


def render_builtin(meta, key, steps, png, title):
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
    ap.add_argument("--png", required=True, help="where to write the picture")
    ap.add_argument("--title", default="", help="title (default: the model name)")
    ap.add_argument("--builtin", action="store_true",
                    help="use the built-in rasteriser even when matplotlib is installed")
    args = ap.parse_args(argv)
    try:
        meta, key, steps = load(args.report)
    except (OSError, ValueError) as e:
        sys.stderr.write("render_loadtest: %s\n" % e)
        return 2
    except (TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        sys.stderr.write("render_loadtest: %s: malformed report (%s: %s)\n"
                         % (args.report, type(e).__name__, e))
        return 2
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
