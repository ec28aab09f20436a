"""Test-time adaptation methods: one registry, one class per method (see `base.TTAMethod`).

Adding a method is one new module plus one entry in `REGISTRY`; the tests are parametrised over it. The base class,
config and override helpers are imported from `extract.methods.base`, each method's names from its module.
"""

from __future__ import annotations

from extract.methods.atpt import ATPT
from extract.methods.base import TTAMethod
from extract.methods.boostadapter import BoostAdapter
from extract.methods.clipartt import CLIPArTT
from extract.methods.dlae import DLAE
from extract.methods.dmn import DMN, DMNWeak
from extract.methods.dpe import DPE
from extract.methods.dynaprompt import DynaPrompt
from extract.methods.ecalp import ECALP
from extract.methods.mta import MTA
from extract.methods.onzeta import OnZeta
from extract.methods.rlcf import RLCF
from extract.methods.rtpt import RTPT
from extract.methods.tda import TDA
from extract.methods.tent import Tent
from extract.methods.tps import TPS
from extract.methods.tpt import CTPT, OTPT, TPT
from extract.methods.ttl import TTL
from extract.methods.watt import WATT
from extract.methods.zero import Zero
from extract.methods.zero_shot import ZeroShot

REGISTRY: dict[str, type[TTAMethod]] = {
    cls.key: cls for cls in (ZeroShot, TDA, DPE, DLAE, TPT, CTPT, OTPT, ATPT, TPS,
                             # TTA-VLM's methods, each with its section in docs/methods.md
                             Zero, MTA, OnZeta, ECALP, DMN, DMNWeak, BoostAdapter, RTPT, DynaPrompt, RLCF, TTL,
                             # methods that adapt the image encoder over batches of test images (consume
                             # "batch_pixels"), each with its section in docs/methods.md
                             Tent,
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
