"""Dataset registry and the generic loader, on synthetic layouts written to a temporary folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from extract import datasets as ds
from extract.datasets import (
    FASHION_MNIST_CLASSES,
    OOD_DATASETS,
    PAPER_DATASETS,
    REGISTRY,
    DatasetError,
    check_outside_dataset,
    get_dataset,
    imagenet_classnames,
    imagenet_synsets,
    load_ood_images,
    load_testset,
    open_image,
    resolve_dataset,
)

from tests.support.extract import make_aircraft, make_imagenet_folders, make_json_dataset, write_image

JSON_KEYS = [k for k, s in REGISTRY.items() if s.kind == "json"]
FOLDER_KEYS = [k for k, s in REGISTRY.items() if s.kind == "folders"]


def test_registry_shape():
    assert len(PAPER_DATASETS) == 15
    for key, spec in REGISTRY.items():
        assert spec.key == key
        if key in OOD_DATASETS:  # images without classes and without settings of their own (--ood-for)
            assert spec.group == "ood" and spec.kind == "ood_images" and spec.hparams_from is None
            continue
        assert spec.group == ("demo" if key.startswith("fmnist") else "corruption" if key.startswith("imagenet_c:")
                              else "natural" if key.startswith("imagenet") else "fine_grained")
        assert spec.hparams_from in PAPER_DATASETS
        if spec.group == "corruption":
            assert spec.hparams_from == "imagenet" and spec.folder_scheme == "wnid1000"
        elif spec.group != "demo":
            assert spec.hparams_from == key
    demo = [get_dataset(k) for k in ("fmnist", "fmnist_noise", "fmnist_blur", "fmnist_contrast", "fmnist_invert",
                                     "fmnist_rotate")]
    assert {d.hparams_from for d in demo} == {"eurosat"}  # single-view rows for 32-pixel images
    assert {d.templates_from for d in demo} == {"imagenet"}  # generic templates, not EuroSAT's satellite prompt


def test_unknown_dataset_lists_keys():
    with pytest.raises(DatasetError, match=r"unknown dataset 'dtdd'; available: imagenet, .*dtd"):
        get_dataset("dtdd")


@pytest.mark.parametrize("key", JSON_KEYS)
def test_json_split_every_layout(tmp_path, key):
    spec = get_dataset(key)
    for i, lay in enumerate(spec.layouts):
        root = tmp_path / f"layout{i}"
        names = list(FASHION_MNIST_CLASSES[:3]) if spec.class_names else ["a_b", "c", "d e"]
        split = make_json_dataset(root, key, class_names=names, per_class=2, layout=i, seed=i)
        ts = load_testset(key, root)
        assert ts.layout == lay.name
        # canonical order = the JSON order; labels from the file; paths exist
        want = [(root / lay.dataset_dir / lay.image_dir / rel).resolve() for rel, _, _ in split["test"]]
        assert [p.resolve() for p in ts.paths] == want
        assert ts.labels.tolist() == [y for _, y, _ in split["test"]]
        assert all(p.is_file() for p in ts.paths)
        if spec.class_names:
            assert ts.class_names == FASHION_MNIST_CLASSES
        else:
            assert ts.class_names == ("a b", "c", "d e")  # '_' -> ' ' as TDA's clip_classifier


def test_env_data_root(tmp_path, monkeypatch):
    make_json_dataset(tmp_path, "dtd", per_class=1)
    monkeypatch.setenv("ZAEC_DATA_ROOT", str(tmp_path))
    assert len(load_testset("dtd")) == 3


def test_missing_dataset_shows_layout(tmp_path):
    with pytest.raises(DatasetError) as e:
        load_testset("oxford_pets", tmp_path)
    msg = str(e.value)
    assert "oxford_pets/split_zhou_OxfordPets.json" in msg and "oxford_pets/images" in msg
    assert "oxfordpets" in msg and "OxfordPets" in msg  # DPE and TPT names are listed too
    with pytest.raises(DatasetError, match="not a directory"):
        load_testset("dtd", tmp_path / "nope")


@pytest.mark.parametrize("bad", ["../outside.png", "/etc/passwd", "a/../../x.png", "..", "C:/x.png"])
def test_split_entries_escaping_root_are_rejected(tmp_path, bad):
    split = make_json_dataset(tmp_path, "dtd", per_class=1)
    split["test"].append([bad, 0, "class_0"])
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    with pytest.raises(DatasetError, match="escapes the dataset folder"):
        load_testset("dtd", tmp_path)


def test_harmless_dotdot_inside_folder_is_accepted(tmp_path):
    split = make_json_dataset(tmp_path, "dtd", per_class=1, shuffle=False)
    rel = split["test"][0][0]
    split["test"][0][0] = "class_0/../" + rel
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    ts = load_testset("dtd", tmp_path)
    assert ts.paths[0] == tmp_path / "dtd" / "images" / rel


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.update(test=[]), "empty"),
    (lambda s: s["test"].append(["x.png", 5, "class_5"]), "without gaps"),
    (lambda s: s["test"].append(["x.png", 0, "other"]), "named"),
    (lambda s: s["test"].append(["x.png", "0", "class_0"]), "expected"),
])
def test_bad_split_files(tmp_path, mutate, match):
    split = make_json_dataset(tmp_path, "dtd", per_class=1)
    mutate(split)
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    with pytest.raises(DatasetError, match=match):
        load_testset("dtd", tmp_path)


@pytest.mark.parametrize("layout", [0, 1, 2])
def test_aircraft_variant_files(tmp_path, layout):
    entries = make_aircraft(tmp_path, layout=layout)
    ts = load_testset("fgvc_aircraft", tmp_path)
    assert ts.class_names == ("707-320", "A300B4", "Cessna 172")  # a variant name with a space survives
    assert ts.labels.tolist() == [ts.class_names.index(v) for _, v in entries]
    assert [p.stem for p in ts.paths] == [i for i, _ in entries]
    assert all(p.is_file() for p in ts.paths)


def test_imagenet_full_wnid_order(tmp_path):
    syn = imagenet_synsets()
    picked = [syn[999], syn[0], syn[500]]
    make_imagenet_folders(tmp_path, "imagenet", picked, per_class=2)
    ts = load_testset("imagenet", tmp_path)
    assert ts.num_classes == 1000 and ts.class_names == imagenet_classnames()
    assert ts.labels.tolist() == [0, 0, 500, 500, 999, 999]
    assert ts.class_names[0] == "tench"


def test_imagenet_v2_numeric_folders_not_string_sorted(tmp_path):
    make_imagenet_folders(tmp_path, "imagenet_v2", ["0", "1", "10", "100", "2", "999"], per_class=1)
    ts = load_testset("imagenet_v2", tmp_path)
    assert ts.labels.tolist() == [0, 1, 2, 10, 100, 999]
    assert [p.parent.name for p in ts.paths] == ["0", "1", "2", "10", "100", "999"]
    assert ts.num_classes == 1000
    (tmp_path / "imagenetv2" / "imagenetv2-matched-frequency-format-val" / "n01440764").mkdir()
    with pytest.raises(DatasetError, match="0..999"):
        load_testset("imagenet_v2", tmp_path)


@pytest.mark.parametrize("key, which", [("imagenet_a", "a"), ("imagenet_r", "r")])
def test_imagenet_a_r_subsets(tmp_path, key, which):
    import importlib.resources
    info = importlib.resources.files("timm.data") / "_info"
    idx = [int(x) for x in (info / f"imagenet_{which}_indices.txt").read_text().split()]
    syn = imagenet_synsets()
    # three classes of the subset, written in an order different from the label order
    chosen = [idx[150], idx[3], idx[77]]
    make_imagenet_folders(tmp_path, key, [syn[i] for i in chosen], per_class=1, layout=1)
    ts = load_testset(key, tmp_path)
    assert ts.num_classes == 200 and ts.layout == "TPT"
    assert ts.imagenet_indices == tuple(sorted(idx))
    assert ts.labels.tolist() == [3, 77, 150]
    names = imagenet_classnames()
    assert [ts.class_names[y] for y in ts.labels] == [names[idx[3]], names[idx[77]], names[idx[150]]]
    # a class outside the subset is an error
    outside = next(i for i in range(1000) if i not in set(idx))
    make_imagenet_folders(tmp_path, key, [syn[outside]], per_class=1, layout=1)
    with pytest.raises(DatasetError, match="200 classes"):
        load_testset(key, tmp_path)


def test_sh_filter_quirk_off_by_default(tmp_path):
    syn = imagenet_synsets()
    make_imagenet_folders(tmp_path, "imagenet_sketch", [syn[1]], per_class=3,
                          names=["a.JPEG", "fish_1.JPEG", "b.JPEG"])
    assert len(load_testset("imagenet_sketch", tmp_path)) == 3
    ts = load_testset("imagenet_sketch", tmp_path, sh_filter=True)
    assert [p.name for p in ts.paths] == ["a.JPEG", "b.JPEG"]
    assert "1 image file(s) dropped" in ts.notes["tda_sh_filter"]
    # not applied to JSON-split sets, as in the official code
    make_json_dataset(tmp_path, "dtd", class_names=["fish", "cat"], per_class=2)
    assert len(load_testset("dtd", tmp_path, sh_filter=True)) == 4


def test_fingerprint_tracks_sample_list(tmp_path):
    make_json_dataset(tmp_path, "dtd", per_class=2)
    a = load_testset("dtd", tmp_path).fingerprint()
    assert a == load_testset("dtd", tmp_path).fingerprint()
    make_json_dataset(tmp_path, "dtd", per_class=2, seed=5)  # different order
    assert load_testset("dtd", tmp_path).fingerprint() != a


def test_labels_are_int64_and_in_range(tmp_path):
    make_json_dataset(tmp_path, "eurosat", n_classes=4, per_class=2)
    ts = load_testset("eurosat", tmp_path)
    assert ts.labels.dtype == np.int64 and ts.labels.min() >= 0 and ts.labels.max() < ts.num_classes


def test_registered_sets_refuse_an_image_listed_twice(tmp_path):
    # a CoOp JSON split: one entry twice
    split = make_json_dataset(tmp_path, "dtd", per_class=2, shuffle=False)
    split["test"].append(split["test"][1])
    split_file = tmp_path / "dtd" / "split_zhou_DescribableTextures.json"
    split_file.write_text(json.dumps(split))
    with pytest.raises(DatasetError) as e:
        load_testset("dtd", tmp_path)
    rel = f"images/{split['test'][1][0]}"
    assert str(e.value).startswith(f"{split_file}: 1 image file(s) of dataset 'dtd' are listed more than once "
                                   f"(1 extra sample(s)): {rel!r} 2 times (sample_id 1, 6)")
    # FGVC-Aircraft: one image id on two lines
    entries = make_aircraft(tmp_path)
    list_file = tmp_path / "fgvc_aircraft" / "images_variant_test.txt"
    list_file.write_text(list_file.read_text() + f"{entries[0][0]} {entries[0][1]}\n")
    with pytest.raises(DatasetError, match=r"images_variant_test.txt: 1 image file\(s\) of dataset 'fgvc_aircraft' "
                                           r"are listed more than once"):
        load_testset("fgvc_aircraft", tmp_path)
    # ImageNet class folders: a wnid folder that is a symlink to another one
    syn = imagenet_synsets()
    img_root = make_imagenet_folders(tmp_path, "imagenet", [syn[0], syn[5]], per_class=2)
    assert len(load_testset("imagenet", tmp_path)) == 4
    (img_root / syn[7]).symlink_to(syn[0], target_is_directory=True)
    with pytest.raises(DatasetError) as e:
        load_testset("imagenet", tmp_path)
    assert str(e.value).startswith(f"{img_root}: 2 image file(s) of dataset 'imagenet' are listed more than once")
    assert f"'images/val/{syn[0]}/img_0.JPEG' (sample_id 0) = 'images/val/{syn[7]}/img_0.JPEG' (sample_id 4)" \
        in str(e.value)
    # ImageNet-C: a symlinked image file next to its target
    img_root = make_imagenet_folders(tmp_path, "imagenet_c:fog:2", [syn[3]], per_class=2)
    os.symlink("img_1.JPEG", img_root / syn[3] / "img_2.JPEG")
    with pytest.raises(DatasetError, match="'n01491361/img_1.JPEG' \\(sample_id 1\\) = 'n01491361/img_2.JPEG'"):
        load_testset("imagenet_c:fog:2", tmp_path)


def test_duplicate_check_stats_folders_not_files(tmp_path, monkeypatch):
    # os.stat on folders, never on an image: ImageNet's 50,000 images lie in 1000 folders
    syn = imagenet_synsets()
    make_imagenet_folders(tmp_path, "imagenet", syn[:3], per_class=6)
    calls: list[str] = []
    real_stat = os.stat
    monkeypatch.setattr(ds.os, "stat", lambda p, *a, **k: calls.append(os.fspath(p)) or real_stat(p, *a, **k))
    assert len(load_testset("imagenet", tmp_path)) == 18
    assert calls and not any(c.endswith(".JPEG") for c in calls)  # folders only (some more than once)


@pytest.fixture
def _fresh_user_registry(monkeypatch):
    monkeypatch.setattr(ds, "_USER_SPECS", {})


@pytest.mark.usefixtures("_fresh_user_registry")
def test_check_outside_dataset(tmp_path):
    # folder: datasets: the folder itself and anything below it, also through a symlink or a relative path
    root = tmp_path / "pets"
    for c in ("cat", "dog"):
        write_image(root / c / "a.png", np.random.default_rng(0))
    ts = load_testset(resolve_dataset(f"folder:{root}"))
    (tmp_path / "alias").symlink_to(root, target_is_directory=True)
    for bad in (root, root / "out", root / "cat" / "cache" / "x", tmp_path / "alias" / "out",
                root / "dog" / ".." / "shards"):
        with pytest.raises(DatasetError) as e:
            check_outside_dataset(ts, bad, "--out")
        assert str(e.value) == (f"--out {bad} is inside the folder {root.resolve()} of dataset 'pets', whose listing "
                                "defines the test set (the run's files there would be read as data by the next run); "
                                "give --out a folder outside it")
    for ok in (tmp_path / "out", tmp_path / "pets-out", root / ".." / "cache", tmp_path):
        check_outside_dataset(ts, ok, "--cache-dir")
    cwd = os.getcwd()
    try:
        os.chdir(root)
        with pytest.raises(DatasetError, match="^--cache-dir data/cache is inside the folder"):
            check_outside_dataset(ts, Path("data/cache"), "--cache-dir")
        os.chdir(tmp_path)
        check_outside_dataset(ts, "data/cache", "--cache-dir")
    finally:
        os.chdir(cwd)
    # a registered class-folder set: its image root (the listing) is refused, the rest of its folder is not
    img_root = make_imagenet_folders(tmp_path / "data", "imagenet", [imagenet_synsets()[0]], per_class=1)
    ts = load_testset("imagenet", tmp_path / "data")
    with pytest.raises(DatasetError, match="^--out .* is inside the folder .*images/val of dataset 'imagenet'"):
        check_outside_dataset(ts, img_root / "shards", "--out")
    check_outside_dataset(ts, tmp_path / "data" / "imagenet" / "shards", "--out")
    # sets listed from a split or list file read only what is listed: a folder next to the images is allowed
    make_json_dataset(tmp_path / "data", "dtd", per_class=1)
    check_outside_dataset(load_testset("dtd", tmp_path / "data"), tmp_path / "data" / "dtd" / "images" / "o", "--out")
    split = tmp_path / "xr" / "split.json"
    for i in range(2):
        write_image(tmp_path / "xr" / f"{i}.png", np.random.default_rng(i))
    split.write_text(json.dumps({"test": [["0.png", 0, "a"], ["1.png", 1, "b"]]}))
    check_outside_dataset(load_testset(resolve_dataset(f"split:{split}")), tmp_path / "xr" / "out", "--out")


#: EXIF orientation (tag 0x0112) -> what a viewer shows, from the stored (H, W, 3) pixels, written from the
#: tag's definition (TIFF 6.0 / EXIF 2.32: where row 0 and column 0 of the stored image go)
_ORIENTED = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],                   # mirrored left-right
    3: lambda a: a[::-1, ::-1],                # rotated 180
    4: lambda a: a[::-1, :],                   # mirrored top-bottom
    5: lambda a: a.transpose(1, 0, 2),         # row 0 becomes column 0 (mirror along the main diagonal)
    6: lambda a: a.transpose(1, 0, 2)[:, ::-1],  # rotated 90 clockwise: row 0 becomes the last column
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],  # mirror along the other diagonal
    8: lambda a: a.transpose(1, 0, 2)[::-1, :],  # rotated 90 counter-clockwise: row 0 becomes column 0, upwards
}


@pytest.mark.parametrize("orientation", sorted(_ORIENTED))
def test_open_image_exif_transpose(tmp_path, orientation):
    from PIL import Image

    rng = np.random.default_rng(orientation)
    path = tmp_path / "photo.jpg"
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)).save(path, exif=exif, quality=95)
    with Image.open(path) as im:
        assert im.getexif()[0x0112] == orientation  # the tag really is in the file
        stored = np.asarray(im.convert("RGB"))
    # default: the stored pixels, as the official code and torchvision's ImageFolder read them
    assert np.array_equal(np.asarray(open_image(path)), stored)
    turned = open_image(path, exif_transpose=True)
    assert turned.mode == "RGB"
    assert np.array_equal(np.asarray(turned), _ORIENTED[orientation](stored))
    # no tag: the same pixels either way
    Image.fromarray(stored).save(tmp_path / "plain.png")
    assert np.array_equal(np.asarray(open_image(tmp_path / "plain.png", exif_transpose=True)), stored)


def test_open_image_drops_alpha_and_reads_the_first_frame(tmp_path):
    # the documented behaviour (docs/extract.md, "Your own data"): alpha dropped, stored colours kept, frame 0
    from PIL import Image

    rng = np.random.default_rng(0)
    rgba = rng.integers(0, 256, (9, 7, 4), dtype=np.uint8)
    rgba[..., 3] = 0  # fully transparent: the stored colours are still what is read
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    assert np.array_equal(np.asarray(open_image(tmp_path / "a.png")), rgba[..., :3])
    frames = [Image.new("P", (6, 5), color=c) for c in (1, 2)]
    for f in frames:
        f.putpalette([0, 0, 0, 255, 0, 0, 0, 0, 255] + [0] * 759)
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    with Image.open(tmp_path / "anim.gif") as im:
        assert im.n_frames == 2
    assert np.asarray(open_image(tmp_path / "anim.gif")).reshape(-1, 3).tolist() == [[255, 0, 0]] * 30


# --- images of every mode ----------------------------------------------------------------------------------------

def _grey16(h=6, w=7):
    return (np.arange(h * w, dtype=np.int64).reshape(h, w) * 65535 // (h * w - 1)).astype(np.uint16)


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_16bit_grey_images_scale_to_8bit(tmp_path, mode):
    from PIL import Image

    from extract.datasets import open_image

    a = _grey16()
    im = Image.fromarray(a) if mode == "I;16" else Image.fromarray(a.astype(np.int32), "I")
    if mode == "I;16B":
        im = Image.frombytes("I;16B", im.size, a.astype(">u2").tobytes())
    path = tmp_path / ("g.png" if mode == "I;16" else "g.tif")  # mode I: how some 16-bit files open
    im.save(path) if mode != "I;16B" else _save_raw_tiff(im, path)
    got = np.asarray(open_image(path))
    want = np.round(a / 257.0).astype(np.uint8)  # 65535 -> 255; a / 257 is never exactly half-way
    assert got.shape == a.shape + (3,) and got.dtype == np.uint8
    np.testing.assert_array_equal(got[..., 0], want)
    np.testing.assert_array_equal(got[..., 1], want)
    assert got.max() == 255 and got.min() == 0 and 100 < got.mean() < 155  # a ramp, not a white image


def _save_raw_tiff(im, path):
    try:
        im.save(path)
    except (OSError, ValueError, KeyError):
        pytest.skip("this Pillow cannot write big-endian 16-bit TIFF")


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "RGBA", "CMYK", "YCbCr"])
def test_8bit_modes_convert_like_pil(tmp_path, mode):
    from PIL import Image

    from extract.datasets import open_image

    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (5, 6, 3), dtype=np.uint8), "RGB")
    im = rgb.convert(mode)
    path = tmp_path / ("x.tif" if mode in ("CMYK", "YCbCr") else "x.png")
    try:
        im.save(path)
    except (OSError, KeyError):
        pytest.skip(f"Pillow cannot save mode {mode} to {path.suffix}")
    with Image.open(path) as ref:
        want = np.asarray(ref.convert("RGB"))
    np.testing.assert_array_equal(np.asarray(open_image(path)), want)


def test_unsupported_modes_rejected_by_name(tmp_path):
    from PIL import Image

    from extract.datasets import DatasetError, open_image

    Image.fromarray(np.zeros((4, 4), np.float32), "F").save(tmp_path / "f.tif")
    with pytest.raises(DatasetError, match=r"f.tif: floating-point image \(mode F\) is not supported"):
        open_image(tmp_path / "f.tif")
    Image.fromarray(np.full((4, 4), 70000, np.int32), "I").save(tmp_path / "i.tif")
    with pytest.raises(DatasetError, match=r"i.tif: 32-bit integer image \(mode I\) with values outside 0..65535"):
        open_image(tmp_path / "i.tif")


@pytest.mark.parametrize("key", OOD_DATASETS)
def test_ood_sets_every_layout_and_the_missing_message(key, tmp_path):
    spec = get_dataset(key)
    with pytest.raises(DatasetError) as e:
        load_ood_images(key, tmp_path)
    for lay in spec.layouts:  # every layout shown, with the folder whose images count
        img = "/".join(p for p in (lay.dataset_dir, lay.image_dir) if p)
        assert f"[{lay.name}] {tmp_path}/{img}/<any sub-folders>/<image>" in str(e.value)
    with pytest.raises(DatasetError, match=f"dataset '{key}' is an out-of-distribution set"):
        load_testset(key, tmp_path)
    rng = np.random.default_rng(0)
    for i, lay in enumerate(spec.layouts):
        root = tmp_path / f"root{i}"
        base = root / lay.dataset_dir / lay.image_dir
        rels = ["b/z.jpg", "a/y/x.png", "top.png", "a/.hidden.png", "a/notes.txt"]
        for rel in rels:
            if rel.endswith(".txt"):
                (base / rel).parent.mkdir(parents=True, exist_ok=True)
                (base / rel).write_text("x")
            else:
                write_image(base / rel, rng, size=(8, 8))
        ts = load_ood_images(key, root)
        assert ts.layout == lay.name and ts.dataset_dir == base
        assert [p.relative_to(base).as_posix() for p in ts.paths] == ["a/y/x.png", "b/z.jpg", "top.png"]
        assert ts.labels.tolist() == [-1, -1, -1] and ts.class_names == ()
