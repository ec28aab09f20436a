"""`make bench-extract`: extraction-stage timings on the CPU with a small random CLIP and a synthetic image set.

Measured in one process, one run each (ratios, not absolute speeds, are the point):
    * encoding pass alone (fill an empty feature cache) vs one full zero-shot run from an empty cache;
    * TDA with an empty cache vs TDA after another method filled the cache (the cache speed-up);
    * the same for a 64-view (AugMix) method on a smaller set, where view generation dominates;
    * view generation alone: `ViewGenerator.augmented` on a 500x375 image to 63 views of 224 px, CPU time of one
      thread, the fast path against the obvious code (`views.reference_augmented`), crop+flip and AugMix;
    * the loader: views/s of `--loader-workers` processes from JPEGs against that many times one thread's rate;
    * TPT and A-TPT samples/s from cached 64-view features (the text encoder's cost per sample);
    * every registered method's adaptation cost per sample through the runner, as ratios to TDA's and TPT's, and
      ECALP's growth with the stream and its graph's bytes (`tools.bench_methods`).

    python -m tools.bench_extract [--images 256] [--multi-view-images 8] [--image-size 64] [--loader-workers 2]
                                  [--methods all|none|KEY,...] [--only-methods] [--method-classes 100]
                                  [--ecalp-stream 64,128,256] [--ecalp-n 2000,8000]
                                  [--transductive-n 1000,5000] [--only-transductive]
    * the transductive methods (StatA, TransCLIP, ZLaP): one solve over a whole unit of N random features at
      K = 1000, D = 512, CPU time and peak memory, each in a fresh process, and the growth with N
      (`make bench-extract BENCH_EXTRACT_ARGS="--only-transductive --transductive-n 1000,5000,20000"`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import typer

from tools.bench_methods import (MethodCost, costs_table, ecalp_report, method_costs, one_torch_thread,
                                   parse_methods, transductive_growth, transductive_keys, transductive_report)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _model_dir(path: Path, image_size: int) -> Path:
    import open_clip
    import torch
    from safetensors.torch import save_file

    cfg = {"embed_dim": 128, "quick_gelu": True,
           "vision_cfg": {"image_size": image_size, "layers": 4, "width": 192, "head_width": 64, "patch_size": 8},
           "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 2, "layers": 2}}
    torch.manual_seed(0)
    model = open_clip.CLIP(**cfg)
    path.mkdir(parents=True)
    (path / "open_clip_config.json").write_text(json.dumps({"model_name": "bench-vit", "model_cfg": cfg}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "open_clip_model.safetensors"))
    return path


def photo(rng: np.random.Generator, size: tuple[int, int]) -> Any:
    """A (w, h) RGB PIL image: a smooth colour field plus noise, which compresses and decodes like a photograph
    rather than like white noise."""
    from PIL import Image

    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
    px = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (size[1], size[0], 3), dtype=np.int16)
    return Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))


def write_image_set(root: Path, n: int, *, n_classes: int = 10, size: tuple[int, int] = (96, 96),
                    ext: str = "png", seed: int = 0, names: Sequence[str] | None = None) -> Path:
    """`n` images of `size` (w, h) in the dtd layout under `root` (JPEG quality 90 for ext="jpg"), class c named
    `names[c]` (default "class c"); returns root."""
    rng = np.random.default_rng(seed)
    img_dir = root / "dtd" / "images"
    test = []
    for i in range(n):
        c = i % n_classes
        rel = f"c{c}/{i}.{ext}"
        (img_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        photo(rng, size).save(img_dir / rel, quality=90)
        test.append([rel, c, f"class {c}" if names is None else names[c]])
    (root / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps({"train": [], "val": [],
                                                                                  "test": test}))
    return root


#: the view-generation measurement: a 500x375 photograph-sized image to views of 224 px (CLIP's input)
VIEW_IMAGE = (500, 375)
VIEW_SIZE = 224


def _clip_preprocess(size: int) -> Any:
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    from extract.models import Preprocess
    return Preprocess((size, size), tuple(OPENAI_DATASET_MEAN), tuple(OPENAI_DATASET_STD))


def view_rate(policy: str, *, seconds: float = 1.0, reference: bool = False, part: str = "all") -> float:
    """Views/s per core on one 500x375 image to 63 views of 224 px, over the CPU time of this one thread (so other
    load on the machine changes it little): `reference_augmented` (`reference=True`), or `ViewGenerator.augmented`
    with `part="all"` (PIL work and float work: a CPU run), `part="raw"` (`augmented_raw`, the PIL work alone: what
    a loader process does in a CPU run), or `part="gpu"`: what a loader process does in a CUDA run (`augmented_raw`
    for crop+flip; for AugMix `augmix_program`, the crops and draws, the chains then running on the GPU)."""
    import io

    from PIL import Image

    from extract.views import N_AUG_VIEWS, ViewGenerator, reference_augmented

    buf = io.BytesIO()
    photo(np.random.default_rng(0), VIEW_IMAGE).save(buf, format="JPEG", quality=90)
    img = Image.open(buf).convert("RGB")  # decoded from a JPEG, as the loader sees it
    gen = ViewGenerator(_clip_preprocess(VIEW_SIZE), policy, seed=0)  # type: ignore[arg-type]
    parts = {"all": gen.augmented, "raw": gen.augmented_raw,
             "gpu": gen.augmix_program if policy == "augmix" else gen.augmented_raw}
    if part not in parts:
        raise ValueError(f"part must be one of {', '.join(parts)}, got {part!r}")
    fn = partial(reference_augmented, gen, img) if reference else partial(parts[part], img)
    with one_torch_thread():
        fn(0)
        n, t0 = 0, time.thread_time()
        while n == 0 or time.thread_time() - t0 < seconds:
            fn(n + 1)
            n += 1
        return n * N_AUG_VIEWS / (time.thread_time() - t0)


def single_view_rate(seconds: float = 1.0) -> float:
    """Images/s per core of a single-view loader item's work: a 500x375 JPEG decoded and made view 0 at 224 px
    (`open_image` + `ViewGenerator.original_raw`), CPU time of this one thread."""
    import io

    from PIL import Image

    from extract.views import ViewGenerator

    buf = io.BytesIO()
    photo(np.random.default_rng(0), VIEW_IMAGE).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    gen = ViewGenerator(_clip_preprocess(VIEW_SIZE), "single", seed=0)

    def one() -> None:
        with Image.open(io.BytesIO(data)) as im:
            gen.original_raw(im.convert("RGB"))

    one()
    n, t0 = 0, time.thread_time()
    while n == 0 or time.thread_time() - t0 < seconds:
        one()
        n += 1
    return n / (time.thread_time() - t0)


def loader_rates(policy: str, workers: int, n_images: int, size: int = VIEW_SIZE,
                 device_chains: bool = True) -> tuple[float, float]:
    """(views/s of the runner's loader with `workers` processes (wall time, after its first item), views/s of one
    thread doing the same items (`_ViewData`: JPEG decode, view 0, views 1..63; CPU time)) on 500x375 JPEGs.
    `device_chains`: the loader of a CUDA run (AugMix's chains left to the device), else a CPU run's."""
    import torch

    from extract.datasets import load_testset
    from extract.run.encode import _ViewData
    from extract.run.stream import stream_permutation
    from extract.views import ViewGenerator

    tmp = Path(tempfile.mkdtemp(prefix="zaec-loader-"))
    try:
        ts = load_testset("dtd", write_image_set(tmp, n_images, size=VIEW_IMAGE, ext="jpg"))
        gen = ViewGenerator(_clip_preprocess(size), policy, seed=0)  # type: ignore[arg-type]
        data = _ViewData(ts, stream_permutation("dtd", 1, len(ts)), [[(i, True, True)] for i in range(len(ts))], gen,
                         device_chains=device_chains)
        views = gen.n_views
        with one_torch_thread():
            data[0]
            t0 = time.thread_time()
            for i in range(1, len(data)):
                data[i]
            one = (len(data) - 1) * views / (time.thread_time() - t0)
        loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers,
                                             prefetch_factor=4 if workers else None)
        it = iter(loader)
        next(it)
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        many = n * views / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return many, one


#: aten operations that launch no kernel on a GPU (views, allocations, metadata), left out of `count_launches`
_NO_KERNEL = frozenset(f"aten::{op}" for op in (
    "view", "reshape", "expand", "expand_as", "view_as", "slice", "select", "as_strided", "permute", "unsqueeze",
    "squeeze", "t", "transpose", "empty", "empty_strided", "empty_like", "resize_", "detach", "alias", "lift_fresh",
    "_unsafe_view", "_reshape_alias", "split", "split_with_sizes", "narrow", "unbind", "flatten", "chunk",
    "result_type", "contiguous", "to", "_to_copy", "is_nonzero"))


def count_launches(fn: Any) -> int:
    """Kernel launches of one call of `fn`, counted with torch's profiler on any device: the aten operations with no
    aten operation below them (a composite's parts count, not the composite), less those in `_NO_KERNEL`. On the
    CPU this counts what a GPU would be asked to launch, each costing the launching thread its Python and dispatch
    time whatever the tensor's size."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def launches(name: str) -> bool:
        return name.startswith("aten::") and name not in _NO_KERNEL

    return sum(1 for e in prof.events()
               if launches(e.name) and not any(launches(c.name) for c in e.cpu_children))


def augmix_launches(samples: int, size: int = VIEW_SIZE) -> tuple[float, float]:
    """(launches per sample with one AugMix sample per call, the same with `samples` samples per call, as
    `encode_pass` groups them): the device chains (`augmix_device.packed_rows` + `run_packed`) and the float work
    (`finish_views` in one step, as on a GPU) of 500x375-photo samples at `size` px."""
    import torch

    import extract.views as views
    from extract.augmix_device import pack_program, packed_rows, run_packed
    from extract.views import AUGMIX_MAX_DEPTH, ViewGenerator

    gen = ViewGenerator(_clip_preprocess(size), "augmix", seed=0)
    img = photo(np.random.default_rng(0), VIEW_IMAGE)
    progs = [pack_program(gen.augmix_program(img, sid))[:2] for sid in range(samples)]

    def group(ps: list[tuple[Any, Any]]) -> None:
        crops, packed = torch.cat([p[0] for p in ps]), torch.cat([p[1] for p in ps])
        gen.finish(*run_packed(crops, packed, *packed_rows(packed, AUGMIX_MAX_DEPTH)))

    saved = views._CPU_FINISH_IMAGES
    views._CPU_FINISH_IMAGES = 1 << 30  # one finishing step per call, as on a GPU (launch counts only)
    try:
        with one_torch_thread():
            one = count_launches(lambda: group(progs[:1]))
            many = count_launches(lambda: group(progs)) / samples
    finally:
        views._CPU_FINISH_IMAGES = saved
    return float(one), many


def loader_item_costs(policy: str, per_item: int, workers: int, n_images: int) -> tuple[float, float]:
    """(one loader thread's CPU ms per stream position, the main process's CPU ms per position received from
    `workers` loader processes) for `_ViewData` items of `per_item` positions of 500x375 JPEGs at 224 px: what a
    loader process does in a CUDA run (AugMix: crops and programs), and what receiving its items costs the process
    that feeds the GPU (all its threads; nothing is encoded)."""
    import torch

    from extract.datasets import load_testset
    from extract.run.encode import _ViewData
    from extract.views import ViewGenerator

    tmp = Path(tempfile.mkdtemp(prefix="zaec-items-"))
    try:
        ts = load_testset("dtd", write_image_set(tmp, n_images, size=VIEW_IMAGE, ext="jpg"))
        jobs = [(i, True, policy != "single") for i in range(n_images)]
        items = [jobs[i:i + per_item] for i in range(0, n_images, per_item)]
        data = _ViewData(ts, np.arange(n_images), items, ViewGenerator(_clip_preprocess(VIEW_SIZE), policy, seed=0),
                         device_chains=True)
        with one_torch_thread():
            data[0]
            t0 = time.thread_time()
            for i in range(len(data)):
                data[i]
            one = 1e3 * (time.thread_time() - t0) / n_images
        it = iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers, prefetch_factor=4))
        first = len(next(it)[0])
        t0 = time.process_time()
        for _ in it:
            pass
        main = 1e3 * (time.process_time() - t0) / (n_images - first)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return one, main


