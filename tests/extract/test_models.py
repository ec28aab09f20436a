"""Model loading through the one code path (local-dir, checkpoint file), offline failures, text prototypes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from extract.models import ModelError, load_model, resolve_device, skip_random_init

from tests.support.extract import (
    TINY_ARCH,
    make_json_dataset,
    make_tiny_checkpoint,
    make_tiny_model_dir,
    register_tiny_arch,
)

EPS32 = torch.finfo(torch.float32).eps  # float32 tolerances below are multiples of it

ROOT = Path(__file__).resolve().parents[2]


def _uses_quick_gelu(model: torch.nn.Module) -> bool:
    from open_clip.transformer import QuickGELU
    return any(isinstance(m, QuickGELU) for m in model.modules())


def test_local_dir_loads_config_and_weights(tiny_model, tiny_model_dir):
    m = tiny_model
    assert m.backbone == "tiny-clip"  # the directory's model name is recorded
    assert m.preprocess.size == (32, 32)
    assert m.logit_scale == pytest.approx(37.5, rel=8 * EPS32)  # the model's own scale, not 100 (a float32 exp)
    assert m.quick_gelu and _uses_quick_gelu(m.model)
    from safetensors.torch import load_file
    sd = load_file(str(tiny_model_dir / "open_clip_model.safetensors"))
    for k, v in m.model.state_dict().items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize("kind", ["local-dir", "file", "jit"])
def test_loading_without_random_init_gives_the_same_model(tmp_path, kind):
    """load_model skips the random initialisation that the strict load overwrites: every parameter and every
    buffer (the non-persistent attention mask too) equals that of a model built the usual way and loaded after."""
    import open_clip
    d = make_tiny_model_dir(tmp_path / "m")
    if kind == "local-dir":
        got, ref = load_model(None, f"local-dir:{d}", "cpu").model, open_clip.create_model(f"local-dir:{d}")
    else:
        ckpt = make_tiny_checkpoint(tmp_path / ("t.safetensors" if kind == "file" else "t.pt"),
                                    fmt="safetensors" if kind == "file" else "jit")
        got = load_model(TINY_ARCH, str(ckpt), "cpu").model
        if kind == "file":
            ref = open_clip.create_model(TINY_ARCH, pretrained=str(ckpt))
        else:
            from extract.models import torchscript_state_dict
            ref = open_clip.create_model(TINY_ARCH)
            expected = set(ref.state_dict())
            ref.load_state_dict({k: v for k, v in torchscript_state_dict(ckpt).items() if k in expected})
    for name, t in [*ref.named_parameters(), *ref.named_buffers()]:
        other = dict([*got.named_parameters(), *got.named_buffers()])[name]
        assert torch.equal(other, t), name
    # the initialisers are back: they draw again outside the block
    x = torch.full((64,), 7.0)
    with skip_random_init():
        torch.nn.init.normal_(x)
        assert torch.equal(x, torch.full((64,), 7.0))
    torch.nn.init.normal_(x)
    assert not torch.equal(x, torch.full((64,), 7.0))


def test_skip_random_init_reaches_initialisers_imported_by_name():
    """nn.MultiheadAttention calls the `xavier_uniform_` its module imported from torch.nn.init (0.8 s of ViT-B-16's
    load when it drew): inside the block building one draws no random number at all, and after it, it draws."""
    state = torch.random.get_rng_state()
    with skip_random_init():
        torch.nn.MultiheadAttention(64, 4)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.nn.MultiheadAttention(64, 4)
    assert not torch.equal(torch.random.get_rng_state(), state)


def test_lazy_tokenizer_tokenises_as_open_clip(tiny_model, tiny_model_dir):
    import open_clip
    texts = ["a photo of a cat.", "a dog"]
    got = tiny_model.tokenizer(texts)
    assert got.shape == (2, 32)  # the model's own context length
    assert torch.equal(got, open_clip.get_tokenizer(f"local-dir:{tiny_model_dir}")(texts))


def test_local_dir_without_model_name_uses_folder_name(tmp_path):
    d = make_tiny_model_dir(tmp_path / "my-model", model_name=None, quick_gelu=False)
    m = load_model(None, f"local-dir:{d}", "cpu")
    assert m.backbone == "my-model" and not m.quick_gelu and not _uses_quick_gelu(m.model)


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "jit"])
def test_checkpoint_file_same_weights_as_local_dir(tmp_path, tiny_model, fmt):
    ckpt = make_tiny_checkpoint(tmp_path / f"tiny.{fmt}", seed=0, fmt=fmt)
    m = load_model(TINY_ARCH, str(ckpt), "cpu", quick_gelu=True)
    assert m.backbone == TINY_ARCH and m.weights_file == str(ckpt)
    x = torch.randn(3, 3, 32, 32)
    # same weights; TorchScript may fuse ops differently: unit-norm features within ~width (32) eps
    torch.testing.assert_close(m.encode_images(x), tiny_model.encode_images(x), rtol=0, atol=32 * EPS32)
    # a checkpoint file of a non-OpenAI architecture keeps the config's activation unless asked
    assert not load_model(TINY_ARCH, str(ckpt), "cpu").quick_gelu


class _Payload:
    pass


def test_pickled_objects_are_refused(tmp_path):
    """A .pt holding Python objects is never unpickled (weights_only loading)."""
    from tests.support.extract import register_tiny_arch
    register_tiny_arch()
    bad = tmp_path / "evil.pt"
    torch.save({"state_dict": {"x": _Payload()}}, bad)
    with pytest.raises(ModelError, match="cannot build"):
        load_model(TINY_ARCH, str(bad), "cpu")


def test_fingerprint_distinguishes_weights(tmp_path, tiny_model):
    other = make_tiny_model_dir(tmp_path / "other", seed=1)
    assert load_model(None, f"local-dir:{other}", "cpu").fingerprint != tiny_model.fingerprint


def test_encode_outputs_are_normalised(tiny_model):
    f = tiny_model.encode_images(torch.randn(4, 3, 32, 32))
    assert f.dtype == torch.float32 and f.shape == (4, 16)
    torch.testing.assert_close(f.norm(dim=-1), torch.ones(4), rtol=0, atol=2 * 16 * EPS32)  # a width-16 norm


def test_text_prototypes_match_independent_average(tiny_model):
    import open_clip
    prompts = [["a photo of a cat.", "itap of a cat."], ["a dog texture."], ["x.", "y.", "z."]]
    got = tiny_model.text_prototypes(prompts, batch_size=2)
    tok = open_clip.get_tokenizer(tiny_model.arch)
    want = []
    with torch.no_grad():
        for ps in prompts:
            e = tiny_model.model.encode_text(tok(ps)).float()
            e = e / e.norm(dim=-1, keepdim=True)
            mean = e.mean(0)
            want.append(mean / mean.norm())
    # other batch shapes through the width-32 tower (~32 eps per unit feature), then a mean of <= 3 and a norm
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=64 * EPS32)


@pytest.mark.parametrize("kwargs, match", [
    (dict(backbone="ViT-B-16", pretrained="/no/such/file.pt"), "does not exist"),
    (dict(backbone="ViT-B-16", pretrained="no-such-tag"), "unknown pretrained tag 'no-such-tag'.*openai"),
    (dict(backbone="ViT-Q-99", pretrained="openai"), "unknown backbone 'ViT-Q-99'"),
])
def test_bad_model_names(kwargs, match):
    with pytest.raises(ModelError, match=match):
        load_model(kwargs["backbone"], kwargs["pretrained"], "cpu")


def test_local_dir_problems(tmp_path):
    with pytest.raises(ModelError, match="no such directory"):
        load_model(None, f"local-dir:{tmp_path / 'nope'}", "cpu")
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelError, match="open_clip_config.json is missing"):
        load_model(None, f"local-dir:{tmp_path / 'd'}", "cpu")
    d = make_tiny_model_dir(tmp_path / "w")
    (d / "open_clip_model.safetensors").unlink()
    with pytest.raises(ModelError, match="no weights file.*open_clip_model.safetensors"):
        load_model(None, f"local-dir:{d}", "cpu")


def test_unavailable_device():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ModelError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ModelError, match="unknown device"):
        resolve_device("tpu9")
    assert resolve_device(None).type == "cpu"


def test_offline_missing_openai_weights_fail_fast_via_cli(tmp_path):
    """The real CLI with empty caches and the hub offline: one clear line naming the files, exit 2, no traceback."""
    make_json_dataset(tmp_path / "data", "dtd", per_class=1)
    env = dict(os.environ, HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "extract.cli", "--method", "zero-shot", "--dataset", "dtd", "--backbone", "RN50",
           "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--cache-dir",
           str(tmp_path / "cache"), "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "RN50/openai" in r.stderr and "RN50.pt" in r.stderr and "resnet50_clip.openai" in r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr and "local-dir:" in r.stderr
    assert not (tmp_path / "out").exists()
    json.dumps(r.stderr)  # printable


def test_unreachable_hub_fails_fast_without_offline_flag(tmp_path, monkeypatch):
    """Hub not declared offline but unreachable (a closed loopback port stands in for a cluster without network):
    one clear error within seconds instead of the hub client's minute of retries."""
    import time

    for var in ("HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens, refused at once
    import extract.models as models

    monkeypatch.setattr(models, "_cached_tag_file", lambda cfg: (None, ["(empty test cache)"]))
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=r"RN50/openai are not on this machine and 127\.0\.0\.1 cannot be reached"):
        load_model("RN50", "openai", "cpu")
    assert time.monotonic() - t0 < 15


