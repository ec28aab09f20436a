"""StatA (extract.methods.stata) against a slow transcription of the official solver (`MaxZanella/StatA @eea8637`,
`solvers/StatA.py`, settings in `main.py` and `scripts/StatA_online.sh`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from extract.methods.stata import StatA, StatAConfig, StatAOnline
from tests.support.transductive import K, assert_float32_matches, make_set, make_text, ref_affinity
from tests.support.transductive import solve as solve_with

pytestmark = pytest.mark.usefixtures("one_thread")
EPS64 = torch.finfo(torch.float64).eps


def ref_stata(x: torch.Tensor, text: torch.Tensor, *, alpha: float = 1.0, soft_beta: bool = False,
              lambda_laplacian: float = 1.0, n_neighbors: int = 3, max_iter: int = 10, chunk: int = 2500,
              scale: float = 100.0) -> torch.Tensor:
    """`StatA_solver` on (N, D) features, line by line (the Gaussian as `Gaussian.forward`, `init_cov` with its
    division by N inside the chunk loop): returns z (N, K)."""
    n = x.shape[0]
    clip_prototypes = text.T[None]  # (1, D, K): one template, `clip_classifier(..., reduce=None)` stacked
    zs_logits = (scale * x @ clip_prototypes).squeeze()
    y_hat = F.softmax(zs_logits, dim=1)
    z = y_hat.clone()
    init_prototypes = clip_prototypes.permute(2, 0, 1)  # (K, 1, D)
    mu = init_prototypes.clone()
    cov = None
    for start in range(0, n, chunk):  # `init_cov`
        end = min(start + chunk, n)
        part = torch.einsum("ij,ijk->k", z[start:end, :], (x[start:end][:, None, :] - init_prototypes[None, :, 0, :]) ** 2)
        cov = part if start == 0 else cov + part
        cov /= n
    cov = cov.unsqueeze(0).repeat(y_hat.size(-1), 1)
    init_covariance = cov
    w = ref_affinity(x, n_neighbors)  # `build_affinity_matrix`: the dense N x N matrix
    for k in range(max_iter + 1):
        lik = -0.5 * (((x[:, None, :] - mu[None, :, 0, :]) ** 2) * (1 / cov[None, :, :])).sum(dim=2)
        for _ in range(5):  # `update_z`
            inter = lik.clone()
            inter += lambda_laplacian * (50 / (n_neighbors * 2)) * (w.T @ z + (w @ z))
            inter -= 0.5 * cov.log().sum(dim=1).unsqueeze(0)
            inter -= torch.max(inter, dim=1, keepdim=True)[0]
            inter = (y_hat ** 1) * torch.exp(1 / 50 * inter)
            z = inter / torch.sum(inter, dim=1, keepdim=True)
        if k == max_iter:
            break
        if soft_beta:  # `update_beta`
            sum_z = torch.sum(z, dim=0)
            beta = sum_z / (alpha + sum_z)
        else:
            # official: int64 counts + a Python float give the default dtype, float32 as the whole run; here z's
            sum_z = torch.bincount(torch.argmax(z, dim=1), minlength=z.size(1)).to(z.dtype)
            beta = sum_z / (alpha + sum_z + 1e-12)
        m = torch.einsum("ij,ik->jk", z, x)  # `update_mu`
        m /= torch.sum(z, dim=0).unsqueeze(-1)
        m = m.unsqueeze(1)
        m /= m.norm(dim=-1, keepdim=True)
        m = beta.unsqueeze(-1).unsqueeze(-1) * m + (1 - beta).unsqueeze(-1).unsqueeze(-1) * init_prototypes
        mu = m / m.norm(dim=-1, keepdim=True)
        c = ((x[:, None, :] - mu[None, :, 0, :]) ** 2 * z[:, :, None]).sum(dim=0)  # `update_cov`
        c /= z.sum(dim=0)[:, None]
        delta = (init_prototypes - mu).squeeze()
        diag = torch.diagonal(torch.bmm(delta.unsqueeze(2), delta.unsqueeze(1)), dim1=1, dim2=2)
        cov = beta.unsqueeze(-1) * c + (1 - beta).unsqueeze(-1) * (init_covariance + diag)
    return z


def solve(x: torch.Tensor, text: torch.Tensor, cls=StatA, **changes) -> torch.Tensor:
    return solve_with(cls, x, text, **changes)[0]


def test_defaults():
    c = StatA.default_config("imagenet", "RN50")
    assert c == StatA.default_config("dtd", "ViT-B-16") == StatAConfig()
    assert (c.unit, c.alpha, c.lambda_laplacian, c.soft_beta, c.lambda_y_hat, c.n_neighbors, c.max_iter,
            c.z_iters, c.temperature, c.init_cov_chunk) == (0, 1.0, 1.0, False, 1.0, 3, 10, 5, 50.0, 2500)
    assert (c.n_views, c.prompts, c.cupl) == (1, "transclip", False)
    assert StatAOnline.default_config("dtd", "RN50").unit == 128
    assert StatA.output_kind == "log_probs" and StatA.unseen_config("RN50").prompts == "single"


@pytest.mark.parametrize("changes", [{}, {"soft_beta": True}, {"alpha": 3.0, "lambda_laplacian": 0.5},
                                     {"init_cov_chunk": 7}])
def test_matches_official_solver_in_float64(changes):
    """The official solve's arithmetic in float64 (`init_cov_chunk` 7 on 40 samples: its per-chunk division of the
    running sum by N taken 6 times). The Gaussian and covariance sums expanded as matrix products move each exponent
    (terms up to ~10² here) by a few eps64 of it: log z agrees within 10⁴ eps64."""
    text = make_text()
    x = make_set(40, text)
    ref_args = {"chunk" if k == "init_cov_chunk" else k: v for k, v in changes.items()}
    want = ref_stata(x[:, 0], text, **ref_args)
    got = solve(x, text, **changes)
    assert got.dtype == torch.float64 and (want > 0).all()
    torch.testing.assert_close(got, want.log(), rtol=0, atol=1e4 * EPS64)


def test_few_effective_classes():
    """StatA's setting: a batch holding 2 of the K classes (the anchor keeps the absent classes' Gaussians at the
    text prototypes)."""
    text = make_text()
    x = make_set(24, text, classes=2, seed=3)
    want = ref_stata(x[:, 0], text)
    got = solve(x, text)
    torch.testing.assert_close(got, want.log(), rtol=0, atol=1e4 * EPS64)


def test_init_cov_quirk_changes_the_result():
    """The official per-chunk division is kept: a chunk as large as the unit (one division) gives other rows."""
    text = make_text()
    x = make_set(40, text)
    assert not torch.allclose(solve(x, text, init_cov_chunk=7), solve(x, text, init_cov_chunk=40))


def test_float32_matches_float64_reference():
    assert_float32_matches(StatA, ref_stata)


def test_online_solves_each_batch_on_its_own():
    """stata-online (unit 128; 8 here): the rows of each batch are the official solve of that batch alone, the last
    batch shorter."""
    text = make_text()
    x = make_set(20, text)
    got = solve(x, text, cls=StatAOnline, unit=8)
    for a in (0, 8, 16):
        piece = x[a:a + 8, 0]
        torch.testing.assert_close(got[a:a + 8], ref_stata(piece, text).log(), rtol=0, atol=1e4 * EPS64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_sample_unit_is_finite(dtype):
    """The last unit holds one sample. In float32 (the run's) the z of the classes far from it underflow to 0, and
    the official refit of such a class (0/0) is NaN in every row: here β_k = 0 takes the anchor alone."""
    text = make_text(dtype=dtype)
    x = make_set(9, text)
    got = solve(x, text, cls=StatAOnline, unit=4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().exp().sum(1), torch.ones(9, dtype=torch.float64), rtol=0,
                               atol=2 * torch.finfo(dtype).eps * K)