def loader_costs_table(console: Any, workers: int) -> None:
    """The loader's per-item costs (one thread, and the receiving process) with one position per item and with the
    runner's items, and the launches per AugMix sample with one sample per call and with the runner's groups."""
    from rich.table import Table

    from extract.run.encode import CHAIN_SAMPLES, SINGLE_VIEW_ITEM

    table = Table(title=f"loader items (500x375 JPEGs, {VIEW_SIZE} px; CPU ms per stream position)")
    for col in ("policy", "positions per item", "one loader thread", "positions/s", f"receiving ({workers} proc.)"):
        table.add_column(col, justify="right")
    for policy, per_item, n in (("single", 1, 64), ("single", SINGLE_VIEW_ITEM, 4 * SINGLE_VIEW_ITEM),
                                ("crop_flip", 1, 12), ("augmix", 1, 12)):
        one, main = loader_item_costs(policy, per_item, workers, n)
        table.add_row(policy, str(per_item), f"{one:.2f}", f"{1e3 / one:,.0f}", f"{main:.3f}")
    console.print(table)
    one, many = augmix_launches(CHAIN_SAMPLES)
    console.print(f"AugMix device chains + float work: {one:,.0f} kernel launches per sample with one sample per "
                  f"call, {many:,.0f} with {CHAIN_SAMPLES} per call ({one / many:.1f}x fewer; each costs the main "
                  "thread its Python and dispatch time on a GPU). Receiving: the process's CPU time (all threads) "
                  "per position, nothing encoded; a CUDA run adds the copy into pinned memory.")


