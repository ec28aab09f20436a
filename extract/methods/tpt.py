"""TPT and its calibration variants C-TPT and O-TPT: episodic test-time prompt tuning.

The official algorithms: docs/methods.md, "TPT: episodic prompt tuning" and "C-TPT and O-TPT"; their precision:
docs/methods.md, "Precision in the official code".

Per test sample (reset before every sample): a learnable 4-token context initialised from "a photo of a" and shared
by all classes gives text features t̂(ctx); the 64 views' logits z_v = s·f̂_v t̂ᵀ select the int(64·0.1) = 6 views
of lowest softmax entropy (chosen at step 0, reused later); one AdamW step (lr 5e-3, weight decay 0.01) on their
marginal entropy (+ the C-TPT / O-TPT regulariser on T̂) tunes the context; the prediction is s·f̂₀ t̂(ctx')ᵀ on the
original view only.

The image encoder is frozen, so the view features come from the feature cache. The cost is the text encoder: one
forward + backward over the K prompts per step and one forward for the prediction, for all views at once. Samples
are independent, so G samples are tuned together (`pass_budget // K` on the CPU; on CUDA as many as a fraction of
the free GPU memory holds, `pass_memory_fraction`): their contexts are stacked into one (G, n_ctx, W) tensor, the
loss is the sum of the per-sample losses (each context only reaches its own loss) and AdamW is element-wise, which
makes the batched step equal to G separate steps at the same loss scale. All G contexts start equal, so step 0's
text forward runs once for the pass and each sample's gradient is a VJP through it (`_share_first_forward`).

Precision: on CUDA with `amp` the text tower runs under autocast (fp16) with fp32 weights and an fp32 context, and
the loss goes through a dynamic loss scale that behaves as the one `GradScaler(init_scale=1000)` the official code
creates once per run (it is not reset between samples; a step whose gradient is not finite is skipped and the scale
halved, and the scale doubles after 2000 finite steps). On the CPU everything is fp32 and the scale is 1.

The official loop updates the scale after every sample, so the next sample already runs at the new scale. A
batched pass keeps that order (`_tune_in_order`): it tunes its G samples at the scale in force, replays the
GradScaler updates in stream order up to the first step that changes the scale (an overflow or a growth step),
keeps the samples up to it and re-runs the rest at the new scale. Batched and one-at-a-time runs therefore give the
same rows, the same skipped steps and the same final scale (a pass is re-run once per scale change: rare, except in
a run of overflows). The count of skipped steps and the scale are the method's `summary()` (recorded per part in
the shard metadata and printed at the end of a run); both are also state, restored on resume.

`EpisodicTuner` is the shared core; TPS (`tps.py`) reuses it with a per-class prototype shift instead of a context,
R-TPT (`rtpt.py`) with its own loss and prediction (`_tuning_loss`, `_predict`). The online DynaPrompt
(`dynaprompt.py`) reuses the pieces: `adamw_step`, `MixedPrecision`, `prompt_encoder`; HisTPT, DART, TTL and
PromptAlign, which tune one sample at a time, `MixedPrecision` (with `unscaled_grads`); DiffTPT is TPT with more
views.

Where this differs from the official loops (numerics only; the formulas are the same):
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

from extract.methods.base import (
    IMAGENET_FAMILY,
    PROMPT_TUNING,
    MethodConfig,
    PromptSet,
    Towers,
    TTAMethod,
    check_hparams_key,
    setting,
    text_setting,
)
from extract.methods.common import marginal_entropy, n_confident, softmax_entropy
from extract.methods.panda import PandaBatchFields, PandaPlugin

# ImageNet-A/-V2/-R/-Sketch: the natural-shift ("ds") group of the C-TPT/O-TPT scripts
NATURAL_SHIFT: frozenset[str] = IMAGENET_FAMILY - {"imagenet"}


# ---------------------------------------------------------------------------------------------------------------
# pure pieces (tested against slow references)

def select_confident(logits: torch.Tensor, selection_p: float) -> torch.Tensor:
    """Indices of the `int(V·p)` views of lowest softmax entropy (TPT
    `tpt_classification.py:select_confident_samples`).

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
    """C-TPT's Average Text Feature Dispersion: (1/K) Σ_c ‖t̂_c − t̄‖₂, t̄ = (1/K) Σ_c t̂_c (C-TPT
    `clip/custom_clip.py:inference`).

    Args:
        text: (..., K, D) L2-normalised text features.

    Returns:
        (...,) dispersion.
    """
    return (text - text.mean(-2, keepdim=True)).norm(dim=-1).mean(-1)


