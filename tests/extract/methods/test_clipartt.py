"""CLIPArTT (extract/methods/clipartt.py) on tiny ViT and ResNet CLIPs, against a slow transcription of the official
code (`adapt.py` `setup_tent` and its per-batch loop, `models/tent.py` `Tent`, `forward_and_adapt`,
`configure_model`, `collect_params`) written here from
docs/methods.md, "CLIPArTT: pseudo-labels from a batch text graph"."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from extract.methods.clipartt import CLIPArTT, top_k_prompts
from extract.methods.norm_tuning import text_graph_loss
from tests.support.norm_tuning import (NAMES, SCALE, assert_reset_per_batch, cross_entropy, encode_image, logit_tol,
                                       openai_fp16, pixels, tiny_loaded)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["vit", "rn"])
def loaded(request):
    return tiny_loaded(request.param)


class RefCLIPArTT:
    """`setup_tent` + `Tent(episodic=True)` + `adapt.py`'s evaluation on an open_clip model (`model` a private
    copy), the official `100` as the model's scale."""

    def __init__(self, model, tokenizer, niter=10, lr=1e-3, K=3, target_method=1, fp16=False):
        self.model = openai_fp16(model) if fp16 else model
        self.tokenizer, self.steps, self.K, self.target_method = tokenizer, niter, K, target_method
        rn = any(isinstance(m, torch.nn.BatchNorm2d) for m in model.visual.modules())  # `'RN' in name_model`
        visual = self.model.visual
        if rn:  # configure_model
            visual.train()
        visual.requires_grad_(False)
        for m in visual.modules():
            if rn and isinstance(m, torch.nn.BatchNorm2d):
                m.requires_grad_(True)
                m.track_running_stats = False
                m.running_mean = None
                m.running_var = None
            elif not rn and isinstance(m, torch.nn.LayerNorm):
                m.requires_grad_(True)
        kind = torch.nn.BatchNorm2d if rn else torch.nn.LayerNorm
        params = [p for m in visual.modules() if isinstance(m, kind)  # collect_params
                  for n, p in m.named_parameters() if n in ("weight", "bias")]
        self.optimizer = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.model_state = copy.deepcopy(self.model.state_dict())
        self.optimizer_state = copy.deepcopy(self.optimizer.state_dict())

    def reset(self):
        self.model.load_state_dict(self.model_state, strict=True)
        self.optimizer.load_state_dict(self.optimizer_state)

    def tokenize(self, texts):
        return torch.cat([self.tokenizer([t]) for t in texts])  # `torch.cat([clip.tokenize(...) for ...])`

    def forward_model(self, image, text):  # the CLIPArTT `CLIP.forward`
        image_features = encode_image(self.model, image)
        text_features = self.model.encode_text(text)
        image_features = image_features / image_features.norm(dim=1, keepdim=True)
        text_features = text_features / text_features.norm(dim=1, keepdim=True)
        logits = self.model.logit_scale.exp() * text_features @ image_features.t()
        return logits, image_features, text_features

    def forward_and_adapt(self, x, text_x, classes):
        with torch.no_grad():
            image_features = encode_image(self.model, x)
            text_features = self.model.encode_text(text_x)
        image_features /= image_features.norm(dim=-1, keepdim=True)
        text_features /= text_features.norm(dim=-1, keepdim=True)
        similarity = (SCALE * image_features @ text_features.T).softmax(dim=-1)
        values, pred = similarity.topk(self.K, 1, True, True)
        prompts = []
        for c in pred:  # getprompt
            for k in range(self.K):
                prompt = f"a photo of a {classes[c[k]]}" if k == 0 else prompt + " or " + classes[c[k]]
            prompts.append(prompt)
        logits, image_features, text_features = self.forward_model(x, self.tokenize(prompts))
        images_similarity = image_features @ image_features.t()
        texts_similarity = text_features @ text_features.t()
        if self.target_method == 1:
            targets = F.softmax(((images_similarity + texts_similarity) / 2) / 0.01, dim=-1)
        elif self.target_method == 2:
            targets = F.softmax(((images_similarity) / 2) / 0.01, dim=-1)
        elif self.target_method == 3:
            targets = F.softmax(((texts_similarity) / 2) / 0.01, dim=-1)
        else:
            targets = torch.eye(logits.shape[0])
        loss = cross_entropy(logits.t(), targets.t())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def batch(self, inputs, classes):  # adapt.py: model.reset(); model(...) (episodic: reset again); evaluate
        text_inputs = self.tokenize([f"a photo of a {c}" for c in classes])
        self.reset()
        self.reset()
        for _ in range(self.steps):
            self.forward_and_adapt(inputs, text_inputs, classes)
        with torch.no_grad():
            image_features = encode_image(self.model, inputs)
            text_features = self.model.encode_text(text_inputs)
        image_features /= image_features.norm(dim=-1, keepdim=True)
        text_features /= text_features.norm(dim=-1, keepdim=True)
        return SCALE * image_features @ text_features.T


