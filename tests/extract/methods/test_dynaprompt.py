"""DynaPrompt (extract/methods/dynaprompt.py) on the tiny open_clip model, against a slow transcription of the
official online loop (DynaPrompt `dynap_classification.py`: `test_time_adapt_eval`, `test_time_tuning`;
`clip/custom_clip_lessctx.py`) written here from docs/methods.md, "DynaPrompt (`dynaprompt`)".
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.methods import REGISTRY, get_method
from extract.methods.base import HPARAMS_KEYS, IMAGENET_FAMILY
from extract.methods.dynaprompt import DynaPrompt, select_prompts

from tests.support.extract import interrupt_nth_write, make_json_dataset

NAMES = ("cat", "sea_lion", "Annual Crop Land", "dog", "a")
K = len(NAMES)
EPS32 = torch.finfo(torch.float32).eps
# the tiny text tower reduces over width 32: a unit feature may move by ~32 eps between two summation orders
FEAT_TOL = 32 * EPS32

pytestmark = pytest.mark.usefixtures("one_thread")


def zs_text(model) -> torch.Tensor:
    return model.encode_texts([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])


def stream(model, n: int, v: int = 64, seed: int = 0, noise: float = 0.6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    text = zs_text(model)
    y = torch.randint(0, K, (n,), generator=g)
    return F.normalize(text[y][:, None] + noise * torch.randn(n, v, text.shape[1], generator=g), dim=-1)


def make(model, dataset: str = "dtd", **changes) -> DynaPrompt:
    cfg = dataclasses.replace(DynaPrompt.default_config(dataset, "ViT-B-16"), **changes)
    return DynaPrompt(cfg, zs_text(model), model.logit_scale, backbone="tiny", dataset=dataset, text_encoder=model,
                      class_names=NAMES)


# ------------------------------------------------------------------------------------------ slow reference

def ref_encode(model, ctx: torch.Tensor) -> torch.Tensor:
    """open_clip's encode_text written out with the 4 context token embeddings replaced by `ctx`."""
    m = model.model
    tokens = model.tokenizer([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])
    x = m.token_embedding(tokens)
    x = torch.cat([x[:, :1], ctx[None].expand(K, -1, -1), x[:, 1 + ctx.shape[0]:]], dim=1)
    x = m.transformer(x + m.positional_embedding, attn_mask=m.attn_mask)
    x = m.ln_final(x)[torch.arange(K), tokens.argmax(-1)] @ m.text_projection
    return x / x.norm(dim=-1, keepdim=True)


def entropy(z: torch.Tensor) -> torch.Tensor:
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)


def avg_entropy(z: torch.Tensor) -> torch.Tensor:
    """The official `avg_entropy`: entropy of the mean softmax over dim 0."""
    log_p = z - z.logsumexp(-1, keepdim=True)
    avg = log_p.logsumexp(0) - np.log(z.shape[0])
    return -(avg * avg.exp()).sum(-1)


class RefDynaPrompt:
    """The official online loop, one sample at a time: a real `torch.optim.AdamW` over the whole (P, 4, W) context
    parameter, reset per sample with `load_state_dict`; every prompt encoded separately."""

    def __init__(self, model, n_prompts: int, init: torch.Tensor, lr: float = 5e-3) -> None:
        self.model, self.p, self.init = model, n_prompts, init
        self.ctx = torch.nn.Parameter(torch.zeros(n_prompts, *init.shape))
        self.order, self.use = list(range(n_prompts)), [0] * n_prompts
        self.opt = torch.optim.AdamW([self.ctx], lr=lr)
        self.opt_state = copy.deepcopy(self.opt.state_dict())
        self.scale = model.logit_scale

    def logits(self, feats: torch.Tensor, prompts) -> torch.Tensor:  # (V, n, K)
        return torch.stack([self.scale * feats @ ref_encode(self.model, self.init + self.ctx[j]).T for j in prompts],
                           dim=1)

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.use.count(0) == 0:
                j = self.order[0]
                self.use[j] = 0
                self.ctx[j] = self.ctx[j] * 0
        self.opt.load_state_dict(self.opt_state)
        out = self.logits(feats, range(self.p))  # (V, P, K)
        pred = out.detach()
        p_ent = entropy(pred).mean(0)
        plpd = (pred[0].max(-1).values[None] - pred[1:].max(-1).values).mean(0)
        ent_order = sorted(range(self.p), key=lambda j: -float(p_ent[j]))  # Python's sort is stable
        plpd_order = sorted(range(self.p), key=lambda j: -float(plpd[j]))
        r = ent_order.index(self.order[0])
        common = np.intersect1d(ent_order[min(r + 1, self.p - 1):], plpd_order[:r])
        sel = [ent_order[c] for c in common] + [ent_order[r]]
        for i in sel:
            self.order.remove(i)
            self.use[i] += 1
            self.order.append(i)
        out = out[:, sel]  # (V, n_sel, K)
        ents = entropy(out.detach()).mean(-1)
        views = [v for _, v in sorted((float(ents[v]), v) for v in range(len(feats)))][:int(len(feats) * 0.1)]
        loss = torch.stack([avg_entropy(out[views][:, j]) for j in range(len(sel))]).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            return self.logits(feats[:1], sel)[0].mean(0)


