"""ECALP — efficient and context-aware label propagation (Li et al., ICLR'25; official code `Yushu-Li/ECALP
@96ddf0b`, `main.py` l.46-63 and `utils/iterative_label_propagation.py`). Online and training-free; docs/methods.md
§ ECALP.

At sample i the graph has K text nodes and N = i + 2 image nodes: the features of samples 0..i and sample i again
(the query node; at the next sample its slot is taken by the new feature). Each image node links to its k_image
nearest image nodes (similarity ⟨normalize(f_a ⊙ w), normalize(f_b)⟩ with w the L2-normalised per-dimension
variance of the text prototypes) and its k_text nearest text nodes (plain cosine); edge weight = similarity^γ.
W + Wᵀ is normalised symmetrically (1/(√deg + 1e-6)); labels propagate 3 times from the text nodes' identity labels
and each image node's previous top-1 score / 5 (Y_0); pred = the query node's row; every image node's Y_0 becomes
its new top-1 score / 5. Output softmax(10⁴·pred).

The image-image neighbour lists are maintained incrementally exactly as the official code does (a store of the
k+2 best candidates per node, entries pointing at the replaced query slot invalidated to -1, the new node's list
from one row of similarities), with the same `topk` calls on the same candidate order, so ties resolve the same way.

Cost at stream position i (N = i + 2 nodes, E ≈ 2N(k_image + k_text) directed edges): one (N × D) similarity row,
O(N·k) neighbour bookkeeping and three propagations over E edges of K-wide label rows, O(E·K) (the official code
also densifies the (N+K) × K label matrix every sample). Memory: the features (N × D), the neighbour store
(N × (k+2) indices and similarities), the compact Y_0 (N values and indices) and the propagation's transients:
at ImageNet's end (N = 50,000, D = 512, K = 1,000) the graph keeps about 147 MB, and one propagation step peaks at
about 8.2 GB of float32 temporaries, most of it (7.6 GB) the K-wide label rows gathered along the E edges
(measured by `python -m tools.bench_extract --ecalp-n`; docs/benchmarks.md, "TTA-VLM methods: cost per sample").
Work over a stream of n samples grows as n²: ImageNet is about 3·10¹⁴ multiply-adds (a GPU's job).

Output (`output_kind = "log_probs"`): log softmax(10⁴·pred) where its float32 value is positive, else the exact
log-softmax (finite, below -103); pred itself is an even better score but the official code ranks with the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F

from extract.methods.base import MethodConfig, OutputKind, PromptSet, TTAMethod, check_hparams_key, setting


@dataclass(frozen=True)
class ECALPConfig(MethodConfig):
    """ECALP's knobs: the argparse defaults of `main.py`, one setting for every dataset (zero-shot mode)."""

    n_views: int = 1  # pre-extracted features, one per image (`main.py` loads them; several are averaged)
    augmix: bool = False
    prompts: PromptSet = "dataset"  # [ASSUMPTION: the text features are pre-extracted; the repository does not say
    #                                 which templates; TDA's per-dataset templates as for the other online methods]
    cupl: bool = False
    k_text: int = setting(3, ge=1)  # --k_text
    k_image: int = setting(8, ge=1)  # --k_image
    gamma: float = setting(10.0, gt=0)  # --gamma: edge weight = similarity ** gamma
    alpha: float = setting(1.0, ge=0, le=1)  # --alpha: Y_t = α·W̃·Ŷ + (1-α)·Y_0
    num_iterations: int = setting(3, ge=0)  # --num_iterations
    y0_divisor: float = setting(5.0, gt=0)  # Y_0 = top-1 score / 5 (`iterative_label_propagation`)
    output_scale: float = setting(1e4, gt=0)  # softmax(pred * 10000)
    degree_eps: float = setting(1e-6, gt=0)  # 1 / (sqrt(W_sum) + 1e-6)


