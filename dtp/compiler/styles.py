"""The ParallelStyles torch does not have: a shared input for sibling colwise layers, sequence
parallelism from a replicated input, chained styles, and per-rank attribute rewrites (packed parts:
dtp/compiler/placed.py)."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from dtp.layout.lower import rewrite


class SetAttributes(ParallelStyle):
    """Rewrite integer attributes of a module on every rank (e.g. its head count to n_heads / tp).

    `HOLDER.ATTR` rewrites an attribute of a plain object the module holds, copy-on-write
    (dtp.layout.lower.rewrite)."""

    def __init__(self, values: dict[str, int]):
        super().__init__()
        self.values = dict(values)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rewrite(module, self.values)
        return module

    def __repr__(self) -> str:
        return f"SetAttributes({self.values})"


class Chained(ParallelStyle):
    """Several styles on one module, applied in order (a shared input for the colwise children of a
    module whose own style, slice_params, leaves its activations alone)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


class SharedInput(ParallelStyle):
    """Redistribute a module's input once, for all of its column-parallel children (q/k/v, gate/up).

    Without it each colwise child turns the same replicated input into a DTensor on its own, so the
    backward pass all-reduces that input's gradient once per child; here the children receive one
    Replicate DTensor, their Partial gradients add up first, and one all-reduce follows (Megatron's
    f). torch's PrepareModuleInput needs to know whether the input arrives positionally or by
    keyword (Hugging Face passes `hidden_states=`); this hook accepts either.
    """

    def __init__(self, input_layout: Placement | None = None):
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _prepare(self, x: object, mesh: DeviceMesh) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
        return x.redistribute(placements=[Replicate()])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        params = list(inspect.signature(module.forward).parameters)
        first = params[0] if params else None

        def hook(mod, args, kwargs):
            if args:
                return (self._prepare(args[0], device_mesh), *args[1:]), kwargs
            if first in kwargs:
                kwargs = {**kwargs, first: self._prepare(kwargs[first], device_mesh)}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"SharedInput(input_layout={self.input_layout})"


class SequenceParallelFromReplicated(SequenceParallel):
    """torch's SequenceParallel, except that a plain-tensor input is read as the full (replicated)
    sequence and cut to this rank's shard, instead of being taken for the shard itself.

    In dtp's sequence-parallel layout every sequence shard travels as a DTensor, so a plain tensor
    reaching a sequence-parallel module is always a replicated activation (GPT's token + position
    embedding sum before `transformer.drop`).
    """

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        return SequenceParallel._prepare_input_fn(
            sequence_sharding, mod, (x, *inputs[1:]), device_mesh
        )
