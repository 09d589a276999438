"""Text → plan IR: the Lark parser, the tree-to-IR transformer and friendly syntax errors."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import stat
from pathlib import Path

from lark import (
    Lark,
    Token,
    Transformer,
    Tree,
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    v_args,
)
from lark.exceptions import VisitError

from dtp.errors import NOWHERE, Diagnostic, PlanError, Pos, UsageError, did_you_mean
from dtp.files import shipped
from dtp.lang import ir

LANGUAGE_VERSION = 1
MAX_NESTING = 64
MAX_EXPR_DEPTH = 64  # operators on one path of a `set` expression's tree
# a plan is a page of text; this bounds the time and memory a file can cost
MAX_PLAN_BYTES = 4 * 2**20
MAX_INT = 2**62


def _grammar_text() -> str:
    return shipped("grammar/tp.lark").read_text(encoding="utf-8")


@functools.cache
def parser() -> Lark:
    """The .tp parser, built once per process."""
    return Lark(
        _grammar_text(),
        parser="lalr",
        strict=True,
        propagate_positions=True,
        maybe_placeholders=False,
    )


# ---- syntax errors ---------------------------------------------------------------------------------

# Labelled bad snippets (Lark's match_examples): the parser state where each fails names the
# mistake.
_EXAMPLES: dict[str, list[str]] = {
    "a plan must start with `dtp 1` (the language version)": [
        "a: colwise",
        "plan x",
        "mesh tp",
        "set a.b = 1",
        "a { }",
        "dtp",
        "dtp x",
    ],
    "expected ':' and a style after the pattern, or '{' to open a block": [
        "dtp 1\na colwise",
        "dtp 1\na.b",
        "dtp 1\na.b rowwise(x=1)",
    ],
    "expected a style name after ':' (colwise, rowwise, vocab_parallel, sequence_parallel, replicate)": [
        "dtp 1\na:",
        "dtp 1\na: (",
        "dtp 1\na: 3",
    ],
    "unclosed '(' in style options; expected KEY=VALUE, ',' or ')'": [
        "dtp 1\na: colwise(",
        "dtp 1\na: colwise(packed=3",
        "dtp 1\na: colwise(packed=3,",
        "dtp 1\na: colwise(packed",
        "dtp 1\na: colwise(packed=",
    ],
    "unclosed block: expected '}'": ["dtp 1\na {\n", "dtp 1\na {\nb: colwise\n"],
    "a statement must end at the end of its line": [
        "dtp 1 2",
        "dtp 1\na: colwise rowwise",
        "dtp 1\na: colwise(packed=3) x",
    ],
    "incomplete set statement; expected `set MODULE.ATTR = EXPRESSION`": [
        "dtp 1\nset",
        "dtp 1\nset a.b",
        "dtp 1\nset a.b =",
        "dtp 1\nset a.b = 1 +",
    ],
    "unclosed '(' in the expression; expected ')'": [
        "dtp 1\nset a.b = (1",
        "dtp 1\nset a.b = (a * 2",
    ],
    "expected a condition after `when`: `when config.ATTR { ... }` or `when config.ATTR == VALUE { ... }`": [
        "dtp 1\nwhen",
        "dtp 1\nwhen {",
    ],
    "expected '{' after the condition (or a comparison: == != < <= > >=)": ["dtp 1\nwhen config.a"],
    "expected '{' after the condition": ["dtp 1\nwhen config.a == 1"],
    "expected a value to compare with: `config.ATTR`, an integer, true or false": [
        "dtp 1\nwhen config.a =="
    ],
}

_TOKEN_NAMES = {
    "PATTERN": "a module pattern",
    "NAME": "a name",
    "INT": "an integer",
    "SIGNED_INT": "an integer",
    "PLAN_NAME": "a plan name",
    "_NL": "end of line",
    "$END": "end of file",
    "ADD_OP": "'+' or '-'",
    "MUL_OP": "'*' or '/'",
    "CONFIG_REF": "config.ATTR",
    "CMP_OP": "a comparison (== != < <= > >=)",
}


@functools.cache
def _example_errors() -> list[tuple[int, frozenset, str]]:
    """(parser state, acceptable tokens, label) for each labelled bad snippet."""
    out = []
    for label, examples in _EXAMPLES.items():
        for text in examples:
            try:
                parser().parse(text)
            except UnexpectedInput as ut:
                state = getattr(ut, "state", None)
                if state is not None:
                    out.append(
                        (state.position, frozenset(getattr(ut, "accepts", None) or ()), label)
                    )
    return out


def _label(err: UnexpectedInput) -> str | None:
    # Lark's match_examples also demands the same parser *stack depth*, so a label learnt on a first
    # statement would miss the same mistake inside a block or after a comment; the state and the
    # acceptable tokens are what identify the mistake.
    state = getattr(err, "state", None)
    if state is None:
        return None
    accepts = frozenset(getattr(err, "accepts", None) or ())
    for position, acc, label in _example_errors():
        if position == state.position and acc == accepts:
            return label
    return None


def _describe_expected(expected: set[str]) -> str:
    names = []
    for name in sorted(expected):
        if name in _TOKEN_NAMES:
            names.append(_TOKEN_NAMES[name])
            continue
        try:
            pattern = parser().get_terminal(name).pattern
            names.append(f"'{pattern.value}'" if pattern.type == "str" else name.lower())
        except KeyError:
            names.append(name.lower())
    names = sorted(set(names))
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _syntax_diagnostic(err: UnexpectedInput, text: str, file: str) -> Diagnostic:
    line, column = max(err.line, 1), max(err.column, 1)
    if isinstance(err, UnexpectedEOF) or (
        isinstance(err, UnexpectedToken) and err.token.type == "$END"
    ):
        lines = text.rstrip("\n").split("\n")
        line, column = len(lines), len(lines[-1]) + 1
    if isinstance(err, UnexpectedCharacters):
        char = text[err.pos_in_stream]
        shown = repr(char) if char.isprintable() else f"byte {ord(char):#04x}"
        return Diagnostic(Pos(file, line, column), f"unexpected character {shown}")
    label = _label(err)
    found = "end of file" if isinstance(err, UnexpectedEOF) else _found(err.token)
    expected = getattr(err, "accepts", None) or getattr(err, "expected", set())
    msg = f"unexpected {found}"
    msg += f": {label}" if label else f"; expected {_describe_expected(set(expected))}"
    length = len(err.token) if isinstance(err, UnexpectedToken) and err.token.type != "$END" else 1
    return Diagnostic(Pos(file, line, column), msg, max(1, min(length, 80)))


def _found(token: Token) -> str:
    if token.type == "$END":
        return "end of file"
    if token.type == "_NL":
        return "end of line"
    shown = str(token) if len(token) <= 40 else str(token)[:37] + "..."
    return f"'{shown}'"


# ---- tree → IR -----------------------------------------------------------------------------------------

_RANGE = re.compile(r"\[([0-9]+)\.\.([0-9]+)\]")


class _ToIR(Transformer):
    """Builds IR nodes; semantic problems that the grammar cannot see are collected, not raised."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file
        self.errors: list[Diagnostic] = []

    def _pos(self, item: Token | Tree | object) -> Pos:
        meta = item.meta if isinstance(item, Tree) else item
        return Pos(self.file, getattr(meta, "line", 0) or 0, getattr(meta, "column", 0) or 0)

    def _int(self, token: Token) -> int:
        value = int(token) if len(token) < 30 else MAX_INT + 1
        if abs(value) > MAX_INT:
            self.errors.append(
                Diagnostic(self._pos(token), f"number too large: {str(token)[:30]}", len(token))
            )
            return 0
        return value

    def _pattern(self, token: Token) -> ir.Pattern:
        segments: list[ir.Segment] = []
        for seg in _split_pattern(str(token)):
            m = _RANGE.fullmatch(seg)
            if m:
                lo, hi = (
                    self._int(Token("INT", m.group(1), line=token.line, column=token.column)),
                    self._int(Token("INT", m.group(2), line=token.line, column=token.column)),
                )
                if lo > hi:
                    self.errors.append(
                        Diagnostic(self._pos(token), f"empty index range [{lo}..{hi}]", len(token))
                    )
                segments.append(ir.IndexRange(lo, hi))
            elif "**" in seg and seg != "**":
                self.errors.append(
                    Diagnostic(
                        self._pos(token), f"'**' must be a whole segment, not '{seg}'", len(token)
                    )
                )
                segments.append(seg)
            else:
                segments.append(seg)
        return ir.Pattern(tuple(segments), self._pos(token))

    @v_args(meta=True)
    def start(self, meta, children) -> ir.Plan:
        version, *items = children
        name = plan_version = None
        mesh: tuple[str, ...] = ("tp",)
        mesh_pos = plan_pos = NOWHERE
        seen: dict[str, Pos] = {}
        body: list[ir.Statement] = []
        for item in items:
            if isinstance(item, tuple):  # ("plan" | "mesh", pos, payload)
                kind, pos, payload = item
                if kind in seen:
                    self.errors.append(
                        Diagnostic(
                            pos,
                            f"duplicate `{kind}` statement (first at line {seen[kind].line})",
                            len(kind),
                        )
                    )
                elif body:
                    self.errors.append(
                        Diagnostic(pos, f"`{kind}` must come before the first rule", len(kind))
                    )
                seen.setdefault(kind, pos)
                if kind == "plan":
                    (name, plan_version), plan_pos = payload, pos
                else:
                    mesh, mesh_pos = payload, pos
            else:
                body.append(item)
        number, version_pos = version
        if number != LANGUAGE_VERSION:
            self.errors.append(
                Diagnostic(
                    version_pos,
                    f"unsupported language version {number}; this dtp reads `dtp "
                    f"{LANGUAGE_VERSION}`",
                )
            )
        return ir.Plan(
            number,
            tuple(body),
            name,
            plan_version,
            mesh,
            file=self.file,
            version_pos=version_pos,
            mesh_pos=mesh_pos,
            plan_pos=plan_pos,
        )

    def version(self, children):
        (number,) = children
        errors = len(self.errors)
        value = self._int(number)
        return (value if len(self.errors) == errors else LANGUAGE_VERSION), self._pos(number)

    @v_args(meta=True)
    def plan_decl(self, meta, children):
        name = str(children[0])
        version = self._int(children[1]) if len(children) > 1 else None
        return ("plan", self._pos(meta), (name, version))

    @v_args(meta=True)
    def mesh_decl(self, meta, children):
        names = tuple(str(c) for c in children)
        pos = self._pos(meta)
        if len(set(names)) != len(names):
            self.errors.append(
                Diagnostic(pos, f"mesh dimension names repeat: {', '.join(names)}", 4)
            )
        if "tp" not in names:
            self.errors.append(
                Diagnostic(
                    self._pos(children[0]),
                    "the mesh needs a `tp` dimension (e.g. `mesh tp` or `mesh dp, tp`)",
                    len(children[0]),
                )
            )
        elif len(names) > 2 or (len(names) == 2 and names != ("dp", "tp")):
            self.errors.append(
                Diagnostic(
                    pos, f"unsupported mesh `{', '.join(names)}`; use `mesh tp` or `mesh dp, tp`", 4
                )
            )
        return ("mesh", pos, names)

    @v_args(meta=True)
    def rule(self, meta, children):
        pattern, style = children
        return ir.Rule(self._pattern(pattern), style, self._pos(meta))

    @v_args(meta=True)
    def block(self, meta, children):
        pattern, *body = children
        if str(pattern) == "else":
            self.errors.append(
                Diagnostic(
                    self._pos(pattern),
                    "`else` must follow the `}` of a `when` block on the same line: `} else {`",
                    4,
                )
            )
        end = Pos(self.file, meta.end_line, meta.end_column - 1)
        return ir.Block(self._pattern(pattern), tuple(body), self._pos(meta), end)

    @v_args(meta=True)
    def body(self, meta, children):
        return tuple(children), Pos(self.file, meta.end_line, meta.end_column - 1)

    @v_args(meta=True)
    def when_block(self, meta, children):
        condition, (body, end), *rest = children
        orelse, else_end = rest[0] if rest else (None, NOWHERE)
        return ir.When(condition, body, orelse, self._pos(meta), end, else_end)

    @v_args(meta=True)
    def condition(self, meta, children):
        if len(children) == 1:
            return ir.Condition(children[0], pos=self._pos(meta))
        left, op, right = children
        return ir.Condition(left, str(op), right, self._pos(meta))

    def ref_operand(self, children):
        (token,) = children
        text, pos = str(token), self._pos(token)
        if text in ("true", "false"):
            return ir.Literal(text == "true", pos)
        if text == "tp":
            return ir.Var("tp", pos)
        head, _, name = text.partition(".")
        if head != "config" or not name.isidentifier():
            self.errors.append(
                Diagnostic(
                    pos,
                    f"a condition reads `config.ATTR`, `tp`, an integer, true or false, "
                    f"not '{text}'",
                    len(text),
                )
            )
        return ir.ConfigRef(name if name.isidentifier() else text, pos)

    def int_operand(self, children):
        return ir.Literal(self._int(children[0]), self._pos(children[0]))

    @v_args(meta=True)
    def set_attr(self, meta, children):
        target, expr = children
        full = self._pattern(target)
        attr = full.segments[-1]
        if not isinstance(attr, str) or not attr.isidentifier():
            self.errors.append(
                Diagnostic(
                    full.pos,
                    f"`set` needs MODULE.ATTR ending in an attribute name, not '{attr}'",
                    len(target),
                )
            )
            attr = str(attr)
        module = ir.Pattern(full.segments[:-1], full.pos)
        return ir.SetAttr(module, attr, expr, self._pos(meta))

    @v_args(meta=True)
    def style(self, meta, children):
        name, *options = children
        return ir.Style(str(name), tuple(options), self._pos(name))

    def option(self, children):
        key, (value, value_pos) = children
        return ir.Option(str(key), value, self._pos(key), value_pos)

    def int_value(self, children):
        return self._int(children[0]), self._pos(children[0])

    def name_value(self, children):
        (name,) = children
        value: ir.OptionValue = {"true": True, "false": False}.get(str(name), str(name))
        if value in ("replicate", "partial"):
            value = ir.Layout(str(name))
        return value, self._pos(name)

    def call_value(self, children):
        name, arg = children
        # Only shard(DIM) takes an argument; anything else stays a string for `check` to reject by
        # name.
        value = ir.Layout("shard", self._int(arg)) if str(name) == "shard" else f"{name}({arg})"
        return value, self._pos(name)

    def call_name_value(self, children):
        name, arg = children
        return f"{name}({arg})", self._pos(name)

    @v_args(meta=True)
    def list_value(self, meta, children):
        items = tuple(str(v) if isinstance(v, ir.Layout) else v for v, _ in children)
        return ir.PartList(items), self._pos(meta)

    def binop(self, children):
        left, op, right = children
        return ir.BinOp(str(op), left, right, self._pos(op))

    def num(self, children):
        return ir.Num(self._int(children[0]), self._pos(children[0]))

    def var(self, children):
        return ir.Var(str(children[0]), self._pos(children[0]))


