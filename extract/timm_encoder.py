"""A second, frozen image encoder from timm beside the CLIP policy (COSMIC's DINOv2), loaded from a folder the user
supplies and fed the policy's own preprocessed views.

The folder is timm's Hugging Face layout, as `huggingface-cli download timm/vit_large_patch14_reg4_dinov2.lvd142m
--local-dir DIR` writes it: `config.json` (the architecture and its arguments) and `model.safetensors`. It is built
with `timm.create_model("local-dir:DIR", pretrained=True, img_size=S)` for the policy's input size S: timm's
checkpoint filter converts Meta's DINOv2 layout and resamples the position embedding of its 37 x 37 grid to S/14
(bicubic, antialiased, by size: what DINOv2's own `interpolate_pos_encoding` does for its register models). The
feature of an image is the class token after the final norm (DINOv2's `x_norm_clstoken`), L2-normalised.

The encoder sees the views exactly as the policy does: COSMIC passes the CLIP-normalised tensor of its views to
DINOv2 (`clip/fix_clip.py` `get_image_features_aux`), so the preprocessing here is the policy's, whatever the timm
folder's own mean and std are.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from extract.models import AmpEncoding, ModelError, Precision, Preprocess, file_digest
from schemas.shard import error_line

#: the files a timm folder must hold (config, then weights: safetensors only)
TIMM_FOLDER_FILES: tuple[str, ...] = ("config.json", "model.safetensors")


@dataclass
class TimmEncoder(AmpEncoding):
    """A frozen timm image encoder with what the encoding pass reads (`extract.run.encode.encode_pass`).

    Attributes:
        model: the timm module in eval mode on `device`.
        folder: the folder it was loaded from; architecture: timm's name of it (`config.json`).
        preprocess: the policy's preprocessing (the encoder sees the policy's views).
        dim: feature width (`num_features`).
        device, precision: as the policy's ("amp": autocast fp16 on CUDA).
        fingerprint: sha256 of the weights' bytes, the config, the precision and the preprocessing (keys its feature
            cache).
    """

    model: torch.nn.Module
    folder: str
    architecture: str
    preprocess: Preprocess
    dim: int
    device: torch.device
    precision: Precision
    fingerprint: str

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) preprocessed images -> (N, dim) float32 L2-normalised class-token features on `device`."""
        with self._autocast():
            tokens = self.model.forward_features(images.to(self.device, non_blocking=True))
        cls = tokens[:, 0].float()
        return cls / cls.norm(dim=-1, keepdim=True)


def check_timm_folder(folder: str | Path) -> str | None:
    """What is wrong with a timm folder before anything is read (None: it looks complete)."""
    p = Path(folder).expanduser()
    if not p.is_dir():
        return "is a file, expected a folder" if p.exists() else "no such folder"
    lacking = [n for n in TIMM_FOLDER_FILES if not (p / n).is_file()]
    return f"the folder lacks {', '.join(lacking)}" if lacking else None


def load_timm_encoder(folder: str | Path, preprocess: Preprocess, device: torch.device,
                      precision: Precision) -> TimmEncoder:
    """Build the timm model of `folder` at the policy's input size and load its weights (safetensors only).

    Raises:
        ModelError: an incomplete folder, a config timm cannot build, or weights that do not fit it (one line).
    """
    import timm
    from safetensors import SafetensorError

    p = Path(folder).expanduser()
    problem = check_timm_folder(p)
    if problem is not None:
        raise ModelError(f"{p}: {problem}")
    try:
        config_text = (p / "config.json").read_text(encoding="utf-8")
        arch = str(json.loads(config_text)["architecture"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{p / 'config.json'}: not a timm config with an 'architecture' ({e})") from None
    if preprocess.size[0] != preprocess.size[1]:
        raise ModelError(f"the policy's input {preprocess.size} is not square")
    try:
        model = timm.create_model(f"local-dir:{p}", pretrained=True, img_size=int(preprocess.size[0]),
                                  num_classes=0)
    except SafetensorError as e:  # as `extract.models` says it of the policy's weights
        raise ModelError(f"{p / 'model.safetensors'}: not a readable safetensors file (truncated or corrupt?): "
                         f"{error_line(e)}") from None
    except (RuntimeError, ValueError, KeyError, TypeError, AssertionError, OSError) as e:
        raise ModelError(f"{p}: timm cannot build {arch} from it ({error_line(e)})") from None
    model = model.to(device).eval()
    for w in model.parameters():
        w.requires_grad_(False)
    parts = [file_digest(p / "model.safetensors"), config_text, f"precision={precision}",
             json.dumps(preprocess.__dict__, sort_keys=True), "timm-cls-token"]
    fp = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return TimmEncoder(model=model, folder=str(p), architecture=arch, preprocess=preprocess,
                       dim=int(model.num_features), device=device, precision=precision, fingerprint=fp)
