"""Apply a compiled plan to a model in place: `parallelize_module`, re-tie shared weights, rewrite
attributes, per-rank dropout.

`program(plan, model, mesh)` is the plan checked and compiled for that model and mesh (what
`dtp.compile` returns); its `apply(model, mesh)` shards the model and returns an `Applied`, whose
`loss` is the cross-entropy the sharded logits need. `apply` is both."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from dtp.checks.checker import Checked, checked_for
from dtp.compiler.compiler import Compiled, compile_plan, tp_mesh
from dtp.compiler.placed import unpack_placed
from dtp.lang import ir
from dtp.runtime.rng import TensorParallelRNG, track


def tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters shared by several modules, as lists of (module path, parameter name), first owner
    first."""
    # keyed by the object, as named_parameters' memo is
    owners: dict[nn.Parameter, list[tuple[str, str]]] = {}
    for path, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(param, []).append((path, name))
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
    # a one-rank mesh left as plain PyTorch: no DTensor, no collectives (see `apply`)
    plain: bool = False

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean token cross-entropy of the sharded model's logits (..., V) (`Compiled.loss`)."""
        return self.compiled.loss(logits, targets)

    def full(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a parameter or its gradient) gathered to the model's unsharded layout (a
        collective)."""
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        # dtp/compiler/placed.py: packed parts, Conv1D, experts
        placed = self.compiled.packed.get(param_name)
        return unpack_placed(full, placed, self.tp) if placed is not None else full


@dataclass(frozen=True)
class Program:
    """A plan compiled for one model on one mesh: everything running it takes, as one object
    (`dtp.compile`).

    `styles` are the ParallelStyles `parallelize_module` installs; `apply(model, mesh)` installs
    them and also re-ties tied weights (parallelize_module gives each owner its own DTensor: GPT-2's
    embedding and head would get separate gradients), makes the `set` rewrites and the per-rank
    dropout streams. `Applied.loss` is the matching loss."""

    checked: Checked
    compiled: Compiled
    mesh: DeviceMesh  # the tp mesh

    @property
    def styles(self) -> dict[str, ParallelStyle]:
        """Module path → ParallelStyle, for reading (apply them with `apply`, which also ties and
        rewrites)."""
        return self.compiled.styles

    def apply(
        self,
        model: nn.Module,
        mesh: DeviceMesh | None = None,
        *,
        seed: int = 0,
        plain: bool = False,
    ) -> Applied:
        """Shard `model` (the one this was compiled for) in place over `mesh` (its tp dimension;
        default: the mesh compiled for), see `dtp.runtime.shard.apply`."""
        if mesh is not None and tp_mesh(mesh).size() != self.mesh.size():
            raise ValueError(
                f"compiled for tp {self.mesh.size()}, applied on a mesh of tp "
                f"{tp_mesh(mesh).size()}"
            )
        mesh, compiled = self.mesh if mesh is None else tp_mesh(mesh), self.compiled
        plain = plain and mesh.size() == 1
        if not plain:
            groups = tied_groups(model)
            parallelize_module(model, mesh, compiled.styles)
            # parallelize_module gives each owner of a tied weight its own DTensor; `check`
            # guaranteed equal placements, so pointing every owner at the first one's keeps one
            # parameter, one gradient, one update.
            retie(model, groups)
        for path, rewrite in compiled.rewrites.items():
            rewrite._apply(model.get_submodule(path), mesh)
        rng = TensorParallelRNG(seed, mesh.get_local_rank(), torch.device(mesh.device_type))
        track(model, compiled.lowered.modules, rng)
        return Applied(model, compiled, mesh.size(), self.checked, plain)


def program(plan: ir.Plan | Checked, model: nn.Module, mesh: DeviceMesh) -> Program:
    """`plan` checked against `model` at the mesh's tp size and compiled (a PlanError if check
    refuses it)."""
    fsdp_follows = mesh.size() > tp_mesh(mesh).size()  # FSDP2 over dp will replace every parameter
    mesh = tp_mesh(mesh)
    checked = checked_for(plan, model, mesh.size())
    return Program(checked, compile_plan(checked, model, mesh, fsdp_follows=fsdp_follows), mesh)


def apply(
    plan: ir.Plan | Checked,
    model: nn.Module,
    mesh: DeviceMesh,
    seed: int = 0,
    *,
    plain: bool = False,
) -> Applied:
    """Shard `model` in place under `plan` on `mesh` (its `tp` dimension); returns how to read it
    back.

    Dropout inside the sharded regions draws from a per-rank generator seeded from `seed` (see
    dtp.runtime.rng). `plain` with a one-rank tp mesh leaves the model as plain PyTorch: on one rank
    every style is the identity, so DTensor would only add its per-op cost and the
    vocabulary-parallel loss its 3 all-reduces. Only a caller whose mesh has no other dimension may
    ask (FSDP2 over dp expects tp DTensors), and a checkpoint of a plain model goes through
    dtp.train.plain_view.as_dtensors (packed parameters are stored in the tp layout).
    """
    return program(plan, model, mesh).apply(model, seed=seed, plain=plain)
