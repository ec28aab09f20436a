"""The prompt text encoder (extract/text_encoder.py) on the tiny open_clip model and on small custom towers: it
reproduces `encode_text`, sends gradients only to the learned context, and refuses towers it cannot handle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from extract.text_encoder import PromptTextEncoder, TextEncoderError

from tests.support.tpt import FEAT_TOL, K, NAMES, ref_encode, zs_text

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread (tests/support/extract.py)



def test_prompt_encoder_reproduces_encode_text(tiny_model):
    ref = zs_text(tiny_model)
    full = PromptTextEncoder(tiny_model.model, tiny_model.tokenizer, NAMES, truncate=False)
    assert full.n_ctx == 4 and full.ctx_init.shape == (4, 32)
    assert torch.equal(full(full.ctx_init), ref)  # bit for bit, the frozen zero-shot prototypes
    short = PromptTextEncoder(tiny_model.model, tiny_model.tokenizer, NAMES, truncate=True)
    assert short.length < full.length
    torch.testing.assert_close(short(short.ctx_init), ref, rtol=0, atol=FEAT_TOL)
    grouped = PromptTextEncoder(tiny_model.model, tiny_model.tokenizer, NAMES, min_bucket=1)
    assert len(grouped.buckets) > 1 and sorted(c for idx, _ in grouped.buckets for c in idx) == list(range(K))
    torch.testing.assert_close(grouped(grouped.ctx_init), ref, rtol=0, atol=FEAT_TOL)
    # a batch of different contexts equals encoding them one by one, and the reference forward
    g = torch.Generator().manual_seed(0)
    ctx = short.ctx_init + 0.05 * torch.randn(3, 4, 32, generator=g)
    for enc in (short, grouped):
        batched = enc(ctx)
        for b in range(3):
            torch.testing.assert_close(batched[b], enc(ctx[b]), rtol=0, atol=FEAT_TOL)
            torch.testing.assert_close(batched[b], ref_encode(tiny_model, NAMES, ctx[b]), rtol=0, atol=FEAT_TOL)


def test_prompt_encoder_custom_text_clip_with_eos_pooling():
    """open_clip's CustomTextCLIP (text tower under `model.text`) with `pool_type="eos"`."""
    import open_clip
    from open_clip.tokenizer import SimpleTokenizer

    torch.manual_seed(0)
    text_cfg = {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1,
                "pool_type": "eos", "eos_id": 49407}
    model = open_clip.CustomTextCLIP(embed_dim=16, vision_cfg={"image_size": 32, "layers": 1, "width": 32,
                                                               "head_width": 16, "patch_size": 8},
                                     text_cfg=text_cfg).eval()
    tok = SimpleTokenizer(context_length=32)
    with torch.no_grad():
        ref = model.encode_text(tok([f"a photo of a {n.replace('_', ' ')}." for n in NAMES]), normalize=True)
        full = PromptTextEncoder(model, tok, NAMES, truncate=False)
        assert torch.equal(full(full.ctx_init), ref)
        short = PromptTextEncoder(model, tok, NAMES)
        torch.testing.assert_close(short(short.ctx_init), ref, rtol=0, atol=FEAT_TOL)


def test_prompt_encoder_gradient_only_to_context_and_same_on_every_path(tiny_model):
    g = torch.Generator().manual_seed(1)
    ctx0 = PromptTextEncoder(tiny_model.model, tiny_model.tokenizer, NAMES).ctx_init
    ctx0 = ctx0 + 0.05 * torch.randn(2, *ctx0.shape, generator=g)
    weights = torch.randn(2, K, 16, generator=g)
    grads = []
    for kw in ({"truncate": False}, {"share_prefix": False, "min_bucket": 1}, {"min_bucket": 1}, {}):
        enc = PromptTextEncoder(tiny_model.model, tiny_model.tokenizer, NAMES, **kw)
        assert enc.shared_prefix == (kw.get("truncate", True) and kw.get("share_prefix", True))
        ctx = ctx0.clone().requires_grad_(True)
        (enc(ctx) * weights).sum().backward()
        grads.append(ctx.grad)
    assert grads[0].abs().sum() > 0
    for gr in grads[1:]:  # backward through width 32: each element within ~32 eps of the largest gradient
        torch.testing.assert_close(gr, grads[0], rtol=0, atol=FEAT_TOL * float(grads[0].abs().max()))
    assert all(p.grad is None for p in tiny_model.model.parameters())


