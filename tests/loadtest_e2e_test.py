"""End-to-end test of tpserve-loadtest against a local tpserve (CTest label e2e).

Run by CTest with TPSERVE_BIN and LOADTEST_BIN pointing at the built binaries.

--mode generate runs against `tpserve serve` (skipped, saying so, while the server's
ModelMetadata has no input named request_output_len, i.e. before it generates), and against a
stand-in generation server with programmed timing (Python, run by an interpreter that has
grpcio; skipped without one), whose known TTFT and inter-token gaps the figures must show.
"""
import csv
import json
import os
import select
import shutil
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

TPSERVE = os.environ.get("TPSERVE_BIN", "build/bin/tpserve")
LOADTEST = os.environ.get("LOADTEST_BIN", "build/bin/tpserve-loadtest")
RENDERER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                        "render_loadtest.py")

STEP_FIELDS = ["requests_per_sec", "tokens_per_sec", "p50_ms", "p90_ms", "p95_ms", "p99_ms",
               "max_ms", "errors", "error_share", "server_queue_ms", "server_compute_ms",
               "window_s", "in_flight_at_end", "stable", "offered_per_sec"]


GENERATE_FIELDS = ["output_tokens_per_sec", "total_tokens_per_sec", "goodput_per_sec",
                   "good_requests", "output_tokens", "prompt_tokens", "ttft_mean_ms",
                   "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms",
                   "tpot_p90_ms", "tpot_p99_ms", "itl_mean_ms", "itl_p50_ms", "itl_p90_ms",
                   "itl_p99_ms", "e2e_mean_ms", "closed_loop_output_tokens_per_sec"]
NO_GENERATION = "has no input named request_output_len"


