"""`dtp fuzz [PLAN MODEL]`: exit 0 every example held, 1 one failed (saved under --save), 2 a usage
error."""

from __future__ import annotations

import argparse

from dtp.cli.args import positive_int, seed_int, timeout_seconds


def add_parser(sub) -> None:
    """Register `dtp fuzz`."""
    f = sub.add_parser("fuzz", help="property-based fuzzing of sharding correctness")
    f.add_argument("plan", nargs="?", help="a plan to fuzz meshes and shapes for (with MODEL)")
    f.add_argument(
        "model",
        nargs="?",
        help="zoo name, model YAML, package.module:factory, or a save_pretrained directory",
    )
    f.add_argument("--examples", type=positive_int, default=100)
    f.add_argument("--seed", type=seed_int, default=0)
    f.add_argument(
        "--max-world",
        type=positive_int,
        default=4,
        help="largest tp × dp to draw (≤ 4 recommended)",
    )
    f.add_argument("--save", metavar="DIR", help="save a failing (shrunk) case here")
    f.add_argument("--replay", metavar="CASE", help="rerun one saved case")
    f.add_argument(
        "--factory",
        metavar="MODULE:FACTORY",
        help="let --replay run this model factory (a case never runs code on its own)",
    )
    f.add_argument(
        "--mutate",
        action="store_true",
        help="draw Megatron plans with one mistake each (partial "
        "outputs, unpaired colwise, unpacked fused layers, partial sequence parallelism, local "
        "flips)",
    )
    f.add_argument(
        "--parser", action="store_true", help="fuzz the parser with random and mutated plan text"
    )
    f.add_argument("--no-shrink", action="store_true", help="report the first failure as found")
    f.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=120.0,
        help="seconds per example before it counts as hung",
    )
    f.add_argument(
        "--progress", action="store_true", help="show the progress bar even when not on a terminal"
    )
    f.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Fuzz meshes, shapes and seeds (or replay a saved case, or fuzz the parser)."""
    from dtp.fuzz.session import fuzz_command

    return fuzz_command(
        plan=args.plan,
        model=args.model,
        examples=args.examples,
        seed=args.seed,
        max_world=args.max_world,
        save_to=args.save,
        replay=args.replay,
        factory=args.factory,
        mutate=args.mutate,
        parser=args.parser,
        shrink=not args.no_shrink,
        timeout=args.timeout,
        show_progress=args.progress,
    )
