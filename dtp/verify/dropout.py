"""Dropout by placement: every random mask a forward draws, checked against what the tensor it
masks is on each tp rank.

Megatron's rule (dtp.runtime.rng): a tensor every tp rank holds whole (replicated) must be masked
alike on every rank, else its copies diverge; a sharded one must be masked differently on each,
else every shard drops the same pattern. dtp's generator regions follow the plan's layouts, which is
a belief about the tensors; this probe looks at the tensors themselves, on one forward:

- a *draw* is any random op (bernoulli, rand, uniform_, normal_, randperm …; native_dropout's mask
  on CUDA); what is computed from draws alone (`div_`, `<`, a view) is still the draw;
- a *site* is the op where a draw meets a tensor that is not one (`x * mask`, `where`,
  `masked_fill`): that tensor is the one masked;
- on every tp rank each site gives a fingerprint of the masked tensor and of the mask. The ranks'
  masked tensors equal: replicated, the masks must be equal. Different (sharded, on features or on
  the sequence): the masks must differ, unless equal masks are likely by chance (a small or nearly
  empty mask: the probability that two independent draws agree must be below `CHANCE`).

A draw from a `torch.Generator` the model holds is outside dtp's streams; the probe names it (the
module attribute that holds it) where its masks break the rule, and the summary lists every one. Runs that do not apply
dropout and hold no generator are not probed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from dtp.verify.parity import dropout_sources

aten = torch.ops.aten
RANDOM = {
    aten.bernoulli.default,
    aten.bernoulli.p,
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.rand.default,
    aten.rand.generator,
    aten.rand_like.default,
    aten.randn.default,
    aten.randn.generator,
    aten.randn_like.default,
    aten.randint.low,
    aten.randint.low_generator,
    aten.randint_like.default,
    aten.randperm.default,
    aten.randperm.generator,
    aten.uniform_.default,
    aten.normal_.default,
    aten.exponential_.default,
    aten.multinomial.default,
}
CHANCE = 1e-6  # equal masks on shards are a fault only when less likely than this by chance


def generators(model: nn.Module) -> dict[str, torch.Generator]:
    """The torch.Generators `model`'s modules hold, by where (`layers.0.attn.gen`)."""
    return {
        f"{path}.{key}".lstrip("."): value
        for path, module in model.named_modules()
        for key, value in vars(module).items()
        if isinstance(value, torch.Generator)
    }


def _owner(gen: torch.Generator, owned: dict[str, torch.Generator]) -> str:
    """Which of the model's generators `gen` is (the dispatcher hands a new Python object for the
    same generator, so it is found by its state, read before the draw)."""
    state = gen.get_state()
    names = [
        n for n, g in owned.items() if g.device == gen.device and torch.equal(g.get_state(), state)
    ]
    return " or ".join(names) if names else "a generator of its own"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def fingerprint(t: torch.Tensor) -> tuple:
    """(shape, a weighted sum) of `t`'s values: equal tensors give equal fingerprints; different
    ones, different fingerprints but for a chance of about 2^-52."""
    flat = _local(t).detach().flatten().double()
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device)
    weights = (weights * 0.6180339887498949).frac() + 0.5
    return tuple(t.shape), float((flat.nan_to_num(0.0) * weights).sum())


def chance_equal(mask: torch.Tensor) -> float:
    """The probability that an independent draw of `mask` (zeros at rate q, else one value) equals
    it: (q² + (1 − q)²)ⁿ; 0 for a draw of more than two values."""
    m = _local(mask).detach()
    n = m.numel()
    if n == 0:
        return 1.0
    if m[m != 0].unique().numel() > 1:
        return 0.0
    q = float((m == 0).double().mean())
    return math.exp(n * math.log(max(q * q + (1 - q) ** 2, 1e-300)))


@dataclass
class Site:
    """Where a draw met the tensor it masks, on this rank."""

    where: str  # the module, then the op
    masked: tuple  # fingerprint of the tensor masked
    mask: tuple  # fingerprint of the mask
    chance: float  # probability that an independent draw equals this mask
    generator: str | None  # the model's own generator it came from, if any