class ECALP(TTAMethod):
    key: ClassVar[str] = "ecalp"
    prefix_stable: ClassVar[bool] = True  # the graph at sample i holds samples 0..i only
    Config: ClassVar[type[MethodConfig]] = ECALPConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    _state_fields: ClassVar[tuple[str, ...]] = ("graph",)
    unseen_like: ClassVar[str] = "imagenet"  # one setting for every dataset
    # no per-dataset templates exist for a user's classes: the 80 CLIP ImageNet templates
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80"})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> ECALPConfig:
        check_hparams_key(hparams_key)
        return ECALPConfig()

    def __init__(self, config: ECALPConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        # feats (capacity, D): rows 0..n_seen-1 used; store_sim/store_idx: the official candidate store; cur_sim /
        # cur_idx: the k nearest image nodes per node; text_sim / text_idx: the k_text nearest text nodes; y0_val /
        # y0_idx: each node's Y_0 (one entry per row). Node rows cover the N nodes of the last graph.
        self.graph: dict[str, torch.Tensor] | None = None

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype(view_feats)
        clf = self.text_features.to(dt)
        w = F.normalize(clf.var(dim=0), dim=0)  # per-dimension weights (`edge_reweighting`, force_1)
        out = []
        for b, x in enumerate(view_feats[:, 0].to(dt)):  # sequential by nature: one node more per sample
            self._grow(self.n_seen + b, x, clf, w)
            out.append(self._propagate(clf.shape[0]))
        pred = self.config.output_scale * torch.stack(out)  # type: ignore[attr-defined]
        prob = pred.float().softmax(-1).to(dt)  # the official softmax, float32
        return torch.where(prob > 0, prob.log(), pred.log_softmax(-1))

    def _grow(self, i: int, x: torch.Tensor, clf: torch.Tensor, w: torch.Tensor) -> None:
        """Add sample i's feature (D,) and update the neighbour lists (`dynamic_graph_expansion`)."""
        cfg: ECALPConfig = self.config  # type: ignore[assignment]
        g = self.graph
        if g is None or i == 0:
            g = {"feats": torch.zeros(_INITIAL_ROWS, x.shape[0], dtype=x.dtype, device=x.device)}
        if g["feats"].shape[0] <= i:  # amortised growth (doubling)
            g["feats"] = torch.cat([g["feats"], torch.zeros_like(g["feats"])])
        g["feats"][i] = x
        feats = torch.cat([g["feats"][:i + 1], x[None]])  # (N, D): samples 0..i, then the query node
        n = feats.shape[0]
        k = min(cfg.k_image, n)
        kt = min(cfg.k_text, clf.shape[0])
        if i == 0:
            sim = _reweighted(feats, w) @ F.normalize(feats, dim=1).T  # rows reweighted
            g["cur_sim"], g["cur_idx"] = sim.topk(k, dim=1)
            g["store_sim"], g["store_idx"] = g["cur_sim"].clone(), g["cur_idx"].clone()
            g["text_sim"], g["text_idx"] = (feats @ clf.T).topk(kt, dim=1)
            g["y0_val"] = torch.zeros(n, dtype=x.dtype, device=x.device)
            g["y0_idx"] = torch.zeros(n, dtype=torch.long, device=x.device)
        else:
            self._extend(g, feats, w, k)
            t_sim, t_idx = (x[None] @ clf.T).topk(kt, dim=1)
            g["text_sim"] = torch.cat([g["text_sim"][:-1], t_sim, t_sim])
            g["text_idx"] = torch.cat([g["text_idx"][:-1], t_idx, t_idx])
            g["y0_val"] = torch.cat([g["y0_val"][:-1], g["y0_val"].new_zeros(2)])
            g["y0_idx"] = torch.cat([g["y0_idx"][:-1], g["y0_idx"].new_zeros(2)])
        self.graph = g

    @staticmethod
    def _extend(g: dict[str, torch.Tensor], feats: torch.Tensor, w: torch.Tensor, k: int) -> None:
        """The official incremental update of the image-image neighbour lists for N = feats.shape[0] nodes."""
        n = feats.shape[0]
        # (2, N): similarity of every node (reweighted) to the two new nodes (plain), rows = the new nodes
        cross = (_reweighted(feats, w) @ F.normalize(feats[-2:], dim=1).T).T
        sim_new, idx_new = cross.topk(k, dim=1)
        store_sim, store_idx = g["store_sim"], g["store_idx"]
        store_sim = torch.where(store_idx == n - 2, torch.full_like(store_sim, -1.0), store_sim)  # replaced slot
        rows = n - 2  # the old nodes, without the previous query node
        fill = torch.full((rows, 1), n - 1, dtype=store_idx.dtype, device=store_idx.device)
        sim_ext = torch.cat([store_sim[:-1], cross[:, :rows].T], dim=1)
        idx_ext = torch.cat([store_idx[:-1], fill - 1, fill], dim=1)
        k_store = k + 1 if rows == k + 1 else (k + 2 if rows > k else k)
        store_sim, order = sim_ext.topk(k_store, dim=1)
        store_idx = idx_ext.gather(1, order)
        cur_sim, cur_idx = store_sim[:, :k], store_idx[:, :k]
        if rows > k:
            more_sim, more_idx = cross.topk(k_store, dim=1)
        else:
            more_sim, more_idx = sim_new, idx_new
        g["store_sim"], g["store_idx"] = torch.cat([store_sim, more_sim]), torch.cat([store_idx, more_idx])
        g["cur_sim"], g["cur_idx"] = torch.cat([cur_sim, sim_new]), torch.cat([cur_idx, idx_new])

    def _propagate(self, n_classes: int) -> torch.Tensor:
        """Three propagation steps on the current graph; updates Y_0 and returns pred (K,) of the query node."""
        cfg: ECALPConfig = self.config  # type: ignore[assignment]
        g = self.graph
        assert g is not None
        n = g["cur_idx"].shape[0]
        size = n + n_classes
        dt, dev = g["cur_sim"].dtype, g["cur_sim"].device
        # directed edges image node -> neighbour, in the official column order (images, then texts)
        cols = torch.cat([g["cur_idx"] + n_classes, g["text_idx"]], dim=1)  # (N, k + kt)
        wts = torch.cat([g["cur_sim"], g["text_sim"]], dim=1) ** cfg.gamma
        rows = torch.arange(n_classes, size, device=dev)[:, None].expand_as(cols)
        keep = wts != 0  # `knn_to_weighted_adj_matrix` drops zero weights
        r, c, v = rows[keep], cols[keep], wts[keep]
        deg = torch.zeros(size, dtype=dt, device=dev)
        deg.index_add_(0, r, v).index_add_(0, c, v)  # row sums of W + Wᵀ
        d = 1.0 / (deg.sqrt() + cfg.degree_eps)
        src = torch.cat([r, c])  # W + Wᵀ as one edge list: (row, column, normalised weight)
        dst = torch.cat([c, r])
        val = d[src] * torch.cat([v, v]) * d[dst]
        img = src >= n_classes  # only the image rows are propagated (`sparse_slice`)
        src, dst, val = src[img] - n_classes, dst[img], val[img]
        y0 = torch.zeros(n, n_classes, dtype=dt, device=dev)
        y0[torch.arange(n, device=dev), g["y0_idx"]] = g["y0_val"]
        eye = torch.eye(n_classes, dtype=dt, device=dev)
        y_hat = torch.cat([eye, y0])
        for _ in range(cfg.num_iterations):
            y_t = torch.zeros(n, n_classes, dtype=dt, device=dev).index_add_(0, src, val[:, None] * y_hat[dst])
            y_t = cfg.alpha * y_t + (1 - cfg.alpha) * y0
            y_hat = torch.cat([eye, y_t])
        top_val, top_idx = y_hat[n_classes:].topk(1, dim=1)
        g["y0_val"], g["y0_idx"] = top_val[:, 0] / cfg.y0_divisor, top_idx[:, 0]
        return y_hat[-1]


#: rows of the feature buffer at the start of a stream (doubled when full)
_INITIAL_ROWS = 1024


def _reweighted(feats: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """normalize(f ⊙ w) row by row (the query side of `edge_reweighting`)."""
    return F.normalize(feats * w, dim=1)