def _split_pattern(text: str) -> list[str]:
    # Dots inside `[a..b]` are not separators.
    return re.split(r"\.(?![.\d]*\])", text)


def _comments(text: str, file: str) -> tuple[ir.Comment, ...]:
    # The language has no string literals, so every '#' starts a comment.
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # the grammar breaks lines at \n only
        idx = line.find("#")
        if idx >= 0:
            out.append(
                ir.Comment(line[idx:].rstrip(), Pos(file, n, idx + 1), bool(line[:idx].strip()))
            )
    return tuple(out)


def _nesting_error(tree: Tree, file: str) -> Diagnostic | None:
    stack = [(tree, 0, 0)]
    # iterative: the transformer below and `dtp fmt` recurse, so depth is bounded first
    while stack:
        node, depth, expr = stack.pop()
        if node.data in ("block", "when_block"):
            depth += 1
            if depth > MAX_NESTING:
                return Diagnostic(
                    Pos(file, node.meta.line, node.meta.column),
                    f"blocks nested more than {MAX_NESTING} deep",
                )
        elif node.data == "binop":
            expr += 1
            if expr > MAX_EXPR_DEPTH:
                return Diagnostic(
                    Pos(file, node.meta.line, node.meta.column),
                    f"expression nested more than {MAX_EXPR_DEPTH} operators deep; "
                    "a `set` expression is a short formula such as `n_heads / tp`",
                )
        stack.extend((c, depth, expr) for c in node.children if isinstance(c, Tree))
    return None


