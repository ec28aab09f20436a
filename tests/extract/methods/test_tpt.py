"""TPT, C-TPT, O-TPT and what every episodic tuner shares (extract/methods/tpt.py) on the tiny open_clip model,
against slow references written here and in tests/support/tpt.py from
docs/methods.md, "Confident-view selection and marginal entropy", "TPT: episodic prompt tuning", "C-TPT and O-TPT",
"Precision in the official code" (TPS's own tests are in test_tps.py, the prompt encoder's in
tests/extract/test_text_encoder.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.methods import REGISTRY, get_method
from extract.methods.base import apply_overrides
from extract.methods.base import HPARAMS_KEYS
from extract.methods.tpt import (
    CTPT,
    OTPT,
    TPT,
    AdamWState,
    EpisodicTuner,
    adamw_step,
    atfd,
    householder_orthogonality,
    select_confident,
)
from extract.methods.tps import TPS

from tests.support.extract import interrupt_nth_write, make_json_dataset
from tests.support.tpt import (
    FEAT_TOL,
    K,
    NAMES,
    make,
    ref_encode,
    ref_episodic,
    ref_marginal_entropy,
    ref_select,
    stream,
    tuned_tol,
    zs_text,
)

# every registered episodic tuner (TPT, C-TPT, O-TPT, A-TPT, TPS, and any added later)
# (those with a second model have their own files: RLCF's reward model, tests/extract/methods/test_rlcf.py;
# DiffTPT's generated views, test_difftpt.py)
EPISODIC = tuple(k for k, cls in REGISTRY.items() if issubclass(cls, EpisodicTuner) and not cls.external_files)
EPS64 = torch.finfo(torch.float64).eps


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (tests/support/extract.py)


# ------------------------------------------------------------------------------------------ slow references

def ref_mean_entropy(z: torch.Tensor) -> torch.Tensor:
    """R-TPT's loss: the mean of the views' own entropies."""
    p = z.softmax(-1)
    return -(p * p.log()).sum(-1).mean()


def ref_atfd(t: torch.Tensor) -> torch.Tensor:
    k = t.shape[0]
    mean = sum(t[c] for c in range(k)) / k
    return sum(torch.sqrt(((t[c] - mean) ** 2).sum()) for c in range(k)) / k


def ref_householder(t: torch.Tensor) -> torch.Tensor:
    """The official construction: K Householder matrices H_i = I - 2 v_i v_i^T, applied to the rows of M."""
    m = t @ t.T
    k = m.shape[0]
    eye = torch.eye(k, dtype=t.dtype)
    total = 0.0
    for i in range(k):
        n_i = torch.sqrt((m[:, i] ** 2).sum())  # column norm
        u = m[i] - n_i * eye[i]
        v = u / torch.sqrt((u ** 2).sum())
        h = eye - 2.0 * torch.outer(v, v)
        total = total + torch.sqrt(((h @ m[i] - eye[i]) ** 2).sum())
    return total / k


# ------------------------------------------------------------------------------------------ pure pieces

@pytest.mark.parametrize("n_views,expected", [(64, 6), (63, 6), (20, 2), (10, 1), (5, 1)])
def test_selection_keeps_int_np_lowest_entropy(n_views, expected):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        logits = 4 * torch.randn(n_views, 7, generator=g, dtype=torch.float64)
        sel = select_confident(logits, 0.1)
        assert sel.tolist() == ref_select(logits, 0.1) and len(sel) == expected
    batch = 4 * torch.randn(3, n_views, 7, generator=g, dtype=torch.float64)
    assert [s.tolist() for s in select_confident(batch, 0.1)] == [ref_select(b, 0.1) for b in batch]


@pytest.mark.parametrize("k", [2, 5, 30])
def test_regularisers_equal_slow_references(k):
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        t = F.normalize(torch.randn(k, 12, generator=g, dtype=torch.float64) + (seed % 2), dim=-1)
        tol = 4 * (k + 12) * EPS64  # float64 sums over the width 12 and over the k classes, values O(1)
        torch.testing.assert_close(atfd(t), ref_atfd(t), rtol=0, atol=tol)
        torch.testing.assert_close(householder_orthogonality(t), ref_householder(t), rtol=0, atol=tol)
        stacked = torch.stack([t, F.normalize(t + 1, dim=-1)])
        torch.testing.assert_close(householder_orthogonality(stacked),
                                   torch.stack([ref_householder(s) for s in stacked]), rtol=0, atol=tol)
        torch.testing.assert_close(atfd(stacked), torch.stack([ref_atfd(s) for s in stacked]), rtol=0, atol=tol)


def test_householder_penalty_properties():
    # H_i maps row i of M onto ‖M_i‖ e_i, so the penalty is mean_i (‖M_i‖ - 1): 0 only for orthonormal rows
    g = torch.Generator().manual_seed(0)
    t = F.normalize(torch.randn(6, 10, generator=g, dtype=torch.float64), dim=-1)
    m = t @ t.T
    # float64 sums over the width 10 and the 6 classes, values O(1)
    torch.testing.assert_close(householder_orthogonality(t), (m.norm(dim=1) - 1).mean(), rtol=0, atol=4 * 16 * EPS64)
    q = torch.linalg.qr(torch.randn(10, 4, generator=g, dtype=torch.float64)).Q.T  # orthonormal rows
    # QR's rows are orthonormal to ~n eps; the penalty sums over the width 10 and the 4 rows
    assert float(householder_orthogonality(q)) == pytest.approx(0.0, abs=4 * 14 * EPS64)
    assert torch.isnan(householder_orthogonality(torch.eye(4, 10, dtype=torch.float64)))  # u_i = 0 exactly: NaN
    same = F.normalize(torch.ones(3, 10, dtype=torch.float64), dim=-1)
    assert float(atfd(same)) == pytest.approx(0.0, abs=4 * 13 * EPS64)  # a mean of 3 equal rows, width 10


def test_stacked_adamw_equals_torch_adamw_per_row():
    g = torch.Generator().manual_seed(0)
    init = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    grads = [torch.randn(4, 3, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    masks = [torch.tensor([True, True, False, True]), torch.tensor([True, False, True, True]),
             torch.tensor([True, True, True, True])]
    kw = dict(lr=5e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p, state = init.clone(), AdamWState.zeros_like(init)
    for gr, mk in zip(grads, masks):
        p = adamw_step(p, gr, state, active=mk, **kw)
    for r in range(4):
        q = torch.nn.Parameter(init[r].clone())
        opt = torch.optim.AdamW([q], lr=5e-3, foreach=False)
        for gr, mk in zip(grads, masks):
            if mk[r]:  # a skipped step leaves parameter and optimiser state untouched (GradScaler)
                q.grad = gr[r].clone()
                opt.step()
        # float64, about ten roundings per step at |p| <= max|init| + 3 lr: three steps
        torch.testing.assert_close(p[r], q.detach(), rtol=0, atol=3 * 16 * EPS64 * float(init.abs().max() + 1))


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of the last place of `want` (its dtype's eps times |want|, floored at tiny)."""
    fi = torch.finfo(want.dtype)
    unit = fi.eps * want.double().abs().clamp_min(fi.tiny)
    return float(((got.double() - want.double()).abs() / unit).max())