def make(loaded, **changes) -> CLIPArTT:
    cfg = dataclasses.replace(CLIPArTT.default_config("imagenet", loaded.backbone), **changes)
    return CLIPArTT(cfg, torch.zeros(len(NAMES), 16), loaded.logit_scale, backbone=loaded.backbone,
                    dataset="imagenet", text_encoder=loaded, class_names=NAMES)


@pytest.mark.parametrize("target_method,top_k", [(1, 3), (2, 2), (3, 1), (4, 3)])
def test_batches_equal_the_official_loop(loaded, target_method, top_k):
    """Two batches in a row (reset between them) equal the transcription's bit for bit (the same operations in the
    same order and layout on the same CPU); lr 1e-2 so that the 10 steps move the logits well beyond rounding."""
    m = make(loaded, lr=1e-2, target_method=target_method, top_k=top_k)
    ref = RefCLIPArTT(copy.deepcopy(loaded.model), loaded.tokenizer, lr=1e-2, K=top_k, target_method=target_method)
    for seed, n in ((1, 6), (2, 5)):
        x = pixels(n, seed)
        got = m.adapt_images(x)
        assert torch.equal(got, ref.batch(x, NAMES).float())
        assert (got - make(loaded, lr=0.0).adapt_images(x)).abs().max() > 100 * logit_tol(torch.float32, 10)


def test_fp16_weights_equal_the_official_fp16_loop(loaded):
    """The official CUDA numerics (clip.load's fp16 weights, fp32 LayerNorms and BatchNorm parameters, no autocast,
    no loss scale) on the CPU (`weights_dtype="fp16"`) against the transcription on OpenAI's conversion."""
    m = make(loaded, lr=1e-2, steps=4, weights_dtype="fp16")
    x = pixels(6, 3)
    want = RefCLIPArTT(copy.deepcopy(loaded.model), loaded.tokenizer, niter=4, lr=1e-2, fp16=True).batch(x, NAMES)
    assert want.dtype == torch.float16
    got = m.adapt_images(x)
    assert torch.equal(got, want.float())
    assert (got - make(loaded, lr=1e-2, steps=4).adapt_images(x)).abs().max() > 0  # fp16 is not the fp32 path


def test_lr_zero_is_the_zero_shot_of_its_prompt(loaded):
    """No movement: on a ViT the frozen model's logits against "a photo of a {}"; on a ResNet those of the frozen
    weights with batch statistics (CLIPArTT's BatchNorms never use the running ones)."""
    x = pixels(5, 4)
    got = make(loaded, lr=0.0).adapt_images(x)
    model = copy.deepcopy(loaded.model)
    text = loaded.encode_texts([f"a photo of a {c}" for c in NAMES])
    if loaded.backbone == "tiny-rn":
        model.visual.train()
        for mod in model.visual.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.track_running_stats, mod.running_mean, mod.running_var = False, None, None
    with torch.no_grad():
        want = SCALE * F.normalize(model.visual(x), dim=-1) @ text.T
    torch.testing.assert_close(got, want, rtol=0, atol=logit_tol(torch.float32, 0))
    if loaded.backbone == "tiny-rn":  # the running statistics would give other logits
        assert (got - SCALE * loaded.encode_images(x) @ text.T).abs().max() > 1e-2


def test_reset_between_batches_and_the_run_model_untouched(loaded):
    """A batch's logits do not depend on the batches before it, and the run's frozen model is never changed."""
    assert_reset_per_batch(loaded, lambda **kw: make(loaded, steps=2, **kw))


def test_top_k_above_the_classes_names_them_all():
    """The official `topk(3)` stops on fewer classes; here every prompt names them all, with a note."""
    loaded = tiny_loaded("vit")
    m = make(loaded, top_k=6, steps=2)
    assert m.warnings == ["clipartt: top_k=6 exceeds the dataset's 5 classes: each image's prompt names all 5"]
    x = pixels(4, 7)
    assert torch.equal(m.adapt_images(x), make(loaded, top_k=5, steps=2).adapt_images(x))


def test_prompt_and_loss_pieces():
    """`getprompt` order (most likely first) and the loss against the formula written out per image."""
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.7, 0.05, 0.15, 0.1]])
    assert top_k_prompts(probs, 3, ["a", "b", "c", "d"], "a photo of a {}", " or ") == [
        "a photo of a b or d or c", "a photo of a a or c or d"]
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(4, 8, generator=g, dtype=torch.float64), dim=-1)
    txt = F.normalize(torch.randn(4, 8, generator=g, dtype=torch.float64), dim=-1)
    logits = 20.0 * txt @ img.t()
    q = torch.softmax((img @ img.t() + txt @ txt.t()) / 2 / 0.01, dim=-1)
    want = sum(-sum(q[j, i] * torch.log_softmax(logits[:, i], 0)[j] for j in range(4)) for i in range(4)) / 4
    torch.testing.assert_close(text_graph_loss(logits, img, txt), want, rtol=1e-12, atol=0)
