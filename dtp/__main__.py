"""`python -m dtp` (what torchrun launches on every node)."""

from dtp.cli import entry

entry()
