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

A leaf is kept per local tensor, in a weak identity map (an entry dies with the tensor). A model
that FSDP2 will shard makes no leaves at all (its layers hold no `LocalParams`): FSDP2 swaps its
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


class LocalParams:
    """One model's parameter leaves, shared by all of its Megatron layers (a tied weight has one
    leaf).

    Keyed by the parameter's local tensor in torch's weak identity map: an entry dies with that
    tensor, so a new tensor can never be taken for a dead one. (Not by the parameter itself:
    `torch.utils.swap_tensors`, which `model.double()` and `.to()` use on DTensor parameters,
    refuses a tensor that has weak references.)"""

    def __init__(self) -> None:
        self._entries = WeakIdKeyDictionary()  # p's local tensor → the leaf that aliases it
        # backward pass → leaves it filled
        self._pending: dict[int, list[tuple[DTensor, torch.Tensor]]] = {}
        # p's local tensor → the leaf gradient `p.grad` last wrapped
        self._wrapped = WeakIdKeyDictionary()

    def of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's own parameters as this rank's local tensors; gradients reach the DTensor
        parameters.

        Read on every call: reduce_grad_on_use swaps a non-leaf in around a forward, which takes
        DTensor's `to_local()`, as does code under torch.compile (traced once, DTensor costs nothing
        there)."""
        compiling = torch.compiler.is_compiling()
        out = {}
        for name, p in module._parameters.items():
            if p is None:
                continue
            if not isinstance(p, DTensor):
                out[name] = p
            elif p.is_leaf and not compiling:
                out[name] = self.leaf(p)
            else:
                out[name] = p.to_local()
        return out

    def leaf(self, p: DTensor) -> torch.Tensor:
        """`p`'s local tensor as a leaf sharing its storage, whose gradient `p.grad` wraps."""
        if self._pending:
            self._catch_up()
        base = p._local_tensor
        leaf = self._entries.get(base)
        if leaf is None or not _same(leaf, base) or leaf.requires_grad != p.requires_grad:
            leaf = base.detach().requires_grad_(p.requires_grad)
            if p.requires_grad:
                leaf.register_post_accumulate_grad_hook(functools.partial(self._noted, p))
            self._entries[base] = leaf
        grad = p.grad
        if grad is None:
            if leaf.grad is not None:
                leaf.grad = None
        # assigned, or accumulated through a DTensor use of `p`
        elif not _same(grad._local_tensor, leaf.grad):
            leaf.grad = grad._local_tensor.detach() if grad.placements == p.placements else None
        return leaf

    def _noted(self, p: DTensor, leaf: torch.Tensor) -> None:
        """A leaf's post-accumulate hook: `p.grad` is settled when this backward pass ends."""
        task = torch._C._current_graph_task_id()
        if task == -1:  # not inside the engine after all: nothing to wait for
            self._grad_to_dtensor(p, leaf)
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
            self._grad_to_dtensor(p, leaf)

    def _catch_up(self) -> None:
        """Before a forward reads `p.grad`: inside a backward pass (checkpointing's recomputation),
        settle what the passes accumulated so far; outside one, what is still pending was
        accumulated by a pass that raised before it ended (an out-of-memory error the loop recovers
        from): those partial gradients are dropped, so that a `zero_grad` made since, which found
        `p.grad` unset, still holds."""
        inside = torch._C._current_graph_task_id() != -1
        for task in list(self._pending):
            for p, leaf in self._pending.pop(task):
                if inside:
                    self._grad_to_dtensor(p, leaf)
                elif leaf.grad is not None and (
                    p.grad is None or not _same(p.grad._local_tensor, leaf.grad)
                ):
                    leaf.grad = None

    def _grad_to_dtensor(self, p: DTensor, leaf: torch.Tensor) -> None:
        """After accumulations into the leaf: `p.grad` is, or now includes, the leaf's gradient."""
        grad = leaf.grad
        if grad is None or (p.grad is not None and _same(p.grad._local_tensor, grad)):
            return
        last = self._wrapped.get(p._local_tensor)
        if p.grad is None or (last is not None and last() is p.grad._local_tensor):
            # unset, or still the gradient the leaf had before it accumulated out of place
            # (create_graph)
            p.grad = like(p, grad)
        else:
            # `p` is also used as a DTensor (a tied weight's owner that is not localized, a forward
            # that reads the parameter itself), which accumulated into a gradient of its own: sum
            # the two
            p.grad = p.grad + like(p, grad)
            leaf.grad = p.grad._local_tensor.detach() if p.grad.placements == p.placements else None
        self._wrapped[p._local_tensor] = weakref.ref(p.grad._local_tensor)


# queue_callback: run once when the backward pass ends
_ENGINE = torch.autograd.Variable._execution_engine
