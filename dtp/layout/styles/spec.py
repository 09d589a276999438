"""What a plan style is: `StyleSpec`, the one object that holds its name (`Style`), its options,
what it does to a module's parameters, the sizes tp must divide, its activation layouts and the
collectives of one training step. The styles themselves are the modules beside this one; SPECS in
the package face gathers them.

No process group is needed for any of it: the checker, `explain`, the cost model and the compiler
all read the same decisions from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from dtp.lang import ir
from dtp.lang.vocabulary import OPTIONS, Style
from dtp.layout.placement import REPLICATE, ParamPlacement

# the residual stream between blocks under sequence parallelism: (batch, seq/tp, hidden)
SEQUENCE = Shard(1)


@dataclass(frozen=True)
class ModuleLayout:
    """What one claimed module does with its activations."""

    style: Style
    embedding: bool  # vocab_parallel on nn.Embedding (else on the output Linear)
    input: Placement | None  # how its input arrives (None: not a tensor-parallel boundary)
    output: Placement | None  # what it hands on
    local: bool  # hand on a local tensor (True) or a DTensor
    # Parameter placements for the layouts torch's styles lack (Conv1D, unequal or replicated
    # parts):
    placements: tuple[tuple[str, ParamPlacement], ...] = ()
    reduce_grad: bool = False  # replicate(reduce_grad=true)
    # slice_input / slice_params(name=…): the inputs or parameters cut
    slice_names: tuple[str, ...] = ()
    heads: int = 0  # the config's attention heads (slice_input)
    slice_dim: int = 0  # slice_input / slice_params(dim=…): the dimension holding the heads


@dataclass(frozen=True)
class LayoutContext:
    """What a style's layout reads beyond its rule and module."""

    sp: bool  # sequence parallel: the stream between blocks is SEQUENCE
    placements: Mapping[str, ParamPlacement]  # the module's own parameters under its rule
    heads: int = 0  # the model config's attention heads (0: unknown)

    @property
    def between(self) -> Placement:
        """The layout of the residual stream between blocks."""
        return SEQUENCE if self.sp else Replicate()


class NotModeled(Exception):
    """A layout the analytic cost model does not cover (e.g. a partial input); explain says so."""


@dataclass(frozen=True)
class Region:
    """One claimed module as the cost model prices it: `add(op, phase, width, reason, nbytes=None,
    sequence=False)` records a collective of `width` features per token (or `nbytes`), `enter`
    prices the module's input once per group of siblings sharing it."""

    path: str
    module: nn.Module
    layout: ModuleLayout
    model: nn.Module
    tokens: int  # per data-parallel rank
    elem: int  # bytes per element of the activations
    add: Callable[..., None]
    enter: Callable[[int], None]

    def leave(self, placement: Placement, width: int) -> None:
        """The partial sums a row-parallel region hands on: g (replicated) or Megatron-SP's
        reduce-scatter (sequence shards)."""
        if placement == Replicate():
            self.add("all_reduce", "forward", width, "partial sums (g)")
        elif placement == SEQUENCE:
            self.add(
                "reduce_scatter", "forward", width, "partial sums to sequence shards", sequence=True
            )
            self.add("all_gather", "backward", width, "gradient", sequence=True)
        else:
            raise NotModeled(f"{self.path}: output {placement}")

    def reduce_param_grads(self) -> None:
        """Every own parameter held whole by each rank, its gradient all-reduced."""
        for name, p in self.module.named_parameters(recurse=False):
            self.add(
                "all_reduce", "backward", 0, f"gradient of replicated {name}", p.numel() * self.elem
            )


def enter_cost(add: Callable[..., None], placement: Placement, width: int, what: str, path: str):
    """A column-parallel region's input: f (replicated) or Megatron-SP's all-gather (sequence
    shards)."""
    if placement == Replicate():
        add("all_reduce", "backward", width, f"{what}: gradient (f)")
    elif placement == SEQUENCE:
        add("all_gather", "forward", width, f"{what}: sequence gather", sequence=True)
        add("reduce_scatter", "backward", width, f"{what}: gradient", sequence=True)
    else:
        raise NotModeled(f"{path}: input {placement}")


def to_placement(layout: ir.Layout) -> Placement:
    """A plan LAYOUT as a DTensor placement."""
    if layout.kind == "shard":
        return Shard(layout.dim)
    return Partial() if layout.kind == "partial" else Replicate()


def written(style: ir.Style, key: str, default: Placement) -> Placement:
    """The layout option `key` as written, else `default`."""
    value = style.option(key)
    return to_placement(value) if isinstance(value, ir.Layout) else default


def _nothing(*args, **kwargs) -> None:
    return None


def _no_params(module: nn.Module, **kwargs) -> dict[str, ParamPlacement]:
    return {}


def _no_sizes(module: nn.Module, packed: int) -> list[tuple[str, int]]:
    return []


@dataclass(frozen=True)
class StyleSpec:
    """Everything dtp knows about one style, except its ParallelStyle, which needs a process group:
    dtp/compiler/compiler.py maps each Style to one (a test holds the table whole).

    - `options`: each option's kind of value, the language's (dtp/lang/vocabulary.py), which
      `dtp check PLAN` reads without torch;
    - `params(module, packed=, parts=, sliced=, dim=)`: its own parameters' placements (the rest
      replicated);
    - `sizes(module, packed)`: (description, size) pairs tp must divide;
    - `layout(rule_style, module, ctx)`: its ModuleLayout, None where activations are untouched;
    - `collectives(region)`: its collectives of one training step at tp > 1 (cost/schedule.py).
    """

    style: Style
    summary: str  # one line: what it does
    params: Callable[..., dict[str, ParamPlacement]] = _no_params
    sizes: Callable[[nn.Module, int], list[tuple[str, int]]] = _no_sizes
    layout: Callable[[ir.Style, nn.Module, LayoutContext], ModuleLayout | None] = _nothing
    collectives: Callable[[Region], None] = _nothing

    @property
    def options(self) -> Mapping[str, str]:
        """Each option the style takes, with the kind of value it takes."""
        return OPTIONS[self.style]

    def placements(self, module: nn.Module, **kwargs) -> dict[str, ParamPlacement]:
        """ParamPlacement of each of `module`'s own parameters (not its children's)."""
        table = self.params(module, **kwargs)
        return {n: table.get(n, REPLICATE) for n, _ in module.named_parameters(recurse=False)}
