#!/usr/bin/python3
"""Regenerates the seed corpora under tests/fuzz/corpus/ (committed).

    /usr/bin/python3 tests/fuzz/make_seeds.py   (the system Python: Debian's protobuf)

Needs protoc and python3-protobuf (Debian: protobuf-compiler, python3-protobuf).
The overlap-config seeds are the deploy/ YAML files plus a few small ones.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def infer_request_seeds():
    tmp = tempfile.mkdtemp()
    try:
        subprocess.check_call(["protoc", f"--proto_path={ROOT}", f"--python_out={tmp}",
                               os.path.join(ROOT, "proto", "grpc_service.proto")])
        sys.path.insert(0, tmp)
        from proto import grpc_service_pb2 as pb  # noqa: E402

        def req(dtype="INT32", shape=(3,), ints=None, ints64=None, raw=None, outputs=(),
                name="input_ids", extra_input=False):
            q = pb.ModelInferRequest(model_name="tiny", id="seed")
            i = q.inputs.add(name=name, datatype=dtype)
            i.shape.extend(shape)
            if ints is not None:
                i.contents.int_contents.extend(ints)
            if ints64 is not None:
                i.contents.int64_contents.extend(ints64)
            if raw is not None:
                q.raw_input_contents.append(raw)
            for o in outputs:
                q.outputs.add(name=o)
            if extra_input:
                q.inputs.add(name="other", datatype="FP32")
            return q.SerializeToString()

        seeds = {
            "ok_int32": req(ints=[1, 2, 3]),
            "ok_int64_batched": req(dtype="INT64", shape=(1, 2), ints64=[5, 1023]),
            "ok_raw_int32": req(shape=(2,), raw=struct.pack("<2i", 7, 9),
                                outputs=("next_token_id",)),
            "ok_raw_int64": req(dtype="INT64", shape=(1, 1), raw=struct.pack("<q", 0),
                                outputs=("logits", "next_token_id")),
            "bad_id_range": req(ints=[1, 5000, 3]),
            "bad_negative_id": req(dtype="INT64", shape=(1,), ints64=[-1]),
            "bad_shape": req(shape=(2, 2), ints=[1, 2, 3, 4]),
            "bad_count": req(shape=(4,), ints=[1, 2]),
            "bad_dtype": req(dtype="FP32", shape=(1,)),
            "bad_raw_size": req(shape=(3,), raw=b"\x01\x00\x00\x00"),
            "bad_both": req(shape=(1,), ints=[1], raw=b"\x01\x00\x00\x00"),
            "bad_too_long": req(shape=(65,), ints=list(range(65))),
            "bad_output": req(ints=[1, 2, 3], outputs=("probs",)),
            "bad_two_inputs": req(ints=[1, 2, 3], extra_input=True),
            "bad_name": req(name="tokens", ints=[1, 2, 3]),
            "empty": b"",
        }
        for name, data in seeds.items():
            write("infer_request", name, data)
    finally:
        shutil.rmtree(tmp)


def safetensors(header, data=b"", pad_to=8, raw_header=None):
    h = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":"))
    h = h.encode()
    if pad_to:
        h += b" " * (-(8 + len(h)) % pad_to)
    return struct.pack("<Q", len(h)) + h + data


def safetensors_seeds():
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    seeds = {
        "ok_f32": safetensors({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}},
                              f32),
        "ok_two_meta": safetensors({
            "__metadata__": {"format": "pt"},
            "a": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]},
        }, bytes(range(8))),
        "ok_scalar_empty": safetensors({
            "s": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]},
            "z": {"dtype": "BOOL", "shape": [0, 3], "data_offsets": [8, 8]},
        }, struct.pack("<q", 42)),
        "ok_gap_trailing": safetensors({
            "x": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
        }, bytes(10)),
        "ok_empty_header": safetensors({}, b""),
        "bad_offsets_past_end": safetensors(
            {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
        "bad_size_mismatch": safetensors(
            {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, f32),
        "bad_overlap": safetensors({
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }, f32),
        "bad_dtype": safetensors(
            {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, f32),
        "bad_huge_shape": safetensors({"w": {"dtype": "F64",
                                             "shape": [4294967296, 4294967296, 16],
                                             "data_offsets": [0, 16]}}, f32),
        "bad_json": safetensors(None, f32, raw_header='{"w": {"dtype": "F32",'),
        "bad_dup_key": safetensors(None, f32, raw_header=(
            '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
            '"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}')),
        "bad_header_len": struct.pack("<Q", 1 << 40) + b"{}",
        "bad_short": b"\x02\x00\x00",
    }
    for name, data in seeds.items():
        write("safetensors", name, data)


def overlap_config_seeds():
    for f in sorted(os.listdir(os.path.join(ROOT, "deploy"))):
        if f.endswith(".yaml"):
            shutil.copy(os.path.join(ROOT, "deploy", f),
                        os.path.join(CORPUS, "overlap_config", f))
    seeds = {
        "ok_example.yaml": """version: 1
