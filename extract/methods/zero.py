"""ZERO — test-time augmentation at zero temperature (Farina et al., NeurIPS'24; official code
`FarinaMatteo/zero @c609f7c`, `ttas/zero.py` `Zero.zero`). Episodic and training-free; docs/methods.md § ZERO.

Per sample, from the V = 64 views (the original + 63 crop+flip):

1. l = f̂_v · t̂ᵀ, unscaled cosines (V, K); p = softmax(l / τ) with τ = 1 / exp(logit_scale).
2. Keep the int(V·γ) = 19 views of lowest entropy -Σ p log p (`ttas/base.py` `confidence_filter`).
3. p̄ = Σ_kept softmax(l / ε), ε = `torch.finfo(l.dtype).eps`: the "zero temperature" vote.
4. Ties of max p̄: the first remaining (less confident) view, in entropy order, whose argmax is a tied class gets
   +1 (`utils/tools.py` `greedy_break`); when none votes for a tied class, the official fallback
   (`break_sample_tie`) runs on the first remaining view's logits.

Numerics. The official model is OpenAI CLIP in fp16 (`clip.load` on CUDA) under autocast, so l is float16: ε = 2⁻¹⁰
on cosines, a soft vote for near-tied views, and l / τ is rounded to float16 before the fp32 softmax, τ itself
rounded to float16 first (CUDA casts the 0-dim operand to the tensor's dtype: 0.010002136). `logits_fp16`
(default True) rounds l, τ and l / τ to float16 the same way; False keeps them in the compute dtype (ε = 2⁻²³ in
float32: hard votes, TTA-VLM's reading).

Output (`output_kind = "log_probs"`): log of the vote fractions p̄ / Σp̄ (tie bonus included), formed in float64
and rounded to float32 once, so equal fractions are stored equal; the argmax is the official prediction
(`log_vote_fractions`). Where the official fp32 p̄ underflows to exactly 0, the row holds the exact log of that sum,
computed in log space (always below log of the smallest positive float32, -103.3), so rows are finite and keep
their order; exp in float32 gives the official zeros back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from extract.methods.base import MethodConfig, OutputKind, PromptSet, TTAMethod, check_hparams_key, setting
from extract.methods.common import n_confident
from extract.methods.panda import PandaBatchFields, PandaPlugin

TieBreak = Literal["official", "fixed"]


@dataclass(frozen=True)
class ZeroConfig(PandaBatchFields, MethodConfig):
    """ZERO's knobs: one setting for every dataset (`ttas/zero.py` hard-codes them, `scripts/zero.sh`); Panda's
    (`--set panda=true`, docs/methods.md "Panda (`--set panda=true`)"): off by default."""

    n_views: int = 64  # self.num_views = 64 (`ttas/zero.py:23`); --num_views 64 (`run.py`)
    augmix: bool = False  # RandomResizedCrop + flip only (`data/augs.py` via `prepare_dataset`), on every set
    prompts: PromptSet = "single"  # --ctx_init a_photo_of_a: "a photo of a {}." (`scripts/zero.sh`, `clip/custom_clip.py`)
    cupl: bool = False
    episodic: bool = field(default=True, metadata={"fixed": True})
    selection_p: float = setting(0.3, gt=0, le=1)  # self.gamma = 0.3 (`ttas/zero.py:24`): 19 of 64 views
    # l is float16 in the official run (fp16 CLIP weights, `torch.cuda.amp.autocast()` in `run.py`), which also sets
    # the zero temperature eps = finfo(float16).eps = 2^-10; CUDA also rounds the temperature to float16 for l / temp
    logits_fp16: bool = True
    # "official": `utils/tools.py` as written, whose fallback `logit[~ties]` blanks classes K-1-t instead of the
    # non-tied ones; "fixed": the fallback picks the first remaining view's best tied class
    tie_break: TieBreak = "official"


class Zero(PandaPlugin, TTAMethod):
    """ZERO: confident views, zero-temperature softmax, vote. Stateless; every sample is independent. With Panda
    the views' features are f̂ − β·m̄, not renormalised (ruxideng/Panda `Zero.py`)."""

    key: ClassVar[str] = "zero"
    prefix_stable: ClassVar[bool] = True  # each row is its own sample's vote
    Config: ClassVar[type[MethodConfig]] = ZeroConfig
    output_kind: ClassVar[OutputKind] = "log_probs"
    unseen_like: ClassVar[str] = "imagenet"  # one setting for every dataset

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> ZeroConfig:
        check_hparams_key(hparams_key)
        return ZeroConfig()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        cfg: ZeroConfig = self.config  # type: ignore[assignment]
        dt = self.compute_dtype(view_feats)
        feats = self.panda_shift(view_feats).to(dt)  # (B, V, D), L2-normalised (Panda: shifted)
        cos = feats @ self.text_features.to(dt).T  # (B, V, K) unscaled cosines
        temp = float(torch.tensor(1.0 / self.logit_scale, dtype=torch.float32))  # `self.model.temp`, fp32
        if cfg.logits_fp16:
            cos = cos.half().to(dt)
            eps = torch.finfo(torch.float16).eps
            # `l / self.model.temp` (`ttas/zero.py:76`) on CUDA: the fp32 0-dim temperature is cast to the fp16
            # operand's dtype (0.01 -> 0.010002136, a logit scale of 99.979), the quotient is formed in float32
            # (opmath) and rounded to float16
            temp16 = torch.tensor(temp, dtype=torch.float16).float()
            scaled = (cos.float() / temp16).half().to(dt)
        else:  # l in float32, TTA-VLM's reading: eps = 2^-23, hard votes
            cos = cos.float().to(dt)
            eps = torch.finfo(torch.float32).eps
            scaled = cos / temp
        # the official softmax runs in float32 (autocast) and its entropy has no epsilon (`confidence_filter`): a
        # probability that underflows makes the entropy NaN, which `argsort` puts last; kept as such
        p = scaled.float().softmax(-1)
        entropy = torch.nan_to_num(-(p * p.log()).sum(-1), nan=math.inf)  # (B, V)
        order = torch.argsort(entropy, dim=1, stable=True)  # (B, V) ascending entropy
        n = n_confident(cos.shape[1], cfg.selection_p)
        kept = torch.gather(cos, 1, order[:, :n, None].expand(-1, -1, cos.shape[-1]))  # (B, n, K)
        z = kept / eps  # exact: eps is a power of two
        p_bar = z.float().softmax(-1).sum(1).to(dt)  # (B, K): the official votes, softmax in float32 (autocast)
        log_votes = z.log_softmax(-1).logsumexp(1)  # (B, K): the same sums in log space (no underflow)
        bonus = torch.zeros_like(p_bar)
        top = p_bar.max(-1, keepdim=True).values
        tied = p_bar == top  # (B, K)
        for b in torch.nonzero(tied.sum(-1) > 1).flatten().tolist():  # rare: Python per tied sample only
            rest = cos[b, order[b, n:]]  # (V - n, K) the less confident views, in entropy order
            bonus[b, self._break_tie(tied[b], rest, cfg.tie_break)] = 1.0
        return log_vote_fractions(p_bar + bonus, log_votes)

    @staticmethod
    def _break_tie(tied: torch.Tensor, rest: torch.Tensor, rule: TieBreak) -> int:
        """The class that gets the +1 (`utils/tools.py` `greedy_break`).

        Args:
            tied: (K,) bool, the classes sharing the maximal vote.
            rest: (R, K) cosines of the views not kept, in ascending entropy.
            rule: "official" or "fixed" (see `ZeroConfig.tie_break`).
        """
        for pred in rest.argmax(-1).tolist():
            if tied[pred]:
                return int(pred)
        classes = torch.nonzero(tied).flatten()
        if rest.shape[0] == 0:
            # no view left (fewer views than 1/(1-γ); the official code would index past the end): smallest tied
            return int(classes[0])
        row = rest[0].clone()
        if rule == "official":
            # `logit[~ties] = -inf` with int indices: ~t = -t-1, i.e. class K-1-t is blanked, then the argmax of all
            row[-classes - 1] = -math.inf
            return int(row.argmax())
        mask = torch.full_like(row, -math.inf)
        mask[classes] = 0.0
        return int((row + mask).argmax())


def log_vote_fractions(votes: torch.Tensor, log_votes: torch.Tensor) -> torch.Tensor:
    """The stored row: log(v_c / Σ_j v_j), rounded once to float32, whose argmax is the official prediction.

    The fractions are formed in float64 from the float32 votes (the sum over the sorted row, so a permuted row gives
    the same numbers) and rounded to float32 once: equal fractions in the method give equal stored values, so the
    calibrate stage sees a tie where ZERO has one (`calibrate.functional.softmax.stored_probability_stats`).
    Votes closer than a float32 log can tell apart (7.0 and 6.9999995) would round to the same value and hand
    the argmax to the smaller class index: a class that collapsed onto the official winner is stored one float32
    step below it instead. A vote of exactly 0 (an underflowed float32 sum) takes the exact log-space sum.

    Args:
        votes: (B, K) the official p̄ after the tie bonus (float32 values).
        log_votes: (B, K) log of the unrounded vote sums (for the zeros).

    Returns:
        (B, K) float32 log vote fractions.

    Example:
        >>> out = log_vote_fractions(torch.tensor([[6.9999995, 7.0]]), torch.zeros(1, 2))
        >>> int(out.argmax()), bool(out[0, 0] < out[0, 1])
        (1, True)
    """
    v = votes.double()
    total = v.sort(-1).values.sum(-1, keepdim=True)
    out = torch.where(v > 0, (v / total).log(), log_votes.double() - total.log()).float()
    winner = votes.argmax(-1, keepdim=True)  # unique: the bonus broke the official ties
    top = out.gather(-1, winner)
    below = torch.nextafter(top, torch.full_like(top, -math.inf))
    others = torch.ones_like(out, dtype=torch.bool).scatter_(-1, winner, False)
    return torch.where(others & (out >= top), below, out)
