"""TransCLIP — transduction for vision-language models, zero-shot (Zanella, Gérin & Ben Ayed, NeurIPS'24; official
code `MaxZanella/transduction-for-vlms`, `TransCLIP_solver/TransCLIP.py` and `TransCLIP_utils.py`). Transductive over
the whole test set; docs/methods.md § TransCLIP.

The unit's N view-0 features x (N, D) and the K text prototypes t (K, D) are solved jointly:

    ŷ = softmax(s · x tᵀ)                            the zero-shot probabilities (s: the model's logit scale, 100)
    z = ŷ;  μ_k = normalize(mean of z_ik x_i over the 8 samples with the largest z_ik);  σ² = 1/D (every dim)
    W: each sample's 3 most similar other samples, weight = cosine (a sparse N x N matrix)
    11 times:  ℓ_ik = -½ Σ_d (x_id - μ_kd)² / σ²_d                        (one diagonal Gaussian per class)
               5 times:  z_i ∝ ŷ_i^λ · exp((ℓ_i + 50/(2·3) · ((Wᵀ + W) z)_i - max) / 50)
               then (not after the 11th): μ_k = normalize(Σ_i z_ik x_i / Σ_i z_ik),
                                           σ²_d = Σ_ik z_ik (x_id - μ_kd)² / Σ_ik z_ik

Output (`output_kind = "log_probs"`): log z, computed in log space where the float32 z underflows to 0.

Numerics: float32 as the official solver (it casts the fp16 features to float32 on the GPU). The Gaussian terms are
summed as matrix products (x·μ/σ² and Σ μ²/σ²: the official (2500, K, D) difference tensors are 5 GB per chunk at
ImageNet's K = 1000) and the per-sample constant Σ x²/σ², which the update subtracts with the row maximum, is left
out; the same sums in another order, within float32 rounding of them. Where the official solve divides by 0 (a small
unit: a variance of 0, a class whose weights z all underflow to 0) and gives NaN, the previous value is kept, and a
class with no weight to start from starts at its text prototype (`keep_positive`, `keep_finite_rows`).
`tests/extract/methods/test_transclip.py` checks the solve against a transcription of the official code in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch

from extract.methods.base import MethodConfig, OutputKind, PromptSet, check_hparams_key, setting
from extract.methods.transductive import TransductiveMethod, knn


@dataclass(frozen=True)
class TransCLIPConfig(MethodConfig):
    """TransCLIP's knobs in zero-shot mode: the constants of `TransCLIP_solver`, one setting for every dataset and
    backbone (`scripts/transclip_zs.sh` runs all eleven sets with the same code)."""

    n_views: int = 1  # pre-extracted features, one per image (`utils.pre_load_features`)
    augmix: bool = False
    prompts: PromptSet = "transclip"  # `datasets/<set>.py` `template`; the first template only (`prepare_objects`)
    cupl: bool = False
    unit: int = setting(0, ge=0)  # samples solved jointly: 0 = the whole run (the official test set)
    max_iter: int = setting(10, ge=0)  # `TransCLIP.py` l.53: 10 updates of μ and σ², 11 of z
    z_iters: int = setting(5, ge=1)  # `update_z(max_iter=5)`
    n_neighbors: int = setting(3, ge=1)  # `TransCLIP.py` l.55
    lambda_value: float = setting(1.0, ge=0)  # `get_parameters`: 1 in zero-shot (0.5 with shots)
    n_most_confident: int = setting(8, ge=1)  # `init_mu`: 8 pseudo-labels per class
    temperature: float = setting(50.0, gt=0)  # the 50 of `update_z`: exp(·/50) and the 50/(2·n_neighbors) weight


class TransCLIP(TransductiveMethod):
    key: ClassVar[str] = "transclip"
    prefix_stable: ClassVar[bool] = False  # each row depends on every sample of its unit (`prefix_dependence`)
    Config: ClassVar[type[MethodConfig]] = TransCLIPConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    unseen_like: ClassVar[str] = "imagenet"  # one setting for every dataset
    # no per-dataset template exists for a user's classes: "a photo of a {}.", the ImageNet family's own template
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "single"})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TransCLIPConfig:
        check_hparams_key(hparams_key)
        return TransCLIPConfig()

    def _solve(self, feats: torch.Tensor) -> torch.Tensor:
        cfg: TransCLIPConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(feats)
        x, t = feats[:, 0].to(dt), self.text_features.to(dt)  # (N, D), (K, D)
        logits = self.logit_scale * x @ t.T
        y_hat, log_y = logits.softmax(1), logits.log_softmax(1)
        z = y_hat.clone()
        mu = init_mu(x, z, cfg.n_most_confident, t)
        std = torch.full((x.shape[1],), 1.0 / x.shape[1], dtype=dt, device=x.device)  # std_init = 1/d
        graph = affinity(x, cfg.n_neighbors)
        coef = cfg.temperature / (2 * cfg.n_neighbors)
        log_z = z
        for k in range(cfg.max_iter + 1):
            lik = x @ (mu / std).T - 0.5 * (mu * mu / std).sum(1)  # -½ Σ (x - μ)²/σ² + a per-sample constant
            z, log_z = z_update(lik, y_hat, log_y, z, graph, coef=coef, lam=cfg.lambda_value,
                                temperature=cfg.temperature, iters=cfg.z_iters, want_log=k == cfg.max_iter)
            if k == cfg.max_iter:
                break
            a, s = z.T @ x, z.sum(0)  # (K, D), (K,)
            n = x.shape[0]
            # `update_mu`: the 1/n weights of the official code
            mu = keep_finite_rows(unit_rows((a / n) / (s / n)[:, None]), mu)
            # `update_sigma`: Σ_ik z_ik (x_i - μ_k)² with the new μ, expanded
            num = z.sum(1) @ (x * x) - 2 * (mu * a).sum(0) + (s[:, None] * mu * mu).sum(0)
            std = keep_positive(num / z.sum(), std)
        return log_z


def keep_positive(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """A refitted variance, where it is positive, else the previous one: a unit whose samples do not vary in a
    dimension (one sample, or duplicates) fits a variance of 0 there, which the official solve divides by (NaN)."""
    return torch.where(new > 0, new, old)


def keep_finite_rows(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Each row of a refitted (K, D) matrix where it is finite, else that row of `old`: in a small unit a class's
    weights z_ik can all underflow to 0 (no sample near it), and the official mean of them, 0/0, is NaN."""
    return torch.where(torch.isfinite(new).all(dim=-1, keepdim=True), new, old)


