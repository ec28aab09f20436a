"""Loading open_clip models the way the official TTA code sees OpenAI CLIP, through one function.

`load_model(backbone, pretrained, device)` accepts three kinds of `pretrained`:
    * a pretrained tag (`openai`, ...): the weights must already be in the local caches (Hugging Face hub cache or
      open_clip's `~/.cache/clip`); with the hub offline (`HF_HUB_OFFLINE=1`) a missing file fails at once with a
      message naming it, instead of hanging in a hub client.
    * a checkpoint file (`.safetensors`, a `.pt/.pth/.bin` state dict loaded with `weights_only=True`, or OpenAI's
      original TorchScript archive, whose state dict is read with `torch.jit.load`).
    * `local-dir:DIR` holding `open_clip_config.json` and `open_clip_model.safetensors` (or another checkpoint name
      open_clip looks for): the architecture comes from the directory.

QuickGELU (docs/methods.md, "CLIP as the official code loads it"): OpenAI's CLIP uses QuickGELU; open_clip's
plain `ViT-B-16`/`RN50` configs use GELU and only warn on a mismatch. For tags the tag's own `quick_gelu` flag is
applied; for a checkpoint file with one of the OpenAI architectures (`OPENAI_ARCHS`) QuickGELU is forced too, since
such a file almost always holds OpenAI weights (pass `quick_gelu=False` or another open_clip model name
otherwise). `local-dir:` follows its config.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np
import torch

from extract.defaults import DEFAULT_BACKBONE

LOCAL_DIR = "local-dir:"
#: architectures released by OpenAI with QuickGELU; a checkpoint file for one of these gets QuickGELU forced
OPENAI_ARCHS = frozenset({"RN50", "RN101", "RN50x4", "RN50x16", "RN50x64", "ViT-B-32", "ViT-B-16", "ViT-L-14",
                          "ViT-L-14-336"})
#: checkpoint names looked for in a local dir, in order (open_clip's own preference)
LOCAL_DIR_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "model.safetensors",
                     "open_clip_pytorch_model.bin", "pytorch_model.bin", "open_clip_pytorch_model.pth",
                     "pytorch_model.pth", "model.pth")
Precision = Literal["amp", "fp32"]


class ModelError(ValueError):
    """A user-side problem loading a model (unknown name or tag, missing weights). One clear message."""


@dataclass(frozen=True)
class WeightFlags:
    """How messages spell the settings that choose a model and its weights, each followed by its value:
    `zaec-extract`'s own options (the default), or the `--set` keys of a second model a method loads (RLCF's
    reward model: `WeightFlags("--set reward_backbone=", "--set reward_pretrained=")`)."""

    backbone: str = "--backbone "
    pretrained: str = "--pretrained "


#: the main model's options
MAIN_FLAGS = WeightFlags()


@dataclass(frozen=True)
class Preprocess:
    """Image preprocessing of a model (from its own open_clip config, never hard-coded)."""

    size: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bicubic"
    resize_mode: str = "shortest"


class AmpEncoding:
    """What an image encoder of a run shares (`LoadedModel`, `extract.timm_encoder.TimmEncoder`): precision "amp"
    encodes under CUDA autocast (fp16) and caches its features in fp16; "fp32" neither. Reads `precision` and
    `device`."""

    precision: Precision
    device: torch.device

    @property
    def cache_dtype(self) -> np.dtype:
        """dtype of cached image features: fp16 when encoded under autocast, fp32 otherwise."""
        return np.dtype(np.float16) if self.precision == "amp" else np.dtype(np.float32)

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        if self.precision == "amp" and self.device.type == "cuda":
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                yield
        else:
            yield


@dataclass
class LoadedModel(AmpEncoding):
    """An open_clip model ready for frozen encoding.

    Attributes:
        model: the open_clip module in eval mode on `device`.
        backbone: the model name recorded in shards (open_clip spelling, e.g. `ViT-B-16`).
        pretrained: as given by the user (tag, file path, or `local-dir:DIR`).
        arch: what open_clip was asked to build (e.g. `ViT-B-16` with quick_gelu, or `local-dir:DIR`).
        quick_gelu: whether the activation is QuickGELU.
        preprocess: image size, mean/std, interpolation of this model.
        logit_scale: the model's own exp(logit_scale) (100 for OpenAI CLIP).
        logit_bias: the model's learned logit bias (SigLIP: logits = logit_scale * cos + logit_bias); 0.0 for
            models without one (CLIP). One scalar for every class: it cancels in every softmax over classes, so the
            project's logits leave it out (docs/methods.md, "SigLIP").
        fingerprint: hex digest identifying weights + architecture + precision (keys the feature cache).
        precision: "amp" = autocast fp16 on CUDA; "fp32" otherwise.
    """

    model: torch.nn.Module
    tokenizer: Any
    backbone: str
    pretrained: str
    arch: str
    quick_gelu: bool
    preprocess: Preprocess
    logit_scale: float
    device: torch.device
    precision: Precision
    fingerprint: str
    weights_file: str | None = None
    notes: dict[str, str] = field(default_factory=dict)
    logit_bias: float = 0.0

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) preprocessed images -> (N, D) float32 L2-normalised features on `device`."""
        with self._autocast():
            feats = self.model.encode_image(images.to(self.device, non_blocking=True))
        feats = feats.float()
        return feats / feats.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def encode_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """List of N strings -> (N, D) float32 L2-normalised text features on `device`."""
        tokens = self.tokenizer(list(texts)).to(self.device)
        with self._autocast():
            feats = self.model.encode_text(tokens)
        feats = feats.float()
        return feats / feats.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_prototypes(self, prompts_per_class: Sequence[Sequence[str]], batch_size: int = 512,
                        on_batch: Callable[[int], Any] | None = None) -> torch.Tensor:
        """Class prototypes as TDA's `clip_classifier`: per prompt L2-normalise, average per class, re-normalise.

        Args:
            prompts_per_class: K lists of prompts (at least one each).
            batch_size: prompts per text-encoder call.
            on_batch: called with the number of prompts after each encoder call (a progress bar).

        Returns:
            (K, D) float32, rows L2-normalised, on `device`.
        """
        flat = [p for ps in prompts_per_class for p in ps]
        owner = torch.tensor([k for k, ps in enumerate(prompts_per_class) for _ in ps], device=self.device)
        if any(len(ps) == 0 for ps in prompts_per_class):
            raise ValueError("every class needs at least one prompt")
        pieces = []
        for i in range(0, len(flat), batch_size):
            pieces.append(self.encode_texts(flat[i:i + batch_size]))
            if on_batch is not None:
                on_batch(len(pieces[-1]))
        feats = torch.cat(pieces)
        k = len(prompts_per_class)
        sums = torch.zeros(k, feats.shape[1], device=self.device).index_add_(0, owner, feats)
        counts = torch.bincount(owner, minlength=k).clamp_min(1).unsqueeze(1).float()
        mean = sums / counts
        return mean / mean.norm(dim=-1, keepdim=True)


