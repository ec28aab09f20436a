"""A-TPT (extract/methods/atpt.py): the angular-diversity term against a slow reference and the worked examples
of docs/methods.md, "A-TPT: angular diversity and its two signs", its sign options, per-sample batching, fp32 under
autocast, and the method end to end on the tiny open_clip model (the TPT-family properties shared with TPT are in
test_tpt.py, parametrised over the registry)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.methods import REGISTRY
from extract.methods.base import apply_overrides
from extract.methods.atpt import ATPT, ATPTConfig, angular_diversity
from extract.methods.base import HPARAMS_KEYS
from extract.methods.tpt import NATURAL_SHIFT

from tests.support.extract import make_json_dataset
from tests.support.tpt import FEAT_TOL, NAMES, make, ref_encode, ref_episodic, stream, tuned_tol

TAU = 0.99999
EPS32 = torch.finfo(torch.float32).eps


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (tests/support/extract.py)


def ref_ad(t: torch.Tensor, tau: float = TAU) -> torch.Tensor:
    """Slow and obvious: for each class, the largest cosine to any *other* class, clamped, arccos, averaged."""
    k = t.shape[0]
    unit = [t[i] / torch.sqrt((t[i] ** 2).sum()) for i in range(k)]
    angles = []
    for i in range(k):
        cos = [(unit[i] * unit[j]).sum() for j in range(k) if j != i]
        nearest = torch.stack(cos).max() if cos else torch.tensor(-1.0, dtype=t.dtype)  # K = 1: only the diagonal
        angles.append(torch.acos(nearest.clamp(-tau, tau)))
    return torch.stack(angles).mean()


def ad_tol(t: torch.Tensor, power: int = 1) -> float:
    """Tolerance of the angular diversity of rows `t` (power 1) or of its gradient (power 3) between two orders of
    summation: a cosine of width-w rows carries ~w eps (normalisation, dot product), arccos multiplies it by its
    slope 1/sin θ at the nearest angle, and the slope's own derivative cos θ / sin³ θ does so for the gradient. A
    pair at the clamp (cosine >= τ) is exact on both sides and does not count."""
    u = F.normalize(t.detach(), dim=-1)
    cos = u @ u.mT - 3 * torch.eye(t.shape[-2], dtype=t.dtype)  # the diagonal out of reach of the max
    nearest = cos.amax(-1)
    free = nearest[(nearest < TAU) & (nearest > -TAU)]
    sin_min = float(torch.sqrt(1 - free.double() ** 2).min()) if free.numel() else 1.0
    return 4 * t.shape[-1] * torch.finfo(t.dtype).eps / sin_min ** power


def unit2d(*angles: float, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([[math.cos(a), math.sin(a)] for a in angles], dtype=dtype)


# ------------------------------------------------------------------------------------------ the term itself

def test_spec_vectors():
    # unit vectors at 0, 0.3, 1.0 rad: nearest-neighbour angles (0.3, 0.3, 0.7), AD = 0.433333
    # (docs/methods.md, "A-TPT: angular diversity and its two signs")
    t = unit2d(0.0, 0.3, 1.0)
    # fp32: the example prints 6 decimals (±5e-7); arccos amplifies a cosine's rounding (a few eps) by 1/sin θ <= 3.4
    assert float(angular_diversity(t)) == pytest.approx(0.433333, abs=5e-7 + 16 * EPS32)
    t64 = unit2d(0.0, 0.3, 1.0, dtype=torch.float64)
    assert float(angular_diversity(t64)) == pytest.approx(1.3 / 3, abs=ad_tol(t64))
    # a duplicate of the first vector: its pair sits at the clamp, arccos(0.99999) = 0.004472 each, AD = 0.252237
    floor = math.acos(TAU)
    exact = (2 * floor + 0.3 + 0.7) / 4  # 0.2522361: the sum of the rounded terms is 0.252236
    assert exact == pytest.approx(0.252237, abs=1e-6)  # a first reading's rounding: one unit of its last digit
    dup = torch.cat([t, t[:1]])
    # fp32: τ rounds to fp32 by <= eps/4 (spacing eps/2 below 1) and arccos' slope there is 1/sin(0.0045) = 224, for
    # 2 of the 4 angles; the other two as above
    assert float(angular_diversity(dup)) == pytest.approx(exact, abs=2 / 4 * 224 * EPS32 / 4 + 16 * EPS32)
    dup64 = torch.cat([t64, t64[:1]])
    assert float(angular_diversity(dup64)) == pytest.approx(exact, abs=ad_tol(dup64))


@pytest.mark.parametrize("k", [1, 2, 5, 30])
def test_equals_slow_reference(k):
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        # unnormalised rows (the function normalises), clustered for odd seeds so that nearest pairs are close
        t = torch.randn(k, 12, generator=g, dtype=torch.float64) + 3 * (seed % 2)
        torch.testing.assert_close(angular_diversity(t), ref_ad(t), rtol=0, atol=ad_tol(t))
        stacked = torch.stack([t, t + torch.randn(k, 12, generator=g, dtype=torch.float64)])
        torch.testing.assert_close(angular_diversity(stacked), torch.stack([ref_ad(s) for s in stacked]),
                                   rtol=0, atol=ad_tol(stacked))


def test_gradient_equals_finite_differences_and_reference():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: angular_diversity(x), (t,))
    (got,) = torch.autograd.grad(angular_diversity(t), t)
    (want,) = torch.autograd.grad(ref_ad(t), t)
    torch.testing.assert_close(got, want, rtol=0, atol=ad_tol(t, power=3))


def test_duplicate_rows_are_inert():
    # rows 0 and 1 are the same class twice (ImageNet's "missile", "sunglasses"); rows 2 and 3 are each other's
    # nearest neighbour, so nothing else pulls on rows 0, 1: their gradient is exactly zero (clamp's mask)
    t = unit2d(0.0, 0.0, 1.0, 1.3, dtype=torch.float64).requires_grad_(True)
    (grad,) = torch.autograd.grad(angular_diversity(t), t)
    assert torch.equal(grad[:2], torch.zeros(2, 2, dtype=torch.float64))
    assert grad[2:].abs().sum() > 0 and torch.isfinite(grad).all()
    t32 = unit2d(0.0, 0.0, 1.0, 1.3).requires_grad_(True)
    (grad32,) = torch.autograd.grad(angular_diversity(t32), t32)
    assert torch.equal(grad32[:2], torch.zeros(2, 2)) and torch.isfinite(grad32).all()


def test_per_sample_never_mixes_samples():
    """G samples' features stacked: each AD and each gradient is the one of that sample alone. The second sample's
    classes lie right next to the first's, so a computation over the G·K stacked rows would differ."""
    a = unit2d(0.0, 0.3, 1.0, dtype=torch.float64)
    b = unit2d(0.01, 0.31, 1.01, dtype=torch.float64)
    stacked = torch.stack([a, b]).requires_grad_(True)
    got = angular_diversity(stacked)
    assert got.shape == (2,)
    torch.testing.assert_close(got, torch.stack([ref_ad(a), ref_ad(b)]), rtol=0, atol=ad_tol(stacked))
    mixed = ref_ad(torch.cat([a, b]))  # what mixing would give: every nearest neighbour at 0.01 rad
    assert abs(float(mixed) - float(got.detach().mean())) > 0.3
    (grad,) = torch.autograd.grad(got.sum(), stacked)
    for i, x in enumerate((a, b)):
        xi = x.clone().requires_grad_(True)
        (gi,) = torch.autograd.grad(ref_ad(xi), xi)
        torch.testing.assert_close(grad[i], gi, rtol=0, atol=ad_tol(x, power=3))


