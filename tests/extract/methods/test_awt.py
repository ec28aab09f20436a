"""AWT (extract/methods/awt.py) against a slow transcription of the official evaluation (AWT `evaluate.py`:
`get_entropy_weight`, `Sinkhorn`, `optimal_transport`, `AWT_evaluation`) written here from docs/methods.md,
"AWT (`awt`)"; the class descriptions the run reads (`--descriptions-dir`), each missing piece
one line before the model loads; a folder set end to end with description files the tests write."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from extract.methods import REGISTRY
from extract.methods.awt import AWT, AWT_FILES, AWT_TEMPLATES, awt_prompts
from extract.methods.base import HPARAMS_KEYS
from extract.prompts import Descriptions, PromptError, load_descriptions

from tests.support.extract import interrupt_nth_write, make_json_dataset, write_image

pytestmark = pytest.mark.usefixtures("one_thread")

EPS32 = torch.finfo(torch.float32).eps
NAMES = ("cat", "sea lion", "dog")
K = len(NAMES)


def descriptions(n: int = 6) -> Descriptions:
    return Descriptions("t.json", NAMES, tuple(tuple(f"The {c} has trait {i}." for i in range(n)) for c in NAMES))


def make(model, n_desc: int = 5, **changes) -> AWT:
    cfg = dataclasses.replace(AWT.default_config("dtd", "ViT-B-16"), num_descriptions=n_desc, **changes)
    return AWT(cfg, model.encode_texts([f"a photo of a {n}." for n in NAMES]), model.logit_scale, backbone="tiny",
               dataset="dtd", text_encoder=model, class_names=NAMES, descriptions=descriptions(max(n_desc, 1)))


def feats(model, n: int, seed: int = 0, v: int = 64) -> torch.Tensor:
    """(n, v, D) normalised features around the plain prompts, so the transport has something to weigh."""
    g = torch.Generator().manual_seed(seed)
    text = model.encode_texts([f"a photo of a {c}." for c in NAMES])
    y = torch.randint(0, K, (n,), generator=g)
    return F.normalize(text[y][:, None] + 0.7 * torch.randn(n, v, text.shape[1], generator=g), dim=-1)


# ------------------------------------------------------------------------------------------ slow reference

def ref_prompts(template, names, table, n):
    """`AWT_evaluation`'s prompt loop."""
    out = []
    for classname in names:
        prompt = template.format(classname.replace("_", " "))
        out.append(prompt + ".")
        for i in range(n):
            out.append(prompt + ". " + table[classname][i])
    return out


def ref_entropy(logits):
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)


def ref_sinkhorn(kk, u, v):
    r = torch.ones_like(u)
    c = torch.ones_like(v)
    for _ in range(100):
        r0 = r
        r = u / torch.matmul(kk, c.unsqueeze(-1)).squeeze(-1)
        c = v / torch.matmul(kk.permute(0, 2, 1).contiguous(), r.unsqueeze(-1)).squeeze(-1)
        if (r - r0).abs().mean().item() < 1e-2:
            break
    return torch.matmul(r.unsqueeze(-1), c.unsqueeze(-2)) * kk


def ref_awt(image_features, text_features, scale, n_prompt):
    """One sample as `AWT_evaluation` does it (the weights with AWT's scatter, the transport per class)."""
    n_views = image_features.size(0)
    output = scale * image_features @ text_features.t()
    output = output.view(n_views, -1, n_prompt).permute(0, 2, 1).contiguous()
    image_weights = F.softmax(-ref_entropy(output.mean(1)) / 0.5, dim=-1)
    _, n_des, n_cls = output.shape
    anchor = output[0].mean(0)[None, None, :].repeat(n_des, n_cls, 1)
    idx = torch.arange(n_cls)[None, :, None].repeat(n_des, 1, 1)
    anchor.scatter_(dim=2, index=idx, src=output[0].unsqueeze(-1))
    text_weights = F.softmax(-ref_entropy(anchor).t() / 0.5, dim=-1)
    sim = (output / scale).permute(2, 0, 1)
    plan = ref_sinkhorn(torch.exp(-(1.0 - sim) / 0.1), image_weights, text_weights).permute(1, 2, 0)
    return torch.sum(plan * output, dim=(0, 1))


