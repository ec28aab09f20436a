"""OnZeta — online zero-shot transfer (Qian, Xu & Hu, ECCV'24; official code `idstcv/OnZeta @befef06`,
`main_online.py` l.249-273). Online and training-free; docs/methods.md § OnZeta.

State: a vision proxy w (D×K, columns unit norm, starting at the text prototypes W₀) and a label-distribution dual
ρ (K, starting at 0). Per sample x (view 0) at stream position i of n:

    lr = c_w/√(i+1), rlr = c_r/√(i+1), β_i = β·√((i+1)/n)
    q = softmax(x·W₀/τ_t)·exp(ρ), renormalised                    (OnLab's label)
    ρ ← max(0, ρ - rlr·(q - α/K))
    v = softmax(x·w/τ_i)
    out = β_i·v + (1 - β_i)·q                                      (OnZeta's label)
    w ← w - (lr/τ_i)·x(v - q)ᵀ, columns re-normalised

n is the stream's length, known in advance: `stream_length`, or the run's length announced by the runner
(`set_stream_length`). Without either, n is taken as i + 1 (β_i = β), with a warning.

Output (`output_kind = "log_probs"`): log of `out` (or of q with `output="onlab"`). Where the float32 probability
underflows to 0 the row holds its exact log computed in log space (log q = log_softmax(x·W₀/τ_t + ρ), and
log out = logaddexp(log β_i + log v, log(1-β_i) + log q)), so rows are finite and keep their order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping

import torch
import torch.nn.functional as F

from extract.methods.base import MethodConfig, OutputKind, PromptSet, TTAMethod, check_hparams_key, setting


@dataclass(frozen=True)
class OnZetaConfig(MethodConfig):
    """OnZeta's knobs: the argparse defaults of `main_online.py` (the code runs ImageNet only)."""

    n_views: int = 1  # ImageFolder with CLIP's preprocess: the original view (`main_online.py`)
    augmix: bool = False
    # the 7 Tip-Adapter ImageNet templates averaged (`imagenet_7_templates`, `zeroshot_classifier`); off ImageNet
    # the TDA/Tip-Adapter per-dataset templates (the official code has no other dataset)
    prompts: PromptSet = "dataset"
    cupl: bool = False
    tau_t: float = setting(0.01, gt=0)  # --tau_t
    tau_i: float = setting(0.04, gt=0)  # --tau_i
    cw: float = setting(0.5, ge=0)  # --cw: step size of the vision proxy
    cr: float = setting(20.0, ge=0)  # --cr: step size of the dual ρ
    alpha: float = setting(1.0, ge=0)  # --alpha: weight of the label-distribution constraint
    beta: float = setting(0.8, ge=0, le=1)  # --beta: final weight of the vision proxy
    stream_length: int = setting(0, ge=0)  # n; 0 = the run's length as the runner announces it (`set_stream_length`)
    output: Literal["onzeta", "onlab"] = "onzeta"  # combo_label (OnZeta) or text_label (OnLab)


class OnZeta(TTAMethod):
    key: ClassVar[str] = "onzeta"
    prefix_stable: ClassVar[bool] = False  # β_i = β·√((i+1)/n) reads the stream's length n (`prefix_dependence`)
    Config: ClassVar[type[MethodConfig]] = OnZetaConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    _state_fields: ClassVar[tuple[str, ...]] = ("w", "rho")
    unseen_like: ClassVar[str] = "imagenet"  # one setting for every dataset
    # no per-dataset templates exist for a user's classes: the 80 CLIP ImageNet templates
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80"})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> OnZetaConfig:
        check_hparams_key(hparams_key)
        return OnZetaConfig()

    @classmethod
    def prefix_dependence(cls, config: MethodConfig) -> str | None:
        """With the run's length as n, the first rows of a shorter run follow another schedule; a fixed
        `stream_length` makes every run's schedule the same (None)."""
        if config.stream_length:  # type: ignore[attr-defined]
            return None
        return ("onzeta's schedule beta_i = beta*sqrt((i+1)/n) reads the stream's length n (fix it with --set "
                "stream_length=N)")

    def __init__(self, config: OnZetaConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.w: torch.Tensor | None = None  # (D, K) vision proxy
        self.rho: torch.Tensor | None = None  # (K,)
        self.n_stream = int(config.stream_length) or None
        self._unknown_note = "onzeta: stream length unknown (no stream_length, none announced): beta_i = beta"
        if self.n_stream is None:
            self.warnings.append(self._unknown_note)

    def set_stream_length(self, n: int) -> None:
        """The run's length n (used unless the config fixes `stream_length`)."""
        if n < 1:
            raise ValueError(f"onzeta: stream length must be >= 1, got {n}")
        if not self.config.stream_length:  # type: ignore[attr-defined]
            self.n_stream = int(n)
            if self._unknown_note in self.warnings:
                self.warnings.remove(self._unknown_note)

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        cfg: OnZetaConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(view_feats)
        w0 = self.text_features.to(dt).T  # (D, K)
        if self.w is None:
            self.w = w0.clone()
            self.rho = torch.zeros(self.n_classes, dtype=dt, device=w0.device)
        assert self.rho is not None
        x_all = view_feats[:, 0].to(dt)  # (B, D)
        text_scores = x_all @ w0 / cfg.tau_t  # (B, K): W₀ never changes, so the whole chunk at once
        out = torch.empty(x_all.shape[0], self.n_classes, dtype=dt, device=x_all.device)
        for b in range(x_all.shape[0]):  # sequential by nature: w and ρ change after every sample
            i = self.n_seen + b
            if self.n_stream is not None and i >= self.n_stream:
                raise ValueError(f"onzeta: sample {i + 1} of a stream announced as {self.n_stream} long")
            n = self.n_stream if self.n_stream is not None else i + 1
            lr, rlr = cfg.cw / math.sqrt(i + 1), cfg.cr / math.sqrt(i + 1)
            beta = cfg.beta * math.sqrt((i + 1) / n)
            x = x_all[b]
            q = text_scores[b].softmax(0) * torch.exp(self.rho)
            q = q / q.sum()
            log_q = (text_scores[b] + self.rho).log_softmax(0)  # the same in log space, before ρ moves
            self.rho = (self.rho - rlr * (q - cfg.alpha / self.n_classes)).clamp_min(0.0)
            v_scores = x @ self.w / cfg.tau_i
            v = v_scores.softmax(0)
            if cfg.output == "onlab":
                out[b] = torch.where(q > 0, q.log(), log_q)
            else:
                combo = beta * v + (1 - beta) * q
                log_b = math.log(beta) if beta > 0 else -math.inf
                log_1b = math.log1p(-beta) if beta < 1 else -math.inf
                log_combo = torch.logaddexp(log_b + v_scores.log_softmax(0), log_1b + log_q)
                out[b] = torch.where(combo > 0, combo.log(), log_combo)
            self.w = F.normalize(self.w - (lr / cfg.tau_i) * torch.outer(x, v - q), dim=0)
        return out

    def summary(self) -> dict[str, Any]:
        """The stream length n used by β's schedule (None: unknown, β_i = β)."""
        return {"stream_length": self.n_stream}
