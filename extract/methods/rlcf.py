"""RLCF (prompt variant): episodic prompt tuning with a CLIP reward model (`mzhaoshuai/RLCF @0996a5d`,
`TPT/tpt_cls_rl.py`; docs/methods.md, "RLCF: prompt tuning with a CLIP reward").

Per test sample (prompt and optimiser reset before every sample): the policy is TPT's prompt learner (a 4-token
context shared by all classes). Step 0 forwards the 64 views and keeps the int(64·0.1) = 6 of lowest softmax entropy
(reused at later steps). At every step, for each kept view v, the top-k (3) classes c of its current logits z_v
get the reward

    r(v, c) = max(w · cos(f_R(v), t_R(c)), 0)          w = 2.5 (CLIPScore), f_R / t_R the reward model's features

minus the mean of the k rewards of that view (the baseline; no std scaling), and the loss is

    L = mean over the 6·k (view, class) pairs of r̃(v, c) · CE(z_v, c)

one AdamW step (lr 7e-3, weight decay 5e-4) per step, 3 steps (ImageNet family) or 5 (fine-grained sets). The
prediction is the tuned prompt's logits on the original view. The reward model is a second, frozen CLIP (officially
OpenAI ViT-L/14), fed the policy's views; its text features are those of the policy's prompt strings
"{ctx_init} {class}.". The rewards carry no gradient.

Inputs: the runner gives the method the policy's cached view features (B, V, D) through `adapt`, and attaches the
reward model's text features and a reader of its cached features of the same views (`attach_reward`;
extract/run/reward.py), read at the stream positions the method is at (`n_seen`). `reward_backbone="policy"` uses
the policy itself as the reward model (TTA-VLM's setting): its own view features and prompt features, no second
model. Inside the tuner the reward features travel as extra columns of the view features (`_pack`), so that the
shared machinery (batched passes, the loss-scale replay in stream order, resume) applies unchanged.

Precision: that of TPT (`tpt.py`): on CUDA with `amp`, autocast fp16 with fp32 context and one dynamic loss scale
GradScaler(1000) for the run, updated after every step; fp32 on the CPU. The cross-entropy is taken in fp32 (as
autocast's fp32 policy runs `cross_entropy`) and the rewards from fp32 features (the official `.float()`).

Where this differs from the official loop: the reward model encodes all 64 views (the feature cache is per view
policy; the official code encodes only the 6 kept ones); selection ties are broken by view index; the initial
context is "a photo of a" unless `ctx_file` gives one (the shipped scripts pass CoOp 16-shot weights with `--load`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from extract.methods.base import (IMAGENET_FAMILY, ExternalFile, MethodConfig, check_hparams_key, setting,
                                  text_setting)
from extract.methods.tpt import TPT, TPTConfig

#: `reward_backbone` value that makes the policy its own reward model (TTA-VLM `instance_method/rlcf.py`)
REWARD_POLICY = "policy"


@dataclass(frozen=True)
class RLCFConfig(TPTConfig):
    """RLCF's settings (scripts/rlcf-prompt.sh, rlcf-prompt-fine.sh; `params.py` defaults where the scripts are
    silent)."""

    lr: float = 7e-3  # lr=7e-3 in both scripts (the fine script's 5e-3 is overridden in its `case 01`)
    weight_decay: float = 5e-4  # weight_decay=5e-4
    tta_steps: int = 3  # 3 (ImageNet family, rlcf-prompt.sh) / 5 (fine-grained, rlcf-prompt-fine.sh): default_config
    sample_k: int = setting(3, ge=1)  # sample_k=3: classes rewarded per view (top-k of the current logits)
    clipscore_weight: float = setting(2.5, ge=0)  # CLIPRewards(clipscore_weight=2.5) (clip_reward.py)
    # the reward model (reward_arch=ViT-L/14, OpenAI weights); "policy" = the policy's own model (TTA-VLM)
    reward_backbone: str = text_setting("ViT-L-14")
    reward_pretrained: str = text_setting("openai", nonempty=True)
    # initial (and reset) context: "" = the token embeddings of `ctx_init`; else a file with a (n_ctx, width)
    # tensor: safetensors, or a torch file (CoOp's checkpoint: ["state_dict"]["ctx"]) read with weights_only=True
    ctx_file: str = text_setting("")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.reward_backbone.strip() and not self.reward_pretrained.startswith("local-dir:"):
            raise ValueError("RLCFConfig.reward_backbone is empty; give an open_clip model name, or 'policy'")


def load_context(path: str, n_ctx: int, width: int) -> torch.Tensor:
    """The (n_ctx, width) float32 context stored in `path`.

    A `.safetensors` file holds a tensor named "ctx" (or only one tensor); any other file is read with
    `torch.load(weights_only=True)` and holds a tensor, {"ctx": tensor}, or CoOp's checkpoint {"state_dict":
    {"ctx": tensor, ...}, ...} (what RLCF's `--load` reads: tpt_cls_rl.py `torch.load(args.load)['state_dict']['ctx']`).

    Raises:
        ValueError: missing or unreadable file, no context in it, or a shape other than (n_ctx, width).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"ctx_file {path}: no such file")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(p))
        else:
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (any reader error is a bad file; named in one line)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"ctx_file {path}: not a readable safetensors or weights-only torch file ({first})") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if isinstance(obj, dict):
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        obj = tensors.get("ctx", next(iter(tensors.values())) if len(tensors) == 1 else None)
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"ctx_file {path}: expected a tensor named 'ctx' (or CoOp's ['state_dict']['ctx'])")
    if tuple(obj.shape) != (n_ctx, width):
        raise ValueError(f"ctx_file {path}: context of shape {tuple(obj.shape)}, this model's prompt needs "
                         f"({n_ctx}, {width})")
    return obj.detach().float().clone()


