"""AugMix's chains on a torch device (`extract.augmix_device`) against Pillow, pixel for pixel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from extract.augmix_device import (AFFINE_KIND, OP_AUTOCONTRAST, OP_EQUALIZE,
                                   OP_POSTERIZE, OP_ROTATE, OP_SHEAR_X, OP_SHEAR_Y, OP_SOLARIZE, OP_TRANSLATE_X,
                                   OP_TRANSLATE_Y, affine_coeffs, bilinear_affine, lut_ops, pack_program,
                                   run_chains, run_packed)
from extract.models import Preprocess
from extract.views import ViewGenerator

S = 32


def _images(seed: int = 0) -> list[np.ndarray]:
    """Random, two-level flat, few-level, single-level and ramp images (the LUT edge cases: one occupied level,
    equalize's step 0, autocontrast's hi == lo)."""
    rng = np.random.default_rng(seed)
    out = [rng.integers(0, 256, (S, S, 3), dtype=np.uint8) for _ in range(3)]
    flat = np.full((S, S, 3), 37, np.uint8)
    flat[3:9, 5:20] = 200
    out += [flat, (out[0] // 80 * 80).astype(np.uint8), np.full((S, S, 3), 9, np.uint8)]
    one_off = np.full((S, S, 3), 100, np.uint8)
    one_off[0, 0] = 101  # equalize: step = (S*S - 1) // 255 = 4 > 0 but one pixel apart
    ramp = np.broadcast_to(np.arange(S, dtype=np.uint8)[None, :, None] * 8, (S, S, 3)).copy()
    return out + [one_off, ramp]


def _lut(op: int, param: int, img: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(img)[None]
    return lut_ops(x, torch.tensor([op]), torch.tensor([param]))[0].numpy()


def _affine(op: int, param: float, img: np.ndarray) -> np.ndarray:
    """The operation through its own kind of path (AFFINE_KIND), checked equal to the full bilinear sum too."""
    coeffs = torch.tensor([affine_coeffs(op, param, S)], dtype=torch.float64)
    x = torch.from_numpy(img)[None]
    out = bilinear_affine(x, coeffs, AFFINE_KIND[op])[0].numpy()
    np.testing.assert_array_equal(out, bilinear_affine(x, coeffs, "full")[0].numpy())
    return out


@pytest.mark.parametrize("img", _images(), ids=lambda _: "")
def test_point_operations_equal_pillow(img):
    pil = Image.fromarray(img)
    np.testing.assert_array_equal(_lut(OP_AUTOCONTRAST, 0, img), np.asarray(ImageOps.autocontrast(pil)))
    np.testing.assert_array_equal(_lut(OP_EQUALIZE, 0, img), np.asarray(ImageOps.equalize(pil)))
    for bits in range(1, 9):
        np.testing.assert_array_equal(_lut(OP_POSTERIZE, bits, img), np.asarray(ImageOps.posterize(pil, bits)))
    for t in (0, 1, 100, 128, 230, 255, 256):
        np.testing.assert_array_equal(_lut(OP_SOLARIZE, t, img), np.asarray(ImageOps.solarize(pil, t)))


@pytest.mark.parametrize("img", _images(1)[:5], ids=lambda _: "")
def test_affine_operations_equal_pillow(img):
    pil = Image.fromarray(img)
    for deg in (-2, -1, 0, 1, 2, 7, -33):  # AugMix draws whole degrees in [-2, 2]; others exercise the matrix
        np.testing.assert_array_equal(_affine(OP_ROTATE, deg, img),
                                      np.asarray(pil.rotate(deg, resample=Image.BILINEAR)), err_msg=f"{deg}")
    for s in np.linspace(-0.03, 0.03, 13):
        for op, coeffs in ((OP_SHEAR_X, (1, s, 0, 0, 1, 0)), (OP_SHEAR_Y, (1, 0, 0, s, 1, 0))):
            want = pil.transform((S, S), Image.AFFINE, coeffs, resample=Image.BILINEAR)
            np.testing.assert_array_equal(_affine(op, float(s), img), np.asarray(want), err_msg=f"{op} {s}")
    for t in range(-S - 1, S + 2, 5):
        np.testing.assert_array_equal(_affine(OP_TRANSLATE_X, t, img), np.asarray(pil.crop((t, 0, t + S, S))))
        np.testing.assert_array_equal(_affine(OP_TRANSLATE_Y, t, img), np.asarray(pil.crop((0, t, S, t + S))))


def test_general_affine_maps_equal_pillow():
    """Pillow's generic bilinear engine for arbitrary matrices (scales, offsets reaching past the border)."""
    rng = np.random.default_rng(3)
    img = _images(3)[0]
    for _ in range(40):
        c = tuple(float(v) for v in rng.uniform(-1, 1, 6) * [1.5, 0.5, 20, 0.5, 1.5, 20] + [0.5, 0, 0, 0, 0.5, 0])
        got = bilinear_affine(torch.from_numpy(img)[None], torch.tensor([c], dtype=torch.float64))[0].numpy()
        want = np.asarray(Image.fromarray(img).transform((S, S), Image.AFFINE, c, resample=Image.BILINEAR))
        np.testing.assert_array_equal(got, want, err_msg=str(c))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_programs_give_pillows_views(seed):
    """A loader's program (crops and draws) run on the device = the Pillow path's images and coefficients."""
    pre = Preprocess((S, S), (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    for img in _images(seed)[:2] + [np.random.default_rng(seed).integers(0, 256, (70, 90, 3), dtype=np.uint8)]:
        pil = Image.fromarray(img)
        gen = ViewGenerator(pre, "augmix", seed=seed)
        raw, coef = gen.augmented_raw(pil, 5 + seed)
        prog = gen.augmix_program(pil, 5 + seed)
        assert torch.equal(prog["coef"], coef)
        out = run_chains(prog["crops"][:, 0], prog["ops"], prog["lut_params"], prog["affine"])
        assert torch.equal(out, raw)
        assert torch.equal(gen.finish(out, prog["coef"]), gen.augmented(pil, 5 + seed))
    with pytest.raises(ValueError, match="augmix policy"):
        ViewGenerator(pre, "crop_flip").augmix_program(pil, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device chains run on CUDA here")
def test_cuda_chains_equal_cpu():
    pre = Preprocess((64, 64), (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    gen = ViewGenerator(pre, "augmix", seed=4)
    pil = Image.fromarray(np.random.default_rng(4).integers(0, 256, (90, 120, 3), dtype=np.uint8))
    prog = gen.augmix_program(pil, 3)
    cpu = run_chains(prog["crops"][:, 0], prog["ops"], prog["lut_params"], prog["affine"])
    crops, packed, rows, lengths = pack_program(prog)  # as the runner receives it from a loader process
    crops, packed, rows = crops.cuda(), packed.cuda(), rows.cuda()
    gen.finish(crops[:1], None)  # mean and std moved to the device once, outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the device path must never make the host wait
    try:
        gpu, coef = run_packed(crops, packed, rows, lengths)
        views = gen.finish(gpu, coef)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(views.cpu(), gen.finish(cpu, prog["coef"]))


def test_program_draws_are_augmixs_in_augmixs_order():
    """The parameters of a program, re-drawn by an independent transcription of AugMix's draws (TPT's
    augmix_ops.py at severity 1: level = U(0.1, 1), int_parameter(level, m) = int(level * m / 10),
    float_parameter(level, m) = level * m / 10, then a sign from U(0, 1) > 0.5) from a fresh Generator."""
    from extract.views import random_resized_crop_box

    pre = Preprocess((S, S), (0.5,) * 3, (0.5,) * 3)
    img = Image.fromarray(np.random.default_rng(9).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    prog = ViewGenerator(pre, "augmix", seed=3).augmix_program(img, 11)
    rng = np.random.default_rng([3, 11])

    def level() -> float:
        return rng.uniform(0.1, 1.0)

    def signed(v):
        return -v if rng.uniform() > 0.5 else v

    for v in range(63):
        random_resized_crop_box(rng, 70, 50)
        rng.uniform()  # the flip
        w = rng.dirichlet([1.0, 1.0, 1.0]).astype(np.float32)
        m = np.float32(rng.beta(1.0, 1.0))
        assert prog["coef"][v].tolist() == [m, np.float32(1) - m, *w]
        for i in range(3):
            depth = int(rng.integers(1, 4))
            for d in range(3):
                op = int(prog["ops"][v, i, d])
                if d >= depth:
                    assert op == -1
                    continue
                assert op == int(rng.integers(0, 9))
                lut, aff = int(prog["lut_params"][v, i, d]), prog["affine"][v, i, d].tolist()
                if op == OP_POSTERIZE:
                    assert lut == 4 - int(level() * 4 / 10)
                elif op == OP_SOLARIZE:
                    assert lut == 256 - int(level() * 256 / 10)
                elif op == OP_ROTATE:
                    assert aff == list(affine_coeffs(OP_ROTATE, signed(int(level() * 30 / 10)), S))
                elif op in (OP_SHEAR_X, OP_SHEAR_Y):
                    s = signed(level() * 0.3 / 10)
                    assert aff == ([1, s, 0, 0, 1, 0] if op == OP_SHEAR_X else [1, 0, 0, s, 1, 0])
                elif op in (OP_TRANSLATE_X, OP_TRANSLATE_Y):
                    t = float(int(signed(int(level() * (S / 3) / 10))))
                    assert aff == ([1, 0, t, 0, 1, 0] if op == OP_TRANSLATE_X else [1, 0, 0, 0, 1, t])


def test_packed_program_round_trip_is_exact():
    """What travels from a loader process (`pack_program`: crops, one float64 tensor, one row tensor and lengths)
    unpacks to the very program."""
    from extract.augmix_device import pack_program, unpack_program

    pre = Preprocess((S, S), (0.5,) * 3, (0.5,) * 3)
    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    prog = ViewGenerator(pre, "augmix", seed=1).augmix_program(img, 4)
    crops, packed, rows, lengths = pack_program(prog)
    assert crops is prog["crops"] and packed.dtype == torch.float64 and rows.dtype == torch.int64
    back = unpack_program(packed, rows, lengths)
    assert set(back) == set(prog) - {"crops"}
    for k, v in back.items():
        assert torch.equal(v, prog[k].to(v.dtype)) and (v.dtype == prog[k].dtype or k in ("ops", "lut_params")), k


def test_many_samples_chains_in_one_call_equal_one_call_per_sample():
    """The runner launches the chains of many samples in one call (`packed_rows` over their concatenated programs,
    `run_packed`), cut into pieces of `piece` images per kernel call: the images and coefficients are those of one
    call per sample, bit for bit, whatever the piece size."""
    from extract.augmix_device import packed_rows, unpack_program

    pre = Preprocess((S, S), (0.5,) * 3, (0.5,) * 3)
    rng = np.random.default_rng(8)
    progs = []
    for sid, shape in enumerate([(40, 60, 3), (S, S, 3), (70, 50, 3)]):
        img = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
        progs.append(pack_program(ViewGenerator(pre, "augmix", seed=2).augmix_program(img, 20 + sid)))
    one = [run_packed(*p) for p in progs]
    want_images, want_coef = torch.cat([o[0] for o in one]), torch.cat([o[1] for o in one])
    crops, packed = torch.cat([p[0] for p in progs]), torch.cat([p[1] for p in progs])
    for p in progs:  # the main thread's row lists of one program are the loader's
        rows, lengths = packed_rows(p[1], 3)
        assert torch.equal(rows, p[2]) and lengths == p[3]
    rows, lengths = packed_rows(packed, 3)
    images, coef = run_packed(crops, packed, rows, lengths)
    assert torch.equal(images, want_images) and torch.equal(coef, want_coef)
    prog = unpack_program(packed, rows, lengths)
    for piece in (5, 100):
        got = run_chains(crops[:, 0], prog["ops"], prog["lut_params"], prog["affine"],
                         {k: v for k, v in prog.items() if k.endswith(("_0", "_1", "_2"))}, piece=piece)
        assert torch.equal(got, want_images), piece
    with pytest.raises(ValueError, match="not a packed program"):
        packed_rows(packed[:, :-1], 3)