def householder_orthogonality(text: torch.Tensor) -> torch.Tensor:
    """O-TPT's orthogonality penalty as its code computes it (`otpt_classification.py:test_time_tuning`).

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
    step: torch.Tensor  # (G,) float64: the bias corrections are formed in double, as AdamW's Python floats
    calls: int = 0  # steps offered so far: no row took more (sizes the table of bias corrections)

    @classmethod
    def zeros_like(cls, param: torch.Tensor) -> "AdamWState":
        return cls(torch.zeros_like(param), torch.zeros_like(param),
                   torch.zeros(param.shape[0], dtype=torch.float64, device=param.device))


def adamw_step(param: torch.Tensor, grad: torch.Tensor, state: AdamWState, *, lr: float, betas: tuple[float, float],
               eps: float, weight_decay: float, active: torch.Tensor | None = None) -> torch.Tensor:
    """One `torch.optim.AdamW` step (amsgrad off) applied independently to each row of a stacked parameter.

    p ← p·(1 − lr·wd); m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²; p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + eps).
    Rows with `active` False keep parameter and state unchanged (a step skipped by the gradient scaler). The
    operations and their order are torch's (`_single_tensor_adam`), in the parameter's dtype (fp32 or fp16), and
    the bias corrections are its Python floats (double) rounded once to float32: the result equals AdamW's.

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
    step = state.step.to(torch.float64) + act.to(torch.float64)
    # torch's own operations in its order (lerp, mul + addcmul), with the Python-float factors it passes
    m = torch.where(a, state.exp_avg.lerp(grad, 1 - b1), state.exp_avg)
    v = torch.where(a, (state.exp_avg_sq * b2).addcmul_(grad, grad, value=1 - b2), state.exp_avg_sq)
    # Bias corrections as AdamW forms them, from Python floats (b ** n in double: torch's float64 pow differs from
    # Python's in the last bit for some n), one table entry per step count, then rounded once to the precision
    # torch applies a Python scalar in: float32 for fp16/fp32 parameters (their opmath type)
    state.calls += 1
    opmath = torch.float64 if param.dtype == torch.float64 else torch.float32
    table = torch.tensor([[lr / (1 - b1 ** n), (1 - b2 ** n) ** 0.5] for n in range(1, state.calls + 1)],
                         dtype=torch.float64).to(device=param.device, dtype=opmath)
    idx = (step.clamp_min(1) - 1).long()
    step_size, bc2_sqrt = table[idx, 0].view(shape), table[idx, 1].view(shape)
    denom = (v.sqrt() / bc2_sqrt).to(v.dtype) + eps
    new = (param * (1 - lr * weight_decay) - step_size * m / denom).to(param.dtype)
    state.exp_avg, state.exp_avg_sq, state.step = m, v, step
    return torch.where(a, new, param)


def grad_scaler_update(scaler: dict[str, float | int], finite: bool, growth_interval: int) -> bool:
    """One `torch.cuda.amp.GradScaler.update` on a plain-number state `{"scale", "growth_tracker"}` (backoff 0.5,
    growth 2 after `growth_interval` finite steps in a row).

    Returns:
        True when the scale changed.

    Example:
        >>> s = {"scale": 1000.0, "growth_tracker": 0}
        >>> grad_scaler_update(s, False, 2000), s
        (True, {'scale': 500.0, 'growth_tracker': 0})
    """
    if not finite:
        scaler["scale"], scaler["growth_tracker"] = float(scaler["scale"]) * 0.5, 0
        return True
    scaler["growth_tracker"] = int(scaler["growth_tracker"]) + 1
    if scaler["growth_tracker"] == growth_interval:
        scaler["scale"], scaler["growth_tracker"] = float(scaler["scale"]) * 2.0, 0
        return True
    return False


