"""Checkpoints that reshard across tp and dp: DCP save and load (`dcp`), the files beside it read as
data only (`files`), the canonical layout, optimizer state, fingerprints, and `dtp export`.

Imports `runtime` and everything below it.
"""

from dtp.checkpoint.dcp import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
