"""A prompt-learnable view of an open_clip text tower (TPT's `PromptLearner` + `TextEncoder`, spec §3).

The prompt of class c is `"{ctx_init} {name}."` (TPT `clip/custom_clip.py`: `prompt_prefix + " " + name + "."`, with
`_` replaced by a space). Its token embeddings are split into the start token, the `n_ctx` context tokens (4 for
"a photo of a") and the rest (class name, ".", end-of-text, padding). The context tokens are replaced by a learnable
tensor shared by all classes, and the sequence goes through the frozen tower exactly as open_clip's
`CLIP.encode_text` / `TextTransformer.forward` do: add the positional embedding, run the transformer with the
causal mask, `ln_final`, pool at the end-of-text token (`text_pool_type` "argmax" or "eos"), project.

Speed: the token sequence is cut after the last end-of-text position of the K prompts (`truncate=True`). Under the
causal mask a position only attends to earlier ones, so the pooled features are mathematically unchanged while the
transformer runs on ~15 instead of 77 positions. `truncate=False` runs the full context and reproduces
`model.encode_text` bit for bit.

    >>> enc = PromptTextEncoder(loaded.model, loaded.tokenizer, ["cat", "dog"])   # doctest: +SKIP
    >>> feats = enc(enc.ctx_init)   # doctest: +SKIP
    >>> feats.shape                 # doctest: +SKIP
    (K, D)                          # L2-normalised: the zero-shot "a photo of a {}." prototypes
    >>> enc(ctx).shape              # doctest: +SKIP
    (B, K, D)                       # ctx (B, n_ctx, W): B independent contexts in one pass
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
import torch.nn.functional as F


class TextEncoderError(ValueError):
    """The model's text tower is not one a prompt can be learned in (e.g. a Hugging Face text tower)."""


