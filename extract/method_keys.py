"""The method registry's keys, in its order, for text that must not import torch (command-line help): outside
the `extract.methods` package, whose import loads every method and torch.

`extract.methods.REGISTRY` is the source of truth; tests/extract/test_methods.py checks that this tuple equals its
keys, so a method added to the registry without its key here fails the tests.
"""

METHOD_KEYS: tuple[str, ...] = (
    "zero-shot", "tda", "dpe", "dlae", "tpt", "ctpt", "otpt", "atpt", "tps",
    "zero", "mta", "onzeta", "ecalp", "dmn", "dmn-weak", "boostadapter", "rtpt", "dynaprompt", "rlcf",
    "ttl",
    "calip", "tca",
    "histpt", "dart", "awt",
    "dota", "oga", "bca",
    "difftpt", "promptalign", "cosmic",
    "stata", "stata-online", "transclip", "zlap", "zlap-inductive",
    "tent", "sar", "deyo", "batclip",
    "watt", "clipartt",
)
