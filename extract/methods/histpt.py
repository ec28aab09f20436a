"""HisTPT: online prompt tuning with memory banks of past prompts (NeurIPS'24).

Spec: docs/methods.md, "HisTPT (`histpt`)".

The official repository (`jingyi0000/HisTPT`) holds only the authors' segmentation code (SEEM); the CLIP
classification version is TTABC's `ttabc/model_selection/histpt.py` (walawalagoose/TTABC, the reference here), with
its settings in `ttabc/configs/algorithms.py` ("histpt"), the optimiser in `ttabc/utils/load_model.py:set_optimizer`
and the model in `clip/custom_clip.py` (TPT's CoOp prompt learner).

State carried over the whole stream (never reset): the 4-token context ctx (initialised from "a photo of a", shared
by the classes, TPT's prompt "{ctx} {class}."), the SGD momentum buffer, the loss scale, and three memories of the
text features t(ctx) = L2-normalised class features of the prompts:

    local  L = 32 past text features (newest first) with the entropy of each sample
    hard   L = 32 past means of the 16 highest-entropy entries of `local` (newest first)
    global an exponential average: g ← 0.99·g + 0.01·½(mean(local) + mean(hard))

Per sample with views f_v (1 view by default: TTABC runs HisTPT with `tpt: False`, batch 1):

1. z_v = s·f_v·t(ctx)ᵀ (with gradient in ctx); with several views the int(V·0.1) of lowest entropy are kept.
2. Pseudo-label from the original view f_0: for each memory m ∈ (global, local, hard) the prompt
   t_m = m̄/‖m̄‖ (m̄ the memory's mean; the current t(ctx) while it is empty), p_m = softmax(s·f_0·t_mᵀ),
   H_m its entropy; weights w = softmax(−H_global, −H_local, −H_hard); q = Σ_m w_m p_m.
3. Loss = mean over the kept views of −Σ_k q_k log softmax(z_v)_k (soft-target cross-entropy); one SGD step
   (lr 5e-3, momentum 0.9, weight decay 1e-4) through the loss scale.
4. Memories: the entropy e = mean softmax entropy of the kept views' logits of the step; t' = t(ctx') after the step
   enters `local` (with e; the first sample fills all 32 slots), then `hard` (the first time a copy of `local`,
   after that the mean of the 16 entries of highest e), then `global` (the first time t', after that the average).
5. Prediction: s·f_0·t(ctx')ᵀ.

Numerics: fp32 context and weights, autocast (fp16) and one `GradScaler(init_scale=1000)` for the run on CUDA with
`amp` (TTABC `base_method.py`): a non-finite step is skipped (no SGD step, no momentum update) and halves the
scale; the memories take t(ctx') in fp32 outside autocast, as the official update runs outside it. The CPU runs
fp32 at scale 1. Samples are strictly sequential, so `adapt` runs them one at a time.

Where this differs from the reference (numerics only):
    * Ties of the hard-sample selection are broken by position (newest first, a stable sort), where CUDA's `topk`
      leaves them to the kernel; only entries equal in entropy tie, and the first sample's 32 copies are equal.
    * The unused "current" text features of step 2 are computed only while a memory is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from extract.methods.base import (
    IMAGENET_FAMILY,
    PROMPT_TUNING,
    MethodConfig,
    PromptSet,
    Ref,
    Towers,
    TTAMethod,
    check_hparams_key,
    setting,
    text_setting,
)
from extract.methods.common import n_confident, softmax_entropy
from extract.methods.tpt import MixedPrecision, prompt_encoder, unscaled_grads


def sgd_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, *, lr: float, momentum: float,
             weight_decay: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One `torch.optim.SGD` step (dampening 0, no Nesterov) in torch's order of operations.

    d = g + wd·p; b = d on the first step, else momentum·b + d; p ← p − lr·b (no buffer when momentum is 0).

    Returns:
        (new parameter, new momentum buffer or None).

    Example:
        >>> p, b = sgd_step(torch.tensor([1.0]), torch.tensor([2.0]), None, lr=0.5, momentum=0.9, weight_decay=0.0)
        >>> p.tolist(), b.tolist()
        ([0.0], [2.0])
    """
    d = grad.add(param, alpha=weight_decay) if weight_decay != 0 else grad
    if momentum != 0:
        buf = d.clone() if buf is None else buf.mul(momentum).add_(d)
        d = buf
    return param.add(d, alpha=-lr), buf


