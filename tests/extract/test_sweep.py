"""`zaec-sweep`: grid expansion and grouping, the plan, SLURM submission parameters, state refresh, and real sweeps
through submitit's local executor with the tiny model on synthetic datasets."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from extract.sweep import cli as sweep
from extract.datasets import PAPER_DATASETS, get_dataset
from extract.methods import REGISTRY, get_method
from extract.run.rundir import run_is_complete
from extract.sweep import submit, track
from extract.run.options import ExecOptions, RunOptions, backbone_refusal
from extract.sweep.cost import (
    ADAPT_COSTS,
    ENCODE_S_PER_VIEW,
    JOB_OVERHEAD_S,
    NUM_CLASSES,
    TEST_SIZES,
    Work,
    backbone_figures,
    load_rates,
)
from extract.sweep.grid import plan_frame
from extract.sweep.errors import SweepError
from extract.sweep.grid import Grid, expand_grid, group_runs, method_overrides, pack_groups
from extract.sweep.manifest import Manifest, error_line, manifest_frame, manifest_path, result_path, sweep_dir
from extract.sweep.runspec import RunSpec
from extract.views import view_policy
from schemas.shard import read_shard

from tests.support.extract import make_json_dataset
from tests.support.sweep import adapt_reference

runner = CliRunner()
EPS = sys.float_info.epsilon
DATASETS = ("dtd", "eurosat")
METHODS = ("zero-shot", "tda")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-data")
    for i, key in enumerate(DATASETS):
        make_json_dataset(root, key, n_classes=3, per_class=2, seed=i)  # 6 images each
    return root


def _image_paths(root: Path, key: str) -> list[Path]:
    lay = get_dataset(key).layouts[0]
    ddir = root / lay.dataset_dir
    split = json.loads((ddir / lay.split_file).read_text())
    return [ddir / lay.image_dir / rel for rel, _, _ in split["test"]]


def _cli(*args: str):
    return runner.invoke(sweep.app, list(args))


def _grid_args(model_dir, data_root, out, cache, *extra):
    return ["run", "--methods", ",".join(METHODS), "--datasets", ",".join(DATASETS),
            "--pretrained", f"local-dir:{model_dir}", "--data-root", str(data_root), "--out", str(out),
            "--cache-dir", str(cache), "--device", "cpu", *extra]


# ---------------------------------------------------------------------------------------------------------------
# grid expansion and grouping (pure; no image is read, no weights are loaded)

def _runs_on(method: str, backbone: str) -> bool:
    """Whether `method` runs on `backbone` (its `towers`: docs/methods.md, "Which backbones a method runs on")."""
    return backbone_refusal(RunOptions(method, "dtd", backbone=backbone)) is None


def _expected_policy(method: str, dataset: str, backbone: str) -> str:
    cfg = get_method(method).default_config(get_dataset(dataset).hparams_from, backbone)
    return view_policy(cfg.n_views, cfg.augmix, cfg.crop_scale)


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_registered_method_expands(method, tmp_path):
    """On every backbone it runs on; a backbone it cannot run on is left out with one line naming both."""
    left_out: list[str] = []
    runs = expand_grid(Grid((method,), ("all",), ("ViT-B-16", "RN50"), (1, 2)), out=tmp_path, left_out=left_out)
    runs_on = [b for b in ("ViT-B-16", "RN50") if _runs_on(method, b)]
    assert runs_on and len(runs) == len(runs_on) * len(PAPER_DATASETS) * 2
    assert sorted({r.backbone for r in runs}) == sorted(runs_on)
    assert left_out == [backbone_refusal(RunOptions(method, "dtd", backbone=b)) for b in ("ViT-B-16", "RN50")
                        if b not in runs_on]
    assert all(line.startswith(f"{method} ") and "RN50's is " in line for line in left_out)
    for r in runs:
        assert r.policy == _expected_policy(method, r.dataset, r.backbone)
        assert Path(r.out).is_absolute()


def test_dmn_own_crops_are_priced_as_crop_flip_views():
    """DMN's `crop_flip_05` views (issue 31 item 4) cost what the measured crop_flip views cost per view."""
    from extract.sweep.cost import Rates, encode_seconds

    rates = Rates(source="test", encode_s={("ViT-B-16", "crop_flip"): 0.25, ("ViT-B-16", "augmix"): 0.5},
                  adapt_s={}, overhead_s={})
    assert encode_seconds("ViT-B-16", "crop_flip_05", rates) == 0.25
    assert encode_seconds("ViT-B-16", "augmix", rates) == 0.5


def test_grouping_puts_the_methods_of_one_cache_key_in_one_group(tmp_path):
    methods = tuple(sorted(REGISTRY))
    runs = expand_grid(Grid(methods, ("dtd", "imagenet_a", "eurosat"), ("ViT-B-16", "RN50"), (1, 2)), out=tmp_path)
    groups = group_runs(runs)
    # reference: bucket by (backbone, dataset, policy from the method's default config, seed), computed here
    expected: dict[tuple, set[str]] = {}
    for b in ("ViT-B-16", "RN50"):
        for d in ("dtd", "imagenet_a", "eurosat"):
            for s in (1, 2):
                for m in (m for m in methods if _runs_on(m, b)):
                    expected.setdefault((b, d, _expected_policy(m, d, b), s), set()).add(m)
    got = {(g.runs[0].backbone, g.runs[0].dataset, g.runs[0].policy, g.runs[0].seed): set(g.methods)
           for g in groups}
    assert got == expected
    assert sum(len(g.runs) for g in groups) == len(runs) == len({r.run_id for r in runs})
    for g in groups:
        assert len({r.group_key for r in g.runs}) == 1
    # the single-view methods of (ViT-B-16, dtd, seed 1) share one job
    assert {"zero-shot", "tda"} <= got[("ViT-B-16", "dtd", "single", 1)]


