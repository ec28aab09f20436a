"""Tent on CLIP (extract/methods/tent.py) against a slow transcription of TTABC's loop (`tests/support/normtta.py`
`ref_tent`, from `ttabc/model_selection/tent.py`), on the tiny ViT (LayerNorms) and the tiny RN (BatchNorms on batch
statistics); its state across batches, the shared model left as loaded, and the CUDA path (fp16 autocast and the
GradScaler) emulated on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from extract.methods.tent import Tent
from tests.support.normtta import emulate_cuda, resumed_rows, image_size, make_method, pixel_stream, ref_tent, run_batches, text_prototypes

pytestmark = pytest.mark.usefixtures("one_thread")

N, B, K = 10, 4, 5  # 10 positions in batches of 4: the last batch holds 2


def inputs(model):
    return pixel_stream(N, image_size(model)), text_prototypes(K, model.text_projection.shape[1])


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("predict", ["after_update", "adapting_forward"])
def test_matches_the_official_loop(tiny_model64, steps, predict):
    """Rows of every batch equal TTABC's loop (AdamW lr 5e-3, weight decay 1e-4 on the norm layers' affine
    parameters; BatchNorm on batch statistics), carried across batches; the same float64 operations in the same
    order, hence equal."""
    pixels, text = inputs(tiny_model64)
    m = make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B, steps=steps, predict=predict)
    got = run_batches(m, N, B)
    want = ref_tent(tiny_model64, pixels, text, 37.5, B, steps=steps, after_update=predict == "after_update")
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    assert m.summary()["steps"] == steps * 3 and m.summary()["skipped_steps"] == 0


def test_adaptation_changes_the_rows_and_zero_steps_is_zero_shot(tiny_model64):
    pixels, text = inputs(tiny_model64)
    adapted = run_batches(make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B), N, B)
    frozen = run_batches(make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B, steps=0), N, B)
    assert not torch.equal(adapted, frozen)
    # steps=0: no update; on the ViT (no batch statistics) the rows are the frozen encoder's
    if not hasattr(tiny_model64.visual, "layer1"):
        feats = tiny_model64.visual(pixels)
        zs = 37.5 * feats / feats.norm(dim=-1, keepdim=True) @ text.t()
        torch.testing.assert_close(frozen, zs.float(), rtol=0, atol=1e-5)


def test_the_shared_model_is_left_as_loaded(tiny_model64):
    """The method adapts a copy: the model the zero-shot rows and the feature cache read keeps every parameter and
    buffer (RN50's running statistics included), and its requires_grad flags."""
    before = {k: v.clone() for k, v in tiny_model64.state_dict().items()}
    flags = {n: p.requires_grad for n, p in tiny_model64.named_parameters()}
    pixels, text = inputs(tiny_model64)
    run_batches(make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B), N, B)
    after = tiny_model64.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert flags == {n: p.requires_grad for n, p in tiny_model64.named_parameters()}


def test_trained_parameters_per_backbone(tiny_model, tiny_rn_model):
    """ViT: every LayerNorm's weight and bias (ln_pre, each block's ln_1/ln_2, ln_post); RN: every BatchNorm's."""
    text = text_prototypes(K, 16, dtype=torch.float32)
    vit = make_method(Tent, tiny_model, pixel_stream(2, 32, dtype=torch.float32), text, 37.5)
    names = [n for n, _ in vit.named_params]
    assert names == ["ln_pre.weight", "ln_pre.bias", "transformer.resblocks.0.ln_1.weight",
                     "transformer.resblocks.0.ln_1.bias", "transformer.resblocks.0.ln_2.weight",
                     "transformer.resblocks.0.ln_2.bias", "ln_post.weight", "ln_post.bias"]
    rn = make_method(Tent, tiny_rn_model, pixel_stream(2, 64, dtype=torch.float32), text, 37.5)
    bns = [n for n, mod in rn.visual.named_modules() if isinstance(mod, torch.nn.BatchNorm2d)]
    assert [n for n, _ in rn.named_params] == [f"{b}.{w}" for b in bns for w in ("weight", "bias")]
    assert all(mod.running_mean is None for mod in rn.visual.modules() if isinstance(mod, torch.nn.BatchNorm2d))


def test_state_resume_equals_uninterrupted(tiny_model64, tmp_path):
    """The state after some batches (parameters, AdamW moments, counters), saved with torch.save and loaded with
    weights_only=True into a fresh method, continues the stream exactly."""
    pixels, text = inputs(tiny_model64)

    def build():
        return make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B)

    _, _, rows = resumed_rows(build, N, B, 8, tmp_path / "state.pt")
    torch.testing.assert_close(rows, run_batches(build(), N, B), rtol=0, atol=0)


def test_a_state_without_its_parameters_is_one_line(tiny_model64):
    """A state file of Tent that lacks what `state_dict` saves (another version's) is refused in one line."""
    pixels, text = inputs(tiny_model64)
    m = make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B)
    state = m.state_dict()
    del state["optimizer"], state["scaler"]
    with pytest.raises(ValueError, match="^tent state lacks optimizer, scaler$"):
        make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B).load_state_dict(state)


def test_a_call_wider_than_the_batch_is_refused(tiny_model):
    m = make_method(Tent, tiny_model, pixel_stream(8, 32, dtype=torch.float32),
                    text_prototypes(K, 16, dtype=torch.float32), 37.5, batch_size=2)
    with pytest.raises(ValueError, match="more than its batch_size 2"):
        m.adapt(torch.zeros(3, 1, 16))
    unattached = Tent(dataclasses.replace(Tent.default_config("dtd", "RN50")), text_prototypes(K, 16), 37.5,
                      backbone="tiny", dataset="dtd", text_encoder=tiny_model)
    with pytest.raises(ValueError, match="attach_pixels"):
        unattached.adapt(torch.zeros(1, 1, 16, dtype=torch.float64))


def test_cuda_path_emulated_matches_the_official_amp_loop(tiny_model, monkeypatch):
    """Under the emulated CUDA path the method is the official step: the batch's forward under autocast, the loss
    scaled by a GradScaler(init_scale=1000) created once per run, unscaled and stepped; the transcription with the
    same autocast and scaler gives the same rows."""
    emulate_cuda(monkeypatch, Tent)
    model = tiny_model.model
    pixels, text = pixel_stream(N, 32, dtype=torch.float32), text_prototypes(K, 16, dtype=torch.float32)
    m = make_method(Tent, model, pixels, text, 37.5, batch_size=B)
    got = run_batches(m, N, B, dtype=torch.float32)
    from tests.support.normtta import configured_copy, norm_forward, softmax_entropy, adamw

    ref, params = configured_copy(model)
    opt, scaler = adamw(params), torch.amp.GradScaler("cpu", init_scale=1000.0)
    want = []
    for s in range(0, N, B):
        images = pixels[s:s + B]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = softmax_entropy(norm_forward(ref, images, text, 37.5)).mean(0)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want.append(norm_forward(ref, images, text, 37.5).float())
    torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=0)
    assert m.summary()["loss_scale"] == 1000.0 and m.state_dict()["scaler"]["_growth_tracker"] == 3


def test_cuda_path_skips_a_non_finite_step_and_halves_the_scale(tiny_model, monkeypatch):
    emulate_cuda(monkeypatch, Tent)
    pixels = pixel_stream(4, 32, dtype=torch.float32)
    pixels[1, 0, 0, 0] = float("inf")  # the batch's loss and gradient are not finite
    m = make_method(Tent, tiny_model.model, pixels, text_prototypes(K, 16, dtype=torch.float32), 37.5,
                    batch_size=4)
    before = [p.detach().clone() for p in m.params]
    m.adapt(torch.zeros(4, 1, 16))
    assert m.summary() == {"steps": 1, "skipped_steps": 1, "loss_scale": 500.0}
    assert all(torch.equal(a, p) for a, p in zip(before, m.params))


def test_amp_is_cuda_only(tiny_model):
    m = make_method(Tent, tiny_model.model, pixel_stream(2, 32, dtype=torch.float32),
                    text_prototypes(K, 16, dtype=torch.float32), 37.5)
    assert not m._use_amp(torch.device("cpu")) and m._use_amp(torch.device("cuda"))
    assert not m.scaler.is_enabled() and m.summary()["loss_scale"] == 1.0


def test_a_batchnorm_batch_of_one_value_per_channel_is_one_line():
    """An RN whose last stage is 1 x 1 (32 px input) cannot normalise a batch of one image with batch statistics
    (torch refuses, as in the official code); the message says why in one line."""
    import open_clip

    rn = open_clip.CLIP(embed_dim=16, vision_cfg={"image_size": 32, "layers": [1, 1, 1, 1], "width": 8},
                        text_cfg={"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1})
    m = make_method(Tent, rn, pixel_stream(1, 32, dtype=torch.float32), text_prototypes(K, 16, dtype=torch.float32),
                    37.5)
    with pytest.raises(ValueError, match=r"tent: the image encoder's BatchNorms .* a batch of 1 image\(s\) leaves "
                                         r"one value per channel"):
        m.adapt(torch.zeros(1, 1, 16))