# ------------------------------------------------------------------------------------------ tests

def test_prompts_are_awts():
    table = {"sea_lion": ["It swims.", "It barks."], "cat": ["Whiskers.", "Fur."]}
    assert awt_prompts("a photo of a {}", ["sea_lion", "cat"], [table["sea_lion"], table["cat"]], 2) == ref_prompts(
        "a photo of a {}", ["sea_lion", "cat"], table, 2)


@pytest.mark.parametrize("n_desc", [5, 0])
def test_matches_the_official_evaluation(tiny_model, n_desc):
    """Rows of the method (a batch of 6) against the official loop, one sample at a time, on the first 51 views.
    The transported logit is a sum of V·P terms with weights summing to 1, reduced in another order: within
    V·P eps32 of the largest |logit|."""
    m = make(tiny_model, n_desc=n_desc)
    x = feats(tiny_model, 6, seed=1)
    out = m.adapt(x)
    prompts = awt_prompts("a photo of a {}, which is a type of texture, or a type of pattern", NAMES,
                          descriptions().per_class, n_desc)
    text = tiny_model.encode_texts(prompts)
    assert torch.equal(m.prompt_features, text)
    scale = tiny_model.logit_scale
    for i in range(6):
        expect = ref_awt(x[i, :51], text, scale, 1 + n_desc)
        torch.testing.assert_close(out[i], expect, rtol=0, atol=51 * (1 + n_desc) * EPS32 * scale)
    assert not torch.allclose(out, scale * x[:, 0] @ tiny_model.encode_texts([f"a photo of a {c}." for c in NAMES]).T)


def test_batched_equals_one_at_a_time(tiny_model, monkeypatch):
    """Each sample's Sinkhorn stops at its own round: any batching gives the same rows bit for bit, also when the
    groups that bound memory split a call."""
    import extract.methods.awt as module

    m = make(tiny_model)
    x = feats(tiny_model, 9, seed=2)
    whole = m.adapt(x)
    one = torch.cat([m.adapt(x[i:i + 1]) for i in range(9)])
    assert torch.equal(whole, one)
    monkeypatch.setattr(module, "GROUP_ELEMENTS", 2 * 51 * K * 6)  # groups of two samples
    assert torch.equal(m.adapt(x), whole)


def test_sinkhorn_stops_per_sample():
    """A sample that converges early keeps its plan while another iterates on (the official loop per sample)."""
    from extract.methods.awt import sinkhorn

    g = torch.Generator().manual_seed(3)
    kk = torch.exp(-torch.rand(2, 3, 4, 5, generator=g) * torch.tensor([0.01, 10.0])[:, None, None, None])
    u = torch.softmax(torch.randn(2, 4, generator=g), -1)
    v = torch.softmax(torch.randn(2, 3, 5, generator=g), -1)
    both = sinkhorn(kk, u, v, 1e-2, 100)
    for i in range(2):
        torch.testing.assert_close(both[i], ref_sinkhorn(kk[i], u[i], v[i]), rtol=0, atol=0)


def test_default_configs():
    for ds in HPARAMS_KEYS:
        cfg = AWT.default_config(ds, "RN50")
        assert (cfg.n_views, cfg.used_views, cfg.augmix, cfg.num_descriptions) == (64, 51, False, 50)
        assert (cfg.image_temperature, cfg.text_temperature, cfg.ot_eps, cfg.sinkhorn_threshold,
                cfg.sinkhorn_iters) == (0.5, 0.5, 0.1, 1e-2, 100)
        assert cfg.template == AWT_TEMPLATES[ds] and AWT.descriptions_request(cfg, ds)[0] == AWT_FILES[ds]
    assert AWT.descriptions_request(AWT.default_config("imagenet", "RN50"), "imagenet_c:fog:3")[0] == "imagenet.json"
    assert REGISTRY["awt"] is AWT and AWT.prefix_stable and AWT.needs_descriptions