def test_overrides_change_the_view_policy_and_thus_the_group(tmp_path):
    base = expand_grid(Grid(("tda",), ("imagenet_a",), ("RN50",)), out=tmp_path)
    assert base[0].policy == "augmix"
    one = expand_grid(Grid(("tda", "zero-shot"), ("imagenet_a",), ("RN50",), overrides=("tda.n_views=1",)),
                      out=tmp_path)
    assert {r.policy for r in one} == {"single"}
    assert [set(g.methods) for g in group_runs(one)] == [{"tda", "zero-shot"}]
    assert dict(one[0].options.overrides) == {"n_views": "1"}


def test_method_overrides_scoping():
    assert method_overrides(["alpha=1", "tda.alpha=2"], ["tda", "dpe"]) == {"tda": {"alpha": "2"},
                                                                            "dpe": {"alpha": "1"}}
    with pytest.raises(SweepError, match="not in the sweep"):
        method_overrides(["dpe.alpha=1"], ["tda"])
    with pytest.raises(SweepError, match="key=value"):
        method_overrides(["alpha"], ["tda"])


def test_expand_grid_rejects_bad_names(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'tpz'; available: .*tda"):
        expand_grid(Grid(("tpz",), ("dtd",)), out=tmp_path)
    with pytest.raises(ValueError, match="unknown dataset 'dtdd'; available: .*dtd"):
        expand_grid(Grid(("tda",), ("dtdd",)), out=tmp_path)
    with pytest.raises(ValueError, match="valid keys"):
        expand_grid(Grid(("tda",), ("dtd",), overrides=("tda.nope=1",)), out=tmp_path)
    with pytest.raises(SweepError, match="does not exist"):
        expand_grid(Grid(("tda",), ("dtd",), ("RN50=/no/such/rn50.pt",)), out=tmp_path)


def test_pack_groups_balances_estimates(tmp_path):
    runs = expand_grid(Grid(("tda", "dpe"), ("all",), ("ViT-B-16",)), out=tmp_path)
    groups = group_runs(runs)
    packs = pack_groups(groups, 3)
    assert len(packs) == 3 and sorted(g.group_id for p in packs for g in p) == sorted(g.group_id for g in groups)
    loads = [sum(g.estimate_hours() for g in p) for p in packs]
    # LPT guarantee: max load <= mean load + the longest single group
    assert max(loads) <= sum(loads) / 3 + max(g.estimate_hours() for g in groups) + 1e-9
    assert sorted(len(p) for p in pack_groups(groups[:2], 5)) == [1, 1]  # never an empty job


# ---------------------------------------------------------------------------------------------------------------
# the plan and its estimate

def _adapt_reference(method: str, n: int, k: int, views: int, backbone: str = "ViT-B-16") -> float:
    """The documented cost model (tests/support/sweep.py): the method's work on the default card (an H100) with
    the backbone's counted figures."""
    return adapt_reference(ADAPT_COSTS[method], n, k, views, backbone_figures(backbone))


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_registered_method_has_a_cost(method):
    assert method in ADAPT_COSTS, f"give {method} a cost entry in extract/sweep/cost.py (ADAPT_COSTS; its work: " \
        "docs/sweep.md, 'The cost model')"
    c = ADAPT_COSTS[method]
    assert isinstance(c.work, Work), f"{method}: an entry is its work (docs/sweep.md, 'The cost model')"
    assert c.estimate(1, 1000, 1) > 0 and c.estimate(1, 1000, 64) > 0


def test_plan_frame_estimate_matches_the_documented_cost_model(tmp_path):
    runs = expand_grid(Grid(tuple(sorted(REGISTRY)), ("all",), ("ViT-B-16", "RN50")), out=tmp_path)
    groups = group_runs(runs)
    df = plan_frame(groups)
    pairs = sum(_runs_on(m, b) for m in REGISTRY for b in ("ViT-B-16", "RN50"))
    assert len(df) == len(groups) and int(df["runs"].sum()) == len(runs) == pairs * 15
    assert set(df["dataset"]) == set(PAPER_DATASETS) == set(TEST_SIZES)
    for row, g in zip(df.iter_rows(named=True), groups):
        n = TEST_SIZES[row["dataset"]]
        views = 1 if row["policy"] == "single" else 64
        enc = ENCODE_S_PER_VIEW["rn" if row["backbone"] == "RN50" else "vit"]
        k = NUM_CLASSES[row["dataset"]]
        adapt = sum(_adapt_reference(m, n, k, views, row["backbone"]) for m in row["methods"].split(","))
        assert row["images"] == n and row["views"] == n * views
        # a sum of a few dozen positive float64 terms, each a few roundings
        want = (JOB_OVERHEAD_S + n * views * enc + adapt) / 3600
        assert row["gpu_hours"] == pytest.approx(want, rel=64 * EPS, abs=0)
    assert TEST_SIZES["imagenet_sketch"] == 50889 and TEST_SIZES["fgvc_aircraft"] == 3333


def test_limit_caps_the_estimate(tmp_path):
    runs = expand_grid(Grid(("zero-shot",), ("imagenet",), ("ViT-B-16",)), out=tmp_path, limit=100)
    assert plan_frame(group_runs(runs))["images"].to_list() == [100]


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    res = _cli("run", "--methods", "zero-shot,tda,dpe,dlae", "--datasets", "all", "--backbones", "ViT-B-16,RN50",
               "--seeds", "1", "--out", str(out), "--dry-run", "--skip-data-check")
    assert res.exit_code == 0, res.output
    assert "120 run(s) to submit in 60 group(s)" in " ".join(res.output.split()) and "GPU-hours" in res.output
    assert not out.exists()


def _left_out_notes(output: str) -> list[str]:
    """The plan's notes on (method, backbone) pairs left out of the grid, one line each."""
    head = "note: left out of the grid: "
    return [line[len(head):] for line in output.splitlines() if line.startswith(head)]


def _refusals(methods, backbones, overrides=None) -> list[str]:
    """The refusal of each (method, backbone) pair that cannot run, in the grid's order (backbone, then method)."""
    lines = [backbone_refusal(RunOptions.make(m, "dtd", backbone=b, overrides=(overrides or {}).get(m)))
             for b in backbones for m in methods]
    return [line for line in lines if line is not None]


def test_methods_all_over_rn50_plans_only_the_runs_that_can_run(tmp_path, monkeypatch, tiny_externals):
    """`--methods all --backbones ViT-B-16,RN50` (dry run): every method on ViT-B-16, on RN50 only those whose
    `towers` take a ResNet; one note per pair left out, the refusal `zaec-extract` would print."""
    real, captured = sweep.sweep_run, []
    monkeypatch.setattr(sweep, "sweep_run", lambda runs, *a, **k: captured.extend(runs) or real(runs, *a, **k))
    externals = {m: tiny_externals.overrides(m) for m, cls in REGISTRY.items() if cls.external_files}
    res = _cli("run", "--dry-run", "--skip-data-check", "--methods", "all", "--datasets", "dtd", "--backbones",
               "ViT-B-16,RN50", "--out", str(tmp_path / "o"),
               *(a for m, ov in externals.items() for k, v in ov.items() for a in ("--set", f"{m}.{k}={v}")))
    assert res.exit_code == 0, res.output
    assert [(r.backbone, r.method) for r in captured] == [(b, m) for b in ("ViT-B-16", "RN50") for m in REGISTRY
                                                          if _runs_on(m, b)]
    assert {m for m in REGISTRY if not _runs_on(m, "RN50")} == {"ttl", "tca", "dart", "promptalign"}
    notes = _left_out_notes(res.output)
    assert notes == _refusals(REGISTRY, ("ViT-B-16", "RN50"), externals) and len(notes) == 4
    assert not (tmp_path / "o").exists()


def test_a_grid_left_empty_by_the_pairs_left_out_is_one_error(tmp_path):
    res = _cli("run", "--dry-run", "--skip-data-check", "--methods", "ttl,tca", "--datasets", "dtd", "--backbones",
               "RN50", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "Traceback" not in res.output + res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line == f"zaec-sweep: error: no run of the grid can run: {' | '.join(_refusals(('ttl', 'tca'), ('RN50',)))}"


class _Job:
    def __init__(self, n: int) -> None:
        self.job_id = str(n)


def test_a_submission_leaves_the_pairs_out_and_says_so(tmp_path, monkeypatch):
    """A real submission (submitit's local executor replaced by a recorder) submits no job for a pair that cannot
    run; the manifest holds the others only; one note per pair left out."""
    from extract.sweep import submit as submit_mod

    submitted: list = []

    class Recorder:
        def __init__(self, *a, **k) -> None:
            pass

        def update_parameters(self, **k) -> None:
            pass

        def submit(self, job):
            submitted.append(job)
            return _Job(len(submitted))

    monkeypatch.setattr(submit_mod, "_import_submitit", lambda: type("stub", (), {"LocalExecutor": Recorder}))
    out = tmp_path / "out"
    res = _cli("run", "--skip-data-check", "--no-wait", "--methods", "zero-shot,ttl,calip", "--datasets", "dtd",
               "--backbones", "ViT-B-16,RN50", "--out", str(out))
    assert res.exit_code == 0, res.output + res.stderr
    runs = [(r.backbone, r.method) for job in submitted for g in job.groups for r in g.runs]
    assert sorted(runs) == sorted([("ViT-B-16", "zero-shot"), ("ViT-B-16", "ttl"), ("ViT-B-16", "calip"),
                                   ("RN50", "zero-shot"), ("RN50", "calip")])
    assert set(_manifest_states(out)) == {("dtd", m) for m in ("zero-shot", "ttl", "calip")}
    assert len(manifest_frame(Manifest.load(out))) == 5
    assert "5 run(s) submitted" in " ".join(res.output.split())
    assert _left_out_notes(res.output) == _refusals(("ttl",), ("RN50",))


# rates as `python -m tools.bench_gpu --json` writes them (tests/tools/test_bench_gpu.py checks that writer)
RATES_DOC = {"version": 1, "device": "test", "backbones": {
    "ViT-B-16": {"encoder_images_per_s": 6000.0, "single_view_images_per_s": 4000.0, "crop_flip_views_per_s": 5000.0,
                 "augmix_views_per_s": 2000.0, "fixed_cost": {"process_s": 10.0},
                 "adapt_samples_per_s": {"tpt": {"47": 40.0, "200": 10.0, "1000": 2.0}, "tps": {"47": 100.0}}}}}


def _write_rates(path, doc=RATES_DOC):
    path.write_text(json.dumps(doc))
    return path


def test_measured_rates_price_the_plan(tmp_path):
    """With --rates, a group costs overhead + images x views / measured rate + images / measured samples/s (TPT
    linear in K between the measured class counts, C-TPT priced as TPT); what the file lacks keeps the guesses."""
    rates = load_rates(str(_write_rates(tmp_path / "r.json")))
    # float64, a handful of roundings each side; the extrapolation to K = 10 cancels 0.025 down to 0.0069 (x 3.6)
    rel = 16 * sys.float_info.epsilon
    assert rates.adapt("ViT-B-16", "tpt", 47) == pytest.approx(1 / 40, rel=rel, abs=0)
    assert rates.adapt("ViT-B-16", "tpt", 600) == pytest.approx(0.1 + (0.5 - 0.1) * 400 / 800, rel=rel, abs=0)
    assert rates.adapt("ViT-B-16", "ctpt", 1000) == pytest.approx(0.5, rel=rel, abs=0)
    assert rates.adapt("ViT-B-16", "tpt", 10) == pytest.approx(max(0.0, 1 / 40 - (0.1 - 1 / 40) * 37 / 153),
                                                               rel=rel, abs=0)
    assert rates.adapt("ViT-B-16", "tps", 500) == pytest.approx(0.01, rel=rel, abs=0)
    assert rates.adapt("RN50", "tpt", 47) is None
    runs = expand_grid(Grid(("tpt", "ctpt", "tda", "zero-shot"), ("imagenet", "dtd"), ("ViT-B-16", "RN50")),
                       out=tmp_path)
    for g in group_runs(runs):
        r0 = g.runs[0]
        n, k = TEST_SIZES[r0.dataset], NUM_CLASSES[r0.dataset]
        views = 1 if r0.policy == "single" else 64
        guess = {m: _adapt_reference(m, n, k, views) for m in g.methods}
        if r0.backbone == "ViT-B-16":
            per_view = {"single": 1 / 4000, "crop_flip": 1 / 5000, "augmix": 1 / 2000}[r0.policy]
            tpt = 1 / 40 if k == 47 else 0.5
            adapt = sum(n * tpt if m in ("tpt", "ctpt") else guess[m] for m in g.methods)
            want = 10.0 + n * (1 if r0.policy == "single" else 64) * per_view + adapt
        else:
            want = g.estimate_hours() * 3600
        assert g.estimate_hours(rates) * 3600 == pytest.approx(want, rel=rel, abs=0)  # sums of positive terms
    out = tmp_path / "o"
    args = ("run", "--methods", "tpt", "--datasets", "imagenet", "--out", str(out), "--dry-run", "--skip-data-check")
    a, b = _cli(*args), _cli(*args, "--rates", str(tmp_path / "r.json"))
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    assert "adaptation measured in" in " ".join(b.output.split())
    assert "adaptation estimated from their work" in " ".join(a.output.split())
    want_h = (10.0 + 50000 * 64 / 5000 + 50000 * 0.5) / 3600  # TPT: crop+flip views
    assert f"about {sweep.fmt_hours(want_h)} GPU-hours" in " ".join(b.output.split()) and not out.exists()
    # `retry` rebuilds the options from the manifest: a rates file removed since falls back to the guesses
    kept = submit.ExecOptions.from_dict({"rates": str(tmp_path / "r.json")})
    gone = submit.ExecOptions.from_dict({"rates": str(tmp_path / "gone.json")})
    assert kept.cost() is not None and gone.cost() is None


@pytest.mark.parametrize("doc,message", [
    ("not json", "cannot read a JSON file"),
    (json.dumps({"version": 2, "backbones": {}}), "expected the JSON of `python -m tools.bench_gpu --json`"),
    (json.dumps({"version": 1, "backbones": {"RN50": {"single_view_images_per_s": 0}}}),
     "backbone RN50: expected a positive number at 'single_view_images_per_s', got 0"),
    (json.dumps({"version": 1, "backbones": {"RN50": {**RATES_DOC["backbones"]["ViT-B-16"],
                                                      "adapt_samples_per_s": {"tpt": {"many": 3.0}}}}}),
     "class counts of 'tpt' must be integers"),
    (json.dumps({"version": 1, "backbones": {"RN50": {**RATES_DOC["backbones"]["ViT-B-16"],
                                                      "adapt_samples_per_s": [3.0]}}}),
     "expected an object at 'adapt_samples_per_s', got [3.0]"),
])
def test_a_bad_rates_file_is_one_line(doc, message, tmp_path):
    (tmp_path / "bad.json").write_text(doc)
    load_rates.cache_clear()
    res = runner.invoke(sweep.app, ["run", "--methods", "tda", "--datasets", "dtd", "--out", str(tmp_path / "o"),
                                    "--rates", str(tmp_path / "bad.json"), "--dry-run"])
    assert res.exit_code == 2 and message in res.stderr and "Traceback" not in res.output + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_default_command_is_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--methods", "zero-shot", "--datasets", "dtd", "--out", str(tmp_path / "o"), "--dry-run",
                    "--skip-data-check"])
    assert e.value.code == 0
    assert "1 run(s) to submit in 1 group(s)" in " ".join(capsys.readouterr().out.split())


