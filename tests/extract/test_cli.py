"""`zaec-extract`: the documented command line, and one clear line for every user error."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from extract.cli import app
from extract.methods import REGISTRY
from schemas.shard import find_shards, read_shard

from tests.support.extract import make_json_dataset

runner = CliRunner()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-data")
    make_json_dataset(root, "dtd", n_classes=2, per_class=3)
    return root


def _invoke(args):
    return runner.invoke(app, args, catch_exceptions=False)


def _base(tmp_path, data_root, model_dir):
    return ["--data-root", str(data_root), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
            "--pretrained", f"local-dir:{model_dir}", "--device", "cpu", "--quiet"]


def test_cli_run_with_set_and_limit(tmp_path, data_root, tiny_model_dir):
    r = _invoke(["--method", "tda", "--dataset", "dtd", "--limit", "4", "--seed", "3", "--set", "alpha=0.5",
                 "--set", "beta=2"] + _base(tmp_path, data_root, tiny_model_dir))
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "out"])
    s = read_shard(path)
    assert len(s) == 4 and s.meta.seed == 3 and s.meta.backbone == "tiny-clip"
    assert s.meta.method_config["alpha"] == 0.5 and s.meta.method_config["beta"] == 2.0
    assert "seed=3" in str(path) and "1 shard(s)" in r.output


@pytest.mark.parametrize("extra, needle", [
    (["--method", "tdaa", "--dataset", "dtd"], "unknown method 'tdaa'; available: zero-shot, tda, dpe, dlae"),
    (["--method", "tda", "--dataset", "dtdd"], "unknown dataset 'dtdd'; available: imagenet, imagenet_a"),
    (["--method", "tda", "--dataset", "dtd", "--set", "alpah=1"], "valid keys: "),
    (["--method", "tda", "--dataset", "dtd", "--set", "alpha"], "--set expects key=value, got 'alpha'"),
    (["--method", "tda", "--dataset", "dtd", "--set", "alpha=big"], "alpha: expected float, got 'big'"),
    (["--method", "tda", "--dataset", "dtd", "--anchor", "both"], "unknown anchor 'both'"),
    (["--method", "tda", "--dataset", "caltech101"], "dataset 'caltech101' not found"),
])
def test_cli_user_errors_one_line_no_traceback(tmp_path, data_root, tiny_model_dir, extra, needle):
    r = _invoke(extra + _base(tmp_path, data_root, tiny_model_dir))
    assert r.exit_code == 2
    assert needle in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_cli_missing_dataset_shows_layout(tmp_path, tiny_model_dir):
    r = _invoke(["--method", "zero-shot", "--dataset", "caltech101"] + _base(tmp_path, tmp_path, tiny_model_dir))
    assert r.exit_code == 2
    assert "caltech-101/split_zhou_Caltech101.json" in r.output and "101_ObjectCategories" in r.output


def test_cli_bad_pretrained(tmp_path, data_root):
    r = _invoke(["--method", "zero-shot", "--dataset", "dtd", "--data-root", str(data_root), "--pretrained",
                 str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "o"), "--quiet"])
    assert r.exit_code == 2 and "missing.safetensors does not exist" in r.output


def test_cli_help_lists_options():
    r = _invoke(["--help"])
    assert r.exit_code == 0
    for opt in ("--method", "--dataset", "--backbone", "--pretrained", "--data-root", "--out", "--seed", "--device",
                "--limit", "--set", "--resume", "--force", "--anchor"):
        assert opt in r.output


#: methods that cannot run on a SigLIP model -> the reason their one-line error names (docs/methods.md, "SigLIP");
#: every other registered method must run end to end on the tiny SigLIP-style model
SIGLIP_CANNOT_RUN: dict[str, str] = {}


@pytest.fixture(scope="module")
def siglip_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("siglip-cache")  # shared: the images are encoded once for all methods


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_every_method_runs_on_a_siglip_model_or_says_why(key, tmp_path, data_root, tiny_siglip_dir,
                                                         siglip_cache):
    """`zaec-extract` on a SigLIP-style model (bidirectional text tower pooled at the last token, logit bias,
    context length 64) loaded through local-dir:, for every registered method."""
    args = ["--method", key, "--dataset", "dtd", "--limit", "3"] + _base(tmp_path, data_root, tiny_siglip_dir)
    if key == "rlcf":  # offline: the policy as its own reward model; 2 classes: its top-k of 3 cannot be drawn
        args += ["--set", "reward_backbone=policy", "--set", "sample_k=2"]
    args[args.index("--cache-dir") + 1] = str(siglip_cache)
    r = _invoke(args)
    if key in SIGLIP_CANNOT_RUN:
        assert r.exit_code == 2 and SIGLIP_CANNOT_RUN[key] in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
        return
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "out"])
    s = read_shard(path)
    assert len(s) == 3 and s.meta.backbone == "tiny-siglip" and s.meta.method == key
    assert s.zs_logits.shape == s.tta_logits.shape == (3, 2)
