"""The paper's scaling experiment (Shoeybi et al. 2019, §5.1, Fig. 5 and Table 8), predicted: weak
scaling over the Table-1 models at 1/2/4/8-way model parallelism, alone and × 64-way data
parallelism (global batch 512), and strong scaling of one model at batch 8. Markdown, JSON and PNG.

Efficiency (stated because definitions differ by ~3 points): per-GPU FLOP/s of a configuration over
the per-GPU FLOP/s of the 1.2B model on one GPU ("flop"). This is the definition under which the
paper's 15.1 PFLOP/s at 512 GPUs is its "76 %" (15.1 / (512 × 39 TF) = 75.6 %). The
parameter-proportional one Megatron-LM's 2020 tables use (P_n / (n P_1) × T_1 / T_n) is reported
next to it ("param").
"""

from __future__ import annotations

from dataclasses import dataclass

from dtp.simulate.model import Result, Run, simulate
from dtp.simulate.prepare import Prepared
from dtp.simulate.profile import Profile

TABLE1 = (("megatron-1.2b", 1), ("megatron-2.5b", 2), ("megatron-4.2b", 4), ("megatron-8.3b", 8))
PAPER_MP = (100, 95, 82, 77)  # Fig. 5 (bars read from NVIDIA's blog image of the same figure)
PAPER_MPDP = (96, 83, 79, 74)
PAPER_STRONG = (1.0, 1.64, 2.34, 2.98)  # Table 8, 1.2B model, batch 8
PAPER_PFLOPS_512 = 15.1
PAPER_TFLOPS_1GPU = 39.0
DP = 64


@dataclass(frozen=True)
class Row:
    """One configuration of the sweep."""

    series: str  # "model parallel", "model+data parallel", "strong"
    model: str
    tp: int
    dp: int
    result: Result
    params: float
    flop_eff: float
    param_eff: float
    paper: float | None  # the paper's efficiency (%) or speedup

    def to_json(self) -> dict:
        """The row with its simulation."""
        return {
            "series": self.series,
            "model": self.model,
            "tp": self.tp,
            "dp": self.dp,
            "gpus": self.tp * self.dp,
            "params": self.params,
            "efficiency_flop": self.flop_eff,
            "efficiency_param": self.param_eff,
            "paper": self.paper,
            "simulation": self.result.to_json(),
        }


def prepare(plan: str, strong_model: str) -> dict[str, Prepared]:
    """The Table-1 models and the strong-scaling one, prepared under `plan` (what every sweep
    reuses)."""
    names = [name for name, _ in TABLE1] + (
        [strong_model] if strong_model not in dict(TABLE1) else []
    )
    return {name: Prepared(plan, name, 1024) for name in names}


def paper_sweep(
    plan: str,
    strong_model: str,
    prof: Profile,
    precision: str = "fp16",
    recompute: str = "full",
    dp_overlap: bool | None = None,
    attention: str = "unfused",
    prepared: dict[str, Prepared] | None = None,
) -> list[Row]:
    """Every configuration of the paper's experiment, simulated with the same profile and plan (the
    2019 code's unfused attention kernels unless told otherwise); `prepared`: `prepare(plan,
    strong_model)`'s."""
    overlap = prof.dp_overlap if dp_overlap is None else dp_overlap
    prepared = prepared or prepare(plan, strong_model)

    def run(name: str, tp: int, dp: int, batch: int) -> Result:
        work = prepared[name].workload(tp, 8, precision)
        return simulate(
            work,
            Run(tp, dp, 8, batch, 1024, precision, recompute, "adam", overlap, attention=attention),
            prof,
        )

    base = run(TABLE1[0][0], 1, 1, 8)
    base_params = prepared[TABLE1[0][0]].workload(1, 8, precision).params_total
    rows: list[Row] = []
    for series, dp, paper in (
        ("model parallel", 1, PAPER_MP),
        ("model+data parallel", DP, PAPER_MPDP),
    ):
        for (name, tp), bar in zip(TABLE1, paper):
            r = run(name, tp, dp, 8 * dp)
            params = prepared[name].workload(tp, 8, precision).params_total
            flop = r.tflops_per_gpu / base.tflops_per_gpu
            param = params / (tp * base_params) * base.iteration_s / r.iteration_s
            rows.append(Row(series, name, tp, dp, r, params, 100 * flop, 100 * param, bar))
    strong = [(tp, run(strong_model, tp, 1, 8)) for tp in (1, 2, 4, 8)]
    params = prepared[strong_model].workload(1, 8, precision).params_total
    # "flop_eff" holds the speedup T_1 / T_tp here
    for (tp, r), speedup in zip(strong, PAPER_STRONG):
        rows.append(
            Row(
                "strong",
                strong_model,
                tp,
                1,
                r,
                params,
                strong[0][1].iteration_s / r.iteration_s,
                0.0,
                speedup if strong_model == TABLE1[0][0] else None,
            )
        )
    return rows


