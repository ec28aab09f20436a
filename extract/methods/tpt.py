"""TPT and its calibration variants C-TPT and O-TPT: episodic test-time prompt tuning (spec §3, §4, §13.1).

Per test sample (reset before every sample): a learnable 4-token context initialised from "a photo of a" and shared
by all classes gives text features t̂(ctx); the 64 views' logits z_v = s·f̂_v t̂ᵀ select the int(64·0.1) = 6 views
of lowest softmax entropy (chosen at step 0, reused later); one AdamW step (lr 5e-3, weight decay 0.01) on their
marginal entropy (+ the C-TPT / O-TPT regulariser on T̂) tunes the context; the prediction is s·f̂₀ t̂(ctx')ᵀ on the
original view only.

The image encoder is frozen, so the view features come from the feature cache. The cost is the text encoder: one
forward + backward over the K prompts per step and one forward for the prediction, for all views at once. Samples
are independent, so `pass_budget // K` samples are tuned together: their contexts are stacked into one (G, n_ctx, W)
tensor, the loss is the sum of the per-sample losses (each context only reaches its own loss) and AdamW is
element-wise, which makes the batched step equal to G separate steps.

Precision: on CUDA with `amp` the text tower runs under autocast (fp16) with fp32 weights and an fp32 context, and
the loss goes through a dynamic loss scale that behaves as the one `GradScaler(init_scale=1000)` the official code
creates once per run (it is not reset between samples; a step whose gradient is not finite is skipped and the scale
halved, and the scale doubles after 2000 finite steps). On the CPU everything is fp32 and the scale is 1.

`EpisodicTuner` is the shared core; TPS (`tps.py`) reuses it with a per-class prototype shift instead of a context.

Where this differs from the official loops (numerics only; the formulas are the same):
    * `pass_budget`: within one pass every sample uses the loss scale in force when the pass starts, where the
      official code would already use a scale halved (or doubled) by the previous sample. The scale only changes
      fp16 gradient rounding, not the update; `pass_budget` <= K (one sample per pass) restores the exact order.
    * The C-TPT/O-TPT terms are computed in fp32 outside autocast from the text features of the entropy forward
      (O-TPT's code re-encodes the prompts outside autocast; C-TPT's uses the autocast features): same values up
      to fp16 rounding. O-TPT's Householder products are applied as vectors (O(K²) memory instead of O(K³)).
    * Selection keeps at least one view with fewer than 10 views (`common.n_confident`); ties are broken by view
      index (stable sort), where the official unstable argsort leaves them arbitrary.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Sequence

import torch

from extract.methods.base import IMAGENET_FAMILY, MethodConfig, PromptSet, TTAMethod, check_hparams_key
from extract.methods.common import marginal_entropy, n_confident, softmax_entropy

# ImageNet-A/-V2/-R/-Sketch: the natural-shift ("ds") group of the C-TPT/O-TPT scripts
NATURAL_SHIFT: frozenset[str] = IMAGENET_FAMILY - {"imagenet"}


# ---------------------------------------------------------------------------------------------------------------
# pure pieces (tested against slow references)

def select_confident(logits: torch.Tensor, selection_p: float) -> torch.Tensor:
    """Indices of the `int(V·p)` views of lowest softmax entropy (TPT `select_confident_samples`, spec §1.3).

    Args:
        logits: (..., V, K) per-view logits.
        selection_p: kept fraction (0.1).

    Returns:
        (..., n) int64 view indices in ascending entropy (stable on ties), n = max(1, int(V·p)).

    Example:
        >>> select_confident(torch.tensor([[0., 0.], [5., 0.], [9., 0.]]), 0.67).tolist()
        [2, 1]
    """
    n = n_confident(logits.shape[-2], selection_p)
    return torch.argsort(softmax_entropy(logits.detach()), dim=-1, stable=True)[..., :n]


def atfd(text: torch.Tensor) -> torch.Tensor:
    """C-TPT's Average Text Feature Dispersion: (1/K) Σ_c ‖t̂_c − t̄‖₂, t̄ = (1/K) Σ_c t̂_c (spec §4).

    Args:
        text: (..., K, D) L2-normalised text features.

    Returns:
        (...,) dispersion.
    """
    return (text - text.mean(-2, keepdim=True)).norm(dim=-1).mean(-1)


def householder_orthogonality(text: torch.Tensor) -> torch.Tensor:
    """O-TPT's orthogonality penalty as its code computes it (spec §4).

    M = T̂T̂ᵀ (K×K); n_i = ‖M_{:,i}‖ (column norm); u_i = M_{i,:} − n_i e_i; v_i = u_i/‖u_i‖; the Householder
    reflector H_i = I − 2 v_i v_iᵀ is applied to M_{i,:}ᵀ and the penalty is (1/K) Σ_i ‖H_i M_{i,:}ᵀ − e_i‖₂.
    H_i x is computed as x − 2 v_i (v_i·x) instead of building the K matrices of size K×K (the official code's
    (K, K, K) tensor), which is the same number with O(K²) memory. It is NaN when some u_i = 0 (K = 1, or exactly
    orthogonal features), as in the official code; the tuner then skips that sample's step.

    Args:
        text: (..., K, D) L2-normalised text features.

    Returns:
        (...,) penalty.
    """
    m = text @ text.transpose(-1, -2)  # (..., K, K)
    k = m.shape[-1]
    eye = torch.eye(k, dtype=m.dtype, device=m.device)
    col_norm = m.norm(dim=-2, keepdim=True)  # (..., 1, K)
    u = m - eye * col_norm  # row i: M_i - n_i e_i
    v = u / u.norm(dim=-1, keepdim=True)
    hx = m - 2.0 * v * (v * m).sum(-1, keepdim=True)  # row i: H_i M_i
    return (hx - eye).norm(dim=-1).mean(-1)


@dataclass
class AdamWState:
    """Per-sample AdamW moments for a stacked (G, ...) parameter; `step` counts the steps each sample took."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # (G,) float

    @classmethod
    def zeros_like(cls, param: torch.Tensor) -> "AdamWState":
        return cls(torch.zeros_like(param), torch.zeros_like(param),
                   torch.zeros(param.shape[0], dtype=param.dtype, device=param.device))


