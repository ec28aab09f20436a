"""Raw against ZAEC per (backbone, method): the comparison behind the demo's one-sentence verdicts (selective
prediction in `run.selective_sentence`, OOD detection in `ood.ood_sentence`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import polars as pl


@dataclass(frozen=True)
class RawVsZaec:
    """Per-pair means of each metric, raw (`none`) and ZAEC, and in how many pairs ZAEC is better or worse.

    Attributes:
        n: (backbone, method) pairs with every metric defined on both sides.
        means: metric -> (mean raw, mean ZAEC) over those pairs.
        better, worse: metric -> pairs where ZAEC is strictly better / worse (ties count as neither).
        verdict: weighing, for every metric, both the pair counts (better or worse in most pairs) and the means
            (better or worse on average): "helps" (every one better), "hurts" (every one worse), "mixed" (some
            better, some worse: a mean that rises while most pairs improve, or metrics that disagree), else
            "neither" (no clear direction anywhere).
        methods: the methods of the pairs, sorted.
    """

    n: int
    means: dict[str, tuple[float, float]]
    better: dict[str, int]
    worse: dict[str, int]
    verdict: str
    methods: tuple[str, ...]

    def says(self, what: str) -> str:
        """The verdict as the start of a sentence about `what` ("deciding which predictions to trust")."""
        return {"helps": f"ZAEC helps {what}", "hurts": f"ZAEC hurts {what}",
                "mixed": f"ZAEC's effect on {what} is mixed (its pair counts and its means do not agree)",
                }.get(self.verdict, f"ZAEC neither clearly helps nor hurts {what}")


def raw_vs_zaec(rows: pl.DataFrame, metrics: Sequence[str], higher_is_better: Sequence[bool]) -> RawVsZaec | None:
    """Average each metric per (backbone, method, calibrator) over `rows` (NaN as missing), pair `none` with `zaec`,
    drop pairs with a missing value, count where ZAEC is better and compare the means; None when no pair is left."""
    per = (rows.with_columns(pl.col(*metrics).cast(pl.Float64).fill_nan(None))
           .group_by(["backbone", "method", "calibrator"]).agg(pl.col(*metrics).mean())
           .pivot(on="calibrator", index=["backbone", "method"], values=list(metrics)))
    need = [f"{m}_{c}" for m in metrics for c in ("none", "zaec")]
    per = per.drop_nulls(need) if set(need) <= set(per.columns) else per.clear()
    if not per.height:
        return None
    n = per.height
    better, worse, signs = {}, {}, []
    means = {m: (float(per[f"{m}_none"].mean()), float(per[f"{m}_zaec"].mean())) for m in metrics}
    for m, higher in zip(metrics, higher_is_better):
        diff = per[f"{m}_zaec"] - per[f"{m}_none"]
        up, down = int((diff > 0).sum()), int((diff < 0).sum())
        better[m], worse[m] = (up, down) if higher else (down, up)
        signs.append(1 if better[m] > n / 2 else -1 if worse[m] > n / 2 else 0)  # most pairs
        change = (means[m][1] - means[m][0]) * (1 if higher else -1)
        signs.append(1 if change > 0 else -1 if change < 0 else 0)  # the means
    verdict = ("helps" if all(s > 0 for s in signs) else "hurts" if all(s < 0 for s in signs)
               else "mixed" if 1 in signs and -1 in signs else "neither")
    return RawVsZaec(n, means, better, worse, verdict, tuple(sorted(set(per["method"].to_list()))))