# ---------------------------------------------------------------------------------------------------------------

def resolve_device(device: str | None) -> torch.device:
    """`device` or cuda-if-available; raises ModelError for an unknown or unavailable device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ModelError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available on this machine; use --device cpu")
    return dev


def is_torchscript(path: Path) -> bool:
    """Whether `path` is a TorchScript archive (a zip holding a `code/` folder) rather than a state dict."""
    import zipfile
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any("/code/" in n or n.startswith("code/") for n in zf.namelist())


def torchscript_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a TorchScript CLIP archive, without OpenAI's non-weight entries."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        module = torch.jit.load(str(path), map_location="cpu")
    sd = {k: v for k, v in module.state_dict().items()
          if k not in ("input_resolution", "context_length", "vocab_size")}
    return sd


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _unreachable_host(tag_cfg: dict[str, Any], timeout: float = 3.0) -> str | None:
    """The download host of a pretrained tag if it cannot be reached within `timeout` seconds, else None.

    Clusters without network are normal for our users; the hub client would retry for about a minute before
    failing, so one short TCP probe decides first.
    """
    import socket
    from urllib.parse import urlparse

    if tag_cfg.get("hf_hub"):
        url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    else:
        url = tag_cfg.get("url", "")
    parsed = urlparse(url)
    host = parsed.hostname
    if not host:
        return None
    try:
        with socket.create_connection((host, parsed.port or (443 if parsed.scheme == "https" else 80)), timeout):
            return None
    except OSError:
        return host


#: torch.nn.init's random initialisers (module construction calls them through `init.<name>` at call time, or
#: through a name a module imported from torch.nn.init: `nn.MultiheadAttention` calls `xavier_uniform_` so)
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_")
#: modules that bind a random initialiser under its own name besides torch.nn.init (checked by identity)
_INIT_IMPORTERS = ("torch.nn.modules.activation",)


@contextlib.contextmanager
def skip_random_init() -> Iterator[None]:
    """Within the block, torch.nn.init's random initialisers leave their tensor as it is (uninitialised memory).

    Only for building a module whose every parameter a strict load overwrites right after: the loaded model is
    then the same, bit for bit (tests/extract/test_models.py compares every tensor with a normally built one).
    Constant initialisers run as usual, and so does code that draws from torch directly. The initialisers are
    swapped in torch.nn.init and in the modules of `_INIT_IMPORTERS` that imported them by name (for ViT-B-16,
    nn.MultiheadAttention's `xavier_uniform_` drew 0.8 s of a fresh process's load). Not thread-safe: it swaps
    module attributes for the duration.
    """
    import importlib

    def keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor

    originals = {n: getattr(torch.nn.init, n) for n in _RANDOM_INITS}
    holders = [torch.nn.init, *(importlib.import_module(m) for m in _INIT_IMPORTERS)]
    saved = [(mod, n, getattr(mod, n)) for mod in holders for n in _RANDOM_INITS
             if getattr(mod, n, None) is originals[n]]
    try:
        for mod, n, _ in saved:
            setattr(mod, n, keep)
        yield
    finally:
        for mod, n, f in saved:
            setattr(mod, n, f)


def hf_tokenizer_source(model_name: str) -> str | None:
    """The Hugging Face tokenizer open_clip builds for `model_name` (`text_cfg.hf_tokenizer_name`; for `local-dir:`
    open_clip reads its files from the directory itself), or None for open_clip's own tokenizer.

    >>> hf_tokenizer_source("ViT-B-16-SigLIP"), hf_tokenizer_source("ViT-B-16")
    ('timm/ViT-B-16-SigLIP', None)
    """
    import open_clip

    if model_name.startswith(LOCAL_DIR):
        text_cfg = _local_dir_config(Path(model_name[len(LOCAL_DIR):])).get("model_cfg", {}).get("text_cfg", {})
    else:
        text_cfg = (open_clip.get_model_config(model_name) or {}).get("text_cfg", {})
    return text_cfg.get("hf_tokenizer_name") or None


def build_tokenizer(model_name: str) -> "LazyTokenizer":
    """open_clip's tokenizer for `model_name`: lazy for open_clip's own BPE; a Hugging Face tokenizer (SigLIP's) is
    built at once, so that missing files or a missing `transformers` fail before any image is read.

    Raises:
        ModelError: the Hugging Face tokenizer cannot be built (one line naming the package or the files).
    """
    tok = LazyTokenizer(model_name)
    source = hf_tokenizer_source(model_name)
    if source is None:
        return tok
    try:
        tok._get()
    except ImportError as e:
        raise ModelError(f"{model_name}: its tokenizer is Hugging Face's {source}, which needs a package that is "
                         f"not installed ({e}); pip install transformers sentencepiece") from None
    except (OSError, ValueError) as e:  # the hub client's errors for absent files are OSErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = (f"in {model_name[len(LOCAL_DIR):]}" if model_name.startswith(LOCAL_DIR) else
                 f"in the Hugging Face cache: download them once with network access (huggingface-cli download "
                 f"{source})")
        raise ModelError(f"{model_name}: cannot load its Hugging Face tokenizer {source} ({first}); its files "
                         f"(tokenizer.json, tokenizer_config.json, special_tokens_map.json, ...) must be {where}"
                         ) from None
    return tok


class LazyTokenizer:
    """open_clip's tokenizer for `model_name`, built on first use: a run whose text prototypes come from the text
    cache never tokenises, and building the BPE tables costs a fraction of a second per process."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._tok: Any = None

    def _get(self) -> Any:
        if self._tok is None:
            import open_clip
            self._tok = open_clip.get_tokenizer(self.model_name)
        return self._tok

    def __call__(self, texts: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._get()(texts, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._get(), name)


def file_digest(path: Path, _memo: dict[tuple[str, int, float], str] = {}) -> str:
    """sha256 of a file's bytes (hex), remembered per (path, size, modification time) for the process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime)
    if key not in _memo:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        _memo[key] = h.hexdigest()
    return _memo[key]


def _cached_tag_file(cfg: dict[str, Any]) -> tuple[str | None, list[str]]:
    """Find a pretrained tag's weights in the local caches without touching the network.

    Returns (path or None, the places looked at).
    """
    looked: list[str] = []
    hub = cfg.get("hf_hub", "")
    if hub:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover - open_clip pulls huggingface_hub in
            try_to_load_from_cache = None
        repo, filename = os.path.split(hub.rstrip("/")) if not hub.endswith("/") else (hub.rstrip("/"), "")
        names = [filename] if filename else ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
        try:
            from huggingface_hub.constants import HF_HUB_CACHE as hub_cache
        except ImportError:  # pragma: no cover
            hub_cache = "~/.cache/huggingface/hub"
        for name in names:
            looked.append(f"{hub_cache}/models--{repo.replace('/', '--')}/snapshots/*/{name}")
            if try_to_load_from_cache is not None:
                hit = try_to_load_from_cache(repo_id=repo, filename=name)
                if isinstance(hit, str) and os.path.isfile(hit):
                    return hit, looked
    url = cfg.get("url", "")
    if url:
        target = Path(os.path.expanduser("~/.cache/clip")) / os.path.basename(url)
        looked.append(str(target))
        if target.is_file():
            return str(target), looked
    return None, looked


def _local_dir_config(path: Path, flags: WeightFlags = MAIN_FLAGS) -> dict[str, Any]:
    cfg_path = path / "open_clip_config.json"
    if not path.is_dir():
        raise ModelError(f"{flags.pretrained}local-dir:{path}: no such directory")
    if not cfg_path.is_file():
        raise ModelError(f"{flags.pretrained}local-dir:{path}: {cfg_path.name} is missing (expected "
                         f"{cfg_path} and {path / LOCAL_DIR_WEIGHTS[0]})")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or "model_cfg" not in cfg:
        raise ModelError(f"{cfg_path}: expected a JSON object with a 'model_cfg' entry (open_clip's format)")
    return cfg


#: what decides whether two open_clip model configs describe the same architecture
_ARCH_KEYS = ("embed_dim", "vision_cfg", "text_cfg")


def _arch_diff(known: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Architecture fields where `cfg` differs from `known` (for the towers, only keys both configs spell out:
    a config may leave a field at open_clip's default)."""
    diff = []
    for key in _ARCH_KEYS:
        a, b = known.get(key), cfg.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diff += [f"{key}.{k}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
        elif a != b:
            diff.append(key)
    return diff


def local_dir_name(path: Path, backbone: str | None, flags: WeightFlags = MAIN_FLAGS) -> str:
    """The backbone name a `local-dir:` model is recorded under: the folder's model decides.

    Its `open_clip_config.json` names the model (`model_name`): a `backbone` must then equal it. Without a
    `model_name`, a `backbone` that is an open_clip architecture must have the folder's architecture (`embed_dim`,
    vision and text towers), and any other `backbone` names the model; with neither, the folder's name is used.

    Raises:
        ModelError: one line, a `backbone` that disagrees with the folder's model, or a bad folder.

    Example:
        >>> local_dir_name(Path("models/tiny"), None)  # doctest: +SKIP
        'tiny-clip'
    """
    cfg = _local_dir_config(path, flags)
    own = cfg.get("model_name")
    if backbone is None or backbone == own:
        return str(own or path.resolve().name)
    where = f"{flags.pretrained}local-dir:{path}"
    bb = flags.backbone
    if own:
        raise ModelError(f"{bb}{backbone} disagrees with {where}, which holds {own} (model_name in its "
                         f"open_clip_config.json); drop {bb.strip()} or pass {bb}{own}")
    import open_clip

    known = open_clip.get_model_config(backbone)
    diff = _arch_diff(known, cfg["model_cfg"]) if known else []
    if diff:
        raise ModelError(f"{bb}{backbone} is not the model in {where}: its open_clip_config.json differs "
                         f"from open_clip's {backbone} in {', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''}; "
                         f"drop {bb.strip()} (the folder's name {path.resolve().name!r} is recorded) or set "
                         "model_name in the config")
    return backbone


def architecture_facts(backbone: str, pretrained: str) -> dict[str, int]:
    """What a method config's ranges may depend on, read from the architecture's config without building the model
    (`extract.methods.base.Ref` with `of_model=True`): {"vision_blocks": N} for a ViT image tower of N blocks.

    The config is open_clip's for a named architecture, or the `open_clip_config.json` of a `local-dir:` folder; a
    tower whose config gives no block count (ResNet, timm) yields {} (the method checks on the loaded model).

    Example:
        >>> architecture_facts("ViT-B-16", "openai")  # doctest: +SKIP
        {'vision_blocks': 12}
    """
    layers = (architecture_config(backbone, pretrained).get("vision_cfg") or {}).get("layers")
    return {"vision_blocks": layers} if isinstance(layers, int) and not isinstance(layers, bool) else {}


def architecture_config(backbone: str, pretrained: str) -> dict[str, Any]:
    """The architecture's open_clip model config (`embed_dim`, `vision_cfg`, `text_cfg`, ...): open_clip's for a
    named architecture, or the `open_clip_config.json` of a `local-dir:` folder; {} for a name open_clip does not
    know. Raises ModelError for a `local-dir:` folder without a readable config."""
    if pretrained.startswith(LOCAL_DIR):
        return _local_dir_config(Path(pretrained[len(LOCAL_DIR):]).expanduser()).get("model_cfg", {})
    import open_clip

    return open_clip.get_model_config(backbone) or {}


#: the kinds of image tower a method declares it runs on (`extract.methods.base.Towers`), as `tower_kinds` reads them
#: from an architecture's config (docs/methods.md, "Which backbones a method runs on")
IMAGE_TOWERS: dict[str, str] = {
    "vit": "a ViT pooled at its class token (CLIP's ViTs)",
    "vit-pooled": "a ViT pooled otherwise (CoCa's attention pool, CLIPA's average)",
    "resnet": "a ResNet (CLIP's ModifiedResNet)",
    "timm": "a timm model (SigLIP's ViTs)",
}
#: the kinds of text tower, likewise
TEXT_TOWERS: dict[str, str] = {
    "clip": "CLIP's causal tower pooled at its end-of-text token",
    "open_clip": "another open_clip text transformer (SigLIP's bidirectional one)",
    "other": "one no prompt can be learned in (a Hugging Face tower, or CoCa's with a class token)",
}
#: a ResNet image tower's last stage is its input size / 32 (open_clip's ModifiedResNet: stem /4, then 3 strides of 2)
RESNET_STRIDE = 32


@dataclass(frozen=True)
class TowerKinds:
    """What an architecture's towers are, read from its config before any weight (`tower_kinds`).

    Attributes:
        image: a key of `IMAGE_TOWERS`; text: a key of `TEXT_TOWERS`; None where the config is unknown.
        last_stage: a ResNet's last feature map side at its input size (RN50 at 224 px: 7), else None.
    """

    image: str | None = None
    text: str | None = None
    last_stage: int | None = None


def tower_kinds(backbone: str, pretrained: str) -> TowerKinds:
    """`classify_towers` of the architecture's config (`architecture_config`: open_clip's for a named architecture,
    the folder's for `local-dir:`); every field None for a name open_clip does not know.

    Example:
        >>> tower_kinds("RN50", "openai")  # doctest: +SKIP
        TowerKinds(image='resnet', text='clip', last_stage=7)
    """
    return classify_towers(architecture_config(backbone, pretrained))


def classify_towers(cfg: dict[str, Any]) -> TowerKinds:
    """The towers open_clip's `create_model` builds from model config `cfg` (what `tower_kinds` reads).

    Image: `timm_model_name` -> "timm"; `layers` a list (stage depths) -> "resnet"; a ViT with an attention pool,
    a pool type other than its class token, or its LayerNorm after pooling -> "vit-pooled"; else "vit". Text: a
    Hugging Face tower, a class token, or a pool type the prompt learner does not read (`extract.text_encoder`)
    -> "other"; open_clip's `CLIP` (no `custom_text`) with a causal tower pooled at the end-of-text token (argmax)
    -> "clip"; any other open_clip text transformer -> "open_clip".
    """
    from extract.text_encoder import POOL_TYPES

    if not cfg:
        return TowerKinds()
    v, t = cfg.get("vision_cfg") or {}, cfg.get("text_cfg") or {}
    last_stage = None
    if v.get("timm_model_name"):
        image = "timm"
    elif isinstance(v.get("layers"), (list, tuple)):
        size = v.get("image_size", 224)
        image, last_stage = "resnet", int(size[0] if isinstance(size, (list, tuple)) else size) // RESNET_STRIDE
    elif v.get("attentional_pool") or v.get("pool_type", "tok") != "tok" or v.get("final_ln_after_pool"):
        image = "vit-pooled"
    else:
        image = "vit"
    pool = t.get("pool_type", "argmax")
    if t.get("hf_model_name") or t.get("embed_cls") or pool not in POOL_TYPES:
        text = "other"
    elif not cfg.get("custom_text") and not t.get("no_causal_mask") and pool == "argmax":
        text = "clip"
    else:
        text = "open_clip"
    return TowerKinds(image, text, last_stage)


@contextlib.contextmanager
def _without_random_init_warning() -> Iterator[None]:
    """Hide open_clip's "Model initialized randomly" warning while a model is built to receive weights loaded
    separately (TorchScript archives): the weights are loaded, the warning would say the opposite."""
    import logging

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "initialized randomly" not in record.getMessage()

    root = logging.getLogger()
    drop = _Drop()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def checkpoint_shapes(path: Path, state: dict[str, torch.Tensor] | None = None) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a checkpoint file (safetensors header, or a weights-only memory-mapped state dict),
    with open_clip's `state_dict` wrapper and `module.` prefixes removed; {} when unreadable."""
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        if state is not None:
            sd: Any = state
        elif path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), framework="pt") as fh:
                return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
            sd = sd["state_dict"]
        for k, v in (sd.items() if isinstance(sd, dict) else ()):
            if isinstance(v, torch.Tensor):
                shapes[k[len("module."):] if k.startswith("module.") else k] = tuple(v.shape)
    except Exception:  # a best-effort hint for an error message: any failure means "no hint"
        return {}
    return shapes


def guess_architectures(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """open_clip model names whose vision tower matches a checkpoint's shapes (width, layers, patch size for a ViT;
    stage depths and width for a ResNet), e.g. `["ViT-B-16", ...]`; [] when nothing matches."""
    import open_clip
    from open_clip.factory import _MODEL_CONFIGS

    conv1 = shapes.get("visual.conv1.weight")
    want: dict[str, Any]
    if conv1 is not None and len(conv1) == 4 and "visual.class_embedding" in shapes:
        n_layers = len({k.split(".")[3] for k in shapes if k.startswith("visual.transformer.resblocks.")})
        want = {"width": conv1[0], "layers": n_layers, "patch_size": conv1[-1]}
    elif "visual.layer1.0.conv1.weight" in shapes:
        depth = tuple(len({k.split(".")[2] for k in shapes if k.startswith(f"visual.layer{i}.")}) for i in range(1, 5))
        want = {"layers": list(depth), "width": shapes["visual.conv1.weight"][0] * 2}
    else:
        return []
    names = []
    for name in open_clip.list_models():
        vc = _MODEL_CONFIGS.get(name, {}).get("vision_cfg", {})
        if all((list(vc.get(k)) if isinstance(vc.get(k), (list, tuple)) else vc.get(k)) == v
               for k, v in want.items()):
            names.append(name)
    return names


def _state_dict_error(e: BaseException, name: str, pretrained: str, weights: Path | None,
                      state: dict[str, torch.Tensor] | None, flags: WeightFlags = MAIN_FLAGS) -> str:
    """One line for a checkpoint that does not fit the architecture: a few missing / unexpected / mismatched keys
    and the architectures the file looks like."""
    lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
    parts = []
    for ln in lines:
        head, _, rest = ln.partition(":")
        keys = [k.strip().strip('"') for k in rest.rstrip(". ").split(",") if k.strip()]
        if head.startswith("size mismatch"):
            if sum(p.startswith("size mismatch") for p in parts) < 2:
                parts.append(ln[:160])
        elif keys:
            parts.append(f"{head.strip()} ({len(keys)}): {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}")
    guess = guess_architectures(checkpoint_shapes(weights, state)) if weights is not None else []
    looks = (f"; the file looks like {', '.join(guess[:4])} (pass it as {flags.backbone.strip()})" if guess
             else "; the file does not match any open_clip architecture by its vision tower")
    detail = "; ".join(parts) or (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{pretrained} does not fit the architecture {name}: {detail}{looks}"


def load_model(
    backbone: str | None = None,
    pretrained: str = "openai",
    device: str | torch.device | None = None,
    *,
    quick_gelu: bool | None = None,
    precision: Precision | None = None,
    flags: WeightFlags = MAIN_FLAGS,
) -> LoadedModel:
    """Build an open_clip model and load its weights (offline-safe, weights-only).

    Args:
        backbone: open_clip model name (`ViT-B-16`, `RN50`, ...); None = `ViT-B-16`. With `local-dir:` the
            architecture and the recorded name come from the directory (`local_dir_name`: its config's
            `model_name`, else the directory's name); a `backbone` that disagrees is a ModelError.
        pretrained: a tag (`openai`), a checkpoint file, or `local-dir:DIR`.
        device: torch device; None = cuda if available.
        quick_gelu: None = automatic (see the module docstring).
        precision: "amp" (autocast fp16) or "fp32"; None = amp on CUDA, fp32 on CPU.
        flags: how the messages name the settings that chose the model (`WeightFlags`).

    Raises:
        ModelError: unknown backbone or tag, missing file, weights absent from the caches while the hub is offline.

    Example:
        >>> m = load_model("ViT-B-16", "openai")  # doctest: +SKIP
        >>> m.logit_scale  # doctest: +SKIP
        100.0
    """
    import open_clip  # noqa: F401  (a missing extra fails here, before any check)

    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if precision is None:
        precision = "amp" if dev.type == "cuda" else "fp32"
    if precision not in ("amp", "fp32"):
        raise ModelError(f"precision must be 'amp' or 'fp32', got {precision!r}")
    if pretrained.startswith(LOCAL_DIR):
        src = _local_dir_source(backbone, pretrained, quick_gelu, flags)
    else:
        src = _named_source(backbone, pretrained, quick_gelu, flags)
    assert src is not None
    # the weights file's digest (sha256, for the fingerprint) in a thread while the model is built and loaded:
    # hashlib leaves the GIL while it hashes, so the file's second read costs no wall time of its own
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        digest = pool.submit(file_digest, Path(src.weights_file)) if src.weights_file else None
        model = _build_model(src, pretrained, dev, flags).eval()
        weights_digest = [digest.result()] if digest is not None else []
    for p in model.parameters():
        p.requires_grad_(False)
    pre = _preprocess_of(model)
    tokenizer = build_tokenizer(src.create["model_name"])
    bias = getattr(model, "logit_bias", None)
    digest_parts = [*src.digest_parts, *weights_digest, src.arch if not src.arch.startswith(LOCAL_DIR) else "local-dir",
                    f"quick_gelu={src.quick_gelu}", f"precision={precision}", json.dumps(pre.__dict__, sort_keys=True)]
    fp = hashlib.sha256("\n".join(digest_parts).encode()).hexdigest()[:16]
    return LoadedModel(model=model, tokenizer=tokenizer, backbone=src.name, pretrained=pretrained, arch=src.arch,
                       quick_gelu=src.quick_gelu, preprocess=pre, logit_scale=float(model.logit_scale.exp().item()),
                       device=dev, precision=precision, fingerprint=fp, weights_file=src.weights_file,
                       logit_bias=0.0 if bias is None else float(bias.float().mean().item()))


def check_weights(backbone: str | None, pretrained: str, *, flags: WeightFlags = MAIN_FLAGS,
                  tag_weights: bool = True) -> None:
    """What `load_model` would refuse before it reads a weight: an unknown architecture or pretrained tag, a
    missing checkpoint file or `local-dir:` folder (or its config or weights file), a folder whose model disagrees
    with `backbone`, and (`tag_weights`) a tag's weights absent from this machine while the hub is offline. Reads
    and downloads no weights (with the hub online, absent weights are left for the run to download).
    `tag_weights=False` checks the names and files only: the weights of a tag may be cached where the run runs.

    Raises:
        ModelError: the line `load_model` would raise (`flags` names the settings).
    """
    import open_clip  # noqa: F401  (a missing extra fails here)

    if pretrained.startswith(LOCAL_DIR):
        ddir = Path(pretrained[len(LOCAL_DIR):]).expanduser()
        if not any((ddir / n).is_file() for n in LOCAL_DIR_WEIGHTS):
            _local_dir_config(ddir, flags)  # a missing folder or config first, as `load_model` reports them
            raise ModelError(f"{flags.pretrained}local-dir:{ddir}: no weights file; expected one of "
                             f"{', '.join(LOCAL_DIR_WEIGHTS)} next to open_clip_config.json")
        local_dir_name(ddir, backbone, flags)
    else:
        _named_source(backbone, pretrained, None, flags, fetch=False, tag_weights=tag_weights)


@dataclass
class _WeightSource:
    """Where a model's architecture and weights come from, resolved before anything is built."""

    name: str  # the backbone name the shards record
    arch: str  # open_clip model name, or `local-dir:DIR`
    quick_gelu: bool
    create: dict[str, Any]  # open_clip.create_model's model_name and pretrained
    weights_file: str | None
    digest_parts: list[str] = field(default_factory=list)  # what the model's fingerprint hashes, then the file's
    kwargs: dict[str, Any] = field(default_factory=dict)  # force_quick_gelu, force_preprocess_cfg


def _local_dir_source(backbone: str | None, pretrained: str, quick_gelu: bool | None,
                      flags: WeightFlags = MAIN_FLAGS) -> _WeightSource:
    """A `local-dir:DIR` folder: its config decides the architecture and (with `local_dir_name`) the name."""
    ddir = Path(pretrained[len(LOCAL_DIR):]).expanduser()
    cfg = _local_dir_config(ddir, flags)
    weights = next((ddir / n for n in LOCAL_DIR_WEIGHTS if (ddir / n).is_file()), None)
    if weights is None:
        raise ModelError(f"{flags.pretrained}local-dir:{ddir}: no weights file; expected one of "
                         f"{', '.join(LOCAL_DIR_WEIGHTS)} next to open_clip_config.json")
    name = local_dir_name(ddir, backbone, flags)
    arch = f"{LOCAL_DIR}{ddir}"
    kwargs: dict[str, Any] = {}
    qg = bool(cfg["model_cfg"].get("quick_gelu", False))
    if quick_gelu is not None and quick_gelu != qg:
        kwargs["force_quick_gelu"] = quick_gelu
        qg = quick_gelu
    return _WeightSource(name, arch, qg, dict(model_name=arch, pretrained=None), str(weights),
                         [json.dumps(cfg, sort_keys=True)], kwargs)


def _named_source(backbone: str | None, pretrained: str, quick_gelu: bool | None, flags: WeightFlags = MAIN_FLAGS,
                  *, fetch: bool = True, tag_weights: bool = True) -> _WeightSource | None:
    """An open_clip architecture with a checkpoint file or a pretrained tag (from the caches, else downloaded).
    `fetch=False` only checks (`check_weights`): nothing is downloaded or hashed, and None is returned;
    `tag_weights=False` then checks a tag's name, not where its weights are."""
    import open_clip
    from open_clip.pretrained import get_pretrained_cfg

    name = backbone or DEFAULT_BACKBONE
    if name not in open_clip.list_models():
        raise ModelError(f"unknown backbone {name!r}; open_clip models include: "
                         f"{', '.join(m for m in open_clip.list_models() if m in OPENAI_ARCHS)}, ... "
                         "(see open_clip.list_models())")
    looks_like_path = os.sep in pretrained or pretrained.endswith((".pt", ".pth", ".bin", ".safetensors"))
    fp = flags.pretrained
    if Path(pretrained).expanduser().is_dir() and (looks_like_path or not get_pretrained_cfg(name, pretrained)):
        raise ModelError(f"{fp}{pretrained} is a folder; for a folder holding open_clip_config.json "
                         f"and the weights pass {fp}local-dir:{pretrained}")
    if looks_like_path or Path(pretrained).is_file():
        path = Path(pretrained).expanduser()
        if not path.is_file():
            raise ModelError(f"checkpoint file {path} does not exist ({fp.strip()} takes a tag such as "
                             f"'openai', a checkpoint file, or local-dir:DIR)")
        qg = name in OPENAI_ARCHS if quick_gelu is None else quick_gelu
        weights_file, pre_force = str(path), None
    else:
        tag_cfg = get_pretrained_cfg(name, pretrained)
        if not tag_cfg or tag_weights:  # an unknown tag is refused there
            found = _tag_weights(name, pretrained, tag_cfg, flags, fetch=fetch)
        else:
            found = None
        if found is None:
            return None
        qg = bool(tag_cfg.get("quick_gelu", False)) if quick_gelu is None else quick_gelu
        weights_file = str(found)
        pre_force = {k: tag_cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if k in tag_cfg}
    if not fetch:
        return None
    kwargs: dict[str, Any] = {}
    if qg:
        kwargs["force_quick_gelu"] = True
    if pre_force:
        kwargs["force_preprocess_cfg"] = pre_force
    return _WeightSource(name, name, qg, dict(model_name=name, pretrained=weights_file), weights_file, [], kwargs)


def _tag_weights(name: str, pretrained: str, tag_cfg: dict[str, Any], flags: WeightFlags = MAIN_FLAGS, *,
                 fetch: bool = True) -> Any:
    """The weights file of a pretrained tag: from the caches, else downloaded unless the hub is offline or its
    host cannot be reached (one line each, naming where it looked). `fetch=False`: None instead of a download
    (the offline refusal stands)."""
    from open_clip.pretrained import list_pretrained_tags_by_model

    if not tag_cfg:
        tags = list_pretrained_tags_by_model(name)
        raise ModelError(f"unknown pretrained tag {pretrained!r} for {name}; available: "
                         f"{', '.join(tags) or '(none)'}; or pass a checkpoint file or local-dir:DIR")
    found, looked = _cached_tag_file(tag_cfg)
    if found is not None:
        return found
    fp = flags.pretrained
    if _hub_offline():
        raise ModelError(
            f"weights for {name}/{pretrained} are not on this machine and the hub is offline "
            f"(HF_HUB_OFFLINE=1); looked for: {'; '.join(looked)}. Provide them with {fp}"
            f"/path/to/checkpoint or {fp}local-dir:DIR, or download them once with network "
            f"access (unset HF_HUB_OFFLINE)")
    if not fetch:
        return None
    host = _unreachable_host(tag_cfg)
    if host is not None:
        raise ModelError(
            f"weights for {name}/{pretrained} are not on this machine and {host} cannot be reached; "
            f"looked for: {'; '.join(looked)}. Provide them with {fp}/path/to/checkpoint or "
            f"{fp}local-dir:DIR, or download them once on a machine with network access")
    from open_clip.pretrained import download_pretrained
    try:
        return download_pretrained(tag_cfg)
    except Exception as e:  # network errors come in many types
        raise ModelError(f"could not download weights for {name}/{pretrained}: {e}; looked for: "
                         f"{'; '.join(looked)}") from None


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def read_safetensors_into(model: torch.nn.Module, path: Path) -> bool:
    """Read a safetensors file straight into `model`'s parameters and buffers, in file order, when it holds exactly
    the model's state dict (every name, shape and dtype); True if it did, False (nothing to trust) otherwise.

    The bytes go from the file into the parameters (through one reused host buffer for a GPU's), the same bytes
    `load_state_dict` would copy from safetensors' memory map, whose page-by-page faults on both sides made a
    ViT-B-16's load about 4x a plain read of the file on a CPU. Layout: an 8-byte little-endian header length, a
    JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, then the data (little-endian, as here)."""
    import sys

    state = model.state_dict()
    try:
        with open(path, "rb", buffering=0) as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            if sys.byteorder != "little" or set(header) != set(state) or any(
                    list(info["shape"]) != list(state[k].shape) or not state[k].is_contiguous()
                    or _SAFETENSORS_DTYPES.get(info["dtype"]) != state[k].dtype for k, info in header.items()):
                return False
            staging = torch.empty(0, dtype=torch.uint8)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = info["data_offsets"]
                dst = state[name]
                if dst.device.type == "cpu":
                    target = dst.reshape(-1).view(torch.uint8)
                else:
                    staging = staging if staging.numel() >= end - begin else torch.empty(end - begin, dtype=torch.uint8)
                    target = staging[:end - begin]
                if target.numel() != end - begin:
                    return False
                fh.seek(8 + n + begin)
                if fh.readinto(memoryview(target.numpy()).cast("B")) != end - begin:
                    return False
                if dst.device.type != "cpu":
                    dst.copy_(target.view(dst.dtype).view(dst.shape))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable: open_clip's loader reports it
        return False
    return True


def _build_model(src: _WeightSource, pretrained: str, device: torch.device,
                 flags: WeightFlags = MAIN_FLAGS) -> torch.nn.Module:
    """open_clip.create_model with the source's weights on `device` (weights-only loading; TorchScript archives by
    their own loader); every loading failure is one ModelError line.

    open_clip moves the (uninitialised) model to `device` first. A safetensors file in the model's own layout is
    then read straight into its parameters (`read_safetensors_into`: one sequential read, at the disk's pace);
    any other file goes through open_clip's `load_checkpoint`, whose conversions it may need."""
    import open_clip

    create, name, weights_file = dict(src.create), src.name, src.weights_file
    jit_state = None
    if weights_file is not None and not pretrained.startswith(LOCAL_DIR) and is_torchscript(Path(weights_file)):
        # OpenAI's original archives (~/.cache/clip/ViT-B-16.pt) are TorchScript, which torch.load refuses with
        # weights_only=True; torch.jit.load reads them with TorchScript's own loader (TorchScript types only, no
        # Python pickle), and only the state dict is kept.
        jit_state = torchscript_state_dict(Path(weights_file))
        create = dict(model_name=create["model_name"], pretrained=None)
    from safetensors import SafetensorError
    try:
        # every parameter is overwritten by a strict load (require_pretrained, or the state dict below), so the
        # random initialisation is skipped: for ViT-B-16 it draws ~150M numbers, seconds of each process's start
        direct = jit_state is None and weights_file is not None and weights_file.endswith(".safetensors")
        quiet = _without_random_init_warning() if jit_state is not None or direct else contextlib.nullcontext()
        with quiet, skip_random_init():
            model = open_clip.create_model(**create, device=device, weights_only=True, load_weights=not direct,
                                           require_pretrained=jit_state is None and not direct, **src.kwargs)
        if direct and not read_safetensors_into(model, Path(weights_file)):  # type: ignore[arg-type]
            open_clip.load_checkpoint(model, weights_file, strict=True, weights_only=True)
        if jit_state is not None:
            # non-persistent buffers (attn_mask) are in a TorchScript state dict but not in the model's
            expected = set(model.state_dict())
            model.load_state_dict({k: v for k, v in jit_state.items() if k in expected}, strict=True)
    except SafetensorError as e:
        raise ModelError(f"{weights_file}: not a readable safetensors file (truncated or corrupt?): "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    except (RuntimeError, AssertionError) as e:
        # AssertionError: open_clip's resize helpers assert on mismatched widths
        if "Error(s) in loading state_dict" in str(e) or isinstance(e, AssertionError):
            raise ModelError(_state_dict_error(e, name, pretrained, Path(weights_file) if weights_file else None,
                                               jit_state, flags)) from None
        raise ModelError(f"cannot build {name} from {pretrained}: {str(e).splitlines()[0] if str(e) else e}") from None
    except (ValueError, KeyError, OSError, pickle.UnpicklingError) as e:
        # UnpicklingError: a .pt holding Python objects beyond tensors, refused by weights_only loading
        raise ModelError(f"cannot build {name} from {pretrained}: {str(e).splitlines()[0] if str(e) else e}") from None
    return model


def _preprocess_of(model: torch.nn.Module) -> Preprocess:
    """The model's own image preprocessing (size, mean, std, interpolation, resize mode) from open_clip."""
    import open_clip

    pcfg = open_clip.get_model_preprocess_cfg(model)
    size = pcfg.get("size", 224)
    size = (int(size), int(size)) if isinstance(size, (int, float)) else (int(size[0]), int(size[1]))
    return Preprocess(size=size, mean=tuple(float(x) for x in pcfg["mean"]),
                      std=tuple(float(x) for x in pcfg["std"]),
                      interpolation=str(pcfg.get("interpolation", "bicubic")),
                      resize_mode=str(pcfg.get("resize_mode", "shortest")))