# --- the descriptions the run reads ---------------------------------------------------------------------------

def _write(folder, name, table):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(table))


def test_load_descriptions_matches_names_and_pairs_official_files_by_position(tmp_path):
    table = {"CAT": ["a"] * 3, "sea_lion": ["b"] * 3, "dog": ["c"] * 3}
    _write(tmp_path, "x.json", table)
    d = load_descriptions(tmp_path, "x.json", NAMES, method="awt", need=3, by_position=False, where="w")
    assert d.names == ("CAT", "sea_lion", "dog") and d.per_class[1] == ("b",) * 3 and not d.warnings
    # an official file naming a class otherwise (AWT's eurosat.json) is paired by position, with a warning
    _write(tmp_path, "e.json", {"cat": ["a"], "brushland": ["b"], "dog": ["c"]})
    d = load_descriptions(tmp_path, "e.json", NAMES, method="awt", need=1, by_position=True, where="w")
    assert d.names == ("cat", "brushland", "dog") and "paired with the classes by position" in d.warnings[0]
    with pytest.raises(PromptError, match=r"e.json has no descriptions for class 'sea lion'$"):
        load_descriptions(tmp_path, "e.json", NAMES, method="awt", need=1, by_position=False, where="w")


@pytest.mark.parametrize("case, needle", [
    ("no_dir", "awt reads class descriptions from x.json in --descriptions-dir (or $ZAEC_DESCRIPTIONS_DIR); "
               "neither is set (FROM)"),
    ("no_file", "x.json does not exist; it needs the class descriptions of this dataset there (FROM)"),
    ("no_class", "x.json has no descriptions for class 'sea lion' (and 1 more)"),
    ("too_few", "x.json: class 'dog' has 2 description(s), awt uses 3 per class"),
])
def test_load_descriptions_errors_name_file_and_class(tmp_path, monkeypatch, case, needle):
    monkeypatch.delenv("ZAEC_DESCRIPTIONS_DIR", raising=False)
    table = {"cat": ["a"] * 3, "sea lion": ["b"] * 3, "dog": ["c"] * 2}
    if case == "no_class":
        table = {"cat": ["a"] * 3}
    if case != "no_file":
        _write(tmp_path, "x.json", table)
    folder = None if case == "no_dir" else tmp_path
    with pytest.raises(PromptError) as e:
        load_descriptions(folder, "x.json", NAMES, method="awt", need=3, by_position=False, where="FROM")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def folder_set(tmp_path_factory):
    """A 3-class folder set `pets` (4 images each) and its description file `pets.json`."""
    root = tmp_path_factory.mktemp("awt-set")
    rng = np.random.default_rng(5)
    for c in ("cat", "dog", "sea_lion"):
        for i in range(4):
            write_image(root / "pets" / c / f"{i}.png", rng)
    _write(root / "desc", "pets.json", {c: [f"A {c} with trait {i}." for i in range(50)]
                                        for c in ("cat", "dog", "sea lion")})
    return root