def unit_rows(m: torch.Tensor) -> torch.Tensor:
    """Each row divided by its norm (the official `mu /= mu.norm(dim=-1, keepdim=True)`, without an epsilon)."""
    return m / m.norm(dim=-1, keepdim=True)


def init_mu(x: torch.Tensor, z: torch.Tensor, n_confident: int, t: torch.Tensor) -> torch.Tensor:
    """(K, D) class means to start from (`init_mu`, zero-shot): for each class the mean of z_ik x_i over its
    `n_confident` samples of largest z_ik (all of them when the unit is smaller), summed in sample order, then
    normalised; a class whose weights underflow to 0 (`keep_finite_rows`) starts at its text prototype t_k."""
    m = min(n_confident, z.shape[0])
    vals, idx = z.topk(m, dim=0)  # (m, K)
    idx, order = idx.sort(dim=0)  # the official code reads them through `nonzero`: in sample order
    vals = vals.gather(0, order)
    return keep_finite_rows(unit_rows((vals[..., None] * x[idx]).mean(0)), t)


def affinity(x: torch.Tensor, n_neighbors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, Wᵀ) as sparse (N, N) matrices: row i holds the cosines to its `n_neighbors` most similar samples
    (`build_affinity_matrix`: the `n_neighbors + 1` largest of row i without the first, the sample itself; at most
    N - 1 when the unit is smaller)."""
    n = x.shape[0]
    k = min(n_neighbors + 1, n)
    sims, idx = knn(x, x, k)
    sims, idx = sims[:, 1:], idx[:, 1:]
    rows = torch.arange(n, device=x.device)[:, None].expand_as(idx)
    edges = torch.stack([rows.flatten(), idx.flatten()])
    w = torch.sparse_coo_tensor(edges, sims.flatten(), (n, n), check_invariants=False).coalesce()
    return w, w.t().coalesce()


def z_update(lik: torch.Tensor, y_hat: torch.Tensor, log_y: torch.Tensor, z: torch.Tensor,
             graph: tuple[torch.Tensor, torch.Tensor], *, coef: float, lam: float, temperature: float, iters: int,
             shift: torch.Tensor | None = None, want_log: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The z-step of TransCLIP and StatA (`update_z`): `iters` times
    z_i ∝ ŷ_i^λ exp((ℓ_i + coef ((Wᵀ + W) z)_i + shift - max) / temperature).

    Args:
        lik: (N, K) log-likelihoods; y_hat, log_y: (N, K) zero-shot probabilities and their logs; z: (N, K).
        graph: (W, Wᵀ) from `affinity`. shift: (K,) added after the graph term (StatA's -½ log det Σ_k).
        want_log: also return log z of the last step, computed in log space (else z itself is returned twice).

    Returns:
        (z, log z) with log z = log(z) where z > 0 in the working dtype, else the log-space value.
    """
    w, wt = graph
    log_z = z
    for it in range(iters):
        inter = lik + coef * (torch.sparse.mm(wt, z) + torch.sparse.mm(w, z))
        if shift is not None:
            inter = inter + shift
        inter = inter - inter.max(dim=1, keepdim=True).values
        powered = y_hat if lam == 1 else y_hat ** lam
        num = powered * torch.exp(inter / temperature)
        z = num / num.sum(dim=1, keepdim=True)
        if want_log and it == iters - 1:
            log_num = lam * log_y + inter / temperature
            log_z = torch.where(z > 0, z.log(), log_num - log_num.logsumexp(dim=1, keepdim=True))
    return z, (log_z if want_log else z)
