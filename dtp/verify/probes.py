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
from dtp.models.calling import MASK, PLAIN, Forward, pad_id, takes_mask
from dtp.models.decoding import CacheHeads, Decoder, as_before
from dtp.runtime.replicas import check_replicas, replica_rtol, replicated_tensors
from dtp.verify.parity import ParityCheck
from dtp.verify.reference import (
    Reference,
    bf16_autocast,
    float64_default,
    full_value,
    own_rng,
)

# why a probe was not compared: the unsharded model cannot take it, not a sharding fault
NOT_FINITE = "not compared (the unsharded model's own logits are not finite there)"
DECODE_STEPS = 4  # tokens the decode probe takes from the KV cache
# the longest probe by default: attention's cost grows as seq², and float64 runs it too
MAX_PROBE_SEQ = 2048


@dataclass(frozen=True)
class Probe:
    """One forward after the steps: a mode and a shape; `padded`: rows left-padded to different
    lengths, with the attention mask; `autocast`: under torch.autocast in bfloat16, the weights
    float32, as `dtp train --dtype bfloat16` runs."""

    mode: str  # "train" | "eval"
    batch: int
    seq: int
    padded: bool = False
    autocast: bool = False
    decode: int = 0  # tokens decoded one at a time from the model's KV cache after the prompts

    @property
    def label(self) -> str:
        """How the report names it."""
        how = ", left-padded" if self.padded else ""
        how += ", bfloat16 autocast" if self.autocast else ""
        how += f", then {self.decode} tokens from the KV cache" if self.decode else ""
        return f"{self.mode}, {self.batch}×{self.seq}{how}"


