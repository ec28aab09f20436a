"""Adapting the normalisation layers of CLIP's image encoder over batches of test images: the core Tent, SAR, DeYO
and BATCLIP share (docs/methods.md, "The run: batches of pixels").

The method adapts a copy of the run's image encoder (`copy.deepcopy(model.visual)`; the loaded model, which the
zero-shot rows and the feature cache read, is never changed). On that copy, as the CLIP ports configure it (TTABC
`ttabc/model_selection/tent.py` `configure_model`, BATCLIP `classification/methods/tent.py`):

- every BatchNorm2d (RN50's) normalises with the statistics of the batch it sees, in every forward, adaptation and
  prediction alike (`track_running_stats = False`, running mean and variance dropped), and BatchNorm1d runs in
  train mode; LayerNorm (ViT's) and GroupNorm have no statistics to change;
- the affine parameters (weight and bias) of the normalisation layers a method selects (`trains`) are the only
  parameters that train; every other parameter is frozen.

Logits are those of TTABC's `ClipTestTimeTuningNorm.forward` (`clip/custom_clip.py`): z = s · f̂ T̂ᵀ with f̂ the
L2-normalised image feature (f / ‖f‖), s the model's logit scale and T̂ the run's prototypes of "a photo of a {}.".
TTABC re-encodes those prompts with the frozen text encoder in every forward; they are the same prototypes up to
fp16 rounding, encoded once here.

Precision (`amp`, CUDA only): the forwards run under fp16 autocast with fp32 weights, the loss goes through a
`torch.amp.GradScaler(init_scale=1000)` created once per run (TTABC `base_method.py`), which skips a step whose
gradient is not finite and halves its scale; on the CPU everything is fp32 and unscaled, the official loop without
autocast and scaler.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Literal, Sequence

import torch
import torch.nn as nn

from extract.methods.batch import BatchConfig, PixelBatchMethod, batch_statistics_hint
from extract.methods.base import MethodConfig, setting
from extract.methods.common import softmax_entropy
from extract.methods.panda import batch_generator, negative_images

Optimizer = Literal["adamw", "adam", "sgd"]


@dataclass(frozen=True)
class NormConfig(BatchConfig):
    """The settings every normalisation-layer method shares; defaults: TTABC (`ttabc/configs/algorithms.py`
    `batch_size` 64 and `optimizer`; `main.py` `--lr 5e-3`, `--tta_steps 1`; `ttabc/utils/tools.py`
    `build_optimizer`: weight decay 1e-4, betas (0.9, 0.999), SGD momentum 0.9)."""

    steps: int = setting(1, ge=0)  # --tta_steps 1 (0: no adaptation, as the official `if tta_steps > 0`)
    optimizer: Optimizer = "adamw"
    lr: float = setting(5e-3, ge=0)
    weight_decay: float = setting(1e-4, ge=0)  # build_optimizer: getattr(args, "weight_decay", 1e-4)
    beta1: float = setting(0.9, ge=0, lt=1)
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)  # torch default
    momentum: float = setting(0.9, ge=0)  # SGD only: build_optimizer's getattr(args, "momentum", 0.9)
    nesterov: bool = False  # SGD only (torch default)
    amp: bool = True  # fp16 autocast + GradScaler on CUDA; ignored on the CPU (fp32)
    grad_scale_init: float = setting(1000.0, gt=0)  # GradScaler(init_scale=1000)
    grad_scale_growth_interval: int = setting(2000, ge=1)  # GradScaler default
    # TTABC predicts with a second forward after the update (`test_time_adapt_eval`); the original Tent/SAR/DeYO
    # and BATCLIP's ports return the logits of the adapting forward, before the update
    predict: Literal["after_update", "adapting_forward"] = "after_update"


def open_clip_model(text_encoder: Any, key: str) -> nn.Module:
    """The open_clip model inside what the runner passes as `text_encoder` (a `LoadedModel`, or the bare model)."""
    model = getattr(text_encoder, "model", text_encoder)
    if not isinstance(model, nn.Module) or not hasattr(model, "visual"):
        raise ValueError(f"{key} adapts the image encoder: it needs the loaded model (text_encoder=...)")
    return model


def configure_norms(module: nn.Module, trains: Any) -> list[tuple[str, nn.Parameter]]:
    """Configure `module` (in place) as the official CLIP ports do and return the affine parameters that train.

    Every parameter is frozen and the module set to eval mode; every BatchNorm2d then normalises with batch
    statistics (running statistics dropped), every BatchNorm1d is put in train mode; the weight and bias of each
    normalisation layer (BatchNorm1d/2d, LayerNorm, GroupNorm) whose name passes `trains(name)` train.

    Returns:
        [(module name + ".weight" / ".bias", parameter)] in module order.
    """
    module.eval()
    module.requires_grad_(False)
    out = []
    for name, m in module.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
        elif isinstance(m, nn.BatchNorm1d):
            m.train()
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)) and trains(name):
            for pname, p in m.named_parameters(recurse=False):
                if pname in ("weight", "bias"):
                    p.requires_grad_(True)
                    out.append((f"{name}.{pname}", p))
    return out


def make_optimizer(cfg: NormConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimiser `cfg.optimizer` names, as TTABC's `build_optimizer` builds it (BATCLIP's `setup_optimizer`
    is the same with its own numbers)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               nesterov=cfg.nesterov)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)


def _cpu(value: Any) -> Any:
    """A copy of `value` with every tensor cloned to the CPU (a state that later steps cannot change)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


