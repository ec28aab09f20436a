"""The embedded demo, end to end: train, write the sets, extract, calibrate, tabulate, summarise.

Everything here is the project's ordinary pipeline on a small scale: the two models are small CLIP-architecture
models trained by this project on Fashion-MNIST (not OpenAI CLIP), loaded by the extraction stage through
``local-dir:`` exactly as real weights; the sets are registered datasets read by the generic loader; every
registered TTA method runs through ``extract.runner.run_extraction``; ``calibrate.run.calibrate_paths`` is what
``zaec-calibrate`` runs, and the tables come from ``zaec-calibrate tables`` itself.

Every step skips finished work (trained models, written sets, finished extraction runs, calibration and tables whose
inputs did not change), so a second run only prints the summary again.

The summary (`summarise`) is a pure function of the metrics table, so tests check it on hand-made tables.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import polars as pl

from tools.demo import ood as ood_mod  # [OOD pair]
from tools.demo.verdict import raw_vs_zaec
from tools.demo import shifts as shifts_mod
from tools.demo import train as train_mod
from tools.demo.fmnist import check_dir

#: the method key of plain zero-shot prediction (its adapted logits are the zero-shot logits: nothing to calibrate)
ZERO_SHOT_METHOD = "zero-shot"
#: the calibrator name under which zaec-calibrate reports the paired zero-shot logits
ZERO_SHOT_ROW = "zero-shot"
#: post-hoc calibrators compared in the summary, as zaec-calibrate names them
CALIBRATORS = ("none", "temperature", "sals", "zaec")
#: the clean set: temperature scaling's labelled source, left out of the shift findings
SOURCE_DATASET = "fmnist"
#: the set of the reliability-diagram and entropy-gap figures (the paper uses ImageNet-A, its hardest shift)
REFERENCE_DATASET = "fmnist_blur"

#: the demo's plain-language summary, next to the tables (`zaec-calibrate tables` writes its own summary.md there)
SUMMARY_FILE = "demo_summary.md"

NOTE = ("small CLIP-architecture models trained by this project on Fashion-MNIST (stand-ins for ViT-B-16 and RN50); "
        "not OpenAI CLIP")


@dataclass(frozen=True)
class DemoConfig:
    """Where the demo reads and writes, and how large it is.

    Defaults give the full demo, sized for a first run within 10 minutes on 2 idle CPU cores (see the README).
    """

    fmnist_dir: Path = Path("data/fashion-mnist")
    data_root: Path = Path("data/datasets")  # the sets: <data_root>/fashion-mnist/<set>/
    models_dir: Path = Path("data/models")  # the trained models: <models_dir>/<name>/ (local-dir format)
    work_dir: Path = Path("data/demo")  # shards/, cache/ and calibrate/ (metrics.parquet/csv)
    results: Path = Path("results/demo")  # tables, figures and demo_summary.md
    n_images: int | None = 400  # first N of the 10,000 test images in every set (None: all)
    sets: tuple[str, ...] = tuple(shifts_mod.SHIFTS)  # "clean" must be among them (temperature scaling's source)
    methods: tuple[str, ...] | None = None  # None: DEMO_METHODS; ("all",): every method in extract.methods.REGISTRY
    seed: int = 1  # stream order and augmented views (the runner's default)
    train_budget: float = 1.0  # scales the training images of both models (tests use a tiny budget)
    train_seed: int = 0
    bootstrap: int = 200  # paired bootstrap resamples of the tables' intervals
    device: str = "cpu"
    threads: int | None = None  # torch CPU threads (None: all cores)
    workers: int = 2  # view-generating processes of the encoding pass (overlap with encoding: ~25% faster on 2 cores)
    progress: bool = True

    @property
    def shards(self) -> Path:
        return self.work_dir / "shards"

    @property
    def cache(self) -> Path:
        return self.work_dir / "cache"

    @property
    def metrics_dir(self) -> Path:
        return self.work_dir / "calibrate"


@dataclass
class DemoResult:
    """What a demo run produced: the metrics table, its summary, where things are, and how long each step took."""

    metrics: pl.DataFrame
    summary: "DemoSummary"
    outputs: dict[str, Path]
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Finding:
    """One claim of the paper checked on the demo's numbers: ``holds`` is True, False, or None (cannot tell).

    ``measured`` is False for a property that holds by construction (the table can only confirm it, or reveal a
    bug); the summary says so instead of presenting it as something this run found.
    """

    key: str
    holds: bool | None
    text: str
    measured: bool = True


@dataclass(frozen=True)
class DemoSummary:
    """The per-(backbone, method) table the findings are computed from, and the findings in plain language.

    ``table`` columns: backbone, method, n_sets, zs_accuracy, accuracy, zs_ece, then ``ece_<calibrator>`` for
    every calibrator present: macro-averages over the shifted sets (fractions).
    """

    table: pl.DataFrame
    findings: tuple[Finding, ...]
    shifted_sets: tuple[str, ...]
    #: beyond the paper: whether ZAEC helps or hurts selective prediction here (`selective_sentence`)
    selective: str = ""

    def finding(self, key: str) -> Finding:
        for f in self.findings:
            if f.key == key:
                return f
        raise KeyError(f"no finding {key!r}; available: {', '.join(f.key for f in self.findings)}")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _count(mask: Sequence[bool]) -> str:
    mask = list(mask)
    return f"{sum(mask)} of {len(mask)}"


def summarise(
    metrics: pl.DataFrame,
    *,
    source: str = SOURCE_DATASET,
    anchor_method: str = ZERO_SHOT_METHOD,
) -> DemoSummary:
    """Check the paper's claims on a metrics table from ``zaec-calibrate``.

    The claims are checked on the shifted sets only (every dataset but ``source``, which is temperature scaling's
    labelled source), over the TTA methods (every method but ``anchor_method``), per (backbone, method) on
    macro-averages over the sets, as the paper reports them:

    * ``tta_accuracy``: adaptation raises accuracy over zero-shot;
    * ``tta_ece``: adaptation raises ECE over zero-shot (degrades calibration);
    * ``zaec_vs_none``: ZAEC lowers ECE relative to the uncalibrated adapted logits;
    * ``zaec_vs_sals`` / ``zaec_vs_temperature``: ZAEC's ECE is below SaLS's / temperature scaling's;
    * ``zaec_best``: ZAEC has the lowest ECE of the post-hoc options (none, temperature, SaLS, ZAEC);
    * ``accuracy_preserved``: not a measurement but a property (``measured=False``): a temperature T > 0 never
      moves the arg-max, and ``zaec-calibrate`` scores every calibrator on the adapted logits' arg-max; the table
      is only checked for consistency with it (all sets included).

    Args:
        metrics: rows (backbone, dataset, method, seed, calibrator, accuracy, ece, ...) as written by
            ``zaec-calibrate``, including the ``calibrator == "zero-shot"`` rows of the paired zero-shot logits.
        source: the dataset left out of the shift findings.
        anchor_method: the method whose adapted logits are the zero-shot logits.

    Returns:
        The per-(backbone, method) table and the findings; a claim that the table cannot decide (no TTA runs, a
        calibrator missing) has ``holds=None`` and says why.
    """
    wide, runs, table, shifted_sets = _shifted_table(metrics, source=source, anchor_method=anchor_method)
    findings = _shift_findings(table, shifted_sets, source=source, anchor_method=anchor_method)
    findings.append(_accuracy_preserved(wide, runs))
    return DemoSummary(table=table, findings=tuple(findings), shifted_sets=shifted_sets,
                       selective=selective_sentence(metrics, source=source, anchor_method=anchor_method))


def _shifted_table(
    metrics: pl.DataFrame, *, source: str, anchor_method: str
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, tuple[str, ...]]:
    """The metrics table pivoted wide, its TTA runs, their per-(backbone, method) macro-averages over the shifted
    sets (`DemoSummary.table`) and the shifted sets' names."""
    needed = {"backbone", "dataset", "method", "seed", "calibrator", "accuracy", "ece"}
    missing = needed - set(metrics.columns)
    if missing:
        raise ValueError(f"metrics table lacks column(s) {', '.join(sorted(missing))}; "
                         "expected zaec-calibrate's metrics.parquet")
    keys = ["backbone", "dataset", "method", "seed"]
    wide = metrics.pivot(on="calibrator", index=keys, values=["accuracy", "ece"], aggregate_function="first")
    present = [c for c in (ZERO_SHOT_ROW, *CALIBRATORS) if f"ece_{c}" in wide.columns]
    runs = wide.filter(pl.col("method") != anchor_method)
    shifted = runs.filter(pl.col("dataset") != source)
    shifted_sets = tuple(sorted(shifted["dataset"].unique().to_list()))

    aggs = [pl.col("dataset").n_unique().alias("n_sets")]
    if ZERO_SHOT_ROW in present:
        aggs += [pl.col(f"accuracy_{ZERO_SHOT_ROW}").mean().alias("zs_accuracy"),
                 pl.col(f"ece_{ZERO_SHOT_ROW}").mean().alias("zs_ece")]
    if "none" in present:
        aggs.append(pl.col("accuracy_none").mean().alias("accuracy"))
    aggs += [pl.col(f"ece_{c}").mean().alias(f"ece_{c}") for c in CALIBRATORS if c in present]
    table = (shifted.group_by(["backbone", "method"], maintain_order=True).agg(aggs).sort(["backbone", "method"])
             if shifted.height else pl.DataFrame())
    return wide, runs, table, shifted_sets