@pytest.mark.parametrize("dtype,eps,foreach", [(torch.float32, 1e-8, False), (torch.float32, 1e-8, True),
                                               (torch.float16, 1e-3, False)])
def test_adamw_step_is_torch_adamw_over_steps(dtype, eps, foreach):
    """Eight steps on fp32 (TPT family) and fp16 parameters (moments in fp16, eps 1e-3 as the fp16 optimisers use):
    the bias corrections are formed in double as AdamW's Python floats (issue 31 item 1; in float32 0.999 became
    0.99900001 and each step was ~6.5e-6 relative smaller). Rows skip steps (a GradScaler skip), so rows are at
    different step counts. The same operations in the same order: a few ulps (rounding of the op order only)."""
    g = torch.Generator().manual_seed(1)
    rows, n_steps = 5, 8
    init = (0.02 * torch.randn(rows, 4, 32, generator=g)).to(dtype)
    # gradients over four decades, as entropy gradients of a prompt context are
    grads = [(torch.randn(rows, 4, 32, generator=g) * 10 ** torch.empty(rows, 1, 1).uniform_(-4, 0, generator=g))
             .to(dtype) for _ in range(n_steps)]
    masks = [torch.rand(rows, generator=g) > 0.25 for _ in range(n_steps)]
    kw = dict(lr=5e-3, betas=(0.9, 0.999), eps=eps, weight_decay=0.01)
    p, state = init.clone(), AdamWState.zeros_like(init)
    for gr, mk in zip(grads, masks):
        p = adamw_step(p, gr, state, active=mk, **kw)
    assert p.dtype == dtype and state.exp_avg.dtype == dtype and state.exp_avg_sq.dtype == dtype
    for r in range(rows):
        q = torch.nn.Parameter(init[r].clone())
        opt = torch.optim.AdamW([q], lr=5e-3, eps=eps, weight_decay=0.01, foreach=foreach)
        for gr, mk in zip(grads, masks):
            if mk[r]:
                q.grad = gr[r].clone()
                opt.step()
        if not any(bool(mk[r]) for mk in masks):
            continue
        st = opt.state[q]
        assert _ulps_apart(p[r], q.detach()) <= 2
        assert _ulps_apart(state.exp_avg[r], st["exp_avg"]) <= 2
        assert _ulps_apart(state.exp_avg_sq[r], st["exp_avg_sq"]) <= 2
        assert float(state.step[r]) == float(st["step"])


def test_adamw_step_bias_corrections_in_double():
    """Where the float32 bias corrections of the old step showed most: one step from zero moves each coordinate by
    lr·g/(|g| + eps·√(1-β₂)), whose float32 factor √(1-0.99900001) is off by 5e-6 relative."""
    g = torch.full((1, 3), 0.5)
    p = adamw_step(torch.zeros(1, 3), g, AdamWState.zeros_like(g), lr=5e-3, betas=(0.9, 0.999), eps=1e-8,
                   weight_decay=0.0)
    q = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([q], lr=5e-3, weight_decay=0.0)
    q.grad = g[0].clone()
    opt.step()
    assert _ulps_apart(p[0], q.detach()) <= 2


