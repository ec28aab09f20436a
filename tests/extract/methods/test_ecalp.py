"""ECALP (extract.methods.ecalp) against a slow transcription of the official zero-shot loop (`Yushu-Li/ECALP
@96ddf0b`: `main.py` l.46-63, `utils/iterative_label_propagation.py` without the few-shot branches), written with
torch.sparse as the official code is."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F


from extract.methods.ecalp import ECALP

pytestmark = pytest.mark.usefixtures("one_thread")
K, D = 5, 16
EPS32 = torch.finfo(torch.float32).eps


class RefECALP:
    """The official module-level state and functions, one call per sample."""

    def __init__(self, k_text=3, k_image=8, gamma=10.0, alpha=1.0, iters=3):
        self.k_text, self.k_image, self.gamma, self.alpha, self.iters = k_text, k_image, gamma, alpha, iters
        self.s = {}

    @staticmethod
    def reweight_full(X, Q, a):
        weights = F.normalize(a.var(dim=0), p=2, dim=0)
        return F.normalize(Q * weights, p=2, dim=1) @ F.normalize(X, p=2, dim=1).t()

    def expansion(self, features, clf):
        s, K_ = self.s, clf.shape[0]
        n = features.shape[0]
        first = s.get("sim_im2im") is None or n == 2
        k = min(self.k_image, n)
        if first:
            full = self.reweight_full(features, features, clf)
            s["sim_im2im"], s["knn_im2im"] = full[:n, :n].topk(k, largest=True, dim=1)
            s["sim_store"], s["knn_store"] = s["sim_im2im"].clone(), s["knn_im2im"].clone()
        else:
            cr = self.reweight_full(features[-2:], features, clf).t()
            sim_new, knn_new = cr.topk(k, largest=True, dim=1)
            new_idx = torch.full((s["knn_im2im"].shape[0] - 1, 1), n - 1, dtype=knn_new.dtype)
            s["sim_store"][s["knn_store"] == n - 2] = -1.0
            sim_ext = torch.cat([s["sim_store"][:-1], cr[:, :n - 2].transpose(1, 0)], dim=1)
            knn_ext = torch.cat([s["knn_store"][:-1], new_idx - 1, new_idx], dim=1)
            if sim_ext.shape[0] == k + 1:
                k_new = k + 1
            elif sim_ext.shape[0] > k:
                k_new = k + 2
            else:
                k_new = k
            s["sim_store"], ht = sim_ext.topk(k_new, largest=True, dim=1)
            s["sim_im2im"] = s["sim_store"][:, :k]
            s["knn_store"] = knn_ext.gather(1, ht)
            s["knn_im2im"] = s["knn_store"][:, :k]
            if sim_ext.shape[0] > k:
                a, b = cr.topk(k_new, largest=True, dim=1)
            else:
                a, b = sim_new, knn_new
            s["sim_store"], s["knn_store"] = torch.cat([s["sim_store"], a]), torch.cat([s["knn_store"], b])
            s["sim_im2im"] = torch.cat([s["sim_im2im"], sim_new])
            s["knn_im2im"] = torch.cat([s["knn_im2im"], knn_new])
        kt = min(self.k_text, K_)
        if first:
            s["sim_t"], s["knn_t"] = features.mm(clf.t())[:n].topk(kt, largest=True, dim=1)
        else:
            a, b = features[-1].unsqueeze(0).mm(clf.t()).topk(kt, largest=True, dim=1)
            s["sim_t"], s["knn_t"] = torch.cat((s["sim_t"][:-1], a, a)), torch.cat((s["knn_t"][:-1], b, b))
        knn = torch.cat((s["knn_im2im"] + K_, s["knn_t"]), dim=1)
        sim = torch.cat((s["sim_im2im"], s["sim_t"]), dim=1)
        knn = torch.cat((-torch.ones((K_, knn.shape[1]), dtype=knn.dtype), knn))
        sim = torch.cat((torch.zeros((K_, sim.shape[1]), dtype=sim.dtype), sim))
        return knn, sim

    def __call__(self, image_features, clf):
        s, K_ = self.s, clf.shape[0]
        if image_features.shape[0] == 2:
            s["Y_0"] = s["Y_txt"] = None
        knn, sim = self.expansion(image_features, clf)
        sim[knn < K_] = sim[knn < K_] ** self.gamma
        sim[knn >= K_] = sim[knn >= K_] ** self.gamma
        size = image_features.shape[0] + K_
        idx, dist = knn.flatten().clone(), sim.flatten()
        idx[idx == -1] = 0
        rows = torch.arange(size).repeat_interleave(knn.shape[1])
        nz = dist != 0
        W = torch.sparse_coo_tensor(torch.stack([rows[nz], idx[nz]]), dist[nz], (size, size))
        W = W.transpose(0, 1) + W
        diag = 1 / (torch.sqrt(torch.sparse.sum(W, dim=1).to_dense()) + 1e-6)
        ii = torch.arange(size)
        Dm = torch.sparse_coo_tensor(torch.stack([ii, ii]), diag, (size, size))
        Wt = torch.sparse.mm(Dm, torch.sparse.mm(W, Dm)).coalesce()
        dt = clf.dtype
        if s["Y_txt"] is None:
            s["Y_txt"] = torch.eye(K_, dtype=dt).to_sparse()
            s["Y_0"] = torch.zeros((size - K_, K_), dtype=dt).to_sparse()
        else:
            s["Y_0"] = torch.cat((s["Y_0"][:-1], torch.zeros((2, K_), dtype=dt)), dim=0).to_sparse()
        Y_hat = torch.cat((s["Y_txt"], s["Y_0"]), dim=0)
        mask = Wt.indices()[0] >= K_
        ind = Wt.indices()[:, mask].clone()
        ind[0] -= K_
        W0 = torch.sparse_coo_tensor(ind, Wt.values()[mask], (size - K_, size))
        for _ in range(self.iters):
            Y_t = self.alpha * torch.sparse.mm(W0, Y_hat) + (1 - self.alpha) * s["Y_0"]
            Y_hat = torch.cat((s["Y_txt"], Y_t), dim=0)
        pred = Y_hat[-1, :K_].to_dense()
        tensor = Y_hat.to_dense()[K_:, :K_]
        v, i = torch.topk(tensor, 1, dim=1)
        s["Y_0"] = torch.zeros_like(tensor)
        s["Y_0"].scatter_(1, i, v / 5)
        return pred


def ref_stream(feats, clf, **kw):
    """`main.py`'s loop: the graph at sample i holds samples 0..i and sample i again. Returns the preds (N, K)."""
    ref = RefECALP(**kw)
    return torch.stack([ref(torch.cat((feats[:i + 1], feats[i].unsqueeze(0)), dim=0), clf) for i in range(len(feats))])


