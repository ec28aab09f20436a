"""ZERO (extract.methods.zero) against a slow transcription of the official per-sample loop
(`FarinaMatteo/zero @c609f7c`: `ttas/zero.py` `Zero.zero`, `ttas/base.py` `confidence_filter`, `utils/tools.py`)."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F

from calibrate.functional.softmax import adapted_stats
from calibrate.run import calibrate_paths
from extract.methods.zero import Zero, log_vote_fractions
from schemas.shard import write_shard

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
    if fp16:
        # `l / self.model.temp` as CUDA runs it: the fp32 0-dim temperature cast to float16 (the operand's dtype),
        # the quotient of the two float16 values in float32, rounded to float16
        t16 = temp.half()
        p = (l.float() / t16.float()).half().float().softmax(1)
    else:
        p = (l / temp).softmax(1)
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


def test_temperature_rounded_to_float16_as_on_cuda():
    """`l / self.model.temp` on CUDA divides by the fp16-rounded temperature (0.01 -> 0.010002136, a logit scale of
    99.979): the views kept, and so the votes, follow it (issue 31 item 2). Many samples, so that some row's kept
    set differs between the two temperatures; every row equals the explicit float16 transcription."""
    text = make_text(2)
    x = make_views(200, 64, text, seed=5, noise=2.0)
    got = build(64, text=text).adapt(x)
    tol = 4 * (int(64 * 0.3) + K) * EPS32
    for i in range(len(x)):
        want, p_bar = ref_zero(x[i], text, 100.0, 0.3, True, "official")
        torch.testing.assert_close(got[i].double(), want, rtol=tol, atol=tol)
        assert int(got[i].argmax()) == int(p_bar.argmax())


def test_stored_argmax_is_the_official_prediction_where_float32_logs_collapse():
    """Votes one float32 step apart (13 and its predecessor; 7 and 6.9999995) whose float32 logs round to the same
    value: the official winner (the larger vote) stays the stored argmax, wherever it sits."""
    below13 = float(torch.nextafter(torch.tensor(13.0), torch.tensor(0.0)))
    rows = torch.tensor([[below13, 13.0, 4.0, 2.0, 0.0], [13.0, below13, 4.0, 2.0, 0.0],
                         [1.0, 6.9999995, 7.0, 4.0, 1.0], [17.0, below13 + 4.0, 0.0, 0.0, 0.0]])
    assert torch.tensor(below13).log() == torch.tensor(13.0).log()  # the collapse: one float32 log for both
    out = log_vote_fractions(rows, torch.full_like(rows, -200.0))
    assert out.dtype == torch.float32
    assert out.argmax(-1).tolist() == rows.argmax(-1).tolist()
    for r in range(len(rows)):  # the winner is strictly above every other class
        assert int((out[r] == out[r].max()).sum()) == 1
    # elsewhere the fractions are the float64 ones rounded once
    want = (rows.double() / rows.double().sum(-1, keepdim=True)).log().float()
    nonzero = rows > 0
    assert int((out != want)[nonzero].sum()) <= 2  # only the two collapsed losers moved, one step each
    # a zero vote takes the exact log of the unrounded sum, less the log of the total
    assert float(out[0, 4]) == pytest.approx(-200.0 - math.log(float(rows[0].double().sum())), rel=1e-7)


def test_stored_argmax_through_the_method_where_the_logs_collapse():
    """The collapse through ZERO itself: 13 views vote for class 1, 12 for class 0 plus one view whose soft vote
    gives class 0 all but ~5e-7, so class 0 sums to the float32 just below 13 (no tie: the official prediction is
    class 1); the float32 logs of the two votes are equal, and the old stored row handed the argmax to class 0."""
    text = torch.eye(K, D, dtype=torch.float32)
    split = torch.zeros(D)
    split[0], split[2] = 0.6, 0.6 - 24 * 2 ** -11
    views = [text[1]] * 13 + [text[0]] * 12 + [split] + [text[3]] * 4 + [torch.ones(D)] * 70
    x = torch.stack(views)
    x = (x / x.norm(dim=-1, keepdim=True))[None]
    _, p_bar = ref_zero(x[0], text, 100.0, 0.3, True, "official")
    assert float(p_bar[1]) == 13.0 and float(p_bar[0]) == float(torch.nextafter(torch.tensor(13.0),
                                                                                  torch.tensor(0.0)))
    got = build(100, text=text).adapt(x)[0]
    assert int(got.argmax()) == 1 and float(got[1]) > float(got[0])

def _exact_aurc(conf: list, correct: list[bool]) -> Fraction:
    """AURC with exact ties: the mean over coverages k/N of the expected error rate of the k most confident
    samples, a tied group entered in a uniformly random order (so its j first members hold j/n of its errors)."""
    total, errs, pos = Fraction(0), 0, 0
    for score in sorted(set(conf), reverse=True):
        group = [c for c, s in zip(correct, conf) if s == score]
        e = sum(not c for c in group)
        for j in range(1, len(group) + 1):
            total += (errs + Fraction(e * j, len(group))) / (pos + j)
        errs, pos = errs + e, pos + len(group)
    return total / len(conf)


def test_vote_ties_reach_the_tie_exact_metrics(tmp_path, make_meta):
    """Issue 32 item 3: ZERO's vote fractions (j/19, (j+1)/20 after a tie bonus) are equal in many rows; through a
    float32 shard and zaec-calibrate, the AURC equals the one computed on the exact fractions (Fractions of the
    official float32 votes, ties by expectation), and the run has as many distinct confidences as the method."""
    text = make_text(4)
    n = 240
    x = make_views(n, 64, text, seed=7, noise=3.0)
    y = torch.randint(0, K, (n,), generator=torch.Generator().manual_seed(8)).numpy()
    lp = build(64, text=text).adapt(x).float().numpy()
    conf, correct = [], []
    for i in range(n):
        _, p_bar = ref_zero(x[i], text, 100.0, 0.3, True, "official")
        v = [Fraction(float(t)) for t in p_bar]
        conf.append(max(v) / sum(v))
        correct.append(int(p_bar.argmax()) == int(y[i]))
    assert len(set(conf)) < n // 4  # the test needs ties
    meta = make_meta(method="zero", k=K, extra={"zaec:output_kind": "log_probs"})
    zs = (100.0 * x[:, 0] @ text.T).float().numpy()
    write_shard(tmp_path / "z" / "part-00000.parquet", meta, np.arange(n), y, zs, lp)
    r = calibrate_paths([tmp_path / "z"], calibrators="none")
    row = r.metrics.filter(pl.col("calibrator") == "none")
    assert float(row["aurc_msp"][0]) == pytest.approx(float(_exact_aurc(conf, correct)), rel=1e-12, abs=1e-15)
    s = adapted_stats(lp, np.ones(n), y, "log_probs")
    assert len(np.unique(s.confidence)) == len(set(conf))
