"""Shared helpers of the per-batch encoder methods' tests (tests/extract/methods/test_watt.py, test_clipartt.py,
test_norm_tuning.py): tiny ViT and ResNet CLIPs on the CPU, OpenAI's `convert_weights` and fp16 LayerNorm written
out, the official model's forward pieces, and tolerances. Written from
docs/methods.md, "Methods that adapt the image encoder per batch (WATT, CLIPArTT)"."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NAMES = ("cat", "dog", "sea lion", "car", "tree")
K = len(NAMES)
SCALE = 37.5  # the tiny models' exp(logit_scale): not OpenAI's 100, so a hard-coded 100 shows
EPS32 = torch.finfo(torch.float32).eps
EPS16 = torch.finfo(torch.float16).eps


def tiny_cfg(family: str) -> dict:
    """The tiny CLIP of tests/support/extract.py (`tiny_model_cfg`): a one-block ViT or a ModifiedResNet with one
    bottleneck per stage (3 stem BatchNorms, 3 per bottleneck, 1 per downsample), both 32 px, embedding 16."""
    from tests.support.extract import tiny_model_cfg

    return tiny_model_cfg(vision=family)


def tiny_loaded(family: str, seed: int = 0):
    """A tiny CLIP as the run hands it to a method (`LoadedModel` on the CPU, fp32), random BatchNorm statistics
    and affine parameters (so that batch statistics and the running ones differ).

    The ViT's class and positional embeddings are zero: random ones make its one block's class token nearly the
    same for every image (cosine ~0.97), so every image gets the same pseudo-labels and prompts, the text-graph loss
    is constant (ln B) and its gradient is rounding noise, which Adam scales up to lr-sized steps on some CPUs and
    not on others. Zero, the images decide the features and the pseudo-labels differ."""
    import open_clip

    from extract.models import LoadedModel, Preprocess

    torch.manual_seed(seed)
    model = open_clip.CLIP(**tiny_cfg(family))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(SCALE))
        if family == "vit":
            model.visual.class_embedding.zero_()
            model.visual.positional_embedding.zero_()
        for m in model.modules():
            if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.LayerNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    model = model.eval().requires_grad_(False)
    tok = open_clip.get_tokenizer("ViT-B-32", context_length=32)
    return LoadedModel(model, tok, f"tiny-{family}", "none", f"tiny-{family}", True,
                       Preprocess((32, 32), (0.5,) * 3, (0.25,) * 3), SCALE, torch.device("cpu"), "fp32", family)


def pixels(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def openai_fp16(model: torch.nn.Module) -> torch.nn.Module:
    """OpenAI `clip/model.py` `convert_weights` in place, written out: Conv1d/Conv2d/Linear weight and bias,
    MultiheadAttention's projection weights and biases, and any `text_projection` / `proj` attribute to fp16; each
    LayerNorm then runs as OpenAI's subclass: `super().forward(x.float()).type(x.dtype)`."""
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)):
            mod.weight.data = mod.weight.data.half()
            if mod.bias is not None:
                mod.bias.data = mod.bias.data.half()
        if isinstance(mod, torch.nn.MultiheadAttention):
            for attr in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                         "bias_k", "bias_v"):
                t = getattr(mod, attr)
                if t is not None:
                    t.data = t.data.half()
        for attr in ("text_projection", "proj"):
            t = getattr(mod, attr, None)
            if isinstance(t, torch.Tensor):
                t.data = t.data.half()
        if isinstance(mod, torch.nn.LayerNorm):
            def forward(x, _m=mod):
                return F.layer_norm(x.float(), _m.normalized_shape, _m.weight, _m.bias, _m.eps).type(x.dtype)
            mod.forward = forward
    return model


def encode_image(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """OpenAI `CLIP.encode_image`: `self.visual(image.type(self.dtype))`."""
    return model.visual(x.type(model.visual.conv1.weight.dtype))


def cross_entropy(preds: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The official `cross_entropy(..., reduction='mean')`: (−targets · LogSoftmax(dim=−1)(preds)).sum(1).mean()."""
    return (-targets * torch.nn.LogSoftmax(dim=-1)(preds)).sum(1).mean()


def logit_tol(dtype: torch.dtype, steps: int, width: int = 32) -> float:
    """Logit tolerance between two paths through the same tiny model after `steps` Adam steps: a unit feature
    reduced over the model's width moves by ~width·eps when a summation order changes, each step carrying at most
    twice that into the next (tests/support/tpt.py `tuned_tol`), the logits times the scale."""
    eps = EPS16 if dtype == torch.float16 else EPS32
    return (2 + 2 * steps) * width * eps * SCALE


def assert_reset_per_batch(loaded, make) -> None:
    """Two batches of 4 through `adapt` (the run's call, pixels attached) equal each batch adapted alone by a fresh
    method: nothing carries from one batch to the next; and the run's frozen model is never changed.

    Args:
        loaded: the `LoadedModel`; make: `make(batch_size=...)` -> a fresh method on it.
    """
    import copy

    before = copy.deepcopy(loaded.model.state_dict())
    x = pixels(8, 5)
    m = make(batch_size=4)
    m.attach_pixels(lambda a, b: x[a:b])
    feats = torch.zeros(4, 1, 16)  # what the run feeds besides the pixels (unused)
    first, second = m.adapt(feats), m.adapt(feats)
    assert m.n_seen == 8 and type(m).adapt_width(m.config) == 4
    assert torch.equal(second, make().adapt_images(x[4:]))
    assert torch.equal(first, make().adapt_images(x[:4]))
    after = loaded.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
