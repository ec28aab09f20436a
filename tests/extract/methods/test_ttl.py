"""TTL (extract/methods/ttl.py, extract/run/pixels.py) on a tiny 4-block open_clip ViT, against a slow transcription
of the official per-sample loop (`ttl.py:test_time_adapt_eval`, `deyo.py:forward_and_adapt_sar`, peft's LoRA on
HuggingFace's separate q_proj/v_proj) written here from docs/methods.md, "TTL: LoRA on the image encoder"."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from extract.methods.ttl import TTL

from tests.support.extract import make_json_dataset

K = 5
DEPTH = 4  # one frozen block before the 3 LoRA blocks
EPS32 = torch.finfo(torch.float32).eps
# a unit feature through DEPTH blocks of width 32: each reduction over the width may round differently
FEAT_TOL = DEPTH * 32 * EPS32

pytestmark = pytest.mark.usefixtures("one_thread")


def tuned_tol(scale: float, updates: int) -> float:
    """fp32 logit tolerance after `updates` AdamW steps (tests/support/tpt.py `tuned_tol`: the prediction's
    2 FEAT_TOL·scale plus at most 2 FEAT_TOL·scale per step)."""
    return (2 + 2 * updates) * FEAT_TOL * scale


@pytest.fixture(scope="module")
def deep_model():
    """A tiny open_clip ViT with 4 vision blocks (so that the frozen prefix is not empty), logit scale 37.5."""
    import open_clip

    from extract.models import LoadedModel, Preprocess

    torch.manual_seed(0)
    cfg = {"embed_dim": 16, "quick_gelu": True,
           "vision_cfg": {"image_size": 32, "layers": DEPTH, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    model = open_clip.CLIP(**cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(37.5))
    return LoadedModel(model, None, "tiny-deep", "none", "tiny-deep", True,
                       Preprocess((32, 32), (0.5,) * 3, (0.25,) * 3), 37.5, torch.device("cpu"), "fp32", "x")


def make(model, text, pixels, **changes) -> TTL:
    cfg = dataclasses.replace(TTL.default_config("dtd", "ViT-B-16"), **changes)
    m = TTL(cfg, text, model.logit_scale, backbone="tiny", dataset="dtd", text_encoder=model)
    m.attach_views(lambda a, b: pixels[a:b])
    return m


def data(n: int, v: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    text = F.normalize(torch.randn(K, 16, generator=g), dim=-1)
    pixels = torch.randn(n, v, 3, 32, 32, generator=g)
    return text, pixels


# ------------------------------------------------------------------------------------------ slow transcription

def ref_attention(blk, x, lora, scale):
    """HF CLIPAttention with peft LoRA: separate q/k/v projections, q scaled by head_dim^-0.5, explicit softmax."""
    w, b = blk.attn.in_proj_weight, blk.attn.in_proj_bias
    d = x.shape[-1]
    h = blk.ln_1(x)
    a_q, b_q, a_v, b_v = lora
    q = h @ w[:d].T + b[:d] + scale * (h @ a_q.T) @ b_q.T
    k = h @ w[d:2 * d].T + b[d:2 * d]
    v = h @ w[2 * d:].T + b[2 * d:] + scale * (h @ a_v.T) @ b_v.T
    heads = blk.attn.num_heads
    hd = d // heads
    outs = []
    for i in range(heads):
        s = slice(i * hd, (i + 1) * hd)
        att = torch.softmax((q[..., s] * hd ** -0.5) @ k[..., s].transpose(-1, -2), dim=-1)
        outs.append(att @ v[..., s])
    o = torch.cat(outs, -1) @ blk.attn.out_proj.weight.T + blk.attn.out_proj.bias
    x = x + o
    return x + blk.mlp(blk.ln_2(x))


def ref_encode(model, images, lora, scale):
    """CLIP's vision forward written out: patches, class token, positions, ln_pre, blocks (LoRA on the last 3),
    ln_post of the class token, projection; L2-normalised."""
    vis = model.model.visual
    x = vis.conv1(images).flatten(2).transpose(1, 2)
    x = torch.cat([vis.class_embedding.expand(len(x), 1, -1), x], 1) + vis.positional_embedding
    x = vis.ln_pre(x)
    blocks = list(vis.transformer.resblocks)
    for i, blk in enumerate(blocks):
        j = i - (len(blocks) - 3)
        x = blk(x) if j < 0 else ref_attention(blk, x, lora[j], scale)
    f = vis.ln_post(x[:, 0]) @ vis.proj
    return f / f.norm(dim=-1, keepdim=True)


def ref_ttl_sample(model, images, text, lora0, *, tta_steps=1, lr=5e-3):
    """One sample: `LoRA_reset`, a fresh AdamW, tta_steps x DeYO steps of mean_i H_i / exp(H_i - 0.4) over the views
    with H_i <= ln 1000, then the prediction on the original view."""
    lora = [[torch.nn.Parameter(p.clone()) for p in ab] for ab in lora0]
    opt = torch.optim.AdamW([{"params": [p]} for ab in lora for p in ab], lr=lr)
    for _ in range(tta_steps):
        for _ in range(tta_steps):
            out = model.logit_scale * ref_encode(model, images, lora, 2.0) @ text.T
            ent = -(out.softmax(1) * out.log_softmax(1)).sum(1)
            ent = ent[torch.where(ent <= math.log(1000))]
            coeff = 1 / torch.exp(ent.clone().detach() - 0.4)
            loss = ent.mul(coeff).mean(0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return model.logit_scale * ref_encode(model, images[:1], lora, 2.0)[0] @ text.T


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("tta_steps", [1, 2])
def test_matches_official_loop(deep_model, tta_steps):
    text, pixels = data(2, v=16, seed=1)
    m = make(deep_model, text, pixels, n_views=16, tta_steps=tta_steps)
    assert m.first_lora == 1 and len(m.lora_init) == 3
    out = m.adapt(torch.zeros(2, 16, 16))  # the cached features are not read: TTL re-encodes the views
    ref = torch.stack([ref_ttl_sample(deep_model, pixels[i], text, m.lora_init, tta_steps=tta_steps)
                       for i in range(2)])
    torch.testing.assert_close(out, ref, rtol=0, atol=tuned_tol(deep_model.logit_scale, tta_steps ** 2))
    zs = deep_model.logit_scale * ref_encode(deep_model, pixels[:, 0], m.lora_init, 2.0) @ text.T
    assert (out - zs).abs().max() > 1e-3  # the update moved the prediction


def test_zero_step_is_the_frozen_encoder(deep_model):
    """B = 0: the adapted encoder is CLIP's own encode_image until a step is taken."""
    text, pixels = data(3, v=4, seed=2)
    m = make(deep_model, text, pixels, n_views=4, lr=0.0, weight_decay=0.0)
    with torch.no_grad():
        want = deep_model.logit_scale * F.normalize(deep_model.model.encode_image(pixels[:, 0]), dim=-1) @ text.T
    torch.testing.assert_close(m.adapt(torch.zeros(3, 4, 16)), want, rtol=0, atol=2 * FEAT_TOL * 37.5)