def rlcf_loss(logits: torch.Tensor, reward_img: torch.Tensor, reward_text: torch.Tensor, *, sample_k: int,
              weight: float) -> torch.Tensor:
    """RLCF's per-sample loss (tpt_cls_rl.py `test_time_tuning`, clip_reward.py `CLIPScore`,
    `rewards_post_process` with reward_process=1, process_batch=0, reward_amplify=0).

    Args:
        logits: (G, n, K) logits of the kept views (any float dtype; the cross-entropy runs in >= fp32).
        reward_img: (G, n, D_R) the reward model's L2-normalised features of those views.
        reward_text: (K, D_R) the reward model's L2-normalised prompt features.
        sample_k: classes rewarded per view (top-k of the detached logits).
        weight: the CLIPScore weight (2.5).

    Returns:
        (G,) mean over the n·k pairs of (r − mean_k r) · CE(z_v, c); the rewards carry no gradient.
    """
    top = logits.detach().topk(sample_k, dim=-1).indices  # (G, n, k)
    with torch.no_grad():
        score = weight * (reward_text[top] * reward_img[:, :, None]).sum(-1)  # (G, n, k)
        reward = score.clamp_min(0)
        if sample_k > 1:  # `rewards_post_process` subtracts the baseline only when there are several rewards
            reward = reward - reward.mean(-1, keepdim=True)
    acc = torch.promote_types(logits.dtype, torch.float32)
    ce = -torch.log_softmax(logits.to(acc), dim=-1).gather(-1, top)  # (G, n, k)
    return (reward.to(acc) * ce).mean(dim=(1, 2))


