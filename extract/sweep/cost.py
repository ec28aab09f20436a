"""The cost model of `zaec-sweep --dry-run`: images and views per group, GPU-seconds per view and per sample.

An estimate, documented as such: fixed guesses per backbone family and method below, replaced by the rates measured
on one device (`python -m tools.bench_gpu --json FILE`, passed as `--rates FILE`) where that file covers them. The
plan table (`extract.sweep.grid.plan_frame`), the SLURM time limit and the local executor's packing all price groups
with it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from extract.sweep.errors import SweepError

if TYPE_CHECKING:
    from extract.sweep.runspec import RunSpec

#: Test-set sizes (images) of the paper's 15 datasets: ImageNet val, the released ImageNet-A/-V2 (matched
#: frequency)/-R/-Sketch, and the CoOp `split_zhou_*` test splits (FGVC-Aircraft: `images_variant_test.txt`).
TEST_SIZES: dict[str, int] = {
    "imagenet": 50000, "imagenet_a": 7500, "imagenet_v2": 10000, "imagenet_r": 30000, "imagenet_sketch": 50889,
    "caltech101": 2465, "dtd": 1692, "eurosat": 8100, "fgvc_aircraft": 3333, "food101": 30300,
    "flowers102": 2463, "oxford_pets": 3669, "stanford_cars": 8041, "sun397": 19850, "ucf101": 3783,
}
#: Fashion-MNIST's test set, used by every demo set (`fmnist`, `fmnist_noise`, ...).
DEMO_TEST_SIZE = 10000

#: Encoder GPU-seconds per encoded view, by backbone family. An estimate for one A100/H100-class GPU with autocast
#: fp16 and about 8 image-loading workers: the network alone runs several thousand views/s, so JPEG decoding and AugMix
#: on the CPU set the pace; ~1000 views/s (ViT-B-16) and ~1500 views/s (RN50, smaller input pipeline cost per
#: forward) are the planning figures. Multi-view policies encode 64 views per image.
ENCODE_S_PER_VIEW: dict[str, float] = {"vit": 1 / 1000, "rn": 1 / 1500}
@dataclass(frozen=True)
class AdaptCost:
    """The fixed guess of one method's adaptation cost, GPU-seconds, over a stream of N samples with K classes:

        N * (per_sample + per_class * K) + (per_position + per_position_class * K) * N * (N + 1) / 2

    with `multi_view` in place of `per_sample` when the run encodes 64 views. The second term prices a method whose
    work per sample grows with the samples seen so far (the n-th sample costs n times the per-position figures).

    Attributes:
        per_sample: seconds per sample (one view, or any view count when `multi_view` is None).
        per_class: seconds per sample and class (the methods that run the text encoder per sample).
        multi_view: seconds per sample when the run encodes 64 views, where that differs.
        per_position, per_position_class: seconds per sample and stream position (and class).
        provisional: a placeholder for a method still being written, applied once its key is registered.
    """

    per_sample: float
    per_class: float = 0.0
    multi_view: float | None = None
    per_position: float = 0.0
    per_position_class: float = 0.0
    provisional: bool = False

    def seconds(self, n: int, k: int, views: int) -> float:
        """Estimated adaptation seconds of a run over the first `n` stream positions, `k` classes, `views` views."""
        base = self.multi_view if views > 1 and self.multi_view is not None else self.per_sample
        growth = (self.per_position + self.per_position_class * k) * n * (n + 1) / 2
        return n * (base + self.per_class * k) + growth


#: TDA's adapt step measured on a CPU (1 thread, K = 1000, D = 512): the reference the figures below scale from
TDA_S, TDA_S_64_VIEWS = 0.0039, 0.0063
#: TPT's per-sample text-encoder pass: one forward + backward and one forward of the text transformer over the K
#: prompts per sample (about 25 GFLOP per prompt at ~100 TFLOP/s effective fp16): ImageNet's 1000 classes ~0.25 s
TPT = {"per_sample": 0.005, "per_class": 2.5e-4}
#: ECALP's seconds per stream position at K = 1000, D = 512: 44.5 ms a sample measured over the first 256 samples,
#: whose mean position is 128.5; its work per sample is O(n D + E K) with E ~ 22 n edges, split in that ratio
ECALP_S_PER_POSITION = 0.0445 / 128.5
#: The encoder passes per sample of the methods that adapt the image encoder over batches, in views' worth of the
#: planning rate (`ENCODE_S_PER_VIEW`): the batch's images read again (1), and the encoder's forward, backward
#: (about 2 forwards) and the prediction's forward on them, each a fraction of a view's loader-bound time
BATCH_ENCODER_COSTS: dict[str, AdaptCost] = {
    # Tent: 1 read + forward, backward, forward (~4 encoder forwards, ~1/3 of a loader-bound view each)
    "tent": AdaptCost(ENCODE_S_PER_VIEW["vit"] * (1 + 4 / 3)),
}
#: Adaptation cost by method. The figures of zero-shot, DPE, DLAE, TPS and the TPT family are guesses for one GPU
#: (zero-shot is one matmul; DPE and DLAE one AdamW step on the prototype residuals per sample, DLAE adds its
#: reflection step; TPS one AdamW step on a (K, D) shift for a batch of samples at once). TDA, ZERO, MTA, OnZeta,
#: ECALP, DMN and BoostAdapter use the adapt steps measured on a CPU (1 thread, K = 1000, D = 512): their work per
#: sample is small tensor operations, which a GPU does not make much faster. docs/sweep.md, "The cost model".
ADAPT_COSTS: dict[str, AdaptCost] = {
    "zero-shot": AdaptCost(0.0001),
    "tda": AdaptCost(TDA_S, multi_view=TDA_S_64_VIEWS),
    "dpe": AdaptCost(0.025),
    "dlae": AdaptCost(0.03),
    "tps": AdaptCost(0.005),
    **{m: AdaptCost(**TPT) for m in ("tpt", "ctpt", "otpt", "atpt")},
    "zero": AdaptCost(0.0036),  # 64 crop+flip views, encoded as TPT's; the adapt step votes over them
    "mta": AdaptCost(0.0034),  # 64 crop+flip views; the mode seeking over them
    "onzeta": AdaptCost(0.0027),  # one view
    "ecalp": AdaptCost(0.0, per_position=ECALP_S_PER_POSITION * 512 / 22512,
                       per_position_class=ECALP_S_PER_POSITION * 22 / 22512),  # grows with the stream
    "dmn": AdaptCost(10 * TDA_S),  # ~10x TDA's cache work: 64 views encoded, 32 read out of the memory
    "dmn-weak": AdaptCost(TDA_S),  # one view through DMN's read-out, priced as TDA's cache read-out
    "boostadapter": AdaptCost(TDA_S + 0.001, multi_view=TDA_S_64_VIEWS + 0.001),  # TDA + its boosting samples
    # the prompt-tuning methods of TTA-VLM, as ratios to TPT measured in one bench-extract run (docs/benchmarks.md,
    # "TTA-VLM methods: cost per sample"): R-TPT 0.9-1.1x, DynaPrompt 6-8x (no batching across samples)
    "rtpt": AdaptCost(**TPT),
    "dynaprompt": AdaptCost(7 * TPT["per_sample"], per_class=7 * TPT["per_class"]),
    # 3.5-4.8x TPT measured (5 steps on the fine-grained sets), plus the 64 views through the reward model once more
    # (ViT-L-14, about 4.6x ViT-B-16's FLOPs a view, at the encoder's planning rate)
    "rlcf": AdaptCost(4 * TPT["per_sample"] + 64 * 4.6 * ENCODE_S_PER_VIEW["vit"], per_class=4 * TPT["per_class"]),
    # measured at 1.97x the bench model's encoding of its 64 views, independent of K: about 2 encodings of 64 views
    "ttl": AdaptCost(2 * 64 * ENCODE_S_PER_VIEW["vit"]),
    # -- methods that adapt the image encoder over batches of test images (docs/benchmarks.md, "Methods that adapt
    # the image encoder over batches: cost per sample"): each reads its batch's images again (one view at the
    # encoder's planning rate, which the loader sets) and runs the encoder on them
    **BATCH_ENCODER_COSTS,
    # -- per batch, reset before each batch (docs/benchmarks.md, "WATT and CLIPArTT: cost per sample"): the batch's
    # images read again (one view at the planning rate) plus the encoder work measured on a CPU in forwards of one
    # view (a forward ~1/3 of a loader-bound view, as above). WATT-S: 5 rounds x 8 templates x 2 steps, each a
    # forward without gradient, one with and its backward: ~200 forwards; CLIPArTT: 10 such steps plus the B
    # prompts' text forward each: ~27 forwards. Neither depends on K (the class texts are encoded once per run).
    "watt": AdaptCost(ENCODE_S_PER_VIEW["vit"] * (1 + 200 / 3)),
    "clipartt": AdaptCost(ENCODE_S_PER_VIEW["vit"] * (1 + 27 / 3)),
}
#: Adaptation cost assumed for a registered method missing from ADAPT_COSTS (the plan names such methods).
DEFAULT_ADAPT_COST = AdaptCost(0.03)
#: Per-job overhead: start-up, model load, text prototypes (seconds).
JOB_OVERHEAD_S = 120.0
#: Classes per dataset (CoOp splits; ImageNet-A/-R are 200-class subsets), for the per-class costs.
NUM_CLASSES: dict[str, int] = {
    "imagenet": 1000, "imagenet_a": 200, "imagenet_v2": 1000, "imagenet_r": 200, "imagenet_sketch": 1000,
    "caltech101": 100, "dtd": 47, "eurosat": 10, "fgvc_aircraft": 100, "food101": 101, "flowers102": 102,
    "oxford_pets": 37, "stanford_cars": 196, "sun397": 397, "ucf101": 101,
}
DEMO_NUM_CLASSES = 10


#: Methods priced with another method's measured rate when a rates file lacks their own (files written before
#: `bench-gpu` timed every method): C-TPT, O-TPT and A-TPT (and R-TPT) tune the same prompts with the same
#: text-encoder passes per sample as TPT (their extra terms cost little next to them).
RATE_PROXY: dict[str, str] = {"ctpt": "tpt", "otpt": "tpt", "atpt": "tpt", "rtpt": "tpt"}


@dataclass(frozen=True)
class Rates:
    """Rates measured on one device by `python -m tools.bench_gpu --json FILE`, by backbone: what `--rates FILE`
    prices a sweep with instead of the fixed guesses above (backbones and methods it did not measure keep those).

    Attributes:
        source: the file.
        encode_s: (backbone, view policy) -> seconds per view through loader and encoder.
        adapt_s: (backbone, method) -> ((K, seconds per sample), ...) sorted by K.
        overhead_s: backbone -> seconds of a process's fixed cost.
        position: (backbone, method) -> mean stream position of the samples its rate was timed over (the bench's
            `adapt_detail`; a method whose cost grows with the stream, ECALP, is priced from it).
    """

    source: str
    encode_s: Mapping[tuple[str, str], float]
    adapt_s: Mapping[tuple[str, str], tuple[tuple[int, float], ...]]
    overhead_s: Mapping[str, float]
    position: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)

    def measured(self, backbone: str, method: str) -> str | None:
        """The method whose rate prices `method`: itself when the file has it, else its `RATE_PROXY`, else None."""
        for m in (method, RATE_PROXY.get(method)):
            if m is not None and (backbone, m) in self.adapt_s:
                return m
        return None

    def adapt(self, backbone: str, method: str, k: int) -> float | None:
        """Seconds per sample at K classes: linear between the measured K, the end segments extended beyond them
        (the TPT family's cost grows linearly in K), never below zero; None when not measured."""
        m = self.measured(backbone, method)
        pts = self.adapt_s.get((backbone, m)) if m is not None else None
        if not pts:
            return None
        if len(pts) == 1:
            return pts[0][1]
        (k0, s0), (k1, s1) = (pts[0], pts[1]) if k <= pts[0][0] else (pts[-2], pts[-1]) if k >= pts[-1][0] else \
            next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= k <= b[0])
        return max(0.0, s0 + (s1 - s0) * (k - k0) / (k1 - k0))


