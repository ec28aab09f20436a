"""TPS (extract/methods/tps.py) on the tiny open_clip model: prototype shifting against a slow reference written
from docs/methods.md, "TPS: prototype shifting", view reselection at every step, its descriptor files and its
ImageNet class names (the TPT-family properties shared with TPT are in test_tpt.py, parametrised over the
registry)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extract.methods import get_method
from extract.methods.tpt import select_confident
from extract.methods.tps import TPS, descriptor_sentence, load_descriptors

from tests.support.extract import make_imagenet_folders, make_json_dataset
from tests.support.tpt import EPS32, FEAT_TOL, K, NAMES, make, ref_episodic, ref_select, stream, tuned_tol, zs_text

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (tests/support/extract.py)



def test_tps_matches_slow_reference(tiny_model):
    m = make("tps", tiny_model, tta_steps=2)
    x = stream(tiny_model, 4, seed=2)
    out = m.adapt(x)
    base = F.normalize(zs_text(tiny_model), dim=-1)
    for i in range(4):
        expect = ref_episodic(x[i], torch.zeros(K, base.shape[1]), lambda s: F.normalize(base + s, dim=-1),
                              tiny_model.logit_scale, lr=m.config.lr, steps=2, reselect=True)
        torch.testing.assert_close(out[i], expect, rtol=0, atol=tuned_tol(tiny_model.logit_scale, steps=2))


@pytest.mark.parametrize("key", ["tps", "tpt"])
def test_tps_reselects_views_at_every_step_tpt_once(tiny_model, monkeypatch, key):
    """TPS `run_shift_iter` selects the confident views from the logits of every step; TPT selects at step 0."""
    import extract.methods.tpt as tpt_module

    calls = []

    def spy(logits, p):
        sel = select_confident(logits, p)
        calls.append((logits.detach().clone(), sel))
        return sel

    monkeypatch.setattr(tpt_module, "select_confident", spy)
    m = make(key, tiny_model, tta_steps=3, lr=0.05)
    x = stream(tiny_model, 6, seed=2, noise=0.8)
    m.adapt(x)
    assert len(calls) == (3 if key == "tps" else 1)
    for (z, sel) in calls:  # each selection: the lowest-entropy views of the logits it was given
        assert [s.tolist() for s in sel] == [ref_select(zi, 0.1) for zi in z]
    if key == "tps":  # ... and those are the current step's logits, after the shift moved
        assert all((a[0] - b[0]).abs().max() > 1e-3 for a, b in zip(calls, calls[1:]))
        assert any(not torch.equal(a[1], b[1]) for a, b in zip(calls, calls[1:])), "the selection must change"


def test_tps_descriptor_prototypes(tiny_model, tmp_path):
    assert descriptor_sentence("fish", "an orange body") == "fish, which is an orange body"
    assert descriptor_sentence("fish", "often seen in ponds") == "fish, which often seen in ponds"
    assert descriptor_sentence("fish", "used as a pet") == "fish, which is used as a pet"
    assert descriptor_sentence("fish", "fins") == "fish, which has fins"
    table = {"cat": ["whiskers", "a tail"], "sea lion": ["flippers"], "annual crop land": ["fields"],
             "DOG": ["a wet nose", "paws", "has fur"], "a": ["letters"]}  # matched loosely: "_", case
    path = tmp_path / "desc.json"
    path.write_text(json.dumps(table))
    m = make("tps", tiny_model, descriptors=str(path))
    from extract.prompts import imagenet80_templates

    descs = [table["cat"], table["sea lion"], table["annual crop land"], table["DOG"], table["a"]]
    for c, (name, desc) in enumerate(zip(NAMES, descs)):
        n = name.replace("_", " ")
        tmpl = tiny_model.encode_texts([t.format(n) for t in imagenet80_templates()]).mean(0)
        dmean = tiny_model.encode_texts([descriptor_sentence(n, d) for d in desc]).mean(0)
        proto = 0.5 * (tmpl + dmean)
        # a mean of up to 80 unit encodings, each within FEAT_TOL: 80 eps for the sum on top
        torch.testing.assert_close(m.text_features[c], proto / proto.norm(), rtol=0, atol=FEAT_TOL + 80 * EPS32)
    del table["cat"]
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match="no descriptors for 1 of 5 classes \\('cat'\\)"):
        make("tps", tiny_model, descriptors=str(path))


def test_tps_descriptor_files_keyed_loosely_or_by_position(tiny_model, tmp_path):
    names = ["sea_lion", "Annual Crop Land", "abbey", "newt", "tights"]
    # SUN397-style keys: `_` and spaces mixed, other case, extra spaces: matched by name, no warning
    loose = {"Sea Lion": ["flippers"], "annual_crop_land": ["fields"], " Abbey ": ["a cloister"],
             "newt": ["a tail"], "TIGHTS": ["legs"]}
    path = tmp_path / "loose.json"
    path.write_text(json.dumps(loose))
    descs, warnings = load_descriptors(path, names)
    assert descs == [["flippers"], ["fields"], ["a cloister"], ["a tail"], ["legs"]] and warnings == []
    # the official ImageNet file's keys differ from the class names ('eft' for 'newt', 'maillot' for 'tights'):
    # TPS pairs by position
    official = {"sea lion": ["flippers"], "annual crop land": ["fields"], "abbey": ["a cloister"],
                "eft": ["a small salamander"], "maillot": ["a swimsuit"]}
    path.write_text(json.dumps(official))
    descs, warnings = load_descriptors(path, names)
    assert descs == [v for v in official.values()]
    assert len(warnings) == 1 and "by position" in warnings[0] and "'newt' <- 'eft'" in warnings[0]
    # with another number of entries there is no pairing to fall back on
    del official["maillot"]
    path.write_text(json.dumps(official))
    with pytest.raises(ValueError, match="no descriptors for 2 of 5 classes \\('newt', 'tights'\\); it has 4 entries"):
        load_descriptors(path, names)


def test_tps_imagenet_names_are_tps_own():
    from extract.datasets import imagenet_classnames, imagenet_subset

    clip = imagenet_classnames()
    assert clip[744] == clip[657] == "missile" and clip[836] == clip[837] == "sunglasses"  # CLIP/TPT duplicates
    tps = TPS.method_class_names("imagenet", clip, range(1000))
    assert (tps[744], tps[836]) == ("projectile", "sunglass") and len(set(tps)) == 1000
    assert [i for i in range(1000) if tps[i] != clip[i]] == [744, 836]
    for key in ("imagenet_v2", "imagenet_sketch"):
        assert TPS.method_class_names(key, clip, range(1000)) == tps
    for which in ("a", "r"):  # TPS indexes its list with the masks; neither subset holds 744 or 836
        idx = imagenet_subset(which)
        sub = tuple(clip[i] for i in idx)
        assert TPS.method_class_names(f"imagenet_{which}", sub, idx) == sub
    assert TPS.method_class_names("dtd", ["a", "b"], None) == ("a", "b")
    for key in ("tpt", "ctpt", "otpt"):  # the TPT family keeps the CLIP/TPT list (the official TPT has the duplicates)
        assert get_method(key).method_class_names("imagenet", clip, range(1000)) == clip


def test_run_records_tps_imagenet_names_and_descriptor_warning(tmp_path, tiny_model):
    from extract.datasets import imagenet_classnames, imagenet_synsets
    from extract.runner import run_extraction
    from schemas.shard import read_shard

    syn = imagenet_synsets()
    make_imagenet_folders(tmp_path / "data", "imagenet", [syn[744], syn[836]], per_class=1)
    common = dict(data_root=tmp_path / "data", cache_dir=tmp_path / "cache", model=tiny_model, progress=False,
                  anchor="method")
    quick = {"prompts": "single", "n_views": "1"}  # 1000 prompts, one view: enough to see the names
    (path,) = run_extraction("tps", "imagenet", out=tmp_path / "out", overrides=quick, **common)
    sh = read_shard(path)
    names = json.loads(sh.meta.extra["zaec:method_class_names"])
    assert (names[744], names[836]) == ("projectile", "sunglass") and sh.meta.class_names == imagenet_classnames()
    # the method's prompts (here also the anchor) use them: no two classes share a prototype any more
    assert not np.array_equal(sh.zs_logits[:, 657], sh.zs_logits[:, 744])
    assert not np.array_equal(sh.zs_logits[:, 836], sh.zs_logits[:, 837])
    (path,) = run_extraction("tpt", "imagenet", out=tmp_path / "out", overrides={"n_views": "1"}, limit=1, **common)
    sh = read_shard(path)
    assert "zaec:method_class_names" not in sh.meta.extra
    np.testing.assert_array_equal(sh.zs_logits[:, 657], sh.zs_logits[:, 744])  # the CLIP/TPT duplicate
    # a descriptor file paired by position: the warning is in the shard metadata
    make_json_dataset(tmp_path / "data", "dtd", n_classes=3, per_class=1)
    desc = tmp_path / "desc.json"
    desc.write_text(json.dumps({"first": ["a"], "second": ["b"], "third": ["c"]}))
    (path,) = run_extraction("tps", "dtd", out=tmp_path / "out", overrides={**quick, "descriptors": str(desc)},
                             **common)
    warnings = json.loads(read_shard(path).meta.extra["zaec:warnings"])
    assert any("paired with the classes by position" in w for w in warnings)
