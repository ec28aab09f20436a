"""Building blocks shared by the online TTA methods (TDA, DPE, DLAE) and, later, the episodic TPT family.

Everything here is a pure tensor function or a small state container; nothing reads a global setting. The
formulas follow the official code as docs/methods.md records it:
    * the confident-view selection and the marginal entropy:
      docs/methods.md, "Confident-view selection and marginal entropy";
    * the per-class cache: docs/methods.md, "TDA: caches and the negative cache band";
    * the DPE step (InfoNCE, first AdamW step): docs/methods.md, "DPE: dual prototypes, one step per sample".
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of softmax over the last axis.

    Args:
        logits: (..., K) logits.

    Returns:
        (...,) entropies, H = -sum_c p_c log p_c with p = softmax(logits).

    Example:
        >>> float(softmax_entropy(torch.zeros(4)))  # uniform over 4 classes: ln 4
        1.3862943649291992
    """
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


def marginal_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the average softmax over views, computed in log space (TPT's `avg_entropy`).

    The definition: docs/methods.md, "Confident-view selection and marginal entropy".

    log p̄_c = logsumexp_v log softmax(z_v)_c - log n, clamped at the dtype's most negative finite value, and
    H = -sum_c p̄_c log p̄_c. With a single view it equals `softmax_entropy`.

    Args:
        logits: (..., n, K) logits of n views.

    Returns:
        (...,) marginal entropies in nats.
    """
    log_p = logits - logits.logsumexp(-1, keepdim=True)
    avg = log_p.logsumexp(-2) - math.log(logits.shape[-2])
    avg = avg.clamp(min=torch.finfo(avg.dtype).min)
    return -(avg * avg.exp()).sum(-1)


def n_confident(n_views: int, selection_p: float) -> int:
    """Number of views kept by the confidence selection: `int(n_views * p)` (6 of 64 at p = 0.1; TPT
    `tpt_classification.py:select_confident_samples`).

    Deviation, only for fewer than 1/p views (never with the official 64): at least one view is kept, where the
    official `int(N * p)` would keep none and crash.
    """
    return max(1, int(n_views * selection_p))


@dataclass(frozen=True)
class ViewSummary:
    """What the official `get_clip_logits` returns, for B samples at once.

    Attributes:
        feats: (B, D) image feature: view 0 for one view, else the mean of the selected normalised view features,
            **not** re-normalised (TDA/DPE/DLAE `get_clip_logits`).
        logits: (B, K) view-0 logits, or the mean of the selected views' logits (keeps autograd history).
        entropy: (B,) softmax entropy (one view) or marginal entropy of the selected views, in nats; detached.
        prob: (B, K) softmax of view 0, or the mean softmax of the selected views; detached.
        pred: (B,) int64 argmax of `logits`.
        selected: (B, n) indices of the selected views (n = 1 and index 0 for one view).
    """

    feats: torch.Tensor
    logits: torch.Tensor
    entropy: torch.Tensor
    prob: torch.Tensor
    pred: torch.Tensor
    selected: torch.Tensor


def summarise_views(feats: torch.Tensor, logits: torch.Tensor, selection_p: float) -> ViewSummary:
    """Confident-view selection and summary for a batch (TDA/DPE/DLAE `utils.py:get_clip_logits`;
    docs/methods.md, "Confident-view selection and marginal entropy").

    With V = 1 the single view is used as it is (softmax entropy, softmax probabilities). With V > 1 the
    `n_confident(V, p)` views of lowest softmax entropy are kept (stable order on ties); the summary is the mean
    of their features, the mean of their logits, their marginal entropy, their mean softmax and the argmax of the
    mean logits. The selection itself never carries gradients; `logits` of the summary does when the input does.

    Args:
        feats: (B, V, D) L2-normalised view features.
        logits: (B, V, K) per-view logits (may require grad).
        selection_p: fraction of views kept (0.1 in every official repo).

    Returns:
        A `ViewSummary` of B samples.
    """
    b, v, _ = logits.shape
    if v == 1:
        z = logits[:, 0]
        zd = z.detach()
        sel = torch.zeros(b, 1, dtype=torch.long, device=logits.device)
        return ViewSummary(feats[:, 0], z, softmax_entropy(zd), zd.softmax(-1), zd.argmax(-1), sel)
    n = n_confident(v, selection_p)
    # Selection on the detached logits: the official code picks indices with argsort, which has no gradient.
    sel = torch.argsort(softmax_entropy(logits.detach()), dim=1, stable=True)[:, :n]  # (B, n)
    sel_logits = torch.gather(logits, 1, sel[..., None].expand(-1, -1, logits.shape[-1]))  # (B, n, K)
    sel_feats = torch.gather(feats, 1, sel[..., None].expand(-1, -1, feats.shape[-1]))  # (B, n, D)
    z = sel_logits.mean(1)
    d = sel_logits.detach()
    return ViewSummary(
        feats=sel_feats.mean(1),
        logits=z,
        entropy=marginal_entropy(d),
        prob=d.softmax(-1).mean(1),
        pred=z.detach().argmax(-1),
        selected=sel,
    )


class ClassCache:
    """Per-class cache of at most `capacity` items kept in ascending order of score (TDA `tda_runner.py:update_cache`).

    Storage is dense: keys (K, capacity, D), scores (K, capacity) with +inf in empty slots, and optional extra
    per-item tensors. The official rule "append if the class has fewer than `capacity` items, otherwise replace
    the last (worst) item if the new score is strictly lower, then stable-sort by score" is implemented as one
    branch-free update: empty slots hold +inf and sit at the end, so "replace the last slot if the new score is
    lower" appends while the class is not full. An item equal in score to a cached one goes after it, as with the
    official stable `sorted`. Scores must be finite.

    Attributes:
        keys: (K, capacity, D) cached features (zeros in empty slots).
        scores: (K, capacity) scores (+inf in empty slots).
        extras: name -> (K, capacity, ...) extra per-item tensors (zeros in empty slots).
        counts: per-class number of cached items (a Python list: classes are indexed by Python ints).
    """

    def __init__(
        self,
        n_classes: int,
        capacity: int,
        dim: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        extras: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.keys = torch.zeros(n_classes, capacity, dim, device=device, dtype=dtype)
        self.scores = torch.full((n_classes, capacity), math.inf, device=device, dtype=dtype)
        self.extras = {
            name: torch.zeros(n_classes, capacity, *shape, device=device, dtype=dt)
            for name, (shape, dt) in (extras or {}).items()
        }
        self.counts = [0] * n_classes
        self._present: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and lists (loadable with `torch.load(..., weights_only=True)`)."""
        return {"capacity": self.capacity, "keys": self.keys.clone(), "scores": self.scores.clone(),
                "extras": {k: v.clone() for k, v in self.extras.items()}, "counts": list(self.counts)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ClassCache:
        keys = state["keys"]
        cache = cls(keys.shape[0], state["capacity"], keys.shape[2], device=keys.device, dtype=keys.dtype)
        cache.keys, cache.scores = keys.clone(), state["scores"].clone()
        cache.extras = {k: v.clone() for k, v in state["extras"].items()}
        cache.counts = list(state["counts"])
        cache._present = [c for c, n in enumerate(cache.counts) if n > 0]
        return cache

    def __len__(self) -> int:
        return sum(self.counts)

    @property
    def valid(self) -> torch.Tensor:
        """(K, capacity) bool: slot holds an item."""
        return torch.isfinite(self.scores)

    def present(self) -> list[int]:
        """Classes holding at least one item, ascending (the official code iterates `sorted(cache.keys())`)."""
        return list(self._present)

    def update(self, c: int, key: torch.Tensor, score: torch.Tensor, **extras: torch.Tensor) -> None:
        """Offer one item to class `c`.

        Args:
            c: class index (the pseudo-label).
            key: (D,) feature.
            score: 0-dim score (lower is better; entropy).
            **extras: per-item extra tensors, one for each name given at construction.
        """
        accept = score < self.scores[c, -1]  # 0-dim bool; True whenever the class is not full
        self.scores[c, -1] = torch.where(accept, score, self.scores[c, -1])
        self.keys[c, -1] = torch.where(accept, key, self.keys[c, -1])
        for name, value in extras.items():
            self.extras[name][c, -1] = torch.where(accept, value, self.extras[name][c, -1])
        if self.counts[c] == 0:
            bisect.insort(self._present, c)
        self.counts[c] = min(self.counts[c] + 1, self.capacity)
        self.sort_class(c)

    def sort_class(self, c: int) -> None:
        """Stable-sort class `c`'s items by ascending score (empty slots stay last)."""
        order = torch.sort(self.scores[c], stable=True).indices
        self.scores[c] = self.scores[c, order]
        self.keys[c] = self.keys[c, order]
        for t in self.extras.values():
            t[c] = t[c, order]

    def affinity_weights(self, query: torch.Tensor, beta: float) -> torch.Tensor:
        """exp(-beta (1 - query . key)) for every slot, zero in empty slots.

        Args:
            query: (D,) feature (not necessarily unit norm: the official code uses the mean of selected views).
            beta: sharpness.

        Returns:
            (K, capacity) weights.
        """
        k, cap, d = self.keys.shape
        aff = (self.keys.reshape(k * cap, d) @ query).reshape(k, cap)
        return torch.exp(-beta * (1.0 - aff)) * self.valid

    def class_means(self, classes: torch.Tensor) -> torch.Tensor:
        """Mean cached feature per class (DPE `cache_key_value`): (len(classes), D), not normalised."""
        valid = self.valid[classes]  # (P, cap)
        keys = self.keys[classes] * valid[..., None]
        return keys.sum(1) / valid.sum(1, keepdim=True).to(keys.dtype)


def info_nce(query: torch.Tensor, keys: torch.Tensor, temperature: float) -> torch.Tensor:
    """One-directional InfoNCE with in-batch negatives (the `info-nce-pytorch` default DPE uses;
    docs/methods.md, "DPE: dual prototypes, one step per sample").

    Row i of `query` is paired with row i of `keys`; every other row of `keys` is a negative. Both sides are
    L2-normalised first. loss = mean_i CE(softmax_j(q̂_i . k̂_j / temperature), i).

    Args:
        query: (P, D) queries (DPE: the image prototypes).
        keys: (P, D) positive keys (DPE: the text prototypes of the same classes).
        temperature: softmax temperature (0.01 in DPE/DLAE).

    Returns:
        0-dim loss (0 when P = 1: the only candidate is the positive).
    """
    q = F.normalize(query, dim=-1)
    k = F.normalize(keys, dim=-1)
    logits = q @ k.T / temperature
    target = torch.arange(q.shape[0], device=q.device)
    return F.cross_entropy(logits, target)


def adamw_first_step(
    param: torch.Tensor, grad: torch.Tensor, lr: float, eps: float, weight_decay: float
) -> torch.Tensor:
    """The first step of a freshly built `torch.optim.AdamW` (betas 0.9/0.999), in closed form.

    Decoupled decay, then Adam with bias-corrected moments m̂ = g and v̂ = g²:
    p ← p (1 - lr·wd) - lr · g / (|g| + eps). DPE/DLAE build a new optimiser for every sample and take one step
    from zero residuals (docs/methods.md, "DPE/DLAE numerics"), so this is the whole optimisation; the decay term
    is zero there and eps (1e-3) sets the step size of small gradients. This is the step in exact arithmetic (DPE/DLAE
    `residual_step="exact"`); the official code's fp16 residuals step differently (`torch_adamw_step`).

    Args:
        param: parameter value before the step.
        grad: its gradient.
        lr, eps, weight_decay: the AdamW settings.

    Returns:
        The parameter value after the step (a new tensor).
    """
    return param * (1.0 - lr * weight_decay) - lr * grad / (grad.abs() + eps)


def torch_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], lrs: list[float], eps: float,
                     weight_decay: float) -> list[torch.Tensor]:
    """One step of a freshly built `torch.optim.AdamW` (one parameter group per tensor), in the parameters' dtype.

    This is the official DPE/DLAE step on their fp16 residuals: AdamW keeps its moments in the parameter's dtype,
    so in fp16 the second moment v = (1 - β₂) g² = 0.001 g² underflows to 0 for |g| below about 5.5e-3 and the
    step becomes lr·g/eps (up to 5.4·lr) instead of lr·g/(|g| + eps) (`adamw_first_step`). The real optimiser is
    used so that the rounding is torch's own on every device.

    Args:
        params: parameter values (not modified); their dtype is the optimiser's.
        grads: their gradients (cast to the parameter's dtype, as autograd delivers them for a leaf).
        lrs: learning rate per parameter.
        eps, weight_decay: the AdamW settings (betas 0.9/0.999).

    Returns:
        The parameter values after the step (new tensors).
    """
    leaves = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g.detach().to(leaf.dtype)
    opt = torch.optim.AdamW([{"params": [leaf], "lr": lr} for leaf, lr in zip(leaves, lrs)], eps=eps,
                            weight_decay=weight_decay)
    opt.step()
    return [leaf.detach() for leaf in leaves]
