"""The import graph of dtp/ is the pipeline: one package per stage, ORDER lists the stages bottom
up.

An import may only point down to a lower level: never up, never sideways between packages on one
level, never in a circle between module files, never to a private name of another module. An import
sits at the top of its module, except on the torch-free path (`dtp --help`, `dtp fmt`, `dtp check
PLAN`) and for an optional package. docs/architecture.md explains the layers, in ORDER, and names
every module. The sources are read as text (ast); nothing from dtp is imported.
"""

from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ORDER: list[tuple[str, ...]] = [  # lower first; one tuple per level
    ("errors",),  # top-level modules dtp/errors.py and dtp/files.py
    ("files",),
    ("lang", "models"),
    ("layout",),
    ("checks",),
    ("cost", "compiler"),
    ("runtime",),
    ("verify", "checkpoint", "simulate"),
    ("train", "hf", "fuzz", "auto", "generate"),
    ("bench",),
    ("cli",),
]
# dtp/__init__.py (the face) and dtp/__main__.py: they may import anything, nothing imports them
TOP = len(ORDER)
LEVEL = {part: i for i, level in enumerate(ORDER) for part in level} | {
    "face": TOP,
    "__main__": TOP,
}
MAX_TOP_MODULES = 6
MAX_INIT_LINES = 40
INIT_EXEMPT: set[str] = set()  # packages whose __init__.py need not be a small face (none)
# violations tolerated while the code moves into this layout; must shrink to empty
ALLOWED: set[str] = set()
# `python -m dtp` and the console script (dtp.cli:entry)
TORCH_FREE_ROOTS = ("dtp.__main__", "dtp.cli")
# pyproject's, and dtp
HARD_DEPENDENCIES = {"torch", "lark", "yaml", "numpy", "tqdm", "hypothesis", "dtp"}
# function-level imports in all of dtp/ (torch-free path and optional packages)
MAX_FUNCTION_IMPORTS = 60
LATE = (
    "imported inside a function (move it to the top: only the torch-free CLI path and optional "
    "packages "
    "import late)"
)


class Edge(NamedTuple):
    """One import: module `source` imports module `target` at `line`, taking `names` from it."""

    source: str
    target: str
    line: int
    names: tuple[str, ...] = ()