class _Recorder(TorchDispatchMode):
    """Follows draws through one forward and records the sites where they meet other tensors."""

    def __init__(self, owned: dict[str, torch.Generator], stack: list[str]):
        super().__init__()
        self.owned, self.stack = owned, stack
        self.draws = WeakTensorKeyDictionary()  # tensor → the generator it came from (or None)
        self.sites: list[Site] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen = kwargs.get("generator") if func in RANDOM else None
        source = _owner(gen, self.owned) if gen is not None else None
        out = func(*args, **kwargs)
        tensors = [a for a in _flat(args) + _flat(list(kwargs.values())) if _is_tensor(a)]
        drawn = [t for t in tensors if t in self.draws]
        if func in RANDOM:
            self._mark(out, source)
        elif func is aten.native_dropout.default:  # CUDA's fused dropout: (output, mask)
            self._site(func, args[0], out[1], None)
        elif drawn:
            others = [t for t in tensors if t not in self.draws and t.numel() > 1]
            gen = self.draws[drawn[0]]
            if others:
                masked = max(others, key=lambda t: t.numel())
                self._site(func, masked, max(drawn, key=lambda t: t.numel()), gen)
            else:
                self._mark(out, gen)
        return out

    def _mark(self, out, gen: str | None) -> None:
        for t in _flat([out]):
            if _is_tensor(t):
                self.draws[t] = gen

    def _site(self, func, masked: torch.Tensor, mask: torch.Tensor, gen: str | None) -> None:
        where = (
            f"{self.stack[-1] if self.stack else '(the model)'} ({func.overloadpacket.__name__})"
        )
        self.sites.append(
            Site(where, fingerprint(masked), fingerprint(mask), chance_equal(mask), gen)
        )


def _flat(values: list) -> list:
    out = []
    for v in values:
        out.extend(_flat(list(v)) if isinstance(v, (list, tuple)) else [v])
    return out


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


@dataclass
class DropoutProbe:
    """The probe of one model: record a forward's sites, then compare them across the tp ranks."""

    model: nn.Module
    owned: dict[str, torch.Generator]
    sites: list[Site] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @classmethod
    def over(cls, model: nn.Module) -> DropoutProbe | None:
        """A probe for `model`, or None when it applies no dropout and holds no generator."""
        owned = generators(model)
        return cls(model, owned) if owned or dropout_sources(model) else None

    @contextlib.contextmanager
    def recording(self):
        """Record the sites of the forward run inside."""
        stack: list[str] = []
        handles = []

        def leave(module, args, output) -> None:  # a hook's return value would replace the output
            stack.pop()

        for path, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda m, a, p=path: stack.append(p)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        recorder = _Recorder(self.owned, stack)
        try:
            with recorder:
                yield
        finally:
            for h in handles:
                h.remove()
            self.sites = recorder.sites

    def verdict(self, group: dist.ProcessGroup | None) -> list[str]:
        """Compare the recorded sites across `group`'s ranks (a collective); the problems, the
        same on every rank of the group."""
        if group is None or dist.get_world_size(group) == 1:
            ranks = [self.sites]
        else:
            ranks = [None] * dist.get_world_size(group)
            dist.all_gather_object(ranks, self.sites, group=group)
        self.problems = judge(ranks)
        return self.problems

    def record(self) -> dict:
        """summary.json's `dropout` section."""
        return {
            "sites": len(self.sites),
            "problems": self.problems,
            "generators": sorted(self.owned),
        }


def judge(ranks: list[list[Site]]) -> list[str]:
    """The problems of the sites each tp rank recorded (rank order)."""
    if len({len(sites) for sites in ranks}) > 1:
        return []  # the ranks took different paths: nothing to align (the parity checks see it)
    problems = []
    for same_site in zip(*ranks):
        site = same_site[0]
        replicated = len({s.masked for s in same_site}) == 1
        alike = len({s.mask for s in same_site}) == 1
        source = f" (drawn from {site.generator})" if site.generator else ""
        if len(same_site) > 1 and replicated and not alike:
            problems.append(
                f"{site.where} masks a tensor every tp rank holds whole (replicated) with a "
                f"different mask{source} on each rank, so its copies diverge"
            )
        elif len(same_site) > 1 and not replicated and alike and site.chance < CHANCE:
            problems.append(
                f"{site.where} masks a tensor sharded across the tp ranks with the same "
                f"mask{source} on every rank, so every shard drops the same pattern"
                + (
                    " (a generator the model holds is outside dtp's per-rank streams: draw "
                    "dropout from the default generator)"
                    if site.generator and not any("default generator" in p for p in problems)
                    else ""
                )
            )
    return problems
