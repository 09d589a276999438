"""What the compiler emits is what runs: no code in dtp/ assigns another object's forward (a module's
forward changes only through its class, as dtp's styles and `dtp train`'s recomputed blocks do), and
none under dtp/compiler or dtp/runtime removes hooks that torch installed or keeps a parameter's
identity by `id()` (an id outlives its object and can be reused). The sources are read as text
(ast), as tests/test_layers.py reads them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dtp/compiler", "dtp/runtime")
HOOK_TABLES = {
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
}


def _others_forward(target: ast.expr) -> bool:
    """`x.forward = …` where x is not `self` (an object's own `forward` attribute, as a plain class
    holding a calling convention has, is not a module's forward rebound from outside)."""
    if not isinstance(target, ast.Attribute) or target.attr != "forward":
        return False
    return not (isinstance(target.value, ast.Name) and target.value.id == "self")


def findings(source: str, where: str) -> list[str]:
    """Every place in `source` that assigns another object's `.forward`, touches a module's hook
    tables or calls `id()`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if _others_forward(t):
                    out.append(f"{where}:{node.lineno}: assigns .forward")
        if isinstance(node, ast.Attribute) and node.attr in HOOK_TABLES:
            out.append(f"{where}:{node.lineno}: reads {node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id":
            out.append(f"{where}:{node.lineno}: calls id()")
    return out


def test_the_scanner_sees_each_construct():
    planted = "module.forward = f\ndel module._forward_pre_hooks[k]\nseen.add(id(p))\n"
    assert findings(planted, "x.py") == [
        "x.py:1: assigns .forward",
        "x.py:2: reads _forward_pre_hooks",
        "x.py:3: calls id()",
    ]
    assert findings("module.register_forward_hook(hook)\nlayer.forward(x)\n", "x.py") == []
    assert findings("self.forward = calling.discover(model)\n", "x.py") == []


def test_no_module_forward_is_assigned_anywhere_in_dtp():
    found = []
    for path in sorted((ROOT / "dtp").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        found += [f for f in findings(path.read_text(), where) if f.endswith("assigns .forward")]
    assert found == []


def test_compiler_and_runtime_neither_undo_styles_nor_rebind_forwards_nor_keep_ids():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += findings(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []
