"""The method lines of `make bench-extract`: the adaptation cost per sample of every registered method, and ECALP's
growth with the stream (docs/benchmarks.md, "TTA-VLM methods: cost per sample").

Every method of `extract.methods.REGISTRY` runs through `run_extraction` on the bench's small CLIP and synthetic set,
as `zaec-extract` runs it, from a feature cache filled beforehand (so no run encodes). The cost counted is the CPU
time of the main thread inside `method.adapt` (one torch thread, so all of the method's work), after its first call
(warm-up: lazy set-up, first allocations), until a time budget is spent or the cached positions end. Reward models,
pixel readers and any other input a method takes from the runner are therefore included exactly as a run builds
them. A method that reads class descriptions (AWT) gets made-up ones of the published files' shape
(`bench_descriptions`). A method that cannot run in this setting is listed with the reason, never left out.

ECALP's cost per sample grows with the samples seen (its graph holds every past sample): `ecalp_growth` times it
on random features at several stream lengths, and `ecalp_graph_bytes` states its memory from its data structures.
"""

from __future__ import annotations

import contextlib
import math
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

#: the view policies and the zero-shot overrides that fill their feature caches
POLICY_OVERRIDES: dict[str, dict[str, str] | None] = {
    "single": None, "crop_flip": {"n_views": "64", "augmix": "false"}, "augmix": {"n_views": "64", "augmix": "true"}}
#: the reference methods every ratio is taken against (always measured)
REFERENCES: tuple[str, ...] = ("tda", "tpt")


@dataclass(frozen=True)
class MethodCost:
    """One method's line: `samples` timed after the warm-up call, `seconds` of CPU time in `adapt` over them;
    `skipped` the reason when it could not run (then the numbers are 0)."""

    key: str
    policy: str = ""
    samples: int = 0
    seconds: float = 0.0
    skipped: str = ""

    @property
    def per_sample(self) -> float:
        """CPU seconds per sample (nan when nothing was timed)."""
        return self.seconds / self.samples if self.samples else math.nan


def bench_descriptions(root: Path, folder: Path, dataset: str = "dtd", per_class: int = 50) -> Path:
    """Write the class-description file of every registered method that reads descriptions (AWT's `<dataset>.json`)
    for the classes of the bench's set under `root` into `folder`, and return `folder` (the runs'
    `descriptions_dir`). The sentences are made up, not LLM-written: AWT's cost depends on their number and length
    (`per_class` of about the published ones' length), not on what they say."""
    import json

    from extract.datasets import load_testset
    from extract.methods import REGISTRY

    names = load_testset(dataset, root).class_names
    folder.mkdir(parents=True, exist_ok=True)
    for cls in REGISTRY.values():
        if getattr(cls, "needs_descriptions", False):
            file_name = cls.descriptions_request(cls.default_config(dataset, "ViT-B-16"), dataset)[0]
            table = {n: [f"A made-up description {i} of {n}, a placeholder of the length of an LLM-written one."
                         for i in range(per_class)] for n in names}
            (folder / file_name).write_text(json.dumps(table), encoding="utf-8")
    return folder


def bench_overrides(cls: type, model_dir: Path, stand_ins: Any = None) -> dict[str, str]:
    """The `--set` values a method needs to run in the bench (`run_overrides` with the bench's own small model as
    RLCF's reward model: a second load of the same weights, its features from the same cache)."""
    return run_overrides(cls, model_dir, stand_ins)


