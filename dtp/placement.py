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

STYLES = ("colwise", "rowwise", "vocab_parallel", "sequence_parallel", "replicate", "experts", "slice_input",
          "sharded_norm", "slice_params")

# The options each style accepts, with the kind of value each takes.
OPTIONS: dict[str, dict[str, str]] = {
    "colwise": {"input": "layout", "output": "layout", "local": "bool", "packed": "parts"},
    "rowwise": {"input": "layout", "output": "layout", "local": "bool"},
    "vocab_parallel": {"input": "layout", "output": "layout", "local": "bool"},
    "sequence_parallel": {},
    "replicate": {"reduce_grad": "bool"},
    "experts": {},
    # inputs (one name or a list) holding every head at dimension `dim` (0: (batch · heads, …)), cut to this rank's
    "slice_input": {"name": "names", "dim": "index"},
    "sharded_norm": {"packed": "parts"},  # an RMS norm over a colwise-sharded feature dim (dtp/sharded_norm.py)
    # an attention's own per-head parameters (one name or a list) holding every head at `dim`, cut to this rank's
    "slice_params": {"name": "names", "dim": "index"},
}


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2): a linear layer whose weight is stored transposed, (in, out)."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def is_linear(module: nn.Module) -> bool:
    """nn.Linear (or a subclass such as Falcon's FalconLinear) or transformers' Conv1D."""
    import torch.nn as nn

    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or a Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def norm_width(module: nn.Module) -> int:
    """The features a norm with a 1-D weight normalises (0 for anything else)."""
    weight = getattr(module, "weight", None)
    return weight.shape[0] if weight is not None and weight.dim() == 1 else 0


