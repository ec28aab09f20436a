"""The second image encoder of a run: RLCF's reward model (a second CLIP) or COSMIC's DINOv2 (timm), loaded before any
image is read, fed the policy's views, its features in a feature cache of its own filled by the same encoding pass
as the policy's (docs/methods.md, "RLCF: prompt tuning with a CLIP reward" and
"COSMIC: a second image encoder (DINOv2) and dual memories").

The second encoder sees the policy's views: RLCF's official code feeds its reward model the policy's preprocessed
images (tpt_cls_rl.py `reward_model.set_image_features(inputs[selected_idx])`), COSMIC's feeds DINOv2 the same
CLIP-normalised tensor (`clip/fix_clip.py` `get_image_features_aux`). Here its encoding pass draws the views with
the same seed and the same preprocessing (RLCF's reward model must share the policy's; COSMIC's timm encoder takes
the policy's), which gives the same pixels; its features are cached under its own fingerprint (extract/cache.py),
so a second run reuses them. RLCF's reward model encodes every view of the policy; COSMIC reads DINOv2's feature of
the original view only (`image_features_global_aux[:1]`), so its pass encodes that view alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from extract.cache import FeatureCache
from extract.datasets import TestSet
from extract.models import LoadedModel, ModelError, WeightFlags, load_model
from extract.timm_encoder import load_timm_encoder
from extract.run.encode import FeatureReader, encode_pass, open_feature_cache
from extract.run.externals import external_error
from extract.run.options import PlannedRun, RunError
from extract.run.progress import Progress
from extract.text_encoder import class_prompt
from extract.views import ViewPolicy

#: how messages about the reward model name its settings (not `--pretrained`: that is the policy's)
REWARD_FLAGS = WeightFlags(backbone="--set reward_backbone=", pretrained="--set reward_pretrained=")


def _needs_second_model(method_cls: type, config: Any) -> bool:
    """A reward model to load: none with `reward_backbone=policy` (RLCF's `needed_files`)."""
    return bool(getattr(method_cls, "needs_reward_model", False)) and bool(method_cls.needed_files(config))


@dataclass(frozen=True)
class EncoderPass:
    """A loaded second image encoder (a `LoadedModel`, or a `TimmEncoder`: what `encode_pass` reads) and its feature
    cache for one run; `encode` fills the cache like the policy's, for the views of `policy`."""

    model: Any
    cache: FeatureCache
    policy: ViewPolicy

    def encode(self, testset: TestSet, perm: np.ndarray, n_positions: int, *, seed: int, batch_size: int,
               workers: int, progress: Progress | None = None) -> int:
        """`encode_pass` of the second encoder over stream positions [0, n_positions); returns samples encoded."""
        return encode_pass(self.model, testset, perm, self.cache, self.policy, n_positions, seed=seed,
                           batch_size=batch_size, workers=workers, progress=progress)


def attach_second_encoder(method: Any, planned: PlannedRun, policy_model: LoadedModel, class_names: Sequence[str],
                          *, cache_root: os.PathLike, testset_key: str, seed: int, perm: np.ndarray,
                          chunk_size: int) -> EncoderPass | None:
    """Load the second image encoder a method asks for, give the method its inputs, and return the pass that encodes
    them: RLCF's reward model (`needs_reward_model`), or the timm encoder named by the config field of the method's
    `second_encoder` (COSMIC's DINOv2) when `needs_second_encoder(config)`. None (nothing to do) otherwise, and for
    RLCF's `reward_backbone="policy"` (the method then uses the policy's own features).

    Raises:
        RunError: the encoder cannot be loaded (one line naming the --set keys and where it comes from), or the
            reward model preprocesses images differently from the policy.
    """
    cls = type(method)
    if _needs_second_model(cls, method.config):
        return _attach_reward(method, planned, policy_model, class_names, cache_root=cache_root,
                              testset_key=testset_key, seed=seed, perm=perm, chunk_size=chunk_size)
    setting = getattr(cls, "second_encoder", None)
    if not setting or not cls.needs_second_encoder(method.config):
        return None
    (ext,) = [e for e in planned.method_cls.external_files if e.setting == setting]
    try:
        encoder = load_timm_encoder(getattr(method.config, setting), policy_model.preprocess, policy_model.device,
                                    policy_model.precision)
    except ModelError as e:
        raise external_error(planned, ext, str(e)) from None
    cache = open_feature_cache(cache_root, encoder, planned.dataset, testset_key, seed, perm, encoder.dim, chunk_size)
    method.attach_second_encoder(FeatureReader(cache, "single").get)
    return EncoderPass(encoder, cache, "single")


def _attach_reward(method: Any, planned: PlannedRun, policy_model: LoadedModel, class_names: Sequence[str], *,
                   cache_root: os.PathLike, testset_key: str, seed: int, perm: np.ndarray,
                   chunk_size: int) -> EncoderPass:
    """RLCF's reward model: loaded, its text features of the policy's prompts, its cache of every view."""
    cfg = method.config
    try:
        reward = load_model(cfg.reward_backbone or None, cfg.reward_pretrained, policy_model.device,
                            flags=REWARD_FLAGS)
    except ModelError as e:  # one line: the reward model, the problem, the way to run without it
        (ext,) = planned.method_cls.external_files
        raise external_error(planned, ext, str(e)) from None
    if reward.preprocess != policy_model.preprocess:
        raise RunError(f"{planned.options.method}: the reward model preprocesses images as {reward.preprocess}, the "
                       f"policy as {policy_model.preprocess}; the reward model must see the policy's views (choose "
                       "one with the same input size and normalisation, or reward_backbone=policy)")
    prompts = [class_prompt(cfg.ctx_init, n) for n in class_names]
    import torch

    text = torch.cat([reward.encode_texts(prompts[i:i + 512]) for i in range(0, len(prompts), 512)])
    cache = open_feature_cache(cache_root, reward, planned.dataset, testset_key, seed, perm, text.shape[1],
                               chunk_size)
    method.attach_reward(text, FeatureReader(cache, planned.policy).get)
    return EncoderPass(reward, cache, planned.policy)