def parse(text: str, file: str = "<plan>") -> ir.Plan:
    """Parse .tp source text into a Plan; raises PlanError with positions on any mistake."""
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise PlanError(
            [
                Diagnostic(
                    Pos(file, line, 1),
                    "this is a binary file, not a .tp plan (it contains NUL bytes)",
                )
            ],
            None,
        )
    if not text.strip():
        raise PlanError(
            [Diagnostic(Pos(file, 1, 1), "empty plan; a plan starts with `dtp 1`")], text
        )
    try:
        tree = parser().parse(text)
    except UnexpectedInput as err:
        raise PlanError([_syntax_diagnostic(err, text, file)], text) from None
    nested = _nesting_error(tree, file)
    if nested:
        raise PlanError([nested], text)
    builder = _ToIR(file)
    try:
        plan = builder.transform(tree)
    # a bug in the builder, not the user's plan: keep the original exception
    except VisitError as err:
        raise err.orig_exc from None
    if builder.errors:
        raise PlanError(builder.errors, text)
    return dataclasses.replace(plan, comments=_comments(text, file), source=text)


_PLAN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?")


def shipped_plans() -> dict[str, Path]:
    """The plans dtp ships, by name: `gpt2` for plans/gpt2.tp, `hf/llama` for plans/hf/llama.tp."""
    root = shipped("plans")
    return dict(sorted((str(p.relative_to(root).with_suffix("")), p) for p in root.rglob("*.tp")))


