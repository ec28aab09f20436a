"""Comments cite the repository, never a document outside it, and what they cite exists.

* No Python file of the packages or tests, and no page of docs/ or the README, points at the project's internal
  methods spec (its section numbers or its file names): the facts live in docs/methods.md.
* Every citation `docs/methods.md, "<heading>"` (or several headings after one path) names a heading of
  docs/methods.md; a citation whose heading is missing or split over two lines fails.
* The contents list of docs/methods.md links to headings that exist.
* The per-dataset tables of docs/methods.md ("Per-dataset settings") equal what `default_config` returns, so the
  page cannot drift from the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    raise RuntimeError(f"no pyproject.toml above {here}")


ROOT = _repo_root()
METHODS_MD = ROOT / "docs" / "methods.md"
CODE_DIRS = ("extract", "calibrate", "schemas", "tools", "tests")
# Built from parts so that this file does not match itself.
SECTION_SIGN = "\N{SECTION SIGN}"
FORBIDDEN = ("spec " + SECTION_SIGN, "Spec " + SECTION_SIGN, "tta_methods" + ".md", "atpt_soc" + ".md",
             "shared" + "/reference")  # the reference folder beside the checkout is not part of the repository
CITED_PATH = "docs/methods" + ".md"


def _code_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert files, f"no Python files under {CODE_DIRS} in {ROOT}"
    return files


def _doc_files() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------------------ parsing

_OPEN = re.compile(r"`?(,|\s*\()")  # what follows the path in a citation: "," or " ("
_SEPARATOR = re.compile(r"(?:[\s,;#]|\band\b)*")  # between headings: commas, "and", line breaks, comment marks


def citations(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """Cited headings and malformed citations in `text`.

    A citation is the path followed by "," or "(" and one or more double-quoted headings, separated by commas,
    semicolons, "and" or line breaks (a comment may go on over several lines). A mention of the path without "," or
    "(" after it is prose, not a citation.

    Returns:
        ([(line, heading)], [(line, problem)]), lines 1-based.
    """
    found: list[tuple[int, str]] = []
    bad: list[tuple[int, str]] = []
    for m in re.finditer(re.escape(CITED_PATH), text):
        line = text.count("\n", 0, m.start()) + 1
        opening = _OPEN.match(text, m.end())
        if opening is None:
            continue
        pos, n = opening.end(), 0
        while True:
            pos = _SEPARATOR.match(text, pos).end()
            if pos >= len(text) or text[pos] != '"':
                break
            end = text.find('"', pos + 1)
            heading = text[pos + 1:end] if end > 0 else text[pos + 1:]
            if end < 0 or "\n" in heading:
                bad.append((line, f"heading split over lines or unterminated: {heading.splitlines()[0]!r}"))
                n = -1
                break
            found.append((line, heading))
            pos, n = end + 1, n + 1
        if n == 0:
            bad.append((line, f"{CITED_PATH}{opening.group(0)} is not followed by a double-quoted heading"))
    return found, bad


def headings(markdown: str) -> list[str]:
    """ATX headings (`#` to `######`) outside fenced code blocks, without the marks."""
    out, fenced = [], False
    for raw in markdown.splitlines():
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", raw)
        if m and not fenced:
            out.append(m.group(1))
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than "-" and "_" dropped, spaces to "-"."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def table_after(markdown: str, name: str) -> list[dict[str, str]]:
    """Rows of the Markdown table right after `<!-- table:name -->`, as header -> cell (backticks removed)."""
    lines = markdown.splitlines()
    marker = f"<!-- table:{name} -->"
    assert marker in lines, f"{_rel(METHODS_MD)}: no {marker}"
    i = lines.index(marker) + 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([c.strip().replace("`", "") for c in lines[i].strip().strip("|").split("|")])
        i += 1
    header, sep, *body = rows
    assert set("".join(sep)) <= set("-: "), f"table {name}: second row is not a separator"
    return [dict(zip(header, r, strict=True)) for r in body]


# ------------------------------------------------------------------------------------------ the parser itself

def test_citation_parser_on_known_text():
    p = CITED_PATH
    text = (f'x = 1  # ({p}, "A")\n'
            f'"""Several: {p}, "B", "C" and "D"; then prose "E" is not one.\n'
            f'    * list: {p}, "F";\n'
            f'    # ({p},\n'
            f'    # "G")\n'
            f'{p} records the facts: "H" is prose.\n'
            f'(`{p}`, "I")\n'
            f'broken: {p}, "J\n'
            f'   K"\n'
            f'missing: {p}, see above\n')
    found, bad = citations(text)
    assert found == [(1, "A"), (2, "B"), (2, "C"), (2, "D"), (3, "F"), (4, "G"), (7, "I")]
    assert [line for line, _ in bad] == [8, 10]


