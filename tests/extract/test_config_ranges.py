"""Every config field of every registered method declares its valid range, and an out-of-range `--set` value is
refused in one line naming the method, the key, the value and the range, before the model loads (issue 32 item 4).

The tests walk the registry itself (`extract.methods.REGISTRY`): a new method or a new field is picked up without
editing this file. The out-of-range values of a field are built here from its declared bounds (one step outside each
bound, NaN and infinities for floats, a blank text, a non-choice); the bounds themselves are pinned against the
official settings by `test_official_settings_are_in_range` and against the issue's list by the CLI tests.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
from typer.testing import CliRunner

from extract.methods import REGISTRY
from extract.methods.base import HPARAMS_KEYS
from extract.methods.base import ConfigRangeError, Ref, Valid, check_ranges, field_ranges
from extract.run.options import RunOptions, plan
from tests.support.extract import make_json_dataset

runner = CliRunner()
#: the backbone and the model facts the plan reads for it (open_clip's ViT-B-16 config: 12 vision blocks)
BACKBONE = "ViT-B-16"
FACTS = {"vision_blocks": 12}
FIELDS = [(key, name) for key, cls in REGISTRY.items() for name in field_ranges(cls.Config)]


def _kind(config_cls: type, name: str) -> typing.Any:
    return typing.get_type_hints(config_cls)[name]


def _bound(b: typing.Any, cfg: typing.Any) -> float | None:
    return b.value(cfg, FACTS) if isinstance(b, Ref) else b


def outside(valid: Valid | None, tp: typing.Any, name: str, cfg: typing.Any) -> list[str]:
    """`--set` strings just outside the declared range of field `name` of `cfg` (a default config)."""
    if valid is None:  # bool and Literal fields: their type is the range
        return ["not-a-choice"]
    if valid.text_field:
        return [" "] if valid.nonempty else []
    step = 1 if tp is int else 0.5
    out = []
    lo, hi = _bound(valid.lo, cfg), _bound(valid.hi, cfg)
    if lo is not None:
        out.append(lo if valid.lo_open else lo - step)
    if hi is not None:
        out.append(hi if valid.hi_open else hi + step)
    out = [str(tp(v)) for v in out]
    return out + (["nan", "inf", "-inf"] if tp is float else [])


def _plan(key: str, name: str, raw: str):
    return plan(RunOptions(key, "dtd", backbone=BACKBONE, overrides=((name, raw),)))


@pytest.mark.parametrize("key", list(REGISTRY))
def test_every_field_declares_a_range(key):
    """Settable numbers and texts declare a `Valid` (`setting` / `text_setting`); bool and Literal fields are ranged
    by their type. Fixed fields (`metadata={"fixed": True}`) are not settable."""
    cfg_cls = REGISTRY[key].Config
    ranges = field_ranges(cfg_cls)
    # fixed where any class of the MRO declares the field fixed (a subclass redeclaring its default keeps that)
    settable = {f.name for f in dataclasses.fields(cfg_cls)
                if not any(k.__dict__.get("__dataclass_fields__", {}).get(f.name, f).metadata.get("fixed")
                           for k in cfg_cls.__mro__)}
    assert set(ranges) == settable
    for name, valid in ranges.items():
        tp = _kind(cfg_cls, name)
        if tp is bool or typing.get_origin(tp) is typing.Literal:
            assert valid is None, f"{key}.{name}: a {tp} field is ranged by its type"
        else:
            assert isinstance(valid, Valid), f"{key}.{name} ({tp}) declares no range: use setting(...)"
            assert valid.text_field == (tp is str), f"{key}.{name}: text_setting for str fields, setting otherwise"


@pytest.mark.parametrize("key", list(REGISTRY))
def test_official_settings_are_in_range(key):
    """The ranges refuse no value of the official per-dataset tables (every dataset, both backbone columns), of the
    settings for unseen data, or of the model's own size (ViT-B-16: TTL's last 3 of 12 blocks)."""
    cls = REGISTRY[key]
    for backbone in ("RN50", "ViT-B-16"):
        for hk in HPARAMS_KEYS:
            check_ranges(cls.default_config(hk, backbone), key, FACTS)
        check_ranges(cls.unseen_config(backbone), key, FACTS)


@pytest.mark.parametrize("key,name", FIELDS)
def test_out_of_range_values_are_refused_in_one_line(key, name):
    """Each value just outside the declared range, given as `--set`, stops the plan (before any file is read or
    the model loads) with one line naming the method, the key, the value and the valid range; the bound itself
    (a closed one) is accepted."""
    cls = REGISTRY[key]
    cfg = cls.default_config("dtd", BACKBONE)
    tp, valid = _kind(cls.Config, name), field_ranges(cls.Config)[name]
    for raw in outside(valid, tp, name, cfg):
        with pytest.raises(ValueError) as err:
            _plan(key, name, raw)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"{key}: "), msg
        if valid is None:
            assert f"{name}: expected" in msg and repr(raw) in msg, msg
            continue
        assert isinstance(err.value, ConfigRangeError), msg
        shown = repr(tp(raw)) if tp is not str else repr(raw)
        # the range as declared; a bound on a model fact shows its value once the plan read it (the refusal of a
        # value outside the fixed bounds may come before, from the config itself)
        said = (valid.describe(name, cfg, FACTS), valid.describe(name, cfg, {}))
        assert f"{name}={shown} is out of range; valid: " in msg and msg.endswith(said), msg
    if valid is not None and not valid.text_field:
        # a closed bound is valid: accepted, unless another field's range depends on this one and now refuses
        dependents = {n for n, v in field_ranges(cls.Config).items() if v is not None
                      for b in (v.lo, v.hi) if isinstance(b, Ref) and not b.of_model and b.name == name}
        for b, is_open in ((valid.lo, valid.lo_open), (valid.hi, valid.hi_open)):
            edge = _bound(b, cfg)
            if edge is not None and not is_open:
                try:
                    assert getattr(_plan(key, name, str(tp(edge))).config, name) == tp(edge)
                except ConfigRangeError as e:
                    assert e.key in dependents, str(e)


def test_dependent_bounds_follow_the_other_field():
    """A bound read from another field is checked against that field's value in the same config."""
    with pytest.raises(ConfigRangeError, match=r"top_k=20 is out of range; valid: 1 <= top_k <= "
                                               r"max\(1, n_views - 1\) = 1"):
        plan(RunOptions("rtpt", "dtd", overrides=(("n_views", "1"),)))
    assert plan(RunOptions("rtpt", "dtd", overrides=(("n_views", "1"), ("top_k", "1")))).config.top_k == 1
    with pytest.raises(ConfigRangeError, match=r"dmn: used_views=32 is out of range; valid: 1 <= used_views <= "
                                               r"n_views = 1"):
        plan(RunOptions("dmn", "dtd", overrides=(("n_views", "1"),)))
    with pytest.raises(ConfigRangeError, match="neg_entropy_lower=0.6 is out of range"):
        plan(RunOptions("tda", "dtd", overrides=(("neg_entropy_lower", "0.6"),)))


