"""OGA — Online Gaussian Adaptation (Fuchs, Zanella & De Vleeschouwer, 2025; official code `cfuchs2023/OGA
@b91d449`, `OGA/OGA_core.py` `GaussAdapt`, driven by `runner.py` l.155-271). Online and training-free;
docs/methods.md, "OGA (`oga`)".

State: a memory of at most `shot_capacity` (8) features per class with their zero-shot entropies, class means μ_k
(from the text prototypes) and one shared precision Λ (from d·I). Per batch of `batch_size` samples (runner.py
l.199-262), with the zero-shot probabilities ŷ = softmax(s·x·Tᵀ), entropies H = -Σ ŷ log(ŷ + 1e-9) and labels
argmax ŷ (runner.py l.136-146):

1. Memory (`update_memory`, one sample at a time): a sample whose entropy is below the largest entropy its
   pseudo-class holds replaces that item (the first such slot); empty slots hold log K.
2. If anything entered: μ_k = Σ_slots memory / capacity for the classes holding >= 2 items (a sum over the
   capacity, not the count: kept), and Λ from the centred memory (`__update_sigma`, "RidgeMoorePenrose": the
   shrinkage estimator d·pinv((n-1)M + tr(M)·I) up to n <= 4d items, then pinv(M); centring on μ_k, which is still
   the text prototype for a class with one item), once any class holds >= 3 items.
3. Output, for every sample of the batch with the updated model: z ∝ ŷ · softmax(τ·log N(x; μ_k, Λ⁻¹)) (`get_MAP`
   with `simplex_p=True`), log N = x·Λμ_k - ½μ_kᵀΛμ_k - ½xᵀΛx (`get_log_probs`).

Output (`output_kind = "log_probs"`): log z; where the official float32 softmax underflows and z is exactly 0 the
row holds the exact log computed in log space (finite, ordered).

Numerics (`fp16`, default true, the official run): features and text prototypes are float16 (`clip.load` on CUDA,
features cached as encoded), the zero-shot logits float16 stored in float64 (ŷ, H in float64), the memory and its
entropies float16, μ, Λ and the Gaussian scores float32, z float64. The official memory also stores each item's ŷ
(`memory_soft_labels`), which nothing reads: not kept here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping

import torch

from extract.methods.base import MethodConfig, OutputKind, PromptSet, TTAMethod, check_hparams_key, setting

SigmaEstimator = Literal["RidgeMoorePenrose", "Ridge", "MoorePenrose"]


@dataclass(frozen=True)
class OGAConfig(MethodConfig):
    """OGA's knobs: the argparse defaults of `main.py` (no per-dataset settings in the official code)."""

    n_views: int = 1  # features of CLIP's preprocess, no augmentation (`compute_features.py`, `utils.py`)
    augmix: bool = False
    # "standard" prompts: `dataset.template` (`utils.py:load_clip_classifier`); the `datasets` package is not in the
    # repository, the TransCLIP/StatA one it follows has CoOp's single templates [assumption: docs/methods.md]
    prompts: PromptSet = "transclip"
    cupl: bool = False
    shot_capacity: int = setting(8, ge=1)  # --shot_capacity
    tau: float = setting(0.05, ge=0)  # --tau: temperature of the Gaussian log-likelihoods in the MAP
    sig_type: SigmaEstimator = "RidgeMoorePenrose"  # --sig_type
    normalize_mu: bool = False  # --normalize_mu
    # Samples per OGA batch (memory over the batch, then the batch predicted). Official: --batch_size 32. zaec's
    # default 1, TTABC's (`algorithms.py` oga batch_size 1) and every online method's here: a row never reads a later
    # sample. With S > 1 each `adapt` call (the runner's --adapt-batch, 64) is cut into batches of S from its first
    # sample: S = 32 gives the official batches.
    batch_size: int = setting(1, ge=1)
    entropy_eps: float = setting(1e-9, ge=0)  # H = -Σ ŷ log(ŷ + 1e-9) (`runner.py` l.146)
    # float16 as the official run (module docstring); False: float32 features, prototypes and memory (a deviation)
    fp16: bool = True


