"""What the transductive methods (StatA, TransCLIP, ZLaP) share: the base class that serves `consumes =
"set_features"`, and the chunked nearest-neighbour search of their graphs;
docs/methods.md, "Transductive methods (StatA, TransCLIP, ZLaP)".

A transductive method solves the cached features of a whole *unit* jointly: the run (`unit = 0`) or consecutive
batches of `unit` stream positions, each solved on its own (the last one shorter). The runner attaches a reader of
the run's cached features (`attach_set`, extract/run/stream.py); the first `adapt` call that reaches a unit reads the
unit's features, solves it once (`_solve`) and keeps its rows; that call and the next ones return the rows of their
positions. The features an `adapt` call receives must be those of its positions in the unit (checked), so a method
never pairs one sample's row with another's features.

No state crosses a unit's end: a resumed run starts at a unit boundary (extract/run/resume.py) and solves the units
it computes from the cache again, so every row of a unit comes from one solve.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar

import torch

from extract.methods.base import Consumes, MethodConfig, TTAMethod

#: reads the cached (B, V, D) view features of stream positions [start, stop) of the run
SetReader = Callable[[int, int], torch.Tensor]
#: bytes of similarities one chunk of a nearest-neighbour search may hold (a (rows, N) block): 256 MiB
KNN_BLOCK_BYTES = 1 << 28


def knn(query: torch.Tensor, base: torch.Tensor, k: int, *, skip_self: bool = False,
        block_bytes: int = KNN_BLOCK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest inner products of each query row with the rows of `base`, sorted from the largest, computed
    over blocks of query rows so that no (n, N) matrix is held (the official code builds the dense N x N
    similarity matrix, 10 GB at ImageNet's 50,000 samples).

    Args:
        query: (n, D); base: (N, D), same dtype and device.
        k: neighbours per row, at most N (N - 1 with `skip_self`).
        skip_self: query row i is base row i and is never its own neighbour (ZLaP's inductive queries, whose
            official unlabeled set never holds the query).
        block_bytes: the size of one block of similarities.

    Returns:
        (sims (n, k), idx (n, k) int64).

    Example:
        >>> x = torch.eye(3)
        >>> knn(x, x, 1)[1].flatten().tolist(), knn(x, x, 1, skip_self=True)[0].flatten().tolist()
        ([0, 1, 2], [0.0, 0.0, 0.0])
    """
    n, big = query.shape[0], base.shape[0]
    rows = max(1, block_bytes // max(1, big * query.element_size()))
    sims, idx = [], []
    for a in range(0, n, rows):
        b = min(n, a + rows)
        block = query[a:b] @ base.T  # (b - a, N)
        if skip_self:
            r = torch.arange(b - a, device=block.device)
            block[r, a + r] = -torch.inf
        s, i = block.topk(k, dim=1)
        sims.append(s)
        idx.append(i)
    if not sims:
        return query.new_zeros(0, k), torch.zeros(0, k, dtype=torch.long, device=query.device)
    return torch.cat(sims), torch.cat(idx)


class TransductiveMethod(TTAMethod):
    """A method whose rows are solved jointly over a unit of the run (`consumes = "set_features"`).

    Subclasses define `_solve(feats) -> (U, K)` rows for the (U, 1, D) view-0 features of one unit, and a config
    with an int field `unit` (0: the whole run). The runner calls `attach_set(read, n_run, start)` before the first `adapt`.
    """

    consumes: ClassVar[Consumes] = "set_features"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, **kwargs: Any) -> None:
        super().__init__(config, text_features, logit_scale, **kwargs)
        self._read: SetReader | None = None
        self._n_run = 0
        # the unit solved last: its first position, its features and its rows
        self._solved: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self.units_solved = 0

    @classmethod
    def transductive_unit(cls, config: MethodConfig) -> int | None:
        """`config.unit`: 0 for the whole run, else the positions of one batch."""
        return int(config.unit)  # type: ignore[attr-defined]

    @classmethod
    def prefix_dependence(cls, config: MethodConfig) -> str | None:
        """Always a reason: a row depends on the other samples of its unit (the whole run, or its batch)."""
        unit = cls.transductive_unit(config)
        if not unit:
            return f"{cls.key} solves the whole run's features jointly: each row depends on every sample of the run"
        return (f"{cls.key} solves batches of {unit} consecutive samples jointly: each row depends on the other "
                "samples of its batch")

    def attach_set(self, read: SetReader, n_run: int, start: int = 0) -> None:
        """Give the method the cached features of the run: `read(a, b)` returns the (b - a, V, D) features of stream
        positions [a, b) of a run of `n_run` positions, of which the next `adapt` call starts at `start` (a unit
        boundary when the run resumes)."""
        if not 0 <= start <= n_run:
            raise ValueError(f"{self.key}: start position {start} outside the run's {n_run} positions")
        self._read, self._n_run, self.n_seen, self._solved = read, int(n_run), int(start), None

    def unit_bounds(self, position: int) -> tuple[int, int]:
        """The first and end positions of the unit holding stream `position`."""
        unit = self.transductive_unit(self.config) or self._n_run
        first = position - position % unit
        return first, min(first + unit, self._n_run)

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        if self._read is None:
            raise ValueError(f"{self.key} consumes the features of its whole transductive unit: attach the run's "
                             "features first (attach_set; the runner does)")
        pos, end = self.n_seen, self.n_seen + view_feats.shape[0]
        if end > self._n_run:
            raise ValueError(f"{self.key}: positions {pos}..{end - 1} run past the attached {self._n_run}")
        out = []
        while pos < end:
            first, stop = self.unit_bounds(pos)
            if self._solved is None or self._solved[0] != first:
                self._solved = None  # the previous unit's rows and features are dropped before the next is read
                # the solves read view 0 only: the other views of the unit (if the run has them) are not kept
                feats = self._read(first, stop)[:, :1].clone().to(view_feats.device)
                self._solved = (first, feats, self._solve(feats))
                self.units_solved += 1
            _, feats, rows = self._solved
            upto = min(end, stop)
            given = view_feats[pos - self.n_seen:upto - self.n_seen, :1]
            if not torch.equal(given, feats[pos - first:upto - first].to(given.dtype)):
                raise ValueError(f"{self.key}: the features given for positions {pos}..{upto - 1} are not those of "
                                 "the attached run")
            out.append(rows[pos - first:upto - first])
            pos = upto
        return torch.cat(out)

    @abc.abstractmethod
    def _solve(self, feats: torch.Tensor) -> torch.Tensor:
        """(U, 1, D) view-0 features of one unit -> (U, K) rows."""
