"""The method lines of `make bench-extract` (tools.bench_methods): every registered method runs through the
runner on a tiny setting (so a new method cannot be left out of the bench), the timer counts what it says and leaves
the classes as it found them, and ECALP's byte count is that of its real data structures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from tools import bench_extract, bench_methods
from extract.methods import REGISTRY, get_method


def test_every_registered_method_runs_in_the_bench(tmp_path):
    from extract.models import load_model

    before = {k: dict(vars(c)).get("adapt") for k, c in REGISTRY.items()}
    model_dir = bench_extract._model_dir(tmp_path / "model", 32)
    model = load_model(None, f"local-dir:{model_dir}", "cpu")
    root = bench_extract.write_image_set(tmp_path / "data", 8, n_classes=4, size=(40, 40))
    costs = bench_methods.method_costs(model, model_dir, root, tmp_path / "work", list(REGISTRY),
                                       single_positions=8, multi_positions=4, adapt_batch=2, budget_s=0.0)
    assert [c.key for c in costs] == list(dict.fromkeys([*bench_methods.REFERENCES, *REGISTRY]))
    skipped = {c.key: c.skipped for c in costs if c.skipped}
    assert not skipped, skipped
    for c in costs:
        # budget 0: the warm-up call (2 samples), then exactly one timed call of 2 samples, then the run is ended; a
        # transductive method's first call is its solve, timed with the second
        assert c.samples == (4 if bench_methods.solves_first(REGISTRY[c.key]) else 2), c
        assert c.seconds > 0, c
        assert c.policy in bench_methods.POLICY_OVERRIDES, c
    assert {k: dict(vars(c)).get("adapt") for k, c in REGISTRY.items()} == before  # the timer restored them


class _Counting:
    def adapt(self, view_feats):
        return view_feats.sum()


def test_timer_times_after_the_first_call_and_stops_at_the_budget():
    calls_made = []

    class M(_Counting):
        def adapt(self, view_feats):
            calls_made.append(view_feats.shape[0])
            return super().adapt(view_feats)

    with bench_methods._adapt_timer(M, budget_s=0.0) as calls:
        m = M()
        m.adapt(torch.zeros(3, 1, 2))
        m.adapt(torch.zeros(5, 1, 2))
        with pytest.raises(bench_methods._Enough):
            m.adapt(torch.zeros(7, 1, 2))
    assert [n for n, _ in calls] == [3, 5] and calls_made == [3, 5]  # the third call never reached the method
    assert "adapt" in vars(M)  # M's own adapt is back
    M().adapt(torch.zeros(1, 1, 2))
    assert calls_made == [3, 5, 1]
    with bench_methods._adapt_timer(_Counting, budget_s=1e9) as calls:
        for b in (1, 2, 3):
            _Counting().adapt(torch.zeros(b, 1, 2))
    assert [n for n, _ in calls] == [1, 2, 3]


def test_method_cost_reports_a_method_that_cannot_run(tiny_model_dir):
    def run(key, *, overrides, limit):
        raise ValueError("no reward model here\nsecond line")

    c = bench_methods.method_cost("tda", run, tiny_model_dir, {"single": 4}, budget_s=1.0)
    assert c.skipped == "ValueError: no reward model here" and c.samples == 0


@pytest.mark.parametrize("key", ["ttl", "tca", "dart", "promptalign"])
def test_a_method_that_cannot_run_on_the_bench_model_is_skipped_by_its_towers(key, tiny_rn_model_dir):
    """The benches ask the method's `towers` (`backbone_refusal`, what `zaec-extract` refuses) before trying a run:
    the line says why, and no run is started."""
    from extract.run.options import RunOptions, backbone_refusal

    def run(key, *, overrides, limit):
        pytest.fail("a run was started")

    pretrained = f"local-dir:{tiny_rn_model_dir}"
    why = backbone_refusal(RunOptions.make(key, "dtd", backbone=None, pretrained=pretrained))
    assert why is not None and why.startswith(f"{key} ") and "RN-tiny's is a ResNet" in why
    c = bench_methods.method_cost(key, run, tiny_rn_model_dir, {"single": 4}, budget_s=1.0)
    assert c.skipped == why and c.samples == 0
    r = bench_methods.run_rate(key, 3, run, {}, {"single": 4}, budget_s=1.0, pretrained=pretrained)
    assert r.skipped == why and r.samples == 0


def _real_graph(n_samples: int, k: int, d: int):
    method = get_method("ecalp")
    g = torch.Generator().manual_seed(0)
    m = method(method.default_config("imagenet", "ViT-B-16"), F.normalize(torch.randn(k, d, generator=g), dim=-1),
               100.0, backbone="ViT-B-16", dataset="imagenet")
    for _ in range(0, n_samples, 64):
        m.adapt(F.normalize(torch.randn(min(64, n_samples - m.n_seen), 1, d, generator=g), dim=-1))
    return m


@pytest.mark.parametrize("n_samples", [12, 40])
def test_ecalp_graph_bytes_are_its_tensors(n_samples):
    k, d = 7, 16
    m = _real_graph(n_samples, k, d)
    held = sum(t.nbytes for t in m.graph.values())
    cfg = m.config
    b = bench_methods.ecalp_graph_bytes(n_samples + 1, k, d, k_image=cfg.k_image, k_text=cfg.k_text)
    assert b["state"] == held
    # the built graph the large-N timing uses has the real layout: same keys, shapes and dtypes
    built = bench_methods.ecalp_built_graph(n_samples, k, d, cfg, torch.Generator().manual_seed(1))
    assert {n: (t.shape, t.dtype) for n, t in built.items()} == {n: (t.shape, t.dtype) for n, t in m.graph.items()}


def test_ecalp_built_graph_steps_like_the_stream():
    sec, _ = bench_methods.ecalp_step_at(50, n_classes=5, dim=8, steps=1)
    assert sec > 0


def test_ecalp_bytes_at_imagenet_scale_are_the_stated_formula():
    b = bench_methods.ecalp_graph_bytes(50_001, 1000, 512)
    n, k = 50_001, 1000
    # written out independently: 65,536 x 512 float32 features; store 10, lists 8 + 3, Y_0 1 column of (f32, i64)
    assert b["state"] == 65_536 * 512 * 4 + n * (10 + 11 + 1) * 12
    assert b["propagation.gathered"] == 2 * 19 * n * k * 4


def test_parse_methods_and_cli_user_errors():
    assert bench_methods.parse_methods("all", list(REGISTRY)) == list(REGISTRY)
    assert bench_methods.parse_methods("none", list(REGISTRY)) == []
    assert bench_methods.parse_methods(" tda, ecalp ", list(REGISTRY)) == ["tda", "ecalp"]
    with pytest.raises(ValueError, match="unknown method.*nope"):
        bench_methods.parse_methods("tda,nope", list(REGISTRY))
    for args in (["--methods", "nope"], ["--ecalp-n", "10,x"], ["--ecalp-stream", "0"]):
        res = CliRunner().invoke(bench_extract.app, ["--only-methods", *args])
        assert res.exit_code == 2, res.output
        assert res.output.startswith("error: --") and len(res.output.strip().splitlines()) == 1, res.output
