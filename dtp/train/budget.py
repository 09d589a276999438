"""`--max-rank-memory`: refuse, before any rank starts, a tp whose per-rank training state exceeds the budget.

A rank of `dtp train` holds its parameter shards in float32 (master weights, whatever --dtype), a gradient
of the same shape and AdamW's two moments: 4 × its row of the placement table (dtp.param_bytes). The model
is built on meta and only those shards are ever materialised (dtp.build), so at tp 1 the whole model
counts against one rank and at tp 2 about half of it: the budget decides which tp can train. Activations
are not counted (they scale with --batch × --seq, not with the model).
"""
from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from dtp.errors import UsageError

if TYPE_CHECKING:  # the parser imports this module for memory_size: torch stays lazy
    import torch.nn as nn

    from dtp.check import Checked

STATE_COPIES = 4  # parameter, gradient, AdamW exp_avg and exp_avg_sq, all float32
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30}


def memory_size(text: str) -> int:
    """'3000000', '1.5MiB', '2GB' → bytes (an argparse type)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size like 3000000, 512KiB or 1.5GiB, got '{text}'")
    return int(float(m.group(1)) * unit)


def state_bytes_per_rank(checked: Checked, model: nn.Module, tp: int, dp: int = 1) -> list[int]:
    """Each rank's parameters, gradients and AdamW moments (float32), from the placement table."""
    from dtp.param_bytes import param_bytes_per_rank

    return [STATE_COPIES * b for b in param_bytes_per_rank(checked, model, tp, dp, elem=4)]


def check_budget(checked: Checked, model: nn.Module, tp: int, dp: int, budget: int) -> None:
    """Exit 2 (UsageError) when a rank's training state at `tp` × `dp` would exceed `budget` bytes."""
    from dtp.explain import human_bytes

    need = max(state_bytes_per_rank(checked, model, tp, dp))
    if need > budget:
        raise UsageError(f"at --tp {tp} --dp {dp} a rank would hold {human_bytes(need)} ({need} B) of parameters, "
                         f"gradients and AdamW state, over --max-rank-memory {human_bytes(budget)} ({budget} B); "
                         "shard the model over more ranks (a larger --tp)")
