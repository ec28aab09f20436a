"""DeYO on CLIP: entropy minimisation of the image encoder's normalisation layers over batches, on the samples that
are confident and whose prediction a patch shuffle disturbs (PLPD), reweighted by both (TTABC
`ttabc/model_selection/deyo.py`; BATCLIP's port `classification/methods/deyo.py`; the original Jhyun17/DeYO
`methods/deyo.py`; docs/methods.md, "DeYO (`deyo`)").

Per batch (batches of 64 along the stream, the adaptation carried across them), under autocast, with K classes:

1. z = the batch's logits, H = softmax entropy; the samples with H < 0.5 · ln K (`deyo_margin`) stay;
2. x' = those images with their 4×4 grid of patches shuffled (`aug_type` "patch"; "occ" paints a mean-colour
   square, "pixel" shuffles every pixel); z' = their logits (no gradient);
3. PLPD = p(ŷ | x) − p(ŷ | x') with ŷ = argmax p(· | x); the samples with PLPD > 0.3 stay;
4. loss = mean of H · (exp(−(H − 0.4 · ln K)) + exp(PLPD)) over them, the weights detached; a scaled AdamW step
   (lr 5e-3, weight decay 1e-4); no step when no sample stays.

The rows are a forward of the updated encoder (`predict`). What trains: the normalisation layers of the image
encoder except the top ones the official rule skips (`extract.methods.sar.official_skip`). The patch permutations
come from a generator seeded per batch (`aug_seed`, the batch's first stream position), where the official code
draws from the global RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torchvision.transforms.functional as TF

from extract.methods.base import MethodConfig, check_hparams_key, setting
from extract.methods.common import softmax_entropy
from extract.methods.normtta import NormConfig, NormTTA
from extract.methods.panda import SHUFFLE_DRAWS, PandaFields, batch_generator, negative_images
from extract.methods.sar import official_skip

AugType = Literal["patch", "occ", "pixel"]


@dataclass(frozen=True)
class DeYOConfig(PandaFields, NormConfig):
    """DeYO's settings: TTABC `ttabc/configs/algorithms.py` "deyo" (AdamW, batch 64, `deyo_margin` 0.5, `margin`
    0.4, `plpd_threshold` 0.3, `aug_type` patch, `patch_len` 4, occlusion 112 at (56, 56), both reweightings);
    `main.py` `--lr 5e-3`."""

    deyo_margin: float = setting(0.5, ge=0)  # samples with H < 0.5 · ln K adapt
    margin_e0: float = setting(0.4, ge=0)  # the entropy weight exp(-(H - 0.4 · ln K)) ("margin")
    plpd_threshold: float = setting(0.3, ge=-1, le=1)  # samples with PLPD > 0.3 adapt (a difference of probabilities)
    aug_type: AugType = "patch"
    patch_len: int = setting(4, ge=1)  # "patch": a patch_len x patch_len grid
    occlusion_size: int = setting(112, ge=0)  # "occ": the square's side
    row_start: int = setting(56, ge=0)
    column_start: int = setting(56, ge=0)
    reweight_ent: bool = True  # reweight_ent 1
    reweight_plpd: bool = True  # reweight_plpd 1
    aug_seed: int = setting(0, ge=0)  # seeds each batch's shuffles with its first stream position


def shuffled(images: torch.Tensor, cfg: DeYOConfig, gen: torch.Generator) -> torch.Tensor:
    """DeYO's x' (TTABC `deyo.py:loss_calculation`): (N, 3, S, S) -> the same images, detached, with the
    `aug_type` disturbance; the random permutations drawn from `gen` on the CPU, as `torch.rand` draws them."""
    x = images.detach().clone()
    n, c, s = x.shape[0], x.shape[1], x.shape[-1]
    if cfg.aug_type == "occ":
        mean = x.reshape(n, c, -1).mean(dim=2)[..., None, None]
        size = cfg.occlusion_size
        x[:, :, cfg.row_start:cfg.row_start + size, cfg.column_start:cfg.column_start + size] = \
            mean.expand(-1, -1, size, size)
        return x
    if cfg.aug_type == "pixel":
        flat = x.reshape(n, c, -1)[:, :, torch.randperm(s * s, generator=gen).to(x.device)]
        return flat.reshape(n, c, s, s)
    k = cfg.patch_len
    inner = (s // k) * k
    x = TF.resize(x, [inner, inner])  # torchvision.transforms.Resize((s // k * k,) * 2): bilinear, antialias
    h = inner // k
    # 'b c (ps1 h) (ps2 w) -> b (ps1 ps2) c h w'
    patches = x.reshape(n, c, k, h, k, h).permute(0, 2, 4, 1, 3, 5).reshape(n, k * k, c, h, h)
    order = torch.argsort(torch.rand(n, k * k, generator=gen), dim=-1).to(x.device)
    patches = patches[torch.arange(n, device=x.device).unsqueeze(-1), order]
    x = patches.reshape(n, k, k, c, h, h).permute(0, 3, 1, 4, 2, 5).reshape(n, c, inner, inner)
    return TF.resize(x, [s, s])


class DeYO(NormTTA):
    """DeYO: per batch, an entropy step on the confident samples a patch shuffle disturbs, online."""

    key: ClassVar[str] = "deyo"
    prefix_stable: ClassVar[bool] = True  # a batch's rows read that batch and the ones before it
    Config: ClassVar[type[MethodConfig]] = DeYOConfig
    # DeYO's statistics: the samples that passed the entropy filter and the PLPD filter, and the steps without any
    _state_fields: ClassVar[tuple[str, ...]] = ("steps_done", "skipped_steps", "passed_entropy", "passed_plpd",
                                                "empty_steps")
    # Unseen data: DeYO has one setting for every set
    unseen_like: ClassVar[str] = "dtd"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any
                 ) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.passed_entropy = self.passed_plpd = self.empty_steps = 0
        cfg: DeYOConfig = self.config  # type: ignore[assignment]
        size = self.visual.image_size
        size = size[0] if isinstance(size, (tuple, list)) else int(size)
        reach = max(cfg.row_start, cfg.column_start) + cfg.occlusion_size
        if cfg.aug_type == "occ" and reach > size:  # the official slice assignment would fail on the first batch
            raise ValueError(f"deyo: aug_type=occ paints a {cfg.occlusion_size}-pixel square at ({cfg.row_start}, "
                             f"{cfg.column_start}), beyond the model's {size}-pixel images; set occlusion_size, "
                             "row_start and column_start to fit")

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DeYOConfig:
        check_hparams_key(hparams_key)
        return DeYOConfig()

    def trains(self, name: str) -> bool:
        return not official_skip(name)

    def deyo_loss(self, images: torch.Tensor, gen: torch.Generator, panda: torch.Generator | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`loss_calculation` (inside autocast): (the batch's logits, the reweighted entropy of the samples both
        filters keep, or None when none is kept). With Panda (`panda`: its generator) its negatives take the
        shuffled images' place (ruxideng/Panda `DeYO.py` `forward_and_adapt_batchhedgev6`)."""
        cfg: DeYOConfig = self.config  # type: ignore[assignment]
        outputs, _ = self.logits(images)
        ln_k = math.log(outputs.shape[1])
        entropies = softmax_entropy(outputs)
        keep1 = torch.where(entropies < cfg.deyo_margin * ln_k)
        entropies = entropies[keep1]
        self.passed_entropy += int(entropies.numel())
        if entropies.numel() == 0:
            return outputs, None
        probs, probs_prime, hedged = self._plpd_probs(images[keep1], outputs[keep1], gen, panda)
        if hedged is not None:  # Panda: the entropy of the hedged logits
            entropies = softmax_entropy(hedged)
        cls1 = probs.argmax(dim=1).reshape(-1, 1)
        plpd = (torch.gather(probs, 1, cls1) - torch.gather(probs_prime, 1, cls1)).reshape(-1)
        keep2 = torch.where(plpd > cfg.plpd_threshold)
        entropies, plpd = entropies[keep2], plpd[keep2]
        self.passed_plpd += int(entropies.numel())
        if entropies.numel() == 0:
            return outputs, None
        if cfg.reweight_ent or cfg.reweight_plpd:
            coeff = (float(cfg.reweight_ent) * (1.0 / torch.exp(entropies.clone().detach() - cfg.margin_e0 * ln_k))
                     + float(cfg.reweight_plpd) * (1.0 / torch.exp(-1.0 * plpd.clone().detach())))
            entropies = entropies.mul(coeff)
        return outputs, entropies.mean(0)

    def _plpd_probs(self, kept: torch.Tensor, outputs: torch.Tensor, gen: torch.Generator,
                    panda: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What PLPD compares for the kept images `kept` (their logits `outputs`): (p(· | x), p(· | x'), None), or
        with Panda (p of the hedged logits z − β·z̄⁻, p of the negatives' mean logits z̄⁻, the hedged logits). Panda
        on fewer than 2 kept images (no negative image exists) falls back to DeYO's shuffled x'."""
        cfg: DeYOConfig = self.config  # type: ignore[assignment]
        negatives = negative_images(kept.detach(), cfg.panda_patch_size, panda) if panda is not None else None
        if negatives is None:
            with torch.no_grad():
                outputs_prime, _ = self.logits(shuffled(kept, cfg, gen))
            return outputs.softmax(1), outputs_prime.softmax(1), None
        with torch.no_grad():
            mean = self.logits(negatives)[0].mean(0, keepdim=True).expand(kept.shape[0], -1)
        hedged = outputs - cfg.panda_beta * mean
        return hedged.softmax(1), mean.softmax(1), hedged

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        cfg: DeYOConfig = self.config  # type: ignore[assignment]
        images = self.batch_images(view_feats.shape[0], self.device, self.params[0].dtype)
        gen = batch_generator(cfg.aug_seed, self.n_seen, SHUFFLE_DRAWS)
        panda = self.generator()
        adapting = None
        for _ in range(cfg.steps):
            with self._autocast():
                outputs, loss = self.deyo_loss(images, gen, panda)
            adapting = outputs.detach()
            if loss is not None:  # "update model only if not all instances have been filtered"
                self.scaled_step(loss)
            else:
                self.empty_steps += 1
            self.optimizer.zero_grad()
        # with Panda too the rows are the plain logits (Panda's DeYO returns `logits`, not the hedged ones)
        return self.predict(images, adapting, None)

    def summary(self) -> dict[str, Any]:
        """Steps taken and skipped by the loss scaler, steps without a kept sample, the samples each filter kept."""
        return {**super().summary(), "empty_steps": int(self.empty_steps),
                "passed_entropy": int(self.passed_entropy), "passed_plpd": int(self.passed_plpd)}
