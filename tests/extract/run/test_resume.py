"""extract/run/resume.py: the read-only resume scan against a table of directory states, then the rewrites it calls
for (`apply_resume`). No model: parts are written with `schemas.shard.write_shard` from random logits."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from extract.run.options import RunError
from extract.run.resume import ResumeScope, apply_resume, scan_resume, settings_kv
from extract.run.rundir import RunDir
from schemas.shard import RunKey, ShardMeta, read_shard, write_shard

KEY = RunKey("tiny", "dtd", "tda", 1)
K, PART, N_RUN = 3, 4, 10  # parts: [0, 4), [4, 8), [8, 10)


def _meta(**extra: str) -> ShardMeta:
    base = {"zaec:data_fingerprint": "stat:abc", "zaec:limit": "none"}
    return ShardMeta(backbone="tiny", pretrained="x", dataset="dtd", method="tda", seed=1,
                     class_names=("a", "b", "c"), extra={**base, **extra})


def _write(rd: RunDir, p: int, meta: ShardMeta, *, n_run: int = N_RUN, pos=None, state=None, seed=0):
    lo, hi = p * PART, min((p + 1) * PART, n_run)
    rng = np.random.default_rng(seed + 10 * p)
    n = hi - lo
    pos = np.arange(lo, hi) if pos is None else np.asarray(pos)
    extra = dict(meta.extra)
    if state is not None:
        extra["zaec:method_state"] = json.dumps(state)
    extra["zaec:method_summary"] = json.dumps({"p": p})
    write_shard(rd.part(p), dataclasses.replace(meta, extra=extra), np.arange(lo, hi), rng.integers(0, K, n),
                rng.normal(size=(n, K)), rng.normal(size=(n, K)), stream_pos=pos)


def _correct(rd: RunDir, parts: range) -> tuple[int, int]:
    """Slow reference: correct predictions of the given parts, read back one row at a time."""
    tta = zs = 0
    for p in parts:
        sh = read_shard(rd.part(p))
        for i in range(len(sh.label)):
            tta += int(np.argmax(sh.tta_logits[i]) == sh.label[i])
            zs += int(np.argmax(sh.zs_logits[i]) == sh.label[i])
    return tta, zs


def _snapshot(rd: RunDir) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in rd.path.iterdir()} if rd.path.is_dir() else {}


def _scope(**kw) -> ResumeScope:
    return ResumeScope(**{"expected": settings_kv(_meta()), "n_run": N_RUN, "part_size": PART, **kw})


def _state(n_seen: int) -> dict:
    return {"key": "tps", "n_seen": n_seen, "loss_scale": {"scale": 1.0}, "skipped_steps": 0}


def _setup_all(rd):
    for p in range(3):
        _write(rd, p, _meta())


def _setup_gap(rd):
    _write(rd, 0, _meta())
    _write(rd, 2, _meta())


def _setup_corrupt(rd):
    _write(rd, 0, _meta())
    rd.part(1).write_bytes(b"not parquet")
    _write(rd, 2, _meta())


def _setup_no_fingerprint(rd):
    _write(rd, 0, _meta())
    _write(rd, 1, dataclasses.replace(_meta(), extra={"zaec:limit": "none"}))


def _setup_bad_positions(rd):
    _write(rd, 0, _meta())
    _write(rd, 1, _meta(), pos=[4, 5, 7, 6])


def _setup_other_settings(rd):
    _write(rd, 0, _meta())
    _write(rd, 1, _meta(**{"zaec:views": "augmix"}))


def _setup_other_limit(rd):
    _write(rd, 0, _meta(**{"zaec:limit": "8"}))
    _write(rd, 1, _meta(**{"zaec:limit": "8"}))


def _setup_two(rd):
    _write(rd, 0, _meta())
    _write(rd, 1, _meta())


# (name, setup, scope options, start_part, restamped parts, refusal expected)
TABLE = [
    ("empty", lambda rd: None, {}, 0, (), False),
    ("all kept", _setup_all, {}, 3, (), False),
    ("gap ends the prefix", _setup_gap, {}, 1, (), False),
    ("unreadable part", _setup_corrupt, {}, 1, (), False),
    ("written before data fingerprints", _setup_no_fingerprint, {}, 1, (), False),
    ("positions out of order", _setup_bad_positions, {}, 1, (), False),
    ("other settings, refused", _setup_other_settings, {}, 1, (), True),
    ("other settings, recomputed", _setup_other_settings, {"recompute_changed": True}, 1, (), False),
    ("another limit: kept, restamped", _setup_other_limit, {}, 2, (0, 1), False),
    # a transductive method: the kept prefix ends at a unit boundary (every row of a unit from one solve)
    ("unit = the run, every part: kept", _setup_all, {"unit": N_RUN}, 3, (), False),
    ("unit = the run, 2 of 3 parts: none kept", _setup_two, {"unit": N_RUN}, 0, (), False),
    ("unit of 8 = 2 parts, 2 parts: kept", _setup_two, {"unit": 8}, 2, (), False),
    ("unit of 8, 1 part: none kept", lambda rd: _write(rd, 0, _meta()), {"unit": 8}, 0, (), False),
    ("unit of 6, 2 parts: none kept (8 is no multiple of 6)", _setup_two, {"unit": 6}, 0, (), False),
    ("unit of 2 within a part: kept", _setup_two, {"unit": 2}, 2, (), False),
    ("unit of 8, a gap at part 1: none kept", _setup_gap, {"unit": 8}, 0, (), False),
]


@pytest.mark.parametrize("name,setup,opts,start,restamped,refused", TABLE, ids=[t[0] for t in TABLE])
def test_scan_table(tmp_path, name, setup, opts, start, restamped, refused):
    rd = RunDir(tmp_path, KEY)
    setup(rd)
    before = _snapshot(rd)
    point = scan_resume(rd, _scope(**opts))
    assert _snapshot(rd) == before  # read-only: no byte and no modification time changed
    assert point.start_part == start
    assert point.restamp == tuple(rd.part(p) for p in restamped)
    assert (point.refusal is not None) == refused
    if refused:
        assert str(rd.part(1)) in point.refusal and "zaec:views" in point.refusal
    assert (point.correct_tta, point.correct_zs) == _correct(rd, range(start))
    assert point.state is None
    assert point.start_pos(_scope(**opts)) == min(start * PART, N_RUN)


@pytest.mark.parametrize("states,start,kept_n_seen", [
    ([_state(4), _state(8), _state(10)], 3, 10),
    ([_state(4), None, _state(10)], 1, 4),  # no state recorded in part 1
    ([_state(4), _state(7), _state(10)], 1, 4),  # part 1's state is not the state after its last row
    ([_state(4), {"n_seen": 8, "key": "tps", "loss_scale": {}}, _state(10)], 1, 4),  # a state field missing
    ([None, _state(8), _state(10)], 0, None),
])
def test_scan_episodic_state(tmp_path, states, start, kept_n_seen):
    rd = RunDir(tmp_path, KEY)
    for p, st in enumerate(states):
        _write(rd, p, _meta(), state=st)
    point = scan_resume(rd, _scope(state_keys=("n_seen", "loss_scale", "skipped_steps")))
    assert point.start_part == start
    assert (point.state or {}).get("n_seen") == kept_n_seen


def test_apply_resume_restamps_then_removes(tmp_path):
    rd = RunDir(tmp_path, KEY)
    _setup_other_limit(rd)
    _write(rd, 2, _meta(**{"zaec:limit": "8"}), pos=[9, 8])  # a broken last part: rewritten by the run
    point = scan_resume(rd, _scope())
    assert point.start_part == 2
    rows = read_shard(rd.part(0)).tta_logits.copy()
    apply_resume(rd, point, _meta())
    assert [p.name for p in rd.existing_parts()] == ["part-00000.parquet", "part-00001.parquet"]
    for p in range(2):
        sh = read_shard(rd.part(p))
        assert sh.meta.extra["zaec:limit"] == "none"  # this run's footer
        assert json.loads(sh.meta.extra["zaec:method_summary"]) == {"p": p}  # its own stream keys kept
    np.testing.assert_array_equal(read_shard(rd.part(0)).tta_logits, rows)
    assert scan_resume(rd, _scope()).restamp == ()


def test_apply_resume_refuses_after_restamping_and_deletes_nothing(tmp_path):
    rd = RunDir(tmp_path, KEY)
    _write(rd, 0, _meta(**{"zaec:limit": "8"}))
    _write(rd, 1, _meta(**{"zaec:views": "augmix"}))
    point = scan_resume(rd, _scope())
    with pytest.raises(RunError, match="different settings"):
        apply_resume(rd, point, _meta())
    assert len(rd.existing_parts()) == 2
    assert read_shard(rd.part(0)).meta.extra["zaec:limit"] == "none"  # restamped before the refusal, as before


@pytest.mark.parametrize("setup,why", [(_setup_corrupt, "is unreadable"),
                                       (_setup_no_fingerprint, "before data fingerprints"),
                                       (_setup_bad_positions, "does not hold stream positions 4..7")])
def test_a_part_on_disk_that_ends_the_prefix_is_named(tmp_path, setup, why):
    """A truncated or otherwise unusable part is recomputed with a note naming it (it used to be silent)."""
    rd = RunDir(tmp_path, KEY)
    setup(rd)
    point = scan_resume(rd, _scope())
    assert point.start_part == 1 and point.note is not None
    assert str(rd.part(1)) in point.note and why in point.note and "parts 0..0 kept" in point.note


def test_no_note_where_the_interrupted_run_stopped(tmp_path):
    rd = RunDir(tmp_path, KEY)
    _setup_gap(rd)
    assert scan_resume(rd, _scope()).note is None


def test_a_unit_not_written_whole_is_named(tmp_path):
    """The parts of a transductive unit the interrupted run did not finish are recomputed with a note; a part that
    ended the prefix for its own reason is named too."""
    rd = RunDir(tmp_path, KEY)
    _setup_two(rd)
    point = scan_resume(rd, _scope(unit=N_RUN))
    assert point.start_part == 0 and "parts 0..1" in point.note and "transductive unit of 10 positions" in point.note
    rd2 = RunDir(tmp_path / "b", KEY)
    _setup_corrupt(rd2)
    point = scan_resume(rd2, _scope(unit=8))
    assert point.start_part == 0 and "transductive unit of 8" in point.note and "is unreadable" in point.note
