"""dtp: declarative, checked tensor parallelism on PyTorch DTensor.

The pipeline, one module per stage: text → `parse` → plan IR → `check` (resolve against the model) →
`compile` to ParallelStyles → `apply` with `parallelize_module` → run and compare (`dtp apply`).
"""
from dtp.check import check
from dtp.compiler import compile
from dtp.errors import DtpError, PlanError, RunError, UsageError
from dtp.shard import apply
from dtp.syntax import load, parse

__all__ = ["parse", "load", "check", "compile", "apply", "DtpError", "PlanError", "RunError", "UsageError"]
__version__ = "0.1.0"
