"""HisTPT (extract/methods/histpt.py) on the tiny open_clip model, against a slow transcription of the reference
loop (TTABC `ttabc/model_selection/histpt.py`: `HistoricalMemory`, `generate_pseudo_labels`, `test_time_tuning`,
`test_time_adapt_eval`; the optimiser of `ttabc/utils/load_model.py:set_optimizer`) written here from
docs/methods.md, "HisTPT (`histpt`)"."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from extract.methods import REGISTRY, get_method
from extract.methods.base import HPARAMS_KEYS, IMAGENET_FAMILY
from extract.methods.histpt import HisTPT, fuse_pseudo_label, sgd_step

from tests.support.extract import interrupt_nth_write, make_json_dataset
from tests.support.tpt import FEAT_TOL, NAMES, K, ref_encode, ref_select, stream, zs_text

pytestmark = pytest.mark.usefixtures("one_thread")


def make(model, dataset: str = "dtd", **changes) -> HisTPT:
    cfg = dataclasses.replace(HisTPT.default_config(dataset, "ViT-B-16"), **changes)
    return HisTPT(cfg, zs_text(model), model.logit_scale, backbone="tiny", dataset=dataset, text_encoder=model,
                  class_names=NAMES)


# ------------------------------------------------------------------------------------------ slow reference

def entropy(z: torch.Tensor) -> torch.Tensor:
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)


class RefMemory:
    """TTABC's `HistoricalMemory`, line by line (top-k ties to the lower index: Python's stable sort)."""

    def __init__(self, size: int = 32, topk: int = 16, momentum: float = 0.99) -> None:
        self.size, self.topk, self.momentum = size, topk, momentum
        self.local = self.hist = self.hard = self.ema = None

    def update(self, text: torch.Tensor, e: torch.Tensor) -> None:
        if self.local is None:
            self.local = text.unsqueeze(0).repeat(self.size, 1, 1)
            self.hist = e.expand(self.size)
        else:
            self.local = torch.cat([text.unsqueeze(0), self.local[:-1]], dim=0)
            self.hist = torch.cat([e.unsqueeze(0), self.hist[:-1]], dim=0)
        if self.hard is None:
            self.hard = self.local.clone()
        else:
            order = sorted(range(self.size), key=lambda i: (-float(self.hist[i]), i))[:self.topk]
            self.hard = torch.cat([self.local[order].mean(dim=0).unsqueeze(0), self.hard[:-1]], dim=0)
        if self.ema is None:
            self.ema = text.clone()
        else:
            new = 0.5 * (self.local.mean(dim=0) + self.hard.mean(dim=0))
            self.ema = self.ema * self.momentum + new * (1 - self.momentum)

    def prompts(self, current: torch.Tensor) -> list[torch.Tensor]:
        def l2n(x):
            return x / x.norm(dim=-1, keepdim=True)

        return [current if m is None else l2n(m) for m in
                (self.ema, None if self.local is None else self.local.mean(0),
                 None if self.hard is None else self.hard.mean(0))]


class RefHisTPT:
    """The reference loop: one `torch.optim.SGD` for the run (never reset), soft pseudo-labels from the three
    memories, the memories updated after the step, the prediction from view 0."""

    def __init__(self, model, init: torch.Tensor, *, p: float = 0.1, soft: bool = True) -> None:
        self.model, self.scale, self.p, self.soft = model, model.logit_scale, p, soft
        self.ctx = torch.nn.Parameter(init.clone())
        self.opt = torch.optim.SGD([self.ctx], lr=5e-3, momentum=0.9, weight_decay=1e-4)
        self.memory = RefMemory()

    def text(self) -> torch.Tensor:
        return ref_encode(self.model, NAMES, self.ctx)

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        logits = self.scale * feats @ self.text().T  # model(images_aug)
        with torch.no_grad():
            per = [self.scale * feats[:1] @ t.T for t in self.memory.prompts(self.text())]
            ents = torch.stack([-entropy(z) for z in per], dim=1).softmax(dim=1)  # (1, 3)
            q = ents[:, 0:1] * per[0].softmax(1) + ents[:, 1:2] * per[1].softmax(1) + ents[:, 2:3] * per[2].softmax(1)
        if len(feats) > 1:
            logits = logits[ref_select(logits.detach(), self.p)]
        if self.soft:
            loss = torch.sum(-q.repeat(len(logits), 1) * logits.log_softmax(-1), dim=-1).mean()
        else:
            loss = torch.nn.functional.cross_entropy(logits, q.argmax(1).repeat(len(logits)))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.memory.update(self.text(), entropy(logits).mean())
            return self.scale * feats[0] @ self.text().T


# ------------------------------------------------------------------------------------------ tests

def test_sgd_step_equals_torch_sgd():
    """`sgd_step` is torch.optim.SGD (momentum, weight decay, first-step buffer) bit for bit over several steps."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(4, 8, generator=g)
    grads = [torch.randn(4, 8, generator=g) for _ in range(6)]
    for momentum, wd in ((0.9, 1e-4), (0.0, 0.0), (0.5, 0.1)):
        param = torch.nn.Parameter(p0.clone())
        opt = torch.optim.SGD([param], lr=5e-3, momentum=momentum, weight_decay=wd)
        mine, buf = p0.clone(), None
        for grad in grads:
            param.grad = grad.clone()
            opt.step()
            mine, buf = sgd_step(mine, grad, buf, lr=5e-3, momentum=momentum, weight_decay=wd)
            assert torch.equal(mine, param.detach())
        assert (buf is None) == (momentum == 0)


