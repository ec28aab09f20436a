"""Test sets: one registry, one generic loader.

Every dataset has one canonical key (`imagenet_a`, `dtd`, `imagenet_c:fog:3`, ...). A registry entry says where the
data may lie under the data root (the CoOp/TDA layout, the TPT layout, DPE's renamed folders), how its test list is
read (a CoOp `split_zhou_*.json`, FGVC-Aircraft's variant text files, or ImageNet-style class folders) and which
per-method hyper-parameters it uses (`hparams_from`).

A user's own data joins through `resolve_dataset`: `folder:PATH` (one sub-folder per class) or `split:FILE.json` (a
CoOp split) becomes a spec registered for this process under a canonical name (the folder's name, or one the user
gives), with `hparams_from=None`: every method then uses its documented settings for unseen data
(`TTAMethod.unseen_config`). `load_testset` turns an entry into a `TestSet`: absolute image paths in the
canonical test order (this order defines `sample_id`), labels, and class names. Only the split/list files and the
folder listing are read here (and one `stat` and listing per image folder, to refuse an image listed twice);
images are opened later, one by one, by `open_image`.

Canonical order:
    * JSON splits: the order of the `test` list in the file.
    * FGVC-Aircraft: the order of `images_variant_test.txt`.
    * class folders: classes by label, then file names sorted as strings within a class.
    * `folder:PATH`: relative paths (POSIX, from PATH) sorted as strings; labels = sorted class-folder names.

Example:
    >>> spec = get_dataset("dtd")
    >>> spec.hparams_from, spec.group
    ('dtd', 'fine_grained')
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import json
import os
import posixpath
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

import numpy as np

from extract.defaults import DATA_ROOT_ENV, DEFAULT_MAX_IMAGE_PIXELS, default_data_root

#: Class names of the embedded demo (Fashion-MNIST), in label order. Helper modules of the demo import this.
FASHION_MNIST_CLASSES: tuple[str, ...] = (
    "t-shirt or top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot",
)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")

Kind = Literal["json", "aircraft", "folders", "image_folder", "split_file", "ood_images"]
Group = Literal["natural", "fine_grained", "demo", "corruption", "user", "ood"]
#: how class folders map to labels: ImageNet wnids (all 1000), the 200-class A/R subsets, V2's numbered folders
FolderScheme = Literal["wnid1000", "wnid_a", "wnid_r", "v2_numeric"]


class DatasetError(ValueError):
    """A user-side problem with a dataset (unknown key, missing folder, bad split file). One clear line or block."""


@dataclass(frozen=True)
class Layout:
    """One place a dataset may lie, relative to the data root.

    Attributes:
        name: the layout's name in messages ("CoOp/TDA", "TPT", "DPE").
        dataset_dir: folder under the data root.
        image_dir: folder (relative to `dataset_dir`) the split's relative paths start from; "" = the folder itself.
        split_file: the split/list file relative to `dataset_dir` (JSON split, Aircraft's test list); "" for folders.
    """

    name: str
    dataset_dir: str
    image_dir: str
    split_file: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """A registry entry. `hparams_from` is the canonical key whose per-method hyper-parameters apply; None for a
    user's dataset (each method's settings for unseen data apply)."""

    key: str
    kind: Kind
    group: Group
    hparams_from: str | None
    layouts: tuple[Layout, ...]
    #: file name of the CuPL prompts (DPE's `gpt3_prompts/` naming), None where no such file exists
    cupl_file: str | None = None
    #: for kind "folders"
    folder_scheme: FolderScheme | None = None
    #: fixed class names (demo sets); None = from the split file / ImageNet names
    class_names: tuple[str, ...] | None = None
    #: the canonical key whose TDA per-dataset templates the "dataset" prompt policy uses; None = `hparams_from`
    templates_from: str | None = None
    #: TDA/DPE/DLAE list these folders with a helper that also drops names containing "sh"
    #: (docs/methods.md, "TDA's file-listing quirk (sh_filter)")
    sh_quirk_applies: bool = False
    description: str = ""
    #: user datasets: the reference as given, made absolute (`folder:/abs/path`, `split:/abs/file.json`)
    ref: str | None = None
    #: user datasets: the --class-names file the names came from (None: folder names / the split's names)
    class_names_file: str | None = None


@dataclass(frozen=True)
class TestSet:
    """A resolved test set.

    Attributes:
        key: canonical dataset key.
        dataset_dir: the folder that matched.
        layout: name of the layout that matched.
        paths: absolute image paths, canonical test order (index = sample_id).
        labels: (N,) int64 class indices in [0, K).
        class_names: K names.
        imagenet_indices: for ImageNet-family sets, the ImageNet class index of each of the K classes.
        notes: facts to record in the shard metadata (e.g. how many files the "sh" filter dropped).
        exif_transpose: images are turned as their EXIF orientation says when read (`open_image`); a run option.
        max_image_pixels: images of more pixels are refused when read (`open_image`; 0: no limit); how a run
            executes (`--max-image-pixels`), never part of its identity.
    """

    key: str
    dataset_dir: Path
    layout: str
    paths: tuple[Path, ...]
    labels: np.ndarray
    class_names: tuple[str, ...]
    imagenet_indices: tuple[int, ...] | None = None
    notes: Mapping[str, str] = field(default_factory=dict)
    exif_transpose: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def fingerprint(self) -> str:
        """sha256 (hex, 16 chars) of the sample list (paths relative to `dataset_dir`, labels) and class names.

        Keys the feature cache: a different split file or folder content gives a different cache entry.
        """
        h = hashlib.sha256()
        for p, y in zip(self.paths, self.labels.tolist()):
            h.update(f"{p.relative_to(self.dataset_dir).as_posix()}\t{y}\n".encode())
        h.update(json.dumps(list(self.class_names)).encode())
        return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# the registry

def _json_set(key: str, json_name: str, cupl: str, *, coop: tuple[str, str], tpt: tuple[str, str],
              dpe: tuple[str, str] | None = None, description: str = "") -> DatasetSpec:
    layouts = [Layout("CoOp/TDA", coop[0], coop[1], json_name)]
    if dpe is not None:
        layouts.append(Layout("DPE", dpe[0], dpe[1], json_name))
    layouts.append(Layout("TPT", tpt[0], tpt[1], json_name))
    return DatasetSpec(key, "json", "fine_grained", key, tuple(layouts), cupl_file=cupl, description=description)


def _folder_set(key: str, scheme: FolderScheme, layouts: tuple[Layout, ...], *, sh: bool,
                description: str) -> DatasetSpec:
    return DatasetSpec(key, "folders", "natural", key, layouts, cupl_file="CuPL_prompts_imagenet.json",
                       folder_scheme=scheme, sh_quirk_applies=sh, description=description)


_REGISTRY_LIST: list[DatasetSpec] = [
    # ImageNet family: class folders (TDA reads ImageNet through torchvision's ImageNet(split='val'), whose
    # prepared layout is images/val/<wnid>/; TPT uses ImageFolder(ImageNet/val)).
    _folder_set("imagenet", "wnid1000", (
        Layout("CoOp/TDA", "imagenet", "images/val"), Layout("TPT", "ImageNet", "val"),
        Layout("plain", "imagenet", "val")), sh=False, description="ImageNet validation set (50,000 images)"),
    _folder_set("imagenet_a", "wnid_a", (
        Layout("CoOp/TDA", "imagenet-adversarial", "imagenet-a"), Layout("TPT", "imagenet-a", "")),
        sh=True, description="ImageNet-A (200 classes)"),
    _folder_set("imagenet_v2", "v2_numeric", (
        Layout("CoOp/TDA", "imagenetv2", "imagenetv2-matched-frequency-format-val"),
        Layout("TPT", "imagenetv2-matched-frequency-format-val", "")),
        sh=True, description="ImageNet-V2 matched-frequency (folders 0..999)"),
    _folder_set("imagenet_r", "wnid_r", (
        Layout("CoOp/TDA", "imagenet-rendition", "imagenet-r"), Layout("TPT", "imagenet-r", "")),
        sh=True, description="ImageNet-R (200 classes)"),
    _folder_set("imagenet_sketch", "wnid1000", (
        Layout("CoOp/TDA", "imagenet-sketch", "images"), Layout("TPT", "ImageNet-Sketch", ""),
        Layout("TPT (unpacked)", "ImageNet-Sketch", "sketch")),
        sh=True, description="ImageNet-Sketch"),
    _json_set("caltech101", "split_zhou_Caltech101.json", "CuPL_prompts_caltech101.json",
              coop=("caltech-101", "101_ObjectCategories"), tpt=("Caltech101", "")),
    _json_set("dtd", "split_zhou_DescribableTextures.json", "CuPL_prompts_dtd.json",
              coop=("dtd", "images"), tpt=("DTD", "images")),
    _json_set("eurosat", "split_zhou_EuroSAT.json", "CuPL_prompts_eurosat.json",
              coop=("eurosat", "2750"), tpt=("eurosat", "")),
    DatasetSpec("fgvc_aircraft", "aircraft", "fine_grained", "fgvc_aircraft", (
        Layout("CoOp/TDA", "fgvc_aircraft", "images", "images_variant_test.txt"),
        Layout("official archive", "fgvc-aircraft-2013b", "data/images", "data/images_variant_test.txt"),
        Layout("official archive (data/)", "fgvc_aircraft", "data/images", "data/images_variant_test.txt")),
        cupl_file="CuPL_prompts_fgvcaircraft.json"),
    _json_set("food101", "split_zhou_Food101.json", "CuPL_prompts_food101.json",
              coop=("food-101", "images"), tpt=("Food101", "images")),
    _json_set("flowers102", "split_zhou_OxfordFlowers.json", "CuPL_prompts_flowers102.json",
              coop=("oxford_flowers", "jpg"), dpe=("flowers102", "jpg"), tpt=("Flower102", "jpg")),
    _json_set("oxford_pets", "split_zhou_OxfordPets.json", "CuPL_prompts_oxfordpets.json",
              coop=("oxford_pets", "images"), dpe=("oxfordpets", "images"), tpt=("OxfordPets", "")),
    _json_set("stanford_cars", "split_zhou_StanfordCars.json", "CuPL_prompts_stanfordcars.json",
              coop=("stanford_cars", ""), dpe=("stanfordcars", ""), tpt=("StanfordCars", "")),
    _json_set("sun397", "split_zhou_SUN397.json", "CuPL_prompts_sun397.json",
              coop=("sun397", "SUN397"), tpt=("SUN397", "")),
    _json_set("ucf101", "split_zhou_UCF101.json", "CuPL_prompts_ucf101.json",
              coop=("ucf101", "UCF-101-midframes"), tpt=("UCF101", "")),
]

# The embedded demo's Fashion-MNIST sets (written to disk by tools.demo): JSON splits under fashion-mnist/<set>/.
# Hyper-parameters: EuroSAT's, the paper's other 10-class set of small images. Its rows make TDA, DPE and DLAE
# single-view; the ImageNet-family rows average the most confident of 63 random crops, and on 32-pixel images
# crops down to 8% of the area are unrecognisable: with ImageNet-A's rows TDA fell from 41% to 10% accuracy on the
# blurred set (fmnist-RN), with one view it rose to 48%. Prompts: the generic 7 Tip-Adapter templates (ImageNet's),
# not EuroSAT's "a centered satellite photo of {}.".
_DEMO_SETS = ("clean", "noise", "blur", "contrast", "invert", "rotate")
for _name in _DEMO_SETS:
    _key = "fmnist" if _name == "clean" else f"fmnist_{_name}"
    _REGISTRY_LIST.append(DatasetSpec(
        _key, "json", "demo", "eurosat",
        (Layout("demo", f"fashion-mnist/{_name}", "images", "split_zhou_FashionMNIST.json"),),
        class_names=FASHION_MNIST_CLASSES,
        templates_from="imagenet",
        description=f"Fashion-MNIST test set ({_name}), embedded demo"))

# ImageNet-C (Hendrycks & Dietterich, ICLR 2019): 15 corruptions x 5 severities of the ImageNet validation set, in
# the release's `<corruption>/<severity>/<wnid>/` folders, all 1000 classes. Keys `imagenet_c:<corruption>:<severity>`.
# Method settings and prompts: ImageNet's (the images are ImageNet val images; TDA/DPE never ran ImageNet-C, so
# ImageNet's row is the nearest official one). CuPL: ImageNet's file, as DPE uses it for every ImageNet variant.
IMAGENET_C = "imagenet_c"
#: the 15 corruptions in the release's order (noise, blur, weather, digital)
IMAGENET_C_CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
IMAGENET_C_SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)
for _corr in IMAGENET_C_CORRUPTIONS:
    for _sev in IMAGENET_C_SEVERITIES:
        _REGISTRY_LIST.append(DatasetSpec(
            f"{IMAGENET_C}:{_corr}:{_sev}", "folders", "corruption", "imagenet",
            (Layout("ImageNet-C", f"imagenet-c/{_corr}/{_sev}", ""),
             Layout("ImageNet-C (capitalised)", f"ImageNet-C/{_corr}/{_sev}", "")),
            cupl_file="CuPL_prompts_imagenet.json", folder_scheme="wnid1000",
            description=f"ImageNet-C, {_corr.replace('_', ' ')}, severity {_sev}"))

# Out-of-distribution sets (kind "ood_images", group "ood"): images without classes, run only against an
# in-distribution set (`zaec-extract --ood-for KEY`, docs/extract.md "Out-of-distribution runs"). Every image below
# the set's folder counts, at any depth, in the order of relative paths sorted as strings (sub-folder names are no
# classes). Layouts: MCM's (deeplearning-wisc/MCM, README.md and utils/detection_util.py
# `set_ood_loader_ImageNet`: `ImageNet_OOD_dataset/{iNaturalist,SUN,Places}` and, for Textures, the whole of DTD
# under `dtd/images`, each read as an ImageFolder), the same folders directly under the data root, and NINCO's
# release (`NINCO/NINCO_OOD_classes/<class>/`, its main OOD split). No settings of their own (`hparams_from=None`):
# an OOD run takes every setting from its in-distribution set.
_MCM = "ImageNet_OOD_dataset"
for _key, _folder, _what in (("inaturalist", "iNaturalist", "iNaturalist plants, 10,000 images (MCM's OOD set)"),
                             ("sun", "SUN", "SUN scenes, 10,000 images (MCM's OOD set; not the sun397 split)"),
                             ("places", "Places", "Places365 scenes, 10,000 images (MCM's OOD set)")):
    _REGISTRY_LIST.append(DatasetSpec(
        _key, "ood_images", "ood", None,
        (Layout("MCM", f"{_MCM}/{_folder}", ""), Layout("plain", _folder, "")),
        description=f"{_what}, out-of-distribution for ImageNet"))
_REGISTRY_LIST.append(DatasetSpec(
    "textures", "ood_images", "ood", None,
    (Layout("MCM", f"{_MCM}/dtd", "images"), Layout("CoOp/TDA", "dtd", "images"), Layout("TPT", "DTD", "images")),
    description="Textures: all 5,640 DTD images (MCM's OOD set), out-of-distribution for ImageNet"))
_REGISTRY_LIST.append(DatasetSpec(
    "ninco", "ood_images", "ood", None,
    (Layout("NINCO", "NINCO", "NINCO_OOD_classes"), Layout("plain", "NINCO_OOD_classes", "")),
    description="NINCO's OOD classes (64 classes, none in ImageNet-1k), out-of-distribution for ImageNet"))
# The embedded demo's OOD set: synthetic geometric shapes, written by tools/demo/ood.py (docs/demo.md).
_REGISTRY_LIST.append(DatasetSpec(
    "demo_shapes", "ood_images", "ood", None, (Layout("demo", "demo-ood/shapes", "images"),),
    description="synthetic geometric shapes (32 px), out-of-distribution for the demo's fmnist; written by the demo"))

REGISTRY: dict[str, DatasetSpec] = {s.key: s for s in _REGISTRY_LIST}
#: the 15 datasets of the paper (excludes the demo sets and ImageNet-C)
PAPER_DATASETS: tuple[str, ...] = tuple(s.key for s in _REGISTRY_LIST if s.group in ("natural", "fine_grained"))
#: the registered out-of-distribution sets (`--ood-for`)
OOD_DATASETS: tuple[str, ...] = tuple(s.key for s in _REGISTRY_LIST if s.group == "ood")
#: the 75 ImageNet-C keys, corruption-major
IMAGENET_C_DATASETS: tuple[str, ...] = tuple(s.key for s in _REGISTRY_LIST if s.group == "corruption")

FOLDER_PREFIX = "folder:"
SPLIT_PREFIX = "split:"
#: user datasets registered in this process by `resolve_dataset`, by canonical name
_USER_SPECS: dict[str, DatasetSpec] = {}


def _available() -> str:
    keys = [k for k, s in REGISTRY.items() if s.group != "corruption"] + list(_USER_SPECS)
    return (f"{', '.join(keys)}, {IMAGENET_C}:<corruption>:<severity> (corruptions: "
            f"{', '.join(IMAGENET_C_CORRUPTIONS)}; severities 1-5), {FOLDER_PREFIX}PATH, {SPLIT_PREFIX}FILE.json")


def get_dataset(key: str) -> DatasetSpec:
    """The registry entry of `key` (a registered key, a user dataset's canonical name, or a `folder:`/`split:`
    reference, which is registered under its default name); raises DatasetError listing the valid keys."""
    spec = REGISTRY.get(key) or _USER_SPECS.get(key)
    if spec is not None:
        return spec
    if key.startswith((FOLDER_PREFIX, SPLIT_PREFIX)):
        return _USER_SPECS[resolve_dataset(key)]
    raise DatasetError(f"unknown dataset {key!r}; available: {_available()}")


def expand_dataset_keys(name: str) -> tuple[str, ...]:
    """Dataset keys a sweep entry stands for: `imagenet_c` -> the 75 ImageNet-C keys, `imagenet_c:<corruption>` ->
    its 5 severities, anything else -> itself (checked later).

    >>> len(expand_dataset_keys("imagenet_c")), expand_dataset_keys("imagenet_c:fog")[-1]
    (75, 'imagenet_c:fog:5')
    """
    if name == IMAGENET_C:
        return IMAGENET_C_DATASETS
    head, _, corr = name.partition(":")
    if head == IMAGENET_C and corr in IMAGENET_C_CORRUPTIONS:
        return tuple(f"{name}:{s}" for s in IMAGENET_C_SEVERITIES)
    return (name,)


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def read_class_names(path: str | os.PathLike) -> tuple[str, ...]:
    """Class names from a file: a JSON list of strings, or one name per line (blank lines skipped), label order.

    Raises:
        DatasetError: unreadable file, a JSON document that is not a list of non-empty strings, no names.
    """
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"--class-names {path}: not a readable text file ({e})") from None
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"--class-names {path}: not a valid JSON list ({e})") from None
        if not all(isinstance(n, str) and n.strip() for n in names):
            raise DatasetError(f"--class-names {path}: expected a JSON list of non-empty strings")
        names = [n.strip() for n in names]
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise DatasetError(f"--class-names {path}: no class names in the file")
    return tuple(names)


def resolve_dataset(ref: str, *, name: str | None = None, class_names: str | os.PathLike | None = None) -> str:
    """The canonical key of a `--dataset` value, registering a user's dataset for this process.

    Args:
        ref: a registered key, `folder:PATH` (one sub-folder per class) or `split:FILE.json` (a CoOp split whose
            relative paths start at the file's folder).
        name: the canonical name of a user dataset (shard metadata, shard folder, tables); default: the name of
            the folder (of PATH, or the one holding FILE.json).
        class_names: a file of class names in label order (`read_class_names`); default: the folder names with
            `_` read as a space, or the split's names.

    Returns:
        The key every later step uses (`load_testset`, `build_prompt_set`, the shard's `dataset`).

    Raises:
        DatasetError: unknown key, a missing folder or file, a name that is not a plain key or clashes with a
            registered one, `name`/`class_names` given with a registered key, an unreadable class-names file.

    Example:
        >>> resolve_dataset("dtd")
        'dtd'
    """
    if not ref.startswith((FOLDER_PREFIX, SPLIT_PREFIX)):
        if name is not None or class_names is not None:
            raise DatasetError(f"--dataset-name and --class-names apply to {FOLDER_PREFIX}PATH and "
                               f"{SPLIT_PREFIX}FILE.json datasets only, not to the registered key {ref!r}")
        return get_dataset(ref).key
    is_folder = ref.startswith(FOLDER_PREFIX)
    raw = ref[len(FOLDER_PREFIX if is_folder else SPLIT_PREFIX):]
    if not raw:
        raise DatasetError(f"--dataset {ref!r}: expected {FOLDER_PREFIX}PATH or {SPLIT_PREFIX}FILE.json")
    path = Path(raw).expanduser().resolve()
    if is_folder and not path.is_dir():
        raise DatasetError(f"--dataset {ref}: {path} is not a folder (expected one sub-folder per class)")
    if not is_folder and not path.is_file():
        raise DatasetError(f"--dataset {ref}: {path} is not a file (expected a CoOp split JSON with a 'test' list)")
    if name is None:
        name, origin = (path if is_folder else path.parent).name, "the folder name"
    else:
        origin = "--dataset-name"
    if not _NAME_RE.fullmatch(name):
        raise DatasetError(f"dataset name {name!r} (from {origin}) must be letters, digits, '.', '_', '+', '-' "
                           "and start with a letter or digit; pass --dataset-name NAME")
    if name in REGISTRY or name == IMAGENET_C or name == "all":
        raise DatasetError(f"dataset name {name!r} (from {origin}) is a registered dataset key; pass "
                           "--dataset-name NAME with another name")
    names = None
    cn_file = None
    if class_names is not None:
        names = read_class_names(class_names)
        cn_file = str(Path(class_names).expanduser().resolve())
        _check_unique(names, f"--class-names {cn_file}", "edit the file so that no name repeats")
    kind: Kind = "image_folder" if is_folder else "split_file"
    layout = Layout("image folder" if is_folder else "split file", "", "", "" if is_folder else path.name)
    spec = DatasetSpec(name, kind, "user", None, (layout,), class_names=names,
                       description=f"user dataset {ref}", ref=("folder:" if is_folder else "split:") + str(path),
                       class_names_file=cn_file)
    _USER_SPECS[name] = spec
    return name


def dataset_source(key: str) -> tuple[str, str | None] | None:
    """(reference, class-names file) of a user dataset registered in this process, None for a registered key: what
    another process (a sweep worker) passes to `resolve_dataset` to register the same dataset."""
    spec = _USER_SPECS.get(key)
    return None if spec is None or spec.ref is None else (spec.ref, spec.class_names_file)


def resolve_data_root(data_root: str | os.PathLike | None) -> Path:
    """`data_root`, else $ZAEC_DATA_ROOT, else ./data. Raises DatasetError if the folder does not exist."""
    raw = data_root if data_root is not None else default_data_root()
    root = Path(raw).expanduser()
    if not root.is_dir():
        src = "--data-root" if data_root is not None else (
            f"${DATA_ROOT_ENV}" if os.environ.get(DATA_ROOT_ENV) else "the default ./data")
        raise DatasetError(f"data root {root} (from {src}) is not a directory; pass --data-root DIR or set "
                           f"{DATA_ROOT_ENV}")
    return root


# ---------------------------------------------------------------------------------------------------------------
# ImageNet metadata (timm ships the synset lists and the A/R subsets; open_clip ships CLIP's class names)

def _timm_info(name: str) -> list[str]:
    text = (importlib.resources.files("timm.data") / "_info" / name).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


@lru_cache(maxsize=None)
def imagenet_synsets() -> tuple[str, ...]:
    """The 1000 ImageNet-1k wnids in class-index order (timm's `imagenet_synsets.txt`)."""
    return tuple(_timm_info("imagenet_synsets.txt"))


@lru_cache(maxsize=None)
def imagenet_classnames() -> tuple[str, ...]:
    """CLIP's 1000 cleaned ImageNet class names (open_clip's IMAGENET_CLASSNAMES), class-index order."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
    return tuple(IMAGENET_CLASSNAMES)


@lru_cache(maxsize=None)
def imagenet_subset(which: Literal["a", "r"]) -> tuple[int, ...]:
    """ImageNet class indices of the 200-class ImageNet-A or -R subset, ascending (timm's info files)."""
    idx = [int(x) for x in _timm_info(f"imagenet_{which}_indices.txt")]
    syn = _timm_info(f"imagenet_{which}_synsets.txt")
    all_syn = imagenet_synsets()
    if len(idx) != 200 or any(all_syn[i] != s for i, s in zip(idx, syn)):
        raise RuntimeError(f"timm's imagenet_{which} info files are inconsistent with imagenet_synsets.txt")
    return tuple(sorted(idx))


# ---------------------------------------------------------------------------------------------------------------
# the generic loader

def expected_layout(spec: DatasetSpec, root: Path) -> str:
    """A human-readable description of where `spec` may lie under `root` (used in error messages)."""
    lines = [f"expected one of these layouts under {root}:"]
    for lay in spec.layouts:
        base = f"{root}/{lay.dataset_dir}"
        img = f"{base}/{lay.image_dir}" if lay.image_dir else base
        if spec.kind == "json":
            lines.append(f"  [{lay.name}] {base}/{lay.split_file}  (CoOp split: "
                         f'{{"test": [[relpath, label, classname], ...]}})')
            lines.append(f"  {' ' * (len(lay.name) + 2)} {img}/<relpath from the split>")
        elif spec.kind == "aircraft":
            lines.append(f"  [{lay.name}] {base}/{posixpath.dirname(lay.split_file) or '.'}/variants.txt, "
                         f"{base}/{lay.split_file}  (lines '<image id> <variant>')")
            lines.append(f"  {' ' * (len(lay.name) + 2)} {img}/<image id>.jpg")
        elif spec.kind == "ood_images":
            lines.append(f"  [{lay.name}] {img}/<any sub-folders>/<image>  (every image below it; no classes)")
        else:
            sub = {"v2_numeric": "<0..999>", "wnid_a": "<wnid, 200 classes>",
                   "wnid_r": "<wnid, 200 classes>"}.get(spec.folder_scheme or "", "<wnid>")
            lines.append(f"  [{lay.name}] {img}/{sub}/<image>")
    return "\n".join(lines)


def _first_test_path(split_path: Path) -> str | None:
    try:
        test = json.loads(split_path.read_text(encoding="utf-8-sig")).get("test") or []
        return str(test[0][0])
    except (OSError, ValueError, AttributeError, IndexError, KeyError, TypeError):
        return None


def _find_layout(spec: DatasetSpec, root: Path) -> Layout:
    found: list[Layout] = []
    for lay in spec.layouts:
        ddir = root / lay.dataset_dir
        if spec.kind in ("folders", "ood_images"):
            if (ddir / lay.image_dir).is_dir() if lay.image_dir else ddir.is_dir():
                return lay
        elif (ddir / lay.split_file).is_file():
            found.append(lay)
    if len(found) > 1 and spec.kind == "json":
        # layouts sharing a split file (EuroSAT: eurosat/2750 vs eurosat/): the one whose first image exists wins
        for lay in found:
            first = _first_test_path(root / lay.dataset_dir / lay.split_file)
            img_root = root / lay.dataset_dir / lay.image_dir if lay.image_dir else root / lay.dataset_dir
            if first is not None and (img_root / first).is_file():
                return lay
    if found:
        return found[0]
    raise DatasetError(f"dataset {spec.key!r} not found under data root {root}; "
                       + expected_layout(spec, root)
                       + f"\nset --data-root DIR (or ${DATA_ROOT_ENV}) to the folder holding it")


def safe_relpath(rel: str, *, where: str) -> str:
    """Validate a relative path taken from a user's split file: no absolute paths, no escaping with '..'.

    Returns the normalised POSIX form. Raises DatasetError naming `where` (file and entry).
    """
    if not isinstance(rel, str) or not rel:
        raise DatasetError(f"{where}: image path must be a non-empty string, got {rel!r}")
    norm = posixpath.normpath(rel.replace("\\", "/"))
    if norm.startswith("/") or (len(norm) > 1 and norm[1] == ":") or norm == ".." or norm.startswith("../"):
        raise DatasetError(f"{where}: image path {rel!r} escapes the dataset folder; split entries must be "
                           "relative paths inside it")
    return norm


def _clean_name(name: str) -> str:
    # TDA/DPE/DLAE's clip_classifier replaces '_' by ' ' before formatting the prompts
    return name.replace("_", " ").strip()


def _load_json_split(spec: DatasetSpec, root: Path, lay: Layout) -> tuple[list[Path], list[int], tuple[str, ...]]:
    ddir = root / lay.dataset_dir
    img_root = ddir / lay.image_dir if lay.image_dir else ddir
    split_path = ddir / lay.split_file
    try:
        data = json.loads(split_path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{split_path}: not a readable JSON split file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("test"), list):
        raise DatasetError(f"{split_path}: expected a JSON object with a 'test' list of [relpath, label, classname]")
    names: dict[int, str] = {}
    paths: list[Path] = []
    labels: list[int] = []
    for split in ("train", "val", "test"):
        entries = data.get(split) or []
        if not isinstance(entries, list):
            raise DatasetError(f"{split_path}: '{split}' must be a list")
        for i, entry in enumerate(entries):
            where = f"{split_path} [{split}][{i}]"
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[1], int)
                    and not isinstance(entry[1], bool) and isinstance(entry[2], str)):
                raise DatasetError(f"{where}: expected [relpath, label, classname], got {entry!r}")
            rel, y, cname = entry
            if y < 0:
                raise DatasetError(f"{where}: negative label {y}")
            cname = _clean_name(cname)
            if names.setdefault(y, cname) != cname:
                raise DatasetError(f"{where}: label {y} is named {cname!r} here but {names[y]!r} elsewhere")
            if split == "test":
                paths.append(img_root / safe_relpath(rel, where=where))
                labels.append(y)
    if not paths:
        raise DatasetError(f"{split_path}: the 'test' split is empty")
    if spec.class_names is not None:
        class_names = spec.class_names
        if max(names) >= len(class_names):
            raise DatasetError(f"{split_path}: label {max(names)} out of range for the {len(class_names)} classes "
                               f"of {spec.key!r}")
    else:
        k = max(names) + 1
        missing = sorted(set(range(k)) - set(names))
        if missing:
            raise DatasetError(f"{split_path}: labels must be 0..{k - 1} without gaps; no entry has label(s) "
                               f"{missing[:10]}")
        class_names = tuple(names[c] for c in range(k))
    return paths, labels, class_names


def _load_aircraft(spec: DatasetSpec, root: Path, lay: Layout) -> tuple[list[Path], list[int], tuple[str, ...]]:
    ddir = root / lay.dataset_dir
    list_path = ddir / lay.split_file
    variants_path = list_path.parent / "variants.txt"
    img_root = ddir / lay.image_dir
    if not variants_path.is_file():
        raise DatasetError(f"FGVC-Aircraft: {variants_path} is missing (the class list, one variant per line); "
                           + expected_layout(spec, root))
    variants = [v.strip() for v in variants_path.read_text(encoding="utf-8-sig").splitlines() if v.strip()]
    index = {v: i for i, v in enumerate(variants)}
    paths: list[Path] = []
    labels: list[int] = []
    for n, line in enumerate(list_path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        img_id, _, variant = line.strip().partition(" ")
        where = f"{list_path}:{n}"
        if variant not in index:
            raise DatasetError(f"{where}: variant {variant!r} is not in {variants_path.name}")
        paths.append(img_root / (safe_relpath(img_id, where=where) + ".jpg"))
        labels.append(index[variant])
    if not paths:
        raise DatasetError(f"{list_path}: no test images listed")
    return paths, labels, tuple(variants)


def _listdir(path: Path, *, sh_filter: bool) -> list[str]:
    # hidden files never count; the optional quirk reproduces TDA/DPE/DLAE's helper, which also drops any name
    # containing "sh" (docs/methods.md, "TDA's file-listing quirk (sh_filter)")
    return sorted(n for n in os.listdir(path) if not n.startswith(".") and not (sh_filter and "sh" in n))


def _load_folders(spec: DatasetSpec, root: Path, lay: Layout, *, sh_filter: bool
                  ) -> tuple[list[Path], list[int], tuple[str, ...], tuple[int, ...], dict[str, str]]:
    img_root = root / lay.dataset_dir / lay.image_dir if lay.image_dir else root / lay.dataset_dir
    scheme = spec.folder_scheme
    synsets = imagenet_synsets()
    if scheme == "wnid_a" or scheme == "wnid_r":
        subset = imagenet_subset("a" if scheme == "wnid_a" else "r")
    else:
        subset = tuple(range(1000))
    label_of_imagenet = {c: i for i, c in enumerate(subset)}
    folders = [f for f in _listdir(img_root, sh_filter=False) if (img_root / f).is_dir()]
    if not folders:
        raise DatasetError(f"{img_root}: no class folders found; " + expected_layout(spec, root))
    paths: list[Path] = []
    labels: list[int] = []
    dropped = 0
    by_label: list[tuple[int, str]] = []
    wnid_index = {w: i for i, w in enumerate(synsets)}
    for f in folders:
        if scheme == "v2_numeric":
            # V2 folders are named 0..999 = the ImageNet class index (never sort them as strings)
            if not f.isdigit() or not 0 <= int(f) < 1000:
                raise DatasetError(f"{img_root}/{f}: ImageNet-V2 class folders must be named 0..999")
            inet = int(f)
        else:
            if f not in wnid_index:
                raise DatasetError(f"{img_root}/{f}: not an ImageNet wnid folder (expected names like n01440764)")
            inet = wnid_index[f]
        if inet not in label_of_imagenet:
            raise DatasetError(f"{img_root}/{f}: class {f} is not one of the 200 classes of {spec.key}")
        by_label.append((label_of_imagenet[inet], f))
    for label, f in sorted(by_label):
        if sh_filter and "sh" in f:
            dropped += sum(1 for _ in os.scandir(img_root / f))
            continue
        all_files = _listdir(img_root / f, sh_filter=False)
        kept = [n for n in all_files if not (sh_filter and "sh" in n)]
        dropped += len(all_files) - len(kept)
        for n in kept:
            if n.lower().endswith(IMAGE_EXTENSIONS):
                paths.append(img_root / f / n)
                labels.append(label)
    if not paths:
        raise DatasetError(f"{img_root}: class folders hold no images ({', '.join(IMAGE_EXTENSIONS)})")
    names = imagenet_classnames()
    class_names = tuple(names[c] for c in subset)
    notes = {}
    if sh_filter:
        notes["tda_sh_filter"] = (f"on: reproduces TDA/DPE/DLAE's file listing, which drops names containing "
                                  f"'sh'; {dropped} image file(s) dropped")
    return paths, labels, class_names, subset, notes


def _check_unique(names: Sequence[str], where: str, fix: str) -> None:
    """Refuse duplicate class names; `fix` says what the user can do where the names came from (`--class-names`
    is suggested only where no such file was given)."""
    dup = sorted({n for n in names if list(names).count(n) > 1})
    if dup:
        raise DatasetError(f"{where}: duplicate class name(s) {', '.join(map(repr, dup[:5]))}; every class needs "
                           f"its own name ({fix})")


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _scan(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return [e for e in it if not e.name.startswith(".")]
    except OSError as e:
        raise DatasetError(f"{folder}: cannot list the folder ({e.strerror or e})") from None


def _entry_is_dir(e: os.DirEntry) -> bool:
    try:
        return e.is_dir()  # follows a symlink
    except OSError:  # a link to itself (ELOOP) or an unreadable target: not a folder to walk
        return False


def _leads_back(real_dir: str, link: str) -> bool:
    """True if the symlinked folder `link` is `real_dir` (a real path) or one of its ancestors: following it would
    walk a folder that is being walked (`cat/self -> .`, `cat/up -> ../..`), without end."""
    target = os.path.realpath(link)
    return real_dir == target or real_dir.startswith(target.rstrip(os.sep) + os.sep)


def _images_below(class_dir: Path, rel: str) -> tuple[list[str], list[str]]:
    """Relative POSIX paths (starting with `rel`) of the images anywhere below `class_dir`, and the symlinks not
    followed because they lead back to a folder they lie in (a cycle). Other symlinked folders are followed; a file
    they reach twice is caught by `_check_no_duplicates`."""
    found: list[str] = []
    cycles: list[str] = []
    stack = [(class_dir, rel, os.path.realpath(class_dir))]
    while stack:
        folder, rel_dir, real = stack.pop()
        for e in _scan(folder):
            rel_e = f"{rel_dir}/{e.name}"
            if not _entry_is_dir(e):
                if _is_image(e.name):
                    found.append(rel_e)
            elif not e.is_symlink():
                stack.append((Path(e.path), rel_e, os.path.join(real, e.name)))
            elif _leads_back(real, e.path):
                cycles.append(rel_e)
            else:
                stack.append((Path(e.path), rel_e, os.path.realpath(e.path)))
    return found, cycles


def _load_image_folder(spec: DatasetSpec, folder: Path
                       ) -> tuple[list[Path], list[int], tuple[str, ...], dict[str, str]]:
    """`folder:PATH`: label = index of the class folder in sorted order; images anywhere below a class folder
    (hidden files and folders skipped); sample order = relative paths sorted as strings. Symlinked folders are
    followed unless they lead back to a folder being walked (a cycle: skipped, recorded in the notes)."""
    entries = _scan(folder)
    if not entries:
        raise DatasetError(f"{folder}: the folder is empty; expected one sub-folder per class holding its images "
                           f"({folder}/<class name>/<image>)")
    real_root = os.path.realpath(folder)
    cycles = sorted(e.name for e in entries if e.is_symlink() and _entry_is_dir(e) and _leads_back(real_root, e.path))
    classes = sorted(e.name for e in entries if _entry_is_dir(e) and e.name not in cycles)
    if not classes:
        raise DatasetError(f"{folder}: no class sub-folders (found only files); expected one sub-folder per class "
                           f"holding its images ({folder}/<class name>/<image>)")
    items: list[tuple[str, int]] = []
    for label, c in enumerate(classes):
        found, skipped = _images_below(folder / c, c)
        if not found:
            raise DatasetError(f"{folder / c}: class folder holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        items += [(rel, label) for rel in found]
        cycles += skipped
    if spec.class_names is not None:
        if len(spec.class_names) != len(classes):
            raise DatasetError(f"--class-names {spec.class_names_file}: {len(spec.class_names)} class name(s) for "
                               f"{len(classes)} class folder(s) in {folder} (one name per folder, in the folders' "
                               "sorted order)")
        names = spec.class_names
    else:
        names = tuple(_clean_name(c) for c in classes)
        _check_unique(names, f"{folder}: class folder names (with '_' read as a space)",
                      "rename a folder or pass --class-names FILE")
    items.sort()
    notes = {}
    if cycles:
        notes["symlink_cycles"] = (f"not followed (each leads back to a folder it lies in): "
                                   f"{', '.join(sorted(cycles)[:5])}" + (f" and {len(cycles) - 5} more"
                                                                        if len(cycles) > 5 else ""))
    return [folder / rel for rel, _ in items], [y for _, y in items], names, notes


def split_image_dir(split_path: Path) -> str:
    """The folder a user's split file's relative paths start at, relative to the file's folder ("" for the folder
    itself): the file's folder when its first test image lies there, else the one sub-folder that holds it.

    CoOp's own split files follow the second convention: `split_zhou_*.json` lies in the dataset folder beside the
    image folder its paths start at (`images/` for DTD, Pets, Food-101 and the demo's sets, `jpg/` for Flowers102,
    `2750/` for EuroSAT, `101_ObjectCategories/` for Caltech101, `SUN397/`, `UCF-101-midframes/`; CoOp
    `DATASETS.md` and `datasets/*.py`). A first image found under no candidate leaves the file's folder (the
    missing image is reported with the others).

    Raises:
        DatasetError: the first test image lies under several sub-folders (which one is meant cannot be told).
    """
    first = _first_test_path(split_path)
    base = split_path.parent
    if first is None or (base / first).is_file():
        return ""
    holders = sorted(d.name for d in base.iterdir()
                     if not d.name.startswith(".") and d.is_dir() and (d / first).is_file())
    if len(holders) > 1:
        raise DatasetError(f"{split_path}: its first test image {first!r} lies under several sub-folders "
                           f"({', '.join(holders)}); keep one image folder beside the split file, or write the paths "
                           "relative to the split file's folder")
    return holders[0] if holders else ""


def _load_split_file(spec: DatasetSpec, split_path: Path) -> tuple[list[Path], list[int], tuple[str, ...]]:
    """`split:FILE.json`: the registered sets' CoOp reader, relative paths starting at the file's folder or at the
    image folder beside it (`split_image_dir`)."""
    lay = Layout("split file", "", split_image_dir(split_path), split_path.name)
    paths, labels, names = _load_json_split(dataclasses.replace(spec, class_names=None), split_path.parent, lay)
    if spec.class_names is not None:
        if len(spec.class_names) != len(names):
            raise DatasetError(f"--class-names {spec.class_names_file}: {len(spec.class_names)} class name(s) for "
                               f"the {len(names)} labels (0..{len(names) - 1}) of {split_path}")
        names = spec.class_names  # already checked for duplicates by resolve_dataset
    else:
        _check_unique(names, f"{split_path}: class names", "fix the split's names or pass --class-names FILE")
    return paths, labels, names


def _load_user(spec: DatasetSpec) -> TestSet:
    assert spec.ref is not None
    path = Path(spec.ref.partition(":")[2])
    notes = {"source": spec.ref}
    if spec.kind == "image_folder":
        if not path.is_dir():
            raise DatasetError(f"dataset {spec.key!r}: {path} is not a folder (expected one sub-folder per class)")
        ddir = path
        paths, labels, names, walk_notes = _load_image_folder(spec, path)
        notes.update(walk_notes)
    else:
        if not path.is_file():
            raise DatasetError(f"dataset {spec.key!r}: split file {path} does not exist")
        ddir = path.parent
        paths, labels, names = _load_split_file(spec, path)
        image_dir = split_image_dir(path)
        if image_dir:  # CoOp's convention: say where the paths start (recorded as zaec:split_image_dir)
            notes["split_image_dir"] = image_dir
    if spec.class_names_file is not None:
        notes["class_names_file"] = spec.class_names_file
    ts = TestSet(key=spec.key, dataset_dir=ddir, layout=spec.layouts[0].name, paths=tuple(paths),
                 labels=np.asarray(labels, dtype=np.int64), class_names=tuple(names), notes=notes)
    return _check_no_duplicates(ts, path)


def load_testset(key: str, data_root: str | os.PathLike | None = None, *, sh_filter: bool = False) -> TestSet:
    """Resolve dataset `key` under the data root and list its test samples (no image is opened).

    Args:
        key: canonical dataset key (see `REGISTRY`), a user dataset's name (`resolve_dataset`), or a `folder:` /
            `split:` reference.
        data_root: folder holding the datasets; None = $ZAEC_DATA_ROOT, else ./data. Not used by user datasets.
        sh_filter: reproduce the TDA/DPE/DLAE listing quirk (drop files/folders whose name contains "sh") on the
            ImageNet-A/-R/-Sketch/-V2 folders (docs/methods.md, "TDA's file-listing quirk (sh_filter)"). Off by
            default; ignored for the other sets.

    Returns:
        TestSet with paths in the canonical order.

    Raises:
        DatasetError: unknown key, missing folder (the message shows the expected layout), a bad split file, or a
            split entry that escapes the dataset folder; for user data also an empty folder, a class folder
            without images, a class-names count that differs from the classes, duplicate class names; an image
            file listed more than once (`_check_no_duplicates`); a set of fewer than two classes.
    """
    spec = get_dataset(key)
    if spec.kind == "ood_images":
        raise DatasetError(f"dataset {key!r} is an out-of-distribution set (images without classes); run it against "
                           f"an in-distribution set: --dataset {key} --ood-for KEY (e.g. imagenet)")
    if spec.ref is not None:  # a user's folder or split file: its own path, no data root
        return _at_least_two_classes(_load_user(spec))  # _load_user checks for duplicates
    root = resolve_data_root(data_root)
    lay = _find_layout(spec, root)
    ddir = root / lay.dataset_dir
    notes: dict[str, str] = {}
    inet: tuple[int, ...] | None = None
    if spec.kind == "json":
        paths, labels, names = _load_json_split(spec, root, lay)
    elif spec.kind == "aircraft":
        paths, labels, names = _load_aircraft(spec, root, lay)
    else:
        paths, labels, names, inet, notes = _load_folders(spec, root, lay,
                                                          sh_filter=sh_filter and spec.sh_quirk_applies)
    listing = ddir / lay.split_file if lay.split_file else ddir / lay.image_dir
    ts = TestSet(key=key, dataset_dir=ddir, layout=lay.name, paths=tuple(paths),
                 labels=np.asarray(labels, dtype=np.int64), class_names=tuple(names), imagenet_indices=inet,
                 notes=notes)
    return _at_least_two_classes(_check_no_duplicates(ts, listing))


def load_ood_images(key: str, data_root: str | os.PathLike | None = None, *, sh_filter: bool = False) -> TestSet:
    """List the images of an out-of-distribution set (no image is opened); their labels are all -1 (no class).

    Args:
        key: a registered OOD set (`OOD_DATASETS`: every image below its folder), a user's `folder:` dataset's name
            (every image below the folder, at any depth: its sub-folders are no classes), or any other dataset
            key or user `split:` name (its test list; its labels are dropped).
        data_root: as for `load_testset` (not used by user datasets).
        sh_filter: as for `load_testset` (only a labelled set's listing uses it).

    Returns:
        TestSet with `class_names=()`, labels (N,) int64 of -1, paths in canonical order: relative paths sorted as
        strings for a folder, the test list's order otherwise.

    Raises:
        DatasetError: a missing folder (with the expected layout), a folder without images, an image listed twice.

    Example:
        >>> load_ood_images("inaturalist", "/data").labels[:3].tolist()  # doctest: +SKIP
        [-1, -1, -1]
    """
    spec = get_dataset(key)
    if spec.kind == "image_folder":
        assert spec.ref is not None
        img_root, layout = Path(spec.ref.partition(":")[2]), spec.layouts[0].name
        if not img_root.is_dir():
            raise DatasetError(f"dataset {spec.key!r}: {img_root} is not a folder")
    elif spec.kind == "ood_images":
        root = resolve_data_root(data_root)
        lay = _find_layout(spec, root)
        img_root, layout = root / lay.dataset_dir / lay.image_dir if lay.image_dir else root / lay.dataset_dir, lay.name
    else:
        ts = load_testset(spec.key, data_root, sh_filter=sh_filter)
        return dataclasses.replace(ts, labels=np.full(len(ts), -1, np.int64), class_names=(), imagenet_indices=None)
    found, cycles = _images_below(img_root, ".")
    if not found:
        raise DatasetError(f"{img_root}: no images ({', '.join(IMAGE_EXTENSIONS)}) below the folder of "
                           f"out-of-distribution set {spec.key!r}")
    rels = sorted(posixpath.normpath(r) for r in found)
    notes = {"symlink_cycles": f"not followed: {', '.join(sorted(cycles)[:5])}"} if cycles else {}
    ts = TestSet(key=spec.key, dataset_dir=img_root, layout=layout, paths=tuple(img_root / r for r in rels),
                 labels=np.full(len(rels), -1, np.int64), class_names=(), notes=notes)
    return _check_no_duplicates(ts, img_root)


def shared_files(a: TestSet, b: TestSet) -> list[tuple[int, int]]:
    """(sample index in `a`, sample index in `b`) of every image file both sets list: the same file, also through a
    symlinked file or folder (`_FileKeys`), in `b`'s order."""
    key_of = _FileKeys()
    where = {key_of(p): i for i, p in enumerate(a.paths)}
    return [(where[k], j) for j, k in enumerate(map(key_of, b.paths)) if k in where]


class _FileKeys:
    """What makes two listed paths one file, at one `stat` and one listing per folder rather than a `stat` per
    image (ImageNet's 50,000): the folder's (device, inode) and the file's name, after resolving a symlinked file
    to its target. Two paths through a symlinked folder, or a symlink next to its target, give one key; hard links
    and byte-identical copies are separate files. A path whose folder cannot be read keys on its normalised text
    (it fails when the image is opened)."""

    def __init__(self) -> None:
        self._dirs: dict[str, tuple[tuple[int, int] | None, frozenset[str]]] = {}

    def _dir(self, folder: str) -> tuple[tuple[int, int] | None, frozenset[str]]:
        info = self._dirs.get(folder)
        if info is None:
            try:
                st = os.stat(folder)
                with os.scandir(folder) as it:
                    info = ((st.st_dev, st.st_ino), frozenset(e.name for e in it if e.is_symlink()))
            except OSError:
                info = (None, frozenset())
            self._dirs[folder] = info
        return info

    def __call__(self, path: Path) -> object:
        folder, name = os.path.split(os.fspath(path))
        dir_id, links = self._dir(folder)
        if name in links:
            folder, name = os.path.split(os.path.realpath(path))
            dir_id = self._dir(folder)[0]
        return (dir_id, name) if dir_id is not None else os.path.normpath(os.fspath(path))


def _check_no_duplicates(ts: TestSet, listing: Path) -> TestSet:
    """Refuse a test set that lists one image file more than once (the same entry twice in a split or list file, or
    one file reached through two paths: a symlinked folder or file), naming the first few and the count: each copy
    would get its own sample_id and count twice in every metric. `listing` is the split file or folder named."""
    key_of = _FileKeys()
    first: dict[object, int] = {}
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(ts.paths):
        j = first.setdefault(key_of(p), i)
        if j != i:
            groups.setdefault(j, [j]).append(i)
    if not groups:
        return ts

    def rel(i: int) -> str:
        return ts.paths[i].relative_to(ts.dataset_dir).as_posix()

    shown = []
    for g in list(groups.values())[:3]:
        if len({rel(i) for i in g}) == 1:
            shown.append(f"{rel(g[0])!r} {len(g)} times (sample_id {', '.join(map(str, g))})")
        else:
            shown.append(" = ".join(f"{rel(i)!r} (sample_id {i})" for i in g))
    more = f"; and {len(groups) - 3} more" if len(groups) > 3 else ""
    extra = sum(len(g) - 1 for g in groups.values())
    raise DatasetError(f"{listing}: {len(groups)} image file(s) of dataset {ts.key!r} are listed more than once "
                       f"({extra} extra sample(s)): {'; '.join(shown)}{more}; each image must appear once in a test "
                       "set (a path through a symlink to a listed file or folder is the same image)")


def check_outside_dataset(testset: TestSet, path: str | os.PathLike, option: str) -> None:
    """Refuse an output folder (`--out`, `--cache-dir`) inside the folder whose listing defines `testset`.

    A `folder:` dataset takes every class sub-folder and every image below one as data, and a registered
    class-folder set (the ImageNet family, ImageNet-C) checks every folder name: a run's files there change or
    break the next listing. Sets listed from a split or list file (`split:`, the CoOp JSON sets, FGVC-Aircraft)
    read only the files listed, so a folder next to them is allowed. Both paths are compared resolved (symlinks,
    `~`, relative parts), and `path` need not exist yet.

    Args:
        testset: from `load_testset` (its dataset registered in this process).
        path: the folder the run writes to.
        option: its option name in the message (`--out`, `--cache-dir`).

    Raises:
        DatasetError: one line naming the option, the path and the dataset folder.

    Example:
        >>> check_outside_dataset(ts, "/data/pets/out", "--out")  # doctest: +SKIP
        DatasetError: --out /data/pets/out is inside the folder /data/pets of dataset 'pets' ...
    """
    spec = get_dataset(testset.key)
    if spec.kind in ("image_folder", "ood_images"):
        listed = testset.dataset_dir
    elif spec.kind == "folders":
        lay = next(lay for lay in spec.layouts if lay.name == testset.layout)
        listed = testset.dataset_dir / lay.image_dir
    else:
        return
    target = Path(path).expanduser().resolve()
    listed = listed.resolve()
    if target == listed or listed in target.parents:
        raise DatasetError(f"{option} {path} is inside the folder {listed} of dataset {testset.key!r}, whose "
                           "listing defines the test set (the run's files there would be read as data by the next "
                           f"run); give {option} a folder outside it")


def _at_least_two_classes(ts: TestSet) -> TestSet:
    """Refuse a test set of one class: every method would report 100% accuracy (and DPE/DLAE divide by K - 1)."""
    if len(ts.class_names) < 2:
        raise DatasetError(f"dataset {ts.key!r} has {len(ts.class_names)} class ({', '.join(ts.class_names)}) in "
                           f"{ts.dataset_dir}; a test set needs at least two classes")
    return ts


#: PIL modes of 16-bit grey images: their 0..65535 range is mapped onto 0..255 (PIL's own convert clips at 255,
#: which turns a 16-bit image white)
_MODES_16BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def _to_rgb(im, path: Path):
    """An RGB copy of a PIL image of any mode: 8-bit modes by PIL's convert, 16-bit grey scaled by 255/65535 (rounded),
    32-bit integer images only when their values lie in 0..65535 (how PIL opens some 16-bit PNGs); float images and
    modes PIL cannot convert are rejected naming the file and the mode."""
    from PIL import Image

    if im.mode in _MODES_16BIT or im.mode == "I":
        a = np.asarray(im).astype(np.int64)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise DatasetError(f"{path}: 32-bit integer image (mode {im.mode}) with values outside 0..65535 is not "
                               "supported; convert it to 8- or 16-bit")
        return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), "L").convert("RGB")
    if im.mode == "F":
        raise DatasetError(f"{path}: floating-point image (mode F) is not supported; convert it to 8- or 16-bit")
    try:
        return im.convert("RGB")
    except ValueError as e:
        raise DatasetError(f"{path}: cannot convert image mode {im.mode} to RGB ({e})") from None


def open_image(path: Path, exif_transpose: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Open one image as RGB PIL, whatever its mode (grey-scale, palette, CMYK, RGBA and 16-bit grey are converted;
    unsupported modes are rejected by name).

    What is read, as the official TDA/DPE code and torchvision's ImageFolder read it (PIL's `open` + `convert`):
    the stored pixels, whatever the EXIF orientation tag says; an alpha channel is dropped (each pixel keeps its
    stored colour, however transparent: no compositing on a background); of an animated or multi-frame file (GIF,
    APNG, WebP, TIFF) only the first frame. docs/extract.md, "Your own data", says the same for users.

    Args:
        path: the image file.
        exif_transpose: turn the image as its EXIF orientation tag says (PIL's `ImageOps.exif_transpose`: the
            8 rotations and mirrorings) before the conversion. Off by default for fidelity with the official
            code; for photos from cameras and phones. A run that uses it must record it in its settings and
            feature-cache key: the pixels, and so every feature, differ.
        max_pixels: refuse an image of more pixels (width x height, read from its header before any pixel is
            decoded: Pillow's decompression-bomb guard, in place of Pillow's own check and warning); 0: no limit.

    Returns:
        An RGB PIL image.

    Raises:
        DatasetError: a missing or unreadable file, an image over `max_pixels`, an unsupported mode, an unreadable
            EXIF block.

    Example:
        >>> open_image(Path("photo.jpg"), exif_transpose=True).size  # doctest: +SKIP
        (3024, 4032)
    """
    from PIL import Image, ImageOps, UnidentifiedImageError
    try:
        with _own_pixel_check(Image), Image.open(path) as im:
            w, h = im.size
            if max_pixels and w * h > max_pixels:
                raise DatasetError(f"{path}: {w} x {h} = {w * h:,} pixels, over the limit of {max_pixels:,} "
                                   "(Pillow's decompression-bomb guard); pass --max-image-pixels N to read larger "
                                   "images (0: no limit)")
            if exif_transpose:
                try:
                    im = ImageOps.exif_transpose(im)
                except (ValueError, SyntaxError) as e:  # PIL's errors for a malformed EXIF block
                    raise DatasetError(f"{path}: cannot read the image's EXIF orientation ({e})") from None
            return _to_rgb(im, path)
    except FileNotFoundError:
        raise DatasetError(f"{path}: image listed in the test split does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise DatasetError(f"{path}: cannot read image ({e})") from None


@contextlib.contextmanager
def _own_pixel_check(image_module: Any) -> Iterator[None]:
    """Pillow's own pixel check off while `open_image` applies its limit: Pillow would warn (a raw warning from a
    loader process, even under --quiet) or raise its own error past `max_pixels`' reach. Images are read by one
    thread per process (a loader process, or the main thread), so nothing else sees the change."""
    old = image_module.MAX_IMAGE_PIXELS
    image_module.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        image_module.MAX_IMAGE_PIXELS = old
