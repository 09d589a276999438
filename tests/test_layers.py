"""The import graph of dtp/ is the pipeline: one package per stage, ORDER lists the stages bottom up.

An import may only point down to a lower level: never up, never sideways between packages on one level,
never in a circle between module files, never to a private name of another module. docs/architecture.md
explains the layers. The sources are read as text (ast); nothing from dtp is imported.
"""
from __future__ import annotations

import ast
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
    ("train", "hf", "fuzz", "auto"),
    ("bench",),
    ("cli",),
]
TOP = len(ORDER)  # dtp/__init__.py (the face) and dtp/__main__.py: they may import anything, nothing imports them
LEVEL = {part: i for i, level in enumerate(ORDER) for part in level} | {"face": TOP, "__main__": TOP}
MAX_TOP_MODULES = 6
MAX_INIT_LINES = 40
INIT_EXEMPT: set[str] = set()  # packages whose __init__.py need not be a small face (none)
ALLOWED: set[str] = set()  # violations tolerated while the code moves into this layout; must shrink to empty


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
    """The stage a module belongs to: the second component (`dtp.layout.resolve` -> layout; dtp -> face)."""
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
        return [Edge(module, _longest(a.name, mods), node.lineno) for a in node.names
                if a.name == "dtp" or a.name.startswith("dtp.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: against the file's package
        package = module.split(".") if rel.name == "__init__.py" else module.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
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
    return [edge for module, rel in mods.items()
            for node in ast.walk(ast.parse((root / rel).read_text(), str(rel)))
            for edge in _edges(module, rel, node, mods)]


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
        lines.append("circle: " + " -> ".join(cycle[::-1] + [start])
                     + (f" (+{more} more modules in the same circle)" if more else ""))
    return lines


def _structure(root: Path, mods: dict[str, Path]) -> list[str]:
    """Top-level module count, small documented package faces, every module in a known part."""
    lines = []
    top = [rel for rel in mods.values() if len(rel.parts) == 2]  # dtp/*.py, __init__ and __main__ included
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
            lines.append(f"{rel.as_posix()}: {len(text.splitlines())} lines (at most {MAX_INIT_LINES})")
        if ast.get_docstring(tree) is None:
            lines.append(f"{rel.as_posix()}: no module docstring")
        targets = [t for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            lines.append(f"{rel.as_posix()}: no __all__")
        for node in tree.body:  # `from dtp.lang import parse` must give the module, never a function it holds
            for alias in node.names if isinstance(node, ast.ImportFrom) else ():
                bound = alias.asname or alias.name
                if f"{module}.{bound}" in mods and node.module != f"{module}.{bound}".rpartition(".")[0]:
                    lines.append(f"{rel.as_posix()}:{node.lineno}: the face binds '{bound}', "
                                 f"hiding its submodule {module}.{bound}")
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
                lines.append(f"{where}: upward import of {e.target} ({tp}, level {tl}) from {sp} (level {sl})")
            elif tl == sl:
                lines.append(f"{where}: sibling import of {e.target} ({tp}) from {sp} (both level {sl})")
    return lines + _circles(edges) + _structure(root, mods)


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


FACE = '"""A face."""\n__all__: list[str] = []\n'
CLEAN = {
    "dtp/__init__.py": FACE + "from dtp.checks import run\nfrom dtp import errors\n",
    "dtp/__main__.py": "from dtp.cli import main\n",
    "dtp/errors.py": '"""Errors."""\n',
    **{f"dtp/{p}/__init__.py": FACE for p in ("lang", "runtime", "cost", "compiler", "checks", "verify", "cli")},
    "dtp/lang/ir.py": "from dtp.errors import PlanError\n",
    "dtp/runtime/build.py": "from dtp.compiler import emit\nfrom dtp.errors import __doc__, PlanError\n",
    "dtp/compiler/emit.py": "from .. import errors\n",
    "dtp/checks/__init__.py": FACE + "from .heads import run\n",
    "dtp/checks/heads.py": "from dtp.checks import rank\nfrom . import rank as r\n",  # a sibling module, not the face
    "dtp/checks/rank.py": "import dtp.lang.ir\n",
    "dtp/cli/main.py": "from dtp.cli import __all__\nfrom dtp.runtime.build import go\n",
}
UP = "upward import of dtp.runtime.build (runtime, level 6) from lang (level 2)"
CLI = "(only dtp/cli/ and dtp/__main__.py may)"
CASES = {
    "upward in a function": ({"dtp/lang/ir.py": "def f():\n    from dtp.runtime.build import x\n"},
                             [f"dtp/lang/ir.py:2: {UP}"]),
    "relative upward": ({"dtp/lang/ir.py": "from ..runtime import build\n"}, [f"dtp/lang/ir.py:1: {UP}"]),
    "siblings": ({"dtp/cost/model.py": "from dtp.compiler import emit\n", "dtp/compiler/emit.py": "\nimport dtp.cost\n"},
                 ["dtp/compiler/emit.py:2: sibling import of dtp.cost (cost) from compiler (both level 5)",
                  "dtp/cost/model.py:1: sibling import of dtp.compiler.emit (compiler) from cost (both level 5)"]),
    "private name": ({"dtp/runtime/build.py": "from dtp.lang.ir import go, _walk\n"},
                     ["dtp/runtime/build.py:1: private name _walk imported from dtp.lang.ir"]),
    "circle": ({"dtp/checks/a.py": "from dtp.checks import b\n", "dtp/checks/b.py": "from .a import x\n"},
               ["circle: dtp.checks.a -> dtp.checks.b -> dtp.checks.a"]),
    "circle through the face": ({"dtp/checks/heads.py": "from dtp.checks import helper\n"},
                                ["circle: dtp.checks -> dtp.checks.heads -> dtp.checks"]),
    "from dtp import": ({"dtp/checks/extra.py": "from dtp import verify\nfrom dtp import load\n"},
                        ["dtp/checks/extra.py:1: upward import of dtp.verify (verify, level 7) from checks (level 4)",
                         "dtp/checks/extra.py:2: upward import of dtp (face, level 11) from checks (level 4)"]),
    "cli from outside": ({"dtp/verify/run.py": "\n\nfrom dtp.cli.main import x\n",
                          "dtp/__init__.py": FACE + "import dtp.cli\n"},
                         [f"dtp/verify/run.py:3: imports dtp.cli.main {CLI}",
                          f"dtp/__init__.py:3: imports dtp.cli {CLI}"]),
    "big faces": ({"dtp/lang/__init__.py": FACE + "x = 1\n" * 39, "dtp/cost/__init__.py": '"""Cost."""\n',
                   "dtp/verify/__init__.py": "__all__ = []\n"},
                  ["dtp/cost/__init__.py: no __all__", "dtp/lang/__init__.py: 41 lines (at most 40)",
                   "dtp/verify/__init__.py: no module docstring"]),
    "7th top-level module": ({f"dtp/{m}.py": "" for m in ("files", "layout", "hf", "bench")},
                             ["dtp/: 7 top-level modules (at most 6)"]),
    "a face hiding a submodule": ({"dtp/lang/parse.py": "def parse():\n    pass\n",
                                   "dtp/lang/__init__.py": FACE + "from dtp.lang.parse import parse\n"},
                                  ["dtp/lang/__init__.py:3: the face binds 'parse', hiding its submodule dtp.lang.parse"]),
    "unknown package": ({"dtp/misc/util.py": ""},
                        ["dtp/misc/: no __init__.py",
                         "dtp/misc/util.py: misc is in no level of ORDER (add it there on purpose)"]),
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
