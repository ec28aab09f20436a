"""The pipeline end to end on a tiny model: shards, zero-shot logits, determinism, cache reuse, resume."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import extract.methods as methods
from extract import runner
from extract.run import encode as run_encode
from extract.run import writer as run_writer
from extract.datasets import imagenet_synsets, load_testset, open_image
from extract.methods.base import apply_overrides
from extract.run.options import RunError, config_dict
from extract.run.rundir import run_is_complete
from extract.run.stream import stream_permutation
from extract.runner import run_extraction
from schemas.shard import RunKey, find_shards, group_shards, read_shard, validate_shard

from tests.support.extract import interrupt_nth_write, make_imagenet_folders, make_json_dataset, with_views
from tests.support.extract import shard_columns as _table

SMALL = dict(part_size=8, adapt_batch=4, chunk_size=5, batch_size=3, progress=False)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)  # 18 samples
    return root


def _run(method, tmp_path, model, data_root, **kw):
    args = dict(SMALL, data_root=data_root, out=tmp_path / "out", cache_dir=tmp_path / "cache", model=model)
    args.update(kw)
    return run_extraction(method, kw.pop("dataset", "dtd") if "dataset" in kw else "dtd",
                          **{k: v for k, v in args.items() if k != "dataset"})


def _whole_run_equals_a_fresh_one(method, tmp_path, tiny_model, data_root):
    """Run `method` over the whole set into tmp_path/out (over what lies there), check it equals a run into an empty
    folder, and return the lines the first printed."""
    lines: list[str] = []
    got = _table(_run(method, tmp_path, tiny_model, data_root, log=lines.append))
    fresh = _table(_run(method, tmp_path / "fresh", tiny_model, data_root, cache_dir=tmp_path / "cache"))
    for k, v in fresh.items():
        np.testing.assert_array_equal(got[k], v)
    return lines


# --------------------------------------------------------------------------------------------------------------

def test_zero_shot_shards_valid_and_logits_independent(tmp_path, tiny_model, tiny_model_dir, data_root):
    paths = _run("zero-shot", tmp_path, tiny_model, data_root)
    assert [p.name for p in paths] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    for p in paths:
        assert validate_shard(p) == []
    groups = group_shards(find_shards([tmp_path / "out"]))
    (key,) = groups
    assert key == RunKey("tiny-clip", "dtd", "zero-shot", 1)
    t = _table(paths)
    ts = load_testset("dtd", data_root)
    assert sorted(t["sample_id"].tolist()) == list(range(18))
    assert t["stream_pos"].tolist() == list(range(18))
    assert t["sample_id"].tolist() == stream_permutation("dtd", 1, 18).tolist()
    assert t["label"].tolist() == ts.labels[t["sample_id"]].tolist()

    # independent zero-shot reference: open_clip directly, torchvision preprocessing, the model's own logit scale
    import open_clip
    from PIL import Image
    from torchvision import transforms as T
    model = open_clip.create_model(f"local-dir:{tiny_model_dir}")
    model.eval()
    tok = open_clip.get_tokenizer(f"local-dir:{tiny_model_dir}")
    pre = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32), T.ToTensor(),
                     T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    with torch.no_grad():
        imgs = torch.stack([pre(Image.open(ts.paths[i]).convert("RGB")) for i in t["sample_id"]])
        f = model.encode_image(imgs)
        f = f / f.norm(dim=-1, keepdim=True)
        w = model.encode_text(tok([f"a photo of a {c}." for c in ts.class_names]))
        w = w / w.norm(dim=-1, keepdim=True)
        want = (model.logit_scale.exp() * f @ w.T).numpy()
    assert float(model.logit_scale.detach().exp()) == pytest.approx(37.5)
    # float32 at logit scale 37.5: unit features through width-32 towers (~32 eps each), a width-16 dot product
    eps32 = np.finfo(np.float32).eps
    np.testing.assert_allclose(t["zs_logits"], want, rtol=0, atol=2 * 32 * eps32 * 37.5)
    np.testing.assert_allclose(t["tta_logits"], t["zs_logits"], rtol=0, atol=2 * 16 * eps32 * 37.5)

    meta = read_shard(paths[0]).meta
    assert meta.class_names == ts.class_names and meta.zs_prompts["templates"] == ["a photo of a {}."]
    assert meta.zs_prompts["logit_scale"] == pytest.approx(37.5)
    assert json.loads(meta.extra["zaec:warnings"]) == []
    assert run_is_complete(tmp_path / "out", key)


def test_deterministic_and_cache_reused(tmp_path, tiny_model, data_root, monkeypatch):
    a = _table(_run("tda", tmp_path / "a", tiny_model, data_root))
    b = _table(_run("tda", tmp_path / "b", tiny_model, data_root))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    # a second method on the same cache never calls the image encoder
    calls = []
    orig = type(tiny_model).encode_images
    monkeypatch.setattr(type(tiny_model), "encode_images", lambda self, x: calls.append(len(x)) or orig(self, x))
    z = _table(_run("zero-shot", tmp_path / "a", tiny_model, data_root))
    assert calls == []
    # same stream and same anchor for every method
    np.testing.assert_array_equal(z["sample_id"], a["sample_id"])
    np.testing.assert_array_equal(z["zs_logits"], a["zs_logits"])


def test_multi_view_cache_shares_view0_exactly(tmp_path, tiny_model, data_root, monkeypatch):
    multi = _table(_run("zero-shot", tmp_path, tiny_model, data_root, limit=6, force=True, chunk_size=3,
                        overrides={"n_views": "64", "augmix": "true"}))
    calls = []
    orig = type(tiny_model).encode_images
    monkeypatch.setattr(type(tiny_model), "encode_images", lambda self, x: calls.append(len(x)) or orig(self, x))
    single = _table(_run("zero-shot", tmp_path / "s", tiny_model, data_root, limit=6, chunk_size=3,
                         cache_dir=tmp_path / "cache"))
    assert calls == []  # view 0 came from the multi-view run's cache
    np.testing.assert_array_equal(single["zs_logits"], multi["zs_logits"])
    cache_dirs = list((tmp_path / "cache").rglob("augmix"))
    assert len(cache_dirs) == 1 and sorted(p.name for p in cache_dirs[0].iterdir()) == ["chunk-00000.npy",
                                                                                       "chunk-00001.npy"]


def test_limit_prefix_of_full_stream(tmp_path, tiny_model, data_root):
    full = _table(_run("tda", tmp_path / "f", tiny_model, data_root))
    part = _table(_run("tda", tmp_path / "l", tiny_model, data_root, limit=8))
    assert len(part["sample_id"]) == 8
    for k in full:
        np.testing.assert_array_equal(part[k], full[k][:8])
    # only the chunks covering the first 8 positions were encoded (chunk size 5)
    assert sorted(p.name for p in (tmp_path / "l" / "cache").rglob("chunk-*.npy")) == ["chunk-00000.npy",
                                                                                      "chunk-00001.npy"]


def test_resume_after_interruption_equals_uninterrupted(tmp_path, tiny_model, data_root, running_mean,
                                                        monkeypatch):
    full_paths = _run(running_mean, tmp_path / "full", tiny_model, data_root)
    full = _table(full_paths)
    # interrupt: the third shard write fails
    real_write = interrupt_nth_write(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _run(running_mean, tmp_path / "r", tiny_model, data_root)
    monkeypatch.setattr(run_writer, "write_shard", real_write)
    out = tmp_path / "r" / "out"
    key = RunKey("tiny-clip", "dtd", running_mean, 1)
    assert not run_is_complete(out, key)
    kept = sorted(p.name for p in out.rglob("part-*.parquet"))
    assert kept == ["part-00000.parquet", "part-00001.parquet"]
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("part-*.parquet")}

    resumed = _table(_run(running_mean, tmp_path / "r", tiny_model, data_root))
    assert run_is_complete(out, key)
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # kept parts were not rewritten
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])
    # the online state matters: without replay the last part would differ
    no_replay = _table(_run(running_mean, tmp_path / "n", tiny_model, data_root, limit=2))
    assert not np.allclose(no_replay["tta_logits"][:2] , full["tta_logits"][8:10])
    # a finished run is skipped (no rewrite) unless forced
    before = {p: p.stat().st_mtime_ns for p in out.rglob("part-*.parquet")}
    _run(running_mean, tmp_path / "r", tiny_model, data_root)
    assert {p: p.stat().st_mtime_ns for p in before} == before
    again = _table(_run(running_mean, tmp_path / "r", tiny_model, data_root, force=True))
    np.testing.assert_array_equal(again["tta_logits"], full["tta_logits"])


def test_changed_settings_need_force(tmp_path, tiny_model, data_root, running_mean):
    _run(running_mean, tmp_path, tiny_model, data_root)
    with pytest.raises(RunError, match="different settings.*--force"):
        _run(running_mean, tmp_path, tiny_model, data_root, overrides={"weight": "1.5"})
    # a partial run with other settings is not silently mixed either
    (tmp_path / "out").joinpath(
        "backbone=tiny-clip", "dataset=dtd", f"method={running_mean}", "seed=1", "_zaec_complete.json").unlink()
    with pytest.raises(RunError, match="different settings.*method_config"):
        _run(running_mean, tmp_path, tiny_model, data_root, overrides={"weight": "1.5"})
    paths = _run(running_mean, tmp_path, tiny_model, data_root, overrides={"weight": "1.5"}, force=True)
    assert read_shard(paths[0]).meta.method_config["weight"] == 1.5


def test_anchor_method_and_cupl_warning_in_metadata(tmp_path, tiny_model, data_root):
    paths = _run("dpe", tmp_path, tiny_model, data_root, limit=4, anchor="method", cupl_dir=tmp_path / "nocupl")
    meta = read_shard(paths[0]).meta
    assert meta.zs_prompts["anchor"] == "method" and meta.zs_prompts["templates"] == ["{} texture."]
    warnings = json.loads(meta.extra["zaec:warnings"])
    assert len(warnings) == 1 and "CuPL_prompts_dtd.json does not exist" in warnings[0]
    assert meta.method_config["cupl"] is True


def test_v2_end_to_end_labels(tmp_path, tiny_model):
    root = tmp_path / "data"
    make_imagenet_folders(root, "imagenet_v2", ["0", "10", "2"], per_class=1)
    paths = _run("zero-shot", tmp_path, tiny_model, root, dataset="imagenet_v2")
    t = _table(paths)
    ts = load_testset("imagenet_v2", root)
    assert dict(zip(t["sample_id"].tolist(), t["label"].tolist())) == {0: 0, 1: 2, 2: 10}
    assert t["zs_logits"].shape == (3, 1000) and ts.num_classes == 1000
    assert read_shard(paths[0]).meta.num_classes == 1000


def test_imagenet_a_subset_metadata(tmp_path, tiny_model):
    import importlib.resources
    idx = [int(x) for x in (importlib.resources.files("timm.data") / "_info" / "imagenet_a_indices.txt")
           .read_text().split()]
    root = tmp_path / "data"
    make_imagenet_folders(root, "imagenet_a", [imagenet_synsets()[idx[5]]], per_class=2)
    paths = _run("zero-shot", tmp_path, tiny_model, root, dataset="imagenet_a")
    meta = read_shard(paths[0]).meta
    assert meta.num_classes == 200 and json.loads(meta.extra["zaec:imagenet_indices"]) == idx
    assert _table(paths)["label"].tolist() == [5, 5]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One feature cache for the registry-wide test: the 64-view features are encoded once for every method."""
    return tmp_path_factory.mktemp("shared-cache")