def test_local_dir_model_decides_the_backbone_name(tmp_path, tiny_model_dir):
    """--backbone RN50 on a folder holding another model used to label its shards RN50: now one line, before any
    image is read (`plan` resolves it), and the same answer from `load_model`."""
    from extract.run.options import RunOptions, plan

    named = f"local-dir:{tiny_model_dir}"
    with pytest.raises(ModelError, match="--backbone RN50 disagrees with .* which holds tiny-clip") as e:
        plan(RunOptions("zero-shot", "dtd", backbone="RN50", pretrained=named))
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="disagrees"):
        load_model("ViT-B-16", named, "cpu")
    assert plan(RunOptions("zero-shot", "dtd", backbone="tiny-clip", pretrained=named)).backbone == "tiny-clip"
    unnamed = make_tiny_model_dir(tmp_path / "folder-name", model_name=None)
    with pytest.raises(ModelError, match=r"is not the model in .* vision_cfg\.") as e:
        plan(RunOptions("zero-shot", "dtd", backbone="RN50", pretrained=f"local-dir:{unnamed}"))
    assert "'folder-name'" in str(e.value)
    # an open_clip architecture equal to the folder's, or a name open_clip does not know, names an unnamed model
    arch = register_tiny_arch()
    assert plan(RunOptions("zero-shot", "dtd", backbone=arch, pretrained=f"local-dir:{unnamed}")).backbone == arch
    assert load_model("my-tiny", f"local-dir:{unnamed}", "cpu").backbone == "my-tiny"


