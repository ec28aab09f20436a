"""The CPU stage: calibrators (none, temperature scaling, SaLS, ZAEC), metrics and the `zaec-calibrate` CLI.

It reads the Parquet shards defined in `schemas/` and never imports torch, open_clip or `extract/`. Every name is
imported from its module (`calibrate.calibrators`, `calibrate.functional.zaec`, ...); the package forwards nothing.
"""