def _tiny_run_inputs(method: str, tmp_path, tiny_model_dir, data_root, tiny_externals) -> tuple[dict, dict]:
    """(`--set` values, run keywords) that run `method` on the tiny model: a method with a second model gets a tiny
    one (RLCF's reward model: the tiny model; the others': the tiny files of tests/support/second_models.py; their
    defaults cannot be had offline), a batch method batches of 2, AWT a description file of the set's classes."""
    cls = methods.get_method(method)
    overrides = ({"reward_pretrained": f"local-dir:{tiny_model_dir}", "reward_backbone": ""}
                 if getattr(cls, "needs_reward_model", False)
                 else tiny_externals.overrides(method) if cls.external_files else {})
    if cls.adapt_width(cls.default_config("dtd", "tiny-clip")) is not None:  # adapts over batches: two of 2 here
        overrides["batch_size"] = "2"
    extra = {}
    if cls.needs_descriptions:
        from extract.datasets import load_testset

        names = load_testset("dtd", data_root).class_names
        (tmp_path / "desc").mkdir()
        (tmp_path / "desc" / "dtd.json").write_text(json.dumps({n: [f"{n}, trait {i}." for i in range(50)]
                                                                for n in names}))
        extra["descriptions_dir"] = tmp_path / "desc"
    return overrides, extra


