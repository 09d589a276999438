"""Apply a compiled plan to a model in place: `parallelize_module`, re-tie shared weights, rewrite attributes.

`program(plan, model, mesh)` is the plan checked and compiled for that model and mesh; its `apply(model)` shards
the model and returns an `Applied`, whose `loss` is the cross-entropy the sharded logits need. `apply` is both."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from dtp.checks.checker import Checked, checked_for
from dtp.compiler.compiler import Compiled, compile_plan, tp_mesh
from dtp.compiler.local_leaves import LocalLeaves
from dtp.compiler.local_pair import hook_ids, localize, pair_side
from dtp.compiler.local_vocab import cross_entropy, localize_vocab, vocab_side
from dtp.compiler.placed import unpack_placed
from dtp.lang import ir
from dtp.runtime.rng import TensorParallelRNG, track


def tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters shared by several modules, as lists of (module path, parameter name), first owner first."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((path, name))
    return [group for group in owners.values() if len(group) > 1]


def retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Point every owner in each of `groups` (from `tied_groups`) at its first owner's parameter."""
    for (first_path, first_name), *others in groups:
        shared = getattr(model.get_submodule(first_path), first_name)
        for path, name in others:
            setattr(model.get_submodule(path), name, shared)


@dataclass(frozen=True)
class Applied:
    """A model sharded in place, with what is needed to read its parameters back in full."""

    model: nn.Module
    compiled: Compiled
    tp: int
    checked: Checked
    plain: bool = False  # a one-rank mesh left as plain PyTorch: no DTensor, no collectives (see `apply`)
    leaves: LocalLeaves | None = None  # the localized modules' parameter leaves (None: none localized)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean token cross-entropy of the sharded model's logits (B, T, V): vocabulary-parallel where the head
        left them split by vocabulary, plain otherwise; equal on every rank (dtp.compiler.local_vocab)."""
        return cross_entropy(logits, targets)

    def full(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a parameter or its gradient) gathered to the model's unsharded layout (a collective)."""
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        placed = self.compiled.packed.get(param_name)  # dtp/compiler/placed.py: packed parts, Conv1D, experts
        return unpack_placed(full, placed, self.tp) if placed is not None else full


@dataclass(frozen=True)
class Program:
    """A plan compiled for one model on one mesh: everything running it takes, as one object (`dtp.compile`).

    `styles` are torch ParallelStyles, but `parallelize_module(model, mesh, program.styles)` alone is not the plan:
    it would untie tied weights (GPT-2's embedding and head: wrong gradients), leave the `set` rewrites undone and
    the colwise → rowwise pairs on DTensor. `apply(model)` does all of it; `Applied.loss` is the matching loss."""

    checked: Checked
    compiled: Compiled
    mesh: DeviceMesh  # the tp mesh
    fsdp_follows: bool  # the mesh given had a dp dimension: FSDP2 will replace every parameter

    @property
    def styles(self) -> dict[str, ParallelStyle]:
        """Module path → ParallelStyle, for reading (apply them with `apply`, which also ties, rewrites, localizes)."""
        return self.compiled.styles

    def apply(self, model: nn.Module, seed: int = 0, *, plain: bool = False) -> Applied:
        """Shard `model` (the one this was compiled for) in place; see `dtp.runtime.shard.apply`."""
        mesh, compiled = self.mesh, self.compiled
        plain = plain and mesh.size() == 1
        leaves = None
        if not plain:
            groups = tied_groups(model)
            # Megatron's colwise → rowwise pairs: torch's styles shard them, then they compute on local tensors
            pairs = {path: side for path, style in compiled.styles.items()
                     if (side := pair_side(style, model.get_submodule(path))) is not None}
            ends = {path: side for path, style in compiled.styles.items()  # the vocabulary-parallel embedding and head
                    if (side := vocab_side(style, model.get_submodule(path))) is not None}
            before = {path: hook_ids(model.get_submodule(path)) for path in pairs | ends}
            parallelize_module(model, mesh, compiled.styles)
            # parallelize_module gives each owner of a tied weight its own DTensor; `check` guaranteed equal
            # placements, so pointing every owner at the first one's keeps one parameter, one gradient, one update.
            retie(model, groups)
            leaves = LocalLeaves(enabled=not self.fsdp_follows)  # one leaf per local shard, shared by tied owners
            for path, side in pairs.items():
                localize(model.get_submodule(path), side, mesh, before[path], leaves)
            for path, side in ends.items():
                localize_vocab(model.get_submodule(path), side, mesh, before[path], leaves)
        for path, rewrite in compiled.rewrites.items():
            rewrite._apply(model.get_submodule(path), mesh)
        rng = TensorParallelRNG(seed, mesh.get_local_rank(), torch.device(mesh.device_type))
        track(model, compiled.lowered.modules, rng)
        return Applied(model, compiled, mesh.size(), self.checked, plain, leaves)


def program(plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh) -> Program:
    """`plan` checked against `model` at the mesh's tp size and compiled (a PlanError if check refuses it)."""
    fsdp_follows = mesh.size() > tp_mesh(mesh).size()
    mesh = tp_mesh(mesh)
    checked = checked_for(plan, model, mesh.size())
    return Program(checked, compile_plan(checked, model, mesh), mesh, fsdp_follows)


def apply(plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh, seed: int = 0, *,
          plain: bool = False) -> Applied:
    """Shard `model` in place under `plan` on `mesh` (its `tp` dimension); returns how to read it back.

    Dropout inside the sharded regions draws from a per-rank generator seeded from `seed` (see dtp.runtime.rng).
    `plain` with a one-rank tp mesh leaves the model as plain PyTorch: on one rank every style is the identity,
    so DTensor would only add its per-op cost and the vocabulary-parallel loss its 3 all-reduces. Only a caller
    whose mesh has no other dimension may ask (FSDP2 over dp expects tp DTensors), and a checkpoint of a plain
    model goes through dtp.train.plain_view.as_dtensors (packed parameters are stored in the tp layout).
    """
    return program(plan, model, mesh).apply(model, seed, plain=plain)
