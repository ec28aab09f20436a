"""StatA — realistic test-time adaptation of vision-language models (Zanella, Fuchs, De Vleeschouwer & Ben Ayed,
CVPR'25; official code `MaxZanella/StatA`, `solvers/StatA.py`, settings in `main.py`). Transductive over a batch or
the whole set; docs/methods.md § StatA.

TransCLIP's solve (extract/methods/transclip.py) with a class-wise diagonal covariance and a statistical anchor on the
text prototypes t (K, D):

    ŷ = softmax(s · x tᵀ);  z = ŷ;  μ_k = t_k;  Σ_k = Σ₀ for every k, Σ₀ = Σ_ik z_ik (x_i - t_k)² / N
    W: each sample's 3 most similar other samples, weight = cosine
    11 times:  ℓ_ik = -½ Σ_d (x_id - μ_kd)² / Σ_kd
               5 times:  z_i ∝ ŷ_i^λ · exp((ℓ_i + λ_L·50/(2·3) · ((Wᵀ + W) z)_i - ½ Σ_d log Σ_kd - max) / 50)
               then (not after the 11th):
                   β_k = n_k / (α + n_k), n_k = #{i: argmax z_i = k}   (soft: n_k = Σ_i z_ik)
                   μ_k = normalize(β_k · normalize(Σ_i z_ik x_i / Σ_i z_ik) + (1 - β_k) t_k)
                   Σ_k = β_k · Σ_i z_ik (x_i - μ_k)² / Σ_i z_ik + (1 - β_k) · (Σ₀ + (t_k - μ_k)²)

Two keys: `stata` solves the whole run (the official `--batch_size -1` rows, "All classes"), `stata-online` consecutive
batches of 128 stream positions, each on its own (the official online setting, `scripts/StatA_online.sh`: the same
solver per batch, no state between batches). `--set unit=N` picks any batch size.

Output (`output_kind = "log_probs"`): log z, computed in log space where the float32 z underflows to 0.

Numerics: float32 as the official solver. Σ₀ reproduces the official `init_cov`, which divides its running sum by N
after every chunk of 2500 samples (`init_cov_chunk`); the Gaussian and covariance sums are matrix products instead
of the official (2500, K, D) difference tensors, the same sums in another order. A class whose z all underflow to 0
(a unit of a sample or two) has β_k = 0 and takes the anchor alone, where the official 0/0 gives NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch

from extract.methods.base import MethodConfig, OutputKind, PromptSet, check_hparams_key, setting
from extract.methods.transclip import affinity, keep_finite_rows, keep_positive, unit_rows, z_update
from extract.methods.transductive import TransductiveMethod


@dataclass(frozen=True)
class StatAConfig(MethodConfig):
    """StatA's knobs: `main.py`'s argparse defaults and `get_hp('StatA')`, the solver's own defaults; one setting for
    every dataset and backbone ("with default values in all experiments", `main.py` l.34)."""

    n_views: int = 1  # pre-extracted features, one per image (`utils.pre_load_features`)
    augmix: bool = False
    prompts: PromptSet = "transclip"  # `datasets/<set>.py` `template` (`clip_classifier(..., reduce=None)`)
    cupl: bool = False
    unit: int = setting(0, ge=0)  # samples solved jointly: 0 = the whole run (`--batch_size -1`)
    alpha: float = setting(1.0, ge=0)  # --alpha: the anchor's weight, β_k = n_k / (α + n_k)
    lambda_laplacian: float = setting(1.0, ge=0)  # --lambda_laplacian
    soft_beta: bool = False  # --soft_beta: n_k = Σ_i z_ik instead of the hard counts
    lambda_y_hat: float = setting(1.0, ge=0)  # `get_hp`: 'lambda_y_hat': 1
    n_neighbors: int = setting(3, ge=1)  # `get_hp`: 'n_neighbors': 3
    max_iter: int = setting(10, ge=0)  # `StatA_solver(max_iter=10)`
    z_iters: int = setting(5, ge=1)  # `update_z(max_iter=5)`
    temperature: float = setting(50.0, gt=0)  # the 50 of `update_z`: exp(·/50) and the 50/(2·n_neighbors) weight
    # `init_cov` divides its running sum by N inside its loop over chunks of 2500 samples (StatA.py l.145), so with
    # more than 2500 samples the first chunks count less; a value >= the unit's size divides once
    init_cov_chunk: int = setting(2500, ge=1)


class StatA(TransductiveMethod):
    key: ClassVar[str] = "stata"
    prefix_stable: ClassVar[bool] = False  # each row depends on every sample of its unit (`prefix_dependence`)
    Config: ClassVar[type[MethodConfig]] = StatAConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    unseen_like: ClassVar[str] = "imagenet"  # one setting for every dataset
    # no per-dataset template exists for a user's classes: "a photo of a {}.", the ImageNet family's own template
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "single"})
    #: the transductive unit of this key (0: the whole run)
    default_unit: ClassVar[int] = 0

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> StatAConfig:
        check_hparams_key(hparams_key)
        return StatAConfig(unit=cls.default_unit)

    def _solve(self, feats: torch.Tensor) -> torch.Tensor:
        cfg: StatAConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(feats)
        x, t = feats[:, 0].to(dt), self.text_features.to(dt)  # (N, D), (K, D)
        logits = self.logit_scale * x @ t.T
        y_hat, log_y = logits.softmax(1), logits.log_softmax(1)
        z, mu = y_hat.clone(), t.clone()
        cov0 = init_cov(x, t, z, cfg.init_cov_chunk).expand(t.shape[0], -1)  # (K, D)
        cov = cov0
        graph = affinity(x, cfg.n_neighbors)
        coef = cfg.lambda_laplacian * cfg.temperature / (2 * cfg.n_neighbors)
        log_z = z
        for k in range(cfg.max_iter + 1):
            inv = 1.0 / cov
            # -½ Σ_d (x_d - μ_kd)² / Σ_kd, expanded
            lik = -0.5 * ((x * x) @ inv.T - 2 * x @ (mu * inv).T + (mu * mu * inv).sum(1))
            z, log_z = z_update(lik, y_hat, log_y, z, graph, coef=coef, lam=cfg.lambda_y_hat,
                                temperature=cfg.temperature, iters=cfg.z_iters, shift=-0.5 * cov.log().sum(1),
                                want_log=k == cfg.max_iter)
            if k == cfg.max_iter:
                break
            mu, fitted = _update_gaussians(x, t, z, cov0, cfg)
            cov = keep_positive(fitted, cov)
        return log_z


class StatAOnline(StatA):
    """StatA on consecutive batches of 128 stream positions, each solved on its own (`scripts/StatA_online.sh`)."""

    key: ClassVar[str] = "stata-online"
    prefix_stable: ClassVar[bool] = False  # each row depends on the other samples of its batch
    default_unit: ClassVar[int] = 128  # `StatA_online.sh`: batch_size 128 (the README's example says 64)


def init_cov(x: torch.Tensor, t: torch.Tensor, z: torch.Tensor, chunk: int) -> torch.Tensor:
    """(D,) Σ₀ as the official `init_cov` computes it: over chunks of `chunk` samples, add the chunk's
    Σ_ik z_ik (x_i - t_k)² to the running sum, then divide the running sum by N (inside the loop)."""
    n = x.shape[0]
    cov = None
    for a in range(0, n, chunk):
        zc, xc = z[a:a + chunk], x[a:a + chunk]
        part = zc.sum(1) @ (xc * xc) - 2 * (t * (zc.T @ xc)).sum(0) + (zc.sum(0)[:, None] * t * t).sum(0)
        cov = part if cov is None else cov + part
        cov = cov / n
    assert cov is not None
    return cov


def _update_gaussians(x: torch.Tensor, t: torch.Tensor, z: torch.Tensor, cov0: torch.Tensor, cfg: StatAConfig
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`update_beta`, `update_mu`, `update_cov`: the anchored class means (K, D) and covariances (K, D)."""
    s = z.sum(0)  # (K,)
    if cfg.soft_beta:
        beta = s / (cfg.alpha + s)
    else:
        counts = torch.bincount(z.argmax(1), minlength=z.shape[1]).to(z.dtype)
        beta = counts / (cfg.alpha + counts + 1e-12)
    b = beta[:, None]
    a = z.T @ x  # (K, D)
    # a class whose z underflowed to 0 in every sample (a unit of a sample or two) has β_k = 0: the anchor alone,
    # its data terms 0 (the official 0/0 makes them NaN, and NaN·0 every row)
    zero = torch.zeros_like(a)
    mu = unit_rows(b * keep_finite_rows(unit_rows(a / s[:, None]), zero) + (1 - b) * t)
    # Σ_i z_ik (x_i - μ_k)² with the new μ, expanded (a true sum of squares: rounding never takes it below 0)
    spread = keep_finite_rows(((z.T @ (x * x)) - 2 * mu * a + s[:, None] * mu * mu).clamp_min(0) / s[:, None], zero)
    delta = t - mu
    return mu, b * spread + (1 - b) * (cov0 + delta * delta)