def test_text_prototypes_report_each_encoder_call(tiny_model):
    prompts = [[f"a photo of a {c}{i}." for i in range(3)] for c in "abcde"]  # 15 prompts
    calls: list[int] = []
    got = tiny_model.text_prototypes(prompts, batch_size=4, on_batch=calls.append)
    assert calls == [4, 4, 4, 3]
    torch.testing.assert_close(got, tiny_model.text_prototypes(prompts, batch_size=4), rtol=0, atol=0)


def test_torchscript_load_does_not_claim_random_init(tmp_path, caplog, capfd):
    from tests.support.extract import make_tiny_checkpoint
    from extract.models import load_model

    path = make_tiny_checkpoint(tmp_path / "jit.pt", fmt="jit")
    with caplog.at_level("INFO"):
        load_model("zaec-tiny-vit", str(path), "cpu")
    said = caplog.text + "".join(capfd.readouterr())
    assert "initialized randomly" not in said
    with caplog.at_level("INFO"):  # the filter is gone afterwards: a real random init is still reported
        import logging
        logging.getLogger().warning("Model x initialized randomly.")
    assert "initialized randomly" in caplog.text


# ------------------------------------------------------------------------------------------ SigLIP (docs/methods.md)

def test_siglip_local_dir_loads_with_its_logit_bias(tiny_siglip, tiny_model):
    """The tiny SigLIP-style model loads through local-dir:; scale and bias reproduce open_clip's own logits
    (`get_logits`: scale·cos + bias), and the bias, one scalar for all classes, leaves every softmax unchanged."""
    from tests.support.extract import TINY_SIGLIP_BIAS

    m = tiny_siglip
    assert type(m.model).__name__ == "CustomTextCLIP" and m.backbone == "tiny-siglip"
    assert m.logit_bias == TINY_SIGLIP_BIAS and tiny_model.logit_bias == 0.0  # -2.5 is exact in float32
    assert m.tokenizer(["a photo of a cat."]).shape == (1, 64)  # SigLIP's context length, from the config
    g = torch.Generator().manual_seed(0)
    images = torch.randn(3, 3, 32, 32, generator=g)
    texts = ["a photo of a cat.", "a photo of a dog.", "a photo of a sea lion.", "a photo of a x."]
    with torch.no_grad():
        ref, _ = m.model.get_logits(images, m.tokenizer(texts))
    ours = m.logit_scale * m.encode_images(images) @ m.encode_texts(texts).T  # (3, 4) what the project computes
    # |logit| <= scale; a width-16 dot product of unit vectors, float32
    tol = 4 * 16 * EPS32 * m.logit_scale
    torch.testing.assert_close(ours + m.logit_bias, ref, rtol=0, atol=tol)
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), rtol=0, atol=tol)


