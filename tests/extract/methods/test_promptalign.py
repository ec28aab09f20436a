"""PromptAlign (extract/methods/promptalign.py, extract/promptalign_stats.py) on a tiny open_clip CLIP with 4
vision blocks and 3 text layers, tiny random MaPLe prompts and statistics (tests/support/second_models.py), against
a slow transcription of the official code written here from docs/methods.md,
"PromptAlign: MaPLe prompts aligned to ImageNet's token statistics": MaPLe's towers in PromptAlign's clip/model.py
(sequence-first, attention written out per head), `MultiModalPromptLearner`, `test_time_tuning`,
`select_confident_samples`, `avg_entropy`, `distr_align_loss`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.methods.promptalign import PromptAlign, load_maple, load_stats, read_checkpoint
from schemas.shard import read_shard

from tests.support.extract import make_json_dataset
from tools.second_models import maple_shapes, write_maple, write_stats

NAMES = ("cat", "sea_lion", "Annual Crop Land", "dog", "a")
K = len(NAMES)
DEPTH, TEXT_LAYERS = 4, 3
EPS32 = torch.finfo(torch.float32).eps
FEAT_TOL = (DEPTH + TEXT_LAYERS) * 32 * EPS32  # unit features through 7 blocks of width 32

pytestmark = pytest.mark.usefixtures("one_thread")


def tuned_tol(scale: float, steps: int) -> float:
    """(2 + 2·steps)·FEAT_TOL·scale, as tests/support/tpt.py `tuned_tol` argues for AdamW steps."""
    return (2 + 2 * steps) * FEAT_TOL * scale


@pytest.fixture(scope="module")
def model():
    """A tiny open_clip CLIP (4 vision blocks: depth-3 prompts and 2 aligned layers fit; 3 text layers: the deep
    text prompts enter), logit scale 37.5, loaded as a LoadedModel on the CPU."""
    import open_clip

    from extract.models import LoadedModel, Preprocess

    torch.manual_seed(0)
    cfg = {"embed_dim": 16, "quick_gelu": True,
           "vision_cfg": {"image_size": 32, "layers": DEPTH, "width": 32, "head_width": 16, "patch_size": 8},
           "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": TEXT_LAYERS}}
    m = open_clip.CLIP(**cfg).eval().requires_grad_(False)
    with torch.no_grad():
        m.logit_scale.fill_(math.log(37.5))
    tok = open_clip.get_tokenizer("ViT-B-16", context_length=32)
    return LoadedModel(m, tok, "tiny-deep", "none", "tiny-deep", True, Preprocess((32, 32), (0.5,) * 3, (0.25,) * 3),
                       37.5, torch.device("cpu"), "fp32", "x")


@pytest.fixture(scope="module")
def files(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("promptalign")
    maple = write_maple(root / "seed1" / "MultiModalPromptLearner" / "model.pth.tar-2", model)
    means, variances = write_stats(root / "stats" / "tiny", model)
    return {"maple_weights": str(maple), "vis_means": str(means), "vis_vars": str(variances)}


def make(model, files, pixels, dataset="dtd", **changes) -> PromptAlign:
    cfg = dataclasses.replace(PromptAlign.default_config(dataset, "ViT-B-16"), **files, **changes)
    text = model.encode_texts([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])
    m = PromptAlign(cfg, text, model.logit_scale, backbone="tiny-deep", dataset=dataset, text_encoder=model,
                    class_names=NAMES)
    m.attach_views(lambda a, b: pixels[a:b])
    return m


# ------------------------------------------------------------------------------------------ slow transcription

def ref_block(blk, x, mask=None):
    """A CLIP residual attention block on sequence-first tokens (L, N, W): ln_1, q·k per head scaled by
    head_dim^-0.5 (+ the causal mask), softmax, v, out_proj; ln_2, the MLP."""
    w, b = blk.attn.in_proj_weight, blk.attn.in_proj_bias
    d = x.shape[-1]
    h = blk.ln_1(x)
    q, k, v = h @ w[:d].T + b[:d], h @ w[d:2 * d].T + b[d:2 * d], h @ w[2 * d:].T + b[2 * d:]
    heads = blk.attn.num_heads
    hd = d // heads
    outs = []
    for i in range(heads):
        s = slice(i * hd, (i + 1) * hd)
        att = (q[..., s].permute(1, 0, 2) * hd ** -0.5) @ k[..., s].permute(1, 2, 0)  # (N, L, L)
        if mask is not None:
            att = att + mask
        outs.append((att.softmax(-1) @ v[..., s].permute(1, 0, 2)).permute(1, 0, 2))
    x = x + torch.cat(outs, -1) @ blk.attn.out_proj.weight.T + blk.attn.out_proj.bias
    return x + blk.mlp(blk.ln_2(x))


class RefLearner(torch.nn.Module):
    """`MultiModalPromptLearner` holding MaPLe's prompts (loaded as `load_model` + `set_prompt_inits` would)."""

    def __init__(self, state, depth):
        super().__init__()
        n, wt = state["prompt_learner.ctx"].shape
        wv = state["prompt_learner.proj.weight"].shape[0]
        self.ctx = torch.nn.Parameter(state["prompt_learner.ctx"].clone())
        self.proj = torch.nn.Linear(wt, wv)
        self.compound_prompts_text = torch.nn.ParameterList(
            [torch.nn.Parameter(state[f"prompt_learner.compound_prompts_text.{i}"].clone()) for i in range(depth - 1)])
        self.compound_prompt_projections = torch.nn.ModuleList([torch.nn.Linear(wt, wv) for _ in range(depth - 1)])
        with torch.no_grad():
            self.proj.weight.copy_(state["prompt_learner.proj.weight"])
            self.proj.bias.copy_(state["prompt_learner.proj.bias"])
            for i, lin in enumerate(self.compound_prompt_projections):
                lin.weight.copy_(state[f"prompt_learner.compound_prompt_projections.{i}.weight"])
                lin.bias.copy_(state[f"prompt_learner.compound_prompt_projections.{i}.bias"])


def ref_text(model, learner):
    """`TextEncoder.forward` with MaPLe's prompts: the first n_ctx words replaced by ctx, the deep prompts at the
    context positions of layers 1..J-1, the end-of-text token through ln_final and the projection."""
    m = model.model
    n = learner.ctx.shape[0]
    tokens = model.tokenizer([f"a photo of a {c.replace('_', ' ')}." for c in NAMES])
    emb = m.token_embedding(tokens)
    x = torch.cat([emb[:, :1], learner.ctx.expand(K, -1, -1), emb[:, 1 + n:]], 1) + m.positional_embedding
    x = x.permute(1, 0, 2)
    for i, blk in enumerate(m.transformer.resblocks):
        if 1 <= i <= len(learner.compound_prompts_text):
            ctx = learner.compound_prompts_text[i - 1].expand(K, -1, -1).permute(1, 0, 2)
            x = torch.cat([x[:1], ctx, x[1 + n:]], 0)
        x = ref_block(blk, x, m.attn_mask)
    x = m.ln_final(x.permute(1, 0, 2))
    x = x[torch.arange(K), tokens.argmax(-1)] @ m.text_projection
    return x / x.norm(dim=-1, keepdim=True)


def ref_image(model, learner, images):
    """`VisionTransformer_MaPLe.forward`, recording each block's `visual_feat` (its input after the replacement)."""
    v = model.model.visual
    n = learner.ctx.shape[0]
    x = v.conv1(images).reshape(len(images), v.conv1.out_channels, -1).permute(0, 2, 1)
    x = torch.cat([v.class_embedding + torch.zeros(len(images), 1, x.shape[-1]), x], 1) + v.positional_embedding
    x = torch.cat([x, learner.proj(learner.ctx).expand(len(images), -1, -1)], 1)
    x = v.ln_pre(x).permute(1, 0, 2)
    feats = []
    for i, blk in enumerate(v.transformer.resblocks):
        if 1 <= i <= len(learner.compound_prompts_text):
            deep = learner.compound_prompt_projections[i - 1](learner.compound_prompts_text[i - 1])
            x = torch.cat([x[:x.shape[0] - n], deep.expand(x.shape[1], -1, -1).permute(1, 0, 2)], 0)
        feats.append(x)
        x = ref_block(blk, x)
    f = v.ln_post(x.permute(1, 0, 2)[:, 0]) @ v.proj
    return f / f.norm(dim=-1, keepdim=True), feats


def ref_promptalign_sample(model, state, means, variances, images, *, lr, steps=1, depth=3, w=100.0, lo=0, hi=3):
    """`test_time_tuning` + the inference of `test_time_adapt_eval` for one sample, fp32."""
    learner = RefLearner(state, depth)
    opt = torch.optim.AdamW(learner.parameters(), lr)
    sel = None
    for _ in range(steps):
        img, feats = ref_image(model, learner, images)
        output = model.logit_scale * img @ ref_text(model, learner).T
        if sel is not None:
            output = output[sel]
        else:
            z = output.detach()
            ents = [float(-(z[v].softmax(0) * z[v].log_softmax(0)).sum()) for v in range(len(z))]
            order = [v for _, v in sorted((e, v) for v, e in enumerate(ents))]
            idx_tpt, sel = order[:int(len(output) * 0.1)], order[:int(len(output) * 0.1)]
            output = output[idx_tpt]
        logits = output - output.logsumexp(dim=-1, keepdim=True)
        avg = logits.logsumexp(dim=0) - np.log(logits.shape[0])
        loss = -(avg * torch.exp(avg)).sum(dim=-1)
        mean = torch.cat([torch.mean(f[:, sel, :], dim=1, keepdim=True).permute(1, 0, 2) for f in feats])
        var = torch.cat([torch.mean((f[:, sel, :] - mean[i].unsqueeze(0).permute(1, 0, 2)) ** 2, dim=1,
                                    keepdim=True).permute(1, 0, 2) for i, f in enumerate(feats)])
        distr = 0
        for layer in range(lo, hi - 1):
            distr += 0.5 * F.l1_loss(mean[layer], means[layer]) + 0.5 * F.l1_loss(var[layer], variances[layer])
        loss = loss + w / (hi - lo) * distr
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        img, _ = ref_image(model, learner, images[:1])
        return model.logit_scale * img[0] @ ref_text(model, learner).T


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("dataset, steps", [("dtd", 1), ("imagenet_a", 1), ("dtd", 2)])
def test_matches_the_official_loop(model, files, dataset, steps):
    cfg = dataclasses.replace(PromptAlign.default_config(dataset, "ViT-B-16"), **files, tta_steps=steps)
    pixels = torch.randn(2, 64, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    m = make(model, files, pixels, dataset=dataset, tta_steps=steps)
    got = m.adapt(torch.zeros(2, 64, 16))  # the cached features are not read: both towers are prompted
    state = read_checkpoint(files["maple_weights"])
    means = torch.load(files["vis_means"], weights_only=True)
    variances = torch.load(files["vis_vars"], weights_only=True)
    want = torch.stack([ref_promptalign_sample(model, state, means, variances, pixels[i], lr=cfg.lr, steps=steps)
                        for i in range(2)])
    torch.testing.assert_close(got, want, rtol=0, atol=tuned_tol(model.logit_scale, steps))
    with torch.no_grad():
        start = torch.stack([model.logit_scale * ref_image(model, RefLearner(state, 3), pixels[i, :1])[0][0]
                             @ ref_text(model, RefLearner(state, 3)).T for i in range(2)])
    assert (got - start).abs().max() > 1e-4  # the step moved the prediction


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autocast fp16 and the loss scale run only on CUDA")
def test_cuda_mixed_precision_close_to_fp32(model, files):
    import copy

    gpu = copy.copy(model)
    gpu.model = copy.deepcopy(model.model).cuda()
    gpu.device = torch.device("cuda")
    pixels = torch.randn(2, 64, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    ref = make(model, files, pixels, lr=0.0, weight_decay=0.0).adapt(torch.zeros(2, 64, 16))
    still = make(gpu, files, pixels.cuda(), lr=0.0, weight_decay=0.0).adapt(torch.zeros(2, 64, 16, device="cuda"))
    # fp16 activations through 7 blocks of width 32: ~10 fp16 eps of the largest logit
    torch.testing.assert_close(still.cpu(), ref, rtol=0, atol=0.01 * float(ref.abs().max()))
    m = make(gpu, files, pixels.cuda())
    out = m.adapt(torch.zeros(2, 64, 16, device="cuda"))
    assert torch.isfinite(out).all() and m.loss_scale["growth_tracker"] + m.skipped_steps == 2


def test_loss_scale_skips_non_finite_steps(model, files, monkeypatch):
    """The CUDA GradScaler bookkeeping, emulated on the CPU: a non-finite step is skipped (MaPLe's prompts unchanged),
    halves the scale and is counted; each finite step counts towards growth."""
    pixels = torch.randn(3, 64, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    m = make(model, files, pixels)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", enabled=False))
    real, calls = m.loss, []

    def poisoned(logits, tokens, sel):
        calls.append(1)
        loss, sel = real(logits, tokens, sel)
        return loss + (float("nan") if len(calls) == 1 else 0.0), sel

    monkeypatch.setattr(m, "loss", poisoned)
    first = m.adapt(torch.zeros(1, 64, 16))
    assert m.skipped_steps == 1 and m.loss_scale == {"scale": 500.0, "growth_tracker": 0}
    still = make(model, files, pixels, lr=0.0, weight_decay=0.0).adapt(torch.zeros(1, 64, 16))
    assert torch.equal(first, still)
    m.adapt(torch.zeros(2, 64, 16))
    assert m.summary() == {"skipped_steps": 1, "loss_scale": 500.0} and m.loss_scale["growth_tracker"] == 2


def test_alignment_term_matters(model, files):
    pixels = torch.randn(1, 64, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with_align = make(model, files, pixels).adapt(torch.zeros(1, 64, 16))
    without = make(model, files, pixels, distr_align=False).adapt(torch.zeros(1, 64, 16))
    assert not torch.allclose(with_align, without)


def test_defaults_are_the_official_configs():
    dg, fine = PromptAlign.default_config("imagenet_r", "ViT-B-16"), PromptAlign.default_config("dtd", "ViT-B-16")
    assert (dg.lr, fine.lr) == (4e-2, 5e-4)
    assert (dg.n_views, dg.augmix, dg.tta_steps, dg.tpt_threshold, dg.align_threshold, dg.distr_loss_w,
            dg.align_layer_from, dg.align_layer_to, dg.n_ctx, dg.prompt_depth, dg.ctx_init, dg.tpt_loss,
            dg.distr_align) == (64, False, 1, 0.1, 0.1, 100.0, 0, 3, 2, 3, "a photo of a", True, True)
    assert (dg.maple_weights, dg.vis_means, dg.vis_vars) == ("", "", "")
    with pytest.raises(ValueError, match="no loss"):
        dataclasses.replace(dg, tpt_loss=False, distr_align=False)


# ------------------------------------------------------------------------------------------ the files

@pytest.mark.parametrize("fmt", ["dassl", "state_dict", "safetensors"])
def test_checkpoint_formats_give_the_same_prompts(model, tmp_path, fmt):
    path = write_maple(tmp_path / f"maple.{'safetensors' if fmt == 'safetensors' else 'pth.tar'}", model,
                           fmt=fmt)
    wt, wv, _ = maple_shapes(model)
    got = load_maple(str(path), n_ctx=2, depth=3, text_width=wt, vision_width=wv)
    ref = load_maple(str(write_maple(tmp_path / "ref.safetensors", model, fmt="safetensors")), n_ctx=2, depth=3,
                     text_width=wt, vision_width=wv)
    assert all(torch.equal(a, b) for a, b in zip(got.params(), ref.params())) and len(got.params()) == 9
    if fmt == "dassl":  # what a dassl checkpoint needs: weights_only alone refuses its pickled scheduler
        import pickle

        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)


class Sneaky:
    """A class a checkpoint may name: unpickling it for real would run its `__setstate__` (here: touch a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __setstate__(self, state):
        open(state["marker"], "w").close()


def test_a_checkpoint_runs_none_of_its_code(tmp_path):
    import os

    marker = tmp_path / "ran"
    path = tmp_path / "sneaky.pth.tar"
    torch.save({"state_dict": {"prompt_learner.ctx": torch.zeros(2, 4)}, "scheduler": Sneaky(marker)}, path)
    assert list(read_checkpoint(str(path))) == ["prompt_learner.ctx"] and not marker.exists()

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save({"state_dict": {"prompt_learner.ctx": torch.zeros(2, 4)}, "scheduler": Evil()}, path)
    with pytest.raises(ValueError, match="not a readable safetensors or torch checkpoint") as e:
        read_checkpoint(str(path))  # torch refuses the module outright: never run, one line
    assert "\n" not in str(e.value) and not marker.exists()


@pytest.mark.parametrize("change, needle", [
    ({"n_ctx": 3}, "has shape (2, 32), this model and n_ctx=3 need (3, 32)"),
    ({"depth": 4}, "no tensor prompt_learner.compound_prompts_text.2"),
    ({"depth": 2}, "its prompt depth exceeds prompt_depth=2")])
def test_a_checkpoint_that_does_not_fit_is_one_line(model, files, change, needle):
    wt, wv, _ = maple_shapes(model)
    kw = {"n_ctx": 2, "depth": 3, "text_width": wt, "vision_width": wv, **change}
    with pytest.raises(ValueError) as e:
        load_maple(files["maple_weights"], **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_statistics_of_the_wrong_shape_are_one_line(model, files, tmp_path):
    _, wv, n_img = maple_shapes(model)
    assert load_stats(files["vis_means"], "vis_means", (2, n_img + 2, wv)).shape == (DEPTH, n_img + 2, wv)
    torch.save(torch.zeros(2, n_img, wv), tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"vis_vars .*bad\.pt: expected one \(layers >= 2, 19, 32\)"):
        load_stats(str(tmp_path / "bad.pt"), "vis_vars", (2, n_img + 2, wv))


def test_rn_backbones_are_refused_in_one_line(files, tiny_rn_model):
    with pytest.raises(ValueError, match="promptalign prompts the tokens of a ViT image encoder"):
        PromptAlign(dataclasses.replace(PromptAlign.default_config("dtd", "RN50"), **files),
                    torch.zeros(K, 16), 37.5, backbone="RN50", dataset="dtd", text_encoder=tiny_rn_model,
                    class_names=NAMES)


# ------------------------------------------------------------------------------------------ the statistics command

def test_stats_command_computes_the_token_moments(model, files, tmp_path, tiny_model_dir, tiny_model):
    from extract.datasets import load_testset, open_image
    from extract.promptalign_stats import main
    from extract.views import ViewGenerator

    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=2, per_class=3)
    maple = write_maple(tmp_path / "maple.pth.tar", tiny_model, depth=1)
    with pytest.raises(SystemExit) as e:
        main(["--maple-weights", str(maple), "--dataset", "dtd", "--data-root", str(root), "--out",
              str(tmp_path / "out" / "tiny"), "--pretrained", f"local-dir:{tiny_model_dir}", "--prompt-depth", "1",
              "--batch-size", "4", "--device", "cpu"])
    assert e.value.code in (0, None)
    means = torch.load(tmp_path / "out" / "tiny_vis_means.pt", weights_only=True)
    variances = torch.load(tmp_path / "out" / "tiny_vis_vars.pt", weights_only=True)
    # the slow way: each image's view 0 through the prompted tower, all tokens of the one block, moments over images
    ts = load_testset("dtd", root)
    gen = ViewGenerator(tiny_model.preprocess, "single")
    images = torch.stack([gen.original(open_image(p)) for p in ts.paths])
    state = read_checkpoint(str(maple))
    with torch.no_grad():
        _, feats = ref_image(tiny_model, RefLearner(state, 1), images)  # (T, N, W) per block
    tokens = torch.stack([f.permute(1, 0, 2) for f in feats], 1).double()  # (N, blocks, T, W)
    torch.testing.assert_close(means.double(), tokens.mean(0), rtol=0, atol=1e-5)
    torch.testing.assert_close(variances.double(), tokens.var(0, unbiased=False), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ runs

def test_resume_equals_uninterrupted(tmp_path, tiny_model, tiny_externals, monkeypatch):
    from extract.run import writer
    from extract.runner import run_extraction

    from tests.support.extract import interrupt_nth_write

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=2)
    over = tiny_externals.overrides("promptalign")

    def run(out):
        return run_extraction("promptalign", "dtd", data_root=tmp_path / "data", out=tmp_path / out,
                              cache_dir=tmp_path / "cache", model=tiny_model, progress=False, adapt_batch=2,
                              part_size=2, overrides=over)

    full = np.concatenate([read_shard(p).tta_logits for p in run("full")])
    real = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run("r")
    monkeypatch.setattr(writer, "write_shard", real)
    resumed = np.concatenate([read_shard(p).tta_logits for p in run("r")])
    assert full.shape == (6, 3) and np.isfinite(full).all()
    np.testing.assert_array_equal(resumed, full)
