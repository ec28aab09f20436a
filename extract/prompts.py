"""Prompt tables and prompt sets (docs/methods.md, "Class prototypes: prompts per method"). Pure Python: no torch here.

Policies (a method's `Config.prompts`):
    * "single": "a photo of a {}." (zero-shot anchor, TPT family, TTA-VLM benchmark).
    * "dataset": TDA's per-dataset CoOp/Tip-Adapter templates (`DATASET_TEMPLATES`).
    * "imagenet80": the 80 CLIP ImageNet templates for every dataset (TPS), taken from open_clip.
    * "dpe_cars": DPE/DLAE's Stanford Cars pair (`DPE_STANFORD_CARS`), used with CuPL.
    * "clip_dataset": CLIP's per-dataset prompt ensembles (`CLIP_DATASET_TEMPLATES`), as TCA reads them.
    * "transclip": TransCLIP's and StatA's one template per dataset (`_transclip_templates`).
`cupl=True` adds the CuPL GPT-3 prompts of the dataset (DPE, DLAE). CuPL files are third-party text the project does
not ship: they are read from a user directory (`--cupl-dir` or $ZAEC_CUPL_DIR) under DPE's file names
(`CuPL_prompts_<name>.json`, a JSON object class name -> list of sentences). If the directory or the file is absent,
the prompt set falls back to the templates and carries a warning that the runner records in the shard metadata
(`zaec:warnings`).

Class descriptions (AWT): a method that reads them (`TTAMethod.needs_descriptions`) gets one JSON object class name ->
list of sentences per dataset, read from `--descriptions-dir` or $ZAEC_DESCRIPTIONS_DIR (`load_descriptions`). They
are third-party text too, but the method cannot run without them: a missing folder, file, class or sentence stops
the run in one line before the model loads.

Demo sets (group "demo") use the templates of their `hparams_from` dataset and have no CuPL file. A user's own
dataset (`folder:PATH`, `split:FILE.json`) has neither: it takes "single" or "imagenet80" (`USER_PROMPT_POLICIES`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal, Sequence

from extract.datasets import get_dataset
from extract.defaults import CUPL_DIR_ENV as CUPL_ENV
from extract.defaults import DESCRIPTIONS_DIR_ENV, default_descriptions_dir

PromptPolicy = Literal["single", "dataset", "imagenet80", "dpe_cars", "clip_dataset", "transclip"]
PROMPT_POLICIES: tuple[str, ...] = ("single", "dataset", "imagenet80", "dpe_cars", "clip_dataset", "transclip")
#: the policies a user's own dataset may use: no per-dataset templates, no CuPL sentences exist for it
USER_PROMPT_POLICIES: tuple[str, ...] = ("single", "imagenet80")

SINGLE_TEMPLATE = "a photo of a {}."

# Tip-Adapter's seven ImageNet templates, used by TDA for ImageNet, -A, -V2, Caltech101, StanfordCars, SUN397
# (TDA datasets/imagenet.py, caltech101.py, ...).
TIP_TEMPLATES: tuple[str, ...] = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)
# DPE datasets/stanford_cars.py, used together with CuPL.
DPE_STANFORD_CARS: tuple[str, ...] = (
    "a photo of a {}.",
    "A {} featuring a wide range of color options for easy selection.",
)

# CLIP's per-dataset prompt ensembles (OpenAI CLIP's prompt engineering), as TCA's `datasets/*.py` hold them (its
# `template`/`templates` lists; Jo-wang/TCA `datasets/dtd.py`, `eurosat.py`, ...); the ImageNet family takes the 80
# ImageNet templates (`imagenet80_templates`, identical in order to TCA's `datasets/imagenet.py` list).
CLIP_DATASET_TEMPLATES: dict[str, tuple[str, ...]] = {
    "caltech101": ("a photo of a {}.", "a painting of a {}.", "a plastic {}.", "a sculpture of a {}.",
        "a sketch of a {}.", "a tattoo of a {}.", "a toy {}.", "a rendition of a {}.", "a embroidered {}.",
        "a cartoon {}.", "a {} in a video game.", "a plushie {}.", "a origami {}.", "art of a {}.",
        "graffiti of a {}.", "a drawing of a {}.", "a doodle of a {}.", "a photo of the {}.", "a painting of the {}.",
        "the plastic {}.", "a sculpture of the {}.", "a sketch of the {}.", "a tattoo of the {}.", "the toy {}.",
        "a rendition of the {}.", "the embroidered {}.", "the cartoon {}.", "the {} in a video game.",
        "the plushie {}.", "the origami {}.", "art of the {}.", "graffiti of the {}.", "a drawing of the {}.",
        "a doodle of the {}."),
    "dtd": ("a photo of a {} texture.", "a photo of a {} pattern.", "a photo of a {} thing.",
        "a photo of a {} object.", "a photo of the {} texture.", "a photo of the {} pattern.",
        "a photo of the {} thing.", "a photo of the {} object."),
    "eurosat": ("a centered satellite photo of {}.", "a centered satellite photo of a {}.",
        "a centered satellite photo of the {}."),
    "fgvc_aircraft": ("a photo of a {}, a type of aircraft.", "a photo of the {}, a type of aircraft."),
    "food101": ("a photo of {}, a type of food.",),
    "flowers102": ("a photo of a {}, a type of flower.",),
    "oxford_pets": ("a photo of a {}, a type of pet.",),
    "stanford_cars": ("a photo of a {}.", "a photo of the {}.", "a photo of my {}.", "i love my {}!",
        "a photo of my dirty {}.", "a photo of my clean {}.", "a photo of my new {}.", "a photo of my old {}."),
    "sun397": ("a photo of a {}.", "a photo of the {}."),
    "ucf101": ("a photo of a person {}.", "a video of a person {}.", "a example of a person {}.",
        "a demonstration of a person {}.", "a photo of the person {}.", "a video of the person {}.",
        "a example of the person {}.", "a demonstration of the person {}.", "a photo of a person using {}.",
        "a video of a person using {}.", "a example of a person using {}.", "a demonstration of a person using {}.",
        "a photo of the person using {}.", "a video of the person using {}.", "a example of the person using {}.",
        "a demonstration of the person using {}.", "a photo of a person doing {}.", "a video of a person doing {}.",
        "a example of a person doing {}.", "a demonstration of a person doing {}.", "a photo of the person doing {}.",
        "a video of the person doing {}.", "a example of the person doing {}.",
        "a demonstration of the person doing {}.", "a photo of a person during {}.", "a video of a person during {}.",
        "a example of a person during {}.", "a demonstration of a person during {}.",
        "a photo of the person during {}.", "a video of the person during {}.", "a example of the person during {}.",
        "a demonstration of the person during {}.", "a photo of a person performing {}.",
        "a video of a person performing {}.", "a example of a person performing {}.",
        "a demonstration of a person performing {}.", "a photo of the person performing {}.",
        "a video of the person performing {}.", "a example of the person performing {}.",
        "a demonstration of the person performing {}.", "a photo of a person practicing {}.",
        "a video of a person practicing {}.", "a example of a person practicing {}.",
        "a demonstration of a person practicing {}.", "a photo of the person practicing {}.",
        "a video of the person practicing {}.", "a example of the person practicing {}.",
        "a demonstration of the person practicing {}."),
}


class PromptError(ValueError):
    """A user-side problem with prompts (unknown policy, unreadable CuPL file)."""


@lru_cache(maxsize=None)
def imagenet80_templates() -> tuple[str, ...]:
    """The 80 CLIP ImageNet templates (open_clip's OPENAI_IMAGENET_TEMPLATES) as "{}" format strings."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES
    return tuple(t("{}") for t in OPENAI_IMAGENET_TEMPLATES)


def _dataset_templates() -> dict[str, tuple[str, ...]]:
    # TDA datasets/*.py; ImageNet-R and -Sketch use the 80 CLIP templates
    return {
        "imagenet": TIP_TEMPLATES,
        "imagenet_a": TIP_TEMPLATES,
        "imagenet_v2": TIP_TEMPLATES,
        "imagenet_r": imagenet80_templates(),
        "imagenet_sketch": imagenet80_templates(),
        "caltech101": TIP_TEMPLATES,
        "stanford_cars": TIP_TEMPLATES,
        "sun397": TIP_TEMPLATES,
        "dtd": ("{} texture.",),
        "eurosat": ("a centered satellite photo of {}.",),
        "fgvc_aircraft": ("a photo of a {}, a type of aircraft.",),
        "food101": ("a photo of {}, a type of food.",),
        "flowers102": ("a photo of a {}, a type of flower.",),
        "oxford_pets": ("a photo of a {}, a type of pet.",),
        "ucf101": ("a photo of a person doing {}.",),
    }


def _transclip_templates() -> dict[str, tuple[str, ...]]:
    # MaxZanella/transduction-for-vlms and MaxZanella/StatA, `datasets/<set>.py` (`template`, or `imagenet_templates`
    # for the ImageNet family): one template per dataset, the CoOp one (TDA's, `_dataset_templates`) except the
    # ImageNet family's, Caltech101's, Stanford Cars' and SUN397's "a photo of a {}." and DTD's "{} texture" (no full
    # stop). OGA's "standard" prompts are `dataset.template` of a `datasets` package its repository does not include;
    # the OGA README names TransCLIP as its base (docs/methods.md, "OGA (`oga`)").
    plain = ("a photo of a {}.",)
    return {**_dataset_templates(), "dtd": ("{} texture",),
            **{key: plain for key in ("imagenet", "imagenet_a", "imagenet_v2", "imagenet_r", "imagenet_sketch",
                                      "caltech101", "stanford_cars", "sun397")}}


def templates_for(dataset: str, policy: PromptPolicy) -> tuple[str, ...]:
    """The templates of `policy` for `dataset` (demo sets: those of their `templates_from` set).

    Raises:
        PromptError: unknown policy (lists the valid ones).
    """
    if policy not in PROMPT_POLICIES:
        raise PromptError(f"unknown prompt policy {policy!r}; available: {', '.join(PROMPT_POLICIES)}")
    if policy == "single":
        return (SINGLE_TEMPLATE,)
    if policy == "imagenet80":
        return imagenet80_templates()
    if policy == "dpe_cars":
        return DPE_STANFORD_CARS
    spec = get_dataset(dataset)
    source = spec.templates_from or spec.hparams_from
    if source is None:  # a user's dataset: no official per-dataset template
        raise PromptError(f"dataset {dataset!r} has no per-dataset templates (prompts={policy!r}); use "
                          f"{' or '.join(repr(p) for p in USER_PROMPT_POLICIES)}")
    if policy == "clip_dataset":  # the ImageNet family: the 80 ImageNet templates
        return imagenet80_templates() if source.startswith("imagenet") else CLIP_DATASET_TEMPLATES[source]
    return (_transclip_templates() if policy == "transclip" else _dataset_templates())[source]


@dataclass(frozen=True)
class PromptSet:
    """The prompts of every class for one (dataset, policy, cupl) choice.

    Attributes:
        per_class: K tuples of prompt strings (templates formatted with the class name, then CuPL sentences).
        templates: the templates used.
        cupl_source: the CuPL file actually read, or None.
        warnings: fallbacks that happened (recorded in shard metadata).
    """

    dataset: str
    policy: str
    cupl_requested: bool
    templates: tuple[str, ...]
    per_class: tuple[tuple[str, ...], ...]
    cupl_source: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def fingerprint(self) -> str:
        """sha256 (16 hex chars) of every prompt of every class, in order: keys the text-prototype cache."""
        return hashlib.sha256(json.dumps(self.per_class).encode()).hexdigest()[:16]

    def describe(self) -> dict:
        """JSON-ready description for shard metadata (no per-class sentences, which can be megabytes)."""
        counts = [len(p) for p in self.per_class]
        return {
            "policy": self.policy,
            "templates": list(self.templates),
            "cupl": self.cupl_requested,
            "cupl_file": None if self.cupl_source is None else Path(self.cupl_source).name,
            "prompts_per_class": {"min": min(counts), "max": max(counts)},
            "fingerprint": self.fingerprint(),
        }


def resolve_cupl_dir(cupl_dir: str | os.PathLike | None) -> Path | None:
    """`cupl_dir`, else $ZAEC_CUPL_DIR, else None."""
    raw = cupl_dir if cupl_dir is not None else os.environ.get(CUPL_ENV)
    return Path(raw).expanduser() if raw else None


def class_key(name: str) -> str:
    """The form class names are matched in: lower case, `_` as a space, runs of white space as one space.

    >>> class_key("Annual_Crop  Land ")
    'annual crop land'
    """
    return " ".join(name.replace("_", " ").lower().split())


def read_class_table(path: str | os.PathLike) -> dict[str, list[str]]:
    """A JSON object class name -> list of strings, in file order.

    Raises:
        PromptError: unreadable file or not a JSON object of class name -> list of strings (names the file).
    """
    path = Path(path).expanduser()
    try:
        table = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PromptError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(table, dict) or not all(
            isinstance(v, list) and all(isinstance(s, str) for s in v) for v in table.values()):
        raise PromptError(f"{path}: expected a JSON object mapping class names to lists of sentences")
    return table


def match_class_table(table: dict[str, list[str]], class_names: Sequence[str]
                      ) -> tuple[list[list[str]], list[str]]:
    """Sentences per class: a key equal to the name, else one equal after `class_key` on both sides.

    Returns:
        (K lists of sentences, empty for unmatched classes; the names of the unmatched classes)
    """
    loose: dict[str, list[str]] = {}
    for k, v in table.items():
        loose.setdefault(class_key(k), v)
    out: list[list[str]] = []
    missing: list[str] = []
    for name in class_names:
        found = table[name] if name in table else loose.get(class_key(name))
        if found is None:
            missing.append(name)
        out.append(list(found or []))
    return out, missing


def read_class_sentences(path: str | os.PathLike, class_names: Sequence[str]
                         ) -> tuple[list[list[str]], list[str]]:
    """Sentences per class from a JSON object class name -> list of strings (CuPL prompts, GPT-4 descriptors),
    matched by name (`match_class_table`).

    Returns:
        (K lists of sentences, empty for unmatched classes; the names of the unmatched classes)

    Raises:
        PromptError: unreadable file or not a JSON object of class name -> list of strings (names the file).
    """
    return match_class_table(read_class_table(path), class_names)


def load_cupl(dataset: str, class_names: Sequence[str], cupl_dir: str | os.PathLike | None
              ) -> tuple[list[list[str]] | None, str | None, list[str]]:
    """CuPL sentences per class, the file read, and warnings. (None, None, [warning]) when unavailable.

    Raises:
        PromptError: the file exists but is not a JSON object of class name -> list of strings.
    """
    spec = get_dataset(dataset)
    if spec.cupl_file is None:
        return None, None, [f"cupl=True but dataset {dataset!r} has no CuPL prompt file; using the templates only"]
    d = resolve_cupl_dir(cupl_dir)
    if d is None:
        return None, None, [f"cupl=True but no CuPL directory was given (--cupl-dir or ${CUPL_ENV}); expected "
                            f"{spec.cupl_file} there (from the CuPL/DPE repositories); using the templates only"]
    path = d / spec.cupl_file
    if not path.is_file():
        return None, None, [f"cupl=True but {path} does not exist; using the templates only"]
    out, missing = read_class_sentences(path, class_names)
    warnings = []
    if missing:
        warnings.append(f"{path.name}: no CuPL sentences for {len(missing)} of {len(class_names)} classes "
                        f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); those use the templates "
                        "only")
    return out, str(path), warnings


