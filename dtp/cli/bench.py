"""`dtp bench [--quick | --smoke] [--tp N]… [--repeats R] [--samples S] [--profile] [--compile]
[--device cuda [--dry-run]] [--out DIR] [--json PATH] [--no-fuzz]`: benchmarks next to a
Megatron-style baseline. The flags become one dtp.bench.run.Bench, which checks them."""

from __future__ import annotations

import argparse

from dtp.cli.args import positive_int


def add_parser(sub) -> None:
    """Register `dtp bench`."""
    p = sub.add_parser(
        "bench",
        help="benchmarks next to a Megatron-style baseline",
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
        "--tp", type=positive_int, action="append", help="run only this tp: 1, 2 or 4 (repeatable)"
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
        type=positive_int,
        help="timed rounds per configuration, 3 to 1000 (default: 20; 3 with --smoke); "
        "more samples narrow the intervals",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="measure each configuration this many times on fresh ranks (1-10); ratios are then "
        "taken over the runs, and their intervals carry how much whole runs differ",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the GPU check instead (NCCL parity, bf16 MFU, dtp/Megatron on GPU; "
        "see --dry-run)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the GPU check's logic on CPU, tiny",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks."""
    from dtp.bench.run import Bench, main

    return main(
        Bench(
            kind="smoke" if args.smoke else "quick" if args.quick else "full",
            tps=tuple(args.tp or ()),
            samples=args.samples,
            repeats=args.repeats,
            out=args.out,
            json_path=args.json,
            fuzz=not args.no_fuzz,
            profile=args.profile,
            compile=args.compile,
            device=args.device,
            dry_run=args.dry_run,
        )
    )