def test_model_bound_from_the_architecture_and_from_the_loaded_model(tmp_path, tiny_model):
    """TTL's lora_blocks: a `--set` above the model's vision blocks is refused at plan time from the local-dir's
    config (the tiny model has 1 block), the default 3 is lowered to fit with a note; a model whose config the
    plan could not read is checked when the method is built on it."""
    from tests.support.extract import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "model")
    pre = f"local-dir:{model_dir}"
    with pytest.raises(ConfigRangeError, match=r"^ttl: lora_blocks=99 is out of range; valid: 1 <= lora_blocks "
                                               r"<= the model's vision blocks = 1$"):
        plan(RunOptions("ttl", "dtd", pretrained=pre, overrides=(("lora_blocks", "99"),)))
    fitted = plan(RunOptions("ttl", "dtd", pretrained=pre))
    assert fitted.config.lora_blocks == 1
    assert fitted.model_notes == ("ttl on tiny-clip: lora_blocks=1 (the default 3 exceeds the model's vision "
                                  "blocks, 1)",)
    assert plan(RunOptions("ttl", "dtd")).config.lora_blocks == 3 and not plan(RunOptions("ttl", "dtd")).model_notes
    import torch

    cls = REGISTRY["ttl"]
    text = torch.nn.functional.normalize(torch.randn(3, 16), dim=-1)
    with pytest.raises(ConfigRangeError, match="^ttl: lora_blocks=3 is out of range"):
        cls(cls.default_config("dtd", BACKBONE), text, 100.0, backbone="tiny-clip", dataset="dtd",
            text_encoder=tiny_model)


