"""The reward model of a run (RLCF): loaded before any image is read, its text features of the policy's prompts, and
its own feature cache of the same views, filled by the same encoding pass as the policy's
(docs/methods.md, "RLCF: prompt tuning with a CLIP reward").

The reward model sees the policy's views: the official code feeds it the policy's preprocessed images
(tpt_cls_rl.py `reward_model.set_image_features(inputs[selected_idx])`). Here its encoding pass draws the views
with the same seed and the same preprocessing (checked), which gives the same pixels; its features are cached under
its own model fingerprint (extract/cache.py), so a second run, or another method with that model as its policy,
reuses them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from extract.cache import FeatureCache
from extract.datasets import TestSet
from extract.models import LoadedModel, ModelError, WeightFlags, load_model
from extract.run.encode import FeatureReader, encode_pass, open_feature_cache
from extract.run.externals import external_error
from extract.run.options import PlannedRun, RunError
from extract.run.progress import Progress
from extract.text_encoder import class_prompt
from extract.views import ViewPolicy

#: `reward_backbone` value that makes the policy its own reward model (no second model)
REWARD_POLICY = "policy"
#: how messages about the reward model name its settings (not `--pretrained`: that is the policy's)
REWARD_FLAGS = WeightFlags(backbone="--set reward_backbone=", pretrained="--set reward_pretrained=")


def _needs_second_model(method_cls: type, config: Any) -> bool:
    return bool(getattr(method_cls, "needs_reward_model", False)) and config.reward_backbone != REWARD_POLICY


def _reward_error(planned: PlannedRun, e: ModelError) -> RunError:
    """One line: which reward model, what is wrong (in `--set` terms), and the way to run without it
    (`extract.run.externals.external_error` on the method's declared reward model)."""
    (ext,) = planned.method_cls.external_files
    return external_error(planned, ext, str(e))


@dataclass(frozen=True)
class RewardPass:
    """A loaded reward model and its feature cache for one run; `encode` fills the cache like the policy's."""

    model: LoadedModel
    cache: FeatureCache
    policy: ViewPolicy

    def encode(self, testset: TestSet, perm: np.ndarray, n_positions: int, *, seed: int, batch_size: int,
               workers: int, progress: Progress | None = None) -> int:
        """`encode_pass` of the reward model over stream positions [0, n_positions); returns samples encoded."""
        return encode_pass(self.model, testset, perm, self.cache, self.policy, n_positions, seed=seed,
                           batch_size=batch_size, workers=workers, progress=progress)


def attach_reward(method: Any, planned: PlannedRun, policy_model: LoadedModel, class_names: Sequence[str], *,
                  cache_root: os.PathLike, testset_key: str, seed: int, perm: np.ndarray,
                  chunk_size: int) -> RewardPass | None:
    """Load the reward model a method asks for, give the method its inputs, and return the pass that encodes them.

    None (nothing to do) for methods without `needs_reward_model` and for `reward_backbone="policy"` (the method
    then uses the policy's own features).

    Raises:
        RunError: the reward model cannot be loaded (one line naming the --set keys), or it preprocesses images
            differently from the policy.
    """
    cfg = method.config
    if not _needs_second_model(type(method), cfg):
        return None
    try:
        reward = load_model(cfg.reward_backbone or None, cfg.reward_pretrained, policy_model.device,
                            flags=REWARD_FLAGS)
    except ModelError as e:
        raise _reward_error(planned, e) from None
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
    return RewardPass(reward, cache, planned.policy)
