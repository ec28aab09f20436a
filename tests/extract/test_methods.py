"""TTA methods (extract.methods): every registered method on small hand-made feature streams, and each method's
defining behaviour against a slow, obvious reference written here from
docs/methods.md, "TDA: caches and the negative cache band", "DPE: dual prototypes, one step per sample",
"DLAE: logit adjustment, reflection and doubt", "DPE/DLAE numerics"."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F


from extract.methods import REGISTRY, get_method
from extract.methods.base import HPARAMS_KEYS, apply_overrides
from extract.methods.common import ClassCache, adamw_first_step, info_nce, marginal_entropy, torch_adamw_step
from extract.methods.dlae import DLAE
from extract.methods.dpe import DPE
from extract.methods.tda import TDA
from extract.methods.zero_shot import ZeroShot
from tests.support.extract import with_views

K, D = 5, 16  # D = the embedding width of the tiny open_clip model of `tests.support.extract`
NAMES = ("cat", "dog", "sea_lion", "car", "tree")
# float32 logit tolerance: a width-D dot product at scale 100 moves by ~D eps x 100 when its summation order changes
LOGIT_TOL32 = 2 * D * torch.finfo(torch.float32).eps * 100.0


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (tests/support/extract.py)


def make_text(seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=dtype), dim=-1)


def make_stream(n: int, v: int, text: torch.Tensor, seed: int = 1, noise: float = 1.0) -> torch.Tensor:
    """(n, v, D) normalised features clustered around random classes' text prototypes (a plausible stream)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    base = text[y][:, None, :] + noise * torch.randn(n, v, D, generator=g, dtype=text.dtype) / math.sqrt(D)
    return F.normalize(base, dim=-1)


def build(cls, v: int, dataset: str = "dtd", scale: float = 100.0, dtype=torch.float64, encoder=None, **changes):
    """A method on the random prototypes of `make_text`; methods that tune prompts also get the tiny model."""
    if getattr(cls, "needs_reward_model", False):  # RLCF: the policy as its own reward model (no second model)
        changes.setdefault("reward_backbone", "policy")
    facts = {"vision_blocks": len(encoder.model.visual.transformer.resblocks)} if encoder is not None else {}
    if cls.adapt_width(cls.default_config(dataset, "ViT-B-16")) is not None:  # adapts over batches: of 4 here
        changes.setdefault("batch_size", 4)
    cfg = with_views(cls.default_config(dataset, "ViT-B-16"), v, facts, **changes)
    extra = {"text_encoder": encoder, "class_names": NAMES} if cls.needs_text_encoder else {}
    m = cls(cfg, make_text(dtype=dtype), scale, backbone="ViT-B-16", dataset=dataset, **extra)
    if cls.consumes_for(cfg) == "view_pixels":  # TTL adapts the image encoder: fixed random pixels per position
        size = encoder.preprocess.size[0]
        pixels = torch.randn(32, v, 3, size, size, generator=torch.Generator().manual_seed(11))
        m.attach_views(lambda a, b: pixels[a:b])
    if cls.consumes_for(cfg) == "batch_pixels":  # the original view of each position: fixed random pixels
        size = encoder.preprocess.size[0]
        pixels = torch.randn(32, 3, size, size, generator=torch.Generator().manual_seed(11))
        m.attach_pixels(lambda a, b: pixels[a:b])
    return m