def test_lora_init_and_loss_by_hand(deep_model):
    text, pixels = data(1, v=4)
    m = make(deep_model, text, pixels, n_views=4)
    a_q, b_q, a_v, b_v = m.lora_init[0]
    assert a_q.shape == (16, 32) and torch.equal(b_q, torch.zeros(32, 16)) and not torch.equal(a_q, a_v)
    # xavier_normal_: std sqrt(2 / (fan_in + fan_out)) = sqrt(2 / 48); 3·16·32·2 draws
    draws = torch.cat([t.flatten() for ab in m.lora_init for t in (ab[0], ab[2])])
    assert abs(float(draws.std()) / math.sqrt(2 / 48) - 1) < 0.05
    z = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
    h = [math.log(2), -(torch.tensor([3.0, 0.0]).softmax(0) * torch.tensor([3.0, 0.0]).log_softmax(0)).sum().item()]
    want = sum(x * math.exp(0.4 - x) for x in h) / 2
    assert abs(float(m.loss(z)) - want) < 8 * EPS32
    assert make(deep_model, text, pixels, n_views=4, entropy_filter=0.1).loss(z) is None  # no view passes


def test_loss_scale_skips_non_finite_steps(deep_model, monkeypatch):
    """The CUDA GradScaler bookkeeping, emulated on the CPU: a non-finite step is skipped (the LoRA factors keep their
    start: the frozen encoder's row), halves the scale and is counted; each finite step counts towards growth."""
    text, pixels = data(3, v=4, seed=5)
    m = make(deep_model, text, pixels, n_views=4)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", enabled=False))
    real, calls = m.loss, []

    def poisoned(logits):
        calls.append(1)
        return real(logits) + (float("nan") if len(calls) == 1 else 0.0)

    monkeypatch.setattr(m, "loss", poisoned)
    first = m.adapt(torch.zeros(1, 4, 16))
    assert m.skipped_steps == 1 and m.loss_scale == {"scale": 500.0, "growth_tracker": 0}
    frozen = make(deep_model, text, pixels, n_views=4, lr=0.0, weight_decay=0.0).adapt(torch.zeros(1, 4, 16))
    assert torch.equal(first, frozen)
    m.adapt(torch.zeros(2, 4, 16))
    assert m.summary() == {"skipped_steps": 1, "loss_scale": 500.0} and m.loss_scale["growth_tracker"] == 2


