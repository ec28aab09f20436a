"""Every import inside the project points down (issue 28): no import circle, the two stages keep their contract, the
core never imports the tools beside it, and every name is imported from the module that defines it.

The graph is read from the source with `ast`, without importing anything. Its nodes are the modules of the
project's packages (extract, calibrate, schemas, tools); an arrow A -> B means module A imports module B:

- every `import` statement counts, at module level, inside functions and classes, and under `if TYPE_CHECKING:`
  (an import only a type checker runs is still a dependency a reader has to follow, and a circle through one
  turns into a real one the day the annotation is needed at run time);
- `from pkg import name` points at the submodule `pkg.name` when it is one, else at `pkg` (where `name` is
  defined); relative imports are resolved against the importing module;
- importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`, but those implicit arrows are not counted:
  a package's `__init__` that imports its own submodules (a registry, say) would otherwise make every submodule
  that imports a sibling a circle, which Python resolves without trouble (the sibling is loaded by then).

A circle is reported as the list of modules it runs through, each file with the line of the import that closes it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("extract", "calibrate", "schemas", "tools")
#: the packages the CPU stage (calibrate/, schemas/) must never import: the GPU stack, the extraction stage and the
#: tools beside the core (docs/architecture.md, "Two stages")
GPU_STACK = ("torch", "torchvision", "open_clip", "extract", "tools")


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` file of the project's packages (`pkg/__init__.py` is `pkg`)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _base(module: str, level: int, target: str | None, modules: dict[str, Path]) -> str:
    """The absolute module named by `from <level dots><target> import ...` inside `module`."""
    if level == 0:
        return target or ""
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{target}" if target else package


def imports_of(module: str, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in `module`'s file, outside modules included (dotted names).

    `from pkg import name` yields `pkg.name` when that is a project module, else `pkg`.
    """
    tree = ast.parse(modules[module].read_text(encoding="utf-8"), filename=str(modules[module]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node.level, node.module, modules)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in modules else base), node.lineno


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported project module: first line importing it}; arrows to outside modules are dropped."""
    graph: dict[str, dict[str, int]] = {}
    for module in modules:
        arrows: dict[str, int] = {}
        for target, line in imports_of(module, modules):
            if target in modules and target != module:
                arrows.setdefault(target, line)
        graph[module] = arrows
    return graph


def tangles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan): modules that all reach each other.

    Returns:
        One sorted list of modules per component, the components sorted. Empty when every import points down.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per tangle: a shortest closed path [m0, m1, ..., m0] along arrows, from its first module."""
    return [circle_through(graph, set(c), c[0]) for c in tangles(graph)]


