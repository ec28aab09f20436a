"""The demo's summary (tools/demo/run.py: `summarise`, `summary_markdown`) on hand-made metrics tables (the demo
end to end is tests/tools/test_demo.py)."""

from __future__ import annotations

import polars as pl
import pytest

from tools.demo.run import CALIBRATORS, summarise, summary_markdown


def _metrics(rows):
    """rows: (backbone, dataset, method, {calibrator: (accuracy, ece)})."""
    out = []
    for backbone, dataset, method, cals in rows:
        for cal, (acc, ece) in cals.items():
            out.append({"backbone": backbone, "dataset": dataset, "method": method, "seed": 1, "calibrator": cal,
                        "n": 100, "accuracy": acc, "ece": ece})
    return pl.DataFrame(out)


def _paper_like():
    rows = []
    for backbone in ("fmnist-ViT", "fmnist-RN"):
        for ds in ("fmnist", "fmnist_blur", "fmnist_noise"):
            rows.append((backbone, ds, "zero-shot", {"zero-shot": (0.5, 0.05), "none": (0.5, 0.05),
                                                    "temperature": (0.5, 0.04), "sals": (0.5, 0.05),
                                                    "zaec": (0.5, 0.05)}))
            for method in ("tda", "dpe"):
                rows.append((backbone, ds, method, {"zero-shot": (0.5, 0.05), "none": (0.55, 0.15),
                                                   "temperature": (0.55, 0.10), "sals": (0.55, 0.08),
                                                   "zaec": (0.55, 0.06)}))
    return _metrics(rows)


def test_summary_paper_claims_hold():
    s = summarise(_paper_like())
    assert s.shifted_sets == ("fmnist_blur", "fmnist_noise")
    assert s.table.height == 4 and set(s.table["method"]) == {"tda", "dpe"}  # zero-shot method excluded
    row = s.table.filter((pl.col("backbone") == "fmnist-ViT") & (pl.col("method") == "tda")).row(0, named=True)
    assert row["n_sets"] == 2 and row["zs_accuracy"] == pytest.approx(0.5) and row["accuracy"] == pytest.approx(0.55)
    assert row["ece_none"] == pytest.approx(0.15) and row["ece_zaec"] == pytest.approx(0.06)
    for key in ("tta_accuracy", "tta_ece", "zaec_vs_none", "zaec_vs_sals", "zaec_vs_temperature", "zaec_best",
                "accuracy_preserved"):
        assert s.finding(key).holds is True, s.finding(key).text
    assert "4 of 4" in s.finding("tta_ece").text and "15.0%" in s.finding("tta_ece").text
    md = summary_markdown(s)
    assert "not OpenAI CLIP" in md and "| fmnist-ViT | tda |" in md
    # accuracy under ZAEC is a property, not something this run measured: said so, not marked "yes"
    assert "- **by construction**: By construction, not measured" in md and "**yes**: By construction" not in md


def test_summary_reports_where_claims_fail():
    df = _paper_like()
    # ZAEC worse than SaLS everywhere, and TTA lowers ECE on the shifted sets
    df = df.with_columns(
        pl.when(pl.col("calibrator") == "zaec").then(0.09).otherwise(pl.col("ece")).alias("ece"))
    df = df.with_columns(
        pl.when((pl.col("calibrator") == "none") & (pl.col("method") != "zero-shot")).then(0.01)
        .otherwise(pl.col("ece")).alias("ece"))
    s = summarise(df)
    assert s.finding("tta_ece").holds is False and "does not raise" in s.finding("tta_ece").text
    assert s.finding("zaec_vs_sals").holds is False and "does not beat SaLS" in s.finding("zaec_vs_sals").text
    assert s.finding("zaec_vs_none").holds is False
    assert s.finding("zaec_best").holds is False


def test_summary_accuracy_change_detected_and_missing_calibrator():
    df = _paper_like().filter(pl.col("calibrator") != "temperature")
    df = df.with_columns(
        pl.when((pl.col("calibrator") == "zaec") & (pl.col("dataset") == "fmnist"))
        .then(pl.col("accuracy") + 0.01).otherwise(pl.col("accuracy")).alias("accuracy"))
    s = summarise(df)
    acc = s.finding("accuracy_preserved")
    assert acc.holds is False and not acc.measured
    assert "differs in 4 of 12 runs (up to 1.00 points)" in acc.text and "inconsistent" in acc.text
    assert s.finding("zaec_vs_temperature").holds is None and "missing" in s.finding("zaec_vs_temperature").text
    assert "ece_temperature" not in s.table.columns


def test_summary_without_tta_runs_is_undecided():
    df = _paper_like().filter(pl.col("method") == "zero-shot")
    s = summarise(df)
    assert s.table.height == 0
    assert all(f.holds is None for f in s.findings)


def test_summary_rejects_foreign_table():
    with pytest.raises(ValueError, match="lacks column"):
        summarise(pl.DataFrame({"a": [1]}))