def _positive(doc: Mapping[str, Any], key: str, where: str) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise SweepError(f"{where}: expected a positive number at {key!r}, got {v!r}")
    return float(v)


@functools.lru_cache(maxsize=8)
def load_rates(path: str) -> Rates:
    """Read the JSON of `python -m tools.bench_gpu --json` (format version 1). Raises SweepError naming the file
    and the key when it is not such a file."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SweepError(f"--rates {path}: cannot read a JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(doc.get("backbones"), dict) \
            or not doc["backbones"]:
        raise SweepError(f"--rates {path}: expected the JSON of `python -m tools.bench_gpu --json` (version 1, "
                         "a 'backbones' object)")
    enc: dict[tuple[str, str], float] = {}
    adapt: dict[tuple[str, str], tuple[tuple[int, float], ...]] = {}
    over: dict[str, float] = {}
    position: dict[tuple[str, str], float] = {}
    for bb, r in doc["backbones"].items():
        where = f"--rates {path}, backbone {bb}"
        if not isinstance(r, dict):
            raise SweepError(f"{where}: expected an object, got {r!r}")
        enc[(bb, "single")] = 1.0 / _positive(r, "single_view_images_per_s", where)
        enc[(bb, "crop_flip")] = 1.0 / _positive(r, "crop_flip_views_per_s", where)
        enc[(bb, "augmix")] = 1.0 / _positive(r, "augmix_views_per_s", where)
        if isinstance(r.get("fixed_cost"), dict):
            over[bb] = _positive(r["fixed_cost"], "process_s", where)
        for method, per_k in (r.get("adapt_samples_per_s") or {}).items():
            if not isinstance(per_k, dict) or not per_k:
                raise SweepError(f"{where}: expected {{K: samples/s}} for {method!r}, got {per_k!r}")
            try:
                pts = sorted((int(k), 1.0 / _positive(per_k, k, where)) for k in per_k)
            except ValueError:
                raise SweepError(f"{where}: class counts of {method!r} must be integers, got {list(per_k)}") from None
            adapt[(bb, method)] = tuple(pts)
        position.update(_positions(r, bb, where))
    return Rates(str(path), enc, adapt, over, position)


def _positions(r: Mapping[str, Any], backbone: str, where: str) -> dict[tuple[str, str], float]:
    """(backbone, method) -> mean stream position of the timed samples, from a backbone's `adapt_detail` (absent
    in files written before it: then nothing), averaged over the K measured."""
    detail = r.get("adapt_detail") or {}
    if not isinstance(detail, dict):
        raise SweepError(f"{where}: expected an object at 'adapt_detail', got {detail!r}")
    out = {}
    for method, per_k in detail.items():
        pos = [v.get("mean_position") for v in (per_k.values() if isinstance(per_k, dict) else [])
               if isinstance(v, dict) and not v.get("skipped")]
        pos = [float(p) for p in pos if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0]
        if pos:
            out[(backbone, method)] = sum(pos) / len(pos)
    return out


def _listed_size(dataset: str) -> tuple[int, int] | None:
    """(images, classes) of a user's dataset registered in this process, from its listing; None otherwise."""
    from extract.datasets import dataset_source

    source = dataset_source(dataset)
    return None if source is None else _listing(dataset, source)


