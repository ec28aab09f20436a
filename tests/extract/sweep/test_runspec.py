"""`extract.sweep.runspec`: a sweep run is the extractor's `RunOptions` + `ExecOptions`; every option that decides
the result can be set in a sweep (command line and config file), the defaults are the extractor's, and the sweep's
finished-run check is the extractor's own."""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from extract import cli as extract_cli
from extract.datasets import get_dataset
from extract.run.options import MAX_CUDA_WORKERS, ExecOptions, RunOptions
from extract.sweep import cli as sweep_cli
from extract.sweep.errors import SweepError
from extract.sweep.grid import Grid, expand_grid, group_runs
from extract.sweep.manifest import MANIFEST_VERSION, Manifest, manifest_path
from extract.sweep.runspec import (
    FIXED_EXECUTION,
    GRID_FIELDS,
    RunSpec,
    check_finished_settings,
    finished_mismatches,
    sweep_exec_fields,
    sweep_run_fields,
)

from tests.support.extract import make_json_dataset

runner = CliRunner()


def _folder(root: Path) -> Path:
    """A user's dataset: two class folders of one 8x8 image each."""
    rng = np.random.default_rng(0)
    for cls in ("x", "y"):
        (root / cls).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / cls / "a.png")
    return root


def _values(tmp_path: Path) -> dict[str, object]:
    """A value other than the default for every option a sweep sets for all its runs, by field name."""
    return {"limit": 3, "anchor": "method", "data_root": tmp_path / "root", "cupl_dir": tmp_path / "cupl",
            "descriptions_dir": tmp_path / "descriptions",
            "sh_filter": True, "fingerprint": "content", "adapt_batch": 2, "part_size": 4,
            "out": tmp_path / "out", "cache_dir": tmp_path / "cache", "device": "cpu", "batch_size": 7,
            "workers": 3, "chunk_size": 9, "exif_transpose": True, "ood_for": "imagenet", "wait_lock": 30.0,
            "max_image_pixels": 1000}


def test_the_sweep_options_are_the_fields_of_the_run_options():
    names = {f.name for f in dataclasses.fields(RunOptions)}
    assert set(sweep_run_fields()) | set(GRID_FIELDS) == names and not set(sweep_run_fields()) & set(GRID_FIELDS)
    assert set(sweep_exec_fields()) | set(FIXED_EXECUTION) == {f.name for f in dataclasses.fields(ExecOptions)}
    params = inspect.signature(sweep_cli.run).parameters
    keys = [*sweep_run_fields().values(), *sweep_exec_fields().values(), *set(GRID_FIELDS.values())]
    missing = [k for k in keys if (k if k != "set" else "set_") not in params or k not in sweep_cli.CONFIG_KEYS]
    assert not missing, f"zaec-sweep run lacks an option or config key for {missing}"


@pytest.mark.parametrize("how", ["options", "config"])
def test_every_run_option_is_settable_in_a_sweep(how, tmp_path, monkeypatch):
    values = _values(tmp_path)
    assert set(values) == set(sweep_run_fields()) | set(sweep_exec_fields()), \
        "give the new option a value other than its default in _values"
    mine, names = _folder(tmp_path / "scans"), tmp_path / "names.txt"
    names.write_text("ex\nwhy\n")
    grid = {"methods": "tda", "datasets": f"mine=folder:{mine}", "class_names": {"mine": str(names)},
            "backbones": "RN50", "seeds": "3", "pretrained": "openai", "set": ["tda.alpha=2.5"]}
    by_key = {sweep_run_fields().get(f, f): v for f, v in values.items()}
    if how == "options":
        args = ["run", "--dry-run", "--skip-data-check", "--class-names", f"mine={names}", "--set", "tda.alpha=2.5"]
        args += [a for k, v in grid.items() if k not in ("class_names", "set") for a in (f"--{k}", v)]
        for k, v in by_key.items():
            args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    else:
        toml = "".join(f"{k} = {json.dumps(v if isinstance(v, (int, list)) else str(v))}\n"
                       for k, v in {**{k: v for k, v in grid.items() if k != "class_names"}, **by_key}.items())
        (tmp_path / "grid.toml").write_text(toml + f'skip_data_check = true\n[class_names]\nmine = "{names}"\n')
        args = ["run", "--dry-run", "--config", str(tmp_path / "grid.toml")]
    captured: list[RunSpec] = []
    monkeypatch.setattr(sweep_cli, "sweep_run", lambda runs, *a, **k: captured.extend(runs) or 0)
    res = runner.invoke(sweep_cli.app, args)
    assert res.exit_code == 0, res.output + res.stderr
    (run,) = captured
    absolute = {"data_root", "cupl_dir", "descriptions_dir", "out", "cache_dir"}
    for field, v in values.items():
        got = getattr(run.options if field in sweep_run_fields() else run.execution, field)
        assert got == (str(Path(v).resolve()) if field in absolute else v), field
    o = run.options
    assert (o.method, o.dataset, o.backbone, o.pretrained, o.seed, o.overrides) == (
        "tda", "mine", "RN50", "openai", 3, (("alpha", "2.5"),))
    assert (o.dataset_ref, o.class_names_file) == (f"folder:{mine.resolve()}", str(names.resolve()))
    assert all(getattr(run.execution, k) == v for k, v in FIXED_EXECUTION.items())