def test_config_file_equals_the_options(tmp_path):
    cfg = tmp_path / "grid.toml"
    cfg.write_text('methods = ["zero-shot", "tda"]\ndatasets = "dtd,eurosat"\nbackbones = ["RN50"]\n'
                   'seeds = [1, 2]\nexecutor = "slurm"\npartition = "gpu"\ntimeout_min = 45\n')
    a = _cli("run", "--config", str(cfg), "--out", str(tmp_path / "o"), "--dry-run", "--skip-data-check")
    b = _cli("run", "--methods", "zero-shot,tda", "--datasets", "dtd,eurosat", "--backbones", "RN50",
             "--seeds", "1,2", "--executor", "slurm", "--partition", "gpu", "--timeout-min", "45",
             "--out", str(tmp_path / "o"), "--dry-run", "--skip-data-check")
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    assert a.output == b.output
    assert "#SBATCH --partition=gpu" in a.output and "#SBATCH --time=45" in a.output
    # an option on the command line overrides the file
    c = _cli("run", "--config", str(cfg), "--partition", "big", "--out", str(tmp_path / "o"), "--dry-run",
             "--skip-data-check")
    assert "#SBATCH --partition=big" in c.output


@pytest.mark.parametrize("args, message", [
    (["run", "--methods", "tpz", "--datasets", "dtd", "--dry-run"], "unknown method 'tpz'; available: "),
    (["run", "--methods", "tda", "--datasets", "dtdd", "--dry-run"], "unknown dataset 'dtdd'; available: "),
    (["run", "--methods", "tda", "--datasets", "dtd", "--executor", "pbs", "--dry-run"],
     "unknown executor 'pbs'; available: local, slurm"),
    (["run", "--methods", "tda", "--datasets", "dtd", "--seeds", "x", "--dry-run"], "--seeds expects integers"),
    (["run", "--methods", "tda", "--datasets", "dtd", "--set", "tda.nope=1", "--dry-run"], "valid keys: "),
    (["run", "--datasets", "dtd", "--dry-run"], "no methods given"),
    (["run", "--config", "/no/such/grid.toml"], "config file /no/such/grid.toml does not exist"),
    (["status", "--state", "weird"], "unknown state 'weird'; available: pending, running, done, failed, lost"),
])
def test_user_errors_are_one_line(args, message, tmp_path):
    res = runner.invoke(sweep.app, args + (["--out", str(tmp_path)] if "--out" not in args else []))
    assert res.exit_code == 2
    assert message in res.stderr
    assert "Traceback" not in res.output + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 or message in res.stderr.strip().splitlines()[0]


