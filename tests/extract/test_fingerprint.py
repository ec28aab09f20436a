"""Extraction you can trust with real data: stale data is never served, partial runs and bad input are named."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from extract.datasets import load_testset
from extract.fingerprint import fingerprint
from extract.run.options import RunError
from extract.runner import run_extraction
from schemas.shard import read_shard

from tests.support.extract import make_json_dataset

SMALL = dict(part_size=8, adapt_batch=4, chunk_size=5, batch_size=3, progress=False)


def _run(root, out, cache, model, method="zero-shot", **kw):
    return run_extraction(method, "dtd", data_root=root, out=out, cache_dir=cache, model=model,
                          **{**SMALL, **kw})


def _logits(paths):
    return np.concatenate([read_shard(p).zs_logits for p in paths])


def _ids(paths):
    return np.concatenate([read_shard(p).sample_id for p in paths])


@pytest.fixture
def two_roots(tmp_path):
    """Two copies of one dataset with the same split file; the second copy's images differ."""
    a, b = tmp_path / "a", tmp_path / "b"
    make_json_dataset(a, "dtd", n_classes=3, per_class=2, seed=0)
    split = (a / "dtd" / "split_zhou_DescribableTextures.json").read_text()
    make_json_dataset(b, "dtd", n_classes=3, per_class=2, seed=5)  # other pixels, same names and labels
    assert (b / "dtd" / "split_zhou_DescribableTextures.json").read_text() != split  # other shuffle...
    (b / "dtd" / "split_zhou_DescribableTextures.json").write_text(split)  # ...made identical
    return a, b


def test_fingerprint_modes_notice_changes(two_roots):
    a, b = two_roots
    ta, tb = load_testset("dtd", a), load_testset("dtd", b)
    assert ta.fingerprint() == tb.fingerprint()  # the sample list cannot tell the copies apart
    assert fingerprint(ta) != fingerprint(tb)
    assert fingerprint(ta).startswith("stat:") and fingerprint(ta, "content").startswith("content:")
    before = {m: fingerprint(ta, m) for m in ("stat", "content")}
    p = ta.paths[0]
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: same bytes, new time
    assert fingerprint(ta, "stat") != before["stat"] and fingerprint(ta, "content") == before["content"]
    shutil.copyfile(ta.paths[1], p)  # replaced bytes
    assert fingerprint(ta, "content") != before["content"]
    with pytest.raises(Exception, match="available: stat, content"):
        fingerprint(ta, "mtime")


def test_other_root_same_split_recomputes_or_refuses(tmp_path, two_roots, tiny_model):
    a, b = two_roots
    out, cache = tmp_path / "out", tmp_path / "cache"
    pa_ = _run(a, out, cache, tiny_model)
    meta = read_shard(pa_[0]).meta.extra
    assert meta["zaec:data_root"] == str(a.resolve())
    assert meta["zaec:data_fingerprint"] == fingerprint(load_testset("dtd", a))
    # same --out: the finished run is not served for the other copy; the refusal says why
    with pytest.raises(RunError, match=r"data_fingerprint \(the image files changed.*data_root \(another data root"):
        _run(b, out, cache, tiny_model)
    # a new --out, the same cache: recomputed from the other copy's images
    pb = _run(b, tmp_path / "out_b", cache, tiny_model)
    la, lb = _logits(pa_), _logits(pb)
    np.testing.assert_array_equal(_ids(pa_), _ids(pb))
    assert not np.allclose(la, lb)
    ref = _run(b, tmp_path / "ref", tmp_path / "fresh_cache", tiny_model)
    np.testing.assert_array_equal(lb, _logits(ref))  # equals a run that never saw the first copy


def test_changed_image_in_place_recomputes(tmp_path, two_roots, tiny_model):
    a, b = two_roots
    out, cache = tmp_path / "out", tmp_path / "cache"
    first = _logits(_run(a, out, cache, tiny_model))
    ts = load_testset("dtd", a)
    sid = int(_ids(_run(a, out, cache, tiny_model))[0])  # the finished run is reused while nothing changed
    shutil.copyfile(load_testset("dtd", b).paths[sid], ts.paths[sid])  # the image is fixed in place
    with pytest.raises(RunError, match="data_fingerprint"):
        _run(a, out, cache, tiny_model)
    again = _logits(_run(a, out, cache, tiny_model, force=True))
    assert not np.array_equal(again[0], first[0])  # the fixed image was re-encoded, not served from the cache
    np.testing.assert_array_equal(again[1:], first[1:])  # the others are the same images
    ref = _logits(_run(a, tmp_path / "ref", tmp_path / "fresh_cache", tiny_model))
    np.testing.assert_array_equal(again, ref)


