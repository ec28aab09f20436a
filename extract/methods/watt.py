"""WATT: weight-average test-time adaptation of CLIP's image encoder, per batch (`Mehrdad-Noori/WATT @40e3fae`,
`adapt/watt.py`, `main.py`, `templates.yaml`, `bash/watt_{s,p}/*/*.sh`;
docs/methods.md, "WATT: weight averaging over text templates").

Per batch of 128 test images (everything reset before each batch): for each of the 8 templates of
`templates.yaml`, `l` = 2 Adam steps (lr 1e-4) on the LayerNorm affine parameters of the image encoder, each step
pseudo-labelling the batch with that template's class texts and minimising CLIPArTT's text-graph loss; the tuned
parameters of the 8 templates are averaged, and the whole repeats `m` = 5 times from the average (WATT-S,
`sequential`: the 8 templates one after another from the average; WATT-P, `parallel`: each template from the
average). The prediction is the averaged encoder's logits against the 8 templates' mean text features.

The official code has no ResNet path: a ResNet's image encoder has no LayerNorm, and `optim.Adam` refuses the empty
parameter list. `rn_batchnorm` (default on) adapts a ResNet's BatchNorm layers instead, as CLIPArTT does (batch
statistics, affine parameters tuned), WATT's code being "based on TENT and CLIPArTT"; off, a ResNet is refused in
one line.

Precision: as `clip.load` gives the model (extract/methods/norm_tuning.py): fp16 weights on CUDA (`weights_dtype`),
fp32 on the CPU; no autocast and no loss scale in the official code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Sequence

import torch

from extract.methods.base import MethodConfig, Towers, check_hparams_key, setting
from extract.methods.batch import BatchConfig
from extract.methods.norm_tuning import (TunedBatchMethod, TunedCLIP, WeightsDtype, adam, step, text_graph_loss,
                                         tokenize)

# templates.yaml, in its order (the first and second without a full stop, as written there)
WATT_TEMPLATES: tuple[str, ...] = (
    "a photo of a {}", "itap of a {}", "a bad photo of the {}.", "a origami {}.", "a photo of the large {}.",
    "a {} in a video game.", "art of the {}.", "a photo of the small {}.",
)

REFERENCE_TEMPLATE = "a photo of a {}"  # `adapt/watt.py` REFERENCE_TEMPLATE (the prediction's with `ref_eval`)


@dataclass(frozen=True)
class WATTConfig(BatchConfig):
    """WATT's settings (`main.py` argparse defaults, `adapt/watt.py`, the scripts `bash/watt_{s,p}/*/*.sh`)."""

    # BATCH_SIZE=128 in every script (`--batch-size` default 128)
    batch_size: int = setting(128, ge=1)
    # LR=1e-4 in the scripts of every natural-image set (OfficeHome, PACS, VLCS, VisDA) and `--lr`'s default;
    # 1e-3 only in the CIFAR scripts of WATT-S (docs/methods.md, "WATT: weight averaging over text templates")
    lr: float = setting(1e-4, ge=0)
    watt_type: Literal["sequential", "parallel"] = "sequential"  # `--watt_type` default (WATT-S)
    steps_per_template: int = setting(2, ge=0)  # `--watt_l` 2 (every script)
    rounds: int = setting(5, ge=1)  # `--watt_m` 5 (WATT-S scripts; WATT-P scripts: 50)
    beta1: float = setting(0.9, ge=0, lt=1)  # optim.Adam(..., betas=(0.9, 0.999), weight_decay=0.0)
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)  # Adam's default eps
    weight_decay: float = setting(0.0, ge=0)
    target_temperature: float = setting(0.01, gt=0)  # targets = softmax(((S_I + S_T) / 2) / 0.01)
    # `ref_eval` (predict from "a photo of a {}" alone) never reaches WATT: `adapt/__init__.py` does not pass it
    ref_eval: bool = False
    # "official": clip.load's fp16 weights on CUDA, fp32 on the CPU; "fp16" everywhere (the CUDA numerics on the
    # CPU, slowly); "fp32" everywhere
    weights_dtype: WeightsDtype = "official"
    # deviation: the official code cannot run a ResNet (no LayerNorm); True adapts its BatchNorms as CLIPArTT does
    rn_batchnorm: bool = True
    templates: tuple[str, ...] = field(default=WATT_TEMPLATES, metadata={"fixed": True})


