"""Dropout under tensor parallelism: Megatron's RNG tracker, with regions that follow the layouts.

Replicated activations must see the same dropout mask on every rank (else the replicas diverge);
sharded ones, whether split on features (between a colwise and a rowwise layer) or on the sequence
(Megatron-SP's norms, dropouts and residual stream), need a different mask on every rank (else every
shard drops the same pattern). Dropout modules draw from the device's default generator, so dtp
swaps a per-rank state into it where activations are sharded and swaps the caller's own state back
where they are replicated:

- after a claimed module, the stream follows its output layout: Shard → per-rank; Replicate or
  Partial → shared (a partial sum must be masked identically on every rank for the sum to be
  masked);
- a `sequence_parallel` module computes on sequence shards: per-rank from its input on;
- every forward pass of the model starts on, and returns to, the shared stream.

The per-rank stream is its own `torch.Generator`, seeded with seed + 2718 + tp rank (Megatron's
`model-parallel-rng` offset); nothing here seeds or permanently changes a global generator.

The region hooks cost a generator state swap each and take every hooked module off nn.Module's fast
path (about 3 % of a small GPT's step on CPU), so a model without dropout runs without them: one
forward pre-hook on the model looks at its dropout rates (Dropout modules, modules' dropout
attributes) and installs the regions on the first forward in which one is positive, so a rate raised
after `apply` still gets them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from dtp.layout.styles import Style

TP_SEED_OFFSET = 2718  # Megatron's offset for the model-parallel RNG


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that dropout on `device` draws from."""
    if device.type == "cuda":
        return torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
    return torch.default_generator


class TensorParallelRNG:
    """Swaps a per-rank generator state into the device's default generator inside sharded regions."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.default = default_generator(device)
        self.sharded = torch.Generator(device=self.default.device)
        self.sharded.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self.saved: torch.Tensor | None = None  # the caller's state, while inside a sharded region

    def enter(self) -> None:
        """Activations become sharded; repeated entries (q, k, v) are one."""
        if self.saved is None:
            self.saved = self.default.get_state()
            self.default.set_state(self.sharded.get_state())

    def leave(self) -> None:
        """Activations become replicated (or partial): the caller's stream again."""
        if self.saved is not None:
            self.sharded.set_state(self.default.get_state())
            self.default.set_state(self.saved)
            self.saved = None


DROPOUT_WORDS = ("dropout", "pdrop")


def dropout_rates(model: nn.Module) -> list[tuple[str, str, nn.Module, str]]:
    """Every dropout rate `model` can apply as (where, how it is written, module, attribute), read
    when needed: Dropout modules' p, and modules' attributes named for dropout (Hugging Face
    attention passes `self.attention_dropout` to its kernel)."""
    rates: list[tuple[str, str, nn.Module, str]] = []
    for path, module in model.named_modules():
        where = path or "(the model)"
        if isinstance(module, nn.modules.dropout._DropoutNd):
            rates.append((where, " (p={:g})", module, "p"))
            continue
        for key, value in vars(module).items():
            if any(w in key.lower() for w in DROPOUT_WORDS) and is_rate(value):
                rates.append((f"{where}.{key}", "={:g}", module, key))
    return rates


def is_rate(value: object) -> bool:
    """Whether `value` is a number that could be a dropout rate (bools are flags, not rates)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive(value: object) -> bool:
    """Whether `value` is a dropout rate that drops something."""
    return is_rate(value) and value > 0


def track(model: nn.Module, layouts: dict, rng: TensorParallelRNG) -> None:
    """The region hooks (`layouts` maps module paths to dtp.layout.lower.ModuleLayout): now if
    `model` applies dropout, else from the first forward in which one of its dropout rates is
    positive."""
    rates = [(module, key) for _, _, module, key in dropout_rates(model)]
    if not rates:  # nothing that could drop: no hooks at all
        return
    if any(positive(getattr(module, key, 0)) for module, key in rates):
        _install(model, layouts, rng)
        return

    def arm(root: nn.Module, args: tuple) -> None:
        for module, key in rates:
            if positive(getattr(module, key, 0)):
                handle.remove()
                _install(model, layouts, rng)
                rng.leave()  # this forward's root pre-hook ran before the one just installed
                return

    handle = model.register_forward_pre_hook(arm)


def _install(model: nn.Module, layouts: dict, rng: TensorParallelRNG) -> None:
    model.register_forward_pre_hook(lambda m, a: rng.leave())
    for path, layout in layouts.items():
        module = model.get_submodule(path)
        if layout.style == Style.SEQUENCE_PARALLEL:
            module.register_forward_pre_hook(lambda m, a: rng.enter())
        sharded = isinstance(layout.output, Shard)
        module.register_forward_hook(lambda m, a, o, s=sharded: rng.enter() if s else rng.leave())
    # registered last: runs after a root rule's
    model.register_forward_hook(lambda m, a, o: rng.leave())
