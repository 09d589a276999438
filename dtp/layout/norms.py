"""Facts about norms: which modules are norms, how many features they normalise, and the RMS-norm
maths that `sharded_norm` runs and its check probes a module's forward against."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


def norm_width(module: nn.Module) -> int:
    """The features a norm with a 1-D weight normalises (0 for anything else)."""
    weight = getattr(module, "weight", None)
    return weight.shape[0] if weight is not None and weight.dim() == 1 else 0


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm, or a model's own `*LayerNorm`/`*RMSNorm` class (Hugging Face's
    LlamaRMSNorm)."""
    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("RMSNorm", "LayerNorm"))


def epsilon(module: nn.Module) -> float | None:
    """The norm's epsilon (`variance_epsilon` in Hugging Face, `eps` in torch; None: torch's
    default)."""
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None,
    features: int,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """w · x / sqrt(reduce(Σ x²) / features + eps), the statistics in at least float32."""
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))
    squares = reduce(xf.pow(2).sum(-1, keepdim=True))  # (batch, seq, 1)
    eps = torch.finfo(dtype).eps if eps is None else eps
    normed = xf * torch.rsqrt(squares / features + eps)
    return (weight.to(xf.dtype) * normed).to(dtype)