@functools.lru_cache(maxsize=None)
def _listing(dataset: str, source: tuple[str, str | None]) -> tuple[int, int]:
    from extract.datasets import load_testset

    ts = load_testset(dataset)
    return len(ts), ts.num_classes


#: Images of the registered out-of-distribution sets (docs/extract.md, "Out-of-distribution runs"): MCM's 10,000
#: sampled iNaturalist, SUN and Places images, all 5,640 DTD images, NINCO's 5,879 OOD-class images.
OOD_SIZES: dict[str, int] = {"inaturalist": 10000, "sun": 10000, "places": 10000, "textures": 5640, "ninco": 5879}


def _table_size(dataset: str) -> tuple[int, int] | None:
    from schemas.shard import OOD_SEPARATOR

    if OOD_SEPARATOR in dataset:  # an OOD run: both sets' images, the in-distribution set's classes
        ood, _, ind = dataset.partition(OOD_SEPARATOR)
        inner = _table_size(ind)
        extra = OOD_SIZES.get(ood) or (_table_size(ood) or (None, None))[0]
        return None if inner is None or extra is None else (inner[0] + extra, inner[1])
    # ImageNet-C: every corruption and severity holds the 50,000 validation images of the 1000 classes
    base = "imagenet" if dataset.startswith("imagenet_c:") else dataset
    if base in TEST_SIZES:
        return TEST_SIZES[base], NUM_CLASSES[base]
    if dataset.startswith("fmnist"):
        return DEMO_TEST_SIZE, DEMO_NUM_CLASSES
    return _listed_size(dataset)


