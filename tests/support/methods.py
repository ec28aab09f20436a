"""Stand-in TTA methods that several test modules register (through the `running_mean` fixture of
tests/support/extract.py), never imported by a test module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from extract.methods.base import MethodConfig, TTAMethod


@dataclass(frozen=True)
class RunningMeanConfig(MethodConfig):
    n_views: int = 1
    prompts: str = "single"  # type: ignore[assignment]
    weight: float = 3.0


class RunningMean(TTAMethod):
    """An online method whose output depends on the whole history (tests resume replay exactly):
    logits = scale * (f0 + weight * mean of all f0 seen so far, this batch included) @ T^T. It declares no
    `prefix_stable` (its rows are treated as reading later samples, as a transductive method's)."""

    key: ClassVar[str] = "running-mean"
    Config: ClassVar[type] = RunningMeanConfig

    @classmethod
    def default_config(cls, hparams_key, backbone):
        return RunningMeanConfig()

    def _adapt(self, view_feats):
        f0 = view_feats[:, 0].double()
        if not hasattr(self, "acc"):
            self.acc = torch.zeros(f0.shape[1], dtype=torch.float64)
        out = []
        for f in f0:
            self.acc += f
            mean = self.acc / (self.n_seen + len(out) + 1)
            out.append(self.logit_scale * (f + self.config.weight * mean) @ self.text_features.double().T)
        return torch.stack(out).float()
