"""Panda as a plug-in (extract/methods/panda.py): its negative images against a patch-by-patch transcription of the
official `batch_hedge_v6_images`; on Tent, SAR and DeYO against transcriptions of TTABC `panda.py` and
ruxideng/Panda's `SAR.py` / `DeYO.py` (tests/support/normtta.py); on TPT, ZERO and DMN against the method fed the
shifted features the official method files compute (f − β·m̄, m̄ the mean normalised feature of the negatives
through the frozen encoder)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from extract.methods import get_method
from extract.methods.deyo import DeYO
from extract.methods.panda import batch_generator, negative_images
from extract.methods.sar import SAR
from extract.methods.tent import Tent
from tests.support.extract import with_views
from tests.support.normtta import (image_size, make_method, pixel_stream, ref_deyo, ref_negatives, ref_sar, ref_tent,
                                   run_batches, text_prototypes)

pytestmark = pytest.mark.usefixtures("one_thread")

N, B, K = 12, 4, 5
PANDA = dict(panda=True, panda_beta=0.2, panda_patch_size=8, panda_seed=3)


@pytest.mark.parametrize("b, patch", [(4, 8), (23, 8), (4, 32), (4, 40), (2, 16)])
def test_negative_images_are_the_official_ones(b, patch):
    """M = ceil(B/10) images, each a base image whose tiled region takes every patch from another image; a patch
    larger than the image returns the batch itself (the official early return)."""
    batch = pixel_stream(b, 32)
    got = negative_images(batch, patch, batch_generator(3, 8))
    want = ref_negatives(batch, patch, batch_generator(3, 8))
    assert torch.equal(got, want)
    if patch <= 32:
        assert got.shape == (-(-b // 10), 3, 32, 32)
    assert negative_images(batch[:1], 8, batch_generator(0, 0)) is None  # one image: no other image to draw from


def test_tent_with_panda_matches_ttabc_panda(tiny_model64):
    pixels, text = pixel_stream(N, image_size(tiny_model64)), text_prototypes(K, 16)
    got = run_batches(make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B, **PANDA), N, B)
    want = ref_tent(tiny_model64, pixels, text, 37.5, B, panda=(0.2, 8, 3))
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    plain = run_batches(make_method(Tent, tiny_model64, pixels, text, 37.5, batch_size=B), N, B)
    assert not torch.equal(got, plain)


def test_sar_with_panda_matches_the_official_variant(tiny_model64):
    pixels, text = pixel_stream(N, image_size(tiny_model64)), text_prototypes(K, 16)
    m = make_method(SAR, tiny_model64, pixels, text, 37.5, batch_size=B, margin_e0=1.0, reset_constant_em=0.0, **PANDA)
    want, _ = ref_sar(tiny_model64, pixels, text, 37.5, B, margin_e0=1.0, reset_em=0.0, panda=(0.2, 8, 3))
    torch.testing.assert_close(run_batches(m, N, B), want.float(), rtol=0, atol=0)


def test_deyo_with_panda_matches_the_official_variant(tiny_model64):
    pixels, text = pixel_stream(N, image_size(tiny_model64)), text_prototypes(K, 16)
    kw = dict(batch_size=B, deyo_margin=1.0, plpd_threshold=-1.0)
    m = make_method(DeYO, tiny_model64, pixels, text, 37.5, **kw, **PANDA)
    want = ref_deyo(tiny_model64, pixels, text, 37.5, B, deyo_margin=1.0, plpd_threshold=-1.0, panda=(0.2, 8, 3))
    torch.testing.assert_close(run_batches(m, N, B), want.float(), rtol=0, atol=0)


def mean_negative(model, pixels, s, b, patch=8, seed=3):
    """m̄ of the batch at [s, s + b): the frozen encoder's normalised features of its negatives, averaged."""
    negatives = ref_negatives(pixels[s:s + b], patch, batch_generator(seed, s))
    with torch.no_grad():
        return F.normalize(model.encode_image(negatives), dim=-1).mean(0)


def feature_method(key, loaded, v, **changes):
    cls = get_method(key)
    cfg = with_views(cls.default_config("dtd", "ViT-B-16"), v, **changes)
    extra = {"class_names": ("cat", "dog", "sea lion", "car", "tree")} if cls.needs_text_encoder else {}
    return cls(cfg, text_prototypes(K, 16, dtype=torch.float32), 37.5, backbone="tiny", dataset="dtd",
               text_encoder=loaded, **extra)


