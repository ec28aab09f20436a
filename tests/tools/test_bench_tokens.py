"""`python -m tools.bench_tokens` (the costs of CALIP and TCA inside the image encoder, and of a token-map cache)
runs end to end on its small models and reports every figure it documents."""

from __future__ import annotations

from typer.testing import CliRunner

from tools import bench_tokens


def test_every_figure_on_the_small_models(tmp_path):
    out = tmp_path / "tokens.json"
    r = CliRunner().invoke(bench_tokens.app, ["--tiny", "--images", "2", "--k", "5", "--repeat", "1", "--json", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    import json

    doc = json.loads(out.read_text())
    vit, rn = doc["ViT-B-16"], doc["RN50"]
    assert (vit["tokens"], vit["dim"], rn["tokens"], rn["dim"]) == (65, 32, 5, 32)  # 1 + 8², 1 + 2²
    assert vit["cache_bytes_per_sample"] == 2 * 65 * 32 and vit["cache_bytes_imagenet"] == 50_000 * 2 * 65 * 32
    for key in ("pixels_ms", "encode_ms", "token_map_ms", "calip_ms", "memmap_ms", "tca_forward_ms", "plain_b1_ms",
                "tca_step_ms"):
        assert vit[key] >= 0
    assert "tca_forward_ms" not in rn  # ViT only