def _tpt_rate(model, n_classes: int, n_samples: int, *, class_names: list[str] | None = None,
              method: str = "tpt", **overrides) -> float:
    """TPT samples/s on random 64-view features: the adaptation alone (text-encoder forward + backward and the
    prediction forward), as the runner feeds it from the feature cache, `adapt_batch` 64, on the model's device.

    `class_names` sets the prompts (their token lengths decide the text-encoder work: pass ImageNet's names for
    ImageNet-like timings); `overrides` replace config fields (e.g. `pass_memory_fraction=0.0` for the
    `pass_budget` sizing on CUDA, `text_shortcuts=False`)."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from extract.methods import get_method

    names = list(class_names) if class_names is not None else [f"class {c}" for c in range(n_classes)]
    text = model.text_prototypes([[f"a photo of a {n}."] for n in names])
    cls = get_method(method)
    cfg = dataclasses.replace(cls.default_config("dtd", model.backbone), **overrides)
    tuner = cls(cfg, text, model.logit_scale, backbone=model.backbone, dataset="dtd", text_encoder=model,
                class_names=names)
    g = torch.Generator().manual_seed(0)
    feats = F.normalize(torch.randn(n_samples, 64, text.shape[1], generator=g), dim=-1).to(text.device)

    def sync() -> None:
        if feats.device.type == "cuda":
            torch.cuda.synchronize(feats.device)

    tuner.adapt(feats[:2])  # warm-up, not timed (on CUDA it also measures the bytes per sample)
    sync()
    t = time.perf_counter()
    for i in range(0, n_samples, 64):
        tuner.adapt(feats[i:i + 64])
    sync()
    return n_samples / (time.perf_counter() - t)


def views_table(console: Any, workers: int, n_images: int) -> None:
    """View generation per core (fast path vs the obvious code) and the loader's efficiency, as a rich table."""
    from rich.table import Table

    table = Table(title=f"views of a {VIEW_IMAGE[0]}x{VIEW_IMAGE[1]} image, {VIEW_SIZE} px (one thread, CPU time)")
    for col in ("policy", "obvious code", "CPU run", "loader proc. (CPU run)", "loader proc. (GPU run)",
                f"loader, {workers} proc.", f"{workers} x one thread", "efficiency"):
        table.add_column(col, justify="right")
    for policy in ("crop_flip", "augmix"):
        ref, fast = view_rate(policy, reference=True), view_rate(policy)
        raw, gpu = view_rate(policy, part="raw"), view_rate(policy, part="gpu")
        many, one = loader_rates(policy, workers, n_images)
        table.add_row(policy, f"{ref:,.0f}", f"{fast:,.0f} ({fast / ref:.2f}x)", f"{raw:,.0f} ({raw / ref:.2f}x)",
                      f"{gpu:,.0f} ({gpu / ref:.2f}x)", f"{many:,.0f}", f"{workers * one:,.0f}",
                      f"{many / (workers * one):.2f}")
    console.print(table)
    console.print("views/s (speed-up over the obvious code). CPU run: PIL and float work in one thread. Loader "
                  "process: its share when the float work runs in the main process (CPU run), and when the model "
                  "is on a GPU, where AugMix's chains run too (`extract.augmix_device`: the loader only crops and "
                  "draws). The loader columns (a GPU run's loader) count view 0 too and include JPEG decoding; "
                  f"efficiency = loader / ({workers} x one thread): 1.0 when the processes scale perfectly (wall "
                  "time, so a loaded machine lowers it).")


