"""The cost model of `zaec-sweep --dry-run`: images and views per group, GPU-seconds per view and per sample.

An estimate, documented as such (docs/sweep.md, "The cost model"). A group costs a job's fixed overhead, its
images x views through the image encoder, and each method's adaptation, priced in this order:

1. measured: the rates of one device (`python -m tools.bench_gpu --json FILE`, passed as `--rates FILE`) where that
   file holds the backbone and the method (never for `FIXED_PRICE`);
2. estimated from its work: a method's `AdaptCost.work` (`Work`: FLOPs, bytes moved, kernel launches and host
   seconds, each a sum of terms over the run's sizes) priced with the figures of a card (`CARDS`: the rates file's
   device, else `DEFAULT_CARD`);
3. default: `DEFAULT_ADAPT_COST`, for a registered method without an entry (the plan names it; a test fails for it).

The plan's title says which priced each method. A new method adds one `ADAPT_COSTS` entry with a few
numbers: its work per sample (`"N"`), per sample and class (`"N*K"`), per stream position (`"P"`, the n-th sample
doing n units: a memory of every sample seen), once per run (`"1"`, `"K*txt_flops"`) or over the whole set (a
transductive solve, `AdaptCost.solve`: `"N^2*D"` for its kNN search, `"N*K*D"` for its iterations), in the symbols
of `SYMBOLS`; the backbone's own figures (`D`, `img_flops`, `txt_flops`, ...) are counted from its architecture
(`backbone_figures`), so one entry prices every backbone.

The plan table (`extract.sweep.grid.plan_frame`), the SLURM time limit and the local executor's packing all price
groups with it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
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

# ---------------------------------------------------------------------------------------------------------------
# a method's work, and what a card makes of it

#: The symbols a work term is written in (`Work`): the run's sizes, and the backbone's own figures
#: (`backbone_figures`).
SYMBOLS: dict[str, str] = {
    "N": "samples of the run (its stream positions)",
    "P": "stream positions summed, N (N + 1) / 2: the n-th sample does n units (a memory of every sample seen)",
    "K": "classes",
    "V": "views the run encodes per sample (1, or 64 for the multi-view policies)",
    "D": "the backbone's embedding dimension",
    "img_flops": "FLOPs of one image-encoder forward of one view",
    "txt_flops": "FLOPs of one text-encoder forward of one prompt (its context length of tokens)",
    "img_params": "parameters of the image encoder",
    "txt_params": "parameters of the model outside the image encoder (the text encoder)",
}
_FACTOR = re.compile(r"([A-Za-z_]+)(?:\^([1-9][0-9]*))?")


@functools.lru_cache(maxsize=None)
def parse_term(term: str) -> tuple[tuple[str, int], ...]:
    """A work term's factors: `"1"` (once per run) or symbols of `SYMBOLS` joined by `*`, each with an optional
    integer power. Raises ValueError naming the term and the symbols.

    >>> parse_term("N^2*D"), parse_term("1")
    ((('N', 2), ('D', 1)), ())
    """
    if term.strip() == "1":
        return ()
    out = []
    for f in term.split("*"):
        m = _FACTOR.fullmatch(f.strip())
        if m is None or m.group(1) not in SYMBOLS:
            raise ValueError(f"work term {term!r}: {f.strip()!r} is not SYMBOL or SYMBOL^POWER; symbols: "
                             f"{', '.join(SYMBOLS)} (or the term '1')")
        out.append((m.group(1), int(m.group(2) or 1)))
    return tuple(out)


#: What a work total is counted in, in the order `Card.seconds` prices them.
WORK_KINDS: tuple[str, ...] = ("flops", "fp32_flops", "bytes", "launches", "host_s")


@dataclass(frozen=True)
class Work:
    """A method's adaptation work over a whole run, each kind a sum of terms {term: coefficient}: the term a product
    of `SYMBOLS` (`"N*K*D"`: per sample, class and embedding dimension), the coefficient what one unit of it costs.

    Example: a prototype update of K x D floats per sample, read and written once in float32 with an Adam state
    (params, grads and two moments: about 8 passes of 4 bytes), in about 300 small operations:
    `Work(bytes={"N*K*D": 32}, launches={"N": 300})`.

    Attributes:
        flops: FLOPs on tensor cores (fp16 under autocast: encoder passes, prompt tuning).
        fp32_flops: FLOPs in float32 (no autocast).
        bytes: bytes read and written in device memory (caches, graphs, optimizer states).
        launches: kernel launches; each costs the launching host thread `LAUNCH_S` whatever its size, which is what
            a per-sample step of small tensor operations pays on a GPU.
        host_s: seconds of the host's CPU the GPU waits on (views generated in the main process).
    """

    flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    fp32_flops: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    launches: Mapping[str, float] = dataclasses.field(default_factory=dict)
    host_s: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind in WORK_KINDS:
            for term, c in getattr(self, kind).items():
                parse_term(term)
                if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
                    raise ValueError(f"work {kind}[{term!r}]: expected a number >= 0, got {c!r}")

    def totals(self, values: Mapping[str, float]) -> dict[str, float]:
        """Each kind's total over the run whose symbols take `values` (`work_values`)."""
        return {kind: sum(c * math.prod(values[s] ** p for s, p in parse_term(t))
                          for t, c in getattr(self, kind).items()) for kind in WORK_KINDS}

    @property
    def grows_with_stream(self) -> bool:
        """True when a term grows faster than the samples: a stream position (`P`) or a power of `N` above 1."""
        return any(s == "P" or (s == "N" and p > 1) for kind in WORK_KINDS for t in getattr(self, kind)
                   for s, p in parse_term(t))


