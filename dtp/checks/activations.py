"""What an activation is at one point of the layout flow (dtp/checks/flow.py): its layout, whether
it is a DTensor or a local tensor, and the module that set it."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Shard

_WHAT = {
    "replicate": "the full activation",
    "shard(-1)": "each rank's slice of the features",
    "shard(1)": "each rank's slice of the sequence",
    "partial": "partial sums",
}


def layout_text(p: Placement) -> str:
    """A placement of a (batch, sequence, features) activation as plan text, negative dims
    normalised."""
    if isinstance(p, Partial):
        return "partial"
    if isinstance(p, Shard):
        return {2: "shard(-1)", -1: "shard(-1)", 1: "shard(1)", -2: "shard(1)"}.get(
            p.dim, f"shard({p.dim})"
        )
    return "replicate"


@dataclass(frozen=True)
class Act:
    """What an activation is at one point of the walk."""

    layout: str  # replicate | shard(-1) | shard(1) | partial | shard(D)
    dtensor: bool
    producer: str | None = None  # the module that set the layout (None: the model's own tensor)

    def describe(self) -> str:
        """E.g. `each rank's slice of the features (shard(-1), local)`."""
        return f"{_WHAT.get(self.layout, self.layout)} ({self.layout}, {'DTensor' if self.dtensor else 'local'})"


PLAIN = Act("replicate", False)