#: the findings decided on the shifted sets' table, in the order the summary lists them
_SHIFT_FINDINGS = ("tta_accuracy", "tta_ece", "zaec_vs_none", "zaec_vs_sals", "zaec_vs_temperature", "zaec_best")
#: how the summary names the baselines ZAEC is compared with one by one
_BASELINES = (("sals", "SaLS"), ("temperature", "temperature scaling (fitted on the clean set)"))


def _shift_findings(table: pl.DataFrame, shifted_sets: tuple[str, ...], *, source: str,
                    anchor_method: str) -> list[Finding]:
    """The paper's claims checked on the per-(backbone, method) table, in `_SHIFT_FINDINGS` order."""
    n_pairs = table.height
    if not n_pairs:
        why = f"no TTA runs on shifted sets in the table (only {source!r} or {anchor_method!r})"
        return [Finding(key, None, why) for key in _SHIFT_FINDINGS]
    where = (f"macro-averaged over the {len(shifted_sets)} shifted set(s), for {n_pairs} (backbone, TTA method) "
             f"pair(s)")
    return [_tta_accuracy(table, where), _tta_ece(table), _zaec_vs_none(table),
            *(_zaec_vs(table, other, label) for other, label in _BASELINES), _zaec_best(table)]


def _tta_accuracy(table: pl.DataFrame, where: str) -> Finding:
    if not {"zs_accuracy", "accuracy"} <= set(table.columns):
        return Finding("tta_accuracy", None, "the zero-shot or uncalibrated rows are missing")
    up = (table["accuracy"] > table["zs_accuracy"]).to_list()
    diff = float((table["accuracy"] - table["zs_accuracy"]).mean())
    holds = sum(up) > table.height / 2
    return Finding("tta_accuracy", holds, (
        f"Adaptation {'raises' if holds else 'does not raise'} accuracy over zero-shot here: higher in "
        f"{_count(up)} pairs, {diff * 100:+.1f} points on average ({where})."))