#: The fraction of a card's datasheet FLOP rate a run reaches: TPT's text passes at K = 1000 on the H100 (8.43
#: samples/s measured; 4 forward-equivalents of 1000 prompts at 5.96 GFLOP, 2.4e13 FLOP a sample)
#: ran at 0.20 of its 989 TFLOP/s (docs/sweep.md, "The cost model").
FLOP_EFFICIENCY = 0.2
#: The fraction of the memory bandwidth a streaming kernel reaches: a planning figure (0.7-0.9 is usual), not
#: measured here.
BANDWIDTH_EFFICIENCY = 0.7
#: Host seconds per kernel launch: the main thread's time per launch measured on the H100 machine
#: (docs/benchmarks.md, the AugMix chains: 17.7 us a launch). It depends on the host's CPU, not the card.
LAUNCH_S = 17.7e-6


@dataclass(frozen=True)
class Card:
    """A GPU's datasheet figures (dense rates, no sparsity).

    Attributes:
        name: the card, as `CARDS` keys it.
        tensor_flops: FLOP/s of fp16/bf16 on tensor cores.
        fp32_flops: FLOP/s of float32 without tensor cores.
        bandwidth: bytes/s of its memory.
    """

    name: str
    tensor_flops: float
    fp32_flops: float
    bandwidth: float

    def seconds(self, totals: Mapping[str, float]) -> float:
        """GPU-seconds of work `totals` (`Work.totals`): each kind at its attainable rate, one after the other (no
        overlap assumed, so an upper estimate within a factor of the kinds' count of the roofline)."""
        return (totals["flops"] / (self.tensor_flops * FLOP_EFFICIENCY)
                + totals["fp32_flops"] / (self.fp32_flops * FLOP_EFFICIENCY)
                + totals["bytes"] / (self.bandwidth * BANDWIDTH_EFFICIENCY)
                + totals["launches"] * LAUNCH_S + totals["host_s"])


#: Cards by the name their device string holds (`torch.cuda.get_device_name`, the rates file's "device"; the
#: longest name found wins: "NVIDIA H100 PCIe" is the PCIe card, "NVIDIA H100 80GB HBM3" the SXM one). NVIDIA's
#: datasheets, dense rates.
CARDS: dict[str, Card] = {c.name: c for c in (
    Card("V100", 125e12, 15.7e12, 900e9),
    Card("A10", 125e12, 31.2e12, 600e9),
    Card("A100", 312e12, 19.5e12, 2039e9),  # SXM4 80 GB
    Card("A100-SXM4-40GB", 312e12, 19.5e12, 1555e9),
    Card("A100-PCIE-40GB", 312e12, 19.5e12, 1555e9),
    Card("L40S", 362e12, 91.6e12, 864e9),
    Card("H100", 989e12, 67e12, 3350e9),  # SXM5
    Card("H100 PCIe", 756e12, 51e12, 2000e9),
    Card("H200", 989e12, 67e12, 4800e9),
)}
#: The card a plan without a rates file (or with one from a card `CARDS` lacks) estimates for: the planning
#: figures above are for an A100/H100-class GPU, and the shared measurements are an H100's.
DEFAULT_CARD = "H100"


def card_for(device: str | None) -> Card:
    """The card a device string names (`CARDS`, longest name first), else `DEFAULT_CARD`'s.

    >>> card_for("NVIDIA H100 PCIe").name, card_for("NVIDIA A100-SXM4-80GB").name, card_for(None).name
    ('H100 PCIe', 'A100', 'H100')
    """
    found = [name for name in CARDS if device and name.lower() in device.lower()]
    return CARDS[max(found, key=len)] if found else CARDS[DEFAULT_CARD]


@dataclass(frozen=True)
class BackboneFigures:
    """A backbone's figures for the work terms (`SYMBOLS`): `counted` is False for `REFERENCE_FIGURES` standing in
    for a backbone whose architecture could not be counted."""

    embed_dim: int
    img_flops: float
    txt_flops: float
    img_params: int
    txt_params: int
    counted: bool = True


#: ViT-B-16's figures as `backbone_figures` counts them (tests/extract/test_sweep.py checks it): the stand-in for a
#: backbone whose architecture is not at hand.
REFERENCE_FIGURES = BackboneFigures(512, 35_126_906_880, 5_959_540_736, 86_192_640, 63_428_097, counted=False)


@functools.lru_cache(maxsize=32)
def backbone_figures(backbone: str, pretrained: str = "") -> BackboneFigures:
    """Count a backbone's figures from its architecture (open_clip's config, or a `local-dir:` folder's), built on
    the meta device (no weights, no memory): the FLOPs of one image-encoder forward at its input size and of one
    text-encoder forward at its context length (torch's `FlopCounterMode`), its parameters and embedding dimension.
    `REFERENCE_FIGURES` where the architecture cannot be built this way (a timm or Hugging Face tower, a name
    open_clip does not know)."""
    from extract.models import architecture_config

    try:
        cfg = architecture_config(backbone, pretrained)
        return _count_figures(cfg) if cfg else REFERENCE_FIGURES
    except Exception:  # noqa: BLE001  (a planning figure: any failure falls back to the reference, said in the plan)
        return REFERENCE_FIGURES


def _count_figures(cfg: Mapping[str, Any]) -> BackboneFigures:
    import open_clip
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    kwargs = {k: v for k, v in cfg.items() if k != "custom_text"}
    custom = bool(cfg.get("custom_text")) or "hf_model_name" in (cfg.get("text_cfg") or {})
    with torch.device("meta"):
        model = (open_clip.CustomTextCLIP if custom else open_clip.CLIP)(**kwargs)
        size = cfg["vision_cfg"].get("image_size", 224)
        h, w = (size, size) if isinstance(size, int) else size
        images = torch.empty(1, 3, h, w)
        tokens = torch.zeros(1, int((cfg.get("text_cfg") or {}).get("context_length", 77)), dtype=torch.long)
        with FlopCounterMode(display=False) as img:
            model.encode_image(images)
        with FlopCounterMode(display=False) as txt:
            model.encode_text(tokens)
    n_img = sum(p.numel() for p in model.visual.parameters())
    return BackboneFigures(int(cfg["embed_dim"]), float(img.get_total_flops()), float(txt.get_total_flops()), n_img,
                           sum(p.numel() for p in model.parameters()) - n_img)


