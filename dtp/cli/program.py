"""The `dtp` command line: one parser per command (dtp/cli/<command>.py), one way out for every
error."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import NoReturn

from dtp.cli import (
    apply,
    bench,
    check,
    explain,
    export,
    fmt,
    fuzz,
    generate,
    plan,
    plans,
    search,
    simulate,
    train,
)
from dtp.errors import DtpError, Terminated
from dtp.runtime.torchrun import leave_rank, under_torchrun

# in `dtp --help`'s order
COMMANDS = (
    check,
    fmt,
    explain,
    apply,
    fuzz,
    simulate,
    search,
    train,
    generate,
    export,
    bench,
    plan,
    plans,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command; building it imports no torch (`dtp --help`, `check`,
    `fmt`)."""
    p = argparse.ArgumentParser(
        prog="dtp", description="Declarative tensor parallelism on PyTorch DTensor."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def _terminate(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (2 a usage or plan error, 1 a failed run, 130/143
    interrupted)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # like Ctrl-C: ranks stopped, temp dirs removed, then exit
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except DtpError as err:
        print(err.render(), file=sys.stderr)
        return err.exit_code
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dtp explain ... | head`
        return 0


def entry() -> NoReturn:
    """The `dtp` console script and `python -m dtp`: `main`, then exit (a torchrun rank skips
    finalisation)."""
    # Before torch is imported: its C++ logs (a rendezvous that finds no peer prints stack frames, a
    # process group torn down at Ctrl-C prints warnings) would bury dtp's one-paragraph messages.
    # Errors still show.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    code = main()
    if under_torchrun():
        leave_rank(code)
    sys.exit(code)
