"""What `zaec-calibrate` prints: the metrics table cut into the views a reader scans (pure polars frames; the CLI
renders them with rich).

Three views of `calibrate.run.RunReport.metrics` (fractions there, percent here where the paper prints percent):

- `calibration`: accuracy, ECE, MCE, equal-mass ECE, NLL, Brier, mean confidence and entropy (every row);
- `selective`: AURC, E-AURC, misclassification AUROC and FPR95 of one confidence score (`--score`: MSP, the default,
  or negative entropy), classwise and top-label ECE (every row; an OOD run's in-distribution rows);
- `ood`: in- vs out-of-distribution AUROC, FPR95 and AUPR of the same score (OOD runs only; absent without one).

Each view keeps the run's key columns and one text column `n` (`count_text`), so an OOD run's count never reads
like a partial run's.
"""

from __future__ import annotations

from typing import Any, Mapping

import polars as pl

from calibrate.classwise import CLASSWISE_NAMES
from calibrate.ood import OOD_METRICS
from calibrate.selective import SCORES, SELECTIVE_METRICS

#: the key columns of every view: the run as the notes spell it (`backbone/dataset/method/seed=s`), the calibrator
#: and the count; one `run` column keeps the wide views within a terminal
KEY_HEADERS = ("run", "calibrator", "n")
_NAMES = {"aurc": "AURC", "eaurc": "E-AURC", "auroc": "AUROC", "fpr95": "FPR95", "aupr": "AUPR"}

#: the confidence scores a view can show (`--score`): the max softmax probability or the negative entropy
CONSOLE_SCORES: tuple[str, ...] = SCORES


def view_columns(score: str = "msp") -> dict[str, dict[str, tuple[str, float, int]]]:
    """view -> {header: (metrics column, scale, decimals)} (percent columns scale 100); the selective and OOD views
    show the columns of one confidence `score` (`msp` or `negent`; every column is in metrics.csv).

    Raises:
        ValueError: an unknown score, naming the valid ones.
    """
    if score not in CONSOLE_SCORES:
        raise ValueError(f"--score must be one of {', '.join(CONSOLE_SCORES)}; got {score!r}")
    return {
        "calibration": {
            "acc %": ("accuracy", 100.0, 2), "ECE %": ("ece", 100.0, 2), "MCE %": ("mce", 100.0, 2),
            "ECE-mass %": ("ece_mass", 100.0, 2), "NLL": ("nll", 1.0, 3), "Brier": ("brier", 1.0, 3),
            "conf %": ("mean_confidence", 100.0, 2), "H (nats)": ("mean_entropy", 1.0, 3),
        },
        "selective": {
            **{_NAMES[m]: (f"{m}_{score}", 100.0, 2) for m in SELECTIVE_METRICS},
            "cw-ECE": (CLASSWISE_NAMES[0], 100.0, 2), "tl-ECE": (CLASSWISE_NAMES[1], 100.0, 2),
        },
        "ood": {f"OOD {_NAMES[m]}": (f"ood_{m}_{score}", 100.0, 2) for m in OOD_METRICS},
    }


def view_title(view: str, score: str = "msp") -> str:
    """The title printed over a view."""
    name = {"msp": "max softmax probability (MSP)", "negent": "negative entropy (−H)"}[score]
    return {
        "calibration": "zaec-calibrate: accuracy and calibration",
        "selective": f"selective prediction, score {name}, and classwise calibration, in percent: AURC, E-AURC lower "
                     "is better, misclassification AUROC higher, FPR95 lower; cw-/tl-ECE: classwise / top-label ECE, "
                     "15 bins",
        "ood": f"out-of-distribution detection (OOD runs), score {name}, in percent, in-distribution positive: AUROC "
               "and AUPR higher is better, FPR95 lower",
    }[view]


def count_text(row: Mapping[str, Any]) -> str:
    """The `n` cell of a metrics row.

    A plain run: `400`; an OOD run: `400 ID + 120 OOD` (its metrics but `ood_*` cover the 400 in-distribution
    rows); a partial run (`--allow-partial`): `150 of 400, partial`, or `380 ID + 100 OOD of 520, partial`.

    Example:
        >>> count_text({"n": 400, "n_ood": 120, "n_total": 520, "partial": False})
        '400 ID + 120 OOD'
    """
    n, n_ood, total = row["n"], row.get("n_ood"), row.get("n_total")
    text = str(n) if n_ood is None else f"{n} ID + {n_ood} OOD"
    if row.get("partial"):
        text += f" of {total}, partial" if total is not None else ", partial"
    return text


def console_views(metrics: pl.DataFrame, score: str = "msp") -> dict[str, pl.DataFrame]:
    """The views of one metrics table: {view: frame}, each with `KEY_HEADERS` (the count as text) and the headers of
    `view_columns(score)` as Float64 columns (scaled; NaN where a metric is undefined). `ood` only when an OOD run is
    present, and then only its rows."""
    keys = pl.DataFrame({
        "run": [f"{r['backbone']}/{r['dataset']}/{r['method']}/seed={r['seed']}" for r in metrics.iter_rows(named=True)],
        "calibrator": metrics["calibrator"],
        "n": [count_text(r) for r in metrics.iter_rows(named=True)]}, schema={"run": pl.Utf8, "calibrator": pl.Utf8,
                                                                              "n": pl.Utf8})
    is_ood = metrics["n_ood"].is_not_null() if "n_ood" in metrics.columns else pl.Series([False] * metrics.height)
    out = {}
    for view, columns in view_columns(score).items():
        frame = pl.concat([keys, metrics.select(
            (pl.col(c).cast(pl.Float64) * scale).alias(h) for h, (c, scale, _) in columns.items())], how="horizontal")
        if view == "ood":
            if not is_ood.any():
                continue
            frame = frame.filter(is_ood)
        out[view] = frame
    return out


def cell(value: Any, decimals: int) -> str:
    """A number as the console prints it; NaN/null (an undefined metric, the reason in notes.json) as a dash."""
    return "–" if value is None or value != value else f"{value:.{decimals}f}"
