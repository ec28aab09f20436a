"""SAR on CLIP: sharpness-aware, reliable entropy minimisation of the image encoder's normalisation layers over
batches, with model recovery (TTABC `ttabc/model_selection/sar.py`; BATCLIP's port `classification/methods/sar.py`;
the original mr-eggplant/SAR `sar.py`, `sam.py`; docs/methods.md, "SAR (`sar`)").

Per batch (the stream cut into batches of 64, the adaptation carried across them), with the margin
E₀ = 0.4 · ln K:

1. under autocast the batch's logits; H = softmax entropy (outside autocast); the samples with H < E₀ give
   loss₁ = mean H; backward; SAM's first step: every trained parameter moves by ρ·g/‖g‖ (ρ 0.05);
2. the logits again at the moved parameters; of the samples kept in 1, those with H < E₀ give loss₂; backward;
   SAM's second step: the parameters go back and SGD (lr 5e-3, momentum 0.9) steps with loss₂'s gradient;
3. ema ← 0.9·ema + 0.1·loss₂ (loss₂ not NaN); ema < 0.2 resets the trained parameters and SAM (model recovery).

The rows are a forward of the updated encoder (`predict`). What trains: the normalisation layers of the image
encoder, except those the official rule skips by name: `layer4` (RN50's last stage), `blocks.9`, `blocks.10`,
`blocks.11` (the last three blocks of ViT-B/16), names containing `norm.` or equal to `norm`. No loss scaler (the
official loop calls `backward` on the autocast loss directly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch
import torch.nn as nn

from extract.methods.base import MethodConfig, check_hparams_key, setting
from extract.methods.common import softmax_entropy
from extract.methods.normtta import NormConfig, NormTTA, Optimizer
from extract.methods.panda import PandaFields


def official_skip(name: str) -> bool:
    """SAR's and DeYO's rule on a module name (`configure_trainable_parameters`, the original `collect_params`):
    "skip top layers for adaptation: layer4 for ResNets and blocks9-11 for Vit-Base", read literally on open_clip's
    names (`transformer.resblocks.9.ln_1` contains `blocks.9`; a deeper ViT still skips blocks 9-11 only)."""
    return ("layer4" in name or "blocks.9" in name or "blocks.10" in name or "blocks.11" in name
            or "norm." in name or name == "norm")


class SAM:
    """Sharpness-aware minimisation around SGD, as SAR ships it (davda54/sam: TTABC `sar.py` `SAM`, mr-eggplant/SAR
    `sam.py`; `adaptive` False, its default).

    `first_step` saves every parameter with a gradient and moves it by ρ·g/(‖g‖ + 1e-12) (‖g‖ the norm of the
    per-parameter gradient norms); `second_step` puts them back and takes the SGD step with the gradient found
    there. The SGD momentum lives in `base` (what `state_dict` saves); a model recovery clears SAM's saved
    parameters but keeps `base`'s momentum, as `SAM.load_state_dict` of the initial state does officially.
    """

    def __init__(self, params: Sequence[nn.Parameter], *, lr: float, momentum: float, rho: float) -> None:
        self.params, self.rho = list(params), rho
        self.base = torch.optim.SGD(self.params, lr=lr, momentum=momentum)
        self.old: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        self.base.zero_grad()

    @torch.no_grad()
    def first_step(self) -> None:
        with_grad = [p for p in self.params if p.grad is not None]
        device = self.params[0].device
        norm = torch.norm(torch.stack([p.grad.norm(p=2).to(device) for p in with_grad]), p=2)
        scale = self.rho / (norm + 1e-12)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            self.old[i] = p.data.clone()
            p.add_(1.0 * p.grad * scale.to(p))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is not None and self.old[i] is not None:
                p.data = self.old[i]  # type: ignore[assignment]
        self.base.step()
        self.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict(state)


@dataclass(frozen=True)
class SARConfig(PandaFields, NormConfig):
    """SAR's settings: TTABC `ttabc/configs/algorithms.py` "sar" (batch 64, `sar_margin_e0` 0.4,
    `reset_constant_em` 0.2), `sar.py` `set_optimizer` (SAM around SGD, momentum 0.9, the run's lr: `main.py`
    `--lr 5e-3`; no weight decay); SAM's ρ 0.05 (its default). `amp`: the forwards under autocast, no scaler."""

    # SAM(params, torch.optim.SGD, lr=args.lr, momentum=0.9): SGD inside SAM, no weight decay, no Nesterov
    optimizer: Optimizer = field(default="sgd", metadata={"fixed": True})
    weight_decay: float = field(default=0.0, metadata={"fixed": True})
    nesterov: bool = field(default=False, metadata={"fixed": True})
    margin_e0: float = setting(0.4, ge=0)  # E₀ = 0.4 · ln K ("remember to multiply math.log(num_classes)")
    reset_constant_em: float = setting(0.2, ge=0)  # model recovery when ema < 0.2
    rho: float = setting(0.05, ge=0)  # SAM(rho=0.05)
    ema_alpha: float = setting(0.9, ge=0, le=1)  # update_ema(alpha=0.9)


