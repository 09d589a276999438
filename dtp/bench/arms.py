"""The benchmark's arms, each one way of training the same GPT on `tp` ranks from the same weights:

- `dtp`: the Megatron plan (`PLAN`, the text of plans/gpt2.tp) compiled by dtp;
- `hand`: the same placements written directly against torch's `parallelize_module`;
- `megatron`: the Megatron-style baseline of plain tensors and counted dist calls (`megatron.py`);
- `dtp-compile` (opt-in): dtp's sharded model with every block under `torch.compile` (parity is
  probed through the compiled blocks).

An arm is built on every rank from the same `Inputs` and offers a training step and a probe: the
full logits, the loss, the global gradient norm² and the collectives of one forward + backward —
what parity is checked on before timing.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from dtp.bench.megatron import MegatronGPT
from dtp.checks.checker import Checked
from dtp.compiler.placed import pack_parts
from dtp.compiler.vocab_parallel import cross_entropy
from dtp.cost.param_bytes import local_param_bytes
from dtp.layout.parts import equal_parts
from dtp.models import ModelSource
from dtp.models.gpt import GPT, GPTConfig
from dtp.runtime.build import build_sharded
from dtp.runtime.comm import CommCounter, merge
from dtp.train.optim import LocalSGD

# plans/gpt2.tp, shipped inside the package so `dtp bench` runs from any install (a test keeps them
# equal).
PLAN_NAME = "plans/gpt2.tp"
PLAN = """\
# Megatron-LM tensor parallelism for GPT-2 (Shoeybi et al., 2019, section 3):
# attention heads and the MLP's first matrix split by columns, the second matrices by rows,
# the embedding and the loss split by vocabulary. 4 all-reduces per block per training step.
dtp 1
plan gpt2-megatron version 1
mesh tp

transformer.wte: vocab_parallel  # VocabParallelEmbedding: rows split, output all-reduced

transformer.h.* {
    attn.c_attn: colwise(packed=3)  # fused q, k, v: every rank holds whole heads of each
    attn.c_proj: rowwise
    mlp.c_fc: colwise
    mlp.c_proj: rowwise
}

lm_head: vocab_parallel  # tied to wte; logits stay sharded, cross-entropy is vocab-parallel
"""


@dataclass(frozen=True)
class Probe:
    """One forward + backward from the initial weights, seen in full."""

    logits: torch.Tensor  # (B, T, V), gathered
    loss: float
    grad_sq: float  # Σ over every parameter (once, in full) of |grad|²
    collectives: dict[str, int]  # op → count
    comm_bytes: dict[str, int]  # op → full-buffer bytes


@dataclass(frozen=True)
class Inputs:
    """What every arm of a configuration is built from, on each rank."""

    base: GPT  # the unsharded GPT, the same weights on every rank
    mesh: DeviceMesh  # ("tp",)
    x: torch.Tensor  # one batch of token ids
    y: torch.Tensor  # its targets
    checked: Checked  # the job's plan, checked once by the pre-flight, matched to this GPT


@dataclass(frozen=True)
class Arm:
    """A built arm: `step()` trains once; `probe()` is for parity (run it before timing)."""

    name: str
    step: Callable[[], None]
    probe: Callable[[], Probe]
    param_bytes: int  # this rank's parameters


LR = 0.01


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's SGD with DTensor and plain parameters in separate groups: its foreach path (the
    default on CUDA) cannot take a list that mixes them, which a plan leaving some modules unsharded
    makes."""
    params = list(model.parameters())
    groups = [
        [p for p in params if isinstance(p, DTensor)],
        [p for p in params if not isinstance(p, DTensor)],
    ]
    return torch.optim.SGD([{"params": g} for g in groups if g], lr=LR)


def _torch_loss(logits, y) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _dtensor_arm(name: str, model: torch.nn.Module, x, y, local_loss: bool = False) -> Arm:
    """An arm over a DTensor-sharded GPT (logits Shard(-1)): torch's `loss_parallel` and SGD, or
    dtp's local vocabulary-parallel cross-entropy and local SGD (`local_loss`)."""
    # dtp's own: the local loss and SGD's update on the local tensors (dtp.train.optim, as its
    # AdamW)
    opt = LocalSGD(model.parameters(), lr=LR) if local_loss else _sgd(model)
    loss_fn, ctx = (
        (cross_entropy, contextlib.nullcontext) if local_loss else (_torch_loss, loss_parallel)
    )

    def step() -> None:
        with ctx():
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def probe() -> Probe:
        counters = {"forward": CommCounter(), "backward": CommCounter()}
        with ctx():
            with counters["forward"]:
                logits = model(x)
                loss = loss_fn(logits, y)
            with counters["backward"]:
                loss.backward()
        counted = merge(counters)
        grad_sq = sum(
            float(
                (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                .double()
                .pow(2)
                .sum()
            )
            for p in model.parameters()
        )
        opt.zero_grad()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        # plain at tp 1 (dtp's arms)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        return Probe(
            logits.detach(), loss.item(), grad_sq, dict(counted["by_op"]), dict(counted["bytes"])
        )

    return Arm(name, step, probe, local_param_bytes(model))


