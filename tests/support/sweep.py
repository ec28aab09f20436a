"""Shared slow references of the sweep's tests: the documented cost model (docs/sweep.md, "The cost model")
written out term by term, independent of `extract.sweep.cost`'s own evaluation."""

from __future__ import annotations

#: H100 (SXM) datasheet figures and the documented efficiencies, as docs/sweep.md states them
H100 = {"tensor": 989e12, "fp32": 67e12, "bandwidth": 3350e9}
FLOP_EFF, BW_EFF, LAUNCH_S = 0.2, 0.7, 17.7e-6


def term_total(term: str, n: int, k: int, views: int, fig) -> float:
    """A work term summed over a run, the slow way: a term holding `P` is summed position by position (the n-th
    sample does n units), every other factor multiplied out."""
    sizes = {"N": n, "K": k, "V": views, "D": fig.embed_dim, "img_flops": fig.img_flops,
             "txt_flops": fig.txt_flops, "img_params": fig.img_params, "txt_params": fig.txt_params}
    if term == "1":
        return 1.0
    total, positions = 1.0, False
    for factor in term.split("*"):
        name, _, power = factor.partition("^")
        power = int(power or 1)
        if name == "P":
            positions = True
            assert power == 1, term
            continue
        total *= sizes[name] ** power
    return total * sum(range(1, n + 1)) if positions else total


def work_seconds(work, n: int, k: int, views: int, fig, card=H100) -> float:
    """GPU-seconds of `work` (an `extract.sweep.cost.Work`) over a run: each kind at its documented rate."""
    def kind(terms):
        return sum(c * term_total(t, n, k, views, fig) for t, c in terms.items())
    return (kind(work.flops) / (card["tensor"] * FLOP_EFF) + kind(work.fp32_flops) / (card["fp32"] * FLOP_EFF)
            + kind(work.bytes) / (card["bandwidth"] * BW_EFF) + kind(work.launches) * LAUNCH_S
            + kind(work.host_s))


def adapt_reference(cost, n: int, k: int, views: int, fig, card=H100) -> float:
    """An `AdaptCost`'s seconds over a run: its work on `card`."""
    return work_seconds(cost.work, n, k, views, fig, card)
