"""ZERO (extract.methods.zero) against a slow transcription of the official per-sample loop
(`FarinaMatteo/zero @c609f7c`: `ttas/zero.py` `Zero.zero`, `ttas/base.py` `confidence_filter`, `utils/tools.py`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F


from extract.methods.zero import Zero

pytestmark = pytest.mark.usefixtures("one_thread")
K, D = 5, 16
EPS32 = torch.finfo(torch.float32).eps


def ref_zero(x: torch.Tensor, text: torch.Tensor, scale: float, gamma: float, fp16: bool, rule: str):
    """One sample, as the official code runs it: l in fp16 (or fp32), softmaxes in fp32 (autocast), Python ties.

    Returns (log vote fractions as zaec stores them, float64; the official p_bar after the tie bonus)."""
    l = x.float() @ text.float().T  # (V, K)
    if fp16:
        l = l.half()
    temp = torch.tensor(1.0 / scale, dtype=torch.float32)
    p = (l / temp).float().softmax(1)
    ent = -(p * p.log()).sum(1)
    # torch.argsort puts NaN (0 * log 0 of an underflowed probability) last
    full_idx = sorted(range(len(ent)), key=lambda v: math.inf if math.isnan(ent[v]) else float(ent[v]))
    n = max(1, int(len(ent) * gamma))
    l_filt = l[full_idx[:n]]
    eps = torch.finfo(l_filt.dtype).eps
    p_bar = (l_filt / eps).float().softmax(1).sum(0)
    m = float(p_bar.max())
    ties = [c for c in range(K) if float(p_bar[c]) == m]
    if len(ties) > 1:
        winner = None
        for v in full_idx[n:]:
            pred = int(l[v].argmax())
            if pred in ties:
                winner = pred
                break
        if winner is None:
            logit = l[full_idx[n]].clone()
            blank = [-t - 1 for t in ties] if rule == "official" else [c for c in range(K) if c not in ties]
            for c in blank:
                logit[c] = -math.inf
            winner = int(logit.argmax())
        p_bar[winner] += 1
    total = float(p_bar.sum())
    out = []
    for c in range(K):
        if float(p_bar[c]) > 0:
            out.append(math.log(float(p_bar[c])) - math.log(total))
        else:  # the exact log of the underflowed sum
            terms = [float(z[c] - torch.logsumexp(z, 0)) for z in (l_filt.double() / eps)]
            out.append(float(torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0)) - math.log(total))
    return torch.tensor(out, dtype=torch.float64), p_bar


def make_text(seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)


def make_views(n, v, text, seed=1, noise=1.5):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    return F.normalize(text[y][:, None] + noise * torch.randn(n, v, D, generator=g, dtype=text.dtype) / D ** 0.5, dim=-1)


def build(v, scale=100.0, text=None, **changes):
    cfg = dataclasses.replace(Zero.default_config("imagenet", "ViT-B-16"), n_views=v, **changes)
    return Zero(cfg, make_text() if text is None else text, scale, backbone="ViT-B-16", dataset="imagenet")


def test_defaults():
    c = Zero.default_config("dtd", "RN50")
    assert (c.n_views, c.augmix, c.prompts, c.selection_p, c.logits_fp16, c.episodic) == (64, False, "single", 0.3,
                                                                                           True, True)
    assert Zero.default_config("imagenet_a", "ViT-B-16") == c and Zero.output_kind == "log_probs"


@pytest.mark.parametrize("fp16", [True, False])
@pytest.mark.parametrize("v,scale", [(64, 100.0), (20, 30.0)])
def test_matches_official_loop(v, scale, fp16):
    text = make_text()
    x = make_views(12, v, text)
    m = build(v, scale, logits_fp16=fp16)
    got = m.adapt(x)
    # float32 softmax sums over n kept views of K classes on the official side: a few eps x (n + K), relative
    tol = 4 * (int(v * 0.3) + K) * EPS32
    for i in range(len(x)):
        want, p_bar = ref_zero(x[i], text, scale, 0.3, fp16, "official")
        torch.testing.assert_close(got[i].double(), want, rtol=tol, atol=tol)
        assert int(got[i].argmax()) == int(p_bar.argmax())
    assert torch.isfinite(got).all()


def test_soft_vote_under_fp16_hard_vote_in_fp32():
    """eps = 2^-10 on cosines leaves near-tied views a split vote; the fp32 eps (2^-23) makes it one-hot."""
    text = torch.eye(K, D, dtype=torch.float64)
    x = F.normalize(text[0] + (1 - 2e-3) * text[1], dim=0).expand(1, 64, D).clone()  # cos gap 1.4e-3 ~ 1.4 eps16
    soft = build(64, text=text).adapt(x)[0].exp()
    hard = build(64, text=text, logits_fp16=False).adapt(x)[0].exp()
    assert 0.05 < float(soft[1]) < float(soft[0]) < 0.95
    assert float(hard[0]) == pytest.approx(1.0, abs=1e-6) and float(hard[1]) < 1e-6


def tie_sample(rest_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """14 views (4 kept at gamma 0.3): two confident votes each for classes 0 and 1, the rest less confident
    views of `rest_class`, themselves ordered by confidence."""
    text = torch.eye(K, D, dtype=torch.float64)
    views = [text[0] + 0.01 * text[4], text[0] + 0.02 * text[4], text[1] + 0.01 * text[4], text[1] + 0.02 * text[4]]
    for j in range(10):
        views.append(text[rest_class] + (0.6 + 0.02 * j) * text[2 if rest_class != 2 else 4] + 0.5 * text[0])
    return text, F.normalize(torch.stack(views), dim=-1)[None]


@pytest.mark.parametrize("rule", ["official", "fixed"])
@pytest.mark.parametrize("rest_class", [1, 3])
def test_tie_breaking(rest_class, rule):
    text, x = tie_sample(rest_class)
    got = build(14, text=text, tie_break=rule).adapt(x)[0]
    want, p_bar = ref_zero(x[0], text, 100.0, 0.3, True, rule)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    votes = got.exp() * 5  # 4 kept votes + the bonus
    if rest_class == 1:  # a remaining view votes for tied class 1: it wins
        torch.testing.assert_close(votes[:2], torch.tensor([2.0, 3.0]), rtol=1e-5, atol=1e-5)
    elif rule == "official":
        # nobody votes 0 or 1: the fallback blanks classes K-1-0 = 4 and K-1-1 = 3 (the view's favourite) instead
        # of the non-tied ones, so the bonus goes to class 2, outside the tie
        torch.testing.assert_close(votes, torch.tensor([2.0, 2.0, 1.0, 0.0, 0.0]), rtol=1e-5, atol=1e-5)
    else:  # fixed: the first remaining view's best tied class (class 0 by its 0.5 e_0 component)
        torch.testing.assert_close(votes[:2], torch.tensor([3.0, 2.0]), rtol=1e-5, atol=1e-5)


def test_batched_equals_one_at_a_time():
    text = make_text()
    x = make_views(9, 64, text, seed=3).float()
    m = build(64, text=text.float())
    whole = m.adapt(x)
    single = torch.cat([build(64, text=text.float()).adapt(x[i:i + 1]) for i in range(len(x))])
    # per-sample independent; the batched matmul may sum in another order: a few eps x D on cosines, x 1/eps16
    torch.testing.assert_close(whole, single, rtol=0, atol=4 * D * EPS32 * 1024)
    assert torch.equal(whole.argmax(-1), single.argmax(-1))
