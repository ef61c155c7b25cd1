"""Tests of benchmarks/compare (plain unittest; from the repository root):

  python3 -m unittest benchmarks/test_compare.py

Each test writes its results files into a temporary directory and runs the
script as a subprocess, as the nightly check does.
"""

import copy
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare")


def record(layer="llama70b.qkv", op="ag_gemm", method="pipeline", dtype="fp8", m=512,
           n=10240, k=8192, chunks=2, median=1.0, impl="tpserve", **config):
    cfg = {"chunks": chunks, "copy_engine": False, "cta_policy": "default",
           "fast_accum": False, "max_ctas": 0, "min_ctas": 0, "mode": method}
    cfg.update(config)
    r = {"impl": impl, "op": op, "method": method, "dtype": dtype, "tp": 2, "m": m,
         "n": n, "k": k, "chunks": chunks, "config": cfg, "median_ms": median,
         "min_ms": median * 0.9, "max_ms": median * 1.2, "mean_ms": median,
         "stddev_ms": 0.01, "iqr_ms": 0.01, "rounds": 30}
    if layer is not None:
        r["layer"] = layer
    return r


def results(records):
    return {"meta": {"commit": "0" * 40, "date": "2026-11-30", "device": "2x NVIDIA H200"},
            "records": records}


def base_records():
    return [
        record(method="none", chunks=1, median=0.07),
        record(method="pipeline", chunks=2, median=0.09),
        record(method="ring", chunks=2, median=0.088),
        record(method="ring", chunks=2, median=0.082, max_ctas=8),
        record(layer="llama70b.o", op="gemm_rs", n=8192, method="pipeline", chunks=4,
               median=0.2, copy_engine=True, cta_policy="zero"),
        record(impl="torch", method="torch_seq", chunks=1, median=0.068),
    ]


class CompareTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def write(self, name, data, raw=False):
        path = os.path.join(self.tmp.name, name)
        with open(path, "w") as f:
            f.write(data if raw else json.dumps(data, indent=1))
        return path

    def run_compare(self, old, new, *args):
        p = subprocess.run([sys.executable, SCRIPT, old, new] + list(args),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True)
        return p.returncode, p.stdout, p.stderr

    def summary(self, out):
        return [l for l in out.splitlines() if "cases compared" in l][-1]

    def row(self, out, *words):
        """The table row that has every word."""
        rows = [l for l in out.splitlines()
                if l.startswith(("tpserve ", "torch ")) and all(w in l for w in words)]
        self.assertEqual(len(rows), 1, "%r in:\n%s" % (words, out))
        return rows[0]

    def test_identical_files(self):
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(base_records()))
        rc, out, err = self.run_compare(old, new)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("5 cases compared, 0 slower than threshold, 0 faster, "
                      "0 only in OLD, 0 only in NEW", out)
        rows = [l for l in out.splitlines() if l.startswith("tpserve ")]
        self.assertEqual(len(rows), 5, out)
        for l in rows:
            self.assertTrue(l.endswith("1.000"), l)  # ratio 1, no flag
        self.assertNotIn("torch_seq", out)
        # Same file on both sides.
        rc, out, err = self.run_compare(old, old, "--impl", "all")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("6 cases compared, 0 slower than threshold", out)

    def test_runs_of_one_session_are_separate_cases(self):
        # A session file: the sweep and the auto run both time plain none.
        def session(auto_none):
            sweep = [dict(r, run="sweep") for r in base_records() if r["impl"] == "tpserve"]
            auto = dict(record(method="none", chunks=1, median=auto_none), run="auto")
            return results(sweep + [auto])
        old = self.write("old.json", session(0.065))
        new = self.write("new.json", session(0.065 * 1.2))
        rc, out, err = self.run_compare(old, old)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("6 cases compared, 0 slower than threshold", out)
        rc, out, err = self.run_compare(old, new)
        self.assertEqual(rc, 1, out + err)
        slow = self.row(out, "SLOWER")
        self.assertIn("run=auto", slow)
        self.assertIn(" none c=1", slow)
        # Without the tags the two none records are one key: bad input.
        untagged = session(0.065)
        for r in untagged["records"]:
            del r["run"]
        rc, out, err = self.run_compare(self.write("untagged.json", untagged), old)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("have the same key", err)

    def test_ten_percent_slower_is_flagged(self):
        new_records = base_records()
        new_records[2]["median_ms"] = 0.088 * 1.10  # ring c=2, max_ctas 0
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new, "--threshold", "5")
        self.assertEqual(rc, 1, out + err)
        self.assertIn("5 cases compared, 1 slower than threshold, 0 faster, "
                      "0 only in OLD, 0 only in NEW", out)
        slow = self.row(out, "SLOWER")
        self.assertIn(" ring c=2", slow)
        self.assertNotIn("max_ctas", slow)
        self.assertIn("1.100", slow)
        self.assertIn("0.0880", slow)
        self.assertIn("0.0968", slow)
        # The other ring row (max_ctas=8) is not flagged.
        self.assertFalse(self.row(out, "ring", "max_ctas=8").rstrip().endswith("SLOWER"))

    def test_within_threshold(self):
        new_records = base_records()
        new_records[2]["median_ms"] = 0.088 * 1.04
        new_records[1]["median_ms"] = 0.09 * 0.97
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new, "--threshold", "5")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("5 cases compared, 0 slower than threshold, 0 faster", out)
        # The same change counts with a smaller threshold.
        rc, out, err = self.run_compare(old, new, "--threshold", "2")
        self.assertEqual(rc, 1, out + err)
        self.assertIn("1 slower than threshold, 1 faster", out)
        self.assertTrue(self.row(out, "pipeline c=2").rstrip().endswith("faster"))

    def test_faster_is_not_a_failure(self):
        new_records = base_records()
        new_records[0]["median_ms"] = 0.05
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("0 slower than threshold, 1 faster", out)
        self.assertTrue(self.row(out, " none c=1").rstrip().endswith("faster"))

    def test_missing_records_key(self):
        old = self.write("old.json", results(base_records()))
        bad = self.write("bad.json", {"meta": {}, "recs": []})
        rc, out, err = self.run_compare(old, bad)
        self.assertEqual(rc, 2, out + err)
        self.assertIn(bad, err)
        self.assertIn("records", err)
        self.assertNotIn(old, err)
        rc, out, err = self.run_compare(bad, old)
        self.assertEqual(rc, 2, out + err)
        self.assertIn(bad, err)

    def test_record_missing_key_field(self):
        new_records = base_records()
        del new_records[3]["op"]
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new)
        self.assertEqual(rc, 2, out + err)
        self.assertIn(new, err)
        self.assertIn("record 3", err)
        self.assertIn('"op"', err)

    def test_unreadable_and_not_json(self):
        old = self.write("old.json", results(base_records()))
        rc, out, err = self.run_compare(old, os.path.join(self.tmp.name, "nope.json"))
        self.assertEqual(rc, 2, out + err)
        self.assertIn("nope.json", err)
        junk = self.write("junk.json", "{not json", raw=True)
        rc, out, err = self.run_compare(junk, old)
        self.assertEqual(rc, 2, out + err)
        self.assertIn(junk, err)
        self.assertIn("not JSON", err)

    def test_malformed_input_is_bad_input_not_slower(self):
        # Exit 1 means "a case is slower": a file this script cannot read must never end
        # with it (a traceback would).
        old = self.write("old.json", results(base_records()))
        huge = base_records()
        huge[0]["median_ms"] = 10 ** 400  # an integer beyond float's range
        deep = self.write("deep.json", "[" * 200000 + "]" * 200000, raw=True)
        for bad in (self.write("huge.json", results(huge)), deep):
            rc, out, err = self.run_compare(old, bad)
            self.assertEqual(rc, 2, out + err)
            self.assertNotIn("Traceback", err)

    def test_only_in_one_side(self):
        old_records = base_records() + [record(method="ring", chunks=8, median=0.17)]
        new_records = base_records()[1:] + [record(m=2048, method="pipeline", median=0.3)]
        old = self.write("old.json", results(old_records))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new)
        self.assertEqual(rc, 3, out + err)  # cases lost from OLD fail a nightly check
        self.assertIn("2 case(s) of OLD missing from NEW", err)
        rc, out, err = self.run_compare(old, new, "--allow-missing")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("4 cases compared, 0 slower than threshold, 0 faster, "
                      "2 only in OLD, 1 only in NEW", out)
        lines = out.splitlines()
        i_old = lines.index("only in OLD (2):")
        i_new = lines.index("only in NEW (1):")
        only_old = lines[i_old + 1:i_new]
        self.assertTrue(any(" none c=1" in l and "m=512" in l for l in only_old), out)
        self.assertTrue(any(" ring c=8" in l for l in only_old), out)
        self.assertIn("m=2048", lines[i_new + 1])
        self.assertIn(" pipeline c=2", lines[i_new + 1])

    def test_config_key_order_does_not_matter(self):
        new_records = copy.deepcopy(base_records())
        for r in new_records:
            r["config"] = dict(reversed(list(r["config"].items())))
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        # The files really spell the configs in different orders.
        def config_fields(path):
            with open(path) as f:
                data = json.load(f, object_pairs_hook=lambda pairs: pairs)
            records = dict(data)["records"]
            return [[k for k, _ in dict(r)["config"]] for r in records]
        old_fields, new_fields = config_fields(old), config_fields(new)
        self.assertEqual(old_fields[0][0], "chunks")
        for a, b in zip(old_fields, new_fields):
            self.assertEqual(a, b[::-1])
        rc, out, err = self.run_compare(old, new, "--impl", "all")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("6 cases compared, 0 slower than threshold, 0 faster, "
                      "0 only in OLD, 0 only in NEW", out)

    def test_config_value_difference_is_another_case(self):
        new_records = base_records()
        new_records[1]["config"]["max_ctas"] = 16
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new, "--allow-missing")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("4 cases compared", out)
        self.assertIn("1 only in OLD, 1 only in NEW", out)

    def test_older_records_with_removed_knobs_match_newer_ones(self):
        # Files written before gemm_sm_count and gemm_lanes were removed carry them in every
        # tpserve record, at 0 (all SMs) and 1 (one GEMM stream): the same cases as records
        # without them. Another value measured something no longer run: its own case.
        old_records = base_records()
        for r in old_records:
            if r["impl"] == "tpserve":
                r["config"].update(gemm_sm_count=0, gemm_lanes=1)
        old_records.append(record(method="ring", chunks=2, median=0.08, gemm_lanes=2))
        old = self.write("old.json", results(old_records))
        new = self.write("new.json", results(base_records()))
        rc, out, err = self.run_compare(old, new, "--allow-missing")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("5 cases compared, 0 slower than threshold, 0 faster, "
                      "1 only in OLD, 0 only in NEW", out)
        lines = out.splitlines()
        only_old = lines[lines.index("only in OLD (1):") + 1]
        self.assertIn("\"gemm_lanes\":2", only_old)
        self.assertNotIn("gemm_sm_count", out)
        # Only the one that cannot be matched is lost.
        rc, out, err = self.run_compare(old, new)
        self.assertEqual(rc, 3, out + err)
        self.assertIn("1 case(s) of OLD missing from NEW", err)

    def test_nothing_in_common_is_an_error(self):
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results([record(m=4096, median=0.3)]))
        rc, out, err = self.run_compare(old, new, "--allow-missing")
        self.assertEqual(rc, 2, out + err)
        self.assertIn("no case is in both files", err)

    def test_impl_filter(self):
        new_records = base_records()
        new_records[5]["median_ms"] = 1.0  # torch much slower
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new)  # default: tpserve only
        self.assertEqual(rc, 0, out + err)
        self.assertNotIn("torch_seq", out)
        rc, out, err = self.run_compare(old, new, "--impl", "all")
        self.assertEqual(rc, 1, out + err)
        self.assertTrue(self.row(out, "torch_seq").rstrip().endswith("SLOWER"))
        rc, out, err = self.run_compare(old, new, "--impl", "torch")
        self.assertEqual(rc, 1, out + err)
        self.assertIn("1 cases compared, 1 slower than threshold", out)

    def test_layer_is_optional(self):
        old_records = [record(layer=None, median=1.0), record(median=1.0)]
        new_records = [record(layer=None, median=1.2), record(median=1.0)]
        old = self.write("old.json", results(old_records))
        new = self.write("new.json", results(new_records))
        rc, out, err = self.run_compare(old, new)
        self.assertEqual(rc, 1, out + err)
        self.assertIn("2 cases compared, 1 slower than threshold", out)
        self.assertNotIn("llama70b.qkv", self.row(out, "SLOWER"))

    def test_metric_option(self):
        new_records = base_records()
        new_records[0]["min_ms"] *= 1.5
        old = self.write("old.json", results(base_records()))
        new = self.write("new.json", results(new_records))
        self.assertEqual(self.run_compare(old, new)[0], 0)
        rc, out, err = self.run_compare(old, new, "--metric", "min_ms")
        self.assertEqual(rc, 1, out + err)
        self.assertIn("metric min_ms", out)
        rc, out, err = self.run_compare(old, new, "--metric", "p99_ms")
        self.assertEqual(rc, 2, out + err)
        self.assertIn("p99_ms", err)
        self.assertIn("record 0", err)


if __name__ == "__main__":
    unittest.main()
