"""The paper's table layout: dataset groups, column labels, method and calibrator order.

Every dataset key present in the shards gets a place: the paper's two groups first (natural shift: Table 2;
ImageNet and the fine-grained sets: Table 3), then ImageNet-C's 75 corruption/severity sets, then any other dataset
(the demo's `fmnist*` sets, a user's own data) in a group named `other`. Labels fall back to the key itself, so
unknown keys never break a table.
"""

from __future__ import annotations

from typing import Iterable, Sequence

#: group name -> dataset keys in the paper's column order. Table 2 holds the four ImageNet variants; Table 3 holds
#: ImageNet itself and the ten fine-grained sets (canonical keys of extract.datasets, one spelling each).
GROUPS: dict[str, tuple[str, ...]] = {
    "natural_shift": ("imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch"),
    "fine_grained": (
        "imagenet",
        "dtd",
        "flowers102",
        "food101",
        "sun397",
        "eurosat",
        "fgvc_aircraft",
        "oxford_pets",
        "caltech101",
        "ucf101",
        "stanford_cars",
    ),
}
#: ImageNet-C's 15 corruptions in the release's order (noise, blur, weather, digital) with column abbreviations; the
#: keys `imagenet_c:<corruption>:<severity>` are extract.datasets' (a test checks the two lists agree)
IMAGENET_C_CORRUPTIONS: dict[str, str] = {
    "gaussian_noise": "Gauss", "shot_noise": "Shot", "impulse_noise": "Impul", "defocus_blur": "Defoc",
    "glass_blur": "Glass", "motion_blur": "Motn", "zoom_blur": "Zoom", "snow": "Snow", "frost": "Frost",
    "fog": "Fog", "brightness": "Brit", "contrast": "Contr", "elastic_transform": "Elast", "pixelate": "Pixel",
    "jpeg_compression": "JPEG",
}
IMAGENET_C_GROUP = "imagenet_c"
#: ImageNet-C columns: corruption-major, severity 1..5 within a corruption
GROUPS[IMAGENET_C_GROUP] = tuple(f"imagenet_c:{c}:{s}" for c in IMAGENET_C_CORRUPTIONS for s in range(1, 6))
OTHER_GROUP = "other"
GROUP_LABELS: dict[str, str] = {
    "natural_shift": "Natural distribution shift",
    "fine_grained": "ImageNet and fine-grained",
    IMAGENET_C_GROUP: "ImageNet-C (corruption, severity)",
    OTHER_GROUP: "Other datasets",
}
#: the paper's column headers
DATASET_LABELS: dict[str, str] = {
    "imagenet_a": "I-A", "imagenet_v2": "I-V", "imagenet_r": "I-R", "imagenet_sketch": "I-S",
    "imagenet": "INet", "dtd": "DTD", "flowers102": "FLOW", "food101": "FOOD",
    "sun397": "SUN", "eurosat": "EURO", "fgvc_aircraft": "AIR", "oxford_pets": "PETS",
    "caltech101": "CALT", "ucf101": "UCF", "stanford_cars": "CAR",
} | {key: f"{IMAGENET_C_CORRUPTIONS[key.split(':')[1]]}-{key.split(':')[2]}" for key in GROUPS[IMAGENET_C_GROUP]}
#: the "ImageNet family" of the paper's subset ablation (Table 4): ImageNet plus its four variants
IMAGENET_FAMILY: tuple[str, ...] = ("imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch")
#: dataset of the paper's per-sample figures (2c/2d, 5) and datasets of the strength ablation (Figure 6)
REFERENCE_DATASET = "imagenet_a"
STRENGTH_DATASETS: tuple[str, ...] = ("dtd", "imagenet_v2")
#: Figure 1 (intro): one panel per method, grouped bars of raw / SaLS / ZAEC ECE over the fine-grained group
FIG1_METHODS: tuple[str, ...] = ("tpt", "tda")
FIG1_CALIBRATORS: tuple[str, ...] = ("none", "sals", "zaec")
#: Figure 5 (reliability diagrams on the reference dataset): one column per method, the paper's TPT, TDA and DPE
FIG5_METHODS: tuple[str, ...] = ("tpt", "tda", "dpe")
#: Figure 4, the boundary case: zero-shot CLIP is underconfident on Caltech101 and DPE's sharpening helps
BOUNDARY_DATASET = "caltech101"
BOUNDARY_METHOD = "dpe"

