"""MTA (extract.methods.mta) against a slow transcription of the official `solve_mta` (`MaxZanella/MTA @cafafdf`,
`mta.py`), one sample at a time."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F


from extract.methods.mta import MTA

pytestmark = pytest.mark.usefixtures("one_thread")
K, D = 5, 16
EPS32 = torch.finfo(torch.float32).eps


def ref_mta(x: torch.Tensor, text: torch.Tensor, scale: float, lambda_y=0.2, lambda_q=4.0):
    """`solve_mta` for one sample's (V, D) features, loops as written."""
    logits = x @ text.t() * scale
    dist = torch.cdist(x, x)
    sorted_dist, _ = torch.sort(dist, dim=1)
    k = int(0.3 * (x.shape[0] - 1))
    bandwidth = torch.sqrt(0.5 * torch.mean(sorted_dist[:, 1:k + 1] ** 2, dim=1))
    affinity = logits.softmax(1) @ logits.softmax(1).t()
    y = torch.ones(x.shape[0], dtype=x.dtype) / x.shape[0]
    mode = x[0]

    def kernel(mu):
        return torch.exp(-torch.norm(x - mu, dim=-1) ** 2 / (2 * bandwidth ** 2))

    stats = {"y_steps": [], "mode_steps": []}
    for _ in range(5):
        density = kernel(mode)
        for i in range(1, 6):
            old_y = y
            y = F.softmax(1 / lambda_y * (density + lambda_q * torch.sum(affinity * y.unsqueeze(0), dim=1)), dim=-1)
            if torch.norm(old_y - y) < 1e-6:
                break
        stats["y_steps"].append(i)
        for i in range(1, 6):
            old_mode = mode
            w = kernel(mode) * y
            mode = torch.sum(w.unsqueeze(1) * x, dim=0) / torch.sum(w)
            mode = mode / mode.norm(p=2, dim=-1)
            if torch.norm(old_mode - mode) < 1e-6:
                break
        stats["mode_steps"].append(i)
    return mode @ text.t() * scale, stats


def make_text(seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)


def make_views(n, v, text, seed=1, noise=1.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    return F.normalize(text[y][:, None] + noise * torch.randn(n, v, D, generator=g, dtype=text.dtype) / D ** 0.5, dim=-1)


def build(v, scale=100.0, text=None, **changes):
    cfg = dataclasses.replace(MTA.default_config("dtd", "ViT-B-16"), n_views=v, **changes)
    return MTA(cfg, make_text() if text is None else text, scale, backbone="ViT-B-16", dataset="dtd")


def test_defaults():
    c = MTA.default_config("imagenet", "RN50")
    assert (c.n_views, c.augmix, c.prompts, c.lambda_y, c.lambda_q, c.max_iter, c.episodic) == (
        64, False, "single", 0.2, 4.0, 5, True)
    assert MTA.default_config("eurosat", "ViT-B-16") == c and MTA.output_kind == "logits"


@pytest.mark.parametrize("v,scale,noise", [(64, 100.0, 1.0), (20, 30.0, 2.0), (64, 10.0, 0.3)])
def test_matches_official_loop(v, scale, noise):
    text = make_text()
    x = make_views(10, v, text, noise=noise)
    m = build(v, scale)
    got = torch.cat([m.adapt(x[:3]), m.adapt(x[3:])])
    steps = set()
    for i in range(len(x)):
        want, stats = ref_mta(x[i], text, scale)
        steps.update(stats["y_steps"] + stats["mode_steps"])
        # float64 on both sides, rounded to float32 at the end: one float32 ulp (plus float64 noise near zero)
        torch.testing.assert_close(got[i].double(), want, rtol=2 * EPS32, atol=1e-9 * scale)
    assert steps & {1, 2, 3, 4} and 5 in steps, "the stream must exercise early stopping and the cap"


def test_batched_equals_one_at_a_time_float32():
    text = make_text().float()
    x = make_views(8, 64, text.double()).float()
    whole = build(64, text=text).adapt(x)
    single = torch.cat([build(64, text=text).adapt(x[i:i + 1]) for i in range(len(x))])
    # fp32 reductions over V = 64 views and D dims in another order, through 50 steps: a few eps x V x scale
    torch.testing.assert_close(whole, single, rtol=0, atol=8 * 64 * EPS32 * 100.0)


def test_one_view_is_zero_shot():
    text = make_text()
    x = make_views(4, 1, text)
    torch.testing.assert_close(build(1).adapt(x), (100.0 * x[:, 0] @ text.T).float())


def test_mode_moves_towards_inliers():
    """View 0 an outlier, 63 views around class 2: the mode leaves view 0 and predicts class 2."""
    text = make_text()
    x = make_views(1, 64, text, noise=0.2)
    x[0, 1:] = F.normalize(text[2] + 0.2 * torch.randn(63, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4)), dim=-1)
    x[0, 0] = text[4]
    out = build(64).adapt(x)
    assert int(out.argmax()) == 2