def test_stream_noise_follows_the_features_device():
    """tests/support/tpt.py's `stream` added CPU noise to CUDA text features (issue 31 item 6: the CUDA pass-sizing
    test never ran). The meta device stands in for CUDA: any device but the CPU's shows the mismatch."""

    class MetaModel:
        def encode_texts(self, names):
            return torch.zeros(len(names), 16, device="meta")

    x = stream(MetaModel(), 3, v=4)
    assert x.device.type == "meta" and tuple(x.shape) == (3, 4, 16)


def test_loss_scale_follows_grad_scaler_rule(tiny_model):
    m = make("tpt", tiny_model, grad_scale_growth_interval=3)
    pattern = [True, True, False, True, True, True, True, True, True, False]
    m._update_scale(torch.tensor(pattern))
    scale, tracker = 1000.0, 0  # GradScaler: backoff 0.5 on inf, x2 after `growth_interval` finite steps
    for ok in pattern:
        if not ok:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == 3:
                scale, tracker = scale * 2, 0
    assert m.loss_scale == {"scale": scale, "growth_tracker": tracker}
    assert m.state_dict()["loss_scale"] == m.loss_scale


# ------------------------------------------------------------------------------------------ the methods

@pytest.mark.parametrize("key", EPISODIC)
def test_zero_lr_or_zero_steps_reproduce_zero_shot(tiny_model, key):
    x = stream(tiny_model, 6)
    zs = tiny_model.logit_scale * x[:, 0] @ zs_text(tiny_model).T
    for changes in ({"lr": 0.0, "weight_decay": 0.0}, {"tta_steps": 0}):
        if key != "tps":
            changes = {**changes, "text_shortcuts": False}
        m = make(key, tiny_model, **changes)
        out = m.adapt(x)
        if type(m)._predict is not EpisodicTuner._predict:  # R-TPT: its own prediction (tested against a slow
            # reference in tests/extract/methods/test_rtpt.py), from the frozen zero-shot prototypes
            with torch.no_grad():
                zs = m._predict(x, zs_text(tiny_model).expand(len(x), -1, -1))
        # cosine logits: feature error FEAT_TOL plus a width-16 dot product, times the logit scale
        torch.testing.assert_close(out, zs, rtol=0, atol=2 * FEAT_TOL * tiny_model.logit_scale)
    # and the default step does change them
    assert (make(key, tiny_model).adapt(x) - zs).abs().max() > 1e-3


@pytest.mark.parametrize("key", EPISODIC)
def test_one_step_lowers_the_tuned_loss(tiny_model, key):
    # a small step: on the tiny random model the default 5e-3 is large next to token embeddings of scale 0.02,
    # and a first Adam step moves every coordinate by about lr whatever the gradient's size
    m = make(key, tiny_model, lr=1e-4)
    x = stream(tiny_model, 8, noise=0.8)
    init = m._init_param(8, x.device)
    tuned, sel = m.tune(x)

    def loss(param, with_reg):
        with torch.no_grad():
            text = m._class_features(param)
            z = m._logits(x, text)
            z = torch.gather(z, 1, sel[..., None].expand(-1, -1, K))
            ent = torch.stack([(ref_mean_entropy if key == "rtpt" else ref_marginal_entropy)(zi) for zi in z])
            reg = m._regulariser(text) if with_reg else None
            return ent if reg is None else ent + reg

    before, after = loss(init, True), loss(tuned, True)
    assert (after < before).all(), (before, after)
    if key in ("tpt", "tps", "rtpt"):  # the loss is the selected views' (marginal or mean) entropy itself
        assert (loss(tuned, False) < loss(init, False)).all()
    # the selection is the int(64 * 0.1) = 6 lowest-entropy views under the initial parameter
    with torch.no_grad():
        z0 = m._logits(x, m._class_features(init))
    assert [s.tolist() for s in sel] == [ref_select(zi, 0.1) for zi in z0]


@pytest.mark.parametrize("shortcuts", [False, True])
@pytest.mark.parametrize("key", ["tpt", "ctpt", "otpt"])
def test_tpt_family_matches_slow_reference(tiny_model, key, shortcuts):
    m = make(key, tiny_model, text_shortcuts=shortcuts)
    x = stream(tiny_model, 3, seed=1)
    out = m.adapt(x)
    lam = getattr(m.config, "lambda_term", 0.0)
    reg = {"tpt": None, "ctpt": lambda t: -lam * ref_atfd(t), "otpt": lambda t: lam * ref_householder(t)}[key]
    for i in range(3):
        expect = ref_episodic(x[i], m.prompts.ctx_init, lambda c: ref_encode(tiny_model, NAMES, c),
                              tiny_model.logit_scale, lr=5e-3, reg=reg)
        torch.testing.assert_close(out[i], expect, rtol=0, atol=tuned_tol(tiny_model.logit_scale, steps=1))


