"""DMN — Dual Memory Networks, zero-shot (Zhang et al., CVPR'24; official code `YBZh/DMN @c6c218c`), and DMN-weak.

docs/methods.md "DMN" is the spec. Online and training-free: a dynamic memory of at most `memory_size` view-0
features per pseudo-class persists along the stream (the learnable "mapping" parameters of the official `DualMem`
are zero in the zero-shot setting and drop out). Per sample, with views v = 0..V'-1 (V' = `used_views`):

1. p_v = softmax(s·x_v·t̂ᵀ) (t̂ the re-normalised text prototypes); the n = int(V'·0.1) views of lowest entropy
   -Σ p log(p + 1e-6) give init = mean of their p_v; pseudo-label ŷ = argmax init, its entropy
   h = -Σ init log(init + 1e-8) (`dmn_main.py` `select_confident_samples`, `DualMem.update_memory_bank`).
2. Memory write (before the read-out): x̂_0 = x_0/|x_0| joins class ŷ while it holds fewer than `memory_size`
   items; a full class replaces its highest-entropy item only if h is lower than some stored entropy.
3. Read-out per class c over keys = its stored features plus t̂_c: w_j = exp(-β(1 - x̂_0·k_j)),
   m_c = normalize(Σ_j w_j k_j); p_mem = softmax(s·x_0·m̂ᵀ) (`DualMem.get_image_pred`, "similarity_weighted").
4. Score p_text + w·p_mem with p_text = p_0 (view 0); the official w is searched on the test labels afterwards.

What the method returns (`output_kind = "log_probs"`): log((p_text + w·p_mem) / (1 + w)), the log of the official
score divided by its constant sum 1 + w (so each row is a distribution), computed as a logaddexp of the two
log-softmaxes so that no entry underflows to log 0. The ranking is the official score's.

Everything before the memory (per-view softmax, selection, pseudo-labels, entropies, p_text) is computed for the
whole chunk at once; the write and the read-out run per sample.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Mapping

import torch
import torch.nn.functional as F

from extract.methods.base import IMAGENET_FAMILY, MethodConfig, PromptSet, Ref, TTAMethod, check_hparams_key, setting
from extract.methods.common import n_confident
from extract.methods.panda import PandaBatchFields, PandaPlugin

# Entropy epsilons of the official code: view selection (`dmn_main.py` `select_confident_samples`) and the memory
# entropy of the averaged prediction (`dmn_main.py` `DualMem.update_memory_bank`).
SELECT_ENTROPY_EPS = 1e-6
MEMORY_ENTROPY_EPS = 1e-8

# w of p_text + w·p_mem per dataset: the values the official search picked on the test labels for ViT-B/16
# (`camera_ready_dmn_tf_searched_vit_0.txt`, `camera_ready_dmn_tf_shift_0.txt`, n_shot 0; `dmn_main.py`
# `direct_inference` searches 0.001 ... 1000). No RN50 log exists; the same values are used for every backbone.
DMN_MEMORY_WEIGHT: dict[str, float] = {
    "imagenet": 1.0, "imagenet_a": 3.0, "imagenet_v2": 1.0, "imagenet_r": 0.3, "imagenet_sketch": 1.0,
    "caltech101": 0.3, "dtd": 10.0, "eurosat": 0.3, "fgvc_aircraft": 1.0, "food101": 0.3, "flowers102": 10.0,
    "oxford_pets": 1.0, "stanford_cars": 0.3, "sun397": 3.0, "ucf101": 0.3,
}


DMNCrops = Literal["official", "shared"]


@dataclass(frozen=True)
class DMNConfig(PandaBatchFields, MethodConfig):
    """DMN's knobs; defaults are the zero-shot ImageNet run of `scripts/run.sh`; Panda's (`--set panda=true`,
    docs/methods.md "Panda (`--set panda=true`)"): off by default."""

    # The runner's multi-view policy (original + 63); DMN reads views 0 .. used_views-1 (see `used_views`).
    n_views: int = 64
    augmix: bool = False  # crop+flip on the ImageNet family, AugMix elsewhere (`dmn_main.py`: augmix=len(set_id) > 1)
    # "official": DMN's own crop + flip views on the ImageNet family, area U(0.5, 1) (`data/datautils.py`
    # `get_preaugment`), cached as their own policy ("crop_flip_05"); "shared": the U(0.08, 1) crops every other
    # crop + flip method uses (TPT's), read from the same cache, so no second encoding pass (zaec before issue 31).
    # The difference measures DMN on larger, less varied crops. AugMix views (the other sets) keep 0.08-1 either way
    crops: DMNCrops = "official"

    @property
    def crop_scale(self) -> tuple[float, float]:
        """The `crops` setting's area range (`extract.views.CROP_SCALE`); AugMix views keep 0.08-1."""
        return (0.5, 1.0) if self.crops == "official" and not self.augmix else (0.08, 1.0)

    prompts: PromptSet = "dataset"  # dataset templates (`data/imagnet_prompts.py` ID_to_prompts / tip templates)
    cupl: bool = True  # --text_prompt tip_cupl: templates + CuPL sentences (`scripts/run.sh`, `clip/fix_clip.py`)
    # -b 32: the original + 31 augmented views (`scripts/run.sh`)
    used_views: int = setting(32, ge=1, le=Ref("n_views"))
    selection_p: float = setting(0.1, gt=0, le=1)  # --selection_p 0.1 (`scripts/run.sh`)
    memory_size: int = setting(50, ge=1)  # --memory_size 50 (`scripts/run.sh`)
    beta: float = setting(5.5, ge=0)  # --beta 5.5 (`scripts/run.sh`)
    # w of p_text + w·p_mem; per dataset `DMN_MEMORY_WEIGHT` (searched on test labels)
    mem_weight: float = setting(1.0, ge=0)