@pytest.mark.parametrize("key, renormalize", [("zero", False), ("tpt", True)])
def test_panda_on_view_features(tiny_model, key, renormalize):
    """ZERO and TPT with Panda: the plain method on f − β·m̄ (ZERO, `Zero.py`) or its renormalisation (TPT: its CoOp
    model normalises, `TPT.py`), m̄ per batch of `panda_batch_size` test images."""
    v, n, pb = 8, 8, 4
    pixels = pixel_stream(n, 32, dtype=torch.float32)
    feats = F.normalize(torch.randn(n, v, 16, generator=torch.Generator().manual_seed(5)), dim=-1)
    panda = feature_method(key, tiny_model, v, **PANDA, panda_batch_size=pb)
    panda.attach_pixels(lambda a, b: pixels[a:b])
    assert type(panda).consumes_for(panda.config) == "batch_pixels" and type(panda).adapt_width(panda.config) == pb
    got = torch.cat([panda.adapt(feats[s:s + pb]) for s in range(0, n, pb)])
    plain = feature_method(key, tiny_model, v)
    shifted = []
    for s in range(0, n, pb):
        x = feats[s:s + pb] - 0.2 * mean_negative(tiny_model.model, pixels, s, pb)
        shifted.append(plain.adapt(F.normalize(x, dim=-1) if renormalize else x))
    torch.testing.assert_close(got, torch.cat(shifted), rtol=0, atol=0)


def test_panda_on_dmn_shifts_the_text_logits_only(tiny_model):
    """DMN with Panda (`DMN.py`): p_text from s·(x − β·m̄)·t̂ᵀ, the memory on the features themselves; with w = 0 the
    rows are log softmax of the shifted view-0 logits, and the memory holds the unshifted normalised features."""
    v, n, pb = 4, 8, 4
    pixels = pixel_stream(n, 32, dtype=torch.float32)
    feats = F.normalize(torch.randn(n, v, 16, generator=torch.Generator().manual_seed(5)), dim=-1)
    m = feature_method("dmn", tiny_model, v, mem_weight=0.0, **PANDA, panda_batch_size=pb)
    m.attach_pixels(lambda a, b: pixels[a:b])
    got = torch.cat([m.adapt(feats[s:s + pb]) for s in range(0, n, pb)])
    text = F.normalize(m.text_features, dim=-1)
    want = torch.cat([(37.5 * (feats[s:s + pb, 0] - 0.2 * mean_negative(tiny_model.model, pixels, s, pb))
                       @ text.T).log_softmax(-1) for s in range(0, n, pb)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    stored = m.memory[m.memory.norm(dim=-1) > 0]
    assert all(any(torch.allclose(row, f, atol=1e-6) for f in feats[:, 0]) for row in stored)


def test_panda_is_off_by_default_and_changes_nothing_then(tiny_model):
    for key in ("tpt", "zero", "dmn", "tent", "sar", "deyo"):
        cls = get_method(key)
        cfg = cls.default_config("dtd", "ViT-B-16")
        assert cfg.panda is False and cfg.panda_beta == 0.2 and cfg.panda_patch_size == 32
    assert get_method("tpt").consumes_for(get_method("tpt").default_config("dtd", "RN50")) == "features"


def _panda_methods() -> list[str]:
    from extract.methods import REGISTRY

    return [k for k, cls in REGISTRY.items() if hasattr(cls.default_config("dtd", "ViT-B-16"), "panda")]


@pytest.mark.parametrize("key", _panda_methods())
def test_panda_plans_on_its_hosts_and_is_refused_on_the_methods_that_inherit_it(key):
    """`--set panda=true` plans on Panda's hosts (TTABC's six and DMN-weak); a method that only inherits the fields
    from its parent (C-TPT, O-TPT, A-TPT, R-TPT, RLCF, DiffTPT from TPT's config) refuses it in one line at plan
    time, before any file is read (their extra features were never what Panda's shift was written for)."""
    from extract.methods.panda import PANDA_HOSTS
    from extract.run.options import RunError, RunOptions, plan

    options = RunOptions.make(key, "dtd", backbone="ViT-B-16", overrides={"panda": "true"})
    if key in PANDA_HOSTS:
        assert plan(options).config.panda
        return
    with pytest.raises(RunError) as refused:
        plan(options)
    assert str(refused.value).startswith(f"{key}: panda=true applies to tent, sar, deyo, tpt, zero, dmn, dmn-weak")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("key", _panda_methods())
def test_panda_settings_are_recorded_only_with_panda(key):
    """A host's recorded `method_config` without Panda holds no `panda*` key (what its finished runs recorded before
    Panda existed, so they still match); with `panda=true` it holds every one."""
    import dataclasses

    from extract.run.options import config_dict

    cfg = get_method(key).default_config("dtd", "ViT-B-16")
    names = {f.name for f in dataclasses.fields(cfg) if f.name.startswith("panda")}
    recorded = config_dict(cfg)
    assert not names & set(recorded) and set(recorded) == {f.name for f in dataclasses.fields(cfg)} - names
    on = config_dict(dataclasses.replace(cfg, panda=True, panda_beta=0.3))
    assert names <= set(on) and on["panda_beta"] == 0.3