class SAR(NormTTA):
    """SAR: per batch, a SAM step on the reliable samples' entropy, EMA-triggered model recovery, online."""

    key: ClassVar[str] = "sar"
    prefix_stable: ClassVar[bool] = True  # a batch's rows read that batch and the ones before it
    Config: ClassVar[type[MethodConfig]] = SARConfig
    _state_fields: ClassVar[tuple[str, ...]] = ("steps_done", "skipped_steps", "ema", "recoveries")
    loss_scaling: ClassVar[bool] = False  # `loss1.backward()` on the autocast loss: no GradScaler
    # Unseen data: SAR has one setting for every set
    unseen_like: ClassVar[str] = "dtd"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any
                 ) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.ema: float | None = None
        self.recoveries = 0

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> SARConfig:
        check_hparams_key(hparams_key)
        return SARConfig()

    def trains(self, name: str) -> bool:
        return not official_skip(name)

    def make_optimizer(self, params: Sequence[nn.Parameter]) -> Any:
        cfg: SARConfig = self.config  # type: ignore[assignment]
        return SAM(params, lr=cfg.lr, momentum=cfg.momentum, rho=cfg.rho)

    def adapt_step(self, images: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """TTABC `sar.py:test_time_tuning` for one step: returns the first forward's logits, detached."""
        cfg: SARConfig = self.config  # type: ignore[assignment]
        with self._autocast():
            logits1 = self.batch_logits(images, gen)
        margin = cfg.margin_e0 * math.log(logits1.shape[1])
        entropies1 = softmax_entropy(logits1)
        keep1 = torch.where(entropies1 < margin)
        entropies1[keep1].mean(0).backward()
        self.optimizer.first_step()
        with self._autocast():
            logits2 = self.batch_logits(images, gen)
        entropies2 = softmax_entropy(logits2)[keep1]
        loss2 = entropies2[torch.where(entropies2 < margin)].mean(0)
        if not loss2.isnan().item():
            value = loss2.item()
            self.ema = value if self.ema is None else cfg.ema_alpha * self.ema + (1 - cfg.ema_alpha) * value
        loss2.backward()
        self.optimizer.second_step()
        self.steps_done += 1
        if self.ema is not None and self.ema < cfg.reset_constant_em:
            self.recover()
        return logits1.detach()

    def recover(self) -> None:
        """Model recovery (TTABC `sar.py:reset`): the trained parameters back to the loaded model's, SAM's saved
        parameters dropped (its SGD momentum kept: see `SAM`), ema forgotten."""
        self.load_params(self.initial)
        self.optimizer.old = [None] * len(self.params)
        self.ema = None
        self.recoveries += 1

    def summary(self) -> dict[str, Any]:
        """Steps taken, model recoveries, the entropy EMA now."""
        return {"steps": int(self.steps_done), "recoveries": int(self.recoveries),
                "ema": None if self.ema is None else float(self.ema)}