def batch_overrides(cls: type, positions: int, adapt_batch: int) -> dict[str, str]:
    """The `--set` a method that adapts over batches of its own (`adapt_width`: Tent, SAR, ...) needs to be timed
    on `positions` one-view positions: none where they hold two of its batches (the first call is the untimed
    warm-up), so it is timed at its official batch, reading its batches' pixels as a run does; on fewer (a smoke
    run of a few images) its batch becomes `adapt_batch` (at most half the positions), so that it still runs."""
    width = cls.adapt_width(cls.default_config("dtd", "ViT-B-16"))  # type: ignore[attr-defined]
    if width is None or positions >= 2 * width:
        return {}
    return {"batch_size": str(max(1, min(adapt_batch, positions // 2)))}


class _Enough(BaseException):
    """Raised from inside `adapt` once the budget is spent: ends the run (a BaseException, so that no `except
    Exception` of the runner takes it for a failure of the method)."""


@contextlib.contextmanager
def patched_adapt(cls: type, adapt: Callable[[Any, Any], Any]) -> Iterator[None]:
    """`cls.adapt` replaced by `adapt` for the duration (the wrappers of the benches: `adapt` calls the original,
    read before); then the class's own `adapt` again, or the inherited one."""
    had_own = "adapt" in cls.__dict__
    original = cls.adapt
    cls.adapt = adapt  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            cls.adapt = original  # type: ignore[method-assign]
        else:
            del cls.adapt


@contextlib.contextmanager
def _adapt_timer(cls: type, budget_s: float) -> Iterator[list[tuple[int, float]]]:
    """Wrap `cls.adapt` for the duration: each call appends (samples, CPU seconds of this thread); after the first
    call, once the timed calls passed `budget_s`, the next call ends the run with `_Enough`."""
    calls: list[tuple[int, float]] = []
    original = cls.adapt

    def adapt(self: Any, view_feats: Any) -> Any:
        if len(calls) > 1 and sum(s for _, s in calls[1:]) >= budget_s:
            raise _Enough
        t = time.thread_time()
        out = original(self, view_feats)
        calls.append((int(view_feats.shape[0]), time.thread_time() - t))
        return out

    with patched_adapt(cls, adapt):
        yield calls


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _timed_run(key: str, run: Callable[..., Any], overrides: dict[str, str], limits: dict[str, int],
               timer: contextlib.AbstractContextManager[Any], pretrained: str | None) -> tuple[str, str, Any]:
    """Plan `key`'s view policy on the bench's model (`pretrained`; None: the default backbone) and run it over
    `limits[policy]` positions inside `timer`: (policy, why it failed or "", what the timer recorded). A method
    that cannot run on the model (`extract.run.options.backbone_refusal`, the method's `towers`) is not tried: the
    refusal is why. A run the timer ends (`_Enough`) has not failed."""
    from extract.run.options import BackboneRefusal, RunOptions, plan

    options = RunOptions.make(key, "dtd", overrides=overrides, **({} if pretrained is None else
                                                                   {"backbone": None, "pretrained": pretrained}))
    try:
        policy = plan(options).policy
    except BackboneRefusal as e:  # the refusal is why (`extract.run.options.backbone_refusal`)
        return "", str(e), None
    except Exception as e:  # noqa: BLE001  (any failure is reported on the method's line)
        return "", _one_line(e), None
    with timer as rec:
        try:
            run(key, overrides=overrides, limit=limits[policy])
        except _Enough:
            pass
        except Exception as e:  # noqa: BLE001
            return policy, _one_line(e), rec
    return policy, "", rec


def method_cost(key: str, run: Callable[..., Any], model_dir: Path, limits: dict[str, int], *,
                budget_s: float, adapt_batch: int = 64, stand_ins: Any = None) -> MethodCost:
    """Time one registered method through `run(key, overrides=..., limit=...)` (a `run_extraction` with the
    bench's model, set, caches and adapt batch bound in).

    Args:
        key: registry key.
        run: the bound run function; its out folder is the caller's business.
        model_dir: the bench model's folder (for `bench_overrides`).
        limits: view policy -> stream positions cached for it (the run's `limit`).
        budget_s: CPU seconds of timed `adapt` calls after which the run is ended.
        adapt_batch: the bench's samples per call (`batch_overrides`).
        stand_ins: the stand-ins of second models (`bench_overrides`).
    """
    from extract.methods import get_method

    cls = get_method(key)
    overrides = {**bench_overrides(cls, model_dir, stand_ins), **batch_overrides(cls, limits["single"], adapt_batch)}
    policy, failed, calls = _timed_run(key, run, overrides, limits, _adapt_timer(cls, budget_s),
                                       f"local-dir:{model_dir}")
    if failed:
        return MethodCost(key, policy, skipped=failed)
    if len(calls) < 2:
        return MethodCost(key, policy, skipped=f"only {len(calls)} adapt call(s): raise the cached positions")
    timed = calls if solves_first(cls) else calls[1:]
    return MethodCost(key, policy, sum(n for n, _ in timed), sum(s for _, s in timed))


def solves_first(cls: type) -> bool:
    """Whether the first `adapt` call of a run holds the method's main work: a transductive method (consumes
    "set_features") solves its first unit there (the whole run by default), so its timing counts that call instead of
    leaving it out as a warm-up."""
    return getattr(cls, "consumes", "features") == "set_features"


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the duration (so that the calling thread's CPU time is all of the work)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def method_costs(model: Any, model_dir: Path, root: Path, work: Path, keys: Sequence[str], *,
                 single_positions: int, multi_positions: int, adapt_batch: int, budget_s: float,
                 log: Callable[[str], None] = lambda s: None) -> list[MethodCost]:
    """Every method of `keys` (the references `REFERENCES` added first), timed by `method_cost` on the dtd-layout
    set under `root`; the feature caches of the three view policies are filled first by zero-shot runs
    (`single_positions` / `multi_positions` stream positions), so the timed runs never encode.

    Args:
        model: the loaded bench model; model_dir: its folder.
        root: data root holding the synthetic set; work: a scratch folder (caches and outputs).
        keys: registry keys to time.
        single_positions, multi_positions: positions cached (and run) for 1-view and 64-view methods.
        adapt_batch: samples per `adapt` call (the first call of each run is the untimed warm-up).
        budget_s: CPU seconds of timed `adapt` calls per method.
        log: progress lines.
    """
    from extract.runner import run_extraction

    limits = {"single": single_positions, "crop_flip": multi_positions, "augmix": multi_positions}
    base = dict(data_root=root, model=model, progress=False, cache_dir=work / "cache", adapt_batch=adapt_batch,
                part_size=adapt_batch * max(1, 4096 // adapt_batch), log=lambda s: None,
                descriptions_dir=bench_descriptions(root, work / "descriptions"))
    for policy, ov in POLICY_OVERRIDES.items():
        log(f"filling the feature cache: {policy}, {limits[policy]} positions")
        run_extraction("zero-shot", "dtd", out=work / f"fill-{policy}", overrides=ov, limit=limits[policy], **base)
    outs = iter(range(1_000_000))

    def run(key: str, *, overrides: dict[str, str], limit: int) -> Any:
        out = work / f"out-{next(outs)}"
        try:
            return run_extraction(key, "dtd", out=out, overrides=overrides, limit=limit, **base)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    from tools.second_models import StandIns

    stand_ins = StandIns(work / "second-models", model)
    results = []
    with one_torch_thread():
        for key in dict.fromkeys([*REFERENCES, *keys]):
            log(f"timing {key}")
            results.append(method_cost(key, run, model_dir, limits, budget_s=budget_s, adapt_batch=adapt_batch,
                                       stand_ins=stand_ins))
    return results


# ---------------------------------------------------------------------------------------------------------------
# samples/s of every method as a run adapts (wall time): what `bench-gpu` prices sweeps with

@dataclass(frozen=True)
class RunRate:
    """One method's steady adaptation rate in a real run at K classes.

    `samples` stream positions were adapted in `seconds` (`bench_clock`), from the end of the run's first batch
    (its `adapt` call is the warm-up: lazy set-up, first kernels, allocator) to the end of its last timed one, so the
    loop's own work for each batch (cache read, the zero-shot anchor, shard rows and parts) is in it; `encode_s` the seconds per sample of a second
    model's encoding pass inside the run (RLCF's reward model: 64 views of every position, before the loop), else 0;
    `mean_position` the mean stream position of the timed samples (ECALP's cost grows with it); `skipped` the reason
    when it could not run.
    """

    key: str
    k: int
    policy: str = ""
    samples: int = 0
    seconds: float = 0.0
    encode_s: float = 0.0
    mean_position: float = 0.0
    skipped: str = ""

    @property
    def samples_per_s(self) -> float:
        """Samples per second of the run's steady state, the reward model's encoding included (nan: not timed)."""
        if not self.samples or self.seconds <= 0:
            return math.nan
        return 1.0 / (self.seconds / self.samples + self.encode_s)


def _sync_all() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def bench_clock() -> float:
    """The clock of the rates: wall seconds where CUDA runs (the GPU works beside the process), else the CPU seconds
    of this process, which a loaded machine moves far less (with one torch thread and in-process loading, as a CPU
    run loads, they are all of a run's work; `one_torch_thread`)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return time.perf_counter()
    return time.process_time()


@contextlib.contextmanager
def _wall_timer(cls: type, budget_s: float | None) -> Iterator[dict[str, list[tuple[int, float]]]]:
    """Time the adapt loop of a run of `cls`, and a second model's pass inside the run (`EncoderPass.encode`, RLCF's
    reward model or COSMIC's DINOv2; `DiffusionPass.encode`, DiffTPT's generated views).

    Yields {"rows": [(samples, end time)], "encode": [(samples, seconds)], "start": [(0, time)]}: the time
    (`bench_clock`, the device synchronised) at the end of each `PartWriter.add`, the loop's last step for a batch
    (after `adapt`, the zero-shot anchor, and the part write when the batch completes one), each second model's pass, and
    the time before the first `adapt` call (a transductive method solves in it, `solves_first`). Once `budget_s`
    seconds passed since the first batch's end, the next `adapt` call ends the run with `_Enough` (never before a
    second batch)."""
    from extract.run.diffusion import DiffusionPass
    from extract.run.reward import EncoderPass
    from extract.run.writer import PartWriter

    rec: dict[str, list[tuple[int, float]]] = {"rows": [], "encode": [], "start": []}
    original, encode, generate, add = cls.adapt, EncoderPass.encode, DiffusionPass.encode, PartWriter.add

    def adapt(self: Any, view_feats: Any) -> Any:
        done = rec["rows"]
        if budget_s is not None and len(done) > 1 and bench_clock() - done[0][1] >= budget_s:
            raise _Enough
        if not rec["start"]:
            _sync_all()
            rec["start"].append((0, bench_clock()))
        return original(self, view_feats)

    def timed_add(self: Any, sample_id: Any, *args: Any) -> Any:
        out = add(self, sample_id, *args)
        _sync_all()
        rec["rows"].append((len(sample_id), bench_clock()))
        return out

    def timing(real: Callable[..., int]) -> Callable[..., int]:
        def timed(self: Any, *args: Any, **kwargs: Any) -> int:
            _sync_all()
            t = bench_clock()
            n = real(self, *args, **kwargs)
            _sync_all()
            rec["encode"].append((int(n), bench_clock() - t))
            return n
        return timed

    PartWriter.add = timed_add  # type: ignore[method-assign]
    EncoderPass.encode, DiffusionPass.encode = timing(encode), timing(generate)  # type: ignore[method-assign]
    try:
        with patched_adapt(cls, adapt):
            yield rec
    finally:
        EncoderPass.encode, DiffusionPass.encode, PartWriter.add = encode, generate, add  # type: ignore[method-assign]


def run_rate(key: str, k: int, run: Callable[..., Any], overrides: dict[str, str], limits: dict[str, int], *,
             budget_s: float | None, adapt_batch: int = 64, pretrained: str | None = None) -> RunRate:
    """Time one registered method through `run(key, overrides=..., limit=...)` (a `run_extraction` with the
    bench's model, K-class set, caches and the runner's default adapt batch bound in): `RunRate` of its adapt loop
    after the first call, until `budget_s` seconds of it (None: the whole run) or the cached positions end.

    Args:
        key: registry key; k: the set's classes (recorded).
        run: the bound run function.
        overrides: `--set` values (`run_overrides`).
        limits: view policy -> stream positions cached for it (the run's `limit`).
        budget_s: seconds (`bench_clock`) after the first batch after which the run is ended.
        adapt_batch: the runner's samples per call (`batch_overrides`).
        pretrained: the model the runs load (`LoadedModel.pretrained`): a method that cannot run on it is skipped
            with the reason (None: the default backbone's).
    """
    from extract.methods import get_method

    cls = get_method(key)
    overrides = {**overrides, **batch_overrides(cls, limits["single"], adapt_batch)}
    policy, failed, rec = _timed_run(key, run, overrides, limits, _wall_timer(cls, budget_s), pretrained)
    if failed:
        return RunRate(key, k, policy, skipped=failed)
    calls = rec["rows"]
    if len(calls) < 2:
        return RunRate(key, k, policy, skipped=f"only {len(calls)} adapt call(s): raise the cached positions")
    # a transductive method solves its first unit in the first call: timed from before it, every row counted
    skip = 0 if solves_first(cls) else 1
    n = sum(c for c, _ in calls[skip:])
    first = sum(c for c, _ in calls[:skip])
    begin = rec["start"][0][1] if not skip else calls[0][1]
    enc_n = sum(c for c, _ in rec["encode"])
    enc_s = sum(s for _, s in rec["encode"]) / enc_n if enc_n else 0.0
    return RunRate(key, k, policy, n, calls[-1][1] - begin, enc_s, first + (n - 1) / 2)


def run_overrides(cls: type, reward_dir: Path | None, stand_ins: Any = None) -> dict[str, str]:
    """The `--set` values a method needs to run in a bench of rates: a method with a reward model (RLCF) gets
    `reward_dir`'s model as its reward model (another model than the policy, so that the run encodes the 64 views
    a second time, as with its official ViT-L-14), or the policy's own when `reward_dir` is None; a method with
    other external files (DiffTPT, PromptAlign) the stand-ins of `stand_ins` (`tools.second_models.StandIns`)."""
    if getattr(cls, "needs_reward_model", False):
        if reward_dir is None:
            return {"reward_backbone": "policy"}
        return {"reward_backbone": "", "reward_pretrained": f"local-dir:{reward_dir}"}
    if cls.external_files and stand_ins is not None:  # type: ignore[attr-defined]
        return stand_ins.overrides(cls.key)  # type: ignore[attr-defined]
    return {}


def fill_caches(model: Any, root: Path, cache_dir: Path, limits: dict[str, int], *, adapt_batch: int,
                policies: Sequence[str] = tuple(POLICY_OVERRIDES), log: Callable[[str], None] = lambda s: None) \
        -> None:
    """Fill the feature caches of `policies` (zero-shot runs of `limits[policy]` positions on the dtd-layout set
    under `root`), so that timed runs never encode the policy's views."""
    from extract.runner import run_extraction

    for policy in policies:
        log(f"filling the feature cache: {policy}, {limits[policy]} positions")
        out = cache_dir.parent / f"fill-{cache_dir.name}-{policy}"
        run_extraction("zero-shot", "dtd", data_root=root, model=model, progress=False, cache_dir=cache_dir,
                       out=out, overrides=POLICY_OVERRIDES[policy], limit=limits[policy], adapt_batch=adapt_batch,
                       log=lambda s: None)
        shutil.rmtree(out, ignore_errors=True)


def _policies(keys: Sequence[str], pretrained: str) -> set[str]:
    """The view policies the methods of `keys` read on the dtd layout with the model `pretrained` (a method that
    cannot plan, or cannot run on the model, adds none)."""
    from extract.run.options import RunOptions, plan

    out = set()
    for key in keys:
        with contextlib.suppress(Exception):
            out.add(plan(RunOptions.make(key, "dtd", backbone=None, pretrained=pretrained)).policy)
    return out


class RateRuns:
    """Runs of registered methods on one K-class dtd-layout set, the feature caches of the view policies they read
    filled once (`fill_caches`) and copied afresh for every run, so a reward model's cache starts empty as in a
    first run (`run(key, overrides=..., limit=...)`, the shape `run_rate` calls). Text prototypes a run encodes are
    kept for the later runs, as a sweep's cache folder keeps them (TPS's 80 templates x K classes at 77 tokens
    cost seconds per run that are not adaptation)."""

    def __init__(self, model: Any, root: Path, work: Path, keys: Sequence[str], limits: dict[str, int], *,
                 adapt_batch: int, log: Callable[[str], None] = lambda s: None) -> None:
        self.model, self.root, self.work, self.adapt_batch = model, root, work, adapt_batch
        self.base_cache = work / "cache"
        self.descriptions = bench_descriptions(root, work / "descriptions")
        fill_caches(model, root, self.base_cache, limits, adapt_batch=adapt_batch, log=log,
                    policies=[p for p in POLICY_OVERRIDES if p in _policies(keys, model.pretrained)])
        self._ids = iter(range(1_000_000))

    def __call__(self, key: str, *, overrides: dict[str, str], limit: int) -> float:
        """Run `key` over `limit` positions; returns the run's seconds (`bench_clock`, the copy of the caches
        excluded)."""
        from extract.runner import run_extraction

        i = next(self._ids)
        out, cache = self.work / f"out-{i}", self.work / f"cache-run-{i}"
        shutil.copytree(self.base_cache, cache)
        try:
            _sync_all()
            t = bench_clock()
            run_extraction(key, "dtd", data_root=self.root, model=self.model, progress=False, cache_dir=cache,
                           out=out, overrides=overrides, limit=limit, adapt_batch=self.adapt_batch,
                           log=lambda s: None, descriptions_dir=self.descriptions)
            _sync_all()
            took = bench_clock() - t
            for text in cache.glob("*/text"):  # text prototypes stay cached for later runs, as in a sweep's folder
                shutil.copytree(text, self.base_cache / text.relative_to(cache), dirs_exist_ok=True)
            return took
        finally:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)


@dataclass(frozen=True)
class Agreement:
    """A method's bench rate against timed runs at K classes: `bench` samples/s (`run_rate` over all positions),
    `run` the marginal samples/s of two timed `run_extraction` calls ((N - B) / (T(N) - T(B)), B the adapt batch:
    what a run pays per sample beyond its first call, fixed costs cancelled; infinite when the longer run took no
    longer, so the ratio reads 0 and fails the check), `whole` N / T(N) of the longer run
    (its set-up, warm-up call and reward model load included); `skipped` the reason when one could not run."""

    key: str
    k: int
    policy: str = ""
    bench: float = math.nan
    run: float = math.nan
    whole: float = math.nan
    skipped: str = ""

    @property
    def ratio(self) -> float:
        """bench / run (1.0: the bench prices the method as the run pays it)."""
        return self.bench / self.run


def agreement(model: Any, root: Path, work: Path, keys: Sequence[str], k: int, *, limits: dict[str, int],
              adapt_batch: int, reward_dir: Path | None, repeat: int = 1,
              log: Callable[[str], None] = lambda s: None) -> list[Agreement]:
    """For every method of `keys`: its bench rate and two timed runs of it (`Agreement`), one after the other on
    the same caches, so that the load of the machine moves them alike; with `repeat` > 1 each of the three is
    measured that many times, interleaved, and the fastest kept (a loaded machine only ever slows a run down)."""
    from extract.methods import get_method

    from tools.second_models import StandIns

    runs = RateRuns(model, root, work, keys, limits, adapt_batch=adapt_batch, log=log)
    stand_ins = StandIns(work / "second-models", model)
    out = []
    for key in keys:
        log(f"bench and runs of {key} at K = {k}")
        cls = get_method(key)
        overrides = {**run_overrides(cls, reward_dir, stand_ins), **batch_overrides(cls, limits["single"], adapt_batch)}
        first = _call_width(key, overrides, adapt_batch)  # the first adapt call: the method's batch, if it has one
        rates, t_first, t_all = [], [], []
        for _ in range(max(1, repeat)):
            rates.append(run_rate(key, k, runs, overrides, limits, budget_s=None, adapt_batch=adapt_batch,
                                  pretrained=model.pretrained))
            if rates[-1].skipped:
                break
            n = limits[rates[-1].policy]
            t_first.append(runs(key, overrides=overrides, limit=first))
            t_all.append(runs(key, overrides=overrides, limit=n))
        if rates[-1].skipped:
            out.append(Agreement(key, k, rates[-1].policy, skipped=rates[-1].skipped))
            continue
        bench, policy = max(r.samples_per_s for r in rates), rates[0].policy
        n = limits[policy]
        extra = min(t_all) - min(t_first)
        if extra <= 0:  # the longer run was not measurably slower (microsecond methods, or noise): no marginal rate
            log(f"{key}: the run of {n} positions took no longer than the run of {first} "
                f"({min(t_all):.3f} s vs {min(t_first):.3f} s); its marginal rate reads as infinite")
        marginal = (n - first) / extra if extra > 0 else math.inf
        out.append(Agreement(key, k, policy, bench, marginal, n / min(t_all)))
    return out


def _call_width(key: str, overrides: dict[str, str], adapt_batch: int) -> int:
    """Samples in a run's first adapt call: the method's own batch with `overrides`, else `adapt_batch`
    (`PlannedRun.adapt_width`; `adapt_batch` when the method cannot plan, as its line then says)."""
    from extract.run.options import RunOptions, plan

    try:
        return plan(RunOptions.make(key, "dtd", overrides=overrides, adapt_batch=adapt_batch)).adapt_width
    except Exception:  # noqa: BLE001  (the timed run reports the failure on the method's line)
        return adapt_batch


def parse_methods(raw: str, registry: Sequence[str]) -> list[str]:
    """`--methods`: "all" (every registered method), "none", or comma-separated registry keys.

    Raises:
        ValueError: an unknown key (the message lists the registered ones).
    """
    raw = raw.strip()
    if raw == "all":
        return list(registry)
    if raw in ("", "none"):
        return []
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    unknown = [k for k in keys if k not in registry]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {', '.join(unknown)}; registered: {', '.join(registry)}")
    return keys


def costs_table(console: Any, costs: Sequence[MethodCost], n_classes: int) -> None:
    """The method lines as a rich table: ms per sample and the ratios to TDA and TPT of the same run."""
    from rich.table import Table

    ref = {c.key: c.per_sample for c in costs if c.key in REFERENCES and not c.skipped}
    table = Table(title=f"adaptation cost per sample, CPU (one thread), bench model, K = {n_classes}")
    for col in ("method", "views", "samples", "ms / sample", "/ TDA", "/ TPT"):
        table.add_column(col, justify="right")
    for c in costs:
        if c.skipped:
            table.add_row(c.key, c.policy, "-", f"skipped: {c.skipped}", "", "")
            continue
        ratios = [f"{c.per_sample / ref[r]:.2f}" if r in ref else "-" for r in REFERENCES]
        table.add_row(c.key, c.policy, str(c.samples), f"{1e3 * c.per_sample:.3f}", *ratios)
    console.print(table)
    console.print("CPU time of the calling thread inside `method.adapt` (one torch thread), after each run's first "
                  "call (a transductive method's first call, its solve, included), from cached features (the encoding pass is priced apart); ratios are to TDA's and TPT's "
                  "time per sample in this run, which a loaded machine moves far less than the absolute times.")


def ecalp_graph_bytes(n_nodes: int, n_classes: int, dim: int, *, k_image: int = 8, k_text: int = 3,
                      capacity: int | None = None, float_bytes: int = 4) -> dict[str, int]:
    """Bytes of ECALP's data structures (extract/methods/ecalp.py) with `n_nodes` image nodes (N = samples + 1):
    `state` what it keeps between samples; `propagation` the peak of the transients of one propagation step.

    state: the feature buffer (`capacity` rows, doubled from 1024: the next power of two >= N - 1, x D floats), the
    candidate store (N x (k_image + 2) similarities and int64 indices), the current lists (N x k_image, N x k_text,
    each a float and an int64) and Y_0 (N floats, N int64).
    propagation: the edge list (11 N directed edges, each once more reversed, int64 ends and float weights), Y_0
    densified (N x K), the label matrix (N + K) x K, and per iteration the gathered labels of every edge whose
    source is an image node (E = N (k_image + k_text) + N k_image rows of K floats), twice (the gather and its
    product with the edge weights), plus Y_t (N x K).
    """
    n, k, i64 = n_nodes, n_classes, 8
    rows = capacity if capacity is not None else max(1024, 1 << max(0, n - 2).bit_length())
    state = {"features": rows * dim * float_bytes,
             "store": n * (k_image + 2) * (float_bytes + i64),
             "neighbours": n * (k_image + k_text) * (float_bytes + i64),
             "y0": n * (float_bytes + i64)}
    directed = n * (k_image + k_text)
    edges_img = directed + n * k_image  # sources that are image nodes: every directed edge + the reversed image ones
    trans = {"edge_list": 2 * directed * (2 * i64 + float_bytes),
             "labels": (n * k + (n + k) * k + n * k) * float_bytes,  # Y_0, Ŷ, Y_t
             "gathered": 2 * edges_img * k * float_bytes}
    return {"state": sum(state.values()), "propagation": sum(trans.values()),
            **{f"state.{a}": b for a, b in state.items()}, **{f"propagation.{a}": b for a, b in trans.items()}}


def _ecalp(n_classes: int, dim: int, seed: int = 0) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    from extract.methods import get_method

    cls = get_method("ecalp")
    g = torch.Generator().manual_seed(seed)
    text = F.normalize(torch.randn(n_classes, dim, generator=g), dim=-1)
    return cls(cls.default_config("imagenet", "ViT-B-16"), text, 100.0, backbone="ViT-B-16", dataset="imagenet"), g


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def ecalp_stream(points: Sequence[int], *, n_classes: int = 1000, dim: int = 512, window: int = 16) \
        -> list[tuple[int, float]]:
    """ECALP on a real stream of random features (K x D): CPU seconds per sample (one thread) over the `window`
    samples ending at each stream length of `points`; the stream runs to max(points)."""
    import torch
    import torch.nn.functional as F

    method, g = _ecalp(n_classes, dim)
    out, pos = [], 0
    with one_torch_thread():
        for p in sorted(points):
            start = max(pos, p - window)
            while pos < start:
                step = min(64, start - pos)
                method.adapt(F.normalize(torch.randn(step, 1, dim, generator=g), dim=-1))
                pos += step
            t = time.thread_time()
            method.adapt(F.normalize(torch.randn(p - pos, 1, dim, generator=g), dim=-1))
            out.append((p, (time.thread_time() - t) / (p - pos)))
            pos = p
    return out


def ecalp_built_graph(n_seen: int, n_classes: int, dim: int, config: Any, generator: Any) -> dict[str, Any]:
    """ECALP's graph after `n_seen` samples in its layout (extract/methods/ecalp.py, `_grow`: N = n_seen + 1 node
    rows, the feature buffer doubled from 1024 rows), filled with random features and random sorted neighbour lists:
    the work of the next sample depends on the sizes only, so a large N needs no quadratic stream."""
    import torch
    import torch.nn.functional as F

    n, cap = n_seen + 1, max(1024, 1 << max(0, n_seen - 1).bit_length())
    feats = torch.zeros(cap, dim)
    feats[:n_seen] = F.normalize(torch.randn(n_seen, dim, generator=generator), dim=-1)

    def lists(width: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
        sim = torch.rand(n, width, generator=generator).sort(dim=1, descending=True).values * 0.5 + 0.5
        return sim, torch.randint(0, high, (n, width), generator=generator)

    store = lists(config.k_image + 2, n)
    return {"feats": feats, "store_sim": store[0], "store_idx": store[1],
            "cur_sim": store[0][:, :config.k_image].clone(), "cur_idx": store[1][:, :config.k_image].clone(),
            **dict(zip(("text_sim", "text_idx"), lists(config.k_text, n_classes))),
            "y0_val": torch.rand(n, generator=generator) / 5,
            "y0_idx": torch.randint(0, n_classes, (n,), generator=generator)}


def ecalp_step_at(n_seen: int, *, n_classes: int = 1000, dim: int = 512, steps: int = 2) -> tuple[float, int]:
    """(CPU seconds per sample of ECALP's next `steps` samples after `n_seen`, one thread; bytes the resident set
    grew by during them, 0 when the process's peak was set earlier) on `ecalp_built_graph`."""
    import torch
    import torch.nn.functional as F

    method, g = _ecalp(n_classes, dim)
    graph = ecalp_built_graph(n_seen, n_classes, dim, method.config, g)
    method.load_state_dict({"key": "ecalp", "n_seen": n_seen, "graph": graph})
    with one_torch_thread():
        rss0, peak0 = _rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t = time.thread_time()
        for _ in range(steps):
            method.adapt(F.normalize(torch.randn(1, 1, dim, generator=g), dim=-1))
        sec = (time.thread_time() - t) / steps
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return sec, peak - rss0 if peak > peak0 else 0


def ecalp_report(console: Any, stream_points: Sequence[int], step_points: Sequence[int], *, n_classes: int = 1000,
                 dim: int = 512) -> None:
    """ECALP's growth: per-sample CPU time on a real stream and at large N on a built graph, the per-position slope
    fitted through them, and its memory at each N and at ImageNet's 50,000 samples (`ecalp_graph_bytes`)."""
    pts = [(n, s, "stream", 0) for n, s in ecalp_stream(stream_points, n_classes=n_classes, dim=dim)] if stream_points \
        else []
    for n in step_points:
        sec, grew = ecalp_step_at(n, n_classes=n_classes, dim=dim)
        pts.append((n, sec, "built graph", grew))
    if not pts:
        return
    ns, secs = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])
    slope, icpt = np.polyfit(ns, secs, 1) if len(pts) > 1 else (secs[0] / ns[0], 0.0)
    gb = 1e9
    for n, s, how, grew in pts:
        b = ecalp_graph_bytes(n + 1, n_classes, dim)
        console.print(f"ECALP K = {n_classes}, D = {dim}, at N = {n:,} samples ({how}): {1e3 * s:.1f} ms / sample; "
                      f"graph {b['state'] / gb:.3f} GB, propagation peak {b['propagation'] / gb:.3f} GB"
                      + (f" (resident set grew {grew / gb:.3f} GB)" if grew else ""))
    end = ecalp_graph_bytes(50_001, n_classes, dim)
    console.print(f"ECALP fit: {1e3 * icpt:.3f} ms + {1e6 * slope:.3f} us x N per sample (CPU, one thread); at "
                  f"N = 50,000: {slope * 5e4 + icpt:.1f} s per sample, the whole ImageNet stream "
                  f"{(slope * 5e4 * 5e4 / 2 + icpt * 5e4) / 3600:.0f} CPU-hours; graph at N = 50,000: "
                  f"{end['state']:,} bytes kept, {end['propagation']:,} bytes of propagation transients")


# ---------------------------------------------------------------------------------------------------------------
# the transductive methods' growth with the unit's size N (docs/benchmarks.md, "Transductive methods: growth with N")

def transductive_keys() -> list[str]:
    """The registered methods that consume "set_features" (their solve is what the growth lines time)."""
    from extract.methods import REGISTRY

    return [k for k, cls in REGISTRY.items() if solves_first(cls)]


@dataclass(frozen=True)
class SolveCost:
    """One solve of a transductive method over a whole unit of `n` random features (K classes, width D): CPU
    `seconds` of the solving thread (one torch thread), `wall` seconds, `grew` bytes the resident set grew by
    during it (its peak minus the resident set before it), the method's `summary`; `skipped` a failure."""

    key: str
    n: int
    seconds: float = 0.0
    wall: float = 0.0
    grew: int = 0
    summary: dict[str, Any] | None = None
    skipped: str = ""


def _solve_in_child(key: str, n: int, n_classes: int, dim: int, seed: int) -> SolveCost:
    """In a fresh process: one solve of `key` over n features clustered around K random prototypes (each sample
    its class prototype plus noise of norm ~1.5, renormalised), with one torch thread."""
    import torch
    import torch.nn.functional as F

    from extract.methods import get_method

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    text = F.normalize(torch.randn(n_classes, dim, generator=g), dim=-1)
    y = torch.randint(0, n_classes, (n,), generator=g)
    feats = F.normalize(text[y] + 1.5 * torch.randn(n, dim, generator=g) / dim ** 0.5, dim=-1)[:, None]
    cls = get_method(key)
    method = cls(cls.default_config("imagenet", "ViT-B-16"), text, 100.0, backbone="ViT-B-16", dataset="imagenet")
    method.attach_set(lambda a, b: feats[a:b], n)
    rss0 = _rss_bytes()
    t, wall = time.thread_time(), time.perf_counter()
    method.adapt(feats)  # every row of the unit: one solve
    sec, wall = time.thread_time() - t, time.perf_counter() - wall
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return SolveCost(key, n, sec, wall, max(0, peak - rss0), method.summary())


def transductive_growth(keys: Sequence[str], points: Sequence[int], *, n_classes: int = 1000, dim: int = 512,
                        log: Callable[[str], None] = lambda s: None) -> list[SolveCost]:
    """Each method of `keys` at each unit size of `points`, every solve in a fresh process (so that its peak
    resident set is its own)."""
    import concurrent.futures
    import multiprocessing

    out = []
    for key in keys:
        for n in sorted(points):
            log(f"solving {key} over N = {n:,} (K = {n_classes}, D = {dim})")
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                try:
                    out.append(pool.submit(_solve_in_child, key, n, n_classes, dim, 0).result())
                except Exception as e:  # noqa: BLE001  (reported on the method's line)
                    out.append(SolveCost(key, n, skipped=_one_line(e)))
    return out


def transductive_report(console: Any, costs: Sequence[SolveCost], *, n_classes: int = 1000, dim: int = 512) -> None:
    """One line per solve of `transductive_growth`, with each method's growth exponent from the previous size (time
    and memory ~ N^e) and the extrapolation of its largest size to ImageNet's N = 50,000 along the last exponent."""
    console.print(f"transductive solves over a whole unit of N random features, K = {n_classes}, D = {dim}: CPU "
                  "seconds of the solving thread (one torch thread) and the growth of the peak resident set, one "
                  "fresh process per solve; N^e: the growth from the previous size")
    prev: dict[str, SolveCost] = {}
    notes: dict[str, str] = {}  # per method: the extrapolation from its largest size
    for c in costs:
        if c.skipped:
            console.print(f"{c.key} N = {c.n:,}: skipped: {c.skipped}")
            continue
        p = prev.get(c.key)
        e_t = math.log(c.seconds / p.seconds) / math.log(c.n / p.n) if p and p.seconds > 0 else math.nan
        e_m = math.log(c.grew / p.grew) / math.log(c.n / p.n) if p and p.grew and c.grew else math.nan
        growth = "" if math.isnan(e_t) else f" (time ~ N^{e_t:.2f}" + (
            ")" if math.isnan(e_m) else f", memory ~ N^{e_m:.2f})")
        summary = " ".join(f"{k}={v}" for k, v in (c.summary or {}).items())
        console.print(f"{c.key} N = {c.n:,}: {c.seconds:.2f} CPU s ({c.wall:.2f} s wall), "
                      f"{1e3 * c.seconds / c.n:.2f} ms / sample, resident +{c.grew / 2**20:,.0f} MB{growth}"
                      + (f"; {summary}" if summary else ""))
        if not math.isnan(e_t):
            scale = 50_000 / c.n
            notes[c.key] = (f"{c.key} at N = 50,000 along N^{e_t:.2f} from N = {c.n:,}: "
                            f"~{c.seconds * scale ** e_t / 60:.1f} CPU-minutes"
                            + ("" if math.isnan(e_m) else f", resident +{c.grew * scale ** e_m / 2**30:.1f} GiB"))
        prev[c.key] = c
    for line in notes.values():
        console.print(line)
