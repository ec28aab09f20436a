"""`zaec-calibrate tables` end to end on small hand-made shards: every output written headless, skips noted,
user errors end in one line and exit code 2."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest

from tests.support.tables import index_items as _items, run_tables as _run, write_run as _write


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    for method in ("zero-shot", "tda", "dpe", "tpt", "otpt"):  # no atpt: Figure 2a is drawn without it
        for dataset, n, k in (("imagenet", 120, 6), ("imagenet_a", 100, 6), ("dtd", 90, 5), ("fmnist_noise", 80, 10)):
            _write(root, "ViT-B-16", dataset, method, n, k)
    _write(root, "ViT-B-16", "caltech101", "dpe", 70, 5)  # Figure 4's boundary case (DPE on Caltech101)
    _write(root, "RN50", "imagenet_a", "tda", 100, 6)  # no imagenet source: temperature scaling skipped there
    _write(root, "RN50", "imagenet_a", "tda", 100, 6, seed=2)
    return root


#: the index's items in the paper's order (Figure 1 intro, 2a-2d, 3 RN50, 4 boundary, 5 reliability, 6 strength)
PAPER_ITEMS = ["Figure 1", "Table 1", "Figure 2a", "Figure 2b", "Figures 2c/2d", "Figure 3", "Tables 2 and 3",
               "Tables 2 and 3, intervals", "Figure 4", "Figure 5", "Table 4", "Figure 6", "Per-run metrics"]
#: the items beyond the paper, listed after the paper's under their own heading (issue 24)
BEYOND_ITEMS = ["Selective prediction and classwise calibration", "Risk-coverage figure",
                "Out-of-distribution detection"]


def test_tables_end_to_end(shards, tmp_path, capsys):
    out = tmp_path / "results"
    code, err = _run([shards, "--out", out, "--bootstrap", "40", "--seed", "3"], capsys)
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    for bb in ("ViT-B-16", "RN50"):
        for stem in (f"main_{bb}", f"main_{bb}_ci"):
            assert {f"{stem}.csv", f"{stem}.md", f"{stem}.tex"} <= names
        figs = ["fig1_intro", "fig2b_entropy_vs_ece", "fig2cd_entropy_gap", "fig3_summary", "fig5_reliability",
                "fig6_strength"]
        if bb == "ViT-B-16":  # RN50 has neither TPT nor O-TPT (Figure 2a) nor DPE on Caltech101 (Figure 4)
            figs += ["fig2a_range_vs_ece", "fig4_boundary_caltech101"]
        for fig in figs:
            png = out / f"{fig}_{bb}.png"
            assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for stem in ("table1_pa_pd", "table4_subset_ablation", "fig2b_correlation", "trust_ViT-B-16", "trust_RN50"):
        assert {f"{stem}.csv", f"{stem}.md", f"{stem}.tex"} <= names
    # every figure keeps its data as CSV next to the PNG
    assert {"trust_ViT-B-16_diff.csv", "risk_coverage.csv", "risk_coverage_ViT-B-16.png"} <= names
    for csv in ("fig1_intro", "fig2a_range_vs_ece", "fig2a_all_points", "fig2b_entropy_vs_ece", "fig2cd_entropy_gap",
                "fig3_summary", "fig4_boundary", "fig5_reliability", "fig6_strength"):
        assert f"{csv}.csv" in names
    # the paper's numbers, never the old ones (reliability grid was "Figure 4", strength "Figure 5")
    assert not any(n.startswith(("fig4_reliability", "fig5_strength", "summary")) for n in names)
    # README links every output, and every link resolves
    readme = (out / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)]+)\)", readme))
    assert links and all((out / link).exists() for link in links)
    assert {p.name for p in out.iterdir() if not p.name.startswith(".")} - {"README.md"} <= links
    assert "temperature scaling skipped for RN50/tda" in readme and "T = " in readme
    # the index lists every paper item, in the paper's order, with what it shows
    items = _items(readme)
    assert list(items) == PAPER_ITEMS + BEYOND_ITEMS
    assert readme.index("## Beyond the paper") > readme.index(f"**{PAPER_ITEMS[-1]}**")
    assert "fig4_boundary_caltech101_ViT-B-16.png" in items["Figure 4"] and "boundary" in items["Figure 4"]
    assert "fig5_reliability_ViT-B-16.png" in items["Figure 5"] and "reliability" in items["Figure 5"]
    assert "fig6_strength_RN50.png" in items["Figure 6"] and "fig3_summary_RN50.png" in items["Figure 3"]
    assert "RN50: no dpe runs on caltech101" in readme  # Figure 4 drawn for ViT-B-16 only, the gap noted

    # Figure 2a as the paper draws it; no A-TPT shards: drawn without its point, and the index says so
    pts = pl.read_csv(out / "fig2a_range_vs_ece.csv")
    assert pts["label"].to_list() == ["TPT + SaLS", "TPT + ZAEC", "O-TPT"] and set(pts["backbone"]) == {"ViT-B-16"}
    assert "ViT-B-16: no runs of A-TPT (atpt); drawn without its point" in readme
    # Figure 2b pools the paper's TTA methods by default, not O-TPT; n and the methods are in the CSV
    corr = {r["backbone"]: r for r in pl.read_csv(out / "fig2b_correlation.csv").iter_rows(named=True)}
    assert corr["ViT-B-16"]["methods"] == "tpt,tda,dpe" and corr["ViT-B-16"]["n"] == 3 * 4 + 1  # + DPE on Caltech
    pts2b = pl.read_csv(out / "fig2b_entropy_vs_ece.csv")
    assert set(pts2b.filter(~pl.col("pooled"))["method"]) == {"otpt"}

    # one run per figure, and the label is that run's ECE: RN50 has seeds 1 and 2 of TDA on ImageNet-A
    per_run = pl.read_csv(out / "per_run_metrics.csv")
    rel = pl.read_csv(out / "fig5_reliability.csv").filter(pl.col("backbone") == "RN50")
    assert set(rel["seed"]) == {1} and set(pl.read_csv(out / "fig2cd_entropy_gap.csv").filter(
        pl.col("backbone") == "RN50")["seed"]) == {1}
    rn50 = per_run.filter((pl.col("backbone") == "RN50") & (pl.col("calibrator") == "none"))
    seed1 = 100 * rn50.filter(pl.col("seed") == 1)["ece"][0]
    labels = rel.filter(pl.col("panel") == "none")["ece"].to_list()
    # the same float64 ECE times 100 on both sides, through CSVs (polars writes floats to round-trip): a few eps
    pct = 4 * 100 * np.finfo(np.float64).eps
    assert len(labels) == 10 and labels == pytest.approx([seed1] * 10, rel=0, abs=pct)
    assert abs(seed1 - 100 * rn50["ece"].mean()) > 1e-3  # the seed mean would differ

    # Figure 4: zero-shot / raw / ZAEC panels of DPE on Caltech101, each with its own run's ECE
    b = pl.read_csv(out / "fig4_boundary.csv")
    assert b["panel"].unique(maintain_order=True).to_list() == ["zero-shot", "none", "zaec"]
    assert set(b["dataset"]) == {"caltech101"} and set(b["method"]) == {"dpe"}
    run = per_run.filter((pl.col("dataset") == "caltech101") & (pl.col("method") == "dpe"))
    for panel in ("zero-shot", "none", "zaec"):
        want = 100 * run.filter(pl.col("calibrator") == panel)["ece"][0]
        assert b.filter(pl.col("panel") == panel)["ece"][0] == pytest.approx(want, rel=0, abs=pct)
        assert b.filter(pl.col("panel") == panel)["count"].sum() == 70

    # temperature scaling is fitted on imagenet: those cells (and the averages holding them) are marked
    marked = pl.read_csv(out / "main_ViT-B-16.csv").filter(pl.col("in_sample"))
    assert set(marked["row"]) == {"temperature"} and set(marked["dataset"]) == {"imagenet", "avg"}
    assert set(marked["group"]) == {"fine_grained"} and "‡" in (out / "main_ViT-B-16.md").read_text()

    main = pl.read_csv(out / "main_ViT-B-16.csv")
    assert main["block"].unique(maintain_order=True).to_list() == ["zero-shot", "tpt", "tda", "dpe", "otpt"]
    assert main["group"].unique(maintain_order=True).to_list() == ["natural_shift", "fine_grained", "other"]
    ece = main.filter((pl.col("metric") == "ece") & pl.col("value").is_not_null())  # Caltech101: DPE only
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
    assert main.filter((pl.col("block") == "tda") & (pl.col("metric") == "accuracy")).height == 8  # 5 sets, 3 avgs
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
    assert "reference dataset 'imagenet_a' absent" not in readme  # imagenet_a is present for both backbones


def test_missing_inputs_are_skipped_with_notes(tmp_path, capsys):
    root = tmp_path / "shards"
    _write(root, "ViT-B-16", "fmnist", "zero-shot", 60, 10)
    out = tmp_path / "results"
    code, err = _run([root, "--out", out, "--bootstrap", "0", "--ts-source", "fmnist"], capsys)
    assert code == 0, err
    readme = (out / "README.md").read_text()
    items = _items(readme)
    assert list(items) == [i for i in PAPER_ITEMS if i != "Tables 2 and 3, intervals"] + BEYOND_ITEMS
    assert items["Risk-coverage figure"].endswith("Skipped: no TTA method runs")
    for item in ("Table 1", "Figure 1", "Figure 2a", "Figure 2b", "Figures 2c/2d", "Figure 4", "Figure 5",
                 "Figure 6"):
        assert items[item].endswith("Skipped: no TTA method runs") or "Skipped: no dpe runs" in items[item], item
    assert "bootstrap disabled" in readme
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
    # not the temperature-scaling source; each item's note names the item itself (issue 35 item 8: the
    # risk-coverage figure's note spoke of Figures 2c/2d and 5)
    absent = "tiny-vit: reference dataset 'imagenet_a' absent;"
    for says in ("Figures 2c/2d use 'fmnist_blur'", "Figure 5 uses 'fmnist_blur'",
                 "the risk-coverage figure uses 'fmnist_blur'"):
        assert f"{absent} {says}" in readme, says
    assert "Figures 2c/2d and 5 use" not in readme
    assert (out / "fig5_reliability_tiny-vit.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["does-not-exist"], "no such file or directory"),
    (["{root}", "--bins", "0"], "--bins must be a positive integer"),
    (["{root}", "--bootstrap", "-1"], "--bootstrap must be >= 0"),
    (["{root}", "--no-such-option"], "No such option: --no-such-option"),  # typer's usage errors: one line too
    (["{root}", "--fig1-methods", "tpt,,tda"], "--fig1-methods expects comma-separated method keys"),
])
def test_user_errors_end_in_one_line(tmp_path, capsys, args, message):
    root = tmp_path / "shards"
    _write(root, "ViT-B-16", "dtd", "tda", 20, 3)
    code, err = _run([a.format(root=root) for a in args] + ["--out", tmp_path / "r"], capsys)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and message in lines[0] and "Traceback" not in err
