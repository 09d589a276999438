"""`dtp plan --from-hf MODEL [-o FILE]` / `dtp plan --to-hf PLAN [MODEL]`: exit 0 written, 2 a usage error."""
from __future__ import annotations

import argparse

from dtp.cli.args import positive_int


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
    """Write a plan for a Hugging Face model, or a plan as an HF tp_plan."""
    from dtp.hf.plan import plan_command

    return plan_command(args)