def fuse_pseudo_label(logits: torch.Tensor) -> torch.Tensor:
    """HisTPT's pseudo-label from the logits of its three memory prompts (TTABC `generate_pseudo_labels`).

    Args:
        logits: (3, K) logits of the original view under the global, local and hard prompts (in that order).

    Returns:
        (K,) w_0·p_0 + w_1·p_1 + w_2·p_2 with p_m = softmax(logits_m) and w = softmax(−H) over their entropies
        (summed in that order, as TTABC does).

    Example:
        >>> fuse_pseudo_label(torch.zeros(3, 4)).tolist()
        [0.25, 0.25, 0.25, 0.25]
    """
    probs = logits.softmax(-1)
    w = (-softmax_entropy(logits)).softmax(0)  # lower entropy, higher weight
    return w[0] * probs[0] + w[1] * probs[1] + w[2] * probs[2]


@dataclass(frozen=True)
class HisTPTConfig(MethodConfig):
    """HisTPT in TTABC (`ttabc/configs/algorithms.py` "histpt", `main.py`, `ttabc/utils/load_model.py`)."""

    # `tpt: False`, `batch_size: 1`: one image per step, the plain preprocess (`ttabc/utils/load_data.py`). With
    # 64 views (TTABC's `tpt: True`) the views are TPT's and the confident ones are kept (`selection_p`).
    n_views: int = 1
    augmix: bool = True  # with 64 views: `augmix=len(set_id) > 1` (TPT's rule), set per dataset
    # the prompts are the learnable "{ctx_init} {class}." themselves (`prompt_type: 'coop'`)
    prompts: PromptSet = field(default="single", metadata={"fixed": True})
    cupl: bool = field(default=False, metadata={"fixed": True})
    episodic: bool = field(default=False, metadata={"fixed": True})  # the context is never reset (l.367)
    ctx_init: str = text_setting("a photo of a", nonempty=True)  # `ctx_init: 'a_photo_of_a'`, n_ctx 4
    lr: float = setting(5e-3, ge=0)  # main.py `--lr` default 5e-3
    # `optimizer: "SGD"`; set_optimizer: SGD(lr, momentum=getattr(args, "momentum", 0.9),
    # weight_decay=getattr(args, "weight_decay", 1e-4)) - neither is set for HisTPT, so the getattr defaults
    momentum: float = setting(0.9, ge=0, lt=1)
    weight_decay: float = setting(1e-4, ge=0)
    tta_steps: int = setting(1, ge=0)  # main.py `--tta_steps` default 1
    selection_p: float = setting(0.1, gt=0, le=1)  # `selection_p: 0.1` (used with several views only)
    memory_size: int = setting(32, ge=1)  # `memory_size: 32`: L = H = 32
    hard_topk: int = setting(16, ge=1, le=Ref("memory_size"))  # `hard_topk: 16`: K = 16 hard entries
    ema_momentum: float = setting(0.99, ge=0, le=1)  # `ema_momentum: 0.99`
    # `self.soft = True`: the fused probabilities are the target; False: their argmax with F.cross_entropy
    soft_labels: bool = True
    amp: bool = True  # autocast + GradScaler on CUDA (base_method.py); ignored on the CPU (fp32, scale 1)
    grad_scale_init: float = setting(1000.0, gt=0)  # GradScaler(init_scale=1000)
    grad_scale_growth_interval: int = setting(2000, ge=1)  # GradScaler default
    # Execution only: each prompt only up to its end-of-text token, and the shared start + context positions once
    # (exact under the causal mask; extract/text_encoder.py). False runs the full 77-token sequences.
    text_shortcuts: bool = True


