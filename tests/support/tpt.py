"""Shared helpers of the TPT-family tests (tests/extract/methods/test_tpt.py, test_tps.py, test_atpt.py,
tests/extract/test_text_encoder.py, test_check_shortcuts.py): class names, float32 tolerances, a feature stream on
the tiny open_clip model, and slow references written from
docs/methods.md, "Confident-view selection and marginal entropy", "TPT: episodic prompt tuning"."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from extract.methods import get_method

NAMES = ("cat", "sea_lion", "Annual Crop Land", "dog", "a")
K = len(NAMES)
# float32 tolerances: the tiny text tower reduces over width 32, so a unit-norm feature may move by ~32 eps when
# the summation order changes (threads, AVX2 vs AVX-512 kernels, batch shapes); logits carry the logit scale.
EPS32 = torch.finfo(torch.float32).eps
FEAT_TOL = 32 * EPS32


def tuned_tol(scale, steps: int) -> float:
    """Logit tolerance between two fp32 paths (batch shapes, kernels, encode_text vs ours) after `steps` AdamW steps.

    The prediction forward contributes 2 FEAT_TOL·scale (a unit feature within FEAT_TOL, then a width-16 dot
    product). Each step contributes at most 2 FEAT_TOL·scale more: AdamW's update lr·m̂/(√v̂ + eps) has a relative
    condition number <= 1 in each gradient coordinate, so the FEAT_TOL relative rounding of a gradient through the
    width-32 tower moves the update by <= FEAT_TOL of itself, and the features by <= FEAT_TOL times the step's own
    effect on a unit vector (< 2). The bound does not cover a coordinate whose gradient cancels to within its own
    rounding of Adam's eps (1e-8): there the rounding is divided by ~eps and that coordinate may step by up to lr,
    which would show as an O(lr·scale) failure, never as a last-bit one.
    """
    return (2 + 2 * steps) * FEAT_TOL * float(scale)


def zs_text(model) -> torch.Tensor:
    return model.encode_texts([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])


def stream(model, n: int, v: int = 64, seed: int = 0, noise: float = 0.4) -> torch.Tensor:
    """(n, v, D) normalised features scattered around the zero-shot prototypes."""
    g = torch.Generator().manual_seed(seed)
    text = zs_text(model)
    y = torch.randint(0, K, (n,), generator=g)
    # the noise is drawn on the CPU (the same values for a seed on every device) and follows the features' device
    eps = torch.randn(n, v, text.shape[1], generator=g).to(device=text.device, dtype=text.dtype)
    return F.normalize(text[y.to(text.device)][:, None] + noise * eps, dim=-1)


def make(key: str, model, dataset: str = "dtd", **changes):
    cls = get_method(key)
    cfg = dataclasses.replace(cls.default_config(dataset, "ViT-B-16"), **changes)
    return cls(cfg, zs_text(model), model.logit_scale, backbone="tiny-clip", dataset=dataset, text_encoder=model,
               class_names=NAMES)


def ref_encode(model, names, ctx: torch.Tensor) -> torch.Tensor:
    """open_clip's CLIP.encode_text written out with the embeddings of tokens 1..n_ctx replaced by `ctx`."""
    m = model.model
    tokens = model.tokenizer([f"a photo of a {n.replace('_', ' ')}." for n in names])
    x = m.token_embedding(tokens)
    x = torch.cat([x[:, :1], ctx[None].expand(len(names), -1, -1), x[:, 1 + ctx.shape[0]:]], dim=1)
    x = x + m.positional_embedding
    x = m.transformer(x, attn_mask=m.attn_mask)
    x = m.ln_final(x)
    x = x[torch.arange(len(names)), tokens.argmax(-1)] @ m.text_projection
    return x / x.norm(dim=-1, keepdim=True)


def ref_entropy(z: torch.Tensor) -> float:
    p = z.softmax(-1)
    return float(-(p * p.log()).sum())


def ref_select(logits: torch.Tensor, p: float) -> list[int]:
    """int(N p) views of lowest entropy, by sorting (entropy, index) pairs."""
    ents = [(ref_entropy(logits[v]), v) for v in range(logits.shape[0])]
    return [v for _, v in sorted(ents)[:max(1, int(logits.shape[0] * p))]]


def ref_marginal_entropy(z: torch.Tensor) -> torch.Tensor:
    pbar = z.softmax(-1).mean(0)
    return -(pbar * pbar.log()).sum()


def ref_episodic(feats: torch.Tensor, init: torch.Tensor, features, scale: float, *, lr: float, steps: int = 1,
                 reg=None, p: float = 0.1, reselect: bool = False, eps: float = 1e-8) -> torch.Tensor:
    """One sample the way TPT's loop does it: a fresh torch AdamW, selection at step 0 (TPT `test_time_tuning`) or
    at every step (`reselect`, TPS `run_shift_iter`), predict on view 0."""
    param = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([param], lr=lr, eps=eps)  # weight decay 0.01 (default)
    sel = None
    for _ in range(steps):
        logits = scale * feats @ features(param).T
        if sel is None or reselect:
            sel = ref_select(logits.detach(), p)
        loss = ref_marginal_entropy(logits[sel])
        if reg is not None:
            loss = loss + reg(features(param))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return scale * feats[0] @ features(param).T
