"""Interim demo on SYNTHETIC data: generate a small fake shard set, then run `zaec-calibrate` on it.

    python -m tools.demo_synthetic OUT

The logits are synthetic (CLIP-like numbers drawn at random, see `calibrate.synthetic`), not the output of any model:
the demo shows the pipeline and the output format, not results. The real demo (a small CLIP on Fashion-MNIST) is
`make demo`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from calibrate.cli import main as cli_main
from calibrate.synthetic import write_synthetic_benchmark

DEMO_DATASETS = ("imagenet", "dtd", "eurosat", "oxford_pets")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.demo_synthetic", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="folder for the synthetic shards (OUT/shards) and results (OUT/results)")
    p.add_argument("--scale", type=float, default=0.2, help="fraction of the real test-set sizes")
    a = p.parse_args(argv)
    print("NOTE: this demo runs on SYNTHETIC logits (random CLIP-like numbers, no model, no images).")
    print("      It shows the pipeline and its outputs; its numbers say nothing about ZAEC on real data.\n")
    shards = a.out / "shards"
    paths = write_synthetic_benchmark(shards, scale=a.scale, datasets=DEMO_DATASETS, methods=("synthetic-tta",))
    print(f"wrote {len(paths)} SYNTHETIC shard(s) under {shards}\n")
    cli_main([str(shards), "--out", str(a.out / "results"), "--samples"])


if __name__ == "__main__":
    main(sys.argv[1:])