@pytest.mark.parametrize("method", sorted(methods.REGISTRY))
def test_every_registered_method_runs(tmp_path, tiny_model, tiny_model_dir, data_root, method,
                                     shared_cache, tiny_externals):
    overrides, extra = _tiny_run_inputs(method, tmp_path, tiny_model_dir, data_root, tiny_externals)
    paths = _run(method, tmp_path, tiny_model, data_root, limit=4, cache_dir=shared_cache, overrides=overrides,
                 **extra)
    t = _table(paths)
    assert t["tta_logits"].shape == (4, 3) and np.isfinite(t["tta_logits"]).all()
    assert all(validate_shard(p) == [] for p in paths)
    default = apply_overrides(methods.get_method(method).default_config("dtd", "tiny-clip"), overrides)
    # a default above a bound of the model (TTL's 3 LoRA blocks; the tiny model has 1) is lowered to it, with a note
    cfg = with_views(default, default.n_views, {"vision_blocks": len(tiny_model.model.visual.transformer.resblocks)})
    meta = read_shard(paths[0]).meta
    assert meta.method_config == config_dict(cfg)  # Panda's fields only with panda=true
    lowered = [f"{method} on tiny-clip: {k}={v} (the default {getattr(default, k)} exceeds" for k, v in
               dataclasses.asdict(cfg).items() if v != getattr(default, k)]
    warnings = json.loads(meta.extra["zaec:warnings"])
    assert all(any(w.startswith(n) for w in warnings) for n in lowered) and (method != "ttl" or lowered)
    # what the rows are: written only when they are not logits, so shards of the logit methods keep their bytes
    kind = methods.get_method(method).output_kind
    assert meta.output_kind == kind and ("zaec:output_kind" in meta.extra) == (kind != "logits")
    if kind == "log_probs":  # natural-log probabilities: each row sums to 1 after exp, within float32 rounding of
        # the stored logs (|log p| <= ~100 here, so exp carries up to 100 eps32 ~ 1.2e-5 relative error per entry)
        np.testing.assert_allclose(np.exp(t["tta_logits"].astype(np.float64)).sum(1), 1.0, rtol=100 * 2**-23 * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the methods' CUDA paths run only on CUDA")
@pytest.mark.parametrize("method", sorted(methods.REGISTRY))
def test_every_registered_method_runs_on_cuda(tmp_path, tiny_model_dir, data_root, method, tiny_externals):
    """Every method end to end on a CUDA device (autocast, loss scaling and the device-side views where the
    method has them; `make gpu-check` runs it where a GPU is lent): finite rows and valid shards."""
    from extract.models import load_model

    model = load_model(None, f"local-dir:{tiny_model_dir}", "cuda")
    overrides, extra = _tiny_run_inputs(method, tmp_path, tiny_model_dir, data_root, tiny_externals)
    paths = _run(method, tmp_path, model, data_root, limit=4, overrides=overrides, device="cuda", **extra)
    t = _table(paths)
    assert t["tta_logits"].shape == (4, 3) and np.isfinite(t["tta_logits"]).all()
    assert all(validate_shard(p) == [] for p in paths)


def test_bad_run_arguments(tmp_path, tiny_model, data_root):
    with pytest.raises(ValueError, match="unknown method 'nope'; available: zero-shot"):
        _run("nope", tmp_path, tiny_model, data_root)
    with pytest.raises(ValueError, match="unknown config key.*valid keys"):
        _run("tda", tmp_path, tiny_model, data_root, overrides={"alpah": "1"})
    with pytest.raises(RunError, match="anchor"):
        _run("tda", tmp_path, tiny_model, data_root, anchor="zs")
    with pytest.raises(RunError, match="limit"):
        _run("tda", tmp_path, tiny_model, data_root, limit=0)
    with pytest.raises(RunError, match="multiple of adapt_batch"):
        _run("tda", tmp_path, tiny_model, data_root, part_size=6)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_stream_permutation_fixed_per_dataset_and_seed():
    a = stream_permutation("dtd", 1, 100)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, stream_permutation("dtd", 1, 100))
    assert not np.array_equal(a, stream_permutation("dtd", 2, 100))
    assert not np.array_equal(a, stream_permutation("eurosat", 1, 100))


