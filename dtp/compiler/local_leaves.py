"""A DTensor parameter's shard as a plain autograd leaf, for modules that compute on local tensors.

`p.to_local()` is an autograd function: every use pays its forward, and in backward wraps the local gradient in
a new DTensor that is then accumulated into `p.grad` by DTensor dispatch (about 70 µs per parameter and step
on CPU, what Megatron's plain parameters do not pay). A leaf instead is a detached alias of `p`'s local tensor
(same storage, so the optimizer's in-place updates of `p` are its own) with `requires_grad`; autograd
accumulates into `leaf.grad` as for any plain parameter, and `p.grad` is a DTensor over that same tensor:

- after an accumulation, a hook points `p.grad` at the leaf's gradient (a new DTensor only when `p.grad` is
  unset or is another tensor: once per step under `zero_grad(set_to_none=True)`). Under `create_graph`
  autograd accumulates out of place, into a new tensor: `p.grad` then follows it;
- before a forward, `p.grad` rules: cleared (`set_to_none`) clears the leaf's gradient, a gradient someone
  assigned becomes the one the leaf accumulates into; zeroed in place is the same tensor already;
- a parameter also used as a DTensor (a tied weight whose other owner keeps torch's style, a forward that
  reads the parameter itself) accumulates into `p.grad` on its own: whichever comes second adds to it.

A leaf serves only the parameter object the module held when it was localized: FSDP2 swaps its own
(unsharded) parameters in around each forward (and a model that FSDP2 will shard makes no leaf at all: its
localized parameters are replaced, and a new one could reuse a dead one's id) and dtp's packed-row gradient
reduction swaps in a non-leaf, and those keep `to_local()`, as does code under `torch.compile` (traced once,
DTensor costs nothing there). A leaf is rebuilt when `p`'s local tensor is no longer the one it aliases (a
`p.data` assignment, a dtype or device move), or when `p.requires_grad` changes.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def owned_params(module: nn.Module) -> dict[str, int]:
    """The identities of `module`'s own DTensor parameters now (taken when it is localized)."""
    return {n: id(p) for n, p in module._parameters.items() if isinstance(p, DTensor)}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors are views of the same memory (DTensor wraps a view of the tensor it is given)."""
    if a is None or b is None:
        return a is b
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def like(p: DTensor, local: torch.Tensor) -> DTensor:
    """`local` (this rank's part of a tensor shaped as `p`: its gradient, an optimizer buffer) as a DTensor laid
    out as `p`, without autograd."""
    if local.dtype == p.dtype and local.shape == p._local_tensor.shape:
        # p's own spec fits its gradient: DTensor's constructor, as DTensor's ops make their outputs (from_local
        # is an autograd function around it, 10× the cost; once per parameter and step)
        return DTensor(local, p._spec, requires_grad=False)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class LocalLeaves:
    """One model's parameter leaves, shared by every module localized in it (a tied weight has one leaf)."""

    def __init__(self, enabled: bool = True) -> None:
        # off under FSDP2, which replaces every parameter: a localized module's remembered id() could otherwise be
        # reused by FSDP2's unsharded parameter on one rank (bench/results/2026-12-04d-fsdp2-flake.md)
        self.enabled = enabled
        self._entries: dict[int, tuple[DTensor, torch.Tensor, torch.Tensor]] = {}  # id(p) → (p, leaf, base)
        self._wrapped: dict[int, weakref.ref] = {}  # id(p) → the leaf gradient `p.grad` was last made to wrap

    def params(self, module: nn.Module, owned: dict[str, int]) -> dict[str, torch.Tensor]:
        """The module's own parameters as this rank's local tensors; gradients reach the DTensor parameters."""
        # read on every call: FSDP2 and reduce_grad_on_use swap the parameter objects around a forward
        if torch.compiler.is_compiling():  # traced once: DTensor's to_local costs nothing at run time there
            return {n: p.to_local() if isinstance(p, DTensor) else p for n, p in module._parameters.items()
                    if p is not None}
        out = {}
        for name, p in module._parameters.items():
            if p is None:
                continue
            if not isinstance(p, DTensor):
                out[name] = p
            elif self.enabled and owned.get(name) == id(p) and p.is_leaf:
                out[name] = self.leaf(p)
            else:
                out[name] = p.to_local()
        return out

    def leaf(self, p: DTensor) -> torch.Tensor:
        """`p`'s local tensor as a leaf sharing its storage, whose gradient `p.grad` wraps."""
        base = p._local_tensor
        entry = self._entries.get(id(p))
        if entry is None or entry[2] is not base or not _same(entry[1], base) or entry[1].requires_grad != p.requires_grad:
            leaf = base.detach().requires_grad_(p.requires_grad)
            if p.requires_grad:
                leaf.register_post_accumulate_grad_hook(functools.partial(self._grad_to_dtensor, p))
            self._entries[id(p)] = entry = (p, leaf, base)
        leaf = entry[1]
        grad = p.grad
        if grad is None:
            leaf.grad = None
        elif not _same(grad._local_tensor, leaf.grad):  # assigned, or accumulated through a DTensor use of `p`
            leaf.grad = grad._local_tensor.detach() if grad.placements == p.placements else None
        return leaf

    def _grad_to_dtensor(self, p: DTensor, leaf: torch.Tensor) -> None:
        """After an accumulation into the leaf: `p.grad` is, or now includes, the leaf's gradient."""
        grad = leaf.grad
        if grad is None or (p.grad is not None and _same(p.grad._local_tensor, grad)):
            return
        last = self._wrapped.get(id(p))
        if p.grad is None or (last is not None and last() is p.grad._local_tensor):
            # unset, or still the gradient the leaf had before it accumulated out of place (create_graph)
            p.grad = like(p, grad)
        else:
            # `p` is also used as a DTensor (a tied weight's owner that is not localized, a forward that reads the
            # parameter itself), which accumulated into a gradient of its own first: sum the two
            p.grad = p.grad + like(p, grad)
            leaf.grad = p.grad._local_tensor.detach() if p.grad.placements == p.placements else None
        self._wrapped[id(p)] = weakref.ref(p.grad._local_tensor)
