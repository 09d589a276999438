"""dtp: declarative, checked tensor parallelism on PyTorch DTensor.

The pipeline, one module per stage: text → `parse` → plan IR → `check` (resolve against the model) →
`compile` to ParallelStyles → `apply` with `parallelize_module` → run and compare (`dtp apply`).
"""
import importlib

from dtp.check import check
from dtp.errors import DtpError, PlanError, RunError, UsageError
from dtp.syntax import load, parse

# The stages that need torch are imported on first use (PEP 562): `dtp fmt` and `dtp check PLAN` never
# import it.
_LAZY = {"compile": "dtp.compiler", "apply": "dtp.shard"}


def __getattr__(name: str):
    """`dtp.apply` and friends, imported when first asked for."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dtp' has no attribute {name!r}")


__all__ = ["parse", "load", "check", "compile", "apply", "DtpError", "PlanError", "RunError", "UsageError"]
__version__ = "0.1.0"