def adamw_step(param: torch.Tensor, grad: torch.Tensor, state: AdamWState, *, lr: float, betas: tuple[float, float],
               eps: float, weight_decay: float, active: torch.Tensor | None = None) -> torch.Tensor:
    """One `torch.optim.AdamW` step (amsgrad off) applied independently to each row of a stacked parameter.

    p ← p·(1 − lr·wd); m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²; p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + eps).
    Rows with `active` False keep parameter and state unchanged (a step skipped by the gradient scaler).

    Args:
        param: (G, ...) parameter values (not modified).
        grad: (G, ...) gradient (finite where active).
        state: the rows' AdamW state, updated in place for active rows.
        active: (G,) bool, default all True.

    Returns:
        (G, ...) new parameter values.
    """
    g_rows = param.shape[0]
    act = torch.ones(g_rows, dtype=torch.bool, device=param.device) if active is None else active
    shape = (g_rows,) + (1,) * (param.ndim - 1)
    a = act.view(shape)
    grad = torch.where(a, grad, torch.zeros_like(grad))
    b1, b2 = betas
    step = state.step + act.to(state.step.dtype)
    m = torch.where(a, state.exp_avg * b1 + grad * (1 - b1), state.exp_avg)
    v = torch.where(a, state.exp_avg_sq * b2 + grad * grad * (1 - b2), state.exp_avg_sq)
    t = step.clamp_min(1).view(shape)
    bc1 = 1 - b1 ** t
    bc2_sqrt = (1 - b2 ** t).sqrt()
    new = param * (1 - lr * weight_decay) - (lr / bc1) * m / (v.sqrt() / bc2_sqrt + eps)
    state.exp_avg, state.exp_avg_sq, state.step = m, v, step
    return torch.where(a, new, param)


# ---------------------------------------------------------------------------------------------------------------
# shared configuration and core

