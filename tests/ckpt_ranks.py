"""Rank-side helpers for the checkpoint tests: a small AdamW training loop over a model sharded by
dtp."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from dtp import models
from dtp.lang.parse import parse
from dtp.models.gpt import GPT, GPTConfig
from dtp.models.llama import Llama, LlamaConfig
from dtp.runtime.data_parallel import data_parallel
from dtp.runtime.shard import Applied, apply

REPO = Path(__file__).resolve().parent.parent
BATCH, SEQ, LR = 4, 16, 1e-2
# `dtp train` on gpt2-tiny at tp 1, small and quick (add --steps, --checkpoint, --out)
TINY_TRAIN = [
    "plans/gpt2.tp",
    "gpt2-tiny",
    "--batch",
    "2",
    "--seq",
    "16",
    "--eval-every",
    "100",
    "--device",
    "cpu",
    "--tp",
    "1",
]
# gpt2-tiny with an odd vocabulary (uneven shards at tp 2 and 4), packed QKV and tied embeddings.
GPT_ODD = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=257, block_size=64, dropout=0.0)
LLAMA_GQA = LlamaConfig(
    n_layer=2,
    n_head=8,
    n_kv_head=4,
    n_embd=64,
    intermediate_size=128,
    vocab_size=250,
    block_size=64,
    packed_gate_up=True,
)


def _factory(name: str) -> nn.Module:
    # transformers' GPT-2: Conv1D, c_attn packed along its dim 1, tied head, odd vocabulary
    if name == "hfgpt2":
        from dtp.models import hf

        return hf.build("gpt2", vocab_size=257)
    if name == "gpt":
        return GPT(GPT_ODD)
    # llama-tiny-packed (fused gate/up, packed=2) with GQA that tp 4 divides, uneven vocabulary
    if name == "llama":
        return Llama(LLAMA_GQA)
    from dtp.models.examples import tiny_llama

    return tiny_llama()


PLANS = {
    "gpt": "plans/gpt2.tp",
    "hfgpt2": "plans/hf/gpt2.tp",
    "llama": "plans/llama-packed.tp",
    "hf": "plans/hf-llama.tp",
}


@dataclass
class Run:
    """One sharded model, its optimizer and how to step it."""

    model: nn.Module
    applied: Applied
    opt: torch.optim.Optimizer
    mesh: DeviceMesh
    plan_text: str
    vocab: int


def mesh_of(tp: int, dp: int = 1) -> DeviceMesh:
    """A (tp) or (dp, tp) mesh over the first tp·dp ranks of the world (all of it)."""
    if dp > 1:
        return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


def setup(name: str, mesh: DeviceMesh, seed: int, plan_text: str | None = None) -> Run:
    """Build model `name` from `seed`, shard it with its plan (FSDP2 over dp too) and give it AdamW."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    text = plan_text or (REPO / PLANS[name]).read_text()
    torch.manual_seed(seed)
    model = _factory(name)
    applied = apply(parse(text), model, mesh)
    if mesh.ndim > 1:
        data_parallel(model, mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return Run(model, applied, opt, mesh, text, models.vocab_size(model))


def batch(step: int, vocab: int) -> torch.Tensor:
    """The global batch of training step `step` (the data position is the step)."""
    return torch.randint(
        0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step)
    )


def logits_of(run: Run, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits (a DTensor when the head is vocabulary-parallel)."""
    out = run.model(ids)
    return out.logits if hasattr(out, "logits") else out


def step(run: Run, s: int) -> float:
    """One AdamW step on batch `s`; the loss on the global batch."""
    ids = batch(s, run.vocab)
    dp = run.mesh["dp"] if run.mesh.ndim > 1 else None
    if dp is not None:
        per = BATCH // dp.size()
        ids = ids[dp.get_local_rank() * per : (dp.get_local_rank() + 1) * per]
    ctx = loss_parallel() if run.applied.compiled.loss_parallel else contextlib.nullcontext()
    with ctx:
        logits = logits_of(run, ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    run.opt.step()
    run.opt.zero_grad()
    value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
    if dp is not None:  # equal parts: the global mean is the mean of the parts
        dist.all_reduce(value, group=dp.get_group())
        value /= dp.size()
    return value.item()


def full_state(run: Run) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor gathered to full, packed parts in the model's order (a
    collective)."""
    out = {}
    for name, p in run.model.named_parameters():
        out[name] = run.applied.full(name, p.detach()).clone()
        for key, value in run.opt.state[p].items():
            out[f"{name}/{key}"] = (
                run.applied.full(name, value).clone() if value.dim() else value.clone()
            )
    return out


def tied_once(run: Run) -> bool:
    """Tied weights are still one parameter with one optimizer state."""
    params = list(run.model.parameters())  # unique
    tied = (
        not hasattr(run.model, "lm_head")
        or not hasattr(run.model, "transformer")
        or run.model.lm_head.weight is run.model.transformer.wte.weight
    )
    return tied and len(run.opt.state) == len(params)