@pytest.mark.parametrize("shortcuts", [True, False])
def test_first_forward_shared_by_a_pass(tiny_model, monkeypatch, shortcuts):
    """With the text shortcuts, step 0 encodes the prompts once per pass (one context), then the prediction G;
    without them, G and G. The rows agree (the reference comparison is `test_tpt_family_matches_slow_reference`)."""
    m = make("tpt", tiny_model, text_shortcuts=shortcuts)
    rows = []
    features = m._class_features
    monkeypatch.setattr(m, "_class_features", lambda param: rows.append(param.shape[0]) or features(param))
    x = stream(tiny_model, 6, seed=9)
    out = m.adapt(x)
    assert rows == ([1, 6] if shortcuts else [6, 6])
    ref = make("tpt", tiny_model, text_shortcuts=not shortcuts).adapt(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=2 * FEAT_TOL * tiny_model.logit_scale)


@pytest.mark.parametrize("key", ["tpt", "otpt"])
def test_shared_first_forward_under_fp16_autocast(tiny_model, monkeypatch, key):
    """The shared forward (torch.func.vjp + vmap, `_Attention`) under fp16 autocast, emulated with the CPU's autocast
    (the CUDA run is `test_cuda_mixed_precision_close_to_fp32`): it runs, it is used, and with a zero step it gives
    the per-sample path's logits to fp16 rounding."""
    x = stream(tiny_model, 5, seed=10)
    outs = {}
    for shortcuts in (True, False):
        for lr in (0.0, 5e-3):
            m = make(key, tiny_model, text_shortcuts=shortcuts, lr=lr, weight_decay=0.01 if lr else 0.0)
            monkeypatch.setattr(m, "_use_amp", lambda device: True)
            monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", dtype=torch.float16))
            rows = []
            features = m._class_features
            monkeypatch.setattr(m, "_class_features", lambda param, f=features: rows.append(param.shape[0]) or f(param))
            outs[shortcuts, lr] = m.adapt(x)
            assert rows == ([1, 5] if shortcuts else [5, 5])
            assert m.loss_scale == {"scale": 1000.0, "growth_tracker": 5} and m.skipped_steps == 0
            assert outs[shortcuts, lr].dtype == torch.float32 and torch.isfinite(outs[shortcuts, lr]).all()
    ref = outs[False, 0.0]
    # fp16 text features (eps 2**-10, width 32): ~10 fp16 eps of the largest logit, as the CUDA test
    torch.testing.assert_close(outs[True, 0.0], ref, rtol=0, atol=0.01 * float(ref.abs().max()))
    assert (outs[True, 5e-3] - outs[True, 0.0]).abs().max() > 1e-3  # the step moved the logits


@pytest.mark.parametrize("key", EPISODIC)
def test_episodic_reset_order_and_batching_invariant(tiny_model, key):
    x = stream(tiny_model, 9, seed=3)
    whole = make(key, tiny_model).adapt(x)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(0))
    m = make(key, tiny_model, pass_budget=2 * K)  # two samples per tuning pass
    permuted = torch.cat([m.adapt(x[perm[i:i + 4]]) for i in range(0, 9, 4)])
    tol = tuned_tol(tiny_model.logit_scale, m.config.tta_steps)  # other batch shapes: other summation orders
    torch.testing.assert_close(permuted, whole[perm], rtol=0, atol=tol)
    one = make(key, tiny_model, pass_budget=1)
    torch.testing.assert_close(torch.cat([one.adapt(x[i:i + 1]) for i in range(9)]), whole, rtol=0, atol=tol)


def test_cpu_runs_fp32_without_loss_scaling(tiny_model):
    x = stream(tiny_model, 4)
    m_amp, m_fp32 = make("tpt", tiny_model, amp=True), make("tpt", tiny_model, amp=False)
    assert not m_amp._use_amp(torch.device("cpu"))
    assert m_amp._use_amp(torch.device("cuda"))  # autocast + loss scale only on CUDA
    assert torch.equal(m_amp.adapt(x), m_fp32.adapt(x))
    assert m_amp.loss_scale == {"scale": 1000.0, "growth_tracker": 0}  # untouched on the CPU


def emulate_loss_scaling(monkeypatch, m, x: torch.Tensor, overflows) -> None:
    """Run the CUDA loss-scale bookkeeping on the CPU (autocast itself needs a GPU): `overflows(i, scale)` says
    whether the tuning step of stream sample i (a row of `x`) overflows at the loss scale in force; such a step
    gets NaN logits, hence a non-finite loss and gradient, as an fp16 overflow would."""
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: contextlib.nullcontext())
    logits = m._logits

    def poisoned(feats, text):
        z = logits(feats, text)
        if not torch.is_grad_enabled():  # selection at tta_steps = 0 and the prediction
            return z
        ids = (feats[:, None, 0] == x[None, :, 0]).all(-1).float().argmax(1).tolist()  # which samples these are
        scale = float(m.loss_scale["scale"])
        bad = torch.tensor([overflows(i, scale) for i in ids])
        return z + torch.where(bad, float("nan"), 0.0)[:, None, None]

    monkeypatch.setattr(m, "_logits", poisoned)


