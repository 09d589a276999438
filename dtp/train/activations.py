"""What one training step keeps and moves on this rank, measured: the bytes a forward leaves
allocated for backward under any recompute policy (`ForwardMeter`), the bytes sent per mesh
dimension (`GroupCounter`, `collective_bytes`), and the parameter, gradient and optimizer-state
bytes (`state_bytes`). dtp.train.predict sets the simulator's figures beside them.

`dtp.verify.instruments.ActivationMeter` counts what autograd's saved-tensor hooks see, which is
right without recomputation but blind to activation checkpointing: torch.utils.checkpoint (non-
reentrant, and selective checkpointing) installs its own inner hooks, keeps the block's inputs in a
closure and the tensors a selective policy saves in a cache of its own. What is left for backward is
what is still allocated once the forward (and the loss) is done. So this meter is a
TorchDispatchMode active over the forward: it takes a weak reference to the storage of every op's
output, and when the context exits (before backward) it sums the storages still alive, each once.

Not counted as activations: parameters (those the model holds on entry and exit, and any
`nn.Parameter` an op reads, as FSDP2's unsharded ones), and kept apart as `weight_copies`: the
copies of parameters an op made during the forward (autocast's low-precision weights, which the
matrix multiplies save; the simulator counts them as weights in the training precision, not as
activations). The forward's inputs (token ids) were allocated before it and are not counted either.
The mode only observes: every op runs as called, so values and gradients are unchanged.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.distributed_c10d import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtp.cost.schedule import sent_bytes
from dtp.runtime.comm import CommCounter, group_of, op_name

# ops that copy a tensor (a dtype cast, a device move): their copy of a parameter is a weight copy
_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}


def _storage(t: torch.Tensor) -> StorageWeakRef | None:
    """A weak reference to the storage under `t` (a DTensor's local shard), or None where `t` has no
    real storage (a meta or wrapper tensor)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    # a wrapper subclass (functional collectives' AsyncCollectiveTensor) reports a storage of its
    # size that holds nothing: its data is its inner tensor's, an op's output of its own
    if local.device.type == "meta" or type(local) not in (torch.Tensor, nn.Parameter):
        return None
    try:
        return StorageWeakRef(local.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class ForwardMeter(TorchDispatchMode):
    """Measure, on exit, the bytes the forward run inside `with ForwardMeter(model):` left
    allocated: `nbytes` activations and `weight_copies`, per rank. Exit it after the loss and before
    backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.supports_higher_order_operators = True
        self.model = model
        self.params: set[int] = set()  # storage keys (StorageWeakRef.cdata)
        self.outputs: dict[int, StorageWeakRef] = {}
        self.copies: set[int] = set()  # outputs that are copies of a parameter
        self.nbytes = 0
        self.weight_copies = 0

    def __enter__(self):
        self._add_params(self.model.parameters())
        self.outputs.clear()
        self.copies.clear()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._add_params(self.model.parameters())  # FSDP2 registers its unsharded ones meanwhile
        self.nbytes = self.weight_copies = 0
        for key, ref in self.outputs.items():
            alive = None if key in self.params else torch.UntypedStorage._new_with_weak_ptr(key)
            if alive is None:
                continue
            size = alive.nbytes()
            if key in self.copies:
                self.weight_copies += size
            else:
                self.nbytes += size
        # drop the weak references: they would keep freed storages' bookkeeping alive
        self.outputs.clear()
        self.params.clear()
        return out

    def _add_params(self, tensors) -> None:
        for p in tensors:
            ref = _storage(p)
            if ref is not None:
                self.params.add(ref.cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self._add_params(t for t in inputs if isinstance(t, nn.Parameter))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into ops on local shards, seen next
        out = func(*args, **kwargs)
        copy = func in _COPIES and bool(inputs) and self._key(inputs[0]) in self.params
        for t in tree_leaves(out):
            ref = _storage(t) if isinstance(t, torch.Tensor) else None
            if ref is not None and ref.cdata not in self.outputs:
                self.outputs[ref.cdata] = ref
                if copy:
                    self.copies.add(ref.cdata)
        return out

    @staticmethod
    def _key(t: torch.Tensor) -> int | None:
        ref = _storage(t)
        return ref.cdata if ref is not None else None


class GroupCounter(CommCounter):
    """A CommCounter that also sums, per mesh dimension ("tp", "dp"; "other" for any other group),
    the bytes each collective sends under ring algorithms."""

    def __init__(self, groups: dict[str, ProcessGroup | None]):
        super().__init__()
        self.names = {_ranks(g): name for name, g in groups.items() if g is not None}
        self.sent: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # a collective (not a DTensor handed back)
            name = op_name(func._overloadpacket)
            nbytes, n = self.comm_sizes[name][-1]
            group = group_of((args, kwargs or {}))
            dim = self.names.get(_ranks(group) if group is not None else None, "other")
            self.sent[dim] += sent_bytes(name, nbytes, n)
        return out


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def collective_bytes(counters) -> dict:
    """{"tp_bytes", "dp_bytes"} summed over GroupCounters."""
    return {f"{dim}_bytes": sum(c.sent.get(dim, 0) for c in counters) for dim in ("tp", "dp")}


def _storages(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Measured parameter, gradient and optimizer-state bytes of this rank: call it after the last
    micro-batch's backward (gradients present) and after at least one optimizer step (state
    present), e.g. after the step with `zero_grad` moved after it."""
    params = list(model.parameters())
    moments = [
        t
        for s in optimizer.state.values()
        for key, t in s.items()
        if key != "step" and isinstance(t, torch.Tensor)
    ]
    return {
        "parameter_bytes": _storages(params),
        "gradient_bytes": _storages(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": _storages(moments),
    }