# ---------------------------------------------------------------------------------------------- the command lines

#: the values the issue found accepted (or crashing), with the range each must now name
ISSUE_CASES = [
    ("onzeta", "tau_i=0", "onzeta: tau_i=0.0 is out of range; valid: tau_i > 0"),
    ("ecalp", "output_scale=-1", "ecalp: output_scale=-1.0 is out of range; valid: output_scale > 0"),
    ("ecalp", "output_scale=0", "ecalp: output_scale=0.0 is out of range; valid: output_scale > 0"),
    ("ecalp", "k_image=0", "ecalp: k_image=0 is out of range; valid: k_image >= 1"),
    ("dmn", "beta=-5", "dmn: beta=-5.0 is out of range; valid: beta >= 0"),
    ("boostadapter", "alpha=-2", "boostadapter: alpha=-2.0 is out of range; valid: alpha >= 0"),
    ("mta", "lambda_y=-1", "mta: lambda_y=-1.0 is out of range; valid: lambda_y > 0"),
    ("rlcf", "clipscore_weight=-3", "rlcf: clipscore_weight=-3.0 is out of range; valid: clipscore_weight >= 0"),
    ("rtpt", "top_k=1000", "rtpt: top_k=1000 is out of range; valid: 1 <= top_k <= max(1, n_views - 1) = 63"),
    ("ttl", "lora_blocks=99", "ttl: lora_blocks=99 is out of range; valid: 1 <= lora_blocks <= the model's vision "
                              "blocks = 1"),
    ("ttl", "lr=-0.1", "ttl: lr=-0.1 is out of range; valid: lr >= 0"),
]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranges-data")
    make_json_dataset(root, "dtd", n_classes=2, per_class=2)
    return root


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything loads a model."""
    import extract.models
    import extract.runner

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad --set value was refused")

    monkeypatch.setattr(extract.models, "load_model", refuse)
    monkeypatch.setattr(extract.runner, "load_model", refuse)


@pytest.mark.parametrize("key,setting,line", ISSUE_CASES)
def test_zaec_extract_refuses_before_the_model_loads(key, setting, line, tmp_path, data_root, tiny_model_dir,
                                                     no_model_load):
    from extract.cli import app

    r = runner.invoke(app, ["--method", key, "--dataset", "dtd", "--set", setting, "--data-root", str(data_root),
                            "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
                            "--pretrained", f"local-dir:{tiny_model_dir}", "--device", "cpu", "--quiet"])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"zaec-extract: error: {line}"
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("key,setting,line", ISSUE_CASES)
def test_zaec_sweep_refuses_before_submitting(key, setting, line, tmp_path, data_root, tiny_model_dir,
                                              no_model_load, monkeypatch):
    from extract.sweep import cli as sweep

    monkeypatch.setattr(sweep, "submit_and_record", lambda *a, **k: pytest.fail("submitted"))
    r = runner.invoke(sweep.app, ["run", "--methods", f"zero-shot,{key}", "--datasets", "dtd", "--set",
                                  f"{key}.{setting}", "--pretrained", f"local-dir:{tiny_model_dir}",
                                  "--data-root", str(data_root), "--out", str(tmp_path / "out"),
                                  "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == f"zaec-sweep: error: {line}" and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_nan_and_infinity_are_out_of_every_float_range():
    """Floats are finite whatever their bounds (global_threshold has none)."""
    for raw in ("nan", "inf"):
        with pytest.raises(ConfigRangeError, match=f"dpe: global_threshold={raw} is out of range; valid: "
                                                   "global_threshold: any finite number"):
            plan(RunOptions("dpe", "dtd", overrides=(("global_threshold", raw),)))


def test_the_error_pickles():
    """A sweep job's exception travels back pickled: the range error keeps its fields and its line."""
    import pickle

    e = ConfigRangeError("ttl", "lora_blocks", 99, "1 <= lora_blocks <= the model's vision blocks = 2")
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and (back.owner, back.key, back.value) == ("ttl", "lora_blocks", 99)
