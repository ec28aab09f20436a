"""Which backbones a method runs on (`TTAMethod.towers`, docs/methods.md "Which backbones a method runs on"): the
towers `extract.models.classify_towers` reads from an architecture's config are those open_clip builds and the
methods' own checks on the loaded model accept; `zaec-extract` refuses a (method, backbone) pair before any model
loads (one line, exit 2); a method on batch statistics refuses a batch of one image through a ResNet whose last stage
is 1x1 before the model loads too."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import extract.models
import extract.runner
from extract.cli import app
from extract.methods import REGISTRY
from extract.models import IMAGE_TOWERS, TEXT_TOWERS, TowerKinds, classify_towers, tower_kinds
from extract.run.options import RunOptions, backbone_refusal

from tests.support.extract import make_json_dataset, make_tiny_model_dir

runner = CliRunner()

VIT = {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8}
RN = {"image_size": 64, "layers": [1, 1, 1, 1], "width": 8, "head_width": 16}
TEXT = {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}
#: tiny configs with the flags of each kind of tower open_clip builds (its `model_configs`: RN50, ViT-B-16, CoCa's
#: attention pool, CLIPA's average pool, SigLIP's timm ViT and bidirectional text tower, an end-of-text pool, CoCa's
#: text class token); a Hugging Face text tower needs its files from the hub: `test_open_clip_configs` reads one
VARIANTS: dict[str, dict] = {
    "vit": {"vision_cfg": VIT, "text_cfg": TEXT},
    "rn": {"vision_cfg": RN, "text_cfg": TEXT},
    "rn-32px": {"vision_cfg": {**RN, "image_size": 32}, "text_cfg": TEXT},
    "vit-attention-pool": {"vision_cfg": {**VIT, "attentional_pool": True, "attn_pooler_queries": 4,
                                          "attn_pooler_heads": 2}, "text_cfg": TEXT},
    "vit-average": {"vision_cfg": {**VIT, "pool_type": "avg", "final_ln_after_pool": True, "no_ln_pre": True},
                    "text_cfg": TEXT},
    "timm": {"vision_cfg": {"timm_model_name": "vit_tiny_patch16_224", "timm_model_pretrained": False,
                            "timm_pool": "", "timm_proj": "linear", "image_size": 32}, "text_cfg": TEXT},
    "siglip-text": {"custom_text": True, "vision_cfg": VIT,
                    "text_cfg": {**TEXT, "no_causal_mask": True, "pool_type": "last", "proj_bias": True}},
    "eos-text": {"vision_cfg": VIT, "text_cfg": {**TEXT, "pool_type": "eos"}},
    "custom-causal-text": {"custom_text": True, "vision_cfg": VIT, "text_cfg": TEXT},
    "class-token-text": {"custom_text": True, "vision_cfg": VIT, "text_cfg": {**TEXT, "embed_cls": True}},
}


def _built(name: str, cfg: dict, monkeypatch) -> torch.nn.Module:
    """open_clip's `create_model` on `cfg` (its choice of CLIP / CustomTextCLIP and of the towers)."""
    import open_clip
    from open_clip.factory import _MODEL_CONFIGS

    monkeypatch.setitem(_MODEL_CONFIGS, name, {"embed_dim": 16, **cfg})
    return open_clip.create_model(name).eval()


def _guards() -> dict[str, object]:
    """The checks each method with restricted towers makes on the loaded model when it is built (the last guard),
    as functions of the open_clip model: True when the method can be built on it."""
    from extract.methods.promptalign import maple_towers
    from extract.methods.tokens import plain_vit_refusal, token_map_refusal
    from extract.methods.ttl import vision_tower
    from extract.text_encoder import _text_tower

    def ok(check):
        def guard(model) -> bool:
            try:
                return check(model) is not False
            except ValueError:
                return False
        return guard

    prompt = ok(_text_tower)
    guards = {"ttl": ok(lambda m: vision_tower(m, "m")),
              "dart": lambda m: ok(lambda m: vision_tower(m, "m"))(m) and prompt(m),
              "tca": ok(lambda m: plain_vit_refusal(m.visual) is None),
              "calip": ok(lambda m: token_map_refusal(m.visual) is None),
              "promptalign": ok(lambda m: maple_towers(m, "m"))}
    for key in ("tpt", "ctpt", "otpt", "atpt", "rtpt", "dynaprompt", "rlcf", "histpt", "difftpt"):
        guards[key] = prompt
    return guards


