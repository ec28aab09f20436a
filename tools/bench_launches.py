"""Kernel launches per sample of each registered method's adaptation, counted on the CPU at ViT-B-16's depth: the
`launches` term of the methods' work in the sweep's cost model (docs/sweep.md, "The cost model").

On a GPU every kernel launch costs the launching thread its Python and dispatch time whatever the tensor's size
(`extract.sweep.cost.LAUNCH_S`), so a method that runs many small operations per sample pays for their number, not
their arithmetic. The number depends on the operations a method runs, not on the widths of its tensors, so it is
counted here on a skeleton of the backbone: open_clip's ViT-B-16 architecture (12 image blocks at 224 px in 16 px
patches, 12 text blocks, 77 tokens) at width 64 instead of 768/512, random weights, which a CPU runs in seconds.

Each method runs through `run_extraction` as `bench-gpu`'s rates run it (`tools.bench_methods.RateRuns`): a
dtd-layout set of K classes named after ImageNet's (the text passes run one transformer call per group of prompt
lengths), feature caches filled first, the method's own input from the run (pixels, second models as the benches'
stand-ins). The second `adapt` call of a run (the first is the warm-up) is counted with torch's profiler
(`tools.bench_extract.count_launches`: the leaf aten operations, less views and allocations), in runs whose calls
hold 1 and 2 samples (2 and 4 as the batch of a method that adapts over batches of its own), and the launches are
fitted as per call + per sample x samples: what a sample pays in the runner's calls of 64 on a GPU, or in the
method's own batch. A transductive method's first call holds its solve of the whole run: counted whole. A second
model's encoding pass (COSMIC's DINOv2, DiffTPT's generation) runs before the stream and is not in it.

    python -m tools.bench_launches --methods calip,tca,dota --classes 1000
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

#: ViT-B-16's open_clip architecture at width 64 (its depth, input size, patch size and context length): the shapes
#: of the operations it runs, not their arithmetic
SKELETON_CFG = {"embed_dim": 64, "quick_gelu": False,
                "vision_cfg": {"image_size": 224, "layers": 12, "width": 64, "head_width": 32, "patch_size": 16},
                "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 12}}


@dataclass(frozen=True)
class MethodLaunches:
    """One method's count: `per_call` launches an `adapt` call pays whatever its samples, `per_sample` launches each
    of its samples adds, fitted through two counted calls (`calls`: (samples, launches)); `own_width` the samples
    of each call of a method that adapts over batches of its own (`adapt_width`); for a transductive method
    (`solve`), `per_call` is its first call, which solves the whole unit. `skipped`: why it could not be counted."""

    key: str
    per_call: float = 0.0
    per_sample: float = 0.0
    calls: tuple[tuple[int, int], ...] = ()
    own_width: int | None = None
    solve: bool = False
    skipped: str = ""

    def at(self, width: int) -> float:
        """Launches per sample in calls of `width` samples (the runner's `adapt_batch` on a GPU: 64), or of the
        method's own batch."""
        return self.per_sample + self.per_call / (self.own_width or width)


def write_skeleton(path: Path, cfg: dict[str, Any] = SKELETON_CFG) -> Path:
    """A random open_clip model of `cfg` as `local-dir:` files (`tools.bench_gpu.write_model_dir`'s layout)."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = open_clip.CLIP(**cfg)
    path.mkdir(parents=True, exist_ok=True)
    (path / "open_clip_config.json").write_text(json.dumps({"model_name": "launch-skeleton", "model_cfg": cfg}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "open_clip_model.safetensors"))
    return path


@contextlib.contextmanager
def _counter(cls: type, counted_call: int) -> Iterator[list[tuple[int, int]]]:
    """Wrap `cls.adapt`: call number `counted_call` (0-based) is counted (`count_launches`) and recorded as
    (samples, launches); the next call ends the run (`tools.bench_methods._Enough`)."""
    from tools.bench_extract import count_launches
    from tools.bench_methods import _Enough, patched_adapt

    rec: list[tuple[int, int]] = []
    calls = [0]
    original = cls.adapt

    def adapt(self: Any, view_feats: Any) -> Any:
        if rec:
            raise _Enough
        i, calls[0] = calls[0], calls[0] + 1
        if i != counted_call:
            return original(self, view_feats)
        out: list[Any] = []
        n = count_launches(lambda: out.append(original(self, view_feats)))
        rec.append((int(view_feats.shape[0]), n))
        return out[0]

    with patched_adapt(cls, adapt):
        yield rec


def _count_call(key: str, run: Any, overrides: dict[str, str], limits: dict[str, int], counted_call: int,
                pretrained: str | None) -> tuple[str, list[tuple[int, int]]]:
    from tools.bench_methods import _timed_run
    from extract.methods import get_method

    _, failed, rec = _timed_run(key, run, overrides, limits, _counter(get_method(key), counted_call), pretrained)
    return failed or ("" if rec else "no adapt call was counted: raise the positions"), rec or []


def method_launches(key: str, runs: Any, overrides: dict[str, str], limits: dict[str, int], *,
                    widths: tuple[int, int] = (1, 2), pretrained: str | None = None) -> MethodLaunches:
    """Count `key` through `runs` (a `RateRuns` on the model `pretrained`; a method that cannot run on it is
    skipped with its refusal): the second `adapt` call at each of the two `widths` (the runner's `adapt_batch`;
    twice them as the `batch_size` of a method that adapts over batches of its own), launches = per_call +
    per_sample x samples fitted through the two; a transductive method's first call (its solve of the run)."""
    from tools.bench_methods import solves_first
    from extract.methods import get_method

    cls = get_method(key)
    if solves_first(cls):
        failed, rec = _count_call(key, runs, overrides, limits, 0, pretrained)
        return MethodLaunches(key, skipped=failed) if failed else MethodLaunches(key, rec[0][1], 0.0, tuple(rec),
                                                                                  solve=True)
    own = cls.adapt_width(cls.default_config("dtd", "ViT-B-16"))  # type: ignore[attr-defined]
    calls = []
    for w in (2 * widths[0], 2 * widths[1]) if own else widths:
        runs.adapt_batch = w
        failed, rec = _count_call(key, runs, {**overrides, **({"batch_size": str(w)} if own else {})}, limits, 1,
                                  pretrained)
        if failed:
            return MethodLaunches(key, skipped=failed)
        calls += rec
    (b1, l1), (b2, l2) = calls
    slope = (l2 - l1) / (b2 - b1)
    return MethodLaunches(key, max(0.0, l1 - slope * b1), slope, tuple(calls), own)


def line(c: MethodLaunches, width: int) -> str:
    """A method's printed line."""
    if c.skipped:
        return f"{c.key:16s} skipped: {c.skipped}"
    if c.solve:
        return f"{c.key:16s} {c.per_call:10,.0f} launches a solve of the run ({c.calls[0][0]} samples in the call)"
    at = f"batches of its own {c.own_width}" if c.own_width else f"calls of {width}"
    return (f"{c.key:16s} {c.at(width):10,.1f} launches/sample in {at} ({c.per_call:,.0f} a call + "
            f"{c.per_sample:,.1f} a sample; counted (samples, launches): {list(c.calls)})")


def count_methods(keys: list[str], k: int, work: Path, *, model_dir: Path, positions: int, multi_positions: int,
                  log: Any = lambda s: None, done: Any = lambda c: None) -> list[MethodLaunches]:
    """Every method of `keys` counted on the model of `model_dir` over a K-class set (module docstring)."""
    from tools.bench_gpu import write_rate_set
    from tools.bench_methods import RateRuns, one_torch_thread, run_overrides
    from tools.second_models import StandIns
    from extract.methods import get_method
    from extract.models import load_model

    model = load_model(None, f"local-dir:{model_dir}", "cpu")
    limits = {"single": positions, "crop_flip": multi_positions, "augmix": multi_positions}
    root = write_rate_set(work / "data", k, positions, tiny=False)
    stand_ins = StandIns(work / "second-models", model)
    out = []
    with one_torch_thread():
        runs = RateRuns(model, root, work / "runs", keys, limits, adapt_batch=2, log=log)
        for key in keys:
            log(f"counting {key}")
            out.append(method_launches(key, runs, run_overrides(get_method(key), None, stand_ins), limits,
                                       pretrained=model.pretrained))
            done(out[-1])
    return out


@app.command()
def main(methods: str = typer.Option("all", help="'all' (every registered method) or comma-separated keys"),
         classes: int = typer.Option(1000, min=2, help="classes K of the synthetic set (ImageNet's names)"),
         positions: int = typer.Option(64, min=8, help="stream positions of one-view methods (a transductive "
                                                       "method solves them all)"),
         multi_positions: int = typer.Option(8, min=2, help="stream positions of 64-view methods"),
         width: int = typer.Option(64, min=1, help="samples per adapt call the printed figure is for (the "
                                                    "runner's adapt batch on a GPU)"),
         model_dir: Optional[Path] = typer.Option(None, help="count on this `local-dir:` model instead of the "
                                                             "ViT-B-16 skeleton"),
         json_out: Optional[Path] = typer.Option(None, "--json", help="write {method: launches per sample}")) \
        -> None:
    """Print each method's kernel launches per sample."""
    from extract.methods import REGISTRY
    from tools.bench_methods import parse_methods

    try:
        keys = parse_methods(methods, list(REGISTRY))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    with tempfile.TemporaryDirectory(prefix="zaec-launches-") as tmp:
        work = Path(tmp)
        mdir = model_dir or write_skeleton(work / "model")
        counts = count_methods(keys, classes, work, model_dir=mdir, positions=positions,
                               multi_positions=multi_positions, log=lambda s: typer.echo(s, err=True),
                               done=lambda c: typer.echo(line(c, width)))
    if json_out is not None:
        json_out.write_text(json.dumps({c.key: {"per_call": c.per_call, "per_sample": c.per_sample,
                                                "own_width": c.own_width, "solve": c.solve, "calls": c.calls}
                                        for c in counts if not c.skipped}, indent=1))


if __name__ == "__main__":
    app()
