"""Tests of torch_model_compiled.py's command line (no torch, no GPU): what a run is asked to
do and what it refuses before touching the GPU."""
import os
import sys
import unittest
from contextlib import redirect_stderr
from io import StringIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_model_compiled as tmc  # noqa: E402


class ArgsTest(unittest.TestCase):

    def refused(self, argv):
        with redirect_stderr(StringIO()) as err, self.assertRaises(SystemExit) as ex:
            tmc.parse_args(argv)
        self.assertEqual(ex.exception.code, 2)
        return err.getvalue()

    def test_defaults_are_the_issue_shapes_with_both_accumulations(self):
        args = tmc.parse_args([])
        self.assertEqual(args.shapes, [(8, 1024), (1, 8192), (64, 128)])
        self.assertEqual(args.fast_accum, "both")
        self.assertEqual(args.sdpa, "auto")
        self.assertEqual(args.compile_mode, "max-autotune-no-cudagraphs")

    def test_batches_parse_as_sequences_by_length(self):
        args = tmc.parse_args(["--batches", "2x4096", "16x512"])
        self.assertEqual(args.shapes, [(2, 4096), (16, 512)])

    def test_malformed_or_empty_batches_are_refused_naming_the_value(self):
        self.assertIn("'8by1024'", self.refused(["--batches", "8by1024"]))
        self.assertIn("'0x128'", self.refused(["--batches", "0x128"]))

    def test_bad_counts_are_refused(self):
        self.assertIn("--layers", self.refused(["--layers", "-1"]))
        self.assertIn("--rounds", self.refused(["--rounds", "0"]))
        self.refused(["--sdpa", "math"])  # not one of the timed backends

    def test_skip_model_needs_attention_only(self):
        self.assertIn("--skip-model", self.refused(["--skip-model"]))
        args = tmc.parse_args(["--attention-only", "--skip-model"])
        self.assertTrue(args.skip_model)

    def test_tp_runs_need_divisible_heads_and_rows(self):
        args = tmc.parse_args(["--tp", "2", "--model", "llama3-70b", "--batches", "8x1024"])
        self.assertEqual((args.tp, args.async_tp), (2, "on"))
        self.assertIn("--tp 3", self.refused(["--tp", "3", "--model", "llama3-70b"]))
        self.assertIn("multiple", self.refused(["--tp", "2", "--batches", "1x7"]))
        self.assertIn("--tp", self.refused(["--tp", "0"]))
        self.assertIn("--attention-only", self.refused(["--tp", "2", "--attention-only"]))

    def test_presets_match_the_engine_shapes(self):
        # hidden, intermediate, heads, kv heads, layers, vocab: engine/model_config.cc's presets.
        self.assertEqual(tmc.PRESETS["llama3-8b"][:6], (4096, 14336, 32, 8, 32, 128256))
        self.assertEqual(tmc.PRESETS["llama3-70b"][:6], (8192, 28672, 64, 8, 80, 128256))


if __name__ == "__main__":
    unittest.main()
