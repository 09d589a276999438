"""What each plan style does to a module's parameters: the static placement table shared by check,
explain and compile.

Megatron's layout: colwise shards a Linear's output features (weight dim 0), rowwise its input
features (weight dim 1, bias replicated), vocab_parallel shards the vocabulary rows of an embedding
or of the output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from dtp.layout.experts import experts_layout
from dtp.layout.modules import features, is_conv1d, is_linear
from dtp.layout.parts import local_rows, reduced_rows


@dataclass(frozen=True)
class ParamPlacement:
    """Where one parameter lives across the tp dimension."""

    shard_dim: int | None = None  # None: replicated
    packed: int = 1  # >1: the sharded dim holds `packed` equal parts, each sharded separately
    # Unequal packed parts, in order: (size, sharded). A part that is not sharded is held whole by
    # every rank (multi-query k/v), so its rows are duplicated across ranks and their gradient
    # all-reduced. An int instead of a bool is repeat(kv) of that many heads (dtp/layout/parts.py).
    parts: tuple[tuple[int, bool | int], ...] = ()

    def __str__(self) -> str:
        if self.shard_dim is None:
            return "Replicate()"
        if self.parts:
            shown = ",".join(
                f"{n}" if kind is True else f"{n}r" if kind is False else f"{n}h{kind}"
                for n, kind in self.parts
            )
            return f"Shard({self.shard_dim}) parts[{shown}]"
        return f"Shard({self.shard_dim})" + (f" packed×{self.packed}" if self.packed > 1 else "")

    def replicated_rows(self, tp: int) -> int:
        """Rows of the sharded dim whose gradient is all-reduced (replicated parts, repeated heads)."""
        return sum(reduced_rows(n, kind, tp) for n, kind in self.parts)

    def local_shape(self, shape: tuple[int, ...], tp: int, rank: int = 0) -> tuple[int, ...]:
        """The shape `rank` holds: torch.chunk's layout, so uneven sizes leave the last ranks
        shorter (only vocabularies may be uneven; `check` demands even division elsewhere)."""
        if self.shard_dim is None:
            return shape
        out = list(shape)
        if self.parts:
            out[self.shard_dim] = sum(local_rows(n, kind, tp) for n, kind in self.parts)
            return tuple(out)
        n = out[self.shard_dim]
        chunk = -(-n // tp)
        out[self.shard_dim] = max(0, min(chunk, n - chunk * rank))
        return tuple(out)

    def is_uneven(self, shape: tuple[int, ...], tp: int) -> bool:
        """Whether ranks hold different amounts."""
        return self.shard_dim is not None and not self.parts and shape[self.shard_dim] % tp != 0


REPLICATE = ParamPlacement()


def param_placements(
    style: str | None,
    module: nn.Module,
    packed: int = 1,
    parts: tuple[tuple[int, bool | int], ...] = (),
    sliced: tuple[str, ...] = (),
    dim: int = 0,
) -> dict[str, ParamPlacement]:
    """ParamPlacement of each of `module`'s own parameters (not its children's) under `style`
    (`sliced`, `dim`: slice_params' names and heads dimension)."""
    names = [n for n, _ in module.named_parameters(recurse=False)]
    table: dict[str, ParamPlacement] = {}
    conv = is_conv1d(module)  # weight (in, out): the output features are dim 1
    if style == "colwise":
        table = {
            "weight": ParamPlacement(1 if conv else 0, packed, parts),
            "bias": ParamPlacement(0, packed, parts),
        }
    elif style == "rowwise":
        table = {"weight": ParamPlacement(0 if conv else 1)}
    # each expert's FFN dimension (dtp/layout/experts.py); down_proj_bias: added once
    elif style == "experts":
        # None on a module the style does not fit (check reports it)
        layout = experts_layout(module)
        if layout is not None:
            halves = 2 if layout.concatenated else 1  # [gate; up]: two packed parts
            table = {
                "gate_up_proj": ParamPlacement(2 if layout.transposed else 1, halves),
                "down_proj": ParamPlacement(1 if layout.transposed else 2),
                "gate_up_proj_bias": ParamPlacement(1, halves),
                "down_proj_bias": REPLICATE,
            }
    elif style == "vocab_parallel":
        table = {"weight": ParamPlacement(0), "bias": ParamPlacement(0)}
    elif style == "sharded_norm":  # laid out as the colwise output it normalises
        table = {"weight": ParamPlacement(0, packed, parts)}
    elif style == "slice_params":  # this rank's heads (dtp/compiler/head_slices.py)
        table = dict.fromkeys(sliced, ParamPlacement(dim))
    return {n: table.get(n, REPLICATE) for n in names}


def sharded_sizes(style: str, module: nn.Module, packed: int = 1) -> list[tuple[str, int]]:
    """(dimension description, size) pairs that tp must divide for `style` on `module`."""
    if style == "experts":
        layout = experts_layout(module)
        if layout is None:
            return []
        dims = "dim 2, down_proj dim 1" if layout.transposed else "dim 1, down_proj dim 2"
        per = " per part" if layout.concatenated else " in gate/up pairs"
        return [
            (f"the expert FFN dimension of {layout.inter} (gate_up_proj {dims}{per})", layout.inter)
        ]
    conv = is_conv1d(module)
    fan_in, fan_out = features(module) if is_linear(module) else (0, 0)
    if style == "colwise":
        part = fan_out // packed
        what = f"out_features={fan_out}" + (
            f" per packed part ({packed} parts of {part})" if packed > 1 else ""
        )
        return [(f"{what} (weight dim {1 if conv else 0})", part)]
    if style == "rowwise":
        return [(f"in_features={fan_in} (weight dim {0 if conv else 1})", fan_in)]
    if style == "sharded_norm":
        width = module.weight.shape[0]
        return [
            (
                f"its {width} features (weight dim 0)"
                + (f" per packed part ({packed} parts)" if packed > 1 else ""),
                width // packed,
            )
        ]
    if style == "vocab_parallel":
        rows = module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features
        return [(f"the vocabulary of {rows} rows (weight dim 0)", rows)]
    return []