def test_loss_scale_path_unscales_and_skips_non_finite_steps(tiny_model, monkeypatch):
    """Scaled gradients are unscaled; a sample whose step is not finite keeps its initial context (zero-shot logits)
    and halves the scale before the next sample."""
    x = stream(tiny_model, 3, seed=4)
    plain = make("tpt", tiny_model).adapt(x)
    m = make("tpt", tiny_model)
    emulate_loss_scaling(monkeypatch, m, x, lambda i, scale: False)
    # the loss scale 1000 is no power of two: scaling and unscaling round the gradient by ~eps, inside FEAT_TOL
    tol = tuned_tol(tiny_model.logit_scale, m.config.tta_steps)
    torch.testing.assert_close(m.adapt(x), plain, rtol=0, atol=tol)
    assert m.loss_scale == {"scale": 1000.0, "growth_tracker": 3}
    m = make("tpt", tiny_model)
    emulate_loss_scaling(monkeypatch, m, x, lambda i, scale: i == 1)
    out = m.adapt(x)
    zs = tiny_model.logit_scale * x[:, 0] @ zs_text(tiny_model).T
    # step skipped: the initial context through our encoder vs open_clip's encode_text, no step
    torch.testing.assert_close(out[1], zs[1], rtol=0, atol=tuned_tol(tiny_model.logit_scale, steps=0))
    torch.testing.assert_close(out[[0, 2]], plain[[0, 2]], rtol=0, atol=tol)
    assert m.loss_scale == {"scale": 500.0, "growth_tracker": 1}
    assert m.summary() == {"skipped_steps": 1, "loss_scale": 500.0}


def ref_grad_scaler(thresholds: list[float], steps: int, interval: int) -> tuple[list[int], float, int]:
    """The official loop's GradScaler over the stream, one sample (and step) at a time: step t of sample i
    overflows when the scale is >= thresholds[i]. Returns (skipped steps per sample, final scale, growth events)."""
    scale, tracker, skipped, growths = 1000.0, 0, [], 0
    for th in thresholds:
        n = 0
        for _ in range(steps):
            if scale >= th:
                scale, tracker, n = scale * 0.5, 0, n + 1
            else:
                tracker += 1
                if tracker == interval:
                    scale, tracker, growths = scale * 2.0, 0, growths + 1
        skipped.append(n)
    return skipped, scale, growths


@pytest.mark.parametrize("key,n,steps", [("tps", 120, 1), ("tps", 60, 2), ("tpt", 24, 1)])
def test_batched_tuning_follows_the_loss_scale_in_stream_order(tiny_model, monkeypatch, key, n, steps):
    """Default `pass_budget` (many samples per pass) == `pass_budget = K` (the official one-at-a-time loop) row for
    row under emulated fp16 overflows, skip count and final scale included (issue 10)."""
    x = stream(tiny_model, n, v=16, seed=7)
    g = np.random.default_rng(3)
    # thresholds around the scales the stream visits: overflows come in runs, the scale halves and grows back
    thresholds = g.choice([250.0, 500.0, 1000.0, 2000.0, 4000.0, float("inf")], size=n,
                          p=[0.05, 0.1, 0.1, 0.2, 0.25, 0.3]).tolist()
    skipped, final, growths = ref_grad_scaler(thresholds, steps, interval=3)
    assert sum(skipped) >= 5 and growths >= 5, "the stream must overflow and grow the scale several times"

    def run(**changes):
        m = make(key, tiny_model, n_views=16, tta_steps=steps, grad_scale_growth_interval=3, **changes)
        emulate_loss_scaling(monkeypatch, m, x, lambda i, scale: scale >= thresholds[i])
        out = torch.cat([m.adapt(x[i:i + 50]) for i in range(0, n, 50)])
        return out, m

    one, m_one = run(pass_budget=K)
    assert m_one.summary() == {"skipped_steps": sum(skipped), "loss_scale": final}
    batched, m_batched = run()
    assert m_batched._rows_per_pass() >= 50
    assert m_batched.summary() == m_one.summary() and m_batched.loss_scale == m_one.loss_scale
    # the same steps on other batch shapes; tuned_tol bounds what AdamW's normalisation does to their rounding
    torch.testing.assert_close(batched, one, rtol=0, atol=tuned_tol(tiny_model.logit_scale, steps))
    # a sample whose every step was skipped predicts with the initial parameter: its zero-shot logits
    with torch.no_grad():
        init = m_one._logits(x[:, :1], m_one._class_features(m_one._init_param(n, x.device)))[:, 0]
    all_skipped = torch.tensor([k == steps for k in skipped])
    # every step skipped leaves the parameter bit-identical; only the forward's batch shape differs
    torch.testing.assert_close(one[all_skipped], init[all_skipped], rtol=0, atol=tuned_tol(tiny_model.logit_scale, 0))
    assert (one[~all_skipped] - init[~all_skipped]).abs().amax(-1).median() > 1e-3  # the others adapted