def test_encoding_crash_resumes_missing_chunks_only(tmp_path, tiny_model, data_root, monkeypatch):
    from extract.cache import FeatureCache
    full = _table(_run("zero-shot", tmp_path / "ref", tiny_model, data_root))
    real_save = FeatureCache.save
    saved = []

    def crash_on_third(self, part, c, arr):
        if len(saved) == 2:
            raise KeyboardInterrupt
        saved.append(c)
        return real_save(self, part, c, arr)

    monkeypatch.setattr(FeatureCache, "save", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        _run("zero-shot", tmp_path / "crash", tiny_model, data_root)
    monkeypatch.setattr(FeatureCache, "save", real_save)
    chunks = sorted(p.name for p in (tmp_path / "crash" / "cache").rglob("chunk-*.npy"))
    assert chunks == ["chunk-00000.npy", "chunk-00001.npy"]  # nothing half-written
    assert not list((tmp_path / "crash" / "cache").rglob("*.tmp"))
    encoded = []
    orig = type(tiny_model).encode_images
    monkeypatch.setattr(type(tiny_model), "encode_images", lambda self, x: encoded.append(len(x)) or orig(self, x))
    resumed = _table(_run("zero-shot", tmp_path / "crash", tiny_model, data_root))
    assert sum(encoded) == 18 - 10  # only chunks 2 and 3 (positions 10..17) were encoded
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])


def test_text_prototypes_cached(tmp_path, tiny_model, data_root, monkeypatch):
    _run("tda", tmp_path, tiny_model, data_root, limit=4)
    calls = []
    orig = type(tiny_model).encode_texts
    monkeypatch.setattr(type(tiny_model), "encode_texts", lambda self, t: calls.append(len(t)) or orig(self, t))
    _run("tda", tmp_path / "again", tiny_model, data_root, limit=4, cache_dir=tmp_path / "cache")
    assert calls == []
    _run("zero-shot", tmp_path / "zs", tiny_model, data_root, limit=4, cache_dir=tmp_path / "cache",
         anchor="method")
    assert calls == []  # "a photo of a {}." prototypes were cached by the anchor of the first run


def test_sh_filter_recorded_in_metadata(tmp_path, tiny_model):
    root = tmp_path / "data"
    make_imagenet_folders(root, "imagenet_v2", ["3"], per_class=3, names=["a.png", "ash.png", "b.png"])
    paths = _run("zero-shot", tmp_path, tiny_model, root, dataset="imagenet_v2", sh_filter=True)
    s = read_shard(paths[0])
    assert len(s) == 2 and "1 image file(s) dropped" in s.meta.extra["zaec:tda_sh_filter"]
    plain = _run("zero-shot", tmp_path / "plain", tiny_model, root, dataset="imagenet_v2")
    assert len(read_shard(plain[0])) == 3 and "zaec:tda_sh_filter" not in read_shard(plain[0]).meta.extra


def test_workers_and_fp16_cache_paths(tmp_path, tiny_model, tiny_model_dir, data_root):
    """The GPU code paths that run on the CPU too: worker processes for the views, an fp16 feature cache."""
    from extract.models import load_model
    ref = _table(_run("tda", tmp_path / "w0", tiny_model, data_root, limit=8, workers=0))
    par = _table(_run("tda", tmp_path / "w2", tiny_model, data_root, limit=8, workers=2))
    for k in ref:
        np.testing.assert_array_equal(par[k], ref[k])
    amp = load_model(None, f"local-dir:{tiny_model_dir}", "cpu", precision="amp")
    assert amp.cache_dtype == np.float16 and amp.fingerprint != tiny_model.fingerprint
    half = _table(_run("tda", tmp_path / "fp16", amp, data_root, limit=8))
    assert next((tmp_path / "fp16" / "cache").rglob("chunk-00000.npy")).stat().st_size < \
        next((tmp_path / "w0" / "cache").rglob("chunk-00000.npy")).stat().st_size
    # fp16 features (eps16 = 2**-10): the dot product moves by <= eps16/2 (x 37.5), TDA's cache affinities by about
    # alpha * beta * eps16 per entry; 0.05 ~ 50 eps16 covers both, and is far below a wrong feature's effect
    np.testing.assert_allclose(half["zs_logits"], ref["zs_logits"], atol=0.05)


