"""The files a method reads besides the CLIP checkpoint (extract/run/externals.py, `TTAMethod.external_files`): one
declaration per method, one check before any model loads in `zaec-extract` and in `zaec-sweep` (dry run too), one
line naming the setting and where the file comes from, exit 2; their identity in a finished run's settings."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from extract.methods import REGISTRY
from extract.methods.base import ExternalFile, MethodConfig, field_ranges, text_setting
from extract.methods.zero_shot import ZeroShot, ZeroShotConfig
from extract.run.externals import SETTINGS_KEY, check_external_files, external_identity
from extract.run.options import RunError, RunOptions, plan

from tests.support.extract import make_json_dataset

FAKE = "fake-external"
DOCS = Path(__file__).resolve().parents[3] / "docs" / "extract.md"


@dataclass(frozen=True)
class FakeConfig(ZeroShotConfig):
    weights_dir: str = text_setting("")
    stats_file: str = text_setting("")


class FakeExternal(ZeroShot):
    """Zero-shot that declares a folder and a file it would read."""

    key: ClassVar[str] = FAKE
    prefix_stable: ClassVar[bool] = True
    Config: ClassVar[type[MethodConfig]] = FakeConfig
    external_files: ClassVar[tuple[ExternalFile, ...]] = (
        ExternalFile("weights_dir", "the fake weights", "make them with `fake-make DIR`", kind="dir",
                     contains=("model_index.json",)),
        ExternalFile("stats_file", "the fake statistics", "compute them with `fake-stats FILE`"),
    )

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> FakeConfig:
        return FakeConfig()


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(REGISTRY, FAKE, FakeExternal)
    return FakeExternal


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "weights"
    d.mkdir()
    (d / "model_index.json").write_text("{}")
    f = tmp_path / "stats.pt"
    f.write_bytes(b"x")
    return d, f


def _planned(**overrides):
    return plan(RunOptions.make(FAKE, "dtd", backbone="ViT-B-16", overrides=overrides))


@pytest.mark.parametrize("which, problem", [
    ("none", "not given"), ("missing_dir", "no such folder"), ("dir_is_file", "is a file, expected a folder"),
    ("empty_dir", "the folder lacks model_index.json"), ("missing_file", "no such file"),
    ("file_is_dir", "is a folder, expected a file")])
def test_each_problem_is_one_line_naming_setting_and_source(fake, files, tmp_path, which, problem):
    d, f = files
    empty = tmp_path / "empty"
    empty.mkdir()
    values = {"none": {}, "missing_dir": {"weights_dir": str(tmp_path / "nope")},
              "dir_is_file": {"weights_dir": str(f)}, "empty_dir": {"weights_dir": str(empty)},
              "missing_file": {"weights_dir": str(d), "stats_file": str(tmp_path / "nope.pt")},
              "file_is_dir": {"weights_dir": str(d), "stats_file": str(d)}}[which]
    with pytest.raises(RunError) as e:
        check_external_files(_planned(**values))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{FAKE}: the fake ")
    assert f"): {problem}; " in msg
    setting = "stats_file" if which in ("missing_file", "file_is_dir") else "weights_dir"
    assert f"(set by --set {setting}={'FILE' if setting == 'stats_file' else 'DIR'})" in msg
    assert msg.endswith("`fake-stats FILE`" if setting == "stats_file" else "`fake-make DIR`")


def test_given_files_pass_and_are_identified(fake, files):
    d, f = files
    planned = _planned(weights_dir=str(d), stats_file=str(f))
    check_external_files(planned)
    ident = external_identity(planned)
    assert set(ident) == {"weights_dir", "stats_file"} and all(v.startswith("stat:") for v in ident.values())
    (d / "model_index.json").write_text('{"changed": 1}')  # another size: another identity
    assert external_identity(planned)["weights_dir"] != ident["weights_dir"]
    assert external_identity(planned)["stats_file"] == ident["stats_file"]


def test_a_method_without_external_files_records_nothing():
    planned = plan(RunOptions.make("tda", "dtd", backbone="ViT-B-16"))
    check_external_files(planned)
    assert external_identity(planned) == {}


def _cli(args):
    from extract.cli import app

    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_zaec_extract_refuses_before_any_model_loads(fake, tmp_path, tiny_model_dir, monkeypatch):
    from extract import runner
    from extract.run import encode

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the external files were checked")

    monkeypatch.setattr(runner, "load_model", no_model)
    monkeypatch.setattr(encode, "open_image", no_model)
    make_json_dataset(tmp_path / "data", "dtd", n_classes=2, per_class=2)
    r = _cli(["--method", FAKE, "--dataset", "dtd", "--data-root", str(tmp_path / "data"), "--out",
              str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"), "--pretrained", f"local-dir:{tiny_model_dir}",
              "--quiet", "--set", "weights_dir=/no/such/dir"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    line = " ".join(r.output.split())
    assert "the fake weights /no/such/dir (set by --set weights_dir=DIR): no such folder; make them with" in line


def test_runs_with_the_files_and_a_changed_file_is_not_reused(fake, files, tmp_path, tiny_model):
    from extract.runner import run_extraction
    from schemas.shard import read_shard

    d, f = files
    make_json_dataset(tmp_path / "data", "dtd", n_classes=2, per_class=2)
    kw = dict(data_root=tmp_path / "data", out=tmp_path / "out", cache_dir=tmp_path / "c", model=tiny_model,
              progress=False, overrides={"weights_dir": str(d), "stats_file": str(f)})
    (path,) = run_extraction(FAKE, "dtd", **kw)
    assert read_shard(path).meta.method_config["weights_dir"] == str(d)
    f.write_bytes(b"other statistics")
    with pytest.raises(RunError, match=re.escape(SETTINGS_KEY)):
        run_extraction(FAKE, "dtd", **kw)
    lines = []
    run_extraction(FAKE, "dtd", on_changed="recompute", log=lines.append, **kw)
    assert any(SETTINGS_KEY in line for line in lines)
    f.unlink()  # a file gone: said as such, not as a refusal of the finished run's settings
    with pytest.raises(RunError, match=r"\(set by --set stats_file=FILE\): no such file"):
        run_extraction(FAKE, "dtd", **kw)


@pytest.mark.parametrize("good", [False, True])
def test_sweep_dry_run_checks_them(fake, files, tmp_path, good):
    from extract.sweep import cli as sweep

    d, f = files
    extra = ["--set", f"{FAKE}.weights_dir={d}", "--set", f"{FAKE}.stats_file={f}"] if good else []
    res = CliRunner().invoke(sweep.app, ["run", "--methods", f"{FAKE},tda", "--datasets", "dtd", "--out",
                                         str(tmp_path / "out"), "--dry-run", "--skip-data-check", *extra])
    if good:
        assert res.exit_code == 0, res.output
        return
    msg = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"{FAKE}: the fake weights (set by --set weights_dir=DIR): not given; make them with" in msg
    assert "run(s) to submit" not in msg and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- every method

DECLARING = sorted(k for k, cls in REGISTRY.items() if cls.external_files)


@pytest.mark.parametrize("key", DECLARING)
def test_declarations_name_text_settings_the_user_supplies(key):
    cls = REGISTRY[key]
    names = {f.name: f for f in dataclasses.fields(cls.Config)}
    ranges = field_ranges(cls.Config)
    for ext in cls.external_files:
        assert ext.setting in names and names[ext.setting].type in (str, "str"), ext.setting
        assert ranges[ext.setting] is not None and ranges[ext.setting].text_field  # ranged as text
        assert ext.what and ext.source
        if ext.kind == "open_clip":
            assert ext.backbone_setting in names
        else:  # zaec downloads nothing for a method: not given until the user names it
            assert getattr(cls.default_config("dtd", "ViT-B-16"), ext.setting) == ""
    cfg = cls.default_config("dtd", "ViT-B-16")
    assert set(cls.needed_files(cfg)) <= set(cls.external_files)


@pytest.mark.parametrize("key", DECLARING)
def test_docs_say_where_each_file_comes_from(key):
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Files a method reads besides the CLIP checkpoint"):]
    for ext in REGISTRY[key].external_files:
        assert f"`{ext.setting}`" in section, f"docs/extract.md does not name {key}'s {ext.setting}"


def test_the_usage_in_a_message_is_a_command_line_that_parses():
    """Every `--set` form a refusal names is one `key=value` per `--set` (zaec-extract takes no `--set a=1 b=2`)."""
    from extract.methods import REGISTRY
    from extract.run.externals import _usage

    for cls in REGISTRY.values():
        for ext in cls.external_files:
            words = f"--set {_usage(ext)}".split()
            assert words[0::2] == ["--set"] * (len(words) // 2) and all("=" in w for w in words[1::2]), words
