"""AugMix's operation chains on a torch device, giving Pillow's pixels bit for bit (the GPU half of AugMix views).

On a GPU machine the loader processes are the bottleneck of the AugMix policy: Pillow's bilinear affine transform
(rotate, the shears) and point operations are most of an AugMix view's CPU time. With `device_chains`, a loader
process only crops, flips and draws the random numbers (`ViewGenerator.augmix_program`, the same draws in the same
order as the Pillow path), and the chains run here, on the model's device, batched over every chain of a sample:

* point operations as per-image, per-channel lookup tables, computed as Pillow's ImageOps computes them:
  autocontrast (cutoff 0: lowest and highest occupied level, lut = int(i * 255/(hi - lo) - lo * 255/(hi - lo))
  clipped, float64 as Python's floats; identity if hi <= lo), equalize (integer arithmetic on the histogram:
  step = (P - count of the last occupied level) // 255, lut[i] = (step // 2 + pixels below i) // step; identity when
  one level or step 0; clipped to 255 as Pillow's C point clips), posterize (i & mask), solarize (i < t ? i : 255 - i);
* rotations, shears and translations through Pillow's generic bilinear affine transform, written out in float64 in
  its C order: source coordinates a0 (x + 0.5) + a1 (y + 0.5) + a2 (and the same for y), zero outside
  [0, size), then x = floor(xin - 0.5), dx = xin - 0.5 - x, neighbours clamped to the image, two horizontal lerps
  v = a + (b - a) dx, one vertical lerp, and truncation to uint8 (`bilinear_filter32RGB`); the rotation matrix as
  `Image.rotate` builds it (`rotate_coeffs`). Shears and translations leave out the lerps their matrices make exact
  (`AFFINE_KIND`).

IEEE float64 additions, multiplications and divisions round the same on the CPU and on a GPU and torch runs each as
its own kernel (nothing is fused), so the device gives the floats Pillow's C code gives.
tests/extract/test_augmix_device.py checks every operation against Pillow over their parameter ranges and random,
flat and few-level images, and whole chains through the runner; a CUDA twin checks the GPU against the CPU.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

(OP_AUTOCONTRAST, OP_EQUALIZE, OP_POSTERIZE, OP_ROTATE, OP_SOLARIZE, OP_SHEAR_X, OP_SHEAR_Y, OP_TRANSLATE_X,
 OP_TRANSLATE_Y) = range(9)
#: operations done with a lookup table (the others are affine maps)
LUT_OPS = (OP_AUTOCONTRAST, OP_EQUALIZE, OP_POSTERIZE, OP_SOLARIZE)
IDENTITY = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)


def rotate_coeffs(degrees: float, width: int, height: int) -> tuple[float, ...]:
    """The inverse affine matrix `Image.rotate(degrees)` hands to `transform` (no centre, translation or expand);
    the identity for a multiple of 360, where Pillow copies the image."""
    angle = degrees % 360.0
    if angle == 0:
        return IDENTITY
    if angle in (90.0, 180.0, 270.0):
        raise ValueError(f"rotation by {degrees} degrees takes Pillow's transpose path, not modelled here")
    cx, cy = width / 2, height / 2
    rad = -math.radians(angle)
    a, b, d, e = (round(math.cos(rad), 15), round(math.sin(rad), 15), round(-math.sin(rad), 15),
                  round(math.cos(rad), 15))
    x, y = -cx - 0, -cy - 0
    c, f = a * x + b * y + 0.0, d * x + e * y + 0.0
    return (a, b, c + cx, d, e, f + cy)


def affine_coeffs(op: int, param: float, size: int) -> tuple[float, ...]:
    """The affine matrix of an AugMix affine operation with its drawn parameter (`extract.views._DRAWS`)."""
    if op == OP_ROTATE:
        return rotate_coeffs(param, size, size)
    if op == OP_SHEAR_X:
        return (1.0, float(param), 0.0, 0.0, 1.0, 0.0)
    if op == OP_SHEAR_Y:
        return (1.0, 0.0, 0.0, float(param), 1.0, 0.0)
    if op == OP_TRANSLATE_X:
        return (1.0, 0.0, float(param), 0.0, 1.0, 0.0)
    if op == OP_TRANSLATE_Y:
        return (1.0, 0.0, 0.0, 0.0, 1.0, float(param))
    raise ValueError(f"operation {op} is not an affine map")


#: what an affine operation's matrix makes exact, whatever its parameter: a shear along x keeps every source row
#: at y + 0.5 (dy = 0, so the vertical lerp returns its first term), a shear along y every source column (dx = 0),
#: a whole-pixel translation both (the pixel itself); a rotation needs the full bilinear sum
AFFINE_KIND = {OP_ROTATE: "full", OP_SHEAR_X: "dy0", OP_SHEAR_Y: "dx0", OP_TRANSLATE_X: "shift",
               OP_TRANSLATE_Y: "shift"}
_KINDS = tuple(dict.fromkeys(AFFINE_KIND.values()))  # ("full", "dy0", "dx0", "shift")


def bilinear_affine(x: torch.Tensor, coeffs: torch.Tensor, kind: str = "full") -> torch.Tensor:
    """Pillow's `transform(size, AFFINE, coeffs, BILINEAR)` of each image: x (M, H, W, 3) uint8, coeffs (M, 6)
    float64 on x's device -> (M, H, W, 3) uint8.

    `kind` (`AFFINE_KIND`) leaves out the terms the matrices make exact: "dy0" when every dy is 0 (the result is
    the first horizontal lerp, exactly: v1 + (v2 - v1) * 0 = v1), "dx0" when every dx is 0 (the lerps' first terms
    are the pixels), "shift" when both are (the source pixel); the caller vouches for the matrices."""
    m, h, w, ch = x.shape
    dev, f64 = x.device, torch.float64
    a = coeffs.to(dev, f64)[:, :, None, None]  # (M, 6, 1, 1)
    xc = torch.arange(w, dtype=f64, device=dev) + 0.5  # x + 0.5, exact
    yc = (torch.arange(h, dtype=f64, device=dev) + 0.5)[:, None]
    xin = (a[:, 0] * xc + a[:, 1] * yc) + a[:, 2]  # (M, H, W): C's a0 * xin + a1 * yin + a2
    yin = (a[:, 3] * xc + a[:, 4] * yc) + a[:, 5]
    inside = (xin >= 0.0) & (xin < w) & (yin >= 0.0) & (yin < h)
    xs, ys = xin.sub_(0.5), yin.sub_(0.5)  # in place: the same floats, less memory (M may be hundreds of images)
    xf, yf = torch.floor(xs), torch.floor(ys)
    dx, dy = xs.sub_(xf).view(m, -1, 1), ys.sub_(yf).view(m, -1, 1)
    # indices of the clamped neighbours (XCLIP / YCLIP); outside pixels are zeroed below, so any index will do
    xi = xf.clamp_(-1.0, float(w)).long()
    yi = yf.clamp_(-1.0, float(h)).long()
    del xf, yf
    x0, x1 = xi.clamp(0, w - 1), (xi + 1).clamp_(0, w - 1)
    y0, y1 = yi.clamp(0, h - 1), (yi + 1).clamp_(0, h - 1)  # row y + 1 past the edge: the same row, so v2 = v1
    del xi, yi
    # row index of image k's first pixel in the (M * H * W, 3) pixel rows: one gather per neighbour for all channels
    base = (torch.arange(m, device=dev) * (h * w)).view(m, 1, 1)
    y0, y1 = y0.mul_(w).add_(base), y1.mul_(w).add_(base)
    pixels = x.reshape(m * h * w, ch)

    def at(yy: torch.Tensor, xx: torch.Tensor) -> torch.Tensor:  # (M, H * W, 3) uint8
        return pixels[(yy + xx).view(m, -1)]

    def lerp(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """C's a + (b - a) * t, in place in b (IEEE addition commutes exactly: the same float as a + ...)."""
        return b.sub_(a).mul_(t).add_(a)

    p00 = at(y0, x0)
    if kind == "shift":
        out = p00
    else:
        p00 = p00.to(f64)
        if kind == "dy0":
            v = lerp(p00, at(y0, x1).to(f64), dx)
        elif kind == "dx0":
            v = lerp(p00, at(y1, x0).to(f64), dy)
        elif kind == "full":
            v1 = lerp(p00, at(y0, x1).to(f64), dx)
            del p00
            v = lerp(v1, lerp(at(y1, x0).to(f64), at(y1, x1).to(f64), dx), dy)
        else:
            raise ValueError(f"unknown affine kind {kind!r}")
        out = v.trunc_().clamp_(0.0, 255.0).to(torch.uint8)  # (UINT8) v: truncation
    out.mul_(inside.view(m, -1, 1).to(torch.uint8))
    return out.view(m, h, w, ch)