def emulate_memory_sizing(monkeypatch, m, free: list[float], oom_at: int) -> list[int]:
    """Size the passes as on CUDA, on the CPU: the free memory reported before pass attempt j is `free[j % len]`,
    every pass measures 1 byte per sample, and attempt `oom_at` runs out of memory after it has tuned (after
    `_tune_in_order` moved the loss scale, which the retry must undo). Returns the pass sizes tried."""
    tried: list[int] = []
    monkeypatch.setattr(m, "_sized_by_memory", lambda device: True)
    monkeypatch.setattr(m, "_free_memory", lambda device: free[len(tried) % len(free)])

    @contextlib.contextmanager
    def measure(device, n):
        tried.append(n)
        yield
        m._pass_bytes = 1.0

    monkeypatch.setattr(m, "_measure_pass", measure)
    tune_in_order = m._tune_in_order

    def maybe_oom(feats):
        param = tune_in_order(feats)
        if len(tried) - 1 == oom_at:
            raise torch.cuda.OutOfMemoryError("emulated")
        return param

    monkeypatch.setattr(m, "_tune_in_order", maybe_oom)
    return tried


@pytest.mark.parametrize("key,steps", [("tpt", 1), ("tps", 2)])
def test_passes_sized_from_memory_follow_the_loss_scale(tiny_model, monkeypatch, key, steps):
    """Passes sized from (emulated) free GPU memory - a whole `adapt` call of 60 samples, 7, 1, and an
    out-of-memory retry with half - give the one-at-a-time rows, skip count and final scale under emulated fp16
    overflows (issue 13)."""
    n = 120
    x = stream(tiny_model, n, v=16, seed=8)
    g = np.random.default_rng(5)
    thresholds = g.choice([250.0, 500.0, 1000.0, 2000.0, 4000.0, float("inf")], size=n,
                          p=[0.05, 0.1, 0.1, 0.2, 0.25, 0.3]).tolist()
    skipped, final, growths = ref_grad_scaler(thresholds, steps, interval=3)
    assert sum(skipped) >= 5 and growths >= 3

    def run(memory: bool, **changes):
        m = make(key, tiny_model, n_views=16, tta_steps=steps, grad_scale_growth_interval=3, **changes)
        emulate_loss_scaling(monkeypatch, m, x, lambda i, scale: scale >= thresholds[i])
        # 0.7 of the free bytes at 1 byte per sample: 1, 7, 70 (all that is left), 42 samples
        tried = emulate_memory_sizing(monkeypatch, m, [1.5, 10.0, 100.0, 60.0], oom_at=2) if memory else []
        out = torch.cat([m.adapt(x[i:i + 60]) for i in range(0, n, 60)])
        return out, m, tried

    one, m_one, _ = run(False, pass_budget=K)
    assert m_one.summary() == {"skipped_steps": sum(skipped), "loss_scale": final}
    sized, m_sized, tried = run(True)
    # pass_budget first (all 60), then 7, then all that is left (out of memory), then at most half of that, then 1
    assert tried[:2] == [60, 7] and tried[2] >= 53 and m_sized._pass_cap == tried[2] // 2
    assert max(tried[3:]) == m_sized._pass_cap and 1 in tried[3:]
    assert m_sized.summary() == m_one.summary() and m_sized.loss_scale == m_one.loss_scale
    torch.testing.assert_close(sized, one, rtol=1e-5, atol=1e-5)