def feed(m, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """`m.adapt` over the stream `x` in calls of `chunk` samples, or of the method's own batch where it has one
    (`adapt_width`: the run never calls it otherwise)."""
    width = type(m).adapt_width(m.config)
    step = chunk if width is None else width
    return torch.cat([m.adapt(x[i:i + step]) for i in range(0, len(x), step)])


@pytest.fixture
def encoder(request):
    """The tiny open_clip model for methods with `needs_text_encoder` (built only when one is tested)."""
    key = request.node.callspec.params.get("key")
    if key is None or not REGISTRY[key].needs_text_encoder:
        return None
    return request.getfixturevalue("tiny_model")


# ---------------------------------------------------------------------------------------------- registry-wide

METHODS = sorted(REGISTRY)


@pytest.mark.parametrize("key", METHODS)
@pytest.mark.parametrize("v", [1, 20])
def test_finite_deterministic_and_chunk_invariant(key, v, encoder):
    cls = REGISTRY[key]
    x = make_stream(30, v, make_text(dtype=torch.float32)).float()
    whole = feed(build(cls, v, dtype=torch.float32, encoder=encoder), x, len(x))
    assert whole.shape == (30, K) and whole.dtype == torch.float32
    assert torch.isfinite(whole).all()
    again = feed(build(cls, v, dtype=torch.float32, encoder=encoder), x, len(x))
    assert torch.equal(whole, again)
    for chunk in (1, 7):
        m = build(cls, v, dtype=torch.float32, encoder=encoder)
        parts = feed(m, x, chunk)
        # a tuner taking several steps per sample carries each step's rounding into the next (RLCF: 5 steps;
        # tests/support/tpt.py `tuned_tol`)
        tol = LOGIT_TOL32 * max(1, getattr(m.config, "tta_steps", 1))
        torch.testing.assert_close(parts, whole, rtol=0, atol=tol)


@pytest.mark.parametrize("key", METHODS)
def test_prefix_stable_declared_and_true(key, encoder):
    """Issue 32 item 1: each method declares whether its first rows depend on the stream's length or a later
    sample (a finished longer run serves a shorter --limit only when they do not). The declaration is checked
    against the rows: the first 8 rows of a 24-sample stream, announced as such, against an 8-sample stream."""
    cls = REGISTRY[key]
    assert "prefix_stable" in vars(cls), f"{key} must declare prefix_stable in its own class"
    x = make_stream(24, 20, make_text(dtype=torch.float32), seed=5).float()

    def rows(n):
        m = build(cls, 20, dtype=torch.float32, encoder=encoder)
        m.set_stream_length(n)
        return torch.cat([m.adapt(x[i:min(i + 4, n)]) for i in range(0, n, 4)])[:8]

    same = torch.equal(rows(24), rows(8))
    why = cls.prefix_dependence(build(cls, 20, dtype=torch.float32, encoder=encoder).config)
    assert (why is None) == cls.prefix_stable
    assert same == cls.prefix_stable, f"{key}: prefix_stable={cls.prefix_stable} but the rows say {same}"


def test_onzeta_with_a_fixed_stream_length_is_prefix_stable():
    from extract.methods.onzeta import OnZeta

    cfg = dataclasses.replace(OnZeta.default_config("dtd", "ViT-B-16"), stream_length=24)
    assert OnZeta.prefix_dependence(cfg) is None
    assert "stream_length=N" in OnZeta.prefix_dependence(OnZeta.default_config("dtd", "ViT-B-16"))


@pytest.mark.parametrize("key", METHODS)
def test_default_config_all_datasets_both_backbones(key):
    cls = REGISTRY[key]
    for ds in HPARAMS_KEYS:
        for bb in ("ViT-B-16", "RN50"):
            cfg = cls.default_config(ds, bb)
            assert isinstance(cfg, cls.Config)
            assert cfg.n_views in (1, 64)
            assert cfg.prompts in ("single", "dataset", "imagenet80", "dpe_cars")
            assert isinstance(cfg.episodic, bool)
            json.dumps(dataclasses.asdict(cfg))  # recorded in the shard metadata
    with pytest.raises(ValueError, match="available: imagenet, imagenet_a"):
        cls.default_config("dtdd", "RN50")


@pytest.mark.parametrize("key", METHODS)
def test_input_checks(key, encoder):
    m = build(REGISTRY[key], 1, encoder=encoder)
    with pytest.raises(ValueError, match="n_views"):
        m.adapt(torch.zeros(2, 3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="feature dim"):
        m.adapt(torch.zeros(2, 1, D + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(B, V, D\)"):
        m.adapt(torch.zeros(2, D, dtype=torch.float64))
    assert m.adapt(torch.zeros(0, 1, D, dtype=torch.float64)).shape == (0, K)


def test_get_method():
    assert get_method("tda") is TDA
    with pytest.raises(ValueError, match=r"unknown method 'tdaa'; available: zero-shot, tda, dpe, dlae"):
        get_method("tdaa")


# ---------------------------------------------------------------------------------------------- overrides

def test_apply_overrides_converts_types():
    cfg = TDA.default_config("dtd", "RN50")
    new = apply_overrides(cfg, {"alpha": "2.5", "pos_capacity": "4", "augmix": "true", "prompts": "imagenet80"})
    assert (new.alpha, new.pos_capacity, new.augmix, new.prompts) == (2.5, 4, True, "imagenet80")
    assert cfg.alpha == 2.0  # the original is frozen and unchanged
    assert apply_overrides(cfg, {"alpha": 3}).alpha == 3.0
    assert apply_overrides(DLAE.default_config("dtd", "RN50"), {"amp_fp16": "0"}).amp_fp16 is False


def test_apply_overrides_rejects_bad_input():
    cfg = DPE.default_config("dtd", "RN50")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) 'alpah'.*valid keys: .*alpha.*lr_text"):
        apply_overrides(cfg, {"alpah": "1"})
    with pytest.raises(ValueError, match="expected float"):
        apply_overrides(cfg, {"alpha": "six"})
    with pytest.raises(ValueError, match="expected a boolean"):
        apply_overrides(cfg, {"cupl": "maybe"})
    with pytest.raises(ValueError, match="expected one of"):
        apply_overrides(cfg, {"prompts": "gpt4"})
    with pytest.raises(ValueError, match="property of the method"):
        apply_overrides(cfg, {"episodic": "true"})
    with pytest.raises(ValueError, match="n_views=0 is out of range; valid: n_views >= 1"):
        apply_overrides(cfg, {"n_views": "0"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.alpha = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- default_config

def test_tda_tables():
    c = TDA.default_config("imagenet_sketch", "RN50")
    assert (c.alpha, c.beta, c.n_views, c.augmix, c.prompts) == (2.363, 7.45, 64, True, "imagenet80")
    c = TDA.default_config("imagenet", "ViT-B-16")
    assert (c.alpha, c.beta, c.n_views, c.prompts) == (2.0, 5.0, 1, "dataset")
    c = TDA.default_config("imagenet_v2", "ViT-B-16")
    assert (c.alpha, c.beta, c.n_views, c.augmix, c.prompts) == (1.0, 8.0, 64, True, "dataset")
    c = TDA.default_config("eurosat", "ViT-B-16")
    assert (c.alpha, c.beta, c.n_views, c.cupl) == (4.0, 8.0, 1, False)
    assert (c.neg_alpha, c.neg_beta, c.pos_capacity, c.neg_capacity) == (0.117, 1.0, 3, 2)
    assert TDA.default_config("dtd", "RN50") == TDA.default_config("dtd", "ViT-B-16")


def test_dpe_tables():
    c = DPE.default_config("imagenet", "RN50")
    assert (c.alpha, c.beta, c.lr_text, c.lr_image, c.align) == (6.0, 5.0, 6e-4, 6e-4, 0.5)
    assert (c.n_views, c.augmix, c.all_view_inference, c.cupl) == (64, True, False, True)
    c = DPE.default_config("imagenet_a", "ViT-B-16")
    assert (c.lr_text, c.align, c.all_view_inference, c.n_views) == (3e-4, 2.5, True, 64)
    c = DPE.default_config("eurosat", "ViT-B-16")
    assert (c.alpha, c.beta, c.lr_text, c.align, c.n_views, c.cupl) == (3.0, 8.0, 5e-5, 0.2, 1, True)
    assert DPE.default_config("stanford_cars", "RN50").prompts == "dpe_cars"
    assert DPE.default_config("imagenet_r", "RN50").prompts == "imagenet80"
    assert (c.temperature, c.adamw_eps, c.weight_decay, c.global_threshold) == (0.01, 1e-3, 0.1, 0.1)


def test_dlae_tables():
    rn, vit = DLAE.default_config("imagenet_v2", "RN50"), DLAE.default_config("imagenet_v2", "ViT-B-16")
    assert (rn.adjust_alpha, rn.reflection_alpha, rn.doubt_rate, rn.backbone_family) == (3.0, 0.5, 0.0, "rn")
    assert (vit.adjust_alpha, vit.reflection_alpha, vit.doubt_rate, vit.backbone_family) == (2.5, 0.5, 2e-3, "vit")
    assert (rn.alpha, rn.beta, rn.lr_text, rn.align, rn.n_views, rn.augmix) == (3.0, 8.0, 5e-4, 0.5, 64, False)
    c = DLAE.default_config("imagenet_r", "ViT-B-16")
    assert (c.n_views, c.augmix, c.doubt_rate, c.align) == (64, True, 1e-5, 0.0)
    assert DLAE.default_config("eurosat", "ViT-B-16").cupl is False
    eu = DLAE.default_config("eurosat", "RN50")
    assert (eu.cupl, eu.n_views, eu.alpha, eu.beta, eu.reflection_alpha) == (True, 1, 5.0, 8.0, 1.5)
    assert DLAE.default_config("ucf101", "RN50").n_views == 64
    assert DLAE.default_config("ucf101", "RN50").augmix is False
    assert DLAE.default_config("imagenet_a", "RN50").all_view_inference is True
    small = DLAE.default_config("imagenet", "tiny-clip")  # the demo's models use the ViT column
    assert small.backbone_family == "vit" and small.adjust_alpha == 0.8


# ---------------------------------------------------------------------------------------------- zero-shot

def test_zero_shot_formula_uses_model_scale():
    text = make_text(dtype=torch.float32)
    x = make_stream(9, 1, text).float()
    m = ZeroShot(ZeroShot.default_config("imagenet", "RN50"), text, 37.5, backbone="RN50", dataset="imagenet")
    torch.testing.assert_close(m.adapt(x), 37.5 * x[:, 0] @ text.T, rtol=0, atol=LOGIT_TOL32 * 37.5 / 100)


# ---------------------------------------------------------------------------------------------- slow references

def ref_entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.log()).sum()


def ref_summary(x: torch.Tensor, logits: torch.Tensor, p: float = 0.1):
    """Official `get_clip_logits` for one sample: (f, z, H, prob, y)."""
    v = x.shape[0]
    if v == 1:
        z = logits[0]
        prob = z.detach().softmax(-1)
        return x[0], z, ref_entropy(prob), prob, int(z.argmax())
    ents = [float(ref_entropy(row.detach().softmax(-1))) for row in logits]
    idx = sorted(range(v), key=lambda j: ents[j])[:max(1, int(v * p))]
    z = logits[idx].mean(0)
    prob = logits[idx].detach().softmax(-1).mean(0)
    return x[idx].mean(0), z, ref_entropy(prob), prob, int(z.detach().argmax())


def ref_keep_lowest(cache: dict, y: int, item: list, capacity: int) -> None:
    """TDA `update_cache`: append while not full, else replace the last if lower; stable sort by item[1]."""
    items = cache.setdefault(y, [])
    if len(items) < capacity:
        items.append(item)
    elif item[1] < items[-1][1]:
        items[-1] = item
    items.sort(key=lambda it: float(it[1]))


def ref_tda(x_stream, text, scale, cfg):
    pos, neg, outs, log = {}, {}, [], []
    for x in x_stream:
        f, z, h, prob, y = ref_summary(x, scale * x @ text.T, cfg.selection_p)
        log.append((y, float(h), f, prob))
        ref_keep_lowest(pos, y, [f, float(h)], cfg.pos_capacity)
        if cfg.neg_entropy_lower < float(h) / math.log2(K) < cfg.neg_entropy_upper:
            ref_keep_lowest(neg, y, [f, float(h), prob], cfg.neg_capacity)
        out = z.clone()
        for c in sorted(pos):
            for fk, _ in pos[c]:
                out[c] += cfg.alpha * math.exp(-cfg.beta * (1 - float(f @ fk)))
        for c in sorted(neg):
            for fk, _, pk in neg[c]:
                mask = ((pk > cfg.neg_mask_lower) & (pk < cfg.neg_mask_upper)).to(out.dtype)
                out -= cfg.neg_alpha * math.exp(-cfg.neg_beta * (1 - float(f @ fk))) * mask
        outs.append(out)
    return torch.stack(outs), pos, neg, log


def ref_info_nce(q, k, tau):
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    terms = []
    for i in range(q.shape[0]):
        sims = torch.stack([q[i] @ k[j] / tau for j in range(k.shape[0])])
        terms.append(-(sims[i] - torch.logsumexp(sims, 0)))
    return torch.stack(terms).mean()


def ref_dual(x_stream, text, scale, cfg, dlae: bool):
    """DPE / DLAE (docs/methods.md, "DPE: dual prototypes, one step per sample",
    "DLAE: logit adjustment, reflection and doubt") sample by sample, with a real fresh torch AdamW per sample on
    residual parameters created as fp16 (the official `TextResidue`/`PositiveCacheResidue`) or, for
    `residual_step="exact"`, in the stream's dtype. As in the official `run_test_dpe`/`run_test_dlae`, W' is built
    twice from the same residual: before the views are read and again in the step loop for the alignment loss.

    `stats["grads"]` has, per sample, the gradients at the two sums W_g + R_t (entropy and alignment uses) and at
    K + R_i, in the stream's dtype (before autograd casts them to the residuals' dtype), and the residuals' grads."""
    rdt = torch.float16 if cfg.residual_step == "official_fp16" else text.dtype
    w_g, n_avg, cache, outs = text.clone(), 0, {}, []
    counter, count = torch.ones(K, dtype=text.dtype), K
    conf_mean, conf_cnt = torch.zeros(K, dtype=text.dtype), torch.zeros(K, dtype=text.dtype)
    stats = {"reflections": 0, "doubts": 0, "global": 0, "grads": []}
    lr_image = cfg.lr_text if dlae else cfg.lr_image

    def views(x, w):
        logits = scale * x @ w.T
        if not dlae:
            return ref_summary(x, logits, cfg.selection_p), None
        _, _, _, prob2, y2 = ref_summary(x, logits, cfg.selection_p)
        dif = float(prob2[y2] - conf_mean[y2])
        adjusted = logits * torch.exp(-cfg.adjust_alpha * (1 - dif) * counter / count)
        return ref_summary(x, adjusted, cfg.selection_p), y2

    for t, x in enumerate(x_stream):
        r_t = torch.zeros(w_g.shape, dtype=rdt, requires_grad=True)
        sum_entropy = w_g + r_t
        sum_entropy.retain_grad()
        w = F.normalize(sum_entropy, dim=1)
        (f, z0, h, prob, y), y2 = views(x, w)
        if dlae:
            score = float(h)
            if y != y2:
                stats["reflections"] += 1
                wd = w.detach()
                score *= math.exp(-cfg.reflection_alpha * float(wd[y] @ wd[y2] / (wd[y].norm() * wd[y2].norm())))
            counter[y] += 1
            count += 1
            conf_mean[y] = (conf_mean[y] * conf_cnt[y] + prob[y]) / (conf_cnt[y] + 1)
            conf_cnt[y] += 1
            items = cache.setdefault(y, [])
            if len(items) < cfg.shot_capacity:
                items.append([f, score, t])
            else:
                wd = w.detach()
                for it in items:
                    if float(it[0] @ wd[y]) < float(it[0] @ text[y]):
                        stats["doubts"] += 1
                        it[1] *= math.exp((t - it[2]) * cfg.doubt_rate)
                        it[2] = t
                items.sort(key=lambda it: it[1])
                if score < items[-1][1]:
                    items[-1] = [f, score, t]
                    items.sort(key=lambda it: it[1])
        else:
            ref_keep_lowest(cache, y, [f, float(h) / math.log2(K)], cfg.shot_capacity)
        classes = sorted(cache)
        protos = torch.stack([sum(it[0] for it in cache[c]) / len(cache[c]) for c in classes])
        r_i = torch.zeros(protos.shape, dtype=rdt, requires_grad=True)
        sum_cache = protos + r_i
        sum_cache.retain_grad()
        keys = F.normalize(sum_cache, dim=1)
        sum_align = w_g + r_t  # the step loop's `new_clip_weights = text_residue(clip_weights_local)`
        sum_align.retain_grad()
        w_align = F.normalize(sum_align, dim=1)
        z = z0.clone()
        for j, c in enumerate(classes):
            z[c] = z[c] + cfg.alpha * torch.exp(-cfg.beta * (1 - f @ keys[j]))
        loss = ref_entropy(z.softmax(-1)) + cfg.align * ref_info_nce(keys, w_align[classes], cfg.temperature)
        opt = torch.optim.AdamW([{"params": [r_t], "lr": cfg.lr_text}, {"params": [r_i], "lr": lr_image}],
                                eps=cfg.adamw_eps, weight_decay=cfg.weight_decay)
        opt.zero_grad()
        loss.backward()
        stats["grads"].append({"entropy": sum_entropy.grad, "align": sum_align.grad, "cache": sum_cache.grad,
                               "r_t": r_t.grad.clone(), "r_i": r_i.grad.clone()})
        opt.step()
        with torch.no_grad():
            w_new = F.normalize(w_g + r_t, dim=1)
            xin = x if cfg.all_view_inference else x[:1]
            (f_i, z_i, _, _, _), _ = views(xin, w_new)
            keys = F.normalize(protos + r_i, dim=1)
            final = z_i.clone()
            for j, c in enumerate(classes):
                final[c] += cfg.alpha * torch.exp(-cfg.beta * (1 - f_i @ keys[j]))
            if float(ref_entropy(final.softmax(-1))) / math.log2(K) < cfg.global_threshold:
                n_avg += 1
                stats["global"] += 1
                w_g = w_g * (n_avg / (n_avg + 1)) + w_new * (1 / (n_avg + 1))
        outs.append(final)
    state = {"w_g": w_g, "cache": cache, "counter": counter, "count": count, "conf_mean": conf_mean}
    return torch.stack(outs), state, stats


# ---------------------------------------------------------------------------------------------- TDA

@pytest.mark.parametrize("v", [1, 20, 64])
def test_tda_matches_reference(v):
    text = make_text()
    x = make_stream(60, v, text, noise=2.0)
    scale = 12.0 if v < 64 else 4.0  # a low scale puts entropies in the negative-cache band
    m = build(TDA, v, dataset="dtd", scale=scale)
    got = m.adapt(x[:25])
    got = torch.cat([got, m.adapt(x[25:])])
    want, pos, neg, log = ref_tda(x, text, scale, m.config)
    assert sum(len(i) for i in neg.values()) >= 3, "the stream must exercise the negative cache"
    # both sides computed in float64 and rounded to float32: at most one float32 ulp apart
    torch.testing.assert_close(got, want.float(), rtol=torch.finfo(torch.float32).eps, atol=1e-12)
    # Cache contents equal the reference's (class by class, in order).
    for c in range(K):
        ref_pos = torch.stack([f for f, _ in pos.get(c, [])]) if c in pos else torch.zeros(0, D, dtype=x.dtype)
        torch.testing.assert_close(m.pos.keys[c, :m.pos.counts[c]], ref_pos)
        assert m.neg.counts[c] == len(neg.get(c, []))


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_class_cache_matches_keep_lowest_rule_with_ties(capacity):
    """Many tied integer scores: strict `<` replacement and stable order, exactly as the official list code."""
    g = torch.Generator().manual_seed(13)
    cache = ClassCache(3, capacity, 2, device=torch.device("cpu"), dtype=torch.float64)
    ref: dict = {}
    for i in range(60):
        c, score = int(torch.randint(0, 3, (1,), generator=g)), float(torch.randint(0, 4, (1,), generator=g))
        key = torch.tensor([float(i), score], dtype=torch.float64)  # the key records which item it is
        cache.update(c, key, torch.tensor(score, dtype=torch.float64))
        ref_keep_lowest(ref, c, [key, score], capacity)
        want = torch.stack([k for k, _ in ref[c]])
        assert torch.equal(cache.keys[c, :cache.counts[c]], want)
        assert cache.scores[c, :cache.counts[c]].tolist() == [sc for _, sc in ref[c]]


def test_tda_positive_cache_keeps_three_lowest_entropy_per_class():
    """Brute force: among all samples pseudo-labelled c, the cache holds the 3 of lowest entropy, sorted."""
    text = make_text()
    x = make_stream(80, 20, text, seed=3, noise=2.0)
    m = build(TDA, 20, dataset="imagenet_a", scale=20.0)
    m.adapt(x)
    _, _, _, log = ref_tda(x, text, 20.0, m.config)
    for c in range(K):
        ents = sorted(h for y, h, _, _ in log if y == c)[:3]
        got = m.pos.scores[c, :m.pos.counts[c]].tolist()
        assert got == pytest.approx(ents, rel=1e-9)
        assert m.pos.counts[c] == min(3, sum(1 for y, *_ in log if y == c))


def test_tda_negative_cache_gating_and_mask():
    text = make_text()
    x = make_stream(80, 1, text, seed=4, noise=2.0)
    m = build(TDA, 1, dataset="dtd", scale=12.0)
    m.adapt(x)
    _, _, _, log = ref_tda(x, text, 12.0, m.config)
    gated = [(y, h, p) for y, h, _, p in log if 0.2 < h / math.log2(K) < 0.5]
    assert 0 < len(gated) < len(log)
    for c in range(K):
        want = sorted([(h, p) for y, h, p in gated if y == c], key=lambda hp: hp[0])[:2]
        assert m.neg.scores[c, :m.neg.counts[c]].tolist() == pytest.approx([h for h, _ in want], rel=1e-9)
        for j, (_, p) in enumerate(want):
            assert torch.equal(m.neg.extras["mask"][c, j], ((p > 0.03) & (p < 1.0)).to(p.dtype))


def test_tda_cache_logits_formula_by_hand():
    """Two samples, one class: the second output is z0 + α Σ_j exp(-β(1 - f·f_j)) on that class only."""
    text = make_text()
    f1 = F.normalize(text[2] + 0.1 * text[0], dim=0)
    f2 = F.normalize(text[2] + 0.1 * text[1], dim=0)
    x = torch.stack([f1, f2])[:, None, :]
    m = build(TDA, 1, dataset="dtd", scale=100.0)  # confident: the negative cache stays empty
    out = m.adapt(x)
    a, b = m.config.alpha, m.config.beta
    z1 = 100.0 * f1 @ text.T
    z2 = 100.0 * f2 @ text.T
    e1 = z1.clone()
    e1[2] += a  # exp(-β(1 - 1)) = 1 for the sample itself
    e2 = z2.clone()
    e2[2] += a * (1 + math.exp(-b * (1 - float(f1 @ f2))))
    torch.testing.assert_close(out, torch.stack([e1, e2]).float())
    assert len(m.neg) == 0


# ---------------------------------------------------------------------------------------------- DPE

def test_adamw_first_step_equals_torch_adamw():
    g = torch.Generator().manual_seed(5)
    for start in ("zero", "random"):
        p0 = torch.randn(4, 6, generator=g, dtype=torch.float64)
        if start == "zero":
            p0.zero_()
        grad = torch.randn(4, 6, generator=g, dtype=torch.float64) * torch.logspace(-6, 1, 6, dtype=torch.float64)
        p = p0.clone().requires_grad_(True)
        opt = torch.optim.AdamW([p], lr=6e-4, eps=1e-3, weight_decay=0.1)
        p.grad = grad.clone()
        opt.step()
        torch.testing.assert_close(adamw_first_step(p0, grad, 6e-4, 1e-3, 0.1), p.detach(), rtol=1e-9, atol=1e-15)


def test_adamw_first_step_sign_behaviour():
    """From zero: large gradients move by ~lr against their sign, small ones by lr·g/eps."""
    grad = torch.tensor([5.0, -5.0, 1e-6, -1e-6], dtype=torch.float64)
    step = adamw_first_step(torch.zeros(4, dtype=torch.float64), grad, 1e-2, 1e-3, 0.1)
    assert step[0] == pytest.approx(-1e-2, rel=1e-3) and step[1] == pytest.approx(1e-2, rel=1e-3)
    assert step[2] == pytest.approx(-1e-2 * 1e-6 / 1e-3, rel=1e-3)
    assert step[3] == pytest.approx(1e-2 * 1e-6 / 1e-3, rel=1e-3)


def torch_adamw_fp16(init: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """The official step: a fresh torch AdamW (eps 1e-3, weight decay 0.1) on an fp16 parameter."""
    p = torch.nn.Parameter(init.to(torch.float16).clone())
    p.grad = grad.to(torch.float16)
    torch.optim.AdamW([p], lr=lr, eps=1e-3, weight_decay=0.1).step()
    return p.detach()


def test_official_residual_step_is_torch_adamw_on_fp16():
    """`torch_adamw_step` on fp16 residuals equals torch.optim.AdamW on fp16 parameters, bit for bit, over
    gradients from 1e-6 to 10, with one learning rate per group (DPE's text and cache residuals)."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 16, generator=g) * torch.logspace(-6, 1, 16), torch.randn(3, 16, generator=g) * 1e-3]
    zeros = [torch.zeros(5, 16, dtype=torch.float16), torch.zeros(3, 16, dtype=torch.float16)]
    got = torch_adamw_step(zeros, grads, [6e-4, 1e-2], 1e-3, 0.1)
    for z, gr, lr, out in zip(zeros, grads, [6e-4, 1e-2], got):
        assert out.dtype == torch.float16
        torch.testing.assert_close(out, torch_adamw_fp16(z, gr, lr), rtol=0, atol=0)
    # weight decay acts on a non-zero parameter as in torch
    init = torch.randn(4, 4, generator=g).half()
    (out,) = torch_adamw_step([init], [torch.full((4, 4), 0.02)], [0.1], 1e-3, 0.1)
    torch.testing.assert_close(out, torch_adamw_fp16(init, torch.full((4, 4), 0.02), 0.1), rtol=0, atol=0)


@pytest.mark.parametrize("g, official, exact", [
    (1e-3, 1.0, 1e-3 / 2e-3),  # v = 1e-9 underflows in fp16: step lr·g/eps
    (5e-3, 5.0, 5e-3 / 6e-3),  # v = 2.5e-8 below half the smallest fp16 subnormal (2^-25): still 0
    (0.1, 0.1 / 0.101, 0.1 / 0.101),  # v = 1e-5, a normal fp16 number: the exact step up to fp16 rounding
])
def test_fp16_adamw_second_moment_underflow(g, official, exact):
    """Step / lr of the first AdamW step at |g| (issue 10): fp16 state (official DPE/DLAE) vs exact arithmetic."""
    lr = 6e-4
    grad = torch.tensor([g, -g])
    (out,) = torch_adamw_step([torch.zeros(2, dtype=torch.float16)], [grad], [lr], 1e-3, 0.1)
    ref = torch_adamw_fp16(torch.zeros(2), grad, lr)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # fp16 rounding of the moments and of the step: a few fp16 eps of the step
    tol = 4 * torch.finfo(torch.float16).eps
    torch.testing.assert_close(-out.double() / lr, torch.tensor([official, -official], dtype=torch.float64),
                               rtol=tol, atol=0)
    step = adamw_first_step(torch.zeros(2, dtype=torch.float64), torch.tensor([g, -g], dtype=torch.float64), lr,
                            1e-3, 0.1)
    # float64: moments, bias corrections, sqrt, the division and -step / lr, a handful of roundings each side
    torch.testing.assert_close(-step / lr, torch.tensor([exact, -exact], dtype=torch.float64),
                               rtol=16 * torch.finfo(torch.float64).eps, atol=0)


@pytest.mark.parametrize("cls", [DPE, DLAE])
def test_residual_step_default_is_official_and_recorded(cls, monkeypatch):
    import extract.methods.dpe as dpe_module

    cfg = cls.default_config("imagenet", "ViT-B-16")
    assert cfg.residual_step == "official_fp16" and not cfg.amp_fp16
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["residual_step"] == "official_fp16"  # in method_config
    seen = []
    real = dpe_module.torch_adamw_step

    def spy(params, grads, lrs, eps, weight_decay):
        seen.append(([p.dtype for p in params], [gr.dtype for gr in grads], lrs, eps, weight_decay))
        return real(params, grads, lrs, eps, weight_decay)

    monkeypatch.setattr(dpe_module, "torch_adamw_step", spy)
    text = make_text()
    x = make_stream(12, 1, text, seed=3, noise=1.5)
    official = build(cls, 1, lr_text=5e-3, lr_image=5e-3).adapt(x) if cls is DPE else \
        build(cls, 1, lr_text=5e-3).adapt(x)
    assert len(seen) == 12
    assert all(d == ([torch.float16] * 2, [torch.float16] * 2, [5e-3, 5e-3], 1e-3, 0.1) for d in seen)
    exact = build(cls, 1, lr_text=5e-3, residual_step="exact", **({"lr_image": 5e-3} if cls is DPE else {})).adapt(x)
    assert len(seen) == 12  # the exact step does not go through the optimiser
    assert (official - exact).abs().max() > 1e-3


@pytest.mark.parametrize("cls", [DPE, DLAE])
def test_amp_prototypes_become_fp32_after_first_update(cls, monkeypatch):
    """Under CUDA autocast F.normalize returns fp32 (its norm autocasts to fp32), so the official W_g, fp16 at
    first, is fp32 from its first update on. Emulated with CPU bfloat16 autocast and a normalize that follows the
    CUDA rule."""
    emulated = type("Emulated" + cls.__name__, (cls,), {"_amp_device_type": "cpu", "_amp_dtype": torch.bfloat16})
    real = F.normalize
    monkeypatch.setattr(F, "normalize", lambda x, *a, **k: real(x.float() if torch.is_autocast_enabled("cpu") else x,
                                                                   *a, **k))
    text = make_text(dtype=torch.float32)
    x = make_stream(30, 1, text, seed=14, noise=0.5).float()
    cfg = dataclasses.replace(cls.default_config("dtd", "RN50"), n_views=1, amp_fp16=True)
    m = emulated(cfg, text, 100.0, backbone="RN50", dataset="dtd")
    dtypes = []
    for i in range(30):
        m.adapt(x[i:i + 1])
        dtypes.append((m.n_global_updates, m.w_global.dtype))
    assert {d for n, d in dtypes if n == 0} <= {torch.bfloat16}
    assert {d for n, d in dtypes if n > 0} == {torch.float32}, "the stream must evolve the prototypes"


def test_info_nce_one_directional():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(4, D, generator=g, dtype=torch.float64)
    torch.testing.assert_close(info_nce(a, b, 0.01), ref_info_nce(a, b, 0.01))
    assert not torch.allclose(info_nce(a, b, 0.01), info_nce(b, a, 0.01))
    assert float(info_nce(a[:1], b[:1], 0.01)) == 0.0


def test_marginal_entropy_is_entropy_of_mean_softmax():
    g = torch.Generator().manual_seed(7)
    z = 10 * torch.randn(3, 6, K, generator=g, dtype=torch.float64)
    for i in range(3):
        torch.testing.assert_close(marginal_entropy(z[i]), ref_entropy(z[i].softmax(-1).mean(0)))


@pytest.mark.parametrize("residual_step", ["official_fp16", "exact"])
@pytest.mark.parametrize("v,dataset", [(1, "dtd"), (20, "imagenet"), (20, "imagenet_a"), (64, "imagenet_r")])
def test_dpe_matches_reference(v, dataset, residual_step):
    text = make_text()
    x = make_stream(40, v, text, seed=8, noise=2.0)
    # A low scale and cache weight keep some outputs above the evolution threshold; larger steps show the update.
    m = build(DPE, v, dataset=dataset, scale=10.0, alpha=2.0, lr_text=2e-2, lr_image=1e-2,
              residual_step=residual_step)
    got = torch.cat([m.adapt(x[:13]), m.adapt(x[13:])])
    want, state, stats = ref_dual(x, text, 10.0, m.config, dlae=False)
    assert 0 < stats["global"] < len(x), "the stream must exercise the global evolution both ways"
    # float64 on both sides, rounded to float32 (one ulp); 1e-12 absorbs float64 reordering next to zero
    torch.testing.assert_close(got, want.float(), rtol=torch.finfo(torch.float32).eps, atol=1e-12)
    assert m.n_global_updates == stats["global"]
    torch.testing.assert_close(m.w_global, state["w_g"], rtol=1e-9, atol=1e-12)
    # Evolved prototypes are a cumulative average of unit vectors, never re-normalised
    # (docs/methods.md, "DPE: dual prototypes, one step per sample", step 6).
    assert (m.w_global.norm(dim=-1) < 1 - 1e-6).any()


def test_dpe_residual_step_moves_prototypes():
    """With lr 0 nothing adapts except the cache; with lr > 0 the output differs."""
    text = make_text()
    x = make_stream(20, 1, text, seed=9, noise=1.5)
    frozen = build(DPE, 1, lr_text=0.0, lr_image=0.0, global_threshold=-1.0).adapt(x)
    moved = build(DPE, 1, lr_text=5e-2, lr_image=5e-2, global_threshold=-1.0).adapt(x)
    assert not torch.allclose(frozen, moved)
    # First sample: cache = {itself}, so its output is z0 + α exp(-β(1 - f·f̂)) = z0 + α (|f| = 1).
    z0 = 100.0 * x[0, 0] @ text.T
    e = z0.clone()
    e[int(z0.argmax())] += 6.0
    torch.testing.assert_close(frozen[0], e.float())


# ---------------------------------------------------------------------------------------------- DLAE

@pytest.mark.parametrize("residual_step", ["official_fp16", "exact"])
@pytest.mark.parametrize("v,dataset", [(1, "eurosat"), (20, "imagenet"), (20, "imagenet_a")])
def test_dlae_matches_reference(v, dataset, residual_step):
    text = make_text()
    x = make_stream(45, v, text, seed=10, noise=2.0)
    m = build(DLAE, v, dataset=dataset, scale=10.0, alpha=2.0, lr_text=2e-2, adjust_alpha=3.0,
              reflection_alpha=0.7, doubt_rate=0.05, residual_step=residual_step)
    got = torch.cat([m.adapt(x[:1]), m.adapt(x[1:20]), m.adapt(x[20:])])
    want, state, stats = ref_dual(x, text, 10.0, m.config, dlae=True)
    assert stats["reflections"] > 0 and stats["doubts"] > 0, "the stream must exercise reflection and doubt"
    assert stats["global"] > 0 and m.n_global_updates == stats["global"]
    torch.testing.assert_close(got, want.float(), rtol=torch.finfo(torch.float32).eps, atol=1e-12)  # as for DPE
    assert m.counter.tolist() == state["counter"].tolist() and m.count == state["count"] == K + len(x)
    torch.testing.assert_close(m.conf_mean, state["conf_mean"], rtol=1e-9, atol=1e-12)
    for c in range(K):
        want_scores = [it[1] for it in state["cache"].get(c, [])]
        assert sorted(m.cache.scores[c, :m.cache.counts[c]].tolist()) == pytest.approx(sorted(want_scores), rel=1e-9)


def test_dlae_logit_adjustment_by_hand():
    m = build(DLAE, 1, dataset="eurosat", adjust_alpha=2.0)
    m._init_state(torch.device("cpu"), torch.float64)
    m.counter = torch.tensor([1, 4, 2, 1, 2])
    m.count = 10
    m.conf_mean = torch.tensor([0.0, 0.3, 0.9, 0.0, 0.5], dtype=torch.float64)
    x = make_stream(1, 1, m.text_features, seed=11)[0]  # (1, D)
    logits = 100.0 * x @ m.text_features.T  # (1, K)
    raw, adj = m._adjusted_summary(x, logits)
    y2 = int(logits[0].argmax())
    dif = float(logits[0].softmax(-1)[y2]) - float(m.conf_mean[y2])
    pi = torch.tensor([1, 4, 2, 1, 2], dtype=torch.float64) / 10
    want = logits[0] * torch.exp(-2.0 * (1 - dif) * pi)
    assert int(raw.pred[0]) == y2
    torch.testing.assert_close(adj.logits[0], want)
    assert int(adj.pred[0]) == int(want.argmax())


def test_dlae_counters_follow_pseudo_labels():
    text = make_text()
    x = make_stream(30, 1, text, seed=12)
    m = build(DLAE, 1, dataset="eurosat")
    m.adapt(x)
    assert int(m.counter.sum()) == K + 30 and m.count == K + 30
    assert torch.equal(m.counter - 1, m.conf_count.long())
    assert ((m.conf_mean >= 0) & (m.conf_mean <= 1)).all()
    assert m.cache.extras["time"].max() <= 29


# ---------------------------------------------------------------------------------------------- fp16 gradient order

def make_aligned_stream(n: int, v: int, seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(text (K, D), stream (n, v, D)) shaped like CLIP's: class prototypes about 0.8 apart in cosine, image
    features about 0.3 from their class's prototype (the modality gap). InfoNCE at temperature 0.01 is then far
    from saturated, so the alignment term's gradient is of the entropy term's size (on `make_text`'s near-orthogonal
    prototypes it is below 1e-8 and rounds away)."""
    g = torch.Generator().manual_seed(seed)
    common = F.normalize(torch.randn(D, generator=g, dtype=dtype), dim=0)
    text = F.normalize(common + 0.5 * torch.randn(K, D, generator=g, dtype=dtype) / math.sqrt(D), dim=-1)
    gap = 1.5 * F.normalize(torch.randn(D, generator=g, dtype=dtype), dim=0)
    y = torch.randint(0, K, (n,), generator=g)
    noise = torch.randn(n, v, D, generator=g, dtype=dtype) / math.sqrt(D)
    return text, F.normalize(text[y][:, None, :] + gap + noise, dim=-1)


def fp16_edge_distance(g: torch.Tensor) -> torch.Tensor:
    """Distance of each float64 value to the nearest point where its fp16 rounding changes (a midpoint)."""
    h = g.to(torch.float16)
    up = torch.nextafter(h, torch.tensor(math.inf, dtype=torch.float16)).double()
    down = torch.nextafter(h, torch.tensor(-math.inf, dtype=torch.float16)).double()
    return torch.minimum((g - (h.double() + up) / 2).abs(), (g - (h.double() + down) / 2).abs())


@pytest.mark.parametrize("cls,v,dataset", [(DPE, 1, "dtd"), (DPE, 20, "imagenet"), (DLAE, 1, "eurosat"),
                                           (DLAE, 20, "imagenet")])
def test_default_fp16_step_rounds_gradients_as_official(cls, v, dataset, monkeypatch):
    """Issue 22. The official step builds W' = normalize(W_g + R_t) twice (once for the views' logits, once for
    the alignment loss), so its fp16 text residual gets fl16(fl16(g_entropy) + fl16(g_align)); one W' would round
    fl16(g_entropy + g_align). `ref_dual` transcribes the official per-sample update with real `.half()` residuals
    and `torch.optim.AdamW`; the project's default config (lr, align, `residual_step="official_fp16"`) runs on a
    stream where the alignment term is active, and must take the same fp16 steps.

    Tolerance. The fp16 step is a discontinuous function of the gradient: it jumps wherever fp16(g) does, and where
    0.001 g² crosses half the smallest fp16 subnormal (|g| about 5.5e-3) one fp16 ulp of g moves the coordinate by
    4.8 lr. So the codes are compared where the fp16 step is deterministic: in float64, where the transcription and
    the project sum the same terms in different orders, a few eps64 of max|g| per reduction (lengths V, K, D <= 20
    here), and every pre-rounding gradient is checked to lie more than 2^-40 max|g| (4096 eps64 max|g|, about 100
    times that reordering error) from a point where its fp16 rounding changes. Then both feed the same fp16 bits to
    the same optimiser (checked bit for bit), and the rows agree to the float64 -> float32 rounding of the output
    (one float32 eps), as in `test_dpe_matches_reference`. (In float32 the reordering error, ~1e-7 relative, puts a
    few gradient coordinates in ten thousand across an fp16 rounding point, and at the underflow edge one of them
    moves a residual coordinate by 4.8 lr, which no small tolerance covers.)
    """
    import extract.methods.dpe as dpe_module

    text, x = make_aligned_stream(40, v, seed=3)
    cfg = dataclasses.replace(cls.default_config(dataset, "ViT-B-16"), n_views=v)
    assert cfg.residual_step == "official_fp16" and cfg.align > 0 and not cfg.amp_fp16
    sent, real = [], dpe_module.torch_adamw_step

    def spy(params, grads, lrs, eps, weight_decay):
        sent.append([gr.clone() for gr in grads])
        return real(params, grads, lrs, eps, weight_decay)

    monkeypatch.setattr(dpe_module, "torch_adamw_step", spy)
    m = cls(cfg, text, 100.0, backbone="ViT-B-16", dataset=dataset)
    got = torch.cat([m.adapt(x[:17]), m.adapt(x[17:])])
    want, state, stats = ref_dual(x, text, 100.0, cfg, dlae=cls is DLAE)
    split = 0
    for g, (g_text, g_cache) in zip(stats["grads"], sent, strict=True):
        for name in ("entropy", "align", "cache"):
            margin = 2.0 ** -40 * float(g[name].abs().max())
            assert (fp16_edge_distance(g[name]) > margin).all(), f"{name} gradient too close to an fp16 edge"
        # the official order of roundings, as autograd does it for two uses of one fp16 leaf
        official = g["entropy"].to(torch.float16) + g["align"].to(torch.float16)
        assert torch.equal(g["r_t"], official) and torch.equal(g["r_i"], g["cache"].to(torch.float16))
        split += int((official != (g["entropy"] + g["align"]).to(torch.float16)).sum())
        assert torch.equal(g_text, g["r_t"]) and torch.equal(g_cache, g["r_i"])
    assert split > 0, "the stream must separate the two orders of rounding"
    assert 0 < stats["global"] < len(x) and m.n_global_updates == stats["global"]
    torch.testing.assert_close(got, want.float(), rtol=torch.finfo(torch.float32).eps, atol=1e-12)
    torch.testing.assert_close(m.w_global, state["w_g"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", [DPE, DLAE])
@pytest.mark.parametrize("amp", [False, True])
def test_text_residual_gradient_rounded_per_term(cls, amp, monkeypatch):
    """Issue 22, on both code paths: the default (fp32 compute, fp16 residuals) and `amp_fp16` (emulated on the CPU
    with bfloat16 autocast, as `test_amp_code_path_emulated_on_cpu` does). `_step` builds W' once per loss term, so
    the text residual's gradient is the fp16 sum of the two sums' gradients, each cast to fp16 on its own: bit for
    bit what the optimiser gets (an exact claim: the same tensors, cast and added once)."""
    import extract.methods.dpe as dpe_module

    seen, sent = [], []

    def text_prototypes(w_loc, r_text):
        s = w_loc + r_text
        if s.requires_grad:
            s.register_hook(lambda g: seen[-1].append(g))
        return F.normalize(s, dim=-1)

    def spy(params, grads, lrs, eps, weight_decay):
        sent.append(grads[0].clone())
        return real(params, grads, lrs, eps, weight_decay)

    real = dpe_module.torch_adamw_step
    monkeypatch.setattr(dpe_module, "torch_adamw_step", spy)
    changes = {"_text_prototypes": staticmethod(text_prototypes)}
    if amp:
        changes.update(_amp_device_type="cpu", _amp_dtype=torch.bfloat16)
    hooked = type("Hooked" + cls.__name__, (cls,), changes)
    text, x = make_aligned_stream(20, 1, seed=4, dtype=torch.float32)
    cfg = dataclasses.replace(cls.default_config("dtd", "RN50"), n_views=1, amp_fp16=amp)
    m = hooked(cfg, text, 100.0, backbone="RN50", dataset="dtd")
    split = 0
    for i in range(len(x)):
        seen.append([])
        m.adapt(x[i:i + 1])
        assert len(seen[-1]) == 2, "W' must be built once for the entropy term and once for the alignment term"
        g_a, g_b = seen[-1]  # the two terms, in the order the backward reached them
        assert sent[-1].dtype == torch.float16
        assert torch.equal(sent[-1], g_a.to(torch.float16) + g_b.to(torch.float16))
        split += int((sent[-1] != (g_a + g_b).to(torch.float16)).sum())
    assert split > 0, "the stream must separate the two orders of rounding"


# ---------------------------------------------------------------------------------------------- resume, numerics

@pytest.mark.parametrize("key", METHODS)
def test_state_dict_resume_equals_uninterrupted(key, tmp_path, encoder):
    cls = REGISTRY[key]
    x = make_stream(24, 20, make_text(dtype=torch.float32)).float()
    whole = feed(build(cls, 20, dtype=torch.float32, encoder=encoder), x, len(x))
    first = build(cls, 20, dtype=torch.float32, encoder=encoder)
    width = cls.adapt_width(first.config)
    cut = 11 if width is None else 2 * width  # a batch method resumes at a batch boundary (a part's end)
    head = feed(first, x[:cut], cut)
    torch.save(first.state_dict(), tmp_path / "state.pt")
    second = build(cls, 20, dtype=torch.float32, encoder=encoder)
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert second.n_seen == cut
    torch.testing.assert_close(torch.cat([head, feed(second, x[cut:], len(x))]), whole, rtol=0, atol=0)
    other = "tda" if key != "tda" else "dpe"
    with pytest.raises(ValueError, match="cannot be loaded"):
        build(REGISTRY[other], 20, dtype=torch.float32).load_state_dict(first.state_dict())


@pytest.mark.parametrize("cls", [DPE, DLAE])
def test_amp_fp16_needs_cuda(cls):
    m = build(cls, 1, amp_fp16=True)
    with pytest.raises(ValueError, match="amp_fp16"):
        m.adapt(make_stream(2, 1, make_text()))


@pytest.mark.parametrize("key", METHODS)
def test_state_dict_before_any_sample(key, encoder):
    m = build(REGISTRY[key], 1, encoder=encoder)
    fresh = build(REGISTRY[key], 1, encoder=encoder)
    fresh.load_state_dict(m.state_dict())
    x = make_stream(5, 1, make_text())
    want = feed(build(REGISTRY[key], 1, encoder=encoder), x, len(x))
    torch.testing.assert_close(feed(fresh, x, len(x)), want, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [DPE, DLAE])
@pytest.mark.parametrize("v,dataset", [(1, "dtd"), (20, "imagenet_a")])
def test_amp_code_path_emulated_on_cpu(cls, v, dataset):
    """The reduced-precision path (fp16 state under autocast on CUDA) has no dtype mismatches: emulated here with
    CPU bfloat16 autocast; outputs stay finite float32 and mostly agree with fp32 (bf16 is coarser than fp16)."""
    emulated = type("Emulated" + cls.__name__, (cls,), {"_amp_device_type": "cpu", "_amp_dtype": torch.bfloat16})
    text = make_text(dtype=torch.float32)
    x = make_stream(30, v, text, seed=14, noise=2.0).float()
    cfg = dataclasses.replace(cls.default_config(dataset, "RN50"), n_views=v, amp_fp16=True)
    low = emulated(cfg, text, 100.0, backbone="RN50", dataset=dataset).adapt(x)
    ref = cls(dataclasses.replace(cfg, amp_fp16=False), text, 100.0, backbone="RN50", dataset=dataset).adapt(x)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_method_keys_for_help_equal_the_registry():
    from extract.method_keys import METHOD_KEYS

    assert METHOD_KEYS == tuple(REGISTRY)
