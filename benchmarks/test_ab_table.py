"""Tests of ab_table.py (standard library only)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ab_table  # noqa: E402


def decode_doc(ms_by_batch):
    return {"meta": {}, "records": [{"batch": b, "step_host_ms_median": ms, "context": 1024}
                                    for b, ms in ms_by_batch.items()]}


class AbTableTest(unittest.TestCase):
    def write(self, d, name, doc):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def test_rounds_gather_per_label_and_the_ratio_is_to_the_first_label(self):
        with tempfile.TemporaryDirectory() as d:
            a1 = self.write(d, "a1.json", decode_doc({1: 3.0, 64: 6.0}))
            a2 = self.write(d, "a2.json", decode_doc({1: 3.2, 64: 6.2}))
            b1 = self.write(d, "b1.json", decode_doc({1: 2.7, 64: 6.6}))
            b2 = self.write(d, "b2.json", decode_doc({1: 2.9, 64: 6.4}))
            out = os.path.join(d, "ab.json")
            rc = ab_table.main(["--run", f"new={b1}", "--run", f"old={a1}", "--run",
                                f"new={b2}", "--run", f"old={a2}", "--json", out])
            self.assertEqual(rc, 0)
            with open(out) as f:
                table = json.load(f)
        self.assertEqual(table, {"new": {"1": [2.7, 2.9], "64": [6.6, 6.4]},
                                 "old": {"1": [3.0, 3.2], "64": [6.0, 6.2]}})
        text = ab_table.render({"new": table["new"], "old": table["old"]})
        rows = [line for line in text.splitlines() if line.startswith("| 1 ") or
                line.startswith("| 64 ")]
        self.assertEqual(len(rows), 2)
        # medians 2.8 (new) and 3.1 (old): old / new, the first label being new
        self.assertTrue(rows[0].endswith(f"| {3.1 / 2.8:.3f} |"), rows[0])
        self.assertTrue(rows[1].endswith(f"| {6.1 / 6.5:.3f} |"), rows[1])

    def test_batches_sort_as_numbers_and_attention_records_are_keyed(self):
        table = {"x": {"64": [1.0], "8": [1.0], "256": [1.0], "1": [1.0]}}
        text = ab_table.render(table)
        order = [line.split("|")[1].strip() for line in text.splitlines()[2:]]
        self.assertEqual(order, ["1", "8", "64", "256"])
        doc = {"records": [{"kernel": "paged_decode", "kv_dtype": "fp8", "output": "fp8",
                            "batch": 8, "median_ms": 0.02, "splits_asked": 0}]}
        self.assertEqual(ab_table.step_times(doc), {"fp8/b8": 0.02})

    def test_a_missing_file_is_named_and_fails_the_run(self):
        with tempfile.TemporaryDirectory() as d:
            a1 = self.write(d, "a1.json", decode_doc({1: 3.0}))
            missing = os.path.join(d, "none.json")
            rc = ab_table.main(["--run", f"a={a1}", "--run", f"b={missing}"])
        self.assertEqual(rc, 1)


FAKE_TOOL = """#!/usr/bin/env python3
# Stands in for tpserve-bench-decode / -attention: writes --out with a step time that depends
# on the build (FAKE_MS in its directory's name) and the batch, 10 % more for each name of
# --unfused and 20 % more without --no-cluster-merge (so that a test sees the flags arrive).
# A build whose directory name ends in _old has no --no-cluster-merge: refused, as CLI11 does.
import json, os, sys
args = sys.argv[1:]
old = os.path.dirname(os.path.abspath(sys.argv[0])).endswith("_old")
if args == ["--help"]:
    print("--decode --batches" + ("" if old else " --no-cluster-merge"))
    sys.exit(0)
if old and "--no-cluster-merge" in args:
    sys.exit(109)
out = args[args.index("--out") + 1]
base = float(os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0]))).split("_")[1])
i = args.index("--batches") + 1
batches = []
while i < len(args) and not args[i].startswith("--"):
    batches.append(int(args[i]))
    i += 1
if "--unfused" in args:
    base *= 1 + 0.1 * len(args[args.index("--unfused") + 1].split(","))
if "--decode" in args and "--no-cluster-merge" not in args:
    base *= 1.2