def work_values(n: int, k: int, views: int, figures: BackboneFigures) -> dict[str, float]:
    """The symbols' values (`SYMBOLS`) of a run over `n` samples, `k` classes and `views` views."""
    return {"N": n, "P": n * (n + 1) / 2, "K": k, "V": views, "D": figures.embed_dim, "img_flops": figures.img_flops,
            "txt_flops": figures.txt_flops, "img_params": figures.img_params, "txt_params": figures.txt_params}


@dataclass(frozen=True)
class AdaptCost:
    """One method's adaptation cost over a run of N samples with K classes: its `work` (`Work`), priced with a
    card's figures and the backbone's (`estimate`).

    Attributes:
        work: what the method computes and moves over a run, in the symbols of `SYMBOLS`.
        solve: the work is one solve over the whole run (a transductive method, whose first `adapt` call holds it):
            a rate measured over a run of N' samples scales to a run of n as the work does, estimate(n) /
            estimate(N') (`adapt_seconds`), not as n / N'.
    """

    work: Work
    solve: bool = False

    def estimate(self, n: int, k: int, views: int, figures: BackboneFigures = REFERENCE_FIGURES,
                 card: Card | None = None) -> float:
        """GPU-seconds of a run over `n` samples, `k` classes and `views` views: its work on `card`
        (`DEFAULT_CARD` when None) with the backbone's `figures`."""
        return (card or CARDS[DEFAULT_CARD]).seconds(self.work.totals(work_values(n, k, views, figures)))

    @property
    def grows_with_stream(self) -> bool:
        """True when the n-th sample costs more than the first (`Work.grows_with_stream`)."""
        return self.work.grows_with_stream


# ---------------------------------------------------------------------------------------------------------------
# the methods' work (docs/sweep.md, "The cost model", has the table of every method)

#: Host seconds per image read again and preprocessed at 224 px in the main process, one core (the run's reader of
#: view pixels, `extract/run/pixels.py`): 2.7-2.8 ms measured for a 500x375 JPEG (docs/benchmarks.md, "Methods
#: inside the image encoder: cost per sample")
PIXEL_READ_S = 0.003
#: Host seconds per view of a sample generated in the main process at 224 px (`ViewImages`, one core: 54-61 ms a
#: sample of 64 crop+flip or AugMix crops; docs/benchmarks.md, "Loader items, AugMix launches and the weights' read")
VIEW_PIXELS_S = 1e-3
#: Host seconds per image read again through the loader processes (a batch's images, a second model's view): the
#: encoding pass's loader-bound planning rate of one view (`ENCODE_S_PER_VIEW`)
LOADER_READ_S = ENCODE_S_PER_VIEW["vit"]
#: Seconds per matrix column of a dense D x D factorisation on a GPU, which is latency-bound (its panels in
#: sequence, which the host issues and waits on), not FLOP-bound, so written as host seconds: an LU for an inverse
#: about 1 ms at D = 512, an SVD for a pseudo-inverse about 20 ms (estimates of the helpers who wrote DOTA and OGA,
#: not measured on a GPU; docs/benchmarks.md, "Training-free online methods: cost per sample")
LU_S_PER_COLUMN, SVD_S_PER_COLUMN = 1e-3 / 512, 20e-3 / 512

#: The methods that adapt the image encoder over batches of test images (docs/benchmarks.md, "Methods that adapt the
#: image encoder over batches: cost per sample"): each reads its batch's images again (loader-bound: a view at the
#: encoding pass's planning rate, `LOADER_READ_S`) and runs the image encoder on them, a
#: backward counted as 2 forwards (measured on the CPU: Tent 3.4, SAR 5.7, DeYO 2.3 up to 5 encodings of an image);
#: launches: about 370 a ViT-B-16 forward (as RLCF's), so per batch of 64 the passes' launches / 64 a sample
BATCH_ENCODER_COSTS: dict[str, AdaptCost] = {
    # Tent: forward, backward, the prediction's forward: 4 forwards
    "tent": AdaptCost(work=Work(flops={"N*img_flops": 4}, launches={"N": 4 * 370 / 64},
                                host_s={"N": LOADER_READ_S})),
    # SAR: two forwards with their backwards and the prediction's forward: 7 forwards
    "sar": AdaptCost(work=Work(flops={"N*img_flops": 7}, launches={"N": 7 * 370 / 64},
                               host_s={"N": LOADER_READ_S})),
    # DeYO: forward, backward, the shuffled images' forward (at most the batch) and the prediction's: 5 forwards
    "deyo": AdaptCost(work=Work(flops={"N*img_flops": 5}, launches={"N": 5 * 370 / 64},
                                host_s={"N": LOADER_READ_S})),
    # BATCLIP: the image encoder's forward and backward (3), and the text encoder's over the K prompts once per batch
    # of 64 (3 forwards of K prompts / 64 a sample)
    "batclip": AdaptCost(work=Work(flops={"N*img_flops": 3, "N*K*txt_flops": 3 / 64},
                                   launches={"N": 6 * 370 / 64}, host_s={"N": LOADER_READ_S})),
}
#: FLOPs of DINOv2 ViT-L/14 with registers (COSMIC's second model, timm's `vit_large_patch14_reg4_dinov2`) on one
#: view at 224 px, counted with torch's FlopCounterMode on the meta device (under autocast: tensor-core FLOPs)
DINO_VIEW_FLOPS = 164.6e9
#: Stable Diffusion v1's UNet (lambdalabs/sd-image-variations-diffusers, the architecture
#: `tools.second_models.write_sd_pipeline(size="official")` builds) at one denoising step of one generated image (its
#: 2 latents of 64 x 64: classifier-free guidance), and its VAE decoding one image at 512 px: FLOPs counted with
#: torch's FlopCounterMode on the meta device, the convolutions apart from the matrix products (attention included)
SD_UNET_STEP_FLOPS, SD_VAE_FLOPS = {"conv": 0.888e12, "matmul": 0.706e12}, {"conv": 2.472e12, "matmul": 0.043e12}
#: DiffTPT's generation per sample at its official settings (63 images, 50 steps, one pipeline call of 63, float32:
#: docs/methods.md, "DiffTPT: views generated by Stable Diffusion"), the field's most expensive work by far (about 5.2
#: PFLOP a sample). In float32 torch runs convolutions in TF32 on tensor cores (cuDNN's default), at half the fp16 rate
#: of an A100/H100 (datasheets: their FLOPs count twice in `flops`), and matrix products in plain float32 (no TF32 by
#: default: `fp32_flops`), plus the pipeline's CLIP ViT-L/14 on the conditioning image (0.162 TFLOP, float32). Each
#: image then goes to PIL, is stored as JPEG and read back, and preprocessed in the main process: 5.4-8.4 ms on one
#: core (measured, 512 px). Launches: 50 x (the UNet's 3,006, counted on the meta device, and the scheduler's and
#: guidance's ~25), the VAE's 462 and the conditioning's 1,943. With `--set diffusion_fp16=true` the FLOPs run at the
#: fp16 rate: about a fifth of the time.
DIFFTPT_GENERATION = Work(
    flops={"N": 2 * 63 * (50 * SD_UNET_STEP_FLOPS["conv"] + SD_VAE_FLOPS["conv"])},
    fp32_flops={"N": 63 * (50 * SD_UNET_STEP_FLOPS["matmul"] + SD_VAE_FLOPS["matmul"]) + 0.162e12},
    host_s={"N": 63 * 6e-3}, launches={"N": 50 * (3006 + 25) + 462 + 1943})