class NormTTA(PixelBatchMethod):
    """A copy of the image encoder whose normalisation layers adapt over batches. Subclasses set `Config`, choose
    the layers (`trains`) and implement the step (`adapt_step`, Tent's `entropy_step` by default) with `logits`
    and `scaled_step`, or the whole batch (`_adapt`)."""

    _state_fields: ClassVar[tuple[str, ...]] = ("steps_done", "skipped_steps")
    #: the official loop scales its loss (`GradScaler`) under `amp`; SAR's does not
    loss_scaling: ClassVar[bool] = True

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: NormConfig = self.config  # type: ignore[assignment]
        self.model = open_clip_model(text_encoder, self.key)
        self.encoder = self.adapted_copy(self.model)
        self.named_params = configure_norms(self.encoder, self.trains)
        if not self.named_params:
            raise ValueError(f"{self.key}: {backbone}'s image encoder has no normalisation layer to adapt")
        self.params = [p for _, p in self.named_params]
        self.optimizer = self.make_optimizer(self.params)
        self.device = self.params[0].device
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=cfg.grad_scale_init,
                                           growth_interval=cfg.grad_scale_growth_interval,
                                           enabled=self.loss_scaling and self._use_amp(self.device))
        # the values SAR's model recovery goes back to: the parameters as configured
        self.initial = [p.detach().clone() for p in self.params]
        self.steps_done = 0
        self.skipped_steps = 0

    # ------------------------------------------------------------------------------------------- what adapts

    def adapted_copy(self, model: nn.Module) -> nn.Module:
        """The module the method adapts: a copy of the image encoder (BATCLIP copies the whole model)."""
        return copy.deepcopy(model.visual)

    @property
    def visual(self) -> nn.Module:
        """The adapted image encoder."""
        return self.encoder

    def trains(self, name: str) -> bool:
        """Whether the normalisation layer `name` (a module name inside the adapted copy) trains: all of them."""
        return True

    def make_optimizer(self, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return make_optimizer(self.config, params)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------- numerics

    def _use_amp(self, device: torch.device) -> bool:
        return bool(self.config.amp) and device.type == "cuda"  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        """fp16 autocast where the run uses it (the official `torch.amp.autocast(device_type='cuda')`)."""
        if self._use_amp(self.device):
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                yield
        else:
            yield

    def text(self) -> torch.Tensor:
        """(K, D) prototypes in the encoder's dtype (float64 in exact tests), on its device."""
        dtype = self.params[0].dtype
        if self.text_features.dtype != dtype or self.text_features.device != self.device:
            self.text_features = self.text_features.to(self.device, dtype)
        return self.text_features

    def logits(self, images: torch.Tensor, text: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, 3, S, S) -> (logits (N, K), image features before normalisation (N, D)) through the adapted
        encoder: z = s · (f / ‖f‖) T̂ᵀ (`ClipTestTimeTuningNorm.forward`)."""
        with batch_statistics_hint(self.key, images.shape[0]):
            pre = self.visual(images)
        feats = pre / pre.norm(dim=-1, keepdim=True)
        return self.logit_scale * (feats @ (self.text() if text is None else text).t()), pre

    def batch_logits(self, images: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """The logits a step or a prediction uses: `logits`, or with Panda (`panda`, `gen` its draws; None: plain
        logits) the hedged z − β·mean of the logits of the batch's negative images through the same encoder (TTABC
        `panda.py` `panda_logits`; the negatives carry gradient too)."""
        logits, _ = self.logits(images)
        cfg: Any = self.config
        if not getattr(cfg, "panda", False) or gen is None:
            return logits
        negatives = negative_images(images, cfg.panda_patch_size, gen)
        if negatives is None:  # one image: no negative image exists
            return logits
        return logits - cfg.panda_beta * self.logits(negatives)[0].mean(0, keepdim=True)

    def generator(self) -> torch.Generator | None:
        """The batch's generator for Panda's negative images (None without Panda)."""
        cfg: Any = self.config
        return batch_generator(cfg.panda_seed, self.n_seen) if getattr(cfg, "panda", False) else None

    def scaled_step(self, loss: torch.Tensor) -> None:
        """`optimizer.zero_grad(); scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()`: the
        official step (a step the scaler skips, for a gradient that is not finite, is counted)."""
        before = self.scaler.get_scale()
        self.optimizer.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.steps_done += 1
        if self.scaler.is_enabled() and self.scaler.get_scale() < before:
            self.skipped_steps += 1

    def entropy_step(self, images: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """Tent's step (TTABC `tent.py:test_time_tuning`; with Panda `panda.py`): under autocast the batch's logits
        and the mean softmax entropy, then one scaled step. Returns the logits of that forward, detached."""
        with self._autocast():
            logits = self.batch_logits(images, gen)
            loss = softmax_entropy(logits).mean(0)
        self.scaled_step(loss)
        return logits.detach()

    def predict(self, images: torch.Tensor, adapting: torch.Tensor | None, gen: torch.Generator | None = None
                ) -> torch.Tensor:
        """The batch's rows: a forward of the updated encoder (`predict = "after_update"`, TTABC's inference pass
        under autocast; hedged with fresh negatives under Panda, `gen`) or the logits of the last adapting forward
        (`"adapting_forward"`; a forward when no step was taken)."""
        if adapting is not None and self.config.predict == "adapting_forward":  # type: ignore[attr-defined]
            return adapting
        with torch.no_grad(), self._autocast():
            return self.batch_logits(images, gen)

    def adapt_step(self, images: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """One adapting step on the batch (`gen`: Panda's draws, None without Panda); returns the logits of its
        forward, detached. Tent's `entropy_step`; SAR and BATCLIP take their own."""
        return self.entropy_step(images, gen)

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        """One batch: `steps` adapting steps on its pixels, then its rows (`predict`); the cached features are
        unused."""
        images = self.batch_images(view_feats.shape[0], self.device, self.params[0].dtype)
        gen = self.generator()  # Panda's draws for this batch (None without Panda)
        adapting = None
        for _ in range(self.config.steps):  # type: ignore[attr-defined]
            adapting = self.adapt_step(images, gen)
        return self.predict(images, adapting, gen)

    def load_params(self, values: Sequence[torch.Tensor]) -> None:
        """Copy `values` into the trained parameters (a loaded state, SAR's model recovery)."""
        with torch.no_grad():
            for p, v in zip(self.params, values):
                p.copy_(v)

    # ------------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The state after `n_seen` samples: the trained parameters, the optimiser's and the loss scaler's state,
        the method's counters (tensors on the CPU; loadable with `weights_only=True`)."""
        state = super().state_dict()
        state["params"] = [_cpu(p) for p in self.params]
        state["optimizer"] = _cpu(self.optimizer.state_dict())
        state["scaler"] = dict(self.scaler.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        missing = [k for k in ("params", "optimizer", "scaler") if k not in state]
        if missing:
            raise ValueError(f"{self.key} state lacks {', '.join(missing)}")
        values = state["params"]
        if len(values) != len(self.params) or any(v.shape != p.shape for v, p in zip(values, self.params)):
            raise ValueError(f"{self.key}: the saved parameters do not fit this model's normalisation layers")
        self.load_params(values)
        self.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])

    def summary(self) -> dict[str, Any]:
        """Steps taken, steps the loss scaler skipped (a gradient that was not finite), the loss scale now."""
        return {"steps": int(self.steps_done), "skipped_steps": int(self.skipped_steps),
                "loss_scale": float(self.scaler.get_scale())}
