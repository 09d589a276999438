"""A DTensor parameter's shard as a plain autograd leaf, for modules that compute on local tensors.

`p.to_local()` is an autograd function: every use pays its forward, and in backward wraps the local
gradient in a new DTensor that is then accumulated into `p.grad` by DTensor dispatch (about 70 µs
per parameter and step on CPU, what Megatron's plain parameters do not pay). A leaf instead is a
detached alias of `p`'s local tensor (same storage, so the optimizer's in-place updates of `p` are
its own) with `requires_grad`; autograd accumulates into `leaf.grad` as for any plain parameter, and
`p.grad` is a DTensor over that same tensor:

- when a backward pass that accumulated into leaves ends, `p.grad` is pointed at each one's gradient
  (a new DTensor only when `p.grad` is unset or is another tensor: once per step under
  `zero_grad(set_to_none=True)`). The leaves' hooks only note that they accumulated; one engine
  callback per pass wraps them all, after the pass's GEMMs, where wrapping each in its own hook cost
  about 14 µs per parameter (Python run between the kernels, on cold caches). A forward inside a
  pass (checkpointing's recomputation) settles them first; a pass that raised before its end leaves
  its partial gradients unsettled, and the next forward drops them. Under `create_graph` autograd
  accumulates out of place, into a new tensor: `p.grad` then follows it;
- before a forward, `p.grad` rules: cleared (`set_to_none`) clears the leaf's gradient, a gradient
  someone assigned becomes the one the leaf accumulates into; zeroed in place is the same tensor
  already;
- a parameter also used as a DTensor (a tied weight whose other owner keeps torch's style, a forward
  that reads the parameter itself) accumulates into `p.grad` on its own; the leaf's gradient is
  added to it.

A leaf is kept per local tensor, in a weak identity map (an entry dies with the tensor), and what
each module read last is kept for it and checked by identity on its next forward (the map is looked
up only when the module's parameters changed: 7.8 → 5.2 µs per forward of a two-parameter layer). A
model that FSDP2 will shard makes no leaves at all (its layers hold no `LocalParams`): FSDP2 swaps its
unsharded parameters in around each forward and reduces their gradients from autograd's own
accumulation. dtp's packed-row gradient reduction swaps in a non-leaf; those, and code under
`torch.compile` (traced once, DTensor costs nothing there), take `to_local()`. A leaf is rebuilt
when `p`'s local tensor is no longer the one it aliases (a `p.data` assignment, a dtype or device
move), or when `p.requires_grad` changes.

This is the one speed trick of the Megatron layers that reaches past DTensor's public API
(`_local_tensor`, `_spec`, the engine's callback queue); it lives here, behind `LocalParams`, and is
measured in bench/.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors are views of the same memory (DTensor wraps a view of the tensor it is
    given)."""
    if a is None or b is None:
        return a is b
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def like(p: DTensor, local: torch.Tensor) -> DTensor:
    """`local` (this rank's part of a tensor shaped as `p`: its gradient, an optimizer buffer) as a
    DTensor laid out as `p`, without autograd."""
    if local.dtype == p.dtype and local.shape == p._local_tensor.shape:
        # p's own spec fits its gradient: DTensor's constructor, as DTensor's ops make their outputs
        # (from_local is an autograd function around it, 10× the cost; once per parameter and step)
        return DTensor(local, p._spec, requires_grad=False)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def local_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s own parameters as this rank's local tensors through DTensor's `to_local()` (an
    autograd function: gradients reach the DTensors)."""
    return {
        n: p.to_local() if isinstance(p, DTensor) else p
        for n, p in module._parameters.items()
        if p is not None
    }


class _Leaf:
    """One parameter's leaf, the local tensor it aliases (weakly), and the local tensor of the
    gradient `p.grad` last wrapped for it (weakly: a cleared gradient is freed)."""

    __slots__ = ("tensor", "base", "wrapped", "__weakref__")

    def __init__(self, tensor: torch.Tensor, base: torch.Tensor) -> None:
        self.tensor = tensor
        self.base = weakref.ref(base)
        self.wrapped: weakref.ref | None = None

    def aliases(self, p: DTensor) -> bool:
        """Whether it still stands for `p`: the same local tensor, which it is still a view of,
        with `p`'s `requires_grad`."""
        base = p._local_tensor
        return (
            self.base() is base
            and _same(self.tensor, base)
            and self.tensor.requires_grad == p.requires_grad
        )


