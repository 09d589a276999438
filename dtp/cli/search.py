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
    s.add_argument(
        "--precision",
        choices=("fp16", "bf16", "fp32"),
        help="default: the profile's best half precision (bf16, else fp16, else fp32)",
    )
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
    """Price every layout and print the ranked table and the commands that run the winner."""
    from dtp import models
    from dtp.auto.search import Job, commands, default_precision, launch, search, why_lost
    from dtp.simulate import profile

    modes = tuple(m.strip() for m in args.dp_modes.split(",") if m.strip())
    if not modes or set(modes) - {"ddp", "fsdp"}:
        raise UsageError(f"--dp-modes takes ddp, fsdp or ddp,fsdp, not {args.dp_modes!r}")
    json_path = writable_file(args.json, "--json") if args.json else None
    prof = profile.load(args.profile)
    precision, why = _precision(args.precision, prof, default_precision(prof))
    nodes, _ = launch(args.gpus, prof.gpus_per_node)  # uneven over nodes: refused before the search
    job = Job(args.model, args.gpus, args.seq, args.global_batch, precision, args.profile)
    model = models.build(models.resolve(args.model), device="meta")
    micro = [args.micro_batch] if args.micro_batch else [1, 2, 4, 8, 16]
    found = search(
        model,
        job,
        prof,
        micro_batches=micro,
        dp_modes=modes,
        log=lambda m: print(m, file=sys.stderr),
    )
    if not found:
        raise UsageError(
            f"no layout of {args.gpus} GPUs divides --global-batch {args.global_batch} into "
            f"micro-batches of {', '.join(map(str, micro))}"
        )
    best, capacity = found[0], prof.memory_GiB
    print(
        f"dtp search: {args.model} on {args.gpus} × {prof.name} ({capacity:.0f} GiB), seq "
        f"{args.seq}, global batch {args.global_batch}, {precision}{why}; {len(found)} layouts "
        f"priced by dtp simulate, {sum(c.fits for c in found)} fit"
    )
    shown = found[:SHOWN]
    whys = ["best" if c is best and c.fits else why_lost(c, best, capacity) for c in shown]
    _print_table(shown, whys, len(found))
    if not best.fits:
        print(
            f"nothing fits in {capacity:.0f} GiB per GPU: the smallest needs "
            f"{min(c.memory_gib for c in found):.1f} GiB"
        )
    lines = commands(best, job, prof.gpus_per_node) if best.fits else []
    if lines:
        _print_commands(lines, nodes, job.gpus)
    if json_path:
        write_text(json_path, json.dumps(_json(found, job, lines), indent=2) + "\n", "--json")
    return 0 if best.fits else 1


def _precision(asked: str | None, prof, default: str) -> tuple[str, str]:
    """(the precision priced, why when it was not asked for): --precision, else `default`, the
    profile's best half precision; one the profile has no rate for is a usage error before any
    pricing."""
    if asked is None:
        if default == "fp32":
            return default, " (the profile has no half precision; --precision overrides)"
        return default, " (the profile's best half precision; --precision overrides)"
    if asked not in prof.peak_tflops:
        raise UsageError(
            f"--precision {asked}: profile {prof.name} has no peak_tflops for it (it has: "
            f"{', '.join(prof.peak_tflops)})"
        )
    return asked, ""


def _print_table(shown: list, whys: list[str], total: int) -> None:
    """The first layouts, each with why it is not first."""
    print(f"{'rank':>4}  {'layout':56s} {'iter s':>8} {'TFLOP/s':>8} {'GiB':>7}  why not first")
    for i, (c, why) in enumerate(zip(shown, whys)):
        print(
            f"{i + 1:>4}  {c.key():56s} {c.iteration_s:8.3f} {c.tflops_per_gpu:8.1f} "
            f"{c.memory_gib:7.1f}  {why}"
        )
    if total > len(shown):
        print(f"  … {total - len(shown)} more (--json lists all)")


def _print_commands(lines: list[str], nodes: int, gpus: int) -> None:
    """The commands that run the winner, and the one thing they cannot say: where a multi-node
    job meets."""
    print("\nrun it:")
    for line in lines:
        print(f"  {line}")
    if nodes > 1:
        print(
            f"  (on each of the {nodes} nodes, with the rendezvous flags torchrun needs, e.g. "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT)"
        )
    else:
        print(f"  (one node: dtp train starts its {gpus} ranks itself)")


def _json(found: list, job, lines: list[str]) -> dict:
    """The winner as it would run (layout, job, commands) and every candidate."""
    best = found[0]
    keys = ("tp", "dp", "sequence_parallel", "recompute", "iteration_s", "memory_gib", "plan")
    return {
        "best": {
            **{k: best.to_json()[k] for k in keys},
            "dp_mode": best.dp_mode,
            "fsdp": best.fsdp,
            "micro_batch": best.micro_batch,
            "global_batch": job.global_batch,
            "seq": job.seq,
            "precision": job.precision,
            "tflops_per_gpu": best.tflops_per_gpu,
            "fits": best.fits,
            "commands": lines,
        },
        "candidates": [c.to_json() for c in found],
    }
