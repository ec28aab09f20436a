"""Panda: negative data augmentation as a plug-in, `--set panda=true` on Tent, SAR, DeYO, TPT, ZERO and DMN
(ruxideng/Panda `src/methods/shuffle.py` and its method files; TTABC `ttabc/model_selection/panda.py`;
docs/methods.md, "Panda (`--set panda=true`)").

From a batch of B test images, M = ceil(B / 10) negative images (`negative_images`, the official
`batch_hedge_v6_images`): each keeps one image of the batch as its base and replaces every P×P patch of the
region the patches tile by the patch at the same place of another image of the batch, chosen at random per patch
(never the base). The mean of their logits (or L2-normalised features) is what a prediction owes to the batch
rather than to its image; it is subtracted, weighted by β = `panda_beta` (0.2):

    z̃ = z − β · mean_j z(negative_j)

On the methods that adapt the image encoder (Tent, SAR, DeYO, `extract/methods/normtta.py`) the negatives go
through the adapted encoder; on the methods of cached features (TPT, ZERO, DMN, `PandaPlugin`) through the frozen
one, as the official method files do, and the shift is applied to the view features: f − β·m̄ (m̄ the mean of the
negatives' normalised features; TPT renormalises, ZERO and DMN do not).

Random draws: the official code uses the global RNG (`torch.randint` on the batch's device); here each batch draws
from its own generator seeded with (`panda_seed`, the batch's first stream position), so that a batch's negatives
never depend on the batches before it (a resumed run, a longer --limit and a replay draw the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from extract.methods.base import Consumes, MethodConfig, setting


#: The methods Panda plugs into: TTABC's hosts (`panda.py` on Tent, SAR, DeYO, TPT, ZERO, DMN) and DMN-weak (DMN on
#: the original view, the same class). A config of another method inherits the fields (C-TPT, RLCF, DiffTPT from
#: TPT's) but refuses `panda=true` (`PandaPlugin.config_refusal`): their own views or features (RLCF's reward
#: features, DiffTPT's generated views) are not what Panda's shift was written for, and TTABC never runs them so.
PANDA_HOSTS: tuple[str, ...] = ("tent", "sar", "deyo", "tpt", "zero", "dmn", "dmn-weak")
#: Panda's fields are recorded in a run's `method_config` only with `panda=true` (`extract.run.options.config_dict`,
#: field metadata `recorded_with`): a host's finished runs written before Panda existed keep matching their settings.
_WITH_PANDA = {"recorded_with": "panda"}


@dataclass(frozen=True)
class PandaFields:
    """Panda's settings on a host method (TTABC `panda.py`: `panda_beta` 0.2, `panda_patch_size` 32)."""

    # Panda's negative-augmentation offset on this method (`--set panda=true`)
    panda: bool = field(default=False, metadata=_WITH_PANDA)
    # β of z - β·mean(z(negatives)) (`getattr(args, "panda_beta", 0.2)`)
    panda_beta: float = setting(0.2, ge=0, metadata=_WITH_PANDA)
    # the patches' side in pixels (`batch_hedge_v6_images(patch_size=32)`)
    panda_patch_size: int = setting(32, ge=1, metadata=_WITH_PANDA)
    # seeds each batch's draws with its first stream position (module docstring)
    panda_seed: int = setting(0, ge=0, metadata=_WITH_PANDA)


@dataclass(frozen=True)
class PandaBatchFields(PandaFields):
    """Panda on a method of one sample at a time (TPT, ZERO, DMN): the batch of test images its negatives are drawn
    from (the official `--batch_size`, whose configs are not released; TTABC's batch, 64)."""

    panda_batch_size: int = setting(64, ge=1, metadata=_WITH_PANDA)


#: the draws of a batch a generator serves (`batch_generator`): Panda's negative images, DeYO's shuffles
PANDA_DRAWS, SHUFFLE_DRAWS = 1, 2


def batch_generator(seed: int, position: int, draws: int = PANDA_DRAWS) -> torch.Generator:
    """The CPU generator of the batch that starts at stream `position`, for one kind of `draws`
    (`numpy.random.SeedSequence([seed, position, draws])`: batches and kinds never share draws)."""
    state = np.random.SeedSequence([int(seed), int(position), int(draws)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))


