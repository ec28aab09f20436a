"""DART (extract/methods/dart.py) on the tiny open_clip model, against a slow transcription of the official loop
(DART `main.py`: `test_time_adapt_eval`, `test_time_tuning`; `clip/my_clip_CSTP.py`: `init_text_prompts`,
`get_text_features`, `inference` with prefix tuning; `utils/ema.py`) written here from docs/methods.md,
"DART (`dart`)"; the views' pixels through the run (`consumes = "view_pixels"`)."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from extract.methods import REGISTRY
from extract.methods.base import HPARAMS_KEYS, IMAGENET_FAMILY
from extract.methods.dart import DART, dart_prompt

from tests.support.extract import interrupt_nth_write, make_json_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ("cat", "sea lion", "Annual Crop Land", "dog", "a")
K = len(NAMES)
EPS32 = torch.finfo(torch.float32).eps


def zs_text(model) -> torch.Tensor:
    return model.encode_texts([f"a photo of a {n}." for n in NAMES])


def views(model, n: int, v: int = 64, seed: int = 0) -> torch.Tensor:
    """(n, v, 3, S, S) random 'preprocessed views' (the method reads pixels, not cached features)."""
    g = torch.Generator().manual_seed(seed)
    s = model.model.visual.image_size[0] if isinstance(model.model.visual.image_size, tuple) else 32
    return torch.randn(n, v, 3, s, s, generator=g)


def make(model, pixels: torch.Tensor, **changes) -> DART:
    cfg = dataclasses.replace(DART.default_config("dtd", "ViT-B-16"), image_prompt_layer=0,
                              n_views=pixels.shape[1], **changes)
    m = DART(cfg, zs_text(model), model.logit_scale, backbone="tiny", dataset="dtd", text_encoder=model,
             class_names=NAMES)
    m.attach_views(lambda a, b: pixels[a:b])
    return m


def run(m: DART, n: int, v: int) -> torch.Tensor:
    """`adapt` fed the right number of dummy features (the method reads its pixels itself)."""
    return m.adapt(torch.zeros(n, v, m.dim))


# ------------------------------------------------------------------------------------------ slow reference

def avg_entropy(outputs):
    logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
    avg = logits.logsumexp(dim=0) - np.log(logits.shape[0])
    avg = torch.clamp(avg, min=torch.finfo(avg.dtype).min)
    return -(avg * torch.exp(avg)).sum(dim=-1)


def select_confident(logits, top):
    ent = -(logits.softmax(1) * logits.log_softmax(1)).sum(1).detach()
    idx = sorted(range(len(ent)), key=lambda i: (float(ent[i]), i))[:int(len(ent) * top)]
    return logits[idx]


class RefDART:
    """DART's `ClipTestTimeTuning` and loop, line by line, on the open_clip modules (batch-first): per-class text
    context at tokens 1..n_ctx, prefix tuning in one block through the block's own attention module, a fresh
    AdamW per sample, `Text_EMA` / `Image_EMA` in mode `one_weight` / 4."""

    def __init__(self, model, image_prompt: torch.Tensor, layer: int, n_ctx: int = 4) -> None:
        m = model.model
        self.m, self.layer, self.scale = m, layer, model.logit_scale
        self.tokens = model.tokenizer([dart_prompt("a_photo_of_a_CLS", n) for n in NAMES])
        x = m.token_embedding(self.tokens).detach()
        self.begin, self.cls, self.end = x[:, :1], x[:, n_ctx + 1:n_ctx + 2], x[:, n_ctx + 2:]
        self.a_init = x[:, 1:n_ctx + 1].clone()
        self.a = torch.nn.Parameter(self.a_init.clone())
        self.image_prompts = torch.nn.Parameter(image_prompt.clone()[None, None])  # (1, 1, 2, W)
        self.opt = torch.optim.AdamW([self.a, self.image_prompts], 5e-3)
        self.optim_state = copy.deepcopy(self.opt.state_dict())
        self.text_shadow = self.a.data.clone()
        self.image_shadow = self.image_prompts.data.unsqueeze(0).repeat(K, 1, 1, 1, 1)

    def text_features(self):
        x = torch.cat((self.begin, self.a, self.cls, self.end), dim=1) + self.m.positional_embedding
        x = self.m.transformer(x, attn_mask=self.m.attn_mask)
        x = self.m.ln_final(x)
        return x[torch.arange(x.shape[0]), self.tokens.argmax(dim=-1)] @ self.m.text_projection

    def image_features(self, images):
        v = self.m.visual
        with torch.no_grad():
            x = v.conv1(images).reshape(len(images), v.conv1.out_channels, -1).permute(0, 2, 1)
            x = torch.cat([v.class_embedding + torch.zeros(len(x), 1, x.shape[-1]), x], dim=1)
            x = x + v.positional_embedding
        x = v.ln_pre(x)
        for layer, blk in enumerate(v.transformer.resblocks):
            q = blk.ln_1(x)
            if layer == self.layer:
                p = self.image_prompts.repeat(len(x), 1, 1, 1)[:, 0]  # (N, 2, W)
                k = torch.cat([q[:, :1], p[:, :1], q[:, 1:]], 1)
                val = torch.cat([q[:, :1], p[:, 1:], q[:, 1:]], 1)
                x = x + blk.attn(q, k, val, need_weights=False)[0]
            else:
                x = x + blk.attn(q, q, q, need_weights=False)[0]
            x = x + blk.mlp(blk.ln_2(x))
        return v.ln_post(x[:, 0]) @ v.proj

    def model(self, images):
        x = self.image_features(images)
        x = x / x.norm(dim=-1, keepdim=True)
        t = self.text_features()
        t = t / t.norm(dim=1, keepdim=True)
        return self.scale * x @ t.t()

    def __call__(self, images):
        with torch.no_grad():
            self.a.copy_(self.a_init)
            self.a.copy_(0.1 * self.text_shadow + (1.0 - 0.1) * self.a.data)
        self.opt.load_state_dict(self.optim_state)
        output = select_confident(self.model(images), 0.1)
        loss = avg_entropy(output)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        output_1 = torch.mean(select_confident(self.model(images), 0.1), dim=0)
        pred = int(output_1.argmax())
        with torch.no_grad():
            self.image_prompts.copy_(0.1 * self.image_shadow[pred] + (1.0 - 0.1) * self.image_prompts.data)
            output = self.model(images[:1])
        pred, weight = int(output.argmax()), float(output.max())
        d = math.exp(-weight / 5000)
        self.text_shadow[pred] = d * self.text_shadow[pred] + (1.0 - d) * self.a.data[pred]
        self.image_shadow[pred] = d * self.image_shadow[pred] + (1.0 - d) * self.image_prompts.data
        return output[0]


# ------------------------------------------------------------------------------------------ tests

def test_prompt_text_keeps_the_official_quirk(tiny_model):
    """`ctx_init.replace("_", " ")` is overwritten by `.replace("-", " ")`: the context tokens are "a _ photo _"."""
    assert dart_prompt("a_photo_of_a_CLS", "sea lion") == "a_photo_of_a_sea lion"
    tok = tiny_model.tokenizer(["a_photo_of_a_x"])[0]
    assert tok[1:5].tolist() == tiny_model.tokenizer(["a _ photo _"])[0][1:5].tolist()


@pytest.mark.parametrize("v", [64, 10])
def test_matches_the_official_loop(tiny_model, v):
    """Rows and state over 8 samples against the transcription, bit for bit: with the full text sequences
    (`text_shortcuts=False`) the method runs the reference's modules, and its written-out prefix block the
    operations `nn.MultiheadAttention` evaluates for a separate key and value (the q, k, v slices of the packed
    projection, `scaled_dot_product_attention`, the output projection), in the same order on the same shapes."""
    x = views(tiny_model, 8, v=v, seed=v)
    m = make(tiny_model, x, text_shortcuts=False)
    ref = RefDART(tiny_model, m.image_prompt, layer=0)
    start = m.image_prompt.clone()
    for i in range(8):
        assert torch.equal(run(m, 1, v)[0], ref(x[i])), i
    assert torch.equal(m.image_prompt, ref.image_prompts.detach()[0, 0])
    assert torch.equal(m.text_shadow, ref.text_shadow) and torch.equal(m.image_shadow, ref.image_shadow[:, 0, 0])
    assert not torch.equal(m.text_shadow, m.text_init) and not torch.equal(m.image_prompt, start)


def test_shortcuts_equal_the_full_sequences(tiny_model):
    """The execution-only truncation changes the rows by rounding only: each sample adds at most 2 FEAT_TOL·scale
    (a unit text feature within 32 eps32 over the tiny tower's width 32) and carries the earlier samples' (TPT's
    `tuned_tol`)."""
    x = views(tiny_model, 6, v=10, seed=6)
    a, b = run(make(tiny_model, x), 6, 10), run(make(tiny_model, x, text_shortcuts=False), 6, 10)
    torch.testing.assert_close(a, b, rtol=0, atol=(2 + 2 * 6) * 32 * EPS32 * tiny_model.logit_scale)


def test_chunked_equals_one_at_a_time_and_resume(tiny_model, tmp_path):
    """Samples run one at a time inside `adapt`: any chunking gives the same rows bit for bit; the state after a
    prefix, saved and loaded into a fresh instance, continues exactly."""
    x = views(tiny_model, 7, v=10, seed=3)
    whole = run(make(tiny_model, x), 7, 10)
    m = make(tiny_model, x)
    assert torch.equal(torch.cat([run(m, 3, 10), run(m, 3, 10), run(m, 1, 10)]), whole)
    first = make(tiny_model, x)
    head = run(first, 4, 10)
    torch.save(first.state_dict(), tmp_path / "s.pt")
    second = make(tiny_model, x)
    second.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    second.n_seen = 4
    assert torch.equal(torch.cat([head, run(second, 3, 10)]), whole)


def test_loss_scale_skips_non_finite_steps(tiny_model, monkeypatch):
    """A non-finite step is skipped (neither prompt moves), halves the scale and is counted; the averages still
    take the sample's prediction."""
    x = views(tiny_model, 3, v=10, seed=4)
    m = make(tiny_model, x)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", enabled=False))
    real = m._confident
    calls = {"n": 0}

    def poisoned(logits):
        calls["n"] += 1
        return real(logits) + (float("nan") if calls["n"] == 1 else 0.0)

    monkeypatch.setattr(m, "_confident", poisoned)
    shadow = m.text_shadow.clone()
    run(m, 1, 10)
    assert m.skipped_steps == 1 and m.loss_scale == {"scale": 500.0, "growth_tracker": 0}
    # no step: the context stayed at its start 0.1·shadow + 0.9·init = shadow (shadow = init so far), so the
    # average moved only by the rounding of those two blends (a few eps32 of the token embeddings)
    torch.testing.assert_close(m.text_shadow, shadow, rtol=4 * EPS32, atol=0)
    run(m, 2, 10)
    assert m.summary() == {"skipped_steps": 1, "loss_scale": 500.0}


def test_autocast_code_path_emulated_on_cpu(tiny_model, monkeypatch):
    """The CUDA path (autocast + loss scale) has no dtype mismatches: emulated with CPU bfloat16 autocast."""
    x = views(tiny_model, 4, v=10, seed=5)
    m = make(tiny_model, x)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    out = run(m, 4, 10)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and m.image_prompt.dtype == torch.float32
    assert m.text_shadow.dtype == torch.float32 and m.loss_scale == {"scale": 1000.0, "growth_tracker": 4}


def test_default_configs_and_errors(tiny_model):
    for ds in HPARAMS_KEYS:
        cfg = DART.default_config(ds, "ViT-B-16")
        assert (cfg.n_views, cfg.lr, cfg.weight_decay, cfg.tta_steps, cfg.selection_p, cfg.n_ctx) == (
            64, 5e-3, 0.01, 1, 0.1, 4)
        assert (cfg.text_ema_w, cfg.text_ema_h, cfg.image_ema_w, cfg.image_ema_h, cfg.image_prompt_layer) == (
            0.1, 5000.0, 0.1, 5000.0, 1)
        assert cfg.augmix == (ds not in IMAGENET_FAMILY) and cfg.template == "a_photo_of_a_CLS" and not cfg.episodic
    assert REGISTRY["dart"] is DART and DART.consumes == "view_pixels"
    x = views(tiny_model, 1, v=10)
    with pytest.raises(ValueError, match="image_prompt_layer=1 is out of range"):  # the tiny model has 1 block
        DART(dataclasses.replace(DART.default_config("dtd", "ViT-B-16"), n_views=10), zs_text(tiny_model),
             tiny_model.logit_scale, backbone="tiny", dataset="dtd", text_encoder=tiny_model, class_names=NAMES)
    with pytest.raises(ValueError, match="no 'CLS'"):
        make(tiny_model, x, template="a photo of a")
    with pytest.raises(ValueError, match="needs the views' pixels"):
        m = make(tiny_model, x)
        m._views = None
        run(m, 1, 10)


def test_resnet_backbone_is_refused_in_one_line(tiny_rn_model):
    with pytest.raises(ValueError, match=r"dart prompts the attention of a ViT image encoder .* RN50 has a "
                                         r"ModifiedResNet image encoder; use a ViT backbone") as e:
        DART(DART.default_config("dtd", "RN50"), torch.eye(K, 16), 100.0, backbone="RN50", dataset="dtd",
             text_encoder=tiny_rn_model, class_names=NAMES)
    assert "\n" not in str(e.value)


def test_run_reads_pixels_and_resumes_equal_to_an_uninterrupted_run(tmp_path, tiny_model, monkeypatch):
    """Through the run: the views' pixels are attached (the same views as the encoding pass), the default image
    prompt layer is lowered to the tiny model's one block with a note, and an interrupted run resumes to the
    uninterrupted rows bit for bit (the online state is rebuilt by replaying the kept prefix)."""
    import json

    from extract.run import writer
    from extract.runner import run_extraction
    from schemas.shard import read_shard, validate_shard

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=4)
    kw = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=tiny_model, progress=False,
              part_size=4, adapt_batch=2, chunk_size=5, batch_size=16)
    full_paths = run_extraction("dart", "dtd", out=tmp_path / "full", **kw)
    assert len(full_paths) == 3 and all(validate_shard(p) == [] for p in full_paths)
    meta = read_shard(full_paths[0]).meta
    assert meta.method_config["image_prompt_layer"] == 0
    assert any(w.startswith("dart on tiny-clip: image_prompt_layer=0") for w in json.loads(
        meta.extra["zaec:warnings"]))
    full = np.concatenate([read_shard(p).tta_logits for p in full_paths])
    real_write = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_extraction("dart", "dtd", out=tmp_path / "r", **kw)
    monkeypatch.setattr(writer, "write_shard", real_write)
    resumed = np.concatenate([read_shard(p).tta_logits for p in run_extraction("dart", "dtd", out=tmp_path / "r",
                                                                                **kw)])
    np.testing.assert_array_equal(resumed, full)
    assert not np.allclose(full, np.concatenate([read_shard(p).zs_logits for p in full_paths]))