def test_batched_calls_and_resume_read_their_own_positions(deep_model):
    text, pixels = data(5, v=4, seed=3)
    whole = make(deep_model, text, pixels, n_views=4).adapt(torch.zeros(5, 4, 16))
    m = make(deep_model, text, pixels, n_views=4)
    head = m.adapt(torch.zeros(2, 4, 16))
    again = make(deep_model, text, pixels, n_views=4)
    again.load_state_dict(m.state_dict())
    rest = again.adapt(torch.zeros(3, 4, 16))
    torch.testing.assert_close(torch.cat([head, rest]), whole, rtol=0, atol=0)


def test_resnet_backbone_is_refused_in_one_line(tiny_rn_model):
    with pytest.raises(ValueError, match=r"ttl adapts the attention of a ViT image encoder .* RN50 has a "
                                         r"ModifiedResNet image encoder") as e:
        TTL(TTL.default_config("dtd", "RN50"), torch.eye(K, 16), 100.0, backbone="RN50", dataset="dtd",
            text_encoder=tiny_rn_model)
    assert "\n" not in str(e.value)


def test_runner_views_are_the_encoding_pass_views(tmp_path, tiny_model):
    """The pixels TTL reads give, through the frozen encoder, the features the encoding pass cached."""
    import numpy as np

    from extract.datasets import load_testset
    from extract.run.encode import FeatureReader, encode_pass, open_feature_cache
    from extract.run.pixels import ViewImages
    from extract.run.stream import stream_permutation

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=2)
    ts = load_testset("dtd", tmp_path / "data")
    perm = stream_permutation("dtd", 1, len(ts.labels))
    cache = open_feature_cache(tmp_path / "cache", tiny_model, "dtd", "k", 1, perm, 16, 4)
    encode_pass(tiny_model, ts, perm, cache, "crop_flip", 3, seed=1, batch_size=64)
    cached = FeatureReader(cache, "crop_flip").get(0, 3)  # (3, 64, 16)
    images = ViewImages(tiny_model, ts, perm, "crop_flip", 1).get(0, 3)
    assert images.shape == (3, 64, 3, 32, 32)
    feats = tiny_model.encode_images(images.flatten(0, 1)).reshape(3, 64, -1).numpy()
    np.testing.assert_allclose(feats, cached, rtol=0, atol=float(FEAT_TOL))


def test_views_are_read_one_sample_at_a_time(deep_model):
    """`adapt` reads each sample's views alone (a call of 64 samples of 64 views at 224 px would hold 2.5 GB of
    pixels at once), and the rows equal those of single-sample calls."""
    text, pixels = data(3, v=4, seed=4)
    m = make(deep_model, text, pixels, n_views=4)
    asked = []
    m.attach_views(lambda a, b: asked.append((a, b)) or pixels[a:b])
    rows = m.adapt(torch.zeros(3, 4, 16))
    assert asked == [(0, 1), (1, 2), (2, 3)]
    one = make(deep_model, text, pixels, n_views=4)
    torch.testing.assert_close(torch.cat([one.adapt(torch.zeros(1, 4, 16)) for _ in range(3)]), rows, rtol=0, atol=0)
