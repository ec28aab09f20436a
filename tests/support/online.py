"""Shared by the online methods' tests (tests/extract/methods/test_dota.py, test_oga.py, test_bca.py,
test_cosmic.py): random class prototypes and a stream of view features clustered around them (the transductive
methods' units too, tests/support/transductive.py), and the check that an interrupted run of the real runner resumes
equal to an uninterrupted one."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def prototypes(k: int, d: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(k, d) random L2-normalised class prototypes."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(k, d, generator=g, dtype=dtype), dim=-1)


def clustered_views(n: int, v: int, text: torch.Tensor, seed: int = 1, noise: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, v, D) L2-normalised view features around the prototypes of random classes, and the (n,) classes: each
    view is its class's prototype plus Gaussian noise of norm ~`noise`."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, text.shape[0], (n,), generator=g)
    base = text[y][:, None] + noise * torch.randn(n, v, text.shape[1], generator=g, dtype=text.dtype) / math.sqrt(
        text.shape[1])
    return F.normalize(base, dim=-1), y


def assert_run_resumes(method: str, tmp_path: Path, model: Any, monkeypatch: Any, **kw: Any) -> np.ndarray:
    """Run `method` on a 12-sample JSON set (parts of 4, adapt calls of 2), interrupt a second run at its second part
    write, resume it, and check its rows equal the uninterrupted run's bit for bit (the runner replays an online
    method's kept prefix). Extra keywords go to `run_extraction` (`overrides`, ...). Returns the adapted rows."""
    from extract.run import writer
    from extract.runner import run_extraction
    from schemas.shard import read_shard, validate_shard
    from tests.support.extract import interrupt_nth_write, make_json_dataset

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=4)
    args = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=model, progress=False,
                part_size=4, adapt_batch=2, chunk_size=5, batch_size=16, **kw)
    full_paths = run_extraction(method, "dtd", out=tmp_path / "full", **args)
    assert len(full_paths) == 3 and all(validate_shard(p) == [] for p in full_paths)
    full = np.concatenate([read_shard(p).tta_logits for p in full_paths])
    real_write = interrupt_nth_write(monkeypatch, 2)
    try:
        run_extraction(method, "dtd", out=tmp_path / "r", **args)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the second part write should have been interrupted")
    monkeypatch.setattr(writer, "write_shard", real_write)
    resumed = np.concatenate([read_shard(p).tta_logits for p in run_extraction(method, "dtd", out=tmp_path / "r",
                                                                                **args)])
    np.testing.assert_array_equal(resumed, full)
    assert np.isfinite(full).all()
    return full