def _tta_ece(table: pl.DataFrame) -> Finding:
    if not {"zs_ece", "ece_none"} <= set(table.columns):
        return Finding("tta_ece", None, "the zero-shot or uncalibrated rows are missing")
    up = (table["ece_none"] > table["zs_ece"]).to_list()
    holds = sum(up) > table.height / 2
    return Finding("tta_ece", holds, (
        f"Adaptation {'raises' if holds else 'does not raise'} ECE over zero-shot here (the paper says it "
        f"does): higher in {_count(up)} pairs; mean ECE {_pct(float(table['zs_ece'].mean()))} zero-shot -> "
        f"{_pct(float(table['ece_none'].mean()))} adapted."))


def _zaec_vs_none(table: pl.DataFrame) -> Finding:
    if not {"ece_zaec", "ece_none"} <= set(table.columns):
        return Finding("zaec_vs_none", None, "the zaec or none rows are missing")
    down = (table["ece_zaec"] < table["ece_none"]).to_list()
    holds = sum(down) > table.height / 2
    return Finding("zaec_vs_none", holds, (
        f"ZAEC {'lowers' if holds else 'does not lower'} ECE of the adapted predictions: lower in "
        f"{_count(down)} pairs; mean ECE {_pct(float(table['ece_none'].mean()))} -> "
        f"{_pct(float(table['ece_zaec'].mean()))}."))


def _zaec_vs(table: pl.DataFrame, other: str, label: str) -> Finding:
    key = f"zaec_vs_{other}"
    if not {"ece_zaec", f"ece_{other}"} <= set(table.columns):
        return Finding(key, None, f"the {other} rows are missing (calibrator skipped?)")
    better = (table["ece_zaec"] < table[f"ece_{other}"]).to_list()
    holds = sum(better) > table.height / 2
    return Finding(key, holds, (
        f"ZAEC {'beats' if holds else 'does not beat'} {label}: lower ECE in {_count(better)} pairs "
        f"(mean {_pct(float(table['ece_zaec'].mean()))} vs {_pct(float(table[f'ece_{other}'].mean()))})."))


def _zaec_best(table: pl.DataFrame) -> Finding:
    ece_cols = [f"ece_{c}" for c in CALIBRATORS if f"ece_{c}" in table.columns]
    if not ("ece_zaec" in ece_cols and len(ece_cols) > 1):
        return Finding("zaec_best", None, "the zaec rows or every baseline are missing")
    best = table.select(pl.min_horizontal(ece_cols)).to_series()
    is_best = (table["ece_zaec"] <= best).to_list()
    means = {c[4:]: float(table[c].mean()) for c in ece_cols}
    ranked = ", ".join(f"{k} {_pct(v)}" for k, v in sorted(means.items(), key=lambda kv: kv[1]))
    holds = sum(is_best) > table.height / 2
    return Finding("zaec_best", holds, (
        f"ZAEC {'has' if holds else 'does not have'} the lowest ECE of the post-hoc options in "
        f"{_count(is_best)} pairs (the paper reports the lowest macro-average on ViT-B/16); mean ECE: "
        f"{ranked}."))


