"""RLCF (extract/methods/rlcf.py, extract/run/reward.py) on the tiny open_clip model, against a slow transcription of
the official per-sample loop (RLCF `TPT/tpt_cls_rl.py:test_time_tuning`, `clip_reward.py:CLIPScore`,
`rewards_post_process`) written here from docs/methods.md, "RLCF: prompt tuning with a CLIP reward"."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.methods import get_method
from extract.methods.rlcf import RLCF, load_context, rlcf_loss

from tests.support.extract import make_json_dataset, make_tiny_model_dir

NAMES = ("cat", "sea_lion", "Annual Crop Land", "dog", "a")
K = len(NAMES)
DR = 24  # the reward model's feature width in the synthetic tests (not the policy's 16)
EPS32 = torch.finfo(torch.float32).eps
FEAT_TOL = 32 * EPS32  # a unit feature through the width-32 tiny tower (tests/support/tpt.py)

pytestmark = pytest.mark.usefixtures("one_thread")


def tuned_tol(scale: float, steps: int) -> float:
    """fp32 logit tolerance after `steps` AdamW steps (the argument of tests/support/tpt.py `tuned_tol`: the
    prediction's 2 FEAT_TOL·scale plus at most 2 FEAT_TOL·scale per step)."""
    return (2 + 2 * steps) * FEAT_TOL * scale


def zs_text(model) -> torch.Tensor:
    return model.encode_texts([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])


def stream(model, n: int, v: int = 64, seed: int = 0, noise: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, v, 16) policy features around the prototypes, and (n, v, DR) unrelated reward features."""
    g = torch.Generator().manual_seed(seed)
    text = zs_text(model)
    y = torch.randint(0, K, (n,), generator=g)
    pol = F.normalize(text[y][:, None] + noise * torch.randn(n, v, text.shape[1], generator=g), dim=-1)
    rew = F.normalize(torch.randn(n, v, DR, generator=g), dim=-1)
    return pol, rew


def reward_text(seed: int = 7) -> torch.Tensor:
    return F.normalize(torch.randn(K, DR, generator=torch.Generator().manual_seed(seed)), dim=-1)


def make(model, dataset: str = "dtd", reward=None, **changes) -> RLCF:
    cfg = dataclasses.replace(RLCF.default_config(dataset, "ViT-B-16"), **changes)
    m = RLCF(cfg, zs_text(model), model.logit_scale, backbone="tiny-clip", dataset=dataset, text_encoder=model,
             class_names=NAMES)
    if reward is not None:
        feats, text = reward
        m.attach_reward(text, lambda a, b: feats[a:b])
    return m


# ------------------------------------------------------------------------------------------ slow transcription

def ref_encode(model, ctx: torch.Tensor) -> torch.Tensor:
    """open_clip's CLIP.encode_text written out with the embeddings of tokens 1..4 replaced by `ctx`."""
    m = model.model
    tokens = model.tokenizer([f"a photo of a {n.replace('_', ' ')}." for n in NAMES])
    x = m.token_embedding(tokens)
    x = torch.cat([x[:, :1], ctx[None].expand(K, -1, -1), x[:, 1 + ctx.shape[0]:]], dim=1)
    x = m.transformer(x + m.positional_embedding, attn_mask=m.attn_mask)
    x = m.ln_final(x)[torch.arange(K), tokens.argmax(-1)] @ m.text_projection
    return x / x.norm(dim=-1, keepdim=True)


def ref_rlcf_sample(model, feats, rfeats, rtext, ctx0, *, steps: int, lr: float = 7e-3, wd: float = 5e-4,
                    k: int = 3, p: float = 0.1) -> torch.Tensor:
    """One sample as `tpt_cls_rl.py` runs it: a fresh AdamW, 64 views at step 0 and the 6 most confident later,
    top-k classes per view, CLIPScore rewards minus their per-view mean, mean of reward x CE; predict view 0."""
    scale = model.logit_scale
    ctx = torch.nn.Parameter(ctx0.clone())
    opt = torch.optim.AdamW([ctx], lr=lr, weight_decay=wd)
    sel = None
    for _ in range(steps):
        out = scale * feats @ ref_encode(model, ctx).T  # (V, K)
        if sel is None:
            z = out.detach()
            ent = [(float(-(z[v].softmax(-1) * z[v].log_softmax(-1)).sum()), v) for v in range(len(z))]
            sel = [v for _, v in sorted(ent)[:max(1, int(len(out) * p))]]
            img = rfeats[sel]  # `reward_model.set_image_features(inputs[selected_idx])`
        out = out[sel]
        idx = torch.topk(out.detach(), k, dim=-1).indices.flatten()  # view-major, as `index.flatten()`
        img_rep = torch.repeat_interleave(img, k, dim=0)
        score = torch.stack([2.5 * (rtext[int(c)] * img_rep[j]).sum() for j, c in enumerate(idx)])
        score = torch.maximum(score, torch.zeros_like(score)).reshape(len(sel), k)
        rewards = (score - score.mean(-1, keepdim=True)).flatten() if k > 1 else score.flatten()
        ce = F.cross_entropy(torch.repeat_interleave(out, k, dim=0), idx, reduction="none")
        loss = torch.mean(rewards.detach() * ce)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return scale * feats[0] @ ref_encode(model, ctx).T


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("dataset,k", [("dtd", 3), ("imagenet_a", 3), ("dtd", 1)])
def test_matches_official_loop(tiny_model, dataset, k):
    x, r = stream(tiny_model, 3, seed=1)
    rt = reward_text()
    m = make(tiny_model, dataset, reward=(r, rt), sample_k=k, lr=1e-3)
    assert m.config.tta_steps == (5 if dataset == "dtd" else 3) and m.config.augmix == (dataset == "dtd")
    out = m.adapt(x)
    ctx0 = m.prompts.ctx_init
    ref = torch.stack([ref_rlcf_sample(tiny_model, x[i], r[i], rt, ctx0, steps=m.config.tta_steps, k=k, lr=1e-3)
                       for i in range(3)])
    torch.testing.assert_close(out, ref, rtol=0, atol=tuned_tol(tiny_model.logit_scale, m.config.tta_steps))
    zs = tiny_model.logit_scale * x[:, 0] @ zs_text(tiny_model).T
    assert (out - zs).abs().max() > 1e-3  # the steps moved the prompt


def test_batched_and_chunked_equal_one_at_a_time(tiny_model):
    """The reward features are read at the method's stream position: any split of the stream reads the same rows."""
    x, r = stream(tiny_model, 7, seed=2)
    rt = reward_text()
    whole = make(tiny_model, reward=(r, rt)).adapt(x)
    m = make(tiny_model, reward=(r, rt), pass_budget=2 * K)  # two samples per tuning pass
    parts = torch.cat([m.adapt(x[i:i + 3]) for i in range(0, 7, 3)])
    tol = tuned_tol(tiny_model.logit_scale, 5)
    torch.testing.assert_close(parts, whole, rtol=0, atol=tol)
    one = make(tiny_model, reward=(r, rt), pass_budget=1)
    torch.testing.assert_close(torch.cat([one.adapt(x[i:i + 1]) for i in range(7)]), whole, rtol=0, atol=tol)
    # a resumed method (its n_seen restored) reads the reward rows of its own positions
    first = make(tiny_model, reward=(r, rt))
    head = first.adapt(x[:4])
    second = make(tiny_model, reward=(r, rt))
    second.load_state_dict(first.state_dict())
    torch.testing.assert_close(torch.cat([head, second.adapt(x[4:])]), whole, rtol=0, atol=tol)


def test_policy_as_its_own_reward_model(tiny_model):
    """reward_backbone=policy (TTA-VLM): the reward is the policy's own view features and prompt features."""
    x, _ = stream(tiny_model, 3, seed=3)
    own = make(tiny_model, reward_backbone="policy").adapt(x)
    attached = make(tiny_model, reward=(x, zs_text(tiny_model))).adapt(x)
    torch.testing.assert_close(own, attached, rtol=0, atol=tuned_tol(tiny_model.logit_scale, 5))
    with pytest.raises(ValueError, match="no reward model attached"):
        make(tiny_model).adapt(x)


def test_loss_by_hand():
    """One view, K = 3, top-2 classes {0, 1}: rewards 2.5·max(cos, 0), baseline their mean; CE per class."""
    z = torch.tensor([[[2.0, 1.0, -1.0]]])
    img = torch.tensor([[[1.0, 0.0]]])
    text = torch.tensor([[0.6, 0.8], [-0.6, 0.8], [0.0, 1.0]])
    r = torch.tensor([2.5 * 0.6, 0.0])  # class 1's negative cosine is clipped at 0
    r = r - r.mean()
    lse = torch.logsumexp(z[0, 0], 0)
    want = ((r[0] * (lse - 2.0)) + (r[1] * (lse - 1.0))) / 2
    torch.testing.assert_close(rlcf_loss(z, img, text, sample_k=2, weight=2.5)[0], want, rtol=0,
                               atol=4 * EPS32)
    # k = 1: no baseline (`rewards_post_process` needs several rewards)
    torch.testing.assert_close(rlcf_loss(z, img, text, sample_k=1, weight=2.5)[0], 1.5 * (lse - 2.0), rtol=0,
                               atol=4 * EPS32)


def test_context_file_formats_and_errors(tiny_model, tmp_path):
    from safetensors.torch import save_file

    ctx = 0.02 * torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    save_file({"ctx": ctx}, str(tmp_path / "ctx.safetensors"))
    torch.save({"state_dict": {"ctx": ctx, "token_prefix": torch.zeros(1)}, "epoch": 50}, tmp_path / "coop.pth")
    for f in ("ctx.safetensors", "coop.pth"):
        assert torch.equal(load_context(str(tmp_path / f), 4, 32), ctx)
    x, _ = stream(tiny_model, 2, seed=5)
    m = make(tiny_model, reward_backbone="policy", ctx_file=str(tmp_path / "coop.pth"), tta_steps=0)
    assert any("initial context from" in w for w in m.warnings)
    want = tiny_model.logit_scale * x[:, 0] @ ref_encode(tiny_model, ctx).T  # no step: the file's prompt
    torch.testing.assert_close(m.adapt(x), want, rtol=0, atol=2 * FEAT_TOL * tiny_model.logit_scale)
    with pytest.raises(ValueError, match=r"shape \(4, 32\), this model's prompt needs \(4, 16\)"):
        load_context(str(tmp_path / "ctx.safetensors"), 4, 16)
    import argparse  # a pickled object weights_only refuses (the official `args` of CoOp's logs, say)

    torch.save({"ctx": ctx, "args": argparse.Namespace(lr=1)}, tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match="not a readable"):
        load_context(str(tmp_path / "pickled.pt"), 4, 32)
    with pytest.raises(ValueError, match="no such file"):
        load_context(str(tmp_path / "nope.pt"), 4, 32)


def test_registered_with_official_defaults():
    cls = get_method("rlcf")
    cfg = cls.default_config("imagenet", "ViT-B-16")
    assert (cfg.lr, cfg.weight_decay, cfg.tta_steps, cfg.sample_k, cfg.selection_p, cfg.n_views) == \
        (7e-3, 5e-4, 3, 3, 0.1, 64)
    assert (cfg.reward_backbone, cfg.reward_pretrained, cfg.ctx_file, cfg.augmix) == ("ViT-L-14", "openai", "", False)


# ------------------------------------------------------------------------------------------ through the runner

def test_runner_encodes_the_reward_model_into_its_own_cache(tmp_path, tiny_model, tiny_model_dir):
    from extract.models import load_model
    from extract.runner import run_extraction
    from schemas.shard import read_shard

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=2)
    other = make_tiny_model_dir(tmp_path / "reward-model", seed=1)  # another model: its own feature cache
    reward = load_model(None, f"local-dir:{other}", "cpu")
    kw = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=tiny_model, limit=3, part_size=2,
              adapt_batch=2, chunk_size=4, batch_size=64, progress=False)
    # reward_backbone empty: the folder's model names itself (a name that disagrees with it is refused)
    paths = run_extraction("rlcf", "dtd", out=tmp_path / "out",
                           overrides={"reward_pretrained": f"local-dir:{other}", "reward_backbone": ""}, **kw)
    assert read_shard(paths[0]).meta.method_config["reward_pretrained"] == f"local-dir:{other}"
    rdir = tmp_path / "cache" / reward.fingerprint
    assert reward.fingerprint != tiny_model.fingerprint
    assert sorted(p.name for p in rdir.glob("*/seed=*/*") if p.is_dir()) == ["augmix", "view0"]
    # the same views as the policy's: the reward model's cached view 0 is its encoding of the policy's view 0
    from extract.cache import FeatureCache  # noqa: F401  (the layout is documented there)
    v0 = np.load(next(rdir.glob("*/seed=*/view0/chunk-00000.npy")))
    assert v0.shape == (3, 16) and np.allclose(np.linalg.norm(v0, axis=1), 1, atol=1e-5)