#: The field's methods beyond TTA-VLM's, by family (docs/methods.md has each method; docs/benchmarks.md their CPU
#: measurements). Launches: `python -m tools.bench_launches` (ViT-B-16's depth, K = 1,000 with ImageNet's names,
#: per sample in the runner's calls of 64 or the method's own batch; docs/sweep.md has the counts).
FIELD_COSTS: dict[str, AdaptCost] = {
    # -- inside the image encoder, training-free (docs/benchmarks.md, "Methods inside the image encoder: cost per
    # sample"). CALIP: view 0 read again (`PIXEL_READ_S`) and encoded once more for its token map, in the call's
    # batch under autocast; its attention, three (L, K) x D products over ViT-B/16's L = 197 tokens (RN50: 50,
    # priced as 197), in float32
    "calip": AdaptCost(Work(flops={"N*img_flops": 1}, fp32_flops={"N*K*D": 6 * 197}, host_s={"N": PIXEL_READ_S},
                            launches={"N": 12})),
    # TCA: view 0 read again and one batch-1 forward through the condensing blocks (197 tokens, then 143, 104 and
    # 77 from blocks 3, 6, 9: 0.66 of a forward's work); its reservoir of up to 3 items a class, each the class
    # token after the 12 blocks (12 x 768 = 18 D floats at ViT-B/16's D = 512), read about 4 times a sample (the
    # affinities, the eviction, the context's class means) in float32; 741 launches a sample (a batch-1 forward
    # is launch-bound on a GPU)
    "tca": AdaptCost(Work(flops={"N*img_flops": 0.66}, fp32_flops={"N*K*D": 2 * 3 * 18},
                          bytes={"N*K*D": 4 * 4 * 3 * 18}, host_s={"N": PIXEL_READ_S}, launches={"N": 741})),
    # -- prompt tuning with history, averaging or descriptions (docs/benchmarks.md, "Prompt tuning with history,
    # averaging or descriptions: cost per sample"). HisTPT: TPT's text work per sample without TPT's batching across
    # samples (1.5x TPT's per class, measured on the CPU) plus the prediction's autocast forward on CUDA (one pass
    # more of TPT's 4: x 5/4); its three memories of (K, D) prompts (32 local, 32 hard, the global one) pushed, sorted
    # and averaged, about 290 float32 passes of K x D a sample; 13,053 launches a sample, one sample at a time (6
    # prompt-length groups at K = 1,000 through 12 blocks, forward, backward, forward)
    "histpt": AdaptCost(Work(flops={"N*K*txt_flops": 4 * 1.5 * 5 / 4}, bytes={"N*K*D": 290 * 4},
                             launches={"N": 13053})),
    # DART: its image side about 3.75 encodings of the 64 views a sample (block 0 once without gradient, blocks
    # 1-11 forward, backward as 2 forwards, and forward again: 1/12 + 11/12 x 4), their pixels generated in the
    # main process; its text step with a context per class (no shared prefix, no batching across samples: 7x TPT's
    # per class on the CPU, as DynaPrompt); the AdamW step on the (K, 4, D) contexts (8 float32 passes); one sample
    # at a time: 7,582 launches a sample (AugMix's device chains of its views included)
    "dart": AdaptCost(Work(flops={"N*V*img_flops": 3.75, "N*K*txt_flops": 7 * 4}, bytes={"N*K*D": 4 * 4 * 8},
                           host_s={"N*V": VIEW_PIXELS_S}, launches={"N": 7582})),
    # AWT: no gradient; per sample the (51 views x 51 prompts x K) logits, 51 K² text-weight entropies (about 8
    # float32 passes over their (51, K, K) rows) and up to 100 Sinkhorn rounds over (K, 51, 51) (2 passes each, the
    # cap: an upper estimate); the 51 K prompts encoded once per run. Samples in groups of 2^24 / (51 x 51 x K)
    # (6 at K = 1,000): 108 launches a group, 30 a sample
    "awt": AdaptCost(Work(fp32_flops={"N*K*D": 2 * 51 * 51, "N*K^2": 51 * 6, "N*K": 51 * 51 * 100 * 4},
                          bytes={"N*K^2": 51 * 8 * 4, "N*K": 51 * 51 * 4 * (10 + 100 * 2)},
                          flops={"K*txt_flops": 51}, launches={"N": 30, "N*K": 108 * 51 * 51 / 2 ** 24})),
    # -- training-free online (docs/benchmarks.md, "Training-free online methods: cost per sample"). DOTA: per sample
    # about 7 float32 passes over the (K, D, D) covariances (scale, rank-n update, divide, mean: 1.05 GB at ImageNet's
    # K = 1,000, D = 512) with the update's 2 n K D² FLOPs (n kept views, about V / 10: 1, or 6 of 64; written
    # 2 + 0.2 V, a slight overcount), and a D x D inverse (8/3 D³ FLOPs, latency-bound); 78 launches a sample
    "dota": AdaptCost(Work(fp32_flops={"N*K*D^2": 2, "N*V*K*D^2": 0.2, "N*D^3": 8 / 3}, bytes={"N*K*D^2": 7 * 4},
                           host_s={"N*D": LU_S_PER_COLUMN}, launches={"N": 78})),
    # OGA: per sample its Gaussian scores (two (K, D) x (D, D) products); about half the samples change the memory
    # (44% on ImageNet: a class's n-th sample enters with probability ~8/n), each change a covariance over up to 8 K
    # items (2 x 8 K D² FLOPs), about 4 passes over the (K, 8, D) float16 memory and a D x D pseudo-inverse (an SVD,
    # latency-bound); 196 launches a sample (about 100, and 200 more a change)
    "oga": AdaptCost(Work(fp32_flops={"N*K*D^2": 4 + 0.5 * 16}, bytes={"N*K*D": 0.5 * 8 * 2 * 4},
                          host_s={"N*D": 0.5 * SVD_S_PER_COLUMN}, launches={"N": 196})),
    # BCA: TDA's order: per sample the views' logits against the K centres, the (K, K) table product, a centre and a
    # table row updated; 4 host syncs among its 75 launches
    "bca": AdaptCost(Work(fp32_flops={"N*V*K*D": 2, "N*K^2": 2}, bytes={"N*K*D": 4, "N*K^2": 4},
                          launches={"N": 75})),
    # COSMIC (docs/methods.md, "COSMIC: a second image encoder (DINOv2) and dual memories"): DINOv2 ViT-L/14 on the
    # original view (`DINO_VIEW_FLOPS`), read again through the loader; per sample the 8 views' logits, DMN's
    # read-out of K x 17 keys (about 7 float32 passes) and the DINOv2 class means (K x 16 x 1024 floats, 2 passes):
    # 733 launches (counted with the rebuilds off). A rebuild of both graphs (2 K CLIP and K DINOv2 nodes) happens at
    # nearly every sample while i <= K x memory (16 on the ImageNet family: 16 K rebuilds; 8 on the fine-grained
    # sets, where this term is twice the work), then every 100 samples: 16 K + N / 100 rebuilds, each the
    # similarities (12 K² D FLOPs), their sort (about 5 K² floats, 64 bytes each through a radix sort), the
    # second-order edges (A ⊙ A²: 18 K³ FLOPs), networkx's clique search on the host (0.14 s at K = 1,000 measured
    # on the CPU, linear in the nodes: 1.4e-4 K s) and about 11.85 K launches (11,854 counted at K = 1,000: its
    # cliques one by one)
    "cosmic": AdaptCost(Work(flops={"N": DINO_VIEW_FLOPS},
                             fp32_flops={"N*K*D": 2 * 8 + 6 * 17, "K^3*D": 16 * 12, "N*K^2*D": 12 / 100,
                                         "K^4": 16 * 18, "N*K^3": 18 / 100},
                             bytes={"N*K*D": 4 * (7 * 17 + 2 * 32), "K^3": 16 * 5 * 64, "N*K^2": 5 * 64 / 100},
                             host_s={"N": LOADER_READ_S, "K^2": 16 * 1.4e-4, "N*K": 1.4e-4 / 100},
                             launches={"N": 733, "K^2": 16 * 11.85, "N*K": 11.85 / 100})),
    # -- methods that need a second pretrained model (docs/benchmarks.md, "Methods that need a second pretrained
    # model: cost"). DiffTPT: its generation (`DIFFTPT_GENERATION`, the most expensive work of the field) in the
    # encoding step, the 63 generated views encoded by the policy (autocast), and its tuning, 4 steps over 127 views
    # (3.9x TPT's text work measured on the CPU at K = 100; 4,227 launches a sample in passes of 64)
    "difftpt": AdaptCost(Work(flops={"N": DIFFTPT_GENERATION.flops["N"], "N*img_flops": 63,
                                     "N*K*txt_flops": 3.9 * 4},
                              fp32_flops=DIFFTPT_GENERATION.fp32_flops, host_s=DIFFTPT_GENERATION.host_s,
                              launches={"N": DIFFTPT_GENERATION.launches["N"] + 4227})),
    # PromptAlign: the 64 views read in the main process and through the MaPLe-prompted image tower forward and
    # backward (3 encodings; 1.43-1.50x TTL's 2 measured on the CPU), the tuned model's prediction on view 0, and a
    # TPT step on the text side one sample at a time (1.5x TPT's per class, as HisTPT); 2,540 launches a sample
    "promptalign": AdaptCost(Work(flops={"N*V*img_flops": 3, "N*img_flops": 1, "N*K*txt_flops": 4 * 1.5},
                                  host_s={"N*V": VIEW_PIXELS_S}, launches={"N": 2540})),
    # -- transductive (docs/benchmarks.md, "Transductive methods: growth with N"; `solve`): one solve over the run
    # (StatA-online: over each batch of 128). Its kNN search, 2 D float32 FLOPs and 8 bytes (the similarity written
    # and read in blocks) per pair of samples (N² pairs); StatA's 11 likelihoods and 10 refits, two (N, D) x (D, K)
    # products each (84 N K D FLOPs; TransCLIP one each: 42), and the 55 z-steps, about 15 float32 passes over
    # (N, K) arrays each read and written (55 x 120 bytes per sample and class); the launches of a solve counted
    # (they do not grow with N but for the search's blocks). ZLaP: the image-text search (2 N K D) and conjugate
    # gradients in float64 over the graph's N + K nodes (about 20 edges a node): 8 iterations of about 500 bytes a
    # node and column, x3 for the sparse product's gathers; K columns (`zlap`), N + K for `zlap-inductive` (one a
    # sample), so its N² term
    "stata": AdaptCost(Work(fp32_flops={"N^2*D": 2, "N*K*D": 84}, bytes={"N^2": 8, "N*K": 55 * 120},
                            launches={"1": 2344}), solve=True),
    "stata-online": AdaptCost(Work(fp32_flops={"N*D": 2 * 128, "N*K*D": 84}, bytes={"N": 8 * 128, "N*K": 55 * 120},
                                   launches={"N": 2344 / 128}), solve=True),
    "transclip": AdaptCost(Work(fp32_flops={"N^2*D": 2, "N*K*D": 42}, bytes={"N^2": 8, "N*K": 55 * 120},
                                launches={"1": 1956}), solve=True),
    "zlap": AdaptCost(Work(fp32_flops={"N^2*D": 2, "N*K*D": 2}, bytes={"N^2": 8, "N*K": 3 * 8 * 500,
                                                                       "K^2": 3 * 8 * 500},
                           launches={"1": 272}), solve=True),
    "zlap-inductive": AdaptCost(Work(fp32_flops={"N^2*D": 2, "N*K*D": 2},
                                     bytes={"N^2": 8 + 3 * 8 * 500, "N*K": 3 * 8 * 500},
                                     launches={"1": 390}), solve=True),
    # -- the image encoder adapted per batch and reset (docs/benchmarks.md, "WATT and CLIPArTT: cost per sample"):
    # the batch's images read again through the loader and the encoder's passes (fp16 weights on CUDA; a backward
    # as 2 forwards, as Tent's). WATT-S: 5 rounds x 8 templates x 2 steps, each a forward without gradient (the
    # pseudo-labels), one with and its backward, then the prediction: 321 forwards; its 8 K template prompts encoded
    # twice once per run. CLIPArTT: 10 such steps, each encoding the batch's B prompts (its top 3 classes), then the
    # prediction: 41 forwards and 10 text forwards a sample. Launches counted per batch of their 128.
    "watt": AdaptCost(Work(flops={"N*img_flops": 80 * 4 + 1, "K*txt_flops": 16}, host_s={"N": LOADER_READ_S},
                           launches={"N": 143628 / 128 + 1})),
    "clipartt": AdaptCost(Work(flops={"N*img_flops": 10 * 4 + 1, "N*txt_flops": 10, "K*txt_flops": 1},
                               host_s={"N": LOADER_READ_S}, launches={"N": 20356 / 128 + 21})),
}

