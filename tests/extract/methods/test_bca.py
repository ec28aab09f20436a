"""BCA (extract.methods.bca) against a slow transcription of TTABC's re-implementation, the reference where the
official repository cannot be read (walawalagoose/TTABC `ttabc/model_selection/bca.py` `BCAState`,
`ttabc/utils/tools.py` `select_confident_samples`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from extract.methods.bca import BCA

from tests.support.online import clustered_views, prototypes

pytestmark = pytest.mark.usefixtures("one_thread")
K, D = 5, 16
EPS32 = torch.finfo(torch.float32).eps


def select_confident_samples(logits, top):
    batch_entropy = -(logits.softmax(1) * logits.log_softmax(1)).sum(1)
    idx = torch.argsort(batch_entropy, descending=False, stable=True)[:int(batch_entropy.size()[0] * top)]
    return logits[idx], idx


class RefBCA:
    """`BCAState` as written (Python-list counts, row updates of μ in place), one sample at a time."""

    def __init__(self, cfg, init_centers, tem=100.0):
        self.mu = init_centers.clone()
        self.M = self.mu.size(0)
        self.cluster_to_class_prob = torch.eye(self.M, dtype=init_centers.dtype)
        self.threshold1, self.threshold2 = cfg.threshold1, cfg.threshold2
        self.c1 = [cfg.init_count1] * self.M
        self.c2 = [cfg.init_count2] * self.M
        self.tem, self.selection_p = tem, cfg.selection_p

    def bca_step(self, image_features):
        output, image_features = self.assign_label(image_features)
        prob_max, pred = torch.max(output, dim=1)
        if prob_max > self.threshold1:
            self.update_centers(image_features, pred)
        if prob_max > self.threshold2:
            self.update_prior(output, pred)
        return output

    def assign_label(self, image_features):
        P_x_um = self.tem * image_features @ self.mu.t()
        if image_features.size(0) > 1:
            output, selected_idx = select_confident_samples(P_x_um, self.selection_p)
            image_features = image_features[selected_idx].mean(0).unsqueeze(0)
            P_x_um = output.mean(0).unsqueeze(0)
        s1 = P_x_um.softmax(dim=1)
        return s1 @ self.cluster_to_class_prob, image_features

    def update_prior(self, soft_prob, pred):
        self.cluster_to_class_prob[pred] = (self.c2[pred] * self.cluster_to_class_prob[pred] + soft_prob) / (
            self.c2[pred] + 1)
        self.c2[pred] = self.c2[pred] + 1

    def update_centers(self, image_feature, pred):
        self.mu[pred] = self.c1[pred] * self.mu[pred] + image_feature
        self.c1[pred] = self.c1[pred] + 1
        self.mu[pred] = self.mu[pred] / self.c1[pred]
        self.mu[pred] = self.mu[pred] / torch.norm(self.mu[pred])


def make_text(seed=0, dtype=torch.float64):
    return prototypes(K, D, seed, dtype)


def make_stream(n, v, text, seed=1, noise=1.0):
    return clustered_views(n, v, text, seed, noise)[0]


def build(text, dataset="dtd", **changes):
    cfg = dataclasses.replace(BCA.default_config(dataset, "ViT-B-16"), **changes)
    return BCA(cfg, text, 100.0, backbone="ViT-B-16", dataset=dataset)


def test_defaults():
    c = BCA.default_config("dtd", "RN50")
    assert (c.n_views, c.augmix, c.prompts, c.selection_p, c.threshold1, c.init_count1, c.threshold2,
            c.init_count2) == (64, True, "single", 0.1, 0.05, 20000, 0.65, 1)
    assert not BCA.default_config("imagenet_r", "RN50").augmix and BCA.output_kind == "log_probs"


@pytest.mark.parametrize("v", [1, 20])
@pytest.mark.parametrize("changes", [{}, {"init_count1": 3, "threshold2": 0.3}])
def test_matches_reference_loop(v, changes):
    text = make_text()
    x = make_stream(40, v, text, noise=1.2)
    m = build(text, n_views=v, **changes)
    got = torch.cat([m.adapt(x[:9]), m.adapt(x[9:10]), m.adapt(x[10:])])
    ref = RefBCA(m.config, text)
    want = torch.cat([ref.bca_step(x[i]) for i in range(len(x))])
    assert (want > 0).all()
    # float64 on both sides, rows rounded to float32 once
    torch.testing.assert_close(got.double(), want.log(), rtol=2 * EPS32, atol=2 * EPS32)
    torch.testing.assert_close(m.mu, ref.mu, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m.table, ref.cluster_to_class_prob, rtol=1e-12, atol=1e-14)
    assert m.count1 == ref.c1 and m.count2 == ref.c2
    assert m.summary()["centre_updates"] > 0 and m.summary()["table_updates"] > 0


def test_underflow_keeps_finite_log_probs():
    """Wide cosine gaps at scale 100: float32 softmax underflows; the row holds the exact log, finite."""
    text = make_text(dtype=torch.float32)
    x = make_stream(12, 1, text.double(), noise=0.1).float()
    got = build(text, n_views=1).adapt(x)
    ref = RefBCA(BCA.default_config("dtd", "RN50"), text)
    want = torch.cat([ref.bca_step(x[i]) for i in range(len(x))])
    assert (want == 0).any(), "the stream must make float32 probabilities underflow"
    assert torch.isfinite(got).all()
    assert (got[want == 0] < math.log(torch.finfo(torch.float32).tiny)).all()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_run_resumes_equal_to_an_uninterrupted_run(tmp_path, tiny_model, monkeypatch):
    from tests.support.online import assert_run_resumes

    assert_run_resumes("bca", tmp_path, tiny_model, monkeypatch)
