"""WATT (extract/methods/watt.py) on tiny ViT and ResNet CLIPs, against a slow transcription of the official class
(`adapt/watt.py` `WATT`: `reset`, `perform_adaptation`, `evaluate`, `weight_average`; `main.py`'s per-batch
reset) written here from docs/methods.md, "WATT: weight averaging over text templates"."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict

import pytest
import torch

from extract.methods.watt import WATT, WATT_TEMPLATES, template_average
from tests.support.norm_tuning import (NAMES, SCALE, assert_reset_per_batch, cross_entropy, encode_image, logit_tol,
                                       openai_fp16, pixels, tiny_loaded)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["vit", "rn"])
def loaded(request):
    return tiny_loaded(request.param)


class RefWATT:
    """`adapt/watt.py` WATT on an open_clip model (`model` a private copy), the official `100` as the model's
    scale; on a ResNet the BatchNorms set up as CLIPArTT's `configure_model` (zaec's `rn_batchnorm`)."""

    def __init__(self, model, tokenizer, lr, type="sequential", l=2, m=5, templates=WATT_TEMPLATES, fp16=False):
        self.model = openai_fp16(model) if fp16 else model.float()
        self.tokenizer, self.lr, self.type, self.l, self.m, self.all_templates = tokenizer, lr, type, l, m, templates
        self.norm = (torch.nn.BatchNorm2d if any(isinstance(x, torch.nn.BatchNorm2d) for x in model.visual.modules())
                     else torch.nn.LayerNorm)
        self.model.visual.requires_grad_(False)  # set_ln_grads
        for mod in self.model.visual.modules():
            if isinstance(mod, self.norm):
                mod.requires_grad_(True)
                if self.norm is torch.nn.BatchNorm2d:  # CLIPArTT configure_model
                    mod.track_running_stats, mod.running_mean, mod.running_var = False, None, None
        if self.norm is torch.nn.BatchNorm2d:
            self.model.visual.train()
        params = [p for mod in self.model.visual.modules() if isinstance(mod, self.norm)
                  for n, p in mod.named_parameters() if n in ("weight", "bias")]
        self.optimizer = torch.optim.Adam(params, lr=self.lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.model_state = copy.deepcopy(self.model.state_dict())
        self.optimizer_state = copy.deepcopy(self.optimizer.state_dict())

    def reset(self):
        self.model.load_state_dict(self.model_state, strict=True)
        self.optimizer.load_state_dict(self.optimizer_state)

    def extract_text_embeddings(self, class_names, templates, average=True):
        with torch.no_grad():
            text_features = []
            for class_name in class_names:
                texts = self.tokenizer([template.format(class_name) for template in templates])
                class_embeddings = self.model.encode_text(texts)
                class_embeddings /= class_embeddings.norm(dim=-1, keepdim=True)
                if average:
                    class_embeddings = class_embeddings.mean(dim=0)
                    class_embeddings /= class_embeddings.norm()
                text_features.append(class_embeddings)
            return torch.stack(text_features, dim=1)

    def forward(self, image, text):  # `CLIP.forward(image, text, text_ensemble=True)`
        image_features = encode_image(self.model, image)
        image_features = image_features / image_features.norm(dim=1, keepdim=True)
        logits = self.model.logit_scale.exp() * text @ image_features.t()
        return logits, image_features, text

    def perform_adaptation(self, x, classes):
        text_x = self.extract_text_embeddings(classes, self.all_templates, average=False)
        for m in range(self.m):
            all_weights = []
            if self.type == "sequential":
                if m == 0:
                    self.reset()
                else:
                    self.model.load_state_dict(avg_state_dict, strict=False)  # noqa: F821 (set in round 0)
            for text_feat in text_x:
                if self.type == "parallel":
                    if m == 0:
                        self.reset()
                    else:
                        self.model.load_state_dict(avg_state_dict, strict=False)  # noqa: F821
                for _ in range(self.l):
                    with torch.no_grad():
                        image_features = encode_image(self.model, x)
                    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
                    similarity = (SCALE * image_features @ text_feat.t()).softmax(1)
                    values, pred = similarity.topk(1, 1, True, True)
                    pred_inputs = torch.cat([text_feat[c,] for c in pred])
                    logits, image_features, text_features = self.forward(x, pred_inputs)
                    images_similarity = image_features @ image_features.t()
                    texts_similarity = text_features @ text_features.t()
                    targets = torch.softmax(((images_similarity + texts_similarity) / 2) / 0.01, dim=-1)
                    loss = cross_entropy(logits.t(), targets.t())
                    loss.backward()
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                weights = {}
                for name, module in self.model.named_modules():
                    # every LayerNorm of the model (the text encoder's too); the tuned BatchNorms on a ResNet
                    if isinstance(module, (torch.nn.LayerNorm, self.norm)):
                        for nparam, p in module.named_parameters():
                            if nparam in ("weight", "bias"):
                                weights[f"{name}.{nparam}"] = copy.deepcopy(p)
                all_weights.append(weights)
            avg_state_dict = OrderedDict((k, sum(sd[k] for sd in all_weights) / len(all_weights))
                                         for k in all_weights[0])
        self.model.load_state_dict(avg_state_dict, strict=False)

    @torch.no_grad()
    def evaluate(self, x, classes):
        image_features = encode_image(self.model, x)
        image_features /= image_features.norm(dim=-1, keepdim=True)
        text_features = self.extract_text_embeddings(classes, self.all_templates, average=True).T
        return SCALE * image_features @ text_features.T  # the logits `similarity` is the softmax of

    def batch(self, x, classes):  # main.py: reset, adapt (which resets again), evaluate
        self.reset()
        self.reset()
        self.perform_adaptation(x, classes)
        return self.evaluate(x, classes)


def make(loaded, **changes) -> WATT:
    cfg = dataclasses.replace(WATT.default_config("imagenet", loaded.backbone), **changes)
    text = torch.zeros(len(NAMES), 16)
    return WATT(cfg, text, loaded.logit_scale, backbone=loaded.backbone, dataset="imagenet", text_encoder=loaded,
                class_names=NAMES)


@pytest.mark.parametrize("watt_type,rounds", [("sequential", 3), ("parallel", 2)])
def test_batches_equal_the_official_loop(loaded, watt_type, rounds):
    """Two batches in a row (reset between them) equal the transcription's bit for bit: the same operations in the
    same order and memory layout on the same CPU (the text encoder's LayerNorms averaged over the templates, the
    (D, K) layout of the prediction's texts and Adam's moments carried across rounds all show in the last bits);
    lr 1e-2 so that the steps move the logits well beyond any rounding."""
    m = make(loaded, watt_type=watt_type, rounds=rounds, lr=1e-2)
    ref = RefWATT(copy.deepcopy(loaded.model), loaded.tokenizer, 1e-2, watt_type, 2, rounds)
    steps = rounds * len(WATT_TEMPLATES) * 2
    for seed, n in ((1, 6), (2, 5)):
        x = pixels(n, seed)
        got, want = m.adapt_images(x), ref.batch(x, NAMES)
        assert torch.equal(got, want.float())
        frozen = make(loaded, steps_per_template=0).adapt_images(x)
        assert (got - frozen).abs().max() > 100 * logit_tol(torch.float32, steps)  # the steps did move it


def test_fp16_weights_equal_the_official_fp16_loop(loaded):
    """The official CUDA numerics (clip.load's fp16 weights, fp32 LayerNorms, no autocast, no loss scale) on the
    CPU (`weights_dtype="fp16"`) against the transcription on OpenAI's conversion, bit for bit."""
    m = make(loaded, rounds=2, lr=1e-2, weights_dtype="fp16")
    x = pixels(6, 3)
    ref = RefWATT(copy.deepcopy(loaded.model), loaded.tokenizer, 1e-2, "sequential", 2, 2, fp16=True)
    want = ref.batch(x, NAMES)
    assert want.dtype == torch.float16 and m.build(x.device).dtype == torch.float16
    got = m.adapt_images(x)
    assert torch.equal(got, want.float())
    assert (got - make(loaded, rounds=2, lr=1e-2).adapt_images(x)).abs().max() > 0  # fp16 is not the fp32 path


def test_template_average_is_the_official_sum():
    """`sum(w for w in ws) / T` left to right from 0: not `mean` (which may sum in another order); T copies of one
    value need not give it back."""
    g = torch.Generator().manual_seed(0)
    ws = [[torch.randn(50, generator=g)] for _ in range(8)]
    assert torch.equal(template_average(ws)[0], sum(w[0] for w in ws) / 8)
    x = torch.rand(10000, generator=g) + 1
    assert not torch.equal(template_average([[x]] * 8)[0], x)  # the text LayerNorms' ulp (see `averaged_...`)


def test_reset_between_batches_and_the_run_model_untouched(loaded):
    """A batch's logits do not depend on the batches before it, and the run's frozen model is never changed."""
    assert_reset_per_batch(loaded, lambda **kw: make(loaded, rounds=1, **kw))


def test_resnet_refused_without_rn_batchnorm():
    rn = tiny_loaded("rn")
    with pytest.raises(ValueError, match=r"ResNet without any .*rn_batchnorm=true"):
        make(rn, rn_batchnorm=False)
    assert make(tiny_loaded("vit"), rn_batchnorm=False).kind == "layernorm"