def test_anchor_matches_github():
    assert anchor("DPE/DLAE numerics") == "dpedlae-numerics"
    assert anchor("TDA's file-listing quirk (sh_filter)") == "tdas-file-listing-quirk-sh_filter"
    assert anchor("A-TPT: angular diversity and its two signs") == "a-tpt-angular-diversity-and-its-two-signs"


# ------------------------------------------------------------------------------------------ the repository

def test_no_reference_to_the_internal_spec():
    hits = []
    for path in _code_files() + _doc_files():
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{_rel(path)}:{i}: {word!r}" for word in FORBIDDEN if word in line]
    assert not hits, ("cite docs/methods.md sections or an official repository's file instead:\n"
                      + "\n".join(hits))


def test_every_cited_heading_exists():
    known = set(headings(METHODS_MD.read_text(encoding="utf-8")))
    me = Path(__file__).resolve()
    problems, n = [], 0
    for path in _code_files() + [d for d in _doc_files() if d != METHODS_MD]:
        if path.resolve() == me:
            continue
        found, bad = citations(path.read_text(encoding="utf-8"))
        n += len(found)
        problems += [f"{_rel(path)}:{line}: no heading {h!r} in {CITED_PATH}" for line, h in found if h not in known]
        problems += [f"{_rel(path)}:{line}: {why}" for line, why in bad]
    assert not problems, "\n".join(problems)
    assert n >= 40  # the comments do cite the page; a parser that found nothing would pass vacuously


def test_promised_headings_exist():
    known = headings(METHODS_MD.read_text(encoding="utf-8"))
    for h in ("Stream order and seeds", "TDA's file-listing quirk (sh_filter)", "DPE/DLAE numerics",
              "Per-dataset settings", "Execution-only knobs", "Settings for unseen data"):
        assert known.count(h) == 1, h


