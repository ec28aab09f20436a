"""The run serving the transductive methods (`consumes = "set_features"`: StatA, TransCLIP, ZLaP) on a tiny model:
the shards record the transductive unit, an interrupted run (Ctrl-C) rerun equals an uninterrupted one, a `--limit`
run is its own run, and `zaec-extract --method NAME` runs each on a `folder:` set."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from extract.cli import app
from extract.methods import REGISTRY
from extract.run import writer as run_writer
from extract.run.options import RunError
from extract.run.rundir import run_is_complete
from extract.runner import run_extraction
from schemas.shard import RunKey, find_shards, read_shard

from tests.support.extract import interrupt_nth_write, make_json_dataset, shard_columns, write_image

SMALL = dict(part_size=8, adapt_batch=4, chunk_size=5, batch_size=3, progress=False)
TRANSDUCTIVE = sorted(k for k, cls in REGISTRY.items() if cls.consumes == "set_features")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)  # 18 samples: parts [0, 8), [8, 16), [16, 18)
    return root


def _run(method, out, model, data_root, **kw):
    args = dict(SMALL, data_root=data_root, out=out / "out", cache_dir=out.parent / "cache", model=model)
    args.update(kw)
    return run_extraction(method, "dtd", **args)


def test_the_methods_are_registered():
    assert TRANSDUCTIVE == ["stata", "stata-online", "transclip", "zlap", "zlap-inductive"]


@pytest.mark.parametrize("method, unit, recorded", [("stata", None, "all"), ("stata-online", None, "128"),
                                                     ("zlap", "8", "8")])
def test_shards_record_the_unit(tmp_path, tiny_model, data_root, method, unit, recorded):
    paths = _run(method, tmp_path, tiny_model, data_root, overrides={"unit": unit} if unit else None)
    assert {read_shard(p).meta.extra["zaec:transductive_unit"] for p in paths} == {recorded}
    assert read_shard(paths[0]).meta.transductive_unit == (recorded if recorded == "all" else int(recorded))


def test_a_batch_unit_is_each_batch_solved_alone(tmp_path, tiny_model, data_root):
    """unit 8: the rows of positions 8..15 are those of a run whose stream is cut there (the same solve of the
    same 8 features), and differ from the whole run's."""
    batch = shard_columns(_run("stata", tmp_path / "b", tiny_model, data_root, overrides={"unit": "8"}))
    whole = shard_columns(_run("stata", tmp_path / "w", tiny_model, data_root))
    first8 = shard_columns(_run("stata", tmp_path / "f", tiny_model, data_root, limit=8))
    np.testing.assert_array_equal(batch["tta_logits"][:8], first8["tta_logits"])
    assert not np.allclose(batch["tta_logits"], whole["tta_logits"])
    np.testing.assert_array_equal(batch["zs_logits"], whole["zs_logits"])  # paired with the same zero-shot rows


@pytest.mark.parametrize("method, overrides, nth, kept_after", [
    ("transclip", None, 3, []),  # whole run: parts 0..1 were written, none kept (all 3 rewritten from one solve)
    ("zlap", None, 2, []),
    ("stata-online", {"unit": "8"}, 3, ["part-00000.parquet", "part-00001.parquet"]),  # units = parts: kept
    ("zlap-inductive", {"unit": "12"}, 3, []),  # parts 0..1 end inside the unit [8, 16): none kept
])
def test_interrupted_run_rerun_equals_uninterrupted(tmp_path, tiny_model, data_root, monkeypatch, method, overrides,
                                                    nth, kept_after):
    full = shard_columns(_run(method, tmp_path / "full", tiny_model, data_root, overrides=overrides))
    real_write = interrupt_nth_write(monkeypatch, nth)
    with pytest.raises(KeyboardInterrupt):
        _run(method, tmp_path / "r", tiny_model, data_root, overrides=overrides)
    monkeypatch.setattr(run_writer, "write_shard", real_write)
    out = tmp_path / "r" / "out"
    assert not run_is_complete(out, RunKey("tiny-clip", "dtd", method, 1))
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("part-*.parquet")}
    lines: list[str] = []
    resumed = shard_columns(_run(method, tmp_path / "r", tiny_model, data_root, overrides=overrides, log=lines.append))
    after = {p.name: p.stat().st_mtime_ns for p in out.rglob("part-*.parquet")}
    assert sorted(n for n in before if before[n] == after[n]) == kept_after  # the parts kept, untouched
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])
    if not kept_after:
        assert any("transductive unit" in ln and "recomputed" in ln for ln in lines)


def test_a_limit_run_is_its_own_run(tmp_path, tiny_model, data_root):
    """A finished 18-sample TransCLIP run never serves --limit 8, and never gives way to it unforced (issue 35
    item 1): the 8-sample run is refused there, naming the finished run and why; elsewhere, or forced, it is solved
    over its 8 samples."""
    full = shard_columns(_run("transclip", tmp_path, tiny_model, data_root))
    with pytest.raises(RunError) as refused:
        _run("transclip", tmp_path, tiny_model, data_root, limit=8)
    msg = str(refused.value)
    assert "holds 18 samples" in msg and "solves the whole run's features jointly" in msg and "--force" in msg
    np.testing.assert_array_equal(shard_columns(_run("transclip", tmp_path, tiny_model, data_root))["tta_logits"],
                                  full["tta_logits"])  # the finished run is untouched (and served)
    limited = shard_columns(_run("transclip", tmp_path, tiny_model, data_root, limit=8, force=True))
    fresh = shard_columns(_run("transclip", tmp_path / "fresh", tiny_model, data_root, limit=8))
    for k, v in fresh.items():
        np.testing.assert_array_equal(limited[k], v)
    assert not np.array_equal(full["tta_logits"][:8], fresh["tta_logits"])


@pytest.fixture(scope="module")
def folder_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder-set")
    rng = np.random.default_rng(5)
    for cls in ("cat", "dog", "fox"):
        for i in range(4):
            write_image(root / cls / f"{i}.png", rng)
    return root


@pytest.mark.parametrize("method", TRANSDUCTIVE)
def test_cli_runs_each_on_a_folder_set(tmp_path, tiny_model_dir, folder_set, method):
    r = CliRunner().invoke(app, ["--method", method, "--dataset", f"folder:{folder_set}", "--out",
                                 str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--pretrained",
                                 f"local-dir:{tiny_model_dir}", "--device", "cpu", "--quiet"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    shards = [read_shard(p) for p in find_shards([tmp_path / "out"])]
    assert sum(len(s) for s in shards) == 12 and all(np.isfinite(s.tta_logits).all() for s in shards)
    meta = shards[0].meta
    assert meta.method_config["prompts"] == "single" and "zaec:transductive_unit" in meta.extra
