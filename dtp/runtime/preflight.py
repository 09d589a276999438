"""Before any rank starts: the one pre-flight of every command that starts ranks (`prepare`), the
one launch of what it prepared (`launch`: local ranks or torchrun's), what the ranks take from it
(`trusted`), and the estimates of whether the world fits this machine and its memory.

`prepare(job)` refuses, with one paragraph each (exit 2), whatever can be known before a process
starts: the world (torchrun's or this machine's), the device, the plan (its text parsed and checked
against the model at the job's tp), the model's vocabulary, how it is called and its pretrained
weights. The ranks receive the job with its plan parsed as it was checked, and `trusted` matches
that plan to the rank's model without checking it again.

The estimate is deliberately simple and stated in the message: rank 0 builds the whole model (P
bytes) and scatters the shards (dtp.runtime.build), every rank holds its shards, their gradients and
momentum; rank 0 also keeps the unsharded references — one in float64, the truth, and one in the
run's dtype — each with parameters, gradients and momentum, and runs both on the whole batch; a
bfloat16 run adds float32 master weights and momentum across the ranks; activations follow the
Megatron-SP paper's per-layer count (Korthikanti et al., 2022: 34·s·b·h + 5·a·s²·b bytes at 16 bits,
i.e. 17·s·b·h + 2.5·a·s²·b elements) plus the logits and their gradient.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from dtp import models
from dtp.checks.checker import Checked, check, render_warnings, sequence_shape_problem
from dtp.errors import PlanError, RunError, UsageError
from dtp.lang import ir
from dtp.lang.parse import parse
from dtp.layout.resolve import resolve
from dtp.layout.trace import TRACES
from dtp.models.calling import Forward
from dtp.runtime.job import Job
from dtp.runtime.launcher import error_summary, launch_local
from dtp.runtime.torchrun import rendezvous_note, torchrun_group, torchrun_world


@dataclass(frozen=True)
class Prepared:
    """A job that passed the pre-flight, and what the pre-flight learnt (`launch` runs it)."""

    job: Job  # its device decided: cpu or cuda
    checked: Checked  # the job's plan text, checked against the model at job.tp (and job.dp)
    source: models.ModelSource
    meta: nn.Module  # the model, its parameters on the meta device
    vocab: int
    forward: Forward  # how the model gives every position's logits (dtp.models.calling)
    world: int | None  # torchrun's WORLD_SIZE; None: local ranks, started by this process

    @property
    def device(self) -> str:
        """cpu or cuda."""
        return self.job.device

    @property
    def reports(self) -> bool:
        """Whether this process reports the outcome: a local run's parent, or torchrun's rank 0."""
        return self.world is None or os.environ.get("RANK") == "0"


def prepare(
    job: Job, *, weights: bool = True, source: models.ModelSource | None = None
) -> Prepared:
    """Everything that can refuse `job` before any rank starts, one paragraph each (exit 2): the
    world, the device, the plan's text parsed and checked against the model at job.tp, the sequence,
    the vocabulary, how the model is called, and its pretrained weights (`weights`: the ranks will
    read them). `source`: the model already resolved, where the job names one that no MODEL
    argument spells (the benchmark's GPT of given sizes). Plan warnings go to stderr. The memory
    estimates are the command's own: what a rank holds differs between commands."""
    # None: not launched by torchrun (a stray variable is ignored, with a warning)
    world = torchrun_world()
    if world is not None and os.environ.get("RANK") == "0":
        note = rendezvous_note()  # the first line: a store that listens beyond this machine
        if note:
            print(note, file=sys.stderr, flush=True)
    ranks = job.tp * job.dp
    if world is not None and ranks != world:
        raise UsageError(
            f"--tp {job.tp} × --dp {job.dp} = {ranks} ranks, but torchrun started "
            f"WORLD_SIZE={world}"
        )
    device = pick_device(job.device, 1 if world else ranks)
    if world is None:
        check_world(ranks, device)
        if device == "cuda" and ranks > cuda_device_count():
            raise UsageError(
                f"tp={job.tp} × dp={job.dp} needs {ranks} GPUs; this machine has "
                f"{cuda_device_count()}. Use --device cpu, or torchrun across machines"
            )
    plan = parse(job.plan_text, job.plan)  # messages name the plan as the user named it
    cwd = os.getcwd()
    try:
        source = source or models.resolve(job.model)
        meta = models.build(source, device="meta")
        if weights and source.pretrained is not None:  # a missing or mis-shaped tensor
            models.check_weights(meta, source.pretrained)
    finally:
        os.chdir(cwd)  # ranks start where the user started dtp, whatever a model factory did
    block = getattr(getattr(meta, "config", None), "block_size", None)
    if isinstance(block, int) and job.seq > block:
        raise UsageError(f"--seq {job.seq} exceeds the model's block_size {block}")
    vocab = model_vocab(meta, job.model)
    forward = TRACES.calling(meta, job.model)  # how to call it for every position's logits
    checked = check(plan, meta, job.tp, job.dp)
    sys.stderr.write(render_warnings(checked))
    problem = sequence_shape_problem(checked, job.tp, job.seq)
    if problem:
        raise UsageError(problem)
    job = replace(job, device=device, parsed=plan)  # the ranks run this plan, as checked
    return Prepared(job, checked, source, meta, vocab, forward, world)


def launch(
    prepared: Prepared, rank_fn, *args, prefix: str = "dtp-", threads: int | None = None
) -> list:
    """Run `rank_fn(rank, world, prepared.job, *args)` on every rank of a prepared job; what each
    returned, in rank order. Not under torchrun: tp × dp local ranks (`launch_local`). Under
    torchrun: this process as its rank of torchrun's world (torchrun's rendezvous), the results
    gathered to every rank. A failing rank is a RunError either way (one paragraph: the rank, where,
    what it raised). The ranks receive the job with the plan `prepare` parsed and checked: what runs
    is what was checked, whatever happens to the file."""
    job = prepared.job
    if job.parsed is not prepared.checked.plan or job.tp != prepared.checked.tp:
        raise AssertionError("launch: the job's plan or tp is not the one its pre-flight checked")
    if prepared.world is None:
        return launch_local(
            rank_fn,
            job.tp * job.dp,
            job,
            *args,
            timeout=job.timeout,
            device=job.device,
            prefix=prefix,
            threads=threads,
        )
    with torchrun_group(job.device, job.timeout) as rank:
        try:
            mine = rank_fn(rank, prepared.world, job, *args)
        except Exception as err:  # noqa: BLE001 - one paragraph per failing rank, as for local ranks
            e = error_summary(err, rank)
            raise RunError(
                f"the run failed on rank {rank} in {e['where']}: {e['error']}",
                rank,
                e["where"],
                e["error"],
            ) from None
        gathered: list = [None] * prepared.world
        dist.all_gather_object(gathered, mine)
    return gathered


def model_vocab(model: nn.Module, name: str) -> int:
    """The vocabulary size of `model` (named `name` in the message), which every command feeds token
    ids."""
    vocab = models.vocab_size(model)
    if vocab is None:
        raise UsageError(
            f"model {name} has no nn.Embedding and no config.vocab_size: dtp feeds it token ids, so "
            ""
            "it must know the vocabulary size"
        )
    return vocab


def trusted(plan: ir.Plan, model: nn.Module, tp: int) -> Checked:
    """On a rank: `plan` (the job's text, parsed) matched against this rank's `model` and taken as
    checked. The parent's `prepare` checked the same text against the same model at the same tp, so
    the rules do not run again; only the matching the compiler reads (`resolve`) is redone, for this
    rank's model."""
    res = resolve(plan, model, tp)
    if res.diagnostics:  # only a plan that never went through `prepare` gets here
        raise PlanError(res.diagnostics, plan.source)
    return Checked(plan=plan, resolution=res, tp=tp, admissible_tp=(tp,))


_LAYER_KEYS = ("n_layer", "num_hidden_layers", "n_layers", "num_layers")
_HIDDEN_KEYS = ("n_embd", "hidden_size", "dim", "d_model")
_HEAD_KEYS = ("n_head", "num_attention_heads", "n_heads", "num_heads")


def max_cpu_world() -> int:
    """The most local CPU ranks dtp will start: 4 per core (at least 8)."""
    return max(4 * (os.cpu_count() or 1), 8)


def check_world(world: int, device: str) -> None:
    """Refuse a local world this machine cannot host (each rank is a process with its own torch)."""
    if device == "cpu" and world > max_cpu_world():
        raise UsageError(
            f"tp × dp = {world} ranks is far more than this machine's {os.cpu_count()} cores can "
            "host "
            f"(at most {max_cpu_world()} local CPU ranks); use a smaller --tp/--dp, or torchrun on "
            "more machines"
        )


def available_bytes() -> int | None:
    """Memory this process may still use: MemAvailable, bounded by a cgroup (v2) limit if there is
    one."""
    avail = None
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max", encoding="ascii").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current", encoding="ascii").read())
        if limit != "max":
            room = int(limit) - used
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def _config_int(model, keys: tuple[str, ...]) -> int | None:
    config = getattr(model, "config", None)
    return next(
        (getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None
    )


def activation_elements(model, batch: int, seq: int, vocab: int | None, tp: int = 1) -> int:
    """Elements one forward+backward saves for `batch` × `seq` tokens on a rank of a tp group: per
    layer 5·s·b·h replicated and 12·s·b·h + 2.5·a·s²·b split over tp (Korthikanti et al.; tp 1:
    17·s·b·h + 2.5·a·s²·b), plus the logits and their gradient (3·b·s·V, split over tp)."""
    layers, hidden = _config_int(model, _LAYER_KEYS), _config_int(model, _HIDDEN_KEYS)
    heads = _config_int(model, _HEAD_KEYS) or 1
    acts = 0
    if layers and hidden:
        acts = layers * (
            5 * seq * batch * hidden
            + (12 * seq * batch * hidden + (5 * heads * seq * seq * batch) // 2) // tp
        )
    return acts + 3 * batch * seq * (vocab or 0) // tp


@dataclass(frozen=True)
class Estimate:
    """Bytes the whole local run needs, and its parts."""

    params: int  # P: the unsharded model's parameters
    activations: int  # one forward+backward of the whole batch on the unsharded model
    total: int


def estimate(
    model, tp: int, dp: int, batch: int, seq: int, elem: int, vocab: int | None
) -> Estimate:
    """Memory for `dtp apply` on one machine, all ranks together (`model` may live on the meta
    device)."""
    params = sum(p.numel() for p in model.parameters()) * elem
    acts = activation_elements(model, batch, seq, vocab) * elem
    world = tp * dp
    # Rank 0: the whole model it scatters from; every rank: its shards + their gradients and
    # momentum (≈ 3·P/tp/dp) and its share of the activations; rank 0: the float64 and same-dtype
    # references (3 copies each) and their activations on the whole batch; bfloat16: float32 master
    # weights and momentum, split.
    elements = params // elem
    references = 3 * elements * 8 + 3 * params + acts * 8 // elem + acts
    masters = 2 * elements * 4 if elem < 4 else 0
    total = params + world * (3 * params // world + acts // world) + references + masters
    return Estimate(params, acts, total)


def check_memory(est: Estimate, device: str) -> None:
    """Refuse a CPU run whose estimate exceeds the memory available (a CUDA run is bounded by its
    GPUs)."""
    avail = available_bytes() if device == "cpu" else None
    if avail is not None and est.total > avail:
        raise UsageError(
            f"this run needs about {_gib(est.total)} of memory (parameters {_gib(est.params)}, "
            f"activations {_gib(est.activations)}, for every rank plus the unsharded references) "
            "but "
            f"{_gib(avail)} is available; use a smaller model, --batch or --seq, or run on more "
            "machines with torchrun"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def pick_device(requested: str, world: int) -> str:
    """`auto` is CUDA only when this machine has a GPU for every local rank, else CPU."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available on this machine")
    return requested


def cuda_device_count() -> int:
    """GPUs visible to this process."""
    return torch.cuda.device_count()
