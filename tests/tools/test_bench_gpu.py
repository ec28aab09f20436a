"""`make bench-gpu` (tools.bench_gpu): the CPU smoke run with a small model exercises every measurement, writes
a JSON that `zaec-sweep --rates` reads, and the ratios are the rates over the ceiling of the same run; without
CUDA the GPU run stops with one line."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from tools import bench_gpu
from extract.sweep.cost import load_rates

runner = CliRunner()
EPS64 = sys.float_info.epsilon


def test_cpu_smoke_run_writes_rates_the_sweep_reads(tmp_path):
    out = tmp_path / "rates.json"
    res = runner.invoke(bench_gpu.app, ["run", "--device", "cpu", "--tiny", "--backbones", "ViT-B-16", "--ks", "5,12",
                                        "--methods", "tps,zero-shot", "--images", "3", "--multi-view-images", "1",
                                        "--no-fixed-cost", "--seconds", "0.05", "--pass-budgets", "12,24",
                                        "--method-positions", "70,66", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    r = doc["backbones"]["ViT-B-16"]
    for key in ("encoder_images_per_s", "single_view_images_per_s", "crop_flip_views_per_s", "augmix_views_per_s",
                "augmix_chains_views_per_s"):
        assert r[key] > 0, key
    assert r["ratios"]["augmix_chains"] == r["augmix_chains_views_per_s"] / r["encoder_images_per_s"]
    assert r["augmix_chains_host_ms_per_sample"] > 0
    assert "AugMix chains" in res.output
    assert set(r["adapt_samples_per_s"]["tps"]) == {"5", "12"}
    # timed as runs adapt: the calls after the first of the runner's 64 (the warm-up), up to the positions asked
    detail = r["adapt_detail"]
    assert detail["tps"]["5"]["samples"] == 66 - 64 and detail["zero-shot"]["12"]["samples"] == 70 - 64
    assert detail["tps"]["12"]["mean_position"] == 64.5 and detail["tps"]["12"]["policy"] == "augmix"
    assert r["adapt_samples_per_s"]["tps"]["5"] == 1 / (detail["tps"]["5"]["seconds"] / 2)
    q = r["ratios"]
    # JSON round-trips floats exactly: the same float64 division is bit for bit the same; v·64/c against the
    # writer's v/(c/64) differs by its two roundings
    assert q["augmix"] == r["augmix_views_per_s"] / r["encoder_images_per_s"]
    assert q["adapt"]["tps"]["5"] == pytest.approx(r["adapt_samples_per_s"]["tps"]["5"] * 64
                                                   / r["encoder_images_per_s"], rel=4 * EPS64, abs=0)
    assert doc["views_per_core"]["augmix"] > 0 and doc["tiny"] is True
    by_budget = r["tpt_by_pass_budget"]
    assert by_budget["k"] == 12 and by_budget["24"]["samples_per_pass"] == 2 and by_budget["12"]["samples_per_s"] > 0
    rates = load_rates(str(out))
    assert rates.encode_s[("ViT-B-16", "augmix")] == 1 / r["augmix_views_per_s"]  # the same float64 division
    assert "encoder alone" in res.output


def test_probe_times_the_phases_of_a_process(tmp_path):
    from tools.bench_extract import write_image_set
    model_dir = bench_gpu.write_model_dir(tmp_path / "m", "ViT-B-16", tiny=True)
    root = write_image_set(tmp_path / "d", 2, size=(50, 40), ext="jpg")
    res = runner.invoke(bench_gpu.app, ["probe", str(model_dir), str(root), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    phases = json.loads(res.output.strip().splitlines()[-1])
    assert set(phases) == {"import_s", "weights_s", "prototypes_s", "loader_start_s"}
    assert all(v >= 0 for v in phases.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_one_line_and_exit_2():
    res = runner.invoke(bench_gpu.app, ["run"])
    assert res.exit_code == 2
    assert "needs a CUDA device" in res.stderr and "--device cpu --tiny" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output + res.stderr


def test_bad_class_counts_are_one_line():
    res = runner.invoke(bench_gpu.app, ["run", "--device", "cpu", "--tiny", "--ks", "a,b"])
    assert res.exit_code == 2 and "--ks and --pass-budgets expect comma-separated integers" in res.stderr


def test_loader_rates_of_make_bench_extract():
    """The loader line of `make bench-extract`: the runner's loader with worker processes and one thread doing the
    same items both deliver views (the values depend on the machine; only that they are measured is checked)."""
    from tools.bench_extract import loader_rates, view_rate
    many, one = loader_rates("crop_flip", 1, 3, size=32)
    assert many > 0 and one > 0
    assert view_rate("crop_flip", seconds=0.01, reference=True) > 0


def test_agreement_check_times_the_bench_and_two_runs(tmp_path):
    """`agree` prints, per method, the bench's rate, the marginal rate of two timed runs and their ratio (values
    depend on the machine: only that each is measured, and that the JSON holds them, is checked here)."""
    out = tmp_path / "agree.json"
    res = runner.invoke(bench_gpu.app, ["agree", "--methods", "zero-shot,ttl", "--ks", "3",
                                        "--method-positions", "66,66", "--tolerance", "1e9", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r["key"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"zero-shot", "ttl"} and rows["ttl"]["policy"] == "crop_flip"
    assert all(r["bench"] > 0 and r["run"] > 0 and r["whole"] > 0 and not r["skipped"] for r in rows.values())
    assert "bench rate vs timed runs" in res.output