#: Adaptation cost by method: its work (`Work`), priced on a card. The launches of TTA-VLM's methods were counted on
#: the CPU around one `adapt` call of 32 samples through the runner on the bench model (torch's profiler,
#: `tools.bench_extract.count_launches`), those of the field's (`FIELD_COSTS`, `BATCH_ENCODER_COSTS`) with
#: `tools.bench_launches` at ViT-B-16's depth (docs/sweep.md, "The cost model", has the counts); FLOPs and bytes
#: follow from each method's tensors at the run's sizes, as the comments say. Where an encoder pass runs per sample,
#: its FLOPs are the backbone's own (`txt_flops`, `img_flops`) and its launches those of ViT-B-16's towers.
#: TPT's work: one forward and backward of the text encoder over the K prompts and the final forward (4 forward
#: FLOPs each); 450 launches a sample, what the run rate the H100 measured at K = 47 (126 samples/s, 7.9 ms a
#: sample; docs/benchmarks.md) leaves beside its FLOPs at `LAUNCH_S` a launch
TPT_WORK = Work(flops={"N*K*txt_flops": 4}, launches={"N": 450})
#: TDA's cache read-out: up to 3 positive and 2 negative entries a class (5 K keys of D floats and their one-hot
#: values of K floats), read once per sample in float32, plus the logits of the run's views; 31 launches a sample
TDA_WORK = Work(fp32_flops={"N*K*D": 10, "N*K^2": 10, "N*V*K*D": 2}, bytes={"N*K*D": 20, "N*K^2": 20},
                launches={"N": 31})