key = "median_ms" if "--decode" in args else "step_host_ms_median"
recs = [dict(batch=b, kv_dtype="bf16", **{key: base * b}) for b in batches]
json.dump({"meta": {}, "records": recs}, open(out, "w"))
"""


def fake_builds(d, builds, suffix=""):
    """Stand-in tool directories build_MS[SUFFIX] under d, by label."""
    dirs = {}
    for label, ms in builds:
        dirs[label] = os.path.join(d, f"build_{ms}{suffix}")
        os.makedirs(dirs[label])
        for tool in ("tpserve-bench-decode", "tpserve-bench-attention"):
            path = os.path.join(dirs[label], tool)
            with open(path, "w") as f:
                f.write(FAKE_TOOL.replace("#!/usr/bin/env python3", "#!" + sys.executable))
            os.chmod(path, 0o755)
    return dirs


def run_ab(d, rounds, batches, *builds):
    """run_decode_ab.sh over LABEL=DIR[@NAMES] builds, BF16 cache, outputs under d/out."""
    env = dict(os.environ, ROUNDS=str(rounds), KV_DTYPES="bf16", BATCHES=batches,
               OUT=os.path.join(d, "out"))
    return subprocess.run(["bash", os.path.join(HERE, "run_decode_ab.sh"), *builds], env=env,
                          capture_output=True, text=True, timeout=60)


class RunDecodeAbTest(unittest.TestCase):
    def test_two_builds_over_two_rounds_give_one_table_per_case(self):
        with tempfile.TemporaryDirectory() as d:
            dirs = fake_builds(d, (("old", "2.0"), ("new", "1.5")))
            proc = run_ab(d, 2, "1 8", f"old={dirs['old']}", f"new={dirs['new']}")
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            with open(os.path.join(d, "out", "ab-fp8-kvbf16.json")) as f:
                steps = json.load(f)
            with open(os.path.join(d, "out", "ab-attention-fp8.json")) as f:
                attention = json.load(f)
        self.assertEqual(steps, {"old": {"1": [2.0, 2.0], "8": [16.0, 16.0]},
                                 "new": {"1": [1.5, 1.5], "8": [12.0, 12.0]}})
        self.assertEqual(attention["new"], {"bf16/b1": [1.5, 1.5], "bf16/b8": [12.0, 12.0]})
        self.assertIn("| 1 | 2.000/2.000; 2.000 | 1.500/1.500; 1.500 | 0.750 |", proc.stdout)

    def test_a_build_run_without_fusions_gets_them_as_flags(self):
        with tempfile.TemporaryDirectory() as d:
            dirs = fake_builds(d, (("new", "1.0"),))
            proc = run_ab(d, 1, "1", f"all={dirs['new']}", f"rope={dirs['new']}@rope",
                          f"two={dirs['new']}@rope,swiglu")
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            with open(os.path.join(d, "out", "ab-fp8-kvbf16.json")) as f:
                steps = json.load(f)
            with open(os.path.join(d, "out", "ab-attention-bf16.json")) as f:
                attention = json.load(f)
        self.assertEqual({k: v["1"] for k, v in steps.items()},
                         {"all": [1.0], "rope": [1.1], "two": [1.2]})
        # Attention alone merges as the engine does in every build (--no-cluster-merge).
        self.assertEqual({k: v["bf16/b1"] for k, v in attention.items()},
                         {"all": [1.0], "rope": [1.0], "two": [1.0]})

    def test_an_old_build_without_the_merge_flag_runs_its_default(self):
        with tempfile.TemporaryDirectory() as d:
            dirs = fake_builds(d, (("old", "2.0"),), suffix="_old")
            dirs.update(fake_builds(d, (("new", "1.0"),)))
            proc = run_ab(d, 1, "1", f"old={dirs['old']}", f"new={dirs['new']}")
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            with open(os.path.join(d, "out", "ab-attention-bf16.json")) as f:
                attention = json.load(f)
        self.assertEqual({k: v["bf16/b1"] for k, v in attention.items()},
                         {"old": [2.4], "new": [1.0]})

    def test_a_label_without_its_tools_is_a_usage_error(self):
        with tempfile.TemporaryDirectory() as d:
            proc = subprocess.run(["bash", os.path.join(HERE, "run_decode_ab.sh"), f"a={d}",
                                   f"b={d}"], capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("tpserve-bench-decode is missing", proc.stderr)


if __name__ == "__main__":
    unittest.main()
