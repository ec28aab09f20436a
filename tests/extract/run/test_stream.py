"""extract/run/stream.py without a model: the adapt loop after a replay against a slow reference, and non-finite
logits named by sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from extract.run.options import RunError
from extract.run.progress import Progress
from extract.run.stream import RunState, StreamInputs, adapt_stream, check_finite_logits, replay


class Reader:
    def __init__(self, feats):
        self.feats = feats

    def get(self, s, e):
        return self.feats[s:e].copy()


class MeanMethod:
    """An online stand-in: logits = scale * (f0 + mean of every f0 so far) @ T^T."""

    def __init__(self, text):
        self.text, self.acc, self.n_seen = text, torch.zeros(text.shape[1], dtype=torch.float64), 0

    def adapt(self, feats):
        out = []
        for f in feats[:, 0].double():
            self.acc += f
            self.n_seen += 1
            out.append(2.0 * (f + self.acc / self.n_seen) @ self.text.double().T)
        return torch.stack(out).float()


class Rows:
    def __init__(self):
        self.rows = []

    def add(self, *cols):
        self.rows.append(cols)


def _inputs(method, feats, text, adapt_batch):
    n = len(feats)
    perm = np.random.default_rng(1).permutation(n)
    return StreamInputs("mean", method, Reader(feats), text, 3.0, torch.device("cpu"), perm,
                        np.arange(n) % text.shape[0], adapt_batch)


@pytest.mark.parametrize("n,adapt_batch,start", [(7, 2, 0), (7, 3, 3), (8, 4, 8), (5, 1, 2)])
def test_adapt_stream_after_replay_equals_a_slow_reference(n, adapt_batch, start):
    rng = np.random.default_rng(n)
    feats = rng.normal(size=(n, 1, 4)).astype(np.float32)
    text = torch.from_numpy(rng.normal(size=(3, 4)).astype(np.float32))
    method = MeanMethod(text)
    inputs = _inputs(method, feats, text, adapt_batch)
    task = Progress(False).task("t", n)
    replay(inputs, start, task)
    rows = Rows()
    state = adapt_stream(inputs, RunState(start), n, rows, task)
    # slow reference: one sample at a time from position 0, the zero-shot logits from the formula
    acc, tta_ref, zs_ref = np.zeros(4), [], []
    for i in range(n):
        f = feats[i, 0].astype(np.float64)
        acc += f
        tta_ref.append(2.0 * (f + acc / (i + 1)) @ text.double().numpy().T)
        zs_ref.append(3.0 * feats[i, 0] @ text.numpy().T)
    got_tta = np.concatenate([r[3] for r in rows.rows]) if rows.rows else np.zeros((0, 3))
    got_zs = np.concatenate([r[2] for r in rows.rows]) if rows.rows else np.zeros((0, 3))
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(got_tta, np.array(tta_ref[start:]).reshape(-1, 3), rtol=0, atol=64 * eps * 2 * 4)
    np.testing.assert_allclose(got_zs, np.array(zs_ref[start:]).reshape(-1, 3), rtol=0, atol=8 * eps * 3 * 4)
    labels = inputs.labels[inputs.perm]
    assert state.position == n
    assert state.correct_tta == sum(int(np.argmax(t) == labels[start + i]) for i, t in enumerate(got_tta))
    assert state.correct_zs == sum(int(np.argmax(z) == labels[start + i]) for i, z in enumerate(got_zs))
    assert [int(p) for r in rows.rows for p in r[4]] == list(range(start, n))
    assert [int(s) for r in rows.rows for s in r[0]] == inputs.perm[start:].tolist()


def test_non_finite_logits_name_the_sample():
    tta = np.array([[0.0, 1.0], [np.nan, 0.0]])
    with pytest.raises(RunError, match=r"non-finite adapted logits for sample_id 9 at stream position 11"):
        check_finite_logits("m", tta, np.zeros((2, 2)), np.array([4, 9]), 10)
    check_finite_logits("m", np.zeros((2, 2)), np.zeros((2, 2)), np.array([4, 9]), 10)


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