def adapt_cost(method: str) -> AdaptCost:
    """The fixed guess of `method`'s adaptation cost (DEFAULT_ADAPT_COST for a method the table lacks)."""
    return ADAPT_COSTS.get(method, DEFAULT_ADAPT_COST)


def adapt_seconds(method: str, dataset: str, n: int, policy: str, backbone: str | None = None,
                  rates: Rates | None = None) -> float:
    """Estimated adaptation GPU-seconds of `method` over the first `n` samples of `dataset` with view `policy`:
    measured (`rates`, seconds per sample) where it holds the backbone and method, else `ADAPT_COSTS`."""
    k = (_table_size(dataset) or (0, DEMO_NUM_CLASSES))[1]
    measured = rates.adapt(backbone, method, k) if rates is not None and backbone is not None else None
    if measured is None:
        return adapt_cost(method).seconds(n, k, views_per_image(policy))
    cost = adapt_cost(method)
    pos = rates.position.get((backbone, rates.measured(backbone, method) or method)) if rates is not None else None
    if (cost.per_position or cost.per_position_class) and pos:
        # its cost per sample grows in proportion to the samples seen (ECALP's graph): the rate measured around
        # stream position `pos` scales to n (n + 1) / 2 positions in all, as the fixed guess does
        return measured / pos * n * (n + 1) / 2
    return n * measured


