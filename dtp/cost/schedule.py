"""The analytic communication schedule of a plan: every collective of one training step, from the
layouts `compile.lower` chose and the model's shapes, with no process group.

A layout change costs (N tokens × width × element size is the buffer S):

| where                                   | forward            | backward           |
|-----------------------------------------|--------------------|--------------------|
| replicated input → colwise region       | -                  | all-reduce S (f)   |
| sequence-sharded input → colwise region | all-gather S       | reduce-scatter S   |
| rowwise / embedding → replicated        | all-reduce S (g)   | -                  |
| rowwise / embedding → sequence-sharded  | reduce-scatter S   | all-gather S       |
| colwise output gathered (output=replicate) | all-gather S    | -                  |
| rowwise input split (input=replicate)   | -                  | all-gather S       |
| sequence_parallel norm parameter        | -                  | all-reduce of its gradient |
| vocab-parallel cross-entropy            | 3 all-reduces of N values (max, sum of exponentials, target logit) | - |
| replicated packed part (`replicate(kv)`) | -                 | all-reduce of those rows' gradient, per parameter |
| `replicate(reduce_grad=true)`           | -                  | all-reduce of each parameter's gradient |
| `sharded_norm` (RMS norm over sharded features) | all-reduce of N sums of squares | all-reduce of their gradient |
| `experts` (expert FFN dimension split)  | all-reduce S (g)   | all-reduce S (f), and of the N × top-k routing weights |
| `slice_input`, `slice_params` (per head) | -                 | -                  |

Sibling colwise layers that share their parent's input pay the input cost once (Megatron's f).
Each style's own rows are its StyleSpec's `collectives` (dtp/layout/styles); the loss, the split into
sequence shards, replicated packed parts and FSDP2 are the model's and are priced here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

from dtp.checks.checker import Checked
from dtp.cost.fsdp import unit_bytes, units
from dtp.layout.lower import Lowered, lower
from dtp.layout.styles import SPECS, Style
from dtp.layout.styles.spec import SEQUENCE, NotModeled, Region, enter_cost


@dataclass(frozen=True)
class Collective:
    """One collective of a training step."""

    op: str  # all_reduce | all_gather | reduce_scatter
    phase: str  # forward | backward
    buffer_bytes: int  # the full buffer (see dtp.runtime.comm)
    module: str
    reason: str
    group: str = "tp"  # the mesh dimension it runs over


def sent_bytes(op: str, buffer_bytes: int, n: int) -> int:
    """Bytes each rank sends for one collective under ring algorithms over n ranks."""
    if n <= 1:
        return 0
    factor = 2 if op == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather
    return factor * buffer_bytes * (n - 1) // n


def schedule(
    checked: Checked,
    tp: int,
    batch: int,
    seq: int,
    *,
    dtype: torch.dtype = torch.float32,
    lowered: Lowered | None = None,
    dp: int = 1,
    model: nn.Module | None = None,
    checkpoint_activations: bool = False,
    plain: bool | None = None,
    dp_mode: str = "fsdp",
    micro_batches: int = 1,
    param_dtype: torch.dtype | None = None,
) -> list[Collective]:
    """Every collective of one forward + backward pass of the plan at `tp` on `batch` × `seq` tokens
    per data-parallel rank, run as `micro_batches` micro-batches of batch / micro_batches sequences
    (gradient accumulation: the tensor-parallel collectives of each); with dp > 1 (give `model`)
    also the data-parallel ones: FSDP2's parameter all-gathers in each micro-batch's forward and
    backward and its gradient reduce-scatters once, or DDP's gradient all-reduces once, one per
    unit, of `param_dtype` (default `dtype`); with `checkpoint_activations`, each block's forward
    collectives again in backward. `plain` (default: tp 1 and dp 1, as `apply` and `train` run it):
    the model is plain PyTorch, no collective; False: a one-rank DTensor model, whose
    vocabulary-parallel loss still issues its collectives."""
    if tp == 1 and dp == 1 if plain is None else plain:
        return []
    one = _tensor_parallel(checked, tp, batch // micro_batches, seq, dtype, lowered)
    if checkpoint_activations:
        one += recomputed(one, units(checked.resolution.modules[""]))
    out = one * micro_batches
    if dp > 1:
        elem = torch.empty((), dtype=param_dtype or dtype).element_size()
        ddp = dp_mode == "ddp"
        # DDP's parameters are whole on every dp rank: nothing padded for a shard
        for path, nbytes in unit_bytes(checked, model, tp, 1 if ddp else dp, elem):
            name = path or "(root)"
            if ddp:
                out.append(
                    Collective("all_reduce", "backward", nbytes, name, "DDP gradients", "dp")
                )
                continue
            for _ in range(micro_batches):
                out.append(
                    Collective("all_gather", "forward", nbytes, name, "FSDP2 parameters", "dp")
                )
                if path:  # FSDP2 keeps the root's parameters gathered from forward to backward
                    out.append(
                        Collective(
                            "all_gather", "backward", nbytes, name, "FSDP2 parameters again", "dp"
                        )
                    )
            out.append(
                Collective("reduce_scatter", "backward", nbytes, name, "FSDP2 gradients", "dp")
            )
    return out


def recomputed(collectives: list[Collective], blocks: list[str]) -> list[Collective]:
    """Activation checkpointing per block re-runs each block's whole forward in backward (Megatron's
    recomputation): the block's forward tensor-parallel collectives again, in the backward phase."""
    inside = [
        c
        for c in collectives
        if c.phase == "forward"
        and c.group == "tp"
        and any(c.module == b or c.module.startswith(b + ".") for b in blocks)
    ]
    return [replace(c, phase="backward", reason=f"recomputed forward: {c.reason}") for c in inside]


