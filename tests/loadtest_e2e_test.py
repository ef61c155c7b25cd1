"""End-to-end test of tpserve-loadtest against a local tpserve (CTest label e2e).

Run by CTest with TPSERVE_BIN and LOADTEST_BIN pointing at the built binaries.
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
                (["--json", self.path("no/such/dir/out.json")], "cannot write")):
            start = time.monotonic()
            p = loadtest("-u", self.url, *args, timeout=10)
            self.assertEqual(p.returncode, 2, (args, p.stdout, p.stderr))
            self.assertIn(says, p.stdout + p.stderr, args)
            self.assertLess(time.monotonic() - start, 5, args)  # before any load runs


if __name__ == "__main__":
    unittest.main()