def test_float32_whatever_the_autocast_state():
    g = torch.Generator().manual_seed(1)
    t = F.normalize(torch.randn(7, 16, generator=g) + 2, dim=-1)
    plain = angular_diversity(t)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        under = angular_diversity(t)
    assert under.dtype == torch.float32 and torch.equal(under, plain)  # autocast is switched off inside
    # fp16 features (what an autocast forward hands over) are computed in fp32, not fp16
    half = t.half()
    out = angular_diversity(half)
    assert out.dtype == torch.float32 and torch.equal(out, angular_diversity(half.float()))
    # a duplicate pair keeps the fp32 floor arccos(τ) = 0.004472: in fp16, τ rounds to 1.0 and θ would be 0
    assert torch.tensor(TAU, dtype=torch.float16) == 1.0
    dup = torch.cat([half, half[:1]])
    floor = torch.acos(torch.tensor(TAU))
    k = dup.shape[0]
    sims = F.normalize(dup.float(), dim=-1) @ F.normalize(dup.float(), dim=-1).T
    sims = sims - 2 * torch.diag(torch.diag(sims))
    theta = torch.acos(sims.max(1).values.clamp(-TAU, TAU))
    # the duplicate's cosine clamps to the same fp32 τ on both sides: equal up to arccos' own last bits
    assert float(theta[0]) == pytest.approx(float(floor), rel=4 * EPS32, abs=0)
    torch.testing.assert_close(angular_diversity(dup), theta.sum() / k, rtol=0, atol=ad_tol(dup.float()))