class _Read:
    """A module's parameters as `LocalParams.of` last read them: the parameters the module held
    then, and its DTensors' leaves weakly (a leaf, a view of its parameter's storage, must not
    outlive the tensor it aliases: after `model.to(torch.bfloat16)`, say)."""

    __slots__ = ("params", "plain", "leaves")

    def __init__(self, params: dict, plain: dict, leaves: list) -> None:
        self.params = tuple(params.items())  # the module's `_parameters` as read
        self.plain = plain  # name → a parameter that is not a DTensor
        self.leaves: tuple[tuple[str, DTensor, weakref.ref], ...] = tuple(leaves)

    def holds(self, params: dict) -> bool:
        """Whether it still holds for `params` (the module's `_parameters`)."""
        if len(params) != len(self.params):
            return False
        for name, p in self.params:
            if params.get(name) is not p:
                return False
        for _, p, ref in self.leaves:
            leaf = ref()
            if leaf is None or not leaf.aliases(p):
                return False
        return True


class LocalParams:
    """One model's parameter leaves, shared by all of its Megatron layers (a tied weight has one
    leaf).

    Keyed by the parameter's local tensor in torch's weak identity map: an entry dies with that
    tensor, so a new tensor can never be taken for a dead one. (Not by the parameter itself:
    `torch.utils.swap_tensors`, which `model.double()` and `.to()` use on DTensor parameters,
    refuses a tensor that has weak references.) What a module read last is kept for it, weakly,
    and checked by identity on each forward: the lookups run only when its parameters changed."""

    def __init__(self) -> None:
        self._entries = WeakIdKeyDictionary()  # p's local tensor → its _Leaf
        self._reads: weakref.WeakKeyDictionary[nn.Module, _Read] = weakref.WeakKeyDictionary()
        # backward pass → leaves it filled
        self._pending: dict[int, list[tuple[DTensor, _Leaf]]] = {}

    def of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's own parameters as this rank's local tensors; gradients reach the DTensor
        parameters.

        Checked on every call: reduce_grad_on_use swaps a non-leaf in around a forward, which takes
        DTensor's `to_local()` (read again each time), as does code under torch.compile (traced
        once, DTensor costs nothing there)."""
        if self._pending:
            self._catch_up()
        params = module._parameters
        if torch.compiler.is_compiling():
            return local_tensors(module)
        read = self._reads.get(module)
        if read is None or not read.holds(params):
            return self._read(module)
        out = dict(read.plain)
        for name, p, ref in read.leaves:
            leaf = ref().tensor
            _follow_grad(p, leaf)
            out[name] = leaf
        return out

    def _read(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`of` the first time, or after `module`'s parameters changed: leaves for its leaf
        DTensors, kept for the next call unless a non-leaf one takes `to_local()`."""
        out, plain, leaves, again = {}, {}, [], False
        for name, p in module._parameters.items():
            if p is None:
                continue
            if not isinstance(p, DTensor):
                out[name] = plain[name] = p
            elif p.is_leaf:
                leaf = self._leaf(p)
                _follow_grad(p, leaf.tensor)
                out[name] = leaf.tensor
                leaves.append((name, p, weakref.ref(leaf)))
            else:
                out[name] = p.to_local()
                again = True
        if again:
            self._reads.pop(module, None)
        else:
            self._reads[module] = _Read(module._parameters, plain, leaves)
        return out

    def _leaf(self, p: DTensor) -> _Leaf:
        """`p`'s leaf, made again when its local tensor or `requires_grad` changed."""
        leaf = self._entries.get(p._local_tensor)
        if leaf is None or not leaf.aliases(p):
            base = p._local_tensor
            leaf = _Leaf(base.detach().requires_grad_(p.requires_grad), base)
            if p.requires_grad:
                # weakly: the leaf's tensor holds the hook, which must not hold the leaf
                leaf.tensor.register_post_accumulate_grad_hook(
                    functools.partial(self._noted, p, weakref.ref(leaf))
                )
            self._entries[p._local_tensor] = leaf
        return leaf

    def _noted(self, p: DTensor, ref: weakref.ref, tensor: torch.Tensor) -> None:
        """A leaf's post-accumulate hook: `p.grad` is settled when this backward pass ends."""
        # a leaf whose local tensor was replaced after the forward (its entry is gone) still
        # settles
        leaf = ref() or _Leaf(tensor, tensor)
        task = torch._C._current_graph_task_id()
        if task == -1:  # not inside the engine after all: nothing to wait for
            _grad_to_dtensor(p, leaf)
            return
        pending = self._pending.get(task)
        # the pass's first leaf (a nested pass, as reentrant checkpointing runs, has its own)
        if pending is None:
            self._pending[task] = pending = []
            _ENGINE.queue_callback(functools.partial(self._settle, task))
        pending.append((p, leaf))

    def _settle(self, task: int) -> None:
        """The end of backward pass `task`: point each accumulated parameter's `p.grad` at its
        leaf's gradient."""
        for p, leaf in self._pending.pop(task, ()):
            _grad_to_dtensor(p, leaf)

    def _catch_up(self) -> None:
        """Before a forward reads `p.grad`: inside a backward pass (checkpointing's recomputation),
        settle what the passes accumulated so far; outside one, what is still pending was
        accumulated by a pass that raised before it ended (an out-of-memory error the loop recovers
        from): those partial gradients are dropped, so that a `zero_grad` made since, which found
        `p.grad` unset, still holds."""
        inside = torch._C._current_graph_task_id() != -1
        for task in list(self._pending):
            for p, leaf in self._pending.pop(task):
                grad = leaf.tensor.grad
                if inside:
                    _grad_to_dtensor(p, leaf)
                elif grad is not None and (p.grad is None or not _same(p.grad._local_tensor, grad)):
                    leaf.tensor.grad = None


