"""R-TPT (extract/methods/rtpt.py) on the tiny open_clip model, against a slow transcription of the official
per-sample loop (R-TPT `rtpt.py`: `test_time_tuning`, `get_top_sim`, `test_time_adapt_eval`) written here from
docs/methods.md, "R-TPT (`rtpt`)".

The `>= 1.0` self-exclusion depends on how each self-similarity rounds. It is tested (1) on hand-built fp32
similarity matrices whose diagonals are exactly 1.0, just below and just above it; (2) end to end on view features
whose every similarity is exact in fp32 (unit vectors with entries ±1/4: sums of multiples of 1/16), so the slow
reference and the method agree on every excluded entry whatever kernel computes them; (3) as a property on random
features: the per-sample products make a sample's weights independent of its batch, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from extract.methods import REGISTRY, get_method
from extract.methods.base import HPARAMS_KEYS, IMAGENET_FAMILY
import extract.methods.rtpt as rtpt_module
from extract.methods.rtpt import RTPT, neighbour_scores, reliability_weights

NAMES = ("cat", "sea_lion", "Annual Crop Land", "dog", "a")
K = len(NAMES)
EPS32 = torch.finfo(torch.float32).eps
# the tiny text tower reduces over width 32: a unit feature may move by ~32 eps between two summation orders
FEAT_TOL = 32 * EPS32

pytestmark = pytest.mark.usefixtures("one_thread")


def zs_text(model) -> torch.Tensor:
    return model.encode_texts([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])


def make(model, dataset: str = "dtd", **changes) -> RTPT:
    cfg = dataclasses.replace(RTPT.default_config(dataset, "ViT-B-16"), **changes)
    return RTPT(cfg, zs_text(model), model.logit_scale, backbone="tiny", dataset=dataset, text_encoder=model,
                class_names=NAMES)


def sign_stream(model, n: int, v: int = 64, seed: int = 0, flip: float = 0.3) -> torch.Tensor:
    """(n, v, 16) unit vectors with entries ±1/4: the signs of a class prototype, each flipped with prob. `flip`.
    Every dot product is a multiple of 1/8, exact in fp32 in any summation order; self-similarities are 1.0."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.sign(zs_text(model))  # (K, 16)
    y = torch.randint(0, K, (n,), generator=g)
    flips = torch.where(torch.rand(n, v, signs.shape[1], generator=g) < flip, -1.0, 1.0)
    return 0.25 * signs[y][:, None] * flips


# ------------------------------------------------------------------------------------------ slow references

def ref_encode(model, ctx: torch.Tensor) -> torch.Tensor:
    """open_clip's encode_text written out, the 4 context token embeddings replaced by `ctx` (R-TPT
    `clip/custom_clip.py` TextEncoder + PromptLearner)."""
    m = model.model
    tokens = model.tokenizer([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])
    x = m.token_embedding(tokens)
    x = torch.cat([x[:, :1], ctx[None].expand(K, -1, -1), x[:, 1 + ctx.shape[0]:]], dim=1)
    x = m.transformer(x + m.positional_embedding, attn_mask=m.attn_mask)
    x = m.ln_final(x)[torch.arange(K), tokens.argmax(-1)] @ m.text_projection
    return x / x.norm(dim=-1, keepdim=True)


def ref_entropy(z: torch.Tensor) -> torch.Tensor:
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)


def ref_top_sim(feats: torch.Tensor, k: int = 20) -> list[float]:
    """`get_top_sim` with Python loops: per view, the mean of the k largest similarities below 1.0, on the features
    as given (the official code normalised them once, before)."""
    f = list(feats)
    out = []
    for i in range(len(f)):
        row = [float((f[i] * f[j]).sum()) for j in range(len(f))]
        kept = sorted((s if s < 1.0 else float("-inf") for s in row), reverse=True)[:k]
        out.append(sum(kept) / k)
    return out


