"""A prompt-learnable view of an open_clip text tower (TPT's `PromptLearner` + `TextEncoder`,
TPT `clip/custom_clip.py`; docs/methods.md, "TPT: episodic prompt tuning").

The prompt of class c is `"{ctx_init} {name}."` (TPT `clip/custom_clip.py`: `prompt_prefix + " " + name + "."`, with
`_` replaced by a space). Its token embeddings are split into the start token, the `n_ctx` context tokens (4 for
"a photo of a") and the rest (class name, ".", end-of-text, padding). The context tokens are replaced by a learnable
tensor shared by all classes, and the sequence goes through the frozen tower exactly as open_clip's
`CLIP.encode_text` / `TextTransformer.forward` do: add the positional embedding, run the transformer with the
causal mask, `ln_final`, pool at the end-of-text token (`text_pool_type` "argmax" or "eos"), project.

SigLIP (docs/methods.md, "SigLIP"): a bidirectional tower (no causal mask) pooled at the last position, and a
tokenizer without a start token, so the context starts after however many leading special tokens the tokenizer
writes (`context_span`), the pooled position follows the tower's pool type, and the shortcuts below (which rest on
the causal mask) are off.

Speed: under the causal mask a position only attends to earlier ones, so everything after a prompt's end-of-text
token can be dropped without changing its pooled feature. With `truncate=True` the prompts are grouped by the
position of their end-of-text token and each group runs only that far (ImageNet's prompts end at token 9 on
average, 18 at most, of 77); groups smaller than `min_bucket` prompts join the next longer one, to keep the number
of transformer calls small. `truncate=False` runs the full context in one call, without the prefix sharing below,
and reproduces `model.encode_text` bit for bit.

The causal mask also makes the first 1 + n_ctx positions (start token and context) the same for every class:
with `share_prefix=True` they run once per context, and each class's remaining positions attend to their keys and
values, projected once per context (the blocks are written out: `_encode_group_shared`). Before the first attention
the class positions do not depend on the context either, and only the end-of-text position is pooled, so the first
block's class inputs are projected once and the last block computes that one position. For ImageNet-length prompts
this roughly halves the work again. It needs open_clip's plain `ResidualAttentionBlock` (batch-first, a packed
`nn.MultiheadAttention`); other block types use the full sequences.

    >>> enc = PromptTextEncoder(loaded.model, loaded.tokenizer, ["cat", "dog"])   # doctest: +SKIP
    >>> feats = enc(enc.ctx_init)   # doctest: +SKIP
    >>> feats.shape                 # doctest: +SKIP
    (K, D)                          # L2-normalised: the zero-shot "a photo of a {}." prototypes
    >>> enc(ctx).shape              # doctest: +SKIP
    (B, K, D)                       # ctx (B, n_ctx, W): B independent contexts in one pass

Class-specific contexts (DART's): with `prompts` (one text per class) and `n_ctx`, the `n_ctx` tokens after the
leading special tokens of each class's own prompt are its learnable context, and `ctx` is (K, n_ctx, W) or
(B, K, n_ctx, W). The contexts differ per class, so only the truncation applies (no shared prefix).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
import torch.nn.functional as F


#: open_clip `text_global_pool` types a prompt can be pooled with ("none" returns every token: no class feature)
POOL_TYPES = ("argmax", "eos", "first", "last")


class TextEncoderError(ValueError):
    """The model's text tower is not one a prompt can be learned in (e.g. a Hugging Face text tower)."""


