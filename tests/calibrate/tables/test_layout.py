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


def test_methods_at_a_glance_lists_every_registered_method_with_its_display_name():
    """Issue 32 item 12: docs/methods.md "The methods at a glance" has a row per registered method (not only the
    paper's), naming it as the tables do."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "methods.md").read_text()
    table = text.split("### The methods at a glance", 1)[1].split("\n### ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| ([^|]+?) \|", table, re.M)}
    assert list(rows) == list(METHOD_KEYS)  # every method, in the registry's order
    assert rows == {k: layout.METHOD_LABELS[k] for k in METHOD_KEYS}
