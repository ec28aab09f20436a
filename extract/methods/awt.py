"""AWT: augment, weight, then transport (NeurIPS'24, `MCG-NJU/AWT @b2b49a8`, `AWT_zero_shot/evaluate.py`,
`pre_extract.py`, `data/datautils.py`, `data/cls_to_names.py`, `scripts/{pre_extract,evaluate}.sh`).

Spec: docs/methods.md, "AWT (`awt`)".

Per sample, training-free and without state: the original view and 50 random crops (the first 51 of the run's 64
crop + flip views) against P = 1 + 50 prompts per class - the dataset's template with the class name and ".", then
the same followed by each of 50 LLM-written descriptions of the class (`<dataset>.json`, read by the run from
`--descriptions-dir`). With z[v, d, c] = s·f_v·t_{c,d} (s the logit scale):

    image weights  a_v = softmax_v(−H(mean_d z[v, d, :]) / 0.5)
    text weights   b_{c,d} = softmax_d(−H(ẑ_{d,c}) / 0.5), ẑ_{d,c} = mean_d' z[0, d', :] with entry c set to z[0, d, c]
    transport      per class c, Sinkhorn between a (views) and b_c (prompts) on the kernel exp(−(1 − z/s) / 0.1)
                   (at most 100 iterations, stopping when the mean change of the view scaling is below 0.01)
    logit          Σ_{v,d} T_c[v, d] · z[v, d, c]

H is the softmax entropy. Everything runs in fp32 as the official evaluation does (its `autocast` region holds
only fp32 inputs); the prompts are encoded once, under autocast on CUDA, as `encode_text` there.

Samples are independent, so `adapt` evaluates its B samples together (in groups that bound memory); each sample's
Sinkhorn stops at its own iteration, so a batch gives the rows of one sample at a time. Where this differs from the
official loop (numerics only): the transported sum is reduced over (views, prompts) in the class-major layout, a
different summation order; the text-weight entropies of the K rows per prompt are computed in chunks of classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from extract.methods.base import MethodConfig, PromptSet, Ref, TTAMethod, check_hparams_key, setting, text_setting
from extract.methods.common import softmax_entropy

#: AWT's description file of each dataset with official settings (AWT `evaluate.py`: imagenet.json for ImageNet,
#: -A and -V2; `descriptions/image_datasets/`)
AWT_FILES: dict[str, str] = {
    "imagenet": "imagenet.json", "imagenet_a": "imagenet.json", "imagenet_v2": "imagenet.json",
    "imagenet_r": "imagenet_r.json", "imagenet_sketch": "imagenet_sketch.json", "caltech101": "caltech101.json",
    "dtd": "dtd.json", "eurosat": "eurosat.json", "fgvc_aircraft": "fgvc_aircraft.json", "food101": "food101.json",
    "flowers102": "oxford_flowers.json", "oxford_pets": "oxford_pets.json", "stanford_cars": "stanford_cars.json",
    "sun397": "sun397.json", "ucf101": "ucf101.json",
}
#: AWT `data/cls_to_names.py:CUSTOM_TEMPLATES`, by this project's dataset keys
AWT_TEMPLATES: dict[str, str] = {
    "imagenet": "a photo of a {}", "imagenet_a": "a photo of a {}", "imagenet_v2": "a photo of a {}",
    "imagenet_r": "a rendition photo of a {}", "imagenet_sketch": "a sketch photo of a {}",
    "caltech101": "a photo of a {}", "dtd": "a photo of a {}, which is a type of texture, or a type of pattern",
    "eurosat": "satellite photo of the {}",
    "fgvc_aircraft": "a photo of a {} from Fine-Grained Visual Classification of Aircraft",
    "food101": "a photo of a {} from Food101", "flowers102": "a photo of a {}, a type of flower",
    "oxford_pets": "a photo of a {} from OxfordPets", "stanford_cars": "a photo of a {}",
    "sun397": "a photo of a {}", "ucf101": "a photo of a person doing {}",
}
DESCRIPTIONS_SOURCE = ("the AWT repository's AWT_zero_shot/descriptions/image_datasets/ holds the published files; "
                       "docs/extract.md, \"Class descriptions (AWT)\"")
#: elements of the largest intermediate tensor one group of samples may hold (execution only)
GROUP_ELEMENTS = 1 << 24


def awt_prompts(template: str, names: Sequence[str], descriptions: Sequence[Sequence[str]], n: int) -> list[str]:
    """AWT's prompts, class-major: per class `template.format(name) + "."`, then `template.format(name) + ". " + d`
    for its first `n` descriptions (`evaluate.py` l.91-101; `_` in a name is a space).

    >>> awt_prompts("a photo of a {}", ["sea_lion"], [["It swims.", "x"]], 1)
    ['a photo of a sea lion.', 'a photo of a sea lion. It swims.']
    """
    out = []
    for name, desc in zip(names, descriptions):
        base = template.format(name.replace("_", " "))
        out += [base + "."] + [base + ". " + d for d in desc[:n]]
    return out


def sinkhorn(kernel: torch.Tensor, u: torch.Tensor, v: torch.Tensor, thresh: float, iters: int) -> torch.Tensor:
    """AWT's `Sinkhorn` for G samples at once, each stopping at its own iteration.

    Per sample: r, c = 1; repeat r = u / (K c), c = v / (Kᵀ r) until the mean |Δr| over (classes, views) is below
    `thresh` (checked after the update, which is kept) or `iters` rounds; T = r cᵀ ∘ K.

    Args:
        kernel: (G, K, M, N) per sample and class; u: (G, M) view weights; v: (G, K, N) prompt weights.

    Returns:
        (G, K, M, N) transport plans.
    """
    g, k, m, n = kernel.shape
    kernel_t = kernel.transpose(-1, -2).contiguous()  # as `K.permute(0, 2, 1).contiguous()`
    r = torch.ones(g, k, m, dtype=kernel.dtype, device=kernel.device)
    c = torch.ones(g, k, n, dtype=kernel.dtype, device=kernel.device)
    active = torch.ones(g, dtype=torch.bool, device=kernel.device)
    for _ in range(iters):
        r_new = u[:, None] / torch.matmul(kernel, c[..., None])[..., 0]
        c_new = v / torch.matmul(kernel_t, r_new[..., None])[..., 0]
        err = (r_new - r).abs().mean(dim=(1, 2))
        keep = active[:, None, None]
        r, c = torch.where(keep, r_new, r), torch.where(keep, c_new, c)
        active = active & ~(err < thresh)
        if not bool(active.any()):  # one host sync per round, as the official `err.item()`
            break
    return torch.matmul(r[..., None], c[..., None, :]) * kernel


def text_weight_entropy(z0: torch.Tensor, chunk: int) -> torch.Tensor:
    """AWT's descriptor entropies (`get_entropy_weight`): for each prompt d and class c, the softmax entropy of the
    view-0 mean logits over prompts with entry c replaced by z0[d, c].

    Args:
        z0: (G, P, K) view-0 logits per prompt; chunk: classes per chunk (the (G, P, chunk, K) rows are built at once).

    Returns:
        (G, P, K) entropies.
    """
    g, p, k = z0.shape
    anchor = z0.mean(1)  # (G, K)
    out = []
    for c0 in range(0, k, chunk):
        cls = torch.arange(c0, min(k, c0 + chunk), device=z0.device)
        rows = anchor[:, None, None, :].expand(g, p, len(cls), k).clone()
        rows.scatter_(3, cls[None, None, :, None].expand(g, p, -1, 1), z0[:, :, cls, None])
        out.append(softmax_entropy(rows))
    return torch.cat(out, dim=-1)


def awt_logits(z: torch.Tensor, logit_scale: float, *, image_temperature: float, text_temperature: float,
               eps: float, thresh: float, iters: int, chunk: int | None = None) -> torch.Tensor:
    """AWT's prediction from the logits of G samples (`get_entropy_weight` + `optimal_transport`).

    Args:
        z: (G, V, P, K) logits s·f_v·t_{c,d}, view 0 the original, prompt 0 the plain one.

    Returns:
        (G, K) Σ_{v,d} T_c[v, d] z[v, d, c].
    """
    g, v, p, k = z.shape
    image_w = (-softmax_entropy(z.mean(2)) / image_temperature).softmax(-1)  # (G, V)
    ent = text_weight_entropy(z[:, 0], chunk or max(1, GROUP_ELEMENTS // max(1, g * p * k)))  # (G, P, K)
    text_w = (-ent.transpose(-1, -2) / text_temperature).softmax(-1)  # (G, K, P)
    zc = z.permute(0, 3, 1, 2)  # (G, K, V, P)
    kernel = torch.exp(-(1.0 - zc / logit_scale) / eps)
    plan = sinkhorn(kernel, image_w, text_w, thresh, iters)
    return (plan * zc).sum(dim=(-2, -1))


@dataclass(frozen=True)
class AWTConfig(MethodConfig):
    """AWT's zero-shot evaluation (`scripts/pre_extract.sh`, `scripts/evaluate.sh`, `evaluate.py`)."""

    # The runner's 1 + 63 views; AWT reads the first 1 + 50 (`used_views`). Its crops are torchvision's
    # RandomResizedCrop(224) + flip on every dataset, never AugMix (`data/datautils.py:Augmenter`).
    n_views: int = 64
    augmix: bool = False
    # the prompts are AWT's own (template + descriptions); the run's prototypes are only the anchor's
    prompts: PromptSet = field(default="single", metadata={"fixed": True})
    cupl: bool = field(default=False, metadata={"fixed": True})
    episodic: bool = field(default=True, metadata={"fixed": True})  # nothing carries over between samples
    used_views: int = setting(51, ge=1, le=Ref("n_views"))  # pre_extract.sh BS=50: the original + 50 views
    # `CUSTOM_TEMPLATES[dataset]` ("{}" is the class name), set per dataset in `default_config`
    template: str = text_setting("a photo of a {}", nonempty=True)
    num_descriptions: int = setting(50, ge=0)  # evaluate.sh N_DESC=50 (`--num_descriptor`)
    image_temperature: float = setting(0.5, gt=0)  # evaluate.py l.127 `image_temperature = 0.5`
    text_temperature: float = setting(0.5, gt=0)  # l.128 `text_temperature = 0.5`
    ot_eps: float = setting(0.1, gt=0)  # `optimal_transport`: `eps = 0.1`
    sinkhorn_threshold: float = setting(1e-2, ge=0)  # `Sinkhorn`: `thresh = 1e-2`
    sinkhorn_iters: int = setting(100, ge=1)  # `for i in range(100)`


