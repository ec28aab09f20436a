"""DMN and DMN-weak (extract.methods.dmn) against a slow transcription of the official zero-shot loop
(`YBZh/DMN` `dmn_main.py` `direct_inference`, `DualMem.update_memory_bank`, `DualMem.get_image_pred`), written here
one sample at a time with the official data layout (zero-filled memory, keys re-normalised at every read)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F


from extract.methods import REGISTRY
from extract.methods.dmn import DMN, DMN_MEMORY_WEIGHT, DMNConfig, mix_log_probs
from tests.support.extract import with_views

K, D = 5, 16
EPS64 = torch.finfo(torch.float64).eps

pytestmark = pytest.mark.usefixtures("one_thread")


def make_text(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)


def make_stream(n: int, v: int, text: torch.Tensor, seed: int = 1, noise: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    base = text[y][:, None, :] + noise * torch.randn(n, v, D, generator=g, dtype=text.dtype) / math.sqrt(D)
    return F.normalize(base, dim=-1)


def official_dmn(stream: torch.Tensor, text: torch.Tensor, scale: float, cfg: DMNConfig):
    """The official per-sample loop, transcribed: returns (N, K) scores p_text + w·p_mem and the events of the
    full-memory branch (replaced, kept)."""
    m_size, beta = cfg.memory_size, cfg.beta
    text_feat = text / text.norm(dim=1, keepdim=True)  # get_text_prediction: text_feat + zero bias, normalised
    memory = torch.zeros(K, m_size, D, dtype=stream.dtype)
    entropy_mem = torch.zeros(K, m_size, dtype=stream.dtype)
    count = [0] * K
    events = {"replaced": 0, "kept": 0}
    scores = []
    for views in stream:
        images = views[:cfg.used_views]
        probs = (scale * images @ text_feat.t()).softmax(-1)  # img_text, every view
        batch_entropy = -(probs * torch.log(probs + 1e-6)).sum(1)
        top = max(1, int(batch_entropy.size()[0] * cfg.selection_p))
        idx = torch.argsort(batch_entropy, descending=False)[:top]
        mean_prob = probs[idx].mean(0)
        pseudo = int(mean_prob.argmax())
        h = -(mean_prob * torch.log(mean_prob + 1e-8)).sum()
        if count[pseudo] == m_size:
            if (h < entropy_mem[pseudo]).sum() == 0:
                events["kept"] += 1
            else:
                _, order = torch.sort(entropy_mem[pseudo])
                memory[pseudo][order[-1]] = images[0]
                entropy_mem[pseudo][order[-1]] = h
                events["replaced"] += 1
        else:
            memory[pseudo][count[pseudo]] = images[0]
            entropy_mem[pseudo][count[pseudo]] = h
            count[pseudo] += 1
        # get_image_pred, similarity_weighted
        mem = torch.cat((memory, text_feat.unsqueeze(1)), dim=1)  # (K, M + 1, D)
        keys = mem / mem.norm(dim=-1, keepdim=True)
        keys[mem.sum(-1) == 0] = 0
        img = images[:1]
        query = img / img.norm(dim=-1, keepdim=True)
        sim = torch.exp(-beta * (-(query * keys).sum(-1) + 1))
        ada = (keys * sim.unsqueeze(-1)).sum(1)
        ada = ada / ada.norm(dim=-1, keepdim=True)
        ada = ada / ada.norm(dim=-1, keepdim=True)  # again after the zero output bias
        p_mem = (scale * ada @ img[0]).softmax(-1)
        scores.append(probs[0] + cfg.mem_weight * p_mem)
    return torch.stack(scores), events


def run(cfg: DMNConfig, text: torch.Tensor, stream: torch.Tensor, chunk: int | None = None,
        scale: float = 100.0) -> torch.Tensor:
    m = DMN(cfg, text, scale, backbone="ViT-B-16", dataset="dtd")
    if chunk is None:
        return m.adapt(stream)
    return torch.cat([m.adapt(stream[i:i + chunk]) for i in range(0, len(stream), chunk)])


# Logit scale of the reference tests: at 100 the unit-variance toy features give one-hot softmaxes whose entropies
# all tie at -1e-8 (-1·log(1 + 1e-8)), and which item the memory replaces then hangs on the last bit. At 10 the
# entropies are distinct, as real CLIP cosines (0.2-0.35) give at 100.
SCALE = 10.0


# log-probabilities from scale-s logits: a width-(M+1)·D computation, each step a few eps of the logit scale
def tol(cfg: DMNConfig, eps: float = EPS64) -> float:
    return 8 * (cfg.memory_size + 1) * D * eps * SCALE


@pytest.mark.parametrize("v,memory_size,weight", [(32, 50, 1.0), (20, 2, 10.0), (64, 3, 0.3), (1, 2, 3.0)])
def test_equals_official_loop(v, memory_size, weight):
    text = make_text()
    x = make_stream(60, v, text, seed=v + memory_size, noise=1.5)
    cfg = with_views(DMN.default_config("dtd", "ViT-B-16"), v, memory_size=memory_size, mem_weight=weight)
    want, events = official_dmn(x.clone(), text, SCALE, cfg)
    got = run(cfg, text, x, scale=SCALE)  # float32 output of a float64 computation
    # the stored value is the log of the official score divided by its sum 1 + w, rounded to float32
    torch.testing.assert_close(got.double(), torch.log(want / (1 + weight)), atol=tol(cfg),
                               rtol=torch.finfo(torch.float32).eps)
    torch.testing.assert_close(want.sum(-1), torch.full((60,), 1.0 + weight, dtype=torch.float64))
    if memory_size <= 3:  # the full-memory branch is exercised both ways
        assert events["replaced"] > 0 and events["kept"] > 0


def test_batched_equals_one_at_a_time_float32():
    text = make_text().float()
    x = make_stream(40, 32, text.double(), seed=3, noise=1.5).float()
    cfg = dataclasses.replace(DMN.default_config("imagenet_a", "ViT-B-16"), n_views=32, memory_size=3)
    whole = run(cfg, text, x)
    for chunk in (1, 7):
        # float32 logits of a width-D product at scale 100, then the same read-out: LOGIT tolerance
        torch.testing.assert_close(run(cfg, text, x, chunk), whole, rtol=0,
                                   atol=2 * D * torch.finfo(torch.float32).eps * 100.0)


def test_views_past_used_views_are_ignored():
    text = make_text()
    x = make_stream(20, 64, text, seed=5)
    y = x.clone()
    y[:, 32:] = make_stream(20, 32, text, seed=6)
    cfg = DMN.default_config("imagenet", "ViT-B-16")
    assert cfg.used_views == 32 and cfg.n_views == 64
    assert torch.equal(run(cfg, text, x), run(cfg, text, y))


def test_output_is_a_finite_log_distribution():
    text = make_text().float()
    x = make_stream(30, 20, text.double(), seed=7, noise=0.2).float()  # confident views: tiny probabilities
    out = run(with_views(DMN.default_config("dtd", "RN50"), 20), text, x)
    assert torch.isfinite(out).all() and (out <= 1e-6).all()
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(30), rtol=0, atol=K * 4 * torch.finfo(torch.float32).eps)
    assert DMN.output_kind == "log_probs"


def test_mix_log_probs_log_space():
    a = torch.tensor([[-1e4, 0.0, -3.0]], dtype=torch.float64).log_softmax(-1)
    b = torch.tensor([[2.0, -1e4, 0.0]], dtype=torch.float64).log_softmax(-1)
    for w in (0.001, 0.3, 1.0, 1000.0):
        got = mix_log_probs(a.float(), b.float(), w)
        want = torch.log((a.exp() + w * b.exp()) / (1 + w))
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    assert torch.equal(mix_log_probs(a, b, 0.0), a)


def test_default_config_tables():
    c = DMN.default_config("dtd", "ViT-B-16")
    assert (c.n_views, c.used_views, c.augmix, c.prompts, c.cupl, c.mem_weight) == (64, 32, True, "dataset", True, 10.0)
    c = DMN.default_config("imagenet_r", "RN50")
    assert (c.augmix, c.mem_weight, c.beta, c.memory_size, c.selection_p) == (False, 0.3, 5.5, 50, 0.1)
    assert set(DMN_MEMORY_WEIGHT) == set(REGISTRY["tda"].default_config.__globals__["TDA_ALPHA_BETA"])
    with pytest.raises(ValueError, match="mem_weight"):
        dataclasses.replace(c, mem_weight=-1.0)
    with pytest.raises(ValueError, match="used_views"):
        dataclasses.replace(c, used_views=0)


# ---------------------------------------------------------------------------------------------- DMN-weak

def test_official_crops_on_the_imagenet_family_are_their_own_policy():
    """Issue 31 item 4: DMN's crop + flip views crop at area 0.5-1 (`data/datautils.py` `get_preaugment`): a view
    policy and cache part of their own by default; `crops="shared"` reads TPT's 0.08-1 crops (no second encoding);
    AugMix sets and DMN-weak's single view are unchanged, and so is every other method."""
    from extract.run.options import RunOptions, plan

    for ds in ("imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch"):
        assert plan(RunOptions.make("dmn", ds)).policy == "crop_flip_05"
        assert plan(RunOptions.make("dmn", ds, overrides={"crops": "shared"})).policy == "crop_flip"
        assert plan(RunOptions.make("dmn-weak", ds)).policy == "single"
        assert plan(RunOptions.make("tpt", ds)).policy == "crop_flip"
    assert plan(RunOptions.make("dmn", "dtd")).policy == "augmix"
    assert DMN.default_config("imagenet_a", "ViT-B-16").crop_scale == (0.5, 1.0)
    # dmn-weak: one view, no crops; COSMIC is built on DMN's code and keeps its crops (tested in test_cosmic.py)
    others = [k for k in REGISTRY if k not in ("dmn", "dmn-weak", "cosmic")]
    assert all(REGISTRY[k].default_config("imagenet", "ViT-B-16").crop_scale == (0.08, 1.0) for k in others)


