"""The command line: argparse and nothing else.

Input: argv. Output: an exit status (0 ok, 1 a failed run or parity check, 2 a usage or plan error).
Each command is one module (`add_parser`, `run`); `args` holds the argument types. A command module
imports the torch-free library (lang, the checker, errors, files) at its top and whatever needs
torch inside `run`, so `dtp --help`, `dtp fmt` and `dtp check PLAN` never import torch. Nothing in
the library imports this package; it may import every other.
"""

from dtp.cli.program import build_parser, entry, main

__all__ = ["build_parser", "entry", "main"]
