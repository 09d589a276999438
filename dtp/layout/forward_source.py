"""What a module's forward does with its children and attributes, read from its Python source.

The layout flow must not claim data flow the model does not have: q_proj, k_proj and v_proj all read
the attention's input, and only the attention's own code combines their outputs. Registration order
cannot tell a chain from siblings, the forward's source can: `self.k_proj(hidden_states)` reads what
`self.q_proj` reads. The same reading finds the attributes a forward cuts tensors with (`view(bsz,
-1, self.num_heads, …)`), which a split attention needs rewritten.

A conservative def-use walk over the forward (and the `self.` methods it calls): every value carries
the children and attributes it was computed from; `if self.FLAG:` on a boolean attribute follows the
branch the module takes, any other branch both. Anything the walk cannot see (no source, a child
reached another way) gives None, and the caller falls back to what it knew before.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.nn as nn

# Tensor methods whose arguments are sizes: an attribute read there shapes the heads.
SHAPE_METHODS = frozenset(
    {
        "view",
        "reshape",
        "split",
        "unflatten",
        "expand",
        "repeat",
        "chunk",
        "tensor_split",
        "new_zeros",
        "new_empty",
    }
)
_MAX_DEPTH = 3  # `self.` methods followed from forward (Falcon: forward → _split_heads)


@dataclass
class ForwardFacts:
    """What one module's forward reads: per child called as `self.NAME(…)`, the children its input
    comes from (transitively, through any computation); the children its result comes from;
    attributes read as sizes."""

    inputs: dict[str, frozenset[str]] = field(default_factory=dict)
    result: frozenset[str] = frozenset()
    shape_attrs: set[str] = field(default_factory=set)


Tags = frozenset  # "c:NAME" (a child's output), "a:NAME" (an attribute's value)


class _Walker:
    def __init__(self, cls: type, children: frozenset[str], flags: dict[str, bool]):
        self.cls, self.children, self.flags, self.facts = cls, children, flags, ForwardFacts()
        # children called inside a helper method: their input is not followed
        self.deep: set[str] = set()

    def expr(self, node: ast.AST | None, env: dict[str, Tags], depth: int) -> Tags:
        if node is None:
            return frozenset()
        if isinstance(node, ast.Name):
            return env.get(node.id, frozenset())
        if _is_self_attr(node):
            return frozenset({"a:" + node.attr})
        if isinstance(node, ast.Call):
            args = frozenset().union(
                *(self.expr(a, env, depth) for a in [*node.args, *(k.value for k in node.keywords)])
            )
            func = node.func
            if _is_self_attr(func) and func.attr in self.children:
                children = frozenset(t[2:] for t in args if t.startswith("c:"))
                if depth:
                    self.deep.add(func.attr)
                self.facts.inputs[func.attr] = (
                    self.facts.inputs.get(func.attr, frozenset()) | children
                )
                return frozenset({"c:" + func.attr}) | args
            if _is_self_attr(func) and depth < _MAX_DEPTH:
                method = _method(self.cls, func.attr)
                # args flow through the method; its own size reads are recorded
                if method is not None:
                    return args | self.body(method, {}, depth + 1)
            if isinstance(func, ast.Attribute) and func.attr in SHAPE_METHODS:
                self.facts.shape_attrs |= {t[2:] for t in args if t.startswith("a:")}
            return args | self.expr(func, env, depth)
        return frozenset().union(*(self.expr(c, env, depth) for c in ast.iter_child_nodes(node)))

    def assign(self, target: ast.AST, tags: Tags, env: dict[str, Tags], aug: bool = False) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = (env.get(target.id, frozenset()) | tags) if aug else tags
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self.assign(elt, tags, env, aug)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, tags, env, aug)

    def _flag(self, test: ast.AST) -> bool | None:
        """The value of `self.FLAG` / `not self.FLAG` on this module, None for any other test."""
        negate = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        inner = test.operand if negate else test
        if _is_self_attr(inner) and inner.attr in self.flags:
            return self.flags[inner.attr] != negate
        return None

    def stmts(self, body: list[ast.stmt], env: dict[str, Tags], depth: int) -> Tags:
        returned: Tags = frozenset()
        for stmt in body:
            if isinstance(stmt, (ast.If, ast.Match)):
                # torchtitan picks its attention kernel by `match self.attn_type`
                if isinstance(stmt, ast.Match):
                    self.expr(stmt.subject, env, depth)
                    branches = [case.body for case in stmt.cases]
                    if not any(
                        isinstance(c.pattern, ast.MatchAs) and c.pattern.pattern is None
                        for c in stmt.cases
                    ):
                        branches.append([])  # no `case _`: the match may take no case
                else:
                    flag = self._flag(stmt.test)
                    self.expr(stmt.test, env, depth)
                    branches = (
                        [stmt.body]
                        if flag is True
                        else [stmt.orelse]
                        if flag is False
                        else [stmt.body, stmt.orelse]
                    )
                envs = []
                for branch in branches:
                    local = dict(env)
                    returned |= self.stmts(branch, local, depth)
                    envs.append(local)
                # either branch may have run: a name carries what any of them gave it
                for local in envs:
                    for name, tags in local.items():
                        env[name] = env.get(name, frozenset()) | tags if len(envs) > 1 else tags
            elif isinstance(stmt, ast.Assign):
                tags = self.expr(stmt.value, env, depth)
                for target in stmt.targets:
                    self.assign(target, tags, env)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                if stmt.value is not None:
                    self.assign(
                        stmt.target,
                        self.expr(stmt.value, env, depth),
                        env,
                        isinstance(stmt, ast.AugAssign),
                    )
            elif isinstance(stmt, ast.Return):
                returned |= self.expr(stmt.value, env, depth)
            elif isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
                if isinstance(stmt, ast.For):
                    self.assign(stmt.target, self.expr(stmt.iter, env, depth), env)
                for part in ("body", "orelse", "finalbody"):
                    returned |= self.stmts(getattr(stmt, part, []), env, depth)
                for handler in getattr(stmt, "handlers", []):
                    returned |= self.stmts(handler.body, env, depth)
            elif isinstance(stmt, (ast.Expr, ast.Assert, ast.Raise)):
                for child in ast.iter_child_nodes(stmt):
                    self.expr(child, env, depth)
        return returned

    def body(self, fn: ast.FunctionDef, env: dict[str, Tags], depth: int) -> Tags:
        return self.stmts(fn.body, env, depth)


def _is_self_attr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


@lru_cache(maxsize=512)
def _method(cls: type, name: str) -> ast.FunctionDef | None:
    """The parsed source of `cls.name` (decorators unwrapped); None without Python source."""
    fn = inspect.getattr_static(cls, name, None)
    if not inspect.isfunction(fn):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def forward_facts(module: nn.Module) -> ForwardFacts | None:
    """What `module.forward` reads (ForwardFacts); None when its source cannot be read."""
    fn = _method(type(module), "forward")
    if fn is None:
        return None
    flags = {k: v for k, v in vars(module).items() if isinstance(v, bool)}
    walker = _Walker(type(module), frozenset(n for n, _ in module.named_children()), flags)
    walker.facts.result = frozenset(t[2:] for t in walker.body(fn, {}, 0) if t.startswith("c:"))
    for name in walker.deep:
        walker.facts.inputs.pop(name, None)
    return walker.facts


def nearest(
    found: frozenset[str], inputs: dict[str, frozenset[str]], among: set[str]
) -> frozenset[str]:
    """Of the children in `found` that are in `among`, those no other of them feeds (q_norm, not
    q_proj under it): the outputs that arrive directly."""
    hits = found & among
    return frozenset(
        c
        for c in hits
        if not any(c in inputs.get(other, frozenset()) for other in hits if other != c)
    )


@dataclass(frozen=True)
class BranchSources:
    """For the leaves of one branch that share a parent: which earlier leaves each one's input comes
    from (empty: the parent's own input), and which leaves the parent's result comes from."""

    parent: str
    # (leaf path, source leaf paths), in walking order
    reads: tuple[tuple[str, tuple[str, ...]], ...]
    result: tuple[str, ...]


def branch_sources(
    modules: dict[str, nn.Module], leaves: list[str], skippable: tuple[type, ...]
) -> BranchSources | None:
    """The data flow between `leaves` (module paths, in walking order) when they are children of one
    module whose forward calls each of them (modules of a `skippable` type, e.g. Dropout, may be
    reached otherwise); None when the source cannot say (the caller keeps registration order)."""
    parent = leaves[0].rpartition(".")[0] if leaves else ""
    if not parent or any(p.rpartition(".")[0] != parent for p in leaves) or parent not in modules:
        return None
    facts = forward_facts(modules[parent])
    if facts is None:
        return None
    name = {p: p.rpartition(".")[2] for p in leaves}
    walked = [p for p in leaves if name[p] in facts.inputs or not isinstance(modules[p], skippable)]
    if not walked or any(name[p] not in facts.inputs for p in walked):
        return None
    reads, seen, waiting = [], set(), list(walked)
    # registration order, except that a leaf waits for the leaves it reads (Phi-3's o_proj)
    while waiting:
        path = next(
            (p for p in waiting if facts.inputs[name[p]] & {name[q] for q in walked} <= seen), None
        )
        if path is None:
            return None  # a circle: the source does not give an order
        waiting.remove(path)
        got = nearest(facts.inputs[name[path]], facts.inputs, seen)
        reads.append((path, tuple(p for p in walked if name[p] in got)))
        seen.add(name[path])
    result = nearest(facts.result, facts.inputs, seen)
    if not result:
        return None
    return BranchSources(parent, tuple(reads), tuple(p for p in walked if name[p] in result))


def is_self_attribute(node: ast.AST) -> bool:
    """Whether `node` is `self.NAME`."""
    return _is_self_attr(node)


_READ_NOTHING = {
    "type",
    "isinstance",
    "id",
}  # builtins that read no attribute of what they are given


def forward_attributes(cls: type) -> frozenset[str] | None:
    """Every attribute name `cls`'s forward loads (of `self` or of anything else: `layer.layer_idx`)
    in its source and in the methods it calls on `self`; None when one of those has no source, reads
    `self` by other means than attributes (getattr, vars, `__dict__`, super), hands `self` to a
    function, or calls a property: then any attribute may be read."""
    names: set[str] = set()
    todo, seen = ["forward"], set()
    while todo:
        method = todo.pop()
        if method in seen:
            continue
        seen.add(method)
        fn = _method(cls, method)
        if fn is None or not fn.args.args:
            return None
        me = fn.args.args[0].arg
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and node.id in ("getattr", "vars", "super", "hasattr"):
                return None
            # `self` handed to a function (transformers' eager_attention_forward(self, …)) is read
            # where this walk does not go
            if (
                isinstance(node, ast.Call)
                and not (isinstance(node.func, ast.Name) and node.func.id in _READ_NOTHING)
                and any(
                    isinstance(a, ast.Name) and a.id == me
                    for a in [*node.args, *(k.value for k in node.keywords)]
                )
            ):
                return None
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            names.add(node.attr)
            if isinstance(node.value, ast.Name) and node.value.id == me:
                found = inspect.getattr_static(cls, node.attr, None)
                if node.attr == "__dict__" or isinstance(found, property):
                    return None
                if inspect.isfunction(found):
                    todo.append(node.attr)
    return frozenset(names)


def method_ast(cls: type, name: str) -> ast.FunctionDef | None:
    """The parsed source of `cls.name` (cached); None without Python source."""
    return _method(cls, name)
