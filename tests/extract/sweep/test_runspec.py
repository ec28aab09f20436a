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
            "workers": 3, "chunk_size": 9, "exif_transpose": True, "ood_for": "imagenet", "wait_lock": 30.0}


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
        args = ["run", "--dry-run", "--class-names", f"mine={names}", "--set", "tda.alpha=2.5"]
        args += [a for k, v in grid.items() if k not in ("class_names", "set") for a in (f"--{k}", v)]
        for k, v in by_key.items():
            args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    else:
        toml = "".join(f"{k} = {json.dumps(v if isinstance(v, (int, list)) else str(v))}\n"
                       for k, v in {**{k: v for k, v in grid.items() if k != "class_names"}, **by_key}.items())
        (tmp_path / "grid.toml").write_text(toml + f'[class_names]\nmine = "{names}"\n')
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
    res = runner.invoke(sweep_cli.app, ["run", "--dry-run", "--methods", "tda,zero-shot", "--datasets", "ninco,sun",
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
