"""COSMIC — Clique-Oriented Semantic Multi-space Integration (Huang et al., CVPR'25; official code `hf618/COSMIC
@34fde07`, `cosmic_main.py` `direct_inference` l.285-549, `utils/utils_cosmic.py`, `utils/DualMems.py`). Online
and training-free, with DINOv2 ViT-L/14 (registers) beside CLIP; the spec:
docs/methods.md, "COSMIC: a second image encoder (DINOv2) and dual memories".

State: DMN's CLIP memory (at most `clip_memory` features per pseudo-class, with their entropies), a TDA-style
cache of DINOv2 features (`dino_memory` per class, lowest entropy first) and the last maximal-clique graph of each
space. Per sample at stream position i, with the U = `used_views` views x_v (CLIP) and d (DINOv2, original view):

1. p_v = softmax(s·x_v·t̂ᵀ); the max(1, int(U·0.1)) views of lowest -Σ p log(p + 1e-6) give init = their mean p,
   ŷ = argmax init, h = -Σ init log(init + 1e-8) (`select_confident_samples`, `DualMem.update_memory_bank`).
2. CLIP memory write (DMN's rule): the mean of the selected views' features joins class ŷ while it has room, else
   replaces the highest-entropy item if h is below some stored entropy.
3. Read-out ("attn", `DualMem.get_image_pred`): per class, keys = its items and t_c, normalised; w = exp(-β(1 - q·k))
   with q = x_0; a_c = normalize(normalize(Σ w k)); p_mem = softmax(s·a·x_0).
4. The DINOv2 cache gets (d, H(softmax(p_0 + p_mem))) under argmax(p_0 + p_mem) (`update_cache`).
5. Cliques (`make_max_cliques`): the graph of the nodes' cosine similarities is cut at the threshold whose average
   degree is the target (bisection), kept to the edges in >= 2 triangles (`is_SOG`), and its maximal cliques
   (networkx) anchored at their mean features. CLIP nodes: the K text prototypes and the K read-out features a_c
   (average degree 0.8·5); DINOv2 nodes: the K class means of its cache (zeros for empty classes; degree 5).
   Rebuilt while i <= K·memory whenever that memory changed, afterwards every `mac_step` samples.
6. Clique logits (`compute_clique_logits`): the cliques of the int(0.2·Q) anchors nearest the query; their nodes n
   score α·exp(-β'(1 - q·f_n)), the others 0; CLIP's 2K scores are averaged over the text and image halves.
7. Score p_0 + w_clip·clip_cliques + w_dino·dino_cliques; the official code picks the two weights on the test labels
   afterwards, zaec takes `clip_clique_weight` and `dino_clique_weight` (1 each, an assumption).

Output (`output_kind = "log_probs"`): log(score / Σ score), the official score made a distribution (its ranking);
where float32 p_0 underflows and the clique terms are 0, the exact log of p_0 (finite).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Literal, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from extract.methods.base import (
    IMAGENET_FAMILY,
    ExternalFile,
    MethodConfig,
    OutputKind,
    PromptSet,
    Ref,
    TTAMethod,
    check_hparams_key,
    setting,
    text_setting,
)
from extract.methods.boostadapter import output_entropy
from extract.methods.common import ClassCache, n_confident
# the entropy epsilons of `select_confident_samples` and `DualMem.update_memory_bank`: DMN's (COSMIC builds on DMN)
from extract.methods.dmn import MEMORY_ENTROPY_EPS, SELECT_ENTROPY_EPS
from extract.methods.tda import TDA_ALPHA_BETA
from extract.timm_encoder import TIMM_FOLDER_FILES

GraphControl = Literal["degree", "threshold"]
#: the timm architecture COSMIC's `--DINO_size l` loads (`clip/dinoV2.py`: `dinov2_vitl14_reg`)
DINO_SOURCE = ("get the DINOv2 ViT-L/14 (registers) folder with `huggingface-cli download "
               "timm/vit_large_patch14_reg4_dinov2.lvd142m --local-dir DIR`, or --set dino=false (no DINOv2 side)")
# Mac lambda1 (CLIP) / lambda2 (DINOv2) per dataset (`configs_l/*.yaml`): thresholds of `control="threshold"`;
# the shipped scripts control the graph by degree, which does not read them
COSMIC_LAMBDAS: dict[str, tuple[float, float]] = {
    "imagenet": (0.85, 0.40), "imagenet_a": (0.85, 0.40), "imagenet_v2": (0.85, 0.40), "imagenet_r": (0.85, 0.40),
    "imagenet_sketch": (0.85, 0.52), "caltech101": (0.75, 0.075), "dtd": (0.70, 0.07), "eurosat": (0.85, 0.085),
    "fgvc_aircraft": (0.85, 0.07), "food101": (0.85, 0.85), "flowers102": (0.75, 0.40), "oxford_pets": (0.69, 0.20),
    "stanford_cars": (0.85, 0.50), "sun397": (0.95, 0.15), "ucf101": (0.85, 0.15),
}


@dataclass(frozen=True)
class COSMICConfig(MethodConfig):
    """COSMIC's knobs: `scripts/cosmic_ood.sh` (ImageNet family, the defaults here) and `scripts/cosmic_cd.sh`
    (the 10 fine-grained sets), `configs_l/*.yaml`, `cosmic_main.py` argparse."""

    # The runner's 64 views (original + 63); COSMIC reads views 0 .. used_views-1 (`-b 8`: the original + 7)
    n_views: int = 64
    augmix: bool = False  # AugMix off the ImageNet family (`AugMixAugmenter(augmix=len(set_id) > 1)`)
    prompts: PromptSet = "dataset"  # --text_prompt tip_cupl: TDA-style templates (`data/imagnet_prompts.py`)
    cupl: bool = True  # ... plus the CuPL sentences (`clip/fix_clip.py` `get_text_features`)
    used_views: int = setting(8, ge=1, le=Ref("n_views"))  # -b 8
    selection_p: float = setting(0.1, gt=0, le=1)  # --selection_p 0.1; at least one view (`select_confident_samples`)
    clip_memory: int = setting(16, ge=1)  # --CLIP_Cache_shot: 16 (ood script), 8 (cd script)
    dino_memory: int = setting(16, ge=1)  # --DINO_Cache_shot: 16 (ood script), 8 (cd script)
    beta: float = setting(5.5, ge=0)  # --beta 5.5: sharpness of the CLIP memory read-out
    clique_alpha: float = setting(2.0, ge=0)  # positive.alpha (`configs_l/*.yaml`)
    clique_beta: float = setting(5.0, ge=0)  # positive.beta (`configs_l/*.yaml`)
    clique_ratio: float = setting(0.2, gt=0, le=1)  # --r 0.2: share of the cliques whose anchors are nearest
    mac_step: int = setting(100, ge=1)  # --mac_step 100: graph rebuild interval after the memory filled
    control: GraphControl = "degree"  # --control_type (default degree; "degeneracy" is not implemented)
    target_avg_degree: float = setting(5.0, gt=0)  # --target_avg_degree 5.0 (CLIP's graph: 0.8 of it)
    lambda1: float = setting(0.85, ge=-1, le=1)  # Mac.lambda1: CLIP's threshold under control="threshold"
    lambda2: float = setting(0.40, ge=-1, le=1)  # Mac.lambda2: DINOv2's threshold under control="threshold"
    increase_threshold: bool = True  # --inrease_t: thresholds grow by 1e-5 a sample, up to 1 (threshold control)
    second_order: bool = True  # --is_SOG: keep the edges in >= 2 triangles
    always_update_graph: bool = False  # --always_update_G
    clip_center: Literal["attn", "default"] = "attn"  # --center_type_clip attn (both scripts)
    dino: bool = True  # --DINOv2 with --use_dino_clique: the DINOv2 side (False: COSMIC's CLIP-only ablation)
    # the weights of the clique scores: the official code searches both over 0, 0.001, ..., 1000 on the test labels
    # after the run (`search_best_weights`) and ships no log of its picks; 1 each [assumption]
    clip_clique_weight: float = setting(1.0, ge=0)
    dino_clique_weight: float = setting(1.0, ge=0)
    # the DINOv2 folder (timm layout: config.json + model.safetensors); "" = not given (zaec downloads nothing)
    dino_weights: str = text_setting("")

    @property
    def crop_scale(self) -> tuple[float, float]:
        """COSMIC's crops take area U(0.5, 1) (`data/datautils.py` `get_preaugment`): the `crop_flip_05` policy on
        the ImageNet family; AugMix views keep 0.08-1 (as DMN's)."""
        return (0.08, 1.0) if self.augmix else (0.5, 1.0)




def degree_graph(sim: torch.Tensor, target: float, tol: float = 1e-2, max_iter: int = 500) -> torch.Tensor:
    """`build_graph_by_degree`: bisect the threshold between the smallest and largest similarity until the average
    degree of (sim > t) (no self-loops) is within `tol` of `target`, or `max_iter` halvings; the last graph.

    The degree at a threshold is read from the sorted off-diagonal similarities (a binary search per halving, the
    same count as the official (sim > t).sum(), compared in sim's dtype), so the halvings cost no pass over sim.

    Args:
        sim: (n, n) similarities. target: the average degree wanted.

    Returns:
        (n, n) 0/1 adjacency in sim's dtype.
    """
    n = sim.shape[0]
    low, high = sim.min().item(), sim.max().item()
    off = sim[~torch.eye(n, dtype=torch.bool, device=sim.device)].sort().values.cpu().numpy()
    dt = off.dtype.type  # the comparisons and the division in sim's dtype, as the official tensor operations
    mid = high
    for _ in range(max_iter):
        mid = (low + high) / 2
        avg = dt(off.size - np.searchsorted(off, dt(mid), side="right")) / dt(n)  # `adj.sum() / n`
        if abs(avg - dt(target)) < dt(tol):
            break
        if avg < dt(target):
            high = mid
        else:
            low = mid
    return threshold_graph(sim, mid)


def threshold_graph(sim: torch.Tensor, threshold: float) -> torch.Tensor:
    """`build_graph_by_threshold`: (sim > threshold), no self-loops."""
    adj = (sim > threshold).to(sim.dtype)
    adj.fill_diagonal_(0)
    return adj


def maximal_cliques(adj: torch.Tensor) -> list[list[int]]:
    """networkx's maximal cliques of the graph, in its order; a node in none joins the first clique (the official
    rule; networkx lists an isolated node as a clique of its own, so it does not arise)."""
    import networkx as nx

    graph = nx.from_numpy_array(adj.detach().cpu().numpy())
    cliques = [list(c) for c in nx.find_cliques(graph)]
    missing = set(range(adj.shape[0])) - {v for c in cliques for v in c}
    for v in missing:  # set order, as the official loop
        if cliques:
            cliques[0].append(v)
        else:
            cliques.append([v])
    return cliques


def clique_graph(feats: torch.Tensor, control: GraphControl, value: float, second_order: bool) -> dict[str, Any]:
    """`make_max_cliques`: the graph of feats·featsᵀ cut by average degree or threshold, the edges in >= 2 triangles
    when `second_order`, its maximal cliques and their anchors (mean node features).

    Returns:
        {"cliques": list of node-id lists, "anchors": (Q, D) tensor} (plain types: the method's saved state).
    """
    sim = feats @ feats.T
    adj = degree_graph(sim, value) if control == "degree" else threshold_graph(sim, value)
    if second_order:
        adj = ((adj * (adj @ adj)) > 1).to(adj.dtype)
    cliques = maximal_cliques(adj)
    anchors = torch.stack([feats[c].mean(0) for c in cliques])
    return {"cliques": cliques, "anchors": anchors}


def clique_scores(x: torch.Tensor, graph: dict[str, Any], targets: torch.Tensor, ratio: float, alpha: float,
                  beta: float) -> torch.Tensor:
    """`compute_clique_logits`: the cliques of the max(1, int(Q·ratio)) anchors nearest x; each node n of them scores
    α·exp(-(β - β·x·f_n)), every other node 0.

    Args:
        x: (D,) query. graph: `clique_graph`'s. targets: (n, D) the nodes' current features.

    Returns:
        (n,) scores.
    """
    cliques = graph["cliques"]
    near = torch.topk(graph["anchors"] @ x, max(1, int(len(cliques) * ratio))).indices
    nodes = torch.unique(torch.cat([torch.tensor(cliques[j]) for j in torch.unique(near).tolist()])).tolist()
    out = torch.zeros(targets.shape[0], dtype=targets.dtype, device=targets.device)
    out[nodes] = alpha * ((-1) * (beta - beta * (targets[nodes] @ x))).exp()
    return out


class COSMIC(TTAMethod):
    key: ClassVar[str] = "cosmic"
    prefix_stable: ClassVar[bool] = True  # memories and graphs hold only samples already seen
    Config: ClassVar[type[MethodConfig]] = COSMICConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    _state_fields: ClassVar[tuple[str, ...]] = ("memory", "mem_entropy", "mem_count", "dino_cache", "clip_graph",
                                                "dino_graph")
    external_files: ClassVar[tuple[ExternalFile, ...]] = (
        ExternalFile("dino_weights", "the DINOv2 ViT-L/14 (registers) folder", DINO_SOURCE, kind="dir",
                     contains=TIMM_FOLDER_FILES),)
    #: the config field naming a second image encoder (timm) whose features of the original view the runner caches
    #: and attaches (`attach_second_encoder`, extract/run/reward.py)
    second_encoder: ClassVar[str] = "dino_weights"
    # Unseen data: the fine-grained row (DTD's: 8 memory items a space, AugMix views) with the 80 CLIP templates and
    # no CuPL (no sentences exist for a user's classes)
    unseen_like: ClassVar[str] = "dtd"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80", "cupl": False})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> COSMICConfig:
        check_hparams_key(hparams_key)
        alpha, beta = TDA_ALPHA_BETA[hparams_key]  # configs_l/*.yaml positive.alpha/beta repeat TDA's
        lam1, lam2 = COSMIC_LAMBDAS[hparams_key]
        family = hparams_key in IMAGENET_FAMILY  # cosmic_ood.sh: 16 items a space; cosmic_cd.sh: 8
        return COSMICConfig(augmix=not family, clip_memory=16 if family else 8, dino_memory=16 if family else 8,
                            clique_alpha=alpha, clique_beta=beta, lambda1=lam1, lambda2=lam2)

    @classmethod
    def needed_files(cls, config: MethodConfig) -> tuple[ExternalFile, ...]:
        """The DINOv2 folder, unless `dino=false` (COSMIC's CLIP-only ablation reads no second model)."""
        return cls.external_files if config.dino else ()  # type: ignore[attr-defined]

    @classmethod
    def needs_second_encoder(cls, config: MethodConfig) -> bool:
        return bool(config.dino)  # type: ignore[attr-defined]

    def __init__(self, config: COSMICConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.memory: torch.Tensor | None = None  # (K, clip_memory, D) CLIP features, zeros in empty slots
        self.mem_entropy: torch.Tensor | None = None  # (K, clip_memory)
        self.mem_count: list[int] = [0] * self.n_classes
        self.dino_cache: ClassCache | None = None  # DINOv2 features of the original view, by pseudo-class
        self.clip_graph: dict[str, Any] | None = None  # {"cliques", "anchors"} of the 2K CLIP nodes
        self.dino_graph: dict[str, Any] | None = None  # of the K DINOv2 class means
        self._second: Callable[[int, int], Any] | None = None

    def attach_second_encoder(self, reader: Callable[[int, int], Any]) -> None:
        """The reader of the DINOv2 features of the original view: reader(a, b) -> (b - a, 1, D') for stream
        positions [a, b) (extract/run/reward.py `attach_second_encoder`)."""
        self._second = reader

    def _dino_feats(self, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        if not self.config.dino:  # type: ignore[attr-defined]
            return None
        if self._second is None:
            raise ValueError("cosmic: no DINOv2 features attached; the runner loads the model of --set "
                             "dino_weights=DIR and attaches them (`attach_second_encoder`), or set dino=false")
        d = torch.as_tensor(np.asarray(self._second(self.n_seen, self.n_seen + n)))[:, 0]
        return d.to(device=device, dtype=dtype)

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        c: COSMICConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(view_feats)
        u = min(view_feats.shape[1], c.used_views)
        x = view_feats[:, :u].to(dt)  # (B, U, D) L2-normalised
        t = F.normalize(self.text_features.to(dt), dim=-1)  # `get_text_prediction` re-normalises
        dino = self._dino_feats(x.shape[0], x.device, dt)
        if self.memory is None:
            self._init_state(x.device, dt, None if dino is None else dino.shape[-1])
        z = self.logit_scale * x @ t.T  # (B, U, K)
        p = z.softmax(-1)
        h_view = -(p * torch.log(p + SELECT_ENTROPY_EPS)).sum(-1)
        sel = torch.argsort(h_view, dim=1, stable=True)[:, :n_confident(u, c.selection_p)]  # (B, n)
        init = torch.gather(p, 1, sel[..., None].expand(-1, -1, p.shape[-1])).mean(1)  # (B, K)
        stored = torch.gather(x, 1, sel[..., None].expand(-1, -1, x.shape[-1])).mean(1)  # (B, D) not re-normalised
        h = -(init * torch.log(init + MEMORY_ENTROPY_EPS)).sum(-1)
        out = torch.empty(x.shape[0], self.n_classes, dtype=dt, device=x.device)
        for b, y in enumerate(init.argmax(-1).tolist()):  # sequential by nature: memories and graphs change
            i = self.n_seen + b
            clip_new = self._write(y, stored[b], h[b])
            p_mem, adaptive = self._read(x[b, 0], t)
            score = p[b, 0] + c.clip_clique_weight * self._clip_cliques(i, clip_new, x[b, 0], t, adaptive)
            if dino is not None:
                score = score + c.dino_clique_weight * self._dino_cliques(i, p[b, 0] + p_mem, dino[b])
            out[b] = self._log_score(score, z[b, 0])
        return out

    def _init_state(self, device: torch.device, dt: torch.dtype, dino_dim: int | None) -> None:
        c: COSMICConfig = self.config  # type: ignore[assignment]
        self.memory = torch.zeros(self.n_classes, c.clip_memory, self.dim, dtype=dt, device=device)
        self.mem_entropy = torch.zeros(self.n_classes, c.clip_memory, dtype=dt, device=device)
        if dino_dim is not None:
            self.dino_cache = ClassCache(self.n_classes, c.dino_memory, dino_dim, device=device, dtype=dt)

    def _write(self, y: int, feat: torch.Tensor, h: torch.Tensor) -> bool:
        """`update_memory_bank`: append while class y has room, else replace its highest-entropy item (of ties, the
        last slot) when h is below some stored entropy. Returns whether the memory changed."""
        assert self.memory is not None and self.mem_entropy is not None
        n = self.mem_count[y]
        if n < self.config.clip_memory:  # type: ignore[attr-defined]
            self.memory[y, n], self.mem_entropy[y, n] = feat, h
            self.mem_count[y] = n + 1
            return True
        e = self.mem_entropy[y]
        if not bool((h < e).any()):
            return False
        j = e.shape[0] - 1 - int(e.flip(0).argmax())  # argmax returns the first maximum; flipped: the last
        self.memory[y, j], self.mem_entropy[y, j] = feat, h
        return True

    def _read(self, f0: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`DualMem.get_image_pred`: (p_mem (K,), the read-out features a (K, D)), keys = the items then t_c."""
        assert self.memory is not None
        c: COSMICConfig = self.config  # type: ignore[assignment]
        stored = torch.cat([self.memory, self.text_features.to(self.memory.dtype)[:, None]], dim=1)  # (K, M+1, D)
        if c.clip_center == "default":  # equal weights: the items and t_c summed over count + 1
            counts = torch.tensor(self.mem_count, dtype=stored.dtype, device=stored.device)
            adaptive = F.normalize(stored.sum(1) / (counts[:, None] + 1), dim=-1)
        else:  # "attn" with the zero biases of the zero-shot setting (`--position all`)
            keys = stored / stored.norm(dim=-1, keepdim=True)
            keys[stored.sum(-1) == 0] = 0  # empty slots stay empty
            q = f0 / f0.norm()
            w = torch.exp(-c.beta * (-(keys * q).sum(-1) + 1))  # (K, M+1)
            adaptive = (keys * w[..., None]).sum(1)
            adaptive = adaptive / adaptive.norm(dim=-1, keepdim=True)
            adaptive = adaptive / adaptive.norm(dim=-1, keepdim=True)  # again after the (zero) output bias
        return (self.logit_scale * adaptive @ f0).softmax(-1), adaptive

    def _due(self, i: int, changed: bool, warmup: int) -> bool:
        """Whether a space's graph is rebuilt at stream position i (`cosmic_main.py` l.451-454, l.493-497)."""
        c: COSMICConfig = self.config  # type: ignore[assignment]
        if c.always_update_graph:
            return changed
        return (i % c.mac_step == 0 and i > warmup) or (changed and i <= warmup)

    def _control(self, i: int, clip_space: bool) -> float:
        """The graph's target average degree (CLIP: 0.8 of it) or threshold (growing by 1e-5 a sample)."""
        c: COSMICConfig = self.config  # type: ignore[assignment]
        if c.control == "degree":
            return c.target_avg_degree * (0.8 if clip_space else 1.0)
        t0 = c.lambda1 if clip_space else c.lambda2
        return min(1.0, t0 + 1e-5 * i) if c.increase_threshold else t0

    def _clip_cliques(self, i: int, changed: bool, f0: torch.Tensor, t: torch.Tensor,
                      adaptive: torch.Tensor) -> torch.Tensor:
        """(K,) the CLIP clique scores: the text and read-out nodes' scores averaged per class."""
        c: COSMICConfig = self.config  # type: ignore[assignment]
        nodes = torch.cat([self.text_features.to(adaptive.dtype), adaptive])  # (2K, D) `clip_both_feats_space`
        if self.clip_graph is None or self._due(i, changed, self.n_classes * c.clip_memory):
            self.clip_graph = clique_graph(nodes, c.control, self._control(i, True), c.second_order)
        s = clique_scores(f0, self.clip_graph, nodes, c.clique_ratio, c.clique_alpha, c.clique_beta)
        return (s[:self.n_classes] + s[self.n_classes:]) / 2

    def _dino_cliques(self, i: int, fused: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """(K,) the DINOv2 clique scores, after the cache took (d, H(softmax(fused))) under argmax(fused)."""
        assert self.dino_cache is not None
        c: COSMICConfig = self.config  # type: ignore[assignment]
        cache = self.dino_cache
        y = int(fused.argmax())
        loss = output_entropy(fused)  # `avg_entropy` of one row: l = z - logsumexp(z), -Σ l·exp(l)
        changed = cache.counts[y] < cache.capacity or bool(loss < cache.scores[y, -1])
        cache.update(y, d, loss)
        valid = cache.valid.to(cache.keys.dtype)  # class means, zeros for empty classes (`make_prototype_features`)
        protos = (cache.keys * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp_min(1)
        if self.dino_graph is None or self._due(i, changed, self.n_classes * c.dino_memory):
            self.dino_graph = clique_graph(protos, c.control, self._control(i, False), c.second_order)
        return clique_scores(d, self.dino_graph, protos, c.clique_ratio, c.clique_alpha, c.clique_beta)

    def _log_score(self, score: torch.Tensor, z0: torch.Tensor) -> torch.Tensor:
        """log(score / Σ score); where score is 0 (p_0 underflowed, no clique term), log p_0 in log space."""
        log = torch.where(score > 0, score.log(), z0.log_softmax(-1))
        return log - math.log(float(score.sum()))

    def summary(self) -> dict[str, Any]:
        """Memory sizes and the cliques of the last graphs."""
        out: dict[str, Any] = {"clip_memory_items": sum(self.mem_count)}
        if self.dino_cache is not None:
            out["dino_cache_items"] = len(self.dino_cache)
        for name, g in (("clip_cliques", self.clip_graph), ("dino_cliques", self.dino_graph)):
            if g is not None:
                out[name] = len(g["cliques"])
        return out
