"""The view generator: view 0 = the model's preprocessing; augmented views seeded per (seed, sample_id)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from extract.models import Preprocess
from extract.views import (AUGMIX_OPS, N_AUG_VIEWS, ViewGenerator, random_resized_crop_box, reference_augmented,
                           view_policy)

PRE = Preprocess(size=(32, 32), mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
# the same uint8 pixels on both sides; /255, -mean, /std in float32 round values |v| <= 1/std by a few eps
PIXEL_TOL = 4 * torch.finfo(torch.float32).eps / min(PRE.std)


def _img(seed: int, size=(45, 37)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def test_view0_is_resize_centercrop_normalise():
    img = _img(0)
    gen = ViewGenerator(PRE, "single")
    # independent reference: PIL bicubic resize of the short side, centre crop, to [0,1], normalise
    w, h = img.size
    s = 32
    nw, nh = (s, int(s * h / w)) if w < h else (int(s * w / h), s)
    r = img.resize((nw, nh), Image.BICUBIC)
    left, top = int(round((nw - s) / 2.0)), int(round((nh - s) / 2.0))
    crop = np.asarray(r.crop((left, top, left + s, top + s)), dtype=np.float32) / 255.0
    want = (torch.from_numpy(crop).permute(2, 0, 1) - torch.tensor(PRE.mean)[:, None, None]) \
        / torch.tensor(PRE.std)[:, None, None]
    got = gen(img, sample_id=3)
    assert got.shape == (1, 3, 32, 32)
    torch.testing.assert_close(got[0], want, atol=PIXEL_TOL, rtol=0)


@pytest.mark.parametrize("policy", ["crop_flip", "augmix"])
def test_views_deterministic_per_seed_and_sample(policy):
    img = _img(1)
    a = ViewGenerator(PRE, policy, seed=7)
    b = ViewGenerator(PRE, policy, seed=7)
    v = a(img, sample_id=11)
    assert v.shape == (1 + N_AUG_VIEWS, 3, 32, 32) and v.dtype == torch.float32
    # other samples generated in between (another stream order / batching) change nothing
    b(img, sample_id=3)
    b(_img(2), sample_id=12)
    assert torch.equal(b(img, sample_id=11), v)
    assert not torch.equal(a(img, sample_id=12)[1:], v[1:])
    assert not torch.equal(ViewGenerator(PRE, policy, seed=8)(img, sample_id=11)[1:], v[1:])
    # view 0 never depends on the seed or the policy
    assert torch.equal(ViewGenerator(PRE, "single", seed=99)(img, 11)[0], v[0])
    # the 63 augmented views differ from each other
    flat = v[1:].reshape(N_AUG_VIEWS, -1)
    assert len({tuple(r[:50].tolist()) for r in flat}) == N_AUG_VIEWS


def test_crop_flip_views_are_pixel_crops_and_augmix_mixes():
    """crop+flip views take values on the 256-level grid of the normalised image; AugMix mixes leave it."""
    img = _img(3)
    mean, std = torch.tensor(PRE.mean)[:, None, None], torch.tensor(PRE.std)[:, None, None]
    cf = ViewGenerator(PRE, "crop_flip", seed=0)(img, 5)[1:] * std + mean
    am = ViewGenerator(PRE, "augmix", seed=0)(img, 5)[1:] * std + mean
    on_grid = lambda x: torch.allclose(x * 255, torch.round(x * 255), atol=1e-3)  # noqa: E731  (grid step 1 >> 1e-3)
    assert all(on_grid(v) for v in cf)
    assert sum(not on_grid(v) for v in am) > N_AUG_VIEWS // 2


def test_random_resized_crop_box_in_bounds_and_scale():
    rng = np.random.default_rng(0)
    fractions = []
    for _ in range(2000):
        w, h = int(rng.integers(5, 300)), int(rng.integers(5, 300))
        left, top, cw, ch = random_resized_crop_box(rng, w, h)
        assert 0 <= left and 0 <= top and 0 < cw and 0 < ch and left + cw <= w and top + ch <= h
        if w > 50 and h > 50:
            fractions.append(cw * ch / (w * h))
    f = np.array(fractions)
    assert f.min() > 0.05 and f.max() <= 1.0 and 0.35 < f.mean() < 0.65  # area fraction ~ U(0.08, 1)


def test_view_policy_and_bad_inputs():
    assert view_policy(1, True) == "single"
    assert view_policy(64, True) == "augmix" and view_policy(64, False) == "crop_flip"
    with pytest.raises(ValueError, match="1 or 64"):
        view_policy(8, False)
    with pytest.raises(ValueError, match="unknown view policy"):
        ViewGenerator(PRE, "mixup")
    with pytest.raises(ValueError, match="seed"):
        ViewGenerator(PRE, "augmix", seed=-1)


def test_grey_images_become_three_channels(tmp_path):
    from extract.datasets import open_image
    p = tmp_path / "g.png"
    _img(4).convert("L").save(p)
    v = ViewGenerator(PRE, "augmix", seed=0)(open_image(p), 0)
    assert v.shape == (64, 3, 32, 32) and torch.isfinite(v).all()


def test_crop_flip_view_matches_torchvision_resized_crop():
    """View 1 of the crop+flip policy = torchvision's resized_crop (bilinear) + flip with the drawn parameters."""
    import torchvision.transforms.functional as TF
    img = _img(5, size=(60, 41))
    gen = ViewGenerator(PRE, "crop_flip", seed=4)
    got = gen.augmented(img, sample_id=9)[0]
    rng = np.random.default_rng([4, 9])
    left, top, w, h = random_resized_crop_box(rng, *img.size)
    flip = rng.uniform() < 0.5
    ref = TF.resized_crop(img, top, left, h, w, [32, 32], interpolation=TF.InterpolationMode.BILINEAR)
    if flip:
        ref = TF.hflip(ref)
    ref = TF.normalize(TF.to_tensor(ref), PRE.mean, PRE.std)
    torch.testing.assert_close(got, ref, atol=PIXEL_TOL, rtol=0)


