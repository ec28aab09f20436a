"""Shared test fixtures for the extraction stage: a tiny open_clip model and tiny image datasets on disk.

Nothing here downloads anything. Import the helpers with `from tests.support.extract import ...`; the pytest
fixtures at the end (`tiny_model_dir`, `tiny_model`, `one_thread`, `running_mean`) are registered by tests/conftest.py
(`pytest_plugins`): name them as test arguments, never import them.

    model_dir = make_tiny_model_dir(tmp_path / "model")               # local-dir: layout
    ckpt = make_tiny_checkpoint(tmp_path / "tiny.safetensors")        # file + registered arch TINY_ARCH
    root = tmp_path / "data"; make_json_dataset(root, "dtd", n_classes=3, per_class=4)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

TINY_ARCH = "zaec-tiny-vit"
TINY_IMAGE_SIZE = 32
TINY_MEAN = (0.48145466, 0.4578275, 0.40821073)
TINY_STD = (0.26862954, 0.26130258, 0.27577711)


def tiny_model_cfg(image_size: int = TINY_IMAGE_SIZE, quick_gelu: bool = True, vision: str = "vit") -> dict:
    """open_clip CLIP config of a ViT with width 32, one layer, patch 8, 32 px input, a one-layer text tower;
    `vision="rn"`: an open_clip ModifiedResNet image tower instead (one bottleneck per stage, width 8, its
    BatchNorms and attention pooling), the stand-in for RN50."""
    vision_cfg = ({"image_size": image_size, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8}
                  if vision == "vit" else {"image_size": image_size, "layers": [1, 1, 1, 1], "width": 8,
                                           "head_width": 16})
    return {
        "embed_dim": 16,
        "quick_gelu": quick_gelu,
        "vision_cfg": vision_cfg,
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }


def _build(cfg: dict, seed: int):
    import open_clip
    import torch

    torch.manual_seed(seed)
    model = open_clip.CLIP(**cfg)
    # a logit scale that is not OpenAI's 100, so tests catch a hard-coded 100
    with torch.no_grad():
        model.logit_scale.fill_(float(np.log(37.5)))
    return model


def _state_dict(model) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def make_tiny_model_dir(path: Path, *, seed: int = 0, model_name: str | None = "tiny-clip",
                        quick_gelu: bool = True, image_size: int = TINY_IMAGE_SIZE, vision: str = "vit") -> Path:
    """Write `open_clip_config.json` + `open_clip_model.safetensors` of a tiny random CLIP into `path` (`vision`:
    "vit" or "rn", `tiny_model_cfg`)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_model_cfg(image_size, quick_gelu, vision)
    doc = {"model_cfg": cfg, "preprocess_cfg": {"mean": list(TINY_MEAN), "std": list(TINY_STD),
                                                 "interpolation": "bicubic", "resize_mode": "shortest"}}
    if model_name:
        doc["model_name"] = model_name
    (path / "open_clip_config.json").write_text(json.dumps(doc))
    save_file(_state_dict(_build(cfg, seed)), str(path / "open_clip_model.safetensors"))
    return path


#: the tiny SigLIP's logit bias and scale (neither 0 nor CLIP's, so tests catch a dropped or hard-coded one)
TINY_SIGLIP_BIAS = -2.5
TINY_SIGLIP_SCALE = 10.0


def tiny_siglip_cfg(image_size: int = TINY_IMAGE_SIZE) -> dict:
    """open_clip config with ViT-B-16-SigLIP's text-tower options (open_clip `model_configs/ViT-B-16-SigLIP.json`):
    a custom text tower without causal mask, pooled at the last position, a projection with bias, LayerNorm eps
    1e-6, a logit bias. Its tokenizer is open_clip's BPE (offline) with SigLIP's context length 64 and
    "canonicalize" cleaning; the vision tower is the tiny CLIP's (SigLIP's is a timm ViT, irrelevant to the text
    side). Two text layers, so that bidirectional attention matters."""
    return {
        "embed_dim": 16,
        "init_logit_bias": TINY_SIGLIP_BIAS,
        "custom_text": True,
        "vision_cfg": {"image_size": image_size, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 64, "vocab_size": 49408, "tokenizer_kwargs": {"clean": "canonicalize"},
                     "width": 32, "heads": 2, "layers": 2, "no_causal_mask": True, "proj_bias": True,
                     "pool_type": "last", "norm_kwargs": {"eps": 1e-6}},
    }