def test_all_parts_present_but_no_marker(tmp_path, tiny_model, data_root, running_mean):
    """A crash between the last shard and the marker: the rerun keeps every part and only writes the marker."""
    paths = _run(running_mean, tmp_path, tiny_model, data_root)
    key = RunKey("tiny-clip", "dtd", running_mean, 1)
    marker = paths[0].parent / "_zaec_complete.json"
    marker.unlink()
    mtimes = {p: p.stat().st_mtime_ns for p in paths}
    assert _run(running_mean, tmp_path, tiny_model, data_root) == paths
    assert {p: p.stat().st_mtime_ns for p in paths} == mtimes and run_is_complete(tmp_path / "out", key)


def test_changed_settings_recomputed_when_the_caller_owns_the_output(tmp_path, tiny_model, data_root,
                                                                    running_mean):
    """on_changed="recompute" (the demo's choice) recomputes a finished or partial run whose settings changed,
    with a note, instead of refusing; the default still refuses (test above)."""
    _run(running_mean, tmp_path, tiny_model, data_root)
    notes: list[str] = []
    paths = _run(running_mean, tmp_path, tiny_model, data_root, overrides={"weight": "1.5"},
                 on_changed="recompute", log=notes.append)
    assert read_shard(paths[0]).meta.method_config["weight"] == 1.5
    assert any("different settings: method_config" in n and "recomputing" in n for n in notes)
    marker = paths[0].parent / "_zaec_complete.json"
    marker.unlink()  # a partial run with other settings: recomputed from its first part
    paths = _run(running_mean, tmp_path, tiny_model, data_root, overrides={"weight": "2.5"},
                 on_changed="recompute")
    assert all(read_shard(p).meta.method_config["weight"] == 2.5 for p in paths)
    with pytest.raises(RunError, match="on_changed must be"):
        _run(running_mean, tmp_path, tiny_model, data_root, on_changed="ask")


@pytest.mark.parametrize("policy,batch_size,device_chains", [("single", 4, False), ("crop_flip", 40, False),
                                                              ("augmix", 64, False), ("augmix", 40, True)])
def test_encode_pass_equals_host_concatenated_micro_batches(tmp_path, tiny_model, data_root, policy,
                                                            batch_size, device_chains):
    """The device-side micro-batches (`_Batcher`) encode exactly what the obvious code encodes: per chunk, every
    view of its samples in stream order, concatenated on the host, cut into `batch_size` pieces (63 views per sample
    do not divide 40 or 64, so micro-batches straddle samples), each piece encoded. Bit for bit: same batches. With
    `device_chains` the AugMix chains run in the main process (`extract.augmix_device`, what CUDA runs do) from the
    loader's crops and draws: the reference is still Pillow's views."""
    _encode_and_compare_with_host_views(tmp_path, tiny_model, data_root, policy, batch_size,
                                        device_chains=device_chains)


def _encode_and_compare_with_host_views(tmp_path, tiny_model, data_root, policy, batch_size, **kw):
    """`encode_pass` of 7 positions in chunks of 3, then each chunk's cache against the obvious code's features."""
    from extract.cache import FeatureCache
    from extract.views import ViewGenerator

    ts = load_testset("dtd", data_root)
    perm = stream_permutation("dtd", 1, len(ts))
    n_pos, chunk = 7, 3  # chunks [0,3) [3,6) [6,7)
    dim = tiny_model.encode_images(torch.zeros(1, 3, *tiny_model.preprocess.size)).shape[1]
    cache = FeatureCache(tmp_path, "m", "dtd", "k", 1, len(ts), dim, np.dtype(np.float32), "s",
                         chunk_size=chunk)
    encoded = run_encode.encode_pass(tiny_model, ts, perm, cache, policy, n_pos, seed=1, batch_size=batch_size, **kw)
    assert encoded == n_pos
    gen = ViewGenerator(tiny_model.preprocess, policy, seed=1)
    for c in range(3):
        lo, hi = c * chunk, min((c + 1) * chunk, n_pos)
        imgs = [open_image(ts.paths[int(perm[p])]) for p in range(lo, hi)]
        parts = {"view0": torch.stack([gen.original(im) for im in imgs])}
        if policy != "single":
            parts[policy] = torch.cat([gen.augmented(im, int(perm[p])) for im, p in zip(imgs, range(lo, hi))])
        for part, views in parts.items():
            want = torch.cat([tiny_model.encode_images(views[i:i + batch_size])
                              for i in range(0, len(views), batch_size)]).numpy()
            got = np.asarray(cache.load(part, c)).reshape(-1, want.shape[1])
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("policy,device_chains,workers", [("single", False, 0), ("single", False, 2),
                                                          ("augmix", True, 0), ("augmix", True, 2),
                                                          ("crop_flip", False, 2)])