class AWT(TTAMethod):
    """Per sample: entropy-weighted views and descriptions matched by optimal transport."""

    key: ClassVar[str] = "awt"
    prefix_stable: ClassVar[bool] = True  # each row is its own sample's
    Config: ClassVar[type[MethodConfig]] = AWTConfig
    needs_text_encoder: ClassVar[bool] = True  # the descriptions are encoded when the method is built
    needs_descriptions: ClassVar[bool] = True
    # unseen data: ImageNet's template "a photo of a {}" and the set's own `<set name>.json`
    unseen_like: ClassVar[str] = "imagenet"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None,
                 descriptions: Any = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: AWTConfig = self.config  # type: ignore[assignment]
        if descriptions is None:
            raise ValueError("awt needs the class descriptions (descriptions=...; the run reads them from "
                             "--descriptions-dir)")
        if len(descriptions.names) != self.n_classes:
            raise ValueError(f"awt: descriptions of {len(descriptions.names)} classes, text_features has "
                             f"{self.n_classes} rows")
        self.warnings.extend(descriptions.warnings)
        self.n_prompts = 1 + cfg.num_descriptions
        prompts = awt_prompts(cfg.template, descriptions.names, descriptions.per_class, cfg.num_descriptions)
        # (K·P, D) float32, L2-normalised, class-major (AWT: encode_text under autocast, .float(), normalise)
        self.prompt_features = torch.cat([text_encoder.encode_texts(prompts[i:i + 1024])
                                          for i in range(0, len(prompts), 1024)])

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> AWTConfig:
        check_hparams_key(hparams_key)
        return AWTConfig(template=AWT_TEMPLATES[hparams_key])

    @classmethod
    def descriptions_request(cls, config: MethodConfig, dataset: str) -> tuple[str, int, str]:
        """AWT's file of a dataset with official settings (`AWT_FILES`, by the set whose settings it uses), else
        `<dataset>.json` (a user's set: its name); the sentences every class needs (`num_descriptions`)."""
        from extract.datasets import get_dataset
        from extract.prompts import PromptError

        if "{}" not in config.template:  # type: ignore[attr-defined]
            raise PromptError(f"awt: template {config.template!r} has no '{{}}' for the class name")  # type: ignore
        spec = get_dataset(dataset)
        official = spec.group in ("natural", "fine_grained", "corruption") and spec.hparams_from in AWT_FILES
        name = AWT_FILES[str(spec.hparams_from)] if official else f"{spec.key}.json"
        return name, int(config.num_descriptions), DESCRIPTIONS_SOURCE  # type: ignore[attr-defined]

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        cfg: AWTConfig = self.config  # type: ignore[assignment]
        feats = view_feats[:, :cfg.used_views].to(self.compute_dtype(view_feats))
        text = self.prompt_features.to(feats.device, feats.dtype)
        b, v, _ = feats.shape
        per_sample = v * text.shape[0]  # elements of one sample's logits (and of its transport plan)
        group = max(1, GROUP_ELEMENTS // per_sample)
        out = []
        for i in range(0, b, group):
            z = self.logit_scale * feats[i:i + group] @ text.T  # (G, V, K·P)
            z = z.view(z.shape[0], v, self.n_classes, self.n_prompts).transpose(2, 3)  # (G, V, P, K)
            out.append(awt_logits(z, self.logit_scale, image_temperature=cfg.image_temperature,
                                  text_temperature=cfg.text_temperature, eps=cfg.ot_eps,
                                  thresh=cfg.sinkhorn_threshold, iters=cfg.sinkhorn_iters))
        return torch.cat(out)
