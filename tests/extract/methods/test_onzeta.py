"""OnZeta (extract.methods.onzeta) against a slow transcription of the official online loop
(`idstcv/OnZeta @befef06`, `main_online.py` l.249-273)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F


from extract.methods.onzeta import OnZeta

pytestmark = pytest.mark.usefixtures("one_thread")
K, D = 5, 16
EPS32 = torch.finfo(torch.float32).eps


def ref_onzeta(feats: torch.Tensor, text: torch.Tensor, n: int, tau_t=0.01, tau_i=0.04, cw=0.5, cr=20.0, alpha=1.0,
               beta0=0.8):
    """The official loop over a stream of (N, D) features in the given order: (combo, tlabel, w, rho)."""
    text_classifier = text.t()  # (D, K)
    w = text_classifier.clone()
    rho = torch.zeros(K, dtype=text.dtype)
    combo_label, text_label = [], []
    ref_onzeta.clipped = 0
    for i in range(len(feats)):
        lr = cw / math.sqrt(i + 1)
        rlr = cr / math.sqrt(i + 1)
        beta = beta0 * math.sqrt((i + 1) / n)
        x = feats[i]
        tlabel = F.softmax(x @ text_classifier / tau_t, dim=0)
        tlabel = tlabel * torch.exp(rho)
        tlabel /= torch.sum(tlabel)
        rho -= rlr * (tlabel - alpha / K)
        ref_onzeta.clipped += int((rho < 0).sum())
        rho[rho < 0] = 0
        text_label.append(tlabel)
        vision_label = F.softmax(x @ w / tau_i, dim=0)
        combo_label.append(beta * vision_label + (1 - beta) * tlabel)
        grad = torch.outer(x, vision_label - tlabel)
        w -= (lr / tau_i) * grad
        w = F.normalize(w, dim=0)
    return torch.stack(combo_label), torch.stack(text_label), w, rho


def make_text(seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)


def make_stream(n, text, seed=1, noise=1.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    return F.normalize(text[y] + noise * torch.randn(n, D, generator=g, dtype=text.dtype) / D ** 0.5, dim=-1)[:, None]


def build(text, **changes):
    cfg = dataclasses.replace(OnZeta.default_config("imagenet", "ViT-B-16"), **changes)
    return OnZeta(cfg, text, 100.0, backbone="ViT-B-16", dataset="imagenet")


def test_defaults():
    c = OnZeta.default_config("dtd", "RN50")
    assert (c.tau_t, c.tau_i, c.cw, c.cr, c.alpha, c.beta, c.n_views, c.prompts) == (
        0.01, 0.04, 0.5, 20.0, 1.0, 0.8, 1, "dataset")
    assert OnZeta.output_kind == "log_probs" and OnZeta.unseen_config("RN50").prompts == "imagenet80"


@pytest.mark.parametrize("output", ["onzeta", "onlab"])
@pytest.mark.parametrize("announce", [True, False])
def test_matches_official_loop(output, announce):
    text = make_text()
    x = make_stream(40, text, noise=0.6)  # cosines gaps up to ~1: q underflows nowhere in float64
    m = build(text, output=output, **({} if announce else {"stream_length": 40}))
    if announce:
        m.set_stream_length(40)
    assert m.warnings == []
    got = torch.cat([m.adapt(x[:7]), m.adapt(x[7:8]), m.adapt(x[8:])])
    combo, tlabel, w, rho = ref_onzeta(x[:, 0], text, 40)
    want = (combo if output == "onzeta" else tlabel).log()
    # float64 on both sides, rounded to float32 (one ulp of the log-probability; 1e-9 near log 1 = 0)
    torch.testing.assert_close(got.double(), want, rtol=2 * EPS32, atol=1e-9)
    torch.testing.assert_close(m.w, w, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(m.rho, rho, rtol=1e-9, atol=1e-9)
    assert ref_onzeta.clipped > 0 and (rho > 0).any(), "the stream must exercise the clipping of the dual"
    assert m.summary() == {"stream_length": 40}


def test_underflow_keeps_finite_log_probs():
    """float32 with wide cosine gaps: OnLab's q (τ_t = 0.01) underflows; the stored row is the exact log, finite."""
    text = make_text().float()
    x = make_stream(12, text.double(), noise=0.1).float()
    got = build(text, stream_length=12, output="onlab").adapt(x)
    _, tlabel, _, _ = ref_onzeta(x[:, 0], text, 12)
    assert (tlabel == 0).any(), "the stream must make float32 probabilities underflow"
    assert torch.isfinite(got).all()
    pos = tlabel > 0
    # float32 on both sides: D-term dot products / τ_t and K-term sums, a few eps x (D + K) x the largest |score|
    tol = 8 * (D + K) * EPS32 / 0.01
    torch.testing.assert_close(got[pos], tlabel[pos].log(), rtol=tol, atol=tol)
    assert (got[~pos] < math.log(torch.finfo(torch.float32).tiny)).all()
    assert torch.equal(got.argmax(-1), tlabel.argmax(-1))


def test_unknown_length_warns_and_uses_constant_beta():
    text = make_text()
    x = make_stream(6, text)
    m = build(text)
    assert any("stream length unknown" for w in m.warnings)
    got = m.adapt(x)
    # beta_i = beta: the official formula with n = i + 1 at every step, i.e. with this stream replayed per prefix
    for i in range(6):
        combo, _, _, _ = ref_onzeta(x[:i + 1, 0], text, i + 1)
        torch.testing.assert_close(got[i].double(), combo[-1].log(), rtol=2 * EPS32, atol=1e-9)
    assert m.summary() == {"stream_length": None}


def test_stream_longer_than_announced_is_an_error():
    text = make_text()
    m = build(text, stream_length=3)
    with pytest.raises(ValueError, match="announced as 3 long"):
        m.adapt(make_stream(4, text))
