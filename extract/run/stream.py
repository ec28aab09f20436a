"""The adaptation stream: its order, the runtime state of the adapt loop, replay of a kept prefix, and the loop.

The stream of a dataset is a permutation of its sample ids per (dataset, seed), the same for every method
(docs/methods.md, "Stream order and seeds"). The loop feeds cached features in stream order, `adapt_batch`
samples per `method.adapt` call, pairs each adapted logit row with the zero-shot anchor on view 0, and hands the
rows to a `PartWriter`; it takes ready-made objects and returns the state it ends in.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from extract.run.options import RunError
from extract.run.progress import Task

STREAM_RULE = "numpy.random.default_rng([seed, crc32(dataset)]).permutation(N)"


def stream_permutation(dataset: str, seed: int, n: int) -> np.ndarray:
    """The adaptation stream of a dataset: sample_id at each stream position, (n,) int64 (`STREAM_RULE`).

    Fixed per (dataset, seed) and identical for every method (docs/methods.md, "Stream order and seeds").

    Example:
        >>> stream_permutation("dtd", 1, 5).tolist() == stream_permutation("dtd", 1, 5).tolist()
        True
    """
    if seed < 0:
        raise RunError(f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng([int(seed), zlib.crc32(dataset.encode())])
    return rng.permutation(n).astype(np.int64)


def check_finite_logits(method: str, tta: np.ndarray, zs: np.ndarray, sample_ids: np.ndarray, start: int) -> None:
    """Stop the run at the first adapted or zero-shot logit row holding NaN or inf, naming the method, the sample
    and its stream position (the run is then never marked complete).

    Args:
        tta, zs: (B, K) logits of stream positions [start, start + B); sample_ids: (B,) their sample ids.
    """
    bad = ~(np.isfinite(tta).all(axis=1) & np.isfinite(zs).all(axis=1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        adapted = not np.isfinite(tta[i]).all()
        # the zero-shot logits use no method setting: non-finite ones come from the features or text prototypes
        hint = ("check the --set values" if adapted else "the image features or text prototypes are not finite "
                "(a damaged feature or text cache: delete it under --cache-dir to encode again)")
        raise RunError(f"method {method!r} produced non-finite {'adapted' if adapted else 'zero-shot'} logits for "
                       f"sample_id {int(sample_ids[i])} at stream position {start + i} ({int(bad.sum())} of {len(bad)} "
                       f"row(s) in this batch); the run is not marked complete; {hint}")


def labelled_counts(perm: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N + 1,) int64: how many of stream positions [0, p) hold a labelled (in-distribution) image, for each p.

    An OOD run's accuracy counts its in-distribution rows only: an OOD row (label -1) is never correct.
    """
    return np.concatenate([[0], np.cumsum(labels[perm] >= 0)]).astype(np.int64)


@dataclass
class RunState:
    """Where the adapt loop stands: the next stream position and the correct predictions so far (kept parts
    included), adapted and zero-shot; `labelled`: an OOD run's `labelled_counts` (None: every row is labelled)."""

    position: int = 0
    correct_tta: int = 0
    correct_zs: int = 0
    labelled: np.ndarray | None = None

    def _seen(self, stop: int) -> int:
        """Labelled rows among positions [0, stop) (at least 1: an accuracy over none reads 0)."""
        return max(stop if self.labelled is None else int(self.labelled[stop]), 1)

    def accuracy_note(self) -> str:
        """`acc 81.2% (zero-shot 78.0%)` over the positions done (for the progress bar)."""
        e = self._seen(self.position)
        return f"acc {100 * self.correct_tta / e:5.1f}% (zero-shot {100 * self.correct_zs / e:5.1f}%)"

    def accuracies(self, n_run: int) -> dict[str, float]:
        """The marker's accuracy fields over a run of `n_run` positions (an OOD run: over its labelled rows)."""
        e = self._seen(n_run)
        return {"accuracy": self.correct_tta / e, "zero_shot_accuracy": self.correct_zs / e}


@dataclass(frozen=True)
class StreamInputs:
    """The ready-made objects the adapt loop reads.

    Attributes:
        method_key: the method's key (for error messages); method: the method object (adapted in place).
        reader: `FeatureReader` of (B, V, D) float32 cached view features by stream range.
        anchor_text: (K, D) float32 zero-shot anchor prototypes on `device`; logit_scale: the model's.
        perm: (N,) int64 sample id per stream position; labels: (N,) int64 label per sample id.
        adapt_batch: samples per `method.adapt` call.
    """

    method_key: str
    method: Any
    reader: Any
    anchor_text: torch.Tensor
    logit_scale: float
    device: torch.device
    perm: np.ndarray
    labels: np.ndarray
    adapt_batch: int


def attach_set(inputs: StreamInputs, n_run: int, start: int) -> bool:
    """[set features] Give a method that consumes "set_features" (StatA, TransCLIP, ZLaP) its reader of the run's
    cached features, positions [0, n_run), the loop starting at `start`; it solves each transductive unit from them
    when its first `adapt` call reaches the unit. Returns whether the method took it (False: another kind).

    Such a method carries nothing from one unit to the next, and a resumed run starts at a unit boundary
    (`ResumeScope.unit`): attaching at `start` is all its "replay"."""
    if getattr(inputs.method, "consumes", "features") != "set_features":
        return False
    inputs.method.attach_set(lambda a, b: torch.from_numpy(inputs.reader.get(a, b)).to(inputs.device), n_run, start)
    return True


def replay(inputs: StreamInputs, stop: int, task: Task) -> None:
    """Rebuild an online method's state after positions [0, stop): the same `adapt` calls on the same inputs."""
    for s in range(0, stop, inputs.adapt_batch):
        e = min(s + inputs.adapt_batch, stop)
        inputs.method.adapt(torch.from_numpy(inputs.reader.get(s, e)).to(inputs.device))
        task.advance(e - s)


def adapt_stream(inputs: StreamInputs, state: RunState, stop: int, writer: Any, task: Task) -> RunState:
    """Adapt positions [state.position, stop), hand each batch's rows to `writer.add`; returns the state after.

    Per batch: tta = method.adapt(feats) (B, K); zs = logit_scale * feats[:, 0] @ anchor_text.T (B, K).
    """
    for s in range(state.position, stop, inputs.adapt_batch):
        e = min(s + inputs.adapt_batch, stop)
        feats = torch.from_numpy(inputs.reader.get(s, e)).to(inputs.device)  # (B, V, D), L2-normalised
        tta = inputs.method.adapt(feats)
        tta = (tta.detach().float().cpu().numpy() if isinstance(tta, torch.Tensor)
               else np.asarray(tta, np.float32))
        zs = (inputs.logit_scale * feats[:, 0] @ inputs.anchor_text.T).float().cpu().numpy()
        sid = inputs.perm[s:e]
        check_finite_logits(inputs.method_key, tta, zs, sid, s)
        label = inputs.labels[sid]
        state.correct_tta += int((tta.argmax(1) == label).sum())
        state.correct_zs += int((zs.argmax(1) == label).sum())
        state.position = e
        task.advance(e - s, state.accuracy_note())
        writer.add(sid, label, zs, tta, np.arange(s, e))
    return state
