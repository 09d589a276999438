"""`dtp train --verify-every N`: the sharded model against a float64 replay of its own weights,
beyond the three steps `dtp apply` proves.

A model can go wrong after warm-up: from its sixth forward (a counter in a Python attribute), once a
buffer crosses a threshold, after the optimizer has moved a weight through zero. Every N steps and
after the last, every rank runs the sharded model without gradients on a fixed batch (the first
validation batch, one label in eight ignored as -100, so the ignored-label path of the loss runs
too). Rank 0 loads the gathered weights, the buffers and the Python scalars training changed into
two unsharded copies of the model, the float64 truth and one in the weights' dtype (float32, under
the run's autocast (bfloat16 or float16) where it computes in one), runs the whole global batch through each and
compares its own rows' logits and loss by dtp.verify.parity's rule: the bound is this step's own
rounding, measured by the unsharded copy, not a fixed band. A tensor over its bound, or a
non-finite one, stops every rank (exit 1).

The check leaves training as it found it: the sharded model's buffers and Python scalars are put
back after its forward and the random generators forked around it. It runs in train mode (the mode
that trains) unless the model applies dropout, whose masks an unsharded copy cannot draw alike;
then in eval mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from dtp import models
from dtp.compiler.vocab_parallel import cross_entropy as sharded_cross_entropy
from dtp.cost.explain import human_bytes
from dtp.train import data
from dtp.verify.parity import FLOOR_SHARE, ParityCheck, compare_grads, dropout_sources
from dtp.verify.reference import (
    autocast,
    cross_entropy,
    full_value,
    ignore_some,
    own_rng,
    reference_step,
    references,
)

# rank 0's two unsharded copies (float64 and float32, 12 bytes a parameter) above this: not run
MAX_REPLAY_BYTES = 2 * 2**30
SCALARS = (int, float, bool)


def due(step: int, every: int, last: int) -> bool:
    """Whether to verify after `step` (1-based): every `every` steps and after the last; never at
    `every` 0."""
    return every > 0 and (step % every == 0 or step == last)


def replay_bytes(model: nn.Module) -> int:
    """Rank 0's memory for the replay: a float64 and a float32 copy of every parameter and buffer."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(12 * t.numel() for t in tensors if t.is_floating_point())


def scalars(model: nn.Module) -> dict[tuple[str, str], object]:
    """Every module's Python numbers and flags (a counter, a warm-up flag), mode aside."""
    return {
        (path, key): value
        for path, module in model.named_modules()
        for key, value in vars(module).items()
        if type(value) in SCALARS and key != "training"
    }


def put_scalars(model: nn.Module, values: dict[tuple[str, str], object]) -> None:
    """Set the scalars `values` holds on the modules of `model` that have them."""
    modules = dict(model.named_modules())
    for (path, key), value in values.items():
        if path in modules and key in vars(modules[path]):
            setattr(modules[path], key, value)