def test_writer_announces_counts_and_resumed_parts_agree(tmp_path, tiny_model):
    from calibrate.run import check_complete
    from schemas.shard import PartialRunError, find_shards, group_shards

    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)  # 18 samples; parts of 8 rows
    out, cache = tmp_path / "out", tmp_path / "cache"
    limited = _run(root, out, cache, tiny_model, limit=8)
    assert read_shard(limited[0]).meta.extra["zaec:limit"] == "8"
    assert read_shard(limited[0]).meta.extra["zaec:n_total"] == "18"
    full = _run(root, out, cache, tiny_model)  # keeps part 0, restamps it with this run's limit
    assert [read_shard(p).meta.extra["zaec:limit"] for p in full] == ["none"] * 3
    assert check_complete(group_shards(find_shards([out]))) == []
    full[-1].unlink()  # a crash before the last part: 16 of 18 rows
    (full[0].parent / "_zaec_complete.json").unlink()
    with pytest.raises(PartialRunError, match="16 of 18 samples in 2 shard"):
        check_complete(group_shards(find_shards([out])))


# --- bad input: one line on stderr, exit 2, nothing half-written, checked before any image is read ------------

def _tiny_ckpt(d, name, cut=None, layers=1):
    """A tiny checkpoint of the registered TINY_ARCH; `cut` truncates it, `layers` != 1 makes it another arch."""
    import open_clip
    from tests.support.extract import make_tiny_checkpoint, tiny_model_cfg
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    path = make_tiny_checkpoint(d / name)
    if layers != 1:
        cfg = tiny_model_cfg()
        cfg["vision_cfg"] = dict(cfg["vision_cfg"], layers=layers)
        save_file({k: v.contiguous() for k, v in open_clip.CLIP(**cfg).state_dict().items()}, str(path))
    if cut is not None:
        path.write_bytes(path.read_bytes()[:cut])
    return path


def _ro(path):
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    return path


def _garbage_local_dir(d, model_dir):
    shutil.copytree(model_dir, d / "m")
    (d / "m" / "open_clip_model.safetensors").write_bytes(b"\x00" * 64)
    return f"local-dir:{d / 'm'}"


