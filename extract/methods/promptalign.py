"""PromptAlign: MaPLe's multi-modal prompts tuned per sample on marginal entropy plus an alignment of the test
sample's token statistics to ImageNet's (`jameelhassan/PromptAlign @9290564`, `trainers/prompt_align.py`,
`clip/model.py`, `configs/trainers/PromptAlign/*.yaml`, `train.py`; docs/methods.md,
"PromptAlign: MaPLe prompts aligned to ImageNet's token statistics").

The model is MaPLe (Khattak et al., CVPR'23) on CLIP ViT-B/16: a 2-token context replaces the first 2 words of
"a photo of a {class}." in the text tower, and its linear projection (text width -> vision width) is appended to
the image tokens after the positional embedding; in the next J − 1 = 2 layers of both towers, those tokens are
replaced by deep prompts (text) and their projections (vision). All of it was trained on ImageNet (16 shots, 2
epochs) and is read from the user's MaPLe checkpoint (`maple_weights`).

Per test sample (prompts and optimiser reset before every sample): the 64 views (original + 63 crop+flip) go through
both prompted towers; the int(64·0.1) = 6 views of lowest softmax entropy are kept, and the loss is

    L = H(mean softmax of the 6) + (w / (to − from)) · Σ_{l=from}^{to−2} [½‖μ_l − μ̂_l‖₁ + ½‖σ²_l − σ̂²_l‖₁]

with μ_l, σ²_l the mean and (population) variance over the 6 views of layer l's input tokens (every token, the
prompt tokens included; (T, W) each), μ̂_l, σ̂²_l ImageNet's (`vis_means`, `vis_vars`), ‖·‖₁ the mean absolute
difference, w = 100, from = 0, to = 3 (layers 0 and 1: the official `range(from, to − 1)`). One AdamW step (lr 4e-2
on the ImageNet family, 5e-4 on the fine-grained sets) on every prompt parameter; the prediction is the tuned
model's logits on the original view.

Inputs: both image and text towers are prompted, so the method cannot run from cached features: the runner attaches
a reader of the views' pixels (`attach_views`, extract/run/pixels.py, as for TTL). ViT backbones with open_clip's
CLIP text tower only (MaPLe prompts a ViT's tokens and a causal text tower pooled at the end-of-text token).

Precision: on CUDA with `amp`, autocast fp16 with fp32 weights and prompts, and one dynamic loss scale emulating
GradScaler(init_scale=1000) for the run (`prompt_align.py:640`); fp32 on the CPU. The official `PREC: "fp16"` does
not make the model fp16: its `build_model` leaves `convert_weights` commented out (clip/model.py).

Where this differs from the official loop: the views are zaec's (the official loader draws them from the global
random state); selection ties are broken by view index (stable sort); the model is open_clip's, with the same
OpenAI weights (the CLIP weights stored in the MaPLe checkpoint beside the prompts are not read; a conv1 that
differs from the run's is said in a warning).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F

from extract.methods.base import (IMAGENET_FAMILY, ExternalFile, MethodConfig, PromptSet, Ref, Towers, TTAMethod,
                                  check_hparams_key, check_ranges, setting, text_setting)
from extract.methods.common import marginal_entropy, n_confident, softmax_entropy
from extract.methods.tpt import MixedPrecision
from extract.methods.view_pixels import ViewPixels

#: where the three files come from (printed when one is missing; docs/extract.md)
MAPLE_SOURCE = ("MaPLe's pre-trained ImageNet weights (muzairkhattak/multimodal-prompt-learning docs/RUN.md, "
                "cross-dataset and domain generalization: a zipped imagenet/seed1..3 folder), the file "
                "imagenet/seed1/MultiModalPromptLearner/model.pth.tar-2 (docs/extract.md)")
STATS_SOURCE = ("ImageNet's token statistics: PromptAlign's ImgNetpre_vis_means.pt / _vis_vars.pt (its docs/run.md "
                "links them), or compute them with `zaec-promptalign-stats` (docs/extract.md)")


@dataclass(frozen=True)
class PromptAlignConfig(MethodConfig):
    """PromptAlign's settings (configs/trainers/PromptAlign/DG_*.yaml, finegrain_*.yaml; `train.py` defaults)."""

    n_views: int = 64  # TPT.BATCH_SIZE 64 (train.py:114): the original + 63 views
    # AugMixAugmenter leaves its operation list empty (prompt_align.py:515): crop + flip views on every set
    augmix: bool = False
    prompts: PromptSet = field(default="single", metadata={"fixed": True})  # "{ctx_init} {class}.", learnable
    cupl: bool = field(default=False, metadata={"fixed": True})
    episodic: bool = field(default=True, metadata={"fixed": True})
    lr: float = setting(4e-2, ge=0)  # TPT.LR 4e-2 (DG config) / 5e-4 (finegrain config): default_config
    weight_decay: float = setting(0.01, ge=0)  # torch.optim.AdamW default (`AdamW(trainable_param, LR)`)
    beta1: float = setting(0.9, ge=0, lt=1)
    beta2: float = setting(0.999, ge=0, lt=1)
    adam_eps: float = setting(1e-8, gt=0)
    tta_steps: int = setting(1, ge=0)  # TPT.TTA_STEPS 1
    tpt_threshold: float = setting(0.1, gt=0, le=1)  # TPT.TPT_THRESHOLD 0.1: views of the entropy loss
    align_threshold: float = setting(0.1, gt=0, le=1)  # TPT.ALIGN_THRESHOLD 0.1: views of the alignment loss
    tpt_loss: bool = True  # TPT.TPT_LOSS
    distr_align: bool = True  # TPT.DISTR_ALIGN (True in both configs; train.py's default False)
    distr_loss_w: float = setting(100.0, ge=0)  # TPT.DISTR_LOSS_W 100.
    align_layer_from: int = setting(0, ge=0)  # TPT.ALIGN_LAYER_FROM 0
    # TPT.ALIGN_LAYER_TO 3; the loss sums layers from .. to − 2 (`range(from, to - 1)`)
    align_layer_to: int = setting(3, ge=Ref("align_layer_from", 2), le=Ref("vision_blocks", 1, of_model=True))
    n_ctx: int = setting(2, ge=1)  # TRAINER.PROMPTALIGN.N_CTX 2
    ctx_init: str = text_setting("a photo of a", nonempty=True)  # TRAINER.PROMPTALIGN.CTX_INIT
    prompt_depth: int = setting(3, ge=1, le=Ref("vision_blocks", of_model=True))  # PROMPT_DEPTH 3 (J)
    # the files (`external_files`): MaPLe's checkpoint, ImageNet's token means and variances
    maple_weights: str = text_setting("")
    vis_means: str = text_setting("")
    vis_vars: str = text_setting("")
    amp: bool = True  # autocast (fp16) + dynamic loss scale on CUDA; ignored on the CPU (fp32)
    grad_scale_init: float = setting(1000.0, gt=0)  # GradScaler(init_scale=1000) (prompt_align.py:640)
    grad_scale_growth_interval: int = setting(2000, ge=1)  # GradScaler default

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.tpt_loss or self.distr_align):
            raise ValueError("PromptAlignConfig: tpt_loss and distr_align are both off: no loss to tune on")


