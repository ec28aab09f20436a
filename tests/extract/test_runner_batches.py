"""The run serving a method that adapts the image encoder over batches of test images (`consumes =
"batch_pixels"`; docs/architecture.md, "A method that adapts over batches"), with Tent on the tiny models: the batch
is the method's, recorded with the stream; the zero-shot rows stay the frozen model's; the state after each part
lies beside it and a resumed run loads it (Ctrl-C and rerun = uninterrupted); a --limit that cuts a batch is
another run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from extract.run import writer as run_writer
from extract.run.options import RunError
from extract.run.rundir import RunDir
from extract.runner import run_extraction
from schemas.shard import RunKey, read_shard

from tests.support.extract import interrupt_nth_write, make_json_dataset, shard_columns as table

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (tests/support/extract.py)

# batches of 2, parts of 4 (two batches), 10 positions: five batches in three parts (the last holds one batch)
SMALL = dict(part_size=4, chunk_size=5, batch_size=3, progress=False, overrides={"batch_size": "2"}, limit=10)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)  # 18 samples
    return root


def run(tmp_path, model, data_root, method="tent", **kw):
    args = dict(SMALL, data_root=data_root, out=tmp_path / "out", cache_dir=tmp_path / "cache", model=model)
    args.update(kw)
    return run_extraction(method, "dtd", **args)


@pytest.mark.parametrize("model_fixture", ["tiny_model", "tiny_rn_model"])
def test_ctrl_c_and_rerun_equal_an_uninterrupted_run(tmp_path, data_root, monkeypatch, request, model_fixture):
    model = request.getfixturevalue(model_fixture)
    full = table(run(tmp_path / "full", model, data_root))
    real_write = interrupt_nth_write(monkeypatch, 3)  # the third part is never written
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "r", model, data_root)
    monkeypatch.setattr(run_writer, "write_shard", real_write)
    run_dir = RunDir(tmp_path / "r" / "out", RunKey(model.backbone, "dtd", "tent", 1))
    assert [p.name for p in run_dir.existing_parts()] == ["part-00000.parquet", "part-00001.parquet"]
    assert run_dir.state(1).is_file()  # saved before its part: a third state may be there, never a third part
    resumed = table(run(tmp_path / "r", model, data_root))
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])
    meta = read_shard(run_dir.part(1)).meta.extra
    saved = json.loads(meta["zaec:method_state_file"])
    assert saved["file"] == "state-00001.pt" and saved["n_seen"] == 8
    assert meta["zaec:adapt_batch"] == "2" and meta["zaec:consumes"] == "batch_pixels"


def test_resume_loads_the_saved_state_and_not_a_replay(tmp_path, data_root, tiny_model, monkeypatch):
    """The kept prefix is not adapted again: the method starts from the state file of the last kept part."""
    full = table(run(tmp_path / "full", tiny_model, data_root))
    real_write = interrupt_nth_write(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "r", tiny_model, data_root)
    monkeypatch.setattr(run_writer, "write_shard", real_write)
    from extract.methods.tent import Tent

    calls = []
    real_adapt = Tent._adapt
    monkeypatch.setattr(Tent, "_adapt", lambda self, x: calls.append(self.n_seen) or real_adapt(self, x))
    resumed = table(run(tmp_path / "r", tiny_model, data_root))
    assert calls == [8]  # only the last batch is adapted
    np.testing.assert_array_equal(resumed["tta_logits"], full["tta_logits"])


def test_a_part_whose_state_file_is_gone_is_recomputed(tmp_path, data_root, tiny_model):
    full = table(run(tmp_path / "r", tiny_model, data_root))
    run_dir = RunDir(tmp_path / "r" / "out", RunKey("tiny-clip", "dtd", "tent", 1))
    run_dir.remove_marker()
    run_dir.state(1).write_bytes(b"changed")  # not the bytes its part recorded
    lines = []
    again = table(run(tmp_path / "r", tiny_model, data_root, log=lines.append))
    assert any("part-00001.parquet lacks the method state" in line and "parts 0..0 kept" in line for line in lines)
    np.testing.assert_array_equal(again["tta_logits"], full["tta_logits"])


def test_a_saved_state_this_torch_cannot_read_is_one_line(tmp_path, data_root, tiny_model, monkeypatch):
    """A state file whose bytes match its part but that this torch cannot unpickle (one written by another version)
    stops the resumed run with one line naming it and what to do, not a traceback."""
    import pickle

    import torch

    from extract.run.options import RunError

    real_write = interrupt_nth_write(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "r", tiny_model, data_root)
    monkeypatch.setattr(run_writer, "write_shard", real_write)

    def refuse(*a, **k):
        raise pickle.UnpicklingError("Weights only load failed. Unsupported global: GLOBAL x.y\nmore lines")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(RunError) as e:
        run(tmp_path / "r", tiny_model, data_root)
    line = str(e.value)
    assert "\n" not in line and "state-00001.pt: the method state saved with the interrupted run cannot be read" in line
    assert "Unsupported global: GLOBAL x.y" in line and line.endswith("--no-resume computes the run again")


def test_zero_shot_rows_are_the_frozen_models(tmp_path, data_root, tiny_model):
    """Pairs stay paired: the zero-shot row of each sample is the frozen model's cached view 0, as in a zero-shot
    run, whatever the method did to its copy of the encoder."""
    tent = table(run(tmp_path, tiny_model, data_root))
    zs = table(run(tmp_path, tiny_model, data_root, method="zero-shot", overrides={}, adapt_batch=2))
    np.testing.assert_array_equal(tent["sample_id"], zs["sample_id"])
    np.testing.assert_array_equal(tent["zs_logits"], zs["zs_logits"])
    assert not np.array_equal(tent["tta_logits"], tent["zs_logits"])


def test_a_limit_that_cuts_a_batch_is_another_run(tmp_path, data_root, tiny_model):
    """A finished run serves a shorter --limit that ends one of its batches, and recomputes one that cuts a batch
    (the cut batch is smaller, its rows differ)."""
    long = table(run(tmp_path, tiny_model, data_root, limit=8))
    lines = []
    served = run(tmp_path, tiny_model, data_root, limit=6, log=lines.append)
    assert any("already finished" in line for line in lines)
    assert len(table(served)["sample_id"]) == 8  # the finished run's parts, positions < 6 asked for
    with pytest.raises(RunError, match="not a multiple of its adapt_batch 2"):  # it would replace the longer run
        run(tmp_path, tiny_model, data_root, limit=5)
    cut = table(run(tmp_path, tiny_model, data_root, limit=5, force=True))
    np.testing.assert_array_equal(cut["tta_logits"][:4], long["tta_logits"][:4])
    assert not np.array_equal(cut["tta_logits"][4], long["tta_logits"][4])


def test_part_size_must_hold_whole_batches(tmp_path, data_root, tiny_model):
    with pytest.raises(RunError, match=r"adapts in batches of 2 samples: --part-size \(5\) must be a multiple"):
        run(tmp_path, tiny_model, data_root, part_size=5)
    lines = []
    run(tmp_path, tiny_model, data_root, adapt_batch=4, log=lines.append)
    assert any("--adapt-batch 4 does not apply" in line for line in lines)


@pytest.mark.parametrize("method, overrides", [
    ("sar", {"batch_size": "2", "margin_e0": "1.0"}), ("deyo", {"batch_size": "2", "deyo_margin": "1.0"}),
    ("batclip", {"batch_size": "2"}), ("tent", {"batch_size": "2", "panda": "true"}),
    ("zero", {"panda": "true", "panda_batch_size": "2"}), ("dmn-weak", {"panda": "true", "panda_batch_size": "2"}),
])
def test_every_batch_method_resumes_as_uninterrupted(tmp_path, data_root, tiny_model, monkeypatch, method,
                                                      overrides):
    """SAR (its EMA and SGD momentum), DeYO, BATCLIP (both encoders), Tent with Panda, and Panda on ZERO and on
    DMN-weak (methods of cached features that read the batch's pixels for Panda's negatives): Ctrl-C after the
    second part and a rerun give the uninterrupted run's rows."""
    kw = dict(method=method, overrides=overrides)
    full = table(run(tmp_path / "full", tiny_model, data_root, **kw))
    real_write = interrupt_nth_write(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "r", tiny_model, data_root, **kw)
    monkeypatch.setattr(run_writer, "write_shard", real_write)
    resumed = table(run(tmp_path / "r", tiny_model, data_root, **kw))
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])
    assert read_shard(RunDir(tmp_path / "r" / "out", RunKey("tiny-clip", "dtd", method, 1)).part(0)).meta.extra[
        "zaec:consumes"] == "batch_pixels"


def test_a_longer_limit_continues_a_finished_shorter_run(tmp_path, data_root, tiny_model):
    """A finished 6-sample run (its last part holds positions 4..5, whole batches) and then a 10-sample run in the same
    folder: the longer run keeps the shorter run's rows, loads the state saved after position 6 and adapts from
    there, which gives the rows of a 10-sample run computed afresh."""
    fresh = table(run(tmp_path / "fresh", tiny_model, data_root, limit=10))
    run(tmp_path / "r", tiny_model, data_root, limit=6)
    lines = []
    longer = table(run(tmp_path / "r", tiny_model, data_root, limit=10, log=lines.append))
    assert any("holds stream positions 4..5" in line for line in lines)
    for k in fresh:
        np.testing.assert_array_equal(longer[k], fresh[k])