def _accuracy_preserved(wide: pl.DataFrame, runs: pl.DataFrame) -> Finding:
    """The by-construction property, checked for consistency on every TTA run (all sets included)."""
    if not ({"accuracy_zaec", "accuracy_none"} <= set(wide.columns) and runs.height):
        return Finding("accuracy_preserved", None, "the zaec or none rows are missing")
    gap = (runs["accuracy_zaec"] - runs["accuracy_none"]).abs()
    worst = float(gap.max())
    holds = worst == 0.0
    text = ("By construction, not measured here: ZAEC divides each sample's logits by a temperature T >= 1, "
            "which never moves the top-1 class, and zaec-calibrate scores every calibrator on the adapted "
            "logits' arg-max, so accuracy under ZAEC is the adapted accuracy.")
    if not holds:  # the table contradicts the property: a bug, said as such
        changed = int((gap > 0.0).sum())
        text += (f" Yet this table differs in {changed} of {gap.len()} runs (up to {worst * 100:.2f} points): "
                 "the metrics table is inconsistent.")
    return Finding("accuracy_preserved", holds, text, measured=False)


def selective_sentence(
    metrics: pl.DataFrame, *, source: str = SOURCE_DATASET, anchor_method: str = ZERO_SHOT_METHOD
) -> str:
    """One sentence: does ZAEC help or hurt selective prediction on these runs (beyond the paper)?

    Per (backbone, TTA method), AURC and misclassification AUROC (max softmax probability score, `aurc_msp`,
    `auroc_msp` of ``zaec-calibrate``) are macro-averaged over the shifted sets, raw (``none``) and ``zaec``. ZAEC
    "helps" when it lowers AURC and raises AUROC in most pairs and on average, "hurts" when it raises AURC and lowers
    AUROC in most pairs and on average, "mixed" when those disagree (a mean AURC that rises while most pairs
    improve), and otherwise neither clearly (`verdict.raw_vs_zaec`). Runs where AUROC is undefined (no
    misclassified sample: NaN) are left out.
    """
    head = "Selective prediction (beyond the paper): "
    if not {"aurc_msp", "auroc_msp"} <= set(metrics.columns):
        return head + ("undecided, the metrics table has no aurc_msp/auroc_msp columns (made by an older "
                       "zaec-calibrate).")
    rows = metrics.filter((pl.col("method") != anchor_method) & (pl.col("dataset") != source)
                          & pl.col("calibrator").is_in(["none", "zaec"]))
    c = raw_vs_zaec(rows, ("aurc_msp", "auroc_msp"), higher_is_better=(False, True))
    if c is None:
        return head + ("undecided, no TTA run on the shifted sets has raw and ZAEC rows with a defined AUROC "
                       "(AUROC needs at least one misclassified sample).")
    (aurc0, aurc1), (auroc0, auroc1) = c.means["aurc_msp"], c.means["auroc_msp"]
    return head + (
        f"{c.says('deciding which predictions to trust')} here: AURC {_pct(aurc0)} raw -> "
        f"{_pct(aurc1)} with ZAEC (lower is better; lower in {c.better['aurc_msp']} of {c.n} pairs), "
        f"misclassification AUROC {_pct(auroc0)} -> {_pct(auroc1)} (higher is better; "
        f"higher in {c.better['auroc_msp']} of {c.n}), both from the max softmax probability.")


def render_summary(summary: DemoSummary, console, *, n_images: int | None = None) -> None:
    """Print the summary table (percent) and the findings with rich."""
    from rich.table import Table

    t = summary.table
    if t.height:
        table = Table(title="shifted sets, macro-average (" + ", ".join(summary.shifted_sets) + ")")
        heads = [("backbone", None), ("method", None), ("zs acc", "zs_accuracy"), ("acc", "accuracy"),
                 ("zs ECE", "zs_ece"), ("ECE none", "ece_none"), ("TS", "ece_temperature"), ("SaLS", "ece_sals"),
                 ("ZAEC", "ece_zaec")]
        heads = [(h, c) for h, c in heads if c is None or c in t.columns]
        for h, c in heads:
            table.add_column(h, justify="left" if c is None else "right")
        for r in t.iter_rows(named=True):
            table.add_row(r["backbone"], r["method"], *(f"{100 * r[c]:.1f}" for _, c in heads[2:]))
        console.print(table)
    console.print("[bold]What this run shows[/] (percent; ECE: 20 equal-width bins):")
    for f in summary.findings:
        mark = {True: "[green]yes[/]", False: "[red]no[/]", None: "[yellow]?[/]"}[f.holds]
        if not f.measured and f.holds:
            mark = "[blue]by construction[/]"
        console.print(f"  {mark}  ", end="")
        console.print(f.text, markup=False, highlight=False)
    if summary.selective:
        console.print(f"  {summary.selective}", markup=False, highlight=False)
    if n_images is not None:
        console.print(
            f"  Caveat: {n_images} images per set and one seed; with this few samples ECE moves by a few points "
            "between subsets, so read small differences as ties.", markup=False, highlight=False)