def test_pass_size_from_memory_and_config_checks(tiny_model, monkeypatch):
    m = make("tpt", tiny_model)
    cpu = torch.device("cpu")
    assert not m._sized_by_memory(cpu) and m._pass_size(cpu, 10**6) == 2048 // K  # the CPU keeps pass_budget
    assert make("tpt", tiny_model, pass_memory_fraction=0.0)._sized_by_memory(torch.device("cuda")) is False
    assert m._sized_by_memory(torch.device("cuda"))
    monkeypatch.setattr(m, "_sized_by_memory", lambda device: True)
    monkeypatch.setattr(m, "_free_memory", lambda device: 10_000)
    assert m._pass_size(cpu, 10**6) == 2048 // K  # nothing measured yet: the first pass uses pass_budget
    m._pass_bytes = 100.0
    assert m._pass_size(cpu, 10**6) == 70 and m._pass_size(cpu, 5) == 5  # 0.7 * 10,000 / 100, capped by what is left
    m._pass_bytes = 1e9
    assert m._pass_size(cpu, 10) == 1
    m._pass_bytes, m._pass_cap = 1.0, 33
    assert m._pass_size(cpu, 10**6) == 33
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="pass_memory_fraction"):
            make("tpt", tiny_model, pass_memory_fraction=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed precision runs only on CUDA")
@pytest.mark.parametrize("key", EPISODIC)
def test_cuda_mixed_precision_close_to_fp32(tiny_model_dir, key):
    from extract.models import load_model

    gpu = load_model(None, f"local-dir:{tiny_model_dir}", "cuda")
    cpu = load_model(None, f"local-dir:{tiny_model_dir}", "cpu")
    x = stream(cpu, 5, seed=5)
    # R-TPT runs fp32 by default (its official code has no autocast): its autocast path (TTA-VLM's reading) is
    # checked here; its weights depend on which self-similarities round to 1.0, which differs between the CPU and
    # CUDA kernels, so the diagonal is excluded outright
    extra = {"amp": True, "self_exclusion": "diagonal"} if key == "rtpt" else {}
    # with a zero step the fp16 text path must give the fp32 logits up to half-precision rounding
    ref = make(key, cpu, lr=0.0, weight_decay=0.0, **extra).adapt(x)
    still = make(key, gpu, lr=0.0, weight_decay=0.0, **extra).adapt(x.cuda())
    # fp16 text features (eps 2**-10, width 32): ~10 fp16 eps of the largest logit
    torch.testing.assert_close(still.cpu(), ref, rtol=0, atol=0.01 * float(ref.abs().max()))
    # Adam's first step is close to lr·sign(g), so fp16 gradients may move some coordinates differently: check the
    # bookkeeping (one finite scaled step per sample) and that the logits moved, not equality with fp32
    m = make(key, gpu, **extra)
    assert m._use_amp(torch.device("cuda"))
    out = m.adapt(x.cuda())
    assert out.dtype == torch.float32 and out.device.type == "cuda" and torch.isfinite(out).all()
    assert (out - still).abs().max() > 1e-3
    assert m.loss_scale == {"scale": 1000.0, "growth_tracker": 5}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pass sizing from GPU memory runs only on CUDA")
def test_cuda_passes_sized_from_free_memory(tiny_model_dir):
    from extract.models import load_model

    gpu = load_model(None, f"local-dir:{tiny_model_dir}", "cuda")
    x = stream(gpu, 12, seed=6).cuda()
    m = make("tpt", gpu, pass_budget=2 * K)  # first pass: 2 samples; then sized from the measured peak
    dev = x.device
    assert m._sized_by_memory(dev) and m._free_memory(dev) > 0
    out = m.adapt(x)
    assert m._pass_bytes is not None and m._pass_bytes > 0
    assert m._pass_size(dev, 10**6) > 2  # the tiny model: far more than pass_budget allows
    one = make("tpt", gpu, pass_budget=K, pass_memory_fraction=0.0)
    ref = torch.cat([one.adapt(x[i:i + 1]) for i in range(12)])
    # fp16 text features; other batch shapes may pick other kernels: ~10 fp16 eps of the largest logit
    torch.testing.assert_close(out, ref, rtol=0, atol=0.01 * float(ref.abs().max()))
    assert m.summary() == one.summary()


# ------------------------------------------------------------------------------------------ configs, errors

def test_default_configs_follow_the_spec():
    for ds in HPARAMS_KEYS:
        imagenet_family = ds in ("imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch")
        shift = imagenet_family and ds != "imagenet"
        tpt, ctpt, otpt, tps = (get_method(k).default_config(ds, "RN50") for k in ("tpt", "ctpt", "otpt", "tps"))
        assert (tpt.n_views, tpt.lr, tpt.selection_p, tpt.tta_steps, tpt.weight_decay) == (64, 5e-3, 0.1, 1, 0.01)
        assert tpt.augmix == (not imagenet_family) and tpt.ctx_init == "a photo of a" and tpt.prompts == "single"
        assert ctpt.augmix == otpt.augmix == (ds != "imagenet")
        assert ctpt.lambda_term == (20.0 if shift else 50.0)
        assert otpt.lambda_term == (2.0 if shift else 18.0)
        assert tps.lr == (5e-3 if imagenet_family else 1e-3) and tps.prompts == "imagenet80"
        assert tps.augmix == (not imagenet_family)
        assert all(c.episodic for c in (tpt, ctpt, otpt, tps))
    cfg = apply_overrides(CTPT.default_config("dtd", "RN50"), {"lambda_term": "7", "tta_steps": "2"})
    assert (cfg.lambda_term, cfg.tta_steps) == (7.0, 2)
    for fixed in ({"episodic": "false"}, {"prompts": "dataset"}, {"cupl": "true"}):
        with pytest.raises(ValueError, match="cannot be overridden"):
            apply_overrides(TPT.default_config("dtd", "RN50"), fixed)
    assert apply_overrides(TPS.default_config("dtd", "RN50"), {"prompts": "single"}).prompts == "single"
    with pytest.raises(ValueError, match="selection_p"):
        dataclasses.replace(TPT.default_config("dtd", "RN50"), selection_p=0.0)
    assert {"tpt", "ctpt", "otpt", "tps"} <= set(REGISTRY)
    assert REGISTRY["ctpt"] is CTPT and REGISTRY["otpt"] is OTPT and REGISTRY["tps"] is TPS


def test_methods_need_encoder_and_class_names(tiny_model):
    cfg = TPT.default_config("dtd", "RN50")
    with pytest.raises(ValueError, match="needs the text encoder"):
        TPT(cfg, zs_text(tiny_model), 1.0, backbone="b", dataset="dtd")
    with pytest.raises(ValueError, match="needs class_names"):
        TPT(cfg, zs_text(tiny_model), 1.0, backbone="b", dataset="dtd", text_encoder=tiny_model)
    with pytest.raises(ValueError, match="2 class names"):
        TPT(cfg, zs_text(tiny_model), 1.0, backbone="b", dataset="dtd", text_encoder=tiny_model,
            class_names=NAMES[:2])


# ------------------------------------------------------------------------------------------ end to end

@pytest.mark.parametrize("key", EPISODIC)
def test_run_extraction_writes_valid_shards(tmp_path_factory, tiny_model, key):
    from extract.runner import run_extraction
    from schemas.shard import read_shard, validate_shard

    shared = tmp_path_factory.getbasetemp() / "tpt-e2e"
    root = shared / "data"
    if not root.exists():
        make_json_dataset(root, "dtd", n_classes=3, per_class=2)
    out = tmp_path_factory.mktemp(f"out-{key}")
    paths = run_extraction(key, "dtd", data_root=root, out=out, cache_dir=shared / "cache", model=tiny_model,
                           limit=3, part_size=2, adapt_batch=2, chunk_size=4, batch_size=64, progress=False)
    assert len(paths) == 2 and all(validate_shard(p) == [] for p in paths)
    shards = [read_shard(p) for p in paths]
    tta = np.concatenate([s.tta_logits for s in shards])
    zs = np.concatenate([s.zs_logits for s in shards])
    assert tta.shape == (3, 3) and np.isfinite(tta).all()
    assert not np.allclose(tta, zs)  # adapted, and paired with the zero-shot anchor
    assert shards[0].meta.method_config["episodic"] is True
    assert np.abs(zs).max() <= tiny_model.logit_scale * 1.0001  # cosine logits


def test_resume_restores_the_loss_scale(tmp_path, tiny_model, monkeypatch):
    """A resumed episodic run equals an uninterrupted one under emulated fp16 overflows: the loss scale, its growth
    tracker and the skip count come back from the last kept part (issue 10)."""
    from extract.run import writer
    from extract.runner import run_extraction
    from schemas.shard import read_shard

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=6)  # 18 samples

    def overflows(feats: torch.Tensor, scale: float) -> torch.Tensor:
        """(G,) whether a sample's step overflows at `scale`: a threshold fixed by its features."""
        thresholds = torch.tensor([250.0, 1000.0, 2000.0, float("inf")])
        return scale >= thresholds[(feats[:, 0, :3].abs().sum(-1) * 1e4).long() % 4]

    logits = TPS._logits

    def poisoned(self, feats, text):
        z = logits(self, feats, text)
        if torch.is_grad_enabled():
            z = z + torch.where(overflows(feats, float(self.loss_scale["scale"])), float("nan"), 0.0)[:, None, None]
        return z

    monkeypatch.setattr(TPS, "_use_amp", lambda self, device: True)
    monkeypatch.setattr(TPS, "_autocast", lambda self, device: contextlib.nullcontext())
    monkeypatch.setattr(TPS, "_logits", poisoned)
    kw = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=tiny_model, progress=False,
              part_size=4, adapt_batch=2, chunk_size=5, batch_size=3,
              overrides={"n_views": "1", "grad_scale_growth_interval": "2"})

    def table(paths):
        shards = [read_shard(p) for p in paths]
        return np.concatenate([s.tta_logits for s in shards]), [s.meta.extra["zaec:method_state"] for s in shards]

    full_paths = run_extraction("tps", "dtd", out=tmp_path / "full", **kw)
    full, full_states = table(full_paths)
    states = [json.loads(st) for st in full_states]
    assert states[-1]["skipped_steps"] > 0
    # a scale history worth resuming: at the cut (after part 1) neither the scale nor the tracker is the initial one
    assert states[1]["loss_scale"] != {"scale": 1000.0, "growth_tracker": 0}
    assert len({json.dumps(st["loss_scale"]) for st in states}) > 2

    real_write = interrupt_nth_write(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run_extraction("tps", "dtd", out=tmp_path / "r", **kw)
    monkeypatch.setattr(writer, "write_shard", real_write)
    kept = {p: p.stat().st_mtime_ns for p in (tmp_path / "r").rglob("part-*.parquet")}
    assert len(kept) == 2
    resumed, resumed_states = table(run_extraction("tps", "dtd", out=tmp_path / "r", **kw))
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # the kept parts were not recomputed
    assert resumed_states == full_states
    np.testing.assert_array_equal(resumed, full)
    marker = json.loads(next((tmp_path / "r").rglob("_zaec_complete.json")).read_text())
    assert marker["method_summary"] == {"skipped_steps": states[-1]["skipped_steps"],
                                        "loss_scale": states[-1]["loss_scale"]["scale"]}
    # a kept part without its state (an older extractor) is recomputed, not resumed from a guess
    import dataclasses as dc

    from schemas.shard import write_shard

    last = sorted((tmp_path / "r").rglob("part-*.parquet"))
    sh = read_shard(last[1])
    extra = {k: v for k, v in sh.meta.extra.items() if k != "zaec:method_state"}
    write_shard(last[1], dc.replace(sh.meta, extra=extra), sh.sample_id, sh.label, sh.zs_logits, sh.tta_logits,
                stream_pos=sh.stream_pos)
    for q in last[2:]:
        q.unlink()
    next((tmp_path / "r").rglob("_zaec_complete.json")).unlink()
    before = last[0].stat().st_mtime_ns
    again, again_states = table(run_extraction("tps", "dtd", out=tmp_path / "r", **kw))
    assert last[0].stat().st_mtime_ns == before and again_states == full_states
    np.testing.assert_array_equal(again, full)
