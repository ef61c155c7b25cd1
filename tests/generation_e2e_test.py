"""Generation over gRPC, end to end: `tpserve serve` on the CPU backend (the
tiny model, TP=2) driven by an independent client (Debian's python3-grpcio,
messages from protoc --python_out), in the tensor names of Triton's
TensorRT-LLM backend.

CTest runs it with /usr/bin/python3 and TPSERVE_BIN, PROTO_DIR set.
"""
import os
import queue
import signal
import socket
import struct
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc

from grpc_interop_test import compile_messages

BIN = os.environ["TPSERVE_BIN"]
VOCAB = 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, tp=2):
    """`tpserve serve` on loopback with a metrics port; returns (process, grpc port, metrics port)."""
    metrics = free_port()
    import subprocess
    server = subprocess.Popen(
        [BIN, "serve", "--model", "tiny", "--tp", str(tp), "--backend", "cpu", *args,
         "--grpc-port", "0", "--host", "127.0.0.1", "--metrics-port", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = server.stdout.readline()
    if "gRPC port" not in line:
        server.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return server, int(line.rsplit(" ", 1)[1]), metrics


def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class Client:
    def __init__(self, pb, port):
        self.pb = pb
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.infer = self.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ModelInferResponse.FromString)
        self.stream = self.channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=pb.ModelStreamInferResponse.FromString)

    def request(self, prompt, out_len, rid="", **extra):
        """A generation request with raw contents; extra: name=(datatype, value or list)."""
        pb = self.pb
        req = pb.ModelInferRequest(model_name="tiny", id=rid)
        tensors = {"input_ids": ("INT32", [1, len(prompt)], prompt),
                   "input_lengths": ("INT32", [1, 1], [len(prompt)]),
                   "request_output_len": ("INT32", [1, 1], [out_len])}
        for name, (dtype, value) in extra.items():
            values = value if isinstance(value, list) else [value]
            shape = [1, 2, len(values) // 2] if name == "stop_words_list" else [1, 1]
            tensors[name] = (dtype, shape, values)
        fmt = {"INT32": "i", "FP32": "f", "UINT64": "Q", "BOOL": "?"}
        for name, (dtype, shape, values) in tensors.items():
            req.inputs.add(name=name, datatype=dtype, shape=shape)
            req.raw_input_contents.append(struct.pack(f"<{len(values)}{fmt[dtype]}", *values))
        return req

    def generate(self, prompt, out_len, **extra):
        resp = self.infer(self.request(prompt, out_len, **extra), timeout=120)
        out = outputs(resp)
        return out["output_ids"], out


def outputs(resp):
    out = {}
    for o, raw in zip(resp.outputs, resp.raw_output_contents):
        fmt = "f" if o.datatype == "FP32" else "i"
        out[o.name] = list(struct.unpack(f"<{len(raw) // 4}{fmt}", raw))
    return out


def stream_generate(client, requests, timeout=120):
    """Sends `requests` on one stream; returns {id: (tokens, responses, error)} once every
    request has its final response or error."""
    results = {r.id: ([], 0, None) for r in requests}
    pending = set(results)
    outbox = queue.Queue()
    for r in requests:
        outbox.put(r)

    def gen():
        while True:
            item = outbox.get()
            if item is None:
                return
            yield item

    responses = client.stream(gen(), timeout=timeout)
    try:
        for resp in responses:
            rid = resp.infer_response.id
            tokens, n, err = results[rid]
            if resp.error_message:
                results[rid] = (tokens, n + 1, resp.error_message)
                pending.discard(rid)
            else:
                tokens = tokens + outputs(resp.infer_response).get("output_ids", [])
                results[rid] = (tokens, n + 1, None)
                final = resp.infer_response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    pending.discard(rid)
            if not pending:
                break
    finally:
        outbox.put(None)
    return results


class Generation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.pb = compile_messages(cls.tmp.name)
        cls.server, cls.port, cls.metrics = start_server([])
        cls.client = Client(cls.pb, cls.port)

    @classmethod
    def tearDownClass(cls):
        cls.client.channel.close()
        if cls.server.poll() is None:
            cls.server.kill()
        cls.tmp.cleanup()

    def logits_argmax(self, ids):
        req = self.pb.ModelInferRequest(model_name="tiny")
        t = req.inputs.add(name="input_ids", datatype="INT32", shape=[len(ids)])
        t.contents.int_contents.extend(ids)
        logits = outputs(self.client.infer(req, timeout=60))["logits"]
        best = max(range(VOCAB), key=lambda i: (logits[i], -i))
        top2 = sorted(logits, reverse=True)[:2]
        return best, (top2[0] - top2[1]) / max(abs(top2[0]), 1e-6)

    def test_metadata_lists_the_generation_tensors(self):
        meta = self.client.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelMetadata",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=self.pb.ModelMetadataResponse.FromString)(
                self.pb.ModelMetadataRequest(name="tiny"), timeout=10)
        names = [i.name for i in meta.inputs]
        for n in ["input_ids", "input_lengths", "request_output_len", "end_id", "streaming",
                  "temperature", "runtime_top_k", "runtime_top_p", "seed", "stop_words_list",
                  "return_log_probs"]:
            self.assertIn(n, names)
        self.assertIn("output_ids", [o.name for o in meta.outputs])

    def test_greedy_matches_recomputing_with_logits_requests(self):
        prompt = [5, 77, 300, 12, 901]
        ids, out = self.client.generate(prompt, 8)
        self.assertEqual(ids[:len(prompt)], prompt)  # output_ids starts with the prompt
        self.assertEqual(out["sequence_length"], [len(prompt) + 8])
        seq = list(prompt)
        for i, token in enumerate(ids[len(prompt):]):
            want, gap = self.logits_argmax(seq)
            if want != token:
                self.assertLess(gap, 0.01, f"token {i} differs from recomputation without a tie")
                break
            seq.append(token)

    def test_streaming_sends_each_step_and_marks_the_last(self):
        prompt = [9, 8, 7]
        full, _ = self.client.generate(prompt, 6, exclude_input_in_output=("BOOL", True))
        self.assertEqual(len(full), 6)
        req = self.client.request(prompt, 6, rid="s1", streaming=("BOOL", True))
        results = stream_generate(self.client, [req])
        tokens, responses, err = results["s1"]
        self.assertIsNone(err)
        self.assertEqual(tokens, full)
        self.assertGreaterEqual(responses, 2)  # several responses, not one at the end

    def test_a_prompt_alone_and_among_64_streams_gives_the_same_tokens(self):
        target = [100, 200, 300, 400]
        alone, _ = self.client.generate(target, 5, exclude_input_in_output=("BOOL", True))
        streams = []
        results = {}

        def run(i):
            prompt = target if i == 17 else [(i * 31 + j) % VOCAB for j in range(1 + i % 7)]
            req = self.client.request(prompt, 5, rid=f"c{i}", streaming=("BOOL", True))
            results[i] = stream_generate(self.client, [req])[f"c{i}"]

        for i in range(64):
            t = threading.Thread(target=run, args=(i,))
            t.start()
            streams.append(t)
        for t in streams:
            t.join(timeout=180)
        self.assertEqual(len(results), 64)
        for i, (tokens, _, err) in results.items():
            self.assertIsNone(err, f"stream {i}")
            self.assertEqual(len(tokens), 5, f"stream {i}")
        self.assertEqual(results[17][0], alone)

    def test_many_requests_multiplexed_on_one_stream(self):
        reqs = [self.client.request([i + 1, i + 2], 4, rid=f"m{i}", streaming=("BOOL", i % 2 == 0))
                for i in range(6)]
        results = stream_generate(self.client, reqs)
        for i in range(6):
            tokens, _, err = results[f"m{i}"]
            self.assertIsNone(err)
            # Non-streamed requests on a stream get one response with the prompt included.
            self.assertEqual(len(tokens), 4 if i % 2 == 0 else 6)

    def test_seeded_sampling_repeats(self):
        kw = dict(temperature=("FP32", 1.2), runtime_top_k=("INT32", 40),
                  runtime_top_p=("FP32", 0.9), seed=("UINT64", 1234),
                  exclude_input_in_output=("BOOL", True))
        a, _ = self.client.generate([3, 4, 5], 10, **kw)
        b, _ = self.client.generate([3, 4, 5], 10, **kw)
        self.assertEqual(a, b)
        kw["seed"] = ("UINT64", 99)
        c, _ = self.client.generate([3, 4, 5], 10, **kw)
        self.assertNotEqual(a, c)

    def test_log_probs_on_request(self):
        _, out = self.client.generate([1, 2], 5, return_log_probs=("BOOL", True))
        self.assertEqual(len(out["output_log_probs"]), 5)
        self.assertTrue(all(lp <= 0 for lp in out["output_log_probs"]))

    def test_end_id_and_stop_words(self):
        free, _ = self.client.generate([42], 8, exclude_input_in_output=("BOOL", True))
        ended, out = self.client.generate([42], 8, end_id=("INT32", free[2]),
                                          exclude_input_in_output=("BOOL", True))
        self.assertEqual(ended, free[:free.index(free[2])])
        stopped, _ = self.client.generate([42], 8, stop_words_list=("INT32", [free[3], 1]),
                                          exclude_input_in_output=("BOOL", True))
        self.assertEqual(stopped, free[:free.index(free[3]) + 1])

    def test_bad_inputs_name_the_tensor(self):
        cases = [
            (dict(out_len=-3), "request_output_len"),
            (dict(out_len=10 ** 6), "request_output_len"),
            (dict(runtime_top_p=("FP32", 1.5)), "runtime_top_p"),
            (dict(runtime_top_p=("FP32", 0.0)), "runtime_top_p"),
            (dict(temperature=("INT32", 1)), "temperature"),
            (dict(seed=("INT32", 1)), "seed"),
        ]
        for extra, name in cases:
            out_len = extra.pop("out_len", 4)
            with self.subTest(name=name, extra=extra):
                with self.assertRaises(grpc.RpcError) as e:
                    self.client.generate([1, 2, 3], out_len, **extra)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(name, e.exception.details())
        req = self.client.request([1, 2, 3], 4)
        req.raw_input_contents[1] = struct.pack("<i", 5)  # input_lengths 5 for 3 ids
        with self.assertRaises(grpc.RpcError) as e:
            self.client.infer(req, timeout=30)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("input_lengths", e.exception.details())
        # Streaming needs ModelStreamInfer.
        with self.assertRaises(grpc.RpcError) as e:
            self.client.generate([1], 2, streaming=("BOOL", True))
        self.assertIn("ModelStreamInfer", e.exception.details())

    def test_a_junk_message_in_a_stream_is_answered_and_the_stream_goes_on(self):
        good = self.client.request([7, 7], 3, rid="after-junk", streaming=("BOOL", True))
        outbox = [b"\xff\xff\xff\xff garbage", good]
        errors, finals = [], []
        for resp in self.client.stream(iter(outbox), timeout=60):
            if resp.error_message:
                errors.append(resp.error_message)
            elif resp.infer_response.parameters["triton_final_response"].bool_param:
                finals.append(resp.infer_response.id)
        self.assertEqual(len(errors), 1)
        self.assertIn("INVALID_ARGUMENT", errors[0])
        self.assertIn("ModelInferRequest", errors[0])
        self.assertEqual(finals, ["after-junk"])
        self.assertGreater(metric(self.metrics, "tpserve_rejected_requests_total"), -1)

    def test_cancelling_a_stream_frees_its_blocks(self):
        req = self.client.request(list(range(1, 40)), 1500, rid="long",
                                  streaming=("BOOL", True))
        call = self.client.stream(iter([req]), timeout=120)
        next(call)  # generation is under way
        self.assertGreater(metric(self.metrics, "tpserve_kv_cache_blocks_used"), 0)
        call.cancel()
        deadline = time.time() + 30
        while time.time() < deadline and metric(self.metrics, "tpserve_kv_cache_blocks_used") > 0:
            time.sleep(0.05)
        self.assertEqual(metric(self.metrics, "tpserve_kv_cache_blocks_used"), 0)
        self.assertGreaterEqual(metric(self.metrics, "tpserve_generation_cancelled_total"), 1)


