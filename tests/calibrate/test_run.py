"""Partial runs: `zaec-calibrate` and `zaec-calibrate tables` stop on a run whose shards hold fewer samples than
their writer announced (one line naming the run and the counts, exit 2), unless --allow-partial (then noted)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from calibrate.cli import main
from calibrate.run import calibrate_paths, check_complete
from calibrate.synthetic import synthetic_logits
from schemas.shard import (
    COMPLETE_MARKER,
    PartialRunError,
    find_shards,
    group_shards,
    run_completeness,
    shard_path,
    write_shard,
)


def _write_run(root, make_meta, rng, *, n=64, parts=4, dataset="imagenet", limit=None, announce=True,
               keep=None, marker=True):
    """A run of `n` samples in `parts` parts, announcing n_total = n (and `limit`); only parts `keep` are kept."""
    extra = {"zaec:n_total": str(n), "zaec:limit": "none" if limit is None else str(limit)} if announce else {}
    meta = make_meta(dataset=dataset, k=4, extra=extra)
    n_run = n if limit is None else min(limit, n)
    y, zs, tta = synthetic_logits(n_run, 4, rng)
    written = []
    for i, idx in enumerate(np.array_split(np.arange(n_run), parts)):
        if keep is None or i in keep:
            written.append(write_shard(shard_path(root, meta.key, i), meta, idx, y[idx], zs[idx], tta[idx],
                                       stream_pos=idx))
    if marker:
        (written[0].parent / COMPLETE_MARKER).write_text(json.dumps({"n_samples": n_run, "n_total": n}))
    return meta.key


def _cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_completeness_counts(tmp_path, make_meta, rng):
    _write_run(tmp_path / "a", make_meta, rng, keep={0, 1}, marker=False)
    (key, members), = group_shards(find_shards([tmp_path / "a"])).items()
    c = run_completeness(members)
    assert (c.n_rows, c.n_expected, c.marker, c.n_shards, c.partial) == (32, 64, False, 2, True)
    assert c.describe() == "32 of 64 samples in 2 shard(s), no completion marker"
    # a limited run announces min(limit, n_total): all of it is there, but it is a subset of the test set
    _write_run(tmp_path / "b", make_meta, rng, limit=20, parts=2)
    (_, members), = group_shards(find_shards([tmp_path / "b"])).items()
    c = run_completeness(members)
    assert (c.n_rows, c.n_expected, c.n_total, c.limit, c.marker) == (20, 20, 64, 20, True)
    assert (c.interrupted, c.subset, c.partial) == (False, True, True)
    assert c.describe() == "20 of 64 samples (--limit 20) in 2 shard(s)"
    # a limit at or above the test set's size covers all of it
    _write_run(tmp_path / "c", make_meta, rng, limit=64, parts=2)
    (_, members), = group_shards(find_shards([tmp_path / "c"])).items()
    c = run_completeness(members)
    assert (c.n_rows, c.n_total, c.limit, c.partial) == (64, 64, 64, False)
    # a limited run that was interrupted is reported as interrupted, with its limit
    _write_run(tmp_path / "d", make_meta, rng, limit=20, parts=2, keep={1}, marker=False)
    (_, members), = group_shards(find_shards([tmp_path / "d"])).items()
    c = run_completeness(members)
    assert (c.interrupted, c.subset) == (True, True)
    assert c.describe() == ("10 of 20 samples in 1 shard(s), no completion marker, a --limit 20 run of a "
                            "64-sample set")


@pytest.mark.parametrize("tables", [False, True], ids=["calibrate", "tables"])
def test_partial_run_stops_unless_allowed(tmp_path, make_meta, rng, capsys, tables):
    _write_run(tmp_path / "s", make_meta, rng, dataset="imagenet")  # complete
    key = _write_run(tmp_path / "s", make_meta, rng, dataset="dtd", keep={0, 1}, marker=False)  # 2 of 4 parts
    pre = ["tables"] if tables else []
    post = ["--bootstrap", "0"] if tables else []
    code, out, err = _cli([*pre, tmp_path / "s", "--out", tmp_path / "o", "--quiet", *post], capsys)
    assert code == 2
    line, = err.strip().splitlines()
    assert f"run {key} is incomplete: 32 of 64 samples in 2 shard(s), no completion marker" in line
    assert "--allow-partial" in line and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # nothing written
    code, out, err = _cli([*pre, tmp_path / "s", "--out", tmp_path / "o", *post, "--allow-partial"], capsys)
    assert code in (0, None), err
    notes = out + err
    if not tables:
        notes += json.dumps(json.loads((tmp_path / "o" / "notes.json").read_text())["notes"])
    else:
        notes += (tmp_path / "o" / "README.md").read_text()
    assert f"{key}: PARTIAL run, 32 of 64 samples" in notes
    assert "imagenet/tda/seed=1: PARTIAL" not in notes


def test_one_part_given_alone_is_partial(tmp_path, make_meta, rng):
    _write_run(tmp_path, make_meta, rng)
    one = sorted(tmp_path.rglob("part-00001.parquet"))
    with pytest.raises(PartialRunError, match="16 of 64 samples in 1 shard"):
        calibrate_paths(one, calibrators="none")


def test_other_writers_without_counts_keep_working(tmp_path, make_meta, rng):
    _write_run(tmp_path, make_meta, rng, announce=False, keep={0}, marker=False)
    report = calibrate_paths([tmp_path], calibrators="none")
    assert int(report.metrics["n"][0]) == 16
    assert any("completeness not checked for 1 run(s)" in n for n in report.notes)


def test_check_complete_notes_only_partial_runs(tmp_path, make_meta, rng):
    _write_run(tmp_path, make_meta, rng, dataset="dtd", limit=30, keep={0}, parts=2)  # marker, rows missing
    _write_run(tmp_path, make_meta, rng, dataset="imagenet")
    groups = group_shards(find_shards([tmp_path]))
    with pytest.raises(PartialRunError, match=r"15 of 30 samples in 1 shard\(s\)"):
        check_complete(groups)
    notes = check_complete(groups, allow_partial=True)
    assert len(notes) == 1 and "dtd" in notes[0] and "PARTIAL" in notes[0]


@pytest.mark.parametrize("tables", [False, True], ids=["calibrate", "tables"])
def test_limited_run_is_partial_for_every_reader(tmp_path, make_meta, rng, capsys, tables):
    """A finished `--limit 5` run of a 24-sample set is a subset: it stops both commands like an interrupted run;
    with --allow-partial the counts are on the screen, in notes.json and metrics.csv, or in the tables' README."""
    _write_run(tmp_path / "s", make_meta, rng, dataset="imagenet", n=24)  # complete: the TS source
    key = _write_run(tmp_path / "s", make_meta, rng, dataset="dtd", n=24, limit=5, parts=1)
    pre = ["tables"] if tables else []
    post = ["--bootstrap", "0"] if tables else []
    code, out, err = _cli([*pre, tmp_path / "s", "--out", tmp_path / "o", "--quiet", *post], capsys)
    assert code == 2
    line, = err.strip().splitlines()
    assert f"run {key} covers only part of its test set: 5 of 24 samples (--limit 5) in 1 shard(s)" in line
    assert "--allow-partial" in line and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    code, out, err = _cli([*pre, tmp_path / "s", "--out", tmp_path / "o", *post, "--allow-partial"], capsys)
    assert code in (0, None), err
    note = f"{key}: PARTIAL run, 5 of 24 samples (--limit 5)"
    assert note in out + err
    if tables:
        assert note in (tmp_path / "o" / "README.md").read_text()
        return
    assert any(note in n for n in json.loads((tmp_path / "o" / "notes.json").read_text())["notes"])
    assert "5 of 24" in out  # the printed table's n column
    m = pl.read_csv(tmp_path / "o" / "metrics.csv")
    counts = {r["dataset"]: (r["n"], r["n_total"], r["limit"]) for r in m.iter_rows(named=True)}
    assert counts == {"dtd": (5, 24, 5), "imagenet": (24, 24, None)}