def test_dmn_weak_is_dmn_on_view_0():
    cfg = REGISTRY["dmn-weak"].default_config("flowers102", "ViT-B-16")
    assert (cfg.n_views, cfg.augmix, cfg.mem_weight) == (1, False, 10.0)
    assert cfg == dataclasses.replace(DMN.default_config("flowers102", "ViT-B-16"), n_views=1, augmix=False,
                                      used_views=1)
    text = make_text()
    x = make_stream(50, 1, text, seed=9, noise=1.5)
    small = dataclasses.replace(cfg, memory_size=2)
    weak = REGISTRY["dmn-weak"](small, text, SCALE, backbone="ViT-B-16", dataset="flowers102").adapt(x)
    # the official loop with its single view kept as the pseudo-label source (int(1 * 0.1) = 0 would keep none)
    want, events = official_dmn(x.clone(), text, SCALE, small)
    torch.testing.assert_close(weak.double(), torch.log(want / (1 + small.mem_weight)), atol=tol(small),
                               rtol=torch.finfo(torch.float32).eps)
    assert events["replaced"] > 0 and events["kept"] > 0
    # the pseudo-label is view 0's own argmax: the memory read-out never sees another view
    assert torch.equal(weak, run(dataclasses.replace(small, n_views=1), text, x, scale=SCALE))


def test_dmn_on_unseen_data_reads_its_views():
    """Issue 32 item 7: DMN's settings for unseen data keep its views, so its logits are not DMN-weak's: the
    pseudo-label that picks the memory slot comes from the confident views, not from view 0 alone."""
    dmn, weak = DMN.unseen_config("ViT-B-16"), REGISTRY["dmn-weak"].unseen_config("ViT-B-16")
    assert (dmn.n_views, dmn.used_views, weak.n_views, weak.used_views) == (64, 32, 1, 1)
    text = make_text()
    x = make_stream(40, 64, text, seed=4, noise=1.5)
    small = {"memory_size": 2}
    multi = run(dataclasses.replace(dmn, **small), text, x, scale=SCALE)
    single = run(dataclasses.replace(weak, **small), text, x[:, :1], scale=SCALE)
    assert (multi - single).abs().max() > 0.1  # far beyond rounding: other memory contents
    # and DMN on view 0 alone is DMN-weak exactly: the difference is the views
    assert torch.equal(run(dataclasses.replace(dmn, n_views=1, used_views=1, augmix=False, **small), text,
                           x[:, :1], scale=SCALE), single)
