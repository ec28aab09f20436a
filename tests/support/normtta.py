"""Slow, obvious transcriptions of the official CLIP ports of the normalisation-layer methods (TTABC
`ttabc/model_selection/{tent,sar,deyo}.py` with its `ClipTestTimeTuningNorm` of `clip/custom_clip.py`; BATCLIP
`classification/methods/ours.py`), written from the official code and independent of `extract.methods.normtta`, and
the tiny inputs their tests share (docs/methods.md, "The run: batches of pixels").

The reference works on its own deep copy of the open_clip model, configured line by line as the official
`configure_model` does, and runs the official loop one batch at a time.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)


def configured_copy(model: nn.Module, *, skip: Callable[[str], bool] = lambda name: False
                    ) -> tuple[nn.Module, list[nn.Parameter]]:
    """TTABC's `configure_model` on a copy of the whole model: eval mode, every parameter frozen, then in the
    image encoder BatchNorm2d on batch statistics with grad, BatchNorm1d in train mode with grad, LayerNorm and
    GroupNorm with grad; and `configure_trainable_parameters`: the weight and bias of the image encoder's norm
    layers in module order, except those whose name `skip` says (SAR and DeYO's rule)."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    for m in ref.visual.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(True)
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
        elif isinstance(m, nn.BatchNorm1d):
            m.train()
            m.requires_grad_(True)
        elif isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
            m.requires_grad_(True)
    params = []
    for nm, m in ref.visual.named_modules():
        if skip(nm):
            continue
        if isinstance(m, NORMS):
            for pn, p in m.named_parameters():
                if pn in ("weight", "bias"):
                    params.append(p)
    return ref, params


def sar_skip(nm: str) -> bool:
    """SAR's and DeYO's `configure_trainable_parameters` rule on a module name."""
    return ("layer4" in nm or "blocks.9" in nm or "blocks.10" in nm or "blocks.11" in nm or "norm." in nm
            or nm in ["norm"])


def norm_forward(model: nn.Module, images: torch.Tensor, text: torch.Tensor, scale: float) -> torch.Tensor:
    """`ClipTestTimeTuningNorm.forward`: scale * (f / |f|) @ text.T with f the image encoder's output."""
    pre = model.visual(images)
    feats = pre / pre.norm(dim=-1, keepdim=True)
    return scale * (feats @ text.t())


def softmax_entropy(x: torch.Tensor) -> torch.Tensor:
    """TTABC `ttabc/utils/tools.py:softmax_entropy`."""
    return -(x.softmax(1) * x.log_softmax(1)).sum(1)


def adamw(params: list[nn.Parameter], lr: float = 5e-3, wd: float = 1e-4) -> torch.optim.Optimizer:
    """TTABC `build_optimizer` for "AdamW": lr from main.py's --lr, weight decay 1e-4, betas (0.9, 0.999)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=(0.9, 0.999))


def ref_tent(model: nn.Module, pixels: torch.Tensor, text: torch.Tensor, scale: float, batch: int, *,
             steps: int = 1, lr: float = 5e-3, after_update: bool = True) -> torch.Tensor:
    """TTABC `tent.py:test_time_adapt_eval` over the stream `pixels` (N, 3, S, S) cut into batches of `batch`, on the
    CPU (no autocast, no scaling): per batch `steps` x (forward, mean entropy, zero_grad, backward, step), then the
    prediction forward (or, `after_update=False`, the last adapting forward's logits as the original Tent)."""
    ref, params = configured_copy(model)
    opt = adamw(params, lr)
    rows = []
    for s in range(0, len(pixels), batch):
        images = pixels[s:s + batch]
        logits = None
        for _ in range(steps):
            logits = norm_forward(ref, images, text, scale)
            loss = softmax_entropy(logits).mean(0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if after_update or logits is None:
            with torch.no_grad():
                logits = norm_forward(ref, images, text, scale)
        rows.append(logits.detach())
    return torch.cat(rows)


def pixel_stream(n: int, size: int, seed: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(n, 3, size, size) random 'preprocessed images' (standard normal, as normalised pixels roughly are)."""
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def text_prototypes(k: int, d: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(k, d) random L2-normalised class prototypes."""
    return F.normalize(torch.randn(k, d, generator=torch.Generator().manual_seed(seed), dtype=dtype), dim=-1)


def make_method(cls: type, model: nn.Module, pixels: torch.Tensor, text: torch.Tensor, scale: float,
                **changes: Any) -> Any:
    """`cls` built on `model` (a bare open_clip model, float64 in exact tests) with its default config and
    `changes`, fed `pixels` by stream position."""
    import dataclasses

    cfg = dataclasses.replace(cls.default_config("dtd", "ViT-B-16"), **changes)
    m = cls(cfg, text, scale, backbone="tiny", dataset="dtd", text_encoder=model, class_names=None)
    m.attach_pixels(lambda a, b: pixels[a:b])
    return m


def run_batches(method: Any, n: int, batch: int, v: int = 1, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The run's adapt calls over n positions in batches of `batch` (the cached features are not read by these
    methods: zeros of the right shape)."""
    out = [method.adapt(torch.zeros(min(batch, n - s), v, method.dim, dtype=dtype)) for s in range(0, n, batch)]
    return torch.cat(out)


def logit_tol(scale: float, steps: int, dtype: torch.dtype = torch.float64) -> float:
    """Tolerance of adapted logits against the transcription: both run the same float64 operations except in
    order-dependent reductions (a few eps per reduction, amplified through the steps and the logit scale)."""
    return 1e3 * (1 + steps) * torch.finfo(dtype).eps * scale * math.sqrt(64)
