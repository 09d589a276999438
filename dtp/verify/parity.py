"""Comparing a sharded run with unsharded references: the rule, and the per-quantity verdict.

Rank 0 runs the same steps twice more, unsharded: in float64 (the *truth*) and in the run's own
dtype (the *unsharded run*; for a float64 run the truth is that run). Both start from the sharded
run's exact initial weights. For every tensor compared (logits, loss, each gradient, each parameter
after a step):

    err_sharded  = max|sharded − truth|        err_unsharded = max|unsharded − truth|
    OK  ⇔  err_sharded ≤ C · err_unsharded + F · eps · max|truth|,   C = 6, F = 2

with eps the unit step of the dtype the tensor is held in (2^-7 for bfloat16, 2^-23 for float32;
float32 for the master weights of a bfloat16 run). Correct sharding only reorders floating-point
sums, so its error is of the size the dtype incurs anyway, which the unsharded run in the same dtype
measures; C allows for the reordering and for partial sums rounded before they are reduced (measured
on the shipped plans at tp 2 and 4, bfloat16 and float32, 2,964 tensors: err_sharded / err_unsharded
≤ 3.2, the largest err / bound 0.43), and the floor covers tensors the unsharded run happens to get
exact (a loss). A wrong plan is off by O(1) of the tensor and fails in every dtype: bfloat16 no
longer hides a missing reduction behind a fixed absolute tolerance. A float64 run has no coarser run
to measure its rounding against; its bound stays fixed: 1e-10 · max|truth| + 1e-12.

A gradient that is mathematically zero (a query's at sequence length 1, where softmax has one key)
has a bound of 0 by this rule while the sharded run's reordered sums leave rounding of the size of
the step's other gradients. So a gradient's bound is never below `Z · eps · G`, G the largest
|truth| of any gradient in the same step, Z = C · F: small enough that an error of O(1) of any
gradient that matters still fails (float32: 1.4e-6 · G). Floating buffers get the same floor with G
the largest |truth| of any buffer compared at that moment.

The report states each quantity's *resolution*: the largest bound / max|truth| over its tensors (for
gradients and buffers, / max(max|truth|, G)), the relative error that could pass unseen on the least
favourable tensor. For a bfloat16 run it is coarse (bfloat16's own rounding), which is why `dtp
apply --dtype bfloat16` decides correctness on a float32 run of the same plan and reports the
bfloat16 run's agreement beside it (dtp.verify.rank).

Any NaN or infinity, on any side, fails: a sharded run that diverges proves nothing, and neither
does a reference that does. The report names the first tensor, in step order, that went non-finite
and where.

Low-precision runs train as Megatron's mixed precision does: bfloat16 parameters, activations and
gradients, and an optimizer on float32 master copies (`dtp.verify.reference.MixedSGD`), so that
small updates accumulate and "parameters after step k" compare weights that moved. The optimizer is
SGD so that an update's error stays proportional to its gradient's (Adam's normalised update turns
the rounding noise of a gradient that is mathematically zero, such as a key bias's, into a full-size
step).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from dtp.runtime.rng import dropout_rates, positive

C = 6.0  # allowed error relative to the unsharded run's own, in the same dtype
F = 2.0  # the floor, in units of eps · max|truth|
Z = C * F  # a gradient's floor, in units of eps · the step's largest gradient
QUANTITIES = ("logits", "loss", "grads", "params", "buffers", "probes", "replicas")
# (relative, absolute) for float64 runs, whose truth is their unsharded run
FLOAT64_BOUND = (1e-10, 1e-12)


def eps(dtype: torch.dtype) -> float:
    """The dtype's unit step at 1.0 (2^-7 for bfloat16, 2^-23 for float32)."""
    return torch.finfo(dtype).eps


@dataclass
class Quantity:
    """The worst error seen for one quantity (logits, loss, grads or params) over all steps."""

    max_abs: float = 0.0
    max_rel: float = 0.0  # err_sharded / max|truth| of the tensor it was seen on
    worst: str = ""
    margin: float = 0.0  # the largest err_sharded / bound seen (OK when ≤ 1)
    ok: bool = True
    compared: int = 0
    # the largest bound / max|truth| (gradients: / G): smaller errors could pass unseen
    resolution: float = 0.0
    # shape mismatches, non-finite values and the like
    problems: list[str] = field(default_factory=list)


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.numel() else True


