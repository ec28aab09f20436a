"""ZLaP — label propagation for zero-shot classification with vision-language models (Stojnić, Kalantidis & Tolias,
CVPR'24; official code `vladan-stojnic/ZLaP`, `zlap.py` and `utils.py`), transductive (`zlap`) and inductive
(`zlap-inductive`); docs/methods.md § ZLaP.

The graph has K text nodes (0..K-1) and one node per sample of the unit (K + i). Sample i links to its k most
similar samples (itself among them, as the official faiss search returns it) with weight max(0, cos) and to its k
most similar text prototypes with weight max(0, cos)^γ; W + Wᵀ without its diagonal is normalised symmetrically,
Wn = D^-½ (W + Wᵀ) D^-½ (a node without edges keeps degree 1), and L = I - α·Wn.

* transductive (`do_transductive_lp`): for each class c, solve L f = e_c by conjugate gradients; the score of
  sample i for class c is f[K + i].
* inductive (`do_inductive_lp`): the graph is built on an unlabeled set and each test sample is a query outside it:
  its seed vector y holds max(0, cos) on its k most similar unlabeled samples and max(0, cos)^γ on its k most
  similar text prototypes; solve L f = y; its scores are f[0..K-1]. zaec has no unlabeled training split: the
  unlabeled set is the unit itself, and each sample's seeds are its k most similar *other* samples (the official
  query is never in the unlabeled set), so `zlap-inductive` reads its whole unit too.

Conjugate gradients as `cupyx.scipy.sparse.linalg.cg` does them (x₀ = 0, stop when ‖r‖ <= 1e-6·‖b‖ or after 50
iterations), in float64 (L is float64: the official `eye` is float64, the graph float32), many right-hand sides at
once, each column stopping at its own iteration; columns are solved in blocks that fit `CG_BLOCK_BYTES`. The
nearest-neighbour searches are exact inner products in blocks (`knn`), as faiss' flat GPU index computes them.

Output (`output_kind = "logits"`): the scores f, which the official code ranks (argmax) without a softmax; they are
small positive numbers (mass propagated from the class nodes), so a softmax at T = 1 is nearly uniform.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping

import torch

from extract.methods.base import MethodConfig, OutputKind, PromptSet, check_hparams_key, setting
from extract.methods.transductive import TransductiveMethod, knn

#: bytes the conjugate-gradient vectors of one block of columns may take (x, r, p, q and temporaries: 6 float64
#: (N + K)-vectors per column): 1 GiB
CG_BLOCK_BYTES = 1 << 30


@dataclass(frozen=True)
class ZLaPConfig(MethodConfig):
    """ZLaP's knobs: `zlap.py`'s argparse defaults (the README's examples for the text classifier use the same), one
    setting for every dataset and backbone."""

    n_views: int = 1  # pre-extracted features, one per image (`utils.get_data`)
    augmix: bool = False
    # [ASSUMPTION: the official text classifiers are downloaded pre-extracted and the repository does not say which
    # templates made them; StatA's runs of ZLaP (`MaxZanella/StatA` `solvers/ZLaP.py`, `main.py` `get_hp`) use the
    # same one template per dataset as its own solver, taken here]
    prompts: PromptSet = "transclip"
    cupl: bool = False
    unit: int = setting(0, ge=0)  # samples solved jointly: 0 = the whole run (the official test set)
    k: int = setting(5, ge=1)  # --k: neighbours per sample, among the samples and among the text prototypes
    gamma: float = setting(5.0, gt=0)  # --gamma: text edges weigh cos^γ
    alpha: float = setting(0.3, gt=0, lt=1)  # --alpha: L = I - α·Wn
    cg_tol: float = setting(1e-6, gt=0)  # `dfs_search(tol=1e-6)`
    cg_maxiter: int = setting(50, ge=1)  # `dfs_search(maxiter=50)`


class ZLaP(TransductiveMethod):
    key: ClassVar[str] = "zlap"
    prefix_stable: ClassVar[bool] = False  # each row depends on every sample of its unit (`prefix_dependence`)
    Config: ClassVar[type[MethodConfig]] = ZLaPConfig
    output_kind: ClassVar[OutputKind] = "logits"
    unseen_like: ClassVar[str] = "imagenet"  # one setting for every dataset
    # no per-dataset template exists for a user's classes: "a photo of a {}.", the ImageNet family's own template
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "single"})
    #: "transductive" (scores at the sample nodes for seeds at the class nodes) or "inductive" (the reverse)
    setup: ClassVar[str] = "transductive"

    def __init__(self, config: ZLaPConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.cg_iterations = 0  # of the unit solved last: the most iterations of a column
        self.cg_unconverged = 0  # and its columns that stopped at cg_maxiter above the tolerance

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> ZLaPConfig:
        check_hparams_key(hparams_key)
        return ZLaPConfig()

    def _solve(self, feats: torch.Tensor) -> torch.Tensor:
        cfg: ZLaPConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(feats)
        x, t = feats[:, 0].to(dt), self.text_features.to(dt)
        n, k = x.shape[0], t.shape[0]
        lap = laplacian(x, t, cfg.k, cfg.gamma, cfg.alpha)
        if self.setup == "transductive":
            def seeds(a: int, b: int) -> torch.Tensor:  # e_c for the classes c of [a, b)
                out = torch.zeros(n + k, b - a, dtype=torch.float64, device=x.device)
                out[torch.arange(a, b, device=x.device), torch.arange(b - a, device=x.device)] = 1.0
                return out
            rows, iters, unconverged = solve_columns(lap, seeds, k, cfg.cg_tol, cfg.cg_maxiter, keep=(k, n + k))
        else:
            seeds = query_seeds(x, t, cfg.k, cfg.gamma)
            scores, iters, unconverged = solve_columns(lap, seeds, n, cfg.cg_tol, cfg.cg_maxiter, keep=(0, k))
            rows = scores.T  # (K, N) -> (N, K)
        self.cg_iterations, self.cg_unconverged = iters, unconverged
        return rows.to(dt)

    def summary(self) -> dict[str, Any]:
        """The conjugate-gradient iterations of the unit solved last (the most of any column) and its columns that
        ended at `cg_maxiter` above the tolerance (the official solver stops there too, silently)."""
        return {"cg_iterations": self.cg_iterations, "cg_unconverged": self.cg_unconverged}


class ZLaPInductive(ZLaP):
    """ZLaP's inductive inference, each sample a query on the graph of the other samples of its unit."""

    key: ClassVar[str] = "zlap-inductive"
    prefix_stable: ClassVar[bool] = False  # each row depends on every sample of its unit
    setup: ClassVar[str] = "inductive"


def laplacian(x: torch.Tensor, t: torch.Tensor, k: int, gamma: float, alpha: float) -> torch.Tensor:
    """L = I - α·Wn of the graph (`create_separate_graph`, `knn2laplacian`) as a sparse (N + K, N + K) float64
    matrix: the edges and their normalisation in the features' dtype (the official float32), L in float64."""
    n, c = x.shape[0], t.shape[0]
    sims_ii, idx_ii = knn(x, x, min(k, n))  # the sample itself among them, as faiss returns it
    sims_it, idx_it = knn(x, t, min(k, c))
    rows = (c + torch.arange(n, device=x.device))[:, None]
    src = torch.cat([rows.expand_as(idx_ii), rows.expand_as(idx_it)], dim=1).flatten()
    dst = torch.cat([c + idx_ii, idx_it], dim=1).flatten()
    val = torch.cat([sims_ii.clamp_min(0), sims_it.clamp_min(0) ** gamma], dim=1).flatten()
    size = n + c
    both = torch.sparse_coo_tensor(torch.stack([torch.cat([src, dst]), torch.cat([dst, src])]), torch.cat([val, val]),
                                   (size, size), check_invariants=False).coalesce()  # W + Wᵀ
    i, j = both.indices()
    off = i != j  # `normalize_connection_graph`: the diagonal removed
    i, j, v = i[off], j[off], both.values()[off]
    off_w = torch.sparse_coo_tensor(torch.stack([i, j]), v, (size, size), check_invariants=False)
    deg = torch.sparse.mm(off_w, torch.ones(size, 1, dtype=v.dtype, device=v.device))[:, 0]  # row sums
    deg = torch.where(deg == 0, torch.ones_like(deg), deg)
    d = 1.0 / deg.sqrt()
    wn = (d[i] * v) * d[j]
    diag = torch.arange(size, device=x.device)
    idx = torch.cat([torch.stack([diag, diag]), torch.stack([i, j])], dim=1)
    vals = torch.cat([torch.ones(size, dtype=torch.float64, device=x.device), -(alpha * wn).double()])
    return torch.sparse_coo_tensor(idx, vals, (size, size), check_invariants=False).coalesce()


def query_seeds(x: torch.Tensor, t: torch.Tensor, k: int, gamma: float) -> Callable[[int, int], torch.Tensor]:
    """The inductive seed vectors of samples [a, b) as (N + K, b - a) float64 columns (`get_neighbors_for_inductive`:
    max(0, cos) on the k most similar other samples, max(0, cos)^γ on the k most similar text prototypes)."""
    n, c = x.shape[0], t.shape[0]
    sims_ii, idx_ii = knn(x, x, min(k, n - 1), skip_self=True)
    sims_it, idx_it = knn(x, t, min(k, c))
    idx = torch.cat([c + idx_ii, idx_it], dim=1)  # (N, k_i + k_t) node indices
    val = torch.cat([sims_ii.clamp_min(0), sims_it.clamp_min(0) ** gamma], dim=1).double()

    def seeds(a: int, b: int) -> torch.Tensor:
        out = torch.zeros(n + c, b - a, dtype=torch.float64, device=x.device)
        return out.scatter_(0, idx[a:b].T.contiguous(), val[a:b].T.contiguous())

    return seeds


def solve_columns(lap: torch.Tensor, seeds: Callable[[int, int], torch.Tensor], n_cols: int, tol: float,
                  maxiter: int, keep: tuple[int, int], block_bytes: int = CG_BLOCK_BYTES
                  ) -> tuple[torch.Tensor, int, int]:
    """Solve L f = b for the `n_cols` right-hand sides `seeds(a, b)` in blocks of columns (`batched_cg`) and keep
    rows keep[0]..keep[1]-1 of the solutions: ((n_kept, n_cols) float64, the most iterations of a column, the
    columns unconverged)."""
    size = lap.shape[0]
    width = max(1, block_bytes // (6 * 8 * size))
    out = torch.empty(keep[1] - keep[0], n_cols, dtype=torch.float64, device=lap.device)
    most, unconverged = 0, 0
    for a in range(0, n_cols, width):
        b = min(n_cols, a + width)
        f, iters, done = batched_cg(lap, seeds(a, b), tol, maxiter)
        out[:, a:b] = f[keep[0]:keep[1]]
        most = max(most, int(iters.max()) if iters.numel() else 0)
        unconverged += int((~done).sum())
    return out, most, unconverged


def batched_cg(lap: torch.Tensor, rhs: torch.Tensor, tol: float, maxiter: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conjugate gradients on every column of `rhs` (n, m) at once, each exactly as `cupyx.scipy.sparse.linalg.cg`
    runs on that column alone (x₀ = 0, no preconditioner, stop once ‖r‖ <= tol·‖b‖ or after `maxiter` iterations;
    a zero column returns zeros): a column that stopped keeps its values while the others go on.

    Returns:
        (x (n, m), iterations per column (m,), whether each column met the tolerance (m,)).
    """
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    b_norm = torch.linalg.vector_norm(rhs, dim=0)
    atol = tol * b_norm
    active = b_norm != 0
    done = ~active
    iters = torch.zeros(rhs.shape[1], dtype=torch.long, device=rhs.device)
    rho = torch.zeros(rhs.shape[1], dtype=rhs.dtype, device=rhs.device)
    zero = rho.new_zeros(())
    p = r.clone()
    for it in range(maxiter):
        if not bool(active.any()):
            break
        rho1, rho = rho, (r * r).sum(0)
        if it:  # a stopped column's p is any finite vector: its step below is exactly 0
            p.mul_(torch.where(active, rho / rho1, zero)).add_(r)
        q = torch.sparse.mm(lap, p)
        step = torch.where(active, rho / (p * q).sum(0), zero)
        x.add_(p * step)  # + 0 leaves a stopped column as it was
        r.sub_(q * step)
        iters += active.long()
        met = torch.linalg.vector_norm(r, dim=0) <= atol
        done = done | (active & met)
        active = active & ~met
    return x, iters, done