def make_tiny_siglip_dir(path: Path, *, seed: int = 0, model_name: str | None = "tiny-siglip") -> Path:
    """Write `open_clip_config.json` + `open_clip_model.safetensors` of a tiny random SigLIP-style model."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_siglip_cfg()
    doc = {"model_cfg": cfg, "preprocess_cfg": {"mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic",
                                                 "resize_mode": "squash"}}
    if model_name:
        doc["model_name"] = model_name
    (path / "open_clip_config.json").write_text(json.dumps(doc))
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in cfg.items() if k != "custom_text"}
    model = open_clip.CustomTextCLIP(**kwargs, init_logit_scale=float(np.log(TINY_SIGLIP_SCALE)))
    save_file(_state_dict(model), str(path / "open_clip_model.safetensors"))
    return path


def register_tiny_arch() -> str:
    """Register TINY_ARCH as an open_clip built-in model name (so a bare checkpoint file can be loaded)."""
    import open_clip
    from open_clip.factory import _MODEL_CONFIGS

    _MODEL_CONFIGS[TINY_ARCH] = tiny_model_cfg()
    assert TINY_ARCH in open_clip.list_models()
    return TINY_ARCH


def make_tiny_checkpoint(path: Path, *, seed: int = 0, fmt: str = "safetensors") -> Path:
    """A checkpoint file of TINY_ARCH (registered on the fly): `.safetensors`, a torch state dict `.pt`, or a
    TorchScript archive (fmt="jit")."""
    import torch
    from safetensors.torch import save_file

    register_tiny_arch()
    sd = _state_dict(_build(tiny_model_cfg(), seed))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file(sd, str(path))
    elif fmt == "jit":  # a TorchScript archive, as OpenAI's original ViT-B-16.pt
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.jit.script(_build(tiny_model_cfg(), seed).eval()).save(str(path))
    else:
        torch.save(sd, path)
    return path


# ------------------------------------------------------------------------------------------------------------------
# method configs

def with_views(config, n_views: int, facts: dict | None = None, **changes):
    """`dataclasses.replace(config, n_views=n_views, **changes)`, with every field whose declared range is bounded
    by `n_views` (R-TPT's top_k, DMN's used_views) or by a model fact in `facts` (TTL's lora_blocks and
    {"vision_blocks": N}) lowered to that bound unless `changes` sets it: the config a test on fewer views or a
    smaller model means (the methods used to clamp these silently, so the logits are those of before). Found
    through the declared ranges, so a new bounded field needs no edit here."""
    import dataclasses

    from extract.methods.base import Ref, field_ranges

    facts = facts or {}
    trial = {**dataclasses.asdict(config), "n_views": n_views, **changes}
    for name, valid in field_ranges(type(config)).items():
        hi = None if valid is None else valid.hi
        if name in changes or not isinstance(hi, Ref) or (hi.of_model and hi.name not in facts):
            continue
        base = facts[hi.name] if hi.of_model else trial[hi.name]
        bound = max(hi.floor or -math.inf, base + hi.offset)
        if trial[name] > bound:
            trial[name] = type(trial[name])(bound)
    settable = {f.name for f in dataclasses.fields(config) if f.init}
    return dataclasses.replace(config, **{k: v for k, v in trial.items() if k in settable})


# ------------------------------------------------------------------------------------------------------------------
# images and layouts

def write_image(path: Path, rng: np.random.Generator, size: tuple[int, int] = (40, 48), mode: str = "RGB") -> Path:
    """A random image (width, height) = size; class-independent noise is enough for pipeline tests."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = size
    arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path)
    return path


