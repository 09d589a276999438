"""What each plan style does to a module's parameters: the static placement table shared by check,
explain and compile.

Megatron's layout: colwise shards a Linear's output features (weight dim 0), rowwise its input features
(weight dim 1, bias replicated), vocab_parallel shards the vocabulary rows of an embedding or of the
output projection.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the functions that look at modules: `dtp check PLAN` needs none
    import torch.nn as nn

STYLES = ("colwise", "rowwise", "vocab_parallel", "sequence_parallel", "replicate")

# The options each style accepts, with the kind of value each takes.
OPTIONS: dict[str, dict[str, str]] = {
    "colwise": {"input": "layout", "output": "layout", "local": "bool", "packed": "int"},
    "rowwise": {"input": "layout", "output": "layout", "local": "bool"},
    "vocab_parallel": {"input": "layout", "output": "layout", "local": "bool"},
    "sequence_parallel": {},
    "replicate": {},
}


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm, or a model's own `*LayerNorm`/`*RMSNorm` class (Hugging Face's LlamaRMSNorm)."""
    import torch.nn as nn

    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("RMSNorm", "LayerNorm"))


def module_fits(style: str, module: nn.Module, vocab: int | None) -> str | None:
    """None when `style` can apply to `module`, else what the style needs."""
    import torch.nn as nn

    if style in ("colwise", "rowwise"):
        return None if isinstance(module, nn.Linear) else f"{style} applies to nn.Linear"
    if style == "vocab_parallel":
        if isinstance(module, nn.Embedding):
            return None
        if isinstance(module, nn.Linear):
            if vocab is None or module.out_features == vocab:
                return None
            return (f"vocab_parallel on an nn.Linear applies to the output projection (out_features == vocab "
                    f"size {vocab}), not one with out_features={module.out_features}")
        return "vocab_parallel applies to nn.Embedding or the output nn.Linear"
    if style == "sequence_parallel":
        if is_norm(module) or isinstance(module, nn.Dropout):
            return None
        return "sequence_parallel applies to LayerNorm, RMSNorm or Dropout"
    return None


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives across the tp dimension."""

    shard_dim: int | None = None  # None: replicated
    packed: int = 1  # >1: the sharded dim holds `packed` equal parts, each sharded separately

    def __str__(self) -> str:
        if self.shard_dim is None:
            return "Replicate()"
        return f"Shard({self.shard_dim})" + (f" packed×{self.packed}" if self.packed > 1 else "")

    def local_shape(self, shape: tuple[int, ...], tp: int, rank: int = 0) -> tuple[int, ...]:
        """The shape `rank` holds: torch.chunk's layout, so uneven sizes leave the last ranks shorter
        (only vocabularies may be uneven; `check` demands even division elsewhere)."""
        if self.shard_dim is None:
            return shape
        out = list(shape)
        n = out[self.shard_dim]
        chunk = -(-n // tp)
        out[self.shard_dim] = max(0, min(chunk, n - chunk * rank))
        return tuple(out)

    def is_uneven(self, shape: tuple[int, ...], tp: int) -> bool:
        """Whether ranks hold different amounts."""
        return self.shard_dim is not None and shape[self.shard_dim] % tp != 0


REPLICATE = Placement()


def param_placements(style: str | None, module: nn.Module, packed: int = 1) -> dict[str, Placement]:
    """Placement of each of `module`'s own parameters (not its children's) under `style`."""
    names = [n for n, _ in module.named_parameters(recurse=False)]
    table: dict[str, Placement] = {}
    if style == "colwise":
        table = {"weight": Placement(0, packed), "bias": Placement(0, packed)}
    elif style == "rowwise":
        table = {"weight": Placement(1)}
    elif style == "vocab_parallel":
        table = {"weight": Placement(0), "bias": Placement(0)}
    return {n: table.get(n, REPLICATE) for n in names}


def sharded_sizes(style: str, module: nn.Module, packed: int = 1) -> list[tuple[str, int]]:
    """(dimension description, size) pairs that tp must divide for `style` on `module`."""
    import torch.nn as nn

    if style == "colwise":
        part = module.out_features // packed
        what = f"out_features={module.out_features}" + (f" per packed part ({packed} parts of {part})" if packed > 1 else "")
        return [(f"{what} (weight dim 0)", part)]
    if style == "rowwise":
        return [(f"in_features={module.in_features} (weight dim 1)", module.in_features)]
    if style == "vocab_parallel":
        rows = module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features
        return [(f"the vocabulary of {rows} rows (weight dim 0)", rows)]
    return []
