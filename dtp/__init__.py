"""dtp: declarative, checked tensor parallelism on PyTorch DTensor.

The pipeline, one package per stage: text → `lang` (parse → plan IR) → `layout` (resolve against the
model) → `checks` → `compiler` (ParallelStyles) → `runtime` (meshes, ranks, build, `apply` with
`parallelize_module`) → `verify` (run and compare: `dtp apply`). docs/architecture.md draws the
whole tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtp.checks.checker import check
from dtp.errors import DtpError, PlanError, RunError, UsageError
from dtp.lang.parse import load, parse

if TYPE_CHECKING:
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from dtp.checks.checker import Checked
    from dtp.lang.ir import Plan
    from dtp.runtime.shard import Applied, Program


def compile(plan: Plan | Checked, model: nn.Module, mesh: DeviceMesh) -> Program:  # noqa: A001
    """`plan` checked and compiled for `model` on `mesh`; `.apply(model, mesh)` shards it."""
    from dtp.runtime.shard import program

    return program(plan, model, mesh)


def apply(plan: Plan | Checked, model: nn.Module, mesh: DeviceMesh, seed: int = 0) -> Applied:
    """`compile(plan, model, mesh).apply(model, mesh, seed=seed)`: `.model`, `.full`, `.loss`."""
    return compile(plan, model, mesh).apply(model, mesh, seed=seed)


__all__ = ["parse", "load", "check", "compile", "apply"]
__all__ += ["DtpError", "PlanError", "RunError", "UsageError"]
__version__ = "0.1.0"