def padded_batch(
    batch: int, seq: int, vocab: int, pad: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of `batch` prompts of different lengths, left-padded with `pad` to `seq`: row r
    has (r + 1) · ⌊seq/2⌋ // batch pad tokens (at least one), so pad ids are present whatever the
    draw."""
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for r in range(batch):
        n = max(1, (r + 1) * (seq // 2) // batch)
        ids[r, :n], mask[r, :n] = pad, 0
    return ids, mask


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
    dtype: torch.dtype,
    forward: Forward = PLAIN,
) -> list[Probe]:
    """The probes every rank runs (decided on rank 0, which holds the references, and broadcast).

    Beside the lengths: a left-padded batch with its mask where the model takes one (prompts as a
    server batches them), for a float32 run bfloat16 autocast (as `dtp train` computes), and for a
    model with a KV cache (dtp.models.decoding) the padded prompts then `DECODE_STEPS` tokens decoded
    from the cache (as `dtp generate` runs it)."""
    decided: list = [None]
    if refs:
        stated = models.max_sequence(model)
        cap = max_seq or min(stated or MAX_PROBE_SEQ, MAX_PROBE_SEQ)
        decided[0] = _longest(refs[0], cap, tp, seq, vocab, device)
    dist.broadcast_object_list(decided, src=0)
    probes = [Probe("eval", batch, seq)]
    if seq >= 2:  # the mask goes where the forward takes one; pad ids go to every model
        probes.append(Probe("eval", max(batch, 2), seq, padded=True))
    if dtype == torch.float32:
        probes.append(Probe("eval", batch, seq, autocast=True))
    decoder = Decoder.of(model, forward)
    if (decoder.cached or decoder.slots) and seq >= 2:  # prefill and decode, as `dtp generate`
        probes.append(Probe("eval", max(batch, 2), seq, padded=True, decode=DECODE_STEPS))
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
    mine: slice,
    seed: int,
    vocab: int,
    device: torch.device,
    forward: Forward,
) -> dict[Probe, str]:
    """Each probe's forward on every rank; on rank 0 its logits against the references'. `inputs` is
    the steps' global batch and `mine` this rank's rows of it: a probe at the training shape runs
    those rows sharded and the whole batch unsharded (one forward, as data parallelism stands for:
    a batch statistic sees every row), compared at these rows. Returns the probes not compared, each
    with why: the unsharded float64 model itself gives non-finite logits there (a model that cannot
    take padding, not a sharding fault), or a gpt-fast model's caches are not made for the rank's
    heads (its decoding is not proven; `dtp generate` refuses it)."""
    skipped: dict[Probe, str] = {}
    gen = torch.Generator().manual_seed(seed + 2)
    pad = pad_id(sharded) if pad_id(sharded) < vocab else 0
    masked = takes_mask(sharded)
    for probe in probes:
        extra, keep, rows = {}, None, slice(None)
        if probe.decode:
            ids, mask = padded_batch(probe.batch, probe.seq, vocab, pad, gen)
            tokens = torch.randint(0, vocab, (probe.decode, probe.batch), generator=gen)
            why = _decode(parity, sharded, refs, probe, ids, mask, tokens, device, forward)
            if why:
                skipped[probe] = why
            continue
        if probe.padded:
            ids, mask = padded_batch(probe.batch, probe.seq, vocab, pad, gen)
            ids, keep = ids.to(device), mask.bool()
            extra = {MASK: mask.to(device)} if masked else {}
        elif probe.seq == inputs.shape[1] and probe.batch == inputs[mine].shape[0]:
            ids, rows = inputs[mine], mine
        else:
            ids = torch.randint(0, vocab, (probe.batch, probe.seq), generator=gen).to(device)
        for m in [sharded] + [r.model for r in refs]:
            m.train(probe.mode == "train")
        with bf16_autocast(device, probe.autocast):
            got = full_value(forward(sharded, ids, **extra))
        if not refs:
            continue
        outs = []
        # the generator state as the sharded forward left it: a shared dropout stream
        for i, ref in enumerate(refs):
            # the float64 truth is the truth: autocast runs the unsharded copy only
            with own_rng(device), bf16_autocast(device, probe.autocast and i > 0):
                whole = inputs if rows != slice(None) else ids
                outs.append(ref.run(whole, **extra)[rows])
        if keep is not None:  # a padded position's logits are whatever the model makes of them
            got, outs = got[keep.to(got.device)], [o[keep.to(o.device)] for o in outs]
            if not bool(outs[0].isfinite().all()):
                skipped[probe] = NOT_FINITE
                continue
        parity.compare(
            "probes",
            f"logits ({probe.label})",
            got,
            outs[0],
            outs[1] if len(outs) > 1 else None,
            held_in=torch.bfloat16 if probe.autocast else None,
        )
    for m in [sharded] + [r.model for r in refs]:
        m.train()
    return skipped


def _decode(
    parity: ParityCheck,
    sharded: nn.Module,
    refs: list[Reference],
    probe: Probe,
    ids: torch.Tensor,
    mask: torch.Tensor,
    tokens: torch.Tensor,
    device: torch.device,
    forward: Forward,
) -> str | None:
    """Prefill the padded prompts, then feed `tokens` (steps × B) one step at a time through every
    model's own cache; each step's last logits against the references' (rank 0). Why it was not
    compared (None: it was): the float64 truth itself is not finite there, or a gpt-fast model's
    caches are not made for the rank's heads."""
    decoder = Decoder.of(sharded, forward, new_tokens=len(tokens))
    ids, mask, tokens = ids.to(device), mask.to(device), tokens.to(device)
    for m in [sharded] + [r.model for r in refs]:
        m.eval()
    # a gpt-fast model's caches (setup_caches) go again after the probe: later forwards and the
    # buffer comparison see the model as it trains
    with as_before(sharded, *[r.model for r in refs]):
        try:
            got, state = decoder.prefill(sharded, ids, mask)
        except CacheHeads as err:  # alike on every rank: each has the same local heads
            return f"not decoded: {err}"
        steps = [full_value(got)]
        for token in tokens:
            steps.append(full_value(decoder.step(sharded, state, token)))
        theirs = []
        for ref in refs:
            with own_rng(device), float64_default(ref.dtype):
                logits, ref_state = decoder.prefill(ref.model, ids, mask)
                outs = [logits] + [decoder.step(ref.model, ref_state, t) for t in tokens]
            theirs.append(outs)
    if not refs:
        return None
    if not all(bool(o.isfinite().all()) for o in theirs[0]):
        return NOT_FINITE
    for k, got in enumerate(steps):
        parity.compare(
            "probes",
            f"logits ({probe.label}: {'prefill' if k == 0 else f'decode step {k}'})",
            got,
            theirs[0][k],
            theirs[1][k] if len(theirs) > 1 else None,
        )
    return None


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
