"""DeYO on CLIP (extract/methods/deyo.py) against a slow transcription of TTABC's loop (`tests/support/normtta.py`
`ref_deyo`, from `ttabc/model_selection/deyo.py`) on the tiny ViT and RN models: the entropy filter, the patch
shuffle, PLPD and its filter, the reweighting, the step skipped when nothing is kept; its statistics and resume."""

from __future__ import annotations


import pytest
import torch

from extract.methods.deyo import DeYO, DeYOConfig, shuffled
from extract.methods.panda import batch_generator
from tests.support.normtta import resumed_rows, image_size, make_method, pixel_stream, ref_deyo, ref_shuffle, run_batches, text_prototypes

pytestmark = pytest.mark.usefixtures("one_thread")

N, B, K = 12, 4, 5


def inputs(model):
    return pixel_stream(N, image_size(model)), text_prototypes(K, model.text_projection.shape[1])


@pytest.mark.parametrize("deyo_margin, plpd_threshold", [(0.5, 0.3), (1.0, -1.0), (1.0, 0.05)])
def test_matches_the_official_loop(tiny_model64, deyo_margin, plpd_threshold):
    """The defaults, every sample kept by both filters, and a PLPD threshold that keeps some."""
    pixels, text = inputs(tiny_model64)
    m = make_method(DeYO, tiny_model64, pixels, text, 37.5, batch_size=B, deyo_margin=deyo_margin,
                    plpd_threshold=plpd_threshold)
    got = run_batches(m, N, B)
    want = ref_deyo(tiny_model64, pixels, text, 37.5, B, deyo_margin=deyo_margin, plpd_threshold=plpd_threshold)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    s = m.summary()
    assert s["passed_plpd"] <= s["passed_entropy"] <= N and s["steps"] + s["empty_steps"] == N // B
    if plpd_threshold == -1.0:
        assert s["passed_plpd"] == s["passed_entropy"] == N and s["empty_steps"] == 0


def test_the_patch_shuffle_is_the_official_rearrangement():
    x = pixel_stream(3, 32)
    cfg = DeYOConfig(patch_len=4)
    got = shuffled(x, cfg, batch_generator(0, 8))
    torch.testing.assert_close(got, ref_shuffle(x, 4, batch_generator(0, 8)), rtol=0, atol=0)
    # 32 is a multiple of 4: both resizes leave the pixels as they are, which the shuffle only moves
    assert not torch.equal(got, x) and torch.equal(got.flatten(1).sort().values, x.flatten(1).sort().values)
    # a size that is not a multiple of patch_len goes through the two resizes
    y = pixel_stream(2, 30)
    torch.testing.assert_close(shuffled(y, cfg, batch_generator(1, 0)), ref_shuffle(y, 4, batch_generator(1, 0)),
                               rtol=0, atol=0)


def test_occlusion_and_pixel_shuffle():
    x = pixel_stream(2, 32)
    occ = shuffled(x, DeYOConfig(aug_type="occ", occlusion_size=8, row_start=4, column_start=20),
                   batch_generator(0, 0))
    want = x.clone()
    for b in range(2):
        for ch in range(3):
            want[b, ch, 4:12, 20:28] = x[b, ch].mean()
    torch.testing.assert_close(occ, want, rtol=0, atol=1e-15)
    pix = shuffled(x, DeYOConfig(aug_type="pixel"), batch_generator(0, 0))
    perm = torch.randperm(32 * 32, generator=batch_generator(0, 0))
    assert torch.equal(pix, x.reshape(2, 3, -1)[:, :, perm].reshape(2, 3, 32, 32))


def test_an_occlusion_beyond_the_image_is_refused(tiny_model):
    with pytest.raises(ValueError, match="aug_type=occ paints a 112-pixel square at \\(56, 56\\), beyond the "
                                         "model's 32-pixel images"):
        make_method(DeYO, tiny_model.model, pixel_stream(2, 32, dtype=torch.float32),
                    text_prototypes(K, 16, dtype=torch.float32), 37.5, aug_type="occ")


def test_state_resume_equals_uninterrupted(tiny_model64, tmp_path):
    pixels, text = inputs(tiny_model64)

    def build():
        return make_method(DeYO, tiny_model64, pixels, text, 37.5, batch_size=B, deyo_margin=1.0, plpd_threshold=-1.0)

    first, second, rows = resumed_rows(build, N, B, 8, tmp_path / "state.pt")
    assert first.summary()["passed_plpd"] == 8  # DeYO's statistics continue from the loaded state
    assert second.summary()["passed_plpd"] == N
    torch.testing.assert_close(rows, run_batches(build(), N, B), rtol=0, atol=0)
