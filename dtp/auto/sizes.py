"""What an attention's forward does with sizes and with its fused projection, read from its Python
source.

Two questions `dtp plan --auto` cannot answer from shapes alone:
- which attributes the forward cuts tensors with (`view(b, s, self.num_heads, …)`, `qkv[...,
  :query_pos]` with `query_pos = self.config.num_attention_heads * self.head_dim`): a split
  attention needs them rewritten;
- whether a fused q/k/v projection is [q | k | v] (split or sliced first: `packed`) or interleaved
  per head or per group (viewed to heads first: `view(b, s, n_heads, 3, hd)`, plain colwise gives
  each rank whole heads).

Nothing is executed: an `ast` walk of `forward` and the `self.` methods it calls, following the
branch a boolean attribute selects (`if self.multi_query:`), as dtp/layout/forward_source.py does.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from dtp.layout.forward_source import SHAPE_METHODS
from dtp.layout.forward_source import is_self_attribute as _is_self_attr
from dtp.layout.forward_source import method_ast as _method

if TYPE_CHECKING:
    import torch.nn as nn

_DEPTH = 3
_SPLITS = frozenset({"split", "chunk", "tensor_split", "unbind"})
_VIEWS = frozenset({"view", "reshape", "unflatten"})
_TRANSPARENT = frozenset({"unsqueeze", "contiguous", "to", "float", "type_as", "clone"})


def _attr_read(node: ast.AST) -> str | None:
    """ "NAME" for `self.NAME`, "config.NAME" for `self.config.NAME`."""
    if _is_self_attr(node):
        return node.attr
    if (
        isinstance(node, ast.Attribute)
        and _is_self_attr(node.value)
        and node.value.attr == "config"
    ):
        return "config." + node.attr
    return None


class _Sizes:
    def __init__(self, module: nn.Module):
        self.cls = type(module)
        self.flags = {k: v for k, v in vars(module).items() if isinstance(v, bool)}
        self.found: set[str] = set()

    def reads(self, node: ast.AST, env: dict[str, set[str]]) -> set[str]:
        out: set[str] = set()
        for sub in ast.walk(node):
            name = _attr_read(sub)
            if name:
                out.add(name)
            elif isinstance(sub, ast.Name):
                out |= env.get(sub.id, set())
        return out

    def visit(self, body: list[ast.stmt], env: dict[str, set[str]], depth: int) -> None:
        for stmt in body:
            if isinstance(stmt, ast.If):
                flag = _flag(stmt.test, self.flags)
                for branch in (
                    [stmt.body]
                    if flag is True
                    else [stmt.orelse]
                    if flag is False
                    else [stmt.body, stmt.orelse]
                ):
                    self.visit(branch, env, depth)
                continue
            if isinstance(stmt, ast.Assign):
                got = self.reads(stmt.value, env)
                for target in stmt.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            env[n.id] = got
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Subscript):
                    self.found |= self.reads(sub.slice, env)
                elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                    if sub.func.attr in SHAPE_METHODS:
                        for arg in [*sub.args, *(k.value for k in sub.keywords)]:
                            self.found |= self.reads(arg, env)
                    elif _is_self_attr(sub.func) and depth < _DEPTH:
                        method = _method(self.cls, sub.func.attr)
                        # a size passed in (`self._split_heads(x, self.num_heads)`)
                        if method is not None:
                            params = [a.arg for a in method.args.args[1:]]
                            inner = {n: self.reads(a, env) for n, a in zip(params, sub.args)}
                            inner.update(
                                {k.arg: self.reads(k.value, env) for k in sub.keywords if k.arg}
                            )
                            self.visit(method.body, inner, depth + 1)
            for part in ("body", "orelse", "finalbody"):
                if not isinstance(stmt, ast.If) and isinstance(getattr(stmt, part, None), list):
                    self.visit(getattr(stmt, part), env, depth)


def _flag(test: ast.AST, flags: dict[str, bool]) -> bool | None:
    negate = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    inner = test.operand if negate else test
    if _is_self_attr(inner) and inner.attr in flags:
        return flags[inner.attr] != negate
    return None


def size_reads(module: nn.Module) -> set[str] | None:
    """Attributes (`NAME`, `config.NAME`) the forward reads as sizes: in shape arguments or slices;
    None without source."""
    fn = _method(type(module), "forward")
    if fn is None:
        return None
    walker = _Sizes(module)
    walker.visit(fn.body, {}, 0)
    return walker.found


def fused_layout(module: nn.Module, child: str) -> str | None:
    """How the forward takes `self.CHILD(…)`'s output apart: "concat" ([q | k | v], split or sliced
    first), "interleaved" (viewed to heads or groups first), or None when the source does not say."""
    return fused_view(module, child)[0]


def fused_view(module: nn.Module, child: str) -> tuple[str | None, frozenset[str]]:
    """fused_layout's answer, and the attributes the deciding view reads (`view(b, s,
    self.num_heads, 3, hd)`: the number of head groups, which a rank holds 1/tp of)."""
    fn = _method(type(module), "forward")
    if fn is None:
        return None, frozenset()
    found = _layout_in(
        type(module),
        fn,
        child,
        None,
        {k: v for k, v in vars(module).items() if isinstance(v, bool)},
        0,
    )
    return found if found else (None, frozenset())


def _layout_in(
    cls: type, fn: ast.FunctionDef, child: str | None, param: str | None, flags: dict, depth: int
):
    names = {param} if param else set()
    for node in _walk_flagged(fn.body, flags):
        if (
            isinstance(node, ast.Assign)
            and _is_source(node.value, child, names)
            and len(node.targets) == 1
        ):
            target = node.targets[0]
            if isinstance(target, ast.Name):
                names.add(target.id)
        verdict = None
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Attribute)
                and _is_source(sub.func.value, child, names)
            ):
                verdict = _method_verdict(sub)
                if verdict:
                    groups = _groups_arg(_flat(sub.args)) if verdict == "interleaved" else None
                    reads = (
                        {r for n in ast.walk(groups) if (r := _attr_read(n))}
                        if groups is not None
                        else set()
                    )
                    verdict = (verdict, frozenset(reads))
            elif isinstance(sub, ast.Subscript) and _is_source(sub.value, child, names):
                verdict = ("concat", frozenset())
            elif (
                isinstance(sub, ast.Call)
                and _is_self_attr(sub.func)
                and depth < _DEPTH
                and sub.args
                and _is_source(sub.args[0], child, names)
            ):
                method = _method(cls, sub.func.attr)
                if method is not None and method.args.args[1:]:
                    verdict = _layout_in(
                        cls, method, None, method.args.args[1].arg, flags, depth + 1
                    )
            elif (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Attribute)
                and sub.func.attr in _SPLITS
                and sub.args
                and _is_source(sub.args[0], child, names)
            ):  # torch.split(qkv, …)
                verdict = ("concat", frozenset())
            if verdict:
                return verdict
    return None


def _is_source(node: ast.AST, child: str | None, names: set[str]) -> bool:
    """`node` is the fused output: `self.CHILD(…)`, a name bound to it, or either through a
    transparent call."""
    if isinstance(node, ast.Name):
        return node.id in names
    if (
        isinstance(node, ast.Call)
        and child
        and _is_self_attr(node.func)
        and node.func.attr == child
    ):
        return True
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _TRANSPARENT
    ):
        return _is_source(node.func.value, child, names)
    return False


def _method_verdict(call: ast.Call) -> str | None:
    op = call.func.attr
    if op in _SPLITS:
        return "concat"
    if op not in _VIEWS:
        return None
    args = _flat(call.args)
    threes = [i for i, a in enumerate(args) if isinstance(a, ast.Constant) and a.value == 3]
    if args and isinstance(args[-1], ast.BinOp) and _has_three(args[-1]):
        return "interleaved"  # (…, n_heads, 3 * head_dim): q, k, v of a head side by side
    if threes and threes[-1] == len(args) - 2:
        return "interleaved"  # (…, n_heads, 3, head_dim)
    if threes:
        return "concat"  # (…, 3, n_heads, head_dim)
    # (…, groups, -1): whole groups of heads (CodeGen's mp_num, Falcon-40B's kv groups)
    return "interleaved"


def _groups_arg(args: list[ast.AST]) -> ast.AST | None:
    """The argument of an interleaving view that counts the groups of heads (a rank holds 1/tp of
    them): before (parts, head_dim) in `(…, groups, 3, hd)` or `(…, groups, n_rep + 2, hd)`, else
    before the last (`(…, groups, 3 * hd)`, `(…, mp_num, -1)`); never a group's own size."""
    if len(args) >= 3 and (
        isinstance(args[-2], ast.BinOp)
        or (isinstance(args[-2], ast.Constant) and args[-2].value == 3)
    ):
        return args[-3]
    return args[-2] if len(args) >= 2 else None


def _flat(args: list[ast.AST]) -> list[ast.AST]:
    out: list[ast.AST] = []
    for a in args:
        if isinstance(a, ast.Tuple):
            out += _flat(list(a.elts))
        elif (
            isinstance(a, ast.BinOp)
            and isinstance(a.op, ast.Add)
            and isinstance(a.right, ast.Tuple)
        ):
            out += _flat([a.left, *a.right.elts])  # shape[:-1] + (n, -1)
        else:
            out.append(a)
    return out


def _has_three(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == 3 for n in ast.walk(node))


def _walk_flagged(body: list[ast.stmt], flags: dict) -> list[ast.stmt]:
    """The statements of `body` in order, entering only the branch a boolean attribute selects."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            flag = _flag(stmt.test, flags)
            for branch in (
                [stmt.body]
                if flag is True
                else [stmt.orelse]
                if flag is False
                else [stmt.body, stmt.orelse]
            ):
                out += _walk_flagged(branch, flags)
        elif isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
            out += _walk_flagged(stmt.body, flags)
        else:
            out.append(stmt)
    return out


def input_width_sizes(module: nn.Module) -> str | None:
    """The name the forward gives its input's feature width and then sizes a tensor with (TrOCR's
    `bsz, tgt_len, embed_dim = hidden_states.size()` … `reshape(bsz, tgt_len, embed_dim)`): split
    heads would be reshaped to the whole width, which no `set` can fix. None when it does no such
    thing or has no source."""
    fn = _method(type(module), "forward")
    if fn is None or len(fn.args.args) < 2:
        return None
    first = fn.args.args[1].arg
    width = None
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Tuple)
        ):
            value, last = node.value, node.targets[0].elts[-1]
            if isinstance(value, ast.Call):
                value = value.func
            if (
                isinstance(value, ast.Attribute)
                and value.attr in ("size", "shape")
                and isinstance(value.value, ast.Name)
                and value.value.id == first
                and isinstance(last, ast.Name)
            ):
                width = last.id
    if width is None:
        return None
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SHAPE_METHODS
        ):
            if any(
                isinstance(n, ast.Name) and n.id == width for a in node.args for n in ast.walk(a)
            ):
                return width
    return None
