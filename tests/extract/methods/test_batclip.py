"""BATCLIP (extract/methods/batclip.py) against a slow transcription of `classification/methods/ours.py` with its
losses (`tests/support/normtta.py` `ref_batclip`) on the tiny ViT and RN models: both encoders' norm layers adapt,
the text features are re-encoded every batch, the rows are the adapting forward's logits; resume."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from extract.methods.batclip import BATCLIP, i2t_loss, inter_mean_loss
from extract.prompts import SINGLE_TEMPLATE
from tests.support.normtta import resumed_rows, image_size, make_method, pixel_stream, ref_batclip, run_batches, text_prototypes

pytestmark = pytest.mark.usefixtures("one_thread")

N, B = 12, 4
NAMES = ("cat", "dog", "sea lion", "car", "tree")


@pytest.fixture(params=["vit", "rn"])
def loaded64(request, tiny_model, tiny_rn_model):
    """The tiny model in float64 with its tokenizer (what the runner passes as `text_encoder`)."""
    loaded = tiny_model if request.param == "vit" else tiny_rn_model
    return SimpleNamespace(model=copy.deepcopy(loaded.model).double(), tokenizer=loaded.tokenizer)


def build(loaded, pixels, **changes):
    import dataclasses

    cfg = dataclasses.replace(BATCLIP.default_config("dtd", "ViT-B-16"), batch_size=B, **changes)
    m = BATCLIP(cfg, text_prototypes(len(NAMES), 16), 37.5, backbone="tiny", dataset="dtd", text_encoder=loaded,
                class_names=NAMES)
    m.attach_pixels(lambda a, b: pixels[a:b])
    return m


def test_matches_the_official_loop(loaded64):
    pixels = pixel_stream(N, image_size(loaded64))
    got = run_batches(build(loaded64, pixels), N, B)
    tokens = loaded64.tokenizer([SINGLE_TEMPLATE.format(c) for c in NAMES])
    want = ref_batclip(loaded64.model, tokens, pixels, 37.5, B)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


def test_both_encoders_adapt_and_the_shared_model_does_not(loaded64):
    before = {k: v.clone() for k, v in loaded64.model.state_dict().items()}
    m = build(loaded64, pixel_stream(N, image_size(loaded64)))
    names = [n for n, _ in m.named_params]
    assert any(n.startswith("visual.") for n in names) and "ln_final.weight" in names
    assert any(n.startswith("transformer.resblocks.0.ln_1") for n in names)
    run_batches(m, N, B)
    assert all(torch.equal(before[k], v) for k, v in loaded64.model.state_dict().items())
    text_before = loaded64.model.encode_text(m.tokens)
    assert not torch.allclose(m.encoder.encode_text(m.tokens), text_before)


def test_losses_by_hand():
    """I2T: the mean over predicted classes of (mean image feature) · t̂; InterMean: Σ over ordered pairs of
    distinct predicted classes of 1 − cos of their normalised means."""
    logits = torch.tensor([[2.0, 0.0, 0.0], [3.0, 1.0, 0.0], [0.0, 0.0, 5.0]], dtype=torch.float64)
    feats = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
    # class 0: mean (2, 0) . (1, 0) = 2; class 2: mean (0, 2) . (0.6, 0.8) = 1.6
    assert float(i2t_loss(logits, feats, text)) == pytest.approx((2 + 1.6) / 2, abs=1e-12)
    # normalised means (1, 0) and (0, 1): cos 0, two ordered pairs
    assert float(inter_mean_loss(logits, feats)) == pytest.approx(2.0, abs=1e-12)


def test_state_resume_equals_uninterrupted(loaded64, tmp_path):
    pixels = pixel_stream(N, image_size(loaded64))
    _, _, rows = resumed_rows(lambda: build(loaded64, pixels), N, B, 8, tmp_path / "state.pt")
    torch.testing.assert_close(rows, run_batches(build(loaded64, pixels), N, B), rtol=0, atol=0)


def test_needs_class_names_and_the_tokenizer(tiny_model):
    with pytest.raises(ValueError, match="class names and the loaded model with its tokenizer"):
        make_method(BATCLIP, tiny_model.model, pixel_stream(2, 32), text_prototypes(5, 16), 37.5)
