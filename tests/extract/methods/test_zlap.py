"""ZLaP (extract.methods.zlap) against a slow transcription of the official code (`vladan-stojnic/ZLaP @89ab14b`,
`zlap.py` and `utils.py`) with numpy and scipy in place of faiss and cupy: the graph as `create_separate_graph` and
`knn2laplacian` build it (scipy's csr_matrix, which cupyx mirrors), and `cupyx.scipy.sparse.linalg.cg` written out
for one right-hand side at a time."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from extract.methods.zlap import ZLaP, ZLaPConfig, ZLaPInductive, batched_cg
from tests.support.transductive import K, make_set, make_text
from tests.support.transductive import solve as solve_with

pytestmark = pytest.mark.usefixtures("one_thread")
EPS64 = np.finfo(np.float64).eps


def ref_search(base: np.ndarray, queries: np.ndarray, k: int, skip_self: bool = False):
    """faiss' exact inner-product search: (knn (n, k), sims (n, k)), largest first."""
    s = queries @ base.T
    if skip_self:
        np.fill_diagonal(s, -np.inf)
    knn = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return knn, np.take_along_axis(s, knn, axis=1)


def ref_laplacian(features: np.ndarray, clf: np.ndarray, k: int, gamma: float, alpha: float) -> sp.csr_matrix:
    """`create_separate_graph`, the edge weights of `do_transductive_lp`, `knn2laplacian`."""
    num_classes = clf.shape[0]
    knn_ii, sim_ii = ref_search(features, features, min(k, features.shape[0]))
    knn_it, sim_it = ref_search(clf, features, min(k, num_classes))
    knn = np.concatenate((knn_ii + num_classes, knn_it), axis=1)
    sim = np.concatenate((sim_ii, sim_it), axis=1)
    knn = np.concatenate((-1 * np.ones((num_classes, knn.shape[1]), dtype=knn.dtype), knn), axis=0)
    sim = np.concatenate((np.zeros((num_classes, sim.shape[1]), dtype=sim.dtype), sim), axis=0)
    sim[sim < 0] = 0
    mask = knn < num_classes
    sim[mask] = sim[mask] ** gamma
    n = knn.shape[0]
    rows = np.tile(np.arange(n), (knn.shape[1], 1)).T.flatten("F")
    cols, vals = knn.flatten("F"), sim.flatten("F")
    valid = np.where(cols != -1)[0]
    w = sp.csr_matrix((vals[valid], (rows[valid], cols[valid])), shape=(n, n))
    w = w + w.T
    w = w - sp.diags(w.diagonal(), 0)  # `normalize_connection_graph`
    s = np.asarray(w.sum(axis=1))
    s[s == 0] = 1
    d = 1.0 / np.sqrt(s)
    d[np.isnan(d)] = 0
    d[np.isinf(d)] = 0
    dm = sp.diags(d.reshape(-1), 0)
    wn = dm * w * dm
    return (sp.eye(n) - alpha * wn).tocsr()


def ref_cg(a: sp.csr_matrix, b: np.ndarray, tol: float = 1e-6, maxiter: int = 50) -> np.ndarray:
    """`cupyx.scipy.sparse.linalg.cg` without a preconditioner, for one right-hand side."""
    x = np.zeros_like(b)
    b_norm = np.linalg.norm(b)
    if b_norm == 0:
        return b
    atol = tol * b_norm
    r = b - a @ x
    iters, rho, p = 0, 0.0, None
    while iters < maxiter:
        z = r
        rho1, rho = rho, r @ z
        p = z if iters == 0 else z + (rho / rho1) * p
        q = a @ p
        step = rho / (p @ q)
        x = x + step * p
        r = r - step * q
        iters += 1
        if np.linalg.norm(r) <= atol:
            break
    return x


def ref_transductive(features, clf, k=5, gamma=5.0, alpha=0.3):
    """`do_transductive_lp`: one solve per class, scores at the sample nodes."""
    num_classes = clf.shape[0]
    lap = ref_laplacian(features, clf, k, gamma, alpha)
    scores = np.zeros((features.shape[0], num_classes))
    for idx in range(num_classes):
        y = np.zeros(lap.shape[0])
        y[idx] = 1
        scores[:, idx] = ref_cg(lap, y)[num_classes:]
    return scores


