"""Tests of hf_greedy_check.py's comparison (standard library only: no torch, no GPU)."""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hf_greedy_check as hgc  # noqa: E402


def step(values, ids):
    return {"top_values": values, "top_ids": ids}


# A reference of three steps: a clear winner, a near tie (gap 0.5 % of 10), a clear winner.
REF = ([5, 6, 7], [step([10.0, 8.0], [5, 1]), step([10.0, 9.95], [6, 2]),
                   step([10.0, 7.0], [7, 3])])


class CompareTest(unittest.TestCase):
    def test_identical_tokens(self):
        rec = hgc.compare([5, 6, 7], *REF, near_tie=0.01)
        self.assertEqual(rec["verdict"], "identical")
        self.assertEqual(rec["matched"], 3)

    def test_a_divergence_at_a_near_tie_is_explained(self):
        rec = hgc.compare([5, 2, 9], *REF, near_tie=0.01)
        self.assertEqual(rec["verdict"], "near_tie")
        d = rec["first_divergence"]
        self.assertEqual((d["index"], d["ours"], d["reference"]), (1, 2, 6))
        self.assertAlmostEqual(d["ref_top2_rel_gap"], 0.005)
        self.assertEqual(d["ours_rank_in_reference"], 2)

    def test_a_divergence_at_a_clear_winner_fails(self):
        rec = hgc.compare([1, 6, 7], *REF, near_tie=0.01)
        self.assertEqual(rec["verdict"], "diverged")
        self.assertFalse(rec["first_divergence"]["near_tie"])
        # The same gap under a looser rule is a near tie.
        self.assertEqual(hgc.compare([1, 6, 7], *REF, near_tie=0.25)["verdict"], "near_tie")

    def test_stopping_early_is_a_divergence(self):
        rec = hgc.compare([5, 6], *REF, near_tie=0.01)
        self.assertEqual(rec["verdict"], "diverged")
        self.assertEqual(rec["first_divergence"]["index"], 2)


class JudgeTest(unittest.TestCase):
    def test_records_carry_lengths_and_the_summary_counts_verdicts(self):
        records, summary = hgc.judge([[5, 6, 7], [5, 2, 9], [1, 6, 7]], [REF, REF, REF],
                                     [1, 64, 1500], 0.01)
        self.assertEqual([r["length"] for r in records], [1, 64, 1500])
        self.assertEqual((summary["identical"], summary["near_tie_divergences"],
                          summary["unexplained_divergences"]), (1, 1, 1))
        self.assertEqual((summary["tokens_matched"], summary["tokens"]), (3 + 1 + 0, 9))
        self.assertFalse(summary["pass"])
        line = hgc.summary_line(summary, records, "calibration, transformers bf16")
        self.assertTrue(line.startswith("calibration, transformers bf16: FAIL: 3 prompts"), line)
        self.assertIn("(len 1500 at token 0)", line)

    def test_all_explained_passes(self):
        records, summary = hgc.judge([[5, 6, 7], [5, 2, 9]], [REF, REF], [1, 2], 0.01)
        self.assertTrue(summary["pass"])
        self.assertTrue(hgc.summary_line(summary, records).startswith("hf_greedy_check: PASS"))


if __name__ == "__main__":
    unittest.main()