def make_text(seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)


def make_stream(n, text, seed=1, noise=1.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    return F.normalize(text[y] + noise * torch.randn(n, D, generator=g, dtype=text.dtype) / D ** 0.5, dim=-1)[:, None]


def build(text, **changes):
    cfg = dataclasses.replace(ECALP.default_config("dtd", "ViT-B-16"), **changes)
    return ECALP(cfg, text, 100.0, backbone="ViT-B-16", dataset="dtd")


def test_defaults():
    c = ECALP.default_config("imagenet", "RN50")
    assert (c.k_text, c.k_image, c.gamma, c.alpha, c.num_iterations, c.n_views) == (3, 8, 10.0, 1.0, 3, 1)
    assert ECALP.output_kind == "log_probs"


@pytest.mark.parametrize("k_image,alpha", [(8, 1.0), (3, 0.7)])
def test_matches_official_loop(k_image, alpha):
    text = make_text()
    x = make_stream(40, text, noise=1.5)
    m = build(text, k_image=k_image, alpha=alpha)
    got = torch.cat([m.adapt(x[:1]), m.adapt(x[1:13]), m.adapt(x[13:])])
    pred = ref_stream(x[:, 0], text, k_image=k_image, alpha=alpha)
    prob32 = (1e4 * pred).float().softmax(-1)  # the official output (its softmax runs in float32)
    want = torch.where(prob32 > 0, prob32.double().log(), (1e4 * pred).log_softmax(-1))
    # float64 propagation on both sides, sums in another order (~1e-16 relative, x 1e4 on the scores); then the
    # float32 softmax: a few float32 eps on each probability, i.e. absolute on its log
    torch.testing.assert_close(got.double(), want, rtol=2 * EPS32, atol=4 * EPS32)
    assert torch.equal(got.argmax(-1), pred.argmax(-1))


def test_float32_stream():
    """float32, as the official code runs."""
    text = make_text().float()
    x = make_stream(30, text.double(), seed=5, noise=2.0).float()
    got = build(text).adapt(x)
    pred = ref_stream(x[:, 0], text)
    prob = (1e4 * pred).softmax(-1)
    assert torch.isfinite(got).all()
    assert torch.equal(got.argmax(-1), prob.argmax(-1))
    pos = prob > 0
    # float32 propagation sums over (k + 3)^3 paths of products of 3 normalised weights; pred ~ 1e-1 is scaled by
    # 1e4: relative error a few eps x 11^3 on pred, times 1e4 x |pred| absolute on the log-probability
    tol = 4 * 11 ** 3 * EPS32 * 1e4 * float(pred.abs().max())
    torch.testing.assert_close(got[pos].double(), prob[pos].double().log(), rtol=0, atol=tol)


def test_feature_buffer_growth_changes_nothing(monkeypatch):
    import extract.methods.ecalp as ecalp_module

    text = make_text()
    x = make_stream(20, text, seed=7)
    want = build(text).adapt(x)
    monkeypatch.setattr(ecalp_module, "_INITIAL_ROWS", 3)
    m = build(text)
    got = torch.cat([m.adapt(x[:5]), m.adapt(x[5:])])
    assert m.graph["feats"].shape[0] == 24  # 3 -> 6 -> 12 -> 24
    assert torch.equal(got, want)