class SmallCache(unittest.TestCase):
    """A pool of 24 blocks of 4 tokens: eight requests of up to 40 tokens cannot all hold
    their blocks at once; the scheduler preempts, recomputes, and every request still gets
    the tokens it gets alone."""

    def test_preemption_loses_nothing(self):
        tmp = tempfile.TemporaryDirectory()
        pb = compile_messages(tmp.name)
        roomy, roomy_port, _ = start_server([])
        small, small_port, small_metrics = start_server(
            ["--kv-cache-blocks", "24", "--kv-block-size", "4", "--max-step-tokens", "16"])
        try:
            prompts = [[(i * 13 + j) % VOCAB for j in range(8 + i)] for i in range(8)]
            want = [Client(pb, roomy_port).generate(p, 24)[0] for p in prompts]
            client = Client(pb, small_port)
            reqs = [client.request(p, 24, rid=f"p{i}") for i, p in enumerate(prompts)]
            results = stream_generate(client, reqs, timeout=300)
            for i in range(8):
                tokens, _, err = results[f"p{i}"]
                self.assertIsNone(err)
                self.assertEqual(tokens, want[i], f"request {i}")
            self.assertGreater(metric(small_metrics, "tpserve_generation_preemptions_total"), 0)
            self.assertEqual(metric(small_metrics, "tpserve_kv_cache_blocks_used"), 0)
        finally:
            for s in (roomy, small):
                s.kill()
            tmp.cleanup()


class Drain(unittest.TestCase):
    def test_sigterm_finishes_generations_in_flight(self):
        tmp = tempfile.TemporaryDirectory()
        pb = compile_messages(tmp.name)
        server, port, _ = start_server(["--exit-timeout", "60"])
        try:
            client = Client(pb, port)
            got = {}

            def run():
                got["ids"] = client.generate([1, 2, 3], 40)[0]

            t = threading.Thread(target=run)
            t.start()
            time.sleep(0.5)
            server.send_signal(signal.SIGTERM)
            t.join(timeout=120)
            self.assertEqual(len(got.get("ids", [])), 43)
            self.assertEqual(server.wait(timeout=60), 0)
        finally:
            if server.poll() is None:
                server.kill()
            tmp.cleanup()


if __name__ == "__main__":
    unittest.main()
