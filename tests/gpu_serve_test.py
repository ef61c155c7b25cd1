"""`tpserve serve --backend cuda` end to end on 2 GPUs (label gpu): one process
per GPU (rank 0 is the server and starts rank 1 as `tpserve worker`), a
KServe v2 request through Debian's python3-grpcio, the logits compared with
the CPU reference backend, and the failure path: a worker killed with SIGKILL
while requests are in flight must make the server answer UNAVAILABLE (never
hang), log which rank was lost, and exit with status 1 within seconds (the
orchestrator restarts it). Skipped (not failed) where fewer than 2 GPUs are
visible.

Tolerance: the GPU keeps activations in BF16 (the CPU reference in FP32), so
the logits agree within a relative Frobenius error of 5e-2 (as in
tests/gpu_model_test.cc), not bit for bit.

CTest runs it with /usr/bin/python3 and TPSERVE_BIN, PROTO_DIR set.
"""
import json
import math
import os
import sys
import signal
import struct
import subprocess
import time
import unittest

import grpc

from grpc_interop_test import BIN, compile_messages, start_server

VOCAB = 1024  # the tiny preset


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


class ServeCuda(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if gpu_count() < 2:
            raise unittest.SkipTest("needs 2 GPUs")
        import tempfile
        cls.tmp = tempfile.TemporaryDirectory()
        cls.pb = compile_messages(cls.tmp.name)
        cls.log = open(os.path.join(cls.tmp.name, "server.log"), "w")
        cls.server, cls.port = start_server(
            ["--model", "tiny", "--tp", "2", "--backend", "cuda", "--rank-timeout-s", "20"],
            stderr=cls.log)
        cls.channel = grpc.insecure_channel(f"127.0.0.1:{cls.port}")

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        if cls.server.poll() is None:
            cls.server.kill()
            cls.server.wait()
        cls.log.close()
        # The server's log tail goes to the test output (a failure's evidence).
        with open(os.path.join(cls.tmp.name, "server.log"), errors="replace") as f:
            tail = f.read()[-6000:]
        sys.stderr.write("---- server log (tail) ----\n" + tail + "\n---- end ----\n")
        cls.tmp.cleanup()

    def infer(self, ids, timeout=60):
        pb = self.pb
        fn = self.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ModelInferResponse.FromString)
        req = pb.ModelInferRequest(model_name="tiny")
        tensor = req.inputs.add(name="input_ids", datatype="INT32", shape=[len(ids)])
        tensor.contents.int_contents.extend(ids)
        resp = fn(req, timeout=timeout)
        names = [o.name for o in resp.outputs]
        return list(struct.unpack(f"<{VOCAB}f", resp.raw_output_contents[names.index("logits")]))

    def health(self):
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check",
                                         request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
        return check(b"", timeout=10)

    def test_a_logits_match_the_cpu_backend(self):
        ids = [(i * 7919 + 13) % VOCAB for i in range(37)]
        gpu = self.infer(ids)
        cpu = json.loads(subprocess.run(
            [BIN, "run", "--model", "tiny", "--tp", "2", "--backend", "cpu", "--ids",
             ",".join(map(str, ids)), "--json"], capture_output=True, text=True,
            check=True).stdout)["logits"]
        num = sum((g - c) ** 2 for g, c in zip(gpu, cpu))
        den = sum(c * c for c in cpu)
        self.assertLessEqual(math.sqrt(num / den), 5e-2)
        self.assertEqual(self.health(), b"\x08\x01")  # SERVING

    def test_z_killed_worker_makes_requests_unavailable_and_the_server_exit(self):
        import threading
        workers = children(self.server.pid)
        self.assertEqual(len(workers), 1, f"expected one worker process, got {workers}")
        codes = []

        def client():  # requests in flight while the worker dies
            for _ in range(200):
                try:
                    self.infer([(i * 31) % VOCAB for i in range(256)], timeout=90)
                except grpc.RpcError as e:
                    codes.append(e.code())
                    return

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        start = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        rc = self.server.wait(timeout=90)
        elapsed = time.monotonic() - start
        for t in threads:
            t.join(timeout=120)
        self.assertEqual(rc, 1)
        self.assertLess(elapsed, 30, "the server must notice a lost rank within seconds")
        self.assertTrue(codes, "the in-flight requests must fail, not hang")
        self.assertTrue(all(c == grpc.StatusCode.UNAVAILABLE for c in codes), codes)
        with open(os.path.join(self.tmp.name, "server.log")) as f:
            log = f.read()
        self.assertIn("worker rank 1", log)
        self.assertIn("NOT_SERVING", log)

if __name__ == "__main__":
    unittest.main()