# ---------------------------------------------------------------------------------------------- reading the files

class _Inert:
    """Stands in for a class of a checkpoint's training state (dassl's LR scheduler, the optimiser it pickles, numpy
    scalars): keeps what the file gives it and runs none of the file's code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's state dict, "module." prefixes removed.

    `.safetensors` files are read as such. Any other file is read by torch's weights-only unpickler: a plain
    state dict, {"state_dict": ...} or {"model_state_dict": ...}. A dassl checkpoint (MaPLe's) also pickles its
    training state (the LR scheduler holds a CosineAnnealingLR, which holds the SGD optimiser), which
    `torch.load(weights_only=True)` refuses; those classes, listed by `torch.serialization.get_unsafe_globals_in_
    checkpoint`, are read as inert stand-ins (`_Inert`), so no code of the file runs and only its tensors are kept.

    Raises:
        ValueError: one line naming the file: unreadable, or no state dict of tensors in it.
    """
    p = Path(path).expanduser()
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(p))
        else:
            obj = _weights_only_load(p)
    except Exception as e:  # noqa: BLE001  (any reader error is a bad file; named in one line)
        raise ValueError(f"{path}: not a readable safetensors or torch checkpoint ({_reason(e)})") from None
    if isinstance(obj, dict):
        obj = obj.get("state_dict", obj.get("model_state_dict", obj))
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in obj.items()
            if isinstance(v, torch.Tensor)}


