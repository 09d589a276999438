"""The plan language's vocabulary: the styles, the options each takes, and readers of option values
that need no model (how many equal packed parts, which names a slice rule cuts)."""

from __future__ import annotations

from dtp.lang import ir

STYLES = (
    "colwise",
    "rowwise",
    "vocab_parallel",
    "sequence_parallel",
    "replicate",
    "experts",
    "slice_input",
    "sharded_norm",
    "slice_params",
)


# The options each style accepts, with the kind of value each takes.
OPTIONS: dict[str, dict[str, str]] = {
    "colwise": {"input": "layout", "output": "layout", "local": "bool", "packed": "parts"},
    "rowwise": {"input": "layout", "output": "layout", "local": "bool"},
    "vocab_parallel": {"input": "layout", "output": "layout", "local": "bool"},
    "sequence_parallel": {},
    "replicate": {"reduce_grad": "bool"},
    "experts": {},
    # inputs (one name or a list) holding every head at dimension `dim` (0: (batch · heads, …)), cut
    # to this rank's
    "slice_input": {"name": "names", "dim": "index"},
    # an RMS norm over a colwise-sharded feature dim (dtp/compiler/sharded_norm.py)
    "sharded_norm": {"packed": "parts"},
    # an attention's own per-head parameters (one name or a list) holding every head at `dim`, cut
    # to this rank's
    "slice_params": {"name": "names", "dim": "index"},
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
