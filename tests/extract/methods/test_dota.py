"""DOTA (extract.methods.dota) against a slow transcription of the official loop (`skylineeeeen/DOTA @bc67d44`,
`dota.py` `DOTA`, `run_test_dota`; `utils.py` `get_clip_logits_aug`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from extract.methods.dota import DOTA

from tests.support.online import clustered_views, prototypes

pytestmark = pytest.mark.usefixtures("one_thread")
K, D = 5, 16
EPS16 = torch.finfo(torch.float16).eps


class RefDOTA:
    """`dota.py` `DOTA`, one sample at a time, in the dtypes of the official run: `low` for what `.half()` makes
    float16 there (Λ, M, the CLIP side), `wide` for μ, c, Σ (float32 there)."""

    def __init__(self, cfg, low, wide, mu0):
        self.eps, self.low = cfg.epsilon, low
        self.mu = mu0.to(wide)  # (K, D)
        self.c = torch.ones(K, dtype=wide)
        self.Sigma = cfg.sigma * torch.eye(D, dtype=wide).repeat(K, 1, 1)
        self.overall_Sigma = torch.mean(self.Sigma, dim=0)
        self.Lambda = torch.pinverse(self.overall_Sigma.double()).to(low)
        self.update_sigma = cfg.update_sigma

    def fit(self, x, y):
        sum_weights = torch.sum(y, dim=0)
        weighted_x = torch.matmul(y.T, x)
        new_mu = (weighted_x + self.c.unsqueeze(1) * self.mu) / (sum_weights.unsqueeze(1) + self.c.unsqueeze(1))
        new_c = self.c + sum_weights
        if self.update_sigma:
            x_minus_mu = x.unsqueeze(1) - self.mu.unsqueeze(0)
            weighted_x_minus_mu = y.unsqueeze(2) * x_minus_mu
            delta = torch.einsum('bji,bjk->jik', weighted_x_minus_mu, x_minus_mu)
            self.Sigma = (self.c[:, None, None] * self.Sigma + delta) / (self.c[:, None, None]
                                                                       + sum_weights[:, None, None])
        self.overall_Sigma = torch.mean(self.Sigma, dim=0)
        self.mu = new_mu
        self.c = new_c

    def update(self):
        self.Lambda = torch.inverse((1 - self.eps) * self.overall_Sigma
                                    + self.eps * torch.eye(D, dtype=self.overall_Sigma.dtype)).to(self.low)

    def predict(self, X):
        M = self.mu.transpose(1, 0).to(self.low)
        W = torch.matmul(self.Lambda, M)
        c = 0.5 * torch.sum(M * W, dim=0)
        return torch.matmul(X, W) - c


def ref_dota(views, text, cfg, low, wide, scale=100.0):
    """`run_test_dota` over a stream of (N, V, D) views: (N, K) final logits and the model after the stream."""
    clip_weights = text.to(low).T  # (D, K)
    mu0 = text if cfg.init_mu == "text" else torch.full((D, K), cfg.init_mu_value).T
    model = RefDOTA(cfg, low, wide, mu0)
    out = []
    for images in views.to(low):
        image_features = images  # normalised features of the views, view 0 = the original
        clip_logits = scale * image_features @ clip_weights
        if image_features.size(0) > 1:
            batch_entropy = -(clip_logits.softmax(1) * clip_logits.log_softmax(1)).sum(1)
            selected_idx = torch.argsort(batch_entropy, descending=False, stable=True)[
                :int(batch_entropy.size()[0] * cfg.selection_p)]
            output = clip_logits[selected_idx]
            image_features = image_features[selected_idx]
            clip_logits = output.mean(0).unsqueeze(0)
            prob_map = output.softmax(1)
        else:
            prob_map = clip_logits.softmax(1)
        dota_logits = model.predict(image_features.mean(0).unsqueeze(0))
        # a 0-dim tensor on the scores' device: it meets them in their dtype
        dota_weights = torch.clamp(cfg.rho * model.c.mean() / image_features.size(0), max=cfg.eta).to(low)
        out.append((clip_logits + dota_weights * dota_logits)[0])
        model.fit(image_features, prob_map)
        model.update()
    return torch.stack(out), model


def make_text(seed=0, dtype=torch.float64):
    return prototypes(K, D, seed, dtype)


def make_stream(n, v, text, seed=1, noise=1.0):
    return clustered_views(n, v, text, seed, noise)[0]


def build(text, dataset="imagenet", **changes):
    cfg = dataclasses.replace(DOTA.default_config(dataset, "ViT-B-16"), **changes)
    return DOTA(cfg, text, 100.0, backbone="ViT-B-16", dataset=dataset)


def test_tables():
    c = DOTA.default_config("imagenet", "ViT-B-16")
    assert (c.epsilon, c.sigma, c.eta, c.rho, c.n_views, c.prompts, c.init_mu) == (
        1e-4, 0.002, 0.2, 0.005, 1, "dataset", "constant")
    assert (DOTA.default_config("eurosat", "RN50").eta, DOTA.default_config("food101", "RN50").epsilon) == (3.0, 4e-5)
    assert DOTA.default_config("caltech101", "RN50").epsilon == 0.002
    r = DOTA.default_config("imagenet_r", "ViT-B-16")
    assert (r.n_views, r.augmix, r.prompts, r.rho) == (64, True, "imagenet80", 0.0025)
    u = DOTA.unseen_config("ViT-B-16")
    assert (u.epsilon, u.eta, u.rho, u.n_views, u.prompts) == (1e-4, 0.3, 0.02, 1, "imagenet80")


@pytest.mark.parametrize("v,dataset", [(1, "dtd"), (20, "imagenet_a")])
@pytest.mark.parametrize("changes", [{}, {"init_mu": "text"}, {"update_sigma": False}])
def test_matches_official_loop_float64(v, dataset, changes):
    """float64 on both sides (no float16 rounding): the same numbers up to the order of the batched sums."""
    text = make_text()
    x = make_stream(30, v, text, noise=1.5)
    m = build(text, dataset, n_views=v, **changes)
    got = torch.cat([m.adapt(x[:7]), m.adapt(x[7:8]), m.adapt(x[8:])])
    want, ref = ref_dota(x, text, m.config, torch.float64, torch.float64)
    # rows are float32 (one rounding); Λ = ((1-ε)Σ + εI)⁻¹ has a condition number up to 1/ε, which multiplies the
    # float64 rounding of the scores
    tol = 2 * torch.finfo(torch.float32).eps + 1e3 / m.config.epsilon * torch.finfo(torch.float64).eps
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(m.sigma, ref.Sigma, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(m.mu, ref.mu, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(m.count, ref.c, rtol=1e-13, atol=0)


def test_fp16_matches_official_dtypes():
    """The default float16 path on float32 features against the transcription in the official dtypes (float16
    features, Λ, M, scores; float32 μ, c, Σ): a few float16 steps of the largest logit."""
    text = make_text(dtype=torch.float32)
    x = make_stream(40, 1, text, noise=1.5).float()
    m = build(text, "dtd")
    got = torch.cat([m.adapt(x[i:i + 5]) for i in range(0, 40, 5)])
    want, ref = ref_dota(x, text, m.config, torch.float16, torch.float32)
    assert m.lam.dtype == torch.float16 and m.sigma.dtype == torch.float32
    tol = 4 * EPS16 * float(want.abs().max())
    torch.testing.assert_close(got, want.float(), rtol=0, atol=tol)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    torch.testing.assert_close(m.sigma, ref.Sigma, rtol=1e-5, atol=1e-7)


def test_fusion_weight_grows_to_eta():
    """w = min(ρ·mean(c)/n, η): every sample adds n soft labels summing to n, so mean(c) = 1 + t·n/K."""
    text = make_text()
    m = build(text, "dtd", rho=0.1, eta=0.3)
    m.adapt(make_stream(3, 1, text))
    assert m.summary()["fusion_weight_one_view"] == pytest.approx(0.1 * (1 + 3 / K))
    m.adapt(make_stream(10, 1, text, seed=3))  # 0.1 * (1 + 13 / K) = 0.36 > η
    assert m.summary()["fusion_weight_one_view"] == pytest.approx(0.3)


def test_first_sample_is_zero_shot_up_to_a_constant():
    """μ starts constant: the first DOTA scores are equal across classes, so the first row ranks as CLIP does."""
    text = make_text()
    x = make_stream(1, 1, text)
    got = build(text, "dtd").adapt(x)[0].double()
    zs = 100.0 * x[0, 0] @ text.T
    tol = 4 * torch.finfo(torch.float32).eps * float(zs.abs().max())  # the row is float32
    torch.testing.assert_close(got - got.mean(), zs - zs.mean(), rtol=0, atol=tol)


def test_run_resumes_equal_to_an_uninterrupted_run(tmp_path, tiny_model, monkeypatch):
    from tests.support.online import assert_run_resumes

    assert_run_resumes("dota", tmp_path, tiny_model, monkeypatch)