ADAPT_COSTS: dict[str, AdaptCost] = {
    "zero-shot": AdaptCost(work=Work(fp32_flops={"N*K*D": 2}, launches={"N": 0.2})),  # one matmul a call
    "tda": AdaptCost(work=TDA_WORK),
    # one AdamW step on the (K, D) prototype residuals per sample: params, grads and two moments read and written
    # (8 passes of 4 bytes), the views' logits forward and backward; TDA-like caches beside it
    "dpe": AdaptCost(work=Work(fp32_flops={"N*V*K*D": 6, "N*K*D": 10}, bytes={"N*K*D": 52}, launches={"N": 343})),
    "dlae": AdaptCost(work=Work(fp32_flops={"N*V*K*D": 6, "N*K*D": 10}, bytes={"N*K*D": 84}, launches={"N": 523})),
    **{m: AdaptCost(work=TPT_WORK) for m in ("tpt", "ctpt", "otpt", "atpt", "rtpt")},  # 18-21 launches counted
    # one AdamW step on a (K, D) shift for a call's samples: the views' logits forward and backward under autocast
    "tps": AdaptCost(work=Work(flops={"N*V*K*D": 6}, bytes={"N*K*D": 1}, launches={"N": 5})),
    "zero": AdaptCost(work=Work(fp32_flops={"N*V*K*D": 2}, launches={"N": 2.25})),  # the views' votes
    # the views' logits and the mode seeking over their (V, V) affinities (a few iterations)
    "mta": AdaptCost(work=Work(fp32_flops={"N*V*K*D": 2, "N*V^2*D": 20}, launches={"N": 29.5})),
    "onzeta": AdaptCost(work=Work(fp32_flops={"N*K*D": 6}, launches={"N": 43})),  # one view, K x D updates
    # the n-th sample: distances to the n samples seen (D floats each), then about 3 iterations x 3 passes over
    # the labels gathered along its graph's E ~ 19 n edges (K floats each: 684 K bytes and 342 K FLOPs per
    # position; docs/benchmarks.md, "ECALP's growth with the stream"); 110 launches a sample
    "ecalp": AdaptCost(work=Work(fp32_flops={"P*D": 2, "P*K": 342}, bytes={"P*D": 4, "P*K": 684},
                                 launches={"N": 110})),
    # a memory of up to 50 entries a class (K x 50 x D floats) read per sample; half the views read out of it
    **{m: AdaptCost(work=Work(fp32_flops={"N*V*K*D": 50, "N*K*D": 100}, bytes={"N*K*D": 200},
                              launches={"N": 27.3})) for m in ("dmn", "dmn-weak")},
    # TDA's caches plus its boosting samples (the confident views join a second cache of the same size)
    "boostadapter": AdaptCost(work=Work(fp32_flops={"N*K*D": 20, "N*K^2": 20, "N*V*K*D": 2},
                                        bytes={"N*K*D": 40, "N*K^2": 40}, launches={"N": 65})),
    # 6-8x TPT's text passes measured (no batching across samples, a text pass over its prompt buffer)
    "dynaprompt": AdaptCost(work=Work(flops={"N*K*txt_flops": 7 * 4}, launches={"N": 7 * 450})),
    # about 4 TPT steps (3 on ImageNet, 5 on the fine-grained sets; 3.5-4.8x TPT measured), plus the views through
    # the reward model once more: its default ViT-L-14 at 162 GFLOP a view as `backbone_figures` counts it, about
    # 370 launches a forward
    "rlcf": AdaptCost(work=Work(flops={"N*K*txt_flops": 4 * 4, "N*V": 162e9}, launches={"N": 4 * 450 + 370})),
    # about 2 encodings of the views a sample (measured 1.97x on the CPU: a frozen forward, the adapted blocks'
    # backward, the final forward), ~2,000 launches (839 counted with the bench's 4 blocks; ViT-B-16 has 12), and
    # the views' pixels generated in the main process (about 1,000 views/s on one core at 224 px)
    "ttl": AdaptCost(work=Work(flops={"N*V*img_flops": 2}, launches={"N": 2000}, host_s={"N*V": VIEW_PIXELS_S})),
    # the field's methods beyond TTA-VLM's (`FIELD_COSTS`) and those that adapt the image encoder over batches
    **FIELD_COSTS,
    **BATCH_ENCODER_COSTS,
}
#: Methods always priced from their work, never with a measured rate: their benches run a stand-in second model whose
#: cost is not the real one's, inside the rate they time (DiffTPT: a tiny random pipeline generating its views;
#: tools/second_models.py). A rate without the generation would miss the work that dominates its price.
FIXED_PRICE: frozenset[str] = frozenset({"difftpt"})
#: Seconds a sample assumed for a registered method missing from ADAPT_COSTS (the plan names such methods; a test
#: fails for each): seconds as they are, whatever the card
DEFAULT_S_PER_SAMPLE = 0.03
DEFAULT_ADAPT_COST = AdaptCost(Work(host_s={"N": DEFAULT_S_PER_SAMPLE}))
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
    prices a sweep with instead of the estimates above (backbones and methods it did not measure keep those).

    Attributes:
        source: the file.
        encode_s: (backbone, view policy) -> seconds per view through loader and encoder.
        adapt_s: (backbone, method) -> ((K, seconds per sample), ...) sorted by K.
        overhead_s: backbone -> seconds of a process's fixed cost.
        position: (backbone, method) -> mean stream position of the samples its rate was timed over (the bench's
            `adapt_detail`; a method whose cost grows with the stream, ECALP, is priced from it).
        device: the device the file was measured on (its "device"): the card the work of the methods it did not
            measure is estimated on (`card_for`).
    """

    source: str
    encode_s: Mapping[tuple[str, str], float]
    adapt_s: Mapping[tuple[str, str], tuple[tuple[int, float], ...]]
    overhead_s: Mapping[str, float]
    position: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    device: str = ""

    def measured(self, backbone: str, method: str) -> str | None:
        """The method whose rate prices `method`: itself when the file has it, else its `RATE_PROXY`, else None
        (always None for `FIXED_PRICE`, whose bench runs a stand-in second model)."""
        if method in FIXED_PRICE:
            return None
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
        per_method = r.get("adapt_samples_per_s") or {}
        if not isinstance(per_method, dict):
            raise SweepError(f"{where}: expected an object at 'adapt_samples_per_s', got {per_method!r}")
        for method, per_k in per_method.items():
            if not isinstance(per_k, dict) or not per_k:
                raise SweepError(f"{where}: expected {{K: samples/s}} for {method!r}, got {per_k!r}")
            try:
                pts = sorted((int(k), 1.0 / _positive(per_k, k, where)) for k in per_k)
            except ValueError:
                raise SweepError(f"{where}: class counts of {method!r} must be integers, got {list(per_k)}") from None
            adapt[(bb, method)] = tuple(pts)
        position.update(_positions(r, bb, where))
    device = doc.get("device")
    return Rates(str(path), enc, adapt, over, position, device if isinstance(device, str) else "")


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
    """The cost entry of `method` (DEFAULT_ADAPT_COST for a method the table lacks)."""
    return ADAPT_COSTS.get(method, DEFAULT_ADAPT_COST)


#: How a method's adaptation was priced (`price_basis`), in the order the plan's title lists them.
BASES: tuple[str, ...] = ("measured", "estimated", "default")


def price_basis(method: str, backbone: str | None, rates: Rates | None = None) -> str:
    """"measured" (the rates file holds the backbone and the method, or its `RATE_PROXY`), "estimated" (from its
    `Work` on a card) or "default" (no entry: `DEFAULT_ADAPT_COST`)."""
    if rates is not None and backbone is not None and rates.measured(backbone, method) is not None:
        return "measured"
    return "estimated" if method in ADAPT_COSTS else "default"


def plan_card(rates: Rates | None = None) -> Card:
    """The card a plan estimates work on: the rates file's device, else `DEFAULT_CARD`."""
    return card_for(rates.device if rates is not None else None)


