"""Lowering: every claimed module's input and output layouts, the shared-input groups and the `set`
values at a tp, decided with no process group, so that the checker's flow analysis, `explain`'s
schedule and the compiler all read the same decisions."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch.nn as nn
from torch.distributed.tensor import Replicate

from dtp.lang import conditions, ir
from dtp.lang.expr import evaluate
from dtp.layout.attention import config_heads
from dtp.layout.resolve import Resolution, set_target
from dtp.layout.styles import SPECS, Style
from dtp.layout.styles.spec import SEQUENCE, LayoutContext, ModuleLayout

# styles that cut per-head tensors and leave activations alone
HEAD_SLICES = (Style.SLICE_INPUT, Style.SLICE_PARAMS)


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


def module_layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout | None:
    """What `style` does with `module`'s activations (None: nothing to do), as its StyleSpec says;
    None for a name no style has (check reports it)."""
    spec = SPECS.get(style.name)
    return spec.layout(style, module, ctx) if spec else None


def lower(res: Resolution, tp: int) -> Lowered:
    """Layouts for every module the plan claims, the shared-input groups and the `set` values at
    `tp`."""
    sp = res.sequence_parallel
    info = (
        config_heads(res.modules[""])
        if any(r.style.name in HEAD_SLICES for r in res.claims.values())
        else None
    )
    heads = info.n_head if info else 0
    modules: dict[str, ModuleLayout] = {}
    for path, rule in res.claims.items():
        ctx = LayoutContext(sp, res.placements(path), heads)
        layout = module_layout(rule.style, res.modules[path], ctx)
        if layout is not None:
            modules[path] = layout
    # A shared input changes what every child of the parent receives, so only a parent whose colwise
    # children all take the default input layout (written or not) gets one.
    between = SEQUENCE if sp else Replicate()
    groups: dict[str, list[str]] = {}
    for path, layout in modules.items():
        if layout.style == Style.COLWISE and "." in path:
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
    loss = any(m.style == Style.VOCAB_PARALLEL and not m.embedding for m in modules.values())
    return Lowered(modules, shared, rewrites, sp, loss)
