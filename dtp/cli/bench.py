"""`dtp bench [...]`: benchmarks next to a Megatron-style baseline. Its flags are the benchmark's
own parser's (dtp/bench/run.py, also `python -m dtp.bench`), so everything after `bench` is handed
on as it is."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """Register `dtp bench`, whose arguments (`--help` too) go to the benchmark's parser."""
    b = sub.add_parser(
        "bench",
        help="benchmarks next to a Megatron-style baseline (`dtp bench --help`)",
        # no option of its own: every word is handed on
        add_help=False,
        prefix_chars="\0",
    )
    b.add_argument("argv", nargs=argparse.REMAINDER)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks."""
    from dtp.bench.run import main

    return main(args.argv)
