"""OGA (extract.methods.oga) against a slow transcription of the official code (`cfuchs2023/OGA @b91d449`:
`OGA/OGA_core.py` `GaussAdapt`, the batch loop of `runner.py` l.136-262)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from extract.methods.oga import OGA

from tests.support.online import clustered_views, prototypes

pytestmark = pytest.mark.usefixtures("one_thread")
K, D = 4, 6  # few dimensions: the Gaussian precision leaves its initial d·I after a few items per class
EPS32 = torch.finfo(torch.float32).eps


class RefGaussAdapt:
    """`GaussAdapt` as written, one item at a time, with the memory in `low` (float16 there) and μ, Λ in `wide`."""

    def __init__(self, clip_prototypes, shot_capacity, sig_type, low, wide):
        self.K, self.d = clip_prototypes.shape
        self.shot_capacity, self.sig_type = shot_capacity, sig_type
        self.mus = clip_prototypes.clone().to(wide)
        self.inv_Sig = self.d * torch.eye(self.d, dtype=wide)
        self.memory_state = torch.zeros((self.K, shot_capacity), dtype=torch.bool)
        self.memory = torch.zeros((self.K, shot_capacity, self.d), dtype=low)
        self.memory_soft_labels = torch.zeros((self.K, shot_capacity), dtype=low)
        max_entropy = -torch.log(torch.tensor(1 / self.K))
        self.memory_entropy = (max_entropy * torch.ones((self.K, shot_capacity), dtype=torch.float32)).to(low)

    def update_memory_entropy(self, x, text_prob, entropy, pseudo_label):
        entropy = entropy.to(self.memory_entropy.dtype)  # the 0-dim operand meets the memory in its dtype
        if torch.any(entropy < self.memory_entropy[pseudo_label, :]):
            idx_max = torch.argmax(self.memory_entropy[pseudo_label, :])
            self.memory[pseudo_label, idx_max] = x[...]
            self.memory_entropy[pseudo_label, idx_max] = entropy
            self.memory_state[pseudo_label, idx_max] = True
            self.memory_soft_labels[pseudo_label, idx_max] = text_prob[pseudo_label].to(self.memory.dtype)
            return True
        return False

    def update_memory(self, features, zs_probs, zs_entropy, zs_labels, normalize_mu=False):
        updated = False
        for ji in range(zs_labels.shape[0]):
            if self.update_memory_entropy(features[ji, :], zs_probs[ji, :], zs_entropy[ji], zs_labels[ji]):
                updated = True
        if updated:
            means = torch.mean(self.memory_state[..., None] * self.memory, dim=1).to(self.mus.dtype)
            mask = torch.sum(self.memory_state, dim=1) >= 2
            self.mus[mask, :] = means[mask, :]
            if normalize_mu:
                self.mus[mask, :] = self.mus[mask, :] / torch.linalg.norm(self.mus[mask, :], dim=-1, keepdims=True)
            self.update_sigma()

    def center_vecs(self):
        x = self.memory.view((self.K * self.shot_capacity, self.d))
        x_labels = torch.tensor([k for k in range(self.K) for _ in range(self.shot_capacity)])
        x_mem_state = self.memory_state.view((self.K * self.shot_capacity))
        return torch.cat([x[torch.logical_and(x_mem_state, x_labels == k)] - self.mus[k:k + 1, :]
                          for k in range(self.K)])

    def update_sigma(self):
        d = self.d
        if not torch.any(torch.sum(self.memory_state, dim=-1) > 2):
            return
        center_vecs = self.center_vecs()
        if self.sig_type == 'RidgeMoorePenrose':
            n = torch.sum(self.memory_state)
            c_center_vecs = center_vecs - center_vecs.mean(dim=0)[None, :]
            M = c_center_vecs.T @ c_center_vecs / (n - 1)
            if n <= 4 * d:
                trace = torch.sum(M[range(d), range(d)])
                self.inv_Sig = d * torch.linalg.pinv((n - 1) * M + trace * torch.eye(d, dtype=M.dtype))
            else:
                self.inv_Sig = torch.linalg.pinv(M)
        elif self.sig_type == 'Ridge':
            M = center_vecs.T.cov()
            trace = torch.sum(M[range(d), range(d)])
            n, d = center_vecs.shape
            self.inv_Sig = d * torch.linalg.pinv((n - 1) * M + trace * torch.eye(d, dtype=M.dtype))
        else:
            self.inv_Sig = torch.linalg.pinv(center_vecs.T.cov())

    def get_log_probs(self, x):
        x = x.to(self.mus.dtype)
        W = torch.einsum('nd, dc -> cn', self.mus, self.inv_Sig)
        b = - torch.einsum('nd, dc, nc -> n', self.mus, self.inv_Sig, self.mus) / 2
        Q = - torch.einsum('nd, dc, nc -> n', x, self.inv_Sig, x) / 2
        return x @ W + b + Q[:, None]

    @staticmethod
    def get_MAP(y_hat, memory_logits, tau):
        p_ = (tau * memory_logits).softmax(-1)
        z = (y_hat ** 1.0) * p_
        return z / torch.sum(z, dim=1, keepdims=True)


def ref_oga(feats, text, cfg, low, wide, scale=100.0):
    """The runner's loop over one stream (no shuffle: the stream order) in batches of `cfg.batch_size`."""
    test_features, clip_prototypes = feats.to(low), text.to(low)
    zs_logits = torch.zeros((len(feats), K), dtype=torch.float64)
    zs_logits[...] = scale * test_features @ clip_prototypes.T
    zs_pred = torch.argmax(zs_logits, dim=-1)
    zs_probs = zs_logits.softmax(-1)
    zs_entropy = - torch.sum(torch.log(zs_probs + 1e-9) * zs_probs, dim=-1)
    model = RefGaussAdapt(clip_prototypes, cfg.shot_capacity, cfg.sig_type, low, wide)
    out = []
    for start in range(0, len(feats), cfg.batch_size):
        idx = torch.arange(start, min(start + cfg.batch_size, len(feats)))
        model.update_memory(test_features[idx], zs_probs[idx], zs_entropy[idx], zs_pred[idx], cfg.normalize_mu)
        out.append(model.get_MAP(zs_probs[idx], model.get_log_probs(test_features[idx]), cfg.tau))
    return torch.cat(out), model


