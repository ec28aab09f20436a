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

from tests.support.online import prototypes as text_prototypes  # noqa: F401  (imported from here by the tests)

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


def ref_negatives(batch: torch.Tensor, patch: int, gen: torch.Generator) -> torch.Tensor | None:
    """Panda's `batch_hedge_v6_images` written out patch by patch, its draws (`torch.randint`) from `gen` in the
    official order: per negative image the base index, then one source index per patch, redrawn while equal to the
    base. None for a batch of one image (the official loop would not end)."""
    b, c, h, w = batch.shape
    nh, nw = h // patch, w // patch
    if nh == 0 or nw == 0:
        return batch
    if b < 2:
        return None
    out = torch.zeros((math.ceil(b / 10), c, h, w), dtype=batch.dtype)
    for m in range(out.shape[0]):
        base = torch.randint(0, b, (1,), generator=gen).item()
        idx = torch.randint(0, b, (nh * nw,), generator=gen)
        mask = idx == base
        while mask.any():
            idx[mask] = torch.randint(0, b, (int(mask.sum().item()),), generator=gen)
            mask = idx == base
        out[m] = batch[base]
        for k in range(nh * nw):
            i, j = divmod(k, nw)
            out[m, :, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch] = \
                batch[idx[k], :, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch]
    return out


def hedged_forward(model: nn.Module, images: torch.Tensor, text: torch.Tensor, scale: float,
                   panda: tuple[float, int, torch.Generator] | None) -> torch.Tensor:
    """`norm_forward`, or with Panda (β, patch, generator) TTABC `panda.py:panda_logits`: z − β·mean z(negatives)."""
    logits = norm_forward(model, images, text, scale)
    if panda is None:
        return logits
    beta, patch, gen = panda
    negatives = ref_negatives(images, patch, gen)
    if negatives is None:
        return logits
    return logits - beta * norm_forward(model, negatives, text, scale).mean(dim=0, keepdim=True)


def softmax_entropy(x: torch.Tensor) -> torch.Tensor:
    """TTABC `ttabc/utils/tools.py:softmax_entropy`."""
    return -(x.softmax(1) * x.log_softmax(1)).sum(1)


