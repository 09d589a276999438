"""What the 2019 paper's Table 8 and 512-GPU bar would need from the simulator, computed rather than
argued.

The dgx2h-v100 profile carries one fitted knob, the NVSwitch all-reduce efficiency, fitted on Fig.
5's model-parallel bars. Two published results stay outside their bands with it, and each is traced
here to the one term that would have to change, by how much, and what that change does to the
results it was not fitted on:

- Table 8 (strong scaling of the 1.2B model at batch 8): the efficiency that makes the 8-GPU speedup
  the paper's, solved by bisection; the speedups and Fig. 5's bars at that efficiency.
- The 512-GPU bar (8.3B, 8 × 64): the gradient all-reduce after backward, with and without DDP's
  overlap with backward, and the model+data-parallel bars each gives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtp.simulate.profile import Profile
from dtp.simulate.sweep import PAPER_MP, PAPER_MPDP, PAPER_STRONG, Row, paper_sweep


@dataclass(frozen=True)
class StrongFit:
    """The intra-node link efficiency that reproduces Table 8, and what it predicts elsewhere."""

    fitted: float  # the profile's (Fig. 5's) efficiency
    needed: float  # the one under which the 8-GPU speedup is the paper's
    busbw_GBps: tuple[float, float]  # the effective bus bandwidths of the two
    speedups: tuple[float, ...]  # at 2, 4, 8 GPUs under `needed`
    # TP communication at 8 GPUs under the fitted and the needed efficiency
    tp_comm_s: tuple[float, float]
    mp_bars: tuple[float, ...]  # Fig. 5's model-parallel bars under `needed`


@dataclass(frozen=True)
class DataParallel:
    """The 512-GPU point with the gradient all-reduce after backward and overlapped with it."""

    dp_comm_s: float  # exposed at 8 × 64, after backward
    after: tuple[float, ...]  # the model+data-parallel bars, all-reduce after backward
    overlapped: tuple[float, ...]  # ... overlapped with backward (DDP's buckets)


def _series(rows: list[Row], series: str) -> list[Row]:
    return [r for r in rows if r.series == series]


def strong_fit(plan: str, prof: Profile, prepared: dict, steps: int = 40) -> StrongFit:
    """Solve for the NVSwitch efficiency under which the simulated 8-GPU speedup is Table 8's (the
    speedup grows with the efficiency: bisection)."""

    def sweep(efficiency: float) -> list[Row]:
        return paper_sweep(
            plan,
            "megatron-1.2b",
            replace(prof, intra=replace(prof.intra, efficiency=efficiency)),
            prepared=prepared,
        )

    lo, hi = 0.01, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (
            (mid, hi)
            if _series(sweep(mid), "strong")[-1].flop_eff < PAPER_STRONG[-1]
            else (lo, mid)
        )
    needed = (lo + hi) / 2
    rows, base = sweep(needed), sweep(prof.intra.efficiency)
    strong = _series(rows, "strong")
    return StrongFit(
        prof.intra.efficiency,
        needed,
        (prof.intra.busbw_GBps * prof.intra.efficiency, prof.intra.busbw_GBps * needed),
        tuple(r.flop_eff for r in strong[1:]),
        (_series(base, "strong")[-1].result.tp_comm_s, strong[-1].result.tp_comm_s),
        tuple(r.flop_eff for r in _series(rows, "model parallel")),
    )


def data_parallel(plan: str, prof: Profile, prepared: dict) -> DataParallel:
    """The model+data-parallel bars with the gradient all-reduce after backward and overlapped with
    it."""
    after = _series(
        paper_sweep(plan, "megatron-1.2b", prof, dp_overlap=False, prepared=prepared),
        "model+data parallel",
    )
    overlapped = _series(
        paper_sweep(plan, "megatron-1.2b", prof, dp_overlap=True, prepared=prepared),
        "model+data parallel",
    )
    return DataParallel(
        after[-1].result.dp_comm_s,
        tuple(r.flop_eff for r in after),
        tuple(r.flop_eff for r in overlapped),
    )


def _bars(values: tuple[float, ...]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def markdown(fit: StrongFit, dp: DataParallel) -> str:
    """The two traces as a section of `--reproduce megatron2019`."""
    implied = [100 * (bar_mp - bar_dp) / bar_mp for bar_mp, bar_dp in zip(PAPER_MP, PAPER_MPDP)]
    return "\n".join(
        [
            "### What the results outside their bands would need",
            "",
            "- **Table 8 (strong scaling).** With the tensor-parallel all-reduce at "
            f"{fit.busbw_GBps[1]:.0f} GB/s of "
            f"bus bandwidth (NVSwitch efficiency {fit.needed:.2f}) instead of the "
            f"{fit.busbw_GBps[0]:.0f} GB/s "
            f"({fit.fitted:.2f}) that Fig. 5's bars fit, the simulator gives "
            f"{'/'.join(f'{s:.2f}' for s in fit.speedups)}× at 2/4/8 GPUs (paper "
            f"{'/'.join(f'{s:.2f}' for s in PAPER_STRONG[1:])}×): TP communication at 8 GPUs of "
            f"{fit.tp_comm_s[1]:.2f} s instead of {fit.tp_comm_s[0]:.2f} s explains the whole gap. "
            "The same link would "
            f"put Fig. 5's model-parallel bars at {_bars(fit.mp_bars)} % (paper {_bars(PAPER_MP)} "
            "%): the two "
            f"published results would need all-reduce speeds {fit.fitted / fit.needed:.1f}× apart, "
            "which no single "
            "profile carries; the simulator keeps the Fig. 5 fit.",
            "- **512 GPUs (8.3B, 8 × 64).** The gradient all-reduce after backward (fp16, 8 "
            "data-parallel groups "
            f"sharing each node's 8 × 100 Gb/s) is exposed for {dp.dp_comm_s:.2f} s, giving bars "
            f"{_bars(dp.after)} % against the paper's {_bars(PAPER_MPDP)} %. Overlapped with "
            "backward (DDP's buckets) "
            f"it gives {_bars(dp.overlapped)} %: the 512-GPU bar is met, and the 128-GPU one is "
            f"{dp.overlapped[1] - PAPER_MPDP[1]:+.0f} points off. The paper's own drops from the "
            "model-parallel to the "
            f"model+data-parallel bar are {'/'.join(f'{v:.0f}' for v in implied)} % at "
            "64/128/256/512 GPUs, for "
            "gradients that grow with the model: not monotonic in bytes, so no bandwidth model fits "
            "all four.",
            "",
        ]
    )
