"""`zaec-calibrate tables` end to end on small hand-made shards: every output written headless, skips noted,
user errors end in one line and exit code 2."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest

from calibrate.tables.cli import main as tables_main
from schemas import ShardMeta, shard_path, write_shard


def _write(root, backbone, dataset, method, n, k, seed=1, parts=2):
    """Zero-shot logits with a true-class margin; adapted logits 2.5x sharper with a little noise."""
    rng = np.random.default_rng([n, k, sum(map(ord, dataset)), sum(map(ord, backbone))])  # same samples per dataset
    labels = rng.integers(0, k, n)
    zs = rng.normal(0, 1.0, (n, k))
    zs[np.arange(n), labels] += rng.uniform(0, 2.5, n)
    noise = np.random.default_rng([seed, sum(map(ord, method))]).normal(0, 0.5, (n, k))
    tta = zs if method == "zero-shot" else 2.5 * zs + noise
    meta = ShardMeta(backbone, "openai", dataset, method, seed, tuple(f"c{i}" for i in range(k)))
    for part, sl in enumerate(np.array_split(np.arange(n), parts)):
        write_shard(shard_path(root, meta.key, part), meta, sl, labels[sl], zs[sl].astype(np.float32),
                    tta[sl].astype(np.float32))


def _run(args, capsys):
    with pytest.raises(SystemExit) as e:
        tables_main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.err


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    for method in ("zero-shot", "tda", "dpe"):
        for dataset, n, k in (("imagenet", 120, 6), ("imagenet_a", 100, 6), ("dtd", 90, 5), ("fmnist_noise", 80, 10)):
            _write(root, "ViT-B-16", dataset, method, n, k)
    _write(root, "RN50", "imagenet_a", "tda", 100, 6)  # no imagenet source: temperature scaling skipped there
    _write(root, "RN50", "imagenet_a", "tda", 100, 6, seed=2)
    return root


def test_tables_end_to_end(shards, tmp_path, capsys):
    out = tmp_path / "results"
    code, err = _run([shards, "--out", out, "--bootstrap", "40", "--seed", "3"], capsys)
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    for bb in ("ViT-B-16", "RN50"):
        for stem in (f"main_{bb}", f"main_{bb}_ci"):
            assert {f"{stem}.csv", f"{stem}.md", f"{stem}.tex"} <= names
        for fig in ("fig2a_range_vs_ece", "fig2b_entropy_vs_ece", "fig2cd_entropy_gap", "fig4_reliability",
                    "fig5_strength", "summary"):
            png = out / f"{fig}_{bb}.png"
            assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for stem in ("table1_pa_pd", "table4_subset_ablation", "fig2b_correlation"):
        assert {f"{stem}.csv", f"{stem}.md", f"{stem}.tex"} <= names
    # README links every output, and every link resolves
    readme = (out / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)]+)\)", readme))
    assert links and all((out / link).exists() for link in links)
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} - {"README.md"} <= links
    assert "temperature scaling skipped for RN50/tda" in readme and "T = " in readme

    main = pl.read_csv(out / "main_ViT-B-16.csv")
    assert main["block"].unique(maintain_order=True).to_list() == ["zero-shot", "tda", "dpe"]
    assert main["group"].unique(maintain_order=True).to_list() == ["natural_shift", "fine_grained", "other"]
    ece = main.filter(pl.col("metric") == "ece")
    assert ece["ci_low"].null_count() == 0 and (ece["ci_low"] <= ece["ci_high"]).all()
    # exactly one (or tied) bold value per method block and column
    bold = main.filter(pl.col("bold"))
    assert bold.group_by(["block", "col_pos"]).len()["len"].min() >= 1
    assert set(bold["metric"]) == {"ece"} and "zero-shot" not in set(bold["block"])
    rn50 = pl.read_csv(out / "main_RN50.csv")
    assert "temperature" not in set(rn50["row"]) and "zaec" in set(rn50["row"])
    # two RN50 seeds: mean with the standard deviation over seeds
    seeds_std = rn50.filter((pl.col("row") == "none") & (pl.col("dataset") == "imagenet_a"))["seed_std"][0]
    assert seeds_std is not None and seeds_std > 0 and " ± " in (out / "main_RN50.md").read_text()
    # accuracy rows: raw TTA accuracy, identical for every calibrator (only one Acc. row per block)
    assert main.filter((pl.col("block") == "tda") & (pl.col("metric") == "accuracy")).height == 7  # 4 sets, 3 avgs
    md = (out / "main_ViT-B-16.md").read_text()
    assert "**" in md and "| I-A | Avg. |" in md
    tex = (out / "main_ViT-B-16.tex").read_text()
    assert "\\textbf{" in tex and "\\multicolumn" in tex and "fmnist\\_noise" in tex
    diffs = pl.read_csv(out / "main_ViT-B-16_ci.csv")
    assert set(diffs["comparison"]) == {"ZAEC - None", "ZAEC - SaLS", "ZAEC - Temp. Scal."}
    assert diffs["contains_zero"].dtype == pl.Boolean
    t4 = pl.read_csv(out / "table4_subset_ablation.csv")
    assert dict(zip(t4["backbone"], t4["datasets"])) == {"ViT-B-16": "imagenet,imagenet_a", "RN50": "imagenet_a"}
    zrow = t4.filter(pl.col("calibrator") == "zaec")
    assert zrow["diff_zaec"].null_count() == zrow.height and t4["diff_contains_zero"].null_count() == zrow.height
    assert "reference dataset" not in readme  # imagenet_a is present for both backbones


def test_missing_inputs_are_skipped_with_notes(tmp_path, capsys):
    root = tmp_path / "shards"
    _write(root, "ViT-B-16", "fmnist", "zero-shot", 60, 10)
    out = tmp_path / "results"
    code, err = _run([root, "--out", out, "--bootstrap", "0", "--ts-source", "fmnist"], capsys)
    assert code == 0, err
    readme = (out / "README.md").read_text()
    assert "Table 1 skipped" in readme and "Figure 2a skipped" in readme and "bootstrap disabled" in readme
    main = pl.read_csv(out / "main_ViT-B-16.csv")
    assert main["block"].unique().to_list() == ["zero-shot"]


def test_reference_dataset_fallback_and_dispatch_through_zaec_calibrate(tmp_path, capsys):
    from calibrate.cli import main as calibrate_main

    root = tmp_path / "shards"
    for d in ("fmnist", "fmnist_blur"):
        _write(root, "tiny-vit", d, "tda", 60, 10)
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as e:
        calibrate_main(
            ["tables", str(root), "--out", str(out), "--bootstrap", "20", "--ts-source", "fmnist", "--quiet"])
    assert e.value.code == 0
    readme = (out / "README.md").read_text()
    assert "Figures 2c/2d and 4 use 'fmnist_blur'" in readme  # not the temperature-scaling source
    assert (out / "fig4_reliability_tiny-vit.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["does-not-exist"], "no such file or directory"),
    (["{root}", "--bins", "0"], "--bins must be a positive integer"),
    (["{root}", "--bootstrap", "-1"], "--bootstrap must be >= 0"),
    (["{root}", "--no-such-option"], "No such option: --no-such-option"),  # typer's usage errors: one line too
])
def test_user_errors_end_in_one_line(tmp_path, capsys, args, message):
    root = tmp_path / "shards"
    _write(root, "ViT-B-16", "dtd", "tda", 20, 3)
    code, err = _run([a.format(root=root) for a in args] + ["--out", tmp_path / "r"], capsys)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and message in lines[0] and "Traceback" not in err