def adapt_seconds(method: str, dataset: str, n: int, policy: str, backbone: str | None = None,
                  rates: Rates | None = None, pretrained: str = "") -> float:
    """Estimated adaptation GPU-seconds of `method` over the first `n` samples of `dataset` with view `policy`:
    measured (`rates`, seconds per sample) where it holds the backbone and method, else `ADAPT_COSTS` (its work on
    `plan_card(rates)` with the backbone's figures)."""
    k = (_table_size(dataset) or (0, DEMO_NUM_CLASSES))[1]
    cost, views, card = adapt_cost(method), views_per_image(policy), plan_card(rates)
    measured = rates.adapt(backbone, method, k) if rates is not None and backbone is not None else None
    figures = backbone_figures(backbone, pretrained) if backbone is not None else REFERENCE_FIGURES
    if measured is None:
        return cost.estimate(n, k, views, figures, card)
    pos = rates.position.get((backbone, rates.measured(backbone, method)))  # measured: `rates` holds the method
    if cost.solve and pos is not None:
        # one solve over the run, timed over every position of a run of `size` (mean position (size - 1) / 2): the
        # measured level, its work's growth from `size` to n on the plan's card
        size = max(1, round(2 * pos + 1))
        return size * measured * cost.estimate(n, k, views, figures, card) / cost.estimate(size, k, views, figures,
                                                                                           card)
    if cost.grows_with_stream and pos:
        # its cost per sample grows in proportion to the samples seen (ECALP's graph): the rate measured around
        # stream position `pos` scales to n (n + 1) / 2 positions in all, as its work does
        return measured / pos * n * (n + 1) / 2
    return n * measured


