"""Convergence parity across tp sizes (`dtp train --compare-tp`): the per-step band, the table, the
verdict.

Correct tensor parallelism only reorders floating-point sums, so curves at different tp differ by
rounding, and rounding differences between two training runs grow: the optimizer feeds each step's
difference into the next, slowly at a small learning rate, chaotically at a large one. A fixed band
is either too loose where the noise is small or a false alarm where it grows; so the band is
measured on the run itself. Its *noise twin* trains the first tp again on the same batches with
every batch's rows in reverse order — the same sums in another order, nothing else — and the band
at step s is K = 10 × the largest |Δloss| / loss between the twin and the first tp up to s, never
below a floor; the final validation loss gets K × the twin's difference, and never less than its own
floor or the last step's band (one validation loss is one sample of the noise: llama-tiny's twin
differed there by 1.1e-7 while its training losses had differed by up to 1.6e-4).

Measured (2-core CPU, gpt2-tiny at tp 2 and 4 against tp 1, 300 steps, seeds 0 and 1, and lr 1e-2
where rounding grows to per cent): in float32 the tp curves stay within 2.7 × the twin's running
largest difference after the first steps (1.8 × at lr 1e-2, where both reach 6e-2 to 8e-2, far
beyond the old fixed 1e-3), and final validation losses within 3.3 ×; the first steps differ by one
ulp of the loss (9e-8), which the float32 floor, 1e-6, covers. A wrong sharding is O(1e-3) or more
from its first steps (q, k, v sharded without packed=3), and a model wrong from its sixth forward
was 7.8e-5 off where correct tp differs by 1.5e-7. In bfloat16 reversing rows leaves each row's
bf16 rounding alone (only the weight-gradient sums move) while tp rounds partial sums to bf16, so
the twin understates bf16's noise 10–15 × once it grows; there the floor is the band measured for
bf16 (1e-3 × loss to step 25, 0.15 after, 2e-2 on the validation loss: bench/results/train/), so a
bf16 band is never looser than before and wider only where the twin says the run itself is noisier.

A run outside its band fails: exit 1, never "OK". So does a run with a non-finite loss, one whose
length differs from the first tp's (a shorter curve cannot be compared step by step), and a twin
that did not run every step with a finite loss (no band is measured, never an infinite one). With
one row per rank (--batch = dp) reversing changes nothing: the band is the floor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

K = 10.0  # the band: K × the noise twin's running largest difference, never below the floor


@dataclass(frozen=True)
class Floor:
    """The least band, relative to the loss: per step (`early` to step `early_steps`, `late`
    after) and on the final validation loss."""

    early: float
    late: float
    early_steps: int
    val: float

    def at(self, step: int) -> float:
        """The floor at 1-based `step`."""
        return self.early if step <= self.early_steps else self.late


FLOORS = {
    # one forward's rounding of the loss: ~1 ulp measured (9e-8), 1e-6 is 8 eps
    "float32": Floor(early=1e-6, late=1e-6, early_steps=0, val=1e-6),
    # the two-part band measured for bf16 (the twin understates its noise: see above)
    "bfloat16": Floor(early=1e-3, late=0.15, early_steps=25, val=2e-2),
}


@dataclass(frozen=True)
class Band:
    """How far another tp's curve may stray from the first tp's, relative to the first tp's loss:
    K × how far the noise twin strayed up to that step, at least the dtype's floor."""

    steps: tuple[float, ...]  # the band at steps 1 … n
    val: float  # |Δ final validation loss| / validation loss
    floor: Floor

    @classmethod
    def from_twin(cls, base: dict, twin: dict, dtype: str) -> Band:
        """The band measured by `twin` (the first tp again, each batch's rows reversed)."""
        floor = FLOORS[dtype]
        envelope, steps = 0.0, []
        for step, (a, b) in enumerate(zip(twin["losses"], base["losses"]), start=1):
            envelope = max(envelope, _rel(a, b))
            steps.append(max(floor.at(step), K * envelope))
        # one validation loss is one sample of the noise: never tighter than the last step's band
        val = max(
            floor.val, K * _rel(twin["val_loss"], base["val_loss"]), steps[-1] if steps else 0
        )
        return cls(tuple(steps), val, floor)

    def at(self, step: int) -> float:
        """The per-step band at 1-based `step` (past the twin's length: its last)."""
        return self.steps[min(step, len(self.steps)) - 1] if self.steps else self.floor.at(step)

    def describe(self) -> str:
        """One line for the verdict."""
        f = self.floor
        least = (
            f"{f.early:g}"
            if f.early == f.late
            else f"{f.early:g} to step {f.early_steps}, {f.late:g} after"
        )
        last = self.at(len(self.steps))
        return (
            f"{K:g}× the noise twin's running largest |Δloss| / loss, at least {least} "
            f"(from {self.at(1):.1e} at step 1 to {last:.1e} at step {len(self.steps)}); final "
            f"validation loss {self.val:.1e}"
        )