def test_cli_folder_set_runs_and_missing_descriptions_stop_before_the_model(tmp_path, folder_set, tiny_model_dir,
                                                                             monkeypatch):
    """`zaec-extract --method awt` on a folder set: `<set name>.json` from --descriptions-dir; without the
    folder, or with a class missing, one line and exit 2 before the model loads."""
    import extract.runner
    from extract.cli import app
    from schemas.shard import find_shards, read_shard

    base = ["--method", "awt", "--dataset", f"folder:{folder_set / 'pets'}", "--out", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "cache"), "--pretrained", f"local-dir:{tiny_model_dir}", "--device",
            "cpu", "--quiet"]
    run = CliRunner().invoke
    r = run(app, base + ["--descriptions-dir", str(folder_set / "desc")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "out"])
    meta = read_shard(path).meta
    assert json.loads(meta.extra["zaec:descriptions"])["file"] == "pets.json"
    assert meta.method_config["template"] == "a photo of a {}"  # ImageNet's row for unseen data
    monkeypatch.setattr(extract.runner, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    monkeypatch.delenv("ZAEC_DESCRIPTIONS_DIR", raising=False)
    r = run(app, base + ["--force"], catch_exceptions=False)
    assert r.exit_code == 2 and "awt reads class descriptions from pets.json in --descriptions-dir" in r.output
    _write(tmp_path / "bad", "pets.json", {"cat": ["x"] * 50, "dog": ["y"] * 50})
    r = run(app, base + ["--force", "--descriptions-dir", str(tmp_path / "bad")], catch_exceptions=False)
    assert r.exit_code == 2 and "has no descriptions for class 'sea lion'" in " ".join(r.output.split())
    assert "Traceback" not in r.output


def test_run_resumes_equal_to_an_uninterrupted_run_and_descriptions_are_a_setting(tmp_path, tiny_model,
                                                                                   monkeypatch):
    """Stateless rows: an interrupted run resumes to the uninterrupted rows bit for bit; a changed description
    file makes the finished run's settings differ (`descriptions`)."""
    from extract.run import writer
    from extract.run.options import RunError
    from extract.runner import run_extraction
    from schemas.shard import read_shard, validate_shard

    from extract.datasets import load_testset

    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=4)
    desc = tmp_path / "desc"
    classes = load_testset("dtd", tmp_path / "data").class_names
    _write(desc, "dtd.json", {c: [f"{c} looks like pattern {i}." for i in range(50)] for c in classes})
    kw = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=tiny_model, progress=False,
              part_size=4, adapt_batch=2, chunk_size=5, batch_size=16, descriptions_dir=desc)
    full_paths = run_extraction("awt", "dtd", out=tmp_path / "full", **kw)
    assert len(full_paths) == 3 and all(validate_shard(p) == [] for p in full_paths)
    full = np.concatenate([read_shard(p).tta_logits for p in full_paths])
    real_write = interrupt_nth_write(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_extraction("awt", "dtd", out=tmp_path / "r", **kw)
    monkeypatch.setattr(writer, "write_shard", real_write)
    resumed = np.concatenate([read_shard(p).tta_logits for p in run_extraction("awt", "dtd", out=tmp_path / "r",
                                                                                **kw)])
    np.testing.assert_array_equal(resumed, full)
    _write(desc, "dtd.json", {c: [f"{c} is pattern {i}." for i in range(50)] for c in classes})
    with pytest.raises(RunError, match="different settings: descriptions"):
        run_extraction("awt", "dtd", out=tmp_path / "full", **kw)


def test_sweep_reads_the_descriptions_before_submitting(tmp_path, monkeypatch):
    """`zaec-sweep run --methods awt`: the data check reads each run's description file as `zaec-extract` would
    (one line naming the file, exit 2, nothing submitted); `--descriptions-dir` reaches the runs, made absolute."""
    from extract.datasets import load_testset
    from extract.sweep import cli as sweep_cli

    monkeypatch.delenv("ZAEC_DESCRIPTIONS_DIR", raising=False)
    make_json_dataset(tmp_path / "data", "dtd", n_classes=2, per_class=1)
    captured = []
    monkeypatch.setattr(sweep_cli, "sweep_run", lambda runs, *a, **k: captured.extend(runs) or 0)
    args = ["run", "--methods", "awt,tda", "--datasets", "dtd", "--out", str(tmp_path / "o"), "--data-root",
            str(tmp_path / "data"), "--no-wait"]
    res = CliRunner().invoke(sweep_cli.app, args)
    assert res.exit_code == 2 and "awt reads class descriptions from dtd.json in --descriptions-dir" in res.stderr
    assert not captured
    names = load_testset("dtd", tmp_path / "data").class_names
    _write(tmp_path / "desc", "dtd.json", {n: ["x"] * 50 for n in names})
    res = CliRunner().invoke(sweep_cli.app, args + ["--descriptions-dir", str(tmp_path / "desc")])
    assert res.exit_code == 0, res.output + res.stderr
    assert {r.options.descriptions_dir for r in captured} == {str((tmp_path / "desc").resolve())}
