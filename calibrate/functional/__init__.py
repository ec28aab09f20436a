"""Calibration kernels as pure functions over arrays, apart from the estimator classes (`calibrate.calibrators`),
the way torchmetrics keeps `functional/` apart from its stateful classes.

- `softmax`: entropy, prediction, confidence, NLL and Brier of softmax(logits / T) (`softmax_stats`,
  `entropy_from_logits`);
- `zaec`: the ZAEC per-sample temperature solver (`solve_zaec`, `zaec_temperature`);
- `temperature`: the temperature-scaling fit by NLL, streaming (`fit_temperature`, `nll_derivatives`).

A new kernel goes into the submodule of its kind (or a new one) and is listed here; an estimator that uses it goes
into `calibrate.calibrators` with its registry entry.
"""

from calibrate.functional.softmax import CHUNK_ELEMENTS, SoftmaxStats, entropy_from_logits, softmax_stats
from calibrate.functional.temperature import TS_BETA_MAX, TS_BETA_MIN, fit_temperature, nll_derivatives
from calibrate.functional.zaec import (
    SUBSETS,
    ZAEC_MAX_ITER,
    ZAEC_RTOL,
    ZAEC_T_MAX,
    ZAEC_T_MIN,
    Subset,
    ZaecSolution,
    solve_zaec,
    zaec_temperature,
)

__all__ = [
    "CHUNK_ELEMENTS", "SUBSETS", "TS_BETA_MAX", "TS_BETA_MIN", "ZAEC_MAX_ITER", "ZAEC_RTOL", "ZAEC_T_MAX",
    "ZAEC_T_MIN", "SoftmaxStats", "Subset", "ZaecSolution", "entropy_from_logits", "fit_temperature",
    "nll_derivatives", "softmax_stats", "solve_zaec", "zaec_temperature",
]
