"""The gRPC server under clients that hold it: many queued requests, many
unread calls on one connection, a thousand idle streams, a stream whose client
stops reading, SIGTERM with hundreds queued. `tpserve serve` on the CPU
backend (tiny model, TP=1) on loopback; grpc.aio clients, so that the client
side holds no thread per call.

CTest runs it with /usr/bin/python3 and TPSERVE_BIN, PROTO_DIR set.
"""
import asyncio
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import grpc
import grpc.aio

from generation_e2e_test import Client, metric, outputs, start_server
from grpc_interop_test import compile_messages


# 1,500 calls on one connection, all sent before any answer is read; prints "sent", then the
# number answered OK.
FLOOD = """
import asyncio, struct, sys
import grpc.aio
from proto import grpc_service_pb2 as pb
async def main():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as ch:
        infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.ModelInferResponse.FromString)
        calls = []
        for i in range(1500):
            q = pb.ModelInferRequest(model_name="tiny")
            q.inputs.add(name="input_ids", datatype="INT32", shape=[4])
            q.raw_input_contents.append(struct.pack("<4i", 1, 2, 3, i % 1000 + 1))
            calls.append(asyncio.ensure_future(infer(q, timeout=300)))
        await asyncio.sleep(0.5)
        print("sent", flush=True)
        done = await asyncio.gather(*calls, return_exceptions=True)
        print(sum(1 for d in done if not isinstance(d, Exception)), flush=True)
asyncio.run(main())
"""


