"""extract/run/options.py: RunOptions round trip, defaults from one place, the planned run, the option checks."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from extract import defaults
from extract.defaults import DEFAULT_BACKBONE, default_cache_dir, default_cupl_dir, default_data_root
from extract.run.options import ExecOptions, RunError, RunOptions, check_options, plan
from schemas.shard import RunKey

FULL = RunOptions("tda", "dtd", backbone="RN50", pretrained="openai", seed=3, limit=7,
                  overrides=(("alpha", "2.0"), ("beta", 5)), anchor="method", data_root="/d", cupl_dir="/c",
                  sh_filter=True, fingerprint="content", adapt_batch=2, part_size=8, dataset_ref="folder:/x",
                  class_names_file="/x/names.txt")


@pytest.mark.parametrize("opts", [RunOptions("zero-shot", "dtd"), FULL], ids=["defaults", "every field"])
def test_round_trip_through_json(opts):
    doc = json.loads(json.dumps(opts.to_dict()))
    assert RunOptions.from_dict(doc) == opts
    assert set(doc) == {f.name for f in dataclasses.fields(RunOptions)}  # every field is serialised


def test_overrides_keep_their_order():
    opts = RunOptions.make("tda", "dtd", overrides={"b": "1", "a": "2"})
    assert opts.overrides == (("b", "1"), ("a", "2"))
    assert list(RunOptions.from_dict(opts.to_dict()).overrides_dict()) == ["b", "a"]


def test_from_dict_names_unknown_and_missing_keys():
    with pytest.raises(RunError, match="unknown run option.*colour.*available:"):
        RunOptions.from_dict({"method": "tda", "dataset": "dtd", "colour": 1})
    with pytest.raises(RunError, match="lack dataset"):
        RunOptions.from_dict({"method": "tda"})


def test_defaults_live_in_one_place(monkeypatch, tmp_path):
    import extract.cache
    import extract.models
    import extract.runner

    # the model loader and the options read the one default backbone, at the bottom of the house
    assert extract.models.DEFAULT_BACKBONE is DEFAULT_BACKBONE == "ViT-B-16"
    sig = inspect.signature(extract.runner.run_extraction).parameters
    opts, execution = RunOptions("m", "d"), ExecOptions()
    for name, param in sig.items():  # run_extraction's defaults are the options' defaults
        if param.default is inspect.Parameter.empty or name == "overrides":  # (None there, () here)
            continue
        if hasattr(opts, name):
            assert param.default == getattr(opts, name), name
        elif hasattr(execution, name):
            assert param.default == getattr(execution, name), name
    monkeypatch.delenv(defaults.DATA_ROOT_ENV, raising=False)
    monkeypatch.delenv(defaults.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv(defaults.CUPL_DIR_ENV, raising=False)
    assert (default_data_root(), default_cache_dir(), default_cupl_dir()) == (Path("data"), Path("data/cache"), None)
    monkeypatch.setenv("ZAEC_DATA_ROOT", str(tmp_path / "d"))
    monkeypatch.setenv("ZAEC_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("ZAEC_CUPL_DIR", str(tmp_path / "u"))
    assert (default_data_root(), default_cache_dir(), default_cupl_dir()) == (tmp_path / "d", tmp_path / "c",
                                                                               tmp_path / "u")
    assert extract.cache.resolve_cache_dir(None) == default_cache_dir()


def test_plan_resolves_names_and_settings():
    planned = plan(RunOptions.make("tda", "dtd", seed=2, overrides={"alpha": "2.5"}))
    assert planned.key == RunKey("ViT-B-16", "dtd", "tda", 2)
    assert (planned.backbone, planned.dataset, planned.key.seed) == ("ViT-B-16", "dtd", 2)
    assert planned.config.alpha == 2.5 and planned.config_dict()["alpha"] == 2.5
    assert planned.policy == "single" and not planned.episodic
    assert planned.n_run(5) == 5 and plan(RunOptions("tda", "dtd", limit=3)).n_run(5) == 3


@pytest.mark.parametrize("opts,message", [
    (RunOptions("tda", "dtd", anchor="both"), "unknown anchor 'both'; available: single, method"),
    (RunOptions("tda", "dtd", limit=0), "--limit must be >= 1"),
    (RunOptions("tda", "dtd", seed=-1), "seed must be >= 0"),
    (RunOptions("tda", "dtd", part_size=10, adapt_batch=4), "multiple of adapt_batch"),
    (RunOptions("tent", "dtd", part_size=100, adapt_batch=4, overrides=(("batch_size", "8"),)),
     r"tent adapts in batches of 8 samples: --part-size \(100\) must be a multiple of it \(e.g. --part-size 96\)"),
])
def test_plan_refuses_bad_options(opts, message):
    with pytest.raises(RunError, match=message):
        plan(opts)


@pytest.mark.parametrize("opts,execution,message", [
    (RunOptions("tda", "dtd"), ExecOptions(batch_size=0), "--batch-size must be a positive integer"),
    (RunOptions("tda", "dtd"), ExecOptions(workers=-1), "--workers must be >= 0"),
    (RunOptions("tda", "dtd"), ExecOptions(on_changed="ignore"), "on_changed must be"),
])
def test_check_options(tmp_path, opts, execution, message):
    execution = dataclasses.replace(execution, out=tmp_path / "o", cache_dir=tmp_path / "c")
    with pytest.raises(RunError, match=message):
        check_options(opts, execution)


def test_check_options_refuses_a_file_as_out(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(RunError, match=r"--out .*is a file, expected a folder"):
        check_options(RunOptions("tda", "dtd"), ExecOptions(out=tmp_path / "f", cache_dir=tmp_path / "c"))
