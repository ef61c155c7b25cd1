"""Timing statistics shared by the Python benchmarks (standard library only):
the same definitions as bench_layers.cc's Stats, so that both
implementations' records mean the same thing."""

import math


def summarize(times_ms):
    """Quantiles by linear interpolation, sample standard deviation,
    IQR = q75 - q25, over the per-round times in ms."""
    t = sorted(float(v) for v in times_ms)
    n = len(t)
    if n == 0:
        raise ValueError("no timings")

    def q(p):
        pos = p * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return t[lo] + (t[hi] - t[lo]) * (pos - lo)

    mean = sum(t) / n
    var = sum((v - mean) ** 2 for v in t)
    return {
        "median_ms": q(0.5),
        "min_ms": t[0],
        "max_ms": t[-1],
        "mean_ms": mean,
        "stddev_ms": math.sqrt(var / (n - 1)) if n > 1 else 0.0,
        "iqr_ms": q(0.75) - q(0.25),
        "rounds": n,
    }