@app.command()
def main(images: int = typer.Option(256, help="images in the single-view set"),
         multi_view_images: int = typer.Option(8, help="images for the 64-view measurement"),
         image_size: int = typer.Option(64, help="model input size"),
         batch_size: int = typer.Option(128, help="images per encoder call"),
         tpt_samples: int = typer.Option(64, help="samples for the TPT / A-TPT throughput line"),
         loader_workers: int = typer.Option(2, min=1, help="loader processes of the loader-efficiency line"),
         loader_images: int = typer.Option(12, help="JPEGs of the loader-efficiency line"),
         only_views: bool = typer.Option(False, "--only-views", help="only the view-generation and loader lines"),
         methods: str = typer.Option("all", help="methods whose adaptation cost per sample is timed: 'all' (every "
                                                 "registered one), 'none', or comma-separated keys (TDA and TPT, "
                                                 "the references, are always timed)"),
         only_methods: bool = typer.Option(False, "--only-methods", help="only the method and ECALP lines"),
         method_classes: int = typer.Option(100, min=2, help="classes K of the methods' synthetic set"),
         method_positions: int = typer.Option(512, help="stream positions cached for 1-view methods"),
         multi_view_positions: int = typer.Option(24, help="stream positions cached for 64-view methods"),
         method_batch: int = typer.Option(8, min=1, help="samples per adapt call in the method lines (the first "
                                                         "call of each run is the untimed warm-up)"),
         method_budget: float = typer.Option(1.0, help="CPU seconds of timed adapt calls per method"),
         ecalp_stream: str = typer.Option("64,128,256", help="stream lengths at which ECALP (K = 1000, D = 512) is "
                                                             "timed on a real stream ('' = none)"),
         ecalp_n: str = typer.Option("2000,8000", help="stream lengths at which ECALP is timed on a graph built "
                                                       "directly ('' = none)"),
         transductive_n: str = typer.Option("1000,5000", help="unit sizes N at which each transductive method "
                                                              "solves once (K = 1000, D = 512; '' = none)"),
         only_transductive: bool = typer.Option(False, "--only-transductive",
                                                help="only the transductive methods' growth lines"))\
        -> None:
    """Print timings and ratios measured in this one run."""
    import torch
    from rich.console import Console

    from extract.methods import REGISTRY

    torch.set_num_threads(max(1, torch.get_num_threads()))
    console = Console(emoji=False)
    try:
        keys = parse_methods(methods, list(REGISTRY))
        stream_ns, step_ns = _int_list(ecalp_stream, "--ecalp-stream"), _int_list(ecalp_n, "--ecalp-n")
        solve_ns = _int_list(transductive_n, "--transductive-n")
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if only_transductive:
        transductive_report(console, transductive_growth(transductive_keys(), solve_ns,
                                                         log=lambda s: console.print(s, style="dim")))
        return
    if not only_methods:
        views_table(console, loader_workers, loader_images)
        loader_costs_table(console, loader_workers)
        if only_views:
            return
        extraction_section(console, images=images, multi_view_images=multi_view_images, image_size=image_size,
                           batch_size=batch_size, tpt_samples=tpt_samples)
    methods_section(console, keys, image_size=image_size, n_classes=method_classes,
                    single_positions=method_positions, multi_positions=multi_view_positions,
                    adapt_batch=method_batch, budget_s=method_budget)
    ecalp_report(console, stream_ns, step_ns)
    if solve_ns:
        transductive_report(console, transductive_growth(transductive_keys(), solve_ns,
                                                         log=lambda s: console.print(s, style="dim")))


