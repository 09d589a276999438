"""`dtp bench`: strong and weak scaling with interleaved arms, median ratios with bootstrap
intervals, a results folder per run (`<out>/<YYYYmmdd-HHMMSS>-<kind>-<host>/`), plots when
matplotlib is installed."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dtp.bench import fuzz_speed
from dtp.bench.breakdown import profile, table
from dtp.bench.gpu import main as gpu_main
from dtp.bench.report import markdown, plots, ratios, results_folder
from dtp.bench.scaling import Config, measure
from dtp.files import writable_dir, writable_file, write_text
from dtp.runtime import ranks

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
    between runs."""
    runs: dict[tuple[str, int], list[dict]] = {
        (part, i): [] for part, c in cfgs.items() for i in range(len(c))
    }
    for _ in range(repeats):
        for (part, i), done in runs.items():
            if not done or done[-1]["ok"]:  # a configuration that failed parity is not run again
                cfg = cfgs[part][i]
                done.append(ranks.on_ranks(measure, cfg.tp, cfg, timeout=3600)[0])
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
    out = results_folder(root, f"{kind}-profile", datetime.datetime.now(datetime.timezone.utc))
    result = {
        f"tp{c.tp}": ranks.on_ranks(profile, c.tp, c, timeout=3600)[0]
        for c in strong
        if c.tp in tps
    }
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


def _samples(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 3 <= n <= 1000:
        raise argparse.ArgumentTypeError(f"must be an integer from 3 to 1000, got {text!r}")
    return n


def _repeats(text: str) -> int:
    if not (text.isdigit() and 1 <= int(text) <= 10):
        raise argparse.ArgumentTypeError(f"must be an integer from 1 to 10, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    """`dtp bench` options."""
    p = argparse.ArgumentParser(
        prog="dtp bench",
        description="scaling benchmarks next to a Megatron-style baseline "
        "(arms interleaved step by step; median ratios with bootstrap 95 % intervals)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="small models (about a minute on 2 cores)"
    )
    size.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models, tp 1-2, 3 samples: checks the machinery only",
    )
    p.add_argument("--json", metavar="PATH", help="also write the whole result here")
    p.add_argument(
        "--out", metavar="DIR", default="bench/results", help="where the run's folder goes"
    )
    p.add_argument("--no-fuzz", action="store_true", help="skip the fuzz throughput measurement")
    p.add_argument(
        "--tp", type=int, action="append", choices=TPS, help="run only this tp (repeatable)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: profile one step of every arm "
        "(strong model, tp 2 or --tp) and group its CPU time (GEMM, communication, DTensor, other)",
    )
    p.add_argument(
        "--compile", action="store_true", help="add an arm: dtp's sharded model under torch.compile"
    )
    p.add_argument(
        "--samples",
        type=_samples,
        help="timed rounds per configuration (default: 20; 3 with --smoke); "
        "more samples narrow the intervals",
    )
    p.add_argument(
        "--repeats",
        type=_repeats,
        default=1,
        help="measure each configuration this many times on "
        "fresh ranks (1-10); ratios are then taken over the runs, and their intervals carry how "
        "much "
        "whole runs differ",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the GPU check instead (NCCL parity, bf16 MFU, dtp/Megatron on GPU; see --dry-run)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with --device cuda: run the GPU check's logic on CPU, tiny",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; exit 1 when an arm failed parity (that configuration is not timed)."""
    args = parser().parse_args(argv)
    writable_dir(args.out, "--out", create=False)  # before hours of benchmarks, not after
    if args.json:
        args.json = writable_file(args.json, "--json")
    if args.device == "cuda" or args.dry_run:
        return gpu_main(Path(args.out), dry_run=args.dry_run)
    kind = "smoke" if args.smoke else "quick" if args.quick else "full"
    arms = ("dtp", "hand", "megatron") + (("dtp-compile",) if args.compile else ())
    cfgs = configs(kind, arms, tuple(args.tp or ()), args.samples)
    if args.profile:
        return _profile(cfgs["strong"], Path(args.out), kind, tuple(args.tp or (2,)))
    peak = gemm_peak()
    total = args.repeats * sum(map(len, cfgs.values())) + (0 if args.no_fuzz else 1)
    with tqdm(total=total, desc="bench", unit="run") as bar:
        result: dict = _run(cfgs, bar, args.repeats)
        if not args.no_fuzz:
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
        + "".join(f"-tp{t}" for t in sorted(set(args.tp or ())))
        + ("-compile" if args.compile else "")
    )
    out = results_folder(Path(args.out), label, now)
    text = json.dumps(result, indent=2, default=str) + "\n"
    (out / "result.json").write_text(text)
    (out / "results.md").write_text(markdown(result) + "\n")
    result["plots"] = plots(result, out)
    if args.json:
        write_text(args.json, json.dumps(result, indent=2, default=str) + "\n", "--json")
    print(markdown(result))
    print(f"written to {out}/")
    failed = [r["error"] for part in ("strong", "weak") for r in result[part] if not r["ok"]]
    for message in failed:
        print(f"error: {message}", file=sys.stderr)
    return 1 if failed else 0
