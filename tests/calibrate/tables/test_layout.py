"""`calibrate.tables.layout`: one display name per method, for every registered method (issue 32 item 9)."""

from __future__ import annotations

import pytest

from calibrate.tables import layout
from extract.method_keys import METHOD_KEYS  # torch-free: the registry's keys (tests/extract/test_methods.py)


@pytest.mark.parametrize("key", METHOD_KEYS)
def test_every_registered_method_has_a_display_name(key):
    assert key in layout.METHOD_LABELS, f"add {key!r} to calibrate/tables/layout.py METHOD_LABELS"
    assert layout.method_label(key) == layout.METHOD_LABELS[key]


def test_display_names_are_unique_and_unknown_keys_are_kept_as_spelt():
    names = [layout.METHOD_LABELS[k] for k in METHOD_KEYS]
    assert len(set(names)) == len(names)
    # a user's own method: its key, never re-cased (today's fallback upper-cased keys of <= 5 letters only)
    assert layout.method_label("mine") == "mine" and layout.method_label("my-long-method") == "my-long-method"
