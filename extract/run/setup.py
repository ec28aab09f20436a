"""What a run builds once its model is loaded: the prompts (the method's and the zero-shot anchor's), their text
prototypes, the method object, and the metadata every part of the run carries."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from extract.cache import TextCache
from extract.models import LoadedModel
from extract.prompts import PromptSet, build_prompt_set
from extract.run.ood import ood_meta
from extract.run.options import DEFAULT_ADAPT_BATCH, PlannedRun
from extract.run.progress import Progress
from extract.run.rundata import RunData
from extract.run.stream import STREAM_RULE
from schemas.shard import ShardMeta


def build_method(cls: type, config: Any, text_features: torch.Tensor, model: LoadedModel, *, backbone: str,
                 dataset: str, class_names: Sequence[str] | None = None) -> Any:
    """The one place a method object is constructed (episodic methods that tune prompts get the model as
    `text_encoder` and the class names to build their prompts from; a method that reads pixels gets the model)."""
    kwargs: dict[str, Any] = {"backbone": backbone, "dataset": dataset}
    if getattr(cls, "needs_text_encoder", False):
        kwargs["text_encoder"] = model
        kwargs["class_names"] = class_names
    elif cls.consumes_for(config) in ("view_pixels", "batch_pixels"):  # it runs the image encoder itself
        kwargs["text_encoder"] = model
    return cls(config, text_features, model.logit_scale, **kwargs)


def text_prototypes(model: LoadedModel, prompts: PromptSet, cache: TextCache | None,
                    progress: Progress | None = None) -> torch.Tensor:
    """(K, D) float32 prototypes on the model's device, from the text cache when present (and finite: a damaged
    entry is encoded again); `progress` shows a bar while the prompts are encoded (2000 classes x 80 templates
    take minutes on a CPU)."""
    k = len(prompts.per_class)
    if cache is not None:
        hit = cache.get(prompts.fingerprint(), k)
        if hit is not None and np.isfinite(hit).all():
            return torch.from_numpy(hit).to(model.device)
    n = sum(len(p) for p in prompts.per_class)
    task = (progress or Progress(False)).task(f"encoding {n} prompts of {k} classes", n)
    protos = model.text_prototypes(prompts.per_class, on_batch=task.advance)
    if cache is not None:
        cache.put(prompts.fingerprint(), protos.cpu().numpy())
    return protos


@dataclass(frozen=True)
class RunPrompts:
    """The prompts of a run.

    Attributes:
        method_names: the class names the method's prompts are built from (TPS has its own ImageNet list).
        method: the method's prompt set; anchor: the zero-shot anchor's (the same object with anchor="method").
    """

    method_names: Sequence[str]
    method: PromptSet
    anchor: PromptSet


def build_prompts(planned: PlannedRun, data: RunData) -> RunPrompts:
    """The method's prompts (its policy, CuPL sentences when asked) and the anchor's ("a photo of a {}.")."""
    ts, config, key = data.testset, planned.config, planned.class_dataset  # an OOD run: the in-distribution set's
    names = planned.method_cls.method_class_names(key, ts.class_names,  # type: ignore[attr-defined]
                                                   ts.imagenet_indices)
    method = build_prompt_set(key, names, policy=config.prompts, cupl=bool(config.cupl),
                              cupl_dir=planned.options.cupl_dir)
    if planned.options.anchor == "single":
        anchor = build_prompt_set(key, ts.class_names, policy="single")
    else:
        anchor = method
    return RunPrompts(names, method, anchor)


def prompt_features(model: LoadedModel, prompts: RunPrompts, cache: TextCache, progress: Progress | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(method prototypes, anchor prototypes), each (K, D) float32 on the model's device (one tensor when the
    anchor is the method's own prompt set); `progress`: where encoding prompts shows its bar."""
    method_text = text_prototypes(model, prompts.method, cache, progress)
    anchor_text = (method_text if prompts.anchor is prompts.method
                   else text_prototypes(model, prompts.anchor, cache, progress))
    return method_text, anchor_text


def shard_meta(planned: PlannedRun, data: RunData, model: LoadedModel, prompts: RunPrompts,
               warnings: Sequence[str]) -> ShardMeta:
    """The metadata every part of the run carries (before the per-part method summary and state)."""
    o, ts = planned.options, data.testset
    zs_desc = {"anchor": o.anchor, **prompts.anchor.describe(), "view": 0, "logit_scale": model.logit_scale}
    extra = {
        "zaec:warnings": json.dumps(list(warnings)),
        "zaec:prompts": json.dumps(prompts.method.describe(), sort_keys=True),
        "zaec:views": planned.policy,
        "zaec:logit_scale": repr(model.logit_scale),
        "zaec:stream": STREAM_RULE,
        "zaec:n_total": str(data.n_total),
        "zaec:limit": "none" if o.limit is None else str(int(o.limit)),
        "zaec:layout": ts.layout,
        "zaec:data_root": data.identity["data_root"],
        "zaec:data_fingerprint": data.identity["data_fingerprint"],
    }
    if tuple(prompts.method_names) != tuple(ts.class_names):
        extra["zaec:method_class_names"] = json.dumps(list(prompts.method_names))
    if ts.imagenet_indices is not None and len(ts.imagenet_indices) != 1000:
        extra["zaec:imagenet_indices"] = json.dumps(list(ts.imagenet_indices))
    for k, v in ts.notes.items():
        extra[f"zaec:{k}"] = v
    if planned.settings_note:
        extra["zaec:method_settings"] = planned.settings_note
    if ts.exif_transpose:  # written only when on: the default's shards keep their bytes
        extra["zaec:exif_transpose"] = "true"
    # an adapt call's width may change the rounding of its rows (a resumed run compares it); written only away
    # from the default, so the default's shards keep their bytes. A method that adapts over batches of pixels
    # always records its batch and what it consumes (docs/contract.md)
    if planned.adapt_width != DEFAULT_ADAPT_BATCH or planned.consumes == "batch_pixels":
        extra["zaec:adapt_batch"] = str(planned.adapt_width)
    if planned.consumes == "batch_pixels":
        extra["zaec:consumes"] = planned.consumes
    extra.update(ood_meta(planned, data))  # an OOD run's keys (docs/contract.md, "Out-of-distribution runs")
    if planned.method_cls.output_kind != "logits":  # absent means logits (docs/contract.md): older shards stay valid
        extra["zaec:output_kind"] = planned.method_cls.output_kind
    return ShardMeta(backbone=planned.backbone, pretrained=model.pretrained, dataset=planned.dataset,
                     method=o.method, seed=o.seed, class_names=ts.class_names, method_config=planned.config_dict(),
                     extra=extra, zs_prompts=zs_desc)
