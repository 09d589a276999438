"""Lowering: every claimed module's input and output layouts, the shared-input groups and the `set`
values at a tp, decided with no process group, so that the checker's flow analysis, `explain`'s
schedule and the compiler all read the same decisions."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from dtp.lang import conditions, ir
from dtp.lang.expr import evaluate
from dtp.lang.vocabulary import slice_names
from dtp.layout.attention import config_heads
from dtp.layout.modules import is_conv1d
from dtp.layout.placement import ParamPlacement
from dtp.layout.resolve import Resolution, set_target

SEQUENCE = Shard(1)


# styles that cut per-head tensors and leave activations alone
HEAD_SLICES = ("slice_input", "slice_params")


def to_placement(layout: ir.Layout) -> Placement:
    """A plan LAYOUT as a DTensor placement."""
    if layout.kind == "shard":
        return Shard(layout.dim)
    return Partial() if layout.kind == "partial" else Replicate()


@dataclass(frozen=True)
class ModuleLayout:
    """What one claimed module does with its activations."""

    style: str  # plan style
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
class Lowered:
    """Every layout decision, made without a process group."""

    modules: dict[str, ModuleLayout]
    shared_inputs: dict[str, tuple[str, ...]]  # parent → colwise children that share its input
    # (the parent receives the block's input layout and hands its children a Replicate DTensor)
    # module path ("" = the model) → attribute values at this tp
    rewrites: dict[str, dict[str, int]]
    sequence_parallel: bool  # activations between blocks are sharded on the sequence
    loss_parallel: bool  # the output projection keeps logits sharded on the vocabulary


def rewrite(module: nn.Module, values: dict[str, int]) -> None:
    """Set `module`'s attributes to `values` (a `set`'s result at a tp). `HOLDER.ATTR` rewrites an
    attribute of a plain object the module holds (Phi-3's `self.config`, shared by every module and
    the model) copy-on-write: the module gets its own shallow copy with the new value, so no other
    module, the model's own config or a reference copy of the model sees the change."""
    copies: dict[str, object] = {}
    for attr, value in values.items():
        holder, _, name = attr.rpartition(".")
        if not holder:
            setattr(module, attr, value)
            continue
        if holder not in copies:
            copies[holder] = copy.copy(getattr(module, holder))
            setattr(module, holder, copies[holder])
        setattr(copies[holder], name, value)


def _layout(style: ir.Style, key: str, default: Placement) -> Placement:
    value = style.option(key)
    return to_placement(value) if isinstance(value, ir.Layout) else default


def module_layout(style: ir.Style, module: nn.Module, sp: bool) -> ModuleLayout | None:
    """What `style` does with `module`'s activations (None: replicate, nothing to do); `sp`:
    sequence parallel."""
    # With sequence parallelism the residual stream between blocks is a DTensor sharded on the
    # sequence: colwise layers all-gather their input, rowwise layers reduce-scatter their output
    # and hand the residual a DTensor (Megatron-SP's g and ḡ).
    between = SEQUENCE if sp else Replicate()
    local = style.option("local", not sp)
    name = style.name
    if name == "colwise":
        return ModuleLayout(
            name,
            False,
            _layout(style, "input", between),
            _layout(style, "output", Shard(-1)),
            style.option("local", True),
        )
    if name == "rowwise":
        return ModuleLayout(
            name,
            False,
            _layout(style, "input", Shard(-1)),
            _layout(style, "output", between),
            local,
        )
    if name == "vocab_parallel" and isinstance(module, nn.Embedding):
        return ModuleLayout(
            name,
            True,
            _layout(style, "input", Replicate()),
            _layout(style, "output", between),
            local,
        )
    if name == "vocab_parallel":
        return ModuleLayout(name, False, _layout(style, "input", between), Shard(-1), False)
    if name == "sequence_parallel":
        return ModuleLayout(name, False, SEQUENCE, SEQUENCE, False)
    if name == "experts":
        return ModuleLayout(name, False, Replicate(), Replicate(), True)
    if name in HEAD_SLICES:
        return ModuleLayout(name, False, None, None, True)
    # between a colwise layer and its consumer: local feature slices in and out
    if name == "sharded_norm":
        return ModuleLayout(name, False, Shard(-1), Shard(-1), True)
    if style.option("reduce_grad", False) is True:
        return ModuleLayout(name, False, None, None, True, reduce_grad=True)
    return None  # replicate


def lower(res: Resolution, tp: int) -> Lowered:
    """Layouts for every module the plan claims, the shared-input groups and the `set` values at
    `tp`."""
    sp = res.sequence_parallel
    modules: dict[str, ModuleLayout] = {}
    for path, rule in res.claims.items():
        layout = module_layout(rule.style, res.modules[path], sp)
        if layout is not None and layout.style in HEAD_SLICES:
            info = config_heads(res.modules[""])
            layout = replace(
                layout,
                slice_names=slice_names(rule.style),
                heads=info.n_head if info else 0,
                slice_dim=int(rule.style.option("dim", 0)),
            )
        if layout is not None and layout.style == "sharded_norm":
            layout = replace(layout, placements=tuple(res.placements(path).items()))
        if layout is not None and layout.style == "colwise":
            # packed parts (equal or not) and Conv1D need dtp's own placements
            placed = res.placements(path)
            special = is_conv1d(res.modules[path]) or any(
                p.parts or p.packed > 1 for p in placed.values()
            )
            layout = replace(layout, placements=tuple(placed.items()) if special else ())
        if layout is not None:
            modules[path] = layout
    # A shared input changes what every child of the parent receives, so only a parent whose colwise
    # children all take the default input layout (written or not) gets one.
    between = SEQUENCE if sp else Replicate()
    groups: dict[str, list[str]] = {}
    for path, layout in modules.items():
        if layout.style == "colwise" and "." in path:
            groups.setdefault(path.rpartition(".")[0], []).append(path)
    # (A parent whose own style leaves its activations alone, slice_input or slice_params, may have
    # one too.)
    shared = {
        parent: tuple(c)
        for parent, c in groups.items()
        if len(c) > 1
        and (parent not in modules or modules[parent].style in HEAD_SLICES)
        and all(modules[p].input == between for p in c)
    }
    for children in shared.values():  # they receive the parent's input already replicated
        for path in children:
            modules[path] = replace(modules[path], input=Replicate())
    rewrites: dict[str, dict[str, int]] = {}
    for (path, attr), stmt in res.sets.items():
        attrs = vars(set_target(res.modules[path], attr)[0])
        rewrites.setdefault(path, {})[attr] = evaluate(
            stmt.expr,
            lambda v: (
                tp
                if v.name == "tp"
                else conditions.config_int(res.modules[""], v)
                if v.name.startswith("config.")
                else attrs[v.name]
            ),
        )
    loss = any(m.style == "vocab_parallel" and not m.embedding for m in modules.values())
    return Lowered(modules, shared, rewrites, sp, loss)
