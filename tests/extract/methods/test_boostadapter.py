"""BoostAdapter (extract.methods.boostadapter) against a slow transcription of the official loop
(`taolinzhang/BoostAdapter` `runner.py` `run_test_tda` / `update_cache` / `compute_cache_logits`, `utils.py`
`get_clip_logits`), written here with the official dict-of-lists caches, one sample at a time."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F


from extract.methods import REGISTRY
from extract.methods.boostadapter import BOOST_DELTA, BoostAdapter, BoostAdapterConfig
from extract.methods.tda import TDA

K, D = 5, 16
EPS64 = torch.finfo(torch.float64).eps
# Logit scale of the reference tests: low enough that the toy features give graded softmaxes (entropies in TDA's
# negative-cache band, distinct entropies for the sorted caches), as real CLIP cosines do at 100.
SCALE = 10.0

pytestmark = pytest.mark.usefixtures("one_thread")


def make_text(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)


def make_stream(n: int, v: int, text: torch.Tensor, seed: int = 1, noise: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    base = text[y][:, None, :] + noise * torch.randn(n, v, D, generator=g, dtype=text.dtype) / math.sqrt(D)
    return F.normalize(base, dim=-1)


def update_cache(cache, pred, item, capacity, fifo, events):
    if pred in cache:
        cache[pred].append(item)
        if fifo:
            if len(cache[pred]) > capacity:
                cache[pred] = cache[pred][1:]
                events["fifo_evicted"] += 1
        else:
            if len(cache[pred]) > capacity:
                events["truncated"] += 1
            cache[pred] = sorted(cache[pred], key=lambda it: float(it[1]))[:capacity]
    else:
        cache[pred] = [item]


def cache_logits(f, cache, alpha, beta, mask_thresholds=None):
    keys, values = [], []
    for c in sorted(cache):
        for item in cache[c]:
            keys.append(item[0])
            if mask_thresholds:
                values.append(((item[2] > mask_thresholds[0]) & (item[2] < mask_thresholds[1])).to(f.dtype))
            else:
                values.append(F.one_hot(torch.tensor(c), K).to(f.dtype))
    if not keys:
        return torch.zeros(K, dtype=f.dtype)
    affinity = f @ torch.stack(keys).T
    return alpha * (((-1) * (beta - beta * affinity)).exp() @ torch.stack(values))


def softmax_entropy(x):
    return -(x.softmax(-1) * x.log_softmax(-1)).sum(-1)


def avg_entropy(outputs):
    logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
    avg = logits.logsumexp(dim=0) - math.log(logits.shape[0])
    avg = torch.clamp(avg, min=torch.finfo(avg.dtype).min)
    return -(avg * torch.exp(avg)).sum(dim=-1)


def output_entropy(outputs):
    """`get_output_entropy`, the boosted views' scores."""
    logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
    return -(logits * torch.exp(logits)).sum(dim=-1)


def official_boost(stream, text, scale, cfg: BoostAdapterConfig):
    """The official loop on `stream` and `text` in their dtype (float16 for the official numerics: every tensor
    op below then rounds as the official fp16 run does). `argsort` is taken stable (zaec's tie rule; the official
    CUDA argsort leaves ties unspecified)."""
    pos, neg, out = {}, {}, []
    events = {"fifo_evicted": 0, "truncated": 0, "boosted": 0}
    for views in stream:
        logits = scale * views @ text.T  # ori_output, (V, K)
        v = views.shape[0]
        if v > 1 and cfg.summary == "selected":
            idx = torch.argsort(softmax_entropy(logits), stable=True)[:int(v * 0.1)]
            feat, logit = views[idx].mean(0), logits[idx].mean(0)
            loss, prob = avg_entropy(logits[idx]), logits[idx].softmax(-1).mean(0)
        else:  # infer_ori_image, or one view
            feat, logit = views[0], logits[0]
            loss, prob = softmax_entropy(logits[0]), logits[0].softmax(-1)
        pred = int(logit.argmax())
        update_cache(pos, pred, [feat, loss], cfg.pos_capacity, False, events)
        idx = torch.argsort(softmax_entropy(logits), stable=True)[:int(v * 0.1)]  # select_confident_samples
        select_entropy = output_entropy(logits[idx])
        current = copy.deepcopy(pos)
        for i, j in enumerate(idx.tolist()):
            events["boosted"] += 1
            update_cache(current, int(logits[j].argmax()), [views[j], float(select_entropy[i])],
                         cfg.pos_capacity + cfg.delta, False, events)
        h_norm = float(loss / math.log2(K))
        if cfg.neg_entropy_lower < h_norm < cfg.neg_entropy_upper:
            update_cache(neg, pred, [feat, loss, prob], cfg.neg_capacity, True, events)
        final = logit.clone() + cache_logits(feat, current, cfg.alpha, cfg.beta)
        if neg:
            final -= cache_logits(feat, neg, cfg.neg_alpha, cfg.neg_beta, (cfg.neg_mask_lower, cfg.neg_mask_upper))
        out.append(final)
    return torch.stack(out), events


def tol(cfg: BoostAdapterConfig) -> float:
    # a width-D dot product per cache item, summed over at most K·(3 + δ) + K·2 items, each scaled up to alpha
    return 16 * D * EPS64 * (SCALE + cfg.alpha * K * (cfg.pos_capacity + cfg.delta + cfg.neg_capacity))


def build(cfg: BoostAdapterConfig, text: torch.Tensor) -> BoostAdapter:
    return BoostAdapter(cfg, text, SCALE, backbone="ViT-B-16", dataset="dtd")


