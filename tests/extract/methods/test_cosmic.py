"""COSMIC (extract.methods.cosmic) against a slow transcription of the official loop (`hf618/COSMIC @34fde07`:
`cosmic_main.py` `direct_inference`, `utils/DualMems.py` `DualMem`, `utils/utils_cosmic.py`), with DINOv2 features
from a tiny random timm ViT of DINOv2's architecture (tools/second_models.py `write_dino_dir`), loaded as the runner
loads the real one (extract/timm_encoder.py)."""

from __future__ import annotations

import dataclasses
import math
import operator

import networkx as nx
import pytest
import torch
import torch.nn.functional as F

from extract.methods.cosmic import COSMIC

from tests.support.online import clustered_views, prototypes

pytestmark = pytest.mark.usefixtures("one_thread")
K, D, U = 5, 16, 8
EPS32 = torch.finfo(torch.float32).eps


# ------------------------------------------------------------------------------------ the official loop, transcribed

def select_confident_samples(prob, top):
    batch_entropy = -(prob * torch.log(prob + 1e-6)).sum(1)
    n_select = max(1, int(batch_entropy.size()[0] * top))
    idx = torch.argsort(batch_entropy, descending=False, stable=True)[:n_select]
    return prob[idx], idx


def avg_entropy(outputs):
    logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
    avg_logits = logits.logsumexp(dim=0) - math.log(logits.shape[0])
    avg_logits = torch.clamp(avg_logits, min=torch.finfo(avg_logits.dtype).min)
    return -(avg_logits * torch.exp(avg_logits)).sum(dim=-1)


def update_cache(cache, pred, features_loss, shot_capacity):
    updated = False
    if pred in cache:
        if len(cache[pred]) < shot_capacity:
            cache[pred].append(features_loss)
            updated = True
        elif features_loss[1] < cache[pred][-1][1]:
            cache[pred][-1] = features_loss
            updated = True
        cache[pred] = sorted(cache[pred], key=operator.itemgetter(1))
    else:
        cache[pred] = [features_loss]
        updated = True
    return updated


def build_graph_by_degree(similarity_matrix, target_avg_degree, tol=1e-2, max_iter=500):
    n = similarity_matrix.shape[0]
    low, high = similarity_matrix.min().item(), similarity_matrix.max().item()
    for _ in range(max_iter):
        mid = (low + high) / 2
        adj_matrix = (similarity_matrix > mid).to(similarity_matrix.dtype)
        adj_matrix.fill_diagonal_(0)
        avg_degree = adj_matrix.sum() / n
        if abs(avg_degree - target_avg_degree) < tol:
            break
        elif avg_degree < target_avg_degree:
            high = mid
        else:
            low = mid
    return adj_matrix


def make_max_cliques(feats, control, is_sog=True):
    similarity_matrix = torch.mm(feats, feats.T)
    method, value = control
    if method == "degree":
        adjacency_matrix = build_graph_by_degree(similarity_matrix, value)
    else:
        adjacency_matrix = (similarity_matrix > value).to(similarity_matrix.dtype)
        adjacency_matrix.fill_diagonal_(0)
    if is_sog:
        adjacency_matrix = ((adjacency_matrix * torch.mm(adjacency_matrix, adjacency_matrix)) > 1).to(feats.dtype)
    G = nx.from_numpy_array(adjacency_matrix.numpy())  # networkx >= 3 spells from_numpy_matrix so
    max_cliques = [c for c in nx.find_cliques(G) if len(c) == len(set(c))]
    missing_nodes = set(range(feats.size(0))) - set(node for clique in max_cliques for node in clique)
    for node in missing_nodes:
        if max_cliques:
            max_cliques[0].append(node)
        else:
            max_cliques.append([node])
    return max_cliques, torch.stack([torch.mean(feats[clique], dim=0) for clique in max_cliques])


