"""SYNTHETIC shard generator, for tests, benchmarks and the interim demo only. These are not real model outputs.

The logits imitate CLIP: zero-shot logits are `scale * cosine` with cosines around 0.2 and the true class raised by
a per-sample margin (so zero-shot accuracy is moderate and uncertainty varies per sample); the adapted logits are
sharper (a per-sample sharpening factor > 1 on the centred logits), and a small logit perturbation plus a nudge
towards the true class changes some predictions (TTA usually gains a little accuracy). Every shard is written through
`schemas.shard.write_shard`, so it follows the contract exactly.

    python -m calibrate.synthetic OUT [--scale 0.05] [--datasets dtd,eurosat] [--rows-per-shard 10000]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import zlib

import numpy as np

from schemas.shard import RunKey, ShardMeta, shard_path, write_shard

#: the 15 benchmark test sets of the paper: canonical key -> (test size, number of classes)
PAPER_DATASETS: dict[str, tuple[int, int]] = {
    "imagenet": (50000, 1000),
    "imagenet_a": (7500, 200),
    "imagenet_v2": (10000, 1000),
    "imagenet_r": (30000, 200),
    "imagenet_sketch": (50889, 1000),
    "caltech101": (2465, 100),
    "dtd": (1692, 47),
    "eurosat": (8100, 10),
    "fgvc_aircraft": (3333, 100),
    "food101": (30300, 101),
    "flowers102": (2463, 102),
    "oxford_pets": (3669, 37),
    "stanford_cars": (8041, 196),
    "sun397": (19850, 397),
    "ucf101": (3783, 101),
}


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the synthetic logits (defaults chosen to look like CLIP ViT-B-16 outputs, not fitted to anything)."""

    logit_scale: float = 100.0  # CLIP's learned logit scale
    cos_mean: float = 0.20  # typical image-text cosine of a wrong class
    cos_std: float = 0.02
    margin_mean: float = 0.03  # extra cosine of the true class
    margin_std: float = 0.03
    sharpen_log_mean: float = 0.4  # log of the per-sample TTA sharpening factor (exp(0.4) ~ 1.5)
    sharpen_log_std: float = 0.35
    tta_noise: float = 0.6  # std of the additive TTA logit perturbation (logit units)
    tta_true_boost: float = 0.5  # mean extra logit TTA gives the true class (accuracy gain)


def synthetic_logits(
    n: int, k: int, rng: np.random.Generator, config: SyntheticConfig = SyntheticConfig()
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SYNTHETIC (labels, zs_logits, tta_logits): (n,) int32, (n, k) float32, (n, k) float32."""
    c = config
    y = rng.integers(0, k, size=n).astype(np.int32)
    cos = rng.normal(c.cos_mean, c.cos_std, size=(n, k))
    rows = np.arange(n)
    cos[rows, y] += rng.normal(c.margin_mean, c.margin_std, size=n)
    zs = c.logit_scale * cos
    centred = zs - zs.mean(axis=1, keepdims=True)
    gamma = np.exp(rng.normal(c.sharpen_log_mean, c.sharpen_log_std, size=n))[:, None]
    tta = zs.mean(axis=1, keepdims=True) + gamma * centred + rng.normal(0.0, c.tta_noise, size=(n, k))
    tta[rows, y] += np.abs(rng.normal(c.tta_true_boost, c.tta_true_boost, size=n))
    return y, zs.astype(np.float32), tta.astype(np.float32)


def write_synthetic_run(
    root: str | Path,
    dataset: str,
    n: int,
    k: int,
    *,
    backbone: str = "ViT-B-16",
    method: str = "synthetic-tta",
    seed: int = 1,
    rows_per_shard: int = 10000,
    config: SyntheticConfig = SyntheticConfig(),
) -> list[Path]:
    """Write one SYNTHETIC run (n samples of k classes) as shards under `root`; returns the shard paths."""
    # crc32, not a character sum: "tda" and "dpe" have equal character sums and would get identical logits
    rng = np.random.default_rng([seed, k, n, zlib.crc32(dataset.encode()), zlib.crc32(method.encode())])
    meta = ShardMeta(
        backbone=backbone,
        pretrained="synthetic",
        dataset=dataset,
        method=method,
        seed=seed,
        class_names=tuple(f"class_{i}" for i in range(k)),
        method_config={"synthetic": True, **{f: getattr(config, f) for f in config.__dataclass_fields__}},
        zs_prompts={"synthetic": True},
        extra={"zaec:synthetic": "true"},
    )
    order = rng.permutation(n)  # stream order: shards hold permuted sample ids, as a shuffled TTA stream would
    paths = []
    for part, start in enumerate(range(0, n, rows_per_shard)):
        ids = order[start : start + rows_per_shard]
        y, zs, tta = synthetic_logits(len(ids), k, rng, config)
        paths.append(
            write_shard(
                shard_path(root, RunKey(backbone, dataset, method, seed), part),
                meta,
                ids,
                y,
                zs,
                tta,
                stream_pos=np.arange(start, start + len(ids)),
            )
        )
    return paths


def write_synthetic_benchmark(
    root: str | Path,
    *,
    scale: float = 1.0,
    datasets: Sequence[str] | None = None,
    methods: Iterable[str] = ("synthetic-tta",),
    seed: int = 1,
    rows_per_shard: int = 10000,
) -> list[Path]:
    """SYNTHETIC shards with the paper's 15 test sets' class counts and `scale` x their real test sizes."""
    names = list(datasets) if datasets else list(PAPER_DATASETS)
    unknown = [d for d in names if d not in PAPER_DATASETS]
    if unknown:
        raise ValueError(f"unknown dataset(s) {', '.join(unknown)}; available: {', '.join(PAPER_DATASETS)}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    paths: list[Path] = []
    for method in methods:
        for d in names:
            n, k = PAPER_DATASETS[d]
            paths += write_synthetic_run(
                root, d, max(1, round(n * scale)), k, method=method, seed=seed, rows_per_shard=rows_per_shard
            )
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m calibrate.synthetic",
        description="Write SYNTHETIC shards (fake CLIP-like logits, for tests/benchmarks/demo only).",
    )
    p.add_argument("out", type=Path)
    p.add_argument("--scale", type=float, default=0.05, help="fraction of each test set's real size (1 = paper scale)")
    p.add_argument("--datasets", default="", help=f"comma-separated subset of: {', '.join(PAPER_DATASETS)}")
    p.add_argument("--methods", default="synthetic-tta", help="comma-separated method names to fake")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rows-per-shard", type=int, default=10000)
    a = p.parse_args(argv)
    try:
        paths = write_synthetic_benchmark(
            a.out,
            scale=a.scale,
            datasets=[d for d in a.datasets.split(",") if d] or None,
            methods=[m for m in a.methods.split(",") if m],
            seed=a.seed,
            rows_per_shard=a.rows_per_shard,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(paths)} SYNTHETIC shard(s) under {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
