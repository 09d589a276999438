"""Hypothesis strategies that build dtp.lang.ir.Plan objects which the grammar can express.

What the grammar cannot say, the strategies do not generate:
- a segment containing `**` other than `**` itself, and empty index ranges;
- a single-segment pattern that is a keyword (`dtp`, `plan`, `mesh`, `set`, `version`, `when`,
  `else`): it lexes as the keyword (`else {` on a line of its own is the stray-else error, by
  design);
- option values `true`/`false`/`replicate`/`partial` as plain strings: they parse as bools and
  layouts;
- the version is always 1 and the mesh is `tp` or `dp, tp` (anything else is an error by design).
"""

from __future__ import annotations

from hypothesis import strategies as st

from dtp.lang import ir
from dtp.lang.parse import MAX_INT

KEYWORDS = frozenset({"dtp", "plan", "mesh", "set", "version", "when", "else"})
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
_DIGITS = "0123456789"

# Names: [A-Za-z_][A-Za-z0-9_]*, biased towards the words plans really use.
names = st.one_of(
    st.sampled_from(
        [
            "tp",
            "a",
            "colwise",
            "rowwise",
            "packed",
            "input",
            "output",
            "local",
            "out_features",
            "in_features",
            "head_dim",
            "x1",
            "_",
            "shard",
            "set",
            "plan",
            "mesh",
            "version",
            "dtp",
        ]
    ),
    st.text(_LETTERS, min_size=1, max_size=1).flatmap(
        lambda first: st.text(_LETTERS + _DIGITS, max_size=8).map(lambda rest: first + rest)
    ),
)

small_ints = st.integers(0, 2**20)
ints = st.one_of(small_ints, st.integers(0, MAX_INT), st.just(MAX_INT))

# ---- patterns ---------------------------------------------------------------------------------------

name_segments = st.one_of(
    st.sampled_from(
        ["transformer", "h", "attn", "c_attn", "c_*", "*", "ln_?", "0", "11", "lm_head", "?"]
    ),
    st.text(_LETTERS + _DIGITS + "*?", min_size=1, max_size=8).filter(lambda s: "**" not in s),
)
ranges = st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).map(
    lambda t: ir.IndexRange(min(t), max(t))
)
segments = st.one_of(name_segments, st.just("**"), ranges)


@st.composite
def patterns(draw, min_size: int = 1, max_size: int = 4) -> ir.Pattern:
    segs = tuple(draw(st.lists(segments, min_size=min_size, max_size=max_size)))
    if len(segs) == 1 and segs[0] in KEYWORDS:
        segs = (segs[0] + "_",)
    return ir.Pattern(segs)


# ---- styles -----------------------------------------------------------------------------------------

layouts = st.one_of(
    st.sampled_from([ir.Layout("replicate"), ir.Layout("partial")]),
    st.integers(-MAX_INT, MAX_INT).map(lambda d: ir.Layout("shard", d)),
)
word_values = names.filter(lambda n: n not in ("true", "false", "replicate", "partial"))
call_values = st.tuples(names.filter(lambda n: n != "shard"), st.integers(-(10**6), 10**6)).map(
    lambda t: f"{t[0]}({t[1]})"
)
option_values = st.one_of(ints, st.booleans(), layouts, word_values, call_values)
options = st.builds(ir.Option, names, option_values)
styles = st.builds(ir.Style, names, st.lists(options, max_size=3).map(tuple))

# ---- expressions --------------------------------------------------------------------------------------

exprs = st.recursive(
    st.one_of(ints.map(ir.Num), names.map(ir.Var)),
    lambda inner: st.builds(ir.BinOp, st.sampled_from("+-*/"), inner, inner),
    max_leaves=12,
)


@st.composite
def set_attrs(draw) -> ir.SetAttr:
    pattern = draw(patterns(min_size=0, max_size=3))
    attr = draw(names)
    if not pattern.segments and attr in KEYWORDS:
        attr += "_"
    return ir.SetAttr(pattern, attr, draw(exprs))


# ---- statements and plans --------------------------------------------------------------------------------

rules = st.builds(ir.Rule, patterns(), styles)


def statements(depth: int = 3) -> st.SearchStrategy:
    """Rules, set statements and (while depth allows) blocks of them."""
    leaves = st.one_of(rules, set_attrs())
    if depth == 0:
        return leaves
    blocks = st.builds(ir.Block, patterns(), st.lists(statements(depth - 1), max_size=3).map(tuple))
    return st.one_of(leaves, leaves, blocks)


plan_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,12}", fullmatch=True)


@st.composite
def plans(draw) -> ir.Plan:
    name = draw(st.none() | plan_names)
    plan_version = draw(st.none() | ints) if name is not None else None
    mesh = draw(st.sampled_from([("tp",), ("dp", "tp")]))
    body = tuple(draw(st.lists(statements(3), max_size=5)))
    return ir.Plan(1, body, name, plan_version, mesh)
