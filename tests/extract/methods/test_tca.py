"""TCA (extract/methods/tca.py) on a small 10-block open_clip ViT, against a slow transcription of the official loop
written here from docs/methods.md, "TCA: token condensation inside the ViT, a reservoir of class tokens":
`runner.py` (`run_test_tca`, `update_reservoir_sim`, `compute_reservoir_logits`), `utils.py` (`get_clip_logits`,
`cls_feature_similarity`, `complement_idx`), `clip/model.py` (`ResidualAttentionBlock_Ours`, `Transformer_drop`,
`VisionTransformer.forward`, `CLIP.update_cls_token`) and `clip/utils.py` (`coreset_averaging`, `k_center_greedy`).

The transcription runs in the model's dtype where the official code runs fp16 (its `.half()` casts are the model's
precision; its float32 buffers and `.float()` distances hold fp16 exactly, so they are at least float32 here), so
that a float64 model makes every comparison exact up to a few ulps."""

from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.methods.tca import TCA, TCAConfig, complement, condense, coreset_average

from tests.support.tokens import LOGIT_SCALE, SIZE, deep_vit

K, D, DEPTH = 3, 16, 10
EPS64, EPS32 = torch.finfo(torch.float64).eps, torch.finfo(torch.float32).eps
# a logit through 10 blocks of width 32 and the reservoir's sums, at scale 37.5 plus lambda x (items <= 9)
TOL64 = 64 * DEPTH * 32 * EPS64 * (LOGIT_SCALE + 10 * 9) + 4 * EPS32 * (LOGIT_SCALE + 10 * 9)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return deep_vit(torch.float64)


