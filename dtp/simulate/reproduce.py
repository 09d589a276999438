"""Published rows the simulator is held against (`dtp simulate --reproduce SOURCE`): each row's
setup, the published figure, the prediction on the source's shipped profile and the error. At most
one number per source is fitted, the profile's `achieved_fraction`, on the row marked `fitted`;
`fit` re-derives it.

Sources (the setups and the figures are quoted in /work/shared/research/megatron-a100-rows.md, and
for torchtitan in its docs/performance.md):
- `a100`: Narayanan et al. 2021 (arXiv 2104.04473) Table 1, the rows with pipeline size 1 (TF/GPU;
  the iteration time is eq. 3 ÷ (GPUs × TF/GPU)), micro-batch sizes from NVIDIA/Megatron-LM's
  examples/sc21 scripts; Korthikanti et al. 2022 (arXiv 2205.05198) Table 5, the 22B model's
  iteration times. Selene, DGX A100 80 GB, fp16, Megatron's fused softmax, torch DDP overlapped with
  backward.
- `torchtitan`: pytorch/torchtitan docs/performance.md (2024–25), Tables 1 and 3: Llama 3.1 8B with
  FSDP2 (bf16, per-op selective checkpointing, flash attention), with and without torch.compile, on
  8 and 128 H100 96 GB (Grand Teton, 500 W). Its FSDP × TP rows (Table 4, 70B on 256 GPUs) use
  Float8, which dtp does not model: their memory is checked, not their speed.
- `torchtitan-a100`: the same page's early-2024 version: Llama 3 8B and 70B with FSDP2 on 64 A100 80
  GB, local batch 1 × 8192; its own achieved_fraction is fitted on the 8B row (`Source.fraction`).
- `megatron2019`: Shoeybi et al. 2019, Fig. 5 and Table 8, through `sweep.py` (efficiencies, not
  seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtp.errors import UsageError
from dtp.files import shipped
from dtp.simulate.flops import narayanan_flops
from dtp.simulate.model import Result, Run, simulate
from dtp.simulate.prepare import Prepared
from dtp.simulate.profile import Profile, load


@dataclass(frozen=True)
class Row:
    """One published configuration and its figure (seconds per iteration, or memory only)."""

    label: str
    model: str
    # a shipped plan ("plans/gpt2.tp"), read through the package, never the working directory
    plan: str
    run: Run
    published_s: float | None  # None: only the memory is checked (a speed dtp cannot model)
    published: str  # the figure as the source gives it
    published_GiB: float | None = None
    fitted: bool = False  # this row sets the profile's achieved_fraction


@dataclass(frozen=True)
class Source:
    """A publication, its profile and its rows."""

    name: str
    citation: str
    profile: str
    rows: tuple[Row, ...]
    # FITTED on the fitted row, replacing the profile's (another source's fit)
    fraction: float | None = None

    def load_profile(self) -> Profile:
        """The source's profile, with its own fitted achieved_fraction where it has one."""
        prof = load(self.profile)
        return prof if self.fraction is None else replace(prof, achieved_fraction=self.fraction)


def _eq3_seconds(tflops: float, run: Run, layers: int, hidden: int) -> float:
    """Narayanan et al.'s iteration time from their TF/GPU: eq. 3 FLOPs ÷ (GPUs × TF/GPU)."""
    return narayanan_flops(run.global_batch, run.seq, layers, hidden, 51200) / (
        run.gpus * tflops * 1e12
    )


def _n21(
    model: str, tp: int, gbs: int, mbs: int, tf: float, layers: int, hidden: int, fitted=False
) -> Row:
    run = Run(tp, 32, mbs, gbs, 2048, "fp16", "full", "adam", True, attention="fused")
    return Row(
        f"N21 {model.split('-')[1].upper()} TP {tp} × DP 32",
        model,
        "plans/gpt2.tp",
        run,
        _eq3_seconds(tf, run, layers, hidden),
        f"{tf:.0f} TF/GPU",
        fitted=fitted,
    )


def _k22(label: str, plan: str, recompute: str, seconds: float) -> Row:
    # K22 §6.2: the input-gradient all-reduce overlaps the weight-gradient GEMM in backward
    run = Run(8, 1, 4, 4, 2048, "fp16", recompute, "adam", True, attention="fused", tp_overlap=True)
    return Row(label, "megatron-22b", plan, run, seconds, f"{seconds} s")


