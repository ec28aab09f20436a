"""TransCLIP (extract.methods.transclip) against a slow transcription of the official zero-shot solver
(`MaxZanella/transduction-for-vlms @6a9e8f3`, `TransCLIP_solver/TransCLIP.py` and `TransCLIP_utils.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from extract.methods.transclip import TransCLIP, TransCLIPConfig
from tests.support.transductive import K, assert_float32_matches, make_set, make_text, ref_affinity
from tests.support.transductive import solve as solve_with

pytestmark = pytest.mark.usefixtures("one_thread")
EPS64 = torch.finfo(torch.float64).eps


def ref_transclip(x: torch.Tensor, text: torch.Tensor, scale: float = 100.0, max_iter: int = 10,
                  n_neighbors: int = 3) -> torch.Tensor:
    """The official zero-shot solve on (N, D) features, line by line: returns z (N, K)."""
    n, d = x.shape
    clip_prototypes = text.T  # (D, K), one template
    y_hat = scale * x @ clip_prototypes  # `prepare_objects`
    y_hat, z = F.softmax(y_hat, dim=1), F.softmax(y_hat, dim=1)  # `init_z`
    kk = text.shape[0]
    mu = torch.zeros(kk, 1, d, dtype=x.dtype)  # `init_mu`, zero-shot
    _, topk_indices = torch.topk(z, k=8, dim=0)
    mask = torch.zeros_like(z).scatter_(0, topk_indices, 1)
    filtered_z = z * mask
    for c in range(kk):
        class_indices = mask[:, c].nonzero().squeeze(1)
        combined = x[class_indices] * filtered_z[class_indices, c].unsqueeze(1)
        mu[c, 0, :] = combined[:8].mean(dim=0)
    mu /= mu.norm(dim=-1, keepdim=True)
    std = torch.eye(d, dtype=x.dtype).diag() * (1 / d)  # `init_sigma`
    w = ref_affinity(x, n_neighbors)  # `build_affinity_matrix`: the dense N x N matrix
    for k in range(max_iter + 1):
        lik = -0.5 * torch.einsum("ijk,ijk->ij", (x[:, None, :] - mu[None, :, 0, :]) ** 2, 1 / std[None, None, :])
        for _ in range(5):  # `update_z`
            inter = lik.clone()
            inter += (50 / (n_neighbors * 2)) * (w.T @ z + (w @ z))
            inter -= torch.max(inter, dim=1, keepdim=True)[0]
            inter = (y_hat ** 1) * torch.exp(1 / 50 * inter)
            z = inter / torch.sum(inter, dim=1, keepdim=True)
        if k == max_iter:
            break
        weights = (1 / n) * z  # `update_mu`
        new_mu = torch.einsum("ij,ik->jk", weights, x)
        new_mu /= (1 / n * torch.sum(z, dim=0).unsqueeze(-1))
        new_mu = new_mu.unsqueeze(1)
        mu = new_mu / new_mu.norm(dim=-1, keepdim=True)
        std = (1 / n) * torch.einsum("ij,ijk->k", z, (x[:, None, :] - mu[None, :, 0, :]) ** 2)  # `update_sigma`
        std /= (1 / n * torch.sum(z))
    return z


def solve(x: torch.Tensor, text: torch.Tensor, **changes) -> torch.Tensor:
    return solve_with(TransCLIP, x, text, **changes)[0]


def test_defaults():
    c = TransCLIP.default_config("imagenet", "RN50")
    assert c == TransCLIP.default_config("dtd", "ViT-B-16") == TransCLIPConfig()
    assert (c.unit, c.max_iter, c.z_iters, c.n_neighbors, c.lambda_value, c.n_most_confident, c.temperature) == (
        0, 10, 5, 3, 1.0, 8, 50.0)
    assert (c.n_views, c.prompts, c.cupl) == (1, "transclip", False)
    assert TransCLIP.output_kind == "log_probs" and TransCLIP.consumes == "set_features"
    assert TransCLIP.unseen_config("RN50").prompts == "single"


@pytest.mark.parametrize("n", [12, 40])
def test_matches_official_solver_in_float64(n):
    """The official solve's arithmetic in float64. The Gaussian sums expanded as matrix products and the
    per-sample constant left out move each exponent (log-likelihood terms up to ~10² here) by a few eps64 of it;
    log z (no entry underflows in float64 here) then agrees within 10⁴ eps64."""
    text = make_text()
    x = make_set(n, text)
    want = ref_transclip(x[:, 0], text)
    got = solve(x, text)
    assert got.dtype == torch.float64 and (want > 0).all()
    torch.testing.assert_close(got, want.log(), rtol=0, atol=1e4 * EPS64)


def test_float32_matches_float64_reference():
    assert_float32_matches(TransCLIP, ref_transclip)


def test_underflowed_probabilities_stay_finite_and_ordered():
    """Well-separated classes at a large logit scale: the official z holds exact zeros in float32; the stored log
    is the log-space value there (finite, below the log of the smallest float32)."""
    text = make_text(dtype=torch.float32)
    x = make_set(40, text, noise=0.2)
    out = solve_with(TransCLIP, x, text, scale=1000.0)[0]
    assert torch.isfinite(out).all() and (out.exp() == 0).any() and (out < -103.3).any()
    torch.testing.assert_close(out.double().exp().sum(1), torch.ones(40, dtype=torch.float64), rtol=0, atol=1e-5)


def test_small_units_solve_with_what_they_have():
    """Fewer samples than the official 8 pseudo-labels per class or 3 + 1 neighbours (the official code fails):
    every sample serves, and each row still sums to one."""
    text = make_text()
    x = make_set(3, text)
    got = solve(x, text)
    assert torch.isfinite(got).all() and torch.allclose(got.exp().sum(1), torch.ones(3, dtype=torch.float64))
    one = solve(x[:1], text)
    assert torch.isfinite(one).all()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_small_float32_units_stay_finite(n):
    """In float32 (the run's) a small unit leaves classes whose z underflow to 0 in every sample, at the start or
    after a refit: the official mean of them (0/0) is NaN in every row; here such a class keeps its mean, or starts
    at its text prototype."""
    text = make_text(dtype=torch.float32)
    got = solve(make_set(n, text), text)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().exp().sum(1), torch.ones(n, dtype=torch.float64), rtol=0,
                               atol=2 * torch.finfo(torch.float32).eps * K)