@dataclass(frozen=True)
class EpisodicConfig(MethodConfig):
    """Settings shared by the episodic tuners (TPT family, TPS); defaults from TPT `tpt_classification.py` and
    `scripts/test_tpt.sh` (spec §3)."""

    n_views: int = 64  # -b 64: the original + 63 augmented views (spec §1.2)
    augmix: bool = True  # per dataset in `default_config`
    prompts: PromptSet = "single"
    cupl: bool = False
    episodic: bool = field(default=True, metadata={"fixed": True})
    lr: float = 5e-3  # --lr 5e-3
    weight_decay: float = 0.01  # torch.optim.AdamW default (the official code passes only the lr)
    beta1: float = 0.9  # AdamW defaults
    beta2: float = 0.999
    adam_eps: float = 1e-8
    tta_steps: int = 1  # --tta_steps 1
    selection_p: float = 0.1  # --selection_p 0.1: 6 of 64 views
    amp: bool = True  # autocast (fp16) + dynamic loss scale on CUDA; ignored on the CPU (fp32)
    grad_scale_init: float = 1000.0  # GradScaler(init_scale=1000)
    grad_scale_growth_interval: int = 2000  # GradScaler default
    # Execution only, results unchanged: how many (sample x class) rows one tuning pass may stack (memory cap).
    pass_budget: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__qualname__
        if self.tta_steps < 0:
            raise ValueError(f"{name}.tta_steps must be >= 0, got {self.tta_steps}")
        if not 0.0 < self.selection_p <= 1.0:
            raise ValueError(f"{name}.selection_p must be in (0, 1], got {self.selection_p}")
        if self.lr < 0 or self.weight_decay < 0 or self.adam_eps <= 0:
            raise ValueError(f"{name}: lr and weight_decay must be >= 0 and adam_eps > 0")
        if self.pass_budget < 1 or self.grad_scale_init <= 0 or self.grad_scale_growth_interval < 1:
            raise ValueError(f"{name}: pass_budget, grad_scale_init and grad_scale_growth_interval must be positive")