def test_grouped_loader_items_and_chain_calls_encode_the_same_features(tmp_path, tiny_model, data_root, monkeypatch,
                                                                       policy, device_chains, workers):
    """Single-view items carry `SINGLE_VIEW_ITEM` positions (one tensor each, never across a chunk) and AugMix's
    device chains run for `CHAIN_SAMPLES` samples per call (the rest at the chunk's end); the cache then holds the
    obvious code's features, bit for bit, from loader processes too (view 0 written into shared memory there)."""
    monkeypatch.setattr(run_encode, "SINGLE_VIEW_ITEM", 2)
    monkeypatch.setattr(run_encode, "CHAIN_SAMPLES", 2)
    added, programs = [], []
    real_add, real_run = run_encode._Batcher.add, run_encode.run_packed

    def add(self, raw, coef):
        added.append(raw.shape[0])
        return real_add(self, raw, coef)

    def run_packed(crops, *args):
        programs.append(crops.shape[0])
        return real_run(crops, *args)

    monkeypatch.setattr(run_encode._Batcher, "add", add)
    monkeypatch.setattr(run_encode, "run_packed", run_packed)
    _encode_and_compare_with_host_views(tmp_path, tiny_model, data_root, policy, 40, device_chains=device_chains,
                                        workers=workers)
    if policy == "single":  # chunks [0,3) [3,6) [6,7): items of 2, 1, 2, 1, 1 images
        assert added == [2, 1, 2, 1, 1]
    elif device_chains:  # view 0 one sample per item; chains: two samples' views, then the chunk's last one
        assert added == [1] * 7 and programs == [126, 63, 126, 63, 63]
    else:
        assert added == [1, 63] * 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-side micro-batches run on CUDA here")
def test_cuda_encode_pass_equals_host_micro_batches(tmp_path, tiny_model_dir, data_root):
    """On CUDA (pinned uint8 from loader processes, finished on the GPU, asynchronous copies into the batch buffer)
    the cache holds the features of the same micro-batches built on the host and encoded one by one."""
    from extract.cache import FeatureCache
    from extract.models import load_model
    from extract.views import ViewGenerator

    gpu = load_model(None, f"local-dir:{tiny_model_dir}", "cuda")
    ts = load_testset("dtd", data_root)
    perm = stream_permutation("dtd", 1, len(ts))
    gen = ViewGenerator(gpu.preprocess, "augmix", seed=1)
    dim = gpu.encode_images(torch.zeros(1, 3, *gpu.preprocess.size)).shape[1]
    cache = FeatureCache(tmp_path, "m", "dtd", "k", 1, len(ts), dim, gpu.cache_dtype, "s", chunk_size=4)
    run_encode.encode_pass(gpu, ts, perm, cache, "augmix", 4, seed=1, batch_size=64, workers=2)
    imgs = [open_image(ts.paths[int(perm[p])]) for p in range(4)]
    for part, views in (("view0", torch.stack([gen.original(im) for im in imgs])),
                        ("augmix", torch.cat([gen.augmented(im, int(perm[p])) for p, im in enumerate(imgs)]))):
        want = torch.cat([gpu.encode_images(views[i:i + 64]) for i in range(0, len(views), 64)]).cpu().numpy()
        got = np.asarray(cache.load(part, 0), np.float32).reshape(-1, dim)
        np.testing.assert_array_equal(got, want.astype(gpu.cache_dtype).astype(np.float32))


@pytest.mark.parametrize("env,expected", [(None, True), ("1", True), ("0", False)])
def test_device_chains_default_on_cuda_unless_disabled(tmp_path, tiny_model, data_root, monkeypatch,
                                                       env, expected):
    """A CUDA model runs AugMix's chains on the device unless ZAEC_DEVICE_CHAINS=0; a CPU model never does."""
    from extract.cache import FeatureCache

    seen = []

    class Stop(Exception):
        pass

    def spy(*args, **kw):
        seen.append(args[-1] if len(args) > 4 else kw.get("device_chains"))
        raise Stop

    monkeypatch.setattr(run_encode, "_ViewData", spy)
    if env is None:
        monkeypatch.delenv(run_encode.DEVICE_CHAINS_ENV, raising=False)
    else:
        monkeypatch.setenv(run_encode.DEVICE_CHAINS_ENV, env)
    ts = load_testset("dtd", data_root)
    perm = stream_permutation("dtd", 1, len(ts))
    cache = FeatureCache(tmp_path, "m", "dtd", "k", 1, len(ts), 16, np.dtype(np.float32), "s", chunk_size=4)
    for device, want in (("cuda", expected), ("cpu", False)):
        model = dataclasses.replace(tiny_model, device=torch.device(device))
        with pytest.raises(Stop):
            run_encode.encode_pass(model, ts, perm, cache, "augmix", 2, seed=1)
        assert seen.pop() is want


# --- issue 21: what a reused, limited or damaged run says -------------------------------------------------------

def test_finished_run_reuse_says_so_and_a_smaller_limit_is_told_it_gets_the_whole_run(tmp_path, tiny_model,
                                                                                       data_root):
    first = _run("tda", tmp_path, tiny_model, data_root)
    lines: list[str] = []
    again = _run("tda", tmp_path, tiny_model, data_root, log=lines.append)
    assert again == first and len(lines) == 1
    assert "already finished" in lines[0] and "18 of 18 samples" in lines[0] and "--force" in lines[0]
    assert "alpha=2.0" in lines[0]  # the settings it was made with
    lines.clear()
    # 8 ends an adapt call (adapt_batch 4) and TDA reads no later sample: its first 8 rows are the 8-sample run's
    limited = _run("tda", tmp_path, tiny_model, data_root, limit=8, log=lines.append)
    assert limited == first  # the superset is reused, not replaced by 8 rows
    assert len(lines) == 1 and "--limit 8" in lines[0] and "hold all 18" in lines[0]
    assert sum(len(read_shard(p).sample_id) for p in limited) == 18