def test_contents_links_resolve():
    text = METHODS_MD.read_text(encoding="utf-8")
    anchors = {anchor(h) for h in headings(text)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 25
    missing = sorted(set(links) - anchors)
    assert not missing, f"{_rel(METHODS_MD)}: links to missing headings: {missing}"


# ------------------------------------------------------------------------------------------ tables == code

def _views(cfg) -> str:
    return "1" if cfg.n_views == 1 else f"{cfg.n_views} {'AugMix' if cfg.augmix else 'crop+flip'}"


def _views_dual(cfg) -> str:
    return _views(cfg) + (", all-view inference" if cfg.all_view_inference else "")


def _pair(cell: str) -> tuple[float, float]:
    rn, vit = cell.split("/")
    return float(rn), float(vit)


@pytest.fixture(scope="module")
def methods_md() -> str:
    return METHODS_MD.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def methods():
    pytest.importorskip("torch")
    from extract.methods import get_method
    from extract.methods.base import HPARAMS_KEYS

    return get_method, HPARAMS_KEYS


def _rows(methods_md: str, name: str, keys) -> list[dict[str, str]]:
    rows = table_after(methods_md, name)
    assert [r["dataset"] for r in rows] == list(keys), f"table {name}: rows are not HPARAMS_KEYS in order"
    return rows


def test_tda_table(methods_md, methods):
    get_method, keys = methods
    for r in _rows(methods_md, "tda", keys):
        c = get_method("tda").default_config(r["dataset"], "ViT-B-16")
        assert (float(r["alpha"]), float(r["beta"]), r["views"], r["prompts"]) == (
            c.alpha, c.beta, _views(c), c.prompts), r["dataset"]
        assert c == get_method("tda").default_config(r["dataset"], "RN50")


def test_dpe_table(methods_md, methods):
    get_method, keys = methods
    for r in _rows(methods_md, "dpe", keys):
        c = get_method("dpe").default_config(r["dataset"], "ViT-B-16")
        assert c.cupl and c.lr_text == c.lr_image
        assert (float(r["alpha"]), float(r["beta"]), float(r["lr"]), float(r["align"]), r["views"],
                r["prompts"]) == (c.alpha, c.beta, c.lr_text, c.align, _views_dual(c), f"{c.prompts} + CuPL"), r
        assert c == get_method("dpe").default_config(r["dataset"], "RN50")


def test_dlae_table(methods_md, methods):
    get_method, keys = methods
    for r in _rows(methods_md, "dlae", keys):
        rn = get_method("dlae").default_config(r["dataset"], "RN50")
        vit = get_method("dlae").default_config(r["dataset"], "ViT-B-16")
        for c in (rn, vit):
            assert (float(r["alpha"]), float(r["beta"]), float(r["lr_text"]), float(r["align"]), r["views"]) == (
                c.alpha, c.beta, c.lr_text, c.align, _views_dual(c)), r["dataset"]
        assert _pair(r["adjust_alpha RN / ViT"]) == (rn.adjust_alpha, vit.adjust_alpha), r["dataset"]
        assert _pair(r["reflection_alpha RN / ViT"]) == (rn.reflection_alpha, vit.reflection_alpha), r["dataset"]
        assert _pair(r["doubt_rate RN / ViT"]) == (rn.doubt_rate, vit.doubt_rate), r["dataset"]
        # the one backbone-dependent prompt fact the page states in words: no CuPL for ViT-B/16 on EuroSAT
        assert rn.cupl and vit.cupl == (r["dataset"] != "eurosat")


def test_episodic_table(methods_md, methods):
    get_method, keys = methods
    for r in _rows(methods_md, "episodic", keys):
        k = r["dataset"]
        tpt, tps = (get_method(m).default_config(k, "ViT-B-16") for m in ("tpt", "tps"))
        ctpt, otpt, atpt = (get_method(m).default_config(k, "ViT-B-16") for m in ("ctpt", "otpt", "atpt"))
        assert r["TPT, TPS views"] == _views(tpt) == _views(tps), k
        assert r["C-TPT, O-TPT, A-TPT views"] == _views(ctpt) == _views(otpt) == _views(atpt), k
        assert float(r["C-TPT λ"]) == ctpt.lambda_term and float(r["O-TPT λ"]) == otpt.lambda_term, k
        assert r["A-TPT λ (script)"] == f"{atpt.lambda_term:g} ({atpt.script})", k
        assert float(r["TPS lr"]) == tps.lr, k


def test_settings_for_unseen_data_lists_every_registered_method(methods_md):
    """docs/methods.md "Settings for unseen data" has one row per registered method (a row may name several keys),
    in the registry's order, each key once (`extract.method_keys.METHOD_KEYS`, torch-free)."""
    from extract.method_keys import METHOD_KEYS

    table = methods_md.split("### Settings for unseen data", 1)[1].split("\n### ", 1)[0]
    listed = [k for line in table.splitlines() if line.startswith("| `")
              for k in re.findall(r"`([^`]+)`", line.split("|")[1])]
    assert listed == list(METHOD_KEYS)