@contextlib.contextmanager
def untouched(model: nn.Module, device: torch.device):
    """Run a forward that leaves no trace: buffers, Python scalars and generators put back."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    before = scalars(model)
    with own_rng(device), torch.no_grad():
        try:
            yield
        finally:
            for b, saved in buffers:
                b.copy_(saved)
            put_scalars(model, before)


@dataclass
class Verification:
    """One rank's verifications: the fixed batch, rank 0's unsharded copies, what each found."""

    every: int
    inputs: torch.Tensor  # the global batch
    targets: torch.Tensor
    mine: slice  # this rank's rows of it
    mode: str  # "train" | "eval"
    autocast: torch.dtype | None  # the run's autocast dtype (bfloat16, float16), None: float32
    refs: list = field(default_factory=list)  # rank 0: the float64 truth, the run's dtype
    born: dict = field(default_factory=dict)  # the scalars as built: what training changes is state
    records: list[dict] = field(default_factory=list)
    skipped: str | None = None  # why verification does not run

    @classmethod
    def over(cls, trainer, every: int) -> Verification:
        """The verification of `trainer`'s run (a collective-free set-up; rank 0 builds its copies)."""
        cfg = trainer.cfg
        # the first validation batch whole (every dp rank's rows)
        inputs, targets = data.val_batches(
            trainer.corpus, trainer.tokens, cfg.batch, cfg.seq, 1, 0, 1
        )[0]
        targets = ignore_some(targets, torch.Generator().manual_seed(cfg.seed + 1))
        per = cfg.batch // cfg.dp
        mine = slice(trainer.dp_rank * per, (trainer.dp_rank + 1) * per)
        mode = "eval" if dropout_sources(trainer.model) else "train"
        out = cls(every, inputs, targets, mine, mode, AUTOCAST.get(cfg.dtype))
        out.born = scalars(trainer.model)
        if every <= 0:
            out.skipped = "--verify-every 0"
            return out
        size = replay_bytes(trainer.meta)
        if size > MAX_REPLAY_BYTES:
            out.skipped = (
                f"the model's unsharded float64 and float32 copies need {human_bytes(size)} on "
                f"rank 0, above {human_bytes(MAX_REPLAY_BYTES)}"
            )
        elif dist.get_rank() == 0:
            # its own initialisation draws on a copy of the generators: the stream the ranks share
            # (dropout on replicated tensors) must stay in step with the other ranks'
            with own_rng(trainer.device):
                full = models.build(trainer.source, device="cpu", weights=False)
            out.refs = references(full.to(trainer.device), torch.float32, 0.0, trainer.forward)
        return out

    def check(self, trainer, step: int) -> dict:
        """Verify after `step` on every rank (collectives); the record, the same on every rank."""
        model, device = trainer.model, trainer.device
        mine = self.inputs[self.mine].to(device), self.targets[self.mine].to(device)
        with untouched(model, device):
            model.train(self.mode == "train")
            with autocast(device, self.autocast):
                logits = trainer.forward(model, *mine)
            loss = sharded_cross_entropy(logits, mine[1])
            got = full_value(logits), full_value(loss)
            grads = self._grads(trainer, mine) if self.autocast else None
            model.train()
        weights = {n: trainer.applied.full(n, p.detach()) for n, p in model.named_parameters()}
        buffers = {n: full_value(b) for n, b in model.named_buffers()}
        record = [None]
        if self.refs:
            changed = {k: v for k, v in scalars(model).items() if self.born.get(k) != v}
            record[0] = self._compare(step, got, grads, weights, buffers, changed, device)
        dist.broadcast_object_list(record, src=0)
        self.records.append(record[0])
        return record[0]

    def _grads(self, trainer, mine) -> dict:
        """Under autocast, every gradient of one more forward and backward of the fixed batch,
        gathered (then cleared: the step that follows starts from none, as it would have). A path
        only autocast takes can move the logits less than half precision's own rounding and the
        gradients of what it touches by O(1) (dtp.verify.rank's autocast step)."""
        model = trainer.model
        with torch.enable_grad():  # the check itself runs without
            with autocast(trainer.device, self.autocast):
                logits = trainer.forward(model, *mine)
            sharded_cross_entropy(logits, mine[1]).backward()
        grads = {
            n: (trainer.applied.full(n, p.grad) if p.grad is not None else None)
            for n, p in model.named_parameters()
        }
        model.zero_grad(set_to_none=True)
        return grads

    def _compare(self, step, got, grads, weights, buffers, changed, device) -> dict:
        """Rank 0: load the copies, run the global batch, compare this rank's rows (and, under
        autocast, every gradient)."""
        parity = ParityCheck(torch.float32)
        inputs, targets = self.inputs.to(device), self.targets.to(device)
        outs = []
        for i, ref in enumerate(self.refs):
            _load(ref.model, weights, buffers, changed)
            ref.model.train(self.mode == "train")
            with own_rng(device), autocast(device, self.autocast if i else None):
                if grads is None:
                    with torch.no_grad():
                        rows = ref.run(inputs, targets)[self.mine]
                else:  # one forward and backward of the whole batch, this rank's rows of it
                    with torch.enable_grad():
                        rows, _ = reference_step(ref, inputs, targets, self.mine, True, device)
            # the loss in float32 from half-precision logits, as training takes it
            wide = rows.float() if rows.dtype in (torch.bfloat16, torch.float16) else rows
            outs.append((rows, cross_entropy(wide, targets[self.mine])))
        held = self.autocast
        when = f"after step {step}"
        for k, name in enumerate(("logits", "loss")):
            parity.compare(name, f"{name} ({when})", got[k], outs[0][k], outs[1][k], held_in=held)
        if grads is not None:
            compare_grads(parity, "grads", grads, self.refs, f" ({when})", held, FLOOR_SHARE)
            for ref in self.refs:
                ref.opt.zero_grad()
        checked = ("logits", "loss", "grads") if grads is not None else ("logits", "loss")
        return {
            "step": step,
            "ok": parity.ok,
            "margin": max(parity.quantities[q].margin for q in checked),
            "logits_rel": parity.quantities["logits"].max_rel,
            "loss_rel": parity.quantities["loss"].max_rel,
            "grads_margin": parity.quantities["grads"].margin if grads is not None else None,
            "problems": [p for q in checked for p in parity.quantities[q].problems],
            "state_copied": sorted(f"{p}.{k}".lstrip(".") for p, k in changed),
        }

    def record(self) -> dict:
        """summary.json's `verify` section."""
        return {
            "every": self.every,
            "mode": self.mode,
            "skipped": self.skipped,
            "checks": self.records,
            "ok": all(r["ok"] for r in self.records),
        }