def modules(root: Path) -> dict[str, Path]:
    """Every module under root/dtp by dotted name (a package by its __init__.py), relative to root."""
    found = {}
    for path in sorted((root / "dtp").rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = rel
    return found


def part(module: str) -> str:
    """The stage a module belongs to: the second component (`dtp.layout.resolve` -> layout; dtp ->
    face)."""
    return module.split(".")[1] if "." in module else "face"


def _longest(name: str, mods: dict[str, Path]) -> str:
    """The longest prefix of a dotted name that is a module (else the face, dtp)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts) or "dtp"


def _edges(module: str, rel: Path, node: ast.AST, mods: dict[str, Path]) -> list[Edge]:
    """The edges of one import statement of `module` (file rel)."""
    if isinstance(node, ast.Import):
        return [
            Edge(module, _longest(a.name, mods), node.lineno)
            for a in node.names
            if a.name == "dtp" or a.name.startswith("dtp.")
        ]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: against the file's package
        package = module.split(".") if rel.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        if not package:
            return []
        base = ".".join(package + ([node.module] if node.module else []))
    if base != "dtp" and not base.startswith("dtp."):
        return []
    names = [a.name for a in node.names]
    subs = [n for n in names if f"{base}.{n}" in mods]
    rest = tuple(n for n in names if n not in subs)
    edges = [Edge(module, f"{base}.{n}", node.lineno) for n in subs]
    return edges + ([Edge(module, _longest(base, mods), node.lineno, rest)] if rest else [])


def imports(root: Path) -> list[Edge]:
    """Every import of dtp in every module under root/dtp, function-level ones included."""
    mods = modules(root)
    return [
        edge
        for module, rel in mods.items()
        for node in ast.walk(ast.parse((root / rel).read_text(), str(rel)))
        for edge in _edges(module, rel, node, mods)
    ]


def _circles(edges: list[Edge]) -> list[str]:
    """One line per strongly connected component of more than one module: its shortest cycle."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    lines, done = [], set()
    for start in sorted(graph):
        comp = {m for m in reach[start] if start in reach.get(m, ())}
        if start in done or not comp:
            continue
        done |= comp
        prev, queue, cycle = {}, [start], []
        for node in queue:  # breadth first: the shortest way from start back to start
            for nxt in sorted(graph[node] & comp):
                if nxt == start and not cycle:
                    cycle = [node]
                    while cycle[-1] != start:
                        cycle.append(prev[cycle[-1]])
                elif nxt not in prev and nxt != start:
                    prev[nxt] = node
                    queue.append(nxt)
        more = len(comp) - len(cycle)
        lines.append(
            "circle: "
            + " -> ".join(cycle[::-1] + [start])
            + (f" (+{more} more modules in the same circle)" if more else "")
        )
    return lines


def _structure(root: Path, mods: dict[str, Path]) -> list[str]:
    """Top-level module count, small documented package faces, every module in a known part."""
    lines = []
    # dtp/*.py, __init__ and __main__ included
    top = [rel for rel in mods.values() if len(rel.parts) == 2]
    if len(top) > MAX_TOP_MODULES:
        lines.append(f"dtp/: {len(top)} top-level modules (at most {MAX_TOP_MODULES})")
    for folder in sorted({rel.parent for rel in mods.values()}):
        if not (root / folder / "__init__.py").exists():
            lines.append(f"{folder.as_posix()}/: no __init__.py")
    for module, rel in mods.items():
        if rel.name != "__init__.py" or module in INIT_EXEMPT:
            continue
        text = (root / rel).read_text()
        tree = ast.parse(text)
        if len(text.splitlines()) > MAX_INIT_LINES:
            lines.append(
                f"{rel.as_posix()}: {len(text.splitlines())} lines (at most {MAX_INIT_LINES})"
            )
        if ast.get_docstring(tree) is None:
            lines.append(f"{rel.as_posix()}: no module docstring")
        targets = [
            t
            for n in tree.body
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        ]
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            lines.append(f"{rel.as_posix()}: no __all__")
        # `from dtp.lang import parse` must give the module, never a function it holds
        for node in tree.body:
            for alias in node.names if isinstance(node, ast.ImportFrom) else ():
                bound = alias.asname or alias.name
                if (
                    f"{module}.{bound}" in mods
                    and node.module != f"{module}.{bound}".rpartition(".")[0]
                ):
                    lines.append(
                        f"{rel.as_posix()}:{node.lineno}: the face binds '{bound}', "
                        f"hiding its submodule {module}.{bound}"
                    )
    for name in sorted({part(m) for m in mods} - set(LEVEL)):
        first = min(rel.as_posix() for m, rel in mods.items() if part(m) == name)
        lines.append(f"{first}: {name} is in no level of ORDER (add it there on purpose)")
    return lines


def violations(root: Path) -> list[str]:
    """Every breach of the layer rules in root/dtp, one human-readable line each."""
    mods, edges, lines = modules(root), imports(root), []
    for e in edges:
        where = f"{mods[e.source].as_posix()}:{e.line}"
        sp, tp = part(e.source), part(e.target)
        for name in e.names:
            if name.startswith("_") and not name.startswith("__") and e.target != e.source:
                lines.append(f"{where}: private name {name} imported from {e.target}")
        if tp == "cli" and sp not in ("cli", "__main__"):
            lines.append(f"{where}: imports {e.target} (only dtp/cli/ and dtp/__main__.py may)")
        elif sp != tp and sp in LEVEL and tp in LEVEL and LEVEL[sp] < TOP:
            sl, tl = LEVEL[sp], LEVEL[tp]
            if tl > sl:
                lines.append(
                    f"{where}: upward import of {e.target} ({tp}, level {tl}) from {sp} (level "
                    f"{sl})"
                )
            elif tl == sl:
                lines.append(
                    f"{where}: sibling import of {e.target} ({tp}) from {sp} (both level {sl})"
                )
    return lines + _circles(edges) + _structure(root, mods)


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports for annotations only, never run."""
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Name)
        and test.id == "TYPE_CHECKING"
        or isinstance(test, ast.Attribute)
        and test.attr == "TYPE_CHECKING"
    )


def _top_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs when it is imported: its body, `if`/`try` blocks
    included, not the functions' and classes' bodies, nor `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            found += _top_imports(node.body) + _top_imports(node.orelse)
        elif isinstance(node, ast.Try):
            found += _top_imports(node.body + node.orelse + node.finalbody)
            found += [n for h in node.handlers for n in _top_imports(h.body)]
    return found


def torch_free(root: Path) -> set[str]:
    """The modules the CLI loads before any command runs (TORCH_FREE_ROOTS and all that their
    top-level imports reach, each package's face with its modules): `dtp --help`, `dtp fmt` and `dtp
    check PLAN` import no torch (tests/cli/test_lazy_imports.py), so torch is imported inside their
    functions."""
    mods, seen = modules(root), set()
    todo = list(TORCH_FREE_ROOTS)
    while todo:
        module = todo.pop()
        if module in seen or module not in mods:
            continue
        seen.add(module)
        tree = ast.parse((root / mods[module]).read_text())
        for node in _top_imports(tree.body):
            for edge in _edges(module, mods[module], node, mods):
                # importing dtp.lang.ir runs dtp/__init__ and dtp/lang/__init__
                parts = edge.target.split(".")
                todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return seen


class FunctionImport(NamedTuple):
    """An import statement inside a function: `module` (file `rel`) imports `names` at `line`;
    `packages` are their top-level names (dtp for a relative import)."""

    module: str
    rel: Path
    line: int
    names: tuple[str, ...]
    packages: tuple[str, ...]


def function_imports(root: Path) -> list[FunctionImport]:
    """Every import statement inside a function body (methods and nested functions included) under
    root/dtp."""
    found = set()
    for module, rel in modules(root).items():
        tree = ast.parse((root / rel).read_text(), str(rel))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            # a nested function's imports are found again from the outer one: a set
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = tuple(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    names = ("." * node.level + (node.module or ""),)
                else:
                    continue
                packages = tuple("dtp" if n.startswith(".") else n.split(".")[0] for n in names)
                found.add(FunctionImport(module, rel, node.lineno, names, packages))
    return sorted(found)


def optional(package: str) -> bool:
    """A package dtp runs without: neither the standard library nor a dependency pyproject requires."""
    return package not in HARD_DEPENDENCIES and package not in sys.stdlib_module_names


def misplaced_imports(root: Path) -> list[str]:
    """One line per import inside a function that belongs at the top of its module: neither on the
    torch-free path nor of optional packages only."""
    free = torch_free(root)
    return [
        f"{imp.rel.as_posix()}:{imp.line}: {', '.join(imp.names)} {LATE}"
        for imp in function_imports(root)
        if imp.module not in free and not all(map(optional, imp.packages))
    ]


def documented(root: Path) -> tuple[set[str], list[tuple[str, ...]]]:
    """What docs/architecture.md states: the module files its tree names (a package line `dtp/x/`
    names `dtp/x/__init__.py`; an indented line names the files of the package above it) and the
    layer order, the code block that starts with `errors` (`a  <  b, c  <  …`, bottom up)."""
    text = (root / "docs" / "architecture.md").read_text()
    blocks = text.split("```")[1::2]
    listed: set[str] = set()
    package = None
    for line in next((b for b in blocks if "dtp/__init__.py" in b), "").splitlines():
        if line.startswith("dtp/"):
            name = line.split()[0]
            package = name if name.endswith("/") else None
            listed.add(name + "__init__.py" if package else name)
        # `  ir.py  what it holds`, or several: `  check.py fmt.py`
        elif line.startswith("  ") and package:
            listed |= {
                package + w for w in itertools.takewhile(lambda w: w.endswith(".py"), line.split())
            }
        elif line and not line.startswith(" "):
            package = None
    order = next((b for b in blocks if b.strip().startswith("errors")), "")
    levels = [
        tuple(p.strip() for p in level.split(",")) for level in " ".join(order.split()).split("<")
    ]
    return listed, levels


def doc_drift(root: Path) -> list[str]:
    """Where docs/architecture.md and dtp/ disagree: a module it does not name, a name with no
    module, the order."""
    listed, levels = documented(root)
    actual = {rel.as_posix() for rel in modules(root).values()}
    lines = [f"docs/architecture.md does not name {rel}" for rel in sorted(actual - listed)]
    lines += [
        f"docs/architecture.md names {rel}, which does not exist" for rel in sorted(listed - actual)
    ]
    if levels != ORDER:
        lines.append(f"docs/architecture.md's layer order {levels} is not ORDER {ORDER}")
    return lines


def repo_root() -> Path:
    """The nearest directory above this file that holds pyproject.toml."""
    return next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())


def test_dtp_imports_point_down() -> None:
    """The real dtp/ breaks no layer rule beyond the ALLOWED migration list."""
    found = [v for v in violations(repo_root()) if v not in ALLOWED]
    assert not found, f"{len(found)} layer violations:\n" + "\n".join(found)


def test_allowed_is_not_stale() -> None:
    """Every ALLOWED entry still occurs: fixed ones must leave the list."""
    stale = ALLOWED - set(violations(repo_root())) if ALLOWED else set()
    assert not stale, "fixed, remove from ALLOWED:\n" + "\n".join(sorted(stale))


def test_function_level_imports_only_where_needed() -> None:
    """An import inside a function is on the torch-free CLI path or of an optional package; any
    other is at the top of its module, where a reader sees what the module needs."""
    found = misplaced_imports(repo_root())
    assert not found, f"{len(found)} function-level imports belong at the top:\n" + "\n".join(found)


def test_function_level_imports_stay_few() -> None:
    """At most MAX_FUNCTION_IMPORTS function-level imports in all of dtp/."""
    found = function_imports(repo_root())
    by_file: dict[str, int] = {}
    for imp in found:
        by_file[imp.rel.as_posix()] = by_file.get(imp.rel.as_posix(), 0) + 1
    shown = "\n".join(f"{n:3d} {rel}" for rel, n in sorted(by_file.items(), key=lambda kv: -kv[1]))
    assert len(found) <= MAX_FUNCTION_IMPORTS, f"{len(found)} function-level imports:\n{shown}"


def test_architecture_doc_names_every_module_and_the_order() -> None:
    """docs/architecture.md names every module of dtp/ (and none that is gone) and states ORDER."""
    found = doc_drift(repo_root())
    assert not found, "\n".join(found)


FACE = '"""A face."""\n__all__: list[str] = []\n'
CLEAN = {
    "dtp/__init__.py": FACE + "from dtp.checks import run\nfrom dtp import errors\n",
    "dtp/__main__.py": "from dtp.cli import main\n",
    "dtp/errors.py": '"""Errors."""\n',
    **{
        f"dtp/{p}/__init__.py": FACE
        for p in ("lang", "runtime", "cost", "compiler", "checks", "verify", "cli")
    },
    "dtp/lang/ir.py": "from dtp.errors import PlanError\n",
    "dtp/runtime/build.py": "from dtp.compiler import emit\nfrom dtp.errors import __doc__, PlanError\n",
    "dtp/compiler/emit.py": "from .. import errors\n",
    "dtp/checks/__init__.py": FACE + "from .heads import run\n",
    # a sibling module, not the face
    "dtp/checks/heads.py": "from dtp.checks import rank\nfrom . import rank as r\n",
    "dtp/checks/rank.py": "import dtp.lang.ir\n",
    "dtp/cli/main.py": "from dtp.cli import __all__\nfrom dtp.runtime.build import go\n",
}
UP = "upward import of dtp.runtime.build (runtime, level 6) from lang (level 2)"
CLI = "(only dtp/cli/ and dtp/__main__.py may)"
CASES = {
    "upward in a function": (
        {"dtp/lang/ir.py": "def f():\n    from dtp.runtime.build import x\n"},
        [f"dtp/lang/ir.py:2: {UP}"],
    ),
    "relative upward": (
        {"dtp/lang/ir.py": "from ..runtime import build\n"},
        [f"dtp/lang/ir.py:1: {UP}"],
    ),
    "siblings": (
        {
            "dtp/cost/model.py": "from dtp.compiler import emit\n",
            "dtp/compiler/emit.py": "\nimport dtp.cost\n",
        },
        [
            "dtp/compiler/emit.py:2: sibling import of dtp.cost (cost) from compiler (both level "
            "5)",
            "dtp/cost/model.py:1: sibling import of dtp.compiler.emit (compiler) from cost (both "
            "level 5)",
        ],
    ),
    "private name": (
        {"dtp/runtime/build.py": "from dtp.lang.ir import go, _walk\n"},
        ["dtp/runtime/build.py:1: private name _walk imported from dtp.lang.ir"],
    ),
    "circle": (
        {"dtp/checks/a.py": "from dtp.checks import b\n", "dtp/checks/b.py": "from .a import x\n"},
        ["circle: dtp.checks.a -> dtp.checks.b -> dtp.checks.a"],
    ),
    "circle through the face": (
        {"dtp/checks/heads.py": "from dtp.checks import helper\n"},
        ["circle: dtp.checks -> dtp.checks.heads -> dtp.checks"],
    ),
    "from dtp import": (
        {"dtp/checks/extra.py": "from dtp import verify\nfrom dtp import load\n"},
        [
            "dtp/checks/extra.py:1: upward import of dtp.verify (verify, level 7) from checks "
            "(level 4)",
            "dtp/checks/extra.py:2: upward import of dtp (face, level 11) from checks (level 4)",
        ],
    ),
    "cli from outside": (
        {
            "dtp/verify/run.py": "\n\nfrom dtp.cli.main import x\n",
            "dtp/__init__.py": FACE + "import dtp.cli\n",
        },
        [
            f"dtp/verify/run.py:3: imports dtp.cli.main {CLI}",
            f"dtp/__init__.py:3: imports dtp.cli {CLI}",
        ],
    ),
    "big faces": (
        {
            "dtp/lang/__init__.py": FACE + "x = 1\n" * 39,
            "dtp/cost/__init__.py": '"""Cost."""\n',
            "dtp/verify/__init__.py": "__all__ = []\n",
        },
        [
            "dtp/cost/__init__.py: no __all__",
            "dtp/lang/__init__.py: 41 lines (at most 40)",
            "dtp/verify/__init__.py: no module docstring",
        ],
    ),
    "7th top-level module": (
        {f"dtp/{m}.py": "" for m in ("files", "layout", "hf", "bench")},
        ["dtp/: 7 top-level modules (at most 6)"],
    ),
    "a face hiding a submodule": (
        {
            "dtp/lang/parse.py": "def parse():\n    pass\n",
            "dtp/lang/__init__.py": FACE + "from dtp.lang.parse import parse\n",
        },
        ["dtp/lang/__init__.py:3: the face binds 'parse', hiding its submodule dtp.lang.parse"],
    ),
    "unknown package": (
        {"dtp/misc/util.py": ""},
        [
            "dtp/misc/: no __init__.py",
            "dtp/misc/util.py: misc is in no level of ORDER (add it there on purpose)",
        ],
    ),
}


def plant(root: Path, files: dict[str, str]) -> Path:
    """Write the clean synthetic tree with `files` laid over it under root."""
    for rel, text in (CLEAN | files).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_clean_tree_has_no_violations(tmp_path: Path) -> None:
    """The synthetic tree that follows every rule reports nothing."""
    assert violations(plant(tmp_path, {})) == []


@pytest.mark.parametrize("case", CASES)
def test_planted_violation_is_reported(tmp_path: Path, case: str) -> None:
    """Each planted breach is reported, exactly and with its position."""
    files, expected = CASES[case]
    assert sorted(violations(plant(tmp_path, files))) == sorted(expected)


# a module off CLEAN's torch-free path (__main__ → cli.main → runtime.build, dtp → checks)
RUN = "dtp/verify/run.py"
FUNCTION_CASES = {
    "torch on the torch-free path": ({"dtp/lang/ir.py": "def f():\n    import torch\n"}, []),
    "a face on the path brings its module": (
        {
            "dtp/lang/__init__.py": FACE + "from dtp.lang.format import x\n",
            "dtp/lang/format.py": "def f():\n    import torch\n",
        },
        [],
    ),
    "optional packages": (
        {RUN: "def f():\n    import transformers\n    from matplotlib import pyplot\n"},
        [],
    ),
    "a dependency, the standard library, dtp": (
        {
            RUN: "def f():\n    import torch.nn as nn\n\n    def g():\n        import os\n    from ..lang import ir\n"
        },
        [f"{RUN}:2: torch.nn {LATE}", f"{RUN}:5: os {LATE}", f"{RUN}:6: ..lang {LATE}"],
    ),
    "a dependency beside an optional package": (
        {RUN: "class A:\n    def f(self):\n        import yaml, tokenizers\n"},
        [f"{RUN}:3: yaml, tokenizers {LATE}"],
    ),
    "TYPE_CHECKING is not on the path": (
        {
            "dtp/cli/main.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dtp.verify import run\n",
            RUN: "def f():\n    import torch\n",
        },
        [f"{RUN}:2: torch {LATE}"],
    ),
}


@pytest.mark.parametrize("case", FUNCTION_CASES)
def test_planted_function_import_is_judged(tmp_path: Path, case: str) -> None:
    """A function-level import is refused off the torch-free path unless every package it names is
    optional."""
    files, expected = FUNCTION_CASES[case]
    assert misplaced_imports(plant(tmp_path, files)) == expected


def test_function_imports_are_counted_once(tmp_path: Path) -> None:
    """Each import statement in a function counts once, a nested function's too; top-level ones not
    at all."""
    root = plant(
        tmp_path,
        {RUN: "import os\n\ndef f():\n    import a, b\n\n    def g():\n        import c\n"},
    )
    assert [(imp.line, imp.names) for imp in function_imports(root)] == [
        (4, ("a", "b")),
        (7, ("c",)),
    ]


DOC = """# Architecture

```
errors  <  lang
        <  cli
```

```
grammar/tp.lark   the language
dtp/__init__.py   the face
dtp/errors.py     diagnostics

dtp/lang/         text
  ir.py           the IR (see dtp/lang/parse.py)
  gone.py
dtp/cli/          the command line
  __init__.py     the face
  main.py run.py  one module per command
tests/            see Testing
```
"""


def test_doc_drift_is_reported(tmp_path: Path) -> None:
    """A module the doc does not name, a name with no module, and an order that is not ORDER are
    each reported."""
    tree = [
        "dtp/__init__.py",
        "dtp/errors.py",
        "dtp/lang/__init__.py",
        "dtp/lang/ir.py",
        "dtp/lang/parse.py",
        "dtp/cli/__init__.py",
        "dtp/cli/main.py",
    ]
    for rel, text in {**dict.fromkeys(tree, ""), "docs/architecture.md": DOC}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert documented(tmp_path)[1] == [("errors",), ("lang",), ("cli",)]
    assert doc_drift(tmp_path) == [
        "docs/architecture.md does not name dtp/lang/parse.py",
        "docs/architecture.md names dtp/cli/run.py, which does not exist",
        "docs/architecture.md names dtp/lang/gone.py, which does not exist",
        f"docs/architecture.md's layer order {[('errors',), ('lang',), ('cli',)]} is not "
        f"ORDER {ORDER}",
    ]