def adamw(params: list[nn.Parameter], lr: float = 5e-3, wd: float = 1e-4) -> torch.optim.Optimizer:
    """TTABC `build_optimizer` for "AdamW": lr from main.py's --lr, weight decay 1e-4, betas (0.9, 0.999)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=(0.9, 0.999))


def ref_tent(model: nn.Module, pixels: torch.Tensor, text: torch.Tensor, scale: float, batch: int, *,
             steps: int = 1, lr: float = 5e-3, after_update: bool = True,
             panda: tuple[float, int, int] | None = None) -> torch.Tensor:
    """TTABC `tent.py:test_time_adapt_eval` over the stream `pixels` (N, 3, S, S) cut into batches of `batch`, on the
    CPU (no autocast, no scaling): per batch `steps` x (forward, mean entropy, zero_grad, backward, step), then the
    prediction forward (or, `after_update=False`, the last adapting forward's logits as the original Tent). With
    `panda` (β, patch, seed): TTABC `panda.py`, every forward hedged, the draws of a batch from
    `batch_generator(seed, first position)` (the method's documented seeding)."""
    from extract.methods.panda import batch_generator

    ref, params = configured_copy(model)
    opt = adamw(params, lr)
    rows = []
    for s in range(0, len(pixels), batch):
        images = pixels[s:s + batch]
        hedge = None if panda is None else (panda[0], panda[1], batch_generator(panda[2], s))
        logits = None
        for _ in range(steps):
            logits = hedged_forward(ref, images, text, scale, hedge)
            loss = softmax_entropy(logits).mean(0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if after_update or logits is None:
            with torch.no_grad():
                logits = hedged_forward(ref, images, text, scale, hedge)
        rows.append(logits.detach())
    return torch.cat(rows)


def image_size(model: Any) -> int:
    """The input side of an open_clip model (or of a `LoadedModel`'s)."""
    size = getattr(model, "model", model).visual.image_size
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def pixel_stream(n: int, size: int, seed: int = 3, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(n, 3, size, size) random 'preprocessed images' (standard normal, as normalised pixels roughly are)."""
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


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


class RefSAM(torch.optim.Optimizer):
    """davda54/sam as TTABC `sar.py` and mr-eggplant/SAR `sam.py` ship it: an Optimizer whose base optimizer (SGD)
    shares its param groups; `load_state_dict` restores SAM's own state and groups, not the base's momentum."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, adaptive=False, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        shared = self.param_groups[0]["params"][0].device
        grad_norm = torch.norm(torch.stack([p.grad.norm(p=2).to(shared) for g in self.param_groups
                                            for p in g["params"] if p.grad is not None]), p=2)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                p.add_(1.0 * p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups


def ref_sar(model: nn.Module, pixels: torch.Tensor, text: torch.Tensor, scale: float, batch: int, *,
            lr: float = 5e-3, margin_e0: float = 0.4, reset_em: float = 0.2, steps: int = 1,
            panda: tuple[float, int, int] | None = None) -> tuple[torch.Tensor, int]:
    """TTABC `sar.py:test_time_adapt_eval` on the CPU: per batch `steps` x (forward, reliable entropy, SAM first
    step, forward, reliable entropy again, ema, SAM second step, recovery when ema < reset_em), then the prediction
    forward. Returns (rows, recoveries). With `panda` (β, patch, seed): ruxideng/Panda `SAR.py`
    `_forward_and_adapt_batchhedgev6`, every forward hedged with fresh negatives."""
    from extract.methods.panda import batch_generator

    ref, params = configured_copy(model, skip=sar_skip)
    opt = RefSAM(params, torch.optim.SGD, lr=lr, momentum=0.9)
    model_state, optim_state = copy.deepcopy(ref.state_dict()), copy.deepcopy(opt.state_dict())
    ema, recoveries, rows = None, 0, []
    for s in range(0, len(pixels), batch):
        images = pixels[s:s + batch]
        hedge = None if panda is None else (panda[0], panda[1], batch_generator(panda[2], s))
        for _ in range(steps):
            logits1 = hedged_forward(ref, images, text, scale, hedge)
            margin = margin_e0 * math.log(logits1.size(1))
            ent1 = softmax_entropy(logits1)
            ids1 = torch.where(ent1 < margin)
            ent1[ids1].mean(0).backward()
            opt.first_step(zero_grad=True)
            ent2 = softmax_entropy(hedged_forward(ref, images, text, scale, hedge))[ids1]
            loss2 = ent2[torch.where(ent2 < margin)].mean(0)
            if not loss2.isnan().item():
                ema = loss2.item() if ema is None else 0.9 * ema + (1 - 0.9) * loss2.item()
            loss2.backward()
            opt.second_step(zero_grad=True)
            if ema is not None and ema < reset_em:
                ref.load_state_dict(model_state, strict=False)
                opt.load_state_dict(optim_state)
                ema, recoveries = None, recoveries + 1
        with torch.no_grad():
            rows.append(hedged_forward(ref, images, text, scale, hedge))
    return torch.cat(rows), recoveries


def ref_shuffle(x: torch.Tensor, patch_len: int, gen: torch.Generator) -> torch.Tensor:
    """DeYO's "patch" x' written out: resize to a multiple of patch_len, cut each image into patch_len x patch_len
    patches in row-major order, put them back in the order argsort(rand) gives, resize back (torchvision Resize)."""
    import torchvision

    s = x.shape[-1]
    inner = s // patch_len * patch_len
    x = torchvision.transforms.Resize((inner, inner))(x)
    h = inner // patch_len
    perm = torch.argsort(torch.rand(x.shape[0], patch_len * patch_len, generator=gen), dim=-1)
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        tiles = [x[b, :, i * h:(i + 1) * h, j * h:(j + 1) * h] for i in range(patch_len) for j in range(patch_len)]
        for slot, src in enumerate(perm[b].tolist()):
            i, j = divmod(slot, patch_len)
            out[b, :, i * h:(i + 1) * h, j * h:(j + 1) * h] = tiles[src]
    return torchvision.transforms.Resize((s, s))(out)


def ref_deyo(model: nn.Module, pixels: torch.Tensor, text: torch.Tensor, scale: float, batch: int, *,
             deyo_margin: float = 0.5, margin: float = 0.4, plpd_threshold: float = 0.3, patch_len: int = 4,
             lr: float = 5e-3, seed: int = 0, panda: tuple[float, int, int] | None = None) -> torch.Tensor:
    """TTABC `deyo.py:test_time_adapt_eval` on the CPU ("patch", both reweightings, AdamW): per batch the filtered,
    PLPD-weighted entropy step (none when every sample is filtered), then the prediction forward. The shuffles draw
    from `extract.methods.panda.batch_generator(seed, first position)`, the method's documented seeding. With
    `panda` (β, patch, seed): ruxideng/Panda `DeYO.py` `forward_and_adapt_batchhedgev6` (the negatives of the kept
    images for x', PLPD against their mean logits, the entropy of the hedged logits), TTABC's detached weights."""
    from extract.methods.panda import SHUFFLE_DRAWS, batch_generator

    ref, params = configured_copy(model, skip=sar_skip)
    opt = adamw(params, lr)
    rows = []
    for s in range(0, len(pixels), batch):
        images = pixels[s:s + batch]
        outputs = norm_forward(ref, images, text, scale)
        k = outputs.shape[1]
        entropies = softmax_entropy(outputs)
        ids1 = torch.where(entropies < deyo_margin * math.log(k))
        entropies = entropies[ids1]
        negatives = None
        if len(entropies) and panda is not None:
            negatives = ref_negatives(images[ids1].detach(), panda[1], batch_generator(panda[2], s))
        if len(entropies) and negatives is not None:
            with torch.no_grad():
                shuffle = norm_forward(ref, negatives, text, scale).mean(0, keepdim=True).expand(len(ids1[0]), -1)
            hedge = outputs[ids1] - panda[0] * shuffle
            prob, prob_prime = hedge.softmax(1), shuffle.softmax(1)
            entropies = softmax_entropy(hedge)
        elif len(entropies):
            x_prime = ref_shuffle(images[ids1].detach(), patch_len, batch_generator(seed, s, SHUFFLE_DRAWS))
            with torch.no_grad():
                outputs_prime = norm_forward(ref, x_prime, text, scale)
            prob, prob_prime = outputs[ids1].softmax(1), outputs_prime.softmax(1)
        if len(entropies):
            cls1 = prob.argmax(dim=1)
            plpd = (torch.gather(prob, 1, cls1.reshape(-1, 1)) - torch.gather(prob_prime, 1, cls1.reshape(-1, 1)))
            plpd = plpd.reshape(-1)
            ids2 = torch.where(plpd > plpd_threshold)
            entropies, plpd = entropies[ids2], plpd[ids2]
            if len(entropies):
                coeff = (1.0 * (1. / torch.exp(entropies.clone().detach() - margin * math.log(k)))
                         + 1.0 * (1. / torch.exp(-1. * plpd.clone().detach())))
                entropies.mul(coeff).mean(0).backward()
                opt.step()
        opt.zero_grad()
        with torch.no_grad():
            rows.append(norm_forward(ref, images, text, scale))
    return torch.cat(rows)


def ref_batclip(model: nn.Module, tokens: torch.Tensor, pixels: torch.Tensor, scale: float, batch: int, *,
                lr: float = 5e-4, wd: float = 0.01) -> torch.Tensor:
    """BATCLIP `ours.py` over the stream on the CPU (no autocast; the CPU GradScaler is off): `configure_model` on
    a copy of the whole model, `collect_params`, AdamW (BETA 0.9, WD 0.01); per batch the bimodal forward
    (`ZeroShotCLIP.forward`, text encoder not frozen), entropy − I2T − InterMean (`utils/losses.py` written out),
    one step; the rows are the forward's logits."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    for m in ref.modules():
        if isinstance(m, (nn.LayerNorm, nn.BatchNorm1d, nn.GroupNorm)):
            m.train()
            m.requires_grad_(True)
        elif isinstance(m, nn.BatchNorm2d):
            m.train()
            m.requires_grad_(True)
            m.track_running_stats = False
            m.running_mean = None
            m.running_var = None
    params = [p for m in ref.modules() if isinstance(m, NORMS) for n, p in m.named_parameters()
              if n in ("weight", "bias")]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=wd)
    rows = []
    for s in range(0, len(pixels), batch):
        images = pixels[s:s + batch]
        img_pre = ref.encode_image(images)
        img = img_pre / img_pre.norm(dim=1, keepdim=True)
        text_pre = ref.encode_text(tokens)
        text = text_pre / text_pre.norm(dim=1, keepdim=True)
        logits = scale * img @ text.T
        labels = torch.argmax(logits.softmax(1), dim=1)
        i2t, means = 0.0, []
        for c in torch.unique(labels, sorted=True).tolist():
            mean = img_pre[labels == c].mean(0)
            i2t = i2t + torch.matmul(mean.unsqueeze(0), text[c].unsqueeze(0).t()).mean()
            means.append(mean / mean.norm())
        i2t = i2t / len(means)
        cos = torch.matmul(torch.stack(means), torch.stack(means).t())
        inter = (1 - cos).fill_diagonal_(0).sum()
        loss = softmax_entropy(logits).mean(0) - i2t - inter
        opt.zero_grad()
        loss.backward()
        opt.step()
        rows.append(logits.detach())
    return torch.cat(rows)


def resumed_rows(build: Callable[[], Any], n: int, batch: int, cut: int, path: Any) -> tuple[Any, Any, torch.Tensor]:
    """A method's rows over n positions when it stops after `cut` positions (a batch boundary), its state is saved
    with `torch.save` and loaded with `weights_only=True` into a fresh method (`build()`), which continues: returns
    (the first method, the second, the rows); a test compares the rows with an uninterrupted run's."""
    first = build()
    head = run_batches(first, cut, batch)
    torch.save(first.state_dict(), path)
    second = build()
    second.load_state_dict(torch.load(path, weights_only=True))
    assert second.n_seen == cut
    rest = [second.adapt(torch.zeros(min(batch, n - s), 1, second.dim, dtype=torch.float64))
            for s in range(cut, n, batch)]
    return first, second, torch.cat([head, *rest])


def emulate_cuda(monkeypatch: Any, cls: type, dtype: torch.dtype = torch.bfloat16) -> None:
    """A normalisation-layer method's CUDA path on the CPU: autocast on the CPU in `dtype` (fp16 autocast is
    CUDA's) and, where the method scales its loss, an enabled CPU GradScaler (`_use_amp` True)."""
    import contextlib

    @contextlib.contextmanager
    def cpu_autocast(self: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            yield

    monkeypatch.setattr(cls, "_use_amp", lambda self, device: True)
    monkeypatch.setattr(cls, "_autocast", cpu_autocast)
