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


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_an_unmeasured_method_is_priced_from_its_work_on_the_card(method):
    """Every registered method has a work entry (issue 35 item 12: no method priced from adapt steps timed on a CPU
    or from a seconds figure) and, without a measured rate, is priced from it on the default card (an H100) with
    ViT-B-16's counted figures, as docs/sweep.md writes the model out."""
    fig = cost.backbone_figures("ViT-B-16")
    assert method in cost.ADAPT_COSTS, f"give {method} a work entry in extract/sweep/cost.py (docs/sweep.md, " \
        "'The cost model')"
    entry = cost.ADAPT_COSTS[method]
    assert isinstance(entry.work, cost.Work)
    assert cost.price_basis(method, "ViT-B-16") == "estimated"
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


def test_a_method_without_a_work_entry_is_priced_at_the_default_and_named():
    """An entry is its work (`AdaptCost` takes nothing else); a registered method without one is priced at
    `DEFAULT_S_PER_SAMPLE` seconds a sample whatever the card, and the plan names it (the test above fails for
    it)."""
    with pytest.raises(TypeError):
        cost.AdaptCost()  # type: ignore[call-arg]
    run = RunSpec(RunOptions("no-entry", "dtd", backbone="ViT-B-16"), ExecOptions(), "single")
    assert cost.price_basis("no-entry", "ViT-B-16") == "default"
    assert cost.adapt_seconds("no-entry", "dtd", 1692, "single", "ViT-B-16") == pytest.approx(
        1692 * cost.DEFAULT_S_PER_SAMPLE, rel=4 * EPS, abs=0)
    assert "no cost entry, 0.03 s a sample: no-entry" in cost.plan_title([run])
    assert "no-entry: no cost entry in extract/sweep/cost.py; priced at 0.03 s a sample" in cost.cost_notes([run])
    assert work_seconds(cost.Work(launches={"N": 1}), 10, 1, 1, cost.REFERENCE_FIGURES) == pytest.approx(10 * 17.7e-6)


def _field_bound_s(k: int, fig, card) -> float:
    """Seconds a sample that no method but DiffTPT exceeds, on `card` at the model's rates: the envelope of the
    field's largest per-sample work (docs/sweep.md, "The cost model"): 8 TPT steps of text work over the K prompts
    (32 K text-encoder forwards; DynaPrompt and DART measured 6-8x TPT on the CPU), 4 encodings of the 64 views
    (DART 3.75), 20,000 kernel launches (the most counted: HisTPT's 13,053 at K = 1,000) and 0.1 s of host time
    (64 views generated in the main process: 64 ms)."""
    flops = 32 * k * fig.txt_flops + 4 * 64 * fig.img_flops
    return flops / (card.tensor_flops * cost.FLOP_EFFICIENCY) + 20_000 * cost.LAUNCH_S + 0.1


def test_the_field_grid_dry_run_prices_every_method_plausibly(tmp_path, monkeypatch, tiny_externals):
    """The dry run of the field's whole grid (`--methods all --datasets all --backbones ViT-B-16`, the second
    models' tiny stand-ins) prices every method from its work, within `_field_bound_s` a sample on every dataset;
    the transductive solves in minutes on ImageNet (issue 36: "in minutes, not hours"); DiffTPT the most expensive
    on every dataset, at least its UNet's 63 x 50 evaluations a sample at the card's whole fp16 datasheet rate."""
    monkeypatch.chdir(tmp_path)
    externals = [f"{m}.{k}={v}" for m, cls in REGISTRY.items() if cls.external_files
                 for k, v in tiny_externals.overrides(m).items()]
    args = ["run", "--dry-run", "--skip-data-check", "--methods", "all", "--datasets", "all", "--backbones",
            "ViT-B-16", "--out", "o", *(a for e in externals for a in ("--set", e))]
    real, captured = sweep.sweep_run, []  # the runs planned, and the plan printed: one dry run
    monkeypatch.setattr(sweep, "sweep_run", lambda runs, *a, **kw: captured.extend(runs) or real(runs, *a, **kw))
    res = CliRunner().invoke(sweep.app, args)
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    assert "adaptation estimated from their work on an H100: " in flat and "no cost entry" not in flat
    assert {r.method for r in captured} == set(REGISTRY) and {r.dataset for r in captured} == set(cost.TEST_SIZES)
    fig, card = cost.backbone_figures("ViT-B-16"), cost.CARDS["H100"]
    hours = {(r.method, r.dataset): cost.adapt_seconds(r.method, r.dataset, cost.n_images(r.dataset), r.policy,
                                                       r.backbone) / 3600 for r in captured}
    for (m, d), h in hours.items():
        n, k = cost.TEST_SIZES[d], cost.NUM_CLASSES[d]
        if m != "difftpt":
            assert 0 < h <= n * _field_bound_s(k, fig, card) / 3600, (m, d, h)
            assert h < hours[("difftpt", d)], (m, d)
    unet = 63 * 50 * sum(cost.SD_UNET_STEP_FLOPS.values())
    assert hours[("difftpt", "imagenet")] >= 50_000 * unet / card.tensor_flops / 3600
    for m in ("stata", "stata-online", "transclip", "zlap", "zlap-inductive"):
        assert hours[(m, "imagenet")] < 1 / 6, m