@pytest.mark.parametrize("dataset,v", [("stanford_cars", 20), ("imagenet_a", 20), ("imagenet_r", 64),
                                       ("imagenet", 1), ("dtd", 64)])
def test_equals_official_loop(dataset, v):
    text = make_text()
    cfg = dataclasses.replace(BoostAdapter.default_config(dataset, "ViT-B-16"), n_views=v)
    # noisier views where the confident views are averaged, so that the summaries' entropies reach the negative band
    x = make_stream(80, v, text, seed=v + len(dataset), noise=3.0 if cfg.summary == "selected" else 1.5)
    want, events = official_boost(x.clone(), text, SCALE, cfg)
    got = build(cfg, text).adapt(x)
    torch.testing.assert_close(got.double(), want, rtol=torch.finfo(torch.float32).eps, atol=tol(cfg))
    assert events["fifo_evicted"] > 0  # the negative cache's FIFO branch is exercised
    if v > 1:
        assert events["boosted"] == 80 * int(v * 0.1) and events["truncated"] > 0


@pytest.mark.parametrize("dataset,v", [("stanford_cars", 64), ("imagenet_a", 64), ("imagenet", 1)])
def test_fp16_default_equals_the_official_float16_loop(dataset, v):
    """Issue 31 item 5: the official code runs float16 throughout; the default (`fp16=True`) equals the official
    loop run on float16 tensors (the same features and prototypes rounded to fp16)."""
    text = make_text(2).float()
    cfg = dataclasses.replace(BoostAdapter.default_config(dataset, "ViT-B-16"), n_views=v)
    assert cfg.fp16
    x = make_stream(80, v, text.double(), seed=3 + v, noise=3.0 if cfg.summary == "selected" else 1.5).float()
    want, events = official_boost(x.half(), text.half(), SCALE, cfg)
    assert want.dtype == torch.float16 and events["fifo_evicted"] > 0
    got = BoostAdapter(cfg, text, SCALE, backbone="ViT-B-16", dataset=dataset).adapt(x)
    # the same float16 operations in the same order: equal but for the order of float accumulation inside the
    # fp16 products and sums (a cache's items are summed per class here, over all items there): 2 fp16 ulps
    torch.testing.assert_close(got, want.float(), rtol=2 * torch.finfo(torch.float16).eps, atol=0)
    f32 = BoostAdapter(dataclasses.replace(cfg, fp16=False), text, SCALE, backbone="ViT-B-16",
                       dataset=dataset).adapt(x)
    assert float((f32 - want.float()).abs().max()) > float((got - want.float()).abs().max())


def test_batched_equals_one_at_a_time_float32():
    text = make_text().float()
    x = make_stream(40, 64, text.double(), seed=4, noise=1.5).float()
    cfg = dataclasses.replace(BoostAdapter.default_config("imagenet_a", "RN50"), fp16=False)
    whole = BoostAdapter(cfg, text, 100.0, backbone="RN50", dataset="imagenet_a").adapt(x)
    for chunk in (1, 7):
        m = BoostAdapter(cfg, text, 100.0, backbone="RN50", dataset="imagenet_a")
        parts = torch.cat([m.adapt(x[i:i + chunk]) for i in range(0, len(x), chunk)])
        # float32 logits of a width-D product at scale 100; cache terms are computed identically per sample
        torch.testing.assert_close(parts, whole, rtol=0, atol=2 * D * torch.finfo(torch.float32).eps * 100.0)


def test_one_view_is_tda_but_for_the_fifo_negative_cache():
    """ImageNet (one view): nothing is boosted. With a negative cache large enough never to evict, BoostAdapter
    and TDA agree exactly; at capacity 2 they part where FIFO keeps a newer, higher-entropy item."""
    text = make_text()
    x = make_stream(60, 1, text, seed=11, noise=1.5)
    cfg = BoostAdapter.default_config("imagenet", "ViT-B-16")
    tda_cfg = TDA.default_config("imagenet", "ViT-B-16")
    big = {"neg_capacity": 60}
    boost = build(dataclasses.replace(cfg, **big), text).adapt(x)
    tda = TDA(dataclasses.replace(tda_cfg, **big), text, SCALE, backbone="ViT-B-16", dataset="imagenet").adapt(x)
    torch.testing.assert_close(boost, tda, rtol=0, atol=0)
    assert not torch.equal(build(cfg, text).adapt(x),
                           TDA(tda_cfg, text, SCALE, backbone="ViT-B-16", dataset="imagenet").adapt(x))


def test_default_config_tables():
    c = BoostAdapter.default_config("imagenet_sketch", "RN50")
    assert (c.alpha, c.beta, c.delta, c.n_views, c.augmix, c.summary, c.prompts) == \
        (2.363, 7.45, 1, 64, False, "selected", "imagenet80")
    c = BoostAdapter.default_config("food101", "ViT-B-16")
    assert (c.alpha, c.beta, c.delta, c.n_views, c.summary, c.prompts) == (1.0, 1.0, 3, 64, "view0", "dataset")
    c = BoostAdapter.default_config("imagenet", "ViT-B-16")
    assert (c.n_views, c.delta) == (1, 0)
    assert (c.pos_capacity, c.neg_capacity, c.neg_alpha, c.neg_beta) == (3, 2, 0.117, 1.0)
    assert set(BOOST_DELTA) == set(REGISTRY["tda"].default_config.__globals__["TDA_ALPHA_BETA"])