def test_missing_reward_model_fails_before_any_image(tmp_path, tiny_model, monkeypatch):
    from extract.run import encode
    from extract.run.options import RunError
    from extract.runner import run_extraction

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=2)

    def no_images(*a, **k):
        raise AssertionError("an image was read")

    monkeypatch.setattr(encode, "open_image", no_images)
    with pytest.raises(RunError, match=r"rlcf: reward model ViT-B-16/nope .*--set reward_backbone") as e:
        run_extraction("rlcf", "dtd", data_root=tmp_path / "data", out=tmp_path / "out", cache_dir=tmp_path / "c",
                       model=tiny_model, limit=2, progress=False,
                       overrides={"reward_backbone": "ViT-B-16", "reward_pretrained": "nope"})
    assert "\n" not in str(e.value)


# --- issue 32 item 5: the reward model's settings are named in its errors and checked before anything else ------

@pytest.fixture
def no_reward_weights(monkeypatch):
    """The default reward model's weights (ViT-L-14, openai) absent from this machine, the hub offline."""
    from extract import models

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_cached_tag_file", lambda cfg: (None, ["/nowhere/ViT-L-14.pt"]))


def _names_the_reward_settings(msg: str) -> None:
    assert "--set reward_pretrained=" in msg and "reward_backbone=policy" in msg
    assert "--pretrained" not in msg  # the policy's option, which would not help
    assert "\n" not in msg