@pytest.mark.parametrize("argv, first", [
    (["--limit", "abc"], "zaec-sweep: error: Invalid value for '--limit': "),
    (["run", "--bogus"], "zaec-sweep: error: No such option: --bogus"),
    (["status", "--state"], "zaec-sweep: error: Option '--state' requires an argument."),
    (["--methods", "tpz", "--datasets", "dtd", "--dry-run"], "zaec-sweep: error: unknown method 'tpz'; available: "),
])
def test_every_error_of_the_console_script_is_one_line(argv, first, tmp_path, capsys):
    """Usage errors (typer's) and user errors (ours) end alike: one `zaec-sweep: error: ...` line, exit 2."""
    with pytest.raises(SystemExit) as e:
        sweep.main(argv + ["--out", str(tmp_path / "o")] if argv[0] != "status" else argv)
    cap = capsys.readouterr()
    assert e.value.code == 2 and cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(first), cap.err


def test_a_missing_dataset_names_its_expected_layouts(tmp_path, capsys):
    """The extractor's layout hint is part of the answer: the error's further lines are kept (no traceback)."""
    with pytest.raises(SystemExit) as e:
        sweep.main(["--methods", "tda", "--datasets", "caltech101", "--data-root", str(tmp_path),
                    "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.startswith("zaec-sweep: error: dataset 'caltech101' not found") and "101_ObjectCategories" in err


def test_bad_config_key_lists_valid_keys(tmp_path):
    cfg = tmp_path / "grid.toml"
    cfg.write_text('methods = ["tda"]\ndatasets = "dtd"\npartitoin = "gpu"\n')
    res = _cli("run", "--config", str(cfg), "--dry-run")
    assert res.exit_code == 2 and "unknown key(s) partitoin; valid keys: " in res.stderr


@pytest.mark.parametrize("command", ["status", "retry"])
def test_status_and_retry_without_manifest(command, tmp_path):
    res = _cli(command, "--out", str(tmp_path / "none"))
    assert res.exit_code == 2 and "no sweep manifest" in res.stderr and "Traceback" not in res.output


# ---------------------------------------------------------------------------------------------------------------
# SLURM: the generated submission, without a cluster

def _fake_slurm(bin_dir: Path, capture: Path, job_id: int = 4242, sacct: str | None = None,
                squeue: str | None = None) -> None:
    """`srun` (submitit only checks it exists), an `sbatch` that keeps the script and answers like SLURM, and
    optionally an `sacct` and a `squeue` printing fixed job states (tests/extract/sweep/test_slurm_real.py meets
    the real ones)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    scripts = {
        "srun": "#!/bin/sh\nexit 0\n",
        "sbatch": f'#!/bin/sh\ncp "$1" "{capture}"\necho "Submitted batch job {job_id}"\n',
    }
    if sacct is not None:
        scripts["sacct"] = f"#!/bin/sh\ncat <<'EOF'\n{sacct}EOF\n"
    if squeue is not None:
        scripts["squeue"] = f"#!/bin/sh\ncat <<'EOF'\n{squeue}EOF\n"
    for name, text in scripts.items():
        p = bin_dir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_slurm_parameters(tmp_path):
    runs = expand_grid(Grid(("zero-shot", "tda"), ("dtd", "imagenet_a"), ("ViT-B-16",)), out=tmp_path)
    groups = group_runs(runs)
    opts = submit.ExecOptions(executor="slurm", partition="gpu", gpus_per_job=2, cpus_per_job=12, mem_gb=64,
                             timeout_min=300, account="lab", array_parallelism=2,
                             slurm_setup=("source /env/bin/activate",))
    p = submit.slurm_parameters(opts, groups)
    assert p["partition"] == "gpu" and p["gpus_per_node"] == 2 and p["cpus_per_task"] == 12
    assert p["mem"] == "64GB" and p["time"] == 300 and p["account"] == "lab" and p["array_parallelism"] == 2
    assert p["nodes"] == 1 and p["ntasks_per_node"] == 1 and p["setup"] == ["source /env/bin/activate"]
    text = submit.sbatch_preview(opts, groups, tmp_path / "sub")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=2", "#SBATCH --cpus-per-task=12",
                 "#SBATCH --mem=64GB", "#SBATCH --time=300", "#SBATCH --account=lab",
                 f"#SBATCH --array=0-{len(groups) - 1}%2", "#SBATCH --job-name=zaec-sweep",
                 "source /env/bin/activate"):
        assert line in text
    # no --timeout-min: twice the longest group's estimate, at least an hour, in steps of 30 minutes
    auto = submit.slurm_parameters(dataclasses.replace(opts, timeout_min=None), groups)["time"]
    longest = max(g.estimate_hours() for g in groups) * 60
    assert auto % 30 == 0 and auto >= max(60, 2 * longest) and auto < max(60, 2 * longest) + 30
    # no GPU requested: no gres line at all
    assert "gpus_per_node" not in submit.slurm_parameters(dataclasses.replace(opts, gpus_per_job=0), groups)


def test_slurm_submission_through_sbatch(tmp_path, tiny_model_dir, data_root, monkeypatch):
    capture = tmp_path / "captured.sbatch"
    _fake_slurm(tmp_path / "bin", capture, squeue="4242_0|PENDING\n4242_1|PENDING\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "out"
    res = _cli(*_grid_args(tiny_model_dir, data_root, out, tmp_path / "cache"), "--executor", "slurm",
               "--partition", "gpu", "--gpus-per-job", "1", "--timeout-min", "30", "--array-parallelism", "8",
               "--slurm-setup", "module load cuda")
    assert res.exit_code == 0, res.output + res.stderr
    script = capture.read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1", "#SBATCH --time=30",
                 "#SBATCH --array=0-1%2", "module load cuda", "submitit.core._submit"):
        assert line in script
    m = Manifest.load(out)
    df = manifest_frame(m)
    assert len(df) == 4 and set(df["state"]) == {"pending"}
    # one array task per (backbone, dataset, view policy, seed): the two methods of a dataset share a task
    jobs = {(r["dataset"], r["method"]): r["job_id"] for r in df.iter_rows(named=True)}
    assert jobs[("dtd", "zero-shot")] == jobs[("dtd", "tda")] != jobs[("eurosat", "tda")]
    assert {jobs[("dtd", "tda")], jobs[("eurosat", "tda")]} == {"4242_0", "4242_1"}
    assert m.executor["executor"] == "slurm" and m.executor["partition"] == "gpu"
    # a second submission while squeue lists the array as pending submits nothing
    capture.unlink()
    again = _cli(*_grid_args(tiny_model_dir, data_root, out, tmp_path / "cache"), "--executor", "slurm")
    assert again.exit_code == 0 and not capture.exists()
    assert "0 run(s) submitted" in " ".join(again.output.split())

    # squeue lists task 1 running, no longer task 0, which sacct says timed out: status marks the first group
    # failed, leaves the second
    timed_out = "dtd" if jobs[("dtd", "tda")] == "4242_0" else "eurosat"
    running = "eurosat" if timed_out == "dtd" else "dtd"
    _fake_slurm(tmp_path / "bin", capture, job_id=5000, squeue="4242_1|RUNNING\n",
                sacct="4242_0|TIMEOUT\n4242_0.batch|CANCELLED\n4242_1|RUNNING\n")
    status = _cli("status", "--out", str(out))
    assert status.exit_code == 0, status.output + status.stderr
    rows = _manifest_states(out)
    for m_ in METHODS:
        assert rows[(timed_out, m_)]["state"] == "failed"
        assert rows[(timed_out, m_)]["error"] == "job 4242_0 ended as TIMEOUT"
        assert rows[(running, m_)]["state"] == "pending"
    # retry resubmits only the timed-out group, with a longer limit; the other settings are the recorded ones
    res = _cli("retry", "--out", str(out), "--timeout-min", "120")
    assert res.exit_code == 0, res.output + res.stderr
    script = capture.read_text()
    assert "#SBATCH --time=120" in script and "#SBATCH --partition=gpu" in script and "--array" not in script
    rows = _manifest_states(out)
    for m_ in METHODS:
        assert rows[(timed_out, m_)]["job_id"] == "5000" and rows[(timed_out, m_)]["attempts"] == 2
        assert rows[(timed_out, m_)]["state"] == "pending" and rows[(timed_out, m_)]["error"] == ""
        assert rows[(running, m_)]["job_id"] == "4242_1" and rows[(running, m_)]["attempts"] == 1


@pytest.mark.parametrize("n_jobs, per_job, gpus, expected", [
    (2, 1, [0, 1], [(0,), (1,)]),
    (2, 1, [0], [(0,), (0,)]),  # one GPU: the jobs share it
    (3, 2, [4, 5, 6, 7], [(4, 5), (6, 7), (4, 5)]),
    (1, 3, [2, 3], [(2, 3)]),  # asks for more than there are: all of them
    (2, 1, [], [(), ()]),  # no GPU: CPU jobs
])
def test_local_gpu_assignment(n_jobs, per_job, gpus, expected):
    assert submit.local_gpu_assignment(n_jobs, per_job, gpus) == expected


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert submit._visible_gpus() == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert submit._visible_gpus() == []


# ---------------------------------------------------------------------------------------------------------------
# refreshing states (no jobs: result files and job ids are written by the test)

def _spec(tmp_path, method="tda", dataset="dtd") -> RunSpec:
    return RunSpec(RunOptions(method, dataset, backbone="tiny-clip", pretrained="local-dir:/x"),
                   ExecOptions(out=str(tmp_path)), "single")


class _LiveJob:
    """Stands in for a submitit job held by the submitting process."""

    def __init__(self, done: bool):
        self._done = done
        self.state = "RUNNING" if not done else "FINISHED"

    def done(self) -> bool:
        return self._done


def _dead_pid() -> str:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return str(p.pid)


def test_refresh_reads_result_files_of_the_current_submission_only(tmp_path):
    run = _spec(tmp_path)
    m = Manifest(tmp_path)
    m.record_submission(run, job_id="77", token="new", log="")
    path = result_path(tmp_path, run.run_id)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"token": "old", "state": "failed", "error": "stale"}))
    assert track.refresh(m, {"77": _LiveJob(done=False)}) == []  # stale file ignored, job still active
    assert m.rows[run.run_id]["state"] == "pending"
    path.write_text(json.dumps({"token": "new", "state": "running", "error": ""}))
    track.refresh(m, {"77": _LiveJob(done=False)})
    assert m.rows[run.run_id]["state"] == "running"
    path.write_text(json.dumps({"token": "new", "state": "failed", "error": "DatasetError: bad image"}))
    assert track.refresh(m) == [(run.run_id, "failed", "DatasetError: bad image")]


def test_refresh_fails_runs_of_a_job_that_died(tmp_path):
    run = _spec(tmp_path)
    m = Manifest(tmp_path)
    m.record_submission(run, job_id=_dead_pid(), token="t", log="")
    (changed,) = track.refresh(m)
    assert changed[1] == "failed" and "ended without a result" in changed[2]
    # a live job object that finished without writing a result
    m.record_submission(run, job_id="123", token="t2", log="")
    (changed,) = track.refresh(m, {"123": _LiveJob(done=True)})
    assert changed[1] == "failed" and "job 123 ended without a result" in changed[2]


def test_refresh_notices_removed_shards(tmp_path):
    run = _spec(tmp_path)
    m = Manifest(tmp_path)
    m.record_done(run)  # as if complete; nothing is on disk
    (changed,) = track.refresh(m)
    assert changed[1] == "failed" and "removed" in changed[2]


def test_manifest_round_trip_is_atomic(tmp_path):
    run = _spec(tmp_path)
    m = Manifest(tmp_path)
    m.record_submission(run, job_id="1", token="t")
    m.save()
    assert [p.name for p in sweep_dir(tmp_path).iterdir()] == ["manifest.json"]  # no temporary file left
    again = Manifest.load(tmp_path)
    assert again.rows == json.loads(json.dumps(m.rows)) and again.spec(run.run_id) == run
    manifest_path(tmp_path).write_text("{broken")
    with pytest.raises(SweepError, match="unreadable"):
        Manifest.load(tmp_path)


def test_error_line_is_one_line():
    assert error_line(ValueError("a\nb")) == "ValueError: a"
    assert error_line(RuntimeError()) == "RuntimeError"


# ---------------------------------------------------------------------------------------------------------------
# the job function in this process: one model per group, one encoding pass, failures isolated per run

def test_run_group_encodes_once_and_isolates_a_failing_run(tmp_path, tiny_model_dir, data_root,
                                                           monkeypatch):
    from extract import runner as extract_runner
    from extract.sweep.job import run_group

    runs = expand_grid(Grid(("zero-shot", "tda"), ("dtd",), (), pretrained=f"local-dir:{tiny_model_dir}"),
                       out=tmp_path / "out", data_root=data_root, cache_dir=tmp_path / "cache", device="cpu")
    (group,) = group_runs(runs)
    encoded = []
    real_encode, real_run = extract_runner.encode_pass, extract_runner.execute

    def counting_encode(*a, **k):
        n = real_encode(*a, **k)
        encoded.append(n)
        return n

    def failing_zero_shot(options, *a, **k):
        if options.method == "zero-shot":
            raise RuntimeError("injected failure\nsecond line")
        return real_run(options, *a, **k)

    monkeypatch.setattr(extract_runner, "encode_pass", counting_encode)
    monkeypatch.setattr(extract_runner, "execute", failing_zero_shot)
    results = run_group(group, "tok")
    assert [(r["run_id"].split("/")[2], r["state"], r["error"]) for r in results] == [
        ("zero-shot", "failed", "RuntimeError: injected failure"), ("tda", "done", "")]
    saved = json.loads(result_path(tmp_path / "out", runs[0].run_id).read_text())
    assert saved["state"] == "failed" and saved["token"] == "tok"
    assert run_is_complete(tmp_path / "out", runs[1].key)

    # with the failure gone, the zero-shot run reuses the cache: nothing is encoded a second time
    monkeypatch.setattr(extract_runner, "execute", real_run)
    results = run_group(group, "tok2")
    assert [r["state"] for r in results] == ["done", "done"]
    assert sum(encoded) == 6  # 6 images, encoded once for the whole group

    # the same grid with another TDA setting: the finished run does not match, and nothing is submitted
    import io

    from rich.console import Console

    other = expand_grid(Grid(("zero-shot", "tda"), ("dtd",), (), pretrained=f"local-dir:{tiny_model_dir}",
                             overrides=("tda.alpha=9",)), out=tmp_path / "out", data_root=data_root)
    with pytest.raises(SweepError, match=r"1 finished run\(s\) used other settings .*tda.*method_config"):
        sweep.sweep_run(other, submit.ExecOptions(), tmp_path / "out", dry_run=False, wait=False,
                        console=Console(file=io.StringIO()))
    assert not manifest_path(tmp_path / "out").exists()

    # the same grid after an image was touched: the finished runs no longer match their images (issue 14)
    same = expand_grid(Grid(("zero-shot", "tda"), ("dtd",), (), pretrained=f"local-dir:{tiny_model_dir}"),
                       out=tmp_path / "out", data_root=data_root)
    img = sorted(Path(data_root).rglob("*.png"))[0]
    st = os.stat(img)
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        with pytest.raises(SweepError, match=r"2 finished run\(s\) used other settings .*\(data_fingerprint \(the "
                                             r"image files changed"):
            sweep.sweep_run(same, submit.ExecOptions(), tmp_path / "out", dry_run=False, wait=False,
                            console=Console(file=io.StringIO()))
    finally:
        os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not manifest_path(tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# real sweeps through submitit's local executor (jobs are subprocesses of this machine)

def _manifest_states(out: Path) -> dict[tuple[str, str], dict]:
    return {(r["dataset"], r["method"]): r for r in manifest_frame(Manifest.load(out)).iter_rows(named=True)}


def _submitted_pickles(out: Path) -> int:
    return len(list((sweep_dir(out) / "submitit").glob("*_submitted.pkl")))


@pytest.mark.slow
def test_local_grid_completes_and_a_second_invocation_submits_nothing(tmp_path, tiny_model_dir,
                                                                      data_root):
    out, cache = tmp_path / "out", tmp_path / "cache"
    res = _cli(*_grid_args(tiny_model_dir, data_root, out, cache))
    assert res.exit_code == 0, res.output + res.stderr
    rows = _manifest_states(out)
    assert set(rows) == {(d, m) for d in DATASETS for m in METHODS}
    assert {r["state"] for r in rows.values()} == {"done"} and all(r["error"] == "" for r in rows.values())
    for (d, m), r in rows.items():
        shards = sorted(Path(r["shard_dir"]).glob("part-*.parquet"))
        assert shards and sum(len(read_shard(p).label) for p in shards) == 6
    assert _submitted_pickles(out) == 1  # --local-jobs 1: all groups in one process

    again = _cli(*_grid_args(tiny_model_dir, data_root, out, cache))
    assert again.exit_code == 0, again.output + again.stderr
    assert "0 run(s) submitted" in " ".join(again.output.split())
    assert _submitted_pickles(out) == 1
    assert {k: r["job_id"] for k, r in _manifest_states(out).items()} == {k: r["job_id"] for k, r in rows.items()}

    status = _cli("status", "--out", str(out))
    assert status.exit_code == 0 and "4 done" in status.output

    # calibration at scale stays one command over the sweep's root: the manifest folder holds no shard
    from calibrate.cli import main as calibrate_main

    try:
        calibrate_main([str(out), "--out", str(tmp_path / "results"), "--quiet"])
    except SystemExit as e:
        assert e.code in (0, None)
    import polars as pl

    metrics = pl.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert set(zip(metrics["dataset"], metrics["method"])) == {(d, m) for d in DATASETS for m in METHODS}


@pytest.mark.slow
def test_a_failure_is_recorded_and_retry_fixes_it(tmp_path, tiny_model_dir, data_root):
    # a private copy of the data with one unreadable eurosat image: every eurosat run fails, dtd is unaffected
    import shutil

    root = tmp_path / "data"
    shutil.copytree(data_root, root)
    bad = _image_paths(root, "eurosat")[2]
    good_bytes = bad.read_bytes()
    bad.write_bytes(b"not an image")
    out, cache = tmp_path / "out", tmp_path / "cache"

    res = _cli(*_grid_args(tiny_model_dir, root, out, cache))
    assert res.exit_code == 1, res.output + res.stderr
    rows = _manifest_states(out)
    for m in METHODS:
        assert rows[("dtd", m)]["state"] == "done"
        r = rows[("eurosat", m)]
        assert r["state"] == "failed" and r["attempts"] == 1
        assert r["error"].startswith("DatasetError: ") and bad.name in r["error"] and "\n" not in r["error"]
    status = _cli("status", "--out", str(out), "--state", "failed")
    assert status.exit_code == 0 and "2 failed" in status.output

    bad.write_bytes(good_bytes)
    fixed = _cli("retry", "--out", str(out))
    assert fixed.exit_code == 0, fixed.output + fixed.stderr
    after = _manifest_states(out)
    assert {r["state"] for r in after.values()} == {"done"}
    for m in METHODS:  # only the failures were resubmitted
        assert after[("dtd", m)]["job_id"] == rows[("dtd", m)]["job_id"] and after[("dtd", m)]["attempts"] == 1
        assert after[("eurosat", m)]["job_id"] != rows[("eurosat", m)]["job_id"]
        assert after[("eurosat", m)]["attempts"] == 2 and after[("eurosat", m)]["error"] == ""
        assert run_is_complete(out, RunSpec(RunOptions(m, "eurosat", backbone="tiny-clip"), ExecOptions(),
                                            "single").key)
    nothing = _cli("retry", "--out", str(out))
    assert nothing.exit_code == 0 and "nothing to retry" in nothing.output


def test_help_keeps_the_example_block_as_written(capsys):
    # issue 21: click re-wrapped the usage examples into one paragraph
    from extract.sweep.cli import main as sweep_main

    with pytest.raises(SystemExit):
        sweep_main(["--help"])
    out = capsys.readouterr().out
    assert "      zaec-sweep --config grid.toml [any option above overrides the file]\n" in out
    assert "      zaec-sweep retry  [--out DIR]         resubmit the failed and lost runs only\n" in out


def test_every_registered_method_is_priced_from_its_own_bench_rate(tmp_path):
    """A rates file that times every registered method (`bench-gpu --methods all`) prices each with its own rate,
    never a proxy's or a guess: n / rate, linear in K between the measured K; ECALP, whose cost per sample grows
    with the samples seen, from its rate at the mean stream position timed (`adapt_detail`), scaled to n (n + 1) / 2
    positions. A file without a method's own rate still prices C-TPT with TPT's."""
    from extract.sweep import cost

    per = {m: {"47": 10.0 + i, "1000": 1.0 + i / 10} for i, m in enumerate(REGISTRY)}
    detail = {m: {k: {"mean_position": 128.0, "skipped": ""} for k in v} for m, v in per.items()}
    vit = {**RATES_DOC["backbones"]["ViT-B-16"], "adapt_samples_per_s": per, "adapt_detail": detail}
    rates = load_rates(str(_write_rates(tmp_path / "all.json", {"version": 1, "backbones": {"ViT-B-16": vit}})))
    rel = 16 * sys.float_info.epsilon
    n = TEST_SIZES["dtd"]
    for m, v in per.items():
        got = cost.adapt_seconds(m, "dtd", n, "augmix", "ViT-B-16", rates)
        c = cost.ADAPT_COSTS[m]
        if m in cost.FIXED_PRICE:  # its bench runs a stand-in second model: priced from its work whatever the
            assert rates.measured("ViT-B-16", m) is None  # file says (DiffTPT's tiny pipeline)
            assert got == pytest.approx(_adapt_reference(m, n, NUM_CLASSES["dtd"], 64), rel=64 * rel, abs=0)
            continue
        assert rates.measured("ViT-B-16", m) == m
        want = 1 / v["47"] / 128.0 * n * (n + 1) / 2 if m == "ecalp" else n / v["47"]
        if c.solve:  # a transductive solve timed over a run of 257 positions (mean 128), grown as its work grows
            want *= (_adapt_reference(m, n, 47, 64) / n) / (_adapt_reference(m, 257, 47, 64) / 257)
        # the solves' growth: two sums of a few dozen positive terms, each a few roundings
        assert got == pytest.approx(want, rel=64 * rel if c.solve else rel, abs=0), m
        s1000 = cost.adapt_seconds(m, "imagenet", 10, "augmix", "ViT-B-16", rates) / 10
        want = 1 / v["1000"] / 128.0 * 11 / 2 if m == "ecalp" else 1 / v["1000"]
        if c.solve:
            want *= (_adapt_reference(m, 10, 1000, 64) / 10) / (_adapt_reference(m, 257, 1000, 64) / 257)
        assert s1000 == pytest.approx(want, rel=64 * rel if c.solve else rel, abs=0), m
    only_tpt = load_rates(str(_write_rates(tmp_path / "tpt.json")))
    assert only_tpt.measured("ViT-B-16", "ctpt") == "tpt" and only_tpt.measured("ViT-B-16", "dynaprompt") is None


def test_methods_all_is_every_registered_method(tmp_path, monkeypatch, tiny_externals):
    """Issue 35 item 11: `--methods all` as `--datasets all` and the demo's `--methods all` take it (the methods
    that read a second model get the tiny stand-ins: the dry run checks their files)."""
    captured: list[RunSpec] = []
    monkeypatch.setattr(sweep, "sweep_run", lambda runs, *a, **k: captured.extend(runs) or 0)
    externals = [f"{m}.{k}={v}" for m, cls in REGISTRY.items() if cls.external_files
                 for k, v in tiny_externals.overrides(m).items()]
    res = _cli("run", "--dry-run", "--skip-data-check", "--methods", "all", "--datasets", "dtd", "--out",
               str(tmp_path / "o"), *(a for e in externals for a in ("--set", e)))
    assert res.exit_code == 0, res.output
    assert [r.method for r in captured] == list(REGISTRY)
    assert [r.method for r in expand_grid(Grid(("tda", "all"), ("dtd",)), out=tmp_path)] == \
        ["tda", *(m for m in REGISTRY if m != "tda")]
