"""`dtp fuzz`: hypothesis drives cases through persistent rank pools and checks the properties.

Properties of every case (for mutated plans, `--mutate`, a run that fails parity or raises on a rank
with a clean report is a right answer, and a plan marked wrong must not pass):
1. a plan that `check` rejects is rejected before launch with a PlanError, never a crash or a hang;
2. a plan that `check` accepts reaches parity with the unsharded model (logits, loss, gradients, and
   the parameters after two optimizer steps);
3. the measured collectives equal the analytic schedule;
4. each rank holds exactly the parameter bytes the placement table (`explain`) says it does.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from dtp import models
from dtp.checks.checker import check, sequence_shape_problem
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.errors import DtpError, PlanError
from dtp.fuzz.cases import Case
from dtp.fuzz.pool import Hang, Pools
from dtp.lang.parse import parse
from dtp.verify.rank import RunConfig


@dataclass(frozen=True)
class Outcome:
    """What one case did: "rejected", "passed" or "failed" (with why)."""

    kind: str
    message: str = ""


def _model_spec(case: Case, scratch: Path) -> str:
    if isinstance(case.model, str):
        return case.model
    path = (
        scratch
        / f"model-{hashlib.sha1(json.dumps(case.model, sort_keys=True).encode()).hexdigest()[:10]}.yaml"
    )
    if not path.exists():
        path.write_text(yaml.safe_dump(case.model))
    return str(path)


def evaluate(case: Case, pools: Pools, timeout: float = 120.0) -> Outcome:
    """Run one case and judge it against the properties."""
    pool = pools.get(case.tp, case.dp)
    spec = _model_spec(case, pool.path(""))
    try:
        plan = parse(case.plan, "fuzz.tp")
        meta_model = models.build(spec, device="meta")
        checked = check(plan, meta_model, case.tp)
    except PlanError:
        return Outcome("rejected")
    except DtpError as err:
        return Outcome("failed", f"usage error instead of a plan error: {err}")
    except Exception as err:  # noqa: BLE001 - property 1: nothing but PlanError before launch
        return Outcome("failed", f"check crashed: {type(err).__name__}: {err}")
    if sequence_shape_problem(checked, case.tp, case.seq):
        return Outcome("rejected")  # `dtp apply` refuses it as a usage error
    cfg = RunConfig(  # the ranks parse the text that was checked here; no file between
        plan="fuzz.tp",
        plan_text=case.plan,
        model=spec,
        tp=case.tp,
        dp=case.dp,
        batch=case.batch,
        seq=case.seq,
        steps=2,
        seed=case.seed,
        dtype=case.dtype,
        timeout=timeout,
    )
    mutated = "mutation" in case.meta  # a deliberate mistake: a clean failure is a right answer
    try:
        report = pool.run(cfg, timeout)
    except Hang as err:
        return Outcome("failed", f"accepted by check, but the run hung: {err}")
    except RuntimeError as err:
        return Outcome(
            "run_failed" if mutated else "failed", f"accepted by check, but the run failed: {err}"
        )
    parity = report.parity
    if not parity["ok"]:
        q = parity[parity["worst_quantity"]]
        return Outcome(
            "parity_failed" if mutated else "failed",
            f"parity failed: {parity['worst_tensor']} ({parity['worst_quantity']}) max rel "
            f"{q['max_rel']:.3g}, max abs {q['max_abs']:.3g}; {'; '.join(q['problems'][:2])}",
        )
    if case.meta.get("wrong") and case.tp > 1:
        return Outcome(
            "failed",
            f"false pass: the mutation '{case.meta['mutation']}' cannot compute what the "
            "unsharded model does, yet parity passed",
        )
    measured, analytic = report.collectives, report.analytic_collectives
    keys = ("by_op", "forward", "backward", "bytes")
    if "not_modeled" in analytic:  # parity still decides; there is no schedule to compare with
        pass
    elif any(measured[k] != analytic[k] for k in keys):
        return Outcome(
            "failed",
            f"collectives differ from the analytic schedule: measured {measured['by_op']} "
            f"{measured['bytes']}, analytic {analytic.get('by_op')} {analytic.get('bytes')}",
        )
    if case.dp == 1:
        elem = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
        want = param_bytes_per_rank(checked, meta_model, case.tp, 1, elem)
        if report.param_bytes_per_rank != want:
            return Outcome(
                "failed",
                f"parameter bytes per rank {report.param_bytes_per_rank} but the placement "
                f"table says {want}",
            )
    return Outcome("passed")


@dataclass
class Summary:
    """Counts over a fuzz run and the (shrunk) failure, if any."""

    counts: Counter = field(default_factory=Counter)
    failure: tuple[Case, str] | None = None
    seconds: float = 0.0

    @property
    def examples(self) -> int:
        """Distinct examples judged during generation (shrinking not counted)."""
        return sum(self.counts.values())

    def describe(self) -> str:
        """`N examples in S s (R/min): … passed, … rejected by check, …, … failed`."""
        c = self.counts
        rate = self.examples / self.seconds * 60 if self.seconds else 0.0
        clean = "".join(
            f", {c[k]} {what}"
            for k, what in (
                ("parity_failed", "failed parity cleanly"),
                ("run_failed", "failed their run cleanly"),
            )
            if c[k]
        )
        return (
            f"{self.examples} examples in {self.seconds:.1f} s ({rate:.0f}/min): {c['passed']} "
            "passed, "
            f"{c['rejected']} rejected by check{clean}, {c['failed']} failed"
        )


def fuzz(
    strategy,
    examples: int,
    seed: int,
    pools: Pools,
    shrink: bool = True,
    progress=None,
    timeout: float = 120.0,
) -> Summary:
    """Draw up to `examples` cases; stop at the first failure and shrink it (hypothesis)."""
    summary = Summary()
    shrinking = [False]
    start = time.monotonic()

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        print_blob=False,
        phases=[Phase.generate, Phase.shrink] if shrink else [Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @hseed(seed)
    @given(strategy)
    def prop(case: Case) -> None:
        outcome = evaluate(case, pools, timeout)
        if not shrinking[0]:
            summary.counts[outcome.kind] += 1
            if progress:
                progress(outcome)
        if outcome.kind == "failed":
            shrinking[0] = True
            summary.failure = (case, outcome.message)  # the last one recorded is the shrunk example
            raise AssertionError(outcome.message)

    try:
        prop()
    except AssertionError:
        pass
    summary.seconds = time.monotonic() - start
    return summary


def save(case: Case, message: str, directory: Path) -> Path:
    """Write a self-contained case file: the plan text, the model, the mesh, the shapes, the seed,
    the error."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {**case.to_json(), "error": message, "torch": torch.__version__}
    name = hashlib.sha1(
        json.dumps(case.to_json(), sort_keys=True, default=str).encode()
    ).hexdigest()[:12]
    path = directory / f"case-{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def fuzz_parser(strategy, examples: int, seed: int) -> list[str]:
    """Feed texts to the parser; anything but a clean PlanError is a failure. Returns failure
    messages."""
    failures: list[str] = []

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hseed(seed)
    @given(strategy)
    def prop(text: str) -> None:
        try:
            parse(text, "fuzz.tp")
        except PlanError as err:
            err.render()
        except Exception as err:  # noqa: BLE001
            failures.append(f"{type(err).__name__}: {err} on {text!r}")

    prop()
    return failures