def ref_inductive(features, clf, k=5, gamma=5.0, alpha=0.3):
    """`do_inductive_lp` with the unit as the unlabeled set and each sample a query outside it (its own node never
    among its seeds): one solve per sample, scores at the class nodes."""
    num_classes = clf.shape[0]
    lap = ref_laplacian(features, clf, k, gamma, alpha)
    knn_ii, sim_ii = ref_search(features, features, min(k, features.shape[0] - 1), skip_self=True)
    sim_ii[sim_ii < 0] = 0
    knn_it, sim_it = ref_search(clf, features, min(k, num_classes))
    sim_it[sim_it < 0] = 0
    knn = np.concatenate((knn_ii + num_classes, knn_it), axis=1)
    sim = np.concatenate((sim_ii, sim_it ** gamma), axis=1)
    scores = np.zeros((features.shape[0], num_classes))
    for idx, (nb, s) in enumerate(zip(knn, sim)):
        y = np.zeros(lap.shape[0])
        y[nb] = s
        scores[idx] = ref_cg(lap, y)[:num_classes]
    return scores


def solve(x: torch.Tensor, text: torch.Tensor, cls=ZLaP, **changes):
    return solve_with(cls, x, text, **changes)


def test_defaults():
    c = ZLaP.default_config("imagenet", "RN50")
    assert c == ZLaP.default_config("dtd", "ViT-B-16") == ZLaPConfig() == ZLaPInductive.default_config("dtd", "RN50")
    assert (c.unit, c.k, c.gamma, c.alpha, c.cg_tol, c.cg_maxiter) == (0, 5, 5.0, 0.3, 1e-6, 50)
    assert (c.n_views, c.prompts, c.cupl) == (1, "transclip", False)
    assert ZLaP.output_kind == "logits" and ZLaP.unseen_config("RN50").prompts == "single"


@pytest.mark.parametrize("n", [3, 30])
@pytest.mark.parametrize("cls, ref", [(ZLaP, ref_transductive), (ZLaPInductive, ref_inductive)])
def test_matches_official_solver_in_float64(n, cls, ref):
    """Exact arithmetic of the official code in float64: the same graph and the same CG iterates per column, sums
    in another order (a few eps64 per step of ~10 iterations on values below 1): within 10³ eps64. n = 3: fewer
    samples than k (the official `min(k, N)`)."""
    text = make_text()
    x = make_set(n, text)
    want = ref(x[:, 0].numpy(), text.numpy())
    got, m = solve(x, text, cls=cls)
    assert got.dtype == torch.float64 and m.summary()["cg_unconverged"] == 0
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e3 * EPS64)
    assert (got > 0).any(dim=1).all()


def test_float32_features_keep_the_official_float64_solve():
    """float32 features (the run's): the graph in float32 as faiss gives it, the solve in float64; scores within
    float32 rounding of the edge weights (~eps32 relative) of the float64 reference, the same predictions."""
    text = make_text(dtype=torch.float32)
    x = make_set(30, text)
    want = ref_transductive(x[:, 0].double().numpy(), text.double().numpy())
    got, _ = solve(x, text)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), want, rtol=0, atol=100 * np.finfo(np.float32).eps * want.max())
    assert np.array_equal(got.argmax(1).numpy(), want.argmax(1))


def test_batched_cg_stops_each_column_on_its_own():
    """Columns needing different iteration counts: each equals its own single-column run, and a zero column
    returns zeros (cupy's `b_norm == 0`)."""
    g = np.random.default_rng(0)
    a = g.normal(size=(12, 12))
    a = sp.csr_matrix(a @ a.T + 12 * np.eye(12))
    b = np.stack([np.eye(12)[0], g.normal(size=12), np.zeros(12), 1e-3 * g.normal(size=12)], axis=1)
    lap = torch.sparse_coo_tensor(torch.tensor(np.stack(a.nonzero())), torch.tensor(a.data),
                                  a.shape, check_invariants=False).coalesce()
    for maxiter in (2, 50):
        x, iters, done = batched_cg(lap, torch.tensor(b), 1e-6, maxiter)
        for j in range(b.shape[1]):
            np.testing.assert_allclose(x[:, j].numpy(), ref_cg(a, b[:, j], maxiter=maxiter), rtol=0,
                                       atol=100 * EPS64)
        assert iters[2] == 0 and bool(done[2])
    assert (iters <= 50).all()


def test_columns_solved_in_blocks_equal_one_block():
    """Columns are independent: blocks of 7 give what one block gives (a product of another width may sum in
    another order: within a few eps64 of values below 1)."""
    from extract.methods.zlap import laplacian, query_seeds, solve_columns

    text = make_text()
    x = make_set(30, text)[:, 0]
    lap = laplacian(x, text, 5, 5.0, 0.3)
    seeds = query_seeds(x, text, 5, 5.0)
    whole = solve_columns(lap, seeds, 30, 1e-6, 50, keep=(0, K))
    blocks = solve_columns(lap, seeds, 30, 1e-6, 50, keep=(0, K), block_bytes=6 * 8 * lap.shape[0] * 7)
    torch.testing.assert_close(whole[0], blocks[0], rtol=0, atol=100 * EPS64)
    assert whole[1:] == blocks[1:]
