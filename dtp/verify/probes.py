"""What the training steps' one shape cannot show, compared after (and between) them.

The K steps run one mode (train) at one shape (batch × seq). Real models take other paths elsewhere:
chunked or windowed attention and scaled rotary positions above some length, an eval branch, running
statistics kept in buffers. So, beside the steps:

- *probes*: forwards without gradients after the K steps, their logits compared with the references'
  by the same rule — eval mode at the training shape, and eval and train mode on one sequence of the
  longest length the model supports (its config's maximum, or the longest its unsharded copy
  accepts, at most `MAX_PROBE_SEQ` unless `--max-seq` says otherwise);
- *buffers*: every buffer of the sharded model (gathered) against the references' after every step
  and after the probes; floating ones by the rule, the others exactly;
- *replicas*: every tensor the tp ranks hold whole, equal on all of them after every step
  (dtp.runtime.replicas): rank 0's copy is what the comparisons read, so a drift on another rank
  would be unseen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from dtp import models
from dtp.models.calling import Forward
from dtp.runtime.replicas import check_replicas, replica_rtol, replicated_tensors
from dtp.verify.parity import ParityCheck
from dtp.verify.reference import Reference, full_value, own_rng

# the longest probe by default: attention's cost grows as seq², and float64 runs it too
MAX_PROBE_SEQ = 2048


@dataclass(frozen=True)
class Probe:
    """One forward after the steps: a mode and a shape."""

    mode: str  # "train" | "eval"
    batch: int
    seq: int

    @property
    def label(self) -> str:
        """How the report names it."""
        return f"{self.mode}, {self.batch}×{self.seq}"


def _longest(
    truth: Reference, cap: int, tp: int, seq: int, vocab: int, device: torch.device
) -> int | None:
    """Rank 0: the longest length ≤ `cap` (a multiple of tp, longer than the steps' `seq`) that the
    unsharded model runs; None if there is none. A model that does not say its maximum tells us by
    raising."""
    length = cap - cap % tp
    model = truth.model
    was_training = model.training
    model.eval()
    try:
        while length > seq:
            ids = torch.randint(
                0, vocab, (1, length), generator=torch.Generator().manual_seed(0)
            ).to(device)
            try:
                with torch.no_grad(), own_rng(device):
                    truth.run(ids)
                return length
            except Exception:  # noqa: BLE001 - too long for this model: positions, masks or caches end earlier
                length = length // 2 - (length // 2) % tp
        return None
    finally:
        model.train(was_training)


def plan_probes(
    *,
    refs: list[Reference],
    model: nn.Module,
    max_seq: int | None,
    tp: int,
    batch: int,
    seq: int,
    vocab: int,
    device: torch.device,
) -> list[Probe]:
    """The probes every rank runs (decided on rank 0, which holds the references, and broadcast)."""
    decided: list = [None]
    if refs:
        stated = models.max_sequence(model)
        cap = max_seq or min(stated or MAX_PROBE_SEQ, MAX_PROBE_SEQ)
        decided[0] = _longest(refs[0], cap, tp, seq, vocab, device)
    dist.broadcast_object_list(decided, src=0)
    probes = [Probe("eval", batch, seq)]
    if decided[0] is not None:
        probes += [Probe("eval", 1, decided[0]), Probe("train", 1, decided[0])]
    return probes


@torch.no_grad()
def run_probes(
    parity: ParityCheck,
    *,
    sharded: nn.Module,
    refs: list[Reference],
    probes: list[Probe],
    inputs: torch.Tensor,
    seed: int,
    vocab: int,
    device: torch.device,
    forward: Forward,
) -> None:
    """Each probe's forward on every rank; on rank 0 its logits against the references'. `inputs` is
    this rank's part of the steps' batch (the eval probe at the training shape reads it)."""
    gen = torch.Generator().manual_seed(seed + 2)
    for probe in probes:
        ids = (
            inputs
            if probe.seq == inputs.shape[1] and probe.batch == inputs.shape[0]
            else torch.randint(0, vocab, (probe.batch, probe.seq), generator=gen).to(device)
        )
        for m in [sharded] + [r.model for r in refs]:
            m.train(probe.mode == "train")
        got = full_value(forward(sharded, ids))
        if refs:
            outs = []
            # the generator state as the sharded forward left it: a shared dropout stream
            for ref in refs:
                with own_rng(device):
                    outs.append(ref.run(ids))
            parity.compare(
                "probes",
                f"logits ({probe.label})",
                got,
                outs[0],
                outs[1] if len(outs) > 1 else None,
            )
    for m in [sharded] + [r.model for r in refs]:
        m.train()


def compare_buffers(
    parity: ParityCheck, sharded: nn.Module, refs: list[Reference], when: str
) -> None:
    """Every buffer of the sharded model (gathered: a collective on every rank) against the
    references'."""
    mine = {n: full_value(b) for n, b in sharded.named_buffers()}
    if not refs:
        return
    theirs = [dict(r.model.named_buffers()) for r in refs]
    largest = max(
        (
            b.detach().abs().max().item()
            for b in theirs[0].values()
            if b.is_floating_point() and b.numel()
        ),
        default=0.0,
    )  # the floor's G (dtp.verify.parity)
    for name, got in mine.items():
        truth = theirs[0].get(name)
        label = f"{name} ({when})"
        if truth is None:
            parity.problem("buffers", label, f"{label}: the unsharded model has no such buffer")
        elif got.is_floating_point() and truth.is_floating_point():
            parity.compare(
                "buffers",
                label,
                got,
                truth,
                theirs[1].get(name) if len(theirs) > 1 else None,
                held_in=got.dtype,
                floor_scale=largest,
            )
        elif got.shape != truth.shape or not torch.equal(got.cpu(), truth.cpu()):
            parity.problem("buffers", label, f"{label}: differs from the unsharded model's")
        else:
            parity.quantities["buffers"].compared += 1
    for name in theirs[0].keys() - mine.keys():
        parity.problem(
            "buffers", f"{name} ({when})", f"{name} ({when}): missing from the sharded model"
        )


def compare_replicas(
    parity: ParityCheck,
    sharded: nn.Module,
    group: dist.ProcessGroup | None,
    device: torch.device,
    dtype: torch.dtype,
    when: str,
) -> None:
    """Every tensor the tp ranks hold whole, equal on all of them (a collective on every rank)."""
    found = check_replicas(sharded, group, replica_rtol(device, dtype))
    q = parity.quantities["replicas"]
    q.compared += (
        len(replicated_tensors(sharded))
        if group is not None and dist.get_world_size(group) > 1
        else 0
    )
    for d in found:
        parity.problem("replicas", d.name, f"{d.describe()} ({when})", rel=d.rel, max_abs=d.max_abs)