def _rel(a: float, b: float) -> float:
    """|a − b| / |b|; infinite when either is not finite (a NaN must never look small)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.inf
    return abs(a - b) / abs(b)


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest rank (no interpolation: it is one of the measured values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class Verdict:
    """The table rows, the worst per-step difference, and whether every curve stays in its band."""

    rows: list[dict]
    worst_rel_dloss: float
    worst_margin: float  # max over tp and step of (|Δloss| / loss) / band(step); ≤ 1 passes
    worst_at: tuple[int, int] | None  # (tp, step) of worst_margin
    problems: list[str]
    band: Band
    twin: dict  # the noise twin's curve against the first tp's

    @property
    def ok(self) -> bool:
        """True only if nothing is out of band."""
        return not self.problems

    def as_json(self) -> dict:
        """compare.json's verdict fields."""
        b = self.band
        return {
            "rows": self.rows,
            "worst_rel_dloss": self.worst_rel_dloss,
            "worst_margin": self.worst_margin,
            "worst_at": self.worst_at,
            "band": {"steps": list(b.steps), "val": b.val, "K": K, "floor": asdict(b.floor)},
            "twin": self.twin,
            "problems": self.problems,
            "ok": self.ok,
        }


def compare(runs: dict[int, dict], dtype: str, twin: dict) -> Verdict:
    """Each tp's losses and final validation loss against the first tp's, in the band `twin` (the
    first tp's run with every batch's rows reversed) measures."""
    base_tp = next(iter(runs))
    band = Band.from_twin(runs[base_tp], twin, dtype)
    base, base_val = runs[base_tp]["losses"], runs[base_tp]["val_loss"]
    rows, problems = [], []
    worst, worst_margin, worst_at = 0.0, 0.0, None
    for tp, run in runs.items():
        losses = run["losses"]
        if len(losses) != len(base):
            problems.append(f"tp={tp} ran {len(losses)} steps, tp={base_tp} {len(base)}")
        rel = [_rel(a, b) for a, b in zip(losses, base)]
        deltas = [abs(a - b) if math.isfinite(a - b) else math.inf for a, b in zip(losses, base)]
        for step, r in enumerate(rel, start=1):
            margin = r / band.at(step)
            if margin > worst_margin or worst_at is None:
                worst_margin, worst_at = margin, (tp, step)
        out = [s for s, r in enumerate(rel, start=1) if not r <= band.at(s)]
        if out:
            s = out[0]
            problems.append(
                f"tp={tp} leaves the band at step {s}: |Δloss| / loss {rel[s - 1]:.2e} > "
                f"{band.at(s):g} "
                f"({len(out)} of {len(rel)} steps out)"
            )
        val_rel = _rel(run["val_loss"], base_val)
        if not val_rel <= band.val:
            problems.append(
                f"tp={tp} final validation loss {run['val_loss']:.4f} vs {base_val:.4f}: "
                f"{val_rel:.2e} relative > {band.val:g}"
            )
        worst = max(worst, max(rel, default=0.0))
        rows.append(
            {
                "tp": tp,
                "steps": len(losses),
                "max_abs_dloss": max(deltas, default=0.0),
                "max_rel_dloss": max(rel, default=0.0),
                "p95_rel_dloss": _percentile(rel, 0.95),
                "final_loss": losses[-1] if losses else math.nan,
                "val_loss": run["val_loss"],
                "val_rel_diff": val_rel,
                "tokens_per_s": run["tokens_per_s"],
            }
        )
    noise = [_rel(a, b) for a, b in zip(twin["losses"], base)]
    if len(twin["losses"]) != len(base) or not all(math.isfinite(r) for r in noise):
        problems.append("the noise twin did not run every step with a finite loss: no band")
    twin_row = {
        "max_rel_dloss": max(noise, default=0.0),
        "val_rel_diff": _rel(twin["val_loss"], base_val),
    }
    return Verdict(rows, worst, worst_margin, worst_at, problems, band, twin_row)


def markdown(rows: list[dict], base_tp: int) -> str:
    """The table as Markdown."""
    lines = [
        f"| tp | steps | max abs Δloss vs tp={base_tp} | max Δloss / loss | p95 Δloss / loss | "
        "final train loss "
        "| final val loss | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['steps']} | {r['max_abs_dloss']:.2e} | {r['max_rel_dloss']:.2e} | "
            f"{r['p95_rel_dloss']:.2e} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | "
            f"{r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)
