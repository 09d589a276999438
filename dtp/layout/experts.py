"""How a module holds its experts: the layouts of transformers' 3-D expert parameters.

Mixtral and the Qwen MoEs keep gate_up_proj (E, 2·I, H) as [gate; up] and down_proj (E, H, I), no
biases; GPT-OSS keeps them transposed, gate_up_proj (E, H, 2·I) with gate and up interleaved column
by column, and adds gate_up_proj_bias (E, 2·I) and down_proj_bias (E, H). transformers 5 says which
on the module (`is_transposed`, `is_concatenated`, set by `use_experts_implementation`); without
those flags the orientation follows from the shapes, which tell the two apart whatever H and I are.

Splitting each expert's FFN dimension I over tp: [gate; up] halves are sharded as two packed parts;
interleaved columns are cut in contiguous chunks of 2·I/tp, which keep gate/up pairs whole when tp
divides I. down_proj_bias is added after the sum over the FFN dimension, so it stays replicated and
is added by one rank only (dtp/compiler/placed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertsLayout:
    """The layout of one experts module's parameters."""

    experts: int
    hidden: int  # H
    inter: int  # I: each expert's FFN dimension, the one tp splits
    transposed: bool  # gate_up_proj (E, H, 2·I), down_proj (E, I, H); else (E, 2·I, H), (E, H, I)
    concatenated: bool  # 2·I is [gate; up]; else gate and up interleaved column by column

    def describe(self) -> str:
        """The layout in words, for messages."""
        order = "[gate; up]" if self.concatenated else "gate/up interleaved"
        shapes = (
            "gate_up_proj (E, H, 2·I), down_proj (E, I, H)"
            if self.transposed
            else "gate_up_proj (E, 2·I, H), down_proj (E, H, I)"
        )
        return f"{shapes}, {order}"


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of `module`'s expert parameters, or None if it holds none dtp can split."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == down.dim() == 3
    ):
        return None
    own = {n: p for n, p in module.named_parameters(recurse=False)}
    if set(own) - set(PARAMS):
        return None  # a parameter of unknown role (a per-expert scale, an up_proj without gate…)
    e, a, b = gate_up.shape
    plain = a == 2 * down.shape[2] and b == down.shape[1]
    transposed_shapes = b == 2 * down.shape[1] and a == down.shape[2]
    flag = getattr(module, "is_transposed", None)
    transposed = flag if isinstance(flag, bool) else transposed_shapes and not plain
    if down.shape[0] != e or not (transposed_shapes if transposed else plain):
        return None
    hidden, inter = (a, b // 2) if transposed else (b, a // 2)
    expected = {"gate_up_proj_bias": (e, 2 * inter), "down_proj_bias": (e, hidden)}
    if any(n in own and tuple(own[n].shape) != shape for n, shape in expected.items()):
        return None
    concatenated = getattr(module, "is_concatenated", True)
    return ExpertsLayout(e, hidden, inter, transposed, concatenated is not False)
