"""CLIPArTT: test-time adaptation of CLIP's image encoder per batch with pseudo-labels from a batch text graph
(`dosowiechi/CLIPArTT @6f439ba`, `adapt.py`, `models/tent.py`, `configuration.py`;
docs/methods.md, "CLIPArTT: pseudo-labels from a batch text graph").

Per batch of 128 test images (model and Adam reset before each batch): 10 steps, each one pseudo-labelling every
image with its K = 3 most likely classes under the current encoder, encoding the prompt "a photo of a c1 or c2 or
c3" per image, and one Adam step (lr 1e-3) on CLIPArTT's text-graph loss: the soft targets softmax(((S_I + S_T)/2)
/0.01) over the batch's image-image and text-text similarities, the cross-entropy of each image's logits against
the batch's prompts. Tuned: the image encoder's LayerNorm affine parameters on a ViT; on a ResNet its BatchNorm
affine parameters, with batch statistics in every forward (the prediction's included). The prediction: the adapted
encoder against "a photo of a {class}".

Precision: as `clip.load` gives the model (extract/methods/norm_tuning.py): fp16 weights on CUDA (`weights_dtype`),
fp32 on the CPU; no autocast and no loss scale in the official code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from extract.methods.base import MethodConfig, check_hparams_key, setting, text_setting
from extract.methods.batch import BatchConfig
from extract.methods.norm_tuning import (TargetMethod, TunedBatchMethod, TunedCLIP, WeightsDtype, adam, step,
                                         text_graph_loss, tokenize)


@dataclass(frozen=True)
class CLIPArTTConfig(BatchConfig):
    """CLIPArTT's settings (`configuration.py` argparse defaults, `adapt.py`, `models/tent.py`)."""

    batch_size: int = setting(128, ge=1)  # `--batch-size` 128
    lr: float = setting(1e-3, ge=0)  # `setup_optimizer`: Adam lr=1e-3 (`--adapt-lr` is never read)
    steps: int = setting(10, ge=1)  # `--niter` 10 (`Tent` asserts steps > 0)
    # `--K` 3: classes per image prompt; above the number of classes every prompt names them all (with a note; the
    # official `topk` would stop)
    top_k: int = setting(3, ge=1)
    target_method: TargetMethod = 1  # `--target-method` 1: targets from (S_I + S_T) / 2
    beta1: float = setting(0.9, ge=0, lt=1)  # optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)  # Adam's default eps
    weight_decay: float = setting(0.0, ge=0)
    target_temperature: float = setting(0.01, gt=0)  # softmax(... / 0.01)
    # `f"a photo of a {c}"` for the classes, `getprompt`: "a photo of a " + c1 + " or " + c2 + ...
    template: str = text_setting("a photo of a {}", nonempty=True)
    joiner: str = text_setting(" or ")
    # "official": clip.load's fp16 weights on CUDA, fp32 on the CPU; "fp16" everywhere (the CUDA numerics on the
    # CPU, slowly); "fp32" everywhere
    weights_dtype: WeightsDtype = "official"


def top_k_prompts(probs: torch.Tensor, k: int, class_names: Sequence[str], template: str, joiner: str) -> list[str]:
    """`getprompt` per image: the template filled with its k most likely classes (most likely first) joined.

    Args:
        probs: (B, K) softmax of the pseudo-labelling logits.

    Example:
        >>> top_k_prompts(torch.tensor([[0.1, 0.6, 0.3]]), 2, ["cat", "dog", "car"], "a photo of a {}", " or ")
        ['a photo of a dog or car']
    """
    pred = probs.topk(k, 1, True, True)[1].tolist()
    return [template.format(joiner.join(class_names[c] for c in row)) for row in pred]


def clipartt_step(clip: TunedCLIP, opt: torch.optim.Optimizer, tokenizer: Any, images: torch.Tensor,
                  class_text: torch.Tensor, class_names: Sequence[str], cfg: CLIPArTTConfig, scale: float) -> None:
    """One `forward_and_adapt` (method "clipartt").

    Args:
        class_text: (K, D) L2-normalised texts of `cfg.template` per class; scale: the model's exp(logit_scale)
            where the official code writes 100.
    """
    with torch.no_grad():
        f = clip.image_features(images)
        probs = (scale * f @ class_text.T).softmax(dim=-1)
    prompts = top_k_prompts(probs, min(cfg.top_k, len(class_names)), class_names, cfg.template, cfg.joiner)
    text = clip.text_features(tokenize(tokenizer, prompts, images.device))  # (B, D)
    img = clip.image_features(images)
    logits = clip.logit_scale * text @ img.t()
    step(opt, text_graph_loss(logits, img, text, temperature=cfg.target_temperature,
                              target_method=cfg.target_method))


def clipartt_adapt(clip: TunedCLIP, tokenizer: Any, images: torch.Tensor, class_text: torch.Tensor,
                   class_names: Sequence[str], cfg: CLIPArTTConfig, scale: float) -> None:
    """`Tent.forward` with `episodic=True`: reset, a fresh Adam, `steps` steps on the batch."""
    clip.reset()
    opt = adam(clip.params, cfg.lr, (cfg.beta1, cfg.beta2), cfg.adam_eps, cfg.weight_decay)
    for _ in range(cfg.steps):
        clipartt_step(clip, opt, tokenizer, images, class_text, class_names, cfg, scale)


@torch.no_grad()
def clipartt_predict(clip: TunedCLIP, images: torch.Tensor, class_text: torch.Tensor, scale: float) -> torch.Tensor:
    """`adapt.py`'s evaluation: (B, K) s·F̂ T̂ᵀ with the adapted encoder, in the weights' dtype."""
    return scale * clip.image_features(images) @ class_text.T


class CLIPArTT(TunedBatchMethod):
    """CLIPArTT: per batch, norm-layer affine parameters tuned on pseudo-labels from the batch's text graph."""

    key: ClassVar[str] = "clipartt"
    # a row depends on the other images of its batch only (reset before each batch); batches are cut at fixed
    # stream positions, so the first batches of a longer run are these
    prefix_stable: ClassVar[bool] = True
    Config: ClassVar[type[MethodConfig]] = CLIPArTTConfig
    # Unseen data: every row is the same (no per-dataset setting)
    unseen_like: ClassVar[str] = "imagenet"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any
                 ) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        cfg: CLIPArTTConfig = self.config  # type: ignore[assignment]
        if cfg.top_k > self.n_classes:
            self.warnings.append(f"clipartt: top_k={cfg.top_k} exceeds the dataset's {self.n_classes} classes: each "
                                 f"image's prompt names all {self.n_classes}")
        self._class_text: torch.Tensor | None = None

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> CLIPArTTConfig:
        check_hparams_key(hparams_key)
        return CLIPArTTConfig()  # one setting for every set (argparse defaults)

    def prepare(self, clip: TunedCLIP) -> None:
        """The classes' texts of `template` (the pseudo-labels' and the prediction's)."""
        prompts = [self.config.template.format(c) for c in self.class_names]  # type: ignore[attr-defined]
        self._class_text = clip.text_features(tokenize(self.text_encoder.tokenizer, prompts, clip.logit_scale.device))

    def tune_and_predict(self, clip: TunedCLIP, images: torch.Tensor) -> torch.Tensor:
        clipartt_adapt(clip, self.text_encoder.tokenizer, images, self._class_text, self.class_names,
                       self.config, self.logit_scale)  # type: ignore[arg-type]
        return clipartt_predict(clip, images, self._class_text, self.logit_scale)  # type: ignore[arg-type]