def run_async(coro, timeout=120):
    """Runs `coro` to its end (at most `timeout` s). Not asyncio.run: grpc.aio can leave a
    default-executor thread that asyncio.run's shutdown would wait on forever."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))
    finally:
        loop.close()


def proc_status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def logits_request(pb, ids, rid=""):
    req = pb.ModelInferRequest(model_name="tiny", id=rid)
    req.inputs.add(name="input_ids", datatype="INT32", shape=[len(ids)])
    req.raw_input_contents.append(struct.pack(f"<{len(ids)}i", *ids))
    return req


def aio_infer(channel, pb):
    return channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb.ModelInferResponse.FromString)


def aio_stream(channel, pb):
    return channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                 request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=pb.ModelStreamInferResponse.FromString)


class HostileClients(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.pb = compile_messages(cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def server(self, args):
        server, port, metrics = start_server(args, tp=1)
        self.addCleanup(lambda: server.poll() is None and server.kill())
        return server, port, metrics

    def test_queued_requests_cost_no_cpu_while_they_wait(self):
        # Batch-mates are awaited 10 s and a batch needs 1M tokens: 300 requests wait.
        server, port, metrics = self.server(["--max-queue-delay-us", "10000000",
                                             "--max-batch-tokens", "1000000",
                                             "--max-batch-sequences", "4096"])

        async def run():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                infer = aio_infer(ch, self.pb)
                calls = [infer(logits_request(self.pb, [i % 1000 + 1]), timeout=60)
                         for i in range(300)]
                tasks = [asyncio.ensure_future(c) for c in calls]
                await asyncio.sleep(1.0)  # all queued
                self.assertEqual(metric(metrics, "nv_inference_pending_request_count"), 300)
                threads = proc_status(server.pid, "Threads")
                before = cpu_seconds(server.pid)
                await asyncio.sleep(3.0)
                used = cpu_seconds(server.pid) - before
                self.assertLess(used / 3.0, 0.1, f"{used:.2f} s of CPU in 3 s with 300 queued")
                self.assertLess(threads, 100, "a thread per queued request?")
                for t in tasks:
                    t.cancel()
        run_async(run())

    def test_a_flood_on_one_connection_leaves_another_client_served(self):
        server, port, _ = self.server(["--max-queue-size", "4096"])
        rss_before = proc_status(server.pid, "VmRSS")
        # The flood comes from another process (its own connection and event loop), so that
        # the polite client's timing is the server's, not this process's.
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, str(port), self.tmp.name], stdout=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": self.tmp.name})
        self.addCleanup(lambda: flood.poll() is None and flood.kill())
        self.assertEqual(flood.stdout.readline().strip(), "sent")
        threads = proc_status(server.pid, "Threads")
        client = Client(self.pb, port)
        start = time.time()
        calls = [client.infer.future(logits_request(self.pb, [5, 6, i + 1], rid=f"p{i}"),
                                     timeout=10) for i in range(20)]
        answers = [c.result() for c in calls]  # raises DEADLINE_EXCEEDED past 10 s
        polite_s = time.time() - start
        client.channel.close()
        ok = int(flood.stdout.readline())
        self.assertEqual(flood.wait(timeout=300), 0)
        self.assertEqual([a.id for a in answers], [f"p{i}" for i in range(20)])
        # Batches take the two connections' requests in turn: the polite requests ride in
        # the next batches, not behind 1,500 others.
        self.assertLess(polite_s, 10)
        self.assertLess(threads, 100)
        self.assertEqual(ok, 1500)
        growth_mb = (proc_status(server.pid, "VmRSS") - rss_before) / 1024
        self.assertLess(growth_mb, 200, f"RSS grew by {growth_mb:.0f} MB")

    def test_a_thousand_idle_streams_and_a_client_that_stops_reading(self):
        server, port, metrics = self.server([])
        client = Client(self.pb, port)  # builds the requests; its channel stays unused
        self.addCleanup(client.channel.close)

        async def run():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stream = aio_stream(ch, self.pb)
                idle = [stream() for _ in range(1000)]
                await asyncio.sleep(1.0)
                self.assertEqual(metric(metrics, "tpserve_open_streams"), 1000)
                threads = proc_status(server.pid, "Threads")
                # A client that asks for a long generation and never reads it.
                stuck = stream()
                await stuck.write(client.request(list(range(1, 20)), 1500, rid="stuck",
                                                 streaming=("BOOL", True)))
                # Another stream is served meanwhile.
                start = time.time()
                other = stream()
                await other.write(client.request([3, 2, 1], 8, rid="other",
                                                 streaming=("BOOL", True)))
                tokens = []
                async for resp in other:
                    self.assertFalse(resp.error_message)
                    out = resp.infer_response
                    tokens += list(struct.unpack(f"<{len(out.raw_output_contents[0]) // 4}i",
                                                 out.raw_output_contents[0]))
                    if out.parameters["triton_final_response"].bool_param:
                        break
                elapsed = time.time() - start
                for c in idle + [stuck, other]:
                    c.cancel()
                return threads, tokens, elapsed
        threads, tokens, elapsed = run_async(run())
        self.assertLess(threads, 100, "a thread per open stream?")
        self.assertEqual(len(tokens), 8)
        self.assertLess(elapsed, 30)

    def test_rejections_are_counted_by_reason(self):
        server, port, metrics = self.server(["--max-streams", "1"])
        client = Client(self.pb, port)
        with self.assertRaises(grpc.RpcError):
            client.generate([1], -1)
        bad = logits_request(self.pb, [1])
        bad.model_name = "nope"
        with self.assertRaises(grpc.RpcError):
            client.infer(bad, timeout=10)
        text = __import__("urllib.request").request.urlopen(
            f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        counts = {}
        for line in text.splitlines():
            if line.startswith("tpserve_rejected_requests_total{"):
                reason = line.split('reason="')[1].split('"')[0]
                counts[reason] = float(line.rsplit(" ", 1)[1])
        self.assertEqual(counts["invalid_argument"], 1)
        self.assertEqual(counts["not_found"], 1)
        client.channel.close()

    def test_health_answers_not_serving_during_the_drain(self):
        server, port, _ = self.server(["--exit-timeout", "60"])
        client = Client(self.pb, port)
        self.addCleanup(client.channel.close)
        check = client.channel.unary_unary("/grpc.health.v1.Health/Check",
                                           request_serializer=lambda b: b,
                                           response_deserializer=lambda b: b)
        self.assertEqual(check(b"", timeout=10), b"\x08\x01")  # SERVING
        # A generation in flight keeps the drain open for a while.
        call = client.infer.future(client.request([1, 2, 3], 300), timeout=120)
        time.sleep(0.3)
        server.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        self.assertEqual(check(b"", timeout=10), b"\x08\x02")  # NOT_SERVING, not an error
        with self.assertRaises(grpc.RpcError) as e:  # new work is refused meanwhile
            client.generate([4], 2)
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        out = outputs(call.result())  # the accepted request finishes
        self.assertEqual(out["sequence_length"], [303])
        self.assertEqual(server.wait(timeout=60), 0)

    def test_sigterm_with_500_queued_exits_0_within_the_exit_timeout(self):
        server, port, _ = self.server(["--exit-timeout", "30", "--max-queue-delay-us", "10000000",
                                       "--max-batch-tokens", "1000000",
                                       "--max-batch-sequences", "4096"])

        async def run():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                infer = aio_infer(ch, self.pb)
                tasks = [asyncio.ensure_future(
                    infer(logits_request(self.pb, [i % 900 + 1, 2]), timeout=60))
                    for i in range(500)]
                await asyncio.sleep(1.0)
                start = time.time()
                server.send_signal(signal.SIGTERM)
                results = await asyncio.gather(*tasks, return_exceptions=True)
                return results, start
        results, start = run_async(run())
        code = server.wait(timeout=60)
        self.assertEqual(code, 0)
        self.assertLess(time.time() - start, 30)
        self.assertEqual(sum(1 for r in results if not isinstance(r, Exception)), 500)


if __name__ == "__main__":
    unittest.main()