class OGA(TTAMethod):
    key: ClassVar[str] = "oga"
    # rows read the samples already seen and those of their own batch, which an `adapt` call holds whole
    prefix_stable: ClassVar[bool] = True
    Config: ClassVar[type[MethodConfig]] = OGAConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    _state_fields: ClassVar[tuple[str, ...]] = ("mus", "inv_sig", "memory", "mem_state", "mem_entropy")
    # one setting for every dataset; a user's classes have no CoOp template: "a photo of a {}." (ImageNet's)
    unseen_like: ClassVar[str] = "imagenet"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "single"})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> OGAConfig:
        check_hparams_key(hparams_key)
        return OGAConfig()

    def __init__(self, config: OGAConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.mus: torch.Tensor | None = None  # (K, d) class means
        self.inv_sig: torch.Tensor | None = None  # (d, d) shared precision
        self.memory: torch.Tensor | None = None  # (K, capacity, d)
        self.mem_state: torch.Tensor | None = None  # (K, capacity) bool: slot filled
        self.mem_entropy: torch.Tensor | None = None  # (K, capacity) zero-shot entropy of each item (log K: empty)

    def _dtypes(self, view_feats: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
        """(features/memory dtype, Gaussian dtype): float16/float32 under `fp16`, else the compute dtype twice."""
        dt = self.compute_dtype(view_feats)
        return (torch.float16 if self.config.fp16 and dt != torch.float64 else dt), dt

    def _init_state(self, device: torch.device, low: torch.dtype, wide: torch.dtype) -> None:
        k, d, cap = self.n_classes, self.dim, self.config.shot_capacity
        # `clip_prototypes.clone().type(torch.float32)`: a copy, whatever the dtypes (μ is written in place)
        self.mus = self.text_features.to(device, low).to(wide, copy=True)
        self.inv_sig = d * torch.eye(d, device=device, dtype=wide)
        self.memory = torch.zeros(k, cap, d, device=device, dtype=low)
        self.mem_state = torch.zeros(k, cap, device=device, dtype=torch.bool)
        # `-torch.log(torch.tensor(1/K))`: float32, then met by the memory's dtype
        log_k = -torch.log(torch.tensor(1 / k, dtype=torch.float32))
        self.mem_entropy = torch.full((k, cap), float(log_k), device=device, dtype=torch.float32).to(low)

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        c: OGAConfig = self.config  # type: ignore[assignment]
        low, wide = self._dtypes(view_feats)
        if self.mus is None:
            self._init_state(view_feats.device, low, wide)
        x = view_feats[:, 0].to(low)  # (B, d)
        # `temp * test_features @ clip_prototypes`: the scaled features are rounded first, then stored in float64
        zs = ((self.logit_scale * x) @ self.text_features.to(low).T).to(torch.float64)  # (B, K)
        probs = zs.softmax(-1)
        entropy = -(torch.log(probs + c.entropy_eps) * probs).sum(-1)
        labels = zs.argmax(-1).tolist()
        out = torch.empty_like(zs)
        for s in range(0, x.shape[0], c.batch_size):  # sequential by nature: the memory changes along the stream
            e = min(s + c.batch_size, x.shape[0])
            updated = [self._offer(x[j], entropy[j], labels[j]) for j in range(s, e)]
            if any(updated):
                self._update_mu()
                self._update_sigma()
            out[s:e] = self._log_posterior(x[s:e], zs[s:e], probs[s:e])
        return out

    def _offer(self, x: torch.Tensor, entropy: torch.Tensor, y: int) -> bool:
        """`__update_memory_entropy`: replace class y's worst item if x's entropy is below it. The float64 entropy
        meets the float16 memory in the memory's dtype (the comparison, then the stored value)."""
        assert self.mem_entropy is not None and self.memory is not None and self.mem_state is not None
        h = entropy.to(self.mem_entropy.dtype)
        row = self.mem_entropy[y]
        if not bool((h < row).any()):
            return False
        slot = int(torch.argmax(row))  # the first slot of largest entropy
        self.memory[y, slot] = x
        self.mem_entropy[y, slot] = h
        self.mem_state[y, slot] = True
        return True

    def _update_mu(self) -> None:
        """`__update_mu`: the mean over all `capacity` slots (empty ones count as zeros), for classes with >= 2."""
        assert self.mus is not None and self.memory is not None and self.mem_state is not None
        means = (self.mem_state[..., None] * self.memory).mean(1).to(self.mus.dtype)
        mask = self.mem_state.sum(1) >= 2
        self.mus[mask] = means[mask]
        if self.config.normalize_mu:
            self.mus[mask] = self.mus[mask] / torch.linalg.norm(self.mus[mask], dim=-1, keepdim=True)

    def _update_sigma(self) -> None:
        """`__update_sigma`: Λ from the memory's items centred on their class means, once a class holds >= 3."""
        assert self.mus is not None and self.memory is not None and self.mem_state is not None
        counts = self.mem_state.sum(1)
        if not bool((counts > 2).any()):
            return
        d = self.dim
        # items in class order, slot order within a class (the official concatenation over k)
        cls = torch.arange(self.n_classes, device=counts.device).repeat_interleave(counts)
        center = self.memory[self.mem_state].to(self.mus.dtype) - self.mus[cls]  # (n, d)
        n = counts.sum()
        eye = torch.eye(d, device=center.device, dtype=center.dtype)
        if self.config.sig_type == "RidgeMoorePenrose":
            cc = center - center.mean(0)[None]
            m = cc.T @ cc / (n - 1)
            shrink = bool(n <= 4 * d)
        else:
            m = center.T.cov()
            shrink = self.config.sig_type == "Ridge"
        if shrink:  # empirical Bayes ridge (the official comment cites doi 10.1016/j.jmva.2008.01.016)
            self.inv_sig = d * torch.linalg.pinv((n - 1) * m + m.diagonal().sum() * eye)
        else:
            self.inv_sig = torch.linalg.pinv(m)

    def _log_posterior(self, x: torch.Tensor, zs: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """log z for a batch of zero-shot logits zs and their softmax ŷ = `probs`: `get_log_probs` then
        `get_MAP(ŷ, ., tau, simplex_p=True)`, z in float64."""
        assert self.mus is not None and self.inv_sig is not None
        xf, mus, inv = x.to(self.mus.dtype), self.mus, self.inv_sig
        w = torch.einsum("nd,dc->cn", mus, inv)
        b = -torch.einsum("nd,dc,nc->n", mus, inv, mus) / 2
        q = -torch.einsum("nd,dc,nc->n", xf, inv, xf) / 2
        log_lik = xf @ w + b + q[:, None]  # (B, K)
        p = (self.config.tau * log_lik).softmax(-1)
        z = probs * p  # float64: ŷ ** 1.0 · p
        z = z / z.sum(-1, keepdim=True)
        # where z underflowed to 0: its exact log in log space
        exact = zs.log_softmax(-1) + (self.config.tau * log_lik).to(zs.dtype).log_softmax(-1)
        exact = exact - exact.logsumexp(-1, keepdim=True)
        return torch.where(z > 0, z.log(), exact)

    def summary(self) -> dict[str, Any]:
        """How many items the memory holds, and over how many classes."""
        if self.mem_state is None:
            return {}
        return {"memory_items": int(self.mem_state.sum()), "memory_classes": int(self.mem_state.any(1).sum())}
