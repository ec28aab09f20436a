"""The demo end to end, reduced: a tiny training budget, a few images, two sets, one TTA method.

Same code path as `make demo` (real Fashion-MNIST images, real contrastive training, zaec-extract's runner,
zaec-calibrate, zaec-calibrate tables), only smaller. Needs the idx files that `make test` puts in $FMNIST_DIR.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import polars as pl
import pytest

from tools.demo import fmnist
from tools.demo.run import CALIBRATORS, DemoConfig, run_demo

REPO = Path(__file__).resolve().parents[2]
FMNIST_DIR = Path(os.environ.get("FMNIST_DIR", REPO / "data" / "fashion-mnist"))
if not FMNIST_DIR.is_absolute():
    FMNIST_DIR = REPO / FMNIST_DIR


def _have_fmnist() -> bool:
    try:
        fmnist.check_dir(FMNIST_DIR)
    except fmnist.FashionMNISTError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _have_fmnist(),
    reason=f"Fashion-MNIST idx files not in {FMNIST_DIR} (run `make test`, which fetches them, or set FMNIST_DIR)",
)

N_IMAGES = 24
METHOD = "tda"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from rich.console import Console

    root = tmp_path_factory.mktemp("demo")
    cfg = DemoConfig(
        fmnist_dir=FMNIST_DIR, data_root=root / "datasets", models_dir=root / "models", work_dir=root / "work",
        results=root / "results", n_images=N_IMAGES, sets=("clean", "noise"), methods=(METHOD, "zero-shot"),
        train_budget=512 / 60_000, bootstrap=10, progress=False, threads=2,
    )
    out = io.StringIO()
    result = run_demo(cfg, console=Console(file=out, width=200, color_system=None))
    return cfg, result, out.getvalue()


def test_models_saved_in_local_dir_format(demo_run):
    import open_clip

    cfg, result, _ = demo_run
    for name in ("fmnist-ViT", "fmnist-RN"):
        d = cfg.models_dir / name
        conf = json.loads((d / "open_clip_config.json").read_text())
        assert conf["model_name"] == name
        assert conf["model_cfg"]["vision_cfg"]["image_size"] == 32
        assert len(conf["preprocess_cfg"]["mean"]) == 3 and len(conf["preprocess_cfg"]["std"]) == 3
        assert (d / "open_clip_model.safetensors").is_file()
        rec = json.loads((d / "training.json").read_text())
        assert "not OpenAI CLIP" in rec["note"]
        model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{d}")
        assert model.visual.image_size in (32, (32, 32))
    # the RN stand-in really is open_clip's ModifiedResNet
    model = open_clip.create_model(f"local-dir:{cfg.models_dir / 'fmnist-RN'}")
    assert type(model.visual).__name__ == "ModifiedResNet"


def test_shards_valid_for_every_run(demo_run):
    from schemas.shard import find_shards, read_shard

    cfg, _, _ = demo_run
    runs = {}
    for path in find_shards([cfg.shards]):
        sh = read_shard(path)  # validates the shard contract
        key = (sh.meta.backbone, sh.meta.dataset, sh.meta.method)
        runs[key] = runs.get(key, 0) + len(sh.label)
        assert sh.zs_logits.shape[1] == 10 and sh.tta_logits.shape == sh.zs_logits.shape
    expected = {(b, d, m) for b in ("fmnist-ViT", "fmnist-RN") for d in ("fmnist", "fmnist_noise")
                for m in (METHOD, "zero-shot")}
    assert set(runs) == expected
    assert all(n == N_IMAGES for n in runs.values())


def test_metrics_table(demo_run):
    cfg, result, _ = demo_run
    m = result.metrics
    on_disk = pl.read_parquet(cfg.metrics_dir / "metrics.parquet")
    assert on_disk.equals(m)
    assert set(m["calibrator"]) == {"zero-shot", *CALIBRATORS}
    assert m.height == 8 * (1 + len(CALIBRATORS))  # 2 backbones x 2 sets x 2 methods, 5 rows each
    assert (m["n"] == N_IMAGES).all()
    assert m["ece"].is_between(0, 1).all() and m["accuracy"].is_between(0, 1).all()
    # ZAEC never changes the prediction
    wide = m.pivot(on="calibrator", index=["backbone", "dataset", "method"], values="accuracy")
    assert (wide["zaec"] == wide["none"]).all()


def test_summary_and_outputs(demo_run):
    cfg, result, printed = demo_run
    s = result.summary
    assert s.shifted_sets == ("fmnist_noise",)
    assert set(s.table["method"]) == {METHOD} and s.table.height == 2
    keys = [f.key for f in s.findings]
    assert keys == ["tta_accuracy", "tta_ece", "zaec_vs_none", "zaec_vs_sals", "zaec_vs_temperature", "zaec_best",
                    "accuracy_preserved"]
    acc = s.finding("accuracy_preserved")
    assert acc.holds is True and acc.measured is False  # a property of T > 0, said as one
    assert acc.text.startswith("By construction, not measured") and " runs" not in acc.text
    assert all(f.measured for f in s.findings if f.key != "accuracy_preserved")
    assert all(f.holds is not None for f in s.findings)  # every claim decided on this table
    assert "What this run shows" in printed and "not OpenAI CLIP" in printed
    for f in s.findings:
        assert f.text in printed.replace("\n", " ") or f.text[:40] in printed
    assert (cfg.results / "demo_summary.md").read_text().startswith("# Demo summary")
    assert (cfg.results / "README.md").is_file()  # zaec-calibrate tables ran
    assert set(result.timings) == {"train", "sets", "extract", "calibrate", "tables", "ood", "total"}


def test_ood_pair(demo_run):
    """The OOD pair: valid OOD shards for zero-shot and TDA on both backbones, and the printed sentence is the one
    `ood_sentence` computes from its metrics."""
    from tools.demo.ood import OOD_METHODS, ood_sentence
    from schemas.shard import find_shards, read_shard

    cfg, _, printed = demo_run
    runs = {}
    for path in find_shards([cfg.work_dir / "ood-shards"]):
        sh = read_shard(path)
        runs[(sh.meta.backbone, sh.meta.dataset, sh.meta.method)] = int((sh.label == -1).sum()), len(sh.label)
    assert set(runs) == {(b, "demo_shapes@fmnist", m) for b in ("fmnist-ViT", "fmnist-RN") for m in OOD_METHODS}
    assert all(v == (N_IMAGES, 2 * N_IMAGES) for v in runs.values())
    sentence = ood_sentence(pl.read_parquet(cfg.work_dir / "ood-calibrate" / "metrics.parquet"))
    assert "ZAEC" in sentence and " ".join(sentence.split()) in " ".join(printed.split())
    assert sentence in (cfg.results / "demo_summary.md").read_text()


def test_second_run_skips_finished_work(demo_run):
    from rich.console import Console

    cfg, first, _ = demo_run
    out = io.StringIO()
    again = run_demo(cfg, console=Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert text.count("already trained") == 2
    assert "wrote fmnist" not in text
    assert "is up to date (skipped)" in text
    assert again.metrics.equals(first.metrics)


def test_cli_user_error_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from tools.demo.__main__ import app

    res = CliRunner().invoke(app, ["--fmnist-dir", str(tmp_path / "missing")])
    assert res.exit_code == 2
    res = CliRunner().invoke(app, ["--fmnist-dir", str(FMNIST_DIR), "--methods", "nope"])
    assert res.exit_code == 2
