"""The optimizer every run uses, and rank 0's unsharded references (see dtp.verify.parity for the
rule).

`MixedSGD` is Megatron's mixed precision for SGD: parameters held in bfloat16 (or float16) are
trained through float32 master copies (gradients cast up, the step taken on the masters, the result
rounded back into the parameters), so updates far below a bfloat16 step still accumulate. Parameters
in float32 or float64 are their own masters.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dtp.compiler.vocab_parallel import IGNORE_INDEX
from dtp.models.calling import PLAIN, Forward
from dtp.models.clone import clone
from dtp.models.spec import cast

LOW_PRECISION = (torch.bfloat16, torch.float16)
MOMENTUM = 0.9


class MixedSGD:
    """SGD with momentum on master weights (float32 copies of low-precision parameters)."""

    def __init__(self, model: nn.Module, lr: float):
        self.params = dict(model.named_parameters())
        self.masters = {
            n: (
                p.detach().float().requires_grad_(p.requires_grad)
                if p.dtype in LOW_PRECISION
                else p
            )
            for n, p in self.params.items()
        }
        self.opt = torch.optim.SGD(list(self.masters.values()), lr=lr, momentum=MOMENTUM)

    @torch.no_grad()
    def step(self) -> None:
        """One step on the masters, then the parameters take their rounded values."""
        for n, p in self.params.items():
            m = self.masters[n]
            if m is not p:
                m.grad = p.grad.float() if p.grad is not None else None
        self.opt.step()
        for n, p in self.params.items():
            m = self.masters[n]
            if m is not p:
                p.copy_(m)

    def zero_grad(self) -> None:
        """Drop every gradient (parameters' and masters')."""
        for n, p in self.params.items():
            p.grad = None
            self.masters[n].grad = None

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype parameters are trained in."""
        return next(iter(self.masters.values())).dtype if self.masters else torch.float32


def copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An unsharded copy of `model` in `dtype`; in float64, Hugging Face MoE experts run their eager
    loop (torch's grouped matmul has no float64 kernel), GPT-2's `reorder_and_upcast_attn` its
    plain path (the same scores, which it insists on computing in float32), and eager attention
    runs as SDPA (`_sdpa`)."""
    out = cast(clone(model), dtype)
    if dtype == torch.float64:
        _sdpa(out)
        for module in out.modules():
            config = getattr(module, "config", None)
            if getattr(config, "_experts_implementation", None) not in (None, "eager"):
                config._experts_implementation = "eager"
            if getattr(module, "reorder_and_upcast_attn", None) is True:
                module.reorder_and_upcast_attn = False
    return out


def _sdpa(model: nn.Module) -> None:
    """A Hugging Face model on eager attention switched to SDPA, the same attention: eager takes its
    softmax in float32, where a float64 mask's minimum becomes -inf, so a left-padded row's pad
    queries see no key and turn NaN, and the NaN reaches the tokens through the values (0 × NaN).
    SDPA keeps such rows finite; the tokens' logits agree with float32 eager to its rounding."""
    config = getattr(model, "config", None)
    if (
        getattr(config, "_attn_implementation", None) == "eager"
        and getattr(model, "_supports_sdpa", False)
        and hasattr(model, "set_attn_implementation")
    ):
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError):  # a family whose SDPA path this version lacks
            pass


class Reference:
    """One unsharded copy of a model with its own optimizer, in a given dtype. The copy is the
    model's own code (dtp.models.clone: closures over submodules call the copy's), called as
    `forward` says."""

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        dtype: torch.dtype | None = None,
        forward: Forward = PLAIN,
    ):
        self.model = copy_in(model, dtype) if dtype is not None else clone(model)
        self.opt = MixedSGD(self.model, lr)
        self.dtype = dtype
        self.forward = forward

    def run(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, **extra: torch.Tensor
    ) -> torch.Tensor:
        """The model's logits (the float64 truth's computed with float64 as the default dtype:
        `forward_as`); `extra` by name (an attention mask)."""
        return forward_as(self.model, self.dtype, inputs, targets, self.forward, **extra)

    def param(self, name: str) -> torch.Tensor | None:
        """A parameter as trained (its master copy)."""
        return self.opt.masters.get(name)

    def grad(self, name: str) -> torch.Tensor | None:
        """A parameter's gradient."""
        p = self.opt.params.get(name)
        return p.grad if p is not None else None


def forward_as(
    model: nn.Module,
    dtype: torch.dtype | None,
    inputs: torch.Tensor,
    targets: torch.Tensor | None = None,
    forward: Forward = PLAIN,
    **extra: torch.Tensor,
) -> torch.Tensor:
    """`model`'s logits on `inputs`, called as `forward` says; for the float64 truth with float64 as
    torch's default dtype, so that a tensor the model makes without a dtype (XGLM's `torch.full((),
    finfo(weights.dtype).min)`) is float64 too, not an overflow."""
    with float64_default(dtype):
        return forward(model, inputs, targets, **extra)


@contextlib.contextmanager
def float64_default(dtype: torch.dtype | None):
    """float64 as torch's default dtype inside, when `dtype` is float64 (the truth's runs)."""
    if dtype != torch.float64:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss over (B, T, V) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def ignore_some(targets: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`targets` with ⌊T/8⌋ positions of every row set to IGNORE_INDEX (-100), as padding and
    prompts are masked in fine-tuning: the same number in every row, so a dp rank's mean loss is over
    as many tokens as the global batch's."""
    out = targets.clone()
    ignored = torch.rand(out.shape, generator=gen).argsort(dim=1)[:, : out.shape[1] // 8]
    return out.scatter_(1, ignored, IGNORE_INDEX)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast in `dtype` on `device`'s type (as `dtp train --precision bf16|fp16`
    computes), or nothing for None."""
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def bf16_autocast(device: torch.device, on: bool = True):
    """`autocast` in bfloat16 where `on`, else nothing."""
    return autocast(device, torch.bfloat16 if on else None)


def own_rng(device: torch.device):
    """A context that puts back the CPU generator's state (and `device`'s, if CUDA) when it ends."""
    return torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else [])


def references(
    model: nn.Module, dtype: torch.dtype, lr: float, forward: Forward = PLAIN
) -> list[Reference]:
    """The float64 truth and, for a lower dtype, the unsharded run in that dtype
    (dtp.verify.parity's rule)."""
    truth = Reference(model, lr, torch.float64, forward)
    return [truth] if dtype == torch.float64 else [truth, Reference(model, lr, forward=forward)]


def reference_step(
    ref: Reference,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    mine: slice,
    split: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward on the global batch; the logits and loss of this rank's part of it
    (`split`: dp ranks hold rows `mine`), taken from that same forward.

    One forward, as data parallelism runs it: train mode once, buffers (a step counter, running
    statistics) updated once, batch statistics over the whole batch. On its own copy of the
    generator state: the shared dropout stream stays in step with the other ranks."""
    with own_rng(device):
        logits = ref.run(inputs, targets)
        loss = cross_entropy(logits, targets)
        loss.backward()
    if not split:
        return logits, loss
    with torch.no_grad():
        rows = logits[mine].detach()
        return rows, cross_entropy(rows, targets[mine])
