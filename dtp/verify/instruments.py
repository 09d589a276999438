"""What a rank of `dtp apply` measures besides parity: where it is (for a failure's message), and
the bytes of activations a forward pass saves for backward."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


class ModuleTrail:
    """Forward hooks that remember which module is running, to say where a rank failed."""

    def __init__(self):
        self.stack: list[str] = []
        self.phase = "setup"
        self.handles = []

    def attach(self, model: nn.Module) -> None:
        """Follow `model`'s modules from now on."""
        for path, module in model.named_modules():
            self.handles.append(
                module.register_forward_pre_hook(lambda m, a, p=path: self._enter(p))
            )
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._leave()))

    def _enter(self, path: str) -> None:
        self.stack.append(path)

    # returns None: a forward hook's return value would replace the output
    def _leave(self) -> None:
        if self.stack:
            self.stack.pop()

    def where(self) -> str:
        """The innermost module running, or the phase."""
        if self.phase == "forward" and self.stack:
            return f"module {self.stack[-1] or '(the model)'} during forward"
        return f"the {self.phase}"


class ActivationMeter:
    """Bytes of the activations a forward pass saves for backward on this rank (parameters excluded,
    each storage counted once): the memory that sequence parallelism divides."""

    def __init__(self, model: nn.Module):
        self.params = {
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in model.parameters()
        }
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        # a tensor without a real storage (e.g. a view DTensor builds): count its size
        except RuntimeError:
            key, nbytes = id(t), local.numel() * local.element_size()
        if key not in self.params:
            self.storages[key] = nbytes
        return t

    def recording(self):
        """A context that records what autograd saves."""
        self.storages.clear()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        """Total recorded bytes."""
        return sum(self.storages.values())