def test_defaults_are_the_extractors(tmp_path, monkeypatch):
    monkeypatch.delenv("ZAEC_DATA_ROOT", raising=False)
    monkeypatch.delenv("ZAEC_CUPL_DIR", raising=False)
    monkeypatch.delenv("ZAEC_DESCRIPTIONS_DIR", raising=False)
    monkeypatch.setenv("ZAEC_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.chdir(tmp_path)
    (run,) = expand_grid(Grid(("tda",), ("dtd",)))
    want = RunOptions("tda", "dtd", backbone="ViT-B-16", data_root=str(tmp_path / "data"),
                      overrides=(), dataset_ref=None)
    assert run.options == want
    assert run.execution == ExecOptions(out=str(tmp_path / "data" / "shards"), cache_dir=str(tmp_path / "env-cache"),
                                        **FIXED_EXECUTION)


@pytest.mark.parametrize("cli", [sweep_cli.run, extract_cli.extract])
def test_both_commands_state_the_extractors_loader_default(cli):
    text = " ".join(inspect.signature(cli).parameters["workers"].default.help.split())
    assert f"up to {MAX_CUDA_WORKERS} on CUDA, 0 on CPU" in text


def test_ood_runs_in_a_sweep(tmp_path, monkeypatch):
    """`zaec-sweep run --ood-for dtd`: each dataset becomes the OOD set of a mixed run keyed `<ood>@dtd` (its shard
    folder, group and cost count both sets); the data check lists both sets and shows a missing one's layout."""
    from extract.sweep.cost import n_images
    from extract.sweep.runspec import check_data

    captured: list[RunSpec] = []
    monkeypatch.setattr(sweep_cli, "sweep_run", lambda runs, *a, **k: captured.extend(runs) or 0)
    res = runner.invoke(sweep_cli.app, ["run", "--dry-run", "--skip-data-check", "--methods", "tda,zero-shot",
                                        "--datasets", "ninco,sun",
                                        "--ood-for", "dtd", "--out", str(tmp_path / "o"),
                                        "--data-root", str(tmp_path)])
    assert res.exit_code == 0, res.output + res.stderr
    assert sorted({r.dataset for r in captured}) == ["ninco@dtd", "sun@dtd"] and len(captured) == 4
    assert all(r.options.ood_for == "dtd" and "dataset=" + r.dataset in str(r.shard_dir) for r in captured)
    assert n_images("ninco@dtd") == 1692 + 5879
    with pytest.raises(Exception, match="dataset 'dtd' not found"):
        check_data(captured)
    make_json_dataset(tmp_path, "dtd", n_classes=2, per_class=1)
    with pytest.raises(Exception, match=r"NINCO/NINCO_OOD_classes/<any sub-folders>/<image>"):
        check_data(captured)
    res = runner.invoke(sweep_cli.app, ["run", "--dry-run", "--methods", "tda", "--datasets", "ninco",
                                        "--ood-for", "ninco", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "is an out-of-distribution set (no classes)" in res.stderr, res.stderr


@pytest.mark.parametrize("args, message", [
    (["--limit", "0"], "--limit must be >= 1, got 0"),
    (["--fingerprint", "md5"], "unknown fingerprint mode 'md5'; available: stat, content"),
    (["--adapt-batch", "3", "--part-size", "8"], "part_size (8) must be a multiple of adapt_batch (3)"),
    (["--adapt-batch", "0"], "--adapt-batch must be >= 1, got 0"),
    (["--anchor", "both"], "unknown anchor 'both'"),
])
def test_bad_run_options_are_one_line(args, message, tmp_path):
    res = runner.invoke(sweep_cli.app, ["run", "--methods", "tda", "--datasets", "dtd", "--out", str(tmp_path / "o"),
                                        "--dry-run", *args])
    assert res.exit_code == 2 and message in res.stderr and "Traceback" not in res.output + res.stderr, res.stderr


def test_a_config_value_of_the_wrong_type_is_one_line(tmp_path):
    (tmp_path / "g.toml").write_text('methods = "tda"\ndatasets = "dtd"\nlimit = "many"\ntda_sh_filter = "yes"\n')
    res = runner.invoke(sweep_cli.app, ["run", "--config", str(tmp_path / "g.toml"), "--out", str(tmp_path / "o"),
                                        "--dry-run"])
    assert res.exit_code == 2 and "--limit: expected an integer, got 'many'" in res.stderr, res.stderr


def test_a_manifest_of_an_older_sweep_is_one_line(tmp_path):
    manifest_path(tmp_path).parent.mkdir(parents=True)
    manifest_path(tmp_path).write_text(json.dumps({"version": 1, "runs": []}))
    assert MANIFEST_VERSION > 1
    with pytest.raises(SweepError, match="made by an older zaec-sweep; start a new sweep with another --out"):
        Manifest.load(tmp_path)
    res = runner.invoke(sweep_cli.app, ["status", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "older zaec-sweep" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    with pytest.raises(SweepError, match="older zaec-sweep"):
        RunSpec.from_dict({"method": "tda", "dataset": "dtd", "backbone": "RN50", "seed": 1})


def test_spec_round_trip(tmp_path):
    for run in expand_grid(Grid(("tda", "tpt"), ("dtd", "imagenet_a"), overrides=("tda.alpha=3",)), out=tmp_path,
                           limit=5, sh_filter=True):
        assert RunSpec.from_dict(json.loads(json.dumps(run.to_dict()))) == run


# ---------------------------------------------------------------------------------------------------------------
# the finished-run check is the extractor's: a finished run that differs in what the extractor compares is refused

@pytest.fixture()
def finished(tmp_path, tiny_model_dir):
    """A sweep over dtd (6 images) whose zero-shot run finished through the sweep's own job function."""
    from extract.sweep.job import run_group

    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=2, per_class=3)
    kw = {"out": tmp_path / "out", "data_root": root, "cache_dir": tmp_path / "cache", "device": "cpu"}
    runs = expand_grid(Grid(("zero-shot",), ("dtd",), (), pretrained=f"local-dir:{tiny_model_dir}"), **kw)
    (group,) = group_runs(runs)
    assert [r["state"] for r in run_group(group, "tok")] == ["done"]
    return runs, kw


def _rename_a_class(root: Path) -> None:
    """Another class name in dtd's split file: the same image files, another sample list."""
    lay = get_dataset("dtd").layouts[0]
    path = root / lay.dataset_dir / lay.split_file
    split = json.loads(path.read_text())
    split["test"] = [[rel, y, name + " renamed" if y == 0 else name] for rel, y, name in split["test"]]
    path.write_text(json.dumps(split))


@pytest.mark.parametrize("change, field", [("pretrained", "pretrained"), ("sh_filter", "sh_filter"),
                                           ("samples", "samples")])
def test_a_finished_run_with_other_settings_is_refused(change, field, finished, tmp_path, tiny_model_dir):
    runs, kw = finished
    assert finished_mismatches(runs) == []  # the same sweep: the recorded pretrained string is the sweep's
    check_finished_settings(runs)
    weights = f"local-dir:{tiny_model_dir}"
    if change == "pretrained":  # the same model under another folder: the backbone name is the same
        weights = f"local-dir:{shutil.copytree(tiny_model_dir, tmp_path / 'copy')}"
    elif change == "samples":
        _rename_a_class(kw["data_root"])
    other = expand_grid(Grid(("zero-shot",), ("dtd",), (), pretrained=weights), **kw,
                        sh_filter=change == "sh_filter")
    assert [r.key for r in other] == [r.key for r in runs]
    ((run, why),) = finished_mismatches(other)
    assert why.split(" (")[0] == field, why
    with pytest.raises(SweepError, match=rf"1 finished run\(s\) used other settings .*\({field}"):
        check_finished_settings(other)


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_sweep_whose_limit_a_finished_longer_run_cannot_serve_is_refused_before_submitting(finished, dry_run):
    """Issue 35 item 1: a `--limit 5` sweep over a finished 6-sample run (5 ends no adapt call of 64) would replace
    it; refused with the extractor's reason in one line, dry run or not, nothing submitted, the run unchanged. A
    limit the run serves (6 and more: the whole set) is skipped as complete."""
    runs, kw = finished
    folder = runs[0].shard_dir
    before = sorted((p.name, p.stat().st_mtime_ns) for p in Path(folder).iterdir())
    args = ["run", "--methods", "zero-shot", "--datasets", "dtd", "--pretrained", runs[0].pretrained, "--data-root",
            str(kw["data_root"]), "--out", str(kw["out"]), "--cache-dir", str(kw["cache_dir"]), "--device", "cpu"]
    res = runner.invoke(sweep_cli.app, [*args, "--limit", "5", "--dry-run" if dry_run else "--no-wait"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "1 run(s) would replace a finished longer run" in err[0], res.stderr
    assert f"the finished run under {folder} holds 6 samples" in err[0] and "adapt_batch 64" in err[0]
    assert "another --out" in err[0] and "zaec-extract --force" in err[0]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in Path(folder).iterdir()) == before
    assert not (Path(kw["out"]) / "_sweep" / "manifest.json").exists()
    res = runner.invoke(sweep_cli.app, [*args, "--limit", "6", "--dry-run"])
    assert res.exit_code == 0 and "1 complete (skipped)" in " ".join(res.output.split()), res.output


# --- issue 35 item 5: a dry run refuses everything a submission refuses ------------------------------------------

def _no_submission(monkeypatch):
    """Make any submission fail loudly: a check that let a bad run through would submit it."""
    from extract.sweep import submit

    class Refuse:
        def __init__(self, *a, **k):
            raise AssertionError("a job was submitted")

    monkeypatch.setattr(submit, "_import_submitit", lambda: type("stub", (), {"SlurmExecutor": Refuse,
                                                                            "LocalExecutor": Refuse}))


REFUSALS = {
    "unknown backbone": (["--pretrained", "openai", "--backbones", "ViT-B-61"], "unknown backbone 'ViT-B-61'"),
    "unknown pretrained tag": (["--pretrained", "nosuchtag", "--backbones", "RN50"],
                               "unknown pretrained tag 'nosuchtag' for RN50"),
    "missing checkpoint": (["--pretrained", "{tmp}/nope/w.safetensors", "--backbones", "ViT-B-16"],
                           "w.safetensors does not exist"),
    "missing local-dir": (["--pretrained", "local-dir:{tmp}/nope"], "no such directory"),
    "data root": (["--data-root", "{tmp}/nonexistent"], "nonexistent (from --data-root) is not a directory"),
    "dataset missing": (["--data-root", "{tmp}/mine"], "dataset 'dtd' not found under data root"),
    "split file": (["--datasets", "split:{tmp}/nope.json"], "nope.json"),
    "folder set": (["--datasets", "folder:{tmp}/nope"], "is not a folder"),
    "class names file": (["--datasets", "mine=folder:{tmp}/mine", "--class-names", "mine={tmp}/nope.txt"],
                         "not a readable text file"),
    "unknown --ood-for": (["--ood-for", "nosuch"], "unknown dataset 'nosuch'"),
    "--ood-for folder": (["--ood-for", "folder:{tmp}/nope"], "is not a folder"),
    "bad --set": (["--set", "zero-shot.nope=1"], "valid keys"),
    "rates file": (["--rates", "{tmp}/nope.json"], "cannot read a JSON file"),
    "slurm setup": (["--executor", "slurm", "--slurm-setup", "source {tmp}/nope/activate"],
                    "does not exist on this machine"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_dry_run_refuses_what_the_submission_refuses(case, tmp_path, tiny_model_dir, monkeypatch):
    """docs/sweep.md: every name is resolved before anything is submitted, dry run included. Each refusal of the
    real command (exit 2, one message, nothing submitted) is the dry run's too, word for word (the real command
    may add what it recorded: a refused submission's rows in the manifest)."""
    _no_submission(monkeypatch)
    make_json_dataset(tmp_path / "data", "dtd", n_classes=2, per_class=2)
    _folder(tmp_path / "mine")
    extra, message = REFUSALS[case]
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    base = ["run", "--methods", "zero-shot", "--datasets", "dtd", "--pretrained", f"local-dir:{tiny_model_dir}",
            "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--cache-dir",
            str(tmp_path / "cache"), "--device", "cpu", "--no-wait"]
    args = base + extra  # a later option wins
    said = []
    for mode in ([], ["--dry-run"]):
        res = runner.invoke(sweep_cli.app, [*args, *mode])
        assert res.exit_code == 2 and "Traceback" not in res.output, (mode, res.output)
        assert message in " ".join(res.stderr.split()), (mode, res.stderr)
        said.append(" ".join(res.stderr.split()))
    assert said[0].startswith(said[1])
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_a_retry_dry_run_refuses_the_slurm_setup_its_submission_refuses(tmp_path, monkeypatch):
    """`retry --dry-run` shares the dry run's plan (`render_plan`), so it refuses a `--slurm-setup` line that
    sources a missing file, word for word as `retry` does, and submits nothing."""
    _no_submission(monkeypatch)
    out = tmp_path / "out"
    manifest = Manifest(out)
    manifest.executor = {"executor": "slurm", "slurm_setup": [f"source {tmp_path}/nope/activate"]}
    run = RunSpec(RunOptions("tda", "dtd", backbone="RN50"), ExecOptions(out=str(out)), "single")
    manifest.record_not_submitted(run, error="sbatch refused", executor="slurm")
    manifest.save()
    said = []
    for mode in (["--dry-run"], []):
        res = runner.invoke(sweep_cli.app, ["retry", "--out", str(out), "--no-wait", *mode])
        assert res.exit_code == 2 and "Traceback" not in res.output, (mode, res.output)
        said.append(" ".join(res.stderr.split()))
        assert "does not exist on this machine" in said[-1], (mode, res.stderr)
    assert said[1].startswith(said[0]), said  # the submission adds the runs it recorded as failed


def test_the_refusals_cover_what_the_command_checks(tmp_path, tiny_model_dir, monkeypatch):
    """The baseline of the cases above submits (to the stub): each case's refusal is its own option's."""
    _no_submission(monkeypatch)
    make_json_dataset(tmp_path / "data", "dtd", n_classes=2, per_class=2)
    args = ["run", "--methods", "zero-shot", "--datasets", "dtd", "--pretrained", f"local-dir:{tiny_model_dir}",
            "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--cache-dir",
            str(tmp_path / "cache"), "--device", "cpu", "--no-wait"]
    assert runner.invoke(sweep_cli.app, [*args, "--dry-run"]).exit_code == 0
    res = runner.invoke(sweep_cli.app, args)
    assert res.exit_code == 2 and "a job was submitted" in res.stderr, res.output


def test_a_last_batch_of_one_image_is_refused_before_submitting(tmp_path, monkeypatch):
    """`zaec-extract` refuses a run whose last batch holds one image a method on batch statistics cannot adapt
    (a ResNet whose last stage is 1x1): the set's size decides it, so the sweep checks it once it has listed the
    sets, dry run included, with the extractor's line and the run it refuses; a batch size that leaves no such
    batch submits."""
    from tests.support.extract import make_tiny_model_dir

    _no_submission(monkeypatch)
    make_json_dataset(tmp_path / "data", "dtd", n_classes=2, per_class=2)  # 4 images
    rn = make_tiny_model_dir(tmp_path / "rn-32px", model_name="RN-32px", vision="rn")
    args = ["run", "--methods", "clipartt", "--datasets", "dtd", "--pretrained", f"local-dir:{rn}",
            "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--cache-dir",
            str(tmp_path / "cache"), "--device", "cpu", "--no-wait", "--part-size", "6"]  # a multiple of 2 and 3
    for mode in ([], ["--dry-run"]):
        res = runner.invoke(sweep_cli.app, [*args, "--set", "clipartt.batch_size=3", *mode])
        assert res.exit_code == 2 and "Traceback" not in res.output, (mode, res.output)
        said = " ".join(res.stderr.split())
        assert "RN-32px/dtd/clipartt" in said and "clipartt normalises the BatchNorms of a ResNet" in said, said
        assert "4 samples in batches of 3 leave one in the last" in said, said
    assert runner.invoke(sweep_cli.app, [*args, "--set", "clipartt.batch_size=2", "--dry-run"]).exit_code == 0
    res = runner.invoke(sweep_cli.app, [*args, "--set", "clipartt.batch_size=2"])
    assert res.exit_code == 2 and "a job was submitted" in res.stderr, res.output
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_ood_for_a_folder_set_in_a_sweep(tmp_path, tiny_model_dir, monkeypatch):
    """`--ood-for NAME=folder:PATH` with `--class-names NAME=FILE`, as `zaec-extract --ood-for folder:PATH` takes
    it: the runs are keyed `<ood>@NAME`, carry the set's source, and a job in a fresh process (no dataset
    registered) registers it from the spec and runs."""
    import extract.datasets as ds
    from extract.sweep.job import run_group

    ind, ood = _folder(tmp_path / "scans"), tmp_path / "odd"
    (ood / "any").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(ood / "any" / "z.png")
    names = tmp_path / "names.txt"
    names.write_text("ex\nwhy\n")
    captured: list[RunSpec] = []
    monkeypatch.setattr(sweep_cli, "sweep_run", lambda runs, *a, **k: captured.extend(runs) or 0)
    res = runner.invoke(sweep_cli.app, ["run", "--dry-run", "--methods", "zero-shot", "--datasets",
                                        f"folder:{ood}", "--ood-for", f"mine=folder:{ind}", "--class-names",
                                        f"mine={names}", "--pretrained", f"local-dir:{tiny_model_dir}", "--out",
                                        str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
                                        "--device", "cpu"])
    assert res.exit_code == 0, res.output + res.stderr
    (run,) = captured
    assert run.dataset == "odd@mine" and run.options.ood_for == "mine"
    assert (run.options.ood_for_ref, run.options.ood_for_class_names_file) == (f"folder:{ind.resolve()}",
                                                                                str(names.resolve()))
    spec = RunSpec.from_dict(json.loads(json.dumps(run.to_dict())))
    monkeypatch.setattr(ds, "_USER_SPECS", {})  # a worker's process: nothing registered
    assert [r["state"] for r in run_group(group_runs([spec])[0], "tok")] == ["done"]
    (shard,) = Path(run.shard_dir).glob("part-*.parquet")
    from schemas.shard import read_shard

    sh = read_shard(shard)
    assert sh.meta.class_names == ("ex", "why") and len(sh.sample_id) == 3


def test_class_names_for_a_registered_ood_for_key_are_refused(tmp_path):
    """`--class-names KEY=FILE` names a user's folder:/split: set; `--ood-for dtd` is a registered key with its own
    class names, so the file would be dropped: one line, as `zaec-extract --ood-for dtd --class-names FILE` refuses
    it."""
    names = tmp_path / "names.txt"
    names.write_text("ex\nwhy\n")
    res = runner.invoke(sweep_cli.app, ["run", "--dry-run", "--skip-data-check", "--methods", "tda", "--datasets",
                                        "ninco", "--ood-for", "dtd", "--class-names", f"dtd={names}", "--out",
                                        str(tmp_path / "o")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("zaec-sweep: error: --class-names dtd=...: no folder:PATH or split:FILE.json dataset"), line
