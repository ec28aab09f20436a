"""`make tables`: every table and figure of the paper from shards, with paired bootstrap intervals.

Pipeline: `data` streams each run's shards into per-sample (N,) summaries (never a dataset's (N, K) logits);
`bootstrap` resamples them (vectorised, paired); `builders` are pure functions returning polars DataFrames;
`figures` draws them; `render` writes CSV + Markdown + LaTeX; `report` writes everything plus `README.md`;
`cli` is `zaec-calibrate tables`.
"""

from calibrate.tables.bootstrap import BootstrapResult, bootstrap_runs
from calibrate.tables.data import RunSummary, Summaries, load_summaries
from calibrate.tables.report import ALL_SPECS, ReportOptions, write_report

__all__ = ["ALL_SPECS", "BootstrapResult", "ReportOptions", "RunSummary", "Summaries", "bootstrap_runs",
           "load_summaries", "write_report"]
