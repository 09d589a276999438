"""`dtp check PLAN [MODEL] [--tp N] [--dp M]`: exit 0 the plan holds, 2 a plan or usage error."""

from __future__ import annotations

import argparse
import sys

from dtp.checks.checker import check, render_warnings
from dtp.cli.args import positive_int
from dtp.lang.parse import load


def add_parser(sub) -> None:
    """Register `dtp check`."""
    c = sub.add_parser("check", help="check a plan, alone or against a model")
    c.add_argument("plan")
    c.add_argument(
        "model",
        nargs="?",
        help="zoo name, model YAML, package.module:factory, or a save_pretrained directory",
    )
    c.add_argument("--tp", type=positive_int, help="tensor-parallel size to check divisibility for")
    c.add_argument(
        "--dp",
        type=positive_int,
        help="data-parallel size the plan's `mesh` header must agree with",
    )
    c.set_defaults(func=run)


def load_checked(plan_path: str, model_spec: str | None, tp: int | None, dp: int | None = None):
    """(plan, model on the meta device or None, Checked); the plan's warnings go to stderr."""
    plan = load(plan_path)
    model = None
    if model_spec:  # torch only when there is a model: `dtp check PLAN` never imports it
        from dtp import models

        model = models.build(models.resolve(model_spec), device="meta")
    checked = check(plan, model, tp, dp)
    sys.stderr.write(render_warnings(checked))
    return plan, model, checked


def run(args: argparse.Namespace) -> int:
    """Check the plan, alone or against the model, and say what it claims."""
    plan, model, checked = load_checked(args.plan, args.model, args.tp, args.dp)
    if model is None:
        print(f"{args.plan}: ok (syntax and styles; give a MODEL to check it against a model)")
        return 0
    res = checked.resolution
    rules = len({r.pos for r in res.claims.values()})
    where = (
        f"tp={args.tp}"
        if args.tp
        else "tp values that work: " + ", ".join(map(str, checked.admissible_tp))
    )
    print(
        f"{args.plan}: ok on {args.model}: {len(res.claims)} modules claimed by {rules} rules, "
        f"{len(res.sets)} attribute rewrites; {where}"
    )
    return 0
