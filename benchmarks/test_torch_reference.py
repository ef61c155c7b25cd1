"""torch_reference.py's checkpoint layout and writer against tpserve's loader,
without torch: the tiny preset's tensors, in the script's layout and written by
its writer, filled with seeded random values here, must load in
`tpserve run --backend cpu` and give a forward pass. CTest sets TPSERVE_BIN."""

import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_reference as ref  # noqa: E402  (imports no torch at module level)

BIN = os.environ.get("TPSERVE_BIN", "")


def bf16_bytes(values):
    # Truncation to BF16 is enough for test data.
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def f32_bytes(values):
    return struct.pack("<%df" % len(values), *values)


def fp8_codes(count, rng):
    # Any E4M3 code but the NaNs (0x7f, 0xff).
    return bytes(rng.choice([c for c in range(256) if c & 0x7F != 0x7F]) for _ in range(count))


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def tiny_entries(rng):
    dims, items = ref.layout("tiny")
    entries = []

    def add(name, dtype, shape, raw):
        entries.append((name, dtype, shape, len(raw), lambda raw=raw: raw))

    for item in items:
        if item[0] == "bf16":
            _, name, shape = item
            add(name, "BF16", shape, bf16_bytes(rng.gauss(0, 0.5) for _ in range(numel(shape))))
        elif item[0] == "norm":
            _, name, shape = item
            add(name, "F32", shape, f32_bytes([1.0 + 0.125 * rng.randint(-2, 2)
                                               for _ in range(numel(shape))]))
        else:
            for base, shape in item[1]:
                add(base + ".weight", "F8_E4M3", shape, fp8_codes(numel(shape), rng))
                add(base + ".weight_scale", "F32", [], f32_bytes([0.002]))
                add(base + ".input_scale", "F32", [], f32_bytes([ref.INPUT_SCALE]))
    return dims, entries


@unittest.skipUnless(BIN, "needs TPSERVE_BIN")
class CheckpointTest(unittest.TestCase):
    def test_the_scripts_checkpoint_loads_in_tpserve(self):
        rng = random.Random(5)
        dims, entries = tiny_entries(rng)
        with tempfile.TemporaryDirectory() as d:
            ref.write_checkpoint(d, ref.hf_config(dims), entries)
            with open(os.path.join(d, "model.safetensors"), "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                self.assertEqual(size % 8, 0)
                header = json.loads(f.read(size))
            self.assertEqual(len(header), len(entries))
            r = subprocess.run([BIN, "run", "--model", d, "--tp", "2", "--backend", "cpu",
                                "--ids", "1,2,3,4", "--json"], capture_output=True, text=True,
                               timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr[-2000:])
            out = json.loads(r.stdout)
            self.assertEqual(len(out["logits"]), dims["vocab"])
            self.assertTrue(0 <= out["next_token_id"] < dims["vocab"])

    def test_a_short_tensor_is_refused_before_writing_wrong_data(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(ValueError) as e:
                ref.write_checkpoint(d, {}, [("x", "F32", [2], 8, lambda: b"1234")])
            self.assertIn("x: 4 bytes, the header says 8", str(e.exception))


class MarkovLanguageTest(unittest.TestCase):
    """--head markov's language: what the head is trained on and the prompts are drawn from."""

    def test_the_language_is_distinct_ids_with_a_permutation_of_them_as_successors(self):
        ids, successor = ref.markov_language(5000, 300, seed=7)
        self.assertEqual(len(ids), 300)
        self.assertEqual(len(set(ids)), 300)
        self.assertTrue(all(0 <= t < 5000 for t in ids))
        self.assertEqual(sorted(successor), sorted(ids))
        self.assertEqual(sorted(successor.values()), sorted(ids))
        self.assertEqual(ref.markov_language(5000, 300, seed=7), (ids, successor))
        self.assertNotEqual(ref.markov_language(5000, 300, seed=8)[0], ids)

    def follow_fraction(self, follow_p, length=20000):
        language = ref.markov_language(100000, 64, seed=3)
        seq = ref.markov_sequence(language, length, random.Random(11), follow_p)
        self.assertEqual(len(seq), length)
        self.assertTrue(set(seq) <= set(language[0]))
        return sum(language[1][a] == b for a, b in zip(seq, seq[1:])) / (length - 1)

    def test_a_token_is_followed_by_its_successor_with_the_stated_probability(self):
        self.assertEqual(self.follow_fraction(1.0), 1.0)
        # A uniformly drawn token is the successor one time in 64 as well.
        self.assertAlmostEqual(self.follow_fraction(0.9), 0.9 + 0.1 / 64, delta=0.01)
        self.assertAlmostEqual(self.follow_fraction(0.0), 1 / 64, delta=0.005)

    def test_bad_language_settings_are_refused(self):
        for flags in (["--language-size", "1"], ["--language-size", "128257"],
                      ["--follow-p", "1.5"], ["--train-seqs", "2"], ["--train-steps", "0"]):
            with self.subTest(flags=flags), self.assertRaises(SystemExit):
                ref.parse_args(["--out", "x.json", "--head", "markov"] + flags)
        args = ref.parse_args(["--out", "x.json", "--head", "markov", "--language-size", "128256"])
        self.assertEqual(args.language_size, 128256)


if __name__ == "__main__":
    unittest.main()
