"""Tests of render_results.criteria (no GPU): the issue-4 checks computed from
a results file's records."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import render_results  # noqa: E402


def rec(impl, method, median, layer="llama70b.qkv", m=8192, dtype="fp8", run=None,
        checked=True):
    """A record as the harnesses write it: layer methods carry their
    correctness check (tpserve: vs mode none; PyTorch: vs torch_seq)."""
    r = {"impl": impl, "layer": layer, "op": "ag_gemm", "method": method, "dtype": dtype,
         "tp": 2, "m": m, "n": 10240, "k": 8192, "chunks": 1, "config": {},
         "median_ms": median, "l2_flush_mib": 128, "rank_times": "max"}
    if run is not None:
        r["run"] = run
    if checked and method not in render_results.DIAGNOSTIC and method != "torch_seq":
        r["check_rel_diff_vs_none" if impl == "tpserve" else "check_rel_diff_vs_seq"] = 0.001
    return r


def by_name(results):
    return {what: (ok, detail) for what, ok, detail in results}


class CriteriaTest(unittest.TestCase):

    def test_passing_case(self):
        records = [rec("tpserve", "none", 1.0), rec("tpserve", "ring", 0.75),
                   rec("tpserve", "auto", 0.81), rec("tpserve", "gemm_only", 0.74),
                   rec("tpserve", "comm_only", 0.30), rec("torch", "torch_symm_mem", 0.90)]
        got = by_name(render_results.criteria(render_results.groups(records)))
        self.assertTrue(got["best tpserve <= 1.02 x best PyTorch, every shape"][0])
        self.assertTrue(got["geometric-mean speedup over best PyTorch >= 1.10"][0])
        # 0.90 / 0.75 = 1.2, far from a rounding boundary of the 3 digits shown.
        self.assertIn("1.200 over 1 shapes",
                      got["geometric-mean speedup over best PyTorch >= 1.10"][1])
        self.assertTrue(got["m >= 4096: best <= 1.05 x max(gemm_only, comm_only)"][0])
        self.assertTrue(got["auto <= 1.02 x none, every shape"][0])

    def test_failures_name_the_worst_case(self):
        records = [rec("tpserve", "none", 1.0), rec("tpserve", "auto", 1.10),
                   rec("tpserve", "gemm_only", 0.5), rec("tpserve", "comm_only", 0.3),
                   rec("torch", "torch_seq", 0.8),
                   rec("tpserve", "none", 0.2, m=512), rec("torch", "torch_seq", 0.21, m=512)]
        got = by_name(render_results.criteria(render_results.groups(records)))
        ok, detail = got["best tpserve <= 1.02 x best PyTorch, every shape"]
        self.assertFalse(ok)
        self.assertIn("1 of 2 cases above 1.02", detail)
        self.assertIn("llama70b.qkv m=8192", detail)
        # m=512 is not in the floor criterion (m >= 4096 only).
        ok, detail = got["m >= 4096: best <= 1.05 x max(gemm_only, comm_only)"]
        self.assertFalse(ok)
        self.assertIn("1 of 1 cases", detail)
        self.assertFalse(got["auto <= 1.02 x none, every shape"][0])

    def test_unmeasured_criteria_are_not_passes(self):
        records = [rec("tpserve", "none", 1.0)]
        got = by_name(render_results.criteria(render_results.groups(records)))
        self.assertEqual(len(got), 4, got)
        for what, (ok, detail) in got.items():
            self.assertIsNone(ok, what)
            self.assertEqual(detail, "not measured")

    def test_other_dtypes_are_left_out(self):
        records = [rec("tpserve", "none", 1.0, dtype="bf16"), rec("torch", "torch_seq", 0.5,
                                                                   dtype="bf16")]
        got = by_name(render_results.criteria(render_results.groups(records)))
        self.assertIsNone(got["best tpserve <= 1.02 x best PyTorch, every shape"][0])


    def test_a_shape_without_a_valid_side_fails_instead_of_dropping_out(self):
        # m=8192: every tpserve method failed its correctness check, and
        # PyTorch is 3x faster; m=2048: the peer wrote nothing.
        bad = rec("tpserve", "ring", 0.3)
        bad["check_rel_diff_vs_none"] = 1.0
        records = [bad, rec("tpserve", "gemm_only", 0.78), rec("tpserve", "comm_only", 0.30),
                   rec("torch", "torch_seq", 0.9),
                   rec("tpserve", "none", 0.5, m=2048),
                   rec("tpserve", "none", 0.2, m=512), rec("torch", "torch_seq", 0.3, m=512)]
        self.assertTrue(render_results.check_failed(bad))
        got = by_name(render_results.criteria(render_results.groups(records)))
        ok, detail = got["best tpserve <= 1.02 x best PyTorch, every shape"]
        self.assertFalse(ok)
        self.assertIn("llama70b.qkv m=8192 (no valid tpserve record)", detail)
        self.assertIn("llama70b.qkv m=2048 (no PyTorch record)", detail)
        ok, detail = got["geometric-mean speedup over best PyTorch >= 1.10"]
        self.assertFalse(ok)  # 1.5 over the one complete shape, but two are missing
        self.assertIn("2 shape(s) left out", detail)
        ok, detail = got["m >= 4096: best <= 1.05 x max(gemm_only, comm_only)"]
        self.assertFalse(ok)
        self.assertIn("no valid tpserve record", detail)

    def test_an_auto_that_failed_its_check_fails(self):
        auto = rec("tpserve", "auto", 0.5)
        auto["check_rel_diff_vs_none"] = float("inf")
        records = [rec("tpserve", "none", 1.0), auto, rec("tpserve", "none", 1.0, m=512),
                   rec("tpserve", "auto", 0.9, m=512)]
        got = by_name(render_results.criteria(render_results.groups(records)))
        ok, detail = got["auto <= 1.02 x none, every shape"]
        self.assertFalse(ok)
        self.assertIn("worst inf (llama70b.qkv m=8192)", detail)

    def test_a_shape_without_auto_fails_once_auto_was_measured(self):
        records = [rec("tpserve", "none", 1.0), rec("tpserve", "auto", 0.9),
                   rec("tpserve", "none", 1.0, m=512)]
        got = by_name(render_results.criteria(render_results.groups(records)))
        ok, detail = got["auto <= 1.02 x none, every shape"]
        self.assertFalse(ok)
        self.assertIn("llama70b.qkv m=512 (no auto record)", detail)


    def test_unchecked_records_are_never_best(self):
        # A --no-check run: the fast ring has no check, so the shape has no
        # valid tpserve record; an unchecked PyTorch method is left out too.
        records = [rec("tpserve", "ring", 0.5, checked=False),
                   rec("tpserve", "gemm_only", 0.5), rec("tpserve", "comm_only", 0.3),
                   rec("torch", "torch_seq", 0.9), rec("torch", "torch_symm_mem", 0.4,
                                                       checked=False)]
        self.assertTrue(render_results.check_failed(records[0]))
        self.assertFalse(render_results.check_failed(records[3]))  # the peer's reference
        self.assertIsNone(render_results.best(records, "tpserve"))
        self.assertEqual(render_results.best(records, "torch")["method"], "torch_seq")
        got = by_name(render_results.criteria(render_results.groups(records)))
        ok, detail = got["best tpserve <= 1.02 x best PyTorch, every shape"]
        self.assertFalse(ok)
        self.assertIn("no valid tpserve record", detail)

    def test_each_shape_is_judged_within_one_run(self):
        # The sweep (heavier context) and the auto run: best, none and floor
        # all come from the auto run, not the minimum over both.
        records = [rec("tpserve", "none", 1.10, run="sweep"),
                   rec("tpserve", "ring", 0.70, run="sweep"),
                   rec("tpserve", "gemm_only", 0.60, run="sweep"),
                   rec("tpserve", "comm_only", 0.30, run="sweep"),
                   rec("tpserve", "none", 1.00, run="auto"),
                   rec("tpserve", "auto", 0.80, run="auto"),
                   rec("tpserve", "gemm_only", 0.74, run="auto"),
                   rec("tpserve", "comm_only", 0.30, run="auto"),
                   rec("torch", "torch_symm_mem", 0.79)]
        grouped = render_results.groups(records)
        judged = render_results.judged_run(next(iter(grouped.values())))
        self.assertEqual({r.get("run") for r in judged if r["impl"] == "tpserve"}, {"auto"})
        got = by_name(render_results.criteria(grouped))
        # 0.80 / 0.79 = 1.013 (the sweep's 0.70 would have given 0.886).
        ok, detail = got["best tpserve <= 1.02 x best PyTorch, every shape"]
        self.assertTrue(ok)
        self.assertIn("worst 1.013", detail)
        # 0.80 / 0.74 = 1.081 against the auto run's own GEMM (vs the sweep's
        # 0.60 it would read 1.333, mixing contexts).
        ok, detail = got["m >= 4096: best <= 1.05 x max(gemm_only, comm_only)"]
        self.assertFalse(ok)
        self.assertIn("worst 1.081", detail)
        ok, detail = got["auto <= 1.02 x none, every shape"]
        self.assertTrue(ok)
        self.assertIn("worst 0.800", detail)
        # The tables still list every run's records, named with their run.
        text = render_results.render_text({"records": records})
        self.assertIn("tpserve ring c=1 (run sweep)", text)
        self.assertIn("tpserve auto (run auto)", text)

    def test_a_planned_case_without_records_fails(self):
        # The run planned m=512 and m=8192 but was cut short after m=8192.
        records = [rec("tpserve", "none", 1.0), rec("tpserve", "auto", 0.8),
                   rec("tpserve", "gemm_only", 0.78), rec("tpserve", "comm_only", 0.3),
                   rec("torch", "torch_seq", 0.9)]
        planned = [{"layer": "llama70b.qkv", "m": m, "dtype": "fp8"} for m in (512, 8192)]
        planned.append({"layer": "llama70b.qkv", "m": 512, "dtype": "bf16"})  # other dtype
        grouped = render_results.groups(records)
        got = by_name(render_results.criteria(grouped))
        self.assertTrue(got["best tpserve <= 1.02 x best PyTorch, every shape"][0])
        got = by_name(render_results.criteria(grouped, planned=planned))
        for what in ("best tpserve <= 1.02 x best PyTorch, every shape",
                     "geometric-mean speedup over best PyTorch >= 1.10",
                     "auto <= 1.02 x none, every shape"):
            ok, detail = got[what]
            self.assertFalse(ok, what)
        self.assertIn("llama70b.qkv m=512 (planned, no record)",
                      got["auto <= 1.02 x none, every shape"][1])
        # m=512 is below the floor criterion's range: it still passes there.
        self.assertTrue(got["m >= 4096: best <= 1.05 x max(gemm_only, comm_only)"][0])
        text = render_results.render_text({"meta": {"planned_cases": planned},
                                           "records": records})
        self.assertIn("(planned, no record)", text)

    def test_planned_cases_count_per_run_and_missing_inputs_fail(self):
        # The sweep measured m=8192; the auto run planned it too but died
        # before writing a record: the shape must not be judged on the sweep.
        records = [rec("tpserve", "none", 1.0, run="sweep"), rec("tpserve", "ring", 0.8, run="sweep"),
                   rec("tpserve", "gemm_only", 0.78, run="sweep"),
                   rec("tpserve", "comm_only", 0.3, run="sweep"), rec("torch", "torch_seq", 0.9)]
        planned = [{"layer": "llama70b.qkv", "m": 8192, "dtype": "fp8", "run": run}
                   for run in ("sweep", "auto")]
        got = by_name(render_results.criteria(render_results.groups(records), planned=planned))
        ok, detail = got["best tpserve <= 1.02 x best PyTorch, every shape"]
        self.assertFalse(ok)
        self.assertIn("llama70b.qkv m=8192 (planned, no record)", detail)
        # With the auto run's records present, the same plan passes.
        records += [rec("tpserve", "none", 1.0, run="auto"), rec("tpserve", "auto", 0.8, run="auto"),
                    rec("tpserve", "gemm_only", 0.78, run="auto"),
                    rec("tpserve", "comm_only", 0.3, run="auto")]
        got = by_name(render_results.criteria(render_results.groups(records), planned=planned))
        self.assertTrue(got["best tpserve <= 1.02 x best PyTorch, every shape"][0])
        # An input file the merge could not find fails every criterion.
        got = by_name(render_results.criteria(render_results.groups(records), planned=planned,
                                              missing_inputs=["/tmp/ours-auto-seed.json"]))
        self.assertEqual(len(got), 4, got)
        for what, (ok, detail) in got.items():
            self.assertFalse(ok, what)
            if what.startswith("geometric-mean"):
                self.assertIn("left out", detail)
            else:
                self.assertIn("input /tmp/ours-auto-seed.json missing", detail)

    def test_old_files_plain_none_needs_no_check(self):
        # Before the separate reference layer, plain none was the reference
        # and carried no check.
        none = rec("tpserve", "none", 1.0, checked=False)
        none.pop("check_rel_diff_vs_none", None)
        self.assertFalse(render_results.check_failed(none))
        none_ce = dict(none, config={"copy_engine": True})
        self.assertTrue(render_results.check_failed(none_ce))

    def test_sides_measured_differently_fail(self):
        records = [rec("tpserve", "none", 1.0), rec("tpserve", "auto", 0.8),
                   rec("torch", "torch_seq", 0.9)]
        records[2]["l2_flush_mib"] = 0
        got = by_name(render_results.criteria(render_results.groups(records)))
        ok, detail = got["best tpserve <= 1.02 x best PyTorch, every shape"]
        self.assertFalse(ok)
        self.assertIn("l2_flush_mib 128 vs 0", detail)
        self.assertIn("measured differently", detail)
        ok, detail = got["geometric-mean speedup over best PyTorch >= 1.10"]
        self.assertFalse(ok)
        self.assertIn("1 shape(s) measured differently", detail)
        # One side reporting rank 0's times, the other the slowest rank's.
        records[2]["l2_flush_mib"] = 128
        del records[2]["rank_times"]
        ok, detail = by_name(render_results.criteria(render_results.groups(records)))[
            "best tpserve <= 1.02 x best PyTorch, every shape"]
        self.assertFalse(ok)
        self.assertIn("rank_times max vs None", detail)


class RowNameTest(unittest.TestCase):
    def test_breakdown_parts_name_their_method(self):
        r = rec("tpserve", "layer_gemm", 0.4)
        r.update(chunks=4, config={"mode": "ring", "chunks": 4, "copy_engine": True})
        self.assertEqual(render_results.row_name(r), "tpserve layer_gemm of ring_ce c=4")
        r.update(method="layer_comm", chunks=1,
                 config={"mode": "none", "chunks": 1, "copy_engine": True})
        self.assertEqual(render_results.row_name(r), "tpserve layer_comm of none_ce c=1")

    def test_in_place_rings_are_named_apart_from_copy_engine_rings(self):
        r = rec("tpserve", "ring", 0.4)
        r.update(chunks=1, config={"mode": "ring", "chunks": 1, "copy_engine": True,
                                   "in_place": True})
        self.assertEqual(render_results.row_name(r), "tpserve ring_inplace c=1")
        r["config"]["in_place"] = False
        self.assertEqual(render_results.row_name(r), "tpserve ring_ce c=1")
        r.update(method="layer_gemm", config={"mode": "ring", "chunks": 1, "copy_engine": True,
                                              "in_place": True})
        self.assertEqual(render_results.row_name(r), "tpserve layer_gemm of ring_inplace c=1")

    def test_full_weight_methods_are_named_apart_from_copy_engine_ones(self):
        r = rec("tpserve", "pipeline", 0.4)
        r.update(chunks=2, config={"mode": "pipeline", "chunks": 2, "copy_engine": True,
                                   "full_weight": True})
        self.assertEqual(render_results.row_name(r), "tpserve pipeline_fullw c=2")
        r["config"]["full_weight"] = False
        self.assertEqual(render_results.row_name(r), "tpserve pipeline_ce c=2")
        r.update(method="none", chunks=1, config={"mode": "none", "chunks": 1,
                                                  "copy_engine": True, "full_weight": True})
        self.assertEqual(render_results.row_name(r), "tpserve none_fullw")
        r.update(method="layer_comm")
        self.assertEqual(render_results.row_name(r), "tpserve layer_comm of none_fullw c=1")
        r.update(method="ring", chunks=2, config={"mode": "ring", "chunks": 2,
                                                  "copy_engine": True, "full_weight": True})
        self.assertEqual(render_results.row_name(r), "tpserve ring_fullw c=2")

    def test_vs_gemm_gives_each_case_its_ratios_to_gemm_only(self):
        fast = rec("tpserve", "ring", 0.55)
        fast.update(chunks=1, config={"mode": "ring", "chunks": 1, "copy_engine": True,
                                      "fast_accum": True})
        other = rec("tpserve", "ring", 0.3, m=2048)  # a case without gemm_only
        other.update(chunks=2, config={"mode": "ring", "chunks": 2})
        text = render_results.render_vs_gemm(
            {"records": [fast, rec("tpserve", "gemm_only", 0.5), other]})
        lines = text.splitlines()
        self.assertEqual(len(lines), 2)
        self.assertEqual(lines[0], "ag_gemm n=10240 k=8192 m=2048 fp8: tpserve ring c=2 0.3000")
        self.assertIn("m=8192 fp8: ", lines[1])
        self.assertIn("tpserve gemm_only 0.5000 (1.000 x gemm)", lines[1])
        self.assertIn("tpserve ring_ce c=1 [fast] 0.5500 (1.100 x gemm)", lines[1])

    def test_the_peers_gemm_only_and_comm_only_are_diagnostics(self):
        # PyTorch's parts of torch_seq, timed alone: never its best, and never
        # tpserve's floor (which is tpserve's own gemm_only and comm_only).
        records = [rec("tpserve", "none", 1.0), rec("tpserve", "ring", 0.79),
                   rec("tpserve", "gemm_only", 0.76), rec("tpserve", "comm_only", 0.30),
                   rec("torch", "torch_seq", 0.95), rec("torch", "gemm_only", 0.60),
                   rec("torch", "comm_only", 0.20)]
        self.assertEqual(render_results.best(records, "torch")["method"], "torch_seq")
        self.assertFalse(render_results.check_failed(records[5]))
        self.assertEqual(render_results.references(records), (1.0, 0.76))
        got = by_name(render_results.criteria(render_results.groups(records)))
        self.assertTrue(got["best tpserve <= 1.02 x best PyTorch, every shape"][0])
        ok, detail = got["m >= 4096: best <= 1.05 x max(gemm_only, comm_only)"]
        self.assertTrue(ok, detail)  # 0.79 / 0.76 = 1.039; against the peer's 0.60 it would fail
        self.assertEqual(render_results.row_name(records[5]), "torch gemm_only")

    def test_malformed_records_are_errors_naming_the_record(self):
        import json
        import tempfile
        for records, says in (([1], "records[0] is not an object"),
                              ([{"median_ms": "0.1"}], "records[0].median_ms is not a number"),
                              ([{"config": [1]}], "records[0].config is not an object")):
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump({"records": records}, f)
            try:
                with self.assertRaises(ValueError) as e:
                    render_results.load(f.name)
                self.assertIn(says, str(e.exception))
                self.assertEqual(render_results.main([f.name]), 1)
            finally:
                os.remove(f.name)

    def test_older_records_with_removed_knobs_render_as_without_them(self):
        # Files of record written before gemm_sm_count and gemm_lanes were removed carry them
        # at their defaults (0: all SMs; one GEMM stream) in every record.
        import contextlib
        import io
        import json
        import tempfile
        old = rec("tpserve", "ring", 0.4)
        old.update(chunks=1, config={"mode": "ring", "chunks": 1, "copy_engine": True,
                                     "gemm_sm_count": 0, "gemm_lanes": 1})
        new = rec("tpserve", "ring", 0.4)
        new.update(chunks=1, config={"mode": "ring", "chunks": 1, "copy_engine": True})
        self.assertEqual(render_results.row_name(old), "tpserve ring_ce c=1")
        self.assertEqual(render_results.row_name(new), "tpserve ring_ce c=1")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"records": [old, rec("tpserve", "none", 0.5)]}, f)
        try:
            for args in ([f.name], [f.name, "--vs-gemm"]):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    self.assertEqual(render_results.main(args), 0)
                self.assertIn("tpserve ring_ce c=1 ", out.getvalue())
                self.assertNotIn("sm=", out.getvalue())
        finally:
            os.remove(f.name)

    def test_the_plain_layer_gemm_and_methods_keep_their_names(self):
        r = rec("tpserve", "layer_gemm", 0.4)
        r["config"] = {"mode": "none", "chunks": 1}
        self.assertEqual(render_results.row_name(r), "tpserve layer_gemm")
        r.update(method="ring", chunks=2, config={"mode": "ring", "chunks": 2, "max_ctas": 8},
                 check_rel_diff_vs_none=0.001)
        self.assertEqual(render_results.row_name(r), "tpserve ring c=2 [maxctas=8]")
        del r["check_rel_diff_vs_none"]  # a layer method without its check
        self.assertEqual(render_results.row_name(r), "tpserve ring c=2 [maxctas=8] !")


if __name__ == "__main__":
    unittest.main()
