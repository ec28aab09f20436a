"""`calibrate.tables.report`: `write_report` runs exactly the builders registered in `BUILDERS`, in their order, and
the index lists what they return (files, skip reasons, captions, notes)."""

from __future__ import annotations

import re

import polars as pl
import pytest

from calibrate.synthetic import write_synthetic_run
from calibrate.tables import report
from calibrate.tables.data import load_summaries
from calibrate.tables.render import write_csv


@pytest.fixture(scope="module")
def summaries(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_synthetic_run(root, "dtd", 60, 5, method="tda")
    return load_summaries([root], report.ALL_SPECS, ts_source=None)


def _index_items(readme: str) -> list[str]:
    return re.findall(r"^- \*\*(.+?)\*\*: ", readme, re.M)


def dummy_figure(ctx: report.Context) -> report.Item:
    """A new item the way a new figure is added: a function of the context that writes its files."""
    df = ctx.run_df.group_by("calibrator").agg(pl.col("ece").mean()).sort("calibrator")
    return report.written("Figure 7", "mean ECE per calibrator", [write_csv(df, ctx.out / "fig7_dummy.csv")],
                          ["a note of the dummy"], caption="The dummy's caption.")


def test_a_registered_builder_adds_its_item_last(summaries, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "BUILDERS", [*report.BUILDERS, dummy_figure])
    rep = report.write_report(summaries, tmp_path, None, report.ReportOptions(ts_source=None))
    readme = (tmp_path / "README.md").read_text()
    items = _index_items(readme)
    # the paper's items keep their order (no bootstrap: no intervals item), the new one comes after them
    assert items == ["Figure 1", "Table 1", "Figure 2a", "Figure 2b", "Figures 2c/2d", "Figure 3", "Tables 2 and 3",
                     "Figure 4", "Figure 5", "Table 4", "Figure 6", "Per-run metrics",
                     "Selective prediction and classwise calibration", "Risk-coverage figure",
                     "Out-of-distribution detection", "Figure 7"]
    assert "- **Figure 7**: mean ECE per calibrator. Files: [fig7_dummy.csv](fig7_dummy.csv)" in readme
    assert "\n  The dummy's caption." in readme and "  - note: a note of the dummy" in readme
    assert rep.items[-1].name == "Figure 7" and "Figure 7: a note of the dummy" in rep.notes
    written = pl.read_csv(tmp_path / "fig7_dummy.csv")
    per_run = pl.read_csv(tmp_path / "per_run_metrics.csv")
    assert sorted(written["calibrator"]) == sorted(per_run["calibrator"].unique())


def test_write_report_runs_only_the_registry(summaries, tmp_path, monkeypatch):
    """With the registry holding one builder (and one that returns None: no entry), nothing else is written."""
    seen = []

    def no_entry(ctx: report.Context) -> None:
        seen.append(ctx.out)
        return None

    monkeypatch.setattr(report, "BUILDERS", [no_entry, dummy_figure])
    rep = report.write_report(summaries, tmp_path, None, report.ReportOptions(ts_source=None))
    assert seen == [tmp_path]
    assert [it.name for it in rep.items] == ["Figure 7"]
    assert {p.name for p in tmp_path.iterdir()} == {"README.md", "fig7_dummy.csv"}
    assert _index_items((tmp_path / "README.md").read_text()) == ["Figure 7"]


def test_a_skipped_item_is_listed_with_its_reason(summaries, tmp_path, monkeypatch):
    def skip(ctx: report.Context) -> report.Item:
        return report.skipped("Figure 8", "never drawn", "no inputs")

    monkeypatch.setattr(report, "BUILDERS", [skip])
    rep = report.write_report(summaries, tmp_path, None, report.ReportOptions(ts_source=None))
    assert "- **Figure 8**: never drawn. Skipped: no inputs" in (tmp_path / "README.md").read_text()
    assert rep.outputs == [] and "Figure 8 skipped: no inputs" in rep.notes


def test_figure_3_names_the_methods_it_leaves_out_and_why(tmp_path):
    """Issue 32 item 8: Figure 3 averages every bar over the same datasets, so a method without a run on one of them
    is left out; the index's notes name it (display name) with the datasets it lacks."""
    from tests.support.tables import write_run

    for ds in ("imagenet_a", "imagenet_v2"):
        for m in ("zero-shot", "tda"):
            write_run(tmp_path / "s", "ViT-B-16", ds, m, 40, 4)
    write_run(tmp_path / "s", "ViT-B-16", "imagenet_a", "onzeta", 40, 4)
    write_run(tmp_path / "s", "ViT-B-16", "imagenet_v2", "dmn-weak", 40, 4)
    s = load_summaries([tmp_path / "s"], report.ALL_SPECS, ts_source=None)
    ctx = report.prepare(s, tmp_path / "o", None, report.ReportOptions(ts_source=None))
    item = report.figure_3(ctx)
    drawn = pl.read_csv(tmp_path / "o" / "fig3_summary.csv")
    assert drawn["method"].unique().to_list() == ["tda"]
    assert item.notes == ["ViT-B-16: 2 of 3 method(s) left out, each without runs on a dataset the bars average "
                          "(imagenet_a, imagenet_v2): DMN-weak (no imagenet_a); OnZeta (no imagenet_v2)"]
    from calibrate.tables import builders

    sm = builders.backbone_summary(ctx.cells, "ViT-B-16", ["imagenet_a", "imagenet_v2"])
    gone = builders.summary_left_out(ctx.cells, "ViT-B-16", ["imagenet_a", "imagenet_v2"], sm)
    assert gone.select("method", "missing").rows() == [("dmn-weak", "imagenet_a"), ("onzeta", "imagenet_v2")]
    report.write_report(s, tmp_path / "o", None, report.ReportOptions(ts_source=None))
    assert "OnZeta (no imagenet_v2)" in (tmp_path / "o" / "README.md").read_text()
