"""BATCLIP: bimodal online adaptation of CLIP's normalisation layers over batches of test images
(sarthaxxxxx/BATCLIP `classification/methods/ours.py`, `classification/utils/losses.py`,
`classification/models/model.py` `ZeroShotCLIP`, `classification/cfgs/imagenet_c/ours.yaml`; docs/methods.md,
"BATCLIP (`batclip`)").

Per batch of 64 test images (the adaptation carried across batches), under autocast, both encoders run: the image
features f_i (before normalisation) and the text features t_c of "a photo of a {class}." through the adapted text
encoder, z = s·f̂ t̂ᵀ, ŷ_i = argmax z_i. Outside autocast:

    loss = mean_i H(softmax z_i) − I2T − InterMean
    I2T = (1/|C|) Σ_{c∈C} f̄_c · t̂_c          f̄_c = mean of the f_i with ŷ_i = c, C = the predicted classes
    InterMean = Σ_{c≠c'∈C} (1 − ĝ_c · ĝ_c')      ĝ_c = f̄_c / ‖f̄_c‖

one scaled AdamW step (lr 5e-4, weight decay 0.01) on the weight and bias of every normalisation layer of both
encoders (ViT and text transformer LayerNorms, `ln_final`; RN50's BatchNorms on batch statistics). The batch's rows
are the logits of that forward, before the step (`forward_and_adapt` returns `logits.detach()`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

import torch
import torch.nn as nn

from extract.methods.base import MethodConfig, check_hparams_key, setting
from extract.methods.batch import batch_statistics_hint
from extract.methods.common import softmax_entropy
from extract.methods.normtta import NormConfig, NormTTA, Optimizer
from extract.prompts import SINGLE_TEMPLATE


@dataclass(frozen=True)
class BATCLIPConfig(NormConfig):
    """BATCLIP's settings: `classification/cfgs/imagenet_c/ours.yaml` (AdamW, lr 5e-4, BETA 0.9, WD 0.01, one
    step, batch 64, not episodic, fp32 weights, the text encoder adapted, "a photo of a {}."); its ImageNet-C row,
    the only ImageNet one, serves every dataset. `ours.py`: autocast and `GradScaler(init_scale=1000)`."""

    optimizer: Optimizer = "adamw"
    lr: float = setting(5e-4, ge=0)
    weight_decay: float = setting(0.01, ge=0)
    # forward_and_adapt returns the adapting forward's logits (no second forward)
    predict: Literal["after_update", "adapting_forward"] = "adapting_forward"


def i2t_loss(logits: torch.Tensor, img_feats: torch.Tensor, text_norm: torch.Tensor) -> torch.Tensor:
    """BATCLIP's `I2TLoss` (`utils/losses.py`): the mean over the predicted classes c (sorted) of f̄_c · t̂_c, f̄_c the
    mean image feature (before normalisation) of the samples predicted c."""
    labels = torch.argmax(logits.softmax(1), dim=1)
    classes = torch.unique(labels, sorted=True).tolist()
    loss: Any = 0.0
    for c in classes:
        mean = img_feats[labels == c].mean(0).type(text_norm.dtype)
        loss = loss + torch.matmul(mean.unsqueeze(0), text_norm[c].unsqueeze(0).t()).mean()
    return loss / len(classes)


def inter_mean_loss(logits: torch.Tensor, img_feats: torch.Tensor) -> torch.Tensor:
    """BATCLIP's `InterMeanLoss`: Σ over ordered pairs of distinct predicted classes of 1 − cos(f̄_c, f̄_c')."""
    labels = torch.argmax(logits.softmax(1), dim=1)
    means = []
    for c in torch.unique(labels, sorted=True).tolist():
        mean = img_feats[labels == c].mean(0)
        means.append(mean / mean.norm())
    stacked = torch.stack(means)
    loss = 1 - torch.matmul(stacked, stacked.t())
    return loss.fill_diagonal_(0).sum()


class BATCLIP(NormTTA):
    """BATCLIP: per batch, entropy minus the image-to-text and inter-class-mean terms, on both encoders' norm
    layers, online."""

    key: ClassVar[str] = "batclip"
    prefix_stable: ClassVar[bool] = True  # a batch's rows read that batch and the ones before it
    Config: ClassVar[type[MethodConfig]] = BATCLIPConfig
    # Unseen data: BATCLIP has one setting (its ImageNet-C row) for every set
    unseen_like: ClassVar[str] = "dtd"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder, class_names=class_names)
        tokenizer = getattr(text_encoder, "tokenizer", None)
        if class_names is None or tokenizer is None:
            raise ValueError("batclip adapts the text encoder too: it needs the class names and the loaded model "
                             "with its tokenizer (text_encoder=..., class_names=...)")
        if len(class_names) != self.n_classes:
            raise ValueError(f"batclip: {len(class_names)} class names for {self.n_classes} prototypes")
        # "a photo of a {}." per class (cfg PROMPT_TEMPLATE), tokenized once
        self.tokens = tokenizer([SINGLE_TEMPLATE.format(c) for c in class_names]).to(self.device)

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> BATCLIPConfig:
        check_hparams_key(hparams_key)
        return BATCLIPConfig()

    def adapted_copy(self, model: nn.Module) -> nn.Module:
        return copy.deepcopy(model)  # both encoders adapt

    @property
    def visual(self) -> nn.Module:
        return self.encoder.visual

    def bimodal(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`ZeroShotCLIP.forward(return_features=True)` with the text encoder adapted: (logits (N, K), image
        features before normalisation (N, D), normalised text features (K, D))."""
        with batch_statistics_hint(self.key, images.shape[0]):
            img_pre = self.visual(images)
        img = img_pre / img_pre.norm(dim=1, keepdim=True)
        text_pre = self.encoder.encode_text(self.tokens)
        text = text_pre / text_pre.norm(dim=1, keepdim=True)
        return self.logit_scale * img @ text.T, img_pre, text

    def batch_logits(self, images: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """The logits a prediction uses (`predict`): both encoders' (`bimodal`; no Panda on BATCLIP)."""
        return self.bimodal(images)[0]

    def adapt_step(self, images: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """`ours.py:forward_and_adapt`: the forward under autocast, the loss outside it, one scaled step; returns
        the logits, detached."""
        with self._autocast():
            logits, img_pre, text = self.bimodal(images)
        loss = softmax_entropy(logits).mean(0)
        loss = loss - i2t_loss(logits, img_pre, text)
        loss = loss - inter_mean_loss(logits, img_pre)
        self.scaled_step(loss)
        return logits.detach()
