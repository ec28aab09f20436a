"""TCA: token condensation as training-free test-time adaptation (Wang et al., ICCV'25; official code
`Jo-wang/TCA @0f846d6`, `runner.py`, `utils.py`, `clip/model.py`, `clip/utils.py`).

docs/methods.md, "TCA: token condensation inside the ViT, a reservoir of class tokens".

Online over the stream, one sample at a time (the official loader's batch size is 1). State: a reservoir of at most
`reservoir_size` items per pseudo-class, each item the class tokens of one past sample after every block,
(L, W), with its entropy. Per sample x at stream position t:

1. The ViT runs with its blocks `drop_layers` (3, 6, 9) replaced (`ResidualAttentionBlock_Ours`, ratio r =
   `drop_rate`): with N tokens, keep = ⌈(1 − r)(N − 1)⌉ and m = N − keep;
   * once every class holds two items or more, the block's input class token picks the class whose reservoir
     mean class token (of the block before) is most cosine-similar; that mean token is prepended to the attention
     as an extra token (its output dropped);
   * the patches are ranked by the class token's attention (mean over heads): the first keep − 2m stay, the next
     2m are condensed into `n_centers` (4) tokens by coreset averaging (greedy k-centre from a random first centre,
     nearest-centre clusters, inverse-distance weights, the centre itself weight 1), the other N − 1 − keep fuse into
     one token weighted by their attention (EViT's fused token); the MLP then runs on the condensed sequence.
2. f = the normalised feature, z = s·f·Tᵀ, H = softmax entropy of z, ŷ = argmax z; the class tokens after every
   block, c (L, W), are kept.
3. Reservoir: (c, H) joins class ŷ; if it then holds more than `reservoir_size`, the item of largest H + (mean
   cosine similarity of its layer-mean class token to the class's other items) leaves; the class is sorted by H.
4. Logits: z + λ Σ_items onehot(class) · exp(−β (1 − a)), a = Σ_l w_l cos(c_l, c_item,l), w = softmax(linspace(0, 1,
   L) / `scale`) (the official exp(·)/Σexp(·)), over the reservoir after step 3.
5. The class-mean class tokens of the reservoir become the context of step 1 for the next sample.

The coreset's random first centres come from one torch generator seeded with `coreset_seed` (the official
`torch.manual_seed(1)` in `runner.py:142`), drawn in stream order, 1 per condensed block per sample; its state is
part of the method's state. The run hands TCA each sample's pixels (`consumes="view_pixels"`,
extract/run/pixels.py); the zero-shot row stays the cached view-0 feature's. On resume the online state is rebuilt
by replaying the kept prefix (its pixels through the same forward), as every online method does.

ViT backbones only (the official `--backbone` accepts ViT-B/16 alone; its ResNet has no condensation path): any
tower but open_clip's plain ViT is refused in one line when the method is built, before any image is read (as TTL).

Where this differs from the official code: the model's logit scale for the hard-coded 100; the encoder under the
run's precision (autocast fp16 on CUDA, fp32 on the CPU; the reservoir, affinities and cache logits in fp32) where
the official code runs OpenAI's fp16 weights and rounds the context tokens, the condensed tokens, the entropies and
the cache logits to fp16; w over the model's L blocks (the official linspace has 12 points, 24 for ViT-L/14: the
same for OpenAI's ViTs); `drop_layers` beyond the model's blocks are skipped with a warning (a small test model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F

from extract.methods.base import MethodConfig, PromptSet, check_hparams_key, setting, text_setting
from extract.methods.common import softmax_entropy
from extract.methods.tokens import EncoderMethod, encoder_autocast, plain_vit_refusal


@dataclass(frozen=True)
class TCAConfig(MethodConfig):
    """TCA's settings: `runner.py` argparse defaults and `configs/<dataset>.yaml` (ImageNet's row here)."""

    n_views: int = setting(1, ge=1)  # batch_size=1 with CLIP's preprocess (`utils.py:268-287`); only view 0 is read
    augmix: bool = False
    prompts: PromptSet = "clip_dataset"  # CLIP's per-dataset ensembles (`datasets/*.py` `template(s)`)
    cupl: bool = False
    reservoir_size: int = setting(3, ge=1)  # items per class (`configs/*.yaml` reservoir_size)
    scale: float = setting(0.1, gt=0)  # temperature of the layer weights exp(linspace(0, 1, L) / scale)
    lambd: float = setting(3.0, ge=0)  # weight of the reservoir logits
    beta: float = setting(5.0, ge=0)  # sharpness of exp(-beta (1 - affinity))
    drop_rate: float = setting(0.1, gt=0, lt=1)  # `--token_pruning Ours-0.1` (`runner.py:25`)
    # the condensed blocks, 0-based (`clip/model.py:491` drop_loc = [3, 6, 9])
    drop_layers: str = text_setting("3,6,9", nonempty=True)
    n_centers: int = setting(4, ge=1)  # `coreset_averaging(x_cluster, num_centers=4)` (`clip/model.py:335`)
    coreset_seed: int = setting(1, ge=0)  # `torch.manual_seed(1)` (`runner.py:140-142`)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layers()

    def layers(self) -> tuple[int, ...]:
        """`drop_layers` as sorted block indices; ValueError naming the field for anything but 0-based integers."""
        try:
            out = tuple(sorted({int(p) for p in self.drop_layers.split(",") if p.strip()}))
        except ValueError:
            out = ()
        if not out or min(out) < 0:
            raise ValueError(f"drop_layers: expected comma-separated block indices >= 0 (e.g. 3,6,9), got "
                             f"{self.drop_layers!r}")
        return out


# (reservoir_size, scale, lambd, beta) per dataset (`configs/<name>.yaml`, its four keys; one set for ViT-B/16, the
# only backbone the official code runs)
TCA_TABLE: dict[str, tuple[int, float, float, float]] = {
    "imagenet": (3, 0.1, 3.0, 5.0), "imagenet_a": (3, 0.01, 3.0, 5.0), "imagenet_v2": (3, 0.1, 4.0, 9.0),
    "imagenet_r": (3, 0.1, 3.0, 8.0), "imagenet_sketch": (3, 0.1, 4.0, 8.0), "caltech101": (3, 1.0, 7.0, 6.0),
    "dtd": (3, 1.0, 2.0, 6.0), "eurosat": (2, 5.0, 8.0, 7.0), "fgvc_aircraft": (3, 0.02, 2.0, 2.0),
    "food101": (3, 0.01, 2.0, 5.0), "flowers102": (3, 0.01, 7.0, 7.0), "oxford_pets": (3, 5.5, 2.0, 6.0),
    "stanford_cars": (3, 0.1, 1.5, 8.0), "sun397": (3, 0.01, 4.0, 3.0), "ucf101": (3, 0.01, 6.0, 8.0),
}


def complement(idx: torch.Tensor, n: int) -> torch.Tensor:
    """The indices in [0, n) not in `idx` (1-D), ascending (`utils.py:complement_idx`)."""
    keep = torch.ones(n, dtype=torch.bool, device=idx.device)
    keep[idx] = False
    return keep.nonzero()[:, 0]


def coreset_average(tokens: torch.Tensor, n_centers: int, gen: torch.Generator) -> torch.Tensor:
    """`clip/utils.py:coreset_averaging` for one sample: (n, W) tokens -> (n_centers, W), at least float32.

    Greedy k-centre: a first centre drawn uniformly (`torch.randint(n, (1,))` on the CPU generator `gen`), then
    n_centers − 1 times the token farthest from the centres so far (first on ties). Each token joins its nearest
    centre (first on ties); a cluster's token is the mean of its members weighted by the inverse
    distance to the centre, the centre itself (distance 0) weight 1. An empty cluster gives a zero token.
    """
    n = tokens.shape[0]
    first = int(torch.randint(n, (1,), generator=gen))
    centers = [first]
    nearest = torch.norm(tokens - tokens[first], dim=1)
    for _ in range(n_centers - 1):
        nxt = int(torch.argmax(nearest))
        centers.append(nxt)
        nearest = torch.minimum(nearest, torch.norm(tokens - tokens[nxt], dim=1))
    c = tokens[centers]
    # the official's `.float()` distances and float32 buffer hold its fp16 tokens exactly: at least float32 here
    wide = torch.promote_types(tokens.dtype, torch.float32)
    owner = torch.argmin(torch.cdist(tokens.to(wide), c.to(wide)), dim=1)
    out = torch.zeros(n_centers, tokens.shape[1], dtype=wide, device=tokens.device)
    eps = 1e-8
    for i in range(n_centers):
        members = tokens[owner == i]
        if members.shape[0] == 0:
            continue
        d = torch.norm(members - c[i], dim=1)
        d[d == 0] = eps
        w = 1 / d
        w[d == eps] = 1.0
        out[i] = torch.sum(members * (w / w.sum()).unsqueeze(-1), dim=0)
    return out


def attention_with_weights(blk: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's self-attention on ln_1(x), (1, T, W) -> (output (1, T, W), weights (1, H, T, T)), as
    `nn.MultiheadAttention(need_weights=True, average_attn_weights=False)` computes them."""
    attn = blk.attn
    h = blk.ln_1(x)
    q, k, v = F.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    n, t, w = x.shape
    heads = attn.num_heads

    def split(z: torch.Tensor) -> torch.Tensor:  # (N, T, W) -> (N, H, T, W/H)
        return z.reshape(n, t, heads, w // heads).transpose(1, 2)

    weights = ((split(q) * (w // heads) ** -0.5) @ split(k).transpose(-1, -2)).softmax(dim=-1)
    o = (weights @ split(v)).transpose(1, 2).reshape(n, t, w)
    return F.linear(o, attn.out_proj.weight, attn.out_proj.bias), weights


def condense(x: torch.Tensor, cls_attn: torch.Tensor, rate: float, n_centers: int, gen: torch.Generator
             ) -> torch.Tensor:
    """The token reduction of `ResidualAttentionBlock_Ours.forward` (`clip/model.py:291-346`) for one sample.

    Args:
        x: (1, N, W) tokens after the attention's residual; cls_attn: (1, H, N − 1) the class token's attention
            to the patches; rate: the drop rate; n_centers: the coreset's tokens; gen: the coreset's generator.

    Returns:
        (1, keep − 2m + n_centers + 2, W): [class token, the keep − 2m top patches (in rank order), the coreset
        tokens, the fused token].
    """
    n = x.shape[1]
    keep = math.ceil((1 - rate) * (n - 1))
    m = n - keep
    a = cls_attn.mean(dim=1)  # (1, N - 1)
    top = torch.topk(a, keep - 2 * m, dim=1, largest=True, sorted=True).indices[0]
    top_all = torch.topk(a, keep, dim=1, largest=True, sorted=True).indices[0]
    patches = x[0, 1:]
    merged = coreset_average(patches[top_all[top.shape[0]:]], n_centers, gen)
    rest = complement(top_all, n - 1)
    fused = torch.sum(patches[rest] * a[0, rest].unsqueeze(-1), dim=0, keepdim=True)
    return torch.cat([x[0, :1], patches[top], merged.to(x.dtype), fused])[None]


def condensed_block(blk: Any, x: torch.Tensor, rate: float, context: torch.Tensor | None, n_centers: int,
                    gen: torch.Generator) -> torch.Tensor:
    """One block of `drop_layers`: attention (with the context token prepended when there is one), condensation,
    MLP (`ResidualAttentionBlock_Ours.forward`, `clip/model.py:286-348`). x: (1, N, W); context: (C, W)."""
    r = 0
    seq = x
    if context is not None:
        pick = torch.argmax(F.cosine_similarity(context, x[:, 0], dim=-1))
        seq = torch.cat([context[pick].to(x.dtype)[None, None], x], dim=1)
        r = 1
    out, weights = attention_with_weights(blk, seq)
    x = x + blk.ls_1(out[:, r:])
    x = condense(x, weights[:, :, r, r + 1:], rate, n_centers, gen)
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


class TCA(EncoderMethod):
    """TCA: the ViT's forward condenses tokens around reservoir class tokens; a class-token reservoir adds logits."""

    key: ClassVar[str] = "tca"
    prefix_stable: ClassVar[bool] = True  # online: a row reads its own and earlier samples only
    Config: ClassVar[type[MethodConfig]] = TCAConfig
    image_towers: ClassVar[frozenset[str]] = frozenset({"vit"})  # `plain_vit_refusal` on the loaded model
    tower_need: ClassVar[str] = ("condenses the tokens of a ViT image encoder (the official code runs ViT-B/16 "
                                 "only)")
    _state_fields: ClassVar[tuple[str, ...]] = ("res_tokens", "res_entropy", "res_counts", "coreset_rng")
    # Unseen data (`EncoderMethod`): ImageNet's row with the 80 templates, ImageNet's own ensemble

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: TCAConfig = self.config  # type: ignore[assignment]
        self.n_blocks = len(self.visual.transformer.resblocks)
        self.drop = tuple(i for i in cfg.layers() if i < self.n_blocks)
        skipped = [i for i in cfg.layers() if i >= self.n_blocks]
        if skipped:
            self.warnings.append(f"tca on {backbone}: drop_layers {','.join(map(str, skipped))} are beyond the "
                                 f"model's {self.n_blocks} vision blocks; those are not condensed")
        self._check_token_counts()
        w = torch.softmax(torch.linspace(0, 1, self.n_blocks, dtype=torch.float64) / cfg.scale, dim=0)
        self.layer_weights = w  # (L,) float64, as `runner.py:71-75`
        self.res_tokens: torch.Tensor | None = None  # (K, cap, L, W) class tokens, zeros in empty slots
        self.res_entropy: torch.Tensor | None = None  # (K, cap) entropies, +inf in empty slots
        self.res_counts: list[int] = [0] * self.n_classes
        self._gen = torch.Generator().manual_seed(cfg.coreset_seed)
        self.coreset_rng = self._gen.get_state()
        self._context: torch.Tensor | None = None  # (K, L, W) class-mean class tokens once every class holds 2

    @classmethod
    def tower_refusal(cls, visual: Any) -> str | None:
        return plain_vit_refusal(visual)

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TCAConfig:
        check_hparams_key(hparams_key)
        size, scale, lambd, beta = TCA_TABLE[hparams_key]
        return TCAConfig(reservoir_size=size, scale=scale, lambd=lambd, beta=beta)

    def _check_token_counts(self) -> None:
        """Each condensed block keeps at least 2m patches to rank (keep − 2m >= 0): one line naming the block."""
        cfg: TCAConfig = self.config  # type: ignore[assignment]
        n = int(self.visual.positional_embedding.shape[0])
        for i in self.drop:
            keep = math.ceil((1 - cfg.drop_rate) * (n - 1))
            if keep - 2 * (n - keep) < 0:
                raise ValueError(f"tca: drop_rate={cfg.drop_rate} leaves {keep} of {n - 1} patches at block {i}, "
                                 f"fewer than twice the {n - keep} condensed ones; lower drop_rate")
            n = keep - 2 * (n - keep) + cfg.n_centers + 2

    @torch.no_grad()
    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, 3, S, S) -> (feature (D,) L2-normalised, class tokens after every block (L, W)) through the condensing
        forward (`VisionTransformer.forward` with `Transformer_drop`, `clip/model.py:443-528`)."""
        cfg: TCAConfig = self.config  # type: ignore[assignment]
        x = self.visual._embeds(image)
        cls = []
        for i, blk in enumerate(self.visual.transformer.resblocks):
            if i in self.drop:  # the context of block i: the mean class tokens after block i - 1 (python's -1)
                ctx = None if self._context is None else self._context[:, i - 1]
                x = condensed_block(blk, x, cfg.drop_rate, ctx, cfg.n_centers, self._gen)
            else:
                x = blk(x)
            cls.append(x[0, 0])
        pooled, _ = self.visual._pool(x)
        if self.visual.proj is not None:
            pooled = pooled @ self.visual.proj
        return F.normalize(pooled[0], dim=-1), torch.stack(cls)

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        b, v, _ = view_feats.shape
        dev, dtype = view_feats.device, self.visual.conv1.weight.dtype
        text = self.text_features.to(dev, dtype)
        out = []
        for i in range(b):  # sequential by nature: sample i's forward reads the reservoir after sample i - 1
            image = self.view0_pixels(self.n_seen + i, 1, v, dev)
            with encoder_autocast(self.text_encoder, dev):
                feat, cls = self.forward(image)
            out.append(self._step(feat.to(dtype), cls.to(dtype), text))
        return torch.stack(out)

    def _step(self, feat: torch.Tensor, cls: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Steps 2-5 for one sample: (D,) feature, (L, W) class tokens -> (K,) logits."""
        z = self.logit_scale * feat @ text.T
        self._store(int(torch.argmax(z)), cls, softmax_entropy(z))
        return z + self._reservoir_logits(cls)

    def _store(self, c: int, cls: torch.Tensor, ent: torch.Tensor) -> None:
        """`update_reservoir_sim` (`runner.py:37-64`): add, evict the item of largest H + mean similarity when over
        capacity, sort by H (stable); then the context of the next sample (`CLIP.update_cls_token`)."""
        cfg: TCAConfig = self.config  # type: ignore[assignment]
        cap = cfg.reservoir_size
        if self.res_tokens is None:
            self.res_tokens = cls.new_zeros(self.n_classes, cap, *cls.shape)
            self.res_entropy = torch.full((self.n_classes, cap), math.inf, dtype=ent.dtype, device=ent.device)
        assert self.res_entropy is not None
        n = self.res_counts[c]
        toks = torch.cat([self.res_tokens[c, :n], cls[None]])  # (n + 1, L, W)
        ents = torch.cat([self.res_entropy[c, :n], ent[None]])
        if n + 1 > cap:  # `cls_feature_similarity`: layer-mean class tokens, mean cosine to the others
            unit = F.normalize(toks.mean(dim=1), dim=1)
            sim = unit @ unit.T
            sim = (sim.sum(dim=1) - sim.diagonal()) / n
            drop = int(torch.argmax(ents.double() + sim.double()))  # python floats in the official score
            kept = [j for j in range(n + 1) if j != drop]
            toks, ents = toks[kept], ents[kept]
        order = torch.sort(ents, stable=True).indices
        m = toks.shape[0]
        self.res_tokens[c, :m], self.res_entropy[c, :m] = toks[order], ents[order]
        self.res_counts[c] = m
        self._refresh_context(c)

    def _refresh_context(self, changed: int | None) -> None:
        """The class-mean class tokens, (K, L, W), once every class holds more than one item (then at every sample;
        only class `changed` moved since the last call; None: all of them, after loading a state). Each class's mean
        is taken the same way on both paths, so a resumed run's context equals an uninterrupted run's."""
        if self.res_tokens is None or min(self.res_counts) < 2:
            self._context = None
            return
        rows = range(self.n_classes) if self._context is None or changed is None else (changed,)
        if self._context is None:
            self._context = torch.empty_like(self.res_tokens[:, 0])
        for k in rows:  # the class's items stacked, then their mean (`CLIP.update_cls_token`)
            self._context[k] = self.res_tokens[k, :self.res_counts[k]].mean(dim=0)

    def _reservoir_logits(self, cls: torch.Tensor) -> torch.Tensor:
        """λ Σ_items onehot · exp(−β (1 − Σ_l w_l cos(c_l, item_l))) (`compute_reservoir_logits`, `runner.py:68-95`)."""
        cfg: TCAConfig = self.config  # type: ignore[assignment]
        assert self.res_tokens is not None and self.res_entropy is not None
        cos = F.cosine_similarity(cls[None, None], self.res_tokens, dim=-1)  # (K, cap, L)
        if self.layer_weights.device != cos.device:  # once: not a small copy to the device per sample
            self.layer_weights = self.layer_weights.to(cos.device)
        aff = (cos.double() * self.layer_weights).sum(dim=-1).to(cls.dtype)  # (K, cap)
        valid = torch.isfinite(self.res_entropy)
        return cfg.lambd * (torch.exp(-(cfg.beta - cfg.beta * aff)) * valid).sum(dim=1)

    def state_dict(self) -> dict[str, Any]:
        self.coreset_rng = self._gen.get_state()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._gen.set_state(self.coreset_rng)
        self._refresh_context(None)

    def summary(self) -> dict[str, Any]:
        """Items in the reservoir, and whether the context tokens are in use (every class holds two items)."""
        return {"reservoir_items": int(sum(self.res_counts)), "context_tokens": self._context is not None}