def ref_rtpt(model, feats: torch.Tensor, init: torch.Tensor, scale: float, lr: float = 5e-3,
             steps: int = 1) -> torch.Tensor:
    """One sample the way `rtpt.py` does it: reset, fresh AdamW (weight decay 0.01), the 6 lowest-entropy views of
    step 0, loss = their mean entropy, then the reliability-weighted tuned logits of all views."""
    ctx = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ctx], lr=lr)
    sel = None
    for _ in range(steps):
        logits = scale * feats @ ref_encode(model, ctx).T
        if sel is None:
            ents = [(float(ref_entropy(logits[v].detach())), v) for v in range(len(feats))]
            sel = [v for _, v in sorted(ents)[:int(len(feats) * 0.1)]]
        loss = ref_entropy(logits[sel]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        tuned = scale * feats @ ref_encode(model, ctx).T  # (V, K)
        score = torch.tensor(ref_top_sim(feats))
        w = torch.exp((score - score.max()) / 0.01)
        w = w / w.sum()
        return sum(w[v] * tuned[v] for v in range(len(feats)))


# ------------------------------------------------------------------------------------------ the rule

def test_self_exclusion_rule_on_exact_matrices():
    """S_ij >= 1.0 becomes -inf: a self-similarity of exactly 1.0 (or above) is excluded, one that rounded just
    below 1.0 is kept and counts among the view's own neighbours; an off-diagonal 1.0 (duplicate views) is
    excluded too. `diagonal` excludes exactly the diagonal."""
    g = torch.Generator().manual_seed(0)
    v = 30
    s = torch.rand(v, v, generator=g) * 0.9
    s = (s + s.T) / 2
    below = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    above = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    diag = torch.full((v,), 1.0)
    diag[::3] = below  # views 0, 3, 6, ... count themselves
    diag[1] = above
    s[range(v), range(v)] = diag
    s[4, 5] = s[5, 4] = 1.0  # two identical views
    got = neighbour_scores(s[None], top_k=20)[0]
    for i in range(v):
        row = [float(x) for x in s[i]]
        kept = sorted((x for x in row if x < 1.0), reverse=True)[:20]
        expect = sum(kept) / 20
        # a mean of 20 fp32 values in [0, 1]: 20 eps
        assert abs(float(got[i]) - expect) <= 20 * EPS32, i
        assert (float(below) in kept) == (i % 3 == 0)
    diag_only = neighbour_scores(s[None], top_k=20, self_exclusion="diagonal")[0]
    off = s.clone()
    off[range(v), range(v)] = float("-inf")
    torch.testing.assert_close(diag_only, off.topk(20, -1).values.mean(-1), rtol=0, atol=20 * EPS32)
    assert float(diag_only[4]) > float(got[4])  # the duplicate counts once self-exclusion is only the diagonal


def test_weights_are_per_sample_and_rounding_dependent():
    """Random fp32 unit features: some self-similarities reach 1.0 and some do not (the official rule is a
    coin flip per view); a sample's weights are the same alone and inside a batch, bit for bit."""
    g = torch.Generator().manual_seed(3)
    feats = F.normalize(torch.randn(7, 64, 512, generator=g), dim=-1)
    w = reliability_weights(feats)
    for i in range(7):
        assert torch.equal(reliability_weights(feats[i:i + 1])[0], w[i])
    f = feats / feats.norm(dim=-1, keepdim=True)
    self_dot = torch.stack([torch.diagonal(fi @ fi.T) for fi in f])
    reached = (self_dot >= 1.0).float().mean()
    assert 0.0 < reached < 1.0, float(reached)
    torch.testing.assert_close(w.sum(-1), torch.ones(7), rtol=0, atol=64 * EPS32)
    assert not torch.equal(w, reliability_weights(feats, self_exclusion="diagonal"))


def official_weights(f: torch.Tensor, k: int = 20, temperature: float = 0.01) -> torch.Tensor:
    """`rtpt.py` on one sample's (V, D) features as the official code holds them (normalised once, fp32): S = the
    fp32 product, `S[S >= 1.0] = -inf`, the mean of the k largest per row, softmax(score / temperature)."""
    sim = f @ f.T
    sim[sim >= 1.0] = float("-inf")
    return (sim.topk(k, dim=-1).values.mean(-1) / temperature).softmax(-1)


def clip_like_views(n: int, seed: int) -> torch.Tensor:
    """(n, 64, 512) fp32 view features with CLIP-like cosines (0.6-0.9 between views), normalised once."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 1, 512, generator=g)
    x = base + 0.6 * torch.randn(n, 64, 512, generator=g)
    return x / x.norm(dim=-1, keepdim=True)


def test_weights_from_the_features_normalised_once():
    """Issue 31 item 3: the official code normalises the view features once and its `>= 1.0` test reads those bits;
    a second normalisation changes which self-similarities reach 1.0 and so the weights. On the same fp32 features
    the weights equal the official computation (the same fp32 product per sample: bit-identical S, so the same
    exclusions; the softmax of 64 scores: a few eps)."""
    f = clip_like_views(6, seed=11)
    got = reliability_weights(f)
    want = torch.stack([official_weights(fi) for fi in f])
    torch.testing.assert_close(got, want, rtol=0, atol=64 * EPS32)
    # the second normalisation is a different computation, with a visible effect on these weights
    twice = reliability_weights(f, renormalise=True)
    assert float((twice - want).abs().max()) > 0.1 * float(want.max())


def test_rtpt_view_normalisation_option(tiny_model, monkeypatch):
    """`view_normalisation="twice"` is the earlier computation (re-normalised features); the default reads the
    features as given."""
    with pytest.raises(ValueError, match="view_normalisation: expected one of 'once', 'twice'"):
        make(tiny_model, view_normalisation="thrice")
    x = sign_stream(tiny_model, 3, seed=2)
    x = x / x.norm(dim=-1, keepdim=True)
    calls = []
    real = rtpt_module.reliability_weights

    def spy(feats, *args):
        calls.append(args[-1])
        return real(feats, *args)

    monkeypatch.setattr(rtpt_module, "reliability_weights", spy)
    make(tiny_model).adapt(x)
    make(tiny_model, view_normalisation="twice").adapt(x)
    assert calls == [False, True]


def test_small_view_counts_and_degenerate_rows():
    one = reliability_weights(F.normalize(torch.randn(3, 1, 8), dim=-1))
    assert torch.equal(one, torch.ones(3, 1))
    same = torch.full((1, 5, 16), 0.25)  # five identical views: every entry is 1.0, every score -inf
    assert torch.equal(reliability_weights(same), torch.full((1, 5), 0.2))
    few = F.normalize(torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    w = reliability_weights(few, self_exclusion="diagonal")  # V <= top_k: the mean of the V - 1 others
    f = few / few.norm(dim=-1, keepdim=True)
    for b in range(2):
        s = f[b] @ f[b].T
        score = torch.stack([torch.cat([s[i, :i], s[i, i + 1:]]).mean() for i in range(6)])
        torch.testing.assert_close(w[b], torch.softmax(score / 0.01, -1), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ the method

@pytest.mark.parametrize("shortcuts", [True, False])
def test_rtpt_matches_the_official_loop(tiny_model, shortcuts):
    x = sign_stream(tiny_model, 4, seed=1)
    m = make(tiny_model, text_shortcuts=shortcuts)
    out = m.adapt(x)
    scale = tiny_model.logit_scale
    # each view's logits as TPT's test (a unit feature within FEAT_TOL after a step: (2 + 2) FEAT_TOL · scale),
    # plus the weighted sum over 64 views and the softmax of the weights (64 eps of the largest logit)
    tol = 4 * FEAT_TOL * scale + 64 * EPS32 * scale
    for i in range(4):
        expect = ref_rtpt(tiny_model, x[i], m.prompts.ctx_init, scale)
        torch.testing.assert_close(out[i], expect, rtol=0, atol=tol)


def test_prediction_is_the_weighted_ensemble_not_view_zero(tiny_model):
    """With lr 0 the prediction is the zero-shot ensemble weighted by the view scores: not the original view's
    logits, and not their plain mean."""
    x = sign_stream(tiny_model, 3, seed=2)
    out = make(tiny_model, lr=0.0, weight_decay=0.0).adapt(x)
    text = zs_text(tiny_model)
    scale = tiny_model.logit_scale
    for i in range(3):
        score = torch.tensor(ref_top_sim(x[i]))
        w = torch.softmax(score / 0.01, -1)
        expect = scale * (w[:, None] * (x[i] @ text.T)).sum(0)
        torch.testing.assert_close(out[i], expect, rtol=0, atol=(2 * FEAT_TOL + 64 * EPS32) * scale)
        assert (out[i] - scale * x[i, 0] @ text.T).abs().max() > 1e-2
        assert (out[i] - scale * (x[i] @ text.T).mean(0)).abs().max() > 1e-3


def test_batched_equals_one_at_a_time(tiny_model):
    x = F.normalize(sign_stream(tiny_model, 7, seed=4) + 0.05 * torch.randn(7, 64, 16), dim=-1)
    whole = make(tiny_model).adapt(x)
    one = make(tiny_model, pass_budget=K)  # one sample per tuning pass, the official loop's shape
    # the same weights (per-sample products); the tuned text differs by batch shape only: TPT's tolerance
    torch.testing.assert_close(torch.cat([one.adapt(x[i:i + 1]) for i in range(7)]), whole, rtol=0,
                               atol=4 * FEAT_TOL * tiny_model.logit_scale)


def test_default_configs():
    for ds in HPARAMS_KEYS:
        cfg = get_method("rtpt").default_config(ds, "ViT-B-16")
        assert (cfg.n_views, cfg.lr, cfg.weight_decay, cfg.tta_steps, cfg.selection_p) == (64, 5e-3, 0.01, 1, 0.1)
        assert cfg.augmix == (ds not in IMAGENET_FAMILY) and cfg.amp is False and cfg.episodic
        assert (cfg.top_k, cfg.temperature, cfg.self_exclusion, cfg.ctx_init) == (20, 0.01, "official",
                                                                                  "a photo of a")
    assert REGISTRY["rtpt"] is RTPT and RTPT.unseen_config("RN50").augmix
    with pytest.raises(ValueError, match="self_exclusion"):
        dataclasses.replace(RTPT.default_config("dtd", "RN50"), self_exclusion="none")
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(RTPT.default_config("dtd", "RN50"), temperature=0.0)


def test_autocast_option_emulated_on_cpu(tiny_model, monkeypatch):
    """`amp=true` (TTA-VLM's reading: autocast + loss scale on CUDA) runs without dtype mismatches: emulated with
    CPU bfloat16 autocast; the weights stay fp32, the rows finite float32 and mostly the fp32 argmax."""
    x = F.normalize(sign_stream(tiny_model, 6, seed=6) + 0.05 * torch.randn(6, 64, 16), dim=-1)
    ref = make(tiny_model).adapt(x)
    m = make(tiny_model, amp=True)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    out = m.adapt(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert m.loss_scale == {"scale": 1000.0, "growth_tracker": 6}
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.6
