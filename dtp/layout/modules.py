"""Facts about one module, by structure: linear layers (nn.Linear or transformers' transposed
Conv1D), their feature counts, expert modules, and the inputs a forward takes."""

from __future__ import annotations

import inspect

import torch.nn as nn

from dtp.layout.experts import experts_layout


def is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2): a linear layer whose weight is stored transposed, (in, out);
    also once a dtp style made it its layer (ColumnParallelConv1D, a subclass)."""
    named = any(cls.__name__ == "Conv1D" for cls in type(module).__mro__)
    return named and isinstance(getattr(module, "nf", None), int)


def is_linear(module: nn.Module) -> bool:
    """nn.Linear (or a subclass such as Falcon's FalconLinear) or transformers' Conv1D."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or a Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def is_experts(module: nn.Module) -> bool:
    """A module holding every expert's FFN as 3-D parameters dtp can split (dtp/layout/experts.py)."""
    return experts_layout(module) is not None


def forward_params(module: nn.Module) -> list[inspect.Parameter] | None:
    """The parameters of `module.forward`; None when it has no Python signature (a builtin or C
    forward)."""
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def forward_inputs(module: nn.Module) -> tuple[list[str], bool]:
    """The named inputs of `module.forward`, and whether it also takes any keyword (`**kwargs`)."""
    params = forward_params(module)
    if params is None:
        return [], True
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return named, any(p.kind == p.VAR_KEYWORD for p in params)
