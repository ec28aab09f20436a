"""The shared pieces of the per-batch encoder methods (extract/methods/norm_tuning.py): the copy at `clip.load`'s
precision against OpenAI's `convert_weights` written out, the layers each backbone tunes, the reset.
docs/methods.md, "The model, its precision and the layers tuned"."""

from __future__ import annotations

import copy

import pytest
import torch

from extract.methods.norm_tuning import TunedCLIP, fp16_weights, norm_kind, official_copy
from tests.support.norm_tuning import openai_fp16, pixels, tiny_loaded

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["vit", "rn"])
def test_fp16_copy_is_openai_conversion(family):
    """Every parameter and buffer in OpenAI's dtype, the same values, and the same forward (LayerNorms in fp32)."""
    model = tiny_loaded(family).model
    ours = official_copy(model, fp16=True)
    ref = openai_fp16(copy.deepcopy(model))
    a, b = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert a.keys() == b.keys()
    half = torch.float16
    assert {k for k, p in a.items() if p.dtype == half} == {k for k, p in b.items() if p.dtype == half}
    assert all(torch.equal(a[k], b[k]) for k in a) and not any(p.requires_grad for p in a.values())
    x = pixels(3)
    with torch.no_grad():
        assert torch.equal(ours.visual(x.half()), ref.visual(x.half()))
        tokens = torch.randint(1, 400, (2, 32))
        assert torch.equal(ours.encode_text(tokens), ref.encode_text(tokens))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the run's model is left as it was


def test_layers_tuned_per_backbone():
    """ViT: ln_pre, ln_1/ln_2 per block, ln_post; ResNet: every BatchNorm2d, on batch statistics only; nothing
    else trains."""
    vit, rn = tiny_loaded("vit").model, tiny_loaded("rn").model
    assert norm_kind(vit.visual) == "layernorm" and norm_kind(rn.visual) == "batchnorm"
    t = TunedCLIP.build(vit, "layernorm", fp16=False)
    assert len(t.params) == 2 * (2 + 2 * len(vit.visual.transformer.resblocks)) and not t.model.training
    assert {id(p) for p in t.model.parameters() if p.requires_grad} == {id(p) for p in t.params}
    t = TunedCLIP.build(rn, "batchnorm", fp16=False)
    bns = [m for m in t.model.visual.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 3 + 4 * 3 + 4 and len(t.params) == 2 * len(bns)  # stem, 4 bottlenecks, 4 downsamples
    assert all(m.running_mean is None and not m.track_running_stats for m in bns)
    assert {id(p) for p in t.model.parameters() if p.requires_grad} == {id(p) for p in t.params}
    with pytest.raises(ValueError, match="no layernorm layer to adapt"):
        TunedCLIP.build(rn, "layernorm", fp16=False)


def test_reset_restores_the_frozen_values():
    t = TunedCLIP.build(tiny_loaded("vit").model, "layernorm", fp16=False)
    before = t.snapshot()
    with torch.no_grad():
        for p in t.params:
            p.add_(1.0)
    t.reset()
    assert all(torch.equal(p, v) for p, v in zip(t.params, before))


def test_weights_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [fp16_weights(w, cpu) for w in ("official", "fp16", "fp32")] == [False, True, False]
    assert [fp16_weights(w, cuda) for w in ("official", "fp16", "fp32")] == [True, True, False]