def make_json_dataset(root: Path, key: str, *, n_classes: int = 3, per_class: int = 3, seed: int = 0,
                      layout: int = 0, class_names: Sequence[str] | None = None, shuffle: bool = True,
                      ext: str = ".png") -> dict:
    """Write a CoOp-style JSON split dataset for registry entry `key` in its `layout`-th layout.

    Returns the split dict written (its "test" list is the canonical order).
    """
    from extract.datasets import get_dataset

    spec = get_dataset(key)
    lay = spec.layouts[layout]
    ddir = Path(root) / lay.dataset_dir
    img_root = ddir / lay.image_dir if lay.image_dir else ddir
    rng = np.random.default_rng(seed)
    names = list(class_names) if class_names is not None else [f"class_{c}" for c in range(n_classes)]
    test = []
    for c, name in enumerate(names):
        for i in range(per_class):
            rel = f"{name.replace(' ', '_')}/img_{c}_{i}{ext}"
            write_image(img_root / rel, rng, mode="L" if (c + i) % 4 == 0 else "RGB")
            test.append([rel, c, name])
    if shuffle:
        order = rng.permutation(len(test))
        test = [test[i] for i in order]
    split = {"train": [test[0]], "val": [], "test": test}
    (ddir / lay.split_file).parent.mkdir(parents=True, exist_ok=True)
    (ddir / lay.split_file).write_text(json.dumps(split))
    return split


def make_aircraft(root: Path, *, variants: Sequence[str] = ("707-320", "A300B4", "Cessna 172"), per_class: int = 2,
                  seed: int = 0, layout: int = 0) -> list[tuple[str, str]]:
    """FGVC-Aircraft layout: variants.txt, images_variant_test.txt ('<id> <variant>'), images/<id>.jpg."""
    from extract.datasets import get_dataset

    lay = get_dataset("fgvc_aircraft").layouts[layout]
    ddir = Path(root) / lay.dataset_dir
    list_path = ddir / lay.split_file
    list_path.parent.mkdir(parents=True, exist_ok=True)
    (list_path.parent / "variants.txt").write_text("\n".join(variants) + "\n")
    rng = np.random.default_rng(seed)
    entries = []
    for v in variants:
        for i in range(per_class):
            img_id = f"{int(rng.integers(1000000, 9999999))}"
            write_image(ddir / lay.image_dir / f"{img_id}.jpg", rng)
            entries.append((img_id, v))
    list_path.write_text("".join(f"{i} {v}\n" for i, v in entries))
    return entries


def make_imagenet_folders(root: Path, key: str, classes: Sequence[str], *, per_class: int = 2, seed: int = 0,
                          layout: int = 0, names: Sequence[str] | None = None) -> Path:
    """ImageNet-style class folders (wnids, or V2's numbers) for `key`; returns the image root."""
    from extract.datasets import get_dataset

    lay = get_dataset(key).layouts[layout]
    img_root = Path(root) / lay.dataset_dir / lay.image_dir if lay.image_dir else Path(root) / lay.dataset_dir
    rng = np.random.default_rng(seed)
    for c in classes:
        for i in range(per_class):
            fname = names[i] if names is not None else f"img_{i}.JPEG"
            write_image(img_root / str(c) / fname, rng)
    return img_root


# ------------------------------------------------------------------------------------------------------------------
# pytest fixtures (a plugin of tests/conftest.py: a test names them as arguments, never imports them)

import os  # noqa: E402

