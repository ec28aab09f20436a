"""Calibration kernels as pure functions over arrays, apart from the estimator classes (`calibrate.calibrators`),
the way torchmetrics keeps `functional/` apart from its stateful classes.

- `softmax`: entropy, prediction, confidence, NLL and Brier of softmax(logits / T) (`softmax_stats`,
  `entropy_from_logits`);
- `zaec`: the ZAEC per-sample temperature solver (`solve_zaec`, `zaec_temperature`);
- `temperature`: the temperature-scaling fit by NLL, streaming (`fit_temperature`, `nll_derivatives`).

A new kernel goes into the submodule of its kind (or a new one), which is where it is imported from
(`from calibrate.functional.zaec import solve_zaec`); an estimator that uses it goes into `calibrate.calibrators`
with its registry entry.
"""