# ------------------------------------------------------------------------------------------ configuration

def test_default_configs_follow_the_official_scripts():
    for ds in HPARAMS_KEYS:
        cfg = ATPT.default_config(ds, "ViT-B-16")
        shift = ds in NATURAL_SHIFT
        assert cfg.lambda_term == (10.0 if shift else 80.0)  # test_tpt_atpt_ds.sh / test_tpt_atpt_fg.sh
        assert cfg.script == ("ds" if shift else "fg")
        assert cfg.augmix == (ds != "imagenet")  # fg: len(set_id) > 1; ds: --I_augmix
        assert cfg.tau == TAU and cfg.sign == "paper" and cfg.direction == "expand"
        assert (cfg.n_views, cfg.lr, cfg.weight_decay, cfg.selection_p, cfg.tta_steps) == (64, 5e-3, 0.01, 0.1, 1)
        assert cfg.ctx_init == "a photo of a" and cfg.episodic and cfg.grad_scale_init == 1000.0
        assert ATPT.default_config(ds, "RN50") == cfg  # one λ per script, whatever the backbone
        head = apply_overrides(cfg, {"sign": "official_head"})
        assert head.direction == ("expand" if shift else "contract")
    assert REGISTRY["atpt"] is ATPT


def test_config_errors():
    cfg = ATPT.default_config("dtd", "ViT-B-16")
    with pytest.raises(ValueError, match="expected one of 'paper', 'official_head'"):
        apply_overrides(cfg, {"sign": "flipped"})
    with pytest.raises(ValueError, match="cannot be overridden"):
        apply_overrides(cfg, {"direction": "contract"})
    with pytest.raises(ValueError, match="tau=1.0 is out of range; valid: 0 < tau < 1"):
        apply_overrides(cfg, {"tau": "1.0"})
    moved = apply_overrides(cfg, {"script": "ds", "sign": "official_head", "lambda_term": "3"})
    assert (moved.direction, moved.lambda_term) == ("expand", 3.0)
    assert ATPTConfig(sign="official_head").direction == "contract"


# ------------------------------------------------------------------------------------------ the method

def test_lambda_zero_is_tpt_bit_for_bit(tiny_model):
    x = stream(tiny_model, 7, seed=6)
    want = make("tpt", tiny_model).adapt(x)
    for sign in ("paper", "official_head"):
        got = make("atpt", tiny_model, lambda_term=0.0, sign=sign).adapt(x)
        assert torch.equal(got, want)
    assert not torch.equal(make("atpt", tiny_model).adapt(x), want)  # the term does act at λ = 80
    # the term itself at λ = 0 adds nothing: forced through (the shortcut bypassed), the same logits up to the
    # rounding of a text-encoder backward whose input gradient has another memory layout (width 32)
    forced = make("atpt", tiny_model)
    forced._regulariser = lambda text: 0.0 * angular_diversity(text)
    # the forwards have the same shapes: only the one step's rounding counts (tuned_tol less its forward term)
    step_tol = tuned_tol(tiny_model.logit_scale, steps=1) - tuned_tol(tiny_model.logit_scale, steps=0)
    torch.testing.assert_close(forced.adapt(x), want, rtol=0, atol=step_tol)


@pytest.mark.parametrize("sign", ["paper", "official_head"])
def test_matches_slow_reference(tiny_model, sign):
    m = make("atpt", tiny_model, text_shortcuts=False, sign=sign)
    assert m.config.direction == ("expand" if sign == "paper" else "contract")  # dtd: the fg script
    lam = (-1.0 if sign == "paper" else 1.0) * m.config.lambda_term
    x = stream(tiny_model, 3, seed=1)
    out = m.adapt(x)
    for i in range(3):
        expect = ref_episodic(x[i], m.prompts.ctx_init, lambda c: ref_encode(tiny_model, NAMES, c),
                              tiny_model.logit_scale, lr=5e-3, reg=lambda t: lam * ref_ad(t))
        # as the TPT/C-TPT/O-TPT reference test (open_clip's encode_text path vs ours, fp32, one step); the term's
        # own rounding (fp32 cosines, arccos) enters through the same relative gradient error as the tower's
        torch.testing.assert_close(out[i], expect, rtol=0, atol=tuned_tol(tiny_model.logit_scale, steps=1))


@pytest.mark.parametrize("dataset,sign,grows", [("dtd", "paper", True), ("dtd", "official_head", False),
                                                 ("imagenet_a", "official_head", True)])
