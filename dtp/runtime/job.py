"""A job: what every command that starts ranks runs (`dtp apply`, `dtp train`, `dtp generate`,
`dtp bench`'s configurations, the fuzz pools), as one value.

The plan travels as its text, read once where the job is made: the pre-flight
(dtp.runtime.preflight.prepare) parses and checks that text and hands the ranks the parsed plan with
it, so what runs is what was checked even if the file changes, and a command parses its plan once
(each torchrun process once: it is its own pre-flight). Every field is validated here, once, with
one message per condition (UsageError: exit 2 before any rank starts). No torch: the command line's
argument types share these limits (dtp/cli/args.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from dtp.errors import UsageError, shorten
from dtp.lang import ir
from dtp.lang.parse import parse, read_plan_text

# what a rank runs in (dtp.verify.rank.DTYPES maps them to torch's)
DTYPES = ("float32", "bfloat16", "float64")
# what `dtp train` takes (its TrainConfig and its command line's choices): the simulator's precision
# names → the dtype a rank computes in (bf16, fp16: autocast over float32 master weights)
TRAIN_PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
RECOMPUTE = ("none", "full", "selective", "op")  # what backward recomputes (dtp.train.recompute)
DP_MODES = ("fsdp", "ddp")  # data parallelism over dp (dtp.runtime.data_parallel)


def state_shards(dp: int, dp_mode: str) -> int:
    """How many dp ranks share the parameters, gradients and AdamW state: FSDP2 shards them over dp;
    DDP replicates them (each dp rank holds its tp rank's whole share)."""
    return dp if dp_mode == "fsdp" else 1


# auto: CUDA when there is a GPU for every local rank (dtp.runtime.launcher)
DEVICES = ("auto", "cpu", "cuda")
MAX_SEED = 2**63 - 2**16  # torch seeds are 64-bit; ranks add their index
MAX_TIMEOUT = 7 * 24 * 3600.0  # seconds: a week; a larger wait overflows the timers it is handed to


def positive(flag: str, value: object) -> None:
    """Refuse what is not an integer ≥ 1: one paragraph."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{flag} must be a positive integer, got {shorten(value)}")


@dataclass(frozen=True, kw_only=True)
class Job:
    """One run of a plan on a model over tp × dp ranks; plain data, so that it pickles to spawned
    ranks."""

    # the plan as the user named it (a file or a shipped plan): FILE in FILE:LINE:COL, never re-read
    plan: str
    plan_text: str | None = None  # the plan's source; None: read from `plan` once, here
    model: str  # zoo name, model YAML, package.module:factory or a save_pretrained directory
    tp: int = 2
    dp: int = 1  # data-parallel size: FSDP2 over a (dp, tp) mesh
    batch: int = 2  # the global batch, in sequences: every dp rank runs batch / dp of them
    seq: int = 16  # tokens per sequence
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"  # auto, cpu or cuda; the pre-flight decides auto
    timeout: float = 120.0  # seconds before every rank is stopped (exit 1)
    # plan_text parsed, set by the pre-flight once it is checked (never by hand)
    parsed: ir.Plan | None = field(default=None, compare=False, repr=False)
    dtypes: ClassVar[tuple[str, ...]] = DTYPES  # what this kind of job runs in

    def __post_init__(self) -> None:
        for flag, value in (
            ("--tp", self.tp),
            ("--dp", self.dp),
            ("--batch", self.batch),
            ("--seq", self.seq),
        ):
            positive(flag, value)
        if self.batch % self.dp:
            raise UsageError(
                f"--batch {self.batch} (the global batch) must divide by --dp {self.dp}"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed <= MAX_SEED
        ):
            raise UsageError(
                f"--seed must be an integer between 0 and {MAX_SEED}, got {shorten(self.seed)}"
            )
        if self.dtype not in self.dtypes:
            raise UsageError(
                f"--dtype must be one of {', '.join(self.dtypes)}, got {shorten(self.dtype)}"
            )
        if self.device not in DEVICES:
            raise UsageError(
                f"--device must be one of {', '.join(DEVICES)}, got {shorten(self.device)}"
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not 0 < self.timeout <= MAX_TIMEOUT
        ):  # nan fails both comparisons
            raise UsageError(
                f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT:.0f}], "
                f"got {shorten(self.timeout)}"
            )
        if not isinstance(self.model, str) or not self.model.strip():
            raise UsageError(
                f"MODEL must name a model (a zoo name, a model YAML, package.module:factory or a "
                f"save_pretrained directory), got {shorten(self.model)}"
            )
        if self.plan_text is None:
            object.__setattr__(self, "plan_text", read_plan_text(self.plan))
        elif not isinstance(self.plan_text, str):
            raise UsageError(
                f"the plan's text must be a string, got {type(self.plan_text).__name__}"
            )

    def plan_ir(self) -> ir.Plan:
        """The plan as the pre-flight parsed and checked it; a job that never went through one (a
        test's, a fuzz case's: checked by the fuzzer) has its text parsed here."""
        return self.parsed if self.parsed is not None else parse(self.plan_text, self.plan)

    def to_json(self) -> dict:
        """The fields as a report records them: the plan by name (its text is in the plan the report
        names)."""
        fields = asdict(self)
        del fields["plan_text"], fields["parsed"]
        return fields


def finite(flag: str, value: float, *, low: float = 0.0, strict: bool = False) -> None:
    """Refuse a number that is not finite, or below `low` (at or below it when `strict`): one
    paragraph."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < low
        or (strict and value <= low)
    ):
        what = f"a finite number > {low:g}" if strict else f"a finite number ≥ {low:g}"
        raise UsageError(f"{flag} must be {what}, got {shorten(value)}")
