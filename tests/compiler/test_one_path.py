"""What the compiler emits is what runs: no code under dtp/compiler or dtp/runtime removes hooks
that torch installed, assigns a module's forward, or keeps a parameter's identity by `id()` (an id
outlives its object and can be reused). The sources are read as text (ast), as tests/test_layers.py
reads them."""

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


def findings(source: str, where: str) -> list[str]:
    """Every place in `source` that assigns `.forward`, touches a module's hook tables or calls
    `id()`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "forward":
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


def test_compiler_and_runtime_neither_undo_styles_nor_rebind_forwards_nor_keep_ids():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found += findings(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []
