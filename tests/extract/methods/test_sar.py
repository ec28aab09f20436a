"""SAR on CLIP (extract/methods/sar.py) against a slow transcription of TTABC's loop with its SAM optimiser
(`tests/support/normtta.py` `ref_sar`, from `ttabc/model_selection/sar.py`) on the tiny ViT and RN models: the
reliable-sample filter, SAM's two steps, the entropy EMA and model recovery (whose SGD momentum survives, as the
official `SAM.load_state_dict` leaves it), the skipped layers, and resume."""

from __future__ import annotations


import pytest
import torch

from extract.methods.sar import SAR, official_skip
from tests.support.normtta import resumed_rows, image_size, make_method, pixel_stream, ref_sar, run_batches, text_prototypes

pytestmark = pytest.mark.usefixtures("one_thread")

N, B, K = 12, 4, 5


def inputs(model, seed=3):
    return pixel_stream(N, image_size(model), seed=seed), text_prototypes(K, model.text_projection.shape[1])


@pytest.mark.parametrize("margin_e0, reset_em", [(0.4, 0.2), (1.0, 0.0), (1.0, 10.0)])
def test_matches_the_official_loop(tiny_model64, margin_e0, reset_em):
    """The defaults; margin ln K (every sample passes) without recovery; and a threshold above every entropy (a
    model recovery after every batch)."""
    pixels, text = inputs(tiny_model64)
    m = make_method(SAR, tiny_model64, pixels, text, 37.5, batch_size=B, margin_e0=margin_e0, reset_constant_em=reset_em)
    got = run_batches(m, N, B)
    want, recoveries = ref_sar(tiny_model64, pixels, text, 37.5, B, margin_e0=margin_e0, reset_em=reset_em)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    assert m.summary()["recoveries"] == recoveries
    assert recoveries == {0.0: 0, 10.0: 3}.get(reset_em, recoveries)


def test_the_official_rule_skips_the_top_layers():
    """`layer4` (RN50's last stage), `blocks.9`-`blocks.11` (ViT-B/16's last three), `norm.` and `norm`, read on
    open_clip's names."""
    assert official_skip("layer4.0.bn1") and official_skip("transformer.resblocks.9.ln_1")
    assert official_skip("transformer.resblocks.11.ln_2") and not official_skip("transformer.resblocks.1.ln_2")
    assert not official_skip("ln_post") and not official_skip("transformer.resblocks.19.ln_1")
    assert not official_skip("layer3.0.bn3")


def test_trained_layers_on_rn(tiny_rn_model):
    m = make_method(SAR, tiny_rn_model.model, pixel_stream(2, 64, dtype=torch.float32),
                    text_prototypes(K, 16, dtype=torch.float32), 37.5)
    names = [n for n, _ in m.named_params]
    assert names and not any(n.startswith("layer4") for n in names)
    assert all(mod.running_mean is None for mod in m.visual.modules() if isinstance(mod, torch.nn.BatchNorm2d))


def test_state_resume_equals_uninterrupted(tiny_model64, tmp_path):
    """The state after two batches (parameters, SGD momentum, ema, counters) continues the stream exactly."""
    pixels, text = inputs(tiny_model64)

    def build():
        return make_method(SAR, tiny_model64, pixels, text, 37.5, batch_size=B, margin_e0=1.0, reset_constant_em=0.0)

    first, second, rows = resumed_rows(build, N, B, 8, tmp_path / "state.pt")
    assert first.ema is not None and second.ema is not None  # the ema of the first 8 positions, loaded
    torch.testing.assert_close(rows, run_batches(build(), N, B), rtol=0, atol=0)


def test_no_loss_scaler_on_the_cuda_path(tiny_model):
    m = make_method(SAR, tiny_model.model, pixel_stream(2, 32, dtype=torch.float32),
                    text_prototypes(K, 16, dtype=torch.float32), 37.5)
    assert not m.scaler.is_enabled() and m._use_amp(torch.device("cuda"))