import pytest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A `local-dir:` model folder with a tiny random CLIP (32 px, logit scale 37.5)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The tiny model loaded on the CPU through `extract.models.load_model`."""
    from extract.models import load_model

    return load_model(None, f"local-dir:{tiny_model_dir}", "cpu")


@pytest.fixture(scope="session")
def tiny_rn_model_dir(tmp_path_factory) -> Path:
    """A `local-dir:` model folder with a tiny random CLIP whose image tower is open_clip's ModifiedResNet (its
    BatchNorms), named "RN-tiny" so that the per-backbone tables read its RN column; 64 px, so that its last stage
    keeps 2 x 2 positions (a BatchNorm on batch statistics needs more than one value per channel, as RN50's 7 x 7
    gives it for a batch of one image)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-rn"), model_name="RN-tiny", vision="rn",
                               image_size=2 * TINY_IMAGE_SIZE)


@pytest.fixture(scope="session")
def tiny_rn_model(tiny_rn_model_dir):
    """The tiny RN model loaded on the CPU through `extract.models.load_model`."""
    from extract.models import load_model

    return load_model(None, f"local-dir:{tiny_rn_model_dir}", "cpu")


@pytest.fixture(params=["vit", "rn"])
def tiny_model64(request, tiny_model, tiny_rn_model):
    """The bare open_clip model of `tiny_model` (ViT) or `tiny_rn_model` (RN), copied to float64: a method and a
    slow transcription of its official loop then run the same float64 operations (a test per backbone)."""
    import copy

    loaded = tiny_model if request.param == "vit" else tiny_rn_model
    return copy.deepcopy(loaded.model).double()


@pytest.fixture(scope="session")
def tiny_siglip_dir(tmp_path_factory) -> Path:
    """A `local-dir:` model folder with a tiny random SigLIP-style model (`tiny_siglip_cfg`)."""
    return make_tiny_siglip_dir(tmp_path_factory.mktemp("tiny-siglip"))


@pytest.fixture(scope="session")
def tiny_siglip(tiny_siglip_dir):
    """The tiny SigLIP-style model loaded on the CPU through `extract.models.load_model`."""
    from extract.models import load_model

    return load_model(None, f"local-dir:{tiny_siglip_dir}", "cpu")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: its tensors are tiny, and thread hand-offs cost more than the work on a
    shared 2-core machine. A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def interrupt_nth_write(monkeypatch, n: int):
    """Make the run's n-th part write raise KeyboardInterrupt (an interrupted run); returns the real writer,
    which `monkeypatch.setattr(extract.run.writer, "write_shard", real)` puts back."""
    from extract.run import writer

    real_write, count = writer.write_shard, {"n": 0}

    def failing(*a, **k):
        count["n"] += 1
        if count["n"] == n:
            raise KeyboardInterrupt
        return real_write(*a, **k)

    monkeypatch.setattr(writer, "write_shard", failing)
    return real_write


#: the row columns of a run's shards (`schemas.shard.Shard`), as the runner tests compare two runs
SHARD_COLUMNS = ("sample_id", "label", "zs_logits", "tta_logits", "stream_pos")


def shard_columns(paths: Sequence[Path], columns: Sequence[str] = SHARD_COLUMNS) -> dict[str, np.ndarray]:
    """{column: the rows of the shards at `paths`, concatenated in order} (a run's parts as one table)."""
    from schemas.shard import read_shard

    shards = [read_shard(p) for p in paths]
    return {k: np.concatenate([getattr(s, k) for s in shards]) for k in columns}


@pytest.fixture(scope="session")
def tiny_externals(tmp_path_factory, tiny_model):
    """`tests.support.second_models.TinyExternals`: `tiny_externals.overrides(key)` is the `--set` values that run a
    method declaring `external_files` on the tiny model with tiny second models (built offline on first use)."""
    from tests.support.second_models import TinyExternals

    return TinyExternals(tmp_path_factory.mktemp("externals"), tiny_model)


@pytest.fixture
def running_mean(monkeypatch):
    """Register the stand-in online method `RunningMean` (tests/support/methods.py) for one test; its key."""
    import extract.methods as methods
    from tests.support.methods import RunningMean

    monkeypatch.setitem(methods.REGISTRY, RunningMean.key, RunningMean)
    return RunningMean.key
