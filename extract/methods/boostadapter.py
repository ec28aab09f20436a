"""BoostAdapter (Zhang et al., NeurIPS'24; official code `taolinzhang/BoostAdapter @9983e1a`).

docs/methods.md "BoostAdapter" is the spec. TDA's caches (`extract.methods.tda`, whose steps this class reuses)
plus regional bootstrapping of the current sample (`runner.py` `run_test_tda`, `--mode boostadapter`):

1. The sample's feature, logits, entropy and pseudo-label: on ImageNet-A/V/R/Sketch the TDA summary of the 10%
   lowest-entropy views; on the other sets those of view 0 alone (`infer_ori_image`), whatever the view count.
2. Positive cache (3 per class) as TDA's. Negative cache: TDA's gate and values, but first in, first out: the
   official call passes `True` in the position of `include_prob_map`, leaving `fifo` at its default, True.
3. Boosting: the int(V·0.1) lowest-entropy views of all V views, each under its own argmax and softmax entropy, go
   into a copy of the positive cache of capacity 3 + δ per class, for this sample only; the positive cache logits
   are read from that copy. With one view (ImageNet) no view is boosted and BoostAdapter is TDA with a FIFO
   negative cache.

Numerics: float16 throughout by default (`fp16`), as the official run (`clip.load` weights, no autocast), with
the official affinity order exp(-(β - β·a)) and the boosted scores of `get_output_entropy`; `fp16=False` is float32.

Only the boosted classes (at most int(V·0.1)) differ from the positive cache, so the copy is never built: the
positive-cache affinities are computed as TDA's, and the boosted classes' entries are recomputed from their
union (positive items first, then the boosted views in selection order; stable sort by entropy; first 3 + δ), which
is what appending to the copy one item at a time with the official stable sort and truncation leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping

import torch

from extract.methods.base import MethodConfig, PromptSet, check_hparams_key, setting
from extract.methods.common import ClassCache, ViewSummary, softmax_entropy, summarise_views
from extract.methods.tda import TDA, TDA_ALPHA_BETA, TDA_IMAGENET80, TDA_MULTI_VIEW, TDAConfig

SampleSummary = Literal["view0", "selected"]

# δ per dataset (BoostAdapter `configs/*.yaml`). `configs/imagenet.yaml` has none: ImageNet runs with one view, so
# no view is boosted and δ is never read; 0 here.
BOOST_DELTA: dict[str, int] = {
    "imagenet": 0, "imagenet_a": 3, "imagenet_v2": 1, "imagenet_r": 3, "imagenet_sketch": 1, "caltech101": 2,
    "dtd": 0, "eurosat": 0, "fgvc_aircraft": 2, "food101": 3, "flowers102": 0, "oxford_pets": 0,
    "stanford_cars": 3, "sun397": 1, "ucf101": 0,
}


@dataclass(frozen=True)
class BoostAdapterConfig(TDAConfig):
    """BoostAdapter's knobs: TDA's (same values, `configs/*.yaml`) plus δ and the sample summary; defaults are the
    ImageNet config."""

    n_views: int = 1  # ImageNet: the CLIP preprocess alone (`utils.py` `build_test_data_loader`)
    augmix: bool = False  # crop+flip views, never AugMix (`utils.py` `get_ood_preprocess`, `get_cross_dataset_...`)
    prompts: PromptSet = "dataset"  # TDA's per-dataset templates (`datasets/*.py`)
    delta: int = setting(0, ge=0)  # extra boosted slots per class (`configs/*.yaml` delta)
    summary: SampleSummary = "view0"  # "selected" on ImageNet-A/V/R/Sketch (`runner.py` `infer_ori_image`)
    # True: float16 throughout, as the official run (`clip.load` gives fp16 weights on CUDA, no autocast): logits,
    # entropies, summaries, cache keys and scores, affinities exp(-(β - β·a)) and cache logits are float16 tensors,
    # the boosted views scored by `get_output_entropy`. False: float32 (zaec before issue 31); the difference
    # measures the official fp16 rounding (which views are confident, cache order on entropies tied in fp16)
    fp16: bool = True


@dataclass(frozen=True)
class _Boosted:
    """The chunk's boosted views: (B, n, D) features, (B, n) entropies, per sample the n argmax classes."""

    feats: torch.Tensor
    entropy: torch.Tensor
    preds: list[list[int]]


