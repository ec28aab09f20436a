"""`make bench-gpu`: how close extraction runs to the image encoder's limit, measured in one run on one device.

For each backbone (a random ViT-B-16 and RN50 written as safetensors, loaded through `local-dir:` like real
weights) on synthetic JPEGs of about 500x375 px, it measures, in this order:

    ceiling      the image encoder alone on preprocessed tensors already on the device (images/s, batch 256)
    single       one view per image from JPEG through the loader and the encoder (`encode_pass`, images/s)
    crop_flip    64 views per image (views/s), and augmix the same with AugMix views; each pass from its first
                 loader item on (what a long pass runs at), and as a whole (loader start included)
    chains       the device half of AugMix views alone (their chains and float work on the GPU, views/s, in the
                 runner's groups of samples): what they take from the encoder's time, and the main thread's CPU
                 time and kernel launches per sample to launch them
    fixed cost   wall seconds of a `zaec-extract` process that finds every feature in its cache (imports, weights,
                 text prototypes, loader start: what a process pays before its first new image), and its phases,
                 with a plain read of the weights file beside their load (first backbone only)
    tpt, tps     samples/s of the adaptation alone from cached 64-view features, at K = 47, 200 and 1000 classes;
                 TPT at K = 1000 also with larger `pass_budget`s (samples tuned per pass) and their peak memory
    per core     views/s of one thread generating views (no GPU), and the loader's efficiency: the rates over
                 `--workers` times that (1.0 = the loader processes scale perfectly)

and prints each as a ratio to the ceiling measured in the same run: images/s or views/s over the ceiling (1.0 = the
encoder's pace), the fixed cost as the images the encoder could have encoded meanwhile, a TPT sample as the
encoder's time for its 64 views over the adaptation's time (above 1: adapting is faster than encoding). `--json`
writes every figure; `zaec-sweep --dry-run --rates FILE` prices a sweep with them (docs/sweep.md).

    python -m tools.bench_gpu [--json bench-gpu.json] [--backbones ViT-B-16,RN50] [--workers 16]
    python -m tools.bench_gpu --device cpu --tiny        # a small model on the CPU: the code path in seconds

Without CUDA (and without `--device cpu`) it stops with one line and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import typer

from tools.bench_extract import single_view_rate, view_rate, write_image_set
from extract.run.options import MAX_CUDA_WORKERS

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

#: format of the `--json` file (read by `zaec-sweep --rates`)
RATES_VERSION = 1
#: the class counts of the TPT/TPS measurement: DTD, ImageNet-A/-R, ImageNet
DEFAULT_KS = (47, 200, 1000)
#: a small CLIP for `--tiny` (the CPU smoke run): 64 px input, 2 layers
TINY_CFG = {"embed_dim": 64, "quick_gelu": True,
            "vision_cfg": {"image_size": 64, "layers": 2, "width": 64, "head_width": 32, "patch_size": 16},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}}


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(2)


# ---------------------------------------------------------------------------------------------------------------
# inputs built on the spot: weights and JPEGs

def write_model_dir(path: Path, backbone: str, tiny: bool, seed: int = 0) -> Path:
    """A random open_clip model (the named architecture, or TINY_CFG) as `local-dir:` files, weights drawn from
    `seed` (another seed: another model with the same preprocessing, such as a reward model)."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    cfg = TINY_CFG if tiny else open_clip.get_model_config(backbone)
    if cfg is None:
        raise ValueError(f"unknown open_clip architecture {backbone!r}")
    torch.manual_seed(seed)
    model = open_clip.CLIP(**cfg)
    path.mkdir(parents=True, exist_ok=True)
    name = f"bench-tiny-{backbone}" if tiny else backbone
    (path / "open_clip_config.json").write_text(json.dumps({"model_name": name, "model_cfg": cfg}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "open_clip_model.safetensors"))
    return path