#: (id, argv builder (tmp_path, data_root, model) -> args replacing the defaults, expected words of the one line)
BAD_INPUTS = [
    ("batch-size-0", lambda t, r, m: {"--batch-size": "0"}, "--batch-size must be a positive integer, got 0"),
    ("batch-size-neg", lambda t, r, m: {"--batch-size": "-1"}, "--batch-size must be a positive integer, got -1"),
    ("workers-neg", lambda t, r, m: {"--workers": "-2"}, "--workers must be >= 0, got -2"),
    ("out-read-only", lambda t, r, m: {"--out": str(_ro(t / "ro") / "shards")}, "is not writable"),
    ("cache-read-only", lambda t, r, m: {"--cache-dir": str(_ro(t / "ro"))}, "--cache-dir"),
    ("cwd-read-only-default-data", lambda t, r, m: {"--out": None, "--cache-dir": None, "cwd": _ro(t / "ro")},
     "--out data/shards (to be created in .): folder . is not writable"),
    ("out-is-file", lambda t, r, m: {"--out": str(_touch(t / "f.txt"))}, "f.txt is a file, expected a folder"),
    ("cache-is-file", lambda t, r, m: {"--cache-dir": str(_touch(t / "f.txt") / "sub")},
     "f.txt is a file, expected a folder"),
    ("safetensors-truncated", lambda t, r, m: {"--pretrained": str(_tiny_ckpt(t / "w", "t.safetensors", cut=300)),
                                               "--backbone": "zaec-tiny-vit"},
     "not a readable safetensors file (truncated or corrupt?)"),
    ("safetensors-garbage-local-dir", lambda t, r, m: {"--pretrained": _garbage_local_dir(t, m)},
     "not a readable safetensors file"),
    ("wrong-architecture", lambda t, r, m: {"--pretrained": str(_tiny_ckpt(t / "w", "two.safetensors", layers=2)),
                                            "--backbone": "zaec-tiny-vit"},
     "does not fit the architecture zaec-tiny-vit: Unexpected key(s) in state_dict (12): visual.transformer."),
    ("folder-without-local-dir", lambda t, r, m: {"--pretrained": str(m)}, "pass --pretrained local-dir:"),
    ("set-nan", lambda t, r, m: {"--set": "alpha=nan"}, "tda: alpha=nan is out of range; valid: alpha >= 0"),
    ("set-inf", lambda t, r, m: {"--set": "beta=inf"}, "tda: beta=inf is out of range; valid: beta >= 0"),
    ("set-fraction-0", lambda t, r, m: {"--set": "selection_p=0"},
     "tda: selection_p=0.0 is out of range; valid: 0 < selection_p <= 1"),
    ("set-fraction-2", lambda t, r, m: {"--set": "selection_p=2"},
     "tda: selection_p=2.0 is out of range; valid: 0 < selection_p <= 1"),
    ("set-capacity-neg", lambda t, r, m: {"--set": "pos_capacity=-1"},
     "tda: pos_capacity=-1 is out of range; valid: pos_capacity >= 1"),
    ("limit-abc", lambda t, r, m: {"--limit": "abc"}, "Invalid value for '--limit'"),
    ("limit-0", lambda t, r, m: {"--limit": "0"}, "--limit must be >= 1, got 0"),
    ("unknown-option", lambda t, r, m: {"--bogus": "1"}, "No such option: --bogus"),
    ("fingerprint-mode", lambda t, r, m: {"--fingerprint": "mtime"}, "available: stat, content"),
    # these already worked before issue 14; kept here so they stay one line
    ("seed-neg", lambda t, r, m: {"--seed": "-1"}, "seed must be >= 0, got -1"),
    ("unknown-method", lambda t, r, m: {"--method": "tdaa"}, "unknown method 'tdaa'; available: zero-shot, tda"),
    ("unknown-dataset", lambda t, r, m: {"--dataset": "dtdd"}, "unknown dataset 'dtdd'; available:"),
    ("set-no-equals", lambda t, r, m: {"--set": "alpha"}, "--set expects key=value, got 'alpha'"),
    ("set-not-float", lambda t, r, m: {"--set": "alpha=big"}, "alpha: expected float, got 'big'"),
    ("missing-checkpoint", lambda t, r, m: {"--pretrained": str(t / "none.pt")}, "none.pt does not exist"),
    ("data-root-missing", lambda t, r, m: {"--data-root": str(t / "nowhere")}, "nowhere (from --data-root) is not"),
]


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    return path


@pytest.fixture(scope="module")
def cli_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input-data")
    make_json_dataset(root, "dtd", n_classes=2, per_class=3)
    return root


def _cli(args, capsys):
    from extract.cli import main
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("build, needle", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_one_line_exit_2_nothing_read_or_written(tmp_path, cli_data, tiny_model_dir, capsys,
                                                           monkeypatch, build, needle):
    import extract.run.encode
    import extract.run.options

    opts = {"--method": "tda", "--dataset": "dtd", "--data-root": str(cli_data), "--out": str(tmp_path / "out"),
            "--cache-dir": str(tmp_path / "cache"), "--pretrained": f"local-dir:{tiny_model_dir}",
            "--device": "cpu", "--quiet": ""}
    opts.update(build(tmp_path, cli_data, tiny_model_dir))
    cwd = opts.pop("cwd", None)
    read_only = [p for p in tmp_path.rglob("ro")] + ([cwd] if cwd else [])
    if read_only and os.geteuid() == 0:
        # root writes through 0o555: emulate the read-only folder the way the check sees it
        real_access = os.access
        monkeypatch.setattr(extract.run.options.os, "access", lambda p, mode, **kw: False if any(
            os.path.abspath(p) == os.path.abspath(r) for r in read_only) else real_access(p, mode, **kw))
    if cwd:
        monkeypatch.chdir(cwd)
    opened = []
    monkeypatch.setattr(extract.run.encode, "open_image", lambda p: opened.append(p))
    args = [a for k, v in opts.items() if v is not None for a in ([k, v] if v != "" else [k])]
    code, out, err = _cli(args, capsys)
    for r in read_only:
        r.chmod(0o755)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    assert opened == []  # failed before any image was read
    assert not list(tmp_path.rglob("*.parquet")) and not list(tmp_path.rglob("_zaec_complete.json"))
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("chunk-*.npy"))