def markdown(rows: list[Row], prof: Profile) -> str:
    """The weak- and strong-scaling tables."""
    out = [
        f"Profile `{prof.name}` ({prof.description}); calibrated: {prof.calibrated or 'nothing'}",
        "",
        'Efficiency = per-GPU FLOP/s ÷ that of the 1.2B model on 1 GPU ("flop", the paper\'s 76 % at '
        '15.1 PFLOP/s); "param" = P_n/(n·P_1) × T_1/T_n (Megatron-LM 2020\'s tables).',
        "",
        "| series | model | tp × dp | iteration s | compute / TP / DP / optimizer s | TFLOP/s per "
        "GPU | "
        "aggregate PFLOP/s | memory GiB (fits) | efficiency flop | param | paper | flop − paper |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.series == "strong":
            continue
        r = row.result
        diff = f"{row.flop_eff - row.paper:+.1f}" if row.paper is not None else "—"
        out.append(
            f"| {row.series} | {row.model} | {row.tp} × {row.dp} | {r.iteration_s:.3f} | "
            f"{r.compute_s:.3f} / {r.tp_comm_s:.3f} / {r.dp_comm_s:.3f} / {r.optimizer_s:.3f} | "
            f"{r.tflops_per_gpu:.1f} | {r.aggregate_pflops:.2f} | {r.memory.total / 2**30:.1f} "
            f"({'yes' if r.memory.fits else 'NO'}) | {row.flop_eff:.1f} % | {row.param_eff:.1f} % | "
            ""
            f"{row.paper:.0f} % | {diff} |"
        )
    strong = [r for r in rows if r.series == "strong"]
    if strong:
        out += [
            "",
            f"Strong scaling of {strong[0].model} (batch 8):",
            "",
            "| GPUs | iteration s | TP comm s | speedup | paper |",
            "|---|---|---|---|---|",
        ]
        for row in strong:
            paper = f"{row.paper:.2f}×" if row.paper is not None else "—"
            out.append(
                f"| {row.tp} | {row.result.iteration_s:.3f} | {row.result.tp_comm_s:.3f} | "
                f"{row.flop_eff:.2f}× | {paper} |"
            )
    last = next(r for r in rows if r.series == "model+data parallel" and r.tp == 8)
    one = rows[0].result
    out += [
        "",
        f"512 GPUs: {last.result.aggregate_pflops:.2f} PFLOP/s (paper {PAPER_PFLOPS_512}); "
        f"1.2B on 1 GPU: {one.tflops_per_gpu:.1f} TFLOP/s (paper {PAPER_TFLOPS_1GPU:.0f}).",
    ]
    return "\n".join(out) + "\n"


def plot(rows: list[Row], path: str) -> None:
    """Bars of predicted vs published efficiency, and the strong-scaling speedups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, series in zip(axes, ("model parallel", "model+data parallel")):
        sel = [r for r in rows if r.series == series]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r.flop_eff for r in sel], 0.4, label="dtp simulate")
        ax.bar([i + 0.2 for i in x], [r.paper for r in sel], 0.4, label="paper (Fig. 5)")
        ax.set_xticks(list(x), [str(r.tp * r.dp) for r in sel])
        ax.set_xlabel("GPUs")
        ax.set_ylabel("weak-scaling efficiency %")
        ax.set_title(series)
        ax.legend()
    strong = [r for r in rows if r.series == "strong"]
    gpus = [r.tp for r in strong]
    axes[2].plot(gpus, [r.flop_eff for r in strong], "o-", label="dtp simulate")
    if strong and strong[0].paper is not None:
        axes[2].plot(gpus, [r.paper for r in strong], "s--", label="paper (Table 8)")
    axes[2].plot(gpus, gpus, ":", color="grey", label="linear")
    axes[2].set_xlabel("GPUs")
    axes[2].set_ylabel("speedup")
    axes[2].set_title(f"strong scaling, {strong[0].model if strong else ''}")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