class ParityCheck:
    """Accumulates comparisons in step order; `ok` when every tensor met the rule and all were
    finite."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.quantities: dict[str, Quantity] = {k: Quantity() for k in QUANTITIES}
        # the first tensor that went NaN/inf: {tensor, quantity, side}
        self.nonfinite: dict | None = None
        self.dropout: list[str] = []  # where the model has dropout on (said when parity fails)
        self.shapes: list[str] = []  # what was compared, in words: modes and shapes

    def problem(
        self, quantity: str, name: str, text: str, rel: float = math.inf, max_abs: float = math.inf
    ) -> None:
        """Record a failure of tensor `name` that is not a comparison with the references (`text`
        says what)."""
        q = self.quantities[quantity]
        q.compared += 1
        q.ok = False
        q.problems.append(text)
        if q.margin != math.inf or not q.worst:
            q.worst, q.max_rel, q.margin = name, rel, math.inf
            q.max_abs = max(q.max_abs, max_abs)

    def compare(
        self,
        quantity: str,
        name: str,
        got: torch.Tensor | None,
        truth: torch.Tensor | None,
        unsharded: torch.Tensor | None = None,
        held_in: torch.dtype | None = None,
        floor_scale: float = 0.0,
    ) -> None:
        """Record how far `got` (sharded, gathered) is from `truth`, against `unsharded`'s own
        error.

        `unsharded` None means the truth is the unsharded run (float64); `held_in` is the dtype the
        tensor is kept in (default: the run's dtype); `floor_scale` the G of a gradient's floor (Z ·
        eps · G)."""
        q = self.quantities[quantity]
        q.compared += 1
        if got is None or truth is None:
            if (got is None) != (truth is None):
                q.ok = False
                q.problems.append(
                    f"{name}: {'no gradient' if got is None else 'unexpected gradient'} in the "
                    "sharded run"
                )
            return
        if got.shape != truth.shape:
            q.ok = False
            q.problems.append(
                f"{name}: shape {tuple(got.shape)} but the reference has {tuple(truth.shape)}"
            )
            if not q.worst:
                q.worst, q.max_rel, q.max_abs, q.margin = name, math.inf, math.inf, math.inf
            return
        got, truth = got.detach().double().cpu(), truth.detach().double().cpu()
        unsharded = unsharded.detach().double().cpu() if unsharded is not None else truth
        sides = (("sharded run", got), ("reference", truth)) + (
            (("unsharded reference", unsharded),) if unsharded is not truth else ()
        )
        bad = [side for side, t in sides if not _finite(t)]
        if bad:
            q.ok = False
            q.problems.append(
                f"{name}: non-finite values (NaN or inf) in the {' and the '.join(bad)}"
            )
            if self.nonfinite is None:
                self.nonfinite = {
                    "tensor": name,
                    "quantity": quantity,
                    "side": " and the ".join(bad),
                }
            q.worst, q.max_rel, q.max_abs, q.margin = name, math.inf, math.inf, math.inf
            return
        if not got.numel():
            return
        err = (got - truth).abs().max().item()
        scale = truth.abs().max().item()
        bound = rule_bound(
            truth, None if unsharded is truth else unsharded, held_in or self.dtype, floor_scale
        )
        if max(scale, floor_scale) > 0:
            q.resolution = max(q.resolution, bound / max(scale, floor_scale))
        margin = err / bound if bound > 0 else (0.0 if err == 0 else math.inf)
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        if margin > 1:
            q.ok = False
        if margin > q.margin or not q.worst:
            q.margin, q.max_rel, q.worst = margin, rel, name
        q.max_abs = max(q.max_abs, err)

    @property
    def ok(self) -> bool:
        """Whether everything matched."""
        return all(q.ok for q in self.quantities.values())

    def to_json(self) -> dict:
        """The `parity` section of the report."""
        rule = (
            {"C": C, "F": F, "eps": eps(self.dtype)}
            if self.dtype != torch.float64
            else {"rtol": FLOAT64_BOUND[0], "atol": FLOAT64_BOUND[1]}
        )
        out: dict = {
            "ok": self.ok,
            "rule": {**rule, "Z": Z},
            "nonfinite": self.nonfinite,
            "dropout": self.dropout,
            "shapes": self.shapes,
        }
        for name, q in self.quantities.items():
            out[name] = asdict(q)
        failing = [(n, q) for n, q in self.quantities.items() if not q.ok]
        worst = max(failing or self.quantities.items(), key=lambda kv: kv[1].margin)
        out["worst_tensor"] = worst[1].worst
        out["worst_quantity"] = worst[0]
        return out


def rule_bound(
    truth: torch.Tensor,
    unsharded: torch.Tensor | None,
    dtype: torch.dtype,
    floor_scale: float = 0.0,
) -> float:
    """The rule's bound on |sharded − truth| for one tensor held in `dtype`; `unsharded` None: the
    truth is the unsharded run (float64), whose bound is fixed."""
    scale = truth.abs().max().item()
    if unsharded is None:
        return FLOAT64_BOUND[0] * max(scale, Z * floor_scale) + FLOAT64_BOUND[1]
    unit = eps(dtype)
    err = (unsharded.double() - truth.double()).abs().max().item()
    return max(C * err + F * unit * scale, Z * unit * floor_scale)


def dropout_sources(model: nn.Module) -> list[str]:
    """Where `model` applies dropout now: Dropout modules with p > 0, and modules' dropout
    attributes > 0 (Hugging Face attention passes `self.attention_dropout` to its kernel). Config
    fields are not named: a config may carry dropout fields no module of this model reads
    (`classifier_dropout` on a causal LM)."""
    return [
        where + how.format(value)
        for where, how, module, key in dropout_rates(model)
        if positive(value := getattr(module, key, 0))
    ]


# the autocast step's gradient floor, as a share of the parity rule's (Z · eps · G): bfloat16's eps
# makes the full floor 9 % of the largest gradient, above a wrong path's whole error on a smaller
# one; 1/16 of it kept correct plans at ≤ 0.21 of their bounds and a wrong path at 5.3
FLOOR_SHARE = 1 / 16


def compare_grads(
    parity: ParityCheck,
    quantity: str,
    grads: dict,
    refs: list,
    label: str = "",
    held_in: torch.dtype | None = None,
    floor_share: float = 1.0,
) -> None:
    """Every gathered gradient against the references' (rank 0), its floor's G the truth's largest
    gradient of the step (times `floor_share`)."""
    truth, unsharded = refs[0], (refs[1] if len(refs) > 1 else None)
    largest = max(
        (
            truth.grad(n).detach().abs().max().item()
            for n in grads
            if truth.grad(n) is not None and truth.grad(n).numel()
        ),
        default=0.0,
    )
    for n, g in grads.items():
        parity.compare(
            quantity,
            f"{n}.grad{label}",
            g,
            truth.grad(n),
            unsharded.grad(n) if unsharded else None,
            held_in=held_in,
            floor_scale=largest * floor_share,
        )
