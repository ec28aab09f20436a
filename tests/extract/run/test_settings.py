"""extract/run/settings.py: how a finished run with other settings names the change."""

from __future__ import annotations

from pathlib import Path

from extract.run.rundir import RunDir
from extract.run.settings import FinishedRun
from schemas.shard import RunKey

RD = RunDir(Path("out"), RunKey("tiny", "dtd", "tda", 1))


def _changed(old: dict, new: dict) -> str:
    return FinishedRun(RD, (), old, new).changed()


def test_other_image_files_are_named_as_such():
    assert "the image files changed" in _changed({"data_fingerprint": "stat:aa"}, {"data_fingerprint": "stat:bb"})


def test_another_fingerprint_mode_is_not_blamed_on_the_files():
    why = _changed({"data_fingerprint": "stat:aa"}, {"data_fingerprint": "content:bb"})
    assert "the image files changed" not in why
    assert "--fingerprint stat" in why and "content" in why


def test_other_keys_keep_their_plain_names():
    assert _changed({"anchor": "single", "data_fingerprint": "stat:aa"},
                    {"anchor": "method", "data_fingerprint": "stat:aa"}) == "anchor"
