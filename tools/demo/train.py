"""Contrastive training of the demo's two small open_clip models on Fashion-MNIST.

These are small CLIP-architecture models trained by this project on the 60,000 Fashion-MNIST training images against
their class prompts; they are *not* OpenAI CLIP. They stand in for the paper's backbones so that the whole pipeline
runs on a laptop: ``fmnist-ViT`` (a ViT image tower, standing in for ``ViT-B-16``) and ``fmnist-RN`` (open_clip's
ModifiedResNet image tower, chosen by ``layers`` being a tuple, standing in for ``RN50``). Both share CLIP's text
transformer and BPE tokenizer, with a short context.

Each model is saved in open_clip's ``local-dir:`` format, ``<models_dir>/<name>/open_clip_config.json`` +
``open_clip_model.safetensors`` (plus ``training.json``, a record of how it was trained), so that
``open_clip.create_model_and_transforms("local-dir:<dir>")`` and ``zaec-extract --pretrained local-dir:<dir>`` load it
exactly as they would load real weights.

The loss is CLIP's symmetric contrastive loss adapted to class prompts: image->text is a softmax over the K class
prompts of one template, text->image is a softmax over the batch's images with every
image of the prompt's class as a positive (the targets spread evenly over them), the two averaged; each step averages
this loss over several templates (the anchor "a photo of a {}." always among them).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from tools.demo.fmnist import load_split
from tools.demo.images import IMAGE_SIZE, to_rgb_uint8, upsample
from schemas.atomic import atomic_dir

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
RECORD_FILE = "training.json"

# The prompt every zero-shot anchor uses ("a photo of a {}.") comes first and is in every step (see
# `TrainConfig.prompts_per_step`); the rest are open_clip's 80 OpenAI ImageNet templates, which cover the
# per-dataset and ensemble templates the TTA methods average over (TDA's 7-template set is a subset of them).
ANCHOR_TEMPLATE = "a photo of a {}."


def _templates() -> tuple[str, ...]:
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    rest = tuple(t("{}") for t in OPENAI_IMAGENET_TEMPLATES)
    return (ANCHOR_TEMPLATE,) + tuple(t for t in rest if t != ANCHOR_TEMPLATE)


@dataclass(frozen=True)
class TrainConfig:
    """Training budget and optimiser of one demo model.

    Defaults follow the design pilot (docs/demo.md, "Design sizes"): AdamW, lr 1e-3, weight decay 0.05,
    batch 256, logit scale learned from CLIP's initial 1/0.07 and clamped at CLIP's maximum of 100.
    """

    n_images: int = 60_000  # training images used (a seeded subset when below 60,000)
    epochs: int = 1
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_fraction: float = 0.05  # linear warm-up, then cosine decay to zero
    max_logit_scale: float = 100.0  # CLIP clamps exp(logit_scale) at 100
    prompts_per_step: int = 8  # templates per step: ANCHOR_TEMPLATE and 7 drawn at random (each trained alone)
    max_shift: int = 2  # augmentation: random translation by up to this many pixels (zero padding) ...
    flip: bool = True  # ... and random horizontal flips (Fashion-MNIST classes are left-right symmetric)
    seed: int = 0
    threads: int = 0  # torch CPU threads; 0 keeps torch's default


@dataclass(frozen=True)
class DemoModel:
    """One demo backbone: its directory name, the backbone it stands in for, its open_clip config and its budget."""

    name: str
    stands_in_for: str
    model_cfg: dict[str, Any]
    train: TrainConfig = field(default_factory=TrainConfig)

    def directory(self, models_dir: str | Path) -> Path:
        return Path(models_dir) / self.name


def _text_cfg() -> dict[str, Any]:
    # CLIP's text transformer and 49,408-token BPE vocabulary, made small; a 32-token context is ample for
    # "a photo of a {class}." and leaves room for TPT-style learnable context tokens.
    return {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}


def default_models(*, budget: float = 1.0, seed: int = 0) -> tuple[DemoModel, ...]:
    """The demo's two backbones, with a training budget scaled by ``budget`` (1.0 = the full demo).

    ``budget`` scales the number of training images (minimum one batch), so tests can train the same architecture for
    seconds. Both use CLIP's QuickGELU, image size 32 and embedding width 64. Measured on 2 CPU cores at budget 1.0:
    fmnist-ViT (60,000 images x 2 epochs) about 2 minutes, clean accuracy about 0.72; fmnist-RN (60,000 x 1) under a
    minute, about 0.8 (one prompt, first 2,000 test images).
    """

    def scaled(n: int, epochs: int) -> TrainConfig:
        return TrainConfig(n_images=max(256, int(round(n * budget))), epochs=epochs, seed=seed)

    vit = DemoModel(
        name="fmnist-ViT",
        stands_in_for="ViT-B-16",
        model_cfg={
            "embed_dim": 64,
            "quick_gelu": True,
            "vision_cfg": {"image_size": IMAGE_SIZE, "patch_size": 4, "layers": 2, "width": 64, "head_width": 32},
            "text_cfg": _text_cfg(),
        },
        train=scaled(60_000, 2),
    )
    rn = DemoModel(
        name="fmnist-RN",
        stands_in_for="RN50",
        model_cfg={
            "embed_dim": 64,
            "quick_gelu": True,
            # layers as a 4-tuple makes open_clip build a ModifiedResNet (attention-pool head, as in RN50)
            "vision_cfg": {"image_size": IMAGE_SIZE, "layers": [1, 1, 1, 1], "width": 16, "head_width": 16},
            "text_cfg": _text_cfg(),
        },
        train=scaled(60_000, 1),  # BatchNorm makes the ResNet learn in fewer steps
    )
    return vit, rn


def _preprocess_cfg() -> dict[str, Any]:
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    # CLIP's own normalisation (as in the pilot); the images are already IMAGE_SIZE square, so resizing is a no-op.
    return {
        "size": IMAGE_SIZE,
        "mode": "RGB",
        "mean": list(OPENAI_DATASET_MEAN),
        "std": list(OPENAI_DATASET_STD),
        "interpolation": "bilinear",
        "resize_mode": "shortest",
    }


def is_trained(spec: DemoModel, models_dir: str | Path) -> bool:
    d = spec.directory(models_dir)
    return (d / CONFIG_FILE).is_file() and (d / WEIGHTS_FILE).is_file()


def _augment(x: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """Random translation (zero padding) and horizontal flip. x: (B, H, W) float in [0, 1]."""
    b, h, w = x.shape
    if cfg.max_shift > 0:
        s = cfg.max_shift
        padded = F.pad(x, (s, s, s, s))
        dy = torch.randint(0, 2 * s + 1, (b,), generator=gen)
        dx = torch.randint(0, 2 * s + 1, (b,), generator=gen)
        rows = (dy[:, None] + torch.arange(h)[None, :])[:, :, None]  # (B, H, 1)
        cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, :]  # (B, 1, W)
        x = padded[torch.arange(b)[:, None, None], rows, cols]
    if cfg.flip:
        flip = torch.rand(b, generator=gen) < 0.5
        x = torch.where(flip[:, None, None], x.flip(-1), x)
    return x


def _normalise(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(B, H, W) grey in [0, 1] -> (B, 3, H, W) normalised, as open_clip's preprocess does to an RGB image."""
    return (x[:, None].expand(-1, 3, -1, -1) - mean[None, :, None, None]) / std[None, :, None, None]