def test_shared_prefix_path_on_a_deep_tower_equals_encode_text():
    """The written-out blocks of the shared-prefix path (first, middle and last block differ) on a 3-layer tower
    with LayerScale, against open_clip's own encode_text and the full path: features, gradients, batching."""
    import open_clip
    from open_clip.tokenizer import SimpleTokenizer

    torch.manual_seed(0)
    text_cfg = {"context_length": 32, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 3, "ls_init_value": 0.5}
    model = open_clip.CLIP(embed_dim=16, vision_cfg={"image_size": 32, "layers": 1, "width": 32, "head_width": 16,
                                                     "patch_size": 8}, text_cfg=text_cfg).eval().requires_grad_(False)
    tok = SimpleTokenizer(context_length=32)
    names = list(NAMES) + ["a rather long class name with many words", "x_y"]
    with torch.no_grad():
        ref = model.encode_text(tok([f"a photo of a {n.replace('_', ' ')}." for n in names]), normalize=True)
    full = PromptTextEncoder(model, tok, names, truncate=False)
    shared = PromptTextEncoder(model, tok, names, min_bucket=3)
    assert shared.shared_prefix and not full.shared_prefix and len(shared.buckets) > 1
    # a unit-norm feature through 3 blocks of width 32: a few times the one-block tolerance
    tol = 3 * FEAT_TOL
    torch.testing.assert_close(shared(shared.ctx_init), ref, rtol=0, atol=tol)
    g = torch.Generator().manual_seed(2)
    ctx0 = shared.ctx_init + 0.05 * torch.randn(3, *shared.ctx_init.shape, generator=g)
    weights = torch.randn(3, len(names), 16, generator=g)
    out, grads = [], []
    for enc in (full, shared):
        ctx = ctx0.clone().requires_grad_(True)
        feats = enc(ctx)
        (feats * weights).sum().backward()
        out.append(feats.detach())
        grads.append(ctx.grad)
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=tol)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=tol * float(grads[0].abs().max()))
    for b in range(3):  # one context at a time: the same rows
        torch.testing.assert_close(shared(ctx0[b]), out[1][b], rtol=0, atol=tol)


def test_attention_backward_equals_autograd_of_sdpa_and_batches_under_vmap():
    """`_Attention`: SDPA forward, textbook backward; equal to autograd through SDPA (float64), also per sample
    under `torch.func.vmap` (the shared first forward's use)."""
    from extract.text_encoder import _Attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g, dtype=torch.float64) for n in (5, 9, 9))
    mask = torch.zeros(5, 9, dtype=torch.float64).masked_fill(torch.ones(5, 9).triu(5).bool(), float("-inf"))
    d_out = torch.randn(3, 2, 5, 8, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3]), _Attention.apply):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*x, mask)
        grads.append((out.detach(), *torch.autograd.grad(out, x, d_out)))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    out, vjp = torch.func.vjp(lambda q_: _Attention.apply(q_, k, v, mask), q)
    cots = torch.randn(4, *out.shape, generator=g, dtype=torch.float64)
    (batched,) = torch.func.vmap(vjp)(cots)
    for i in range(4):
        torch.testing.assert_close(batched[i], vjp(cots[i])[0], rtol=1e-12, atol=1e-12)


def test_prompt_encoder_rejects_unsupported_towers(tiny_model):
    with pytest.raises(TextEncoderError, match="CLIP-style text tower"):
        PromptTextEncoder(torch.nn.Linear(2, 2), tiny_model.tokenizer, NAMES)
    with pytest.raises(ValueError, match="at least one class"):
        PromptTextEncoder(tiny_model.model, tiny_model.tokenizer, [])
