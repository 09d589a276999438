"""`dtp plans`: the plans dtp ships, by the name any PLAN argument takes (`dtp apply gpt2
gpt2-tiny`); exit 0."""

from __future__ import annotations

import argparse

from dtp.lang.parse import load, shipped_plans


def add_parser(sub) -> None:
    """Register `dtp plans`."""
    p = sub.add_parser(
        "plans",
        help="list the shipped plans (a PLAN argument may name one: `dtp apply gpt2 gpt2-tiny`)",
    )
    p.set_defaults(func=run)


def _summary(text: str) -> str:
    """The plan's first comment line (what it is for), without the `#`."""
    line = next(
        (line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), ""
    )
    return line if len(line) <= 80 else line[:79].rstrip() + "…"


def run(args: argparse.Namespace) -> int:
    """Print every shipped plan's name, its `plan NAME version V` and what it is for."""
    rows = []
    for name, path in shipped_plans().items():
        plan = load(path)
        label = f"{plan.name} v{plan.plan_version}" if plan.name else ""
        rows.append((name, label, _summary(plan.source)))
    width = max(len(r[0]) for r in rows)
    label_width = max(len(r[1]) for r in rows)
    for name, label, summary in rows:
        print(f"{name:<{width}}  {label:<{label_width}}  {summary}".rstrip())
    return 0
