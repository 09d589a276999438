"""`dtp plan --from-hf MODEL [-o FILE]` / `dtp plan --to-hf PLAN [MODEL]`: exit 0 written, 2 a usage error."""
from __future__ import annotations

import argparse
import json
import sys

from dtp.cli.args import positive_int
from dtp.files import writable_file, write_text


def add_parser(sub) -> None:
    """Register `dtp plan`."""
    p = sub.add_parser("plan", help="import a Hugging Face tp_plan as a .tp plan, or export one")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-hf", metavar="MODEL", help="write the plan for a Hugging Face model")
    mode.add_argument("--to-hf", metavar="PLAN", help="print the plan as a Hugging Face tp_plan (JSON)")
    p.add_argument("model", nargs="?", help="with --to-hf: the model, to tell embeddings from output heads")
    p.add_argument("--tp", type=positive_int, default=2, metavar="N",
                   help="with --to-hf MODEL: the tp the export is checked at (picks `when` branches; default 2)")
    p.add_argument("--lossy", action="store_true",
                   help="with --to-hf MODEL: print what can be expressed even when HF would run it differently")
    p.add_argument("-o", "--output", metavar="FILE", help="with --from-hf: write the plan here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print or write the plan for a Hugging Face model, or print a plan as an HF tp_plan (JSON)."""
    from dtp import models
    from dtp.hf.plan import export_for, export_plan, from_hf
    from dtp.lang import conditions
    from dtp.lang.parse import load

    if args.from_hf:
        output = writable_file(args.output, "-o") if args.output else None  # before the model is built
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
        warnings.append("not checked against a model: give MODEL (and --tp) to check that Hugging Face would "
                        "compute what this plan does")
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