def test_dmn_crops_at_half_the_area_or_more():
    """"crop_flip_05" (DMN's official `RandomResizedCrop(224, scale=(0.5, 1))`): every view is torchvision's
    resized crop with boxes drawn at area U(0.5, 1), a reference that draws them in the test's own loop; no box
    covers less than half the image (ten tries), where the 0.08-1 policy does."""
    import torchvision.transforms.functional as TF
    img = _img(6, size=(64, 48))
    got = ViewGenerator(PRE, "crop_flip_05", seed=2).augmented(img, sample_id=3)
    rng = np.random.default_rng([2, 3])
    areas = []
    for v in range(N_AUG_VIEWS):
        left, top, w, h = random_resized_crop_box(rng, *img.size, scale=(0.5, 1.0))
        areas.append(w * h / (64 * 48))
        ref = TF.resized_crop(img, top, left, h, w, [32, 32], interpolation=TF.InterpolationMode.BILINEAR)
        if rng.uniform() < 0.5:
            ref = TF.hflip(ref)
        torch.testing.assert_close(got[v], TF.normalize(TF.to_tensor(ref), PRE.mean, PRE.std), atol=PIXEL_TOL,
                                   rtol=0)
    assert min(areas) > 0.45  # 0.5 of the area, less the rounding of w and h to pixels
    small = ViewGenerator(PRE, "crop_flip", seed=2).augmented(img, sample_id=3)
    assert not torch.equal(small, got)
    assert view_policy(64, False, (0.5, 1.0)) == "crop_flip_05" and view_policy(64, False) == "crop_flip"
    with pytest.raises(ValueError, match=r"no augmix view policy crops at scale \(0.5, 1.0\)"):
        view_policy(64, True, (0.5, 1.0))


@pytest.mark.parametrize("policy", ["crop_flip", "augmix"])
@pytest.mark.parametrize("size,mode,seed", [((45, 37), "RGB", 0), ((120, 90), "RGB", 3), ((31, 64), "L", 5),
                                            ((500, 375), "RGB", 11)])
def test_fast_views_equal_the_obvious_implementation_bit_for_bit(policy, size, mode, seed):
    """The fast path (in-place arithmetic, translations as crops) gives the very floats of the obvious per-view
    code: PIL for every operation, AugMix's affine translations, images mixed in [0, 1], then normalised."""
    img = _img(seed, size).convert(mode).convert("RGB")
    gen = ViewGenerator(PRE, policy, seed=seed)
    for sid in (0, 17):
        torch.testing.assert_close(gen.augmented(img, sid), reference_augmented(gen, img, sid), atol=0, rtol=0)