class HisTPT(MixedPrecision, TTAMethod):
    """Online prompt tuning towards a pseudo-label fused from three memories of past prompts."""

    key: ClassVar[str] = "histpt"
    prefix_stable: ClassVar[bool] = True  # the context and memories hold only samples already seen
    Config: ClassVar[type[MethodConfig]] = HisTPTConfig
    needs_text_encoder: ClassVar[bool] = True
    _state_fields: ClassVar[tuple[str, ...]] = ("ctx", "momentum_buffer", "memory_local", "entropy_history",
                                                "memory_hard", "memory_global", "loss_scale", "skipped_steps")
    # unseen data: TTABC has one setting for every set
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        return PROMPT_TUNING  # `prompt_encoder` checks the loaded model's text tower

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: HisTPTConfig = self.config  # type: ignore[assignment]
        if class_names is not None and len(class_names) != self.n_classes:
            raise ValueError(f"{self.key}: {len(class_names)} class names but text_features has "
                             f"{self.n_classes} rows")
        self.prompts = prompt_encoder(self.key, text_encoder, class_names, cfg.ctx_init, cfg.text_shortcuts)
        self.ctx = self.prompts.ctx_init.clone()  # (n_ctx, W) fp32, `model.reset()` once per run
        self.momentum_buffer: torch.Tensor | None = None
        # the memories (TTABC `HistoricalMemory`), empty until the first sample: local (L, K, D) newest first, its
        # entropies (L,), hard (L, K, D), global (K, D)
        self.memory_local: torch.Tensor | None = None
        self.entropy_history: torch.Tensor | None = None
        self.memory_hard: torch.Tensor | None = None
        self.memory_global: torch.Tensor | None = None
        self._init_loss_scale()

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> HisTPTConfig:
        check_hparams_key(hparams_key)
        return HisTPTConfig(augmix=hparams_key not in IMAGENET_FAMILY)

    # -- pieces --------------------------------------------------------------------------------------------------
    def _text(self, ctx: torch.Tensor) -> torch.Tensor:
        """(n_ctx, W) context -> (K, D) L2-normalised class features (`get_text_features`)."""
        return self.prompts(ctx.to(self.prompts.device))

    def memory_prompts(self) -> list[torch.Tensor]:
        """The (K, D) prompts of the global, local and hard memories: each memory's mean (global: itself),
        L2-normalised; while the memories are empty, the present t(ctx), encoded without gradient as TTABC's
        `get_text_embeddings_with_memory` does."""
        if self.memory_global is None or self.memory_local is None or self.memory_hard is None:
            return [self._text(self.ctx)] * 3  # the first sample: every memory is still empty
        return [m / m.norm(dim=-1, keepdim=True)
                for m in (self.memory_global, self.memory_local.mean(0), self.memory_hard.mean(0))]

    def update_memories(self, text: torch.Tensor, entropy: torch.Tensor) -> None:
        """TTABC `update_st_memory`, `update_hard_memory`, `update_ema_memory` with the tuned (K, D) `text` and
        the sample's entropy (a 0-d tensor)."""
        cfg: HisTPTConfig = self.config  # type: ignore[assignment]
        e = entropy.reshape(1)  # in the logits' dtype (fp16 on CUDA: TTABC takes it outside autocast)
        if self.memory_local is None or self.entropy_history is None:  # the first sample fills every slot
            self.memory_local = text[None].repeat(cfg.memory_size, 1, 1)
            self.entropy_history = e.expand(cfg.memory_size).clone()
        else:
            self.memory_local = torch.cat([text[None], self.memory_local[:-1]])
            self.entropy_history = torch.cat([e, self.entropy_history[:-1]])
        if self.memory_hard is None:
            self.memory_hard = self.memory_local.clone()
        else:
            # the hard_topk highest entropies, ties to the newer entry (stable sort); their mean enters first
            top = torch.sort(self.entropy_history, descending=True, stable=True).indices[:cfg.hard_topk]
            self.memory_hard = torch.cat([self.memory_local[top].mean(0)[None], self.memory_hard[:-1]])
        if self.memory_global is None:
            self.memory_global = text.clone()
        else:
            fresh = 0.5 * (self.memory_local.mean(0) + self.memory_hard.mean(0))
            self.memory_global = self.memory_global * cfg.ema_momentum + fresh * (1 - cfg.ema_momentum)

    def _pseudo_label(self, f0: torch.Tensor) -> torch.Tensor:
        """(K,) fused target of the original view (no gradient; one logit product per memory, as TTABC's
        `forward_with_memory`)."""
        with torch.no_grad():
            return fuse_pseudo_label(torch.cat([self._logits(f0[None], t) for t in self.memory_prompts()]))

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean over the views of the soft-target cross-entropy (timm's `SoftTargetCrossEntropy`, which TTABC
        imports), or of the cross-entropy to the target's argmax (`soft_labels` False)."""
        if self.config.soft_labels:  # type: ignore[attr-defined]
            return torch.sum(-target * logits.log_softmax(-1), dim=-1).mean()
        return torch.nn.functional.cross_entropy(logits, target.argmax(-1).expand(logits.shape[0]))

    def _step(self, feats: torch.Tensor) -> torch.Tensor:
        """One tuning step on one sample's (V, D) views; returns the detached logits of the kept views."""
        cfg: HisTPTConfig = self.config  # type: ignore[assignment]
        dev = feats.device
        amp = self._use_amp(dev)
        ctx = self.ctx.detach().clone().requires_grad_(True)
        with self._autocast(dev):
            text = self._text(ctx)
            logits = self._logits(feats, text)  # (V, K)
            target = self._pseudo_label(feats[0])
            if feats.shape[0] > 1:  # TTABC's `tpt: True`: the int(V·p) views of lowest entropy (TPT's rule)
                n = n_confident(feats.shape[0], cfg.selection_p)
                logits = logits[torch.argsort(softmax_entropy(logits.detach()), stable=True)[:n]]
            loss = self._loss(logits, target).float()
        (grad,), finite = unscaled_grads(loss, [ctx], self.loss_scale, amp=amp)
        if finite:
            self.ctx, self.momentum_buffer = sgd_step(self.ctx, grad, self.momentum_buffer, lr=cfg.lr,
                                                      momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self._count_step(finite, amp)
        return logits.detach()

    def _adapt_one(self, feats: torch.Tensor) -> torch.Tensor:
        """One sample: (V, D) view features -> (K,) logits of the original view after its update."""
        cfg: HisTPTConfig = self.config  # type: ignore[assignment]
        dev = feats.device
        if cfg.tta_steps > 0:  # TTABC tunes (and updates the memories) only with tta_steps > 0
            logits = None
            for _ in range(cfg.tta_steps):
                logits = self._step(feats)
            assert logits is not None
            with torch.no_grad():
                entropy = softmax_entropy(logits).mean()
                tuned = self._text(self.ctx).float()  # outside autocast, as TTABC's memory update
                self.update_memories(tuned, entropy)
            if not self._use_amp(dev):  # the prediction's features are the same numbers
                return self._logits(feats[:1], tuned)[0].float()
        with torch.no_grad(), self._autocast(dev):
            return self._logits(feats[:1], self._text(self.ctx))[0].float()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        dev = view_feats.device
        feats = view_feats.to(torch.promote_types(view_feats.dtype, torch.float32))
        self._loss_scaling = self._use_amp(dev)
        if self.ctx.device != dev:  # (a state loaded on another device)
            self._to(dev)
        return torch.stack([self._adapt_one(f) for f in feats])

    def _to(self, device: torch.device) -> None:
        for name in ("ctx", "momentum_buffer", "memory_local", "entropy_history", "memory_hard", "memory_global"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