def test_nonfinite_logits_fail_the_run_naming_the_sample(tmp_path, tiny_model, monkeypatch):
    import torch
    import extract.methods as methods
    from extract.methods.zero_shot import ZeroShot
    from extract.run.rundir import run_is_complete
    from extract.run.stream import stream_permutation
    from schemas.shard import RunKey

    class Poisoned(ZeroShot):
        """Zero-shot logits, but NaN from stream position 10 on (a method whose state went bad)."""
        key = "poisoned"

        def _adapt(self, view_feats):
            out = super()._adapt(view_feats)
            pos = self.n_seen + torch.arange(out.shape[0])
            return torch.where((pos >= 10)[:, None], torch.full_like(out, float("nan")), out)

    monkeypatch.setitem(methods.REGISTRY, "poisoned", Poisoned)
    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)
    sid = int(stream_permutation("dtd", 1, 18)[10])
    with pytest.raises(RunError, match=rf"method 'poisoned' produced non-finite adapted logits for sample_id {sid} "
                                       r"at stream position 10 \(2 of 4 row\(s\) in this batch\); the run is not "
                                       "marked complete"):
        _run(root, tmp_path / "out", tmp_path / "cache", tiny_model, method="poisoned")
    assert not run_is_complete(tmp_path / "out", RunKey("tiny-clip", "dtd", "poisoned", 1))
    parts = sorted((tmp_path / "out").rglob("*.parquet"))
    assert [len(read_shard(p)) for p in parts] == [8]  # the finite part before it stays; nothing after it



# --- --limit encodes only what it needs ----------------------------------------------------------------------------

def _count_encoded(monkeypatch, model):
    calls: list[int] = []
    orig = type(model).encode_images
    monkeypatch.setattr(type(model), "encode_images", lambda self, x: calls.append(len(x)) or orig(self, x))
    return calls


def _cache_arrays(cache):
    return {str(p.relative_to(cache).parts[-2:]): np.load(p) for p in sorted(cache.rglob("chunk-*.npy"))}


def test_limit_encodes_only_needed_positions_and_extends_prefix(tmp_path, tiny_model, monkeypatch):
    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)  # 18 samples, chunks of 5, micro-batches of 2
    kw = dict(chunk_size=5, batch_size=2)
    calls = _count_encoded(monkeypatch, tiny_model)
    cache = tmp_path / "cache"
    _run(root, tmp_path / "o3", cache, tiny_model, limit=3, **kw)
    assert sum(calls) == 3  # not the whole first chunk (5)
    calls.clear()
    _run(root, tmp_path / "o8", cache, tiny_model, limit=8, **kw)
    # chunk 0 keeps its 2 rows up to the micro-batch boundary and re-encodes 2..4; chunk 1: positions 5..7
    assert sum(calls) == 3 + 3
    calls.clear()
    full = _run(root, tmp_path / "full", cache, tiny_model, **kw)
    assert sum(calls) == 3 + 5 + 3  # chunk 1 keeps 5..6 and encodes 7..9 (7 again); chunks 2 and 3
    calls.clear()
    fresh = _run(root, tmp_path / "fresh", tmp_path / "cache2", tiny_model, **kw)
    # the extended chunks equal chunks encoded whole (same micro-batches), and so do the shards
    a, b = _cache_arrays(cache), _cache_arrays(tmp_path / "cache2")
    assert a.keys() == b.keys() and len(a) == 4
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(_logits(full), _logits(fresh))


def test_limit_with_64_views_encodes_limit_times_64_images(tmp_path, tiny_model, monkeypatch):
    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=6)
    calls = _count_encoded(monkeypatch, tiny_model)
    _run(root, tmp_path / "out", tmp_path / "cache", tiny_model, limit=2, chunk_size=16, batch_size=64,
         overrides={"n_views": "64", "augmix": "true"})
    assert sum(calls) == 2 * 64  # 2 originals + 2 x 63 augmented views, not 16 x 64
    shapes = sorted(np.load(p).shape[:2] for p in (tmp_path / "cache").rglob("chunk-*.npy"))
    assert shapes == [(2, 16), (2, 63)]  # prefixes of the first chunk: (2, D) view 0, (2, 63, D) augmented


# --- small things --------------------------------------------------------------------------------------------------