def summary_markdown(summary: DemoSummary) -> str:
    """The summary as Markdown (written next to the tables as demo_summary.md)."""
    lines = ["# Demo summary", "", f"Models: {NOTE}.", "",
             f"Shifted sets: {', '.join(summary.shifted_sets) or '(none)'}; macro-averages over them, percent.", ""]
    t = summary.table
    if t.height:
        cols = [c for c in t.columns if c not in ("backbone", "method", "n_sets")]
        lines.append("| backbone | method | " + " | ".join(cols) + " |")
        lines.append("|---|---|" + "---:|" * len(cols))
        for r in t.iter_rows(named=True):
            lines.append(f"| {r['backbone']} | {r['method']} | " + " | ".join(f"{100 * r[c]:.1f}" for c in cols) + " |")
        lines.append("")
    for f in summary.findings:
        mark = {True: "yes", False: "no", None: "undecided"}[f.holds]
        if not f.measured and f.holds:
            mark = "by construction"
        lines.append(f"- **{mark}**: {f.text}")
    if summary.selective:
        lines.append(f"- {summary.selective}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ orchestration


#: what a first `make demo` runs: the paper's methods plus the TTA-VLM methods that fit its 10-minute budget on an
#: idle 2-core machine (docs/demo.md, "Which methods"); `--methods all` runs every registered one
DEMO_METHODS: tuple[str, ...] = ("zero-shot", "tda", "dpe", "dlae", "tpt", "ctpt", "otpt", "atpt", "tps",
                                  "onzeta", "dmn-weak")
#: settings the demo's offline models need: RLCF's default reward model (OpenAI ViT-L-14) cannot be had here, so
#: the demo uses the policy as its own reward model, TTA-VLM's setting
#: (docs/methods.md, "RLCF: prompt tuning with a CLIP reward")
DEMO_OVERRIDES: dict[str, dict[str, str]] = {"rlcf": {"reward_backbone": "policy"}}


def _resolve_methods(methods: Sequence[str] | None) -> tuple[str, ...]:
    from extract.methods import REGISTRY

    if methods is None:
        methods = DEMO_METHODS
    elif tuple(methods) == ("all",):
        methods = tuple(REGISTRY)
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}; available: {', '.join(REGISTRY)}")
    # the zero-shot run comes first: it is the cheapest and fills the view-0 cache the others reuse
    return tuple(sorted(dict.fromkeys(methods), key=lambda m: (m != ZERO_SHOT_METHOD, list(REGISTRY).index(m))))


def _resolve_sets(sets: Sequence[str]) -> tuple[str, ...]:
    unknown = [s for s in sets if s not in shifts_mod.SHIFTS]
    if unknown:
        raise ValueError(f"unknown set(s) {', '.join(map(repr, unknown))}; available: {', '.join(shifts_mod.SHIFTS)}")
    if "clean" not in sets:
        raise ValueError("the sets must include 'clean': it is temperature scaling's labelled source")
    return tuple(dict.fromkeys(sets))