tp: 2
defaults:
  mode: pipeline
  chunks: 2
layers:
  - match: "layers.*.mlp.down"
    comm: {max_ctas: 8}
    m_ranges:
      - {m_min: 1, m_max: 1024, mode: none}
      - {m_min: 1025, m_max: 8192, mode: ring, chunks: 4}
      - {m_min: 8193, mode: ring, chunks: 8, fast_accum: true}
  - match: "layers.?.self_attn.o_proj"
    mode: auto
  - match: "layers.*.mlp.gate_up"
    mode: pipeline
    chunks: 2
    copy_engine: true
    comm: {cta_policy: zero}
tuned:
  - {op: gemm_rs, n: 8192, k: 8192, m: 2048, mode: pipeline, chunks: 4, median_ms: 0.2, none_ms: 0.21}
  - {op: gemm_rs, n: 8192, k: 8192, m: 8192, mode: ring, chunks: 2, median_ms: 0.6, none_ms: 0.7}
""",
        "ok_minimal.yaml": "version: 1\n",
        "ok_defaults.yaml": ("version: 1\ndefaults:\n  mode: ring\n  chunks: 3\n"
                             "  comm: {min_ctas: 1, max_ctas: 4, cga_cluster_size: 2}\n"
                             "  fast_accum: true\n"),
        "bad_overlap_ranges.yaml": ("version: 1\nlayers:\n  - match: \"*\"\n    m_ranges:\n"
                                    "      - {m_min: 1, m_max: 100, mode: none}\n"
                                    "      - {m_min: 50, mode: ring}\n"),
        "bad_unknown_key.yaml": "version: 1\ndefaults:\n  mdoe: ring\n",
        "bad_version.yaml": "version: 2\n",
        "bad_type.yaml": "version: 1\ndefaults:\n  chunks: many\n",
        "bad_syntax.yaml": "version: 1\nlayers: [\n",
        "two_documents.yaml": "version: 1\n---\nversion: 1\n",
    }
    for name, data in seeds.items():
        write("overlap_config", name, data)


def main():
    # Inputs the fuzzer found (named regression-*) were added by hand: kept.
    kept = {}
    if os.path.isdir(CORPUS):
        for target in os.listdir(CORPUS):
            for name in os.listdir(os.path.join(CORPUS, target)):
                if name.startswith("regression-"):
                    with open(os.path.join(CORPUS, target, name), "rb") as f:
                        kept[(target, name)] = f.read()
        shutil.rmtree(CORPUS)
    os.makedirs(os.path.join(CORPUS, "overlap_config"))
    infer_request_seeds()
    safetensors_seeds()
    overlap_config_seeds()
    for (target, name), data in kept.items():
        write(target, name, data)
    for t in sorted(os.listdir(CORPUS)):
        print(f"{t}: {len(os.listdir(os.path.join(CORPUS, t)))} seeds")


if __name__ == "__main__":
    main()
