"""Tests of torch_peer.py's planning (no torch, no GPU): which methods run,
in which order, and what is skipped."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402


def planned(argv):
    args = torch_peer.parse_args(argv)
    cases, skipped = torch_peer.plan(args)
    return args, cases, skipped


class PlanTest(unittest.TestCase):

    def test_default_methods_leave_the_diagnostics_out(self):
        args, cases, skipped = planned(["--m", "512"])
        self.assertEqual(skipped, [])
        self.assertEqual(len(cases), 4)  # qkv, o, gate_up, down at m = 512
        for _, dtype, variants in cases:
            self.assertEqual(dtype, "fp8")
            self.assertEqual(variants, [("torch_seq", 1), ("torch_chunked", 2),
                                        ("torch_chunked", 4), ("torch_symm_mem", 1)])

    def test_diagnostics_run_when_named_after_the_layer_methods(self):
        _, cases, _ = planned(["--m", "512", "--methods", "comm_only", "gemm_only", "torch_seq"])
        for _, _, variants in cases:
            self.assertEqual(variants, [("torch_seq", 1), ("gemm_only", 1), ("comm_only", 1)])
        _, cases, _ = planned(["--m", "512", "--methods", "gemm_only", "--tp", "1"])
        self.assertEqual([v for _, _, v in cases], [[("gemm_only", 1)]] * 4)

    def test_unknown_methods_are_refused(self):
        with self.assertRaises(SystemExit):
            torch_peer.parse_args(["--methods", "layer_gemm"])

    def test_shapes_that_do_not_split_are_skipped_with_their_reason(self):
        _, cases, skipped = planned(["--m", "512", "--tp", "3", "--methods", "gemm_only"])
        self.assertEqual(cases, [])
        self.assertEqual(len(skipped), 4)
        self.assertIn("not divisible by tp=3", skipped[0]["reason"])
        self.assertEqual(skipped[0]["method"], "gemm_only")


if __name__ == "__main__":
    unittest.main()