# ------------------------------------------------------------------------------------------ tests

def test_select_prompts_against_the_official_lines():
    """`select_prompts` vs a transcription with numpy's intersect1d, on random entropies with ties and every
    init position."""
    g = np.random.default_rng(0)
    for _ in range(300):
        p = int(g.integers(1, 13))
        ent = torch.tensor(g.choice([0.5, 1.0, 1.5, 2.0, 2.5], size=p))  # ties on purpose
        plpd = torch.tensor(g.normal(size=p))
        init = int(g.integers(0, p))
        ent_order = sorted(range(p), key=lambda j: -float(ent[j]))
        plpd_order = sorted(range(p), key=lambda j: -float(plpd[j]))
        r = ent_order.index(init)
        common = np.intersect1d(ent_order[min(r + 1, p - 1):], plpd_order[:r])
        expect = [ent_order[c] for c in common] + [init] if len(common) else [init]
        assert select_prompts(ent, plpd, init) == expect


@pytest.mark.parametrize("n_prompts,n", [(12, 16), (3, 12)])
def test_matches_the_official_loop(tiny_model, monkeypatch, n_prompts, n):
    """Rows, prompt order and use counts over a stream (3 prompts: the buffer fills after a few samples and the
    least recently used prompt is reset at every sample after that)."""
    import extract.methods.dynaprompt as module

    picked = []
    monkeypatch.setattr(module, "select_prompts", lambda *a: picked.append(select_prompts(*a)) or picked[-1])
    x = stream(tiny_model, n, seed=n_prompts)
    m = make(tiny_model, num_prompts=n_prompts)
    ref = RefDynaPrompt(tiny_model, n_prompts, m.prompts.ctx_init)
    scale = tiny_model.logit_scale
    resets = 0
    for i in range(n):
        resets += int(min(m.ctx_use) > 0)
        out = m.adapt(x[i:i + 1])[0]
        expect = ref(x[i])
        assert m.ctx_order == ref.order and m.ctx_use == ref.use, i
        # each sample's step moves the residuals by at most 2 FEAT_TOL of its effect (TPT's `tuned_tol`); a prompt
        # carries the rounding of every step it took, at most i + 1
        tol = (2 + 2 * (i + 1)) * FEAT_TOL * scale
        torch.testing.assert_close(out, expect, rtol=0, atol=tol)
        torch.testing.assert_close(m.residual, ref.ctx.detach(), rtol=0, atol=(i + 1) * 1e-6)
    assert resets > 0 and any(len(p) > 1 for p in picked), "the stream must reset prompts and select several"
    assert m.summary() == {"skipped_steps": 0, "loss_scale": None}


def test_chunked_equals_one_at_a_time_and_resume(tiny_model, tmp_path):
    """Samples run one at a time inside `adapt`, so any chunking gives the same rows bit for bit; the state after
    a prefix, saved and loaded into a fresh instance, continues exactly."""
    x = stream(tiny_model, 14, seed=5)
    whole = make(tiny_model, num_prompts=4).adapt(x)
    m = make(tiny_model, num_prompts=4)
    assert torch.equal(torch.cat([m.adapt(x[i:i + 3]) for i in range(0, 14, 3)]), whole)
    first = make(tiny_model, num_prompts=4)
    head = first.adapt(x[:6])
    torch.save(first.state_dict(), tmp_path / "s.pt")
    second = make(tiny_model, num_prompts=4)
    second.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert second.ctx_order == first.ctx_order and second.ctx_use == first.ctx_use
    assert torch.equal(torch.cat([head, second.adapt(x[6:])]), whole)
    with pytest.raises(ValueError, match="residuals of shape"):
        make(tiny_model, num_prompts=5).load_state_dict(first.state_dict())