def resolve_plan(path: str | Path) -> Path:
    """PLAN as given: a file, or the name of a shipped plan (`gpt2`, `hf/llama`) that is not a file
    here, so that an installed dtp runs its own Quickstart from any directory."""
    given = Path(path)
    if given.exists() or given.suffix == ".tp" or not _PLAN_NAME.fullmatch(str(path)):
        return given
    found = shipped_plans().get(str(path))
    if found is None:
        near = did_you_mean(str(path), list(shipped_plans()))
        raise UsageError(
            f"plan {path} is neither a file nor a plan dtp ships{near}; `dtp plans` lists them"
        )
    return found


def read_plan_text(path: str | Path) -> str:
    """A plan file's text; unreadable, special, oversized, binary or non-UTF-8 files are clean
    errors."""
    path = resolve_plan(path)
    if path.is_dir():
        raise UsageError(f"{path} is a directory, not a .tp plan file")
    try:
        # /dev/zero never ends and opening a FIFO waits for a writer: open without blocking, then
        # look at what was opened
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UsageError(
                    f"{path} is not a regular file (a device, FIFO or socket); a plan is a text "
                    "file"
                )
            data = f.read(MAX_PLAN_BYTES + 1)
    except FileNotFoundError:
        raise UsageError(f"plan file {path} does not exist") from None
    except OSError as err:
        raise UsageError(f"cannot read plan file {path}: {err.strerror}") from None
    if len(data) > MAX_PLAN_BYTES:
        raise UsageError(
            f"plan file {path} is larger than {MAX_PLAN_BYTES // 2**20} MiB; a plan is a page of "
            "text"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise PlanError(
            [
                Diagnostic(
                    Pos(str(path), line, column),
                    f"not UTF-8 text (byte {data[err.start]:#04x}); a .tp plan is a text file",
                )
            ]
        ) from None


def load(path: str | Path) -> ir.Plan:
    """Read (`read_plan_text`) and parse a .tp file."""
    return parse(read_plan_text(path), str(path))