def _text_tower(model: Any) -> SimpleNamespace:
    """The pieces of `encode_text` for open_clip's CLIP (attributes on the model) or CustomTextCLIP (`model.text`).

    Causal towers (CLIP) and bidirectional ones (SigLIP: `no_causal_mask`, `attn_mask` None) are both supported, with
    open_clip's pool types `argmax`, `eos`, `first` and `last` (`text_global_pool`). A class token or a padding mask
    (CoCa, `use_pad_mask`) is refused: the prompt learner builds the token embeddings itself.
    """
    src = model if hasattr(model, "token_embedding") else getattr(model, "text", None)
    needed = ("token_embedding", "positional_embedding", "transformer", "ln_final", "attn_mask")
    if src is None or not all(hasattr(src, n) for n in needed):
        raise TextEncoderError(
            f"{type(model).__name__}: prompt tuning needs an open_clip CLIP-style text tower (token_embedding, "
            "positional_embedding, transformer, ln_final; causal or not); Hugging Face text towers are not supported")
    pool = getattr(src, "text_pool_type", None) or getattr(src, "pool_type", "argmax")
    eos_id = getattr(src, "text_eos_id", None) if src is model else getattr(src, "eos_id", None)
    if getattr(src, "cls_emb", None) is not None or getattr(src, "use_pad_mask", False):
        raise TextEncoderError(f"{type(model).__name__}: text towers with a class token or a padding mask are not "
                               "supported by the prompt learner")
    if pool not in POOL_TYPES:
        raise TextEncoderError(f"{type(model).__name__}: text pool type {pool!r} is not supported (expected one of "
                               f"{', '.join(POOL_TYPES)})")
    return SimpleNamespace(token_embedding=src.token_embedding, positional_embedding=src.positional_embedding,
                           transformer=src.transformer, ln_final=src.ln_final,
                           text_projection=getattr(src, "text_projection", None), attn_mask=src.attn_mask,
                           causal=src.attn_mask is not None, pool=pool, eos_id=eos_id)


def context_span(tokens_init: torch.Tensor, tokens_empty: torch.Tensor) -> tuple[int, int]:
    """Where a context's tokens sit in a tokenised prompt: (start, n_ctx).

    A tokenizer turns "" into its special tokens and padding (CLIP: start, end, 0...; SigLIP's: end, padding...) and
    `ctx_init` into the same with the context's tokens inserted after the leading specials. `start` is the length of
    the common prefix of the two, and `n_ctx` the shift that makes the rest of `ctx_init`'s tokens equal those of "".

    Args:
        tokens_init: (L,) token ids of `ctx_init`; tokens_empty: (L,) token ids of "".

    Returns:
        (start, n_ctx); n_ctx is 0 when no shift matches.

    >>> context_span(torch.tensor([7, 1, 2, 3, 9, 0, 0]), torch.tensor([7, 9, 0, 0, 0, 0, 0]))
    (1, 3)
    >>> context_span(torch.tensor([1, 2, 9, 9]), torch.tensor([9, 9, 9, 9]))
    (0, 2)
    """
    a, e = tokens_init.tolist(), tokens_empty.tolist()
    start = next((i for i, (x, y) in enumerate(zip(a, e)) if x != y), len(a))
    for n in range(1, len(a) - start):
        if a[start + n:] == e[start:len(e) - n]:
            return start, n
    return start, 0


def _plain_blocks(transformer: Any) -> bool:
    """open_clip's standard batch-first `ResidualAttentionBlock`s (what the shared-prefix path calls into)."""
    from open_clip.transformer import ResidualAttentionBlock

    def plain_attention(a: Any) -> bool:  # packed input projection, no extra keys, no dropout
        return (isinstance(a, torch.nn.MultiheadAttention) and a.batch_first and a._qkv_same_embed_dim
                and a.bias_k is None and a.bias_v is None and not a.add_zero_attn
                and (a.dropout == 0 or not a.training))

    return (bool(getattr(transformer, "batch_first", False)) and not getattr(transformer, "grad_checkpointing", False)
            and all(type(b) is ResidualAttentionBlock and not hasattr(b, "ln_1_kv") and plain_attention(b.attn)
                    for b in transformer.resblocks))


