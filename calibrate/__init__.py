"""The CPU stage: calibrators (none, temperature scaling, SaLS, ZAEC), metrics and the `zaec-calibrate` CLI.

It reads the Parquet shards defined in `schemas/` and never imports torch, open_clip or `extract/`.
"""

from calibrate.calibrators import CALIBRATORS, Calibrator, parse_calibrator
from calibrate.functional import entropy_from_logits, softmax_stats, solve_zaec, zaec_temperature

__all__ = [
    "CALIBRATORS", "Calibrator", "entropy_from_logits", "parse_calibrator", "softmax_stats", "solve_zaec",
    "zaec_temperature",
]
