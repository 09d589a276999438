"""`python -m dtp` (what torchrun launches on every node)."""
import sys

from dtp.cli import main

sys.exit(main())
