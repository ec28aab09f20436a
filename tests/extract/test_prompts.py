"""Prompt tables and CuPL loading with fallbacks."""

from __future__ import annotations

import json

import pytest

from extract.datasets import PAPER_DATASETS, REGISTRY
from extract.prompts import (
    DPE_STANFORD_CARS,
    TIP_TEMPLATES,
    PromptError,
    build_prompt_set,
    imagenet80_templates,
    templates_for,
)


def test_tables():
    assert templates_for("dtd", "single") == ("a photo of a {}.",)
    assert templates_for("dtd", "dataset") == ("{} texture.",)
    assert templates_for("eurosat", "dataset") == ("a centered satellite photo of {}.",)
    assert templates_for("imagenet_a", "dataset") == TIP_TEMPLATES and len(TIP_TEMPLATES) == 7
    assert templates_for("imagenet_r", "dataset") == imagenet80_templates()
    assert len(set(imagenet80_templates())) == 80 and all("{}" in t for t in imagenet80_templates())
    assert templates_for("stanford_cars", "dpe_cars") == DPE_STANFORD_CARS
    # CoOp's single templates (TransCLIP/StatA `datasets/*.py`): DTD's without a full stop
    assert templates_for("dtd", "transclip") == ("{} texture",)
    assert templates_for("imagenet_r", "transclip") == templates_for("sun397", "transclip") == ("a photo of a {}.",)
    # demo sets use their hparams_from set's templates
    assert templates_for("fmnist", "dataset") == TIP_TEMPLATES
    with pytest.raises(PromptError, match="unknown prompt policy 'many'.*single, dataset, imagenet80"):
        templates_for("dtd", "many")


@pytest.mark.parametrize("key", [k for k, s in REGISTRY.items() if s.group != "ood"])
def test_every_dataset_has_templates(key):
    # the out-of-distribution sets have no classes: an OOD run builds the in-distribution set's prompts
    for policy in ("single", "dataset", "imagenet80", "transclip"):
        ts = templates_for(key, policy)
        assert ts and all(t.format("x") != t for t in ts)


def test_cupl_merged_after_templates(tmp_path):
    (tmp_path / "CuPL_prompts_dtd.json").write_text(json.dumps({"banded": ["Stripes.", "Bands."], "woven": ["W."]}))
    ps = build_prompt_set("dtd", ["banded", "woven"], policy="dataset", cupl=True, cupl_dir=tmp_path)
    assert ps.per_class == (("banded texture.", "Stripes.", "Bands."), ("woven texture.", "W."))
    assert ps.warnings == () and ps.cupl_source.endswith("CuPL_prompts_dtd.json")
    assert ps.describe()["prompts_per_class"] == {"min": 2, "max": 3}


def test_cupl_env_and_underscore_lookup(tmp_path, monkeypatch):
    (tmp_path / "CuPL_prompts_imagenet.json").write_text(json.dumps({"great white shark": ["S."]}))
    monkeypatch.setenv("ZAEC_CUPL_DIR", str(tmp_path))
    ps = build_prompt_set("imagenet_v2", ["great_white_shark"], policy="single", cupl=True)
    assert ps.per_class == (("a photo of a great_white_shark.", "S."),)


def test_cupl_fallbacks_warn(tmp_path, monkeypatch):
    monkeypatch.delenv("ZAEC_CUPL_DIR", raising=False)
    ps = build_prompt_set("dtd", ["banded"], policy="dataset", cupl=True)
    assert ps.per_class == (("banded texture.",),) and "no CuPL directory" in ps.warnings[0]
    ps = build_prompt_set("dtd", ["banded"], policy="dataset", cupl=True, cupl_dir=tmp_path)
    assert "CuPL_prompts_dtd.json does not exist" in ps.warnings[0]
    (tmp_path / "CuPL_prompts_dtd.json").write_text(json.dumps({"banded": ["B."]}))
    ps = build_prompt_set("dtd", ["banded", "woven"], policy="dataset", cupl=True, cupl_dir=tmp_path)
    assert ps.per_class[1] == ("woven texture.",) and "1 of 2 classes (woven)" in ps.warnings[0]
    ps = build_prompt_set("fmnist", ["bag"], policy="single", cupl=True, cupl_dir=tmp_path)
    assert "no CuPL prompt file" in ps.warnings[0]


def test_bad_cupl_file_is_an_error(tmp_path):
    (tmp_path / "CuPL_prompts_dtd.json").write_text("{not json")
    with pytest.raises(PromptError, match="CuPL_prompts_dtd.json"):
        build_prompt_set("dtd", ["banded"], policy="dataset", cupl=True, cupl_dir=tmp_path)
    (tmp_path / "CuPL_prompts_dtd.json").write_text(json.dumps({"banded": "not a list"}))
    with pytest.raises(PromptError, match="lists of sentences"):
        build_prompt_set("dtd", ["banded"], policy="dataset", cupl=True, cupl_dir=tmp_path)


def test_fingerprint_changes_with_prompts():
    a = build_prompt_set("dtd", ["a", "b"], policy="dataset")
    assert a.fingerprint() == build_prompt_set("dtd", ["a", "b"], policy="dataset").fingerprint()
    assert a.fingerprint() != build_prompt_set("dtd", ["a", "c"], policy="dataset").fingerprint()
    assert a.fingerprint() != build_prompt_set("dtd", ["a", "b"], policy="single").fingerprint()


def test_paper_datasets_have_cupl_files():
    assert all(REGISTRY[k].cupl_file for k in PAPER_DATASETS)
