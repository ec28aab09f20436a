"""DynaPrompt: an online buffer of prompts, tuned and selected per sample (`zzzx1224/DynaPrompt @acd33cf`,
`dynap_classification.py` via `run_dynap.sh`; docs/methods.md, "DynaPrompt (`dynaprompt`)").

State carried over the whole stream (never reset): P = 12 residual contexts r_j (P, 4, W), starting at 0, each
giving the prompt embed("a photo of a") + r_j; `ctx_order` (least recently used first) and `ctx_use` (times
selected since the last reset); the loss scale. Per sample, with V views:

1. If every prompt has been used (`ctx_use` > 0 for all), the least recently used one, j₀ = ctx_order[0], is reset
   (r_j₀ = 0, ctx_use[j₀] = 0). With a full buffer this happens at every sample.
2. A fresh AdamW state (the official `optimizer.load_state_dict(optim_state)`).
3. On detached logits z (V, P, K) of all prompts: ent_j = mean over views of the entropy of z[:, j];
   plpd_j = mean over the V − 1 augmented views of (max_k z[0, j] − max_k z[v, j]).
4. `select_prompts`: the init prompt ctx_order[0] plus the prompts the official intersection picks (with its quirk,
   see there); each selected prompt (with multiplicity) moves to the end of `ctx_order`, `ctx_use` += 1.
5. The int(V·0.1) views of lowest entropy averaged over the selected prompts; loss = mean over the selected prompts
   of the marginal entropy of those views; one AdamW step (lr 5e-3, weight decay 0.01) on the whole (P, 4, W)
   tensor, so every residual decays by (1 − 5e-5), selected or not, while only the selected ones get an update.
6. Prediction: the original view's logits, averaged over the selected prompts (with multiplicity) after the step.

Numerics: the official run keeps fp32 weights and context and runs under autocast with one
`GradScaler(init_scale=1000)` for the run; on CUDA with `amp` (default) the same here (a non-finite step is
skipped - no decay either - and halves the scale; 2000 finite steps double it). On the CPU everything is fp32 and
the scale is 1 (the default reproduces what the CPU can).

Samples are strictly sequential (each one's selection depends on every earlier update), so `adapt` runs them one at
a time. Deviations, each exact in exact arithmetic or outside the official setting:
    * Prompts with identical residuals (fresh or just reset) are encoded once per sample in step 3, so their
      entropies tie exactly, as they do in exact arithmetic; ties in every ordering are broken by prompt index
      (stable sorts), where the official `topk` leaves them to the kernel. Step 5 encodes only the selected prompts.
    * With one view there are no augmented views: plpd is 0 for every prompt (the official mean over none is NaN).
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
    Towers,
    TTAMethod,
    check_hparams_key,
    setting,
    text_setting,
)
from extract.methods.common import marginal_entropy, n_confident, softmax_entropy
from extract.methods.tpt import AdamWState, MixedPrecision, adamw_step, prompt_encoder, unscaled_grads


def select_prompts(ent: torch.Tensor, plpd: torch.Tensor, init: int) -> list[int]:
    """DynaPrompt's prompt selection (`dynap_classification.py:test_time_tuning`, l.119-132).

    ent_order = prompts by descending entropy; r = position of `init` in it; list1 = ent_order[min(r + 1, P − 1):]
    (the prompts of lower entropy; `init` itself when r = P − 1); list2 = the r prompts of largest plpd; c =
    sorted(list1 ∩ list2). The official code then takes `ent_order[c]` - the common prompt *ids* used as
    *positions* in ent_order - plus `init`; this quirk is kept, so `init` may appear twice. Ties: lower index first.

    Args:
        ent: (P,) mean entropy of each prompt over the views.
        plpd: (P,) mean max-logit drop from the original view to the augmented views.
        init: the least recently used prompt.

    Returns:
        The selected prompt ids, `init` last; duplicates count twice in the loss and the prediction.

    Example:
        >>> select_prompts(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([0.0, 0.0, 5.0]), 1)  # r = 1, {2} ∩ {2}
        [2, 1]
        >>> select_prompts(torch.tensor([3.0, 2.0, 1.0]), torch.tensor([0.0, 0.0, 5.0]), 0)  # r = 0: list2 empty
        [0]
        >>> # r = 2 = P - 1: list1 = [init] = [0]; {0} ∩ {0, 2} = {0}, read as a position: ent_order[0] = 2
        >>> select_prompts(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, 0.0, 1.0]), 0)
        [2, 0]
    """
    p = ent.shape[0]
    ent_order = torch.sort(ent, descending=True, stable=True).indices.tolist()
    plpd_order = torch.sort(plpd, descending=True, stable=True).indices.tolist()
    r = ent_order.index(init)
    common = sorted(set(ent_order[min(r + 1, p - 1):]) & set(plpd_order[:r]))
    return [ent_order[c] for c in common] + [init]


@dataclass(frozen=True)
class DynaPromptConfig(MethodConfig):
    """DynaPrompt (`zzzx1224/DynaPrompt @acd33cf`): `run_dynap.sh` + `scripts/test_dynap.sh`; nothing per dataset
    but the views."""

    n_views: int = 64  # -b 64 (scripts/test_dynap.sh `bs=64`): the original + 63 views
    augmix: bool = True  # `AugMixAugmenter(..., augmix=len(set_id) > 1)`: set per dataset in `default_config`
    # the prompts are the learnable "{ctx_init} {class}." themselves: no prototype set to choose
    prompts: PromptSet = field(default="single", metadata={"fixed": True})
    cupl: bool = field(default=False, metadata={"fixed": True})
    episodic: bool = field(default=False, metadata={"fixed": True})  # `--onlinetpt`: the buffer is never reset
    # ctx_init=a_photo_of_a (scripts/test_dynap.sh), n_ctx 4 (run_dynap.sh `ntx=4`)
    ctx_init: str = text_setting("a photo of a", nonempty=True)
    num_prompts: int = setting(12, ge=1)  # run_dynap.sh `num_p=12`
    lr: float = setting(5e-3, ge=0)  # run_dynap.sh `lr=0.005`
    weight_decay: float = setting(0.01, ge=0)  # torch.optim.AdamW default (dynap_classification.py passes only the lr)
    beta1: float = setting(0.9, ge=0, lt=1)  # AdamW defaults
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)
    tta_steps: int = setting(1, ge=0)  # --tta_steps default 1
    selection_p: float = setting(0.1, gt=0, le=1)  # run_dynap.sh `selection_p=0.1`: 6 of 64 views
    # reset the least recently used prompt once all are used (l.396; the official skips it when the log name
    # contains "noapp", an ablation)
    reset_lru: bool = True
    amp: bool = True  # autocast + GradScaler on CUDA (l.102, l.230); ignored on the CPU (fp32, scale 1)
    grad_scale_init: float = setting(1000.0, gt=0)  # GradScaler(init_scale=1000), l.230
    grad_scale_growth_interval: int = setting(2000, ge=1)  # GradScaler default
    # Execution only: run each prompt up to its end-of-text token and the shared start + context positions once
    # per context (exact under the causal mask; `text_encoder.py`). False runs the full 77-token sequences.
    text_shortcuts: bool = True


class DynaPrompt(MixedPrecision, TTAMethod):
    """Online prompt buffer: per sample, reset the least recently used prompt, select prompts by entropy and
    prediction drop, one AdamW step on the selected prompts' marginal entropy, predict with their mean logits."""

    key: ClassVar[str] = "dynaprompt"
    prefix_stable: ClassVar[bool] = True  # the prompt buffer holds updates of samples already seen
    Config: ClassVar[type[MethodConfig]] = DynaPromptConfig
    needs_text_encoder: ClassVar[bool] = True
    _state_fields: ClassVar[tuple[str, ...]] = ("residual", "ctx_order", "ctx_use", "loss_scale", "skipped_steps")
    # unseen data: the fine-grained views (AugMix); nothing else depends on the dataset
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        return PROMPT_TUNING  # `prompt_encoder` checks the loaded model's text tower

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: DynaPromptConfig = self.config  # type: ignore[assignment]
        if class_names is not None and len(class_names) != self.n_classes:
            raise ValueError(f"{self.key}: {len(class_names)} class names but text_features has "
                             f"{self.n_classes} rows")
        self.prompts = prompt_encoder(self.key, text_encoder, class_names, cfg.ctx_init, cfg.text_shortcuts)
        n = cfg.num_prompts
        # residual contexts, zero at first (custom_clip_lessctx.py: `ctx_vectors = torch.zeros(...)`), fp32
        self.residual = torch.zeros(n, *self.prompts.ctx_init.shape, dtype=torch.float32,
                                    device=self.prompts.device)
        self.ctx_order: list[int] = list(range(n))  # least recently used first
        self.ctx_use: list[int] = [0] * n
        self._init_loss_scale()

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DynaPromptConfig:
        check_hparams_key(hparams_key)
        return DynaPromptConfig(augmix=hparams_key not in IMAGENET_FAMILY)

    # -- pieces --------------------------------------------------------------------------------------------------
    def _text(self, residual: torch.Tensor) -> torch.Tensor:
        """(n, n_ctx, W) residuals -> (n, K, D) L2-normalised class features of the prompts init + residual."""
        return self.prompts((self.prompts.ctx_init + residual).to(self.prompts.device))

    def _logits(self, feats: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """s · f̂ t̂ᵀ: feats (V, D), text (n, K, D) -> (V, n, K)."""
        return super()._logits(feats, text).transpose(0, 1)  # (n, V, K) -> (V, n, K)

    def _all_prompt_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """(V, P, K) detached logits of every prompt; prompts with equal residuals are encoded once."""
        flat = self.residual.flatten(1)
        uniq, inverse = torch.unique(flat, dim=0, return_inverse=True)
        with torch.no_grad(), self._autocast(feats.device):
            z = self._logits(feats, self._text(uniq.view(-1, *self.residual.shape[1:])))
        return z[:, inverse]

    def _step(self, feats: torch.Tensor, state: AdamWState) -> list[int]:
        """Steps 3-5 for one sample: select prompts, update the bookkeeping, one (loss-scaled) AdamW step.
        Returns the selected prompt ids (with multiplicity)."""
        cfg: DynaPromptConfig = self.config  # type: ignore[assignment]
        dev = feats.device
        if cfg.num_prompts > 1:
            z = self._all_prompt_logits(feats)
            ent = softmax_entropy(z).mean(0)  # (P,)  official `entropy(p_pred).mean(0)`
            top = z.max(-1).values  # (V, P)
            plpd = ((top[0] - top[1:]).mean(0) if feats.shape[0] > 1 else torch.zeros_like(ent))
            ent_plpd = torch.stack([ent.float(), plpd.float()]).cpu()  # one host sync for both (a GPU waits once)
            selected = select_prompts(ent_plpd[0], ent_plpd[1], self.ctx_order[0])
            for i in selected:  # (a prompt selected twice moves and counts twice, as in the official loop)
                self.ctx_order.remove(i)
                self.ctx_order.append(i)
                self.ctx_use[i] += 1
        else:
            selected = [0]
        ids = sorted(set(selected))
        pos = torch.tensor([ids.index(i) for i in selected], device=dev)
        amp = self._use_amp(dev)
        param = self.residual.detach().clone().requires_grad_(True)
        with self._autocast(dev):
            z = self._logits(feats, self._text(param[ids]))[:, pos]  # (V, n_sel, K)
            n = n_confident(z.shape[0], cfg.selection_p)
            views = torch.argsort(softmax_entropy(z.detach()).mean(-1), stable=True)[:n]
            # marginal entropy of the chosen views, per selected prompt, then the mean over prompts (`avg_entropy`)
            loss = marginal_entropy(z[views].transpose(0, 1)).float().mean()
        (grad,), finite = unscaled_grads(loss, [param], self.loss_scale, amp=amp)
        self.residual = adamw_step(self.residual[None], grad[None], state, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                   eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                                   active=torch.tensor([finite], device=dev))[0].detach()
        self._count_step(finite, amp)
        return selected

    def _adapt_one(self, feats: torch.Tensor) -> torch.Tensor:
        """One sample: (V, D) view features -> (K,) logits; updates the buffer."""
        cfg: DynaPromptConfig = self.config  # type: ignore[assignment]
        if cfg.reset_lru and cfg.num_prompts > 1 and min(self.ctx_use) > 0:
            j = self.ctx_order[0]
            self.ctx_use[j] = 0
            self.residual[j] = 0.0
        state = AdamWState.zeros_like(self.residual[None])  # the optimiser state is reset per sample
        selected = [self.ctx_order[0]]
        for _ in range(cfg.tta_steps):
            selected = self._step(feats, state)
        ids = sorted(set(selected))
        pos = torch.tensor([ids.index(i) for i in selected], device=feats.device)
        with torch.no_grad(), self._autocast(feats.device):
            z = self._logits(feats[:1], self._text(self.residual[ids]))[0, pos]  # (n_sel, K), the original view
            return z.mean(0).float()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        dev = view_feats.device
        feats = view_feats.to(torch.promote_types(view_feats.dtype, torch.float32))
        self._loss_scaling = self._use_amp(dev)
        if self.residual.device != dev:  # (a state loaded on another device)
            self.residual = self.residual.to(dev)
        return torch.stack([self._adapt_one(f) for f in feats])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`TTAMethod.load_state_dict`, with the residuals checked against this buffer's shape and kept fp32."""
        super().load_state_dict(state)
        want = (self.config.num_prompts, *self.prompts.ctx_init.shape)  # type: ignore[attr-defined]
        if tuple(self.residual.shape) != want:
            raise ValueError(f"{self.key} state holds residuals of shape {tuple(self.residual.shape)}, "
                             f"this buffer needs {want}")
        self.residual = self.residual.float()


__all__ = ["DynaPrompt", "DynaPromptConfig", "select_prompts"]
