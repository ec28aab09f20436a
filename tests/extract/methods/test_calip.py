"""CALIP (extract/methods/calip.py, extract/methods/tokens.py) on small ViT and ResNet open_clip models, against a
slow transcription of the official code written here from
docs/methods.md, "CALIP: parameter-free attention between the token map and the text": `clip/model.py` (the token map: ViT l.218-233, the ResNet's attention pool with
every query kept l.66-89) and `run_imagenet.py` (the per-sample loop l.73-93 and the sum l.112-113)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from extract.methods.calip import CALIP, CALIPConfig
from extract.methods.tokens import token_map

from tests.support.tokens import LOGIT_SCALE, SIZE, deep_vit, tiny_rn

K, D = 4, 16
EPS64, EPS32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    """float64 copies (the comparisons with the transcription are then exact up to a few ulps) and float32 ones."""
    return {("vit", torch.float64): deep_vit(torch.float64, layers=3), ("rn", torch.float64): tiny_rn(torch.float64),
            ("vit", torch.float32): deep_vit(torch.float32, layers=3), ("rn", torch.float32): tiny_rn(torch.float32)}


def data(n: int, seed: int = 0, views: int = 1):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(K, D, generator=g), dim=-1), torch.randn(n, views, 3, SIZE, SIZE, generator=g)


def make(model, text, pixels, **changes) -> CALIP:
    cfg = dataclasses.replace(CALIP.default_config("imagenet", "tiny"), n_views=pixels.shape[1], **changes)
    m = CALIP(cfg, text, model.logit_scale, backbone="tiny", dataset="imagenet", text_encoder=model)
    m.attach_views(lambda a, b: pixels[a:b])
    return m


def tol(dtype: torch.dtype, cfg: CALIPConfig) -> float:
    """A logit's error: the encoder's few blocks of width <= 256 then two softmax attentions, each a reduction of
    at most 256 terms, on unit features, at scale 37.5 and weight 1 + beta2 + beta3."""
    eps = EPS64 if dtype == torch.float64 else EPS32
    return 8 * 256 * eps * LOGIT_SCALE * (1 + cfg.beta2 + cfg.beta3)


# ------------------------------------------------------------------------------------------ slow transcription

def ref_vit_tokens(visual, image):
    """CALIP's `VisionTransformer.forward` (`clip/model.py:218-233`) for one image: every token after ln_post and
    the projection (open_clip's blocks are batch first)."""
    x = visual.conv1(image[None])
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    x = torch.cat([visual.class_embedding + torch.zeros(1, 1, x.shape[-1], dtype=x.dtype), x], dim=1)
    x = visual.ln_pre(x + visual.positional_embedding)
    for blk in visual.transformer.resblocks:
        x = blk(x)
    return (visual.ln_post(x) @ visual.proj)[0]


def ref_rn_tokens(visual, image):
    """CALIP's `ModifiedResNet.forward` (`clip/model.py:134-149`) with its `AttentionPool2d.forward` returning
    every token (l.66-89), the multi-head attention written out head by head."""
    x = image[None]
    for conv, bn, act in ((visual.conv1, visual.bn1, visual.act1), (visual.conv2, visual.bn2, visual.act2),
                          (visual.conv3, visual.bn3, visual.act3)):
        x = act(bn(conv(x)))
    x = visual.avgpool(x)
    for layer in (visual.layer1, visual.layer2, visual.layer3, visual.layer4):
        x = layer(x)
    pool = visual.attnpool
    x = x.reshape(x.shape[1], -1).T  # (HW, C)
    x = torch.cat([x.mean(dim=0, keepdim=True), x]) + pool.positional_embedding
    q, k, v = pool.q_proj(x), pool.k_proj(x), pool.v_proj(x)
    heads, c = pool.num_heads, x.shape[1]
    hd = c // heads
    out = []
    for h in range(heads):
        s = slice(h * hd, (h + 1) * hd)
        att = torch.softmax((q[:, s] * hd ** -0.5) @ k[:, s].T, dim=-1)
        out.append(att @ v[:, s])
    return pool.c_proj(torch.cat(out, dim=1))


def ref_calip(model, kind, images, text, beta2, beta3):
    """`run_imagenet.py`: features normalised per token (l.52-53), global = token 0, spatial = the rest (D, L)
    (l.63-65); per sample A = 2 F_sᵀ T, the two softmaxes and the logits (l.77-89); logits + l1 β₂ + l2 β₃ (l.113)."""
    visual, scale = model.model.visual, model.logit_scale
    feat_t = text.T  # (D, K), as `text_encode`
    rows = []
    for image in images:
        tokens = (ref_vit_tokens if kind == "vit" else ref_rn_tokens)(visual, image)
        tokens = tokens / tokens.norm(dim=-1, keepdim=True)
        glob, feat_v = tokens[0], tokens[1:].permute(1, 0)
        a = torch.matmul(feat_v.permute(1, 0), feat_t) * 2
        a1, a2 = F.softmax(a, dim=0), F.softmax(a, dim=1)
        feat_t_a = torch.matmul(feat_v, a1)
        feat_v_a = torch.matmul(a2, feat_t.permute(1, 0))
        feat_v_a = feat_v_a.mean(0) + feat_v_a.max(0)[0]
        l1 = scale * glob @ feat_t_a
        l2 = scale * feat_v_a @ feat_t
        rows.append(scale * glob @ feat_t + l1 * beta2 + l2 * beta3)
    return torch.stack(rows)


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("kind", ["vit", "rn"])
@pytest.mark.parametrize("beta2,beta3", [(1.0, 0.01), (1.7, 0.35)])
def test_matches_the_official_computation(models, kind, beta2, beta3):
    model = models[(kind, torch.float64)]
    text, pixels = data(5, seed=1)
    m = make(model, text.double(), pixels, beta2=beta2, beta3=beta3)
    out = m.adapt(torch.zeros(5, 1, D))  # the cached features are not read: CALIP re-encodes view 0
    ref = ref_calip(model, kind, pixels[:, 0].double(), text.double(), beta2, beta3).float()
    torch.testing.assert_close(out, ref, rtol=0, atol=tol(torch.float64, m.config) + LOGIT_SCALE * 4 * EPS32)
    zs = LOGIT_SCALE * F.normalize(model.model.encode_image(pixels[:, 0].double()), dim=-1) @ text.double().T
    assert (out - zs.float()).abs().max() > 1e-2  # the attention terms move the logits


@pytest.mark.parametrize("kind", ["vit", "rn"])
def test_token_zero_is_the_pooled_feature(models, kind):
    """The global token is the model's own image feature: CALIP's first term is zero-shot CLIP with its prompts."""
    model = models[(kind, torch.float32)]
    _, pixels = data(3, seed=2)
    tokens = token_map(model.model.visual, pixels[:, 0])
    n_tokens = 1 + (SIZE // 8) ** 2 if kind == "vit" else 1 + (SIZE // 32) ** 2
    assert tokens.shape == (3, n_tokens, D)
    torch.testing.assert_close(tokens[:, 0], model.model.encode_image(pixels[:, 0]), rtol=0, atol=256 * EPS32 * 8)


@pytest.mark.parametrize("kind", ["vit", "rn"])
def test_without_the_attention_terms_it_is_zero_shot(models, kind):
    model = models[(kind, torch.float64)]
    text, pixels = data(4, seed=3)
    out = make(model, text.double(), pixels, beta2=0.0, beta3=0.0).adapt(torch.zeros(4, 1, D))
    zs = LOGIT_SCALE * F.normalize(model.model.encode_image(pixels[:, 0].double()), dim=-1) @ text.double().T
    torch.testing.assert_close(out, zs.float(), rtol=0, atol=LOGIT_SCALE * 4 * EPS32 + 1e-9)


@pytest.mark.parametrize("kind", ["vit", "rn"])
def test_batched_calls_equal_one_at_a_time_and_read_their_own_positions(models, kind):
    model = models[(kind, torch.float32)]
    text, pixels = data(7, seed=4, views=3)
    whole = make(model, text, pixels).adapt(torch.zeros(7, 3, D))
    m = make(model, text, pixels)
    asked = []
    m.attach_views(lambda a, b: asked.append((a, b)) or pixels[a:b])
    parts = torch.cat([m.adapt(torch.zeros(n, 3, D)) for n in (1, 4, 2)])
    assert asked == [(0, 1), (1, 5), (5, 7)]
    torch.testing.assert_close(parts, whole, rtol=0, atol=tol(torch.float32, m.config))
    # only view 0 is read: the other views' pixels change nothing
    other = pixels.clone()
    other[:, 1:] = 0
    torch.testing.assert_close(make(model, text, other).adapt(torch.zeros(7, 3, D)), whole, rtol=0, atol=0)


def test_settings_and_refusals():
    cfg = CALIP.default_config("caltech101", "RN50")
    assert (cfg.n_views, cfg.prompts, cfg.beta2, cfg.beta3, cfg.attn_scale) == (1, "dataset", 1.0, 0.01, 2.0)
    assert CALIP.unseen_config("ViT-B-16").prompts == "imagenet80"
    with pytest.raises(ValueError, match="attn_scale=0.0 is out of range"):
        CALIPConfig(attn_scale=0.0)

    class Odd(torch.nn.Module):
        visual = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"calip reads the token map of a ViT or ResNet image encoder; odd has a "
                                         r"Linear image encoder") as e:
        CALIP(cfg, torch.eye(K, D), 100.0, backbone="odd", dataset="dtd", text_encoder=Odd())
    assert "\n" not in str(e.value)
    m = CALIP(cfg, torch.eye(K, D), 100.0, backbone="x", dataset="dtd", text_encoder=tiny_rn())
    with pytest.raises(ValueError, match="needs the views' pixels"):
        m.adapt(torch.zeros(1, 1, D))


# ------------------------------------------------------------------------------------------ through the run

@pytest.fixture(scope="module")
def folder_set(tmp_path_factory):
    """A `folder:` set of 3 classes x 3 images, and `local-dir:` folders of the small ViT and ResNet."""
    import numpy as np

    from tests.support.extract import write_image
    from tests.support.tokens import rn_cfg, vit_cfg, write_model_dir

    root = tmp_path_factory.mktemp("calip-run")
    rng = np.random.default_rng(0)
    for c in ("cat_a", "dog_b", "eel_c"):
        for i in range(3):
            write_image(root / "set" / c / f"{i}.png", rng)
    return {"set": root / "set", "vit": write_model_dir(root / "vit", vit_cfg(3), "tiny-deep-vit"),
            "rn": write_model_dir(root / "rn", rn_cfg(), "tiny-rn")}


@pytest.mark.parametrize("kind", ["vit", "rn"])
def test_zaec_extract_on_a_folder_set(tmp_path, folder_set, kind):
    """`zaec-extract --method calip` on a user's folder set: its settings for unseen data; with β₂ = β₃ = 0 and the
    method's prompts as the anchor, the adapted rows are the zero-shot rows (token 0 of the run's pixels is the
    feature the encoding pass cached)."""
    import numpy as np
    from typer.testing import CliRunner

    from extract.cli import app
    from schemas.shard import find_shards, read_shard

    base = ["--method", "calip", "--dataset", f"folder:{folder_set['set']}", "--cache-dir", str(tmp_path / "cache"),
            "--pretrained", f"local-dir:{folder_set[kind]}", "--device", "cpu", "--quiet"]
    r = CliRunner().invoke(app, base + ["--out", str(tmp_path / "a")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "a"])
    s = read_shard(path)
    assert len(s) == 9 and s.meta.method_config["prompts"] == "imagenet80" and s.meta.method_config["beta2"] == 1.0
    assert (s.tta_logits != s.zs_logits).any()
    r = CliRunner().invoke(app, base + ["--out", str(tmp_path / "b"), "--set", "beta2=0", "--set", "beta3=0",
                                        "--anchor", "method"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "b"])
    s = read_shard(path)
    np.testing.assert_allclose(s.tta_logits, s.zs_logits, rtol=0, atol=8 * 256 * EPS32 * LOGIT_SCALE)


@pytest.mark.parametrize("kind", ["vit", "rn"])
def test_reduced_precision_path_emulated_on_cpu(models, kind):
    """The encoder under autocast (fp16 on CUDA, `encoder_autocast`) has no dtype mismatch down the method: emulated
    with CPU bfloat16 autocast around the call; rows stay finite float32 and mostly agree with fp32."""
    model = models[(kind, torch.float32)]
    text, pixels = data(12, seed=6)
    want = make(model, text, pixels).adapt(torch.zeros(12, 1, D))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = make(model, text, pixels).adapt(torch.zeros(12, 1, D))
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.8


def test_resume_after_interruption_reads_only_the_rest(tmp_path, folder_set, monkeypatch):
    """CALIP has no state: a resumed run loads the empty state of its last kept part (it is episodic) and encodes
    only the positions after it; the shards equal an uninterrupted run's."""
    import numpy as np

    from extract.models import load_model
    from extract.run import writer as run_writer
    from extract.runner import run_extraction
    from schemas.shard import find_shards

    from tests.support.extract import interrupt_nth_write, shard_columns

    model = load_model(None, f"local-dir:{folder_set['vit']}", "cpu")
    args = dict(cache_dir=tmp_path / "cache", model=model, part_size=4, adapt_batch=2, progress=False)
    dataset = f"folder:{folder_set['set']}"

    def rows(out):
        return shard_columns(find_shards([out]), ("stream_pos", "zs_logits", "tta_logits"))

    run_extraction("calip", dataset, out=tmp_path / "full", **args)
    real = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_extraction("calip", dataset, out=tmp_path / "r", **args)
    monkeypatch.setattr(run_writer, "write_shard", real)
    asked = []
    original = CALIP.view0_pixels
    monkeypatch.setattr(CALIP, "view0_pixels", lambda self, start, n, *a: asked.append(start) or original(
        self, start, n, *a))
    run_extraction("calip", dataset, out=tmp_path / "r", **args)
    assert asked == [4, 6, 8]  # part 0 (positions 0-3) kept, never re-encoded
    full, resumed = rows(tmp_path / "full"), rows(tmp_path / "r")
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])
