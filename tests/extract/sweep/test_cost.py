"""`extract.sweep.cost`: a method no GPU measured is priced from its work (FLOPs, bytes moved, kernel launches, host
seconds) on a card's figures, and the plan says per method whether its price is measured or estimated (issue 35,
item 12). The references are `tests/support/sweep.py`'s term-by-term transcription of docs/sweep.md."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch
from typer.testing import CliRunner

from extract.methods import REGISTRY
from extract.sweep import cli as sweep
from extract.sweep import cost
from extract.sweep.runspec import RunSpec
from extract.run.options import ExecOptions, RunOptions

from tests.support.sweep import H100, adapt_reference, work_seconds

EPS = sys.float_info.epsilon
#: an A100 (SXM4 80 GB) by its datasheet, as the rates file's device names it
A100 = {"tensor": 312e12, "fp32": 19.5e12, "bandwidth": 2039e9}


#: the 20 method keys registered when issue 35 item 12 was fixed (ECALP, DMN, BoostAdapter and others had been
#: priced from adapt steps timed on a CPU): each is priced from its work now
WORK_PRICED = ("zero-shot", "tda", "dpe", "dlae", "tpt", "ctpt", "otpt", "atpt", "tps", "zero", "mta", "onzeta",
               "ecalp", "dmn", "dmn-weak", "boostadapter", "rtpt", "dynaprompt", "rlcf", "ttl")


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_an_unmeasured_method_is_priced_from_its_entry_on_the_card(method):
    """Every registered method without a measured rate: its work on the default card (an H100) with ViT-B-16's
    counted figures, or its seconds figures, as docs/sweep.md writes them out."""
    fig = cost.backbone_figures("ViT-B-16")
    entry = cost.ADAPT_COSTS[method]
    if method in WORK_PRICED:
        assert entry.work is not None, f"{method} is priced from its work (docs/sweep.md, 'The cost model')"
    assert cost.price_basis(method, "ViT-B-16") == ("estimated" if entry.work is not None else "seconds")
    for dataset, policy, views in (("imagenet", "single", 1), ("dtd", "augmix", 64), ("eurosat", "crop_flip", 64)):
        n, k = cost.TEST_SIZES[dataset], cost.NUM_CLASSES[dataset]
        got = cost.adapt_seconds(method, dataset, n, policy, "ViT-B-16")
        # sums of a few dozen positive float64 terms, each a few roundings (the positions' sum in the reference is
        # exact in integers)
        assert got == pytest.approx(adapt_reference(entry, n, k, views, fig), rel=64 * EPS, abs=0)
        assert got > 0


def test_ecalp_on_imagenet_is_priced_in_minutes_not_hundreds_of_hours():
    """docs/benchmarks.md estimates minutes for ECALP's ImageNet stream on a GPU (memory-bound steps over its
    graph); its CPU timing, used as a GPU figure before, priced it at about 120 GPU-hours."""
    hours = cost.adapt_seconds("ecalp", "imagenet", 50000, "single", "ViT-B-16") / 3600
    assert 1 / 60 < hours < 1
    grid = sum(cost.adapt_seconds(m, d, cost.TEST_SIZES[d], "single", "ViT-B-16") for m in ("ecalp", "dmn", "boostadapter")
               for d in cost.TEST_SIZES) / 3600
    assert grid < 5  # the three methods priced from CPU steps, over the 15 sets: was 274 GPU-hours for ECALP alone


def test_the_work_of_a_growing_method_scales_with_the_positions():
    """A term in P (stream positions summed) makes the n-th sample cost n units: twice the stream, about four
    times the cost; the plan says so."""
    w = cost.AdaptCost(work=cost.Work(bytes={"P": 1e9}))
    one, two = (w.estimate(n, 10, 1) for n in (1000, 2000))
    assert two / one == pytest.approx(2000 * 2001 / (1000 * 1001), rel=8 * EPS, abs=0)
    assert w.grows_with_stream and cost.AdaptCost(work=cost.Work(flops={"N^2*D": 2})).grows_with_stream
    assert not cost.AdaptCost(work=cost.Work(flops={"N*K": 2})).grows_with_stream
    run = RunSpec(RunOptions("ecalp", "dtd", backbone="ViT-B-16"), ExecOptions(), "single")
    assert any(n.startswith("ecalp: its cost per sample grows") for n in cost.cost_notes([run]))


@pytest.mark.parametrize("terms,message", [
    ({"N**2": 1.0}, "work term 'N**2': '' is not SYMBOL or SYMBOL^POWER"),
    ({"Q": 1.0}, "'Q' is not SYMBOL"),
    ({"N^0": 1.0}, "'N^0' is not SYMBOL"),
    ({"N^-1": 1.0}, "'N^-1' is not SYMBOL"),
    ({"": 1.0}, "'' is not SYMBOL"),
    ({"n*K": 1.0}, "'n' is not SYMBOL"),
    ({"N": -1.0}, "expected a number >= 0, got -1.0"),
    ({"N": math.nan}, "expected a number >= 0, got nan"),
    ({"N": True}, "expected a number >= 0, got True"),
    ({"N": "3"}, "expected a number >= 0, got '3'"),
])
def test_a_work_term_that_is_not_one_is_refused_naming_it(terms, message):
    with pytest.raises(ValueError) as e:
        cost.Work(flops=terms)
    assert message in str(e.value)


@pytest.mark.parametrize("device,card", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"), ("NVIDIA A10", "A10"),
    ("NVIDIA L40S", "L40S"), ("Tesla V100-SXM2-32GB", "V100"), ("test", "H100"), ("", "H100"), (None, "H100"),
])
def test_the_card_is_the_one_the_device_names(device, card):
    assert cost.card_for(device).name == card


def test_backbone_figures_count_the_architecture_on_the_meta_device(tiny_model_dir):
    """The meta-device count equals the same count on the model built with real tensors (FLOPs of one view and of
    one prompt, parameters), attention in its plain matmuls (torch's FLOP counter does not see inside the CPU's
    fused attention kernel; the meta device runs the plain path); ViT-B-16's is the reference stand-in; an
    architecture open_clip does not know falls back to it, and the plan says so."""
    import open_clip
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = json.loads((tiny_model_dir / "open_clip_config.json").read_text())["model_cfg"]
    fig = cost.backbone_figures("tiny-clip", f"local-dir:{tiny_model_dir}")
    model = open_clip.CLIP(**cfg)
    size = cfg["vision_cfg"]["image_size"]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as img:
        model.encode_image(torch.zeros(1, 3, size, size))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as txt:
        model.encode_text(torch.zeros(1, cfg["text_cfg"]["context_length"], dtype=torch.long))
    assert img.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0) > 0  # attention counted
    n_img = sum(p.numel() for p in model.visual.parameters())
    assert fig == cost.BackboneFigures(cfg["embed_dim"], img.get_total_flops(), txt.get_total_flops(), n_img,
                                       sum(p.numel() for p in model.parameters()) - n_img)
    assert cost.backbone_figures("ViT-B-16") == dataclasses.replace(cost.REFERENCE_FIGURES, counted=True)
    assert not cost.backbone_figures("no-such-architecture").counted
    run = RunSpec(RunOptions("tda", "dtd", backbone="no-such-architecture"), ExecOptions(), "single")
    assert "no-such-architecture: its architecture could not be counted" in " ".join(cost.cost_notes([run]))


def _rates(path, device):
    doc = {"version": 1, "device": device, "backbones": {"ViT-B-16": {
        "single_view_images_per_s": 4000.0, "crop_flip_views_per_s": 5000.0, "augmix_views_per_s": 2000.0,
        "fixed_cost": {"process_s": 10.0}, "adapt_samples_per_s": {"tpt": {"47": 40.0, "1000": 2.0}}}}}
    path.write_text(json.dumps(doc))
    return path


def test_the_plan_title_says_per_method_whether_measured_or_estimated(tmp_path, monkeypatch):
    """With an A100's rates file measuring TPT on ViT-B-16: TPT there is measured; TPT on RN50 and TDA everywhere
    are estimated from their work on the A100 (the file's device), at the A100's figures."""
    monkeypatch.chdir(tmp_path)
    _rates(tmp_path / "r.json", "NVIDIA A100-SXM4-80GB")
    cost.load_rates.cache_clear()
    rates = cost.load_rates("r.json")
    runs = [RunSpec(RunOptions(m, "dtd", backbone=b), ExecOptions(), "augmix")
            for b in ("ViT-B-16", "RN50") for m in ("tpt", "tda")]
    assert cost.price_bases(runs, rates) == {"measured": ["tpt (ViT-B-16)"],
                                             "estimated": ["tpt (RN50)", "tda"]}
    title = cost.plan_title(runs, rates)
    assert "adaptation measured in r.json: tpt (ViT-B-16); estimated from their work on an A100: tpt (RN50), tda" \
        in title and "encoding: measured in r.json" in title
    fig = cost.backbone_figures("RN50")
    want = adapt_reference(cost.ADAPT_COSTS["tpt"], 1692, 47, 64, fig, A100)
    assert cost.adapt_seconds("tpt", "dtd", 1692, "augmix", "RN50", rates) == pytest.approx(want, rel=64 * EPS, abs=0)
    assert want != pytest.approx(adapt_reference(cost.ADAPT_COSTS["tpt"], 1692, 47, 64, fig, H100))
    res = CliRunner().invoke(sweep.app, ["run", "--methods", "tpt,tda", "--datasets", "dtd", "--backbones",
                                         "ViT-B-16,RN50", "--out", "o", "--rates", "r.json", "--dry-run",
                                         "--skip-data-check"])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    assert "measured in r.json: tpt (ViT-B-16)" in flat and "estimated from their work on an A100" in flat
    without = cost.plan_title(runs, None)
    assert "adaptation estimated from their work on an H100: tpt, tda" in without
    assert "no cost entry, 0.03 s a sample: no-entry" in cost.plan_title([dataclasses.replace(runs[0], options=
                                                                        dataclasses.replace(runs[0].options,
                                                                                            method="no-entry"))])


def test_a_seconds_figure_still_prices_a_method_without_work():
    """An entry given in seconds (the form before work terms) keeps its meaning: N (per_sample + per_class K) +
    (per_position + per_position_class K) N (N + 1) / 2, `multi_view` for 64 views; the plan says it is estimated in
    GPU-seconds."""
    c = cost.AdaptCost(0.01, per_class=1e-5, multi_view=0.02, per_position=1e-7, per_position_class=1e-9)
    for views in (1, 64):
        assert c.estimate(300, 47, views) == pytest.approx(adapt_reference(c, 300, 47, views, None), rel=16 * EPS,
                                                           abs=0)
    assert c.grows_with_stream and not cost.AdaptCost(0.01).grows_with_stream
    cost.ADAPT_COSTS["seconds-entry"] = c
    try:
        assert cost.price_basis("seconds-entry", "ViT-B-16") == "seconds"
        run = RunSpec(RunOptions("tda", "dtd", backbone="ViT-B-16"), ExecOptions(), "single")
        title = cost.plan_title([dataclasses.replace(run, options=dataclasses.replace(run.options,
                                                                                      method="seconds-entry"))])
        assert "adaptation estimated in GPU-seconds (extract/sweep/cost.py): seconds-entry" in title
    finally:
        del cost.ADAPT_COSTS["seconds-entry"]
    assert work_seconds(cost.Work(launches={"N": 1}), 10, 1, 1, cost.REFERENCE_FIGURES) == pytest.approx(10 * 17.7e-6)
