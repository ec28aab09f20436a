"""Tiny random second models for the methods that read files beyond the CLIP checkpoint (`external_files`), built
offline from configs by `tools.second_models` (the benches' stand-ins, where PromptAlign's MaPLe prompts and statistics
are written: `write_maple`, `write_stats`). Nothing is downloaded.

    pipe_dir = make_tiny_sd_pipeline(tmp_path / "sd")           # a diffusers folder, 32 px in, 16 px out
    TinyExternals(tmp_path, tiny_model).overrides("difftpt")    # the `--set` values that run it on the tiny model

The session fixture `tiny_externals` (tests/support/extract.py) is a `TinyExternals`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.second_models import StandIns, write_sd_pipeline


def _need_diffusion() -> None:
    import pytest

    pytest.importorskip("diffusers", reason="DiffTPT's tests need the diffusion extra: pip install -e "
                                            "'.[extract,diffusion]' (make venv installs it)")
    pytest.importorskip("transformers", reason="DiffTPT's tests need the diffusion extra")


def make_tiny_sd_pipeline(path: Path, *, seed: int = 0) -> Path:
    """`tools.second_models.write_sd_pipeline(size="tiny")`; the test is skipped without the diffusion extra."""
    _need_diffusion()
    return write_sd_pipeline(path, size="tiny", seed=seed)


class TinyExternals(StandIns):
    """The stand-ins with few generated views and diffusion steps (3 and 3, not 63 and 50), so that a test stays
    fast; DiffTPT's are skipped without the diffusion extra."""

    def __init__(self, root: Path, model: Any):
        super().__init__(root, model, views=3, steps=3)

    def _make(self, key: str) -> dict[str, str]:
        if key == "difftpt":
            _need_diffusion()
        return super()._make(key)
