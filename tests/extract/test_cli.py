"""`zaec-extract`: the documented command line, and one clear line for every user error."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from extract.cli import app
from extract.methods import REGISTRY
from schemas.shard import find_shards, read_shard

from tests.support.extract import make_json_dataset, write_image

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


#: methods that cannot run on the tiny SigLIP-style model (a plain ViT image tower, SigLIP's text tower) -> the reason
#: their one-line error names, said by the method's `towers` before the model loads (docs/methods.md, "SigLIP" and
#: "Which backbones a method runs on"); every other registered method must run end to end on it
SIGLIP_CANNOT_RUN: dict[str, str] = {
    "promptalign": "promptalign prompts CLIP's causal text tower pooled at the end-of-text token (MaPLe): it runs on "
                   "a text tower that is CLIP's causal tower pooled at its end-of-text token; tiny-siglip's is another "
                   "open_clip text transformer"}


@pytest.fixture(scope="module")
def siglip_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("siglip-cache")  # shared: the images are encoded once for all methods


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_every_method_runs_on_a_siglip_model_or_says_why(key, tmp_path, data_root, tiny_siglip_dir,
                                                         siglip_cache, tiny_externals, monkeypatch):
    """`zaec-extract` on a SigLIP-style model (bidirectional text tower pooled at the last token, logit bias,
    context length 64) loaded through local-dir:, for every registered method."""
    args = ["--method", key, "--dataset", "dtd", "--limit", "3"] + _base(tmp_path, data_root, tiny_siglip_dir)
    if key == "rlcf":  # offline: the policy as its own reward model; 2 classes: its top-k of 3 cannot be drawn
        args += ["--set", "reward_backbone=policy", "--set", "sample_k=2"]
    elif REGISTRY[key].external_files:  # the tiny second models (tests/support/second_models.py)
        args += [a for k, v in tiny_externals.overrides(key).items() for a in ("--set", f"{k}={v}")]
    if REGISTRY[key].needs_descriptions:  # AWT: a description file for the set's classes
        import json

        from extract.datasets import load_testset

        names = load_testset("dtd", data_root).class_names
        (tmp_path / "desc").mkdir()
        (tmp_path / "desc" / "dtd.json").write_text(json.dumps({n: [f"{n} {i}." for i in range(50)] for n in names}))
        args += ["--descriptions-dir", str(tmp_path / "desc")]
    args[args.index("--cache-dir") + 1] = str(siglip_cache)
    if key in SIGLIP_CANNOT_RUN:  # refused before the model loads
        import extract.runner

        monkeypatch.setattr(extract.runner, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
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


# --- issue 32 item 2: the options of a folder:/split: set reach the in-distribution set of an OOD run -------------

@pytest.fixture(scope="module")
def user_sets(tmp_path_factory):
    """A 2-class folder set (`fash`), a folder of 3 unlabelled images (`noise`) and a class-names file."""
    root = tmp_path_factory.mktemp("user-sets")
    rng = np.random.default_rng(3)
    for cls in ("shirt_x", "shoe_y"):
        for i in range(3):
            write_image(root / "fash" / cls / f"{i}.png", rng)
    for i in range(3):
        write_image(root / "noise" / f"n{i}.png", rng)
    (root / "names.txt").write_text("T-shirt\nsneaker\n")
    return root


def _rows(out):
    shards = [read_shard(p) for p in find_shards([out])]
    sid = np.concatenate([s.sample_id for s in shards])
    order = np.argsort(sid)
    return shards[0].meta, sid[order], np.concatenate([s.zs_logits for s in shards])[order]


def test_ood_run_gives_class_names_to_its_in_distribution_set(tmp_path, user_sets, tiny_model_dir):
    names = user_sets / "names.txt"
    ood = ["--method", "zero-shot", "--dataset", f"folder:{user_sets / 'noise'}", "--ood-for",
           f"folder:{user_sets / 'fash'}", "--class-names", str(names)]
    r = _invoke(ood + _base(tmp_path / "ood", user_sets, tiny_model_dir))
    assert r.exit_code == 0, r.output
    meta, sid, zs = _rows(tmp_path / "ood" / "out")
    assert meta.dataset == "noise@fash" and meta.class_names == ("T-shirt", "sneaker")
    assert meta.extra["zaec:class_names_file"] == str(names.resolve())  # recorded in the shards
    # the in-distribution rows are those of a plain run of the set under the same names, not the folder names
    plain = ["--method", "zero-shot", "--dataset", f"folder:{user_sets / 'fash'}"]
    r = _invoke(plain + ["--class-names", str(names)] + _base(tmp_path / "named", user_sets, tiny_model_dir))
    assert r.exit_code == 0, r.output
    _, id_sid, id_zs = _rows(tmp_path / "named" / "out")
    r = _invoke(plain + _base(tmp_path / "folders", user_sets, tiny_model_dir))
    assert r.exit_code == 0, r.output
    _, _, folder_zs = _rows(tmp_path / "folders" / "out")
    n_id = len(id_sid)
    np.testing.assert_array_equal(sid[:n_id], id_sid)
    # features of the same pixels encoded in batches of another width: a few float32 eps per component, times
    # the logit scale (100) and the width D = 16 of the tiny model
    tol = 4 * 16 * 100 * np.finfo(np.float32).eps
    np.testing.assert_allclose(zs[:n_id], id_zs, rtol=0, atol=tol)
    assert np.abs(zs[:n_id] - folder_zs).max() > 100 * tol  # the folder names give other logits
    # the in-distribution set's own name, as --dataset-name gives a plain run's
    r = _invoke(ood + ["--ood-for-name", "clothes"] + _base(tmp_path / "named-ood", user_sets, tiny_model_dir))
    assert r.exit_code == 0, r.output
    assert _rows(tmp_path / "named-ood" / "out")[0].dataset == "noise@clothes"


@pytest.mark.parametrize("extra, needle", [
    (["--ood-for", "dtd", "--class-names", "NAMES"], "--class-names applies to a folder:PATH or split:FILE.json "
                                                     "in-distribution set; --ood-for 'dtd' is a registered key"),
    (["--ood-for-name", "x"], "--ood-for-name names the folder:/split: in-distribution set of an OOD run"),
])
def test_ood_set_options_never_dropped(tmp_path, user_sets, data_root, tiny_model_dir, extra, needle):
    extra = [str(user_sets / "names.txt") if a == "NAMES" else a for a in extra]
    r = _invoke(["--method", "zero-shot", "--dataset", f"folder:{user_sets / 'noise'}"] + extra
                + _base(tmp_path, data_root, tiny_model_dir))
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output


# --- issue 32 item 13: --adapt-batch and --part-size, as zaec-sweep and the API take them ----------------------

def test_cli_adapt_batch_and_part_size(tmp_path, data_root, tiny_model_dir):
    r = _invoke(["--method", "tda", "--dataset", "dtd", "--adapt-batch", "2", "--part-size", "4"]
                + _base(tmp_path, data_root, tiny_model_dir))
    assert r.exit_code == 0, r.output
    shards = [read_shard(p) for p in find_shards([tmp_path / "out"])]
    assert [len(s) for s in shards] == [4, 2]  # 6 samples in parts of 4 rows
    assert shards[0].meta.extra["zaec:adapt_batch"] == "2"  # recorded: a resumed run compares it
    # another width of the adapt calls is another run: the finished one is not served for it
    again = _invoke(["--method", "tda", "--dataset", "dtd", "--part-size", "4", "--adapt-batch", "4"]
                    + _base(tmp_path, data_root, tiny_model_dir))
    assert again.exit_code == 2 and "adapt_batch" in again.output and "--force" in again.output


@pytest.mark.parametrize("extra, needle", [
    (["--adapt-batch", "0"], "--adapt-batch must be >= 1, got 0"),
    (["--part-size", "0"], "--part-size must be >= 1, got 0"),
    (["--adapt-batch", "3", "--part-size", "8"], "part_size (8) must be a multiple of adapt_batch (3)"),
])
def test_cli_adapt_batch_and_part_size_checked_as_the_sweep_does(tmp_path, data_root, tiny_model_dir, extra,
                                                                 needle):
    from extract.sweep import cli as sweep

    r = _invoke(["--method", "tda", "--dataset", "dtd"] + extra + _base(tmp_path, data_root, tiny_model_dir))
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output
    s = runner.invoke(sweep.app, ["run", "--methods", "tda", "--datasets", "dtd", "--out", str(tmp_path / "sw"),
                                  "--dry-run", *extra])
    assert s.exit_code == 2 and needle in " ".join(s.output.split())


def test_cli_help_of_adapt_batch_and_part_size_is_the_sweeps():
    import inspect

    from extract import cli
    from extract.run.options import ADAPT_BATCH_HELP, DEFAULT_ADAPT_BATCH, DEFAULT_PART_SIZE, PART_SIZE_HELP
    from extract.sweep import cli as sweep

    mine = inspect.signature(cli.extract).parameters
    theirs = inspect.signature(sweep.run).parameters
    for name, text, default in (("adapt_batch", ADAPT_BATCH_HELP, DEFAULT_ADAPT_BATCH),
                                ("part_size", PART_SIZE_HELP, DEFAULT_PART_SIZE)):
        assert mine[name].default.help == text and theirs[name].default.help.startswith(text)
        assert mine[name].default.default == default and f"[default: {default}]" in theirs[name].default.help
    shown = _invoke(["--help"]).output
    assert "--adapt-batch" in shown and "--part-size" in shown


# --- issue 35 item 3: images over Pillow's pixel limits ----------------------------------------------------------

def _bomb(path):
    """A PNG whose header says 14,000 x 13,000 pixels (182 M, over Pillow's hard limit of 178,956,970): one bit a
    pixel, all zero, so the file is a few kilobytes (its pixels are never decoded)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("1", (14000, 13000)).save(path)
    return path


def _folder_set(root, n=4, size=(40, 48)):
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        for i in range(n // 2):
            write_image(root / c / f"{i}.png", rng, size)
    return root


@pytest.mark.parametrize("workers", ["0", "2"])
def test_an_image_over_the_pixel_limit_is_one_line_naming_it(tmp_path, tiny_model_dir, workers):
    """Pillow's DecompressionBombError (182 megapixels) ended the run with a traceback and exit 1, from a loader
    process too; now one line naming the file, its pixels and the limit, with the option that allows it."""
    root = _folder_set(tmp_path / "set")
    bomb = _bomb(root / "b" / "huge.png")
    r = runner.invoke(app, ["--method", "zero-shot", "--dataset", f"folder:{root}", "--workers", workers]
                      + _base(tmp_path, root, tiny_model_dir))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and str(bomb) in err[0], r.stderr
    assert "14000 x 13000 = 182,000,000 pixels, over the limit of 178,956,970" in err[0]
    assert "--max-image-pixels" in err[0]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_max_image_pixels_sets_the_limit(tmp_path, tiny_model_dir, workers):
    """`--max-image-pixels N` refuses images of more than N pixels, 0 none; the sweep passes it to its jobs."""
    root = _folder_set(tmp_path / "set")
    base = ["--method", "zero-shot", "--dataset", f"folder:{root}", "--workers", workers] + \
        _base(tmp_path, root, tiny_model_dir)
    r = runner.invoke(app, [*base, "--max-image-pixels", "1919"])
    assert r.exit_code == 2 and "40 x 48 = 1,920 pixels, over the limit of 1,919" in r.stderr, r.output
    assert runner.invoke(app, [*base, "--max-image-pixels", "1920"]).exit_code == 0
    assert runner.invoke(app, [*base, "--max-image-pixels", "0", "--force"]).exit_code == 0
    r = runner.invoke(app, [*base, "--max-image-pixels", "-1"])
    assert r.exit_code == 2 and "--max-image-pixels must be an integer >= 0" in r.stderr


@pytest.mark.parametrize("quiet", [True, False])
def test_large_images_are_noted_once_through_the_run_and_pillow_stays_silent(tmp_path, tiny_model_dir, quiet,
                                                                             monkeypatch):
    """Images between Pillow's warning threshold and the limit: Pillow's raw warning (two lines from its
    site-packages file, from each loader process, even under --quiet) is gone; the run notes them once through its
    own printer, and not under --quiet. The thresholds are lowered here so that 40 x 48 images stand for 90 M."""
    import warnings

    from PIL import Image

    from extract.run import encode

    # Pillow warns over 1,500 pixels (the 40 x 48 images), refuses over 3,000 (the model's 32 x 32 views are below)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1500)
    monkeypatch.setattr(encode, "WARN_IMAGE_PIXELS", 1500)
    root = _folder_set(tmp_path / "set")
    args = ["--method", "zero-shot", "--dataset", f"folder:{root}", *_base(tmp_path, root, tiny_model_dir)]
    if not quiet:
        args.remove("--quiet")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "DecompressionBomb" not in r.output and "site-packages" not in r.output
    said = [ln for ln in r.output.splitlines() if "image(s) of more than 1,500 pixels were read" in ln]
    assert len(said) == (0 if quiet else 1), r.output
    if not quiet:
        assert "the limit is 178,956,970 (--max-image-pixels)" in " ".join(r.output.split())


def test_every_option_is_in_the_documented_option_list():
    """Issue 35 item 6: docs/extract.md's option list (the paragraph from "Options:") names every option of
    `zaec-extract`; --exif-transpose was missing, and the docs called it "not yet a command-line option"."""
    import inspect
    import re
    from pathlib import Path

    from extract import cli

    doc = (Path(__file__).resolve().parents[2] / "docs" / "extract.md").read_text(encoding="utf-8")
    options = doc[doc.index("Options:"):doc.index("The last line on stdout")]
    documented = set(re.findall(r"--[a-z][a-z0-9-]*", options))
    flags = set()
    for p in inspect.signature(cli.extract).parameters.values():
        decls = [d for d in p.default.param_decls if d.startswith("--")] or [f"--{p.name.replace('_', '-')}"]
        flags.add(decls[0].split("/")[0])
    assert sorted(flags - documented) == []
    assert "not yet a command-line option" not in doc
