"""A user's own test set (`folder:PATH`, `split:FILE.json`), ImageNet-C, and the methods' settings for unseen data."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from extract import datasets as ds
from extract.cli import app
from extract.datasets import (
    IMAGENET_C_CORRUPTIONS,
    IMAGENET_C_DATASETS,
    DatasetError,
    expand_dataset_keys,
    get_dataset,
    imagenet_classnames,
    imagenet_synsets,
    load_testset,
    resolve_dataset,
)
from extract.methods import REGISTRY as METHODS
from extract.prompts import USER_PROMPT_POLICIES, PromptError, build_prompt_set
from extract.run.options import RunError
from extract.runner import plan_run, run_extraction
from extract.views import ViewGenerator
from schemas.shard import find_shards, read_shard

from tests.support.extract import make_imagenet_folders, write_image

cli = CliRunner()


@pytest.fixture(autouse=True)
def _fresh_user_registry(monkeypatch):
    # every test starts as a fresh process would: no user dataset registered
    monkeypatch.setattr(ds, "_USER_SPECS", {})


def make_folder(root: Path, layout: dict[str, list[str]], *, seed: int = 0) -> Path:
    """Write `root/<class>/<relative file>` images (random pixels) for every class and file name given."""
    rng = np.random.default_rng(seed)
    for cls, files in layout.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for f in files:
            write_image(root / cls / f, rng, mode="L" if len(f) % 3 == 0 else "RGB")
    return root


PETS = {
    "tabby_cat": ["b.png", "a.jpg", "sub/c.png"],
    "dog": ["z.JPEG", "m.png"],
    "Zebra": ["1.bmp"],
    "dog-x": ["k.png"],  # '-' sorts before '/': the global relative-path order differs from class-then-file order
}


def test_folder_order_labels_and_names(tmp_path):
    root = make_folder(tmp_path / "my_pets", PETS)
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / "dog" / ".hidden.png").write_bytes(b"")
    (root / ".cache").mkdir()
    (root / "README.md").write_text("top-level files are not classes")
    key = resolve_dataset(f"folder:{root}")
    assert key == "my_pets"
    ts = load_testset(key)
    classes = sorted(PETS)  # label order: the sorted folder names
    assert ts.class_names == tuple(c.replace("_", " ") for c in classes)
    want = sorted(f"{c}/{f}" for c, fs in PETS.items() for f in fs)
    assert [p.relative_to(root).as_posix() for p in ts.paths] == want
    assert ts.labels.tolist() == [classes.index(r.split("/")[0]) for r in want]
    assert ts.labels.dtype == np.int64 and ts.dataset_dir == root.resolve()
    assert ts.notes["source"] == f"folder:{root.resolve()}"
    assert want.index("dog-x/k.png") < want.index("dog/m.png")  # the order really is by relative path
    # the same object type as a registered set's: the image paths are absolute and exist
    assert type(ts) is type(load_testset(key)) and all(p.is_absolute() and p.is_file() for p in ts.paths)


@pytest.mark.parametrize("bom", [False, True], ids=["plain", "bom"])
@pytest.mark.parametrize("fmt", ["lines", "json"])
def test_class_names_file(tmp_path, fmt, bom):
    root = make_folder(tmp_path / "pets", PETS)
    names = ["a cat", "a dog", "a dog, dashed", "a zebra"]  # label order = sorted folders: Zebra, dog, dog-x, ...
    f = tmp_path / "names.txt"
    # a UTF-8 byte-order mark (Windows editors write one) is not part of the first name
    f.write_text(("\ufeff" if bom else "") + (json.dumps(names) if fmt == "json" else "\n".join(names) + "\n\n"),
                 encoding="utf-8")
    key = resolve_dataset(f"folder:{root}", name="pets2", class_names=f)
    ts = load_testset(key)
    assert key == "pets2" and ts.class_names == tuple(names)
    assert ts.notes["class_names_file"] == str(f.resolve())


def _err(fn, *a, **k) -> str:
    with pytest.raises(DatasetError) as e:
        fn(*a, **k)
    return str(e.value)


def test_folder_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "the folder is empty" in _err(load_testset, resolve_dataset(f"folder:{tmp_path / 'empty'}"))
    flat = tmp_path / "flat"
    write_image(flat / "a.png", np.random.default_rng(0))
    assert "no class sub-folders" in _err(load_testset, resolve_dataset(f"folder:{flat}"))
    holes = make_folder(tmp_path / "holes", {"cat": ["a.png"], "dog": []})
    (holes / "dog" / "readme.txt").write_text("x")
    msg = _err(load_testset, resolve_dataset(f"folder:{holes}"))
    assert f"{holes / 'dog'}: class folder holds no images" in msg
    dup = make_folder(tmp_path / "dup", {"sea_lion": ["a.png"], "sea lion": ["b.png"]})
    assert "duplicate class name(s) 'sea lion'" in _err(load_testset, resolve_dataset(f"folder:{dup}"))
    names = tmp_path / "names.txt"
    names.write_text("one\ntwo\nthree\n")
    two = make_folder(tmp_path / "two", {"a": ["a.png"], "b": ["b.png"]})
    msg = _err(load_testset, resolve_dataset(f"folder:{two}", class_names=names))
    assert "3 class name(s) for 2 class folder(s)" in msg and str(names.resolve()) in msg
    names.write_text('["one", "one"]')
    assert "duplicate class name(s) 'one'" in _err(resolve_dataset, f"folder:{two}", class_names=names)
    names.write_text('["one", 2]')
    assert "a JSON list of non-empty strings" in _err(resolve_dataset, f"folder:{two}", class_names=names)
    assert "is not a folder" in _err(resolve_dataset, f"folder:{tmp_path / 'nope'}")
    assert "is a registered dataset key" in _err(resolve_dataset, f"folder:{two}", name="dtd")
    spaced = make_folder(tmp_path / "my pets", {"a": ["a.png"]})
    assert "pass --dataset-name NAME" in _err(resolve_dataset, f"folder:{spaced}")
    assert "apply to folder:PATH and split:FILE.json datasets only" in _err(resolve_dataset, "dtd", name="x")


def test_duplicate_class_names_hint_fits_their_source(tmp_path):
    # --class-names is suggested only where no such file was given
    dup = make_folder(tmp_path / "dup", {"sea_lion": ["a.png"], "sea lion": ["b.png"]})
    msg = _err(load_testset, resolve_dataset(f"folder:{dup}"))
    assert "rename a folder or pass --class-names FILE" in msg
    two = make_folder(tmp_path / "two", {"a": ["a.png"], "b": ["b.png"]})
    names = tmp_path / "names.txt"
    names.write_text("same\nsame\n")
    msg = _err(resolve_dataset, f"folder:{two}", class_names=names)
    assert msg.startswith(f"--class-names {names.resolve()}: duplicate class name(s) 'same'")
    assert "edit the file so that no name repeats" in msg and "pass --class-names" not in msg
    msg = _err(resolve_dataset, f"split:{_split(tmp_path / 'sp', [('a.png', 0, 'x'), ('b.png', 1, 'x')])}",
               class_names=names)
    assert "edit the file so that no name repeats" in msg and "pass --class-names" not in msg
    split = _split(tmp_path / "sp2", [("a.png", 0, "x_y"), ("b.png", 1, "x y")])
    msg = _err(load_testset, resolve_dataset(f"split:{split}"))
    assert f"{split}: class names: duplicate class name(s) 'x y'" in msg
    assert "fix the split's names or pass --class-names FILE" in msg
    names.write_text("one\ntwo\n")  # a file that fixes the split's duplicates is accepted
    assert load_testset(resolve_dataset(f"split:{split}", name="sp3", class_names=names)).class_names == ("one",
                                                                                                          "two")


def _split(root: Path, test: list[tuple[str, int, str]]) -> Path:
    """A split file `root/split.json` listing `test` (relative path, label, name), with an image for each path."""
    rng = np.random.default_rng(0)
    for rel, _, _ in test:
        if not (root / rel).exists():
            write_image(root / rel, rng)
    (root / "split.json").write_text(json.dumps({"test": [list(t) for t in test]}))
    return root / "split.json"


def _listed_twice(fn, *a) -> str:
    msg = _err(fn, *a)
    assert "listed more than once" in msg and "\n" not in msg
    return msg


def test_split_listing_an_image_twice_is_an_error(tmp_path):
    # the same entry twice, the same file under two spellings, and a symlink to a listed file
    split = _split(tmp_path / "xr", [("n/1.png", 0, "a"), ("p/2.png", 1, "b"), ("n/1.png", 0, "a"),
                                     ("n/3.png", 0, "a"), ("p/./2.png", 1, "b")])
    msg = _listed_twice(load_testset, resolve_dataset(f"split:{split}"))
    assert msg.startswith(f"{split}: 2 image file(s) of dataset 'xr' are listed more than once (2 extra sample(s))")
    assert "'n/1.png' 2 times (sample_id 0, 2)" in msg and "'p/2.png' 2 times (sample_id 1, 4)" in msg
    os.symlink("1.png", tmp_path / "xr" / "n" / "link.png")
    (tmp_path / "xr" / "m").symlink_to("n", target_is_directory=True)
    split = _split(tmp_path / "xr", [("n/1.png", 0, "a"), ("p/2.png", 1, "b"), ("n/link.png", 0, "a"),
                                     ("m/3.png", 0, "a"), ("n/3.png", 0, "a")])
    msg = _listed_twice(load_testset, resolve_dataset(f"split:{split}", name="xr2"))
    assert "'n/1.png' (sample_id 0) = 'n/link.png' (sample_id 2)" in msg
    assert "'m/3.png' (sample_id 3) = 'n/3.png' (sample_id 4)" in msg
    # more than three: the first three and the count of the others
    many = [(f"c{c}/{i}.png", c, f"k{c}") for c in range(2) for i in range(5)]
    split = _split(tmp_path / "many", many + many)
    msg = _listed_twice(load_testset, resolve_dataset(f"split:{split}"))
    assert "10 image file(s)" in msg and "(10 extra sample(s))" in msg and "; and 7 more;" in msg
    # distinct files are fine, also two hard links to one file (two files by name) and identical bytes
    os.link(tmp_path / "xr" / "n" / "1.png", tmp_path / "xr" / "n" / "hard.png")
    (tmp_path / "xr" / "n" / "copy.png").write_bytes((tmp_path / "xr" / "n" / "1.png").read_bytes())
    split = _split(tmp_path / "xr", [("n/1.png", 0, "a"), ("n/hard.png", 0, "a"), ("n/copy.png", 0, "a"),
                                     ("p/2.png", 1, "b")])
    assert len(load_testset(resolve_dataset(f"split:{split}", name="xr3"))) == 4


def _seven(root: Path) -> Path:
    return make_folder(root, {"cat": ["a.png", "b.png", "sub/c.png", "sub/d.png"], "dog": ["x.png", "y.png",
                                                                                          "z.png"]})


def test_folder_symlink_cycles_are_never_followed(tmp_path):
    root = _seven(tmp_path / "pets")
    want = load_testset(resolve_dataset(f"folder:{root}", name="plain"))
    assert len(want) == 7
    # the case: a link to its own folder turned 7 images into 287 samples
    os.symlink(".", root / "cat" / "self")
    assert len(load_testset(resolve_dataset(f"folder:{root}", name="one_loop"))) == 7
    # links back to a folder being walked: itself, its parent, the dataset folder, a folder above it
    os.symlink("..", root / "cat" / "sub" / "up")
    os.symlink("../..", root / "dog" / "top")
    os.symlink(str(tmp_path), root / "dog" / "above")
    os.symlink(".", root / "loop")  # at the class level: not a class
    os.symlink("nowhere", root / "dog" / "broken")
    os.symlink("me", root / "dog" / "me")  # a link to itself
    ts = load_testset(resolve_dataset(f"folder:{root}"))
    assert ts.paths == want.paths and ts.labels.tolist() == want.labels.tolist()
    assert ts.class_names == ("cat", "dog")
    assert ts.notes["symlink_cycles"] == ("not followed (each leads back to a folder it lies in): cat/self, "
                                          "cat/sub/up, dog/above, dog/top, loop")


def test_folder_symlinked_folders_are_followed_once(tmp_path):
    root = _seven(tmp_path / "pets")
    # a class folder and a sub-folder that live elsewhere are followed (no cycle, nothing reached twice)
    make_folder(tmp_path / "elsewhere", {"birds": ["p.png"], "more_dogs": ["w.png"]})
    (root / "bird").symlink_to(tmp_path / "elsewhere" / "birds", target_is_directory=True)
    (root / "dog" / "extra").symlink_to(tmp_path / "elsewhere" / "more_dogs", target_is_directory=True)
    ts = load_testset(resolve_dataset(f"folder:{root}"))
    rels = [p.relative_to(root).as_posix() for p in ts.paths]
    assert rels == sorted(["bird/p.png", "cat/a.png", "cat/b.png", "cat/sub/c.png", "cat/sub/d.png", "dog/x.png",
                           "dog/y.png", "dog/z.png", "dog/extra/w.png"])
    assert "symlink_cycles" not in ts.notes
    # a link to a sibling class reaches its files twice: an error naming them
    (root / "cat" / "dogs").symlink_to("../dog", target_is_directory=True)
    msg = _listed_twice(load_testset, resolve_dataset(f"folder:{root}", name="p2"))
    assert msg.startswith(f"{root.resolve()}: 4 image file(s) of dataset 'p2' are listed more than once")
    assert "'cat/dogs/extra/w.png' (sample_id " in msg and "= 'dog/extra/w.png' (sample_id" in msg
    (root / "cat" / "dogs").unlink()
    # a symlinked file next to its target, and two links into one outside folder
    os.symlink("a.png", root / "cat" / "a2.png")
    msg = _listed_twice(load_testset, resolve_dataset(f"folder:{root}", name="p3"))
    assert "1 image file(s)" in msg and "'cat/a.png' (sample_id 1) = 'cat/a2.png' (sample_id 2)" in msg


def test_split_file_uses_the_coop_reader(tmp_path):
    root = tmp_path / "xray"
    rng = np.random.default_rng(1)
    test = []
    for rel, y, name in [("imgs/n/1.png", 1, "normal_lung"), ("imgs/p/2.png", 0, "pneumonia"),
                         ("imgs/n/3.png", 1, "normal_lung")]:
        write_image(root / rel, rng)
        test.append([rel, y, name])
    split = root / "split.json"
    split.write_text(json.dumps({"train": [], "val": [], "test": test}))
    key = resolve_dataset(f"split:{split}")
    ts = load_testset(key)
    assert key == "xray" and ts.class_names == ("pneumonia", "normal lung")
    assert [p.relative_to(root).as_posix() for p in ts.paths] == [t[0] for t in test]  # the file's order
    assert ts.labels.tolist() == [1, 0, 1]
    names = tmp_path / "names.txt"
    names.write_text("bacterial pneumonia\nhealthy lung\n")
    ts = load_testset(resolve_dataset(f"split:{split}", name="xray2", class_names=names))
    assert ts.class_names == ("bacterial pneumonia", "healthy lung")
    names.write_text("only one\n")
    assert "1 class name(s) for the 2 labels" in _err(load_testset, resolve_dataset(f"split:{split}",
                                                                                     class_names=names))
    split.write_text(json.dumps({"test": [["../../etc/passwd", 0, "x"]]}))
    assert "escapes the dataset folder" in _err(load_testset, resolve_dataset(f"split:{split}"))


def test_imagenet_c_keys_and_layout(tmp_path):
    assert len(IMAGENET_C_DATASETS) == 75 == len(set(IMAGENET_C_DATASETS))
    assert expand_dataset_keys("imagenet_c") == IMAGENET_C_DATASETS
    assert expand_dataset_keys("imagenet_c:snow") == tuple(f"imagenet_c:snow:{s}" for s in range(1, 6))
    assert expand_dataset_keys("dtd") == ("dtd",)
    from calibrate.tables import layout
    assert tuple(layout.IMAGENET_C_CORRUPTIONS) == IMAGENET_C_CORRUPTIONS
    assert layout.GROUPS[layout.IMAGENET_C_GROUP] == IMAGENET_C_DATASETS
    syn = imagenet_synsets()
    wnids = [syn[999], syn[0], syn[417]]
    make_imagenet_folders(tmp_path, "imagenet_c:glass_blur:4", wnids, per_class=2)
    assert (tmp_path / "imagenet-c" / "glass_blur" / "4" / syn[0]).is_dir()
    ts = load_testset("imagenet_c:glass_blur:4", tmp_path)
    assert ts.num_classes == 1000 and ts.class_names == imagenet_classnames()
    assert ts.labels.tolist() == [0, 0, 417, 417, 999, 999]
    assert "imagenet-c/<corruption>" not in _err(load_testset, "imagenet_c:fog:1", tmp_path)  # its own folder
    assert f"{tmp_path}/imagenet-c/fog/1/<wnid>/<image>" in _err(load_testset, "imagenet_c:fog:1", tmp_path)
    from extract.run.options import RunOptions, backbone_refusal

    for key in METHODS:  # ImageNet's method settings and prompts (on RN50, or ViT-B-16 for a method RN50 refuses)
        bb = "RN50" if backbone_refusal(RunOptions(key, "imagenet_c:glass_blur:4", backbone="RN50")) is None \
            else "ViT-B-16"
        plan = plan_run(key, "imagenet_c:glass_blur:4", backbone=bb, pretrained="openai", seed=1, overrides=None,
                        anchor="single", limit=None)
        assert plan.config == METHODS[key].default_config("imagenet", bb) and plan.settings_note == ""
    assert build_prompt_set("imagenet_c:fog:1", ["x"], policy="dataset").templates == \
        build_prompt_set("imagenet", ["x"], policy="dataset").templates


@pytest.mark.parametrize("key", sorted(METHODS))
def test_unseen_config_per_method(key):
    cls = METHODS[key]
    for backbone in ("ViT-B-16", "RN50"):
        cfg = cls.unseen_config(backbone)
        assert cfg == dataclasses.replace(cls.default_config(cls.unseen_like, backbone), **cls.unseen_changes)
        assert cfg.prompts in USER_PROMPT_POLICIES and not cfg.cupl
        # the online cache methods: one view, as on the fine-grained sets (DynaPrompt tunes on 64 views); DMN keeps
        # its 32 of 64 views, which its official code uses on every set (DMN-weak is DMN on one view), and so do BCA
        # (64 views on every set in TTABC's settings) and COSMIC (DMN's 8 of 64, built on DMN's code)
        if not cfg.episodic and not cls.needs_text_encoder and key not in ("dmn", "bca", "cosmic"):
            assert cfg.n_views == 1


def test_dmn_on_unseen_data_is_not_dmn_weak(tmp_path):
    """Issue 32 item 7: on a user's dataset `dmn` ran DMN-weak's config (one view; the settings line said
    `n_views=1 ... used_views=32`). It now runs DMN's multi-view setting (the official 32 of 64 views, AugMix as on
    every set outside the ImageNet family), DMN-weak its one view, and the settings line says which."""
    key = resolve_dataset(f"folder:{make_folder(tmp_path / 'sat', {'a': ['a.png'], 'b': ['b.png']})}")
    plans = {m: plan_run(m, key, backbone="ViT-B-16", pretrained="openai", seed=1, overrides=None,
                         anchor="single", limit=None) for m in ("dmn", "dmn-weak")}
    dmn, weak = plans["dmn"], plans["dmn-weak"]
    assert (dmn.config.n_views, dmn.config.used_views, dmn.config.augmix, dmn.policy) == (64, 32, True, "augmix")
    assert (weak.config.n_views, weak.config.used_views, weak.config.augmix, weak.policy) == (1, 1, False, "single")
    for p in plans.values():
        assert (p.config.prompts, p.config.cupl, p.config.mem_weight) == ("imagenet80", False, 1.0)
    assert dataclasses.replace(dmn.config, n_views=1, used_views=1, augmix=False) == weak.config
    assert dmn.settings_note == "dmn's settings for unseen data: imagenet's row, augmix=True, prompts=imagenet80, " \
                                "cupl=False"


def test_plan_for_unseen_data(tmp_path):
    key = resolve_dataset(f"folder:{make_folder(tmp_path / 'sat', {'a': ['a.png'], 'b': ['b.png']})}")
    plan = plan_run("dpe", key, backbone="RN50", pretrained="openai", seed=1, overrides={"alpha": "3"},
                    anchor="single", limit=None)
    assert plan.config == dataclasses.replace(METHODS["dpe"].unseen_config("RN50"), alpha=3.0)
    assert plan.key.dataset == "sat" and "imagenet's row, n_views=1" in plan.settings_note
    assert plan.settings_note.endswith("then --set alpha=3")
    for bad in ({"cupl": "true"}, {"prompts": "dataset"}):
        with pytest.raises(RunError, match="prompts must be one of single, imagenet80 and cupl false"):
            plan_run("tda", key, backbone="RN50", pretrained="openai", seed=1, overrides=bad, anchor="single",
                     limit=None)
    with pytest.raises(PromptError, match="has no per-dataset templates"):
        build_prompt_set(key, ["a", "b"], policy="dataset")


def test_run_on_a_folder_end_to_end(tmp_path, tiny_model):
    root = make_folder(tmp_path / "pets", PETS, seed=3)
    lines: list[str] = []
    paths = run_extraction("zero-shot", f"folder:{root}", out=tmp_path / "out", cache_dir=tmp_path / "cache",
                           model=tiny_model, progress=False, log=lines.append)
    (shard,) = [read_shard(p) for p in paths]
    meta = shard.meta
    assert meta.dataset == "pets" and "dataset=pets" in str(paths[0])
    assert meta.method_config == json.loads(json.dumps(dataclasses.asdict(METHODS["zero-shot"].unseen_config(
        "tiny-clip"))))
    assert meta.extra["zaec:method_settings"] == "zero-shot's settings for unseen data: imagenet's row"
    assert meta.extra["zaec:source"] == f"folder:{root.resolve()}"
    assert lines[0].startswith("pets has no official settings; zero-shot's settings for unseen data")
    # each row is the image its sample_id names in the sorted relative-path order: recompute every image's
    # zero-shot logits one by one and identify the row by its nearest recomputed vector
    rels = sorted(f"{c}/{f}" for c, fs in PETS.items() for f in fs)
    names = [c.replace("_", " ") for c in sorted(PETS)]
    text = tiny_model.text_prototypes([[f"a photo of a {n}."] for n in names])
    view0 = ViewGenerator(tiny_model.preprocess, "single", seed=1).original
    with torch.no_grad():
        feats = torch.cat([tiny_model.encode_images(view0(ds.open_image(root / r))[None]) for r in rels])
    want = (tiny_model.logit_scale * feats @ text.T).numpy()
    dist = ((shard.zs_logits[:, None, :] - want[None]) ** 2).sum(-1)
    assert dist.argmin(1).tolist() == shard.sample_id.tolist()
    assert shard.label.tolist() == [sorted(PETS).index(rels[i].split("/")[0]) for i in shard.sample_id]


def _cli(args, tmp_path, model_dir):
    base = ["--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--pretrained",
            f"local-dir:{model_dir}", "--device", "cpu", "--quiet"]
    return cli.invoke(app, args + base, catch_exceptions=False)


def test_cli_folder_with_name_and_class_names(tmp_path, tiny_model_dir):
    root = make_folder(tmp_path / "scans", {"benign": ["a.png", "b.png"], "malignant": ["c.png"]})
    names = tmp_path / "names.json"
    names.write_text('["benign lesion", "malignant lesion"]')
    r = _cli(["--method", "tda", "--dataset", f"folder:{root}", "--dataset-name", "derm", "--class-names",
              str(names), "--set", "beta=4"], tmp_path, tiny_model_dir)
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "out"])
    meta = read_shard(path).meta
    assert meta.dataset == "derm" and meta.class_names == ("benign lesion", "malignant lesion")
    assert meta.method_config["beta"] == 4.0 and meta.method_config["prompts"] == "imagenet80"
    assert meta.method_config["n_views"] == 1


def _bad_image_folder(tmp_path: Path) -> Path:
    root = make_folder(tmp_path / "broken", {"a": ["ok.png"], "b": ["fine.png"]})
    (root / "b" / "torn.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


@pytest.mark.parametrize("case, needle", [
    ("empty", "the folder is empty"),
    ("no_images", "class folder holds no images"),
    ("names_count", "3 class name(s) for 2 class folder(s)"),
    ("duplicates", "duplicate class name(s) 'a b'"),
    ("unreadable", "torn.jpg: cannot read image"),
    ("listed_twice", "1 image file(s) of dataset 'x' are listed more than once"),
    ("cupl", "prompts must be one of single, imagenet80 and cupl false"),
])
def test_cli_user_errors(tmp_path, tiny_model_dir, case, needle):
    data = tmp_path / "data"
    data.mkdir()
    extra: list[str] = []
    if case == "empty":
        root = data / "void"
        root.mkdir()
    elif case == "no_images":
        root = make_folder(data / "x", {"a": ["a.png"], "b": []})
    elif case == "names_count":
        root = make_folder(data / "x", {"a": ["a.png"], "b": ["b.png"]})
        (data / "n.txt").write_text("1\n2\n3\n")
        extra = ["--class-names", str(data / "n.txt")]
    elif case == "duplicates":
        root = make_folder(data / "x", {"a_b": ["a.png"], "a b": ["b.png"]})
    elif case == "unreadable":
        root = _bad_image_folder(data)
    elif case == "listed_twice":
        root = make_folder(data / "x", {"a": ["a.png"], "b": ["b.png"]})
        os.symlink("a.png", root / "a" / "again.png")
    else:
        root = make_folder(data / "x", {"a": ["a.png"], "b": ["b.png"]})
        extra = ["--set", "cupl=true"]
    r = _cli(["--method", "tda", "--dataset", f"folder:{root}"] + extra, tmp_path, tiny_model_dir)
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) <= 2  # one message (rich may wrap a long path once)
    assert not (tmp_path / "out").exists()


def test_unreadable_image_from_a_loader_process_is_named(tmp_path, tiny_model):
    root = _bad_image_folder(tmp_path)
    with pytest.raises(DatasetError) as e:
        run_extraction("zero-shot", f"folder:{root}", out=tmp_path / "out", cache_dir=tmp_path / "cache",
                       model=tiny_model, progress=False, workers=1, log=lambda s: None)
    msg = str(e.value)
    assert msg.startswith(f"{root / 'b' / 'torn.jpg'}: cannot read image") and "Traceback" not in msg
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_sweep_with_own_data_and_a_fresh_worker(tmp_path, tiny_model_dir, monkeypatch):
    from extract.sweep.job import run_group
    from extract.sweep.cost import n_images
    from extract.sweep.errors import SweepError
    from extract.sweep.grid import Grid, expand_datasets, expand_grid, group_runs

    a = make_folder(tmp_path / "a", {"x": ["1.png", "2.png"], "y": ["3.png"]})
    b = make_folder(tmp_path / "b" / "a", {"x": ["1.png"], "y": ["2.png"]})
    assert expand_datasets(["imagenet_c:fog", "dtd", f"folder:{a}", f"other=folder:{b}", "imagenet_c:fog:2"]) == (
        "imagenet_c:fog:1", "imagenet_c:fog:2", "imagenet_c:fog:3", "imagenet_c:fog:4", "imagenet_c:fog:5", "dtd",
        "a", "other")
    assert len(expand_datasets(["imagenet_c"])) == 75 and n_images("imagenet_c:fog:3") == 50000
    with pytest.raises(SweepError, match="two datasets are named 'a'"):
        expand_datasets([f"folder:{a}", f"folder:{b}"])
    with pytest.raises(SweepError, match="NAME=... names folder:PATH or split:FILE.json datasets only"):
        expand_datasets(["x=dtd"])
    runs = expand_grid(Grid(("zero-shot", "tda"), (f"mine=folder:{a}",), (),
                            pretrained=f"local-dir:{tiny_model_dir}"),
                       out=tmp_path / "out", cache_dir=tmp_path / "cache", device="cpu")
    assert {r.dataset for r in runs} == {"mine"} and {r.options.dataset_ref for r in runs} == {f"folder:{a.resolve()}"}
    (group,) = group_runs(runs)
    assert n_images("mine") == 3
    monkeypatch.setattr(ds, "_USER_SPECS", {})  # a worker process: nothing registered yet
    results = run_group(group, "tok")
    assert [r["state"] for r in results] == ["done", "done"], results
    metas = [read_shard(p).meta for p in find_shards([tmp_path / "out"])]
    assert {m.dataset for m in metas} == {"mine"} and {m.method for m in metas} == {"zero-shot", "tda"}


def test_tables_group_other_datasets():
    from calibrate.tables.layout import dataset_label, order_datasets

    got = order_datasets(["mine", "imagenet_c:fog:2", "dtd", "imagenet_c:gaussian_noise:5", "fmnist"])
    assert got == [("fine_grained", ["dtd"]), ("imagenet_c", ["imagenet_c:gaussian_noise:5", "imagenet_c:fog:2"]),
                   ("other", ["fmnist", "mine"])]
    assert dataset_label("imagenet_c:fog:2") == "Fog-2" and dataset_label("mine") == "mine"


def test_get_dataset_lists_the_families():
    msg = _err(get_dataset, "nope")
    assert "imagenet_c:<corruption>:<severity>" in msg and "folder:PATH" in msg and "split:FILE.json" in msg
    assert "imagenet_c:fog:1," not in msg  # the 75 keys are summarised, not listed
    assert os.sep not in get_dataset("dtd").key


def test_sweep_cli_dry_run_with_imagenet_c_and_a_folder(tmp_path):
    from extract.sweep import cli as sweep_cli

    a = make_folder(tmp_path / "scans", {"x": ["1.png", "2.png"], "y": ["3.png"]})
    out = tmp_path / "out"
    res = cli.invoke(sweep_cli.app, ["run", "--methods", "zero-shot,tda", "--datasets", f"imagenet_c,mine=folder:{a}",
                                     "--out", str(out), "--dry-run", "--skip-data-check"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "152 run(s) to submit in 76 group(s)" in text and "mine" in text
    assert not out.exists()
    res = cli.invoke(sweep_cli.app, ["run", "--methods", "tda", "--datasets", f"folder:{tmp_path / 'nope'}",
                                     "--out", str(out), "--dry-run"])
    assert res.exit_code == 2 and "is not a folder" in res.output and "Traceback" not in res.output


def _sweep_folder_with_names(tmp_path: Path) -> tuple[Path, Path]:
    root = make_folder(tmp_path / "scans", {"benign": ["a.png", "b.png"], "malignant": ["c.png"]})
    names = tmp_path / "names.txt"
    names.write_text("benign lesion\nmalignant lesion\n")
    return root, names


def test_sweep_class_names_per_dataset(tmp_path):
    from extract.sweep import cli as sweep_cli
    from extract.sweep.grid import Grid, expand_grid

    root, names = _sweep_folder_with_names(tmp_path)
    other = make_folder(tmp_path / "sat", {"x": ["1.png"], "y": ["2.png"]})
    runs = expand_grid(Grid(("zero-shot", "tda"), (f"derm=folder:{root}", f"folder:{other}"),
                            class_names=(("derm", str(names)),)), out=tmp_path / "out")
    assert {(r.dataset, r.options.class_names_file) for r in runs} == {("derm", str(names.resolve())), ("sat", None)}
    assert load_testset("derm").class_names == ("benign lesion", "malignant lesion")
    assert load_testset("sat").class_names == ("x", "y")

    # the option and the config file's table give the same plan
    out = tmp_path / "out"
    base = ["run", "--methods", "zero-shot", "--datasets", f"derm=folder:{root}", "--out", str(out), "--dry-run"]
    by_option = cli.invoke(sweep_cli.app, base + ["--class-names", f"derm={names}"])
    toml = tmp_path / "grid.toml"
    toml.write_text(f'methods = "zero-shot"\ndatasets = ["derm=folder:{root}"]\nout = "{out}"\n'
                    f'[class_names]\nderm = "{names}"\n')
    ds._USER_SPECS.clear()
    by_config = cli.invoke(sweep_cli.app, ["run", "--config", str(toml), "--dry-run"])
    assert by_option.exit_code == 0 and by_config.exit_code == 0, by_option.output + by_config.output
    assert "derm" in by_option.output and by_option.output == by_config.output
    assert ds.dataset_source("derm") == (f"folder:{root.resolve()}", str(names.resolve()))
    assert not out.exists()


@pytest.mark.parametrize("entry, needle", [
    ("other={names}", "no folder:PATH or split:FILE.json dataset of --datasets is named 'other'; the sweep's own "
                      "datasets: derm"),
    ("dtd={names}", "no folder:PATH or split:FILE.json dataset of --datasets is named 'dtd'"),
    ("{names}", "--class-names expects NAME=FILE"),
    ("derm={missing}", "not a readable text file"),
    ("derm={three}", "3 class name(s) for 2 class folder(s)"),
])
def test_sweep_class_names_errors(tmp_path, entry, needle):
    from extract.sweep import cli as sweep_cli

    root, names = _sweep_folder_with_names(tmp_path)
    three = tmp_path / "three.json"
    three.write_text('["a", "b", "c"]')
    entry = entry.format(names=names, missing=tmp_path / "nope.txt", three=three)
    out = tmp_path / "out"
    res = cli.invoke(sweep_cli.app, ["run", "--methods", "tda", "--datasets", f"dtd,derm=folder:{root}",
                                     "--class-names", entry, "--out", str(out), "--dry-run", "--skip-data-check"])
    assert res.exit_code == 2, res.output
    assert needle in " ".join(res.output.split()) and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) <= 3  # one message (rich may wrap long paths)
    assert not out.exists()


@pytest.mark.slow
def test_sweep_local_job_and_retry_carry_the_class_names(tmp_path, tiny_model_dir):
    from extract.sweep import cli as sweep_cli
    from extract.sweep.manifest import Manifest

    root, names = _sweep_folder_with_names(tmp_path)
    bad = root / "malignant" / "c.png"
    good = bad.read_bytes()
    bad.write_bytes(b"not an image")  # the first job fails on it; `retry` runs again after the fix
    out = tmp_path / "out"
    args = ["run", "--methods", "zero-shot", "--datasets", f"derm=folder:{root}", "--class-names", f"derm={names}",
            "--pretrained", f"local-dir:{tiny_model_dir}", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
            "--device", "cpu"]
    res = cli.invoke(sweep_cli.app, args)
    assert res.exit_code == 1, res.output
    (row,) = Manifest.load(out).rows.values()
    assert row["state"] == "failed" and "c.png" in row["error"]
    assert row["spec"]["options"]["class_names_file"] == str(names.resolve())

    bad.write_bytes(good)
    ds._USER_SPECS.clear()  # `retry` finds the dataset and its class names in the manifest alone
    res = cli.invoke(sweep_cli.app, ["retry", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (path,) = find_shards([out])
    meta = read_shard(path).meta
    assert meta.dataset == "derm" and meta.class_names == ("benign lesion", "malignant lesion")

    # the finished run is reused with the same names, and refused (not silently kept) with other names
    same = cli.invoke(sweep_cli.app, args + ["--dry-run"])
    assert same.exit_code == 0 and "1 complete (skipped)" in " ".join(same.output.split()), same.output
    names.write_text("harmless\nharmful\n")
    changed = cli.invoke(sweep_cli.app, args + ["--dry-run"])
    assert changed.exit_code == 2 and "(samples (another split or class list))" in " ".join(changed.output.split()), \
        changed.output


@pytest.mark.parametrize("method", ["dpe", "dlae", "tda", "tpt"])
def test_one_class_dataset_is_one_line(tmp_path, tiny_model_dir, method):
    # DPE/DLAE divided by K - 1 (a 43-line traceback) and the others reported 100% accuracy
    root = make_folder(tmp_path / "solo", {"only": ["a.png", "b.png"]})
    with pytest.raises(DatasetError, match="needs at least two classes"):
        load_testset(resolve_dataset(f"folder:{root}", name=f"solo_{method}"))
    r = cli.invoke(app, ["--method", method, "--dataset", f"folder:{root}", "--out", str(tmp_path / "out"),
                         "--pretrained", f"local-dir:{tiny_model_dir}", "--device", "cpu", "--quiet"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs at least two classes" in lines[0], r.output


@pytest.mark.parametrize("where", ["out", "cache"])
def test_outputs_inside_a_folder_dataset_are_refused(tmp_path, tiny_model_dir, where):
    # issue 21: an --out or --cache-dir inside a folder: dataset broke the next run (its files became "classes")
    root = make_folder(tmp_path / "scans", {"benign": ["a.png", "b.png"], "malignant": ["c.png"]})
    inside = root / "zaec-output"
    out = inside if where == "out" else tmp_path / "out"
    cache = inside if where == "cache" else tmp_path / "cache"
    r = cli.invoke(app, ["--method", "zero-shot", "--dataset", f"folder:{root}", "--out", str(out), "--cache-dir",
                         str(cache), "--pretrained", f"local-dir:{tiny_model_dir}", "--device", "cpu", "--quiet"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    option = "--out" if where == "out" else "--cache-dir"
    assert f"{option} {inside}" in lines[0] and str(root) in lines[0]
    assert not inside.exists()  # nothing was written there


def test_exif_transpose_option_is_its_own_run(tmp_path, tiny_model_dir):
    # issue 21: EXIF orientation is ignored by default (as the official code and torchvision do); --exif-transpose
    # turns photos, is recorded, has its own feature-cache entry and is part of the finished-run check
    from PIL import Image

    root = make_folder(tmp_path / "photos", {"cat": ["a.png"], "dog": ["b.png"]})
    rng = np.random.default_rng(3)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: a viewer turns it 90 degrees
    Image.fromarray(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)).save(root / "cat" / "c.jpg", exif=exif)
    base = ["--method", "zero-shot", "--dataset", f"folder:{root}", "--cache-dir", str(tmp_path / "cache"),
            "--pretrained", f"local-dir:{tiny_model_dir}", "--device", "cpu", "--quiet"]
    plain = cli.invoke(app, base + ["--out", str(tmp_path / "a")])
    turned = cli.invoke(app, base + ["--out", str(tmp_path / "b"), "--exif-transpose"])
    assert plain.exit_code == 0 and turned.exit_code == 0, plain.output + turned.output
    (pa_,), (pb,) = find_shards([tmp_path / "a"]), find_shards([tmp_path / "b"])
    a, b = read_shard(pa_), read_shard(pb)
    assert "zaec:exif_transpose" not in a.meta.extra and b.meta.extra["zaec:exif_transpose"] == "true"
    c = [i for i, p in enumerate(sorted(["cat/a.png", "cat/c.jpg", "dog/b.png"])) if p == "cat/c.jpg"][0]
    row_a, row_b = a.zs_logits[a.sample_id == c], b.zs_logits[b.sample_id == c]
    assert not np.array_equal(row_a, row_b)  # other pixels: not served from the first run's feature cache
    others = a.sample_id != c
    np.testing.assert_array_equal(a.zs_logits[others], b.zs_logits[b.sample_id != c])  # untagged images unchanged
    again = cli.invoke(app, base + ["--out", str(tmp_path / "a"), "--exif-transpose"])  # the finished run differs
    assert again.exit_code == 2 and "exif_transpose" in again.output, again.output