class DMN(PandaPlugin, TTAMethod):
    """Zero-shot DMN with the official 32 views; returns log((p_text + w·p_mem) / (1 + w)) (module docstring).
    With Panda the text logits are s·(x − β·m̄)·t̂ᵀ while the memory keeps and reads the features themselves
    (ruxideng/Panda `DMN.py`: `orig_logits - beta * aug_logits`, the cache on `feat`)."""

    key: ClassVar[str] = "dmn"
    prefix_stable: ClassVar[bool] = True  # the memory holds only samples already seen
    Config: ClassVar[type[MethodConfig]] = DMNConfig
    #: what `adapt` returns: log-probabilities, not logits (the shard's `zaec:output_kind`, docs/contract.md)
    output_kind: ClassVar[str] = "log_probs"
    _state_fields: ClassVar[tuple[str, ...]] = ("memory", "mem_entropy", "mem_count")
    # Unseen data: ImageNet's row (w = 1, the value TTA-VLM uses everywhere: the other rows' w were searched on
    # test labels) with DMN's own views, 32 of 64 as on every official set (`scripts/run.sh` `-b 32` for all 15),
    # AugMix as on every set outside the ImageNet family (`augmix = len(set_id) > 1`), the 80 CLIP templates and
    # no CuPL (no sentences exist for unknown classes). One view would make it DMN-weak (`dmn-weak` is that run).
    unseen_like: ClassVar[str] = "imagenet"
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType(
        {"augmix": True, "prompts": "imagenet80", "cupl": False})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DMNConfig:
        check_hparams_key(hparams_key)
        return DMNConfig(augmix=hparams_key not in IMAGENET_FAMILY, mem_weight=DMN_MEMORY_WEIGHT[hparams_key])

    def __init__(self, config: DMNConfig, text_features: torch.Tensor, logit_scale: float, **kwargs) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self.memory: torch.Tensor | None = None  # (K, M, D) normalised view-0 features, zeros in empty slots
        self.mem_entropy: torch.Tensor | None = None  # (K, M) entropy h of each stored item
        self.mem_count: list[int] = [0] * self.n_classes

    def summary(self) -> dict[str, Any]:
        return {"memory_items": sum(self.mem_count), "classes_in_memory": sum(n > 0 for n in self.mem_count)}

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        c = self.config
        dt = self.compute_dtype(view_feats)
        v = min(view_feats.shape[1], c.used_views)
        x = view_feats[:, :v].to(dt)  # (B, V', D), L2-normalised by the encoder
        # the official re-normalises the prototypes (text_feat + a zero bias) before every use
        t = F.normalize(self.text_features.to(dt), dim=-1)  # (K, D)
        if self.memory is None:
            self.memory = torch.zeros(self.n_classes, c.memory_size, self.dim, dtype=dt, device=x.device)
            self.mem_entropy = torch.zeros(self.n_classes, c.memory_size, dtype=dt, device=x.device)
        z = self.logit_scale * self.panda_shift(x) @ t.T  # (B, V', K)
        p = z.softmax(-1)
        h_view = -(p * torch.log(p + SELECT_ENTROPY_EPS)).sum(-1)  # (B, V')
        sel = torch.argsort(h_view, dim=1, stable=True)[:, :n_confident(v, c.selection_p)]
        init = torch.gather(p, 1, sel[..., None].expand(-1, -1, p.shape[-1])).mean(1)  # (B, K)
        h = -(init * torch.log(init + MEMORY_ENTROPY_EPS)).sum(-1)  # (B,)
        log_text = z[:, 0].log_softmax(-1)  # log p_text: view 0
        f0 = x[:, 0]
        q = F.normalize(f0, dim=-1)  # what the memory stores and the read-out queries with
        log_mem = torch.empty_like(log_text)
        for i, y in enumerate(init.argmax(-1).tolist()):  # sequential by nature: the memory changes per sample
            self._write(y, q[i], h[i])
            log_mem[i] = self._read(q[i], f0[i], t).log_softmax(-1)
        return mix_log_probs(log_text, log_mem, c.mem_weight)

    def _write(self, y: int, feat: torch.Tensor, h: torch.Tensor) -> None:
        """`update_memory_bank`: append while class y has room, else replace its highest-entropy item if h is lower
        than some stored entropy (equivalently, than the highest). Of tied highest entropies the last slot goes."""
        assert self.memory is not None and self.mem_entropy is not None
        n = self.mem_count[y]
        if n < self.config.memory_size:
            self.memory[y, n], self.mem_entropy[y, n] = feat, h
            self.mem_count[y] = n + 1
            return
        e = self.mem_entropy[y]
        j = e.shape[0] - 1 - int(e.flip(0).argmax())  # argmax returns the first maximum; flipped: the last
        if bool(h < e[j]):
            self.memory[y, j], self.mem_entropy[y, j] = feat, h

    def _read(self, query: torch.Tensor, f0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """`get_image_pred` ("similarity_weighted"): (K,) memory logits s·f0·m̂_c for the normalised query."""
        assert self.memory is not None
        k, m, d = self.memory.shape
        w_mem = torch.exp(-self.config.beta * (1.0 - (self.memory.reshape(k * m, d) @ query).reshape(k, m)))
        w_text = torch.exp(-self.config.beta * (1.0 - t @ query))  # (K,)
        # empty slots hold zeros: whatever their weight, they add nothing
        value = torch.einsum("km,kmd->kd", w_mem, self.memory) + w_text[:, None] * t
        return self.logit_scale * F.normalize(value, dim=-1) @ f0


def mix_log_probs(log_a: torch.Tensor, log_b: torch.Tensor, weight: float) -> torch.Tensor:
    """log((a + w·b) / (1 + w)) from log a and log b, in log space (no entry becomes log 0 by underflow).

    Args:
        log_a, log_b: (..., K) log-probabilities.
        weight: w >= 0 (w = 0 returns log a).

    Example:
        >>> a, b = torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])
        >>> mix_log_probs(a.log(), b.log(), 1.0).exp()
        tensor([0.7500, 0.2500])
    """
    if weight == 0:
        return log_a.clone()
    return torch.logaddexp(log_a - math.log1p(weight), log_b + (math.log(weight) - math.log1p(weight)))


class DMNWeak(DMN):
    """DMN-weak (TTA-VLM's name; no official mode): DMN on the original view alone.

    With one view the official selection int(1·0.1) = 0 keeps no view (NaN pseudo-labels); here the single view is
    its own pseudo-label source (`n_confident` keeps at least one view). Everything else is DMN's, including the
    per-dataset w of `DMN_MEMORY_WEIGHT`.
    """

    key: ClassVar[str] = "dmn-weak"
    prefix_stable: ClassVar[bool] = True  # as DMN
    # Unseen data: DMN's (ImageNet's row, w = 1, the 80 CLIP templates, no CuPL) on its one view
    unseen_changes: ClassVar[Mapping[str, Any]] = MappingProxyType({"prompts": "imagenet80", "cupl": False})

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> DMNConfig:
        # used_views 1: the one view it reads (DMN's 32 cannot exceed n_views)
        return dataclasses.replace(DMN.default_config(hparams_key, backbone), n_views=1, augmix=False, used_views=1)
