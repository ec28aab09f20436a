"""`make tables`: every table and figure of the paper from shards, with paired bootstrap intervals.

Pipeline: `data` streams each run's shards into per-sample (N,) summaries (never a dataset's (N, K) logits);
`bootstrap` resamples them (vectorised, paired); `builders` are pure functions returning polars DataFrames;
`figures` draws them; `render` writes CSV + Markdown + LaTeX; `report` writes everything plus `README.md`;
`cli` is `zaec-calibrate tables`.
"""
