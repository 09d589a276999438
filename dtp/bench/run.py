"""`dtp bench`: strong and weak scaling with interleaved arms, median ratios with bootstrap
intervals, a results folder per run (`<out>/<YYYYmmdd-HHMMSS>-<kind>-<host>/`), plots when
matplotlib is installed."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dtp.bench import fuzz_speed, scaling
from dtp.bench.breakdown import profile, table
from dtp.bench.gpu import main as gpu_main
from dtp.bench.report import markdown, plots, ratios, results_folder
from dtp.bench.scaling import Config
from dtp.errors import UsageError, shorten
from dtp.files import writable_dir, writable_file, write_text

TPS = (1, 2, 4)
KINDS = {  # per kind: strong model, weak head size and shape, warm-up rounds, timed rounds
    "full": dict(
        strong=dict(n_layer=2, n_head=8, n_embd=512, vocab_size=8192, seq=128, batch=2),
        head=64,
        weak=dict(n_layer=2, vocab_size=8192, seq=128, batch=2),
        warmup=2,
        samples=20,
    ),
    "quick": dict(
        strong=dict(n_layer=2, n_head=8, n_embd=256, vocab_size=2048, seq=64, batch=4),
        head=32,
        weak=dict(n_layer=2, vocab_size=2048, seq=64, batch=4),
        warmup=2,
        samples=20,
    ),
    # for the test suite: tiny models, tp 1 and 2, 3 samples (the timings mean nothing)
    "smoke": dict(
        strong=dict(n_layer=1, n_head=4, n_embd=32, vocab_size=64, seq=8, batch=2),
        head=8,
        weak=dict(n_layer=1, vocab_size=64, seq=8, batch=2),
        warmup=1,
        samples=3,
    ),
}


def configs(
    kind: str, arms: tuple[str, ...], only_tp: tuple[int, ...] = (), samples: int | None = None
) -> dict[str, list[Config]]:
    """Strong scaling (a fixed GPT at tp 1, 2, 4) and weak scaling (the paper's recipe scaled down:
    the hidden size grows with tp at a fixed head size, n_embd ≈ 4·head·√tp, heads divisible by tp)."""
    k = KINDS[kind]
    tps = TPS[:2] if kind == "smoke" else TPS
    heads = {1: 4, 2: 6, 4: 8}
    common = dict(warmup=k["warmup"], samples=samples or k["samples"], arms=arms)
    tps = tuple(tp for tp in tps if not only_tp or tp in only_tp)
    return {
        "strong": [Config(tp=tp, **k["strong"], **common) for tp in tps],
        "weak": [
            Config(tp=tp, n_head=heads[tp], n_embd=heads[tp] * k["head"], **k["weak"], **common)
            for tp in tps
        ],
    }


def gemm_peak(n: int = 512, reps: int = 10, trials: int = 5) -> float:
    """Single-thread fp32 GEMM FLOP/s, best of `trials`, measured alone before any rank starts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = 0.0
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(threads)


def _run(cfgs: dict[str, list[Config]], progress, repeats: int = 1) -> dict[str, list[dict]]:
    """Each configuration measured `repeats` times on fresh ranks, every configuration in turn
    between runs. Every configuration passes its pre-flight before the first rank starts."""
    prepared = {
        (part, i): scaling.preflight(cfg) for part, c in cfgs.items() for i, cfg in enumerate(c)
    }
    runs: dict[tuple[str, int], list[dict]] = {key: [] for key in prepared}
    for _ in range(repeats):
        for key, done in runs.items():
            if not done or done[-1]["ok"]:  # a configuration that failed parity is not run again
                done.append(scaling.run(prepared[key]))
            progress.update(1)
    return {part: [pool_runs(runs[part, i]) for i in range(len(c))] for part, c in cfgs.items()}


def pool_runs(runs: list[dict]) -> dict:
    """One configuration's runs as one result: samples pooled (and kept per run, for the ratios),
    the worst parity error of any run; a run that failed, or whose collectives differ from the
    first's, fails it."""
    first = runs[0]
    if len(runs) == 1 or not all(r["ok"] for r in runs):
        return next((r for r in runs if not r["ok"]), first)
    for r in runs[1:]:
        if (r["collectives"], r["comm_bytes"]) != (first["collectives"], first["comm_bytes"]):
            return first | {
                "ok": False,
                "error": "the collectives of one run differ from another's: "
                f"{first['collectives']} vs {r['collectives']}",
            }
    arms = first["times_ms"]
    parity = {
        arm: {k: max(r["parity"][arm][k] for r in runs) for k in errs}
        for arm, errs in first["parity"].items()
    }
    return first | {
        "runs": len(runs),
        "parity": parity,
        "times_ms_by_run": {arm: [r["times_ms"][arm] for r in runs] for arm in arms},
        "times_ms": {arm: [t for r in runs for t in r["times_ms"][arm]] for arm in arms},
    }


