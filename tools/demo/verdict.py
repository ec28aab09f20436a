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
        verdict: "helps" (better in most pairs on every metric), "hurts" (worse in most on every metric), else
            "neither clearly helps nor hurts".
        methods: the methods of the pairs, sorted.
    """

    n: int
    means: dict[str, tuple[float, float]]
    better: dict[str, int]
    worse: dict[str, int]
    verdict: str
    methods: tuple[str, ...]


def raw_vs_zaec(rows: pl.DataFrame, metrics: Sequence[str], higher_is_better: Sequence[bool]) -> RawVsZaec | None:
    """Average each metric per (backbone, method, calibrator) over `rows` (NaN as missing), pair `none` with `zaec`,
    drop pairs with a missing value, and count where ZAEC is better; None when no pair is left."""
    per = (rows.with_columns(pl.col(*metrics).cast(pl.Float64).fill_nan(None))
           .group_by(["backbone", "method", "calibrator"]).agg(pl.col(*metrics).mean())
           .pivot(on="calibrator", index=["backbone", "method"], values=list(metrics)))
    need = [f"{m}_{c}" for m in metrics for c in ("none", "zaec")]
    per = per.drop_nulls(need) if set(need) <= set(per.columns) else per.clear()
    if not per.height:
        return None
    n = per.height
    better, worse = {}, {}
    for m, higher in zip(metrics, higher_is_better):
        diff = per[f"{m}_zaec"] - per[f"{m}_none"]
        up, down = int((diff > 0).sum()), int((diff < 0).sum())
        better[m], worse[m] = (up, down) if higher else (down, up)
    if all(better[m] > n / 2 for m in metrics):
        verdict = "helps"
    elif all(worse[m] > n / 2 for m in metrics):
        verdict = "hurts"
    else:
        verdict = "neither clearly helps nor hurts"
    means = {m: (float(per[f"{m}_none"].mean()), float(per[f"{m}_zaec"].mean())) for m in metrics}
    return RawVsZaec(n, means, better, worse, verdict, tuple(sorted(set(per["method"].to_list()))))