class _Attention(torch.autograd.Function):
    """`F.scaled_dot_product_attention` (the call `nn.MultiheadAttention` makes) with the textbook backward.

    The forward is the fused kernel itself, so the features are what open_clip computes. The backward recomputes the
    softmax in fp32 and applies dV = PᵀdO, dS = P ∘ (dO Vᵀ − rowsum(P ∘ dO Vᵀ)), dQ = s·dS K, dK = s·dSᵀQ (s =
    1/√head_dim), the formulas the fused backward kernels evaluate, with fp32 accumulation as theirs. It is here
    because those kernels have no `torch.func.vmap` batching rule: the shared first forward of the TPT tuners
    (`EpisodicTuner._share_first_forward`) runs G backward passes through one graph under vmap, and a rule-less
    kernel would run once per sample. The prompts are short (at most 77 positions), so P is small.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, mask = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 for fp16/bf16 inputs
        qf, kf, vf, do = q.to(acc), k.to(acc), v.to(acc), d_out.to(acc)
        s = qf @ kf.transpose(-1, -2) * scale
        p = torch.softmax(s if mask is None else s + mask.to(acc), dim=-1)  # (..., L_q, L_k)
        dp = do @ vf.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = (ds @ kf) * scale
        dk = (ds.transpose(-1, -2) @ qf) * scale
        dv = p.transpose(-1, -2) @ do
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _block(blk: Any, x: torch.Tensor) -> torch.Tensor:
    """open_clip's `ResidualAttentionBlock.forward` without a mask (batch-first, packed `nn.MultiheadAttention`),
    the attention through `_Attention`, whose backward has a vmap rule (the fused kernels' have none, so the shared
    first forward of the TPT tuners would run their backward once per sample). (N, L, W) -> (N, L, W)."""
    attn = blk.attn
    n, length, w = x.shape
    h = attn.num_heads
    q, k, v = F.linear(blk.ln_1(x), attn.in_proj_weight, attn.in_proj_bias).unflatten(-1, (3, h, w // h)).permute(
        2, 0, 3, 1, 4)  # each (N, H, L, hd)
    o = _Attention.apply(q, k, v, None)
    x = x + blk.ls_1(F.linear(o.transpose(1, 2).reshape(n, length, w), attn.out_proj.weight, attn.out_proj.bias))
    return x + blk.ls_2(blk.mlp(blk.ln_2(x)))


def class_prompt(ctx_init: str, name: str) -> str:
    """TPT's prompt string: `"{ctx_init} {name}."` with underscores in the name replaced by spaces.

    >>> class_prompt("a photo of a", "sea_lion")
    'a photo of a sea lion.'
    """
    return f"{ctx_init} {name.replace('_', ' ')}."


class PromptTextEncoder:
    """K class prompts with a learnable shared context, encoded by a frozen open_clip text tower.

    Args:
        model: an open_clip `CLIP` or `CustomTextCLIP` (frozen; its parameters receive no gradient).
        tokenizer: the model's open_clip tokenizer.
        class_names: the K class names.
        ctx_init: the words whose token embeddings initialise the context ("a photo of a", TPT `--ctx_init`).
        truncate: run each prompt only up to its end-of-text token, in length groups (exact; see module doc).
        min_bucket: smallest length group with `truncate` (smaller ones are merged into the next longer group).
        share_prefix: run the class-independent start + context positions once per context (exact; module doc).
        prompts: the K prompt texts, for class-specific contexts (default: `"{ctx_init} {name}."` with one shared
            context); their `n_ctx` tokens after the leading specials are the contexts.
        n_ctx: the number of context tokens of `prompts` (required with them).

    Attributes:
        ctx_init: (n_ctx, W) float32 initial context (the token embeddings of `ctx_init`); with `prompts`
            (K, n_ctx, W), each class's own tokens.
        n_ctx: number of context tokens.
        tokens: (K, 77) int64 token ids of the prompts.
        buckets: the length groups, as (class indices, sequence length) pairs.
        length: the longest sequence length run.
        shared_prefix: whether the shared-prefix path is in use.
    """

    def __init__(self, model: Any, tokenizer: Any, class_names: Sequence[str], *, ctx_init: str = "a photo of a",
                 truncate: bool = True, min_bucket: int = 32, share_prefix: bool = True,
                 prompts: Sequence[str] | None = None, n_ctx: int | None = None) -> None:
        if not class_names:
            raise ValueError("PromptTextEncoder needs at least one class name")
        t = _text_tower(model)
        self._t = t
        device = t.token_embedding.weight.device
        self.per_class = prompts is not None
        if prompts is not None:
            tokens, start, init = self._class_prompts(tokenizer, prompts, n_ctx, len(class_names), device)
        else:
            tokens, start, init = self._shared_prompts(tokenizer, ctx_init, class_names, device)
        self.start = start  # leading special tokens before the context (CLIP: the start token; SigLIP's: none)
        end = start + self.n_ctx
        pool_idx = self._pool_index(tokens, t)  # (K,) the pooled position
        if bool((pool_idx < end).any()):
            raise ValueError(f"a prompt ends inside its {self.n_ctx} context tokens")
        self.tokens = tokens
        self.n_classes = len(class_names)
        # Dropping the positions after the pooled one is exact only when no earlier position attends to them (the
        # causal mask) and the pooled position is not the last one by definition; bidirectional towers (SigLIP)
        # run the full context.
        truncate = bool(truncate) and t.causal and t.pool in ("argmax", "eos")
        self.shared_prefix = (bool(share_prefix) and truncate and start == 1 and not self.per_class
                              and _plain_blocks(t.transformer))
        # bidirectional plain blocks run written out (`_block`): their attention's backward then batches under vmap
        self._written_out = not t.causal and _plain_blocks(t.transformer)
        self.buckets = self._group(pool_idx.tolist(), tokens.shape[1], truncate, max(1, min_bucket))
        self.length = max(n for _, n in self.buckets)
        with torch.no_grad():
            emb = t.token_embedding(tokens)  # (K, L, W)
            ctx0 = emb[:, start:end] if self.per_class else t.token_embedding(init[None])[0, start:end]
        self.width = emb.shape[-1]
        self.ctx_init = ctx0.detach().float().clone()  # (n_ctx, W), or (K, n_ctx, W) per class
        # per group: leading specials (K_b, start, W); class name, ".", end-of-text, padding (K_b, L_b - end, W);
        # the pooled positions (K_b,); the group's classes (K_b,)
        self._parts = []
        for idx, n in self.buckets:
            ix = torch.tensor(idx, device=device)
            self._parts.append((emb[ix, :start].detach(), emb[ix, end:n].detach(), pool_idx[ix], n, ix))
        order = [c for idx, _ in self.buckets for c in idx]
        # group-concatenated order -> class order (None when the groups already list the classes in order)
        self._inverse = (None if order == list(range(self.n_classes))
                         else torch.argsort(torch.tensor(order, device=device)))

    def _shared_prompts(self, tokenizer: Any, ctx_init: str, class_names: Sequence[str], device: torch.device
                        ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """TPT's prompts `"{ctx_init} {name}."`: (tokens (K, L), start, the tokens of `ctx_init`); sets n_ctx."""
        if not ctx_init.strip():
            raise ValueError("ctx_init must contain at least one word")
        tokens = tokenizer([class_prompt(ctx_init, n) for n in class_names]).to(device)  # (K, L)
        init = tokenizer([ctx_init]).to(device)[0]
        start, self.n_ctx = context_span(init, tokenizer([""]).to(device)[0])
        if self.n_ctx < 1:
            raise ValueError(f"ctx_init {ctx_init!r} tokenises to no context tokens")
        # CLIP's BPE and SigLIP's SentencePiece split at spaces, so the prefix tokenises the same inside every
        # prompt; check it anyway.
        if not torch.equal(tokens[:, start:start + self.n_ctx], init[start:start + self.n_ctx].expand(
                len(class_names), -1)):
            raise ValueError(f"the tokens of {ctx_init!r} change inside the class prompts; cannot share a context")
        return tokens, start, init

    def _class_prompts(self, tokenizer: Any, prompts: Sequence[str], n_ctx: int | None, k: int,
                       device: torch.device) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Given prompts with class-specific contexts: (tokens (K, L), start, tokens[0]); sets n_ctx."""
        if len(prompts) != k:
            raise ValueError(f"{len(prompts)} prompts for {k} classes")
        if n_ctx is None or n_ctx < 1:
            raise ValueError(f"prompts with class contexts need n_ctx >= 1, got {n_ctx}")
        self.n_ctx = int(n_ctx)
        tokens = tokenizer(list(prompts)).to(device)  # (K, L)
        start, _ = context_span(tokenizer(["x"]).to(device)[0], tokenizer([""]).to(device)[0])
        return tokens, start, tokens[0]

    @staticmethod
    def _group(ends: list[int], full: int, truncate: bool, min_bucket: int) -> list[tuple[list[int], int]]:
        """Classes grouped by sequence length (end-of-text position + 1), shortest first."""
        if not truncate:
            return [(list(range(len(ends))), full)]
        by_len: dict[int, list[int]] = {}
        for c, e in enumerate(ends):
            by_len.setdefault(e + 1, []).append(c)
        groups: list[tuple[list[int], int]] = []
        carry: list[int] = []
        lengths = sorted(by_len)
        for i, n in enumerate(lengths):
            carry = carry + by_len[n]
            if len(carry) >= min_bucket or i == len(lengths) - 1:
                groups.append((carry, n))
                carry = []
        return groups

    @staticmethod
    def _pool_index(tokens: torch.Tensor, t: SimpleNamespace) -> torch.Tensor:
        # open_clip `text_global_pool`: argmax of the token ids (end-of-text has the largest id), the first eos, or
        # the first / last position of the context
        if t.pool == "argmax":
            return tokens.argmax(dim=-1)
        if t.pool == "eos":
            return (tokens == t.eos_id).int().argmax(dim=-1)
        return torch.full_like(tokens[:, 0], 0 if t.pool == "first" else tokens.shape[1] - 1)

    @property
    def device(self) -> torch.device:
        return self.ctx_init.device

    def _encode_group(self, ctx: torch.Tensor, prefix: torch.Tensor, suffix: torch.Tensor, pool: torch.Tensor,
                      length: int, classes: torch.Tensor) -> torch.Tensor:
        """ctx (B, n_ctx, W), or per class (B, K, n_ctx, W) -> (B, K_b, D) unnormalised features of one length group
        (open_clip `encode_text`); `classes`: the group's class indices."""
        t = self._t
        b, k = ctx.shape[0], prefix.shape[0]
        cast = t.transformer.get_cast_dtype()
        # cast before the shared context is expanded to the K_b classes (a cast of the view would copy it K_b times)
        rows = (ctx[:, classes].to(prefix.dtype) if self.per_class
                else ctx[:, None].to(prefix.dtype).expand(-1, k, -1, -1))
        x = torch.cat([
            prefix[None].expand(b, -1, -1, -1),
            rows,
            suffix[None].expand(b, -1, -1, -1),
        ], dim=2).reshape(b * k, length, self.width).to(cast)  # as token_embedding(text).to(cast_dtype)
        x = x + t.positional_embedding[:length].to(cast)
        if self._written_out:
            for blk in t.transformer.resblocks:
                x = _block(blk, x)
        else:
            x = t.transformer(x, attn_mask=None if t.attn_mask is None else t.attn_mask[:length, :length])
        x = t.ln_final(x)
        x = x[torch.arange(b * k, device=x.device), pool.repeat(b)]  # (B*K_b, W) at end-of-text
        if t.text_projection is not None:
            x = t.text_projection(x) if isinstance(t.text_projection, torch.nn.Linear) else x @ t.text_projection
        return x.reshape(b, k, -1)

    def _encode_group_shared(self, ctx: torch.Tensor, prefix: torch.Tensor, suffix: torch.Tensor,
                             pool: torch.Tensor, length: int, classes: torch.Tensor) -> torch.Tensor:
        """As `_encode_group`, with the class-independent work done once (see the module doc).

        The blocks are open_clip's `ResidualAttentionBlock.forward` written out on two streams: the start + context
        positions (B, n_pre, W), run once per context, and each class's remaining positions (B, K_b, L_s, W), which
        attend to the prefix's keys and values (projected once per context, not once per class) and to their own.
        Before the first attention the class positions do not depend on the context, so the first block's ln_1 and
        input projection run once for the K_b classes, not B·K_b times. In the last block only the end-of-text
        position is pooled, so only its query, attention output and MLP are computed (keys and values still cover
        every position it attends to). Every operation is the one `nn.MultiheadAttention` (batch-first, packed
        input projection, `scaled_dot_product_attention`) and the block apply, in the same dtypes under autocast;
        the attention's backward is `_Attention`'s.
        """
        t = self._t
        b, k = ctx.shape[0], suffix.shape[0]
        n_pre = 1 + self.n_ctx
        w = self.width
        cast = t.transformer.get_cast_dtype()
        pos = t.positional_embedding[:length].to(cast)
        pre = torch.cat([prefix[:1].expand(b, -1, -1), ctx.to(prefix.dtype)], dim=1).to(cast) + pos[:n_pre]
        suf = (suffix.to(cast) + pos[n_pre:])[None]  # (1, K_b, L_s, W): the same for every context so far
        mask = t.attn_mask[:length, :length]
        eot = pool - n_pre  # (K_b,) end-of-text position within the class positions
        blocks = list(t.transformer.resblocks)
        for i, blk in enumerate(blocks):
            last = i + 1 == len(blocks)
            attn = blk.attn
            h = attn.num_heads
            hd = w // h
            wt, bias = attn.in_proj_weight, attn.in_proj_bias
            pre_ln = blk.ln_1(pre)  # (B, n_pre, W)
            m = mask.to(pre_ln.dtype)  # as `ResidualAttentionBlock.attention`: attn_mask.to(q_x.dtype)
            qkv_p = F.linear(pre_ln, wt, bias).unflatten(-1, (3, h, hd)).permute(2, 0, 3, 1, 4)  # (3, B, H, n_pre, hd)
            suf_ln = blk.ln_1(suf)  # (B or 1, K_b, L_s, W)
            if last:  # the query of the end-of-text position only
                base = suf[:, torch.arange(k, device=suf.device), eot][:, :, None]  # (B or 1, K_b, 1, W)
                q_ln = suf_ln[:, torch.arange(k, device=suf.device), eot][:, :, None]
                q = F.linear(q_ln, wt[:w], None if bias is None else bias[:w]).unflatten(-1, (h, hd))
                kv = F.linear(suf_ln, wt[w:], None if bias is None else bias[w:]).unflatten(-1, (2, h, hd))
                k_s, v_s = kv.unbind(-3)
                q_mask = m[pool][:, None][None].expand(b, -1, -1, -1).reshape(b * k, 1, 1, length)
            else:
                q, k_s, v_s = F.linear(suf_ln, wt, bias).unflatten(-1, (3, h, hd)).unbind(-3)
                q_mask = m[n_pre:]
            n_q = q.shape[2]

            def heads(x: torch.Tensor) -> torch.Tensor:  # (B or 1, K_b, L, H, hd) -> (B·K_b, H, L, hd)
                return x.transpose(2, 3).expand(b, -1, -1, -1, -1).reshape(b * k, h, x.shape[2], hd)

            keys = [qkv_p[j][:, None].expand(-1, k, -1, -1, -1).reshape(b * k, h, n_pre, hd) for j in (1, 2)]
            key = torch.cat([keys[0], heads(k_s)], dim=2)  # (B·K_b, H, L_b, hd): prefix, then own positions
            val = torch.cat([keys[1], heads(v_s)], dim=2)
            o = _Attention.apply(heads(q), key, val, q_mask)  # (B·K_b, H, n_q, hd)
            o = F.linear(o.transpose(1, 2).reshape(b, k, n_q, w), attn.out_proj.weight, attn.out_proj.bias)
            x = (suf if not last else base) + blk.ls_1(o)
            suf = x + blk.ls_2(blk.mlp(blk.ln_2(x)))
            if not last:  # the prefix's own block (its output after the last block is not needed)
                o_p = _Attention.apply(qkv_p[0], qkv_p[1], qkv_p[2], m[:n_pre, :n_pre])
                o_p = F.linear(o_p.transpose(1, 2).reshape(b, n_pre, w), attn.out_proj.weight, attn.out_proj.bias)
                x = pre + blk.ls_1(o_p)
                pre = x + blk.ls_2(blk.mlp(blk.ln_2(x)))
        x = t.ln_final(suf[:, :, 0])  # (B, K_b, W) at end-of-text
        if t.text_projection is not None:
            x = t.text_projection(x) if isinstance(t.text_projection, torch.nn.Linear) else x @ t.text_projection
        return x

    def __call__(self, ctx: torch.Tensor) -> torch.Tensor:
        """Encode the K prompts with context `ctx`.

        Args:
            ctx: (n_ctx, W) one context, or (B, n_ctx, W) B independent contexts (one per test sample); with
                class-specific contexts (K, n_ctx, W) or (B, K, n_ctx, W).

        Returns:
            (K, D), or (B, K, D), L2-normalised text features (in the tower's compute dtype; under autocast the
            transformer runs in half precision as `encode_text` would). Differentiable in `ctx`.
        """
        one = (self.n_classes, self.n_ctx, self.width) if self.per_class else (self.n_ctx, self.width)
        single = ctx.ndim == len(one)
        if single:
            ctx = ctx[None]
        if tuple(ctx.shape[1:]) != one:
            raise ValueError(f"ctx must be {one} or (B, {', '.join(map(str, one))}), got {tuple(ctx.shape)}")
        encode = self._encode_group_shared if self.shared_prefix else self._encode_group
        outs = [encode(ctx, *part) for part in self._parts]
        x = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self._inverse is not None:
            x = x[:, self._inverse]
        x = F.normalize(x, dim=-1)
        return x[0] if single else x