def test_missing_reward_weights_name_its_own_settings_before_the_policy_loads(tmp_path, tiny_model_dir, monkeypatch,
                                                                              no_reward_weights):
    from extract import runner
    from extract.run.options import RunError
    from extract.runner import run_extraction

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=2)

    def no_policy(*a, **k):
        raise AssertionError("the policy model was loaded before the reward model was checked")

    monkeypatch.setattr(runner, "load_model", no_policy)
    with pytest.raises(RunError) as e:
        run_extraction("rlcf", "dtd", pretrained=f"local-dir:{tiny_model_dir}", data_root=tmp_path / "data",
                       out=tmp_path / "out", cache_dir=tmp_path / "c", limit=2, progress=False)
    msg = str(e.value)
    assert msg.startswith("rlcf: reward model ViT-L-14/openai") and "not on this machine" in msg
    _names_the_reward_settings(msg)


def test_reward_model_load_error_names_its_own_settings(tmp_path, tiny_model):
    """The error of `load_model` itself (a local-dir without weights), raised where the runner attaches it."""
    from extract.run.reward import REWARD_FLAGS
    from extract.models import ModelError, load_model

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "open_clip_config.json").write_text('{"model_cfg": {}}')
    with pytest.raises(ModelError) as e:
        load_model(None, f"local-dir:{empty}", "cpu", flags=REWARD_FLAGS)
    assert str(e.value).startswith(f"--set reward_pretrained=local-dir:{empty}: no weights file")


@pytest.mark.parametrize("extra, ok", [((), False), (("--set", "rlcf.reward_backbone=policy"), True),
                                       (("--set", "rlcf.reward_pretrained=local-dir:/no/such/dir"), False)])
def test_sweep_dry_run_checks_the_reward_model(tmp_path, no_reward_weights, extra, ok):
    from typer.testing import CliRunner

    from extract.sweep import cli as sweep

    res = CliRunner().invoke(sweep.app, ["run", "--methods", "rlcf,tda", "--datasets", "dtd", "--out",
                                         str(tmp_path / "out"), "--dry-run", "--skip-data-check", *extra])
    if ok:
        assert res.exit_code == 0, res.output
        return
    msg = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "rlcf: reward model ViT-L-14/" in msg
    _names_the_reward_settings(msg)
    assert "run(s) to submit" not in msg and not (tmp_path / "out").exists()
