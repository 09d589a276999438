"""`dtp fmt PLAN... [--write | --check]`: exit 0 formatted (or printed), 1 with --check a file is
not, 2 a plan error."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtp.lang.format import format_plan
from dtp.lang.parse import load


def add_parser(sub) -> None:
    """Register `dtp fmt`."""
    f = sub.add_parser("fmt", help="format plans canonically")
    f.add_argument("files", nargs="+", metavar="PLAN")
    mode = f.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite files in place")
    mode.add_argument("--check", action="store_true", help="exit 1 when a file is not formatted")
    f.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print, rewrite or check each plan in its canonical form."""
    status = 0
    for name in args.files:
        plan = load(name)
        text = format_plan(plan, plan.source)
        if args.check:
            if text != plan.source:
                print(f"{name}: not formatted (run `dtp fmt --write {name}`)", file=sys.stderr)
                status = 1
        elif args.write:
            if text != plan.source:
                Path(name).write_text(text, encoding="utf-8")
                print(f"formatted {name}")
        else:
            sys.stdout.write(text)
    return status
