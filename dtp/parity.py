"""Comparing a sharded run with its unsharded reference: tolerances and the per-quantity verdict.

A tensor matches when max|sharded − reference| ≤ atol + rtol · max|reference|. The scale is the tensor's
own largest magnitude, not each element's: sharding changes only the order of floating-point sums, so
its error is relative to the size of what was summed, while a wrong plan is off by O(1) of that size.
The optimizer is SGD so that an update's error stays proportional to its gradient's (Adam's normalised
update turns the rounding noise of a gradient that is mathematically zero, such as a key bias's, into a
full-size step).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# dtype → (rtol, atol); documented in the README.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-4, 1e-6),
    torch.bfloat16: (5e-2, 1e-2),
}


@dataclass
class Quantity:
    """The worst error seen for one quantity (logits, loss, grads or params) over all steps."""

    max_abs: float = 0.0
    max_rel: float = 0.0  # max_abs / max|reference| of the tensor it was seen on
    worst: str = ""
    ok: bool = True
    compared: int = 0
    problems: list[str] = field(default_factory=list)  # shape mismatches and the like


class ParityCheck:
    """Accumulates comparisons; `ok` when every tensor matched within the dtype's tolerance."""

    def __init__(self, dtype: torch.dtype):
        self.rtol, self.atol = TOLERANCES[dtype]
        self.quantities: dict[str, Quantity] = {k: Quantity() for k in ("logits", "loss", "grads", "params")}

    def compare(self, quantity: str, name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        """Record how far `got` (sharded, gathered) is from `want` (reference)."""
        q = self.quantities[quantity]
        q.compared += 1
        if got is None or want is None:
            if (got is None) != (want is None):
                q.ok = False
                q.problems.append(f"{name}: {'no gradient' if got is None else 'unexpected gradient'} in the sharded run")
            return
        if got.shape != want.shape:
            q.ok = False
            q.problems.append(f"{name}: shape {tuple(got.shape)} but the reference has {tuple(want.shape)}")
            if not q.worst:
                q.worst, q.max_rel, q.max_abs = name, float("inf"), float("inf")
            return
        got, want = got.detach().double().cpu(), want.detach().double().cpu()
        err = (got - want).abs().max().item() if want.numel() else 0.0
        scale = want.abs().max().item() if want.numel() else 0.0
        if err != err:  # NaN
            err = float("inf")
        rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
        if err > self.atol + self.rtol * scale:
            q.ok = False
        if rel > q.max_rel or (rel == q.max_rel and err > q.max_abs) or not q.worst:
            q.max_rel, q.worst = rel, name
        q.max_abs = max(q.max_abs, err)

    @property
    def ok(self) -> bool:
        """Whether everything matched."""
        return all(q.ok for q in self.quantities.values())

    def to_json(self) -> dict:
        """The `parity` section of the report."""
        out: dict = {"ok": self.ok, "rtol": self.rtol, "atol": self.atol}
        for name, q in self.quantities.items():
            out[name] = asdict(q)
        failing = [(n, q) for n, q in self.quantities.items() if not q.ok]
        worst = max(failing or self.quantities.items(), key=lambda kv: kv[1].max_rel)
        out["worst_tensor"] = worst[1].worst
        out["worst_quantity"] = worst[0]
        return out
