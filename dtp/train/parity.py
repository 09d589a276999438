"""Convergence parity across tp sizes (`dtp train --compare-tp`): the per-step band, the table, the
verdict.

Correct tensor parallelism only reorders floating-point sums, so curves at different tp differ by
rounding, and rounding differences between two training runs grow: the optimizer feeds each step's
difference into the next. The bands below are measured, not picked (README, "Convergence parity";
bench/results/train/):

- float32: tp 2 and 4 stay within 3e-6 × loss of tp 1 over 300 steps; the tolerance is 1e-3 × loss
  (the issue's acceptance), final validation losses within 1e-3 relative (≈ 3 significant digits).
- bfloat16 (autocast, float32 master weights): differences start at bf16 rounding (≈1e-5 × loss at
  step 1) and grow about tenfold every 25 steps until the runs are on different trajectories (after
  step ~75), where a loss spike that one run takes and the other does not can differ by several per
  cent. bf16 does this to itself: float32 against bfloat16 at tp 1, and tp 1 dp 1 against tp 1 dp 2
  (same global batch, only the summation order differs) grow and saturate the same way, and no tp
  run has diverged more from tp 1 than bf16 at tp 1 diverges from float32. So the band has two
  parts. Steps 1–25, before rounding has grown: 1e-3 × loss, ≥ 7× the largest difference measured
  there (1.3e-4, tp or not); this is where a wrong sharding shows (q, k, v sharded without packed=3:
  1e-3..6e-3 from step 1). After step 25: 0.15 × loss, 1.7× bf16's own largest deviation from
  float32 (9.0e-2, a spike at step 55 of llama seed 1; tp 4's worst is 5.2e-2 there), so it catches
  only gross divergence; and final validation losses within 2e-2 relative (2× the largest measured,
  1.0e-2, both for tp 4 and for float32 against bf16), which catches a curve that drifts steadily
  away.

A run outside its band fails: exit 1, never "OK". So does a run with a non-finite loss, or one whose
length differs from the first tp's (a shorter curve cannot be compared step by step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """How far another tp's curve may stray from the first tp's, relative to the first tp's loss."""

    early: float  # per-step |Δloss| / loss, steps 1 … early_steps
    late: float  # per-step |Δloss| / loss after early_steps
    early_steps: int
    val: float  # |Δ final validation loss| / validation loss

    def at(self, step: int) -> float:
        """The per-step band at 1-based `step`."""
        return self.early if step <= self.early_steps else self.late

    def describe(self) -> str:
        """One line for the verdict."""
        if self.early == self.late:
            return f"per step {self.early:g} × loss, final validation loss {self.val:g}"
        return (
            f"per step {self.early:g} × loss to step {self.early_steps}, {self.late:g} after; "
            f"final validation loss {self.val:g}"
        )


BANDS = {
    "float32": Band(early=1e-3, late=1e-3, early_steps=0, val=1e-3),
    "bfloat16": Band(early=1e-3, late=0.15, early_steps=25, val=2e-2),
}


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
            "band": {"early": b.early, "late": b.late, "early_steps": b.early_steps, "val": b.val},
            "tolerance": b.late,
            "problems": self.problems,
            "ok": self.ok,
        }


def compare(runs: dict[int, dict], dtype: str) -> Verdict:
    """Each tp's losses and final validation loss against the first tp's, in `dtype`'s band."""
    band = BANDS[dtype]
    base_tp = next(iter(runs))
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
    return Verdict(rows, worst, worst_margin, worst_at, problems, band)


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