def extraction_section(console: Any, *, images: int, multi_view_images: int, image_size: int, batch_size: int,
                       tpt_samples: int) -> None:
    """The encoding pass vs a whole zero-shot run, TDA from an empty vs a filled cache (1 view, 64 AugMix views),
    and TPT / A-TPT samples/s at K = 10, 100 and 1000."""
    import torch
    from rich.table import Table

    from extract.cache import FeatureCache
    from extract.datasets import load_testset
    from extract.models import load_model
    from extract.run.encode import encode_pass
    from extract.run.stream import stream_permutation
    from extract.runner import run_extraction

    tmp = Path(tempfile.mkdtemp(prefix="zaec-bench-"))
    try:
        model = load_model(None, f"local-dir:{_model_dir(tmp / 'model', image_size)}", "cpu")
        model.encode_images(torch.zeros(batch_size, 3, image_size, image_size))  # warm-up, not timed
        rows = []
        for label, n, overrides in (("1", images, None),
                                    ("64 AugMix", multi_view_images, {"n_views": "64", "augmix": "true"})):
            root = tmp / f"data-{n}"
            write_image_set(root, n)
            ts = load_testset("dtd", root)
            perm = stream_permutation("dtd", 1, len(ts))
            common = dict(data_root=root, model=model, progress=False, batch_size=batch_size, overrides=overrides)

            # encoding pass alone, into an empty cache
            cache = FeatureCache(tmp / f"enc-{n}", model.fingerprint, "dtd", ts.fingerprint(), 1, len(ts),
                                 int(model.model.text_projection.shape[1]), model.cache_dtype,
                                 stream_fp=f"bench-{n}")
            policy = "single" if overrides is None else "augmix"
            t0 = time.perf_counter()
            encode_pass(model, ts, perm, cache, policy, len(ts), seed=1, batch_size=batch_size)
            t_enc = time.perf_counter() - t0

            def timed(method: str, out: str, cache_dir: str) -> float:
                t = time.perf_counter()
                run_extraction(method, "dtd", out=tmp / out, cache_dir=tmp / cache_dir, **common)
                return time.perf_counter() - t

            t_zs_cold = timed("zero-shot", f"o1-{n}", f"c1-{n}")
            t_tda_cold = timed("tda", f"o2-{n}", f"c2-{n}")
            t_tda_warm = timed("tda", f"o3-{n}", f"c1-{n}")  # cache filled by the zero-shot run
            rows.append((label, n, t_enc, t_zs_cold, t_tda_cold, t_tda_warm))

        table = Table(title="extraction on the CPU (one run each; seconds)")
        for col in ("views", "images", "encode", "zs cold", "tda cold", "tda warm", "full/enc", "speed-up"):
            table.add_column(col, justify="right")
        for label, n, t_enc, t_zs, t_cold, t_warm in rows:
            table.add_row(label, str(n), f"{t_enc:.2f}", f"{t_zs:.2f}", f"{t_cold:.2f}", f"{t_warm:.2f}",
                          f"{t_zs / t_enc:.2f}x", f"{t_cold / t_warm:.1f}x")
        console.print(table)
        console.print("encode: the encoding pass alone into an empty cache; zs cold: a whole zero-shot run from an "
                      "empty cache; full/enc = zs cold / encode (close to 1: encoding dominates); speed-up = tda cold "
                      "/ tda warm, TDA from an empty cache vs after the zero-shot run filled it.")
        # A-TPT adds its K×K angular term to TPT's step: the ratio shows what that costs
        for k in (10, 100):
            rates = {key: _tpt_rate(model, k, tpt_samples, method=key) for key in ("tpt", "atpt")}
            console.print(f"TPT samples/s (CPU, small model): {rates['tpt']:.1f}; A-TPT {rates['atpt']:.1f} "
                          f"(atpt/tpt time {rates['tpt'] / rates['atpt']:.2f}x) (K = {k} classes, 64 views, "
                          "adaptation from cached features)")
        from extract.datasets import imagenet_classnames

        rate = _tpt_rate(model, 1000, max(8, tpt_samples // 4), class_names=list(imagenet_classnames()))
        console.print(f"TPT samples/s (CPU, small model): {rate:.2f} (K = 1000 ImageNet class names, 64 views)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _int_list(raw: str, option: str) -> list[int]:
    try:
        out = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {raw!r}") from None
    if any(n < 1 for n in out):
        raise ValueError(f"{option}: stream lengths must be >= 1, got {raw!r}")
    return out


def methods_section(console: Any, keys: list[str], *, image_size: int, n_classes: int, single_positions: int,
                    multi_positions: int, adapt_batch: int, budget_s: float) -> list[MethodCost]:
    """Time `keys` (plus the references) with `method_costs` on a fresh bench model and a synthetic set of
    `max(single_positions, n_classes)` images of `n_classes` classes, print the table, return the lines."""
    from extract.models import load_model

    tmp = Path(tempfile.mkdtemp(prefix="zaec-bench-methods-"))
    try:
        model_dir = _model_dir(tmp / "model", image_size)
        model = load_model(None, f"local-dir:{model_dir}", "cpu")
        root = write_image_set(tmp / "data", max(single_positions, n_classes), n_classes=n_classes)
        costs = method_costs(model, model_dir, root, tmp, keys, single_positions=single_positions,
                             multi_positions=multi_positions, adapt_batch=adapt_batch, budget_s=budget_s,
                             log=lambda s: console.print(s, style="dim"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    costs_table(console, costs, n_classes)
    return costs


if __name__ == "__main__":
    app()