def test_calibrators_match_zaec_calibrate_names():
    from calibrate.calibrators import parse_calibrators

    parse_calibrators(",".join(CALIBRATORS))  # every name the demo asks for is a valid calibrator spec


def test_demo_method_selection():
    from tools.demo.run import DEMO_METHODS, _resolve_methods
    from extract.methods import REGISTRY

    assert _resolve_methods(None) == DEMO_METHODS and set(DEMO_METHODS) <= set(REGISTRY)
    every = _resolve_methods(["all"])
    assert set(every) == set(REGISTRY) and every[0] == "zero-shot"  # zero-shot first: it fills the view-0 cache
    assert _resolve_methods(["tda", "zero-shot", "tda"]) == ("zero-shot", "tda")


def _with_selective(df, aurc, auroc):
    """Add aurc_msp/auroc_msp columns: {calibrator: value} for the TTA methods' rows, 0.3/0.7 elsewhere."""
    def col(values, other):
        expr = pl.lit(other)
        for cal, v in values.items():
            expr = pl.when((pl.col("calibrator") == cal) & (pl.col("method") != "zero-shot")).then(v).otherwise(expr)
        return expr
    return df.with_columns(col(aurc, 0.3).alias("aurc_msp"), col(auroc, 0.7).alias("auroc_msp"))


def test_selective_sentence_helps_hurts_and_undecided():
    from tools.demo.run import selective_sentence

    helps = selective_sentence(_with_selective(_paper_like(), {"none": 0.30, "zaec": 0.25},
                                               {"none": 0.70, "zaec": 0.75}))
    assert "ZAEC helps" in helps and "AURC 30.0% raw -> 25.0% with ZAEC" in helps
    assert "lower in 4 of 4 pairs" in helps and "AUROC 70.0% -> 75.0%" in helps and "higher in 4 of 4" in helps
    hurts = selective_sentence(_with_selective(_paper_like(), {"none": 0.25, "zaec": 0.30},
                                               {"none": 0.75, "zaec": 0.70}))
    assert "ZAEC hurts" in hurts and "lower in 0 of 4 pairs" in hurts
    mixed = selective_sentence(_with_selective(_paper_like(), {"none": 0.30, "zaec": 0.25},
                                               {"none": 0.75, "zaec": 0.70}))
    assert "ZAEC's effect on deciding which predictions to trust is mixed" in mixed
    same = selective_sentence(_with_selective(_paper_like(), {"none": 0.30, "zaec": 0.30},
                                              {"none": 0.70, "zaec": 0.70}))
    assert "neither clearly helps nor hurts" in same
    assert "undecided" in selective_sentence(_paper_like()) and "aurc_msp" in selective_sentence(_paper_like())
    # AUROC undefined (NaN: no misclassified sample) everywhere: undecided, never a made-up number
    nan = selective_sentence(_with_selective(_paper_like(), {"none": 0.0, "zaec": 0.0},
                                             {"none": float("nan"), "zaec": float("nan")}))
    assert "undecided" in nan and "misclassified" in nan
    # the summary carries the sentence next to the paper's findings, which are unchanged
    s = summarise(_with_selective(_paper_like(), {"none": 0.30, "zaec": 0.25}, {"none": 0.70, "zaec": 0.75}))
    assert s.selective == helps and [f.key for f in s.findings][-1] == "accuracy_preserved"
    assert summary_markdown(s).rstrip().endswith(helps)


def test_extraction_skips_a_method_the_model_cannot_run_by_its_declaration(tmp_path, tiny_rn_model_dir,
                                                                          monkeypatch):
    """The demo asks the method's `towers` (`backbone_refusal`, what `zaec-extract` refuses) before a run: TTL on a
    ResNet is one note line and a "skipped" entry, and no run is started."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    import extract.models
    import extract.runner
    from extract.run.options import RunOptions, backbone_refusal
    from tools.demo import run as demo_run
    from tools.demo.run import DemoConfig

    monkeypatch.setattr(extract.models, "load_model", lambda *a, **k: object())
    monkeypatch.setattr(extract.runner, "run_extraction", lambda *a, **k: pytest.fail("a run was started"))
    cfg = DemoConfig(data_root=tmp_path / "data", work_dir=tmp_path / "work", progress=False)
    notes: list[str] = []
    out = io.StringIO()
    demo_run._extract(cfg, [SimpleNamespace(name="fmnist-RN")], {"fmnist-RN": tiny_rn_model_dir}, ["dtd"], ["ttl"],
                      Console(file=out, width=400, color_system=None), notes)
    why = backbone_refusal(RunOptions.make("ttl", "dtd", backbone=None, pretrained=f"local-dir:{tiny_rn_model_dir}"))
    assert why is not None and notes == [f"ttl skipped on fmnist-RN: {why}"]
    assert "accuracy: ttl skipped" in out.getvalue() and f"note: ttl skipped on fmnist-RN: {why}" in out.getvalue()