def write_jpeg_set(root: Path, n: int, seed: int = 0) -> Path:
    """`n` photograph-like 500x375 JPEGs of 47 classes in the dtd layout; returns the data root."""
    return write_image_set(root, n, n_classes=47, size=(500, 375), ext="jpg", seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# measurements

def _sync(device: Any) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encoder_ceiling(model: Any, batch_size: int, min_seconds: float) -> float:
    """Images/s of `model.encode_images` on a random preprocessed batch already on the device."""
    import torch

    s = model.preprocess.size
    x = torch.randn(batch_size, 3, s[0], s[1], generator=torch.Generator().manual_seed(0)).to(model.device)
    model.encode_images(x)  # warm-up (cuDNN autotuning, allocator)
    _sync(model.device)
    n, t0 = 0, time.perf_counter()
    while True:
        model.encode_images(x)
        n += batch_size
        _sync(model.device)
        if time.perf_counter() - t0 >= min_seconds and n >= 2 * batch_size:
            return n / (time.perf_counter() - t0)


class _Timeline:
    """A stand-in for the run's `Progress` that records when `encode_pass` took each loader item: (seconds since
    the pass began, positions so far) per item."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: list[tuple[float, int]] = []

    def task(self, description: str, total: int) -> "_Timeline":
        return self

    def advance(self, n: int, info: str = "") -> None:
        done = self.marks[-1][1] + n if self.marks else n
        self.marks.append((time.perf_counter() - self.t0, done))


def encode_rate(model: Any, root: Path, policy: str, n: int, cache_dir: Path, *, batch_size: int,
                workers: int) -> tuple[float, float]:
    """(views/s of the whole `encode_pass` (loader start, view generation, encoder) over the first `n` images of the
    set into an empty feature cache, views/s from its first item on): the second is the rate of a long pass,
    which a real run's thousands of images approach; the loader's start, timed apart as part of a process's fixed
    cost, and the first item's latency are left out. Each view counts; a single-view pass counts images."""
    from extract.cache import FeatureCache
    from extract.datasets import load_testset
    from extract.run.encode import encode_pass
    from extract.run.stream import stream_permutation

    ts = load_testset("dtd", root)
    perm = stream_permutation("dtd", 1, len(ts))
    dim = int(model.model.text_projection.shape[1])
    cache = FeatureCache(cache_dir, model.fingerprint, "dtd", ts.fingerprint(), 1, len(ts), dim, model.cache_dtype,
                         stream_fp=f"bench-{policy}")
    _sync(model.device)
    timeline = _Timeline()
    done = encode_pass(model, ts, perm, cache, policy, n, seed=1, batch_size=batch_size,  # type: ignore[arg-type]
                       workers=workers, progress=timeline)  # type: ignore[arg-type]
    _sync(model.device)
    end = time.perf_counter() - timeline.t0
    views = 1 if policy == "single" else 64
    whole = done * views / end
    t_first, n_first = timeline.marks[0]
    if n_first == done:  # one item: no rate after it
        return whole, whole
    return whole, (done - n_first) * views / max(end - t_first, 1e-9)


def chains_rate(model: Any, min_seconds: float, samples: int | None = None) -> tuple[float, float, float]:
    """(views/s, host ms per sample, kernel launches per sample) of the device half of AugMix views alone
    (`augmix_device.run_packed` + `finish_views`) for 64-view samples of a 500x375 photo at the model's input size,
    `samples` per call (default `encode_pass`'s `CHAIN_SAMPLES`), programs prepared beforehand and on the device:
    what AugMix views cost the GPU besides the encoder (above the ceiling, they leave it most of its time), and the
    main thread's CPU time and kernel launches to launch that work (the host's share, to set against its other
    work per sample)."""
    import numpy as np
    import torch

    from extract.augmix_device import pack_program, packed_rows, run_packed
    from extract.run.encode import CHAIN_SAMPLES
    from extract.views import AUGMIX_MAX_DEPTH, N_AUG_VIEWS, ViewGenerator
    from tools.bench_extract import VIEW_IMAGE, count_launches, photo

    gen = ViewGenerator(model.preprocess, "augmix", seed=0)
    img = photo(np.random.default_rng(0), VIEW_IMAGE)
    samples = samples or CHAIN_SAMPLES
    progs = [pack_program(gen.augmix_program(img, sid))[:2] for sid in range(samples)]
    crops = torch.cat([p[0] for p in progs]).to(model.device)  # as the runner's group buffers hold them
    host = torch.cat([p[1] for p in progs])
    packed = host.to(model.device)

    def group() -> torch.Tensor:  # what `_Batcher._run_programs` does
        rows, lengths = packed_rows(host, AUGMIX_MAX_DEPTH)
        return gen.finish(*run_packed(crops, packed, rows.to(model.device), lengths))

    group()  # warm-up
    _sync(model.device)
    n, host_s, t0 = 0, 0.0, time.perf_counter()
    while True:
        h0 = time.thread_time()
        group()
        host_s += time.thread_time() - h0  # launching (on a GPU the work itself runs on)
        n += samples
        _sync(model.device)
        if time.perf_counter() - t0 >= min_seconds and n >= 2 * samples:
            rate = n * N_AUG_VIEWS / (time.perf_counter() - t0)
            break
    return rate, 1e3 * host_s / n, count_launches(group) / samples


def _cpu_one_thread(model: Any) -> Any:
    """One torch thread on the CPU (the rates' clock there is the process's CPU time: `bench_methods.bench_clock`),
    nothing on CUDA (a GPU run's main thread uses what torch gives it)."""
    import contextlib

    from tools.bench_methods import one_torch_thread

    return one_torch_thread() if model.device.type != "cuda" else contextlib.nullcontext()


def write_rate_set(root: Path, k: int, n: int, tiny: bool) -> Path:
    """A dtd-layout set of K classes and max(n, K) JPEGs (500x375, tiny 80x60: TTL reads the pixels of its views
    and pays for the image size); returns the data root. The classes are named after ImageNet's (cycled past 1000):
    the prompt tuners' text passes run one transformer call per group of prompt lengths (`text_encoder.py`), so
    real names price them as real runs, where "class c" would make one group."""
    from extract.datasets import imagenet_classnames

    inet = imagenet_classnames()
    names = [inet[c % len(inet)] + ("" if c < len(inet) else f" {c // len(inet)}") for c in range(k)]
    return write_image_set(root, max(n, k), n_classes=k, size=(80, 60) if tiny else (500, 375), ext="jpg", seed=k,
                           names=names)


def method_rates(model: Any, work: Path, rates: "RateSettings", *, tiny: bool, say: Any) -> dict[str, Any]:
    """Samples/s of each method at each K as a run adapts (`bench_methods.run_rate`: `run_extraction` on a
    K-class set, features cached first, the runner's `adapt_batch`, its pass sizing, RLCF's reward model encoding
    its views in the run, TTL reading its view pixels, warm-up call excluded); at the largest K also TPT with each
    of `rates.pass_budgets` alone sizing its passes (`pass_memory_fraction=0`), with its peak device memory.

    Returns:
        {"by_method": {method: {str(K): RunRate}}, "by_budget": {str(budget): {...}}}.
    """
    from tools.bench_methods import RateRuns, run_overrides, run_rate
    from tools.second_models import StandIns
    from extract.methods import get_method
    from extract.run.options import DEFAULT_ADAPT_BATCH

    out: dict[str, Any] = {"by_method": {}, "by_budget": {}}
    # DiffTPT's tiny pipeline: priced apart (cost.FIXED_PRICE); COSMIC's DINOv2: ViT-L/14 unless the bench is tiny
    stand_ins = StandIns(work / "second-models", model, dino="tiny" if tiny else "official")
    keys = list(rates.methods) + (["tpt"] if rates.pass_budgets else [])
    for k in rates.ks:
        root = write_rate_set(work / f"data-k{k}", k, rates.limits["single"], tiny)
        with _cpu_one_thread(model):
            runs = RateRuns(model, root, work / f"rates-k{k}", keys, rates.limits, adapt_batch=DEFAULT_ADAPT_BATCH)
            for key in rates.methods:
                r = run_rate(key, k, runs, run_overrides(get_method(key), rates.reward_dir, stand_ins),
                             rates.limits, budget_s=rates.budget_s, pretrained=model.pretrained)
                out["by_method"].setdefault(key, {})[str(k)] = r
                say(f"  {key} K = {k}: " + (f"skipped: {r.skipped}" if r.skipped
                                            else f"{r.samples_per_s:,.2f} samples/s over {r.samples} samples"))
            if k == max(rates.ks):
                for b in rates.pass_budgets:
                    out["by_budget"][str(b)] = _budget_rate(model, runs, k, b, rates)
        shutil.rmtree(work / f"data-k{k}", ignore_errors=True)
        shutil.rmtree(work / f"rates-k{k}", ignore_errors=True)
    return out


def _budget_rate(model: Any, runs: Any, k: int, pass_budget: int, rates: "RateSettings") -> dict[str, Any]:
    """TPT samples/s at K classes with `pass_budget` (sample x class rows per tuning pass) alone sizing its passes
    (`pass_memory_fraction=0`), and the peak device memory of the run."""
    import torch

    from tools.bench_methods import run_rate

    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(model.device)
    r = run_rate("tpt", k, runs, {"pass_budget": str(pass_budget), "pass_memory_fraction": "0"}, rates.limits,
                 budget_s=rates.budget_s)
    if r.skipped:
        return {"samples_per_s": None, "error": r.skipped}
    peak = torch.cuda.max_memory_allocated(model.device) / 2**30 if cuda else None
    return {"samples_per_s": r.samples_per_s, "samples_per_pass": max(1, pass_budget // k), "peak_gib": peak}


def fixed_cost(model_dir: Path, root: Path, work: Path, device: str, workers: int) -> dict[str, float]:
    """Wall seconds of a `zaec-extract` process (zero-shot) whose features are all cached: started, timed from
    outside, after a first process filled the cache; plus the phases of a probe process (`_probe`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "extract.cli", "--method", "zero-shot", "--dataset", "dtd",
           "--pretrained", f"local-dir:{model_dir}", "--data-root", str(root), "--cache-dir", str(work / "cache"),
           "--device", device, "--workers", str(workers), "--quiet"]
    for i in range(2):
        t0 = time.perf_counter()
        subprocess.run(cmd + ["--out", str(work / f"out{i}")], check=True, env=env, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
    probe = subprocess.run([sys.executable, "-m", "tools.bench_gpu", "probe", str(model_dir), str(root),
                            "--device", device, "--workers", str(workers)],
                           check=True, env=env, capture_output=True, text=True)
    return {"process_s": wall, **json.loads(probe.stdout.strip().splitlines()[-1])}


@app.command("probe", hidden=True)
def probe(model_dir: Path, root: Path, device: str = typer.Option("cuda"), workers: int = typer.Option(0)) -> None:
    """Phases of a process's fixed cost, each timed in this fresh process; prints one JSON line."""
    t0 = time.perf_counter()
    import torch  # noqa: F401

    import extract.runner  # noqa: F401  (timed: the modules a run imports, the whole run stack)
    from extract.datasets import load_testset
    from extract.models import load_model
    from extract.prompts import build_prompt_set
    from extract.run.encode import _ViewData
    from extract.run.stream import stream_permutation
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    dev = torch.device(device)
    torch.zeros(1, device=dev)  # the device's context (CUDA: driver and context start), apart from the weights
    _sync(dev)
    t_device = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = load_model(None, f"local-dir:{model_dir}", device)
    _sync(model.device)
    t_weights = time.perf_counter() - t0
    # the weights file read once, plainly (its pages are where the load left them): the disk's pace to compare with
    t0 = time.perf_counter()
    weights_bytes = 0
    with open(model.weights_file, "rb") as fh:
        while block := fh.read(1 << 24):
            weights_bytes += len(block)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    ts = load_testset("dtd", root)
    prompts = build_prompt_set("dtd", ts.class_names, policy="single")
    model.text_prototypes(prompts.per_class)
    _sync(model.device)
    t_protos = time.perf_counter() - t0
    from extract.views import ViewGenerator
    t0 = time.perf_counter()
    gen = ViewGenerator(model.preprocess, "single", seed=1)
    data = _ViewData(ts, stream_permutation("dtd", 1, len(ts)), [[(0, True, False)]], gen)
    next(iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers)))
    t_loader = time.perf_counter() - t0
    print(json.dumps({"import_s": t_import, "device_init_s": t_device, "weights_s": t_weights,
                      "weights_file_read_s": t_read, "weights_mb": weights_bytes / 1e6, "prototypes_s": t_protos,
                      "loader_start_s": t_loader}))


@dataclass(frozen=True)
class RateSettings:
    """What the adaptation lines time: `methods` at each K of `ks`, runs of up to `limits[policy]` stream positions
    (a method stops after `budget_s` wall seconds past its warm-up call; None: all positions), RLCF's reward model
    (`reward_dir`, None: the policy as its own), and TPT at the largest K with each of `pass_budgets`."""

    ks: tuple[int, ...]
    methods: tuple[str, ...]
    limits: dict[str, int]
    budget_s: float | None
    reward_dir: Path | None = None
    pass_budgets: tuple[int, ...] = ()


def adapt_section(model: Any, work: Path, rates: RateSettings, *, tiny: bool, say: Any) -> dict[str, Any]:
    """The adaptation lines of one backbone: `adapt_samples_per_s` {method: {K: samples/s}} (the rates
    `zaec-sweep --rates` prices with), `adapt_detail` (samples timed, seconds, reward encoding per sample, mean
    stream position, or why a method was skipped), and `tpt_by_pass_budget`."""
    r: dict[str, Any] = {"adapt_samples_per_s": {}, "adapt_detail": {}}
    if not rates.ks or not (rates.methods or rates.pass_budgets):  # `--methods none`: no K-class set to write
        return r
    measured = method_rates(model, work, rates, tiny=tiny, say=say)
    for m, per_k in measured["by_method"].items():
        r["adapt_detail"][m] = {k: dataclasses.asdict(v) for k, v in per_k.items()}
        timed = {k: v.samples_per_s for k, v in per_k.items() if not v.skipped}
        if timed:
            r["adapt_samples_per_s"][m] = timed
    if measured["by_budget"]:
        r["tpt_by_pass_budget"] = {"k": max(rates.ks), **measured["by_budget"]}
        say(f"TPT at K = {max(rates.ks)} by pass_budget {r['tpt_by_pass_budget']}")
    return r


def bench_backbone(backbone: str, *, tiny: bool, device: str, work: Path, root_single: Path, root_multi: Path,
                   n_single: int, n_multi: int, batch_size: int, workers: int, rates: "RateSettings",
                   min_seconds: float, with_fixed_cost: bool, say: Any) -> dict[str, Any]:
    from extract.models import load_model

    model_dir = write_model_dir(work / f"model-{backbone}", backbone, tiny)
    model = load_model(None, f"local-dir:{model_dir}", device)
    r: dict[str, Any] = {"image_size": int(model.preprocess.size[0])}
    r["encoder_images_per_s"] = encoder_ceiling(model, batch_size, min_seconds)
    say(f"{backbone}: encoder ceiling {r['encoder_images_per_s']:,.0f} images/s")
    for policy, n, root in (("single", n_single, root_single), ("crop_flip", n_multi, root_multi),
                            ("augmix", n_multi, root_multi)):
        key = "single_view_images_per_s" if policy == "single" else f"{policy}_views_per_s"
        r[key.replace("_per_s", "_per_s_whole_pass")], r[key] = encode_rate(
            model, root, policy, n, work / f"c-{backbone}-{policy}", batch_size=batch_size, workers=workers)
    (r["augmix_chains_views_per_s"], r["augmix_chains_host_ms_per_sample"],
     r["augmix_chains_launches_per_sample"]) = chains_rate(model, min_seconds, 2 if tiny else None)
    say(f"{backbone}: single {r['single_view_images_per_s']:,.0f} images/s, crop+flip "
        f"{r['crop_flip_views_per_s']:,.0f} views/s, AugMix {r['augmix_views_per_s']:,.0f} views/s")
    r.update(adapt_section(model, work / f"adapt-{backbone}", rates, tiny=tiny, say=say))
    del model
    if with_fixed_cost:
        r["fixed_cost"] = fixed_cost(model_dir, root_single, work / f"fc-{backbone}", device, workers)
        say(f"{backbone}: fixed cost {r['fixed_cost']['process_s']:.1f} s")
    return r


def ratios(r: dict[str, Any]) -> dict[str, Any]:
    """Every figure of one backbone relative to its encoder ceiling (see the module docstring)."""
    c = r["encoder_images_per_s"]
    out: dict[str, Any] = {"single_view": r["single_view_images_per_s"] / c,
                           "crop_flip": r["crop_flip_views_per_s"] / c, "augmix": r["augmix_views_per_s"] / c,
                           "augmix_chains": r["augmix_chains_views_per_s"] / c}
    if "fixed_cost" in r:
        out["fixed_cost_images"] = r["fixed_cost"]["process_s"] * c
    out["adapt"] = {m: {k: v / (c / 64) for k, v in per_k.items()} for m, per_k in r["adapt_samples_per_s"].items()}
    return out


def _table(results: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"extraction vs the image encoder's ceiling ({results['device']}; one run)")
    for col in ("backbone", "measurement", "rate", "ratio to ceiling"):
        t.add_column(col, justify="right" if col != "measurement" else "left")
    for bb, r in results["backbones"].items():
        q = r["ratios"]
        t.add_row(bb, "encoder alone (ceiling)", f"{r['encoder_images_per_s']:,.0f} img/s", "1.00")
        for label, key, unit, ratio in (("single view from JPEG", "single_view_images_per_s", "img/s", "single_view"),
                                        ("64 views crop+flip", "crop_flip_views_per_s", "views/s", "crop_flip"),
                                        ("64 views AugMix", "augmix_views_per_s", "views/s", "augmix")):
            whole = r.get(key.replace("_per_s", "_per_s_whole_pass"))
            t.add_row("", label + ("" if whole is None else f" (whole pass: {whole:,.0f})"),
                      f"{r[key]:,.0f} {unit}", f"{q[ratio]:.2f}")
        t.add_row("", f"  AugMix chains + float work on the device alone", f"{r['augmix_chains_views_per_s']:,.0f} "
                  "views/s", f"{q['augmix_chains']:.2f}")
        t.add_row("", "  their launch: main thread's CPU time, kernel launches",
                  f"{r['augmix_chains_host_ms_per_sample']:.2f} ms/sample",
                  f"{r.get('augmix_chains_launches_per_sample', 0):,.0f} / sample")
        if "fixed_cost" in r:
            fc = r["fixed_cost"]
            t.add_row("", "fixed cost of a process", f"{fc['process_s']:.1f} s",
                      f"{q['fixed_cost_images']:,.0f} images")
            t.add_row("", "  import / device start / weights / prototypes / loader",
                      f"{fc['import_s']:.1f} / {fc.get('device_init_s', 0):.1f} / {fc['weights_s']:.1f} / "
                      f"{fc['prototypes_s']:.1f} / {fc['loader_start_s']:.1f} s", "")
            if "weights_file_read_s" in fc:
                t.add_row("", f"  weights: load / plain read of the file ({fc['weights_mb']:,.0f} MB)",
                          f"{fc['weights_s']:.2f} / {fc['weights_file_read_s']:.2f} s",
                          f"{fc['weights_s'] / max(fc['weights_file_read_s'], 1e-9):.1f}x the read")
        for m, per_k in r["adapt_samples_per_s"].items():
            for k, v in per_k.items():
                t.add_row("", f"{m.upper()} K = {k}", f"{v:,.2f} samples/s", f"{q['adapt'][m][k]:.3f}")
        for b, v in r.get("tpt_by_pass_budget", {}).items():
            if b != "k":
                rate = "out of memory" if v["samples_per_s"] is None else f"{v['samples_per_s']:,.2f} samples/s"
                mem = "" if v.get("peak_gib") is None else f"peak {v['peak_gib']:.1f} GiB"
                t.add_row("", f"  TPT K = {r['tpt_by_pass_budget']['k']}, pass_budget {b}", rate, mem)
    console.print(t)
    console.print("ratio: rate / ceiling; fixed cost: images the encoder encodes in that time; TPT/TPS: the "
                  "encoder's time for a sample's 64 views / the adaptation's time per sample.")


def _check_options(device: str, tiny: bool, ks: str, pass_budgets: str) -> tuple[list[int], list[int]]:
    """Refuse a device this run cannot use; parse `--ks` and `--pass-budgets` (a user error exits with one line)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise _fail("bench-gpu needs a CUDA device and torch.cuda.is_available() is False here; "
                    "for a smoke run on the CPU use --device cpu --tiny")
    if not device.startswith("cuda") and not tiny:
        raise _fail(f"--device {device} runs the full-size models on the CPU for hours; add --tiny for a smoke run")
    try:
        k_list = [int(k) for k in ks.split(",") if k.strip()]
        budgets = [int(b) for b in pass_budgets.split(",") if b.strip()]
    except ValueError:
        raise _fail(f"--ks and --pass-budgets expect comma-separated integers, got {ks!r} and {pass_budgets!r}") \
            from None
    return k_list, budgets


def _check_method_options(methods: str, positions: Optional[str], tiny: bool) -> tuple[list[str], dict[str, int]]:
    """`--methods` (registry keys, 'all' or 'none') and `--method-positions` (one-view,64-view positions; more than
    the runner's adapt batch, so that a call follows the warm-up call); a user error exits with one line."""
    from tools.bench_methods import parse_methods
    from extract.methods import REGISTRY
    from extract.run.options import DEFAULT_ADAPT_BATCH

    try:
        keys = parse_methods(methods, list(REGISTRY))
    except ValueError as e:
        raise _fail(str(e)) from None
    raw = positions if positions is not None else ("256,192" if tiny else "512,192")
    try:
        single, multi = (int(p) for p in raw.split(","))
    except ValueError:
        raise _fail(f"--method-positions expects two integers 'one-view,64-view', got {raw!r}") from None
    if min(single, multi) <= DEFAULT_ADAPT_BATCH:
        raise _fail(f"--method-positions must exceed the runner's adapt batch ({DEFAULT_ADAPT_BATCH}): the first "
                    f"call is the untimed warm-up; got {raw!r}")
    return keys, {"single": single, "crop_flip": multi, "augmix": multi}


def _rate_settings(work: Path, tiny: bool, ks: Sequence[int], methods: Sequence[str], limits: dict[str, int],
                   seconds: Optional[float], pass_budgets: Sequence[int]) -> RateSettings:
    """The adaptation lines' settings; writes RLCF's reward model when it is timed (tiny: another seed of the tiny
    model; else a random ViT-L-14, the official reward model's architecture, with the policy's preprocessing)."""
    reward_dir = None
    if "rlcf" in methods:
        reward_dir = write_model_dir(work / "model-reward", "ViT-L-14", tiny, seed=1)
    budget = seconds if seconds is not None else (None if tiny else 10.0)
    return RateSettings(tuple(ks), tuple(methods), limits, budget, reward_dir, tuple(pass_budgets))


def _print_loader(results: dict[str, Any], nw: int, console: Any) -> None:
    """One loader thread's view rates, and how well `nw` loader processes scaled against them."""
    per_core = results["views_per_core"]
    console.print(f"one loader thread (its share of the views): {per_core['single']:,.0f} single views/s (JPEG "
                  f"decode included), {per_core['crop_flip']:,.0f} crop+flip views/s, {per_core['augmix']:,.0f} "
                  f"AugMix views/s; {nw} loader processes; whole run {results['seconds']:.0f} s")
    for bb, r in results["backbones"].items():
        if "loader_efficiency" in r["ratios"]:
            eff = r["ratios"]["loader_efficiency"]
            console.print(f"{bb}: rate / ({nw} x one thread): single {eff['single']:.2f}, crop+flip "
                          f"{eff['crop_flip']:.2f}, AugMix {eff['augmix']:.2f} (1.0 = the processes scale perfectly; "
                          "below it, the GPU, the main process or the transfer sets the pace)")


@app.command("run")
def run(
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write every figure to this JSON file"),
    backbones: str = typer.Option("ViT-B-16,RN50", help="comma-separated open_clip architectures (random weights)"),
    device: str = typer.Option("cuda", help="torch device; cpu only for a smoke run (with --tiny)"),
    tiny: bool = typer.Option(False, "--tiny", help="a small model and few images instead (a smoke run)"),
    images: Optional[int] = typer.Option(None, help="JPEGs of the single-view pass (default 4096; tiny 8)"),
    multi_view_images: Optional[int] = typer.Option(None, help="JPEGs of each 64-view pass (default 160; tiny 2)"),
    batch_size: Optional[int] = typer.Option(None, help="images per encoder call (default 256; tiny 64)"),
    workers: Optional[int] = typer.Option(None, help=f"loader processes (default up to {MAX_CUDA_WORKERS}; tiny 0)"),
    ks: str = typer.Option(",".join(map(str, DEFAULT_KS)), help="class counts of the TPT/TPS measurement"),
    methods: str = typer.Option("all", help="adaptation methods to time at each K: 'all', 'none' or keys"),
    method_positions: Optional[str] = typer.Option(
        None, help="stream positions run per method, one-view,64-view (default 512,192; tiny 256,192)"),
    method_seconds: Optional[float] = typer.Option(
        None, help="wall seconds per method after its warm-up call (default 10; tiny: all positions)"),
    seconds: Optional[float] = typer.Option(None, help="least seconds per timed rate (default 3; tiny 0.2)"),
    fixed_cost_: bool = typer.Option(True, "--fixed-cost/--no-fixed-cost",
                                     help="time a fresh process (with the first backbone)"),
    pass_budgets: str = typer.Option("2048,8192", help="TPT pass_budget values timed at the largest K (empty: none)"),
) -> None:
    """Measure and print the rates and their ratios to the encoder ceiling."""
    import torch
    from rich.console import Console

    k_list, budgets = _check_options(device, tiny, ks, pass_budgets)
    method_keys, positions = _check_method_options(methods, method_positions, tiny)
    bbs = [b.strip() for b in backbones.split(",") if b.strip()]
    n_single = images if images is not None else (8 if tiny else 4096)
    n_multi = multi_view_images if multi_view_images is not None else (2 if tiny else 160)
    bs = batch_size if batch_size is not None else (64 if tiny else 256)
    nw = workers if workers is not None else (0 if tiny else min(MAX_CUDA_WORKERS, os.cpu_count() or 1))
    secs = seconds if seconds is not None else (0.2 if tiny else 3.0)
    console = Console(emoji=False)
    say = (lambda msg: console.print(msg, highlight=False))
    t_all = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="zaec-bench-gpu-"))
    try:
        root_single = write_jpeg_set(work / "data-single", max(n_single, 2))  # two classes at least: one is refused
        root_multi = write_jpeg_set(work / "data-multi", max(n_multi, 2), seed=1)  # (a pass encodes the first n)
        rate_settings = _rate_settings(work, tiny, k_list, method_keys, positions, method_seconds, budgets)
        dev = torch.device(device)
        results: dict[str, Any] = {
            "version": RATES_VERSION, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "tiny": tiny, "workers": nw, "cpus": os.cpu_count(), "batch_size": bs, "backbones": {}}
        for i, bb in enumerate(bbs):  # a process's fixed cost once: the first backbone's
            r = bench_backbone(bb, tiny=tiny, device=device, work=work, root_single=root_single,
                               root_multi=root_multi, n_single=n_single, n_multi=n_multi, batch_size=bs, workers=nw,
                               rates=rate_settings, min_seconds=secs, with_fixed_cost=fixed_cost_ and i == 0,
                               say=say)
            r["ratios"] = ratios(r)
            results["backbones"][bb] = r
        # the CPU side alone: views/s of one thread, to read the loader's efficiency against
        per_core = {p: view_rate(p, seconds=min(secs, 1.0), part="gpu" if device != "cpu" else "raw")
                    for p in ("crop_flip", "augmix")}
        per_core["single"] = single_view_rate(seconds=min(secs, 1.0))
        results["views_per_core"] = per_core
        if nw:  # how much of `workers` times one thread's rate the pass delivered (1.0: perfect scaling)
            for r in results["backbones"].values():
                r["ratios"]["loader_efficiency"] = {
                    p: r["single_view_images_per_s" if p == "single" else f"{p}_views_per_s"] / (nw * per_core[p])
                    for p in per_core}
        results["seconds"] = time.perf_counter() - t_all
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _table(results, console)
    _print_loader(results, nw, console)
    if json_out is not None:
        from schemas.atomic import atomic_path
        with atomic_path(json_out) as tmp:
            Path(tmp).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {json_out}")


