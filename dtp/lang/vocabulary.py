"""The language's side of each style: its name (`Style`) and the options it takes, which `dtp check
PLAN` reads with no model and no torch; and readers of option values that need no model (how many
equal packed parts, which names a slice rule cuts). Everything else a style is, is its StyleSpec
(dtp/layout/styles), whose `options` are these."""

from __future__ import annotations

from enum import StrEnum

from dtp.lang import ir


class Style(StrEnum):
    """The plan language's styles, as written in a `.tp` file."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    VOCAB_PARALLEL = "vocab_parallel"
    SEQUENCE_PARALLEL = "sequence_parallel"
    REPLICATE = "replicate"
    EXPERTS = "experts"
    SLICE_INPUT = "slice_input"
    SHARDED_NORM = "sharded_norm"
    SLICE_PARAMS = "slice_params"


# The options each style accepts, with the kind of value each takes (a layout, a bool, `packed`'s
# parts, one name or a list, a dimension index).
OPTIONS: dict[Style, dict[str, str]] = {
    Style.COLWISE: {"input": "layout", "output": "layout", "local": "bool", "packed": "parts"},
    Style.ROWWISE: {"input": "layout", "output": "layout", "local": "bool"},
    Style.VOCAB_PARALLEL: {"input": "layout", "output": "layout", "local": "bool"},
    Style.SEQUENCE_PARALLEL: {},
    Style.REPLICATE: {"reduce_grad": "bool"},
    Style.EXPERTS: {},
    Style.SLICE_INPUT: {"name": "names", "dim": "index"},
    Style.SHARDED_NORM: {"packed": "parts"},
    Style.SLICE_PARAMS: {"name": "names", "dim": "index"},
}


def slice_names(style: ir.Style) -> tuple[str, ...]:
    """The inputs a `slice_input` rule names (one, or a list); empty when the option is missing or
    malformed."""
    value = style.option("name")
    items = value.items if isinstance(value, ir.PartList) else (value,)
    if not all(isinstance(i, str) and i.isidentifier() for i in items) or len(set(items)) != len(
        items
    ):
        return ()
    return tuple(items)


def packed(style: ir.Style) -> int:
    """The equal parts `packed=K` names (1 when the option is missing, a part list or malformed)."""
    value = style.option("packed", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def parts_option_ok(value: object) -> bool:
    """`packed` takes a positive integer (equal parts) or a part list."""
    if isinstance(value, ir.PartList):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