def test_nan_in_a_cached_feature_chunk_names_the_file_not_the_settings(tmp_path, tiny_model, data_root):
    from extract.cache import CacheError

    _run("zero-shot", tmp_path, tiny_model, data_root)
    chunk = sorted((tmp_path / "cache").rglob("view0/chunk-00001.npy"))[0]
    arr = np.load(chunk)
    arr[2, 0] = np.nan
    np.save(chunk, arr)
    with pytest.raises(CacheError) as e:
        _run("zero-shot", tmp_path, tiny_model, data_root, force=True)
    assert str(chunk) in str(e.value) and "stream position 7 " in str(e.value) and "--set" not in str(e.value)


def test_a_bad_prompt_file_stops_the_run_before_the_model_loads(tmp_path, data_root, monkeypatch):
    """Validation that needs no model used to wait for the model to load (seconds for ViT-B-16)."""
    from extract.prompts import PromptError

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the prompts were checked")

    monkeypatch.setattr(runner, "load_model", no_model)
    cupl = tmp_path / "cupl"
    cupl.mkdir()
    (cupl / "CuPL_prompts_dtd.json").write_text("[1, 2]")
    with pytest.raises(PromptError, match="CuPL_prompts_dtd.json"):
        run_extraction("dpe", "dtd", data_root=data_root, out=tmp_path / "out", cache_dir=tmp_path / "cache",
                       cupl_dir=cupl, progress=False)
    assert not (tmp_path / "out").exists()  # the lock took the run folder and gave it back


def test_truncated_part_is_recomputed_with_a_warning(tmp_path, tiny_model, data_root, running_mean):
    paths = _run(running_mean, tmp_path, tiny_model, data_root)
    ref = _table(paths)
    paths[1].write_bytes(paths[1].read_bytes()[:100])
    (paths[0].parent / "_zaec_complete.json").unlink()
    lines: list[str] = []
    again = _run(running_mean, tmp_path, tiny_model, data_root, log=lines.append)
    assert [ln for ln in lines if "warning" in ln] == [ln for ln in lines if str(paths[1]) in ln]
    assert any("is unreadable" in ln and "parts 0..0 kept" in ln for ln in lines)
    for k, v in _table(again).items():
        np.testing.assert_array_equal(v, ref[k])


def test_switching_fingerprint_mode_does_not_blame_the_files(tmp_path, tiny_model, data_root):
    _run("zero-shot", tmp_path, tiny_model, data_root)
    with pytest.raises(RunError) as e:
        _run("zero-shot", tmp_path, tiny_model, data_root, fingerprint="content")
    msg = str(e.value)
    assert "--fingerprint stat" in msg and "the image files changed" not in msg


# --- issue 32 item 1: a longer finished run serves a --limit only where its first rows are the limited run's -----

def test_limit_after_a_full_onzeta_run_computes_the_limited_run_when_forced(tmp_path, tiny_model, data_root):
    """OnZeta's schedule reads the stream's length: the full run's first 8 rows are not an 8-sample run's. The
    8-sample run is refused without --force (issue 35 item 1); forced, it equals a fresh 8-sample run."""
    full = _table(_run("onzeta", tmp_path, tiny_model, data_root))
    with pytest.raises(RunError) as e:
        _run("onzeta", tmp_path, tiny_model, data_root, limit=8)
    assert "holds 18 samples" in str(e.value) and "stream's length" in str(e.value)
    lines: list[str] = []
    limited = _table(_run("onzeta", tmp_path, tiny_model, data_root, limit=8, force=True, log=lines.append))
    fresh = _table(_run("onzeta", tmp_path / "fresh", tiny_model, data_root, limit=8, cache_dir=tmp_path / "cache"))
    assert len(limited["sample_id"]) == 8
    for k, v in fresh.items():
        np.testing.assert_array_equal(limited[k], v)
    assert not np.array_equal(full["tta_logits"][:8], fresh["tta_logits"])  # what reusing it would have served
    assert not any("already finished" in ln for ln in lines)


def test_a_full_onzeta_run_keeps_no_part_of_a_limited_one(tmp_path, tiny_model, data_root):
    """The resume scan: part 0 of an 8-sample OnZeta run holds positions 0..7, but with another schedule."""
    _run("onzeta", tmp_path, tiny_model, data_root, limit=8)
    lines = _whole_run_equals_a_fresh_one("onzeta", tmp_path, tiny_model, data_root)
    assert any("was written by a run of 8 samples, this run has 18" in ln for ln in lines)


def test_a_limit_that_ends_inside_an_adapt_call_is_computed_when_forced(tmp_path, tiny_model, data_root):
    """TDA reads no later sample, but 5 samples end inside the longer run's second adapt call (adapt_batch 4): the
    5-sample run is refused without --force, and forced it equals a fresh 5-sample run."""
    _run("tda", tmp_path, tiny_model, data_root, part_size=4)
    with pytest.raises(RunError, match="5 is not a multiple of its adapt_batch 4"):
        _run("tda", tmp_path, tiny_model, data_root, limit=5, part_size=4)
    limited = _table(_run("tda", tmp_path, tiny_model, data_root, limit=5, part_size=4, force=True))
    fresh = _table(_run("tda", tmp_path / "fresh", tiny_model, data_root, limit=5, part_size=4,
                        cache_dir=tmp_path / "cache"))
    for k, v in fresh.items():
        np.testing.assert_array_equal(limited[k], v)