def circle_through(graph: dict[str, dict[str, int]], component: set[str], start: str) -> list[str]:
    """A shortest closed path from `start` back to it inside `component` (breadth-first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in component:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a component without a circle back to it")


def imports_into(modules: dict[str, Path], sources: tuple[str, ...], targets: tuple[str, ...],
                 root: Path = REPO) -> list[str]:
    """`file:line imports target` for every import, anywhere in a module of the packages `sources`, of a module of
    the top-level packages `targets` (outside ones too: `torch`, `open_clip.model`)."""
    return [f"{modules[m].relative_to(root)}:{line} imports {target}"
            for m in modules if m.split(".")[0] in sources
            for target, line in imports_of(m, modules) if target.split(".")[0] in targets]


def defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (def, class, assignment, also under if/try/with/for), not those it
    imports."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                names.update(x.id for t in targets for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, ast.Try):
                for part in (n.body, n.orelse, n.finalbody, *(h.body for h in n.handlers)):
                    visit(part)
            elif isinstance(n, (ast.If, ast.With, ast.For, ast.While)):
                visit(n.body)
                visit(getattr(n, "orelse", []))

    visit(tree.body)
    return names


def forwarded_imports(modules: dict[str, Path], importers: dict[str, Path], root: Path = REPO) -> list[str]:
    """`file:line imports NAME from MODULE` for every `from MODULE import NAME` (in any of `importers`: module name
    -> file) where MODULE is a project module that does not define NAME and NAME is no submodule of it: the name is
    taken through a module that only imported it, not from its home."""
    defined = {m: defined_names(ast.parse(p.read_text(encoding="utf-8"))) for m, p in modules.items()}
    found = []
    for importer, path in importers.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _base(importer, node.level, node.module, modules) if importer in modules else node.module or ""
            found += [f"{path.relative_to(root)}:{node.lineno} imports {a.name} from {base}, which does not define it"
                      for a in node.names
                      if base in modules and f"{base}.{a.name}" not in modules and a.name not in defined[base]]
    return found


def describe(circle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path], root: Path = REPO) -> str:
    """One line per arrow of a circle: `extract/a.py:12 imports extract.b`."""
    return "\n".join(f"  {modules[a].relative_to(root)}:{graph[a][b]} imports {b}" for a, b in zip(circle, circle[1:]))


# ---------------------------------------------------------------------------------------------------------------------
# the reader itself, on small trees written here


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    return project_modules(tmp_path)


def test_reader_resolves_submodules_relative_imports_and_hidden_imports(tmp_path):
    modules = _tree(tmp_path, {
        "extract/__init__.py": "",
        "extract/low.py": "X = 1\n",
        "extract/run/__init__.py": "",
        "extract/run/top.py": "from extract import low\nfrom . import sib\nfrom ..low import X\n",
        "extract/run/sib.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from extract.run.top import Y\ndef f():\n    import extract.low\n"),
        "calibrate/__init__.py": "", "schemas/__init__.py": "", "tools/__init__.py": "",
    })
    graph = import_graph(modules)
    assert graph["extract.run.top"] == {"extract.low": 1, "extract.run.sib": 2}
    assert graph["extract.run.sib"] == {"extract.run.top": 3, "extract.low": 5}
    assert find_cycles(graph) == [["extract.run.sib", "extract.run.top", "extract.run.sib"]]


def test_reader_names_a_long_circle_and_ignores_imports_that_point_down(tmp_path):
    modules = _tree(tmp_path, {
        "extract/__init__.py": "from extract.a import A\n",  # a package importing its submodule: no circle
        "extract/a.py": "from extract.b import B\nimport numpy\n",
        "extract/b.py": "from extract.c import C\n",
        "extract/c.py": "def late():\n    from extract.a import A\n",
        "extract/d.py": "from extract import c\n",
        "calibrate/__init__.py": "", "schemas/__init__.py": "", "tools/__init__.py": "",
    })
    graph = import_graph(modules)
    assert find_cycles(graph) == [["extract.a", "extract.b", "extract.c", "extract.a"]]
    assert tangles(graph) == [["extract.a", "extract.b", "extract.c"]]
    text = describe(["extract.a", "extract.b", "extract.c", "extract.a"], graph, modules, tmp_path)
    assert text.splitlines() == ["  extract/a.py:1 imports extract.b", "  extract/b.py:1 imports extract.c",
                                 "  extract/c.py:2 imports extract.a"]
    del graph["extract.c"]["extract.a"]
    assert find_cycles(graph) == []


def test_reader_finds_an_upward_import_hidden_in_a_function(tmp_path):
    modules = _tree(tmp_path, {
        "extract/__init__.py": "", "schemas/__init__.py": "", "tools/__init__.py": "",
        "calibrate/__init__.py": "import numpy\n",
        "calibrate/run.py": "from schemas import shard\ndef f():\n    import torch.nn\n    from tools import bench\n",
        "calibrate/cli.py": "def g():\n    from extract.models import load_model\n",
        "tools/bench.py": "import extract\n",
    })
    assert imports_into(modules, ("calibrate",), GPU_STACK, tmp_path) == [
        "calibrate/cli.py:2 imports extract.models", "calibrate/run.py:3 imports torch.nn",
        "calibrate/run.py:4 imports tools.bench"]
    assert imports_into(modules, ("extract", "calibrate", "schemas"), ("tools",), tmp_path) == [
        "calibrate/run.py:4 imports tools.bench"]
    assert imports_into(modules, ("schemas",), GPU_STACK, tmp_path) == []


def test_reader_finds_a_name_taken_through_a_module_that_only_imported_it(tmp_path):
    modules = _tree(tmp_path, {
        "extract/__init__.py": "", "calibrate/__init__.py": "", "tools/__init__.py": "",
        "schemas/__init__.py": "from schemas.shard import read_shard\n",  # a forwarding package face
        "schemas/shard.py": "from pathlib import Path\nif True:\n    VERSION = 1\ndef read_shard(): ...\n",
        "extract/run.py": "from schemas import read_shard\nfrom schemas.shard import VERSION, read_shard, Path\n"
                          "from schemas import shard\n",
    })
    assert forwarded_imports(modules, modules, tmp_path) == [
        "extract/run.py:1 imports read_shard from schemas, which does not define it",
        "extract/run.py:2 imports Path from schemas.shard, which does not define it"]


# ---------------------------------------------------------------------------------------------------------------------
# the project


def test_no_import_circle_inside_the_project():
    modules = project_modules()
    graph = import_graph(modules)
    found = [(t, circle_through(graph, set(t), t[0])) for t in tangles(graph)]
    assert not found, "import circles (every import must point down; docs/architecture.md, \"Floors\"):\n" + "\n".join(
        f"{len(t)} modules reach each other ({', '.join(t)}), e.g. {' -> '.join(c)}:\n{describe(c, graph, modules)}"
        for t, c in found)


@pytest.mark.parametrize("stage", ["calibrate", "schemas"])
def test_cpu_stage_imports_neither_the_gpu_stack_nor_the_tools(stage):
    """calibrate/ and schemas/ read shards through `schemas` only (the two-stage contract), in every import
    statement, including those inside functions that a run may never reach (test_cli.py checks a whole run at
    run time; this checks every line)."""
    bad = imports_into(project_modules(), (stage,), GPU_STACK)
    assert not bad, "\n".join(bad)


def test_the_core_never_imports_the_tools():
    """tools/ (benchmarks, checks, the demo) sits beside the core: extract/, calibrate/ and schemas/ run without it."""
    bad = imports_into(project_modules(), ("extract", "calibrate", "schemas"), ("tools",))
    assert not bad, "\n".join(bad)


def test_every_name_is_imported_from_its_home():
    """A name has one home and is imported from there (docs/architecture.md, "Floors"): no module of the project or
    of the tests takes a project name through a module that only imported it (a re-export)."""
    modules = project_modules()
    tests = {"tests." + ".".join(p.relative_to(REPO / "tests").with_suffix("").parts): p
             for p in sorted((REPO / "tests").rglob("*.py"))}
    bad = forwarded_imports(modules, {**modules, **tests})
    assert not bad, "import each name from the module that defines it:\n" + "\n".join(bad)


def test_no_test_module_imports_another():
    """Helpers several test files share live in tests/support/ (docs/architecture.md, "Tests"); a test module
    importing another (issue 35 item 13: test_ood.py took its stand-in method from test_runner.py) runs that
    module's imports and ties the two files together."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if "support" in path.relative_to(REPO / "tests").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                      if n.startswith("tests.") and not n.startswith("tests.support")]
    assert found == [], "\n".join(found)
