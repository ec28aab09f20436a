"""What the per-batch encoder methods (WATT, CLIPArTT) share: their own copy of CLIP at the precision the official
`clip.load` gives it, the normalisation layers they tune on each backbone, the reset to the frozen values,
CLIPArTT's text-graph loss, which WATT reuses, and the batch loop (`TunedBatchMethod`: build, adapt, predict, reset)
(docs/methods.md, "Methods that adapt the image encoder per batch (WATT, CLIPArTT)").

The copy: `clip.load(name, device)` builds OpenAI CLIP with `convert_weights` (WATT and CLIPArTT `clip/model.py`):
the weights of convolutions, linear layers, attention projections and the `proj` / `text_projection` matrices in
fp16, everything else (LayerNorm and BatchNorm affine parameters, embeddings, `logit_scale`) in fp32, each
LayerNorm computing in fp32 and casting back (`LayerNorm.forward`); on the CPU it calls `model.float()`. So on CUDA
the official forward and backward run with fp16 weights and fp16 activations, without autocast and without a loss
scale; on the CPU in fp32. `official_copy` builds the same from an open_clip model (`fp16=True`: open_clip's
`convert_weights_to_lp`, whose rules are OpenAI's, and every LayerNorm computing in fp32 as
`open_clip.transformer.LayerNormFp32` does).

Which parameters train (CLIPArTT `models/tent.py` `configure_model`, `collect_params`; WATT `adapt/watt.py`
`set_ln_grads`, `collect_ln_params`): on a ViT the weight and bias of every `nn.LayerNorm` of the image encoder, the
model in eval mode; on a ResNet (a name containing "RN") the weight and bias of every `nn.BatchNorm2d` of the image
encoder, its running statistics removed, so every forward (the adapting ones and the final prediction) normalises
with the statistics of the batch at hand.
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F

from extract.methods.base import MethodConfig
from extract.methods.batch import PixelBatchMethod, batch_statistics_hint
from extract.methods.normtta import configure_norms, open_clip_model

NormKind = Literal["layernorm", "batchnorm"]
# CLIPArTT `models/tent.py` forward_and_adapt, `--target-method`: how the soft targets of the batch graph are formed
TargetMethod = Literal[1, 2, 3, 4]
# The weights' precision: "official" as `clip.load` (fp16 on CUDA, fp32 on the CPU), or fp16 / fp32 everywhere
WeightsDtype = Literal["official", "fp16", "fp32"]


def fp16_weights(weights_dtype: WeightsDtype, device: torch.device) -> bool:
    """Whether the copy gets fp16 weights on `device`.

    >>> fp16_weights("official", torch.device("cpu")), fp16_weights("fp16", torch.device("cpu"))
    (False, True)
    """
    return weights_dtype == "fp16" or (weights_dtype == "official" and device.type == "cuda")


def official_copy(model: torch.nn.Module, *, fp16: bool) -> torch.nn.Module:
    """A frozen copy of an open_clip model in eval mode, with OpenAI `clip.load`'s fp16 weights when `fp16`.

    Args:
        model: an open_clip `CLIP` / `CustomTextCLIP` (left untouched: the run's frozen encoder).
        fp16: convert as `clip.load` does on CUDA (`convert_weights`; LayerNorms in fp32); False: as on the CPU.

    Returns:
        The copy, every parameter with `requires_grad=False`.
    """
    from open_clip.model import convert_weights_to_lp
    from open_clip.transformer import LayerNormFp32

    twin = copy.deepcopy(model).eval().requires_grad_(False)
    if fp16:
        convert_weights_to_lp(twin, torch.float16)
        for m in twin.modules():
            if isinstance(m, torch.nn.LayerNorm) and type(m) is not LayerNormFp32:
                # OpenAI's LayerNorm: x.float() -> layer_norm -> back to x's dtype (state unchanged)
                m.__class__ = LayerNormFp32
    return twin


def norm_kind(visual: torch.nn.Module) -> NormKind:
    """Which layers an image encoder's adaptation tunes: BatchNorm for a ResNet (an encoder with BatchNorm2d
    layers), LayerNorm otherwise. The official code decides by the model's name (`'RN' in name_model`), which is
    the same choice for OpenAI's models (RN50, RN101, RN50x4, ... are the ResNets); the architecture decides here,
    so that a local model of any name is treated by what it is.
    """
    return "batchnorm" if any(isinstance(m, torch.nn.BatchNorm2d) for m in visual.modules()) else "layernorm"


@dataclass
class TunedCLIP:
    """A copy of CLIP whose image encoder's normalisation affine parameters are tuned, and their frozen values.

    Attributes:
        model: the copy (`official_copy`), configured for its `kind`.
        params: the tuned parameters, weight then bias of each layer in module order.
        initial: their frozen values (`reset` restores them).
        logit_scale: the copy's `logit_scale.exp()` (a 0-dim fp32 tensor, as the official forward uses it).
    """

    model: torch.nn.Module
    kind: NormKind
    params: list[torch.nn.Parameter]
    initial: list[torch.Tensor]
    logit_scale: torch.Tensor

    @classmethod
    def build(cls, model: torch.nn.Module, kind: NormKind, *, fp16: bool,
              device: torch.device | None = None) -> "TunedCLIP":
        """`official_copy` of `model` on `device`, its image encoder configured as the CLIP ports do
        (`extract.methods.normtta.configure_norms`: every BatchNorm2d on batch statistics, the normalisation
        layers' weight and bias the only trainable parameters), which is CLIPArTT's `configure_model` / WATT's
        `set_ln_grads`. CLIPArTT also puts a ResNet's encoder in train mode; in open_clip's ModifiedResNet that
        changes nothing else (its attention pool's dropout is 0), so the copy stays in eval mode.

        Raises:
            ValueError: the image encoder has no layer of `kind` (WATT on a ResNet: the official Adam gets an
                empty parameter list).
        """
        twin = official_copy(model, fp16=fp16)
        if device is not None:
            twin = twin.to(device)
        if norm_kind(twin.visual) != kind:
            raise ValueError(f"the image encoder has no {kind} layer to adapt")
        params = [p for _, p in configure_norms(twin.visual, lambda name: True)]
        with torch.no_grad():
            scale = twin.logit_scale.exp()
        return cls(twin, kind, params, [p.detach().clone() for p in params], scale)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (fp16 on the official CUDA path), the dtype images are cast to."""
        return self.model.visual.conv1.weight.dtype

    def load(self, values: Sequence[torch.Tensor]) -> None:
        """Copy `values` into the tuned parameters (`load_state_dict(..., strict=False)`)."""
        with torch.no_grad():
            for p, v in zip(self.params, values):
                p.copy_(v)

    def reset(self) -> None:
        """Back to the frozen values (`load_model_and_optimizer` with the saved model state)."""
        self.load(self.initial)

    def snapshot(self) -> list[torch.Tensor]:
        """The tuned parameters' current values (WATT's per-template `copy.deepcopy(p)`)."""
        return [p.detach().clone() for p in self.params]

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> (B, D) `encode_image(x)` (images cast to the weights' dtype as `encode_image` does),
        L2-normalised as the official `f / f.norm(dim=-1, keepdim=True)`; under the caller's grad mode."""
        f = self.model.visual(images.to(self.dtype))
        return f / f.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, L) tokens -> (N, D) `encode_text`, L2-normalised (the text encoder is never tuned)."""
        t = self.model.encode_text(tokens)
        return t / t.norm(dim=-1, keepdim=True)


def adam(params: Sequence[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
         eps: float = 1e-8, weight_decay: float = 0.0) -> torch.optim.Adam:
    """The official optimiser, fresh (`optim.Adam(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)`: its saved
    initial state is an empty one, so a fresh Adam is what `load_model_and_optimizer` restores)."""
    return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def text_graph_loss(logits: torch.Tensor, image: torch.Tensor, text: torch.Tensor, *, temperature: float = 0.01,
                    target_method: TargetMethod = 1) -> torch.Tensor:
    """CLIPArTT's loss over a batch (`models/tent.py` forward_and_adapt and `cross_entropy`; WATT
    `adapt/watt.py` perform_adaptation with target method 1).

    With S_I = F̂F̂ᵀ and S_T = T̂T̂ᵀ (B × B), the targets Q = softmax_rows(((S_I + S_T)/2)/τ) (method 1; 2: S_I/2,
    3: S_T/2, 4: the identity), not detached; with Z = logits (text rows, image columns),
    L = mean_i Σ_j −Qᵀ_ij · log_softmax(Zᵀ_i)_j, each image's row of logits against column i of Q.

    Args:
        logits: (B, B) s·T̂F̂ᵀ, row b the text of sample b; image: (B, D) F̂; text: (B, D) T̂.
        temperature: τ (0.01).

    Returns:
        0-dim loss in the inputs' dtype (fp32 for method 4, whose identity target is fp32).
    """
    if target_method == 4:
        targets = torch.eye(logits.shape[0], device=logits.device)  # `torch.eye(...).to(device)`: fp32
    else:
        image_sim, text_sim = image @ image.t(), text @ text.t()
        sim = {1: image_sim + text_sim, 2: image_sim, 3: text_sim}[target_method]
        targets = F.softmax((sim / 2) / temperature, dim=-1)
    return (-targets.t() * F.log_softmax(logits.t(), dim=-1)).sum(1).mean()


def step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """`loss.backward(); optimizer.step(); optimizer.zero_grad()` (the official order)."""
    loss.backward()
    opt.step()
    opt.zero_grad()


def tokenize(tokenizer: Any, texts: Sequence[str], device: torch.device) -> torch.Tensor:
    """The model's tokenizer on `texts`, on `device`."""
    return tokenizer(list(texts)).to(device)


class TunedBatchMethod(PixelBatchMethod):
    """A method that tunes its own `TunedCLIP` on each batch of pixels from the frozen values, reset before each
    batch (WATT, CLIPArTT). Subclasses set `Config` (with `weights_dtype`), encode the texts they read once per copy
    (`prepare`) and adapt on and predict one batch (`tune_and_predict`)."""

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder)
        self.kind: NormKind = norm_kind(open_clip_model(text_encoder, self.key).visual)
        self.class_names = tuple(class_names) if class_names is not None else tuple(map(str, range(self.n_classes)))
        self._clip: TunedCLIP | None = None

    def build(self, device: torch.device) -> TunedCLIP:
        """The tuned copy on `device` and the texts the method reads (`prepare`; once per run: they never change)."""
        if self._clip is None or self._clip.logit_scale.device != device:
            model = open_clip_model(self.text_encoder, self.key)
            fp16 = fp16_weights(self.config.weights_dtype, device)  # type: ignore[attr-defined]
            clip = TunedCLIP.build(model, self.kind, fp16=fp16, device=device)
            self.prepare(clip)
            self._clip = clip
        return self._clip

    @abc.abstractmethod
    def prepare(self, clip: TunedCLIP) -> None:
        """Encode with the copy `clip` (its text encoder never tuned) the text features the method reads."""

    @abc.abstractmethod
    def tune_and_predict(self, clip: TunedCLIP, images: torch.Tensor) -> torch.Tensor:
        """From the frozen values: adapt `clip` on the batch `images` (B, 3, S, S), return its (B, K) logits."""

    def adapt_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) one batch's preprocessed images -> (B, K) float32 logits: reset, adapt, predict, reset."""
        with batch_statistics_hint(self.key, len(images)):
            clip = self.build(images.device)
            out = self.tune_and_predict(clip, images).float()
            clip.reset()
        return out

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        """One batch: its pixels (positions [n_seen, n_seen + B)) adapted on; the cached features are unused."""
        return self.adapt_images(self.batch_images(view_feats.shape[0], view_feats.device, torch.float32))