def compute_clique_logits(image_features, anchor_feat, target_feat, max_cliques, R, alpha, beta):
    affinity_0 = torch.mm(image_features, anchor_feat.T)
    top_R_count = max(1, int(len(max_cliques) * R))
    _, topk_indices = torch.topk(affinity_0, k=top_R_count, dim=-1)
    mac_idxs = torch.unique(topk_indices, sorted=True)
    relevant_indices = torch.unique(torch.cat([torch.tensor(max_cliques[idx.item()]) for idx in mac_idxs])).tolist()
    relevant_target_features = target_feat[relevant_indices]
    affinity = torch.mm(image_features, relevant_target_features.T)
    cache_values = F.one_hot(torch.tensor(relevant_indices), num_classes=target_feat.size(0)).to(affinity.dtype)
    logits = alpha * (((-1) * (beta - beta * affinity)).exp() @ cache_values)
    full_logits = torch.zeros((1, target_feat.shape[0]), dtype=affinity.dtype)
    full_logits[0, relevant_indices] = logits.squeeze()[relevant_indices]
    return full_logits


def make_prototype_features(cache, n_class, n_dim, dtype):
    prototype_features = torch.zeros((n_class, n_dim), dtype=dtype)
    for class_id, features in cache.items():
        prototype_features[class_id] = torch.stack([feature[0] for feature in features]).mean(dim=0)
    return prototype_features


class RefDualMem:
    """`DualMem` with the model's memory tensors (`ClipFix.get_text_features`), centre type "attn" or "default"."""

    def __init__(self, text_feat, memory_size, beta, center):
        self.text_feat, self.memory_size, self.beta, self.center = text_feat, memory_size, beta, center
        self.image_feature_memory = torch.zeros(K, memory_size, D, dtype=text_feat.dtype)
        self.image_entropy_mem = torch.zeros(K, memory_size, dtype=text_feat.dtype)
        self.image_feature_count = torch.zeros(K, 1).long()

    def update_memory_bank(self, mean_prob, feats, selected_idx):
        pseudo_label = mean_prob.max(0)[1].item()
        selected = feats[selected_idx].mean(0).unsqueeze(0)
        entropy = -(mean_prob * (torch.log(mean_prob + 1e-8))).sum()
        if self.image_feature_count[pseudo_label] == self.memory_size:
            if (entropy < self.image_entropy_mem[pseudo_label]).sum() == 0:
                return False
            ent = self.image_entropy_mem[pseudo_label]  # the highest entropy; of ties the last slot
            to_replace = ent.shape[0] - 1 - int(ent.flip(0).argmax())
            self.image_feature_memory[pseudo_label][to_replace] = selected
            self.image_entropy_mem[pseudo_label][to_replace] = entropy
            return True
        n = self.image_feature_count[pseudo_label, 0].item()
        self.image_feature_memory[pseudo_label][n] = selected
        self.image_entropy_mem[pseudo_label][n] = entropy
        self.image_feature_count[pseudo_label] += 1
        return True

    def get_image_pred(self, img_feat, scale):
        memorized = torch.cat((self.image_feature_memory, self.text_feat.unsqueeze(1)), dim=1)
        if self.center == "default":
            filled = memorized.sum(1) / (self.image_feature_count + 1)
            adaptive = filled / filled.norm(dim=-1, keepdim=True)
            return (scale * img_feat @ adaptive.t()).softmax(dim=1), adaptive
        K_ = memorized / memorized.norm(dim=-1, keepdim=True)
        K_[memorized.sum(-1) == 0] = 0
        q = img_feat / img_feat.norm(dim=-1, keepdim=True)
        similarity_matrix = torch.exp(-self.beta * (-(q * K_).sum(-1) + 1))
        adaptive = (K_ * similarity_matrix.unsqueeze(-1)).sum(1)
        adaptive = adaptive / adaptive.norm(dim=-1, keepdim=True)
        adaptive = adaptive / adaptive.norm(dim=-1, keepdim=True)
        logits = scale * adaptive.unsqueeze(0) @ img_feat.unsqueeze(-1)
        return logits[:, :, 0].softmax(dim=1), adaptive


