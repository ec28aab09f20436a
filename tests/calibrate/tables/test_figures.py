"""The paper's figures as `make tables` numbers them: Figure 1 (intro bars), Figure 2a as the paper draws it (with and
without A-TPT), Figure 2b's pooled methods, the one-run reliability diagrams of Figures 4 and 5 (their ECE labels),
and the marks of the main tables. Builders against hand-computed answers; figures drawn headless from small shards."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from matplotlib.figure import Figure

from calibrate.tables import builders, figures, render
from calibrate.tables.data import summarise_arrays
from schemas.shard import RunKey

from tests.support.tables import cells as _cells
from tests.support.tables import index_items as _items
from tests.support.tables import run_tables as _run
from tests.support.tables import slow_ece
from tests.support.tables import write_run as _write

EPS64 = np.finfo(np.float64).eps
# percent ECE means over at most 3 datasets: a few float64 roundings of values <= 100
MEAN_TOL = 4 * 3 * EPS64 * 100


def _item_block(readme: str, name: str) -> str:
    """An item of the results index with its note lines."""
    return _items(readme)[name] + "".join(
        line for line in readme.split(f"- **{name}**", 1)[1].split("\n- **", 1)[0].splitlines()[1:])


def _with(cells: pl.DataFrame, **cols) -> pl.DataFrame:
    return cells.with_columns(**{k: pl.Series(v) for k, v in cols.items()})


# ---------------------------------------------------------------------------------------------------------------
# Figure 1
# ---------------------------------------------------------------------------------------------------------------


def test_intro_bars_average_each_method_over_its_datasets():
    cells = _cells([
        ("imagenet", "tpt", "none", 0.5, 0.20), ("dtd", "tpt", "none", 0.5, 0.30),
        ("eurosat", "tpt", "none", 0.5, 0.40),
        ("imagenet", "tpt", "zaec", 0.5, 0.05), ("dtd", "tpt", "zaec", 0.5, 0.07),
        ("eurosat", "tpt", "zaec", 0.5, 0.09),
        ("imagenet", "tda", "none", 0.5, 0.10), ("dtd", "tda", "none", 0.5, 0.16),  # TDA lacks eurosat
        ("imagenet_a", "tda", "none", 0.5, 0.99),  # not a dataset of the figure
    ])
    bars = builders.intro_bars(cells, "ViT-B-16", ["tpt", "tda", "dlae"], ["imagenet", "dtd", "eurosat"])
    avg = {(r["method"], r["calibrator"]): (r["ece"], r["n_datasets"])
           for r in bars.filter(pl.col("dataset") == "avg").iter_rows(named=True)}
    assert avg[("tpt", "none")] == (pytest.approx(30.0, rel=0, abs=MEAN_TOL), 3)
    assert avg[("tpt", "zaec")] == (pytest.approx(7.0, rel=0, abs=MEAN_TOL), 3)
    assert avg[("tda", "none")] == (pytest.approx(13.0, rel=0, abs=MEAN_TOL), 2)  # over its two datasets, and says so
    assert set(avg) == {("tpt", "none"), ("tpt", "zaec"), ("tda", "none")}  # no SaLS rows, no DLAE panel
    assert set(bars["group_size"]) == {3}
    assert bars.filter(pl.col("method") == "tda")["dataset"].to_list() == ["imagenet", "dtd", "avg"]


# ---------------------------------------------------------------------------------------------------------------
# Figure 2a and 2b
# ---------------------------------------------------------------------------------------------------------------


def _range_cells(rows):
    """rows: (dataset, method, calibrator, range_deviation, ece)."""
    cells = _cells([(d, m, c, 0.5, e) for d, m, c, _, e in rows])
    return _with(cells, range_deviation=[r for _, _, _, r, _ in rows])


def test_range_figure_points_average_over_the_datasets_all_points_share():
    rows = [("dtd", "tpt", "sals", 1.0, 0.20), ("eurosat", "tpt", "sals", 3.0, 0.40),
            ("dtd", "tpt", "zaec", 30.0, 0.10), ("eurosat", "tpt", "zaec", 50.0, 0.20),
            ("dtd", "tpt", "none", 90.0, 0.30), ("dtd", "otpt", "none", 60.0, 0.12)]
    pts, missing = builders.range_figure_points(_range_cells(rows), "ViT-B-16")
    assert missing == [("atpt", "none")]
    assert pts["label"].to_list() == ["TPT + SaLS", "TPT + ZAEC", "O-TPT"]
    # O-TPT has dtd only, so every point is its dtd value
    assert pts["range_deviation"].to_list() == pytest.approx([1.0, 30.0, 60.0], rel=0, abs=MEAN_TOL)
    assert pts["ece"].to_list() == pytest.approx([20.0, 10.0, 12.0], rel=0, abs=MEAN_TOL)
    assert set(pts["datasets"]) == {"dtd"}

    # A-TPT present: four points, nothing missing, still the shared datasets
    pts, missing = builders.range_figure_points(
        _range_cells(rows + [("dtd", "atpt", "none", 70.0, 0.11), ("eurosat", "otpt", "none", 80.0, 0.5)]),
        "ViT-B-16")
    assert missing == [] and pts["label"].to_list() == ["TPT + SaLS", "TPT + ZAEC", "O-TPT", "A-TPT"]
    assert pts["range_deviation"].to_list() == pytest.approx([1.0, 30.0, 60.0, 70.0], rel=0, abs=MEAN_TOL)

    # without O-TPT and A-TPT: both TPT points average over dtd and eurosat
    pts, missing = builders.range_figure_points(_range_cells(rows[:4]), "ViT-B-16")
    assert missing == [("otpt", "none"), ("atpt", "none")]
    assert pts["range_deviation"].to_list() == pytest.approx([2.0, 40.0], rel=0, abs=MEAN_TOL)
    assert pts["ece"].to_list() == pytest.approx([30.0, 15.0], rel=0, abs=MEAN_TOL)
    assert pts["n_datasets"].to_list() == [2, 2]


def test_pooled_methods_default_to_the_papers_tta_methods():
    present = ["atpt", "ctpt", "dlae", "dpe", "otpt", "tda", "tps", "tpt", "mine", "zero-shot"]
    assert builders.pooled_methods(present) == ["tpt", "tps", "tda", "dpe", "dlae", "mine"]
    assert builders.pooled_methods(present, ("otpt", "tda", "absent")) == ["tda", "otpt"]
    assert builders.pooled_methods(present, ("all",)) == ["tpt", "tps", "tda", "dpe", "dlae", "ctpt", "otpt", "atpt",
                                                          "mine"]


def test_entropy_ece_points_flag_the_pooled_methods_and_correlations_name_them():
    rows = []
    for i, d in enumerate(("dtd", "eurosat", "imagenet")):
        for m, slope in (("tda", 1.0), ("tpt", 2.0), ("otpt", -5.0)):
            rows += [(d, m, "zero-shot", 0.5, 0.05), (d, m, "none", 0.5, 0.05 + slope * 0.01 * (i + 1))]
    cells = _with(_cells(rows), mean_delta_entropy=[-0.1 * (k % 6) for k in range(len(rows))])
    pts = builders.entropy_ece_points(cells, builders.pooled_methods(["tda", "tpt", "otpt"]))
    assert dict(pts.group_by("method").agg(pl.col("pooled").all()).iter_rows()) == {
        "tda": True, "tpt": True, "otpt": False}
    corr = builders.correlations(pts.filter(pl.col("pooled"))).row(0, named=True)
    assert corr["n"] == 6 and corr["methods"] == "tpt,tda"


# ---------------------------------------------------------------------------------------------------------------
# Reliability diagrams (Figures 4 and 5): one run, its own ECE
# ---------------------------------------------------------------------------------------------------------------


def _two_seeds():
    rng = np.random.default_rng(7)
    runs = []
    for seed, sharpen in ((1, 3.0), (2, 1.2)):
        n, k = 150, 4
        labels = rng.integers(0, k, n)
        zs = rng.normal(0, 1, (n, k))
        zs[np.arange(n), labels] += 1.0
        tta = sharpen * zs + rng.normal(0, 0.3, (n, k))
        runs.append(summarise_arrays(RunKey("RN50", "caltech101", "dpe", seed), np.arange(n), labels, zs, tta, {}))
    return runs


def test_reliability_table_is_one_run_with_its_own_ece():
    s1, s2 = _two_seeds()
    t = builders.reliability_table(s1, ["zero-shot", "none"], n_bins=10, ece_bins=20)
    assert set(t["seed"]) == {1} and t["panel"].unique(maintain_order=True).to_list() == ["zero-shot", "none"]
    for panel, conf, corr in (("zero-shot", s1.zs_confidence, s1.zs_correct),
                              ("none", s1.tta_confidence, s1.tta_correct)):
        p = t.filter(pl.col("panel") == panel).sort("bin")
        own = 100 * slow_ece(conf.tolist(), corr.tolist(), 20)
        # float64 bin sums of n = 150 values <= 1 in another order, divided by n, in percent
        assert p["ece"].to_list() == pytest.approx([own] * 10, rel=0, abs=4 * 150 * EPS64 * 100)
        # bins by a slow loop (lo < c <= hi, c == 0 in the first)
        for b in range(10):
            idx = [i for i, c in enumerate(conf) if b / 10 < c <= (b + 1) / 10 or (b == 0 and c == 0)]
            assert p["count"][b] == len(idx) and p["share"][b] == len(idx) / len(s1)  # one division of integers
            if idx:  # bin means of <= 150 values in [0, 1], summed in another order
                assert p["accuracy"][b] == pytest.approx(np.mean(corr[idx]), rel=0, abs=4 * len(idx) * EPS64)
                assert p["confidence"][b] == pytest.approx(np.mean(conf[idx]), rel=0, abs=4 * len(idx) * EPS64)
    # the label is this run's ECE, not the mean over seeds (the bug: a seed mean over the lowest seed's bars)
    mean = 100 * np.mean([slow_ece(s.tta_confidence.tolist(), s.tta_correct.tolist(), 20) for s in (s1, s2)])
    assert abs(t.filter(pl.col("panel") == "none")["ece"][0] - mean) > 1.0


def test_reliability_panel_prints_the_ece_of_the_data_it_plots():
    s1, _ = _two_seeds()
    t = builders.reliability_table(s1, ["none"], n_bins=10, ece_bins=20)
    fig = Figure()
    ax, strip = fig.subplots(2, 1)
    figures._draw_reliability(ax, strip, t)
    assert [x.get_text() for x in ax.texts] == [f"ECE {t['ece'][0]:.2f}"]
    # the confidence histogram: one bar per bin in its own strip, heights the share of samples (percent)
    heights = [r.get_height() for r in strip.patches]
    assert heights == pytest.approx((100 * t.sort("bin")["share"]).to_list(), rel=4 * EPS64, abs=0)  # one product


# ---------------------------------------------------------------------------------------------------------------
# Main-table marks
# ---------------------------------------------------------------------------------------------------------------


def test_main_table_marks_in_sample_temperature_and_partial_averages():
    cells = _cells([
        ("imagenet", "tda", "zero-shot", 0.5, 0.05), ("dtd", "tda", "zero-shot", 0.5, 0.05),
        ("imagenet_a", "tda", "zero-shot", 0.5, 0.05),
        ("imagenet", "tda", "none", 0.5, 0.20), ("imagenet", "tda", "temperature", 0.5, 0.02),
        ("dtd", "tda", "none", 0.5, 0.30), ("dtd", "tda", "temperature", 0.5, 0.10),
        ("imagenet_a", "tda", "none", 0.5, 0.30), ("imagenet_a", "tda", "temperature", 0.5, 0.15),
    ])
    t = builders.main_table(cells, "ViT-B-16", ts_in_sample="imagenet")
    marked = {(r["row"], r["dataset"]) for r in t.filter(pl.col("in_sample")).iter_rows(named=True)}
    assert marked == {("temperature", "imagenet"), ("temperature", "avg")}
    assert t.filter(pl.col("in_sample") & (pl.col("dataset") == "avg"))["group"].to_list() == ["fine_grained"]
    avg = t.filter(pl.col("dataset") == "avg")
    assert dict(zip(avg["group"], avg["group_size"])) == {"natural_shift": 4, "fine_grained": 11}
    assert set(avg["n_datasets"]) == {1, 2}
    # the rendered marks follow the frame: ‡ on the in-sample cell, (n/m) on partial averages only
    row = t.filter((pl.col("row") == "temperature") & (pl.col("dataset") == "avg")
                   & (pl.col("group") == "fine_grained")).row(0, named=True)
    assert render.cell_marks(row) == "‡ (2/11)"
    full = dict(row, n_datasets=11, in_sample=False)
    assert render.cell_marks(full) == ""
    # a fixed temperature is fitted nowhere: no cell is in-sample
    assert not builders.main_table(cells, "ViT-B-16", ts_in_sample=None)["in_sample"].any()


# ---------------------------------------------------------------------------------------------------------------
# end to end: Figure 2a with A-TPT, Figure 2b with every method, Figure 4 on other options, a fixed temperature
# ---------------------------------------------------------------------------------------------------------------


def test_atpt_shards_simply_appear_in_figure_2a(tmp_path, capsys):
    root = tmp_path / "shards"
    for method in ("tpt", "otpt", "atpt", "tda"):
        for dataset in ("dtd", "eurosat"):
            _write(root, "ViT-B-16", dataset, method, 60, 5, parts=1)
    out = tmp_path / "results"
    code, err = _run([root, "--out", out, "--bootstrap", "0", "--temperature", "1.5", "--fig2b-methods", "all",
                      "--boundary-dataset", "eurosat", "--boundary-method", "tda", "--quiet"], capsys)
    assert code == 0, err
    pts = pl.read_csv(out / "fig2a_range_vs_ece.csv")
    assert pts["label"].to_list() == ["TPT + SaLS", "TPT + ZAEC", "O-TPT", "A-TPT"]
    assert set(pts["datasets"]) == {"dtd,eurosat"}
    allpts = pl.read_csv(out / "fig2a_all_points.csv")
    assert {"tda", "atpt"} <= set(allpts["method"])  # the other methods' points stay available
    readme = (out / "README.md").read_text()
    assert "Files: [fig2a_range_vs_ece.csv]" in _items(readme)["Figure 2a"]
    assert "no runs of" not in _item_block(readme, "Figure 2a")
    assert (out / "fig2a_range_vs_ece_ViT-B-16.png").stat().st_size > 1000
    # --fig2b-methods all: the prompt-coupled methods pooled too
    corr = pl.read_csv(out / "fig2b_correlation.csv").row(0, named=True)
    assert corr["methods"] == "tpt,tda,otpt,atpt" and corr["n"] == 8
    # Figure 4 on the chosen dataset and method
    b = pl.read_csv(out / "fig4_boundary.csv")
    assert set(b["dataset"]) == {"eurosat"} and set(b["method"]) == {"tda"}
    assert (out / "fig4_boundary_eurosat_ViT-B-16.png").stat().st_size > 1000
    # a fixed temperature: nothing fitted, so nothing in-sample
    assert not pl.read_csv(out / "main_ViT-B-16.csv")["in_sample"].any()


def test_figure_5_columns_are_the_papers_methods_unless_chosen(tmp_path, capsys):
    """Figure 5 shows TPT, TDA and DPE (the paper's columns) of the reference dataset; an absent one is noted;
    `--fig5-methods` chooses others, `all` every TTA method; none present: skipped with the reason."""
    root = tmp_path / "shards"
    for method in ("tpt", "tda", "otpt", "tps"):
        _write(root, "ViT-B-16", "imagenet_a", method, 60, 5, parts=1)
    base = ["--bootstrap", "0", "--temperature", "1.5", "--quiet"]

    def fig5(*extra):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        code, err = _run([root, "--out", out, *base, *extra], capsys)
        assert code == 0, err
        item = _item_block((out / "README.md").read_text(), "Figure 5")
        csv = out / "fig5_reliability.csv"
        return (pl.read_csv(csv)["method"].unique(maintain_order=True).to_list() if csv.exists() else None), item

    methods, item = fig5()
    assert methods == ["tpt", "tda"] and "no runs of DPE (dpe) on imagenet_a" in item
    methods, _ = fig5("--fig5-methods", "tps,otpt")
    assert methods == ["tps", "otpt"]
    methods, _ = fig5("--fig5-methods", "all")
    assert methods == ["tpt", "tps", "tda", "otpt"]  # the paper's method order
    methods, item = fig5("--fig5-methods", "dlae")
    assert methods is None and "--fig5-methods" in item


def test_ts_source_among_the_tabulated_datasets_is_marked_everywhere(tmp_path, capsys, monkeypatch):
    """--ts-source imagenet_a, a natural-shift set: Figure 3's Temp. Scal. average holds in-sample scores, so its
    legend, CSV and index say so; the main table never bolds an in-sample cell; the differences against it and the
    per-run metrics carry the mark."""
    root = tmp_path / "shards"
    for method in ("tda", "dpe"):
        for dataset in ("imagenet_a", "imagenet_r"):
            _write(root, "ViT-B-16", dataset, method, 60, 5, parts=1)
    legends: list[str] = []
    save = figures.save

    def spy(fig, path, dpi=130):
        if "fig3" in str(path):
            legends.extend(t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts())
        return save(fig, path, dpi)

    monkeypatch.setattr(figures, "save", spy)
    out = tmp_path / "results"
    code, err = _run([root, "--out", out, "--bootstrap", "20", "--ts-source", "imagenet_a", "--quiet"], capsys)
    assert code == 0, err
    fig3 = pl.read_csv(out / "fig3_summary.csv")
    assert fig3.filter(pl.col("in_sample"))["calibrator"].unique().to_list() == ["temperature"]
    assert fig3.filter(pl.col("calibrator") == "temperature")["in_sample"].all()
    assert "Temp. Scal. ‡ (in-sample)" in legends and "ZAEC" in legends
    block = _item_block((out / "README.md").read_text(), "Figure 3")
    assert "Temp. Scal. bars (‡) average over imagenet_a" in block
    main = pl.read_csv(out / "main_ViT-B-16.csv")
    assert main.filter(pl.col("in_sample")).height and not main.filter(pl.col("in_sample") & pl.col("bold")).height
    assert "Neither is ever bold" in (out / "main_ViT-B-16.md").read_text()
    assert "‡ against temperature scaling" in (out / "main_ViT-B-16_ci.md").read_text()
    per_run = pl.read_csv(out / "per_run_metrics.csv").filter(pl.col("in_sample"))
    assert set(zip(per_run["dataset"], per_run["calibrator"])) == {("imagenet_a", "temperature")}
    assert per_run.height == 2  # TDA and DPE


def test_figure_6_legend_names_every_method_drawn_in_any_panel(tmp_path, monkeypatch):
    """A method with runs only on the second panel's dataset used to be drawn without a legend entry (the legend was
    the first panel's); and a partial run's method carries § in it."""
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, path, dpi=130: drawn.setdefault("fig", fig))
    st = pl.DataFrame({"backbone": "RN50", "dataset": ["dtd"] * 2 + ["imagenet_v2"] * 4,
                       "method": ["tda", "tda", "tda", "tda", "mta", "mta"], "strength": [0.0, 1.0] * 3,
                       "calibrator": ["none", "zaec"] * 3, "ece": [5.0, 2.0, 6.0, 3.0, 7.0, 4.0],
                       "partial": [None, None, None, None, "10 of 20", "10 of 20"]})
    figures.plot_strength(st, ["dtd", "imagenet_v2"], tmp_path / "f.png", "t")
    fig = drawn["fig"]
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["TDA", "MTA§"]
    assert "MTA I-V 10 of 20" in fig._suptitle.get_text()
