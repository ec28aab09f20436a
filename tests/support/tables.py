"""Shared helpers of the table and figure tests (tests/calibrate/tables/): a slow ECE loop, a hand-made cells frame,
small shard sets written to disk, and the `zaec-calibrate tables` command run in-process."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest

from calibrate.tables.cli import main as tables_main
from schemas.shard import ShardMeta, shard_path, write_shard


def slow_ece(conf, correct, n_bins):
    """Loop over bins with membership lo < c <= hi (c == 0 in the first bin)."""
    total = 0.0
    n = len(conf)
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        idx = [i for i, c in enumerate(conf) if (lo < c <= hi) or (b == 0 and c == 0)]
        if idx:
            acc = sum(correct[i] for i in idx) / len(idx)
            cf = sum(conf[i] for i in idx) / len(idx)
            total += len(idx) / n * abs(acc - cf)
    return total


def cells(rows):
    """rows: (dataset, method, calibrator, accuracy, ece) -> a cells frame as `cell_metrics` makes."""
    return pl.DataFrame(
        [dict(backbone="ViT-B-16", dataset=d, method=m, calibrator=c, accuracy=a, ece=e, nll=1.0, mean_confidence=0.5,
              mean_entropy=1.0, range_deviation=0.0, mean_delta_entropy=0.0, n=10.0, n_seeds=1)
         for d, m, c, a, e in rows])


def write_run(root, backbone, dataset, method, n, k, seed=1, parts=2):
    """Zero-shot logits with a true-class margin; adapted logits 2.5x sharper with a little noise."""
    rng = np.random.default_rng([n, k, sum(map(ord, dataset)), sum(map(ord, backbone))])  # same samples per dataset
    labels = rng.integers(0, k, n)
    zs = rng.normal(0, 1.0, (n, k))
    zs[np.arange(n), labels] += rng.uniform(0, 2.5, n)
    noise = np.random.default_rng([seed, *method.encode()]).normal(0, 0.5, (n, k))  # its own noise per method
    tta = zs if method == "zero-shot" else 2.5 * zs + noise
    meta = ShardMeta(backbone, "openai", dataset, method, seed, tuple(f"c{i}" for i in range(k)))
    for part, sl in enumerate(np.array_split(np.arange(n), parts)):
        write_shard(shard_path(root, meta.key, part), meta, sl, labels[sl], zs[sl].astype(np.float32),
                    tta[sl].astype(np.float32))


def run_tables(args, capsys):
    with pytest.raises(SystemExit) as e:
        tables_main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.err


def index_items(readme: str) -> dict[str, str]:
    """Index lines `- **<item>** ...`: item -> the rest of its line, in the order written."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^- \*\*(.+?)\*\*: (.*)$", readme, re.M)}
