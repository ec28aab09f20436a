"""Partial runs (`--allow-partial`) are marked, with their n, in every table and figure of `make tables` (issue 32
item 11): the frames carry `partial` (`150 of 400`), the rendered cells carry §, footnotes and figure titles list
each partial run and its n."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from calibrate.tables import builders, figures, render, report, trust_tables
from calibrate.tables.data import load_summaries
from schemas.shard import ShardMeta, shard_path, write_shard

K = 4


def _run(root, dataset, method, n_rows, n_total, limit=None):
    rng = np.random.default_rng([n_total, sum(map(ord, dataset))])  # the same samples per dataset
    labels = rng.integers(0, K, n_total)
    zs = rng.normal(0, 1, (n_total, K))
    zs[np.arange(n_total), labels] += 1.5
    tta = 2.5 * zs + np.random.default_rng(sum(map(ord, method))).normal(0, 0.5, (n_total, K))
    extra = {"zaec:n_total": str(n_total), "zaec:limit": str(limit) if limit else "none"}
    meta = ShardMeta("ViT-B-16", "openai", dataset, method, 1, tuple(f"c{i}" for i in range(K)), extra=extra)
    sl = np.arange(n_rows)
    write_shard(shard_path(root, meta.key, 0), meta, sl, labels[sl], zs[sl].astype(np.float32),
                tta[sl].astype(np.float32), stream_pos=sl)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    for ds in ("imagenet_a", "imagenet_v2", "dtd"):
        for m in ("zero-shot", "tda"):
            _run(root / "s", ds, m, 80, 80)
    _run(root / "s", "imagenet_a", "dpe", 30, 80, limit=30)  # a --limit 30 run of an 80-sample set
    _run(root / "s", "imagenet_v2", "dpe", 80, 80)
    s = load_summaries([root / "s"], report.ALL_SPECS, ts_source=None, allow_partial=True)
    return s, root / "o"


def test_summaries_runs_and_cells_carry_the_partial_count(out):
    s, _ = out
    partial = {str(k): r.partial for k, r in s.runs.items() if r.partial}
    assert partial == {"ViT-B-16/imagenet_a/dpe/seed=1": "30 of 80"}
    cells = builders.cell_metrics(builders.run_metrics(s.runs.values()))
    got = cells.filter(pl.col("partial").is_not_null()).select("dataset", "method").unique().rows()
    assert got == [("imagenet_a", "dpe")]


def test_every_table_marks_the_partial_run(out):
    s, o = out
    report.write_report(s, o, None, report.ReportOptions(ts_source=None, fig5_methods=("all",)))
    cells = builders.cell_metrics(builders.run_metrics(s.runs.values()))
    main = builders.main_table(cells, "ViT-B-16")
    marked = main.filter(pl.col("partial").is_not_null())
    assert set(marked["block"]) == {"dpe"}
    assert set(marked.filter(pl.col("dataset") != "avg")["dataset"]) == {"imagenet_a"}
    assert marked.filter(pl.col("dataset") == "avg")["partial"].unique().to_list() == ["I-A 30 of 80"]
    assert main.filter((pl.col("block") == "tda") & pl.col("partial").is_not_null()).height == 0
    md = (o / "main_ViT-B-16.md").read_text()
    assert "DPE on I-A: 30 of 80 samples" in md and "§" in md
    trust = trust_tables.trust_table(trust_tables.trust_cells(list(s.runs.values())), "ViT-B-16")
    assert set(trust.filter(pl.col("partial").is_not_null())["block"]) == {"dpe"}
    for name in ("trust_ViT-B-16.md", "table1_pa_pd.md", "main_ViT-B-16.tex", "trust_ViT-B-16.tex"):
        text = (o / name).read_text()
        assert ("§" in text or r"\S{}" in text) and "30 of 80" in text, name


def test_every_figure_frame_and_title_names_the_partial_run(out):
    s, o = out
    report.write_report(s, o, None, report.ReportOptions(ts_source=None, fig5_methods=("all",)))
    for csv in ("fig2b_entropy_vs_ece.csv", "fig2cd_entropy_gap.csv", "fig3_summary.csv", "fig5_reliability.csv",
                "fig6_strength.csv", "risk_coverage.csv"):
        df = pl.read_csv(o / csv, infer_schema_length=None)
        assert figures.partial_runs(df) == {"dpe": "I-A 30 of 80"}, csv
        assert figures.method_name("dpe", figures.partial_runs(df)) == "DPE§"
    assert figures.partial_runs(pl.read_csv(o / "fig1_intro.csv")) == {}  # Figure 1 draws TPT, TDA: none partial
    assert figures.method_name("tda", {"dpe": "x"}) == "TDA"


def test_console_and_metrics_csv_mark_it_too(tmp_path, capsys):
    from calibrate.cli import main

    _run(tmp_path / "s", "dtd", "tda", 30, 80, limit=30)
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "s"), "--out", str(tmp_path / "o"), "--allow-partial", "--calibrators", "none"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None)
    assert "30 of 80, partial" in out
    m = pl.read_csv(tmp_path / "o" / "metrics.csv")
    assert m["partial"].to_list() == [True, True] and m["n_ood"].null_count() == 2
    assert render.PARTIAL_MARK == "§"