def test_quiet_keeps_warnings_and_the_last_line_is_unwrapped(tmp_path, cli_data, tiny_model_dir,
                                                             capsys):
    out = tmp_path / ("a-long-folder-name-" * 5) / "shards"
    code, stdout, err = _cli(["--method", "dpe", "--dataset", "dtd", "--limit", "2", "--data-root", cli_data,
                              "--out", out, "--cache-dir", tmp_path / "cache", "--cupl-dir", tmp_path / "no-cupl",
                              "--pretrained", f"local-dir:{tiny_model_dir}", "--device", "cpu", "--quiet"], capsys)
    assert code == 0, err
    assert "warning:" in err and "CuPL" in err  # the fallback to templates is said even with --quiet
    sdir = out / "backbone=tiny-clip" / "dataset=dtd" / "method=dpe" / "seed=1"
    assert stdout.splitlines()[-1] == f"1 shard(s) in {sdir}"  # one line, whatever its length


def test_runs_from_before_fingerprints_are_recomputed(tmp_path, tiny_model):
    root = tmp_path / "data"
    make_json_dataset(root, "dtd", n_classes=3, per_class=3)
    out, cache = tmp_path / "out", tmp_path / "cache"
    paths = _run(root, out, cache, tiny_model)
    want = _logits(paths)
    # rewrite the run as an older zaec wrote it: no data keys in the marker's settings or the shards' metadata
    import dataclasses
    import json as _json

    from schemas.shard import write_shard
    marker = paths[0].parent / "_zaec_complete.json"
    info = _json.loads(marker.read_text())
    for k in ("data_root", "data_fingerprint"):
        del info["settings"][k]
    marker.write_text(_json.dumps(info))
    for p in paths:
        sh = read_shard(p)
        extra = {k: v for k, v in sh.meta.extra.items() if k not in ("zaec:data_root", "zaec:data_fingerprint")}
        write_shard(p, dataclasses.replace(sh.meta, extra=extra), sh.sample_id, sh.label, sh.zs_logits,
                    sh.tta_logits, stream_pos=sh.stream_pos)
    notes = []
    again = run_extraction("zero-shot", "dtd", data_root=root, out=out, cache_dir=cache, model=tiny_model,
                           log=notes.append, **SMALL)
    assert any("predates data fingerprints" in n for n in notes)
    assert all("zaec:data_fingerprint" in read_shard(p).meta.extra for p in again)
    np.testing.assert_array_equal(_logits(again), want)
    (again[0].parent / "_zaec_complete.json").unlink()  # an interrupted legacy run: its parts are rewritten too
    for p in again:
        sh = read_shard(p)
        extra = {k: v for k, v in sh.meta.extra.items() if k != "zaec:data_fingerprint"}
        write_shard(p, dataclasses.replace(sh.meta, extra=extra), sh.sample_id, sh.label, sh.zs_logits,
                    sh.tta_logits, stream_pos=sh.stream_pos)
    third = run_extraction("zero-shot", "dtd", data_root=root, out=out, cache_dir=cache, model=tiny_model, **SMALL)
    assert all("zaec:data_fingerprint" in read_shard(p).meta.extra for p in third)


def test_user_folder_dataset_gets_the_fingerprint_for_free(tmp_path, tiny_model, monkeypatch):
    import extract.datasets as ds
    from tests.support.extract import write_image
    monkeypatch.setattr(ds, "_USER_SPECS", {})  # as a fresh process: no user dataset registered yet
    rng = np.random.default_rng(0)
    root = tmp_path / "pets"
    for c in ("cat", "dog"):
        for i in range(2):
            write_image(root / c / f"{i}.png", rng)
    ref = f"folder:{root}"
    kw = dict(out=tmp_path / "out", cache_dir=tmp_path / "cache", model=tiny_model, progress=False)
    paths = run_extraction("zero-shot", ref, **kw)
    extra = read_shard(paths[0]).meta.extra
    assert extra["zaec:data_root"] == str(root.resolve())  # a user's folder needs no data root: its own folder
    assert extra["zaec:data_fingerprint"] == fingerprint(load_testset(ds.resolve_dataset(ref)))
    shutil.copyfile(root / "dog" / "0.png", root / "cat" / "0.png")
    with pytest.raises(RunError, match="data_fingerprint"):
        run_extraction("zero-shot", ref, **kw)
