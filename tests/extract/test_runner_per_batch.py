"""WATT and CLIPArTT through the run (`consumes = "batch_pixels"`, reset before each batch): Ctrl-C and rerun equal
an uninterrupted run on the tiny ViT and ResNet models, the rows equal the method on the run's own pixels, and
`zaec-extract --method NAME` runs them on a `folder:` set.
docs/methods.md, "Methods that adapt the image encoder per batch (WATT, CLIPArTT)"."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from extract.cli import app
from extract.run import writer as run_writer
from extract.runner import run_extraction
from schemas.shard import find_shards, read_shard

from tests.support.extract import (interrupt_nth_write, make_json_dataset, make_tiny_model_dir, shard_columns as table,
                                   write_image)

pytestmark = pytest.mark.usefixtures("one_thread")

# few steps (the loops are tested against the official ones in tests/extract/methods): the run is the point here
CHEAP = {"watt": {"rounds": "1", "steps_per_template": "1"}, "clipartt": {"steps": "2"}}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_json_dataset(root, "dtd", n_classes=3, per_class=4)  # 12 samples
    return root


def run(out, model, data_root, method, **kw):
    args = dict(data_root=data_root, out=out / "out", cache_dir=out / "cache", model=model, progress=False,
                part_size=4, limit=10, overrides={"batch_size": "2", **CHEAP[method]})
    args.update(kw)
    return run_extraction(method, "dtd", **args)


@pytest.mark.parametrize("method", ["watt", "clipartt"])
@pytest.mark.parametrize("model_fixture", ["tiny_model", "tiny_rn_model"])
def test_ctrl_c_and_rerun_equal_an_uninterrupted_run(tmp_path, data_root, monkeypatch, request, model_fixture,
                                                    method):
    """Five batches of 2 in three parts; the third part interrupted; the rerun keeps two parts and gives the
    uninterrupted run's rows. The adapted rows are the method's on the run's pixels, batch by batch."""
    model = request.getfixturevalue(model_fixture)
    full = table(run(tmp_path / "full", model, data_root, method))
    real_write = interrupt_nth_write(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "r", model, data_root, method)
    monkeypatch.setattr(run_writer, "write_shard", real_write)
    resumed = table(run(tmp_path / "r", model, data_root, method))
    for k in full:
        np.testing.assert_array_equal(resumed[k], full[k])
    assert not np.array_equal(full["tta_logits"], full["zs_logits"])
    meta = read_shard(find_shards([tmp_path / "full" / "out"])[0]).meta
    assert meta.extra["zaec:adapt_batch"] == "2" and meta.extra["zaec:consumes"] == "batch_pixels"


def test_rows_are_the_method_on_the_runs_pixels(tmp_path, data_root, tiny_model):
    """The run's rows of a batch = `adapt_images` on the original views of its positions (the encoding pass's view
    0 preprocessing): nothing of one batch reaches another."""
    from extract.methods.clipartt import CLIPArTT
    from extract.run.pixels import BatchPixels
    from extract.run.settings import load_run_data
    from extract.run.options import RunOptions, plan
    from extract.run.stream import stream_permutation

    rows = table(run(tmp_path, tiny_model, data_root, "clipartt", limit=4))
    options = RunOptions("clipartt", "dtd", data_root=str(data_root), limit=4,
                         overrides=(("batch_size", "2"), ("steps", "2")))
    planned = plan(options)
    data = load_run_data(planned)
    perm = stream_permutation("dtd", 1, data.n_total)
    pixels = BatchPixels(tiny_model, data.testset, perm, 1, stop=4)
    cfg = planned.config
    m = CLIPArTT(cfg, torch.zeros(3, 16), tiny_model.logit_scale, backbone="tiny-clip", dataset="dtd",
                 text_encoder=tiny_model, class_names=data.testset.class_names)
    want = torch.cat([m.adapt_images(pixels.get(s, s + 2)) for s in (0, 2)]).numpy()
    np.testing.assert_array_equal(rows["tta_logits"], want)


@pytest.mark.parametrize("method", ["watt", "clipartt"])
def test_zaec_extract_on_a_folder_set(tmp_path, tiny_rn_model_dir, method):
    """`zaec-extract --method NAME --dataset folder:PATH` on the tiny ResNet: the settings for unseen data, a row
    per image."""
    rng = np.random.default_rng(0)
    for cls in ("shirt", "shoe"):
        for i in range(3):
            write_image(tmp_path / "set" / cls / f"{i}.png", rng)
    sets = [a for k, v in CHEAP[method].items() for a in ("--set", f"{k}={v}")]
    args = ["--method", method, "--dataset", f"folder:{tmp_path / 'set'}", "--set", "batch_size=4", *sets,
            "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
            "--pretrained", f"local-dir:{tiny_rn_model_dir}", "--device", "cpu", "--quiet"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (path,) = find_shards([tmp_path / "out"])
    s = read_shard(path)
    assert len(s) == 6 and np.isfinite(s.tta_logits).all() and s.meta.method == method
    assert s.meta.method_config["batch_size"] == 4


def test_batch_part_size_and_a_one_image_resnet_batch_on_the_command_line(tmp_path, monkeypatch):
    """`--set batch_size=7 --part-size 7` is a valid run (the plan checks the part size given, not the default);
    15 images leave a last batch of one, which a tiny ResNet at 32 px (its last stage 1x1) cannot normalise with
    batch statistics: one line saying what to change, exit 2, before the model loads (`Towers.batch_statistics`)."""
    import extract.runner

    model_dir = make_tiny_model_dir(tmp_path / "rn-32px", model_name="RN-32px", vision="rn")
    rng = np.random.default_rng(1)
    for cls in ("shirt", "shoe", "bag"):
        for i in range(5):
            write_image(tmp_path / "set" / cls / f"{i}.png", rng)
    def invoke(batch: int):
        args = ["--method", "clipartt", "--dataset", f"folder:{tmp_path / 'set'}", "--set", f"batch_size={batch}",
                "--set", "steps=1", "--part-size", str(batch), "--out", str(tmp_path / f"out{batch}"),
                "--cache-dir", str(tmp_path / "cache"), "--pretrained", f"local-dir:{model_dir}",
                "--device", "cpu", "--quiet"]
        return CliRunner().invoke(app, args, catch_exceptions=False)

    with monkeypatch.context() as m:
        m.setattr(extract.runner, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
        r = invoke(7)
    assert r.exit_code == 2 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert "clipartt normalises the BatchNorms of a ResNet with the statistics of each batch of images, and " \
           "RN-32px's last stage is 1x1 at its input size" in r.output
    assert "15 samples in batches of 7 leave one in the last" in r.output
    r = invoke(5)
    assert r.exit_code == 0, r.output
    assert len(read_shard(find_shards([tmp_path / "out5"])[0])) == 5  # parts of one batch each
