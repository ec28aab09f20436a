"""The prompt learner on SigLIP-style text towers (bidirectional, pooled at the last position, projection with bias)
and on a tokenizer laid out as SigLIP's (no start token, padded with end-of-text); docs/methods.md, "SigLIP"."""

from __future__ import annotations

import pytest
import torch

from extract.text_encoder import PromptTextEncoder, class_prompt, context_span

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ["cat", "sea_lion", "golden retriever dog", "x"]
EPS32 = torch.finfo(torch.float32).eps
# a unit-norm feature through two blocks of width 32 and a 16-wide projection: a few eps per reduction element
FEAT_TOL = 2 * 32 * EPS32


class SigLipLayout:
    """open_clip's BPE tokenizer re-laid as SigLIP's SentencePiece output (open_clip `SigLipTokenizer`: no start
    token, end-of-text appended, padded with the end-of-text id), so the learner's context search is exercised on a
    tokenizer without leading specials. Offline: SigLIP's own vocabulary cannot be had here."""

    def __init__(self, tok):
        self.tok = tok
        self.eot = tok.eot_token_id

    def __call__(self, texts):
        ids = self.tok(texts)[:, 1:]  # drop the start token
        ids = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1)
        return ids.masked_fill(ids == 0, self.eot)


def slow_encode(tower, tokens: torch.Tensor, start: int, ctx: torch.Tensor) -> torch.Tensor:
    """open_clip's `TextTransformer.forward` written out per prompt, the embeddings at [start, start + n_ctx)
    replaced by `ctx`; SigLIP's tower: no attention mask, pooled at the last position, Linear projection."""
    out = []
    for row in tokens:
        x = tower.token_embedding(row[None])
        x = torch.cat([x[:, :start], ctx[None], x[:, start + ctx.shape[0]:]], dim=1) + tower.positional_embedding
        for blk in tower.transformer.resblocks:
            x = blk(x, attn_mask=None)
        x = tower.ln_final(x)[:, -1]
        x = tower.text_projection(x)
        out.append(x[0] / x[0].norm())
    return torch.stack(out)


def test_context_span_finds_context_after_any_leading_specials():
    # CLIP: start token, 3 context tokens, end, padding; SigLIP: 2 context tokens, then end as padding
    assert context_span(torch.tensor([7, 1, 2, 3, 9, 0, 0]), torch.tensor([7, 9, 0, 0, 0, 0, 0])) == (1, 3)
    assert context_span(torch.tensor([1, 2, 9, 9]), torch.tensor([9, 9, 9, 9])) == (0, 2)
    assert context_span(torch.tensor([7, 9, 0]), torch.tensor([7, 9, 0])) == (3, 0)  # nothing inserted


def test_zero_context_change_equals_encode_text_on_siglip(tiny_siglip):
    m = tiny_siglip.model
    assert m.text.attn_mask is None and m.text.pool_type == "last"
    tokens = tiny_siglip.tokenizer([class_prompt("a photo of a", n) for n in NAMES])
    with torch.no_grad():
        ref = m.encode_text(tokens, normalize=True)
    for kw in ({}, {"truncate": False}, {"min_bucket": 1}):  # shortcuts requested: refused silently (not exact)
        enc = PromptTextEncoder(m, tiny_siglip.tokenizer, NAMES, **kw)
        assert (enc.start, enc.n_ctx, enc.length, enc.shared_prefix) == (1, 4, 64, False)
        with torch.no_grad():
            # the blocks written out (`_block`): the same operations, other summation orders in the attention
            torch.testing.assert_close(enc(enc.ctx_init), ref, rtol=0, atol=FEAT_TOL)