def test_siglip_tag_resolves_its_hf_tokenizer_and_fails_offline_with_one_line():
    from extract.models import hf_tokenizer_source

    assert hf_tokenizer_source("ViT-B-16-SigLIP") == "timm/ViT-B-16-SigLIP"
    assert hf_tokenizer_source("ViT-B-16") is None
    with pytest.raises(ModelError, match="weights for ViT-B-16-SigLIP/webli are not on this machine"):
        load_model("ViT-B-16-SigLIP", "webli", "cpu")  # the real loading path; HF_HUB_OFFLINE=1 in tests


@pytest.mark.parametrize("failure,needle", [
    ("import", "pip install transformers sentencepiece"),
    ("files", "its files (tokenizer.json"),
])
def test_hf_tokenizer_that_cannot_be_built_fails_at_load(tmp_path, monkeypatch, failure, needle):
    """A model whose config names a Hugging Face tokenizer (SigLIP's) builds it at load time, before any image is
    read: no `transformers`, or its files absent, is one ModelError line."""
    import extract.models as models
    from tests.support.extract import make_tiny_siglip_dir

    d = make_tiny_siglip_dir(tmp_path / "m")
    doc = json.loads((d / "open_clip_config.json").read_text())
    doc["model_cfg"]["text_cfg"]["hf_tokenizer_name"] = "timm/ViT-B-16-SigLIP"
    (d / "open_clip_config.json").write_text(json.dumps(doc))
    if failure == "import":
        monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    else:
        def absent(self):
            raise OSError("Can't load tokenizer for '...'. Make sure the files are there\nmore detail")
        monkeypatch.setattr(models.LazyTokenizer, "_get", absent)
    with pytest.raises(ModelError) as e:
        load_model(None, f"local-dir:{d}", "cpu")
    assert needle in str(e.value) and "\n" not in str(e.value) and "timm/ViT-B-16-SigLIP" in str(e.value)


@pytest.mark.parametrize("layout", ["model", "module-prefix", "float16"])
def test_safetensors_read_straight_into_the_parameters_or_through_open_clip(tmp_path, monkeypatch, layout):
    """A safetensors file in the model's own layout is read straight into the parameters (`read_safetensors_into`,
    open_clip's loader never called); a file open_clip must convert (a `module.` prefix, float16 tensors) goes
    through open_clip's `load_checkpoint`. Either way every tensor is the one open_clip itself loads."""
    import open_clip
    from safetensors.torch import load_file, save_file

    ckpt = make_tiny_checkpoint(tmp_path / "t.safetensors")
    sd = load_file(str(ckpt))
    if layout == "module-prefix":
        save_file({f"module.{k}": v for k, v in sd.items()}, str(ckpt))
    elif layout == "float16":
        save_file({k: v.half() if v.is_floating_point() else v for k, v in sd.items()}, str(ckpt))
    ref = open_clip.create_model(TINY_ARCH, pretrained=str(ckpt))
    calls = []
    real = open_clip.load_checkpoint

    def spy(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(open_clip, "load_checkpoint", spy)
    monkeypatch.setattr(open_clip.factory, "load_checkpoint", spy)
    got = load_model(TINY_ARCH, str(ckpt), "cpu").model
    assert len(calls) == (0 if layout == "model" else 1)
    ref_state = ref.state_dict()
    assert set(got.state_dict()) == set(ref_state)
    for name, t in got.state_dict().items():
        assert t.dtype == ref_state[name].dtype and torch.equal(t, ref_state[name]), name