def template_average(values: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """WATT's `weight_average`: per parameter, `sum(w_t for t in templates) / T`, summed left to right in template
    order (Python's `sum` from 0) and divided once.

    Args:
        values: T lists of the same parameters' values.

    Returns:
        One list: the averages.
    """
    out = []
    for i in range(len(values[0])):
        acc = values[0][i].clone()
        for v in values[1:]:
            acc = acc + v[i]
        out.append(acc / len(values))
    return out


def watt_step(clip: TunedCLIP, opt: torch.optim.Optimizer, images: torch.Tensor, text: torch.Tensor,
              scale: float, temperature: float) -> None:
    """One official step with one template's class texts (`perform_adaptation`, the body of `for l in ...`).

    Pseudo-labels: the top-1 of softmax(s·F̂ T̂ᵀ) under no gradient; their texts T̂_y (B, D); then the loss
    `text_graph_loss(s·T̂_y F̂ᵀ, F̂, T̂_y)` with F̂ re-encoded with gradient; Adam step.

    Args:
        text: (K, D) L2-normalised class texts of the template; scale: the model's exp(logit_scale) where the
            official code writes 100.
    """
    with torch.no_grad():
        f = clip.image_features(images)
        pred = (scale * f @ text.t()).softmax(1).topk(1, 1, True, True)[1]  # (B, 1)
    text_y = text[pred[:, 0]]  # `torch.cat([text_feat[c,] for c in pred])`
    img = clip.image_features(images)
    logits = clip.logit_scale * text_y @ img.t()  # the official forward: logit_scale * text @ image.t()
    step(opt, text_graph_loss(logits, img, text_y, temperature=temperature))


def watt_adapt(clip: TunedCLIP, images: torch.Tensor, text: torch.Tensor, cfg: WATTConfig, scale: float) -> None:
    """WATT's `perform_adaptation` on one batch, from the frozen parameters: leaves the last average loaded.

    Sequential: per round, from the frozen values (round 0) or the last average, the templates one after
    another, a snapshot after each; parallel: each template from the frozen values (round 0) or the last average.
    Adam starts fresh where the official code reloads its saved state (round 0: at the round's start, or at each
    template for parallel) and carries its moments on in later rounds.

    Args:
        images: (B, 3, S, S); text: (T, K, D) per-template L2-normalised class texts.
    """
    clip.reset()
    opt, avg = None, None
    for r in range(cfg.rounds):
        snaps = []
        for t in range(text.shape[0]):
            if t == 0 or cfg.watt_type == "parallel":
                if r == 0:
                    clip.reset()
                    opt = adam(clip.params, cfg.lr, (cfg.beta1, cfg.beta2), cfg.adam_eps, cfg.weight_decay)
                else:
                    clip.load(avg)
            for _ in range(cfg.steps_per_template):
                watt_step(clip, opt, images, text[t], scale, cfg.target_temperature)
            snaps.append(clip.snapshot())
        avg = template_average(snaps)
    clip.load(avg)


@torch.no_grad()
def watt_predict(clip: TunedCLIP, images: torch.Tensor, text: torch.Tensor, scale: float) -> torch.Tensor:
    """`evaluate`: (B, K) s·F̂ T̂ᵀ with the adapted encoder, in the weights' dtype.

    Args:
        text: (D, K) contiguous, the transposed mean of the templates' L2-normalised texts, re-normalised: the
            official layout (`torch.stack(..., dim=1)`), which decides the matmul kernel and so its last bits.
    """
    return scale * clip.image_features(images) @ text


@torch.no_grad()
def template_texts(clip: TunedCLIP, tokenizer: Any, class_names: Sequence[str],
                   templates: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """`extract_text_embeddings`, per class (one encoder call of its T prompts): (T, K, D) the L2-normalised
    texts, and (D, K) their mean per class re-normalised (stacked along dim 1, as the official code)."""
    dev = clip.logit_scale.device
    per_class = [clip.text_features(tokenize(tokenizer, [t.format(c) for t in templates], dev))
                 for c in class_names]  # each (T, D)
    mean = [e.mean(dim=0) for e in per_class]
    return torch.stack(per_class, dim=1), torch.stack([m / m.norm() for m in mean], dim=1)


def averaged_text_layernorms(clip: TunedCLIP, n_templates: int, rounds: int) -> list[tuple[torch.nn.Parameter,
                                                                                            torch.Tensor]]:
    """The values the text encoder's LayerNorm parameters have when the official `evaluate` runs.

    `perform_adaptation` averages every LayerNorm of the whole model over the templates, the text encoder's
    included, although they never change: each round replaces them with `sum` of T copies / T, which the
    floating-point sum can move by an ulp, and the last round's values are loaded for the prediction.

    Returns:
        (parameter, value after `rounds` such averages) for each text-side LayerNorm weight and bias.
    """
    visual = set(map(id, clip.model.visual.modules()))
    out = []
    for m in clip.model.modules():
        if isinstance(m, torch.nn.LayerNorm) and id(m) not in visual:
            for p in (m.weight, m.bias):
                v = p.detach()
                for _ in range(rounds):
                    v = template_average([[v]] * n_templates)[0]
                out.append((p, v))
    return out


class WATT(TunedBatchMethod):
    """WATT: per batch, LayerNorm (ViT) or BatchNorm (ResNet) affine parameters tuned per template and averaged."""

    key: ClassVar[str] = "watt"
    # a row depends on the other images of its batch only (reset before each batch); batches are cut at fixed
    # stream positions, so the first batches of a longer run are these
    prefix_stable: ClassVar[bool] = True
    Config: ClassVar[type[MethodConfig]] = WATTConfig
    # Unseen data: every row is the same (no per-dataset setting)
    unseen_like: ClassVar[str] = "imagenet"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any
                 ) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        if self.kind == "batchnorm" and not self.config.rn_batchnorm:  # type: ignore[attr-defined]
            raise ValueError(f"watt adapts the LayerNorms of the image encoder; {self.backbone}'s is a ResNet without "
                             f"any (the official code stops there); use a ViT backbone, or rn_batchnorm=true to adapt "
                             f"its BatchNorms as CLIPArTT does")
        self._texts: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        if config.rn_batchnorm:  # type: ignore[attr-defined]
            return super().towers(config)
        from extract.models import IMAGE_TOWERS

        return Towers(image=frozenset(IMAGE_TOWERS) - {"resnet"},
                      image_use="adapts the LayerNorms of the image encoder (rn_batchnorm=false: the official code has "
                                "no ResNet path; rn_batchnorm=true adapts a ResNet's BatchNorms as CLIPArTT does)")

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> WATTConfig:
        check_hparams_key(hparams_key)
        return WATTConfig()  # no script for these sets: the natural-image scripts' settings everywhere

    def prepare(self, clip: TunedCLIP) -> None:
        """The per-template class texts the steps read and the prediction's mean texts, the latter encoded with the
        text LayerNorms the official `evaluate` has (`averaged_text_layernorms`)."""
        cfg: WATTConfig = self.config  # type: ignore[assignment]
        tok = self.text_encoder.tokenizer
        per_template, _ = template_texts(clip, tok, self.class_names, cfg.templates)
        eval_templates = (REFERENCE_TEMPLATE,) if cfg.ref_eval else cfg.templates
        frozen = []
        for p, v in averaged_text_layernorms(clip, len(cfg.templates), cfg.rounds):
            frozen.append((p, p.detach().clone()))
            p.data.copy_(v)
        _, eval_text = template_texts(clip, tok, self.class_names, eval_templates)
        for p, v in frozen:
            p.data.copy_(v)
        self._texts = (per_template, eval_text)

    def tune_and_predict(self, clip: TunedCLIP, images: torch.Tensor) -> torch.Tensor:
        per_template, eval_text = self._texts  # type: ignore[misc]
        watt_adapt(clip, images, per_template, self.config, self.logit_scale)  # type: ignore[arg-type]
        return watt_predict(clip, images, eval_text, self.logit_scale)
