"""TPS: Test-time Prototype Shifting (`elaine-sui/TPS @556db0f`; docs/methods.md, "TPS: prototype shifting").

Per test sample (episodic): a per-class shift S (K×D) starts at zero; the shifted prototypes are
t̃_c = normalize(normalize(P_c) + S_c); the 64 views' logits s·f̂_v t̃ᵀ select the 6 lowest-entropy views; one AdamW
step on their marginal entropy moves S; the prediction is s·f̂₀ t̃ᵀ on the original view. Everything but the text
encoder of TPT, so all samples of a batch are tuned in one pass (`EpisodicTuner` in `tpt.py`). With more than one
step the views are selected anew at every step (TPS `run_shift_iter`; TPT selects once).

Class names: on ImageNet, -V2 and -Sketch TPS's own list, which differs from the CLIP/TPT list at two indices
(`TPS_IMAGENET_RENAMES`); the runner records the names used (`zaec:method_class_names`).

Prototypes P: the mean of the L2-normalised embeddings of the 80 CLIP ImageNet templates (the runner's "imagenet80"
prompt set, TPS `--with_templates`). With `descriptors` (a GPT-4 descriptor file, class name -> list of
descriptors, the format of TPS `gpt4_descriptors/*.json`) the paper default is used instead:
P_c = normalize(½ (mean_t normalize(E(template_t(c))) + mean_d normalize(E("{c}, " + sentence(d))))).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F

from extract.methods.base import IMAGENET_FAMILY, MethodConfig, PromptSet, check_hparams_key, text_setting
from extract.methods.tpt import EpisodicConfig, EpisodicTuner


def descriptor_sentence(class_name: str, descriptor: str) -> str:
    """TPS `make_descriptor_sentence` (from classify_by_description): the prompt of one GPT-4 descriptor.

    The rule tests prefixes of the raw descriptor, so any descriptor starting with the letter "a" gets "which is".

    >>> descriptor_sentence("goldfish", "has orange scales"), descriptor_sentence("goldfish", "small fins")
    ('goldfish, which has orange scales', 'goldfish, which has small fins')
    >>> descriptor_sentence("goldfish", "a small fish")
    'goldfish, which is a small fish'
    """
    d = descriptor
    if d.startswith("a") or d.startswith("used"):
        tail = f"which is {d}"
    elif d.startswith(("has", "often", "typically", "may", "can")):
        tail = f"which {d}"
    else:
        tail = f"which has {d}"
    return f"{class_name}, {tail}"


def load_descriptors(path: str | Path, class_names: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    """Descriptors per class from a JSON object class name -> list of strings, and warnings.

    Keys are matched to class names after normalising both (`extract.prompts.class_key`: case, `_`, spaces). When
    some class has no key of its name but the file has exactly K keys, the classes are paired with the keys by
    position, as the official TPS does (`save_concepts.py` reads the values in file order): its ImageNet file says
    'eft' where the class is 'newt' and 'maillot' for 'tights'. That pairing is reported in a warning. Every class
    needs at least one descriptor (TPS `save_concepts.py` asserts the same).

    Returns:
        (K lists of descriptors, warnings to record in the shard metadata)

    Raises:
        ValueError: unreadable file, wrong format, or classes without descriptors (the message names them).
    """
    from extract.prompts import PromptError, class_key, match_class_table, read_class_table

    p = Path(path).expanduser()
    try:
        table = read_class_table(p)
    except PromptError as e:
        raise ValueError(f"TPS descriptors: {e}") from None
    out, unmatched = match_class_table(table, class_names)
    warnings = []
    if unmatched and len(table) == len(class_names):
        out = [list(v) for v in table.values()]
        differ = [(n, k) for n, k in zip(class_names, table) if class_key(n) != class_key(k)]
        shown = ", ".join(f"{n!r} <- {k!r}" for n, k in differ[:5]) + (", ..." if len(differ) > 5 else "")
        warnings.append(f"TPS descriptors: {p.name} has no key for {len(unmatched)} of {len(class_names)} class names; "
                        f"its {len(table)} entries were paired with the classes by position, as the official TPS "
                        f"does ({len(differ)} positions where key and class name differ: {shown})")
    missing = [n for n, sentences in zip(class_names, out) if not sentences]  # unmatched or an empty list
    if missing:
        raise ValueError(f"TPS descriptors: {p} has no descriptors for {len(missing)} of {len(class_names)} classes "
                         f"({', '.join(map(repr, missing[:5]))}{', ...' if len(missing) > 5 else ''}); it has "
                         f"{len(table)} entries, so they cannot be paired by position either")
    return out, warnings


# Official TPS's ImageNet names (`data/imagenet_prompts_clean.py:imagenet_classes`, @556db0f) are CLIP's cleaned
# names (open_clip's IMAGENET_CLASSNAMES, which the TPT family keeps) except at two ImageNet-1k indices where CLIP's
# list repeats a name: 744 "missile" (also 657) and 836 "sunglasses" (also 837). Checked entry by entry: no other
# index differs. TPS indexes this list with the ImageNet-A/-R masks and uses it whole for -V2 and -Sketch; neither
# 744 nor 836 is among the 200 classes of -A or -R, so there the names are CLIP's.
TPS_IMAGENET_RENAMES: dict[int, tuple[str, str]] = {744: ("missile", "projectile"), 836: ("sunglasses", "sunglass")}


@dataclass(frozen=True)
class TPSConfig(EpisodicConfig):
    """TPS defaults: TPT's view selection and one AdamW step (wd 0.01 has no effect on a zero shift:
    docs/methods.md, "Precision in the official code")."""

    augmix: bool = True  # TPS --img_aug with `augmix = len(set_id) > 1`: fine-grained sets only
    prompts: PromptSet = "imagenet80"  # the 80 CLIP templates for every dataset (TPS `data/imagenet_prompts_clean.py`)
    lr: float = 1e-3  # per dataset: 5e-3 ImageNet family, 1e-3 fine-grained (TTA-VLM `instance_method/tps.py`)
    # A GPT-4 descriptor file (class -> descriptors, TPS `gpt4_descriptors/<dataset>.json`); "" = templates only.
    descriptors: str = text_setting("")
    # Execution only: shifts are cheap (no text encoder), so many samples share one pass.
    pass_budget: int = 65536


class TPS(EpisodicTuner):
    """Test-time prototype shifting: a per-class shift of cached prototypes, one AdamW step per sample."""

    key: ClassVar[str] = "tps"
    prefix_stable: ClassVar[bool] = True  # episodic (the run's loss scale follows the samples already seen)
    Config: ClassVar[type[MethodConfig]] = TPSConfig
    # The text encoder builds the descriptor prototypes when `descriptors` is set; unused otherwise.
    needs_text_encoder: ClassVar[bool] = True
    reselect_each_step: ClassVar[bool] = True  # `run_shift_iter` selects the views anew at every step

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder, class_names=class_names)
        cfg: TPSConfig = self.config  # type: ignore[assignment]
        if cfg.descriptors:
            self.text_features = self._descriptor_prototypes(cfg, text_encoder).to(self.text_features.device)

    def _descriptor_prototypes(self, cfg: TPSConfig, encoder: Any) -> torch.Tensor:
        from extract.prompts import templates_for

        if self.class_names is None:
            raise ValueError("tps with descriptors needs class_names=...")
        names = [n.replace("_", " ") for n in self.class_names]
        descs, warnings = load_descriptors(cfg.descriptors, self.class_names)
        self.warnings.extend(warnings)
        templates = templates_for(self.dataset, cfg.prompts)
        protos = []
        for name, ds in zip(names, descs):
            t_mean = encoder.encode_texts([t.format(name) for t in templates]).mean(0)
            d_mean = encoder.encode_texts([descriptor_sentence(name, d) for d in ds]).mean(0)
            protos.append(F.normalize((0.5 * (t_mean + d_mean)).float(), dim=-1))
        return torch.stack(protos)

    # Unseen data: the fine-grained settings (AugMix views, lr 1e-3; every fine-grained set has the same row), with
    # the 80 CLIP templates TPS uses everywhere.
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def method_class_names(cls, dataset: str, class_names: Sequence[str],
                           imagenet_indices: Sequence[int] | None = None) -> tuple[str, ...]:
        """TPS's own ImageNet names where CLIP's repeat one (`TPS_IMAGENET_RENAMES`); other names unchanged.

        >>> names = ["x"] * 1000; names[744] = "missile"
        >>> TPS.method_class_names("imagenet", names, range(1000))[744]
        'projectile'
        """
        out = list(class_names)
        for c, idx in enumerate(imagenet_indices or ()):
            clip_name, tps_name = TPS_IMAGENET_RENAMES.get(int(idx), (None, None))
            if out[c] == clip_name:
                out[c] = tps_name
        return tuple(out)

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> TPSConfig:
        check_hparams_key(hparams_key)
        imagenet = hparams_key in IMAGENET_FAMILY
        return TPSConfig(augmix=not imagenet, lr=5e-3 if imagenet else 1e-3)

    def _init_param(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(n, self.n_classes, self.dim, dtype=torch.float32, device=device)  # S = 0 per sample

    def _class_features(self, param: torch.Tensor) -> torch.Tensor:
        base = F.normalize(self.text_features.float(), dim=-1)
        return F.normalize(base + param, dim=-1)  # t̃ = normalize(normalize(P) + S): (G, K, D)