def rebuild(cfg, i, updated, warmup):
    """`cosmic_main.py` l.451-454 (and l.493-497): situation1 or situation2 or situation3."""
    return ((cfg.always_update_graph and updated)
            or (not cfg.always_update_graph and i % cfg.mac_step == 0 and i > warmup)
            or (not cfg.always_update_graph and updated and i <= warmup))


def ref_cosmic(views, dino, text, cfg, scale=100.0):
    """`direct_inference` over a stream: views (N, U, D), dino (N, D') (original view), the final scores
    p_text + w_clip·MAC1 + w_dino·MAC2 (N, K)."""
    mem = RefDualMem(text, cfg.clip_memory, cfg.beta, cfg.clip_center)
    dinov2_cache, out = {}, []
    cliques1 = cliques2 = None
    for i in range(len(views)):
        feats = views[i]
        img_text = (scale * feats @ (text / text.norm(dim=1, keepdim=True)).t()).softmax(-1)
        img_text_pred = img_text[:1]
        confidence_prediction, selected_idx = select_confident_samples(img_text, cfg.selection_p)
        is_clip_update = mem.update_memory_bank(confidence_prediction.mean(0), feats, selected_idx)
        img_global_pred, adaptive = mem.get_image_pred(feats[:1], scale)
        temp_pred = img_text_pred + img_global_pred
        loss, pred = avg_entropy(temp_pred), int(temp_pred.argmax())
        score = img_text_pred[0].clone()
        th = [(min(1, lam + 0.00001 * i) if cfg.increase_threshold else lam) for lam in (cfg.lambda1, cfg.lambda2)]
        controls = [(cfg.control, cfg.target_avg_degree * 0.8 if cfg.control == "degree" else th[0]),
                    (cfg.control, cfg.target_avg_degree if cfg.control == "degree" else th[1])]
        space1 = torch.cat((text, adaptive), dim=0)
        if rebuild(cfg, i, is_clip_update, K * cfg.clip_memory):
            cliques1 = make_max_cliques(space1, controls[0], cfg.second_order)
        mac1 = compute_clique_logits(feats[:1], cliques1[1], space1, cliques1[0], cfg.clique_ratio,
                                     cfg.clique_alpha, cfg.clique_beta)
        score += cfg.clip_clique_weight * ((mac1[:, :K] + mac1[:, K:]) / 2)[0]
        if cfg.dino:
            is_dino_update = update_cache(dinov2_cache, pred, [dino[i:i + 1], loss], cfg.dino_memory)
            protos = make_prototype_features(dinov2_cache, K, dino.shape[1], dino.dtype)
            if rebuild(cfg, i, is_dino_update, K * cfg.dino_memory):
                cliques2 = make_max_cliques(protos, controls[1], cfg.second_order)
            mac2 = compute_clique_logits(dino[i:i + 1], cliques2[1], protos, cliques2[0], cfg.clique_ratio,
                                         cfg.clique_alpha, cfg.clique_beta)
            score += cfg.dino_clique_weight * mac2[0]
        out.append(score)
    return torch.stack(out)


# ------------------------------------------------------------------------------------------------- inputs

def make_text(seed=0, dtype=torch.float64):
    return prototypes(K, D, seed, dtype)


def make_views(n, text, seed=1, noise=1.2):
    return clustered_views(n, U, text, seed, noise)


