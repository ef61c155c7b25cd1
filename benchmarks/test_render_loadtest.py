"""Tests of render_loadtest.py (no GPU, no matplotlib needed): the built-in
rasteriser writes a valid PNG with the series drawn, and bad input is an
error naming the file."""
import json
import os
import struct
import sys
import tempfile
import unittest
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import render_loadtest  # noqa: E402


def read_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        tag = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        chunks.setdefault(tag, b"")
        chunks[tag] += body
        pos += 12 + n
    w, h = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (w * 3 + 1) + 1:(y + 1) * (w * 3 + 1)] for y in range(h)]
    return w, h, rows


def count(rows, rgb):
    target = bytes(rgb)
    return sum(1 for row in rows for i in range(0, len(row), 3) if row[i:i + 3] == target)


class RenderLoadtestTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def report(self, steps):
        path = os.path.join(self.tmp.name, "report.json")
        with open(path, "w") as f:
            json.dump({"meta": {"model": "tiny"}, "steps": steps}, f)
        return path

    def test_builtin_png_has_every_series(self):
        steps = [{"concurrency": c, "tokens_per_sec": 1000.0 * c, "p50_ms": 5.0 + c,
                  "p90_ms": 6.0 + 2 * c, "p99_ms": 7.0 + 3 * c, "error_count": 0}
                 for c in (1, 2, 4, 8, 16)]
        png = os.path.join(self.tmp.name, "out.png")
        self.assertEqual(render_loadtest.main([self.report(steps), "--png", png, "--builtin"]),
                         0)
        w, h, rows = read_png(png)
        self.assertEqual((w, h), (1000, 420))
        for _, _, rgb in render_loadtest.SERIES:
            self.assertGreater(count(rows, rgb), 100, rgb)  # a drawn line, not a stray pixel
        self.assertGreater(count(rows, render_loadtest.THROUGHPUT[2]), 100)

    def test_request_rate_reports_and_nulls(self):
        steps = [{"request_rate": 10.0, "tokens_per_sec": 500.0, "p50_ms": 3.0, "p90_ms": None,
                  "p99_ms": 4.0, "error_count": 1},
                 {"request_rate": 20.0, "tokens_per_sec": 900.0, "p50_ms": 3.5, "p90_ms": 5.0,
                  "p99_ms": 6.0, "error_count": 0}]
        png = os.path.join(self.tmp.name, "rate.png")
        self.assertEqual(render_loadtest.main([self.report(steps), "--png", png, "--builtin"]),
                         0)
        _, _, rows = read_png(png)
        self.assertGreater(count(rows, (220, 0, 0)), 5)  # the error tick

    def test_a_step_without_values_breaks_the_line(self):
        # The middle step had no successful request: no latency, no tokens/s.
        steps = [{"concurrency": 1, "tokens_per_sec": 1000.0, "p50_ms": 100.0, "p90_ms": 100.0,
                  "p99_ms": 100.0, "error_count": 0},
                 {"concurrency": 2, "tokens_per_sec": None, "p50_ms": None, "p90_ms": None,
                  "p99_ms": None, "error_count": 5},
                 {"concurrency": 3, "tokens_per_sec": 1000.0, "p50_ms": 100.0, "p90_ms": 100.0,
                  "p99_ms": 100.0, "error_count": 0}]
        png = os.path.join(self.tmp.name, "gap.png")
        self.assertEqual(render_loadtest.main([self.report(steps), "--png", png, "--builtin"]),
                         0)
        _, _, rows = read_png(png)
        # The same steps with the middle one filled in: one long line each.
        full = [dict(s, tokens_per_sec=1000.0, p50_ms=100.0, p90_ms=100.0, p99_ms=100.0)
                for s in steps]
        joined_png = os.path.join(self.tmp.name, "joined.png")
        self.assertEqual(
            render_loadtest.main([self.report(full), "--png", joined_png, "--builtin"]), 0)
        _, _, joined = read_png(joined_png)
        # Broken at the gap, each colour is its markers and legend box only.
        for rgb in (render_loadtest.SERIES[2][2], render_loadtest.THROUGHPUT[2]):
            self.assertLess(count(rows, rgb), 150, rgb)
            self.assertGreater(count(joined, rgb), 400, rgb)

    def test_bad_steps_are_errors_naming_the_step(self):
        for steps in ([{"concurrency": 1}, {"p50_ms": 3.0}], [{"concurrency": 1}, 7],
                      [{"concurrency": "4"}]):
            path = self.report(steps)
            png = os.path.join(self.tmp.name, "x.png")
            with self.assertRaises(ValueError) as ctx:
                render_loadtest.load(path)
            self.assertIn("step", str(ctx.exception))
            self.assertEqual(render_loadtest.main([path, "--png", png]), 2)
            self.assertFalse(os.path.exists(png))
        path = os.path.join(self.tmp.name, "list.json")
        with open(path, "w") as f:
            json.dump([1, 2], f)
        self.assertEqual(render_loadtest.main([path, "--png", png]), 2)

    def test_png_is_written_at_the_given_path(self):
        # matplotlib picks the format from the suffix (none: it appends .png;
        # .jpg: a JPEG): the picture must be a PNG at --png as given.
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("matplotlib is not installed")
        path = self.report([{"concurrency": c, "tokens_per_sec": 1.0, "p50_ms": 1.0,
                             "p90_ms": 2.0, "p99_ms": 3.0, "error_count": 0} for c in (1, 2)])
        for name in ("out", "out.jpg"):
            png = os.path.join(self.tmp.name, name)
            self.assertEqual(render_loadtest.main([path, "--png", png]), 0)
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n", name)
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "out.png")))

    def test_unwritable_png_is_an_error(self):
        path = self.report([{"concurrency": 1, "tokens_per_sec": 1.0, "p50_ms": 1.0}])
        for png in (os.path.join(self.tmp.name, "no", "such", "dir", "x.png"), self.tmp.name):
            for extra in (["--builtin"], []):
                with self.subTest(png=png, extra=extra):
                    self.assertEqual(render_loadtest.main([path, "--png", png] + extra), 2)

    def test_a_malformed_report_is_an_error_not_a_traceback(self):
        path = os.path.join(self.tmp.name, "meta.json")
        with open(path, "w") as f:
            json.dump({"meta": [1], "steps": [{"concurrency": 1, "p50_ms": 1.0}]}, f)
        png = os.path.join(self.tmp.name, "x.png")
        self.assertEqual(render_loadtest.main([path, "--png", png, "--builtin"]), 2)
        self.assertFalse(os.path.exists(png))

    def test_not_a_report_is_an_error(self):
        path = os.path.join(self.tmp.name, "bad.json")
        with open(path, "w") as f:
            json.dump({"records": []}, f)
        png = os.path.join(self.tmp.name, "x.png")
        self.assertEqual(render_loadtest.main([path, "--png", png]), 2)
        self.assertFalse(os.path.exists(png))