#: the paper's method order (Tables 2 and 3), then the prompt-coupled calibrated TPT variants of Figure 2a;
#: other methods follow alphabetically
METHOD_ORDER: tuple[str, ...] = ("tpt", "tps", "tda", "dpe", "dlae", "ctpt", "otpt", "atpt")
#: THE display name of every method, as its paper and docs/methods.md spell it: every table, figure, legend and
#: README of `make tables` names a method through `method_label` only. It is data here because calibrate/ never
#: imports extract/ (the method registry, `extract.methods.REGISTRY`, loads torch); tests/calibrate/tables/
#: test_layout.py checks that every registered method (`extract.method_keys.METHOD_KEYS`) has an entry.
METHOD_LABELS: dict[str, str] = {
    "zero-shot": "Zero-shot",
    # the paper's methods (Tables 2 and 3) and the prompt-coupled calibrated TPT variants (Figure 2a)
    "tpt": "TPT", "tps": "TPS", "tda": "TDA", "dpe": "DPE", "dlae": "DLAE",
    "ctpt": "C-TPT", "otpt": "O-TPT", "atpt": "A-TPT",
    # TTA-VLM's methods (docs/methods.md, "The methods at a glance")
    "zero": "ZERO", "mta": "MTA", "onzeta": "OnZeta", "ecalp": "ECALP", "dmn": "DMN", "dmn-weak": "DMN-weak",
    "boostadapter": "BoostAdapter", "rtpt": "R-TPT", "dynaprompt": "DynaPrompt", "rlcf": "RLCF", "ttl": "TTL",
    # inside the image encoder (docs/methods.md, "Methods inside the image encoder, training-free (CALIP, TCA)")
    "calip": "CALIP", "tca": "TCA",
    # prompt tuning with history, averaging or descriptions (HisTPT, DART, AWT)
    "histpt": "HisTPT", "dart": "DART", "awt": "AWT",
    # the field's training-free online methods (DOTA, OGA, BCA)
    "dota": "DOTA", "oga": "OGA", "bca": "BCA",
    # a second model (docs/methods.md, "Methods that need a second pretrained model (DiffTPT, PromptAlign, COSMIC)")
    "difftpt": "DiffTPT", "promptalign": "PromptAlign", "cosmic": "COSMIC",
    # transductive (docs/methods.md, "Transductive methods (StatA, TransCLIP, ZLaP)")
    "stata": "StatA", "stata-online": "StatA-online", "transclip": "TransCLIP", "zlap": "ZLaP",
    "zlap-inductive": "ZLaP-inductive",
    # the methods that adapt the image encoder over batches (docs/methods.md, "The methods at a glance")
    "tent": "Tent", "sar": "SAR", "deyo": "DeYO", "batclip": "BATCLIP",
    # per batch, reset before each batch (WATT, CLIPArTT)
    "watt": "WATT", "clipartt": "CLIPArTT",
}
#: prompt-coupled calibration methods (TPT variants that calibrate while tuning the prompt): Figure 2b's statistic
#: is over the paper's TTA methods, so these are left out of it by default
PROMPT_CALIBRATION_METHODS: tuple[str, ...] = ("ctpt", "otpt", "atpt")
#: Figure 2a as the paper draws it: (method, calibrator) points; arrows join points of the same method
FIG2A_POINTS: tuple[tuple[str, str], ...] = (("tpt", "sals"), ("tpt", "zaec"), ("otpt", "none"), ("atpt", "none"))
ZERO_SHOT = "zero-shot"
BACKBONE_ORDER: tuple[str, ...] = ("ViT-B-16", "RN50")

#: the four calibrators of the main tables, in the paper's row order
MAIN_CALIBRATORS: tuple[str, ...] = ("none", "temperature", "sals", "zaec")
CALIBRATOR_LABELS: dict[str, str] = {
    "none": "None", "temperature": "Temp. Scal.", "sals": "SaLS", "zaec": "ZAEC",
    "zaec:subset=all": "All predictions", "zaec:subset=increased": "Entropy-increased",
}
#: Table 4 rows: corrected subset -> calibrator spec ("none" is raw TTA)
SUBSET_SPECS: dict[str, str] = {
    "None (raw TTA)": "none",
    "All predictions": "zaec:subset=all",
    "Entropy-increased": "zaec:subset=increased",
    "Entropy-reduced (ZAEC)": "zaec",
}
#: Figure 6: restoration strengths lambda (0 is raw TTA, 1 is ZAEC)
STRENGTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)


def strength_spec(strength: float) -> str:
    """Calibrator spec of restoration strength `strength` (0 -> "none", 1 -> "zaec", else "zaec:strength=x")."""
    if strength == 0.0:
        return "none"
    if strength == 1.0:
        return "zaec"
    return f"zaec:strength={strength:g}"


def dataset_group(dataset: str) -> str:
    """The group a dataset key belongs to (`other` for keys outside the paper's groups)."""
    for group, keys in GROUPS.items():
        if dataset in keys:
            return group
    return OTHER_GROUP


def dataset_label(dataset: str) -> str:
    return DATASET_LABELS.get(dataset, dataset)


def method_label(method: str) -> str:
    """The display name of a method key (`METHOD_LABELS`); a key outside the registry (a user's own method) is shown
    as it is spelt, never re-cased, so one method never appears under two names."""
    return METHOD_LABELS.get(method, method)


def calibrator_label(spec: str) -> str:
    return CALIBRATOR_LABELS.get(spec, spec)


def _ordered(keys: Iterable[str], order: Sequence[str]) -> list[str]:
    keys = set(keys)
    known = [k for k in order if k in keys]
    return known + sorted(keys - set(known))


def order_datasets(datasets: Iterable[str]) -> list[tuple[str, list[str]]]:
    """Group and order dataset keys: [(group, [dataset, ...]), ...], empty groups left out.

    Example:
        >>> order_datasets(["dtd", "fmnist", "imagenet_a", "imagenet"])
        [('natural_shift', ['imagenet_a']), ('fine_grained', ['imagenet', 'dtd']), ('other', ['fmnist'])]
    """
    datasets = set(datasets)
    out = []
    for group, keys in GROUPS.items():
        members = [k for k in keys if k in datasets]
        if members:
            out.append((group, members))
    rest = sorted(d for d in datasets if dataset_group(d) == OTHER_GROUP)
    if rest:
        out.append((OTHER_GROUP, rest))
    return out


def order_methods(methods: Iterable[str]) -> list[str]:
    """TTA methods in the paper's order, others alphabetically; the zero-shot pseudo-method left out."""
    return _ordered((m for m in methods if m != ZERO_SHOT), METHOD_ORDER)


def order_backbones(backbones: Iterable[str]) -> list[str]:
    return _ordered(backbones, BACKBONE_ORDER)