def test_augmix_equals_tpt_order_of_operations_up_to_rounding():
    """TPT normalises each image and mixes normalised tensors; mixing in [0, 1] first is the same affine map since
    the weights m + (1 - m) * sum(w) sum to 1. The two differ by float32 rounding only: each side rounds about eight
    times (conversion, normalisation, three weighted terms and their sums, the final mix) at values of magnitude at
    most B = max |(0 or 1) - mean| / std, and the float32 weights sum to 1 within a few eps."""
    mean, std = np.array(PRE.mean), np.array(PRE.std)
    bound = float(np.max(np.maximum(mean, 1 - mean) / std))
    atol = 16 * np.finfo(np.float32).eps * bound
    gen = ViewGenerator(PRE, "augmix", seed=2)
    worst = 0.0
    for seed in range(4):
        img = _img(seed, (70, 52))
        got = gen.augmented(img, seed)
        ref = reference_augmented(gen, img, seed, mix_space="normalised")
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)
        worst = max(worst, float((got - ref).abs().max()))
    assert worst > 0  # the two orders really are different computations


@pytest.mark.parametrize("axis", [0, 1])
def test_whole_pixel_translation_equals_pil_bilinear_affine(axis):
    """Every shift AugMix can draw at severity 1 for a 224 px view (|t| <= 7), and larger ones, both signs: the crop
    equals PIL's bilinear affine transform pixel for pixel (zeros where the shifted image leaves the frame)."""
    op = AUGMIX_OPS[7 + axis]
    size = 40
    img = _img(9, (size, size))
    for t in list(range(-12, 13)) + [-size, size + 3]:
        coeffs = (1, 0, t, 0, 1, 0) if axis == 0 else (1, 0, 0, 0, 1, t)
        want = np.asarray(img.transform((size, size), Image.AFFINE, coeffs, resample=Image.BILINEAR))

        class _Fixed:  # an rng whose draws give shift t: level = |t| / (size / 3) * 10 + tiny, sign from uniform()
            def __init__(self):
                self.calls = 0

            def uniform(self, lo=0.0, hi=1.0):
                self.calls += 1
                return (abs(t) + 0.5) / (size / 3) * 10 if self.calls == 1 else (0.9 if t < 0 else 0.1)

        got = np.asarray(op(img, _Fixed(), size))
        assert got.shape == want.shape and np.array_equal(got, want), t


def test_raw_views_are_uint8_and_coefficients_checked():
    """What a loader process sends: uint8 images (J = 4 per AugMix view: the crop and its three chains) and the
    float32 mixing coefficients [m, 1 - m, w_0, w_1, w_2] with m in [0, 1] and the w summing to 1."""
    img = _img(6, size=(70, 50))
    raw, coef = ViewGenerator(PRE, "augmix", seed=3).augmented_raw(img, 4)
    assert raw.dtype == torch.uint8 and raw.shape == (N_AUG_VIEWS, 4, 32, 32, 3)
    assert coef.dtype == torch.float32 and coef.shape == (N_AUG_VIEWS, 5)
    assert torch.all((coef[:, 0] >= 0) & (coef[:, 0] <= 1)) and torch.equal(coef[:, 1], 1 - coef[:, 0])
    torch.testing.assert_close(coef[:, 2:].sum(1), torch.ones(N_AUG_VIEWS), atol=4 * torch.finfo().eps, rtol=0)
    raw_cf, none = ViewGenerator(PRE, "crop_flip", seed=3).augmented_raw(img, 4)
    assert raw_cf.shape == (N_AUG_VIEWS, 1, 32, 32, 3) and none is None
    # the first crop is drawn first under both policies (AugMix's further draws then shift the stream)
    assert torch.equal(raw_cf[0, 0], raw[0, 0]) and not torch.equal(raw_cf[1, 0], raw[1, 0])
    gen = ViewGenerator(PRE, "augmix", seed=3)
    with pytest.raises(ValueError, match="coefficients"):
        gen.finish(raw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU side of the loader runs only on CUDA")
@pytest.mark.parametrize("policy", ["crop_flip", "augmix"])
def test_cuda_finish_equals_cpu_bit_for_bit(policy):
    """The float work done on the GPU (what the runner does with the loader's uint8) gives the CPU's very floats."""
    img = _img(7, size=(120, 90))
    gen = ViewGenerator(PRE, policy, seed=5)
    raw, coef = gen.augmented_raw(img, 2)
    cpu = gen.finish(raw, coef)
    gpu = gen.finish(raw.cuda(), None if coef is None else coef.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=0, rtol=0)
    v0 = torch.from_numpy(gen.original_raw(img).copy())[None, None]
    torch.testing.assert_close(gen.finish(v0.cuda()).cpu(), gen.finish(v0), atol=0, rtol=0)
