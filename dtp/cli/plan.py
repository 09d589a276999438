"""`dtp plan --auto MODEL` / `dtp plan --from-hf MODEL` / `dtp plan --to-hf PLAN [MODEL]`: exit 0
written (and, with --verify, parity held), 1 parity failed, 2 a usage error."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from dtp.cli.args import positive_int
from dtp.errors import UsageError
from dtp.files import writable_file, write_text
from dtp.lang import conditions
from dtp.lang.parse import load

MAX_AUTO_TP = 4096  # a typo must not plan for a million ranks


def add_parser(sub) -> None:
    """Register `dtp plan`."""
    p = sub.add_parser(
        "plan",
        help="write a plan from a model's structure (--auto), import a Hugging Face tp_plan, "
        "or export one",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--auto",
        metavar="MODEL",
        help="write a Megatron plan from MODEL's structure, checked by dtp check",
    )
    mode.add_argument("--from-hf", metavar="MODEL", help="write the plan for a Hugging Face model")
    mode.add_argument(
        "--to-hf", metavar="PLAN", help="print the plan as a Hugging Face tp_plan (JSON)"
    )
    p.add_argument(
        "model", nargs="?", help="with --to-hf: the model, to tell embeddings from output heads"
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=2,
        metavar="N",
        help="with --auto: the tp the plan is written for; with --to-hf MODEL: the tp the export is checked "
        "at (picks `when` branches); default 2",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --auto: also run the residual stream's norms sequence-parallel",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="with --auto: then run `dtp apply` with the plan at --tp and prove parity (exit 1 if it fails)",
    )
    p.add_argument(
        "--lossy",
        action="store_true",
        help="with --to-hf MODEL: print what can be expressed even when HF would run it differently",
    )
    p.add_argument(
        "-o", "--output", metavar="FILE", help="with --auto or --from-hf: write the plan here"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print or write the plan for a Hugging Face model, or print a plan as an HF tp_plan (JSON)."""
    from dtp import models
    from dtp.hf.plan import export_for, export_plan, from_hf

    if args.sequence_parallel and not args.auto or args.verify and not args.auto:
        raise UsageError("--sequence-parallel and --verify go with --auto MODEL")
    if args.auto:
        return _auto(args)
    if args.from_hf:
        # before the model is built
        output = writable_file(args.output, "-o") if args.output else None
        text, warnings = from_hf(args.from_hf)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        if output:
            write_text(output, text, "-o")
            print(f"wrote {args.output}")
        else:
            sys.stdout.write(text)
        return 0

    plan = load(args.to_hf)
    if args.model is None:
        out, warnings = export_plan(plan)
        warnings.append(
            "not checked against a model: give MODEL (and --tp) to check that Hugging Face would "
            "compute what this plan does"
        )
    else:
        model = models.build(models.resolve(args.model), device="meta")
        if args.lossy:
            out, warnings = export_plan(plan, model, conditions.chooser(model, [], args.tp))
        else:
            out, warnings = export_for(plan, model, args.tp)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(json.dumps(out, indent=2))
    return 0


def _auto(args: argparse.Namespace) -> int:
    """Write the plan `--auto` finds; with --verify, prove it with `dtp apply`."""
    from dtp import models
    from dtp.auto.planner import auto_plan

    if args.tp > MAX_AUTO_TP:
        raise UsageError(f"--tp {args.tp} is more than {MAX_AUTO_TP}")
    output = writable_file(args.output, "-o") if args.output else None  # before the model is built
    model = models.build(models.resolve(args.auto), device="meta")
    found = auto_plan(model, args.auto, args.tp, args.sequence_parallel)
    for why in found.refused:
        print(f"note: {why}", file=sys.stderr)
    print(f"dtp plan --auto: {found.summary}", file=sys.stderr)
    if args.tp not in found.checked_tp:
        print(
            f"note: dtp check accepts this plan at tp {', '.join(map(str, found.checked_tp))} only, "
            "not at "
            f"tp {args.tp}: the parts it refused stay replicated",
            file=sys.stderr,
        )
    if output:
        write_text(output, found.text, "-o")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(found.text)
    if not args.verify:
        return 0
    from dtp.verify.apply import apply_command
    from dtp.verify.report import render

    with tempfile.TemporaryDirectory(prefix="dtp-auto-") as scratch:
        path = output or f"{scratch}/auto.tp"
        if not output:
            write_text(path, found.text)
        report = apply_command(
            plan=path,
            model=args.auto,
            tp=args.tp,
            dp=1,
            batch=2,
            seq=16,
            steps=3,
            seed=0,
            lr=0.1,
            dtype="float32",
            device="auto",
            timeout=300.0,
        )
    if report is None:
        return 0
    print(render(report), file=sys.stderr)
    return 0 if report.ok else 1