def is_experts(module: nn.Module) -> bool:
    """A module holding every expert's FFN as 3-D parameters dtp can split (dtp/experts.py)."""
    from dtp.experts import experts_layout

    return experts_layout(module) is not None


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm, or a model's own `*LayerNorm`/`*RMSNorm` class (Hugging Face's LlamaRMSNorm)."""
    import torch.nn as nn

    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("RMSNorm", "LayerNorm"))


def module_fits(style: str, module: nn.Module, vocab: int | None) -> str | None:
    """None when `style` can apply to `module`, else what the style needs."""
    import torch.nn as nn

    if style in ("colwise", "rowwise"):
        return None if is_linear(module) else f"{style} applies to nn.Linear or transformers' Conv1D"
    if style == "experts":
        return None if is_experts(module) else (
            "experts applies to a module with 3-D expert parameters gate_up_proj (E, 2·I, H) and down_proj "
            "(E, H, I), or transposed (E, H, 2·I) and (E, I, H), optionally gate_up_proj_bias (E, 2·I) and "
            "down_proj_bias (E, H), and no other parameters of its own")
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
    if style == "sharded_norm":
        weight = getattr(module, "weight", None)
        if is_norm(module) and isinstance(weight, nn.Parameter) and weight.dim() == 1:
            return None
        return "sharded_norm applies to an RMS norm with a 1-D weight"
    return None


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives across the tp dimension."""

    shard_dim: int | None = None  # None: replicated
    packed: int = 1  # >1: the sharded dim holds `packed` equal parts, each sharded separately
    # Unequal packed parts, in order: (size, sharded). A part that is not sharded is held whole by every
    # rank (multi-query k/v), so its rows are duplicated across ranks and their gradient all-reduced.
    # An int instead of a bool is repeat(kv) of that many heads (dtp/parts.py).
    parts: tuple[tuple[int, bool | int], ...] = ()

    def __str__(self) -> str:
        if self.shard_dim is None:
            return "Replicate()"
        if self.parts:
            shown = ",".join(f"{n}" if kind is True else f"{n}r" if kind is False else f"{n}h{kind}"
                             for n, kind in self.parts)
            return f"Shard({self.shard_dim}) parts[{shown}]"
        return f"Shard({self.shard_dim})" + (f" packed×{self.packed}" if self.packed > 1 else "")

    def replicated_rows(self, tp: int) -> int:
        """Rows of the sharded dim whose gradient is all-reduced (replicated parts, repeated heads)."""
        from dtp.parts import reduced_rows
        return sum(reduced_rows(n, kind, tp) for n, kind in self.parts)

    def local_shape(self, shape: tuple[int, ...], tp: int, rank: int = 0) -> tuple[int, ...]:
        """The shape `rank` holds: torch.chunk's layout, so uneven sizes leave the last ranks shorter
        (only vocabularies may be uneven; `check` demands even division elsewhere)."""
        if self.shard_dim is None:
            return shape
        out = list(shape)
        if self.parts:
            from dtp.parts import local_rows
            out[self.shard_dim] = sum(local_rows(n, kind, tp) for n, kind in self.parts)
            return tuple(out)
        n = out[self.shard_dim]
        chunk = -(-n // tp)
        out[self.shard_dim] = max(0, min(chunk, n - chunk * rank))
        return tuple(out)

    def is_uneven(self, shape: tuple[int, ...], tp: int) -> bool:
        """Whether ranks hold different amounts."""
        return self.shard_dim is not None and not self.parts and shape[self.shard_dim] % tp != 0


REPLICATE = Placement()


def param_placements(style: str | None, module: nn.Module, packed: int = 1,
                     parts: tuple[tuple[int, bool | int], ...] = (), sliced: tuple[str, ...] = (),
                     dim: int = 0) -> dict[str, Placement]:
    """Placement of each of `module`'s own parameters (not its children's) under `style` (`sliced`, `dim`:
    slice_params' names and heads dimension)."""
    names = [n for n, _ in module.named_parameters(recurse=False)]
    table: dict[str, Placement] = {}
    conv = is_conv1d(module)  # weight (in, out): the output features are dim 1
    if style == "colwise":
        table = {"weight": Placement(1 if conv else 0, packed, parts), "bias": Placement(0, packed, parts)}
    elif style == "rowwise":
        table = {"weight": Placement(0 if conv else 1)}
    elif style == "experts":  # each expert's FFN dimension (dtp/experts.py)
        from dtp.experts import experts_layout

        layout = experts_layout(module)  # None on a module the style does not fit (check reports it)
        table = layout.placements() if layout else {}
    elif style == "vocab_parallel":
        table = {"weight": Placement(0), "bias": Placement(0)}
    elif style == "sharded_norm":  # laid out as the colwise output it normalises
        table = {"weight": Placement(0, packed, parts)}
    elif style == "slice_params":  # this rank's heads (dtp/head_slices.py)
        table = dict.fromkeys(sliced, Placement(dim))
    return {n: table.get(n, REPLICATE) for n in names}


def sharded_sizes(style: str, module: nn.Module, packed: int = 1) -> list[tuple[str, int]]:
    """(dimension description, size) pairs that tp must divide for `style` on `module`."""
    import torch.nn as nn

    if style == "experts":
        from dtp.experts import experts_layout

        layout = experts_layout(module)
        if layout is None:
            return []
        dims = "dim 2, down_proj dim 1" if layout.transposed else "dim 1, down_proj dim 2"
        per = " per part" if layout.concatenated else " in gate/up pairs"
        return [(f"the expert FFN dimension of {layout.inter} (gate_up_proj {dims}{per})", layout.inter)]
    conv = is_conv1d(module)
    fan_in, fan_out = features(module) if is_linear(module) else (0, 0)
    if style == "colwise":
        part = fan_out // packed
        what = f"out_features={fan_out}" + (f" per packed part ({packed} parts of {part})" if packed > 1 else "")
        return [(f"{what} (weight dim {1 if conv else 0})", part)]
    if style == "rowwise":
        return [(f"in_features={fan_in} (weight dim {0 if conv else 1})", fan_in)]
    if style == "sharded_norm":
        width = module.weight.shape[0]
        return [(f"its {width} features (weight dim 0)" + (f" per packed part ({packed} parts)" if packed > 1 else ""),
                 width // packed)]
    if style == "vocab_parallel":
        rows = module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features
        return [(f"the vocabulary of {rows} rows (weight dim 0)", rows)]
    return []