class EpisodicTuner(TTAMethod):
    """Core of the episodic methods: per sample, reset the parameter, select confident views at step 0, take
    `tta_steps` AdamW steps on marginal entropy + `regulariser`, predict on view 0.

    Subclasses define the parameter (`_init_param`), the class features it gives (`_class_features`) and optionally
    a regulariser on them. The dynamic loss scale is online state (saved by `state_dict`), as the official
    GradScaler is created once per run.
    """

    Config: ClassVar[type[MethodConfig]] = EpisodicConfig
    _state_fields: ClassVar[tuple[str, ...]] = ("loss_scale",)

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        self.class_names = None if class_names is None else tuple(class_names)
        if self.class_names is not None and len(self.class_names) != self.n_classes:
            raise ValueError(f"{self.key}: {len(self.class_names)} class names but text_features has "
                             f"{self.n_classes} rows")
        cfg: EpisodicConfig = self.config  # type: ignore[assignment]
        # GradScaler state: {"scale", "growth_tracker"} (plain numbers, so `state_dict` can save them)
        self.loss_scale: dict[str, float | int] = {"scale": float(cfg.grad_scale_init), "growth_tracker": 0}

    # -- hooks ---------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _init_param(self, n: int, device: torch.device) -> torch.Tensor:
        """(n, ...) float32 initial parameter for n samples."""

    @abc.abstractmethod
    def _class_features(self, param: torch.Tensor) -> torch.Tensor:
        """(G, ...) parameter -> (G, K, D) L2-normalised class features (differentiable)."""

    def _regulariser(self, text: torch.Tensor) -> torch.Tensor | None:
        """(G, K, D) class features -> (G,) term added to the loss, or None."""
        return None

    def _rows_per_pass(self) -> int:
        return max(1, self.config.pass_budget // self.n_classes)  # type: ignore[attr-defined]

    # -- machinery -----------------------------------------------------------------------------------------------
    def _use_amp(self, device: torch.device) -> bool:
        return bool(self.config.amp) and device.type == "cuda"  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def _autocast(self, device: torch.device) -> Iterator[None]:
        if self._use_amp(device):
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                yield
        else:
            yield

    def _update_scale(self, finite: torch.Tensor) -> None:
        """GradScaler.update once per sample, in stream order (backoff 0.5, growth 2)."""
        cfg: EpisodicConfig = self.config  # type: ignore[assignment]
        for ok in finite.tolist():
            if not ok:
                self.loss_scale["scale"] = float(self.loss_scale["scale"]) * 0.5
                self.loss_scale["growth_tracker"] = 0
            else:
                self.loss_scale["growth_tracker"] = int(self.loss_scale["growth_tracker"]) + 1
                if self.loss_scale["growth_tracker"] == cfg.grad_scale_growth_interval:
                    self.loss_scale["scale"] = float(self.loss_scale["scale"]) * 2.0
                    self.loss_scale["growth_tracker"] = 0

    def _logits(self, feats: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """s · f̂ t̂ᵀ: feats (G, V, D), text (G, K, D) -> (G, V, K)."""
        if not self._use_amp(feats.device):
            text = text.to(feats.dtype)
        return self.logit_scale * feats @ text.transpose(-1, -2)

    def tune(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tune the parameter of G samples from scratch.

        Args:
            feats: (G, V, D) L2-normalised view features.

        Returns:
            (tuned parameter (G, ...), selected view indices (G, n)).
        """
        cfg: EpisodicConfig = self.config  # type: ignore[assignment]
        dev = feats.device
        amp = self._use_amp(dev)
        param = self._init_param(feats.shape[0], dev)
        state = AdamWState.zeros_like(param)
        sel = None
        if cfg.tta_steps == 0:
            with torch.no_grad(), self._autocast(dev):
                sel = select_confident(self._logits(feats, self._class_features(param)), cfg.selection_p)
        for _ in range(cfg.tta_steps):
            p = param.detach().requires_grad_(True)
            with self._autocast(dev):
                text = self._class_features(p)
                logits = self._logits(feats, text)  # (G, V, K)
                if sel is None:  # chosen at step 0 and reused (TPT `test_time_tuning`)
                    sel = select_confident(logits, cfg.selection_p)
                chosen = torch.gather(logits, 1, sel[..., None].expand(-1, -1, logits.shape[-1]))
                # fp32 before summing: G scaled fp16 losses (each up to 1000 · ln K) would overflow their sum
                loss = marginal_entropy(chosen).float()  # (G,)
            with torch.autocast(device_type=dev.type, enabled=False):
                reg = self._regulariser(text.float())  # in fp32, outside autocast
            if reg is not None:
                loss = loss + reg
            scale = float(self.loss_scale["scale"]) if amp else 1.0
            (grad,) = torch.autograd.grad(loss.sum() * scale, p)
            grad = grad.float() / scale
            finite = torch.isfinite(grad).flatten(1).all(1) & torch.isfinite(loss.detach())
            param = adamw_step(param, grad, state, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                               weight_decay=cfg.weight_decay, active=finite)
            if amp:
                self._update_scale(finite)
        assert sel is not None
        return param.detach(), sel

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        feats = view_feats.to(self.compute_dtype(view_feats))
        out = []
        g = self._rows_per_pass()
        for i in range(0, feats.shape[0], g):
            chunk = feats[i:i + g]
            param, _ = self.tune(chunk)
            with torch.no_grad(), self._autocast(chunk.device):
                text = self._class_features(param)
                out.append(self._logits(chunk[:, :1], text)[:, 0].float())  # the original view only
        return torch.cat(out)


# ---------------------------------------------------------------------------------------------------------------
# TPT, C-TPT, O-TPT

@dataclass(frozen=True)
class TPTConfig(EpisodicConfig):
    """TPT (`azshue/TPT @63ecbac`, spec §3). AugMix on the fine-grained sets only (`augmix = len(set_id) > 1`)."""

    # the prompts are the learnable "{ctx_init} {class}." themselves: no prototype set to choose
    prompts: PromptSet = field(default="single", metadata={"fixed": True})
    cupl: bool = field(default=False, metadata={"fixed": True})
    ctx_init: str = "a photo of a"  # --ctx_init a_photo_of_a: n_ctx = 4 context tokens
    # Execution only: run each prompt only up to its end-of-text token, in length groups, and the class-independent
    # start + context positions once per sample (both exact under the causal mask; `text_encoder.py`). False runs
    # open_clip's encode_text path, bit for bit.
    text_shortcuts: bool = True


class TPT(EpisodicTuner):
    """Test-time prompt tuning: a shared learnable context, one AdamW step per sample, episodic."""

    key: ClassVar[str] = "tpt"
    Config: ClassVar[type[MethodConfig]] = TPTConfig
    needs_text_encoder: ClassVar[bool] = True

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder, class_names=class_names)
        from extract.text_encoder import PromptTextEncoder

        if self.class_names is None:
            raise ValueError(f"method {self.key!r} builds one prompt per class and needs class_names=...")
        cfg: TPTConfig = self.config  # type: ignore[assignment]
        model = getattr(text_encoder, "model", text_encoder)  # a LoadedModel or a bare open_clip model
        tokenizer = getattr(text_encoder, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"{self.key}: text_encoder must carry its tokenizer (pass the LoadedModel)")
        self.prompts = PromptTextEncoder(model, tokenizer, self.class_names, ctx_init=cfg.ctx_init,
                                         truncate=cfg.text_shortcuts, share_prefix=cfg.text_shortcuts)

    # Unseen data (C-TPT and O-TPT inherit this): the fine-grained settings - AugMix views, and for C-TPT / O-TPT the
    # fine-grained lambda (every fine-grained set has the same row; DTD stands for them).
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TPTConfig:
        check_hparams_key(hparams_key)
        return TPTConfig(augmix=hparams_key not in IMAGENET_FAMILY)

    def _init_param(self, n: int, device: torch.device) -> torch.Tensor:
        # the context restarts from "a photo of a" for every sample (`model.reset()`), in fp32 (spec §13.1)
        return self.prompts.ctx_init.to(device).expand(n, -1, -1).clone()

    def _class_features(self, param: torch.Tensor) -> torch.Tensor:
        return self.prompts(param.to(self.prompts.device))


@dataclass(frozen=True)
class CTPTConfig(TPTConfig):
    """C-TPT (`hee-suk-yoon/C-TPT @085e6c2`, spec §4): TPT − λ·ATFD."""

    # λ = 50: fine-grained sets and ImageNet (scripts/test_tpt_ctpt_fg.sh); 20: A/V2/R/Sketch (test_tpt_ctpt_ds.sh)
    lambda_term: float = 50.0


class CTPT(TPT):
    """TPT with C-TPT's dispersion reward: loss = marginal entropy − λ·ATFD(T̂)."""

    key: ClassVar[str] = "ctpt"
    Config: ClassVar[type[MethodConfig]] = CTPTConfig

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> CTPTConfig:
        check_hparams_key(hparams_key)
        # The ds script adds --I_augmix (AugMix also on A/V2/R/Sketch); the fg script runs ImageNet without it.
        return CTPTConfig(augmix=hparams_key != "imagenet",
                          lambda_term=20.0 if hparams_key in NATURAL_SHIFT else 50.0)

    def _regulariser(self, text: torch.Tensor) -> torch.Tensor:
        return -self.config.lambda_term * atfd(text)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class OTPTConfig(TPTConfig):
    """O-TPT (`ashshaksharifdeen/O-TPT @a09933f`, spec §4): TPT + λ·Householder orthogonality penalty."""

    # λ = 18 fine-grained (scripts/test_tpt_otpt_fg.sh), 2 for A/V2/R/Sketch (test_tpt_otpt_ds.sh). ImageNet goes
    # with the fine-grained script as in C-TPT [ASSUMPTION: the O-TPT snapshot has no ImageNet script].
    lambda_term: float = 18.0


class OTPT(TPT):
    """TPT with O-TPT's orthogonality penalty: loss = marginal entropy + λ·householder_orthogonality(T̂)."""

    key: ClassVar[str] = "otpt"
    Config: ClassVar[type[MethodConfig]] = OTPTConfig

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> OTPTConfig:
        check_hparams_key(hparams_key)
        return OTPTConfig(augmix=hparams_key != "imagenet",
                          lambda_term=2.0 if hparams_key in NATURAL_SHIFT else 18.0)

    def _regulariser(self, text: torch.Tensor) -> torch.Tensor:
        return self.config.lambda_term * householder_orthogonality(text)  # type: ignore[attr-defined]
