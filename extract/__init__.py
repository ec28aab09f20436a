"""The extraction stage (GPU): open_clip models, test sets, views, TTA methods, and the pipeline writing shards.

Entry points: `zaec-extract` (`extract.cli`), `extract.runner.run_extraction`, `make bench-extract`
(`tools.bench_extract`). Needs the `extract` extra: `pip install -e .[extract]`.
"""
