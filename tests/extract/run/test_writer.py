"""extract/run/writer.py, rundir.py and settings.py without a model: part writing (boundaries, atomicity, per-part
method state), the marker and the finished-run check (the adapt loop is tested in test_stream.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from extract.run import writer as run_writer
from extract.run.rundir import RunDir, run_is_complete
from extract.run.settings import FinishedRun, finished_run
from extract.run.stream import RunState
from extract.run.writer import PartWriter, marker_doc
from schemas.shard import RunKey, ShardMeta, read_shard

KEY = RunKey("tiny", "dtd", "tda", 1)
META = ShardMeta(backbone="tiny", pretrained="x", dataset="dtd", method="tda", seed=1, class_names=("a", "b", "c"),
                 extra={"zaec:limit": "none"})


class Counter:
    """A stand-in method: its state is how many rows it saw."""

    def __init__(self):
        self.n_seen = 0

    def summary(self):
        return {"seen": self.n_seen}

    def state_dict(self):
        return {"key": "counter", "n_seen": self.n_seen}


def test_run_dir_paths(tmp_path):
    rd = RunDir(tmp_path, KEY)
    assert rd.path == tmp_path / "backbone=tiny" / "dataset=dtd" / "method=tda" / "seed=1"
    assert rd.part(12) == rd.path / "part-00012.parquet" and RunDir.part_index(rd.part(12)) == 12
    assert rd.marker == rd.path / "_zaec_complete.json"
    assert rd.existing_parts() == [] and rd.read_marker() is None and not rd.is_complete()


@pytest.mark.parametrize("n_run,part_size,batch", [(10, 4, 2), (8, 4, 4), (3, 4, 1), (12, 6, 3)])
def test_part_writer_boundaries_and_state(tmp_path, n_run, part_size, batch):
    rd = RunDir(tmp_path, KEY)
    method = Counter()
    w = PartWriter(rd, META, method, episodic=True, part_size=part_size, n_run=n_run)
    rng = np.random.default_rng(0)
    zs, tta = rng.normal(size=(n_run, 3)), rng.normal(size=(n_run, 3))
    for s in range(0, n_run, batch):
        e = min(s + batch, n_run)
        method.n_seen = e
        w.add(np.arange(s, e)[::-1], np.arange(s, e) % 3, zs[s:e], tta[s:e], np.arange(s, e))
    n_parts = -(-n_run // part_size)
    assert w.written == [rd.part(p) for p in range(n_parts)]
    for p in range(n_parts):
        lo, hi = p * part_size, min((p + 1) * part_size, n_run)
        sh = read_shard(rd.part(p))
        np.testing.assert_array_equal(sh.stream_pos, np.arange(lo, hi))
        np.testing.assert_array_equal(sh.tta_logits, tta[lo:hi].astype(np.float32))
        assert json.loads(sh.meta.extra["zaec:method_state"])["n_seen"] == hi  # the state after its last row
        assert json.loads(sh.meta.extra["zaec:method_summary"]) == {"seen": hi}
    assert rd.temp_files() == []


def test_part_writer_online_method_records_no_state(tmp_path):
    rd = RunDir(tmp_path, KEY)
    w = PartWriter(rd, META, Counter(), episodic=False, part_size=2, n_run=2)
    w.add(np.arange(2), np.zeros(2, int), np.zeros((2, 3)), np.zeros((2, 3)), np.arange(2))
    assert "zaec:method_state" not in read_shard(rd.part(0)).meta.extra


def test_part_writer_leaves_no_half_written_part(tmp_path, monkeypatch):
    """A write that fails midway leaves neither the part nor its temporary file."""
    import pyarrow.parquet as pq

    def broken(table, where, **kw):
        Path(where).write_bytes(b"PAR1 half")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    rd = RunDir(tmp_path, KEY)
    w = PartWriter(rd, META, Counter(), episodic=False, part_size=2, n_run=2)
    with pytest.raises(OSError, match="disk full"):
        w.add(np.arange(2), np.zeros(2, int), np.zeros((2, 3)), np.zeros((2, 3)), np.arange(2))
    assert rd.existing_parts() == [] and rd.temp_files() == [] and w.written == []


def test_marker_and_finished_run(tmp_path):
    rd = RunDir(tmp_path, KEY)
    settings = {"method_config": {"a": 1}, "data_root": "/d", "data_fingerprint": "stat:1"}
    rd.path.mkdir(parents=True)
    rd.part(0).write_bytes(b"x")
    doc = marker_doc(n_run=6, n_total=10, limit=6, settings=settings, parts=[rd.part(0)], method_summary={},
                     accuracies=RunState(6, 3, 2).accuracies(6), prefix_dependence=None, adapt_batch=1)
    assert doc["accuracy"] == 0.5 and doc["zero_shot_accuracy"] == pytest.approx(2 / 6)
    rd.write_marker(doc)
    assert rd.read_marker() == doc
    assert rd.is_complete(6) and rd.is_complete(3) and not rd.is_complete(None) and not rd.is_complete(7)
    assert run_is_complete(tmp_path, KEY, limit=5)
    done = finished_run(rd, settings, 6)
    assert isinstance(done, FinishedRun) and done.matches and done.parts == (rd.part(0),)
    other = finished_run(rd, {**settings, "data_root": "/e", "anchor": "single"}, 6)
    assert not other.matches and not other.predates_fingerprints
    assert other.changed() == "anchor, data_root (another data root)"
    assert str(rd.path) in other.refusal() and "--force" in other.refusal()
    old = {k: v for k, v in settings.items() if k not in ("data_fingerprint", "data_root")}
    rd.write_marker({**doc, "settings": old})
    assert finished_run(rd, settings, 6).predates_fingerprints
    assert finished_run(rd, settings, None) is None  # a limited run does not finish a full one
    rd.part(0).unlink()
    assert finished_run(rd, settings, 6) is None  # a listed part is missing
    rd.remove_marker()
    assert not rd.marker.exists()


def test_a_longer_finished_run_serves_a_shorter_limit_only_where_its_first_rows_are_that_run(tmp_path):
    """Issue 32 item 1: the marker says whether the method's first rows depend on what follows them and the width
    of its adapt calls; a shorter run is served only when neither can change its rows."""
    rd = RunDir(tmp_path, KEY)
    rd.path.mkdir(parents=True)
    rd.part(0).write_bytes(b"x")

    def finished(**kw):
        rd.write_marker(marker_doc(n_run=8, n_total=8, limit=None, settings={}, parts=[rd.part(0)], method_summary={},
                                   accuracies={}, **kw))

    finished(prefix_dependence=None, adapt_batch=4)
    assert rd.is_complete(None) and rd.is_complete(8) and rd.is_complete(4)
    assert not rd.is_complete(6) and "6 is not a multiple of its adapt_batch 4" in rd.shorter_refusal(6)
    assert rd.shorter_refusal(4) is None
    finished(prefix_dependence="onzeta's schedule reads the stream's length", adapt_batch=4)
    assert rd.is_complete(None) and rd.is_complete(8) and not rd.is_complete(4)
    assert rd.shorter_refusal(4) == "onzeta's schedule reads the stream's length"
    old = {k: v for k, v in (rd.read_marker() or {}).items() if k not in ("prefix_dependence", "adapt_batch")}
    rd.write_marker(old)  # a marker written before the record: it proves nothing about its first rows
    assert rd.is_complete(None) and not rd.is_complete(4) and "predates" in rd.shorter_refusal(4)


def test_writer_module_is_where_parts_are_written():
    """The tests' interrupt helper patches `extract.run.writer.write_shard`: the writer must look it up there."""
    assert run_writer.write_shard.__module__ == "schemas.shard"