def _profile(strong: list[Config], root: Path, kind: str, tps: tuple[int, ...]) -> int:
    """`--profile`: profile.json and profile.md in a new results folder."""
    prepared = [scaling.preflight(c) for c in strong if c.tp in tps]
    out = results_folder(root, f"{kind}-profile", datetime.datetime.now(datetime.timezone.utc))
    result = {f"tp{p.job.tp}": scaling.run(p, profile) for p in prepared}
    (out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
    text = "\n\n".join(
        f"tp={k[2:]}, n_embd={strong[0].n_embd}: self CPU ms per step on rank 0\n\n{table(v)}"
        for k, v in result.items()
    )
    (out / "profile.md").write_text(text + "\n")
    print(text)
    print(f"written to {out}/")
    return 0


def machine() -> dict:
    """What ran the benchmark."""
    return {
        "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "device": "cpu",
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


SAMPLES = (3, 1000)  # timed rounds per configuration, at least and at most
REPEATS = (1, 10)  # fresh runs per configuration


def _within(flag: str, value: object, bounds: tuple[int, int]) -> None:
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{flag} must be an integer from {low} to {high}, got {shorten(value)}")


@dataclass(frozen=True, kw_only=True)
class Bench:
    """One `dtp bench` run, validated here, once, one message per condition (UsageError: exit 2
    before anything is measured). Each configuration it times is a Config, a job of its own."""

    kind: str = "full"  # a key of KINDS: the sizes
    tps: tuple[int, ...] = ()  # only these tp (empty: every one of TPS)
    samples: int | None = None  # timed rounds per configuration (None: the kind's)
    repeats: int = 1  # fresh runs per configuration, every configuration in turn between them
    out: str = "bench/results"  # where the run's folder goes
    json_path: str | None = None  # also write the whole result here
    fuzz: bool = True  # measure the fuzzer's throughput too
    profile: bool = False  # instead of timing: profile one step of every arm
    compile: bool = False  # add the arm of dtp's blocks under torch.compile
    device: str = "cpu"  # cuda: the GPU check instead (dtp.bench.gpu)
    dry_run: bool = False  # the GPU check's logic on CPU, tiny

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(
                f"the size must be one of {', '.join(KINDS)}, got {shorten(self.kind)}"
            )
        wrong = [t for t in self.tps if t not in TPS]
        if wrong:
            raise UsageError(
                f"--tp must be one of {', '.join(map(str, TPS))}, got {shorten(wrong[0])}"
            )
        if self.samples is not None:
            _within("--samples", self.samples, SAMPLES)
        _within("--repeats", self.repeats, REPEATS)
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"--device must be cpu or cuda, got {shorten(self.device)}")


def main(bench: Bench) -> int:
    """Run the benchmarks; exit 1 when an arm failed parity (that configuration is not timed)."""
    writable_dir(bench.out, "--out", create=False)  # before hours of benchmarks, not after
    json_path = writable_file(bench.json_path, "--json") if bench.json_path else None
    if bench.device == "cuda" or bench.dry_run:
        return gpu_main(Path(bench.out), dry_run=bench.dry_run)
    kind = bench.kind
    arms = ("dtp", "hand", "megatron") + (("dtp-compile",) if bench.compile else ())
    cfgs = configs(kind, arms, bench.tps, bench.samples)
    if bench.profile:
        return _profile(cfgs["strong"], Path(bench.out), kind, bench.tps or (2,))
    peak = gemm_peak()
    total = bench.repeats * sum(map(len, cfgs.values())) + bench.fuzz
    with tqdm(total=total, desc="bench", unit="run") as bar:
        result: dict = _run(cfgs, bar, bench.repeats)
        if bench.fuzz:
            result["fuzz"] = fuzz_speed.measure(
                examples={"full": 60, "quick": 20}.get(kind, 4),
                baseline_examples={"full": 8, "quick": 3}.get(kind, 1),
            )
            bar.update(1)
    now = datetime.datetime.now(datetime.timezone.utc)
    result |= {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "kind": kind,
        "machine": machine(),
        "gemm_flops_single_thread": peak,
    }
    result["ratios"] = ratios(result)
    label = (
        kind
        + "".join(f"-tp{t}" for t in sorted(set(bench.tps)))
        + ("-compile" if bench.compile else "")
    )
    out = results_folder(Path(bench.out), label, now)
    text = json.dumps(result, indent=2, default=str) + "\n"
    (out / "result.json").write_text(text)
    (out / "results.md").write_text(markdown(result) + "\n")
    result["plots"] = plots(result, out)
    if json_path:
        write_text(json_path, json.dumps(result, indent=2, default=str) + "\n", "--json")
    print(markdown(result))
    print(f"written to {out}/")
    failed = [r["error"] for part in ("strong", "weak") for r in result[part] if not r["ok"]]
    for message in failed:
        print(f"error: {message}", file=sys.stderr)
    return 1 if failed else 0