def unscaled_grads(loss: torch.Tensor, params: Sequence[torch.Tensor], loss_scale: dict[str, float | int], *,
                   amp: bool) -> tuple[list[torch.Tensor], bool]:
    """The gradients `scaler.scale(loss).backward()` leaves after `scaler.unscale_`, the GradScaler emulated by
    `loss_scale`: those of loss·scale, unscaled in fp32 (scale 1 without `amp`: no scaler on the CPU), and whether
    the loss and every gradient are finite (the step the scaler would take). One host sync for all the checks (a GPU
    waits once per step, not once per tensor)."""
    scale = float(loss_scale["scale"]) if amp else 1.0
    grads = [g.float() / scale for g in torch.autograd.grad(loss * scale, list(params))]
    finite = bool(torch.stack([torch.isfinite(loss.detach()).all(), *(torch.isfinite(g).all() for g in grads)]).all())
    return grads, finite


@contextlib.contextmanager
def amp_autocast(enabled: bool) -> Iterator[None]:
    """fp16 autocast on CUDA when `enabled` (the official `torch.cuda.amp.autocast()`), else nothing."""
    if enabled:
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            yield
    else:
        yield


def prompt_encoder(key: str, text_encoder: Any, class_names: Sequence[str] | None, ctx_init: str,
                   shortcuts: bool) -> Any:
    """The `PromptTextEncoder` of a prompt-tuning method, from the `LoadedModel` the runner passes as
    `text_encoder` (or a bare open_clip model with a `tokenizer` attribute)."""
    from extract.text_encoder import PromptTextEncoder

    if class_names is None:
        raise ValueError(f"method {key!r} builds one prompt per class and needs class_names=...")
    model = getattr(text_encoder, "model", text_encoder)  # a LoadedModel or a bare open_clip model
    tokenizer = getattr(text_encoder, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"{key}: text_encoder must carry its tokenizer (pass the LoadedModel)")
    return PromptTextEncoder(model, tokenizer, class_names, ctx_init=ctx_init, truncate=shortcuts,
                             share_prefix=shortcuts)