def test_sign_moves_the_angles_the_documented_way(tiny_model, dataset, sign, grows):
    # a tiny step dominated by the term (λ large, no decay): Adam's first step is about -lr·sign(∇), a descent step
    m = make("atpt", tiny_model, dataset=dataset, sign=sign, lambda_term=1e4, lr=1e-5, weight_decay=0.0)
    x = stream(tiny_model, 4, seed=7)
    init = m._init_param(4, x.device)
    tuned, _ = m.tune(x)
    with torch.no_grad():
        before = angular_diversity(m._class_features(init))
        after = angular_diversity(m._class_features(tuned))
    assert ((after > before) if grows else (after < before)).all(), (before, after)


def test_batched_tuning_equals_one_sample_at_a_time(tiny_model):
    x = stream(tiny_model, 9, seed=3)
    batched = make("atpt", tiny_model)
    assert batched._rows_per_pass() >= 9  # all nine in one pass
    one = make("atpt", tiny_model, pass_budget=1)
    params, sel = batched.tune(x)
    for i in range(9):
        p_i, s_i = one.tune(x[i:i + 1])
        assert torch.equal(sel[i], s_i[0])
        # the contexts differ only by the rounding of a batched vs a single fp32 text forward (width 32): the
        # decayed parameter is the same, the update moves by <= FEAT_TOL of lr (see tuned_tol), below FEAT_TOL·|p|
        torch.testing.assert_close(params[i], p_i[0], rtol=0, atol=FEAT_TOL * float(p_i.abs().max()))
    torch.testing.assert_close(batched.adapt(x), torch.cat([one.adapt(x[i:i + 1]) for i in range(9)]),
                               rtol=0, atol=tuned_tol(tiny_model.logit_scale, batched.config.tta_steps))


def test_shard_metadata_records_the_sign(tmp_path, tiny_model):
    from extract.runner import run_extraction
    from schemas.shard import read_shard

    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=1)
    recorded = {}
    for sign in ("paper", "official_head"):
        paths = run_extraction("atpt", "dtd", data_root=root, out=tmp_path / sign, cache_dir=tmp_path / "cache",
                               model=tiny_model, overrides={"sign": sign}, progress=False, batch_size=64)
        meta = read_shard(paths[0]).meta
        assert meta.method == "atpt"
        recorded[sign] = meta.method_config
    assert {k: recorded["paper"][k] for k in ("sign", "script", "direction", "lambda_term", "tau")} == {
        "sign": "paper", "script": "fg", "direction": "expand", "lambda_term": 80.0, "tau": TAU}
    assert (recorded["official_head"]["sign"], recorded["official_head"]["direction"]) == ("official_head", "contract")
    assert np.isfinite(read_shard(paths[0]).tta_logits).all()



def test_cli_runs_atpt_and_rejects_a_bad_sign(tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from extract.cli import app
    from schemas.shard import find_shards, read_shard

    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=2, per_class=1)
    base = ["--method", "atpt", "--dataset", "dtd", "--data-root", str(root), "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), "--pretrained", f"local-dir:{tiny_model_dir}", "--device", "cpu",
            "--quiet"]
    r = CliRunner().invoke(app, base + ["--set", "sign=official_head"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "out"])
    cfg = read_shard(path).meta.method_config
    assert (cfg["sign"], cfg["direction"], cfg["lambda_term"]) == ("official_head", "contract", 80.0)
    r = CliRunner().invoke(app, base + ["--set", "sign=up"], catch_exceptions=False)
    assert r.exit_code == 2 and "sign: expected one of 'paper', 'official_head', got 'up'" in r.output
    assert "Traceback" not in r.output


def test_mixed_precision_emulated_on_cpu_keeps_the_term_in_fp32(tiny_model):
    """The CUDA path (autocast fp16 + loss scale 1000) emulated with the CPU's fp16 autocast: the term is computed
    in fp32 from the fp16 text features, and its scaled gradient through the fp16 text forward stays finite (no
    step skipped) at the official λ = 80."""
    import contextlib

    @contextlib.contextmanager
    def fp16(device):
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            yield

    x = stream(tiny_model, 6, seed=5)
    for sign in ("paper", "official_head"):
        m = make("atpt", tiny_model, sign=sign)
        m._use_amp, m._autocast = (lambda device: True), fp16
        seen = []
        inner = m._regulariser

        def spy(text, inner=inner, seen=seen):
            out = inner(text)
            seen.append(out.dtype)
            return out

        m._regulariser = spy
        out = m.adapt(x)
        assert torch.isfinite(out).all() and seen == [torch.float32]
        assert m.loss_scale == {"scale": 1000.0, "growth_tracker": 6}