def price_bases(runs: Sequence["RunSpec"], rates: Rates | None = None) -> dict[str, list[str]]:
    """basis (`BASES`) -> the methods it priced, in the runs' order; a method priced one way on one backbone and
    another way on another is listed under each with the backbone, `tpt (RN50)`."""
    per_method: dict[str, dict[str, str]] = {}
    for r in runs:
        per_method.setdefault(r.method, {})[r.backbone] = price_basis(r.method, r.backbone, rates)
    out: dict[str, list[str]] = {b: [] for b in BASES}
    for method, per_backbone in per_method.items():
        if len(set(per_backbone.values())) == 1:
            out[next(iter(per_backbone.values()))].append(method)
        else:
            for backbone, basis in per_backbone.items():
                out[basis].append(f"{method} ({backbone})")
    return {b: v for b, v in out.items() if v}


def plan_title(runs: Sequence["RunSpec"], rates: Rates | None = None) -> str:
    """The plan table's title: how the encoding and, per method, the adaptation were priced (`price_bases`)."""
    card = plan_card(rates).name
    labels = {"measured": f"measured in {rates.source if rates else ''}",
              "estimated": f"estimated from their work on an {card}",
              "default": f"no cost entry, {DEFAULT_S_PER_SAMPLE} s a sample"}
    encoding = f"measured in {rates.source}" if rates is not None else "the planning rates of extract/sweep/cost.py"
    parts = [f"{labels[b]}: {', '.join(ms)}" for b, ms in price_bases(runs, rates).items()]
    return f"sweep plan (GPU-hours, an estimate; encoding: {encoding}; adaptation {'; '.join(parts) or 'none'})"


def cost_notes(runs: Sequence["RunSpec"]) -> list[str]:
    """One line per method whose price needs saying (none in the table, a cost that grows faster than its images) and
    per backbone whose architecture could not be counted for the work estimates."""
    notes = []
    for m in dict.fromkeys(r.method for r in runs):
        cost = ADAPT_COSTS.get(m)
        if cost is None:
            notes.append(f"{m}: no cost entry in extract/sweep/cost.py; priced at {DEFAULT_S_PER_SAMPLE} s a sample")
        elif cost.solve and cost.grows_with_stream:
            notes.append(f"{m}: one transductive solve over the run, whose search grows with the square of its "
                         "images (--limit caps it)")
        elif cost.grows_with_stream:
            notes.append(f"{m}: its cost per sample grows with the samples seen (or the set's size), so a run's "
                         "cost grows with the square of its images (--limit caps it)")
    for backbone, pretrained in dict.fromkeys((r.backbone, r.pretrained) for r in runs):
        if not backbone_figures(backbone, pretrained).counted:
            notes.append(f"{backbone}: its architecture could not be counted; methods' work is priced with "
                         "ViT-B-16's figures")
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
    each method's adaptation, priced with the measured `rates` where they cover it, else from its work."""
    r0 = runs[0]
    n = n_images(r0.dataset, r0.limit)
    views = views_per_image(r0.policy)
    enc = n * views * encode_seconds(r0.backbone, r0.policy, rates)
    adapt = sum(adapt_seconds(r.method, r.dataset, n, r.policy, r.backbone, rates, r.pretrained) for r in runs)
    return (overhead_seconds(r0.backbone, rates) + enc + adapt) / 3600.0