def test_memories_match_the_reference_with_entropy_ties():
    g = torch.Generator().manual_seed(1)
    m = make_memory_only()
    ref = RefMemory(size=5, topk=3, momentum=0.9)
    for i in range(12):
        text = torch.randn(K, 16, generator=g)
        e = torch.tensor([0.5, 1.0, 1.0, 2.0][i % 4], dtype=torch.float32)  # ties on purpose
        m.update_memories(text, e)
        ref.update(text, e)
        for mine, theirs in ((m.memory_local, ref.local), (m.memory_hard, ref.hard), (m.memory_global, ref.ema),
                             (m.entropy_history, ref.hist)):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def make_memory_only() -> HisTPT:
    """A HisTPT whose memories can be driven directly (no text encoder needed for `update_memories`)."""
    m = HisTPT.__new__(HisTPT)
    m.config = dataclasses.replace(HisTPT.default_config("dtd", "RN50"), memory_size=5, hard_topk=3,
                                   ema_momentum=0.9)
    m.memory_local = m.entropy_history = m.memory_hard = m.memory_global = None
    return m


def test_fuse_pseudo_label_weights_lower_entropy_higher():
    z = torch.tensor([[9.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    q = fuse_pseudo_label(z)
    w = torch.softmax(-entropy(z), 0)
    torch.testing.assert_close(q, (w[:, None] * z.softmax(-1)).sum(0))
    assert w.argmax() == 0 and abs(float(q.sum()) - 1) < 1e-6


@pytest.mark.parametrize("views,soft", [(1, True), (64, True), (1, False)])
def test_matches_the_reference_loop(tiny_model, views, soft):
    """Rows, context and memories over a stream long enough to fill and cycle the memories' first slots (16
    samples), one view (TTABC's default) and 64 views with TPT's selection (`tpt: True`); soft and hard
    pseudo-labels. With the full text sequences (`text_shortcuts=False`) the method runs the reference's operations
    in its order on the same shapes (the memory prompts' logits one product each, the fused label summed in
    order, the present prompt of an empty memory encoded without gradient), so the rows are equal bit for bit."""
    x = stream(tiny_model, 16, v=views, seed=views)
    m = make(tiny_model, n_views=views, soft_labels=soft, text_shortcuts=False)
    ref = RefHisTPT(tiny_model, m.prompts.ctx_init, soft=soft)
    for i in range(16):
        out = m.adapt(x[i:i + 1])[0]
        assert torch.equal(out, ref(x[i])), i
        assert torch.equal(m.ctx, ref.ctx.detach()), i
    assert torch.equal(m.memory_global, ref.memory.ema) and torch.equal(m.memory_hard, ref.memory.hard)
    assert not torch.allclose(m.ctx, m.prompts.ctx_init) and m.summary() == {"skipped_steps": 0, "loss_scale": None}


def test_shortcuts_equal_the_full_sequences(tiny_model):
    """The execution-only text shortcuts change the rows by rounding only. The tiny random text tower amplifies
    a change of its context strongly, and at the default lr the online context leaves the range where rounding
    stays rounding within a few samples; at lr 1e-4 each sample adds at most 2 FEAT_TOL·scale (TPT's `tuned_tol`)."""
    x = stream(tiny_model, 8, v=1, seed=3)
    a = make(tiny_model, lr=1e-4).adapt(x)
    b = make(tiny_model, lr=1e-4, text_shortcuts=False).adapt(x)
    torch.testing.assert_close(a, b, rtol=0, atol=(2 + 2 * 8) * FEAT_TOL * tiny_model.logit_scale)


def test_chunked_equals_one_at_a_time_and_resume(tiny_model, tmp_path):
    """Samples run one at a time inside `adapt`: any chunking gives the same rows bit for bit; the state after a
    prefix, saved and loaded into a fresh instance, continues exactly."""
    x = stream(tiny_model, 12, v=1, seed=5)
    whole = make(tiny_model).adapt(x)
    m = make(tiny_model)
    assert torch.equal(torch.cat([m.adapt(x[i:i + 5]) for i in range(0, 12, 5)]), whole)
    first = make(tiny_model)
    head = first.adapt(x[:7])
    torch.save(first.state_dict(), tmp_path / "s.pt")
    second = make(tiny_model)
    second.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(torch.cat([head, second.adapt(x[7:])]), whole)


def test_loss_scale_skips_non_finite_steps(tiny_model, monkeypatch):
    """The CUDA GradScaler bookkeeping, emulated on the CPU: a non-finite step is skipped (no SGD step, no
    momentum), halves the scale and is counted; the memories still take the sample."""
    x = stream(tiny_model, 4, v=1, seed=7)
    m = make(tiny_model)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", enabled=False))
    real = m._loss
    calls = {"n": 0}

    def poisoned(logits, target):
        calls["n"] += 1
        return real(logits, target) + (float("nan") if calls["n"] == 2 else 0.0)

    monkeypatch.setattr(m, "_loss", poisoned)
    m.adapt(x[:1])
    ctx, buf, hist = m.ctx.clone(), m.momentum_buffer.clone(), m.entropy_history.clone()
    m.adapt(x[1:2])
    assert torch.equal(m.ctx, ctx) and torch.equal(m.momentum_buffer, buf) and m.skipped_steps == 1
    assert not torch.equal(m.entropy_history, hist)  # the sample entered the memory (its entropy)
    assert m.loss_scale == {"scale": 500.0, "growth_tracker": 0}
    m.adapt(x[2:])
    assert m.summary() == {"skipped_steps": 1, "loss_scale": 500.0}


def test_autocast_code_path_emulated_on_cpu(tiny_model, monkeypatch):
    """The CUDA path (autocast + loss scale) has no dtype mismatches: emulated with CPU bfloat16 autocast (at a
    small lr, where the tiny tower's online context stays where bf16 rounding stays small)."""
    x = stream(tiny_model, 10, v=1, seed=11)
    ref = make(tiny_model, lr=1e-4).adapt(x)
    m = make(tiny_model, lr=1e-4)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    out = m.adapt(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and m.ctx.dtype == torch.float32
    assert m.memory_local.dtype == torch.float32 and m.loss_scale == {"scale": 1000.0, "growth_tracker": 10}
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.7


def test_no_steps_is_zero_shot(tiny_model):
    x = stream(tiny_model, 3, v=1, seed=2)
    m = make(tiny_model, tta_steps=0)
    torch.testing.assert_close(m.adapt(x), tiny_model.logit_scale * x[:, 0] @ zs_text(tiny_model).T,
                               rtol=0, atol=2 * FEAT_TOL * tiny_model.logit_scale)
    assert m.memory_local is None


def test_default_configs_and_errors(tiny_model):
    for ds in HPARAMS_KEYS:
        cfg = get_method("histpt").default_config(ds, "RN50")
        assert (cfg.n_views, cfg.lr, cfg.momentum, cfg.weight_decay, cfg.tta_steps) == (1, 5e-3, 0.9, 1e-4, 1)
        assert (cfg.memory_size, cfg.hard_topk, cfg.ema_momentum, cfg.soft_labels) == (32, 16, 0.99, True)
        assert cfg.augmix == (ds not in IMAGENET_FAMILY) and cfg.amp and not cfg.episodic
    assert REGISTRY["histpt"] is HisTPT
    with pytest.raises(ValueError, match="hard_topk"):
        make(tiny_model, memory_size=4, hard_topk=5)
    with pytest.raises(ValueError, match="needs class_names"):
        HisTPT(HisTPT.default_config("dtd", "RN50"), zs_text(tiny_model), 1.0, backbone="b", dataset="dtd",
               text_encoder=tiny_model)


def test_run_resumes_equal_to_an_uninterrupted_run(tmp_path, tiny_model, monkeypatch):
    """An interrupted run replays the kept prefix (the runner's rule for online methods) and gives the
    uninterrupted rows bit for bit."""
    from extract.run import writer
    from extract.runner import run_extraction
    from schemas.shard import read_shard, validate_shard

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=4)
    kw = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=tiny_model, progress=False,
              part_size=4, adapt_batch=2, chunk_size=5, batch_size=16, overrides={"memory_size": "4",
                                                                                   "hard_topk": "2"})
    full_paths = run_extraction("histpt", "dtd", out=tmp_path / "full", **kw)
    assert len(full_paths) == 3 and all(validate_shard(p) == [] for p in full_paths)
    full = np.concatenate([read_shard(p).tta_logits for p in full_paths])
    real_write = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_extraction("histpt", "dtd", out=tmp_path / "r", **kw)
    monkeypatch.setattr(writer, "write_shard", real_write)
    resumed = np.concatenate([read_shard(p).tta_logits for p in run_extraction("histpt", "dtd",
                                                                                out=tmp_path / "r", **kw)])
    np.testing.assert_array_equal(resumed, full)
    assert not np.allclose(full, np.concatenate([read_shard(p).zs_logits for p in full_paths]))