@app.command("agree")
def agree(
    device: str = typer.Option("cpu", help="torch device (the CPU runs the tiny model)"),
    backbone: str = typer.Option("ViT-B-16", help="open_clip architecture (random weights; tiny on the CPU)"),
    methods: str = typer.Option("all", help="methods to check: 'all' or comma-separated keys"),
    ks: str = typer.Option("47", help="class counts"),
    method_positions: Optional[str] = typer.Option(None, help="positions run, one-view,64-view (default 256,192)"),
    tolerance: float = typer.Option(0.2, help="largest accepted |bench / run - 1|"),
    repeat: int = typer.Option(1, help="measurements of each rate and run, interleaved; the fastest is kept"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="also write the rows to this JSON file"),
) -> None:
    """Check the adaptation rates against timed runs: per method and K, the bench's rate and the marginal rate of
    two timed `run_extraction` calls of the same method (B and N positions, B the adapt batch), and their ratio.
    Exits 1 when a ratio is off by more than `--tolerance` (on a loaded machine, read the ratios, not the exit)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from tools.bench_methods import agreement
    from extract.models import load_model
    from extract.run.options import DEFAULT_ADAPT_BATCH

    tiny = not device.startswith("cuda")
    k_list, _ = _check_options(device, tiny, ks, "")
    keys, limits = _check_method_options(methods, method_positions, tiny)
    console = Console(emoji=False)
    work = Path(tempfile.mkdtemp(prefix="zaec-bench-agree-"))
    rows = []
    try:
        model = load_model(None, f"local-dir:{write_model_dir(work / 'model', backbone, tiny)}", device)
        settings = _rate_settings(work, tiny, k_list, keys, limits, None, ())
        for k in k_list:
            root = write_rate_set(work / f"data-k{k}", k, limits["single"], tiny)
            with _cpu_one_thread(model):
                rows += agreement(model, root, work / f"runs-k{k}", keys, k, limits=limits,
                                  adapt_batch=DEFAULT_ADAPT_BATCH, reward_dir=settings.reward_dir, repeat=repeat,
                                  log=lambda line: console.print(line, highlight=False))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t = Table(title=f"bench rate vs timed runs ({torch.cuda.get_device_name() if not tiny else 'cpu, tiny model'})")
    for col in ("method", "K", "views", "bench samples/s", "run samples/s", "bench / run", "whole run samples/s"):
        t.add_column(col, justify="right")
    for a in rows:
        if a.skipped:
            t.add_row(a.key, str(a.k), a.policy, f"skipped: {a.skipped}", "", "", "")
        else:
            t.add_row(a.key, str(a.k), a.policy, f"{a.bench:,.2f}", f"{a.run:,.2f}", f"{a.ratio:.3f}",
                      f"{a.whole:,.2f}")
    console.print(t)
    if json_out is not None:
        from schemas.atomic import atomic_path
        with atomic_path(json_out) as tmp:
            Path(tmp).write_text(json.dumps([dataclasses.asdict(a) for a in rows], indent=1) + "\n")
    off = [a for a in rows if not a.skipped and not abs(a.ratio - 1) <= tolerance]
    if off:
        console.print(f"{len(off)} method(s) off by more than {tolerance:.0%}: "
                      + ", ".join(f"{a.key} K = {a.k} ({a.ratio:.2f})" for a in off))
        raise typer.Exit(1)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("run", "probe", "agree", "--help"):
        args = ["run"] + args  # `python -m tools.bench_gpu [options]` runs the benchmark
    app(args=args, prog_name="python -m tools.bench_gpu")


if __name__ == "__main__":
    main()