def test_loss_scale_skips_non_finite_steps(tiny_model, monkeypatch):
    """The CUDA GradScaler bookkeeping, emulated on the CPU: a non-finite step is skipped (no update, no weight
    decay), halves the scale and is counted; the selection bookkeeping of that sample still happens."""
    x = stream(tiny_model, 4, seed=7)
    m = make(tiny_model, num_prompts=4)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", enabled=False))
    logits = m._logits
    calls = {"n": 0}

    def poisoned(feats, text):
        z = logits(feats, text)
        if torch.is_grad_enabled():  # the loss forward of sample 2 overflows
            calls["n"] += 1
            if calls["n"] == 2:
                z = z + float("nan")
        return z

    monkeypatch.setattr(m, "_logits", poisoned)
    m.adapt(x[:1])
    before = m.residual.clone()
    m.adapt(x[1:2])
    assert torch.equal(m.residual, before) and m.skipped_steps == 1
    assert m.loss_scale == {"scale": 500.0, "growth_tracker": 0} and m.ctx_use.count(1) == 2
    m.adapt(x[2:])
    assert m.loss_scale == {"scale": 500.0, "growth_tracker": 2}
    assert m.summary() == {"skipped_steps": 1, "loss_scale": 500.0}


def test_default_configs_and_errors(tiny_model):
    for ds in HPARAMS_KEYS:
        cfg = get_method("dynaprompt").default_config(ds, "RN50")
        assert (cfg.n_views, cfg.num_prompts, cfg.lr, cfg.weight_decay, cfg.tta_steps, cfg.selection_p) == (
            64, 12, 5e-3, 0.01, 1, 0.1)
        assert cfg.augmix == (ds not in IMAGENET_FAMILY) and cfg.amp and not cfg.episodic and cfg.reset_lru
    assert REGISTRY["dynaprompt"] is DynaPrompt
    with pytest.raises(ValueError, match="num_prompts"):
        make(tiny_model, num_prompts=0)
    with pytest.raises(ValueError, match="needs class_names"):
        DynaPrompt(DynaPrompt.default_config("dtd", "RN50"), zs_text(tiny_model), 1.0, backbone="b",
                   dataset="dtd", text_encoder=tiny_model)


def test_run_resumes_equal_to_an_uninterrupted_run(tmp_path, tiny_model, monkeypatch):
    """An interrupted run of the online buffer resumes by replaying the kept prefix (the runner's rule for online
    methods) and gives the uninterrupted rows bit for bit; the shards validate."""
    from extract.run import writer
    from extract.runner import run_extraction
    from schemas.shard import read_shard, validate_shard

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=4)  # 12 samples
    kw = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=tiny_model, progress=False,
              part_size=4, adapt_batch=2, chunk_size=5, batch_size=16,
              overrides={"num_prompts": "3"})
    full_paths = run_extraction("dynaprompt", "dtd", out=tmp_path / "full", **kw)
    assert len(full_paths) == 3 and all(validate_shard(p) == [] for p in full_paths)
    full = np.concatenate([read_shard(p).tta_logits for p in full_paths])
    cfg = read_shard(full_paths[0]).meta.method_config
    assert np.isfinite(full).all() and cfg["episodic"] is False and cfg["num_prompts"] == 3
    real_write = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_extraction("dynaprompt", "dtd", out=tmp_path / "r", **kw)
    monkeypatch.setattr(writer, "write_shard", real_write)
    resumed = np.concatenate([read_shard(p).tta_logits for p in run_extraction("dynaprompt", "dtd",
                                                                                out=tmp_path / "r", **kw)])
    np.testing.assert_array_equal(resumed, full)
    zs = np.concatenate([read_shard(p).zs_logits for p in full_paths])
    assert not np.allclose(full, zs)


def test_autocast_code_path_emulated_on_cpu(tiny_model, monkeypatch):
    """The CUDA path (autocast + loss scale) has no dtype mismatches: emulated with CPU bfloat16 autocast. Rows
    stay finite float32, every step is finite, and the predictions mostly agree with fp32 (bf16 is coarse)."""
    x = stream(tiny_model, 10, seed=11)
    ref = make(tiny_model, num_prompts=4).adapt(x)
    m = make(tiny_model, num_prompts=4)
    monkeypatch.setattr(m, "_use_amp", lambda device: True)
    monkeypatch.setattr(m, "_autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    out = m.adapt(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and m.residual.dtype == torch.float32
    assert m.summary() == {"skipped_steps": 0, "loss_scale": 1000.0}
    assert m.loss_scale == {"scale": 1000.0, "growth_tracker": 10}
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.7