# what `dtp train --precision` runs its forward in
AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def _load(model: nn.Module, weights: dict, buffers: dict, changed: dict) -> None:
    """The sharded run's gathered state into an unsharded copy (cast to its dtype)."""
    for n, p in model.named_parameters():
        if n in weights:
            p.copy_(weights[n])
    for n, b in model.named_buffers():
        if n in buffers:
            b.copy_(buffers[n])
    put_scalars(model, changed)


def message(record: dict) -> str:
    """Why a verification failed, in one paragraph."""
    grads = record.get("grads_margin")
    what = "; ".join(record["problems"]) or (
        f"logits off by {record['logits_rel']:.2e} and the loss by {record['loss_rel']:.2e} "
        "relative"
        + (
            f" and the gradients of one more forward and backward under autocast {grads:.1f}× "
            "their bound; worst"
            if grads is not None
            else ","
        )
        + f" {record['margin']:.1f}× the bound this step's own rounding allows"
    )
    return (
        f"after step {record['step']} the sharded model no longer computes what its own weights "
        f"do unsharded (a float64 replay on a fixed batch): {what}; the run stopped (exit 1)"
    )


def line(record: dict) -> list[str]:
    """The summary's line: what was verified, and its worst margin."""
    if record["skipped"]:
        return [f"  verification against a float64 replay: not run ({record['skipped']})"]
    checks = record["checks"]
    if not checks:
        return []
    worst = max(checks, key=lambda r: r["margin"])
    return [
        f"  verified against a float64 replay of its own weights after {len(checks)} step"
        f"{'s' if len(checks) > 1 else ''} ({', '.join(str(r['step']) for r in checks)}; "
        f"{record['mode']} mode): worst {worst['margin']:.2f} of the bound (logits "
        f"{worst['logits_rel']:.1e}, loss {worst['loss_rel']:.1e} relative"
        + (
            f"; gradients under autocast {worst['grads_margin']:.2f} of theirs)"
            if worst.get("grads_margin") is not None
            else ")"
        )
    ]