class RLCF(TPT):
    """RLCF with a tuned prompt: TPT's tuner with the CLIP-reward loss, several steps per sample, episodic."""

    key: ClassVar[str] = "rlcf"
    prefix_stable: ClassVar[bool] = True  # episodic; the reward features are read at the sample's own position
    Config: ClassVar[type[MethodConfig]] = RLCFConfig
    #: the runner loads the reward model and calls `attach_reward` before the first image (`attach_second_encoder`,
    #: extract/run/reward.py)
    needs_reward_model: ClassVar[bool] = True
    # the reward model's weights: an open_clip tag (OpenAI's ViT-L-14 by default), a checkpoint file or a
    # `local-dir:` folder, checked before the policy loads (extract/run/externals.py)
    external_files: ClassVar[tuple[ExternalFile, ...]] = (
        ExternalFile("reward_pretrained", "reward model", "or --set reward_backbone=policy (the policy as its own "
                     "reward model)", kind="open_clip", backbone_setting="reward_backbone"),)
    # Unseen data: the fine-grained settings (5 steps, AugMix views)
    unseen_like: ClassVar[str] = "dtd"

    def __init__(self, config: MethodConfig, text_features: torch.Tensor, logit_scale: float, *, backbone: str,
                 dataset: str, text_encoder: Any = None, class_names: Sequence[str] | None = None) -> None:
        super().__init__(config, text_features, logit_scale, backbone=backbone, dataset=dataset,
                         text_encoder=text_encoder, class_names=class_names)
        cfg: RLCFConfig = self.config  # type: ignore[assignment]
        if cfg.sample_k > self.n_classes:
            raise ValueError(f"rlcf: sample_k = {cfg.sample_k} exceeds the {self.n_classes} classes")
        self._ctx0 = self.prompts.ctx_init
        if cfg.ctx_file:
            self._ctx0 = load_context(cfg.ctx_file, self.prompts.n_ctx, self.prompts.width).to(self.prompts.device)
            digest = hashlib.sha256(Path(cfg.ctx_file).expanduser().read_bytes()).hexdigest()[:16]
            self.warnings.append(f"rlcf: initial context from {cfg.ctx_file} (sha256 {digest}) instead of "
                                 f"the words {cfg.ctx_init!r}")
        self._reward_text: torch.Tensor | None = None  # (K, D_R)
        self._reward_reader: Callable[[int, int], Any] | None = None
        self._reward_cur: torch.Tensor | None = None  # the reward text of the current `adapt` call

    @classmethod
    def default_config(cls, hparams_key: str, backbone: str) -> RLCFConfig:
        check_hparams_key(hparams_key)
        fine = hparams_key not in IMAGENET_FAMILY
        # AugMix on the fine-grained sets: `augmix=len(set_id)>1 and args.augmix` (`--augmix` defaults to 1)
        return RLCFConfig(augmix=fine, tta_steps=5 if fine else 3)

    @classmethod
    def needed_files(cls, config: MethodConfig) -> tuple[ExternalFile, ...]:
        """No second model with `reward_backbone=policy` (the policy is its own reward model)."""
        return () if config.reward_backbone == REWARD_POLICY else cls.external_files  # type: ignore[attr-defined]

    def attach_reward(self, text: torch.Tensor, reader: Callable[[int, int], Any]) -> None:
        """Give the method its reward model's inputs.

        Args:
            text: (K, D_R) the reward model's L2-normalised features of the prompts "{ctx_init} {class}.".
            reader: `reader(start, stop)` -> (stop − start, V, D_R) the reward model's L2-normalised features of the
                views of stream positions [start, stop) (array or tensor).
        """
        if text.ndim != 2 or text.shape[0] != self.n_classes:
            raise ValueError(f"rlcf: reward text features must be ({self.n_classes}, D), got {tuple(text.shape)}")
        self._reward_text, self._reward_reader = text.detach().float(), reader

    def _policy_is_reward(self) -> bool:
        return self.config.reward_backbone == REWARD_POLICY  # type: ignore[attr-defined]

    def _own_prompt_features(self, device: torch.device) -> torch.Tensor:
        """The policy's features of its prompt strings (the reward text when the policy is its own reward model)."""
        if self._reward_text is None or self._reward_text.device != device:
            with torch.no_grad(), self._autocast(device):
                self._reward_text = self.prompts(self.prompts.ctx_init.to(device)).float()
        return self._reward_text

    def _adapt(self, view_feats: torch.Tensor) -> torch.Tensor:
        b, v, _ = view_feats.shape
        dev = view_feats.device
        if self._policy_is_reward():
            img, text = view_feats, self._own_prompt_features(dev)
        else:
            if self._reward_reader is None or self._reward_text is None:
                name = self.config.reward_backbone  # type: ignore[attr-defined]
                raise ValueError(f"rlcf: no reward model attached (reward_backbone={name!r}); the runner attaches "
                                 "it (`attach_reward`), or set reward_backbone=policy")
            got = self._reward_reader(self.n_seen, self.n_seen + b)
            img = torch.as_tensor(got).to(dev)
            if img.ndim != 3 or img.shape[:2] != (b, v) or img.shape[2] != self._reward_text.shape[1]:
                raise ValueError(f"rlcf: reward features of shape {tuple(img.shape)} for {b} samples of {v} views "
                                 f"(width {self._reward_text.shape[1]})")
            text = self._reward_text.to(dev)
        self._reward_cur = text
        dtype = self.compute_dtype(view_feats)
        return super()._adapt(torch.cat([view_feats.to(dtype), img.to(dtype)], dim=-1))  # `_pack`: see module doc

    def _logits(self, feats: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return super()._logits(feats[..., :self.dim], text)  # the policy's columns of the packed features

    def _init_param(self, n: int, device: torch.device) -> torch.Tensor:
        return self._ctx0.to(device).expand(n, -1, -1).clone()

    def _loss(self, feats: torch.Tensor, logits: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        cfg: RLCFConfig = self.config  # type: ignore[assignment]
        assert self._reward_cur is not None
        chosen = torch.gather(logits, 1, sel[..., None].expand(-1, -1, logits.shape[-1]))  # (G, n, K)
        reward = feats[..., self.dim:]  # (G, V, D_R)
        img = torch.gather(reward, 1, sel[..., None].expand(-1, -1, reward.shape[-1]))  # fp32 (fp64 in tests)
        return rlcf_loss(chosen, img, self._reward_cur.to(img.dtype), sample_k=cfg.sample_k,
                         weight=cfg.clipscore_weight)