class MixedPrecision:
    """The official loops' precision on CUDA with `amp`, emulated for a method that tunes fp32 tensors: fp16 autocast
    (`_autocast`) and the one `GradScaler(init_scale=grad_scale_init)` of the run as online state (`loss_scale`
    {"scale", "growth_tracker"}: plain numbers, so `state_dict` saves them; `skipped_steps`: steps not taken for a
    non-finite loss or gradient). fp32 at scale 1 on the CPU. The TPT family (`EpisodicTuner`), DynaPrompt, HisTPT,
    DART, TTL and PromptAlign; put it before `TTAMethod` in the bases and call `_init_loss_scale` in `__init__`."""

    config: MethodConfig
    logit_scale: float

    def _init_loss_scale(self) -> None:
        self.loss_scale: dict[str, float | int] = {
            "scale": float(self.config.grad_scale_init), "growth_tracker": 0}  # type: ignore[attr-defined]
        self.skipped_steps = 0  # steps not taken because the loss or the gradient was not finite
        self._loss_scaling = False  # whether the last `adapt` used the loss scale (for `summary`)

    def _use_amp(self, device: torch.device) -> bool:
        return bool(self.config.amp) and device.type == "cuda"  # type: ignore[attr-defined]

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return amp_autocast(self._use_amp(device))

    def _logits(self, feats: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """s · f̂ t̂ᵀ: feats (..., V, D), text (..., K, D) -> (..., V, K); the text in the features' dtype unless
        autocast decides it."""
        if not self._use_amp(feats.device):
            text = text.to(feats.dtype)
        return self.logit_scale * feats @ text.transpose(-1, -2)

    def _count_step(self, finite: bool, amp: bool) -> None:
        """After a step, taken or skipped (`finite`): the skipped ones counted, then `scaler.update()` with `amp`."""
        self.skipped_steps += int(not finite)
        if amp:
            grad_scaler_update(self.loss_scale, finite,
                               self.config.grad_scale_growth_interval)  # type: ignore[attr-defined]

    def _scaled_step(self, params: Sequence[torch.Tensor], loss: torch.Tensor, opt: torch.optim.Optimizer,
                     amp: bool) -> None:
        """The official `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()` on fp32 leaf tensors with
        a torch optimiser (`unscaled_grads`; the step only when they are finite)."""
        grads, finite = unscaled_grads(loss, params, self.loss_scale, amp=amp)
        if finite:
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        self._count_step(finite, amp)

    def summary(self) -> dict[str, Any]:
        """Steps skipped for a non-finite loss or gradient, and the loss scale now (None when the last `adapt` did
        not use loss scaling: the CPU, or `amp` off)."""
        scale = float(self.loss_scale["scale"]) if self._loss_scaling else None
        return {"skipped_steps": int(self.skipped_steps), "loss_scale": scale}


# ---------------------------------------------------------------------------------------------------------------
# shared configuration and core

@dataclass(frozen=True)
class EpisodicConfig(MethodConfig):
    """Settings shared by the episodic tuners (TPT family, TPS); defaults from TPT `tpt_classification.py` and
    `scripts/test_tpt.sh` (docs/methods.md, "TPT: episodic prompt tuning")."""

    n_views: int = 64  # -b 64: the original + 63 augmented views (TPT `data/datautils.py`)
    augmix: bool = True  # per dataset in `default_config`
    prompts: PromptSet = "single"
    cupl: bool = False
    episodic: bool = field(default=True, metadata={"fixed": True})
    lr: float = setting(5e-3, ge=0)  # --lr 5e-3
    weight_decay: float = setting(0.01, ge=0)  # torch.optim.AdamW default (the official code passes only the lr)
    beta1: float = setting(0.9, ge=0, lt=1)  # AdamW defaults
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)
    tta_steps: int = setting(1, ge=0)  # --tta_steps 1
    selection_p: float = setting(0.1, gt=0, le=1)  # --selection_p 0.1: 6 of 64 views
    amp: bool = True  # autocast (fp16) + dynamic loss scale on CUDA; ignored on the CPU (fp32)
    grad_scale_init: float = setting(1000.0, gt=0)  # GradScaler(init_scale=1000)
    grad_scale_growth_interval: int = setting(2000, ge=1)  # GradScaler default
    # Execution only: how many (sample x class) rows one tuning pass may stack (memory cap). Results equal the
    # one-at-a-time loop's, loss-scale updates included (see `_tune_in_order`).
    pass_budget: int = setting(2048, ge=1)
    # Execution only, CUDA: size the passes from free GPU memory instead - this fraction of what is free (driver
    # free + the allocator's cached, unused blocks) over the peak bytes per sample measured on the previous pass
    # (the first pass uses `pass_budget`). `pass_budget // K` is 2 samples at K = 1,000, which leaves the GPU idle
    # on kernel launches. 0 uses `pass_budget` on CUDA too. Ignored on the CPU.
    pass_memory_fraction: float = setting(0.7, ge=0, lt=1)