def _reason(e: BaseException) -> str:
    """The line of a reader's error that says what is wrong (torch's weights-only refusal names the global in a
    later line: "Trying to load unsupported GLOBAL ...")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln]
    return (named or lines or [type(e).__name__])[0]


def _weights_only_load(p: Path) -> Any:
    import pickle

    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(p))
        with torch.serialization.safe_globals([(_Inert, n) for n in names]):
            return torch.load(p, map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class MaplePrompts:
    """MaPLe's prompt parameters, the state PromptAlign starts every sample from (`prompt_learner.*`).

    Attributes:
        ctx: (n_ctx, Wt) the shared context (text side). proj_weight (Wv, Wt), proj_bias (Wv,): its projection to the
            image tokens. deep_text: J − 1 tensors (n_ctx, Wt), the text prompts of layers 1..J−1; deep_weight (Wv, Wt)
            and deep_bias (Wv,) per layer: their projections to the image tokens of the same layers.
    """

    ctx: torch.Tensor
    proj_weight: torch.Tensor
    proj_bias: torch.Tensor
    deep_text: tuple[torch.Tensor, ...]
    deep_weight: tuple[torch.Tensor, ...]
    deep_bias: tuple[torch.Tensor, ...]

    def params(self) -> list[torch.Tensor]:
        """The tensors in `prompt_learner.parameters()` order (ctx, proj, the deep text prompts, their projections)."""
        deep = [t for w, b in zip(self.deep_weight, self.deep_bias) for t in (w, b)]
        return [self.ctx, self.proj_weight, self.proj_bias, *self.deep_text, *deep]

    @classmethod
    def from_params(cls, params: Sequence[torch.Tensor]) -> "MaplePrompts":
        j1 = (len(params) - 3) // 3
        deep = params[3 + j1:]
        return cls(params[0], params[1], params[2], tuple(params[3:3 + j1]), tuple(deep[0::2]), tuple(deep[1::2]))


def load_maple(path: str, *, n_ctx: int, depth: int, text_width: int, vision_width: int,
               state: dict[str, torch.Tensor] | None = None) -> MaplePrompts:
    """MaPLe's prompts from a checkpoint (`read_checkpoint`, or its `state` already read), checked against the
    run's settings and model.

    Raises:
        ValueError: one line naming the file and the tensor that is missing or of the wrong shape.
    """
    sd = read_checkpoint(path) if state is None else state
    pre = "prompt_learner." if any(k.startswith("prompt_learner.") for k in sd) else ""

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = sd.get(pre + name)
        if t is None:
            raise ValueError(f"maple_weights {path}: no tensor {pre + name} (a MaPLe checkpoint of prompt depth "
                             f"{depth} holds prompt_learner.ctx, .proj.*, .compound_prompts_text.0..{depth - 2}, "
                             f".compound_prompt_projections.0..{depth - 2}.*)")
        if tuple(t.shape) != shape:
            raise ValueError(f"maple_weights {path}: {pre + name} has shape {tuple(t.shape)}, this model and "
                             f"n_ctx={n_ctx} need {shape}")
        return t.detach().float().clone()

    j1 = depth - 1
    extra = [k for k in sd if k.startswith(f"{pre}compound_prompts_text.{j1}")]
    if extra:
        raise ValueError(f"maple_weights {path}: holds {extra[0]}: its prompt depth exceeds prompt_depth={depth}")
    return MaplePrompts(
        get("ctx", (n_ctx, text_width)), get("proj.weight", (vision_width, text_width)),
        get("proj.bias", (vision_width,)),
        tuple(get(f"compound_prompts_text.{i}", (n_ctx, text_width)) for i in range(j1)),
        tuple(get(f"compound_prompt_projections.{i}.weight", (vision_width, text_width)) for i in range(j1)),
        tuple(get(f"compound_prompt_projections.{i}.bias", (vision_width,)) for i in range(j1)))


def load_stats(path: str, setting_name: str, shape: tuple[int, int, int]) -> torch.Tensor:
    """A (layers, tokens, width) float32 tensor of token statistics: a torch file holding one tensor (PromptAlign's
    `ImgNetpre_vis_*.pt`, read with weights_only=True) or a `.safetensors` file with one tensor. At least
    `shape[0]` layers; `tokens` and `width` exactly.

    Raises:
        ValueError: one line naming the setting, the file and the shape.
    """
    p = Path(path).expanduser()
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            got = list(load_file(str(p)).values())
            obj: Any = got[0] if len(got) == 1 else None
        else:
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{setting_name} {path}: not a readable tensor file ({first})") from None
    if not isinstance(obj, torch.Tensor) or obj.ndim != 3 or obj.shape[0] < shape[0] or \
            tuple(obj.shape[1:]) != shape[1:]:
        got = tuple(obj.shape) if isinstance(obj, torch.Tensor) else type(obj).__name__
        raise ValueError(f"{setting_name} {path}: expected one (layers >= {shape[0]}, {shape[1]}, {shape[2]}) "
                         f"tensor of token statistics (layer inputs x tokens x width), got {got}")
    return obj.detach().float()



# ---------------------------------------------------------------------------------------------- the MaPLe model

#: what PromptAlign does with each tower (its `towers` and `maple_towers`, the check on the loaded model, say it)
IMAGE_USE = "prompts the tokens of a ViT image encoder (MaPLe)"
TEXT_USE = "prompts CLIP's causal text tower pooled at the end-of-text token (MaPLe)"


def maple_towers(model: Any, backbone: str) -> tuple[Any, Any]:
    """(open_clip CLIP, its VisionTransformer), or a one-line error naming why PromptAlign cannot prompt them."""
    import open_clip
    from open_clip.transformer import VisionTransformer

    visual = getattr(model, "visual", None)
    if not isinstance(visual, VisionTransformer):
        kind = type(visual).__name__ if visual is not None else "no"
        raise ValueError(f"promptalign {IMAGE_USE}; {backbone} has a {kind} image encoder; use a ViT backbone such "
                         "as ViT-B-16")
    if visual.attn_pool is not None or getattr(visual, "pool_type", "tok") != "tok" or visual.final_ln_after_pool:
        raise ValueError(f"promptalign: {backbone}'s image encoder does not pool its class token as CLIP's does")
    if type(model) is not open_clip.CLIP or model.attn_mask is None or \
            getattr(model, "text_pool_type", "argmax") != "argmax":
        raise ValueError(f"promptalign {TEXT_USE}; {backbone}'s text tower ({type(model).__name__}) is another")
    return model, visual


def maple_text_features(model: Any, prefix: torch.Tensor, suffix: torch.Tensor, eot: torch.Tensor,
                        ctx: torch.Tensor, deep_text: Sequence[torch.Tensor]) -> torch.Tensor:
    """MaPLe's text tower (PromptAlign `TextEncoder.forward`, clip/model.py `ResidualAttentionBlock_MaPLe`): the
    prompts [start token, ctx, rest of "{ctx_init} {class}."] through the blocks, the context positions of block i
    (1 <= i <= J−1) replaced by `deep_text[i − 1]`, then ln_final at the end-of-text token and the projection.

    Args:
        model: the open_clip CLIP. prefix: (K, 1, Wt), suffix: (K, L − 1 − n_ctx, Wt) token embeddings;
        eot: (K,) end-of-text positions; ctx: (n_ctx, Wt); deep_text: J − 1 tensors (n_ctx, Wt).

    Returns:
        (K, D) L2-normalised class features.
    """
    k, n = prefix.shape[0], ctx.shape[0]
    x = torch.cat([prefix, ctx.expand(k, -1, -1).to(prefix.dtype), suffix], dim=1)
    x = x + model.positional_embedding.to(x.dtype)
    for i, blk in enumerate(model.transformer.resblocks):
        if 1 <= i <= len(deep_text):
            x = torch.cat([x[:, :1], deep_text[i - 1].expand(k, -1, -1).to(x.dtype), x[:, 1 + n:]], dim=1)
        x = blk(x, attn_mask=model.attn_mask)
    x = model.ln_final(x)
    x = x[torch.arange(k, device=x.device), eot] @ model.text_projection
    return F.normalize(x.float() if x.dtype == torch.float16 else x, dim=-1)


def maple_image_features(visual: Any, images: torch.Tensor, prompts: MaplePrompts,
                         record: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """MaPLe's image tower (clip/model.py `VisionTransformer_MaPLe`): patches, class token, positions, the projected
    context appended, ln_pre; the last n_ctx tokens of block i (1 <= i <= J−1) replaced by the projection of
    `deep_text[i − 1]`; the class token through ln_post and the projection.

    Args:
        visual: the open_clip VisionTransformer; images: (N, 3, S, S); prompts: the current prompts.
        record: blocks whose input tokens to return (PromptAlign's `visual_feat`, after the replacement).

    Returns:
        ((N, D) L2-normalised features, [(N, T, Wv) input tokens of each block in `record`]).
    """
    n = prompts.ctx.shape[0]
    x = visual.conv1(images)
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    cls = visual.class_embedding.to(x.dtype) + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype,
                                                           device=x.device)
    x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)
    shared = F.linear(prompts.ctx, prompts.proj_weight, prompts.proj_bias)  # (n_ctx, Wv)
    x = torch.cat([x, shared.expand(x.shape[0], -1, -1).to(x.dtype)], dim=1)
    x = visual.ln_pre(x)
    kept = []
    for i, blk in enumerate(visual.transformer.resblocks):
        if 1 <= i <= len(prompts.deep_text):
            deep = F.linear(prompts.deep_text[i - 1], prompts.deep_weight[i - 1], prompts.deep_bias[i - 1])
            x = torch.cat([x[:, :-n], deep.expand(x.shape[0], -1, -1).to(x.dtype)], dim=1)
        if i in record:
            kept.append(x)
        x = blk(x)
    pooled, _ = visual._pool(x)
    if visual.proj is not None:
        pooled = pooled @ visual.proj
    return F.normalize(pooled.float() if pooled.dtype == torch.float16 else pooled, dim=-1), kept


def distr_align_loss(tokens: Sequence[torch.Tensor], sel: torch.Tensor, means: Sequence[torch.Tensor],
                     variances: Sequence[torch.Tensor]) -> torch.Tensor:
    """PromptAlign's alignment term before its weight (`distr_align_loss`, `test_time_tuning`): per recorded layer,
    ½ mean|μ − μ̂| + ½ mean|σ² − σ̂²|, μ and σ² the mean and population variance over the selected views of each
    token's features.

    Args:
        tokens: per layer (V, T, W) input tokens of the views; sel: (n,) selected views;
        means, variances: per layer (T, W) the source statistics.
    """
    loss = torch.zeros((), device=sel.device)
    for x, mu_s, var_s in zip(tokens, means, variances):
        chosen = x[sel]  # (n, T, W)
        mu = chosen.mean(dim=0, keepdim=True)
        var = ((chosen - mu) ** 2).mean(dim=0)
        loss = loss + 0.5 * F.l1_loss(mu[0], mu_s) + 0.5 * F.l1_loss(var, var_s)
    return loss


# ---------------------------------------------------------------------------------------------- the method

class PromptAlign(ViewPixels, MixedPrecision, TTAMethod):
    """PromptAlign: per sample, MaPLe's prompts tuned on marginal entropy + token-statistics alignment, episodic."""

    key: ClassVar[str] = "promptalign"
    prefix_stable: ClassVar[bool] = True  # episodic; the views' pixels are read at the sample's own position
    Config: ClassVar[type[MethodConfig]] = PromptAlignConfig
    needs_text_encoder: ClassVar[bool] = True  # the runner passes the model (both towers are prompted)
    # the runner attaches a reader of the views' pixels (`ViewPixels`: `consumes = "view_pixels"`)
    pixels_use: ClassVar[str] = "prompts the image encoder"
    external_files: ClassVar[tuple[ExternalFile, ...]] = (
        ExternalFile("maple_weights", "MaPLe's prompts trained on ImageNet (a dassl checkpoint or safetensors)",
                     MAPLE_SOURCE),
        ExternalFile("vis_means", "ImageNet's per-layer token means", STATS_SOURCE),
        ExternalFile("vis_vars", "ImageNet's per-layer token variances", STATS_SOURCE),
    )
    _state_fields: ClassVar[tuple[str, ...]] = ("loss_scale", "skipped_steps")
    # Unseen data: the fine-grained settings (lr 5e-4; finegrain config)
    unseen_like: ClassVar[str] = "dtd"

    @classmethod
    def towers(cls, config: MethodConfig) -> Towers:
        # CLIP's ViT and text tower as MaPLe builds them (`maple_towers` checks the loaded model)
        return Towers(image=frozenset({"vit"}), image_use=IMAGE_USE, text=frozenset({"clip"}), text_use=TEXT_USE)

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        cfg: PromptAlignConfig = self.config  # type: ignore[assignment]
        if class_names is None or len(class_names) != self.n_classes:
            raise ValueError(f"promptalign builds one prompt per class and needs the {self.n_classes} class names")
        self.model, self.visual = maple_towers(getattr(text_encoder, "model", text_encoder), backbone)
        check_ranges(cfg, self.key, {"vision_blocks": len(self.visual.transformer.resblocks)})
        wt, wv = self.model.ln_final.weight.shape[0], self.visual.conv1.out_channels
        state = read_checkpoint(cfg.maple_weights)
        self.prompts0 = load_maple(cfg.maple_weights, n_ctx=cfg.n_ctx, depth=cfg.prompt_depth, text_width=wt,
                                   vision_width=wv, state=state)
        n_tokens = self.visual.positional_embedding.shape[0] + cfg.n_ctx
        layers = cfg.align_layer_to - 1  # the loss reads layers from .. to − 2
        self.means = load_stats(cfg.vis_means, "vis_means", (layers, n_tokens, wv))
        self.vars = load_stats(cfg.vis_vars, "vis_vars", (layers, n_tokens, wv))
        self._text_inputs(text_encoder, class_names)
        self._init_loss_scale()
        self._on: tuple[Any, ...] | None = None  # the prompts and statistics on the adapting device
        self._check_clip_weights(cfg.maple_weights, state)

    def _text_inputs(self, text_encoder: Any, class_names: Sequence[str]) -> None:
        """Token embeddings of "{ctx_init} {class}." around the context positions 1..n_ctx (MaPLe's
        `token_prefix` / `token_suffix`) and the end-of-text positions."""
        from extract.text_encoder import class_prompt

        cfg: PromptAlignConfig = self.config  # type: ignore[assignment]
        tokenizer = getattr(text_encoder, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("promptalign: text_encoder must carry its tokenizer (pass the LoadedModel)")
        words = int((tokenizer([cfg.ctx_init])[0] > 0).sum()) - 2  # the words' tokens, start and end aside
        if cfg.n_ctx > words:
            raise ValueError(f"promptalign: n_ctx={cfg.n_ctx} exceeds the {words} tokens of ctx_init "
                             f"{cfg.ctx_init!r} (the context replaces its first n_ctx tokens)")
        dev = self.model.token_embedding.weight.device
        tokens = tokenizer([class_prompt(cfg.ctx_init, n) for n in class_names]).to(dev)
        with torch.no_grad():
            emb = self.model.token_embedding(tokens)
        self.prefix, self.suffix = emb[:, :1], emb[:, 1 + cfg.n_ctx:]
        self.eot = tokens.argmax(dim=-1)

    def _check_clip_weights(self, path: str, state: dict[str, torch.Tensor]) -> None:
        """A warning when the MaPLe checkpoint's CLIP (stored beside its prompts) is not the run's model."""
        theirs = state.get("image_encoder.conv1.weight")
        ours = self.visual.conv1.weight.detach().cpu().float()
        if theirs is not None and (theirs.shape != ours.shape or not torch.allclose(theirs.float(), ours,
                                                                                     atol=1e-3)):
            self.warnings.append(f"promptalign: the CLIP weights stored in {path} (image_encoder.conv1) differ from "
                                 f"the run's {self.backbone}: MaPLe's prompts were trained on another CLIP")

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> PromptAlignConfig:
        check_hparams_key(hparams_key)
        # DG config (palign_dg.sh: ImageNet-A/-V2/-R/-Sketch; ImageNet itself taken with them) lr 4e-2; the
        # finegrain config (palign_finegrain.sh: the 10 cross-dataset sets) lr 5e-4
        return PromptAlignConfig(lr=4e-2 if hparams_key in IMAGENET_FAMILY else 5e-4)

    def _device_state(self, device: torch.device) -> tuple[Any, ...]:
        """(initial prompts, text inputs, statistics of the aligned layers) on `device`, copied there once."""
        if self._on is None or self._on[0].ctx.device != device:
            cfg: PromptAlignConfig = self.config  # type: ignore[assignment]
            layers = range(cfg.align_layer_from, cfg.align_layer_to - 1)
            p0 = MaplePrompts.from_params([t.to(device) for t in self.prompts0.params()])
            self._on = (p0, self.prefix.to(device), self.suffix.to(device), self.eot.to(device),
                        [self.means[i].to(device) for i in layers], [self.vars[i].to(device) for i in layers])
        return self._on

    def logits(self, images: torch.Tensor, prompts: MaplePrompts, record: Sequence[int] = ()
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(N, K) logits of `images` under `prompts`, and the recorded blocks' input tokens."""
        _, prefix, suffix, eot, _, _ = self._device_state(images.device)
        text = maple_text_features(self.model, prefix, suffix, eot, prompts.ctx, prompts.deep_text)
        img, kept = maple_image_features(self.visual, images, prompts, record)
        return self.logit_scale * img @ text.to(img.dtype).T, kept

    def loss(self, logits: torch.Tensor, tokens: Sequence[torch.Tensor], sel: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, the alignment views) of one step: the entropy views chosen at step 0 (`tpt_threshold`, then the
        alignment views at later steps, as the official `output[selected_idx]`) and the alignment term."""
        cfg: PromptAlignConfig = self.config  # type: ignore[assignment]
        _, _, _, _, means, variances = self._device_state(logits.device)
        if sel is None:
            order = torch.argsort(softmax_entropy(logits.detach()), stable=True)
            v = logits.shape[0]
            chosen, sel = order[:n_confident(v, cfg.tpt_threshold)], order[:n_confident(v, cfg.align_threshold)]
        else:
            chosen = sel
        loss = marginal_entropy(logits[chosen]) if cfg.tpt_loss else torch.zeros((), device=logits.device)
        if cfg.distr_align:
            w = cfg.distr_loss_w / (cfg.align_layer_to - cfg.align_layer_from)
            loss = loss + w * distr_align_loss(tokens, sel, means, variances)
        return loss, sel

    def _adapt_one(self, images: torch.Tensor) -> torch.Tensor:
        """One sample: (V, 3, S, S) views -> (K,) logits of view 0 after tuning (`test_time_tuning`, then the
        inference of `test_time_adapt_eval`)."""
        cfg: PromptAlignConfig = self.config  # type: ignore[assignment]
        dev = images.device
        amp = self._use_amp(dev)
        p0 = self._device_state(dev)[0]
        params = [t.clone().requires_grad_(True) for t in p0.params()]  # `model.reset()`: MaPLe's prompts
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                weight_decay=cfg.weight_decay)
        record = range(cfg.align_layer_from, cfg.align_layer_to - 1) if cfg.distr_align else ()
        sel = None
        for _ in range(cfg.tta_steps):
            with self._autocast(dev):
                logits, tokens = self.logits(images, MaplePrompts.from_params(params), record)
                loss, sel = self.loss(logits, tokens, sel)
            self._scaled_step(params, loss, opt, amp)
        with torch.no_grad(), self._autocast(dev):
            return self.logits(images[:1], MaplePrompts.from_params(params))[0][0].float()

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        b, v, _ = view_feats.shape
        dev, dtype = view_feats.device, self.visual.conv1.weight.dtype
        # one sample's 64 views at a time, as the official loop
        return torch.stack([self._adapt_one(self.views_of(self.n_seen + i, 1, v)[0].to(dev, dtype))
                            for i in range(b)])

    def summary(self) -> dict[str, Any]:
        """Steps skipped for a non-finite loss or gradient, and the loss scale now (also on the CPU, as TTL's)."""
        return {"skipped_steps": int(self.skipped_steps), "loss_scale": float(self.loss_scale["scale"])}