@pytest.fixture(scope="module")
def stream(model):
    """K prototypes from the features of 3 images (so that every class is predicted and the context turns on), and
    24 images around them."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(K, 3, SIZE, SIZE, generator=g)
    text = F.normalize(model.model.encode_image(base.double()), dim=-1).float()
    pixels = base[torch.arange(24) % K] + 0.8 * torch.randn(24, 3, SIZE, SIZE, generator=g)
    return text, pixels[:, None]


def make(model, text, pixels, dataset="imagenet", **changes) -> TCA:
    cfg = dataclasses.replace(TCA.default_config(dataset, "ViT-B-16"), n_views=pixels.shape[1], **changes)
    m = TCA(cfg, text.to(model.model.visual.conv1.weight.dtype), model.logit_scale, backbone="tiny",
            dataset=dataset, text_encoder=model)
    m.attach_views(lambda a, b: pixels[a:b])
    return m


# ------------------------------------------------------------------------------------------ slow transcription

def ref_complement_idx(idx, dim):
    """`utils.py:complement_idx`."""
    a = torch.arange(dim, device=idx.device)
    ndim = idx.ndim
    dims = idx.shape
    n_idx = dims[-1]
    dims = dims[:-1] + (-1,)
    for _ in range(1, ndim):
        a = a.unsqueeze(0)
    a = a.expand(*dims)
    masked = torch.scatter(a, -1, idx, 0)
    compl, _ = torch.sort(masked, dim=-1, descending=False)
    compl = compl.permute(-1, *tuple(range(ndim - 1)))
    compl = compl[n_idx:].permute(*(tuple(range(1, ndim)) + (0,)))
    return compl


def ref_k_center_greedy(token, num_cluster, gen):
    n = token.shape[0]
    center = [torch.randint(n, (1,), generator=gen).item()]
    min_distances = torch.norm(token - token[center[0]], dim=1)
    for _ in range(num_cluster - 1):
        next_center = torch.argmax(min_distances).item()
        center.append(next_center)
        new_distances = torch.norm(token - token[next_center], dim=1)
        min_distances = torch.minimum(min_distances, new_distances)
    return torch.stack([token[i] for i in center])


def ref_coreset_averaging(token, num_centers, gen):
    """`clip/utils.py:coreset_averaging` on (n, B, C) tokens, LND."""
    batch_size, feature_dim = token.shape[1], token.shape[2]
    wide = torch.promote_types(token.dtype, torch.float32)
    weighted_tokens = torch.zeros(num_centers, batch_size, feature_dim, dtype=wide)
    for b in range(batch_size):
        token_batch = token[:, b, :]
        centers = ref_k_center_greedy(token_batch, num_centers, gen)
        distances = torch.cdist(token_batch.to(wide), centers.to(wide))
        cluster_assignment = torch.argmin(distances, dim=1)
        for i in range(num_centers):
            cluster_tokens = token_batch[cluster_assignment == i]
            if cluster_tokens.shape[0] == 0:
                continue
            token_distances = torch.norm(cluster_tokens - centers[i], dim=1)
            epsilon = 1e-8
            token_distances[token_distances == 0] = epsilon
            weights = 1 / token_distances
            weights[token_distances == epsilon] = 1.0
            weights = weights / weights.sum()
            weighted_tokens[i, b] = torch.sum(cluster_tokens * weights.unsqueeze(-1), dim=0)
    return weighted_tokens


def ref_block_ours(blk, x, drop_rate, cls_token_cache, gen, num_centers):
    """`ResidualAttentionBlock_Ours.forward` with drop_rate > 0 (x: (N, B, C), LND); torch's own multi-head
    attention with per-head weights (open_clip's block is batch first: transposed around it). The unused ranking
    positions are left out."""
    n_tok, b, c = x.shape

    def attention(z):
        out, w = blk.attn(z.transpose(0, 1), z.transpose(0, 1), z.transpose(0, 1), need_weights=True,
                          average_attn_weights=False)
        return out.transpose(0, 1), w

    left_tokens = math.ceil((1 - drop_rate) * (n_tok - 1))
    merged_tokens = n_tok - left_tokens
    if cls_token_cache is not None:
        max_token_cls = torch.argmax(F.cosine_similarity(cls_token_cache.unsqueeze(1), x[:1, :, :], dim=2), dim=0)
        tmp, attn_weights = attention(blk.ln_1(torch.cat((cls_token_cache[max_token_cls].unsqueeze(0), x), dim=0)))
        tmp, attn_weights = tmp[1:, :, :], attn_weights[:, :, 1:, 1:]
    else:
        tmp, attn_weights = attention(blk.ln_1(x))
    x = x + tmp
    cls_attn = attn_weights[:, :, 0, 1:].mean(dim=1)
    _, idx = torch.topk(cls_attn, (left_tokens - 2 * merged_tokens), dim=1, largest=True, sorted=True)
    _, idx1 = torch.topk(cls_attn, left_tokens, dim=1, largest=True, sorted=True)
    cluster_idx = idx1[:, idx.shape[1]:]
    non_cls = x[1:, :, :]
    x_others = torch.gather(non_cls, dim=0, index=idx.unsqueeze(-1).expand(-1, -1, c).permute(1, 0, 2))
    x_cluster = torch.gather(non_cls, dim=0, index=cluster_idx.unsqueeze(-1).expand(-1, -1, c).permute(1, 0, 2))
    merged = ref_coreset_averaging(x_cluster, num_centers, gen).to(x.dtype)
    compl = ref_complement_idx(idx1, n_tok - 1)
    non_topk = torch.gather(non_cls, dim=0, index=compl.unsqueeze(-1).expand(-1, -1, c).permute(1, 0, 2))
    non_topk_attn = torch.gather(cls_attn, dim=1, index=compl).permute(1, 0)
    extra_token = torch.sum(non_topk * non_topk_attn.unsqueeze(-1), dim=0, keepdim=True)
    x = torch.cat([x[:1, :, :], x_others, merged, extra_token], dim=0)
    return x + blk.mlp(blk.ln_2(x))


def ref_encode_image(visual, image, cls_token_cache, drop_rate, gen, num_centers, drop_loc=(3, 6, 9)):
    """`VisionTransformer.forward` + `Transformer_drop.forward`: (feature (1, D), cls_token_list (L, C))."""
    x = visual.conv1(image)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    x = torch.cat([visual.class_embedding + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype), x], dim=1)
    x = visual.ln_pre(x + visual.positional_embedding).permute(1, 0, 2)
    blocks = visual.transformer.resblocks
    cls_token_list = torch.zeros((len(blocks), x.shape[-1]), dtype=x.dtype)
    for i, blk in enumerate(blocks):
        if i in drop_loc:
            x = ref_block_ours(blk, x, drop_rate, cls_token_cache[:, i - 1, :] if cls_token_cache is not None
                               else None, gen, num_centers)
        else:
            x = blk(x.transpose(0, 1)).transpose(0, 1)
        cls_token_list[i, :] = x[0, 0, :]
    x = visual.ln_post(x.permute(1, 0, 2)[:, 0, :]) @ visual.proj
    return x, cls_token_list


def ref_cls_feature_similarity(cls_cache):
    features_tensor = torch.stack([torch.mean(f[2], dim=0) for f in cls_cache]).squeeze()
    norm = F.normalize(features_tensor, p=2, dim=1)
    sim = torch.mm(norm, norm.t())
    n = features_tensor.size(0)
    return [((sim[i, :].sum() - sim[i, i]) / (n - 1)).item() for i in range(n)]


def ref_run(model, pixels, text, cfg, n_classes):
    """`run_test_tca` over the stream (batch size 1): logits and the final reservoir."""
    visual, scale = model.model.visual, model.logit_scale
    clip_weights = text.T  # (D, K)
    gen = torch.Generator().manual_seed(cfg.coreset_seed)
    reservoir = {i: [] for i in range(n_classes)}
    cache = None
    weights = np.exp(np.linspace(0, 1, DEPTH) / cfg.scale)  # the official 12: ViT-B/16's blocks
    weights = torch.tensor(weights / sum(weights))
    rows = []
    for image in pixels:
        feats, cls_token_list = ref_encode_image(visual, image, cache, cfg.drop_rate, gen, cfg.n_centers)
        feats = feats / feats.norm(dim=-1, keepdim=True)
        clip_logits = scale * feats @ clip_weights
        loss = -(clip_logits.softmax(1) * clip_logits.log_softmax(1)).sum(1)
        pred = int(clip_logits.topk(1, 1, True, True)[1].t()[0])
        reservoir[pred].append([feats, loss, cls_token_list])  # `update_reservoir_sim`
        if len(reservoir[pred]) > cfg.reservoir_size:
            sim_score = ref_cls_feature_similarity(reservoir[pred])
            losses = [item[1].item() for item in reservoir[pred]]
            score = np.add(losses, sim_score).tolist()
            reservoir[pred].pop(torch.argmax(torch.tensor(score)).item())
        reservoir[pred] = sorted(reservoir[pred], key=operator.itemgetter(1))
        if all(len(reservoir[key]) > 1 for key in reservoir):  # `update_cls_token`
            cache = torch.stack([torch.mean(torch.stack([i[2] for i in reservoir[key]]), dim=0)
                                 for key in reservoir if reservoir[key] != []])
        keys, values = [], []  # `compute_reservoir_logits`
        for class_index in sorted(reservoir.keys()):
            for item in reservoir[class_index]:
                keys.append(item[2].unsqueeze(0))
                values.append(class_index)
        keys = torch.cat(keys, dim=0)
        values = F.one_hot(torch.tensor(values).to(torch.int64), num_classes=n_classes).to(text.dtype)
        affinity = (F.cosine_similarity(cls_token_list.unsqueeze(0), keys, dim=-1) * weights).sum(dim=1,
                                                                                                   keepdim=True)
        res = ((-1) * (cfg.beta - cfg.beta * affinity.to(text.dtype).permute(1, 0))).exp() @ values
        rows.append((clip_logits + cfg.lambd * res)[0])
    return torch.stack(rows), reservoir, cache


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("dataset,changes", [("imagenet", {}), ("dtd", {"reservoir_size": 2, "drop_rate": 0.2}),
                                             ("eurosat", {"n_centers": 3, "coreset_seed": 4})])
def test_matches_the_official_loop(model, stream, dataset, changes):
    text, pixels = stream
    m = make(model, text, pixels, dataset, **changes)
    out = m.adapt(torch.zeros(24, 1, D))  # the cached features are not read: TCA runs its own forward
    ref, reservoir, cache = ref_run(model, pixels[:, 0].double()[:, None], text.double(), m.config, K)
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=TOL64)
    assert cache is not None and m.summary()["context_tokens"]  # the context tokens were in use
    for c in range(K):
        n = m.res_counts[c]
        assert n == len(reservoir[c])
        got = m.res_tokens[c, :n]
        torch.testing.assert_close(got, torch.stack([item[2] for item in reservoir[c]]), rtol=0, atol=1e-9)
    torch.testing.assert_close(m._context, cache, rtol=0, atol=1e-9)


def test_condensed_token_counts(model, stream, monkeypatch):
    """65 tokens -> 50 -> 41 -> 32 at blocks 3, 6, 9 (drop rate 0.1, 4 centres): keep − 2m + 4 + 2 each."""
    import extract.methods.tca as tca_module

    text, pixels = stream
    seen = []

    def counting(x, *args):
        out = condense(x, *args)
        seen.append((x.shape[1], out.shape[1]))
        return out

    monkeypatch.setattr(tca_module, "condense", counting)
    make(model, text, pixels).adapt(torch.zeros(1, 1, D))
    assert seen == [(65, 50), (50, 41), (41, 32)]


def test_coreset_and_complement_by_hand():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(9, 5, generator=g, dtype=torch.float64)
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    got = coreset_average(tokens, 4, a)
    want = ref_coreset_averaging(tokens[:, None], 4, b)[:, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # two identical tokens and fewer tokens than centres: duplicated centres, empty clusters give zero tokens
    two = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    out = coreset_average(two, 4, torch.Generator().manual_seed(0))
    assert out.shape == (4, 2) and set(map(tuple, out[:2].tolist())) == {(1.0, 0.0), (0.0, 2.0)}
    assert torch.equal(out[2:], torch.zeros(2, 2))
    idx = torch.tensor([5, 0, 3])
    assert complement(idx, 7).tolist() == ref_complement_idx(idx[None], 7)[0].tolist() == [1, 2, 4, 6]
    x = torch.randn(1, 17, 8, generator=g)
    attn = torch.rand(1, 2, 16, generator=g)
    assert condense(x, attn, 0.1, 4, torch.Generator()).shape == (1, 17, 8)  # 15 kept - 2 x 2 + 4 + 2


def test_batched_calls_resume_and_state_equal_one_uninterrupted_stream(model, stream, tmp_path):
    text, pixels = stream
    whole = make(model, text, pixels).adapt(torch.zeros(24, 1, D))
    m = make(model, text, pixels)
    parts = [m.adapt(torch.zeros(n, 1, D)) for n in (5, 1, 7)]
    torch.save(m.state_dict(), tmp_path / "state.pt")
    again = make(model, text, pixels)
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert again.n_seen == 13 and again._context is not None
    rest = again.adapt(torch.zeros(11, 1, D))
    torch.testing.assert_close(torch.cat([*parts, rest]), whole, rtol=0, atol=0)


def test_layer_weights_and_settings(model, stream):
    text, pixels = stream
    m = make(model, text, pixels, scale=0.01)
    w = np.exp(np.linspace(0, 1, DEPTH) / 0.01)
    np.testing.assert_allclose(m.layer_weights.numpy(), w / w.sum(), rtol=1e-13)
    assert TCA.default_config("eurosat", "ViT-B-16").reservoir_size == 2
    assert (TCA.default_config("fgvc_aircraft", "ViT-B-16").scale, TCA.default_config("sun397", "x").beta) == (0.02, 3.0)
    assert TCA.default_config("dtd", "x").prompts == "clip_dataset"
    assert TCA.unseen_config("ViT-B-16").prompts == "imagenet80"
    assert TCAConfig(drop_layers=" 9, 3,6,3").layers() == (3, 6, 9)
    for bad in ("", "a,b", "3,-1"):
        with pytest.raises(ValueError, match="drop_layers"):
            TCAConfig(drop_layers=bad)
    with pytest.raises(ValueError, match=r"tca: drop_rate=0.4 leaves 39 of 64 patches at block 3, fewer than twice"):
        make(model, text, pixels, drop_rate=0.4)
    shallow = deep_vit(layers=5)
    m = make(shallow, text, pixels)
    assert m.drop == (3,) and m.warnings == ["tca on tiny: drop_layers 6,9 are beyond the model's 5 vision blocks; "
                                             "those are not condensed"]


def test_a_resnet_is_refused_in_one_line():
    from tests.support.tokens import tiny_rn

    with pytest.raises(ValueError, match=r"tca condenses the tokens of a ViT image encoder \(the official code runs "
                                         r"ViT-B/16 only\); tiny-rn has a ModifiedResNet image encoder") as e:
        TCA(TCA.default_config("dtd", "x"), torch.eye(K, D), 100.0, backbone="tiny-rn", dataset="dtd",
            text_encoder=tiny_rn())
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ through the run

@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    """A dtd-layout set of 3 classes x 4 images and a `local-dir:` folder of the 10-block ViT."""
    from tests.support.extract import make_json_dataset
    from tests.support.tokens import vit_cfg, write_model_dir

    root = tmp_path_factory.mktemp("tca-run")
    make_json_dataset(root / "data", "dtd", n_classes=3, per_class=4)
    return root / "data", write_model_dir(root / "vit", vit_cfg(), "tiny-deep-vit")


def test_resume_after_interruption_replays_the_prefix(tmp_path, run_inputs, monkeypatch):
    """Ctrl-C after the first part, then the same command: the online state is rebuilt by replaying the kept
    prefix's pixels through the same forward, and the shards equal an uninterrupted run's."""
    import numpy as np

    from extract.models import load_model
    from extract.run import writer as run_writer
    from extract.runner import run_extraction
    from schemas.shard import find_shards

    from tests.support.extract import interrupt_nth_write, shard_columns

    data, model_dir = run_inputs
    model = load_model(None, f"local-dir:{model_dir}", "cpu")
    args = dict(data_root=data, cache_dir=tmp_path / "cache", model=model, part_size=4, adapt_batch=2,
                progress=False)

    def rows(out):
        return shard_columns(find_shards([out]), ("stream_pos", "zs_logits", "tta_logits"))

    run_extraction("tca", "dtd", out=tmp_path / "full", **args)
    full = rows(tmp_path / "full")
    real = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_extraction("tca", "dtd", out=tmp_path / "r", **args)
    monkeypatch.setattr(run_writer, "write_shard", real)
    assert len(find_shards([tmp_path / "r"])) == 1
    run_extraction("tca", "dtd", out=tmp_path / "r", **args)
    resumed = rows(tmp_path / "r")
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])
    assert (full["tta_logits"] != full["zs_logits"]).any()


def test_zaec_extract_on_a_folder_set_and_a_resnet_refused(tmp_path, run_inputs):
    """`zaec-extract --method tca` on a user's folder set (ImageNet's row, the 80 templates); a ResNet is refused in
    one line, exit status 2, no shard written."""
    import numpy as np
    from typer.testing import CliRunner

    from extract.cli import app
    from schemas.shard import find_shards, read_shard

    from tests.support.extract import write_image
    from tests.support.tokens import rn_cfg, write_model_dir

    _, vit_dir = run_inputs
    rng = np.random.default_rng(1)
    for c in ("cat_a", "dog_b"):
        for i in range(3):
            write_image(tmp_path / "set" / c / f"{i}.png", rng)
    rn_dir = write_model_dir(tmp_path / "rn", rn_cfg(), "tiny-rn")

    def invoke(model_dir, out):
        return CliRunner().invoke(app, ["--method", "tca", "--dataset", f"folder:{tmp_path / 'set'}", "--out",
                                        str(out), "--cache-dir", str(tmp_path / "cache"), "--pretrained",
                                        f"local-dir:{model_dir}", "--device", "cpu", "--quiet"],
                                  catch_exceptions=False)

    r = invoke(vit_dir, tmp_path / "a")
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "a"])
    s = read_shard(path)
    assert len(s) == 6 and s.meta.method_config["prompts"] == "imagenet80" and s.meta.method_config["lambd"] == 3.0
    r = invoke(rn_dir, tmp_path / "b")
    # refused by TCA's `towers` before the model loads (the loaded-model check above stays as the last guard)
    assert r.exit_code == 2 and "it runs on an image tower that is a ViT pooled at its class token" in r.output
    assert "tiny-rn's is a ResNet" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not list((tmp_path / "b").rglob("*.parquet"))


def test_reduced_precision_path_emulated_on_cpu(stream):
    """As CALIP's: CPU bfloat16 autocast around the call stands in for CUDA's fp16 autocast of the forward. The
    rows are finite float32 and the reservoir fills as in fp32 (the predictions themselves may part: this stream's
    classes are close, and an online method carries a changed prediction on)."""
    text, pixels = stream
    model = deep_vit()
    m = make(model, text, pixels[:12])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m.adapt(torch.zeros(12, 1, D))
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert m.res_tokens.dtype == torch.float32 and sum(m.res_counts) >= K