def _tensor_parallel(
    checked: Checked, tp: int, batch: int, seq: int, dtype: torch.dtype, lowered: Lowered | None
) -> list[Collective]:
    low = lowered or lower(checked.resolution, tp)
    res = checked.resolution
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = batch * seq
    out: list[Collective] = []

    # Sequence shards follow torch.chunk: a sequence that does not divide is padded for the
    # collective.
    padded = batch * -(-seq // tp) * tp

    def add(
        op: str,
        phase: str,
        width: int,
        reason: str,
        nbytes: int | None = None,
        sequence: bool = False,
        *,
        module: str,
    ) -> None:
        n = padded if sequence else tokens
        size = nbytes if nbytes is not None else n * width * elem
        out.append(Collective(op, phase, size, module, reason))

    if low.loss_parallel:
        head = next(
            p for p, m in low.modules.items() if m.style == Style.VOCAB_PARALLEL and not m.embedding
        )
        # dtp's vocab-parallel cross-entropy (dtp.compiler.vocab_parallel) reads bf16 logits in
        # float32: its three statistics travel in at least float32 (torch's loss_parallel sends the
        # target logit in bf16)
        stats = max(elem, 4)
        for what, size in (("max", stats), ("sum of exponentials", stats), ("target logit", stats)):
            reason = f"vocab-parallel cross-entropy: {what}"
            add("all_reduce", "forward", 1, reason, tokens * size, module=head)
    if tp == 1:
        return out  # DTensor skips redistributions over a one-rank mesh

    shared_children = {
        c: parent for parent, children in low.shared_inputs.items() for c in children
    }
    entered: set[str] = set()

    def enter(path: str, m, width: int) -> None:
        # siblings that share their parent's input pay its cost once (Megatron's f)
        key = shared_children.get(path, path)
        if key in entered:
            return
        entered.add(key)
        if key in low.shared_inputs:
            siblings = ", ".join(c.rsplit(".", 1)[-1] for c in low.shared_inputs[key])
            between = SEQUENCE if low.sequence_parallel else Replicate()
            enter_cost(partial(add, module=key), between, width, f"shared input of {siblings}", key)
        else:
            enter_cost(partial(add, module=key), m.input, width, "input", key)

    for path, m in low.modules.items():
        module = res.modules[path]
        # replicated packed parts: their rows' gradient is summed
        for name, placement in m.placements:
            rows = placement.replicated_rows(tp)
            param = getattr(module, name, None)
            if rows and param is not None:
                numel = param.numel() // param.shape[placement.shard_dim] * rows
                reason = f"gradient of {name}'s replicated parts"
                add("all_reduce", "backward", 0, reason, numel * elem, module=path)
        region = Region(
            path,
            module,
            m,
            res.modules[""],
            tokens,
            elem,
            partial(add, module=path),
            partial(enter, path, m),
        )
        SPECS[m.style].collectives(region)
    if low.sequence_parallel and not any(
        m.embedding and m.output == SEQUENCE for m in low.modules.values()
    ):
        # A replicated activation (e.g. GPT-2's token + position sum) is cut into sequence shards
        # where it enters the first sequence-parallel module; the backward pass gathers its
        # gradient.
        first = next(p for p, m in low.modules.items() if m.style == Style.SEQUENCE_PARALLEL)
        reason = "gradient of the split into sequence shards"
        add(
            "all_gather", "backward", _hidden(res.modules, low), reason, sequence=True, module=first
        )
    return out


def _hidden(modules: dict[str, nn.Module], low: Lowered) -> int:
    """The width of the sequence-parallel activations: a sequence-parallel norm's size."""
    for path, m in low.modules.items():
        weight = (
            getattr(modules[path], "weight", None) if m.style == Style.SEQUENCE_PARALLEL else None
        )
        if weight is not None:
            return weight.shape[-1]
    raise NotModeled("sequence parallelism without a norm to read the hidden size from")


def summarize(collectives: list[Collective], tp: int, dp: int = 1) -> dict:
    """The same shape as the measured `collectives` of a `dtp apply` report."""
    size = {"tp": tp, "dp": dp}
    out: dict = {
        "total": len(collectives),
        "by_op": {},
        "forward": {},
        "backward": {},
        "bytes": {},
        "sent_bytes": {},
    }
    for c in collectives:
        out["by_op"][c.op] = out["by_op"].get(c.op, 0) + 1
        out[c.phase][c.op] = out[c.phase].get(c.op, 0) + 1
        out["bytes"][c.op] = out["bytes"].get(c.op, 0) + c.buffer_bytes
        out["sent_bytes"][c.op] = out["sent_bytes"].get(c.op, 0) + sent_bytes(
            c.op, c.buffer_bytes, size[c.group]
        )
    return out


def to_json(collectives: list[Collective]) -> list[dict]:
    """Each collective as a dict."""
    return [asdict(c) for c in collectives]