def loadtest(*args, timeout=60):
    return subprocess.run([LOADTEST, *args], capture_output=True, text=True, timeout=timeout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoadTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.metrics_port = free_port()
        self.server = subprocess.Popen(
            [TPSERVE, "serve", "--model", "tiny", "--tp", "2", "--backend", "cpu", "--grpc-port", "0",
             "--metrics-port", str(self.metrics_port), "--host", "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.addCleanup(self._kill_server)
        ready, _, _ = select.select([self.server.stdout], [], [], 30)
        self.assertTrue(ready, "tpserve printed nothing within 30 s")
        line = self.server.stdout.readline()
        self.assertIn("on gRPC port", line)
        self.port = int(line.strip().rsplit(" ", 1)[1])
        self.url = f"127.0.0.1:{self.port}"

    def _kill_server(self):
        if self.server.poll() is None:
            self.server.kill()
            self.server.wait()
        self.server.stdout.close()

    def wait_for_served_requests(self, count, seconds=30):
        """Waits until the server has answered `count` inference requests (its metrics)."""
        deadline = time.monotonic() + seconds
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=5) as r:
                m = re.search(r'^nv_inference_request_success\{[^}]*\} (\d+)$',
                              r.read().decode(), re.M)
            if m and int(m.group(1)) >= count:
                return
            time.sleep(0.01)
        self.fail(f"the server answered fewer than {count} requests in {seconds} s")

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def check_steps(self, doc, key, n):
        self.assertEqual(doc["meta"]["url"], self.url)
        self.assertEqual(doc["meta"]["model"], "tiny")
        self.assertIn("date", doc["meta"])
        self.assertIs(doc["meta"]["complete"], True)
        self.assertIn(LOADTEST, doc["meta"]["command"])
        self.assertEqual(len(doc["steps"]), n, doc)
        for step in doc["steps"]:
            for field in [key] + STEP_FIELDS:
                self.assertIn(field, step, step)
            self.assertEqual(step["errors"], {}, step)
            self.assertGreater(step["requests_per_sec"], 0, step)
            self.assertGreater(step["tokens_per_sec"], 0, step)
            # Stability needs 3 windows; with fewer it is not claimed either way.
            if step["trials"] >= 3:
                self.assertIsInstance(step["stable"], bool, step)
            else:
                self.assertIsNone(step["stable"], step)
            self.assertEqual(step["error_share"], 0, step)
            self.assertLessEqual(step["p50_ms"], step["p90_ms"])
            self.assertLessEqual(step["p90_ms"], step["p95_ms"])
            self.assertLessEqual(step["p95_ms"], step["p99_ms"])
            self.assertLessEqual(step["p99_ms"], step["max_ms"])
            self.assertGreaterEqual(step["server_queue_ms"], 0)
            self.assertGreater(step["server_compute_ms"], 0)

    def test_sweeps_then_unreachable_server(self):
        # Closed loop: concurrency 1 and 4.
        out_json, out_csv = self.path("out.json"), self.path("out.csv")
        p = loadtest("-u", self.url, "--concurrency-range", "1:4:3", "--duration", "1",
                     "--warmup", "0.5", "--max-trials", "3", "--prompt-len-range", "4:16",
                     "--json", out_json, "--csv", out_csv)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        print(p.stdout)
        with open(out_json) as f:
            doc = json.load(f)
        self.check_steps(doc, "concurrency", 2)
        self.assertEqual([s["concurrency"] for s in doc["steps"]], [1, 4])
        with open(out_csv) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 2)
        self.assertEqual(rows[1]["concurrency"], "4")
        for field in ["requests_per_sec", "tokens_per_sec", "p99_ms", "server_queue_ms",
                      "server_compute_ms", "stable"]:
            self.assertIn(field, rows[0])
        self.assertGreater(float(rows[0]["requests_per_sec"]), 0)
        # The latency-vs-load picture of this very report.
        png = self.path("out.png")
        r = subprocess.run([sys.executable, RENDERER, out_json, "--png", png],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

        # Open loop: Poisson arrivals at 40 requests/s, INT64 ids.
        out_json = self.path("rate.json")
        p = loadtest("-u", self.url, "--request-rate-range", "40", "--distribution", "poisson",
                     "--duration", "1", "--warmup", "0.5", "--max-trials", "3",
                     "--prompt-len", "8", "--datatype", "INT64", "--json", out_json)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        print(p.stdout)
        with open(out_json) as f:
            doc = json.load(f)
        self.check_steps(doc, "request_rate", 1)
        self.assertEqual(doc["steps"][0]["request_rate"], 40)
        # What the client really issued: Poisson arrivals at 40/s over the windows' seconds
        # (a few dozen requests: within a wide margin).
        self.assertGreater(doc["steps"][0]["offered_per_sec"], 20, doc["steps"][0])
        self.assertLess(doc["steps"][0]["offered_per_sec"], 70, doc["steps"][0])
        self.assertAlmostEqual(doc["steps"][0]["tokens_per_sec"],
                               8 * doc["steps"][0]["requests_per_sec"], delta=1e-6)

        # Stop the server: it drains and exits 0.
        self.server.send_signal(signal.SIGTERM)
        self.assertEqual(self.server.wait(timeout=30), 0)

        # Now nothing listens on the port: exit 2 at once with a clear message,
        # and the earlier report given as --json is left as it was.
        with open(out_json) as f:
            before = f.read()
        start = time.monotonic()
        p = loadtest("-u", self.url, "--duration", "1", "--json", out_json, timeout=30)
        self.assertLess(time.monotonic() - start, 5)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn(f"cannot reach the server at {self.url}", p.stderr)
        with open(out_json) as f:
            self.assertEqual(f.read(), before)
        self.assertFalse(os.path.exists(out_json + ".tmp"))

    def test_errors_are_counted_and_all_failed_exits_1(self):
        # Every request names an input the model does not have.
        out_json = self.path("bad.json")
        p = loadtest("-u", self.url, "--input-name", "no_such_input", "--requests", "5",
                     "--warmup", "0", "--max-trials", "1", "--json", out_json)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("every measured request failed", p.stderr)
        with open(out_json) as f:
            step = json.load(f)["steps"][0]
        self.assertGreaterEqual(step["errors"].get("INVALID_ARGUMENT", 0), 5, step)
        self.assertEqual(step["requests_per_sec"], 0)
        self.assertEqual(step["error_share"], 1.0, step)
        self.assertIsNone(step["stable"], step)  # nothing succeeded: not "stable"

    def test_unknown_model_exits_2_before_any_load(self):
        p = loadtest("-u", self.url, "-m", "no-such-model", "--requests", "5", "--warmup", "0",
                     timeout=10)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("model 'no-such-model' is not ready", p.stderr)
        self.assertIn("NOT_FOUND", p.stderr)

    def test_prompt_file(self):
        prompts = self.path("prompts.txt")
        with open(prompts, "w") as f:
            f.write("1,2,3\n\n4 5 6 7\n")
        out_json = self.path("file.json")
        p = loadtest("-u", self.url, "--prompt-file", prompts, "--requests", "20", "--warmup",
                     "0", "--max-trials", "1", "--json", out_json)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(out_json) as f:
            step = json.load(f)["steps"][0]
        self.assertGreaterEqual(step["requests"], 20)
        self.assertEqual(step["errors"], {})
        self.assertIsNone(step["stable"], step)  # one window cannot show stability

    def test_server_killed_mid_sweep(self):
        # The server dies during the first step: the sweep goes on without
        # hanging, counts the failures, and closes the report.
        out_json = self.path("killed.json")
        lt = subprocess.Popen(
            [LOADTEST, "-u", self.url, "--concurrency-range", "1:4", "--duration", "0.3",
             "--warmup", "0.2", "--max-trials", "3", "--json", out_json],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: lt.poll() is None and lt.kill())
        # The first step is 0.2 s of warmup, then three 0.3 s windows. Kill the
        # server 0.45 s after it answered the load's first request: inside the
        # step, after some of its measured requests succeeded, whatever the
        # client's start-up took.
        self.wait_for_served_requests(1)
        time.sleep(0.45)
        self.server.kill()
        self.server.wait()
        out, err = lt.communicate(timeout=60)
        self.assertEqual(lt.returncode, 0, out + err)  # the first window succeeded
        with open(out_json) as f:
            doc = json.load(f)
        self.assertIs(doc["meta"]["complete"], True)
        steps = doc["steps"]
        self.assertEqual([s["concurrency"] for s in steps], [1, 2, 3, 4])
        self.assertGreater(steps[0]["requests"], 0, steps[0])
        self.assertGreater(steps[0]["error_count"], 0, steps[0])
        for step in steps:
            # Closed loop: exactly the concurrency outstanding, never a
            # replacement counted before the request it replaces is done.
            self.assertEqual(step["in_flight_at_end"], step["concurrency"], step)
        for step in steps[1:]:
            self.assertEqual(step["requests"], 0, step)
            self.assertEqual(step["errors"], {"UNAVAILABLE": step["error_count"]}, step)
            self.assertEqual(step["error_share"], 1.0, step)
            self.assertIsNone(step["p50_ms"], step)
            self.assertIsNone(step["server_compute_ms"], step)

    def test_a_stalled_server_is_measured_in_back_to_back_windows(self):
        # The server stops answering (SIGSTOP) early in the first window. Each window's end
        # is followed by a statistics call that waits its 3 s deadline on the stalled server;
        # the windows must run on through those waits, so that the requests timing out
        # meanwhile are counted, not lost between windows (they were: three 1 s windows
        # reported 3 s and a dozen errors for a 12 s run).
        out_json = self.path("stalled.json")
        lt = subprocess.Popen(
            [LOADTEST, "-u", self.url, "--concurrency-range", "4", "--duration", "1",
             "--warmup", "0.2", "--max-trials", "3", "--timeout-ms", "500", "--json", out_json],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: lt.poll() is None and lt.kill())
        self.wait_for_served_requests(1)
        time.sleep(0.4)  # the 0.2 s warm-up and a little of the first window
        os.kill(self.server.pid, signal.SIGSTOP)
        self.addCleanup(lambda: self.server.poll() is None and os.kill(self.server.pid,
                                                                       signal.SIGCONT))
        out, err = lt.communicate(timeout=60)
        os.kill(self.server.pid, signal.SIGCONT)
        with open(out_json) as f:
            step = json.load(f)["steps"][0]
        # Windows back to back through the two 3 s statistics waits: more than 6 s together.
        self.assertGreater(step["window_s"], 5.5, step)
        # Stalled for all but the first moments: four slots time out every 0.5 s.
        stalled_s = step["window_s"] - 1.0
        self.assertGreater(step["error_count"], 0.5 * 4 * stalled_s / 0.5, step)
        self.assertEqual(set(step["errors"]), {"DEADLINE_EXCEEDED"}, step)

    @unittest.skipUnless(shutil.which("openssl"), "needs openssl")
    def test_tls_server(self):
        # A server that serves TLS (`serve --tls-cert/--tls-key`): reached with --tls-ca and
        # measured; without it the error says TLS may be the cause.
        crt, key = self.path("server.crt"), self.path("server.key")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", key, "-out", crt],
                       check=True, capture_output=True)
        tls_server = subprocess.Popen(
            [TPSERVE, "serve", "--model", "tiny", "--tp", "1", "--backend", "cpu",
             "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1",
             "--tls-cert", crt, "--tls-key", key],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.addCleanup(lambda: (tls_server.kill(), tls_server.wait(), tls_server.stdout.close()))
        ready, _, _ = select.select([tls_server.stdout], [], [], 30)
        self.assertTrue(ready, "tpserve printed nothing within 30 s")
        url = "127.0.0.1:" + tls_server.stdout.readline().strip().rsplit(" ", 1)[1]
        out_json = self.path("tls.json")
        p = loadtest("-u", url, "--tls-ca", crt, "--duration", "0.3", "--warmup", "0.1",
                     "--max-trials", "1", "--json", out_json)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(out_json) as f:
            step = json.load(f)["steps"][0]
        self.assertGreater(step["requests"], 0, step)
        self.assertEqual(step["errors"], {}, step)
        p = loadtest("-u", url, "--duration", "0.3", timeout=30)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("needs --tls or --tls-ca", p.stderr)
        p = loadtest("-u", url, "--tls-ca", key, "--duration", "0.3", timeout=30)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        # A key is no certificate: refused naming the flag, before any connection.
        self.assertIn("--tls-ca %s: not a PEM file holding a CERTIFICATE" % key, p.stderr)

    def test_report_survives_arguments_that_are_not_utf8(self):
        # A --csv path in another encoding: the JSON report (whose meta holds
        # the command line) is still written, with U+FFFD for the bad byte.
        out_json = self.path("utf8.json")
        out_csv = self.path("r\udce9sultats.csv")  # b"r\xe9sultats.csv" on the command line
        p = loadtest("-u", self.url, "--requests", "5", "--warmup", "0", "--max-trials", "1",
                     "--json", out_json, "--csv", out_csv)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(out_json) as f:
            doc = json.load(f)
        self.assertIn("r\ufffdsultats.csv", doc["meta"]["command"])
        self.assertEqual(len(doc["steps"]), 1)
        self.assertTrue(os.path.exists(out_csv))

    def test_usage_errors_exit_2(self):
        negative = self.path("negative.txt")
        with open(negative, "w") as f:
            f.write("1 2 3\n4 -5 6\n")
        wide = self.path("wide.txt")
        with open(wide, "w") as f:
            f.write("1 4294967296\n")
        for args, says in (
                (["--duration", "nan"], "--duration must be at least 0.1 s"),
                (["--duration", "1e-6"], "--duration must be at least 0.1 s"),
                (["--stability", "nan"], "--stability and --warmup finite"),
                (["--warmup", "inf"], "--stability and --warmup finite"),
                (["--concurrency-range", "3000000000"], "from 1 to 65536"),
                (["--request-rate-range", "2e6"], "at most 1e+06"),
                (["--request-rate-range", "0.5:10000:0.5"], "at most 10000 values"),
                (["--prompt-len-range", "1.5:3"], "whole numbers"),
                (["--prompt-file", negative], negative + ":2: token id -5 out of range"),
                (["--prompt-file", wide], wide + ":1: token id 4294967296 out of range for "
                                                 "--datatype INT32"),
                (["--concurrency-range", "1", "--request-rate-range", "5"], "excludes"),
                (["--concurrency-range", "4:1"], "--concurrency-range"),
                (["--concurrency-range", "0.4"], "whole numbers from 1 to 65536"),
                (["--datatype", "FP32"], "FP32"),
                (["--prompt-file", self.path("missing.txt")], "missing.txt"),
                (["--requests", "-5"], "--requests must be >= 1"),
                (["--requests", "0"], "--requests must be >= 1"),  # was: windows of --duration
                (["--seed", "-1"], "--seed: '-1' is not a whole number"),  # wrapped to 2^64-1
                (["--prompt-len-range", "1:1e13"],
                 "--prompt-len-range: prompts of at most 1048576 tokens"),
                (["--prompt-len", "2000000"], "--prompt-len: prompts of at most 1048576 tokens"),
                # Times beyond the nanosecond clocks wrapped: a window that
                # closed at once, no warmup, every request past its deadline,
                # requests sent flat out.
                (["--duration", "1e12"], "--duration must be at least 0.1 s and at most 1e+06 s"),
                (["--warmup", "1e300"], "--warmup must be at most 1e+06 s"),
                (["--timeout-ms", "9223372036854775807"], "--timeout-ms must be at most"),
                (["--request-rate-range", "1e-12"], "at least 0.001, got 1e-12"),
                # Closed loop has no arrival process: not silently ignored.
                (["--concurrency-range", "2", "--distribution", "poisson"],
                 "--distribution requires --request-rate-range"),
                (["--json", self.tmp.name], "a directory"),
                (["--json", self.path("r"), "--csv", os.path.join(self.tmp.name, ".", "r")],
                 "--json and --csv name the same file"),
                # Relative, and not there yet (refused before anything is written).
                (["--json", "lt-same.json", "--csv", "./lt-same.json"],
                 "--json and --csv name the same file"),
                (["--vocab", "3000000000"], "does not fit --datatype INT32"),
                (["--json", self.path("no/such/dir/out.json")], "cannot write"),
                # Generation flags need --mode generate, and are checked before any load.
                (["--output-len", "8"], "--output-len needs --mode generate"),
                (["--no-streaming"], "needs --mode generate"),
                (["--mode", "generate", "--output-len", "0"], "--output-len must be N or MIN:MAX"),
                (["--mode", "generate", "--output-len", "9:3"], "1 <= MIN <= MAX <= 1048576"),
                (["--mode", "generate", "--output-len", "2000000"], "got '2000000'"),
                (["--mode", "generate", "--no-streaming", "--slo-ttft-ms", "100"],
                 "--slo-ttft-ms needs streaming"),
                (["--mode", "generate", "--slo-tpot-ms", "0"],
                 "--slo-tpot-ms must be a positive number"),
                (["--mode", "generate", "--slo-ttft-ms", "nan"],
                 "--slo-ttft-ms must be a positive number"),
                (["--mode", "generate", "--end-id", "-3"], "--end-id must be a token id"),
                (["--mode", "generate", "--end-id", "2", "--ignore-eos"], "excludes"),
                (["--mode", "generate", "--datatype", "INT64"],
                 "--mode generate sends input_ids as INT32"),
                (["--mode", "generate", "--requests-per-stream", "0"],
                 "--requests-per-stream must be from 1 to 1000000"),
                (["--requests-per-stream", "8"], "--requests-per-stream needs --mode generate"),
                (["--mode", "sample"], "sample")):
            start = time.monotonic()
            p = loadtest("-u", self.url, *args, timeout=10)
            self.assertEqual(p.returncode, 2, (args, p.stdout, p.stderr))
            self.assertIn(says, p.stdout + p.stderr, args)
            self.assertLess(time.monotonic() - start, 5, args)  # before any load runs


class GenerateChecks:
    """Checks of --mode generate reports shared by the tests against tpserve and the stand-in."""

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def run_generate(self, url, *args, expect_rc=0, timeout=90):
        p = loadtest("-u", url, "--mode", "generate", *args, timeout=timeout)
        self.assertEqual(p.returncode, expect_rc, p.stdout + p.stderr)
        return p

    def check_generate_step(self, step, output_len, streaming):
        for field in STEP_FIELDS + GENERATE_FIELDS:
            self.assertIn(field, step, step)
        self.assertEqual(step["errors"], {}, step)
        self.assertGreater(step["requests"], 0, step)
        lo, hi = output_len
        # --ignore-eos: every request ran to its drawn length.
        self.assertGreaterEqual(step["output_tokens"], lo * step["requests"], step)
        self.assertLessEqual(step["output_tokens"], hi * step["requests"], step)
        secs = step["window_s"]
        self.assertAlmostEqual(step["output_tokens_per_sec"], step["output_tokens"] / secs,
                               delta=1e-6 * step["output_tokens_per_sec"])
        self.assertAlmostEqual(step["total_tokens_per_sec"],
                               (step["output_tokens"] + step["prompt_tokens"]) / secs,
                               delta=1e-6 * step["total_tokens_per_sec"])
        self.assertLessEqual(step["p50_ms"], step["p90_ms"])
        self.assertLessEqual(step["p90_ms"], step["p99_ms"])
        if streaming:
            for name in ("ttft", "tpot", "itl"):
                self.assertLessEqual(step[name + "_p50_ms"], step[name + "_p90_ms"], name)
                self.assertLessEqual(step[name + "_p90_ms"], step[name + "_p99_ms"], name)
            self.assertGreater(step["ttft_p50_ms"], 0)
            self.assertLessEqual(step["ttft_p50_ms"], step["p50_ms"])  # first token before the last
            self.assertGreater(step["tpot_p50_ms"], 0)
            self.assertGreater(step["itl_p50_ms"], 0)
        else:
            # Not observed without streaming: null, not the end-to-end latency.
            for name in ("ttft", "tpot", "itl"):
                for q in ("mean", "p50", "p90", "p99"):
                    self.assertIsNone(step["%s_%s_ms" % (name, q)], (name, q, step))


class GenerateAgainstTpserve(GenerateChecks, unittest.TestCase):
    """--mode generate against `tpserve serve --model tiny --tp 1`: skipped until it generates.
    A server per test, so that one test's failure does not fail the next."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.server = subprocess.Popen(
            [TPSERVE, "serve", "--model", "tiny", "--tp", "1", "--backend", "cpu",
             "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.addCleanup(self._kill_server)
        ready, _, _ = select.select([self.server.stdout], [], [], 30)
        line = self.server.stdout.readline() if ready else ""
        self.assertIn("on gRPC port", line, "tpserve did not start")
        self.url = "127.0.0.1:" + line.strip().rsplit(" ", 1)[1]
        # The loadtest reads the model's metadata before any load: without generation it
        # names the missing input and exits 2. (One unary request: the probe needs nothing
        # of streaming.)
        p = loadtest("-u", self.url, "--mode", "generate", "--no-streaming", "--output-len", "1",
                     "--requests", "1", "--warmup", "0", "--max-trials", "1", timeout=30)
        if p.returncode == 2 and NO_GENERATION in p.stderr:
            self.skipTest("tpserve's ModelMetadata for 'tiny' has no input named "
                          "request_output_len: the server does not generate tokens yet, so "
                          "--mode generate has nothing to measure")

    def _kill_server(self):
        if self.server.poll() is None:
            self.server.kill()
            self.server.wait()
        self.server.stdout.close()

    def test_streaming_closed_loop(self):
        out_json, out_csv = self.path("gen.json"), self.path("gen.csv")
        self.run_generate(self.url, "--streaming", "--concurrency-range", "1:4:3",
                          "--output-len", "8", "--prompt-len-range", "4:16", "--duration", "1",
                          "--warmup", "0.3", "--max-trials", "2", "--slo-ttft-ms", "60000",
                          "--slo-tpot-ms", "60000", "--json", out_json, "--csv", out_csv)
        with open(out_json) as f:
            doc = json.load(f)
        self.assertEqual(doc["meta"]["mode"], "generate")
        self.assertIs(doc["meta"]["streaming"], True)
        self.assertIs(doc["meta"]["ignore_eos"], True)
        self.assertEqual([s["concurrency"] for s in doc["steps"]], [1, 4])
        for step in doc["steps"]:
            self.check_generate_step(step, (8, 8), streaming=True)
            # Objectives a minute long: every request meets them.
            self.assertEqual(step["good_requests"], step["requests"], step)
            self.assertAlmostEqual(step["goodput_per_sec"], step["requests_per_sec"])
            # Little's law over the same requests: clients x tokens per request / mean e2e.
            want = (step["concurrency"] * step["output_tokens"] / step["requests"] /
                    (step["e2e_mean_ms"] / 1e3))
            self.assertAlmostEqual(step["closed_loop_output_tokens_per_sec"], want,
                                   delta=1e-6 * want)
        with open(out_csv) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 2)
        for field in GENERATE_FIELDS:
            self.assertIn(field, rows[0])
        png, table = self.path("gen.png"), self.path("gen.md")
        r = subprocess.run([sys.executable, RENDERER, out_json, "--png", png, "--table", table],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        with open(table) as f:
            self.assertIn("TTFT p50", f.read())

    def test_unary_poisson(self):
        out_json = self.path("unary.json")
        self.run_generate(self.url, "--no-streaming", "--request-rate-range", "10",
                          "--distribution", "poisson", "--output-len", "4:8", "--duration", "1",
                          "--warmup", "0.3", "--max-trials", "2", "--json", out_json)
        with open(out_json) as f:
            doc = json.load(f)
        self.assertIs(doc["meta"]["streaming"], False)
        step = doc["steps"][0]
        self.check_generate_step(step, (4, 8), streaming=False)
        self.assertIsNone(step["goodput_per_sec"], step)  # no objectives given
        self.assertIsNone(step["closed_loop_output_tokens_per_sec"], step)  # an open loop

    def test_streaming_poisson(self):
        out_json = self.path("stream_rate.json")
        self.run_generate(self.url, "--request-rate-range", "10", "--distribution", "poisson",
                          "--output-len", "4", "--duration", "1", "--warmup", "0.3",
                          "--max-trials", "1", "--json", out_json)
        with open(out_json) as f:
            step = json.load(f)["steps"][0]
        self.check_generate_step(step, (4, 4), streaming=True)


# A generation server with programmed timing, in the protocol tpserve-loadtest speaks.
STAND_IN = r"""
# A stand-in generation server: the TensorRT-LLM backend protocol with programmed timing.
#
#   python3 stand_in.py PROTO_OUT_DIR TTFT_MS ITL_MS [TOKENS_PER_RESPONSE]
#
# Prints its port, then serves until killed. Every request generates request_output_len tokens
# (token i is 1000 + i; half as many when end_id is sent, as if it met its end token): the
# first response TTFT_MS after the request, then responses of TOKENS_PER_RESPONSE tokens, each
# ITL_MS after the one before; the last carries triton_final_response. request_output_len
# > 100000 is refused on the stream with the request's id.
import concurrent.futures
import queue
import struct
import sys
import threading
import time

import grpc

sys.path.insert(0, sys.argv[1])
from proto import grpc_service_pb2 as pb  # noqa: E402

TTFT, ITL = float(sys.argv[2]) / 1000, float(sys.argv[3]) / 1000
PER = int(sys.argv[4]) if len(sys.argv) > 4 else 1
SERVICE = "inference.GRPCInferenceService"


def inputs(req):
    out = {}
    for i, t in enumerate(req.inputs):
        raw = req.raw_input_contents[i]
        if t.datatype == "INT32":
            out[t.name] = list(struct.unpack("<%di" % (len(raw) // 4), raw))
        elif t.datatype == "BOOL":
            out[t.name] = [b != 0 for b in raw]
    return out


def response(req_id, tokens, final):
    r = pb.ModelInferResponse(model_name="tiny", id=req_id)
    r.outputs.add(name="output_ids", datatype="INT32", shape=[1, 1, len(tokens)])
    r.raw_output_contents.append(struct.pack("<%di" % len(tokens), *tokens))
    r.outputs.add(name="sequence_length", datatype="INT32", shape=[1, 1])
    r.raw_output_contents.append(struct.pack("<i", len(tokens)))
    if final:
        r.parameters["triton_final_response"].bool_param = True
    return r


def plan(req):
    x = inputs(req)
    n = x["request_output_len"][0]
    if "end_id" in x:
        n = max(1, n // 2)  # "stops at its end token" half way
    return n


def live(req, ctx):
    return pb.ServerLiveResponse(live=True)


def ready(req, ctx):
    return pb.ModelReadyResponse(ready=req.name == "tiny")


def metadata(req, ctx):
    m = pb.ModelMetadataResponse(name="tiny", platform="mock")
    for name in ("input_ids", "input_lengths", "request_output_len", "end_id", "streaming",
                 "exclude_input_in_output"):
        m.inputs.add(name=name, datatype="INT32", shape=[1, -1])
    return m


def stats(req, ctx):
    return pb.ModelStatisticsResponse()


def infer(req, ctx):
    n = plan(req)
    time.sleep(TTFT + ITL * max(0, (n - 1) // PER))
    return response(req.id, [1000 + i for i in range(n)], False)


def stream(it, ctx):
    out = queue.Queue()
    done = object()
    active = [0]  # requests still generating
    idle = threading.Condition()

    def generate(req):
        # Sleeps between responses, not a schedule: a late response never makes the next
        # gap shorter, so the programmed times are floors.
        n = plan(req)
        time.sleep(TTFT)
        k = 0
        while k < n:
            if k:
                time.sleep(ITL)
            toks = [1000 + i for i in range(k, min(n, k + PER))]
            k += len(toks)
            out.put(pb.ModelStreamInferResponse(infer_response=response(req.id, toks, k >= n)))
        with idle:
            active[0] -= 1
            idle.notify_all()

    def reader():
        for req in it:
            x = inputs(req)
            if x.get("request_output_len", [1])[0] > 100000:
                r = pb.ModelStreamInferResponse(error_message="INVALID_ARGUMENT: too long")
                r.infer_response.id = req.id
                out.put(r)
                continue
            with idle:
                active[0] += 1
            threading.Thread(target=generate, args=(req,), daemon=True).start()
        with idle:  # the client has half-closed: end the stream once every request is answered
            idle.wait_for(lambda: active[0] == 0)
        out.put(done)

    threading.Thread(target=reader, daemon=True).start()
    while True:
        m = out.get()
        if m is done:
            return
        yield m


def main():
    def u(fn, request, response):
        return grpc.unary_unary_rpc_method_handler(fn, request.FromString,
                                                   response.SerializeToString)
    handlers = {
        "ServerLive": u(live, pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ModelReady": u(ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ModelMetadata": u(metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelStatistics": u(stats, pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
        "ModelInfer": u(infer, pb.ModelInferRequest, pb.ModelInferResponse),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
            stream, pb.ModelInferRequest.FromString, pb.ModelStreamInferResponse.SerializeToString),
    }
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=64))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()

"""


def python_with_grpc():
    """An interpreter that can import grpc (the stand-in server needs it), or None."""
    for exe in (sys.executable, "/usr/bin/python3"):
        if exe and os.path.exists(exe) and subprocess.run(
                [exe, "-c", "import grpc, google.protobuf"], capture_output=True).returncode == 0:
            return exe
    return None


class GenerateAgainstStandIn(GenerateChecks, unittest.TestCase):
    """--mode generate against a stand-in server whose timing is known: the first response at
    least 40 ms after the request, each later one at least 10 ms after the one before. TTFT and
    end-to-end latency have those floors (a busy machine adds to them); the gaps the client
    sees may also shrink (one response read late, the next on time), so TPOT and ITL are held
    to wide bounds around the programmed gap."""

    TTFT_MS, ITL_MS = 40, 10

    @classmethod
    def setUpClass(cls):
        cls.python = python_with_grpc()
        if cls.python is None or shutil.which("protoc") is None:
            raise unittest.SkipTest("the stand-in generation server needs a Python with grpcio "
                                    "and protoc")
        cls.tmp = tempfile.TemporaryDirectory()
        proto_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        subprocess.run(["protoc", "--proto_path=" + proto_dir, "--python_out=" + cls.tmp.name,
                        os.path.join(proto_dir, "proto", "grpc_service.proto")], check=True)
        cls.script = os.path.join(cls.tmp.name, "stand_in.py")
        with open(cls.script, "w") as f:
            f.write(STAND_IN)
        cls.servers = []
        cls.url = cls.start(1)
        cls.url3 = cls.start(3)  # three tokens per response

    @classmethod
    def start(cls, per_response):
        server = subprocess.Popen([cls.python, cls.script, cls.tmp.name, str(cls.TTFT_MS),
                                   str(cls.ITL_MS), str(per_response)],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        cls.servers.append(server)
        ready, _, _ = select.select([server.stdout], [], [], 30)
        line = server.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            cls.tearDownClass()
            raise AssertionError("the stand-in server did not start: %r" % line)
        return "127.0.0.1:" + line.strip()

    @classmethod
    def tearDownClass(cls):
        for server in cls.servers:
            if server.poll() is None:
                server.kill()
                server.wait()
            server.stdout.close()
        cls.tmp.cleanup()

    def step(self, url, *args, expect_rc=0):
        out_json = self.path("step.json")
        self.run_generate(url, *args, "--warmup", "0.2", "--max-trials", "1", "--json",
                          out_json, expect_rc=expect_rc)
        with open(out_json) as f:
            doc = json.load(f)
        return doc["meta"], doc["steps"][0]

    def test_streamed_figures_show_the_programmed_timing(self):
        meta, step = self.step(self.url, "--concurrency-range", "2", "--output-len", "12",
                               "--duration", "1", "--slo-ttft-ms", "5000", "--slo-tpot-ms",
                               "5000")
        self.assertEqual(meta["output_len"], [12, 12])
        self.check_generate_step(step, (12, 12), streaming=True)
        self.assertEqual(step["output_tokens"], 12 * step["requests"])
        self.assertGreaterEqual(step["ttft_p50_ms"], self.TTFT_MS)
        self.assertLess(step["ttft_p50_ms"], 3 * self.TTFT_MS)
        # One token per response: the two agree. (The client may read one response late and
        # the next on time, so its gaps have no hard floor: half the programmed one.)
        for name in ("tpot", "itl"):
            self.assertGreaterEqual(step[name + "_p50_ms"], 0.5 * self.ITL_MS, name)
            self.assertLess(step[name + "_p50_ms"], 3 * self.ITL_MS, name)
        self.assertGreaterEqual(step["p50_ms"], self.TTFT_MS + 11 * self.ITL_MS)
        self.assertEqual(step["good_requests"], step["requests"])
        self.assertAlmostEqual(step["goodput_per_sec"], step["requests_per_sec"])
        # An objective no request can meet: goodput 0, the requests themselves still counted.
        _, step = self.step(self.url, "--concurrency-range", "2", "--output-len", "12",
                            "--duration", "0.5", "--slo-tpot-ms", "1")
        self.assertGreater(step["requests"], 0)
        self.assertEqual(step["good_requests"], 0)
        self.assertEqual(step["goodput_per_sec"], 0)

    def test_requests_spread_over_streams(self):
        # One request per stream: 3 streams at concurrency 3, each request answered on its own.
        meta, step = self.step(self.url, "--requests-per-stream", "1", "--concurrency-range",
                               "3", "--output-len", "6", "--duration", "0.5")
        self.assertEqual(meta["requests_per_stream"], 1)
        self.check_generate_step(step, (6, 6), streaming=True)
        self.assertGreaterEqual(step["ttft_p50_ms"], self.TTFT_MS)

    def test_tpot_and_itl_differ_when_responses_carry_several_tokens(self):
        # 12 tokens in 4 responses 10 ms apart: ITL is the gap between responses, TPOT the
        # time after the first response per later token, (3 x 10 ms) / 11.
        _, step = self.step(self.url3, "--concurrency-range", "2", "--output-len", "12",
                            "--duration", "1")
        self.check_generate_step(step, (12, 12), streaming=True)
        self.assertGreaterEqual(step["itl_p50_ms"], 0.5 * self.ITL_MS)
        self.assertGreaterEqual(step["tpot_p50_ms"], 0.5 * 3 * self.ITL_MS / 11)
        self.assertLess(step["tpot_p50_ms"], 0.6 * step["itl_p50_ms"])

    def test_unary_open_loop(self):
        meta, step = self.step(self.url, "--no-streaming", "--request-rate-range", "20",
                               "--distribution", "poisson", "--output-len", "4:12",
                               "--duration", "1")
        self.assertIs(meta["streaming"], False)
        self.check_generate_step(step, (4, 12), streaming=False)
        self.assertGreaterEqual(step["p50_ms"], self.TTFT_MS + 3 * self.ITL_MS)
        self.assertGreater(step["offered_per_sec"], 8, step)
        self.assertLess(step["offered_per_sec"], 40, step)

    def test_end_id_lets_requests_stop_early(self):
        # The stand-in "meets its end token" half way when end_id is sent.
        meta, step = self.step(self.url, "--end-id", "2", "--concurrency-range", "2",
                               "--output-len", "12", "--duration", "0.5")
        self.assertIs(meta["ignore_eos"], False)
        self.assertEqual(meta["end_id"], 2)
        self.assertEqual(step["errors"], {}, step)
        self.assertEqual(step["output_tokens"], 6 * step["requests"])

    def test_errors_are_counted_per_request(self):
        # The stand-in refuses request_output_len > 100000 with the request's id.
        _, step = self.step(self.url, "--output-len", "200000", "--requests", "6",
                            expect_rc=1)
        self.assertGreaterEqual(step["errors"].get("INVALID_ARGUMENT", 0), 6, step)
        # A deadline shorter than the generation: each streamed request times out alone.
        _, step = self.step(self.url, "--output-len", "50", "--timeout-ms", "100",
                            "--concurrency-range", "2", "--requests", "4", expect_rc=1)
        self.assertEqual(set(step["errors"]), {"DEADLINE_EXCEEDED"}, step)

    def test_server_killed_mid_stream(self):
        url = self.start(1)
        server = self.servers[-1]
        out_json = self.path("killed.json")
        lt = subprocess.Popen(
            [LOADTEST, "-u", url, "--mode", "generate", "--output-len", "10",
             "--concurrency-range", "1:2", "--duration", "0.5", "--warmup", "0.2",
             "--max-trials", "2", "--json", out_json],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(lambda: lt.poll() is None and lt.kill())
        time.sleep(1.0)  # the first step's warm-up and part of its first window
        server.kill()
        server.wait()
        out, err = lt.communicate(timeout=60)
        self.assertEqual(lt.returncode, 0, out + err)
        with open(out_json) as f:
            steps = json.load(f)["steps"]
        self.assertEqual([s["concurrency"] for s in steps], [1, 2])
        self.assertGreater(steps[0]["requests"], 0, steps[0])
        self.assertEqual(steps[1]["requests"], 0, steps[1])
        self.assertEqual(set(steps[1]["errors"]), {"UNAVAILABLE"}, steps[1])


if __name__ == "__main__":
    unittest.main()