def _inputs_fingerprint(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _drop_runs_of(shards: Path, dataset: str) -> None:
    """Remove the demo's own shards of one dataset (its set was rewritten, so they no longer match)."""
    for d in shards.glob(f"backbone=*/dataset={dataset}"):
        shutil.rmtree(d, ignore_errors=True)


def _calibration_notes(notes: Sequence[str], temperatures: dict[str, float], capped: dict[str, int]) -> list[str]:
    """zaec-calibrate's notes, with its one-line-per-run temperature notes folded into one line per backbone."""
    out = [f"note: {n}" for n in notes if not n.startswith("temperature scaling fitted on")]
    per_backbone: dict[str, list[str]] = {}
    for key, t in temperatures.items():  # key: backbone/dataset/method/seed=S
        parts = key.split("/")
        if len(parts) >= 3:
            per_backbone.setdefault(parts[0], []).append(f"{parts[2]} {t:.2f}")
    for backbone, items in per_backbone.items():
        out.append(f"temperature scaling, T fitted on {SOURCE_DATASET} ({backbone}): {', '.join(items)}")
    n_capped = sum(capped.values())
    if n_capped:
        out.append(f"ZAEC capped the temperature of {n_capped} sample(s) (zero-shot entropy unreachable)")
    return out


def _accuracy(paths: Sequence[Path]) -> tuple[float, float]:
    from schemas.shard import read_shard

    hit_tta = hit_zs = n = 0
    for p in paths:
        sh = read_shard(p)
        hit_tta += int((sh.tta_logits.argmax(1) == sh.label).sum())
        hit_zs += int((sh.zs_logits.argmax(1) == sh.label).sum())
        n += len(sh.label)
    return hit_tta / max(n, 1), hit_zs / max(n, 1)


#: zaec-calibrate's metrics and the fingerprint of the shards they came from, under DemoConfig.metrics_dir
_METRICS_FILE = "metrics.parquet"
_METRICS_STAMP = "inputs.sha256"


def run_demo(cfg: DemoConfig = DemoConfig(), *, console=None) -> DemoResult:
    """Run the whole demo (each step skips finished work) and return the metrics and their summary."""
    # every stage is imported before any work, so that a missing dependency stops the demo at once; the steps
    # below import what they use again (a lookup in sys.modules)
    import torch  # noqa: F401
    from rich.console import Console

    from calibrate.run import calibrate_paths, write_metrics  # noqa: F401
    from extract.models import load_model  # noqa: F401
    from extract.runner import run_extraction  # noqa: F401
    from schemas.shard import find_shards  # noqa: F401

    console = console or Console(emoji=False)
    say = console.print
    started = time.perf_counter()
    timings: dict[str, float] = {}
    notes: list[str] = []

    methods, sets, datasets, specs = _plan(cfg, say)

    t = time.perf_counter()
    model_dirs = _train_models(cfg, specs, console)
    timings["train"] = time.perf_counter() - t

    t = time.perf_counter()
    _write_sets(cfg, sets, datasets, say)
    timings["sets"] = time.perf_counter() - t

    t = time.perf_counter()
    _extract(cfg, specs, model_dirs, datasets, methods, console, notes)
    timings["extract"] = time.perf_counter() - t

    t = time.perf_counter()
    fingerprint, fresh = _calibrate(cfg, say)
    metrics = pl.read_parquet(cfg.metrics_dir / _METRICS_FILE)
    timings["calibrate"] = time.perf_counter() - t

    t = time.perf_counter()
    _tables(cfg, datasets, fingerprint, say)
    if not fresh:  # stamped only once the tables are written too: a failed tables step redoes both next time
        (cfg.metrics_dir / _METRICS_STAMP).write_text(fingerprint + "\n")
    timings["tables"] = time.perf_counter() - t

    # [OOD pair] issue 24: fmnist against synthetic shapes, zero-shot and TDA only (tools/demo/ood.py)
    t = time.perf_counter()
    say("[bold]OOD pair[/] (beyond the paper: fmnist against synthetic shapes, zero-shot and TDA)")
    ood_line = ood_mod.run_ood_pair(cfg, model_dirs, say=say, log=notes.append)
    timings["ood"] = time.perf_counter() - t

    summary = summarise(metrics)
    cfg.results.mkdir(parents=True, exist_ok=True)
    (cfg.results / SUMMARY_FILE).write_text(summary_markdown(summary), encoding="utf-8")
    ood_mod.append_to_summary(cfg.results / SUMMARY_FILE, ood_line)  # [OOD pair]
    outputs = {
        "models": cfg.models_dir,
        "sets": cfg.data_root / shifts_mod.SET_DIR,
        "shards": cfg.shards,
        "metrics": cfg.metrics_dir / _METRICS_FILE,
        "tables": cfg.results,
        "summary": cfg.results / SUMMARY_FILE,
    }
    timings["total"] = time.perf_counter() - started
    _print_outputs(cfg, outputs, summary, timings, console, ood_line)
    return DemoResult(metrics=metrics, summary=summary, outputs=outputs, timings=timings, notes=notes)


def _plan(
    cfg: DemoConfig, say
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[train_mod.DemoModel, ...]]:
    """Resolve every name before any work and announce the run: (methods, sets, dataset keys, model specs)."""
    import torch

    check_dir(cfg.fmnist_dir)
    methods = _resolve_methods(cfg.methods)
    sets = _resolve_sets(cfg.sets)
    datasets = tuple(shifts_mod.dataset_key(s) for s in sets)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    specs = train_mod.default_models(budget=cfg.train_budget, seed=cfg.train_seed)
    size = "all 10,000" if cfg.n_images is None else f"the first {cfg.n_images:,} of the 10,000"
    say(f"[bold]zaec demo[/] - {NOTE}.", highlight=False)
    say(f"Sets: {', '.join(datasets)}, each holding {size} Fashion-MNIST test images"
        f"{' (subsampled to keep the demo short on a CPU)' if cfg.n_images else ''}; methods: {', '.join(methods)}; "
        f"backbones: {', '.join(s.name for s in specs)}.", highlight=False)
    return methods, sets, datasets, specs


def _train_models(cfg: DemoConfig, specs: Sequence[train_mod.DemoModel], console) -> dict[str, Path]:
    """Step 1: train the two models (or find them trained); their local-dir folders by name."""
    say = console.print
    say("[bold]\\[1/5] models[/]")
    model_dirs: dict[str, Path] = {}
    for spec in specs:
        skipped = train_mod.is_trained(spec, cfg.models_dir)
        if not skipped:
            say(f"  training {spec.name} (stand-in for {spec.stands_in_for}) on {spec.train.n_images:,} images, "
                f"{spec.train.epochs} epoch(s)", highlight=False)
        model_dirs[spec.name] = train_mod.train_model(spec, cfg.fmnist_dir, cfg.models_dir, console=console)
        rec = train_mod.training_record(spec, cfg.models_dir)
        where = model_dirs[spec.name]
        done = f"already trained in {where} (skipped)" if skipped else f"saved to {where}"
        facts = ""
        if rec:
            nan = float("nan")
            facts = (f"; trained in {rec.get('train_seconds', nan):.0f} s, logit scale "
                     f"{rec.get('final_logit_scale', nan):.1f}, clean accuracy "
                     f"{_pct(rec.get('clean_test_accuracy_first_2000', nan))} (first 2,000 test images, one prompt)")
        say(f"  {spec.name}: {done}{facts}", highlight=False)
    return model_dirs


def _write_sets(cfg: DemoConfig, sets: Sequence[str], datasets: Sequence[str], say) -> None:
    """Step 2: write the test sets that are not written yet (dropping the shards of a rewritten one)."""
    say("[bold]\\[2/5] test sets[/]")
    for name, key in zip(sets, datasets):
        if shifts_mod.is_written(cfg.data_root, name, n=cfg.n_images, cfg=shifts_mod.ShiftConfig()):
            continue
        _drop_runs_of(cfg.shards, key)
        shifts_mod.write_set(name, cfg.fmnist_dir, cfg.data_root, limit=cfg.n_images, force=True)
        say(f"  wrote {key} ({shifts_mod.describe(name)}) to {shifts_mod.set_dir(cfg.data_root, name)}",
            highlight=False)
    say(f"  {len(sets)} sets under {cfg.data_root / shifts_mod.SET_DIR}", highlight=False)


def _extract(cfg: DemoConfig, specs: Sequence[train_mod.DemoModel], model_dirs: dict[str, Path],
             datasets: Sequence[str], methods: Sequence[str], console, notes: list[str]) -> None:
    """Step 3: extraction, every method x set x backbone; appends the runner's messages (once each) to ``notes``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from extract.models import load_model
    from extract.run.options import RunOptions, backbone_refusal
    from extract.runner import run_extraction

    say = console.print
    say("[bold]\\[3/5] extraction[/] (zaec-extract's run_extraction; finished runs are skipped)")
    total = len(specs) * len(datasets) * len(methods)
    logged: set[str] = set()
    method_seconds: dict[str, float] = {m: 0.0 for m in methods}

    def log(msg: str) -> None:
        # the same prompt warning repeats for every set: keep one, with the set's name generalised
        msg = re.sub(r"'fmnist(_[a-z]+)?'", "'fmnist*'", msg)
        msg = re.sub(r"\bfmnist(_[a-z]+)?\.json\b", "fmnist*.json", msg)  # AWT's description file per set
        if msg not in logged:
            logged.add(msg)
            notes.append(msg)

    columns = (TextColumn("  extract"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not cfg.progress) as progress:
        task = progress.add_task("", total=total)
        for spec in specs:
            pretrained = f"local-dir:{model_dirs[spec.name]}"
            model = None
            for key in datasets:
                line = []
                t_set = time.perf_counter()
                for method in methods:
                    progress.update(task, description=f"{spec.name} {key} {method}")
                    t_run = time.perf_counter()
                    if model is None:
                        model = load_model(None, pretrained, cfg.device)
                    # a method that cannot run on this model (TTL, TCA, DART, PromptAlign need a ViT: the method's
                    # `towers`, the check `zaec-extract` makes): said in one line, then skipped without trying it
                    why = backbone_refusal(RunOptions.make(method, key, backbone=None, pretrained=pretrained,
                                                           overrides=DEMO_OVERRIDES.get(method)))
                    if why is not None:
                        log(f"{method} skipped on {spec.name}: {why}")
                        line.append(f"{method} skipped")
                        progress.advance(task)
                        continue
                    try:
                        paths = run_extraction(
                            method, key, backbone=None, pretrained=pretrained, data_root=cfg.data_root,
                            out=cfg.shards, seed=cfg.seed, device=cfg.device, cache_dir=cfg.cache,
                            workers=cfg.workers, model=model, progress=False, log=log,
                            on_changed="recompute",  # the demo owns its shards
                            overrides=DEMO_OVERRIDES.get(method))
                    except ValueError as e:
                        if method in DEMO_METHODS:  # the default methods run on both demo models: a real failure
                            raise
                        # an opt-in method that cannot run here for another reason (AWT needs description files,
                        # which the demo does not write): said in one line, then skipped
                        log(f"{method} skipped on {spec.name}: {str(e).splitlines()[0]}")
                        line.append(f"{method} skipped")
                        progress.advance(task)
                        continue
                    method_seconds[method] += time.perf_counter() - t_run
                    acc, zs_acc = _accuracy(paths)
                    if method == ZERO_SHOT_METHOD:
                        line.insert(0, f"zero-shot {_pct(zs_acc)}")
                    else:
                        line.append(f"{method} {_pct(acc)}")
                    progress.advance(task)
                progress.console.print(f"  {spec.name:<11} {key:<16} accuracy: {' | '.join(line)} "
                                       f"({time.perf_counter() - t_set:.0f} s)", highlight=False)
    say("  time per method (both backbones, all sets): "
        + ", ".join(f"{m} {v:.0f} s" for m, v in method_seconds.items()), highlight=False)
    for n in notes:
        say(f"  note: {n}", markup=False, highlight=False)


def _calibrate(cfg: DemoConfig, say) -> tuple[str, bool]:
    """Step 4: zaec-calibrate, skipped when the shards did not change: (the shards' fingerprint, whether skipped).

    The caller stamps the fingerprint once the tables are written too.
    """
    from calibrate.run import calibrate_paths, write_metrics
    from schemas.shard import find_shards

    say("[bold]\\[4/5] calibration[/] (zaec-calibrate: none, temperature fitted on fmnist, SaLS, ZAEC)")
    shard_files = [Path(p) for p in find_shards([cfg.shards])]
    fingerprint = _inputs_fingerprint(shard_files)
    stamp = cfg.metrics_dir / _METRICS_STAMP
    metrics_path = cfg.metrics_dir / _METRICS_FILE
    fresh = stamp.is_file() and stamp.read_text().strip() == fingerprint and metrics_path.is_file()
    if fresh:
        say(f"  {metrics_path} is up to date (skipped)", highlight=False)
    else:
        report = calibrate_paths([cfg.shards], calibrators=",".join(CALIBRATORS), ts_source=SOURCE_DATASET)
        write_metrics(report, cfg.metrics_dir)
        for line in _calibration_notes(report.notes, report.temperatures, report.capped):
            say(f"  {line}", markup=False, highlight=False)
    return fingerprint, fresh


def _tables(cfg: DemoConfig, datasets: Sequence[str], fingerprint: str, say) -> None:
    """Step 5: the paper's tables and figures (zaec-calibrate tables, as `make tables` runs it), unless up to date."""
    say("[bold]\\[5/5] tables and figures[/] (zaec-calibrate tables)")
    tables_stamp = cfg.results / ".inputs.sha256"
    tables_fresh = tables_stamp.is_file() and tables_stamp.read_text().strip() == fingerprint
    if tables_fresh and (cfg.results / "README.md").is_file():
        say(f"  {cfg.results} is up to date (skipped)", highlight=False)
        return
    cmd = [sys.executable, "-m", "calibrate.cli", "tables", str(cfg.shards), "--out", str(cfg.results),
           "--ts-source", SOURCE_DATASET, "--reference-dataset", REFERENCE_DATASET if REFERENCE_DATASET in
           datasets else datasets[-1], "--bootstrap", str(cfg.bootstrap), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DemoError(f"zaec-calibrate tables failed (exit {proc.returncode}): "
                        f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:] or ['no output']}")
    tables_stamp.write_text(fingerprint + "\n")


def _print_outputs(cfg: DemoConfig, outputs: dict[str, Path], summary: DemoSummary, timings: dict[str, float],
                   console, ood_line: str) -> None:
    """The closing report: where the outputs are, the summary, and each step's time."""
    say = console.print
    say("")
    say("[bold]Outputs[/]")
    for k, v in (("models (local-dir)", outputs["models"]), ("test sets", outputs["sets"]),
                 ("shards", outputs["shards"]), ("metrics (zaec-calibrate)", cfg.metrics_dir / "metrics.csv"),
                 ("tables and figures", cfg.results / "README.md"), ("this summary", outputs["summary"])):
        say(f"  {k:<26} {v}", highlight=False)
    say("")
    render_summary(summary, console, n_images=cfg.n_images)
    say(ood_line, highlight=False)  # [OOD pair]
    say("")
    say("Steps: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()), highlight=False)
    say("Run the same pipeline on real CLIP weights and the paper's datasets: see the README "
        "(zaec-extract --pretrained openai --backbone ViT-B-16 ...).", highlight=False)


class DemoError(RuntimeError):
    """A step of the demo failed for a reason outside the user's input (the message names the step)."""