def _loaded_last_stage(model: torch.nn.Module) -> int | None:
    """The side of a ModifiedResNet's last feature map at its input size (run, not computed)."""
    from open_clip.modified_resnet import ModifiedResNet

    v = model.visual
    if not isinstance(v, ModifiedResNet):
        return None
    with torch.no_grad():
        x = v.stem(torch.zeros(1, 3, v.image_size, v.image_size))
        for layer in (v.layer1, v.layer2, v.layer3, v.layer4):
            x = layer(x)
    return int(x.shape[-1])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_plans_kinds_are_what_the_loaded_model_guards_accept(variant, monkeypatch):
    """For every registered method, the plan refuses a tower kind exactly where the method's own check on the
    loaded model would refuse the model open_clip builds from that config; the kinds are the built classes."""
    from open_clip.modified_resnet import ModifiedResNet
    from open_clip.timm_model import TimmModel
    from open_clip.transformer import VisionTransformer

    from extract.methods.norm_tuning import norm_kind

    cfg = VARIANTS[variant]
    kinds = classify_towers({"embed_dim": 16, **cfg})
    model = _built(f"towers-{variant}", cfg, monkeypatch)
    assert kinds.image in IMAGE_TOWERS and kinds.text in TEXT_TOWERS
    visual_class = {"vit": VisionTransformer, "vit-pooled": VisionTransformer, "resnet": ModifiedResNet,
                    "timm": TimmModel}[kinds.image]
    assert type(model.visual) is visual_class
    assert (norm_kind(model.visual) == "batchnorm") == (kinds.image == "resnet")  # WATT's rn_batchnorm decides
    assert kinds.last_stage == _loaded_last_stage(model)
    guards = _guards()
    restricted = {k for k, c in REGISTRY.items() if c.towers(c.default_config("dtd", "ViT-B-16")).image is not None
                  or c.towers(c.default_config("dtd", "ViT-B-16")).text is not None}
    assert restricted == set(guards), "a method with restricted towers needs its loaded-model guard here"
    for key, guard in guards.items():
        cls = REGISTRY[key]
        refused = cls.towers(cls.default_config("dtd", "ViT-B-16")).refusal(key, variant, kinds, None)
        assert (refused is None) == guard(model), (key, variant, kinds, refused)


def test_open_clip_configs():
    """open_clip's own architectures, read without building them; a name it does not know is unclassified."""
    assert tower_kinds("RN50", "openai") == TowerKinds("resnet", "clip", 7)
    assert tower_kinds("RN50x4", "openai") == TowerKinds("resnet", "clip", 9)
    assert tower_kinds("ViT-B-16", "openai") == TowerKinds("vit", "clip")
    assert tower_kinds("ViT-B-16-SigLIP", "webli") == TowerKinds("timm", "open_clip")
    assert tower_kinds("coca_ViT-B-32", "laion2b_s13b_b90k") == TowerKinds("vit-pooled", "other")
    assert tower_kinds("ViT-L-14-CLIPA", "datacomp1b") == TowerKinds("vit-pooled", "open_clip")
    assert tower_kinds("xlm-roberta-base-ViT-B-32", "laion5b_s13b_b90k") == TowerKinds("vit", "other")
    assert tower_kinds("no-such-model", "openai") == TowerKinds()


def _refused(backbone: str, pretrained: str = "openai", **overrides: str) -> set[str]:
    return {k for k in REGISTRY if backbone_refusal(RunOptions.make(k, "dtd", backbone=backbone,
                                                                    pretrained=pretrained,
                                                                    overrides=overrides or None)) is not None}


def test_which_methods_each_backbone_refuses(tiny_siglip_dir, tiny_rn_model_dir):
    """The declarations, pinned: RN50 refuses the four methods that run a ViT's blocks themselves; SigLIP (a timm
    ViT) also CALIP's token map; the tiny SigLIP-style model (a plain ViT) only PromptAlign's text side; a Hugging
    Face text tower every method that learns a prompt; WATT refuses a ResNet only with rn_batchnorm=false."""
    vit_only = {"ttl", "tca", "dart", "promptalign"}
    prompt = {"tpt", "ctpt", "otpt", "atpt", "rtpt", "dynaprompt", "rlcf", "histpt", "difftpt", "dart", "promptalign"}
    assert _refused("ViT-B-16") == set()
    assert _refused("RN50") == vit_only
    assert _refused(None, f"local-dir:{tiny_rn_model_dir}") == vit_only
    assert _refused("ViT-B-16-SigLIP", "webli") == vit_only | {"calip"}
    assert _refused(None, f"local-dir:{tiny_siglip_dir}") == {"promptalign"}
    assert _refused("xlm-roberta-base-ViT-B-32", "laion5b_s13b_b90k") == prompt
    for backbone, refused in (("RN50", True), ("ViT-B-16", False)):
        options = RunOptions.make("watt", "dtd", backbone=backbone, overrides={"rn_batchnorm": "false"})
        assert (backbone_refusal(options) is not None) == refused
    assert _refused("no-such-model") == set()  # unclassified: the loaded model decides


