"""`dtp explain PLAN MODEL --tp N [--json PATH]`: where every parameter lives, its cost per rank,
the schedule."""

from __future__ import annotations

import argparse
import json

from dtp.cli.args import positive_int
from dtp.cli.check import load_checked
from dtp.files import write_text


def add_parser(sub) -> None:
    """Register `dtp explain`."""
    e = sub.add_parser("explain", help="show where every parameter lives and its cost per rank")
    e.add_argument("plan")
    e.add_argument("model")
    e.add_argument("--tp", type=positive_int, required=True)
    e.add_argument(
        "--dp", type=positive_int, default=1, help="data-parallel size (FSDP2) for the schedule"
    )
    e.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    e.add_argument(
        "--batch",
        type=positive_int,
        default=1,
        help="sequences per step, for the schedule (default 1)",
    )
    e.add_argument(
        "--seq",
        type=positive_int,
        help="tokens per sequence, for the schedule (default: the block size)",
    )
    e.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="the schedule with each block's forward recomputed in backward (as dtp train does)",
    )
    e.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the explanation (and write it as JSON)."""
    import torch

    from dtp.cost.explain import explain, render

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    plan, model, checked = load_checked(args.plan, args.model, args.tp, args.dp)
    seq = args.seq or getattr(getattr(model, "config", None), "block_size", None) or 1024
    ex = explain(
        checked,
        model,
        args.model,
        args.tp,
        dtype=dtype,
        batch=args.batch,
        seq=seq,
        dp=args.dp,
        checkpoint_activations=args.checkpoint_activations,
    )
    print(render(ex))
    if args.json:  # no rank to wait for: the write itself refuses a device, a FIFO, /proc
        write_text(args.json, json.dumps(ex.to_json(), indent=2, default=str) + "\n", "--json")
    return 0