def _contrastive_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits: (B, K) scaled cosine similarities; labels: (B,). Symmetric class-prompt contrastive loss."""
    loss_i = F.cross_entropy(logits, labels)
    pos = F.one_hot(labels, logits.shape[1]).T.float()  # (K, B): images of each class
    present = pos.sum(1) > 0
    logp_t = F.log_softmax(logits.T[present], dim=1)  # (K', B): each prompt's softmax over the batch's images
    target = pos[present] / pos[present].sum(1, keepdim=True)
    loss_t = -(target * logp_t).sum(1).mean()
    return 0.5 * (loss_i + loss_t)


def _prompt_tokens(tokenizer, class_names: tuple[str, ...]) -> torch.Tensor:
    """(T, K, L) token ids for every template x class."""
    return torch.stack([tokenizer([t.format(c) for c in class_names]) for t in _templates()])


@torch.no_grad()
def zero_shot_accuracy(model, tokenizer, images: np.ndarray, labels: np.ndarray, *, batch_size: int = 500) -> float:
    """Top-1 accuracy with the single anchor prompt on (N, H, W) uint8 images already at IMAGE_SIZE."""
    from extract.datasets import FASHION_MNIST_CLASSES

    model.eval()
    pre = _preprocess_cfg()
    mean, std = torch.tensor(pre["mean"]), torch.tensor(pre["std"])
    text = F.normalize(model.encode_text(tokenizer([ANCHOR_TEMPLATE.format(c) for c in FASHION_MNIST_CLASSES])), dim=-1)
    correct = 0
    for i in range(0, len(images), batch_size):
        x = _normalise(torch.from_numpy(images[i : i + batch_size]).float() / 255.0, mean, std)
        feats = F.normalize(model.encode_image(x), dim=-1)
        correct += int(((feats @ text.T).argmax(1).numpy() == labels[i : i + batch_size]).sum())
    return correct / max(1, len(images))


def train_model(
    spec: DemoModel,
    fmnist_dir: str | Path,
    models_dir: str | Path,
    *,
    console=None,
    force: bool = False,
) -> Path:
    """Train one demo model and save it in open_clip's ``local-dir:`` format; skipped when already saved.

    The directory appears atomically (written under a temporary name, then renamed), so an interrupted run leaves
    nothing half-written and simply trains again. Seeded: the same spec gives the same weights on the same machine.

    Returns:
        The model directory, to be passed as ``--pretrained local-dir:<dir>``.
    """
    import open_clip

    out = spec.directory(models_dir)
    if is_trained(spec, models_dir) and not force:
        return out
    cfg = spec.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    train_x, train_y = _training_images(cfg, fmnist_dir)
    model = open_clip.CLIP(**spec.model_cfg)  # after manual_seed: its initial weights are seeded
    model.train()
    tokenizer = open_clip.SimpleTokenizer(context_length=spec.model_cfg["text_cfg"]["context_length"])
    started = time.perf_counter()
    _train_loop(spec, model, tokenizer, train_x, train_y, gen, console)
    train_seconds = time.perf_counter() - started

    model.eval()
    test_x, test_y = load_split(fmnist_dir, "test")
    n_eval = min(2000, len(test_x))
    acc = zero_shot_accuracy(model, tokenizer, to_rgb_uint8(upsample(test_x[:n_eval]))[..., 0], test_y[:n_eval])
    record = {
        "name": spec.name,
        "stands_in_for": spec.stands_in_for,
        "note": "a small CLIP-architecture model trained by the zaec project on Fashion-MNIST; not OpenAI CLIP",
        "train": asdict(cfg),
        "train_seconds": round(train_seconds, 1),
        "final_logit_scale": round(model.logit_scale.exp().item(), 3),
        "templates": len(_templates()),
        "clean_test_accuracy_first_2000": round(acc, 4),
        "torch": torch.__version__,
        "open_clip": open_clip.__version__,
    }
    _save_model(out, spec, model, record)
    return out


def _training_images(cfg: TrainConfig, fmnist_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The training images as (N, 32, 32) uint8 (grey: R = G = B) and their labels; a seeded subset below 60,000."""
    images, labels = load_split(fmnist_dir, "train")
    if cfg.n_images < len(images):
        keep = np.random.default_rng(cfg.seed).permutation(len(images))[: cfg.n_images]
        images, labels = images[keep], labels[keep]
    # uint8 at IMAGE_SIZE, exactly as the test sets are written to PNG, so training and test preprocessing agree
    return torch.from_numpy(to_rgb_uint8(upsample(images))[..., 0]), torch.from_numpy(labels)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on embeddings, biases, norms or the logit scale)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr
    )