def _dtp_model(given: Inputs) -> torch.nn.Module:
    """dtp's sharded GPT through the one build path (dtp.runtime.build): built on meta, sharded by
    the checked plan, each rank's blocks scattered from rank 0's `base`; on one rank the plain
    model, as `dtp apply` and `dtp train` run."""
    base = given.base
    applied = build_sharded(
        given.checked,
        ModelSource("bench-gpt", "gpt", base.config),
        given.mesh,
        seed=0,
        device=base.lm_head.weight.device,
        full=base if dist.get_rank() == 0 else None,
        from_rank0=True,
        # at tp 1 plain PyTorch, no DTensor and no collective, as apply and train
        plain=True,
    )
    return applied.model


def build_dtp(given: Inputs) -> Arm:
    """dtp's compiled plan."""
    return _dtensor_arm("dtp", _dtp_model(given), given.x, given.y, local_loss=True)


def build_dtp_compiled(given: Inputs) -> Arm:
    """dtp's compiled plan with every transformer block under torch.compile (inductor), as
    torchtitan compiles per block; the vocabulary-parallel embedding and head stay eager (DTensor's
    masked embedding does not trace here: "Mixing fake modes")."""
    model = _dtp_model(given)
    for block in model.transformer.h:
        block.compile()
    return _dtensor_arm("dtp-compile", model, given.x, given.y, local_loss=True)


def handwritten(model: GPT, mesh) -> None:
    """The placements of plans/gpt2.tp written directly against torch's API (what dtp saves you)."""
    tp = mesh.size()
    # head-aligned QKV the manual way: reorder rows, then plain ColwiseParallel
    with torch.no_grad():
        for block in model.transformer.h:
            for name in ("weight", "bias"):
                p = getattr(block.attn.c_attn, name)
                p.copy_(pack_parts(p, equal_parts(p.shape[0], 3), tp))
    plan = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.transformer.h)):
        plan |= {
            f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
            f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
            f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
            f"transformer.h.{i}.mlp.c_proj": RowwiseParallel(),
        }
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.transformer.wte.weight


def build_hand(given: Inputs) -> Arm:
    """The hand-written parallelize_module plan (its QKV rows reordered; logits and gradient norm do
    not depend on the order of rows)."""
    model = copy.deepcopy(given.base)
    handwritten(model, given.mesh)
    return _dtensor_arm("hand", model, given.x, given.y)


def build_megatron(given: Inputs) -> Arm:
    """The Megatron-style baseline, loaded with this rank's slices of `base`."""
    base, x, y = given.base, given.x, given.y
    world, rank = given.mesh.size(), given.mesh.get_local_rank()
    meg = MegatronGPT(base.config, rank, world).to(base.lm_head.weight.device)
    meg.load_from(base)
    opt = _sgd(meg)

    def step() -> None:
        meg.loss(meg(x), y).backward()
        meg.finish_grads()
        opt.step()
        opt.zero_grad()

    def probe() -> Probe:
        before, before_bytes = meg.calls.counts.copy(), meg.calls.bytes.copy()
        local = meg(x)
        loss = meg.loss(local, y)
        loss.backward()
        meg.finish_grads()
        counts, nbytes = meg.calls.counts - before, meg.calls.bytes - before_bytes
        gathered = [torch.empty_like(local) for _ in range(world)]  # harness-side, not counted
        dist.all_gather(gathered, local.detach().contiguous())
        sharded = torch.zeros((), dtype=torch.float64, device=local.device)
        replicated = 0.0
        for name, p in meg.named_parameters():
            sq = p.grad.double().pow(2).sum()
            if name == "wte" or any(
                name.endswith(s)
                for s in (
                    ".qkv.weight",
                    ".qkv.bias",
                    ".proj.weight",
                    ".fc.weight",
                    ".fc.bias",
                    ".fc2.weight",
                )
            ):
                sharded += sq
            else:
                replicated += float(sq)
        dist.all_reduce(sharded)
        opt.zero_grad()
        return Probe(
            torch.cat(gathered, dim=-1),
            loss.item(),
            float(sharded) + replicated,
            dict(counts),
            dict(nbytes),
        )

    return Arm("megatron", step, probe, local_param_bytes(meg))


ARMS: dict[str, Callable[[Inputs], Arm]] = {
    "dtp": build_dtp,
    "hand": build_hand,
    "megatron": build_megatron,
    "dtp-compile": build_dtp_compiled,
}


def gpt_config(n_layer: int, n_head: int, n_embd: int, vocab_size: int, seq: int) -> GPTConfig:
    """The benchmark's GPT: biases, tied embeddings, dropout 0."""
    return GPTConfig(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab_size,
        block_size=seq,
        bias=True,
        tie_embeddings=True,
    )