def lut_ops(x: torch.Tensor, ops: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Point operations, one per image: x (M, H, W, 3) uint8, ops (M,) in `LUT_OPS`, params (M,) (posterize: bits,
    solarize: threshold; ignored otherwise) -> (M, H, W, 3) uint8."""
    m, h, w, ch = x.shape
    dev = x.device
    n_pix = h * w
    levels = torch.arange(256, device=dev)
    lut = levels.expand(m, ch, 256).clone()  # identity, int64
    ops, params = ops.to(dev).long(), params.to(dev)
    offs = ((torch.arange(m, device=dev) * ch)[:, None, None] + torch.arange(ch, device=dev)) * 256  # (M, 1, 3)
    # every row gets a histogram (a branch on the rows that need one would synchronise a GPU stream), counted with
    # scatter_add into a fixed size: CUDA's bincount reads the input's maximum back to size its output, a sync.
    # One int64 index per pixel and channel (in place; the ones are a broadcast scalar): the only large temporary
    flat_idx = x.reshape(m, h * w, ch).long().add_(offs).view(-1)
    hist = torch.zeros(m * ch * 256, dtype=torch.int64, device=dev).scatter_add_(
        0, flat_idx, torch.ones((), dtype=torch.int64, device=dev).expand(flat_idx.shape)).view(m, ch, 256)
    occupied = hist > 0
    lo = occupied.to(torch.uint8).argmax(-1)  # first occupied level (argmax returns the first maximum)
    hi = 255 - occupied.flip(-1).to(torch.uint8).argmax(-1)  # last occupied level
    # autocontrast, as ImageOps.autocontrast with cutoff 0 computes it in Python floats
    span = (hi - lo).to(torch.float64)
    # a true division: `255.0 / tensor` would be computed as 255 * (1 / tensor), another rounding
    scale = torch.div(torch.full_like(span, 255.0), torch.where(span > 0, span, torch.ones_like(span)))
    offset = (-lo).to(torch.float64) * scale
    ac = (levels.to(torch.float64) * scale[..., None] + offset[..., None]).trunc().clamp_(0, 255).long()
    ac = torch.where((hi > lo)[..., None], ac, lut)
    # equalize, integer arithmetic as ImageOps.equalize
    last = hist.gather(-1, hi[..., None].long())[..., 0]
    step = (n_pix - last) // 255
    below = torch.cumsum(hist, -1) - hist
    safe = torch.where(step > 0, step, torch.ones_like(step))
    eq = ((safe // 2)[..., None] + below).div(safe[..., None], rounding_mode="floor").clamp_(max=255)
    eq = torch.where(((occupied.sum(-1) > 1) & (step > 0))[..., None], eq, lut)
    lut = torch.where((ops == OP_AUTOCONTRAST)[:, None, None], ac, lut)
    lut = torch.where((ops == OP_EQUALIZE)[:, None, None], eq, lut)
    bits = params.long().clamp(1, 8)
    mask = ~(2 ** (8 - bits) - 1)  # ImageOps.posterize
    lut = torch.where((ops == OP_POSTERIZE)[:, None, None], levels & mask[:, None, None], lut)
    thr = params.long()[:, None, None]
    lut = torch.where((ops == OP_SOLARIZE)[:, None, None], torch.where(levels < thr, levels, 255 - levels), lut)
    return lut.to(torch.uint8).reshape(-1)[flat_idx].view(m, h, w, ch)  # every entry is in [0, 255]


def chain_rows(ops: torch.Tensor) -> dict[str, torch.Tensor]:
    """Which chains take which kind of operation at each depth, from `ops` (N, C, D) on the host: int64 indices
    into the N * C chains under "lut_rows_d" (point operations) and "<kind>_rows_d" for each `AFFINE_KIND`. A
    loader process computes them with the program, so the device never waits for the host to find out (`nonzero`
    on the device would synchronise)."""
    flat = ops.reshape(-1, ops.shape[-1]).numpy()
    out = {}
    for d in range(flat.shape[1]):
        out[f"lut_rows_{d}"] = torch.from_numpy(np.flatnonzero(np.isin(flat[:, d], LUT_OPS)))
        for kind in _KINDS:
            codes = [op for op, k in AFFINE_KIND.items() if k == kind]
            out[f"{kind}_rows_{d}"] = torch.from_numpy(np.flatnonzero(np.isin(flat[:, d], codes)))
    return out


#: chains per kernel call in `run_chains`: each kind of operation's rows at one depth are cut into pieces of at most
#: this many images, which bounds the temporaries when many samples' chains run together (`encode_pass` runs 16
#: samples' per call): at 224 px a rotation (the full bilinear sum in float64) peaks near 7 MB per image, so about
#: 3.6 GB per piece, a point operation near 1.7 MB (measured on the CPU with `ru_maxrss`)
CHAIN_PIECE = 512


def run_chains(crops: torch.Tensor, ops: torch.Tensor, lut_params: torch.Tensor, affine: torch.Tensor,
               rows: dict[str, torch.Tensor] | None = None, piece: int = CHAIN_PIECE) -> torch.Tensor:
    """Every AugMix chain of a sample: crops (N, S, S, 3) uint8, and per view, chain and depth the operation
    (`ops` (N, C, D) int, -1 past the chain's depth), its point-operation parameter (`lut_params` (N, C, D)) and its
    affine matrix (`affine` (N, C, D, 6) float64) -> (N, 1 + C, S, S, 3) uint8: the crop, then each chain's image.

    `rows` (`chain_rows`, computed from `ops` on the host when not given) says which chains take which kind of
    operation at each depth; each kind runs batched over its chains, `piece` images per call at most. Every
    operation is per image, so N may hold the views of many samples: the images are the same whatever N and
    `piece`, and the launches (the host's share of the work) are per call, not per sample."""
    n, c, depth = ops.shape
    s = crops.shape[1:]
    dev = crops.device
    if rows is None:
        rows = chain_rows(ops.cpu())
    ops, lut_params, affine = ops.to(dev).long(), lut_params.to(dev), affine.to(dev, torch.float64)
    state = crops[:, None].expand(n, c, *s).reshape(n * c, *s).clone()
    ops_f, lp_f, af_f = ops.reshape(n * c, depth), lut_params.reshape(n * c, depth), affine.reshape(n * c, depth, 6)
    for d in range(depth):
        for kind in ("lut", *_KINDS):
            r_all = rows[f"{kind}_rows_{d}"].to(dev)
            for r in r_all.split(piece) if r_all.numel() else ():  # sizes are known on the host: no synchronisation
                if kind == "lut":
                    state[r] = lut_ops(state[r], ops_f[r, d], lp_f[r, d])
                else:
                    state[r] = bilinear_affine(state[r], af_f[r, d], kind)
    return torch.cat([crops[:, None], state.view(n, c, *s)], 1)


def packed_rows(packed: torch.Tensor, depth: int) -> tuple[torch.Tensor, list[int]]:
    """The row lists (`chain_rows`) of packed programs (`pack_program`; (N, W) float64 on the host, any number of
    views, e.g. several samples' programs concatenated), as one int64 tensor and its lengths (`run_packed`'s
    `rows` and `lengths`). `depth`: the programs' chain depth (W = 2 + C (1 + 8 depth))."""
    n = packed.shape[0]
    chains = (packed.shape[1] - 2) // (1 + 8 * depth)
    if packed.shape[1] != 2 + chains * (1 + 8 * depth):
        raise ValueError(f"not a packed program of depth {depth}: {packed.shape[1]} columns")
    ops = packed[:, 2 + chains:2 + chains + chains * depth].reshape(n, chains, depth).to(torch.int64)
    rows = chain_rows(ops)
    keys = _row_keys(depth)
    return torch.cat([rows[k] for k in keys]), [int(rows[k].numel()) for k in keys]


def pack_program(prog: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A program (`ViewGenerator.augmix_program`) as few tensors as possible, for the trip from a loader process
    (each tensor passed between processes costs the receiver about 0.3 ms): (crops, one float64 tensor (N, 77)
    holding the coefficients, operations, point parameters and matrices, exactly, the row lists concatenated into
    one int64 tensor, and their lengths)."""
    n = prog["ops"].shape[0]
    packed = torch.cat([prog["coef"].to(torch.float64), prog["ops"].reshape(n, -1).to(torch.float64),
                        prog["lut_params"].reshape(n, -1).to(torch.float64), prog["affine"].reshape(n, -1)], 1)
    keys = _row_keys(prog["ops"].shape[-1])
    return prog["crops"], packed, torch.cat([prog[k] for k in keys]), [int(prog[k].numel()) for k in keys]


def unpack_program(packed: torch.Tensor, rows: torch.Tensor, lengths: Sequence[int]) -> dict[str, torch.Tensor]:
    """`pack_program`'s tensors (on any device) back to coef, ops, lut_params, affine and the row lists; the shape
    follows from the lengths (five row lists per depth) and the packed width (2 + C + 8 C D columns), and the
    lengths are host integers, so splitting a device tensor waits for nothing."""
    depth = len(lengths) // (1 + len(_KINDS))
    chains, rest = divmod(packed.shape[1] - 2, 1 + 8 * depth)
    if rest or depth * (1 + len(_KINDS)) != len(lengths):
        raise ValueError(f"not a packed program: {packed.shape[1]} columns, {len(lengths)} row lists")
    n, k, n_coef = packed.shape[0], chains * depth, 2 + chains
    out = {"coef": packed[:, :n_coef].to(torch.float32),
           "ops": packed[:, n_coef:n_coef + k].reshape(n, chains, depth).to(torch.int64),
           "lut_params": packed[:, n_coef + k:n_coef + 2 * k].reshape(n, chains, depth).to(torch.int64),
           "affine": packed[:, n_coef + 2 * k:].reshape(n, chains, depth, 6)}
    out.update(zip(_row_keys(depth), torch.split(rows, list(lengths))))
    return out


def run_packed(crops: torch.Tensor, packed: torch.Tensor, rows: torch.Tensor, lengths: Sequence[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A loader's packed program (`pack_program`) run on the crops' device: ((N, 1 + C, S, S, 3) uint8 images, the
    crop and each chain's, and the (N, 5) float32 mixing coefficients), as `finish_views` takes them."""
    prog = unpack_program(packed, rows, lengths)
    return run_chains(crops[:, 0], prog.pop("ops"), prog.pop("lut_params"), prog.pop("affine"), prog), \
        prog.pop("coef")


def _row_keys(depth: int) -> list[str]:
    return [f"{kind}_rows_{d}" for d in range(depth) for kind in ("lut", *_KINDS)]