def test_tuned_contexts_equal_slow_reference_and_gradient_reaches_only_ctx(tiny_siglip):
    m = tiny_siglip.model
    enc = PromptTextEncoder(m, tiny_siglip.tokenizer, NAMES)
    tokens = tiny_siglip.tokenizer([class_prompt("a photo of a", n) for n in NAMES])
    g = torch.Generator().manual_seed(0)
    ctx = (enc.ctx_init + 0.05 * torch.randn(3, *enc.ctx_init.shape, generator=g)).requires_grad_(True)
    feats = enc(ctx)  # (3, K, D)
    with torch.no_grad():
        for b in range(3):
            torch.testing.assert_close(feats[b], slow_encode(m.text, tokens, 1, ctx[b]), rtol=0, atol=FEAT_TOL)
    feats.sum().backward()
    assert ctx.grad is not None and ctx.grad.abs().sum() > 0
    assert all(p.grad is None for p in m.parameters())


def test_bidirectional_tower_sees_positions_after_the_pooled_one_of_clip(tiny_siglip):
    """Under SigLIP's tower every position attends to every other: changing a padding embedding changes the
    feature, so no prompt may be truncated (the CLIP shortcut would be wrong here)."""
    m = tiny_siglip.model
    tokens = tiny_siglip.tokenizer(["a photo of a cat."])
    x = m.text.token_embedding(tokens) + m.text.positional_embedding
    y = x.clone()
    y[:, 20] += torch.randn(y.shape[-1], generator=torch.Generator().manual_seed(0))  # padding, after end-of-text
    with torch.no_grad():
        a, b = (m.text.transformer(v, attn_mask=None)[:, 10] for v in (x, y))
    assert (a - b).abs().max() > 1e-3


def test_siglip_token_layout_without_start_token(tiny_siglip):
    m = tiny_siglip.model
    tok = SigLipLayout(tiny_siglip.tokenizer)
    enc = PromptTextEncoder(m, tok, NAMES)
    assert (enc.start, enc.n_ctx) == (0, 4)
    tokens = tok([class_prompt("a photo of a", n) for n in NAMES])
    assert int(tokens[0, -1]) == tok.eot  # padded with end-of-text, pooled there
    with torch.no_grad():
        torch.testing.assert_close(enc(enc.ctx_init), m.encode_text(tokens, normalize=True), rtol=0, atol=FEAT_TOL)
        ctx = enc.ctx_init + 0.05 * torch.randn(*enc.ctx_init.shape, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(enc(ctx), slow_encode(m.text, tokens, 0, ctx), rtol=0, atol=FEAT_TOL)


def test_unsupported_pooling_is_one_clear_error(tiny_siglip, monkeypatch):
    from extract.text_encoder import TextEncoderError

    monkeypatch.setattr(tiny_siglip.model.text, "pool_type", "none")
    with pytest.raises(TextEncoderError, match="pool type 'none' is not supported"):
        PromptTextEncoder(tiny_siglip.model, tiny_siglip.tokenizer, NAMES)


@pytest.mark.parametrize("key", ["tpt", "ctpt", "rtpt"])
def test_shared_first_forward_on_siglip_equals_one_forward_per_sample(tiny_siglip, key):
    """Step 0's text forward shared by a pass (one forward, G backward passes under vmap through `_block`) gives the
    rows of one forward per sample, on the bidirectional tower."""
    import dataclasses
    import warnings

    import torch.nn.functional as F

    from extract.methods import get_method

    text = tiny_siglip.encode_texts([class_prompt("a photo of a", n) for n in NAMES])
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, len(NAMES), (5,), generator=g)
    x = F.normalize(text[y][:, None] + 0.4 * torch.randn(5, 64, text.shape[1], generator=g), dim=-1)
    out = []
    for shortcuts in (True, False):
        cls = get_method(key)
        cfg = dataclasses.replace(cls.default_config("dtd", "ViT-B-16-SigLIP"), text_shortcuts=shortcuts)
        m = cls(cfg, text, tiny_siglip.logit_scale, backbone="tiny-siglip", dataset="dtd", text_encoder=tiny_siglip,
                class_names=NAMES)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no vmap fallback ("performance drop") warning
            out.append(m.adapt(x))
    # a prediction forward (2 FEAT_TOL·scale) plus one AdamW step's share (2 FEAT_TOL·scale): test_extract_tpt.py
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=4 * FEAT_TOL * tiny_siglip.logit_scale)
