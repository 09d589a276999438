"""Where a parameter lives across the tp dimension: `ParamPlacement`, the unit in which each style
(dtp/layout/styles) states what it does to a module's parameters, read by check, explain, compile
and checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

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
