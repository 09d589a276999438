"""`dtp apply PLAN MODEL`: exit 0 parity holds, 1 parity or the run failed, 2 a plan or usage error."""

from __future__ import annotations

import argparse
import json

from dtp.cli.args import bounded, positive_float, positive_int, seed_int, timeout_seconds
from dtp.files import writable_file, write_text
from dtp.runtime.job import DEVICES, DTYPES


def add_parser(sub) -> None:
    """Register `dtp apply`."""
    a = sub.add_parser(
        "apply", help="shard a model under a plan, train K steps, prove parity, report costs"
    )
    a.add_argument("plan")
    a.add_argument(
        "model", help="zoo name, model YAML, package.module:factory, or a save_pretrained directory"
    )
    a.add_argument(
        "--tp",
        type=positive_int,
        help="tensor-parallel size (default 2; under torchrun WORLD_SIZE/dp)",
    )
    a.add_argument(
        "--dp",
        type=positive_int,
        default=1,
        help="data-parallel size: FSDP2 over a (dp, tp) mesh; --batch is the global batch",
    )
    a.add_argument("--batch", type=positive_int, default=2)
    a.add_argument("--seq", type=positive_int, default=16)
    a.add_argument("--steps", type=positive_int, default=3)
    a.add_argument(
        "--max-seq",
        type=bounded(1 << 20),
        metavar="N",
        help="after the steps, also compare one forward (eval and train mode) at N tokens (default: the "
        "model's maximum sequence, at most 2048)",
    )
    a.add_argument("--seed", type=seed_int, default=0)
    a.add_argument(
        "--lr", type=positive_float, default=0.1, help="SGD learning rate (momentum 0.9)"
    )
    a.add_argument("--dtype", choices=DTYPES, default="float32")
    a.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: CUDA when there is a GPU for every rank, else CPU",
    )
    a.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=300.0,
        help="seconds before every rank is stopped (exit 1)",
    )
    a.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    a.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sharded model beside its references and print the report (rank 0)."""
    from dtp.verify.apply import apply_command
    from dtp.verify.report import render

    json_path = writable_file(args.json, "--json") if args.json else None  # before any rank starts
    report = apply_command(
        plan=args.plan,
        model=args.model,
        tp=args.tp,
        dp=args.dp,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        dtype=args.dtype,
        device=args.device,
        timeout=args.timeout,
        max_seq=args.max_seq,
    )
    if report is None:  # a torchrun rank other than 0
        return 0
    print(render(report))
    if json_path:
        write_text(json_path, json.dumps(report.to_json(), indent=2, default=str) + "\n", "--json")
    return 0 if report.ok else 1
