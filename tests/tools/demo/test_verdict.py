"""`tools.demo.verdict`: raw against ZAEC weighs the pair counts and the means (issue 35 item 10: the demo said
ZAEC "helps" selective prediction while the mean AURC rose, 36.6% to 36.8%, because it counted pairs only)."""

from __future__ import annotations

import polars as pl
import pytest

from tools.demo.verdict import raw_vs_zaec


def _rows(pairs):
    """(backbone, method, aurc raw, aurc zaec, auroc raw, auroc zaec) -> metrics rows of both calibrators."""
    out = []
    for b, m, a0, a1, u0, u1 in pairs:
        out += [{"backbone": b, "method": m, "calibrator": "none", "aurc": a0, "auroc": u0},
                {"backbone": b, "method": m, "calibrator": "zaec", "aurc": a1, "auroc": u1}]
    return pl.DataFrame(out)


def _verdict(pairs):
    return raw_vs_zaec(_rows(pairs), ("aurc", "auroc"), higher_is_better=(False, True))


@pytest.mark.parametrize("pairs, verdict", [
    # the issue's case: AURC lower in 3 of 4 pairs, yet its mean rises (36.6% -> 36.8%); AUROC better throughout
    ([("V", "tda", 0.366, 0.360, 0.7, 0.72), ("V", "dpe", 0.366, 0.361, 0.7, 0.72),
      ("R", "tda", 0.366, 0.362, 0.7, 0.72), ("R", "dpe", 0.366, 0.389, 0.7, 0.72)], "mixed"),
    ([("V", "tda", 0.30, 0.25, 0.70, 0.75), ("R", "tda", 0.30, 0.28, 0.70, 0.71)], "helps"),
    ([("V", "tda", 0.25, 0.30, 0.75, 0.70), ("R", "tda", 0.28, 0.30, 0.71, 0.70)], "hurts"),
    # most pairs worse, but one large gain makes the mean better: mixed, not "hurts"
    ([("V", "tda", 0.30, 0.31, 0.70, 0.69), ("V", "dpe", 0.30, 0.31, 0.70, 0.69),
      ("R", "tda", 0.30, 0.10, 0.70, 0.95)], "mixed"),
    ([("V", "tda", 0.30, 0.30, 0.70, 0.70)], "neither"),
    # AURC better, AUROC unchanged: no metric against, but not every signal for: neither
    ([("V", "tda", 0.30, 0.25, 0.70, 0.70)], "neither"),
])
def test_the_verdict_weighs_pairs_and_means(pairs, verdict):
    c = _verdict(pairs)
    assert c.verdict == verdict, (c.means, c.better, c.worse)


def test_the_issue_case_reads_mixed_with_the_means_it_weighed():
    c = _verdict([("V", "tda", 0.366, 0.360, 0.7, 0.72), ("V", "dpe", 0.366, 0.361, 0.7, 0.72),
                  ("R", "tda", 0.366, 0.362, 0.7, 0.72), ("R", "dpe", 0.366, 0.389, 0.7, 0.72)])
    assert c.better["aurc"] == 3 and c.means["aurc"][1] > c.means["aurc"][0]
    assert c.says("deciding which predictions to trust").startswith(
        "ZAEC's effect on deciding which predictions to trust is mixed")