def _follow_grad(p: DTensor, leaf: torch.Tensor) -> None:
    """Before a forward, `p.grad` rules: cleared clears the leaf's gradient; one assigned, or
    accumulated through a DTensor use of `p`, becomes the one the leaf accumulates into."""
    grad = p.grad
    if grad is None:
        if leaf.grad is not None:
            leaf.grad = None
    elif not _same(grad._local_tensor, leaf.grad):
        leaf.grad = grad._local_tensor.detach() if grad.placements == p.placements else None


def _grad_to_dtensor(p: DTensor, leaf: _Leaf) -> None:
    """After accumulations into the leaf: `p.grad` is, or now includes, the leaf's gradient."""
    grad, current = leaf.tensor.grad, p.grad
    if grad is None or (current is not None and _same(current._local_tensor, grad)):
        return
    last = leaf.wrapped
    if current is None or (last is not None and last() is current._local_tensor):
        # unset, or still the gradient the leaf had before it accumulated out of place
        # (create_graph)
        p.grad = like(p, grad)
    else:
        # `p` is also used as a DTensor (a tied weight's owner that is not localized, a forward
        # that reads the parameter itself), which accumulated into a gradient of its own: sum the
        # two
        p.grad = current + like(p, grad)
        leaf.tensor.grad = (
            p.grad._local_tensor.detach() if p.grad.placements == p.placements else None
        )
    leaf.wrapped = weakref.ref(p.grad._local_tensor)


# queue_callback: run once when the backward pass ends
_ENGINE = torch.autograd.Variable._execution_engine