def _no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(extract.models, "load_model", refuse)
    monkeypatch.setattr(extract.runner, "load_model", refuse)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("towers-data")
    make_json_dataset(root, "dtd", n_classes=2, per_class=3)  # 6 images
    return root


def _extract(tmp_path, data_root, *args: str):
    return runner.invoke(app, ["--dataset", "dtd", "--data-root", str(data_root), "--out", str(tmp_path / "out"),
                               "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--quiet", *args],
                         catch_exceptions=False)


#: named backbones whose towers differ (no weights are needed: the refusal comes before the model loads)
BACKBONES = (("RN50", "openai"), ("ViT-B-16-SigLIP", "webli"), ("xlm-roberta-base-ViT-B-32", "laion5b_s13b_b90k"))
PAIRS = [(k, b, p) for k in REGISTRY for b, p in BACKBONES
         if backbone_refusal(RunOptions.make(k, "dtd", backbone=b, pretrained=p)) is not None]


@pytest.mark.parametrize("key, backbone, pretrained", PAIRS)
def test_zaec_extract_refuses_a_pair_before_the_model_loads(key, backbone, pretrained, tmp_path, data_root,
                                                            monkeypatch):
    """One line, exit 2, naming the method, the backbone and what the method runs on; no model, no folder."""
    _no_model(monkeypatch)
    r = _extract(tmp_path, data_root, "--method", key, "--backbone", backbone, "--pretrained", pretrained)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith(f"zaec-extract: error: {key} ") and f"{backbone}'s is " in line
    assert "it runs on an image tower that is" in line or "it runs on a text tower that is" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_watt_without_rn_batchnorm_is_refused_on_a_resnet_before_the_model_loads(tmp_path, data_root,
                                                                                tiny_rn_model_dir, monkeypatch):
    _no_model(monkeypatch)
    r = _extract(tmp_path, data_root, "--method", "watt", "--set", "rn_batchnorm=false", "--pretrained",
                 f"local-dir:{tiny_rn_model_dir}")
    assert r.exit_code == 2 and "Traceback" not in r.output
    (line,) = r.output.strip().splitlines()
    assert "watt adapts the LayerNorms of the image encoder (rn_batchnorm=false" in line
    assert "RN-tiny's is a ResNet" in line


BATCH_STATISTICS = sorted(k for k, c in REGISTRY.items()
                          if c.towers(c.default_config("dtd", "ViT-B-16")).batch_statistics)


@pytest.fixture(scope="module")
def rn_32px_dir(tmp_path_factory):
    """A tiny ResNet at 32 px: its last stage is 1x1, so a batch of one image leaves its BatchNorms one value."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("rn-32px"), model_name="RN-32px", vision="rn")


def test_the_batch_methods_are_the_ones_on_batch_statistics():
    assert BATCH_STATISTICS == sorted(k for k, c in REGISTRY.items() if c.consumes == "batch_pixels")


@pytest.mark.parametrize("key", BATCH_STATISTICS)
def test_a_batch_of_one_image_through_a_1x1_resnet_is_refused_before_the_model_loads(key, tmp_path, data_root,
                                                                                     rn_32px_dir, tiny_rn_model_dir,
                                                                                     monkeypatch):
    """batch_size=1 (every batch one image) is the plan's refusal; 5 samples in batches of 2 leave a last batch of
    one, refused once the test set is listed; at 64 px (2x2) neither is refused."""
    _no_model(monkeypatch)
    one = _extract(tmp_path, data_root, "--method", key, "--set", "batch_size=1", "--part-size", "1",
                   "--pretrained", f"local-dir:{rn_32px_dir}")
    assert one.exit_code == 2 and "Traceback" not in one.output
    (line,) = one.output.strip().splitlines()
    assert f"{key} normalises the BatchNorms of a ResNet" in line and "RN-32px's last stage is 1x1" in line
    assert line.endswith("set batch_size >= 2")
    last = _extract(tmp_path, data_root, "--method", key, "--set", "batch_size=2", "--part-size", "2", "--limit",
                    "5", "--pretrained", f"local-dir:{rn_32px_dir}")
    assert last.exit_code == 2 and "Traceback" not in last.output
    (line,) = last.output.strip().splitlines()
    assert line.startswith(f"zaec-extract: error: {key} normalises") and "5 samples in batches of 2 leave one" in line
    assert not (tmp_path / "out").exists()
    for size, pretrained in (("1", f"local-dir:{tiny_rn_model_dir}"), ("2", f"local-dir:{rn_32px_dir}")):
        assert backbone_refusal(RunOptions.make(key, "dtd", backbone=None, pretrained=pretrained,
                                                overrides={"batch_size": size})) is None