def test_count_columns_are_null_for_other_writers(tmp_path, make_meta, rng):
    _write_run(tmp_path, make_meta, rng, announce=False, marker=False)
    m = calibrate_paths([tmp_path], calibrators="none").metrics
    assert m["n"].to_list() == [64, 64] and m["n_total"].null_count() == m["limit"].null_count() == 2


def _make_tables_line(**variables) -> str:
    """The command `make tables` runs (`make -n`: printed, not run), its continuation lines joined."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = ["make", "-n", "-s", "tables", "VENV=/nonexistent", *(f"{k}={v}" for k, v in variables.items())]
    out = subprocess.run(args, cwd=root, capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    (line,) = [ln for ln in out.splitlines() if "zaec-calibrate tables" in ln]
    return line


def test_make_tables_takes_allow_partial_and_its_refusal_names_the_make_form(tmp_path, make_meta, rng, capsys,
                                                                            monkeypatch):
    """Issue 35 item 7: `make tables` could not pass --allow-partial, yet its refusal said to. `ALLOW_PARTIAL=1`
    passes it, and the refusal of a run from make names that form."""
    import shlex

    assert "--allow-partial" in _make_tables_line(ALLOW_PARTIAL=1) and "--allow-partial" not in _make_tables_line()
    env, _, _ = _make_tables_line().partition(" /nonexistent/bin/zaec-calibrate")
    name, _, value = shlex.split(env)[0].partition("=")
    monkeypatch.setenv(name, value)
    _write_run(tmp_path / "s", make_meta, rng, dataset="dtd", keep={0, 1}, marker=False)
    code, out, err = _cli(["tables", tmp_path / "s", "--out", tmp_path / "o", "--quiet", "--bootstrap", "0"], capsys)
    (line,) = err.strip().splitlines()
    assert code == 2 and "or pass ALLOW_PARTIAL=1 (make tables ALLOW_PARTIAL=1) to use what is there" in line
    monkeypatch.delenv(name)
    code, out, err = _cli(["tables", tmp_path / "s", "--out", tmp_path / "o", "--quiet", "--bootstrap", "0"], capsys)
    assert code == 2 and "or pass --allow-partial to use what is there" in err
