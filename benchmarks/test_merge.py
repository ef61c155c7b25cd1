"""Tests of merge_results.py (standard library only)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import merge_results  # noqa: E402


def record(impl, method, ms):
    return {"impl": impl, "layer": "x", "op": "ag_gemm", "method": method, "dtype": "fp8",
            "tp": 2, "m": 512, "n": 64, "k": 64, "chunks": 1, "config": {}, "median_ms": ms,
            "min_ms": ms, "max_ms": ms, "mean_ms": ms, "stddev_ms": 0.0, "iqr_ms": 0.0,
            "rounds": 3}


class MergeTest(unittest.TestCase):
    def write(self, d, name, doc):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def test_several_ours_files_are_concatenated_with_the_first_meta(self):
        with tempfile.TemporaryDirectory() as d:
            sweep = self.write(d, "sweep.json", {
                "meta": {"commit": "abc", "device": "2x H200", "nccl": 22803, "cublaslt": 1},
                "records": [record("tpserve", "none", 1.0), record("tpserve", "ring", 0.8)]})
            auto = self.write(d, "auto.json", {
                "meta": {"commit": "abc", "device": "2x H200", "nccl": 99},
                "records": [record("tpserve", "auto", 0.7)],
                "skipped": [{"method": "x", "why": "y"}]})
            peer = self.write(d, "peer.json", {"meta": {"torch": "2.11"},
                                               "records": [record("torch", "torch_seq", 0.9)]})
            out = os.path.join(d, "merged.json")
            rc = merge_results.main(["--ours", sweep, "--ours", auto, "--peer", peer,
                                     "--date", "2026-11-30", "--command", "cmd", "--out", out])
            self.assertEqual(rc, 0)
            with open(out) as f:
                merged = json.load(f)
            self.assertEqual([r["method"] for r in merged["records"]],
                             ["none", "ring", "auto", "torch_seq"])
            self.assertEqual(merged["meta"]["nccl"], 22803)  # from the first --ours
            self.assertEqual(merged["meta"]["torch"], "2.11")
            self.assertEqual(merged["meta"]["command"], "cmd")
            self.assertEqual(len(merged["skipped"]), 1)
            self.assertEqual(merged["skipped"][0]["impl"], "tpserve")

    def test_planned_cases_of_every_ours_file_are_kept_once(self):
        with tempfile.TemporaryDirectory() as d:
            a = {"layer": "x", "m": 512, "dtype": "fp8"}
            b = {"layer": "seed", "m": 65536, "dtype": "fp8"}
            sweep = self.write(d, "sweep.json", {
                "meta": {"commit": "abc", "planned_cases": [a], "gemm_algo": "timed"},
                "records": [record("tpserve", "none", 1.0)]})
            auto = self.write(d, "auto.json", {"meta": {"planned_cases": [a]},
                                               "records": [record("tpserve", "auto", 0.7)]})
            seed = self.write(d, "seed.json", {"meta": {"planned_cases": [b]}, "records": []})
            out = os.path.join(d, "merged.json")
            rc = merge_results.main(["--ours", sweep, "--ours", auto, "--ours", seed,
                                     "--out", out])
            self.assertEqual(rc, 0)
            with open(out) as f:
                meta = json.load(f)["meta"]
            self.assertEqual(meta["planned_cases"], [a, b])
            self.assertEqual(meta["gemm_algo"], "timed")

    def test_several_presets_merge_into_one_file(self):
        # One file per session: each preset's sweep and each preset's peer run.
        with tempfile.TemporaryDirectory() as d:
            ours = [self.write(d, "o%d.json" % i, {"meta": {"commit": "abc"},
                                                   "records": [record("tpserve", m, 1.0)]})
                    for i, m in enumerate(("none", "ring"))]
            peers = [self.write(d, "p%d.json" % i, {"meta": {"torch": "2.%d" % i},
                                                    "records": [record("torch", m, 0.9)]})
                     for i, m in enumerate(("torch_seq", "torch_symm_mem"))]
            peers.append(self.write(d, "p2.json", {"meta": {}, "records": [],
                                                   "skipped": [{"method": "s", "why": "w"}]}))
            out = os.path.join(d, "merged.json")
            argv = ["--out", out]
            for o in ours:
                argv += ["--ours", o]
            for p in peers:
                argv += ["--peer", p]
            self.assertEqual(merge_results.main(argv), 0)
            with open(out) as f:
                merged = json.load(f)
            self.assertEqual([(r["impl"], r["method"]) for r in merged["records"]],
                             [("tpserve", "none"), ("tpserve", "ring"),
                              ("torch", "torch_seq"), ("torch", "torch_symm_mem")])
            self.assertEqual(merged["meta"]["torch"], "2.0")  # from the first --peer
            self.assertEqual(merged["skipped"], [{"method": "s", "why": "w", "impl": "torch"}])

    def test_peer_passes_are_pooled_into_one_record_per_case_and_method(self):
        def timed(method, times, **extra):
            r = record("torch", method, 0.0)
            r["times_ms"] = times
            r.update(extra)
            return r
        with tempfile.TemporaryDirectory() as d:
            pre = self.write(d, "pre.json", {"meta": {"torch": "2.11"}, "records": [
                timed("torch_seq", [1.0, 1.2, 1.1], check_rel_diff_vs_seq=0.0),
                timed("torch_symm_mem", [2.0, 2.0])]})
            post = self.write(d, "post.json", {"meta": {"torch": "2.11"}, "records": [
                timed("torch_symm_mem", [1.0, 3.0]),
                timed("torch_seq", [0.9, 1.3, 1.4], check_rel_diff_vs_seq=0.0),
                # Only in one pass: kept as it is.
                timed("torch_chunked", [5.0])]})
            out = os.path.join(d, "merged.json")
            argv = ["--peer", pre, "--peer", post, "--pool-peer-passes", "--out", out]
            self.assertEqual(merge_results.main(argv), 0)
            with open(out) as f:
                merged = json.load(f)
            recs = {r["method"]: r for r in merged["records"]}
            self.assertEqual([r["method"] for r in merged["records"]],
                             ["torch_seq", "torch_symm_mem", "torch_chunked"])
            seq = recs["torch_seq"]
            self.assertEqual(seq["passes"], 2)
            self.assertEqual(seq["rounds"], 6)
            self.assertEqual(sorted(seq["times_ms"]), [0.9, 1.0, 1.1, 1.2, 1.3, 1.4])
            self.assertAlmostEqual(seq["median_ms"], 1.15)
            self.assertAlmostEqual(seq["min_ms"], 0.9)
            self.assertAlmostEqual(seq["max_ms"], 1.4)
            self.assertAlmostEqual(recs["torch_symm_mem"]["median_ms"], 2.0)
            self.assertAlmostEqual(recs["torch_symm_mem"]["iqr_ms"], 0.5)
            self.assertNotIn("passes", recs["torch_chunked"])
            # Without the flag the passes stay separate records.
            self.assertEqual(merge_results.main(["--peer", pre, "--peer", post, "--out", out]), 0)
            with open(out) as f:
                self.assertEqual(len(json.load(f)["records"]), 5)

    def test_passes_without_times_are_not_pooled(self):
        recs = [record("torch", "torch_seq", 1.0), record("torch", "torch_seq", 2.0)]
        self.assertEqual(merge_results.pool_passes(recs), recs)
        # A different config is a different case.
        a, b = dict(record("torch", "torch_seq", 1.0)), dict(record("torch", "torch_seq", 2.0))
        a["times_ms"], b["times_ms"] = [1.0], [2.0]
        b["config"] = {"graph": False}
        self.assertEqual(len(merge_results.pool_passes([a, b])), 2)

    def test_a_file_without_records_is_an_error_naming_it(self):
        with tempfile.TemporaryDirectory() as d:
            bad = self.write(d, "bad.json", {"meta": {}})
            r = subprocess.run([sys.executable, os.path.join(HERE, "merge_results.py"),
                                "--ours", bad, "--out", os.path.join(d, "m.json")],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 1)
            self.assertIn("bad.json", r.stderr)
            self.assertIn("records", r.stderr)

    def test_malformed_inputs_and_outputs_are_errors_not_tracebacks(self):
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(HERE, "merge_results.py")
            good = self.write(d, "ours.json", {"meta": {}, "records": [record("tpserve", "none",
                                                                              1.0)]})
            bad_times = record("torch", "torch_seq", 1.0)
            bad_times["times_ms"] = ["x", "y"]
            peer = self.write(d, "peer.json", {"meta": {}, "records": [bad_times]})
            for args, says in (
                    (["--ours", good, "--out", d], "is a directory"),
                    (["--ours", good, "--peer", peer, "--peer", peer, "--pool-peer-passes",
                      "--out",
                      os.path.join(d, "m.json")], "could not convert string to float"),
                    (["--ours", good, "--date", "2026-13-45", "--out",
                      os.path.join(d, "m.json")], "--date must be a date")):
                r = subprocess.run([sys.executable, script] + args, capture_output=True,
                                   text=True)
                self.assertNotEqual(r.returncode, 0, args)
                self.assertIn(says, r.stderr, args)
                self.assertNotIn("Traceback", r.stderr, args)
            self.assertFalse(os.path.exists(d + ".tmp"))

    def test_a_missing_input_is_left_out_and_the_rest_still_written(self):
        with tempfile.TemporaryDirectory() as d:
            ours = self.write(d, "ours.json", {"meta": {"commit": "abc"}, "skipped": None,
                                               "records": [record("tpserve", "none", 1.0)]})
            gone = os.path.join(d, "peer-pre.json")
            out = os.path.join(d, "m.json")
            r = subprocess.run([sys.executable, os.path.join(HERE, "merge_results.py"),
                                "--ours", ours, "--peer", gone, "--out", out],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)  # not a complete run
            self.assertIn("peer-pre.json: no such file", r.stderr)
            with open(out) as f:
                merged = json.load(f)
            self.assertEqual([x["impl"] for x in merged["records"]], ["tpserve"])
            self.assertEqual(merged["missing_inputs"], [gone])
            r = subprocess.run([sys.executable, os.path.join(HERE, "merge_results.py"),
                                "--peer", gone, "--out", out], capture_output=True, text=True)
            self.assertEqual(r.returncode, 1)
            self.assertIn("none of the inputs exists", r.stderr)


if __name__ == "__main__":
    unittest.main()