def cost_notes(methods: Sequence[str]) -> list[str]:
    """One line per method whose fixed guess needs saying: none in the table, a provisional one, or a cost that
    grows with the stream (quadratic in a run's images)."""
    notes = []
    for m in dict.fromkeys(methods):
        cost = ADAPT_COSTS.get(m)
        if cost is None:
            notes.append(f"{m}: no cost figure in extract/sweep/cost.py; priced at "
                         f"{DEFAULT_ADAPT_COST.per_sample} s a sample")
        elif cost.provisional:
            notes.append(f"{m}: provisional cost figure (extract/sweep/cost.py)")
        elif cost.per_position or cost.per_position_class:
            notes.append(f"{m}: its cost per sample grows with the samples seen, so a run's cost grows with the "
                         "square of its images (--limit caps it)")
    return notes


def encode_seconds(backbone: str, policy: str, rates: Rates | None = None) -> float:
    """Estimated GPU-seconds per encoded view: measured (`rates`) for this backbone and policy, else the table."""
    # DMN's crop_flip_05 views cost what crop_flip views cost (the same operations on a larger area)
    rate_policy = "crop_flip" if policy == "crop_flip_05" else policy
    measured = rates.encode_s.get((backbone, rate_policy)) if rates is not None else None
    return measured if measured is not None else ENCODE_S_PER_VIEW[_family(backbone)]


def overhead_seconds(backbone: str, rates: Rates | None = None) -> float:
    """Fixed seconds of one job: measured (`rates`) for this backbone, else JOB_OVERHEAD_S."""
    measured = rates.overhead_s.get(backbone) if rates is not None else None
    return measured if measured is not None else JOB_OVERHEAD_S


def n_images(dataset: str, limit: int | None = None) -> int:
    """Images a run over `dataset` processes: the table's test size (a user's dataset: its listing), capped by
    `--limit`.

    >>> n_images("dtd"), n_images("imagenet", limit=1000), n_images("imagenet_c:fog:3")
    (1692, 1000, 50000)
    """
    size = _table_size(dataset)
    if size is None:
        raise SweepError(f"no test size for dataset {dataset!r}; known: {', '.join(TEST_SIZES)}")
    return size[0] if limit is None else min(int(limit), size[0])


def _family(backbone: str) -> str:
    return "rn" if backbone.upper().startswith("RN") else "vit"


def views_per_image(policy: str) -> int:
    """Views a run encodes per image: one for the single view, the original and `N_AUG_VIEWS` augmented ones for
    the multi-view policies (`extract.views`)."""
    from extract.views import N_AUG_VIEWS

    return 1 if policy == "single" else 1 + N_AUG_VIEWS


def estimate_hours(runs: Sequence["RunSpec"], rates: Rates | None = None) -> float:
    """Estimated GPU-hours of a group of runs sharing one feature cache: one encoding pass of the group's views plus
    each method's adaptation, priced with the measured `rates` where they cover it, else with the fixed guesses."""
    r0 = runs[0]
    n = n_images(r0.dataset, r0.limit)
    views = views_per_image(r0.policy)
    enc = n * views * encode_seconds(r0.backbone, r0.policy, rates)
    adapt = sum(adapt_seconds(r.method, r.dataset, n, r.policy, r.backbone, rates) for r in runs)
    return (overhead_seconds(r0.backbone, rates) + enc + adapt) / 3600.0