def _tt(label: str, dp: int, compile_: bool, tps: float, gib: float, fitted=False) -> Row:
    run = Run(1, dp, 2, 2 * dp, 8192, "bf16", "op", "adam", True, fsdp=True, compile=compile_)
    return Row(
        label,
        "llama3-8b",
        "plans/llama.tp",
        run,
        2 * 8192 / tps,
        f"{tps:,.0f} TPS/GPU",
        gib,
        fitted,
    )


def _tt2(
    label: str, model: str, dp: int, mbs: int, recompute: str, tps: float, async_tp: bool
) -> Row:
    # torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md: bf16, torch.compile, seq 8192
    # (the llama3 train configs' seq_len), TP 8 with sequence parallelism inside a host × FSDP
    # across hosts. TPS is per GPU: local batch × seq ÷ (seconds × tp). Async TP is priced as dtp's
    # --tp-overlap (backward only).
    run = Run(
        8,
        dp,
        mbs,
        mbs * dp,
        8192,
        "bf16",
        recompute,
        "adam",
        True,
        fsdp=True,
        compile=True,
        tp_overlap=async_tp,
    )
    return Row(label, model, "plans/llama-sp.tp", run, mbs * 8192 / (tps * 8), f"{tps:,} TPS/GPU")


SOURCES = {
    "a100": Source(
        "a100",
        "Narayanan et al. 2021, Table 1 (PP 1); Korthikanti et al. 2022, Table 5 (22B)",
        "a100-80gb",
        (
            _n21("megatron-1.7b", 1, 512, 16, 137, 24, 2304, fitted=True),
            _n21("megatron-3.6b", 2, 512, 16, 138, 30, 3072),
            _n21("megatron-7.5b", 4, 512, 16, 142, 36, 4096),
            _n21("megatron-18.4b", 8, 1024, 8, 135, 40, 6144),
            _k22("K22 22B TP 8, full recompute", "plans/gpt2.tp", "full", 1.42),
            _k22("K22 22B TP 8, SP + selective", "plans/gpt2-sp.tp", "selective", 1.10),
        ),
    ),
    "torchtitan": Source(
        "torchtitan",
        "pytorch/torchtitan docs/performance.md, Tables 1, 3 and 4; "
        "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (bf16 FSDP × TP)",
        "h100-96gb",
        (
            _tt("8B FSDP 8", 8, False, 5762, 82.4, fitted=True),
            _tt("8B FSDP 8 + compile", 8, True, 6667, 77.0),
            _tt("8B FSDP 128", 128, False, 5605, 67.0),
            _tt("8B FSDP 128 + compile", 128, True, 6514, 62.0),
            Row(
                "70B FSDP 32 × TP 8 (Float8: memory only)",
                "llama3-70b",
                "plans/llama-sp.tp",
                Run(8, 32, 16, 512, 8192, "bf16", "full", "adam", True, fsdp=True, compile=True),
                None,
                "829 TPS/GPU (Float8)",
                71.9,
            ),
            _tt2(
                "70B FSDP 32 × TP 8, mb 16, full recompute",
                "llama3-70b",
                32,
                16,
                "full",
                597.3,
                False,
            ),
            _tt2(
                "70B FSDP 32 × TP 8, mb 16, full recompute, async TP",
                "llama3-70b",
                32,
                16,
                "full",
                652.4,
                True,
            ),
            _tt2(
                "8B FSDP 8 × TP 8, mb 12, per-op recompute", "llama3-8b", 8, 12, "op", 4378, False
            ),
            _tt2(
                "8B FSDP 8 × TP 8, mb 12, per-op recompute, async TP",
                "llama3-8b",
                8,
                12,
                "op",
                4809.4,
                True,
            ),
        ),
    ),
}
SOURCES["torchtitan-a100"] = Source(
    "torchtitan-a100",
    "pytorch/torchtitan docs/performance.md (early 2024): Llama 3 on 64 A100 80GB, FSDP2",
    "a100-80gb",
    (
        Row(
            "8B FSDP 64, per-op checkpointing",
            "llama3-8b",
            "plans/llama.tp",
            Run(1, 64, 1, 64, 8192, "bf16", "op", "adam", True, fsdp=True),
            8192 / 2973,
            "2,973 WPS",
            fitted=True,
        ),
        Row(
            "70B FSDP 64, full recompute",
            "llama3-70b",
            "plans/llama.tp",
            Run(1, 64, 1, 64, 8192, "bf16", "full", "adam", True, fsdp=True),
            8192 / 331,
            "331 WPS",
        ),
    ),
    fraction=0.751,
)
NAMES = ("megatron2019", *SOURCES)