@pytest.fixture(scope="module")
def dino_encoder(tmp_path_factory):
    """The tiny random DINOv2 folder loaded as the runner loads the real one, at the tiny views' 32 px."""
    from extract.models import Preprocess
    from extract.timm_encoder import load_timm_encoder
    from tools.second_models import write_dino_dir

    folder = write_dino_dir(tmp_path_factory.mktemp("dino") / "dino", tiny=True)
    pre = Preprocess((32, 32), (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    return load_timm_encoder(folder, pre, torch.device("cpu"), "fp32")


def dino_features(encoder, y, dtype=torch.float64):
    """DINOv2 features of random class-dependent 32 px images: `x_norm_clstoken` normalised, as the official reads
    them (`clip/fix_clip.py` `get_image_features_aux`), from the timm model directly."""
    g = torch.Generator().manual_seed(7)
    proto = torch.randn(K, 3, 32, 32, generator=g)
    images = proto[y] + 0.7 * torch.randn(len(y), 3, 32, 32, generator=g)
    with torch.no_grad():
        cls = encoder.model.forward_features(images)[:, 0]
    ref = cls / cls.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(encoder.encode_images(images), ref, rtol=0, atol=0)
    return ref.to(dtype)


def build(text, second=None, dataset="imagenet", **changes):
    cfg = dataclasses.replace(COSMIC.default_config(dataset, "ViT-B-16"), n_views=U, used_views=U, **changes)
    m = COSMIC(cfg, text, 100.0, backbone="ViT-B-16", dataset=dataset)
    if second is not None:
        m.attach_second_encoder(lambda a, b: second[a:b, None])
    return m


# ------------------------------------------------------------------------------------------------- tests

def test_defaults_and_tables():
    c = COSMIC.default_config("imagenet_a", "ViT-B-16")
    assert (c.n_views, c.used_views, c.augmix, c.crop_scale, c.prompts, c.cupl) == (64, 8, False, (0.5, 1.0),
                                                                                    "dataset", True)
    assert (c.clip_memory, c.dino_memory, c.beta, c.clique_ratio, c.mac_step, c.target_avg_degree) == (
        16, 16, 5.5, 0.2, 100, 5.0)
    assert (c.control, c.second_order, c.clip_center, c.dino, c.clip_clique_weight, c.dino_clique_weight) == (
        "degree", True, "attn", True, 1.0, 1.0)
    d = COSMIC.default_config("dtd", "RN50")
    assert (d.clip_memory, d.dino_memory, d.augmix, d.crop_scale, d.clique_alpha, d.clique_beta) == (
        8, 8, True, (0.08, 1.0), 2.0, 3.0)
    assert (COSMIC.default_config("imagenet_sketch", "RN50").clique_alpha, d.lambda1, d.lambda2) == (2.363, 0.70, 0.07)
    u = COSMIC.unseen_config("ViT-B-16")
    assert (u.prompts, u.cupl, u.clip_memory) == ("imagenet80", False, 8)
    assert [f.setting for f in COSMIC.needed_files(c)] == ["dino_weights"]
    assert COSMIC.needed_files(dataclasses.replace(c, dino=False)) == ()


@pytest.mark.parametrize("changes", [
    {},  # the shipped scripts' loop: attn read-out, degree control, second-order edges
    {"clip_center": "default", "control": "threshold", "lambda1": 0.3, "lambda2": 0.5, "second_order": False},
    {"dino": False, "always_update_graph": True},
])
def test_matches_official_loop(dino_encoder, changes):
    """float64 on both sides; memories of 2 items so the stream passes the warm-up (K·2 = 10 samples) into the
    every-`mac_step` rebuilds; the rows are the official scores made distributions, rounded to float32."""
    text = make_text()
    x, y = make_views(48, text)
    d = dino_features(dino_encoder, y)
    m = build(text, d, clip_memory=2, dino_memory=2, mac_step=7, target_avg_degree=2.5, **changes)
    got = torch.cat([m.adapt(x[:5]), m.adapt(x[5:6]), m.adapt(x[6:])])
    want = ref_cosmic(x, d, text, m.config)
    assert (want > 0).all()
    torch.testing.assert_close(got.double(), (want / want.sum(1, keepdim=True)).log(), rtol=4 * EPS32,
                               atol=4 * EPS32)
    if m.config.dino:
        assert m.summary()["dino_cache_items"] == 2 * K and len(m.dino_graph["cliques"]) >= 1
    assert m.summary()["clip_memory_items"] == 2 * K


def test_batched_equals_one_at_a_time_and_resume(dino_encoder, tmp_path):
    text = make_text(dtype=torch.float32)
    x, y = make_views(30, text.double())
    x, d = x.float(), dino_features(dino_encoder, y, torch.float32)
    whole = build(text, d, clip_memory=2, dino_memory=2, mac_step=4).adapt(x)
    m = build(text, d, clip_memory=2, dino_memory=2, mac_step=4)
    # a product of another batch shape may round z = 100·x·tᵀ (D terms) otherwise, and the rows follow z: the
    # registry-wide chunk tolerance (tests/extract/test_methods.py `LOGIT_TOL32`); rows reach |118| here, where one
    # float32 step is 8e-6
    tol = 2 * D * EPS32 * 100
    torch.testing.assert_close(torch.cat([m.adapt(x[i:i + 1]) for i in range(30)]), whole, rtol=0, atol=tol)
    first = build(text, d, clip_memory=2, dino_memory=2, mac_step=4)
    head = first.adapt(x[:13])
    torch.save(first.state_dict(), tmp_path / "state.pt")
    second = build(text, d, clip_memory=2, dino_memory=2, mac_step=4)
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    torch.testing.assert_close(torch.cat([head, second.adapt(x[13:])]), whole, rtol=0, atol=0)


def test_timm_resamples_the_position_embedding_as_dinov2(tmp_path):
    """Loaded at another input size, the patch position embedding is DINOv2's `interpolate_pos_encoding` of a
    register model: bicubic, antialiased, to the new grid by size (`interpolate_offset=0`)."""
    from extract.models import Preprocess
    from extract.timm_encoder import load_timm_encoder
    from safetensors.torch import load_file
    from tools.second_models import TINY_DINO_ARGS, write_dino_dir

    folder = write_dino_dir(tmp_path / "dino", tiny=True, img_size=64)  # an 8 x 8 grid of 8 px patches
    saved = load_file(str(folder / "model.safetensors"))["pos_embed"]
    enc = load_timm_encoder(folder, Preprocess((32, 32), (0.5,) * 3, (0.5,) * 3), torch.device("cpu"), "fp32")
    width = TINY_DINO_ARGS["embed_dim"]
    grid = saved.reshape(1, 8, 8, width).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(4, 4), mode="bicubic", antialias=True).permute(0, 2, 3, 1).reshape(1, 16, -1)
    torch.testing.assert_close(enc.model.pos_embed, want, rtol=0, atol=0)
    assert enc.dim == width and len(enc.fingerprint) == 16


def test_a_broken_dino_folder_is_refused_in_one_line(tmp_path):
    """What the timm loader refuses, each in one line (`ModelError`, which the run reports with the --set key): no
    folder, a folder without its weights, a config without an architecture, truncated weights."""
    import json

    from extract.models import ModelError, Preprocess
    from extract.timm_encoder import load_timm_encoder
    from tools.second_models import write_dino_dir

    def refusal(folder):
        with pytest.raises(ModelError) as e:
            load_timm_encoder(folder, Preprocess((32, 32), (0.5,) * 3, (0.5,) * 3), torch.device("cpu"), "fp32")
        assert "\n" not in str(e.value)
        return str(e.value)

    folder = write_dino_dir(tmp_path / "dino", tiny=True)
    assert "no such folder" in refusal(tmp_path / "nowhere")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    assert "model.safetensors: not a readable safetensors file (truncated or corrupt?)" in refusal(folder)
    weights.unlink()
    assert "the folder lacks model.safetensors" in refusal(folder)
    weights.write_bytes(data)
    (folder / "config.json").write_text(json.dumps({"architecture_of": "vit"}))
    assert "not a timm config with an 'architecture'" in refusal(folder)


def test_run_resumes_equal_to_an_uninterrupted_run(tmp_path, tiny_model, tiny_externals, monkeypatch):
    from tests.support.online import assert_run_resumes

    assert_run_resumes("cosmic", tmp_path, tiny_model, monkeypatch, overrides=tiny_externals.overrides("cosmic"))