def _lr_schedule(cfg: TrainConfig, total: int) -> Callable[[int], float]:
    """Linear warm-up over `warmup_fraction` of the steps, then a cosine decay to 0."""
    warmup = max(1, int(cfg.warmup_fraction * total))

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        return 0.5 * cfg.lr * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return lr_at


def _train_loop(spec: DemoModel, model: Any, tokenizer: Any, train_x: torch.Tensor, train_y: torch.Tensor,
                gen: torch.Generator, console: Any) -> None:
    """The contrastive training epochs, with a progress bar (loss, running accuracy, logit scale)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from extract.datasets import FASHION_MNIST_CLASSES

    cfg = spec.train
    tokens = _prompt_tokens(tokenizer, FASHION_MNIST_CLASSES)  # (T, K, L)
    n_templates, n_classes = tokens.shape[:2]
    pre = _preprocess_cfg()
    mean, std = torch.tensor(pre["mean"]), torch.tensor(pre["std"])
    opt = _optimizer(model, cfg)
    total = math.ceil(len(train_x) / cfg.batch_size) * cfg.epochs
    lr_at = _lr_schedule(cfg, total)
    max_log_scale = math.log(cfg.max_logit_scale)
    seen = correct = 0
    loss_avg = float("nan")
    columns = (
        TextColumn("[bold]train[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  acc {task.fields[acc]:.3f}  scale {task.fields[scale]:.1f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(spec.name, total=total, loss=float("nan"), acc=0.0,
                                 scale=model.logit_scale.exp().item())
        step = 0
        for _ in range(cfg.epochs):
            order = torch.randperm(len(train_x), generator=gen)
            for start in range(0, len(order), cfg.batch_size):
                idx = order[start : start + cfg.batch_size]
                x = _normalise(_augment(train_x[idx].float() / 255.0, cfg, gen), mean, std)
                y = train_y[idx]
                # the anchor template plus prompts_per_step - 1 others drawn at random; every one must classify
                # on its own (the zero-shot anchor uses a single prompt), so the loss is their mean
                others = torch.randperm(n_templates - 1, generator=gen)[: cfg.prompts_per_step - 1] + 1
                pick = torch.cat([torch.zeros(1, dtype=torch.long), others])  # (M,)
                text = tokens[pick].reshape(-1, tokens.shape[-1])  # (M * K, L)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                img_f = F.normalize(model.encode_image(x), dim=-1)  # (B, D)
                txt_f = F.normalize(model.encode_text(text), dim=-1).reshape(len(pick), n_classes, -1)  # (M, K, D)
                logits = model.logit_scale.exp() * torch.einsum("bd,mkd->mbk", img_f, txt_f)  # (M, B, K)
                loss = torch.stack([_contrastive_loss(lg, y) for lg in logits]).mean()
                logits = logits[0]  # the anchor prompt's logits, for the running accuracy
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                with torch.no_grad():
                    model.logit_scale.clamp_(0.0, max_log_scale)
                seen += len(y)
                correct += int((logits.argmax(1) == y).sum())
                loss_avg = loss.item() if step == 0 else 0.98 * loss_avg + 0.02 * loss.item()
                step += 1
                progress.update(
                    task, advance=1, loss=loss_avg, acc=correct / seen, scale=model.logit_scale.exp().item()
                )


def _save_model(out: Path, spec: DemoModel, model: Any, record: dict[str, Any]) -> None:
    """Config, safetensors weights and the training record, in one folder that appears atomically."""
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:  # an existing model folder is only replaced with force=True (the caller checks)
        with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as fh:
            # model_name: the backbone name zaec-extract records in the shards (else the folder's name)
            config = {"model_name": spec.name, "model_cfg": spec.model_cfg, "preprocess_cfg": _preprocess_cfg()}
            json.dump(config, fh, indent=2)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        with open(tmp / RECORD_FILE, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2)


def training_record(spec: DemoModel, models_dir: str | Path) -> dict[str, Any]:
    """The ``training.json`` saved next to a trained model ({} if absent, e.g. a model brought by the user)."""
    path = spec.directory(models_dir) / RECORD_FILE
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def with_budget(spec: DemoModel, **train_overrides: Any) -> DemoModel:
    """A copy of ``spec`` with some TrainConfig fields replaced (tests use it for a tiny budget)."""
    return replace(spec, train=replace(spec.train, **train_overrides))