# --- issue 35 items 1-2: a shorter run never replaces a finished longer one; a longer run reuses a shorter one ----

def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


@pytest.mark.parametrize("method,limit,why", [
    ("tda", 5, "5 is not a multiple of its adapt_batch 4"),  # the case: the limit cuts an adapt call
    ("onzeta", 8, "stream's length"),  # a method whose rows read the stream's length (prefix_stable False)
    # a method that declares its rows may read later samples (prefix_stable False: the transductive and
    # batch-adapted methods), even at a limit that ends an adapt call
    ("running-mean", 8, "running-mean's rows depend on the samples after them"),
])
def test_a_shorter_run_never_replaces_a_finished_longer_one(tmp_path, tiny_model, data_root, running_mean, method,
                                                            limit, why):
    """A quick `--limit` check that the finished run cannot serve is refused naming that run, and the run stays as
    it was (parts and marker, byte for byte); --out elsewhere keeps both, --force replaces it."""
    paths = _run(method, tmp_path, tiny_model, data_root)
    folder = paths[0].parent
    before = _files(folder)
    with pytest.raises(RunError) as e:
        _run(method, tmp_path, tiny_model, data_root, limit=limit)
    msg = str(e.value)
    assert f"the finished run under {folder} holds 18 samples" in msg and why in msg
    assert "--out" in msg and "--force" in msg and "\n" not in msg
    assert _files(folder) == before and run_is_complete(tmp_path / "out", RunKey("tiny-clip", "dtd", method, 1))
    elsewhere = _run(method, tmp_path / "quick", tiny_model, data_root, limit=limit, cache_dir=tmp_path / "cache")
    assert len(_table(elsewhere)["sample_id"]) == limit and _files(folder) == before
    forced = _run(method, tmp_path, tiny_model, data_root, limit=limit, force=True)
    assert len(_table(forced)["sample_id"]) == limit


def test_zaec_extract_refuses_a_shorter_run_over_a_finished_one_in_one_line(tmp_path, tiny_model_dir, data_root):
    from typer.testing import CliRunner

    from extract.cli import app

    args = ["--method", "tda", "--dataset", "dtd", "--pretrained", f"local-dir:{tiny_model_dir}", "--data-root",
            str(data_root), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
            "--quiet"]
    assert CliRunner().invoke(app, args).exit_code == 0
    res = CliRunner().invoke(app, [*args, "--limit", "50"])
    assert res.exit_code == 0, res.output  # 50 > 18: the whole set, served
    res = CliRunner().invoke(app, [*args, "--limit", "5"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "holds 18 samples" in err[0] and "--force" in err[0], res.stderr


@pytest.mark.parametrize("method", ["tda", "zero"])
def test_a_full_run_after_a_limited_one_keeps_its_rows(tmp_path, tiny_model, data_root, method):
    """A finished 4-sample run (one adapt call, half of part 0) of a method whose rows read no later sample: the
    full run keeps its rows (an online method replays them, an episodic one loads the state recorded after them),
    says so, and equals a fresh full run; no row of positions 0..3 is adapted again outside the replay."""
    _run(method, tmp_path, tiny_model, data_root, limit=4)
    lines: list[str] = []
    calls: list[int] = []
    cls = methods.REGISTRY[method]
    real = cls.adapt

    def counted(self, view_feats):
        calls.append(int(view_feats.shape[0]))
        return real(self, view_feats)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "adapt", counted)
        extended = _table(_run(method, tmp_path, tiny_model, data_root, log=lines.append))
    fresh = _table(_run(method, tmp_path / "fresh", tiny_model, data_root, cache_dir=tmp_path / "cache"))
    for k, v in fresh.items():
        np.testing.assert_array_equal(extended[k], v)
    kept = [ln for ln in lines if "holds stream positions 0..3" in ln]
    assert len(kept) == 1 and "are kept; computing from position 4" in kept[0]
    assert not any("recomputed" in ln or "warning" in ln for ln in lines), lines
    assert sum(calls) == (14 if method == "zero" else 18)  # online TDA replays positions 0..3, episodic ZERO not


def test_a_full_run_after_a_limited_one_that_cut_an_adapt_call_recomputes_it_and_says_why(tmp_path, tiny_model,
                                                                                          data_root):
    _run("tda", tmp_path, tiny_model, data_root, limit=5)
    lines = _whole_run_equals_a_fresh_one("tda", tmp_path, tiny_model, data_root)
    said = [ln for ln in lines if "part-00000" in ln]
    assert len(said) == 1 and "the end of a finished 5-sample run, whose last adapt call held 1 samples where this " \
        "run's holds 4" in said[0] and "nothing kept" in said[0]


def test_an_interrupted_extension_of_a_limited_run_resumes_equal(tmp_path, tiny_model, data_root, monkeypatch):
    """The part whose rows are carried stays on disk until the writer replaces it: interrupted before, the rerun
    carries them again."""
    _run("tda", tmp_path, tiny_model, data_root, limit=4)
    real = interrupt_nth_write(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        _run("tda", tmp_path, tiny_model, data_root)
    monkeypatch.setattr(run_writer, "write_shard", real)
    assert list((tmp_path / "out").rglob("part-00000.parquet"))
    lines = _whole_run_equals_a_fresh_one("tda", tmp_path, tiny_model, data_root)
    assert any("are kept; computing from position 4" in ln for ln in lines)
