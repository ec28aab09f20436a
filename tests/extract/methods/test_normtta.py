"""The core the normalisation-layer methods share (extract/methods/normtta.py): the copy configured as the official
ports configure it, and the CUDA path (autocast, GradScaler) of every method emulated on the CPU: it runs, its rows
are finite float32, the scaler's state is saved and loaded with the method's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from extract.methods.batclip import BATCLIP
from extract.methods.deyo import DeYO
from extract.methods.normtta import configure_norms
from extract.methods.sar import SAR
from extract.methods.tent import Tent
from tests.support.normtta import emulate_cuda, image_size, pixel_stream, run_batches, text_prototypes

pytestmark = pytest.mark.usefixtures("one_thread")


def test_configure_norms_as_the_official_ports(tiny_rn_model):
    """Eval mode, everything frozen, every BatchNorm2d on batch statistics (its buffers gone), the chosen layers'
    weight and bias trainable."""
    import copy

    visual = copy.deepcopy(tiny_rn_model.model.visual)
    visual.train()
    trained = configure_norms(visual, lambda name: not name.startswith("layer4"))
    bns = [m for m in visual.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert not visual.training and all(m.running_mean is None and not m.track_running_stats for m in bns)
    names = {n for n, _ in trained}
    assert names and all(not n.startswith("layer4") and n.rsplit(".", 1)[1] in ("weight", "bias") for n in names)
    assert {n for n, p in visual.named_parameters() if p.requires_grad} == names


@pytest.mark.parametrize("cls", [Tent, SAR, DeYO, BATCLIP])
@pytest.mark.parametrize("model_fixture", ["tiny_model", "tiny_rn_model"])
def test_cuda_path_emulated(cls, model_fixture, request, monkeypatch, tmp_path):
    loaded = request.getfixturevalue(model_fixture)
    emulate_cuda(monkeypatch, cls)
    pixels = pixel_stream(8, image_size(loaded), dtype=torch.float32)
    text = text_prototypes(5, 16, dtype=torch.float32)
    changes = {"deyo_margin": 1.0, "plpd_threshold": -1.0} if cls is DeYO else {}

    def build():
        import dataclasses

        cfg = dataclasses.replace(cls.default_config("dtd", "ViT-B-16"), batch_size=4, **changes)
        m = cls(cfg, text, 37.5, backbone="tiny", dataset="dtd", text_encoder=SimpleNamespace(
            model=loaded.model, tokenizer=loaded.tokenizer), class_names=("a", "b", "c", "d", "e"))
        m.attach_pixels(lambda a, b: pixels[a:b])
        return m

    m = build()
    rows = run_batches(m, 8, 4, dtype=torch.float32)
    assert rows.dtype == torch.float32 and torch.isfinite(rows).all()
    state = m.state_dict()
    if cls is SAR:  # SAR's official loop has no loss scaler
        assert not m.scaler.is_enabled() and state["scaler"] == {}
    else:
        assert m.scaler.is_enabled() and state["scaler"]["scale"] == 1000.0 and state["scaler"]["_growth_tracker"] == 2
        torch.save(state, tmp_path / "s.pt")
        again = build()
        again.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
        assert again.scaler.state_dict() == m.scaler.state_dict()