def negative_images(batch: torch.Tensor, patch_size: int, gen: torch.Generator) -> torch.Tensor | None:
    """Panda's negative images of a batch (`batch_hedge_v6_images`, the official loop with the draws from `gen`).

    Args:
        batch: (B, C, H, W) images. patch_size: the patches' side P. gen: the batch's CPU generator.

    Returns:
        (M, C, H, W), M = ceil(B / 10): image m is batch[base_m] with the region [0, ⌊H/P⌋P) × [0, ⌊W/P⌋P) made of
        the patch at each place from another image of the batch (its index drawn uniformly, drawn again while it
        equals the base). The batch itself when no patch fits (the official early return); None for B < 2, where
        no other image exists (the official loop never ends there).
    """
    b, c, h, w = batch.shape
    nh, nw = h // patch_size, w // patch_size
    if nh == 0 or nw == 0:
        return batch
    if b < 2:
        return None
    eh, ew, n = nh * patch_size, nw * patch_size, nh * nw
    patches = (batch[:, :, :eh, :ew].unfold(2, patch_size, patch_size).unfold(3, patch_size, patch_size)
               .permute(0, 2, 3, 1, 4, 5).reshape(b, n, c, patch_size, patch_size))
    out = torch.zeros((math.ceil(b / 10), c, h, w), device=batch.device, dtype=batch.dtype)
    for m in range(out.shape[0]):
        base = int(torch.randint(0, b, (1,), generator=gen))
        idx = torch.randint(0, b, (n,), generator=gen)
        mask = idx == base
        while mask.any():
            idx[mask] = torch.randint(0, b, (int(mask.sum()),), generator=gen)
            mask = idx == base
        region = (patches[idx.to(batch.device), torch.arange(n, device=batch.device)]
                  .reshape(nh, nw, c, patch_size, patch_size).permute(2, 0, 3, 1, 4).reshape(c, eh, ew))
        image = batch[base].clone()
        image[:, :eh, :ew] = region
        out[m] = image
    return out


class PandaPlugin:
    """Panda on a method of cached features (TPT, ZERO, DMN): with `panda` set its config reads batches of
    `panda_batch_size` test images' pixels (`consumes_for`, `adapt_width`), and `panda_shift` moves a batch's view
    features by −β·m̄, m̄ the mean normalised feature of the batch's negative images through the frozen encoder
    (the model the run passes as `text_encoder`). Put it before `TTAMethod` in the bases."""

    consumes: ClassVar[Consumes]
    config: MethodConfig
    n_seen: int
    text_encoder: Any

    key: ClassVar[str]

    @classmethod
    def consumes_for(cls, config: MethodConfig) -> Consumes:
        return "batch_pixels" if getattr(config, "panda", False) else cls.consumes

    @classmethod
    def config_refusal(cls, config: MethodConfig) -> str | None:
        """`panda=true` on a method that inherits Panda's fields but is none of its hosts (`PANDA_HOSTS`)."""
        if getattr(config, "panda", False) and cls.key not in PANDA_HOSTS:
            return (f"{cls.key}: panda=true applies to {', '.join(PANDA_HOSTS)} (TTABC's hosts of Panda, and DMN-weak); "
                    f"{cls.key} inherits the setting from its parent method but does not run with it")
        return None

    @classmethod
    def adapt_width(cls, config: MethodConfig) -> int | None:
        return int(config.panda_batch_size) if getattr(config, "panda", False) else None  # type: ignore[attr-defined]

    def attach_pixels(self, reader: Callable[[int, int], torch.Tensor]) -> None:
        self._panda_pixels = reader

    def _negative_mean(self, b: int, device: torch.device) -> torch.Tensor | None:
        """(D,) m̄ of the batch at [n_seen, n_seen + b), or None when it has no negative image (one image)."""
        reader = getattr(self, "_panda_pixels", None)
        if reader is None:
            raise ValueError(f"{getattr(self, 'key', 'method')} with panda=true reads the batch's pixels; the runner "
                             "attaches them (`attach_pixels`)")
        cfg: Any = self.config
        images = torch.as_tensor(reader(self.n_seen, self.n_seen + b))
        negatives = negative_images(images, cfg.panda_patch_size, batch_generator(cfg.panda_seed, self.n_seen))
        if negatives is None:
            return None
        encode = getattr(self.text_encoder, "encode_images", None)
        if encode is None:  # a bare open_clip model (tests)
            with torch.no_grad():
                return F.normalize(self.text_encoder.encode_image(negatives), dim=-1).mean(0).to(device)
        return encode(negatives).mean(0).to(device)

    def panda_shift(self, view_feats: torch.Tensor, renormalize: bool = False) -> torch.Tensor:
        """(B, V, D) view features moved by −β·m̄ (TPT's CoOp model renormalises them: `renormalize`); unchanged
        without `panda` or without negative images."""
        cfg: Any = self.config
        if not getattr(cfg, "panda", False):
            return view_feats
        mean = self._negative_mean(view_feats.shape[0], view_feats.device)
        if mean is None:
            return view_feats
        shifted = view_feats - cfg.panda_beta * mean.to(view_feats.dtype)
        return F.normalize(shifted, dim=-1) if renormalize else shifted