@dataclass(frozen=True)
class Outcome:
    """A row with its prediction."""

    row: Row
    result: Result

    @property
    def error(self) -> float | None:
        """Predicted ÷ published − 1 (iteration time), or None for a memory-only row."""
        return self.result.iteration_s / self.row.published_s - 1 if self.row.published_s else None


def source(name: str) -> Source:
    """The source by name; an unknown one is a UsageError."""
    if name not in SOURCES:
        raise UsageError(f"--reproduce: unknown source '{name[:60]}' (sources: {', '.join(NAMES)})")
    return SOURCES[name]


def predict(src: Source, prof: Profile | None = None, cache: dict | None = None) -> list[Outcome]:
    """Every row of `src` on its profile (or `prof`); `cache` keeps the prepared models between
    calls."""
    prof = prof or src.load_profile()
    prepared = {} if cache is None else cache
    out = []
    for row in src.rows:
        key = (row.plan, row.model, row.run.seq)
        if key not in prepared:
            prepared[key] = Prepared(str(shipped(row.plan)), row.model, row.run.seq)
        work = prepared[key].workload(row.run.tp, row.run.micro_batch, row.run.precision)
        out.append(Outcome(row, simulate(work, row.run, prof)))
    return out


def fit(src: Source) -> float:
    """The achieved_fraction at which the source's fitted row is predicted exactly (bisection)."""
    row = next(r for r in src.rows if r.fitted)
    prof, cache = src.load_profile(), {}
    one = replace(src, rows=(row,))
    low, high = 0.05, 1.0
    for _ in range(30):
        mid = (low + high) / 2
        if predict(one, replace(prof, achieved_fraction=mid), cache)[0].error > 0:
            low = mid  # too slow: a higher fraction
        else:
            high = mid
    return (low + high) / 2


def markdown(src: Source, outcomes: list[Outcome]) -> str:
    """The table of predicted vs published, and the mean absolute error of the rows not fitted."""
    prof = src.load_profile()
    out = [
        f"{src.citation} — profile `{prof.name}` ({prof.description})",
        "",
        "| row | run | predicted s | published | published s | error | memory GiB (published) | "
        "fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        r, run = o.result, o.row.run
        how = (
            f"tp {run.tp} × dp {run.dp}{' FSDP' if run.fsdp else ''}, mb {run.micro_batch} × "
            f"{run.microbatches}, "
            f"{run.precision}, recompute {run.recompute}, "
            f"{run.attention}{', compile' if run.compile else ''}"
            f"{', TP overlap' if run.tp_overlap else ''}"
        )
        err = (
            "—"
            if o.error is None
            else f"{100 * o.error:+.1f} %" + (" (fitted)" if o.row.fitted else "")
        )
        pub_s = f"{o.row.published_s:.3f}" if o.row.published_s else "—"
        pub_m = f" ({o.row.published_GiB})" if o.row.published_GiB else ""
        out.append(
            f"| {o.row.label} | {how} | {r.iteration_s:.3f} | {o.row.published} | {pub_s} | {err} | "
            ""
            f"{r.memory_gib:.1f}{pub_m} | {'yes' if r.fits else 'NO'} |"
        )
    errors = [abs(o.error) for o in outcomes if o.error is not None and not o.row.fitted]
    if errors:
        out += [
            "",
            f"Rows not fitted: mean |error| {100 * sum(errors) / len(errors):.1f} %, "
            f"max {100 * max(errors):.1f} %. Fitted: achieved_fraction {prof.achieved_fraction} "
            f"({'on this source' + chr(39) + 's fitted row' if src.fraction else prof.calibrated})",
        ]
    return "\n".join(out) + "\n"
