"""End-to-end tests of the tpserve command line (CTest label e2e).

Run by CTest with TPSERVE_BIN pointing at build/bin/tpserve.
"""
import json
import os
import subprocess
import tempfile
import unittest

BIN = os.environ.get("TPSERVE_BIN", "build/bin/tpserve")


def run(*args, check=True):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{args}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


class RunCommand(unittest.TestCase):
    def test_json_has_next_token_top_logits_and_logits(self):
        out = json.loads(run("run", "--model", "tiny", "--tp", "2", "--backend", "cpu",
                             "--ids", "1,2,3", "--json").stdout)
        logits = out["logits"]
        self.assertEqual(len(logits), 1024)
        self.assertEqual(len(out["top_logits"]), 10)
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))
        self.assertEqual(out["next_token_id"], best)
        self.assertEqual(out["top_logits"][0], [best, logits[best]])
        values = [v for _, v in out["top_logits"]]
        self.assertEqual(values, sorted(values, reverse=True))

    def test_tp_sizes_agree_on_the_next_token(self):
        ids = {json.loads(run("run", "--model", "tiny", "--tp", str(tp), "--ids", "5,6,7,8",
                              "--json").stdout)["next_token_id"] for tp in (1, 2, 4)}
        self.assertEqual(len(ids), 1, ids)

    def test_checkpoint_round_trip_gives_the_same_logits(self):
        with tempfile.TemporaryDirectory() as d:
            run("make-checkpoint", "--model", "tiny", "--out", d, "--seed", "7")
            self.assertTrue(os.path.exists(os.path.join(d, "model.safetensors")))
            with open(os.path.join(d, "config.json")) as f:
                self.assertEqual(json.load(f)["hidden_size"], 512)
            a = json.loads(run("run", "--model", d, "--ids", "9,8,7", "--json").stdout)
            b = json.loads(run("run", "--model", "tiny", "--seed", "7", "--ids", "9,8,7",
                               "--json").stdout)
            self.assertEqual(a["logits"], b["logits"])

    def test_bad_input_is_a_clear_error(self):
        p = run("run", "--model", "tiny", "--ids", "1,99999", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("id 99999", p.stderr)
        p = run("run", "--model", "no-such-model", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("no-such-model", p.stderr)
        p = run("run", "--model", "tiny", "--ids", "1,x", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("'x'", p.stderr)

    def test_gemm_algo_is_offered_checked_and_documented_where_gemms_run(self):
        # The cuda backend's GEMM algorithm choice: every command that runs
        # GEMMs documents it, refuses other values naming the allowed ones,
        # and a CPU run accepts it (nothing to choose there).
        for cmd in ("run", "serve", "layer", "worker"):
            help_text = run(cmd, "--help").stdout
            self.assertIn("--gemm-algo", help_text, cmd)
            p = run(cmd, "--gemm-algo", "fastest", check=False)
            self.assertNotEqual(p.returncode, 0, cmd)
            self.assertIn("fastest not in {timed,heuristic}", p.stderr + p.stdout, cmd)
        a = json.loads(run("run", "--model", "tiny", "--ids", "4,5", "--json").stdout)
        b = json.loads(run("run", "--model", "tiny", "--ids", "4,5", "--json", "--gemm-algo",
                           "heuristic").stdout)
        self.assertEqual(a["logits"], b["logits"])


if __name__ == "__main__":
    unittest.main()