class BoostAdapter(TDA):
    key: ClassVar[str] = "boostadapter"
    prefix_stable: ClassVar[bool] = True  # TDA's caches plus the sample's own boosting views
    Config: ClassVar[type[MethodConfig]] = BoostAdapterConfig
    _state_fields: ClassVar[tuple[str, ...]] = ("pos", "neg", "neg_clock")
    # Unseen data: as TDA (ImageNet's row: one view, alpha 2, beta 5, where BoostAdapter is TDA with a FIFO
    # negative cache), with the 80 CLIP templates.
    unseen_like: ClassVar[str] = "imagenet"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80"})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> BoostAdapterConfig:
        check_hparams_key(hparams_key)
        alpha, beta = TDA_ALPHA_BETA[hparams_key]  # BoostAdapter's configs/*.yaml repeat TDA's alpha and beta
        return BoostAdapterConfig(
            n_views=1 if hparams_key == "imagenet" else 64,
            prompts="imagenet80" if hparams_key in TDA_IMAGENET80 else "dataset",
            alpha=alpha,
            beta=beta,
            delta=BOOST_DELTA[hparams_key],
            summary="selected" if hparams_key in TDA_MULTI_VIEW else "view0",
        )

    def __init__(self, config: BoostAdapterConfig, text_features: torch.Tensor, logit_scale: float,
                 **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.neg_clock = 0  # items offered to the negative cache so far: its FIFO order

    def compute_dtype(self, view_feats: torch.Tensor) -> torch.dtype:
        # float64 inputs stay float64 (exact references in tests)
        if self.config.fp16 and view_feats.dtype != torch.float64:
            return torch.float16
        return super().compute_dtype(view_feats)

    def _init_caches(self, device: torch.device, dtype: torch.dtype) -> None:
        super()._init_caches(device, dtype)
        if dtype == torch.float16:
            # the negative cache's FIFO scores -(arrival number) need float32 (fp16 integers stop at 2048); its
            # keys and masks are fp16 values either way (cast back in `_cache_affinity`)
            c, k, d = self.config, self.n_classes, self.dim
            self.neg = ClassCache(k, c.neg_capacity, d, device=device, dtype=torch.float32,
                                  extras={"mask": ((k,), torch.float32)})

    def _cache_affinity(self, cache: ClassCache, f: torch.Tensor, beta: float) -> torch.Tensor:
        if f.dtype != torch.float16:
            return super()._cache_affinity(cache, f, beta)
        k, cap, d = cache.keys.shape
        aff = (cache.keys.reshape(k * cap, d).to(f.dtype) @ f).reshape(k, cap)
        return official_affinity(aff, beta) * cache.valid

    def _summarise(self, feats: torch.Tensor, logits: torch.Tensor) -> ViewSummary:
        if self.config.summary == "view0":  # `get_clip_logits(..., infer_ori_image=True)`
            return summarise_views(feats[:, :1], logits[:, :1], self.config.selection_p)
        return super()._summarise(feats, logits)

    def _chunk_extra(self, feats: torch.Tensor, logits: torch.Tensor) -> _Boosted:
        """`select_confident_samples(ori_feat, ori_output, 0.1)` over all views: int(V·p) of them (none for V < 10,
        as the official code), each with its softmax entropy and argmax."""
        n = int(logits.shape[1] * self.config.selection_p)
        h = softmax_entropy(logits)  # (B, V)
        sel = torch.argsort(h, dim=1, stable=True)[:, :n]  # (B, n)
        picked = torch.gather(logits, 1, sel[..., None].expand(-1, -1, logits.shape[-1]))
        # the boosted items' scores: `get_output_entropy` (log-probabilities times their exp), which rounds
        # differently from the selection's softmax entropy in float16; the same number in exact arithmetic
        score = output_entropy(picked) if logits.dtype == torch.float16 else torch.gather(h, 1, sel)
        return _Boosted(torch.gather(feats, 1, sel[..., None].expand(-1, -1, feats.shape[-1])), score,
                        picked.argmax(-1).tolist())

    def _update_negative(self, y: int, f: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        # FIFO through TDA's sorted cache: score = -(arrival number), so a newcomer always scores lowest and
        # replaces the last slot, the oldest item of a full class
        assert self.neg is not None
        self.neg_clock += 1
        score = torch.tensor(-float(self.neg_clock), dtype=self.neg.scores.dtype, device=f.device)
        self.neg.update(y, f, score, mask=mask)

    def _positive_affinity(self, i: int, f: torch.Tensor, extra: _Boosted) -> torch.Tensor:
        assert self.pos is not None
        aff = super()._positive_affinity(i, f, extra)  # (K,) the positive cache as it is
        classes = extra.preds[i]
        for c in sorted(set(classes)):
            mine = [j for j, cj in enumerate(classes) if cj == c]
            aff[c] = boosted_class_affinity(self.pos, c, extra.feats[i, mine], extra.entropy[i, mine], f,
                                            self.pos.capacity + self.config.delta, self.config.beta)
        return aff


def official_affinity(aff: torch.Tensor, beta: float) -> torch.Tensor:
    """exp(-(β - β·a)) in the order of `compute_cache_logits` (`((-1) * (beta - beta * affinity)).exp()`): the same
    number as exp(-β(1 - a)), rounded differently in float16."""
    return ((-1) * (beta - beta * aff)).exp()


def output_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`get_output_entropy`: l = z - logsumexp(z); -Σ l·exp(l) over the last axis."""
    log_p = logits - logits.logsumexp(dim=-1, keepdim=True)
    return -(log_p * torch.exp(log_p)).sum(dim=-1)


def boosted_class_affinity(cache: ClassCache, c: int, keys: torch.Tensor, scores: torch.Tensor, query: torch.Tensor,
                           capacity: int, beta: float) -> torch.Tensor:
    """Σ exp(-β(1 - query·k)) over what class c of a copy of `cache` with `capacity` slots holds after the boosted
    items are appended one at a time (each: append, stable sort by score, keep the first `capacity`).

    Appending then truncating one at a time keeps the first `capacity` items of the stable sort of the whole
    sequence (an item dropped has `capacity` items ahead of it, which stay ahead), so one sort suffices.

    Args:
        cache: the positive cache (class c's items in ascending score order).
        c: the class.
        keys: (n, D) boosted features, in insertion order; scores: (n,) their entropies.
        query: (D,) the sample's feature.
        capacity: slots per class of the copy (3 + δ).
        beta: sharpness.

    Returns:
        0-dim affinity sum.
    """
    n = cache.counts[c]
    all_keys = torch.cat([cache.keys[c, :n], keys])
    all_scores = torch.cat([cache.scores[c, :n], scores])
    kept = torch.sort(all_scores, stable=True).indices[:capacity]
    aff = all_keys[kept] @ query
    if query.dtype == torch.float16:
        return official_affinity(aff, beta).sum()
    return torch.exp(-beta * (1.0 - aff)).sum()

