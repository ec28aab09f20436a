"""extract/run/stream.py: what a non-finite logit row says about its cause."""

from __future__ import annotations

import numpy as np
import pytest

from extract.run.options import RunError
from extract.run.stream import check_finite_logits


def test_non_finite_adapted_logits_point_at_the_settings():
    tta, zs = np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
    tta[1, 0] = np.inf
    with pytest.raises(RunError, match=r"adapted logits for sample_id 11 at stream position 5 .*--set values"):
        check_finite_logits("tda", tta, zs, np.array([10, 11, 12]), 4)


def test_non_finite_zero_shot_logits_point_at_the_caches_not_the_settings():
    """The zero-shot anchor uses no method setting: a NaN there was blamed on --set before."""
    tta, zs = np.zeros((3, 2), np.float32), np.zeros((3, 2), np.float32)
    zs[2, 1] = np.nan
    with pytest.raises(RunError) as e:
        check_finite_logits("tda", tta, zs, np.array([10, 11, 12]), 4)
    assert "zero-shot logits for sample_id 12" in str(e.value) and "--set" not in str(e.value)
    assert "cache" in str(e.value)
