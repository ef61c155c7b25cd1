"""End-to-end tests of the tpserve command line (CTest label e2e).

Run by CTest with TPSERVE_BIN pointing at build/bin/tpserve.
"""
import json
import os
import select
import signal
import subprocess
import tempfile
import time
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
            # A directory holding a checkpoint is not written over without --force; with it,
            # every old shard goes (a stray one would make the directory unloadable).
            with open(os.path.join(d, "model-00002-of-00002.safetensors"), "w") as f:
                f.write("old shard")
            p = run("make-checkpoint", "--model", "tiny", "--out", d, "--seed", "8", check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("already holds a checkpoint (config.json, model-00002-of-00002"
                          ".safetensors, model.safetensors); give --force", p.stderr)
            run("make-checkpoint", "--model", "tiny", "--out", d, "--seed", "7", "--force")
            self.assertEqual(sorted(os.listdir(d)), ["config.json", "model.safetensors"])
            c = json.loads(run("run", "--model", d, "--ids", "9,8,7", "--json").stdout)
            self.assertEqual(c["logits"], b["logits"])
            # --seed seeds a preset's random weights: with a checkpoint it would be ignored.
            for cmd in (["run", "--ids", "1"], ["serve", "--backend", "cpu"]):
                p = run(*cmd, "--model", d, "--seed", "9", check=False)
                self.assertEqual(p.returncode, 2, (cmd, p.stderr))
                self.assertIn("is a checkpoint, whose weights are used", p.stderr)

    def test_calibrate_kv_scales_writes_scales_the_loader_reads(self):
        def header(path):
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                return json.loads(f.read(n))

        with tempfile.TemporaryDirectory() as d:
            run("make-checkpoint", "--model", "tiny", "--out", d)
            before = json.loads(run("run", "--model", d, "--ids", "9,8,7", "--json").stdout)
            out = os.path.join(d, "kv_scales.safetensors")
            prompts = os.path.join(d, "prompts.json")
            with open(prompts, "w") as f:
                json.dump([[1, 2, 3, 4, 5, 6], [7, 8, 9]], f)
            tables = []
            for extra in (["--num-prompts", "2", "--prompt-len", "32"],
                          ["--num-prompts", "2", "--prompt-len", "32", "--tp", "2"],
                          ["--prompts", prompts]):
                p = run("calibrate-kv-scales", "--model", d, "--out", out, *extra)
                rows = [line.split() for line in p.stdout.splitlines()
                        if line.split() and line.split()[0].isdigit()]
                tables.append(rows)
                self.assertEqual([r[0] for r in rows], ["0", "1"], p.stdout)
                h = header(out)
                self.assertEqual(h["__metadata__"]["tpserve"], "calibrate-kv-scales")
                for layer, max_k, max_v, k_scale, v_scale in rows:
                    for scale, most in ((k_scale, max_k), (v_scale, max_v)):
                        self.assertAlmostEqual(float(scale), float(most) / 448,
                                               delta=1e-5 * float(scale))
                    for kv in ("k", "v"):
                        t = h[f"model.layers.{layer}.self_attn.{kv}_scale"]
                        self.assertEqual((t["dtype"], t["shape"]), ("F32", []))
                self.assertIn("the model directory's loads read it", p.stdout)
            # tp 2's ranks see every KV head together: its maxima are tp 1's, but for the
            # rounding of the row-parallel sums (layer 0's are exact, the others' within 1 %).
            self.assertEqual(tables[0][0], tables[1][0])
            for a, b in zip(tables[0], tables[1]):
                for x, y in zip(a[1:], b[1:]):
                    self.assertAlmostEqual(float(x), float(y), delta=1e-2 * float(x))
            self.assertNotEqual(tables[0], tables[2])
            self.assertIn(prompts, header(out)["__metadata__"]["prompts"])
            # The directory still loads (prefill logits do not quantize K and V on the CPU).
            after = json.loads(run("run", "--model", d, "--ids", "9,8,7", "--json").stdout)
            self.assertEqual(after["logits"], before["logits"])
            refusals = [
                (["--model", d, "--out", os.path.join(d, "model.safetensors")],
                 "was not written by calibrate-kv-scales"),
                (["--model", d, "--out", os.path.join(d, "more.safetensors")],
                 "already holds KV cache scales (" + out + ": tensor model.layers."),
                (["--model", "tiny", "--out", os.path.join(d, "x.safetensors")],
                 "a preset's weights are random"),
                (["--model", d, "--out", os.path.join(d, "x.bin")], "name a .safetensors file"),
            ]
            with open(prompts, "w") as f:
                json.dump([[1, 2, 5000]], f)
            refusals.append((["--model", d, "--out", out, "--prompts", prompts],
                             prompts + ": prompt 0, token 2: 5000 is not a token id"))
            for args, message in refusals:
                p = run("calibrate-kv-scales", *args, check=False)
                self.assertEqual(p.returncode, 2, (args, p.stderr))
                self.assertIn(message, p.stderr)

    def test_interrupted_make_checkpoint_leaves_no_partial_file(self):
        # llama3-8b's file is gigabytes: an interrupted run left them in model.safetensors.tmp.
        with tempfile.TemporaryDirectory() as d:
            p = subprocess.Popen([BIN, "make-checkpoint", "--model", "llama3-8b", "--out", d],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            partial = os.path.join(d, "model.safetensors.tmp")
            deadline = time.monotonic() + 60
            while not os.path.exists(partial) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertTrue(os.path.exists(partial), "no partial file within 60 s")
            p.send_signal(signal.SIGINT)
            self.assertEqual(p.wait(timeout=60), 128 + signal.SIGINT)
            self.assertFalse(os.path.exists(partial))

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
        p = run("run", "--model", "tiny", "--ids", "1,2,", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("after the last comma", p.stderr)
        # A flag out of range is a usage error like the others: 2, not CLI11's own codes.
        p = run("run", "--model", "tiny", "--tp", "0", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        # A path is not taken for a preset name.
        p = run("run", "--model", "./no-such-dir", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--model ./no-such-dir: no such directory", p.stderr)

    @unittest.skipUnless(os.path.exists("/dev/full"), "needs /dev/full")
    def test_results_that_cannot_be_written_are_a_failure(self):
        for args in (["run", "--model", "tiny", "--ids", "1,2", "--json"], ["plan"]):
            with open("/dev/full", "w") as full:
                p = subprocess.run([BIN, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                                   timeout=300)
            self.assertEqual(p.returncode, 1, (args, p.stderr))
            self.assertIn("could not write the results to standard output", p.stderr)

    def test_gemm_algo_is_offered_checked_and_documented_where_gemms_run(self):
        # The cuda backend's GEMM algorithm choice: every command that runs
        # GEMMs documents it and refuses other values naming the allowed ones
        # (the cpu backend refuses it altogether: CommandLineChecks).
        for cmd in ("run", "serve", "layer", "worker"):
            help_text = run(cmd, "--help").stdout
            self.assertIn("--gemm-algo", help_text, cmd)
            p = run(cmd, "--gemm-algo", "fastest", check=False)
            self.assertNotEqual(p.returncode, 0, cmd)
            self.assertIn("fastest not in {timed,heuristic}", p.stderr + p.stdout, cmd)


class CommandLineChecks(unittest.TestCase):
    """Bad values are refused at once, naming the flag; nothing is silently reinterpreted."""

    def refused(self, args, says, code=None):
        p = run(*args, check=False)
        if code is None:
            self.assertGreater(p.returncode, 0, (args, p.stdout, p.stderr))  # not a signal
        else:
            self.assertEqual(p.returncode, code, (args, p.stdout, p.stderr))
        self.assertIn(says, p.stderr + p.stdout, args)
        return p

    def test_integers_are_decimal_and_within_their_type(self):
        # CLI11 read "010" as octal 8, "0x3" as hex, wrapped "-1" to 2^64-1 for unsigned
        # flags and saturated values beyond 64 bits.
        self.assertIn("plans of all 10 ranks", run("plan", "--tp", "010", "--chunks", "1").stdout)
        self.refused(["plan", "--tp", "0x3"], "--tp: '0x3' is not a whole number")
        for cmd in ("run", "make-checkpoint", "serve", "worker"):
            self.refused([cmd, "--seed", "-1"], "--seed: '-1' is not a whole number from 0")
        self.refused(["plan", "--m", "99999999999999999999"], "--m: '99999999999999999999'")

    def test_floats_are_finite(self):
        # --exit-timeout nan passed the range check, then a clean SIGTERM drain exited 1.
        p = self.refused(["serve", "--backend", "cpu", "--exit-timeout", "nan"],
                         "--exit-timeout: 'nan' is not a finite number")
        self.assertNotIn("loading", p.stderr)
        self.refused(["serve", "--rank-timeout-s", "inf"], "--rank-timeout-s: 'inf'")
        self.refused(["layer", "--tolerance", "nan"], "--tolerance: 'nan'")

    def test_range_messages_say_the_range(self):
        p = self.refused(["layer", "--m", "0"], "--m: '0' is not positive")
        self.assertNotIn("1797693", p.stderr)  # not the largest double's 309 digits
        self.refused(["layer", "--tolerance", "-0.5"], "--tolerance: '-0.5' is negative")

    def test_plan_rank_must_be_one_of_the_ranks(self):
        self.refused(["plan", "--tp", "2", "--rank", "2"], "--rank 2: the ranks are 0 to 1", 2)
        self.refused(["plan", "--tp", "4", "--rank", "-2"], "--rank -2", 2)
        out = run("plan", "--tp", "2", "--rank", "1", "--chunks", "1").stdout
        self.assertIn("plans of all 2 ranks checked", out)

    def test_plan_shows_the_copy_engine_schedules(self):
        out = run("plan", "--op", "gemm_rs", "--mode", "ring", "--tp", "3", "--chunks", "1",
                  "--copy-engine", "--in-place", "--rank", "0").stdout
        self.assertIn("pull_ring", out)
        self.assertIn("reads 1#0", out)  # the running sum read where the peer left it
        self.assertIn("plans of all 3 ranks checked", out)
        out = run("plan", "--op", "gemm_rs", "--mode", "pipeline", "--tp", "2", "--chunks", "2",
                  "--copy-engine", "--full-weight", "--m", "40", "--rank", "1").stdout
        self.assertIn("pull_columns", out)
        self.assertIn("k_blocks 0 1", out)
        self.refused(["plan", "--op", "ag_gemm", "--copy-engine", "--full-weight"],
                     "full_weight applies to gemm_rs layers", 2)

    def test_mode_none_runs_one_chunk_by_default(self):
        # The default --chunks 4 made `plan --mode none` and `layer --mode none` fail.
        run("plan", "--mode", "none")
        out = run("layer", "--mode", "none", "--m", "8").stdout
        self.assertIn("chunks=1", out)
        for cmd in ("plan", "layer"):
            self.refused([cmd, "--mode", "none", "--chunks", "3"],
                         "--chunks 3: mode none runs one chunk", 2)

    def test_layer_prints_the_tolerance_it_used(self):
        out = run("layer", "--m", "8", "--tolerance", "0.015").stdout
        self.assertIn("(tolerance 0.015)", out)  # "%.g" printed 0.01

    def help_entries(self, cmd):
        """`tpserve CMD --help` as {flag: its help entry} (CLI11 may wrap the description to
        a new line)."""
        entries = {}
        for line in run(cmd, "--help").stdout.splitlines():
            if line.startswith("  -"):
                flag = line.split()[0]
                entries[flag] = line
            elif entries and line.startswith("   "):
                entries[flag] += " " + line.strip()
        return entries

    def assert_help_marks_cuda_only(self, cmd, flags):
        """The help of CMD says of `flags`, and of no other flag, that only the cuda backend
        reads them, at the start of their description."""
        entries = self.help_entries(cmd)
        cuda_only = {f for f, e in entries.items() if "cuda backend only" in e}
        self.assertEqual(cuda_only, set(flags), entries)
        for flag in cuda_only:
            self.assertIn(" cuda backend only: ", entries[flag])
            self.assertNotIn(" cuda: ", entries[flag])  # the shared helper's short prefix

    # layer's flags that only the cuda backend reads, with a value to give each.
    LAYER_CUDA_ONLY = (["--copy-engine"], ["--max-ctas", "2"], ["--cta-policy", "zero"],
                       ["--split-output"], ["--in-place"], ["--full-weight"],
                       ["--gemm-algo", "heuristic"])

    def test_layer_refuses_cuda_only_flags_on_the_cpu_backend(self):
        # --gemm-algo was accepted and ignored. The cpu backend, given or layer's default,
        # refuses each flag, with its default value too, before preparing the operands.
        for knob in (*self.LAYER_CUDA_ONLY, ["--max-ctas", "0"], ["--gemm-algo", "timed"]):
            for backend in (["--backend", "cpu"], []):
                p = self.refused(["layer", *backend, "--m", "8", *knob],
                                 f"error: --backend cpu: {knob[0]} needs --backend cuda; the "
                                 "cpu backend does not read it", 2)
                self.assertNotIn("preparing operands", p.stderr)
                self.assertEqual(p.stdout, "")
        # Refused before the other checks of the flags, naming all of them.
        p = self.refused(["layer", "--backend", "cpu", "--mode", "none", "--chunks", "3",
                          *[a for knob in self.LAYER_CUDA_ONLY for a in knob]],
                         "error: --backend cpu: --max-ctas, --cta-policy, --copy-engine, "
                         "--split-output, --in-place, --full-weight and --gemm-algo need "
                         "--backend cuda; the cpu backend does not read them", 2)
        self.assertNotIn("--chunks 3", p.stderr)
        self.assertNotIn("--backend auto", p.stderr)  # layer has none
        # Without them the cpu backend runs.
        self.assertIn("-> PASS", run("layer", "--backend", "cpu", "--m", "8").stdout)
        self.assert_help_marks_cuda_only("layer", [knob[0] for knob in self.LAYER_CUDA_ONLY])

    def test_layer_refuses_split_output_for_an_all_gather(self):
        # An AllGather+GEMM has no sum to leave to its consumer; refused before anything runs,
        # with or without a CUDA backend in the build.
        p = self.refused(["layer", "--backend", "cuda", "--op", "ag_gemm", "--split-output"],
                         "error: --split-output applies to --op gemm_rs only", 2)
        self.assertNotIn("preparing operands", p.stderr)

    def test_layer_refuses_in_place_where_it_does_not_apply(self):
        # Only a ring over peer memory has running sums to read in place: other ops, modes
        # and NCCL transfers are refused before anything runs, naming what was given.
        for args, given in ((["--op", "ag_gemm", "--mode", "ring", "--copy-engine"],
                             "--op ag_gemm --mode ring --copy-engine"),
                            (["--op", "gemm_rs", "--mode", "pipeline", "--copy-engine"],
                             "--op gemm_rs --mode pipeline --copy-engine"),
                            (["--op", "gemm_rs", "--mode", "ring"], "--op gemm_rs --mode ring")):
            p = self.refused(["layer", "--backend", "cuda", *args, "--in-place"],
                             "error: --in-place applies to --op gemm_rs --mode ring "
                             "--copy-engine (got " + given + ")", 2)
            self.assertNotIn("preparing operands", p.stderr)

    def test_layer_refuses_full_weight_where_it_does_not_apply(self):
        # Only a gemm_rs on copy engines pulls the peers' input columns: refused before
        # anything runs, naming what was given.
        for args, given in ((["--op", "ag_gemm", "--mode", "pipeline", "--copy-engine"],
                             "--op ag_gemm --mode pipeline --copy-engine"),
                            (["--op", "gemm_rs", "--mode", "ring"], "--op gemm_rs --mode ring"),
                            (["--op", "gemm_rs", "--mode", "none"], "--op gemm_rs --mode none")):
            p = self.refused(["layer", "--backend", "cuda", *args, "--full-weight"],
                             "error: --full-weight applies to --op gemm_rs --copy-engine (got " +
                             given + ")", 2)
            self.assertNotIn("preparing operands", p.stderr)
        # Each allowed alone in ring on copy engines, not together.
        p = self.refused(["layer", "--backend", "cuda", "--op", "gemm_rs", "--mode", "ring",
                          "--copy-engine", "--in-place", "--full-weight"],
                         "error: --full-weight and --in-place do not combine", 2)
        self.assertNotIn("preparing operands", p.stderr)

    def test_run_refuses_cuda_only_flags_on_the_cpu_backend(self):
        # --gemm-algo was accepted and ignored. A model that does not exist shows that the
        # refusal comes before the model is looked at. --overlap-config is not one of them:
        # the cpu backend reads it.
        for value in ("heuristic", "timed"):
            for backend in (["--backend", "cpu"], []):
                p = self.refused(["run", *backend, "--model", "no-such-model",
                                  "--gemm-algo", value],
                                 "--backend cpu: --gemm-algo needs --backend cuda; the cpu "
                                 "backend does not read it", 2)
                self.assertNotIn("no-such-model", p.stderr)
                self.assertEqual(p.stdout, "")
        self.assert_help_marks_cuda_only("run", ["--gemm-algo"])

    # serve's flags that only the cuda backend reads, with a value to give each.
    SERVE_CUDA_ONLY = (["--rank-timeout-s", "60"], ["--device-random-weights"],
                       ["--gemm-algo", "heuristic"], ["--fp8-attention"])

    def test_serve_refuses_cuda_only_flags_on_the_cpu_backend(self):
        # They were silently ignored. Given with their default value they are still refused:
        # what counts is that they were given. A model that does not exist shows that the
        # refusal comes before the model is looked at (and keeps a server that wrongly
        # accepted the flags from serving for good).
        for knob in (*self.SERVE_CUDA_ONLY, ["--rank-timeout-s", "300"],
                     ["--gemm-algo", "timed"]):
            p = self.refused(["serve", "--backend", "cpu", "--model", "no-such-model",
                              "--grpc-port", "0", "--metrics-port", "0", *knob],
                             f"--backend cpu: {knob[0]} needs --backend cuda", 2)
            self.assertNotIn("no-such-model", p.stderr)
        p = self.refused(["serve", "--backend", "cpu", "--model", "no-such-model",
                          *[a for knob in self.SERVE_CUDA_ONLY for a in knob]],
                         "--backend cpu: --rank-timeout-s, --device-random-weights, "
                         "--gemm-algo and --fp8-attention need --backend cuda", 2)
        self.assertIn("or --backend auto on a node with the GPUs", p.stderr)
        # The help says which flags those are, and of no other flag.
        self.assert_help_marks_cuda_only("serve", [knob[0] for knob in self.SERVE_CUDA_ONLY])

    def serve_until_up_then_stop(self, args):
        """Starts `tpserve serve ARGS` on loopback without GPUs (CUDA_VISIBLE_DEVICES empty,
        so that auto falls back to the cpu in a CUDA build too), stops it with SIGTERM once it
        serves; returns its stderr."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        with tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen([BIN, "serve", "--model", "tiny", "--tp", "2", "--host",
                                  "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0", *args],
                                 stdout=subprocess.PIPE, stderr=err, text=True, env=env)
            try:
                ready, _, _ = select.select([p.stdout], [], [], 60)
                self.assertTrue(ready, "tpserve printed nothing within 60 s")
                self.assertIn("serving 'tiny' on gRPC port", p.stdout.readline())
                p.send_signal(signal.SIGTERM)
                self.assertEqual(p.wait(timeout=60), 0)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                p.stdout.close()
            err.seek(0)
            return err.read()

    def test_serve_auto_on_the_cpu_warns_of_ignored_cuda_only_flags(self):
        stderr = self.serve_until_up_then_stop(
            [a for knob in self.SERVE_CUDA_ONLY for a in knob])
        said = [line for line in stderr.splitlines() if "cuda backend only" in line]
        self.assertEqual(len(said), 1, stderr)
        self.assertIn("[warning]", said[0])
        self.assertRegex(said[0], r"--backend auto runs the cpu backend \((this build has "
                         r"no CUDA|this node has 0 GPUs, --tp 2 needs 2)\): ignoring "
                         r"--rank-timeout-s, --device-random-weights, --gemm-algo and "
                         r"--fp8-attention \(cuda backend only\)")
        # Said before the model loads, which then loads on the CPU.
        self.assertLess(stderr.index(said[0]), stderr.index("on the CPU backend"), stderr)
        # One flag: named alone; none: no warning.
        stderr = self.serve_until_up_then_stop(["--device-random-weights"])
        self.assertRegex(stderr, r"\): ignoring --device-random-weights \(cuda backend only\)")
        stderr = self.serve_until_up_then_stop([])
        self.assertNotIn("ignoring", stderr)
        self.assertNotIn("[warning]", stderr)

    def test_layer_sizes_beyond_memory_are_an_error_not_a_crash(self):
        # m x k overflowed int64: a segmentation fault.
        self.refused(["layer", "--m", "4611686018427387904"], "more than 2^34", 2)
        # The check of a plan follows every row through every step: refused before the
        # system's OOM killer would end it (1e9 rows took 8.5 GB and 34 s; 1e11 was killed).
        self.refused(["plan", "--m", "9223372036854775807", "--chunks", "1"],
                     "GiB (at most 4); a smaller --m", 2)
        self.refused(["plan", "--m", "100000000000", "--tp", "1024", "--mode", "ring",
                      "--chunks", "64"], "GiB (at most 4)", 2)

    def test_tls_flags_are_checked_before_the_model_loads(self):
        with tempfile.NamedTemporaryFile("w", suffix=".pem") as key:
            p = self.refused(["serve", "--backend", "cpu", "--tls-key", key.name],
                             "--tls-key requires --tls-cert")
            self.assertNotIn("loading", p.stderr)
            self.refused(["serve", "--tls-cert", "/nonexistent.pem", "--tls-key", key.name],
                         "/nonexistent.pem")
            self.refused(["serve", "--tls-client-ca", key.name], "--tls-client-ca requires")

    def test_listen_addresses_are_checked_before_the_model_loads(self):
        # Found after minutes of loading a large model before; now at once. llama3-70b's
        # random weights would take far longer than the refusal may.
        for args, says in (
                (["--host", "256.1.1.1"], "--host 256.1.1.1: not an address or a name"),
                (["--metrics-host", "no-such-host.invalid"], "--metrics-host no-such-host"
                                                             ".invalid: not an address")):
            start = time.monotonic()
            p = self.refused(["serve", "--model", "llama3-70b", "--backend", "cpu"] + args,
                             says, 2)
            self.assertLess(time.monotonic() - start, 30, args)
            self.assertNotIn("random weights", p.stderr)
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            self.refused(["serve", "--model", "llama3-70b", "--backend", "cpu", "--host",
                          "127.0.0.1", "--grpc-port", str(port)],
                         "--grpc-port %d: in use on 127.0.0.1" % port, 2)

    def test_host_random_weights_print_progress(self):
        # llama3-8b's random weights take minutes on the host; they printed nothing.
        p = subprocess.Popen([BIN, "run", "--model", "llama3-8b", "--tp", "1", "--ids", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            seen = []
            for line in p.stderr:
                seen.append(line)
                if "random weights:" in line:
                    break
            self.assertRegex("".join(seen), r"random weights: \d+ of 32 layers")
        finally:
            p.kill()
            p.wait()
            p.stderr.close()


BENCH = os.environ.get("BENCH_BIN")
BENCH_MODEL = os.environ.get("BENCH_MODEL_BIN")
BENCH_DECODE = os.environ.get("BENCH_DECODE_BIN")


@unittest.skipUnless(BENCH and BENCH_MODEL and BENCH_DECODE,
                     "the benchmarks are built with CUDA only")
class BenchmarkUsageErrors(unittest.TestCase):
    """Checked before any GPU work, so visible here without GPUs (they fail with 1 there)."""

    def refused(self, binary, args, says):
        with tempfile.TemporaryDirectory() as d:
            p = subprocess.run([binary, *args, "--ranks", "threads", "--out",
                                os.path.join(d, "out.json")],
                               capture_output=True, text=True, timeout=60)
        self.assertNotIn(p.returncode, (0, 1), (args, p.stdout, p.stderr))
        self.assertIn(says, p.stdout + p.stderr, args)

    def test_bench(self):
        for args, says in (
                # Anything but bf16 ran (and was recorded) as fp8; unknown methods were skipped.
                (["--dtype", "fp16"], "--dtype: fp16 not in {fp8,bf16}"),
                (["--methods", "rign"], "--methods: rign not in"),
                (["--tp", "0"], "--tp"),
                (["--m", "-5"], "--m: '-5' is not positive"),
                (["--chunks", "0"], "--chunks"),
                (["--max-ctas", "-1"], "--max-ctas"),
                (["--queue-delay-us", "3000000"], "--queue-delay-us"),  # overflowed an int
                (["--shapes", "seed", "--m", "512"], "--m: --shapes seed has its own m"),
                # n_local = n / tp was truncated: a different shape, recorded as the asked one.
                (["--tp", "3"], "--tp 3: llama70b.qkv splits n=10240"),
                (["--dtype", "fp8", "--dtype", "bf16", "--tune-out", "t.yaml"],
                 "give exactly one --dtype"),
                (["--methods", "auto"], "--methods auto needs --overlap")):
            self.refused(BENCH, args, says)

    def test_bench_model(self):
        for args, says in (
                (["--model", "tiny", "--layers", "500"], "--layers 500: tiny has 2 layers"),
                (["--warmup", "-1"], "--warmup: '-1' is negative"),
                (["--tp", "0"], "--tp"),
                (["--seed", "-1"], "--seed: '-1'"),
                (["--model", "tiny", "--batches", "1x3000"], "LEN must be at most 2048"),
                (["--batches", "300000x8192"], "SEQS x LEN at most 2147483647"),
                (["--residual-gain", "0"], "--residual-gain"),
                (["--residual-gain", "-0.5"], "--residual-gain"),
                (["--model", "tiny", "--fp8-attention"], "tiny's head_dim is 64")):
            self.refused(BENCH_MODEL, args, says)

    def test_bench_decode(self):
        for args, says in (
                # A tp that does not divide the heads would shard them unevenly.
                (["--model", "llama3-8b", "--tp", "3"], "--tp 3: llama3-8b has 32 attention heads"),
                (["--tp", "0"], "--tp"),
                (["--overlap", "/nonexistent/overlap.yaml"], "--overlap: File does not exist"),
                (["--batches", "0"], "--batches"),
                (["--kv-dtype", "fp16"], "--kv-dtype: fp16 not in {bf16,fp8}"),
                (["--timeline", "--tp", "2"], "--timeline traces one GPU's kernels")):
            self.refused(BENCH_DECODE, args, says)


if __name__ == "__main__":
    unittest.main()