class EpisodicTuner(MixedPrecision, TTAMethod):
    """Core of the episodic methods: per sample, reset the parameter, select confident views at step 0, take
    `tta_steps` AdamW steps on marginal entropy + `regulariser`, predict on view 0.

    Subclasses define the parameter (`_init_param`), the class features it gives (`_class_features`) and optionally
    a regulariser on them. The dynamic loss scale is online state (saved by `state_dict`), as the official
    GradScaler is created once per run.
    """

    Config: ClassVar[type[MethodConfig]] = EpisodicConfig
    _state_fields: ClassVar[tuple[str, ...]] = ("loss_scale", "skipped_steps")
    # TPS re-selects the confident views at every step, TPT at step 0 only (see `_tune`).
    reselect_each_step: ClassVar[bool] = False

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        self.class_names = None if class_names is None else tuple(class_names)
        if self.class_names is not None and len(self.class_names) != self.n_classes:
            raise ValueError(f"{self.key}: {len(self.class_names)} class names but text_features has "
                             f"{self.n_classes} rows")
        self._init_loss_scale()
        # pass sizing on CUDA (execution only, not state): peak bytes per sample of the last pass, and the largest
        # pass size known to fit after an out-of-memory error
        self._pass_bytes: float | None = None
        self._pass_cap: int | None = None

    # -- hooks ---------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _init_param(self, n: int, device: torch.device) -> torch.Tensor:
        """(n, ...) float32 initial parameter for n samples."""

    @abc.abstractmethod
    def _class_features(self, param: torch.Tensor) -> torch.Tensor:
        """(G, ...) parameter -> (G, K, D) L2-normalised class features (differentiable)."""

    def _loss(self, feats: torch.Tensor, logits: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """(G,) per-sample tuning loss (before the regulariser): `_tuning_loss` of the selected views' logits
        (a method whose loss needs more than those, such as RLCF's reward, overrides this one).

        Args:
            feats: (G, V, ...) the pass's inputs; logits: (G, V, K) of the current parameter; sel: (G, n) views.
        """
        chosen = torch.gather(logits, 1, sel[..., None].expand(-1, -1, logits.shape[-1]))
        return self._tuning_loss(chosen)

    def _select(self, logits: torch.Tensor) -> torch.Tensor:
        """(G, V, K) logits -> (G, n) the views the loss uses: the `selection_p` most confident (TPT
        `select_confident_samples`); DiffTPT filters by cosine similarity first."""
        return select_confident(logits, self.config.selection_p)  # type: ignore[attr-defined]

    def _regulariser(self, text: torch.Tensor) -> torch.Tensor | None:
        """(G, K, D) class features -> (G,) term added to the loss, or None."""
        return None

    def _tuning_loss(self, chosen: torch.Tensor) -> torch.Tensor:
        """(G, n, K) logits of the selected views -> (G,) loss: their marginal entropy (TPT's `avg_entropy`)."""
        return marginal_entropy(chosen)

    def _predict(self, feats: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """(G, V, D) view features and (G, K, D) tuned class features -> (G, K) prediction: the original view's
        logits (no grad; under autocast when the run uses it)."""
        return self._logits(feats[:, :1], text)[:, 0]

    def _share_first_forward(self) -> bool:
        """Whether step 0 runs `_class_features` once for a pass instead of once per sample (execution only).

        Every sample starts from the same parameter, so step 0's class features - and the graph behind them - are
        the same for all G samples; only the cotangents (each sample's loss gradient at the features) differ. One
        forward and G vector-Jacobian products through it (`torch.func.vjp` + `vmap`) give each sample the gradient
        a forward of its own would: the same operations in the same dtypes (autocast included), fed the same
        numbers. Worth it where the forward is expensive (the TPT text encoder: one of its three passes per sample
        saved, and the activations of only one sample kept for the backward)."""
        return False

    def _rows_per_pass(self) -> int:
        return max(1, self.config.pass_budget // self.n_classes)  # type: ignore[attr-defined]

    # -- pass sizing (execution only: the rows do not depend on it) ---------------------------------------------
    def _sized_by_memory(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.config.pass_memory_fraction > 0  # type: ignore[attr-defined]

    def _free_memory(self, device: torch.device) -> int:
        """Bytes a pass can still allocate: free on the device plus cached blocks the allocator is not using."""
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))

    @contextlib.contextmanager
    def _measure_pass(self, device: torch.device, n: int) -> Iterator[None]:
        """Record the peak bytes per sample of a pass of `n` samples (`_pass_bytes`), on CUDA."""
        if not self._sized_by_memory(device):
            yield
            return
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield
        self._pass_bytes = max(1.0, (torch.cuda.max_memory_allocated(device) - base) / n)

    def _pass_size(self, device: torch.device, left: int) -> int:
        """Samples in the next tuning pass: `pass_budget // K`, or on CUDA `pass_memory_fraction` of the free
        memory over the bytes per sample of the last pass; never more than an out-of-memory error allowed."""
        g = self._rows_per_pass()
        if self._sized_by_memory(device) and self._pass_bytes is not None:
            frac = self.config.pass_memory_fraction  # type: ignore[attr-defined]
            g = max(1, int(frac * self._free_memory(device) / self._pass_bytes))
        if self._pass_cap is not None:
            g = min(g, self._pass_cap)
        return max(1, min(g, left))

    # -- machinery -----------------------------------------------------------------------------------------------
    def _scaler_step(self, scaler: dict[str, float | int], finite: bool) -> bool:
        """One `GradScaler.update` on `scaler` (backoff 0.5, growth 2); True when the scale changed."""
        return grad_scaler_update(scaler, finite, self.config.grad_scale_growth_interval)  # type: ignore[attr-defined]

    def _update_scale(self, finite: torch.Tensor) -> None:
        """GradScaler.update once per step, in the order given (stream order)."""
        for ok in finite.flatten().tolist():
            self._scaler_step(self.loss_scale, bool(ok))

    def tune(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tune the parameter of G samples from scratch, every step at the loss scale in force now (the loss scale
        is left unchanged; `_adapt` applies its updates in stream order).

        Args:
            feats: (G, V, D) L2-normalised view features.

        Returns:
            (tuned parameter (G, ...), selected view indices of the last step (G, n)).
        """
        param, sel, _ = self._tune(feats, update_scale=False)
        return param, sel

    def _tune(self, feats: torch.Tensor, *, update_scale: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`tune`, plus the (G, tta_steps) bool record of which steps had a finite loss and gradient.

        With `update_scale` (for one sample) the loss scale is updated after every step, as the official loop does.
        """
        cfg: EpisodicConfig = self.config  # type: ignore[assignment]
        dev = feats.device
        amp = self._use_amp(dev)
        param = self._init_param(feats.shape[0], dev)
        state = AdamWState.zeros_like(param)
        finite_steps = []
        sel = None
        if cfg.tta_steps == 0:
            with torch.no_grad(), self._autocast(dev):
                sel = self._select(self._logits(feats, self._class_features(param)))
        for step in range(cfg.tta_steps):
            p = param.detach().requires_grad_(True)
            vjp = None
            with self._autocast(dev):
                if step == 0 and self._share_first_forward() and torch.equal(param, param[:1].expand_as(param)):
                    # every sample starts from the same parameter: one forward for all, and each sample's
                    # gradient is a backward pass through it with that sample's cotangent (`_share_first_forward`)
                    text1, vjp = torch.func.vjp(self._class_features, param[:1])
                    text = text1.detach().expand(param.shape[0], *text1.shape[1:]).clone().requires_grad_(True)
                else:
                    text = self._class_features(p)
                logits = self._logits(feats, text)  # (G, V, K)
                # TPT chooses the views at step 0 and reuses them (`test_time_tuning`); TPS re-selects at every
                # step (`run_shift_iter`). Identical with the default single step.
                if sel is None or self.reselect_each_step:
                    sel = self._select(logits)
                # fp32 before summing: G scaled fp16 losses (each up to 1000 · ln K) would overflow their sum
                loss = self._loss(feats, logits, sel).float()  # (G,)
            with torch.autocast(device_type=dev.type, enabled=False):
                reg = self._regulariser(text.float())  # in fp32, outside autocast
            if reg is not None:
                loss = loss + reg
            scale = float(self.loss_scale["scale"]) if amp else 1.0
            if vjp is None:
                (grad,) = torch.autograd.grad(loss.sum() * scale, p)
            else:  # loss i reaches only row i of `text`, so this is each sample's own cotangent, as one tensor
                (cot,) = torch.autograd.grad(loss.sum() * scale, text)
                (grad,) = torch.func.vmap(vjp)(cot[:, None])  # (G, 1, ...): G backward passes, one call
                grad = grad[:, 0]
            grad = grad.float() / scale
            finite = torch.isfinite(grad).flatten(1).all(1) & torch.isfinite(loss.detach())
            param = adamw_step(param, grad, state, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                               weight_decay=cfg.weight_decay, active=finite)
            finite_steps.append(finite)
            if amp and update_scale:
                self._update_scale(finite)
        assert sel is not None
        steps = (torch.stack(finite_steps, 1) if finite_steps
                 else torch.ones(feats.shape[0], 0, dtype=torch.bool, device=dev))
        return param.detach(), sel, steps

    def _tune_in_order(self, feats: torch.Tensor) -> torch.Tensor:
        """Tune the first samples of `feats` exactly as the official one-sample-at-a-time loop would.

        All G samples are tuned at the loss scale in force. The GradScaler updates are then replayed in stream order
        (sample by sample, step by step) up to the first one that changes the scale (an overflow or a growth step):
        the samples up to it were tuned at the right scale and are kept; the caller re-runs the rest at the new
        scale. When the scale changes before the last step of the first sample, that sample is re-tuned alone with
        the scale updated after every step. Without loss scaling every sample is kept.

        Args:
            feats: (G, V, D) view features of consecutive samples.

        Returns:
            (n, ...) tuned parameters of the first n >= 1 samples; `loss_scale` and `skipped_steps` cover them.
        """
        param, _, finite = self._tune(feats, update_scale=False)
        if not self._use_amp(feats.device):
            self.skipped_steps += int((~finite).sum())
            return param
        rows = finite.tolist()
        scaler = dict(self.loss_scale)
        for i, row in enumerate(rows):
            before = dict(scaler)
            for t, ok in enumerate(row):
                if not self._scaler_step(scaler, ok):
                    continue
                if t == len(row) - 1:  # changed at this sample's last step: samples 0..i are right
                    n, self.loss_scale = i + 1, scaler
                elif i > 0:  # changed in the middle of sample i: keep 0..i-1
                    n, self.loss_scale = i, before
                else:  # ... of the first sample: tune it alone, updating the scale after every step
                    param, _, finite = self._tune(feats[:1], update_scale=True)
                    self.skipped_steps += int((~finite).sum())
                    return param
                self.skipped_steps += int((~finite[:n]).sum())
                return param[:n]
        self.loss_scale = scaler
        self.skipped_steps += int((~finite).sum())
        return param

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        feats = view_feats.to(self.compute_dtype(view_feats))
        self._loss_scaling = self._use_amp(feats.device)
        dev = feats.device
        out = []
        i = 0
        while i < feats.shape[0]:
            g = self._pass_size(dev, feats.shape[0] - i)
            kept = dict(self.loss_scale), self.skipped_steps
            try:
                with self._measure_pass(dev, g):
                    param = self._tune_in_order(feats[i:i + g])
                    chunk = feats[i:i + param.shape[0]]
                    with torch.no_grad(), self._autocast(dev):
                        text = self._class_features(param)
                        logits = self._predict(chunk, text).float()  # TPT: the original view only
            except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError from torch 2.5 on)
                if g == 1:
                    raise
                oom = True
            else:
                oom = False
            if oom:  # (outside the handler, so the failed pass's tensors are released first)
                # nothing of this pass is kept: undo its loss-scale bookkeeping and retry with half the samples
                self.loss_scale, self.skipped_steps = kept
                self._pass_cap = g // 2
                param = text = logits = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            out.append(logits)
            i += param.shape[0]
        return torch.cat(out)


# ---------------------------------------------------------------------------------------------------------------
# TPT, C-TPT, O-TPT

@dataclass(frozen=True)
class TPTConfig(PandaBatchFields, EpisodicConfig):
    """TPT (`azshue/TPT @63ecbac`). AugMix on the fine-grained sets only (`augmix = len(set_id) > 1`). Panda's
    fields (`--set panda=true`, docs/methods.md "Panda (`--set panda=true`)"): off by default."""

    # the prompts are the learnable "{ctx_init} {class}." themselves: no prototype set to choose
    prompts: PromptSet = field(default="single", metadata={"fixed": True})
    cupl: bool = field(default=False, metadata={"fixed": True})
    ctx_init: str = text_setting("a photo of a", nonempty=True)  # --ctx_init a_photo_of_a: n_ctx = 4 context tokens
    # Execution only: run each prompt only up to its end-of-text token, in length groups, and the class-independent
    # start + context positions once per sample (both exact under the causal mask; `text_encoder.py`); and step 0's
    # text forward once per pass, not once per sample (`EpisodicTuner._share_first_forward`). False runs open_clip's
    # encode_text path per sample, bit for bit.
    text_shortcuts: bool = True


class TPT(PandaPlugin, EpisodicTuner):
    """Test-time prompt tuning: a shared learnable context, one AdamW step per sample, episodic. With Panda the
    views' features are f̂ = normalize(f − β·m̄) (ruxideng/Panda `TPT.py`: its CoOp model normalises them)."""

    key: ClassVar[str] = "tpt"
    prefix_stable: ClassVar[bool] = True  # episodic (the run's loss scale follows the samples already seen)
    Config: ClassVar[type[MethodConfig]] = TPTConfig
    needs_text_encoder: ClassVar[bool] = True

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        return PROMPT_TUNING  # `prompt_encoder` checks the loaded model's text tower

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder, class_names=class_names)
        cfg: TPTConfig = self.config  # type: ignore[assignment]
        self.prompts = prompt_encoder(self.key, text_encoder, self.class_names, cfg.ctx_init, cfg.text_shortcuts)

    # Unseen data (C-TPT and O-TPT inherit this): the fine-grained settings - AugMix views, and for C-TPT / O-TPT the
    # fine-grained lambda (every fine-grained set has the same row; DTD stands for them).
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TPTConfig:
        check_hparams_key(hparams_key)
        return TPTConfig(augmix=hparams_key not in IMAGENET_FAMILY)

    def _init_param(self, n: int, device: torch.device) -> torch.Tensor:
        # the context restarts from "a photo of a" for every sample (`model.reset()`), in fp32
        # (docs/methods.md, "Precision in the official code")
        return self.prompts.ctx_init.to(device).expand(n, -1, -1).clone()

    def _class_features(self, param: torch.Tensor) -> torch.Tensor:
        return self.prompts(param.to(self.prompts.device))

    def _share_first_forward(self) -> bool:
        return bool(self.config.text_shortcuts)  # type: ignore[attr-defined]

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        return super()._adapt(self.panda_shift(view_feats, renormalize=True))


@dataclass(frozen=True)
class CTPTConfig(TPTConfig):
    """C-TPT (`hee-suk-yoon/C-TPT @085e6c2`): TPT − λ·ATFD."""

    # λ = 50: fine-grained sets and ImageNet (scripts/test_tpt_ctpt_fg.sh); 20: A/V2/R/Sketch (test_tpt_ctpt_ds.sh)
    lambda_term: float = setting(50.0, ge=0)


class CTPT(TPT):
    """TPT with C-TPT's dispersion reward: loss = marginal entropy − λ·ATFD(T̂)."""

    key: ClassVar[str] = "ctpt"
    prefix_stable: ClassVar[bool] = True  # episodic, as TPT
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
    """O-TPT (`ashshaksharifdeen/O-TPT @a09933f`): TPT + λ·Householder orthogonality penalty."""

    # λ = 18 fine-grained (scripts/test_tpt_otpt_fg.sh), 2 for A/V2/R/Sketch (test_tpt_otpt_ds.sh). ImageNet goes
    # with the fine-grained script as in C-TPT [ASSUMPTION: the O-TPT snapshot has no ImageNet script].
    lambda_term: float = setting(18.0, ge=0)


class OTPT(TPT):
    """TPT with O-TPT's orthogonality penalty: loss = marginal entropy + λ·householder_orthogonality(T̂)."""

    key: ClassVar[str] = "otpt"
    prefix_stable: ClassVar[bool] = True  # episodic, as TPT
    Config: ClassVar[type[MethodConfig]] = OTPTConfig

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> OTPTConfig:
        check_hparams_key(hparams_key)
        return OTPTConfig(augmix=hparams_key != "imagenet",
                          lambda_term=2.0 if hparams_key in NATURAL_SHIFT else 18.0)

    def _regulariser(self, text: torch.Tensor) -> torch.Tensor:
        return self.config.lambda_term * householder_orthogonality(text)  # type: ignore[attr-defined]