def build_prompt_set(dataset: str, class_names: Sequence[str], *, policy: PromptPolicy, cupl: bool = False,
                     cupl_dir: str | os.PathLike | None = None) -> PromptSet:
    """All prompts of every class for a method's prompt policy.

    Example:
        >>> ps = build_prompt_set("dtd", ["banded", "woven"], policy="dataset")
        >>> ps.per_class
        (('banded texture.',), ('woven texture.',))
    """
    templates = templates_for(dataset, policy)
    per_class = [[t.format(name) for t in templates] for name in class_names]
    warnings: list[str] = []
    source = None
    if cupl:
        sentences, source, warnings = load_cupl(dataset, class_names, cupl_dir)
        if sentences is not None:
            per_class = [p + s for p, s in zip(per_class, sentences)]
    return PromptSet(dataset=dataset, policy=policy, cupl_requested=cupl, templates=templates,
                     per_class=tuple(tuple(p) for p in per_class), cupl_source=source, warnings=tuple(warnings))


# ---------------------------------------------------------------------------------------------------------------
# class descriptions (AWT)

@dataclass(frozen=True)
class Descriptions:
    """The class descriptions a method reads (AWT's LLM descriptions).

    Attributes:
        source: the file read.
        names: per class, the name the file gives it (its key; AWT formats its prompts with it).
        per_class: per class, its sentences in file order.
        warnings: how classes were matched when not by name (recorded in shard metadata).
    """

    source: str
    names: tuple[str, ...]
    per_class: tuple[tuple[str, ...], ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def fingerprint(self) -> str:
        """sha256 (16 hex chars) of every name and sentence used, in order (the finished-run check compares it)."""
        return hashlib.sha256(json.dumps([self.names, self.per_class]).encode()).hexdigest()[:16]

    def describe(self) -> dict:
        """JSON-ready description for shard metadata."""
        counts = [len(p) for p in self.per_class]
        return {"file": Path(self.source).name, "fingerprint": self.fingerprint(),
                "sentences_per_class": {"min": min(counts), "max": max(counts)}}


def resolve_descriptions_dir(descriptions_dir: str | os.PathLike | None) -> Path | None:
    """`descriptions_dir`, else $ZAEC_DESCRIPTIONS_DIR (`default_descriptions_dir`), else None."""
    if descriptions_dir is None:
        return default_descriptions_dir()
    return Path(descriptions_dir).expanduser() if descriptions_dir else None


def load_descriptions(folder: str | os.PathLike | None, file_name: str, class_names: Sequence[str], *,
                      method: str, need: int, by_position: bool, where: str) -> Descriptions:
    """The descriptions of every class from `<folder>/<file_name>` (a JSON object class name -> sentences).

    Keys are matched to class names after `class_key` on both sides. With `by_position` (a registered dataset,
    whose official file may name a class differently: AWT's eurosat.json says 'brushland or shrubland' for
    'Herbaceous Vegetation Land'), a file of exactly K entries whose keys do not all match is paired with the
    classes by position, as TPS's descriptor files are, and a warning says so. The file's key is the class's name
    in the result either way.

    Args:
        folder: `--descriptions-dir` (None: $ZAEC_DESCRIPTIONS_DIR).
        file_name: the dataset's file; class_names: the K classes in label order.
        method: the method key (named in every message); need: sentences every class must have.
        by_position: allow the pairing by position; where: where the files come from (named in the messages).

    Raises:
        PromptError: one line naming the folder or file and, for a class without (enough) descriptions, the class.
    """
    d = resolve_descriptions_dir(folder)
    if d is None:
        raise PromptError(f"{method} reads class descriptions from {file_name} in --descriptions-dir (or "
                          f"${DESCRIPTIONS_DIR_ENV}); neither is set ({where})")
    path = d / file_name
    if not path.is_file():
        raise PromptError(f"{method}: {path} does not exist; it needs the class descriptions of this dataset "
                          f"there ({where})")
    table = read_class_table(path)
    out, missing = match_class_table(table, class_names)
    loose = {class_key(k): k for k in reversed(list(table))}  # the first key of each loose name
    names = [loose.get(class_key(n), n) if n not in table else n for n in class_names]
    warnings = []
    if missing and by_position and len(table) == len(class_names):
        out, names = [list(v) for v in table.values()], list(table)
        warnings.append(f"{method}: {path.name} has no key for {len(missing)} of {len(class_names)} class names "
                        f"(e.g. {missing[0]!r}); its {len(table)} entries were paired with the classes by position")
    elif missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise PromptError(f"{method}: {path} has no descriptions for class {missing[0]!r}{more}")
    short = [(n, len(v)) for n, v in zip(names, out) if len(v) < need]
    if short:
        raise PromptError(f"{method}: {path}: class {short[0][0]!r} has {short[0][1]} description(s), {method} uses "
                          f"{need} per class{f' ({len(short) - 1} more classes have too few)' if len(short) > 1 else ''}")
    return Descriptions(str(path), tuple(names), tuple(tuple(v) for v in out), tuple(warnings))