def _text_tower(model: Any) -> SimpleNamespace:
    """The pieces of `encode_text` for open_clip's CLIP (attributes on the model) or CustomTextCLIP (`model.text`)."""
    src = model if hasattr(model, "token_embedding") else getattr(model, "text", None)
    needed = ("token_embedding", "positional_embedding", "transformer", "ln_final", "attn_mask")
    if src is None or not all(hasattr(src, n) for n in needed):
        raise TextEncoderError(
            f"{type(model).__name__}: prompt tuning needs an open_clip CLIP-style text tower (token_embedding, "
            "positional_embedding, transformer with a causal mask, ln_final); Hugging Face text towers are not "
            "supported")
    pool = getattr(src, "text_pool_type", None) or getattr(src, "pool_type", "argmax")
    eos_id = getattr(src, "text_eos_id", None) if src is model else getattr(src, "eos_id", None)
    if getattr(src, "cls_emb", None) is not None or getattr(src, "use_pad_mask", False):
        raise TextEncoderError(f"{type(model).__name__}: text towers with a class token or a padding mask are not "
                               "supported by the prompt learner")
    if src.attn_mask is None:
        raise TextEncoderError(f"{type(model).__name__}: the text tower has no causal mask; the context tokens "
                               "cannot be learned as TPT does")
    if pool not in ("argmax", "eos"):
        raise TextEncoderError(f"{type(model).__name__}: text_pool_type {pool!r} is not supported (expected "
                               "'argmax' or 'eos')")
    return SimpleNamespace(token_embedding=src.token_embedding, positional_embedding=src.positional_embedding,
                           transformer=src.transformer, ln_final=src.ln_final,
                           text_projection=getattr(src, "text_projection", None), attn_mask=src.attn_mask,
                           pool=pool, eos_id=eos_id)


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
        truncate: run only up to the last end-of-text position (exact under the causal mask; see module doc).

    Attributes:
        ctx_init: (n_ctx, W) float32 initial context (the token embeddings of `ctx_init`).
        n_ctx: number of context tokens.
        tokens: (K, L) int64 token ids of the prompts (L = truncated length).
    """

    def __init__(self, model: Any, tokenizer: Any, class_names: Sequence[str], *, ctx_init: str = "a photo of a",
                 truncate: bool = True) -> None:
        if not class_names:
            raise ValueError("PromptTextEncoder needs at least one class name")
        if not ctx_init.strip():
            raise ValueError("ctx_init must contain at least one word")
        t = _text_tower(model)
        self._t = t
        device = t.token_embedding.weight.device
        tokens = tokenizer([class_prompt(ctx_init, n) for n in class_names]).to(device)  # (K, 77)
        init = tokenizer([ctx_init]).to(device)[0]
        pool_idx = self._pool_index(tokens, t)
        init_end = int(self._pool_index(init[None], t)[0])
        self.n_ctx = init_end - 1  # tokens strictly between the start token and end-of-text
        if self.n_ctx < 1:
            raise ValueError(f"ctx_init {ctx_init!r} tokenises to no context tokens")
        # CLIP's BPE works word by word, so the prefix tokenises the same inside every prompt; check it anyway.
        if not torch.equal(tokens[:, 1:1 + self.n_ctx], init[1:1 + self.n_ctx].expand(len(class_names), -1)):
            raise ValueError(f"the tokens of {ctx_init!r} change inside the class prompts; cannot share a context")
        length = int(pool_idx.max()) + 1 if truncate else tokens.shape[1]
        self.tokens = tokens[:, :length]
        self.pool_idx = pool_idx  # (K,) position of end-of-text
        self.length = length
        with torch.no_grad():
            emb = t.token_embedding(self.tokens)  # (K, L, W)
            ctx0 = t.token_embedding(init[None])[0, 1:1 + self.n_ctx]
        self.prefix = emb[:, :1].detach()  # (K, 1, W) start token
        self.suffix = emb[:, 1 + self.n_ctx:].detach()  # (K, L - 1 - n_ctx, W) class name, ".", end, padding
        self.ctx_init = ctx0.detach().float().clone()  # (n_ctx, W)
        self.n_classes = len(class_names)
        self.width = emb.shape[-1]

    @staticmethod
    def _pool_index(tokens: torch.Tensor, t: SimpleNamespace) -> torch.Tensor:
        # open_clip `text_global_pool`: argmax of the token ids (end-of-text has the largest id), or the first eos
        if t.pool == "argmax":
            return tokens.argmax(dim=-1)
        return (tokens == t.eos_id).int().argmax(dim=-1)

    @property
    def device(self) -> torch.device:
        return self.prefix.device

    def __call__(self, ctx: torch.Tensor) -> torch.Tensor:
        """Encode the K prompts with context `ctx`.

        Args:
            ctx: (n_ctx, W) one context, or (B, n_ctx, W) B independent contexts (one per test sample).

        Returns:
            (K, D), or (B, K, D), L2-normalised text features (in the tower's compute dtype; under autocast the
            transformer runs in half precision as `encode_text` would). Differentiable in `ctx`.
        """
        single = ctx.ndim == 2
        if single:
            ctx = ctx[None]
        if ctx.ndim != 3 or ctx.shape[1:] != (self.n_ctx, self.width):
            raise ValueError(f"ctx must be ({self.n_ctx}, {self.width}) or (B, {self.n_ctx}, {self.width}), "
                             f"got {tuple(ctx.shape)}")
        b, k = ctx.shape[0], self.n_classes
        t = self._t
        cast = t.transformer.get_cast_dtype()
        x = torch.cat([
            self.prefix[None].expand(b, -1, -1, -1),
            ctx[:, None].to(self.prefix.dtype).expand(-1, k, -1, -1),
            self.suffix[None].expand(b, -1, -1, -1),
        ], dim=2).reshape(b * k, self.length, self.width).to(cast)  # (B*K, L, W) as token_embedding(text).to(cast)
        x = x + t.positional_embedding[:self.length].to(cast)
        x = t.transformer(x, attn_mask=t.attn_mask[:self.length, :self.length])
        x = t.ln_final(x)
        idx = self.pool_idx.repeat(b)
        x = x[torch.arange(b * k, device=x.device), idx]  # (B*K, W) at end-of-text
        if t.text_projection is not None:
            x = t.text_projection(x) if isinstance(t.text_projection, torch.nn.Linear) else x @ t.text_projection
        x = F.normalize(x, dim=-1).reshape(b, k, -1)
        return x[0] if single else x
