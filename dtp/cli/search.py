"""`dtp search MODEL --profile P --gpus G --seq S --global-batch B`: the best layout for a cluster;
exit 0 found, 1 nothing fits, 2 a usage error."""

from __future__ import annotations

import argparse
import json
import sys

from dtp.cli.args import bounded
from dtp.errors import UsageError
from dtp.files import writable_file, write_text

# typos, not clusters
LIMITS = {"gpus": 1 << 20, "seq": 1 << 20, "global_batch": 1 << 24, "micro_batch": 1 << 16}
SHOWN = 12


def add_parser(sub) -> None:
    """Register `dtp search`."""
    s = sub.add_parser(
        "search",
        help="rank tp × dp, sequence parallelism and recomputation for a cluster by `dtp "
        "simulate` on the auto plan",
    )
    s.add_argument(
        "model", help="zoo name, model YAML, package.module:factory, or a save_pretrained directory"
    )
    s.add_argument(
        "--profile",
        required=True,
        help="a shipped hardware profile (see dtp simulate) or a YAML file",
    )
    s.add_argument("--gpus", type=bounded(LIMITS["gpus"]), required=True)
    s.add_argument("--seq", type=bounded(LIMITS["seq"]), required=True, help="tokens per sequence")
    s.add_argument(
        "--global-batch",
        type=bounded(LIMITS["global_batch"]),
        required=True,
        help="sequences per iteration",
    )
    s.add_argument(
        "--micro-batch",
        type=bounded(LIMITS["micro_batch"]),
        help="sequences per micro-batch (default: try 1, 2, 4, 8, 16)",
    )
    s.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="bf16")
    s.add_argument(
        "--dp-modes",
        default="ddp,fsdp",
        help="data parallelism to try: ddp, fsdp or both (default)",
    )
    s.add_argument(
        "--json", metavar="PATH", help="also write the best layout and every candidate as JSON"
    )
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Price every layout and print the ranked table and the command that runs the winner."""
    from dtp import models
    from dtp.auto.search import search, why_lost
    from dtp.simulate import profile

    modes = tuple(m.strip() for m in args.dp_modes.split(",") if m.strip())
    if not modes or set(modes) - {"ddp", "fsdp"}:
        raise UsageError(f"--dp-modes takes ddp, fsdp or ddp,fsdp, not {args.dp_modes!r}")
    json_path = writable_file(args.json, "--json") if args.json else None
    prof = profile.load(args.profile)
    model = models.build(models.resolve(args.model), device="meta")
    micro = [args.micro_batch] if args.micro_batch else [1, 2, 4, 8, 16]
    found = search(
        model,
        args.model,
        prof,
        args.gpus,
        args.seq,
        args.global_batch,
        micro_batches=micro,
        precision=args.precision,
        dp_modes=modes,
        log=lambda m: print(m, file=sys.stderr),
    )
    if not found:
        raise UsageError(
            f"no layout of {args.gpus} GPUs divides --global-batch {args.global_batch} into "
            "micro-batches "
            f"of {', '.join(map(str, micro))}"
        )
    best = found[0]
    capacity = prof.memory_GiB
    print(
        f"dtp search: {args.model} on {args.gpus} × {prof.name} ({capacity:.0f} GiB), seq "
        f"{args.seq}, global batch "
        f"{args.global_batch}, {args.precision}; {len(found)} layouts priced by dtp simulate, "
        f"{sum(c.fits for c in found)} fit"
    )
    print(f"{'rank':>4}  {'layout':56s} {'iter s':>8} {'TFLOP/s':>8} {'GiB':>7}  why not first")
    for i, c in enumerate(found[:SHOWN]):
        why = "best" if i == 0 and c.fits else why_lost(c, best, capacity)
        print(
            f"{i + 1:>4}  {c.key():56s} {c.iteration_s:8.3f} {c.tflops_per_gpu:8.1f} "
            f"{c.memory_gib:7.1f}  {why}"
        )
    if len(found) > SHOWN:
        print(f"  … {len(found) - SHOWN} more (--json lists all)")
    if not best.fits:
        print(
            f"nothing fits in {capacity:.0f} GiB per GPU: the smallest needs "
            f"{min(c.memory_gib for c in found):.1f} GiB"
        )
    else:
        sp = " --sequence-parallel" if best.sequence_parallel else ""
        print(
            f"\nrun it:\n  dtp plan --auto {args.model} --tp {best.tp}{sp} -o plan.tp\n"
            f"  torchrun --nnodes {max(1, args.gpus // prof.gpus_per_node)} --nproc-per-node "
            f"{min(args.gpus, prof.gpus_per_node)} -m dtp train plan.tp {args.model} --tp {best.tp} "
            f"--dp {best.dp} "
            f"--seq {args.seq}"
        )
        if not best.fsdp:
            print(
                "  (dtp train runs data parallelism as FSDP2; the figures above are the simulator's "
                "for DDP)"
            )
    if json_path:
        keys = ("tp", "dp", "sequence_parallel", "recompute", "iteration_s", "memory_gib", "plan")
        data = {
            "best": {
                **{k: best.to_json()[k] for k in keys},
                "fsdp": best.fsdp,
                "micro_batch": best.micro_batch,
                "tflops_per_gpu": best.tflops_per_gpu,
                "fits": best.fits,
            },
            "candidates": [c.to_json() for c in found],
        }
        write_text(json_path, json.dumps(data, indent=2) + "\n", "--json")
    return 0 if best.fits else 1
