"""`python -m tools.check_shortcuts`: a TPT-family method with and without its execution-only shortcuts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools import check_shortcuts
from tools.check_shortcuts import _metrics

from tests.support.extract import make_json_dataset
from tests.support.tpt import tuned_tol


def test_metrics_against_an_obvious_loop():
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(0, 3, (200, 4)), rng.integers(0, 4, 200)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    conf, correct = p.max(1), p.argmax(1) == labels
    ece = 0.0
    for b in range(20):  # equal-width bins (lo, hi], the first one closed at 0
        inside = (conf > b / 20) & (conf <= (b + 1) / 20)
        if inside.any():
            ece += inside.mean() * abs(correct[inside].mean() - conf[inside].mean())
    m = _metrics(labels, logits)
    assert m["accuracy"] == correct.mean()
    assert abs(m["ece"] - ece) <= 64 * np.finfo(np.float64).eps


def test_cpu_runs_agree_to_rounding_and_write_json(tmp_path, tiny_model_dir, capsys):
    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=4)
    out = tmp_path / "s.json"
    with pytest.raises(SystemExit) as e:
        check_shortcuts.run(["--pretrained", f"local-dir:{tiny_model_dir}", "--dataset", "dtd", "--data-root",
                             str(root), "--device", "cpu", "--methods", "tpt,atpt", "--limit", "6", "--json",
                             str(out)])
    assert e.value.code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and [r["method"] for r in doc["rows"]] == ["tpt", "atpt"]
    for r in doc["rows"]:
        assert r["n"] == 6 and r["argmax_agreement"] == 1.0
        # fp32 on the CPU: other summation orders only (tests/support/tpt.py's bound after TPT's one step)
        assert r["max_abs_logit_diff"] <= tuned_tol(r["logit_scale_max"], 1)
        assert r["shortcuts"]["accuracy"] == r["no_shortcuts"]["accuracy"]
    assert "with / without the shortcuts" in capsys.readouterr().out


def test_a_method_without_shortcuts_is_one_line(tmp_path, tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        check_shortcuts.run(["--pretrained", f"local-dir:{tiny_model_dir}", "--dataset", "dtd", "--methods", "tda"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "tda has no text-encoder shortcuts" in err
