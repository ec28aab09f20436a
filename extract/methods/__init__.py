"""Test-time adaptation methods: one registry, one class per method (see `base.TTAMethod`).

Adding a method is one new module plus one entry in `REGISTRY`; the tests are parametrised over it. The base class,
config and override helpers are imported from `extract.methods.base`, each method's names from its module.
"""

from __future__ import annotations

from extract.methods.atpt import ATPT
from extract.methods.awt import AWT
from extract.methods.batclip import BATCLIP
from extract.methods.base import TTAMethod
from extract.methods.bca import BCA
from extract.methods.boostadapter import BoostAdapter
from extract.methods.calip import CALIP
from extract.methods.clipartt import CLIPArTT
from extract.methods.cosmic import COSMIC
from extract.methods.dart import DART
from extract.methods.deyo import DeYO
from extract.methods.difftpt import DiffTPT
from extract.methods.dlae import DLAE
from extract.methods.dmn import DMN, DMNWeak
from extract.methods.dota import DOTA
from extract.methods.dpe import DPE
from extract.methods.dynaprompt import DynaPrompt
from extract.methods.ecalp import ECALP
from extract.methods.histpt import HisTPT
from extract.methods.mta import MTA
from extract.methods.oga import OGA
from extract.methods.onzeta import OnZeta
from extract.methods.promptalign import PromptAlign
from extract.methods.rlcf import RLCF
from extract.methods.rtpt import RTPT
from extract.methods.sar import SAR
from extract.methods.stata import StatA, StatAOnline
from extract.methods.tca import TCA
from extract.methods.tda import TDA
from extract.methods.tent import Tent
from extract.methods.tps import TPS
from extract.methods.tpt import CTPT, OTPT, TPT
from extract.methods.transclip import TransCLIP
from extract.methods.ttl import TTL
from extract.methods.watt import WATT
from extract.methods.zero import Zero
from extract.methods.zero_shot import ZeroShot
from extract.methods.zlap import ZLaP, ZLaPInductive

REGISTRY: dict[str, type[TTAMethod]] = {
    cls.key: cls for cls in (ZeroShot, TDA, DPE, DLAE, TPT, CTPT, OTPT, ATPT, TPS,
                             # TTA-VLM's methods, each with its section in docs/methods.md
                             Zero, MTA, OnZeta, ECALP, DMN, DMNWeak, BoostAdapter, RTPT, DynaPrompt, RLCF, TTL,
                             # docs/methods.md, "Methods inside the image encoder, training-free (CALIP, TCA)":
                             CALIP, TCA,
                             # prompt tuning with history, averaging or descriptions
                             HisTPT, DART, AWT,
                             # the field's training-free online methods, each with its section in docs/methods.md
                             DOTA, OGA, BCA,
                             # methods that need a second pretrained model (docs/methods.md,
                             # "Methods that need a second pretrained model (DiffTPT, PromptAlign, COSMIC)")
                             DiffTPT, PromptAlign, COSMIC,
                             # transductive: each row solved jointly with its unit
                             # (docs/methods.md, "Transductive methods (StatA, TransCLIP, ZLaP)")
                             StatA, StatAOnline, TransCLIP, ZLaP, ZLaPInductive,
                             # methods that adapt the image encoder over batches of test images (consume
                             # "batch_pixels"), each with its section in docs/methods.md
                             Tent, SAR, DeYO, BATCLIP,
                             # per batch, reset before each batch:
                             # docs/methods.md, "Methods that adapt the image encoder per batch (WATT, CLIPArTT)"
                             WATT, CLIPArTT)
}


def get_method(key: str) -> type[TTAMethod]:
    """The method class registered under `key`.

    Raises:
        ValueError: unknown key; the message lists the available ones.
    """
    try:
        return REGISTRY[key]
    except KeyError:
        raise ValueError(f"unknown method {key!r}; available: {', '.join(REGISTRY)}") from None