def generate_steps(streaming=True):
    """A --mode generate report's steps (TTFT, TPOT and ITL null without streaming)."""
    steps = []
    for c in (1, 2, 4, 8):
        s = {"concurrency": c, "requests_per_sec": 2.0 * c, "goodput_per_sec": 1.5 * c,
             "tokens_per_sec": 64.0 * c, "output_tokens_per_sec": 256.0 * c,
             "total_tokens_per_sec": 320.0 * c, "p50_ms": 400.0 + c, "p90_ms": 450.0 + 2 * c,
             "p99_ms": 500.0 + 3 * c, "error_count": 0}
        for name, base in (("ttft", 40.0), ("tpot", 10.0), ("itl", 9.0)):
            for q, k in (("p50", 1.0), ("p90", 1.5), ("p99", 2.0)):
                s["%s_%s_ms" % (name, q)] = base * k + c if streaming else None
        steps.append(s)
    return steps


class RenderGenerateTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def report(self, steps, **meta):
        path = os.path.join(self.tmp.name, "gen.json")
        with open(path, "w") as f:
            json.dump({"meta": dict({"model": "tiny", "mode": "generate"}, **meta),
                       "steps": steps}, f)
        return path

    def test_builtin_png_has_every_generation_series(self):
        png = os.path.join(self.tmp.name, "gen.png")
        path = self.report(generate_steps(), streaming=True, slo_ttft_ms=50)
        self.assertEqual(render_loadtest.main([path, "--png", png, "--builtin"]), 0)
        w, h, rows = read_png(png)
        self.assertEqual((w, h), (1500, 820))
        for _, _, series in render_loadtest.GENERATE_PANELS:
            for field, _, rgb in series:
                # Colours shared between panels (p50 of e2e and TTFT) count twice: >= one line.
                self.assertGreater(count(rows, rgb), 100, field)

    def test_unary_report_leaves_ttft_out_with_a_note(self):
        png = os.path.join(self.tmp.name, "unary.png")
        path = self.report(generate_steps(streaming=False), streaming=False)
        self.assertEqual(render_loadtest.main([path, "--png", png, "--builtin"]), 0)
        _, _, rows = read_png(png)
        tpot = render_loadtest.GENERATE_PANELS[2][2]
        for _, _, rgb in tpot:
            self.assertLess(count(rows, rgb), 60, rgb)  # the legend box only, no line
        meta, _, steps = render_loadtest.load(path)
        self.assertIn("not observed without streaming",
                      render_loadtest.unobserved_note(meta, steps))

    def test_table_has_the_generation_figures(self):
        path = self.report(generate_steps(), streaming=True, slo_ttft_ms=50, slo_tpot_ms=12)
        out = os.path.join(self.tmp.name, "gen.md")
        self.assertEqual(render_loadtest.main([path, "--table", out]), 0)
        with open(out) as f:
            text = f.read()
        lines = text.splitlines()
        head = [c.strip() for c in lines[0].strip("|").split("|")]
        self.assertEqual(head[:5], ["concurrency", "req/s", "goodput/s", "output tok/s",
                                    "total tok/s"])
        for col in ("TTFT p50", "TTFT p99", "TPOT p50", "ITL p99", "e2e p50", "e2e p99"):
            self.assertIn(col, head)
        first = [c.strip() for c in lines[2].strip("|").split("|")]
        self.assertEqual(first[:5], ["1", "2.00", "1.50", "256.0", "320.0"])
        self.assertEqual(first[head.index("TTFT p50")], "41.0")
        self.assertEqual(len([ln for ln in lines if ln.startswith("| ")]), 5)  # head + 4 steps
        self.assertIn("TTFT <= 50 ms and TPOT <= 12 ms", text)

    def test_table_of_a_unary_report_shows_nulls_as_dashes(self):
        path = self.report(generate_steps(streaming=False), streaming=False)
        out = os.path.join(self.tmp.name, "unary.md")
        self.assertEqual(render_loadtest.main([path, "--table", out]), 0)
        with open(out) as f:
            text = f.read()
        lines = text.splitlines()
        head = [c.strip() for c in lines[0].strip("|").split("|")]
        row = [c.strip() for c in lines[2].strip("|").split("|")]
        for col in ("TTFT p50", "TPOT p99", "ITL p50"):
            self.assertEqual(row[head.index(col)], "-", col)
        self.assertEqual(row[head.index("e2e p50")], "401.0")
        self.assertIn("not observed without streaming", text)

    def test_logits_table_and_needs_an_output(self):
        path = os.path.join(self.tmp.name, "logits.json")
        with open(path, "w") as f:
            json.dump({"meta": {"model": "tiny"},
                       "steps": [{"request_rate": 2.5, "requests_per_sec": 2.4,
                                  "tokens_per_sec": 40.0, "p50_ms": 3.0, "p90_ms": 4.0,
                                  "p99_ms": 5.0, "error_count": 0}]}, f)
        out = os.path.join(self.tmp.name, "logits.md")
        self.assertEqual(render_loadtest.main([path, "--table", out]), 0)
        with open(out) as f:
            lines = f.read().splitlines()
        self.assertTrue(lines[0].startswith("| request rate | req/s | tok/s |"), lines[0])
        self.assertTrue(lines[2].startswith("| 2.5 | 2.4 | 40.0 |"), lines[2])
        with self.assertRaises(SystemExit):
            render_loadtest.main([path])  # neither --png nor --table


if __name__ == "__main__":
    unittest.main()
