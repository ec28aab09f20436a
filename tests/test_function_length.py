"""Functions stay short enough to read at once (issue 20): none over 80 lines in extract/, calibrate/, schemas/,
tools/.

Exempt: figure-drawing code (every function in calibrate/tables/figures.py, and functions named ``plot_*``), and a
function whose docstring has a line starting with ``Length:`` that says why it is longer. A function's length runs
from its ``def`` line to its last line (decorators excluded), nested functions included in their parent and also
checked on their own.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("extract", "calibrate", "schemas", "tools")
MAX_LINES = 80
#: files of figure-drawing code, exempt as a whole (paths relative to the repository root)
FIGURE_FILES = frozenset({"calibrate/tables/figures.py"})

#: (file, function) pairs over the limit that are being shortened on other branches right now; each is exempt until
#: that branch is merged, and then removed from here (`test_pending_entries_are_still_long` fails once one is short,
#: to say so). Empty this set once both merges are in.
PENDING = frozenset({
})


def _has_length_note(node: ast.AST) -> bool:
    """True when the docstring has a line ``Length: <why>`` (the reason must not be empty)."""
    doc = ast.get_docstring(node) or ""
    return any(line.strip().startswith("Length:") and line.strip()[len("Length:"):].strip()
               for line in doc.splitlines())


def long_functions(source: str, rel: str, limit: int = MAX_LINES) -> list[tuple[str, str, int, int]]:
    """(file, function, first line, length) of every function in ``source`` over ``limit`` lines, exemptions applied."""
    if rel in FIGURE_FILES:
        return []
    out = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = node.end_lineno - node.lineno + 1
        if n > limit and not node.name.startswith("plot_") and not _has_length_note(node):
            out.append((rel, node.name, node.lineno, n))
    return out


def _repo_offenders() -> list[tuple[str, str, int, int]]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            found += long_functions(path.read_text(encoding="utf-8"), rel)
    return found


def test_no_function_over_80_lines():
    offenders = [o for o in _repo_offenders() if (o[0], o[1]) not in PENDING]
    assert not offenders, (
        f"functions over {MAX_LINES} lines (split them into named steps, or say why in a 'Length:' docstring line):\n"
        + "\n".join(f"  {rel}:{line} {name}: {n} lines" for rel, name, line, n in offenders))


def test_pending_entries_are_still_long():
    long_now = {(rel, name) for rel, name, _, _ in _repo_offenders()}
    stale = sorted(PENDING - long_now)
    assert not stale, ("no longer over the limit (or gone): remove from PENDING in tests/test_function_length.py: "
                       + ", ".join(f"{rel} {name}" for rel, name in stale))


# ------------------------------------------------------------------------------------ the checker on known sources

def _function(name: str, n_lines: int, doc: str | None = None, indent: str = "") -> str:
    """Source of a function exactly ``n_lines`` long (def line included), optionally with a docstring."""
    body = [f'{indent}    """{doc}"""'] if doc is not None else []
    body += [f"{indent}    x = {i}" for i in range(n_lines - 1 - len(body))]
    return "\n".join([f"{indent}def {name}():", *body]) + "\n"


@pytest.mark.parametrize("n, flagged", [(79, False), (80, False), (81, True), (200, True)])
def test_checker_counts_def_to_last_line(n, flagged):
    src = _function("f", n)
    assert len(src.splitlines()) == n  # the reference: the source's own line count
    assert long_functions(src, "extract/x.py") == ([("extract/x.py", "f", 1, n)] if flagged else [])


def test_checker_decorators_excluded_and_nested_functions_checked():
    src = "@staticmethod\n@staticmethod\n" + _function("f", 80)  # decorators add lines but do not count
    assert long_functions(src, "calibrate/x.py") == []
    outer = "def outer():\n" + _function("inner", 81, indent="    ") + "    return inner\n"
    assert long_functions(outer, "calibrate/x.py") == [("calibrate/x.py", "outer", 1, 83),
                                                       ("calibrate/x.py", "inner", 2, 81)]
    method = "class C:\n" + _function("m", 90, indent="    ")
    assert long_functions(method, "schemas/x.py") == [("schemas/x.py", "m", 2, 90)]


def test_checker_exemptions():
    assert long_functions(_function("plot_curves", 120), "calibrate/x.py") == []
    assert long_functions(_function("f", 120), "calibrate/tables/figures.py") == []
    assert long_functions(_function("f", 120), "calibrate/tables/figures_more.py") != []
    noted = _function("f", 120, doc="Do it.\n\n    Length: one table spec, listed in the paper's order.\n    ")
    assert long_functions(noted, "extract/x.py") == []
    # the note must start a line and give a reason
    for doc in ("Do it. Length: because.", "Do it.\n\n    Length:\n    ", "Do it.\n\n    length: lower case.\n"):
        assert long_functions(_function("f", 120, doc=doc), "extract/x.py") != [], doc


def test_failure_message_names_file_function_and_length(monkeypatch):
    mod = sys.modules[__name__]
    fake = [("extract/big.py", "huge", 12, 99)]
    monkeypatch.setattr(mod, "_repo_offenders", lambda: fake)
    with pytest.raises(AssertionError, match=r"extract/big\.py:12 huge: 99 lines"):
        mod.test_no_function_over_80_lines()