def make_text(seed=0, dtype=torch.float64):
    return prototypes(K, D, seed, dtype)


def make_stream(n, text, seed=1, noise=1.0):
    return clustered_views(n, 1, text, seed, noise)[0][:, 0]


def build(text, **changes):
    cfg = dataclasses.replace(OGA.default_config("dtd", "ViT-B-16"), **changes)
    return OGA(cfg, text, 100.0, backbone="ViT-B-16", dataset="dtd")


def test_defaults():
    c = OGA.default_config("imagenet", "RN50")
    assert (c.shot_capacity, c.tau, c.sig_type, c.normalize_mu, c.batch_size, c.n_views, c.prompts) == (
        8, 0.05, "RidgeMoorePenrose", False, 1, 1, "transclip")
    assert OGA.output_kind == "log_probs" and OGA.unseen_config("RN50").prompts == "single"


@pytest.mark.parametrize("changes", [
    {}, {"batch_size": 4}, {"sig_type": "Ridge"}, {"sig_type": "MoorePenrose"}, {"normalize_mu": True},
    {"shot_capacity": 2},  # no class ever holds 3 items: Λ stays d·I (the official `> 2`)
])
def test_matches_official_loop_float64(changes):
    text = make_text()
    x = make_stream(60, text, noise=0.3)
    m = build(text, **changes)
    cfg = m.config
    got = torch.cat([m.adapt(x[i:i + 8, None]) for i in range(0, 60, 8)])  # calls of whole batches (8 = 2 x 4)
    z, ref = ref_oga(x, text, cfg, torch.float64, torch.float64)
    assert (z > 0).all()
    # float64 on both sides, the stored rows rounded to float32 once: a float32 step of the log-probability
    torch.testing.assert_close(got.double(), z.log(), rtol=2 * EPS32, atol=2 * EPS32)
    torch.testing.assert_close(m.inv_sig, ref.inv_Sig, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(m.mus, ref.mus, rtol=1e-12, atol=1e-14)
    assert torch.equal(m.mem_state, ref.memory_state) and torch.equal(m.memory, ref.memory)
    if cfg.shot_capacity > 2:
        assert int(m.mem_state.sum(1).max()) > 2, "the stream must reach the covariance update"
        # K·capacity = 32 items > 4d = 24: the stream ends in the pseudo-inverse branch of RidgeMoorePenrose
        assert int(m.mem_state.sum()) > 4 * D
    else:
        assert torch.equal(m.inv_sig, D * torch.eye(D, dtype=torch.float64))


def test_fp16_matches_official_dtypes():
    """The default float16 memory and features on float32 inputs against the transcription in the official dtypes;
    the memory decisions (float16 entropies) are the same, the log-probabilities within float32 steps of the
    Gaussian scores."""
    text = make_text(dtype=torch.float32)
    x = make_stream(60, text, noise=0.3).float()
    m = build(text)
    got = torch.cat([m.adapt(x[i:i + 7, None]) for i in range(0, 60, 7)])
    z, ref = ref_oga(x, text, m.config, torch.float16, torch.float32)
    assert m.memory.dtype == torch.float16 and m.mus.dtype == torch.float32
    assert torch.equal(m.mem_state, ref.memory_state) and torch.equal(m.memory, ref.memory)
    # the float32 Gaussian scores (hundreds here: Λ ~ d/tr(M)) differ by float32 steps between a batched and a
    # one-row einsum; τ = 0.05 scales them into the log-probabilities: ~1e3·eps32·τ
    torch.testing.assert_close(got, z.log().float(), rtol=1e-4, atol=1e-4)


def test_underflow_keeps_finite_log_probs():
    """A sharp τ makes the float32 softmax of the Gaussian scores underflow: the row holds the exact log, finite,
    below the log of the smallest float32."""
    text = make_text(dtype=torch.float32)
    x = make_stream(40, text, noise=0.3).float()
    m = build(text, tau=50.0)
    got = m.adapt(x[:, None])
    z, _ = ref_oga(x, text, m.config, torch.float16, torch.float32)
    assert (z == 0).any(), "the stream must make z underflow"
    assert torch.isfinite(got).all()
    assert (got[z == 0] < math.log(torch.finfo(torch.float32).tiny)).all()
    assert torch.equal(got.argmax(-1), z.argmax(-1))


def test_batches_are_cut_from_each_call():
    """batch_size S: each adapt call is cut into batches of S from its first sample (the official batches when the
    calls are whole batches); with S = 1 any cut gives the same rows."""
    text = make_text()
    x = make_stream(24, text, noise=0.3)[:, None]
    whole = build(text, batch_size=8).adapt(x)
    m = build(text, batch_size=8)
    torch.testing.assert_close(torch.cat([m.adapt(x[:16]), m.adapt(x[16:])]), whole, rtol=0, atol=0)
    m = build(text, batch_size=8)
    assert not torch.equal(torch.cat([m.adapt(x[:5]), m.adapt(x[5:])]), whole)


def test_run_resumes_equal_to_an_uninterrupted_run(tmp_path, tiny_model, monkeypatch):
    from tests.support.online import assert_run_resumes

    assert_run_resumes("oga", tmp_path, tiny_model, monkeypatch, overrides={"batch_size": "2"})
