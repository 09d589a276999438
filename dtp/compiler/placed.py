"""ParallelStyles for the layouts of Hugging Face families: transformers' transposed `Conv1D`,
packed parts of unequal sizes or kept whole (multi-query k/v), replicated parameters whose gradient
is all-reduced (per-head q/k norms), and 3-D expert parameters.

A parameter with packed parts is one `Shard(dim)` DTensor whose rank-r block is, part by part, rank
r's slice of a sharded part or the whole of a replicated part (`pack_parts`). Replicated parts are
therefore held tp times: each copy's gradient covers only that rank's heads, so a backward hook
all-reduces those rows, and `unpack_parts` reads the model's own layout back from the gathered
tensor.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn.utils.stateless import _reparametrize_module

from dtp.compiler.layer import TensorParallelGroup, become
from dtp.compiler.mappings import copy_to_ranks, sum_over_ranks
from dtp.layout.experts import experts_layout
from dtp.layout.modules import is_conv1d
from dtp.layout.parts import Parts, equal_parts, local_rows, repeated
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles import Style, param_placements


def _block(piece: torch.Tensor, kind: bool | int, r: int, tp: int, dim: int) -> torch.Tensor:
    if kind is False:
        return piece
    if kind is True or kind % tp == 0:
        return piece.chunk(tp, dim)[r]
    return piece.chunk(kind, dim)[r * kind // tp]  # repeat(kv): the head rank r's query heads read


def pack_parts(t: torch.Tensor, parts: Parts, tp: int, dim: int = 0) -> torch.Tensor:
    """The tensor laid out so that Shard(dim) chunk r is rank r's block: its slice of every sharded
    part, the whole of every replicated part, its head of a repeated part."""
    pieces = t.split([n for n, _ in parts], dim)
    blocks = [
        torch.cat([_block(p, kind, r, tp, dim) for p, (_, kind) in zip(pieces, parts)], dim)
        for r in range(tp)
    ]
    return torch.cat(blocks, dim)


def unpack_parts(t: torch.Tensor, parts: Parts, tp: int, dim: int = 0) -> torch.Tensor:
    """Inverse of `pack_parts` on the gathered tensor (a replicated part is read from rank 0's
    block, a repeated head from the first rank that holds it)."""
    local = [local_rows(n, kind, tp) for n, kind in parts]
    blocks = [b.split(local, dim) for b in t.chunk(tp, dim)]
    out = []
    for i, (_, kind) in enumerate(parts):
        if kind is False:
            out.append(blocks[0][i])
        elif repeated(kind, tp):
            out.append(torch.cat([blocks[h * tp // kind][i] for h in range(kind)], dim))
        else:
            out.append(torch.cat([b[i] for b in blocks], dim))
    return torch.cat(out, dim)


def _reduced_ranges(parts: Parts, tp: int, rank: int) -> list[tuple[int, int, int, int]]:
    """(start, rows, buffer rows, offset) per part whose gradient rows are summed over ranks: a
    replicated part is its own buffer; a repeated head goes at its head's offset in a zero buffer of
    every head, so one all-reduce sums each head over exactly the ranks that hold it."""
    out, start = [], 0
    for n, kind in parts:
        size = local_rows(n, kind, tp)
        if kind is False:
            out.append((start, size, size, 0))
        elif repeated(kind, tp):
            out.append((start, size, n, rank * kind // tp * size))
        start += size
    return out


def _reduce_rows(
    grad: torch.Tensor, ranges: list[tuple[int, int, int, int]], dim: int, mesh: DeviceMesh
) -> torch.Tensor:
    """All-reduce the rows of the local gradient that belong to replicated or repeated parts (one
    collective)."""
    placements = [Shard(dim)]
    if isinstance(grad, DTensor):
        if list(grad.placements) != placements:
            grad = grad.redistribute(placements=placements)
        local = grad.to_local()
    else:
        local = grad
    buffers = []
    for s, n, total, offset in ranges:
        rows = local.narrow(dim, s, n)
        if total != n:
            shape = list(rows.shape)
            shape[dim] = total
            rows = (
                torch.zeros(shape, dtype=rows.dtype, device=rows.device)
                .narrow(dim, 0, total)
                .index_copy(dim, torch.arange(offset, offset + n, device=rows.device), rows)
            )
        buffers.append(rows)
    summed = funcol.all_reduce(torch.cat(buffers, dim), "sum", (mesh, 0))
    summed = summed.wait() if isinstance(summed, funcol.AsyncCollectiveTensor) else summed
    pieces, cursor, base = [], 0, 0
    for s, n, total, offset in ranges:
        pieces += [local.narrow(dim, cursor, s - cursor), summed.narrow(dim, base + offset, n)]
        cursor, base = s + n, base + total
    pieces.append(local.narrow(dim, cursor, local.shape[dim] - cursor))
    new = torch.cat(pieces, dim)
    if not isinstance(grad, DTensor):
        return new
    return DTensor.from_local(
        new, grad.device_mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride()
    )


def distribute_param(
    module: nn.Module, name: str, placement: ParamPlacement, mesh: DeviceMesh
) -> None:
    """Replace `module.name` by a DTensor laid out as `placement` (packed parts, replicated rows)."""
    param = getattr(module, name)
    tp = mesh.size()
    if placement.shard_dim is None:
        dist = distribute_tensor(param.detach(), mesh, [Replicate()])
    else:
        parts = placement.parts or (
            equal_parts(param.shape[placement.shard_dim], placement.packed)
            if placement.packed > 1
            else ()
        )
        data = (
            pack_parts(param.detach(), parts, tp, placement.shard_dim) if parts else param.detach()
        )
        dist = distribute_tensor(data, mesh, [Shard(placement.shard_dim)])
    new = nn.Parameter(dist, requires_grad=param.requires_grad)
    ranges = _reduced_ranges(placement.parts, tp, mesh.get_local_rank()) if placement.parts else []
    module.register_parameter(name, new)
    if ranges and new.requires_grad and tp > 1:
        reduce_grad_on_use(
            module, name, partial(_reduce_rows, ranges=ranges, dim=placement.shard_dim, mesh=mesh)
        )


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; `reduce` applied to the gradient in backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, reduce) -> torch.Tensor:
        ctx.reduce = reduce
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.reduce(grad), None


def reduce_grad_on_use(module: nn.Module, name: str, reduce) -> None:
    """Apply `reduce` to the gradient of `module.name` (a collective over tp) on its way to the
    parameter.

    Not a tensor hook: the Parameter object changes after sharding (materialising a meta model,
    FSDP2's unsharded parameter during forward), so the module reads its parameter through an
    identity whose backward reduces, whichever object holds the parameter when the module runs."""

    def swap_in(mod: nn.Module, args: tuple) -> None:
        param = mod._parameters.get(name)
        if isinstance(param, nn.Parameter) and param.requires_grad and torch.is_grad_enabled():
            mod._parameters[name] = _ReduceGrad.apply(param, reduce)
            mod._dtp_held = getattr(mod, "_dtp_held", {}) | {name: param}

    def swap_back(mod: nn.Module, args: tuple, output: object) -> None:
        held = getattr(mod, "_dtp_held", {})
        if name in held:
            mod._parameters[name] = held.pop(name)

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_back, always_call=True)


class PlacedColwise(ColwiseParallel):
    """ColwiseParallel for a Linear or a Conv1D whose parameters follow dtp placements (Conv1D's
    weight is (in, out), so its output features are dim 1; packed parts may be unequal or
    replicated)."""

    def __init__(self, placements: dict[str, ParamPlacement], **kwargs):
        super().__init__(**kwargs)
        self.placements = placements

    def _partition(self, name, module, mesh):
        for pname, placement in self.placements.items():
            distribute_param(module, pname, placement, mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return f"PlacedColwise({ {k: str(v) for k, v in self.placements.items()} })"


class CopiedOutputRowwise(RowwiseParallel):
    """torch's RowwiseParallel whose local output may be updated in place (Falcon's `mlp_output +=
    attention_output`, CTRL's `inputs_embeds *= sqrt(d_model)`): torch's `to_local()` hands out a
    view that autograd forbids modifying, so the output is a copy."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )
        return out.clone() if use_local_output and not isinstance(out, DTensor) else out


class RowwiseEmbedding(CopiedOutputRowwise):
    """An nn.Embedding's rows split by vocabulary as torch's RowwiseParallel does it, its output
    all-reduced (and copied when local): for the layouts dtp.compiler.vocab_parallel's layer does
    not compute (sequence parallelism, options that read the whole table)."""


class PlacedRowwise(CopiedOutputRowwise):
    """A rowwise layer that also takes transformers' Conv1D (weight (in, out) sharded on dim 0, bias
    replicated), its local output copied."""

    def _partition(self, name, module, mesh):
        distribute_param(module, "weight", ParamPlacement(0), mesh)
        if getattr(module, "bias", None) is not None:
            distribute_param(module, "bias", ParamPlacement(), mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def all_reduce_grad(grad: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum of every rank's gradient (a replicated parameter used on sharded activations)."""
    if mesh.size() == 1:
        return grad
    out = funcol.all_reduce(grad, "sum", (mesh, 0))
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


class ReplicateReduceGrad(ParallelStyle):
    """A replicated module whose parameters act on this rank's heads only (per-head q/k norms
    between a colwise and a rowwise layer): the parameters stay whole and their gradients are
    all-reduced in the backward pass (Hugging Face's `replicated_with_grad_allreduce`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and device_mesh.size() > 1:
                reduce_grad_on_use(module, name, partial(all_reduce_grad, mesh=device_mesh))
        return module


def _eager_if_misaligned(module: nn.Module, tp: int) -> None:
    """torch's grouped matmul (transformers' default experts kernel) needs 16-byte-aligned strides;
    a local FFN slice of I/tp features (in down_proj, and in the activations between the two
    matmuls) may not give them (I/tp = 6 or 50 in float32): this module then runs transformers'
    eager loop over experts instead, the same maths, through a config of its own."""
    layout, config = experts_layout(module), getattr(module, "config", None)
    elem = module.down_proj.element_size()
    aligned = all(-(-width // tp) * elem % 16 == 0 for width in (layout.inter, 2 * layout.inter))
    if aligned or getattr(config, "_experts_implementation", None) in (None, "eager"):
        return
    module.config = copy.copy(config)
    module.config._experts_implementation = "eager"


class ParallelExperts:
    """The forward of a module holding every expert's FFN slice: its own forward on the local
    slices, with f on the replicated inputs (hidden states, routing weights: each rank's gradient
    covers its FFN slice only) and g on its partial output."""

    _tp: TensorParallelGroup

    def forward(self, *args, **kwargs):  # noqa: D102 - the class says it
        group = self._tp.group
        args = (*(copy_to_ranks(a, group) for a in args[:1]), *(_f32(a, group) for a in args[1:]))
        kwargs = {k: _f32(v, group) for k, v in kwargs.items()}
        local = {n: p.to_local() for n, p in self.named_parameters(recurse=False)}
        if "down_proj_bias" in local and self._tp.rank != 0:
            # Added after the sum over the FFN dimension: once in the partial sums, on the first
            # rank. Elsewhere it adds zero yet takes the same gradient, so it stays replicated with
            # no all-reduce.
            bias = local["down_proj_bias"]
            local["down_proj_bias"] = bias - bias.detach()
        with _reparametrize_module(self, local):
            out = super().forward(*args, **kwargs)
        # g reduces in place: on a copy, as out may be saved
        return sum_over_ranks(out.clone(), group)


def _f32(t: object, group: ProcessGroup) -> object:
    """f on a routing weight, its gradient summed in at least float32 (Mixtral's router hands them
    on in float32 anyway, Qwen2-MoE's not)."""
    if not isinstance(t, torch.Tensor) or not t.requires_grad or t.element_size() >= 4:
        return copy_to_ranks(t, group)
    return copy_to_ranks(t.float(), group).to(t.dtype)


class ExpertsParallel(ParallelStyle):
    """Every expert's FFN dimension split over tp (Megatron's MLP layout, once per expert) on a
    module that holds the experts as 3-D parameters (dtp/layout/experts.py: Mixtral's [gate; up] (E,
    2·I, H), GPT-OSS's transposed, interleaved, with biases): a `ParallelExperts` layer. Routing
    happens outside, on replicated input, so every rank picks the same experts."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _eager_if_misaligned(module, device_mesh.size())  # before the parameters become DTensors
        for name, placement in param_placements(Style.EXPERTS, module).items():
            distribute_param(module, name, placement, device_mesh)
        return become(module, ParallelExperts, TensorParallelGroup.of(device_mesh, None))


def unpack_placed(full: torch.Tensor, placement: ParamPlacement, tp: int) -> torch.Tensor:
    """A gathered parameter (or gradient) with packed parts back in the model's own layout."""
    dim = placement.shard_dim
    parts = placement.parts or equal_parts(full.shape[dim], placement.packed)
    return unpack_parts(full, parts, tp, dim)
